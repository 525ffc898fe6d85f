r"""
GSM8K (openai/gsm8k, config "main"): grade-school word problems whose reference solutions end
in "#### <number>".

Rows keep the data set's own schema: {"question": str, "answer": "<worked solution>\n#### 72"}.

The verifier's rule: the FIRST "####" that is followed by a number binds, and that number, read
as an exact rational, must equal the reference.
  "#### 18", "#### 18.0", "#### 18.00", "####18"           -> 18   (exact rationals: all equal)
  "#### 1,000" -> 1000, but "#### 1,00" / "#### 1,0000"     -> malformed (bad thousands groups)
  "#### $18", "#### **18**", "#### 18%", "#### 18.", "#### 18 apples", "#### -$5", "#### \u22125"
                                                            -> decoration tolerated
  "#### Step 1: add\n...\n#### 18"                          -> 18   (a heading is not an answer)
  "#### 17 #### 18", "#### 17 or 18", "#### 18/1", "#### 12.3.4", "#### 1e3"
                                                            -> malformed: the rest of the answer
     line may hold words but no other digit, so no hedge or expression pays.
  "#### 1,00\n#### 100"                                     -> malformed, score 0: the binding
     marker holds garbage and there is NO fallback to a later marker.
  "#### 17\n#### 18"                                        -> 17 (first binds; format_ok fails)
Digits are ASCII only (a full-width "１８" is not a number here). format_ok is stricter: exactly
one "####", on the last line, followed by nothing but "-?digits(.digits)?".

--gsm8k-answer=last-number grades by the reply's last number instead (last_number_task): chat
models such as SmolLM2 answer in their own words and never write "####", and evaluation harnesses
grade them so (lm-evaluation-harness's "flexible-extract"). The prompt is the same, so the two rules
compare on the same replies. A number there: digits, with valid thousands groups or none, and a
decimal part; a "$" before it, a sign only where no word or digit precedes it (in "10-8" the number
is 8); a period after it ends the sentence. Compared as exact rationals with the reference, as
"####" is:
  "So she has $1,250.", "The answer is 1250", "**1250**", "1250.00"   -> 1250
  "1250 or 1300"                                                        -> 1300 (the last binds)
  "#### 1250\nThat is 1250 dollars for 3 people."                       -> 3
format_ok: the reply ends with its last number (punctuation and markup after it allowed).
"""

import re
from fractions import Fraction
from types import SimpleNamespace

from tasks.common import use_cache_if_hub_unreachable

DATASET, CONFIG = "openai/gsm8k", "main"
ANSWER_RULES = ("hash", "last-number")  # --gsm8k-answer: the first '#### n', or the last number

INSTRUCTION = (
    "Solve the problem step by step. On the last line write the final answer as "
    "'#### <number>' (digits only)."
)


def load(split, limit=None):
    """The train (7473) or test (1319) split through HF `datasets`, imported here so other tasks
    never pay for it."""
    if split not in ("train", "test"):
        raise ValueError(f"gsm8k has splits 'train' and 'test', not {split!r}")
    use_cache_if_hub_unreachable()
    from datasets import load_dataset

    try:
        ds = load_dataset(DATASET, CONFIG, split=split)
    except Exception as e:  # no network, no cache, hub error: one actionable line, not a traceback
        raise RuntimeError(
            f"could not load {DATASET} ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
            "offline? run the offline demo instead: python -m chat_rl --preset=demo"
        ) from None
    rows = [{"question": r["question"], "answer": r["answer"]} for r in ds]
    return rows[:limit] if limit else rows


def prompt(row):
    return f"{row['question']}\n\n{INSTRUCTION}"


def reference(row):
    return extract_answer(row["answer"])


def solution(row):
    # the data set's own text, calculator annotations (<<48/2=24>>) kept: a supervised warm-up on
    # it teaches the syntax the engine's tool answers (--tool=calculator), and its forced results
    # are what follows the '='
    return row["answer"]


# ---------------------------------------------------------------------------------------------
# The verifier (rules and examples in the module docstring). Plain string code: no eval, no
# sympy, linear scans, so it is bounded on any input and safe in any thread.
MARKER_RE = re.compile(r"####")
# after the marker: blanks and decoration ($, \$, **), a sign, maybe a $, then digits; the
# quantifiers are possessive (*+), so the match is linear
LEAD_RE = re.compile(r"(?:[^\S\n]|\*\*|\\?\$)*+([-+\u2212]?)(?:[^\S\n]|\\?\$)*+(?=\.?[0-9])")
BODY_RE = re.compile(r"[0-9](?:[0-9,]*[0-9])?(?:\.[0-9]+)?|\.[0-9]+")
GROUPED_RE = re.compile(r"[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?")
FORMAT_RE = re.compile(r"####[ \t]*-?[0-9]+(?:\.[0-9]+)?")
MAX_BODY = 100  # characters; a longer "number" is garbage, and int() of it would be slow


def _parse_body(body):
    """Exact value of '1,234.50' / '18' / '.5', or None if the digit groups are malformed."""
    if len(body) > MAX_BODY or ("," in body and not GROUPED_RE.fullmatch(body)):
        return None
    return Fraction(body.replace(",", ""))


def _bound_number(text):
    """The value bound by the first '####' followed by a number (None if malformed or absent)."""
    for marker in MARKER_RE.finditer(text):
        lead = LEAD_RE.match(text, marker.end())
        if not lead:
            continue  # "#### Step 1": a heading, not an answer; look further
        body = BODY_RE.match(text, lead.end())
        line_end = text.find("\n", body.end())
        tail = text[body.end() : line_end if line_end >= 0 else len(text)]
        value = _parse_body(body.group())
        if value is None or any(ch.isnumeric() for ch in tail):  # 17 or 18, 18/1, 12.3.4, 18²
            return None  # the binding marker holds garbage: no fallback to a later marker
        return -value if lead.group(1) in ("-", "\u2212") else value
    return None


def _canonical(q):
    """18, -3, 2.5: the shortest exact decimal of a value that came from a decimal literal."""
    if q.denominator == 1:
        return str(q.numerator)
    k = 0
    while (10**k) % q.denominator:
        k += 1
    digits = str(abs(q.numerator) * (10**k // q.denominator)).rjust(k + 1, "0")
    return ("-" if q < 0 else "") + digits[:-k] + "." + digits[-k:]


def extract_answer(text):
    value = _bound_number(text or "")
    return None if value is None else _canonical(value)


def grade(completion, ref):
    """True iff the bound number equals the reference number exactly (as rationals)."""
    try:
        pred = _bound_number(completion or "")
        if pred is None or ref is None:
            return False
        ref = str(ref).strip()
        value = _bound_number(ref if "####" in ref else "#### " + ref)
        return value is not None and pred == value
    except Exception:  # the rules above cannot raise; this keeps "never raises" true regardless
        return False


def format_ok(completion):
    """The answer once, at the end, exactly as instructed: a last line '#### <digits>'."""
    lines = (completion or "").strip().splitlines()
    return (
        bool(lines)
        and completion.count("####") == 1
        and FORMAT_RE.fullmatch(lines[-1].strip()) is not None
        and _bound_number(lines[-1]) is not None  # and not too long to be a number
    )


# ---------------------------------------------------------------------------------------------
# The last-number rule (--gsm8k-answer=last-number; module docstring). The same discipline: no
# eval, a linear scan, a value too long to be a number is none.
LAST_NUMBER_RE = re.compile(
    r"(?<![\w.])([-\u2212]?)\$?([0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|[0-9]+(?:\.[0-9]+)?|\.[0-9]+)"
)


def _last_number(text):
    """(value, where it ends) of the text's last number, or None if it has none."""
    last = None
    for last in LAST_NUMBER_RE.finditer(text):
        pass
    if last is None or len(last.group(2)) > MAX_BODY:
        return None
    value = Fraction(last.group(2).replace(",", ""))
    return (-value if last.group(1) else value), last.end()


def last_number_answer(completion):
    found = _last_number(completion or "")
    return None if found is None else _canonical(found[0])


def last_number_grade(completion, ref):
    """True iff the reply's last number equals the reference number exactly (as rationals)."""
    found = _last_number(completion or "")
    if found is None or ref is None:
        return False
    ref = str(ref).strip()
    value = _bound_number(ref if "####" in ref else "#### " + ref)
    return value is not None and found[0] == value


def ends_with_number(completion):
    """The reply ends with its answer: only punctuation, markup and blanks after the last number."""
    found = _last_number(completion or "")
    return found is not None and not re.search(r"\w", completion[found[1] :])


def last_number_task():
    """GSM8K graded by the reply's last number: its rows, prompt and references, this verifier."""
    return SimpleNamespace(
        name="gsm8k",
        load=load,
        prompt=prompt,
        reference=reference,
        solution=solution,
        extract_answer=last_number_answer,
        grade=last_number_grade,
        format_ok=ends_with_number,
    )
