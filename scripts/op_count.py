"""
ATen operations per decode pass: what a GPU pays at least one kernel launch (and Python's
dispatch) for, whatever the work in it. Counted by a TorchDispatchMode around whole generate
calls at two lengths, the difference divided by the steps between them, so the prefill and the
per-call setup cancel out. Views (and _unsafe_view, matmul's reshape of its result) only relabel
memory: they are counted apart.

Each generate is counted as it runs: the engine under its own no_grad, where composite operations
(linear, rms_norm) reach the counter as the kernels they decompose into on this device;
transformers under inference_mode, as the bench times it, where the counter sees each composite
operation once.
"""

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = {torch.ops.aten._unsafe_view.default}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.views = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view or func in VIEWS:
            self.views += 1
        else:
            self.ops[func.name()] += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(generate, short=8, long=24):
    """generate(new_tokens) runs one whole call -> (operations that are not views, all operations,
    Counter of the former by name) per decode pass, averaged over the long - short steps that the
    longer call adds."""
    counts = []
    for new_tokens in (short, long):
        with OpCounter() as counter:
            generate(new_tokens)
        counts.append(counter)
    steps = long - short
    ops = counts[1].ops - counts[0].ops
    non_views = sum(ops.values()) / steps
    return (
        non_views,
        non_views + (counts[1].views - counts[0].views) / steps,
        Counter({k: v / steps for k, v in ops.items()}),
    )
