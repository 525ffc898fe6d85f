"""
A small KV-cached batched sampler: the rollout half of RL.

generate_batch takes several prompts of different lengths and samples num_samples completions of
each in one batch:
  1. prefill: the prompts are left-padded into one (P, T) batch and run through the model once;
     the KV cache knows each row's pad count, so padding is neither attended to nor counted in
     RoPE positions (a left-padded prompt computes exactly what it computes alone).
  2. share: each prompt's keys and values serve all its num_samples samples (P -> P*S rows): a
     prompt is prefilled once and its cache stored once, however many samples it gets.
  3. decode: one token per step for all live rows, until every row has sampled a stop token or
     max_tokens tokens. Rows that have stopped keep decoding (their tokens are discarded) until
     enough of them have stopped to be worth a compaction: then live rows from the back of the batch
     move into the finished rows' slots and the batch and its KV cache end where the live rows end,
     so finished rows stop costing compute.
Sampling is by inverse CDF: every row draws one uniform number per step, all of them drawn up
front from a seeded generator as a (rows, max_tokens) table, and the token is where that number
falls in the row's cumulative probabilities. A row's token depends only on its own logits and its
own uniform u[row, step], so neither finished rows, compaction, nor the other rows can change the
number it draws, and the same seed gives the same samples. (Its logits can still move in the last
bit with the batch's size, as any batched matmul's do; where that crosses a boundary between two
tokens, the draw differs.) Cost: one softmax pass over the vocabulary, not one
random number per (row, vocab) entry as the Gumbel-max trick needs.
"""

import torch

from distributed import is_sharded
from tool_calls import ToolCalls, call_tables

BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF (sample_from_probs)
ROWS_X_VOCAB = 2 ** 21  # the sampler's working set, rows x vocabulary entries at a time (8 MB in fp32)


class KVCache:
    """
    Keys and values of every layer, in two parts:
      prompt part (P * Hkv, T, D): written once by the prefill, one row per prompt and kv head, shared by all its samples;
      own part (B, Hkv, max_new, D): one row per sample (prompt-major, B = P * S), one slot per decode step.
    Prompts are left-padded to T: prompt p's tokens start at slot pad[p]; RoPE positions are slot - pad[p]
    and masks hide slots < pad[p]. rope: (max_len, head_dim/2, 2) RoPE rotations of positions 0..max_len-1 (GPT.rope).
    Why two parts: a prompt's keys are the same for its S samples, so they are stored and read once, and a
    decode step attends to them with one matmul per prompt (its S samples' queries stacked as the rows)
    instead of S matmuls of one row each, which on a CPU run far below the memory's speed.
    static: decode steps of one fixed shape that read no Python number (for torch.compile / CUDA graphs): the
    step's slot is a tensor, and every step attends over all max_new own slots, the unwritten ones masked.
    """

    def __init__(self, num_layers, pad, max_new, rope, static=False):
        self.pad = pad  # (P,) long
        self.max_new = max_new
        self.pos = 0  # next slot to write, the same for every row: T + tokens generated so far
        self.prompt_k, self.prompt_v = [None] * num_layers, [None] * num_layers
        self.rope = rope
        self.static, self.decoding = static, False

    def share(self, num_samples):
        """After the prefill: row r = sample r % S of prompt r // S (prompt-major), B = P * S rows."""
        self.samples, self.decoding = num_samples, True
        P, T = self.pad.size(0), self.prompt_len
        self.rows = None  # original index of each row (p * S + s), None = all B rows in order
        self.lead = (P, num_samples)  # leading dims of a rows-first tensor viewed in the (P, S) grid: (B,) after compaction
        self.row_start = T - self.pad.repeat_interleave(num_samples)  # (B,) RoPE position of each row's own slot 0
        k = self.prompt_k[0]  # (P * Hkv, T, D); the own part in its dtype (autocast's)
        B, Hkv = P * num_samples, k.size(0) // P
        self.k = [k.new_zeros(B, Hkv, self.max_new, k.size(2)) for k in self.prompt_k]
        self.v = [v.new_zeros(B, Hkv, self.max_new, v.size(2)) for v in self.prompt_v]
        # (P * Hkv, 1, T) additive: -inf on each prompt's padding, the same for all its samples whatever leaves the batch
        padding = torch.arange(T, device=self.pad.device)[None, :] < self.pad[:, None]
        mask = torch.zeros(padding.shape, device=self.pad.device).masked_fill_(padding, float("-inf"))
        self.prompt_mask = mask[:, None, None].expand(P, Hkv, 1, T).reshape(P * Hkv, 1, T)
        self.slots = torch.arange(self.max_new, device=self.pad.device)
        self.step = torch.zeros(1, dtype=torch.long, device=self.pad.device)  # own slot of the next token (static)
        self.own_mask = torch.zeros((), device=self.pad.device)  # nothing to hide (static: set at every step)

    def keep_rows(self, holes, fillers, order, written):
        """
        Finished rows leave: the live rows move into the first len(order) batch slots, row i now being
        old row order[i] (compaction_moves). Only holes are written, from their fillers (some a live row onto
        itself), and only the written own slots; the batch is then a view of the first slots of the same buffers.
        """
        rows = torch.arange(self.row_start.size(0), device=order.device) if self.rows is None else self.rows
        self.rows, self.row_start, self.lead = rows[order], self.row_start[order], (order.size(0),)
        self.grid_prompt, self.grid_sample = self.rows // self.samples, self.rows % self.samples  # each row's place in the grid
        for buffers in (self.k, self.v):
            for i, t in enumerate(buffers):
                t[holes, :, :written] = t[fillers, :, :written]
                buffers[i] = t[:order.size(0)]

    def rope_and_mask(self, T):
        """
        RoPE rotations (rows, 1, T, head_dim/2, 2) of the T new tokens, and the mask the model's attention needs:
        prefill (T tokens per prompt): boolean (P, 1, T, T), True = may attend;
        decode (one token per row): None, KVCache.attend masks the prompt padding itself.
        """
        if self.decoding:
            assert T == 1, "after the prefill the cache takes one token per row at a time"
            if self.static:  # the slots this step may read, from the step tensor: its shapes never change
                self.own_mask = torch.zeros(self.max_new, device=self.slots.device).masked_fill_(self.slots > self.step, float("-inf"))
            positions = self.row_start + (self.step if self.static else self.pos - self.prompt_len)  # (B,)
            return self.rope[positions][:, None, None], None
        slot = torch.arange(T, device=self.pad.device)
        positions = (slot[None, :] - self.pad[:, None]).clamp(min=0)  # (P, T)
        causal = slot[None, None, :] <= slot[None, :, None]           # (1, T, T)
        real = slot[None, None, :] >= self.pad[:, None, None]         # (P, 1, T): not padding
        # a padding query sees only itself: its output is garbage nobody reads, but never NaN
        itself = slot[None, None, :] == slot[None, :, None]
        return self.rope[positions][:, None], (causal & (real | itself))[:, None]

    def update(self, layer, k, v):
        """Prefill: keep the prompts' k, v (P, Hkv, T, D) as the prompt part; return them for the prefill's attention."""
        assert self.pos == 0, "update() is the prefill's; decode steps go through attend()"
        P, Hkv, T, D = k.shape
        self.prompt_len = T
        self.prompt_k[layer], self.prompt_v[layer] = k.reshape(P * Hkv, T, D).contiguous(), v.reshape(P * Hkv, T, D).contiguous()
        return self.prompt_k[layer].view(P, Hkv, T, D), self.prompt_v[layer].view(P, Hkv, T, D)

    def advance(self, T):
        if self.static and self.decoding:
            self.step += T  # in place: compiled steps see no Python number change
        else:
            self.pos += T

    def attend(self, layer, q, k, v):
        """
        Decode step: q (B, H, 1, D), k and v (B, Hkv, 1, D) of each row's new token -> attention output (B, H, 1, D).
        k, v go into this step's slot of the own part; each row then attends to its prompt's keys and its own, one
        softmax over both. GQA without copies: the g = H / Hkv query heads sharing a kv head are g rows of one matmul.
        The prompt part runs in the (P, S) grid (_to_grid): one matmul per prompt and kv head for all its samples.
        """
        B, H, _, D = q.shape
        Hkv = k.size(1)
        g = H // Hkv
        if self.static:  # write at the slot held in a tensor, attend over all slots, the unwritten ones masked (own_mask)
            self.k[layer].index_copy_(2, self.step, k)
            self.v[layer].index_copy_(2, self.step, v)
            own_k, own_v = self.k[layer], self.v[layer]
        else:
            t = self.pos - self.prompt_len  # own slot of this step
            self.k[layer][:, :, t] = k[:, :, 0]
            self.v[layer][:, :, t] = v[:, :, 0]
            own_k, own_v = self.k[layer][:, :, :t + 1], self.v[layer][:, :, :t + 1]  # (B, Hkv, t + 1, D)
        slots = own_k.size(2)
        q = q.view(B, Hkv, g, D) * D ** -0.5  # contiguous: a view as (B * Hkv, g, D) batches the own part's matmuls
        # scores with the masks added by the same call: prompt padding (P * Hkv, 1, T), own slots not written yet
        prompt_scores = torch.baddbmm(self.prompt_mask, self._to_grid(q), self.prompt_k[layer].transpose(1, 2))
        own_scores = torch.baddbmm(self.own_mask, q.flatten(0, 1), own_k.flatten(0, 1).transpose(1, 2))
        # one softmax over prompt and own keys, in fp32 under autocast; the cat also brings the prompt part back to rows
        scores = torch.cat([self._from_grid(prompt_scores), own_scores.view(*self.lead, Hkv, g, slots)], dim=-1)
        probs = scores.float().softmax(dim=-1).to(v.dtype).view(B, Hkv, g, -1)
        prompt_probs, own_probs = probs.split([probs.size(-1) - slots, slots], dim=-1)
        prompt_y = self._from_grid(torch.bmm(self._to_grid(prompt_probs), self.prompt_v[layer]))
        y = torch.bmm(own_probs.flatten(0, 1), own_v.flatten(0, 1)).view(*self.lead, Hkv, g, D) + prompt_y
        return y.reshape(B, H, 1, D)

    def _to_grid(self, x):
        """
        Rows (B, Hkv, g, X) -> the per-prompt grid (P * Hkv, S * g, X): each prompt's rows stacked by kv head, the
        rows of one matmul per prompt. Rows sit in the grid by their original index; after compaction the grid
        has holes (zero rows, computed and dropped).
        """
        B, Hkv, g, X = x.shape
        P, S = self.pad.size(0), self.samples
        if self.rows is None:
            return x.view(P, S, Hkv, g, X).transpose(1, 2).reshape(P * Hkv, S * g, X)
        grid = x.new_zeros(P, Hkv, S, g, X)
        grid[self.grid_prompt, :, self.grid_sample] = x
        return grid.view(P * Hkv, S * g, X)

    def _from_grid(self, y):
        """The grid (P * Hkv, S * g, Y) -> rows (*lead, Hkv, g, Y): a view (P, S, ...) while every row is in the
        batch, the rows' entries (B, ...) after compaction."""
        P, S = self.pad.size(0), self.samples
        y = y.view(P, y.size(0) // P, S, -1, y.size(-1))
        return y.transpose(1, 2) if self.rows is None else y[self.grid_prompt, :, self.grid_sample]


def sample_next_token(logits, u, temperature=1.0, top_k=None):
    """
    logits (B, V), u (B,) uniform numbers in [0, 1) -> token ids (B,), row b drawn from
    softmax(logits[b] / temperature) restricted to its top_k entries (all entries tied with the
    k-th largest are kept). temperature 0 = greedy argmax, u unused.
    Rows go through in chunks of at most ROWS_X_VOCAB entries: each chunk's temporaries stay in cache
    and in the allocator's free lists (on CPU a fresh 150 MB tensor per step, 256 rows of a 152k
    vocabulary, costs more in page faults than the softmax itself).
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
    if logits.is_cuda or bool((values[:, top_k:] == kth).any()):
        # a tie at the k-th (or a GPU: there this check would be a host sync, and the full row costs little)
        return sample_from_probs(torch.softmax(torch.where(logits >= kth, logits, float("-inf")), dim=-1), u)
    # no tie: sample among the k candidates only, no pass over the whole vocabulary
    return ids.gather(1, sample_from_probs(torch.softmax(values[:, :top_k], dim=-1), u)[:, None])[:, 0]


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


def compaction_moves(live, n_live):
    """
    live (n,) bool with n_live True entries -> (holes, fillers, order): the moves that put the live rows
    in the first n_live batch slots. A finished row in front (a hole) takes a live row from the back (a
    filler); the other live rows stay where they are, so a compaction copies at most min(finished, live)
    rows rather than all live ones. order (n_live,): the old slot of each new one. Computed without a host
    sync (nonzero would need one to size its result): the number of moves m stays on the device, so both
    lists hold c = min(n - n_live, n_live) entries, and entries past m move a live front row onto itself.
    """
    n = live.size(0)
    c = min(n - n_live, n_live)
    front_dead = ~live[:n_live]
    holes = torch.argsort((~front_dead).to(torch.uint8), stable=True)[:c]             # finished front rows first
    fillers = n_live + torch.argsort((~live[n_live:]).to(torch.uint8), stable=True)[:c]  # live back rows first
    # as many live rows at the back as finished ones at the front: m of each
    fillers = torch.where(torch.arange(c, device=live.device) < front_dead.sum(), fillers, holes)
    order = torch.arange(n_live, device=live.device).index_copy_(0, holes, fillers)
    return holes, fillers, order


def padded_live(live, n_live, n_keep):
    """live (n,) bool with n_live True entries -> the n_keep rows a compaction keeps: the live ones and, as padding, the
    first n_keep - n_live finished ones (their tokens are discarded, as a finished row's are until it leaves). No host sync."""
    if n_keep == n_live:
        return live
    finished = ~live
    return live | (finished & (finished.cumsum(0) <= n_keep - n_live))


def decode_step(model, token, cache, weights):
    """
    token (B,) -> next-token logits (B, V): one token per row through the model, its keys/values cached.
    weights: tensors that stand in for the model's own, by name (autocast_weights); {} = the model's.
    """
    if weights:
        return torch.func.functional_call(model, weights, (token[:, None],), {"kv_cache": cache}, tie_weights=False)[:, -1]
    return model(token[:, None], kv_cache=cache)[:, -1]


def autocast_weights(model):
    """
    Under autocast, every Linear's weight and bias cast to autocast's dtype, by name: the casts autocast itself
    makes, for the compiled decode step. Eager autocast (outside inference_mode) casts each fp32 weight once per
    autocast block and reuses the copy; a compiled graph cannot, and casts every weight at every step (a kernel
    per weight, reading all fp32 weights: 4L at 16 rows in bf16 on this CPU, 11.0-13.4 ms a step against
    9.8-12.1 with these). Same values: the compiled step's logits are bit for bit those it makes without them.
    Only the Linears: the embedding (tied to lm_head or not) stays fp32, as under eager autocast. Marked static:
    as inputs of a step compiled with dynamic=True their sizes would otherwise become symbols, and a prompt
    length equal to one of them would cost a recompile.
    {} without autocast, or for an FSDP-sharded model (its mixed precision gathers the weights in bf16 already).
    """
    device_type = model.lm_head.weight.device.type
    if not torch.is_autocast_enabled(device_type) or is_sharded(model):
        return {}
    dtype = torch.get_autocast_dtype(device_type)
    weights = {f"{name}.{p_name}": p.to(dtype) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
               for p_name, p in module.named_parameters(recurse=False)}
    for w in weights.values():
        torch._dynamo.mark_static(w)
    return weights


class Engine:
    """
    model, tokenizer: the policy and its tokenizer (stop_tokens, vocab_size).
    compact_at: compact the batch (drop finished rows and their KV cache) once at least this share of
        its rows has finished; 0 = as soon as one has, None = never. A compaction copies live rows from
        the back into finished rows' slots, at most min(finished, live) rows and only their written own
        slots (compaction_moves): on the bench's mixed-length batch, 23 compactions cost 41-43 ms in all,
        against 126-218 ms when every live row was copied; shrinking the batch by 1/8 saves 1/8 of every
        later step.
    compile_decode: torch.compile the decode step (for CUDA, where per-step Python and kernel launches
        dominate), on a KV cache whose steps all have the same shapes (KVCache static), with the Linears'
        autocast copies made once per call (autocast_weights); compactions keep one of a few batch sizes
        (rows_to_keep), each compiled once. Off by default: not yet shown on a GPU to give the same samples
        faster; on a 2-core CPU compiling takes about a minute a size and gains nothing.
    tool: a function from an expression to its result text or None (calculator.calculate), called when a
        row writes GSM8K's `<<expression=`; its result and `>>` are forced into the row (tool_calls.py).
        None: no tool, and a row that writes `<<` is sampled like any other.
    """

    def __init__(self, model, tokenizer, compact_at=0.125, compile_decode=False, tool=None):
        self.model = model
        self.tokenizer = tokenizer
        self.compact_at = compact_at
        self.compile_decode = compile_decode
        self.decode_step = torch.compile(decode_step, dynamic=True) if compile_decode else decode_step
        self.tool = tool  # calculator.calculate, or None: no tool calls
        self.tool_tables = None  # tool_calls.call_tables of the tokenizer, built at the first call
        self.tool_calls, self.tool_errors = [], []  # per row of the last generate_batch: calls made, and of them refused

    def rows_to_keep(self, n_live, batch):
        """
        How many rows a compaction of a call that began with `batch` rows keeps: the n_live live ones, or under
        compile_decode the smallest size that holds them of batch and the powers of two below it, 8 sizes at most
        (torch.compile's default number of graphs for one function): a rollout's decode steps then take a handful of
        shapes, each compiled (and, on CUDA, capturable as a graph) once, the live rows padded with finished ones.
        """
        if not self.compile_decode:
            return n_live
        sizes = [batch] + [2 ** k for k in reversed(range(batch.bit_length())) if 2 ** k < batch]
        return min(size for size in sizes[:8] if size >= n_live)

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
        cache = KVCache(model.config.num_hidden_layers, pad, max_tokens, rope, static=self.compile_decode)
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
        logits, cache = self.prefill(prompts, num_samples, max_tokens)
        weights = autocast_weights(model) if self.compile_decode else {}  # eager autocast keeps its casts (no_grad)
        B = logits.size(0)
        vocab = self.tokenizer.vocab_size
        # every random number of the call, drawn now: u[t, b] is row b's at step t, whatever else happens
        # (its column moves with the row when the batch is compacted)
        u = torch.rand(B, max_tokens, generator=torch.Generator(device=device).manual_seed(seed), device=device).T.contiguous()
        out = torch.zeros(max_tokens, B, dtype=torch.long, device=device)  # out[t, b]: row b's token at step t
        rows = torch.arange(B, device=device)  # original index of each row still in the batch
        # steps before each row's first stop token = its completion length; max_tokens until it stops
        n_generated = torch.full((B,), max_tokens, dtype=torch.long, device=device)
        live_n = n_generated.clone()  # the same, for the rows in the batch, in batch order
        steps = torch.arange(max_tokens + 1, device=device)  # steps[t]: the step as a tensor, no new one each step
        tools = None
        if self.tool is not None:
            if self.tool_tables is None:
                self.tool_tables = call_tables(self.tokenizer, device)
            tools = ToolCalls(self.tool, self.tokenizer, self.tool_tables, B, device)
            was_forced = torch.zeros(max_tokens, B, dtype=torch.bool, device=device)  # out's tokens the tool wrote
        for t in range(max_tokens):
            # a model's embedding table may be padded past the tokenizer's vocabulary: those rows are not tokens
            n = rows.size(0)
            token = sample_next_token(logits[:, :vocab], u[t], temperature, top_k)
            if tools is not None:  # a row inside a tool's answer takes its next forced token instead
                token, forced, called = tools.step(t, token, live_n == max_tokens)
                was_forced[t].index_copy_(0, rows, forced)
            out[t].index_copy_(0, rows, token)
            live_n = torch.minimum(live_n, torch.where(torch.isin(token, stop), steps[t], steps[max_tokens]))
            if tools is None:
                n_done = int((live_n < max_tokens).sum())  # the step's one host sync
            else:
                n_done, n_called = torch.stack([(live_n < max_tokens).sum(), called.sum()]).tolist()  # still one
                if n_called:
                    tools.answer(t, called, rows, out)
            if n_done == n or t == max_tokens - 1:
                break
            n_keep = self.rows_to_keep(n - n_done, B)  # the live rows; under compile_decode padded to a compiled size
            if self.compact_at is not None and n_done > 0 and n_done >= self.compact_at * n and n_keep < n:
                n_generated.index_copy_(0, rows, live_n)  # finished rows leave: record their lengths first
                holes, fillers, order = compaction_moves(padded_live(live_n == max_tokens, n - n_done, n_keep), n_keep)
                rows, live_n, token, u = rows[order], live_n[order], token[order], u[:, order]
                cache.keep_rows(holes, fillers, order, written=t)  # own slots 0..t-1 hold tokens 0..t-1
                if tools is not None:
                    tools.keep_rows(order)
            logits = self.decode_step(model, token, cache, weights)
        n_generated.index_copy_(0, rows, live_n)

        out, n_generated = out.T.tolist(), n_generated.tolist()
        sampled = [[1] * max_tokens] * B if tools is None else (~was_forced).T.int().tolist()  # mask 0: forced by the tool
        self.tool_calls, self.tool_errors = (tools.calls, tools.errors) if tools is not None else ([0] * B, [0] * B)
        sequences, masks = [], []
        for row in range(B):
            prompt = prompts[row // num_samples]
            stopped = n_generated[row] < max_tokens  # else it ran out of tokens
            n = n_generated[row] + (include_stop and stopped)
            sequences.append(list(prompt) + out[row][:n])
            masks.append([0] * len(prompt) + sampled[row][:n])
        return sequences, masks
