"""The README's commands are the ones that run: its quick start is what CI runs;
docs/checkpoints.md's engine snippet runs as pasted."""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme():
    with open(os.path.join(REPO, "README.md")) as f:
        return f.read()


def quick_start():
    """The commands of the quick start's one code block, comments dropped."""
    block = readme().split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    return [
        line.split("#", 1)[0].strip()
        for line in block.splitlines()
        if line.split("#", 1)[0].strip()
    ]


def test_the_quick_start_is_environment_install_demo_plot_tests():
    commands = quick_start()
    assert commands[0] == "python -m venv .venv && source .venv/bin/activate"
    assert commands[1].startswith("pip install torch==")
    assert "--index-url https://download.pytorch.org/whl/cpu" in commands[1]  # the CPU wheel first
    assert commands[2:] == [
        "pip install -r requirements.txt",
        "python -m chat_rl --preset=demo",
        "python -m scripts.plot out/demo",
        "python -m pytest -q tests",
    ]


def test_ci_installs_the_same_torch_and_runs_the_same_test_command():
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    torch_pin = re.search(r"torch==[0-9.]+", quick_start()[1]).group()
    assert any(
        line.startswith("python -m pip install") and torch_pin in line.split() for line in ci
    ), torch_pin
    assert any(
        line.startswith("python -m pip install") and "-r requirements.txt" in line for line in ci
    )
    assert ci[-1] == quick_start()[-1]  # the last thing CI does is the README's test command


def test_the_engine_snippet_runs_as_pasted_on_the_demo_model():
    with open(os.path.join(REPO, "docs", "checkpoints.md")) as f:
        snippet = (
            f.read()
            .split("use chat_rl's engine, from the repository root", 1)[1]
            .split("```python\n", 1)[1]
            .split("\n```", 1)[0]
        )
    code, n = re.subn(r'load_policy\("[^"]*"', 'load_policy("demo_model"', snippet)
    assert n == 1
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("#### 34"), (
        result.stdout
    )  # the demo model's answer to the snippet's problem


def test_the_readme_stays_a_front_door_of_at_most_300_lines():
    """What a user needs to start, choose and trust; the depth lives in docs/, linked from it."""
    lines = readme().count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move the depth into docs/"
