"""Rotary position embeddings: neox (rotate_half) layout, and mRoPE (positions [3, N]) with interleaved or
blocked (contiguous) frequency sections; frequencies from the rope scaling kinds (default, linear, dynamic,
yarn, frequency_bands, longrope, proportional: runtime/rope_kinds.py), with transformers' arithmetic. Two further axes compose with
all of them: partial rotary (only the first `rotary_dim` dims of each head rotate, the rest pass through; the
frequencies are computed over rotary_dim, as transformers does) and the pair layout (`neox`: dim j pairs with
j + rotary_dim/2; `interleaved`: GPT-J's rotate-every-two, dim 2j pairs with 2j + 1)."""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from xllm_gen.runtime import ops
from xllm_gen.runtime.rope_kinds import ROPE_KINDS, ROPE_SCALING_KEYS

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


# ------------------------------------------------------------------------------------------ rope scaling
# Every mapping also accepts rope_type / type (its kind), rope_theta (must equal `theta`), partial_rotary_factor
# (must be 1.0) and the mRoPE keys (taken from the rotary kind, not from here).
_COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")


def rope_parameters(head_dim: int, theta: float, max_position: int,
                    scaling: Optional[Mapping[str, Any]] = None,
                    full_dim: Optional[int] = None, context_len: Optional[int] = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] float32, attention_factor) of a rope-parameter mapping whose rope_type is a kind
    of rope_kinds.py (the generated config reader translates transformers' names). `head_dim` is the number of
    rotating dims (transformers' int(head_dim * partial_rotary_factor)); `full_dim` (the whole head, default
    head_dim) is only checked against a partial_rotary_factor key of the mapping.

    Same arithmetic as transformers 5 (modeling_rope_utils.ROPE_INIT_FUNCTIONS and the models' default init),
    written here so that serving does not import transformers. `max_position` plays HF's
    config.max_position_embeddings (the default of original_max_position_embeddings, and the yarn factor when
    the mapping gives factor None). cos and sin are multiplied by attention_factor (1.0 except for yarn).

    - default: inv_freq = 1 / theta ** (arange(0, D, 2) / D).
    - linear: default / factor.
    - frequency_bands: per-wavelength scaling (factor, low_freq_factor, high_freq_factor,
      original_max_position_embeddings).
    - yarn: NTK-by-parts interpolation between default and default / factor with the linear ramp over
      [beta_fast, beta_slow] rotations at original_max_position_embeddings (truncate: floor/ceil the ramp
      bounds, default True); attention_factor given, or 0.1 * mscale * ln(factor) + 1 (ratio of the mscale and
      mscale_all_dim forms when both are given).
    - dynamic (NTK): transformers computes its initial inv_freq with seq_len = max_position_embeddings, which is
      the default inv_freq (the base factor ((factor * L / L) - (factor - 1)) ** (D / (D - 2)) is 1 up to
      rounding, reproduced here as written), and recomputes the base from the current sequence length only
      when a forward pass sees positions beyond max_position_embeddings (the "original" length for this type;
      an original_max_position_embeddings key is ignored, as transformers ignores it). That per-call rescale
      cannot be reproduced with a paged KV cache (cached keys keep the rotation they were written with), so
      this runtime uses the initial (default) inv_freq at every position: exact within max_position, plain
      extrapolation beyond it. vLLM instead fixes one NTK base for all positions, computed at
      max_position * factor, which differs from transformers already within the original length. A spec that
      serves dynamic rope should cap the engine's max_model_len at max_position.
    - longrope (transformers' _compute_longrope_parameters): inv_freq = 1 / (ext * theta ** (arange(0, D, 2) / D))
      with ext = long_factor when `context_len` > original_max_position_embeddings, else short_factor (each a
      list of D/2 numbers); attention_factor given, or sqrt(1 + ln(factor) / ln(original)) (1 for factor <= 1)
      with factor given or max_position / original; `short_mscale` / `long_mscale` (PhiMoE), where given, replace
      the attention factor in their regime. transformers picks the list per forward call from the
      longest position it sees (long_factor for the whole call once a sequence exceeds the original context),
      which a KV cache cannot follow (cached keys keep the rotation they were written with). This runtime
      decides once per engine, as vLLM does (Phi3LongRoPEScaledRotaryEmbedding.use_long_rope): the engine's
      max_model_len is `context_len` (Rotary.set_context_len), so max_model_len <= original serves every
      sequence with short_factor (what transformers computes for every sequence it can hold), and a longer
      max_model_len serves every position with long_factor (what transformers computes for a sequence that
      exceeds the original context in one forward; shorter sequences differ from transformers then).
      `context_len` None (a model built outside an engine): short_factor, transformers' initial frequencies.

    Unknown rope types, unknown keys and missing required keys raise ValueError naming them.
    """
    half = head_dim // 2
    if not scaling:
        scaling = {"rope_type": "default"}
    if not isinstance(scaling, Mapping):
        raise ValueError(f"rope scaling must be a mapping of rope parameters, not {type(scaling).__name__}")
    p = dict(scaling)
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type not in ROPE_SCALING_KEYS:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_KINDS)}")
    required, optional = ROPE_SCALING_KEYS[rope_type]
    for key in required:
        if key not in p:
            raise ValueError(f"rope_type {rope_type!r} needs rope parameter {key!r}")
    unknown = sorted(set(p) - set(required) - set(optional) - set(_COMMON_KEYS))
    if unknown:
        raise ValueError(f"rope_type {rope_type!r}: unknown rope parameter(s) {', '.join(map(repr, unknown))}; "
                         f"allowed: {', '.join(required + optional)}")
    if p.get("rope_theta") is not None and float(p["rope_theta"]) != float(theta):
        raise ValueError(f"rope parameter 'rope_theta' = {p['rope_theta']} differs from theta = {theta}")
    prf = p.get("partial_rotary_factor")
    full = head_dim if full_dim is None else full_dim
    if rope_type != "proportional" and prf is not None and (isinstance(prf, bool) or not isinstance(prf, (int, float)) or int(full * prf) != head_dim):
        raise ValueError(f"rope parameter 'partial_rotary_factor' = {prf!r} disagrees with the model's rotary dims: "
                         f"{head_dim} of head_dim {full}")
    base = theta
    dim = head_dim
    attention_factor = 1.0

    def default_inv_freq(b):
        return 1.0 / (b ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))

    def number(key):
        v = p[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"rope parameter {key!r} must be a finite number, got {v!r}")
        return v

    if rope_type == "default":
        inv_freq = default_inv_freq(base)
    elif rope_type == "linear":
        factor = number("factor")
        inv_freq = default_inv_freq(base)
        inv_freq /= factor
    elif rope_type == "dynamic":
        factor = number("factor")
        seq_len = max_position
        base = base * ((factor * seq_len / max_position) - (factor - 1)) ** (dim / (dim - 2))
        inv_freq = default_inv_freq(base)
    elif rope_type == "longrope":
        original = p.get("original_max_position_embeddings", max_position)
        factor = p.get("factor")
        factor = max_position / original if factor is None else number("factor")
        attention_factor = p.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        key = "long_factor" if context_len and context_len > original else "short_factor"
        mscale = p.get("long_mscale" if key == "long_factor" else "short_mscale")
        if mscale is not None:          # PhiMoE: the attention factor per regime (as vLLM's short / long mscale)
            attention_factor = number("long_mscale" if key == "long_factor" else "short_mscale")
        ext = p[key]
        if (not isinstance(ext, (list, tuple)) or len(ext) != half or
                not all(not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x > 0
                        for x in ext)):
            raise ValueError(f"rope parameter {key!r} must be a list of {half} positive numbers (rotary dims "
                             f"{dim} / 2), got {len(ext) if isinstance(ext, (list, tuple)) else ext!r}"
                             + (" entries" if isinstance(ext, (list, tuple)) else ""))
        other = "short_factor" if key == "long_factor" else "long_factor"
        if not isinstance(p[other], (list, tuple)) or len(p[other]) != half:
            raise ValueError(f"rope parameter {other!r} must be a list of {half} numbers (rotary dims {dim} / 2), "
                             f"got {len(p[other]) if isinstance(p[other], (list, tuple)) else p[other]!r}"
                             + (" entries" if isinstance(p[other], (list, tuple)) else ""))
        ext_factors = torch.tensor(ext, dtype=torch.float32)
        inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv_freq = 1.0 / (ext_factors * base ** inv_freq_shape)
    elif rope_type == "proportional":
        # transformers' _compute_proportional_rope_parameters: the first int(prf * D // 2) pairs at the default
        # frequencies over the whole head (exponents / D), the rest at frequency 0 (no turn); all / factor
        prop = 1.0 if prf is None else prf
        if isinstance(prop, bool) or not isinstance(prop, (int, float)) or not 0 <= prop <= 1:
            raise ValueError(f"rope parameter 'partial_rotary_factor' = {prf!r} must be a number in [0, 1] "
                             f"(rope type 'proportional')")
        if dim != full:
            raise ValueError(f"rope type 'proportional' turns the whole head ({full} dims); it does not compose "
                             f"with a partial rotary of {dim} dims")
        angles = int(prop * dim // 2)
        inv_freq = torch.zeros(half, dtype=torch.float32)
        inv_freq[:angles] = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(dtype=torch.float)
                                            / dim))
        factor = p.get("factor")
        if factor is not None:
            inv_freq /= number("factor")
    elif rope_type == "frequency_bands":
        factor = number("factor")
        low_freq_factor = number("low_freq_factor")
        high_freq_factor = number("high_freq_factor")
        old_context_len = p.get("original_max_position_embeddings", max_position)
        inv_freq = default_inv_freq(base)
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed_inv_freq = (1 - smooth_factor) * inv_freq_scaled / factor + smooth_factor * inv_freq_scaled
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_scaled)
    else:                                                   # yarn
        original = p.get("original_max_position_embeddings", max_position)
        factor = p["factor"]
        if factor is None:
            factor = max_position / original
        else:
            factor = number("factor")
        attention_factor = p.get("attention_factor")
        mscale = p.get("mscale")
        mscale_all_dim = p.get("mscale_all_dim")

        def get_mscale(scale, m=1):
            if scale <= 1:
                return 1.0
            return 0.1 * m * math.log(scale) + 1.0

        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
            else:
                attention_factor = get_mscale(factor)
        beta_fast = p.get("beta_fast") or 32
        beta_slow = p.get("beta_slow") or 1
        truncate = p.get("truncate", True)

        def find_correction_dim(num_rotations):
            return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low = find_correction_dim(beta_fast)
        high = find_correction_dim(beta_slow)
        if truncate:
            low = math.floor(low)
            high = math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001                                   # as transformers: no singular ramp
        ramp = torch.clamp((torch.arange(half, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        inv_freq_extrapolation = 1.0 / pos_freqs
        inv_freq_interpolation = 1.0 / (factor * pos_freqs)
        extrapolation_factor = 1 - ramp
        inv_freq = (inv_freq_interpolation * (1 - extrapolation_factor)
                    + inv_freq_extrapolation * extrapolation_factor)
    return inv_freq.to(torch.float32), float(attention_factor)


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
                 context_len: Optional[int] = None):
    """(inv_freq [D/2], cos|sin [max_position, D], attention_factor): float32 tensors, cos and sin already
    multiplied by attention_factor (as transformers does before casting), built once per (shape, theta,
    scaling, device) and shared by every layer: a 262k-position table is 134 MB, too much to hold once per
    layer."""
    skey = _scaling_key(scaling)
    if not scaling or dict(scaling).get("rope_type", dict(scaling).get("type")) not in CONTEXT_DEPENDENT:
        context_len = None                  # the frequencies do not depend on it: share the table
    key = (head_dim, theta, max_position, skey, full_dim, context_len, str(device))
    if key not in _TABLES:
        cpu_key = (head_dim, theta, max_position, skey, full_dim, context_len, "cpu")
        cpu = _TABLES.get(cpu_key)
        if cpu is None:
            with torch.device("cpu"):       # computed on CPU even inside a torch.device("meta"/"cuda") build
                inv_freq, factor = rope_parameters(head_dim, theta, max_position, scaling, full_dim, context_len)
                freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
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
    that read it (transformers' rule for a config with a top-level original_max_position_embeddings, Phi-3).
    longrope's frequencies depend on the engine's max_model_len: the runner calls `set_context_len`.
    """

    def __init__(self, head_dim: int, theta: float, max_position: int, kind: str = "neox",
                 mrope_section: Optional[Sequence[int]] = None, scaling: Optional[Mapping[str, Any]] = None,
                 rotary_dim: Optional[int] = None, layout: str = "neox",
                 original_max_position: Optional[int] = None, direction: str = "forward", position: str = "first"):
        super().__init__()
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
            # the model's own original context (Phi-3's top-level original_max_position_embeddings, which
            # transformers writes over the rope mapping's key)
            self.scaling["original_max_position_embeddings"] = original_max_position
        self.context_len: Optional[int] = None      # the engine's max_model_len (set_context_len)
        half = rotary_dim // 2
        # the tables (inv_freq, cos|sin, attention_factor) are built on first use, on the device of the inputs:
        # a model built only to read its parameter shapes (tp_check's meta build at compile time) never builds
        # them (a 10M-position table is 2.6 GB of float32 per half). No rotating dim (transformers:
        # int(head_dim * partial_rotary_factor) == 0): q and k pass unchanged.
        self._device = torch.device("cpu")
        self._tables = None if rotary_dim else (torch.empty(0), torch.empty(max_position, 0), 1.0)
        if rotary_dim:      # the scaling is checked now (a bad mapping fails the build, naming the key): cheap
            rope_parameters(rotary_dim, self.theta, max_position, self.scaling, head_dim)
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
        long_factor beyond; see rope_parameters) choose their tables from it, for every position."""
        if self.rope_type not in CONTEXT_DEPENDENT or not self.head_dim or context_len == self.context_len:
            return
        self.context_len = context_len
        self._tables = None                         # rebuilt on next use, with the context's factors

    @property
    def tables(self):
        """(inv_freq, cos|sin, attention_factor) on the device of the last inputs, built on first use."""
        if self._tables is None:
            self._tables = _rope_tables(self.head_dim, self.theta, self.max_position, self._device, self.scaling,
                                        self.full_head_dim, self.context_len)
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


def yarn_mscale(scaling: Optional[Mapping[str, Any]]) -> float:
    """The softmax-scale factor that multi-head latent attention derives from its rope parameters (transformers'
    yarn_apply_mscale): mscale(factor, mscale_all_dim) ** 2 with mscale(s, m) = 0.1 * m * ln(s) + 1 (1 for s <= 1)
    when the rope type is not `default` and `mscale_all_dim` is set (non-zero); else 1."""
    p = dict(scaling or {})
    if p.get("rope_type", p.get("type", "default")) == "default" or not p.get("mscale_all_dim"):
        return 1.0
    factor = float(p["factor"])
    m = 1.0 if factor <= 1 else 0.1 * float(p["mscale_all_dim"]) * math.log(factor) + 1.0
    return m * m


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
