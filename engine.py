"""
A small KV-cached batched sampler: the rollout half of RL.

generate_batch takes several prompts of different lengths and samples num_samples completions of
each in one batch:
  1. prefill: the prompts are left-padded into one (P, T) batch and run through the model once;
     the KV cache knows each row's pad count, so padding is neither attended to nor counted in
     RoPE positions (a left-padded prompt computes exactly what it computes alone).
  2. share: each prompt's cache row is repeated for its num_samples samples (P -> P*S rows), so a
     prompt is prefilled once however many samples it gets.
  3. decode: one token per step for all rows, until every row has sampled a stop token or
     max_tokens tokens.
Sampling uses the Gumbel-max trick with noise drawn for the whole (rows, vocab) grid from a seeded
generator: a row's token depends only on its own logits and its own slice of noise, so finished
rows (which keep decoding, their tokens discarded) can never change other rows' results, and the
same seed gives the same samples.
"""

import torch


class KVCache:
    """Keys and values of every layer for B rows that share one write position.

    Rows are left-padded: row b's real tokens start at cache slot pad[b]. Position ids for RoPE are
    slot - pad[b], and the attention mask hides slots < pad[b].
    """

    def __init__(self, num_layers, pad, max_len):
        self.pad = pad  # (B,) long: left padding of each row
        self.max_len = max_len
        self.pos = 0  # next slot to write, the same for every row
        self.k = [None] * num_layers
        self.v = [None] * num_layers

    def positions_and_mask(self, T):
        """RoPE positions (B, T) and boolean attention mask (B, 1, T, pos + T) for T new tokens."""
        device = self.pad.device
        q_slot = self.pos + torch.arange(T, device=device)         # slots of the new tokens
        k_slot = torch.arange(self.pos + T, device=device)         # slots they may look at
        positions = (q_slot[None, :] - self.pad[:, None]).clamp(min=0)
        causal = k_slot[None, None, :] <= q_slot[None, :, None]    # (1, T, S)
        real = k_slot[None, None, :] >= self.pad[:, None, None]    # (B, 1, S): not padding
        # a padding query sees only itself: its output is garbage nobody reads, but never NaN
        itself = k_slot[None, None, :] == q_slot[None, :, None]
        return positions, (causal & (real | itself))[:, None]

    def update(self, layer, k, v):
        """Write k, v (B, H, T, D) at the current position; return all keys/values so far."""
        B, H, T, D = k.shape
        if self.k[layer] is None:  # allocate lazily: dtype follows autocast
            self.k[layer] = torch.zeros(B, H, self.max_len, D, dtype=k.dtype, device=k.device)
            self.v[layer] = torch.zeros(B, H, self.max_len, D, dtype=v.dtype, device=v.device)
        end = self.pos + T
        assert end <= self.max_len, f"KV cache overflow: {end} > {self.max_len}"
        self.k[layer][:, :, self.pos:end] = k
        self.v[layer][:, :, self.pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, T):
        self.pos += T

    def repeat_rows(self, n):
        """Row b becomes rows b*n .. b*n+n-1 (prompt-major), e.g. to share a prefill across samples."""
        self.pad = self.pad.repeat_interleave(n)
        self.k = [t.repeat_interleave(n, dim=0) for t in self.k]
        self.v = [t.repeat_interleave(n, dim=0) for t in self.v]


def sample_next_token(logits, generator, temperature=1.0, top_k=None):
    """logits (B, V) -> token ids (B,). temperature 0 = greedy."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    # Gumbel-max: argmax(logits + Gumbel noise) is a sample of softmax(logits), row by row
    noise = torch.empty_like(logits).exponential_(generator=generator)
    return (logits - noise.log()).argmax(dim=-1)


class Engine:
    def __init__(self, model, tokenizer):
        self.model = model
        self.tokenizer = tokenizer

    @torch.inference_mode()
    def generate_batch(self, prompts, num_samples=1, max_tokens=256, temperature=1.0, top_k=None, seed=0,
                       include_stop=False):
        """
        prompts: list of P token-id lists. Returns (sequences, masks), P * num_samples of each,
        prompt-major: sequence = prompt + generated tokens (the stop token excluded, unless
        include_stop: RL wants it, since ending the answer is a choice the policy makes too);
        mask has 0 on prompt tokens and 1 on sampled ones.
        """
        model, device = self.model, self.model.lm_head.weight.device
        stop = torch.tensor(sorted(self.tokenizer.stop_tokens), dtype=torch.long, device=device)
        generator = torch.Generator(device=device).manual_seed(seed)
        lengths = [len(p) for p in prompts]
        assert min(lengths) > 0, "every prompt needs at least one token"
        T = max(lengths)
        ids = torch.zeros(len(prompts), T, dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            ids[i, T - len(p):] = torch.tensor(p, dtype=torch.long)
        pad = torch.tensor([T - n for n in lengths], dtype=torch.long, device=device)
        cache = KVCache(model.config.num_hidden_layers, pad, max_len=T + max_tokens)

        logits = model(ids, kv_cache=cache)[:, -1]                    # prefill once per prompt
        cache.repeat_rows(num_samples)                                # share it across samples
        logits = logits.repeat_interleave(num_samples, dim=0)
        B = logits.size(0)
        vocab = self.tokenizer.vocab_size
        out = torch.zeros(B, max_tokens, dtype=torch.long, device=device)
        n_generated = torch.full((B,), max_tokens, dtype=torch.long, device=device)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        for t in range(max_tokens):
            # a model's embedding table may be padded past the tokenizer's vocabulary: those rows are not tokens
            token = sample_next_token(logits[:, :vocab], generator, temperature, top_k)
            out[:, t] = token
            just_stopped = ~done & torch.isin(token, stop)
            n_generated[just_stopped] = t
            done |= just_stopped
            if t == max_tokens - 1 or bool(done.all()):
                break
            logits = model(token[:, None], kv_cache=cache)[:, -1]

        out, n_generated, done = out.tolist(), n_generated.tolist(), done.tolist()
        sequences, masks = [], []
        for row in range(B):
            prompt = prompts[row // num_samples]
            completion = out[row][:n_generated[row] + (include_stop and done[row])]
            sequences.append(list(prompt) + completion)
            masks.append([0] * len(prompt) + [1] * len(completion))
        return sequences, masks
