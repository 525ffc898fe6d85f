"""
--kl-beta and --ppo-epochs through chat_rl.objective, each held to its formula written out on a
small batch, at a policy that has moved away from the reference or from the policy that sampled:
the k3 estimator of KL to a frozen reference, and PPO's clipped surrogate aggregated token by token
(TRL's "dapo"), on both --logprobs paths and for each normaliser; the first epoch's ratio of
exactly 1; the fast path's guess, missed once a pass; two ranks; LoRA's reference, the base with its
adapters off; the flags; and train()'s epochs, each its own gradient and update.

The harness a test of an objective term of your own uses (docs/testing_a_change.md):
  base.small_model(seed)      a tiny random policy (test_objective.py), V = 48 tokens, T = 0.7
  base.rollouts()             12 rows, 4 groups of NUM_SAMPLES = 3, random tokens; base.REWARDS
                              leaves 2 groups with signal: 6 rows, 14 sampled tokens, that train
  base.sampled_rollouts(m)    rows the policy m sampled (a term reading p needs likely tokens)
  options(**flags)            OFF's objective flags with yours changed
  moved(model, scale)         the model moved (a ratio other than 1): scale=0.005 about one
                              update, as the clip test; the default 0.2 much further
  two_epochs(...)             --ppo-epochs=2 through policy_gradient_backward: the second's result
  written_out(...)            L straight from the logits, backpropagated: the reference; extra=
                              a term of your own (tests/test_fork.py's penalised objective)
  base.assert_same_grads      every parameter's gradient compared
"""

import inspect
import json
import os
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

import chat_rl
import test_objective as base  # the objective's own tests: their model, rollouts and formulas
from fast import logprobs as fast
from fast.logprobs import fast_logprobs, plain_logprobs
from plumbing import checkpoint, flags, fsdp, metrics
from policy import lora

T, NUM_SAMPLES, NORMS = base.T, base.NUM_SAMPLES, base.NORMS
PATHS = {"plain": plain_logprobs, "fast": fast_logprobs}
BETA, EPS_LOW, EPS_HIGH = 0.5, 0.1, 0.15


def moved(model, scale=0.2, seed=7):
    """The model after some updates: each weight moved by noise of `scale` times its own spread."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
    return model


def options(**changes):
    return {**chat_rl.OFF, **changes}


def frozen_model(model):
    """A reference as train() hands it over: a function opening a block that yields the model."""
    model.requires_grad_(False)
    return lambda: nullcontext(model)


def written_out(
    policy, sequences, masks, advantages, loss_norm, kl_beta=0.0, reference=None, old=None,
    weight=None, extra=None, bounds=(1 - EPS_LOW, 1 + EPS_HIGH),
):  # fmt: skip
    """The tests' one reference loss: L over every row, unanimous groups too, straight from the
    logits (r = exp(logp - old)):
        - sum_i sum_{t in S_i} w_t min(r A_it, clip(r, low, high) A_it) / N_i
          (old None: - sum_i sum_{t in S_i} w_t A_it logp / N_i)
        + kl_beta sum_i sum_{t in S_i} (exp(ref - logp) - (ref - logp) - 1) / N_i
    advantages: (rows,) a row's A_i, or (rows, T) a token's in make_batch's layout; weight: w,
    (rows, T) in that layout, no gradient (the rollout correction's), 1 if None; bounds: the
    ratio's (low, high), numbers or (rows, T) tensors in that layout (a clip of your own; (0,
    math.inf) for none), PPO's at two_epochs' clip_eps EPS_LOW and clip_eps_high EPS_HIGH by
    default. N_i as
    --loss-norm says, kept_tokens counting every row with the KL term. Backpropagates L into
    policy; returns (L, the tokens the clip cuts below and above, and those it leaves inside). A
    term of your own that reweights the advantages is written out by the advantages it amounts to
    (per row or per token); any other by extra(logp, old_logp, sampled) -> its value per token
    (rows, T), old_logp None without old, added on the kept rows (those the run's passes run)
    before the division by N_i."""
    inputs, targets = chat_rl.make_batch(sequences, masks, "cpu")
    sampled = targets >= 0
    logp = base.direct_logp(policy, inputs, targets, T)
    tokens = sampled.sum(dim=1).float()
    per_row = advantages if advantages.dim() == 1 else advantages.abs().sum(dim=1)
    kept = base.kept_rows(per_row) if kl_beta == 0 else torch.ones(len(sequences), dtype=bool)
    N = {
        "all_tokens": tokens.sum().expand(len(sequences)),
        "kept_tokens": tokens[kept].sum().expand(len(sequences)),
        "sequence": len(sequences) * tokens.clamp(min=1),
    }[loss_norm][:, None]
    A = advantages[:, None] if advantages.dim() == 1 else advantages[:, : logp.size(1)]
    w, cut, old_logp = 1.0 if weight is None else weight, (0, 0, 0), None
    if old is not None:
        with torch.no_grad():
            old_logp = base.direct_logp(old, inputs, targets, T)
    if old is None:
        per_token = -w * A * logp
    else:
        r = torch.exp(logp - old_logp)
        low, high = bounds
        per_token = -w * torch.minimum(r * A, torch.clamp(r, low, high) * A)
        cut = (
            int(((r < low) & (A < 0) & sampled).sum()),
            int(((r > high) & (A > 0) & sampled).sum()),
            int(((r >= low) & (r <= high) & (A != 0) & sampled).sum()),
        )
    if kl_beta:
        with torch.no_grad():
            ref = base.direct_logp(reference, inputs, targets, T)
        per_token = per_token + kl_beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    if extra is not None:
        per_token = per_token + extra(logp, old_logp, sampled) * kept[:, None]
    loss = (per_token * sampled / N).sum()
    loss.backward()
    return loss.detach(), cut


def two_epochs(
    sampler, policy, sequences, masks, advantages, loss_norm, logprobs, batch_rows=3, **kwargs
):
    """--ppo-epochs=2 as train() runs it: the first epoch on the sampling policy (its log-probs
    kept), the second on `policy`, which has moved. Returns the second's (loss, kept tokens, stats);
    its gradient is in policy. Its options are PPO's clip (ppo_epochs=2, clip_eps EPS_LOW,
    clip_eps_high EPS_HIGH), a test's opts={...} added and overriding: a term of your own is
    tested beside PPO's clip unless its opts set those back."""
    saved = fast.RolloutLogprobs()
    args = dict(num_samples=NUM_SAMPLES, device_batch_size=batch_rows, loss_norm=loss_norm)
    clip = dict(ppo_epochs=2, clip_eps=EPS_LOW, clip_eps_high=EPS_HIGH)
    opts = options(**{**clip, **kwargs.pop("opts", {})})  # a test's own opts win
    kwargs.update(temperature=T, logprobs=logprobs, options=opts, saved=saved)
    chat_rl.policy_gradient_backward(sampler, sequences, masks, advantages, **args, **kwargs)
    stats = {}
    loss, kept = chat_rl.policy_gradient_backward(
        policy, sequences, masks, advantages, **args, stats=stats, **kwargs
    )
    return loss, kept, stats


def step_zero():
    sequences, masks = base.rollouts()
    return sequences, masks, chat_rl.compute_advantages(base.REWARDS, NUM_SAMPLES)


# ---- the KL term: k3 against a frozen reference, every row kept ----------------------------------
@pytest.mark.parametrize("loss_norm", NORMS)
@pytest.mark.parametrize("path", PATHS)
def test_the_kl_term_is_k3_over_n_on_every_row_at_a_moved_policy(path, loss_norm):
    sequences, masks, advantages = step_zero()
    policy, expected_policy, stats = moved(base.small_model()), moved(base.small_model()), {}
    loss, kept = chat_rl.policy_gradient_backward(
        policy,
        sequences,
        masks,
        advantages,
        num_samples=NUM_SAMPLES,
        device_batch_size=3,
        loss_norm=loss_norm,
        device="cpu",
        temperature=T,
        logprobs=PATHS[path],
        options=options(kl_beta=BETA),
        reference=frozen_model(base.small_model()),
        stats=stats,
    )
    expected, _ = written_out(
        expected_policy,
        sequences,
        masks,
        advantages,
        loss_norm,
        kl_beta=BETA,
        reference=base.small_model(),
    )
    assert kept == sum(sum(m[1:]) for m in masks)  # unanimous groups kept: the KL pulls on them
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    base.assert_same_grads(base.grads(policy), base.grads(expected_policy))
    assert float(stats["kl"]) > 0
    without = moved(base.small_model())  # the KL's share of the gradient is no rounding error
    written_out(without, sequences, masks, advantages, loss_norm)
    head = "lm_head.weight"
    assert (base.grads(without)[head] - base.grads(policy)[head]).abs().max() > 1e-3


def test_at_the_start_the_kl_is_zero_and_the_gradient_the_policy_gradients():
    sequences, masks, advantages = step_zero()  # reference = policy: exp(0) - 0 - 1
    policy, plain, stats = base.small_model(), base.small_model(), {}
    args, kw = (
        (sequences, masks, advantages),
        dict(num_samples=NUM_SAMPLES, device_batch_size=3, loss_norm="all_tokens", device="cpu"),
    )
    chat_rl.policy_gradient_backward(
        policy,
        *args,
        **kw,
        temperature=T,
        options=options(kl_beta=BETA),
        reference=frozen_model(base.small_model()),
        stats=stats,
    )
    chat_rl.policy_gradient_backward(plain, *args, **kw, temperature=T)
    assert abs(float(stats["kl"])) < 1e-5
    base.assert_same_grads(base.grads(policy), base.grads(plain))


def test_with_the_kl_a_step_of_unanimous_groups_still_trains():
    sequences, masks, _ = step_zero()
    advantages = chat_rl.compute_advantages(torch.ones(len(sequences)), NUM_SAMPLES)
    policy = moved(base.small_model())
    loss, kept = chat_rl.policy_gradient_backward(
        policy,
        sequences,
        masks,
        advantages,
        num_samples=NUM_SAMPLES,
        device_batch_size=8,
        loss_norm="all_tokens",
        device="cpu",
        temperature=T,
        options=options(kl_beta=BETA),
        reference=frozen_model(base.small_model()),
    )
    assert kept > 0 and float(loss) > 0 and base.grads(policy)["lm_head.weight"].abs().max() > 0


def test_rows_with_gradient_are_the_groups_with_signal_or_with_the_kl_every_row():
    advantages = chat_rl.compute_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), 2)
    assert chat_rl.rows_with_gradient(advantages, 2).tolist() == [True] * 2 + [False] * 4
    assert chat_rl.rows_with_gradient(advantages, 2, kl_beta=0.1).tolist() == [True] * 6


# ---- the clipped ratio ---------------------------------------------------------------------------
@pytest.mark.parametrize("loss_norm", NORMS)
@pytest.mark.parametrize("path", PATHS)
def test_the_second_epoch_is_the_clipped_surrogate_token_by_token_at_a_moved_policy(
    path, loss_norm
):
    # moved as far as one update might: of the 14 tokens with an advantage the clip cuts 2 below
    # and 1 above, leaves 8 inside (3 of them between 1 + EPS_LOW and 1 + EPS_HIGH, two with
    # A > 0), 3 are outside on the side the min does not clip
    sequences, masks, advantages = step_zero()
    policy, expected_policy = (moved(base.small_model(), scale=0.005, seed=9) for _ in range(2))
    loss, kept, stats = two_epochs(
        base.small_model(), policy, sequences, masks, advantages, loss_norm, PATHS[path]
    )
    expected, cut = written_out(
        expected_policy, sequences, masks, advantages, loss_norm, old=base.small_model()
    )
    assert cut == (2, 1, 8)
    assert float(stats["clip_frac"]) == 2 + 1
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    base.assert_same_grads(base.grads(policy), base.grads(expected_policy))


@pytest.mark.parametrize("path", PATHS)
def test_the_upper_clip_off_is_the_lower_one_on_both_sides(path):
    # --clip-eps-high=-1 (its default): the ratio clipped to [1 - EPS_LOW, 1 + EPS_LOW]; of the
    # test before's rows it cuts 3 above where [1 - EPS_LOW, 1 + EPS_HIGH] cut 1, and leaves 5
    # inside where that left 8: of the 3 ratios between the two upper bounds, the two with A > 0
    # are cut, the one with A < 0 is past the side the min does not clip
    sequences, masks, advantages = step_zero()
    policy, expected_policy = (moved(base.small_model(), scale=0.005, seed=9) for _ in range(2))
    loss, _, stats = two_epochs(
        base.small_model(), policy, sequences, masks, advantages, "all_tokens", PATHS[path],
        opts=dict(clip_eps_high=-1.0),
    )  # fmt: skip
    expected, cut = written_out(
        expected_policy, sequences, masks, advantages, "all_tokens", old=base.small_model(),
        bounds=(1 - EPS_LOW, 1 + EPS_LOW),
    )  # fmt: skip
    assert cut == (2, 3, 5)
    assert float(stats["clip_frac"]) == 2 + 3
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    base.assert_same_grads(base.grads(policy), base.grads(expected_policy))


@pytest.mark.parametrize("path", PATHS)
def test_the_ratio_and_the_kl_together(path):
    sequences, masks = base.rollouts(seed=2)
    advantages = chat_rl.compute_advantages(base.REWARDS, NUM_SAMPLES)
    policy, expected_policy = moved(base.small_model()), moved(base.small_model())
    loss, _, stats = two_epochs(
        base.small_model(),
        policy,
        sequences,
        masks,
        advantages,
        "all_tokens",
        PATHS[path],
        opts=dict(kl_beta=BETA),
        reference=frozen_model(moved(base.small_model(), seed=3)),
    )
    expected, _ = written_out(
        expected_policy,
        sequences,
        masks,
        advantages,
        "all_tokens",
        kl_beta=BETA,
        reference=moved(base.small_model(), seed=3),
        old=base.small_model(),
    )
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    base.assert_same_grads(base.grads(policy), base.grads(expected_policy))
    assert float(stats["kl"]) > 0 and float(stats["clip_frac"]) > 0


def test_in_the_first_epoch_the_ratio_is_exactly_1_and_the_gradient_the_policy_gradients(
    monkeypatch,
):
    # the weights that sampled are the ones updated: the objective takes the pass's own log-probs as
    # the sampling policy's. The fast path's guess, made at ratio 1, then holds to the bit (its
    # backward pass compares): the head is projected once, as for the default loss, nothing clipped
    sequences, masks, advantages = step_zero()
    given, objective, recomputed, nll_grads = [], chat_rl.objective, [], fast.nll_grads

    def watched(logp, batch):
        given.append(batch.old_logp)
        return objective(logp, batch)

    monkeypatch.setattr(chat_rl, "objective", watched)
    monkeypatch.setattr(fast, "nll_grads", lambda *a: recomputed.append(1) or nll_grads(*a))
    ppo, default, stats, saved = base.small_model(), base.small_model(), {}, fast.RolloutLogprobs()
    args, kw = (
        (sequences, masks, advantages),
        dict(num_samples=NUM_SAMPLES, device_batch_size=3, loss_norm="all_tokens", device="cpu"),
    )
    chat_rl.policy_gradient_backward(
        ppo, *args, **kw, temperature=T, options=options(ppo_epochs=2), saved=saved, stats=stats
    )
    assert not recomputed and float(stats["clip_frac"]) == 0
    assert given == [None] * 4  # 2 passes, each a guess and the pass itself
    chat_rl.policy_gradient_backward(default, *args, **kw, temperature=T)
    base.assert_same_grads(base.grads(ppo), base.grads(default))
    rows = [i for i, kept in enumerate(base.kept_rows(advantages)) if kept]  # kept: the sampler's
    inputs, targets = chat_rl.make_batch(
        [sequences[i] for i in rows], [masks[i] for i in rows], "cpu"
    )
    with torch.no_grad():
        expected = plain_logprobs(base.small_model(), inputs, targets, T)
    torch.testing.assert_close(saved.get("old_logp", rows), expected)


@pytest.mark.parametrize("objective", ["clip", "kl", "tis", "sequence"])
def test_after_the_first_miss_the_fast_path_is_told_the_gradient_at_the_log_probs(
    monkeypatch, objective
):
    # the second epoch's guess (its gradient at ratio 1) misses on the first micro-batch, whose
    # gradients the fast path makes again (the head projected once more); the later ones are told
    # the objective's gradient as a function of the log-probs, which the fast path takes a chunk
    # at a time: exact for a token's gradient that reads its own log-prob alone (the clip, k3, the
    # rollout correction), so nothing is made again. A term over a whole sequence misses that too,
    # and the passes after it are told no guess
    sequences, masks, advantages = step_zero()
    told, remade, nll_grads = [], [], fast.nll_grads
    monkeypatch.setattr(fast, "nll_grads", lambda *a: remade.append(len(told)) or nll_grads(*a))
    monkeypatch.setattr(fast, "LOGITS_PER_CHUNK", 2 * base.V)  # 2 tokens a chunk: many a pass

    def counted(model, inputs, targets, temperature, loss_grad=None, vocab_size=None):
        if torch.is_grad_enabled():  # a pass of the policy's, not --kl-beta's reference's
            kind = "function" if callable(loss_grad) else "tensor" if loss_grad is not None else ""
            told.append(kind)
        return fast.fast_logprobs(model, inputs, targets, temperature, loss_grad, vocab_size)

    opts, frozen = {}, {}
    if objective == "kl":
        opts = dict(kl_beta=0.1)
        frozen = dict(reference=frozen_model(moved(base.small_model(), seed=3)))
    if objective == "tis":
        opts = dict(rollout_correction="tis", rollout_cap=1.2)
        frozen = dict(sampler_logp=[[-1.0] * len(s) for s in sequences])  # a sampler far off
    if objective == "sequence":  # a sequence's mean log-prob squared: every token reads its row's
        objective_ = chat_rl.objective

        def sequence_term(logp, batch):
            loss, stats = objective_(logp, batch)
            return loss + ((logp * batch.sampled).sum(dim=1) ** 2).sum() * 1e-3, stats

        monkeypatch.setattr(chat_rl, "objective", sequence_term)
    two_epochs(
        base.small_model(),
        moved(base.small_model()),
        sequences,
        masks,
        advantages,
        "all_tokens",
        counted,
        batch_rows=2,
        opts=opts,
        **frozen,
    )
    # n passes an epoch, each epoch a guess of its own: at ratio 1 the first epoch's holds for the
    # clip and misses at once for k3 and the correction; the second's misses for all. remade:
    # the passes (from 1) whose head's gradients were made again in their backward pass
    n = len(told) // 2
    one = {"clip": ["tensor"] * n, "sequence": ["tensor", "function"] + [""] * (n - 2)}
    epoch = ["tensor"] + ["function"] * (n - 1)
    assert told == one.get(objective, epoch) + (
        one["sequence"] if objective == "sequence" else epoch
    )
    first = {"clip": [], "sequence": list(range(1, n + 1))}.get(objective, [1])
    assert remade == first + [p + n for p in (first if objective == "sequence" else [1])]


# ---- LoRA: the reference is the base, its adapters off -------------------------------------------
def test_with_lora_the_reference_is_the_same_model_with_its_adapters_off():
    idx = torch.randint(0, base.V, (2, 9), generator=torch.Generator().manual_seed(0))
    plain, model = base.small_model(), lora.add_adapters(base.small_model(), 4, 8.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # adapters as training leaves them: the model has moved
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
        adapted = model(idx)
    cfg = flags.parse_config(["--kl-beta=0.1"], chat_rl.HYPERPARAMETERS)
    reference = checkpoint.reference_policy(cfg, model, None, "cpu")
    with torch.no_grad(), reference() as frozen:
        assert frozen is model  # no second model
        assert torch.equal(frozen(idx), plain(idx))
    with torch.no_grad():
        assert not torch.equal(adapted, plain(idx)) and torch.equal(model(idx), adapted)  # back on


def test_lora_training_a_module_whole_has_no_base_to_measure_the_kl_to():
    targets = lora.parse_targets("all-linear,lm_head")
    model = lora.add_adapters(base.small_model(), 4, 8.0, targets=targets)
    cfg = flags.parse_config(["--kl-beta=0.1"], chat_rl.HYPERPARAMETERS)
    with pytest.raises(flags.ConfigError, match="drop them from --lora-targets"):
        checkpoint.reference_policy(cfg, model, None, "cpu")


# ---- the flags -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv,message",
    [
        (["--kl-beta=-0.1"], "--kl-beta must be a finite number >= 0"),
        (["--kl-beta=nan"], "--kl-beta must be a finite number >= 0"),
        (["--ppo-epochs=0"], "--ppo-epochs must be >= 1"),
        (["--clip-eps=1.0"], r"--clip-eps must be in \[0, 1\)"),
        (["--clip-eps=-0.2"], r"--clip-eps must be in \[0, 1\)"),
        (["--clip-eps-high=-0.5"], "--clip-eps-high must be -1"),
        (["--clip-eps=0.1"], "--clip-eps acts only with --ppo-epochs > 1: alone it changes"),
        (["--clip-eps-high=0.28"], "--clip-eps-high acts only with --ppo-epochs > 1"),
        (["--kl-beta=0.1", "--fsdp"], "--kl-beta with --fsdp is not built"),
    ],
)
def test_impossible_objective_flags_are_refused_in_one_line(argv, message):
    cfg = flags.parse_config(["--preset=demo", *argv], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS)
    with pytest.raises(flags.ConfigError, match=message):
        flags.check_config(cfg, world_size=1)


def test_the_objective_flags_change_what_is_computed_so_resume_checks_them(tmp_path):
    assert not {"kl_beta", "ppo_epochs", "clip_eps", "clip_eps_high"} & checkpoint.MAY_DIFFER
    folder = tmp_path / "step_000003"
    base.small_model().save_pretrained(str(folder))
    cfg = flags.parse_config(
        ["--preset=demo", f"--out-dir={tmp_path}"], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS
    )
    older = {k: v for k, v in vars(cfg).items() if k not in chat_rl.OFF}  # before the flags
    torch.save(
        {"step": 3, "optimizer": {}, "rng": [None], "world_size": 1, "config": older},
        folder / "trainer_state.pt",
    )
    assert checkpoint.find_resumable(cfg, world=1)[0] == 3
    cfg.kl_beta = 0.04
    with pytest.raises(flags.ConfigError, match=r"kl_beta \(0.0 -> 0.04\)"):
        checkpoint.find_resumable(cfg, world=1)


# ---- train(): each epoch its own gradient and update; the rows' kl and clip_frac -----------------
@pytest.mark.parametrize(
    "extra", [[], ["--ppo-epochs=2", "--kl-beta=0.05"], ["--kl-beta=0.05", "--lora-rank=1"]]
)
def test_each_epoch_starts_from_a_zero_gradient_and_takes_its_own_update(
    extra, tmp_path, monkeypatch
):
    entered, steps = [], []
    backward, step = chat_rl.policy_gradient_backward, chat_rl.optimizer_step

    def spy(model, *args, **kwargs):
        entered.append(all(p.grad is None for p in model.parameters()))
        return backward(model, *args, **kwargs)

    def stepped(model, optimizer, *args):
        result = step(model, optimizer, *args)
        steps.append(max(int(s["step"]) for s in optimizer.state.values()))
        return result

    monkeypatch.setattr(chat_rl, "policy_gradient_backward", spy)
    monkeypatch.setattr(chat_rl, "optimizer_step", stepped)
    out = tmp_path / "run"
    assert (
        chat_rl.main(
            [
                "--preset=demo",
                f"--out-dir={out}",
                "--num-steps=2",
                "--eval-every=-1",
                "--examples-per-step=4",
                "--num-samples=4",
                "--max-new-tokens=30",
                *extra,
            ]
        )
        == 0
    )
    epochs = 2 if "--ppo-epochs=2" in extra else 1
    assert entered == [True] * 2 * epochs and steps == list(range(1, 2 * epochs + 1))  # AdamW's
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert all(("kl" in r) == bool(extra) and "clip_frac" in r for r in rows)  # the kl if on
    assert all(r["clip_frac"] == 0 for r in rows if epochs == 1)  # one update: the ratio is 1
    if extra:  # at the start (LoRA: the base, B = 0) the kl is 0; an update later it is not
        assert (abs(rows[0]["kl"]) < 1e-6 or epochs > 1) and rows[1]["kl"] > 1e-6
        assert all(0 <= r["clip_frac"] < 1 for r in rows if epochs > 1)


# objective flags as a command line gives them, a run each: a flag of your own gets a case here,
# alone or beside the flags it goes with (one that refuses another cannot share a case with it)
GIVEN = [
    dict(kl_beta=0.02, ppo_epochs=3, clip_eps=0.1),
    dict(rollout_correction="mis", rollout_cap=1.5),
]


@pytest.mark.parametrize("given", GIVEN)
def test_train_hands_the_objective_its_flags(given, tmp_path, monkeypatch):
    seen, real = [], chat_rl.policy_gradient_backward

    def spy(*args, **kwargs):
        seen.append(inspect.signature(real).bind(*args, **kwargs).arguments["options"])
        return real(*args, **kwargs)

    monkeypatch.setattr(chat_rl, "policy_gradient_backward", spy)
    argv = [f"--{name.replace('_', '-')}={value}" for name, value in given.items()]
    run = ["--num-steps=1", "--eval-every=-1", "--examples-per-step=2", "--num-samples=2"]
    out = f"--out-dir={tmp_path / 'run'}"
    assert chat_rl.main(["--preset=demo", out, *run, "--max-new-tokens=8", *argv]) == 0
    # as given, each epoch; a flag not given at its off value (the upper clip's -1 is handed
    # over as -1: objective() reads it as --clip-eps)
    assert seen == [{**chat_rl.OFF, **given}] * given.get("ppo_epochs", 1)


# ---- two ranks: each rank's gradient is one process's over both ranks' rows ----------------------
def rank_rows(rank):
    sequences, masks = base.rollouts(seed=20 + rank, num_groups=4 if rank == 0 else 2)  # uneven
    return sequences, masks, chat_rl.compute_advantages(base.REWARDS[: len(sequences)], NUM_SAMPLES)


def _worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    rows, out, cpu = rank_rows(rank), {}, torch.device("cpu")
    for case in ("kl", "ratio", "ratio --fsdp"):
        sharded = case.endswith("--fsdp")
        policy = fsdp.prepare(moved(base.small_model()), cpu, sharded, False)
        if case == "kl":
            chat_rl.policy_gradient_backward(
                policy,
                *rows,
                num_samples=NUM_SAMPLES,
                device_batch_size=2,
                loss_norm="all_tokens",
                temperature=T,
                options=options(kl_beta=BETA),
                reference=frozen_model(base.small_model()),
            )
        else:
            sampler = fsdp.prepare(base.small_model(), cpu, sharded, False)
            two_epochs(sampler, policy, *rows, "all_tokens", fast_logprobs, batch_rows=2)
        chat_rl.sync_gradients(policy)
        out[case] = {
            n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in policy.named_parameters()
        }
    out["per_token"] = metrics.per_token({"kl": torch.tensor(3.0)} if rank == 0 else {}, 6, cpu)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("objective_options")
    mp.start_processes(
        _worker, args=(2, str(tmp / "init"), str(tmp)), nprocs=2, join=True, start_method="spawn"
    )
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("case", ["kl", "ratio", "ratio --fsdp"])
def test_on_two_ranks_each_option_sums_to_one_process_over_every_row(case, two_ranks):
    parts = [rank_rows(r) for r in range(2)]
    rows = [
        parts[0][0] + parts[1][0],
        parts[0][1] + parts[1][1],
        torch.cat([parts[0][2], parts[1][2]]),
    ]
    expected = moved(base.small_model())
    if case == "kl":
        written_out(expected, *rows, "all_tokens", kl_beta=BETA, reference=base.small_model())
    else:
        written_out(expected, *rows, "all_tokens", old=base.small_model())
    for rank in range(2):
        base.assert_same_grads(two_ranks[rank][case], base.grads(expected))


def test_a_stat_one_rank_has_not_is_averaged_over_both(two_ranks):
    assert two_ranks[0]["per_token"] == two_ranks[1]["per_token"] == {"kl": 0.5}
