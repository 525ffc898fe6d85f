"""The GSM8K verifier: the first '####' followed by a number binds; exact rational comparison."""

import builtins
import threading
from fractions import Fraction

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
    ("#### \u22125", "-5", True),  # the minus sign U+2212
    ("####\u00a018", "18", True),  # a no-break space
    ("#### 18 \U0001f34e", "18", True),  # an emoji unit
    ("#### \uff11\uff18", "18", False),  # full-width digits are not ASCII digits
    ("#### \u0661\u0668", "18", False),  # Arabic-Indic digits neither
    ("\uff03\uff03\uff03\uff03 18", "18", False),  # full-width hashes are not the marker
    ("#### 18 \u0661", "18", False),  # a digit of any script after the answer: malformed
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
    assert (
        gsm8k.solution(row) == row["answer"]
    )  # annotations kept: they teach the calculator's syntax


gsm_text = st.lists(
    st.sampled_from(
        [
            "####",
            " ",
            "\n",
            "18",
            "1",
            ",",
            ".",
            "000",
            "-",
            "$",
            "**",
            "%",
            "or",
            "/",
            "Step",
            "\u2212",
            "\uff11",
            "\u00b2",
            "e3",
            "\\",
        ]
    ),
    max_size=20,
).map("".join)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    completion=st.one_of(gsm_text, st.text(max_size=200)),
    reference=st.one_of(gsm_text, st.text(max_size=20)),
)
def test_fuzz_grade_never_raises_and_is_deterministic(completion, reference):
    first = gsm8k.grade(completion, reference)
    assert isinstance(first, bool) and gsm8k.grade(completion, reference) is first
    assert isinstance(gsm8k.format_ok(completion), bool)
    answer = gsm8k.extract_answer(completion)
    assert answer is None or isinstance(answer, str)


# ---- verdicts, as properties over random numbers -------------------------------------------------
@st.composite
def numbers(draw):
    """(value, plain): a random decimal number, as a Fraction and as a plain
    '-?digits(.digits)?' string."""
    whole, frac, negative = (
        draw(st.integers(0, 10**9)),
        draw(st.text("0123456789", max_size=3)),
        draw(st.booleans()),
    )
    value = (Fraction(whole) + (Fraction(int(frac), 10 ** len(frac)) if frac else 0)) * (
        -1 if negative else 1
    )
    return value, ("-" if negative else "") + str(whole) + (f".{frac}" if frac else "")


@st.composite
def written(draw, value_and_plain):
    """The number as the verifier accepts it after its marker:
    sign, $, **, thousands groups, zeros, units."""
    value, _ = value_and_plain
    whole, frac = divmod(abs(value), 1)
    digits = (
        f"{int(whole):,}"
        if whole >= 1000 and draw(st.booleans())
        else "0" * draw(st.integers(0, 2)) + str(int(whole))
    )
    decimals = ""
    if frac:
        decimals = str(frac.numerator * 10**3 // frac.denominator).rjust(3, "0").rstrip("0")
    decimals += "0" * draw(st.integers(0, 2)) if decimals or draw(st.booleans()) else ""
    body = (digits + "." + decimals) if decimals else digits
    if body.startswith("0.") and draw(st.booleans()):
        body = body[1:]  # .5
    sign = draw(st.sampled_from(["-", "\u2212"])) if value < 0 else draw(st.sampled_from(["", "+"]))
    dollar = draw(st.sampled_from(["", "$", "\\$"]))
    bold = draw(st.sampled_from(["", "**"]))
    number = bold + (sign + dollar if draw(st.booleans()) else dollar + sign) + body + bold
    marker = draw(st.sampled_from(["####", "#### ", "####  ", "####\u00a0"]))
    tail = draw(
        st.sampled_from(["", ".", "%", " apples", " dollars.", "\nThat is 5 more than yesterday."])
    )
    work = draw(st.text(st.characters(blacklist_characters="#"), max_size=30))
    return f"{work}\n{marker}{number}{tail}"


def plain(q):
    """A Fraction with a finite decimal expansion as a plain '-?digits(.digits)?' string."""
    whole, frac = divmod(abs(q), 1)
    decimals = (
        str(frac.numerator * 10**6 // frac.denominator).rjust(6, "0").rstrip("0") if frac else ""
    )
    return ("-" if q < 0 else "") + str(int(whole)) + (f".{decimals}" if decimals else "")


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data(), number=numbers())
def test_fuzz_a_number_in_any_accepted_form_is_graded_right_and_extracted_exactly(data, number):
    value, as_reference = number
    completion = data.draw(written(number))
    assert gsm8k.grade(completion, as_reference) is True, completion
    assert gsm8k.extract_answer(completion) == plain(value)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(data=st.data(), number=numbers(), other=numbers())
def test_fuzz_a_different_number_is_graded_wrong(data, number, other):
    value, _ = number
    completion = data.draw(written(number))
    for wrong in {
        other[0],
        value + 1,
        value - Fraction(1, 1000),
        -value if value else Fraction(1),
    } - {value}:
        assert gsm8k.grade(completion, plain(wrong)) is False, (completion, plain(wrong))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(data=st.data(), number=numbers())
def test_fuzz_the_reference_may_be_written_in_any_accepted_form_too(data, number):
    completion, reference = data.draw(written(number)), data.draw(written(number)).split("\n", 1)[1]
    assert gsm8k.grade(completion, reference) is True, (completion, reference)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(a=numbers(), b=numbers())
def test_fuzz_a_hedge_pays_for_neither_answer_and_the_first_marker_binds(a, b):
    if a[0] == b[0]:
        return
    for reference in (a[1], b[1]):
        assert gsm8k.grade(f"#### {a[1]} or {b[1]}", reference) is False
    assert gsm8k.grade(f"#### {a[1]}\n#### {b[1]}", a[1]) is True
    assert gsm8k.grade(f"#### {a[1]}\n#### {b[1]}", b[1]) is False


def test_adversarial_inputs_are_bounded_and_raise_nothing():
    from scripts.bench_verifiers import adversarial_cases

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
