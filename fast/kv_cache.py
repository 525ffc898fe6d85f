"""
The KV cache of engine.py's batched sampler: each prompt's keys and values stored once for all
its samples, each sample's own keys beside them, and a decode pass's attention over both.

The cache is a layout in the sense of policy/gpt.py's GPT._hidden_states, which states the
protocol the model speaks to it (rope_and_mask, update in the prefill, attend in a decode pass,
advance), as fast/shared_prefix.SharedPrefix speaks it for the loss.
The engine calls share(S) once, between the prefill and the first decode pass, and
keep_rows(...) between two decode passes when it compacts the batch.
"""

import torch


class KVCache:
    """
    Keys and values of every layer, in two parts:
      prompt part (P * Hkv, T, D): written once by the prefill, one row per prompt and kv head,
        shared by all its samples;
      own part (B, Hkv, max_new_tokens, D): one row per sample (prompt-major, B = P * S), one
        slot per new token.
    Prompts are left-padded to T: prompt p's tokens start at slot pad[p]; RoPE positions are
    slot - pad[p] and masks hide slots < pad[p]. rope: (max_len, head_dim/2, 2) RoPE rotations
    of positions 0..max_len-1 (GPT.rope).
    Why two parts: a prompt's keys are the same for its S samples, so they are stored and read
    once, and a decode pass attends to them with one matmul per prompt (its S samples' queries
    stacked as the rows) instead of S matmuls of one row each, each of which would read all the
    prompt's keys again for one row.
    """

    def __init__(self, num_layers, pad, max_new_tokens, rope):
        self.pad = pad  # (P,) long: each prompt's left padding
        self.max_new_tokens = max_new_tokens  # own slots of a row: the most tokens it can generate
        self.rope = rope
        self.pos = 0  # the next slot, the same for every row: T + tokens generated so far
        self.prompt_len = None  # T, set by the prefill (update)
        self.prompt_k, self.prompt_v = [None] * num_layers, [None] * num_layers
        self.decoding = False  # set by share(), with the rest:
        self.samples = None  # S
        self.k = self.v = None  # the own part, per layer
        # original index (p * S + s) of each batch row after a compaction; None = all B, in order
        self.row_ids = None
        # leading dims of a rows-first tensor: (P, S) while every row is in, (rows,) after
        self.rows_shape = None
        # (rows,) RoPE position of each batch row's own slot 0: its prompt's length
        self.first_position = None
        # additive mask of the scores against the prompt part: -inf on its padding
        self.prompt_mask = None
        # after a compaction: each batch row's prompt and sample (_to_grid)
        self.grid_prompt = self.grid_sample = None

    def update(self, layer, k, v):
        """Prefill: keep the prompts' k, v (P, Hkv, T, D) as the prompt part; return them for the
        prefill's attention."""
        assert self.pos == 0, "update() is the prefill's; decode passes go through attend()"
        P, Hkv, T, D = k.shape
        self.prompt_len = T
        keys = k.reshape(P * Hkv, T, D).contiguous()
        # kept in fp32 for attend's fp32 scores: under bf16 autocast an exact upcast, made once
        # here rather than at every decode pass (the values stay in the pass's dtype)
        self.prompt_k[layer] = keys.float()
        self.prompt_v[layer] = v.reshape(P * Hkv, T, D).contiguous()
        return keys.view(P, Hkv, T, D), self.prompt_v[layer].view(P, Hkv, T, D)

    def share(self, num_samples):
        """After the prefill: row r = sample r % S of prompt r // S (prompt-major); B = P * S."""
        P, T, device = self.pad.size(0), self.prompt_len, self.pad.device
        self.samples, self.decoding, self.rows_shape = num_samples, True, (P, num_samples)
        self.first_position = T - self.pad.repeat_interleave(num_samples)
        B, Hkv = P * num_samples, self.prompt_k[0].size(0) // P
        # keys in fp32 (as the prompt's: update), values in the pass's dtype (bf16 under autocast)
        self.k = [k.new_zeros(B, Hkv, self.max_new_tokens, k.size(2)) for k in self.prompt_k]
        self.v = [v.new_zeros(B, Hkv, self.max_new_tokens, v.size(2)) for v in self.prompt_v]
        # (P * Hkv, 1, T): -inf on each prompt's padding, the same for all its samples whatever
        # leaves the batch
        padding = torch.arange(T, device=device)[None, :] < self.pad[:, None]
        mask = torch.zeros(padding.shape, device=device).masked_fill_(padding, float("-inf"))
        self.prompt_mask = mask[:, None, None].expand(P, Hkv, 1, T).reshape(P * Hkv, 1, T)

    def rope_and_mask(self, T):
        """
        RoPE rotations (rows, 1, T, head_dim/2, 2) of the T new tokens, and the mask the model's
        attention needs:
        prefill (T tokens per prompt): boolean (P, 1, T, T), True = may attend;
        decode (one token per row): None, attend() masks the prompt padding itself.
        """
        if self.decoding:
            assert T == 1, "after the prefill the cache takes one token per row at a time"
            return self.rope[self.positions()][:, None, None], None
        slot = torch.arange(T, device=self.pad.device)
        positions = (slot[None, :] - self.pad[:, None]).clamp(min=0)  # (P, T)
        causal = slot[None, None, :] <= slot[None, :, None]  # (1, T, T)
        real = slot[None, None, :] >= self.pad[:, None, None]  # (P, 1, T): not padding
        # a padding query sees only itself: its output is garbage nobody reads, but never NaN
        itself = slot[None, None, :] == slot[None, :, None]
        return self.rope[positions][:, None], (causal & (real | itself))[:, None]

    def positions(self):
        """(rows,) RoPE position of each row's token in this decode pass."""
        return self.first_position + (self.pos - self.prompt_len)

    def attend(self, layer, q, k, v):
        """
        Decode pass: q (B, H, 1, D), k and v (B, Hkv, 1, D) of each row's new token ->
        attention output (B, H, 1, D). k, v go into this token's slot of the own part; each row
        then attends to its prompt's keys and its own, one softmax over both. GQA without
        copies: the g = H / Hkv query heads sharing a kv head are g rows of one matmul.
        The prompt part runs in the (P, S) grid (_to_grid): one matmul per prompt and kv head
        for all its samples.
        """
        B, H, _, D = q.shape
        Hkv = k.size(1)
        g = H // Hkv
        own_k, own_v = self.write_own(layer, k, v)  # (B, Hkv, slots, D)
        slots = own_k.size(2)
        # the scores in fp32, as the training pass's attention kernel keeps them: in bf16
        # (autocast's) a score of 20 is off by up to 0.06, and so is each probability, relatively; q
        # is upcast, the keys are kept in fp32 (update, write_own), and autocast is off
        # contiguous: a view as (B * Hkv, g, D) batches the own part's matmuls
        q = q.view(B, Hkv, g, D).float() * D**-0.5
        with torch.autocast(q.device.type, enabled=False):
            # the prompt scores with its padding mask (P * Hkv, 1, T) added by the same call; the
            # own slots read are all written, so they need no mask
            prompt_k = self.prompt_k[layer].transpose(1, 2)
            prompt_scores = torch.baddbmm(self.prompt_mask, self._to_grid(q), prompt_k)
            own_scores = torch.bmm(q.flatten(0, 1), own_k.flatten(0, 1).transpose(1, 2))
        # one softmax over prompt and own keys; the cat also brings the prompt part back to rows
        scores = torch.cat(
            [self._from_grid(prompt_scores), own_scores.view(*self.rows_shape, Hkv, g, slots)],
            dim=-1,
        )
        probs = scores.softmax(dim=-1).to(v.dtype).view(B, Hkv, g, -1)
        prompt_probs, own_probs = probs.split([probs.size(-1) - slots, slots], dim=-1)
        prompt_y = self._from_grid(torch.bmm(self._to_grid(prompt_probs), self.prompt_v[layer]))
        y = (
            torch.bmm(own_probs.flatten(0, 1), own_v.flatten(0, 1)).view(
                *self.rows_shape, Hkv, g, D
            )
            + prompt_y
        )
        return y.reshape(B, H, 1, D)

    def write_own(self, layer, k, v):
        """Store this token's k, v (B, Hkv, 1, D) in its own slot; return the own part's written
        slots (B, Hkv, t + 1, D)."""
        t = self.pos - self.prompt_len
        self.k[layer][:, :, t] = k[:, :, 0]
        self.v[layer][:, :, t] = v[:, :, 0]
        return self.k[layer][:, :, : t + 1], self.v[layer][:, :, : t + 1]

    def advance(self, T):
        """The forward pass is over: its T tokens per row are in the cache, the next ones go T
        slots further."""
        self.pos += T

    def keep_rows(self, holes, fillers, row_ids, written):
        """
        A compaction: the batch becomes the rows row_ids (original indices, in their new
        order), which fill the first len(row_ids) slots (compaction_moves). Only holes are
        written, from their fillers (some a row onto itself), and only the written own slots;
        the batch is then a view of the first slots of the same buffers.
        """
        self.row_ids, self.rows_shape = row_ids, (row_ids.size(0),)
        # each row's place in the grid
        self.grid_prompt, self.grid_sample = row_ids // self.samples, row_ids % self.samples
        self.first_position = self.prompt_len - self.pad[self.grid_prompt]
        for buffers in (self.k, self.v):
            for i, buffer in enumerate(buffers):
                buffer[holes, :, :written] = buffer[fillers, :, :written]
                buffers[i] = buffer[: row_ids.size(0)]

    def _to_grid(self, x):
        """
        Rows (B, Hkv, g, X) -> the per-prompt grid (P * Hkv, S * g, X): each prompt's rows
        stacked by kv head, the rows of one matmul per prompt. Rows sit in the grid by their
        original index; after a compaction the grid has holes (zero rows, computed and dropped).
        """
        B, Hkv, g, X = x.shape
        P, S = self.pad.size(0), self.samples
        if self.row_ids is None:
            return x.view(P, S, Hkv, g, X).transpose(1, 2).reshape(P * Hkv, S * g, X)
        grid = x.new_zeros(P, Hkv, S, g, X)
        grid[self.grid_prompt, :, self.grid_sample] = x
        return grid.view(P * Hkv, S * g, X)

    def _from_grid(self, y):
        """The grid (P * Hkv, S * g, Y) -> rows (*rows_shape, Hkv, g, Y): a view (P, S, ...)
        while every row is in the batch, the rows' entries (B, ...) after a compaction (the two
        index tensors, apart, put their dim first)."""
        P, S = self.pad.size(0), self.samples
        y = y.view(P, y.size(0) // P, S, -1, y.size(-1))  # (P, Hkv, S, g, Y)
        return (
            y.transpose(1, 2) if self.row_ids is None else y[self.grid_prompt, :, self.grid_sample]
        )
