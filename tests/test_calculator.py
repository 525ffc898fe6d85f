"""The calculator: exact arithmetic over plain numbers, None for anything else, never eval,
always fast."""

import json
import os
import subprocess
import sys
import time
from fractions import Fraction

import pytest

from calculator import calculate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "gsm8k_annotations.txt")


def gsm8k_annotations():
    with open(FIXTURE) as f:
        return [
            line.strip().rpartition("=")[::2]
            for line in f
            if line.strip() and not line.startswith("#")
        ]


def test_reproduces_gsm8k_annotations_except_floor_division():
    for expression, result in gsm8k_annotations():
        if (
            "//" in expression
        ):  # two of GSM8K's 27,998 annotations floor-divide; the tool has / only
            assert calculate(expression) is None
        else:
            assert Fraction(calculate(expression)) == Fraction(result), expression


@pytest.mark.parametrize(
    "expression, text",
    [
        ("48/2", "24"),
        ("2.5*12", "30"),
        ("6*4.0", "24"),
        ("12/60", "0.2"),
        ("1/8", "0.125"),
        ("10/3", "3.3333"),
        ("2/3", "0.6667"),
        ("-10/3", "-3.3333"),
        ("-(2-5)", "3"),
        ("+4", "4"),
        ("1,200*3", "3600"),
        ("1,000,000/4", "250000"),
        ("(1+2)*(3+4)", "21"),
        (" 7 - 10 ", "-3"),
        ("0.1+0.2", "0.3"),
        (".5*4", "2"),
        ("-0.00001", "0"),
        ("1/3-1/3", "0"),
        # exact: in floats these lose their last digits (or pick up 0.30000000000000004-style tails)
        ("123456789012345678901/3*3", "123456789012345678901"),
        ("12345678901234567891*10/10", "12345678901234567891"),
    ],
)
def test_exact_values_print_as_integers_or_short_decimals(expression, text):
    assert calculate(expression) == text


@pytest.mark.parametrize(
    "expression",
    [
        "",
        "   ",
        "x+1",
        "abs(-3)",
        "(1).real",
        "__import__('os').system('true')",
        "'12'",
        "1 < 2",
        "2**10",
        "7//2",
        "7%2",
        "1/0",
        "5/(3-3)",
        "1e3",
        "0x10",
        "1_000",
        "1,20",
        "1,2345",
        "(1,2)",
        "[1]",
        "1;2",
        "1+",
        "\uff11\uff12+1",
        "\u0661+1",
        "\u22123",
        "1\u00d72",
        "a=1",
        "lambda: 1",
        "1 if 1 else 2",
    ],
)
def test_refuses_everything_that_is_not_plain_arithmetic(expression):
    assert calculate(expression) is None


def test_refuses_non_strings():
    assert calculate(None) is None and calculate(12) is None and calculate(b"1+1") is None


@pytest.mark.parametrize(
    "expression",
    [
        "9" * 31,  # a number past MAX_DIGITS
        "*".join(["999999999999"] * 8),  # a product past the result limit
        "(" * 30 + "1" + ")" * 30,  # nesting past MAX_DEPTH
        "-" * 60 + "1",  # a tower of unary minus
        "1+" * 5000 + "1",  # 10,000 characters
        "(" * 10_000,  # a parser-hostile 10,000 characters
        "()" * 5000,
        "__class__.__bases__[0].__subclasses__()",
        "9**9**9**9",
    ],
)
def test_hostile_input_returns_none_within_a_second(expression):
    start = time.perf_counter()
    assert calculate(expression) is None
    assert time.perf_counter() - start < 1.0


def test_deep_but_allowed_nesting_still_evaluates():
    assert calculate("(" * 10 + "2*3" + ")" * 10) == "6"


def test_check_calculator_counts_agreement_over_a_release_file(tmp_path, capsys):
    from scripts.check_calculator import main

    rows = [
        {"question": "q", "answer": "48/2 = <<48/2=24>>24 and <<10/3=3.33>>3.33\n#### 27"},
        {"question": "q", "answer": "<<560//10=56>>56 then <<2*3=7>>7\n#### 7"},
    ]  # floor division, a wrong annotation
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    main([str(path)])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("calculator agrees with 2 of 4 GSM8K annotations")
    assert out[1:] == ["  <<560//10=56>>: calculate gives None", "  <<2*3=7>>: calculate gives 6"]


def test_check_calculator_refuses_a_missing_file_in_one_line(tmp_path):
    # (its --help: tests/test_bad_input.py's test of every script)
    missing = str(tmp_path / "train.jsonl")
    command = [sys.executable, "-m", "scripts.check_calculator", missing]
    refused = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    assert refused.returncode == 1
    assert refused.stderr.splitlines() == [f"check_calculator: no such file {missing!r}"]
