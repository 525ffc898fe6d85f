"""
The loss's log-probs. plain_logprobs is the version to read: every logit of a batch that
make_batch lays out. fast_logprobs, the default, computes the same numbers wasting nothing, held
to plain_logprobs by tests/test_fast_logprobs.py. What it does differently, and why:

    fast_logprobs(model, inputs, targets, temperature, loss_grad, vocab_size)
      -> make_shared_batch: each distinct prompt once (the 16 samples of a problem share it,
         and it is often longer than their answers); a row keeps only its own tokens
      -> model.hidden_states(..., SharedPrefix): the prefixes and the rows' own tokens as one
         flat sequence, attention put back into padded slots (fast/shared_prefix.py)
      -> SampledLogprobs: the head chunk by chunk, never all (tokens, vocabulary) logits at once;
         and, given loss_grad, a guess of the gradient the loss will send back to the log-probs,
         the head's gradients made in the same pass over each chunk's logits, not by projecting
         again in the backward pass

Guess makes loss_grad from chat_rl.objective itself: exact for a loss linear in the log-probs (the
default), whose head is then projected once; for another (a KL term, a ratio) the backward pass
finds the guess wrong and projects again, as token_nll does, and the later passes take the
objective's gradient at their own log-probs, a chunk at a time: any objective gets its own
gradient, and one whose tokens' gradients read their own log-probs alone keeps the saving.
token_nll (ChunkedNLL) is the same chunked head for gpt.GPT.forward's per-token NLL (supervised
training), whose gradient is not known in advance: its backward pass projects each chunk again.
micro_batches orders the rows and bounds those of one pass; RolloutLogprobs keeps their
log-probs across --ppo-epochs.
"""

import torch
import torch.nn.functional as F

from fast.shared_prefix import SharedPrefix, make_shared_batch


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
    """Right-padded (inputs, targets), both (B, T) with T the longest row's length - 1: inputs[b, t]
    = token t of row b predicts targets[b, t] = targets_of(row b)[t], padded with -1 (no
    gradient). A prompt p0 p1 and sampled a0 a1, beside a row one token longer:
        sequence  p0 p1 a0 a1     mask  0 0 1 1
        inputs    p0 p1 a0 0      (the last token predicts nothing; 0 pads)
        targets   -1 a0 a1 -1     (column t holds token t + 1 where the policy sampled it)
    So logp[b, t], the log-prob of targets[b, t], is the policy's at token t + 1 of the row."""
    B, T = len(sequences), max(len(s) for s in sequences) - 1
    inputs, targets = torch.zeros(B, T, dtype=torch.long), torch.full((B, T), -1)
    for i, (seq, mask) in enumerate(zip(sequences, masks)):
        inputs[i, : len(seq) - 1] = torch.tensor(seq[:-1])
        targets[i, : len(seq) - 1] = torch.tensor(targets_of(seq, mask))
    return inputs.to(device), targets.to(device)


def targets_of(sequence, mask):
    """A row's targets: token t + 1 where the policy sampled it (mask 1), else -1 (the prompt, a
    tool's result). The first token is never one: nothing before it predicts it."""
    return [token if m else -1 for token, m in zip(sequence[1:], mask[1:])]


def sampled_tokens(mask):
    """|S_i|, the row's tokens the loss trains: its targets_of that are not -1 (mask[1:]: a row's
    first token has nothing before it to predict it, and is always the prompt's)."""
    return sum(mask[1:])


def fast_logprobs(model, inputs, targets, temperature, loss_grad=None, vocab_size=None):
    """
    plain_logprobs: inputs, targets (B, T) as make_batch lays them out -> logp (B, T) fp32, the
    log-probability under softmax(logits / temperature) of each target, 0 where targets is -1,
    the softmax over the head's first vocab_size rows (None: all of them).
    loss_grad (B, T): a guess of the gradient the loss will send back to logp (Guess), or a function
    making it from logp (B, T) itself, called a chunk at a time with the log-probs made so far (0
    where not yet), whose `made` attribute then holds the guess it gave, (B, T). Given, the head's
    gradients are made for it in the forward pass, handed over if the gradient that arrives is that
    one, made again for the one that arrives if not; None: the head is projected again in the
    backward pass (token_nll).
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
    chunk = head_chunk_rows(weight)
    if loss_grad is None:
        return laid_out(-token_nll(h, weight, targets[sampled], chunk, temperature), sampled)
    if not callable(loss_grad):
        logp = SampledLogprobs.apply(
            h, weight, targets[sampled], loss_grad[sampled], chunk, float(temperature)
        )
        return laid_out(logp, sampled)
    # of logp (B, T): SampledLogprobs calls it with its (N,) sampled ones, filling `made` (N,)
    at, made = loss_grad, torch.empty(h.size(0), device=h.device)
    per_token = (lambda logp: at(laid_out(logp, sampled))[sampled], made)
    logp = SampledLogprobs.apply(h, weight, targets[sampled], per_token, chunk, float(temperature))
    at.made = laid_out(made, sampled)
    return laid_out(logp, sampled)


def laid_out(values, sampled):
    """(N,) values of the sampled positions, in targets[sampled]'s order -> (B, T), 0 elsewhere."""
    return torch.zeros(sampled.shape, device=sampled.device).masked_scatter(sampled, values)


# the head projects at most this many logits at once (each chunk's buffer: 4 bytes each), or
# LOW_PRECISION_CHUNKS times as many where its matmuls run in bf16 (head_chunk_rows)
LOGITS_PER_CHUNK = 2**24
LOW_PRECISION_CHUNKS = 8


def head_chunk_rows(weight):
    """Tokens a chunk of fast_logprobs' head takes: LOGITS_PER_CHUNK logits, LOW_PRECISION_CHUNKS
    times as many where the head's matmuls run in bf16 (autocast, or a bf16 head). There each
    chunk's share of the head's gradient is a (V, C) bf16 product added into the fp32 gradient
    (add_chunk_grads): a pass over the whole head per chunk, which at 2**24 logits (110 tokens of
    a 152k vocabulary) outweighs the chunk's own matmuls on a GPU (about 1.4 GB moved against 30
    GFLOP at 0.5B) and on a CPU allocates a head-sized temporary each time. In fp32 the chunks'
    products sum inside the matmul (addmm_), and the chunks, and so the numbers, stay as they
    were."""
    autocast = autocast_state(weight.device.type)
    low_precision = matmul_dtype(weight, autocast) != torch.float32
    logits = LOGITS_PER_CHUNK * (LOW_PRECISION_CHUNKS if low_precision else 1)
    return max(1, logits // weight.size(0))


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
    Under autocast the recomputed logits are made as forward made them (bf16 matmul), and so are
    the gradient matmuls (add_chunk_grads), the sums in fp32.
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
    # gradients are summed in fp32 and go back in their inputs' dtypes at the end
    grad_h = torch.empty(h.shape, device=h.device) if needed[0] else None
    grad_w = torch.zeros(weight.shape, device=h.device) if needed[1] else None
    mm_weight = weight.to(matmul_dtype(weight, autocast))  # cast once, not once a chunk
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
            mm_weight,
            None if grad_h is None else grad_h[rows],
            grad_w,
        )
    return (
        None if grad_h is None else grad_h.to(h.dtype),
        None if grad_w is None else grad_w.to(weight.dtype),
    )


def matmul_dtype(weight, autocast):
    """The head's matmuls' dtype, its gradients' too: autocast's where it is on (its cast of the
    weight, once per pass), else the weight's own."""
    return autocast["dtype"] if autocast["enabled"] else weight.dtype


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
    written (skipped if None), and grad_w (V, C) += its transpose @ h (skipped if None), both
    fp32. The gradient matmuls run in weight's dtype: fp32, or bf16 (autocast's cast of the head,
    matmul_dtype) as autograd's own Linear backward would run them under autocast.
    """
    grad = probs.mul_((scale if total is None else scale / total)[:, None])
    grad.scatter_add_(1, targets[:, None], -scale[:, None])  # - onehot
    with torch.autocast(h.device.type, enabled=False):
        if weight.dtype == torch.float32:
            if grad_h is not None:
                torch.matmul(grad, weight, out=grad_h)
            if grad_w is not None:
                grad_w.addmm_(grad.t(), h.float())
            return
        grad = grad.to(weight.dtype)
        if grad_h is not None:
            grad_h.copy_(grad @ weight)
        if grad_w is not None:
            grad_w.add_(grad.t() @ h.to(weight.dtype))


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
    loss_grad may also be (a function from the log-probs (N,) made so far, 0 for the chunks still to
    come, to the gradient (N,); a buffer (N,)): the function is called once a chunk for that
    chunk's share, which goes into the buffer. Exact for a loss whose gradient at a token reads
    that token's log-prob alone (a KL term, PPO's clip, a rollout correction), which a guess at a
    stand-in misses.
    backward: the gradients made in the forward pass, if the incoming gradient is exactly the one
    they were made for (as it is for a loss linear in logp, whose gradient is the same everywhere);
    if not, those are dropped and the incoming one's made as ChunkedNLL's backward makes them, from
    h and the log-sum-exp: never a wrong gradient, at the cost of the head's matmuls once more.
    """

    @staticmethod
    def forward(ctx, h, weight, targets, loss_grad, chunk, temperature):
        grad_h = torch.empty(h.shape, device=h.device) if ctx.needs_input_grad[0] else None
        grad_w = (
            torch.zeros(weight.shape, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        # logp 0 before its chunk is made: what a per-token loss_grad reads of the chunks to come
        logp, lse = torch.zeros(h.size(0), device=h.device), torch.empty(h.size(0), device=h.device)
        made = loss_grad if torch.is_tensor(loss_grad) else loss_grad[1]
        # one (chunk, V) buffer for every chunk's logits: a fresh one per chunk would cost its
        # allocation each time
        buffer = torch.empty(min(chunk, h.size(0)), weight.size(0), device=h.device)
        autocast = autocast_state(h.device.type)
        mm_weight = weight.to(matmul_dtype(weight, autocast))  # cast once, not once a chunk
        for s in range(0, h.size(0), chunk):
            rows = slice(s, s + chunk)
            logits = buffer[: h[rows].size(0)]
            if mm_weight.dtype != torch.float32:  # autocast's (or the model's) dtype
                logits.copy_(torch.mm((h[rows] / temperature).to(mm_weight.dtype), mm_weight.t()))
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
            if not torch.is_tensor(loss_grad):  # this chunk's share, at its own log-probs
                made[rows] = loss_grad[0](logp)[rows]
            # d (sum g logp) / d z = -(softmax - onehot) g / T: add_chunk_grads' NLL gradient
            # with scale -g / T
            add_chunk_grads(
                exp,
                targets[rows],
                -made[rows] / temperature,
                h[rows],
                mm_weight,
                None if grad_h is None else grad_h[rows],
                grad_w,
                total=total,
            )
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.grads, ctx.loss_grad = (grad_h, grad_w), made
        ctx.chunk, ctx.temperature, ctx.autocast = chunk, temperature, autocast
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
    What editing chat_rl.objective() needs of this class (the rest of this docstring says how):
    - keep objective() a pure function of (logp, batch): it is called again here, on stand-ins;
    - a loss linear in logp (REINFORCE, the default) is guessed exactly: the head's gradients are
      made in the forward pass, once;
    - any other loss is caught (the gradient that arrives is compared with the guess, bit for
      bit) and its head gradients made again from it: slower, never wrong;
    - --logprobs=plain runs the same step with the guess made but unused (plain_logprobs
      ignores it: autograd alone), the check after an edit (tests/test_objective_options.py
      holds the options' gradients on both paths).

    fast_logprobs' loss_grad through one call of plumbing/passes.backward_passes, from the
    objective itself: autograd's gradient of objective(x, batch) at a stand-in x for the log-probs
    about to be computed (the sampling policy's, batch.old_logp, where the batch has them; else
    zeros). For an objective linear in logp, chat_rl's default, that is its gradient at every x,
    so the guess is exact to the bit. For another (a KL term, PPO's clip at a moved policy, a
    rollout correction) it misses and SampledLogprobs makes the gradients again; watch() sees the
    miss, and the passes after it are told the objective's gradient as a function of the log-probs
    themselves, which SampledLogprobs takes a chunk at a time: exact where a token's gradient reads
    its own log-prob alone, as all of chat_rl's do. Should that miss too (a term over a whole
    sequence), the passes after it are told no guess (the head projected again in their backward
    pass, less work than a forward pass's gradients thrown away).
    """

    def __init__(self, objective):
        self.objective, self.misses = objective, 0

    def __call__(self, batch):
        if self.misses == 0:  # at a stand-in
            x = batch.old_logp
            if x is None:
                x = torch.zeros(batch.sampled.shape, device=batch.sampled.device)
            return self.gradient(x, batch)
        if self.misses == 1:  # at the log-probs themselves, as the pass makes them

            def at(logp):
                return self.gradient(logp, batch)

            return at
        return None

    def gradient(self, x, batch):
        """d objective(x, batch) / dx (B, T), x taken as a constant."""
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            loss, _ = self.objective(x, batch)
            grad = torch.autograd.grad(loss, x, allow_unused=True)[0]
        return torch.zeros_like(x) if grad is None else grad

    def logprobs(self, logprobs, model, inputs, targets, temperature, batch, vocab_size=None):
        """logprobs(model, inputs, targets, ...) told this guess for the batch, and watched for a
        miss: the log-probs of a pass of plumbing/passes.backward_passes."""
        loss_grad = self(batch)
        logp = logprobs(
            model, inputs, targets, temperature, loss_grad=loss_grad, vocab_size=vocab_size
        )
        return self.watch(logp, loss_grad)

    def watch(self, logp, guess):
        """logp, on which a hook compares the gradient that arrives with the guess (one made from
        the log-probs: what it made, a chunk at a time; plain_logprobs uses none, so none is
        compared)."""

        def compare(grad):
            expected = getattr(guess, "made", None) if callable(guess) else guess
            if expected is not None:
                self.misses += not torch.equal(grad, expected)

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
    do (less padding). Another order gives the same gradient up to the order of its float sums;
    this one is fixed by the rows alone, so a run (and its resume) repeats bit for bit."""

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


LOGPROBS = {"fast": fast_logprobs, "plain": plain_logprobs}  # --logprobs
