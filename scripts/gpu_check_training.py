"""
gpu_check's checks of the training pass (python -m scripts.gpu_check runs them with the engine's),
each in the precision chat_rl trains in on CUDA (fp32 weights, bf16 autocast; bf16 gathers under
--fsdp; a bf16 base under LoRA): the loss's log-probs as the trainer takes them (told the loss's
gradient) and as any loss does, against the plain ones; --fsdp's loss on one rank against the whole
model; two ranks' step (under NCCL when two GPUs are visible) against one process; LoRA on a bf16
base against the fp32 base; one RL update against its FLOPs at the device's matmul rates. Each takes
gpu_check.Setup (device, batch shapes, the shared random model, its clock) and returns (result,
note) or raises.
"""

import copy
import json
import math
import os
import tempfile
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import chat_rl
from engine import Engine
from fast.logprobs import fast_logprobs, make_batch, plain_logprobs
from plumbing import flags, fsdp, start
from plumbing.distributed import sync_gradients
from policy import lora
from policy.gpt import GPT, GPTConfig
from scripts.bench_rl_step import Tokenizer, update_against_floor, update_work

# the loss's log-probs three ways: chat_rl's (each prompt once, told the gradient the loss will send
# back, so the head's gradients are made in the forward pass), any loss's (each prompt once, the
# head projected again in the backward pass) and the plain ones (every sequence whole, all logits at
# once), which the other two must give
LAYOUTS = ("told the loss", "any loss", "plain")


def loss_rollouts(loss_batch, vocab, seed=4, n_prompts=None):
    """Prompt-major sequences and masks: prompts and completions of random tokens and lengths in the
    ranges of loss_batch (prompts, samples, prompt lengths, completion lengths); n_prompts: another
    number of prompts."""
    prompts, samples, (p_lo, p_hi), (c_lo, c_hi) = loss_batch
    g = torch.Generator().manual_seed(seed)

    def randint(lo, hi, n=None):
        return torch.randint(lo, hi + 1, (n or 1,), generator=g).tolist()

    sequences, masks = [], []
    for _ in range(n_prompts or prompts):
        prompt = randint(0, vocab - 1, randint(p_lo, p_hi)[0])
        for _ in range(samples):
            completion = randint(0, vocab - 1, randint(c_lo, c_hi)[0])
            sequences.append(prompt + completion)
            masks.append([0] * len(prompt) + [1] * len(completion))
    return sequences, masks


def flat_grad(model, trained_only=False):
    """Every parameter's gradient in one fp64 vector on the CPU (zeros where none; a sharded one
    gathered whole)."""
    grads = []
    for p in model.parameters():
        if p.requires_grad or not trained_only:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad  # a DTensor: whole
            grads.append(grad.double().flatten().cpu())
    return torch.cat(grads)


def loss_and_grad(s, model, sequences, masks, weights, layout, autocast):
    """Per-token NLL (every target, row-major), the flattened gradient of sum(weight x NLL), and
    the seconds of forward + backward, the log-probs taken one of the LAYOUTS' ways."""
    model.zero_grad(set_to_none=True)
    inputs, targets = make_batch(sequences, masks, s.device)
    logprobs = plain_logprobs if layout == "plain" else fast_logprobs
    # d sum(weight x NLL) / d logp = -weight on every sampled token: what the loss will send back
    loss_grad = -weights[:, None] * (targets >= 0) if layout == "told the loss" else None

    def run():
        with autocast():  # as plumbing/passes.backward_passes calls it
            nll = -logprobs(model, inputs, targets, 1.0, loss_grad=loss_grad)
        (nll * weights[:, None]).sum().backward()
        return nll

    nll, seconds = s.timed(run)
    return nll[targets >= 0].detach(), flat_grad(model), seconds


def grad_agreement(nll, grad, ref_nll, ref_grad):
    """(NLL max diff, gradient norm relative diff, gradient cosine) of one loss pass against a
    reference pass."""
    return (float((nll - ref_nll).abs().max()), *norm_and_cosine(grad, ref_grad))


def norm_and_cosine(grad, ref_grad):
    """(gradient norm relative diff, gradient cosine) of a flat gradient against a reference."""
    a, b = ref_grad.double(), grad.double()
    return float((b.norm() - a.norm()).abs() / a.norm()), float(a @ b / (a.norm() * b.norm()))


def agrees(precision, nll_diff, norm_diff, cosine):
    """The gradient's direction and size, and the NLL: bf16 rounds differently in two layouts
    (~1e-2), fp32 agrees to ~1e-5 (a gradient summed or divided wrongly keeps its direction: its
    size tells)."""
    if precision == "bf16":
        return cosine >= 0.99 and norm_diff <= 0.02 and nll_diff <= 0.5
    return cosine >= 0.9999 and norm_diff <= 1e-4 and nll_diff <= 1e-3 and math.isfinite(nll_diff)


def check_shared_loss(s):
    """The loss's log-probs and gradients as chat_rl trains with them (told the loss) and as any
    loss takes them, against the plain ones (every sequence whole), in bf16 (chat_rl's precision on
    CUDA) and in fp32."""
    model = s.model().train()
    sequences, masks = loss_rollouts(s.loss_batch, model.config.vocab_size)
    # stand-in advantages
    weights = torch.randn(len(sequences), generator=torch.Generator().manual_seed(5)).to(s.device)
    notes, ok = [], True
    for name, autocast in s.precisions:
        results = {}
        # the bf16 timings: the second of each layout (the first warms up)
        for _ in range(1 if name == "fp32" else 2):
            for layout in LAYOUTS:
                results[layout] = loss_and_grad(
                    s, model, sequences, masks, weights, layout, autocast
                )
        plain_nll, plain_grad, plain_s = results["plain"]
        parts = []
        for layout in LAYOUTS[:2]:
            nll, grad, seconds = results[layout]
            assert nll.shape == plain_nll.shape, f"{plain_nll.numel()} targets whole, {nll.numel()}"
            nll_diff, norm_diff, cosine = grad_agreement(nll, grad, plain_nll, plain_grad)
            ok &= agrees(name, nll_diff, norm_diff, cosine)
            parts.append(
                f"{layout}: NLL max diff {nll_diff:.1e}, grad norm rel diff "
                f"{norm_diff:.1e}, cosine {cosine:.6f}, {seconds / plain_s:.2f}x the time"
            )
        note = (
            f"{name} against plain (mean NLL {float(plain_nll.mean()):.2f}, "
            f"{plain_s * 1e3:.0f} ms): " + "; ".join(parts)
        )
        print(f"  {note} ({len(sequences)} rows, {plain_nll.numel()} targets)", flush=True)
        notes.append(note)
        del results
    model.zero_grad(set_to_none=True)
    return ("pass" if ok else "FAIL"), "; ".join(notes)


def check_fsdp_loss(s):
    """--fsdp's loss pass (fsdp.prepare on one rank: bf16 all-gathers and compute) against the whole
    model's in fp32, the log-probs taken as chat_rl trains with them."""
    model = s.model().train()
    sequences, masks = loss_rollouts(s.loss_batch, model.config.vocab_size)
    # stand-in advantages
    weights = torch.randn(len(sequences), generator=torch.Generator().manual_seed(5)).to(s.device)
    told = "told the loss"
    ref_nll, ref_grad, _ = loss_and_grad(s, model, sequences, masks, weights, told, nullcontext)
    model.zero_grad(set_to_none=True)
    started = not dist.is_initialized()
    # one rank: FSDP's gathers, mixed precision and gradient reduction all run, over a group of one
    if started:
        dist.init_process_group(
            "nccl" if s.cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
    try:
        sharded = fsdp.prepare(
            copy.deepcopy(model).cpu(),
            s.device,
            fsdp=True,
            activation_checkpointing=False,
            dtype=s.dtype,
        )
        assert all(hasattr(p, "full_tensor") for p in sharded.parameters()), (
            "fsdp.prepare left parameters unsharded"
        )
        nll, grad, seconds = loss_and_grad(s, sharded, sequences, masks, weights, told, s.autocast)
    finally:
        if started:
            dist.destroy_process_group()
    nll_diff, norm_diff, cosine = grad_agreement(nll, grad, ref_nll, ref_grad)
    note = (
        f"--fsdp bf16 against whole fp32: NLL max diff {nll_diff:.1e}, grad norm rel diff "
        f"{norm_diff:.1e}, cosine {cosine:.6f} ({seconds * 1e3:.0f} ms)"
    )
    print(f"  {note}", flush=True)
    return ("pass" if agrees("bf16", nll_diff, norm_diff, cosine) else "FAIL"), note


# ---- two ranks -----------------------------------------------------------------------------------
def two_rank_rollouts(loss_batch, vocab, samples, rank):
    """Rank 0's rows (3 groups) or rank 1's (1 group): 3 loss passes against 1, a group a pass."""
    prompts = 3 if rank == 0 else 1
    sequences, masks = loss_rollouts(loss_batch, vocab, seed=10 + rank, n_prompts=prompts)
    rewards = torch.tensor([float(i % 2) for i in range(len(sequences))])  # half right: all kept
    return sequences, masks, chat_rl.compute_advantages(rewards, samples)


def _two_rank_worker(rank, world, folder, device_type, config, loss_batch):
    """One rank of check_two_ranks: a step's gradient replicated and under --fsdp, the gathered
    weights and a rollout inside one gather; rank 0 also the one-process reference, and writes
    result.json."""
    cuda = device_type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{folder}/init",
        rank=rank,
        world_size=world,
        device_id=device if cuda else None,
    )
    autocast = torch.autocast(device_type, dtype=torch.bfloat16)
    samples = loss_batch[1]
    start = GPT(GPTConfig(**config)).init_weights(0)  # the same weights on every rank
    vocab = start.config.vocab_size
    sequences, masks, advantages = two_rank_rollouts(loss_batch, vocab, samples, rank)
    args = (sequences, masks, advantages)
    kw = dict(num_samples=samples, device_batch_size=samples, loss_norm="all_tokens", device=device)
    out = {}
    # replicated: each rank the whole model, the gradients summed by all-reduce
    model = copy.deepcopy(start).to(device).train()
    chat_rl.policy_gradient_backward(model, *args, **kw, autocast=autocast)
    sync_gradients(model)
    out["replicated"] = flat_grad(model)
    del model
    # --fsdp: shards, bf16 gathers, the ranks' passes matched (rank 1 runs 2 idle ones)
    sharded = fsdp.prepare(
        copy.deepcopy(start),
        device,
        fsdp=True,
        activation_checkpointing=False,
        dtype=torch.bfloat16,
    )
    passes = []

    def counted(*a, **k):
        passes.append(1)
        return fast_logprobs(*a, **k)

    chat_rl.policy_gradient_backward(
        sharded.train(), *args, **kw, autocast=autocast, logprobs=counted
    )
    out["fsdp"] = flat_grad(sharded)
    # inside one gather: every weight whole, the model's rounded to bf16; ranks decode different
    # numbers of tokens
    expected = {name: p.to(torch.bfloat16) for name, p in start.named_parameters()}
    new_tokens = 8 if rank == 0 else 3
    with torch.no_grad(), autocast, fsdp.gathered(sharded.eval()):
        gathered = all(torch.equal(p.cpu(), expected[n]) for n, p in sharded.named_parameters())
        prompts = [list(range(5)), list(range(3, 9))]
        engine = Engine(sharded, Tokenizer(vocab))
        _, sampled = engine.generate_batch(prompts, 2, new_tokens, 1.0, None, seed=rank)
    mine = dict(passes=len(passes), gathered=gathered, sampled=sum(map(sum, sampled)) // 4)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    dist.destroy_process_group()
    if rank == 0:  # one process over both ranks' rows, in the same precision (no group: own sums)
        both = [two_rank_rollouts(loss_batch, vocab, samples, r) for r in range(world)]
        rows = [sum((b[i] for b in both), []) for i in (0, 1)] + [torch.cat([b[2] for b in both])]
        whole = copy.deepcopy(start).to(device).train()
        chat_rl.policy_gradient_backward(whole, *rows, **kw, autocast=autocast)
        reference = flat_grad(whole)
        result = {"ranks": everyone}
        for kind in ("replicated", "fsdp"):
            norm, cosine = norm_and_cosine(out[kind], reference)
            result[kind] = dict(cosine=cosine, norm=norm)
        with open(os.path.join(folder, "result.json"), "w") as f:
            json.dump(result, f)


def check_two_ranks(s):
    """A step on two ranks (NCCL on two GPUs; gloo on the CPU) as chat_rl runs one, in bf16: the
    gradient summed over the ranks, replicated (all-reduce) and under --fsdp (reduce-scatter),
    against one process over both ranks' rows; --fsdp's passes matched when the ranks keep different
    numbers; its gathered weights, and a rollout inside one gather that the ranks end at different
    tokens."""
    if s.cuda and torch.cuda.device_count() < 2:
        return "one GPU", f"{torch.cuda.device_count()} GPU visible: two ranks need two"
    with tempfile.TemporaryDirectory() as folder:
        args = (2, folder, s.device.type, s.config, s.loss_batch)
        mp.start_processes(_two_rank_worker, args=args, nprocs=2, join=True, start_method="spawn")
        with open(os.path.join(folder, "result.json")) as f:
            result = json.load(f)
    ranks = result["ranks"]
    sums = {kind: result[kind] for kind in ("replicated", "fsdp")}
    ok = all(r["cosine"] >= 0.99 and r["norm"] <= 0.02 for r in sums.values())
    passes, gathered = [r["passes"] for r in ranks], all(r["gathered"] for r in ranks)
    sampled = [r["sampled"] for r in ranks]
    ok &= passes == [passes[0]] * len(ranks) and gathered and sampled == [8, 3]
    replicated, sharded = sums["replicated"], sums["fsdp"]
    note = (
        f"{'nccl' if s.cuda else 'gloo'}, 2 ranks: gradient sum against one process, "
        f"replicated cosine {replicated['cosine']:.6f} (norm {replicated['norm']:.1e} apart), "
        f"--fsdp cosine {sharded['cosine']:.6f} (norm {sharded['norm']:.1e}); --fsdp passes "
        f"{passes} (3 and 1 kept), gathered weights {'equal' if gathered else 'DIFFER'}, "
        f"tokens sampled inside one gather {sampled}"
    )
    print(f"  {note}", flush=True)
    return ("pass" if ok else "FAIL"), note


# ---- LoRA ----------------------------------------------------------------------------------------
def lora_copy(base, dtype):
    """The shared model with LoRA adapters (rank 16, every projection), its base in dtype, the
    adapters moved off B = 0 the same way at any dtype (as training leaves them), so that every
    adapter has a gradient."""
    frozen = None if dtype == torch.float32 else dtype
    model = lora.add_adapters(copy.deepcopy(base), 16, 32.0, base_dtype=frozen)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                generator = torch.Generator().manual_seed(len(name))
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    return model.train()


def check_lora(s):
    """--lora-rank as chat_rl runs it on CUDA: the adapters' gradient on the bf16 base through the
    loss chat_rl trains with, against the same adapters on the fp32 base; the supervised NLL's
    backward on the bf16 base; a rollout with the adapters; and the checkpoint's merged fp32
    weights, made on the CPU tensor by tensor (the GPU's added peak)."""
    base = s.model()
    vocab = base.config.vocab_size
    sequences, masks = loss_rollouts(s.loss_batch, vocab)
    rewards = torch.tensor([float(i % 2) for i in range(len(sequences))])
    samples = s.loss_batch[1]
    advantages = chat_rl.compute_advantages(rewards, samples)
    grads = {}
    for dtype in (torch.float32, s.dtype):
        model = lora_copy(base, dtype)
        chat_rl.policy_gradient_backward(
            model,
            sequences,
            masks,
            advantages,
            num_samples=samples,
            device_batch_size=samples,
            loss_norm="all_tokens",
            device=s.device,
            autocast=s.autocast(),
        )
        grads[dtype] = flat_grad(model, trained_only=True)
        del model
    norm, cosine = norm_and_cosine(grads[s.dtype], grads[torch.float32])
    model = lora_copy(base, s.dtype)  # the supervised NLL (GPT.forward with targets): head frozen
    inputs, targets = make_batch(sequences, masks, s.device)
    with s.autocast():
        loss = model(inputs, targets)
    loss.backward()
    nll_finite = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad(), s.autocast():
        engine = Engine(model.eval(), Tokenizer(vocab))
        _, sampled = engine.generate_batch([list(range(8))], 2, 4, 1.0, None, seed=0)
    largest = max(p.numel() for p in model.parameters()) * 4 / 2**20  # MiB, one weight in fp32
    s.sync()
    before = torch.cuda.memory_allocated(s.device) if s.cuda else 0
    if s.cuda:
        torch.cuda.reset_peak_memory_stats(s.device)
    merged = lora.merged_state_dict(model)
    added = (torch.cuda.max_memory_allocated(s.device) - before) / 2**20 if s.cuda else float("nan")
    fp32_model = sum(t.numel() for t in merged.values()) * 4 / 2**20
    del model, merged
    ok = cosine >= 0.99 and norm <= 0.02 and nll_finite and sum(map(sum, sampled)) == 8
    ok &= not s.cuda or added <= 2 * largest
    peak = (
        f"GPU peak +{added:.0f} MiB (one weight in fp32: {largest:.0f} MiB, the model: "
        f"{fp32_model:.0f} MiB)"
        if s.cuda
        else "made (the GPU's peak is measured on a GPU)"
    )
    note = (
        f"adapters' gradient on the bf16 base against the fp32 base: cosine {cosine:.6f}, norm "
        f"{norm:.1e} apart; supervised NLL gradient {'finite' if nll_finite else 'NOT FINITE'};"
        f" rollout ran; checkpoint's merged weights: {peak}"
    )
    print(f"  {note}", flush=True)
    return ("pass" if ok else "FAIL"), note


def check_update(s):
    """
    One RL update as chat_rl.train_step runs it (policy_gradient_backward, clipping, fused AdamW;
    lr 0, so the shared model stays as it is) on the rollout batch's shape, every group live,
    against its FLOPs (bench_rl_step.update_work) at this device's matmul rates taken beside it
    (bench_rl_step.update_against_floor, as bench_rollout's RL-step row). Micro-batches of one
    group each (device_batch_size = samples), so that each prompt runs once, as update_work counts.
    """
    model = s.model().train()
    vocab, rows = model.config.vocab_size, s.prompts * s.samples
    tokens = torch.randint(
        0,
        vocab,
        (s.prompts, s.prompt_len + s.new_tokens),
        generator=torch.Generator().manual_seed(6),
    )
    # each prompt's samples share it whole: lengths alike
    sequences = [tokens[r // s.samples].tolist() for r in range(rows)]
    masks = [[0] * s.prompt_len + [1] * s.new_tokens] * rows
    # half right in every group: every group carries gradient
    advantages = torch.tensor([1.0, -1.0]).repeat(rows // 2)
    defaults = {name: values[0] for name, values in chat_rl.HYPERPARAMETERS.items()}
    optimizer = start.adamw(
        model.parameters(), 0.0, flags.parse_config([], chat_rl.HYPERPARAMETERS)
    )

    def update():
        model.zero_grad(set_to_none=True)
        loss, kept_tokens = chat_rl.policy_gradient_backward(
            model,
            sequences,
            masks,
            advantages,
            num_samples=s.samples,
            device_batch_size=s.samples,
            loss_norm=defaults["loss_norm"],
            device=s.device,
            autocast=s.autocast(),
            device_batch_tokens=defaults["device_batch_tokens"],
        )
        chat_rl.optimizer_step(
            model, optimizer, 0.0, defaults["grad_clip"], float(loss), kept_tokens
        )

    work = update_work(model.config, list(zip(sequences, masks)), s.samples)
    n = 512 if s.quick else 8192
    seconds, floor, rates = update_against_floor(update, work, s.device, s.dtype, n=n)
    model.zero_grad(set_to_none=True)
    # AdamW's moments: 8 bytes a parameter, not needed by the checks after this one
    optimizer.state.clear()
    share = floor / seconds
    note = (
        f"{rows} rows x {s.prompt_len}+{s.new_tokens} tokens: update {seconds:.2f} s; "
        "at the matmul rates beside it ("
        + ", ".join(
            f"{str(kind).removeprefix('torch.')} {rate / 1e12:.1f} TFLOP/s"
            for kind, rate in rates.items()
        )
        + f") {floor:.2f} s: {share:.0%} (target >= 75%)"
    )
    print(f"  {note}", flush=True)
    return s.verdict(share >= 0.75), note
