"""
Rollout benchmark: the engine against transformers `generate` on the same weights and against this
machine's measured ceiling, and the pieces around it (batches that shrink, full-vocabulary sampling,
the training log-prob pass, one whole RL step). Random Qwen3-shaped models, nothing downloaded; and
SmolLM2-135M's shape, a real model's (--only=smollm2: the engine against transformers; smollm2-step:
one RL step in its parts, each beside its floor).

    # one table: 7 min on 2 idle cores, + SmolLM2's rows
    python -m scripts.bench_rollout
    # SmolLM2-135M's rows alone
    python -m scripts.bench_rollout --only=smollm2,smollm2-step
    # smoke run on tiny shapes, seconds (tests/test_bench_rollout.py)
    python -m scripts.bench_rollout --quick

Ceiling: the time a token needs at the machine's fp32 GEMM rate and read bandwidth (both measured
next to each run, best of several tries: the machine is shared), counting
    FLOPs: 2 x (linear weights, lm_head included)
           + 4 x heads x head_dim x context per layer (q.k and p.v)
    bytes: keys and values of the context, every layer, + all weights once per decode pass / rows
with the context averaged over the completion (prompt + half the new tokens). Time = FLOPs / GEMM
rate + bytes / bandwidth: no overlap of the two, no kernel overhead, no sampler, so no engine
reaches it. The same ceiling for completions 4x as long (512 new tokens), and the ATen operations
one decode pass dispatches, the engine's and transformers' on the same batch (scripts/op_count.py):
on a GPU each is at least one kernel launch, which at RL's small per-row work is what a decode
pass costs.
"""

import argparse
import functools
import math
import os
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace
from unittest import mock

import torch

from engine import Engine, next_logits
from fast import packed_linear
from fast.packed_linear import packed_linears
from fast.sampling import sample_next_token
from policy import lora
from policy.gpt import GPT, GPTConfig
from scripts import bench_memory, bench_rl_step, op_count
from scripts.bench_mixed_lengths import mixed_floor, mixed_lengths
from scripts.bench_rl_step import Tokenizer, best_of

QWEN3 = dict(
    qk_norm=True,
    tie_word_embeddings=True,
    rope_theta=1e6,
    max_position_embeddings=4096,
    head_dim=64,
)
CONFIGS = {
    "4L": dict(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        **QWEN3,
    ),
    "12L": dict(
        vocab_size=32768,
        hidden_size=768,
        intermediate_size=2304,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        **QWEN3,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        **QWEN3,
    ),
    "SmolLM2": bench_rl_step.SHAPES["smollm2-135m"],  # SmolLM2-135M-Instruct's shape, Llama
    # --quick's stand-in for it
    "tiny-llama": dict(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1e5,
    ),
}
FULL_VOCAB = 151936  # Qwen2.5 / Qwen3


def measure_machine(quick):
    """The fp32 GEMM rate of square (n, n) matmuls, the faster of torch's (MKL's) and, on x86,
    oneDNN's on a packed weight, which the engine's large matmuls use (fast/packed_linear.py), each
    kept too (0: not on this machine); and the read bandwidth."""
    n, tries = (512, 3) if quick else (2048, 8)
    a, b = torch.randn(n, n), torch.randn(n, n)
    mkl, onednn = 2 * n**3 / best_of(lambda: a @ b, tries), 0.0
    if packed_linear.can_pack(b):
        packed = packed_linear.packed_forward(packed_linear.pack(b, n), None)
        onednn = 2 * n**3 / best_of(lambda: packed(a), tries)
    x = torch.randn((2 if quick else 64) * 2**20)  # 8 / 256 MB: well past the caches
    read = x.numel() * 4 / best_of(lambda: x.sum(), tries)
    return SimpleNamespace(
        gemm_flops=max(mkl, onednn),
        mkl_flops=mkl,
        onednn_flops=onednn,
        gemm_size=n,
        read_bytes=read,
    )


def decode_cost(c, rows, context, weight_bytes=4, kv_bytes=8):
    """(FLOPs, bytes read) per generated token of config c at the given mean context length:
    weights of weight_bytes each, a key and a value of kv_bytes together (fp32: 8; --dtype=bf16:
    6, the cache's fp32 key and bf16 value)."""
    linear = (
        c.num_hidden_layers
        * (
            c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
            + 3 * c.hidden_size * c.intermediate_size
        )
        + c.vocab_size * c.hidden_size
    )
    attention_flops = 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * context
    kv = c.num_hidden_layers * c.num_key_value_heads * c.head_dim * context * kv_bytes
    return 2 * linear + attention_flops, kv + linear * weight_bytes / rows


def ceiling_tokens_per_s(c, rows, prompt_len, new_tokens, machine, bf16=False):
    """Tokens/s at the machine's GEMM rate and read bandwidth; bf16: at its bf16 rate, with bf16
    weights and the bf16 run's KV cache."""
    sizes = dict(weight_bytes=2, kv_bytes=6) if bf16 else {}
    flops, nbytes = decode_cost(c, rows, prompt_len + new_tokens / 2, **sizes)
    rate = machine.bf16_flops if bf16 else machine.gemm_flops
    return 1 / (flops / rate + nbytes / machine.read_bytes)


def bf16_gemm_flops(quick):
    """The bf16 GEMM rate of square matmuls: the faster of torch.mm's and, on x86, oneDNN's on a
    weight packed in bf16 (the engine's under --dtype=bf16). On a CPU without bf16 units both are
    emulated, slower than fp32."""
    n, tries = (512, 3) if quick else (2048, 8)
    a, b = torch.randn(n, n).bfloat16(), torch.randn(n, n).bfloat16()
    rate = 2 * n**3 / best_of(lambda: a @ b, tries)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if packed_linear.can_pack(b):
            dtype = torch.bfloat16
            packed = packed_linear.packed_forward(packed_linear.pack(b, n, dtype), None, dtype)
            rate = max(rate, 2 * n**3 / best_of(lambda: packed(a), tries))
    return rate


def rollout_floor(c, prompt_len, n_prompts, samples, new_tokens, machine):
    """Seconds of a rollout at the machine's rates: the prefill's weight matmuls (each prompt once,
    the head on its last position alone) and every new token at the ceiling."""
    head = c.vocab_size * c.hidden_size
    body = decode_cost(c, 1, 0)[0] / 2 - head  # the layers' linear weights
    prefill = 2 * (body * prompt_len + head) * n_prompts / machine.gemm_flops
    rows = n_prompts * samples
    decode = rows * new_tokens / ceiling_tokens_per_s(c, rows, prompt_len, new_tokens, machine)
    return prefill + decode


# ---- engine and transformers, same weights ----------------------------------------------------
def percent(x):
    """A fraction as a percentage with two significant digits below 10%: tiny --quick shapes sit
    far below their ceiling, and "0%" would hide that a figure was measured at all."""
    return f"{x:.0%}" if x >= 0.1 else f"{x * 100:.2g}%"


def duration(seconds):
    """Seconds as s, or as ms below a tenth of one (--quick's tiny shapes): no figure reads 0."""
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:.2g} ms"


def random_prompts(n, length, vocab, seed=0):
    return torch.randint(
        0, vocab, (n, length), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def engine_tokens_per_s(model, prompts, samples, new_tokens, top_k, tries=1, bf16=False):
    """The engine's tokens/s, every row making new_tokens (no stop tokens); bf16: under CPU bf16
    autocast, as --dtype=bf16 samples."""
    engine = Engine(model, Tokenizer(model.config.vocab_size))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)

    def generate(*args, **kwargs):
        with autocast:
            return engine.generate_batch(*args, **kwargs)

    generate(prompts[:1], 2, 2, 1.0, top_k)  # warm-up
    seconds = best_of(lambda: generate(prompts, samples, new_tokens, 1.0, top_k, seed=1), tries)
    return len(prompts) * samples * new_tokens / seconds


@torch.inference_mode()
def transformers_generate(hf, prompts, samples, new_tokens, top_k):
    """transformers' generate on the same batch, every row sampling exactly new_tokens (top_k 0:
    the whole vocabulary)."""
    ids = torch.tensor(prompts)
    kw = dict(
        do_sample=True,
        temperature=1.0,
        top_k=top_k,
        pad_token_id=0,
        eos_token_id=None,
        num_return_sequences=samples,
    )
    return hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        **kw,
    )


def transformers_tokens_per_s(hf, prompts, samples, new_tokens, top_k):
    transformers_generate(hf, prompts[:1], samples, 2, top_k)  # warm-up
    t0 = time.perf_counter()
    out = transformers_generate(hf, prompts, samples, new_tokens, top_k)
    seconds = time.perf_counter() - t0
    assert out.shape == (len(prompts) * samples, len(prompts[0]) + new_tokens), out.shape
    return out.numel() - len(prompts) * samples * len(prompts[0]), seconds


def load_transformers(model, dtype=torch.float32):
    """The same weights through transformers: save_pretrained, then AutoModelForCausalLM, in dtype
    (bf16: as a user loads a model to sample in bf16)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    folder = tempfile.mkdtemp(prefix="bench_rollout_")
    try:
        model.save_pretrained(folder)
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    finally:
        shutil.rmtree(folder)


# ---- full-vocabulary sampling against a decode pass --------------------------------------------
@torch.inference_mode()
def sampling_vs_decode(model, prompts, samples, prompt_len, tries):
    """Seconds of one decode pass (prompts x samples rows, one token each, through the model, its
    Linears packed as the engine runs them), of its head alone, and of sampling its logits, top-k 0:
    (head, sample, decode)."""
    vocab, rows = model.config.vocab_size, prompts * samples
    with packed_linears(model, rows):
        engine = Engine(model, Tokenizer(vocab))
        _, cache = engine.prefill(random_prompts(prompts, prompt_len, vocab), samples, tries)
        token = torch.randint(0, vocab, (rows,))
        logits = [None]  # the last step's, (rows, V)
        decode = best_of(lambda: logits.__setitem__(0, next_logits(model, token, cache)), tries)
        h = torch.randn(rows, 1, model.config.hidden_size)
        head = best_of(lambda: model.lm_head(h), tries)
    u = torch.rand(rows)
    sample = best_of(lambda: sample_next_token(logits[0], u, 1.0, 0), tries)
    return head, sample, decode


@torch.inference_mode()
def packed_vs_plain_decode(model, prompts, samples, prompt_len, tries):
    """Seconds of one decode pass (prompts x samples rows) with every Linear's weight packed
    (fast/packed_linear.py; at SmolLM2's shape the engine packs them all) and with MKL's matmuls,
    in turn, the best of tries each, packing untimed: (packed, plain). Whole rollouts timed one
    after the other read the shared machine's drift as much as the kernels."""
    vocab, rows = model.config.vocab_size, prompts * samples
    engine = Engine(model, Tokenizer(vocab))
    _, cache = engine.prefill(random_prompts(prompts, prompt_len, vocab), samples, 2 * tries)
    token = torch.randint(0, vocab, (rows,))

    def decode():
        return next_logits(model, token, cache)

    packed = plain = math.inf
    for _ in range(tries):
        with mock.patch.object(packed_linear, "MIN_WEIGHT", 0), packed_linears(model, rows):
            packed = min(packed, best_of(decode, 1))
        plain = min(plain, best_of(decode, 1))
    return packed, plain


# ---- the calculator's cost -----------------------------------------------------------------------
def open_every_call(model, token):
    """A forward hook that lifts `token` (the byte '<') 1000 above the prefill's logits: every
    row's first token then opens a call, and the demo's policy goes on in its calculator style
    (`<<4*5=20>>`)."""

    def hook(module, args, kwargs, logits):
        cache = kwargs.get("kv_cache")
        if cache is not None and not cache.decoding:
            logits[..., token] += 1000.0
        return logits

    return model.register_forward_hook(hook, with_kwargs=True)


def tool_overhead(quick, tries):
    """
    The engine with the calculator on against off, on the same batch: the demo's policy on arith
    problems as it starts out (about one sample in seven calls the tool, three times each), then
    with every row's first token a '<', so that about every row calls it as a policy trained to use
    it does. No stop token, so both sides decode the same rows for the same steps and differ only in
    the tool's work: spotting calls, answering them, feeding the forced tokens.
    Returns (calls per row, tool-on tok/s, tool-off tok/s).
    """
    from calculator import calculate
    from plumbing.checkpoint import load_policy
    from tasks import arith
    from tasks.common import conversation

    model, tokenizer = load_policy("demo_model", "cpu")
    model.eval()
    tokenizer.stop_tokens = set()  # every row runs to new_tokens, tool or not
    rows = arith.load("test", limit=4 if quick else 16)
    prompts = [tokenizer.render_for_completion(conversation(arith, row)) for row in rows]
    samples, new_tokens = (4, 32) if quick else (16, 64)
    results = []
    for open_calls in (False, True):
        handle = open_every_call(model, ord("<")) if open_calls else None
        on, off = Engine(model, tokenizer, tool=calculate), Engine(model, tokenizer)
        # warm-up (and the tool's vocabulary tables)
        for engine in (on, off):
            engine.generate_batch(prompts[:1], 2, 4, seed=0)
        seconds = {on: float("inf"), off: float("inf")}
        # on and off in turn, so a drift in the shared machine's speed meets both alike
        for _ in range(tries):
            for engine in (on, off):
                seconds[engine] = min(
                    seconds[engine],
                    best_of(
                        lambda: engine.generate_batch(prompts, samples, new_tokens, 1.0, 0, seed=1),
                        1,
                    ),
                )
        # the timed batch's, untimed
        calls = on.generate(prompts, samples, new_tokens, 1.0, 0, seed=1).tool_calls
        if handle is not None:
            handle.remove()
        tokens = len(prompts) * samples * new_tokens
        results.append((sum(calls) / len(calls), tokens / seconds[on], tokens / seconds[off]))
    return results


# ---- a real model's shape: SmolLM2-135M ------------------------------------------------------
def smollm2_rows(add, quick, prompt_len, new_tokens):
    """
    SmolLM2-135M's shape (30 layers x width 576, a 49,152-token vocabulary; tiny-llama when quick),
    random weights, 16 prompts x 8 samples, top-k 0 as RL samples: the machine's two fp32 GEMMs,
    oneDNN's and MKL's; the engine against transformers' generate on the same batch, one after the
    other, and against its ceiling; a decode pass with the weights packed as the engine runs it
    (packed_vs_plain_decode) against MKL's matmuls; and the share of a pass its head and the sampler
    take.
    """
    name = "tiny-llama" if quick else "SmolLM2"
    model = GPT(GPTConfig(**CONFIGS[name])).init_weights(0).eval()
    c, hf = model.config, load_transformers(model)
    n_prompts, samples = (2, 4) if quick else (16, 8)
    prompts = random_prompts(n_prompts, prompt_len, c.vocab_size)
    now = measure_machine(quick)
    if now.onednn_flops:  # the machine's two fp32 matmuls: the engine's large ones are oneDNN's
        add(
            f"fp32 GEMM, {now.gemm_size} x {now.gemm_size}",
            f"oneDNN, packed: {now.onednn_flops / 1e9:.0f} GFLOP/s",
            f"MKL (torch.mm): {now.mkl_flops / 1e9:.0f} GFLOP/s",
            f"{now.onednn_flops / now.mkl_flops:.2f}x",
            "",
        )
    ours = engine_tokens_per_s(model, prompts, samples, new_tokens, 0)
    n, seconds = transformers_tokens_per_s(hf, prompts, samples, new_tokens, 0)
    del hf
    case = f"{name} {n_prompts}x{samples}, {new_tokens} new tokens, top-k 0"
    add(
        case,
        f"{ours:,.0f} tok/s",
        f"transformers {n / seconds:,.0f} tok/s",
        f"{ours / (n / seconds):.1f}x",
        ">= 2.5x",
    )
    ceiling = ceiling_tokens_per_s(c, n_prompts * samples, prompt_len, new_tokens, now)
    add(
        case,
        f"{ours:,.0f} tok/s",
        f"ceiling {ceiling:,.0f} tok/s ({now.gemm_flops / 1e9:.0f} "
        f"GFLOP/s, {now.read_bytes / 1e9:.0f} GB/s)",
        percent(ours / ceiling),
        "",
    )
    packed, plain = packed_vs_plain_decode(model, n_prompts, samples, prompt_len, 3 if quick else 5)
    add(
        f"{name} decode pass, {n_prompts * samples} rows, weights packed",
        f"{packed * 1e3:.1f} ms",
        f"MKL's matmuls, in turn: {plain * 1e3:.1f} ms",
        f"{packed / plain:.2f}x",
        "",
    )
    head, sample, decode = sampling_vs_decode(
        model, n_prompts, samples, prompt_len, tries=2 if quick else 3
    )
    add(
        f"{name} head and sampler, {n_prompts * samples} rows, {c.vocab_size:,} columns",
        f"head {head * 1e3:.1f} ms, sampler {sample * 1e3:.1f} ms / step",
        f"decode pass {decode * 1e3:.0f} ms",
        f"{(head + sample) / decode:.0%}",
        "",
    )


def smollm2_bf16_rows(add, quick, prompt_len, new_tokens):
    """
    smollm2_rows' batch in bf16: the engine under --dtype=bf16's autocast (fp32 weights, packed in
    bf16 once a call) against transformers' generate on the same rows in fp32 and in bf16 (the
    model loaded in bf16, as a user samples in bf16), and the engine in fp32, each timed in turn,
    the faster of two each; and the engine against the bf16 ceiling (the bf16 GEMM rate, bf16
    weights, the cache's fp32 keys and bf16 values).
    """
    name = "tiny-llama" if quick else "SmolLM2"
    model = GPT(GPTConfig(**CONFIGS[name])).init_weights(0).eval()
    c = model.config
    n_prompts, samples = (2, 4) if quick else (16, 8)
    prompts = random_prompts(n_prompts, prompt_len, c.vocab_size)
    hf = {dtype: load_transformers(model, dtype) for dtype in (torch.float32, torch.bfloat16)}
    for dtype, hf_model in hf.items():  # warm-up
        transformers_tokens_per_s(hf_model, prompts[:1], samples, 2, 0)
    best = dict.fromkeys(("bf16", "fp32", torch.float32, torch.bfloat16), 0.0)
    for _ in range(2):  # in turn, so a drift in the shared machine's speed meets each alike
        best["bf16"] = max(
            best["bf16"], engine_tokens_per_s(model, prompts, samples, new_tokens, 0, bf16=True)
        )
        best["fp32"] = max(
            best["fp32"], engine_tokens_per_s(model, prompts, samples, new_tokens, 0)
        )
        for dtype, hf_model in hf.items():
            n, seconds = transformers_tokens_per_s(hf_model, prompts, samples, new_tokens, 0)
            best[dtype] = max(best[dtype], n / seconds)
    case = f"{name} {n_prompts}x{samples}, {new_tokens} new tokens, engine in bf16"
    ours = best["bf16"]
    for what, theirs, target in (
        ("transformers fp32", best[torch.float32], ">= 2.5x"),
        ("transformers bf16", best[torch.bfloat16], ">= 1.5x"),
        ("the engine in fp32", best["fp32"], ""),
    ):
        add(
            case,
            f"{ours:,.0f} tok/s",
            f"{what} {theirs:,.0f} tok/s",
            f"{ours / theirs:.1f}x",
            target,
        )
    now = measure_machine(quick)
    now.bf16_flops = bf16_gemm_flops(quick)
    ceiling = ceiling_tokens_per_s(c, n_prompts * samples, prompt_len, new_tokens, now, bf16=True)
    add(
        case,
        f"{ours:,.0f} tok/s",
        f"bf16 ceiling {ceiling:,.0f} tok/s ({now.bf16_flops / 1e9:.0f} GFLOP/s bf16, "
        f"{now.read_bytes / 1e9:.0f} GB/s)",
        percent(ours / ceiling),
        "",
    )


def smollm2_step_rows(add, quick):
    """
    One RL step at SmolLM2-135M's shape as a laptop run takes it (8 prompts x 8 samples, 35-token
    prompts, 48-token completions; tiny-llama and less when quick), full fine-tuning, then LoRA rank
    16 on every projection: each part (bench_rl_step.step_breakdown) beside its floor at the fp32
    matmul rate taken right after the step and the read bandwidth. Floors: the rollout's
    (rollout_floor); the log-probs' and the backward pass's matmul FLOPs (bench_rl_step.pass_flops);
    the optimizer's bytes, 40 a trained parameter (clipping reads each gradient twice and writes it
    once; AdamW reads the weight, the gradient and both moments and writes three of them).
    """
    name = "tiny-llama" if quick else "SmolLM2"
    n_prompts, samples, prompt_len, new_tokens = (2, 4, 8, 8) if quick else (8, 8, 35, 48)
    for rank in (0, 16):
        model = GPT(GPTConfig(**CONFIGS[name])).init_weights(0)
        if rank:
            lora.add_adapters(model, rank, 32.0)
        prompts = random_prompts(n_prompts, prompt_len, model.config.vocab_size)
        parts = bench_rl_step.step_breakdown(model, prompts, samples, new_tokens, tries=2)
        rates = SimpleNamespace(
            gemm_flops=parts["gemm_flops"], read_bytes=measure_machine(quick).read_bytes
        )
        trained = parts["trained_params"]
        floors = dict(
            rollout=rollout_floor(model.config, prompt_len, n_prompts, samples, new_tokens, rates),
            logprobs=parts["logprobs_flops"] / rates.gemm_flops,
            backward=parts["backward_flops"] / rates.gemm_flops,
            optimizer=40 * trained / rates.read_bytes,
        )
        what = dict(
            rollout="its matmuls and cache reads",
            backward="its matmuls",
            logprobs="its matmuls, the head's gradients too",
            optimizer=f"{trained / 1e6:.3g}M parameters' bytes",
        )
        kind = f"LoRA rank {rank}" if rank else "full"
        for part, floor in floors.items():
            add(
                f"{name} RL step {n_prompts}x{samples}, {prompt_len} + {new_tokens} tokens, "
                f"{kind}: {part.replace('logprobs', 'log-probs')}",
                duration(parts[part]),
                f"floor {duration(floor)}, {what[part]}",
                percent(floor / parts[part]),
                "",
            )
        step, floor = sum(parts[part] for part in floors), sum(floors.values())
        add(
            f"{name} RL step {n_prompts}x{samples}, {kind}: whole step",
            duration(step),
            f"floor {duration(floor)} ({rates.gemm_flops / 1e9:.0f} GFLOP/s, "
            f"{rates.read_bytes / 1e9:.0f} GB/s)",
            percent(floor / step),
            "",
        )


# ---- the table --------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(description="engine rollout benchmark (one table)")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run in seconds")
    p.add_argument(
        "--only",
        default="",
        help="comma-separated rows to run: engine, ops, long, mixed, sampling, logprob, rlstep, "
        "lora, smollm2, smollm2-bf16, smollm2-step, tool (default all)",
    )
    args = p.parse_args(argv)
    torch.manual_seed(0)
    quick, started = args.quick, time.time()
    prompt_len, new_tokens, top_k = (16, 16, 5) if quick else (96, 128, 50)
    machine = measure_machine(quick)
    lines = []  # (case, figure, compared with, ratio, target)

    def wanted(row):
        return not args.only or row in args.only.split(",")

    def add(*row):
        lines.append(row)
        print("  " + " | ".join(row), flush=True)

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; "
        f"fp32 GEMM {machine.gemm_flops / 1e9:.0f} GFLOP/s, "
        f"read bandwidth {machine.read_bytes / 1e9:.1f} GB/s (measured now)",
        flush=True,
    )
    plan = (
        [("tiny", [(1, 4), (2, 4)])]
        if quick
        else [("4L", [(1, 16), (16, 16)]), ("12L", [(1, 16), (16, 16)])]
    )
    for name, layouts in plan if wanted("engine") or wanted("ops") or wanted("long") else []:
        model = GPT(GPTConfig(**CONFIGS[name])).init_weights(0).eval()
        c = model.config
        hf = load_transformers(model)
        for n_prompts, samples in layouts if wanted("engine") else []:
            prompts = random_prompts(n_prompts, prompt_len, c.vocab_size)
            # the machine is shared: its ceiling is measured again next to each run
            now = measure_machine(quick)
            ours = engine_tokens_per_s(model, prompts, samples, new_tokens, top_k)
            # transformers on the 12-layer model is slow: fewer new tokens for it
            # (its per-token cost only grows with length)
            hf_tokens = new_tokens if name != "12L" else 16
            n, seconds = transformers_tokens_per_s(hf, prompts, samples, hf_tokens, top_k)
            ceiling = ceiling_tokens_per_s(c, n_prompts * samples, prompt_len, new_tokens, now)
            case = f"{name} {n_prompts}x{samples}"
            target_hf = {"4L 1x16": ">= 3x", "4L 16x16": ">= 6x"}.get(case, "")
            add(
                case,
                f"{ours:,.0f} tok/s",
                f"transformers {n / seconds:,.0f} tok/s"
                + (f" ({hf_tokens} new tokens)" if hf_tokens != new_tokens else ""),
                f"{ours / (n / seconds):.1f}x",
                target_hf,
            )
            add(
                case,
                f"{ours:,.0f} tok/s",
                f"ceiling {ceiling:,.0f} tok/s "
                f"({now.gemm_flops / 1e9:.0f} GFLOP/s, {now.read_bytes / 1e9:.0f} GB/s)",
                percent(ours / ceiling),
                {"4L 16x16": ">= 40%", "12L 16x16": ">= 50%"}.get(case, ""),
            )
        # operations per decode pass, top-k 0 as RL samples;
        # 12L on 16 rows (transformers' 256 are slow)
        if wanted("ops"):
            n_prompts, samples = layouts[-1] if name != "12L" else layouts[0]
            prompts, engine = (
                random_prompts(n_prompts, prompt_len, c.vocab_size),
                Engine(model, Tokenizer(c.vocab_size)),
            )
            ours, ours_all, _ = op_count.ops_per_step(
                lambda n: engine.generate_batch(prompts, samples, n, 1.0, 0, seed=1)
            )
            theirs, theirs_all, _ = op_count.ops_per_step(
                functools.partial(transformers_generate, hf, prompts, samples, top_k=0)
            )
            add(
                f"{name} {n_prompts}x{samples} decode pass, top-k 0",
                f"{ours:.0f} operations ({ours_all:.0f} with views)",
                f"transformers {theirs:.0f} ({theirs_all:.0f})",
                f"{ours / theirs:.2f}x",
                "<= 200" if name == "4L" else "",
            )
        # long completions: the context grows 4x as long over the rollout
        if wanted("long") and name != "12L":
            # 1x and 4x the new tokens timed in turn, twice, the faster of each kept, both against
            # one measure of the machine: a shared machine's drift between two rows timed minutes
            # apart would move one share, not both
            n_prompts, samples = layouts[-1]
            prompts, now = (
                random_prompts(n_prompts, prompt_len, c.vocab_size),
                measure_machine(quick),
            )
            lengths, best = (new_tokens, 4 * new_tokens), {}
            for _ in range(2):
                for n in lengths:
                    best[n] = max(
                        best.get(n, 0), engine_tokens_per_s(model, prompts, samples, n, top_k)
                    )
            share = {
                n: best[n] / ceiling_tokens_per_s(c, n_prompts * samples, prompt_len, n, now)
                for n in lengths
            }
            short, long = lengths
            add(
                f"{name} {n_prompts}x{samples}, {long} new tokens",
                f"{best[long]:,.0f} tok/s, {percent(share[long])} of its ceiling",
                f"{short} new tokens, timed in turn: {best[short]:,.0f} tok/s, "
                f"{percent(share[short])} of its ceiling "
                f"({now.gemm_flops / 1e9:.0f} GFLOP/s, {now.read_bytes / 1e9:.0f} GB/s)",
                f"{share[long] / share[short]:.2f}x",
                ">= 1.00x",
            )
        del hf
    # rows stopping early: 4L (tiny when quick), 16 x 16, lengths spread over 16..128
    if wanted("mixed"):
        model = GPT(GPTConfig(**CONFIGS["tiny" if quick else "4L"])).init_weights(0).eval()
        prompts = random_prompts(4 if quick else 16, prompt_len, model.config.vocab_size)
        useful, mixed, full = mixed_lengths(
            model, prompts, 4 if quick else 16, new_tokens, top_k, 4 if quick else 16, tries=2
        )
        add(
            f"mixed lengths {len(prompts)}x{4 if quick else 16}, "
            f"{4 if quick else 16}..{new_tokens} tokens",
            f"{mixed:.2f} s, {useful / mixed:,.0f} useful tok/s",
            f"all rows to {new_tokens}: {full:.2f} s",
            f"{mixed / full:.2f}x",
            "<= 0.65x",
        )
        floor, sizes, costs = mixed_floor(
            model, prompts, 4 if quick else 16, new_tokens, top_k, 4 if quick else 16, tries=2
        )
        add(
            "mixed lengths, floor from step costs",
            f"{floor:.2f}x with free compactions, no finished row kept",
            f"decode pass {costs[0] * 1e3:.1f} ms at {sizes[0]} rows, "
            f"{costs[-1] * 1e3:.1f} ms at {sizes[-1]}",
            f"engine {mixed / full / floor:.2f}x the floor",
            "",
        )
    if wanted("sampling"):  # full-vocabulary sampling against a decode pass
        config = dict(
            CONFIGS["tiny" if quick else "12L"], vocab_size=FULL_VOCAB // (64 if quick else 1)
        )
        prompts, samples = (2, 8) if quick else (16, 16)
        model = GPT(GPTConfig(**config)).init_weights(0).eval()
        tries = 2 if quick else 3
        _, sample, decode = sampling_vs_decode(model, prompts, samples, prompt_len, tries)
        add(
            f"sampling {config['vocab_size']:,} columns, {prompts * samples} rows, top-k 0",
            f"{sample * 1e3:.1f} ms / step",
            f"decode pass {decode * 1e3:.0f} ms",
            f"{sample / decode:.1%}",
            "<= 15%",
        )
    if wanted("logprob"):  # the training log-prob pass
        tokens, hidden, vocab = (512, 64, 4096) if quick else (8192, 768, FULL_VOCAB)
        chunked, unchunked = (
            bench_memory.logprob_peak(kind, tokens, hidden, vocab)
            for kind in ("chunked", "unchunked")
        )
        add(
            f"log-prob pass peak, {tokens:,} tokens, vocab {vocab:,}, width {hidden}",
            f"+{chunked / 2**30:.2f} GiB chunked",
            f"+{unchunked / 2**30:.2f} GiB unchunked",
            f"{chunked / max(unchunked, 1):.2f}x",
            "<= 1.5 GB",
        )
    if wanted("rlstep"):  # one whole RL step, 4L (tiny when quick)
        model = GPT(GPTConfig(**CONFIGS["tiny" if quick else "4L"])).init_weights(0)
        parts = bench_rl_step.step_parts(
            model, n_prompts=4 if quick else 16, samples=4 if quick else 16, new_tokens=new_tokens
        )
        add(
            f"RL step {4 if quick else 16}x{4 if quick else 16}x{new_tokens}",
            f"rollout {parts['rollout']:.1f} s, reward {parts['reward']:.2f} s, "
            f"update {parts['update']:.1f} s",
            f"update at the GEMM rate ({parts['gemm_flops'] / 1e9:.0f} GFLOP/s beside it): "
            f"{parts['update_floor']:.2f} s "
            f"(attention {parts['attention_flops'] / parts['gemm_flops']:.2f} s)",
            f"{parts['update_floor'] / parts['update']:.0%}",
            ">= 75%",
        )
        add(
            "update against its own matmuls",
            f"{parts['update']:.1f} s",
            f"the same matmuls alone, at their shapes: {parts['update_matmuls']:.1f} s",
            f"{parts['update_matmuls'] / parts['update']:.0%}",
            "",
        )
        add(
            "update, fast_logprobs",
            f"{parts['update']:.2f} s",
            f"plain_logprobs: {parts['update_whole']:.2f} s",
            f"{parts['update'] / parts['update_whole']:.2f}x",
            "",
        )
    # LoRA adapters beside the frozen base (policy/lora.py) against the same model without them
    if wanted("lora"):
        model = GPT(GPTConfig(**CONFIGS["tiny" if quick else "4L"])).init_weights(0).eval()
        prompts, samples = (
            random_prompts(4 if quick else 16, prompt_len, model.config.vocab_size),
            4 if quick else 16,
        )
        adapted = lora.add_adapters(
            GPT(GPTConfig(**CONFIGS["tiny" if quick else "4L"])).init_weights(0).eval(), 16, 32.0
        )
        speeds = {"base": 0.0, "lora": 0.0}
        for _ in range(2 if quick else 3):  # in turn, the best of each: the machine is shared
            for name, m in (("base", model), ("lora", adapted)):
                speeds[name] = max(
                    speeds[name], engine_tokens_per_s(m, prompts, samples, new_tokens, top_k)
                )
        add(
            f"LoRA rank 16, every projection, {len(prompts)}x{samples}",
            f"{speeds['lora']:,.0f} tok/s",
            f"the base alone: {speeds['base']:,.0f} tok/s",
            f"{speeds['lora'] / speeds['base']:.2f}x",
            "",
        )
    if wanted("smollm2"):  # SmolLM2-135M's shape: the engine against transformers and its ceiling
        smollm2_rows(add, quick, prompt_len, new_tokens)
    if wanted("smollm2-bf16"):  # the same in bf16: the engine against transformers in both dtypes
        smollm2_bf16_rows(add, quick, prompt_len, new_tokens)
    if wanted("smollm2-step"):  # SmolLM2-135M's shape: one RL step in its parts, full and LoRA
        smollm2_step_rows(add, quick)
    if wanted("tool"):  # the calculator on against off, on the demo's policy
        for label, (calls, on, off) in zip(
            ("as it starts", "every row calling"), tool_overhead(quick, tries=2 if quick else 5)
        ):
            add(
                f"calculator on, demo model, {label}, {calls:.1f} calls a row",
                f"{on:,.0f} tok/s",
                f"calculator off: {off:,.0f} tok/s",
                f"{on / off:.2f}x",
                ">= 0.90x",
            )
    return print_table(lines, quick, started, machine)


def print_table(lines, quick, started, machine):
    print(
        f"\n`python -m scripts.bench_rollout{' --quick' if quick else ''}`: "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{(time.time() - started) / 60:.1f} min; "
        f"at the start fp32 GEMM {machine.gemm_flops / 1e9:.0f} GFLOP/s, "
        f"read {machine.read_bytes / 1e9:.1f} GB/s\n"
    )
    header = ("case", "engine", "compared with", "ratio", "target")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in lines:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
