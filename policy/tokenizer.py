"""
Tokenizers. Both expose the same methods, so chat_rl.py and engine.py never ask which one they
hold:

    encode(text) -> list[int]            decode(ids) -> str
    render_conversation(conv) -> (ids, mask)   mask 1 = assistant tokens a model is trained on
    render_for_completion(conv) -> ids   the prompt, ending where the assistant's turn begins
    stop_tokens -> set[int]              a sampled stop token ends a row
    vocab_size, bos_id

A conversation is {"messages": [{"role": "user" | "assistant" | "system", "content": str}, ...]}.

ByteTokenizer: the 256 byte values plus five chat special tokens; the offline demo and the
tests use it, so nothing has to be downloaded. It saves itself as a standard Hugging Face tokenizer
(tokenizer.json + chat template), so transformers loads a demo checkpoint with the same ids.
HFTokenizer: a real checkpoint's tokenizer.json (the `tokenizers` library) with the model's own
chat template, rendered the way transformers' apply_chat_template renders it.
load_tokenizer(folder or hub id) picks the one a folder was saved with (ByteTokenizer's folders
carry the marker chat_rl_tokenizer.json); save_pretrained writes it back.
"""

import json
import os
import re
from datetime import datetime

import jinja2

# templates from the hub are untrusted code
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from policy.hf_folder import resolve_folder

SPECIAL_TOKENS = [
    "<|bos|>",
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
]


class ByteTokenizer:
    def __init__(self):
        self.special = {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)}
        self.special_names = {i: name for name, i in self.special.items()}
        self.vocab_size = 256 + len(SPECIAL_TOKENS)
        self.bos_id = self.special["<|bos|>"]
        self.stop_tokens = {self.special["<|assistant_end|>"]}

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        # special tokens are dropped; bytes that do not form valid UTF-8 (a model can sample
        # anything) become U+FFFD instead of raising
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def render_conversation(self, conversation):
        """ids and a mask of the same length: 1 on the assistant's content and its end token."""
        s = self.special
        ids, mask = [self.bos_id], [0]

        def add(tokens, m):
            ids.extend(tokens)
            mask.extend([m] * len(tokens))

        for role, content in _merged_turns(conversation):
            if role == "user":
                add([s["<|user_start|>"], *self.encode(content), s["<|user_end|>"]], 0)
            else:
                add([s["<|assistant_start|>"]], 0)
                add([*self.encode(content), s["<|assistant_end|>"]], 1)
        return ids, mask

    def render_for_completion(self, conversation):
        """The prompt for sampling: every turn up to the last user turn, then
        <|assistant_start|>."""
        turns = _merged_turns(conversation)
        if turns and turns[-1][0] == "assistant":
            turns = turns[:-1]  # a conversation that carries its reference answer: drop it
        ids, _ = self.render_conversation(
            {"messages": [{"role": r, "content": c} for r, c in turns]}
        )
        return ids + [self.special["<|assistant_start|>"]]

    def save_pretrained(self, path):
        """
        The files of a standard Hugging Face tokenizer, so AutoTokenizer loads the folder as it
        is, with the same ids and prompts as this class:
          tokenizer.json         byte b -> id b (byte_level_tokenizer), special tokens at 256..260
          tokenizer_config.json  the class transformers builds; which special token is bos / eos
          chat_template.jinja    CHAT_TEMPLATE: apply_chat_template gives render_conversation's ids
          generation_config.json the stop token: transformers' generate stops where the engine does
        plus the marker chat_rl_tokenizer.json, which makes load_tokenizer return this class.
        """
        os.makedirs(path, exist_ok=True)
        _write_json(os.path.join(path, "chat_rl_tokenizer.json"), {"type": "byte"})
        byte_level_tokenizer().save(os.path.join(path, "tokenizer.json"))
        _write_json(
            os.path.join(path, "tokenizer_config.json"),
            {
                # a plain tokenizer.json, no Python tokenizer class
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|bos|>",
                "eos_token": "<|assistant_end|>",
                # no token_type_ids, which generate() refuses
                "model_input_names": ["input_ids", "attention_mask"],
                # decode must not drop the space in "x ." (the bytes are the text)
                "clean_up_tokenization_spaces": False,
            },
        )
        with open(os.path.join(path, "chat_template.jinja"), "w") as f:
            f.write(CHAT_TEMPLATE)
        _write_json(
            os.path.join(path, "generation_config.json"),
            {"bos_token_id": self.bos_id, "eos_token_id": sorted(self.stop_tokens)},
        )


# ByteTokenizer's conversation format as a Jinja chat template (the ecosystem's form of it),
# rendered to text that the tokenizer.json below turns into exactly render_conversation's ids: the
# special tokens are written as their strings, which the tokenizer maps to 256..260.
# demo_model/chat_template.jinja holds this text byte for byte (a test compares them), so its long
# lines stay as they are.
CHAT_TEMPLATE = r"""{#- chat_rl's byte tokenizer (tokenizer.py): <|bos|>, then user turns <|user_start|>...<|user_end|> and
    assistant turns <|assistant_start|>...<|assistant_end|>, alternating; a leading system message is
    folded into the first user turn, joined by a blank line. -#}
{%- set offset = 1 if messages and messages[0]['role'] == 'system' else 0 -%}
{%- if offset and (messages | length < 2 or messages[1]['role'] != 'user') -%}
    {{- raise_exception('a system message must precede a user message') -}}
{%- endif -%}
<|bos|>
{%- for message in messages[offset:] -%}
    {%- if message['role'] != ['user', 'assistant'][loop.index0 % 2] -%}
        {{- raise_exception('roles must alternate user, assistant, user, ... (after an optional system message)') -}}
    {%- endif -%}
    {%- if message['role'] == 'user' -%}
        <|user_start|>{{ messages[0]['content'] + '\n\n' if offset and loop.first else '' }}{{ message['content'] }}<|user_end|>
    {%- else -%}
        <|assistant_start|>{{ message['content'] }}<|assistant_end|>
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|assistant_start|>
{%- endif -%}
"""  # noqa: E501


def byte_level_tokenizer():
    """
    ByteTokenizer as a `tokenizers` Tokenizer (what tokenizer.json holds): the ByteLevel
    pre-tokenizer turns each UTF-8 byte of the text into one printable character (GPT-2's table,
    BYTE_CHARS), and a BPE model with those 256 characters as its vocabulary (character of byte b
    -> id b) and no merges maps each to its id, so every text encodes to its bytes. The decoder
    maps characters back to bytes and decodes them as UTF-8, invalid sequences becoming U+FFFD as
    in ByteTokenizer.decode.
    """
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in BYTE_CHARS.items()}, merges=[]))
    # no word splits: none needed
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # ids 256..260
    tok.add_special_tokens(
        [AddedToken(name, special=True, normalized=False) for name in SPECIAL_TOKENS]
    )
    return tok


def _byte_chars():
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the other 68
    for chr(256 + n)."""
    # "!".."~", "¡".."¬", "®".."ÿ"
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


BYTE_CHARS = _byte_chars()


def _merged_turns(conversation):
    """(role, content) pairs; a leading system message is folded into the first user turn."""
    messages = conversation["messages"]
    if messages and messages[0]["role"] == "system":
        assert len(messages) > 1 and messages[1]["role"] == "user", (
            "a system message must precede a user message"
        )
        messages = [
            {"role": "user", "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}
        ] + messages[2:]
    turns = []
    for i, m in enumerate(messages):
        expected = "user" if i % 2 == 0 else "assistant"
        assert m["role"] == expected, f"message {i} has role {m['role']!r}, expected {expected!r}"
        turns.append((m["role"], m["content"]))
    return turns


# ---------------------------------------------------------------------------------------------
# Real checkpoints: tokenizer.json + the chat template of tokenizer_config.json or
# chat_template.jinja

TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
]


class HFTokenizer:
    """A checkpoint folder's tokenizer.json, chat template and stop tokens, behind ByteTokenizer's
    methods."""

    def __init__(self, folder):
        self.folder = folder
        # the files' bytes are kept: a resumed run loads from a checkpoint folder that checkpoint
        # pruning later deletes, and every later checkpoint must still carry the tokenizer
        self.files = {}
        for name in TOKENIZER_FILES:
            if os.path.exists(os.path.join(folder, name)):
                with open(os.path.join(folder, name), "rb") as f:
                    self.files[name] = f.read()
        self.tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        config = _read_json_if_any(folder, "tokenizer_config.json")
        special_map = _read_json_if_any(folder, "special_tokens_map.json")
        # template variables (bos_token, eos_token, ...); a token is saved as a string or as
        # {"content": ...}
        self.special_strings = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(key) or special_map.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if value:
                self.special_strings[key] = value
        self.template = _compile_chat_template(_read_chat_template(folder, config))
        # the texts of control tokens (<|im_end|>, <|eot_id|>): in a message's content they are
        # text, not control
        self.special_texts = [
            t.content for t in self.tok.get_added_tokens_decoder().values() if t.special
        ]
        # ids may have gaps (added tokens); the engine masks logits at ids >= vocab_size (embedding
        # padding)
        self.vocab_size = max(self.tok.get_vocab(with_added_tokens=True).values()) + 1
        self.bos_id = (
            self.tok.token_to_id(self.special_strings["bos_token"])
            if "bos_token" in self.special_strings
            else None
        )
        # stop on every id any of the three places calls end-of-sequence (Qwen2.5-Instruct:
        # <|im_end|>, <|endoftext|>)
        self.stop_tokens = set()
        for file in ("generation_config.json", "config.json"):
            eos = _read_json_if_any(folder, file).get("eos_token_id")
            self.stop_tokens.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if (
            "eos_token" in self.special_strings
            and self.tok.token_to_id(self.special_strings["eos_token"]) is not None
        ):
            self.stop_tokens.add(self.tok.token_to_id(self.special_strings["eos_token"]))

    def encode(self, text):
        # no special tokens added: the chat template writes its own bos / turn markers as text,
        # which the tokenizer maps to their ids (as apply_chat_template(tokenize=True) does)
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def render_text(self, messages, add_generation_prompt):
        """The chat template applied to a list of messages, as a string."""
        if self.template is None:
            raise ValueError(
                f"{self.folder} has no chat template "
                "(tokenizer_config.json chat_template or chat_template.jinja)"
            )
        return self.template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_strings
        )

    def encode_messages(self, messages, add_generation_prompt):
        """
        The chat template's tokens, where a control token comes only from the template: the text of
        one inside a message (a question holding "<|im_end|>") is encoded as the ordinary text it
        is, so a data row cannot forge a turn. The template is rendered with each content replaced
        by a placeholder, the template's text between them encoded with its control tokens and each
        content as plain text. Contents without such text take the plain route, the whole rendered
        text encoded at once, exactly as transformers' apply_chat_template(tokenize=True).
        """
        text = self.render_text(messages, add_generation_prompt)
        if not any(s in str(m["content"]) for m in messages for s in self.special_texts):
            return self.encode(text)
        # private-use characters: in no real text
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        shell = self.render_text(
            [{**m, "content": mark} for m, mark in zip(messages, marks)], add_generation_prompt
        )
        # template, mark, template, ...
        pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", shell)
        content = {mark: str(m["content"]) for mark, m in zip(marks, messages)}
        if "".join(content.get(p, p) for p in pieces) != text:
            raise ValueError(
                "this chat template rewrites a message's content, and the content holds a "
                "control token's text that cannot then be kept apart as text"
            )
        ids = []
        try:
            for piece in pieces:
                # control-token texts inside a content: plain text
                self.tok.encode_special_tokens = piece in content
                ids += self.tok.encode(content.get(piece, piece), add_special_tokens=False).ids
        finally:
            self.tok.encode_special_tokens = False
        return ids

    def render_for_completion(self, conversation):
        """The prompt for sampling: the template with add_generation_prompt, a trailing reference
        answer dropped."""
        messages = conversation["messages"]
        if messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        return self.encode_messages(messages, add_generation_prompt=True)

    def render_conversation(self, conversation):
        """
        ids and a mask: 1 on each assistant turn's tokens up to and including its first stop token.

        Templates differ in how they wrap a turn, so the assistant's tokens are found by rendering
        prefixes, not by parsing. A turn starts where "the messages before it + the generation
        prompt" stops agreeing token by token with the whole conversation (a token straddling that
        boundary is left out), and runs to its first stop token (<|im_end|>, <|eot_id|>): what
        follows it, like Qwen's "\n", is template glue the model never samples. The run never
        passes the point where "the messages up to and including this turn" stops agreeing, unless
        that point is the turn's start: templates may render a turn differently once it is no
        longer the last (Qwen3 adds an empty <think></think> to the final turn only), and then the
        stop token alone ends it.
        """
        messages = conversation["messages"]
        ids = self.encode_messages(messages, add_generation_prompt=False)
        mask = [0] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = _common_prefix(
                self.encode_messages(messages[:i], add_generation_prompt=True), ids
            )
            end = _common_prefix(
                self.encode_messages(messages[: i + 1], add_generation_prompt=False), ids
            )
            for j in range(start, end if end > start else len(ids)):
                mask[j] = 1
                if ids[j] in self.stop_tokens:
                    break
        return ids, mask

    def save_pretrained(self, path):
        """Copy the tokenizer files; generation_config.json gets the stop tokens so transformers'
        generate stops where we do."""
        os.makedirs(path, exist_ok=True)
        for name, data in self.files.items():
            with open(os.path.join(path, name), "wb") as f:
                f.write(data)
        # keeps the model's sampling defaults
        generation = _read_json_if_any(path, "generation_config.json")
        generation["eos_token_id"] = sorted(self.stop_tokens)
        if self.bos_id is not None:
            generation.setdefault("bos_token_id", self.bos_id)
        _write_json(os.path.join(path, "generation_config.json"), generation)


def load_tokenizer(name_or_dir):
    """HFTokenizer for a folder (or hub id) with tokenizer.json; ByteTokenizer for one saved by
    ByteTokenizer."""
    folder = resolve_folder(name_or_dir)
    # the marker first: a byte tokenizer's folder carries a tokenizer.json too (for transformers)
    if _read_json_if_any(folder, "chat_rl_tokenizer.json").get("type") == "byte":
        return ByteTokenizer()
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        return HFTokenizer(folder)
    raise ValueError(
        f"{folder} has neither tokenizer.json (a fast tokenizer) "
        "nor chat_rl_tokenizer.json (the byte tokenizer)"
    )


def _read_chat_template(folder, config):
    """chat_template.jinja (newer saves) else tokenizer_config.json's chat_template (a string or a
    list of named ones)."""
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(jinja_file):
        with open(jinja_file) as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


def _compile_chat_template(source):
    """Jinja set up as the ecosystem renders chat templates: sandboxed, trim/lstrip blocks,
    raise_exception."""
    if source is None:
        return None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    # jinja's own tojson escapes <, >, & as HTML; templates expect plain JSON
    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    # Llama 3.x templates date the system turn
    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _read_json_if_any(folder, name):
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
