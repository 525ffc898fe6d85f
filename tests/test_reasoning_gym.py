"""--task=rg:<dataset>: reasoning-gym's generators as a task (tasks/rg.py), offline, in seconds."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import chat_rl
from plumbing import flags
from tasks import rg
from tasks.common import rewards

# requirements.txt installs it; without it only the tests of its absence run
needs_it = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None, reason="pip install reasoning-gym"
)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# two numbers of up to two digits, signs and brackets: over 100,000 questions, so 60 rows
# hardly ever repeat one
EASY = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 2,
    "max_digits": 2,
    "operators": ["+", "-", "*"],
}
# one operator on two one-digit numbers: 81 questions, so a set of 100 must repeat held-out ones
TINY = {
    "min_terms": 2,
    "max_terms": 2,
    "max_digits": 1,
    "operators": ["+"],
    "allow_parentheses": False,
    "allow_negation": False,
    "whitespace": "single",
}


def easy_task(seed=0, train_size=40, eval_size=20, config=EASY):
    return rg.make("basic_arithmetic", json.dumps(config), train_size, eval_size, seed)


@needs_it
def test_a_small_generator_builds_rows_that_are_json_and_prompt_for_tagged_answers():
    task = easy_task()
    train, test = task.load("train"), task.load("test")
    assert len(train) == 40 and len(test) == 20
    for row in train + test:
        assert set(row) == {"question", "answer", "metadata"}
        assert json.loads(json.dumps(row)) == row  # what --resume fingerprints is the row itself
        assert task.prompt(row).startswith(row["question"]) and "<answer>" in task.prompt(row)
        assert task.reference(row) == row["answer"]


@needs_it
def test_the_held_out_set_is_the_same_for_every_seed_and_the_training_sets_differ():
    runs = [easy_task(seed) for seed in (0, 1)]
    assert runs[0].load("test") == runs[1].load("test")
    assert runs[0].load("test", limit=5) == easy_task(eval_size=5).load("test")  # a prefix
    assert runs[0].load("train") != runs[1].load("train")


@needs_it
def test_training_rows_come_from_another_stream_than_the_held_out_ones():
    task = easy_task(train_size=60)
    asked = {row["question"] for row in task.load("test")}
    train = task.load("train")
    # none dropped: a stream that overlapped the held-out one would lose its shared rows here
    assert len(train) == 60 and not asked & {row["question"] for row in train}


@needs_it
def test_a_held_out_question_that_a_small_config_repeats_is_never_trained_on():
    task = easy_task(train_size=100, eval_size=30, config=TINY)
    asked = {row["question"] for row in task.load("test")}
    train = task.load("train")
    assert 0 < len(train) < 100 and not asked & {row["question"] for row in train}


@needs_it
def test_the_reward_is_the_data_sets_own_score_of_the_tagged_answer():
    import reasoning_gym

    task = easy_task()
    config = dict(EASY, seed=rg.HELD_OUT_SEED, size=20)
    generated = reasoning_gym.create_dataset("basic_arithmetic", **config)
    for i, row in enumerate(task.load("test")[:5]):
        entry, answer = generated[i], row["answer"]
        wrong = str(int(answer) + 1)
        right_reply = f"{entry['question']} is easy.\n<answer>{answer}</answer>"
        wrong_reply = f"<answer>{answer}</answer> no wait <answer>{wrong}</answer>"  # last binds
        assert task.score(right_reply, row) == generated.score_answer(answer, entry) == 1.0
        assert task.score(wrong_reply, row) == generated.score_answer(wrong, entry) < 1.0
        assert task.score(f"It is {answer}.", row) == generated.score_answer(None, entry) == 0.0
        # through the trainer's reward (the answer term evaluation.py counts right at 1)
        assert rewards(task, right_reply, task.reference(row), row=row)["answer"] == 1.0
        assert rewards(task, wrong_reply, task.reference(row), row=row)["answer"] < 1.0
        assert task.grade(right_reply, task.reference(row))
        assert not task.grade(wrong_reply, task.reference(row))
        assert task.format_ok(right_reply) and not task.format_ok(wrong_reply)


@needs_it
def test_a_data_set_whose_rows_do_not_survive_json_is_refused():
    # arc_agi compares boards as tuples, which JSON gives back as lists: its right answer would
    # score 0.05
    with pytest.raises(ValueError, match="rg:arc_agi's rows do not survive JSON"):
        rg.make("arc_agi", "", 4, 4, 0)


@needs_it
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--task=rg:basic_arith"], "unknown reasoning-gym data set 'basic_arith' .*did you mean"),
        (
            ["--task=rg:basic_arithmetic", '--rg-config={"min_digit": 1}'],
            "rg:basic_arithmetic has no option 'min_digit' .*did you mean min_digits",
        ),
        (
            ["--task=rg:basic_arithmetic", '--rg-config={"min_digits": 3, "max_digits": 2}'],
            "rg:basic_arithmetic refused it: max_digits must be >= min_digits",
        ),
        (["--task=rg:basic_arithmetic", '--rg-config={"seed": 3}'], "seed and size are the run's"),
        (["--task=rg:basic_arithmetic", "--rg-config={1"], "--rg-config='{1': Expecting"),
        (["--task=rg:basic_arithmetic", "--rg-config=no.json"], "and no such file"),
        (["--task=rg:basic_arithmetic", "--data=rows.jsonl"], "generates its own rows"),
        (["--task=rg:basic_arithmetic", "--rg-train-size=0"], "--rg-train-size must be positive"),
        (['--rg-config={"max_digits": 2}'], "--rg-config is for --task=rg:<dataset>"),
        (["--rg-train-size=50"], "--rg-train-size is for --task=rg:<dataset>"),
    ],
)
def test_a_bad_name_or_config_is_a_one_line_config_error(argv, message):
    cfg = flags.parse_config(["--preset=demo", *argv], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS)
    with pytest.raises(flags.ConfigError, match=message) as refused:
        flags.check_config(cfg, world_size=1)
    assert "\n" not in str(refused.value)


def test_without_the_package_the_run_stops_in_one_line_naming_the_install(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` now fails
    monkeypatch.setitem(sys.modules, "reasoning_gym.utils", None)
    code = chat_rl.main(
        ["--preset=demo", "--task=rg:basic_arithmetic", f"--out-dir={tmp_path / 'run'}"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        "chat_rl: error: --task=rg:basic_arithmetic needs the reasoning-gym package: "
        "pip install reasoning-gym"
    ], err


def test_other_tasks_never_import_it():
    code = (
        "import sys, chat_rl\n"
        "from plumbing import flags, data\n"
        "cfg = flags.parse_config(['--preset=demo'], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS)\n"
        "flags.check_config(cfg, 1)\n"
        "data.load_data(flags.load_task(cfg), cfg)\n"
        "print('reasoning_gym' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.stdout.strip() == "False", result.stderr[-2000:]


@needs_it
def test_a_tiny_run_trains_and_evaluates_through_chat_rl(tmp_path):
    out = tmp_path / "run"
    code = chat_rl.main(
        [
            "--model=demo_model",
            "--device-type=cpu",
            "--task=rg:basic_arithmetic",
            f"--rg-config={json.dumps(EASY)}",
            "--rg-train-size=8",
            "--eval-examples=4",
            "--num-steps=2",
            "--examples-per-step=2",
            "--num-samples=2",
            "--max-new-tokens=8",
            "--eval-every=1",
            "--eval-samples=2",
            f"--out-dir={out}",
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in rows if "split" not in r]
    evals = [r for r in rows if r.get("split") == "eval"]
    assert [r["step"] for r in train] == [0, 1] and [r["step"] for r in evals] == [0, 1, 2]
    assert all(r["reward_errors"] == 0 for r in train + evals)  # score_answer never raised
    # the eval's problems are the held-out generator's, each sample's reward its own score of the
    # completion's tagged answer (reasoning-gym's code alone, none of tasks/rg.py's)
    import reasoning_gym
    from reasoning_gym.utils import extract_answer

    generated = reasoning_gym.create_dataset(
        "basic_arithmetic", **EASY, seed=rg.HELD_OUT_SEED, size=4
    )
    held_out = {entry["question"]: entry for entry in generated}
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    asked = [s["question"].split("\n\n")[0] for s in samples]
    assert samples and all(question in held_out for question in asked)
    assert all(
        s["reward"] == generated.score_answer(extract_answer(s["completion"]), held_out[question])
        for s, question in zip(samples, asked)
    )
