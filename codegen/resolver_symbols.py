"""The spec resolver's helpers every section uses (a mixin of resolver._Resolver): a located error (`err`, `_where`),
a config symbol of a type (`symbol`), an expression over the config symbols (`expr`), a size / number / positive
number / flag (`dim`, `num`, `positive`, `flag`) and a Python identifier (`ident`)."""
from __future__ import annotations

import keyword
import math
import re
from typing import Optional, Tuple

from .errors import SpecError, did_you_mean
from .expr import Expr, ExprError, is_symbol
from .expr import parse as parse_expr
from .ir import (
    ConfigFieldIR,
    Size,
    Value,
)
from .resolver_variants import MAX_SIZE

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

class SymbolResolver:
    # ---- helpers ----------------------------------------------------------------------------------
    def err(self, path, message: str, at_key: bool = False) -> SpecError:
        loc = self.smap.key(tuple(path)) if at_key else self.smap.value(tuple(path))
        return SpecError(message, loc)

    def _where(self, path) -> str:
        out = ""
        for p in path:
            out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
        return out

    def symbol(self, path, name: str, types: Tuple[str, ...]) -> ConfigFieldIR:
        field = self.config.get(name)
        if field is None and name in ("None", "True", "False"):     # a literal alone reads as a symbol name here
            raise self.err(path, f"{self._where(path)}: '{name}' alone is read as a config symbol's name; a bare "
                                 f"value is YAML: {'`~` (null)' if name == 'None' else '`' + name.lower() + '`'}"
                                 f" (inside an expression, {name} is the literal)")
        if field is None:
            raise self.err(path, f"{self._where(path)}: unknown config symbol '{name}'"
                                 f"{did_you_mean(name, self.config)}; symbols are the keys of `config`")
        if field.type not in types:
            raise self.err(path, f"{self._where(path)}: config symbol '{name}' is {field.type}, "
                                 f"expected {' or '.join(types)}")
        return field

    def expr(self, path, source: str, per_layer: bool = False) -> Expr:
        """A spec expression over config symbols (and `layer` where per_layer), parsed and checked."""
        try:
            e = parse_expr(source)
        except ExprError as exc:
            raise self.err(path, f"{self._where(path)}: {exc}") from None
        for n in e.names:
            if n == "layer" and per_layer:
                continue
            if n == "layer":
                raise self.err(path, f"{self._where(path)}: `layer` (the layer index) is only defined for "
                                     f"per-layer values of decoder layer blocks")
            if n not in self.config:
                raise self.err(path, f"{self._where(path)}: unknown config symbol '{n}'"
                                     f"{did_you_mean(n, self.config)}; symbols are the keys of `config`")
        for n in _divisors(e.tree()):     # `x / s`: s must be > 0 (a config.json with 0 refused by name at load,
            self.divisors.append((path, Value(symbol=n)))      # not a ZeroDivisionError in the first step)
        return e

    def dim(self, path, value, per_layer: bool = False):
        if isinstance(value, str):
            if is_symbol(value):
                self.symbol(path, value, ("int",))
                size = Size.of(value)
            else:
                size = self.expr(path, value, per_layer)
            self.sizes.append((path, size))
            return size
        if value <= 0:
            raise self.err(path, f"{self._where(path)}: a size must be positive, got {value}")
        if value > MAX_SIZE:
            raise self.err(path, f"{self._where(path)}: a size must be at most 2**31 - 1, got {value}")
        return Size.of(value)

    def num(self, path, value, per_layer: bool = False, optional: bool = False) -> Value:
        if isinstance(value, str):
            if is_symbol(value):
                f = self.symbol(path, value, ("float", "int"))
                if f.optional and not optional:
                    raise self.err(path, f"{self._where(path)}: config symbol '{value}' is optional (may be "
                                         f"None), which this field does not admit")
                return Value(symbol=value)
            return Value(expr=self.expr(path, value, per_layer))
        if not math.isfinite(value):
            raise self.err(path, f"{self._where(path)}: must be finite, got {value}")
        return Value(literal=value)

    def positive(self, path, value, per_layer: bool = False, optional: bool = False,
                 below: Optional[float] = None) -> Value:
        """A number that must be > 0 (eps, theta, scale, soft-cap), and < `below` when given (eps < 1):
        literals checked here, symbols and expressions for every variant (and at load, by the symbol's
        bounds)."""
        v = self.num(path, value, per_layer, optional)
        if v.expr is None and v.symbol is None and v.literal <= 0:
            raise self.err(path, f"{self._where(path)}: must be > 0, got {v.literal}")
        if below is not None and v.expr is None and v.symbol is None and v.literal >= below:
            raise self.err(path, f"{self._where(path)}: must be < {below}, got {v.literal}")
        self.positives.append((path, v))
        if below is not None:
            self.below.append((path, v, below))
        return v

    def flag(self, path, value, per_layer: bool = False) -> Value:
        if isinstance(value, str):
            if is_symbol(value):
                self.symbol(path, value, ("bool",))
                return Value(symbol=value)
            return Value(expr=self.expr(path, value, per_layer))
        return Value(literal=value)

    def ident(self, path, name: str, what: str, at_key: bool = False) -> str:
        if not _IDENT.match(name) or keyword.iskeyword(name):
            raise self.err(path, f"{self._where(path)}: {what} '{name}' is not a valid Python identifier",
                           at_key=at_key)
        return name


def _divisors(tree) -> set:
    """The symbols an expression divides by directly (`a / s`, `a // s`, `a % s`), outside a conditional (a
    division under `... if s else ...` may be guarded)."""
    import ast
    out: set = set()

    def walk(node, guarded: bool) -> None:
        guarded = guarded or isinstance(node, (ast.IfExp, ast.BoolOp))
        if (not guarded and isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod))
                and isinstance(node.right, ast.Name)):
            out.add(node.right.id)
        for child in ast.iter_child_nodes(node):
            walk(child, guarded)
    walk(tree, False)
    return out - {"layer"}
