"""A run killed at any moment and resumed ends where an uninterrupted run ends: same metrics, same bits."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from policy.gpt import GPT

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING_KEYS = {"rollout_tokens_per_s", "step_time_s"}  # wall-clock, the only values allowed to differ

# Runs chat_rl.main in a child process that dies (SIGKILL) or is asked to stop (SIGTERM) at a chosen
# moment: after a step's metrics row ("metrics"), or mid-checkpoint after every file is written but
# before the rename that makes it visible ("save").
RUNNER = r"""
import os, signal, sys
import chat_rl
from plumbing import metrics
where, at, sig = sys.argv[1], int(sys.argv[2]), getattr(signal, sys.argv[3])
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
    # the demo's model, not a random one: a random model never earns a reward, so every group would be
    # unanimous, no update would happen, and "the same final weights" would prove nothing
    return os.path.join(REPO, "demo_model")


def args(model_dir, out_dir):
    return ["--preset=demo", f"--model={model_dir}", f"--out-dir={out_dir}", "--num-steps=5", "--examples-per-step=2",
            "--num-samples=4", "--max-new-tokens=40", "--eval-every=2", "--eval-examples=4", "--eval-samples=2",
            "--save-every=1", "--keep-checkpoints=2", "--device-batch-size=3", "--lr=1e-3"]


def launch(argv, where="none", at=-1, sig="SIGKILL"):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-c", RUNNER, where, str(at), sig, *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


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
    # an update at every step, before and after each resume point: what a resumed run must restore (the
    # optimizer's moments, its step count) shows only in the updates it takes after resuming
    rows = metrics(out)
    assert [r["step"] for r in rows if "split" not in r and r["kept_tokens"] > 0] == [0, 1, 2, 3, 4]
    start, end = load_file(os.path.join(model_dir, "model.safetensors")), final_weights(out)
    assert any(not torch.equal(start[k], end[k]) for k in start), "the reference run never updated the weights"
    return rows, end


# resumes_at: the latest complete checkpoint when the kill came (none yet after step 0: step_000001 is
# written after that step's metrics row; a checkpoint killed before its rename does not count)
@pytest.mark.parametrize("where,at,resumes_at", [("metrics", 0, 0), ("metrics", 2, 2), ("save", 3, 2), ("save", 5, 4)],
                         ids=["after-first-step", "mid-run", "mid-checkpoint-write", "mid-final-checkpoint"])
def test_sigkill_then_resume_matches_an_uninterrupted_run(where, at, resumes_at, model_dir, reference, tmp_path):
    out = tmp_path / "run"
    killed = launch(args(model_dir, out), where, at)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not any(d.startswith("step_") and not os.path.exists(out / d / "trainer_state.pt") for d in os.listdir(out))
    resumed = launch(args(model_dir, out) + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f" steps={resumes_at}->5 " in resumed.stdout  # from the latest complete checkpoint, not an older one
    ref_metrics, ref_weights = reference
    assert metrics(out) == ref_metrics
    weights = final_weights(out)
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in weights)


def test_sigterm_stops_at_a_step_boundary_with_a_checkpoint_and_exit_0(model_dir, reference, tmp_path):
    out = tmp_path / "run"
    stopped = launch(args(model_dir, out) + ["--save-every=-1"], "metrics", 1, "SIGTERM")
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert sorted(d for d in os.listdir(out) if d.startswith("step_")) == ["step_000002"]  # steps 0 and 1 done
    resumed = launch(args(model_dir, out) + ["--save-every=-1", "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert metrics(out) == reference[0]


def test_old_checkpoints_are_pruned(model_dir, reference, tmp_path):
    out = tmp_path / "run"
    assert launch(args(model_dir, out)).returncode == 0
    assert sorted(d for d in os.listdir(out) if d.startswith(("step_", ".tmp"))) == ["step_000004", "step_000005"]


def test_a_checkpoint_is_a_folder_the_model_loader_reads(model_dir, reference, tmp_path):
    out = tmp_path / "run"
    assert launch(args(model_dir, out)).returncode == 0
    model = GPT.from_pretrained(str(out / "step_000005"))
    assert all(torch.equal(model.hf_state_dict()[k], v) for k, v in reference[1].items())
