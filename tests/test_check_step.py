"""scripts/check_step.py, the run's first steps beside the docstring's formulas worked by hand: it
agrees with the run as it is (a step with signal, one more with AdamW's moments, and a skip; with
the clip acting), and says NO (exit 1) where the run computes something else."""

import pytest
import torch

import chat_rl
from scripts import check_step

ROWS = "sampling A N kept_tokens L gradient lr update".split()  # and "ranks" on several


def tables(out):
    """[{what: (by hand, agree)}] a step, from the printed tables."""
    steps = []
    for line in out.splitlines():
        if line.startswith("step ") and "the docstring's formula" in line:  # a table's header
            steps.append({})
        elif steps and line.split() and line.split()[0] in (*ROWS, "ranks"):
            what, *_, agree = line.split()
            steps[-1][what] = (line, agree)
    return steps


@pytest.mark.parametrize(
    "flags", [[], ["--seed=1", "--temperature=1.5", "--grad-clip=0.05", "--num-steps=2"]]
)
def test_the_run_agrees_with_the_formulas_by_hand(flags, capsys):
    assert check_step.main(flags) == 0
    out = capsys.readouterr().out
    steps = tables(out)
    assert len(steps) == (2 if flags else 3)
    assert all(sorted(step) == sorted(ROWS) for step in steps)
    assert all(agree == "yes" for step in steps for _, agree in step.values())
    assert "fused: ((0.9, 0.95), 1e-08, 0.0, True) (yes)" in out
    if not flags:  # the default seed's step 2 has no group with signal: the skip is checked too
        assert [" skip " in step["update"][0] for step in steps] == [False, False, True]


def test_two_ranks_agree_with_the_formulas_over_all_their_rows(capsys):
    # each rank samples its share of the step's problems; N, L and the gradient are the step's, on
    # every rank, and both ranks take one update
    assert check_step.main(["--ranks=2", "--num-steps=2"]) == 0
    steps = tables(capsys.readouterr().out)
    assert len(steps) == 2 and all(sorted(step) == sorted([*ROWS, "ranks"]) for step in steps)
    assert all(agree == "yes" for step in steps for _, agree in step.values())


def test_a_run_that_divides_by_another_n_is_caught(monkeypatch, capsys):
    # N counting the kept rows' tokens alone (--loss-norm=kept_tokens's) where the docstring's
    # counts every row's: L and the gradient grow by N / kept_tokens
    normaliser = chat_rl.normaliser
    monkeypatch.setattr(
        chat_rl, "normaliser", lambda tokens, kept, loss_norm, device: normaliser(
            tokens, kept, "kept_tokens", device)
    )  # fmt: skip
    assert check_step.main(["--num-steps=1"]) == 1
    (step,) = tables(capsys.readouterr().out)
    assert step["L"][1] == step["gradient"][1] == "NO"
    assert step["sampling"][1] == step["A"][1] == step["N"][1] == "yes"


def test_a_run_whose_advantage_drops_the_baseline_is_caught(monkeypatch, capsys):
    # A = r, REINFORCE without the group's mean: every row of a unanimous group trains too
    monkeypatch.setattr(chat_rl, "compute_advantages", lambda rewards, *args: rewards.clone())
    assert check_step.main(["--num-steps=1"]) == 1
    (step,) = tables(capsys.readouterr().out)
    assert step["A"][1] == step["L"][1] == "NO"


def test_a_run_that_steps_without_signal_is_caught(monkeypatch, capsys):
    # AdamW stepping at step 2, whose groups are all unanimous, on zero gradients (a rank without
    # kept rows holds them after the sum over ranks): steps 0 and 1's moments still move the weights
    optimizer_step = chat_rl.optimizer_step

    def stepping(model, optimizer, lr, grad_clip, loss, kept_tokens):
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        return optimizer_step(model, optimizer, lr, grad_clip, loss, max(kept_tokens, 1))

    monkeypatch.setattr(chat_rl, "optimizer_step", stepping)
    assert check_step.main([]) == 1
    steps = tables(capsys.readouterr().out)
    assert [step["update"][1] for step in steps] == ["yes", "yes", "NO"]
