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

The ceiling each row is held to, and how a rate is measured: scripts/rollout_rates.py. Beside the
ceiling: completions 4x as long (512 new tokens), and the ATen operations one decode pass
dispatches, the engine's and transformers' on the same batch (scripts/op_count.py): on a GPU each
is at least one kernel launch, which at RL's small per-row work is what a decode pass costs.
"""

import argparse
import functools
import os
import sys
import time

import torch

from engine import Engine
from policy import lora
from policy.gpt import GPT, GPTConfig
from scripts import bench_memory, bench_rl_step, op_count
from scripts.bench_mixed_lengths import mixed_floor, mixed_lengths
from scripts.bench_rl_step import Tokenizer, best_of
from scripts.bench_smollm2 import smollm2_bf16_rows, smollm2_rows, smollm2_step_rows
from scripts.rollout_rates import (
    CONFIGS,
    FULL_VOCAB,
    ceiling_tokens_per_s,
    engine_tokens_per_s,
    load_transformers,
    measure_machine,
    percent,
    random_prompts,
    sampling_vs_decode,
    transformers_generate,
    transformers_tokens_per_s,
)


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
