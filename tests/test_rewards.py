"""Reward terms: total = answer + format_weight * format, ranked so that honesty pays best."""

import pytest

from tasks import gsm8k, mathtask
from tasks.common import rewards

W = 0.1  # the ranking below needs 0 < format_weight < 1; 0.1 is a typical opt-in bonus

# per task: (reference, correct and well-formed, correct but sloppy, wrong but well-formed, garbage)
LADDERS = {
    "gsm8k": (
        gsm8k,
        "18",
        "5 + 13 = 18\n#### 18",
        "5 + 13 = 18\n#### $18.00 dollars, I think",
        "5 + 12 = 17\n#### 17",
        "I am not sure.",
    ),
    "math": (
        mathtask,
        r"\frac{1}{2}",
        r"Half of it, so $\boxed{\frac{1}{2}}$.",
        r"$\boxed{0.5}$ -- let me double-check that... yes.",
        r"So $\boxed{\frac{1}{3}}$.",
        "no idea",
    ),
}


@pytest.mark.parametrize("name", LADDERS)
def test_totals_rank_correct_formed_over_sloppy_over_wrong_formed_over_garbage(name):
    task, ref, *completions = LADDERS[name]
    totals = [rewards(task, c, ref, format_weight=W)["total"] for c in completions]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4, totals
    assert totals == [1 + W, 1.0, W, 0.0]


@pytest.mark.parametrize("name", LADDERS)
def test_terms_are_separate_and_keys_are_fixed(name):
    task, ref, formed, sloppy, wrong, garbage = LADDERS[name]
    assert rewards(task, sloppy, ref, W) == {"answer": 1.0, "format": 0.0, "total": 1.0}
    assert rewards(task, wrong, ref, W) == {"answer": 0.0, "format": 1.0, "total": W}


@pytest.mark.parametrize("name", LADDERS)
def test_default_weight_is_the_pure_answer_reward(name):
    task, ref, *completions = LADDERS[name]
    for c in completions:
        r = rewards(task, c, ref)
        assert r["total"] == r["answer"]


# hedging, repetition and box-spamming, each against an honest correct answer
HACKS = {
    "gsm8k": (
        gsm8k,
        "18",
        "#### 18",
        [
            "#### 17 #### 18",
            "#### 17 or 18",
            "#### 18 or 17",
            "#### 18/1",
            "#### 36/2",
            "#### 17\n#### 18",
            "#### 18\n#### 17",
            "#### 18\n#### 18",
            "#### 18 18 18",
            "#### 17, 18",
            "#### 17.5 to 18.5",
            "#### 1,00\n#### 18",
            "####" * 50 + " 18",
            "#### 18 \n" * 20,
            "18 18 18 18 18",
        ],
    ),
    "math": (
        mathtask,
        "5",
        r"\boxed{5}",
        [
            r"\boxed{5} \boxed{6}",
            r"\boxed{6} \boxed{5}",
            r"\boxed{5}\boxed{5}\boxed{5}",
            r"\boxed{5, 6}",
            r"\boxed{5 \text{ or } 6}",
            r"\boxed{\pm 5}",
            r"\boxed{x}",
            r"\boxed{[4, 6]}",
            r"\boxed{5",
            r"\boxed{}",
            r"\boxed{\boxed{5}}",
            r"\fbox{5}\boxed{5}",
            r"\boxed{5} or maybe \boxed{}",
            "".join(rf"\boxed{{{i}}}" for i in range(100)),
            r"\boxed{\{4, 5, 6\}}",
            r"\boxed{5}" + " 5" * 50,
            r"\boxed{4.99999999}",
            r"\boxed{5 = 6}",
        ],
    ),
}


@pytest.mark.parametrize("name", HACKS)
@pytest.mark.parametrize("weight", [0.0, W, 0.5])
def test_no_hack_beats_an_honest_correct_answer(name, weight):
    task, ref, honest, hacks = HACKS[name]
    best = rewards(task, honest, ref, weight)["total"]
    for hack in hacks:
        total = rewards(task, hack, ref, weight)["total"]
        assert total <= best, hack
        if weight > 0:
            assert total < best, hack  # a hack is never paid the format bonus on top
