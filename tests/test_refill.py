"""
--refill, DAPO's dynamic sampling: while fewer than examples_per_step groups of a step have signal,
more rounds of problems are sampled (up to --refill), and the step trains on its first
examples_per_step groups with signal in (round, rank, place) order; the epoch's order of problems
is the same however many rounds ran; a run resumed, or on two ranks, learns what one uninterrupted
process learns; each train row counts the groups and names the problems the rounds took.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import chat_rl
import test_resume
from plumbing import flags, refill
from plumbing.data import refill_problems
from test_fork import rollout_out

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S = 2  # samples a group


def group_out(rewards):
    """rollout()'s dict for groups of S completions with these rewards (a list per group)."""
    return rollout_out([float(r) for group in rewards for r in group])


def mean(out):
    """with_refills' advantages_of at the default kind: r - mean(r) within each group."""
    return chat_rl.compute_advantages(torch.tensor(out["total"]), S)


def test_the_step_trains_its_first_groups_with_signal_in_round_order():
    # 4 groups a step: round 0 has 1 with signal, round 1 two, round 2 three (one too many)
    rounds = [
        [[1, 1], [0, 1], [0, 0], [1, 1]],
        [[1, 0], [0, 0], [1, 1], [0, 1]],
        [[0, 1], [1, 0], [0, 1], [0, 0]],
    ]
    asked = []

    def sample_round(r):
        asked.append(r)
        return group_out(rounds[r])

    first = group_out(rounds[0])
    advantages = chat_rl.compute_advantages(torch.tensor(first["total"]), S)
    out, adv, trains, counts = refill.with_refills(
        first, advantages, sample_round, 4, S, 5, rank=0, world=1, device="cpu", advantages_of=mean
    )
    assert asked == [1, 2]  # sampled until 4 groups had signal, no further
    assert counts == dict(groups_sampled=12, groups_kept=4, refill_rounds=2)
    assert len(out["total"]) == len(adv) == len(trains) == 24  # every round's completions
    chosen = trains.view(-1, S)[:, 0].tolist()
    assert chosen == [0, 1, 0, 0] + [1, 0, 0, 1] + [1, 0, 0, 0]  # the first four with signal
    assert all(adv.view(-1, S)[g].abs().sum() > 0 for g, c in enumerate(chosen) if c)


def test_every_round_takes_the_runs_kind_of_advantage():
    rounds = [[[1, 0], [1, 1]], [[1, 0], [0, 0]]]
    first = group_out(rounds[0])
    # the run's config, every flag at its default but these: a flag a fork reads in
    # step_advantages comes with its default, as in a run
    cfg = flags.parse_config([f"--num-samples={S}", "--advantage=zscore"], chat_rl.HYPERPARAMETERS)
    _, adv, _, _ = refill.with_refills(
        first,
        chat_rl.step_advantages(first, cfg),
        lambda r: group_out(rounds[r]),
        2,
        S,
        1,
        0,
        1,
        "cpu",
        advantages_of=lambda extra: chat_rl.step_advantages(extra, cfg),
    )
    expected = chat_rl.compute_advantages(torch.tensor([1.0, 0, 1, 1, 1, 0, 0, 0]), S, "zscore")
    torch.testing.assert_close(adv, expected)  # round 1's z-scored as round 0's: not r - mean(r)


def test_rounds_of_per_token_advantages_are_padded_to_the_widest():
    # a fork's step_advantages giving one advantage a token, (rows, T), each round its own T: a
    # group has signal where any of its entries is nonzero, and the rounds come back zero-padded
    rounds = [[[1, 1], [0, 1]], [[1, 0], [0, 0]]]

    def per_token(out):  # r - mean(r) on each of 3 tokens, then a 4th in the second round
        width = 3 if out["total"] == group_out(rounds[0])["total"] else 4
        return mean(out)[:, None].expand(-1, width).clone()

    first = group_out(rounds[0])
    out, adv, trains, counts = refill.with_refills(
        first, per_token(first), lambda r: group_out(rounds[r]), 2, S, 1, rank=0, world=1,
        device="cpu", advantages_of=per_token,
    )  # fmt: skip
    assert counts == dict(groups_sampled=4, groups_kept=2, refill_rounds=1)
    assert trains.view(-1, S)[:, 0].tolist() == [0, 1, 1, 0]
    row = torch.tensor([0.0, 0.0, -0.5, 0.5, 0.5, -0.5, 0.0, 0.0])
    assert adv.shape == (8, 4)
    torch.testing.assert_close(adv[:4, :3], row[:4, None].expand(-1, 3))
    torch.testing.assert_close(adv[4:], row[4:, None].expand(-1, 4))
    assert adv[:4, 3].abs().sum() == 0  # the first round's missing token: 0, no gradient


def test_a_bound_on_the_rounds_trains_on_what_has_signal_by_then():
    rounds = [[[1, 1], [0, 0]], [[0, 1], [1, 1]], [[0, 0], [1, 0]]]
    first = group_out(rounds[0])
    out, adv, trains, counts = refill.with_refills(
        first,
        chat_rl.compute_advantages(torch.tensor(first["total"]), S),
        lambda r: group_out(rounds[r]),
        2,
        S,
        1,
        rank=0,
        world=1,
        device="cpu",
        advantages_of=mean,
    )
    assert counts == dict(groups_sampled=4, groups_kept=1, refill_rounds=1)
    assert trains.view(-1, S)[:, 0].tolist() == [0, 0, 1, 0]


def test_the_refill_problems_are_the_steps_and_the_rounds_alone():
    rows = [{"id": i} for i in range(50)]
    drawn = refill_problems(rows, 3, 1, 0, 1, 8, seed=0)[1]
    assert drawn == refill_problems(rows, 3, 1, 0, 1, 8, seed=0)[1]  # the same every time
    assert drawn != refill_problems(rows, 3, 2, 0, 1, 8, seed=0)[1]  # another round: others
    halves = [refill_problems(rows, 3, 1, r, 2, 8, seed=0)[1] for r in range(2)]
    assert halves[0] + halves[1] == drawn  # each rank its part of the one draw


def recorded_run(tmp_path, name, monkeypatch, *flags):
    """A short demo run, recording the problems of every training rollout call in order."""
    calls, rollout = [], chat_rl.rollout

    def recording(engine, task, problems, *args, progress="", **kwargs):
        if not progress:  # the training rollouts (the evals show a progress bar)
            calls.append([task.prompt(p) for p in problems])
        return rollout(engine, task, problems, *args, progress=progress, **kwargs)

    monkeypatch.setattr(chat_rl, "rollout", recording)
    out = tmp_path / name
    argv = ["--preset=demo", f"--out-dir={out}", "--num-steps=3", "--eval-every=-1"]
    argv += ["--examples-per-step=4", f"--num-samples={S}", "--max-new-tokens=40", *flags]
    assert chat_rl.main(argv) == 0
    monkeypatch.setattr(chat_rl, "rollout", rollout)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return rows, calls


def test_the_epochs_order_is_the_same_however_many_rounds_ran(tmp_path, monkeypatch):
    plain, plain_calls = recorded_run(tmp_path, "plain", monkeypatch)
    refilled, calls = recorded_run(tmp_path, "refill", monkeypatch, "--refill=4")
    rounds = [row["refill_rounds"] for row in refilled]
    assert sum(rounds) > 0  # some step refilled (2 samples: a group is unanimous half the time)
    # each step's first round: the step's own problems, as without --refill
    firsts = [sum(rounds[:step]) + step for step in range(3)]
    assert [calls[i] for i in firsts] == plain_calls
    for row in refilled:
        assert row["groups_sampled"] == 4 * (1 + row["refill_rounds"])
        assert row["groups_kept"] <= 4 and len(row["refill_problems"]) == row["refill_rounds"]
        assert row["groups_kept"] == 4 or row["refill_rounds"] == 4
    assert "groups_kept" not in plain[0]


def test_a_refilled_run_resumes_bit_for_bit(tmp_path):
    flags = ["--refill=3", "--num-samples=2"]
    whole = tmp_path / "whole"
    args = test_resume.args(test_resume.REPO + "/demo_model", whole) + flags
    assert test_resume.launch(args).returncode == 0
    train = [r for r in test_resume.metrics(whole) if "split" not in r]
    assert any(r["refill_rounds"] for r in train)
    out = tmp_path / "run"
    args = test_resume.args(test_resume.REPO + "/demo_model", out) + flags
    assert test_resume.launch(args, "metrics", 2).returncode == -9
    resumed = test_resume.launch(args + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert test_resume.metrics(out) == test_resume.metrics(whole)
    weights = test_resume.final_weights(whole)
    assert all(torch.equal(test_resume.final_weights(out)[k], v) for k, v in weights.items())


@pytest.mark.parametrize("refill", ["--refill=3"])
def test_two_ranks_refill_and_learn_what_one_process_does(tmp_path, refill):
    flags = ["--preset=demo", "--device-type=cpu", "--num-steps=2", "--eval-every=-1"]
    flags += ["--examples-per-step=4", f"--num-samples={S}", "--max-new-tokens=40", refill]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "chat_rl", *flags, f"--out-dir={tmp_path / 'two'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert chat_rl.main([*flags, f"--out-dir={tmp_path / 'one'}"]) == 0
    two, one = (
        [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        for name in ("two", "one")
    )
    assert any(r["refill_rounds"] for r in one)
    for a, b in zip(one, two):
        for key in ("groups_sampled", "groups_kept", "refill_rounds", "refill_problems", "reward"):
            assert a[key] == b[key], (a["step"], key)
        assert a["kept_tokens"] == b["kept_tokens"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    start = load_file(os.path.join(REPO, "demo_model", "model.safetensors"))
    w1, w2 = (
        load_file(tmp_path / name / "step_000002" / "model.safetensors") for name in ("one", "two")
    )
    for k in w1:
        apart, moved = (w1[k] - w2[k]).abs(), (w1[k] - start[k]).abs().max()
        assert apart.max() <= 0.05 * moved + 1e-7 and (apart > 1e-6).float().mean() < 1e-3, k
