"""
--fsdp: the policy sharded across ranks with FSDP2 (torch.distributed.fsdp.fully_shard), and what
the rest of chat_rl needs from a sharded model.

Without it every rank holds the whole model: fp32 weights, gradients and both AdamW moments, 16
bytes a parameter. fully_shard cuts each of those tensors along dim 0 into one piece per rank, 16/N
bytes a parameter on each of N ranks. A decoder layer's full weights exist only while it
computes: each layer is its own unit, all-gathered before its forward (and again before its
backward) and freed after; the root unit (embeddings, final norm, head) stays gathered from its
forward to its backward. Gradients are reduce-scattered as they are made, so each rank keeps only
its shard of them, and AdamW, stepping on sharded parameters, keeps only its shard of the
moments. On CUDA the weights are all-gathered in bf16 and the layers compute in bf16
(MixedPrecisionPolicy); the shards, the gradient sums and AdamW stay fp32.

What stays as it is: the loss, its step-level normaliser, the skipped groups, the collectives of
chat_rl.py, and the checkpoint folder (a Hugging Face folder of full fp32 weights). What this file
adds for a sharded model:
  - gathered(): full weights for the whole rollout phase, so the engine's many small forwards (one
    per sampled token) do not all-gather every layer each time;
  - match_passes(): as many loss passes on every rank, since each is collective, whatever each kept;
  - save_weights(): the Hugging Face weights file written by rank 0 from the shards, one tensor
    gathered at a time, never a second whole model;
  - save_optimizer() / restore_optimizer(): each rank's shard of the AdamW state in its own file
    (torch.distributed.checkpoint), and a replicated run's state loaded into shards (and back);
  - state_bytes(): what a rank holds of weights, gradients and optimizer state.
"""

import json
import math
import os
import struct
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

from plumbing.distributed import compute_dtype, is_sharded
from policy.hf_folder import write_config


def prepare(model, device, fsdp, activation_checkpointing, dtype=None):
    """The policy as the run trains it: whole on `device`, or sharded over the ranks (fsdp=True;
    the model comes in on the CPU on rank 0, on the CPU or the meta device on the others, and each
    unit moves to `device` as it is sharded, its values rank 0's).
    activation_checkpointing: recompute each decoder layer in the backward pass
    (gpt.GPT.forward). dtype: what a sharded model gathers its weights in and computes in (None:
    distributed.compute_dtype, bf16 on CUDA)."""
    model.checkpoint_layers = activation_checkpointing
    if not fsdp:
        return model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # fp32 shards (AdamW's master copy); on CUDA bf16 all-gathers and compute, fp32 gradient sums. A
    # layer's inputs are not cast to bf16 (cast_forward_inputs): RoPE's rotations must stay fp32
    # (CUDA's view_as_complex refuses bf16, and bf16 cos/sin would blur positions); the weights are
    # bf16 and autocast casts the rest
    dtype = dtype or compute_dtype(device)
    # the weights every rank starts from are rank 0's: its whole model's tensors, kept here before
    # sharding frees them, are sent to every rank's shards below (start.py builds the others' on
    # the meta device)
    whole = model.state_dict() if dist.get_rank() == 0 else {}
    policy = MixedPrecisionPolicy()
    if dtype != torch.float32:
        policy = MixedPrecisionPolicy(
            param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    # the root holds what is left (embeddings, final norm, head: the tied head shares
    # embed_tokens' shard); it is needed again first thing in the backward pass, so it is not
    # freed after the forward
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    # fast_logprobs calls hidden_states, not forward: FSDP gathers the root's weights (and
    # sets itself up) for it too
    register_fsdp_forward_method(model, "hidden_states")
    for unit in units(model):
        # chat_rl's loss is already divided by the step's global normaliser, so the step's gradient
        # is the SUM of the ranks' gradients (sync_gradients without FSDP), not FSDP's default mean
        # over ranks; a plain SUM collective (gloo has no pre-multiplied sum), then a division by
        # 1.0, which is exact
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model.to_empty(device=device)  # room for the shards, filled from rank 0 next
        model.init_rope(device)
    # one tensor at a time: rank 0 broadcasts it whole, each rank keeps its own shard of it
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, whole, options=options)
    return model


def units(model):
    """The FSDP units of a sharded model: the root, then one per decoder layer."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered(model):
    """Full weights on every rank for the whole block (a rollout, an eval), gathered once on entry
    and freed on exit. Inside, forwards all-gather nothing, so ranks may run different numbers of
    them (their rows stop at different tokens). A no-op for a model that is not sharded."""
    if not is_sharded(model):
        yield
        return
    model.set_reshard_after_forward(False)  # every unit, the layers too: keep what was gathered
    for unit in units(model):
        unit.unshard()
    try:
        yield
    finally:
        for unit in units(model):
            unit.reshard()
            # as prepare() set them
            unit.set_reshard_after_forward(unit is not model, recurse=False)


def match_passes(model, passes, logprobs, device):
    """Under FSDP every forward/backward pass is collective (each layer's weights all-gathered, its
    gradients reduce-scattered), so every rank must run as many as the busiest one. Called on every
    rank before its `passes` (the count is one all-reduce, which must not meet another rank's
    pass): the passes this rank has fewer run here, through the same `logprobs` as its real ones
    (the same collectives in the same order) over one token that is no target, which adds exactly 0
    to every gradient. Nothing to do without FSDP."""
    if not is_sharded(model):
        return
    most = torch.tensor(passes, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    inputs, targets = (
        torch.zeros(1, 1, dtype=torch.long, device=device),
        torch.full((1, 1), -1, device=device),
    )
    for _ in range(int(most) - passes):
        logprobs(
            model, inputs, targets, 1.0, loss_grad=torch.zeros(1, 1, device=device)
        ).sum().backward()


def state_bytes(model, optimizer):
    """Bytes this rank holds of weights, gradients and optimizer state: its local shards
    under FSDP."""
    tensors = [
        *model.parameters(),
        *(p.grad for p in model.parameters() if p.grad is not None),
        *(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
    ]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


# ---- checkpoints of a sharded model -------------------------------------------------------------
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def save_weights(model, path, rank):
    """model.safetensors + config.json in `path`, as gpt.GPT.save_pretrained writes them, from a
    sharded model. Every rank calls this: each parameter is all-gathered on its own (a fused
    Linear's once for its parts), written by rank 0 and freed, so no rank ever holds a second whole
    model. The file is the safetensors layout written by hand: 8 bytes of header length, a JSON
    header (name -> dtype, shape, byte range), then the tensors' bytes in that order."""
    state = model.state_dict()  # the model's names (fully_shard keeps them) -> DTensor shards
    # the checkpoint's tensors, in its order: fused Linears split into their parts
    layout = model.hf_layout()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, own, rows in layout:
        t = state[own]
        shape = list(t.shape) if rows is None else [rows.stop - rows.start, *t.shape[1:]]
        size = math.prod(shape) * t.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # the tensors start 8-byte aligned, as safetensors writes them
    last_use = {own: i for i, (_, own, _) in enumerate(layout)}
    f = open(os.path.join(path, "model.safetensors"), "wb") if rank == 0 else None
    try:
        if f:
            f.write(struct.pack("<Q", len(head)) + head)
        # the gathered parameters whose parts are not all written yet: one module's at most
        full = {}
        for i, (name, own, rows) in enumerate(layout):
            if own not in full:
                # an all-gather: every rank, the same tensors in the same order
                full[own] = state[own].full_tensor()
            if f:
                piece = full[own] if rows is None else full[own][rows]
                # little-endian, as safetensors
                f.write(piece.detach().cpu().contiguous().view(torch.uint8).numpy())
            if last_use[own] == i:
                del full[own]
    finally:
        if f:
            f.close()
    if rank == 0:
        write_config(path, model.config, state[layout[0][1]].dtype)


def save_optimizer(model, optimizer, path):
    """What trainer_state.pt keeps of the optimizer; every rank calls this. A replicated model's
    whole state dict; for a sharded one None, each rank having written its shard into the folder
    `path` (torch.distributed.checkpoint: a file per rank plus .metadata, which says how the shards
    make the whole tensors). Before the first update AdamW has no state to shard: its empty
    state dict is kept (get_optimizer_state_dict would create one by a zero-lr step, one AdamW
    step too many)."""
    if not is_sharded(model) or not optimizer.state:
        return optimizer.state_dict()
    dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=path)
    return None


def restore_optimizer(model, optimizer, saved, path):
    """Load the AdamW state of a checkpoint into this run's optimizer, sharded or not.
    saved: the state dict trainer_state.pt keeps (save_optimizer), or None when the checkpoint holds
    per-rank shards in the folder `path` (a sharded run's)."""
    if saved is not None and not saved["state"]:
        return  # saved before the first update: AdamW creates its state at its first step, as here
    if saved is not None and not is_sharded(model):
        optimizer.load_state_dict(saved)
    elif saved is not None:
        # a replicated run's state into shards: each rank keeps its part of every tensor;
        # optimizer.state_dict() numbers the parameters in the order of named_parameters()
        names = [name for name, _ in model.named_parameters()]
        by_name = {
            "state": {names[i]: s for i, s in saved["state"].items()},
            "param_groups": [
                {**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]
            ],
        }
        set_optimizer_state_dict(
            model, optimizer, by_name, options=StateDictOptions(full_state_dict=True)
        )
    else:  # shards into this run's layout, sharded or whole: dcp.load fills the tensors it is given
        # the layout to fill (it creates AdamW's state)
        state = get_optimizer_state_dict(model, optimizer)
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(model, optimizer, state)
