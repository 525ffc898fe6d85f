"""
The ranks of a run: process-group setup and the collectives the training loop uses (stop.py has
the stop every rank agrees on). With one process (no torchrun) every function here is a no-op or a
plain local computation, so chat_rl.py reads the same for 1 CPU and 64 GPUs.
"""

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

# How long a rank waits in a collective before the run fails. The longest wait is a checkpoint: the
# other ranks wait while rank 0 writes and syncs it to disk, 91 GB for the largest run docs/gpu.md
# names (7B under --fsdp: 30 GB of weights, 61 GB of AdamW moments), an hour at 26 MB/s; NCCL's
# default of 10 minutes would end that run at its first save. A rank that hangs for good is found as
# late.
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=1)


def setup_distributed(device_type, fsdp=False):
    """(rank, world_size, device). torchrun sets RANK; gloo on CPU, nccl on GPU. FSDP needs a
    process group even for one process: it gets a group of one."""
    if not device_type:
        device_type = (
            "cuda"
            if torch.cuda.is_available()
            else "mps"
            if torch.backends.mps.is_available()
            else "cpu"
        )
    rank, world, local_rank = (
        int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0))
    )
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device(device_type)
        # ranks sharing one CPU split its cores instead of fighting over them; OMP_NUM_THREADS wins
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(
                max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
            )
    if world > 1 and not dist.is_initialized():
        # torchrun --max-restarts keeps one key-value store across the restarts of a group, and
        # the old group's rank addresses are still in it: a restarted rank can read a dead peer's
        # address and fail ("connectFullMesh failed ... Connection refused";
        # scripts/repro_gloo_restart.py shows it) or wait on it. Each restart therefore gets keys
        # of its own.
        store, rank, world = next(dist.rendezvous("env://"))
        store = dist.PrefixStore(f"chat_rl/restart_{restart_count()}", store)
        init_process_group(device, store, rank, world)
    elif fsdp and not dist.is_initialized():
        init_process_group(device, dist.HashStore(), 0, 1)
    return rank, world, device


def init_process_group(device, store, rank, world):
    """nccl on CUDA, bound to this rank's GPU (device_id: NCCL connects at once, and a barrier knows
    its GPU instead of guessing it from the rank), gloo elsewhere; collectives wait up to
    COLLECTIVE_TIMEOUT."""
    cuda = device.type == "cuda"
    dist.init_process_group(
        backend="nccl" if cuda else "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
        device_id=device if cuda else None,
    )


def compute_dtype(device, choice=None):
    """What the matmuls run in on `device`, as a torch dtype: --dtype resolved ("fp32" | "bf16",
    dtype_choice), or None for the hardware's default, bf16 on CUDA and fp32 elsewhere. bf16 means
    autocast over fp32 weights (AdamW's master copy); --fsdp gathers them in bf16 and LoRA's frozen
    base is bf16. The tests ask for bf16 on the CPU, which has bf16 autocast and FSDP over gloo, to
    run CUDA's configuration where CI runs."""
    if choice is None:
        choice = "bf16" if torch.device(device).type == "cuda" else "fp32"
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[choice]


def dtype_choice(device, choice="auto", config=None):
    """--dtype resolved: ("fp32" or "bf16", why, for the start line). auto: bf16 on CUDA, and on a
    CPU with bf16 units if the model's matmuls are large enough to gain (config: its GPTConfig);
    fp32 elsewhere."""
    device = torch.device(device)
    if choice != "auto":
        return choice, "as given"
    if device.type == "cuda":
        return "bf16", "auto: CUDA"
    if device.type != "cpu":
        return "fp32", f"auto: {device.type}"
    if not cpu_bf16_units():
        return "fp32", "auto: this CPU has no bf16 units"
    if config is not None and not bf16_pays(config):
        return "fp32", "auto: the model's matmuls are too small for bf16 to pay"
    return "bf16", "auto: this CPU has bf16 units"


def cpu_bf16_units():
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX tiles): without them torch
    emulates bf16 matmuls in fp32, slower than fp32 itself."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


# a decoder-layer matmul of fewer weights gains nothing from bf16 on a CPU: it is too short to
# outweigh the casts around it (docs/benchmarks.md: the demo's 0.8M-parameter model)
BF16_MIN_WEIGHT = 2**18


def bf16_pays(config):
    """Whether a model of this GPTConfig has a decoder-layer matmul (its fused gate/up or q/k/v
    weight) of at least BF16_MIN_WEIGHT entries: the head aside, since a tiny model with a large
    vocabulary still computes little per token."""
    c = config
    rows = max(
        2 * c.intermediate_size, (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    )
    return rows * c.hidden_size >= BF16_MIN_WEIGHT


def restart_count():
    """How many times torchrun (--max-restarts) has restarted this group; 0 for a first start."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def all_reduce_sum(tensor):
    """Sum a tensor over ranks, in place (and return it)."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def is_sharded(model):
    """Whether the model is sharded over the ranks with FSDP (--fsdp; see fsdp.py)."""
    return isinstance(model, FSDPModule)


# Gradients are summed in buckets of about this many bytes: one collective a bucket instead of one a
# parameter (a Qwen2.5-0.5B has 290, each a launch and a round trip on NCCL), for one bucket's copy
# in memory. 25 MB is DDP's default bucket.
GRAD_BUCKET_BYTES = 25 * 2**20


def sync_gradients(model, bucket_bytes=GRAD_BUCKET_BYTES):
    """Sum gradients over ranks (the loss is already divided by the step's global normaliser, so a
    sum is the gradient of the whole step). A rank that kept no rows has no .grad: it sends zeros.
    A sharded model has nothing to do here: FSDP reduce-scattered the sums in the backward pass.
    Without buckets it is: for each trained p, dist.all_reduce(p.grad); a bucket sums the same
    numbers, each element with its own peers only."""
    if not dist.is_initialized() or is_sharded(model):
        return
    grads = []
    for p in model.parameters():
        if not p.requires_grad:  # frozen (a LoRA run's base): no gradient to sum
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    for bucket in buckets(grads, bucket_bytes):
        if len(bucket) == 1:  # a tensor as large as a bucket is summed where it is
            dist.all_reduce(bucket[0], op=dist.ReduceOp.SUM)
            continue
        flat = torch.cat([g.flatten() for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for g, summed in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(summed.view_as(g))


def buckets(tensors, max_bytes):
    """tensors, in order, as lists of one dtype and device of at most max_bytes together (a larger
    tensor alone): the same lists on every rank, which hold the same parameters."""
    out, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        same_kind = out and (out[-1][-1].dtype, out[-1][-1].device) == (t.dtype, t.device)
        if not same_kind or size + nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out
