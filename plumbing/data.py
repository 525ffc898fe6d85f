"""
Where a run's problems come from: the task's train and test rows, loaded before the model, so that a missing
data set stops the run in seconds with one line, not after a model load.
"""

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
