"""
Benchmark of whole RL steps (rollout + reward + backward + AdamW) on a model of a real shape with
random weights, so it needs no download. Prints a table of step time, rollout tokens/s and peak memory.

    python -m tools.bench_rl_step --shape=qwen2.5-0.5b --device-type=cuda   # 16 prompts x 16 samples x 256 tokens, bf16
    python -m tools.bench_rl_step --shape=demo --device-type=cpu

The model's weights are random and its tokenizer is the byte tokenizer: sampling covers those 261
columns (the sampler's softmax over a real 152k vocabulary is a small share of a decode step; the
lm_head projection onto all 152k rows is paid in full). A random model rarely samples the stop
token, so completions run long, and its answers are never right, so every group would be skipped:
the verifier is replaced by a deterministic coin flip so that every step also trains on its rows.
"""

import argparse
import hashlib
import json
import os
import shutil
import tempfile

import torch

import chat_rl
from tools import make_demo_model
from gpt import GPT, GPTConfig
from tasks import arith
from tokenizer import ByteTokenizer

SHAPES = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, attention_bias=True, tie_word_embeddings=True,
                         rope_theta=1e6, max_position_embeddings=32768, rms_norm_eps=1e-6),
    "demo": make_demo_model.CONFIG,
}


def coin_flip_grade(completion, reference):
    return hashlib.sha256(completion.encode()).digest()[0] % 2 == 0


def main():
    p = argparse.ArgumentParser(description="time whole RL steps")
    p.add_argument("--shape", default="demo", choices=sorted(SHAPES))
    p.add_argument("--device-type", default="")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--device-batch-size", type=int, default=16)
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="bench_rl_")
    model_dir, out_dir = os.path.join(work, "model"), os.path.join(work, "run")
    model = GPT(GPTConfig(**SHAPES[args.shape])).init_weights(0)
    num_params = model.num_params()
    model.save_pretrained(model_dir)
    del model
    ByteTokenizer().save_pretrained(model_dir)
    arith.grade = coin_flip_grade
    code = chat_rl.main([f"--model={model_dir}", "--task=arith", f"--out-dir={out_dir}", f"--device-type={args.device_type}",
                         f"--num-steps={args.steps}", f"--examples-per-step={args.prompts}", f"--num-samples={args.samples}",
                         f"--max-new-tokens={args.max_new_tokens}", f"--device-batch-size={args.device_batch_size}",
                         "--eval-every=-1", "--lr=1e-6", "--generate-batch-rows=256"])
    assert code == 0, f"chat_rl exited {code}"
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    shutil.rmtree(work)  # the random model and its final checkpoint: gigabytes for a real shape
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device_type != "cpu" else "cpu"
    print(f"\nshape={args.shape} params={num_params / 1e6:.0f}M device={device} torch={torch.__version__} "
          f"{args.prompts} prompts x {args.samples} samples x {args.max_new_tokens} tokens")
    print(f"{'step':>4} | {'step time s':>11} | {'rollout tok/s':>13} | {'gen tokens':>10} | {'trained tokens':>14} | {'peak GiB':>8}")
    for r in rows:
        print(f"{r['step']:>4} | {r['step_time_s']:>11.2f} | {r['rollout_tokens_per_s']:>13.0f} | "
              f"{r['seq_len'] * args.prompts * args.samples:>10.0f} | {r['valid_tokens']:>14} | {r.get('peak_mem_gb', float('nan')):>8.2f}")


if __name__ == "__main__":
    main()
