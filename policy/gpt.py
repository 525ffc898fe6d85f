"""
The policy: one decoder-only Transformer for the Llama / Qwen2 / Qwen3 family.

    token ids -> embed_tokens -> N x [RMSNorm -> attention (GQA, RoPE) -> + ->
                                     RMSNorm -> SwiGLU MLP -> +] -> RMSNorm -> lm_head -> logits

The three families differ only in switches of GPTConfig:
    Llama / SmolLM : no qkv bias, no q/k norm, tied or untied head, rope_theta
    Qwen2 / Qwen2.5: qkv bias (attention_bias=True)
    Qwen3          : q/k RMSNorm per head (qk_norm=True), explicit head_dim
Parameter names follow the Hugging Face checkpoints (model.layers.0.self_attn.o_proj.weight, ...),
except that the Linears reading the same input are one matmul: q/k/v are self_attn.qkv_proj,
gate/up mlp.gate_up_proj, their weights stacked by rows. hf_layout says where each checkpoint
tensor sits, so the files map one-to-one onto the model, in and out: GPT.from_pretrained reads a
hub id or a Hugging Face folder, save_pretrained writes one that transformers and vLLM load as it
is, the same tensor names and values as unfused Linears would write (the folder format itself,
config.json and the weight files, is hf_folder.py).
Tiny configs of the same class are the offline demo's policy.
"""

import math
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from fast.attention import attention
from fast.logprobs import token_nll
from policy.hf_folder import (
    config_fields,
    read_json,
    read_weights,
    resolve_folder,
    write_config,
    write_weights,
)


@dataclass
class GPTConfig:
    vocab_size: int = 264
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads (Qwen3 sets it explicitly)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Llama-3.1 style {"rope_type": "llama3", ...}; None = plain RoPE
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head's q and k before RoPE
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        assert self.num_attention_heads % self.num_key_value_heads == 0, (
            "GQA needs heads % kv_heads == 0"
        )

    def to_dict(self):
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # one call with the weight: one kernel on CUDA
        if x.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)
        # normalize in fp32 (as the reference implementations do), scale in the input dtype
        return self.weight * F.rms_norm(x.float(), (x.size(-1),), eps=self.eps).to(x.dtype)


def rope_inv_freq(config):
    """Inverse frequencies of RoPE, (head_dim/2,), with Llama-3.1 frequency scaling if asked."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = config.rope_scaling
    if scaling is None or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: none, 'llama3')")
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen) - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(is_mid, blended, scaled).float()


def apply_rope(x, rope):
    """
    x (B, H, T, D), rope (B or 1, 1, T, D/2, 2): cos and sin of each pair's angle (GPT.rope)
    -> x rotated, in fp32. The checkpoints' "rotate half" layout pairs x_i with x_{i + D/2}: each
    pair is one complex number, turned by one complex multiplication. The pairs come out side by
    side (x_0, x_{D/2}, x_1, x_{D/2+1}, ...): q and k alike, so every q . k, all that attention
    reads of them, is the same.
    """
    half = x.size(-1) // 2
    # inductor has no complex kernels; it fuses the same rotation in real arithmetic
    if torch.compiler.is_compiling():
        x = x.float()
        x1, x2, cos, sin = x[..., :half], x[..., half:], rope[..., 0], rope[..., 1]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    # each pair side by side as one complex number: one copy, which (unlike torch.complex) keeps
    # nothing for backward
    pairs = (
        x.unflatten(-1, (2, half))
        .transpose(-1, -2)
        .float()
        .clone(memory_format=torch.contiguous_format)
    )
    rotated = torch.view_as_complex(pairs) * torch.view_as_complex(rope)
    return torch.view_as_real(rotated).flatten(-2)


class Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        # q, k and v of all heads from one matmul, in this row order (hf_layout splits them back)
        self.qkv_proj = nn.Linear(
            config.hidden_size,
            (self.n_head + 2 * self.n_kv_head) * self.head_dim,
            bias=config.attention_bias,
        )
        self.qkv_proj.parts = {
            "q_proj": self.n_head * self.head_dim,
            "k_proj": self.n_kv_head * self.head_dim,
            "v_proj": self.n_kv_head * self.head_dim,
        }
        self.o_proj = nn.Linear(self.n_head * self.head_dim, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, rope, attn_mask, layout):
        """x (B, T, C) -> (B, T, C); layout: None for plain causal attention, else
        GPT.hidden_states' protocol."""
        B, T, _ = x.shape
        H = self.n_head
        qkv = self.qkv_proj(x).view(B, T, H + 2 * self.n_kv_head, self.head_dim)
        # split, not sliced: the backward pass of two slices fills two zero tensors the size of qkv;
        # a split's joins the pieces' gradients once
        qk, v = qkv.split([H + self.n_kv_head, self.n_kv_head], dim=2)
        v = v.transpose(1, 2)  # (B, Hkv, T, D)
        # the heads of q and k normalized in one call, each scaled by its own norm's weight
        if hasattr(self, "q_norm"):
            weight = torch.cat(
                (self.q_norm.weight.expand(H, -1), self.k_norm.weight.expand(self.n_kv_head, -1))
            )
            qk = weight * F.rms_norm(qk.float(), (self.head_dim,), eps=self.q_norm.eps).to(qk.dtype)
        # one RoPE for the heads of q and k together, in fp32; under autocast q and k go back to v's
        # dtype, so the KV cache holds bf16 keys instead of fp32 ones
        qk = apply_rope(qk.transpose(1, 2), rope).to(v.dtype)
        q, k = qk.split([H, self.n_kv_head], dim=1)  # (B, H, T, D), (B, Hkv, T, D)
        if layout is None:
            # whole sequences from position 0: plain causal; GQA = each group of query heads shares
            # a k/v head. k and v are views into the fused projections: saved as they are for the
            # backward pass, they would keep the whole q/k and q/k/v outputs alive; their own
            # copies are a fraction of that
            y = attention(
                q,
                k.contiguous(),
                v.contiguous(),
                is_causal=True,
                enable_gqa=self.n_kv_head != self.n_head,
            )
        elif attn_mask is None:
            # the layout knows where the keys are (a decode pass, SharedPrefix): it attends
            y = layout.attend(self.layer_idx, q, k, v)
        else:
            # the sampler's prefill: its keys and values kept by the cache, a boolean padding mask
            # (B, 1, T, T)
            k, v = layout.update(self.layer_idx, k, v)  # (B, Hkv, T, D)
            # Fold each group's query heads into the time axis, (B, H, T, D) -> (B, Hkv, g*T, D):
            # every SDPA kernel, the masked memory-efficient one included, then runs GQA without
            # copying k and v g times.
            g = self.n_head // self.n_kv_head
            q = q.reshape(B, self.n_kv_head, g * T, self.head_dim)
            # row j*T + t is query t of head j
            mask = attn_mask.repeat(1, 1, g, 1) if g > 1 else attn_mask
            # reshape, not view: CUDA's memory-efficient kernel (the one that takes a mask) returns
            # a transposed layout
            y = attention(q, k, v, attn_mask=mask)
            y = y.reshape(B, self.n_head, T, self.head_dim)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class SwiGLU(torch.autograd.Function):
    """
    silu(gate) * up of the fused (..., 2 * I) gate/up output, keeping that output alone for the
    backward pass. Autograd's silu(gate) * up would keep silu(gate) as well, intermediate_size more
    values a token a layer (a sixth of a Qwen2.5-0.5B layer's activations), and join the two halves'
    gradients with one more copy; here the backward pass recomputes silu(gate) and writes each
    half's gradient into its place in one (..., 2 * I) tensor.
    """

    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        grad_gate_up = torch.empty_like(gate_up)
        grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)
        torch.mul(F.silu(gate), grad, out=grad_up)
        # d silu(g) / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g))), times grad * up: torch's own
        # kernel for it
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_gate_up


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        # gate and up from one matmul (hf_layout splits them back)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.gate_up_proj.parts = {
            "gate_proj": config.intermediate_size,
            "up_proj": config.intermediate_size,
        }
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(SwiGLU.apply(self.gate_up_proj(x)))


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, attn_mask, layout):
        x = x + self.self_attn(self.input_layernorm(x), rope, attn_mask, layout)
        return x + self.mlp(self.post_attention_layernorm(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=nn.Embedding(config.vocab_size, config.hidden_size),
                layers=nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers)),
                norm=RMSNorm(config.hidden_size, config.rms_norm_eps),
            )
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        # activation checkpointing (--activation-checkpointing): see hidden_states
        self.checkpoint_layers = False

    def init_rope(self, device):
        """RoPE's inverse frequencies, the one buffer: no checkpoint holds it, so a model built on
        the meta device (from_pretrained; under --fsdp every rank but the first) computes it."""
        self.inv_freq = rope_inv_freq(self.config).to(device)

    def init_weights(self, seed=0):
        """Random init for models trained from scratch (the demo); real checkpoints overwrite it."""
        gen = torch.Generator().manual_seed(seed)
        # tensor by tensor in the checkpoints' layout and order: the same weights as unfused Linears
        # would get
        with torch.no_grad():
            for name, p in self.hf_state_dict(keep_vars=True).items():
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    # residual-branch outputs get the GPT-2 1/sqrt(2 * n_layer) shrink
                    std = (
                        0.02 / math.sqrt(2 * self.config.num_hidden_layers)
                        if name.endswith(("o_proj.weight", "down_proj.weight"))
                        else 0.02
                    )
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        return self

    def hf_layout(self):
        """
        Where each tensor of a Hugging Face checkpoint sits in this model: [(checkpoint name, own
        parameter name, rows)] in the order the checkpoints list them, rows = the slice of a fused
        Linear's rows (qkv_proj, gate_up_proj) that holds the tensor, None for a whole parameter.
        The tied lm_head is left out (it is embed_tokens.weight). Names only: it holds for a model
        on the meta device or sharded by FSDP as well.
        """
        layout = []
        for module_name, module in self.named_modules():
            # LoRA's adapters (policy/lora.py): no checkpoint tensor
            if module_name.endswith((".lora_A", ".lora_B")):
                continue
            own = [name for name, _ in module.named_parameters(prefix=module_name, recurse=False)]
            if not hasattr(module, "parts"):
                layout += [
                    (name, name, None)
                    for name in own
                    if not (name == "lm_head.weight" and self.config.tie_word_embeddings)
                ]
                continue
            start, parent = 0, module_name.rpartition(".")[0]
            # each part's weight, then its bias, as unfused Linears list them
            for part, width in module.parts.items():
                layout += [
                    (
                        f"{parent}.{part}.{name.rpartition('.')[2]}",
                        name,
                        slice(start, start + width),
                    )
                    for name in own
                ]
                start += width
        return layout

    def hf_state_dict(self, keep_vars=False):
        """The weights under the checkpoints' names and shapes (hf_layout): views of the model's
        tensors, no copies."""
        state = self.state_dict(keep_vars=keep_vars)
        return {
            name: state[own] if rows is None else state[own][rows]
            for name, own, rows in self.hf_layout()
        }

    def rope(self, positions):
        """RoPE's rotation of each pair (apply_rope) for integer positions (B, T): cos and sin of
        position * inv_freq, (B, 1, T, head_dim/2, 2) in fp32."""
        angles = positions.float()[:, None, :, None] * self.inv_freq.float()
        return torch.stack((angles.cos(), angles.sin()), dim=-1)

    def forward(
        self,
        idx,
        targets=None,
        kv_cache=None,
        loss_reduction="mean",
        logits_per_chunk=2**24,
        temperature=1.0,
    ):
        """
        idx: (B, T) token ids. Without a cache, row b's tokens sit at positions 0..T-1, and the
        logits of every position come back (B, T, V). With a cache (fast/kv_cache.KVCache, the
        sampler's), rows may be left-padded and only the last position's logits (B, 1, V) come
        back, all the sampler needs.
        targets: (B, T) next-token ids, -1 = ignore. Returns per-token NLL (B, T) with
        loss_reduction='none' (0 where ignored) or the mean over valid tokens with 'mean', of
        softmax(logits / temperature); the logits are projected at most logits_per_chunk at a time
        (fast/logprobs.token_nll).
        """
        x = self._hidden_states(idx, kv_cache)
        if targets is None:
            # the sampler reads only the last position: a (B, T, 152k) prefill logit tensor would be
            # gigabytes
            return self.lm_head(x[:, -1:] if kv_cache is not None else x)
        # project only the positions that have a target: prompt and padding positions would cost
        # logits for nothing
        valid = targets >= 0
        chunk = max(1, logits_per_chunk // self.lm_head.weight.size(0))
        nll = torch.zeros(targets.shape, device=x.device)
        nll[valid] = token_nll(x[valid], self.lm_head.weight, targets[valid], chunk, temperature)
        if loss_reduction == "none":
            return nll
        assert loss_reduction == "mean", f"unknown loss_reduction {loss_reduction!r}"
        return nll.sum() / valid.sum().clamp(min=1)

    def hidden_states(self, idx, layout=None):
        """The final-norm hidden states, for a caller that applies the head itself
        (fast/logprobs.fast_logprobs); under FSDP a forward method of its own (fsdp.prepare).
        forward calls _hidden_states instead: one FSDP forward method inside another would reshard
        the root's weights as the inner one ends."""
        return self._hidden_states(idx, layout)

    def _hidden_states(self, idx, layout=None):
        """
        (B, T) token ids -> final-norm hidden states (B, T, C). Without a layout, row b's tokens sit
        at positions 0..T-1 and attend causally. A layout says otherwise: where each token sits and
        what its attention sees. Two kinds speak its four methods: fast/kv_cache.KVCache (the
        sampler's: left-padded prompts, then one token a row per pass) and
        fast/shared_prefix.SharedPrefix (the loss's: each prompt once for all its samples; it caches
        nothing):
          rope_and_mask(T) -> (RoPE rotations of the pass's tokens, a mask or None), once a pass;
          update(layer, k, v) -> the keys and values to attend to, under that mask, here: a pass
              with a mask (the sampler's prefill) hands its keys and values over to be kept, and
              attends to what comes back;
          attend(layer, q, k, v) -> the attention output: a pass without a mask leaves attention to
              the layout, which knows where the keys are (a decode pass's are in the cache;
              SharedPrefix's are in the pass);
          advance(T): the pass is over; the next one's tokens come T positions later.
        """
        T = idx.size(1)
        x = self.model.embed_tokens(idx)
        if layout is None:
            # (1, 1, T, D/2, 2): the same for every row
            rope = self.rope(torch.arange(T, device=idx.device)[None])
            attn_mask = None  # plain causal; right padding never leaks into earlier tokens
        else:
            rope, attn_mask = layout.rope_and_mask(T)
        for block in self.model.layers:
            if self.checkpoint_layers and torch.is_grad_enabled():
                # keep only this layer's input (B, T, C) for the backward pass and recompute the
                # rest there: one layer's activations alive at a time instead of all of them, for a
                # second forward's cost
                x = torch.utils.checkpoint.checkpoint(
                    block, x, rope, attn_mask, layout, use_reentrant=False
                )
            else:
                x = block(x, rope, attn_mask, layout)
        if layout is not None:
            layout.advance(T)
        return self.model.norm(x)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    @classmethod
    def from_pretrained(cls, name_or_dir, device="cpu", dtype=torch.float32, keep_fp32=()):
        """
        A Hugging Face checkpoint of the Llama / Qwen2 / Qwen3 family: a hub id
        ("Qwen/Qwen2.5-0.5B-Instruct") or a local folder with config.json + safetensors (one file,
        or shards listed in model.safetensors.index.json). dtype=None keeps the stored dtype;
        keep_fp32 names tensors read in fp32 whatever dtype says (a LoRA run's modules trained
        whole; a tied head is its embeddings). The model is built on the meta device (no random
        init, no memory) and each tensor is read from the file on its own, converted, and put in
        place: the peak is the model plus one tensor.
        """
        path = resolve_folder(name_or_dir)
        config = config_from_hf(read_json(os.path.join(path, "config.json")))
        with torch.device("meta"):
            model = cls(config)
        if config.tie_word_embeddings and "lm_head.weight" in keep_fp32:
            keep_fp32 = {*keep_fp32, "model.embed_tokens.weight"}
        read_weights(model, path, device, dtype, keep_fp32)
        if config.tie_word_embeddings:
            # the tie broke when embed_tokens was replaced
            model.lm_head.weight = model.model.embed_tokens.weight
        model.init_rope(device)
        return model

    def save_pretrained(self, path):
        """
        Write a folder transformers (and vLLM) load as it is: config.json + model.safetensors in the
        dtype the model holds. The tokenizer's save_pretrained adds its files and
        generation_config.json.
        """
        # the checkpoints' names and shapes, the fused Linears split into their parts; the tied head
        # is left out (safetensors refuses one tensor under two names; the config says "tied")
        state = {k: v.detach().contiguous().cpu() for k, v in self.hf_state_dict().items()}
        write_weights(path, state)
        write_config(path, self.config, self.model.embed_tokens.weight.dtype)


def config_from_hf(hf):
    """GPTConfig from a Hugging Face config.json dict (hf_folder.config_fields says what maps to
    what)."""
    return GPTConfig(**config_fields(hf))
