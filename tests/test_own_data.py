"""Your own rows and reward without editing code: --data files (JSONL, Parquet, CSV, a folder, a
hub data set from a local cache), the generic task's columns and --reward, a task from a module or
a file, resume on other rows. The rows are written here: arithmetic word problems in a schema that
is not GSM8K's (q, sol as an int, level)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file

import chat_rl
from plumbing import checkpoint
from plumbing.data import problems_for_step
from tasks import arith, generic
from tasks.common import get_task, rewards

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEVELS = ["easy", "medium", "easy", "hard"]


def own_rows(split, n):
    """arith's problems as a user's file might hold them: another schema, the answer an int,
    a metadata column."""
    return [
        {"q": r["question"], "sol": int(r["answer"].rsplit("#### ", 1)[1]), "level": LEVELS[i % 4]}
        for i, r in enumerate(arith.load(split, limit=n))
    ]


TRAIN, TEST = own_rows("train", 8), own_rows("test", 4)
SMALL = [
    "--preset=demo",
    "--device-type=cpu",
    "--num-steps=2",
    "--examples-per-step=2",
    "--num-samples=4",
    "--max-new-tokens=48",
    "--eval-every=2",
    "--eval-examples=4",
    "--eval-samples=2",
]
OWN = ["--prompt-column=q", "--answer-column=sol"]


def write(path, rows):
    """rows to a .jsonl, .parquet or .csv file, by the name's extension
    (the writers are datasets' own)."""
    from datasets import Dataset

    os.makedirs(os.path.dirname(path), exist_ok=True)
    if path.endswith(".jsonl"):
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    elif path.endswith(".parquet"):
        Dataset.from_list(rows).to_parquet(path)
    else:
        Dataset.from_list(rows).to_csv(path, index=False)
    return path


def run(tmp_path, *flags, name="run"):
    out = tmp_path / name
    return chat_rl.main([*SMALL, f"--out-dir={out}", *flags]), out


def metrics(out):
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [r for r in rows if "split" not in r], [r for r in rows if r.get("split") == "eval"]


@pytest.mark.parametrize("extension", ["jsonl", "parquet", "csv"])
def test_a_users_file_in_any_format_trains_and_evaluates(extension, tmp_path):
    train = write(str(tmp_path / f"data/train.{extension}"), TRAIN)
    test = write(str(tmp_path / f"data/test.{extension}"), TEST)
    code, out = run(
        tmp_path, f"--data={train}", f"--eval-data={test}", *OWN
    )  # --data alone selects --task=data
    assert code == 0
    train_rows, eval_rows = metrics(out)
    assert [r["step"] for r in train_rows] == [0, 1] and [r["step"] for r in eval_rows] == [0, 2]
    assert all(r["reward_errors"] == 0 and 0 <= r["reward"] <= 1 for r in train_rows)
    assert 0 < eval_rows[0]["pass@2"] and all(
        r["reward_errors"] == 0 for r in eval_rows
    )  # the demo model gets some right
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    # the prompts are the q column, the references the sol column read as GSM8K's verifier reads a
    # bare number
    assert [s["question"] for s in samples[:3]] == [r["q"] for r in TEST[:3]]
    assert [s["reference"] for s in samples[:3]] == [str(r["sol"]) for r in TEST[:3]]
    assert all(
        s["reward"] == float(get_task("gsm8k").grade(s["completion"], s["reference"]))
        for s in samples
    )


def test_a_folder_gives_its_splits_by_file_name(tmp_path):
    write(str(tmp_path / "data/train.jsonl"), TRAIN)
    write(str(tmp_path / "data/test.jsonl"), TEST)
    code, out = run(tmp_path, f"--data={tmp_path / 'data'}", *OWN)
    assert code == 0
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert [s["question"] for s in samples[:3]] == [r["q"] for r in TEST[:3]]


REWARD_SEEING_ROWS = """
import json
def reward(completion, row):
    with open({log!r}, "a") as f:
        f.write(json.dumps(row) + "\\n")
    return 1.0 if str(row["sol"]) in completion else 0.0
"""


def test_a_reward_function_receives_the_whole_row(tmp_path):
    train, test = (
        write(str(tmp_path / "train.jsonl"), TRAIN),
        write(str(tmp_path / "test.jsonl"), TEST),
    )
    log = tmp_path / "rows.jsonl"
    (tmp_path / "my_reward.py").write_text(REWARD_SEEING_ROWS.format(log=str(log)))
    code, out = run(
        tmp_path,
        f"--data={train}",
        f"--eval-data={test}",
        *OWN,
        f"--reward={tmp_path / 'my_reward.py'}:reward",
    )
    assert code == 0
    seen = [json.loads(line) for line in open(log)]
    # every completion's reward saw its row, every column of it:
    # 2 evals x 4 problems x (2 samples + greedy), 2 steps x 2 x 4
    assert len(seen) == 2 * 4 * 3 + 2 * 2 * 4
    assert all(row in TRAIN + TEST for row in seen) and {row["level"] for row in seen} == {
        "easy",
        "medium",
        "hard",
    }


FLAKY_REWARD = """
def reward(completion, row):
    if row["level"] == "hard":
        raise KeyError("no such thing")
    if row["level"] == "medium":
        return float("nan")
    return 1.0 if "####" in completion else 0.0
"""


def test_rewards_that_raise_or_return_nan_score_zero_and_are_counted(tmp_path):
    (tmp_path / "r.py").write_text(FLAKY_REWARD)
    task = generic.make(
        prompt_column="q", answer_column="sol", reward=str(tmp_path / "r.py") + ":reward"
    )
    assert rewards(task, "#### 3", "3", row=TRAIN[0]) == {
        "answer": 1.0,
        "format": 1.0,
        "total": 1.0,
    }
    columns = "(the row's columns: q, sol, level)"
    error = f"KeyError at {tmp_path / 'r.py'}:4 in reward: 'no such thing' {columns}"
    assert rewards(task, "#### 3", "3", row=TRAIN[3]) == {
        "answer": 0.0,
        "format": 0.0,
        "total": 0.0,
        "error": error,
    }
    assert (
        rewards(task, "#### 3", "3", row=TRAIN[1])["error"]
        == "ValueError: the reward returned nan, not a finite number"
    )
    train, test = (
        write(str(tmp_path / "train.jsonl"), TRAIN),
        write(str(tmp_path / "test.jsonl"), TEST),
    )
    code, out = run(
        tmp_path,
        f"--data={train}",
        f"--eval-data={test}",
        *OWN,
        f"--reward={tmp_path / 'r.py'}:reward",
        "--examples-per-step=4",
    )
    assert code == 0
    train_rows, eval_rows = metrics(out)
    for row in (
        train_rows
    ):  # each step's problems as the run drew them: hard and medium ones err on all 4 samples
        problems = problems_for_step(TRAIN, row["step"], 0, 1, 4, 0)
        assert row["reward_errors"] == 4 * sum(p["level"] in ("hard", "medium") for p in problems)
    assert [r["reward_errors"] for r in eval_rows] == [
        (2 + 1) * 2
    ] * 2  # TEST has one hard and one medium row


def test_a_reward_that_fails_on_every_completion_stops_in_one_line(tmp_path, capsys):
    (tmp_path / "r.py").write_text(
        "def reward(completion, row):\n    return row['no_such_column']\n"
    )
    train, test = (
        write(str(tmp_path / "train.jsonl"), TRAIN),
        write(str(tmp_path / "test.jsonl"), TEST),
    )
    code, out = run(
        tmp_path,
        f"--data={train}",
        f"--eval-data={test}",
        *OWN,
        f"--reward={tmp_path / 'r.py'}:reward",
        "--eval-every=-1",
    )
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        (
            "chat_rl: error: step 0: the reward failed on every completion; the first: "
            f"KeyError at {tmp_path / 'r.py'}:2 in reward: 'no_such_column' "
            "(the row's columns: q, sol, level)"
        )
    ]
    assert not any(
        name.startswith("step_") for name in os.listdir(out)
    )  # nothing trained: no checkpoint to keep


MY_TASK = '''
"""A user's task: arith's problems, the answer read from a 'Final:' line."""
import re
from tasks import arith


def load(split, limit=None):
    return arith.load(split, limit=limit or 8)


def prompt(row):
    return row["question"]


def reference(row):
    return row["answer"].rsplit("#### ", 1)[1]


def extract_answer(completion):
    numbers = re.findall(r"-?[0-9]+", completion)
    return numbers[-1] if numbers else None


def grade(completion, reference):
    return extract_answer(completion) == reference


def format_ok(completion):
    return extract_answer(completion) is not None
'''


@pytest.mark.parametrize("how", ["file", "module"])
def test_a_task_from_a_file_or_a_module_trains(how, tmp_path, monkeypatch):
    package = tmp_path / "my_tasks"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "numbers_task.py").write_text(MY_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    task = str(package / "numbers_task.py") if how == "file" else "my_tasks.numbers_task"
    code, out = run(tmp_path, f"--task={task}")
    assert code == 0
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    user_task = get_task(task)  # the same module, imported once: what the run graded with
    assert samples and all(
        s["reward"] == float(user_task.grade(s["completion"], s["reference"])) for s in samples
    )
    assert user_task.__file__ == str(package / "numbers_task.py")


def test_a_task_file_without_grade_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    (tmp_path / "half_task.py").write_text(MY_TASK.replace("def grade(", "def grade_it("))
    monkeypatch.setattr(
        checkpoint,
        "load_policy",
        lambda *a: pytest.fail("the model loaded before the task was checked"),
    )
    code, _ = run(tmp_path, f"--task={tmp_path / 'half_task.py'}")
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"chat_rl: error: task {tmp_path / 'half_task.py'} has no function grade: "
        "a task defines load, prompt, reference, extract_answer, grade, format_ok "
        "(tasks/common.py)"
    )


def test_gsm8k_reads_its_own_jsonl_files_with_no_datasets_cache(tmp_path, monkeypatch):
    from tasks import gsm8k

    monkeypatch.setattr(
        gsm8k, "load", lambda *a, **k: pytest.fail("the hub loader ran though --data was given")
    )
    rows = [
        {"question": r["question"], "answer": r["answer"]} for r in arith.load("train", limit=8)
    ]
    held_out = [
        {"question": r["question"], "answer": r["answer"]} for r in arith.load("test", limit=4)
    ]
    train, test = (
        write(str(tmp_path / "train.jsonl"), rows),
        write(str(tmp_path / "test.jsonl"), held_out),
    )
    code, out = run(tmp_path, "--task=gsm8k", f"--data={train}", f"--eval-data={test}")
    assert code == 0
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert [s["reference"] for s in samples[:3]] == [
        gsm8k.extract_answer(r["answer"]) for r in held_out[:3]
    ]


def test_resume_refuses_other_rows(tmp_path, capsys):
    train, test = (
        write(str(tmp_path / "train.jsonl"), TRAIN),
        write(str(tmp_path / "test.jsonl"), TEST),
    )
    flags = [f"--data={train}", f"--eval-data={test}", *OWN, "--eval-every=-1"]
    assert run(tmp_path, *flags, "--num-steps=4", "--save-every=2")[0] == 0
    shutil.rmtree(tmp_path / "run" / "step_000004")  # back to step 2, as a preempted run would be
    write(train, TRAIN[::-1])  # the same file, other rows (in another order)
    capsys.readouterr()
    assert run(tmp_path, *flags, "--num-steps=4", "--save-every=2", "--resume")[0] == 2
    assert "rows_fingerprint" in capsys.readouterr().err
    other = write(str(tmp_path / "other.jsonl"), TRAIN)
    assert (
        run(
            tmp_path,
            *[f"--data={other}" if f.startswith("--data=") else f for f in flags],
            "--num-steps=4",
            "--save-every=2",
            "--resume",
        )[0]
        == 2
    )
    assert f"data ({train!r} -> {other!r})" in capsys.readouterr().err
    write(train, TRAIN)  # the rows it trained on: it resumes
    assert run(tmp_path, *flags, "--num-steps=4", "--save-every=2", "--resume")[0] == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--data=TRAIN"],
            "is one file, so it holds no held-out rows: name them with --eval-data=<file>",
        ),
        (
            ["--data=TRAIN", "--eval-data=TEST"],
            "row 0 has no column 'question'; its columns: q, sol, level "
            "(--prompt-column and --answer-column name them)",
        ),
        (
            ["--data=TRAIN", "--eval-data=TEST", "--prompt-column=q", "--answer-column=level"],
            "row 0 has no answer the verifier can read",
        ),
        (
            ["--data=TRAIN", "--eval-data=TEST", "--verifier=fuzzy"],
            "unknown --verifier 'fuzzy' (gsm8k | math | exact)",
        ),
        (
            ["--data=TRAIN", "--eval-data=TEST", "--reward=REWARD:rewardd"],
            "has no function rewardd (its functions: reward)",
        ),
        (
            ["--data=TRAIN", "--eval-data=TEST", "--reward=no_such_file.py:reward"],
            "--reward='no_such_file.py:reward': no such file 'no_such_file.py'",
        ),
        (
            ["--task=arith", "--prompt-column=q"],
            "--prompt-column is for --task=data, your own rows",
        ),
        (["--task=data"], "--task=data trains on your own rows: name them with --data="),
        (["--task=nonesuch"], "unknown task 'nonesuch'"),
        (["--data=no/such-data-set"], "could not read 'train' rows of no/such-data-set"),
    ],
)
def test_bad_data_flags_stop_in_one_line(flags, message, tmp_path, capsys):
    files = {
        "TRAIN": write(str(tmp_path / "train.jsonl"), TRAIN),
        "TEST": write(str(tmp_path / "test.jsonl"), TEST),
        "REWARD": os.path.join(REPO, "examples", "reward.py"),
    }
    for key, path in files.items():
        flags = [f.replace(key, path) for f in flags]
    code, _ = run(tmp_path, *flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert code in (1, 2) and len(err) == 1 and message in err[0], err


BUILD_CACHE_AND_TRAIN = """
import json, os, shutil, sys
import datasets
from datasets.packaged_modules.json.json import Json
# what load_dataset('me/own_problems', config) leaves in the cache after a download, built from
# local files: two configurations, "other" (the test rows reversed) written last, which datasets
# would take were none named
for config, order in (("small", 1), ("other", -1)):
    suffix = "" if order > 0 else "_reversed"
    files = {split: os.path.abspath(f"{split}{suffix}.jsonl") for split in ("train", "test")}
    builder = Json(
        cache_dir="build", dataset_name="own_problems", config_name=config, data_files=files
    )
    builder.download_and_prepare()
    cached = os.path.join(
        datasets.config.HF_DATASETS_CACHE, "me___own_problems", config, "0.0.0", "0"
    )
    shutil.copytree(builder.cache_dir, cached)
import chat_rl
sys.exit(chat_rl.main(sys.argv[1:]))
"""


def test_a_hub_data_set_id_reads_the_local_datasets_cache(tmp_path):
    for name, rows in (("train", TRAIN), ("test", TEST)):
        write(str(tmp_path / f"{name}.jsonl"), rows)
        write(str(tmp_path / f"{name}_reversed.jsonl"), rows[::-1])
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONPATH": REPO,
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            BUILD_CACHE_AND_TRAIN,
            *SMALL,
            f"--out-dir={tmp_path / 'run'}",
            "--data=me/own_problems",
            "--data-config=small",
            *OWN,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    samples = [json.loads(line) for line in open(tmp_path / "run" / "samples.jsonl")]
    assert [s["question"] for s in samples[:3]] == [
        r["q"] for r in TEST[:3]
    ]  # the data set's test split


def test_two_ranks_train_a_users_rows_to_the_weights_of_one_process(tmp_path):
    train, test = (
        write(str(tmp_path / "train.jsonl"), TRAIN),
        write(str(tmp_path / "test.jsonl"), TEST),
    )
    (tmp_path / "r.py").write_text(REWARD_SEEING_ROWS.format(log=str(tmp_path / "rows.jsonl")))
    flags = [
        *SMALL,
        "--examples-per-step=4",
        f"--data={train}",
        f"--eval-data={test}",
        *OWN,
        f"--reward={tmp_path / 'r.py'}:reward",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "chat_rl",
            *flags,
            f"--out-dir={tmp_path / 'two'}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert chat_rl.main([*flags, f"--out-dir={tmp_path / 'one'}"]) == 0
    (two_train, two_eval), (one_train, one_eval) = (
        metrics(tmp_path / "two"),
        metrics(tmp_path / "one"),
    )
    # each problem samples from its own stream: the same completions, the same rewards and evals
    # on 1 or 2 ranks
    for two, one in zip(two_train + two_eval, one_train + one_eval):
        for key in {
            "reward",
            "seq_len",
            "tool_use",
            "pass@1",
            "pass@2",
            "greedy",
            "reward_errors",
        } & set(one):
            assert one[key] == pytest.approx(two[key], rel=1e-5), key
    assert any(r["kept_tokens"] > 0 for r in one_train)  # something trained
    one, two = (
        load_file(str(tmp_path / run / "step_000002" / "model.safetensors"))
        for run in ("one", "two")
    )
    start = load_file(os.path.join(REPO, "demo_model", "model.safetensors"))
    for k in one:  # summed in another order: weights a share of one AdamW step apart at most
        apart, moved = (one[k] - two[k]).abs(), (one[k] - start[k]).abs().max()
        assert apart.max() <= 0.05 * moved + 1e-7, k


def test_the_readme_example_runs_as_printed(tmp_path, monkeypatch):
    with open(os.path.join(REPO, "README.md")) as f:
        section = f.read().split("## Your own task", 1)[1].split("\n## ", 1)[0]
    reward_file = section.split("```python\n", 1)[1].split("\n```", 1)[0]
    assert (
        reward_file in open(os.path.join(REPO, "examples", "reward.py")).read()
    )  # the file, as the README shows it
    command = section.split("```bash\n", 1)[1].split("\n```", 1)[0].replace("\\\n", " ").split()
    assert command[:4] == ["python", "-m", "chat_rl", "--preset=demo"]
    monkeypatch.chdir(REPO)  # the README's paths are the repository's
    shorter = [
        "--num-steps=2",
        "--eval-every=2",
        "--eval-examples=4",
        "--examples-per-step=4",
        f"--out-dir={tmp_path / 'run'}",
    ]
    assert chat_rl.main(command[3:] + shorter) == 0  # later flags win: the same run, shorter
    train_rows, eval_rows = metrics(tmp_path / "run")
    assert len(train_rows) == 2 and all(r["reward_errors"] == 0 for r in train_rows + eval_rows)
