"""
Plot a run: python -m tools.plot <out_dir> [more out_dirs ...] [--out=file.png]

Four panels against step: mean reward, held-out pass@1 (solid) and the largest pass@k logged
(dashed), mean completion length and truncation rate. Several out_dirs (e.g. seeds) share the axes. Written to <first out_dir>/metrics.png.
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
    for i, out_dir in enumerate(out_dirs):
        train, evals = read_metrics(out_dir)
        label, color = os.path.basename(os.path.normpath(out_dir)), f"C{i}"  # one colour per run in every panel
        steps = [r["step"] for r in train]
        axes[0, 0].plot(steps, [r["reward"] for r in train], color=color, label=label, alpha=0.7)
        ks = sorted((int(k[5:]) for k in (evals[0] if evals else {}) if k.startswith("pass@")))
        eval_steps = [r["step"] for r in evals]
        for k, style in ((ks[0], "-"), (ks[-1], "--")) if ks else ():  # the headline pass@1 and the widest pass@k
            axes[0, 1].plot(eval_steps, [r[f"pass@{k}"] for r in evals], style, marker="o", ms=3, color=color,
                            label=f"{label} pass@{k}")
        axes[1, 0].plot(steps, [r["seq_len"] for r in train], color=color, label=label, alpha=0.7)
        axes[1, 1].plot(steps, [r.get("truncated", 0.0) for r in train], color=color, label=label)
    for ax, title in zip(axes.flat, ["mean reward (train)", "held-out pass@1 and pass@k (temperature 1.0)",
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
        raise SystemExit("usage: python -m tools.plot <out_dir> [<out_dir> ...] [--out=file.png] (each holding metrics.jsonl)")
    print(plot(args, outs[0] if outs else None))
