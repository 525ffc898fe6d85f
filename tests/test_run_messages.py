"""What a user reads while a run goes: the step numbers of the console and of metrics.jsonl agree, a
resumed run shows its last eval instead of nan, and each checkpoint written is announced."""

import json

import torch

import chat_rl
import checkpoint
import flags
from gpt import GPT, GPTConfig
from metrics import MetricsLog, console_line
from tokenizer import ByteTokenizer


def test_the_console_counts_steps_as_metrics_jsonl_does():
    row = dict(step=0, reward=0.5, loss=-0.02, seq_len=30, rollout_tokens_per_s=1000, step_time_s=1.0)
    assert console_line(row, 300, 0.448, 60).startswith("step 0/300 | reward 0.500 | pass@1 0.448 |")


def test_a_resumed_log_remembers_its_last_eval(tmp_path):
    rows = [{"step": 0, "split": "eval", "pass@1": 0.4}, {"step": 0, "reward": 0.5}, {"step": 1, "reward": 0.6},
            {"step": 2, "split": "eval", "pass@1": 0.55}, {"step": 2, "reward": 0.7}, {"step": 4, "split": "eval", "pass@1": 0.9}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = MetricsLog(str(tmp_path), rank=0, keep_below_step=3)  # resumed from step_000003
    assert log.last_eval["pass@1"] == 0.55  # the eval of step 4 came after the checkpoint: it is redone
    log.close()
    assert MetricsLog(str(tmp_path / "fresh"), rank=0).last_eval == {}


def test_each_checkpoint_written_is_announced(tmp_path, capsys):
    model = GPT(GPTConfig(vocab_size=264, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1))
    cfg = flags.parse_config(["--preset=demo", f"--out-dir={tmp_path}"], chat_rl.HYPERPARAMETERS)
    checkpoint.save(cfg, 7, model, ByteTokenizer(), torch.optim.AdamW(model.parameters()), rank=0, world=1)
    assert capsys.readouterr().out == f"checkpoint: wrote {tmp_path}/step_000007\n"
