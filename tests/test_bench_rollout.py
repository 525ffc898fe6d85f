"""tools/bench_rollout.py on tiny shapes: every row of its table still runs (the full run takes ~10 minutes)."""

from tools import bench_rollout


def test_quick_bench_prints_every_row(capsys):
    assert bench_rollout.main(["--quick"]) == 0
    table = capsys.readouterr().out.split("| case |", 1)[1]
    for row in ("tiny 1x4", "tiny 2x4", "transformers", "ceiling", "decode step, top-k 0", "64 new tokens", "mixed lengths",
                "sampling", "log-prob pass peak", "RL step", "each prompt run once"):
        assert row in table, row
