"""(hT) Fast checks of the fixes the released-settings trials (tests/test_real_settings_hT.py) found:

- tencent/Hy3's config.json (num_nextn_predict_layers, qk_norm, first_k_dense_replace, expert_hidden_dim: fields
  transformers' HYV3Config never reads) was refused as unknown fields; accepted now, qk_norm assumed true (refused by
  name otherwise), and the MTP layer's tensors (model.layers.80.*) skipped at load as transformers skips them.
"""
from __future__ import annotations

import pytest
from test_real_settings import _real


def _read(cfg: dict):
    from xllm_gen.runtime.loading import registry
    module, _ = registry.resolve(cfg)
    return module.Config.from_hf(cfg)


def test_hy3_release_fields_are_accepted():
    c = _read(_real("hy_v3__Hy3"))
    assert c.num_hidden_layers == 80


def test_hy3_without_qk_norm_is_refused_by_name():
    cfg = _real("hy_v3__Hy3")
    cfg["qk_norm"] = False
    with pytest.raises(Exception, match="qk_norm"):
        _read(cfg)


def test_hy3_mtp_layer_tensors_are_skipped_like_transformers():
    import re

    from transformers import HYV3ForCausalLM

    from xllm_gen.generated.hy_v3 import model
    pats = [p for p in vars(model).values() if isinstance(p, (list, tuple)) and any(
        isinstance(x, str) and "inv_freq" in x for x in p)][0]
    for name in ("model.layers.80.eh_proj.weight", "model.layers.80.self_attn.q_proj.weight"):
        assert any(re.fullmatch(p, name) for p in pats)
        assert any(re.search(p, name) for p in HYV3ForCausalLM._keys_to_ignore_on_load_unexpected)
    assert not any(re.fullmatch(p, "model.layers.8.self_attn.q_proj.weight") for p in pats)
