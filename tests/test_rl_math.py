"""The RL math of chat_rl.py, pinned down on batches small enough to compute by hand."""

import math
import os
import subprocess
import sys

import pytest
import torch

import chat_rl
from fast import logprobs
from plumbing import flags
from plumbing.evaluation import pass_at_k
from plumbing.flags import RunError
from plumbing.metrics import check_nonfinite
from policy.gpt import GPT, GPTConfig


class LinearNLLModel(torch.nn.Module):
    """Test double: log p of target token t is -w * t (0 where ignored);
    counts forward passes and rows."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(1.0))
        self.calls, self.rows = 0, 0


def linear_logprobs(model, inputs, targets, temperature, loss_grad=None, vocab_size=None):
    """plain_logprobs' place for the double above: the log-probs are linear in w."""
    model.calls += 1
    model.rows += inputs.size(0)
    return torch.where(targets >= 0, -model.w * targets.float(), torch.zeros(()))


def backward(model, advantages, num_samples=2, device_batch_size=8, loss_norm="all_tokens"):
    return chat_rl.policy_gradient_backward(
        model,
        SEQS,
        MASKS,
        advantages,
        num_samples=num_samples,
        device_batch_size=device_batch_size,
        loss_norm=loss_norm,
        device="cpu",
        logprobs=linear_logprobs,
    )


# two groups of two samples; sequences are prompt + completion, mask 1 on completion tokens
SEQS = [[9, 9, 1, 2, 3], [9, 9, 4, 5], [9, 7, 1], [9, 7, 2]]
MASKS = [[0, 0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 1], [0, 0, 1]]


def test_advantages_are_reward_minus_group_mean():
    adv = chat_rl.compute_advantages(
        torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), num_samples=4
    )
    assert adv.tolist() == [0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]


def test_zscore_advantages_divide_by_group_std():
    adv = chat_rl.compute_advantages(torch.tensor([1.0, 0.0]), num_samples=2, kind="zscore")
    std = torch.tensor([1.0, 0.0]).std().item()
    assert adv.tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4)])


# every kind of advantage by name, written out rather than read from plumbing/flags.ADVANTAGES (a
# loop over that list passes with a name left out of it): a kind of your own joins KINDS, and the
# tests naming kinds (here and test_train_loop's) run it; NO_BASELINE names the kinds that train
# unanimous groups (none built in), which the equal-rewards test leaves out
KINDS, NO_BASELINE = ("mean", "zscore"), ()


def test_the_tests_name_every_kind_the_flag_accepts():
    assert sorted(KINDS) == sorted(flags.ADVANTAGES)


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind not in NO_BASELINE])
def test_a_group_of_equal_rewards_gets_advantage_exactly_zero_whatever_their_value(kind):
    # the float32 mean of 16 x 0.1 (a format bonus alone) is not exactly 0.1: r - mean(r) would be
    # ~1e-8, and the group would look live to the loss: a forward and backward pass for a gradient
    # of rounding noise. (The last check, every mixed group's row nonzero, is these two kinds': a
    # baseline that can equal a reward, such as a group's median, leaves that row 0.)
    rewards = torch.tensor([0.1] * 16 + [0.7] * 16 + [1.0] * 8 + [0.0] * 8)
    adv = chat_rl.compute_advantages(rewards, num_samples=16, kind=kind)
    assert torch.all(adv[:32] == 0) and torch.all(adv[32:] != 0)


def test_loss_equals_hand_computed_value():
    # the run's default, all_tokens. group 0 rewards [1, 0] -> advantages [+0.5, -0.5]; group 1
    # rewards [1, 1] -> [0, 0]: its rows skip the passes, but their tokens still count in N.
    # N = every sampled token of the step: 3 + 2 + 1 + 1 = 7; with logp = -w * token,
    # loss = -(0.5 * -(1 + 2 + 3) + -0.5 * -(4 + 5)) / 7 = -(-3 + 4.5) / 7 = -1.5 / 7
    assert chat_rl.HYPERPARAMETERS["loss_norm"][0] == "all_tokens"
    model = LinearNLLModel()
    adv = chat_rl.compute_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), num_samples=2)
    loss, kept_tokens = backward(model, adv)
    assert kept_tokens == 5  # the rows that trained (the logged kept_tokens), not N
    assert loss.item() == pytest.approx(-1.5 / 7)
    # d loss / d w = -(0.5 * -6 + -0.5 * -9) / 7 as well (loss is linear in w, w = 1)
    assert model.w.grad.item() == pytest.approx(-1.5 / 7)


def test_kept_tokens_normalisation_counts_only_the_groups_with_signal():
    # DAPO's: the same step, N = group 0's tokens alone, 3 + 2 = 5
    model = LinearNLLModel()
    adv = chat_rl.compute_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), num_samples=2)
    loss, _ = backward(model, adv, loss_norm="kept_tokens")
    assert loss.item() == pytest.approx(-1.5 / 5)
    assert model.w.grad.item() == pytest.approx(-1.5 / 5)


def test_sequence_normalisation_averages_each_completion_first():
    # per-completion means: row 0: 0.5 * -(6)/3 = -1, row 1: -0.5 * -(9)/2 = 2.25;
    # over all 4 completions
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
    inputs, targets = chat_rl.make_batch([[5, 6, 7, 8], [5, 9]], [[0, 0, 1, 1], [0, 1]], "cpu")
    # row 0: inputs 5 6 7 predict 6 (prompt: -1), 7, 8; row 1: input 5 predicts 9, then padding
    assert inputs.tolist() == [[5, 6, 7], [5, 0, 0]]
    assert targets.tolist() == [[-1, 7, 8], [9, -1, -1]]


def test_gpt_per_token_nll_ignores_minus_one_targets():
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).init_weights(0)
    idx = torch.randint(0, 32, (2, 5))
    targets = torch.randint(0, 32, (2, 5))
    targets[0, :2] = -1
    nll = model(idx, targets, loss_reduction="none")
    expected = -torch.log_softmax(model(idx), dim=-1).gather(-1, targets.clamp(min=0)[..., None])[
        ..., 0
    ]
    assert nll.shape == (2, 5)
    assert torch.all(nll[0, :2] == 0)
    assert torch.allclose(nll[targets >= 0], expected[targets >= 0], atol=1e-6)


@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (4, 0, 1, 0.0),
        (4, 4, 1, 1.0),
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),
        (4, 2, 2, 1 - 1 / 6),
        (4, 1, 4, 1.0),
        (10, 3, 5, 1 - math.comb(7, 5) / math.comb(10, 5)),
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.mark.parametrize(
    "lengths,max_rows,max_tokens,expected",
    [
        ([3, 3, 4, 4, 5], 8, 1000, [[0, 1, 2, 3, 4]]),  # one batch when both budgets allow
        ([3, 3, 4, 4, 5], 2, 1000, [[0, 1], [2, 3], [4]]),  # the row budget
        (
            [3, 3, 4, 4, 5],
            8,
            12,
            [[0, 1, 2], [3, 4]],
        ),  # the token budget: 3 rows x 4 = 12, 3 x 5 > 12
        ([2, 50, 3], 8, 10, [[0], [1], [2]]),  # a row past the budget still gets its own batch
    ],
)
def test_micro_batches_respect_rows_and_padded_tokens(lengths, max_rows, max_tokens, expected):
    assert logprobs.split_rows(lengths, max_rows, max_tokens) == expected


def test_token_budget_does_not_change_the_loss_or_gradient():
    adv = torch.tensor([0.5, -0.5, 0.25, -0.25])
    results = []
    for budget in (math.inf, 3):  # 3 tokens: every row alone (targets of 2, 2, 3 and 4 positions)
        model = LinearNLLModel()
        loss, _ = chat_rl.policy_gradient_backward(
            model,
            SEQS,
            MASKS,
            adv,
            num_samples=2,
            device_batch_size=8,
            loss_norm="kept_tokens",
            device="cpu",
            device_batch_tokens=budget,
            logprobs=linear_logprobs,
        )
        results.append((loss.item(), model.w.grad.item(), model.calls))
    assert results[0][:2] == pytest.approx(results[1][:2]) and (results[0][2], results[1][2]) == (
        1,
        4,
    )


def test_derived_seeds_differ_for_every_tuple_the_old_arithmetic_mixed_up():
    # (seed * 100_003 + step) * 1009 + rank * 101 gave rank 10 at step s the seed of rank 0 at
    # step s + 1 plus a prompt offset of 1009 - 1010 = -1;
    # seed * 1000 + epoch mixed seed 0, epoch 1000 with seed 1, epoch 0
    d = chat_rl.derive_seed
    assert d(0, "rollout", 5, 10) != d(0, "rollout", 6, 0)
    assert d(0, "data", 1000) != d(1, "data", 0)
    seeds = {
        d(seed, "rollout", step, rank)
        for seed in range(3)
        for step in range(300)
        for rank in range(16)
    }
    assert len(seeds) == 3 * 300 * 16 and all(0 <= s < 2**63 for s in seeds)


def test_derived_seeds_are_the_same_in_every_process():
    # a resumed run is a new process: its seeds must not hang on Python's per-process string hashing
    tuples = [(0, "eval", 0), (1, "rollout", 7, 3), (2, "data", 1)]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    other_hash_seed = str(int(os.environ.get("PYTHONHASHSEED", "0").replace("random", "0")) + 1)
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import chat_rl; print([chat_rl.derive_seed(*t) for t in {tuples!r}])",
        ],
        cwd=repo,
        env={**os.environ, "PYTHONHASHSEED": other_hash_seed, "PYTHONPATH": repo},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.stdout.strip() == str([chat_rl.derive_seed(*t) for t in tuples]), child.stderr[
        -2000:
    ]


# ---- step 1: each step's problems ----------------------------------------------------------------
ROWS = [f"problem {i}" for i in range(50)]  # 6 steps of 8 an epoch; 2 problems left over each epoch


@pytest.mark.parametrize("world", [2, 4])
def test_a_steps_problems_are_split_among_ranks_without_overlap(world):
    for step in range(14):
        whole = chat_rl.problems_for_step(ROWS, step, 0, 1, 8, seed=0)
        parts = [
            chat_rl.problems_for_step(ROWS, step, rank, world, 8, seed=0) for rank in range(world)
        ]
        assert [len(p) for p in parts] == [8 // world] * world
        assert sum(parts, []) == whole  # rank r takes the r-th part of the step's problems


def test_an_epoch_takes_each_problem_at_most_once_and_the_next_epoch_reshuffles():
    epochs = [
        sum(
            (
                chat_rl.problems_for_step(ROWS, step, 0, 1, 8, seed=0)
                for step in range(6 * e, 6 * e + 6)
            ),
            [],
        )
        for e in range(2)
    ]
    for taken in epochs:
        assert len(taken) == len(set(taken)) == 48
    assert epochs[0] != epochs[1]


def test_the_data_order_is_fixed_by_the_seed():
    def take(seed):
        return [chat_rl.problems_for_step(ROWS, step, 0, 1, 8, seed) for step in range(3)]

    assert take(0) == take(0) and take(0) != take(1)
    assert take(0)[0] != take(0)[1]


# ---- step 6: clip, then step at the scheduled learning rate --------------------------------------
class TwoWeights(torch.nn.Module):
    """Two parameters, gradients set by hand: g = norm * (0.6, 0.8) has global norm `norm`."""

    def __init__(self):
        super().__init__()
        self.a, self.b = (
            torch.nn.Parameter(torch.tensor([1.0])),
            torch.nn.Parameter(torch.tensor([2.0])),
        )

    def set_gradient(self, norm):
        self.a.grad, self.b.grad = torch.tensor([0.6 * norm]), torch.tensor([0.8 * norm])
        return self

    def weights(self):
        return torch.cat([self.a.detach(), self.b.detach()])


def step_with_sgd(norm, grad_clip, lr=0.5):
    """optimizer_step under plain SGD, whose update is -lr * the gradient it is left:
    (reported norm, update)."""
    model = TwoWeights().set_gradient(norm)
    before = model.weights()
    grad_norm, finite = chat_rl.optimizer_step(
        model,
        torch.optim.SGD(model.parameters(), lr=123.0),
        lr,
        grad_clip,
        loss=-0.1,
        kept_tokens=10,
    )
    assert finite
    return grad_norm, model.weights() - before


def test_a_gradient_above_grad_clip_leaves_with_norm_grad_clip():
    grad_norm, update = step_with_sgd(norm=10.0, grad_clip=1.0)
    assert grad_norm == pytest.approx(10.0)  # the norm logged is the one before clipping
    assert update.tolist() == pytest.approx(
        [-0.5 * 0.6, -0.5 * 0.8], rel=1e-5
    )  # lr 0.5 times the clipped (0.6, 0.8)


def test_a_gradient_below_grad_clip_is_untouched():
    grad_norm, update = step_with_sgd(norm=0.5, grad_clip=1.0)
    assert grad_norm == pytest.approx(0.5)
    assert update.tolist() == pytest.approx([-0.5 * 0.3, -0.5 * 0.4], rel=1e-5)


def test_grad_clip_zero_turns_clipping_off():
    grad_norm, update = step_with_sgd(norm=10.0, grad_clip=0.0)
    assert grad_norm == pytest.approx(10.0)
    assert update.tolist() == pytest.approx([-0.5 * 6.0, -0.5 * 8.0], rel=1e-5)


def test_the_update_is_taken_at_the_learning_rate_given():
    _, update = step_with_sgd(norm=0.5, grad_clip=1.0, lr=0.1)
    assert update.tolist() == pytest.approx([-0.1 * 0.3, -0.1 * 0.4], rel=1e-5)


def adamw_after_one_update():
    model = TwoWeights().set_gradient(1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    chat_rl.optimizer_step(model, optimizer, 0.1, 1.0, loss=-0.1, kept_tokens=10)
    return (
        model,
        optimizer,
    )  # AdamW now has momentum: a step on a zero gradient would still move the weights


@pytest.mark.parametrize(
    "loss,gradient", [(math.nan, 1.0), (math.inf, 1.0), (-0.1, math.nan), (-0.1, math.inf)]
)
def test_a_non_finite_loss_or_gradient_skips_the_update(loss, gradient):
    model, optimizer = adamw_after_one_update()
    model.set_gradient(gradient)
    before = model.weights()
    _, finite = chat_rl.optimizer_step(model, optimizer, 0.1, 1.0, loss=loss, kept_tokens=10)
    assert not finite and torch.equal(model.weights(), before)


def test_a_step_with_no_sampled_token_leaves_the_weights_alone():
    model, optimizer = adamw_after_one_update()
    model.set_gradient(0.0)
    before = model.weights()
    _, finite = chat_rl.optimizer_step(model, optimizer, 0.1, 1.0, loss=0.0, kept_tokens=0)
    assert finite and torch.equal(model.weights(), before)
    # what skipping it avoids: AdamW's momentum moves the weights on a zero gradient
    optimizer.step()
    assert not torch.equal(model.weights(), before)


def test_a_run_stops_after_max_nonfinite_non_finite_updates_in_a_row():
    def quiet(*a, **k):
        pass

    in_row = 0
    for finite, kept_tokens, expected in [
        (False, 10, 1),
        (True, 0, 1),
        (False, 10, 2),
        (True, 10, 0),
        (False, 10, 1),
    ]:
        in_row = check_nonfinite(finite, kept_tokens, in_row, 3, 0, quiet)
        assert (
            in_row == expected
        )  # a good update resets the count; a step with nothing to learn leaves it
    in_row = check_nonfinite(False, 10, in_row, 3, 5, quiet)
    with pytest.raises(RunError, match="3 non-finite updates in a row at step 6"):
        check_nonfinite(False, 10, in_row, 3, 6, quiet)
