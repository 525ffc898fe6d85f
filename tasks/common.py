"""
What a task is: where its problems come from, how one becomes a prompt, how a completion is scored.

A task is a module with these names (a module, not a class: one obvious home):
    load(split, limit=None) -> list[dict]  rows of "train" or "test", in the data set's own schema
    prompt(row) -> str                      the user message the policy sees
    reference(row) -> str                   the row's final answer, as a string
    extract_answer(completion) -> str|None  the answer the completion commits to
    grade(completion, reference) -> bool    the verifier: pure, deterministic, never raises
    format_ok(completion) -> bool           the answer given once, in the required form, at the end
Optional: solution(row) -> str, a worked solution ending in the answer (supervised warm-up);
score(completion, row) -> float, a reward that replaces grade's 0/1 and sees the whole row.

--task names a built-in task (TASKS), the generic task over a user's own rows ("data",
tasks/generic.py), one of reasoning-gym's generators ("rg:<dataset>", tasks/rg.py), a module on
the import path (my_pkg.my_task) or a file (path/to/my_task.py) with the names above. `get_task`
imports lazily, so `--task=arith` never imports `datasets` (nor reasoning-gym).
"""

import copy
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
import traceback
import urllib.error
import urllib.request

HUB_TIMEOUT_S = 3.0  # how long a data loader waits for the hub before it reads the local cache only

TASKS = {
    "gsm8k": "tasks.gsm8k",
    "math": "tasks.mathtask",
    "arith": "tasks.arith",
    "mental": "tasks.mental",
}


INTERFACE = ("load", "prompt", "reference", "extract_answer", "grade", "format_ok")


def get_task(name):
    """The task --task names, built-in or a user's module or file, checked for the interface:
    anything missing is a ValueError naming it. (The generic task, "data", and reasoning-gym's,
    "rg:<dataset>", are made from their flags: tasks/generic.make, tasks/rg.make.)"""
    if name in TASKS:
        return importlib.import_module(TASKS[name])
    if not (name.endswith(".py") or "/" in name or "." in name):
        raise ValueError(
            f"unknown task {name!r} (choose from {', '.join([*TASKS, 'data', 'rg:<dataset>'])}, "
            "a module my_pkg.my_task or a file path/to/my_task.py)"
        )
    task = import_user_code(name)
    missing = [f for f in INTERFACE if not callable(getattr(task, f, None))]
    if missing:
        raise ValueError(
            f"task {name} has no function {', '.join(missing)}: "
            f"a task defines {', '.join(INTERFACE)} (tasks/common.py)"
        )
    return task


def import_user_code(name):
    """A module by file path (ends in .py or holds a /) or by dotted name; a ValueError in one
    line if it cannot be."""
    try:
        if name.endswith(".py") or "/" in name:
            if not os.path.isfile(name):
                raise ValueError(f"no such file {name!r}")
            # once per file: checking the flags imported it already
            module_name = "user_code." + os.path.abspath(name)
            if module_name not in sys.modules:
                spec = importlib.util.spec_from_file_location(module_name, name)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                sys.modules[module_name] = module
            return sys.modules[module_name]
        return importlib.import_module(name)
    except ValueError:
        raise
    except Exception as e:  # the user's code failed to import: its own error, in one line
        raise ValueError(
            f"cannot import {name} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None


def user_function(spec):
    """--reward's 'path/to/file.py:function' (or 'module:function') -> the function; a ValueError
    in one line if it is not one, saying what is there instead."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"--reward={spec!r}: expected path/to/file.py:function")
    try:
        module = import_user_code(path)
    except ValueError as e:
        raise ValueError(f"--reward={spec!r}: {e}") from None
    function = getattr(module, name, None)
    if not callable(function):
        defined = [
            n
            for n, f in vars(module).items()  # its own functions, not those it imports
            if inspect.isfunction(f) and f.__module__ == module.__name__ and n[0] != "_"
        ]
        there = f"its functions: {', '.join(defined)}" if defined else "it defines no function"
        raise ValueError(f"--reward={spec!r}: {path} has no function {name} ({there})")
    return function


def conversation(task, row, with_solution=False, system_prompt=""):
    """A row as a chat conversation: a system turn if system_prompt, the user's, and with_solution
    the worked solution as the assistant turn."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": task.prompt(row)})
    if with_solution:
        messages.append({"role": "assistant", "content": task.solution(row)})
    return {"messages": messages}


def rewards(task, completion, reference, format_weight=0.0, row=None):
    """
    The reward terms of one completion; the rules themselves live in each task module:
        answer = 1 if task.grade accepts the final answer else 0
                 (or task.score(completion, row): any number)
        format = 1 if task.format_ok: the answer given once, in the required form, at the end else 0
        total  = answer + format_weight * format
    format_weight (--format-weight) defaults to 0, nanochat's pure answer reward: a format bonus is
    the easiest term for a policy to farm, so it is opt-in. With 0 < format_weight < 1 (e.g. 0.1)
    totals rank correct and well-formed (1 + w) > correct but sloppy (1) > wrong but well-formed (w)
    > garbage (0); at w >= 1 a well-formed wrong answer would tie or beat a sloppy right one.
    Hedging, repeating the answer or spamming boxes never beats an honest correct answer: the
    verifier binds one answer (GSM8K: the first '#### <number>', MATH: the last box) and format
    is only paid for a single one. A task's code that raises, or a score that is not a finite
    number, scores 0 and carries "error", one line (failure()); the built-in verifiers never
    raise, a user's reward may. Returns a dict of floats.
    """
    try:
        if hasattr(task, "score"):
            # a deep copy: a reward may change its row, lists in it too; the next sample's is whole
            answer = task.score(completion, copy.deepcopy(row))
            if not isinstance(answer, numbers.Real) or not math.isfinite(answer):
                raise ValueError(f"the reward returned {answer!r}, not a finite number")
            answer = float(answer)
        else:
            answer = float(task.grade(completion, reference))
        fmt = float(task.format_ok(completion))
    except Exception as e:
        return {"answer": 0.0, "format": 0.0, "total": 0.0, "error": failure(e, row)}
    return {"answer": answer, "format": fmt, "total": answer + format_weight * fmt}


def failure(error, row):
    """An exception of a task's code in one line: its type, the line of that code that raised it,
    its message and the columns of the row it was given (what a KeyError needs to fix it), e.g.
        KeyError at my_reward.py:5 in reward: 'answer' (the row's columns: problem, target, steps)
    What precedes the first ': ' is the error's kind (plumbing/metrics.report_reward_errors)."""
    frames = traceback.extract_tb(error.__traceback__)[1:]  # [0] is rewards()'s own call
    ours = [f for f in frames if f.filename == frames[0].filename] if frames else []
    where = f" at {ours[-1].filename}:{ours[-1].lineno} in {ours[-1].name}" if ours else ""
    message = str(error).splitlines()[0] if str(error) else ""
    columns = f" (the row's columns: {', '.join(map(str, row))})" if isinstance(row, dict) else ""
    columns = columns if ours else ""  # raised by rewards() itself: not about the row
    return f"{type(error).__name__}{where}: {message[:300]}{columns}"


def use_cache_if_hub_unreachable():
    """
    Call before the first `import datasets`. Unless offline mode is already on, ask the hub once
    (HF_ENDPOINT, a HEAD request, HUB_TIMEOUT_S); if nothing answers, turn on datasets' offline mode
    (HF_DATASETS_OFFLINE=1, read when datasets is imported): load_dataset then reads only the local
    cache, so a machine without network loads its cached copy, or fails in seconds with the loader's
    one line, instead of sitting through datasets' ~24 s of "Retrying in 8s [Retry 5/5]" first.
    """
    if any(
        os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    ):
        return
    try:
        with urllib.request.urlopen(
            urllib.request.Request(
                os.environ.get("HF_ENDPOINT", "https://huggingface.co"), method="HEAD"
            ),
            timeout=HUB_TIMEOUT_S,
        ):
            pass
    except urllib.error.HTTPError:
        pass  # an error status is still an answer: the hub is reachable
    except OSError:  # refused, no route, no DNS, timed out (URLError and TimeoutError are OSErrors)
        os.environ["HF_DATASETS_OFFLINE"] = "1"
