"""The training log-prob pass: chunked over tokens, same NLL and gradients, never all
(tokens, vocab) logits at once."""

import math

import torch
import torch.nn.functional as F

from fast.logprobs import SampledLogprobs, token_nll
from policy.gpt import GPT, GPTConfig


def small_model():
    config = GPTConfig(
        vocab_size=500,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return GPT(config).init_weights(0)


def batch():
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 500, (3, 24), generator=gen)
    targets = torch.randint(0, 500, (3, 24), generator=gen)
    targets[0, :5] = -1  # prompt
    targets[2, 17:] = -1  # padding
    return idx, targets


def reference_nll(model, idx, targets):
    """Today's computation before chunking: every valid position's logits at once."""
    logits = model(idx).float()
    nll = F.cross_entropy(
        logits.flatten(0, 1), targets.flatten().clamp(min=0), reduction="none"
    ).view_as(targets)
    return nll.masked_fill(targets < 0, 0.0)


def test_chunked_nll_and_gradients_equal_the_unchunked_computation():
    idx, targets = batch()
    adv = torch.randn(3, 24, generator=torch.Generator().manual_seed(1))
    grads = []
    for chunked in (True, False):
        model = small_model()
        # 7 * 500 logits per chunk: 62 valid tokens make 9 chunks, the last one partial
        nll = (
            model(idx, targets, loss_reduction="none", logits_per_chunk=7 * 500)
            if chunked
            else reference_nll(model, idx, targets)
        )
        (nll * adv).sum().backward()
        grads.append((nll.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (nll_a, grad_a), (nll_b, grad_b) = grads
    assert torch.allclose(nll_a, nll_b, atol=1e-6)
    assert torch.all(nll_a[targets < 0] == 0)
    for (
        name
    ) in grad_a:  # equal up to fp32 summation order: within 1e-5 of the tensor's largest entry
        assert (grad_a[name] - grad_b[name]).abs().max() <= 1e-5 * grad_b[name].abs().max(), name


def test_backward_keeps_no_full_logit_tensor():
    # the shapes of all tensors autograd saves for backward: with chunks of 8 tokens, no
    # (tokens, vocab) one holds more
    idx, targets = batch()

    def saved_logit_rows(loss_fn):
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: shapes.append(t.shape) or t, lambda t: t
        ):
            loss_fn().sum().backward()
        return max((math.prod(s[:-1]) for s in shapes if s and s[-1] == 500), default=0)

    assert (
        saved_logit_rows(
            lambda: small_model()(idx, targets, loss_reduction="none", logits_per_chunk=8 * 500)
        )
        <= 8
    )
    assert (
        saved_logit_rows(lambda: reference_nll(small_model(), idx, targets)) == 3 * 24
    )  # what the check would see


def test_without_autograd_the_loss_is_the_same():
    idx, targets = batch()
    model = small_model()
    with torch.no_grad():
        assert torch.allclose(
            model(idx, targets, loss_reduction="none", logits_per_chunk=500),
            reference_nll(model, idx, targets),
            atol=1e-6,
        )


def test_under_bf16_autocast_the_chunked_pass_matches_to_bf16_precision():
    # the GPU path: logits made in bf16 (forward and the backward's recompute alike), NLL in fp32;
    # the chunked backward's matmuls in bf16 as autograd's, its sums in fp32 where autograd's are
    # bf16, so gradients agree to bf16 precision
    idx, targets = batch()
    results = []
    for chunked in (True, False):
        model = small_model()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            nll = (
                model(idx, targets, loss_reduction="none", logits_per_chunk=7 * 500)
                if chunked
                else reference_nll(model, idx, targets)
            )
        nll.sum().backward()
        results.append((nll.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (nll_a, grad_a), (nll_b, grad_b) = results
    assert nll_a.dtype == torch.float32 and torch.allclose(nll_a, nll_b, atol=1e-5)
    for name in grad_a:
        assert (grad_a[name] - grad_b[name]).abs().max() <= 3e-2 * grad_b[name].abs().max(), name


def test_log_probs_told_their_gradient_give_the_weighted_nlls_value_and_grads_and_project_once():
    # fast_logprobs' head (SampledLogprobs): log-probs whose gradients, for the loss_grad it is
    # told, are made in the forward pass; the loss sum of weight * NLL through it equals the
    # per-token NLL weighted afterwards, at a temperature, in chunks (62 targets, 7 per chunk), and
    # under bf16 autocast to bf16 precision; its backward pass makes no (tokens, vocab) matmul
    from torch.utils._python_dispatch import TorchDispatchMode

    class LogitMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.count += (
                func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
                and out.size(-1) == 500
            )
            return out

    idx, targets = batch()
    weights = torch.randn(3, 24, generator=torch.Generator().manual_seed(2))
    for autocast, tolerance in ((False, 1e-5), (True, 3e-2)):
        results = []
        for fused in (True, False):
            model = small_model()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                if fused:
                    valid = targets >= 0
                    logp = SampledLogprobs.apply(
                        model.hidden_states(idx)[valid],
                        model.lm_head.weight,
                        targets[valid],
                        -weights[valid],
                        7,
                        0.7,
                    )  # d loss / d logp
                    loss = -(weights[valid] * logp).sum()
                else:
                    loss = (
                        model(
                            idx,
                            targets,
                            loss_reduction="none",
                            logits_per_chunk=7 * 500,
                            temperature=0.7,
                        )
                        * weights
                    ).sum()
            with LogitMatmuls() as matmuls:
                loss.backward()
            results.append(
                (loss.detach(), {n: p.grad for n, p in model.named_parameters()}, matmuls.count)
            )
        (loss_a, grad_a, fused_matmuls), (loss_b, grad_b, recomputed) = results
        assert torch.allclose(loss_a, loss_b, rtol=1e-5) and fused_matmuls == 0 and recomputed == 9
        for name in grad_a:
            assert (grad_a[name] - grad_b[name]).abs().max() <= tolerance * grad_b[
                name
            ].abs().max(), (autocast, name)


def test_log_probs_told_another_gradient_make_the_head_gradients_again_for_what_arrives():
    # a guess that misses (the loss sends back twice the gradient it was told): SampledLogprobs
    # drops what it made and projects each chunk again, ChunkedNLL's way, in fp32 and under bf16
    idx, targets = batch()
    valid = targets >= 0
    weights = torch.randn(3, 24, generator=torch.Generator().manual_seed(2))[valid]
    for autocast, tolerance in ((False, 1e-5), (True, 3e-2)):
        results = []
        for fused in (True, False):
            model = small_model()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                h = model.hidden_states(idx)[valid]
                if fused:
                    logp = SampledLogprobs.apply(
                        h, model.lm_head.weight, targets[valid], weights, 7, 0.7
                    )
                else:
                    logp = -token_nll(h, model.lm_head.weight, targets[valid], 7, 0.7)
                (2 * weights * logp).sum().backward()
            results.append({n: p.grad for n, p in model.named_parameters()})
        for name in results[0]:
            error = (results[0][name] - results[1][name]).abs().max()
            assert error <= tolerance * results[1][name].abs().max(), (autocast, name)


def test_the_mlp_keeps_its_gate_up_output_not_silu_of_it_and_has_autograds_gradients():
    # what the MLP's backward keeps, weights aside: its input (N, C), the fused gate/up output
    # (N, 2M) and down_proj's input (N, M); autograd's silu(gate) * up would also keep
    # silu(gate), N x M more
    mlp = small_model().model.layers[0].mlp
    N, C, M = 10, 32, 64  # tokens, model width, MLP width
    x = torch.randn(N, C, generator=torch.Generator().manual_seed(0), requires_grad=True)
    weights = {p.data_ptr() for p in mlp.parameters()}
    saved = {}
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: (
            saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) and t
        ),
        lambda t: t,
    ):
        y = mlp(x)
    assert sum(n for ptr, n in saved.items() if ptr not in weights) == N * (C + 2 * M + M) * 4
    grad = torch.randn(N, C, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(y, [x, mlp.gate_up_proj.weight, mlp.down_proj.weight], grad)
    gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    want = torch.autograd.grad(
        mlp.down_proj(F.silu(gate) * up), [x, mlp.gate_up_proj.weight, mlp.down_proj.weight], grad
    )
    for a, b in zip(got, want):
        assert torch.equal(a, b)
