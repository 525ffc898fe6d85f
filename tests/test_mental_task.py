"""tasks/mental: the offline task a real chat model learns on.
Its verifier binds the reply's last number."""

import time

import pytest
from hypothesis import given, settings, strategies as st

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
