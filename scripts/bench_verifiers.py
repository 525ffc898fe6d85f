"""
Time the verifiers on the worst inputs we can construct:

    python -m scripts.bench_verifiers [--repeat=3]

Prints one row per input: the verdict and the max wall seconds over the repeats (target <= 1 s),
then a row for the MATH sympy worker's start-up (paid once per process, and again after a
worker is killed for running past its deadline). tests/ reuse adversarial_cases() to check
the same inputs are bounded and raise nothing, without timing them.
"""

import argparse
import random
import time

from tasks import gsm8k, mathtask


def adversarial_cases():
    """(name, task module, completion, reference) for inputs built to be slow, huge or hostile."""
    rng = random.Random(0)
    garbage = "".join(
        rng.choice("\\{}^_$#0123456789,.()[] abcxyz+-*/=\n") for _ in range(1_000_000)
    )
    tower = "9^{" * 40 + "9" + "}" * 40
    nest = "{" * 100_000 + "5" + "}" * 100_000
    g, m = gsm8k, mathtask
    return [
        ("gsm8k: megabyte of garbage", g, garbage, "18"),
        ("gsm8k: a million-digit number", g, "#### " + "9" * 1_000_000, "18"),
        ("gsm8k: 250k markers, no number", g, "####" * 250_000, "18"),
        ("gsm8k: marker, a megabyte of blanks", g, "#### " + " " * 1_000_000 + "x", "18"),
        ("gsm8k: 100k nested braces", g, "#### " + nest, "18"),
        ("gsm8k: a million commas", g, "#### 1" + ",000" * 250_000, "18"),
        ("math: megabyte of garbage", m, garbage, "5"),
        (
            "math: garbage inside one box",
            m,
            "\\boxed{" + garbage.replace("{", "(").replace("}", ")") + "}",
            "5",
        ),
        ("math: 100k nested braces in a box", m, "\\boxed{" + nest + "}", "5"),
        ("math: a megabyte of {} in a wrapped box", m, "\\boxed{{" + "{}" * 500_000 + "}}", "5"),
        ("math: 100k unterminated boxes", m, "\\boxed{" * 100_000, "5"),
        ("math: 100k closed boxes", m, "\\boxed{1}" * 100_000, "5"),
        ("math: 100k boxes vs a 3-part reference", m, "\\boxed{1}" * 100_000, "1, 2, 3"),
        # the last box, then the last three: two comparisons, each in budget
        (
            "math: 3 trig soups vs a 3-part reference",
            m,
            "".join(
                f"\\boxed{{\\sin^{{{n}}}(x)\\cos^{{40}}(x)\\tan^{{40}}(x)}}" for n in (40, 41, 42)
            ),
            "\\frac{1}{2}, x, 1",
        ),
        ("math: a million-digit number", m, "\\boxed{" + "9" * 1_000_000 + "}", "5"),
        ("math: 300-digit number vs sqrt", m, "\\boxed{" + "9" * 300 + "}", "\\sqrt{2}"),
        ("math: power tower 9^9^...^9", m, "\\boxed{" + tower + "}", "5"),
        ("math: 10^{10^{10}}", m, "\\boxed{10^{10^{10}}}", "5"),
        ("math: ((10^99)^99)^99", m, "\\boxed{((10^{99})^{99})^{99}}", "5"),
        ("math: 1000000!", m, "\\boxed{1000000!}", "5"),
        ("math: binom(10^6, 5*10^5)", m, "\\boxed{\\binom{1000000}{500000}}", "5"),
        ("math: (x+1)^{1000} vs a quadratic", m, "\\boxed{(x+1)^{1000}}", "x^2-x-2"),
        (
            "math: trig power soup",
            m,
            "\\boxed{\\sin^{40}(x)\\cos^{40}(x)\\tan^{40}(x)}",
            "\\frac{1}{2}",
        ),
        ("math: sum to 10^9", m, "\\boxed{\\sum_{k=1}^{10^{9}} k^k}", "5"),
        (
            "math: 300-char polynomial",
            m,
            "\\boxed{" + "+".join(f"x^{{{i}}}" for i in range(45)) + "}",
            "x",
        ),
        ("math: nested fractions", m, "\\boxed{" + "\\frac{1}{1+" * 30 + "x" + "}" * 30 + "}", "x"),
        ("math: \\frac soup", m, "\\boxed{" + "\\frac{" * 50 + "}" * 50 + "}", "5"),
        ("math: \\sqrt soup", m, "\\boxed{" + "\\sqrt" * 70 + "2}", "2"),
        ("math: ( )_{ } soup", m, "\\boxed{" + "(a)_{b}" * 50 + "}", "5"),
        ("math: 1 + 400 spaces", m, "\\boxed{1" + " " * 390 + "x}", "1"),
        ("math: long comma list", m, "\\boxed{" + ",".join(["1"] * 190) + "}", "1"),
        ("math: long \\text", m, "\\boxed{\\text{" + "a " * 180 + "}}", "\\text{a}"),
        ("math: python payload", m, "\\boxed{__import__('os').system('touch /tmp/pwned')}", "0"),
    ]


def main(repeat=3):
    print(f"{'input':42} {'verdict':>8} {'max s':>8}")
    t0 = time.perf_counter()
    mathtask.grade("\\boxed{x+1}", "1+x")  # start the sympy worker before timing anything
    startup = time.perf_counter() - t0
    worst = 0.0
    for name, task, completion, ref in adversarial_cases():
        times = []
        for _ in range(repeat):
            mathtask._equivalent.cache_clear()  # time the real work, not the cache
            t = time.perf_counter()
            verdict = task.grade(completion, ref)
            times.append(time.perf_counter() - t)
        worst = max(worst, max(times))
        print(f"{name:42} {str(verdict):>8} {max(times):8.3f}")
    print(f"{'(math sympy worker start-up, once)':42} {'':>8} {startup:8.3f}")
    print(f"worst input: {worst:.3f} s (target <= 1 s)")
    return worst


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3, help="timings of each input")
    main(parser.parse_args().repeat)
