"""The RL math of chat_rl.py, pinned down on batches small enough to compute by hand."""

import math

import pytest
import torch

import chat_rl
import loss_pass
from gpt import GPT, GPTConfig


class LinearNLLModel(torch.nn.Module):
    """Test double: NLL of target token t is w * t (0 where ignored); counts forward passes and rows."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(1.0))
        self.calls, self.rows = 0, 0

    def forward(self, idx, targets, loss_reduction="none", prefix=None, temperature=1.0, token_weights=None):
        self.calls += 1
        self.rows += idx.size(0)
        nll = torch.where(targets >= 0, self.w * targets.float(), torch.zeros(()))
        return nll if token_weights is None else (nll * token_weights).sum()  # GPT.forward's two reductions


def backward(model, advantages, num_samples=2, device_batch_size=8, loss_norm="kept_tokens"):
    return chat_rl.policy_gradient_backward(model, SEQS, MASKS, advantages, num_samples, device_batch_size, loss_norm, "cpu")


# two groups of two samples; sequences are prompt + completion, mask 1 on completion tokens
SEQS = [[9, 9, 1, 2, 3], [9, 9, 4, 5], [9, 7, 1], [9, 7, 2]]
MASKS = [[0, 0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 1], [0, 0, 1]]


def test_advantages_are_reward_minus_group_mean():
    adv = chat_rl.compute_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), num_samples=4)
    assert adv.tolist() == [0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]


def test_zscore_advantages_divide_by_group_std():
    adv = chat_rl.compute_advantages(torch.tensor([1.0, 0.0]), num_samples=2, kind="zscore")
    std = torch.tensor([1.0, 0.0]).std().item()
    assert adv.tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4)])


def test_loss_equals_hand_computed_value():
    # group 0 rewards [1, 0] -> advantages [+0.5, -0.5]; group 1 rewards [1, 1] -> [0, 0], skipped.
    # valid completion tokens of the step's kept rows: 3 + 2 = 5 (group 1's rows carry no gradient)
    # loss = -(sum logp * adv) / 5 with logp = -w * token:
    #      = -(0.5 * -(1 + 2 + 3) + -0.5 * -(4 + 5)) / 5 = -(-3 + 4.5) / 5 = -0.3
    model = LinearNLLModel()
    adv = chat_rl.compute_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), num_samples=2)
    loss, tokens = backward(model, adv)
    assert tokens == 5
    assert loss.item() == pytest.approx(-0.3)
    # d loss / d w = -(0.5 * -6 + -0.5 * -9) / 5 = -0.3 as well (loss is linear in w, w = 1)
    assert model.w.grad.item() == pytest.approx(-0.3)


def test_sequence_normalisation_averages_each_completion_first():
    # per-completion means: row 0: 0.5 * -(6)/3 = -1, row 1: -0.5 * -(9)/2 = 2.25; over all 4 completions
    model = LinearNLLModel()
    adv = torch.tensor([0.5, -0.5, 0.0, 0.0])
    loss, _ = backward(model, adv, loss_norm="sequence")
    assert loss.item() == pytest.approx(-(-1 + 2.25) / 4)


def test_micro_batching_does_not_change_the_loss():
    adv = torch.tensor([0.5, -0.5, 0.25, -0.25])
    losses = []
    for dbs in (1, 3, 8):
        model = LinearNLLModel()
        loss, _ = backward(model, adv, device_batch_size=dbs)
        losses.append((loss.item(), model.w.grad.item()))
    assert losses[0] == pytest.approx(losses[1]) and losses[0] == pytest.approx(losses[2])


def test_all_equal_reward_groups_cost_no_forward_pass():
    model = LinearNLLModel()
    adv = chat_rl.compute_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), num_samples=2)
    loss, tokens = backward(model, adv)
    assert model.calls == 0 and tokens == 0 and loss.item() == 0.0 and model.w.grad is None


def test_only_rows_of_groups_with_signal_are_forwarded():
    model = LinearNLLModel()
    adv = chat_rl.compute_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0]), num_samples=2)
    backward(model, adv)
    assert (model.calls, model.rows) == (1, 2)


def test_remainder_rows_get_their_own_micro_batch():
    # 4 active rows with device_batch_size 3: batches of 3 and 1, no row dropped
    model = LinearNLLModel()
    adv = torch.tensor([0.5, -0.5, 0.5, -0.5])
    backward(model, adv, device_batch_size=3)
    assert (model.calls, model.rows) == (2, 4)


def test_targets_exclude_prompt_and_padding_tokens():
    inputs, targets = loss_pass.make_batch([[5, 6, 7, 8], [5, 9]], [[0, 0, 1, 1], [0, 1]], "cpu")
    # row 0: inputs 5 6 7 predict 6 (prompt: -1), 7, 8; row 1: input 5 predicts 9, then padding
    assert inputs.tolist() == [[5, 6, 7], [5, 0, 0]]
    assert targets.tolist() == [[-1, 7, 8], [9, -1, -1]]


def test_gpt_per_token_nll_ignores_minus_one_targets():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1)).init_weights(0)
    idx = torch.randint(0, 32, (2, 5))
    targets = torch.randint(0, 32, (2, 5))
    targets[0, :2] = -1
    nll = model(idx, targets, loss_reduction="none")
    expected = -torch.log_softmax(model(idx), dim=-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    assert nll.shape == (2, 5)
    assert torch.all(nll[0, :2] == 0)
    assert torch.allclose(nll[targets >= 0], expected[targets >= 0], atol=1e-6)


@pytest.mark.parametrize("n,c,k,expected", [(4, 0, 1, 0.0), (4, 4, 1, 1.0), (4, 1, 1, 0.25), (4, 1, 2, 0.5),
                                            (4, 2, 2, 1 - 1 / 6), (4, 1, 4, 1.0), (10, 3, 5, 1 - math.comb(7, 5) / math.comb(10, 5))])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert chat_rl.pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.mark.parametrize("lengths,max_rows,max_tokens,expected", [
    ([3, 3, 4, 4, 5], 8, 1000, [[0, 1, 2, 3, 4]]),        # one batch when both budgets allow
    ([3, 3, 4, 4, 5], 2, 1000, [[0, 1], [2, 3], [4]]),    # the row budget
    ([3, 3, 4, 4, 5], 8, 12, [[0, 1, 2], [3, 4]]),        # the token budget: 3 rows x 4 = 12, 3 x 5 > 12
    ([2, 50, 3], 8, 10, [[0], [1], [2]]),                 # a row past the budget still gets its own batch
])
def test_micro_batches_respect_rows_and_padded_tokens(lengths, max_rows, max_tokens, expected):
    assert loss_pass.micro_batches(lengths, max_rows, max_tokens) == expected


def test_token_budget_does_not_change_the_loss_or_gradient():
    adv = torch.tensor([0.5, -0.5, 0.25, -0.25])
    results = []
    for budget in (math.inf, 3):  # 3 tokens: every row alone (targets of 2, 2, 3 and 4 positions)
        model = LinearNLLModel()
        loss, _ = chat_rl.policy_gradient_backward(model, SEQS, MASKS, adv, 2, 8, "kept_tokens", "cpu", device_batch_tokens=budget)
        results.append((loss.item(), model.w.grad.item(), model.calls))
    assert results[0][:2] == pytest.approx(results[1][:2]) and (results[0][2], results[1][2]) == (1, 4)


def test_derived_seeds_differ_for_every_tuple_the_old_arithmetic_mixed_up():
    # (seed * 100_003 + step) * 1009 + rank * 101 gave rank 10 at step s the seed of rank 0 at step s + 1
    # plus a prompt offset of 1009 - 1010 = -1; seed * 1000 + epoch mixed seed 0, epoch 1000 with seed 1, epoch 0
    d = chat_rl.derive_seed
    assert d(0, "rollout", 5, 10) != d(0, "rollout", 6, 0)
    assert d(0, "data", 1000) != d(1, "data", 0)
    seeds = {d(seed, "rollout", step, rank) for seed in range(3) for step in range(300) for rank in range(16)}
    assert len(seeds) == 3 * 300 * 16 and all(0 <= s < 2**63 for s in seeds)
    assert d(0, "eval", 0) == d(0, "eval", 0)  # a resumed run derives the same seeds
