"""
fast_logprobs (fast/logprobs.py, the loss's default) held to plain_logprobs, the version
to read: the same log-probs, and through policy_gradient_backward as train() calls it the same
loss and gradients, in fp32, within 1e-6 of each tensor's largest entry. On rollouts with what
the loss meets: several prompts of different lengths (one of a single token, one shared by two
groups), groups whose rewards are unanimous (dropped), tokens forced by the calculator (mask 0
inside a completion), several micro-batches, each normaliser, each model family, activation
checkpointing; and on 2 ranks, replicated and under --fsdp, the ranks running different numbers
of passes. Also: the shared layout by hand, each prompt run once per micro-batch, and a loss
other than the one the fast path was told of, which gets its own gradient.
"""

import os
import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import chat_rl
import fast.logprobs as fast_lp
from fast.logprobs import fast_logprobs, make_shared_batch, plain_logprobs
from plumbing import fsdp
from policy.gpt import GPT, GPTConfig
from test_objective import NORMS  # every --loss-norm by name

TOLERANCE = 1e-6  # of each tensor's largest entry: fp32 summation order, nothing more
T = 0.7  # a rollout temperature, so that dividing the logits by it is checked too
NUM_SAMPLES = 4
FAMILIES = {
    "llama (GQA, tied head)": dict(),
    "qwen2 (qkv bias, untied head)": dict(attention_bias=True, tie_word_embeddings=False),
    "qwen3 (q/k norm, head_dim set)": dict(qk_norm=True, head_dim=16),
}


def model_for(family, seed=0):
    config = GPTConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **FAMILIES[family],
    )
    model = GPT(config).init_weights(seed)
    with (
        torch.no_grad()
    ):  # the init leaves biases and norm weights at 0 and 1: make every switch matter
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(
                    0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)))
                )
        model.lm_head.weight.mul_(
            5
        )  # logits of order 1, not the init's near-uniform ones: T then matters
    return model


def rollouts(seed, num_groups=5):
    """Prompt-major (sequences, masks, advantages): prompts of 1, 3 or 8 tokens (group 2 repeats
    group 0's), completions of 1, 4 or 9 tokens, the third token of a longer one forced by the
    calculator (mask 0); group 1 unanimously right and group 3 unanimously wrong, both dropped
    by the loss."""
    rng = random.Random(seed)
    sequences, masks, rewards, prompts = [], [], [], []
    for g in range(num_groups):
        prompt = prompts[0] if g == 2 else [rng.randrange(64) for _ in range(rng.choice([1, 3, 8]))]
        prompts.append(prompt)
        for s in range(NUM_SAMPLES):
            completion = [rng.randrange(64) for _ in range(rng.choice([1, 4, 9]))]
            sampled = [int(j != 2) for j in range(len(completion))]
            sequences.append(prompt + completion)
            masks.append([0] * len(prompt) + sampled)
            rewards.append(
                1.0
                if g == 1
                else 0.0
                if g == 3
                else float(s % 2 == 0)
                if g == 0
                else float(rng.random() < 0.5)
            )
    return sequences, masks, chat_rl.compute_advantages(torch.tensor(rewards), NUM_SAMPLES)


def relative_error(a, b):
    return float((a - b).abs().max() / b.abs().max())


def assert_close(ours, reference):
    assert relative_error(ours, reference) <= TOLERANCE, relative_error(ours, reference)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "activation checkpointing"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_fast_log_probs_and_their_gradients_are_the_plain_ones(family, checkpointing):
    # any loss, by autograd (loss_grad None: the head projected again in the backward pass), and
    # the loss it was told of (loss_grad given: the head's gradients made in the forward pass)
    sequences, masks, _ = rollouts(seed=0)
    inputs, targets = chat_rl.make_batch(sequences, masks, "cpu")
    weights = torch.randn(targets.shape, generator=torch.Generator().manual_seed(1)) * (
        targets >= 0
    )
    results = {}
    for name, logprobs, loss_grad in (
        ("plain", plain_logprobs, None),
        ("fast", fast_logprobs, None),
        ("fast, told the loss", fast_logprobs, weights),
    ):
        model = model_for(family)
        model.checkpoint_layers = checkpointing
        logp = logprobs(model, inputs, targets, T, loss_grad=loss_grad)
        (weights * logp).sum().backward()
        results[name] = logp.detach(), grads(model)
    plain, plain_grads = results.pop("plain")
    assert torch.all(plain[targets < 0] == 0) and torch.all(plain[targets >= 0] < 0)
    for logp, fast_grads in results.values():
        assert torch.all(logp[targets < 0] == 0)
        assert_close(logp, plain)
        for name, grad in plain_grads.items():
            assert grad.abs().max() > 0, name  # every parameter takes part
            assert_close(fast_grads[name], grad)


@pytest.mark.parametrize("loss_norm", NORMS)
@pytest.mark.parametrize("family", FAMILIES)
def test_through_the_loss_the_fast_path_gives_the_plain_loss_and_gradients(family, loss_norm):
    sequences, masks, advantages = rollouts(seed=1)
    results = {}
    for name, logprobs in (("plain", plain_logprobs), ("fast", fast_logprobs)):
        model, calls = model_for(family), []

        def counted(*args, **kwargs):
            calls.append(1)
            return logprobs(*args, **kwargs)

        loss, tokens = chat_rl.policy_gradient_backward(
            model,
            sequences,
            masks,
            advantages,
            num_samples=NUM_SAMPLES,
            device_batch_size=5,
            loss_norm=loss_norm,
            device="cpu",
            temperature=T,
            logprobs=counted,
        )
        results[name] = loss, tokens, len(calls), grads(model)
    (loss, tokens, passes, plain_grads), (fast_loss, fast_tokens, fast_passes, fast_grads) = (
        results["plain"],
        results["fast"],
    )
    assert passes == fast_passes == 3  # 12 kept rows, 5 a micro-batch
    # the loss sums terms of order 1 that cancel: its error is of their size, not of what is left
    assert fast_tokens == tokens and abs(float(fast_loss - loss)) <= TOLERANCE * (
        1 + abs(float(loss))
    )
    for name, grad in plain_grads.items():
        assert_close(fast_grads[name], grad)


def test_both_paths_take_the_softmax_over_the_tokenizers_vocabulary_as_the_sampler_does():
    # an embedding padded past the tokenizer's vocabulary (Qwen2.5's, the demo's): those rows
    # are never sampled (engine.py slices the logits to tokenizer.vocab_size), so the loss's
    # distribution leaves them out too
    sequences, masks, advantages = rollouts(seed=5)
    # every token within the tokenizer's 60
    sequences = [[token % 60 for token in seq] for seq in sequences]
    inputs, targets = chat_rl.make_batch(sequences, masks, "cpu")
    model = model_for("qwen2 (qkv bias, untied head)")
    with torch.no_grad():
        expected = torch.log_softmax(model(inputs)[..., :60].float() / T, dim=-1).gather(
            -1, targets.clamp(min=0)[..., None]
        )[..., 0]
        expected = torch.where(targets >= 0, expected, 0.0)
        everything = plain_logprobs(model, inputs, targets, T)
    results = {}
    for name, logprobs in (("plain", plain_logprobs), ("fast", fast_logprobs)):
        model = model_for("qwen2 (qkv bias, untied head)")
        with torch.no_grad():
            logp = logprobs(model, inputs, targets, T, vocab_size=60)
        assert_close(logp, expected)
        chat_rl.policy_gradient_backward(
            model,
            sequences,
            masks,
            advantages,
            num_samples=NUM_SAMPLES,
            device_batch_size=8,
            loss_norm="all_tokens",
            device="cpu",
            temperature=T,
            logprobs=logprobs,
            vocab_size=60,
        )
        results[name] = grads(model)
        assert torch.all(
            results[name]["lm_head.weight"][60:] == 0
        )  # the padding rows learn nothing
    assert (
        relative_error(everything, expected) > 1e-3
    )  # the padding rows do weigh in the softmax over all 64
    for name, grad in results["plain"].items():
        assert_close(results["fast"][name], grad)


def random_rollouts(rng, num_groups, num_samples):
    """Prompt-major rollouts with the loss's edge cases: a prompt of one token, the same prompt
    in two groups, empty or one-token completions, unsampled tokens inside a completion, a row
    with no sampled token at all, a row sampled from position 0."""
    sequences, masks, prompts = [], [], []
    for _ in range(num_groups):
        prompt = (
            list(rng.choice(prompts))
            if prompts and rng.random() < 0.3
            else [rng.randrange(64) for _ in range(rng.choice([1, 2, 5, 9]))]
        )
        prompts.append(prompt)
        for _ in range(num_samples):
            completion = [rng.randrange(64) for _ in range(rng.choice([0, 1, 3, 7]))]
            seq, mask = (
                prompt + completion,
                [0] * len(prompt) + [int(rng.random() < 0.8) for _ in completion],
            )
            kind = rng.random()
            if kind < 0.1:
                mask = [0] * len(seq)
            elif kind < 0.15:
                mask = [1] * len(seq)
            if len(seq) < 2:
                seq, mask = seq + [rng.randrange(64)], mask + [1]
            sequences.append(seq)
            masks.append(mask)
    return sequences, masks


@pytest.mark.parametrize("trial", range(6))
def test_on_random_edge_cases_the_fast_path_gives_the_plain_loss_and_gradients(trial):
    # micro-batches that split groups, a token budget, every normaliser, activation checkpointing
    rng = random.Random(trial)
    sequences, masks = random_rollouts(rng, num_groups=4, num_samples=3)
    advantages = torch.tensor([rng.choice([-0.5, 0.0, 0.25, 1.0]) for _ in sequences])
    family = list(FAMILIES)[trial % len(FAMILIES)]
    args = dict(
        num_samples=3,
        device_batch_size=rng.choice([1, 2, 5, 100]),
        loss_norm=rng.choice(NORMS),
        device="cpu",
        device_batch_tokens=rng.choice([12, float("inf")]),
        temperature=T,
    )
    results = []
    for logprobs in (plain_logprobs, fast_logprobs):
        model = model_for(family, seed=trial)
        model.checkpoint_layers = trial % 2 == 1
        loss, tokens = chat_rl.policy_gradient_backward(
            model, sequences, masks, advantages, logprobs=logprobs, **args
        )
        results.append((loss, tokens, {n: p.grad for n, p in model.named_parameters()}))
    (loss, tokens, plain_grads), (fast_loss, fast_tokens, fast_grads) = results
    assert fast_tokens == tokens
    assert abs(float(fast_loss - loss)) <= TOLERANCE * (1 + abs(float(loss)))
    for name, grad in plain_grads.items():
        if grad is None:  # no kept row at all
            assert fast_grads[name] is None, name
        else:
            assert_close(fast_grads[name], grad)


def test_the_shared_layout_by_hand():
    # rows 0 and 1 share prompt [5, 6, 7]; row 2 has prompt [5] (an empty prefix);
    # row 3 has no sampled token
    sequences = [[5, 6, 7, 8, 9], [5, 6, 7, 4], [5, 3], [1, 2]]
    masks = [[0, 0, 0, 1, 1], [0, 0, 0, 1], [0, 1], [0, 0]]
    ids, lengths, row_prefix, inputs, targets = make_shared_batch(
        *chat_rl.make_batch(sequences, masks, "cpu")
    )
    assert ids.tolist() == [[5, 6], [0, 0]] and lengths.tolist() == [
        2,
        0,
    ]  # prefixes: [5, 6] and [] (twice)
    assert row_prefix.tolist() == [0, 0, 1, 1]
    # each row starts at its prompt's last token, which predicts the first sampled one
    assert inputs.tolist() == [[7, 8], [7, 0], [5, 0], [1, 0]]
    assert targets.tolist() == [[8, 9], [4, -1], [3, -1], [-1, -1]]


def test_the_loss_runs_each_prompt_once_per_micro_batch():
    # 2 prompts x 4 samples, one micro-batch: the model embeds one flat sequence without padding,
    # each prompt less its last token once, then each row's own tokens (that last token + its
    # completion less its last token)
    sequences, masks, _ = rollouts(seed=3, num_groups=2)
    # no forced token: rows end at a target
    masks = [[0] * m.index(1) + [1] * (len(m) - m.index(1)) for m in masks]
    advantages = torch.tensor([0.5, -0.5, 0.25, -0.25] * 2)
    model = model_for("llama (GQA, tied head)")
    embedded = []
    model.model.embed_tokens.register_forward_hook(
        lambda m, args, out: embedded.append(tuple(args[0].shape))
    )
    chat_rl.policy_gradient_backward(
        model,
        sequences,
        masks,
        advantages,
        num_samples=NUM_SAMPLES,
        device_batch_size=8,
        loss_norm="kept_tokens",
        device="cpu",
    )
    prompt_lengths = [m.index(1) for m in masks]
    prefix_tokens = sum(n - 1 for n in prompt_lengths[::NUM_SAMPLES])
    own_tokens = sum(len(s) - n for s, n in zip(sequences, prompt_lengths))
    assert embedded == [(1, prefix_tokens + own_tokens)]
    assert own_tokens + prefix_tokens < sum(len(s) - 1 for s in sequences)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_under_bf16_the_head_takes_its_gradient_in_fewer_larger_chunks(monkeypatch, bf16):
    # each chunk adds a (V, C) product into the head's fp32 gradient under bf16 (a pass over the
    # whole head), where fp32 sums inside addmm_: bf16 takes LOW_PRECISION_CHUNKS x the logits a
    # chunk, fp32 keeps its chunks (and so its numbers)
    sequences, masks, advantages = rollouts(seed=3, num_groups=2)
    model = model_for("llama (GQA, tied head)")
    V = model.lm_head.weight.size(0)
    monkeypatch.setattr(fast_lp, "LOGITS_PER_CHUNK", V)  # fp32: a token a chunk
    chunks = []  # the tokens of each chunk's gradient share
    add = fast_lp.add_chunk_grads
    monkeypatch.setattr(
        fast_lp,
        "add_chunk_grads",
        lambda probs, *a, **k: (chunks.append(len(probs)), add(probs, *a, **k)),
    )
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        chat_rl.policy_gradient_backward(
            model, sequences, masks, advantages, num_samples=NUM_SAMPLES, device_batch_size=64,
            loss_norm="all_tokens", device="cpu",
        )  # fmt: skip
    tokens = sum(chunks)
    per_chunk = fast_lp.LOW_PRECISION_CHUNKS if bf16 else 1
    assert tokens > 2 * per_chunk  # several chunks' worth in the one pass
    last = [tokens % per_chunk] if tokens % per_chunk else []
    assert chunks == [per_chunk] * (tokens // per_chunk) + last


def test_under_bf16_a_pass_casts_the_head_once_and_multiplies_by_it_in_bf16(monkeypatch):
    # an fp32 head under autocast: its bf16 copy made once a pass (not once a chunk: autocast
    # does not cache a slice's cast), and every matmul that reads the head reads that copy, the
    # gradient matmuls too (fp32 ones would run without TF32 on a GPU, slower than the forward)
    sequences, masks, advantages = rollouts(seed=3, num_groups=2)
    # a head of a shape no other weight has (96 x 32)
    config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config.update(num_key_value_heads=2, vocab_size=96, tie_word_embeddings=False)
    model = GPT(GPTConfig(**config)).init_weights(0)
    head = tuple(model.lm_head.weight.shape)
    monkeypatch.setattr(fast_lp, "LOGITS_PER_CHUNK", head[0])  # 8 tokens a bf16 chunk: several
    casts, head_matmuls = [], []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func._schema.name
            if name in ("aten::_to_copy", "aten::copy_") and tuple(out.shape) == head:
                casts.append(out.dtype)
            if name in ("aten::mm", "aten::addmm_", "aten::addmm") and head[1] in out.shape:
                if any(tuple(a.shape) in (head, head[::-1]) for a in args if torch.is_tensor(a)):
                    head_matmuls.append({a.dtype for a in args if torch.is_tensor(a)})
            return out

    with torch.autocast("cpu", dtype=torch.bfloat16), Watch():
        chat_rl.policy_gradient_backward(
            model, sequences, masks, advantages, num_samples=NUM_SAMPLES, device_batch_size=64,
            loss_norm="all_tokens", device="cpu",
        )  # fmt: skip
    assert casts == [torch.bfloat16]  # one pass, one cast
    assert len(head_matmuls) > 2 and all(dtypes == {torch.bfloat16} for dtypes in head_matmuls)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_loss_other_than_the_one_guessed_gets_its_own_gradients_at_a_moved_policy(family):
    # the head's gradients are made in the forward pass for the guess loss_grad; a loss that sends
    # back another gradient (a ratio to the log-probs of the weights that sampled, which have moved
    # since) gets the head's gradients made again for what it sends: the plain path's
    sequences, masks, _ = rollouts(seed=4, num_groups=2)
    inputs, targets = chat_rl.make_batch(sequences, masks, "cpu")
    weights = torch.randn(targets.shape, generator=torch.Generator().manual_seed(2))
    weights = weights * (targets >= 0)
    with torch.no_grad():
        old = plain_logprobs(model_for(family), inputs, targets, T)
    results = {}
    for name, logprobs, loss_grad in (
        ("plain", plain_logprobs, None),
        ("guessed", fast_logprobs, weights),
        ("told the loss", fast_logprobs, weights),
    ):
        model = model_for(family, seed=1)  # moved: another init
        logp = logprobs(model, inputs, targets, T, loss_grad=loss_grad)
        ratio = torch.exp(logp - old)
        ((weights * logp).sum() if name == "told the loss" else (weights * ratio).sum()).backward()
        results[name] = grads(model)
    plain = results["plain"]
    for name, grad in plain.items():  # the ratio carries logp's rounding into the gradient: 1e-5
        assert relative_error(results["guessed"][name], grad) <= 10 * TOLERANCE, name
    # what the guess alone would have given: another gradient
    assert max(relative_error(results["told the loss"][n], grad) for n, grad in plain.items()) > 0.1


# ---- two ranks: replicated (gradients all-reduced) and --fsdp (sharded; the ranks' passes matched)
def _worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    sequences, masks, advantages = rollouts(
        seed=10 + rank, num_groups=4 if rank == 0 else 2
    )  # 3 and 1 kept groups
    out = {}
    for sharded in (False, True):
        for name, logprobs in (("plain", plain_logprobs), ("fast", fast_logprobs)):
            model = fsdp.prepare(
                model_for("qwen2 (qkv bias, untied head)"), torch.device("cpu"), sharded, False
            )
            chat_rl.policy_gradient_backward(
                model,
                sequences,
                masks,
                advantages,
                num_samples=NUM_SAMPLES,
                device_batch_size=4,
                loss_norm="all_tokens",
                device="cpu",
                temperature=T,
                logprobs=logprobs,
            )  # 3 passes on rank 0, 1 on rank 1
            chat_rl.sync_gradients(model)
            out[sharded, name] = {
                n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                for n, p in model.named_parameters()
            }
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fast_logprobs")
    mp.start_processes(
        _worker, args=(2, str(tmp / "init"), str(tmp)), nprocs=2, join=True, start_method="spawn"
    )
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "--fsdp"])
def test_on_two_ranks_the_fast_path_gives_the_plain_gradients_of_one_process(two_ranks, sharded):
    parts = [rollouts(seed=10 + r, num_groups=4 if r == 0 else 2) for r in range(2)]
    sequences, masks = parts[0][0] + parts[1][0], parts[0][1] + parts[1][1]
    reference = model_for("qwen2 (qkv bias, untied head)")
    chat_rl.policy_gradient_backward(
        reference,
        sequences,
        masks,
        torch.cat([parts[0][2], parts[1][2]]),
        num_samples=NUM_SAMPLES,
        device_batch_size=4,
        loss_norm="all_tokens",
        device="cpu",
        temperature=T,
        logprobs=plain_logprobs,
    )
    for rank in range(2):
        for name, grad in grads(reference).items():
            assert_close(
                two_ranks[rank][sharded, "fast"][name], two_ranks[rank][sharded, "plain"][name]
            )
            assert_close(two_ranks[rank][sharded, "fast"][name], grad)
