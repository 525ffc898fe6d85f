"""The KV-cached engine: same answers as a plain forward pass, batched or not, seeded,
independent rows."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import engine as engine_module
from calculator import calculate
from engine import Engine, compaction_moves
from fast.tool_calls import ToolCalls
from plumbing.checkpoint import load_policy
from policy.gpt import GPT, GPTConfig
from policy.tokenizer import ByteTokenizer
from tasks import arith
from tasks.common import conversation

STOP = 260  # <|assistant_end|> of the byte tokenizer


class NoStopTokenizer(ByteTokenizer):
    def __init__(self):
        super().__init__()
        self.stop_tokens = set()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=264,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return GPT(config).init_weights(3).eval()


@pytest.fixture(scope="module")
def wide_model(model):
    """The same shape with wide random weights: its greedy continuations depend on the whole
    prompt. (The small-init model above repeats its last token whatever came before it, so its
    greedy output cannot tell an engine that attends to the prompt from one that does not.)"""
    wide = GPT(model.config).init_weights(3).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in wide.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.15)
    tok = ByteTokenizer()
    same_last_token = [
        reference_greedy(wide, p, 4, tok.stop_tokens, tok.vocab_size)[len(p) :]
        for p in ([256, 50, 33], [256, 72, 33])
    ]
    assert same_last_token[0] != same_last_token[1]
    return wide


PROMPTS = [[256, 72, 105, 33], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [256, 50]]


def reference_greedy(model, prompt, max_new_tokens, stop_tokens, vocab):
    """Greedy decoding by re-running the whole sequence every token: no cache, no padding."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids]))[0, -1]
        logits[vocab:] = float("-inf")
        token = int(logits.argmax())
        if token in stop_tokens:
            break
        ids.append(token)
    return ids


def test_greedy_output_equals_no_cache_reference(wide_model):
    tok = ByteTokenizer()
    seqs, masks = Engine(wide_model, tok).generate_batch(
        PROMPTS, num_samples=1, max_new_tokens=24, temperature=0.0
    )
    for prompt, seq, mask in zip(PROMPTS, seqs, masks):
        assert seq == reference_greedy(wide_model, prompt, 24, tok.stop_tokens, tok.vocab_size)
        assert mask == [0] * len(prompt) + [1] * (len(seq) - len(prompt))


def test_batching_prompts_gives_the_same_greedy_output_as_one_at_a_time(wide_model):
    engine = Engine(wide_model, ByteTokenizer())
    batched, _ = engine.generate_batch(PROMPTS, num_samples=2, max_new_tokens=20, temperature=0.0)
    for i, prompt in enumerate(PROMPTS):
        alone, _ = engine.generate_batch(
            [prompt], num_samples=1, max_new_tokens=20, temperature=0.0
        )
        assert batched[2 * i] == alone[0] and batched[2 * i + 1] == alone[0]


def test_samples_of_one_prompt_differ(model):
    seqs, _ = Engine(model, ByteTokenizer()).generate_batch(
        [PROMPTS[0]], num_samples=8, max_new_tokens=16, temperature=1.0, seed=1
    )
    assert len({tuple(s) for s in seqs}) == 8


def test_same_seed_same_samples_other_seed_other_samples(model):
    engine = Engine(model, ByteTokenizer())
    a, _ = engine.generate_batch(PROMPTS, num_samples=3, max_new_tokens=12, temperature=1.0, seed=5)
    b, _ = engine.generate_batch(PROMPTS, num_samples=3, max_new_tokens=12, temperature=1.0, seed=5)
    c, _ = engine.generate_batch(PROMPTS, num_samples=3, max_new_tokens=12, temperature=1.0, seed=6)
    assert a == b and a != c


def test_results_are_prompt_major_with_mask_1_on_the_sampled_tokens(wide_model):
    # rows 3i .. 3i+2 are prompt i's samples: the prompt (mask 0), then the tokens sampled (mask 1)
    tok = ByteTokenizer()
    seqs, masks = Engine(wide_model, tok).generate_batch(
        PROMPTS, num_samples=3, max_new_tokens=4, temperature=1.0, seed=3
    )
    assert len(seqs) == len(masks) == 3 * len(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        for seq, mask in zip(seqs[3 * i : 3 * i + 3], masks[3 * i : 3 * i + 3]):
            assert seq[: len(prompt)] == prompt and len(seq) - len(prompt) <= 4
            assert mask == [0] * len(prompt) + [1] * (len(seq) - len(prompt))
    # and the tokens after prompt i were sampled from prompt i's distribution: at top-k 1 every
    # row of a group is its prompt's greedy continuation (the prompts' continuations all differ)
    top1, _ = Engine(wide_model, tok).generate_batch(
        PROMPTS, num_samples=3, max_new_tokens=6, temperature=1.0, top_k=1, seed=3
    )
    greedy = [
        reference_greedy(wide_model, prompt, 6, tok.stop_tokens, tok.vocab_size)
        for prompt in PROMPTS
    ]
    assert len({tuple(g[len(p) :]) for g, p in zip(greedy, PROMPTS)}) == len(PROMPTS)
    assert top1 == [g for g in greedy for _ in range(3)]


def test_without_stop_tokens_every_row_gets_exactly_max_new_tokens(model):
    seqs, masks = Engine(model, NoStopTokenizer()).generate_batch(
        PROMPTS, num_samples=2, max_new_tokens=9, temperature=1.0
    )
    assert [sum(m) for m in masks] == [9] * 6


def test_finished_rows_do_not_change_the_other_rows(model):
    # Make a frequent token the stop token: rows that sample it finish early. Every row must equal
    # the same row sampled with no stop token at all, cut at its first stop token.
    free, _ = Engine(model, NoStopTokenizer()).generate_batch(
        PROMPTS, num_samples=4, max_new_tokens=30, temperature=1.5, seed=2
    )
    stopper = frequent_stop_tokenizer(model)
    stopped, _ = Engine(model, stopper).generate_batch(
        PROMPTS, num_samples=4, max_new_tokens=30, temperature=1.5, seed=2
    )
    finished_early = 0
    prompt_lens = [len(p) for p in PROMPTS for _ in range(4)]
    for f, s, n in zip(free, stopped, prompt_lens):
        assert f[: len(s)] == s
        assert not set(s[n:]) & stopper.stop_tokens
        if len(s) < len(f):
            finished_early += 1
            assert f[len(s)] in stopper.stop_tokens  # it stopped exactly at its first stop token
    assert finished_early >= 2


def test_generate_batch_returns_generates_sequences_and_masks(model):
    engine = Engine(model, ByteTokenizer())
    samples = engine.generate(PROMPTS, 2, 8, 1.0, None, 3)
    assert engine.generate_batch(PROMPTS, 2, 8, 1.0, None, 3) == (samples.sequences, samples.masks)
    assert samples.tool_calls == samples.tool_errors == [0] * 6  # no tool: no calls


def test_top_k_one_is_greedy(model):
    engine = Engine(model, ByteTokenizer())
    greedy, _ = engine.generate_batch(PROMPTS, num_samples=1, max_new_tokens=10, temperature=0.0)
    top1, _ = engine.generate_batch(
        PROMPTS, num_samples=1, max_new_tokens=10, temperature=1.0, top_k=1, seed=9
    )
    assert greedy == top1


def frequent_stop_tokenizer(model):
    """A tokenizer whose stop token is the one the model samples most at temperature 1.5:
    rows stop early, at different positions."""
    free, _ = Engine(model, NoStopTokenizer()).generate_batch(
        PROMPTS, num_samples=4, max_new_tokens=30, temperature=1.5, seed=2
    )
    generated = [
        t for s, p in zip(free, [p for p in PROMPTS for _ in range(4)]) for t in s[len(p) :]
    ]
    stopper = NoStopTokenizer()
    stopper.stop_tokens = {max(set(generated), key=generated.count)}
    return stopper


def test_compacting_the_batch_at_every_position_changes_no_row(model):
    # compact_at=0: finished rows leave the batch (and its KV cache) at the first position they can;
    # None: they stay to the end. Every row must come out the same, stop token included.
    stopper = frequent_stop_tokenizer(model)
    kw = dict(num_samples=4, max_new_tokens=30, temperature=1.5, seed=2, include_stop=True)
    eager, eager_masks = Engine(model, stopper, compact_at=0.0).generate_batch(PROMPTS, **kw)
    never, never_masks = Engine(model, stopper, compact_at=None).generate_batch(PROMPTS, **kw)
    assert eager == never and eager_masks == never_masks
    stopped_at = {
        sum(m) for m in eager_masks if sum(m) < 30
    }  # include_stop: a stopped row is shorter than 30 + 1
    assert len(stopped_at) >= 3, (
        stopped_at
    )  # rows did stop, at different positions: there was compacting to do


def test_compaction_moves_only_finished_front_rows_and_keeps_every_live_row():
    # live rows fill the first n_live slots; a live row already there stays; only holes are written
    gen = torch.Generator().manual_seed(0)
    for n in [1, 2, 5, 16, 33]:
        for _ in range(20):
            live = torch.rand(n, generator=gen) < torch.rand(1, generator=gen)
            n_live = int(live.sum())
            if n_live in (0, n):
                continue
            holes, fillers, order = compaction_moves(live, n_live)
            assert (
                sorted(order.tolist()) == live.nonzero()[:, 0].tolist()
            )  # every live row once, no finished one
            for i in range(n_live):
                assert order[i] == i or not live[i]  # a live front row is not moved
            buffer = torch.arange(n).float()
            buffer[holes] = buffer[fillers]  # what KVCache.keep_rows does to the keys and values
            assert buffer[:n_live].tolist() == order.float().tolist()
            moved = holes != fillers
            assert int(moved.sum()) == int(
                (~live[:n_live]).sum()
            )  # copies: the finished front rows, no more


def test_top_k_sampling_stays_within_the_top_k(model):
    # every sampled token is among the k likeliest at its position
    # (the logits recomputed without the cache)
    seqs, masks = Engine(model, NoStopTokenizer()).generate_batch(
        PROMPTS, num_samples=2, max_new_tokens=6, temperature=2.0, top_k=3, seed=4
    )
    for seq, mask in zip(seqs, masks):
        for t in range(mask.index(1), len(seq)):
            logits = model(torch.tensor([seq[:t]]))[0, -1, : NoStopTokenizer().vocab_size]
            assert logits[seq[t]] >= torch.topk(logits, 3).values[-1]


def test_under_autocast_each_weight_is_cast_once_per_call_not_once_per_token(model):
    # generate_batch runs under no_grad, not inference_mode: only then does autocast keep the
    # bf16 copy of each fp32 weight for the rest of the call (on a GPU, one cast kernel per
    # weight per decode pass otherwise)
    weight_shapes = {
        tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)
    }
    n_weights = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        torch.profiler.profile(record_shapes=True) as prof,
    ):
        Engine(model, NoStopTokenizer()).generate_batch(
            PROMPTS, num_samples=2, max_new_tokens=8, seed=1
        )
    weight_casts = [
        e
        for e in prof.events()
        if e.name == "aten::_to_copy"
        and e.input_shapes
        and tuple(e.input_shapes[0]) in weight_shapes
    ]
    assert len(weight_casts) == n_weights  # the prefill's, then none in 7 decode passes


def test_autocasts_copies_do_not_outlive_the_block_an_update_comes_after():
    # the casts kept for a call (no_grad) leave with their autocast block, as chat_rl's loop
    # relies on: the rollout after an optimizer step (outside the block) decodes with the new
    # weights. Untied head: only the cast lm_head changes (inside one block the stale copy would
    # keep the old tokens)
    config = GPTConfig(
        vocab_size=264,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = GPT(config).init_weights(3).eval()
    engine = Engine(model, NoStopTokenizer())
    autocast = torch.autocast(
        "cpu", dtype=torch.bfloat16
    )  # one object, entered once per phase, as chat_rl does
    kw = dict(num_samples=1, max_new_tokens=4, temperature=0.0)
    with autocast:
        before, _ = engine.generate_batch(PROMPTS, **kw)
    original = model.lm_head.weight.detach().clone()
    try:
        with torch.no_grad():
            # the "update": every logit 0, so greedy picks token 0 every time
            model.lm_head.weight.zero_()
        with autocast:
            after, _ = engine.generate_batch(PROMPTS, **kw)
    finally:
        with torch.no_grad():
            model.lm_head.weight.copy_(original)
    assert all(s[-4:] != [0] * 4 for s in before) and all(s[-4:] == [0] * 4 for s in after)


class HostReads(TorchDispatchMode):
    """Counts what makes the host wait for the device on CUDA, whatever calls it: item(), int(),
    bool() and the like (_local_scalar_dense), nonzero, boolean masks and unique (sized by the
    host), repeat_interleave (sized by it unless told), and tolist(). Not seen on a CPU: a copy
    to the host (.cpu(), which is no copy there). reads[i]: those before decode pass i + 1
    (engine.next_logits), the last entry those after the last pass."""

    SYNCS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::equal"}
    SYNCS |= {"aten::_unique2", "aten::unique_consecutive", "aten::repeat_interleave"}

    def __init__(self, monkeypatch):
        super().__init__()
        self.reads = [0]
        tolist, next_logits = torch.Tensor.tolist, engine_module.next_logits
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: self.read() or tolist(t))
        monkeypatch.setattr(
            engine_module, "next_logits", lambda *a: self.reads.append(0) or next_logits(*a)
        )

    def read(self):
        self.reads[-1] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.SYNCS:
            self.read()
        return func(*args, **(kwargs or {}))


def test_the_decode_loop_waits_for_the_host_once_every_check_every_positions_without_the_tool(
    model, monkeypatch
):
    # each host read makes the CPU wait for the GPU: without the calculator, once every
    # Engine.check_every positions (CUDA's default, engine.CHECK_EVERY), the finished rows decoding
    # on till then; a CPU's default is every position, where a read costs nothing
    kw = dict(num_samples=3, max_new_tokens=40, temperature=1.0, seed=4)
    every = Engine(model, ByteTokenizer()).generate(PROMPTS, **kw)
    assert Engine(model, ByteTokenizer()).check_every == 1
    with torch.no_grad(), HostReads(monkeypatch) as host:
        sparse = Engine(model, ByteTokenizer(), check_every=engine_module.CHECK_EVERY).generate(
            PROMPTS, **kw
        )
    loop, k = host.reads[:-1], engine_module.CHECK_EVERY  # loop[t]: position t's reads
    assert len(loop) > 2 * k  # positions ran past two checks
    assert loop == [int((t + 1) % k == 0) for t in range(len(loop))]  # one read each k positions
    assert sparse == every  # the rows that finished between two reads are cut where they stopped


def test_with_the_calculator_the_decode_loop_reads_once_a_position_and_once_more_for_its_calls(
    monkeypatch,
):
    # the default --tool: a row that writes '<<expr=' needs its result as its next token, so the
    # host learns at every position which rows called (one read, with the finished count), and
    # reads the calling rows' text once more where any did (fast/tool_calls.ToolCalls.answer)
    policy, tokenizer = load_policy("demo_model", "cpu")
    rows = arith.load("test", 8)
    prompts = [tokenizer.render_for_completion(conversation(arith, r)) for r in rows]
    engine = Engine(policy.eval(), tokenizer, tool=calculate, check_every=engine_module.CHECK_EVERY)
    answered, answer = [], ToolCalls.answer
    monkeypatch.setattr(
        ToolCalls, "answer", lambda self, t, *a: answered.append(t) or answer(self, t, *a)
    )
    with torch.no_grad(), HostReads(monkeypatch) as host:
        samples = engine.generate(prompts, 4, 64, 1.0, seed=1)
    assert sum(samples.tool_calls) > 0 and answered  # rows called the calculator
    loop = host.reads[:-1]  # loop[t]: position t's reads
    assert loop == [1 + (t in answered) for t in range(len(loop))]
