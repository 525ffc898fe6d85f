"""
The engine's large matmuls on the CPU, with their weights packed once per generate call.

A decode pass multiplies a few hundred rows at most by each weight: x (rows, in) @ W.T. torch's
fp32 Linear calls MKL's GEMM, which copies W into its kernel's layout at every call (SmolLM2-135M's
49k x 576 head: 113 MB read and written again at every position) and, on AMD processors, runs
without AVX-512. oneDNN (the library behind torch.compile's CPU matmuls) takes the weight packed
ahead, once, and uses the CPU's widest vectors. The sums come out in another order, so the logits
move in their last bits, as they do with the batch's size; the tests hold the packed engine to the
reference sampler (tests/test_packed_linear.py). docs/benchmarks.md has what it gains.

packed_linears(model) changes nothing else about an nn.Linear, and only where it pays: on an x86
CPU, in fp32 (or in bf16 under --dtype=bf16's autocast: packed in bf16, the weight is cast once a
call rather than at every position), for weights of at least MIN_WEIGHT entries. Below that (the
demo's 128-wide model) MKL is as fast, and small models keep their exact numbers. The packed
copies live for one generate call, one more copy of those weights in memory while the engine
samples, packed again at every call since training changes the weights between calls.

DecodeThreads (a context manager; rows(n) before each decode pass) sets the threads a call samples
on. Under bf16 a decode pass on a CPU is a few dozen element-wise operations a layer between matmuls
that bf16 made 3x shorter, and with torch's threads waiting passively (OMP_WAIT_POLICY=PASSIVE,
chat_rl's default) each operation split over threads pays to wake them, more than the split saves at
a few rows: on one thread the engine sampled SmolLM2-135M's 64 rows 1.5x faster than on two on a
2-core Intel Xeon (1.1-1.7x on an AMD EPYC), while at 256 rows one thread was as fast on the Intel
and 0.76x on the AMD (docs/benchmarks.md). So under bf16 a decode pass of at most
BF16_ONE_THREAD_ROWS running rows runs on one thread (a call's rows shrink as they finish); the
prefill, and fp32 (so its numbers), keep their threads.
"""

import platform
from contextlib import contextmanager

import torch
from torch import nn

MIN_WEIGHT = 2**18  # entries of a weight worth packing: 1 MiB in fp32
BF16_ONE_THREAD_ROWS = 128  # a bf16 decode pass of at most this many rows: one thread on a CPU
X86 = platform.machine().lower() in ("x86_64", "amd64")


def pack_dtype(weight):
    """The dtype oneDNN's packed matmul serves weight in, or None where it does not: on an x86 CPU
    (on ARM torch's own matmuls use other libraries), a plain tensor (not FSDP's sharded one),
    oneDNN built into torch; fp32 outside autocast, bf16 under CPU autocast to bf16 (--dtype=bf16),
    which then casts the weight once per call instead of once per token."""
    if not (
        weight.device.type == "cpu"
        and type(weight.data) is torch.Tensor
        and X86
        and torch.backends.mkldnn.is_available()
    ):
        return None
    if not torch.is_autocast_enabled("cpu"):
        return torch.float32 if weight.dtype == torch.float32 else None
    dtype = torch.get_autocast_dtype("cpu")
    ok = dtype == torch.bfloat16 and weight.dtype in (torch.float32, torch.bfloat16)
    return dtype if ok else None


def can_pack(weight):
    """Whether oneDNN's packed matmul serves weight (pack_dtype)."""
    return pack_dtype(weight) is not None


def packable(linear):
    """Whether packed_linears packs linear: can_pack, MIN_WEIGHT entries or more, unpatched."""
    w = linear.weight
    return can_pack(w) and w.numel() >= MIN_WEIGHT and "forward" not in vars(linear)


def pack(weight, rows, dtype=torch.float32):
    """weight (out, in) -> its packed copy in dtype for packed_forward; rows: x's rows, a layout
    hint."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), rows)


def packed_forward(packed, bias, dtype=torch.float32):
    """x (..., in) -> x @ W.T + bias in dtype, the matmul oneDNN's, on W packed by pack(): x cast
    to dtype first, as autocast casts a Linear's input."""

    def forward(x):
        return torch.ops.mkldnn._linear_pointwise(x.to(dtype), packed, bias, "none", [], "")

    return forward


@contextmanager
def packed_linears(model, rows=128):
    """
    Within the block, each packable Linear of model multiplies by its weight packed once on entry
    (rows: the batch's rows, a hint for the layout; any count of rows works). Forward hooks (LoRA's
    adapters) still run on its output. On exit every Linear is as it was, the packed copies freed.
    """
    patched = []
    try:
        with torch.no_grad():
            for linear in model.modules():
                if isinstance(linear, nn.Linear) and packable(linear):
                    dtype = pack_dtype(linear.weight)
                    bias = None if linear.bias is None else linear.bias.detach().to(dtype)
                    # an instance attribute shadows nn.Linear.forward; the module's hooks still run
                    packed = pack(linear.weight, rows, dtype)
                    linear.forward = packed_forward(packed, bias, dtype)
                    patched.append(linear)
        yield
    finally:
        for linear in patched:
            del linear.forward


class DecodeThreads:
    """`with DecodeThreads(device) as threads:` around a generate call, threads.rows(n) before each
    decode pass of n running rows: one thread for at most BF16_ONE_THREAD_ROWS rows in bf16
    autocast on a CPU (the module's docstring says why), the count the block began with otherwise
    and after it; off a CPU and in fp32, nothing changes."""

    def __init__(self, device):
        bf16 = (
            torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        )
        self.on, self.before = device.type == "cpu" and bf16, torch.get_num_threads()

    def rows(self, n):
        if self.on:
            self._set(1 if n <= BF16_ONE_THREAD_ROWS else self.before)

    def _set(self, threads):
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.on:
            self._set(self.before)
