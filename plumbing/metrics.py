"""
What a run reports: each step's metrics reduced over ranks by name, metrics.jsonl / samples.jsonl
(rank 0, flushed as they go, rewound on resume), optional Weights & Biases, the console line, and
the count of non-finite updates that stops a run gone bad.
"""

import json
import math
import os

import torch
import torch.distributed as dist

from plumbing.distributed import all_reduce_sum
from plumbing.flags import RunError

# train-row means over every completion of every rank: metric name -> per-row list of rollout()
MEANS = {
    "reward": "total",
    "reward_answer": "answer",
    "reward_format": "format",
    "seq_len": "tokens",
    "truncated": "truncated",
    "tool_use": "tool_use",
    "tool_calls": "tool_calls",
    "tool_errors": "tool_errors",
}


def step_metrics(step, out, t_rollout, device, world, *, sampled_tokens, **values):
    """One train row: the rollout's means over all ranks (summed by name, then divided by the number
    of completions), the rollout tokens/s of all ranks together, and the step's own values.
    sampled_tokens: the tokens this rank's training rows sampled, summed over ranks into the row."""
    local = {name: float(sum(out[key])) for name, key in MEANS.items()}
    local.update(
        completions=len(out["total"]),
        rollout_s=t_rollout,
        reward_errors=sum(e is not None for e in out["reward_errors"]),
        sampled_tokens=sampled_tokens,
    )
    names = sorted(local)  # every rank packs the same names in the same order
    sums = dict(
        zip(names, all_reduce_sum(torch.tensor([local[k] for k in names], device=device)).tolist())
    )
    row = {
        "step": step,
        **{name: sums[name] / sums["completions"] for name in MEANS},
        **values,
        # completions whose reward raised or was not a number: scored 0
        "reward_errors": int(sums["reward_errors"]),
        # the loss's N at the default --loss-norm (all_tokens); kept_tokens, at most as many
        "sampled_tokens": int(sums["sampled_tokens"]),
        # ranks sample side by side: tokens of all ranks over one rank's (the mean) rollout time
        "rollout_tokens_per_s": sums["seq_len"] / (sums["rollout_s"] / world),
    }
    if device.type == "cuda":
        row["peak_mem_gb"] = peak_memory_gb(device)
    return {k: _json_number(v) for k, v in row.items()}


def per_token(sums, tokens, device):
    """The objective's stats (chat_rl.objective: name -> a sum over this rank's sampled tokens), as
    means per token over all ranks; tokens: the kept tokens of all ranks times the step's updates.
    A rank that ran no pass has none: every rank's names are gathered first."""
    names = sorted(sums)
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, names)
        names = sorted(set().union(*every))
    totals = torch.tensor([float(sums.get(name, 0.0)) for name in names], dtype=torch.float64)
    totals = all_reduce_sum(totals.to(device)).tolist() if names else []
    return {name: total / max(tokens, 1) for name, total in zip(names, totals)}


def sampler_gap(logp, sampler_logp, sampled, cap):
    """How far the sampler's log-probs q are from the trainer's p on the sampled tokens, as sums
    (k3, an estimate of KL(q || p) per token; the ratio p / q; tokens with it outside [1 / cap,
    cap]) and extremes of the ratio, for one training pass: gap_row turns them into the train row's
    mismatch_* means over all ranks. In fp32 they read 1 and 0 up to rounding; in bf16 they do
    not."""
    log_ratio = (logp.detach() - sampler_logp)[sampled]
    ratio = torch.exp(log_ratio)
    return dict(
        sums=torch.stack(
            [
                (ratio - log_ratio - 1).sum(),
                ratio.sum(),
                ((ratio < 1 / cap) | (ratio > cap)).sum(),
            ]
        ),
        high=ratio.max() if ratio.numel() else ratio.new_ones(()),  # on the passes' device
        low=ratio.min() if ratio.numel() else ratio.new_ones(()),
    )


def gap_row(gaps, kept_tokens, device):
    """The step's sampler/trainer gap (sampler_gap of each pass of its first epoch) as the
    train row's mismatch_* entries, over all ranks: k3 (KL(sampler || trainer) per token), the mean
    ratio p_trainer / p_sampler, the share of tokens past the correction's cap, the largest and the
    smallest ratio; None in a step that kept no row. Every rank calls it (two collectives)."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    extremes = torch.tensor([0.0, -math.inf], dtype=torch.float64, device=device)  # max, -min
    for gap in gaps:
        sums += gap["sums"].double()
        extremes = torch.maximum(extremes, torch.stack([gap["high"], -gap["low"]]).double())
    all_reduce_sum(sums)
    if dist.is_initialized():
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    names = ("mismatch_k3", "mismatch_ratio", "mismatch_past_cap")
    if kept_tokens == 0:
        return dict.fromkeys((*names, "mismatch_ratio_max", "mismatch_ratio_min"))
    row = {name: total / kept_tokens for name, total in zip(names, sums.tolist())}
    high, low = extremes.tolist()
    return {**row, "mismatch_ratio_max": high, "mismatch_ratio_min": -low}


def rank_means(values, device):
    """A step's own values (train_step()'s step_values: name -> a number this rank computed once
    this step) as their means over the ranks; a rank without one counts 0 (every rank's names are
    gathered first)."""
    names = sorted(values)
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, names)
        names = sorted(set().union(*every))
    if not names:
        return {}
    totals = torch.tensor([float(values.get(name, 0.0)) for name in names], dtype=torch.float64)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {n: t / world for n, t in zip(names, all_reduce_sum(totals.to(device)).tolist())}


def peak_memory_gb(device):
    """The most CUDA memory allocated since the last call (the first: since the run started), in
    GiB; then the count starts again. Each train row so shows its own step's peak (with the eval or
    checkpoint since the row before), not the run's peak so far."""
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def console_line(row, num_steps, last_pass1, eta_s, tool=False):
    """One line a step: pass@1 of the last eval, if there has been one; with the tool on, the share
    of completions that called it; a step that took no update for want of signal says so (its
    loss and grad_norm read 0 either way)."""
    # last_pass1 is nan before the first eval, or with evals off
    pass1 = f"pass@1 {last_pass1:.3f} | " if math.isfinite(last_pass1) else ""
    return (
        f"step {row['step']}/{num_steps} | reward {row['reward']:.3f} | "
        + pass1
        + (f"tool {row['tool_use']:.2f} | " if tool else "")
        + (f"reward errors {row['reward_errors']} | " if row.get("reward_errors") else "")
        + f"loss {row['loss']:+.4f} | "
        + ("no update: no group with signal | " if row.get("kept_tokens") == 0 else "")
        + f"len {row['seq_len']:.0f} | "
        f"{row['rollout_tokens_per_s']:.0f} tok/s | "
        f"{row['step_time_s']:.1f}s | eta {eta_s / 60:.1f} min"
    )


def eval_line(step, metrics):
    """An eval's console line: its step (None: --eval-only of a model no chat_rl run saved), then
    its metrics, reward_errors only when some failed."""
    shown = " ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k != "reward_errors" or v)
    return f"eval step {step}: {shown}" if step is not None else f"eval (no chat_rl step): {shown}"


def start_line(cfg, model, world, device, start_step, num_steps, resumed, dtype_why=""):
    """The run's first words: what trains where (a LoRA run: how many of the parameters), from
    which step to which, and where it writes."""
    steps = "eval only" if cfg.eval_only else f"{start_step}->{num_steps}"
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    params = f"{model.num_params() / 1e6:.1f}M params" + (
        f", {trained:,} of them trained" if cfg.lora_rank else ""
    )
    return (
        f"chat_rl: task={cfg.task} model={cfg.model} ({params}) ranks={world} "
        f"device={device.type} dtype={cfg.dtype}{f' ({dtype_why})' if dtype_why else ''} "
        f"steps={steps} out={cfg.out_dir}"
        + (
            " (--resume: no checkpoint there yet, so from step 0)"
            if cfg.resume and not resumed
            else ""
        )
    )


def reward_errors_line(counts):
    """How many completions' reward failed in the run, if any; counts: {"train": n, "eval": m}."""
    if not any(counts.values()):
        return ""
    return (
        f"the reward failed on {counts['train']:,} training and {counts['eval']:,} eval "
        f"completions, each scored 0 (reward_errors in metrics.jsonl; each kind shown above)\n"
    )


def stop_line(step, num_steps, minutes, out_dir, evaluated="", stopped=False):
    """The run's last words: where its checkpoint is, and the command that goes on from it. A
    stopped run continues under the same flags (the checkpoint checks them, it does not supply
    them); a finished one cannot be lengthened (its learning rate has decayed to 0), only be the
    start of a new run. evaluated: the model an --eval-only run evaluated, which writes no
    checkpoint. stopped: by a signal, maybe in its final eval (step == num_steps), or in step 0
    (which saves nothing: with --resume, the run starts afresh)."""
    if evaluated:
        if stopped:
            return f"stopped after {minutes:.1f} min, before the eval of {evaluated} ended: no row"
        return (
            f"evaluated {evaluated} in {minutes:.1f} min: "
            f"the eval row is in {out_dir}/metrics.jsonl"
        )
    path = os.path.join(out_dir, f"step_{step:06d}")
    if stopped or step < num_steps:
        saved = f"checkpoint in {path}" if step > 0 else "no step had finished, so no checkpoint"
        return (
            f"stopped at step {step}/{num_steps} after {minutes:.1f} min; {saved}\n"
            f"to continue: the same command, with all its flags, plus --resume"
        )
    return (
        f"done at step {step}/{num_steps} after {minutes:.1f} min; checkpoint in {path}\n"
        f"to train on: the same command with --model={path} and a new --out-dir "
        f"(the learning rate starts again from its peak)"
    )


class Eta:
    """The console's estimate of the time left: the mean time of this run's training steps times the
    steps to come, plus its last eval's time times the evals to come. From steps, not from the wall
    clock since the start, which would make a first eval's time part of every step to come."""

    def __init__(self, num_steps, eval_every):
        self.num_steps, self.eval_every, self.step_s, self.eval_s = num_steps, eval_every, [], 0.0

    def evaluated(self, seconds):
        self.eval_s = seconds

    def stepped(self, step, seconds):
        """Seconds left after training step `step` took `seconds`."""
        self.step_s.append(seconds)
        later = range(step + 1, self.num_steps + 1)  # evals to come: each eval_every-th, the last
        evals = sum(s % self.eval_every == 0 or s == self.num_steps for s in later)
        per_step = sum(self.step_s) / len(self.step_s)
        return per_step * (self.num_steps - step - 1) + self.eval_s * evals * (self.eval_every > 0)


REPORTED = set()  # the kinds of reward error this process has printed


def report_reward_errors(errors):
    """Print each reward error of a kind this process has not met yet (its exception's type and the
    line that raised it: what tasks/common.failure writes before the first ': '); return how many
    of errors (None, or an error, per completion) there are. Printed by the rank that meets it."""
    for error in errors:
        if error is not None and (kind := error.split(": ", 1)[0]) not in REPORTED:
            REPORTED.add(kind)
            print(
                f"chat_rl: the reward failed, scoring 0 (counted in reward_errors; each kind "
                f"shown once): {error}",
                flush=True,
            )
    return sum(error is not None for error in errors)


def all_rewards_failed(errors, device):
    """The first error of this rank if the reward failed on every completion of every rank this step
    (no hard problem does that: a bug in the reward, and no signal to learn from), else None.
    errors: None or a message a completion; each kind's first is printed (report_reward_errors)."""
    failed = report_reward_errors(errors)
    counts = all_reduce_sum(torch.tensor([failed, len(errors)], dtype=torch.float, device=device))
    return next(e for e in errors if e is not None) if counts[0] == counts[1] > 0 else None


def check_nonfinite(finite, kept_tokens, in_row, max_in_row, step, print0):
    """Count non-finite updates in a row (the same on every rank: loss and norm are of the summed
    step); a finite update resets the count, a step with nothing kept (no update) leaves it;
    max_in_row in a row stop the run."""
    if finite:
        return 0 if kept_tokens > 0 else in_row
    print0(f"step {step}: non-finite loss/gradient, update skipped ({in_row + 1} in a row)")
    if in_row + 1 >= max_in_row:
        # loss and norm are of the step summed over ranks: every rank stops here
        raise RunError(
            f"{in_row + 1} non-finite updates in a row at step {step}; "
            f"lower --lr or check the model's dtype",
            every_rank=True,
        )
    return in_row + 1


def _json_number(v):
    """Round floats for a readable log, to 6 decimals, or to 6 significant digits below 1e-3 (the
    sampler/trainer gap's k3 is 1e-7 in fp32); non-finite values become null (NaN is not JSON)."""
    if isinstance(v, torch.Tensor):
        v = float(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return None
        return round(v, 6) if abs(v) >= 1e-3 else float(f"{v:.6g}")
    return v


class MetricsLog:
    """metrics.jsonl and samples.jsonl, written by rank 0, one JSON object a line, flushed as it
    goes. On resume from step s, rows of step >= s (written after that checkpoint) are dropped:
    they are redone."""

    def __init__(self, out_dir, rank, keep_below_step=0, wandb_project="", config=None):
        self.enabled = rank == 0
        self.files, self.wandb, self.last_eval = {}, None, {}
        self.reward_errors = {"train": 0, "eval": 0}  # the rows' counts: all ranks, this run
        if not self.enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        for name in ("metrics", "samples"):
            path = os.path.join(out_dir, f"{name}.jsonl")
            if keep_below_step:
                # rewrite under a temporary name: a kill now must not lose the history
                kept = _rows_below(path, keep_below_step)
                with open(path + ".tmp", "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in kept)
                os.replace(path + ".tmp", path)
                if name == "metrics":
                    self.last_eval = next(
                        (r for r in reversed(kept) if r.get("split") == "eval"), {}
                    )
            self.files[name] = open(path, "a" if keep_below_step else "w")
        if wandb_project:
            import hashlib

            import wandb  # optional dependency, only when asked for

            # a resumed run continues its W&B run
            run_id = hashlib.sha1(os.path.abspath(out_dir).encode()).hexdigest()[:12]
            self.wandb = wandb.init(project=wandb_project, config=config, id=run_id, resume="allow")

    def write(self, row, samples=()):
        if not self.enabled:
            return
        split = "eval" if row.get("split") == "eval" else "train"
        self.reward_errors[split] += row.get("reward_errors", 0)
        self.files["metrics"].write(json.dumps(row) + "\n")
        self.files["metrics"].flush()
        for s in samples:
            self.files["samples"].write(json.dumps({"step": row["step"], **s}) + "\n")
        self.files["samples"].flush()
        if self.wandb is not None:
            prefix = "eval/" if row.get("split") == "eval" else "train/"
            self.wandb.log(
                {prefix + k: v for k, v in row.items() if k not in ("step", "split")},
                step=row["step"],
            )

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
