"""
Tokenizers. Both expose the same methods, so chat_rl.py and engine.py never ask which one they hold:

    encode(text) -> list[int]            decode(ids) -> str
    render_conversation(conv) -> (ids, mask)   mask 1 = assistant tokens a model is trained on
    render_for_completion(conv) -> ids   the prompt, ending where the assistant's turn begins
    stop_tokens -> set[int]              a sampled stop token ends a row
    vocab_size, bos_id

A conversation is {"messages": [{"role": "user" | "assistant" | "system", "content": str}, ...]}.

ByteTokenizer: the 256 byte values plus five chat special tokens; the offline demo and the
tests use it, so nothing has to be downloaded. (A wrapper over the `tokenizers` library for
real checkpoints lives beside it, with the same methods.)
"""

SPECIAL_TOKENS = ["<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>"]


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
        """The prompt for sampling: every turn up to the last user turn, then <|assistant_start|>."""
        turns = _merged_turns(conversation)
        if turns and turns[-1][0] == "assistant":
            turns = turns[:-1]  # a conversation that carries its reference answer: drop it
        ids, _ = self.render_conversation({"messages": [{"role": r, "content": c} for r, c in turns]})
        return ids + [self.special["<|assistant_start|>"]]


def _merged_turns(conversation):
    """(role, content) pairs; a leading system message is folded into the first user turn."""
    messages = conversation["messages"]
    if messages and messages[0]["role"] == "system":
        assert len(messages) > 1 and messages[1]["role"] == "user", "a system message must precede a user message"
        messages = [{"role": "user", "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}] + messages[2:]
    turns = []
    for i, m in enumerate(messages):
        expected = "user" if i % 2 == 0 else "assistant"
        assert m["role"] == expected, f"message {i} has role {m['role']!r}, expected {expected!r}"
        turns.append((m["role"], m["content"]))
    return turns
