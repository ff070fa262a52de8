"""Tiny checkpoints at the settings of released checkpoints (every non-size config.json field as published, only the
sizes shrunk), served against transformers: the forms the default tiny configs do not reach.

- Falcon-11B: the new decoder architecture (GQA, qkv per KV group) with ONE shared input_layernorm
  (`num_ln_in_parallel_attn: 1`) and its leftover `ff_factor`; it was refused by the guard (min 2).
- Command R+ (c4ai-command-r-plus): `use_qk_norm: true`, a LayerNorm of each q / k head with a weight per head
  (`[heads, head_dim]`), before the interleaved rotary; it was refused (assumed false). Command R's config.json also
  carries `model_max_length` (a tokenizer leftover), which was refused as unknown.
- GPT-NeoX-20B: `attention_probs_dropout_prob` / `hidden_dropout_prob` (older names of the dropouts), refused as
  unknown.
"""
from __future__ import annotations

import pytest
from fixtures.tiny_hf import edit_config
from test_spec_battery import Tokens, _assert_same

_TOKENS = Tokens()


def _flat(tokens) -> bool:
    return all(len(set(t)) <= 2 for t in tokens)


def _served_as_transformers(ckpt, what: str, tp: int = 1) -> list:
    want = _TOKENS.hf(ckpt)
    assert not _flat(want), f"{what}: transformers' greedy tokens are flat"
    _assert_same(_TOKENS.engine(ckpt, tp), want, f"{what} tp={tp}")
    return want


# Falcon-11B's config.json (tiiuae/falcon-11B), sizes shrunk
_FALCON_11B = {"new_decoder_architecture": True, "num_kv_heads": 2, "num_ln_in_parallel_attn": 1,
               "parallel_attn": True, "bias": False, "alibi": False, "tie_word_embeddings": False,
               "ffn_hidden_size": 256, "rope_parameters": {"rope_theta": 500042.0}}


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_falcon_11b_one_shared_norm(tiny_checkpoint, tmp_path, tp):
    ckpt = tiny_checkpoint("FalconForCausalLM", overrides=_FALCON_11B)
    ckpt = edit_config(ckpt, tmp_path / "falcon11b", lambda c: c.update(ff_factor=4))
    want = _served_as_transformers(ckpt, "Falcon-11B form", tp)
    # the shared norm is not the two-norm form of the same weights' family (transformers differs between them)
    two = tiny_checkpoint("FalconForCausalLM", overrides={**_FALCON_11B, "num_ln_in_parallel_attn": 2})
    assert _TOKENS.hf(two) != want


# c4ai-command-r-plus's config.json, sizes shrunk (GQA 12 / 4 heads of 16)
_COMMAND_R_PLUS = {"hidden_size": 192, "num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 528,
                   "use_qk_norm": True, "logit_scale": 0.8333333333333334, "attention_bias": False,
                   "rope_parameters": {"rope_theta": 75000000.0}}


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_command_r_plus_per_head_qk_norm(tiny_checkpoint, tmp_path, tp):
    ckpt = tiny_checkpoint("CohereForCausalLM", overrides=_COMMAND_R_PLUS)
    ckpt = edit_config(ckpt, tmp_path / "crplus", lambda c: c.update(model_max_length=131072))
    want = _served_as_transformers(ckpt, "Command R+ form", tp)
    # sensitivity: the q/k norms matter (transformers' tokens without them differ)
    off = tiny_checkpoint("CohereForCausalLM", overrides={**_COMMAND_R_PLUS, "use_qk_norm": False})
    assert _TOKENS.hf(off) != want


def test_gpt_neox_20b_dropout_leftovers_are_accepted(tiny_checkpoint):
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.runtime.loading import registry

    cfg = tiny_config("GPTNeoXForCausalLM", {"hidden_act": "gelu_fast"}).to_dict()
    cfg.update(attention_probs_dropout_prob=0, hidden_dropout_prob=0)
    module, _ = registry.resolve(cfg)
    assert module.Config.from_hf(cfg).hidden_act == "gelu_fast"


def test_olmo3_legacy_rope_theta_other_than_the_sliding_theta_is_refused():
    """OLMo 3's releases (written by transformers 4.57) carry a top-level rope_theta, no rope_parameters. transformers 5
    reads that form with the sliding layers at theta 500000 whatever rope_theta says (Olmo3Config pops rope_theta
    twice); 4.57 turned them at rope_theta. They agree at 500000, every release's value (served); another value was
    served at rope_theta on the sliding layers, unlike transformers 5 (now refused by name)."""
    import json
    from pathlib import Path

    from transformers import Olmo3Config

    from xllm_gen.runtime.loading import registry

    real = json.loads((Path(__file__).parent / "data" / "real_configs" / "olmo3__Olmo-3.1-32B-Instruct.json").read_text())
    module, _ = registry.resolve(real)
    assert module.Config.from_hf(real).rope_local_theta == 500000.0
    legacy = {**real, "rope_theta": 10000.0}
    assert Olmo3Config(**{k: v for k, v in legacy.items() if k != "architectures"}).rope_parameters[
        "sliding_attention"]["rope_theta"] == 500000.0           # transformers 5's reading: the fix's premise
    with pytest.raises(Exception, match="rope_theta_legacy"):
        module.Config.from_hf(legacy)
    # transformers 5's own form (rope_parameters per layer type) states the sliding theta: read as written
    v5 = {k: v for k, v in real.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}}
    c = module.Config.from_hf(v5)
    assert (c.rope_theta, c.rope_local_theta) == (10000.0, 20000.0)
