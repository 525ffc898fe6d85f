"""
--fsdp and --activation-checkpointing. Two CPU ranks under gloo (spawned, as in
test_distributed.py): a sharded model's summed gradient equals one process's over the union of
the ranks' groups, also when the ranks run different numbers of micro-batches or one keeps no
rows; the gradient norm is the global one; rollouts all-gather once; the per-rank state is about
half; checkpoints of shards load in transformers and into a replicated run (and back). Then
whole runs under torchrun.
"""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

import chat_rl
from engine import Engine
from plumbing import checkpoint, flags, fsdp
from policy.gpt import GPT, GPTConfig
from policy.tokenizer import ByteTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_SAMPLES = 2
CONFIG = dict(
    vocab_size=264,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)  # tied head, like the demo model and Qwen2.5-0.5B


def model_for_test():
    return GPT(GPTConfig(**CONFIG)).init_weights(0)


def groups_for(rank, live_groups):
    """This rank's rollouts: two groups of two samples, the first `live_groups` of them with a
    reward difference (advantages +-0.5), the others unanimous (skipped before any forward pass)."""
    g = torch.Generator().manual_seed(rank)
    seqs, masks = [], []
    for _ in range(2 * NUM_SAMPLES):
        prompt_len, completion_len = (
            int(torch.randint(2, 5, (1,), generator=g)),
            int(torch.randint(1, 7, (1,), generator=g)),
        )
        seqs.append(torch.randint(0, 256, (prompt_len + completion_len,), generator=g).tolist())
        masks.append([0] * prompt_len + [1] * completion_len)
    rewards = torch.tensor([1.0, 0.0] * live_groups + [1.0, 1.0] * (2 - live_groups))
    return seqs, masks, chat_rl.compute_advantages(rewards, NUM_SAMPLES)


# rank 0 keeps 4 rows, rank 1 2 rows: with one row per micro-batch, 4 passes against 2
LIVE = {"uneven": (2, 1), "one rank idle": (2, 0)}


def gradient(model, rank, live):
    model.zero_grad(set_to_none=True)
    seqs, masks, adv = groups_for(rank, live)
    chat_rl.policy_gradient_backward(
        model,
        seqs,
        masks,
        adv,
        num_samples=NUM_SAMPLES,
        device_batch_size=1,
        loss_norm="kept_tokens",
        device="cpu",
    )
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}


def full(state):
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def _worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    cpu, out = torch.device("cpu"), {}
    model = fsdp.prepare(model_for_test(), cpu, fsdp=True, activation_checkpointing=False)
    recomputing = fsdp.prepare(model_for_test(), cpu, fsdp=True, activation_checkpointing=True)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)  # a checkpoint before the first update
    saved = fsdp.save_optimizer(model, fresh, os.path.join(out_dir, "no optimizer shards"))
    fsdp.restore_optimizer(model, fresh, saved, None)
    out["state before the first update"] = (len(saved["state"]), len(fresh.state))
    for case, live in LIVE.items():
        out[f"grads {case}"] = gradient(model, rank, live[rank])
        out[f"checkpointed grads {case}"] = gradient(recomputing, rank, live[rank])
    out["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer.step()
    out["sharded state bytes"] = fsdp.state_bytes(model, optimizer)
    names = [n for n, _ in model.named_parameters()]
    out["sharded optimizer"] = {
        names[i]: full(s) for i, s in optimizer.state_dict()["state"].items()
    }

    # rollouts: all-gathers counted, ranks decoding different numbers of tokens
    calls, all_gather = [], dist.all_gather_single
    dist.all_gather_single = lambda *a, **k: calls.append(1) or all_gather(*a, **k)
    engine, model = Engine(model.eval(), ByteTokenizer()), model.eval()
    with fsdp.gathered(model):
        gathered = len(calls)
        out["sharded inside"] = isinstance(model.model.layers[0].mlp.gate_up_proj.weight, DTensor)
        engine.generate_batch(
            [[256, 1, 2], [256, 7]], 2, max_new_tokens=8 if rank == 0 else 3, seed=rank
        )
        out["all-gathers"] = (gathered, len(calls) - gathered)
    out["sharded after"] = isinstance(model.model.layers[0].mlp.gate_up_proj.weight, DTensor)
    engine.generate_batch(
        [[256, 1, 2]], 1, max_new_tokens=4, seed=0
    )  # 4 forwards, sharded: for contrast
    out["all-gathers without"] = len(calls) - sum(out["all-gathers"])
    dist.all_gather_single = all_gather

    # checkpoints: the Hugging Face weights from shards, the optimizer shards into a whole model
    # and back
    fsdp.save_weights(model, out_dir, rank)
    # the checkpoint's tensors: the fused Linears split into their parts
    state = full(model.state_dict())
    out["weights"] = {
        name: state[own] if rows is None else state[own][rows]
        for name, own, rows in model.hf_layout()
    }
    fsdp.save_optimizer(model, optimizer, os.path.join(out_dir, "optimizer"))
    whole = model_for_test()
    whole_optimizer = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    fsdp.restore_optimizer(whole, whole_optimizer, None, os.path.join(out_dir, "optimizer"))
    out["shards into whole"] = {
        names[i]: copy.deepcopy(s) for i, s in whole_optimizer.state_dict()["state"].items()
    }
    for p in whole.parameters():
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
    whole_optimizer.step()
    out["whole state bytes"] = fsdp.state_bytes(whole, whole_optimizer)
    out["whole optimizer"] = {names[i]: s for i, s in whole_optimizer.state_dict()["state"].items()}
    resharded = fsdp.prepare(model_for_test(), cpu, fsdp=True, activation_checkpointing=False)
    resharded_optimizer = torch.optim.AdamW(resharded.parameters(), lr=1e-2)
    fsdp.restore_optimizer(resharded, resharded_optimizer, whole_optimizer.state_dict(), None)
    out["whole into shards"] = {
        names[i]: full(s) for i, s in resharded_optimizer.state_dict()["state"].items()
    }
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    mp.start_processes(
        _worker, args=(2, str(tmp / "init"), str(tmp)), nprocs=2, join=True, start_method="spawn"
    )
    return tmp, [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


def reference_gradient(case):
    """One process over the union of both ranks' kept rows."""
    model = model_for_test()
    union = [groups_for(r, LIVE[case][r]) for r in range(2)]
    chat_rl.policy_gradient_backward(
        model,
        union[0][0] + union[1][0],
        union[0][1] + union[1][1],
        torch.cat([union[0][2], union[1][2]]),
        num_samples=NUM_SAMPLES,
        device_batch_size=1,
        loss_norm="kept_tokens",
        device="cpu",
    )
    return model


@pytest.mark.parametrize("case", LIVE)
def test_sharded_gradient_equals_one_process_over_the_union(ranks, case):
    reference = reference_gradient(case)
    for name, p in reference.named_parameters():
        for r in range(2):
            assert torch.allclose(ranks[1][r][f"grads {case}"][name], p.grad, atol=1e-6, rtol=0), (
                name
            )


@pytest.mark.parametrize("case", LIVE)
def test_activation_checkpointing_under_fsdp_gives_the_same_gradient(ranks, case):
    for name, g in ranks[1][0][f"grads {case}"].items():
        assert torch.allclose(
            ranks[1][0][f"checkpointed grads {case}"][name], g, atol=1e-6, rtol=0
        ), name


def test_gradient_norm_of_shards_is_the_global_norm(ranks):
    reference = reference_gradient("one rank idle")
    norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")))
    assert ranks[1][0]["grad_norm"] == ranks[1][1]["grad_norm"] == pytest.approx(norm, rel=1e-6)


def test_rollout_all_gathers_once_per_unit_not_per_forward(ranks):
    for r in range(2):
        out = ranks[1][r]
        assert out["all-gathers"] == (
            3,
            0,
        )  # 2 layers + the root on entry, nothing in 8 (rank 1: 3) decode passes
        assert (out["sharded inside"], out["sharded after"]) == (
            False,
            True,
        )  # full weights inside, shards after
        assert (
            out["all-gathers without"] >= 4 * 2
        )  # without it every forward gathers every layer (4 forwards here)


def test_sharded_state_is_about_half_per_rank(ranks):
    for r in range(2):
        sharded, whole = ranks[1][r]["sharded state bytes"], ranks[1][r]["whole state bytes"]
        ratio = sharded / whole
        print(f"rank {r}: {sharded} of {whole} bytes ({ratio:.3f})")
        assert 0.45 < ratio < 0.55


def test_weights_written_from_shards_load_in_transformers_with_equal_logits(ranks):
    from transformers import AutoModelForCausalLM

    folder, out = ranks
    written = load_file(folder / "model.safetensors")
    assert written.keys() == out[0]["weights"].keys()  # the tied head stored once
    assert all(torch.equal(written[k], out[0]["weights"][k]) for k in written)
    ours, hf = (
        GPT.from_pretrained(str(folder)),
        AutoModelForCausalLM.from_pretrained(str(folder)).eval(),
    )
    idx = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(idx) - hf(idx).logits).abs().max().item()
    assert diff < 1e-5


@pytest.mark.parametrize("direction", ["shards into whole", "whole into shards"])
def test_optimizer_state_moves_between_sharded_and_whole(ranks, direction):
    source = ranks[1][0][
        "sharded optimizer" if direction == "shards into whole" else "whole optimizer"
    ]
    for r in range(2):
        loaded = ranks[1][r][direction]
        assert loaded.keys() == source.keys()
        for name, state in source.items():
            assert all(
                torch.equal(loaded[name][k], state[k]) for k in ("step", "exp_avg", "exp_avg_sq")
            ), name


def test_a_checkpoint_before_the_first_update_keeps_adamw_without_state(ranks):
    # nothing to shard yet; a state made up for the checkpoint would be one AdamW step too many
    assert ranks[1][0]["state before the first update"] == (0, 0)
    assert not (ranks[0] / "no optimizer shards").exists()


def test_activation_checkpointing_gives_the_same_gradient():
    model = model_for_test()
    seqs, masks, adv = groups_for(0, 2)
    chat_rl.policy_gradient_backward(
        model,
        seqs,
        masks,
        adv,
        num_samples=NUM_SAMPLES,
        device_batch_size=4,
        loss_norm="kept_tokens",
        device="cpu",
    )
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.checkpoint_layers = True
    chat_rl.policy_gradient_backward(
        model,
        seqs,
        masks,
        adv,
        num_samples=NUM_SAMPLES,
        device_batch_size=4,
        loss_norm="kept_tokens",
        device="cpu",
    )
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, plain[n], atol=1e-6, rtol=0), n


def test_activation_checkpointing_stays_off_outside_training():
    model = model_for_test()
    model.checkpoint_layers = True
    idx = torch.randint(0, 256, (1, 8))
    with torch.no_grad():  # nothing to recompute for: the plain forward
        assert torch.equal(model(idx), GPT(GPTConfig(**CONFIG)).init_weights(0)(idx))


# ---- start(): the policy each rank builds under --fsdp -------------------------------------------
def _start_worker(rank, world, init_file, out_dir):
    """plumbing/start.start under --fsdp on two gloo ranks, the demo model: the parameter bytes
    each rank held in host memory before sharding (fsdp.prepare's input), and its weights after."""
    from plumbing import start

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    held, prepare = [], fsdp.prepare

    def counting(model, *args, **kwargs):
        held.append(sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta))
        return prepare(model, *args, **kwargs)

    fsdp.prepare = counting
    argv = [*ARGS, "--fsdp", f"--out-dir={os.path.join(out_dir, 'run')}"]
    cfg = flags.parse_config(argv, chat_rl.HYPERPARAMETERS, chat_rl.PRESETS)
    flags.check_config(cfg, world)
    model = start.start(cfg, rank, world, torch.device("cpu")).model
    weights = full({n: p.detach() for n, p in model.named_parameters()})
    out = dict(held=held, weights=weights, inv_freq=model.inv_freq.clone())
    torch.save(out, os.path.join(out_dir, f"start{rank}.pt"))
    dist.destroy_process_group()


def test_under_fsdp_only_rank_0_holds_the_whole_model_and_every_rank_starts_from_its_weights(
    tmp_path,
):
    mp.start_processes(
        _start_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
        start_method="spawn",
    )  # fmt: skip
    ranks = [torch.load(tmp_path / f"start{r}.pt", weights_only=False) for r in range(2)]
    demo, _ = checkpoint.load_policy("demo_model", "cpu")
    whole = sum(p.numel() * p.element_size() for p in demo.parameters())
    # 8 ranks of a 7B model would each read 30 GB into the node's memory; rank 1 reads nothing
    assert [r["held"] for r in ranks] == [[whole], [0]]
    for r in ranks:
        assert r["weights"].keys() == dict(demo.named_parameters()).keys()
        for name, p in demo.named_parameters():
            assert torch.equal(r["weights"][name], p.detach()), name
        assert torch.equal(r["inv_freq"], demo.inv_freq)


# ---- whole runs: torchrun, 2 CPU ranks, the demo model (its groups disagree: each step trains) ---
# wall-clock, the only values allowed to differ
TIMING_KEYS = {"rollout_tokens_per_s", "step_time_s", "eval_time_s"}
ARGS = [
    "--preset=demo",
    "--device-type=cpu",
    "--num-steps=4",
    "--examples-per-step=4",
    "--num-samples=4",
    "--save-every=2",
    "--eval-every=2",
    "--eval-examples=4",
    "--eval-samples=2",
]

# chat_rl under torchrun; rank 1 SIGKILLs itself when the train row of step KILL_AT is logged
# (every rank calls MetricsLog.write; only rank 0 writes), as a node that dies mid-run
RUNNER = r"""
import os, signal, sys
import chat_rl
from plumbing import metrics
kill_at, write = int(os.environ["KILL_AT"]), metrics.MetricsLog.write
def hooked(self, row, samples=()):
    write(self, row, samples)
    if row["step"] == kill_at and "split" not in row and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
metrics.MetricsLog.write = hooked
sys.exit(chat_rl.main())
"""


def torchrun(out_dir, *flags, kill_at=-1):
    runner = os.path.join(os.path.dirname(out_dir), "runner.py")
    with open(runner, "w") as f:
        f.write(RUNNER)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        runner,
        *ARGS,
        f"--out-dir={out_dir}",
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "KILL_AT": str(kill_at)}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def metrics(out_dir):
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def weights(out_dir, step=4):
    return load_file(os.path.join(out_dir, f"step_{step:06d}", "model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Uninterrupted 4-step runs, replicated and sharded."""
    out = {}
    for kind, extra in (("ddp", []), ("fsdp", ["--fsdp"])):
        out[kind] = tmp_path_factory.mktemp(kind) / "run"
        result = torchrun(out[kind], *extra)
        assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_fsdp_run_ends_where_the_replicated_run_ends(runs):
    a, b = weights(runs["ddp"]), weights(runs["fsdp"])
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"max |ddp - fsdp| after 4 steps: {diff:.1e}")
    assert a.keys() == b.keys() and diff < 1e-5
    ddp, sharded = metrics(runs["ddp"]), metrics(runs["fsdp"])
    assert [r["step"] for r in ddp] == [r["step"] for r in sharded]
    assert all(
        r["reward"] == s["reward"] for r, s in zip(ddp, sharded) if "reward" in r
    )  # the same samples
    replicated, per_shard = (
        next(r["state_mib"] for r in reversed(m) if "state_mib" in r) for m in (ddp, sharded)
    )
    print(
        f"rank 0 weights + grads + AdamW: {replicated:.3f} MiB replicated, "
        f"{per_shard:.3f} MiB sharded"
    )
    assert 0.45 < per_shard / replicated < 0.55


def test_fsdp_run_checkpoint_loads_in_transformers_with_equal_logits(runs):
    from transformers import AutoModelForCausalLM

    folder = str(runs["fsdp"] / "step_000004")
    ours, hf = GPT.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder).eval()
    idx = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # fp32 through two implementations: logits of size ~10 agree to a few of their last bits
        torch.testing.assert_close(ours(idx), hf(idx).logits, rtol=1e-5, atol=1e-5)


def test_fsdp_sigkill_then_resume_matches_the_uninterrupted_run(runs, tmp_path):
    out = tmp_path / "run"
    killed = torchrun(out, "--fsdp", kill_at=2)
    assert killed.returncode != 0 and "exitcode: -9" in killed.stderr, killed.stderr[-3000:]
    assert sorted(d for d in os.listdir(out) if d.startswith("step_")) == ["step_000002"]
    resumed = torchrun(out, "--fsdp", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "steps=2->4" in resumed.stdout
    assert metrics(out) == metrics(runs["fsdp"])
    a, b = weights(out), weights(runs["fsdp"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "source,flags", [("ddp", ["--fsdp"]), ("fsdp", [])], ids=["ddp-to-fsdp", "fsdp-to-ddp"]
)
def test_a_checkpoint_resumes_with_the_other_kind_of_run(runs, tmp_path, source, flags):
    out = tmp_path / "run"
    subprocess.run(["cp", "-r", str(runs[source]), str(out)], check=True)
    subprocess.run(["rm", "-r", str(out / "step_000004")], check=True)
    resumed = torchrun(out, "--resume", *flags)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = weights(out), weights(runs[source])
    assert (
        max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    )  # sums in another order: close, not equal


def test_a_sharded_checkpoint_without_its_optimizer_shards_is_refused_in_one_line(runs, tmp_path):
    out = tmp_path / "run"
    subprocess.run(["cp", "-r", str(runs["fsdp"]), str(out)], check=True)
    os.remove(
        out / "step_000004" / "optimizer" / ".metadata"
    )  # as if only the weights had been copied over
    cfg = flags.parse_config(
        [*ARGS, f"--out-dir={out}", "--fsdp", "--resume"], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS
    )
    with pytest.raises(
        flags.ConfigError, match="optimizer/ folder of per-rank shards .* is missing"
    ):
        checkpoint.find_resumable(cfg, 2)
