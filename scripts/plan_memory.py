"""
The memory of a GPU run, planned on the CPU: what each rank of a CUDA run of chat_rl holds, part by
part, and whether it fits a GPU of the given size, on each number of ranks, replicated, under
--fsdp and with LoRA.

    python -m scripts.plan_memory --model=Qwen/Qwen2.5-7B-Instruct --ranks=1,8 --gpu-gb=80
    python -m scripts.plan_memory --model=models/smollm2-135m --lora-rank=16 --max-new-tokens=256
    python -m scripts.plan_memory --model=Qwen/Qwen2.5-0.5B-Instruct,Qwen/Qwen2.5-7B-Instruct

--model takes what chat_rl takes (a folder, a PEFT folder: its base, a hub id) or a config.json
path; several, comma-separated, add a summary. Only the config is read: a folder's config.json,
a hub id's from the local Hugging Face cache; nothing is downloaded, no weight is read. The
Qwen2.5 Instruct models' configs are also in scripts/qwen25_configs.json, used when the cache has
none. Every other flag is chat_rl's own (--lora-rank, --fsdp, --activation-checkpointing,
--generate-batch-rows, --max-new-tokens, --device-batch-tokens, --device-batch-size, --preset,
...), read as chat_rl reads them; --prompt-tokens is the longest prompt of an engine call, a
planning figure (GSM8K's chat prompts are 100-200 tokens).

The figures are plumbing/memory.py's: sizes of the tensors the code makes, counted from the shapes
it gives them (the policy built on the meta device, the KV cache's layout, what autograd keeps of a
micro-batch), which tests/test_plan_memory.py holds to the bytes the CPU allocates for a small
model of the same family. Computed on the CPU, not measured on a GPU: CUDA's allocator hands out
blocks of its own sizes and caches freed ones, its attention kernels pad their log-sum-exp, and
NCCL, the CUDA context and cuBLAS's workspace take their own (hundreds of MB a GPU), none of which
is here.
"""

import json
import os
import sys
from types import SimpleNamespace

import chat_rl
from plumbing import flags, memory
from policy import hf_folder
from policy.gpt import config_from_hf

HERE = os.path.dirname(os.path.abspath(__file__))
OWN = {"ranks": "1,8", "gpu_gb": "80", "prompt_tokens": "256"}  # this script's flags


def model_config(name):
    """(config.json dict, where it came from) of --model, read without downloading anything."""
    hf = hf_folder.read_config(name)
    if hf is not None:
        return hf, name
    with open(os.path.join(HERE, "qwen25_configs.json")) as f:
        known = json.load(f)
    if name in known:
        return known[name], "scripts/qwen25_configs.json (not in the local cache)"
    raise flags.ConfigError(
        f"--model={name}: no config.json to read (a folder, a config.json, or a hub id in the "
        f"local Hugging Face cache: nothing is downloaded)"
    )


def variants(cfg, ranks):
    """The runs planned on `ranks` ranks: (column title, flags): full fine-tuning replicated, under
    --fsdp (on more than one rank, or as given), and LoRA (at --lora-rank, or 16); each with the
    rest of cfg."""
    rank = cfg.lora_rank or 16
    runs = [("full", dict(lora_rank=0, fsdp=False))]
    if ranks > 1 or (cfg.fsdp and not cfg.lora_rank):
        runs.append(("--fsdp", dict(lora_rank=0, fsdp=True)))
    runs.append((f"LoRA r{rank}", dict(lora_rank=rank, fsdp=False)))
    where = "1 GPU" if ranks == 1 else f"{ranks} GPUs"
    return [
        (f"{where}: {title}", SimpleNamespace(**{**vars(cfg), **changes}))
        for title, changes in runs
    ]


def given(cfg, run):
    """Whether the planned run is the one the flags name."""
    return run.lora_rank == cfg.lora_rank and bool(run.fsdp) == bool(cfg.fsdp and not cfg.lora_rank)


def fits(peak, gpu):
    return "yes" if peak <= gpu else "no"


def gb(size):
    return f"{size / memory.GB:.1f}" if size < 1e11 else f"{size / memory.GB:.0f}"


def plan_table(name, config, cfg, ranks, gpu, prompt_tokens):
    """The parts and peaks of each planned run, a markdown table; returns the plans too."""
    columns = [(title, run, memory.plan(config, run, r, prompt_tokens))
               for r in ranks for title, run in variants(cfg, r)]  # fmt: skip
    c = columns[0][2].counts
    print(f"\n{name}: {c.total / 1e9:.2f}B parameters, per GPU in GB (10^9 bytes), CUDA (fp32 "
          f"master weights, bf16 compute); planned from the config, not measured")  # fmt: skip
    titles = [title + (" (as given)" if given(cfg, run) else "") for title, run, _ in columns]
    print("| part | " + " | ".join(titles) + " |")
    print("| --- |" + " --- |" * len(columns))
    for part in columns[0][2].parts:
        sizes = [p.parts[part] for _, _, p in columns]
        if any(sizes):
            print(f"| {part} | " + " | ".join(gb(s) if s else "-" for s in sizes) + " |")
    for peak in columns[0][2].peaks:
        print(
            f"| **peak: {peak}** | " + " | ".join(gb(p.peaks[peak]) for _, _, p in columns) + " |"
        )
    print(f"| fits {gpu / memory.GB:g} GB: plain / checkpointed | " + " | ".join(
        f"{fits(max(p.peaks['rollout'], p.peaks['training']), gpu)} / "
        f"{fits(max(p.peaks['rollout'], p.peaks['training, --activation-checkpointing']), gpu)}"
        for _, _, p in columns) + " |")  # fmt: skip
    calls = " | ".join(f"{p.call[0]} x {p.call[1]}" for _, _, p in columns)
    print(f"| largest engine call: prompts x samples | {calls} |")
    mb = columns[0][2].micro_batch
    print(f"\nmicro-batch: {mb.B} rows of {mb.G} prompt(s), {mb.P} prefix + {mb.T} own tokens each "
          f"({mb.G * mb.P + mb.B * mb.T} tokens through the layers); engine calls of "
          f"{cfg.generate_batch_rows} rows at most, prompts of {prompt_tokens} tokens, "
          f"{cfg.max_new_tokens} new tokens")  # fmt: skip
    return columns


def summary(rows, gpu):
    """One line a model: each run's peak (the larger phase), plain / checkpointed."""
    print(f"\nsummary: peak GB a GPU (the larger of rollout and training), plain / "
          f"--activation-checkpointing; * does not fit {gpu / memory.GB:g} GB")  # fmt: skip
    titles = [title for title, _, _ in rows[0][1]]
    print("| model | params | " + " | ".join(titles) + " |")
    print("| --- | --- |" + " --- |" * len(titles))
    for name, columns in rows:
        cells = []
        for _, _, p in columns:
            peaks = [max(p.peaks["rollout"], p.peaks[k])
                     for k in ("training", "training, --activation-checkpointing")]  # fmt: skip
            cells.append(" / ".join(gb(x) + ("*" if x > gpu else "") for x in peaks))
        params = f"{columns[0][2].counts.total / 1e9:.2f}B"
        print(f"| {name} | {params} | " + " | ".join(cells) + " |")


def main(argv):
    own, rest = dict(OWN), []
    for arg in argv:
        name, _, value = arg[2:].partition("=")
        if arg.startswith("--") and name.replace("-", "_") in OWN:
            own[name.replace("-", "_")] = value
        else:
            rest.append(arg)
    if "--help" in rest or "-h" in rest:
        print(__doc__)
        return 0
    try:
        cfg = flags.parse_config(rest, chat_rl.HYPERPARAMETERS, chat_rl.PRESETS)
        ranks = [int(r) for r in own["ranks"].split(",")]
        gpu, prompt_tokens = float(own["gpu_gb"]) * memory.GB, int(own["prompt_tokens"])
        rows = []
        for name in cfg.model.split(","):
            hf, source = model_config(name)
            print(f"{name}: config from {source}")
            table = plan_table(name, config_from_hf(hf), cfg, ranks, gpu, prompt_tokens)
            rows.append((name, table))
    except (flags.RunError, ValueError) as e:
        print(f"plan_memory: error: {e}", file=sys.stderr)
        return 2
    if len(rows) > 1:
        summary(rows, gpu)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
