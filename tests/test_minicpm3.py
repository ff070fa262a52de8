"""MiniCPM3's three scalings (specs/minicpm3.yaml) on its tiny checkpoint: the embedding times scale_emb, each
residual branch times scale_depth / sqrt(num_hidden_layers) and the logits of the hidden state divided by
hidden_size / dim_model_base. Each arm turns one off the way transformers does (scale_emb 1; scale_depth /
dim_model_base null, which transformers reads as the no-op sqrt(num_hidden_layers) / hidden_size): transformers'
greedy tokens or log-probabilities must change, and the engine must still agree (the spec battery checks greedy
parity with all three on)."""
from __future__ import annotations

import numpy as np
import pytest
from test_scalings import _agree, _engine, _hf

ARCH = "MiniCPM3ForCausalLM"


@pytest.mark.engine
@pytest.mark.parametrize("field,neutral_value", [("scale_emb", 1.0), ("scale_depth", None),
                                                 ("dim_model_base", None)])
def test_each_minicpm3_scaling_matters(field, neutral_value, tiny_checkpoint, tmp_path):
    from fixtures.tiny_hf import edit_config

    ckpt = tiny_checkpoint(ARCH)
    prompt = np.random.default_rng(7).integers(0, 400, 11).tolist()
    base = _hf(ckpt, prompt)
    _agree(_engine(ckpt, prompt), base, "as built")

    def neutral(cfg):
        assert cfg[field] not in (None, 1.0)
        cfg[field] = neutral_value

    arm = edit_config(ckpt, tmp_path / field, neutral)
    want = _hf(arm, prompt)
    assert want[0] != base[0] or not np.allclose(want[1], base[1], atol=1e-3), \
        f"{field} = {neutral_value} changes nothing in transformers' output on the tiny checkpoint: no arm"
    _agree(_engine(arm, prompt), want, f"{field} = {neutral_value}")

