"""What chat_rl promises a reward of your own (--reward, docs/rewards.md), one promise a test: what
it is called with, that it may change its row, how its number becomes the reward, what its errors
do and how they are told, and how evaluation counts part marks."""

import copy
import json
import math

import numpy as np
import pytest

import chat_rl
from engine import Engine
from plumbing import checkpoint, evaluation
from tasks import arith, generic
from tasks.common import rewards

SAMPLES, BUDGET = 3, 24
# arith's problems in a schema of a user's own: an int answer, metadata, a list column
ROWS = [
    {
        "q": r["question"],
        "sol": int(r["answer"].rsplit("#### ", 1)[1]),
        "level": level,
        "tags": ["x"],
    }
    for r, level in zip(arith.load("train", 3), ("easy", "medium", "hard"))
]
COLUMNS = "(the row's columns: q, sol, level, tags)"
SMALL = [
    "--preset=demo",
    "--device-type=cpu",
    "--num-steps=2",
    "--examples-per-step=2",
    "--num-samples=4",
    "--max-new-tokens=40",
    "--eval-examples=3",
    "--eval-samples=2",
    "--prompt-column=q",
    "--answer-column=sol",
]


@pytest.fixture(scope="module")
def engine():
    model, tokenizer = checkpoint.load_policy("demo_model", "cpu")
    return Engine(model.eval(), tokenizer)


def metrics(out):
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def task_scored_by(score):
    task = generic.make(prompt_column="q", answer_column="sol")
    task.score = score  # what --reward=file.py:function makes it
    return task


def test_it_is_called_once_per_completion_with_the_completions_text_and_its_whole_row(engine):
    calls = []
    task = task_scored_by(lambda completion, row: calls.append((completion, row)) or 0.0)
    out = chat_rl.rollout(engine, task, ROWS, SAMPLES, BUDGET, temperature=1.0, top_k=0, seed=0)
    assert [c for c, _ in calls] == out["completions"]  # the decoded text, stop token dropped
    assert [row for _, row in calls] == [row for row in ROWS for _ in range(SAMPLES)]  # all columns


def test_it_may_change_its_row_lists_too_and_no_other_sample_sees_the_change(engine):
    rows, seen = copy.deepcopy(ROWS), []

    def meddling(completion, row):
        seen.append(copy.deepcopy(row))
        row["tags"].append("seen")
        row.pop("level")
        row["sol"] = -1
        return 1.0

    chat_rl.rollout(
        engine, task_scored_by(meddling), rows, SAMPLES, BUDGET, temperature=1.0, top_k=0, seed=0
    )
    assert seen == [row for row in ROWS for _ in range(SAMPLES)]  # each sample its row as it was
    assert rows == ROWS  # and the run's rows untouched


def test_its_number_is_the_answer_term_and_the_format_bonus_is_added():
    task = task_scored_by(lambda completion, row: np.float32(0.5))  # any real number, numpy's too
    assert rewards(task, "so 5 + 3 = 8\n#### 8", "8", format_weight=0.25, row=ROWS[0]) == {
        "answer": 0.5,
        "format": 1.0,
        "total": 0.75,
    }
    assert rewards(task, "8", "8", format_weight=0.25, row=ROWS[0]) == {
        "answer": 0.5,
        "format": 0.0,
        "total": 0.5,
    }


@pytest.mark.parametrize("returned", ["1.0", None, [1.0], math.nan, math.inf, -math.inf])
def test_what_is_not_a_finite_number_scores_0_and_is_an_error(returned):
    terms = rewards(task_scored_by(lambda completion, row: returned), "#### 8", "8", row=ROWS[0])
    assert terms == {
        "answer": 0.0,
        "format": 0.0,
        "total": 0.0,
        "error": f"ValueError: the reward returned {returned!r}, not a finite number",
    }


def test_an_exception_it_raises_is_told_by_its_type_line_message_and_the_rows_columns(tmp_path):
    mine = tmp_path / "mine.py"
    mine.write_text("def reward(completion, row):\n    return row['answer'] + 1\n")
    task = generic.make(prompt_column="q", answer_column="sol", reward=f"{mine}:reward")
    assert rewards(task, "#### 8", "8", row=ROWS[0])["error"] == (
        f"KeyError at {mine}:2 in reward: 'answer' {COLUMNS}"
    )


FAILING = """
def reward(completion, row):
    if row["level"] == "hard":
        return row["answer"]
    if row["level"] == "medium":
        return 1 / 0
    return 1.0 if "####" in completion else 0.0
"""


def write_rows(tmp_path):
    """Training rows with a working row in every step (4 a step: all of them), and held-out ones."""
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in [ROWS[0], *ROWS]))
    test.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return [f"--data={train}", f"--eval-data={test}", "--examples-per-step=4"]


def test_each_kind_of_error_is_printed_once_and_the_run_ends_with_their_count(tmp_path, capsys):
    (tmp_path / "failing.py").write_text(FAILING)
    out, where = tmp_path / "run", tmp_path / "failing.py"
    argv = [*SMALL, *write_rows(tmp_path), f"--out-dir={out}", f"--reward={where}:reward"]
    assert chat_rl.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    told = [line.split("once): ", 1)[1] for line in lines if "the reward failed, scoring 0" in line]
    # the step 0 eval meets the medium row first
    assert told == [
        f"ZeroDivisionError at {where}:6 in reward: division by zero {COLUMNS}",
        f"KeyError at {where}:4 in reward: 'answer' {COLUMNS}",
    ]
    rows = metrics(out)
    errors = [sum(r["reward_errors"] for r in rows if ("split" in r) == evals) for evals in (0, 1)]
    # 2 steps x 2 failing rows x 4 samples; 2 evals x 2 failing rows x (2 samples + greedy)
    assert errors == [2 * 2 * 4, 2 * 2 * (2 + 1)]
    assert lines[-3].startswith(
        f"the reward failed on {errors[0]} training and {errors[1]} eval completions, each scored 0"
    )


def test_evaluation_counts_a_completion_right_at_an_answer_of_1_or_more(engine):
    for marks, right in ((0.5, 0.0), (0.99, 0.0), (1.0, 1.0), (1.5, 1.0)):
        task = task_scored_by(lambda completion, row, marks=marks: marks)
        metrics, _ = evaluation.evaluate(
            chat_rl.rollout, engine, task, ROWS, 2, BUDGET, rank=0, world=1, device="cpu", seed=0
        )
        assert (metrics["greedy"], metrics["pass@1"], metrics["pass@2"]) == (right,) * 3, marks


BREAKING = """
calls = [0]
def reward(completion, row):
    calls[0] += 1
    if calls[0] > 8:  # step 0's 2 problems x 4 samples, then never again
        raise RuntimeError("the grader went away")
    return float(str(row["sol"]) in completion)
"""


def test_failing_on_every_completion_of_a_step_stops_the_run_keeping_its_training(tmp_path, capsys):
    (tmp_path / "breaking.py").write_text(BREAKING)
    out, where = tmp_path / "run", tmp_path / "breaking.py"
    assert (
        chat_rl.main(
            [
                *SMALL,
                *write_rows(tmp_path),
                "--examples-per-step=2",
                f"--out-dir={out}",
                f"--reward={where}:reward",
                "--eval-every=-1",
                "--num-steps=3",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        (
            f"chat_rl: error: step 1: the reward failed on every completion; the first: "
            f"RuntimeError at {where}:6 in reward: the grader went away {COLUMNS}"
        )
    ]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0] and rows[0]["kept_tokens"] > 0  # step 0 trained
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step_")) == ["step_000001"]
