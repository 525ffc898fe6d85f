"""
The compiled decode step (Engine(compile_decode=True)): what torch.compile, and CUDA graphs after it, need from
engine.py's eager path, kept here so that the eager path reads without it. Not yet shown faster on a GPU, so off
by default.

A compiled graph is specialised to its shapes and to the Python numbers it reads, so:
  - StaticKVCache: every decode step has the same shapes and reads no Python number. The step's own slot is a
    tensor (written with index_copy_), and each step attends over all max_new own slots, the unwritten ones masked.
  - batch_size_bucket: a compaction keeps one of a few batch sizes, the running rows padded with finished ones, so
    a rollout compiles (and can capture) a handful of graphs, not one per batch size.
  - autocast_weights: the Linears' autocast copies made once per call instead of at every step.
"""

import torch

from distributed import is_sharded
from kv_cache import KVCache


class StaticKVCache(KVCache):
    """kv_cache.KVCache with decode steps of one fixed shape: the step is a tensor advanced in place."""

    def share(self, num_samples):
        super().share(num_samples)
        self.slots = torch.arange(self.max_new, device=self.pad.device)
        self.step = torch.zeros(1, dtype=torch.long, device=self.pad.device)  # own slot of the next token

    def rope_and_mask(self, T):
        if self.decoding:  # the own slots this step may read: those written so far and its own
            self.own_mask = torch.zeros(self.max_new, device=self.slots.device).masked_fill_(self.slots > self.step, float("-inf"))
        return super().rope_and_mask(T)

    def positions(self):
        return self.row_start + self.step

    def write_own(self, layer, k, v):
        self.k[layer].index_copy_(2, self.step, k)
        self.v[layer].index_copy_(2, self.step, v)
        return self.k[layer], self.v[layer]  # all max_new slots; own_mask hides the unwritten ones

    def advance(self, T):
        if self.decoding:
            self.step += T  # in place: a compiled step sees no Python number change
        else:
            super().advance(T)


def batch_size_bucket(n_running, batch):
    """
    The batch size a compaction keeps, in a call that began with `batch` rows: the smallest of batch and the powers
    of two below it that holds the n_running running rows, 8 sizes at most (torch.compile's default number of graphs
    for one function). A rollout's decode steps then take a handful of shapes, each compiled once.
    """
    sizes = [batch] + [2 ** k for k in reversed(range(batch.bit_length())) if 2 ** k < batch]
    return min(size for size in sizes[:8] if size >= n_running)


def with_finished_padding(running, n_running, n_keep):
    """running (n,) bool with n_running True entries -> the n_keep rows a compaction keeps: the running ones and, as
    padding, the first n_keep - n_running finished ones (their tokens are discarded, as a finished row's are until it
    leaves). No host sync."""
    if n_keep == n_running:
        return running
    finished = ~running
    return running | (finished & (finished.cumsum(0) <= n_keep - n_running))


def decode_step(model, token, cache, weights):
    """
    engine.decode_step with `weights` (autocast_weights) standing in for the model's own, by name.
    tie_weights=False: functional_call would otherwise tie lm_head's stand-in to the embedding's fp32 table (the
    model ties the two); here each keeps its own, as eager autocast does.
    """
    if not weights:
        return model(token[:, None], kv_cache=cache)[:, -1]
    return torch.func.functional_call(model, weights, (token[:, None],), {"kv_cache": cache}, tie_weights=False)[:, -1]


def autocast_weights(model):
    """
    Under autocast, every Linear's weight and bias cast to autocast's dtype, by name: the casts autocast itself
    makes. Eager autocast (outside inference_mode) casts each fp32 weight once per autocast block and reuses the
    copy; a compiled graph cannot, and would cast every weight at every step, reading all the fp32 weights again.
    Same values: the compiled step's logits are bit for bit those it makes without them. Only the Linears: the
    embedding stays fp32, as under eager autocast. Marked static: as inputs of a step compiled with dynamic=True
    their sizes would otherwise become symbols, and a prompt length equal to one of them would cost a recompile.
    {} without autocast, or for an FSDP-sharded model (its mixed precision gathers the weights in bf16 already).
    """
    device_type = model.lm_head.weight.device.type
    if not torch.is_autocast_enabled(device_type) or is_sharded(model):
        return {}
    dtype = torch.get_autocast_dtype(device_type)
    weights = {f"{name}.{p_name}": p.to(dtype) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
               for p_name, p in module.named_parameters(recurse=False)}
    for w in weights.values():
        torch._dynamo.mark_static(w)
    return weights
