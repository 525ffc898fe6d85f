"""A run killed at any moment and resumed ends where an uninterrupted run ends: same metrics, same
bits. A run asked to stop (SIGTERM, SIGINT) mid-rollout, mid-eval or mid-backward-pass leaves that
step at once, on every rank."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from policy.gpt import GPT

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING_KEYS = {
    "rollout_tokens_per_s",
    "step_time_s",
    "eval_time_s",
}  # wall-clock, the only values allowed to differ

# Runs chat_rl.main in a child process that dies (SIGKILL) or is asked to stop (SIGTERM, SIGINT) at
# a chosen moment: after a step's metrics row ("metrics"); mid-checkpoint, every file written but
# not the rename that makes it visible ("save"); or mid-work: at the 3rd position decoded in step
# `at`'s rollout ("rollout"), in the first --refill round from step `at` on ("refill") or in the
# at-th eval, from 0 ("eval"), in the last layer's backward
# pass of step `at` ("backward"), or after step `at`'s first update of several ("update").
# Mid-work it prints, as it exits, when the signal was sent and how
# many decoder layers' forward or backward passes still ended after it. STOP_RANK: the one rank that
# is sent the signal (torchrun); AGAIN_AFTER: the signal again that many seconds later, from
# another thread, while the checkpoint is written (3 s).
RUNNER = r"""
import atexit, os, signal, sys, threading, time
import chat_rl, engine
from plumbing import checkpoint, evaluation, metrics, refill
from policy import gpt
where, at, sig = sys.argv[1], int(sys.argv[2]), getattr(signal, sys.argv[3])
state = dict(phase=None, decoded=0, evals=-1, sent=None, after=0)
def send():
    rank = os.environ.get("RANK", "0")
    if state["sent"] is None and os.environ.get("STOP_RANK", rank) == rank:
        state["sent"] = time.monotonic()
        if "AGAIN_AFTER" in os.environ:
            threading.Timer(float(os.environ["AGAIN_AFTER"]), os.kill, (os.getpid(), sig)).start()
        os.kill(os.getpid(), sig)
if "AGAIN_AFTER" in os.environ:
    save = checkpoint.save
    checkpoint.save = lambda *args, **kwargs: time.sleep(3) or save(*args, **kwargs)
def counted(function):  # a layer's forward or backward pass, counted if it ends after the signal
    def wrapper(*args, **kwargs):
        result = function(*args, **kwargs)
        state["after"] += state["sent"] is not None
        return result
    return wrapper
if where in ("rollout", "refill", "eval", "backward", "update"):
    problems_for_step, evaluate = chat_rl.problems_for_step, evaluation.evaluate
    optimizer_step = chat_rl.optimizer_step
    next_logits, backward = engine.next_logits, gpt.SwiGLU.backward
    def step_starts(rows, step, *args):
        state.update(phase=("rollout", step), decoded=0)
        return problems_for_step(rows, step, *args)
    def eval_starts(*args, **kwargs):
        state.update(phase=("eval", state["evals"] + 1), evals=state["evals"] + 1, decoded=0)
        return evaluate(*args, **kwargs)
    def decoding(*args):
        state["decoded"] += state["phase"] == (where, at)
        if state["decoded"] == 3:
            send()
        return next_logits(*args)
    def backward_pass(ctx, grad):
        if where == "backward" and state["phase"] == ("rollout", at):
            send()
        return backward(ctx, grad)
    def update(*args):
        result = optimizer_step(*args)
        if where == "update" and state["phase"] == ("rollout", at):
            send()
        return result
    refill_round = refill.refill_round
    def refill_starts(rollout, setup, cfg, step, *args):
        if step >= at and state["sent"] is None:
            state.update(phase=("refill", at), decoded=0)
        return refill_round(rollout, setup, cfg, step, *args)
    chat_rl.problems_for_step, evaluation.evaluate = step_starts, eval_starts
    refill.refill_round = refill_starts
    chat_rl.optimizer_step = update
    engine.next_logits, gpt.SwiGLU.backward = decoding, staticmethod(counted(backward_pass))
    gpt.Block.forward = counted(gpt.Block.forward)
    atexit.register(lambda: print(f"signal sent at {state['sent']}; "
                                  f"layer passes after it: {state['after']}", file=sys.stderr))
if where == "metrics":
    write = metrics.MetricsLog.write
    def hooked(self, row, samples=()):
        write(self, row, samples)
        if row["step"] == at and "split" not in row:
            os.kill(os.getpid(), sig)
    metrics.MetricsLog.write = hooked
elif where == "save":
    replace = os.replace
    def hooked(src, dst):
        if dst.endswith(f"step_{at:06d}"):
            os.kill(os.getpid(), sig)
        replace(src, dst)
    os.replace = hooked
sys.exit(chat_rl.main(sys.argv[4:]))
"""


@pytest.fixture(scope="module")
def model_dir():
    # the demo's model, not a random one: a random model never earns a reward, so every group would
    # be unanimous, no update would happen, and "the same final weights" would prove nothing
    return os.path.join(REPO, "demo_model")


def args(model_dir, out_dir):
    return [
        "--preset=demo",
        f"--model={model_dir}",
        f"--out-dir={out_dir}",
        "--num-steps=5",
        "--examples-per-step=2",
        "--num-samples=4",
        "--max-new-tokens=40",
        "--eval-every=2",
        "--eval-examples=4",
        "--eval-samples=2",
        "--save-every=1",
        "--keep-checkpoints=2",
        "--device-batch-size=3",
        "--lr=1e-3",
    ]


def launch(argv, where="none", at=-1, sig="SIGKILL", **environ):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, **environ}
    return subprocess.run(
        [sys.executable, "-c", RUNNER, where, str(at), sig, *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def signal_to_exit(result, exited):
    """(seconds from the signal to the process's end, layer passes that ended after the signal)."""
    sent, after = result.stderr.rsplit("signal sent at ", 1)[1].split("; layer passes after it: ")
    return exited - float(sent), int(after.split()[0])


def metrics(out_dir):
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def final_weights(out_dir):
    return load_file(os.path.join(out_dir, "step_000005", "model.safetensors"))


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    result = launch(args(model_dir, out))
    assert result.returncode == 0, result.stderr[-2000:]
    # an update at every step, before and after each resume point: what a resumed run must restore
    # (the optimizer's moments, its step count) shows only in the updates it takes after resuming
    rows = metrics(out)
    assert [r["step"] for r in rows if "split" not in r and r["kept_tokens"] > 0] == [0, 1, 2, 3, 4]
    start, end = load_file(os.path.join(model_dir, "model.safetensors")), final_weights(out)
    assert any(not torch.equal(start[k], end[k]) for k in start), (
        "the reference run never updated the weights"
    )
    return rows, end


# resumes_at: the latest complete checkpoint when the kill came (none yet after step 0:
# step_000001 is written after that step's metrics row; a checkpoint killed before its rename does
# not count)
@pytest.mark.parametrize(
    "where,at,resumes_at",
    [("metrics", 0, 0), ("metrics", 2, 2), ("save", 3, 2), ("save", 5, 4)],
    ids=["after-first-step", "mid-run", "mid-checkpoint-write", "mid-final-checkpoint"],
)
def test_sigkill_then_resume_matches_an_uninterrupted_run(
    where, at, resumes_at, model_dir, reference, tmp_path
):
    out = tmp_path / "run"
    killed = launch(args(model_dir, out), where, at)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not any(
        d.startswith("step_") and not os.path.exists(out / d / "trainer_state.pt")
        for d in os.listdir(out)
    )
    resumed = launch(args(model_dir, out) + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (
        f" steps={resumes_at}->5 " in resumed.stdout
    )  # from the latest complete checkpoint, not an older one
    ref_metrics, ref_weights = reference
    assert metrics(out) == ref_metrics
    weights = final_weights(out)
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in weights)


def test_sigterm_stops_at_a_step_boundary_with_a_checkpoint_and_exit_0(
    model_dir, reference, tmp_path
):
    out = tmp_path / "run"
    stopped = launch(args(model_dir, out) + ["--save-every=-1"], "metrics", 1, "SIGTERM")
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert sorted(d for d in os.listdir(out) if d.startswith("step_")) == [
        "step_000002"
    ]  # steps 0 and 1 done
    resumed = launch(args(model_dir, out) + ["--save-every=-1", "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert metrics(out) == reference[0]


# the step under way is left at once: no decoder layer ends a forward or backward pass after the
# signal; the checkpoint of the last finished step (step 1: step_000002) is kept or written; exit 0
@pytest.mark.parametrize(
    "where, at, save_every",
    [("rollout", 2, -1), ("eval", 1, 1), ("backward", 2, -1)],
    ids=["mid-rollout-writes-it", "mid-eval-keeps-it", "mid-backward-pass"],
)
def test_a_stop_mid_step_leaves_it_at_once_and_resumes_bit_for_bit(
    where, at, save_every, model_dir, reference, tmp_path
):
    out = tmp_path / "run"
    stopped = launch(args(model_dir, out) + [f"--save-every={save_every}"], where, at, "SIGTERM")
    seconds, after = signal_to_exit(stopped, time.monotonic())
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert after == 0 and seconds < STOP_BOUND_S, (after, seconds)
    assert max(d for d in os.listdir(out) if d.startswith("step_")) == "step_000002"
    assert "stopped at step 2/5" in stopped.stdout and "checkpoint in" in stopped.stdout
    resumed = launch(args(model_dir, out) + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert " steps=2->5 " in resumed.stdout
    assert metrics(out) == reference[0]
    assert all(torch.equal(final_weights(out)[k], v) for k, v in reference[1].items())


STOP_BOUND_S = 10  # signal to exit, checkpoint included: 0.5-1 s measured on a busy 2-core CPU


def test_a_repeat_within_a_second_is_one_stop_and_a_later_one_kills_at_once(model_dir, tmp_path):
    # torchrun forwards a Ctrl-C its workers already got from the terminal: it must not kill them
    soon, later = (
        launch(
            args(model_dir, tmp_path / str(delay)) + ["--save-every=-1"],
            "rollout",
            2,
            "SIGINT",
            AGAIN_AFTER=str(delay),
        )
        for delay in (0.1, 2.0)
    )
    assert soon.returncode == 0, soon.stderr[-2000:]
    assert os.path.isdir(tmp_path / "0.1" / "step_000002")
    assert later.returncode == -2, later.stderr[-2000:]  # died of the second, mid-checkpoint
    assert not os.path.exists(tmp_path / "2.0" / "step_000002")


def two_ranks(tmp_path, argv, stop=(), timeout=300):
    """torchrun --nproc_per_node=2 on this CPU: chat_rl with argv, or, given stop (where, at, sig),
    RUNNER sending that stop to rank 0 alone."""
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "STOP_RANK": "0"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    program = [str(runner), *map(str, stop)] if stop else ["-m", "chat_rl"]
    return subprocess.run(
        [*torchrun, *program, *argv], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def test_a_stop_sent_to_one_rank_stops_both_at_one_step_and_resumes(model_dir, reference, tmp_path):
    # rank 1 is never signalled and ends its rollout; the ranks agree after it and both leave step 2
    out = tmp_path / "run"
    two = [*args(model_dir, out), "--examples-per-step=2", "--save-every=-1"]
    stopped = two_ranks(tmp_path, two, stop=("rollout", 2, "SIGTERM"))
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    # rank 0 left its rollout at once; rank 1, never signalled, sent nothing
    assert stopped.stderr.count("layer passes after it: 0") == 2
    assert stopped.stderr.count("signal sent at None") == 1
    assert sorted(d for d in os.listdir(out) if d.startswith("step_")) == ["step_000002"]
    resumed = two_ranks(tmp_path, [*two, "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows, steps = metrics(out), lambda rows: [(r["step"], r.get("split")) for r in rows]
    assert steps(rows) == steps(reference[0])
    for ours, one_process in zip(rows, reference[0]):  # each problem samples from its own stream
        for key in {"reward", "seq_len", "kept_tokens", "pass@1", "greedy"} & set(one_process):
            assert ours[key] == pytest.approx(one_process[key], rel=1e-5), key


def test_a_stop_mid_refill_on_one_rank_stops_both_and_resumes(model_dir, tmp_path):
    # --refill samples its rounds between collectives (the rounds' signal, summed over ranks): a
    # stop leaves a round's sampling at once and every rank agrees after it, not a rank leaving
    # while its peer waits in the sum (a hang) or reading what the left round never returned
    out = tmp_path / "run"
    # 2 samples a problem: a group is unanimous half the time, so steps refill
    refill = [*args(model_dir, out), "--num-samples=2", "--refill=4", "--save-every=1"]
    stopped = two_ranks(tmp_path, refill, stop=("refill", 1, "SIGTERM"), timeout=120)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert stopped.stderr.count("layer passes after it: 0") == 2  # rank 0 left the round at once
    assert stopped.stderr.count("signal sent at None") == 1  # rank 1 was never signalled
    rows = metrics(out)
    last = max(r["step"] for r in rows if "split" not in r)  # the step the stop left unfinished
    saved = sorted(d for d in os.listdir(out) if d.startswith("step_"))
    assert saved[-1] == f"step_{last + 1:06d}" and last + 1 < 5
    resumed = two_ranks(tmp_path, [*refill, "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in metrics(out) if "split" not in r] == list(range(5))


# --kl-beta's reference is the starting model, and --ppo-epochs updates more than once a step
OBJECTIVE = ["--kl-beta=0.05", "--ppo-epochs=2"]


@pytest.fixture(scope="module")
def objective_reference(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("objective_reference")
    result = launch(args(model_dir, out) + OBJECTIVE)
    assert result.returncode == 0, result.stderr[-2000:]
    train = [r for r in metrics(out) if "split" not in r]
    assert all(r["kl"] > 0 for r in train[1:]) and any(r["clip_frac"] > 0 for r in train)
    return metrics(out), final_weights(out)


def test_a_resumed_run_keeps_the_starting_model_as_its_kl_reference(
    model_dir, objective_reference, tmp_path
):
    # killed after step 2's row, resumed from step_000002: a reference loaded from that checkpoint
    # would put step 2's kl near 0 (the policy is the checkpoint), not where it is unstopped
    out = tmp_path / "run"
    assert launch(args(model_dir, out) + OBJECTIVE, "metrics", 2).returncode == -9
    resumed = launch(args(model_dir, out) + OBJECTIVE + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert " steps=2->5 " in resumed.stdout
    assert metrics(out) == objective_reference[0]
    assert all(torch.equal(final_weights(out)[k], v) for k, v in objective_reference[1].items())


def test_a_stop_after_a_steps_first_update_finishes_its_epochs_and_resumes_bit_for_bit(
    model_dir, objective_reference, tmp_path
):
    # the weights have moved: leaving now would save half a step as step 2's end; epoch 1 runs on
    out = tmp_path / "run"
    stopped = launch(args(model_dir, out) + OBJECTIVE + ["--save-every=-1"], "update", 2, "SIGTERM")
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert "stopped at step 3/5" in stopped.stdout
    assert sorted(d for d in os.listdir(out) if d.startswith("step_")) == ["step_000003"]
    resumed = launch(args(model_dir, out) + OBJECTIVE + ["--save-every=-1", "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert metrics(out) == objective_reference[0]
    assert all(torch.equal(final_weights(out)[k], v) for k, v in objective_reference[1].items())


def test_old_checkpoints_are_pruned(model_dir, reference, tmp_path):
    out = tmp_path / "run"
    assert launch(args(model_dir, out)).returncode == 0
    assert sorted(d for d in os.listdir(out) if d.startswith(("step_", ".tmp"))) == [
        "step_000004",
        "step_000005",
    ]


def test_a_checkpoint_is_a_folder_the_model_loader_reads(model_dir, reference, tmp_path):
    out = tmp_path / "run"
    assert launch(args(model_dir, out)).returncode == 0
    model = GPT.from_pretrained(str(out / "step_000005"))
    assert all(torch.equal(model.hf_state_dict()[k], v) for k, v in reference[1].items())


# bf16 (sampler and trainer each rounding their own way) with the rollout correction acting on it
BF16 = ["--dtype=bf16", "--rollout-correction=tis", "--rollout-cap=1.02"]


def test_a_bf16_run_with_the_rollout_correction_resumes_bit_for_bit(model_dir, tmp_path):
    whole = tmp_path / "whole"
    assert launch(args(model_dir, whole) + BF16).returncode == 0
    train = [r for r in metrics(whole) if "split" not in r]
    assert all(r["mismatch_k3"] > 0 for r in train) and any(r["mismatch_past_cap"] for r in train)
    out = tmp_path / "run"
    assert launch(args(model_dir, out) + BF16, "metrics", 2).returncode == -9
    resumed = launch(args(model_dir, out) + BF16 + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert " dtype=bf16 (as given) steps=2->5 " in resumed.stdout
    assert metrics(out) == metrics(whole)
    assert all(torch.equal(final_weights(out)[k], v) for k, v in final_weights(whole).items())
