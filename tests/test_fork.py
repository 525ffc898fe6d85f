"""
What a fork that changes the objective relies on: each objective flag's off value written once (its
default), so OFF, the defaults and resume's view of older checkpoints cannot disagree; a flag added
without a word to resume still refuses an older checkpoint it would change; one count of a row's
sampled tokens; a term of a fork's own added to objective(), and an advantage of its own with a
flag, each held to its formula written out (the recipes' patterns, whole); advantages per token as
well as per row, on both log-prob paths and two ranks; a once-a-step value's home in the train row.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import chat_rl
import test_objective as base  # the objective's own tests: their model, rollouts and formulas
import test_objective_options as opts  # the tests' one reference loss, written out
from fast.logprobs import fast_logprobs, make_batch, plain_logprobs, sampled_tokens
from plumbing import checkpoint, flags, metrics
from scripts.check_step import first_step_of_train  # train()'s first step, recorded

T, NUM_SAMPLES = base.T, base.NUM_SAMPLES
PATHS = {"plain": plain_logprobs, "fast": fast_logprobs}


# ---- one off value a flag ------------------------------------------------------------------------
def test_each_objective_flag_is_off_at_its_default_and_resume_reads_older_checkpoints_so():
    defaults = {name: default for name, (default, _) in chat_rl.HYPERPARAMETERS.items()}
    assert chat_rl.OFF == {name: defaults[name] for name in chat_rl.OBJECTIVE_FLAGS}
    assert set(chat_rl.OBJECTIVE_FLAGS) <= set(defaults)
    assert not set(chat_rl.OFF) & checkpoint.MAY_DIFFER  # they change what is computed
    # ADDED names only what an older run computed otherwise than the default says
    assert all(name in defaults and defaults[name] != v for name, v in checkpoint.ADDED.items())


def test_the_off_upper_clip_is_the_lower_one():
    # --clip-eps-high's default, -1, is --clip-eps: objective() reads it so, whoever calls it
    sequences, masks = base.rollouts()
    advantages = chat_rl.compute_advantages(base.REWARDS, NUM_SAMPLES)
    grads = []
    for high in (-1.0, 0.1):
        policy, old = base.small_model(), base.small_model(seed=3)
        saved = chat_rl.RolloutLogprobs()
        options = {**chat_rl.OFF, "ppo_epochs": 2, "clip_eps": 0.1, "clip_eps_high": high}
        kw = dict(num_samples=NUM_SAMPLES, loss_norm="all_tokens", temperature=T, options=options)
        chat_rl.policy_gradient_backward(old, sequences, masks, advantages, saved=saved, **kw)
        chat_rl.policy_gradient_backward(policy, sequences, masks, advantages, saved=saved, **kw)
        grads.append(base.grads(policy))
    base.assert_same_grads(*grads)


@pytest.fixture
def forked(monkeypatch):
    """chat_rl with a flag of a fork's own, --token-penalty (default 0.0, off), added to
    HYPERPARAMETERS and nowhere else."""
    hyperparameters = {
        **chat_rl.HYPERPARAMETERS,
        "token_penalty": (0.0, "a penalty per sampled token; 0 = off"),
    }
    monkeypatch.setattr(chat_rl, "HYPERPARAMETERS", hyperparameters)
    return hyperparameters


def checkpoint_before_the_flag(tmp_path, hyperparameters):
    """A checkpoint whose run had no --token-penalty, as one saved before the fork added it."""
    folder = tmp_path / "step_000003"
    base.small_model().save_pretrained(str(folder))
    cfg = flags.parse_config([f"--out-dir={tmp_path}", "--dtype=fp32"], hyperparameters)
    older = {k: v for k, v in vars(cfg).items() if k != "token_penalty"}
    state = {"step": 3, "optimizer": {}, "rng": [None], "world_size": 1, "config": older}
    torch.save(state, folder / "trainer_state.pt")


def test_a_checkpoint_older_than_a_new_flag_resumes_at_its_default_and_refuses_another(
    tmp_path, forked
):
    checkpoint_before_the_flag(tmp_path, forked)
    argv = [f"--out-dir={tmp_path}", "--dtype=fp32", "--resume"]
    assert checkpoint.find_resumable(flags.parse_config(argv, forked), world=1)[0] == 3
    cfg = flags.parse_config([*argv, "--token-penalty=0.01"], forked)
    with pytest.raises(flags.ConfigError) as refused:
        checkpoint.find_resumable(cfg, world=1)
    message = str(refused.value)
    assert "token_penalty (0.0 -> 0.01) (the checkpoint is older than the flag)" in message
    assert "\n" not in message


# ---- one count of a row's sampled tokens ---------------------------------------------------------
def test_a_rows_sampled_tokens_are_its_targets():
    gen = torch.Generator().manual_seed(0)
    sequences, masks = [], []
    for n in (1, 2, 5, 9):
        sequences.append(torch.randint(0, 40, (n,), generator=gen).tolist())
        masks.append(torch.randint(0, 2, (n,), generator=gen).tolist())
    masks[2][0] = 1  # a first token marked sampled: nothing predicts it, so it is no target
    _, targets = make_batch(sequences, masks, "cpu")
    assert [sampled_tokens(m) for m in masks] == (targets >= 0).sum(dim=1).tolist()


# ---- a term of a fork's own, held to its formula -------------------------------------------------
PENALTY = 0.3


@pytest.fixture
def penalised(monkeypatch):
    """chat_rl.objective with a fork's term added, as a fork would write it inside objective():
    PENALTY x (1 - p) on each sampled token, over its N_i (a push away from unlikely tokens). It
    reads p, so the fast path's first guess of the gradient misses and is remade: the case that
    holds an edit of objective() hardest. Here it wraps the original, leaving chat_rl unedited."""
    objective = chat_rl.objective

    def with_penalty(logp, batch):
        loss, stats = objective(logp, batch)
        term = PENALTY * (1 - logp.exp()) * batch.sampled / batch.normaliser[:, None]
        return loss + term.sum(), stats

    monkeypatch.setattr(chat_rl, "objective", with_penalty)


@pytest.mark.parametrize("loss_norm", base.NORMS)
@pytest.mark.parametrize("path", PATHS)
def test_a_forks_own_term_is_held_to_its_formula_written_out(penalised, path, loss_norm):
    # docs/objective.md's recipe end to end: the term through the run's backward, against
    # written_out's reference with the term as extra=, loss and every gradient
    sequences, masks = base.sampled_rollouts(base.small_model())  # p well above 0 (a real test)
    advantages = chat_rl.compute_advantages(base.REWARDS, NUM_SAMPLES)
    policy, expected_policy = base.small_model(), base.small_model()
    loss, _ = chat_rl.policy_gradient_backward(
        policy, sequences, masks, advantages, num_samples=NUM_SAMPLES, loss_norm=loss_norm,
        temperature=T, logprobs=PATHS[path], device_batch_size=3,
    )  # fmt: skip

    def penalty(logp, old_logp, sampled):  # per token, before the division by N_i
        return PENALTY * (1 - logp.exp())

    expected, _ = opts.written_out(
        expected_policy, sequences, masks, advantages, loss_norm, extra=penalty
    )
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    base.assert_same_grads(base.grads(policy), base.grads(expected_policy))


# ---- an advantage of a fork's own, with a flag, through the run ----------------------------------
BREVITY = 0.5


@pytest.fixture
def brief(monkeypatch):
    """chat_rl with a fork's advantage step, as a fork would write it: --brevity=b (default 0.0,
    off), its line in HYPERPARAMETERS, scaling each A_i by 1 - b x its reply's length over its
    group's longest (a short reply's advantage kept nearer whole, a long one's shrunk), in
    step_advantages, the run's one place that computes advantages (--refill's rounds too). Its bad
    values' check (plumbing/flags.check_config) is left out here."""
    hyperparameters = {**chat_rl.HYPERPARAMETERS, "brevity": (0.0, "length's weight; 0 = off")}
    monkeypatch.setattr(chat_rl, "HYPERPARAMETERS", hyperparameters)
    step_advantages = chat_rl.step_advantages

    def with_brevity(out, cfg):
        lengths = torch.tensor(out["tokens"], dtype=torch.float).view(-1, cfg.num_samples)
        scale = 1 - cfg.brevity * lengths / lengths.amax(dim=1, keepdim=True)
        return step_advantages(out, cfg) * scale.view(-1)

    monkeypatch.setattr(chat_rl, "step_advantages", with_brevity)


def test_a_forks_own_advantage_reaches_the_loss(brief, tmp_path):
    # the pattern for an advantage with a flag: train()'s first step, the advantages its backward
    # receives held to the formula written out on its rollout
    seen = first_step_of_train(tmp_path, "--seed=1", f"--brevity={BREVITY}")
    assert chat_rl.step_advantages.__name__ == "with_brevity"  # the fork's patch outlives the run
    r = torch.tensor(seen["out"]["total"]).view(-1, 4)
    lengths = torch.tensor(seen["out"]["tokens"], dtype=torch.float).view(-1, 4)
    signal = r.amax(dim=1) > r.amin(dim=1)
    # a group with signal and replies of mixed length, or a length term is 1 whatever its form
    # (seed 1's step 0 has three such groups, seed 0's one)
    assert (lengths[signal].amax(dim=1) > lengths[signal].amin(dim=1)).any()
    expected = (r - r.mean(dim=1, keepdim=True)) * (1 - BREVITY * lengths / lengths.amax(1, True))
    torch.testing.assert_close(seen["advantages"], expected.view(-1))


# ---- advantages per token ------------------------------------------------------------------------
def per_token_advantages(advantages, sequences, seed=0):
    """(rows, T) advantages in make_batch's layout: each row's A_i times a positive weight per
    token (a return-to-go's shape), 0 past its end and in a unanimous group."""
    T_max = max(len(s) for s in sequences) - 1
    gen = torch.Generator().manual_seed(seed)
    weights = 0.5 + torch.rand(len(sequences), T_max, generator=gen)
    for i, seq in enumerate(sequences):
        weights[i, len(seq) - 1 :] = 0
    return advantages[:, None] * weights


def per_token_written_out(policy, sequences, masks, A, loss_norm):
    """L = -sum_i sum_{t in S_i} A_it logp_it / N_i, every row, straight from the logits: the
    tests' one reference loss (test_objective_options.written_out) at a per-token A."""
    return opts.written_out(policy, sequences, masks, A, loss_norm)[0]


@pytest.mark.parametrize("loss_norm", base.NORMS)
@pytest.mark.parametrize("path", PATHS)
def test_a_per_token_advantage_is_its_formula_on_both_paths(path, loss_norm):
    sequences, masks = base.rollouts()
    A = per_token_advantages(chat_rl.compute_advantages(base.REWARDS, NUM_SAMPLES), sequences)
    policy, expected_policy = base.small_model(), base.small_model()
    loss, _ = chat_rl.policy_gradient_backward(
        policy,
        sequences,
        masks,
        A,
        num_samples=NUM_SAMPLES,
        loss_norm=loss_norm,
        device_batch_size=3,
        temperature=T,
        logprobs=PATHS[path],
    )
    expected = per_token_written_out(expected_policy, sequences, masks, A, loss_norm)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    base.assert_same_grads(base.grads(policy), base.grads(expected_policy))


@pytest.mark.parametrize("path", PATHS)
def test_a_per_token_advantage_under_ppos_clip_is_its_formula_at_a_moved_policy(path):
    # the clip compares r A_it token by token: a per-token weight (a fork's reweighting) meets
    # the clip as the written-out reference computes it, the sampling policy's log-probs kept
    sequences, masks = base.rollouts()
    A = per_token_advantages(chat_rl.compute_advantages(base.REWARDS, NUM_SAMPLES), sequences)
    policy, expected_policy = (opts.moved(base.small_model(), 0.005, 9) for _ in range(2))
    loss, _, stats = opts.two_epochs(
        base.small_model(), policy, sequences, masks, A, "all_tokens", PATHS[path]
    )
    expected, cut = opts.written_out(
        expected_policy, sequences, masks, A, "all_tokens", old=base.small_model()
    )
    assert cut[0] + cut[1] > 0  # the clip acts on some tokens: not REINFORCE in disguise
    assert float(stats["clip_frac"]) == cut[0] + cut[1]
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    base.assert_same_grads(base.grads(policy), base.grads(expected_policy))


def test_a_per_token_advantage_constant_along_each_row_is_the_per_row_one():
    sequences, masks = base.rollouts()
    advantages = chat_rl.compute_advantages(base.REWARDS, NUM_SAMPLES)
    T_max = max(len(s) for s in sequences) - 1
    per_row, per_token = base.small_model(), base.small_model()
    kw = dict(num_samples=NUM_SAMPLES, loss_norm="all_tokens", device_batch_size=3, temperature=T)
    chat_rl.policy_gradient_backward(per_row, sequences, masks, advantages, **kw)
    broadcast = advantages[:, None].expand(-1, T_max)
    chat_rl.policy_gradient_backward(per_token, sequences, masks, broadcast, **kw)
    base.assert_same_grads(base.grads(per_token), base.grads(per_row))


# ---- two ranks: per-token advantages and a once-a-step value -------------------------------------
def rank_rows(rank):
    sequences, masks = base.rollouts(seed=20 + rank, num_groups=4 if rank == 0 else 2)
    advantages = chat_rl.compute_advantages(base.REWARDS[: len(sequences)], NUM_SAMPLES)
    return sequences, masks, advantages


def _worker(rank, world, init_file, out_dir, T_max):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    sequences, masks, advantages = rank_rows(rank)
    A = per_token_advantages(advantages, sequences, seed=rank)
    A = torch.nn.functional.pad(A, (0, T_max - A.size(1)))  # the step's width, as train() holds it
    policy = base.small_model()
    chat_rl.policy_gradient_backward(
        policy, sequences, masks, A, num_samples=NUM_SAMPLES, loss_norm="all_tokens", temperature=T
    )
    chat_rl.sync_gradients(policy)
    per_step = metrics.rank_means({"spread": float(rank + 1)} if rank == 0 else {}, "cpu")
    torch.save({"grads": base.grads(policy), "per_step": per_step}, f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


def test_on_two_ranks_per_token_advantages_sum_to_one_process_over_every_row(tmp_path):
    parts = [rank_rows(r) for r in range(2)]
    T_max = max(len(s) for part in parts for s in part[0]) - 1
    args = (2, str(tmp_path / "init"), str(tmp_path), T_max)
    mp.start_processes(_worker, args=args, nprocs=2, start_method="spawn")
    results = [torch.load(os.path.join(tmp_path, f"{r}.pt")) for r in range(2)]
    sequences = parts[0][0] + parts[1][0]
    masks = parts[0][1] + parts[1][1]
    A = [per_token_advantages(p[2], p[0], seed=r) for r, p in enumerate(parts)]
    A = torch.cat([torch.nn.functional.pad(a, (0, T_max - a.size(1))) for a in A])
    expected = base.small_model()
    per_token_written_out(expected, sequences, masks, A, "all_tokens")
    for result in results:
        base.assert_same_grads(result["grads"], base.grads(expected))
        assert result["per_step"] == {"spread": 0.5}  # rank 0's 1.0 and rank 1's nothing


# ---- one list of advantage kinds -----------------------------------------------------------------
def test_an_advantage_kind_is_named_once_and_a_named_kind_without_a_branch_is_refused(monkeypatch):
    # flags.ADVANTAGES is what --advantage accepts: a fork's new name there passes the start check
    monkeypatch.setattr(flags, "ADVANTAGES", (*flags.ADVANTAGES, "my_new_kind"))
    cfg = flags.parse_config(
        ["--preset=demo", "--advantage=my_new_kind"], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS
    )
    flags.check_config(cfg, world_size=1)
    # ... and until compute_advantages has its branch, the kind is refused, not taken for "mean"
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="unknown advantage 'my_new_kind'"):
        chat_rl.compute_advantages(rewards, num_samples=2, kind="my_new_kind")
    for kind in flags.ADVANTAGES[:-1]:  # every kind the flag accepts by default has its branch,
        # called as the run calls it: a kind's own flag arrives from HYPERPARAMETERS' default
        argv = [f"--advantage={kind}", "--num-samples=2"]
        cfg = flags.parse_config(argv, chat_rl.HYPERPARAMETERS, chat_rl.PRESETS)
        chat_rl.step_advantages(rollout_out(rewards.tolist()), cfg)


def rollout_out(rewards):
    """rollout()'s dict for completions with these rewards: its every key, replies of 1, 2, 3, ...
    sampled tokens after a 3-token prompt and 0, 1, 2, 0, ... calculator calls, so that a kind
    reading more than the rewards (a length, the masks, the calls) sees them differ, as in a run."""
    n, prompt = len(rewards), [7, 8, 9]
    calls = [i % 3 for i in range(n)]
    replies = [[5] * (i + 1) for i in range(n)]
    out = dict(
        sequences=[prompt + r for r in replies],
        masks=[[0] * len(prompt) + [1] * len(r) for r in replies],
        sampler_logp=[[0.0] * len(prompt) + [-1.0] * len(r) for r in replies],
        answer=[float(r) for r in rewards], format=[0.0] * n, overlong=[0.0] * n,
        total=[float(r) for r in rewards],
        tokens=[len(r) for r in replies], completions=["5" * len(r) for r in replies],
        truncated=[False] * n, tool_calls=calls, tool_errors=[0] * n,
        tool_use=[float(c > 0) for c in calls],
        reward_errors=[None] * n,
    )  # fmt: skip
    return out
