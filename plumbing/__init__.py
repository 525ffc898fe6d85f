"""What a run needs besides the RL of chat_rl.py: flags.py (the command line and its checks),
distributed.py and fsdp.py (the ranks, their collectives, sharding), checkpoint.py (saving, loading,
resuming), metrics.py (what a run reports), memory.py (what a GPU run will hold, planned from its
config), passes.py (step 5's micro-batches, how the loss is computed, not what), loop.py (the run
around chat_rl's step: evals, checkpoints, stops, the log).

The torch this needs is checked here, before any module of the package is imported: distributed.py
and fsdp.py import FSDP2 (torch.distributed.fsdp.fully_shard, public from torch 2.6) at their top,
and fsdp.prepare calls FSDPModule.set_gradient_divide_factor and set_force_sum_reduction_for_comms,
which torch 2.8 added (2.7.1 has neither). chat_rl imports this package first thing: an older torch
would end every run, --fsdp or not, in an ImportError's traceback; here it ends in one line."""

import re
import sys

import torch

TORCH_FLOOR = (2, 8)  # requirements.txt says the same


def torch_floor_message(version):
    """The line that stops a run on a torch older than TORCH_FLOOR; "" when `version` will do."""
    major, minor = (int(n) for n in re.match(r"(\d+)\.(\d+)", version).groups())
    if (major, minor) >= TORCH_FLOOR:
        return ""
    floor = ".".join(map(str, TORCH_FLOOR))
    return f"chat_rl needs torch>={floor} (found {version}): pip install --upgrade 'torch>={floor}'"


if message := torch_floor_message(torch.__version__):
    sys.exit(message)  # said on stderr, exit status 1: no traceback
