"""
Hugging Face folders, the format every checkpoint in and out of chat_rl has: a hub id
("Qwen/Qwen2.5-0.5B-Instruct") becomes a local folder (the model and the tokenizer loaders both
ask here), fetching only what chat_rl reads; config.json maps to and from gpt.GPTConfig's fields;
the weights are one model.safetensors or the shards an index names, read tensor by tensor into a
model built on the meta device (read_weights) and written back (write_weights). Checkpoint names
map onto the model's parameters by gpt.GPT.hf_layout (q/k/v and gate/up are stored fused there).
"""

import json
import os

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

# what a hub download fetches: weights (model.safetensors or model-0000x-of-0000n shards), config,
# tokenizer, chat template, stop tokens, the marker of a chat_rl byte-tokenizer folder and a PEFT
# adapter's files; not *.bin, *.gguf or other copies of the weights
HUB_FILES = [
    "config.json",
    "generation_config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_rl_tokenizer.json",
    "adapter_config.json",
    "adapter_model.safetensors",
]


def resolve_folder(name_or_dir):
    """A local folder as it is; a hub id ("Qwen/Qwen2.5-0.5B-Instruct") is fetched into the HF
    cache first."""
    if os.path.isdir(name_or_dir):
        return name_or_dir
    if name_or_dir.count("/") != 1 or name_or_dir.startswith((".", "/", "~")):
        raise FileNotFoundError(
            f"{name_or_dir!r} is neither a folder nor a hub id like 'Qwen/Qwen2.5-0.5B-Instruct'"
        )
    # imported here: the offline demo never needs the hub
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name_or_dir, allow_patterns=HUB_FILES)
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise FileNotFoundError(
            f"no folder {name_or_dir!r} here, and no hub model of that name could be fetched "
            f"({type(e).__name__}: {first_line[:160]})"
        ) from None


# the repository root: "demo_model" names the folder shipped here wherever a run starts, as
# plumbing/checkpoint.load_policy reads it
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_config(name_or_dir, fetch=False):
    """
    A model's config.json as a dict, read cheaply: no weights, and nothing downloaded unless
    fetch. name_or_dir: a folder (a PEFT LoRA folder: its base's config), a config.json file,
    "demo_model" (the folder shipped here) or a hub id, whose config.json comes from the local
    Hugging Face cache (fetch=True: fetched into it, that file alone, if it is not there yet).
    None when there is none to read: a hub id not cached (offline), a folder without one.
    """
    if name_or_dir == "demo_model":
        name_or_dir = os.path.join(REPO, "demo_model")
    try:
        if os.path.isdir(name_or_dir):
            file = os.path.join(name_or_dir, "config.json")
            if not os.path.exists(file) and os.path.exists(
                os.path.join(name_or_dir, "adapter_config.json")
            ):
                from policy.lora import read_adapter_config  # a PEFT folder: its base's shape

                return read_config(read_adapter_config(name_or_dir)[0], fetch)
        elif os.path.isfile(name_or_dir):
            file = name_or_dir
        else:
            # imported here: the offline demo never needs the hub
            from huggingface_hub import hf_hub_download, try_to_load_from_cache

            file = try_to_load_from_cache(name_or_dir, "config.json")
            if not isinstance(file, str) and fetch:
                file = hf_hub_download(name_or_dir, "config.json")
        return read_json(file) if isinstance(file, str) else None
    except Exception:  # noqa: BLE001 - unreadable for any reason (a bad id, offline): no config
        return None


ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def write_config(path, config, dtype):
    """config.json of a folder whose weights are stored in dtype."""
    hf = config_to_hf(config)
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)


def read_weights(model, path, device, dtype, keep_fp32=()):
    """
    Each checkpoint tensor of folder `path` into `model` (built on the meta device: nothing
    allocated, nothing drawn), read on its own from the memory-mapped file, converted to dtype
    (None: as stored; fp32 for the names in keep_fp32), put on device and in place, so the peak is
    the model plus one tensor. A fused Linear's part (model.hf_layout) goes into its rows. A tensor
    the architecture lacks, a shape the config does not give or a tensor the files lack fails in one
    line.
    """
    tied = model.config.tie_word_embeddings
    layout = {name: (own, rows) for name, own, rows in model.hf_layout()}
    loaded = set()
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:  # memory-mapped: nothing is read until asked for
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and tied):
                    continue  # recomputed / the same tensor as embed_tokens.weight
                if name not in layout:
                    raise ValueError(
                        f"{file} holds {name!r}, which this architecture does not have"
                    )
                own, rows = layout[name]
                param = model.get_parameter(own)
                expected = param.shape if rows is None else param[rows].shape
                kind = torch.float32 if name in keep_fp32 else dtype
                tensor = read_tensor(f, name, device, kind)
                if tensor.shape != expected:
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)} "
                        f"!= config shape {tuple(expected)}"
                    )
                module_name, _, attr = own.rpartition(".")
                if rows is None:
                    setattr(model.get_submodule(module_name), attr, nn.Parameter(tensor))
                else:
                    # a part of a fused Linear (the others may come from another shard): its rows,
                    # in place
                    if param.is_meta:
                        param = nn.Parameter(
                            torch.empty(param.shape, device=device, dtype=tensor.dtype)
                        )
                        setattr(model.get_submodule(module_name), attr, param)
                    with torch.no_grad():
                        param[rows] = tensor
                loaded.add(name)
    missing = [name for name in layout if name not in loaded]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[0]}")


def read_tensor(f, name, device, dtype):
    """Tensor `name` of the open file f, converted to dtype (None: as stored) on device; on the
    meta device (under --fsdp every rank but the first, whose values come from rank 0) its shape
    and dtype alone: nothing is read."""
    if torch.device(device).type == "meta":
        part = f.get_slice(name)
        return torch.empty(part.get_shape(), dtype=dtype or part[:0].dtype, device="meta")
    return f.get_tensor(name).to(device=device, dtype=dtype)


def write_weights(path, state):
    """model.safetensors in folder `path` (made if missing) from {checkpoint name: CPU tensor}."""
    os.makedirs(path, exist_ok=True)
    weights = os.path.join(path, "model.safetensors")
    save_file(state, weights, metadata={"format": "pt"})  # "pt": what transformers expects
    # safetensors writes a temporary file of mode 0600 and renames it into place; give the weights
    # the mode every other file of the folder gets from open(), 0666 less the umask (0644 under the
    # usual 022), or the other users of a shared machine could read the config but not the weights
    os.chmod(weights, 0o666 & ~umask())


def safetensors_files(path):
    """The weight files of a folder: the shards its index names, else model.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        return [
            os.path.join(path, name)
            for name in sorted(set(read_json(index)["weight_map"].values()))
        ]
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(
            f"{path} has no model.safetensors or model.safetensors.index.json "
            "(only safetensors are read)"
        )
    return [single]


def umask():
    """The process's umask: os.umask can only read it by setting it, so it is set straight back."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def read_json(file):
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file} does not exist")
    with open(file) as f:
        return json.load(f)


def config_fields(hf):
    """gpt.GPTConfig's fields from a Hugging Face config.json dict; anything gpt.py cannot compute
    fails with one line."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {kind!r} (supported model_type: {', '.join(ARCHITECTURES)} "
            "= Llama/SmolLM, Qwen2/Qwen2.5, Qwen3)"
        )
    # switches this class does not have: refuse instead of computing something else
    refused = {
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        "mlp_bias": bool(hf.get("mlp_bias")),
        "use_sliding_window": bool(hf.get("use_sliding_window")),
        "partial_rotary_factor": hf.get("partial_rotary_factor", 1.0) != 1.0,
        "attention_bias (bias on o_proj too)": kind != "qwen2" and bool(hf.get("attention_bias")),
    }
    for what, bad in refused.items():
        if bad:
            raise ValueError(
                f"{kind} checkpoint with {what} = {hf.get(what.split()[0])!r} is not supported"
            )
    fields = {
        f: hf[f]
        for f in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "rms_norm_eps",
            "max_position_embeddings",
        )
        if f in hf
    }
    fields["num_key_value_heads"] = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    fields["head_dim"] = hf.get("head_dim") or 0
    # RoPE: hub configs write rope_theta + rope_scaling; transformers 5 writes both into
    # rope_parameters
    rope = dict(hf.get("rope_parameters") or {})
    fields["rope_theta"] = hf.get("rope_theta") or rope.get("rope_theta", 10000.0)
    scaling = hf.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: default, llama3)")
    fields["rope_scaling"] = dict(scaling, rope_type="llama3") if rope_type == "llama3" else None
    # False: the default of all three config classes
    fields["tie_word_embeddings"] = hf.get("tie_word_embeddings", False)
    # Qwen2 always has q/k/v bias; its config does not say so
    fields["attention_bias"] = kind == "qwen2"
    fields["qk_norm"] = kind == "qwen3"
    return fields


def config_to_hf(config):
    """config.json in the form hub checkpoints use (rope_theta, rope_scaling), read by
    transformers 4 and 5 and vLLM."""
    kind = "qwen3" if config.qk_norm else "qwen2" if config.attention_bias else "llama"
    hf = {
        f: getattr(config, f)
        for f in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "rope_theta",
            "rope_scaling",
            "max_position_embeddings",
            "tie_word_embeddings",
        )
    }
    hf.update(
        model_type=kind,
        architectures=[ARCHITECTURES[kind]],
        hidden_act="silu",
        torch_dtype="float32",
    )
    if kind != "qwen2":
        hf["attention_bias"] = False
    if kind != "llama":
        hf["use_sliding_window"] = False
    return hf
