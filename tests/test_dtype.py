"""
--dtype: auto's choice (bf16 on CUDA, and on a CPU with bf16 units for a model whose matmuls are
large enough to gain; fp32 elsewhere), said on the start line with its reason; a one-line warning
for bf16 on a CPU without bf16 units; a bf16 run's weights and AdamW state in fp32; the engine's
packed Linears in bf16 and its keys kept in fp32; resume's check of the dtype.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chat_rl
from engine import Engine
from fast import packed_linear
from plumbing import checkpoint, distributed, flags
from plumbing.checkpoint import load_policy
from policy.gpt import GPTConfig
from scripts.bench_rl_step import SHAPES
from tasks import arith
from tasks.common import conversation

# SmolLM2-135M's shape: its gate/up weight, 3072 x 576, is worth bf16
SMOLLM2 = GPTConfig(**SHAPES["smollm2-135m"])
DEMO = GPTConfig()  # the demo model's: 768 x 128, too small to gain


@pytest.fixture
def bf16_units(monkeypatch):
    """Set whether this CPU has bf16 units, for every module that asks."""

    def set_units(present):
        for module in (distributed, checkpoint, flags):
            monkeypatch.setattr(module, "cpu_bf16_units", lambda: present)

    return set_units


@pytest.mark.parametrize(
    "device,units,config,expected",
    [
        ("cuda", False, DEMO, ("bf16", "auto: CUDA")),
        ("cpu", False, SMOLLM2, ("fp32", "auto: this CPU has no bf16 units")),
        ("cpu", True, SMOLLM2, ("bf16", "auto: this CPU has bf16 units")),
        ("cpu", True, DEMO, ("fp32", "auto: the model's matmuls are too small for bf16 to pay")),
        ("mps", True, SMOLLM2, ("fp32", "auto: mps")),
    ],
)
def test_auto_takes_bf16_where_the_hardware_has_it_and_the_model_gains(
    bf16_units, device, units, config, expected
):
    bf16_units(units)
    assert distributed.dtype_choice(device, "auto", config) == expected
    for given in ("fp32", "bf16"):  # a choice given is kept, whatever the hardware
        assert distributed.dtype_choice(device, given, config) == (given, "as given")


def test_the_threshold_sits_between_the_demo_and_smollm2():
    assert not distributed.bf16_pays(DEMO) and distributed.bf16_pays(SMOLLM2)


def one_step(tmp_path, *flags_given):
    out = tmp_path / "run"
    argv = ["--preset=demo", f"--out-dir={out}", "--num-steps=1", "--eval-every=-1"]
    argv += ["--examples-per-step=4", "--num-samples=4", "--max-new-tokens=64", *flags_given]
    assert chat_rl.main(argv) == 0
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize(
    "units,said",
    [
        (True, "dtype=fp32 (auto: the model's matmuls are too small for bf16 to pay)"),
        (False, "dtype=fp32 (auto: this CPU has no bf16 units)"),
    ],
)
def test_the_start_line_says_which_dtype_and_why(bf16_units, units, said, tmp_path, capsys):
    bf16_units(units)
    one_step(tmp_path)
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("chat_rl: task=arith") and f" {said} " in first


def test_bf16_on_a_cpu_without_bf16_units_warns_in_one_line(bf16_units, tmp_path, capsys):
    bf16_units(False)
    rows = one_step(tmp_path, "--dtype=bf16")
    lines = capsys.readouterr().out.splitlines()
    warned = [line for line in lines if "warning" in line]
    assert warned == [
        "chat_rl: warning: --dtype=bf16 on a CPU without bf16 units (AVX512-BF16 or AMX): "
        "torch emulates its matmuls, several times slower than --dtype=fp32"
    ]
    assert " dtype=bf16 (as given) " in lines[1]  # and it runs as asked
    assert rows[0]["skipped_nonfinite"] == 0


def test_a_bf16_run_keeps_weights_and_adamw_state_in_fp32(tmp_path, monkeypatch):
    seen = []
    step = chat_rl.optimizer_step

    def spy(model, optimizer, *args):
        result = step(model, optimizer, *args)
        seen.append({p.dtype for p in model.parameters()})
        seen.append({v.dtype for s in optimizer.state.values() for v in s.values() if v.dim()})
        return result

    monkeypatch.setattr(chat_rl, "optimizer_step", spy)
    rows = one_step(tmp_path, "--dtype=bf16")
    assert seen == [{torch.float32}, {torch.float32}]
    assert rows[0]["kept_tokens"] > 0 and rows[0]["skipped_nonfinite"] == 0
    assert rows[0]["mismatch_k3"] > 0  # sampled in bf16: the sampler and the trainer part a little


@pytest.mark.skipif(not packed_linear.X86, reason="oneDNN's packed matmul: x86 CPUs")
def test_under_bf16_autocast_a_packed_linear_is_the_autocast_linear_in_bf16(monkeypatch):
    monkeypatch.setattr(packed_linear, "MIN_WEIGHT", 0)
    torch.manual_seed(0)
    linear, x = nn.Linear(64, 96), torch.randn(5, 64)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert packed_linear.pack_dtype(linear.weight) == torch.bfloat16
        expected = F.linear(x, linear.weight, linear.bias)
        with packed_linear.packed_linears(linear, rows=5):
            assert "forward" in vars(linear)  # packed
            packed = linear(x)
    assert packed.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(packed.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert packed_linear.pack_dtype(linear.weight) == torch.float32  # outside autocast: fp32
    with torch.autocast("cpu", dtype=torch.float16):  # a dtype oneDNN's packing is not used for
        assert packed_linear.pack_dtype(linear.weight) is None


def test_under_bf16_the_kv_cache_keeps_its_keys_in_fp32_and_its_values_in_bf16():
    model, tokenizer = load_policy("demo_model", "cpu")
    prompts = [tokenizer.render_for_completion(conversation(arith, arith.load("test", 1)[0]))]
    engine = Engine(model.eval(), tokenizer)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _, cache = engine.prefill(prompts, 2, 4)
    assert {k.dtype for k in cache.prompt_k + cache.k} == {torch.float32}
    assert {v.dtype for v in cache.prompt_v + cache.v} == {torch.bfloat16}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_under_bf16_on_a_cpu_a_decode_pass_of_few_rows_runs_on_one_thread(monkeypatch, bf16):
    # bf16: a decode pass of at most BF16_ONE_THREAD_ROWS running rows on one thread, more rows and
    # the prefill on the threads the call began with; fp32 always on those; given back after it
    monkeypatch.setattr(packed_linear, "BF16_ONE_THREAD_ROWS", 5)
    model, tokenizer = load_policy("demo_model", "cpu")
    prompts = [tokenizer.render_for_completion(conversation(arith, arith.load("test", 1)[0]))]
    passes = []  # (rows, positions, threads) of each forward pass of the call
    model.register_forward_pre_hook(
        lambda _, args: passes.append((*args[0].shape, torch.get_num_threads()))
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            Engine(model.eval(), tokenizer).generate(prompts, 8, 40, 1.0, seed=1)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    prefill, decode = passes[0], passes[1:]
    assert prefill[2] == 2 and after == 2
    # the 8 rows finished at different positions: passes of more and of fewer than 5 rows
    assert {rows > 5 for rows, _, _ in decode} == {True, False}
    for rows, _, threads in decode:
        assert threads == (1 if bf16 and rows <= 5 else 2), (rows, threads)


def test_resume_refuses_a_checkpoint_of_another_dtype(tmp_path, capsys):
    one_step(tmp_path, "--dtype=bf16", "--save-every=1")
    argv = ["--preset=demo", f"--out-dir={tmp_path / 'run'}", "--num-steps=1", "--eval-every=-1"]
    argv += ["--examples-per-step=4", "--num-samples=4", "--max-new-tokens=64", "--resume"]
    capsys.readouterr()
    assert chat_rl.main([*argv, "--dtype=fp32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "different settings: dtype ('bf16' -> 'fp32')" in err[0]
