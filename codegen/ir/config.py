"""A resolved config symbol (`ConfigFieldIR`: its config.json field(s), type, default, values)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple


@dataclass(frozen=True)
class ConfigFieldIR:
    name: str
    type: str                     # int | float | bool | str | int_tuple | float_tuple | str_tuple | bool_tuple | rope
    paths: Tuple[str, ...]
    default: Any                  # None when required (has_default False)
    has_default: bool
    doc: str = ""
    expr: Any = None              # derived symbol: an Expr over other symbols (reads no config.json path)
    default_expr: Any = None      # fallback Expr when no path is present
    if_null: Any = None           # Expr: the value of an explicit null in config.json (none: the reader's rule)
    values: Optional[Tuple[str, ...]] = None   # str / rope: the admitted values
    aliases: Tuple[Tuple[str, str], ...] = ()  # rope: (config.json rope_type name, the admitted value it is read as)
    optional: bool = False        # None admitted
    bounds: Tuple[Any, Any] = (None, None)     # inclusive (min, max), None = unbounded
    positive: bool = False        # used where a number must be > 0 (eps, theta, scales): checked at load
    guard: bool = False           # guard-only: read and checked (values / bounds), used by no block
    truthy: bool = False          # bool: an int in config.json is read as its truth value
    present: bool = False         # bool: whether config.json has the path (its content is not read)
    same_meaning: str = ""        # why the defaults check does not compare it with transformers' class (a reason)
    read_if: Any = None           # Expr (bool): the field is read only where it holds, else the default / None
    item_default: Any = None      # a per-element read (`list[*].field`): an element's absent / null field

    @property
    def derived(self) -> bool:
        return self.expr is not None

    @property
    def py_type(self) -> str:
        t = {"int": "int", "float": "float", "bool": "bool", "str": "str", "int_tuple": "tuple",
             "float_tuple": "tuple", "str_tuple": "tuple", "bool_tuple": "tuple", "rope": "dict"}[self.type]
        return f"{t} | None" if self.optional else t
