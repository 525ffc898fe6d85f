"""
Flags and their checks, kept out of chat_rl.py's reading line: --name=value over a preset over the
defaults of chat_rl.HYPERPARAMETERS, and every impossible or nonsensical combination refused with a
one-line reason before any process group, model or data is touched.
"""

import math
import os
import sys
from types import SimpleNamespace

import torch

from tasks.common import TASKS


class RunError(Exception):
    """Stops the run with a one-line message (exit 1): data or model that cannot be loaded, a run gone non-finite."""


class ConfigError(RunError):
    """A bad flag or an impossible combination: one line (exit 2), before any work."""


def parse_config(argv, hyperparameters, presets, doc=""):
    """--name=value flags over the preset over the defaults; unknown names and bad values raise ConfigError."""
    if "--help" in argv or "-h" in argv:
        print(doc.strip().split("\n")[0] + "\n\nflags (default):")
        for name, (default, help) in hyperparameters.items():
            print(f"  --{name.replace('_', '-'):<22} {help} ({default!r})")
        sys.exit(0)
    flags = {}
    for arg in argv:
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r} (flags look like --name=value)")
        name, has_value, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if name not in hyperparameters:
            raise ConfigError(f"unknown flag --{name.replace('_', '-')} (see --help)")
        default = hyperparameters[name][0]
        if not has_value and not isinstance(default, bool):
            raise ConfigError(f"--{name.replace('_', '-')} needs a value")
        flags[name] = _convert(name, value if has_value else "true", default)
    preset = flags.get("preset", "")
    if preset and preset not in presets:
        raise ConfigError(f"unknown preset {preset!r} (choose from {', '.join(presets)})")
    return SimpleNamespace(**{**{k: d for k, (d, _) in hyperparameters.items()}, **presets.get(preset, {}), **flags})


def _convert(name, value, default):
    try:
        if isinstance(default, bool):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return value.lower() in ("true", "1")
        return type(default)(value)
    except ValueError:
        raise ConfigError(f"--{name.replace('_', '-')}={value!r}: expected {type(default).__name__}") from None


def check_config(cfg, world_size):
    """Impossible or nonsensical settings, each refused with its reason."""
    for name in ("examples_per_step", "num_samples", "max_new_tokens", "device_batch_size", "eval_examples",
                 "eval_samples", "generate_batch_rows", "num_epochs", "keep_checkpoints", "max_nonfinite"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    for name in ("eval_every", "save_every", "num_steps"):
        value = getattr(cfg, name)
        if value == 0 or value < -1:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive or -1 (off/derived), got {value}")
    if cfg.examples_per_step % world_size:
        raise ConfigError(f"--examples-per-step={cfg.examples_per_step} is not divisible by the {world_size} ranks")
    for name in ("temperature", "lr", "weight_decay", "grad_clip", "format_weight"):
        if not math.isfinite(getattr(cfg, name)):
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number, got {getattr(cfg, name)}")
    if cfg.temperature < 0 or cfg.top_k < 0 or cfg.lr <= 0 or cfg.grad_clip < 0 or cfg.format_weight < 0:
        raise ConfigError("temperature, top_k, grad_clip and format_weight must be >= 0 and lr > 0")
    if cfg.num_samples < 2 or cfg.temperature == 0:
        # one sample, or identical greedy samples, give every group a zero advantage: nothing would train
        raise ConfigError(f"rollouts need --num-samples >= 2 and --temperature > 0 (got {cfg.num_samples}, {cfg.temperature})")
    if cfg.task not in TASKS:
        raise ConfigError(f"unknown task {cfg.task!r} (choose from {', '.join(TASKS)})")
    if cfg.device_type not in ("", "cpu", "cuda", "mps"):
        raise ConfigError(f"unknown --device-type {cfg.device_type!r} (cpu | cuda | mps, or empty to autodetect)")
    if cfg.device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device-type=cuda but no CUDA device is visible")
    if cfg.device_type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("--device-type=mps but MPS is not available on this machine")
    if cfg.advantage not in ("mean", "zscore") or cfg.loss_norm not in ("token", "sequence"):
        raise ConfigError("--advantage is mean | zscore and --loss-norm is token | sequence")
    if cfg.model != "demo_model" and not os.path.isdir(cfg.model) and not _looks_like_hub_id(cfg.model):
        raise ConfigError(f"--model={cfg.model!r}: no such folder (and not a hub id like Qwen/Qwen2.5-0.5B-Instruct)")


def _looks_like_hub_id(name):
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))
