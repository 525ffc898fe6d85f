r"""
Mental arithmetic for a real chat model, offline: "What is 7 + 5?", "What is 9 × 6?",
"What is 8 - 3?" on the numbers 1 to 10, generated here, so a pretrained model learns with no
hub and no internet.

Why this task: a small chat model (SmolLM2-135M-Instruct) has signal here and almost none on
GSM8K. It samples the right sum now and then, rambles, and never writes GSM8K's "#### 12" even
when asked. RL learns only from the samples a model already draws right, so the task must sit
where the model is sometimes right: on these, about one sample in six at temperature 1
(docs/smollm2.md, "The task, chosen from what the model can already do").

The verifier: the reply's last number, read as an exact rational, must equal the answer
("7 + 5 = 12.", "The answer is 12", "**12**"), the rule evaluation harnesses use for chat models
that answer in their own words (lm-evaluation-harness's "flexible-extract"). The last number
binds, so a reply that lists candidates scores the last of them, and a reply cut off in its
ramble scores whatever number it was cut after, almost never the answer. format_ok: the reply
ends with that number (punctuation and markup after it allowed). A problem's split is decided by
a hash of the problem itself: no held-out question is ever trained on.

Harder, by flag (make): --mental-digits=2 or 3 draws the operands from 10-99 or 100-999, and
--mental-ops picks the operations (x alone, +-): a ladder from what the model half solves
to what it never samples right (README, "Where RL adds reach").
"""

import hashlib
import random
import re
from fractions import Fraction
from functools import partial
from types import SimpleNamespace

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "×": lambda a, b: a * b}
LOW, HIGH = 1, 10  # operands; a - b only where a >= b: no negative answers
TEST_FRACTION = 0.25  # share of the problems held out
NUMBER_RE = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")
MAX_CHARS = 20_000  # longer replies are not read: the rule stays linear and bounded on any input
DRAWN = 4000  # problems of 2 or more digits: too many pairs to list, so this many are drawn


def _split_of(question):
    digest = hashlib.sha256(question.encode()).digest()
    return "test" if digest[0] < 256 * TEST_FRACTION else "train"


def problems(digits=1, ops=tuple(OPS)):
    """Every problem, in a fixed order: {"question", "answer"} rows. One digit: every pair of 1 to
    10 (255 problems with all three operations); more: DRAWN distinct problems of operands with
    that many digits, drawn with a seed of their own (the same on every run)."""
    if digits == 1:
        triples = [
            (op, a, b) for op in ops for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)
        ]
    else:
        rng, drawn = random.Random(f"mental-{digits}-{''.join(ops)}"), {}
        low, high = 10 ** (digits - 1), 10**digits - 1
        while len(drawn) < DRAWN:
            op, a, b = rng.choice(ops), rng.randint(low, high), rng.randint(low, high)
            drawn[(op, max(a, b), min(a, b)) if op == "-" else (op, a, b)] = None  # a - b >= 0
        triples = list(drawn)
    return [
        {"question": f"What is {a} {op} {b}?", "answer": OPS[op](a, b)}
        for op, a, b in triples
        if op != "-" or a >= b
    ]


def load(split, limit=None, seed=0, digits=1, ops=tuple(OPS)):
    """The split's problems, shuffled by seed (the same for the same seed): 191 train, 64 test at
    one digit and all three operations."""
    if split not in ("train", "test"):
        raise ValueError(f"mental has splits 'train' and 'test', not {split!r}")
    rows = [row for row in problems(digits, ops) if _split_of(row["question"]) == split]
    stream = f"mental-{split}-{seed}" if (digits, tuple(ops)) == (1, tuple(OPS)) else None
    random.Random(stream or f"mental-{digits}-{''.join(ops)}-{split}-{seed}").shuffle(rows)
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


def make(digits=1, ops="+-×"):
    """The task at a difficulty: --mental-digits (1, 2 or 3) and --mental-ops (some of "+-×", x or *
    for ×); a ValueError naming what is wrong. The same prompt and verifier at every difficulty."""
    ops = ops.replace("x", "×").replace("*", "×")
    if digits not in (1, 2, 3):
        raise ValueError(f"--mental-digits must be 1, 2 or 3, got {digits}")
    if not ops or set(ops) - set(OPS) or len(set(ops)) < len(ops):
        raise ValueError(f"--mental-ops must be some of '+-x', each once, got {ops!r}")
    return SimpleNamespace(
        load=partial(load, digits=digits, ops=tuple(ops)), prompt=prompt, reference=reference,
        extract_answer=extract_answer, grade=grade, format_ok=format_ok,
    )  # fmt: skip
