"""
Step 7, held-out evaluation: each rank samples its share of the eval problems k times at
temperature 1.0 and once greedily, with the rollout the training steps use, and the ranks sum
pass@1..pass@k, greedy accuracy, reply length and the tool's use. eval_step runs it in the loop.
"""

import math
import time

import torch

from plumbing import checkpoint, fsdp
from plumbing.data import derive_seed
from plumbing.distributed import all_reduce_sum
from plumbing.metrics import eval_line, report_reward_errors
from plumbing.stop import NEVER


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n - c, k) / C(n, k),
    computed as a product."""
    return 1.0 if n - c < k else 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@torch.no_grad()
def evaluate(rollout, engine, task, problems, k, max_new_tokens, rank, world, device, seed,
             generate_batch_rows=256, system_prompt="", stop=NEVER):  # fmt: skip
    """Held-out accuracy, each rank taking every world-th problem: greedy (temperature 0, the
    policy's best single answer) and pass@1..pass@k of k samples at temperature 1.0 (how often a
    sample is right, and how often one of k is; right: an answer reward of 1 or more, as a user's
    may give part marks). rollout: chat_rl.rollout. The same problems and random numbers at every
    eval, so that evals compare. Returns (metrics, samples.jsonl's); (None, []) on every rank if a
    stop signal reached any (plumbing/stop.py)."""
    mine, ids = problems[rank::world], range(rank, len(problems), world)  # a stream per problem
    # summed over problems and ranks; pass@j, greedy and greedy_tool_use per problem, the tool's
    # means per sample
    names = [f"pass@{j}" for j in range(1, k + 1)]
    names += ["greedy", "greedy_tool_use", "tool_use", "tool_calls", "tool_errors", "seq_len"]
    totals, samples, reward_errors = dict.fromkeys(names, 0.0), [], 0
    if mine:
        label = "eval" if rank == 0 else ""
        common = dict(seed=seed, generate_batch_rows=generate_batch_rows, problem_ids=ids,
                      system_prompt=system_prompt, top_k=0)  # fmt: skip
        with stop.abandonable(engine.model):  # a stop signal leaves the sampling at once
            # temperature 1 whatever --temperature trains at: pass@k of the model's own
            # distribution, comparable across runs
            out = rollout(engine, task, mine, k, max_new_tokens, temperature=1.0,
                          progress=label, **common)  # fmt: skip
            greedy = rollout(engine, task, mine, 1, max_new_tokens, temperature=0.0,
                             progress=label and "eval greedy", **common)  # fmt: skip
    if stop.requested(device):  # every rank, before the sums below
        return None, []
    if mine:
        reward_errors = report_reward_errors(out["reward_errors"] + greedy["reward_errors"])
        for g in range(len(mine)):
            correct = sum(a >= 1 for a in out["answer"][g * k : (g + 1) * k])
            for j in range(1, k + 1):
                totals[f"pass@{j}"] += pass_at_k(k, correct, j)
        totals.update(
            greedy=sum(a >= 1 for a in greedy["answer"]),
            greedy_tool_use=sum(greedy["tool_use"]),
            # a sample's completion tokens: does RL make replies shorter?
            seq_len=sum(out["tokens"]) / k,
            **{name: sum(out[name]) / k for name in ("tool_use", "tool_calls", "tool_errors")},
        )
        samples = [
            dict(
                question=task.prompt(mine[g]),
                reference=task.reference(mine[g]),
                completion=out["completions"][g * k],
                reward=out["total"][g * k],
            )
            for g in range(min(3, len(mine)))
        ]
    values = [totals[name] for name in names] + [reward_errors, len(mine)]
    sums = all_reduce_sum(torch.tensor(values, dtype=torch.float64, device=device))
    metrics = {name: round(float(sums[i] / sums[-1]), 4) for i, name in enumerate(names)}
    return {"greedy": metrics.pop("greedy"), **metrics, "reward_errors": int(sums[-2])}, samples


def eval_step(rollout, setup, cfg, step, rank, world, device, stop, eta):
    """Step 7 at step: the held-out eval of the policy's weights, its row in metrics.jsonl and its
    console line. setup: plumbing/start.start's. Returns the metrics, or None if a stop signal came
    mid-eval."""
    setup.model.eval()
    t0 = time.time()
    with setup.autocast, fsdp.gathered(setup.model):
        held_out, samples = evaluate(rollout, setup.engine, setup.task, setup.eval_rows,
                                     cfg.eval_samples, cfg.max_new_tokens, rank, world, device,
                                     derive_seed(cfg.seed, "eval"), cfg.generate_batch_rows,
                                     cfg.system_prompt, stop)  # fmt: skip
    if held_out is None:
        return None
    seconds = time.time() - t0
    eta.evaluated(seconds)
    at = checkpoint.step_of(cfg.model) if cfg.eval_only else step  # --eval-only: the checkpoint's
    row = dict(step=at or 0, split="eval", **held_out, eval_time_s=round(seconds, 3))
    setup.log.write(row, samples)
    if rank == 0:
        print(eval_line(at, held_out))
    return held_out
