"""
The calculator against GSM8K's own annotations: for every <<expression=result>> in the worked
solutions, does calculator.calculate(expression) give the annotated result (as an exact number,
or within the annotation's printed precision)?

    # GSM8K train + test through `datasets` (downloads once)
    python -m scripts.check_calculator
    # OpenAI's release files (github.com/openai/grade-school-math)
    python -m scripts.check_calculator train.jsonl test.jsonl

Prints the agreement and every annotation it misses.
"""

import argparse
import json
import os
import re
import sys
from fractions import Fraction

from calculator import calculate

ANNOTATION = re.compile(r"<<([^>]*)>>")


def solutions(paths):
    if paths:
        for path in paths:
            with open(path) as f:
                yield from (json.loads(line)["answer"] for line in f if line.strip())
        return
    from tasks import gsm8k

    for split in ("train", "test"):
        yield from (row["answer"] for row in gsm8k.load(split))


def agrees(result, annotated):
    """The tool's text against the annotation's: equal as numbers, or apart by less than one unit
    of the annotation's last printed decimal (GSM8K rounds or cuts repeating decimals)."""
    try:
        got, want = Fraction(result), Fraction(annotated)
    except (ValueError, ZeroDivisionError):
        return False
    places = len(annotated.partition(".")[2])
    return got == want or abs(got - want) < Fraction(1, 10**places)


def main(paths):
    total, misses = 0, []
    for answer in solutions(paths):
        for annotation in ANNOTATION.findall(answer):
            expression, _, annotated = annotation.rpartition("=")
            total += 1
            result = calculate(expression)
            if result is None or not agrees(result, annotated):
                misses.append((annotation, result))
    print(
        f"calculator agrees with {total - len(misses):,} of {total:,} GSM8K annotations "
        f"({(total - len(misses)) / max(total, 1):.3%})"
    )
    for annotation, result in misses:
        print(f"  <<{annotation}>>: calculate gives {result}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("paths", nargs="*", help="GSM8K release files; none: through `datasets`")
    paths = parser.parse_args().paths
    for path in paths:
        if not os.path.isfile(path):
            sys.exit(f"check_calculator: no such file {path!r}")
    try:
        main(paths)
    except RuntimeError as e:
        # GSM8K neither on the hub nor in the cache: one line, and the way round it
        sys.exit(
            f"check_calculator: {str(e).split('; offline?')[0]}; "
            "offline, pass GSM8K's own files instead: "
            "python -m scripts.check_calculator train.jsonl test.jsonl"
        )
