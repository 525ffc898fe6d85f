"""
The objective chat_rl optimises, pinned on small batches: the loss's log-probs are those of the
distribution the rollout sampled from, softmax(logits / temperature), through the chunked log-prob
pass and the shared prompt layout; and each --loss-norm divides by what its name says, with
unanimous groups dropped before any forward pass (for all_tokens and sequence a pure saving: the
gradient is that of every row run).
"""

import inspect
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import chat_rl
from engine import generate_reference
from fast import logprobs
from plumbing import checkpoint, flags
from policy.gpt import GPT, GPTConfig
from policy.tokenizer import ByteTokenizer
from test_rl_math import LinearNLLModel, linear_logprobs  # log p of token t is -w * t

V, T = 48, 0.7
# every --loss-norm by name, written out rather than read from plumbing/flags.LOSS_NORMS (a loop
# over that list passes with a name left out of it): a normaliser of your own joins here, and the
# tests parametrized by NORMS (here, test_objective_options', test_fast_logprobs') run it
NORMS = ("kept_tokens", "all_tokens", "sequence")


def test_the_tests_name_every_normaliser_the_flag_accepts():
    assert sorted(NORMS) == sorted(flags.LOSS_NORMS)


def small_model(seed=0):
    model = GPT(
        GPTConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
    ).init_weights(seed)
    with (
        torch.no_grad()
    ):  # logits of order 1, not the init's near-uniform ones: the temperature then matters
        model.lm_head.weight.mul_(100)
    return model


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(a, b):
    assert a.keys() == b.keys()
    for name in a:  # equal up to fp32 summation order: within 1e-4 of the tensor's largest entry
        error, scale = (a[name] - b[name]).abs().max().item(), b[name].abs().max().item()
        assert error <= 1e-4 * scale, (name, error, scale)


def direct_logp(model, inputs, targets, temperature):
    """log_softmax(logits / temperature) of every target, straight from all the logits;
    0 where target is -1."""
    logp = torch.log_softmax(model(inputs) / temperature, dim=-1).gather(
        -1, targets.clamp(min=0)[..., None]
    )[..., 0]
    return logp.masked_fill(targets < 0, 0.0)


def test_the_chunked_nll_at_a_temperature_is_minus_log_softmax_of_logits_over_t():
    gen = torch.Generator().manual_seed(0)
    idx, targets = (
        torch.randint(0, V, (3, 10), generator=gen),
        torch.randint(0, V, (3, 10), generator=gen),
    )
    targets[0, :4], targets[2, 7:] = -1, -1  # a prompt, padding
    weight = torch.randn(3, 10, generator=gen)
    model, reference = small_model(), small_model()
    nll = model(
        idx, targets, loss_reduction="none", logits_per_chunk=4 * V, temperature=T
    )  # 23 targets: 6 chunks
    (nll * weight).sum().backward()
    expected = -direct_logp(reference, idx, targets, T)
    (expected * weight).sum().backward()
    torch.testing.assert_close(nll, expected, rtol=1e-5, atol=1e-5)
    assert (
        nll - model(idx, targets, loss_reduction="none")
    ).abs().max() > 0.1  # T = 0.7 is not T = 1 here
    assert_same_grads(grads(model), grads(reference))


# 4 groups of 3 samples, each group one prompt (shared in the loss); groups 1 and 3 are unanimous
NUM_SAMPLES = 3
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])


def rollouts(seed=0, num_groups=4):
    gen = torch.Generator().manual_seed(seed)
    sequences, masks = [], []
    for _ in range(num_groups):
        prompt = torch.randint(
            0, V, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(NUM_SAMPLES):
            completion = torch.randint(
                0, V, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen
            ).tolist()
            sequences.append(prompt + completion)
            # every third token after the first forced by a tool (mask 0): inside the completion,
            # never a target
            masks.append([0] * len(prompt) + [int(j % 3 != 1) for j in range(len(completion))])
    return sequences, masks


def sampled_rollouts(model, seed=0, num_groups=4, max_new_tokens=6):
    """rollouts' prompts, each with NUM_SAMPLES completions the model samples at T through the plain
    sampler, as a run draws them. rollouts' random tokens have p about 0 under small_model's peaked
    head, so a term that reads a token's probability (a weight such as 1 - p) is constant on them
    and a test there passes with it dropped: test such a term on these."""
    sequences, _ = rollouts(seed, num_groups)
    prompts = [sequences[g * NUM_SAMPLES] for g in range(num_groups)]
    tokenizer = SimpleNamespace(vocab_size=V, stop_tokens={0}, decode=lambda ids: "")
    samples = generate_reference(model, tokenizer, prompts, NUM_SAMPLES, max_new_tokens, T,
                                 seed=seed, include_stop=True)  # fmt: skip
    return samples.sequences, samples.masks


def test_sampled_rollouts_have_likely_tokens_where_the_random_ones_have_none():
    model = small_model()

    def probs(sequences, masks):  # p of each sampled token under softmax(logits / T)
        inputs, targets = logprobs.make_batch(sequences, masks, "cpu")
        with torch.no_grad():
            logp = logprobs.plain_logprobs(model, inputs, targets, T)
        return logp.exp()[targets >= 0]

    random, sampled = probs(*rollouts()), probs(*sampled_rollouts(model))
    assert random.max() < 0.5 < sampled.max() and sampled.min() < 0.5  # spread between 0 and 1


def kept_rows(advantages):
    """(rows,) True for the rows of groups that carry signal (not unanimous)."""
    return advantages.view(-1, NUM_SAMPLES).abs().sum(dim=1).repeat_interleave(NUM_SAMPLES) > 0


def reference_backward(model, sequences, masks, advantages, loss_norm, temperature):
    """The loss written out over every row, the unanimous groups' included, each sequence whole."""
    inputs, targets = chat_rl.make_batch(sequences, masks, "cpu")
    logp = direct_logp(model, inputs, targets, temperature)
    tokens = (targets >= 0).sum(dim=1)
    kept = kept_rows(advantages)
    if loss_norm == "sequence":
        loss = -(advantages * logp.sum(dim=1) / tokens).sum() / len(sequences)
    else:
        loss = (
            -(advantages * logp.sum(dim=1)).sum()
            / (tokens[kept] if loss_norm == "kept_tokens" else tokens).sum()
        )
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("loss_norm", NORMS)
def test_the_gradient_is_that_of_log_softmax_over_t_for_every_row_run(loss_norm, monkeypatch):
    # policy_gradient_backward as train() calls it at --temperature=0.7: shared prompts,
    # two micro-batches, the log-prob pass in chunks of 3 tokens; against every row whole,
    # straight from the logits
    sequences, masks = rollouts()
    advantages = chat_rl.compute_advantages(REWARDS, NUM_SAMPLES)
    model, reference = small_model(), small_model()
    monkeypatch.setattr(logprobs, "LOGITS_PER_CHUNK", 3 * V)  # the head in chunks of 3 tokens
    passes, fast = [], logprobs.fast_logprobs

    def counted(model, inputs, targets, temperature, **kw):
        passes.append(((targets >= 0).sum(), temperature))
        return fast(model, inputs, targets, temperature, **kw)

    loss, tokens = chat_rl.policy_gradient_backward(
        model,
        sequences,
        masks,
        advantages,
        num_samples=NUM_SAMPLES,
        device_batch_size=3,
        loss_norm=loss_norm,
        device="cpu",
        temperature=T,
        logprobs=counted,
    )
    expected = reference_backward(reference, sequences, masks, advantages, loss_norm, T)
    assert len(passes) == 2 and all(
        n > 3 and t == T for n, t in passes
    )  # two micro-batches, several chunks each
    assert tokens == sum(sum(m[1:]) for m, kept in zip(masks, kept_rows(advantages)) if kept)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert_same_grads(grads(model), grads(reference))


# group 0 rewards [1, 0]: advantages +-0.5, completions [1, 2, 3] and [4, 5];
# groups 1 and 2 unanimous
HAND_SEQS = [
    [9, 9, 1, 2, 3],
    [9, 9, 4, 5],
    [9, 7, 1],
    [9, 7, 2],
    [8, 8, 8, 3, 3, 3, 3],
    [8, 8, 8, 6],
]
HAND_MASKS = [
    [0, 0, 1, 1, 1],
    [0, 0, 1, 1],
    [0, 0, 1],
    [0, 0, 1],
    [0, 0, 0, 1, 1, 1, 1],
    [0, 0, 0, 1],
]
HAND_REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])


@pytest.mark.parametrize(
    "loss_norm,expected",
    [
        # sum of logp * adv = 0.5 * -(1 + 2 + 3) - 0.5 * -(4 + 5) = 1.5
        ("kept_tokens", -1.5 / 5),  # group 0's 3 + 2 sampled tokens
        ("all_tokens", -1.5 / 12),  # every group's: 5 + (1 + 1) + (4 + 1)
        (
            "sequence",
            -(0.5 * -6 / 3 - 0.5 * -9 / 2) / 6,
        ),  # each completion's mean first, then over all 6 completions
    ],
)
def test_each_normaliser_divides_by_what_its_name_says(loss_norm, expected):
    model = LinearNLLModel()
    adv = chat_rl.compute_advantages(HAND_REWARDS, num_samples=2)
    loss, tokens = chat_rl.policy_gradient_backward(
        model,
        HAND_SEQS,
        HAND_MASKS,
        adv,
        num_samples=2,
        device_batch_size=8,
        loss_norm=loss_norm,
        device="cpu",
        logprobs=linear_logprobs,
    )
    assert loss.item() == pytest.approx(expected)
    assert model.w.grad.item() == pytest.approx(expected)  # the loss is linear in w, and w = 1
    assert (
        model.rows == 2 and tokens == 5
    )  # the unanimous groups never reach the model, whatever the normaliser


def test_kept_tokens_is_all_tokens_scaled_by_all_over_kept():
    sequences, masks = rollouts(seed=1)
    advantages = chat_rl.compute_advantages(REWARDS, NUM_SAMPLES)
    results = {}
    for loss_norm in ("kept_tokens", "all_tokens"):
        model = small_model()
        _, kept = chat_rl.policy_gradient_backward(
            model,
            sequences,
            masks,
            advantages,
            num_samples=NUM_SAMPLES,
            device_batch_size=8,
            loss_norm=loss_norm,
            device="cpu",
            temperature=T,
        )
        results[loss_norm] = grads(model)
    ratio = sum(sum(m[1:]) for m in masks) / kept
    assert ratio > 1.5  # the unanimous groups hold a good share of the tokens
    assert_same_grads(
        results["kept_tokens"], {n: g * ratio for n, g in results["all_tokens"].items()}
    )


def test_a_misspelt_keyword_is_refused_on_a_step_without_signal_too():
    # a step without signal returns before the passes that take the keywords: a fork's typo would
    # otherwise pass silently until the first step with signal
    sequences, masks = rollouts(seed=1)
    unanimous = torch.zeros(len(sequences))
    with pytest.raises(TypeError, match="device_batch_sise"):
        chat_rl.policy_gradient_backward(small_model(), sequences, masks, unanimous,
                                         num_samples=NUM_SAMPLES, loss_norm="all_tokens",
                                         device_batch_sise=2)  # fmt: skip


# ---- two ranks, each with a group that carries signal and a unanimous one ------------------------
# every normaliser counts both ranks' rows
def _worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    sequences, masks = rollouts(seed=10 + rank, num_groups=2)
    rewards = REWARDS[6 * rank : 6 * rank + 6]
    result = {}
    for loss_norm in NORMS:
        model = small_model()
        chat_rl.policy_gradient_backward(
            model,
            sequences,
            masks,
            chat_rl.compute_advantages(rewards, NUM_SAMPLES),
            num_samples=NUM_SAMPLES,
            device_batch_size=8,
            loss_norm=loss_norm,
            device="cpu",
            temperature=T,
        )
        chat_rl.sync_gradients(model)
        result[loss_norm] = grads(model)
    torch.save(result, os.path.join(out_dir, f"grads{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_grads(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    mp.start_processes(
        _worker, args=(2, str(out / "init"), str(out)), nprocs=2, join=True, start_method="spawn"
    )
    return [torch.load(out / f"grads{r}.pt") for r in range(2)]


@pytest.mark.parametrize("loss_norm", NORMS)
def test_two_ranks_sum_to_one_process_over_every_row(loss_norm, two_rank_grads):
    sequences, masks = (
        sum(parts, []) for parts in zip(*(rollouts(seed=10 + r, num_groups=2) for r in range(2)))
    )
    advantages = chat_rl.compute_advantages(REWARDS, NUM_SAMPLES)
    reference = small_model()
    reference_backward(reference, sequences, masks, advantages, loss_norm, T)
    for rank in range(2):
        assert_same_grads(two_rank_grads[rank][loss_norm], grads(reference))


# ---- the flag and the checkpoints of its earlier name
def test_the_earlier_name_token_is_refused_with_its_new_one():
    cfg = flags.parse_config(
        ["--preset=demo", "--loss-norm=token"], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS
    )
    with pytest.raises(flags.ConfigError, match="--loss-norm=token is now kept_tokens"):
        flags.check_config(cfg, world_size=1)


def test_a_checkpoint_saved_with_token_resumes_as_kept_tokens(tmp_path):
    folder = tmp_path / "step_000003"
    small_model().save_pretrained(str(folder))
    old = flags.parse_config(
        ["--preset=demo", f"--out-dir={tmp_path}"], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS
    )
    config = {**vars(old), "loss_norm": "token"}
    torch.save(
        {"step": 3, "optimizer": {}, "rng": [None], "world_size": 1, "config": config},
        folder / "trainer_state.pt",
    )
    cfg = flags.parse_config(
        ["--preset=demo", f"--out-dir={tmp_path}", "--loss-norm=kept_tokens"],
        chat_rl.HYPERPARAMETERS,
        chat_rl.PRESETS,
    )
    assert checkpoint.find_resumable(cfg, world=1)[0] == 3
    cfg.loss_norm = "all_tokens"
    with pytest.raises(flags.ConfigError, match=r"loss_norm \('kept_tokens' -> 'all_tokens'\)"):
        checkpoint.find_resumable(cfg, world=1)


def test_train_hands_the_rollout_temperature_and_the_normaliser_to_the_loss(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    GPT(
        GPTConfig(
            vocab_size=264,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).init_weights(0).save_pretrained(str(model_dir))
    ByteTokenizer().save_pretrained(str(model_dir))
    seen, real = [], chat_rl.policy_gradient_backward

    def spy(*args, **kwargs):
        given = inspect.signature(real).bind(*args, **kwargs).arguments
        seen.append((given["loss_norm"], given["temperature"], given["how"]["vocab_size"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(chat_rl, "policy_gradient_backward", spy)
    code = chat_rl.main(
        [
            "--preset=demo",
            f"--model={model_dir}",
            f"--out-dir={tmp_path / 'run'}",
            "--num-steps=1",
            "--examples-per-step=2",
            "--num-samples=2",
            "--max-new-tokens=3",
            "--eval-every=-1",
            "--temperature=0.6",
            "--loss-norm=sequence",
        ]
    )
    assert code == 0 and seen == [
        ("sequence", 0.6, ByteTokenizer().vocab_size)
    ]  # the sampler's vocabulary, not the 264 rows


# --mask-truncated: rows 1, 5 and 7 were cut off by the budget (row 5's group is unanimous)
CUT = [i in (1, 5, 7) for i in range(len(REWARDS))]


@pytest.mark.parametrize("loss_norm", NORMS)
def test_mask_truncated_trains_no_cut_off_token_and_keeps_their_rewards_in_the_baseline(loss_norm):
    sequences, masks = rollouts()
    advantages = chat_rl.compute_advantages(REWARDS, NUM_SAMPLES)  # every row's reward, cut off too
    model, reference = small_model(), small_model()
    chat_rl.policy_gradient_backward(
        model,
        sequences,
        chat_rl.without_truncated(masks, CUT),
        advantages,
        num_samples=NUM_SAMPLES,
        device_batch_size=3,
        loss_norm=loss_norm,
        device="cpu",
        temperature=T,
    )
    # written out: L = -sum_{i finished} sum_{t in S_i} A_i logp_it / N_i, N_i over finished rows'
    # tokens (all_tokens, kept_tokens), or C * max(1, |S_i|) with C every row (sequence: TRL's grpo)
    inputs, targets = chat_rl.make_batch(sequences, masks, "cpu")
    logp = direct_logp(reference, inputs, targets, T)
    finished = ~torch.tensor(CUT)
    tokens = (targets >= 0).sum(dim=1) * finished
    normaliser = {
        "all_tokens": tokens.sum(),
        "kept_tokens": tokens[kept_rows(advantages)].sum(),
        "sequence": len(sequences) * tokens.clamp(min=1),
    }[loss_norm]
    (-(finished * advantages * logp.sum(dim=1) / normaliser).sum()).backward()
    assert_same_grads(grads(model), grads(reference))


@pytest.mark.parametrize("flag", [[], ["--mask-truncated"]])
def test_train_masks_cut_off_completions_if_asked_after_the_advantages(flag, tmp_path, monkeypatch):
    rolled, given = [], []
    rollout, backward = chat_rl.rollout, chat_rl.policy_gradient_backward

    def spy(*args, **kwargs):
        given.append(inspect.signature(backward).bind(*args, **kwargs).arguments)
        return backward(*args, **kwargs)

    monkeypatch.setattr(
        chat_rl, "rollout", lambda *a, **k: rolled.append(rollout(*a, **k)) or rolled[-1]
    )
    monkeypatch.setattr(chat_rl, "policy_gradient_backward", spy)
    assert (
        chat_rl.main(
            [
                "--preset=demo",
                f"--out-dir={tmp_path / 'run'}",
                "--num-steps=1",
                "--eval-every=-1",
                "--examples-per-step=4",
                "--num-samples=4",
                "--max-new-tokens=30",
                *flag,
            ]
        )
        == 0
    )
    out, args = rolled[0], given[0]
    assert 0 < sum(out["truncated"]) < len(out["truncated"])  # some cut off, some not
    every_reward = chat_rl.compute_advantages(torch.tensor(out["total"]), 4)
    assert args["advantages"].tolist() == every_reward.tolist()
    cut = out["truncated"] if flag else [False] * len(out["masks"])
    assert args["masks"] == [[0] * len(m) if c else m for m, c in zip(out["masks"], cut)]
