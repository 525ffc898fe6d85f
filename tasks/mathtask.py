r"""
MATH (Hendrycks et al. 2021): competition problems whose answers are LaTeX, given in \boxed{}.

Train: EleutherAI/hendrycks_math, split "train" of its 7 subject configs (7500 problems).
Test:  HuggingFaceH4/MATH-500, split "test" (500 problems). MATH-500 was drawn from MATH's *test*
       split, so training must only ever see the *train* split or the evaluation is contaminated.
Rows keep their data set's schema: train {problem, level, type, solution}, test {problem,
solution, answer, subject, level, unique_id}.

This module holds the grading rules: what counts as the answer and when two answers are the same.
The sympy comparison they end in lives in tasks/math_sandbox.py, because running sympy on model
text safely (a worker process, CPU and memory limits, no eval) is a different concern from the
rules, and the rules are what a fork edits. Everything here is plain string code, cheap and
bounded; the training process never imports sympy.

The verifier, grade(completion, reference), in three layers:
1. Extraction (ours). The answer is the LAST \boxed{...} or \fbox{...}, brace-matched
   (\boxed{\frac{22}{7}} -> \frac{22}{7}; \boxed {5} -> 5). A missing, empty, unterminated or
   nested last box is no answer (score 0): we never fall back to an earlier box, so
   "\boxed{1} ... \boxed{2}" commits to 2 and box-spamming buys nothing. Braces around the
   whole answer only group, at any depth: \boxed{{{5}}} -> 5, and so is 5 inside 100k nested
   pairs (found in linear time); \boxed{{1}{2}} -> {1}{2}, whose braces are not redundant.
   Answers of several parts may also come one part per box. Against a reference of k > 1 parts
   (a list, a set of tuples, several equations: "(2, 2), (6, 2)", "\{1, 2, 3\}", "k = 45, n = 2")
   the last k boxes, one part each, are read together as one list and compared with it as a
   set, in any order, as the reference's own list would be:
   "\boxed{(2, 2)} \text{ and } \boxed{(6, 2)}" answers "(2, 2), (6, 2)". It still commits to
   one answer, because k comes from the reference, not from the completion: against "5" only
   the last box counts, however many there are; against "1, 2" "\boxed{1}\boxed{2}\boxed{3}"
   reads {2, 3} and "\boxed{1}" alone is a part short. Earlier boxes are overruled, as for one
   part. A tuple or an interval is one part, since its brackets are part of the answer:
   "\boxed{-2}, \boxed{7}" would leave [-2, 7] and (-2, 7) unsaid. format_ok still wants the
   single box the prompt asks for. A worked solution given as the reference answers with its
   last box, or its last boxes when they are written as one list (solution_answer).
2. Normalisation and policy (ours, string code only). Unicode (π, √, −, °, ², full-width digits),
   \dfrac -> \frac, \frac12 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}, $ and \left/\right and spacing
   dropped, \text{} units dropped (5\text{ cm} = 5), degrees are a unit (30° = 30^\circ = 30) and
   so is percent (25\% = 25, NOT 0.25: otherwise "25%" would pay for both 25 and 1/4).
   Hedges inside the box are lists, and a list never equals a single answer: "17 \text{ or } 18",
   "17, 18", "\pm 3" all lose against 17 (resp. 3). Inside a number, a comma glued to the next
   digits groups thousands (32,349 = 32{,}349 = 32349), and so does a comma then \!, LaTeX's way
   of taking back the space after a comma, whatever spacing follows it (10,\!000 = 10,\! 000 =
   10000); a comma then a space separates items (32, 349 is the list of 32 and 349): otherwise
   the list would pay for the number its digits spell, and the number for the set {32, 349}. Plain
   numbers compare as exact rationals (0.5 = \frac12 = 1/2; 0.5000001 != 1/2; 3.1428 != 22/7;
   0.333 != 1/3: MATH wants exact answers and says so when it wants a decimal). Base-n numerals
   (2220_4) must match as written.
3. Equivalence (Math-Verify, the field's standard), in math_sandbox.equal: algebra
   (x+1)(x-2) = x^2-x-2, \sqrt8 = 2\sqrt2, sets in any order, tuples in order, intervals with
   their brackets, matrices, equations x=5 vs 5. Only answers that layers 1-2 could not settle and
   that are at most MAX_ANSWER_CHARS long get there.

Math-Verify gaps we work around here (math_sandbox's docstring lists the ones it closes):
- its extraction misses "\boxed {5}" and falls back to earlier boxes -> our extraction (1).
- no "°", and floats are compared after rounding to 6 decimals, so 0.5000001 == 1/2 -> we
  normalise (2) and compare plain numbers as exact rationals; math_sandbox parses every other
  number token exactly too, so no Float ever reaches verify.
"""

import re
import unicodedata
from fractions import Fraction
from functools import lru_cache

from tasks import math_sandbox
from tasks.common import use_cache_if_hub_unreachable

TRAIN_DATASET, TRAIN_CONFIGS = (
    "EleutherAI/hendrycks_math",
    (
        "algebra",
        "counting_and_probability",
        "geometry",
        "intermediate_algebra",
        "number_theory",
        "prealgebra",
        "precalculus",
    ),
)
TEST_DATASET = "HuggingFaceH4/MATH-500"

INSTRUCTION = (
    "Solve the problem step by step. At the very end, write the final answer once as "
    "\\boxed{<answer>}, in simplest exact form."
)


def _load_dataset(name, config, split):
    from datasets import load_dataset

    try:
        return load_dataset(name, config, split=split)
    except Exception as e:  # no network, no cache, hub error: one actionable line, not a traceback
        raise RuntimeError(
            f"could not load {name} ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
            "offline? run the offline demo instead: python -m chat_rl --preset=demo"
        ) from None


def load(split, limit=None):
    """MATH train (7500, subjects interleaved: a limit still covers all) or MATH-500 test (500)."""
    if split not in ("train", "test"):
        raise ValueError(f"math has splits 'train' and 'test', not {split!r}")
    use_cache_if_hub_unreachable()
    if split == "test":
        rows = [dict(r) for r in _load_dataset(TEST_DATASET, None, "test")]
    else:  # the train split only: MATH-500 comes from MATH's test split
        subjects = [
            [dict(r) for r in _load_dataset(TRAIN_DATASET, c, "train")] for c in TRAIN_CONFIGS
        ]
        rows = [s[i] for i in range(max(map(len, subjects))) for s in subjects if i < len(s)]
    return rows[:limit] if limit else rows


def prompt(row):
    return f"{row['problem']}\n\n{INSTRUCTION}"


def reference(row):
    # MATH-500 rows carry the answer; train rows only a solution, whose boxes give it
    return row["answer"] if row.get("answer") else solution_answer(row["solution"])


def solution(row):
    return row["solution"]


# ---------------------------------------------------------------------------------------------
# 1. Extraction: linear passes, whatever the input (a megabyte of garbage, 100k nested braces).
BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*")


def _box_end(text, i):
    """Index just past the brace that closes text[i] == '{', or -1 if it never closes."""
    depth, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2  # \{ \} \\ are characters, not grouping
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def _boxes(text):
    r"""Every top-level box, in order, as (content, start, end): start where its command begins,
    end just past its closing brace; content None for a box without braces ("\boxed 5"). An
    unterminated box is the last one: nothing after it can close. One linear pass."""
    boxes, pos = [], 0
    while True:
        m = BOX_RE.search(text, pos)
        if not m:
            return boxes
        start = m.end()
        if start >= len(text) or text[start] != "{":
            boxes.append((None, m.start(), start))  # "\boxed 5" or a bare "\boxed": not an answer
            pos = start
            continue
        end = _box_end(text, start)
        if end < 0:
            boxes.append((None, m.start(), len(text)))
            return boxes
        boxes.append((text[start + 1 : end - 1], m.start(), end))
        pos = end


def _last_box(text):
    """(content, end) of the last top-level box; content None if that box is malformed."""
    boxes = _boxes(text)
    return (boxes[-1][0], boxes[-1][2]) if boxes else None


_BRACE_OR_ESCAPE = re.compile(r"\\.|[{}]", re.S)  # \{ \} \\ are characters, as in _box_end


def _strip_wrapping_braces(s):
    r"""s without the brace pairs that wrap all of it: {{{5}}} -> 5, { {5} } -> 5.
    Only a pair around the whole is grouping and nothing else: {1}{2}, {1}^2 and \frac{1}{2} stay.
    Linear at any depth (peeling one pair and calling _box_end again would be quadratic): the
    brace at the front that opens depth d+1 closes where the depth first falls back to d, so one
    pass records those places, then the pairs that end at the very end are peeled."""
    if not s.startswith("{"):
        return s
    depth, low, closes = 0, len(s), {}  # closes[d]: where the depth first falls back to d
    for token in _BRACE_OR_ESCAPE.finditer(s):
        if token.group() == "{":
            depth += 1
        elif token.group() == "}":
            depth -= 1
            if depth < low:
                low, closes[depth] = depth, token.start()
                if depth == 0 and token.start() < len(s) - 1:
                    return s  # the first brace closes before the end: nothing wraps the whole
    lo, hi, d = 0, len(s) - 1, 0
    while lo < hi and s[lo] == "{" and closes.get(d) == hi:
        lo, hi, d = lo + 1, hi - 1, d + 1
        while lo <= hi and s[lo].isspace():
            lo += 1
        while hi >= lo and s[hi].isspace():
            hi -= 1
    return s[lo : hi + 1]  # "" for {} or {{ }}: an empty box


def _answer(content):
    """What one box's content commits to; None for a malformed, empty or nested box."""
    if content is None:
        return None
    content = _strip_wrapping_braces(content.strip())  # \boxed{{5}} commits to 5, at any depth
    if not content or BOX_RE.search(content):  # empty, or a box in a box
        return None
    return content


def extract_answer(text):
    boxes = _boxes(text or "")
    return _answer(boxes[-1][0]) if boxes else None


# What may stand between two boxes of one list in a worked solution: spacing and math delimiters,
# then at most one connective (a comma, "and", "or"), which a unit word may precede and the name
# of the next value may follow ("\boxed{1} cm and \boxed{2}", "$x = \boxed{1}$ or $x = \boxed{2}$").
_SPACING = r"(?:\s|\$|\\[()\[\]]|\\q?quad(?![A-Za-z])|\\[,;:! ]|~)*"
_JOIN = r"(?:,?\s*(?:and|or)\b|,|;)"
_UNIT = r"(?:\\text\s*\{\s*[A-Za-z]+\s*\}|[A-Za-z]+\b)"
_NAME = r"(?:[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?\s*=)"
LIST_GAP = re.compile(
    rf"{_SPACING}(?:(?:{_UNIT}{_SPACING})?(?:\\text\s*\{{\s*{_JOIN}\s*\}}|{_JOIN}){_SPACING}"
    rf"(?:{_NAME}{_SPACING})?)?"
)
MAX_GAP_CHARS = 40


def solution_answer(text):
    r"""The answer a worked solution gives: its last box, or its last boxes when they are written
    as one list ("$\boxed{1}$ and $\boxed{-2}$" -> "1, -2"; "\boxed{1} papers and \boxed{2} bins"
    -> "1, 2"). A box followed by prose ("\boxed{3}. So the area is \boxed{12}") was a step on
    the way. None where the last box is malformed or there is none."""
    text = text or ""
    boxes = _boxes(text)
    parts = [_answer(boxes[-1][0])] if boxes else [None]
    for i in range(len(boxes) - 1, 0, -1):  # walk back while the boxes are joined as a list
        gap = text[boxes[i - 1][2] : boxes[i][1]]
        earlier = _answer(boxes[i - 1][0])
        if (
            parts[-1] is None
            or earlier is None
            or len(gap) > MAX_GAP_CHARS
            or not LIST_GAP.fullmatch(gap)
        ):
            break
        parts.append(earlier)
    return None if parts[0] is None else ", ".join(reversed(parts))


def format_ok(completion):
    """Exactly one box, well-formed and non-empty, followed only by closing punctuation."""
    text = completion or ""
    box = _last_box(text)
    if len(BOX_RE.findall(text)) != 1 or box is None or not (box[0] or "").strip():
        return False
    return re.fullmatch(r"(?:\s|\$|\\\]|\\\)|\.|\*)*", text[box[1] :]) is not None


# ---------------------------------------------------------------------------------------------
# 2. Normalisation and policy: plain string code, linear regexes, capped sizes.
MAX_ANSWER_CHARS = 400  # longer answers are compared as strings only (MATH answers are short)

UNICODE = {
    "π": r"\pi ",
    "√": r"\sqrt",
    "−": "-",
    "–": "-",
    "×": r"\times ",
    "·": r"\cdot ",
    "⋅": r"\cdot ",
    "÷": r"\div ",
    "∞": r"\infty ",
    "≤": r"\le ",
    "≥": r"\ge ",
    "≠": r"\ne ",
    "°": r"^\circ",
    "²": "^2",
    "³": "^3",
    "∪": r"\cup ",
    "∩": r"\cap ",
    "∈": r"\in ",
    "θ": r"\theta ",
    "½": r"\frac{1}{2}",
    "⅓": r"\frac{1}{3}",
    "¼": r"\frac{1}{4}",
    "¾": r"\frac{3}{4}",
    "⁄": "/",
}
TEXT_CMD = r"\\(?:text|textbf|textrm|textit|mbox)\s*"
SUBS = [  # (pattern, replacement), applied in order
    (r"\\[dt]frac(?![A-Za-z])", r"\\frac"),
    (r"\\(?:left|right)\.|\\(?:left|right|[bB]igg?[lr]?)(?![A-Za-z])", ""),
    (r",\s*\\!\s*", ","),  # 10,\!000 and 10,\! 000: thousands
    (
        r"\\\\|\\(?:display|text)style|\\[,;:! ]|\\\$|\$|\\[()\[\]]",  # keep \\, drop the rest
        lambda m: m.group() if m.group() == "\\\\" else "",
    ),
    (r"\\q?quad(?![A-Za-z])|~", " "),
    (r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree", ""),  # degrees are a unit
    (r"\\%|%", ""),  # and so is percent
    (TEXT_CMD + r"\{\s*(?:or|and)\s*\}|\b(?:or|and)\b", ","),  # "17 or 18" is a list of two
    (r"\\mathrm\s*\{\s*([A-Za-z])\s*\}", r"\1"),  # \mathrm{i}, \mathrm{e}
    (
        r"\\frac\s*(\d|\{[^{}]*\}|\\[A-Za-z]+)\s*(\d|\{[^{}]*\}|\\[A-Za-z]+)",
        r"\\frac{\1}{\2}",
    ),  # \frac\pi2
    (r"\\sqrt\s*(\d)", r"\\sqrt{\1}"),
    (r"\{\{([^{}]*)\}\}", r"{\1}"),
    (r"\{,\}", ","),  # 1{,}000
]
SUBS = [(re.compile(p), r) for p, r in SUBS]
TEXT_UNIT = re.compile(TEXT_CMD + r"\{[A-Za-z .]*\}(?:\^\{?\d\}?)?")
NUMBER = re.compile(r"(-?)([0-9]{1,3}(?:,[0-9]{3})+|[0-9]*)(?:\.([0-9]+))?")  # ASCII digits only
FRACTION = re.compile(r"(-?)\\frac\{(-?[0-9]+)\}\{(-?[0-9]+)\}|(-?)([0-9]+)/([0-9]+)")


def normalize(answer):
    """The answer as plain LaTeX with decoration, units and look-alike unicode removed."""
    s = "".join(UNICODE.get(c, c) for c in answer if unicodedata.category(c) != "Cf")
    s = unicodedata.normalize("NFKC", s)
    for pattern, repl in SUBS:
        s = pattern.sub(repl, s)
    if re.search(r"[0-9]", TEXT_UNIT.sub("", s)):  # a number is there: the words are its unit
        s = TEXT_UNIT.sub("", s)
        words = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ")
        tail = s[len(words) :]
        if words[-1:].isdigit() or words.endswith("}"):  # "5 cm", "\frac{1}{2} inches"
            if tail.startswith(" ") and all(len(w) > 1 for w in tail.split()):
                s = words
    return " ".join(s.split()).rstrip(" .,;:")


LIST_COMMA = re.compile(r",\s")  # a comma then a space separates items: "32, 349" is two numbers


def _compact(s):
    """s without its spaces, except the one after a list comma: "1 000" -> "1000", but "32, 349"
    stays apart from "32,349" (a list of two is not the number 32349)."""
    return re.sub(r"(?<!,) ", "", s)


def as_rational(s):
    """An exact Fraction for a plain number (-3, 1,000, 0.25, .5, 1/2, \frac{-1}{2}), else None."""
    if LIST_COMMA.search(s):
        return None  # a list, however its items would read glued together
    s = s.replace(" ", "")
    if len(s) > 100:
        return None
    m = NUMBER.fullmatch(s)
    if m and (m.group(2) or m.group(3)):
        q = Fraction(m.group(2).replace(",", "") or "0") + Fraction(
            int(m.group(3) or 0), 10 ** len(m.group(3) or "")
        )
        return -q if m.group(1) else q
    m = FRACTION.fullmatch(s)
    if m:
        sign, num, den = (m.group(1), m.group(2), m.group(3)) if m.group(2) else m.group(4, 5, 6)
        if int(den) != 0:
            return Fraction(int(num), int(den)) * (-1 if sign else 1)
    return None


@lru_cache(maxsize=8192)
def _equivalent(pred, ref):
    p, r = normalize(pred), normalize(ref)
    if not p or not r:
        return False
    compact_p, compact_r = _compact(p), _compact(r)
    if compact_p == compact_r:
        return True
    if re.search(r"[0-9]_", compact_p + " " + compact_r):  # base-n numerals: sympy drops the base
        return compact_p.replace("{", "").replace("}", "") == compact_r.replace("{", "").replace(
            "}", ""
        )
    qp, qr = as_rational(p), as_rational(r)
    if qp is not None and qr is not None:
        return qp == qr
    if len(p) > MAX_ANSWER_CHARS or len(r) > MAX_ANSWER_CHARS:
        return False
    return math_sandbox.equal(p, r)  # layer 3, in its worker process


THOUSANDS = re.compile(r"(?<![0-9.,])[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])")  # 32,349: one number


def count_parts(answer):
    r"""How many items a list answer holds: its commas and semicolons outside brackets, plus one.
    "(2, 2), (6, 2)" -> 2, "\{1, 2, 3\}" -> 3, "k = 45, n = 2" -> 2, "6 \text{ and } 8" -> 2. A
    tuple or an interval is one answer whose brackets are part of it ("(3, \frac{\pi}{2})" -> 1),
    and a number with thousands is one number ("32,349" -> 1)."""
    s = _strip_wrapping_braces(THOUSANDS.sub("0", normalize(answer)))
    if s.startswith("\\{") and s.endswith("\\}"):
        # a set's own braces; "\{1\} \cup \{2\}" is caught below: its depth goes negative
        s = s[2:-2]
    depth, parts = 0, 1
    for c in s:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth < 0:
                return 1  # the braces stripped were not one pair around everything
        elif c in ",;" and depth == 0:
            parts += 1
    return parts


def grade(completion, reference):
    """1/0 verdict on the last box of completion against reference, or, against a reference of
    k > 1 parts, on its last k boxes taken together; pure, bounded, never raises."""
    try:
        boxes = _boxes(completion or "")
        pred = _answer(boxes[-1][0]) if boxes else None
        ref = _strip_wrapping_braces(str(reference).strip()) if reference is not None else ""
        if "\\boxed" in ref or "\\fbox" in ref:  # a whole solution passed as the reference
            ref = solution_answer(ref) or ""
        if pred is None or not ref or len(pred) > 10 * MAX_ANSWER_CHARS:
            return False
        if _equivalent(pred, ref):
            return True
        k = count_parts(ref)
        if not 1 < k <= len(boxes):
            return False  # one part: the last box alone; or fewer boxes than parts
        last = [_answer(content) for content, _, _ in boxes[-k:]]
        if any(a is None or count_parts(a) != 1 for a in last):
            return False  # one part per box, so k boxes hold exactly k parts
        together = ", ".join(last)
        return len(together) <= 10 * MAX_ANSWER_CHARS and _equivalent(together, ref)
    except Exception:
        return False
