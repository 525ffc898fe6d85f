"""
gpu_check's checks of the training pass (python -m scripts.gpu_check runs them with the engine's): the shared-prompt
loss against whole sequences, --fsdp's against the whole model, and one RL update against its FLOPs at the device's
matmul rates. Each takes gpu_check.Setup (device, batch shapes, the shared random model, its clock) and returns
(result, note) or raises.
"""

import copy
import math
from contextlib import nullcontext

import torch
import torch.distributed as dist

import chat_rl
from plumbing import fsdp
from fast.logprobs import fast_logprobs
from scripts.bench_rl_step import update_against_floor, update_work


def loss_rollouts(s, vocab):
    """Prompt-major sequences and masks: prompts and completions of random tokens and lengths in the ranges of s.loss_batch."""
    n_prompts, samples, (p_lo, p_hi), (c_lo, c_hi) = s.loss_batch
    g = torch.Generator().manual_seed(4)
    randint = lambda lo, hi, n=None: torch.randint(lo, hi + 1, (n or 1,), generator=g).tolist()  # noqa: E731
    sequences, masks = [], []
    for _ in range(n_prompts):
        prompt = randint(0, vocab - 1, randint(p_lo, p_hi)[0])
        for _ in range(samples):
            completion = randint(0, vocab - 1, randint(c_lo, c_hi)[0])
            sequences.append(prompt + completion)
            masks.append([0] * len(prompt) + [1] * len(completion))
    return sequences, masks


def loss_and_grad(s, model, sequences, masks, weights, shared, autocast):
    """Per-token NLL (every target, row-major), the flattened gradient of sum(weight x NLL), and the seconds of forward
    + backward: shared, chat_rl's fast path (each prompt once, fast_logprobs); else every sequence whole (plain_logprobs)."""
    model.zero_grad(set_to_none=True)
    inputs, targets = chat_rl.make_batch(sequences, masks, s.device)
    logprobs = fast_logprobs if shared else chat_rl.plain_logprobs

    def run():
        with autocast():  # as policy_gradient_backward calls it
            nll = -logprobs(model, inputs, targets, 1.0)
        (nll * weights[:, None]).sum().backward()
        return nll

    nll, seconds = s.timed(run)
    whole = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g  # noqa: E731 -- a sharded model's DTensor gradient
    grad = torch.cat([whole(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])
    return nll[targets >= 0].detach(), grad, seconds


def check_shared_loss(s):
    model = s.model().train()
    sequences, masks = loss_rollouts(s, model.config.vocab_size)
    weights = torch.randn(len(sequences), generator=torch.Generator().manual_seed(5)).to(s.device)  # stand-in advantages
    notes, ok = [], True
    for name, autocast in s.precisions:
        results = {}
        for _ in range(1 if name == "fp32" else 2):  # the bf16 timings: the second of each layout (the first warms up)
            for shared in (False, True):
                results[shared] = loss_and_grad(s, model, sequences, masks, weights, shared, autocast)
        (nll, grad, whole_s), (shared_nll, shared_grad, shared_s) = results[False], results[True]
        assert nll.shape == shared_nll.shape, f"{nll.numel()} targets whole, {shared_nll.numel()} shared"
        nll_diff, norm_diff, cosine = grad_agreement(shared_nll, shared_grad, nll, grad)
        del results, grad, shared_grad
        note = (f"{name}: NLL max diff {nll_diff:.1e} (mean NLL {float(nll.mean()):.2f}), grad norm rel diff {norm_diff:.1e}, "
                f"cosine {cosine:.6f}, shared/whole time {shared_s * 1e3:.0f}/{whole_s * 1e3:.0f} ms = {shared_s / whole_s:.2f}x")
        print(f"  {note} ({len(sequences)} rows, {nll.numel()} targets)", flush=True)
        notes.append(note)
        # bf16 rounds differently in the two layouts (~1e-2); fp32 should agree to ~1e-5
        ok &= cosine >= 0.99 if name == "bf16" else (cosine >= 0.9999 and nll_diff <= 1e-3 and math.isfinite(nll_diff))
    model.zero_grad(set_to_none=True)
    return ("pass" if ok else "FAIL"), "; ".join(notes)


def grad_agreement(nll, grad, ref_nll, ref_grad):
    """(NLL max diff, gradient norm relative diff, gradient cosine) of one loss pass against a reference pass."""
    a, b = ref_grad.double(), grad.double()
    return float((nll - ref_nll).abs().max()), float((b.norm() - a.norm()).abs() / a.norm()), float(a @ b / (a.norm() * b.norm()))


def check_fsdp_loss(s):
    """--fsdp's loss pass (fsdp.prepare on one rank: on CUDA bf16 all-gathers and compute) against the whole model's in fp32."""
    model = s.model().train()
    sequences, masks = loss_rollouts(s, model.config.vocab_size)
    weights = torch.randn(len(sequences), generator=torch.Generator().manual_seed(5)).to(s.device)  # stand-in advantages
    ref_nll, ref_grad, _ = loss_and_grad(s, model, sequences, masks, weights, True, nullcontext)
    model.zero_grad(set_to_none=True)
    started = not dist.is_initialized()
    if started:  # one rank: FSDP's gathers, mixed precision and gradient reduction all run, over a group of one
        dist.init_process_group("nccl" if s.cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded = fsdp.prepare(copy.deepcopy(model).cpu(), s.device, fsdp=True, activation_checkpointing=False)
        assert all(hasattr(p, "full_tensor") for p in sharded.parameters()), "fsdp.prepare left parameters unsharded"
        nll, grad, seconds = loss_and_grad(s, sharded, sequences, masks, weights, True, s.autocast)
    finally:
        if started:
            dist.destroy_process_group()
    nll_diff, norm_diff, cosine = grad_agreement(nll, grad, ref_nll, ref_grad)
    precision = s.precisions[0][0]
    note = (f"--fsdp {precision} against whole fp32: NLL max diff {nll_diff:.1e}, grad norm rel diff {norm_diff:.1e}, "
            f"cosine {cosine:.6f} ({seconds * 1e3:.0f} ms)")
    print(f"  {note}", flush=True)
    # the direction and the size: a gradient summed or divided wrongly over the ranks keeps its direction
    ok = (cosine >= 0.99 and norm_diff <= 0.02) if precision == "bf16" else (cosine >= 0.9999 and norm_diff <= 1e-4 and nll_diff <= 1e-3)
    return ("pass" if ok else "FAIL"), note


def check_update(s):
    """
    One RL update as chat_rl.train runs it (policy_gradient_backward, clipping, fused AdamW; lr 0, so the shared model
    stays as it is) on the rollout batch's shape, every group live, against its FLOPs (bench_rl_step.update_work) at
    this device's matmul rates taken beside it (bench_rl_step.update_against_floor, as bench_rollout's RL-step row).
    Micro-batches of one group each (device_batch_size = samples), so that each prompt runs once, as update_work counts.
    """
    model = s.model().train()
    vocab, rows = model.config.vocab_size, s.prompts * s.samples
    tokens = torch.randint(0, vocab, (s.prompts, s.prompt_len + s.new_tokens), generator=torch.Generator().manual_seed(6))
    sequences = [tokens[r // s.samples].tolist() for r in range(rows)]  # each prompt's samples share it whole: lengths alike
    masks = [[0] * s.prompt_len + [1] * s.new_tokens] * rows
    advantages = torch.tensor([1.0, -1.0]).repeat(rows // 2)  # half right in every group: every group carries gradient
    defaults = {name: values[0] for name, values in chat_rl.HYPERPARAMETERS.items()}
    optimizer = chat_rl.adamw(model.parameters(), 0.0, defaults["weight_decay"])

    def update():
        model.zero_grad(set_to_none=True)
        loss, kept_tokens = chat_rl.policy_gradient_backward(model, sequences, masks, advantages, s.samples, s.samples,
                                                       defaults["loss_norm"], s.device, autocast=s.autocast(),
                                                       device_batch_tokens=defaults["device_batch_tokens"])
        chat_rl.optimizer_step(model, optimizer, 0.0, defaults["grad_clip"], float(loss), kept_tokens)

    work = update_work(model.config, list(zip(sequences, masks)), s.samples)
    seconds, floor, rates = update_against_floor(update, work, s.device, torch.bfloat16 if s.cuda else torch.float32,
                                                 n=512 if s.quick else 8192)
    model.zero_grad(set_to_none=True)
    optimizer.state.clear()  # AdamW's moments: 8 bytes a parameter, not needed by the checks after this one
    share = floor / seconds
    note = (f"{rows} rows x {s.prompt_len}+{s.new_tokens} tokens: update {seconds:.2f} s; at the matmul rates beside it ("
            + ", ".join(f"{str(kind).removeprefix('torch.')} {rate / 1e12:.1f} TFLOP/s" for kind, rate in rates.items())
            + f") {floor:.2f} s: {share:.0%} (target >= 75%)")
    print(f"  {note}", flush=True)
    return s.verdict(share >= 0.75), note
