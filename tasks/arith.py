"""
An offline task: procedurally generated GSM8K-style word problems, so the whole RL loop runs with
no hub and no internet.

    Q: Ava has 23 pens, buys 4 boxes of 5 pens and gives away 9. How many pens now?
    A: 4*5=20
       23+20=43
       43-9=34
       #### 34

Rows use GSM8K's schema ({"question", "answer": "<steps>\\n#### N"}) and GSM8K's verifier, so the
demo exercises exactly the code a GSM8K run uses. Generation is deterministic by seed, and a
problem's split is decided by a hash of its numbers: no test problem's arithmetic ever appears
in training, whatever the names and objects around it.

`solution_with_slip` writes the same worked solution with one arithmetic step off by a little,
the error carried through to a wrong final answer; `solution_with_tool` writes each step as a
calculator call (`<<4*5=20>>`), whose result the engine computes. Supervised on a mix of the three,
a tiny model becomes competent but unreliable when sampled, and uses the calculator now and then:
exactly the starting point where RL with a verifier has signal to work with (see
scripts/make_demo_model.py).
"""

import hashlib
import random

from tasks import gsm8k

NAMES = [
    "Ava",
    "Ben",
    "Cara",
    "Dev",
    "Eli",
    "Fay",
    "Gus",
    "Ivy",
    "Jon",
    "Kim",
    "Leo",
    "Mia",
    "Ned",
    "Ola",
    "Pam",
    "Raj",
]
THINGS = [
    "pens",
    "apples",
    "cards",
    "books",
    "shells",
    "stamps",
    "coins",
    "eggs",
    "beads",
    "marbles",
]
TEST_FRACTION = 0.2  # share of the number space reserved for the test split


def _problem(kind, nums, name, thing, slip_at=-1, delta=0, tool=False):
    """(question, solution lines, answer). The step numbered slip_at gets `delta` added to its
    result. tool: each step a calculator call, `<<4*5=20>>`, whose result the engine forces."""
    steps = []

    def step(x, op, y):
        value = {"+": x + y, "-": x - y, "*": x * y, "/": x // y}[op]
        if len(steps) == slip_at:
            value += delta
        steps.append(f"<<{x}{op}{y}={value}>>" if tool else f"{x}{op}{y}={value}")
        return value

    if kind == 0:
        a, b, c, d = nums
        q = (
            f"{name} has {a} {thing}, buys {b} boxes of {c} {thing} and gives away {d}. "
            f"How many {thing} now?"
        )
        answer = step(step(a, "+", step(b, "*", c)), "-", d)
    elif kind == 1:
        n, p, bill = nums
        q = (
            f"{thing.capitalize()} cost ${p} each. {name} buys {n} and pays ${bill}. "
            f"What is the change?"
        )
        answer = step(bill, "-", step(n, "*", p))
    elif kind == 2:
        a, b, k = nums
        q = (
            f"{name} reads {a} pages on Monday, {b} on Tuesday and {k} times Monday's pages "
            f"on Wednesday. How many pages in all?"
        )
        wed = step(k, "*", a)
        answer = step(step(a, "+", b), "+", wed)
    else:
        g, s, m, t = nums
        q = (
            f"{g} groups of {s} kids meet. {m} kids leave and the rest form {t} equal teams. "
            f"How many kids per team?"
        )
        answer = step(step(step(g, "*", s), "-", m), "/", t)
    return q, steps, answer


def _numbers(kind, rng):
    # small numbers on purpose: a 0.8M-parameter byte-level model can learn this arithmetic, so
    # what RL has to fix is the policy's unreliability, not missing knowledge
    if kind == 0:
        return (rng.randint(10, 40), rng.randint(2, 5), rng.randint(2, 5), rng.randint(1, 9))
    if kind == 1:
        n, p = rng.randint(2, 5), rng.randint(2, 9)
        return (n, p, rng.choice([50, 100]))
    if kind == 2:
        return (rng.randint(5, 30), rng.randint(5, 30), rng.randint(2, 3))
    g, s, t = rng.randint(2, 6), rng.randint(3, 6), rng.randint(2, 5)
    r = (g * s) % t  # m = r + t*j leaves a multiple of t kids, so teams come out even
    m = r + t * rng.randint(0, (g * s - r) // t - 1)
    return (g, s, m or t, t)


def _split_of(kind, nums):
    h = hashlib.sha256(repr((kind, nums)).encode()).digest()
    return "test" if h[0] < 256 * TEST_FRACTION else "train"


def load(split, limit=None, seed=0):
    """`limit` problems of one split (default 20000 train / 500 test), fixed by the seed."""
    if split not in ("train", "test"):
        raise ValueError(f"arith has splits 'train' and 'test', not {split!r}")
    n = limit or (20000 if split == "train" else 500)
    rng = random.Random(f"arith-{split}-{seed}")
    rows, seen, misses = [], set(), 0
    while len(rows) < n:
        kind = rng.randrange(4)
        nums = _numbers(kind, rng)
        if _split_of(kind, nums) != split or (split == "test" and (kind, nums) in seen):
            misses += 1  # test problems are distinct, so pass@1 over N rows means N problems
            if misses > 200_000:
                raise ValueError(
                    f"arith has only about {len(rows)} distinct {split} problems; ask for fewer"
                )
            continue
        misses = 0
        seen.add((kind, nums))
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        q, steps, answer = _problem(kind, nums, name, thing)
        rows.append(
            {
                "question": q,
                "answer": "\n".join(steps) + f"\n#### {answer}",
                "kind": kind,
                "nums": list(nums),
                "name": name,
                "thing": thing,
            }
        )
    return rows


def prompt(row):
    return row["question"]


def reference(row):
    return gsm8k.extract_answer(row["answer"])


def solution(row):
    return row["answer"]


def solution_with_slip(row, rng):
    """The worked solution with one step's result off by 1-3 (never 0), carried to the end."""
    num_steps = row["answer"].count("\n")
    # a slip swallowed by a later step (13//5 == 12//5) would teach a wrong line with a right
    # answer: draw again until the final answer is wrong
    while True:
        delta = rng.choice([-3, -2, -1, 1, 2, 3])
        _, steps, answer = _problem(
            row["kind"],
            tuple(row["nums"]),
            row["name"],
            row["thing"],
            slip_at=rng.randrange(num_steps),
            delta=delta,
        )
        if str(answer) != reference(row):
            return "\n".join(steps) + f"\n#### {answer}"


def solution_with_tool(row):
    """The worked solution with every step a calculator call (`<<4*5=20>>`, GSM8K's annotation
    syntax): the engine forces each result, so a solution written this way cannot slip."""
    _, steps, answer = _problem(
        row["kind"], tuple(row["nums"]), row["name"], row["thing"], tool=True
    )
    return "\n".join(steps) + f"\n#### {answer}"


# the verifier is GSM8K's: the demo trains against exactly the rule a GSM8K run uses
extract_answer, grade, format_ok = gsm8k.extract_answer, gsm8k.grade, gsm8k.format_ok
