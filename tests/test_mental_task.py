"""tasks/mental: the offline task a real chat model learns on.
Its verifier binds the reply's last number."""

import time

import pytest
from hypothesis import given, settings, strategies as st

import chat_rl
from plumbing import flags
from tasks import mental
from tasks.common import get_task, rewards


def test_train_and_test_problems_are_disjoint_and_cover_every_problem_once():
    train, test = mental.load("train"), mental.load("test")
    questions = [row["question"] for row in train + test]
    assert len(questions) == len(set(questions)) == len(mental.problems()) == 255
    assert len(test) == 64 and mental.load("test", limit=8) == test[:8]
    assert mental.load("train", seed=1) != train and sorted(
        map(str, mental.load("train", seed=1))
    ) == sorted(map(str, train))


def test_every_answer_is_the_arithmetic_its_question_asks():
    for row in mental.problems():
        a, op, b = row["question"].removeprefix("What is ").removesuffix("?").split()
        assert (
            row["answer"]
            == {"+": int(a) + int(b), "-": int(a) - int(b), "×": int(a) * int(b)}[op]
            >= 0
        )


@pytest.mark.parametrize(
    "reply, right",
    [
        ("7 + 5 = 12.", True),
        ("The answer is **12**", True),
        ("12", True),
        ("12.0", True),
        ("1,212", False),
        ("12 or 13", False),  # the last number binds: hedging pays only if the last guess is right
        ("7 + 5 = 12. In binary that is 1100.", False),
        ("twelve", False),
        ("", False),
        ("-12", False),
    ],
)
def test_the_last_number_in_the_reply_is_its_answer(reply, right):
    assert mental.grade(reply, "12") is right


def test_format_asks_the_reply_to_end_with_its_answer():
    assert mental.format_ok("7 + 5 = 12.") and mental.format_ok("**12**")
    assert not mental.format_ok("12 is the answer") and not mental.format_ok("no number")


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_the_verifier_never_raises_on_any_text(text):
    assert mental.grade(text, "12") in (True, False) and mental.format_ok(text) in (True, False)


def test_the_verifier_reads_a_huge_reply_in_bounded_time():
    start = time.time()
    mental.grade("1 " * 2_000_000, "1")
    assert time.time() - start < 1.0


def test_chat_rl_finds_it_by_name_and_scores_it_as_a_task():
    task = get_task("mental")
    row = task.load("test")[0]
    assert (
        rewards(task, f"It is {task.reference(row)}.", task.reference(row), row=row)["answer"]
        == 1.0
    )


# ---- harder rungs: --mental-digits, --mental-ops -------------------------------------------------
def task_for(*argv):
    cfg = flags.parse_config(["--task=mental", *argv], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS)
    flags.check_config(cfg, world_size=1)
    return flags.load_task(cfg)


def operands(row):
    a, op, b = row["question"].removeprefix("What is ").removesuffix("?").split()
    return int(a), op, int(b)


def test_the_default_rung_is_the_module_itself_and_its_rows_unchanged():
    assert task_for() is mental  # the preset's task, bit for bit what it was
    same = task_for("--mental-ops=+-×")  # spelled with the sign: the same rows, seed for seed
    for split, seed in (("train", 0), ("test", 0), ("train", 3)):
        assert same.load(split, seed=seed) == mental.load(split, seed=seed)


@pytest.mark.parametrize("digits, ops", [(2, "+-x"), (3, "x"), (2, "+")])
def test_a_harder_rung_draws_its_operands_and_keeps_held_out_questions_out_of_training(digits, ops):
    task = task_for(f"--mental-digits={digits}", f"--mental-ops={ops}")
    train, test = task.load("train"), task.load("test")
    assert len(train) + len(test) == mental.DRAWN and 0.2 < len(test) / mental.DRAWN < 0.3
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    signs = {"+": "+", "-": "-", "x": "×"}
    for row in train + test:
        a, op, b = operands(row)
        assert op in {signs[o] for o in ops}
        assert 10 ** (digits - 1) <= min(a, b) and max(a, b) < 10**digits
        assert row["answer"] == {"+": a + b, "-": a - b, "×": a * b}[op] >= 0
    # the same rows on every run; --seed reorders them only
    assert task_for(f"--mental-digits={digits}", f"--mental-ops={ops}").load("test") == test
    assert sorted(map(str, task.load("train", seed=1))) == sorted(map(str, train))
    assert task.load("test", limit=8) == test[:8]
    reply = f"It is {task.reference(test[0])}."
    assert rewards(task, reply, task.reference(test[0]), row=test[0])["answer"] == 1.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mental-digits=4"], "--mental-digits must be 1, 2 or 3, got 4"),
        (["--mental-ops=+/"], "--mental-ops must be some of '\\+-x', each once, got '\\+/'"),
        (["--mental-ops=++"], "each once"),
        (["--task=arith", "--mental-digits=2"], "--mental-digits is for --task=mental"),
    ],
)
def test_a_bad_rung_is_a_one_line_config_error(argv, message):
    with pytest.raises(flags.ConfigError, match=message):
        task_for(*argv)
