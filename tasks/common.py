"""
What a task is: where its problems come from, how one becomes a prompt, and how a completion is scored.

A task is a module in this package with these names (a module, not a class: one obvious home):
    load(split, limit=None) -> list[dict]  rows in the data set's own schema; split is "train" or "test"
    prompt(row) -> str                      the user message the policy sees
    reference(row) -> str                   the row's final answer, as a string
    extract_answer(completion) -> str|None  the answer the completion commits to
    grade(completion, reference) -> bool    the verifier: pure, deterministic, never raises
    format_ok(completion) -> bool           the answer given once, in the required form, at the end
Optional: solution(row) -> str, a worked solution ending in the answer (supervised warm-up).

`get_task(name)` imports a task module lazily, so `--task=arith` never imports `datasets`.
"""

import importlib
import os
import urllib.error
import urllib.request

HUB_TIMEOUT_S = 3.0  # how long a data loader waits for the hub before it reads the local cache only

TASKS = {"gsm8k": "tasks.gsm8k", "math": "tasks.mathtask", "arith": "tasks.arith"}


def get_task(name):
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r} (choose from {', '.join(TASKS)})")
    return importlib.import_module(TASKS[name])


def conversation(task, row, with_solution=False):
    """A row as a chat conversation; with_solution appends the worked solution as the assistant turn."""
    messages = [{"role": "user", "content": task.prompt(row)}]
    if with_solution:
        messages.append({"role": "assistant", "content": task.solution(row)})
    return {"messages": messages}


def rewards(task, completion, reference, format_weight=0.0):
    """
    The reward terms of one completion; the rules themselves live in each task module:
        answer = 1 if task.grade accepts the final answer else 0
        format = 1 if task.format_ok: the answer given once, in the required form, at the end else 0
        total  = answer + format_weight * format
    format_weight (--format-weight) defaults to 0, nanochat's pure answer reward: a format bonus is
    the easiest term for a policy to farm, so it is opt-in. With 0 < format_weight < 1 (e.g. 0.1)
    totals rank correct and well-formed (1 + w) > correct but sloppy (1) > wrong but well-formed (w)
    > garbage (0); at w >= 1 a well-formed wrong answer would tie or beat a sloppy right one.
    Hedging, repeating the answer or spamming boxes never beats an honest correct answer: the
    verifier binds one answer (GSM8K: the first '#### <number>', MATH: the last box) and format
    is only paid for a single one. Returns a dict of floats.
    """
    answer = float(task.grade(completion, reference))
    fmt = float(task.format_ok(completion))
    return {"answer": answer, "format": fmt, "total": answer + format_weight * fmt}


def use_cache_if_hub_unreachable():
    """
    Call before the first `import datasets`. Unless offline mode is already on, ask the hub once
    (HF_ENDPOINT, a HEAD request, HUB_TIMEOUT_S); if nothing answers, turn on datasets' offline mode
    (HF_DATASETS_OFFLINE=1, read when datasets is imported): load_dataset then reads only the local
    cache, so a machine without network loads its cached copy, or fails in seconds with the loader's
    one line, instead of sitting through datasets' ~24 s of "Retrying in 8s [Retry 5/5]" first.
    """
    if any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return
    try:
        with urllib.request.urlopen(urllib.request.Request(os.environ.get("HF_ENDPOINT", "https://huggingface.co"),
                                                           method="HEAD"), timeout=HUB_TIMEOUT_S):
            pass
    except urllib.error.HTTPError:
        pass  # an error status is still an answer: the hub is reachable
    except OSError:  # refused, no route, no DNS, timed out (URLError and TimeoutError are OSErrors)
        os.environ["HF_DATASETS_OFFLINE"] = "1"
