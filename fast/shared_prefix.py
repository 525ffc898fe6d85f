"""
The loss's training forward with each prompt run once: in RL the samples of a problem share its
prompt, often longer than their answers. make_shared_batch lays a batch out as distinct prefixes
and each row's own tokens; SharedPrefix is the layout the model's attention reads that from.
fast/logprobs.fast_logprobs uses both; tests/test_fast_logprobs.py holds it to the plain forward.
"""

import torch

from fast.attention import attention, kernel_dtype


def make_shared_batch(inputs, targets):
    """
    (inputs, targets) of whole rows (B, T) -> the same targets laid out so that each distinct
    prompt runs once (SharedPrefix): a row's prompt is its tokens before its first target; its
    prefix is that prompt less its last token, whose position predicts the first target and so
    starts the row's own part, which ends at its last target (what follows feeds no target).
    Returns prefix_ids (G, P) right-padded, prefix_lengths (G,), row_prefix (B,), and each
    row's own (inputs, targets) (B, T'), right-padded, targets -1 where not sampled.
    """
    prefixes, row_prefix, own = {}, [], []
    for row_inputs, row_targets in zip(inputs.tolist(), targets.tolist()):
        sampled = [t for t, target in enumerate(row_targets) if target >= 0]
        if not sampled:
            # nothing to train on: an empty prefix and one token, which the model leaves out
            key, row = (), ([row_inputs[0]], [-1])
        else:
            first, last = sampled[0], sampled[-1] + 1
            key, row = tuple(row_inputs[:first]), (row_inputs[first:last], row_targets[first:last])
        row_prefix.append(prefixes.setdefault(key, len(prefixes)))
        own.append(row)
    device = inputs.device
    P, T = max(1, max(map(len, prefixes))), max(len(row_inputs) for row_inputs, _ in own)
    prefix_ids = torch.tensor(
        [list(prefix) + [0] * (P - len(prefix)) for prefix in prefixes], dtype=torch.long
    )
    own_inputs = torch.tensor(
        [row_inputs + [0] * (T - len(row_inputs)) for row_inputs, _ in own], dtype=torch.long
    )
    own_targets = torch.tensor(
        [row_targets + [-1] * (T - len(row_targets)) for _, row_targets in own], dtype=torch.long
    )
    prefix_lengths = torch.tensor(list(map(len, prefixes)), dtype=torch.long)
    return (
        prefix_ids.to(device),
        prefix_lengths.to(device),
        torch.tensor(row_prefix, dtype=torch.long).to(device),
        own_inputs.to(device),
        own_targets.to(device),
    )


class SharedPrefix:
    """
    The training forward of samples that share prompts, each prompt run once: in RL the 16
    samples of a problem repeat its prompt, often longer than the answers (the demo's: 90
    tokens against 30), and a plain forward pass would run it, and backpropagate through it,
    16 times.
    Row b = prefix p + its own tokens, where prefix p = the prompt less its last token (that
    token's position predicts the first sampled token, so it starts the row's own part). The
    prefixes' real tokens and the rows' own tokens up to their last target go through the
    layers as one flat sequence (1, N): no padding for the linear layers, which hold most of
    the FLOPs, and every layer called once (FSDP gathers a layer once per call; activation
    checkpointing recomputes one call). A row's tokens after its last target are left out:
    nothing they feed has a target. attend() puts the flat queries, keys and values into padded
    (G, P) and (B, T) slots again for attention alone:
      prefixes: causal within each prefix (its padding comes after it, so causality hides it);
      rows: row b attends to prefix p's keys (its padding masked) and, causally, to its own.
    Same positions, same keys as the whole sequence in one row: the same NLL up to float rounding;
    the backward pass sums each prefix's gradient over its rows (the index_select's backward).
    """

    def __init__(self, rope, prefix_ids, lengths, row_prefix, targets):
        (self.G, self.P), (self.B, self.T) = prefix_ids.shape, targets.shape
        self.row_prefix = row_prefix
        device = targets.device
        self.prefix_real = torch.arange(self.P, device=device)[None, :] < lengths[:, None]  # (G, P)
        last_target = torch.where(targets >= 0, torch.arange(self.T, device=device), -1).amax(dim=1)
        # (B, T)
        self.own_real = torch.arange(self.T, device=device)[None, :] <= last_target[:, None]
        # where each flat token sits in the padded layouts (row-major); how many are prefix tokens
        self.prefix_slots, self.own_slots = (
            self.prefix_real.flatten().nonzero()[:, 0],
            self.own_real.flatten().nonzero()[:, 0],
        )
        self.num_prefix_tokens = self.prefix_slots.numel()
        start = lengths[row_prefix]  # (B,) each row's first position: its prefix's length
        positions = torch.cat(
            [
                torch.arange(self.P, device=device).expand(self.G, -1)[self.prefix_real],
                (start[:, None] + torch.arange(self.T, device=device))[self.own_real],
            ]
        )
        self.rope = rope(positions[None])  # (1, 1, N, D/2, 2)
        # the flat token each padded slot reads (prefixes then rows, row-major); a padding slot
        # reads token 0, a key the mask hides or a query whose output is dropped. Queries: the
        # prefixes' (G * P) and the rows' own (B * T) slots; keys and values: the prefixes',
        # then each row's prefix and own, (B, P + T)
        prefix_index = torch.where(
            self.prefix_real, self.prefix_real.flatten().cumsum(0).view(self.G, self.P) - 1, 0
        )
        own_index = torch.where(
            self.own_real,
            self.num_prefix_tokens + self.own_real.flatten().cumsum(0).view(self.B, self.T) - 1,
            0,
        )
        self.query_index = torch.cat([prefix_index.flatten(), own_index.flatten()])
        self.key_index = torch.cat(
            [
                prefix_index.flatten(),
                torch.cat([prefix_index[row_prefix], own_index], dim=1).flatten(),
            ]
        )
        # each flat token's slot
        self.output_index = torch.cat([self.prefix_slots, self.G * self.P + self.own_slots])
        causal = torch.ones(self.T, self.T, dtype=torch.bool, device=device).tril()
        sees_prefix = self.prefix_real[row_prefix][:, None, :].expand(self.B, self.T, self.P)
        sees_own = causal.expand(self.B, self.T, self.T)
        self.sees = torch.cat([sees_prefix, sees_own], dim=-1)[:, None]  # (B, 1, T, P + T)
        self.mask = None  # the additive mask attention reads, made by the first layer (folded_mask)

    def folded_mask(self, g, dtype):
        """
        The additive mask (B, 1, g * T, P + T), 0 where a query sees a key, -inf elsewhere; row
        j * T + t is query t of head j of a GQA group. In dtype, attention's kernel's (bf16 under
        CUDA's autocast, fp32 on a CPU: fast/attention.kernel_dtype): a mask in another would be
        cast in each layer, and each layer would keep its copy for the backward pass (it is
        hundreds of MB at 16k tokens). Its rows lie a multiple of 8 entries apart in memory, or
        CUDA's memory-efficient kernel pads a copy in each layer.
        """
        keys = self.P + self.T
        width = -(-keys // 8) * 8
        rows = torch.zeros(self.B, 1, g * self.T, width, dtype=dtype, device=self.sees.device)
        return rows[..., :keys].masked_fill_(~self.sees.repeat(1, 1, g, 1), float("-inf"))

    def pack(self, prefix_ids, idx):
        """The flat sequence (1, N) of token ids: the prefixes' real tokens, then the rows' own."""
        return torch.cat([prefix_ids[self.prefix_real], idx[self.own_real]])[None]

    def rope_and_mask(self, N):
        assert N == self.rope.size(2)
        return self.rope, None  # no mask: the model's attention hands over to attend()

    def advance(self, N):
        pass  # positions are fixed by the layout, not by a running count

    def attend(self, layer, q, k, v):
        """
        q (1, H, N, D), k and v (1, Hkv, N, D) of the flat sequence -> attention output
        (1, H, N, D). Each of q, k, v goes into its padded slots by one gather (its backward,
        one scatter-add, sums a prefix's gradient over its rows), the outputs back to the flat
        sequence by one more.
        """
        H, Hkv, D = q.size(1), k.size(1), q.size(3)
        G, P, B, T = self.G, self.P, self.B, self.T
        if q.size(2) == 0:  # no token to attend (FSDP's idle pass): nothing to gather
            return q
        # (slots, heads, D), token-major, split (not sliced: a slice's backward fills a zero
        # tensor of the whole)
        (q_prefix, q_rows), (k_prefix, k_rows), (v_prefix, v_rows) = (
            x[0].transpose(0, 1).index_select(0, index).split([G * P, index.numel() - G * P])
            for x, index in ((q, self.query_index), (k, self.key_index), (v, self.key_index))
        )

        def slots(x, rows, width):  # (rows * width, h, D) -> (rows, h, width, D)
            return x.view(rows, width, x.size(1), D).transpose(1, 2)

        y_prefix = attention(
            slots(q_prefix, G, P),
            slots(k_prefix, G, P),
            slots(v_prefix, G, P),
            is_causal=True,
            enable_gqa=Hkv != H,
        )
        # GQA with a mask: fold each group's g query heads into the time axis, as the prefill
        # does (gpt.Attention)
        g = H // Hkv
        if self.mask is None:  # the same for every layer: made once
            self.mask = self.folded_mask(g, kernel_dtype(q.device, q.dtype))
        y_rows = attention(
            slots(q_rows, B, T).reshape(B, Hkv, g * T, D),
            slots(k_rows, B, P + T),
            slots(v_rows, B, P + T),
            attn_mask=self.mask,
        )
        y_rows = y_rows.reshape(B, H, T, D)
        y = torch.cat(
            [
                y_prefix.transpose(1, 2).reshape(G * P, H, D),
                y_rows.transpose(1, 2).reshape(B * T, H, D),
            ]
        )
        return y.index_select(0, self.output_index)[None].transpose(1, 2)
