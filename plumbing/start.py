"""
What a run holds before its first step, built in the order resuming needs: the task and its rows,
the step count, the checkpoint to resume from, the check that the GPU can hold the policy, the
policy (its weights, LoRA's adapters, FSDP's shards), its Engine and optimizer, the --kl-beta
reference, the passes' autocast and the log.
"""

from contextlib import nullcontext
from types import SimpleNamespace

import torch

from calculator import calculate
from engine import Engine
from plumbing import checkpoint, fsdp, memory
from plumbing.data import load_data, rows_fingerprint
from plumbing.distributed import compute_dtype, restart_count
from plumbing.flags import load_task
from plumbing.metrics import MetricsLog


def adamw(parameters, lr, settings):
    """AdamW, fused (one kernel for all), at the run's weight_decay, adam_beta1 and adam_beta2
    (settings: the run's cfg; flags.parse_config([], HYPERPARAMETERS) for the defaults), eps 1e-8
    (torch's default, written out); one param group: weight_decay > 0 decays norms too."""
    betas = (settings.adam_beta1, settings.adam_beta2)
    return torch.optim.AdamW(
        parameters, lr, betas, eps=1e-8, weight_decay=settings.weight_decay, fused=True
    )


def start(cfg, rank, world, device):
    """The run's parts, as a namespace of the names below."""
    # --dtype resolved first: a checkpoint records what its run computed in, which resuming checks
    cfg.dtype, dtype_why = checkpoint.run_dtype(cfg, device)
    dtype = compute_dtype(device, cfg.dtype)
    task = load_task(cfg)
    train_rows, eval_rows = load_data(task, cfg)
    cfg.rows_fingerprint = rows_fingerprint(train_rows)  # in checkpoints: --resume checks the rows
    steps_per_epoch = len(train_rows) // cfg.examples_per_step
    num_steps = cfg.num_steps if cfg.num_steps > 0 else cfg.num_epochs * steps_per_epoch
    restarted = restart_count() > 0  # torchrun restarted the ranks: resume whatever the flags
    start_step, state = checkpoint.resume_point(cfg, world, device, restarted)  # fresh: (0, None)
    # a GPU that cannot hold even the weights, gradients and AdamW state is refused now, in one
    # line, before the weights are read onto it (plumbing/memory.py)
    memory.check_state_fits(cfg, world, device)
    # with --lora-rank, adapters. Under --fsdp the whole model is only ever in rank 0's host memory
    # (8 ranks each reading a 7B model in fp32 would take 8 x 30 GB of a node's): the other ranks
    # build it on the meta device, nothing allocated, and rank 0 sends each its shards
    # (fsdp.prepare); each unit moves to the device as it is sharded
    where = device if not cfg.fsdp else torch.device("cpu" if rank == 0 else "meta")
    model, tokenizer = checkpoint.build_policy(cfg, state, where, dtype)
    model = fsdp.prepare(model, device, cfg.fsdp, cfg.activation_checkpointing, dtype)
    engine = Engine(model, tokenizer, tool=calculate if cfg.tool == "calculator" else None)
    peak_lr = cfg.lora_lr if cfg.lora_rank else cfg.lr
    trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    optimizer = adamw(trained, peak_lr, cfg)
    checkpoint.restore(state, model, optimizer, rank)  # a resumed run's AdamW state and RNGs
    reference = checkpoint.reference_policy(cfg, model, state, device)  # --kl-beta's frozen start
    # trained weights stay fp32 (AdamW's master copy); with bf16 the passes compute in it
    bf16 = dtype == torch.bfloat16
    autocast = torch.autocast(device.type, dtype=dtype) if bf16 else nullcontext()
    log = MetricsLog(cfg.out_dir, rank, keep_below_step=start_step, wandb_project=cfg.wandb,
                     config=vars(cfg))  # fmt: skip
    resumed = state is not None
    return SimpleNamespace(task=task, train_rows=train_rows, eval_rows=eval_rows,
                           num_steps=num_steps, start_step=start_step, resumed=resumed,
                           model=model, tokenizer=tokenizer, engine=engine, peak_lr=peak_lr,
                           optimizer=optimizer, reference=reference, autocast=autocast,
                           dtype_why=dtype_why, log=log)  # fmt: skip
