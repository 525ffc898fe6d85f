"""
The Hugging Face hub, in one place: a hub id ("Qwen/Qwen2.5-0.5B-Instruct") becomes a local
folder (the model loader and the tokenizer loader both ask here), fetching only what chat_rl reads.
"""

import os

# what a hub download fetches: weights (model.safetensors or model-0000x-of-0000n shards), config,
# tokenizer, chat template, stop tokens (and the marker of a chat_rl byte-tokenizer folder); not *.bin,
# *.gguf or other copies of the weights
HUB_FILES = ["config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
             "chat_rl_tokenizer.json"]


def resolve_folder(name_or_dir):
    """A local folder as it is; a hub id ("Qwen/Qwen2.5-0.5B-Instruct") is fetched into the HF cache first."""
    if os.path.isdir(name_or_dir):
        return name_or_dir
    if name_or_dir.count("/") != 1 or name_or_dir.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{name_or_dir!r} is neither a folder nor a hub id like 'Qwen/Qwen2.5-0.5B-Instruct'")
    from huggingface_hub import snapshot_download  # imported here: the offline demo never needs the hub
    try:
        return snapshot_download(name_or_dir, allow_patterns=HUB_FILES)
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise FileNotFoundError(f"{name_or_dir!r} is no local folder and the hub download failed: "
                                f"{type(e).__name__}: {first_line}") from None
