"""
Plot a run: python -m plot <out_dir> [more out_dirs ...] [--out=file.png]

Four panels against step: mean reward, held-out pass@k, mean completion length and truncation
rate. Several out_dirs (e.g. seeds) share the axes. Written to <first out_dir>/metrics.png.
matplotlib is imported here only, so training never needs it.
"""

import json
import os
import sys


def read_metrics(out_dir):
    train, evals = [], []
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line of a killed run
            (evals if row.get("split") == "eval" else train).append(row)
    return train, evals


def plot(out_dirs, path=None):
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot: matplotlib is not installed (pip install matplotlib)") from None
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for out_dir in out_dirs:
        train, evals = read_metrics(out_dir)
        label = os.path.basename(os.path.normpath(out_dir))
        steps = [r["step"] for r in train]
        axes[0, 0].plot(steps, [r["reward"] for r in train], label=label, alpha=0.8)
        ks = sorted((k for k in (evals[0] if evals else {}) if k.startswith("pass@")), key=lambda k: int(k[5:]))
        for k in ks:
            axes[0, 1].plot([r["step"] for r in evals], [r[k] for r in evals], marker="o", ms=3,
                            label=f"{label} {k}", alpha=0.9 if k == "pass@1" else 0.4)
        axes[1, 0].plot(steps, [r["seq_len"] for r in train], label=label)
        axes[1, 1].plot(steps, [r.get("truncated", 0.0) for r in train], label=label)
    for ax, title in zip(axes.flat, ["mean reward (train)", "held-out pass@k (temperature 1.0)",
                                     "mean completion tokens", "truncated completions (fraction)"]):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = path or os.path.join(out_dirs[0], "metrics.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--out=")]
    outs = [a[6:] for a in sys.argv[1:] if a.startswith("--out=")]
    if not args or any(not os.path.exists(os.path.join(a, "metrics.jsonl")) for a in args):
        raise SystemExit("usage: python -m plot <out_dir> [<out_dir> ...] [--out=file.png] (each holding metrics.jsonl)")
    print(plot(args, outs[0] if outs else None))
