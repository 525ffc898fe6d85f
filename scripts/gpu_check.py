"""
What chat_rl does on a CUDA GPU, checked in one command: the one to run first on a new GPU or a new
torch.

    python -m scripts.gpu_check 2>&1 | tee gpu_check.txt  # CUDA, Qwen2.5-0.5B shape, ~5-7 min
    python -m scripts.gpu_check --quick --device-type=cpu  # the same checks, tiny shapes: seconds
    python -m scripts.gpu_check --only=rollout,shared_loss  # some checks (a prefix selects several)
    python -m scripts.gpu_check --shape=smollm2-135m  # another model's shape (bench_rl_step.SHAPES)

Checks (a model of the Qwen2.5-0.5B shape, or --shape's, with random weights; fp32 weights
computing in bf16 under autocast, as chat_rl runs on CUDA, and on the CPU too, whose autocast has
bf16: CI runs the paths a GPU will; nothing is downloaded):
    env          device, torch, CUDA, bf16 support
    run          python -m chat_rl itself on this shape: the calculator on, 768-token replies,
                 --activation-checkpointing, a checkpoint a step, --resume; two GPUs: torchrun.
                 A step's time in its parts, its peak memory against the plan (plumbing/memory.py)
    rollout      engine tokens/s, 16 prompts x 16 samples x 256 new tokens, no stop, against this
                 device's ceiling (its bf16 matmul rate and read bandwidth, measured beside it;
                 target >= 40% of it: about 93,000 tok/s on an H100, 117,000 on an H200)
    profile      torch.profiler over a few decode passes: wall ms vs GPU-busy ms a step
                 (launch-bound?)
    shared_loss  the loss's log-probs as chat_rl trains with them (fast, told the loss's gradient)
                 and as any loss takes them, against the plain ones, in bf16 and fp32
    fsdp_loss    the same loss under --fsdp (one rank: bf16 all-gathers and compute) against the
                 whole model in fp32
    two_ranks    a step on two ranks (NCCL; not run with one GPU visible): the gradient sum,
                 replicated and under --fsdp, against one process; --fsdp's matched passes, its
                 gathered weights, a rollout inside one gather
    lora         LoRA on a bf16 base against the fp32 base (the adapters' gradient), its NLL, a
                 rollout, the checkpoint's merged weights made on the CPU (the GPU's added peak)
    update       one RL update (loss, backward, AdamW) on the rollout batch against its FLOPs at the
                 matmul rate (target >= 75%)
    mixed        rows stopping at 16..256 tokens against all rows running to 256 (target <= 0.65x)
    gap          the bf16 sampler against the bf16 trainer on the rollout's tokens: the train rows'
                 mismatch_* (metrics.sampler_gap), and what --rollout-correction would act on
(rollout, profile, mixed and gap, the engine's checks, are in scripts/gpu_check_rollout.py;
shared_loss to update, the training pass's, in scripts/gpu_check_training.py; run in
scripts/gpu_check_run.py.)
Each check runs in its own try/except: a failure prints its one-line error and the next check runs;
the script ends with a markdown table, then one line per check saying what its result means for a
run, and exits 1 if any check failed (a missed speed target is reported, not failed). A time limit's
SIGTERM cuts off the check under way and the table still prints; no check starts after --budget-s
seconds (default 480). Expected wall time on an H200 (guessed: nothing here has run on one yet):
model init ~15 s (random init on the CPU), run ~2-3 min (two launches of chat_rl, each ~20 s to
start and ~15 s a checkpoint; two GPUs: one more), rollout ~10-30 s (two engine calls), profile ~10
s, shared_loss ~10 s, fsdp_loss ~10 s, two_ranks ~40-60 s (each rank builds the model on its CPU),
lora ~10-20 s, update ~10-20 s, mixed ~10-30 s, gap ~10 s: about 5-7 minutes in all.
"""

import argparse
import os
import signal
import sys
import time
import traceback
from contextlib import nullcontext

import torch

from policy.gpt import GPT, GPTConfig
from scripts import rollout_rates
from scripts.bench_rl_step import SHAPES
from scripts.gpu_check_rollout import check_gap, check_mixed, check_profile, check_rollout
from scripts.gpu_check_run import check_run
from scripts.gpu_check_training import (
    check_fsdp_loss,
    check_lora,
    check_shared_loss,
    check_two_ranks,
    check_update,
)

BENCH_RL_STEP = (
    "python -m scripts.bench_rl_step --shape=qwen2.5-0.5b --device-type=cuda --steps=3 "
    "--device-batch-size=32"
)


class OutOfTime(BaseException):  # not an Exception: no library's `except Exception` swallows it
    """Raised by the SIGTERM handler: the check under way stops, the report goes on."""


def out_of_time(signum, frame):
    raise OutOfTime("SIGTERM (a time limit): the checks after this one did not run")


class Setup:
    """What every check shares: the device, the shapes of its batches, one random model, and its
    clock and verdicts."""

    def __init__(self, device_type, quick, shape="qwen2.5-0.5b"):
        self.device, self.cuda, self.quick, self.built = (
            torch.device(device_type),
            device_type == "cuda",
            quick,
            None,
        )
        self.config = (
            dict(rollout_rates.CONFIGS["tiny"], attention_bias=True) if quick else SHAPES[shape]
        )
        # rollouts: prompts x samples rows, prompts of prompt_len random tokens, new_tokens each
        # (mixed: stops from min_len)
        self.prompts, self.samples, self.prompt_len, self.new_tokens, self.min_len = (
            (4, 4, 16, 32, 4) if quick else (16, 16, 128, 256, 16)
        )
        self.profile_tokens = 4 if quick else 8
        # shared_loss: prompts x samples rows, prompt and completion lengths drawn from these ranges
        self.loss_batch = (3, 3, (4, 12), (2, 16)) if quick else (4, 4, (64, 128), (32, 256))
        # weights stay fp32 and the matmuls run in bf16 (chat_rl's setup on CUDA), on the CPU as
        # well: slow there, but it runs CUDA's paths; fp32 beside it where a check compares tightly
        self.dtype = torch.bfloat16
        bf16 = ("bf16", lambda: torch.autocast(device_type, dtype=torch.bfloat16))
        self.precisions = [bf16, ("fp32", nullcontext)]
        self.autocast = self.precisions[0][1]

    def model(self):
        """One random model for every check (building the 0.5B one on the CPU takes seconds)."""
        if self.built is None:
            t0 = time.perf_counter()
            self.built = GPT(GPTConfig(**self.config)).init_weights(0).to(self.device)
            print(
                f"  model: {self.built.num_params() / 1e6:.1f}M parameters, "
                f"built in {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
        return self.built.eval()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn):
        """(fn(), seconds), the GPU's queue drained on both sides."""
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - t0

    def verdict(self, met):
        # each speed target is against this device's own rates or times, measured beside it
        return ("pass" if met else "below target") if self.cuda else "ran (CPU)"


# ---- the checks: each returns (result, note) or raises -------------------------------------------
def check_env(s):
    print(
        f"  torch {torch.__version__}, python {sys.version.split()[0]}, "
        f"{torch.get_num_threads()} CPU threads"
    )
    if not s.cuda:
        return "pass", f"cpu, torch {torch.__version__}"
    p = torch.cuda.get_device_properties(s.device)
    bf16 = torch.cuda.is_bf16_supported()
    note = (
        f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, "
        f"torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, bf16 {'yes' if bf16 else 'NO'}"
    )
    # TF32 would loosen the fp32 comparisons of shared_loss; PyTorch's default is off
    print(f"  {note}; TF32 matmul {'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}")
    return ("pass" if bf16 else "FAIL"), note


# ---- the run -------------------------------------------------------------------------------------
def error_line(e):
    """'Type: message' (first line), and where it was raised: the innermost frame in this
    repository, and the innermost of all."""
    frames = traceback.extract_tb(e.__traceback__)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ours = [f for f in frames if os.path.abspath(f.filename).startswith(root)]

    def where(f):
        return f"{os.path.relpath(f.filename, root) if f in ours else f.filename}:{f.lineno}"

    at = f" at {where(ours[-1])}" if ours else ""
    if frames and (not ours or frames[-1] is not ours[-1]):
        at += f" (raised in {where(frames[-1])})"
    message = (str(e).strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {message}{at}"


# every check in the order they run: env, chat_rl's own run (scripts/gpu_check_run.py), the
# engine's, then the training pass's (scripts/gpu_check_training.py)
CHECK_FUNCTIONS = dict(
    env=check_env,
    run=check_run,
    rollout=check_rollout,
    profile=check_profile,
    shared_loss=check_shared_loss,
    fsdp_loss=check_fsdp_loss,
    two_ranks=check_two_ranks,
    lora=check_lora,
    update=check_update,
    mixed=check_mixed,
    gap=check_gap,
)
CHECKS = list(CHECK_FUNCTIONS)

# what each result means for a run on this machine: {check: {result: line}}; "*": any other result
REPORT = "report the line above"
MEANING = {
    "env": {
        "pass": "chat_rl's bf16 compute runs on this device",
        "FAIL": "no bf16 here: chat_rl's autocast will not run; use a GPU with bf16 (Ampere on)",
    },
    "rollout": {
        "pass": "sampling reaches its share of this GPU's ceiling",
        "below target": "sampling runs below its share of this GPU's ceiling: steps will take "
        "longer (profile's note says whether kernel launches are why)",
        "ran (CPU)": "sampling runs end to end (its speed is a GPU's to judge)",
    },
    "profile": {
        "*": "the note says how busy the GPU is in a decode pass (far below 100%: launch-bound)"
    },
    "shared_loss": {
        "pass": "the loss chat_rl trains with gives the plain loss's gradient here",
        "FAIL": f"the fast loss disagrees with the plain one: use --logprobs=plain; {REPORT}",
    },
    "fsdp_loss": {
        "pass": "--fsdp's bf16 loss gives the whole model's gradient: --fsdp may be used",
        "FAIL": f"--fsdp gives another gradient here: do not use --fsdp; {REPORT}",
    },
    "two_ranks": {
        "pass": "two ranks train what one process trains, replicated and under --fsdp: torchrun "
        "runs may be launched",
        "one GPU": "multi-GPU training is unchecked: run this where two GPUs are visible before a "
        "torchrun launch",
        "FAIL": f"two ranks disagree with one process: launch no torchrun run; {REPORT}",
    },
    "lora": {
        "pass": "LoRA on a bf16 base trains the fp32 base's gradient and saves without an fp32 "
        "model on the GPU: --lora-rank may be used",
        "FAIL": f"LoRA on a bf16 base fails here: do not use --lora-rank; {REPORT}",
    },
    "update": {
        "pass": "an RL update meets its H200 speed target",
        "below target": "an RL update runs, below its H200 speed target",
        "ran (CPU)": "an RL update (loss, backward, AdamW) runs end to end",
    },
    "gap": {
        "pass": "the sampler and the trainer agree closely (mismatch_* in metrics.jsonl show it "
        "on your model); --rollout-correction=tis costs little if a run's mismatch_past_cap grows",
        "wide": "over 1% of tokens' sampler/trainer ratio is past 2: train with "
        "--rollout-correction=tis",
    },
    "run": {
        "pass": "chat_rl trains, checkpoints and resumes here with the calculator, 768-token "
        "replies and --activation-checkpointing; the note has a step's parts and its peak memory "
        "against the plan (python -m scripts.plan_memory for your flags)",
        "FAIL": f"a chat_rl run fails here: {REPORT}",
    },
    "mixed": {
        "pass": "finished rows leave the batch as fast as the target asks",
        "below target": "finished rows cost more than the target allows: short rows save less",
        "ran (CPU)": "rows of mixed lengths run end to end",
    },
}


def meaning(check, result):
    """The line a user reads for one check's result; a check that did not run or crashed says so."""
    lines = MEANING[check]
    if result in lines:
        return lines[result]
    if result in ("skipped", "cut off"):
        return "did not run: nothing is known of it"
    return lines.get("*", f"it failed: {REPORT}")


def main(argv=None):
    p = argparse.ArgumentParser(description="the GPU checks, one report (see the docstring)")
    p.add_argument("--device-type", default="cuda", choices=["cuda", "cpu"])
    p.add_argument(
        "--quick", action="store_true", help="tiny shapes: a smoke run of every check in seconds"
    )
    p.add_argument(
        "--shape", default="qwen2.5-0.5b", choices=list(SHAPES), help="the random model's shape"
    )
    p.add_argument(
        "--only",
        default="",
        help="comma-separated checks: " + ", ".join(CHECKS) + " (a prefix selects several)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=480,
        help="start no check after this many seconds (the table still prints)",
    )
    args = p.parse_args(argv)
    only = [w for w in args.only.split(",") if w]
    unknown = [w for w in only if not any(c.startswith(w) for c in CHECKS)]
    if unknown:
        p.error(f"unknown checks {unknown}; known: {CHECKS}")
    started = time.time()
    torch.manual_seed(0)
    s = Setup(args.device_type, args.quick, args.shape)
    shape = "tiny (bench_rollout 'tiny' + qkv bias)" if args.quick else args.shape
    print(
        f"gpu_check: device {args.device_type}, shape {shape}, fp32 weights under bf16 autocast",
        flush=True,
    )
    rows, failed = [], False
    # a time limit's SIGTERM ends the check under way, not the report:
    # the table of what ran still prints
    previous = signal.signal(signal.SIGTERM, out_of_time)
    for name in CHECKS:
        if only and not any(name.startswith(w) for w in only):
            rows.append((name, "skipped", "not in --only"))
            continue
        if time.time() - started > args.budget_s or any(r[1] == "cut off" for r in rows):
            rows.append(
                (
                    name,
                    "skipped",
                    "not started: "
                    + (
                        f"past --budget-s={args.budget_s:g}"
                        if time.time() - started > args.budget_s
                        else "an earlier check was cut off"
                    ),
                )
            )
            continue
        print(f"\n== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            result, note = CHECK_FUNCTIONS[name](s)
        except OutOfTime as e:
            result, note = "cut off", str(e)
            print(f"  CUT OFF: {note}", flush=True)
        except Exception as e:  # noqa: BLE001 -- every check runs, whatever failed before it
            result, note = "FAIL", error_line(e)
            print(f"  FAILED: {note}", flush=True)
        failed |= result == "FAIL"
        seconds = time.perf_counter() - t0
        print(f"  [{name}: {result}, {seconds:.1f} s]", flush=True)
        rows.append((name, result, f"{note} ({seconds:.0f} s)"))
    print(
        f"\n`python -m scripts.gpu_check{' --quick' if args.quick else ''} "
        f"--device-type={args.device_type}"
        f"{' --only=' + args.only if args.only else ''}`: {time.time() - started:.0f} s in all\n"
    )
    print("| check | result | note |\n| --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(x.replace("|", "/") for x in row) + " |")
    print("\nwhat this means for a run here:")
    for name, result, _ in rows:
        print(f"  {name}: {result}: {meaning(name, result)}")
    if s.cuda:
        print(
            "\nalso worth running if time is left (peak memory and time of whole RL steps):\n"
            f"    {BENCH_RL_STEP}"
        )
    signal.signal(signal.SIGTERM, previous)
    return 1 if failed or any(r[1] == "cut off" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
