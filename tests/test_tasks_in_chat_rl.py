"""--task=gsm8k and --task=math run end to end through their real loaders, on handwritten rows in
each data set's own schema served by a stand-in `datasets` module (no download)."""

import json
import sys
import types

import pytest

import chat_rl
from policy.gpt import GPT, GPTConfig
from policy.tokenizer import ByteTokenizer
from tasks.common import get_task

GSM8K_ROWS = [
    {
        "question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
        "answer": "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7",
    },
    {
        "question": "A box holds 12 eggs. How many eggs are in 3 boxes?",
        "answer": "12 * 3 = <<12*3=36>>36\n#### 36",
    },
]
MATH_TRAIN_ROW = {
    "problem": "What is $1+1$?",
    "level": "Level 1",
    "type": "Algebra",
    "solution": "We have $1+1=\\boxed{2}$.",
}
MATH500_ROWS = [
    {
        "problem": "Simplify $\\frac{2}{4}$.",
        "solution": "It is $\\boxed{\\frac12}$.",
        "answer": "\\frac{1}{2}",
        "subject": "Prealgebra",
        "level": 1,
        "unique_id": "test/prealgebra/1.json",
    },
    {
        "problem": "What is $2^3$?",
        "solution": "$2^3=\\boxed{8}$.",
        "answer": "8",
        "subject": "Algebra",
        "level": 1,
        "unique_id": "test/algebra/2.json",
    },
]


def fake_load_dataset(name, config=None, split=None):
    if name == "openai/gsm8k":
        assert config == "main" and split in ("train", "test")
        return GSM8K_ROWS
    if name == "HuggingFaceH4/MATH-500":
        return MATH500_ROWS
    if name == "EleutherAI/hendrycks_math":
        assert split == "train", (
            "MATH-500 is drawn from MATH's test split: train on the train split only"
        )
        return [dict(MATH_TRAIN_ROW, type=config)]
    raise AssertionError(f"unexpected data set {name}")


@pytest.mark.parametrize("task", ["gsm8k", "math"])
def test_task_trains_and_evaluates_through_chat_rl(task, tmp_path, monkeypatch):
    monkeypatch.setitem(
        sys.modules, "datasets", types.SimpleNamespace(load_dataset=fake_load_dataset)
    )
    model_dir = tmp_path / "model"
    GPT(
        GPTConfig(
            vocab_size=264,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).init_weights(0).save_pretrained(str(model_dir))
    ByteTokenizer().save_pretrained(str(model_dir))
    out = tmp_path / "run"
    code = chat_rl.main(
        [
            f"--task={task}",
            f"--model={model_dir}",
            f"--out-dir={out}",
            "--device-type=cpu",
            "--num-steps=2",
            "--examples-per-step=2",
            "--num-samples=2",
            "--max-new-tokens=6",
            "--eval-every=1",
            "--eval-samples=2",
            "--format-weight=0.1",
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in rows if "split" not in r]
    evals = [r for r in rows if r.get("split") == "eval"]
    assert [r["step"] for r in train] == [0, 1] and [r["step"] for r in evals] == [0, 1, 2]
    assert all({"reward", "reward_answer", "reward_format", "truncated"} <= set(r) for r in train)
    assert all(
        set(r)
        == {
            "step",
            "split",
            "greedy",
            "pass@1",
            "pass@2",
            "greedy_tool_use",
            "tool_use",
            "tool_calls",
            "tool_errors",
            "seq_len",
            "reward_errors",
            "eval_time_s",
        }
        for r in evals
    )
    assert all(r["reward_errors"] == 0 for r in train + evals)  # the built-in verifiers never raise
    for r in train:
        assert (
            0 <= r["reward_answer"] <= 1
            and 0 <= r["reward_format"] <= 1
            and 0 <= r["truncated"] <= 1
        )
        assert r["reward"] == pytest.approx(r["reward_answer"] + 0.1 * r["reward_format"])
        assert 0 < r["seq_len"] <= 6  # the budget, a stop token included
    for r in evals:
        assert 0 <= r["pass@1"] <= r["pass@2"] <= 1 and 0 <= r["greedy"] <= 1
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    references = {"gsm8k": {"7", "36"}, "math": {"\\frac{1}{2}", "8"}}[task]
    assert samples and {s["reference"] for s in samples} <= references
    # each eval sample's reward is the task's verdict on its completion
    # (evals score the answer alone)
    assert all(
        s["reward"] == float(get_task(task).grade(s["completion"], s["reference"])) for s in samples
    )
