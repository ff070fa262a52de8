"""Rotary position embeddings: neox (rotate_half) layout, and mRoPE (positions [3, N]) with interleaved or
blocked (contiguous) frequency sections; frequencies from the rope scaling kinds (default, linear, dynamic,
yarn, frequency_bands, longrope, proportional: runtime/rope_kinds.py), with transformers' arithmetic
(layers/rope_scaling.py). Two further axes compose with all of them: partial rotary (only the first `rotary_dim` dims of each head rotate, the rest pass through; the
frequencies are computed over rotary_dim, as transformers does) and the pair layout (`neox`: dim j pairs with
j + rotary_dim/2; `interleaved`: GPT-J's rotate-every-two, dim 2j pairs with 2j + 1)."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from xllm_gen.runtime import ops
from xllm_gen.runtime.layers.rope_scaling import rope_parameters

ROTARY_KINDS = ("neox", "mrope_interleaved", "mrope_blocked")
ROTARY_LAYOUTS = ("neox", "interleaved")


def mrope_axis_map(kind: str, sections: Sequence[int], half: int) -> torch.Tensor:
    """[half] int32: which position axis (0=t, 1=h, 2=w) drives each frequency slot.

    interleaved (transformers' apply_interleaved_mrope): slot j takes h when j % 3 == 1 and j < 3 * s_h,
    w when j % 3 == 2 and j < 3 * s_w, else t.  blocked: t for the first s_t slots, then h, then w.
    """
    if len(sections) != 3 or sum(sections) != half:
        raise ValueError(f"mrope_section {list(sections)} must have 3 entries summing to head_dim/2 = {half}")
    axis = torch.zeros(half, dtype=torch.int32)
    if kind == "mrope_interleaved":
        for dim, offset in ((1, 1), (2, 2)):
            axis[offset: sections[dim] * 3: 3] = dim
    elif kind == "mrope_blocked":
        axis[sections[0]: sections[0] + sections[1]] = 1
        axis[sections[0] + sections[1]:] = 2
    else:
        raise ValueError(f"not an mrope kind: {kind!r}")
    return axis


def _scaling_key(scaling: Optional[Mapping[str, Any]]):
    if not scaling:
        return None
    return tuple(sorted((k, repr(v)) for k, v in dict(scaling).items()))


_TABLES: dict = {}
# scaling kinds whose frequencies depend on the engine's context length (Rotary.set_context_len)
CONTEXT_DEPENDENT = ("longrope",)
# scaling kinds that read original_max_position_embeddings (a Rotary's `original_max_position` overrides it)
_READS_ORIGINAL = ("yarn", "frequency_bands", "longrope")


def _rope_tables(head_dim: int, theta: float, max_position: int, device: torch.device,
                 scaling: Optional[Mapping[str, Any]] = None, full_dim: Optional[int] = None,
                 context_len: Optional[int] = None, longrope_factors: str = "by_context",
                 longrope_mscale: bool = False, rows: Optional[int] = None):
    """(inv_freq [D/2], cos|sin [rows, D], attention_factor): float32 tensors, cos and sin already
    multiplied by attention_factor (as transformers does before casting), built once per (shape, theta,
    scaling, device) and shared by every layer: a 262k-position table is 134 MB, too much to hold once per
    layer. `rows` (default max_position): the positions the table covers, the engine's context where it is longer
    (the frequencies still read max_position, transformers' max_position_embeddings)."""
    rows = max_position if rows is None else rows
    skey = _scaling_key(scaling)
    if not scaling or dict(scaling).get("rope_type", dict(scaling).get("type")) not in CONTEXT_DEPENDENT:
        context_len = None                  # the frequencies do not depend on it: share the table
    key = (head_dim, theta, max_position, rows, skey, full_dim, context_len, longrope_factors, longrope_mscale,
           str(device))
    if key not in _TABLES:
        cpu_key = (head_dim, theta, max_position, rows, skey, full_dim, context_len, longrope_factors,
                   longrope_mscale, "cpu")
        cpu = _TABLES.get(cpu_key)
        if cpu is None:
            with torch.device("cpu"):       # computed on CPU even inside a torch.device("meta"/"cuda") build
                inv_freq, factor = rope_parameters(head_dim, theta, max_position, scaling, full_dim, context_len,
                                                   longrope_factors, longrope_mscale)
                freqs = torch.arange(rows, dtype=torch.float)[:, None] * inv_freq[None, :]
                cos, sin = freqs.cos(), freqs.sin()
                if factor != 1.0:
                    cos, sin = cos * factor, sin * factor
            cpu = _TABLES[cpu_key] = (inv_freq, torch.cat((cos, sin), -1), factor)
        _TABLES[key] = (cpu[0].to(device), cpu[1].to(device), cpu[2])
    return _TABLES[key]


class Rotary(nn.Module):
    """forward(positions, q [N, H, D], k [N, Hk, D]) -> (q, k).

    positions: [N] for kind "neox", [3, N] (t, h, w) for the mrope kinds. `scaling`: a rope-parameter mapping
    (config.json `rope_parameters` / `rope_scaling` as the config reader normalizes it): rope_type default |
    linear | dynamic | yarn | frequency_bands | longrope (runtime/rope_kinds.py) with that kind's keys (see
    `rope_parameters` for the math and for dynamic's behaviour beyond max_position); None means default. inv_freq and the attention factor are computed as
    transformers 5 does, in float32; cos/sin are multiplied by the attention factor. The CPU path computes
    cos/sin from positions exactly as HF does, the CUDA kernel reads a float32 [max_position, D] cos|sin
    table (already scaled). The tables are plain attributes (not buffers): they stay float32 whatever the
    model is cast to, and follow the inputs' device on first use.

    `rotary_dim` (default head_dim, even): only the first rotary_dim dims of each head rotate, the rest pass
    through unchanged; frequencies are computed over rotary_dim (transformers' partial_rotary_factor /
    rotary_pct / rotary_dim). `layout` "interleaved" (GPT-J's rotate_every_two: dim 2j pairs with 2j + 1 at
    frequency j) is computed as the neox rotation of the rotary dims gathered evens-then-odds: each rotated
    element is the same product as transformers', and q and k stay in that gathered order (attention only
    reads their dot products, which a common permutation of the dims leaves unchanged). Both run around the
    same op (CPU reference or the CUDA kernel) on the [N, H, rotary_dim] slice.

    `original_max_position` (optional): overrides the mapping's original_max_position_embeddings for the kinds
    that read it (transformers' rule for a config with a top-level original_max_position_embeddings).
    longrope's frequencies depend on the engine's max_model_len: the runner calls `set_context_len`.
    `longrope_factors` "short": longrope turns at short_factor at every context, only its attention factor follows
    the regime (rope_parameters). `longrope_mscale`: the mapping's short_mscale / long_mscale are that attention
    factor (PhiMoE); otherwise they are ignored, as transformers' generic longrope ignores them.
    """

    def __init__(self, head_dim: int, theta: float, max_position: int, kind: str = "neox",
                 mrope_section: Optional[Sequence[int]] = None, scaling: Optional[Mapping[str, Any]] = None,
                 rotary_dim: Optional[int] = None, layout: str = "neox",
                 original_max_position: Optional[int] = None, direction: str = "forward", position: str = "first",
                 longrope_factors: str = "by_context", longrope_mscale: bool = False):
        super().__init__()
        if longrope_factors not in ("by_context", "short"):
            raise ValueError(f"longrope_factors must be 'by_context' or 'short', not {longrope_factors!r}")
        self.longrope_factors = longrope_factors
        self.longrope_mscale = bool(longrope_mscale)
        if position not in ("first", "last"):
            raise ValueError(f"rotary position must be 'first' or 'last', not {position!r}")
        self.position = position        # which dims of a partial rotary turn: the first or the last rotary_dim
        if direction not in ("forward", "backward"):
            raise ValueError(f"rotary direction must be 'forward' or 'backward', not {direction!r}")
        if kind not in ROTARY_KINDS:
            raise ValueError(f"rotary kind must be one of {ROTARY_KINDS}, not {kind!r}")
        if layout not in ROTARY_LAYOUTS:
            raise ValueError(f"rotary layout must be one of {ROTARY_LAYOUTS}, not {layout!r}")
        if layout != "neox" and kind != "neox":
            raise ValueError(f"rotary layout {layout!r} is for kind 'neox' only, not {kind!r}")
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or not 0 <= rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be an int in 0..head_dim = {head_dim}, got {rotary_dim!r}")
        if rotary_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}" if rotary_dim == head_dim else
                             f"rotary dims must be even, got {rotary_dim} (of head_dim {head_dim})")
        self.full_head_dim = head_dim
        self.head_dim = rotary_dim                  # the dims that rotate (the tables' width)
        self.layout = layout
        self.theta = float(theta)
        self.max_position = max_position
        self.kind = kind
        self.mrope_section = list(mrope_section) if mrope_section is not None else None
        self.scaling = dict(scaling) if scaling else None
        self.rope_type = (self.scaling or {}).get("rope_type", (self.scaling or {}).get("type", "default"))
        if original_max_position is not None and self.scaling and self.rope_type in _READS_ORIGINAL:
            # the model's own original context (a top-level original_max_position_embeddings, which
            # transformers writes over the rope mapping's key)
            self.scaling["original_max_position_embeddings"] = original_max_position
        self.context_len: Optional[int] = None      # the engine's max_model_len (set_context_len)
        self.rows = max_position        # the CUDA kernel's table covers every position the engine serves
        half = rotary_dim // 2
        # the tables (inv_freq, cos|sin, attention_factor) are built on first use, on the device of the inputs:
        # a model built only to read its parameter shapes (tp_check's meta build at compile time) never builds
        # them (a 10M-position table is 2.6 GB of float32 per half). No rotating dim (transformers:
        # int(head_dim * partial_rotary_factor) == 0): q and k pass unchanged.
        self._device = torch.device("cpu")
        self._tables = None if rotary_dim else (torch.empty(0), torch.empty(max_position, 0), 1.0)
        if rotary_dim:      # the scaling is checked now (a bad mapping fails the build, naming the key): cheap
            rope_parameters(rotary_dim, self.theta, max_position, self.scaling, head_dim,
                            longrope_factors=longrope_factors, longrope_mscale=self.longrope_mscale)
        # interleaved: the rotary dims gathered evens then odds (pairs (2j, 2j + 1) -> (j, j + half))
        self.gather = (torch.cat((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)))
                       if layout == "interleaved" and rotary_dim else None)
        # backward (each pair turns by -theta * p: NanoChat's rotate_half [x2, -x1]) is the forward turn of the pair
        # taken in the other order, (a, b) -> (b, a): the same products, with q and k kept in that order
        self.direction = direction
        if direction == "backward" and rotary_dim:
            if kind != "neox":
                raise ValueError("a backward rotary is for kind 'neox' only")
            self.gather = (torch.cat((torch.arange(1, rotary_dim, 2), torch.arange(0, rotary_dim, 2)))
                           if layout == "interleaved" else
                           torch.cat((torch.arange(half, rotary_dim), torch.arange(0, half))))
        if kind == "neox":
            if mrope_section is not None:
                raise ValueError("mrope_section is only for the mrope kinds")
            self.axis_map = None
        else:
            if mrope_section is None:
                raise ValueError(f"rotary kind {kind!r} needs mrope_section")
            self.axis_map = mrope_axis_map(kind, self.mrope_section, half)

    def set_context_len(self, context_len: int) -> None:
        """The engine's max_model_len, told once after the model is built and before any step: the scaling
        kinds whose frequencies depend on the context (longrope: short_factor up to the original context,
        long_factor beyond; see rope_parameters) choose their tables from it, for every position. The cos|sin table
        covers the context where it is longer than max_position (the CUDA kernel reads it at each position
        unchecked: a spec whose max_position is short of the engine's context would read past its end). A 1-D
        rotary's positions are token indices, below the context, so its table stops there (a config's
        max_position_embeddings of 1e9, or a 10M one, is no table of that size); mRoPE's temporal positions
        can run past the token count (scaled video time), so its table keeps max_position's rows too."""
        rows = context_len if self.kind == "neox" else max(self.max_position, context_len)
        if rows != self.rows:
            self.rows = rows
            self._tables = None
        if self.rope_type not in CONTEXT_DEPENDENT or not self.head_dim or context_len == self.context_len:
            return
        self.context_len = context_len
        self._tables = None                         # rebuilt on next use, with the context's factors

    def long_regime_original(self) -> Optional[int]:
        """The original context when the engine's context puts this rotary in its long-context regime (longrope with
        context_len > original_max_position_embeddings: long_factor at every position, where transformers keeps
        short_factor while a sequence is within the original context), else None."""
        if not self.context_len or not self.long_regime_differs():
            return None
        original = int(self.scaling.get("original_max_position_embeddings", self.max_position))
        return original if self.context_len > original else None

    def long_regime_differs(self) -> bool:
        """Whether a longrope rotary computes otherwise past the original context (long_factor, or long_mscale);
        short_factor with one attention factor at every context has no regime to differ in."""
        if self.rope_type != "longrope" or not self.head_dim:
            return False
        return not (self.longrope_factors == "short" and (
            not self.longrope_mscale or self.scaling.get("short_mscale") == self.scaling.get("long_mscale")))

    @property
    def tables(self):
        """(inv_freq, cos|sin, attention_factor) on the device of the last inputs, built on first use."""
        if self._tables is None:
            self._tables = _rope_tables(self.head_dim, self.theta, self.max_position, self._device, self.scaling,
                                        self.full_head_dim, self.context_len, self.longrope_factors,
                                        self.longrope_mscale, self.rows)
        return self._tables

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.tables[0]

    @property
    def cos_sin_cache(self) -> torch.Tensor:
        return self.tables[1]

    @property
    def attention_factor(self) -> float:
        return self.tables[2]

    @property
    def whole(self) -> bool:
        """Every dim of the head rotates in the neox layout (the fused q/k-norm + rope kernel's case)."""
        return self.head_dim == self.full_head_dim and self.gather is None and self.position == "first"

    def _to(self, device: torch.device) -> None:
        if self._device != device and self.head_dim:
            self._device, self._tables = device, None
            if self.axis_map is not None:
                self.axis_map = self.axis_map.to(device)
            if self.gather is not None:
                self.gather = self.gather.to(device)

    def _check_positions(self, positions: torch.Tensor) -> None:
        want = 1 if self.kind == "neox" else 2
        if positions.dim() != want:
            raise ValueError(f"rotary {self.kind!r} expects positions of {want} dims, got {tuple(positions.shape)}")

    def _rope(self, positions, q, k):
        return ops.rope(q, k, positions, self.inv_freq, self.cos_sin_cache, self.axis_map, self.attention_factor)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        self._check_positions(positions)
        if self.head_dim == 0:                      # nothing rotates
            return q, k
        self._to(q.device)
        if self.whole:
            return self._rope(positions, q, k)
        rd, last = self.head_dim, self.position == "last"
        q_rot, k_rot = (q[..., -rd:], k[..., -rd:]) if last else (q[..., :rd], k[..., :rd])
        if self.gather is not None:
            q_rot, k_rot = q_rot.index_select(-1, self.gather), k_rot.index_select(-1, self.gather)
        q_rot, k_rot = self._rope(positions, q_rot.contiguous(), k_rot.contiguous())
        if rd == self.full_head_dim:
            return q_rot, k_rot
        if last:        # the pass dims first, the rotated last rotary_dim dims after them (HY-V4's indexer)
            p = self.full_head_dim - rd
            return torch.cat((q[..., :p], q_rot), -1), torch.cat((k[..., :p], k_rot), -1)
        return torch.cat((q_rot, q[..., rd:]), -1), torch.cat((k_rot, k[..., rd:]), -1)

    def extra_repr(self) -> str:
        s = f"head_dim={self.full_head_dim}, theta={self.theta}, max_position={self.max_position}, kind={self.kind!r}"
        s += f", rotary_dim={self.head_dim}" if self.head_dim != self.full_head_dim else ""
        s += f", layout={self.layout!r}" if self.layout != "neox" else ""
        s += f", direction={self.direction!r}" if self.direction != "forward" else ""
        s += f", position={self.position!r}" if self.position != "first" else ""
        s += f", mrope_section={self.mrope_section}" if self.mrope_section else ""
        return s + (f", scaling={self.scaling}" if self.scaling else "")


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm, k_norm, rotary: Rotary):
    """Per-head RMSNorm of q [N, H, D] and k [N, Hk, D] (q_norm/k_norm: RMSNorm(head_dim) modules or None),
    then rotary (with its scaled cos/sin; None: no rotary on this layer). One fused Triton kernel on CUDA; the
    HF-exact reference composition on CPU. Norms the fused kernel does not cover (one of the two missing,
    different eps, a weight_offset, a bias) or a partial / interleaved rotary run as the modules themselves, then
    rotary."""
    if rotary is None:                      # a layer without rotary (NoPE): the norms alone
        return (q if q_norm is None else q_norm(q)), (k if k_norm is None else k_norm(k))
    rotary._check_positions(positions)
    rotary._to(q.device)
    if not rotary.whole or (q_norm is None) != (k_norm is None) or (q_norm is not None and (
            q_norm.eps != k_norm.eps or getattr(q_norm, "weight_offset", 0.0) or getattr(k_norm, "weight_offset", 0.0)
            or getattr(q_norm, "bias", None) is not None or getattr(k_norm, "bias", None) is not None)):
        if q_norm is not None:
            q = q_norm(q)
        if k_norm is not None:
            k = k_norm(k)
        return rotary(positions, q, k)
    qw = q_norm.weight if q_norm is not None else None
    kw = k_norm.weight if k_norm is not None else None
    eps = q_norm.eps if q_norm is not None else 0.0
    return ops.qk_norm_rope(q, k, qw, kw, eps, positions, rotary.inv_freq, rotary.cos_sin_cache, rotary.axis_map,
                            rotary.attention_factor)
