"""
Step 5 in passes: chat_rl.policy_gradient_backward hands its rows with gradient here, and each
micro-batch of them (--device-batch-size rows and --device-batch-tokens tokens at most) becomes one
pass: objective()'s batch built, the policy's log-probs taken (fast/logprobs.py), objective()'s loss
backward. Summed over the passes, that is plain_step's step-5 lines (tests/test_plain_step.py holds
the run to them). What a pass adds besides, each for an option: the frozen start's log-probs
(--kl-beta), the sampling policy's kept for the next epoch (--ppo-epochs), the engine's against the
trainer's log-probs (the train row's gap metrics; --rollout-correction's q).
"""

import math
from contextlib import nullcontext
from types import SimpleNamespace

import torch

from fast.logprobs import Guess, RolloutLogprobs, fast_logprobs, make_batch, micro_batches
from plumbing import fsdp, metrics


def backward_passes(objective, model, sequences, masks, advantages, kept, N_i, *, num_samples,
                    temperature, options, device,
                    # what the loss reads besides the policy's log-probs
                    reference=None, sampler_logp=None,
                    # how: passes of at most so many rows and tokens
                    autocast=nullcontext(), device_batch_size=8, device_batch_tokens=math.inf,
                    logprobs=fast_logprobs, vocab_size=None,
                    # kept across --ppo-epochs: rows' log-probs, stats, the sampler's gap
                    saved=None, stats=None, gaps=None):  # fmt: skip
    """Add to .grad the gradient of objective()'s loss over the kept rows, a pass at a time, and
    return the loss summed over the passes. kept: (rows,) bool, the rows with gradient; N_i:
    (rows,) each row's divisor (chat_rl.normaliser: at the default, N in every entry);
    advantages: (rows,), or (rows, T) per token in make_batch's layout over all the rows (T at
    least the longest row's length - 1; each pass cuts it to its own width: row_advantages);
    options: chat_rl.OFF's flags, as given; reference: opens a block yielding the frozen start
    (--kl-beta); sampler_logp: each row's log-probs as the engine drew it (Samples.logprobs;
    None: no gap, no correction); logprobs: fast_logprobs or plain_logprobs (--logprobs); saved:
    rows' log-probs across epochs; stats: objective()'s, summed; gaps: a list the first epoch's
    passes append their metrics.sampler_gap to."""
    # a row without gradient would add 0, so it gets no pass; the kept rows go in passes of at
    # most device_batch_size rows and device_batch_tokens tokens, in the order the fast path likes
    batches = micro_batches(kept.nonzero()[:, 0].tolist(), sequences, masks, num_samples,
                            device_batch_size, device_batch_tokens)  # fmt: skip
    fsdp.match_passes(model, len(batches), logprobs, device)  # --fsdp: equal passes, or a hang
    saved, stats = saved or RolloutLogprobs(), {} if stats is None else stats
    # the fast path's guess of d loss / d logp, asked of objective() itself (fast/logprobs.Guess,
    # its first paragraph: what an edit of objective() needs to know of it)
    guess, loss_sum = Guess(objective), torch.zeros((), device=device)
    # one autocast block over every pass: each weight is cast to bf16 once for all of them
    # (autocast keeps its casts until its outermost block ends), not once a pass
    with autocast:
        for rows in batches:
            inputs, targets = make_batch(
                [sequences[i] for i in rows], [masks[i] for i in rows], device
            )
            batch = SimpleNamespace(
                **options, sampled=targets >= 0, normaliser=N_i[rows].to(device),
                advantages=row_advantages(advantages, rows, targets, device),
                old_logp=saved.get("old_logp", rows), ref_logp=saved.get("ref_logp", rows),
                sampler_logp=token_values(sampler_logp, rows, device))  # fmt: skip
            if options["kl_beta"] > 0 and batch.ref_logp is None:  # once a row, no gradient
                with torch.no_grad(), reference() as frozen:
                    batch.ref_logp = logprobs(
                        frozen, inputs, targets, temperature, vocab_size=vocab_size
                    )
                saved.put("ref_logp", rows, batch.ref_logp, sequences)
            # logp (B, T): plain_logprobs' numbers (tests/test_fast_logprobs.py holds the fast path
            # to it within 1e-6, gradients too); editing objective() needs nothing of fast/
            logp = guess.logprobs(logprobs, model, inputs, targets, temperature, batch, vocab_size)
            # the weights that sampled the rows: how far the sampler's numbers are from these
            if batch.old_logp is None and batch.sampler_logp is not None and gaps is not None:
                gaps.append(
                    metrics.sampler_gap(
                        logp, batch.sampler_logp, batch.sampled, options["rollout_cap"]
                    )
                )
            loss, batch_stats = objective(logp, batch)
            with torch.autocast(torch.device(device).type, enabled=False):  # as outside it
                loss.backward()
            loss_sum += loss.detach()
            if options["ppo_epochs"] > 1 and batch.old_logp is None:  # the sampling policy's
                saved.put("old_logp", rows, logp, sequences)
            for name, value in batch_stats.items():
                stats[name] = stats.get(name, 0.0) + value
    return loss_sum


def row_advantages(advantages, rows, targets, device):
    """The pass's advantages: (B,) per row, or (B, T) per token, cut to the width of its targets
    (make_batch's layout: its longest row, no wider)."""
    chosen = advantages[rows]
    return (chosen if chosen.dim() == 1 else chosen[:, : targets.size(1)]).to(device)


def token_values(values, rows, device):
    """(B, T) of the rows' per-token values (lists aligned with their sequences), laid out as
    make_batch lays out targets: token t + 1 at t, 0-padded; None without values."""
    if values is None or any(values[i] is None for i in rows):
        return None
    rows = [torch.tensor(values[i][1:], dtype=torch.float32) for i in rows]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).to(device)
