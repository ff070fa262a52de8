"""Spec expressions: small, safe Python expressions over config symbols, parsed and checked, never eval'd.

`hidden_size // num_attention_heads`, `query_pre_attn_scalar ** -0.5`,
`sliding_window if layer_types[layer] == 'sliding_attention' else None`, `len(deepstack_visual_indexes)`.

The grammar is Python's own (ast.parse, mode "eval") cut down to: literals (numbers, strings, True/False/None,
lists/tuples of those), names (config symbols; `layer` = the layer index where a per-layer value is allowed),
arithmetic (+ - * / // % **, unary -), comparisons, and/or/not, `a if c else b`, subscripts `xs[i]`, and
the calls len/min/max/int/float/bool/round. A list comprehension over `range(n)` is allowed for config defaults
(`['sliding_attention' if (i + 1) % 2 else 'full_attention' for i in range(num_hidden_layers)]`).

An Expr renders itself as Python source over `config.<symbol>` (generated code evaluates it at run time,
with the checkpoint's values) and is evaluated here by a small interpreter for the spec's variants.
"""
from __future__ import annotations

import ast
import functools
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Tuple

_BINOPS: dict = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
                 ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_CMPOPS: dict = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
                 ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
                 ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not}
_CALLS: dict = {"len": len, "min": min, "max": max, "int": int, "float": float, "bool": bool, "round": round,
                 "range": range}
_MAX_LEN = 400          # characters: an expression is a short formula, not a program
_MAX_NODES = 120
MAX_EXPONENT = 64       # |b| of a power a ** b: a literal (or constant) exponent at most this large
MAX_INT = 2 ** 63       # an int a spec expression computes lies in (-MAX_INT, MAX_INT)
MAX_SEQ = 1_000_000     # a list a spec expression builds (`[x] * n`, range) has at most this many items


class ExprError(ValueError):
    """A bad expression; the message says what is wrong (the caller adds file:line:col)."""


def _check(node: ast.AST, names: set, bound: frozenset = frozenset()) -> None:
    """Walks `node`, refusing what the grammar does not allow; collects free names into `names`."""
    if isinstance(node, ast.ListComp):
        gens = node.generators
        if (len(gens) != 1 or len(gens[0].ifs) > 1 or gens[0].is_async or not isinstance(gens[0].target, ast.Name)
                or not (isinstance(gens[0].iter, ast.Call) and isinstance(gens[0].iter.func, ast.Name)
                        and gens[0].iter.func.id == "range")):
            raise ExprError("a list comprehension must be `[... for i in range(n)]` (with at most one `if` clause)")
        if gens[0].iter.keywords:
            raise ExprError("range takes positional arguments")
        for a in gens[0].iter.args:          # range itself is only this comprehension's iterable
            _check(a, names, bound)
        _check(node.elt, names, bound | {gens[0].target.id})
        for cond in gens[0].ifs:
            _check(cond, names, bound | {gens[0].target.id})
        return
    if isinstance(node, ast.Name):
        if node.id not in bound and node.id not in _CALLS:
            names.add(node.id)
    elif isinstance(node, ast.Constant):
        if not isinstance(node.value, (int, float, str, bool, type(None))):
            raise ExprError(f"literal {node.value!r} is not allowed")
    elif isinstance(node, ast.BinOp):
        if type(node.op) not in _BINOPS:
            raise ExprError(f"operator {type(node.op).__name__} is not allowed")
        if isinstance(node.op, ast.Pow):
            _check_exponent(node.right)
    elif isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, (ast.USub, ast.UAdd, ast.Not)):
            raise ExprError(f"operator {type(node.op).__name__} is not allowed")
    elif isinstance(node, ast.Compare):
        if any(type(o) not in _CMPOPS for o in node.ops):
            raise ExprError("comparison not allowed")
    elif isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in _CALLS or node.keywords:
            raise ExprError(f"only the calls {', '.join(sorted(c for c in _CALLS if c != 'range'))} are allowed "
                            f"(positional arguments), and range(n) as a list comprehension's iterable")
        if node.func.id == "range":       # a range object is no spec value (a list is: [i for i in range(n)])
            raise ExprError("range(n) is only a list comprehension's iterable: write [i for i in range(n)]")
    elif not isinstance(node, (ast.Expression, ast.BoolOp, ast.IfExp, ast.Subscript, ast.List, ast.Tuple,
                               ast.Load, ast.operator, ast.cmpop, ast.boolop, ast.unaryop)):
        raise ExprError(f"{type(node).__name__} is not allowed in a spec expression")
    for child in ast.iter_child_nodes(node):
        _check(child, names, bound)


@functools.lru_cache(maxsize=4096)
def _parsed(source: str) -> ast.Expression:
    """The tree of a checked expression, parsed once (read only: the evaluator never changes it)."""
    return ast.parse(source, mode="eval")


def _check_exponent(node: ast.AST) -> None:
    """The exponent of `**` is a constant of magnitude <= MAX_EXPONENT (`hidden_size ** 0.5`, `x ** -0.5`,
    `2 ** 10`): the generated code evaluates a power over the checkpoint's config at load, so a symbol (or a
    nested power) in the exponent could compute an unbounded number there."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and not all(
            isinstance(x, ast.Constant) for x in (node.left, node.right)):
        return              # a true division is a float: a float power takes constant time (or overflows)
    folded = node
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        folded = node.operand
    if isinstance(folded, ast.BinOp) and isinstance(folded.op, (ast.Div,)) and all(
            isinstance(x, ast.Constant) for x in (folded.left, folded.right)):
        folded = folded.left            # 1 / 2: a constant fraction
    if not (isinstance(folded, ast.Constant) and isinstance(folded.value, (int, float))
            and not isinstance(folded.value, bool)):
        raise ExprError("the exponent of `**` must be a number literal (e.g. `x ** 0.5`, `x ** -0.5`, `x ** (1 / 3)`) "
                        "or a division (`alpha ** (head_dim / (head_dim - 2))`)")
    value = _Eval({}).run(node)
    if not abs(value) <= MAX_EXPONENT:
        raise ExprError(f"exponent {value!r} is too large (at most {MAX_EXPONENT} in magnitude)")


def _bounded(value: Any) -> Any:
    """An int result within +-MAX_INT and a list of at most MAX_SEQ items (raises ExprError)."""
    if isinstance(value, int) and not isinstance(value, bool) and not -MAX_INT < value < MAX_INT:
        raise ExprError(f"the result {_short(value)} is out of range (an int must lie within +-2**63)")
    if isinstance(value, float) and value != value:
        return value
    if isinstance(value, (list, tuple, str)) and len(value) > MAX_SEQ:
        raise ExprError(f"the result has {len(value)} items, more than {MAX_SEQ}")
    return value


def _short(value: int) -> str:
    return repr(value) if abs(value) < 10 ** 30 else f"~1e{len(str(abs(value))) - 1}"


@dataclass(frozen=True)
class Expr:
    """A parsed, checked expression. `source` is normalized (ast.unparse)."""
    source: str
    names: Tuple[str, ...]                # config symbols (and `layer`) it reads

    # sizes quack alike: terms == () marks a non-linear size (see ir.Size)
    @property
    def terms(self) -> tuple:
        return ()

    @property
    def per_layer(self) -> bool:
        return "layer" in self.names

    def tree(self) -> ast.Expression:
        return ast.parse(self.source, mode="eval")

    def py(self, config: str = "config", layer: str = "layer_idx", subscript: bool = False) -> str:
        """Python source with symbols as `config.<name>` (or `config["<name>"]` when subscript) and `layer` as
        the layer-index variable."""
        tree = self.tree()
        bound = {n.target.id for n in ast.walk(tree) if isinstance(n, ast.comprehension)}

        class _Rename(ast.NodeTransformer):
            def visit_Name(self, node):
                if node.id in _CALLS or node.id in bound:
                    return node
                if node.id == "layer":
                    return ast.copy_location(ast.Name(layer, ast.Load()), node)
                if subscript:
                    return ast.copy_location(ast.Subscript(ast.Name(config, ast.Load()), ast.Constant(node.id),
                                                           ast.Load()), node)
                return ast.copy_location(ast.Attribute(ast.Name(config, ast.Load()), node.id, ast.Load()), node)

        out = ast.unparse(_Rename().visit(tree))
        return out if isinstance(tree.body, (ast.Name, ast.Attribute, ast.Constant, ast.Call, ast.Subscript,
                                             ast.List, ast.ListComp)) else f"({out})"

    def eval(self, values: Mapping[str, Any], layer: Optional[int] = None) -> Any:
        env = dict(values)
        if layer is not None:
            env["layer"] = layer
        return _Eval(env).run(_parsed(self.source).body)

    def __str__(self) -> str:
        return self.source

    def _combine(self, other, op: str) -> "Expr":
        o = other.source if isinstance(other, Expr) else str(other)
        # a size the compiler derives (a fused projection's rows: a sum of per-layer products) from checked parts: the
        # limits of a written formula, 4x
        return parse(f"({self.source}) {op} ({o})", _scale=4)

    def __add__(self, other):
        return self._combine(other, "+")

    def __mul__(self, other):
        return self._combine(other, "*")

    __radd__ = __add__
    __rmul__ = __mul__


class _Eval:
    def __init__(self, env: Mapping[str, Any]):
        self.env = dict(env)

    def run(self, node: ast.AST) -> Any:
        m: Callable = getattr(self, "_" + type(node).__name__)
        return m(node)

    def _Constant(self, n):
        return n.value

    def _Name(self, n):
        if n.id not in self.env:
            raise ExprError(f"'{n.id}' has no value here")
        return self.env[n.id]

    def _BinOp(self, n):
        a, b = self.run(n.left), self.run(n.right)
        if isinstance(n.op, ast.Pow) and isinstance(b, (int, float)) and abs(b) > MAX_EXPONENT:
            raise ExprError("exponent too large")
        if isinstance(n.op, ast.Mult) and isinstance(a, int) and isinstance(b, (list, tuple, str)):
            a, b = b, a
        if isinstance(n.op, ast.Mult) and isinstance(a, (list, tuple, str)) and isinstance(b, int) \
                and len(a) * max(b, 0) > MAX_SEQ:
            raise ExprError(f"the result would have {len(a) * b} items, more than {MAX_SEQ}")
        if isinstance(n.op, ast.Pow) and isinstance(a, int) and isinstance(b, int) and b > 0 and a not in (0, 1, -1) \
                and abs(a).bit_length() * b > 64 * 2:
            raise ExprError(f"{_short(a)} ** {b} is out of range (an int must lie within +-2**63)")
        try:
            return _bounded(_BINOPS[type(n.op)](a, b))
        except OverflowError:
            raise ExprError("the result is out of range (float overflow)") from None
        except ZeroDivisionError:
            raise ExprError("division by zero") from None

    def _UnaryOp(self, n):
        v = self.run(n.operand)
        return -v if isinstance(n.op, ast.USub) else (+v if isinstance(n.op, ast.UAdd) else not v)

    def _BoolOp(self, n):
        if isinstance(n.op, ast.And):
            v = True
            for x in n.values:
                v = self.run(x)
                if not v:
                    return v
            return v
        v = False
        for x in n.values:
            v = self.run(x)
            if v:
                return v
        return v

    def _Compare(self, n):
        left = self.run(n.left)
        for op, right in zip(n.ops, n.comparators):
            r = self.run(right)
            if not _CMPOPS[type(op)](left, r):
                return False
            left = r
        return True

    def _IfExp(self, n):
        return self.run(n.body) if self.run(n.test) else self.run(n.orelse)

    def _Subscript(self, n):
        return self.run(n.value)[self.run(n.slice)]

    def _Call(self, n):
        args = [self.run(a) for a in n.args]
        if n.func.id == "range" and args and max(args) > MAX_SEQ:
            raise ExprError("range too large")
        try:
            return _bounded(_CALLS[n.func.id](*args))
        except OverflowError:
            raise ExprError(f"{n.func.id}(...) is out of range") from None

    def _List(self, n):
        return [self.run(e) for e in n.elts]

    _Tuple = _List

    def _ListComp(self, n):
        g = n.generators[0]
        out = []
        for i in self.run(g.iter):
            inner = _Eval({**self.env, g.target.id: i})
            if all(inner.run(c) for c in g.ifs):
                out.append(inner.run(n.elt))
        return out


def parse(source: str, _scale: int = 1) -> Expr:
    """Parses and checks `source`; raises ExprError with a short reason."""
    if not isinstance(source, str) or not source.strip():
        raise ExprError("empty expression")
    if len(source) > _MAX_LEN * _scale:
        raise ExprError(f"expression longer than {_MAX_LEN * _scale} characters")
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError as e:
        raise ExprError(f"not a valid expression: {e.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > _MAX_NODES * _scale:
        raise ExprError("expression too large")
    names: set = set()
    _check(tree, names)
    _fold(tree.body)
    return Expr(ast.unparse(tree), tuple(sorted(names)))


def _fold(node: ast.AST) -> None:
    """Evaluates every constant sub-expression once (bounded: `10 ** 100`, `[0] * 10 ** 9` fail here, at compile
    time, with the reason); a sub-expression that reads a symbol is checked when it is evaluated."""
    free = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id not in _CALLS}
    if not free and isinstance(node, (ast.BinOp, ast.UnaryOp, ast.Call, ast.List, ast.Tuple, ast.ListComp)):
        try:
            _Eval({}).run(node)
        except ExprError:
            raise
        except Exception:  # noqa: BLE001 - 1 / 0 and the like fail where the spec's variants evaluate it
            return
        return
    for child in ast.iter_child_nodes(node):
        _fold(child)


def is_symbol(source: str) -> bool:
    return isinstance(source, str) and source.isidentifier()
