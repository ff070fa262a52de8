"""Tensor-parallel sharding math, shared by the compiler's static checks and the loader.

A weight is split along one dimension into *segments* (q/k/v of a fused projection, gate/up of a fused
MLP, or one segment for a plain linear). A segment is `heads` units of `unit` rows each; every rank
takes its share of every segment and the shares are concatenated. When a segment has fewer heads than
ranks (KV heads < TP), heads are replicated: rank r serves head r // (tp // heads).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class ShardingError(ValueError):
    pass


@dataclass(frozen=True)
class Segment:
    name: str
    heads: int          # number of units; a plain linear segment has heads = rows and unit = 1
    unit: int = 1       # rows per unit (head_dim for attention heads)
    replicate_ok: bool = False  # may a rank serve a replicated unit when heads < tp (KV heads)

    @property
    def size(self) -> int:
        return self.heads * self.unit


def check_segment(seg: Segment, tp: int) -> Optional[str]:
    """Returns a message when `seg` cannot be split over `tp` ranks, else None."""
    if seg.heads % tp == 0:
        return None
    if seg.replicate_ok and seg.heads < tp and tp % seg.heads == 0:
        return None
    if seg.replicate_ok:
        return (f"segment '{seg.name}' has {seg.heads} heads: tensor parallel size {tp} must divide it "
                f"or be a multiple of it")
    return f"segment '{seg.name}' has {seg.heads} units: not divisible by tensor parallel size {tp}"


def segment_range(seg: Segment, tp: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of `seg` (relative to the segment's start) that `rank` holds."""
    msg = check_segment(seg, tp)
    if msg:
        raise ShardingError(msg)
    if seg.heads >= tp:
        per = seg.heads // tp
        return rank * per * seg.unit, (rank + 1) * per * seg.unit
    head = rank // (tp // seg.heads)
    return head * seg.unit, (head + 1) * seg.unit


def heads_per_rank(heads: int, tp: int) -> int:
    return max(1, heads // tp) if heads < tp else heads // tp


def padded_vocab(vocab: int, tp: int, multiple: int = 64) -> int:
    m = multiple * tp
    return (vocab + m - 1) // m * m


def vocab_range(vocab: int, tp: int, rank: int, multiple: int = 64) -> tuple[int, int]:
    """Padded row range [start, stop) of the vocabulary that `rank` holds."""
    per = padded_vocab(vocab, tp, multiple) // tp
    return rank * per, (rank + 1) * per
