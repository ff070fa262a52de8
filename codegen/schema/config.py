"""The `config` section: a spec symbol <- config.json field(s) (`ConfigField`)."""
from __future__ import annotations

from typing import Dict, List, Literal, Optional, Union

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from .base import Scalar, Strict


class ConfigField(Strict):
    """`name: {type: int, from: [dotted.path, fallback.path], default: 10}`; the first present path wins.

    Types are strict at load (no bool("false"), no int(2.7)): int, float (ints accepted), bool, str,
    int_tuple / float_tuple / str_tuple / bool_tuple (a scalar is a 1-tuple), and rope (the rope-parameters mapping,
    transformers' `rope_parameters` or the older `rope_scaling`: its `rope_type` must be one of `values`).
    `values` restricts a str (or rope) symbol to the variants the spec models: a checkpoint with another
    value is refused at load, naming the spec and the field. `optional: true` admits null / absence (None).
    `default` is a literal; `default_expr` an expression over other symbols (`hidden_size //
    num_attention_heads`). A derived symbol reads no config.json field: `expr: "len(deepstack_visual_indexes)"`
    (rendered as a Config property, evaluated for every variant)."""
    type: Literal["int", "float", "bool", "str", "int_tuple", "float_tuple", "str_tuple", "bool_tuple",
                  "rope"]  # strict at load
    # dotted config.json path, or a list of them: the first present wins
    from_: Optional[Union[StrictStr, List[StrictStr]]] = Field(default=None, alias="from")
    default: Optional[Scalar] = None     # a literal used when no path is present (none: the field is required)
    # a per-element read (`from: block_configs[*].attention.no_op`, a tuple symbol): the entry of an element whose field
    # is absent or null (the config class's default for it); without it such an element is None where the symbol is
    # `optional`, false in a bool_tuple where the field is null, and refused naming the element otherwise
    item_default: Optional[Union[StrictBool, StrictInt, StrictFloat, StrictStr]] = None
    default_expr: Optional[StrictStr] = None  # an expression over other symbols used when no path is present
    # what an explicit null in config.json means, where the config class computes a value for None (Qwen3Config's
    # num_key_value_heads: absent 32, null num_attention_heads): an expression over other symbols. Without it a null
    # is the computed default (`default_expr`), false (a bool: the modeling code tests it by truth), None
    # (`optional`), the default rope (a rope symbol), and otherwise refused by name
    if_null: Optional[Union[StrictStr, StrictBool, StrictInt, StrictFloat]] = None   # a number: that constant
    expr: Optional[StrictStr] = None     # a derived symbol: an expression, no config.json field read
    # str / str_tuple (each entry) / rope symbols: the values (rope types) the spec models
    values: Optional[List[StrictStr]] = None
    # rope symbols: other rope_type names config.json may carry, each read as one of `values` (transformers' Phi3Config
    # reads the older `su` and `yarn` as longrope): `aliases: {su: longrope}`
    aliases: Optional[Dict[StrictStr, StrictStr]] = None
    optional: StrictBool = False         # null / absent is admitted (the symbol is None)
    min: Optional[Union[StrictInt, StrictFloat]] = None   # inclusive bounds checked at load (and for variants)
    max: Optional[Union[StrictInt, StrictFloat]] = None
    doc: StrictStr = ""                         # a free-text note about the symbol (not rendered)
    # a guard-only symbol: read (or derived) and held to its `values` / `min` / `max` at load, but used by no
    # block. Every other symbol must reach the generated model (a symbol read and never used is a compile error)
    guard: StrictBool = False
    # bool symbols: an int in config.json is read as its truth value (0: false, any other: true), for a field a config
    # class tested by truth where releases wrote an int (Llama 4 Scout / Maverick: `attn_temperature_tuning: 4`)
    truthy: StrictBool = False
    # bool symbols: whether config.json has the (one) `from` path at all, whatever its value (`{}` and null too);
    # reads none of its content (the guard still wants every key under it read, assumed or ignored). transformers 5's
    # per-layer overrides differ by presence: `per_layer_config` given -> an entry's omitted key is the top level's,
    # absent -> the config class derives the entries (Gemma 4's global_head_dim)
    present: StrictBool = False
    # why this read symbol's value differs from the attribute transformers' config class holds for its field although
    # the meaning is the same (None where the modeling code computes 4 * hidden_size; a field the class ignores but the
    # checkpoint's training used): verify's defaults check (codegen/defaults_check.py) then does not compare it
    same_meaning: StrictStr = ""
    # a bool expression over other symbols: where it is false the field is not read at all (the symbol is its default,
    # None where `optional`, whatever config.json holds, of any type; the guard counts the field as read), as a config
    # class that consults a field only to derive another one where that one is absent (EXAONE 4's
    # sliding_window_pattern, used only where layer_types is absent, and a string in the releases that carry them)
    read_if: Optional[StrictStr] = None
