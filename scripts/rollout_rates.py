"""
A rollout's rates, as scripts/bench_rollout.py and scripts/bench_smollm2.py measure them: the
shapes they run (random Qwen3-shaped models, SmolLM2-135M's), the engine's tokens a second and
transformers' `generate`'s on the same weights, a decode pass's parts, and the machine's ceiling.

Ceiling: the time a token needs at the machine's fp32 GEMM rate and read bandwidth (both measured
next to each run, best of several tries: the machine is shared), counting
    FLOPs: 2 x (linear weights, lm_head included)
           + 4 x heads x head_dim x context per layer (q.k and p.v)
    bytes: keys and values of the context, every layer, + all weights once per decode pass / rows
with the context averaged over the completion (prompt + half the new tokens). Time = FLOPs / GEMM
rate + bytes / bandwidth: no overlap of the two, no kernel overhead, no sampler, so no engine
reaches it.
"""

import math
import shutil
import tempfile
import time
from types import SimpleNamespace
from unittest import mock

import torch

from engine import Engine, next_logits
from fast import packed_linear
from fast.packed_linear import packed_linears
from fast.sampling import sample_next_token
from scripts import bench_rl_step
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
