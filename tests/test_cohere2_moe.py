"""Cohere 2 MoE (specs/cohere2_moe.yaml) arms on its tiny checkpoint (a dense full layer with rotary, a sliding MoE
layer, a full MoE layer without rotary): the expert scoring chosen by config.json (`expert_selection_fn`, a `moe`
`scoring` read from a str symbol; the tiny checkpoint scores by sigmoid, the arm by softmax), an optional shared expert averaged or summed (`shared_expert.enabled` /
`scale`) and the dense prefix's forced rotary. Each arm must change transformers' output
and the engine must agree (the conformance battery checks the checkpoint as built)."""
from __future__ import annotations

import numpy as np
import pytest
from test_scalings import _agree, _engine, _hf

ARCH = "Cohere2MoeForCausalLM"


def _arm(tiny_checkpoint, tmp_path, edits: dict, label: str, **build):
    from fixtures.tiny_hf import edit_config

    ckpt = tiny_checkpoint(ARCH, **build)
    prompt = np.random.default_rng(7).integers(0, 400, 12).tolist()
    base = _hf(ckpt, prompt)

    def edit(cfg):
        for k, v in edits.items():
            assert cfg.get(k) != v
            cfg[k] = v

    arm = edit_config(ckpt, tmp_path / label, edit)
    want = _hf(arm, prompt)
    assert want[0] != base[0] or not np.allclose(want[1], base[1], atol=1e-3), \
        f"{edits} changes nothing in transformers' output on the tiny checkpoint: no arm"
    _agree(_engine(arm, prompt), want, label)


@pytest.mark.engine
def test_softmax_scoring_from_config(tiny_checkpoint, tmp_path):
    # the tiny checkpoint scores by sigmoid; the arm: transformers' default, a softmax over the top-k logits
    _arm(tiny_checkpoint, tmp_path, {"expert_selection_fn": "softmax"}, "softmax")


@pytest.mark.slow
@pytest.mark.engine
def test_sigmoid_scoring_not_renormalized(tiny_checkpoint, tmp_path):
    _arm(tiny_checkpoint, tmp_path, {"norm_topk_prob": False}, "sigmoid_raw")


@pytest.mark.engine
def test_shared_expert_summed_not_averaged(tiny_checkpoint, tmp_path):
    # a checkpoint with a shared expert (optional: `shared_expert.enabled`), averaged with the routed experts by
    # default (`shared_expert.scale` and `routed_scale` 0.5); the arm sums them
    _arm(tiny_checkpoint, tmp_path, {"shared_expert_combination_strategy": "sum"}, "shared_sum",
         overrides={"num_shared_experts": 1})


@pytest.mark.slow
@pytest.mark.engine
def test_dense_prefix_without_forced_rotary(tiny_checkpoint, tmp_path):
    # prefix pattern 2: the dense full layer 0 no longer applies rotary (layer_types are explicit in config.json)
    _arm(tiny_checkpoint, tmp_path, {"prefix_dense_sliding_window_pattern": 2}, "no_force_rope")


def test_guard_refuses_unmodeled_forms():
    from conformance.families import config_json

    from generated.cohere2_moe.model import Config

    # (rms_norm_eps, the RMSNorm form, is served since hR: tests/test_released_settings_hR.py)
    for field, value in [("shared_expert_combination_strategy", "max"), ("expert_selection_fn", "relu")]:
        with pytest.raises(Exception) as e:
            Config.from_hf({**config_json(ARCH), field: value})
        assert field in str(e.value), (field, str(e.value))
