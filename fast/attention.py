"""
The attention kernel every pass of the model calls (policy/gpt.py's training and prefill passes,
fast/shared_prefix.py's loss pass): torch's scaled_dot_product_attention, in the dtype that is fast
where it runs.
"""

import torch
import torch.nn.functional as F

# bf16 attention on a CPU runs in fp32 (tests/test_cuda_precision.py turns this off to run CUDA's
# bf16 kernels' configuration on the CPU)
FP32_ON_CPU = True


def kernel_dtype(device, dtype):
    """The dtype attention() runs its kernel in for inputs of dtype on device: fp32 for bf16 on a
    CPU, where torch's bf16 attention kernel runs its backward pass 4x slower than its fp32 one
    (docs/benchmarks.md) and the engine's decode passes score in fp32 too (fast/kv_cache.py); on
    CUDA the bf16 kernels are the fast ones."""
    if FP32_ON_CPU and torch.device(device).type == "cpu" and dtype == torch.bfloat16:
        return torch.float32
    return dtype


def attention(q, k, v, attn_mask=None, **kwargs):
    """F.scaled_dot_product_attention in kernel_dtype (autocast off), the output in q's dtype. A
    float mask should come in that dtype already (a cast here would be one per layer)."""
    dtype = kernel_dtype(q.device, q.dtype)
    if dtype == q.dtype:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kwargs)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(dtype)
    with torch.autocast(q.device.type, enabled=False):
        y = F.scaled_dot_product_attention(
            q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=attn_mask, **kwargs
        )
    return y.to(q.dtype)
