"""
The Engine's sampler: engine.sample_reference's draws (the same token but where the sums' rounding
moves u across a token's boundary), without its full-row cumulative sum (a slow serial pass over
the vocabulary) and within a bounded working set.
tests/test_reference_sampler.py holds it to the reference; tests/test_sampler.py checks its draws
against softmax(logits / temperature).
"""

import torch

BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF (sample_from_probs)
ROWS_X_VOCAB = 2**21  # the sampler's working set, rows x vocabulary entries at a time


def sample_next_token(logits, u, temperature=1.0, top_k=None, logprobs=False):
    """
    sample_reference's draws, faster: logits (B, V), u (B,) uniform numbers in [0, 1) -> token
    ids (B,), row b drawn from softmax(logits[b] / temperature) restricted to its top_k entries
    (all entries tied with the k-th largest are kept). temperature 0 = greedy argmax, u unused.
    logprobs: (tokens, their log-probs (B,) under that distribution, read off the probabilities
    the draw used; 0 at temperature 0).
    On a CPU rows go through in chunks of about ROWS_X_VOCAB entries (chunk_rows; on CUDA all at
    once), so that at every position the softmax's temporaries are the same few small tensors,
    reused from the caches and the allocator's free lists, rather than fresh ones the size of all
    rows x the whole vocabulary.
    """
    if temperature == 0.0:
        token = logits.argmax(dim=-1)
        return (token, torch.zeros(token.shape, device=token.device)) if logprobs else token
    rows = chunk_rows(logits.device.type, *logits.shape)
    if logits.size(0) <= rows:
        token, logp = _sample_rows(logits, u, temperature, top_k)
    else:
        chunks = [
            _sample_rows(logits[i : i + rows], u[i : i + rows], temperature, top_k)
            for i in range(0, logits.size(0), rows)
        ]
        token, logp = (torch.cat(parts) for parts in zip(*chunks))
    return (token, logp) if logprobs else token


def chunk_rows(device_type, rows, vocab):
    """The rows of (rows, vocab) logits sample_next_token takes at once: on a CPU ROWS_X_VOCAB
    entries' worth; on a GPU all of them, each chunk being a dozen kernel launches there and
    memory not the limit (plumbing/memory.py plans this)."""
    return rows if device_type == "cuda" else max(1, ROWS_X_VOCAB // vocab)


def drawn_logprob(probs, token):
    """log p of each row's drawn token (B,), from the probabilities (B, V) it was drawn with: a
    gather, not a second pass over the vocabulary (a log-softmax would be one)."""
    return probs.gather(1, token[:, None])[:, 0].log()


def _sample_rows(logits, u, temperature, top_k):
    """sample_next_token on rows that fit its working set: (tokens, their log-probs)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if not top_k or top_k >= logits.size(-1):
        probs = torch.softmax(logits, dim=-1)
        token = sample_from_probs(probs, u)
        return token, drawn_logprob(probs, token)
    # the k + 1 largest, in descending order: the first k are the candidates, unless the
    # (k+1)-th ties the k-th (then more than k entries are >= the k-th, and all stay in)
    values, ids = torch.topk(logits, top_k + 1, dim=-1)  # (B, k + 1)
    kth = values[:, top_k - 1 : top_k]
    if logits.is_cuda:  # every row over the whole vocabulary: a check for ties would be a host sync
        probs = torch.softmax(torch.where(logits >= kth, logits, float("-inf")), dim=-1)
        token = sample_from_probs(probs, u)
        return token, drawn_logprob(probs, token)
    # sample among the k candidates only, no pass over the whole vocabulary; sorted by token
    # id, so that the same u picks the same token here as on the paths that walk the whole
    # vocabulary in id order
    candidates, order = ids[:, :top_k].sort(dim=-1)
    probs = torch.softmax(values[:, :top_k].gather(1, order), dim=-1)
    picked = sample_from_probs(probs, u)
    token, logp = candidates.gather(1, picked[:, None])[:, 0], drawn_logprob(probs, picked)
    # a row with a tie at the k-th keeps every tied entry, over its whole row: each row's path
    # depends on its own logits alone
    tied = values[:, top_k] == kth[:, 0]
    if bool(tied.any()):
        rows, kth = logits[tied], kth[tied]
        probs = torch.softmax(torch.where(rows >= kth, rows, float("-inf")), dim=-1)
        token[tied] = sample_from_probs(probs, u[tied])
        logp[tied] = drawn_logprob(probs, token[tied])
    return token, logp


def sample_from_probs(probs, u):
    """
    Inverse CDF, two levels: probs (B, V) >= 0, each row with a positive sum (need not be 1),
    u (B,) in [0, 1) -> for each row the first token whose cumulative probability exceeds
    u * total.
    A full-row cumsum would be a second slow serial pass over the vocabulary; instead sum
    blocks of BLOCK tokens (one vectorized pass), pick the block on the (B, V / BLOCK) running
    sums, and run the cumsum only inside that block (B, BLOCK).
    A token of probability 0 (cut by top-k, or the zeros padding V to whole blocks) is never
    returned: searchsorted(right=True) finds the first running sum strictly above the target,
    and a zero entry does not raise the running sum; where rounding puts the target at or
    past the last running sum, the index is clamped to the last entry that raised it (a
    positive one).
    """
    B, V = probs.shape
    n_blocks = -(-V // BLOCK)
    # zeros up to whole blocks: they weigh nothing, so they are never drawn
    if n_blocks * BLOCK > V:
        probs = torch.nn.functional.pad(probs, (0, n_blocks * BLOCK - V))
    blocks = probs.view(B, n_blocks, BLOCK)
    block_sums = blocks.sum(dim=-1)  # (B, n_blocks)
    running = nondecreasing(block_sums.cumsum(dim=-1))
    target = u[:, None].to(running.dtype) * running[:, -1:]  # (B, 1)
    block = first_above(running, target)  # (B, 1)
    # the running sum before the chosen block; rounding may put it an ulp above the target:
    # clamp the rest at 0, which then picks the block's first positive entry
    rest = (target - (running - block_sums).gather(1, block)).clamp(min=0)
    # (B, BLOCK): the chosen block's entries
    inside = blocks.gather(1, block[:, :, None].expand(B, 1, BLOCK))[:, 0]
    return (block * BLOCK + first_above(nondecreasing(inside.cumsum(dim=-1)), rest))[:, 0]


def nondecreasing(running):
    """A cumulative sum made nondecreasing, as searchsorted needs: CUDA's cumsum adds in a tree,
    not in sequence, and can dip by an ulp (where a 0 follows), which could let a token of
    probability 0 be drawn; a CPU's adds in order and cannot, and is left as it is."""
    return running.cummax(dim=-1).values if running.is_cuda else running


def first_above(running, target):
    """Index (B, 1) of the first entry of running (B, n), nondecreasing, strictly above target
    (B, 1), clamped to the first entry equal to the row's last (the last one that raised the
    running sum: the first maximum, which argmax returns)."""
    last_raise = running.argmax(dim=-1, keepdim=True)
    return torch.minimum(torch.searchsorted(running, target.contiguous(), right=True), last_raise)
