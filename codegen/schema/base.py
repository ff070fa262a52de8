"""The building blocks of every section: the value kinds (`Dim` a size, `Num` a number, `Flag` a bool: a literal,
a config symbol or an expression; `Scalar` a config value) and `Strict`, the base model (strict, unknown keys
forbidden, frozen)."""
from __future__ import annotations

from typing import Dict, List, Union

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

Symbol = StrictStr                                   # the name of a config symbol
Dim = Union[StrictInt, StrictStr]                    # a size: an int literal, a symbol or an expression
Num = Union[StrictInt, StrictFloat, StrictStr]       # a number: a literal, a symbol or an expression
Flag = Union[StrictBool, StrictStr]                  # a bool literal, a bool symbol or an expression
# a list's items: bools (a bool_tuple), and None (an element's null field in a per-element read, `list[*].field`)
Scalar = Union[StrictBool, StrictInt, StrictFloat, StrictStr, None,
               List[Union[StrictBool, StrictInt, StrictFloat, StrictStr, None]],
               Dict[StrictStr, Union[StrictBool, StrictInt, StrictFloat, StrictStr, None, List[StrictInt]]]]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, populate_by_name=False)
