"""
The loss's forward pass, laid out to waste nothing: what chat_rl's policy_gradient_backward hands the model,
and the two pieces of the model's training pass that make it cheap.

    rollouts -> make_shared_batch (each prompt once) -> micro_batches (rows and tokens bounded)
             -> gpt.GPT.forward(..., prefix=) -> SharedPrefix (attention over the shared prompts)
                                              -> token_nll (the NLL, chunked over tokens)

make_batch lays out whole sequences, one row each: supervised training (scripts/make_demo_model.py) and
the reference the tests compare the shared layout with.
"""

import torch
import torch.nn.functional as F


def make_batch(sequences, masks, device):
    """Right-padded (inputs, targets), both (B, T - 1): inputs[t] predicts targets[t] = sequence[t + 1].
    targets are -1 where the next token was not sampled by the policy (prompt, padding): no gradient.
    (Whole sequences, one row each: what supervised training wants; RL's loss uses make_shared_batch.)"""
    T = max(len(s) for s in sequences) - 1
    inputs = torch.zeros(len(sequences), T, dtype=torch.long)
    targets = torch.full((len(sequences), T), -1, dtype=torch.long)
    for i, (seq, mask) in enumerate(zip(sequences, masks)):
        n = len(seq) - 1
        inputs[i, :n] = torch.tensor(seq[:-1])
        # the target of position t is token t + 1, and it is trained only if the policy sampled it
        targets[i, :n] = torch.tensor([tok if m else -1 for tok, m in zip(seq[1:], mask[1:])])
    return inputs.to(device), targets.to(device)


def first_target(mask):
    """Position of a row's first sampled token that is a target (position 0 never is); None if it has none."""
    return next((i for i in range(1, len(mask)) if mask[i]), None)


def make_shared_batch(sequences, masks, device):
    """
    make_batch's targets, laid out so that each distinct prompt is run once (SharedPrefix below): the 16
    samples of a problem share its prompt, and the loss would otherwise run it, forward and backward,
    16 times. A row's prompt is its tokens before its first target; its prefix is that prompt less its
    last token, whose position predicts the first target and so starts the row's own part.
    Returns prefix = (ids (G, P) right-padded, lengths (G,), row_prefix (B,)) for model(..., prefix=prefix),
    and each row's own (inputs, targets) (B, T), right-padded, targets -1 where not sampled.
    """
    prefixes, row_prefix, own = {}, [], []
    for seq, mask in zip(sequences, masks):
        start = first_target(mask)
        if start is None:  # nothing to train on: an empty prefix and one token, which the model leaves out
            key, row = (), ([seq[0]], [-1])
        else:
            key, row = tuple(seq[:start - 1]), (seq[start - 1:-1], [tok if m else -1 for tok, m in zip(seq[start:], mask[start:])])
        row_prefix.append(prefixes.setdefault(key, len(prefixes)))
        own.append(row)
    P, T = max(1, max(map(len, prefixes))), max(1, max(len(inputs) for inputs, _ in own))
    ids = torch.zeros(len(prefixes), P, dtype=torch.long)
    for g, prefix in enumerate(prefixes):
        ids[g, :len(prefix)] = torch.tensor(prefix, dtype=torch.long)
    inputs = torch.zeros(len(own), T, dtype=torch.long)
    targets = torch.full((len(own), T), -1, dtype=torch.long)
    for i, (row_inputs, row_targets) in enumerate(own):
        inputs[i, :len(row_inputs)] = torch.tensor(row_inputs, dtype=torch.long)
        targets[i, :len(row_targets)] = torch.tensor(row_targets, dtype=torch.long)
    lengths = torch.tensor(list(map(len, prefixes)), dtype=torch.long)
    prefix = (ids.to(device), lengths.to(device), torch.tensor(row_prefix, dtype=torch.long).to(device))
    return prefix, inputs.to(device), targets.to(device)


def micro_batches(lengths, max_rows, max_tokens):
    """Split rows into micro-batches (lists of indices, in order) of at most max_rows rows and
    max_tokens padded tokens (rows x longest row), so one memory budget holds for short and long
    completions alike. A row longer than max_tokens gets a micro-batch of its own: none is dropped."""
    batches, batch, longest = [], [], 0
    for i, n in enumerate(lengths):
        if batch and (len(batch) == max_rows or (len(batch) + 1) * max(longest, n) > max_tokens):
            batches.append(batch)
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, n)
    return batches + [batch] if batch else batches


def token_nll(h, weight, targets, chunk, temperature=1.0):
    """
    Per-token NLL (N,) in fp32 of hidden states h (N, C) under the head weight (V, C), chunk tokens at a time,
    of softmax(logits / temperature): the distribution the rollout sampled from, so RL's log-probs are those
    of the policy that drew the tokens (supervised training and eval keep 1).
    All (N, V) logits at once would be 5 GB in fp32 for 8192 tokens of a 152k vocabulary, and autograd would
    keep their log-softmax and make their gradient as well: ChunkedNLL never holds more than one chunk.
    """
    return ChunkedNLL.apply(h, weight, targets, chunk, float(temperature))


class ChunkedNLL(torch.autograd.Function):
    """
    forward: each chunk's logits z / T in fp32 (T the temperature), their log-sum-exp kept (N,) and the NLL read
    off; the logits dropped.
    backward: each chunk's logits again, turned in place into d nll / d z = (softmax(z / T) - onehot) / T (times
    the incoming gradient), then added into the gradients of h and of the head, the head's by addmm_ into a single
    (V, C) buffer. Peak: that buffer plus one chunk's logits. (torch.utils.checkpoint per chunk recomputes too,
    but autograd then makes a fresh (V, C) head gradient per chunk before adding it up: +0.5 GB at 152k x 768.)
    Under autocast the recomputed logits are made as forward made them (bf16 matmul); the gradient matmuls
    run in fp32, the gradients' dtype.
    """

    @staticmethod
    def forward(ctx, h, weight, targets, chunk, temperature):
        nll = torch.empty(h.size(0), device=h.device)
        lse = torch.empty_like(nll)
        for s in range(0, h.size(0), chunk):
            # z / T = (h / T) W^T: scaling the (chunk, C) hidden states costs C/V of scaling the (chunk, V) logits
            logits = F.linear(h[s:s + chunk] / temperature, weight).float()  # (chunk, V)
            lse[s:s + chunk] = torch.logsumexp(logits, dim=-1)
            nll[s:s + chunk] = lse[s:s + chunk] - logits.gather(1, targets[s:s + chunk, None])[:, 0]
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.chunk, ctx.temperature = chunk, temperature
        device = h.device.type
        ctx.autocast = dict(device_type=device, dtype=torch.get_autocast_dtype(device), enabled=torch.is_autocast_enabled(device))
        return nll

    @staticmethod
    def backward(ctx, grad_nll):
        h, weight, targets, lse = ctx.saved_tensors
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for s in range(0, h.size(0), ctx.chunk):
            rows = slice(s, s + ctx.chunk)
            with torch.autocast(**ctx.autocast):
                logits = F.linear(h[rows] / ctx.temperature, weight).float()
            probs = logits.sub_(lse[rows, None]).exp_()  # softmax(z / T), in place
            add_chunk_grads(probs, targets[rows], grad_nll[rows] / ctx.temperature, h[rows], weight,
                            None if grad_h is None else grad_h[rows], grad_w)
        return grad_h, grad_w, None, None, None


def add_chunk_grads(probs, targets, scale, h, weight, grad_h, grad_w, total=None):
    """
    One chunk's share of the gradients of sum_i scale_i * NLL_i with respect to the hidden states and the head:
    probs (n, V) fp32, the softmax of the logits of h (n, C) or, with total (n,), its numerators exp(z - max)
    over their sum, turned in place into d / d logits = (softmax - onehot) * scale (n,); then grad_h (n, C) =
    that @ weight, written (skipped if None), and grad_w (V, C) += its transpose @ h (skipped if None). The
    gradient matmuls run in fp32, the gradients' dtype, under autocast too.
    """
    grad = probs.mul_((scale if total is None else scale / total)[:, None])
    grad.scatter_add_(1, targets[:, None], -scale[:, None])  # - onehot
    with torch.autocast(h.device.type, enabled=False):
        if grad_h is not None:
            torch.matmul(grad, weight.to(grad.dtype), out=grad_h)
        if grad_w is not None:
            grad_w.addmm_(grad.t(), h.to(grad.dtype))


def weighted_nll(h, weight, targets, token_weights, chunk, temperature=1.0):
    """
    sum_i token_weights[i] * NLL_i (a scalar): the loss of token_nll's per-token NLL weighted by a factor known
    before the forward pass (RL's advantage over the normaliser), with its gradients made in the same pass over
    the logits (WeightedNLL), so that the backward pass projects nothing again.
    """
    return WeightedNLL.apply(h, weight, targets, token_weights, chunk, float(temperature))


class WeightedNLL(torch.autograd.Function):
    """
    forward: each chunk's logits z / T once: their log-sum-exp and NLL, and in place d / d z of the weighted
    sum, whose products with the head and the hidden states are the gradients of h and of the head (add_chunk_grads),
    kept for the backward pass, which scales them by its incoming gradient. ChunkedNLL's backward makes every
    chunk's logits a second time, a third of the head's matmul work; this costs the gradient buffers from the
    forward pass on (grad_h the size of h, which is not kept; the head's (V, C), which the backward pass makes anyway).
    """

    @staticmethod
    def forward(ctx, h, weight, targets, token_weights, chunk, temperature):
        grad_h = torch.empty(h.shape, device=h.device) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, device=weight.device) if ctx.needs_input_grad[1] else None
        loss = torch.zeros((), device=h.device)
        # one (chunk, V) buffer for every chunk's logits: on CPU a fresh 64 MiB tensor per chunk costs a third more
        # than its matmul in page faults
        buffer = torch.empty(min(chunk, h.size(0)), weight.size(0), device=h.device)
        for s in range(0, h.size(0), chunk):
            rows = slice(s, s + chunk)
            logits = buffer[:h[rows].size(0)]
            if torch.is_autocast_enabled(h.device.type) or weight.dtype != torch.float32:
                logits.copy_(F.linear(h[rows] / temperature, weight))  # the matmul in autocast's (or the model's) dtype
            else:
                torch.mm(h[rows] / temperature, weight.t(), out=logits)
            target_logits = logits.gather(1, targets[rows, None])[:, 0]
            # the log-sum-exp and the softmax's numerators in place: logsumexp would make two (chunk, V) temporaries
            top = logits.amax(dim=-1)
            exp = logits.sub_(top[:, None]).exp_()
            total = exp.sum(dim=-1)
            loss += ((top + total.log() - target_logits) * token_weights[rows]).sum()
            add_chunk_grads(exp, targets[rows], token_weights[rows] / temperature, h[rows], weight,
                            None if grad_h is None else grad_h[rows], grad_w, total=total)
        ctx.grads, ctx.h_dtype, ctx.w_dtype = (grad_h, grad_w), h.dtype, weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.grads
        del ctx.grads  # in place below: a second backward pass through the same forward would scale them twice
        return (None if grad_h is None else grad_h.mul_(grad_loss).to(ctx.h_dtype),
                None if grad_w is None else grad_w.mul_(grad_loss).to(ctx.w_dtype), None, None, None, None)


class SharedPrefix:
    """
    The training forward of samples that share prompts, each prompt run once: in RL the 16 samples of a
    problem repeat its prompt, often longer than the answers (the demo's: 90 tokens against 30), and a
    plain forward pass would run it, and backpropagate through it, 16 times.
    Row b = prefix p + its own tokens, where prefix p = the prompt less its last token (that token's
    position predicts the first sampled token, so it starts the row's own part). The prefixes' real
    tokens and the rows' own tokens up to their last target go through the layers as one flat sequence
    (1, N): no padding for the linear layers, which hold most of the FLOPs, and every layer called once
    (FSDP gathers a layer once per call; activation checkpointing recomputes one call). A row's tokens
    after its last target are left out: nothing they feed has a target. attend() puts the flat queries,
    keys and values into padded (G, P) and (B, T) slots again for attention alone:
      prefixes: causal within each prefix (its padding comes after it, so causality hides it);
      rows: row b attends to prefix p's keys (its padding masked) and, causally, to its own.
    Same positions, same keys as the whole sequence in one row: the same NLL up to float rounding;
    the backward pass sums each prefix's gradient over its rows (the index_select's backward).
    """

    def __init__(self, rope, prefix_ids, lengths, row_prefix, targets):
        (self.G, self.P), (self.B, self.T) = prefix_ids.shape, targets.shape
        self.row_prefix = row_prefix
        device = targets.device
        self.prefix_real = torch.arange(self.P, device=device)[None, :] < lengths[:, None]   # (G, P)
        last_target = torch.where(targets >= 0, torch.arange(self.T, device=device), -1).amax(dim=1)
        self.own_real = torch.arange(self.T, device=device)[None, :] <= last_target[:, None]  # (B, T)
        # where each flat token sits in the padded layouts (row-major), and how many are prefix tokens
        self.prefix_slots, self.own_slots = self.prefix_real.flatten().nonzero()[:, 0], self.own_real.flatten().nonzero()[:, 0]
        self.num_prefix_tokens = self.prefix_slots.numel()
        start = lengths[row_prefix]  # (B,) each row's first position: its prefix's length
        positions = torch.cat([torch.arange(self.P, device=device).expand(self.G, -1)[self.prefix_real],
                               (start[:, None] + torch.arange(self.T, device=device))[self.own_real]])
        self.rope = rope(positions[None])  # (1, 1, N, D/2, 2)
        # the flat token each padded slot reads (prefixes then rows, row-major); a padding slot reads token 0, a key
        # the mask hides or a query whose output is dropped. Queries: the prefixes' (G * P) and the rows' own
        # (B * T) slots; keys and values: the prefixes', then each row's prefix and own, (B, P + T)
        prefix_index = torch.where(self.prefix_real, self.prefix_real.flatten().cumsum(0).view(self.G, self.P) - 1, 0)
        own_index = torch.where(self.own_real, self.num_prefix_tokens + self.own_real.flatten().cumsum(0).view(self.B, self.T) - 1, 0)
        self.query_index = torch.cat([prefix_index.flatten(), own_index.flatten()])
        self.key_index = torch.cat([prefix_index.flatten(), torch.cat([prefix_index[row_prefix], own_index], dim=1).flatten()])
        self.output_index = torch.cat([self.prefix_slots, self.G * self.P + self.own_slots])  # each flat token's slot
        causal = torch.ones(self.T, self.T, dtype=torch.bool, device=device).tril()
        sees = torch.cat([self.prefix_real[row_prefix][:, None, :].expand(self.B, self.T, self.P),
                          causal.expand(self.B, self.T, self.T)], dim=-1)[:, None]  # (B, 1, T, P + T)
        self.mask = torch.zeros(sees.shape, device=device).masked_fill_(~sees, float("-inf"))  # additive: built once
        self.folded_mask = None  # the mask with GQA's query heads folded into time (attend)

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
        q (1, H, N, D), k and v (1, Hkv, N, D) of the flat sequence -> attention output (1, H, N, D). Each of q, k, v
        goes into its padded slots by one gather (its backward, one scatter-add, sums a prefix's gradient over its
        rows), the outputs back to the flat sequence by one more.
        """
        H, Hkv, D = q.size(1), k.size(1), q.size(3)
        G, P, B, T = self.G, self.P, self.B, self.T
        if q.size(2) == 0:  # no token to attend (FSDP's idle pass): nothing to gather
            return q
        # (slots, heads, D), token-major, split (not sliced: a slice's backward fills a zero tensor of the whole)
        (q_prefix, q_rows), (k_prefix, k_rows), (v_prefix, v_rows) = (
            x[0].transpose(0, 1).index_select(0, index).split([G * P, index.numel() - G * P])
            for x, index in ((q, self.query_index), (k, self.key_index), (v, self.key_index)))

        def slots(x, rows, width):  # (rows * width, h, D) -> (rows, h, width, D)
            return x.view(rows, width, x.size(1), D).transpose(1, 2)

        y_prefix = F.scaled_dot_product_attention(slots(q_prefix, G, P), slots(k_prefix, G, P), slots(v_prefix, G, P),
                                                  is_causal=True, enable_gqa=Hkv != H)
        # GQA with a mask: fold each group's g query heads into the time axis, as the prefill does (gpt.Attention)
        g = H // Hkv
        if self.folded_mask is None:  # the same for every layer: built once
            self.folded_mask = self.mask.repeat(1, 1, g, 1) if g > 1 else self.mask
        y_rows = F.scaled_dot_product_attention(slots(q_rows, B, T).reshape(B, Hkv, g * T, D), slots(k_rows, B, P + T),
                                                slots(v_rows, B, P + T), attn_mask=self.folded_mask).reshape(B, H, T, D)
        y = torch.cat([y_prefix.transpose(1, 2).reshape(G * P, H, D), y_rows.transpose(1, 2).reshape(B * T, H, D)])
        return y.index_select(0, self.output_index)[None].transpose(1, 2)
