"""
Where a run's problems come from, and in what order: the task's train and test rows, loaded before the model (a
missing data set stops the run in seconds with one line, not after a model load); each step's share of them; and
every seed of a run, derived so that a resumed run draws what it would have drawn.
"""

import hashlib

import torch

from plumbing.flags import ConfigError, RunError


def load_data(task, cfg):
    """(train rows, eval rows) of the task: cfg.eval_examples of its test rows at most; at least one step's worth of
    training rows (cfg.examples_per_step), or a ConfigError."""
    try:
        train_rows, eval_rows = task.load("train"), task.load("test", limit=cfg.eval_examples)
    except (RuntimeError, ValueError) as e:
        raise RunError(str(e)) from None
    if len(train_rows) < cfg.examples_per_step:
        raise ConfigError(f"{cfg.task} has {len(train_rows)} training problems, fewer than --examples-per-step={cfg.examples_per_step}")
    return train_rows, eval_rows


def problems_for_step(train_rows, step, rank, world, examples_per_step, seed):
    """Step s takes the s-th slice of a permutation of the training problems fixed per epoch, and
    rank r the r-th part of that slice: the step alone fixes the data, so a resumed run continues it."""
    epoch, offset = divmod(step, len(train_rows) // examples_per_step)
    order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(derive_seed(seed, "data", epoch)))
    per_rank = examples_per_step // world
    first = offset * examples_per_step + rank * per_rank
    return [train_rows[i] for i in order[first:first + per_rank].tolist()]


def derive_seed(*parts):
    """Every seed of a run: a 63-bit hash of what tells two streams apart, e.g. (run seed, "rollout", step, rank) or
    (run seed, "data", epoch); bare arithmetic would mix them up (seed * 1000 + epoch: seed 0, epoch 1000 = seed 1,
    epoch 0). Evals reuse one stream per rank, so pass@k moves with the policy, not with the sampling noise."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1
