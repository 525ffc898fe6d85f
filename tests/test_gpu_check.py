"""scripts/gpu_check.py on tiny CPU shapes, in CUDA's precision (bf16 autocast, bf16 gathers, a bf16
LoRA base; two gloo ranks where a GPU machine has two NCCL ones): every check still runs end to end,
so that the command meant for a GPU has run before it first meets one, and each result comes with
the line that says what it means."""

import pytest
import torch

from scripts import gpu_check
from scripts.bench_rl_step import update_against_floor


def test_quick_cpu_run_passes_every_check(capsys):
    assert gpu_check.main(["--quick", "--device-type=cpu"]) == 0
    table = capsys.readouterr().out.split("| check | result | note |", 1)[1]
    cells = [
        line.split(" | ")
        for line in table.splitlines()
        if line.startswith("| ") and "---" not in line
    ]
    rows = {cell[0].strip("| "): cell[1] for cell in cells}
    assert list(rows) == gpu_check.CHECKS
    for check, result in rows.items():
        assert result in ("pass", "ran (CPU)"), (check, result)
    # then one line a check: what its result means for a run
    meanings = table.split("what this means for a run here:\n", 1)[1].splitlines()
    for line, (check, result) in zip(meanings, rows.items(), strict=True):
        assert line == f"  {check}: {result}: {gpu_check.meaning(check, result)}"


def test_the_update_floor_prices_every_matmul_at_the_updates_own_precision():
    # the head's gradient matmuls run in bf16 under autocast too (fast/logprobs.add_chunk_grads):
    # priced at fp32's rate (without TF32 on a GPU), the floor would hide their own cost
    work = dict(weight_flops=2 * 64**3, attention_flops=0)
    for dtype in (torch.bfloat16, torch.float32):
        _, floor, rates = update_against_floor(lambda: None, work, torch.device("cpu"), dtype, n=64)
        assert list(rates) == [dtype] and floor == pytest.approx(
            work["weight_flops"] / rates[dtype]
        )
