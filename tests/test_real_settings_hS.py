"""(hS) Released-settings trials: Qwen3-VL (dense and MoE, text tower and vision tower), Mellum, HyperCLOVA X,
Jais 2, Solar Open, Youtu-LLM, CWM, Qwen3-MoE 235B, Qwen3 dense 4B / 8B / 32B.

Each case takes a released config.json (tests/data/real_configs, provenance in its MANIFEST.md), keeps every non-size
field as published and shrinks only the sizes; transformers' own class writes the tiny weights. Text: `verify` (greedy
tokens and per-layer states). Qwen3-VL also on images: the engine's greedy tokens on image requests against
transformers' Qwen3VL(Moe)ForConditionalGeneration fed by the checkpoint's own processor, and the per-layer states of
those prompts' prefill (pixels, deepstack levels and mRoPE positions included).

Qwen3-VL keeps head_dim 128 and the released mrope_section [24, 20, 20] (the heads are few, not narrow); the vision
tower keeps the released patch / merge sizes and its 2304-entry position table (48 x 48, bilinearly interpolated to
the tiny grids), its depth shrunk with the deepstack taps kept strictly inside it (not on the last block, as
released). At these settings the image check is not blind: the engine with its deepstack zeroed, or with the blocked
mRoPE layout, gives other tokens than transformers on these requests (the three-image-size prompt for the layout).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from test_real_settings import _META, ROOT, _build, _real

_DENSE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=3,
              intermediate_size=128, vocab_size=512)
_MOE = dict(_DENSE, moe_intermediate_size=32)


def _sized(stem: str, *bases: dict, **sizes) -> dict:
    c = _real(stem)
    for b in bases:
        c.update(b)
    c.update(sizes)
    return c


def _mellum(stem: str) -> dict:
    c = _sized(stem, _MOE, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, sliding_window=6)
    for key in ("layer_types", "mlp_layer_types"):
        if key in c:
            c[key] = c[key][:4]                # 3 sliding layers and a full one, as the release's period 4
    return c


def _cwm() -> dict:
    c = _sized("cwm__cwm", _DENSE, num_hidden_layers=4, sliding_window=6)
    c["layer_types"] = c["layer_types"][:4]      # full, then three sliding: the release's period 4
    return c


def _youtu(stem: str = "youtu__Youtu-LLM-2B") -> dict:
    c = _sized(stem, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
               intermediate_size=128, vocab_size=512, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=16)
    c.update({k: v for k, v in (("qk_head_dim", 24), ("head_dim", 8)) if k in c})   # restated sizes, where released
    return c


TEXT_CASES = {
    "qwen3-4b": ("Qwen3ForCausalLM", "qwen3", lambda: _sized("qwen3__Qwen3-4B", **_DENSE)),
    "qwen3-8b": ("Qwen3ForCausalLM", "qwen3", lambda: _sized("qwen3__Qwen3-8B", **_DENSE)),
    "qwen3-32b": ("Qwen3ForCausalLM", "qwen3", lambda: _sized("qwen3__Qwen3-32B", **_DENSE)),
    "qwen3-235b-a22b": ("Qwen3MoeForCausalLM", "qwen3_moe",
                        lambda: _sized("qwen3_moe__Qwen3-235B-A22B", **_MOE, num_experts=4, num_experts_per_tok=2)),
    "qwen3-235b-a22b-2507": ("Qwen3MoeForCausalLM", "qwen3_moe",
                             lambda: _sized("qwen3_moe__Qwen3-235B-A22B-Instruct-2507", **_MOE, num_experts=4,
                                            num_experts_per_tok=2)),
    "mellum2-rust-copy": ("MellumForCausalLM", "mellum", lambda: _mellum("mellum__Mellum2-rust-test-copy")),
    "mellum2.1-thinking": ("MellumForCausalLM", "mellum", lambda: _mellum("mellum__Mellum2.1-Thinking-mlx-test-copy")),
    "mellum-4b-base": ("LlamaForCausalLM", "llama", lambda: _sized("llama__Mellum-4b-base", **_DENSE)),
    "hyperclovax-seed-think-14b": ("HyperCLOVAXForCausalLM", "hyperclovax",
                                   lambda: _sized("hyperclovax__HyperCLOVAX-SEED-Think-14B", **_DENSE)),
    "hyperclovax-seed-text-instruct-1.5b": ("LlamaForCausalLM", "llama",
                                            lambda: _sized("llama__HyperCLOVAX-SEED-Text-Instruct-1.5B", _DENSE)),
    "jais-2-8b-chat": ("Jais2ForCausalLM", "jais2",
                       lambda: _sized("jais2__Jais-2-8B-Chat", **dict(_DENSE, num_key_value_heads=4))),
    "solar-open-100b": ("SolarOpenForCausalLM", "solar_open",
                        lambda: _sized("solar_open__Solar-Open-100B", **_MOE, n_routed_experts=8,
                                       num_experts_per_tok=2)),
    "youtu-llm-2b": ("YoutuForCausalLM", "youtu", _youtu),
    # the identity YaRN block of an earlier form (factor 1, mscale_all_dim 0, no original context)
    "youtu-llm-2b-yarn-identity": ("YoutuForCausalLM", "youtu", lambda: _youtu("youtu__Youtu-LLM-2B-yarn-identity")),
    "cwm": ("CwmForCausalLM", "cwm", _cwm),
}

# the fixture's layer patterns where the release states none (transformers' defaults then: all full, all sparse)
BUILD_ONLY = {"mellum2-rust-copy": {"layer_types": ["full_attention"] * 4, "mlp_layer_types": ["sparse"] * 4}}


# ------------------------------------------------------------------------------------------------- Qwen3-VL
_VL_TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                intermediate_size=128, vocab_size=512)
_VL_VISION = dict(hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)


def _vl(stem: str, depth: int, taps: list[int], **text) -> dict:
    c = copy.deepcopy(_real(stem))
    c["text_config"].update(_VL_TEXT, **text)
    c["vision_config"].update(_VL_VISION, depth=depth, deepstack_visual_indexes=taps)
    return c


VL_CASES = {
    # 24 blocks, taps 5 / 11 / 17 -> 4 blocks, taps 0 / 1 / 2
    "qwen3-vl-2b": ("Qwen3VLForConditionalGeneration", "qwen3_vl",
                    lambda: _vl("qwen3_vl__Qwen3-VL-2B-Instruct", 4, [0, 1, 2])),
    "qwen3-vl-4b": ("Qwen3VLForConditionalGeneration", "qwen3_vl",
                    lambda: _vl("qwen3_vl__Qwen3-VL-4B-Instruct", 4, [0, 1, 2])),
    # 27 blocks, taps 8 / 16 / 24 -> 5 blocks, taps 1 / 2 / 3
    "qwen3-vl-8b": ("Qwen3VLForConditionalGeneration", "qwen3_vl",
                    lambda: _vl("qwen3_vl__Qwen3-VL-8B-Instruct", 5, [1, 2, 3])),
    "qwen3-vl-32b": ("Qwen3VLForConditionalGeneration", "qwen3_vl",
                     lambda: _vl("qwen3_vl__Qwen3-VL-32B-Instruct", 5, [1, 2, 3])),
    "qwen3-vl-30b-a3b": ("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe",
                         lambda: _vl("qwen3_vl_moe__Qwen3-VL-30B-A3B-Instruct", 5, [1, 2, 3],
                                     moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
    "qwen3-vl-235b-a22b": ("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe",
                           lambda: _vl("qwen3_vl_moe__Qwen3-VL-235B-A22B-Instruct", 5, [1, 2, 3],
                                       moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
}

_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "video_token_id",
              "vision_start_token_id", "vision_end_token_id")


def _rope_parameters(text: dict) -> dict:
    rp = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rp.pop("type", None)
    rp.setdefault("rope_type", "default")
    rp.setdefault("rope_theta", float(text.get("rope_theta", 10000.0)))
    return rp


def build_vl(tmp: Path, arch: str, real: dict) -> Path:
    """The tiny checkpoint of a Qwen3-VL release (tokenizer, processor, weights from transformers' class), its
    config.json the shrunken release; only the token ids are the tiny tokenizer's (the placeholders it holds)."""
    from fixtures.tiny_hf import make_tiny_checkpoint

    text = {k: v for k, v in real["text_config"].items() if k not in _META and k not in ("rope_scaling", "rope_theta")}
    text["rope_parameters"] = _rope_parameters(real["text_config"])
    vision = {k: v for k, v in real["vision_config"].items() if k not in _META}
    overrides = {"tie_word_embeddings": real.get("tie_word_embeddings", False),
                 **{f"text_config.{k}": v for k, v in text.items()},
                 **{f"vision_config.{k}": v for k, v in vision.items()}}
    make_tiny_checkpoint(arch, tmp, overrides=overrides)
    built = json.loads((tmp / "config.json").read_text())
    cfg = copy.deepcopy({**real, "architectures": [arch], "torch_dtype": "float32"})
    for node, bnode in ((cfg, built), (cfg["text_config"], built.get("text_config", {}))):
        for k in _TOKEN_IDS:
            if k in node or k in bnode:
                node.pop(k, None)
                if bnode.get(k) is not None:
                    node[k] = bnode[k]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    return tmp


def _image(h: int, w: int, seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / max(w - 1, 1), yy * 255 / max(h - 1, 1), np.full((h, w), 40 * (seed % 6))], -1)
    return Image.fromarray(np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8))


IMG = "<|vision_start|><|image_pad|><|vision_end|>"
VL_REQUESTS = [
    (f"{IMG}Describe the image.", [(64, 64, 1)]),
    (f"First {IMG} then {IMG} which one?", [(96, 128, 3), (40, 200, 4)]),
]


def vl_image_mismatches(spec: Path, ckpt: Path, max_tokens: int = 12, **llm_kwargs) -> list[str]:
    """The engine (the spec compiled now) vs transformers on image requests: greedy tokens, and the per-layer states
    of each prompt's prefill; the differences."""
    import tempfile

    import torch
    from hf_ref import _as_inputs, hf_model, hf_vl_greedy, hf_vl_inputs

    from xllm_gen import LLM, SamplingParams
    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.codegen.verify import DEFAULT_TOL, _decoder_layers, _import_compiled, _Recorder, _served_by

    compiled = compile_spec(spec)
    bad = []
    with tempfile.TemporaryDirectory(prefix="xllm_gen_vl_") as tmp:
        model_module, runner_module = _import_compiled(compiled.files, compiled.ir.name, Path(tmp))
        with _served_by(model_module, runner_module):
            llm = LLM(model=str(ckpt), device="cpu", dtype="float32", enforce_eager=True,
                      enable_prefix_caching=False, block_size=4, **llm_kwargs)
        try:
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            for prompt, sizes in VL_REQUESTS:
                images = [_image(*s) for s in sizes]
                want = hf_vl_greedy(ckpt, hf_vl_inputs(ckpt, prompt, images), max_tokens)
                out = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": images}}], sp)[0]
                assert getattr(out, "error", None) is None, out.error
                got = list(out.outputs[0].token_ids)
                if len(set(want)) <= 2:
                    bad.append(f"{prompt!r}: transformers' greedy tokens are flat ({list(want)}): no evidence")
                if got != list(want):
                    bad.append(f"{prompt!r}: engine {got} vs transformers {list(want)}")
            # the per-layer states of the image prompt's prefill (deepstack levels added after the first layers)
            hf = hf_model(ckpt)
            n = hf.config.get_text_config().num_hidden_layers
            hf_rec = _Recorder(_decoder_layers(hf, n), engine=False)
            eng_rec = _Recorder(_decoder_layers(llm.engine.runner.model, n), engine=True)
            try:
                for prompt, sizes in VL_REQUESTS:
                    images = [_image(*s) for s in sizes]
                    hf.model.rope_deltas = None
                    hf_rec.arm()
                    with torch.no_grad():
                        hf(**_as_inputs(hf_vl_inputs(ckpt, prompt, images)), use_cache=False)
                    hf.model.rope_deltas = None
                    ref = hf_rec.take()
                    eng_rec.arm()
                    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
                    llm.generate([{"prompt": prompt, "multi_modal_data": {"image": images}}], one)
                    mine = eng_rec.take()
                    assert len(ref) == len(mine) == n, (len(ref), len(mine), n)
                    for layer, (a, b) in enumerate(zip(ref, mine)):
                        rel = float((b - a).abs().max() / a.abs().max().clamp_min(1e-12))
                        if a.shape != b.shape or rel > DEFAULT_TOL["float32"]:
                            bad.append(f"{prompt!r}: layer {layer} states differ (relative {rel:.3e})")
            finally:
                hf_rec.remove()
                eng_rec.remove()
        finally:
            llm.shutdown()
    return bad


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("case", list(TEXT_CASES))
def test_real_settings_hs_text(case, tmp_path):
    from xllm_gen.codegen.verify import verify

    arch, spec, make = TEXT_CASES[case]
    ckpt = _build(tmp_path / case, arch, make(), BUILD_ONLY.get(case))
    report = verify(ROOT / "specs" / f"{spec}.yaml", ckpt, prompt_lens=(3, 9, 17, 30))
    assert report.ok, report.text()


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("case", list(VL_CASES))
def test_real_settings_hs_vl(case, tmp_path):
    from xllm_gen.codegen.verify import verify

    arch, spec, make = VL_CASES[case]
    ckpt = build_vl(tmp_path / case, arch, make())
    report = verify(ROOT / "specs" / f"{spec}.yaml", ckpt, prompt_lens=(3, 9, 17, 30))
    assert report.ok, report.text()
    bad = vl_image_mismatches(ROOT / "specs" / f"{spec}.yaml", ckpt)
    assert not bad, "\n".join(bad)
