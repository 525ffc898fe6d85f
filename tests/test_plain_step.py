"""chat_rl.plain_step, the step in plain torch, against train()'s first step on the demo: the same
completions, rewards, loss, gradient and updated weights, so a reader can learn the algorithm from
the plain one; and plain_step on two ranks against itself on one."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import chat_rl
from calculator import calculate
from fast.logprobs import make_batch
from plumbing import checkpoint, flags, start
from scripts.check_step import MAX_NEW_TOKENS, NUM_SAMPLES, first_step_of_train
from tasks import arith

DEFAULTS = flags.parse_config([], chat_rl.HYPERPARAMETERS)  # every flag at its default


# the demo's step 0 has a gradient norm of 0.21 (0.14 at temperature 1.5): a clip of 0.05 acts on
# it, the default's 1 not, and 0 is off, as --grad-clip=0 is
@pytest.mark.parametrize("temperature, grad_clip", [(1.0, 1.0), (1.5, 0.05), (1.0, 0.0)])
def test_train_takes_the_plain_steps_gradient_and_update(tmp_path, temperature, grad_clip):
    argv = f"--temperature={temperature}", f"--grad-clip={grad_clip}"
    train = first_step_of_train(tmp_path, *argv)
    model, tokenizer = checkpoint.load_policy("demo_model", "cpu")  # the weights step 0 starts at
    lr = chat_rl.PRESETS["demo"]["lr"]
    optimizer = start.adamw(model.parameters(), lr, DEFAULTS)  # the run's AdamW
    for p in model.parameters():  # a last step's gradients, which a step starts by dropping
        p.grad = torch.ones_like(p)
    loss, rewards = chat_rl.plain_step(model, optimizer, tokenizer, arith, train["problems"],
                                       NUM_SAMPLES, MAX_NEW_TOKENS, temperature, train["seed"],
                                       step=0, num_steps=1, peak_lr=lr, tool=calculate,
                                       grad_clip=grad_clip)  # fmt: skip
    assert rewards == train["out"]["total"]  # the same completions, scored the same
    groups = torch.tensor(rewards).view(-1, NUM_SAMPLES)
    assert (groups.amax(1) > groups.amin(1)).any(), "no group with signal: no gradient to compare"
    assert loss != 0 and loss == pytest.approx(train["loss"], rel=1e-5)
    assert train["row"]["loss"] == pytest.approx(loss, abs=1e-6)  # logged: L, 6 decimals
    _, targets = make_batch(train["out"]["sequences"], train["out"]["masks"], "cpu")
    assert train["row"]["sampled_tokens"] == int((targets >= 0).sum())  # logged: plain_step's N
    clear = sum(int((g.abs() > 1e-5).sum()) for g in train["grads"].values())
    assert clear > sum(g.numel() for g in train["grads"].values()) / 4  # a quarter at least
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, train["grads"][name], rtol=1e-4, atol=1e-7), name
        # AdamW's first step moves a weight by lr x g / (|g| + eps) (m / sqrt(v) is g / |g| after
        # the bias correction): where |g| is far above its eps of 1e-8, lr x sign(g), whatever the
        # gradient's last bits; near eps those bits move it by up to a tenth of lr
        clear = train["grads"][name].abs() > 1e-5
        weights, expected = p.detach()[clear], train["weights"][name][clear]
        assert torch.allclose(weights, expected, rtol=1e-6, atol=1e-7), name


def test_a_step_without_signal_takes_no_update():
    # plain_step skips a step without signal (kept_tokens 0 to the run's optimizer_step): after a
    # step with signal, AdamW's momentum would move every weight again at a zero gradient
    model, tokenizer = checkpoint.load_policy("demo_model", "cpu")
    lr = chat_rl.PRESETS["demo"]["lr"]
    optimizer = start.adamw(model.parameters(), lr, DEFAULTS)  # the run's AdamW
    problems = arith.load("test", limit=4)
    common = dict(tokenizer=tokenizer, task=arith, num_samples=NUM_SAMPLES, temperature=1.0,
                  seed=0, step=0, num_steps=2, peak_lr=lr, tool=calculate)  # fmt: skip
    _, rewards = chat_rl.plain_step(
        model, optimizer, problems=problems, max_new_tokens=40, **common
    )
    groups = torch.tensor(rewards).view(-1, NUM_SAMPLES)
    assert (groups.amax(1) > groups.amin(1)).any(), "the first step needs signal, for momentum"
    after_first = {n: p.detach().clone() for n, p in model.named_parameters()}
    # one token a reply: nothing answers, every reward 0, every group unanimous
    _, rewards = chat_rl.plain_step(model, optimizer, problems=problems, max_new_tokens=1, **common)
    assert set(rewards) == {0.0}
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), after_first[name]), name


def test_each_step_takes_the_runs_learning_rate():
    # the run's schedule (test_train_loop holds the logged lr of each of 4 steps to it), read as
    # AdamW steps: an lr set after the step would be the last step's
    model, tokenizer = checkpoint.load_policy("demo_model", "cpu")
    peak, num_steps = 4e-4, 4
    optimizer = start.adamw(model.parameters(), peak, DEFAULTS)
    stepped, adamw_step = {}, optimizer.step

    def recording_step(*args, **kwargs):
        stepped[step] = optimizer.param_groups[0]["lr"]
        return adamw_step(*args, **kwargs)

    optimizer.step = recording_step
    problems = arith.load("test", limit=4)
    for step in range(num_steps):
        chat_rl.plain_step(model, optimizer, tokenizer, arith, problems, NUM_SAMPLES, 40, 1.0,
                           seed=step, step=step, num_steps=num_steps, peak_lr=peak,
                           tool=calculate)  # fmt: skip
    assert list(stepped) == [0, 1, 2, 3], "a step without signal: no lr to compare"
    assert list(stepped.values()) == pytest.approx([4e-4, 3e-4, 2e-4, 1e-4], abs=1e-12)


class NoneRight:
    """arith whose replies are all wrong: every group unanimous, no signal."""

    def __getattr__(self, name):
        return getattr(arith, name)

    def grade(self, completion, reference):
        return False


def plain_step_on(problems, first_id=0, task=arith):
    """plain_step's step 0 from the demo model's start: its L, rewards, gradient and weights."""
    model, tokenizer = checkpoint.load_policy("demo_model", "cpu")
    lr = chat_rl.PRESETS["demo"]["lr"]
    optimizer = start.adamw(model.parameters(), lr, DEFAULTS)
    loss, rewards = chat_rl.plain_step(model, optimizer, tokenizer, task, problems, NUM_SAMPLES,
                                       MAX_NEW_TOKENS, 1.0, seed=7, step=0, num_steps=1,
                                       peak_lr=lr, tool=calculate, first_id=first_id)  # fmt: skip
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(loss=loss, rewards=rewards, grads=grads, weights=weights)


def _plain_step_on_a_rank(rank, world, init_file, out_dir, silent_rank):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mine = arith.load("test", limit=4)[2 * rank : 2 * rank + 2]  # each rank two of the four
    task = NoneRight() if rank == silent_rank else arith
    torch.save(plain_step_on(mine, first_id=2 * rank, task=task), f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def plain_step_on_two_ranks(tmp_path, silent_rank=-1):
    args = (2, str(tmp_path / "init"), str(tmp_path), silent_rank)
    mp.start_processes(_plain_step_on_a_rank, args=args, nprocs=2, join=True, start_method="spawn")
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


def test_plain_step_on_two_ranks_is_plain_step_on_one(tmp_path):
    # N and kept_tokens counted on both ranks, the gradients summed over them: two ranks' shares
    # make one step over all four problems, and both ranks take the same update
    ranks = plain_step_on_two_ranks(tmp_path)
    one = plain_step_on(arith.load("test", limit=4))
    assert ranks[0]["rewards"] + ranks[1]["rewards"] == one["rewards"]  # each problem samples alike
    groups = torch.tensor(one["rewards"]).view(-1, NUM_SAMPLES)
    assert (groups.amax(1) > groups.amin(1)).any(), "no group with signal: no gradient to compare"
    assert ranks[0]["loss"] == ranks[1]["loss"] == pytest.approx(one["loss"], rel=1e-5)
    for name, grad in one["grads"].items():
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name
        assert torch.allclose(ranks[0]["grads"][name], grad, rtol=1e-4, atol=1e-7), name
        clear = grad.abs() > 1e-5  # AdamW's first step: see the test above
        expected = one["weights"][name][clear]
        assert torch.allclose(ranks[0]["weights"][name][clear], expected, rtol=1e-6, atol=1e-7)


def test_a_rank_without_signal_takes_the_update_its_peer_does(tmp_path):
    # kept_tokens counted on both ranks: the rank whose groups are all unanimous still steps, with
    # the gradient its peer sent, so the two keep the same weights
    ranks = plain_step_on_two_ranks(tmp_path, silent_rank=1)
    assert set(ranks[1]["rewards"]) == {0.0} and len(set(ranks[0]["rewards"])) > 1
    start_weights = checkpoint.load_policy("demo_model", "cpu")[0].state_dict()
    assert any(not torch.equal(w, start_weights[n]) for n, w in ranks[0]["weights"].items())
    for name, weight in ranks[0]["weights"].items():
        assert torch.equal(weight, ranks[1]["weights"][name]), name
