"""scripts/bench_rollout.py on tiny shapes: every row of its table still runs and reports real
figures (the full run takes ~10 minutes)."""

import re

from policy import lora
from policy.gpt import GPT, GPTConfig
from scripts import bench_rollout
from scripts.bench_rl_step import pass_flops, update_work

ROWS = (
    "tiny 1x4",
    "tiny 2x4",
    "transformers",
    "ceiling",
    "decode pass, top-k 0",
    "64 new tokens",
    "mixed lengths",
    "sampling",
    "log-prob pass peak",
    "RL step",
    "update against its own matmuls",
    "update, fast_logprobs",
    "LoRA rank 16",
    "calculator on, demo model, as it starts",
    "calculator on, demo model, every row calling",
    # SmolLM2-135M's rows, on a tiny Llama
    "fp32 GEMM, 512 x 512",
    "tiny-llama 2x4, 16 new tokens, top-k 0",
    "tiny-llama decode pass, 8 rows, weights packed",
    "tiny-llama head and sampler",
    "tiny-llama 2x4, 16 new tokens, engine in bf16",  # against transformers in fp32 and bf16
    *(
        f"tiny-llama RL step 2x4, 8 + 8 tokens, {kind}: {part}"
        for kind in ("full", "LoRA rank 16")
        for part in ("rollout", "log-probs", "backward", "optimizer")
    ),
    *(f"tiny-llama RL step 2x4, {kind}: whole step" for kind in ("full", "LoRA rank 16")),
)


def test_quick_bench_prints_every_row_with_finite_figures_and_positive_ratios(capsys):
    assert bench_rollout.main(["--quick"]) == 0
    table = capsys.readouterr().out.split("| case |", 1)[1]
    for row in ROWS:
        assert row in table, row
    rows = [
        line.strip("|").split(" | ") for line in table.splitlines()[2:] if line.startswith("| ")
    ]
    assert len(rows) == 35
    for case, engine, compared, ratio, _ in rows:
        assert not re.search(r"(?<![a-z])(nan|inf)", " ".join((engine, compared, ratio)), re.I), (
            case
        )
        # the ratio of two measured figures (speeds, times, sizes), computed before rounding:
        # above zero
        number = re.match(r"(?:engine )?(\d[\d,]*(?:\.\d+)?)", ratio)
        assert number and float(number.group(1).replace(",", "")) > 0, (case, ratio)
        # the figures themselves (some round to 0.0 s at these tiny shapes): there, and numbers
        assert re.search(r"\d", engine) and re.search(r"\d", compared), case


def test_the_step_breakdowns_passes_count_every_matmul_of_the_update_and_no_frozen_gradient():
    config = GPTConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    kept = [([1, 2, 3, 4, 5], [0, 0, 1, 1, 1]), ([1, 2, 3, 6], [0, 0, 1, 1])]  # prompt 1 2 3, twice
    work = update_work(config, kept, samples=2)
    full = pass_flops(GPT(config), work)
    assert sum(full) == work["weight_flops"] + work["attention_flops"]  # the update's, in 2 passes
    model = lora.add_adapters(GPT(config), 2, 4.0)  # frozen base and head, rank 2 everywhere
    # a position's adapter FLOPs, 2 x rank x projections x (in + out) a Linear: q/k/v 2 * 6 * 24,
    # o 2 * 2 * 16, gate/up 2 * 4 * 40, down 2 * 2 * 24; the backward pass twice the forward's
    adapters = 768 * work["positions"]
    # no gradient of the head's weight in the log-probs pass, none of the layers' in the backward
    assert pass_flops(model, work) == (
        full[0] - work["head_flops"] + adapters,
        full[1] - work["body_flops"] + 2 * adapters,
    )
