r"""
reasoning-gym's procedurally generated problems as a task: --task=rg:<dataset>, e.g.
--task=rg:basic_arithmetic --rg-config='{"min_digits": 1, "max_digits": 2}'.

reasoning-gym (pip install reasoning-gym, Apache-2.0) generates about a hundred kinds of problem
(arithmetic, counting, sorting, ciphers, puzzles) from a seed and a config, and scores an answer
to each with the data set's own score_answer, a float in [0, 1]. It is imported only here, and only
when an rg: task is asked for: --task=arith never needs it.

Rows are the generator's entries, {"question", "answer", "metadata"}, as JSON: a run fingerprints
its rows for --resume (plumbing/data.rows_fingerprint), and score_answer reads the metadata, so a
row must mean the same after a round trip through JSON. make() checks that it does for the data
set asked for (arc_agi's boards are tuples that JSON turns into lists: refused).

    prompt(row)   the question, then where to put the answer: <answer>...</answer>, reasoning-gym's
                  own convention
    score         the data set's score_answer of the text in the reply's last <answer> tags,
                  read with reasoning-gym's own extract_answer; partial credit (0.05 for a
                  well-formed wrong board) is reward, but pass@k and greedy count a sample right
                  only at 1 (evaluation.py: an answer reward >= 1)
    reference     the generator's answer ("" where it gives none: graph_color and others accept many
                  answers, and score_answer checks one against the metadata)
    grade         the exact answer, for callers that hold only the reference: never the reward here,
                  score is (tasks/common.rewards)
"""

import dataclasses
import difflib
import hashlib
import json
import os
from types import SimpleNamespace

INSTRUCTION = (
    "Give your final answer between <answer> and </answer> tags, and nothing else in them."
)
ROUND_TRIP_ROWS = 4  # held-out rows make() checks survive JSON: score_answer is slow on some sets

# Seeds. Nearly every generator seeds row i's random stream with seed + i (pool_matrix seeds numpy,
# which takes seeds below 2**32), so two sets whose seeds are closer than their sizes share rows.
# The held-out set starts at a fixed seed below 2**30, the same for every --seed, so that runs of
# other seeds are measured on the very same problems; the training set starts at 2**30 + a hash of
# --seed (below 2**31), so the two seed ranges never meet. A small config may still repeat a
# question (there are few sums of two one-digit numbers): a training row that asks a held-out
# question is dropped.
HELD_OUT_SEED = 271_828_182
TRAIN_SIZE = 1000  # --rg-train-size's default


def train_seed(seed):
    """The training set's first seed, from the run's --seed: in [2**30, 2**31)."""
    digest = hashlib.blake2b(f"rg-train-{seed}".encode(), digest_size=8).digest()
    return 2**30 + int.from_bytes(digest, "little") % 2**30


def parse_config(config):
    """--rg-config: inline JSON ('{"max_digits": 2}'), a .json file's path, or "" (the defaults)."""
    if not config.strip():
        return {}
    try:
        if config.lstrip().startswith("{"):
            options = json.loads(config)
        elif os.path.isfile(config):
            with open(config) as f:
                options = json.load(f)
        else:
            raise ValueError("not a JSON object {...}, and no such file")
    except (OSError, ValueError) as e:  # json's JSONDecodeError is a ValueError
        raise ValueError(f"--rg-config={config!r}: {str(e).splitlines()[0]}") from None
    if not isinstance(options, dict):
        raise ValueError(f"--rg-config={config!r}: not a JSON object of options")
    if {"seed", "size"} & set(options):
        raise ValueError(
            "--rg-config: seed and size are the run's (--seed, --rg-train-size, --eval-examples)"
        )
    return options


def make(dataset, config="", train_size=TRAIN_SIZE, eval_size=400, seed=0):
    """The task over reasoning-gym's `dataset`, generated with the options of `config`:
    train_size training rows from --seed's stream, eval_size held-out rows from a fixed one.
    Everything that can be checked without generating the whole sets is: a missing package, an
    unknown data set, a bad option, rows that do not survive JSON; each a ValueError in one line."""
    try:
        import reasoning_gym
        from reasoning_gym.utils import extract_answer as tag_answer
    except ImportError:
        raise ValueError(
            f"--task=rg:{dataset} needs the reasoning-gym package: pip install reasoning-gym"
        ) from None
    known = reasoning_gym.factory.DATASETS
    if dataset not in known:
        close = difflib.get_close_matches(dataset, known, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(
            f"unknown reasoning-gym data set {dataset!r} ({hint}the {len(known)} there are: "
            f"{', '.join(sorted(known))})"
        )
    options = parse_config(config)
    fields = [
        f.name for f in dataclasses.fields(known[dataset][1]) if f.name not in ("seed", "size")
    ]
    for name in options:
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(
                f"--rg-config: rg:{dataset} has no option {name!r} "
                f"({hint}its options: {', '.join(fields)})"
            )

    def generator(start, size):
        try:
            return reasoning_gym.create_dataset(dataset, seed=start, size=size, **options)
        except Exception as e:  # a bad value: the config's own assert, or any error of its own
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"--rg-config: rg:{dataset} refused it: {message}") from None

    held_out = generator(HELD_OUT_SEED, eval_size)
    for i in range(min(ROUND_TRIP_ROWS, eval_size)):
        entry = held_out[i]
        before, after = (held_out.score_answer(entry["answer"], e) for e in (entry, as_json(entry)))
        if before != after:
            raise ValueError(
                f"rg:{dataset}'s rows do not survive JSON, which a run keeps them in: its answer "
                f"scores {before} on a generated row and {after} on the row's JSON copy"
            )

    def load(split, limit=None):
        if split not in ("train", "test"):
            raise ValueError(f"rg:{dataset} has splits 'train' and 'test', not {split!r}")
        test = [as_json(held_out[i]) for i in range(eval_size)]
        if split == "test":
            return test[:limit] if limit else test
        asked = {row["question"] for row in test}
        train = generator(train_seed(seed), train_size)
        rows = [row for row in map(as_json, train) if row["question"] not in asked]
        return rows[:limit] if limit else rows

    def score(completion, row):
        # one scorer for both sets: they differ only in seed and size
        return held_out.score_answer(tag_answer(completion or ""), row)

    def grade(completion, reference):
        answer = tag_answer(completion or "")
        return bool(reference) and answer is not None and answer == reference.strip()

    def format_ok(completion):
        text = (completion or "").rstrip()
        return text.count("<answer>") == 1 and text.endswith("</answer>")

    return SimpleNamespace(
        name=f"rg:{dataset}",
        load=load,
        prompt=lambda row: f"{row['question']}\n\n{INSTRUCTION}",
        reference=lambda row: "" if row["answer"] is None else str(row["answer"]),
        extract_answer=lambda completion: tag_answer(completion or ""),
        grade=grade,
        format_ok=format_ok,
        score=score,
    )


def as_json(entry):
    """The entry as its JSON round trip gives it back: tuples become lists, and what JSON cannot
    hold (gsm_symbolic's Fractions) its str, which make()'s check catches if score_answer needs
    it."""
    return json.loads(json.dumps(entry, default=str))
