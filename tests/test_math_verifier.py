r"""The MATH verifier: the last \boxed{} binds; Math-Verify equivalence under our own policy.

The rules are tasks/mathtask.py; the sympy worker they end in (its limits, its refusal to eval
model text, killing a stuck one) is tasks/math_sandbox.py, so the worker tests patch that module.
"""

import builtins
import json
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from tasks import math_sandbox, mathtask


def boxed(answer):
    return f"Some reasoning first. The final answer is $\\boxed{{{answer}}}$."


EXTRACT_CASES = [
    (r"so \boxed{5}", "5"),
    (r"\boxed{\frac{22}{7}}", r"\frac{22}{7}"),
    (r"\boxed {5}", "5"),  # Math-Verify misses a space before the brace
    ("\\boxed\n{5}", "5"),
    (r"\fbox{5}", "5"),
    (r"\boxed{ 7 }", "7"),
    (r"\boxed{{5}}", "5"),  # braces around the whole answer only group
    (r"\boxed{{{5}}}", "5"),
    (r"\boxed{ { {5} } }", "5"),
    (r"\boxed{{\frac{1}{2}}}", r"\frac{1}{2}"),
    (r"\boxed{{\{5\}}}", r"\{5\}"),  # the grouping goes, the set's braces stay
    (r"\boxed{{1}{2}}", "{1}{2}"),  # two groups, not one around 12: kept
    (r"\boxed{{1}^2}", "{1}^2"),
    (r"\boxed{{}}", None),  # nothing but grouping: an empty box
    (r"\boxed{{\boxed{5}}}", None),
    (r"$\boxed{x^{2}}$.", "x^{2}"),
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces do not close the box
    (r"\boxed{a}b}", "a"),
    (r"\boxed{\text{(C)}}", r"\text{(C)}"),
    (r"\boxed{1} then \boxed{2}", "2"),  # the last box binds
    (r"\boxed{2} then \boxed{}", None),  # an empty last box: no fallback to 2
    (r"\boxed{2} then \boxed{ }", None),
    (r"\boxed{2} then \boxed{3", None),  # unterminated last box
    (r"\boxed{2} then \boxed 3", None),  # a box without braces
    (r"\boxed{2} \boxed", None),
    (r"\boxed{\boxed{5}}", None),  # a box in a box
    (r"\boxedx{5}", None),  # not a box command
    ("no box at all: 5", None),
    ("", None),
    (None, None),
]


@pytest.mark.parametrize("text,answer", EXTRACT_CASES)
def test_extract_answer(text, answer):
    assert mathtask.extract_answer(text) == answer


# (what the model boxes, reference, verdict)
EQUIV_CASES = [
    # ordinary
    ("5", "5", True),
    ("5", "6", False),
    ("-3", "-3", True),
    (r"\frac{22}{7}", r"\frac{22}{7}", True),
    ("x^2-x-2", "x^2-x-2", True),
    # fractions and decimals, exactly
    ("0.5", r"\frac{1}{2}", True),
    (r"\frac12", r"\frac{1}{2}", True),
    (r"\dfrac{1}{2}", r"\frac12", True),
    (r"\tfrac{1}{2}", "0.5", True),
    ("1/2", r"\frac{1}{2}", True),
    (r"\frac{2}{4}", r"\frac12", True),
    (r"-\frac{1}{2}", r"\frac{-1}{2}", True),
    (r"\frac{-1}{2}", "-0.5", True),
    (".5", r"\frac12", True),
    ("0.50", r"\frac{1}{2}", True),
    ("1.25", r"\frac{5}{4}", True),
    (r"\frac{14}{3}", r"4\frac{2}{3}", True),
    (r"\frac{10}{2}", "5", True),
    # roots and pi
    (r"\sqrt2", r"\sqrt{2}", True),
    (r"2\sqrt{2}", r"\sqrt{8}", True),
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", True),
    (r"\sqrt{2}/2", r"\frac{\sqrt2}{2}", True),
    (r"3\sqrt{13}", r"3 \sqrt{13}", True),
    (r"\frac{\pi}{2}", r"0.5\pi", True),
    (r"\frac\pi2", r"\frac{\pi}{2}", True),
    (r"\sqrt51", r"\sqrt{51}", False),  # LaTeX reads \sqrt51 as \sqrt{5}1
    # percent, degrees, units, money: decoration
    (r"50\%", "50", True),
    ("50", r"50\%", True),
    ("30^\\circ", "30", True),
    ("30^{\\circ}", "30", True),
    (r"5\text{ cm}", "5", True),
    (r"5 \text{ cm}^2", "5", True),
    (r"5\,\mbox{inches}", "5", True),
    ("12 inches", "12", True),
    (r"\$18.90", "18.90", True),
    ("18.9", r"\$18.90", True),
    ("1,000", "1000", True),
    (r"10,\!000", "10000", True),
    ("1{,}000", "1000", True),
    (r"\displaystyle 5", "5", True),
    # redundant grouping braces
    ("{5}", "5", True),
    ("{{{5}}}", "5", True),
    ("{ {-3} }", "-3", True),
    (r"{\frac{1}{2}}", "0.5", True),
    ("5", "{{5}}", True),  # in the reference too
    ("{{{5}}}", "6", False),
    ("{1}{2}", "12", False),  # two groups, not a wrapped 12
    # brackets, intervals, tuples, sets
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})", True),
    ("[-2,7]", "[-2, 7]", True),
    (r"(-\infty, 3) \cup (4, \infty)", r"(-\infty,3)\cup(4,\infty)", True),
    (r"\{2,1\}", "1, 2", True),
    ("2, 1", "1,2", True),
    (r"x \in [-2,7]", "[-2,7]", True),
    (r"\mathbb{R}", r"(-\infty,\infty)", True),
    (r"\pm 3", "3, -3", True),
    # algebra
    ("(x+1)(x-2)", "x^2-x-2", True),
    ("x^2-x-2", "(x+1)(x-2)", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("y = 2x - 3", "y=2x-3", True),
    ("2x-3", "y=2x-3", True),
    ("x = 5", "5", True),
    ("y=-2x+5", "-2x+5", True),
    ("-q + p", "p - q", True),
    ("3/56", r"\frac{3}{56}", True),
    (r"\$32,\!000", "32000", True),
    (
        r"\begin{pmatrix} -1/3 \\ 2/3 \end{pmatrix}",
        r"\begin{pmatrix} -\frac13 \\ \frac23 \end{pmatrix}",
        True,
    ),
    ("5", "x=5", True),
    # matrices, complex numbers
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}", True),
    (r"\begin{pmatrix} 1 \\ 3 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}", False),
    ("6-5i", "6 - 5i", True),
    (r"3 + 4\mathrm{i}", "3+4i", True),
    ("3-4i", "3+4i", False),
    # text answers
    (r"\text{(C)}", r"\text{(C)}", True),
    ("C", r"\text{(C)}", True),
    (r"\text{(A)}", r"\text{(C)}", False),
    (r"\text{Evelyn}", r"\text{Evelyn}", True),
    (r"\text{even}", r"\text{odd}", False),
    # base-n numerals keep their base
    ("2220_4", "2220_{4}", True),
    ("2220_4", "2220_5", False),
    ("2220", "2220_4", False),
    # near misses
    ("3.1428", r"\frac{22}{7}", False),
    ("3.14", r"\pi", False),
    (r"\frac{22}{7}", r"\pi", False),
    ("0.5000001", r"\frac12", False),
    ("0.4999999", "0.5", False),
    ("0.333333", r"\frac{1}{3}", False),
    ("1.41421356237310", r"\sqrt{2}", False),
    (r"\pi + 0.0000000000000000001", r"\pi", False),
    (r"\frac{1}{2}", r"\frac{1}{3}", False),
    ("x^2-x+2", "(x+1)(x-2)", False),
    ("(x+1)(x-3)", "x^2-x-2", False),
    ("2x+3", "2x-3", False),
    ("(-2,7]", "[-2,7]", False),
    ("[-2,7)", "[-2,7]", False),
    ("(1,2)", "(2,1)", False),
    ("-5", "5", False),
    ("5", "-5", False),
    (r"10\%", "0.1", False),  # percent is a unit, not a factor of 1/100
    ("0.5", r"50\%", False),
    # hedges and hacks
    ("17, 18", "17", False),
    (r"17 \text{ or } 18", "17", False),
    ("17 or 18", "17", False),
    (r"17 \text{ and } 18", "17", False),
    (r"\text{17 or 18}", "17", False),
    (r"\{17, 18\}", "17", False),
    (r"17 \lor 18", "17", False),
    ("17; 18", "17", False),
    (r"\pm 3", "3", False),
    ("[16, 18]", "17", False),
    ("x", "5", False),
    (r"\infty", "5", False),
    ("x > 0", "5", False),
    (r"\frac{1}{0}", r"\infty", False),
    (r"\text{answer}", "5", False),
    (r"\lim_{x \to 0} \frac{\sin x}{x}", "1", False),  # an answer is a value, not a problem
    (r"\sum_{k=1}^{3} k", "6", False),
    ("10^{10^{10}}", "5", False),
    ("__import__('os').system('echo hi')", "5", False),
    ("1e3", "1000", False),
    # unicode
    ("\uff15", "5", True),  # full-width 5 (NFKC)
    ("\u22123", "-3", True),  # minus sign
    ("x\u00b2-x-2", "x^2-x-2", True),  # superscript two
    ("\u00bd", r"\frac12", True),
    ("\u03c0", r"\pi", True),
    ("2\u03c0", r"2\pi", True),
    ("\u221a2", r"\sqrt{2}", True),
    ("30\u00b0", "30^\\circ", True),
    ("3\u200b5", "35", True),  # a zero-width space
    ("\u0665", "5", False),  # Arabic-Indic five: not an ASCII digit
    ("\u2155", r"\frac15", False),  # a vulgar fraction we do not map
]


@pytest.mark.parametrize("answer,reference,verdict", EQUIV_CASES)
def test_grade(answer, reference, verdict):
    assert mathtask.grade(boxed(answer), reference) is verdict


# A comma glued to the next digits groups thousands; a comma then a space separates list items.
@pytest.mark.parametrize("answer", ["32, 349", "32 , 349", r"32,\quad 349", "32,~349"])
def test_a_comma_then_a_space_makes_a_list_not_a_number(answer):
    assert mathtask.grade(boxed(answer), "32349") is False


@pytest.mark.parametrize("answer", ["32,349", "32{,}349"])
def test_a_comma_glued_to_the_digits_groups_thousands(answer):
    assert mathtask.grade(boxed(answer), "32349") is True


@pytest.mark.parametrize(
    "answer,reference",
    [(r"32,\!349", "32349"), (r"32,\! 349", "32349"), (r"11,\! 111,\! 111,\! 100", "11111111100")],
)
def test_a_comma_then_backslash_bang_groups_thousands_whatever_spacing_follows(answer, reference):
    assert mathtask.grade(boxed(answer), reference) is True  # \! takes back the comma's space


def test_plain_numbers_read_glued_thousands_exactly_and_refuse_a_spaced_list():
    # layer 2 settles plain numbers without the sympy worker; a list must reach it whole
    assert mathtask.as_rational("32,349") == 32349 and mathtask.as_rational("32, 349") is None


@pytest.mark.parametrize("reference", ["32, 349", r"\{32, 349\}", "349, 32"])
def test_a_number_does_not_pay_for_the_list_its_digits_spell(reference):
    assert mathtask.grade(boxed("32,349"), reference) is False


def test_a_list_does_not_pay_for_the_number_written_with_the_same_characters():
    assert mathtask.grade(boxed("32, 349"), "32,349") is False


@pytest.mark.parametrize("answer", ["32, 349", "32 ,  349", "349, 32"])
def test_a_spaced_list_still_equals_the_same_list(answer):
    assert mathtask.grade(boxed(answer), "32, 349") is True


GRADE_CASES = [
    (r"\boxed{1} no wait, \boxed{2}", "2", True),
    (r"\boxed{2} no wait, \boxed{1}", "2", False),  # only the last box counts
    (r"\boxed{2} and \boxed{}", "2", False),  # never fall back to an earlier box
    (r"\boxed{2} and \boxed{3", "2", False),
    (r"\boxed {2}", "2", True),
    (r"\fbox{2}", "2", True),
    ("2", "2", False),  # no box, no answer
    (r"\boxed{2}", None, False),
    (r"\boxed{2}", "", False),
    (r"\boxed{2}", r"so the answer is \boxed{2}.", True),  # a whole solution as the reference
    (None, "2", False),
]


@pytest.mark.parametrize("completion,reference,verdict", GRADE_CASES)
def test_grade_binds_the_last_box(completion, reference, verdict):
    assert mathtask.grade(completion, reference) is verdict


# --- answers of several parts, one part per box --------------------------------------------
def boxes(*answers, sep=r" \text{ and } "):
    return "The answers are " + sep.join(rf"$\boxed{{{a}}}$" for a in answers) + "."


@pytest.mark.parametrize(
    "answers,reference",
    [
        (["(2, 2)", "(6, 2)"], "(2, 2), (6, 2)"),  # a set of tuples
        (["1", "2", "3"], r"\{1, 2, 3\}"),  # a set
        (["k = 45", "n = 2"], "k = 45, n = 2"),  # several equations
        ([r"1 - \sqrt{2}", r"1 + \sqrt{2}"], r"x_1 = 1 + \sqrt{2}, x_2 = 1 - \sqrt{2}"),
        (["6", "8"], r"6 \text{ and } 8"),
    ],
)
def test_one_part_per_box_answers_a_reference_of_as_many_parts(answers, reference):
    assert mathtask.grade(boxes(*answers), reference) is True


def test_parts_in_boxes_compare_in_any_order_like_the_list_they_form():
    assert mathtask.grade(boxes("(6, 2)", "(2, 2)"), "(2, 2), (6, 2)") is True


def test_parts_in_boxes_keep_the_labels_they_are_given():
    assert mathtask.grade(boxes("k = 2", "n = 45"), "k = 45, n = 2") is False


@pytest.mark.parametrize("answers", [["1", "2"], ["2", "3"], ["1", "2", "3", "4"], ["1", "2", "4"]])
def test_a_box_too_few_or_too_many_or_wrong_fails(answers):
    assert mathtask.grade(boxes(*answers), "1, 2, 3") is False


def test_earlier_boxes_are_overruled_by_the_last_k_as_one_box_is_by_the_last():
    assert mathtask.grade(boxes("7", "1", "2", "3"), "1, 2, 3") is True
    assert mathtask.grade(boxes("1", "2", "3", "7"), "1, 2, 3") is False


@pytest.mark.parametrize(
    "completion",
    [
        boxes("5", "6"),
        boxes("6", "5", "6"),
        boxes(*range(10)),
        boxes("4", "5", "6"),
        boxes("5", "5, 6"),
    ],
)
def test_a_single_answer_problem_reads_the_last_box_alone_however_many_there_are(completion):
    assert mathtask.grade(completion, "5") is False


def test_a_box_holding_a_list_is_not_one_part():
    # k boxes must hold exactly k parts: otherwise the list would be read at another length
    assert mathtask.grade(boxes("1", "1, 2", "3"), "1, 2, 3") is False


@pytest.mark.parametrize("answers,reference", [(["1", "2"], "(1, 2)"), (["-2", "7"], "[-2, 7]")])
def test_a_tuple_or_interval_is_one_part_so_its_coordinates_cannot_be_boxed_apart(
    answers, reference
):
    assert mathtask.grade(boxes(*answers), reference) is False  # the brackets would go unsaid


def test_an_empty_box_among_the_last_k_is_no_part():
    assert mathtask.grade(r"\boxed{1} \boxed{} \boxed{3}", "1, 2, 3") is False
    assert (
        mathtask.grade(r"\boxed{1} \boxed{2} \boxed{3", "1, 2, 3") is False
    )  # nor an unterminated last one


def test_a_list_in_the_last_box_still_answers_alone_among_other_boxes():
    assert mathtask.grade(boxes("7", "1, 2, 3"), "1, 2, 3") is True


PARTS_CASES = [
    ("5", 1),
    ("(2, 2), (6, 2)", 2),
    (r"\{1, 2, 3\}", 3),
    ("{1,2,3}", 3),
    ("k = 45, n = 2", 2),
    (r"6 \text{ and } 8", 2),
    ("-12;-11;-10", 3),
    (r"\frac{1}{2}, 3", 2),
    (r"(3, \frac{\pi}{2})", 1),  # a tuple: one answer
    ("[-2, 7)", 1),  # an interval
    ("32,349", 1),  # thousands
    (r"\{1\} \cup \{2, 3\}", 1),  # braces that open and close inside are not the set's
]


@pytest.mark.parametrize("answer,parts", PARTS_CASES)
def test_count_parts(answer, parts):
    assert mathtask.count_parts(answer) == parts


# --- a worked solution as the reference -------------------------------------------------------
SOLUTION_CASES = [
    (r"so $n = \boxed{1}$ and $n = \boxed{-2}$.", "1, -2"),
    (r"$\boxed{1}\boxed{2}$", "1, 2"),
    (r"\boxed{1} papers and \boxed{2} bins", "1, 2"),
    (
        r"so $x = \boxed{3}$. Then the area is $\boxed{12}$.",
        "12",
    ),  # prose between: a step on the way
    (r"\boxed{1} no no no no no \boxed{2}", "2"),
    (r"\boxed{1} and \boxed{}", None),
    (r"\boxed{} and \boxed{2}", "2"),  # an empty box ends the list
    ("no box", None),
]


@pytest.mark.parametrize("solution,answer", SOLUTION_CASES)
def test_solution_answer(solution, answer):
    assert mathtask.solution_answer(solution) == answer


EACH_PART_BOXED = r"Factoring, $(n - 1)(n + 2) = 0$, so $n = \boxed{1}$ or $n = \boxed{-2}$."


def test_a_solution_that_boxes_each_part_is_not_passed_by_one_of_them():
    assert mathtask.grade(boxed("-2"), EACH_PART_BOXED) is False
    assert mathtask.grade(boxed("1, -2"), EACH_PART_BOXED) is True


def test_a_train_reference_holds_every_part_its_solution_boxes():
    assert mathtask.reference(dict(TRAIN_ROW, solution=EACH_PART_BOXED)) == "1, -2"


@pytest.mark.parametrize("depth", [1, 2, 3, 1000, 100_000])
def test_redundant_braces_at_any_depth(depth):
    wrapped = boxed("{" * depth + "5" + "}" * depth)  # 100k: the adversarial case, still linear
    assert mathtask.extract_answer(wrapped) == "5"
    assert mathtask.grade(wrapped, "5") is True and mathtask.grade(wrapped, "6") is False
    assert mathtask.extract_answer(boxed("{" * depth + "1}{2" + "}" * depth)) == "{1}{2}"


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.lists(st.sampled_from(["{", "}", " ", "5", "\\{", "\\}", "\\\\"]), max_size=14).map("".join)
)
def test_stripping_braces_in_one_pass_matches_peeling_them_one_at_a_time(text):
    text = text.strip()
    peeled = (
        text  # the definition, quadratic: while the first brace closes at the very end, drop it
    )
    while peeled.startswith("{") and mathtask._box_end(peeled, 0) == len(peeled):
        peeled = peeled[1:-1].strip()
    assert mathtask._strip_wrapping_braces(text) == peeled


FORMAT_CASES = [
    (r"... so the answer is $\boxed{5}$.", True),
    (r"\boxed{5}", True),
    (r"\[\boxed{5}\]", True),
    (r"**\boxed{5}**", True),
    (r"\boxed {5}", True),
    (r"\fbox{5}", True),
    (r"\boxed{5} and that is all.", False),  # not at the end
    (r"\boxed{5} \boxed{5}", False),  # not once
    (r"\boxed{4} ... \boxed{5}", False),
    (r"\boxed{}", False),
    (r"\boxed{5", False),
    ("5", False),
    ("", False),
]


@pytest.mark.parametrize("completion,ok", FORMAT_CASES)
def test_format_ok(completion, ok):
    assert mathtask.format_ok(completion) is ok


latex = st.lists(
    st.sampled_from(
        [
            "\\boxed",
            "\\fbox",
            "{",
            "}",
            "\\frac",
            "1",
            "2",
            "0.5",
            "x",
            "^",
            "_",
            "\\sqrt",
            ",",
            ".",
            "-",
            " ",
            "\\text{",
            "cm",
            "\u03c0",
            "\u00b0",
            "\\left(",
            "\\right)",
            "\\infty",
            "\\{",
            "\\}",
            "=",
            "\\pm",
            "or",
            "%",
            "\\%",
            "[",
            ")",
            "\\",
            "$",
            "\\!",
            "\uff11",
        ]
    ),
    max_size=25,
).map("".join)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    completion=st.one_of(latex, st.text(max_size=100)),
    reference=st.one_of(latex, st.text(max_size=20)),
)
def test_fuzz_grade_never_raises_and_is_deterministic(completion, reference):
    mathtask._equivalent.cache_clear()  # the second call must recompute, not read the cache
    first = mathtask.grade(completion, reference)
    mathtask._equivalent.cache_clear()
    assert isinstance(first, bool) and mathtask.grade(completion, reference) is first
    assert isinstance(mathtask.format_ok(completion), bool)


# ---- verdicts, as properties over random numbers -------------------------------------------------
rationals = st.one_of(
    st.integers(-(10**7), 10**7).map(Fraction),
    st.builds(Fraction, st.integers(-(10**7), 10**7), st.integers(1, 64)),
)


def as_latex(q):
    r"""A number as MATH references write it: 7, -3, \frac{3}{8}, -\frac{1}{2}."""
    if q.denominator == 1:
        return str(q.numerator)
    return ("-" if q < 0 else "") + f"\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


@st.composite
def equivalent_forms(draw, q):
    """q written in one of the forms the verifier takes for the same number, inside one of the
    boxes it reads."""
    sign = draw(st.sampled_from(["-", "\u2212"])) if q < 0 else ""
    n, d = abs(q.numerator), q.denominator
    forms = []
    if d == 1:
        forms += [
            sign + str(n),
            sign + str(n) + ".0",
            sign + str(n) + "^\\circ",
            sign + str(n) + "\\%",
            sign + str(n) + "\\text{ cm}",
            f"{sign}\\frac{{{2 * n}}}{{2}}",
        ]
        if n >= 1000:
            forms += [sign + f"{n:,}", sign + f"{n:,}".replace(",", "{,}")]
    else:
        k = draw(st.integers(2, 5))
        forms += [
            f"{sign}\\frac{{{n}}}{{{d}}}",
            f"{sign}\\dfrac{{{n}}}{{{d}}}",
            f"{sign}{n}/{d}",
            f"{sign}\\frac{{{k * n}}}{{{k * d}}}",
            f"\\frac{{{'-' if q < 0 else ''}{n}}}{{{d}}}",
        ]
        if n < 10 and d < 10:
            forms.append(f"{sign}\\frac{n}{d}")
        if 10**6 % d == 0:
            forms.append(sign + str(Fraction(n, d).numerator * (10**6 // d) / 10**6).rstrip("0"))
    answer = draw(st.sampled_from(forms))
    box = draw(
        st.sampled_from(
            [
                "\\boxed{{{}}}",
                "\\boxed {{{}}}",
                "\\fbox{{{}}}",
                "\\boxed{{{{{}}}}}",
                "\\boxed{{\\displaystyle {}}}",
            ]
        )
    )
    work = draw(st.text("abcxyz =+0123456789.", max_size=30))
    return f"{work} so the answer is ${box.format(answer)}$."


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data(), q=rationals)
def test_fuzz_a_box_of_an_equivalent_form_is_graded_right(data, q):
    completion = data.draw(equivalent_forms(q))
    assert mathtask.grade(completion, as_latex(q)) is True, completion


@settings(max_examples=100, deadline=None, derandomize=True)
@given(data=st.data(), q=rationals, other=rationals)
def test_fuzz_a_different_number_is_graded_wrong(data, q, other):
    completion = data.draw(equivalent_forms(q))
    for wrong in {other, q + 1, q * 2, -q, Fraction(q.numerator, q.denominator + 1)} - {q}:
        assert mathtask.grade(completion, as_latex(wrong)) is False, (completion, as_latex(wrong))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(a=rationals, b=rationals)
def test_fuzz_the_last_box_binds(a, b):
    if a == b:
        return
    completion = f"\\boxed{{{as_latex(a)}}} no, \\boxed{{{as_latex(b)}}}"
    assert (
        mathtask.grade(completion, as_latex(b)) is True
        and mathtask.grade(completion, as_latex(a)) is False
    )


@settings(
    max_examples=10, deadline=None, derandomize=True
)  # hedges are settled by the sympy worker: slower
@given(a=rationals, b=rationals)
def test_fuzz_a_hedge_pays_for_neither_answer(a, b):
    if a == b:
        return
    for hedge in (f"{as_latex(a)} \\text{{ or }} {as_latex(b)}", f"{as_latex(a)}, {as_latex(b)}"):
        assert (
            mathtask.grade(boxed(hedge), as_latex(a)) is False
            and mathtask.grade(boxed(hedge), as_latex(b)) is False
        )


def test_adversarial_inputs_are_bounded_and_raise_nothing():
    from scripts.bench_verifiers import adversarial_cases

    for name, task, completion, reference in adversarial_cases():
        if task is mathtask:
            assert isinstance(mathtask.grade(completion, reference), bool), name
            assert isinstance(mathtask.format_ok(completion), bool), name
    assert mathtask.grade(boxed("x+1"), "1+x")  # and the worker still serves


# The size guard bounds b^e by e's value: a fraction in the exponent makes it smaller, not bigger.
@pytest.mark.parametrize(
    "answer,reference",
    [
        (r"10^{\frac{\sqrt{13} - 5}{6}}", r"10^{\frac{-5+\sqrt{13}}{6}}"),
        (r"2^{\frac{\sqrt{2}}{2}}", r"\sqrt{2}^{\sqrt{2}}"),
    ],
)
def test_a_power_with_a_fraction_in_its_exponent_is_compared_not_refused(answer, reference):
    assert mathtask.grade(boxed(answer), reference) is True


@pytest.mark.parametrize(
    "answer", [r"2^{30000000}", r"2^{10^{7} + 1}", r"2^{3 \cdot 10^{7}}", r"2^{10^{-20000}}"]
)
def test_a_power_too_big_to_compute_exactly_is_still_refused(answer):
    parse, _ = math_sandbox._sympy_tools()  # parsing builds the tree unevaluated: cheap
    assert math_sandbox._digits(parse(mathtask.normalize(answer)), [2000]) > math_sandbox.MAX_DIGITS


def test_no_verifier_executes_model_text(monkeypatch, tmp_path):
    import sympy
    import sympy.parsing.sympy_parser as sympy_parser

    monkeypatch.setattr(math_sandbox, "USE_WORKER", False)  # run sympy in this process, under watch
    pwned = tmp_path / "pwned"
    payloads = [
        f"__import__('os').system('touch {pwned}')",
        f"eval(\"open('{pwned}','w')\")",
        f"\\text{{__import__('os').system('touch {pwned}')}}",
        "x.__class__.__mro__",
        "lambda: 0",
        f'exec(\'open("{pwned}", "w")\')',
    ]
    honest = [(boxed(a), r, v) for a, r, v in EQUIV_CASES if "import" not in a]
    for completion, ref, _ in honest + [(boxed(p), "0", False) for p in payloads]:
        mathtask.grade(completion, ref)  # warm up: sympy's lazy imports happen before the guard
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args[:1])
        raise RuntimeError("refused to execute text")

    def refuse_strings(real, only_if=lambda text: True):
        def guarded(a, *args, **kwargs):
            if isinstance(a, str) and only_if(a):
                return refuse(a)
            return real(a, *args, **kwargs)

        return guarded

    # sympify / parse_expr turn text into Python: refused outright. eval / exec are refused on
    # anything carrying the payloads' fingerprints (sympy exec()s polynomial code it writes itself).

    def tainted(text):
        return any(t in text for t in ("__import__", "pwned", "__class__", "lambda"))

    monkeypatch.setattr(builtins, "eval", refuse_strings(builtins.eval, tainted))
    monkeypatch.setattr(builtins, "exec", refuse_strings(builtins.exec, tainted))
    for mod in [
        m
        for name, m in list(sys.modules.items())
        if isinstance(m, types.ModuleType)
        and name.split(".")[0] in ("sympy", "latex2sympy2_extended", "math_verify", "tasks")
    ]:
        if getattr(mod, "sympify", None) is sympy.sympify:
            monkeypatch.setattr(mod, "sympify", refuse_strings(sympy.sympify))
        if getattr(mod, "parse_expr", None) is sympy_parser.parse_expr:
            monkeypatch.setattr(mod, "parse_expr", refuse)
    mathtask._equivalent.cache_clear()
    for payload in payloads:
        assert mathtask.grade(boxed(payload), "0") is False
    for completion, ref, verdict in honest:  # and grading still works with those doors shut
        assert mathtask.grade(completion, ref) is verdict, (completion, ref)
    mathtask._equivalent.cache_clear()
    assert calls == [] and not pwned.exists()


def test_worker_does_not_execute_payloads(tmp_path):
    pwned = tmp_path / "pwned"
    for payload in [
        f"__import__('os').system('touch {pwned}')",
        f"\\text{{__import__('os').system('touch {pwned}')}}",
    ]:
        mathtask._equivalent.cache_clear()
        assert mathtask.grade(boxed(payload), "5") is False
    assert not pwned.exists()


def test_grades_from_other_threads():
    cases = [(boxed(a), r, v) for a, r, v in EQUIV_CASES[:60]]
    mathtask._equivalent.cache_clear()
    with ThreadPoolExecutor(max_workers=4) as pool:
        verdicts = list(pool.map(lambda c: mathtask.grade(c[0], c[1]), cases))
    assert verdicts == [v for _, _, v in cases]


def test_a_stuck_worker_is_killed_and_replaced(monkeypatch):
    assert mathtask.grade(boxed("(x+1)^2"), "x^2+2x+1")  # a worker is up
    old = math_sandbox._worker["proc"]
    with monkeypatch.context() as m:  # every answer is late, and the worker looks busy in C code
        m.setattr(math_sandbox, "DEADLINE_S", 0.0)
        m.setattr(math_sandbox, "_cpu_seconds", lambda pid: time.monotonic() * 100)
        mathtask._equivalent.cache_clear()
        assert mathtask.grade(boxed("(x+1)^3"), "x^3+3x^2+3x+1") is False
    assert old.poll() is not None  # the stuck worker was killed
    mathtask._equivalent.cache_clear()
    assert mathtask.grade(boxed("(x+1)^3"), "x^3+3x^2+3x+1") is True  # and a fresh one serves


def test_a_starved_worker_is_waited_for(monkeypatch):
    assert mathtask.grade(boxed("(x+1)^2"), "x^2+2x+1")
    old = math_sandbox._worker["proc"]
    monkeypatch.setattr(math_sandbox, "DEADLINE_S", 0.0)  # late at once, but it has used no CPU yet
    monkeypatch.setattr(math_sandbox, "_cpu_seconds", lambda pid: 0.0)
    mathtask._equivalent.cache_clear()
    assert mathtask.grade(boxed("(x+1)^3"), "x^3+3x^2+3x+1") is True
    assert math_sandbox._worker["proc"] is old and old.poll() is None


def test_math_verify_regression_cases_give_no_false_pass_and_only_accepted_false_fails():
    from scripts.check_math_verify_cases import CASES, check

    with open(CASES, encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    agree, false_pass, accepted, other = check(cases)
    assert false_pass == [] and other == [], (false_pass, other)


# --- the task-module interface, with handwritten rows in the real schemas ---------------------
TRAIN_ROW = {
    "problem": "What is $1+1$?",
    "level": "Level 1",
    "type": "Algebra",
    "solution": r"We have $1+1=\boxed{2}$.",
}
TEST_ROW = {
    "problem": "What is $2+2$?",
    "solution": r"$2+2=\boxed{4}$.",
    "answer": "4",
    "subject": "Prealgebra",
    "level": 1,
    "unique_id": "test/prealgebra/1.json",
}


def test_reference_prompt_and_solution():
    assert mathtask.reference(TRAIN_ROW) == "2"  # train rows: the last box of the solution
    assert mathtask.reference(TEST_ROW) == "4"  # MATH-500 rows: the answer column
    assert mathtask.prompt(TEST_ROW).startswith("What is $2+2$?") and "\\boxed{" in mathtask.prompt(
        TEST_ROW
    )
    assert mathtask.grade(mathtask.solution(TRAIN_ROW), mathtask.reference(TRAIN_ROW))


def fake_datasets(monkeypatch, fail=False):
    seen = []

    def load_dataset(name, config=None, split=None):
        seen.append((name, config, split))
        if fail:
            raise ConnectionError("Couldn't reach the Hub\nmore detail")
        if name == mathtask.TEST_DATASET:
            return [TEST_ROW]
        return [dict(TRAIN_ROW, type=config, problem=f"{config} {i}") for i in range(2)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return seen


def test_load_train_uses_the_train_split_of_every_subject(monkeypatch):
    seen = fake_datasets(monkeypatch)
    rows = mathtask.load("train")
    assert {split for _, _, split in seen} == {"train"}
    assert [c for _, c, _ in seen] == list(mathtask.TRAIN_CONFIGS)
    assert len(rows) == 14 and set(rows[0]) == {"problem", "level", "type", "solution"}
    assert [r["type"] for r in mathtask.load("train", limit=7)] == list(
        mathtask.TRAIN_CONFIGS
    )  # interleaved


def test_load_test_is_math500(monkeypatch):
    seen = fake_datasets(monkeypatch)
    assert mathtask.load("test") == [TEST_ROW] and seen == [(mathtask.TEST_DATASET, None, "test")]
    with pytest.raises(ValueError):
        mathtask.load("validation")


def test_load_offline_says_how_to_run_the_demo(monkeypatch):
    fake_datasets(monkeypatch, fail=True)
    with pytest.raises(RuntimeError, match="python -m chat_rl --preset=demo") as info:
        mathtask.load("test")
    assert "\n" not in str(info.value)
