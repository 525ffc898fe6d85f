r"""
Mental arithmetic for a real chat model, offline: "What is 7 + 5?", "What is 9 × 6?",
"What is 8 - 3?" on the numbers 1 to 10, generated here, so a pretrained model learns with no
hub and no internet.

Why this task: a small chat model (SmolLM2-135M-Instruct) has signal here and almost none on
GSM8K. It samples the right sum now and then, rambles, and never writes GSM8K's "#### 12" even
when asked. RL learns only from the samples a model already draws right, so the task must sit
where the model is sometimes right: on these, one sample in seven at temperature 1
(docs/smollm2.md, "The task, chosen from what the model can already do").

The verifier: the reply's last number, read as an exact rational, must equal the answer
("7 + 5 = 12.", "The answer is 12", "**12**"), the rule evaluation harnesses use for chat models
that answer in their own words (lm-evaluation-harness's "flexible-extract"). The last number
binds, so a reply that lists candidates scores the last of them, and a reply cut off in its
ramble scores whatever number it was cut after, almost never the answer. format_ok: the reply
ends with that number (punctuation and markup after it allowed). A problem's split is decided by
a hash of the problem itself: no held-out question is ever trained on.
"""

import hashlib
import random
import re
from fractions import Fraction

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "×": lambda a, b: a * b}
LOW, HIGH = 1, 10  # operands; a - b only where a >= b: no negative answers
TEST_FRACTION = 0.25  # share of the problems held out
NUMBER_RE = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")
MAX_CHARS = 20_000  # longer replies are not read: the rule stays linear and bounded on any input


def _split_of(question):
    digest = hashlib.sha256(question.encode()).digest()
    return "test" if digest[0] < 256 * TEST_FRACTION else "train"


def problems():
    """Every problem, in a fixed order: {"question", "answer"} rows."""
    rows = []
    for op, fn in OPS.items():
        for a in range(LOW, HIGH + 1):
            for b in range(LOW, HIGH + 1):
                if op != "-" or a >= b:
                    rows.append({"question": f"What is {a} {op} {b}?", "answer": fn(a, b)})
    return rows


def load(split, limit=None, seed=0):
    """The split's problems, shuffled by seed (the same for the same seed): 191 train, 64 test."""
    if split not in ("train", "test"):
        raise ValueError(f"mental has splits 'train' and 'test', not {split!r}")
    rows = [row for row in problems() if _split_of(row["question"]) == split]
    random.Random(f"mental-{split}-{seed}").shuffle(rows)
    return rows[:limit] if limit else rows


def prompt(row):
    return row["question"]


def reference(row):
    return str(row["answer"])


def extract_answer(completion):
    """The reply's last number as a string ("1,000" read as 1000), or None if it has none."""
    numbers = NUMBER_RE.findall((completion or "")[:MAX_CHARS].replace(",", ""))
    return numbers[-1] if numbers else None


def grade(completion, reference):
    answer = extract_answer(completion)
    return answer is not None and reference is not None and Fraction(answer) == Fraction(reference)


def format_ok(completion):
    """The reply ends with its answer: only punctuation, markup and blanks after the last number."""
    text = (completion or "")[:MAX_CHARS].replace(",", "")
    last = None
    for last in NUMBER_RE.finditer(text):
        pass
    return last is not None and not re.search(r"\w", text[last.end() :])
