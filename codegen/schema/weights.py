"""The `weights` section: where each parameter comes from in the checkpoint (`WeightEntry`), the row layout of
a fused tensor (`RowLayout`, or one of two chosen by the checkpoint's config: `RowLayoutChoice`), and a tensor that
fills several segments of a fused parameter (`SegmentSource`, under a key `k+v` of a `from` mapping)."""
from __future__ import annotations

from typing import Annotated, Dict, List, Literal, Optional, Union

from pydantic import Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag

from .base import Strict


class RowLayout(Strict):
    """How the rows of one fused checkpoint tensor are laid out (undone at load, before TP sharding).
    `interleave`: the parameter's segments in the order the checkpoint stores them within a group; `per`:
    `tensor` (one group: the segments blocked in that order, "split by sizes"), `head` (one group per head, every
    segment with as many heads: GPT-NeoX `query_key_value` [h0: q k v, h1: q k v, ...]), `kv_group` (one group per
    head of the segment with the fewest heads, each holding heads / groups heads of every segment: Falcon's
    [g0: q * (heads / kv_heads), k, v, g1: ...]; with one KV head the multi-query [q * heads, k, v]), `group`
    (`groups` groups, each holding heads / groups heads of every segment: CodeGen's qkv_proj, 4 groups of [q v k])."""
    interleave: List[StrictStr]
    per: Literal["tensor", "head", "kv_group", "group"]
    groups: Optional[StrictInt] = None   # per: group only: the number of groups


class RowLayoutChoice(Strict):
    """A row layout chosen by the checkpoint's config: `{if: <bool expression over config symbols>, then: <layout>,
    else: <layout>}` (each a RowLayout), decided when the weights are loaded, as `dataflow: {if: ...}` chooses a
    dataflow. ChatGLM2/3's `query_key_value` is blocked [q | k | v] with `multi_query_attention` and per head
    [h0: q k v, ...] without: `{if: multi_query_attention, then: {interleave: [q, k, v], per: tensor}, else:
    {interleave: [q, k, v], per: head}}`. The expression may not read `layer`; each variant is checked against the
    layout its flag chooses."""
    if_: StrictStr = Field(alias="if")
    then: RowLayout
    else_: RowLayout = Field(alias="else")


def _layout_kind(value) -> str:
    """A mapping with `if`, `then` or `else` is a RowLayoutChoice (its errors are then that form's alone)."""
    return "RowLayoutChoice" if isinstance(value, dict) and {"if", "then", "else"} & set(value) else "RowLayout"


LayoutSpec = Annotated[Union[Annotated[RowLayout, Tag("RowLayout")], Annotated[RowLayoutChoice, Tag("RowLayoutChoice")]],
                       Discriminator(_layout_kind)]


class SegmentSource(Strict):
    """One checkpoint tensor that holds several consecutive segments of a fused parameter, the value of a `from`
    mapping's key naming them joined by `+` (`k+v`): `from` the tensor, `layout` how its rows hold those segments
    (a RowLayout or RowLayoutChoice over them alone; none: blocked in their order). TeleChat2 stores q in `query` and
    k, v in one `key_value` laid out per KV head [kv0: k v, kv1: k v, ...]: `from: {q: ...query.weight, k+v: {from:
    ...key_value.weight, layout: {interleave: [k, v], per: head}}}`."""
    from_: StrictStr = Field(alias="from")
    layout: Optional[LayoutSpec] = None


def _segment_source_kind(value) -> str:
    return "SegmentSource" if isinstance(value, dict) else "str"


SegmentFrom = Annotated[Union[Annotated[StrictStr, Tag("str")], Annotated[SegmentSource, Tag("SegmentSource")]],
                        Discriminator(_segment_source_kind)]


def _from_kind(value) -> str:
    """`from` is one tensor name or a mapping of segments (the errors inside a mapping are then that form's alone)."""
    return "segments" if isinstance(value, dict) else "name"


FromSpec = Annotated[Union[Annotated[StrictStr, Tag("name")], Annotated[Dict[StrictStr, SegmentFrom], Tag("segments")]],
                     Discriminator(_from_kind)]


class WeightEntry(Strict):
    """Where one parameter comes from in the checkpoint (names only: the layer kind implies the sharding).

    A parameter without an entry loads the tensor of its own name. `from` renames it; a mapping
    {segment: tensor} stacks several checkpoint tensors into a fused parameter, in the block's segment order
    (which is the order of its forward split); a key `k+v` names consecutive segments one tensor holds (blocked in
    their order, or in its SegmentSource's `layout`). `{i}` stands for the layer index, `{e}` for the expert index of a
    stacked expert parameter (the per-expert tensors are stacked at load; each rank reads only its slices).
    `transpose: true`: the tensor stores each matrix as [in, out] (the last two dims swapped). `segments_interleaved:
    true`: a single tensor holds the fused parameter's segments interleaved element by element along the output
    dim (gate = [..., 0::2], up = [..., 1::2]) instead of stacked. Without `from`, the tensor of the parameter's
    own name is read in that layout."""
    from_: Optional[FromSpec] = Field(default=None, alias="from")
    transpose: StrictBool = False
    segments_interleaved: StrictBool = False
    # `squeeze: true`: the tensor stores the parameter under one extra leading dim of size 1 (ERNIE 4.5's routing
    # bias moe_statics.e_score_correction_bias [1, experts] for the [experts] parameter); dropped at load. A list of
    # dims: the stored shape has unit dims at those positions (Kimi's A_log [1, 1, heads, 1]: [0, 1, 3])
    squeeze: Union[StrictBool, List[StrictInt]] = False
    # the row layout of a single fused tensor (`from` one name) stored per head / per KV group / reordered, or
    # `{if: <flag>, then: <layout>, else: <layout>}`: one of two chosen by the checkpoint's config
    layout: Optional[LayoutSpec] = None
