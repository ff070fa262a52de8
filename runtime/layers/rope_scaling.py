"""The rope scaling kinds' frequencies (the kinds and their keys: runtime/rope_kinds.py): rope_parameters gives a
rotary's inv_freq and attention factor from a rope-parameter mapping, with transformers' arithmetic;
yarn_mscale the softmax-scale factor multi-head latent attention derives from the same mapping. The rotary
primitive (layers/rotary.py) builds its cos / sin tables from these.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch

from xllm_gen.runtime.rope_kinds import ROPE_KINDS, ROPE_SCALING_KEYS

# ------------------------------------------------------------------------------------------ rope scaling
# Every mapping also accepts rope_type / type (its kind), rope_theta (must equal `theta`), partial_rotary_factor
# (must be 1.0) and the mRoPE keys (taken from the rotary kind, not from here).
_COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")


def rope_parameters(head_dim: int, theta: float, max_position: int,
                    scaling: Optional[Mapping[str, Any]] = None,
                    full_dim: Optional[int] = None, context_len: Optional[int] = None,
                    longrope_factors: str = "by_context", longrope_mscale: bool = False) -> tuple[torch.Tensor, float]:
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
      with factor given or max_position / original; with `longrope_mscale`, `short_mscale` / `long_mscale`,
      where given, replace the attention factor in their regime (PhiMoE's rotary; transformers' generic longrope,
      Phi-3's, ignores them). transformers picks the list per forward call from the
      longest position it sees (long_factor for the whole call once a sequence exceeds the original context),
      which a KV cache cannot follow (cached keys keep the rotation they were written with). This runtime
      decides once per engine, as vLLM does (Phi3LongRoPEScaledRotaryEmbedding.use_long_rope): the engine's
      max_model_len is `context_len` (Rotary.set_context_len), so max_model_len <= original serves every
      sequence with short_factor (what transformers computes for every sequence it can hold), and a longer
      max_model_len serves every position with long_factor (what transformers computes for a sequence that
      exceeds the original context in one forward; shorter sequences differ from transformers then).
      `context_len` None (a model built outside an engine): short_factor, transformers' initial frequencies.
      `longrope_factors` "short": short_factor at every context (a model whose reference computes its frequencies
      with short_factor whatever the length and only its attention factor per regime); the attention factor
      (short_mscale / long_mscale) still follows the context's regime.

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
        if longrope_factors not in ("by_context", "short"):
            raise ValueError(f"longrope_factors must be 'by_context' or 'short', not {longrope_factors!r}")
        long = bool(context_len and context_len > original)
        key = "long_factor" if long and longrope_factors == "by_context" else "short_factor"
        mscale = p.get("long_mscale" if long else "short_mscale") if longrope_mscale else None
        if mscale is not None:          # the attention factor per regime (as vLLM's short / long mscale)
            attention_factor = number("long_mscale" if long else "short_mscale")
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
