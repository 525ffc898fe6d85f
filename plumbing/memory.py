"""
What a GPU run holds, per rank, planned from the model's config.json alone, before any weight is
read: start() refuses a run whose weights, gradients and AdamW state cannot fit the GPU
(check_state_fits), and scripts/plan_memory.py prints the whole plan (docs/benchmarks.md, "The
memory of a GPU run, planned").

Each figure is the size of tensors the code makes, counted from the shapes the code gives them:
the parameters of the policy built on the meta device (gpt.GPT, lora.add_adapters), the KV cache
in fast/kv_cache.py's layout, and what autograd keeps of a training micro-batch as
fast/logprobs.fast_logprobs runs it (every tensor saved for the backward pass, listed below where
the code makes it). tests/test_plan_memory.py holds each to the bytes the CPU allocates for a
small model of the same family, in CUDA's precision (bf16 autocast, a bf16 base). The plan is for
CUDA: fp32 master weights, bf16 compute; what it leaves out is said where it is left out.

Two phases, never at once (train_step() frees the gradients before each rollout):
  rollout:  the weights, AdamW's moments, autocast's bf16 copy of the weights (kept for the whole
            rollout: the Engine runs under no_grad, not inference_mode, for this cache), under
            --fsdp the whole model gathered in bf16 (fsdp.gathered), the KV cache of the largest
            engine call, and the larger temporaries of its prefill or of its last decode step;
  training: the weights, gradients, AdamW's moments, autocast's copy, --fsdp's gathered units,
            a micro-batch's activations and the loss head's buffers.
"""

import math
from types import SimpleNamespace

import torch

from fast.logprobs import LOGITS_PER_CHUNK, LOW_PRECISION_CHUNKS
from fast.sampling import chunk_rows
from plumbing.flags import ConfigError
from policy import hf_folder, lora
from policy.gpt import GPT, config_from_hf

FP32, BF16 = 4, 2  # bytes an element
GB = 1e9


def counts(config, lora_rank=0, lora_targets="all-linear"):
    """The parameters of the policy chat_rl builds for `config` (a GPTConfig), counted on the meta
    device (nothing allocated): total, trained (all; LoRA: the adapters and the modules trained
    whole), cast (the trained fp32 tensors a matmul reads, which autocast copies to bf16: not the
    norms, not an untied embedding table, which is looked up, not multiplied), and per FSDP unit
    (one decoder layer; the root: the rest)."""
    with torch.device("meta"):
        model = GPT(config)
        if lora_rank:
            lora.add_adapters(model, lora_rank, 1.0, lora.parse_targets(lora_targets))
    params = dict(model.named_parameters())  # a tied head once, as embed_tokens.weight
    trained = {name: p for name, p in params.items() if p.requires_grad}
    looked_up = set() if config.tie_word_embeddings else {"model.embed_tokens.weight"}
    # LoRA's A's and B's are joined (torch.cat, block_diag) before their matmuls: autocast casts
    # the joined tensors, not leaves, so it caches none of them (the activations count those)
    cast = {
        name
        for name, p in trained.items()
        if p.dim() == 2 and name not in looked_up and ".lora_" not in name
    } | {name for name in trained if name.endswith("bias")}
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    total = sum(p.numel() for p in params.values())
    return SimpleNamespace(
        total=total,
        trained=sum(p.numel() for p in trained.values()),
        cast=sum(params[name].numel() for name in cast),
        layer=layer,
        root=total - config.num_hidden_layers * layer,
        head_trained=model.lm_head.weight.requires_grad,
        embeddings_trained=model.model.embed_tokens.weight.requires_grad,
        norms_trained=model.model.norm.weight.requires_grad,
        model=model,  # on the meta device: its shapes
    )


def state(c, fsdp=False, world=1, kl_reference=False):
    """Bytes a rank holds for the whole run: weights (fp32 master copy; LoRA: the frozen base in
    bf16, the trained tensors fp32), gradients (fp32, as the weights they belong to) and AdamW's
    two moments (fp32), each divided over the ranks under --fsdp. kl_reference: --kl-beta's frozen
    copy of the start without LoRA (checkpoint.reference_policy: fp32, every rank)."""
    shard = world if fsdp else 1
    return {
        "weights": (FP32 * c.trained + BF16 * (c.total - c.trained)) / shard,
        "gradients": FP32 * c.trained / shard,
        "AdamW moments": 2 * FP32 * c.trained / shard,
        "--kl-beta reference": FP32 * c.total if kl_reference else 0,
    }


def kv_cache(config, prompts, samples, prompt_tokens, new_tokens, dtype_bytes=BF16):
    """The KV cache of one engine call (fast/kv_cache.KVCache), bytes: (prompt part, own part).
    Every layer's keys in fp32 (kept so for the decode passes' fp32 scores, upcast once as they
    are written) and its values in the dtype the projections compute in (bf16 on CUDA: autocast's,
    or the bf16 weights'): each prompt's once, (P * Hkv, T, D), however many samples share it;
    each row's own (P * S, Hkv, new_tokens, D), every slot allocated at the start."""
    per_token = config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    per_token *= FP32 + dtype_bytes
    return (
        per_token * prompts * prompt_tokens,
        per_token * prompts * samples * new_tokens,
    )


def decode_temporaries(config, prompts, samples, prompt_tokens, new_tokens, vocab):
    """The largest temporaries of the engine's last decode step, bytes: the larger of its
    attention's and its sampler's. KVCache.attend scores in fp32 (as the training kernel does,
    on keys the cache keeps in fp32): the query upcast, scaled and laid out by prompt (three
    copies), the scores, prompt and own, joined for one softmax, its output, that in the values'
    dtype and its prompt part laid out by prompt; the sampler reads the head's (rows, V) bf16
    logits in fp32, on CUDA all rows at once (fast/sampling.chunk_rows)."""
    rows, heads = prompts * samples, config.num_attention_heads
    query = FP32 * rows * heads * config.head_dim
    scores = FP32 * rows * heads * (prompt_tokens + new_tokens)
    probs = BF16 * rows * heads * (prompt_tokens + new_tokens + prompt_tokens)
    attention = 3 * query + 3 * scores + probs
    sampler = BF16 * rows * vocab + 3 * FP32 * chunk_rows("cuda", rows, vocab) * vocab
    return max(attention, sampler)


def prefill_temporaries(config, prompts, prompt_tokens, residual_bytes=FP32):
    """The largest temporaries of the engine's prefill (Engine.prefill: every prompt of the call,
    left-padded, in one forward pass), bytes. A layer at a time, its MLP's moment is the largest:
    in SwiGLU, the fused gate/up output (2F) beside silu(gate) and their product (F each), all
    bf16, while the layer's input, its attention's output added to it and the norm's output stay
    alive in the residual stream's dtype (fp32 beside fp32 weights)."""
    tokens = prompts * prompt_tokens
    return tokens * (BF16 * 4 * config.intermediate_size + 3 * residual_bytes * config.hidden_size)


def micro_batch(cfg, prompt_tokens, rows_per_rank):
    """The largest training micro-batch (fast/logprobs.micro_batches), as SimpleNamespace(B rows, G
    prompts, P prefix tokens, T own tokens): every completion max_new_tokens long and a target
    throughout (an upper bound: tool results are no targets), device_batch_size rows unless
    device_batch_tokens allows fewer. A row's prefix is its prompt less the last token, which
    starts its own part (fast/shared_prefix.make_shared_batch); rows go in group order, so B rows
    span ceil(B / num_samples) prompts, or one more when passes start mid-group."""
    P, T = prompt_tokens - 1, cfg.max_new_tokens
    B = min(cfg.device_batch_size, rows_per_rank, max(1, cfg.device_batch_tokens // (P + T)))
    S = cfg.num_samples
    aligned = S % B == 0 or B % S == 0  # every pass starts a group
    G = min(B, math.ceil(B / S) if aligned else math.ceil((B - 1) / S) + 1)
    return SimpleNamespace(B=B, G=G, P=P, T=T)


def norm_saved(C, weight_trained, residual_bytes):
    """Bytes a token's RMSNorm keeps for the backward pass (gpt.RMSNorm): its input in fp32 (an
    fp32 residual as it is, a bf16 one upcast) and 1 / rms, and, if its weight trains, the
    normalized input it multiplies (in the residual's dtype)."""
    return FP32 * C + FP32 + (residual_bytes * C if weight_trained else 0)


def layer_saved(config, mb, residual_bytes, lora_rank=0, lora_targets="all-linear",
                input_grad=True):  # fmt: skip
    """Bytes one decoder layer keeps for the backward pass of micro-batch mb (gpt.Block over
    fast/shared_prefix.SharedPrefix), computing in bf16: N flat tokens, the prefixes' and the
    rows' own; F: the MLP's width. input_grad: whether the layer's input needs a gradient; a LoRA
    run's first layer does not (its embeddings are frozen), so its first norm keeps nothing, and
    the attention keeps nothing unless q, k or v is adapted."""
    C, F, H, Hkv, D = (
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    B, G, P, T = mb.B, mb.G, mb.P, mb.T
    N = G * P + B * T
    full = not lora_rank
    targets = set(lora.parse_targets(lora_targets)) if lora_rank else set()
    parts = {
        "qkv": ("q_proj", "k_proj", "v_proj"),
        "o_proj": ("o_proj",),
        "gate_up": ("gate_proj", "up_proj"),
        "down_proj": ("down_proj",),
    }
    inputs = {"qkv": C, "o_proj": H * D, "gate_up": C, "down_proj": F}
    outputs = {"qkv": (H + 2 * Hkv) * D, "o_proj": C, "gate_up": 2 * F, "down_proj": C}
    adapted = {name: len(targets & set(own)) * lora_rank for name, own in parts.items()}
    # the norms; a Linear keeps its (bf16) input if its weight trains, or if its adapter's first
    # matmul does (a frozen Linear's input gradient needs only its weight)
    norms = (2 if input_grad else 1) * norm_saved(C, full, residual_bytes)
    kept = sum(width for name, width in inputs.items() if full or adapted[name])
    total = (norms + BF16 * kept) * N
    # LoRA (lora.Adapter): each adapted Linear keeps its rank-r middle (N, r x targets), the bf16
    # cast of its block-diagonal B's (out, r x targets) and, for its input's gradient, that of its
    # joined A's (r x targets, in)
    for name, r in adapted.items():
        needs_a = input_grad or name != "qkv"
        total += BF16 * r * (N + outputs[name] + (inputs[name] if needs_a else 0))
    if not (full or input_grad or adapted["qkv"]):
        return total + BF16 * 2 * F * N  # q, k, v need no gradient: attention keeps nothing
    if config.qk_norm:  # the heads of q and k normalized in fp32, then scaled (gpt.Attention)
        heads = H + Hkv
        total += (FP32 * heads * D + FP32 * heads + (BF16 * heads * D if full else 0)) * N
        # the joined norm weights (H + Hkv, D), in the weights' dtype (LoRA's base: bf16)
        total += (residual_bytes if full else BF16) * heads * D
    # SharedPrefix.attend: q, k, v gathered into their padded slots (k and v: each row's prefix
    # again beside its own tokens); flash attention over the prefixes keeps its output and
    # log-sum-exp; the rows' masked attention its output and log-sum-exp, and the query heads of
    # each GQA group folded into its time axis (a copy, unless the group is one head)
    folded = BF16 * H * D if H > Hkv else 0
    total += BF16 * H * D * (G * P + B * T)
    total += 2 * BF16 * Hkv * D * (G * P + B * (P + T))
    total += (BF16 * H * D + FP32 * H) * G * P
    total += (BF16 * H * D + folded + FP32 * H) * B * T
    # SwiGLU keeps its (N, 2F) input alone (gpt.SwiGLU)
    return total + BF16 * 2 * F * N


def shared_saved(config, mb, ids_kept, layout_kept):
    """Bytes of a micro-batch's tensors kept once for all its layers: RoPE's rotations (fp32),
    SharedPrefix's gather indices (int64) and its additive mask (bf16, rows padded to 8 entries,
    made once: SharedPrefix.folded_mask); the token ids if the embeddings train (ids_kept); and
    with layout_kept (--activation-checkpointing keeps each layer's arguments, the layout among
    them) the layout's own masks and slots too."""
    B, G, P, T = mb.B, mb.G, mb.P, mb.T
    N = G * P + B * T
    g = config.num_attention_heads // config.num_key_value_heads
    indices = 8 * ((G * P + B * T) + (G * P + B * (P + T)) + N + (N if ids_kept else 0))
    rope = FP32 * config.head_dim * N
    mask = BF16 * B * g * T * (-(-(P + T) // 8) * 8)
    # SharedPrefix.sees (B, 1, T, P + T), prefix_real, own_real (bool), their slots (int64)
    layout = B * T * (P + T) + (1 + 8) * (G * P + B * T) if layout_kept else 0
    return indices + rope + mask + layout


def head_saved(config, c, mb, residual_bytes):
    """Bytes the loss's head keeps for the backward pass (fast_logprobs, SampledLogprobs): the final
    norm's, the hidden states of the M target tokens (in the residual's dtype), their targets
    (int64), log-sum-exp (fp32), and the masks that place them (bool)."""
    M, C = mb.B * mb.T, config.hidden_size
    N = mb.G * mb.P + mb.B * mb.T
    norm = norm_saved(C, c.norms_trained, residual_bytes) * N
    return norm + residual_bytes * C * M + (8 + FP32 + 1) * M + mb.B * (mb.P + mb.T)


def head_buffers(config, c, mb):
    """Bytes of SampledLogprobs' buffers, made in the forward pass and alive until the backward:
    the gradients of the hidden states (M, C) and of the head (V, C) if it trains, both fp32, the
    guessed loss gradient, and the (B, P + T) log-probs handed to the loss."""
    M, C, V = mb.B * mb.T, config.hidden_size, config.vocab_size
    return FP32 * (M * C + (V * C if c.head_trained else 0) + M + mb.B * (mb.P + mb.T))


def head_temporaries(config, mb, head_fp32, head_trained):
    """Bytes the head's forward pass holds for one chunk of its logits (bf16's chunk:
    fast/logprobs.head_chunk_rows): the fp32 buffer and the chunk's bf16 logits before they are
    copied in; a trained head's (V, C) bf16 share of its gradient before it is added in; and, when
    the head's weight is fp32 (full fine-tuning under autocast), its bf16 copy, made once a pass
    for the logits' and the gradients' matmuls (fast/logprobs.matmul_dtype); a bf16 head (a LoRA
    base, --fsdp's gathered weights) is used as it is."""
    V, C = config.vocab_size, config.hidden_size
    rows = min(max(1, LOW_PRECISION_CHUNKS * LOGITS_PER_CHUNK // V), mb.B * mb.T)
    product = BF16 * V * C if head_trained else 0
    return (FP32 + BF16) * rows * V + product + (BF16 * V * C if head_fp32 else 0)


def activations(config, c, mb, residual_bytes, checkpointing, lora_rank=0, lora_targets=""):
    """What a micro-batch keeps for its backward pass, bytes: every layer's saved tensors, or with
    --activation-checkpointing every layer's input alone (the residual stream, gpt.GPT's
    checkpoint) and one layer's saved tensors at a time as the backward pass recomputes it; plus
    what is kept once and the head's."""
    targets = lora_targets or "all-linear"
    L, N = config.num_hidden_layers, mb.G * mb.P + mb.B * mb.T
    layer = layer_saved(config, mb, residual_bytes, lora_rank, targets)
    if checkpointing:
        layers = L * residual_bytes * config.hidden_size * N + layer
    else:
        first = layer_saved(config, mb, residual_bytes, lora_rank, targets, c.embeddings_trained)
        layers = first + (L - 1) * layer
    shared = shared_saved(config, mb, c.embeddings_trained, checkpointing)
    return layers + shared + head_saved(config, c, mb, residual_bytes)


def engine_call(config, prompts, samples, prompt_tokens, new_tokens, residual_bytes):
    """(the call's peak, (prompts, samples), its parts) of one engine call: the larger of the
    prefill's moment (every prompt's keys kept, the rows' own part not made yet) and the last
    decode step's (every slot written)."""
    prompt_part, own_part = kv_cache(config, prompts, samples, prompt_tokens, new_tokens)
    parts = {
        "KV cache, prompt part": prompt_part,
        "KV cache, own part": own_part,
        "prefill's temporaries": prefill_temporaries(
            config, prompts, prompt_tokens, residual_bytes
        ),
        "decode step's temporaries": decode_temporaries(
            config, prompts, samples, prompt_tokens, new_tokens, config.vocab_size
        ),
    }
    prefill = prompt_part + parts["prefill's temporaries"]
    decode = prompt_part + own_part + parts["decode step's temporaries"]
    return max(prefill, decode), (prompts, samples), parts


def plan(config, cfg, world=1, prompt_tokens=256):
    """Bytes per rank of each part of a CUDA run of `config` (a GPTConfig) with chat_rl's flags
    `cfg` on `world` ranks, as a dict, and the peaks of its two phases (the module's docstring).
    prompt_tokens: the longest prompt of an engine call (a planning figure: GSM8K's chat prompts
    are about 100-200 tokens)."""
    lora_rank, fsdp = cfg.lora_rank, cfg.fsdp and not cfg.lora_rank
    c = counts(config, lora_rank, cfg.lora_targets)
    parts = state(c, fsdp, world, kl_reference=cfg.kl_beta > 0 and not lora_rank)
    # replicated: autocast's bf16 copy of the fp32 tensors a matmul reads; --fsdp computes with
    # the gathered bf16 weights and LoRA with its bf16 base: nothing of the frozen base to cast
    parts["autocast's bf16 copies"] = 0 if fsdp else BF16 * c.cast
    # --fsdp: the root (embeddings, final norm, head) gathered from its forward to its backward,
    # and two decoder layers at a time (the one computing, the next one prefetched), bf16; the
    # rollout gathers every unit (fsdp.gathered)
    parts["--fsdp gathered, training"] = BF16 * (c.root + 2 * c.layer) if fsdp else 0
    parts["--fsdp gathered, rollout"] = BF16 * c.total if fsdp else 0
    # the residual stream is the embeddings' dtype: fp32 beside fp32 weights under autocast, bf16
    # under --fsdp (gathered in bf16) and from LoRA's bf16 base (unless they train whole, fp32)
    residual = FP32 if c.embeddings_trained and not fsdp else BF16
    held = parts["weights"] + parts["AdamW moments"] + parts["--kl-beta reference"]
    # the engine calls: a step's rollout, the eval's samples and its greedy pass (one sample a
    # prompt: none shared), each over this rank's share of the problems; the largest is planned
    problems = math.ceil(cfg.examples_per_step / world)
    evals = math.ceil(cfg.eval_examples / world) if cfg.eval_every > 0 or cfg.eval_only else 0
    calls = [(problems, cfg.num_samples)] + [(evals, cfg.eval_samples), (evals, 1)] * bool(evals)
    calls = [(min(n, max(1, cfg.generate_batch_rows // s)), s) for n, s in calls]
    rollouts = [engine_call(config, *call, prompt_tokens, cfg.max_new_tokens, residual)
                for call in calls]  # fmt: skip
    peak, call, engine = max(rollouts)
    parts.update(engine)
    rollout = held + parts["autocast's bf16 copies"] + parts["--fsdp gathered, rollout"] + peak
    mb = micro_batch(cfg, prompt_tokens, problems * cfg.num_samples)
    for checkpointing in (False, True):
        name = "activations" + (", --activation-checkpointing" if checkpointing else "")
        parts[name] = activations(
            config, c, mb, residual, checkpointing, lora_rank, cfg.lora_targets
        )
    parts["loss head's buffers"] = head_buffers(config, c, mb)
    head_fp32 = not fsdp and c.head_trained
    parts["loss head's chunk"] = head_temporaries(config, mb, head_fp32, c.head_trained)
    training = held + parts["gradients"] + parts["autocast's bf16 copies"]
    training += parts["--fsdp gathered, training"] + parts["loss head's buffers"]
    training += parts["loss head's chunk"]
    peaks = {
        "rollout": rollout,
        "training": training + parts["activations"],
        "training, --activation-checkpointing": training
        + parts["activations, --activation-checkpointing"],
    }
    return SimpleNamespace(parts=parts, peaks=peaks, counts=c, micro_batch=mb, call=call)


def gb(size):
    """Bytes as GB (10^9 bytes), three figures: 122 GB, 7.9 GB, 0.001 GB."""
    return f"{size / GB:.3g} GB"


# ---- the check at start --------------------------------------------------------------------------
def device_memory(device):
    """A CUDA device's total memory in bytes; None elsewhere (a CPU run shares the machine's, and
    MPS the system's)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def check_state_fits(cfg, world, device, total=None):
    """Refuse, in one line, a run whose weights, gradients and AdamW state alone exceed the GPU's
    memory, before any weight moves to it, naming what would fit: --fsdp on enough GPUs, or
    LoRA. total: the GPU's bytes (None: device_memory(device); no check off CUDA). A config that
    cannot be read here passes: loading the model will say why it cannot."""
    total = device_memory(device) if total is None else total
    hf = hf_folder.read_config(cfg.model, fetch=True) if total else None
    if hf is None:
        return
    config = config_from_hf(hf)
    kl = cfg.kl_beta > 0 and not cfg.lora_rank
    c = counts(config, cfg.lora_rank, cfg.lora_targets)
    need = sum(state(c, cfg.fsdp, world, kl).values())
    if need <= total:
        return
    kind = f"LoRA rank {cfg.lora_rank}" if cfg.lora_rank else "full fine-tuning"
    said = (
        f"--model={cfg.model}: {kind} holds {gb(need)} a GPU of weights, gradients and AdamW "
        f"state alone, more than the GPU's {gb(total)}"
    )
    options = []
    if not cfg.lora_rank and not kl:  # LoRA and --kl-beta refuse --fsdp (flags.check_config)
        # the fewest GPUs whose planned peaks fit, not those the state's share alone fits; each a
        # count --examples-per-step divides (flags.check_config refuses others)
        for gpus in (n for n in (2, 4, 8, 16, 32, 64) if cfg.examples_per_step % n == 0):
            if fitting := fits(config, cfg, gpus, total, fsdp=True):
                options.append(f"--fsdp on {gpus} GPUs ({fitting})")
                break
    if not cfg.lora_rank and (fitting := fits(config, cfg, world, total, lora_rank=16)):
        options.append(f"--lora-rank=16 ({fitting})")
    fits_with = " or ".join(options) if options else "a GPU with more memory"
    raise ConfigError(
        f"{said}: it fits with {fits_with}, as planned with activations and the KV cache "
        f"(python -m scripts.plan_memory shows the parts)"
    )


# the share of a GPU's memory a suggested setting's planned peak may take: the plan leaves out the
# CUDA context, NCCL's and cuBLAS's buffers and the allocator's rounding (docs/benchmarks.md)
PLANNED_SHARE = 0.9


def fits(config, cfg, world, total, **flags):
    """What plan() says of cfg with flags changed on `world` ranks, if its peaks fit PLANNED_SHARE
    of `total` bytes: "a 61.2 GB peak", "... with --activation-checkpointing" where only that fits;
    else None."""
    peaks = plan(config, SimpleNamespace(**{**vars(cfg), **flags}), world).peaks
    for checkpointing in ("", ", --activation-checkpointing"):
        peak = max(peaks["rollout"], peaks["training" + checkpointing])
        if peak <= PLANNED_SHARE * total:
            return f"a {gb(peak)} peak" + (
                " with --activation-checkpointing" if checkpointing else ""
            )
    return None
