"""
The run around chat_rl's step: plumbing/start.py's setup (the rows, the resume point, the policy,
AdamW, the log), then train_step() once a step with a held-out eval every --eval-every steps
(plumbing/evaluation.py), a checkpoint every --save-every and at the end, the console line and the
metrics row of each step, a count of non-finite updates in a row, and a stop signal's clean exit.
chat_rl.train hands in its train_step and rollout, looked up as the run starts, so a fork's or a
test's own are the ones run.
"""

import math
import time

from plumbing import checkpoint, metrics
from plumbing.evaluation import eval_step
from plumbing.flags import RunError
from plumbing.start import start
from plumbing.stop import StopFlag


def run(train_step, rollout, cfg, rank, world, device):
    """Steps 1-7, every rank in lockstep: the run around chat_rl's train_step(), which takes one
    step, and its rollout(), which the evals sample with. Step s sees the weights after s updates:
    num_steps=2, eval_every=1 runs eval 0, update 0, eval 1, update 1, eval 2, and saves
    step_000002."""
    print0 = print if rank == 0 else (lambda *a, **k: None)
    stop = StopFlag()  # SIGTERM, SIGINT: the step under way left in seconds, the last one kept
    # plumbing/start.py: the rows, the resume point, the policy with its Engine and AdamW, the log
    setup = start(cfg, rank, world, device)
    model, optimizer, tokenizer, log = setup.model, setup.optimizer, setup.tokenizer, setup.log
    num_steps, start_step = setup.num_steps, setup.start_step
    print0(metrics.start_line(cfg, model, world, device, start_step, num_steps, setup.resumed,
                              setup.dtype_why))  # fmt: skip
    last_pass1 = log.last_eval.get("pass@1", math.nan)  # a resumed run shows its last eval
    last_saved = start_step if setup.resumed else -1  # the newest checkpoint's step: none twice
    step, nonfinite_in_row, failure, t_start = start_step, 0, None, time.time()
    eta = metrics.Eta(num_steps, cfg.eval_every)  # from the times of steps and evals
    for step in range(start_step, num_steps + 1):  # the pass at num_steps only evaluates
        if stop.requested(device):
            break
        eval_due = cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == num_steps)
        if cfg.eval_only or eval_due:  # 7. held-out pass@k (plumbing/evaluation.py)
            held_out = eval_step(rollout, setup, cfg, step, rank, world, device, stop, eta)
            if held_out is None:  # a stop signal came mid-eval
                break
            last_pass1 = held_out["pass@1"]
        if step == num_steps or cfg.eval_only:
            break
        row, failure = train_step(setup, cfg, step, rank, world, device, stop)
        if row is None:  # a stop, or every reward failed: no update this step
            break
        finite, kept_tokens = not row["skipped_nonfinite"], row["kept_tokens"]
        nonfinite_in_row = metrics.check_nonfinite(finite, kept_tokens, nonfinite_in_row,
                                                   cfg.max_nonfinite, step, print0)  # fmt: skip
        log.write(row)
        eta_s = eta.stepped(step, row["step_time_s"])
        print0(metrics.console_line(row, num_steps, last_pass1, eta_s, tool=cfg.tool != "none"))
        if cfg.save_every > 0 and (step + 1) % cfg.save_every == 0 and step + 1 < num_steps:
            checkpoint.save(cfg, step + 1, model, tokenizer, optimizer, rank, world)
            last_saved = step + 1
    if not cfg.eval_only and step not in (start_step, last_saved):  # an update not saved yet
        checkpoint.save(cfg, step, model, tokenizer, optimizer, rank, world)
    if failure:
        message = f"step {step}: the reward failed on every completion; the first: {failure}"
        raise RunError(message, every_rank=True)
    evaluated, minutes = cfg.model if cfg.eval_only else "", (time.time() - t_start) / 60
    ended = metrics.stop_line(step, num_steps, minutes, cfg.out_dir, evaluated, stop.agreed)
    print0(metrics.reward_errors_line(log.reward_errors) + ended)
    log.close()
    return 0
