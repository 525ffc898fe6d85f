"""
No network and no offline env vars: the data loaders fail in seconds with one line that names the
offline demo, instead of datasets' ~24 s of "Retrying in 8s [Retry 5/5]" (HF_*_OFFLINE=1 is tested
in test_bad_input.py). Subprocesses: datasets reads the offline switch when it is first imported.
"""

import os
import socket
import subprocess
import sys
import time

import pytest

from policy.gpt import GPT, GPTConfig
from policy.tokenizer import ByteTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RETRIES_TAKE_S = 24  # what datasets' own retries took before it gave up


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # free once the socket closes: a connection there is refused


def run_without_network(tmp_path, argv):
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    }
    env.update(
        HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}",
        HF_HOME=str(tmp_path / "empty_hf_home"),
        PYTHONPATH=REPO,
        OMP_NUM_THREADS="1",
    )
    start = time.time()
    result = subprocess.run(
        [sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    return result, time.time() - start


def test_gsm8k_without_network_fails_in_seconds_with_one_line(tmp_path):
    model = tmp_path / "model"
    GPT(
        GPTConfig(
            vocab_size=264,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).save_pretrained(str(model))
    ByteTokenizer().save_pretrained(str(model))
    result, seconds = run_without_network(
        tmp_path,
        ["-m", "chat_rl", "--task=gsm8k", f"--model={model}", f"--out-dir={tmp_path / 'run'}"],
    )
    err = result.stderr.strip().splitlines()
    assert result.returncode != 0
    assert len(err) == 1 and err[0].startswith("chat_rl: error: could not load openai/gsm8k"), (
        result.stderr
    )
    assert "python -m chat_rl --preset=demo" in err[0]
    assert seconds < RETRIES_TAKE_S / 2, (
        f"{seconds:.1f} s"
    )  # python, torch and datasets imports included


@pytest.mark.parametrize("split", ["train", "test"])
def test_math_without_network_fails_in_seconds_with_one_line(tmp_path, split):
    code = (
        f"from tasks import mathtask\ntry:\n    mathtask.load({split!r})\n"
        "except RuntimeError as e:\n    print(e)"
    )
    result, seconds = run_without_network(tmp_path, ["-c", code])
    out = result.stdout.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("could not load") and "--preset=demo" in out[0], (
        result.stdout + result.stderr
    )
    assert "Retrying" not in result.stderr
    assert seconds < RETRIES_TAKE_S / 2, f"{seconds:.1f} s"
