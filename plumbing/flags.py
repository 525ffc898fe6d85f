"""
The command line: flags and their checks, and the run that starts from them, kept out of
chat_rl.py's reading line.

chat_rl.HYPERPARAMETERS maps each name to (default, help), and chat_rl.PRESETS names a few runs by
their changes to the defaults. A run starts from the defaults, with a preset's changes over them
(--preset=demo), and command-line flags win over both:
--name=value and --name value both work, as in every argparse script; a bare --name sets a
boolean. An impossible or nonsensical combination of flags is refused with a one-line reason
(ConfigError) before any process group, model or data is touched; what needs the data, the model
or a checkpoint read first (--kl-beta beside LoRA training a whole module, a single --data file
with evals on, a resume whose settings differ) is refused in one line once it is read.

The options, by the step of chat_rl.py's docstring they change (those that switch something on
are off by default):
  2  --temperature; --top-k truncates the distribution, which the loss does not model (keep 0);
     --tool=none samples without the calculator
  3  --format-weight adds format (1 for the answer given once, in the task's form, at the end);
     --overlong-buffer DAPO's length penalty (overlong_penalty); --reward a function of yours
  4  --advantage=zscore; --refill: DAPO's dynamic sampling (plumbing/refill.py): a step trains
     only the groups it chose, so there N (all_tokens) equals kept_tokens
  5  --mask-truncated: cut-off completions train no token, after the advantages (their rewards
     stay in the means; training_rows()), so they add nothing to N but count in sequence's C;
     --loss-norm: N_i per completion (normaliser()'s table); --kl-beta, --ppo-epochs and
     --rollout-correction: objective()'s other branches (docs/objective.md); --kl-beta's term
     pulls on every row, so unanimous groups train too
  6  --grad-clip; --lr, or --lora-lr with --lora-rank
"""

import difflib
import inspect
import math
import os
import re
import signal
import sys
import time
from types import SimpleNamespace

import torch

from plumbing.distributed import cpu_bf16_units, setup_distributed
from policy import hf_folder, lora
from tasks import generic, gsm8k, mental, rg
from tasks.common import get_task


class RunError(Exception):
    """Stops the run with a one-line message (exit 1): data or model that cannot be loaded, a run
    gone non-finite. every_rank: every rank stops for this same reason (a bad flag, a verdict on
    summed figures), so rank 0 says it."""

    def __init__(self, message, every_rank=False):
        super().__init__(message)
        self.every_rank = every_rank


class ConfigError(RunError):
    """A bad flag or an impossible combination: one line (exit 2), before any work where the
    flags alone tell (the module docstring names what waits for the data or the model)."""

    def __init__(self, message):
        super().__init__(message, every_rank=True)


def run(train, hyperparameters, presets, doc, argv):
    """The command line: flags over hyperparameters, checked for world size ranks before any
    process group, model or data; then this rank's process group and device, and train(cfg, rank,
    world, device). A RunError is said in one line on stderr (once, by rank 0, when every rank has
    it) and returns 1, 2 for a ConfigError; anything else is a bug and keeps its traceback. The
    signal handlers the run installs (plumbing/loop.py, plumbing/stop.py) end with it."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        cfg = parse_config(argv, hyperparameters, presets, doc)
        check_config(cfg, int(os.environ.get("WORLD_SIZE", 1)))
        rank, world, device = setup_distributed(cfg.device_type, cfg.fsdp)
        if (note := preset_note(cfg, presets)) and rank == 0:
            print(note)
        return train(cfg, rank, world, device)
    except RunError as e:
        if int(os.environ.get("RANK", 0)) == 0 or not e.every_rank:
            print(f"chat_rl: error: {e}", file=sys.stderr)
        elif os.environ.get("TORCHELASTIC_RUN_ID"):
            time.sleep(1.0)  # torchrun stops every rank once one exits: rank 0 speaks first
        return 2 if isinstance(e, ConfigError) else 1
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for sig, handler in handlers.items():
            if handler is not None:  # None: installed outside Python, nothing to put back
                signal.signal(sig, handler)


def parse_config(argv, hyperparameters, presets=None, doc=""):
    """Flags over a preset's values over the defaults; unknown names and values of the wrong type
    raise ConfigError. A value's range and the flags' combinations are check_config's (run() calls
    it next)."""
    presets = presets or {}
    if "--help" in argv or "-h" in argv:
        try:
            print_help(hyperparameters, presets, doc)
            sys.stdout.flush()
        except BrokenPipeError:
            # `--help | head` closed the pipe: what it read is all that was wanted. Stdout goes
            # to /dev/null, so that Python's flush at exit raises no second error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    flags, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            raise ConfigError(
                f"unexpected argument {arg!r} (flags look like --name=value or --name value)"
            )
        name, has_value, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if name != "preset" and name not in hyperparameters:
            close = difflib.get_close_matches(name, [*hyperparameters, "preset"], n=1)
            hint = f"did you mean --{close[0].replace('_', '-')}?" if close else "see --help"
            raise ConfigError(f"unknown flag --{name.replace('_', '-')} ({hint})")
        is_bool = name != "preset" and isinstance(hyperparameters[name][0], bool)
        next_is_value = i < len(argv) and not argv[i].startswith("--")
        # --name value (a bool takes the next word only if it is one)
        if not has_value and next_is_value and (not is_bool or argv[i].lower() in _BOOLS):
            value, has_value = argv[i], True
            i += 1
        if not has_value and not is_bool:
            raise ConfigError(f"--{name.replace('_', '-')} needs a value")
        flags[name] = (
            value
            if name == "preset"
            else _convert(name, value if has_value else "true", hyperparameters[name][0])
        )
    if "data" in flags and "task" not in flags:
        flags["task"] = "data"  # your own rows, without naming a task: the generic one
    preset = flags.pop("preset", "")
    if preset and preset not in presets:
        raise ConfigError(f"unknown preset {preset!r} (choose from {', '.join(presets)})")
    defaults = {name: default for name, (default, _) in hyperparameters.items()}
    DEFAULTS.clear()
    DEFAULTS.update(defaults)
    return SimpleNamespace(preset=preset, **{**defaults, **presets.get(preset, {}), **flags})


# each flag's default, as the last parse_config read them: what a checkpoint older than a flag
# computed with (plumbing/checkpoint.find_resumable)
DEFAULTS = {}


_BOOLS = ("true", "false", "1", "0")


def preset_note(cfg, presets):
    """One line when a preset's model is replaced by another model: its learning rate, budget and
    eval were chosen for that one."""
    tuned_for = presets.get(cfg.preset, {}).get("model")
    if not tuned_for or same_model(cfg.model, tuned_for):
        return ""
    preset = presets[cfg.preset]
    kept = [
        f"--{name.replace('_', '-')}={value}"
        for name, value in preset.items()
        if name in ("lr", "lora_lr", "max_new_tokens", "eval_examples", "eval_samples")
        and getattr(cfg, name) == value
    ]
    if not kept:
        return ""
    return (
        f"chat_rl: note: --preset={cfg.preset} was chosen for --model={tuned_for}; "
        f"with --model={cfg.model} it still sets {' '.join(kept)}: "
        'give your model\'s own values (docs/smollm2.md: "Your own model of 100M-500M")'
    )


# what makes two config.json describe one model, whatever folder or name holds it
SHAPE = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "vocab_size")  # fmt: skip


def same_model(a, b):
    """Whether --model a and --model b are one model: the same architecture and shape by their
    config.json, read without the weights (a copy in another folder, the hub id of a converted
    folder, a checkpoint of it); by name when either config cannot be read (a hub id not in the
    local cache, offline)."""
    if a == b:
        return True
    configs = [hf_folder.read_config(name) for name in (a, b)]
    if None in configs:
        return False
    for hf in configs:  # a config without it has as many KV heads as heads
        hf["num_key_value_heads"] = hf.get("num_key_value_heads") or hf.get("num_attention_heads")
    return all(configs[0].get(key) == configs[1].get(key) for key in SHAPE)


def _convert(name, value, default):
    try:
        if isinstance(default, bool):
            if value.lower() not in _BOOLS:
                raise ValueError
            return value.lower() in ("true", "1")
        return type(default)(value)
    except ValueError:
        raise ConfigError(
            f"--{name.replace('_', '-')}={value!r}: expected {type(default).__name__}"
        ) from None


def print_help(hyperparameters, presets, doc):
    # the docstring's summary line: one whole sentence (a test holds it so)
    print(doc.strip().split("\n")[0])
    print(
        f"\nusage: python -m chat_rl [--preset={'|'.join(presets)}] "
        f"[--name=value | --name value ...]\n"
    )
    # the longest flag, --activation-checkpointing, and its two dashes
    width = max(len(name) for name in hyperparameters) + 2
    print(f"  {'flag':<{width}} {'default':<28} meaning")
    for name, (default, help) in hyperparameters.items():
        print(f"  --{name.replace('_', '-'):<{width - 2}} {default!r:<28} {help}")
        for preset, values in presets.items():
            if name in values:
                print(f"  {'':<{width}} {values[name]!r:<28} with --preset={preset}")


# --advantage's kinds, each a branch of chat_rl.compute_advantages: the one list of them
ADVANTAGES = ("mean", "zscore")
# --loss-norm's normalisers, each an entry of chat_rl.normaliser's table: the one list of them
LOSS_NORMS = ("kept_tokens", "all_tokens", "sequence")


def check_config(cfg, world_size):
    """Impossible or nonsensical settings, each refused with its reason."""
    for name in (
        "examples_per_step",
        "num_samples",
        "max_new_tokens",
        "device_batch_size",
        "device_batch_tokens",
        "eval_examples",
        "eval_samples",
        "generate_batch_rows",
        "num_epochs",
        "keep_checkpoints",
        "max_nonfinite",
        "rg_train_size",
    ):
        if getattr(cfg, name) <= 0:
            raise ConfigError(
                f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}"
            )
    if cfg.refill < 0:
        raise ConfigError(f"--refill must be >= 0 (0 = off), got {cfg.refill}")
    if not 0 <= cfg.overlong_buffer <= cfg.max_new_tokens:
        raise ConfigError(
            f"--overlong-buffer must be in [0, --max-new-tokens={cfg.max_new_tokens}] (0 = off), "
            f"got {cfg.overlong_buffer}"
        )
    for name in ("eval_every", "save_every", "num_steps"):
        value = getattr(cfg, name)
        if value == 0 or value < -1:
            raise ConfigError(
                f"--{name.replace('_', '-')} must be positive or -1 (off/derived), got {value}"
            )
    if cfg.examples_per_step % world_size:
        lower = cfg.examples_per_step - cfg.examples_per_step % world_size
        nearest = ", ".join(str(n) for n in (lower, lower + world_size) if n > 0)
        raise ConfigError(
            f"--examples-per-step={cfg.examples_per_step} is not divisible by the {world_size} "
            f"ranks: use a multiple of {world_size}, e.g. {nearest}"
        )
    for name in ("temperature", "lr", "weight_decay", "grad_clip", "format_weight"):
        if not math.isfinite(getattr(cfg, name)):
            raise ConfigError(
                f"--{name.replace('_', '-')} must be a finite number, got {getattr(cfg, name)}"
            )
    if cfg.lr <= 0:
        raise ConfigError(f"--lr must be above 0, got {cfg.lr}")
    for name in ("adam_beta1", "adam_beta2"):  # a decay of 1 never forgets; torch refuses it
        if not 0 <= getattr(cfg, name) < 1:
            raise ConfigError(
                f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(cfg, name)}"
            )
    for name in ("temperature", "top_k", "grad_clip", "format_weight"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    if cfg.num_samples < 2 or cfg.temperature == 0:
        # one sample, or identical greedy samples, give every group a zero advantage:
        # nothing would train
        raise ConfigError(
            f"rollouts need --num-samples >= 2 and --temperature > 0 "
            f"(got {cfg.num_samples}, {cfg.temperature})"
        )
    if cfg.device_batch_tokens < cfg.max_new_tokens:
        # a micro-batch never splits a row, so a row past the budget would run alone,
        # over it, and slowly
        raise ConfigError(
            f"--device-batch-tokens={cfg.device_batch_tokens} is below "
            f"--max-new-tokens={cfg.max_new_tokens}: "
            f"one completion, without its prompt, may need more than a micro-batch holds"
        )
    if cfg.dtype not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"unknown --dtype {cfg.dtype!r} (auto | fp32 | bf16)")
    if cfg.dtype == "bf16" and cfg.device_type in ("", "cpu") and not torch.cuda.is_available():
        if not cpu_bf16_units() and int(os.environ.get("RANK", 0)) == 0:
            print(
                "chat_rl: warning: --dtype=bf16 on a CPU without bf16 units (AVX512-BF16 or AMX): "
                "torch emulates its matmuls, several times slower than --dtype=fp32"
            )
    if cfg.logprobs not in ("fast", "plain"):
        raise ConfigError(f"unknown --logprobs {cfg.logprobs!r} (fast | plain)")
    if cfg.tool not in ("calculator", "none"):
        raise ConfigError(f"unknown --tool {cfg.tool!r} (calculator | none)")
    if cfg.device_type not in ("", "cpu", "cuda", "mps"):
        raise ConfigError(
            f"unknown --device-type {cfg.device_type!r} (cpu | cuda | mps, or empty to autodetect)"
        )
    if cfg.device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device-type=cuda but no CUDA device is visible")
    if cfg.device_type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("--device-type=mps but MPS is not available on this machine")
    if cfg.fsdp and cfg.device_type == "mps":
        raise ConfigError("--fsdp runs on cuda (nccl) or cpu (gloo), not mps")
    if cfg.loss_norm == "token":  # earlier versions' name for kept_tokens
        raise ConfigError(
            "--loss-norm=token is now kept_tokens (the same normaliser); "
            "all_tokens counts the dropped groups too"
        )
    if cfg.advantage not in ADVANTAGES:
        raise ConfigError(f"--advantage is {' | '.join(ADVANTAGES)}, not {cfg.advantage!r}")
    if cfg.loss_norm not in LOSS_NORMS:
        raise ConfigError(f"--loss-norm is {' | '.join(LOSS_NORMS)}, not {cfg.loss_norm!r}")
    check_objective(cfg)
    check_model_path(cfg.model)
    # the generic task's options
    for name, parameter in inspect.signature(generic.make).parameters.items():
        if cfg.task != "data" and getattr(cfg, name) != parameter.default:
            raise ConfigError(
                f"--{name.replace('_', '-')} is for --task=data, your own rows; "
                f"--task={cfg.task} reads its own columns and grades with its own verifier"
            )
    if (
        cfg.lora_rank < 0
        or cfg.lora_alpha <= 0
        or not cfg.lora_lr > 0
        or not math.isfinite(cfg.lora_lr + cfg.lora_alpha)
    ):
        raise ConfigError(
            f"--lora-rank must be >= 0 (0 = off), --lora-alpha and --lora-lr above 0 "
            f"(got {cfg.lora_rank}, {cfg.lora_alpha}, {cfg.lora_lr})"
        )
    if cfg.lora_rank and cfg.fsdp:
        raise ConfigError(
            "--lora-rank with --fsdp is not built: LoRA's frozen bf16 base is 2 bytes a parameter "
            "(a 7B model, 15 GB, fits one 24 GB GPU), so ranks hold all of it (plain DDP); "
            "sharding it beside fp32 adapters is untested here"
        )
    try:
        lora.parse_targets(cfg.lora_targets)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.eval_data and not cfg.data:
        raise ConfigError("--eval-data names the held-out rows of --data: give --data too")
    check_task_options(cfg)
    # a user's task or reward that cannot be loaded stops the run here, before any data or model
    load_task(cfg)


def check_objective(cfg):
    """--kl-beta, --ppo-epochs, the clip and --rollout-correction (chat_rl.objective)."""
    if not (math.isfinite(cfg.kl_beta) and cfg.kl_beta >= 0):
        raise ConfigError(f"--kl-beta must be a finite number >= 0 (0 = off), got {cfg.kl_beta}")
    if cfg.ppo_epochs < 1:
        raise ConfigError(f"--ppo-epochs must be >= 1 (1 update a rollout), got {cfg.ppo_epochs}")
    if not 0 <= cfg.clip_eps < 1:  # 1 - clip_eps bounds a ratio, which is > 0
        raise ConfigError(f"--clip-eps must be in [0, 1), got {cfg.clip_eps}")
    if cfg.clip_eps_high != -1 and not 0 <= cfg.clip_eps_high < math.inf:
        raise ConfigError(
            f"--clip-eps-high must be -1 (= --clip-eps) or a finite number >= 0, "
            f"got {cfg.clip_eps_high}"
        )
    # read by PPO's branch of objective() alone; DEFAULTS: each flag's default (parse_config's)
    for name in ("clip_eps", "clip_eps_high"):
        if cfg.ppo_epochs == 1 and getattr(cfg, name) != DEFAULTS.get(name, getattr(cfg, name)):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} acts only with --ppo-epochs > 1: alone it changes nothing")
    if cfg.rollout_correction not in ("none", "tis", "mis"):
        raise ConfigError(
            f"unknown --rollout-correction {cfg.rollout_correction!r} (none | tis | mis)"
        )
    if not (math.isfinite(cfg.rollout_cap) and cfg.rollout_cap > 1):
        raise ConfigError(f"--rollout-cap must be a finite number above 1, got {cfg.rollout_cap}")
    # the engine's log-probs are of the cut distribution, the trainer's of the whole: their ratio
    # would weigh each token by its share of the top k, not by the sampler's rounding
    if cfg.rollout_correction != "none" and cfg.top_k > 0:
        raise ConfigError(
            "--rollout-correction with --top-k > 0: the sampler's log-probs are of the top-k "
            "distribution, the trainer's of the whole one, their ratio not rounding (--top-k=0)"
        )
    if cfg.kl_beta > 0 and cfg.fsdp:
        raise ConfigError(
            "--kl-beta with --fsdp is not built: its frozen reference would be "
            "a whole, unsharded copy of the model on every rank"
        )


def check_task_options(cfg):
    """The options of one built-in task, refused with any other: --rg-config and --rg-train-size
    (--task=rg:<dataset>), --gsm8k-answer (--task=gsm8k), --mental-digits and --mental-ops."""
    if cfg.task != "mental":
        for name, default in (("mental_digits", 1), ("mental_ops", "+-x")):
            if getattr(cfg, name) != default:
                raise ConfigError(
                    f"--{name.replace('_', '-')} is for --task=mental, not --task={cfg.task}"
                )
    if not cfg.task.startswith("rg:"):
        for name, default in (("rg_config", ""), ("rg_train_size", rg.TRAIN_SIZE)):
            if getattr(cfg, name) != default:
                raise ConfigError(
                    f"--{name.replace('_', '-')} is for --task=rg:<dataset> (reasoning-gym), "
                    f"not --task={cfg.task}"
                )
    elif cfg.data:
        raise ConfigError(f"--task={cfg.task} generates its own rows: it reads no --data")
    if cfg.gsm8k_answer not in gsm8k.ANSWER_RULES:
        raise ConfigError(
            f"unknown --gsm8k-answer {cfg.gsm8k_answer!r} ({' | '.join(gsm8k.ANSWER_RULES)})"
        )
    if cfg.gsm8k_answer != "hash" and cfg.task != "gsm8k":
        own = cfg.task == "data"  # --data without --task: GSM8K's own files are --task=gsm8k's
        raise ConfigError(
            f"--gsm8k-answer is for --task=gsm8k, not --task={cfg.task}"
            + (" (GSM8K's own files: --task=gsm8k --data=...)" if own else "")
        )


def load_task(cfg):
    """The task --task names, with its options (the generic task's, reasoning-gym's, GSM8K's
    answer rule); what cannot be loaded is a ConfigError, before any data or model is touched."""
    if cfg.task == "data" and not cfg.data:
        raise ConfigError(
            "--task=data trains on your own rows: name them with --data=<file, folder or hub id>"
        )
    try:
        if cfg.task == "data":
            return generic.make(
                cfg.prompt_column, cfg.answer_column, cfg.instruction, cfg.verifier, cfg.reward
            )
        if cfg.task.startswith("rg:"):  # reasoning-gym's generators, imported only here
            return rg.make(
                cfg.task[3:], cfg.rg_config, cfg.rg_train_size, cfg.eval_examples, cfg.seed
            )
        if cfg.task == "mental" and (cfg.mental_digits, cfg.mental_ops) != (1, "+-x"):
            return mental.make(cfg.mental_digits, cfg.mental_ops)  # a harder ladder's rung
        if cfg.task == "gsm8k" and cfg.gsm8k_answer == "last-number":
            return gsm8k.last_number_task()
        return get_task(cfg.task)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_model_path(model):
    """--model names a Hugging Face folder, a PEFT LoRA folder, "demo_model" or a hub id: a file,
    a run's folder or a folder without a config.json (or adapter_config.json) is refused with what
    to give instead."""
    if os.path.isfile(model):
        raise ConfigError(
            f"--model={model!r} is a file: "
            f"give the folder that holds its config.json and safetensors"
        )
    if os.path.isdir(model) and not any(
        os.path.exists(os.path.join(model, f)) for f in ("config.json", "adapter_config.json")
    ):
        steps = sorted(
            d
            for d in os.listdir(model)
            if d.startswith("step_") and os.path.isdir(os.path.join(model, d))
        )
        if steps:
            raise ConfigError(
                f"--model={model!r} is a run's folder: its checkpoints are its step_* folders, "
                f"the latest {os.path.join(model, steps[-1])}"
            )
        raise ConfigError(
            f"--model={model!r} holds no config.json: not a Hugging Face model folder"
        )
    if model != "demo_model" and not os.path.isdir(model) and not _looks_like_hub_id(model):
        raise ConfigError(
            f"--model={model!r}: no such folder (a name is downloaded as a hub id only if it "
            f"looks like Org/Name, e.g. Qwen/Qwen2.5-0.5B-Instruct, and no folder Org is here)"
        )


def _looks_like_hub_id(name):
    """Org/Name in the hub's characters, where Org is not a folder here: my_models/qwen with
    my_models/ present is a path with a typo in it, not a model to look for on the network."""
    hub_shaped = re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None and not name.startswith(".")
    return hub_shaped and not os.path.isdir(name.split("/")[0])
