"""The symbolic values of the IR: `Size` (a sum of products of ints and config symbols, `size_at` its value
at a layer), `Ratio`, and `Value` (a literal, a config symbol or an expression)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple, Union

Factor = Union[int, str]


@dataclass(frozen=True)
class Size:
    """sum(prod(term)) over terms; a term is a tuple of ints and config symbol names."""
    terms: Tuple[Tuple[Factor, ...], ...]

    @staticmethod
    def of(*factors: Factor) -> "Size":
        return Size((tuple(factors),))

    def __add__(self, other: "Size") -> "Size":
        if not isinstance(other, Size):
            return other + self           # an expression (codegen/expr.py) absorbs a linear size
        return Size(self.terms + other.terms)

    def __mul__(self, other: "Size") -> "Size":
        if not isinstance(other, Size):
            return other * self
        return Size(tuple(a + b for a in self.terms for b in other.terms))

    def eval_layer(self, values: Mapping[str, Any], layer: Optional[int] = None) -> int:
        return self.eval(values)

    @property
    def symbol(self) -> Optional[str]:
        """The config symbol when this size is exactly one symbol, else None."""
        if len(self.terms) == 1 and len(self.terms[0]) == 1 and isinstance(self.terms[0][0], str):
            return self.terms[0][0]
        return None

    def eval(self, values: Mapping[str, Any]) -> int:
        total = 0
        for term in self.terms:
            prod = 1
            for f in term:
                prod *= values[f] if isinstance(f, str) else f
            total += prod
        return total

    @staticmethod
    def _clean(term: Tuple[Factor, ...]) -> Tuple[Factor, ...]:
        kept = tuple(f for f in term if f != 1)
        return kept or (1,)

    def py(self, config: str = "config") -> str:
        return " + ".join(" * ".join(f"{config}.{f}" if isinstance(f, str) else str(f) for f in self._clean(t))
                          for t in self.terms)

    def __str__(self) -> str:
        # merge equal terms for display: a*b + c*b + c*b -> a*b + 2*c*b
        counts: dict = {}
        for t in self.terms:
            t = self._clean(t)
            counts[t] = counts.get(t, 0) + 1
        parts = []
        for t, n in counts.items():
            s = " * ".join(str(f) for f in t)
            parts.append(s if n == 1 else f"{n} * {s}")
        return " + ".join(parts)


def size_at(size, values: Mapping[str, Any], layer: Optional[int] = None) -> Any:
    """A size's value in a variant; a per-layer size (an expression reading `layer`) in `layer` (0 when None)."""
    if getattr(size, "per_layer", False):
        return size.eval(values, 0 if layer is None else layer)
    return size.eval(values)


@dataclass(frozen=True)
class Ratio:
    """num // den, exact (the resolver checks divisibility for every variant), e.g. a vision head_dim =
    hidden / heads. Quacks like Size where a segment unit or a constructor argument is rendered."""
    num: Size
    den: Size

    @property
    def terms(self) -> tuple:
        return ()

    def eval(self, values: Mapping[str, Any]) -> int:
        return self.num.eval(values) // self.den.eval(values)

    def py(self, config: str = "config") -> str:
        return f"{self.num.py(config)} // {self.den.py(config)}"

    def __str__(self) -> str:
        return f"{self.num} / {self.den}"


@dataclass(frozen=True)
class Value:
    """A number, flag or string: a literal, a config symbol, or an expression (codegen/expr.py)."""
    literal: Any = None
    symbol: Optional[str] = None
    expr: Any = None                      # an Expr

    def py(self, config: str = "config") -> str:
        if self.expr is not None:
            return self.expr.py(config)
        return f"{config}.{self.symbol}" if self.symbol else repr(self.literal)

    def eval(self, values: Mapping[str, Any], layer: Optional[int] = None) -> Any:
        if self.expr is not None:
            return self.expr.eval(values, layer)
        return values[self.symbol] if self.symbol else self.literal

    @property
    def per_layer(self) -> bool:
        return self.expr is not None and self.expr.per_layer

    @property
    def is_none(self) -> bool:
        return self.expr is None and self.symbol is None and self.literal is None

    def __str__(self) -> str:
        if self.expr is not None:
            return str(self.expr)
        return self.symbol or repr(self.literal)
