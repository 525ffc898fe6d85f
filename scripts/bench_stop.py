"""
How long a run takes to stop:
    python -m scripts.bench_stop [--line="step 0/"] [--after=2] [--signal=SIGTERM] -- <flags>

Starts `python -m chat_rl <flags>` into a fresh --out-dir, sends the signal --after seconds after
the first console line that starts with --line, and prints the seconds from the signal to the
process's exit, its exit status, the checkpoints it left and its last lines. After "step 0/" comes
step 1: its eval with --eval-every=1, else its rollout; after "chat_rl: task=", the start line,
comes the eval at step 0 (nothing finished yet, so nothing to save). docs/runs.md and
docs/benchmarks.md quote what it measured.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time


def main():
    p = argparse.ArgumentParser(description="seconds from a stop signal to a run's exit")
    p.add_argument("--line", default="step 0/", help="the console line that starts the wait")
    p.add_argument("--after", type=float, default=2.0, help="seconds after that line")
    p.add_argument("--signal", default="SIGTERM")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="-- then chat_rl's flags")
    args = p.parse_args()
    out_dir = tempfile.mkdtemp(prefix="bench_stop-")
    flags = [f for f in args.flags if f != "--"] + [f"--out-dir={out_dir}"]
    run = subprocess.Popen(
        [sys.executable, "-m", "chat_rl", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    lines, sent, waiting = [], [], []

    def signal_later():
        time.sleep(args.after)
        sent.append(time.monotonic())
        run.send_signal(getattr(signal, args.signal))

    for line in run.stdout:  # read to the end: a child writing into a full pipe would wait
        lines.append(line.rstrip())
        if line.startswith(args.line) and not waiting:
            waiting.append(threading.Thread(target=signal_later, daemon=True))
            waiting[0].start()
    code = run.wait()
    seconds = time.monotonic() - sent[0] if sent else float("nan")
    saved = sorted(d for d in os.listdir(out_dir) if d.startswith("step_"))
    print(
        f"{seconds:.1f} s from {args.signal} to exit, {args.after} s after {args.line!r}: exit "
        f"status {code}, checkpoints {', '.join(saved) or 'none'}"
    )
    print("  ", "\n   ".join(lines[-3:]))


if __name__ == "__main__":
    main()
