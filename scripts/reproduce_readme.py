"""
The README's tables, rerun and printed as the README shows them:

    # 6 demo runs, ~3.5 min each on 2 CPU cores, into runs/readme/
    python -m scripts.reproduce_readme
    # only print the table of runs already in DIR
    python -m scripts.reproduce_readme --out=DIR --print
    # docs/benchmarks.md's LoRA table: 3 seeds x full, rank 1, 16
    python -m scripts.reproduce_readme --lora
    # the real model's tables: 3 seeds and LoRA, 4 runs of ~10-16 min (~50 min in all)
    python -m scripts.reproduce_readme --smollm2

Each row is `python -m chat_rl --preset=demo` (--preset=smollm2 with --smollm2) with the flags
below and --out-dir=DIR/<name>; a folder that already holds a finished run (its last step's eval)
is read, not rerun. The table is step 0 -> the last step's held-out eval.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from chat_rl import PRESETS

RUNS = {  # name: (the row's label, its flags beside --preset=demo)
    "seed0": ("seed 0", ["--seed=0"]),
    "seed1": ("seed 1", ["--seed=1"]),
    "seed2": ("seed 2", ["--seed=2"]),
    "seed0-none": ("seed 0, `--tool=none`", ["--seed=0", "--tool=none"]),
    "seed0-plain": ("seed 0, `--logprobs=plain`", ["--seed=0", "--logprobs=plain"]),
    "seed0-kept": ("seed 0, `--loss-norm=kept_tokens`", ["--seed=0", "--loss-norm=kept_tokens"]),
}
# SmolLM2-135M-Instruct (README "A real model on a laptop", docs/smollm2.md), full and LoRA
SMOLLM2_RUNS = {
    **{f"smollm2-seed{i}": (f"seed {i}", [f"--seed={i}"]) for i in range(3)},
    "smollm2-seed0-r16": ("seed 0, `--lora-rank=16`", ["--seed=0", "--lora-rank=16"]),
}
# the seeds of full fine-tuning above, beside LoRA at rank 1 and 16 (--preset=demo's --lora-lr)
LORA_RUNS = {
    **{f"seed{i}": (f"seed {i}, full", [f"--seed={i}"]) for i in range(3)},
    **{
        f"seed{i}-r{r}": (f"seed {i}, `--lora-rank={r}`", [f"--seed={i}", f"--lora-rank={r}"])
        for r in (1, 16)
        for i in range(3)
    },
}


def evals(folder):
    """The eval rows of a run's metrics.jsonl, in order (none if it has none)."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [row for row in map(json.loads, f) if row.get("split") == "eval"]


def row(label, first, last, tool):
    widest = max(int(k[5:]) for k in first if k.startswith("pass@"))

    def change(key):
        a, b = 100 * first[key], 100 * last[key]
        return f"{a:.1f}% -> {b:.1f}% ({b - a:+.1f})"

    cells = [
        label,
        change("pass@1"),
        change("greedy"),
        f"{100 * first[f'pass@{widest}']:.1f}% -> {100 * last[f'pass@{widest}']:.1f}%",
    ]
    cells += (
        [
            f"{100 * first['tool_use']:.1f}% -> {100 * last['tool_use']:.1f}%",
            f"{100 * first['greedy_tool_use']:.0f}% -> {100 * last['greedy_tool_use']:.0f}%",
        ]
        if tool
        else ["(off)", "(off)"]
    )
    return "| " + " | ".join(cells) + " |"


def main(argv=None):
    p = argparse.ArgumentParser(description="rerun the README's demo table and print it")
    p.add_argument("--out", default="runs/readme", help="one folder per run goes here")
    p.add_argument(
        "--print",
        action="store_true",
        dest="print_only",
        help="print the table of the runs there, run nothing",
    )
    p.add_argument(
        "--lora",
        action="store_true",
        help="the LoRA table (3 seeds x full, rank 1, rank 16) instead",
    )
    p.add_argument(
        "--smollm2", action="store_true", help="the real model's tables (--preset=smollm2) instead"
    )
    args = p.parse_args(argv)
    preset = "smollm2" if args.smollm2 else "demo"
    runs, seconds = SMOLLM2_RUNS if args.smollm2 else LORA_RUNS if args.lora else RUNS, {}
    last_step = PRESETS[preset]["num_steps"]
    for name, (_, flags) in runs.items():
        folder = os.path.join(args.out, name)
        if args.print_only or any(e["step"] == last_step for e in evals(folder)):
            continue
        if os.path.exists(folder):
            sys.exit(
                f"reproduce_readme: {folder} holds an unfinished run: "
                "delete it or pass another --out"
            )
        command = ["-m", "chat_rl", f"--preset={preset}", *flags, f"--out-dir={folder}"]
        print(f"reproduce_readme: {name}: python {' '.join(command)}", flush=True)
        t0 = time.time()
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        subprocess.run([sys.executable, *command], env=env, check=True, stdout=subprocess.DEVNULL)
        seconds[name] = time.time() - t0
    for name, s in seconds.items():
        print(f"{name}: {s / 60:.1f} min, start to end")
    if args.lora:
        return print_lora_table(args.out)
    if args.smollm2:
        return print_smollm2_tables(args.out)
    print(
        "\n| run | pass@1 (T = 1) | greedy (T = 0) | pass@8 "
        "| samples calling the tool | greedy calling it |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (label, flags) in RUNS.items():
        rows = evals(os.path.join(args.out, name))
        if len(rows) >= 2:
            print(row(label, rows[0], rows[-1], tool="--tool=none" not in flags))
    return 0


def print_lora_table(out):
    """Each run's step 0 -> 150 (greedy, pass@1, the widest pass@k, tool use), its trained
    parameters (the run's first line) and its wall time (its train rows' step times, summed)."""
    print(
        "\n| run | trained parameters | pass@1 (T = 1) | greedy (T = 0) | pass@8 "
        "| samples calling the tool | time in steps |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (label, flags) in LORA_RUNS.items():
        rows = evals(os.path.join(out, name))
        if len(rows) < 2:
            continue
        first, last = rows[0], rows[-1]
        with open(os.path.join(out, name, "metrics.jsonl")) as f:
            minutes = (
                sum(r.get("step_time_s", 0) for r in map(json.loads, f) if "split" not in r) / 60
            )
        rank = int(next((f.split("=")[1] for f in flags if f.startswith("--lora-rank")), 0))
        cells = [label, f"{trained_parameters(rank):,}"]
        cells += [
            f"{100 * first[k]:.1f}% -> {100 * last[k]:.1f}%"
            for k in ("pass@1", "greedy", "pass@8", "tool_use")
        ]
        print("| " + " | ".join(cells + [f"{minutes:.1f} min"]) + " |")
    return 0


def print_smollm2_tables(out):
    """The real model's runs: step 0 -> the last eval of pass@1, greedy, the widest pass@k and the
    mean completion length, each run's time in steps and evals; then pass@1..16 at both ends."""
    ks = (1, 2, 4, 8, 16)
    print(
        "\n| run | pass@1 (T = 1) | greedy (T = 0) | pass@16 "
        "| reply length (tokens) | time in steps and evals |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    found = {}
    for name, (label, _) in SMOLLM2_RUNS.items():
        rows = evals(os.path.join(out, name))
        if len(rows) < 2:
            continue
        first, last = found[label] = rows[0], rows[-1]
        cells = [
            label,
            *(change(first, last, key) for key in ("pass@1", "greedy")),
            f"{100 * first['pass@16']:.1f}% -> {100 * last['pass@16']:.1f}%",
            f"{first['seq_len']:.0f} -> {last['seq_len']:.0f}",
            f"{run_seconds(os.path.join(out, name)) / 60:.0f} min",
        ]
        print("| " + " | ".join(cells) + " |")
    print("\n| run | " + " | ".join(f"pass@{k}" for k in ks) + " |")
    print("| --- |" + " --- |" * len(ks))
    for label, (first, last) in found.items():
        cells = [f"{100 * first[f'pass@{k}']:.1f} -> {100 * last[f'pass@{k}']:.1f}" for k in ks]
        print(f"| {label} | " + " | ".join(cells) + " |")
    return 0


def change(first, last, key):
    a, b = 100 * first[key], 100 * last[key]
    return f"{a:.1f}% -> {b:.1f}% ({b - a:+.1f})"


def run_seconds(folder):
    """A run's time in its steps and its evals, from its rows: all of it but loading the model and
    the checkpoints."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return sum(
            row.get("step_time_s", 0) + row.get("eval_time_s", 0) for row in map(json.loads, f)
        )


def trained_parameters(rank):
    """The demo model's trained parameters: all of them (rank 0), or its adapters' at a rank,
    every projection."""
    from plumbing.checkpoint import load_policy
    from policy import lora

    model = load_policy("demo_model", "cpu")[0]
    model = lora.add_adapters(model, rank, 32.0) if rank else model
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


if __name__ == "__main__":
    sys.exit(main())
