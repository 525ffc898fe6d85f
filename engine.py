"""
A small KV-cached batched sampler: the rollout half of RL.

Engine.generate_batch takes P prompts of different lengths and samples S completions of each in one
batch of B = P * S rows:
  1. prefill: the prompts are left-padded into one (P, T) batch and run through the model once; the
     KV cache knows each prompt's pad count, so padding is neither attended to nor counted in RoPE
     positions (a left-padded prompt computes what it computes alone, up to the last bit).
  2. share: each prompt's keys and values serve all its S samples: prefilled once, stored once.
  3. decode: one token per step for every row, until each has sampled a stop token or max_tokens
     tokens. A finished row keeps decoding (its tokens are discarded) until enough rows have finished
     to be worth a compaction: running rows from the back of the batch then move into the finished
     rows' slots and the batch ends where the running rows end, so finished rows stop costing the
     model's matmuls and the attention to their own keys (the attention to the prompts still runs
     over each prompt's S sample slots, zeros where a row has left: one matmul per prompt either way).
Sampling is by inverse CDF: the token is where the row's uniform number for the step falls in its
cumulative probabilities. All of a call's numbers are drawn up front from a seeded generator: u[t, b]
is row b's at step t (drawn as torch.rand(B, max_tokens), a row's numbers one run of the generator's
stream, and stored transposed, so a step reads its numbers u[t] as one contiguous slice; a compaction
moves each row's column with it). A row's
token depends only on its own logits and its own u[t, b]: neither finished rows, compaction, nor the
other rows change what it draws, and the same seed gives the same samples. (Its logits can still move
in the last bit with the batch's size, as any batched matmul's do; where that crosses a boundary
between two tokens, the draw differs.) Cost: one softmax pass over the vocabulary, not one random
number per (row, vocabulary entry) as the Gumbel-max trick needs.

The KV cache, and how the model talks to it, are in fast/kv_cache.py.
"""

import torch

from fast.kv_cache import KVCache
from fast.tool_calls import ToolCalls, call_tables

BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF (sample_from_probs)
ROWS_X_VOCAB = 2 ** 21  # the sampler's working set, rows x vocabulary entries at a time (8 MB in fp32)


def sample_next_token(logits, u, temperature=1.0, top_k=None):
    """
    logits (B, V), u (B,) uniform numbers in [0, 1) -> token ids (B,), row b drawn from
    softmax(logits[b] / temperature) restricted to its top_k entries (all entries tied with the
    k-th largest are kept). temperature 0 = greedy argmax, u unused.
    Rows go through in chunks of at most ROWS_X_VOCAB entries: each chunk's temporaries stay in cache
    and in the allocator's free lists, where a fresh full-size tensor at every step (150 MB for 256 rows
    of a 152k vocabulary) would cost a CPU more in page faults than the softmax itself.
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    rows = max(1, ROWS_X_VOCAB // logits.size(-1))
    if logits.size(0) <= rows:
        return _sample_rows(logits, u, temperature, top_k)
    return torch.cat([_sample_rows(logits[i:i + rows], u[i:i + rows], temperature, top_k)
                      for i in range(0, logits.size(0), rows)])


def _sample_rows(logits, u, temperature, top_k):
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if not top_k or top_k >= logits.size(-1):
        return sample_from_probs(torch.softmax(logits, dim=-1), u)
    # the k + 1 largest, in descending order: the first k are the candidates, unless the (k+1)-th ties the
    # k-th (then more than k entries are >= the k-th, and all of them stay in)
    values, ids = torch.topk(logits, top_k + 1, dim=-1)  # (B, k + 1)
    kth = values[:, top_k - 1:top_k]
    if logits.is_cuda:  # every row over the whole vocabulary: a check for ties would be a host sync
        return sample_from_probs(torch.softmax(torch.where(logits >= kth, logits, float("-inf")), dim=-1), u)
    # sample among the k candidates only, no pass over the whole vocabulary; a row with a tie at the k-th
    # keeps every tied entry, over its whole row: each row's path depends on its own logits alone
    token = ids.gather(1, sample_from_probs(torch.softmax(values[:, :top_k], dim=-1), u)[:, None])[:, 0]
    tied = values[:, top_k] == kth[:, 0]
    if bool(tied.any()):
        rows, kth = logits[tied], kth[tied]
        token[tied] = sample_from_probs(torch.softmax(torch.where(rows >= kth, rows, float("-inf")), dim=-1), u[tied])
    return token


def sample_from_probs(probs, u):
    """
    Inverse CDF, two levels: probs (B, V) >= 0, each row with a positive sum (need not be 1), u (B,)
    in [0, 1) -> for each row the first token whose cumulative probability exceeds u * total.
    A full-row cumsum would be a second slow serial pass over the vocabulary; instead sum blocks of
    BLOCK tokens (one vectorized pass), pick the block on the (B, V / BLOCK) running sums, and run the
    cumsum only inside that block (B, BLOCK).
    A token of probability 0 (cut by top-k, or the zeros padding V to whole blocks) is never returned:
    searchsorted(right=True) finds the first running sum strictly above the target, and a zero entry
    does not raise the running sum; where rounding puts the target at or past the last running sum,
    the index is clamped to the last entry that raised it (a positive one).
    """
    B, V = probs.shape
    n_blocks = -(-V // BLOCK)
    if n_blocks * BLOCK > V:  # zeros up to whole blocks: they weigh nothing, so they are never drawn
        probs = torch.nn.functional.pad(probs, (0, n_blocks * BLOCK - V))
    blocks = probs.view(B, n_blocks, BLOCK)
    block_sums = blocks.sum(dim=-1)                                      # (B, n_blocks)
    running = block_sums.cumsum(dim=-1)
    target = u[:, None].to(running.dtype) * running[:, -1:]             # (B, 1)
    block = first_above(running, target)                                 # (B, 1)
    # the running sum before the chosen block; rounding may put it an ulp above the target: clamp the rest at 0,
    # which then picks the block's first positive entry
    rest = (target - (running - block_sums).gather(1, block)).clamp(min=0)
    inside = blocks.gather(1, block[:, :, None].expand(B, 1, BLOCK))[:, 0]  # (B, BLOCK): the chosen block's entries
    return (block * BLOCK + first_above(inside.cumsum(dim=-1), rest))[:, 0]


def first_above(running, target):
    """Index (B, 1) of the first entry of running (B, n), nondecreasing, strictly above target (B, 1),
    clamped to the first entry equal to the row's last (the last one that raised the running sum: the
    first maximum, which argmax returns)."""
    last_raise = running.argmax(dim=-1, keepdim=True)
    return torch.minimum(torch.searchsorted(running, target.contiguous(), right=True), last_raise)


def compaction_moves(keep, n_keep):
    """
    keep (n,) bool with n_keep True entries -> (holes, fillers, order): the moves that put the kept rows in the
    first n_keep batch slots. A leaving row in front (a hole) takes a kept row from the back (a filler); the other
    kept rows stay where they are, so a compaction copies at most min(leaving, kept) rows rather than all kept ones.
    order (n_keep,): the old slot of each new one. Computed without a host sync (nonzero would need one to size its
    result): the number of moves m stays on the device, so both lists hold c = min(n - n_keep, n_keep) entries, and
    entries past m move a kept front row onto itself.
    """
    n = keep.size(0)
    c = min(n - n_keep, n_keep)
    front_kept = keep[:n_keep]
    holes = torch.argsort(front_kept.to(torch.uint8), stable=True)[:c]                  # the front's leaving rows first
    fillers = n_keep + torch.argsort((~keep[n_keep:]).to(torch.uint8), stable=True)[:c]  # the back's kept rows first
    # as many kept rows at the back as leaving ones at the front: m of each
    fillers = torch.where(torch.arange(c, device=keep.device) < (~front_kept).sum(), fillers, holes)
    order = torch.arange(n_keep, device=keep.device).index_copy_(0, holes, fillers)
    return holes, fillers, order


def decode_step(model, token, cache):
    """token (B,) -> next-token logits (B, V): one token per row through the model, its keys and values cached."""
    return model(token[:, None], kv_cache=cache)[:, -1]


class Engine:
    """
    model, tokenizer: the policy and its tokenizer (stop_tokens, vocab_size).
    compact_at: compact the batch (drop finished rows and their KV cache) once at least this share of
        its rows has finished; 0 = as soon as one has, None = never. A compaction copies running rows from
        the back into finished rows' slots, at most min(finished, running) rows and only their written own
        slots (compaction_moves), while shrinking the batch by 1/8 saves 1/8 of every later step.
    tool: a function from an expression to its result text or None (calculator.calculate), called when a
        row writes GSM8K's `<<expression=`; its result and `>>` are forced into the row (tool_calls.py).
        None: no tool, and a row that writes `<<` is sampled like any other.
    """

    def __init__(self, model, tokenizer, compact_at=0.125, tool=None):
        self.model = model
        self.tokenizer = tokenizer
        self.compact_at = compact_at
        self.tool = tool
        self.tool_tables = None  # tool_calls.call_tables of the tokenizer, built at the first call
        self.tool_calls, self.tool_errors = [], []  # per row of the last generate_batch: calls made, and of them refused

    @torch.no_grad()
    def prefill(self, prompts, num_samples, max_tokens):
        """
        Steps 1-2 of generate_batch: prompts (P token-id lists) -> the logits of each row's first token
        (P * num_samples, V), prompt-major, and the KV cache, ready for max_tokens decode steps of those rows.
        """
        model, device = self.model, self.model.lm_head.weight.device
        lengths = [len(p) for p in prompts]
        assert min(lengths) > 0, "every prompt needs at least one token"
        T = max(lengths)
        ids = torch.tensor([[0] * (T - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)  # one copy to the device
        pad = torch.tensor([T - n for n in lengths], dtype=torch.long, device=device)
        rope = model.rope(torch.arange(T + max_tokens, device=device)[None])[0, 0]  # (max_len, D/2, 2)
        cache = KVCache(model.config.num_hidden_layers, pad, max_tokens, rope)
        logits = model(ids, kv_cache=cache)[:, -1]  # once per prompt
        cache.share(num_samples)                    # its keys serve all its samples
        return logits.repeat_interleave(num_samples, dim=0), cache

    @torch.no_grad()  # not inference_mode: under it autocast keeps no cast weights and casts each one at every step
    def generate_batch(self, prompts, num_samples=1, max_tokens=256, temperature=1.0, top_k=None, seed=0,
                       include_stop=False):
        """
        prompts: list of P token-id lists. Returns (sequences, masks), P * num_samples of each,
        prompt-major: sequence = prompt + generated tokens (the stop token excluded, unless
        include_stop: RL wants it, since ending the answer is a choice the policy makes too);
        mask has 1 on sampled tokens and 0 on the prompt's and on those the tool forced (its results).
        self.tool_calls and self.tool_errors then hold each row's calls and, of them, the refused ones.
        Forced tokens count toward max_tokens: each takes a decode step and a slot of the row's KV cache,
        which max_tokens sizes, and the budget then bounds the sequence the loss runs as well.
        """
        model, device = self.model, self.model.lm_head.weight.device
        stop = torch.tensor(sorted(self.tokenizer.stop_tokens), dtype=torch.long, device=device)
        vocab = self.tokenizer.vocab_size  # a model's embedding table may be padded past it: those rows are not tokens
        logits, cache = self.prefill(prompts, num_samples, max_tokens)
        B = logits.size(0)
        u = torch.rand(B, max_tokens, generator=torch.Generator(device=device).manual_seed(seed), device=device).T.contiguous()
        out = torch.zeros(max_tokens, B, dtype=torch.long, device=device)  # out[t, b]: original row b's token at step t
        row_ids = torch.arange(B, device=device)  # original index of each row in the batch, in batch order
        steps = torch.arange(max_tokens + 1, device=device)  # steps[t]: step t as a tensor, made once
        # each batch row's step of its first stop token, which is its completion length; max_tokens while it runs
        stop_step = torch.full((B,), max_tokens, dtype=torch.long, device=device)
        lengths = stop_step.clone()  # the same by original row, recorded as rows leave the batch
        tools = None
        if self.tool is not None:
            if self.tool_tables is None:
                self.tool_tables = call_tables(self.tokenizer, device)
            tools = ToolCalls(self.tool, self.tokenizer, self.tool_tables, B, device)
            forced = torch.zeros(max_tokens, B, dtype=torch.bool, device=device)  # forced[t, b]: the tool wrote out[t, b]
        for t in range(max_tokens):
            n_rows = row_ids.size(0)
            token = sample_next_token(logits[:, :vocab], u[t], temperature, top_k)
            if tools is not None:  # a row inside a tool's answer takes its next forced token instead
                token, forced_now, called = tools.step(t, token, stop_step == max_tokens)
                forced[t].index_copy_(0, row_ids, forced_now)
            out[t].index_copy_(0, row_ids, token)
            stop_step = torch.minimum(stop_step, torch.where(torch.isin(token, stop), steps[t], steps[max_tokens]))
            if tools is None:
                n_finished = int((stop_step < max_tokens).sum())  # the step's one host sync
            else:
                n_finished, n_called = torch.stack([(stop_step < max_tokens).sum(), called.sum()]).tolist()  # still one
                if n_called:
                    tools.answer(t, called, row_ids, out)
            if n_finished == n_rows or t == max_tokens - 1:
                break
            n_keep = n_rows - n_finished  # a compaction keeps the running rows
            if self.compact_at is not None and n_finished > 0 and n_finished >= self.compact_at * n_rows:
                lengths.index_copy_(0, row_ids, stop_step)  # finished rows leave: record their lengths first
                keep = stop_step == max_tokens  # the running rows
                holes, fillers, order = compaction_moves(keep, n_keep)
                row_ids, stop_step, token, u = row_ids[order], stop_step[order], token[order], u[:, order]
                cache.keep_rows(holes, fillers, row_ids, written=t)  # tokens 0..t-1 are in; token t is fed next
                if tools is not None:
                    tools.keep_rows(order)
            logits = decode_step(model, token, cache)
        lengths.index_copy_(0, row_ids, stop_step)

        out, lengths = out.T.tolist(), lengths.tolist()
        sampled = [[1] * max_tokens] * B if tools is None else (~forced).T.int().tolist()  # 0: forced by the tool
        self.tool_calls, self.tool_errors = (tools.calls, tools.errors) if tools is not None else ([0] * B, [0] * B)
        sequences, masks = [], []
        for row in range(B):
            prompt = prompts[row // num_samples]
            n = lengths[row] + int(include_stop and lengths[row] < max_tokens)  # a row that ran out of tokens has no stop token
            sequences.append(list(prompt) + out[row][:n])
            masks.append([0] * len(prompt) + sampled[row][:n])
        return sequences, masks
