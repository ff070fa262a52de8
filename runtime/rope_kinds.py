"""The rope scaling kinds the rotary primitive computes (layers/rope_scaling.rope_parameters has the math) and the
keys of a rope-parameters mapping each reads, as (required, optional). Torch-free: the config reader checks a checkpoint's
mapping against the same table. A checkpoint names its scaling with transformers' rope_type; the compiler maps
those names to these kinds (codegen/resolver.py HF_ROPE_TYPES) and the generated config reader translates.

- default, linear, dynamic (NTK-aware base), yarn (NTK-by-parts);
- frequency_bands: frequencies below a low band divided by `factor`, above a high band kept, a smooth blend
  between (bands from low_freq_factor / high_freq_factor at original_max_position_embeddings).
- longrope (LongRoPE; "su" in early releases): a per-frequency divisor, `short_factor` for contexts within
  original_max_position_embeddings and `long_factor` beyond (lists of rotary_dim / 2 numbers), and an attention
  factor (given, or sqrt(1 + ln(factor) / ln(original)) with factor = max_position / original), or per regime
  short_mscale / long_mscale where given (a MoE release's; vLLM's LongRoPE rotary reads them too).
- proportional (transformers' `_compute_proportional_rope_parameters`): the whole
  head rotates in the neox layout with the default frequencies over head_dim for the first
  int(partial_rotary_factor * head_dim // 2) pairs and frequency 0 (cos 1, sin 0: no turn) for the rest, all
  divided by `factor`. Unlike partial rotary (`fraction`), the exponents are over the whole head_dim and the pairs
  are (j, j + head_dim / 2); here `partial_rotary_factor` is a key of the kind, not the rotary's width.
"""
from __future__ import annotations

ROPE_SCALING_KEYS = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ("original_max_position_embeddings",)),
    "yarn": (("factor",), ("original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                           "mscale", "mscale_all_dim", "truncate")),
    "frequency_bands": (("factor", "low_freq_factor", "high_freq_factor"), ("original_max_position_embeddings",)),
    "longrope": (("short_factor", "long_factor"), ("original_max_position_embeddings", "factor", "attention_factor",
                                                   "short_mscale", "long_mscale")),
    "proportional": ((), ("factor", "partial_rotary_factor")),
}
# keys whose value is a list of positive numbers (one per rotating frequency), not one number
ROPE_LIST_KEYS = ("short_factor", "long_factor")
# the keys of a rope mapping read whatever its type (its type, theta and the multimodal sections)
ROPE_SHARED_KEYS = ("rope_type", "type", "rope_theta", "mrope_section", "mrope_interleaved")
# config.json's rope mapping under its two names: transformers 5's, and the legacy one, which its configs take
# in place of the other where both are given (runtime/loading/hf_config.py _rope_scaling_wins)
ROPE_MAPPING, LEGACY_ROPE_MAPPING = "rope_parameters", "rope_scaling"
ROPE_KINDS = tuple(ROPE_SCALING_KEYS)
