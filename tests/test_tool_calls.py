"""The engine calls the calculator mid-decode: forced results masked 0, any tokenizer, compaction,
seeds."""

import json

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from calculator import calculate
from engine import Engine
from fast.tool_calls import IN, LT, OUT, _run
from policy.gpt import GPT, GPTConfig
from policy.tokenizer import ByteTokenizer, load_tokenizer

STOP = 260  # <|assistant_end|> of the byte tokenizer


class ScriptedModel(torch.nn.Module):
    """
    A policy that writes a fixed text per row, whatever the tokenizer: at each position it reads
    the row's text so far (its tokens as fed back to it, forced ones included) and puts a large
    logit on the longest token that continues its script; once the script is written (or the text
    has left it) it says stop. Underneath, a tiny random GPT runs the KV cache exactly as a real
    policy would, and KVCache.row_ids tells the original row each batch slot holds after compaction.
    """

    def __init__(self, tokenizer, scripts, num_samples, stop):
        super().__init__()
        vocab = tokenizer.vocab_size
        self.gpt = (
            GPT(
                GPTConfig(
                    vocab_size=vocab,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    num_key_value_heads=1,
                )
            )
            .init_weights(0)
            .eval()
        )
        self.config, self.lm_head, self.rope = self.gpt.config, self.gpt.lm_head, self.gpt.rope
        self.tokenizer, self.scripts, self.num_samples, self.stop = (
            tokenizer,
            scripts,
            num_samples,
            stop,
        )
        self.texts = {token: tokenizer.decode([token]) for token in range(vocab)}
        self.history = {}

    def forward(self, idx, kv_cache=None):
        logits = self.gpt(idx, kv_cache=kv_cache)
        if not kv_cache.decoding:  # the prefill: one row per prompt, before any sample exists
            self.history = {row: [] for row in range(idx.size(0) * self.num_samples)}
            rows = [
                p * self.num_samples for p in range(idx.size(0))
            ]  # every sample of a prompt starts alike
        else:
            rows = (
                kv_cache.row_ids.tolist()
                if kv_cache.row_ids is not None
                else list(range(idx.size(0)))
            )
            for slot, row in enumerate(rows):
                self.history[row].append(int(idx[slot, 0]))
        for slot, row in enumerate(rows):
            logits[slot, -1] += 1e4 * torch.nn.functional.one_hot(
                torch.tensor(self.next_token(row)), logits.size(-1)
            )
        return logits

    def next_token(self, row):
        text, script = self.tokenizer.decode(self.history[row]), self.scripts[row]
        if not script.startswith(text) or text == script:
            return self.stop
        rest = script[len(text) :]
        return max(
            (t for t, s in self.texts.items() if s and rest.startswith(s)),
            key=lambda t: len(self.texts[t]),
        )


PROMPT = [256, 257, 65, 258, 259]  # <|bos|><|user_start|>A<|user_end|><|assistant_start|>


def completion(tokenizer, seq, prompt):
    return tokenizer.decode(seq[len(prompt) :])


def forced_text(tokenizer, seq, mask, prompt=PROMPT):
    return tokenizer.decode([t for t, m in zip(seq[len(prompt) :], mask[len(prompt) :]) if not m])


def test_the_automaton_spots_calls_in_text_split_anywhere():
    assert _run("$<<12/60=", OUT) == (OUT, True)
    assert (
        _run("<", OUT) == (LT, False)
        and _run("<", LT) == (IN, False)
        and _run("3*4=", IN) == (OUT, True)
    )
    assert _run("=$", IN) == (OUT, False)  # the model wrote past the '=' itself: no call
    assert _run("3*4\n", IN) == (OUT, False) and _run("3>", IN) == (
        OUT,
        False,
    )  # an annotation is one line
    assert _run("a < b = c", OUT) == (OUT, False)  # one '<' is not a call


def test_results_are_forced_masked_zero_and_counted():
    tok = ByteTokenizer()
    scripts = ["<<3*4=12>>12\n#### 12", "7-2=5\n#### 5", "<<10/4=2.5>>2.5 and <<2.5*2=5>>5\n#### 5"]
    model = ScriptedModel(tok, scripts, 1, STOP)
    engine = Engine(model, tok, tool=calculate)
    seqs, masks, calls, errors = engine.generate([PROMPT] * 3, 1, 64, temperature=1.0, seed=0)[:4]
    assert [completion(tok, s, PROMPT) for s in seqs] == scripts
    assert [forced_text(tok, s, m) for s, m in zip(seqs, masks)] == ["12>>", "", "2.5>>5>>"]
    assert calls == [1, 0, 2] and errors == [0, 0, 0]
    # what the loss trains on (mask 1) is the model's own text: the results are not in it
    sampled = [tok.decode([t for t, m in zip(s, k) if m]) for s, k in zip(seqs, masks)]
    assert sampled[0] == "<<3*4=12\n#### 12"


def test_without_the_tool_the_same_script_is_all_sampled():
    tok = ByteTokenizer()
    scripts = ["<<3*4=12>>12\n#### 12"]
    seqs, masks = Engine(ScriptedModel(tok, scripts, 1, STOP), tok).generate_batch(
        [PROMPT], 1, 64, seed=0
    )
    assert completion(tok, seqs[0], PROMPT) == scripts[0] and all(masks[0][len(PROMPT) :])


def test_a_refused_expression_forces_nothing_and_is_counted():
    tok = ByteTokenizer()
    scripts = ["<<2+x=5>>5\n#### 5", "<<7//2=3>>3", "<<1/0=0>>"]
    engine = Engine(ScriptedModel(tok, scripts, 1, STOP), tok, tool=calculate)
    seqs, masks, calls, errors = engine.generate([PROMPT] * 3, 1, 64, seed=0)[:4]
    assert [completion(tok, s, PROMPT) for s in seqs] == scripts
    assert all(all(m[len(PROMPT) :]) for m in masks)
    assert calls == [1, 1, 1] and errors == [1, 1, 1]


def test_an_unclosed_call_simply_continues():
    tok = ByteTokenizer()
    scripts = ["<<3*4 is twelve\n#### 12", "<<3*4"]
    engine = Engine(ScriptedModel(tok, scripts, 1, STOP), tok, tool=calculate)
    seqs, masks, calls, errors = engine.generate([PROMPT] * 2, 1, 32, seed=0)[:4]
    assert [completion(tok, s, PROMPT) for s in seqs] == scripts
    assert calls == [0, 0] and errors == [0, 0]


def test_forced_tokens_count_toward_max_new_tokens():
    tok = ByteTokenizer()
    engine = Engine(ScriptedModel(tok, ["<<99*99=9801>>9801"], 1, STOP), tok, tool=calculate)
    seqs, masks = engine.generate_batch(
        [PROMPT], 1, 9, seed=0
    )  # "<<99*99=" is 8 tokens, then 1 forced
    assert completion(tok, seqs[0], PROMPT) == "<<99*99=9" and masks[0][-1] == 0


def test_rows_mid_call_survive_compaction():
    # 16 rows that stop at different positions (compaction at every position it can), some inside a
    # call or a forced result when their neighbours leave: every row's text and mask must be as if
    # alone
    tok = ByteTokenizer()
    # (a prompt's samples share their first token, drawn from the prefill:
    # every script starts with "So")
    scripts = [
        "So" + " " * (i % 5) + f"<<{i}*3={i * 3}>>{i * 3}" + ("\n" if i % 2 else " and <<1+1=2>>2")
        for i in range(16)
    ]
    kw = dict(num_samples=4, max_new_tokens=40, temperature=1.0, seed=0)
    prompts = [PROMPT[:2] + [65 + p] + PROMPT[3:] for p in range(4)]
    together = Engine(ScriptedModel(tok, scripts, 4, STOP), tok, compact_at=0.0, tool=calculate)
    seqs, masks, calls, _ = together.generate(prompts, **kw)[:4]
    assert [completion(tok, s, prompts[i // 4]) for i, s in enumerate(seqs)] == scripts
    for i, (s, m) in enumerate(zip(seqs, masks)):
        alone = Engine(ScriptedModel(tok, [scripts[i]], 1, STOP), tok, tool=calculate)
        a, am = alone.generate_batch([prompts[i // 4]], 1, 40, seed=0)
        assert (s, m) == (a[0], am[0])
    assert calls == [1 if i % 2 else 2 for i in range(16)]


def test_rows_that_never_call_sample_bit_for_bit_as_with_the_tool_off():
    # a random model at temperature 1.5 writes '<' and '=' now and then but never '<<...=':
    # the tool must change nothing
    torch.manual_seed(0)
    model = (
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
        .init_weights(3)
        .eval()
    )
    prompts = [[256, 72, 105, 33], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [256, 60, 60, 61]]
    kw = dict(num_samples=8, max_new_tokens=40, temperature=1.5, seed=4, include_stop=True)
    off = Engine(model, ByteTokenizer()).generate(prompts, **kw)
    on = Engine(model, ByteTokenizer(), tool=calculate).generate(prompts, **kw)
    assert on == off and sum(on.tool_calls) == 0


def bpe_folder(tmp_path):
    """A byte-level BPE tokenizer.json trained here on GSM8K-style lines, so '<<', '=' and
    '>>' merge with their neighbours, saved with a chat template as a real checkpoint's
    tokenizer is."""
    tok = Tokenizer(models.BPE())
    # digits one by one, as Qwen's and Llama 3's pre-tokenizers split them;
    # everything else may merge: "$<<", ")=", ">>."
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    lines = [
        "She pays $<<12/60=0.2>>0.2 a minute.",
        "So 3*4 = <<3*4=12>>12 cups.",
        "Total: <<2*(5+7)=24>>24.",
        "Then <<24-9=15>>15 are left.",
        "#### 15",
        "<|end|>",
    ] * 50
    tok.train_from_iterator(
        lines,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|end|>",
                "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
            }
        )
    )
    return load_tokenizer(str(tmp_path))


def test_calls_work_with_a_bpe_tokenizer_whose_tokens_merge_across_the_syntax(tmp_path):
    tok = bpe_folder(tmp_path)
    scripts = [
        "She pays $<<12/60=0.2>>0.2 a minute.",
        "So 3*4 = <<3*4=12>>12 cups.",
        "Total: <<2*(5+7)=24>>24.",
    ]
    pieces = {tok.decode([t]) for script in scripts for t in tok.encode(script)}
    assert {
        "She pays $<<",
        ")=",
    } <= pieces  # the call's syntax merged with its neighbours into one token
    prompt = tok.encode("Q")
    stop = min(tok.stop_tokens)
    engine = Engine(ScriptedModel(tok, scripts, 1, stop), tok, tool=calculate)
    seqs, masks, calls, _ = engine.generate([prompt] * 3, 1, 64, seed=0)[:4]
    assert [tok.decode(s[len(prompt) :]) for s in seqs] == scripts
    assert calls == [1, 1, 1]
    assert [forced_text(tok, s, k, prompt) for s, k in zip(seqs, masks)] == [
        "0.2>>",
        "12>>",
        "24>>",
    ]


def test_forced_tokens_are_neither_trained_nor_counted_by_the_loss():
    import chat_rl

    model = GPT(
        GPTConfig(
            vocab_size=264,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).init_weights(1)
    # one prompt [256, 5, 6], two samples; mask 0 after the prompt = a forced tool result inside the
    # completion
    seqs = [[256, 5, 6, 7, 8, 9, 10, 11], [256, 5, 6, 12, 13, 14, 15, 16]]
    masks = [[0, 0, 0, 1, 1, 0, 0, 1], [0, 0, 0, 1, 0, 0, 1, 1]]
    advantages = torch.tensor([0.5, -0.5])
    loss, counted = chat_rl.policy_gradient_backward(
        model,
        seqs,
        masks,
        advantages,
        num_samples=2,
        device_batch_size=8,
        loss_norm=chat_rl.HYPERPARAMETERS["loss_norm"][0],
        device="cpu",
    )
    assert counted == 6  # the sampled tokens only
    reference = GPT(model.config)
    reference.load_state_dict(model.state_dict())
    logp = torch.log_softmax(reference(torch.tensor(seqs)[:, :-1]), dim=-1)
    picked = logp.gather(2, torch.tensor(seqs)[:, 1:, None])[
        ..., 0
    ]  # (2, 7): log-prob of each next token
    sampled = torch.tensor(masks)[:, 1:].float()
    expected = -(picked * sampled * advantages[:, None]).sum() / sampled.sum()
    expected.backward()
    assert torch.allclose(loss, expected, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
