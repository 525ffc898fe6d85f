"""python -m tools.plot draws a run's metrics.jsonl into a PNG, torn last lines and all."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plot_writes_a_png_of_a_run(tmp_path):
    rows = [{"step": s, "reward": 0.5 + s / 10, "seq_len": 30 - s, "truncated": 0.0} for s in range(4)]
    rows += [{"step": s, "split": "eval", "pass@1": 0.4 + s / 10, "pass@2": 0.6 + s / 20} for s in (0, 2, 4)]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.write('{"step": 4, "rew')  # a run killed mid-line
    result = subprocess.run([sys.executable, "-m", "tools.plot", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_a_run_says_how_to_use_it(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tools.plot", str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode != 0 and "usage: python -m tools.plot" in result.stderr
