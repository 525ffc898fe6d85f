"""scripts/bench_rollout.py on tiny shapes: every row of its table still runs and reports real figures
(the full run takes ~10 minutes)."""

import re

from scripts import bench_rollout

ROWS = ("tiny 1x4", "tiny 2x4", "transformers", "ceiling", "decode pass, top-k 0", "64 new tokens", "mixed lengths",
        "sampling", "log-prob pass peak", "RL step", "update against its own matmuls", "update, fast_logprobs", "LoRA rank 16", "calculator on, demo model, as it starts",
        "calculator on, demo model, every row calling")


def test_quick_bench_prints_every_row_with_finite_figures_and_positive_ratios(capsys):
    assert bench_rollout.main(["--quick"]) == 0
    table = capsys.readouterr().out.split("| case |", 1)[1]
    for row in ROWS:
        assert row in table, row
    rows = [line.strip("|").split(" | ") for line in table.splitlines()[2:] if line.startswith("| ")]
    assert len(rows) == 16
    for case, engine, compared, ratio, _ in rows:
        assert not re.search(r"(?<![a-z])(nan|inf)", " ".join((engine, compared, ratio)), re.I), case
        # the ratio of two measured figures (speeds, times, sizes), computed before rounding: above zero
        number = re.match(r"(?:engine )?(\d[\d,]*(?:\.\d+)?)", ratio)
        assert number and float(number.group(1).replace(",", "")) > 0, (case, ratio)
        # the figures themselves (some round to 0.0 s at these tiny shapes): there, and numbers
        assert re.search(r"\d", engine) and re.search(r"\d", compared), case
