"""
A batch that shrinks: bench_rollout's "mixed lengths" rows. Rows are made to stop after lengths
spread over a range (force_stops), and the engine's wall time is compared with every row running
to the end (mixed_lengths) and with the floor the machine allows an engine that drops finished
rows at once and for free (mixed_floor).
"""

import time
from types import SimpleNamespace

import numpy as np
import torch

from engine import Engine, compaction_moves
from scripts.bench_rl_step import Tokenizer, best_of


def force_stops(model, lengths, stop):
    """
    Make row r (prompt-major) sample the stop token after exactly lengths[r] tokens, and never
    before: a forward hook rewrites the logits. It follows the engine's compaction from the
    outside: when the batch shrinks, the rows gone are the ones it made stop (a compaction drops
    every finished row), and the live ones moved as engine.compaction_moves moves them.
    Returns the hook's handle (.remove() it).
    """
    state = SimpleNamespace(calls=0, rows=None, stopped=set())

    def hook(module, args, kwargs, logits):
        if kwargs.get("kv_cache") is None:
            return logits
        step = state.calls  # the token sampled from these logits is the row's step-th (0-based)
        state.calls += 1
        if step == 0:
            return logits  # prefill: one row per prompt, never a stop at step 0
        if state.rows is None:
            state.rows = list(range(len(lengths)))
        # a compaction: the rows it made stop left, the engine's way
        if logits.size(0) < len(state.rows):
            live = torch.tensor([r not in state.stopped for r in state.rows])
            state.rows = [
                state.rows[i] for i in compaction_moves(live, int(live.sum()))[2].tolist()
            ]
        assert logits.size(0) == len(state.rows), "the hook lost track of the engine's rows"
        logits[:, :, stop] = float("-inf")
        for i, r in enumerate(state.rows):
            if lengths[r] == step:
                # the stop token 1000 above the rest: every other entry's probability underflows
                # to exactly 0, and the row's top-k has no tie at the k-th (all others at -inf
                # would tie, and send the whole batch down the sampler's full-vocabulary tie
                # path at every step where a row stops, as no model's logits would)
                logits[i, :, stop] = logits[i].max() + 1000.0
                state.stopped.add(r)
        return logits

    return model.register_forward_hook(hook, with_kwargs=True)


def spread_lengths(rows, min_len, new_tokens):
    """Completion lengths spread evenly over min_len..new_tokens, shuffled over the rows."""
    return [min_len + (r * 7919) % (new_tokens - min_len + 1) for r in range(rows)]


def mixed_floor(model, prompts, samples, new_tokens, top_k, min_len, tries):
    """
    The mixed-length ratio this machine allows: a decode pass's cost, measured now at batch
    sizes from all the rows down to one prompt's samples, summed over the mixed batch's steps as
    if each finished row left at once and leaving cost nothing, against every row at every step.
    Costs between measured sizes are interpolated, below the smallest they are the smallest's.
    Per-step costs that do not shrink with the batch (small matmuls, kernel and thread
    overheads) put it above the lengths' share of the row-steps.
    Returns (floor, sizes, seconds per step at each size).
    """
    engine = Engine(model, Tokenizer(model.config.vocab_size))  # no stop tokens
    engine.generate_batch(prompts[:1], 2, 2, 1.0, top_k)  # warm-up
    steps = max(2, new_tokens // 2)
    sizes, costs, n = [], [], len(prompts)
    # (n tokens) - (1 token) = n - 1 decode passes, and their sampling, without the prefill
    while n >= 1:
        one = best_of(
            lambda: engine.generate_batch(prompts[:n], samples, 1, 1.0, top_k, seed=1), tries
        )
        many = best_of(
            lambda: engine.generate_batch(prompts[:n], samples, steps, 1.0, top_k, seed=1), tries
        )
        sizes.insert(0, n * samples)
        costs.insert(0, (many - one) / (steps - 1))
        n //= 2
    lengths = spread_lengths(len(prompts) * samples, min_len, new_tokens)
    # decode pass t runs for the rows that sample a token after step t's: those longer than t
    live = [sum(length > t for length in lengths) for t in range(new_tokens - 1)]
    mixed = sum(float(np.interp(rows, sizes, costs)) for rows in live if rows > 0)
    return mixed / ((new_tokens - 1) * costs[-1]), sizes, costs


def mixed_lengths(model, prompts, samples, new_tokens, top_k, min_len, tries):
    """
    Best wall time of tries runs with rows stopping at lengths spread over min_len..new_tokens,
    and of tries runs of the same batch with every row running to new_tokens, interleaved (the
    machine is shared).
    """
    lengths = spread_lengths(len(prompts) * samples, min_len, new_tokens)
    stop = model.config.vocab_size - 1
    stopping, running = (
        Engine(model, Tokenizer(model.config.vocab_size, {stop})),
        Engine(model, Tokenizer(model.config.vocab_size)),
    )
    stopping.generate_batch(prompts[:1], 2, 2, 1.0, top_k)  # warm-up
    mixed = full = float("inf")
    for _ in range(tries):
        handle = force_stops(model, lengths, stop)
        try:
            t0 = time.perf_counter()
            _, masks = stopping.generate_batch(prompts, samples, new_tokens, 1.0, top_k, seed=1)
            mixed = min(mixed, time.perf_counter() - t0)
        finally:
            handle.remove()
        assert [sum(m) for m in masks] == lengths, "the forced stops did not happen where asked"
        full = min(
            full,
            best_of(
                lambda: running.generate_batch(prompts, samples, new_tokens, 1.0, top_k, seed=1), 1
            ),
        )
    return sum(lengths), mixed, full
