r"""
MATH (Hendrycks et al. 2021): competition problems whose answers are LaTeX, given in \boxed{}.

Train: EleutherAI/hendrycks_math, split "train" of its 7 subject configs (7500 problems).
Test:  HuggingFaceH4/MATH-500, split "test" (500 problems). MATH-500 was drawn from MATH's *test*
       split, so training must only ever see the *train* split or the evaluation is contaminated.
Rows keep their data set's schema: train {problem, level, type, solution}, test {problem,
solution, answer, subject, level, unique_id}.

The verifier, grade(completion, reference), in three layers:
1. Extraction (ours). The answer is the LAST \boxed{...} or \fbox{...}, brace-matched
   (\boxed{\frac{22}{7}} -> \frac{22}{7}; \boxed {5} -> 5). A missing, empty, unterminated or
   nested last box is no answer (score 0): we never fall back to an earlier box, so
   "\boxed{1} ... \boxed{2}" commits to 2 and box-spamming buys nothing.
2. Normalisation and policy (ours, string code only). Unicode (π, √, −, °, ², full-width digits),
   \dfrac -> \frac, \frac12 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}, $ and \left/\right and spacing
   dropped, \text{} units dropped (5\text{ cm} = 5), degrees are a unit (30° = 30^\circ = 30) and
   so is percent (25\% = 25, NOT 0.25: otherwise "25%" would pay for both 25 and 1/4).
   Hedges inside the box are lists, and a list never equals a single answer: "17 \text{ or } 18",
   "17, 18", "\pm 3" all lose against 17 (resp. 3). Plain numbers compare as exact rationals
   (0.5 = \frac12 = 1/2; 0.5000001 != 1/2; 3.1428 != 22/7; 0.333 != 1/3: MATH wants exact answers
   and says so when it wants a decimal). Base-n numerals (2220_4) must match as written.
3. Equivalence (Math-Verify, the field's standard): latex2sympy parses the normalised LaTeX,
   math_verify.verify compares (algebra (x+1)(x-2) = x^2-x-2, \sqrt8 = 2\sqrt2, sets in any
   order, tuples in order, intervals with their brackets, matrices, equations x=5 vs 5).

Math-Verify gaps we work around, and how:
- its extraction misses "\boxed {5}" and falls back to earlier boxes -> our extraction (1).
- no "°", and floats are compared after rounding to 6 decimals, so 0.5000001 == 1/2 -> we
  normalise (2), and decimals are parsed as exact rationals (no Float ever reaches verify).
- parse() runs sympy's parse_expr (Python eval) on plain-text answers, and latex2sympy turns each
  number token into sympy through sympify (eval again) -> we never call parse(), and we replace
  latex2sympy's number hook with an exact, eval-free one. Model text is never executed.
- its timeouts use signal.alarm, which fails outside the main thread -> we disable them and run
  sympy in a worker process instead, with a CPU budget inside it (SIGPROF: past it, "not equal"),
  an address-space limit, a refusal to evaluate anything whose exact value would need more than
  MAX_DIGITS digits (10^{10^{10}}, 1000000!), and, outside it, a deadline: a worker still silent
  after DEADLINE_S that has burnt its budget is stuck in C code and is killed and replaced.
  So grade() is bounded in time and memory from any thread, and the training process itself
  never imports sympy.
"""

import atexit, json, math, os, re, select, subprocess, sys, threading, time, unicodedata
from fractions import Fraction
from functools import lru_cache

TRAIN_DATASET, TRAIN_CONFIGS = "EleutherAI/hendrycks_math", (
    "algebra", "counting_and_probability", "geometry", "intermediate_algebra",
    "number_theory", "prealgebra", "precalculus")
TEST_DATASET = "HuggingFaceH4/MATH-500"

INSTRUCTION = ("Solve the problem step by step. At the very end, write the final answer once as "
               "\\boxed{<answer>}, in simplest exact form.")


def _load_dataset(name, config, split):
    from datasets import load_dataset
    try:
        return load_dataset(name, config, split=split)
    except Exception as e:  # no network, no cache, hub error: one actionable line, not a traceback
        raise RuntimeError(f"could not load {name} ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                           "offline? run the offline demo instead: python -m chat_rl --preset=demo") from None


def load(split, limit=None):
    """MATH train (7500, subjects interleaved so a limit still covers all) or MATH-500 test (500)."""
    if split not in ("train", "test"):
        raise ValueError(f"math has splits 'train' and 'test', not {split!r}")
    from tasks.gsm8k import use_cache_if_hub_unreachable  # fail in seconds, not after ~24 s of hub retries
    use_cache_if_hub_unreachable()
    if split == "test":
        rows = [dict(r) for r in _load_dataset(TEST_DATASET, None, "test")]
    else:  # the train split only: MATH-500 comes from MATH's test split
        subjects = [[dict(r) for r in _load_dataset(TRAIN_DATASET, c, "train")] for c in TRAIN_CONFIGS]
        rows = [s[i] for i in range(max(map(len, subjects))) for s in subjects if i < len(s)]
    return rows[:limit] if limit else rows


def prompt(row):
    return f"{row['problem']}\n\n{INSTRUCTION}"


def reference(row):
    # MATH-500 rows carry the answer; train rows only a solution whose last box is the answer
    return row["answer"] if row.get("answer") else extract_answer(row["solution"])


def solution(row):
    return row["solution"]


# ---------------------------------------------------------------------------------------------
# 1. Extraction: one linear pass, whatever the input (a megabyte of garbage, 100k nested braces).
BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*")


def _box_end(text, i):
    """Index just past the brace that closes text[i] == '{', or -1 if it never closes."""
    depth, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2  # \{ \} \\ are characters, not grouping
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def _last_box(text):
    """(content, end) of the last top-level box; content None if that box is malformed."""
    last, pos = None, 0
    while True:
        m = BOX_RE.search(text, pos)
        if not m:
            return last
        start = m.end()
        if start >= len(text) or text[start] != "{":
            last, pos = (None, start), start  # "\boxed 5" or a bare "\boxed": not an answer
            continue
        end = _box_end(text, start)
        if end < 0:
            return (None, len(text))  # unterminated: nothing after it can close, stop here
        last, pos = (text[start + 1:end - 1], end), end


def extract_answer(text):
    box = _last_box(text or "")
    if box is None or box[0] is None:
        return None
    content = box[0].strip()
    if not content or BOX_RE.search(content):  # empty, or a box in a box
        return None
    return content


def format_ok(completion):
    """Exactly one box, well-formed and non-empty, followed only by closing punctuation."""
    text = completion or ""
    box = _last_box(text)
    if len(BOX_RE.findall(text)) != 1 or box is None or not (box[0] or "").strip():
        return False
    return re.fullmatch(r"(?:\s|\$|\\\]|\\\)|\.|\*)*", text[box[1]:]) is not None


# ---------------------------------------------------------------------------------------------
# 2. Normalisation and policy: plain string code, linear regexes, capped sizes.
MAX_ANSWER_CHARS = 400  # longer answers are compared as strings only (MATH answers are short)
MAX_DIGITS = 10_000     # refuse to evaluate anything whose exact value has more digits than this

UNICODE = {"π": r"\pi ", "√": r"\sqrt", "−": "-", "–": "-", "×": r"\times ", "·": r"\cdot ",
           "⋅": r"\cdot ", "÷": r"\div ", "∞": r"\infty ", "≤": r"\le ", "≥": r"\ge ", "≠": r"\ne ",
           "°": r"^\circ", "²": "^2", "³": "^3", "∪": r"\cup ", "∩": r"\cap ", "∈": r"\in ",
           "θ": r"\theta ", "½": r"\frac{1}{2}", "⅓": r"\frac{1}{3}", "¼": r"\frac{1}{4}",
           "¾": r"\frac{3}{4}", "⁄": "/"}
TEXT_CMD = r"\\(?:text|textbf|textrm|textit|mbox)\s*"
SUBS = [  # (pattern, replacement), applied in order
    (r"\\[dt]frac(?![A-Za-z])", r"\\frac"),
    (r"\\(?:left|right)\.|\\(?:left|right|[bB]igg?[lr]?)(?![A-Za-z])", ""),
    (r"\\\\|\\(?:display|text)style|\\[,;:! ]|\\\$|\$|\\[()\[\]]",   # keep \\, drop the rest
     lambda m: m.group() if m.group() == "\\\\" else ""),
    (r"\\q?quad(?![A-Za-z])|~", " "),
    (r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree", ""),  # degrees are a unit
    (r"\\%|%", ""),                                              # and so is percent
    (TEXT_CMD + r"\{\s*(?:or|and)\s*\}|\b(?:or|and)\b", ","),    # "17 or 18" is a list of two
    (r"\\mathrm\s*\{\s*([A-Za-z])\s*\}", r"\1"),                 # \mathrm{i}, \mathrm{e}
    (r"\\frac\s*(\d|\{[^{}]*\}|\\[A-Za-z]+)\s*(\d|\{[^{}]*\}|\\[A-Za-z]+)", r"\\frac{\1}{\2}"),  # \frac\pi2
    (r"\\sqrt\s*(\d)", r"\\sqrt{\1}"),
    (r"\{\{([^{}]*)\}\}", r"{\1}"),
    (r"\{,\}", ","),                                             # 1{,}000
]
SUBS = [(re.compile(p), r) for p, r in SUBS]
TEXT_UNIT = re.compile(TEXT_CMD + r"\{[A-Za-z .]*\}(?:\^\{?\d\}?)?")
NUMBER = re.compile(r"(-?)([0-9]{1,3}(?:,[0-9]{3})+|[0-9]*)(?:\.([0-9]+))?")  # ASCII digits only
FRACTION = re.compile(r"(-?)\\frac\{(-?[0-9]+)\}\{(-?[0-9]+)\}|(-?)([0-9]+)/([0-9]+)")


def normalize(answer):
    """The answer as plain LaTeX with decoration, units and look-alike unicode removed."""
    s = "".join(UNICODE.get(c, c) for c in answer if unicodedata.category(c) != "Cf")
    s = unicodedata.normalize("NFKC", s)
    for pattern, repl in SUBS:
        s = pattern.sub(repl, s)
    if re.search(r"[0-9]", TEXT_UNIT.sub("", s)):  # a number is there: the words are its unit
        s = TEXT_UNIT.sub("", s)
        words = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ")
        tail = s[len(words):]
        if words[-1:].isdigit() or words.endswith("}"):  # "5 cm", "\frac{1}{2} inches"
            if tail.startswith(" ") and all(len(w) > 1 for w in tail.split()):
                s = words
    return " ".join(s.split()).rstrip(" .,;:")


def as_rational(s):
    """An exact Fraction for a plain number (-3, 1,000, 0.25, .5, 1/2, \frac{-1}{2}), else None."""
    s = s.replace(" ", "")
    if len(s) > 100:
        return None
    m = NUMBER.fullmatch(s)
    if m and (m.group(2) or m.group(3)):
        q = Fraction(m.group(2).replace(",", "") or "0") + Fraction(int(m.group(3) or 0), 10 ** len(m.group(3) or ""))
        return -q if m.group(1) else q
    m = FRACTION.fullmatch(s)
    if m:
        sign, num, den = (m.group(1), m.group(2), m.group(3)) if m.group(2) else m.group(4, 5, 6)
        if int(den) != 0:
            return Fraction(int(num), int(den)) * (-1 if sign else 1)
    return None


@lru_cache(maxsize=8192)
def _equivalent(pred, ref):
    p, r = normalize(pred), normalize(ref)
    if not p or not r:
        return False
    compact_p, compact_r = p.replace(" ", ""), r.replace(" ", "")
    if compact_p == compact_r:
        return True
    if re.search(r"[0-9]_", compact_p + " " + compact_r):  # base-n numerals: sympy drops the base
        return compact_p.replace("{", "").replace("}", "") == compact_r.replace("{", "").replace("}", "")
    qp, qr = as_rational(p), as_rational(r)
    if qp is not None and qr is not None:
        return qp == qr
    if len(p) > MAX_ANSWER_CHARS or len(r) > MAX_ANSWER_CHARS:
        return False
    return _ask_worker(p, r) if USE_WORKER else sympy_equal(p, r)


def grade(completion, reference):
    """1/0 verdict on the last box of completion against reference; pure, bounded, never raises."""
    try:
        pred = extract_answer(completion)
        ref = str(reference).strip() if reference is not None else ""
        if "\\boxed" in ref or "\\fbox" in ref:  # a whole solution passed as the reference
            ref = extract_answer(ref) or ""
        if pred is None or not ref or len(pred) > 10 * MAX_ANSWER_CHARS:
            return False
        return _equivalent(pred, ref)
    except Exception:
        return False


# ---------------------------------------------------------------------------------------------
# 3. Equivalence through latex2sympy + math_verify, inside the worker (or inline in tests).
_NUMBER_TOKEN = re.compile(r"([0-9]*)(?:\.([0-9]*))?(?:[eE]([-+]?[0-9]{1,3}))?")


def _exact_number(text):
    """A number token as an exact sympy Rational, with no sympify (eval) and no floats."""
    import sympy
    m = _NUMBER_TOKEN.fullmatch(text.replace(",", "").strip())
    if not m or not (m.group(1) or m.group(2)) or len(text) > 100:
        raise ValueError("not a number token")
    frac = m.group(2) or ""
    q = Fraction(int((m.group(1) or "0") + frac), 10 ** len(frac)) * Fraction(10) ** int(m.group(3) or 0)
    return sympy.Rational(q.numerator, q.denominator)


@lru_cache(maxsize=1)
def _sympy_tools():
    import logging
    from latex2sympy2_extended import latex2sympy2 as l2s
    from latex2sympy2_extended.math_normalization import NormalizationConfig, normalize_latex
    from math_verify.grader import should_treat_as_complex, verify
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns that we disabled its timeouts
    l2s._Latex2Sympy.parse_number = lambda self, text: _exact_number(text)
    l2s.convert_number = _exact_number
    config = NormalizationConfig(basic_latex=True, units=True, malformed_operators=True, nits=True,
                                 boxed="none", equations=False)

    def parse(s):
        s = normalize_latex(s, config)
        return l2s.latex2sympy(s, is_real=not should_treat_as_complex(s), convert_degrees=False,
                               normalization_config=None)
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
        top = _digits(args[1] if power else args[0], budget)  # the exponent, or n in n! and C(n, k)
        if top > 6:
            return math.inf
        base = _digits(args[0], budget) if power else top
        return 10 ** top * max(base, 1)  # |b^n| <= |b|^|n|, n! <= n^n, C(n, k) <= 2^n
    return 1 + sum(_digits(a, budget) for a in args)


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


# The worker: a child python that answers one JSON line [pred, ref] with "1" or "0".
USE_WORKER = True     # tests switch it off to run sympy in-process
CPU_BUDGET_S = 0.4    # inside the worker: CPU seconds one comparison may use, then it is "not equal"
DEADLINE_S = 0.9      # outside: a worker this late that has burnt its budget is stuck in C code
STARVED_S = 10.0      # a worker merely starved of CPU by other work gets this long before we give up
MEMORY_BYTES = 2 << 30
_worker = {"proc": None, "pid": None, "ready": False, "broken": False}
_lock = threading.Lock()


class _OverBudget(BaseException):  # BaseException: sympy's "except Exception" must not swallow it
    pass


def _serve():
    import resource, signal
    _, hard = resource.getrlimit(resource.RLIMIT_AS)  # lower the soft limit only, never raise it
    soft = MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(MEMORY_BYTES, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    armed = [False]

    def over_budget(*_):
        if armed[0]:
            raise _OverBudget()
    signal.signal(signal.SIGPROF, over_budget)  # CPU time, not wall time: verdicts do not depend on load
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
    boot = ("import importlib.util as u, sys; s = u.spec_from_file_location('_mathtask_worker', sys.argv[1]); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); m._serve()")
    _worker.update(proc=subprocess.Popen([sys.executable, "-c", boot, os.path.abspath(__file__)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, bufsize=0),
                   pid=os.getpid(), ready=False)


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
                if cpu is None or cpu0 is None or cpu - cpu0 > CPU_BUDGET_S + 0.1 or time.monotonic() - t0 > STARVED_S:
                    break
        except (OSError, ValueError) as e:
            if not _worker["broken"]:
                print(f"mathtask: sympy worker failed ({e}); such answers score 0", file=sys.stderr)
                _worker["broken"] = True
        _kill_worker()  # stuck or dead: start a fresh one now so it is ready for the next call
        _start_worker()
        return False


atexit.register(lambda: _worker["proc"] is not None and _kill_worker())
