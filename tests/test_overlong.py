"""--overlong-buffer, DAPO's soft overlong punishment: a reward term that is 0 for a reply of at
most L - N tokens and falls linearly to -1 at L = --max-new-tokens, written out here and held to
chat_rl.overlong_penalty and to what chat_rl.rollout adds to each total."""

import pytest

import chat_rl
from calculator import calculate
from engine import Engine
from fast.logprobs import sampled_tokens
from plumbing import checkpoint
from tasks import arith

# 40 tokens, the last 8 the buffer: the demo model's replies at seed 0 land below it, on its
# edge, inside it and at the budget; eighths are exact in binary, so totals compare exactly
NUM_SAMPLES, BUDGET, BUFFER, FORMAT_WEIGHT = 8, 40, 8, 0.5


def penalty_written_out(length, L, N):
    """DAPO's eq. 13 as the brief states it, piece by piece."""
    if N == 0 or length <= L - N:
        return 0.0
    assert length <= L
    return ((L - N) - length) / N


@pytest.mark.parametrize(
    "length,expected",
    [(0, 0.0), (5, 0.0), (6, 0.0), (7, -0.25), (8, -0.5), (9, -0.75), (10, -1.0)],
)
def test_the_penalty_is_0_up_to_L_minus_N_then_falls_linearly_to_minus_1_at_L(length, expected):
    assert chat_rl.overlong_penalty(length, 10, 4) == expected == penalty_written_out(length, 10, 4)


@pytest.mark.parametrize("length", [0, 1, 9, 10])
def test_a_buffer_of_0_is_off(length):
    assert chat_rl.overlong_penalty(length, 10, 0) == 0.0


def test_a_buffer_of_the_whole_budget_charges_every_token():
    assert [chat_rl.overlong_penalty(n, 4, 4) for n in range(5)] == [0.0, -0.25, -0.5, -0.75, -1.0]


@pytest.fixture(scope="module")
def rollouts():
    """The same rollout twice, the buffer off and on, with the calculator: its forced tokens count
    toward the budget, and so toward the length the penalty reads."""
    model, tokenizer = checkpoint.load_policy("demo_model", "cpu")
    engine = Engine(model.eval(), tokenizer, tool=calculate)
    problems = arith.load("test", limit=4)
    common = dict(temperature=1.0, top_k=0, seed=0, format_weight=FORMAT_WEIGHT)
    off = chat_rl.rollout(engine, arith, problems, NUM_SAMPLES, BUDGET, **common)
    on = chat_rl.rollout(
        engine, arith, problems, NUM_SAMPLES, BUDGET, overlong_buffer=BUFFER, **common
    )
    return off, on


def test_off_the_total_is_the_reward_alone(rollouts):
    off, _ = rollouts
    assert off["overlong"] == [0.0] * len(off["total"])
    assert off["total"] == [a + FORMAT_WEIGHT * f for a, f in zip(off["answer"], off["format"])]


def test_the_buffer_changes_no_sample_and_no_other_term(rollouts):
    off, on = rollouts
    for key in ("sequences", "masks", "tokens", "answer", "format", "truncated", "tool_calls"):
        assert on[key] == off[key], key


def test_each_total_gains_the_penalty_of_its_whole_length(rollouts):
    off, on = rollouts
    expected = [penalty_written_out(n, BUDGET, BUFFER) for n in off["tokens"]]
    assert on["overlong"] == expected
    assert on["total"] == [t + p for t, p in zip(off["total"], expected)]
    # the cases the check tells apart: below the buffer, inside it, at the budget
    assert any(n <= BUDGET - BUFFER for n in off["tokens"]), off["tokens"]
    assert any(-1.0 < p < 0.0 for p in expected), off["tokens"]
    assert any(n == BUDGET for n in off["tokens"]), off["tokens"]
    for i, n in enumerate(off["tokens"]):
        if n == BUDGET:  # cut off, or stopped on the budget's last token: the full -1
            assert on["overlong"][i] == -1.0


def test_the_length_counts_the_calculators_tokens_and_the_stop_token(rollouts, tokenizer):
    # the reply's length is what --max-new-tokens bounds: everything after the prompt, tool
    # results and the stop token in it; not the sampled tokens the loss counts
    off, on = rollouts
    for i, (seq, mask) in enumerate(zip(off["sequences"], off["masks"])):
        length = len(seq) - mask.index(1)  # the prompt: every token before the first sampled one
        assert on["overlong"][i] == penalty_written_out(length, BUDGET, BUFFER)
    calls = [
        i
        for i, mask in enumerate(off["masks"])
        if penalty_written_out(sampled_tokens(mask), BUDGET, BUFFER) != on["overlong"][i]
    ]
    assert any(off["tool_calls"][i] for i in calls), "no tool call changed a penalty: untested"
    stopped = [
        i
        for i, seq in enumerate(off["sequences"])
        if seq[-1] in tokenizer.stop_tokens and on["overlong"][i] < 0
    ]
    assert stopped, "no reply stopped inside the buffer: its stop token's count untested"


@pytest.fixture(scope="module")
def tokenizer():
    return checkpoint.load_policy("demo_model", "cpu")[1]


def test_every_training_rollout_pays_it_refill_rounds_too(tmp_path, monkeypatch):
    # --refill's extra rounds are rollouts of their own (plumbing/refill.refill_round): their groups
    # enter the step's advantages beside the first round's, so they carry the same terms, which
    # train_step binds to rollout once (chat_rl.training_rewards)
    outs, rollout = [], chat_rl.rollout

    def recording(*args, **kwargs):
        outs.append(rollout(*args, **kwargs))
        return outs[-1]

    monkeypatch.setattr(chat_rl, "rollout", recording)
    argv = ["--preset=demo", f"--out-dir={tmp_path}", "--num-steps=1", "--eval-every=-1",
            "--examples-per-step=2", "--num-samples=2", f"--max-new-tokens={BUDGET}",
            "--overlong-buffer=20", f"--format-weight={FORMAT_WEIGHT}", "--refill=4"]  # fmt: skip
    assert chat_rl.main(argv) == 0
    assert len(outs) > 1, "no refill round: nothing to see"
    assert any(p < 0 for out in outs[1:] for p in out["overlong"]), "no round paid the term"
    for out in outs:
        expected = [penalty_written_out(n, BUDGET, 20) for n in out["tokens"]]
        assert out["overlong"] == expected
        weighted = [a + FORMAT_WEIGHT * f for a, f in zip(out["answer"], out["format"])]
        assert out["total"] == [w + p for w, p in zip(weighted, expected)]
