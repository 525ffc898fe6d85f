"""
How often the MATH verifier agrees with Math-Verify's own regression cases:
    python -m scripts.check_math_verify_cases [--all]

Math-Verify is the library our equivalence layer builds on, and its test suite pins down, case by
case, what a grader should say about answers that real models wrote. scripts/math_verify_cases.json
holds the boxed ones its tests check with their default options (where they came from and how
they were picked is written at the top of that file; nothing is fetched when this runs). Each is
graded with mathtask.grade(prediction, gold) and compared with the verdict the suite expects.

A disagreement is a false pass (we pay for an answer the suite calls wrong: the costly kind, since
a policy learns to farm it) or a false fail. A false fail our own rules call for, listed in
BY_OUR_RULES with the rule, is reported but accepted. The run prints every disagreement, then the
totals; it exits 1 if there is a false pass or an unaccepted false fail. --all prints every case.
"""

import argparse
import json
import os
import sys

from tasks import mathtask

CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_verify_cases.json")

# (Math-Verify's test file, line) -> the rule of ours that makes grade fail a case its suite passes
BY_OUR_RULES = {
    ("tests/test_all.py", 810): "the last box binds: the right total is only in the text after it",
}


def check(cases, show_all=False):
    """Print one line per disagreement (or per case).

    Returns (agree, false passes, accepted, other fails)."""
    agree, false_pass, accepted, other = 0, [], [], []
    for case in cases:
        verdict = int(mathtask.grade(case["prediction"], case["gold"]))
        where = f"{case['file']}:{case['line']}"
        if verdict == case["expected"]:
            agree += 1
            kind = "agree"
        elif verdict:
            false_pass.append(where)
            kind = "FALSE PASS"
        elif (case["file"], case["line"]) in BY_OUR_RULES:
            accepted.append(where)
            kind = f"false fail, by our rules ({BY_OUR_RULES[case['file'], case['line']]})"
        else:
            other.append(where)
            kind = "FALSE FAIL"
        if show_all or kind != "agree":
            print(f"{where:34} expected {case['expected']} got {verdict}  {kind}")
            if kind != "agree":
                print(
                    f"    gold: {case['gold'][-100:]!r}\n"
                    f"    prediction: {case['prediction'][-160:]!r}"
                )
    return agree, false_pass, accepted, other


def main(show_all=False):
    with open(CASES, encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    agree, false_pass, accepted, other = check(cases, show_all=show_all)
    print(
        f"{agree}/{len(cases)} agree, {len(false_pass)} false passes, "
        f"{len(accepted) + len(other)} false fails ({len(accepted)} by our rules, {len(other)} not)"
    )
    return 1 if false_pass or other else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--all", action="store_true", help="show every case, not only misses")
    sys.exit(main(parser.parse_args().all))
