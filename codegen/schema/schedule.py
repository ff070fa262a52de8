"""`decoder.schedule`: rewrites of the residual stream before chosen layers, with values carried across layers
(looped and cycled decoders: HRM-Text's two states that its two layer stacks update in turn), and the decoder-level
norms and learned vectors those rewrites read."""
from __future__ import annotations

from typing import Dict, List, Union

from pydantic import StrictStr

from .base import Dim, Flag, Strict
from .blocks import LayerNormBlock, RMSNormBlock


class StreamTerm(Strict):
    """`{norm: N, of: V}`: the value V (`stream`, a carried value or a vector) normalized by the schedule's norm N."""
    norm: StrictStr
    of: StrictStr


class BeforeLayer(Strict):
    """Before each layer where `when` (a bool expression over config symbols and `layer`) holds: `set` (`stream` or a
    carried value's name) becomes the sum of `sum`'s terms, left to right; a term is a value name (`stream`, a carried
    value, a `vectors` entry broadcast over the tokens) or `{norm: N, of: value}`. The rewrites of one layer run in the
    order listed; each reads the values as the earlier ones left them."""
    when: Flag
    set: StrictStr
    sum: List[Union[StrictStr, StreamTerm]]


class Schedule(Strict):
    # decoder-level norms the rewrites use (modules `<prefix>.<name>`)
    norms: Dict[StrictStr, Union[RMSNormBlock, LayerNormBlock]] = {}
    # learned vectors of the decoder (parameters `<prefix>.<name> [size]`, replicated): HRM-Text's `z_L_init`
    vectors: Dict[StrictStr, Dim] = {}
    before_layer: List[BeforeLayer]
