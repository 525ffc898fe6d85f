"""
The calculator the policy calls mid-solution, in GSM8K's annotation syntax: a line of working
written as `48/2 = <<48/2=24>>24` asks the tool for `48/2`; the engine forces the result and the
closing `>>` (fast/tool_calls.py, ToolCalls), and the model goes on from there.

    calculate("48/2")        -> "24"       integral results print as integers
    calculate("12/60")       -> "0.2"
    calculate("10/3")        -> "3.3333"   the rest as a decimal rounded to DECIMALS places
    calculate("1,200*3")     -> "3600"     thousands commas are stripped
    calculate("2**10"), calculate("x+1"), calculate("1/0"), calculate("__import__('os')") -> None

Model text is untrusted input: the expression is parsed with `ast` and only numbers, + - * /,
unary minus (and plus) and parentheses are evaluated, with exact fractions, never with eval or
exec. Every other node (names, calls, attributes, strings, comparisons, powers, ...) refuses the
whole expression, and so do division by zero, an expression or a number past a size limit, nesting
past a depth limit and a result too large to be an answer. Before the parser sees anything, a
character whitelist (ASCII digits, the operators, parentheses, '.', ',', blanks) and the length
limit bound its work, so any input, however long or hostile, is answered in a time bounded by
those limits.
"""

import ast
import re
from fractions import Fraction

DECIMALS = 4  # a non-integral result is rounded to this many decimal places (GSM8K prints 2 to 4)
MAX_CHARS = 100  # GSM8K's longest annotated expression has 36 characters
MAX_DIGITS = 30  # per number, and per numerator / denominator of the result
MAX_DEPTH = 20  # nested operations (parentheses included)

ALLOWED_CHARS = re.compile(r"[0-9+\-*/().,\s]*")
# 1,200 -> 1200; "1,20" keeps its comma and fails
THOUSANDS = re.compile(r"(?<=[0-9]),(?=[0-9]{3}(?![0-9]))")
OPERATORS = {
    ast.Add: Fraction.__add__,
    ast.Sub: Fraction.__sub__,
    ast.Mult: Fraction.__mul__,
    ast.Div: Fraction.__truediv__,
}
TOO_BIG = Fraction(10) ** MAX_DIGITS


def calculate(expression):
    """The value of an arithmetic expression as the text a model should see, or None if not one."""
    if (
        not isinstance(expression, str)
        or len(expression) > MAX_CHARS
        or not ALLOWED_CHARS.fullmatch(expression)
    ):
        return None
    source = THOUSANDS.sub("", expression).strip()
    # parentheses leave no node in the tree, so count them here
    if _paren_depth(source) > MAX_DEPTH:
        return None
    try:
        tree = ast.parse(source, mode="eval")
        value = _evaluate(tree.body, source, depth=0)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None
    return None if value is None else _as_text(value)


def _evaluate(node, source, depth):
    """Exact value of an ast node, or None for anything that is not plain arithmetic."""
    if depth > MAX_DEPTH:
        return None
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        # read the literal's own text: Fraction(0.2) would be the float's binary value, not 1/5
        literal = ast.get_source_segment(source, node)
        if (
            literal is None
            or len(literal.replace(".", "")) > MAX_DIGITS
            or not re.fullmatch(r"[0-9]*\.?[0-9]*", literal)
        ):
            # 1e3 and 0x10 parse as numbers too; a calculator for word problems takes decimals only
            return None
        return Fraction(literal)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _evaluate(node.operand, source, depth + 1)
        return None if operand is None else (-operand if isinstance(node.op, ast.USub) else operand)
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left = _evaluate(node.left, source, depth + 1)
        right = _evaluate(node.right, source, depth + 1)
        if left is None or right is None:
            return None
        value = OPERATORS[type(node.op)](left, right)
        # bounded sizes keep every operation cheap: 30-digit numbers multiplied at most
        # MAX_CHARS / 2 times
        return value if abs(value.numerator) < TOO_BIG and value.denominator < TOO_BIG else None
    return None


def _paren_depth(text):
    depth = deepest = 0
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        deepest = max(deepest, depth)
    return deepest


def _as_text(value):
    """24 for an integral value, else a decimal rounded to DECIMALS places without trailing zeros
    (0.2, 3.3333)."""
    if value.denominator == 1:
        return str(value.numerator)
    scaled = round(abs(value) * 10**DECIMALS)  # Fraction rounds half to even, exactly
    sign = "-" if value < 0 and scaled else ""
    whole, frac = divmod(scaled, 10**DECIMALS)
    frac = str(frac).rjust(DECIMALS, "0").rstrip("0")
    return f"{sign}{whole}.{frac}" if frac else f"{sign}{whole}"
