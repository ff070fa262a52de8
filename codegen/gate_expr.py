"""Gate expressions: an elementwise formula over a learned parameter `w` (a `residual_gate` block's `branch` and
`residual` coefficients), parsed and checked here, rendered as torch code, never eval'd.

The grammar: numbers, the name `w` (the gate's weight, in float32), + - * / ** and unary -, and the calls
sigmoid, softplus, exp, log, sqrt, tanh, abs (one positional argument each). `"sigmoid(w)"`,
`"sqrt(1 + sigmoid(w)) * exp(-softplus(w) / 2)"` (Ergo), `"w"` (Doge's learned residual gain), `"1"`.
The resolver checks that the formula evaluates to a finite number at a few values of `w` (`evaluate`, in Python
floats), so a typo (`softpus`) or a formula that is infinite for every weight is a located compile error."""
from __future__ import annotations

import ast
import math
from typing import Callable, Dict

_TORCH: Dict[str, str] = {"sigmoid": "torch.sigmoid", "softplus": "torch.nn.functional.softplus",
                          "exp": "torch.exp", "log": "torch.log", "sqrt": "torch.sqrt", "tanh": "torch.tanh",
                          "abs": "torch.abs"}


def _softplus(x: float) -> float:
    return x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x))


_MATH: Dict[str, Callable[[float], float]] = {
    "sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x)), "softplus": _softplus, "exp": math.exp, "log": math.log,
    "sqrt": math.sqrt, "tanh": math.tanh, "abs": abs}
_BIN = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}
_MAX_LEN = 200


class GateExprError(ValueError):
    """A bad gate expression; the message says what is wrong (the caller adds file:line:col)."""


def parse(src) -> ast.AST:
    """The checked syntax tree of `src` (a str, int or float)."""
    if isinstance(src, bool) or not isinstance(src, (str, int, float)):
        raise GateExprError(f"a gate formula is a string over `w` (or a number), not {src!r}")
    text = str(src)
    if len(text) > _MAX_LEN:
        raise GateExprError(f"a gate formula has at most {_MAX_LEN} characters")
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as exc:
        raise GateExprError(f"not an expression: {exc.msg}") from None
    _check(tree)
    return tree


def _check(node: ast.AST) -> None:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise GateExprError(f"literal {node.value!r}: only numbers")
    elif isinstance(node, ast.Name):
        if node.id != "w":
            raise GateExprError(f"unknown name '{node.id}': a gate formula reads only `w` (the gate's weight)")
    elif isinstance(node, ast.BinOp):
        if type(node.op) not in _BIN:
            raise GateExprError(f"operator {type(node.op).__name__} is not allowed (+ - * / **)")
        _check(node.left)
        _check(node.right)
    elif isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, (ast.USub, ast.UAdd)):
            raise GateExprError(f"operator {type(node.op).__name__} is not allowed")
        _check(node.operand)
    elif isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in _TORCH or node.keywords or len(node.args) != 1:
            raise GateExprError(f"only the calls {', '.join(sorted(_TORCH))} (one positional argument) are allowed")
        _check(node.args[0])
    else:
        raise GateExprError(f"{type(node).__name__} is not allowed in a gate formula")


def render(tree: ast.AST) -> str:
    """Python source over a float32 tensor `w` (torch ops)."""
    if isinstance(tree, ast.Constant):
        return repr(float(tree.value))
    if isinstance(tree, ast.Name):
        return "w"
    if isinstance(tree, ast.BinOp):
        return f"({render(tree.left)} {_BIN[type(tree.op)]} {render(tree.right)})"
    if isinstance(tree, ast.UnaryOp):
        return f"({'-' if isinstance(tree.op, ast.USub) else '+'}{render(tree.operand)})"
    return f"{_TORCH[tree.func.id]}({render(tree.args[0])})"


def evaluate(tree: ast.AST, w: float) -> float:
    """The formula at one weight value, in Python floats (the resolver's finiteness check)."""
    if isinstance(tree, ast.Constant):
        return float(tree.value)
    if isinstance(tree, ast.Name):
        return w
    if isinstance(tree, ast.BinOp):
        a, b = evaluate(tree.left, w), evaluate(tree.right, w)
        op = type(tree.op)
        return a + b if op is ast.Add else a - b if op is ast.Sub else a * b if op is ast.Mult else \
            a / b if op is ast.Div else a ** b
    if isinstance(tree, ast.UnaryOp):
        v = evaluate(tree.operand, w)
        return -v if isinstance(tree.op, ast.USub) else v
    return _MATH[tree.func.id](evaluate(tree.args[0], w))


def is_one(tree: ast.AST) -> bool:
    """The formula is the literal 1 (the coefficient is left out of the generated code)."""
    return isinstance(tree, ast.Constant) and float(tree.value) == 1.0


def check_finite(tree: ast.AST, points=(-1.0, 0.0, 0.5, 1.0)) -> None:
    """Finite at some value of `w` among `points` (refuses a formula that fails everywhere, e.g. log(-1 - w*w))."""
    errors = []
    for p in points:
        try:
            v = evaluate(tree, p)
        except (ArithmeticError, ValueError) as exc:
            errors.append(f"w={p}: {type(exc).__name__}")
            continue
        if isinstance(v, complex) or not math.isfinite(v):
            errors.append(f"w={p}: {v}")
            continue
        return
    raise GateExprError(f"the formula is not a finite number at any of w = {', '.join(map(str, points))} "
                        f"({'; '.join(errors)})")
