"""EXAONE MoE (specs/exaone_moe.yaml) routing arms on its tiny checkpoint (renormalized top-k, routed scale 2.5, a
global NoPE layer between sliding ones): each arm turns one off; transformers' output must change and the engine
must still agree (the spec battery checks the checkpoint as built)."""
from __future__ import annotations

import numpy as np
import pytest
from test_scalings import _agree, _engine, _hf

ARCH = "ExaoneMoeForCausalLM"


@pytest.mark.engine
@pytest.mark.parametrize("field,value", [("norm_topk_prob", False), ("routed_scaling_factor", 1.0)])
def test_exaone_moe_arm_matters(field, value, tiny_checkpoint, tmp_path):
    from fixtures.tiny_hf import edit_config

    ckpt = tiny_checkpoint(ARCH)
    prompt = np.random.default_rng(11).integers(0, 400, 11).tolist()
    base = _hf(ckpt, prompt)
    _agree(_engine(ckpt, prompt), base, "as built")

    def arm_cfg(cfg):
        assert cfg[field] != value
        cfg[field] = value

    arm = edit_config(ckpt, tmp_path / field, arm_cfg)
    want = _hf(arm, prompt)
    assert want[0] != base[0] or not np.allclose(want[1], base[1], atol=1e-3), \
        f"{field} = {value} changes nothing in transformers' output on the tiny checkpoint: no arm"
    _agree(_engine(arm, prompt), want, f"{field} = {value}")
