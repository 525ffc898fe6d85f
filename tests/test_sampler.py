"""The sampler: draws follow softmax(logits / T) within top-k, never a zero-probability token,
row by row."""

import pytest
import torch

from fast import sampling
from fast.sampling import BLOCK, sample_from_probs, sample_next_token

V = 2 * BLOCK + 88  # two full blocks of the two-level inverse CDF and a partial third one
N = 100_000  # draws per distribution


def expected_probs(logits, temperature, top_k):
    scaled = logits / temperature
    if top_k:
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, top_k).values[-1], float("-inf"))
    return torch.softmax(scaled.double(), dim=-1)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("top_k", [0, 50])
def test_draws_follow_softmax_of_logits_over_temperature(temperature, top_k):
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0)) * 2
    u = torch.rand(N, generator=torch.Generator().manual_seed(1))
    tokens = sample_next_token(logits.expand(N, V), u, temperature, top_k)
    counts = torch.bincount(tokens, minlength=V).double()
    p = expected_probs(logits, temperature, top_k)
    assert counts[p == 0].sum() == 0, "a token outside the top-k was drawn"
    # every token within 5 standard deviations of its expected count:
    # N * p +- 5 sqrt(N p (1 - p)) (+1 for rounding).
    # At another temperature (T=1 for T=0.5, say) the likeliest tokens miss by dozens of deviations.
    z = (counts - N * p).abs() / (N * p * (1 - p)).sqrt().clamp(min=1e-9)
    assert torch.all((z < 5) | ((counts - N * p).abs() <= 1)), (
        f"worst token off by {z.max():.1f} standard deviations"
    )


def test_zero_probability_tokens_are_never_drawn_even_where_u_lands_on_a_block_boundary():
    # Zero runs at the end of every block and of the vocabulary (what top-k leaves), u aimed
    # exactly at each block's upper running sum, one float below it, and at the largest float
    # below 1: where rounding puts the target at or past a running sum, the draw must still land
    # on a positive entry.
    gen = torch.Generator().manual_seed(2)
    n_blocks = (V + BLOCK - 1) // BLOCK
    for _ in range(20):
        probs = torch.rand(64, V, generator=gen) ** 4
        for start in range(0, V, BLOCK):
            probs[:, start + BLOCK - 30 : start + BLOCK] = 0
        probs[:, -50:] = 0
        running = torch.stack(
            [probs[:, b * BLOCK : (b + 1) * BLOCK].sum(-1) for b in range(n_blocks)], 1
        ).cumsum(-1)
        for b in range(n_blocks):
            u = (running[:, b] / running[:, -1]).clamp(max=1 - 2**-24)
            for u_aimed in (u, torch.nextafter(u, torch.zeros(())), torch.full_like(u, 1 - 2**-24)):
                tokens = sample_from_probs(probs, u_aimed)
                assert torch.all(probs[torch.arange(64), tokens] > 0)


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    seen = {
        int(sample_next_token(logits, torch.tensor([u]), 1.0, top_k=2))
        for u in torch.linspace(0, 0.999, 200).tolist()
    }
    assert seen == {0, 2, 3, 4}  # 2 is the 2nd largest; all three 2.0s stay in


def test_top_k_walks_its_candidates_in_vocabulary_order():
    # top-2 of [0, 2, 1, 3, 0] keeps tokens 1 and 3, e^2 : e^3: token 1 holds u in [0, 0.269),
    # token 3 the rest, as on the paths that walk the whole vocabulary (a tie at the k-th, CUDA)
    # and in engine.sample_reference
    logits = torch.tensor([[0.0, 2.0, 1.0, 3.0, 0.0]])
    drawn = [
        int(sample_next_token(logits, torch.tensor([u]), 1.0, top_k=2))
        for u in (0.0, 0.1, 0.26, 0.28, 0.5, 0.99)
    ]
    assert drawn == [1, 1, 1, 3, 3, 3]


def test_greedy_is_argmax():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(3))
    assert torch.equal(
        sample_next_token(logits, torch.rand(5), 0.0, top_k=10), logits.argmax(dim=-1)
    )


@pytest.mark.parametrize("vocab", [V, 8192, 151936])
def test_a_rows_draw_does_not_depend_on_the_other_rows(vocab):
    # the engine shrinks its batch as rows finish:
    # a row must draw the same token alone or among others
    gen = torch.Generator().manual_seed(4)
    logits, u = torch.randn(40, vocab, generator=gen) * 3, torch.rand(40, generator=gen)
    batched = sample_next_token(logits, u, 1.0, top_k=0)
    for i in (0, 13, 39):
        assert sample_next_token(logits[i : i + 1], u[i : i + 1], 1.0, top_k=0) == batched[i]
    assert torch.equal(sample_next_token(logits[5:30], u[5:30], 1.0, top_k=0), batched[5:30])


def test_with_top_k_a_rows_draw_does_not_depend_on_a_neighbour_tied_at_its_kth():
    # a tie at the k-th entry sends its row over the whole vocabulary; a row beside it without a tie
    # must still draw what it draws alone (once the whole chunk switched paths, and the same u
    # picked another token 2 times in 3)
    gen = torch.Generator().manual_seed(0)
    logits, k = torch.randn(2, V, generator=gen) * 3, 5
    logits[1, torch.topk(logits[1], k + 1).indices[k]] = torch.topk(logits[1], k).values[
        -1
    ]  # row 1: tied at its k-th
    u = torch.rand(200, 2, generator=gen)
    together = torch.stack([sample_next_token(logits, u[i], 1.0, top_k=k) for i in range(200)])
    alone = torch.tensor(
        [
            [
                int(sample_next_token(logits[i : i + 1], u[j, i : i + 1], 1.0, top_k=k))
                for i in range(2)
            ]
            for j in range(200)
        ]
    )
    assert torch.equal(together, alone)
    assert (
        len(set(together[:, 1].tolist())) == k + 1
    )  # the tied row keeps all k + 1 entries >= its k-th


def test_a_gpu_samples_every_row_at_once_and_a_cpu_in_chunks(monkeypatch):
    # on CUDA each chunk is a dozen kernel launches (20 chunks at 256 rows of a 152k vocabulary);
    # on a CPU a chunk keeps the softmax's temporaries small and reused
    assert sampling.chunk_rows("cuda", 256, 151936) == 256
    assert sampling.chunk_rows("cpu", 256, 151936) == sampling.ROWS_X_VOCAB // 151936 == 13
    # and the sampler takes its chunks by it: here 3 rows at a time
    monkeypatch.setattr(sampling, "ROWS_X_VOCAB", 3 * 50)
    calls, sample_rows = [], sampling._sample_rows
    monkeypatch.setattr(
        sampling,
        "_sample_rows",
        lambda logits, *a: calls.append(len(logits)) or sample_rows(logits, *a),
    )
    sample_next_token(torch.randn(8, 50), torch.rand(8))
    assert calls == [3, 3, 2]
