"""scripts/check_step.py, the run's first step beside the docstring's formulas worked by hand: it
agrees with a run as it is, with the clip acting, and says NO (exit 1) where the run computes
something else."""

import pytest

import chat_rl
from scripts import check_step

ROWS = "sampling A N kept_tokens L gradient lr AdamW update".split()


def table(out):
    """{what: agree} from the printed table."""
    lines = out.split("the run's\n", 1)[1].splitlines()[1:]  # past the title and the header
    return {line.split()[0]: line.split()[-1] for line in lines}


@pytest.mark.parametrize("flags", [[], ["--seed=1", "--temperature=1.5", "--grad-clip=0.05"]])
def test_the_run_agrees_with_the_formulas_by_hand(flags, capsys):
    assert check_step.main(flags) == 0
    assert table(capsys.readouterr().out) == {what: "yes" for what in ROWS}


def test_a_run_that_divides_by_another_n_is_caught(monkeypatch, capsys):
    # N counting the kept rows' tokens alone (--loss-norm=kept_tokens's) where the docstring's
    # counts every row's: L and the gradient grow by N / kept_tokens
    normaliser = chat_rl.normaliser
    monkeypatch.setattr(
        chat_rl, "normaliser", lambda tokens, kept, loss_norm, device: normaliser(
            tokens, kept, "kept_tokens", device)
    )  # fmt: skip
    assert check_step.main([]) == 1
    agree = table(capsys.readouterr().out)
    assert agree["L"] == agree["gradient"] == "NO"
    assert agree["sampling"] == agree["A"] == agree["N"] == "yes"


def test_a_run_whose_advantage_drops_the_baseline_is_caught(monkeypatch, capsys):
    # A = r, REINFORCE without the group's mean: every row of a unanimous group trains too
    monkeypatch.setattr(chat_rl, "compute_advantages", lambda rewards, *args: rewards.clone())
    assert check_step.main([]) == 1
    agree = table(capsys.readouterr().out)
    assert agree["A"] == agree["L"] == "NO"
