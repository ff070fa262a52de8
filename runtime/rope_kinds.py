"""The rope scaling kinds the rotary primitive computes (rotary.rope_parameters has the math) and the keys of a
rope-parameters mapping each reads, as (required, optional). Torch-free: the config reader checks a checkpoint's
mapping against the same table. A checkpoint names its scaling with transformers' rope_type; the compiler maps
those names to these kinds (codegen/resolver.py HF_ROPE_TYPES) and the generated config reader translates.

- default, linear, dynamic (NTK-aware base), yarn (NTK-by-parts);
- frequency_bands: frequencies below a low band divided by `factor`, above a high band kept, a smooth blend
  between (bands from low_freq_factor / high_freq_factor at original_max_position_embeddings).
"""
from __future__ import annotations

ROPE_SCALING_KEYS = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ("original_max_position_embeddings",)),
    "yarn": (("factor",), ("original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                           "mscale", "mscale_all_dim", "truncate")),
    "frequency_bands": (("factor", "low_freq_factor", "high_freq_factor"), ("original_max_position_embeddings",)),
}
ROPE_KINDS = tuple(ROPE_SCALING_KEYS)
