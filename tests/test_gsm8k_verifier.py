"""The GSM8K verifier: the first '####' followed by a number binds; exact rational comparison."""

import builtins
import threading

import pytest
from hypothesis import given, settings, strategies as st

from tasks import gsm8k

# (completion, reference, verdict)
GRADE_CASES = [
    # ordinary
    ("5 + 13 = 18\n#### 18", "18", True),
    ("#### 18", "18", True),
    ("####18", "18", True),
    ("#### 18", "19", False),
    ("#### 0", "0", True),
    ("#### -7", "-7", True),
    ("#### 7", "-7", False),
    ("#### 2.5", "2.5", True),
    ("#### 18", 18, True),
    # equivalent forms: exact rationals, valid thousands groups, decoration
    ("#### 18.0", "18", True),
    ("#### 18.00", "18", True),
    ("#### 018", "18", True),
    ("#### 1,000", "1000", True),
    ("#### 1000", "1,000", True),
    ("#### 1,000,000", "1000000", True),
    ("#### 1,234.50", "1234.5", True),
    ("#### .5", "0.5", True),
    ("#### 0.50", ".5", True),
    ("#### +5", "5", True),
    ("#### $18", "18", True),
    ("#### \\$18", "18", True),
    ("#### $18.00", "18", True),
    ("#### -$5", "-5", True),
    ("#### $-5", "-5", True),
    ("#### **18**", "18", True),
    ("**#### 18**", "18", True),
    ("#### 18%", "18", True),
    ("#### 18.", "18", True),
    ("#### 18 apples", "18", True),
    ("#### 18 dollars.", "18", True),
    ("#### 18\nThat is the answer.", "18", True),
    ("#### Step 1: add\n5 + 13 = 18\n#### 18", "18", True),
    ("#### Solution\n#### 18", "18", True),
    ("#### 18", "18.0", True),
    # near misses
    ("#### 18.01", "18", False),
    ("#### 17.999", "18", False),
    ("#### 180", "18", False),
    ("#### 1.8", "18", False),
    ("#### -18", "18", False),
    ("#### 18", "-18", False),
    ("#### 0.1", "0.10000001", False),
    # hedging and tricks: never paid
    ("#### 17 #### 18", "18", False),
    ("#### 17 or 18", "18", False),
    ("#### 18 or 17", "18", False),
    ("#### 17\n#### 18", "18", False),
    ("#### 18/1", "18", False),
    ("#### 36/2", "18", False),
    ("#### 17-18", "18", False),
    ("#### 17, 18", "18", False),
    ("#### 17,18", "18", False),
    ("#### 18 (or maybe 17)", "18", False),
    ("#### 18 = 18", "18", False),
    ("#### 18 18 18", "18", False),
    ("#### 1e3", "1000", False),
    ("#### 18²", "18", False),
    ("#### 18½", "18", False),
    ("The answer is 18.", "18", False),
    ("18", "18", False),
    ("#### eighteen", "18", False),
    ("#### Answer: 18", "18", False),
    # malformed after the binding marker: 0, no fallback to a later marker
    ("#### 1,00", "100", False),
    ("#### 1,0000", "10000", False),
    ("#### 12.3.4", "12.3", False),
    ("#### 1,00\n#### 100", "100", False),
    ("#### 1,000,00\n#### 100000", "100000", False),
    ("#### 12.3.4\n#### 18", "18", False),
    ("#### ,100", "100", False),
    ("####", "18", False),
    ("#### ", "18", False),
    ("", "18", False),
    ("#### -", "18", False),
    ("#### $", "18", False),
    ("#### 18", None, False),
    ("#### 18", "abc", False),
    ("#### 18", "", False),
    (None, "18", False),
    # unicode
    ("#### \u22125", "-5", True),          # the minus sign U+2212
    ("####\u00a018", "18", True),          # a no-break space
    ("#### 18 \U0001F34E", "18", True),    # an emoji unit
    ("#### \uff11\uff18", "18", False),    # full-width digits are not ASCII digits
    ("#### \u0661\u0668", "18", False),    # Arabic-Indic digits neither
    ("\uff03\uff03\uff03\uff03 18", "18", False),  # full-width hashes are not the marker
    ("#### 18 \u0661", "18", False),       # a digit of any script after the answer: malformed
]


@pytest.mark.parametrize("completion,reference,verdict", GRADE_CASES)
def test_grade(completion, reference, verdict):
    assert gsm8k.grade(completion, reference) is verdict


EXTRACT_CASES = [
    ("#### 18.00", "18"),
    ("#### 1,234.50", "1234.5"),
    ("#### -0.0", "0"),
    ("#### $5", "5"),
    ("#### 0.125", "0.125"),
    ("#### -2.50", "-2.5"),
    ("#### Step 1\n#### 7", "7"),
    ("no marker here", None),
    ("#### 1,00", None),
    ("#### 17 or 18", None),
    ("#### 17\n#### 18", "17"),
]


@pytest.mark.parametrize("text,answer", EXTRACT_CASES)
def test_extract_answer(text, answer):
    assert gsm8k.extract_answer(text) == answer


FORMAT_CASES = [
    ("work\n#### 18", True),
    ("#### 18", True),
    ("#### -3", True),
    ("#### 2.5", True),
    ("work\n#### 18\n\n", True),
    ("#### 18\nthanks", False),
    ("#### 18\n#### 18", False),
    ("#### Step 1\n#### 18", False),
    ("#### $18", False),
    ("#### 18.", False),
    ("#### 1,000", False),
    ("#### **18**", False),
    ("18", False),
    ("", False),
]


@pytest.mark.parametrize("completion,ok", FORMAT_CASES)
def test_format_ok(completion, ok):
    assert gsm8k.format_ok(completion) is ok


def test_reference_of_a_real_row_strips_nothing_it_needs():
    row = {"question": "q", "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"}
    assert gsm8k.reference(row) == "72"
    assert gsm8k.grade("...\n#### 72", gsm8k.reference(row))
    assert gsm8k.solution(row) == row["answer"]  # annotations kept: they teach the calculator's syntax


gsm_text = st.lists(st.sampled_from(["####", " ", "\n", "18", "1", ",", ".", "000", "-", "$", "**", "%",
                                     "or", "/", "Step", "\u2212", "\uff11", "\u00b2", "e3", "\\"]),
                    max_size=20).map("".join)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(completion=st.one_of(gsm_text, st.text(max_size=200)), reference=st.one_of(gsm_text, st.text(max_size=20)))
def test_fuzz_grade_never_raises_and_is_deterministic(completion, reference):
    first = gsm8k.grade(completion, reference)
    assert isinstance(first, bool) and gsm8k.grade(completion, reference) is first
    assert isinstance(gsm8k.format_ok(completion), bool)
    answer = gsm8k.extract_answer(completion)
    assert answer is None or isinstance(answer, str)


def test_adversarial_inputs_are_bounded_and_raise_nothing():
    from tools.bench_verifiers import adversarial_cases
    for name, task, completion, reference in adversarial_cases():
        if task is gsm8k:
            assert gsm8k.grade(completion, reference) is False, name
            assert gsm8k.format_ok(completion) is False, name


def test_verifier_never_executes_model_text(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("the verifier tried to execute text")
    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    payload = f"#### __import__('os').system('touch {tmp_path}/pwned')"
    assert gsm8k.grade(payload, "0") is False
    assert gsm8k.grade("#### 18", "18") is True
    assert not (tmp_path / "pwned").exists()


def test_grades_the_same_from_other_threads():
    results = {}

    def work(i):
        results[i] = [gsm8k.grade(c, r) for c, r, _ in GRADE_CASES]
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == [v for _, _, v in GRADE_CASES] for r in results.values())
