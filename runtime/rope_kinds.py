"""The rope scaling kinds the rotary primitive computes (rotary.rope_parameters has the math) and the keys of a
rope-parameters mapping each reads, as (required, optional). Torch-free: the config reader checks a checkpoint's
mapping against the same table. A checkpoint names its scaling with transformers' rope_type; the compiler maps
those names to these kinds (codegen/resolver.py HF_ROPE_TYPES) and the generated config reader translates.

- default, linear, dynamic (NTK-aware base), yarn (NTK-by-parts);
- frequency_bands: frequencies below a low band divided by `factor`, above a high band kept, a smooth blend
  between (bands from low_freq_factor / high_freq_factor at original_max_position_embeddings).
- longrope (LongRoPE, Phi-3's "su"): a per-frequency divisor, `short_factor` for contexts within
  original_max_position_embeddings and `long_factor` beyond (lists of rotary_dim / 2 numbers), and an attention
  factor (given, or sqrt(1 + ln(factor) / ln(original)) with factor = max_position / original), or per regime
  short_mscale / long_mscale where given (PhiMoE; vLLM's Phi3LongRoPEScaledRotaryEmbedding reads them too).
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
}
# keys whose value is a list of positive numbers (one per rotating frequency), not one number
ROPE_LIST_KEYS = ("short_factor", "long_factor")
ROPE_KINDS = tuple(ROPE_SCALING_KEYS)
