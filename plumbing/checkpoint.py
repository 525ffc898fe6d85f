"""
Where the policy comes in and goes out: loading it from a folder or hub id, checkpoints that
resume exactly, and the decision where a run starts.

A checkpoint is <out_dir>/step_000120/: a Hugging Face folder (config.json, model.safetensors,
tokenizer files) that transformers and `--model` load as it is, plus trainer_state.pt holding
the optimizer state, the step, every rank's RNG state and the run's config; a LoRA run's holds
its weights merged, and its adapter alone in adapter/, a PEFT folder with the tokenizer beside it
(lora_base says how it names its base). Under --fsdp the optimizer state is in optimizer/
instead, one file per rank with its shard (fsdp.py); either kind resumes with or without --fsdp.
Data position is the step itself: step s always takes the s-th slice of a per-epoch permutation
fixed by the seed, and every training rollout's seed is derived from (seed, step, the problem's
place in the step; a --refill round adds its number), an eval's from (seed, the held-out problem),
never from the rank, so nothing else is needed to continue bit-identically on CPU.
Writes are atomic: the folder is written under a temporary name and renamed into place, so a
crash mid-write leaves a `.tmp-` folder that is never mistaken for a checkpoint.
"""

import json
import os
import re
import shutil
from contextlib import nullcontext
from types import SimpleNamespace

import torch
import torch.distributed as dist
from safetensors import safe_open

from plumbing import flags, fsdp
from plumbing.distributed import compute_dtype, cpu_bf16_units, dtype_choice, is_sharded
from plumbing.flags import ConfigError, RunError
from policy import lora
from policy.gpt import GPT, config_from_hf
from policy.hf_folder import read_json, resolve_folder, write_config, write_weights
from policy.tokenizer import load_tokenizer

# settings that may change between a run and its resumption without changing what it computes
# (--fsdp and --activation-checkpointing change where the memory goes, --logprobs how the loss
# is computed, not what)
MAY_DIFFER = {
    "out_dir",
    "resume",
    "eval_every",
    "save_every",
    "keep_checkpoints",
    "wandb",
    "preset",
    "max_nonfinite",
    "device_type",
    "model",
    "fsdp",
    "activation_checkpointing",
    "logprobs",
}

# A flag younger than a checkpoint: the run that saved it computed as the flag's default does (a
# new flag's default is its value when off), so resuming compares the flag with its default; unless
# it is named here with what such runs computed with instead. (--dtype's depends on the device:
# find_resumable.)
ADDED = {}

# the repository root, above plumbing/
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_policy(path, device, dtype=torch.float32, keep_fp32=()):
    """(model, tokenizer) from a Hugging Face folder or hub id; "demo_model" is the folder shipped
    here. The weights in dtype (a LoRA run's frozen base: bf16 on CUDA), those named in keep_fp32 in
    fp32 (GPT.from_pretrained)."""
    if path == "demo_model":
        path = os.path.join(REPO, "demo_model")
        if not os.path.exists(os.path.join(path, "model.safetensors")):
            raise RunError(
                f"{path} is missing its weights: restore it with `git checkout demo_model` "
                f"or rebuild it with `python -m scripts.make_demo_model` (about 20 minutes)"
            )
    try:  # trained weights stay fp32 (master copy for AdamW); bf16 happens in autocast on CUDA
        model = GPT.from_pretrained(path, device=device, dtype=dtype, keep_fp32=keep_fp32)
        return model, load_tokenizer(path)
    except (OSError, ValueError) as e:
        raise RunError(f"cannot load model {path!r}: {e}") from None


def model_config(name):
    """The GPTConfig of --model (a PEFT folder's: its base's), from its config.json alone."""
    path = os.path.join(REPO, "demo_model") if name == "demo_model" else name
    if os.path.exists(os.path.join(path, "adapter_config.json")):
        return model_config(lora.read_adapter_config(path)[0])
    try:
        return config_from_hf(read_json(os.path.join(resolve_folder(path), "config.json")))
    except (OSError, ValueError) as e:
        raise RunError(f"cannot load model {name!r}: {e}") from None


def run_dtype(cfg, device):
    """--dtype resolved for this run: ("fp32" | "bf16", why); auto looks at the model's config
    only where the hardware's answer is not enough (a CPU with bf16 units)."""
    config = None
    if cfg.dtype == "auto" and torch.device(device).type == "cpu" and cpu_bf16_units():
        config = model_config(cfg.model)
    return dtype_choice(device, cfg.dtype, config)


def build_policy(cfg, state, device, dtype=None):
    """
    The run's (model, tokenizer): --model, or the checkpoint a resumed run continues. --model may be
    a PEFT LoRA folder (adapter_config.json): its base with the adapter, merged in for full
    fine-tuning, trained on with --lora-rank. With --lora-rank > 0 the base is frozen in dtype
    (None: cfg.dtype as run_dtype resolved it, or else bf16 on CUDA and fp32 elsewhere) and the
    adapters train (policy/lora.py); a resumed LoRA run reloads its base from the --model it first
    started with (the checkpoint's config, whatever --model says now) and its adapters from the
    checkpoint.
    """
    source = (
        (state["config"]["model"] if cfg.lora_rank else state["model_dir"]) if state else cfg.model
    )
    adapter = source if os.path.exists(os.path.join(source, "adapter_config.json")) else None
    base, rank, alpha, targets = (
        lora.read_adapter_config(adapter) if adapter else (source, 0, 0, [])
    )
    if adapter and cfg.lora_rank and cfg.lora_rank != rank:
        raise ConfigError(
            f"--model={adapter} is a rank-{rank} adapter: to train it on, "
            f"--lora-rank={rank}; --lora-rank=0 trains its merged model fully"
        )
    if cfg.lora_rank and not adapter:
        targets = lora.parse_targets(cfg.lora_targets)
    choice = getattr(cfg, "dtype", "auto")  # a cfg of its own (a test, a script): the default
    dtype = dtype or compute_dtype(device, None if choice == "auto" else choice)
    base_dtype = dtype if cfg.lora_rank and dtype != torch.float32 else None
    # a frozen base is read in its dtype straight from the file (read in fp32 first, a 7B base would
    # take 30 GB of the GPU before its cast to 15); the modules a LoRA run trains whole stay fp32
    whole = [lora.WHOLE[name] for name in targets if name in lora.WHOLE] if base_dtype else []
    model, tokenizer = load_policy(base, device, dtype=base_dtype or torch.float32, keep_fp32=whole)
    if adapter:
        lora.add_adapters(model, rank, alpha, targets, base_dtype=base_dtype)
        try:
            lora.load_adapter(model, adapter)
        except ValueError as e:
            raise RunError(str(e)) from None
        if not cfg.lora_rank:
            lora.merge_adapters(model)
    elif cfg.lora_rank:
        lora.add_adapters(
            model, cfg.lora_rank, cfg.lora_alpha, targets, seed=cfg.seed, base_dtype=base_dtype
        )
    if state and cfg.lora_rank:
        lora.load_adapter(model, os.path.join(state["model_dir"], "adapter"))
    return model, tokenizer


def reference_policy(cfg, model, state, device):
    """--kl-beta's reference, the frozen starting policy, as a function that opens a block yielding
    the model to run it with: with LoRA the policy itself, its adapters off (lora.adapters_off: the
    base, no second model); otherwise a frozen copy of the run's --model, the first start's on
    resume (never the checkpoint: the reference stays where the run started). None without it."""
    if cfg.kl_beta == 0:
        return None
    if lora.has_adapters(model):  # from a PEFT adapter: the KL to its base, as TRL measures it
        if lora.whole_modules(model):
            raise ConfigError(
                "--kl-beta with LoRA measures the KL to the base, adapters off; "
                "the embeddings or head it trains whole have no base left: drop "
                "them from --lora-targets"
            )
        return lambda: lora.adapters_off(model)
    start = SimpleNamespace(**vars(cfg))
    start.model = state["config"]["model"] if state else cfg.model
    frozen, _ = build_policy(start, None, device)
    frozen.requires_grad_(False)
    return lambda: nullcontext(frozen)


def lora_base(cfg, adapter_dir):
    """The base model of a LoRA run's adapter, as its adapter_config.json (in adapter_dir) names it,
    so that the adapter loads elsewhere: a hub id as --model gave it, or as the hub's cache folder
    spells it (.../models--Org--Name/snapshots/...); a folder under the directory the run started
    in (demo_model/, a models/ beside out/) relative to adapter_dir, so the two can move together
    (lora.read_adapter_config resolves it); any other folder by its absolute path."""
    base = cfg.model
    if os.path.exists(os.path.join(base, "adapter_config.json")):  # --model, an adapter: its base
        base = lora.read_adapter_config(base)[0]
    path = os.path.join(REPO, "demo_model") if base == "demo_model" else base
    if not os.path.isdir(path):
        return base  # a hub id
    path = os.path.abspath(path)
    cached = re.search(r"/models--([^/]+?)--([^/]+)/snapshots/[^/]+$", path)
    if cached:
        return f"{cached[1]}/{cached[2]}"
    here = os.getcwd() + os.sep
    if path.startswith(here) and os.path.abspath(adapter_dir).startswith(here):
        return os.path.relpath(path, adapter_dir)
    return path


def step_of(model):
    """The step a --model folder was saved at, a checkpoint's (or its adapter/'s): what --eval-only
    evaluates; None for any other model."""
    adapter = os.path.exists(os.path.join(model, "adapter_config.json"))
    folder = os.path.dirname(os.path.normpath(model)) if adapter else model
    path = os.path.join(folder, "trainer_state.pt")
    if not os.path.isfile(path):
        return None
    try:  # mmap: the step alone is read, not the optimizer state beside it
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"])
    except Exception:  # noqa: BLE001 - only a label: an unreadable file names no step
        return None


def _ckpt_dirs(out_dir):
    if not os.path.isdir(out_dir):
        return []
    return sorted(d for d in os.listdir(out_dir) if d.startswith("step_") and d[5:].isdigit())


def has_run(out_dir):
    return bool(_ckpt_dirs(out_dir)) or os.path.exists(os.path.join(out_dir, "metrics.jsonl"))


def save(cfg, step, model, tokenizer, optimizer, rank, world):
    """Every rank calls this (to hand over its RNG state, and under FSDP its shards); rank 0
    writes the rest."""
    rng = {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }
    rngs = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(rngs, rng)
    else:
        rngs = [rng]
    sharded = is_sharded(model)
    final = os.path.join(cfg.out_dir, f"step_{step:06d}")
    tmp = os.path.join(cfg.out_dir, f".tmp-step_{step:06d}")
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        for name in os.listdir(cfg.out_dir):  # leftovers of writes that a crash interrupted
            if name.startswith(".tmp-step_"):
                shutil.rmtree(os.path.join(cfg.out_dir, name), ignore_errors=True)
        os.makedirs(tmp)
    # every rank: the weights gathered tensor by tensor, and its own shard of the optimizer state
    if sharded:
        # the temporary folder exists, and no leftover is being deleted under another rank
        dist.barrier()
        fsdp.save_weights(model, tmp, rank)
    # None when sharded: each rank wrote its shard into optimizer/
    saved_optimizer = fsdp.save_optimizer(model, optimizer, os.path.join(tmp, "optimizer"))
    if rank == 0:
        # the merged weights, a plain folder; the adapter alone beside it, PEFT's folder
        if lora.has_adapters(model):
            write_weights(tmp, lora.merged_state_dict(model))
            write_config(tmp, model.config, torch.float32)
            adapter = os.path.join(tmp, "adapter")  # its base, as seen from step_N/adapter
            lora.save_adapter(model, adapter, lora_base(cfg, os.path.join(final, "adapter")))
            tokenizer.save_pretrained(adapter)  # all a user needs, besides the base
        elif not sharded:
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        state = {
            "step": step,
            "optimizer": saved_optimizer,
            "rng": rngs,
            "world_size": world,
            "config": vars(cfg),
        }
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
        # make the bytes durable before the rename makes them visible
        for folder, _, names in os.walk(tmp):
            for name in names:
                with open(os.path.join(folder, name), "rb") as f:
                    os.fsync(f.fileno())
            _fsync_dir(folder)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(cfg.out_dir)  # the rename itself survives a power cut
        print(f"checkpoint: wrote {final}")
        for old in _ckpt_dirs(cfg.out_dir)[: -cfg.keep_checkpoints]:
            shutil.rmtree(os.path.join(cfg.out_dir, old), ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resume_point(cfg, world, device, restarted=False):
    """(start_step, state): where this run starts. A fresh run refuses an out_dir that already holds
    one; --resume takes the latest complete checkpoint (state None if there is none yet, so a
    preemption script can always pass --resume). A group that torchrun restarted (restarted=True)
    resumes by itself: its command line is the first start's. Every rank must find the same one."""
    resume = cfg.resume or restarted
    if not resume and has_run(cfg.out_dir):
        raise ConfigError(
            f"{cfg.out_dir} already holds a run, which a new one would overwrite: "
            f"to continue it, give the same command plus --resume; "
            f"to start another, pass --out-dir={_free_folder(cfg.out_dir)}"
        )
    start_step, state = find_resumable(cfg, world, device) if resume else (0, None)
    if world > 1:  # and they must have looked before rank 0 writes anything
        found = torch.tensor([start_step, -start_step], device=device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        if found[0] != -found[1]:
            raise ConfigError(
                f"ranks found different checkpoints in {cfg.out_dir}: "
                f"it must be one folder all ranks see"
            )
    return start_step, state


def _free_folder(out_dir):
    """out/demo -> out/demo-2 (or -3, ...): the first name no run has taken."""
    base, n = os.path.normpath(out_dir), 2
    while os.path.exists(f"{base}-{n}"):
        n += 1
    return f"{base}-{n}"


def find_resumable(cfg, world, device="cpu"):
    """(step, state) of the latest checkpoint in out_dir, or (0, None) if there is none yet.
    A checkpoint that cannot be read, or whose config differs in a way that matters, is refused."""
    dirs = _ckpt_dirs(cfg.out_dir)
    if not dirs:
        return 0, None
    path = os.path.join(cfg.out_dir, dirs[-1])
    try:
        state = torch.load(
            os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=True
        )
        with open(os.path.join(path, "config.json")) as f:
            json.load(f)
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            list(f.keys())
        if state["optimizer"] is None and not os.path.exists(
            os.path.join(path, "optimizer", ".metadata")
        ):
            raise FileNotFoundError(
                "its optimizer/ folder of per-rank shards (an --fsdp run's) "
                "is missing or incomplete"
            )
    except Exception as e:
        raise ConfigError(
            f"checkpoint {path} is unreadable ({type(e).__name__}: {str(e)[:100]}); "
            f"move it away to resume from an earlier one"
        ) from None
    # a flag the checkpoint has not: its run computed as the flag's default (ADDED says otherwise)
    saved = {**flags.DEFAULTS, **ADDED, **state["config"]}
    younger = set(saved) - set(state["config"])
    if "dtype" not in state["config"]:  # before --dtype a run computed in the device's default
        saved["dtype"] = "bf16" if torch.device(device).type == "cuda" else "fp32"
    elif saved["dtype"] == "auto":  # a checkpoint written outside start(), which resolves it
        saved["dtype"] = run_dtype(SimpleNamespace(dtype="auto", model=cfg.model), device)[0]
    # kept_tokens' name in earlier checkpoints: the same computation
    if saved.get("loss_norm") == "token":
        saved = {**saved, "loss_norm": "kept_tokens"}
    current = vars(cfg)
    if cfg.dtype == "auto":  # not resolved yet (start() resolves it first): as it will be
        current = {**current, "dtype": run_dtype(cfg, device)[0]}
    differs = [k for k in saved if k not in MAY_DIFFER and k in current and saved[k] != current[k]]
    if state.get("world_size") != world:
        differs.append(f"world size ({state.get('world_size')} -> {world})")
    if differs:
        detail = ", ".join(
            f"{k} ({saved[k]!r} -> {current[k]!r})"
            + (" (the checkpoint is older than the flag)" if k in younger else "")
            if k in saved
            else k
            for k in differs
        )
        hint = ""
        # the same flags, other rows: a data file edited or a hub data set updated
        if "rows_fingerprint" in differs:
            hint = (
                "; rows_fingerprint hashes the training rows: these are not the rows it trained on"
            )
        # the learning rate decays to 0 over the run's length
        if {"num_steps", "num_epochs"} & set(differs):
            hint = (
                f"; a run's length is part of its learning-rate schedule, so it cannot change: "
                f"to train on, start a new run with --model={path} and a new --out-dir"
            )
        raise ConfigError(f"checkpoint {path} was made with different settings: {detail}{hint}")
    state["model_dir"] = path
    return state["step"], state


def restore(state, model, optimizer, rank):
    """The optimizer state and this rank's RNG state of a checkpoint (the weights came with the
    model); state None, a fresh run's: nothing."""
    if state is None:
        return
    fsdp.restore_optimizer(
        model, optimizer, state["optimizer"], os.path.join(state["model_dir"], "optimizer")
    )
    rng = state["rng"][rank]
    torch.set_rng_state(rng["cpu"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
