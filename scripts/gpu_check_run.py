"""
gpu_check's run check: python -m chat_rl itself, launched as a user launches it (a subprocess, then
--resume, then torchrun on two visible GPUs), on the check's model shape with random weights. The
in-process checks of the training pass are in scripts/gpu_check_training.py; this one sees what
only a whole run shows: the command line, checkpoints, the process group as torchrun builds it,
and a step's peak memory against plumbing/memory.plan's.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

import chat_rl
from plumbing import flags
from policy.gpt import GPT, GPTConfig

# a reward a random model's replies earn now and then (their length's parity), so that groups carry
# signal and the step trains
RUN_REWARD = "def reward(completion, row):\n    return float(len(completion) % 2)\n"


def check_run(s):
    """
    chat_rl itself, launched as a user launches it, on the check's model shape with random weights
    (saved as a folder, with the byte tokenizer) and examples/' rows: the default --tool (the
    calculator: the host reads which rows called at every position), --max-new-tokens=768 (the
    KV cache a run holds; 24 with --quick), --activation-checkpointing, a checkpoint a step; then
    the last checkpoint removed and the run resumed from the first; on two visible GPUs one step
    under torchrun (NCCL's group as torchrun builds it). Reports a step's time in its parts and
    its peak memory against plumbing/memory.plan's for the same flags. Its folder (the model and
    checkpoints with AdamW's state: GBs at 0.5B) goes whatever happens.
    """
    folder = tempfile.mkdtemp(prefix="gpu_check_run_")
    try:
        note = run_chat_rl(s, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"  {note}", flush=True)
    return "pass", note


def run_chat_rl(s, folder):
    """check_run's launches in `folder`: its note, or an error."""
    from plumbing import memory
    from policy.tokenizer import ByteTokenizer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model_dir, out = os.path.join(folder, "model"), os.path.join(folder, "run")
    # a Qwen2.5 folder: --quick's tiny shape has Qwen3's q/k norms beside the qkv bias, which no
    # checkpoint family has
    config = {**s.config, "qk_norm": False}
    same = GPTConfig(**config) == GPTConfig(**s.config)
    model = s.model() if same else GPT(GPTConfig(**config)).init_weights(0)
    model.save_pretrained(model_dir)
    ByteTokenizer().save_pretrained(model_dir)
    with open(os.path.join(folder, "reward.py"), "w") as f:
        f.write(RUN_REWARD)
    problems, samples = 4, 8  # a step's rows: problems x samples
    argv = [
        f"--model={model_dir}", f"--out-dir={out}", f"--device-type={s.device.type}",
        "--data=examples/train.jsonl", "--prompt-column=problem", "--answer-column=target",
        f"--reward={os.path.join(folder, 'reward.py')}:reward", "--eval-every=-1",
        "--num-steps=2", "--save-every=1", f"--examples-per-step={problems}",
        f"--num-samples={samples}",
        f"--max-new-tokens={24 if s.quick else 768}", "--activation-checkpointing",
    ] + ([] if s.cuda else ["--dtype=bf16"])  # fmt: skip

    def launch(*command, seconds=600):
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True,
                              timeout=seconds)  # fmt: skip
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or [""]
            raise RuntimeError(f"{' '.join(command[:3])} exited {done.returncode}: {lines[-1]}")

    def train_rows():
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [row for row in map(json.loads, f) if "split" not in row]

    launch(sys.executable, "-m", "chat_rl", *argv)
    first = train_rows()
    assert [r["step"] for r in first] == [0, 1], first
    assert all(r["kept_tokens"] > 0 for r in first), "a step trained nothing"
    shutil.rmtree(os.path.join(out, "step_000002"))  # resume from step 1's checkpoint
    launch(sys.executable, "-m", "chat_rl", *argv, "--resume")
    resumed = train_rows()
    assert [r["step"] for r in resumed] == [0, 1], resumed
    repeated = resumed[1]["reward"] == first[1]["reward"]
    note = f"2 steps, resumed from step 1 ({'the same' if repeated else 'another'} step-1 reward)"
    if s.cuda and torch.cuda.device_count() >= 2:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launch(*torchrun, "--nproc_per_node=2", "-m", "chat_rl", *argv,
               f"--out-dir={out}-2ranks", "--num-steps=1")  # fmt: skip
        note += "; 1 step on 2 GPUs under torchrun"
    row = first[1]
    rollout_s = row["seq_len"] * problems * samples / row["rollout_tokens_per_s"]
    note += (
        f"; step 1: {row['step_time_s']:.1f} s, rollout {rollout_s:.1f} s "
        f"({row['rollout_tokens_per_s']:,.0f} tok/s, {row['seq_len']:.0f} tokens a reply), "
        f"update {row['step_time_s'] - rollout_s:.1f} s"
    )
    if "peak_mem_gb" in row:  # CUDA's, this step's own, GiB
        cfg = flags.parse_config(argv, chat_rl.HYPERPARAMETERS, chat_rl.PRESETS)
        # examples/' longest prompt is 112 tokens of the byte tokenizer, its chat template in
        plan = memory.plan(GPTConfig(**config), cfg, world=1, prompt_tokens=112).peaks
        planned = max(plan["rollout"], plan["training, --activation-checkpointing"]) / 2**30
        note += f"; peak {row['peak_mem_gb']:.1f} GiB, planned {planned:.1f} GiB"
    return note
