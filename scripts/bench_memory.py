"""
Memory of a training micro-batch, with and without --activation-checkpointing.

    # peak of one forward+backward, 12-layer config, on this CPU
    python -m scripts.bench_memory
    # activation bytes a token costs, Qwen2.5 0.5B / 1.5B / 3B / 7B shapes
    python -m scripts.bench_memory --per-token
    # per-GPU memory: full fine-tuning beside LoRA (--lora-rank=16)
    python -m scripts.bench_memory --table

Peak (the default): a 12-layer model (width 768, SwiGLU 2048, 12 heads over 4 KV heads,
vocabulary 32768, tied head: 101M parameters) runs one forward+backward of the per-token NLL that
chat_rl's loss weights, on 8 rows x 512 tokens, every token a target (the most a micro-batch of
that size can cost), in fp32 on the CPU. Each variant runs in a fresh process, since an allocator
that has already grown would hide the difference: build the model, allocate its gradients, reset
the kernel's high-water mark of the process's resident memory (write 5 to /proc/self/clear_refs;
Linux), run the pass, read VmHWM from /proc/self/status. Printed: the high-water mark above what
was resident before the pass (the pass's activations and temporaries; weights and gradients
excluded), the bytes autograd kept for the backward pass, counted exactly with
saved_tensors_hooks (unique storages, weights excluded), and the pass's seconds (one measurement
on a shared CPU: indicative only).

Per token: what autograd keeps for one decoder layer and for the head (final norm, lm_head, the
fp32 cross-entropy) of each shape, per token, from one row of 256 tokens on the CPU with bf16
weights (what FSDP computes with on CUDA). The CPU's attention kernel, like CUDA's flash kernel,
keeps O(T) per row, not the T x T attention matrix, so the count scales with tokens. docs/gpu.md's
memory table is built from these figures.

Log-prob pass (a row of scripts/bench_rollout.py's table): the peak of forward + backward of
lm_head and the log-probs alone, chunked as RL's loss runs them (logprobs.SampledLogprobs) or all
logits at once.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fast import logprobs
from plumbing import memory
from policy import lora
from policy.gpt import GPT, GPTConfig
from policy.hf_folder import config_fields

TWELVE_LAYERS = dict(
    vocab_size=32768,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)
# the shapes of Qwen2.5-{0.5B, 1.5B, 3B, 7B}-Instruct's config.json (shared with plan_memory.py)
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "qwen25_configs.json")) as f:
    QWEN25 = {
        re.search(r"[\d.]+B", hub_id)[0]: config_fields(hf) for hub_id, hf in json.load(f).items()
    }


class SavedBytes:
    """Counts the bytes autograd keeps for the backward pass: unique storages, weights excluded."""

    def __init__(self, model):
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t):
        s = t.untyped_storage()
        if s.data_ptr() not in self.weights:
            self.storages[s.data_ptr()] = s.nbytes()
        return t

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def total(self):
        return sum(self.storages.values())


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that the operations under it make (views and in-place results
    are not new storage) and that are still alive, now and at the most: each is counted until
    its storage is freed, however many tensors or autograd's saved ones keep it."""

    def __init__(self):
        super().__init__()
        self.sizes, self.now, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    key = storage.data_ptr()
                    if key and key not in self.sizes:
                        self.sizes[key] = storage.nbytes()
                        self.now += storage.nbytes()
                        self.peak = max(self.peak, self.now)
                        weakref.finalize(storage, self._freed, key)
        return out

    def _freed(self, key):
        self.now -= self.sizes.pop(key)


def resident_kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_worker(checkpointing, rows, tokens):
    """One forward+backward in this (fresh) process; prints a JSON line."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TWELVE_LAYERS)).init_weights(0)
    model.checkpoint_layers = checkpointing
    # allocated before the measurement: the pass's own memory is what is left
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    idx = torch.randint(0, 32768, (rows, tokens))
    targets = torch.randint(0, 32768, (rows, tokens))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    before, t0 = resident_kb("VmRSS"), time.time()
    with SavedBytes(model) as saved:
        loss = model(idx, targets, loss_reduction="none").sum() / targets.numel()
    loss.backward()
    print(
        json.dumps(
            {
                "checkpointing": checkpointing,
                "resident_before_mib": before / 1024,
                "seconds": time.time() - t0,
                "pass_peak_mib": (resident_kb("VmHWM") - before) / 1024,
                "saved_mib": saved.total / 2**20,
            }
        )
    )


def logprob_peak_worker(kind, tokens, hidden, vocab):
    """In a fresh process: peak resident memory growth (bytes) of forward + backward of lm_head +
    NLL over tokens."""
    h = torch.randn(tokens, hidden, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(vocab, hidden) * 0.02)
    targets = torch.randint(0, vocab, (tokens,))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    before = resident_kb("VmRSS")
    if kind == "chunked":  # what RL's loss does (fast_logprobs' head)
        loss_grad = torch.full((tokens,), -1.0 / tokens)
        loss = (
            loss_grad
            * logprobs.SampledLogprobs.apply(
                h, weight, targets, loss_grad, max(1, 2**24 // vocab), 1.0
            )
        ).sum()
    else:  # the previous way: all (tokens, vocab) logits at once
        loss = torch.nn.functional.cross_entropy(
            torch.nn.functional.linear(h, weight).float(), targets
        )
    loss.backward()
    print((resident_kb("VmHWM") - before) * 1024)


def logprob_peak(kind, tokens, hidden, vocab):
    """The training log-prob pass's peak (bench_rollout's row): kind "chunked"
    (logprobs.SampledLogprobs) or "unchunked"."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.bench_memory",
            f"--logprob-worker={kind},{tokens},{hidden},{vocab}",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    return int(out.stdout.split()[-1])


def peak(rows, tokens):
    print(
        f"12-layer config ({GPT(GPTConfig(**TWELVE_LAYERS)).num_params() / 1e6:.0f}M params, "
        f"fp32, CPU), one forward+backward of {rows} rows x {tokens} tokens, every token a "
        f"target, torch {torch.__version__}"
    )
    print(
        f"{'activation checkpointing':<26} {'resident before MiB':>20} "
        f"{'pass peak above it MiB':>23} {'saved for backward MiB':>23} {'pass s':>7}"
    )
    for checkpointing in (False, True):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "scripts.bench_memory",
                "--worker",
                str(int(checkpointing)),
                f"--rows={rows}",
                f"--tokens={tokens}",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{'on' if checkpointing else 'off':<26} {r['resident_before_mib']:>20.0f} "
            f"{r['pass_peak_mib']:>23.0f} {r['saved_mib']:>23.0f} {r['seconds']:>7.1f}"
        )


def saved_per_token(shape, lora_rank=0, tokens=256):
    """Bytes autograd keeps per token for one decoder layer of the shape, plain and checkpointed,
    and for the head, bf16 (as on CUDA): with lora_rank, the layer frozen and LoRA adapters on all
    its projections (policy/lora.py)."""
    # one layer of the shape: the rest repeats it
    model = GPT(GPTConfig(**{**shape, "num_hidden_layers": 1}))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    if lora_rank:
        lora.add_adapters(model, lora_rank, 32.0)
        # under autocast on CUDA the adapters compute in bf16 too
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    else:
        model = model.to(torch.bfloat16)
    idx, targets = torch.randint(0, 1000, (1, tokens)), torch.randint(0, 1000, (1, tokens))
    # the layer's input (B, T, C), bf16
    x = model.model.embed_tokens(idx).detach().requires_grad_(not lora_rank)
    rope = model.rope(torch.arange(tokens)[None])
    layer = {}
    for checkpointing in (False, True):
        with SavedBytes(model) as saved:
            h = x
            for block in model.model.layers:  # gpt.GPT.forward's loop, over one layer
                h = (
                    torch.utils.checkpoint.checkpoint(
                        block, h, rope, None, None, use_reentrant=False
                    )
                    if checkpointing
                    else block(h, rope, None, None)
                )
        layer[checkpointing] = saved.total / tokens
    # the head: final norm, lm_head over the targets, fp32 cross-entropy
    with SavedBytes(model) as saved:
        hidden = model.model.norm(h.detach().requires_grad_())
        torch.nn.functional.cross_entropy(model.lm_head(hidden[0]).float(), targets[0])
    return layer[False], layer[True], saved.total / tokens


def table(lora_rank=16, tokens=16384):
    """Per-GPU training memory (GB) of full fine-tuning and of LoRA at lora_rank, one GPU (or every
    rank of a DDP run), a micro-batch of `tokens` tokens, every one a target: state + activations,
    each measured or counted."""
    print(
        f"per-GPU training memory, GB: micro-batch of {tokens} tokens (--device-batch-tokens), "
        f"every token a target; LoRA rank {lora_rank} on every projection; "
        f"torch {torch.__version__}"
    )
    print(
        "| Qwen2.5 | params | LoRA params | state: full / LoRA | activations: full / LoRA "
        "| full: plain / checkpointed | LoRA: plain / checkpointed |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")

    def gb(b):
        return f"{b / 1e9:.0f}" if b >= 1e10 else f"{b / 1e9:.1f}"

    for name, shape in QWEN25.items():
        full, low_rank = (memory.counts(GPTConfig(**shape), rank) for rank in (0, lora_rank))
        params, adapters = full.total, low_rank.trained
        # fp32 weights, gradients and 2 moments; LoRA: the base in bf16 (plumbing/memory.state)
        state = {
            kind: sum(memory.state(c).values()) for kind, c in (("full", full), ("lora", low_rank))
        }
        peaks, activations = {}, {}
        for kind, rank in (("full", 0), ("lora", lora_rank)):
            layer, layer_checkpointed, head = saved_per_token(shape, rank)
            n = shape["num_hidden_layers"]
            activations[kind] = (n * layer + head) * tokens
            # checkpointed: every layer's input, and the one layer
            # the backward pass recomputes at a time
            peaks[kind] = [
                state[kind] + (n * layer + head) * tokens,
                state[kind] + (n * layer_checkpointed + layer + head) * tokens,
            ]
        print(
            f"| {name} | {params / 1e9:.2f}B | {adapters / 1e6:.1f}M | "
            f"{gb(state['full'])} / {gb(state['lora'])} | "
            f"{gb(activations['full'])} / {gb(activations['lora'])} | "
            f"{' / '.join(map(gb, peaks['full']))} | {' / '.join(map(gb, peaks['lora']))} |"
        )


def per_token(tokens=256):
    """Saved bytes per token of one decoder layer (plain, and checkpointed: its input only) and of
    the head."""
    print(
        f"bytes autograd keeps per token, bf16 weights, one row of {tokens} tokens (CPU), "
        f"torch {torch.__version__}"
    )
    print(f"{'shape':<6} {'params':>8} {'layer':>9} {'layer, checkpointed':>20} {'head':>10}")
    for name, shape in QWEN25.items():
        with torch.device("meta"):
            params = GPT(GPTConfig(**shape)).num_params()
        layer, layer_checkpointed, head = saved_per_token(shape, tokens=tokens)
        print(
            f"{name:<6} {params / 1e9:>7.2f}B {layer:>9.0f} "
            f"{layer_checkpointed:>20.0f} {head:>10.0f}"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description="activation memory with and without activation checkpointing"
    )
    p.add_argument("--per-token", action="store_true")
    p.add_argument(
        "--table",
        action="store_true",
        help="per-GPU memory of full fine-tuning and LoRA, Qwen2.5 shapes",
    )
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--logprob-worker", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.logprob_worker:
        kind, *sizes = args.logprob_worker.split(",")
        logprob_peak_worker(kind, *map(int, sizes))
    elif args.worker >= 0:
        peak_worker(bool(args.worker), args.rows, args.tokens)
    elif args.per_token:
        per_token()
    elif args.table:
        table(args.lora_rank)
    else:
        peak(args.rows, args.tokens)
