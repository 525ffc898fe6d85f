"""
Batched sampling for RL's rollouts, twice: a plain reference sampler to read first, then the
fast Engine that the tests hold to it, token for token.

How a token is drawn, in both. All of a call's random numbers are drawn up front (uniforms):
row b's token t uses u[b, t]. Each prompt's rows can have a seeded generator of their own, so a
problem samples alike whatever else shares its batch. The token is where u[b, t] falls in the
row's cumulative probabilities, walked in vocabulary order (inverse CDF: one softmax pass, not
a random number per vocabulary entry as the Gumbel-max trick needs). So a row's token depends
only on its own logits and its own number, and the same seed gives the same samples. (Logits
can still move in the last bit with the batch's size or the cache, as any batched matmul's do,
and the Engine sums the probabilities in blocks; where that crosses the boundary between two
tokens, the draw differs.)

generate_reference samples a batch the simplest correct way: one loop over token positions t,
the model rerun over every running row's whole sequence at each, each row's calculator a small
object in plain Python (Calculator).

The Engine samples the same rows with a KV cache, each prompt's shared by its samples, and
finished rows compacted out of the batch (its class says how); the tests hold it to
generate_reference.
"""

import re
from typing import NamedTuple

import torch

from fast.kv_cache import KVCache
from fast.packed_linear import DecodeThreads, packed_linears
from fast.sampling import sample_next_token
from fast.tool_calls import ToolCalls, call_tables
from policy import lora


class Samples(NamedTuple):
    """One entry per row, prompt-major: the samples of prompt 0, then those of prompt 1, ..."""

    sequences: list  # prompt + generated tokens; the stop token only with include_stop
    masks: list  # 1 on sampled tokens, 0 on the prompt's and on those the calculator forced
    tool_calls: list  # the row's calls, answered or refused
    tool_errors: list  # of them, the refused ones
    # per token, aligned with sequences: the sampler's log-prob of each token it drew, under the
    # distribution it drew from (softmax(logits / temperature), top-k's cut renormalised); 0 on the
    # prompt, on forced tokens and at temperature 0
    logprobs: list = None


def uniforms(seed, num_prompts, num_samples, max_new_tokens, device):
    """
    The call's random numbers, (B, max_new_tokens): row b's token t draws with u[b, t]. seed:
    one number for the whole call, or a list of one per prompt, whose num_samples rows then
    draw from that prompt's own stream, whatever else shares the batch (so that a problem
    samples alike on 1 rank or on 8). The same seed gives the same numbers on one device type
    (CPU and CUDA generators differ), and for one max_new_tokens (which sets the numbers each
    row takes from its stream).
    """
    if isinstance(seed, int):
        return torch.rand(
            num_prompts * num_samples,
            max_new_tokens,
            generator=torch.Generator(device).manual_seed(seed),
            device=device,
        )
    assert len(seed) == num_prompts, f"{len(seed)} seeds for {num_prompts} prompts"
    return torch.cat(
        [
            torch.rand(
                num_samples,
                max_new_tokens,
                generator=torch.Generator(device).manual_seed(s),
                device=device,
            )
            for s in seed
        ]
    )


# A calculator call fires when the token just written ends in '=' and the text then ends in
# '<<', an expression (one line, no '<', '>' or '=') and that '=': "so <<48/2=" calls 48/2, and
# "24>>" is then written in, one token per position. A longer run of '<' pairs up from its
# start: "<<<<3=" calls 3, "<<<3=" nothing (tests/test_reference_sampler.py).
CALL = re.compile(r"(?:^|[^<])(?:<<)+[^<>\n=]*=\Z")


@torch.no_grad()
def generate_reference(
    model,
    tokenizer,
    prompts,
    num_samples=1,
    max_new_tokens=256,
    temperature=1.0,
    top_k=None,
    seed=0,
    tool=None,
    include_stop=False,
):
    """
    The plain sampler, and the reference the tests hold the Engine to: for the same arguments
    (tool given to the Engine's constructor), the same Samples, token for token wherever
    batching's rounding moves no logit across a token's boundary (above). No cache: at
    each position t the model runs over every running row's whole sequence, right-padded (under
    causal attention, padding after a row's last real token changes nothing there), and row b
    draws its token t with u[b, t]. A row's Calculator (below; a first read skips it) may write
    a call's result in place of a draw: the model still runs there, u[b, t] goes unused, the
    token gets mask 0 and counts toward max_new_tokens. The Engine computes the same rows with a
    KV cache (each prompt's shared by its samples), compacts finished rows out of the batch, and
    spots calls on the device with an automaton equivalent to CALL. chat_rl.rollout asks for
    include_stop=True (a finished row keeps its stop token, sampled and trained like any other)
    and a seed per prompt (uniforms).
    """
    device = model.lm_head.weight.device
    B = len(prompts) * num_samples
    u = uniforms(seed, len(prompts), num_samples, max_new_tokens, device)
    prompt = [list(prompts[b // num_samples]) for b in range(B)]
    # each row's generated tokens, 1 where sampled, the sampler's log-probs; its calculator
    new, mask, logps = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)]
    calculator = [Calculator(tool, tokenizer) for _ in range(B)]
    running = list(range(B))
    for t in range(max_new_tokens):
        if not running:
            break
        rows = [prompt[b] + new[b] for b in running]
        width = max(len(row) for row in rows)
        ids = torch.tensor([row + [0] * (width - len(row)) for row in rows], device=device)
        last = torch.tensor([len(row) - 1 for row in rows], device=device)
        logits = model(ids)[torch.arange(len(rows), device=device), last, : tokenizer.vocab_size]
        drawn, logp = sample_reference(logits, u[running, t], temperature, top_k, logprobs=True)
        still_running = []
        for b, token, lp in zip(running, drawn.tolist(), logp.tolist()):
            forced = calculator[b].result_token()  # None, unless a call's result is being written
            if forced is not None:  # it goes in place of the draw, which is discarded
                token, lp = forced, 0.0
            new[b].append(token)
            mask[b].append(1 if forced is None else 0)
            logps[b].append(lp)
            if token in tokenizer.stop_tokens:
                continue
            still_running.append(b)
            calculator[b].wrote(new[b])
        running = still_running
    sequences, masks, logprobs = [], [], []
    for b in range(B):
        # the stop token kept only on request
        if new[b] and new[b][-1] in tokenizer.stop_tokens and not include_stop:
            new[b], mask[b], logps[b] = new[b][:-1], mask[b][:-1], logps[b][:-1]
        sequences.append(prompt[b] + new[b])
        masks.append([0] * len(prompt[b]) + mask[b])
        logprobs.append([0.0] * len(prompt[b]) + logps[b])
    calls, errors = [c.calls for c in calculator], [c.errors for c in calculator]
    return Samples(sequences, masks, calls, errors, logprobs)


class Calculator:
    """
    One row's calculator in generate_reference, plain Python: its completion's text and the
    result tokens it has still to write. A call just written ('<<48/2=') queues its result
    ('24>>'), which the row's next positions take, one token each, in place of their draws.
    Without a tool (tool=None) it never calls.
    """

    def __init__(self, tool, tokenizer):
        self.tool, self.tokenizer = tool, tokenizer
        self.text, self.pending = "", []
        self.calls = self.errors = 0  # calls made, and of them the refused ones

    def result_token(self):
        """The token this position writes for the calculator, or None (the draw stands)."""
        return self.pending.pop(0) if self.pending else None

    def wrote(self, completion):
        """After each token the row writes but its stop token (completion: its tokens so far, the
        last one new).
        Each token decoded alone, as the Engine's tables hold them (a result's tokens too)."""
        piece = self.tokenizer.decode(completion[-1:])
        self.text += piece
        if self.tool is not None and piece.endswith("=") and CALL.search(self.text):
            self.pending = tool_result(self.tool, self.tokenizer, completion)
            self.calls, self.errors = self.calls + 1, self.errors + (not self.pending)


def tool_result(tool, tokenizer, completion):
    """The tokens a call answers with, for a completion whose text ends in one ('<<48/2='):
    the tool's result and '>>' ('24>>'), or [] where the tool refuses the expression."""
    written = tokenizer.decode(completion)  # decoded together: a token alone can split a character
    result = tool(written[written.rfind("<<") + 2 : -1])  # after the last '<<', before the '='
    return [] if result is None else tokenizer.encode(result + ">>")


def sample_reference(logits, u, temperature, top_k, logprobs=False):
    """
    logits (B, V), u (B,) in [0, 1) -> token ids (B,): for each row the first token, in
    vocabulary order, whose cumulative probability exceeds u * total, under
    softmax(logits / temperature) restricted to the entries >= the k-th largest (ties with it
    kept). temperature 0 = argmax, u unused. logprobs: (tokens, their log-probs (B,) under that
    distribution; 0 at temperature 0).
    """
    if temperature == 0.0:
        token = logits.argmax(dim=-1)
        return (token, torch.zeros(token.shape, device=token.device)) if logprobs else token
    logits = logits.float() / temperature
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    cdf = torch.softmax(logits, dim=-1).cumsum(dim=-1)
    token = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)
    # if rounding puts u * total at or past the last sum, take the last token that added
    # probability (the first place the cumulative sum reaches its maximum): a token the row
    # could draw
    token = torch.minimum(token, cdf.argmax(dim=-1, keepdim=True))[:, 0]
    if not logprobs:
        return token
    return token, logits.log_softmax(dim=-1).gather(1, token[:, None])[:, 0]


# ---- the fast engine ---------------------------------------------------------------------------


def compaction_moves(keep, n_keep):
    """
    keep (n,) bool with n_keep True entries -> (holes, fillers, order): the moves that put the
    kept rows in the first n_keep batch slots. A leaving row in front (a hole) takes a kept row
    from the back (a filler); the other kept rows stay where they are, so a compaction copies
    at most min(leaving, kept) rows rather than all kept ones.
    order (n_keep,): the old slot of each new one. Computed without a host sync (nonzero would
    need one to size its result): the number of moves m stays on the device, so both lists hold
    c = min(n - n_keep, n_keep) entries, and entries past m move a kept front row onto itself.
    """
    n = keep.size(0)
    c = min(n - n_keep, n_keep)
    front_kept = keep[:n_keep]
    # the front's leaving rows first, and the back's kept rows first
    holes = torch.argsort(front_kept.to(torch.uint8), stable=True)[:c]
    fillers = n_keep + torch.argsort((~keep[n_keep:]).to(torch.uint8), stable=True)[:c]
    # as many kept rows at the back as leaving ones at the front: m of each
    fillers = torch.where(torch.arange(c, device=keep.device) < (~front_kept).sum(), fillers, holes)
    order = torch.arange(n_keep, device=keep.device).index_copy_(0, holes, fillers)
    return holes, fillers, order


def host_count(x):
    """The decode loop's host sync: a bool tensor's count of True, or a count tensor's entries, as
    Python ints (tests count the calls)."""
    return int(x.sum()) if x.dtype == torch.bool else x.tolist()


def next_logits(model, token, cache):
    """token (B,) -> next-token logits (B, V): one token per row through the model, its keys
    and values cached."""
    return model(token[:, None], kv_cache=cache)[:, -1]


CHECK_EVERY = 8  # positions between the decode loop's host syncs on CUDA (Engine.check_every)


class Engine:
    """
    Engine.generate samples the same rows as generate_reference, P prompts of different
    lengths x S completions each, as one batch of B = P * S rows, and wastes no work:
      1. prefill: the prompts are left-padded into one (P, T) batch and run through the model
         once. The KV cache knows each prompt's pad count, so padding is neither attended to
         nor counted in RoPE positions: a left-padded prompt computes what it computes alone,
         up to the last bit.
      2. share: each prompt's keys and values serve all its S samples, stored once.
      3. decode: one token per running row at each position t, each a forward pass over one
         position. A finished row keeps decoding (its tokens discarded) until enough rows have
         finished to be worth a compaction: running rows from the back of the batch then move
         into the finished rows' slots, and the batch ends where they end. So finished rows
         stop costing the model's matmuls and the attention to their own keys (the attention to
         a prompt's keys still runs over its S slots, zeros where a row has left: one matmul
         per prompt either way).
      (The Engine stores u transposed, so position t reads u[t] as one contiguous slice; a
      compaction moves each row's column with it.) The KV cache, and how the model talks to it,
      are in fast/kv_cache.py; the Engine's calculator calls in fast/tool_calls.py, its sampler in
      fast/sampling.py.

    model, tokenizer: the policy and its tokenizer (stop_tokens, vocab_size).
    compact_at: compact the batch (drop finished rows and their KV cache) once at least this
        share of its rows has finished; 0 = as soon as one has, None = never. A compaction
        copies running rows from the back into finished rows' slots, at most
        min(finished, running) rows and only their written own slots (compaction_moves), while
        shrinking the batch by a share saves that share of the model's work at every later
        position.
    tool: a function from an expression to its result text or None (calculator.calculate),
        called when a row writes GSM8K's `<<expression=`; its result and `>>` are forced into
        the row (fast/tool_calls.py). None: no tool, and a row that writes `<<` is sampled like
        any other.
    """

    def __init__(self, model, tokenizer, compact_at=0.125, tool=None, check_every=None):
        self.model = model
        self.tokenizer = tokenizer
        self.compact_at = compact_at
        self.tool = tool
        # how often, in positions, the host learns how many rows have finished (to stop, or to
        # compact): each time is a sync that waits for the GPU, so on CUDA every CHECK_EVERY, the
        # rows finished in between decoding on (their tokens discarded). With the calculator on,
        # every position (a call's result is the row's next token, so the host must see each call
        # before the next position), and once more where a row called (ToolCalls.answer); a row
        # waiting for its result while the others decode on would need a KV cache of per-row
        # positions, not built. On a CPU a sync costs nothing. tests/test_engine.py counts them.
        device = model.lm_head.weight.device.type
        self.check_every = check_every or (CHECK_EVERY if device == "cuda" else 1)
        # fast/tool_calls.call_tables of the tokenizer, built at the first call
        self.tool_tables = None

    @torch.no_grad()
    def prefill(self, prompts, num_samples, max_new_tokens):
        """
        Parts 1-2 of generate: prompts (P token-id lists) -> the logits of each row's first
        token (P * num_samples, V), prompt-major, and the KV cache, with room for
        max_new_tokens tokens of each row.
        """
        model, device = self.model, self.model.lm_head.weight.device
        prompt_lengths = [len(p) for p in prompts]
        assert min(prompt_lengths) > 0, "every prompt needs at least one token"
        T = max(prompt_lengths)
        left_padded = [[0] * (T - len(p)) + list(p) for p in prompts]
        ids = torch.tensor(left_padded, dtype=torch.long, device=device)  # one copy to the device
        pad = torch.tensor([T - n for n in prompt_lengths], dtype=torch.long, device=device)
        # (max_len, D/2, 2)
        rope = model.rope(torch.arange(T + max_new_tokens, device=device)[None])[0, 0]
        cache = KVCache(model.config.num_hidden_layers, pad, max_new_tokens, rope)
        logits = model(ids, kv_cache=cache)[:, -1]  # once per prompt
        cache.share(num_samples)  # its keys serve all its samples
        return logits.repeat_interleave(num_samples, dim=0), cache

    def generate_batch(
        self,
        prompts,
        num_samples=1,
        max_new_tokens=256,
        temperature=1.0,
        top_k=None,
        seed=0,
        include_stop=False,
    ):
        """generate's (sequences, masks) alone."""
        return self.generate(
            prompts, num_samples, max_new_tokens, temperature, top_k, seed, include_stop
        )[:2]

    # not inference_mode: under it autocast keeps no cast weights, and casts each one per token
    @torch.no_grad()
    def generate(
        self,
        prompts,
        num_samples=1,
        max_new_tokens=256,
        temperature=1.0,
        top_k=None,
        seed=0,
        include_stop=False,
    ):
        """
        prompts: list of P token-id lists -> Samples (sequences, masks, tool_calls, tool_errors,
        logprobs: each sampled token's under the distribution it was drawn from, 0 at the others),
        P * num_samples rows, prompt-major: generate_reference's for the same
        arguments. sequence = prompt + generated tokens (the stop token excluded, unless
        include_stop: RL wants it, since ending the answer is a choice the policy makes too);
        mask has 1 on sampled tokens and 0 on the prompt's and on those the tool forced (its
        results). Forced tokens count toward max_new_tokens: each takes a position and a slot
        of the row's KV cache, which max_new_tokens sizes, and the budget then bounds the
        sequence the loss runs as well.
        """
        # on the CPU the large matmuls take their weights packed once for the call, and under
        # bf16 a few running rows decode on one thread (fast/packed_linear.py); LoRA's adapters
        # are stacked once for the call too
        rows, device = len(prompts) * num_samples, self.model.lm_head.weight.device
        with (
            packed_linears(self.model, rows=rows),
            DecodeThreads(device) as threads,
            lora.frozen_adapters(self.model),
        ):
            return self._generate(
                prompts, num_samples, max_new_tokens, temperature, top_k, seed, include_stop,
                threads,
            )  # fmt: skip

    def _generate(
        self, prompts, num_samples, max_new_tokens, temperature, top_k, seed, include_stop, threads
    ):
        """generate's work: parts 1-3 of the class's docstring."""
        model, device = self.model, self.model.lm_head.weight.device
        stop = torch.tensor(sorted(self.tokenizer.stop_tokens), dtype=torch.long, device=device)
        # a model's embedding table may be padded past it: those rows are not tokens
        vocab = self.tokenizer.vocab_size
        logits, cache = self.prefill(prompts, num_samples, max_new_tokens)
        B = logits.size(0)
        u = uniforms(seed, len(prompts), num_samples, max_new_tokens, device).T.contiguous()
        # out[t, b]: original row b's token t; logp[t, b], the sampler's log-prob of it
        out = torch.zeros(max_new_tokens, B, dtype=torch.long, device=device)
        out_logp = torch.zeros(max_new_tokens, B, device=device)
        # original index of each row in the batch, in batch order
        row_ids = torch.arange(B, device=device)
        # positions[t]: t as a tensor, made once
        positions = torch.arange(max_new_tokens + 1, device=device)
        # each batch row's completion length: the position of its first stop token,
        # max_new_tokens while it runs
        length = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)
        # the same by original row, recorded as rows leave the batch
        completion_lengths = length.clone()
        tools = None
        if self.tool is not None:
            if self.tool_tables is None:
                self.tool_tables = call_tables(self.tokenizer, device)
            tools = ToolCalls(self.tool, self.tokenizer, self.tool_tables, B, device)
            # forced[t, b]: the tool wrote out[t, b]
            forced = torch.zeros(max_new_tokens, B, dtype=torch.bool, device=device)
        threads.rows(B)
        for t in range(max_new_tokens):
            n_rows = row_ids.size(0)
            token, logp = sample_next_token(logits[:, :vocab], u[t], temperature, top_k, True)
            # a row inside a tool's answer takes its next result token instead
            if tools is not None:
                token, forced_now, called = tools.feed(t, token, length == max_new_tokens)
                forced[t].index_copy_(0, row_ids, forced_now)
                logp = logp.masked_fill(forced_now, 0.0)
            out[t].index_copy_(0, row_ids, token)
            out_logp[t].index_copy_(0, row_ids, logp)
            length = torch.minimum(
                length,
                torch.where(torch.isin(token, stop), positions[t], positions[max_new_tokens]),
            )
            if tools is None:
                if (t + 1) % self.check_every and t < max_new_tokens - 1:  # no sync this time
                    logits = next_logits(model, token, cache)
                    continue
                n_finished = host_count(length < max_new_tokens)  # the one host sync
            else:
                counts = torch.stack([(length < max_new_tokens).sum(), called.sum()])
                n_finished, n_called = host_count(counts)  # still one
                if n_called:
                    tools.answer(t, called, n_called, row_ids, out)
            if n_finished == n_rows or t == max_new_tokens - 1:
                break
            n_keep = n_rows - n_finished  # a compaction keeps the running rows
            if (
                self.compact_at is not None
                and n_finished > 0
                and n_finished >= self.compact_at * n_rows
            ):
                # finished rows leave: record their lengths first
                completion_lengths.index_copy_(0, row_ids, length)
                keep = length == max_new_tokens  # the running rows
                holes, fillers, order = compaction_moves(keep, n_keep)
                row_ids, length, token, u = row_ids[order], length[order], token[order], u[:, order]
                # tokens 0..t-1 are in; token t is fed next
                cache.keep_rows(holes, fillers, row_ids, written=t)
                threads.rows(n_keep)
                if tools is not None:
                    tools.keep_rows(order)
            logits = next_logits(model, token, cache)
        completion_lengths.index_copy_(0, row_ids, length)

        out, completion_lengths = out.T.tolist(), completion_lengths.tolist()
        out_logp = out_logp.T.tolist()
        # 0 where the tool forced the token
        sampled = [[1] * max_new_tokens] * B if tools is None else (~forced).T.int().tolist()
        sequences, masks, logprobs = [], [], []
        for row, n in enumerate(completion_lengths):
            prompt = prompts[row // num_samples]
            # a row that ran out of tokens has no stop token
            n += int(include_stop and n < max_new_tokens)
            sequences.append(list(prompt) + out[row][:n])
            masks.append([0] * len(prompt) + sampled[row][:n])
            logprobs.append([0.0] * len(prompt) + out_logp[row][:n])
        calls, errors = (tools.calls, tools.errors) if tools is not None else ([0] * B, [0] * B)
        return Samples(sequences, masks, calls, errors, logprobs)
