"""torchrun --max-restarts: a rank dies, torchrun restarts the group with the same command line, and
the run continues from its last complete checkpoint by itself to the weights of an uninterrupted run."""

import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

from gpt import GPT, GPTConfig
from tokenizer import ByteTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# chat_rl under torchrun; in the first round (no restart yet) rank 1 SIGKILLs itself right after the
# checkpoint of step KILL_AFTER is complete on every rank, as a preempted node would die
RUNNER = r"""
import os, signal, sys
import checkpoint, chat_rl
kill_after = int(os.environ["KILL_AFTER"])
save = checkpoint.save
def hooked(cfg, step, *args, **kwargs):
    save(cfg, step, *args, **kwargs)
    if step == kill_after and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint.save = hooked
sys.exit(chat_rl.main())
"""


def torchrun(tmp_path, out_dir, model_dir, kill_after):
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts=1", "--nproc_per_node=2",
           str(runner), "--preset=demo", f"--model={model_dir}", f"--out-dir={out_dir}", "--device-type=cpu",
           "--num-steps=6", "--save-every=2", "--eval-every=-1", "--examples-per-step=4", "--num-samples=4",
           "--max-new-tokens=8", "--lr=0.01"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "KILL_AFTER": str(kill_after)}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_a_group_restarted_after_a_dead_rank_finishes_with_the_uninterrupted_weights(tmp_path):
    model_dir = tmp_path / "model"
    GPT(GPTConfig(vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)).init_weights(0).save_pretrained(str(model_dir))
    ByteTokenizer().save_pretrained(str(model_dir))
    whole = torchrun(tmp_path, tmp_path / "whole", model_dir, kill_after=-1)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = torchrun(tmp_path, tmp_path / "killed", model_dir, kill_after=2)
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "failed (exitcode: -9) local_rank: 1" in killed.stderr  # rank 1 did die
    assert "steps=2->6" in killed.stdout  # and the restarted group went on from step_000002
    a = load_file(tmp_path / "whole" / "step_000006" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "step_000006" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
