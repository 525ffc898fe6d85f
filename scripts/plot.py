"""
Plot a run: python -m scripts.plot <out_dir> [more out_dirs ...] [--out=file.png]

Four panels against step: mean train reward (faint per step, with its running mean over SMOOTH
steps drawn solid), held-out pass@1 (solid), the largest pass@k logged (dashed) and greedy accuracy
(dotted, when eval rows carry it), mean completion length, and the share of completions that called
the calculator (solid, when train rows carry it) and that were truncated (dashed). Several out_dirs
(e.g. seeds) share the axes, one colour per run. Written to <first out_dir>/metrics.png.
matplotlib is imported here only, so training never needs it.
"""

import json
import os
import sys

USAGE = "usage: python -m scripts.plot <out_dir> [<out_dir> ...] [--out=file.png]"
# steps in the running mean of the train reward: one step's (16 problems; the demo's 12) is noisy
SMOOTH = 20


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


def running_mean(values, window):
    """Mean of the last `window` values at each point (fewer at the start): trails the data,
    never leads it."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def missing(out_dir):
    """What keeps out_dir from being plotted, in words, or None."""
    if not os.path.isdir(out_dir):
        return f"no such folder: {out_dir}"
    if not os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
        return (
            f"{out_dir} has no metrics.jsonl "
            "(the --out-dir of a chat_rl run holds one from its first step)"
        )
    return None


def plot(out_dirs, path=None):
    """Draw the runs of out_dirs into path (default <first out_dir>/metrics.png); return path."""
    fig = figure(out_dirs)
    path = path or os.path.join(out_dirs[0], "metrics.png")
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def figure(out_dirs):
    """The four panels of the runs of out_dirs, as a matplotlib Figure (the test reads its axes)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise SystemExit("plot: matplotlib is not installed (pip install matplotlib)") from None
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels = {ax: [] for ax in axes.flat}  # every value drawn on each panel, to size flat ones
    has_greedy = False
    for i, out_dir in enumerate(out_dirs):
        train, evals = read_metrics(out_dir)
        # one colour per run in every panel
        label, color = os.path.basename(os.path.normpath(out_dir)), f"C{i}"

        def draw(ax, xs, ys, *style, **kwargs):
            ax.plot(xs, ys, *style, color=color, **kwargs)
            panels[ax].extend(ys)

        steps = [r["step"] for r in train]
        rewards = [r["reward"] for r in train]
        draw(axes[0, 0], steps, rewards, alpha=0.25, lw=0.8)  # each step, faint
        draw(axes[0, 0], steps, running_mean(rewards, SMOOTH), label=label)
        ks = sorted({int(k[5:]) for r in evals for k in r if k.startswith("pass@")})
        eval_steps = [r["step"] for r in evals]
        # the headline pass@1 and the widest pass@k; one legend entry per run (the title says
        # which line is which, so the legend stays small enough to leave the curves' ends in view)
        for k, style in ((ks[0], "-"), (ks[-1], "--")) if ks else ():
            draw(
                axes[0, 1],
                eval_steps,
                [r.get(f"pass@{k}", float("nan")) for r in evals],
                style,
                marker="o",
                ms=3,
                label=label if style == "-" else None,
            )
        greedy = [r for r in evals if "greedy" in r]
        if greedy:
            has_greedy = True
            draw(
                axes[0, 1],
                [r["step"] for r in greedy],
                [r["greedy"] for r in greedy],
                ":",
                marker="s",
                ms=3,
            )
        draw(axes[1, 0], steps, [r["seq_len"] for r in train], alpha=0.7, label=label)
        has_tool = any("tool_use" in r for r in train)
        if has_tool:
            draw(
                axes[1, 1],
                steps,
                running_mean([r.get("tool_use", 0.0) for r in train], SMOOTH),
                label=label,
            )
        draw(
            axes[1, 1],
            steps,
            [r.get("truncated", 0.0) for r in train],
            "--",
            label=None if has_tool else label,
        )
    titles = [
        f"mean reward (train): per step (faint) and running mean of {SMOOTH} steps",
        "held-out pass@1 (solid), widest pass@k (dashed), T = 1.0"
        + ("; greedy (dotted)" if has_greedy else ""),
        "mean completion tokens",
        f"completions calling the calculator (mean of {SMOOTH} steps), truncated (dashed)",
    ]
    for ax, title in zip(axes.flat, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        # steps are whole numbers: no 2.5 ticks on short runs
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        values = [v for v in panels[ax] if v == v]  # nan (a pass@k a row lacks) is not a value
        if values and min(values) == max(values):
            # one value throughout (no truncation at all) would get matplotlib's +-0.04 band
            # around it; every panel holds values >= 0, so show 0 up to 1 (a fraction) or a little
            # past the value, with 0 a little above the bottom edge so a line at 0 is not hidden
            # under the axis
            top = max(1.0, 1.1 * values[0])
            ax.set_ylim(-0.03 * top, top)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right" if ax is axes[0, 1] else "best")
    fig.tight_layout()
    return fig


def main(argv):
    out_dirs = [a for a in argv if not a.startswith("--out=")]
    outs = [a[6:] for a in argv if a.startswith("--out=")]
    if out_dirs in (["-h"], ["--help"]):
        print(USAGE)
        return
    if not out_dirs or any(a.startswith("-") for a in out_dirs):
        raise SystemExit(USAGE)
    for out_dir in out_dirs:
        if missing(out_dir):
            raise SystemExit(f"plot: {missing(out_dir)}")
    print(plot(out_dirs, outs[0] if outs else None))


if __name__ == "__main__":
    main(sys.argv[1:])
