"""
gpu_check's checks of the engine, each in the precision chat_rl samples in on CUDA (fp32 weights,
bf16 autocast): its tokens a second against the device's ceiling, a profile of its decode passes
(launch-bound?), rows that stop early against rows that run to the budget, and the bf16 sampler's
log-probs against the bf16 trainer's. Each takes gpu_check.Setup (device, batch shapes, the shared
random model, its clock) and returns (result, note) or raises.
"""

from types import SimpleNamespace

import torch

from engine import Engine
from policy.gpt import GPTConfig
from scripts import bench_mixed_lengths, rollout_rates
from scripts.bench_rl_step import Tokenizer


def check_rollout(s):
    model = s.model()
    vocab = model.config.vocab_size
    engine = Engine(model, Tokenizer(vocab))  # no stop tokens: every row makes new_tokens
    prompts = rollout_rates.random_prompts(s.prompts, s.prompt_len, vocab)
    with s.autocast():
        (_, warm) = s.timed(
            lambda: engine.generate_batch(
                prompts, s.samples, max(2, s.new_tokens // 8), 1.0, None, seed=0
            )
        )
        if s.cuda:
            torch.cuda.reset_peak_memory_stats()
        (_, masks), seconds = s.timed(
            lambda: engine.generate_batch(prompts, s.samples, s.new_tokens, 1.0, None, seed=1)
        )
    rows = s.prompts * s.samples
    assert sum(map(sum, masks)) == rows * s.new_tokens, "rows without stop tokens stopped early"
    tok_s = rows * s.new_tokens / seconds
    peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if s.cuda else ""
    rates = device_rates(s)
    ceiling = rollout_rates.ceiling_tokens_per_s(
        GPTConfig(**s.config), rows, s.prompt_len, s.new_tokens, rates, bf16=True
    )
    note = (
        f"{tok_s:,.0f} tok/s ({rows} rows x {s.new_tokens} tokens in {seconds:.2f} s{peak}; "
        f"warm-up {warm:.1f} s), {rollout_rates.percent(tok_s / ceiling)} of this device's "
        f"ceiling {ceiling:,.0f} tok/s (bf16 matmuls {rates.bf16_flops / 1e12:.3g} TFLOP/s, reads "
        f"{rates.read_bytes / 1e9:.3g} GB/s)"
    )
    print("  " + note)
    return s.verdict(tok_s >= ROLLOUT_SHARE * ceiling), note + ", target >= 40%"


# the rollout's target share of the device's ceiling: 100,000 tok/s, the target an H200 was once
# given, is 34% of this shape's ceiling on an H200 and 43% on an H100 (700 TFLOP/s; 4.3, 3.0 TB/s)
ROLLOUT_SHARE = 0.4


def device_rates(s):
    """This device's bf16 matmul rate (square matmuls) and read bandwidth (a sum over a tensor far
    past its caches), measured now, the best of three: rollout_rates' ceiling of a decode pass."""
    n, size = (512, 2 * 2**20) if s.quick else (8192, 256 * 2**20)  # 8 MB / 1 GB of fp32
    a, b = (torch.randn(n, n, device=s.device, dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn(size, device=s.device)
    a @ b, x.sum()  # warm-up: cuBLAS's handle, the kernels' first launch
    flops = 2 * n**3 / min(s.timed(lambda: a @ b)[1] for _ in range(3))
    read = x.numel() * 4 / min(s.timed(lambda: x.sum())[1] for _ in range(3))
    return SimpleNamespace(bf16_flops=flops, read_bytes=read)


def gpu_busy_us(prof):
    """Microseconds the GPU spent in kernels (and copies) during a profile: the device-side
    events' durations (not the annotations that newer profilers mirror onto the GPU timeline:
    they span kernels already counted)."""
    return sum(
        e.time_range.elapsed_us()
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
    )


def check_profile(s):
    model = s.model()
    vocab = model.config.vocab_size
    engine = Engine(model, Tokenizer(vocab))
    prompts = rollout_rates.random_prompts(s.prompts, s.prompt_len, vocab)
    n = s.profile_tokens

    def call(tokens):
        return engine.generate_batch(prompts, s.samples, tokens, 1.0, None, seed=1)

    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if s.cuda else []
    )
    with s.autocast():
        call(n)  # warm-up
        # one token = prefill + sampling, no decode pass;
        # n tokens = the same + n - 1 decode passes: the difference is theirs
        wall = {k: min(s.timed(lambda: call(k))[1] for _ in range(3)) for k in (1, n)}
        busy = {}
        for k in (1, n):
            with torch.profiler.profile(activities=activities) as prof:
                call(k)
                s.sync()
            busy[k] = gpu_busy_us(prof)
    events = prof.key_averages()
    key = (
        "cpu_time_total"
        if not s.cuda
        else "device_time_total"
        if hasattr(events[0], "device_time_total")
        else "cuda_time_total"
    )
    print(events.table(sort_by=key, row_limit=15))
    step_ms = (wall[n] - wall[1]) / (n - 1) * 1e3
    note = f"decode pass {step_ms:.2f} ms wall ({s.prompts * s.samples} rows)"
    if s.cuda:
        busy_ms = (busy[n] - busy[1]) / (n - 1) / 1e3
        note += (
            f", GPU busy {busy_ms:.2f} ms ({busy_ms / step_ms:.0%}; far below 100% = launch-bound)"
            if busy[n] > 0
            else ", no GPU events recorded (CUPTI?): busy time unknown"
        )
    print("  " + note)
    return "pass", note


def check_mixed(s):
    model = s.model()
    prompts = rollout_rates.random_prompts(s.prompts, s.prompt_len, model.config.vocab_size)
    # bench_rollout's own measurement (bench_mixed_lengths):
    # force_stops makes row r stop after a spread length
    with s.autocast():
        useful, mixed, full = bench_mixed_lengths.mixed_lengths(
            model, prompts, s.samples, s.new_tokens, None, s.min_len, tries=1
        )
    note = (
        f"{mixed / full:.2f}x: {mixed:.2f} s with stops at {s.min_len}..{s.new_tokens} "
        f"({useful / mixed:,.0f} useful tok/s), "
        f"{full:.2f} s all to {s.new_tokens}"
    )
    print("  " + note)
    return s.verdict(mixed / full <= 0.65), note + ", target <= 0.65x"


def check_gap(s):
    """The engine's log-probs of the tokens it drew, in bf16 as a run samples, against the
    training pass's of the same rows, in bf16 as a run trains: the gap every train row logs
    (mismatch_*), and the share of tokens a --rollout-cap of 2 would act on. A random model's
    distributions are flatter than a trained one's: a real model's gap is the one to watch."""
    from fast.logprobs import fast_logprobs, make_batch
    from plumbing import metrics
    from plumbing.passes import token_values  # the loss's own layout of the sampler's numbers

    model = s.model()
    vocab = model.config.vocab_size
    prompts = rollout_rates.random_prompts(s.prompts, s.prompt_len, vocab)
    new_tokens = max(4, s.new_tokens // 4)
    with s.autocast(), torch.no_grad():
        out = Engine(model, Tokenizer(vocab)).generate(prompts, s.samples, new_tokens, 1.0, None)
        inputs, targets = make_batch(out.sequences, out.masks, s.device)
        trainer = fast_logprobs(model, inputs, targets, 1.0, vocab_size=vocab)
    rows = range(len(out.sequences))
    sampler = token_values(out.logprobs, rows, s.device)
    gap = metrics.sampler_gap(trainer, sampler, targets >= 0, cap=2.0)
    row = metrics.gap_row([gap], int((targets >= 0).sum()), s.device)
    note = (
        f"k3 {row['mismatch_k3']:.2e} a token, ratio {row['mismatch_ratio_min']:.3f}.."
        f"{row['mismatch_ratio_max']:.3f}, {row['mismatch_past_cap']:.2%} past a cap of 2"
    )
    print("  " + note)
    return ("pass" if row["mismatch_past_cap"] < 0.01 else "wide"), note
