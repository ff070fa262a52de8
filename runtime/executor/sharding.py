"""Tensor-parallel sharding: the split math, and the weight loaders that layers attach to their parameters.

A layer (runtime/layers) is the single source of its sharding. When it is built it computes, for this
rank, a `ParamSplit` per parameter: along which dim the parameter is split (None = replicated) and, per
*segment* of that dim (q/k/v of a fused projection, gate/up of a fused MLP, one segment for a plain linear,
the vocabulary of an embedding), the segment's global size and the rows [start, stop) this rank holds.
The same object loads the parameter (`param.weight_loader = split.load`, the nano-vllm pattern), so the
loader, the static TP check (tp_check.tp_plan) and `xllm-gen --explain --tp N` read one plan.

A segment is `heads` units of `unit` rows each; every rank takes its share of every segment and the shares
are concatenated. When a segment has fewer heads than ranks (KV heads < TP) and may be replicated, rank r
serves head r // (tp // heads).

A segment of plain rows that the TP size does not divide may be *padded* where its layer asks (`pad=True`: an
MLP's intermediate width, read by an elementwise activation between a column- and a row-parallel projection,
e.g. jais-13b's 13653): every rank holds `padded_rows(size, tp)` rows, the checkpoint's rows [start, stop) of its
share followed by `pad` zero rows (`SegmentSlice.pad`). Zero rows of gate/up (and of their bias) give act(0) * 0,
zero columns of the down projection drop whatever the activation makes of them: the output is exact. The padding
lives in the parameters only: the checkpoint coordinates (`size`, `start`, `stop`) are the real ones, and the
loader zero-fills the rest (ParamSplit.load).

`weight_loader(param, loaded, shard_id=None)`: `loaded` is a lazy safetensors slice (`get_shape()`,
`[a:b]`, `[:, a:b]`) or a tensor; each rank reads only its rows. `shard_id` names the segment that
`loaded` fills (a name, or its index); None means `loaded` is the whole parameter (for a fused layer: its
segments stacked in order, e.g. a checkpoint's fused q|k|v, split here before sharding).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

if TYPE_CHECKING:     # torch is imported where tensors are handled: the compiler imports the split math only
    import torch


class ShardingError(ValueError):
    """A size that cannot be split over the tensor-parallel ranks. `problems`: one line per problem."""

    def __init__(self, message: str, problems: Sequence[str] = ()):
        super().__init__(message)
        self.problems = list(problems) or [message]


class WeightLoadError(ValueError):
    """A checkpoint tensor that does not fit its parameter (shape, dtype, unknown segment)."""


# ------------------------------------------------------------------------------------------ split math
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


# a padded segment's rows per rank are aligned to this many rows where each rank holds at least ALIGN_MIN_ROWS of them
# (128: fp8 weight blocks and activation groups, tensor-core tiles; the padding then adds < 1/8 of the width), to 8
# (16-byte bf16 vectors) from 64 rows, not at all below (test checkpoints)
PAD_ALIGN = ((1024, 128), (64, 8))


def padded_rows(size: int, tp: int) -> int:
    """Rows per rank of a padded `size`-row segment over `tp` ranks (`size` when tp is 1)."""
    per = -(-size // tp)
    if tp == 1 or size % tp == 0:
        return per
    align = next((a for least, a in PAD_ALIGN if per >= least), 1)
    return -(-per // align) * align


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


# --------------------------------------------------------------------------- deferred sharding errors
_DEFERRED: Optional[list] = None


@contextlib.contextmanager
def deferred_sharding_errors():
    """While active, a layer that cannot split a size records the problem (`module.sharding_errors`) and
    builds with a stand-in shape instead of raising, so tp_check.tp_plan can name every parameter at
    fault. Outside it (a real build) the layer raises ShardingError at once."""
    global _DEFERRED
    saved, _DEFERRED = _DEFERRED, []
    try:
        yield
    finally:
        _DEFERRED = saved


def deferring() -> bool:
    """True while a TP plan is being built with problems collected (not raised): a layer built from a projection's
    impossible split then has inconsistent per-rank sizes, which the projection has already reported."""
    return _DEFERRED is not None


def raise_or_defer(module, problems: Sequence[str]) -> None:
    """Called by a layer after computing its splits: raise its problems, or keep them when deferred."""
    if not problems:
        return
    if _DEFERRED is None:
        raise ShardingError(f"{type(module).__name__}: " + "; ".join(problems), problems)
    module.sharding_errors = list(problems)


@dataclass(frozen=True)
class SegmentSlice:
    """This rank's share of one segment of a split dimension."""
    name: str
    size: int           # global rows of the segment (in the checkpoint)
    start: int          # this rank's rows [start, stop) within the segment
    stop: int
    heads: int = 0      # units of the segment (heads for attention), 0 when rows
    unit: int = 1
    pad: int = 0        # zero rows this rank holds after its real ones (a padded segment: split_segment(pad=True))
    padded: int = 0     # a padded segment's rows over all ranks (padded_rows * tp, on every rank), else 0

    @property
    def rows(self) -> int:
        """This rank's rows of the parameter (the real ones and the padding)."""
        return self.stop - self.start + self.pad

    @property
    def real(self) -> int:
        """This rank's rows read from the checkpoint."""
        return self.stop - self.start


def split_segment(seg: Segment, tp: int, rank: int, problems: list, pad: bool = False) -> SegmentSlice:
    """This rank's SegmentSlice of `seg`; a segment that cannot be split appends its message to `problems`
    and gets a stand-in share (ceil) so a deferred build can go on. `pad`: a segment of plain rows (unit 1) that
    `tp` does not divide is padded instead (padded_rows per rank, zero rows after each rank's real ones; the
    caller's computation must make zero rows exact, as an MLP's intermediate width does)."""
    if pad and seg.unit == 1 and not seg.replicate_ok and seg.heads % tp:
        per = padded_rows(seg.heads, tp)
        a, b = min(rank * per, seg.heads), min((rank + 1) * per, seg.heads)
        return SegmentSlice(seg.name, seg.size, a, b, seg.heads, seg.unit, pad=per - (b - a), padded=per * tp)
    msg = check_segment(seg, tp)
    if msg:
        problems.append(msg)
        per = -(-seg.heads // tp) * seg.unit
        return SegmentSlice(seg.name, seg.size, 0, per, seg.heads, seg.unit)
    a, b = segment_range(seg, tp, rank)
    return SegmentSlice(seg.name, seg.size, a, b, seg.heads, seg.unit)


# ------------------------------------------------------------------------------------------ loading
def source_shape(loaded) -> tuple[int, ...]:
    """Global shape of a lazy safetensors slice or a tensor."""
    if hasattr(loaded, "get_shape"):
        return tuple(int(s) for s in loaded.get_shape())
    return tuple(loaded.shape)


def read_range(loaded, dim: int, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of `loaded` along `dim` (a lazy slice reads only those bytes)."""
    if dim == 0:
        return loaded[start:stop]
    return loaded[(slice(None),) * dim + (slice(start, stop),)]


def read_all(loaded) -> torch.Tensor:
    if not hasattr(loaded, "get_shape"):
        return loaded
    return loaded[()] if len(loaded.get_shape()) == 0 else loaded[:]     # a scalar (0-dim) tensor: no slice


class RowWindow:
    """Rows [start, stop) (dim 0) of a lazy slice or tensor, itself sliceable lazily: how a fused
    checkpoint tensor (vision `attn.qkv`: q | k | v stacked) is split before sharding."""

    def __init__(self, base, start: int, stop: int):
        self.base, self.start, self.stop = base, start, stop

    def get_shape(self) -> list[int]:
        return [self.stop - self.start] + list(source_shape(self.base)[1:])

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        first = idx[0]
        if not isinstance(first, slice) or first.step not in (None, 1):
            raise TypeError("RowWindow supports plain slices only")
        n = self.stop - self.start
        a, b, _ = first.indices(n)
        rows = slice(self.start + a, self.start + max(a, b))
        rest = idx[1:]
        return self.base[(rows,) + rest] if rest else self.base[rows]


def _fmt(shape) -> str:
    return str(tuple(int(s) for s in shape))


def _mismatch(shape, want, what: str = "") -> WeightLoadError:
    shape, want = tuple(shape), tuple(want)
    if len(shape) != len(want):
        why = f"{len(shape)} dims, expected {len(want)}"
    else:
        why = "; ".join(f"dim {d} is {a}, expected {b}" for d, (a, b) in enumerate(zip(shape, want)) if a != b)
    return WeightLoadError(f"shape {_fmt(shape)}, expected {_fmt(want)}{what}: {why}")


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    import torch

    if dst.is_floating_point() and not (src.is_floating_point()):
        raise WeightLoadError(f"dtype {src.dtype} cannot fill a {dst.dtype} parameter")
    if tuple(dst.shape) != tuple(src.shape):        # a reader that returned a different shape (never silently)
        raise WeightLoadError(f"read shape {_fmt(src.shape)}, expected {_fmt(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src.to(dtype=dst.dtype))


def _fill(param: torch.Tensor, dim: int, dst: int, seg: SegmentSlice, src: torch.Tensor) -> None:
    """This rank's rows of one segment at `dst` along `dim`: the checkpoint's, then the padding's zeros."""
    _copy(param.narrow(dim, dst, seg.real), src)
    if seg.pad:
        import torch

        with torch.no_grad():
            param.narrow(dim, dst + seg.real, seg.pad).zero_()


@dataclass(frozen=True)
class ParamSplit:
    """How one parameter is split over the TP ranks, for this rank; `load` is its weight loader.

    kind: replicated | column (dim 0) | row (dim 1) | vocab (dim 0, padded rows zeroed).
    segments: the split dim's segments in order (empty for replicated).
    shape: this rank's parameter shape."""
    kind: str
    dim: Optional[int]
    segments: tuple[SegmentSlice, ...]
    shape: tuple[int, ...]
    tp_size: int = 1
    tp_rank: int = 0
    owner: str = ""                  # the layer class, for messages

    @functools.cached_property          # asked for every checkpoint tensor a parameter takes
    def segment_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.segments)

    def global_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        s = list(self.shape)
        s[self.dim] = sum(seg.size for seg in self.segments)
        return tuple(s)

    def segment_index(self, shard_id: Union[int, str]) -> int:
        names = self.segment_names
        if isinstance(shard_id, int) and not isinstance(shard_id, bool) and 0 <= shard_id < len(names) \
                and len(names) > 1:
            return shard_id
        if isinstance(shard_id, str) and shard_id in names and len(names) > 1:
            return names.index(shard_id)
        have = f"its segments are {', '.join(names)}" if len(names) > 1 else "it has no segments (one source)"
        raise WeightLoadError(f"{self.owner or 'the layer'} has no segment {shard_id!r}: {have}")

    def load(self, param: torch.Tensor, loaded, shard_id: Union[int, str, None] = None) -> None:
        """The weight loader: copies this rank's part of `loaded` into `param`."""
        shape = source_shape(loaded)
        if self.dim is None or self.kind == "vocab" or shard_id is None:
            if shard_id is not None:
                self.segment_index(shard_id)                      # raises: no segments
            if self.kind == "vocab":
                return self._load_vocab(param, loaded, shape)
            want = self.global_shape()
            if shape != want:
                raise _mismatch(shape, want)
            if self.dim is None:
                return _copy(param, read_all(loaded))
            offset, dst = 0, 0                                    # whole (possibly fused) tensor: per segment
            for seg in self.segments:
                _fill(param, self.dim, dst, seg, read_range(loaded, self.dim, offset + seg.start, offset + seg.stop))
                offset += seg.size
                dst += seg.rows
            return
        i = self.segment_index(shard_id)
        seg = self.segments[i]
        want = list(self.shape)
        want[self.dim] = seg.size
        if shape != tuple(want):
            raise _mismatch(shape, want, f" (segment {seg.name!r})")
        dst = sum(s.rows for s in self.segments[:i])
        _fill(param, self.dim, dst, seg, read_range(loaded, self.dim, seg.start, seg.stop))

    def _load_vocab(self, param, loaded, shape) -> None:
        seg = self.segments[0]
        want = (seg.size,) + tuple(self.shape[1:])
        if shape != want:
            raise _mismatch(shape, want, f" (vocab size {seg.size})")
        real = max(0, min(seg.stop, seg.size) - seg.start)
        if real:
            _copy(param.narrow(0, 0, real), read_range(loaded, 0, seg.start, seg.start + real))
        if real < seg.rows:                                        # padding rows past the vocabulary
            import torch

            with torch.no_grad():
                param.narrow(0, real, seg.rows - real).zero_()


def attach(param: torch.nn.Parameter, split: ParamSplit) -> torch.nn.Parameter:
    """Gives `param` its split (`param.tp_split`) and weight loader (`param.weight_loader`)."""
    param.tp_split = split
    param.weight_loader = split.load
    return param


def replicated(param: torch.nn.Parameter, owner: str = "") -> torch.nn.Parameter:
    return attach(param, ParamSplit("replicated", None, (), tuple(param.shape), owner=owner))


def default_weight_loader(param: torch.Tensor, loaded, shard_id=None) -> None:
    """For a parameter without a weight loader (norms, vision embeddings): a full copy, shape checked."""
    split = getattr(param, "tp_split", None) or ParamSplit("replicated", None, (), tuple(param.shape))
    split.load(param, loaded, shard_id)
