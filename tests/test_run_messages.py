"""What a user reads while a run goes: the step numbers of the console and of metrics.jsonl agree, a
resumed run shows its last eval instead of nan, a run without evals shows no pass@1, each checkpoint
written is announced, and the last line says how to go on."""

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

import chat_rl
from plumbing import checkpoint, evaluation, flags
from plumbing.metrics import Eta, MetricsLog, console_line, stop_line
from policy.gpt import GPT, GPTConfig
from policy.tokenizer import ByteTokenizer

TINY = dict(
    vocab_size=264,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def test_the_console_counts_steps_as_metrics_jsonl_does():
    row = dict(
        step=0, reward=0.5, loss=-0.02, seq_len=30, rollout_tokens_per_s=1000, step_time_s=1.0
    )
    assert console_line(row, 300, 0.448, 60).startswith(
        "step 0/300 | reward 0.500 | pass@1 0.448 |"
    )


def test_a_resumed_log_remembers_its_last_eval(tmp_path):
    rows = [
        {"step": 0, "split": "eval", "pass@1": 0.4},
        {"step": 0, "reward": 0.5},
        {"step": 1, "reward": 0.6},
        {"step": 2, "split": "eval", "pass@1": 0.55},
        {"step": 2, "reward": 0.7},
        {"step": 4, "split": "eval", "pass@1": 0.9},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = MetricsLog(str(tmp_path), rank=0, keep_below_step=3)  # resumed from step_000003
    assert (
        log.last_eval["pass@1"] == 0.55
    )  # the eval of step 4 came after the checkpoint: it is redone
    log.close()
    assert MetricsLog(str(tmp_path / "fresh"), rank=0).last_eval == {}


def test_each_checkpoint_written_is_announced(tmp_path, capsys):
    model = GPT(GPTConfig(**TINY))
    cfg = flags.parse_config(
        ["--preset=demo", f"--out-dir={tmp_path}"], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS
    )
    checkpoint.save(
        cfg, 7, model, ByteTokenizer(), torch.optim.AdamW(model.parameters()), rank=0, world=1
    )
    assert capsys.readouterr().out == f"checkpoint: wrote {tmp_path}/step_000007\n"


def test_the_console_shows_no_pass_at_1_before_any_eval():
    row = dict(
        step=3, reward=0.5, loss=-0.02, seq_len=30, rollout_tokens_per_s=1000, step_time_s=1.0
    )
    line = console_line(row, 300, math.nan, 60)  # --eval-every=-1: there is never an eval
    assert (
        line.startswith("step 3/300 | reward 0.500 | loss ")
        and "pass@1" not in line
        and "nan" not in line
    )


def test_a_step_without_signal_says_it_took_no_update():
    row = dict(step=3, reward=0.0, loss=0.0, seq_len=30, rollout_tokens_per_s=1000, step_time_s=1.0)
    assert "no update: no group with signal" in console_line({**row, "kept_tokens": 0}, 9, 0.5, 60)
    assert "no update" not in console_line({**row, "kept_tokens": 120}, 9, 0.5, 60)


def test_a_stopped_run_says_how_to_continue_it():
    lines = stop_line(15, 40, 0.2, "out/demo").splitlines()
    assert lines == [
        "stopped at step 15/40 after 0.2 min; checkpoint in out/demo/step_000015",
        "to continue: the same command, with all its flags, plus --resume",
    ]


def test_a_finished_run_says_how_to_train_on_from_it():
    lines = stop_line(40, 40, 3.7, "out/demo").splitlines()
    assert lines[0] == "done at step 40/40 after 3.7 min; checkpoint in out/demo/step_000040"
    # "the same command": the flags that made the run (--preset=demo among them) make the next too
    assert lines[1].startswith(
        "to train on: the same command with --model=out/demo/step_000040 and a new --out-dir"
    )


def test_a_run_ends_with_its_stop_line(tmp_path, capsys):
    model_dir = str(tmp_path / "model")
    GPT(GPTConfig(**TINY)).init_weights(0).save_pretrained(model_dir)
    ByteTokenizer().save_pretrained(model_dir)
    out_dir = tmp_path / "run"
    assert (
        chat_rl.main(
            [
                "--preset=demo",
                f"--model={model_dir}",
                f"--out-dir={out_dir}",
                "--num-steps=1",
                "--examples-per-step=2",
                "--num-samples=2",
                "--max-new-tokens=4",
                "--eval-every=-1",
            ]
        )
        == 0
    )
    done, how = capsys.readouterr().out.splitlines()[-2:]
    assert done.startswith("done at step 1/1 after ") and done.endswith(
        f"min; checkpoint in {out_dir}/step_000001"
    )
    assert how == stop_line(1, 1, 0.0, str(out_dir)).splitlines()[1]


def test_help_piped_into_head_ends_quietly():
    # `--help | head -1` closes the pipe early: the reader got what it wanted, so no BrokenPipeError
    # traceback. Here the pipe is closed before the help is written (startup takes a second), so
    # every write meets it closed.
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "chat_rl", "--help"],
        cwd=repo,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 0 and stderr == "", stderr


def test_resume_with_nothing_to_resume_says_it_starts_from_step_0(tmp_path, capsys):
    # --resume into an empty (or mistyped) out dir starts fresh, as a preemption script needs,
    # but not silently
    model_dir = str(tmp_path / "model")
    GPT(GPTConfig(**TINY)).init_weights(0).save_pretrained(model_dir)
    ByteTokenizer().save_pretrained(model_dir)
    argv = [
        "--preset=demo",
        f"--model={model_dir}",
        "--num-steps=1",
        "--examples-per-step=2",
        "--num-samples=2",
        "--max-new-tokens=4",
        "--eval-every=-1",
        "--resume",
    ]
    assert chat_rl.main(argv + [f"--out-dir={tmp_path / 'typo'}"]) == 0
    start = next(
        line
        for line in capsys.readouterr().out.splitlines()
        if not line.startswith("chat_rl: note:")
    )
    assert start.startswith("chat_rl: ") and start.endswith(
        "steps=0->1 out="
        + str(tmp_path / "typo")
        + " (--resume: no checkpoint there yet, so from step 0)"
    )


def test_chat_rl_sets_a_passive_omp_wait_policy_before_torch_loads_unless_the_user_set_one():
    # OpenMP reads OMP_WAIT_POLICY once, when torch loads its library: chat_rl must set it before
    # its first torch import
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    probe = "import sys, chat_rl, os; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    unset = subprocess.run(
        [sys.executable, "-c", probe], cwd=repo, env=env, capture_output=True, text=True
    )
    chosen = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=repo,
        env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
        capture_output=True,
        text=True,
    )
    assert (unset.stdout.strip(), chosen.stdout.strip()) == ("PASSIVE", "ACTIVE"), unset.stderr[
        -1000:
    ]
    # and nothing chat_rl imports before that line loads torch: those lines alone, run in a fresh
    # interpreter, leave torch unloaded (an import of your own above it is fine if it does too)
    source = open(os.path.join(repo, "chat_rl.py")).read()
    before = source[: source.index('os.environ.setdefault("OMP_WAIT_POLICY"')]
    probe = before + "\nimport sys\nprint('torch' in sys.modules)"  # sys loads no torch
    loaded = subprocess.run(
        [sys.executable, "-c", probe], cwd=repo, env=env, capture_output=True, text=True
    )
    assert loaded.stdout.strip() == "False", loaded.stderr[-1000:]


def tiny_model(tmp_path):
    model_dir = str(tmp_path / "model")
    GPT(GPTConfig(**TINY)).init_weights(0).save_pretrained(model_dir)
    ByteTokenizer().save_pretrained(model_dir)
    return model_dir


def test_eval_only_names_the_step_of_the_checkpoint_it_evaluates_or_none(tmp_path, capsys):
    small = [
        "--preset=demo",
        "--examples-per-step=2",
        "--num-samples=2",
        "--max-new-tokens=4",
        "--eval-examples=2",
        "--eval-samples=2",
    ]
    model, run = tiny_model(tmp_path), tmp_path / "run"
    assert (
        chat_rl.main(
            [*small, f"--model={model}", f"--out-dir={run}", "--num-steps=2", "--eval-every=-1"]
        )
        == 0
    )
    for evaluated, step, line in [
        (run / "step_000002", 2, "eval step 2: "),
        (model, 0, "eval (no chat_rl step): "),
    ]:
        capsys.readouterr()
        out_dir = tmp_path / f"eval-{step}"
        argv = [*small, f"--model={evaluated}", "--eval-only", f"--out-dir={out_dir}"]
        assert chat_rl.main(argv) == 0
        assert any(printed.startswith(line) for printed in capsys.readouterr().out.splitlines())
        with open(out_dir / "metrics.jsonl") as f:
            assert [json.loads(row)["step"] for row in f] == [step]


def test_the_first_eta_does_not_spread_a_first_eval_over_each_step(tmp_path, capsys, monkeypatch):
    # a 3 s eval at steps 0 and 20 of 20 steps: after step 0, 19 quick steps and one eval are left
    # (a few seconds); the wall clock since the start would make each step to come 3 s (1 min)
    evaluate = evaluation.evaluate
    monkeypatch.setattr(evaluation, "evaluate", lambda *a, **k: time.sleep(3) or evaluate(*a, **k))
    assert (
        chat_rl.main(
            [
                "--preset=demo",
                f"--model={tiny_model(tmp_path)}",
                "--num-steps=20",
                f"--out-dir={tmp_path / 'run'}",
                "--eval-every=20",
                "--num-samples=2",
                "--examples-per-step=2",
                "--max-new-tokens=4",
                "--eval-examples=2",
                "--eval-samples=2",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    first = next(line for line in lines if line.startswith("step 0/20"))
    assert float(first.split("eta ")[1].split(" min")[0]) < 0.5, first


def test_the_eta_is_the_mean_step_times_the_steps_left_plus_the_last_eval_times_evals_left():
    eta = Eta(num_steps=150, eval_every=50)
    eta.evaluated(20.0)
    assert eta.stepped(0, 1.0) == pytest.approx(149 * 1.0 + 3 * 20.0)  # evals at 50, 100, 150
    assert eta.stepped(1, 3.0) == pytest.approx(148 * 2.0 + 3 * 20.0)
    assert Eta(num_steps=10, eval_every=-1).stepped(4, 2.0) == pytest.approx(5 * 2.0)  # no evals


def test_a_stopped_run_says_where_it_stopped_and_how_to_go_on():
    mid_eval = stop_line(150, 150, 3.0, "out/demo", stopped=True).splitlines()  # its final eval
    assert mid_eval == [
        "stopped at step 150/150 after 3.0 min; checkpoint in out/demo/step_000150",
        "to continue: the same command, with all its flags, plus --resume",
    ]
    first = stop_line(0, 150, 0.5, "out/demo", stopped=True).splitlines()[0]  # no step finished
    assert first == "stopped at step 0/150 after 0.5 min; no step had finished, so no checkpoint"
    eval_only = stop_line(0, 1, 0.5, "out/e", evaluated="m", stopped=True)
    assert eval_only == "stopped after 0.5 min, before the eval of m ended: no row"
