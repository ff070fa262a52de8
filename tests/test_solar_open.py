"""Solar Open (specs/solar_open.yaml) on its tiny checkpoint (routed scale 2.5): the routed-scale arm (1) must change
transformers' output and the engine must still agree; a partial rotary factor (GLM-4.5's 0.5, which transformers'
Solar Open attention cannot run) is refused at load, naming the field."""
from __future__ import annotations

import numpy as np
import pytest
from test_scalings import _agree, _engine, _hf

ARCH = "SolarOpenForCausalLM"


@pytest.mark.engine
def test_routed_scale_matters(tiny_checkpoint, tmp_path):
    edit = "routed_scaling_factor"
    from fixtures.tiny_hf import edit_config

    ckpt = tiny_checkpoint(ARCH)
    prompt = np.random.default_rng(17).integers(0, 400, 11).tolist()
    base = _hf(ckpt, prompt)
    _agree(_engine(ckpt, prompt), base, "as built")

    def arm_cfg(cfg):
        assert cfg["routed_scaling_factor"] == 2.5
        cfg["routed_scaling_factor"] = 1.0

    arm = edit_config(ckpt, tmp_path / edit, arm_cfg)
    want = _hf(arm, prompt)
    assert want[0] != base[0] or not np.allclose(want[1], base[1], atol=1e-3), \
        f"{edit}: changes nothing in transformers' output on the tiny checkpoint: no arm"
    _agree(_engine(arm, prompt), want, edit)


def test_partial_rotary_is_refused_by_name(tiny_checkpoint, tmp_path):
    from fixtures.tiny_hf import edit_config

    from xllm_gen import LLM

    def half(cfg):
        cfg["rope_parameters"]["partial_rotary_factor"] = 0.5

    arm = edit_config(tiny_checkpoint(ARCH), tmp_path / "half", half)
    with pytest.raises(Exception, match="partial_rotary_factor"):
        LLM(model=str(arm), device="cpu", dtype="float32", block_size=4)
