"""
SmolLM2-135M's rows of scripts/bench_rollout.py's table (--only=smollm2, smollm2-bf16,
smollm2-step), a real model's shape with random weights: the engine against transformers and its
ceiling, in fp32 and bf16, and one RL step in its parts beside their floors.
"""

from types import SimpleNamespace

import torch

from policy import lora
from policy.gpt import GPT, GPTConfig
from scripts import bench_rl_step
from scripts.rollout_rates import (
    CONFIGS,
    bf16_gemm_flops,
    ceiling_tokens_per_s,
    duration,
    engine_tokens_per_s,
    load_transformers,
    measure_machine,
    packed_vs_plain_decode,
    percent,
    random_prompts,
    rollout_floor,
    sampling_vs_decode,
    transformers_tokens_per_s,
)


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
