"""Youtu-LLM (specs/youtu.yaml): the rotary layout of its MLA rope dims follows `rope_interleave`. The tiny
checkpoint rotates them in interleaved pairs (transformers' default); the arm switches to the neox halves:
transformers' output must change and the engine must still agree (the spec battery checks the default)."""
from __future__ import annotations

import numpy as np
import pytest
from test_scalings import _agree, _engine, _hf

ARCH = "YoutuForCausalLM"


@pytest.mark.slow     # a sensitivity arm (the spec and conformance batteries run Youtu's parity by default)
@pytest.mark.engine
def test_rope_interleave_matters(tiny_checkpoint, tmp_path):
    from fixtures.tiny_hf import edit_config

    ckpt = tiny_checkpoint(ARCH)
    prompt = np.random.default_rng(3).integers(0, 400, 11).tolist()
    base = _hf(ckpt, prompt)
    _agree(_engine(ckpt, prompt), base, "as built")

    def neox(cfg):
        assert cfg.get("rope_interleave", True) is True
        cfg["rope_interleave"] = False

    arm = edit_config(ckpt, tmp_path / "neox", neox)
    want = _hf(arm, prompt)
    assert want[0] != base[0] or not np.allclose(want[1], base[1], atol=1e-3), \
        "rope_interleave = false changes nothing in transformers' output on the tiny checkpoint: no arm"
    _agree(_engine(arm, prompt), want, "rope_interleave = false")
