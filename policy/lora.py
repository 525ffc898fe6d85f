"""
LoRA (Hu et al. 2021): the base model frozen, and each adapted projection y = W x trained as

    y = W x + (alpha / r) B A x,     A (r, in) random, B (out, r) zero at the start,

so that training starts from the base model exactly.

Memory is why: full fine-tuning keeps fp32 weights, gradients and both AdamW moments, 16 bytes a
parameter; with LoRA the base is 2 bytes a parameter where the run computes in bf16 (CUDA, or a CPU
under --dtype=bf16 or auto's bf16; fp32, 4, otherwise) and only the adapters, a fraction of a
percent of them, get gradients and AdamW state. Quality is the question, and for RL the answer is in
"LoRA Without Regret" (Schulman et al. 2025): policy-gradient RL, which learns about one bit an
episode, matches full fine-tuning with LoRA even at rank 1, if the learning rate is about 10x full
fine-tuning's (chat_rl's --lora-lr) and adapters sit on every linear layer, the MLP's included
(--lora-targets' default).

Where chat_rl meets it: plumbing/checkpoint.build_policy calls add_adapters when it builds the
model, plumbing/start.start gives AdamW only the parameters that still require a gradient, and a
checkpoint holds the merged weights as a plain Hugging Face folder (merged_state_dict), with the
adapter alone beside it as a PEFT folder (save_adapter, which peft.PeftModel.from_pretrained
loads on the base; load_adapter reads one back).

The fused Linears (qkv_proj, gate_up_proj) get one A and one B per projection they hold (q_proj,
k_proj, v_proj; gate_proj, up_proj), under the names Hugging Face and PEFT give them:
`model.layers.0.self_attn.q_proj`. The embeddings and the head stay frozen unless --lora-targets
names them; then they train whole, in fp32 (PEFT's modules_to_save), at 16 bytes a parameter
like full fine-tuning: a 152k-token vocabulary's matrix is 136M parameters at 0.5B's width.

Sampling runs the adapters beside the frozen base (a forward hook adds the second term to each
adapted Linear's output), not a merged copy of the weights: a copy would cost another base model
of memory and a merge every step; beside it, a decode pass runs two small matmuls more per
adapted Linear (docs/benchmarks.md has the cost).
"""

import json
import math
import os
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

# every linear layer
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# frozen unless named: then trained whole
WHOLE = {"embed_tokens": "model.embed_tokens.weight", "lm_head": "lm_head.weight"}


class Adapter(nn.Module):
    """
    The LoRA term of one Linear, x (..., in) -> (..., out): for each projection p the Linear holds
    (parts, in its row order), scale * B_p A_p x where p is a target, 0 where it is not. One
    matmul by the targets' A's stacked, one by their B's laid block-diagonally (zero columns for
    the projections left out), so a fused Linear's adapters cost two matmuls, not two per
    projection.
    """

    def __init__(self, in_features, parts, targets, rank, alpha, generator):
        super().__init__()
        self.widths, self.scale = dict(parts), alpha / rank
        self.off = False  # adapters_off(): the Linear's output is the base's alone
        adapted = [name for name in parts if name in targets]
        self.lora_A = nn.ParameterDict(
            {name: nn.Parameter(torch.empty(rank, in_features)) for name in adapted}
        )
        self.lora_B = nn.ParameterDict(
            {name: nn.Parameter(torch.zeros(parts[name], rank)) for name in adapted}
        )
        for a in self.lora_A.values():  # PEFT's initialisation: A as nn.Linear's weight, B zero
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.built = None  # (a, b) made once for a block of frozen_adapters(), else None

    def stacked(self):
        """(a, b): the targets' A's stacked (targets x r, in), in row order, and their B's laid
        block-diagonally (out, targets x r)."""
        a = torch.cat([self.lora_A[name] for name in self.widths if name in self.lora_A])
        b = torch.block_diag(
            *(
                self.lora_B[name] if name in self.lora_B else a.new_zeros(width, 0)
                for name, width in self.widths.items()
            )
        )
        return a, b

    def forward(self, x):
        a, b = self.built if self.built is not None else self.stacked()
        return F.linear(F.linear(x, a), b) * self.scale


def parse_targets(text):
    """--lora-targets: "all-linear" (PEFT's word for every linear layer but the head) or names,
    "q_proj,v_proj", and either may add embed_tokens and lm_head, which then train whole (PEFT's
    modules_to_save): "all-linear,lm_head"."""
    targets = [t.strip() for t in text.split(",") if t.strip()]
    targets = [name for t in targets for name in (TARGETS if t == "all-linear" else [t])]
    unknown = [t for t in targets if t not in TARGETS and t not in WHOLE]
    if unknown or not set(targets) & set(TARGETS):
        problem = f"unknown {unknown[0]!r}" if unknown else "no projection"
        raise ValueError(
            f"--lora-targets={text!r}: {problem} "
            f"(all-linear, or names from {', '.join(TARGETS)}; "
            "and embed_tokens, lm_head to train whole)"
        )
    return targets


def adapted_linears(model):
    """(name, Linear, {projection: rows}) of every Linear of the decoder layers, fused or not."""
    for name, module in model.model.layers.named_modules(prefix="model.layers"):
        if isinstance(module, nn.Linear):
            yield (
                name,
                module,
                getattr(module, "parts", {name.rpartition(".")[2]: module.out_features}),
            )


def add_adapters(model, rank, alpha, targets=TARGETS, seed=0, base_dtype=None):
    """Freeze the model (its base in base_dtype, None: as it is) and give each target projection a
    LoRA adapter in fp32, B = 0: the same function as before, now trainable only through the
    adapters, and through the embeddings or the head if targets names them (trained whole, in fp32;
    a tied head is the embeddings). Returns the model."""
    whole = {id(model.get_parameter(WHOLE[name])) for name in targets if name in WHOLE}
    for p in model.parameters():
        p.requires_grad_(id(p) in whole)
        if base_dtype is not None and id(p) not in whole:
            p.data = p.data.to(base_dtype)  # parameters only: the RoPE frequencies stay fp32
    generator = torch.Generator().manual_seed(seed)
    for _, linear, parts in adapted_linears(model):
        if set(parts) & set(targets):
            adapter = Adapter(linear.in_features, parts, targets, rank, alpha, generator)
            linear.lora = adapter.to(linear.weight.device)
            linear.lora_hook = linear.register_forward_hook(_add_lora_term)
    model.lora_config = dict(rank=rank, alpha=alpha, targets=list(targets))
    return model


@contextmanager
def frozen_adapters(model):
    """Within the block every adapter's stacked matrices are made once, detached and in autocast's
    dtype where it is on, not at each forward: the engine's decode passes (one per token) under
    no_grad, where the weights do not change. On exit they are made afresh each pass again."""
    adapters = [m for m in model.modules() if isinstance(m, Adapter)]
    device = next(model.parameters()).device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    try:
        with torch.no_grad():
            for adapter in adapters:
                adapter.built = tuple(m.to(dtype or m.dtype) for m in adapter.stacked())
        yield
    finally:
        for adapter in adapters:
            adapter.built = None


def _add_lora_term(linear, inputs, output):
    if not linear.lora.off:  # returning None keeps the base's output
        return output + linear.lora(inputs[0])


@contextmanager
def adapters_off(model):
    """Inside the block the model is its base: every adapter's term left out, nothing copied.
    With B = 0 at the start that is the starting policy, --kl-beta's reference without a second
    model. The modules a run trains whole (embed_tokens, lm_head) have no base to go back to."""
    adapters = [linear.lora for _, linear, _ in adapted_linears(model) if hasattr(linear, "lora")]
    for adapter in adapters:
        adapter.off = True
    try:
        yield model
    finally:
        for adapter in adapters:
            adapter.off = False


def has_adapters(model):
    return hasattr(model, "lora_config")


def adapter_state_dict(model):
    """The adapters under PEFT's names: base_model.model.<projection>.lora_A.weight (r, in),
    lora_B.weight (out, r); and the modules trained whole, base_model.model.lm_head.weight (both
    names of a tied matrix, as PEFT keeps both)."""
    state = {
        f"base_model.model.{WHOLE[name]}": model.get_parameter(WHOLE[name])
        for name in whole_modules(model)
    }
    for name, linear, _ in adapted_linears(model):
        if hasattr(linear, "lora"):
            parent = name.rpartition(".")[0]
            for part in linear.lora.lora_A:
                for kind in ("lora_A", "lora_B"):
                    weight = getattr(linear.lora, kind)[part]
                    state[f"base_model.model.{parent}.{part}.{kind}.weight"] = weight
    return state


def merged_state_dict(model):
    """The weights a plain model with the adapters folded in would hold, under the checkpoints'
    names, in fp32 on the CPU: W + scale * B A per projection (a bf16 base would round away the
    small updates, so they are kept in fp32). Each tensor goes to the CPU on its own before it turns
    fp32, and each update B A leaves the GPU as it is made: the GPU holds one of them at a time,
    never an fp32 copy of the model (30 GB for 7B)."""
    # copied to the CPU as they are, then fp32 there (a copy: the model's own CPU tensors must not
    # take the update)
    state = {
        name: tensor.detach().to("cpu", copy=True).float()
        for name, tensor in model.hf_state_dict().items()
    }
    for name, linear, _ in adapted_linears(model):
        if hasattr(linear, "lora"):
            parent = name.rpartition(".")[0]
            for part, a in linear.lora.lora_A.items():
                update = linear.lora.scale * (linear.lora.lora_B[part] @ a).detach()
                state[f"{parent}.{part}.weight"] += update.cpu()
    return state


def save_adapter(model, path, base_model):
    """A PEFT folder: adapter_config.json and adapter_model.safetensors (fp32), for
    PeftModel.from_pretrained(base)."""
    cfg = model.lora_config
    os.makedirs(path, exist_ok=True)
    # cloned one by one: a tied pair is saved as two copies
    tensors = {k: v.detach().float().cpu().clone() for k, v in adapter_state_dict(model).items()}
    save_file(
        tensors,
        os.path.join(path, "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": base_model,
                "r": cfg["rank"],
                "lora_alpha": cfg["alpha"],
                "target_modules": sorted(set(cfg["targets"]) & set(TARGETS)),
                "lora_dropout": 0.0,
                "bias": "none",
                "fan_in_fan_out": False,
                "use_rslora": False,
                "use_dora": False,
                "init_lora_weights": True,
                "inference_mode": True,
                "modules_to_save": whole_modules(model) or None,
            },
            f,
            indent=2,
        )


def whole_modules(model):
    """The modules a LoRA run trains whole: those its targets name, and with a tied head, both of
    its names."""
    named = [name for name in WHOLE if name in model.lora_config["targets"]]
    return list(WHOLE) if named and model.config.tie_word_embeddings else named


def read_adapter_config(path):
    """A PEFT LoRA folder's settings: (base model, rank, alpha, targets); a ValueError in one line
    if it is not one. A base recorded relative to the folder (plumbing/checkpoint.lora_base writes
    one for a base beside the run) comes back resolved."""
    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    whole = cfg.get("modules_to_save") or []
    if (
        cfg.get("peft_type") != "LORA"
        or cfg.get("use_dora")
        or set(whole) - set(WHOLE)
        or cfg.get("bias", "none") != "none"
    ):
        raise ValueError(
            f"{path}: only LoRA adapters load here "
            "(no DoRA, no bias, modules_to_save only embed_tokens, lm_head)"
        )
    targets = cfg["target_modules"]
    # a list of names, or the string "all-linear"
    targets = [t for t in TARGETS if t in targets] if isinstance(targets, list) else list(TARGETS)
    base = cfg["base_model_name_or_path"]
    if base.startswith("."):  # relative to this folder: the two were moved together, or not at all
        base = os.path.normpath(os.path.join(path, base))
    return base, cfg["r"], cfg["lora_alpha"], targets + [t for t in WHOLE if t in whole]


def load_adapter(model, path):
    """The adapter weights of a PEFT folder into the model's adapters (made by add_adapters with
    its settings)."""
    saved = load_file(os.path.join(path, "adapter_model.safetensors"))
    saved = {
        k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
        for k, v in saved.items()
    }
    ours = adapter_state_dict(model)
    if set(saved) != set(ours):
        missing = sorted(set(ours) ^ set(saved))[0]
        raise ValueError(
            f"{path}: its adapter does not fit this model ({missing} is only on one side)"
        )
    with torch.no_grad():
        for name, p in ours.items():
            p.copy_(saved[name])


def merge_adapters(model):
    """Fold the adapters into the base weights, in fp32, and remove them: a plain, trainable model
    again (a full fine-tuning run that starts from base + adapter). On the meta device (under
    --fsdp, every rank but the first) only the adapters go: the merged values come from rank 0."""
    meta = next(model.parameters()).is_meta
    merged = None if meta else merged_state_dict(model)
    for _, linear, _ in adapted_linears(model):
        if hasattr(linear, "lora"):
            linear.lora_hook.remove()
            del linear.lora, linear.lora_hook
    del model.lora_config
    for p in model.parameters():
        p.data = p.data.float()
        p.requires_grad_(True)
    with torch.no_grad():
        for name, p in model.hf_state_dict(keep_vars=True).items():
            if not meta:
                p.copy_(merged[name])
    return model
