"""torchrun --max-restarts: a rank dies, torchrun restarts the group with the same command line,
and the run continues from its last complete checkpoint by itself to the weights of an
uninterrupted run."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# chat_rl under torchrun; in the first launch, before any restart, rank 1 SIGKILLs itself right
# after the checkpoint of step KILL_AFTER is complete on every rank, as a preempted node would die
RUNNER = r"""
import os, signal, sys
import chat_rl
from plumbing import checkpoint
kill_after = int(os.environ["KILL_AFTER"])
save = checkpoint.save
def hooked(cfg, step, *args, **kwargs):
    save(cfg, step, *args, **kwargs)
    first_launch = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    if step == kill_after and first_launch and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint.save = hooked
sys.exit(chat_rl.main())
"""


def torchrun(tmp_path, out_dir, kill_after, flags):
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    # the demo model: its groups disagree, so every step trains and the weights have somewhere to go
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--max-restarts=1",
        "--nproc_per_node=2",
        str(runner),
        "--preset=demo",
        f"--out-dir={out_dir}",
        "--device-type=cpu",
        "--num-steps=6",
        "--save-every=2",
        "--eval-every=-1",
        "--examples-per-step=4",
        "--num-samples=4",
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "KILL_AFTER": str(kill_after)}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("flags", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_a_group_restarted_after_a_dead_rank_finishes_with_the_uninterrupted_weights(
    tmp_path, flags
):
    whole = torchrun(tmp_path, tmp_path / "whole", kill_after=-1, flags=flags)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = torchrun(tmp_path, tmp_path / "killed", kill_after=2, flags=flags)
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "failed (exitcode: -9) local_rank: 1" in killed.stderr  # rank 1 did die
    assert "steps=2->6" in killed.stdout  # and the restarted group went on from step_000002
    a = load_file(tmp_path / "whole" / "step_000006" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "step_000006" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    start = load_file(os.path.join(REPO, "demo_model", "model.safetensors"))
    assert not all(torch.equal(a[k], start[k]) for k in a)  # and the run did train
