"""
The loss's log-probs. plain_logprobs is the version to read: every logit of a batch that
make_batch lays out. fast_logprobs, the default, computes the same numbers wasting nothing, held
to plain_logprobs by tests/test_fast_logprobs.py. What it does differently, and why:

    fast_logprobs(model, inputs, targets, temperature, loss_grad)
      -> make_shared_batch: each distinct prompt once (the 16 samples of a problem share it,
         and it is often longer than their answers); a row keeps only its own tokens
      -> model.hidden_states(..., SharedPrefix): the prefixes and the rows' own tokens as one
         flat sequence, attention put back into padded slots (SharedPrefix, below)
      -> SampledLogprobs: the head chunk by chunk, never all (tokens, vocabulary) logits at once;
         and, given loss_grad, a guess of the gradient the loss will send back to the log-probs,
         the head's gradients made in the same pass over each chunk's logits, not by projecting
         again in the backward pass

Guess makes loss_grad from chat_rl.objective itself: exact for a loss linear in the log-probs (the
default), whose head is then projected once; for another (a KL term, a ratio) the backward pass
finds the guess wrong and projects again, as token_nll does: any objective gets its own gradient.
token_nll (ChunkedNLL) is the same chunked head for gpt.GPT.forward's per-token NLL (supervised
training), whose gradient is not known in advance: its backward pass projects each chunk again.
micro_batches orders the rows and bounds those of one pass; RolloutLogprobs keeps their
log-probs across --ppo-epochs.
"""

import torch
import torch.nn.functional as F


def plain_logprobs(model, inputs, targets, temperature, loss_grad=None, vocab_size=None):
    """log p(target) under softmax(logits / temperature) over the tokenizer's vocab_size (rows past
    it pad the embedding: never sampled), the distribution the rollout drew from; 0 where targets
    is -1. All (B, T, V) logits at once (--logprobs=plain): the version to read. fast_logprobs,
    the default, gives the same numbers with each prompt run once, the head in chunks, and its
    gradient made in the forward pass from loss_grad (unused here)."""
    logits = model(inputs)[..., :vocab_size].float() / temperature  # (B, T, V)
    logp = logits.log_softmax(dim=-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return torch.where(targets >= 0, logp, 0.0)


def make_batch(sequences, masks, device):
    """Right-padded (inputs, targets), both (B, T - 1): inputs[b, t] = token t of row b predicts
    targets[b, t] = token t + 1, or -1 where the policy did not sample that token (prompt, tool
    result, padding): no gradient."""
    B, T = len(sequences), max(len(s) for s in sequences) - 1
    inputs, targets = torch.zeros(B, T, dtype=torch.long), torch.full((B, T), -1)
    for i, (seq, mask) in enumerate(zip(sequences, masks)):
        inputs[i, : len(seq) - 1] = torch.tensor(seq[:-1])
        sampled = [token if m else -1 for token, m in zip(seq[1:], mask[1:])]
        targets[i, : len(seq) - 1] = torch.tensor(sampled)
    return inputs.to(device), targets.to(device)


def fast_logprobs(model, inputs, targets, temperature, loss_grad=None, vocab_size=None):
    """
    plain_logprobs: inputs, targets (B, T) as make_batch lays them out -> logp (B, T) fp32, the
    log-probability under softmax(logits / temperature) of each target, 0 where targets is -1,
    the softmax over the head's first vocab_size rows (None: all of them).
    loss_grad (B, T): a guess of the gradient the loss will send back to logp (Guess). Given, the
    head's gradients are made for it in the forward pass, handed over if the gradient that arrives
    is that one, made again for the one that arrives if not; None: the head is projected again in
    the backward pass (token_nll).
    """
    prefix_ids, prefix_lengths, row_prefix, own_inputs, own_targets = make_shared_batch(
        inputs, targets
    )
    layout = SharedPrefix(model.rope, prefix_ids, prefix_lengths, row_prefix, own_targets)
    hidden = model.hidden_states(layout.pack(prefix_ids, own_inputs), layout)
    h = hidden[0, layout.num_prefix_tokens :]  # (own tokens, C)
    # the positions with a target, row-major: targets[sampled]'s order
    h = h[own_targets[layout.own_real] >= 0]
    sampled = targets >= 0
    # rows past the tokenizer's vocabulary pad the embedding: never sampled
    weight = model.lm_head.weight[:vocab_size]
    chunk = max(1, LOGITS_PER_CHUNK // weight.size(0))
    if loss_grad is None:
        logp = -token_nll(h, weight, targets[sampled], chunk, temperature)
    else:
        logp = SampledLogprobs.apply(
            h, weight, targets[sampled], loss_grad[sampled], chunk, float(temperature)
        )
    return torch.zeros(targets.shape, device=targets.device).masked_scatter(sampled, logp)


# the head projects at most this many logits at once (each chunk's buffer: 4 bytes each)
LOGITS_PER_CHUNK = 2**24


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


def token_nll(h, weight, targets, chunk, temperature=1.0):
    """
    Per-token NLL (N,) in fp32 of hidden states h (N, C) under the head weight (V, C), chunk
    tokens at a time, of softmax(logits / temperature): the distribution the rollout sampled
    from, so RL's log-probs are those of the policy that drew the tokens (supervised training
    and eval keep 1).
    All (N, V) logits at once would be 5 GB in fp32 for 8192 tokens of a 152k vocabulary, and
    autograd would keep their log-softmax and make their gradient as well: ChunkedNLL never
    holds more than one chunk.
    """
    return ChunkedNLL.apply(h, weight, targets, chunk, float(temperature))


class ChunkedNLL(torch.autograd.Function):
    """
    forward: each chunk's logits z / T in fp32 (T the temperature), their log-sum-exp kept (N,)
    and the NLL read off; the logits dropped.
    backward: each chunk's logits again, turned in place into
    d nll / d z = (softmax(z / T) - onehot) / T (times the incoming gradient), then added into
    the gradients of h and of the head, the head's by addmm_ into a single (V, C) buffer.
    Peak: that buffer plus one chunk's logits. (torch.utils.checkpoint per chunk recomputes
    too, but autograd then makes a fresh (V, C) head gradient per chunk before adding it up: a
    second head-sized buffer.)
    Under autocast the recomputed logits are made as forward made them (bf16 matmul); the
    gradient matmuls run in fp32, the gradients' dtype.
    """

    @staticmethod
    def forward(ctx, h, weight, targets, chunk, temperature):
        nll = torch.empty(h.size(0), device=h.device)
        lse = torch.empty_like(nll)
        for s in range(0, h.size(0), chunk):
            # z / T = (h / T) W^T: scaling the (chunk, C) hidden states costs C/V of scaling
            # the (chunk, V) logits
            logits = F.linear(h[s : s + chunk] / temperature, weight).float()  # (chunk, V)
            lse[s : s + chunk] = torch.logsumexp(logits, dim=-1)
            nll[s : s + chunk] = (
                lse[s : s + chunk] - logits.gather(1, targets[s : s + chunk, None])[:, 0]
            )
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.chunk, ctx.temperature, ctx.autocast = chunk, temperature, autocast_state(h.device.type)
        return nll

    @staticmethod
    def backward(ctx, grad_nll):
        h, weight, targets, lse = ctx.saved_tensors
        grads = nll_grads(
            h,
            weight,
            targets,
            lse,
            grad_nll,
            ctx.chunk,
            ctx.temperature,
            ctx.autocast,
            ctx.needs_input_grad[:2],
        )
        return (*grads, None, None, None)


def nll_grads(h, weight, targets, lse, grad_nll, chunk, temperature, autocast, needed):
    """
    ChunkedNLL's backward pass: the gradients of sum_i grad_nll_i * NLL_i with respect to h (N, C)
    and the head's weight (V, C), each None unless `needed` says so, from the forward pass's
    log-sum-exp lse (N,). Each chunk's logits are made again, as the forward pass made them (under
    `autocast`, the settings it ran under).
    """
    # fp32 buffers whatever h and the head are (bf16 under --fsdp on CUDA, or LoRA's base): the
    # gradient matmuls write fp32; the gradients go back in their inputs' dtypes at the end
    grad_h = torch.empty(h.shape, device=h.device) if needed[0] else None
    grad_w = torch.zeros(weight.shape, device=h.device) if needed[1] else None
    for s in range(0, h.size(0), chunk):
        rows = slice(s, s + chunk)
        with torch.autocast(**autocast):
            logits = F.linear(h[rows] / temperature, weight).float()
        probs = logits.sub_(lse[rows, None]).exp_()  # softmax(z / T), in place
        add_chunk_grads(
            probs,
            targets[rows],
            grad_nll[rows] / temperature,
            h[rows],
            weight,
            None if grad_h is None else grad_h[rows],
            grad_w,
        )
    return (
        None if grad_h is None else grad_h.to(h.dtype),
        None if grad_w is None else grad_w.to(weight.dtype),
    )


def autocast_state(device):
    """What torch.autocast(**autocast_state(device)) needs to run as the current pass runs."""
    return dict(
        device_type=device,
        dtype=torch.get_autocast_dtype(device),
        enabled=torch.is_autocast_enabled(device),
    )


def add_chunk_grads(probs, targets, scale, h, weight, grad_h, grad_w, total=None):
    """
    One chunk's share of the gradients of sum_i scale_i * NLL_i with respect to the hidden
    states and the head: probs (n, V) fp32, the softmax of the logits of h (n, C) or, with
    total (n,), its numerators exp(z - max) over their sum, turned in place into
    d / d logits = (softmax - onehot) * scale (n,); then grad_h (n, C) = that @ weight,
    written (skipped if None), and grad_w (V, C) += its transpose @ h (skipped if None). The
    gradient matmuls run in fp32, the gradients' dtype, under autocast too.
    """
    grad = probs.mul_((scale if total is None else scale / total)[:, None])
    grad.scatter_add_(1, targets[:, None], -scale[:, None])  # - onehot
    with torch.autocast(h.device.type, enabled=False):
        if grad_h is not None:
            torch.matmul(grad, weight.to(grad.dtype), out=grad_h)
        if grad_w is not None:
            grad_w.addmm_(grad.t(), h.to(grad.dtype))


class SampledLogprobs(torch.autograd.Function):
    """
    h (N, C), the head's weight (V, C), targets (N,), loss_grad (N,) -> logp (N,) of
    softmax(h W^T / T), and in the same pass the gradients of sum_i loss_grad_i * logp_i with
    respect to h and W.
    forward: each chunk's logits z / T once: their log-sum-exp and the targets' log-probs, and
    in place d logp / d z, whose products with the head and the hidden states are the gradients
    (add_chunk_grads), kept for the backward pass. ChunkedNLL's backward makes every chunk's
    logits a second time, a third of the head's matmul work; this costs the gradient buffers
    from the forward pass on (grad_h the size of h; the head's (V, C), which the backward pass
    makes anyway) and h itself, kept for the case below.
    backward: the gradients made in the forward pass, if the incoming gradient is exactly loss_grad
    (as it is for a loss linear in logp, whose gradient is the same everywhere); if not, those are
    dropped and the incoming one's made as ChunkedNLL's backward makes them, from h and the
    log-sum-exp: never a wrong gradient, at the cost of the head's matmuls once more.
    """

    @staticmethod
    def forward(ctx, h, weight, targets, loss_grad, chunk, temperature):
        grad_h = torch.empty(h.shape, device=h.device) if ctx.needs_input_grad[0] else None
        grad_w = (
            torch.zeros(weight.shape, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        logp, lse = torch.empty(h.size(0), device=h.device), torch.empty(h.size(0), device=h.device)
        # one (chunk, V) buffer for every chunk's logits: a fresh one per chunk would cost its
        # allocation each time
        buffer = torch.empty(min(chunk, h.size(0)), weight.size(0), device=h.device)
        for s in range(0, h.size(0), chunk):
            rows = slice(s, s + chunk)
            logits = buffer[: h[rows].size(0)]
            if torch.is_autocast_enabled(h.device.type) or weight.dtype != torch.float32:
                # the matmul in autocast's (or the model's) dtype
                logits.copy_(F.linear(h[rows] / temperature, weight))
            else:
                torch.mm(h[rows] / temperature, weight.t(), out=logits)
            target_logits = logits.gather(1, targets[rows, None])[:, 0]
            # the log-sum-exp and the softmax's numerators in place: logsumexp would make two
            # (chunk, V) temporaries
            top = logits.amax(dim=-1)
            exp = logits.sub_(top[:, None]).exp_()
            total = exp.sum(dim=-1)
            logp[rows] = target_logits - top - total.log()
            lse[rows] = top + total.log()
            # d (sum g logp) / d z = -(softmax - onehot) g / T: add_chunk_grads' NLL gradient
            # with scale -g / T
            add_chunk_grads(
                exp,
                targets[rows],
                -loss_grad[rows] / temperature,
                h[rows],
                weight,
                None if grad_h is None else grad_h[rows],
                grad_w,
                total=total,
            )
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.grads, ctx.loss_grad = (grad_h, grad_w), loss_grad
        ctx.chunk, ctx.temperature, ctx.autocast = chunk, temperature, autocast_state(h.device.type)
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        h, weight, targets, lse = ctx.saved_tensors
        grad_h, grad_w = ctx.grads
        # they are handed over once: a second backward pass through the same forward has none
        del ctx.grads
        if torch.equal(grad_logp, ctx.loss_grad):
            grads = (
                None if grad_h is None else grad_h.to(h.dtype),
                None if grad_w is None else grad_w.to(weight.dtype),
            )
        else:  # not the gradient guessed (the loss is not linear in logp): its own, made again
            del grad_h, grad_w
            grads = nll_grads(
                h,
                weight,
                targets,
                lse,
                -grad_logp,
                ctx.chunk,
                ctx.temperature,
                ctx.autocast,
                ctx.needs_input_grad[:2],
            )  # logp = -NLL
        return (*grads, None, None, None, None)


class Guess:
    """
    fast_logprobs' loss_grad through one call of chat_rl.policy_gradient_backward, from the
    objective itself: autograd's gradient of objective(x, batch) at a stand-in x for the log-probs
    about to be computed (the sampling policy's, batch.old_logp, where the batch has them; else
    zeros). For an objective linear in logp, chat_rl's default, that is its gradient at every x,
    so the guess is exact to the bit. For another it misses and SampledLogprobs makes the
    gradients again; watch() sees the miss, and the passes after it are told no guess (the head
    projected again in their backward pass, less work than a forward pass's gradients thrown away).
    """

    def __init__(self, objective):
        self.objective, self.missed = objective, False

    def __call__(self, batch):
        if self.missed:
            return None
        x = batch.old_logp
        if x is None:
            x = torch.zeros(batch.sampled.shape, device=batch.sampled.device)
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            loss, _ = self.objective(x, batch)
            grad = torch.autograd.grad(loss, x, allow_unused=True)[0]
        return torch.zeros_like(x) if grad is None else grad

    def watch(self, logp, guess):
        """logp, on which a hook compares the gradient that arrives with the guess."""

        def compare(grad):
            self.missed = self.missed or not torch.equal(grad, guess)

        if guess is not None and logp.requires_grad:
            logp.register_hook(compare)
        return logp


class RolloutLogprobs:
    """
    Rows' log-probs kept across the epochs of one rollout (--ppo-epochs, --kl-beta), by name: the
    sampling policy's (old_logp, from the first epoch's own pass: the weights have not moved yet,
    so no extra pass) and the reference's (ref_logp, one no-grad pass a row, not one an epoch).
    """

    def __init__(self):
        self.rows = {}  # (name, row) -> the row's log-probs (len(sequence) - 1,)

    def get(self, name, rows):
        """(B, T) of the rows, right-padded with 0 to the longest (make_batch's T); None if any
        is not kept yet."""
        if not all((name, i) in self.rows for i in rows):
            return None
        return torch.nn.utils.rnn.pad_sequence([self.rows[name, i] for i in rows], batch_first=True)

    def put(self, name, rows, logp, sequences):
        for b, i in enumerate(rows):
            self.rows[name, i] = logp[b, : len(sequences[i]) - 1].detach()


def micro_batches(rows, sequences, masks, num_samples, max_rows, max_tokens):
    """The training passes over rows (indices into sequences and masks): lists of indices,
    sorted by prompt length (up to the first sampled token), group and length, so that a
    group's rows share a pass (fast_logprobs runs their prompt once) and rows of similar length
    do (less padding); any order would give the same gradient."""

    def prompt_length(i):
        return next((t for t in range(1, len(masks[i])) if masks[i][t]), len(masks[i]))

    rows = sorted(rows, key=lambda i: (prompt_length(i), i // num_samples, len(sequences[i])))
    return [
        [rows[j] for j in batch]
        for batch in split_rows([len(sequences[i]) - 1 for i in rows], max_rows, max_tokens)
    ]


def split_rows(lengths, max_rows, max_tokens):
    """Split rows into micro-batches (lists of indices, in order) of at most max_rows rows
    and max_tokens padded tokens (rows x longest row), so one memory budget holds for short
    and long completions alike. A row longer than max_tokens gets a micro-batch of its own:
    none is dropped."""
    batches, batch, longest = [], [], 0
    for i, n in enumerate(lengths):
        if batch and (len(batch) == max_rows or (len(batch) + 1) * max(longest, n) > max_tokens):
            batches.append(batch)
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, n)
    return batches + [batch] if batch else batches


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
        j * T + t is query t of head j of a GQA group. In dtype, attention's (bf16 under autocast):
        a mask in another, autocast would cast it in each layer, and each layer would keep its copy
        for the backward pass (it is hundreds of MB at 16k tokens). Its rows lie a multiple of 8
        entries apart in memory, or CUDA's memory-efficient kernel pads a copy in each layer.
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

        y_prefix = F.scaled_dot_product_attention(
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
            self.mask = self.folded_mask(g, q.dtype)
        y_rows = F.scaled_dot_product_attention(
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


LOGPROBS = {"fast": fast_logprobs, "plain": plain_logprobs}  # --logprobs
