"""
Where a run's problems come from, and in what order: the task's train and test rows (its own
loader, or --data's files or hub data set), checked and loaded before the model (bad data stops
the run in seconds with one line, not after a model load); each step's share of them; and every
seed of a run, derived so that a resumed run draws what it would have drawn. Every rank reads the
rows itself: the loaders are deterministic, so every rank holds the same rows in the same order,
and nothing has to be broadcast.
"""

import hashlib
import json
import os

import torch

from plumbing.flags import ConfigError, RunError
from tasks.common import use_cache_if_hub_unreachable

# a file's extension -> the datasets loader that reads it
FILE_FORMATS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}


def load_data(task, cfg):
    """(train rows, eval rows): the task's own, or --data's (and --eval-data's) when given;
    cfg.eval_examples eval rows at most, none when no eval runs; at least one step's worth of
    training rows, none for --eval-only."""
    evals_on = cfg.eval_only or cfg.eval_every > 0
    # no silent split of the user's rows
    if cfg.data and evals_on and not cfg.eval_data and os.path.isfile(cfg.data):
        raise ConfigError(
            f"--data={cfg.data} is one file, so it holds no held-out rows: "
            f"name them with --eval-data=<file>, or turn evals off with --eval-every=-1"
        )
    try:
        if cfg.data:
            train_rows = (
                [] if cfg.eval_only else read_rows(cfg.data, cfg.data_config, cfg.train_split)
            )
            eval_rows = (
                read_rows(
                    cfg.eval_data or cfg.data, cfg.data_config, cfg.eval_split, cfg.eval_examples
                )
                if evals_on
                else []
            )
        else:
            train_rows = [] if cfg.eval_only else task.load("train")
            eval_rows = task.load("test", limit=cfg.eval_examples) if evals_on else []
    except (RuntimeError, ValueError) as e:
        raise RunError(str(e)) from None
    train_source = f"--data={cfg.data}" if cfg.data else cfg.task
    check_rows(task, train_rows, train_source)
    eval_source = f"--eval-data={cfg.eval_data}" if cfg.eval_data else train_source
    check_rows(task, eval_rows, eval_source)
    if not cfg.eval_only and len(train_rows) < cfg.examples_per_step:
        raise ConfigError(
            f"{cfg.data or cfg.task} has {len(train_rows)} training problems, fewer than "
            f"--examples-per-step={cfg.examples_per_step}"
        )
    if evals_on and not eval_rows:
        raise ConfigError(
            f"{cfg.eval_data or cfg.data or cfg.task} has no held-out rows to evaluate on"
        )
    return train_rows, eval_rows


def read_rows(source, config="", split="train", limit=None):
    """Rows (dicts, every column) of a local .jsonl / .json / .parquet / .csv file, gzipped or not
    (all of it, whatever split says: a file is one split), of a split of a folder of such files
    (datasets names splits by file name: train.jsonl, test.csv, ...), or of a split of a hub data
    set (config: its configuration, "" for the default)."""
    if os.path.isfile(source):
        # compressed as GSM8K ships its own (train.jsonl.gz): datasets reads it as it is
        extension = os.path.splitext(source.removesuffix(".gz"))[1].lower()
        if extension not in FILE_FORMATS:
            raise ValueError(f"{source}: not a {' / '.join(FILE_FORMATS)} file, gzipped or not")
        split = "train"  # its one split
        args, kwargs = (FILE_FORMATS[extension],), dict(data_files=os.path.abspath(source))
    elif os.path.isdir(source):
        args, kwargs = (os.path.abspath(source),), {}
    elif "/" in source and not os.path.exists(source.split("/")[0]) and not source.startswith("."):
        use_cache_if_hub_unreachable()
        args, kwargs = (source, config or None), {}
    else:
        raise ValueError(
            f"--data {source!r}: no such file or folder, and not a hub data set id (Org/Name)"
        )
    import datasets  # imported here: the built-in arith task never needs it

    local, shown = os.path.exists(source), not datasets.are_progress_bars_disabled()
    if local and shown:
        # a local file reads in a moment: its bars would only clutter the log
        datasets.disable_progress_bars()
    try:
        rows = datasets.load_dataset(*args, split=split, **kwargs)
    except Exception as e:  # a missing split, a malformed file, no network and no cache: one line
        raise ValueError(
            f"could not read {split!r} rows of {source} ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''})"
        ) from None
    finally:
        if local and shown:
            datasets.enable_progress_bars()
    rows = [dict(row) for row in rows]
    return rows[:limit] if limit else rows


def check_rows(task, rows, source):
    """Every row gives a prompt and a reference: a missing column or an unreadable answer is one
    line naming the row and the columns that exist, not a KeyError in the middle of a rollout."""
    for i, row in enumerate(rows):
        try:
            ok = isinstance(task.prompt(row), str) and task.reference(row) is not None
        except KeyError as e:
            raise ConfigError(
                f"{source}: row {i} has no column {e}; its columns: {', '.join(map(str, row))}"
                + (
                    " (--prompt-column and --answer-column name them)"
                    if hasattr(task, "columns")
                    else ""
                )
            ) from None
        except Exception as e:
            raise ConfigError(f"{source}: row {i}: {type(e).__name__}: {e}") from None
        if not ok:
            raise ConfigError(
                f"{source}: row {i} has no answer the verifier can read "
                f"({json.dumps(row, default=str)[:200]})"
            )


def rows_fingerprint(rows):
    """A short hash of the rows a run trains on: a resumed run must see the very same ones."""
    return hashlib.blake2b(
        json.dumps(rows, sort_keys=True, default=str).encode(), digest_size=8
    ).hexdigest()


def problems_for_step(train_rows, step, rank, world, examples_per_step, seed):
    """Step s takes the s-th slice of a permutation of the training problems fixed per epoch,
    and rank r the r-th part of that slice: the step alone fixes the data, so a resumed run
    continues it."""
    epoch, offset = divmod(step, len(train_rows) // examples_per_step)
    order = torch.randperm(
        len(train_rows), generator=torch.Generator().manual_seed(derive_seed(seed, "data", epoch))
    )
    per_rank = examples_per_step // world
    first = offset * examples_per_step + rank * per_rank
    return [train_rows[i] for i in order[first : first + per_rank].tolist()]


def refill_problems(train_rows, step, round, rank, world, examples_per_step, seed):
    """(problems, their indices) of --refill's round `round` (1, 2, ...) of step `step`, rank's
    part: examples_per_step drawn from all the training rows by a stream of the step and the round
    alone, never from the epoch's order, which stays what it is however many rounds ran."""
    stream = torch.Generator().manual_seed(derive_seed(seed, "refill", step, round))
    order = torch.randperm(len(train_rows), generator=stream)[:examples_per_step]
    per_rank = examples_per_step // world
    ids = order[rank * per_rank : (rank + 1) * per_rank].tolist()
    return [train_rows[i] for i in ids], ids


def derive_seed(*parts):
    """Every seed of a run: a 63-bit hash of what tells two streams apart, e.g. (run seed, "data",
    epoch), or (the step's seed, a problem's place in the step), the step's seed being (run seed,
    "rollout", step). Bare arithmetic would mix them up (seed * 1000 + epoch: seed 0, epoch 1000 =
    seed 1, epoch 0). Every eval draws from the same streams (one per held-out problem), so pass@k
    moves with the policy, not with the sampling noise."""
    return (
        int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1
    )
