r"""
Math-Verify's equivalence check, run where model text can do no harm: tasks/mathtask.py's layer 3.

mathtask.py holds the grading rules (which box binds, what normalisation forgives, what a list
is); this module holds none. It answers one question, equal(pred, ref) for two answers mathtask
has already normalised, and its job is to answer it safely: sympy is slow, can run without
bound (10^{10^{10}}, 1000000!) and, used naively, evaluates text as Python. The seam is there
so that a reader changing a rule never has to read process plumbing, and so that the code
which touches untrusted text through sympy is in one file small enough to audit.

How (latex2sympy parses, math_verify.verify compares: algebra (x+1)(x-2) = x^2-x-2,
\sqrt8 = 2\sqrt2, sets in any order, tuples in order, intervals with their brackets, matrices,
equations x=5 vs 5), and the Math-Verify gaps we close here:
- parse() runs sympy's parse_expr (Python eval) on plain-text answers, and latex2sympy turns each
  number token into sympy through sympify (eval again) -> we never call parse(), and we replace
  latex2sympy's number hook with an exact, eval-free one. Model text is never executed.
- floats are compared after rounding to 6 decimals (0.5000001 == 1/2) -> number tokens become
  exact rationals, so no Float ever reaches verify.
- its timeouts use signal.alarm, which fails outside the main thread -> we disable them and run
  sympy in a worker process instead, with a CPU budget inside it (SIGPROF: past it, "not equal"),
  an address-space limit, a refusal to evaluate anything whose exact value would need more than
  MAX_DIGITS digits (10^{10^{10}}, 1000000!), and, outside it, a deadline: a worker still silent
  after DEADLINE_S that has burnt its budget is stuck in C code and is killed and replaced.
  So equal() is bounded in time and memory from any thread, and the training process itself
  never imports sympy: only the worker does, and it loads this file alone, not mathtask.
"""

import atexit
import json
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
from fractions import Fraction
from functools import lru_cache

MAX_DIGITS = 10_000  # refuse to evaluate anything whose exact value has more digits than this


def equal(p, r):
    """Math-Verify's verdict on two normalised answers: bounded in time and memory, and safe
    from any thread."""
    return _ask_worker(p, r) if USE_WORKER else sympy_equal(p, r)


# ---------------------------------------------------------------------------------------------
# The comparison itself: latex2sympy + math_verify, inside the worker (or inline in tests).
_NUMBER_TOKEN = re.compile(r"([0-9]*)(?:\.([0-9]*))?(?:[eE]([-+]?[0-9]{1,3}))?")


def _exact_number(text):
    """A number token as an exact sympy Rational, with no sympify (eval) and no floats."""
    import sympy

    m = _NUMBER_TOKEN.fullmatch(text.replace(",", "").strip())
    if not m or not (m.group(1) or m.group(2)) or len(text) > 100:
        raise ValueError("not a number token")
    frac = m.group(2) or ""
    q = Fraction(int((m.group(1) or "0") + frac), 10 ** len(frac)) * Fraction(10) ** int(
        m.group(3) or 0
    )
    return sympy.Rational(q.numerator, q.denominator)


@lru_cache(maxsize=1)
def _sympy_tools():
    import logging

    from latex2sympy2_extended import latex2sympy2 as l2s
    from latex2sympy2_extended.math_normalization import NormalizationConfig, normalize_latex
    from math_verify.grader import should_treat_as_complex, verify

    # it warns that we disabled its timeouts
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    l2s._Latex2Sympy.parse_number = lambda self, text: _exact_number(text)
    l2s.convert_number = _exact_number
    config = NormalizationConfig(
        basic_latex=True,
        units=True,
        malformed_operators=True,
        nits=True,
        boxed="none",
        equations=False,
    )

    def parse(s):
        s = normalize_latex(s, config)
        return l2s.latex2sympy(
            s,
            is_real=not should_treat_as_complex(s),
            convert_degrees=False,
            normalization_config=None,
        )

    return parse, verify


def _digits(e, budget):
    """Upper bound on log10 of any number sympy could compute from e; inf means refuse."""
    import sympy

    budget[0] -= 1
    if budget[0] < 0:
        return math.inf
    if isinstance(e, sympy.Rational):
        return math.log10(max(abs(e.p), e.q) + 1)
    if isinstance(e, (sympy.Sum, sympy.Product, sympy.Integral, sympy.Limit, sympy.Derivative)):
        return math.inf  # an answer is a value, not a problem to evaluate
    args = list(e) if isinstance(e, sympy.MatrixBase) else getattr(e, "args", ())
    if isinstance(e, (sympy.Pow, sympy.factorial, sympy.binomial)):
        power = isinstance(e, sympy.Pow)
        # the exponent, or n in n! and C(n, k)
        top = _size(args[1], budget) if power else _digits(args[0], budget)
        if top > 6:
            return math.inf
        base = _digits(args[0], budget) if power else top
        return 10**top * max(base, 1)  # |b^n| <= |b|^|n|, n! <= n^n, C(n, k) <= 2^n
    return 1 + sum(_digits(a, budget) for a in args)


def _size(e, budget):
    r"""Upper bound on log10(|e| + 1), for an exponent: b^e has about |e| times the digits of b, so
    what counts is e's value, not the digits it is written with. 13^{1/2} is no bigger than 13, and
    10^{(\sqrt{13}-5)/6} is below 10; bounding such exponents by their digits, as _digits does for
    the numbers themselves, refused them as if they were huge."""
    import sympy

    budget[0] -= 1
    if budget[0] < 0:
        return math.inf
    if isinstance(e, sympy.Rational):
        return math.log10(abs(e.p) / e.q + 1)
    base, exponent = e.args if isinstance(e, sympy.Pow) else (None, None)
    if base is not None and base.is_Integer and base != 0 and exponent.is_Rational and exponent < 0:
        # \frac{a}{6} parses as a * 6^{-1}: at most 1, though computing it still costs its digits
        return math.log10(2) if _digits(e, budget) <= MAX_DIGITS else math.inf
    if isinstance(e, sympy.Add):  # |a + b| + 1 <= 2 max(|a| + 1, |b| + 1)
        return max(_size(a, budget) for a in e.args) + math.log10(len(e.args))
    if isinstance(e, sympy.Mul):  # |ab| + 1 <= (|a| + 1)(|b| + 1)
        return sum(_size(a, budget) for a in e.args)
    return _digits(e, budget)  # anything else: bounded by the digits it could produce


def sympy_equal(p, r):
    """Math-Verify's verdict on two normalised answers; False on any error or oversized value."""
    try:
        parse, verify = _sympy_tools()
        gold, pred = parse(r), parse(p)
        if max(_digits(gold, [2000]), _digits(pred, [2000])) > MAX_DIGITS:
            return False
        return bool(verify(gold, pred, numeric_precision=50, timeout_seconds=None, strict=True))
    except Exception:
        return False


# ---------------------------------------------------------------------------------------------
# The worker: a child python that answers one JSON line [pred, ref] with "1" or "0".
USE_WORKER = True  # tests switch it off to run sympy in-process
CPU_BUDGET_S = 0.4  # inside the worker: CPU seconds one comparison may use, then it is "not equal"
DEADLINE_S = 0.9  # outside: a worker this late that has burnt its budget is stuck in C code
STARVED_S = 10.0  # a worker merely starved of CPU by other work gets this long before we give up
MEMORY_BYTES = 2 << 30
_worker = {"proc": None, "pid": None, "ready": False, "broken": False}
_lock = threading.Lock()


class _OverBudget(BaseException):  # BaseException: sympy's "except Exception" must not swallow it
    pass


def _serve():
    import resource
    import signal

    _, hard = resource.getrlimit(resource.RLIMIT_AS)  # lower the soft limit only, never raise it
    soft = MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(MEMORY_BYTES, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    armed = [False]

    def over_budget(*_):
        if armed[0]:
            raise _OverBudget()

    # CPU time, not wall time: verdicts do not depend on load
    signal.signal(signal.SIGPROF, over_budget)
    sympy_equal(r"\frac{x^2-1}{x+1}", "x-1")  # pay imports and caches before the first budget
    os.write(1, b"ready\n")
    for line in sys.stdin.buffer:
        ok = False
        try:
            armed[0] = True
            signal.setitimer(signal.ITIMER_PROF, CPU_BUDGET_S)
            ok = sympy_equal(*json.loads(line))
            armed[0] = False
        except BaseException:
            armed[0] = ok = False
        signal.setitimer(signal.ITIMER_PROF, 0)
        os.write(1, b"1\n" if ok else b"0\n")


def _read_line(fd, deadline):
    """One line from the worker, None if it is not there by deadline; OSError if the worker died."""
    buf = b""
    while not buf.endswith(b"\n"):
        if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            return None
        chunk = os.read(fd, 64)
        if not chunk:
            raise OSError("the sympy worker exited")
        buf += chunk
    return buf.strip()


def _cpu_seconds(pid):
    """CPU seconds a process has used (Linux /proc), None where that cannot be read."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _kill_worker():
    proc, _worker["proc"] = _worker["proc"], None
    if proc is not None and _worker["pid"] == os.getpid():  # never kill a parent process's worker
        proc.kill()
        proc.wait()


def _start_worker():
    # the worker loads this file by path, not as tasks.math_sandbox, so it starts from any cwd
    boot = (
        "import importlib.util as u, sys; "
        "s = u.spec_from_file_location('_math_sandbox_worker', sys.argv[1]); "
        "m = u.module_from_spec(s); s.loader.exec_module(m); m._serve()"
    )
    _worker.update(
        proc=subprocess.Popen(
            [sys.executable, "-c", boot, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
        ),
        pid=os.getpid(),
        ready=False,
    )


def _ask_worker(p, r):
    with _lock:
        try:
            if _worker["pid"] != os.getpid():  # first call, or we are a forked child
                _worker["proc"] = None
                _start_worker()
            proc = _worker["proc"]
            fd = proc.stdout.fileno()
            if not _worker["ready"]:  # start-up (imports) has its own, generous deadline
                _worker["ready"] = _read_line(fd, time.monotonic() + 60) == b"ready"
                if not _worker["ready"]:
                    raise OSError("the sympy worker did not start")
            proc.stdin.write(json.dumps([p, r]).encode() + b"\n")
            cpu0, t0 = _cpu_seconds(proc.pid), time.monotonic()
            while True:
                answer = _read_line(fd, time.monotonic() + DEADLINE_S)
                if answer is not None:
                    return answer == b"1"
                cpu = _cpu_seconds(proc.pid)  # late: stuck in C code, or only starved of CPU?
                if (
                    cpu is None
                    or cpu0 is None
                    or cpu - cpu0 > CPU_BUDGET_S + 0.1
                    or time.monotonic() - t0 > STARVED_S
                ):
                    break
        except (OSError, ValueError) as e:
            if not _worker["broken"]:
                print(
                    f"math_sandbox: sympy worker failed ({e}); such answers score 0",
                    file=sys.stderr,
                )
                _worker["broken"] = True
        _kill_worker()  # stuck or dead: start a fresh one now so it is ready for the next call
        _start_worker()
        return False


atexit.register(lambda: _worker["proc"] is not None and _kill_worker())
