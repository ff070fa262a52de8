"""Image / video preprocessing on the GPU (marker `gpu`; skipped without CUDA): the processor's torchvision image
and video processors get device="cuda" (runtime/multimodal/processor.py; the engine's mm_preprocess_device,
"auto" by default).

- the rows come back on the GPU; token ids, grids, mRoPE positions and visual-token positions are the host
  path's exactly; the rows equal the host rows to float rounding where nothing is resized (64x96 is a multiple
  of patch * merge = 32 inside the pixel budget). Where the image / video is resized, torchvision runs other
  math on the two devices: on the CPU a native uint8 antialiased bicubic (two passes, rounded and clamped to
  uint8 in between), on CUDA float32 interpolation, clamped and rounded once. Measured on the CPU with random
  pixels, those two differ by up to ~20 uint8 levels at single pixels and ~0.3 level on average. So the GPU
  rows are checked against the host processor made to take torchvision's float path (the GPU's math: at most
  one level apart, float rounding), and against the default host rows on average (<= 1 level) and at most
  MAX_NATIVE_LEVELS levels;
- the engine (bfloat16): LLM on CUDA preprocesses on the GPU by default; a not-resized image request (the
  same pixel rows either way) gives the same greedy tokens as mm_preprocess_device="cpu"; with prefix caching on, the same request again hits the cache
  (the key is the raw-input digest) and gives the same tokens, and another image misses it.
Numbers are printed (pytest -s) and appended as JSON lines to $XLLM_TEST_REPORT when set.
"""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from fixtures.report import report as _report

from xllm_gen.runtime.multimodal.processor import MultiModalProcessor

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STD = 0.5                                 # the tiny fixture processor's image_std
LEVEL = 1 / 255 / STD                     # one uint8 level in the normalized rows
MAX_NATIVE_LEVELS = 32                    # vs the CPU's native uint8 resize (see the docstring)
IMG_PH = "<|vision_start|><|image_pad|><|vision_end|>"
VID_PH = "<|vision_start|><|video_pad|><|vision_end|>"


def _image(h, w, seed=0):
    from PIL import Image
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _video(t, h, w, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


CASES = {   # name: (prompt, multi_modal_data, resized?)
    "image_not_resized": (f"Describe {IMG_PH} the image.", {"image": [_image(64, 96)]}, False),
    "image_resized": (f"Describe {IMG_PH} the image.", {"image": [_image(50, 70, 1)]}, True),
    "video_not_resized": (f"Watch {VID_PH}", {"video": [_video(8, 64, 64, 2)]}, False),
    "image_and_video": (f"{IMG_PH} then {VID_PH}", {"image": [_image(80, 50, 3)], "video": [_video(12, 40, 40, 4)]},
                        True),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from fixtures.tiny_hf import make_tiny_qwen3_vl
    # text attention at head_dim 128 (FlashInfer's kernels), as tests/gpu/test_gpu_graphs.py's VL checkpoint
    return make_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny_qwen3_vl_prep_gpu"), hidden_size=256,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=512,
                              mrope_section=(24, 20, 20), max_position_embeddings=4096, rope_theta=10000.0, seed=0)


@pytest.mark.parametrize("case", list(CASES))
def test_processor_on_gpu_matches_host(ckpt, case, monkeypatch):
    import torchvision.transforms.v2.functional._geometry as tvgeo
    cfg = json.loads((ckpt / "config.json").read_text())
    host = MultiModalProcessor(str(ckpt), cfg)
    dev = MultiModalProcessor(str(ckpt), cfg, device="cuda")
    assert dev.device_kwargs == ["images_kwargs", "videos_kwargs"]
    prompt, mm, resized = CASES[case]
    out, ref = dev.process(0, prompt, None, mm, {}), host.process(0, prompt, None, mm, {})
    with monkeypatch.context() as m:      # the host processor on torchvision's float path (the GPU's math)
        m.setattr(tvgeo, "_do_native_uint8_resize_on_cpu", lambda interpolation: False)
        ref_float = host.process(0, prompt, None, mm, {})
    assert out.prompt_token_ids == ref.prompt_token_ids
    assert torch.equal(out.mrope_positions, ref.mrope_positions) and out.mrope_delta == ref.mrope_delta
    assert torch.equal(out.visual_token_positions, ref.visual_token_positions)
    diffs = {}
    for key in ("pixel_values", "pixel_values_videos"):
        a, b, bf = getattr(out, key), getattr(ref, key), getattr(ref_float, key)
        grid = "image_grid_thw" if key == "pixel_values" else "video_grid_thw"
        assert (a is None) == (b is None), key
        if a is None:
            continue
        assert a.device.type == "cuda", key
        assert torch.equal(getattr(out, grid), getattr(ref, grid)), grid
        d = (a.cpu() - b).abs()
        diffs[key] = {"max": float(d.max()), "mean": float(d.mean()),
                      "max_vs_float_path": float((a.cpu() - bf).abs().max())}
    print(f"GPU preprocessing {case} (resized: {resized}): row differences to the host {diffs} "
          f"(one level {LEVEL:.4g})")
    _report(test="gpu_preprocess_rows", case=case, resized=resized, diffs=diffs)
    for key, d in diffs.items():
        if not resized:
            assert d["max"] <= 1e-6, (key, d)
        else:
            assert d["max_vs_float_path"] <= LEVEL + 1e-6, (key, d)
            assert d["mean"] <= LEVEL and d["max"] <= MAX_NATIVE_LEVELS * LEVEL + 1e-6, (key, d)


def test_engine_preprocesses_on_gpu(ckpt):
    if importlib.util.find_spec("xllm_gen.generated.qwen3_vl.model") is None:
        pytest.skip("generated/qwen3_vl is not generated")
    from xllm_gen import LLM, SamplingParams
    prompt, mm, _ = CASES["image_not_resized"]
    prompt += " Name every colour, every shape and every texture you can see in it, one by one, in order."
    req = {"prompt": prompt, "multi_modal_data": mm}
    other = {"prompt": prompt, "multi_modal_data": {"image": [_image(64, 96, 7)]}}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    toks = {}
    for option in ("auto", "cpu"):
        llm = LLM(str(ckpt), dtype="bfloat16", max_num_seqs=4, num_kv_blocks=256, max_model_len=512,
                  enable_prefix_caching=True, mm_preprocess_device=option)
        try:
            mmp = llm.engine.mm_processor
            assert (mmp.device is not None and mmp.device.type == "cuda") if option == "auto" else mmp.device is None
            toks[option] = llm.generate([req], params)[0].outputs[0].token_ids
            if option == "auto":
                bm = llm.engine.block_manager
                hits = bm.prefix_hits
                again = llm.generate([req], params)[0].outputs[0].token_ids
                assert bm.prefix_hits > hits and again == toks[option]      # same raw image: a cache hit
                hits = bm.prefix_hits
                llm.generate([other], params)
                assert bm.prefix_hits == hits          # another image: every block's key differs (no hit)
        finally:
            llm.shutdown()
    print(f"engine: device-preprocessed tokens {toks['auto']}, host {toks['cpu']}")
    _report(test="gpu_preprocess_engine", tokens=toks)
    assert toks["auto"] == toks["cpu"]
