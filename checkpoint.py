"""
What lets a run survive: checkpoints that resume exactly, a stop flag for preemption, and the
metrics log that a resumed run rewinds.

A checkpoint is <out_dir>/step_000120/: a Hugging Face folder (config.json, model.safetensors,
tokenizer files) that transformers and `--model` load as it is, plus trainer_state.pt holding
the optimizer state, the step, every rank's RNG state and the run's config. Data position is the
step itself: step s always takes the s-th slice of a per-epoch permutation fixed by the seed, and
every sampling seed is derived from (seed, step, rank), so nothing else is needed to continue
bit-identically on CPU.
Writes are atomic: the folder is written under a temporary name and renamed into place, so a
crash mid-write leaves a `.tmp-` folder that is never mistaken for a checkpoint.
"""

import json
import os
import shutil
import signal
import time

import torch
import torch.distributed as dist

from flags import ConfigError

# settings that may change between a run and its resumption without changing what it computes
MAY_DIFFER = {"out_dir", "resume", "eval_every", "save_every", "keep_checkpoints", "wandb", "preset",
              "max_nonfinite", "device_type", "model"}


def _ckpt_dirs(out_dir):
    if not os.path.isdir(out_dir):
        return []
    return sorted(d for d in os.listdir(out_dir) if d.startswith("step_") and d[5:].isdigit())


def has_run(out_dir):
    return bool(_ckpt_dirs(out_dir)) or os.path.exists(os.path.join(out_dir, "metrics.jsonl"))


def save(cfg, step, model, tokenizer, optimizer, rank, world):
    """Every rank calls this (to hand over its RNG state); rank 0 writes."""
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    rngs = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(rngs, rng)
    else:
        rngs = [rng]
    if rank == 0:
        final = os.path.join(cfg.out_dir, f"step_{step:06d}")
        tmp = os.path.join(cfg.out_dir, f".tmp-step_{step:06d}")
        os.makedirs(cfg.out_dir, exist_ok=True)
        for name in os.listdir(cfg.out_dir):  # leftovers of writes that a crash interrupted
            if name.startswith(".tmp-step_"):
                shutil.rmtree(os.path.join(cfg.out_dir, name), ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        state = {"step": step, "optimizer": optimizer.state_dict(), "rng": rngs, "world_size": world, "config": vars(cfg)}
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
        for name in os.listdir(tmp):  # make the bytes durable before the rename makes them visible
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(cfg.out_dir)  # the rename itself survives a power cut
        for old in _ckpt_dirs(cfg.out_dir)[:-cfg.keep_checkpoints]:
            shutil.rmtree(os.path.join(cfg.out_dir, old), ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def find_resumable(cfg, world):
    """(step, state) of the latest checkpoint in out_dir, or (0, None) if there is none yet.
    A checkpoint that cannot be read, or whose config differs in a way that matters, is refused."""
    dirs = _ckpt_dirs(cfg.out_dir)
    if not dirs:
        return 0, None
    path = os.path.join(cfg.out_dir, dirs[-1])
    try:
        state = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=True)
        with open(os.path.join(path, "config.json")) as f:
            json.load(f)
        from safetensors import safe_open
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            list(f.keys())
    except Exception as e:
        raise ConfigError(f"checkpoint {path} is unreadable ({type(e).__name__}: {str(e)[:100]}); "
                          f"move it away to resume from an earlier one") from None
    saved = state["config"]
    differs = [k for k in saved if k not in MAY_DIFFER and k in vars(cfg) and saved[k] != getattr(cfg, k)]
    if state.get("world_size") != world:
        differs.append(f"world size ({state.get('world_size')} -> {world})")
    if differs:
        detail = ", ".join(f"{k} ({saved[k]!r} -> {getattr(cfg, k)!r})" if k in saved else k for k in differs)
        raise ConfigError(f"checkpoint {path} was made with different settings: {detail}")
    state["model_dir"] = path
    return state["step"], state


def restore(state, optimizer, rank):
    optimizer.load_state_dict(state["optimizer"])
    rng = state["rng"][rank]
    torch.set_rng_state(rng["cpu"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


class MetricsLog:
    """metrics.jsonl and samples.jsonl, written by rank 0, one JSON object a line, flushed as it goes.
    On resume from step s, rows of step >= s (written after that checkpoint) are dropped: they are redone."""

    def __init__(self, out_dir, rank, keep_below_step=0, wandb_project="", config=None):
        self.enabled = rank == 0
        self.files, self.wandb = {}, None
        if not self.enabled:
            return
        for name in ("metrics", "samples"):
            path = os.path.join(out_dir, f"{name}.jsonl")
            if keep_below_step:  # rewrite under a temporary name: a kill now must not lose the history
                with open(path + ".tmp", "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in _rows_below(path, keep_below_step))
                os.replace(path + ".tmp", path)
            self.files[name] = open(path, "a" if keep_below_step else "w")
        if wandb_project:
            import hashlib
            import wandb  # optional dependency, only when asked for
            run_id = hashlib.sha1(os.path.abspath(out_dir).encode()).hexdigest()[:12]  # a resumed run continues its W&B run
            self.wandb = wandb.init(project=wandb_project, config=config, id=run_id, resume="allow")

    def write(self, row, samples=()):
        if not self.enabled:
            return
        self.files["metrics"].write(json.dumps(row) + "\n")
        self.files["metrics"].flush()
        for s in samples:
            self.files["samples"].write(json.dumps({"step": row["step"], **s}) + "\n")
        self.files["samples"].flush()
        if self.wandb is not None:
            prefix = "eval/" if row.get("split") == "eval" else "train/"
            self.wandb.log({prefix + k: v for k, v in row.items() if k not in ("step", "split")}, step=row["step"])

    def close(self):
        for f in self.files.values():
            f.close()
        if self.wandb is not None:
            self.wandb.finish()


def _rows_below(path, step):
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the torn last line of a killed run
                if row["step"] < step:
                    rows.append(row)
    return rows


class StopFlag:
    """SIGTERM (preemption) and SIGINT (Ctrl-C) ask for a stop at the next step boundary. All ranks
    agree through one all-reduce, so every rank stops at the same step. Repeats are expected (torchrun
    and Slurm forward signals a worker also gets directly) and ignored, except a Ctrl-C pressed again
    after a few seconds: that one kills at once. Under torchrun, give the checkpoint time to be written
    (torchrun's --shutdown-timeout, 30 s by default, after which it kills the workers)."""

    def __init__(self):
        self.flag, self.first = False, None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        now = time.monotonic()
        if self.first is not None:
            if signum == signal.SIGINT and now - self.first > 3:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            return
        self.flag, self.first = True, now
        # os.write, not print: print is not safe inside a signal handler (re-entrant stdout)
        os.write(2, f"\nchat_rl: got {signal.Signals(signum).name}; stopping after this step with a checkpoint\n".encode())

    def requested(self, device):
        flag = torch.tensor(float(self.flag), device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag > 0)
