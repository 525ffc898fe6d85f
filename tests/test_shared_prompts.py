"""
The loss's forward pass runs each distinct prompt once for all the samples that share it
(logprobs.make_shared_batch + logprobs.SharedPrefix): same per-token NLL and same gradients as running
every sequence whole, for each model family's switches, with activation checkpointing, with prompts
of different lengths, and with a prompt of one token (an empty prefix); and the prompt's tokens go
through the model once per micro-batch, not once per sample.
"""

import pytest
import torch

import chat_rl
from fast import logprobs
from policy.gpt import GPT, GPTConfig

FAMILIES = {
    "llama (GQA, tied head)": dict(),
    "qwen2 (qkv bias, untied head)": dict(attention_bias=True, tie_word_embeddings=False),
    "qwen3 (q/k norm, head_dim set)": dict(qk_norm=True, head_dim=16),
}


def model_for(family, seed=0):
    config = GPTConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, **FAMILIES[family])
    model = GPT(config).init_weights(seed)
    with torch.no_grad():  # the init leaves biases and norm weights at 0 and 1: make every switch matter
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model


def rollouts(num_prompts=3, num_samples=4, seed=0):
    """Prompt-major sequences and masks: prompts of 1 to 9 tokens (1: an empty prefix), completions of 1 to 7;
    one completion has a token the policy did not sample (a forced token, mask 0) in its middle."""
    g = torch.Generator().manual_seed(seed)
    sequences, masks = [], []
    for p in range(num_prompts):
        prompt = torch.randint(0, 64, (1 if p == 0 else int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
        for _ in range(num_samples):
            completion = torch.randint(0, 64, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
            sequences.append(prompt + completion)
            masks.append([0] * len(prompt) + [1] * len(completion))
    masks[-1] = masks[-1][:-2] + [0, 1] if sum(masks[-1]) >= 3 else masks[-1]
    return sequences, masks


def plain_nll(model, sequences, masks):
    """Every sequence whole, one row each: per row, the NLL of each sampled token in order."""
    inputs, targets = logprobs.make_batch(sequences, masks, "cpu")
    nll = model(inputs, targets, loss_reduction="none")
    return [nll[i][targets[i] >= 0] for i in range(len(sequences))]


def shared_nll(model, sequences, masks):
    prefix, inputs, targets = logprobs.make_shared_batch(sequences, masks, "cpu")
    nll = model(inputs, targets, loss_reduction="none", prefix=prefix)
    return [nll[i][targets[i] >= 0] for i in range(len(sequences))]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "activation checkpointing"])
@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prompts_give_the_nll_and_gradients_of_whole_sequences(family, checkpointing):
    sequences, masks = rollouts()
    weights = torch.randn(len(sequences), generator=torch.Generator().manual_seed(1))  # stand-in advantages
    results = []
    for nll_of in (plain_nll, shared_nll):
        model = model_for(family)
        model.checkpoint_layers = checkpointing
        nll = nll_of(model, sequences, masks)
        sum(w * row.sum() for w, row in zip(weights, nll)).backward()
        results.append((nll, {n: p.grad for n, p in model.named_parameters()}))
    (plain, plain_grads), (shared, shared_grads) = results
    assert [len(row) for row in shared] == [sum(m[1:]) for m in masks]  # every sampled target, none more
    for a, b in zip(plain, shared):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for name in plain_grads:
        torch.testing.assert_close(shared_grads[name], plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert all(g.abs().sum() > 0 for g in shared_grads.values())  # every parameter got a gradient


def test_shared_batch_layout_by_hand():
    # rows 0 and 1 share prompt [5, 6, 7]; row 2 has prompt [5] (an empty prefix); row 3 has no sampled token
    sequences = [[5, 6, 7, 8, 9], [5, 6, 7, 4], [5, 3], [1, 2]]
    masks = [[0, 0, 0, 1, 1], [0, 0, 0, 1], [0, 1], [0, 0]]
    (ids, lengths, row_prefix), inputs, targets = logprobs.make_shared_batch(sequences, masks, "cpu")
    assert ids.tolist() == [[5, 6], [0, 0]] and lengths.tolist() == [2, 0]  # prefixes: [5, 6] and [] (twice)
    assert row_prefix.tolist() == [0, 0, 1, 1]
    # each row starts at its prompt's last token, which predicts the first sampled one
    assert inputs.tolist() == [[7, 8], [7, 0], [5, 0], [1, 0]]
    assert targets.tolist() == [[8, 9], [4, -1], [3, -1], [-1, -1]]


def test_the_loss_runs_each_prompt_once_per_micro_batch():
    # 2 prompts x 4 samples, all rows kept, one micro-batch: the model embeds one flat sequence without padding,
    # each prompt less its last token once, then each row's own tokens (that last token + its completion less
    # its last token); the gradient equals the one of whole sequences
    sequences, masks = rollouts(num_prompts=2, num_samples=4, seed=3)
    advantages = torch.tensor([0.5, -0.5, 0.25, -0.25] * 2)
    model = model_for("llama (GQA, tied head)")
    embedded = []
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: embedded.append(tuple(args[0].shape)))
    chat_rl.policy_gradient_backward(model, sequences, masks, advantages, 4, 8, "kept_tokens", "cpu")
    prompt_lengths = [m.index(1) for m in masks]
    prefix_tokens = sum(n - 1 for n in prompt_lengths[::4])
    own_tokens = sum(len(s) - n for s, n in zip(sequences, prompt_lengths))
    assert embedded == [(1, prefix_tokens + own_tokens)]
    assert own_tokens + prefix_tokens < sum(len(s) - 1 for s in sequences)

    reference = model_for("llama (GQA, tied head)")
    nll = plain_nll(reference, sequences, masks)
    (-sum(a * -row.sum() for a, row in zip(advantages, nll)) / sum(sum(m[1:]) for m in masks)).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def random_rollouts(rng, num_groups, num_samples):
    """Prompt-major rollouts with the edge cases the loss can meet: a prompt of one token, the same prompt in
    two groups, empty or one-token completions, unsampled tokens inside a completion, a row with no sampled
    token at all (FSDP's idle pass is [0, 0]), a row sampled from position 0."""
    sequences, masks, prompts = [], [], []
    for _ in range(num_groups):
        prompt = list(rng.choice(prompts)) if prompts and rng.random() < 0.3 else [rng.randrange(64) for _ in range(rng.choice([1, 2, 5, 9]))]
        prompts.append(prompt)
        for _ in range(num_samples):
            completion = [rng.randrange(64) for _ in range(rng.choice([0, 1, 3, 7]))]
            seq, mask = prompt + completion, [0] * len(prompt) + [int(rng.random() < 0.8) for _ in completion]
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
def test_the_loss_and_gradients_match_whole_sequences_on_random_edge_cases(trial, monkeypatch):
    # the whole of policy_gradient_backward, shared prompts against every sequence whole (make_batch, no prefix),
    # with micro-batches that split groups, a token budget, both normalisations and activation checkpointing
    rng = __import__("random").Random(trial)
    sequences, masks = random_rollouts(rng, num_groups=4, num_samples=3)
    advantages = torch.tensor([rng.choice([-0.5, 0.0, 0.25, 1.0]) for _ in sequences])
    family = list(FAMILIES)[trial % len(FAMILIES)]
    args = dict(num_samples=3, device_batch_size=rng.choice([1, 2, 5, 100]), loss_norm=rng.choice(["kept_tokens", "all_tokens", "sequence"]),
                device="cpu", device_batch_tokens=rng.choice([12, float("inf")]))
    results = []
    for layout in ("whole", "shared"):
        model = model_for(family, seed=trial)
        model.checkpoint_layers = trial % 2 == 1
        if layout == "whole":
            monkeypatch.setattr(chat_rl, "make_shared_batch", lambda s, m, d: (None, *logprobs.make_batch(s, m, d)))
        loss, tokens = chat_rl.policy_gradient_backward(model, sequences, masks, advantages, **args)
        monkeypatch.undo()
        results.append((loss, tokens, {n: p.grad for n, p in model.named_parameters()}))
    (loss, tokens, grads), (shared_loss, shared_tokens, shared_grads) = results
    assert shared_tokens == tokens
    torch.testing.assert_close(shared_loss, loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        if grad is None:
            assert shared_grads[name] is None, name
        else:
            torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
