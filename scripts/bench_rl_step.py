"""
Benchmark of whole RL steps (rollout + reward + backward + AdamW) on a model of a real shape with
random weights: it needs no download. Prints a table of step time, rollout tokens/s and peak memory.

    # 16 prompts x 16 samples x 256 tokens, bf16
    python -m scripts.bench_rl_step --shape=qwen2.5-0.5b --device-type=cuda
    python -m scripts.bench_rl_step --shape=demo --device-type=cpu

The model's weights are random and its tokenizer is the byte tokenizer: sampling covers those 261
columns (the sampler's softmax over a real 152k vocabulary is a small share of a decode pass; the
lm_head projection onto all 152k rows is paid in full). A random model rarely samples the stop
token, so completions run long, and its answers are never right, so every group would be skipped:
the verifier is replaced by a deterministic coin flip so that every step also trains on its rows.
step_parts: one step in its parts (rollout, reward, update), the update against its FLOPs at the
GEMM rate beside it (update_against_floor, which gpu_check's update check shares) and against
its matmuls alone, bench_rollout's RL-step rows.
"""

import argparse
import functools
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
from fast import packed_linear
from fast.logprobs import fast_logprobs, plain_logprobs
from plumbing import flags, start
from policy.gpt import GPT, GPTConfig
from policy.tokenizer import ByteTokenizer
from scripts import make_demo_model
from tasks import arith

SHAPES = {
    "qwen2.5-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        attention_bias=True,
        tie_word_embeddings=True,
        rope_theta=1e6,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct: Llama, tied head, no bias, no q/k norm
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
        rope_theta=1e5,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),
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
    code = chat_rl.main(
        [
            f"--model={model_dir}",
            "--task=arith",
            f"--out-dir={out_dir}",
            f"--device-type={args.device_type}",
            f"--num-steps={args.steps}",
            f"--examples-per-step={args.prompts}",
            f"--num-samples={args.samples}",
            f"--max-new-tokens={args.max_new_tokens}",
            f"--device-batch-size={args.device_batch_size}",
            "--eval-every=-1",
            "--lr=1e-6",
            "--generate-batch-rows=256",
        ]
    )
    assert code == 0, f"chat_rl exited {code}"
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    shutil.rmtree(work)  # the random model and its final checkpoint: gigabytes for a real shape
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available() and args.device_type != "cpu"
        else "cpu"
    )
    print(
        f"\nshape={args.shape} params={num_params / 1e6:.0f}M device={device} "
        f"torch={torch.__version__} {args.prompts} prompts x {args.samples} samples x "
        f"{args.max_new_tokens} tokens"
    )
    print(
        f"{'step':>4} | {'step time s':>11} | {'rollout tok/s':>13} | {'gen tokens':>10} | "
        f"{'trained tokens':>14} | {'peak GiB':>8}"
    )
    for r in rows:
        print(
            f"{r['step']:>4} | {r['step_time_s']:>11.2f} | {r['rollout_tokens_per_s']:>13.0f} | "
            f"{r['seq_len'] * args.prompts * args.samples:>10.0f} | {r['kept_tokens']:>14} | "
            f"{r.get('peak_mem_gb', float('nan')):>8.2f}"
        )


# ---- one RL step through chat_rl's own functions, in parts --------------------------------------
# (bench_rollout's RL-step rows; adapt when chat_rl changes)
def update_matmul_seconds(c, positions, kept_tokens):
    """
    Seconds of the update's weight matmuls alone, each timed at its own shape: for every Linear
    of a layer (times the layers) and the head, the forward x @ W.T and the backward's two,
    dY @ W and dY.T @ x, on `positions` rows (the head: the kept tokens the loss projects). Small
    inner dimensions (width 256) run well below a square GEMM's rate: this is the floor those
    matmuls set, whatever the rest of the update does.
    """
    width, heads = c.hidden_size, c.head_dim * (c.num_attention_heads + 2 * c.num_key_value_heads)
    shapes = [
        (width, heads),
        (c.head_dim * c.num_attention_heads, width),
        (width, 2 * c.intermediate_size),
        (c.intermediate_size, width),
    ]
    total = 0.0
    for (n_in, n_out), rows, times in [(s, positions, c.num_hidden_layers) for s in shapes] + [
        ((width, c.vocab_size), kept_tokens, 1)
    ]:
        x, w, dy = torch.randn(rows, n_in), torch.randn(n_out, n_in), torch.randn(rows, n_out)
        total += times * sum(
            best_of(f, 2) for f in (lambda: x @ w.T, lambda: dy @ w, lambda: dy.T @ x)
        )
    return total


class Tokenizer:
    """What the engine reads of a tokenizer, for the benchmarks' random models: vocab_size columns
    are sampled, a stop token ends a row."""

    def __init__(self, vocab_size, stop_tokens=()):
        self.vocab_size, self.stop_tokens = vocab_size, set(stop_tokens)


def best_of(fn, tries):
    """Smallest wall time of fn() over tries calls: the machine is shared, the minimum is the least
    disturbed."""
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def step_parts(model, n_prompts, samples, new_tokens):
    """
    Seconds of rollout (engine), reward (verifier), update (log-probs, backward, AdamW) of one
    step of chat_rl on the arith task; the update's FLOPs (update_work), their seconds at the
    GEMM rate beside it (update_against_floor), the update with plain_logprobs (every sequence
    whole, all logits at once), and its weight matmuls alone (update_matmul_seconds). A random
    model's answers are never right, so the verifier is a coin flip (coin_flip_grade): every
    group then has signal to train on.
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
        out = chat_rl.rollout(
            engine, arith, rows, samples, new_tokens, temperature=1.0, top_k=0, seed=0
        )
        rollout_and_reward = time.perf_counter() - t0
        optimizer = start.adamw(
            model.parameters(), 1e-6, flags.parse_config([], chat_rl.HYPERPARAMETERS)
        )
        model.train()
        advantages = chat_rl.compute_advantages(
            torch.tensor(out["total"]), samples, defaults["advantage"]
        )

        # the loss's passes, clipping and an AdamW step, as chat_rl.train_step runs them
        def update(logprobs=fast_logprobs):
            model.zero_grad(set_to_none=True)
            loss, kept_tokens = chat_rl.policy_gradient_backward(
                model,
                out["sequences"],
                out["masks"],
                advantages,
                num_samples=samples,
                device_batch_size=32,
                loss_norm=defaults["loss_norm"],
                device="cpu",
                logprobs=logprobs,
                device_batch_tokens=defaults["device_batch_tokens"],
            )
            chat_rl.optimizer_step(
                model, optimizer, 1e-6, defaults["grad_clip"], float(loss), kept_tokens
            )

        # the same with plain_logprobs: every sequence whole, one row each, all logits at once
        def update_whole():
            update(plain_logprobs)

        c = model.config
        kept = [
            (s, m)
            for s, m, a in zip(
                out["sequences"],
                out["masks"],
                advantages.view(-1, samples).abs().sum(1).repeat_interleave(samples),
            )
            if a > 0
        ]
        work = update_work(c, kept, samples)
        # twice, the faster kept: the first backward pass warms the allocator
        whole = best_of(update_whole, 2)
        shared, floor, rates = update_against_floor(
            update, work, torch.device("cpu"), torch.float32
        )
    finally:
        arith.grade = grade
    return dict(
        rollout=sum(generate_seconds),
        reward=rollout_and_reward - sum(generate_seconds),
        update=shared,
        update_whole=whole,
        update_floor=floor,
        gemm_flops=rates[torch.float32],
        update_matmuls=update_matmul_seconds(c, work["positions"], work["kept_tokens"]),
        **work,
    )


def step_breakdown(model, prompts, samples, new_tokens, tries=2, lr=1e-6):
    """
    One RL step of chat_rl's own functions on prompts (token-id lists) in the four parts a user
    waits for, each the fastest of `tries` steps (the first also warms the allocator and makes
    AdamW's state):
      rollout: Engine.generate, no stop token, so every completion is new_tokens long;
      log-probs: the loss's training forward (fast_logprobs, which makes the head's gradients in
        the same pass);
      backward: the rest of policy_gradient_backward's passes, loss.backward() through the layers;
      optimizer: optimizer_step, clipping and AdamW.
    The parameters that require a gradient train (a LoRA model's: its adapters). The verifier is a
    coin flip on each completion's tokens, so nearly every group trains. Returns the seconds, the
    matmul FLOPs of the log-probs and backward passes (pass_flops), the trained parameters and the
    fp32 matmul rate taken right after the step, over as many FLOPs (matmul_rate).
    """
    defaults = {name: values[0] for name, values in chat_rl.HYPERPARAMETERS.items()}
    engine = Engine(model, Tokenizer(model.config.vocab_size))
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = start.adamw(trained, lr, flags.parse_config([], chat_rl.HYPERPARAMETERS))
    forward_seconds = []

    def timed_logprobs(*args, **kwargs):
        t0 = time.perf_counter()
        logp = fast_logprobs(*args, **kwargs)
        forward_seconds.append(time.perf_counter() - t0)
        return logp

    best = dict.fromkeys(("rollout", "logprobs", "backward", "optimizer"), math.inf)
    for _ in range(tries):
        model.eval()
        t0 = time.perf_counter()
        out = engine.generate(prompts, samples, new_tokens, 1.0, 0, seed=0, include_stop=True)
        t1 = time.perf_counter()
        flips = [float(coin_flip_grade(str(s), "")) for s in out.sequences]
        advantages = chat_rl.compute_advantages(torch.tensor(flips), samples, defaults["advantage"])
        model.train()
        optimizer.zero_grad(set_to_none=True)
        forward_seconds.clear()
        t2 = time.perf_counter()
        loss, kept_tokens = chat_rl.policy_gradient_backward(
            model,
            out.sequences,
            out.masks,
            advantages,
            num_samples=samples,
            device_batch_size=len(out.sequences),
            loss_norm=defaults["loss_norm"],
            device="cpu",
            device_batch_tokens=defaults["device_batch_tokens"],
            logprobs=timed_logprobs,
        )
        t3 = time.perf_counter()
        chat_rl.optimizer_step(
            model, optimizer, lr, defaults["grad_clip"], float(loss), kept_tokens
        )
        t4 = time.perf_counter()
        forward = sum(forward_seconds)
        parts = {
            "rollout": t1 - t0,
            "logprobs": forward,
            "backward": t3 - t2 - forward,
            "optimizer": t4 - t3,
        }
        best = {name: min(best[name], parts[name]) for name in best}
    group_kept = advantages.view(-1, samples).abs().sum(1).repeat_interleave(samples) > 0
    kept = [(s, m) for s, m, k in zip(out.sequences, out.masks, group_kept) if k]
    flops = pass_flops(model, update_work(model.config, kept, samples))
    rate = matmul_rate(sum(flops), torch.device("cpu"), torch.float32)
    return dict(
        best,
        logprobs_flops=flops[0],
        backward_flops=flops[1],
        gemm_flops=rate,
        trained_params=sum(p.numel() for p in trained),
    )


def pass_flops(model, work):
    """
    (log-probs pass, backward pass) matmul FLOPs of an update of update_work's `work`, as
    fast_logprobs and autograd run them: the head's gradients in the log-probs pass (the hidden
    states', and the head's own when it trains), attention's backward twice its forward, and no
    gradient of a frozen weight. A LoRA adapter (policy/lora.py) is two matmuls a position, by its
    stacked A's and its block-diagonal B's; the backward pass makes their input's gradients and
    their own.
    """
    head_trains = model.lm_head.weight.requires_grad
    base_trains = model.model.layers[0].mlp.down_proj.weight.requires_grad
    adapters = 0
    for m in model.modules():
        if hasattr(m, "lora"):  # its A's stacked: rows x in; its B's block-diagonal: out x rows
            rows = sum(a.size(0) for a in m.lora.lora_A.values())
            adapters += 2 * rows * (m.in_features + m.out_features) * work["positions"]
    attention = work["attention_flops"]
    forward = work["body_flops"] + adapters + work["head_flops"] * (2 + head_trains) + attention / 3
    backward = work["body_flops"] * (1 + base_trains) + 2 * adapters + attention * 2 / 3
    return forward, backward


def update_against_floor(update, work, device, dtype, n=2048, tries=2):
    """
    (seconds of update(), the faster of `tries`; seconds of its FLOPs, update_work's `work`, at
    this device's matmul rates; {dtype: FLOP/s}). The rates are taken beside each try, by square
    (n, n) matmuls as many FLOPs long into one output (fresh outputs would cost page faults): on
    a shared machine the rate of the same seconds, not of a quieter moment (a second of matmuls
    reads the machine at its best). Every matmul is priced at the rate of dtype, the update's
    precision: the head's two gradient matmuls run in it too (logprobs.add_chunk_grads, under
    autocast).
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def seconds_of(fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    flops = {dtype: work["weight_flops"] + work["attention_flops"]}
    seconds, rates = math.inf, {}
    for _ in range(tries):
        seconds = min(seconds, seconds_of(update))
        for kind, total in flops.items():
            rates[kind] = max(rates.get(kind, 0), matmul_rate(total, device, kind, n))
    return seconds, sum(total / rates[kind] for kind, total in flops.items()), rates


def matmul_rate(total, device, dtype, n=2048):
    """
    FLOP/s of square (n, n) matmuls as many FLOPs long as `total`, into one output (fresh outputs
    would cost page faults). On an x86 CPU in fp32, the faster of torch's (MKL's) and oneDNN's on a
    weight packed ahead, the engine's kernel (fast/packed_linear.py): MKL leaves AVX-512 unused on
    AMD processors, so its rate alone can understate what the machine does.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a = torch.randn(n, n, device=device, dtype=dtype)
    out, gemms = torch.empty_like(a), max(1, round(total / (2 * n**3)))
    kernels = [lambda: torch.mm(a, a, out=out)]
    if packed_linear.can_pack(a):
        packed = packed_linear.packed_forward(packed_linear.pack(a, n), None)
        kernels.append(functools.partial(packed, a))
    best = 0.0
    for kernel in kernels:
        sync()
        t0 = time.perf_counter()
        for _ in range(gemms):
            kernel()
        sync()
        best = max(best, gemms * 2 * n**3 / (time.perf_counter() - t0))
    return best


def update_work(c, kept, samples):
    """
    Weight and attention FLOPs of the update's forward and backward passes over the kept rows
    (whole groups of `samples`, in order), laid out as the loss runs them: each row's own part
    (its sampled tokens, from the prompt's last token on) and each group's prompt less its last
    token once. Weights: 2 FLOPs a weight a position forward, 4 backward. Attention: q.k and
    p.v, 4 x heads x head_dim a (query, key) pair and layer forward, twice that backward; an own
    position sees the prefix and the own positions up to it, a prefix position the prefix up to
    it. Also the positions the layers run, the tokens the head projects (kept_tokens) and the
    FLOPs of the head's two gradient matmuls.
    """
    own = [(sum(m), len(s) - sum(m) - 1) for s, m in kept]  # (own positions, prefix length) a row
    positions = sum(n for n, _ in own) + sum(p for _, p in own[::samples])
    pairs = sum(n * p + n * (n + 1) // 2 for n, p in own) + sum(
        p * (p + 1) // 2 for _, p in own[::samples]
    )
    body = c.num_hidden_layers * (
        c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
        + 3 * c.hidden_size * c.intermediate_size
    )
    kept_tokens = sum(sum(m[1:]) for _, m in kept)
    return dict(
        weight_flops=6 * body * positions + 6 * c.vocab_size * c.hidden_size * kept_tokens,
        positions=positions,
        kept_tokens=kept_tokens,
        body_flops=2 * body * positions,  # the layers' weights, one forward pass
        head_flops=2 * c.vocab_size * c.hidden_size * kept_tokens,  # the head's, one pass
        attention_flops=12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * pairs,
        head_grad_flops=4 * c.vocab_size * c.hidden_size * kept_tokens,
    )


if __name__ == "__main__":
    main()
