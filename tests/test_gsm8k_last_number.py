"""--gsm8k-answer=last-number: GSM8K graded by the reply's last number, as evaluation harnesses
grade chat models; the default, '####', unchanged; GSM8K's own files read offline with --data.
The rows are handwritten in GSM8K's schema."""

import gzip
import json

import pytest
from hypothesis import given, settings, strategies as st

import chat_rl
from plumbing import flags
from plumbing.data import read_rows
from tasks import gsm8k
from tasks.common import rewards

TRAIN = [
    {
        "question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
        "answer": "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7",
    },
    {
        "question": "A box holds 12 eggs. How many eggs are in 3 boxes?",
        "answer": "12 * 3 = <<12*3=36>>36\n#### 36",
    },
]
TEST = [
    {
        "question": "A shop sells 250 pens a day. How many pens does it sell in 5 days?",
        "answer": "250 * 5 = <<250*5=1250>>1250\n#### 1,250",
    },
    {
        "question": "Ann has 10 dollars and spends 8. How many dollars are left?",
        "answer": "10 - 8 = <<10-8=2>>2\n#### 2",
    },
]


@pytest.mark.parametrize(
    "reply, reference, right",
    [
        ("So the shop sells $1,250.", "1250", True),
        ("The answer is 1250", "1,250", True),
        ("5 days x 250 = **1250** pens", "1250", True),
        ("1250.00", "1250", True),
        ("#### 1250", "1250", True),
        ("10 - 8 = 2", "2", True),
        ("She read pages 12-18", "18", True),  # a hyphen after a digit is no sign: 18, not -18
        ("She owes -$5.", "-5", True),
        ("1250 or 1300", "1250", False),  # the last number binds: no hedge pays
        ("#### 1250\nThat is 1250 pens for 3 shops.", "1250", False),
        ("1,25", "125", False),  # not a thousands group: two numbers, the last 25
        ("It is 12500", "1250", False),
        ("-1250", "1250", False),
        ("one thousand two hundred fifty", "1250", False),  # words are not a number
        ("", "1250", False),
        (None, "1250", False),
        ("9" * 5000, "9" * 5000, False),  # too long to be a number (int() would refuse it)
    ],
)
def test_the_reply_is_graded_by_its_last_number(reply, reference, right):
    assert gsm8k.last_number_grade(reply, reference) is right


def test_the_last_number_is_the_extracted_answer_and_format_asks_it_at_the_end():
    assert gsm8k.last_number_answer("So $1,250.") == "1250"
    assert gsm8k.last_number_answer("half is 0.50") == "0.5"
    assert gsm8k.last_number_answer("no number here") is None
    assert gsm8k.ends_with_number("The answer is **1250**.")
    assert not gsm8k.ends_with_number("1250 pens") and not gsm8k.ends_with_number("none")


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_the_last_number_rule_never_raises_on_any_text(text):
    assert gsm8k.last_number_grade(text, "18") in (True, False)
    assert gsm8k.ends_with_number(text) in (True, False)


def task_for(*argv):
    cfg = flags.parse_config(["--task=gsm8k", *argv], chat_rl.HYPERPARAMETERS, chat_rl.PRESETS)
    flags.check_config(cfg, world_size=1)
    return flags.load_task(cfg)


def test_the_default_keeps_the_hash_rule_and_the_flag_grades_by_the_last_number():
    assert chat_rl.HYPERPARAMETERS["gsm8k_answer"][0] == "hash"
    hash_rule, last_number = task_for(), task_for("--gsm8k-answer=last-number")
    assert hash_rule is gsm8k  # the module itself, its verifier as it was
    reply, row = "5 boxes of 250 pens: 1250 pens.", TEST[0]
    assert rewards(hash_rule, reply, hash_rule.reference(row), row=row)["answer"] == 0.0
    assert rewards(last_number, reply, last_number.reference(row), row=row)["answer"] == 1.0
    # the same rows, prompt and reference: only the rule differs
    assert last_number.prompt(row) == hash_rule.prompt(row)
    assert last_number.reference(row) == hash_rule.reference(row) == "1250"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gsm8k-answer=last"], r"unknown --gsm8k-answer 'last' \(hash \| last-number\)"),
        (["--task=arith", "--gsm8k-answer=last-number"], "--gsm8k-answer is for --task=gsm8k"),
    ],
)
def test_a_bad_answer_rule_is_a_one_line_config_error(argv, message):
    with pytest.raises(flags.ConfigError, match=message):
        task_for(*argv)


def write_jsonl_gz(path, rows):
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def test_gsm8k_own_files_read_offline_jsonl_gz_and_parquet_folders(tmp_path):
    from datasets import Dataset

    # GSM8K's GitHub release: train.jsonl.gz, test.jsonl.gz; the hub's: main/<split>-*.parquet
    gz = write_jsonl_gz(tmp_path / "test.jsonl.gz", TEST)
    assert read_rows(str(gz)) == TEST
    hub = tmp_path / "gsm8k" / "main"
    hub.mkdir(parents=True)
    Dataset.from_list(TRAIN).to_parquet(str(hub / "train-00000-of-00001.parquet"))
    Dataset.from_list(TEST).to_parquet(str(hub / "test-00000-of-00001.parquet"))
    assert read_rows(str(hub), split="train") == TRAIN
    assert read_rows(str(hub), split="test") == TEST


def test_gsm8k_from_a_folder_of_its_own_files_trains_graded_by_the_last_number(
    tmp_path, monkeypatch
):
    graded, rule = [], gsm8k.last_number_grade

    def last_number_grade(completion, reference):  # the rule itself, and a note that it ran
        graded.append(completion)
        return rule(completion, reference)

    monkeypatch.setattr(gsm8k, "last_number_grade", last_number_grade)
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    write_jsonl_gz(folder / "train.jsonl.gz", TRAIN)
    write_jsonl_gz(folder / "test.jsonl.gz", TEST)
    out = tmp_path / "run"
    code = chat_rl.main(
        [
            "--preset=demo",
            "--task=gsm8k",
            f"--data={folder}",
            "--gsm8k-answer=last-number",
            "--num-steps=1",
            "--examples-per-step=2",
            "--num-samples=2",
            "--max-new-tokens=16",
            "--eval-samples=2",
            f"--out-dir={out}",
        ]
    )
    assert code == 0 and graded  # the run's rewards came from the last-number rule
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert [s["reference"] for s in samples] == ["1250", "2"] * (len(samples) // 2)
    assert all(s["reward"] == float(rule(s["completion"], s["reference"])) for s in samples)
