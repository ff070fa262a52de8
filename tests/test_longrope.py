"""LongRoPE (`longrope`, Phi-3's older `su`): the rope kind of runtime/rope_kinds.py, served by specs/phi3.yaml on tiny
Phi-3 checkpoints with Phi-4-mini's partial rotary (partial_rotary_factor 0.75: 12 of 16 dims rotate, 6 factors).

transformers picks short_factor or long_factor per forward call from the longest position it sees. The engine picks
once per engine from its max_model_len, as vLLM does (runtime/layers/rotary.py rope_parameters): max_model_len <=
original_max_position_embeddings serves every position with short_factor, a longer one with long_factor. So:

- short regime: original 64, max_position_embeddings 128 (factor 2, attention factor sqrt(1 + ln 2 / ln 64)),
  engine max_model_len 64; transformers' generate on prompts of 3..30 tokens (+ 16 new) never exceeds 64 positions,
  so it uses short_factor throughout: greedy tokens must be identical;
- long regime: original 8, max_position_embeddings 128, engine max_model_len 128 (default); prompts of 9, 17, 30
  tokens exceed 8 positions already at prefill, so transformers' generate uses long_factor in every forward of the
  run (prefill and each decode step): the same computation as the engine's, greedy tokens must be identical. (A
  prompt within 8 tokens that grows past 8 is not compared: transformers switches the factor mid-generation while
  its cache keeps keys rotated with the short factor; no paged-cache engine reproduces that.)

Sensitivity: the engine's short / long choice changes its output; without the scaling (default rope)
transformers' and the engine's tokens both change. Guard: missing or mis-sized factor lists and a rope type the spec
does not model are refused naming the key.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

ARCH = "Phi3ForCausalLM"
HALF = 6                                  # head_dim 16 * partial_rotary_factor 0.75 / 2
_RNG = np.random.default_rng(7)
SHORT = [round(float(x), 4) for x in _RNG.uniform(1.0, 3.0, HALF)]
LONG = [round(float(x), 4) for x in _RNG.uniform(2.0, 12.0, HALF)]
PROMPTS = [np.random.default_rng(1).integers(0, 400, n).tolist() for n in (3, 9, 17, 30)]
STEPS = 16


def _overrides(original: int, max_position: int = 128, short=SHORT, long=LONG, rope_type="longrope") -> dict:
    return {"rope_parameters": {"rope_type": rope_type, "rope_theta": 10000.0, "short_factor": short,
                                "long_factor": long, "partial_rotary_factor": 0.75},
            "partial_rotary_factor": 0.75, "original_max_position_embeddings": original,
            "max_position_embeddings": max_position}


def _engine(ckpt, prompts, max_model_len=None):
    from xllm_gen import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4, max_model_len=max_model_len) as llm:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _hf(ckpt, prompts):
    from hf_ref import hf_greedy

    return hf_greedy(ckpt, prompts, STEPS)


@pytest.mark.engine
@pytest.mark.slow      # ~12 s; the default run has the spec battery's short-regime longrope arm
def test_short_regime_matches_hf_and_scaling_matters(tiny_checkpoint, tmp_path):
    from fixtures.tiny_hf import edit_config

    ckpt = tiny_checkpoint(ARCH, overrides=_overrides(64))
    want = _hf(ckpt, PROMPTS)
    assert _engine(ckpt, PROMPTS, max_model_len=64) == want
    # sensitivity: the long factor (an engine whose context exceeds the original one) changes the output
    assert _engine(ckpt, PROMPTS, max_model_len=128) != want
    # and without the scaling transformers' own output changes, and the engine follows it
    plain = edit_config(ckpt, tmp_path / "plain", lambda c: c.update(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}))
    plain_want = _hf(plain, PROMPTS)
    assert plain_want != want, "fixture: the longrope scaling changes nothing in transformers' output"
    assert _engine(plain, PROMPTS, max_model_len=64) == plain_want


@pytest.mark.engine
def test_long_regime_matches_hf(tiny_checkpoint):
    ckpt = tiny_checkpoint(ARCH, overrides=_overrides(8))
    prompts = [p for p in PROMPTS if len(p) > 8]
    want = _hf(ckpt, prompts)
    assert _engine(ckpt, prompts) == want          # max_model_len 128 > 8: long_factor at every position
    # sensitivity: the factors themselves (long_factor swapped for short_factor) change transformers' output
    swapped = tiny_checkpoint(ARCH, overrides=_overrides(8, short=LONG, long=SHORT))
    assert _hf(swapped, prompts) != want


def test_original_context_is_the_top_level_field():
    """The top-level original_max_position_embeddings (Phi3Config's default 4096 when absent) is what transformers
    uses for longrope, over the mapping's key; the frequencies and attention factor equal transformers' for both
    the short (engine context within it) and the long choice."""
    import torch
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from xllm_gen.generated.phi3.model import Config, Phi3Attention

    hf = {"architectures": [ARCH], "model_type": "phi3", "vocab_size": 512, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 32768, "partial_rotary_factor": 0.75, "eos_token_id": 0, "pad_token_id": 0,
          "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                           "original_max_position_embeddings": 16}}
    cfg = Config.from_hf(hf)
    assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.original_max_position_embeddings == 4096
    rot = Phi3Attention(cfg, 0).rotary_emb
    ref = Phi3Config.from_dict(hf)              # as from_pretrained reads config.json
    assert ref.rope_parameters["original_max_position_embeddings"] == 4096
    for context, seq_len in ((4096, None), (32768, 4097)):
        rot.set_context_len(context)
        inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](ref, "cpu", seq_len=seq_len)
        assert torch.equal(rot.inv_freq, inv_freq) and rot.attention_factor == factor


@pytest.mark.parametrize("alias", ["su", "yarn"])
def test_older_names_are_longrope(alias):
    """The first Phi-3-mini-128k / Phi-3-medium-128k configs name the rope type `su` (Phi3Config also reads `yarn`):
    transformers reads either as longrope with the top-level original context, so the spec's `aliases` serve them as
    longrope (refused as an unmodeled rope type before): the frequencies and attention factor equal transformers'."""
    import torch
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from xllm_gen.generated.phi3.model import Config, Phi3Attention

    hf = {"architectures": [ARCH], "model_type": "phi3", "vocab_size": 512, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "original_max_position_embeddings": 8, "partial_rotary_factor": 0.75,
          "eos_token_id": 0, "pad_token_id": 0,
          "rope_scaling": {"type": alias, "short_factor": SHORT, "long_factor": LONG}}
    cfg = Config.from_hf(hf)
    assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.original_max_position_embeddings == 8
    assert (cfg.rope_scaling["short_factor"], cfg.rope_scaling["long_factor"]) == (SHORT, LONG)
    ref = Phi3Config.from_dict(hf)
    assert ref.rope_parameters["rope_type"] == "longrope"
    rot = Phi3Attention(cfg, 0).rotary_emb
    for context, seq_len in ((8, None), (256, 9)):
        rot.set_context_len(context)
        inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](ref, "cpu", seq_len=seq_len)
        assert torch.equal(rot.inv_freq, inv_freq) and rot.attention_factor == factor


@pytest.mark.parametrize("edit, needle", [
    (lambda rp: rp.pop("long_factor"), "long_factor"),
    (lambda rp: rp.update(short_factor=SHORT[:-1]), "short_factor"),
    (lambda rp: rp.update(long_factor=LONG + [1.0]), "long_factor"),
    (lambda rp: rp.update(short_factor=[1.0, -2.0, 1.0, 1.0, 1.0, 1.0]), "short_factor"),
    (lambda rp: rp.update(rope_type="dynamic"), "rope_type='dynamic'"),
])
def test_guard_refuses_bad_longrope(edit, needle, tiny_checkpoint, tmp_path):
    from fixtures.tiny_hf import edit_config

    from xllm_gen import LLM

    ckpt = tiny_checkpoint(ARCH, overrides=_overrides(64))
    bad = edit_config(ckpt, tmp_path / "bad", lambda c: edit(c["rope_parameters"]))
    with pytest.raises(ValueError, match=needle.replace("[", r"\[")) as e:
        LLM(model=str(bad), device="cpu", dtype="float32")
    assert "config.json" in str(e.value) or "specs/phi3.yaml" in str(e.value), str(e.value)
    json.loads((bad / "config.json").read_text())


@pytest.mark.engine
def test_long_regime_is_announced(tiny_checkpoint, caplog):
    """An engine context beyond the original one serves every position with long_factor, where transformers keeps
    short_factor for sequences within the original context (the real Phi-3.5-mini at its default max_model_len
    131072 > 4096): a warning says so and how to get short_factor; none within the original context."""
    import logging

    from xllm_gen import LLM

    ckpt = tiny_checkpoint(ARCH, overrides=_overrides(64))
    for max_model_len, warned in ((64, False), (128, True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="xllm_gen"):
            LLM(model=str(ckpt), device="cpu", dtype="float32", max_model_len=max_model_len).shutdown()
        msgs = [r.getMessage() for r in caplog.records if "longrope" in r.getMessage()]
        assert bool(msgs) == warned, msgs
        if warned:
            assert "original context 64" in msgs[0] and "max_model_len <= 64" in msgs[0], msgs[0]


def test_mscale_keys_only_where_the_rotary_reads_them():
    """short_mscale / long_mscale in a longrope mapping are PhiMoE's: its rotary (the spec's `longrope_mscale: true`)
    takes them as the attention factor per regime; transformers' generic longrope (Phi-3) ignores them, and so does
    a rotary without the flag (it applied them before, serving such a Phi-3 checkpoint wrong with no refusal)."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from xllm_gen.runtime.layers.rope_scaling import rope_parameters

    scaling = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
               "original_max_position_embeddings": 16, "short_mscale": 1.3, "long_mscale": 1.7}
    ref = Phi3Config(hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.75, max_position_embeddings=256,
                     original_max_position_embeddings=16,
                     rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.75, **scaling})
    for context, seq_len in ((16, None), (256, 17)):
        _, want = ROPE_INIT_FUNCTIONS["longrope"](ref, "cpu", seq_len=seq_len)
        _, got = rope_parameters(12, 10000.0, 256, scaling, 16, context)
        _, phimoe = rope_parameters(12, 10000.0, 256, scaling, 16, context, longrope_mscale=True)
        assert got == want != phimoe == (1.3 if context == 16 else 1.7)
