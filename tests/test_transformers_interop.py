"""
What transformers sees of chat_rl's folders: the demo's byte tokenizer saved as a standard Hugging
Face tokenizer (same ids, same chat prompts), and docs/checkpoints.md's transformers snippet run as
written on the checkpoints chat_rl writes, giving the engine's own greedy completion.
"""

import os
import re

import pytest
import torch

import chat_rl
import test_hf_checkpoints as hf_ckpt  # a module object, so pytest does not collect its tests twice
from engine import Engine
from plumbing import checkpoint, flags
from policy.gpt import GPT, GPTConfig
from policy.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from tasks import gsm8k

# ---------------------------------------------------------------------------------------------
# The byte tokenizer (the demo's) as a standard Hugging Face tokenizer:
# tokenizer.json + chat template.

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BYTE_CONVERSATIONS = [
    [{"role": "user", "content": "what is two plus two?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "and 3 + 4?\n"}],
    [
        {"role": "user", "content": "héllo €😀 <b>"},
        {"role": "assistant", "content": "#### 4"},
        {"role": "user", "content": " spaces  and\ttabs . "},
    ],
    [{"role": "system", "content": ""}, {"role": "user", "content": ""}],
]


def random_text(rng, n):
    """n code points from every plane (surrogates excluded: they are not text):
    1- to 4-byte UTF-8."""
    ranges = [(0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    return "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(n))


def test_byte_tokenizer_json_gives_the_same_ids(tmp_path):
    import random

    from tokenizers import Tokenizer, pre_tokenizers
    from transformers import AutoTokenizer

    from policy.tokenizer import BYTE_CHARS, SPECIAL_TOKENS

    assert sorted(BYTE_CHARS.values()) == sorted(
        pre_tokenizers.ByteLevel.alphabet()
    )  # GPT-2's table, as the library has it
    ours = ByteTokenizer()
    ours.save_pretrained(tmp_path)
    raw, auto = (
        Tokenizer.from_file(str(tmp_path / "tokenizer.json")),
        AutoTokenizer.from_pretrained(tmp_path),
    )
    assert (
        [raw.token_to_id(t) for t in SPECIAL_TOKENS]
        == [256, 257, 258, 259, 260]
        == auto.convert_tokens_to_ids(SPECIAL_TOKENS)
    )
    assert (auto.bos_token_id, auto.eos_token_id, len(auto)) == (ours.bos_id, 260, ours.vocab_size)
    rng = random.Random(0)
    texts = ["", " x . y , z ?", "  two  spaces\n\ttab\r\n", "\x00\x7f\x80ÿ", "héllo €😀"] + [
        random_text(rng, 50) for _ in range(200)
    ]
    for text in texts:
        ids = ours.encode(text)
        assert (
            raw.encode(text, add_special_tokens=False).ids
            == ids
            == auto.encode(text, add_special_tokens=False)
        )
        assert raw.decode(ids) == text == auto.decode(ids)
    # any id sequence decodes alike:
    # invalid UTF-8 (a model samples anything) and special tokens between bytes
    invalid = [
        [0xFF],
        [0xE2, 0x82],
        [0xE2, 0x82, 0x41],
        [0xC0, 0x80],
        [0xED, 0xA0, 0x80],
        [0xF4, 0x90, 0x80, 0x80],
        [0xE2, 257, 0x82, 0xAC],
    ]
    for ids in invalid + [
        [rng.randrange(261) for _ in range(rng.randrange(30))] for _ in range(2000)
    ]:
        assert raw.decode(ids) == ours.decode(ids) == auto.decode(ids, skip_special_tokens=True), (
            ids
        )
    assert ours.decode([0xE2, 257, 0x82, 0xAC]) == "€"


def test_byte_tokenizer_chat_template_renders_chat_rl_prompts(tmp_path):
    import jinja2
    from transformers import AutoTokenizer

    ours = ByteTokenizer()
    ours.save_pretrained(tmp_path)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    for messages in BYTE_CONVERSATIONS:
        prompt = auto.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert list(prompt) == ours.render_for_completion({"messages": messages})
    full = BYTE_CONVERSATIONS[2][
        :2
    ]  # the whole conversation, the assistant's turn and its end token included
    assert (
        list(auto.apply_chat_template(full, tokenize=True, return_dict=False))
        == ours.render_conversation({"messages": full})[0]
    )
    # a copy without the marker (on the hub, say) reads as a plain HF tokenizer:
    # same ids, same training mask
    hf = HFTokenizer(str(tmp_path))
    assert hf.render_conversation({"messages": full}) == ours.render_conversation(
        {"messages": full}
    )
    assert (hf.stop_tokens, hf.bos_id) == (ours.stop_tokens, ours.bos_id)
    with pytest.raises(jinja2.exceptions.TemplateError, match="roles must alternate"):
        auto.apply_chat_template([{"role": "assistant", "content": "hi"}], tokenize=False)


def test_byte_tokenizer_folders_load_as_the_byte_tokenizer(tmp_path):
    ByteTokenizer().save_pretrained(tmp_path / "new")
    assert isinstance(
        load_tokenizer(str(tmp_path / "new")), ByteTokenizer
    )  # the marker wins over tokenizer.json
    (tmp_path / "old").mkdir()  # what ByteTokenizer saved before it wrote tokenizer.json
    (tmp_path / "old" / "chat_rl_tokenizer.json").write_text('{"type": "byte"}')
    assert isinstance(load_tokenizer(str(tmp_path / "old")), ByteTokenizer)


def test_demo_model_carries_the_current_tokenizer_files(tmp_path):
    ByteTokenizer().save_pretrained(tmp_path)
    for name in os.listdir(tmp_path):
        with (
            open(tmp_path / name, "rb") as fresh,
            open(os.path.join(REPO, "demo_model", name), "rb") as shipped,
        ):
            assert shipped.read() == fresh.read(), (
                f"demo_model/{name} is stale: "
                "rewrite it with ByteTokenizer().save_pretrained('demo_model')"
            )


# ---------------------------------------------------------------------------------------------
# docs/checkpoints.md's transformers snippet, executed as written (its path replaced; for
# demo_model/, its commented-out message for the demo's models used): its prompt ids, greedy
# completion and printed text must be the ones chat_rl's engine gives at temperature 0.


def readme_snippet():
    text = open(os.path.join(REPO, "docs", "checkpoints.md")).read()
    return (
        text.split("\ntransformers, as it is", 1)[1].split("```python\n", 1)[1].split("\n```", 1)[0]
    )


def run_readme_snippet(path, capsys, demo_message=False):
    """Execute the snippet on path;
    demo_message: with its commented-out message for the demo's models instead."""
    code, n = re.subn(
        r'^path = "[^"]*"', lambda m: f"path = {str(path)!r}", readme_snippet(), flags=re.M
    )
    assert n == 1, 'the snippet no longer sets path = "..." on a line of its own'
    if demo_message:
        code, n = re.subn(
            r"^# (messages = .*)$", r"\1", code, flags=re.M
        )  # the later assignment wins
        assert n == 1
    capsys.readouterr()
    namespace = {}
    exec(compile(code, "docs/checkpoints.md (transformers snippet)", "exec"), namespace)
    return namespace, capsys.readouterr().out


def assert_snippet_matches_engine(path, namespace, printed):
    """The snippet's prompt ids, completion ids (its stop token included) and printed text
    are chat_rl's."""
    tokenizer, model = load_tokenizer(path), GPT.from_pretrained(path).eval()
    prompt = tokenizer.render_for_completion({"messages": namespace["messages"]})
    max_new_tokens = int(re.search(r"max_new_tokens=(\d+)", readme_snippet()).group(1))
    sequences, masks = Engine(model, tokenizer).generate_batch(
        [prompt], max_new_tokens=max_new_tokens, temperature=0.0, include_stop=True
    )
    completion = sequences[0][len(prompt) :]
    assert masks[0] == [0] * len(prompt) + [1] * len(completion)
    assert namespace["inputs"]["input_ids"][0].tolist() == prompt
    assert namespace["out"][0, len(prompt) :].tolist() == completion  # token for token
    assert printed == tokenizer.decode(completion) + "\n"
    return completion


def assert_ran_the_whole_budget(completion, path):
    """The completion is the snippet's whole budget, varied, with no stop token:
    every one of its tokens was compared."""
    budget = int(re.search(r"max_new_tokens=(\d+)", readme_snippet()).group(1))
    assert len(completion) == budget and not set(completion) & load_tokenizer(str(path)).stop_tokens
    assert len(set(completion)) > 50  # not one token repeated: a long run of distinct choices


def perturb(model, seed=0):
    """Wide random weights: logits far apart, so greedy decoding meets no near-ties
    that rounding could flip."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.15)
    return model


def test_readme_snippet_on_a_byte_tokenizer_checkpoint(tmp_path, capsys):
    # the folder a demo run writes (checkpoint.save), from a random model of the demo's shape
    model = perturb(
        GPT(
            GPTConfig(
                vocab_size=264,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        )
    )
    with torch.no_grad():
        model.model.embed_tokens.weight[261:] = (
            0  # rows past the 261 tokens: never chosen (the engine masks them)
        )
    cfg = flags.parse_config(
        ["--preset=demo", f"--out-dir={tmp_path / 'run'}"], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS
    )
    checkpoint.save(
        cfg, 300, model, ByteTokenizer(), torch.optim.AdamW(model.parameters()), rank=0, world=1
    )
    path = tmp_path / "run" / "step_000300"
    namespace, printed = run_readme_snippet(path, capsys)
    # as written, the snippet sends the GSM8K user message chat_rl trains on
    assert namespace["messages"] == [
        {"role": "user", "content": gsm8k.prompt({"question": namespace["question"]})}
    ]
    completion = assert_snippet_matches_engine(str(path), namespace, printed)
    assert_ran_the_whole_budget(
        completion, path
    )  # random bytes, invalid UTF-8 included, not an early stop


def test_readme_snippet_on_the_demo_model(capsys):
    # the shipped demo_model/, asked the snippet's problem for the demo
    # (one of its own kind, as arith asks it)
    from tasks import arith

    path = os.path.join(REPO, "demo_model")
    namespace, printed = run_readme_snippet(path, capsys, demo_message=True)
    question = namespace["messages"][0]["content"]
    assert namespace["messages"] == [
        {"role": "user", "content": arith.prompt({"question": question})}
    ]
    completion = assert_snippet_matches_engine(path, namespace, printed)
    assert printed.endswith("#### 34\n") and completion[-1] == 260, (
        printed
    )  # what docs/checkpoints.md says it answers, then its turn ends


def test_readme_snippet_on_a_real_model_style_checkpoint(tmp_path, capsys):
    # Llama-3 style (a byte-level BPE tokenizer.json with tokenizer_class PreTrainedTokenizerFast, a
    # chat template, llama3 RoPE), through chat_rl's loader and saver. Not Qwen2: transformers 5
    # rebuilds any qwen2 folder's tokenizer as Qwen2Tokenizer (Qwen's own split regex), which only
    # Qwen's tokenizer.json matches.
    import transformers

    source = tmp_path / "llama"
    hf_ckpt.make_tokenizer_folder(source)
    vocab = HFTokenizer(
        str(source)
    ).vocab_size  # no rows past the tokenizer's: every logit is a token
    config = transformers.LlamaConfig(
        **{**hf_ckpt.COMMON, "vocab_size": vocab, "max_position_embeddings": 2048},
        rope_parameters={"rope_theta": 500000.0, **hf_ckpt.LLAMA3_ROPE},
        tie_word_embeddings=True,
    )
    perturb(transformers.AutoModelForCausalLM.from_config(config)).save_pretrained(source)
    path = str(tmp_path / "step_000467")
    GPT.from_pretrained(str(source)).save_pretrained(path)
    load_tokenizer(str(source)).save_pretrained(path)
    namespace, printed = run_readme_snippet(path, capsys)
    completion = assert_snippet_matches_engine(path, namespace, printed)
    assert_ran_the_whole_budget(completion, path)
