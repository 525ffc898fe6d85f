"""Two CPU ranks (gloo): gradients equal one process's over the union of their groups;
ranks stay in sync."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

import chat_rl
from plumbing.distributed import buckets, sync_gradients
from policy.gpt import GPT, GPTConfig

NUM_SAMPLES, DEVICE_BATCH_SIZE = 2, 3
CONFIG = dict(
    vocab_size=264,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def groups_for(rank, step):
    """Each rank's rollouts at a step:
    rank 0 two groups, rank 1 one live group plus one all-equal group."""
    g = torch.Generator().manual_seed(100 * step + rank)
    n_groups = 2
    seqs, masks = [], []
    for _ in range(n_groups * NUM_SAMPLES):
        prompt_len = int(torch.randint(2, 5, (1,), generator=g))
        completion_len = int(torch.randint(1, 7, (1,), generator=g))
        seqs.append(torch.randint(0, 256, (prompt_len + completion_len,), generator=g).tolist())
        masks.append([0] * prompt_len + [1] * completion_len)
    rewards = (
        torch.tensor([1.0, 0.0, 0.0, 1.0]) if rank == 0 else torch.tensor([1.0, 0.0, 1.0, 1.0])
    )
    return seqs, masks, chat_rl.compute_advantages(rewards, NUM_SAMPLES)


def model_for_test():
    return GPT(GPTConfig(**CONFIG)).init_weights(0)


def _worker(rank, world, init_file, out_dir, dead_rank):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = model_for_test()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        seqs, masks, adv = groups_for(rank, step)
        if rank == dead_rank:
            adv = torch.zeros_like(
                adv
            )  # nothing to learn on this rank: it still joins every collective
        opt.zero_grad(set_to_none=True)
        loss, tokens = chat_rl.policy_gradient_backward(
            model,
            seqs,
            masks,
            adv,
            num_samples=NUM_SAMPLES,
            device_batch_size=DEVICE_BATCH_SIZE,
            loss_norm="kept_tokens",
            device="cpu",
        )
        sync_gradients(model)
        if step == 0:
            torch.save(
                {n: p.grad.clone() for n, p in model.named_parameters()},
                os.path.join(out_dir, f"grad{rank}.pt"),
            )
            torch.save(tokens, os.path.join(out_dir, f"tokens{rank}.pt"))
        chat_rl.optimizer_step(
            model, opt, 1e-2, 0.0, float(loss), tokens
        )  # as train() steps: it may skip the update
    torch.save(
        torch.cat([p.detach().flatten() for p in model.parameters()]),
        os.path.join(out_dir, f"params{rank}.pt"),
    )
    dist.destroy_process_group()


def run_two_ranks(tmp_path, dead_rank=-1):
    mp.start_processes(
        _worker,
        args=(2, str(tmp_path / "init"), str(tmp_path), dead_rank),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    return (
        [torch.load(tmp_path / f"grad{r}.pt") for r in range(2)],
        [torch.load(tmp_path / f"params{r}.pt") for r in range(2)],
        [torch.load(tmp_path / f"tokens{r}.pt") for r in range(2)],
    )


def test_two_rank_gradient_equals_one_process_over_the_union(tmp_path):
    # at --loss-norm=kept_tokens; every normaliser, the default all_tokens among them:
    # test_objective.py's test_two_ranks_sum_to_one_process_over_every_row
    grads, _, tokens = run_two_ranks(tmp_path)
    model = model_for_test()
    union = [groups_for(r, 0) for r in range(2)]
    seqs = union[0][0] + union[1][0]
    masks = union[0][1] + union[1][1]
    adv = torch.cat([union[0][2], union[1][2]])
    _, union_tokens = chat_rl.policy_gradient_backward(
        model,
        seqs,
        masks,
        adv,
        num_samples=NUM_SAMPLES,
        device_batch_size=DEVICE_BATCH_SIZE,
        loss_norm="kept_tokens",
        device="cpu",
    )
    assert tokens == [
        union_tokens,
        union_tokens,
    ]  # every rank reports the kept rows' sampled tokens, all ranks together
    for name, p in model.named_parameters():
        for r in range(2):
            assert torch.allclose(grads[r][name], p.grad, atol=1e-6, rtol=0), name


def test_parameters_stay_identical_on_both_ranks(tmp_path):
    _, params, _ = run_two_ranks(tmp_path)
    assert torch.equal(params[0], params[1])


def test_a_rank_with_no_live_groups_does_not_hang_and_stays_in_sync(tmp_path):
    _, params, _ = run_two_ranks(tmp_path, dead_rank=1)
    assert torch.equal(params[0], params[1])
    assert not torch.equal(
        params[0], torch.cat([p.detach().flatten() for p in model_for_test().parameters()])
    )


# chat_rl under torchrun, recording on each rank the problems of every training rollout and the
# weights each checkpoint is written from
RUNNER = r"""
import json, os, sys
import torch
import chat_rl
from plumbing import checkpoint, evaluation
rank, dump = os.environ["RANK"], os.environ["DUMP_DIR"]
rollout, evaluate, save = chat_rl.rollout, evaluation.evaluate, checkpoint.save
trained_on, evaluating = [], []
def recording_evaluate(*args, **kwargs):
    evaluating.append(True)
    try:
        return evaluate(*args, **kwargs)
    finally:
        evaluating.pop()
def recording_rollout(engine, task, problems, *args, **kwargs):
    if not evaluating:
        trained_on.append([task.prompt(p) for p in problems])
    return rollout(engine, task, problems, *args, **kwargs)
def recording_save(cfg, step, model, *args, **kwargs):
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(weights, os.path.join(dump, f"weights{rank}.pt"))
    return save(cfg, step, model, *args, **kwargs)
chat_rl.rollout, evaluation.evaluate = recording_rollout, recording_evaluate
checkpoint.save = recording_save
code = chat_rl.main()
json.dump(trained_on, open(os.path.join(dump, f"problems{rank}.json"), "w"))
sys.exit(code)
"""


def test_torchrun_two_ranks_train_the_demo_on_their_own_problems_to_identical_weights(tmp_path):
    # the demo model: its groups disagree, so both steps update
    # and the ranks have weights to agree on
    out, runner = tmp_path / "run", tmp_path / "runner.py"
    runner.write_text(RUNNER)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(runner),
        "--preset=demo",
        f"--out-dir={out}",
        "--device-type=cpu",
        "--num-steps=2",
        "--examples-per-step=4",
        "--num-samples=4",
        "--max-new-tokens=40",
        "--eval-every=2",
        "--eval-examples=4",
        "--eval-samples=2",
    ]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo, "DUMP_DIR": str(tmp_path)}
    result = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in rows if "split" not in r]
    assert [r["step"] for r in train] == [0, 1] and all(r["kept_tokens"] > 0 for r in train)
    for r in train:  # means over both ranks' completions
        assert (
            0 <= r["reward"] <= 1
            and 0 <= r["reward_format"] <= 1
            and 0 <= r["truncated"] <= 1
            and 0 < r["seq_len"] <= 40
        )
    assert [r["step"] for r in rows if r.get("split") == "eval"] == [0, 2]
    # each rank its own half of each step's problems
    problems = [json.load(open(tmp_path / f"problems{r}.json")) for r in range(2)]
    for step in range(2):
        mine, theirs = problems[0][step], problems[1][step]
        assert len(mine) == len(theirs) == 2 and not set(mine) & set(theirs)
    assert problems[0][0] != problems[0][1]
    # gradients summed over ranks: one update, the same on both, away from the start
    weights = [torch.load(tmp_path / f"weights{r}.pt") for r in range(2)]
    start = load_file(os.path.join(repo, "demo_model", "model.safetensors"))
    assert weights[0].keys() == weights[1].keys() and all(
        torch.equal(weights[0][k], weights[1][k]) for k in weights[0]
    )
    assert any(not torch.equal(weights[0][k], start[k]) for k in start)
    # and the same run as one process: each problem samples from its own stream, so the rollouts are
    # the same; the gradient sums in another order, and the numbers agree to fp32 rounding
    flags = cmd[cmd.index("--preset=demo") :]
    assert (
        chat_rl.main(
            [
                f if not f.startswith("--out-dir=") else f"--out-dir={tmp_path / 'one'}"
                for f in flags
            ]
        )
        == 0
    )
    alone = [json.loads(line) for line in open(tmp_path / "one" / "metrics.jsonl")]
    for two, one in zip(rows, alone):
        for key in one:
            if key in (
                "rollout_tokens_per_s",
                "step_time_s",
                "eval_time_s",
                "state_mib",
                "peak_mem_gb",
            ):
                continue
            expected = (
                pytest.approx(two[key], rel=1e-4, abs=1e-6)
                if isinstance(two[key], (int, float))
                else two[key]
            )
            assert one[key] == expected, (one["step"], key)
    one, two = (
        load_file(os.path.join(folder, "step_000002", "model.safetensors"))
        for folder in (tmp_path / "one", out)
    )
    # (AdamW's first steps move a weight by about lr whatever its gradient's size, so a gradient
    # near 0 that rounds to the other sign moves it the other way: a few weights apart by a share of
    # one step, the rest alike)
    assert one.keys() == two.keys()
    for k in one:
        apart, moved = (one[k] - two[k]).abs(), (one[k] - start[k]).abs().max()
        assert apart.max() <= 0.05 * moved + 1e-7 and (apart > 1e-6).float().mean() < 1e-3, k


def test_eval_only_writes_one_eval_row_and_no_checkpoint_and_two_ranks_give_one_process_figures(
    tmp_path,
):
    # each held-out problem samples from its own stream (its index in the eval set), so
    # splitting the problems over ranks changes no figure beyond fp32 summation order (the
    # figures are rounded to 4 digits)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = [
        "--preset=demo",
        "--device-type=cpu",
        "--eval-only",
        "--eval-examples=12",
        "--eval-samples=4",
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "chat_rl",
        *flags,
        f"--out-dir={tmp_path / 'two'}",
    ]
    result = subprocess.run(
        cmd,
        cwd=repo,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert chat_rl.main(flags + [f"--out-dir={tmp_path / 'one'}"]) == 0
    rows = {
        name: [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        for name in ("one", "two")
    }
    for row in rows["one"] + rows["two"]:
        assert row.pop("eval_time_s") > 0  # its wall time, the one figure that may differ
    assert [r["split"] for r in rows["one"]] == ["eval"] and rows["one"] == rows["two"]
    assert not any(name.startswith("step_") for name in os.listdir(tmp_path / "one"))


# sync_gradients sums in buckets: one collective for a small model's every gradient, and exactly
# the sums a per-parameter all_reduce gives
FROZEN, NO_GRAD_ON_RANK1 = (
    "model.layers.0.input_layernorm.weight",
    "model.layers.1.self_attn.o_proj.weight",
)


def gradient_for(rank, name, p):
    seed = 1000 * rank + sum(map(ord, name))
    return torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))


def _bucket_worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    calls, all_reduce = [], dist.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted
    out = {}
    for bucket_bytes in (None, 10_000):
        model = model_for_test()
        for name, p in model.named_parameters():
            p.requires_grad_(name != FROZEN)
            if p.requires_grad and not (rank == 1 and name == NO_GRAD_ON_RANK1):
                p.grad = gradient_for(rank, name, p)
        calls.clear()
        sync_gradients(model) if bucket_bytes is None else sync_gradients(model, bucket_bytes)
        out[bucket_bytes] = dict(
            calls=list(calls), grads={n: p.grad for n, p in model.named_parameters()}
        )
    torch.save(out, os.path.join(out_dir, f"buckets{rank}.pt"))
    dist.destroy_process_group()


def test_gradients_are_summed_in_buckets_to_the_per_parameter_sums(tmp_path):
    mp.start_processes(
        _bucket_worker,
        args=(2, str(tmp_path / "init"), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    results = [torch.load(tmp_path / f"buckets{r}.pt") for r in range(2)]
    model = model_for_test()
    trained = [(n, p) for n, p in model.named_parameters() if n != FROZEN]
    for bucket_bytes, calls in ((None, 1), (10_000, None)):
        for r in range(2):
            got = results[r][bucket_bytes]
            if calls is not None:  # a small model's gradients all fit one 25 MB bucket
                assert len(got["calls"]) == calls
            else:  # small buckets: several collectives, fewer than one a parameter
                assert 1 < len(got["calls"]) < len(trained)
            assert sum(got["calls"]) == sum(p.numel() for _, p in trained)  # each element once
            assert got["grads"][FROZEN] is None
            for name, p in trained:
                expected = gradient_for(0, name, p)
                if name != NO_GRAD_ON_RANK1:  # a rank without a gradient sends zeros
                    expected = expected + gradient_for(1, name, p)
                assert torch.equal(got["grads"][name], expected), (bucket_bytes, r, name)


def test_buckets_keep_order_dtype_and_size():
    f32 = [torch.zeros(n) for n in (10, 10, 30, 5)]  # 40, 40, 120, 20 bytes
    b16 = torch.zeros(4, dtype=torch.bfloat16)
    got = buckets([*f32[:2], b16, *f32[2:]], max_bytes=100)
    assert [[t.numel() for t in b] for b in got] == [[10, 10], [4], [30], [5]]
    assert [t for b in got for t in b][2] is b16  # the tensors themselves, in order
