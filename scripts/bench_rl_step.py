"""
Benchmark of whole RL steps (rollout + reward + backward + AdamW) on a model of a real shape with
random weights, so it needs no download. Prints a table of step time, rollout tokens/s and peak memory.

    python -m scripts.bench_rl_step --shape=qwen2.5-0.5b --device-type=cuda   # 16 prompts x 16 samples x 256 tokens, bf16
    python -m scripts.bench_rl_step --shape=demo --device-type=cpu

The model's weights are random and its tokenizer is the byte tokenizer: sampling covers those 261
columns (the sampler's softmax over a real 152k vocabulary is a small share of a decode pass; the
lm_head projection onto all 152k rows is paid in full). A random model rarely samples the stop
token, so completions run long, and its answers are never right, so every group would be skipped:
the verifier is replaced by a deterministic coin flip so that every step also trains on its rows.
step_parts: one step in its parts (rollout, reward, update), the update against its FLOPs at the GEMM rate beside it
(update_against_floor, which gpu_check's update check shares) and against its matmuls alone, bench_rollout's RL-step rows.
"""

import argparse
import hashlib
import json
import math
import os
import shutil
import tempfile
import time

import torch

import chat_rl
from engine import Engine
from scripts import make_demo_model
from policy.gpt import GPT, GPTConfig
from tasks import arith
from policy.tokenizer import ByteTokenizer

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
              f"{r['seq_len'] * args.prompts * args.samples:>10.0f} | {r['kept_tokens']:>14} | {r.get('peak_mem_gb', float('nan')):>8.2f}")


# ---- one RL step through chat_rl's own functions, in parts (bench_rollout's RL-step rows; adapt when chat_rl changes)
def update_matmul_seconds(c, positions, kept_tokens):
    """
    Seconds of the update's weight matmuls alone, each timed at its own shape: for every Linear of a layer (times the
    layers) and the head, the forward x @ W.T and the backward's two, dY @ W and dY.T @ x, on `positions` rows (the
    head: the kept tokens the loss projects). Small inner dimensions (width 256) run well below a square GEMM's
    rate: this is the floor those matmuls set, whatever the rest of the update does.
    """
    width, heads = c.hidden_size, c.head_dim * (c.num_attention_heads + 2 * c.num_key_value_heads)
    shapes = [(width, heads), (c.head_dim * c.num_attention_heads, width), (width, 2 * c.intermediate_size),
              (c.intermediate_size, width)]
    total = 0.0
    for (n_in, n_out), rows, times in [(s, positions, c.num_hidden_layers) for s in shapes] + [((width, c.vocab_size), kept_tokens, 1)]:
        x, w, dy = torch.randn(rows, n_in), torch.randn(n_out, n_in), torch.randn(rows, n_out)
        total += times * sum(best_of(f, 2) for f in (lambda: x @ w.T, lambda: dy @ w, lambda: dy.T @ x))
    return total


class Tokenizer:
    """What the engine reads of a tokenizer, for the benchmarks' random models: vocab_size columns are sampled, a stop
    token ends a row."""

    def __init__(self, vocab_size, stop_tokens=()):
        self.vocab_size, self.stop_tokens = vocab_size, set(stop_tokens)


def best_of(fn, tries):
    """Smallest wall time of fn() over tries calls: the machine is shared, the minimum is the least disturbed."""
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def step_parts(model, n_prompts, samples, new_tokens):
    """
    Seconds of rollout (engine), reward (verifier), update (log-probs, backward, AdamW) of one step of
    chat_rl on the arith task; the update's FLOPs (update_work), their seconds at the GEMM rate beside it
    (update_against_floor), the update with plain_logprobs (every sequence whole, all logits at once), and its weight matmuls alone
    (update_matmul_seconds). A random model's answers are never right, so the verifier is a coin flip
    (coin_flip_grade): every group then has signal to train on.
    """
    defaults = {name: values[0] for name, values in chat_rl.HYPERPARAMETERS.items()}
    grade, arith.grade = arith.grade, coin_flip_grade
    engine = Engine(model, ByteTokenizer())
    generate, generate_seconds = engine.generate, []

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        result = generate(*a, **kw)
        generate_seconds.append(time.perf_counter() - t0)
        return result

    engine.generate = timed_generate
    try:
        rows = arith.load("train")[:n_prompts]
        model.eval()
        t0 = time.perf_counter()
        out = chat_rl.rollout(engine, arith, rows, samples, new_tokens, temperature=1.0, top_k=0, seed=0)
        rollout_and_reward = time.perf_counter() - t0
        optimizer = chat_rl.adamw(model.parameters(), 1e-6, defaults["weight_decay"])
        model.train()
        advantages = chat_rl.compute_advantages(torch.tensor(out["total"]), samples, defaults["advantage"])

        def update(logprobs=chat_rl.fast_logprobs):  # the loss's passes, clipping and an AdamW step, as chat_rl.train runs them
            model.zero_grad(set_to_none=True)
            loss, kept_tokens = chat_rl.policy_gradient_backward(model, out["sequences"], out["masks"], advantages, samples, 32,
                                                           defaults["loss_norm"], "cpu", logprobs=logprobs,
                                                           device_batch_tokens=defaults["device_batch_tokens"])
            chat_rl.optimizer_step(model, optimizer, 1e-6, defaults["grad_clip"], float(loss), kept_tokens)

        def update_whole():  # the same with plain_logprobs: every sequence whole, one row each, all logits at once
            update(chat_rl.plain_logprobs)

        c = model.config
        kept = [(s, m) for s, m, a in zip(out["sequences"], out["masks"], advantages.view(-1, samples).abs().sum(1).repeat_interleave(samples))
                if a > 0]
        work = update_work(c, kept, samples)
        whole = best_of(update_whole, 2)  # twice, the faster kept: the first backward pass warms the allocator
        shared, floor, rates = update_against_floor(update, work, torch.device("cpu"), torch.float32)
    finally:
        arith.grade = grade
    return dict(rollout=sum(generate_seconds), reward=rollout_and_reward - sum(generate_seconds), update=shared,
                update_whole=whole, update_floor=floor, gemm_flops=rates[torch.float32],
                update_matmuls=update_matmul_seconds(c, work["positions"], work["kept_tokens"]), **work)


def update_against_floor(update, work, device, dtype, n=2048, tries=2):
    """
    (seconds of update(), the faster of `tries`; seconds of its FLOPs, update_work's `work`, at this device's matmul
    rates; {dtype: FLOP/s}). The rates are taken beside each try, by square (n, n) matmuls as many FLOPs long into one
    output (fresh outputs would cost page faults): on a shared machine the rate of the same seconds, not of a quieter
    moment (a second of matmuls reads the machine at its best). The head's two gradient matmuls run in fp32
    (logprobs.add_chunk_grads) and are priced at the fp32 rate, the rest at the rate of dtype, the update's precision.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def seconds_of(fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    flops = {dtype: work["weight_flops"] + work["attention_flops"] - work["head_grad_flops"]}
    flops[torch.float32] = flops.get(torch.float32, 0) + work["head_grad_flops"]  # one entry when dtype is fp32
    seconds, rates = math.inf, {}
    for _ in range(tries):
        seconds = min(seconds, seconds_of(update))
        for kind, total in flops.items():
            a = torch.randn(n, n, device=device, dtype=kind)
            out, gemms = torch.empty_like(a), max(1, round(total / (2 * n ** 3)))
            rates[kind] = max(rates.get(kind, 0), gemms * 2 * n ** 3 / seconds_of(lambda: [torch.mm(a, a, out=out) for _ in range(gemms)]))
    return seconds, sum(total / rates[kind] for kind, total in flops.items()), rates


def update_work(c, kept, samples):
    """
    Weight and attention FLOPs of the update's forward and backward passes over the kept rows (whole groups of
    `samples`, in order), laid out as the loss runs them: each row's own part (its sampled tokens, from the prompt's
    last token on) and each group's prompt less its last token once. Weights: 2 FLOPs a weight a position forward, 4
    backward. Attention: q.k and p.v, 4 x heads x head_dim a (query, key) pair and layer forward, twice that backward;
    an own position sees the prefix and the own positions up to it, a prefix position the prefix up to it. Also the
    positions the layers run, the tokens the head projects (kept_tokens) and the FLOPs of the head's two gradient matmuls.
    """
    own = [(sum(m), len(s) - sum(m) - 1) for s, m in kept]  # (own positions, prefix length) a row
    positions = sum(n for n, _ in own) + sum(p for _, p in own[::samples])
    pairs = sum(n * p + n * (n + 1) // 2 for n, p in own) + sum(p * (p + 1) // 2 for _, p in own[::samples])
    body = c.num_hidden_layers * (c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
                                  + 3 * c.hidden_size * c.intermediate_size)
    kept_tokens = sum(sum(m[1:]) for _, m in kept)
    return dict(weight_flops=6 * body * positions + 6 * c.vocab_size * c.hidden_size * kept_tokens, positions=positions,
                kept_tokens=kept_tokens,
                attention_flops=12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * pairs,
                head_grad_flops=4 * c.vocab_size * c.hidden_size * kept_tokens)


if __name__ == "__main__":
    main()
