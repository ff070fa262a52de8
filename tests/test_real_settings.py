"""Tiny checkpoints at the real settings of released checkpoints: the config.json of tests/data/real_configs (or, for
a release without a file there, its fields as published), every non-size field as released (rope scaling mappings
with their factor lists, windows, soft-caps, partial rotary, biases, tie, norm flags), only the sizes shrunk; the
weights from transformers' own class (tests/fixtures/tiny_hf.py), config.json replaced by the shrunken real file.
`xllm-gen verify` must find the same greedy tokens and per-layer states as transformers.

Where a real list is per rotating frequency (longrope's short / long factors), it is subsampled to the tiny head.
The long-context regimes shrink the original context too (8, ratio 32 as Phi-3.5-mini's 4096 -> 131072), so the
prompts (9..30 tokens) exceed it from their prefill on.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

REAL = Path(__file__).parent / "data" / "real_configs"
ROOT = Path(__file__).resolve().parents[1]
_META = ("architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "_name_or_path", "bos_token_id",
         "eos_token_id", "pad_token_id", "model_type", "_attn_implementation")


def _real(stem: str) -> dict:
    return json.loads((REAL / f"{stem}.json").read_text())


def _shrink_factors(cfg: dict, n: int) -> dict:
    rs = dict(cfg["rope_scaling"])
    for key in ("short_factor", "long_factor"):
        rs[key] = [rs[key][i] for i in np.linspace(0, len(rs[key]) - 1, n).round().astype(int)]
    return {**cfg, "rope_scaling": rs}


def _phi35(rope_type: str, long: bool) -> dict:
    c = _real("phi3__Phi-3.5-mini-instruct")
    c.update(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
             intermediate_size=256, vocab_size=512)
    c = _shrink_factors(c, 16)                     # head_dim 32: 16 rotating frequencies
    c["rope_scaling"]["type"] = rope_type
    if long:
        c.update(original_max_position_embeddings=8, max_position_embeddings=256)
    return c


def _gemma2_27b() -> dict:
    c = _real("gemma2__gemma-2-27b")               # query_pre_attn_scalar = hidden / heads (144), not head_dim (128)
    c.update(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
             num_hidden_layers=4, intermediate_size=192, vocab_size=512, sliding_window=6, sliding_window_size=6)
    return c


# stabilityai/stablelm-2-12b (its config.json as published): GQA 32 / 8, per-head q/k LayerNorms, parallel residual
_STABLELM_2_12B = {
    "architectures": ["StableLmForCausalLM"], "bos_token_id": 100257, "eos_token_id": 100257, "hidden_act": "silu",
    "hidden_dropout": 0.0, "attention_dropout": 0.0, "hidden_size": 160, "initializer_range": 0.01,
    "intermediate_size": 320, "layer_norm_eps": 1e-05, "max_position_embeddings": 4096, "model_type": "stablelm",
    "num_attention_heads": 4, "num_hidden_layers": 3, "num_key_value_heads": 1, "partial_rotary_factor": 0.25,
    "qk_layernorm": True, "rope_scaling": None, "rope_theta": 10000, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_parallel_residual": True, "use_qkv_bias": False,
    "vocab_size": 512}


def _mistral_nemo() -> dict:
    c = _real("mistral__Mistral-7B-v0.3")          # Mistral-Nemo: head_dim 128 beside hidden 5120 / 32 heads (160)
    c.update(hidden_size=160, num_attention_heads=4, num_key_value_heads=1, head_dim=32, num_hidden_layers=3,
             intermediate_size=256, vocab_size=512, max_position_embeddings=1024000, rope_theta=1000000.0,
             sliding_window=None)
    return c


CASES = {
    # the first Phi-3-mini-128k / Phi-3-medium-128k releases name longrope `su` (refused before)
    "phi3-128k-su-short": ("Phi3ForCausalLM", "phi3", lambda: _phi35("su", False), (3, 9, 17, 30)),
    "phi3.5-mini-long": ("Phi3ForCausalLM", "phi3", lambda: _phi35("longrope", True), (9, 17, 30)),
    "gemma2-27b": ("Gemma2ForCausalLM", "gemma2", _gemma2_27b, (3, 9, 17, 30)),
    "stablelm-2-12b": ("StableLmForCausalLM", "stablelm", lambda: dict(_STABLELM_2_12B), (3, 9, 17, 30)),
    "mistral-nemo": ("MistralForCausalLM", "mistral", _mistral_nemo, (3, 9, 17, 30)),
}


def _build(tmp: Path, arch: str, real: dict) -> Path:
    from fixtures.tiny_hf import make_tiny_checkpoint

    ov = {k: v for k, v in real.items() if k not in _META}
    rs = ov.pop("rope_scaling", None)
    rp = {"rope_type": "default", "rope_theta": ov.get("rope_theta", 10000.0)}
    if isinstance(rs, dict):
        rp = {**{k: v for k, v in rs.items() if k != "type"}, "rope_type": "longrope", "rope_theta": rp["rope_theta"]}
    if "partial_rotary_factor" in ov:
        rp["partial_rotary_factor"] = ov["partial_rotary_factor"]
    ov["rope_parameters"] = rp
    ov.setdefault("head_dim", ov["hidden_size"] // ov["num_attention_heads"])   # transformers' value where absent
    make_tiny_checkpoint(arch, tmp, overrides=ov)
    built = json.loads((tmp / "config.json").read_text())
    cfg = {**real, "architectures": [arch], "torch_dtype": "float32"}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg.pop(k, None)
        if k in built:
            cfg[k] = built[k]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    return tmp


@pytest.mark.slow      # ~10 s each: a transformers model and an engine per checkpoint
@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_real_settings_verify(case, tmp_path):
    from xllm_gen.codegen.verify import verify

    arch, spec, make, prompt_lens = CASES[case]
    ckpt = _build(tmp_path / case, arch, make())
    report = verify(ROOT / "specs" / f"{spec}.yaml", ckpt, prompt_lens=prompt_lens)
    assert report.ok, report.text()
