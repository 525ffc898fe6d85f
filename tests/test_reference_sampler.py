"""The Engine held to generate_reference, its plain oracle: the same seed gives the same tokens,
masks, calls and refusals, with and without the calculator, greedy and sampled, with top-k, and
with rows that stop at different positions and leave the batch. (Both read the same logits up to
the last bit, the cache's and the batch's rounding: a draw could differ only where u lands that
close to a boundary between two tokens.)"""

import itertools
from collections import Counter

import pytest
import torch

from calculator import calculate
from engine import CALL, Engine, generate_reference, sample_reference
from fast.sampling import sample_next_token
from fast.tool_calls import OUT, _run
from plumbing.checkpoint import load_policy
from policy.gpt import GPT, GPTConfig
from policy.tokenizer import ByteTokenizer
from tasks import arith
from tasks.common import conversation


def engine_and_reference(model, tokenizer, prompts, tool=None, compact_at=0.125, **kw):
    """The same arguments to Engine(...).generate and to generate_reference:
    (fast, plain) Samples."""
    fast = Engine(model, tokenizer, compact_at=compact_at, tool=tool).generate(prompts, **kw)
    return fast, generate_reference(model, tokenizer, prompts, tool=tool, **kw)


def first_difference(fast, plain):
    """Where two Samples part: the field, the row and the token, for the failure message."""
    for field, a, b in zip(fast._fields, fast, plain):
        for row, (x, y) in enumerate(zip(a, b)):
            if x != y:
                if not isinstance(x, list):
                    return f"{field}[{row}]: engine {x}, reference {y}"
                at = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                x_at, y_at = x[at : at + 6], y[at : at + 6]
                return f"{field}[{row}] from index {at}: engine {x_at}, reference {y_at}"
    return "no difference"


def assert_same(fast, plain):
    """Tokens, masks, calls and refusals to the bit; the log-probs the sampler drew with within
    fp32's rounding (the engine reads them off its softmax, the reference off a log-softmax)."""
    assert fast[:4] == plain[:4], first_difference(fast, plain)
    assert len(fast.logprobs) == len(plain.logprobs)
    for a, b in zip(fast.logprobs, plain.logprobs):
        assert a == pytest.approx(b, abs=1e-4)


# ---- fixtures: the demo policy on arith problems, and a tiny random model ------------------------


@pytest.fixture(scope="module")
def demo():
    """The demo policy, its byte tokenizer, and three arith prompts of different lengths."""
    model, tokenizer = load_policy("demo_model", "cpu")
    prompts = [
        tokenizer.render_for_completion(conversation(arith, row))
        for row in arith.load("test", limit=3)
    ]
    assert len({len(p) for p in prompts}) == 3
    return model.eval(), tokenizer, prompts


@pytest.fixture
def opens_a_call(demo):
    """The demo policy made to answer with '<' first (1000 on its logit after
    <|assistant_start|>, a rule on the input alone, so the cached and the plain forward passes
    get it alike): it then goes on in its calculator style, `<<2*25=50>>`, greedy or sampled."""
    model, tokenizer, _ = demo
    start = tokenizer.special["<|assistant_start|>"]

    def hook(module, args, kwargs, logits):
        idx = args[0] if args else kwargs["idx"]
        logits[..., ord("<")] += 1000.0 * (idx[:, -logits.size(1) :] == start)
        return logits

    handle = model.register_forward_hook(hook, with_kwargs=True)
    yield demo
    handle.remove()


def refuse_25(expression):
    """The calculator, but refusing any expression with a 25 in it
    (the demo's first step on problem 0 is 2*25)."""
    return None if "25" in expression else calculate(expression)


class NoStopTokenizer(ByteTokenizer):
    def __init__(self, stop_tokens=()):
        super().__init__()
        self.stop_tokens = set(stop_tokens)


RANDOM_PROMPTS = [[256, 72, 105, 33], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [256, 50]]


@pytest.fixture(scope="module")
def random_model():
    """A tiny GPT with wide random weights, and a byte tokenizer whose stop token is the one it
    samples most at temperature 0.7: its rows stop early, at many different positions."""
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=264,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = GPT(config).init_weights(3).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.15)
    free = Engine(model, NoStopTokenizer()).generate(RANDOM_PROMPTS, 4, 30, temperature=0.7, seed=2)
    generated = Counter(
        t for s, m in zip(free.sequences, free.masks) for t, sampled in zip(s, m) if sampled
    )
    return model, NoStopTokenizer([generated.most_common(1)[0][0]])


# ---- the two rules the reference states plainly --------------------------------------------------


def test_the_reference_call_rule_fires_exactly_where_the_automaton_does():
    # every text of up to 7 characters over the ones that matter to a call,
    # read character by character
    for n in range(1, 8):
        for chars in itertools.product("<=>\na", repeat=n):
            text = "".join(chars)
            fires = _run(text, OUT)[1]
            assert fires == bool(CALL.search(text)), repr(text)


def interval_midpoints(logits, temperature, top_k):
    """(rows, tokens, u): for each row of logits (B, V) and each token whose interval of the
    exact inverse CDF (float64, vocabulary order, top-k ties kept) holds at least 1e-3 of the
    total, u at the interval's middle, where float32 rounding of either sampler cannot carry an
    end of the interval past it."""
    scaled = logits.double() / temperature
    if top_k:
        scaled = scaled.masked_fill(
            scaled < torch.topk(scaled, top_k, dim=-1).values[:, -1:], float("-inf")
        )
    probs = torch.softmax(scaled, dim=-1)
    rows, tokens = (probs >= 1e-3).nonzero(as_tuple=True)
    u = (probs.cumsum(dim=-1) - probs / 2)[rows, tokens]
    return rows, tokens, u.float()


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("top_k", [None, 5])
def test_the_engine_sampler_and_the_reference_sampler_draw_the_token_whose_interval_holds_u(
    temperature, top_k
):
    # 600 entries: more than two blocks of the engine's two-level inverse CDF; rows 0-3 tied at
    # their 5th largest, which sends them down the engine's other top-k path
    logits = torch.randn(16, 600, generator=torch.Generator().manual_seed(0)) * 3
    for row in range(4):
        ranked = torch.topk(logits[row], 6).indices
        logits[row, ranked[5]] = logits[row, ranked[4]]
    rows, tokens, u = interval_midpoints(logits, temperature, top_k)
    if top_k:  # every kept token is tested: the 6 of a tied row, the 5 of the others
        assert torch.bincount(rows).tolist() == [6] * 4 + [5] * 12
    assert torch.equal(sample_next_token(logits[rows], u, temperature, top_k), tokens)
    assert torch.equal(sample_reference(logits[rows], u, temperature, top_k), tokens)


def test_at_temperature_0_both_samplers_take_the_argmax():
    logits = torch.randn(16, 600, generator=torch.Generator().manual_seed(1))
    u = torch.rand(16)
    for top_k in (None, 5):
        assert torch.equal(sample_next_token(logits, u, 0.0, top_k), logits.argmax(dim=-1))
        assert torch.equal(sample_reference(logits, u, 0.0, top_k), logits.argmax(dim=-1))


# ---- the engine against the reference ------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_without_the_calculator_the_engine_samples_what_the_reference_samples(demo, temperature):
    model, tokenizer, prompts = demo
    fast, plain = engine_and_reference(
        model,
        tokenizer,
        prompts,
        num_samples=4,
        max_new_tokens=64,
        temperature=temperature,
        seed=0,
        include_stop=True,
    )
    assert_same(fast, plain)
    assert all(
        seq[-1] in tokenizer.stop_tokens for seq in fast.sequences
    )  # each row stopped, its stop token kept


def test_with_top_k_the_engine_samples_what_the_reference_samples(demo):
    model, tokenizer, prompts = demo
    fast, plain = engine_and_reference(
        model,
        tokenizer,
        prompts,
        num_samples=4,
        max_new_tokens=64,
        temperature=0.7,
        top_k=5,
        seed=1,
    )
    assert_same(fast, plain)
    assert len({tuple(s) for s in fast.sequences}) > len(
        prompts
    )  # the samples of a prompt do differ


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (0.7, None), (0.7, 5)])
@pytest.mark.parametrize("compact_at", [0.0, 0.5])
def test_rows_compacted_out_of_the_batch_leave_every_row_as_the_reference_samples_it(
    random_model, compact_at, temperature, top_k, include_stop
):
    # compact_at=0: the engine drops a finished row from its batch and KV cache at the first
    # position it can; 0.5: half the batch at once, finished rows at its front and at its back,
    # so that running ones move
    model, tokenizer = random_model
    fast, plain = engine_and_reference(
        model,
        tokenizer,
        RANDOM_PROMPTS,
        compact_at=compact_at,
        num_samples=4,
        max_new_tokens=30,
        temperature=temperature,
        top_k=top_k,
        seed=2,
        include_stop=include_stop,
    )
    assert_same(fast, plain)
    stopped_at = {sum(m) for m in fast.masks if sum(m) < 30}
    assert len(stopped_at) >= 2, (
        stopped_at
    )  # rows stopped, at different positions: there was compacting to do


def test_calls_the_policy_makes_on_its_own_are_answered_as_the_reference_answers_them(demo):
    # at temperature 0.7 a few of the demo's samples call the calculator, the others do not
    model, tokenizer, prompts = demo
    fast, plain = engine_and_reference(
        model,
        tokenizer,
        prompts,
        tool=calculate,
        compact_at=0.0,
        num_samples=8,
        max_new_tokens=64,
        temperature=0.7,
        seed=0,
        include_stop=True,
    )
    assert_same(fast, plain)
    assert 0 < sum(c > 0 for c in fast.tool_calls) < len(fast.tool_calls)
    assert any(
        0 in m[len(prompts[i // 8]) :] for i, m in enumerate(fast.masks)
    )  # results were forced, mask 0


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_every_row_calling_the_calculator_gets_the_reference_results(opens_a_call, temperature):
    model, tokenizer, prompts = opens_a_call
    fast, plain = engine_and_reference(
        model,
        tokenizer,
        prompts,
        tool=calculate,
        num_samples=3,
        max_new_tokens=64,
        temperature=temperature,
        top_k=5,
        seed=0,
    )
    assert_same(fast, plain)
    assert all(c >= 2 for c in fast.tool_calls) and sum(fast.tool_errors) == 0


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_refused_call_forces_nothing_and_is_counted_as_the_reference_counts_it(
    opens_a_call, temperature
):
    model, tokenizer, prompts = opens_a_call
    fast, plain = engine_and_reference(
        model,
        tokenizer,
        prompts,
        tool=refuse_25,
        compact_at=0.0,
        num_samples=3,
        max_new_tokens=64,
        temperature=temperature,
        seed=0,
        include_stop=True,
    )
    assert_same(fast, plain)
    assert (
        all(e > 0 for e in fast.tool_errors[:3]) and sum(fast.tool_errors[3:]) == 0
    )  # problem 0's rows: 2*25
    assert all(
        c > e for c, e in zip(fast.tool_calls[3:], fast.tool_errors[3:])
    )  # the others answered


def test_a_result_cut_off_by_max_new_tokens_is_cut_alike(opens_a_call):
    # `<<2*25=` is 7 tokens: a budget of 8 leaves room for one forced token of `50>>`, masked 0
    model, tokenizer, prompts = opens_a_call
    fast, plain = engine_and_reference(
        model,
        tokenizer,
        prompts[:1],
        tool=calculate,
        num_samples=2,
        max_new_tokens=8,
        temperature=0.0,
        seed=0,
    )
    assert_same(fast, plain)
    assert [tokenizer.decode(s[len(prompts[0]) :]) for s in fast.sequences] == ["<<2*25=5"] * 2
    assert [m[-2:] for m in fast.masks] == [[1, 0]] * 2


@pytest.mark.parametrize("sampler", [sample_reference, sample_next_token])
def test_greedy_log_probs_are_on_the_logits_device(sampler):
    # the meta device stands in for a GPU: a CPU tensor here would be a host copy per call there
    logits, u = torch.randn(2, 5, device="meta"), torch.rand(2, device="meta")
    token, logp = sampler(logits, u, 0.0, None, logprobs=True)
    assert token.device == logp.device == logits.device
