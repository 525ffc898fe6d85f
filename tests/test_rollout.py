"""chat_rl.rollout on the demo model: which tokens a completion trains, when it counts as cut off,
and that each completion is scored against its own problem."""

import pytest

import chat_rl
from engine import Engine
from plumbing import checkpoint
from tasks import arith
from tasks.common import conversation

NUM_SAMPLES, BUDGET, FORMAT_WEIGHT = (
    4,
    30,
    0.5,
)  # 30 tokens: some of the demo's answers fit, some do not


@pytest.fixture(scope="module")
def problems():
    rows = arith.load("test", limit=3)
    assert (
        len({arith.reference(r) for r in rows}) == 3
    )  # distinct answers: a reward checked against another problem shows
    return rows


@pytest.fixture(scope="module")
def rollout(problems):
    model, tokenizer = checkpoint.load_policy("demo_model", "cpu")
    engine = Engine(model.eval(), tokenizer)
    out = chat_rl.rollout(
        engine,
        arith,
        problems,
        NUM_SAMPLES,
        BUDGET,
        temperature=1.0,
        top_k=0,
        seed=0,
        format_weight=FORMAT_WEIGHT,
    )
    return out, tokenizer


def sampled(out, i):
    """Completion i's tokens with mask 1: what the loss trains."""
    return [t for t, m in zip(out["sequences"][i], out["masks"][i]) if m]


def test_each_sequence_is_its_problems_prompt_then_the_sampled_tokens(rollout, problems):
    out, tokenizer = rollout
    assert len(out["sequences"]) == len(problems) * NUM_SAMPLES
    for i, (seq, mask) in enumerate(zip(out["sequences"], out["masks"])):
        prompt = tokenizer.render_for_completion(conversation(arith, problems[i // NUM_SAMPLES]))
        assert seq[: len(prompt)] == prompt and mask == [0] * len(prompt) + [1] * (
            len(seq) - len(prompt)
        )
        assert out["tokens"][i] == len(sampled(out, i)) <= BUDGET


def test_a_completion_that_stopped_trains_its_stop_token_and_is_not_truncated(rollout):
    out, tokenizer = rollout
    stopped = [i for i in range(len(out["sequences"])) if len(sampled(out, i)) < BUDGET]
    assert stopped, "every completion ran the whole budget: nothing to check"
    for i in stopped:
        tokens = sampled(out, i)
        assert (
            tokens[-1] in tokenizer.stop_tokens
        )  # ending the answer is trained like any other choice
        assert not set(tokens[:-1]) & tokenizer.stop_tokens
        assert not out["truncated"][i]


def test_a_completion_that_ran_the_whole_budget_is_truncated_unless_its_last_token_stopped_it(
    rollout,
):
    out, tokenizer = rollout
    full = [i for i in range(len(out["sequences"])) if len(sampled(out, i)) == BUDGET]
    assert any(out["truncated"][i] for i in full), "no completion was cut off: nothing to check"
    for i in full:
        tokens = sampled(out, i)
        assert not set(tokens[:-1]) & tokenizer.stop_tokens
        assert out["truncated"][i] == (tokens[-1] not in tokenizer.stop_tokens)
        assert (
            out["answer"][i] == 0.0 or not out["truncated"][i]
        )  # a cut-off answer has no final answer line


def test_each_completion_is_scored_against_its_own_problem(rollout, problems):
    out, tokenizer = rollout
    for i, text in enumerate(out["completions"]):
        assert text == tokenizer.decode(sampled(out, i))
        reference = arith.reference(problems[i // NUM_SAMPLES])
        assert out["answer"][i] == float(arith.grade(text, reference))
        assert out["format"][i] == float(arith.format_ok(text))
        assert out["total"][i] == out["answer"][i] + FORMAT_WEIGHT * out["format"][i]
    assert (
        0 < sum(out["answer"]) < len(out["answer"])
    )  # right and wrong answers both: the check had something to tell apart
    assert 0 < sum(out["format"])


def test_the_forks_stand_in_for_a_rollout_has_its_every_key(rollout):
    # tests/test_fork.py calls each advantage kind on rollout_out(): a key rollout() gains must be
    # there too, or a kind that reads it passes that test and fails in the run
    from test_fork import rollout_out

    out, _ = rollout
    stand_in = rollout_out([1.0, 0.0])
    assert set(stand_in) == set(out)
    assert all(len(v) == 2 for v in stand_in.values())
