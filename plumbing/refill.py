"""
--refill, DAPO's dynamic sampling (arXiv:2503.14476): a group whose samples all scored the same
has advantage 0 and teaches nothing, so while too few of a step's groups carry signal, more rounds
of problems are sampled and scored, and the step trains on its first examples_per_step groups with
signal. chat_rl.train_step calls refill_step after the step's own rollout and advantages; it hands
in chat_rl's rollout (with the reward's training terms bound: chat_rl.training_rewards) and
step_advantages, which each round's problems go through as the step's did.
"""

import torch

from plumbing import fsdp
from plumbing.data import derive_seed, refill_problems
from plumbing.distributed import all_reduce_sum


def refill_step(rollout, step_advantages, setup, cfg, step, out, advantages, rank, world, device,
                stop):  # fmt: skip
    """--refill in train_step(): with_refills over refill_round's rounds, after the step's own
    rollout `out` and its advantages. Returns with_refills' (every round's completions, their
    advantages, which of them train, the rounds' counts with each round's problems added for the
    train row), or None if a stop came during a round, on some rank."""

    def sample_round(r):  # a round's sampling is abandonable, the sums between rounds not
        return refill_round(rollout, setup, cfg, step, r, rank, world, device, stop)

    with setup.autocast, fsdp.gathered(setup.model):
        refills = with_refills(out, advantages, sample_round, cfg.examples_per_step,
                               cfg.num_samples, cfg.refill, rank, world, device,
                               advantages_of=lambda extra: step_advantages(extra, cfg))  # fmt: skip
    if refills is None:
        return None
    out, advantages, trains, refilled = refills
    refilled["refill_problems"] = [  # every rank's, each round's: the rows' indices
        refill_problems(setup.train_rows, step, r, 0, 1, cfg.examples_per_step, cfg.seed)[1]
        for r in range(1, refilled["refill_rounds"] + 1)
    ]
    return out, advantages, trains, refilled


def with_refills(out, advantages, sample_round, examples_per_step, num_samples, max_rounds, rank,
                 world, device, advantages_of):  # fmt: skip
    """--refill (DAPO's dynamic sampling): a unanimous group teaches nothing, so while fewer than
    examples_per_step groups of the step have signal (a nonzero advantage), sample another round of
    as many problems (sample_round(r): this rank's rollout of round r, plumbing/data.py's refill
    problems), up to max_rounds more. The step then trains on its first examples_per_step groups
    with signal, all ranks in order (round, rank, place): the same groups on 1 rank or 8. Returns
    every round's completions (what the step sampled, its metrics' rows), their advantages, which
    of them train (rows,) bool, and the rounds' counts for the train row; None if sample_round
    returned None (a stop, agreed by every rank). advantages_of: a round's advantages from its
    rollout, as the first round's were made (step_advantages): one a row (rows,), or one a token
    (rows, T), each round's T its own, the rounds' then zero-padded to the widest."""
    rounds = [(out, advantages)]
    while True:
        # every rank's groups' signal, every round so far: (rounds, world, groups a rank)
        signal = torch.zeros(len(rounds), world, examples_per_step // world, device=device)
        for r, (_, adv) in enumerate(rounds):
            group = adv.abs().reshape(adv.size(0) // num_samples, -1)  # a group's every entry
            signal[r, rank] = (group.sum(dim=1) > 0).float()
        signal = all_reduce_sum(signal).bool()
        if signal.sum() >= examples_per_step or len(rounds) > max_rounds:
            break
        extra = sample_round(len(rounds))
        if extra is None:
            return None
        rounds.append((extra, advantages_of(extra)))
    # the first examples_per_step groups with signal, in (round, rank, place) order
    chosen = signal & (signal.flatten().cumsum(0) <= examples_per_step).view(signal.shape)
    trains = chosen[:, rank].repeat_interleave(num_samples, dim=1).flatten().cpu()
    every = {key: sum((o[key] for o, _ in rounds), []) for key in out}
    counts = dict(groups_sampled=signal.numel(), groups_kept=int(chosen.sum()),
                  refill_rounds=len(rounds) - 1)  # fmt: skip
    return every, padded_cat([adv for _, adv in rounds]), trains, counts


def padded_cat(advantages):
    """The rounds' advantages as one tensor: (rows,) a row, or (rows, T) a token, the narrower
    rounds padded with 0 (no token there) to the widest's T."""
    if advantages[0].dim() == 1:
        return torch.cat(advantages)
    T = max(a.size(1) for a in advantages)
    return torch.cat([torch.nn.functional.pad(a, (0, T - a.size(1))) for a in advantages])


def refill_round(rollout, setup, cfg, step, r, rank, world, device, stop):
    """--refill's round r of a step on this rank: its problems (plumbing/data.refill_problems),
    sampled from seeds of their own and scored by chat_rl's rollout, as it returns them; None if
    any rank was asked to stop (the sampling is abandonable, and every rank agrees after it:
    with_refills' sums between rounds are collective, so no rank may leave one its peers are in)."""
    problems, _ = refill_problems(setup.train_rows, step, r, rank, world, cfg.examples_per_step,
                                  cfg.seed)  # fmt: skip
    problem_ids = range(rank * len(problems), (rank + 1) * len(problems))
    out = None
    with stop.abandonable(setup.model):
        out = rollout(setup.engine, setup.task, problems, cfg.num_samples, cfg.max_new_tokens,
                      cfg.temperature, cfg.top_k,
                      derive_seed(cfg.seed, "rollout", step, "refill", r),
                      generate_batch_rows=cfg.generate_batch_rows, problem_ids=problem_ids,
                      system_prompt=cfg.system_prompt)  # fmt: skip
    return None if stop.requested(device) else out
