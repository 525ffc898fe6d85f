"""
CUDA's precision configuration, run on the CPU, which has bf16 tensors, bf16 autocast and FSDP over
gloo: fp32 weights computing in bf16 under autocast, --fsdp gathering its weights in bf16
(plumbing/fsdp.prepare's policy), LoRA's frozen base in bf16 (plumbing/checkpoint.build_policy).
chat_rl picks bf16 from the device (distributed.compute_dtype); these tests ask for it, and hold
each path to the same step in fp32 within bf16's rounding. CPU autocast differs from CUDA's in one
way that matters here: it runs view_as_complex in fp32, where CUDA's refuses a bf16 input, so the
tests check the dtype RoPE's rotations arrive in themselves.
"""

import datetime
import os
import weakref
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

import chat_rl
import test_fast_logprobs as fast_tests  # a module object: pytest does not collect its tests twice
from fast import attention
from fast.kv_cache import KVCache
from fast.logprobs import fast_logprobs, plain_logprobs, token_nll
from plumbing import checkpoint, distributed, fsdp, metrics
from policy import lora
from policy.tokenizer import ByteTokenizer

BF16 = torch.bfloat16
T = fast_tests.T
NUM_SAMPLES = fast_tests.NUM_SAMPLES
FAMILY = "qwen2 (qkv bias, untied head)"


def bf16_autocast():
    return torch.autocast("cpu", dtype=BF16)


def relative_error(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max())


def assert_bf16_close(grads, expected):
    """bf16's rounding apart, the same gradients: each tensor within 10% of its largest entry (a
    tensor missing, doubled or left at zero fails), and all of them together pointing the same way
    (cosine 0.999) at the same length (2%). Seen on these models: cosine 0.99998, lengths 0.6%
    apart, single tensors up to 5%."""
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert relative_error(grad, expected[name]) <= 0.1, name
    a, b = (
        torch.cat([g[name].detach().double().flatten() for name in expected])
        for g in (grads, expected)
    )
    cosine = float(a @ b / (a.norm() * b.norm()))
    length = float((a.norm() - b.norm()).abs() / b.norm())
    assert cosine >= 0.999 and length <= 0.02, (cosine, length)


def any_loss_logprobs(model, inputs, targets, temperature, loss_grad=None, vocab_size=None):
    """fast_logprobs as a loss that is not linear in logp calls it: without loss_grad (ChunkedNLL's
    backward)."""
    return fast_logprobs(model, inputs, targets, temperature, vocab_size=vocab_size)


# each way the loss takes the log-probs: chat_rl's (told the loss's gradient), any loss's, and the
# plain one
LOGPROBS = {
    "fast, told the loss": fast_logprobs,
    "fast, any loss": any_loss_logprobs,
    "plain": plain_logprobs,
}


def record_rope_dtypes(model):
    """The dtype of the RoPE rotations each decoder layer receives, after FSDP's pre-forward hook
    has run."""
    seen = []
    for block in model.model.layers:
        block.register_forward_pre_hook(lambda module, args: seen.append(args[1].dtype))
    return seen


# ---- --fsdp in bf16 on two ranks -----------------------------------------------------------------
def sharded_model():
    return fsdp.prepare(
        fast_tests.model_for(FAMILY),
        torch.device("cpu"),
        fsdp=True,
        activation_checkpointing=False,
        dtype=BF16,
    )


def _fsdp_worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    groups = 4 if rank == 0 else 2
    sequences, masks, advantages = fast_tests.rollouts(seed=10 + rank, num_groups=groups)
    out = {}
    for name, logprobs in LOGPROBS.items():
        model = sharded_model()
        ropes = record_rope_dtypes(model)
        # 3 passes on rank 0, 1 on rank 1: rank 1 runs 2 idle ones (fsdp.match_passes)
        chat_rl.policy_gradient_backward(
            model,
            sequences,
            masks,
            advantages,
            num_samples=NUM_SAMPLES,
            device_batch_size=4,
            loss_norm="all_tokens",
            device="cpu",
            autocast=bf16_autocast(),
            temperature=T,
            logprobs=logprobs,
        )
        out[name] = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        out[name, "rope"] = set(ropes)
    # the supervised NLL (GPT.forward with targets, ChunkedNLL), each rank its own rows
    model = sharded_model()
    inputs, targets = chat_rl.make_batch(sequences, masks, "cpu")
    with bf16_autocast():
        loss = model(inputs, targets)
    loss.backward()
    out["nll"] = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_bf16")
    mp.start_processes(
        _fsdp_worker,
        args=(2, str(tmp / "init"), str(tmp)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


def both_ranks_rollouts():
    parts = [fast_tests.rollouts(seed=10 + r, num_groups=4 if r == 0 else 2) for r in range(2)]
    return parts[0][0] + parts[1][0], parts[0][1] + parts[1][1], torch.cat([p[2] for p in parts])


@pytest.mark.parametrize("logprobs", LOGPROBS)
def test_fsdp_in_bf16_on_two_ranks_gives_one_process_gradient_in_bf16(fsdp_ranks, logprobs):
    # the reference: one process over both ranks' rows, fp32 weights under bf16 autocast (a
    # replicated CUDA run)
    reference = fast_tests.model_for(FAMILY)
    sequences, masks, advantages = both_ranks_rollouts()
    chat_rl.policy_gradient_backward(
        reference,
        sequences,
        masks,
        advantages,
        num_samples=NUM_SAMPLES,
        device_batch_size=4,
        loss_norm="all_tokens",
        device="cpu",
        autocast=bf16_autocast(),
        temperature=T,
        logprobs=plain_logprobs,
    )
    expected = {name: p.grad for name, p in reference.named_parameters()}
    for rank in range(2):
        # bf16 rotations: CUDA's view_as_complex refuses them
        assert fsdp_ranks[rank][logprobs, "rope"] == {torch.float32}
        assert_bf16_close(fsdp_ranks[rank][logprobs], expected)


def test_fsdp_in_bf16_takes_the_supervised_nll_gradient(fsdp_ranks):
    sequences, masks, _ = both_ranks_rollouts()
    reference = fast_tests.model_for(FAMILY)
    for rank, (start, stop) in enumerate([(0, 4 * NUM_SAMPLES), (4 * NUM_SAMPLES, len(sequences))]):
        inputs, targets = chat_rl.make_batch(sequences[start:stop], masks[start:stop], "cpu")
        with bf16_autocast():
            loss = reference(inputs, targets)
        loss.backward()  # the sum over ranks of each rank's mean, as FSDP sums the ranks' gradients
    expected = {name: p.grad for name, p in reference.named_parameters()}
    for rank in range(2):
        assert_bf16_close(fsdp_ranks[rank]["nll"], expected)


# ---- the chunked NLL's backward with bf16 inputs -------------------------------------------------
@pytest.mark.parametrize("head_trained", [True, False], ids=["head trained", "head frozen (LoRA)"])
def test_the_chunked_nll_backward_takes_bf16_hidden_states_and_head(head_trained):
    # under --fsdp in bf16 the final norm's output and the gathered head are bf16; with LoRA's bf16
    # base, the same
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 16, generator=g).to(BF16).requires_grad_()
    weight = torch.randn(40, 16, generator=g).to(BF16).requires_grad_(head_trained)
    targets, scale = torch.randint(0, 40, (7,), generator=g), torch.randn(7, generator=g)
    with bf16_autocast():
        nll = token_nll(h, weight, targets, chunk=3, temperature=T)
    (nll * scale).sum().backward()
    # the same bf16 values in fp32, by autograd
    h32, w32 = h.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    expected = F.cross_entropy(h32 @ w32.t() / T, targets, reduction="none")
    (expected * scale).sum().backward()
    assert nll.dtype == torch.float32 and relative_error(nll, expected.detach()) <= 0.02
    assert h.grad.dtype == BF16 and relative_error(h.grad, h32.grad) <= 0.02
    if head_trained:
        assert weight.grad.dtype == BF16 and relative_error(weight.grad, w32.grad) <= 0.02
    else:
        assert weight.grad is None


# ---- LoRA on a bf16 base -------------------------------------------------------------------------
def lora_config(path, rank=2):
    return SimpleNamespace(
        model=str(path), lora_rank=rank, lora_alpha=8.0, lora_targets="all-linear", seed=0
    )


def base_folder(tmp_path):
    """A folder chat_rl loads: the test model's weights in fp32 and a byte tokenizer."""
    path = tmp_path / "base"
    fast_tests.model_for(FAMILY).save_pretrained(path)
    ByteTokenizer().save_pretrained(path)
    return path


class OnGPU(torch.Tensor):
    """
    A pretend GPU for a test of memory: a CPU tensor that says it lives on another device ("meta",
    which needs no driver), whose results stay on it unless moved to "cpu", and which counts the
    bytes made on it and alive at once. A view adds no bytes; a tensor that leaves no Python
    reference is counted freed.
    """

    live = peak = 0

    @staticmethod
    def __new__(cls, data, counted=True):
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            dtype=data.dtype,
            device=torch.device("meta"),
            requires_grad=data.requires_grad,
        )
        t.data_on_cpu = data
        if counted:
            size = data.numel() * data.element_size()
            OnGPU.live += size
            OnGPU.peak = max(OnGPU.peak, OnGPU.live)
            weakref.finalize(t, OnGPU.free, size)
        return t

    @staticmethod
    def free(size):
        OnGPU.live -= size

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        to_host = kwargs.get("device") == torch.device("cpu")
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        args = tree_map(lambda x: x.data_on_cpu if isinstance(x, OnGPU) else x, args)
        out = func(*args, **kwargs)
        if to_host:
            return out
        view = any(r.alias_info is not None for r in func._schema.returns)
        return tree_map(lambda x: OnGPU(x, not view) if isinstance(x, torch.Tensor) else x, out)


def on_pretend_gpu(model):
    """The model's parameters moved onto OnGPU, a tied pair staying one tensor."""
    moved = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:  # a Linear without bias
                continue
            if id(p) not in moved:
                moved[id(p)] = torch.nn.Parameter(OnGPU(p.data), requires_grad=p.requires_grad)
            module._parameters[name] = moved[id(p)]
    return model


def test_a_lora_checkpoint_moves_the_weights_to_the_cpu_one_tensor_at_a_time(tmp_path):
    # the merged fp32 weights of a 7B model are 30 GB: built on the GPU beside the bf16 base they
    # would not fit a 48 GB card; made tensor by tensor, the GPU holds one merged tensor (and one
    # adapter product) at a time
    model = checkpoint.build_policy(lora_config(base_folder(tmp_path)), None, "cpu", dtype=BF16)[0]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    expected = lora.merged_state_dict(model)
    on_pretend_gpu(model)
    before = OnGPU.peak = OnGPU.live
    merged = lora.merged_state_dict(model)
    largest = max(p.numel() for p in model.parameters()) * 4  # one tensor in fp32
    whole = sum(p.numel() for name, p in model.named_parameters() if ".lora" not in name) * 4
    peak = OnGPU.peak - before
    assert peak <= 2 * largest, (
        f"{peak} bytes on the GPU at once; one tensor in fp32 is {largest}, the whole model {whole}"
    )
    # on the CPU, in fp32, the values the CPU's merge gives
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in merged.values())
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[k], expected[k]) for k in expected)


def lora_model(path, dtype, targets="all-linear"):
    """A LoRA run's model on a base folder, its adapters moved off B = 0 (as training leaves them)
    the same way at any dtype, so that every adapter gets a gradient."""
    cfg = SimpleNamespace(**{**vars(lora_config(path)), "lora_targets": targets})
    model = checkpoint.build_policy(cfg, None, "cpu", dtype=dtype)[0]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                generator = torch.Generator().manual_seed(len(name))
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    return model


def adapter_grads(model):
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def test_lora_on_a_bf16_base_gives_the_fp32_base_gradients_on_every_loss_path(tmp_path):
    path = base_folder(tmp_path)
    sequences, masks, advantages = fast_tests.rollouts(seed=1)
    args, kw = (
        (sequences, masks, advantages),
        dict(num_samples=NUM_SAMPLES, device_batch_size=8, loss_norm="all_tokens", device="cpu"),
    )
    reference = lora_model(path, torch.float32)
    chat_rl.policy_gradient_backward(reference, *args, **kw, temperature=T, logprobs=plain_logprobs)
    expected = adapter_grads(reference)
    for logprobs in LOGPROBS.values():
        model = lora_model(path, BF16)
        adapter = model.model.layers[0].mlp.gate_up_proj.lora.lora_A["up_proj"]
        assert model.lm_head.weight.dtype == BF16 and adapter.dtype == torch.float32
        chat_rl.policy_gradient_backward(
            model, *args, **kw, autocast=bf16_autocast(), temperature=T, logprobs=logprobs
        )
        grads = adapter_grads(model)
        assert all(grad.dtype == torch.float32 for grad in grads.values())
        assert_bf16_close(grads, expected)


def test_lora_on_a_bf16_base_takes_the_supervised_nll_gradient(tmp_path):
    path = base_folder(tmp_path)
    inputs, targets = chat_rl.make_batch(*fast_tests.rollouts(seed=2)[:2], "cpu")
    grads = []
    for dtype, autocast in ((torch.float32, nullcontext()), (BF16, bf16_autocast())):
        model = lora_model(path, dtype)
        with autocast:
            loss = model(inputs, targets)
        loss.backward()  # the head is frozen: ChunkedNLL makes the hidden states' gradient alone
        grads.append(adapter_grads(model))
    assert_bf16_close(grads[1], grads[0])


class Allocations(TorchDispatchMode):
    """Every tensor the operations under it make, but on the meta device (no memory): (dtype, number
    of elements)."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and not t.is_meta]
        self.made += [(t.dtype, t.numel()) for t in made]
        return out


@pytest.mark.parametrize("targets", ["all-linear", "all-linear,lm_head"])
def test_a_lora_base_is_read_in_bf16_straight_from_the_file(tmp_path, targets):
    # hub checkpoints are bf16: read as fp32 first, a 7B base would take 30 GB of the GPU before its
    # cast to 15
    path = tmp_path / "base"
    fast_tests.model_for(FAMILY).to(BF16).save_pretrained(path)
    ByteTokenizer().save_pretrained(path)
    with Allocations() as allocations:
        model = lora_model(path, BF16, targets)
    adapter = max(p.numel() for name, p in model.named_parameters() if ".lora" in name)
    trained_whole = model.lm_head.weight.numel() if "lm_head" in targets else 0
    kept_fp32 = max(adapter, trained_whole)
    made_fp32 = [n for dtype, n in allocations.made if dtype == torch.float32 and n > kept_fp32]
    assert not made_fp32, f"{len(made_fp32)} fp32 tensors larger than any the run keeps in fp32"
    frozen = {p.dtype for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {BF16}
    if "lm_head" in targets:  # trained whole, in fp32, with the file's values
        stored = fast_tests.model_for(FAMILY).to(BF16).lm_head.weight.float()
        assert model.lm_head.weight.dtype == torch.float32
        assert torch.equal(model.lm_head.weight, stored)


# ---- the sampler's decode attention --------------------------------------------------------------
def test_decode_attention_keeps_its_scores_fp32_under_bf16_autocast():
    # the training pass's attention kernel keeps q.k in fp32; bf16 scores of about 20 are off by up
    # to 0.06, and every probability by as much: the engine would sample another distribution than
    # the one the loss trains. Keys that share a large part (as attention sinks make them) give
    # large scores whose differences matter
    P, S, Hkv, g, T, D = 2, 3, 2, 2, 6, 16
    gen = torch.Generator().manual_seed(0)
    shared = 8 * torch.randn(D, generator=gen)

    def draw(*shape, common=0):
        return (torch.randn(*shape, generator=gen) + common).to(BF16)

    cache = KVCache(num_layers=1, pad=torch.tensor([0, 2]), max_new_tokens=2, rope=None)
    prompt_k, prompt_v = draw(P, Hkv, T, D, common=shared), draw(P, Hkv, T, D)
    cache.update(0, prompt_k, prompt_v)
    cache.advance(T)
    cache.share(S)
    q, k = 2 * draw(P * S, Hkv * g, 1, D), draw(P * S, Hkv, 1, D, common=shared)
    v = draw(P * S, Hkv, 1, D)
    with bf16_autocast():
        y = cache.attend(0, q, k, v)
    # each row: its prompt's keys past the padding, then its own, in fp64 from the same bf16 values
    errors = []
    for row in range(P * S):
        p, pad = row // S, int(cache.pad[row // S])
        keys = torch.cat([prompt_k[p, :, pad:], k[row]], dim=1).double()  # (Hkv, n, D)
        values = torch.cat([prompt_v[p, :, pad:], v[row]], dim=1).double()
        # (H, n, D): each kv head for its g query heads
        keys, values = keys.repeat_interleave(g, dim=0), values.repeat_interleave(g, dim=0)
        probs = (q[row].double() @ keys.transpose(1, 2) / D**0.5).softmax(dim=-1)  # (H, 1, n)
        errors.append(relative_error(y[row], probs @ values))
    # the output's and the probabilities' bf16 rounding: 0.26-0.45% seen (with bf16 scores,
    # 0.9-1.6%)
    assert max(errors) <= 0.006, errors


# ---- the loss's attention mask -------------------------------------------------------------------
def test_the_shared_prefix_mask_is_made_once_in_bf16_and_kept_once_for_the_backward_pass(
    monkeypatch,
):
    monkeypatch.setattr(attention, "FP32_ON_CPU", False)  # CUDA's bf16 attention kernels
    # the loss's mask is (rows, 1, GQA group x own tokens, prefix + own tokens): at 16k tokens a
    # micro-batch, hundreds of MB. Made in another dtype, autocast would cast it for each layer, and
    # each layer would keep its copy for the backward pass; its rows 8 entries apart, CUDA's
    # memory-efficient kernel takes it without padding a copy
    sequences, masks, _ = fast_tests.rollouts(seed=2)  # 11 keys a row: not 8 apart when packed
    inputs, targets = chat_rl.make_batch(sequences, masks, "cpu")
    model = fast_tests.model_for(FAMILY)
    masks_given, saved = [], []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):
        if attn_mask is not None:
            masks_given.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    def keep(t):
        saved.append(t)
        return t

    F.scaled_dot_product_attention = spy
    try:
        with bf16_autocast(), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            logp = fast_logprobs(model, inputs, targets, T)
    finally:
        F.scaled_dot_product_attention = sdpa
    assert len(masks_given) == model.config.num_hidden_layers
    assert len({m.data_ptr() for m in masks_given}) == 1 and masks_given[0].dtype == BF16
    assert masks_given[0].size(-1) == 11
    assert all(stride % 8 == 0 for stride in masks_given[0].stride()[:-1])
    kept = {t.data_ptr() for t in saved if t.shape == masks_given[0].shape}
    assert kept == {masks_given[0].data_ptr()}, f"{len(kept)} masks kept for the backward pass"
    # and the same log-probs as the plain path
    with bf16_autocast():
        plain = plain_logprobs(model, inputs, targets, T)
    assert relative_error(logp, plain) <= 0.02


# ---- what a CUDA run reports ---------------------------------------------------------------------
def test_each_train_row_reports_its_own_steps_peak_memory(monkeypatch):
    # CUDA's allocator, as far as peak_mem_gb reads it: a step that peaks at 5 GiB, then one that
    # peaks at 2
    allocator = {"now": 1.0, "peak": 1.0}

    def allocate(gib):
        allocator["peak"] = max(allocator["peak"], allocator["now"] + gib)

    def peak_bytes(device):
        return allocator["peak"] * 2**30

    def reset(device):
        allocator["peak"] = allocator["now"]

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", peak_bytes)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    cuda = torch.device("cuda", 0)
    allocate(4.0)
    first = metrics.peak_memory_gb(cuda)
    allocate(1.0)
    assert (first, metrics.peak_memory_gb(cuda)) == (5.0, 2.0)


@pytest.mark.parametrize(
    "device_type, fsdp",
    [("cuda", False), ("cpu", False), ("cuda", True)],
    ids=["torchrun, GPUs", "torchrun, CPUs", "one GPU, --fsdp"],
)
def test_the_process_group_waits_out_a_large_checkpoint_and_knows_its_gpu(
    monkeypatch, device_type, fsdp
):
    # while rank 0 writes a checkpoint the others wait in a collective: NCCL's default 10 minutes is
    # too short for a 7B run's 91 GB on a slow disk; and an NCCL group should know its rank's GPU
    # rather than guess it
    groups = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: groups.append(kwargs))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "rendezvous", lambda url: iter([(dist.HashStore(), 1, 2)]))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    rank, world = (0, 1) if fsdp else (1, 2)
    ranks = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
    for name, value in {**ranks, "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(name, value)
    rank, world, device = distributed.setup_distributed(device_type, fsdp=fsdp)
    [group] = groups
    assert group["timeout"] >= datetime.timedelta(hours=1)
    assert group["backend"] == ("nccl" if device_type == "cuda" else "gloo")
    assert group["device_id"] == (device if device_type == "cuda" else None)
    assert device == (torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu"))
