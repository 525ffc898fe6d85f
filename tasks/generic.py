r"""
The generic task (--task=data): a user's own rows and reward, with no code edited.

Rows come from --data (plumbing/data.py reads files and hub data sets), in any schema:
    prompt(row)    = row[prompt_column], then a blank line and `instruction` if one is given
    reference(row) = the answer column, as the verifier reads it:
        gsm8k  the number after "####", or the whole cell if it is a bare number ("72", 72,
               "1,000", "-2.5")
        math   the last \boxed{} of the cell if it has one (its last boxes where they form one
               list), else the whole cell; graded by \boxed{} equivalence
        exact  the stripped cell; a completion is right if, stripped, it is that string
    reward         a user's function(completion: str, row: dict) -> float replaces the verifier's
                   0/1: the row holds every column, so a reward can use metadata. common.rewards
                   counts what it raises or returns that is not a finite number as an error
                   scoring 0 (docs/rewards.md: the promises, each held by
                   tests/test_user_reward.py).
"""

import re
from types import SimpleNamespace

from tasks import gsm8k, mathtask
from tasks.common import user_function

VERIFIERS = ("gsm8k", "math", "exact")
BARE_NUMBER_RE = re.compile(r"[-+]?(?:[0-9][0-9,]*)?\.?[0-9]+")


def gsm8k_reference(cell):
    text = str(cell).strip()
    if "####" not in text and not BARE_NUMBER_RE.fullmatch(text):
        return None
    return gsm8k.extract_answer(text if "####" in text else "#### " + text)


def math_reference(cell):
    text = str(cell).strip()
    return mathtask.solution_answer(text) if "\\boxed" in text or "\\fbox" in text else text or None


def exact_reference(cell):
    return str(cell).strip() or None


def exact_grade(completion, reference):
    return reference is not None and (completion or "").strip() == str(reference).strip()


def make(
    prompt_column="question", answer_column="answer", instruction="", verifier="gsm8k", reward=""
):
    """The task over rows of these columns, graded by `verifier`, or scored by `reward`
    ('file.py:function')."""
    if verifier not in VERIFIERS:
        raise ValueError(f"unknown --verifier {verifier!r} ({' | '.join(VERIFIERS)})")
    references = {"gsm8k": gsm8k_reference, "math": math_reference, "exact": exact_reference}
    to_reference = references[verifier]
    rules = {"gsm8k": gsm8k, "math": mathtask}.get(verifier)
    task = SimpleNamespace(
        name="data",
        prompt=lambda row: str(row[prompt_column]) + (f"\n\n{instruction}" if instruction else ""),
        # with a reward of its own, the answer column is the reward's to read: shown in
        # samples.jsonl as it is
        reference=(lambda row: str(row[answer_column]))
        if reward
        else (lambda row: to_reference(row[answer_column])),
        extract_answer=rules.extract_answer
        if rules
        else lambda completion: (completion or "").strip() or None,
        grade=rules.grade if rules else exact_grade,
        format_ok=rules.format_ok if rules else lambda completion: bool((completion or "").strip()),
        load=_load,
        columns=(prompt_column, answer_column),
    )
    if reward:
        task.score = user_function(reward)
    return task


def _load(split, limit=None):
    raise ValueError(
        "--task=data reads its rows from --data (a file, a folder of them or a hub data set)"
    )
