"""(hS) Fast tests of the fixes found by the released-settings trials of tests/test_real_settings_hS.py: fields of
published config.json files that transformers never reads, refused before as unknown (so the release was refused at
load); where a field's other value would change the model transformers builds, that value stays refused by name.

- Mellum 2 / 2.1 (MellumForCausalLM): `use_sliding_window: true`, `max_window_layers: 0` (Qwen-config leftovers:
  transformers' Mellum places its windows by layer_types alone) and `num_mtp_layers` (the mtp.* layer is not loaded).
- HyperCLOVAX-SEED-Think-14B: `end_token_id`, a generation-time id of the original code.
- Solar-Open-100B: `intermediate_size: 10240` (transformers' Solar Open has no dense MLP; the shared experts are sized
  by moe_intermediate_size) and `first_k_dense_replace: 0` (every layer the mixture, as transformers builds it; a dense
  prefix is refused by name).
- Youtu-LLM-2B: `mlp_bias: false` (transformers' Youtu MLP is always bias-free; true is refused by name).
- Youtu-LLM-2B as its mlx-community export carries it: `rope_scaling: {type: yarn, factor: 1.0, mscale_all_dim: 0}`.
  transformers tests yarn's mscale / mscale_all_dim by their truth (0 = absent: no mscale ratio in the attention
  factor, no softmax mscale); the rope parser refused 0 as not a positive number. Now 0 is read as absent (runtime).
- Qwen3-VL / Qwen3-VL-MoE: transformers' ConditionalGeneration ties the head by the top-level tie_word_embeddings alone
  (false where absent); the spec fell back to text_config.tie_word_embeddings (true on Qwen3-VL-4B, the text config
  class's default on the MoE releases), so a config.json without the top-level flag was served tied where
  transformers serves the stored head (refused at load when the two differ, served wrong where they don't exist).
"""
from __future__ import annotations

import pytest
from fixtures.tiny_hf import edit_config, tiny_config
from test_spec_battery import Tokens, _assert_same


def _config(arch: str, **fields):
    from xllm_gen.runtime.loading import registry

    cfg = tiny_config(arch).to_dict()
    cfg.update(fields)
    module, _ = registry.resolve(cfg)
    return module.Config, cfg


@pytest.mark.parametrize("arch,fields", [
    ("MellumForCausalLM", {"use_sliding_window": True, "max_window_layers": 0, "num_mtp_layers": 1}),
    ("HyperCLOVAXForCausalLM", {"end_token_id": 128001, "pretraining_tp": 1}),
    ("SolarOpenForCausalLM", {"intermediate_size": 10240, "first_k_dense_replace": 0}),
    ("YoutuForCausalLM", {"mlp_bias": False}),
])
def test_released_leftovers_are_accepted(arch, fields):
    config_cls, cfg = _config(arch, **fields)
    config_cls.from_hf(cfg)


@pytest.mark.parametrize("arch,field,value", [
    ("SolarOpenForCausalLM", "first_k_dense_replace", 1),
    ("YoutuForCausalLM", "mlp_bias", True),
])
def test_other_values_are_refused_by_name(arch, field, value):
    config_cls, cfg = _config(arch, **{field: value})
    with pytest.raises(ValueError, match=field):
        config_cls.from_hf(cfg)


@pytest.mark.parametrize("arch", ["Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"])
@pytest.mark.parametrize("top,text", [(None, True), (False, True), (True, False), (None, None)])
def test_qwen3_vl_ties_by_the_top_level_flag(arch, top, text):
    import transformers

    config_cls, cfg = _config(arch)
    cfg.pop("tie_word_embeddings", None)
    cfg["text_config"].pop("tie_word_embeddings", None)
    if top is not None:
        cfg["tie_word_embeddings"] = top
    if text is not None:
        cfg["text_config"]["tie_word_embeddings"] = text
    want = getattr(transformers, arch).config_class.from_dict(cfg).tie_word_embeddings   # what the model ties by
    assert want is bool(top)
    assert config_cls.from_hf(cfg).tie_word_embeddings is want


@pytest.mark.parametrize("zero", ["mscale_all_dim", "mscale"])
def test_yarn_zero_mscale_reads_as_absent(tiny_checkpoint, tmp_path, zero):
    """A YaRN block with mscale_all_dim (or mscale) 0 at factor 8 (the tiny Youtu's, whose attention also takes the
    softmax mscale): served as transformers serves it, which reads the 0 as no value."""
    ckpt = tiny_checkpoint("YoutuForCausalLM")
    ckpt = edit_config(ckpt, tmp_path / zero, lambda c: c["rope_parameters"].update({zero: 0}))
    tokens = Tokens()
    _assert_same(tokens.engine(ckpt, 1), tokens.hf(ckpt), f"yarn {zero}=0")
