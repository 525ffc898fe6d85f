"""chat_rl.main on the demo model for a few steps: the learning rate each update used, and what the
rows of metrics.jsonl hold."""

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

import chat_rl
from scripts.check_step import NUM_SAMPLES as STEP0_SAMPLES, first_step_of_train
from test_rl_math import KINDS, NO_BASELINE  # every kind of advantage by name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR, NUM_STEPS, MAX_NEW_TOKENS, FORMAT_WEIGHT, EVAL_EXAMPLES, EVAL_SAMPLES = 4e-4, 4, 40, 0.5, 4, 4


def run(out_dir, *extra):
    code = chat_rl.main(
        [
            "--preset=demo",
            f"--out-dir={out_dir}",
            f"--num-steps={NUM_STEPS}",
            "--examples-per-step=2",
            "--num-samples=4",
            f"--max-new-tokens={MAX_NEW_TOKENS}",
            "--eval-every=3",
            f"--eval-examples={EVAL_EXAMPLES}",
            f"--eval-samples={EVAL_SAMPLES}",
            "--save-every=1",
            "--keep-checkpoints=10",
            f"--lr={LR}",
            f"--format-weight={FORMAT_WEIGHT}",
            *extra,
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return [r for r in rows if "split" not in r], [r for r in rows if r.get("split") == "eval"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_run")
    train, evals = run(out)
    assert sum(r["kept_tokens"] > 0 for r in train) >= NUM_STEPS - 1, (
        "steps without an update: the checks below would see less"
    )
    return out, train, evals


def test_the_logged_learning_rate_decays_linearly_toward_zero(demo_run):
    _, train, _ = demo_run
    assert [r["step"] for r in train] == list(range(NUM_STEPS))
    assert [r["lr"] for r in train] == pytest.approx(
        [LR * (1 - s / NUM_STEPS) for s in range(NUM_STEPS)], abs=1e-9
    )


def test_each_update_is_taken_at_the_logged_learning_rate(demo_run):
    # the checkpoint after step s holds the optimizer as step s left it
    out, train, _ = demo_run
    for row in train:
        state = torch.load(
            out / f"step_{row['step'] + 1:06d}" / "trainer_state.pt", weights_only=True
        )
        assert [g["lr"] for g in state["optimizer"]["param_groups"]] == pytest.approx(
            [row["lr"]], abs=1e-9
        )


def test_train_rows_hold_their_invariants(demo_run):
    _, train, _ = demo_run
    for r in train:
        assert (
            0 <= r["reward_answer"] <= 1
            and 0 <= r["reward_format"] <= 1
            and 0 <= r["truncated"] <= 1
        )
        assert r["reward"] == pytest.approx(r["reward_answer"] + FORMAT_WEIGHT * r["reward_format"])
        assert 0 < r["seq_len"] <= MAX_NEW_TOKENS
        assert r["skipped_nonfinite"] == 0 and (r["grad_norm"] > 0) == (r["kept_tokens"] > 0)
    assert any(r["reward_format"] > 0 for r in train)  # the format term was there to be weighed


def test_eval_rows_hold_their_invariants(demo_run):
    _, _, evals = demo_run
    assert [r["step"] for r in evals] == [0, 3, 4]  # every 3 steps, and after the last
    for r in evals:
        passes = [r[f"pass@{j}"] for j in range(1, EVAL_SAMPLES + 1)]
        assert (
            0 <= passes[0] and passes == sorted(passes) and passes[-1] <= 1
        )  # pass@1 <= pass@2 <= ... <= pass@k
        assert 0 <= r["greedy"] <= 1
        # counts behind them: right samples of all, problems with a right sample,
        # right greedy answers
        for value, count in [
            (passes[0], EVAL_EXAMPLES * EVAL_SAMPLES),
            (passes[-1], EVAL_EXAMPLES),
            (r["greedy"], EVAL_EXAMPLES),
        ]:
            assert value * count == pytest.approx(round(value * count), abs=1e-3)
    assert any(
        0 < r["pass@1"] < r[f"pass@{EVAL_SAMPLES}"] for r in evals
    )  # values between the bounds: the order was tested


def test_every_key_the_rows_hold_is_in_docs_metrics(demo_run):
    # a key docs/metrics.md names in backticks; pass@2 ... pass@k under its `pass@k`
    with open(os.path.join(REPO, "docs", "metrics.md")) as f:
        spans = re.findall(r"`([^`]+)`", f.read())
    named = {word for span in spans for word in re.findall(r"[\w@]+", span)}
    _, train, evals = demo_run
    keys = {re.sub(r"^pass@\d+$", "pass@k", key) for row in train + evals for key in row}
    assert keys - named == set(), "keys the rows hold that docs/metrics.md does not name"


def test_top_k_1_rollouts_leave_nothing_to_learn(tmp_path):
    # --top-k=1 samples the greedy answer: a group's samples are one answer, every group is
    # unanimous, no update
    train, _ = run(tmp_path, "--top-k=1", "--eval-every=-1", "--num-steps=2")
    assert [r["kept_tokens"] for r in train] == [0, 0]
    start, end = (
        load_file(os.path.join(REPO, "demo_model", "model.safetensors")),
        load_file(tmp_path / "step_000002" / "model.safetensors"),
    )
    assert all(torch.equal(start[k], end[k]) for k in start)


@pytest.fixture(scope="module")
def default_step0(tmp_path_factory):
    return first_step_of_train(tmp_path_factory.mktemp("default_step0"))


@pytest.mark.parametrize(
    "flag", [*(f"--advantage={kind}" for kind in KINDS if kind != "mean"), "--loss-norm=sequence"]
)
def test_the_objective_flags_reach_the_loss(flag, default_step0, tmp_path):
    # step 0 samples the same completions under any objective (same weights, same seeds): only
    # the loss differs. Its groups differ in what a kind of advantage may read: some have signal,
    # and one with signal has replies of different lengths, so a kind weighing by length shows too
    base = default_step0
    rewards = torch.tensor(base["out"]["total"]).view(-1, STEP0_SAMPLES)
    lengths = torch.tensor(base["out"]["tokens"]).view(-1, STEP0_SAMPLES)
    signal = rewards.amax(dim=1) > rewards.amin(dim=1)
    assert signal.any(), "step 0 had nothing to learn: no loss to compare"
    assert (lengths.amax(dim=1) > lengths.amin(dim=1))[signal].any(), "one length a group"
    first = first_step_of_train(tmp_path, flag)
    assert first["out"]["total"] == base["out"]["total"]
    if flag.removeprefix("--advantage=") not in NO_BASELINE:  # those train unanimous groups too
        assert first["row"]["kept_tokens"] == base["row"]["kept_tokens"]
    assert first["loss"] != pytest.approx(base["loss"], rel=1e-3)


def test_adamws_flags_reach_the_optimizer_and_its_defaults_are_the_runs_before_them(
    demo_run, tmp_path
):
    def group(out_dir, step):  # what the checkpoint's AdamW ran with
        state = torch.load(out_dir / f"step_{step:06d}" / "trainer_state.pt", weights_only=True)
        return state["optimizer"]["param_groups"][0]

    default = group(demo_run[0], NUM_STEPS)
    assert tuple(default["betas"]) == (0.9, 0.95) and default["weight_decay"] == 0.0
    run(tmp_path, "--num-steps=1", "--eval-every=-1", "--adam-beta1=0.8", "--adam-beta2=0.99",
        "--weight-decay=0.1")  # fmt: skip
    changed = group(tmp_path, 1)
    assert tuple(changed["betas"]) == (0.8, 0.99) and changed["weight_decay"] == 0.1


def test_the_overlong_buffer_reaches_the_reward_the_advantages_are_taken_from(demo_run, tmp_path):
    # step 0 samples the same completions with the buffer on (same weights, same seeds): only
    # their totals differ, by the penalty. (Not always the loss: a penalty equal across a group,
    # its replies of one length, cancels in r - mean(r), as it does here at seed 0.)
    _, train, _ = demo_run
    assert all("reward_overlong" not in r for r in train)  # off: the row is the default run's
    first = run(tmp_path, f"--overlong-buffer={MAX_NEW_TOKENS // 2}", "--num-steps=1",
                "--eval-every=-1")[0][0]  # fmt: skip
    assert first["seq_len"] == train[0]["seq_len"]
    assert first["reward_answer"] == train[0]["reward_answer"]
    assert first["reward_overlong"] < 0, "no reply reached the buffer: nothing to see"
    assert first["reward"] == pytest.approx(train[0]["reward"] + first["reward_overlong"])
