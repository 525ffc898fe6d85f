"""scripts/check_step.py, the run's first steps beside the docstring's formulas worked by hand: it
agrees with the run as it is (a step with signal, one more with AdamW's moments, and a skip; with
the clip acting), and says NO (exit 1) where the run computes something else."""

import pytest
import torch

import chat_rl
import plumbing.start
from plumbing import checkpoint
from scripts import check_step

ROWS = "sampling A rows calculator N kept_tokens L gradient lr update".split()  # "ranks" on several


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
    assert len(steps) == (2 if flags else 4)
    assert all(sorted(step) == sorted(ROWS) for step in steps)
    assert all(agree == "yes" for step in steps for _, agree in step.values())
    assert "fused: ((0.9, 0.95), 1e-08, 0.0, True) (yes)" in out
    if not flags:  # the default seed's step 2 has no group with signal: the skip, and AdamW's
        # count after it (step 3's bias correction), are checked too
        assert [" skips " in step["update"][0] for step in steps] == [False, False, True, False]


def test_two_ranks_agree_with_the_formulas_over_all_their_rows(capsys):
    # each rank samples its share of the step's problems; N, L and the gradient are the step's, on
    # every rank, and both ranks take one update
    assert check_step.main(["--ranks=2", "--num-steps=2"]) == 0
    steps = tables(capsys.readouterr().out)
    assert len(steps) == 2 and all(sorted(step) == sorted([*ROWS, "ranks"]) for step in steps)
    assert all(agree == "yes" for step in steps for _, agree in step.values())


def test_a_run_that_divides_by_another_n_is_caught(monkeypatch, capsys):
    # N counting the kept rows' tokens alone (--loss-norm=kept_tokens's) where the docstring's
    # counts every row's: the divisor differs, and L and the gradient grow by N / kept_tokens
    normaliser = chat_rl.normaliser
    monkeypatch.setattr(
        chat_rl, "normaliser", lambda tokens, kept, loss_norm, device: normaliser(
            tokens, kept, "kept_tokens", device)
    )  # fmt: skip
    assert check_step.main(["--num-steps=1"]) == 1
    (step,) = tables(capsys.readouterr().out)
    assert step["N"][1] == step["L"][1] == step["gradient"][1] == "NO"  # N: the divisor used
    assert step["sampling"][1] == step["A"][1] == step["kept_tokens"][1] == "yes"


def test_a_run_whose_advantage_drops_the_baseline_is_caught(monkeypatch, capsys):
    # A = r, REINFORCE without the group's mean: every row of a unanimous group trains too
    def without_baseline(rewards, *args, **kwargs):  # a fork's kind may pass keywords
        return rewards.clone()

    monkeypatch.setattr(chat_rl, "compute_advantages", without_baseline)
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
    assert check_step.main(["--num-steps=3"]) == 1
    steps = tables(capsys.readouterr().out)
    assert [step["update"][1] for step in steps] == ["yes", "yes", "NO"]


def test_a_run_whose_calculator_answers_no_call_is_caught(monkeypatch, capsys):
    # the Engine's tool refusing every expression: the calls stay unanswered, nothing is forced
    monkeypatch.setattr(plumbing.start, "calculate", lambda expression: None)
    assert check_step.main(["--num-steps=1"]) == 1
    (step,) = tables(capsys.readouterr().out)
    assert step["calculator"][1] == "NO" and step["sampling"][1] == "yes"


def test_a_run_that_stops_is_told_apart_from_a_disagreement(monkeypatch, capsys):
    monkeypatch.setattr(chat_rl, "main", lambda argv: 1)  # its own error already printed
    assert check_step.main(["--num-steps=1"]) == 2
    assert "the run did not finish" in capsys.readouterr().err


def test_rows_that_end_or_take_results_otherwise_than_step_2_are_caught():
    # the demo's byte tokenizer: a row of prompt "Q:" then a reply; mask 1 where the policy drew
    _, tokenizer = checkpoint.load_policy("demo_model", "cpu")
    stop = min(tokenizer.stop_tokens)

    def row(reply, forced=()):  # forced: the reply's positions the calculator wrote
        tokens = tokenizer.encode(reply) if isinstance(reply, str) else reply
        mask = [0, 0] + [int(j not in forced) for j in range(len(tokens))]
        return tokenizer.encode("Q:") + tokens, mask, len(tokens)

    def check(*rows):
        out = dict(zip(("sequences", "masks", "tokens"), map(list, zip(*rows))))
        ends, written = check_step.rows_as_step_2_says(out, tokenizer)
        return [good for _, good in ends], [good for _, good in written]

    call = tokenizer.encode("<<6*5=")
    result = tokenizer.encode("30>>")
    good = row([*call, *result, stop], forced=range(len(call), len(call) + len(result)))
    assert check(good) == ([True], [True])
    wrong = row([*call, *tokenizer.encode("31>>"), stop],
                forced=range(len(call), len(call) + len(result)))  # fmt: skip
    assert check(wrong) == ([True], [False])
    stopped_early = row([stop, *tokenizer.encode("ab"), stop])  # a stop token before the last
    short = row(tokenizer.encode("ab"))  # no stop token, and not at the budget
    full = row(tokenizer.encode("a" * check_step.MAX_NEW_TOKENS))
    stopped_at_the_budget = row([*tokenizer.encode("a" * (check_step.MAX_NEW_TOKENS - 1)), stop])
    assert check(stopped_early, short, full, stopped_at_the_budget)[0] == [False, False, True, True]
    unanswered = row([*call, *tokenizer.encode("30>>"), stop])  # drawn, not forced: no result
    assert check(unanswered)[1] == [False]
