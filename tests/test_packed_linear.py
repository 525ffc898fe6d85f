"""fast/packed_linear.py: the engine's large Linears with their weights packed for oneDNN give the
plain Linear's outputs up to fp32 rounding, leave every Linear as it was afterwards, pack only what
pays, and the engine that uses them still samples what the reference sampler samples."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from calculator import calculate
from engine import Engine, generate_reference
from fast import packed_linear
from fast.packed_linear import can_pack, packed_linears
from plumbing.checkpoint import load_policy
from policy import lora
from policy.gpt import GPT, GPTConfig
from tasks import arith
from tasks.common import conversation

pytestmark = pytest.mark.skipif(
    not can_pack(torch.zeros(1)), reason="oneDNN's packed matmul: x86 CPUs"
)


@pytest.fixture
def pack_every_linear(monkeypatch):
    """MIN_WEIGHT 0: the tests' small Linears packed too; returns how many packed matmuls ran."""
    monkeypatch.setattr(packed_linear, "MIN_WEIGHT", 0)
    calls, plain = [0], packed_linear.packed_forward

    def counting(packed, bias, dtype=torch.float32):
        forward = plain(packed, bias, dtype)

        def counted(x):
            calls[0] += 1
            return forward(x)

        return counted

    monkeypatch.setattr(packed_linear, "packed_forward", counting)
    return calls


@pytest.mark.parametrize("shape", [(5, 64), (3, 7, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_gives_the_plain_output_up_to_fp32_rounding(pack_every_linear, shape, bias):
    torch.manual_seed(0)
    linear, x = nn.Linear(64, 96, bias=bias), torch.randn(shape)
    if bias:
        nn.init.normal_(linear.bias, std=10.0)  # large enough that a bias left out would show
    with packed_linears(linear, rows=4):
        packed = linear(x)
    assert pack_every_linear[0] == 1
    plain = F.linear(x, linear.weight, linear.bias)
    assert packed.shape == plain.shape
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)


def test_after_the_block_every_linear_is_as_it_was_even_after_an_error(pack_every_linear):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    before = model(x)
    with pytest.raises(ValueError), packed_linears(model):
        assert all("forward" in vars(m) for m in model)
        raise ValueError
    assert all("forward" not in vars(m) for m in model)
    calls = pack_every_linear[0]
    assert torch.equal(model(x), before) and pack_every_linear[0] == calls


def test_only_large_fp32_weights_are_packed():
    small = nn.Linear(
        128, 384
    )  # the demo model's widest: MKL is as fast, and the demo keeps its numbers
    large = nn.Linear(576, 1536)
    large_bf16 = nn.Linear(576, 1536).to(torch.bfloat16)
    with packed_linears(nn.ModuleList([small, large, large_bf16])):
        packed = [("forward" in vars(m)) for m in (small, large, large_bf16)]
    assert packed == [False, True, False]


def test_lora_adapters_still_add_their_term_to_a_packed_linear(pack_every_linear):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    model = lora.add_adapters(GPT(config).init_weights(0).eval(), 4, 8.0)
    ids = torch.randint(0, 64, (2, 6))
    base = model(ids)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    adapted = model(ids)
    with packed_linears(model):
        packed = model(ids)
    assert pack_every_linear[0] > 0
    assert (adapted - base).abs().max() > 0.1
    torch.testing.assert_close(packed, adapted, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_engine_with_every_linear_packed_samples_what_the_reference_samples(
    pack_every_linear, temperature
):
    # the demo's policy with the calculator: calls, forced results and rows leaving the batch
    model, tokenizer = load_policy("demo_model", "cpu")
    model.eval()
    prompts = [
        tokenizer.render_for_completion(conversation(arith, row))
        for row in arith.load("test", limit=3)
    ]
    kw = dict(num_samples=8, max_new_tokens=64, temperature=temperature, seed=0, include_stop=True)
    fast = Engine(model, tokenizer, compact_at=0.0, tool=calculate).generate(prompts, **kw)
    assert pack_every_linear[0] > 0
    plain = generate_reference(model, tokenizer, prompts, tool=calculate, **kw)
    assert fast[:4] == plain[:4]  # tokens, masks, calls and refusals; the log-probs up to rounding
    for a, b in zip(fast.logprobs, plain.logprobs):
        assert a == pytest.approx(b, abs=1e-4)
    assert temperature == 0.0 or sum(fast.tool_calls) > 0  # sampled, some rows call the calculator
