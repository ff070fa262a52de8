"""(hP) Released settings of OLMo 1, Persimmon, Helium, Ministral, Falcon, DiffLlama and Doge checkpoints: each
config.json of tests/data/real_configs (provenance in its MANIFEST.md) with every non-size field as released and only
the sizes shrunk, a tiny checkpoint from transformers' own class, served against transformers (see
tests/test_real_settings.py). Windows are shrunk below the prompts where a case says so, so that they are crossed."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_real_settings import _META, ROOT, _build, _real, _write_real_config

_DENSE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
              intermediate_size=128, vocab_size=512)


def _sized(stem: str, **sizes) -> dict:
    c = _real(stem)
    c.update(sizes)
    return c


def _ministral(**extra) -> dict:
    c = _real("mistral__Ministral-8B-Instruct-2410")   # MistralForCausalLM with Ministral's layer_types
    c.update(_DENSE, num_key_value_heads=2, head_dim=16, num_hidden_layers=4, layer_types=c["layer_types"][:4],
             **extra)
    return c


def _ministral_class() -> dict:
    # the same file read by its own class (as the engines that re-serve the 2410 checkpoint as Ministral do)
    c = _ministral(sliding_window=6)
    c.update(architectures=["MinistralForCausalLM"], model_type="ministral")
    return c


_FALCON = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=512)
_DOGE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, intermediate_size=128,
             vocab_size=512)

CASES = {
    "olmo-1b-hf": ("OlmoForCausalLM", "olmo", lambda: _sized("olmo__OLMo-1B-hf", **_DENSE), (3, 9, 17, 30)),
    "olmo-7b-hf": ("OlmoForCausalLM", "olmo", lambda: _sized("olmo__OLMo-7B-hf", **_DENSE), (3, 9, 17, 30)),
    "olmo-7b-0424-hf": ("OlmoForCausalLM", "olmo", lambda: _sized("olmo__OLMo-7B-0424-hf", **_DENSE),
                        (3, 9, 17, 30)),
    # OLMo 1.7's clip_qkv (8.0) binds no projection of the tiny random weights: a clip the projections cross
    "olmo-7b-0424-hf-clip0.5": ("OlmoForCausalLM", "olmo",
                                lambda: _sized("olmo__OLMo-7B-0424-hf", **_DENSE, clip_qkv=0.5), (3, 9, 17, 30)),
    "persimmon-8b-base": ("PersimmonForCausalLM", "persimmon",
                          lambda: _sized("persimmon__persimmon-8b-base", **_DENSE), (3, 9, 17, 30)),
    "persimmon-8b-chat": ("PersimmonForCausalLM", "persimmon",
                          lambda: _sized("persimmon__persimmon-8b-chat", **_DENSE), (3, 9, 17, 30)),
    "helium-1-preview-2b": ("HeliumForCausalLM", "helium",
                            lambda: _sized("helium__helium-1-preview-2b", **_DENSE, head_dim=16), (3, 9, 17, 30)),
    "helium-1-2b": ("HeliumForCausalLM", "helium",
                    lambda: _sized("helium__helium-1-2b", **_DENSE | dict(num_key_value_heads=2), head_dim=16),
                    (3, 9, 17, 30)),
    "ministral-8b-2410": ("MistralForCausalLM", "mistral", _ministral, (3, 9, 17, 30)),
    "ministral-8b-2410-window6": ("MistralForCausalLM", "mistral", lambda: _ministral(sliding_window=6),
                                  (3, 9, 17, 30)),
    "ministral-8b-2410-as-ministral": ("MinistralForCausalLM", "ministral", _ministral_class, (3, 9, 17, 30)),
    "falcon-7b": ("FalconForCausalLM", "falcon", lambda: _sized("falcon__falcon-7b", **_FALCON), (3, 9, 17, 30)),
    "falcon-40b": ("FalconForCausalLM", "falcon",
                   lambda: _sized("falcon__falcon-40b", **_FALCON | dict(num_attention_heads=8), num_kv_heads=2),
                   (3, 9, 17, 30)),
    "falcon-rw-1b": ("FalconForCausalLM", "falcon", lambda: _sized("falcon__falcon-rw-1b", **_FALCON),
                     (3, 9, 17, 30)),
    # 32 heads as released (slopes 2 ** (-i / 4): not powers of two)
    "falcon-rw-1b-32heads": ("FalconForCausalLM", "falcon",
                             lambda: _sized("falcon__falcon-rw-1b", **_FALCON | dict(hidden_size=256,
                                                                                      num_attention_heads=32)),
                             (3, 9, 17, 30)),
    "diffllama-0.3b-handcut": ("DiffLlamaForCausalLM", "diffllama",
                               lambda: _sized("diffllama__DiffLlama-0.3B-handcut",
                                              **_DENSE | dict(num_key_value_heads=2), head_dim=16), (3, 9, 17, 30)),
    "doge-20m": ("DogeForCausalLM", "doge", lambda: _sized("doge__Doge-20M", **_DOGE), (3, 9, 17, 30)),
    "doge-160m": ("DogeForCausalLM", "doge", lambda: _sized("doge__Doge-160M", **_DOGE), (3, 9, 17, 30)),
    # the dynamic mask's top-k of keys crossed by the prompts (keep_window_size 2048 -> 8)
    "doge-20m-keep8": ("DogeForCausalLM", "doge", lambda: _sized("doge__Doge-20M", **_DOGE, keep_window_size=8),
                       (3, 9, 17, 30)),
}


def _build_falcon(tmp: Path, arch: str, real: dict) -> Path:
    """_build for FalconConfig, whose head_dim is a read-only property (hidden_size / heads): not set; no rotary
    settings in the releases (rope_theta absent: transformers' default)."""
    from fixtures.tiny_hf import make_tiny_checkpoint

    make_tiny_checkpoint(arch, tmp, overrides={k: v for k, v in real.items() if k not in _META})
    return _write_real_config(tmp, arch, real)


# cases refused at load, by design, naming the field: a MistralForCausalLM file whose layer_types mark a
# full-attention layer beside a window shorter than its context (transformers' Mistral slides every layer, the file
# means alternation). (Falcon-RW was refused here, naming alibi, until specs/falcon.yaml modelled it.)
REFUSED = {"ministral-8b-2410-window6": r"REFUSED.*layer_types"}


@pytest.mark.slow      # ~10 s each: a transformers model and an engine per checkpoint
@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_real_settings_hp_verify(case, tmp_path):
    from xllm_gen.codegen.verify import verify

    arch, spec, make, prompt_lens = CASES[case]
    build = _build_falcon if arch == "FalconForCausalLM" else _build
    ckpt = build(tmp_path / case, arch, make())
    report = verify(ROOT / "specs" / f"{spec}.yaml", ckpt, prompt_lens=prompt_lens)
    if case in REFUSED:
        assert not report.ok and re.search(REFUSED[case], report.text()), report.text()
        return
    assert report.ok, report.text()
