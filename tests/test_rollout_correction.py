"""
The sampler's log-probs against the trainer's, and --rollout-correction: in fp32 the engine's
log-prob of each token it drew is the trainer's up to rounding (the gap every train row logs reads
0), in bf16 it is not; tis and mis through chat_rl.objective, each held to its formula written out
at a mismatch made on purpose (a bf16 sampler, an fp32 trainer), on both --logprobs paths, after a
--ppo-epochs update, and on two ranks; the flags and resume's check of them.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import chat_rl
import test_objective as base  # the objective's own tests: their model, rollouts and formulas
import test_objective_options as opts  # a moved policy, two epochs as train() runs them
from engine import Engine
from fast.logprobs import fast_logprobs, make_batch, plain_logprobs
from fast.sampling import sample_next_token
from plumbing import checkpoint, flags, metrics
from plumbing.checkpoint import load_policy
from plumbing.passes import token_values
from tasks import arith
from tasks.common import conversation

T, NUM_SAMPLES = base.T, base.NUM_SAMPLES
PATHS = {"plain": plain_logprobs, "fast": fast_logprobs}


def bf16_sampler_logprobs(model, sequences, masks):
    """What a bf16 sampler draws each token with: the model's log-probs under CPU bf16 autocast,
    as per-row lists aligned with the sequences (Samples.logprobs' layout), 0 off the sampled."""
    inputs, targets = make_batch(sequences, masks, "cpu")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        q = plain_logprobs(model, inputs, targets, T)
    return [[0.0] + q[i, : len(seq) - 1].tolist() for i, seq in enumerate(sequences)]


def step_with_mismatch():
    """The objective tests' rollouts, their advantages, the bf16 sampler's log-probs, and a cap that
    about half the sampled tokens' ratios p_fp32 / q_bf16 pass (in either direction): a cap that
    bounds nothing, or everything, would let a formula with it dropped pass."""
    sequences, masks = base.rollouts()
    advantages = chat_rl.compute_advantages(base.REWARDS, NUM_SAMPLES)
    q_rows = bf16_sampler_logprobs(base.small_model(), sequences, masks)
    inputs, targets = make_batch(sequences, masks, "cpu")
    with torch.no_grad():
        p = base.direct_logp(base.small_model(), inputs, targets, T)
    q = token_values(q_rows, range(len(sequences)), "cpu")
    log_ratio = (p - q)[targets >= 0]
    cap = float(torch.exp(log_ratio.abs().median()))
    assert 1.0005 < cap < 1.5, cap  # bf16's rounding: small ratios, yet not 1
    return sequences, masks, advantages, q_rows, cap


def corrected_written_out(policy, sequences, masks, advantages, q_rows, kind, cap, old=None):
    """L with the correction, every row (unanimous groups too: A = 0), straight from the logits:
    test_objective_options.written_out (REINFORCE, or PPO's clip at old) with its per-token
    weight w from rho_t = exp(p_t - q_t), p the sampling weights' log-probs (old's, or the
    policy's own, no gradient), q the sampler's: w = min(rho, cap) (tis), rho inside [1/cap, cap]
    and 0 outside (mis). N: every sampled token (all_tokens). Backpropagates into policy; returns
    (L, tokens past the cap)."""
    inputs, targets = make_batch(sequences, masks, "cpu")
    sampled = targets >= 0
    with torch.no_grad():
        p = base.direct_logp(policy if old is None else old, inputs, targets, T)
    q = torch.zeros_like(p)
    for i, row in enumerate(q_rows):
        q[i, : len(row) - 1] = torch.tensor(row[1:])
    rho = torch.exp(p - q)
    inside = (rho >= 1 / cap) & (rho <= cap)
    w = torch.clamp(rho, max=cap) if kind == "tis" else torch.where(inside, rho, 0.0)
    loss, _ = opts.written_out(
        policy, sequences, masks, advantages, "all_tokens", old=old, weight=w
    )
    return loss, int((~inside & sampled).sum())


@pytest.mark.parametrize("kind", ["tis", "mis"])
@pytest.mark.parametrize("path", PATHS)
def test_each_correction_is_its_formula_at_a_bf16_sampler_and_an_fp32_trainer(path, kind):
    sequences, masks, advantages, q_rows, cap = step_with_mismatch()
    policy, expected_policy = base.small_model(), base.small_model()
    loss, _ = chat_rl.policy_gradient_backward(
        policy,
        sequences,
        masks,
        advantages,
        num_samples=NUM_SAMPLES,
        device_batch_size=3,
        loss_norm="all_tokens",
        device="cpu",
        temperature=T,
        logprobs=PATHS[path],
        options=opts.options(rollout_correction=kind, rollout_cap=cap),
        sampler_logp=q_rows,
    )
    expected, past_cap = corrected_written_out(
        expected_policy, sequences, masks, advantages, q_rows, kind, cap
    )
    assert past_cap > 0  # the cap acts on this batch
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-6)
    base.assert_same_grads(base.grads(policy), base.grads(expected_policy))
    uncorrected = base.small_model()  # and the correction is no rounding error
    base.reference_backward(uncorrected, sequences, masks, advantages, "all_tokens", T)
    head = "lm_head.weight"
    gap = (base.grads(uncorrected)[head] - base.grads(policy)[head]).abs().max()
    assert gap > 1e-3 * base.grads(policy)[head].abs().max()


@pytest.mark.parametrize("kind", ["tis", "mis"])
@pytest.mark.parametrize("path", PATHS)
def test_after_a_ppo_update_the_weight_is_the_sampling_weights_ratio_to_the_sampler(path, kind):
    sequences, masks, advantages, q_rows, cap = step_with_mismatch()
    policy, expected_policy = opts.moved(base.small_model()), opts.moved(base.small_model())
    correction = dict(rollout_correction=kind, rollout_cap=cap)
    loss, _, _ = opts.two_epochs(
        base.small_model(),
        policy,
        sequences,
        masks,
        advantages,
        "all_tokens",
        PATHS[path],
        opts=correction,
        sampler_logp=q_rows,
    )
    expected, _ = corrected_written_out(
        expected_policy, sequences, masks, advantages, q_rows, kind, cap, old=base.small_model()
    )
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-6)
    base.assert_same_grads(base.grads(policy), base.grads(expected_policy))


def test_without_the_samplers_log_probs_nothing_is_corrected():
    sequences, masks, advantages, _, cap = step_with_mismatch()
    corrected, plain = base.small_model(), base.small_model()
    args, kw = (
        (sequences, masks, advantages),
        dict(num_samples=NUM_SAMPLES, device_batch_size=3, loss_norm="all_tokens", device="cpu"),
    )
    chat_rl.policy_gradient_backward(
        corrected, *args, **kw, temperature=T, options=opts.options(rollout_correction="tis")
    )
    chat_rl.policy_gradient_backward(plain, *args, **kw, temperature=T)
    base.assert_same_grads(base.grads(corrected), base.grads(plain))


# ---- the gap: what the sampler drew with against what the trainer computes -----------------------
def test_the_gap_is_k3_the_ratio_and_the_tokens_past_the_cap_over_the_sampled_tokens():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -3.0, -1.0]])
    q = torch.tensor([[-1.5, -2.0, 9.0], [-0.5, -1.0, -1.2]])
    sampled = torch.tensor([[True, True, False], [True, True, True]])
    gap = metrics.sampler_gap(logp, q, sampled, cap=1.5)
    log_ratio = torch.tensor([0.5, 0.0, 0.0, -2.0, 0.2])
    ratio = log_ratio.exp()
    expected = torch.stack([(ratio - log_ratio - 1).sum(), ratio.sum(), torch.tensor(2.0)])
    torch.testing.assert_close(gap["sums"], expected)
    assert float(gap["high"]) == pytest.approx(float(ratio.max()))
    assert float(gap["low"]) == pytest.approx(float(ratio.min()))
    row = metrics.gap_row([gap, gap], kept_tokens=10, device=torch.device("cpu"))
    assert row["mismatch_past_cap"] == pytest.approx(0.4)  # 2 of 5 tokens, in each of two passes
    assert row["mismatch_ratio_max"] == pytest.approx(float(ratio.max()))
    assert None not in row.values()
    assert set(metrics.gap_row([], 0, torch.device("cpu")).values()) == {None}  # nothing kept


@pytest.mark.parametrize("top_k", [0, 5])
def test_the_samplers_log_prob_is_that_of_the_distribution_it_drew_from(top_k):
    gen = torch.Generator().manual_seed(0)
    logits, u = 3 * torch.randn(16, 50, generator=gen), torch.rand(16, generator=gen)
    logits[3, :7] = 4.0  # a tie at the 5th largest: every tied entry stays in
    token, logp = sample_next_token(logits, u, 0.7, top_k, logprobs=True)
    scaled = logits / 0.7
    if top_k:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    expected = scaled.log_softmax(dim=-1).gather(1, token[:, None])[:, 0]
    torch.testing.assert_close(logp, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(token, sample_next_token(logits, u, 0.7, top_k))  # the same draw
    greedy, zero = sample_next_token(logits, u, 0.0, top_k, logprobs=True)
    assert torch.equal(greedy, logits.argmax(-1)) and not zero.any()


@pytest.fixture(scope="module")
def demo_rollout():
    """The demo policy sampling arith problems at temperature 1 with the calculator on: forced
    tokens among the sampled ones (one sample in seven calls it), rows of every length."""
    from calculator import calculate

    model, tokenizer = load_policy("demo_model", "cpu")
    model.eval()
    prompts = [
        tokenizer.render_for_completion(conversation(arith, row))
        for row in arith.load("test", limit=8)
    ]

    def sample(autocast=None):
        engine = Engine(model, tokenizer, tool=calculate)
        with autocast or torch.autocast("cpu", enabled=False):
            return engine.generate(prompts, 8, 48, 1.0, 0, seed=1, include_stop=True)

    return model, sample


def gap_of(model, samples):
    rows = range(len(samples.sequences))
    inputs, targets = make_batch(samples.sequences, samples.masks, "cpu")
    with torch.no_grad():
        p = fast_logprobs(model, inputs, targets, 1.0)
    q = token_values(samples.logprobs, rows, "cpu")
    gap = metrics.sampler_gap(p, q, targets >= 0, cap=2.0)
    return metrics.gap_row([gap], int((targets >= 0).sum()), torch.device("cpu"))


def test_in_fp32_the_engines_log_probs_are_the_trainers(demo_rollout):
    model, sample = demo_rollout
    samples = sample()
    pairs = [
        (lp, m) for row, mask in zip(samples.logprobs, samples.masks) for lp, m in zip(row, mask)
    ]
    assert all(lp == 0.0 for lp, m in pairs if not m)  # the prompt's and the forced tokens'
    assert all(lp <= 0.0 for lp, m in pairs if m) and any(lp < 0.0 for lp, m in pairs if m)
    assert sum(samples.tool_calls) > 0  # forced tokens among the sampled ones
    gap = gap_of(model, samples)
    # a KV-cached decode and the full-sequence forward round apart in fp32's last bits, no more
    assert abs(gap["mismatch_k3"]) < 1e-7 and gap["mismatch_past_cap"] == 0
    assert 1 - 1e-4 < gap["mismatch_ratio_min"] <= gap["mismatch_ratio_max"] < 1 + 1e-4


def test_in_bf16_the_sampler_and_the_fp32_trainer_part(demo_rollout):
    model, sample = demo_rollout
    gap = gap_of(model, sample(torch.autocast("cpu", dtype=torch.bfloat16)))
    assert gap["mismatch_k3"] > 1e-6 and gap["mismatch_ratio_max"] > 1 + 1e-3


# ---- in a run: every train row, the flags, resume ------------------------------------------------
def run(tmp_path, name, *flags):
    out = tmp_path / name
    argv = ["--preset=demo", f"--out-dir={out}", "--num-steps=2", "--eval-every=-1"]
    argv += ["--examples-per-step=4", "--num-samples=4", "--max-new-tokens=40", *flags]
    assert chat_rl.main(argv) == 0
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


GAP_KEYS = {f"mismatch_{k}" for k in ("k3", "ratio", "past_cap", "ratio_max", "ratio_min")}


def test_every_train_row_logs_the_gap_near_0_in_fp32_and_not_in_bf16(tmp_path):
    fp32 = run(tmp_path, "fp32", "--dtype=fp32")
    bf16 = run(tmp_path, "bf16", "--dtype=bf16", "--rollout-correction=tis")
    for rows in (fp32, bf16):
        assert len(rows) == 2 and all(GAP_KEYS <= row.keys() for row in rows)
    for row in fp32:  # a KV-cached decode and the training forward apart in fp32's last bits
        assert abs(row["mismatch_k3"]) < 1e-7 and row["mismatch_past_cap"] == 0
        assert 1 - 1e-4 < row["mismatch_ratio_min"] <= row["mismatch_ratio_max"] < 1 + 1e-4
    for row in bf16:  # both in bf16, each rounding its own way
        assert row["mismatch_k3"] > 0 and row["mismatch_ratio_max"] > 1 + 1e-3


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--rollout-correction=clip"], "unknown --rollout-correction 'clip' (none | tis | mis)"),
        (["--rollout-cap=1.0"], "--rollout-cap must be a finite number above 1, got 1.0"),
        (["--dtype=fp16"], "unknown --dtype 'fp16' (auto | fp32 | bf16)"),
        (
            ["--rollout-correction=tis", "--top-k=5"],
            "--rollout-correction with --top-k > 0: the sampler's log-probs are of the top-k "
            "distribution, the trainer's of the whole one, their ratio not rounding (--top-k=0)",
        ),
    ],
)
def test_impossible_correction_flags_are_refused_in_one_line(argv, message, capsys):
    assert chat_rl.main(["--preset=demo", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"chat_rl: error: {message}"]


def test_resume_refuses_another_correction_and_takes_old_checkpoints_as_none(tmp_path):
    out = tmp_path / "run"
    run(tmp_path, "run", "--save-every=1")
    argv = ["--preset=demo", f"--out-dir={out}", "--num-steps=2", "--eval-every=-1"]
    argv += ["--examples-per-step=4", "--num-samples=4", "--max-new-tokens=40", "--resume"]
    cfg = flags.parse_config(
        [*argv, "--rollout-correction=tis"], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS
    )
    with pytest.raises(flags.ConfigError, match=r"rollout_correction \('none' -> 'tis'\)"):
        checkpoint.find_resumable(cfg, world=1)
    state_path = out / "step_000002" / "trainer_state.pt"  # a checkpoint from before the flags
    state = torch.load(state_path, weights_only=True)
    for name in ("rollout_correction", "rollout_cap", "dtype"):
        del state["config"][name]
    torch.save(state, state_path)
    cfg = flags.parse_config(argv, chat_rl.HYPERPARAMETERS, chat_rl.PRESETS)
    assert checkpoint.find_resumable(cfg, world=1)[0] == 2


# ---- two ranks: each rank's corrected gradient is one process's over both ranks' rows -----------
def rank_rows(rank):
    sequences, masks, advantages = opts.rank_rows(rank)
    return sequences, masks, advantages, bf16_sampler_logprobs(base.small_model(), sequences, masks)


CAP = 1.004


def _worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    sequences, masks, advantages, q_rows = rank_rows(rank)
    policy, gaps = base.small_model(), []
    chat_rl.policy_gradient_backward(
        policy,
        sequences,
        masks,
        advantages,
        num_samples=NUM_SAMPLES,
        device_batch_size=2,
        loss_norm="all_tokens",
        device="cpu",
        temperature=T,
        options=opts.options(rollout_correction="tis", rollout_cap=CAP),
        sampler_logp=q_rows,
        gaps=gaps,
    )
    chat_rl.sync_gradients(policy)
    row = metrics.gap_row(gaps, 1, torch.device("cpu"))  # summed over both ranks' passes
    torch.save({"grads": base.grads(policy), "gap": row}, f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


def test_on_two_ranks_the_correction_and_the_gap_are_one_process_over_every_row(tmp_path):
    mp.start_processes(
        _worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    results = [torch.load(os.path.join(tmp_path, f"{r}.pt")) for r in range(2)]
    parts = [rank_rows(r) for r in range(2)]
    sequences, masks = parts[0][0] + parts[1][0], parts[0][1] + parts[1][1]
    advantages, q_rows = torch.cat([parts[0][2], parts[1][2]]), parts[0][3] + parts[1][3]
    expected = base.small_model()
    _, past_cap = corrected_written_out(expected, sequences, masks, advantages, q_rows, "tis", CAP)
    assert past_cap > 0
    for result in results:
        base.assert_same_grads(result["grads"], base.grads(expected))
    # the gap's sums and extremes over both ranks: each rank's row the same
    assert results[0]["gap"] == results[1]["gap"]
    inputs, targets = make_batch(sequences, masks, "cpu")
    with torch.no_grad():
        p = base.direct_logp(base.small_model(), inputs, targets, T)
    kept, q = base.kept_rows(advantages), token_values(q_rows, range(len(sequences)), "cpu")
    one = metrics.sampler_gap(p[kept], q[kept], (targets >= 0)[kept], CAP)
    for key, value in metrics.gap_row([one], 1, torch.device("cpu")).items():
        assert results[0]["gap"][key] == pytest.approx(value, rel=1e-4, abs=1e-9), key
