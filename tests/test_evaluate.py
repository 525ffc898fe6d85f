"""plumbing/evaluation.evaluate's numbers, on an engine whose answers are scripted: problem g
has RIGHT[g] right answers among its K samples at temperature 1.0, and a right greedy answer
where GREEDY_RIGHT[g]."""

import pytest
import torch

import chat_rl
from engine import Samples
from plumbing import evaluation
from policy.tokenizer import ByteTokenizer
from tasks import arith
from tasks.common import conversation

K = 4
RIGHT = [0, 1, 2, 4]
GREEDY_RIGHT = [True, False, False, True]  # not sample 0's verdicts ([False, True, True, True])


class ScriptedEngine:
    """Stands in for Engine.generate: sample s of a problem is right iff s < its RIGHT count."""

    model = None  # an Engine's policy: where a stop signal's hook would go (none installed here)

    def __init__(self, problems):
        self.tokenizer = ByteTokenizer()
        self.script = {
            tuple(self.tokenizer.render_for_completion(conversation(arith, p))): (
                arith.reference(p),
                right,
                greedy,
            )
            for p, right, greedy in zip(problems, RIGHT, GREEDY_RIGHT)
        }
        self.temperatures = set()

    def generate(
        self,
        prompts,
        num_samples=1,
        max_new_tokens=256,
        temperature=1.0,
        top_k=None,
        seed=0,
        include_stop=False,
    ):
        self.temperatures.add(temperature)
        sequences, masks = [], []
        for prompt in prompts:
            reference, right, greedy = self.script[tuple(prompt)]
            for s in range(num_samples):
                ok = greedy if temperature == 0.0 else s < right
                completion = self.tokenizer.encode(
                    f"work\n#### {int(reference) + (0 if ok else 1)}"
                )
                completion += sorted(self.tokenizer.stop_tokens)[:1] if include_stop else []
                sequences.append(list(prompt) + completion)
                masks.append([0] * len(prompt) + [1] * len(completion))
        return Samples(
            sequences, masks, [0] * len(sequences), [0] * len(sequences)
        )  # no tool called


@pytest.fixture(scope="module")
def problems():
    return arith.load("test", limit=len(RIGHT))


def evaluate(problems, generate_batch_rows=256):
    engine = ScriptedEngine(problems)
    metrics, samples = evaluation.evaluate(
        chat_rl.rollout,
        engine,
        arith,
        problems,
        K,
        max_new_tokens=16,
        rank=0,
        world=1,
        device=torch.device("cpu"),
        seed=0,
        generate_batch_rows=generate_batch_rows,
    )
    return metrics, samples, engine


def test_pass_at_j_is_the_mean_over_problems_of_the_unbiased_estimate(problems):
    metrics, _, _ = evaluate(problems)
    # per problem, pass@j = 1 - C(K - right, j) / C(K, j), for right = 0, 1, 2, 4 of K = 4
    expected = {
        "pass@1": (0 + 1 / 4 + 2 / 4 + 1) / 4,
        "pass@2": (0 + (1 - 3 / 6) + (1 - 1 / 6) + 1) / 4,
        "pass@3": (0 + (1 - 1 / 4) + 1 + 1) / 4,
        "pass@4": (0 + 1 + 1 + 1) / 4,
    }
    assert {k: v for k, v in metrics.items() if k.startswith("pass@")} == pytest.approx(
        expected, abs=1e-4
    )


def test_greedy_is_the_share_of_right_answers_at_temperature_0(problems):
    metrics, _, engine = evaluate(problems)
    assert metrics["greedy"] == 0.5
    assert engine.temperatures == {0.0, 1.0}  # pass@k samples at temperature 1.0, greedy at 0


def test_the_numbers_do_not_depend_on_how_many_rows_an_engine_call_takes(problems):
    assert evaluate(problems, generate_batch_rows=K)[0] == evaluate(problems)[0]


def test_samples_carry_each_problems_own_reference_and_reward(problems):
    _, samples, _ = evaluate(problems)
    assert [s["reference"] for s in samples] == [
        arith.reference(p) for p in problems[: len(samples)]
    ]
    assert [s["question"] for s in samples] == [arith.prompt(p) for p in problems[: len(samples)]]
    assert all(s["reward"] == float(arith.grade(s["completion"], s["reference"])) for s in samples)
    assert [s["reward"] for s in samples] == [
        float(r > 0) for r in RIGHT[: len(samples)]
    ]  # sample 0 is right iff any is


def test_seq_len_is_the_mean_completion_length_of_the_temperature_1_samples(problems):
    metrics, _, _ = evaluate(problems)
    lengths = [
        len(f"work\n#### {int(arith.reference(p)) + (0 if s < right else 1)}")
        + 1  # + the stop token
        for p, right in zip(problems, RIGHT)
        for s in range(K)
    ]
    assert metrics["seq_len"] == pytest.approx(sum(lengths) / len(lengths), abs=1e-4)
