"""Image / video preprocessing on the model's device (runtime/multimodal/processor.py, `device=`; the engine's
`mm_preprocess_device`).

- device="cpu" given explicitly reaches the processor's torchvision image and video processors and gives the
  same pixel rows, grids, token ids and mRoPE positions as today's path (no device);
- the option reaches the processor (a recording wrapper around the real one), per modality, and a request's
  own `device` in mm_processor_kwargs wins;
- device="meta" shows that nothing brings the rows back to the host: a meta tensor cannot be copied out, yet
  ids, grids and positions are the host path's (they come from the resized shapes) and the prefix-cache key
  is the raw-input digest;
- a PIL image processor (no device support) is called without `device`: its rows stay on the host, equal
  to its own output, while the video processor still gets the device;
- the engine option: auto / cpu / a device / a bad value, and an end-to-end generate with an explicit
  device equal to the default path.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from xllm_gen.runtime.multimodal.processor import MultiModalProcessor, supports_device


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory):
    from fixtures.tiny_hf import make_tiny_qwen3_vl
    return make_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny_qwen3_vl_pre"), seed=0)


def _cfg(ckpt):
    return json.loads((ckpt / "config.json").read_text())


def _image(h, w, seed=0):
    from PIL import Image
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _video(t, h, w, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


IMG_PH = "<|vision_start|><|image_pad|><|vision_end|>"
VID_PH = "<|vision_start|><|video_pad|><|vision_end|>"
REQUESTS = {
    "one_image": (f"Describe {IMG_PH} the image.", {"image": [_image(50, 70)]}),
    "one_video": (f"Describe the video. {VID_PH}", {"video": [_video(20, 48, 64)]}),
    "image_and_video": (f"{IMG_PH} then {VID_PH} and {IMG_PH}",
                        {"image": [_image(30, 60), _image(80, 50, 5)], "video": [_video(12, 40, 40, 4)]}),
}
FIELDS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


class Recording:
    """The real processor, recording the keyword arguments of every call."""

    def __init__(self, processor):
        self.inner, self.calls = processor, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        self.calls.append(kwargs)
        return self.inner(*args, **kwargs)


def _pil_image_processor(fast):
    from transformers import Qwen2VLImageProcessorPil
    keys = ("size", "patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std")
    return Qwen2VLImageProcessorPil(**{k: getattr(fast, k) for k in keys})


@pytest.fixture(scope="module")
def host(vl_ckpt):
    return MultiModalProcessor(str(vl_ckpt), _cfg(vl_ckpt))


def _same(a, b, pixels=True):
    assert a.prompt_token_ids == b.prompt_token_ids
    assert torch.equal(a.mrope_positions, b.mrope_positions) and a.mrope_delta == b.mrope_delta
    assert torch.equal(a.image_token_positions, b.image_token_positions)
    assert torch.equal(a.video_token_positions, b.video_token_positions)
    for key in FIELDS:
        x, y = getattr(a, key), getattr(b, key)
        assert (x is None) == (y is None), key
        if x is not None and (pixels or "grid" in key):
            assert x.shape == y.shape, key
            if pixels or x.device == y.device:
                assert torch.equal(x, y), key


@pytest.mark.parametrize("case", list(REQUESTS))
def test_explicit_cpu_device_is_todays_path(vl_ckpt, host, case):
    prompt, mm = REQUESTS[case]
    dev = MultiModalProcessor(str(vl_ckpt), _cfg(vl_ckpt), device="cpu")
    assert dev.device_kwargs == ["images_kwargs", "videos_kwargs"]
    rec = dev.processor = Recording(dev.processor)
    ref, out = host.process(0, prompt, None, mm, {}), dev.process(0, prompt, None, mm, {})
    _same(out, ref)
    kw = rec.calls[-1]
    assert kw["images_kwargs"]["device"] == torch.device("cpu")
    assert kw["videos_kwargs"]["device"] == torch.device("cpu")
    assert out.source_digest() is None                       # rows on the host: the key is the rows
    ids = host.tokenizer(prompt)["input_ids"]                 # token-id prompts: the same expansion
    _same(dev.process(1, None, ids, mm, {}), host.process(1, None, ids, mm, {}))


def test_device_reaches_processor_and_request_kwargs_win(vl_ckpt):
    dev = MultiModalProcessor(str(vl_ckpt), _cfg(vl_ckpt), device="meta")
    rec = dev.processor = Recording(dev.processor)
    prompt, mm = REQUESTS["image_and_video"]
    dev.process(0, prompt, None, mm, {"images_kwargs": {"do_resize": True}, "fps": 2})
    kw = rec.calls[-1]
    assert kw["images_kwargs"] == {"do_resize": True, "device": torch.device("meta")}
    assert kw["videos_kwargs"] == {"device": torch.device("meta")} and kw["fps"] == 2
    out = dev.process(0, prompt, None, mm, {"device": "cpu"})      # the request's own device goes as given
    kw = rec.calls[-1]
    assert kw["device"] == "cpu" and "images_kwargs" not in kw and "videos_kwargs" not in kw
    assert out.pixel_values.device.type == "cpu" and out.pixel_values_videos.device.type == "cpu"
    out = dev.process(0, prompt, None, mm, {"videos_kwargs": {"device": "cpu"}})
    assert out.pixel_values.device.type == "meta" and out.pixel_values_videos.device.type == "cpu"
    host = MultiModalProcessor(str(vl_ckpt), _cfg(vl_ckpt))
    rec = host.processor = Recording(host.processor)
    host.process(0, prompt, None, mm, {})
    assert host.device_kwargs == [] and set(rec.calls[-1]) == {"text", "images", "videos", "return_tensors"}


@pytest.mark.parametrize("case", list(REQUESTS))
def test_rows_stay_on_the_device(vl_ckpt, host, case):
    """meta: any copy of the rows back to the host raises, so this passing means none happens."""
    from types import SimpleNamespace

    from xllm_gen.runtime.engine.block_manager import _extra_key
    prompt, mm = REQUESTS[case]
    dev = MultiModalProcessor(str(vl_ckpt), _cfg(vl_ckpt), device="meta")
    out, ref = dev.process(0, prompt, None, mm, {}), host.process(0, prompt, None, mm, {})
    for key in ("pixel_values", "pixel_values_videos"):
        if getattr(ref, key) is not None:
            assert getattr(out, key).device.type == "meta", key
    _same(out, ref, pixels=False)
    pix, grid = out.vision_batch()
    assert pix.device.type == "meta" and grid.device.type == "cpu"
    key = _extra_key(SimpleNamespace(mm_inputs=out))              # prefix caching: the raw-input digest
    again = dev.process(0, prompt, None, mm, {})
    assert _extra_key(SimpleNamespace(mm_inputs=again)) == key
    other = {k: [_image(50, 70, 9) if k == "image" else _video(20, 48, 64, 9)] + v[1:] for k, v in mm.items()}
    assert _extra_key(SimpleNamespace(mm_inputs=dev.process(0, prompt, None, other, {}))) != key
    kwargs = {"images_kwargs": {"do_normalize": False}} if "image" in mm else {"fps": 4}
    assert _extra_key(SimpleNamespace(mm_inputs=dev.process(0, prompt, None, mm, kwargs))) != key


def test_pil_image_processor_falls_back(vl_ckpt):
    from transformers import AutoProcessor
    cfg = _cfg(vl_ckpt)
    proc = AutoProcessor.from_pretrained(str(vl_ckpt))
    proc.image_processor = _pil_image_processor(proc.image_processor)
    pil_host = MultiModalProcessor(hf_config=cfg, processor=proc)
    dev = MultiModalProcessor(hf_config=cfg, processor=proc, device="meta")
    assert not supports_device(dev.processor.image_processor)
    assert supports_device(dev.processor.video_processor)
    assert dev.device_kwargs == ["videos_kwargs"]
    rec = dev.processor = Recording(proc)
    prompt, mm = REQUESTS["image_and_video"]
    out, ref = dev.process(0, prompt, None, mm, {}), pil_host.process(0, prompt, None, mm, {})
    assert "images_kwargs" not in rec.calls[-1] and rec.calls[-1]["videos_kwargs"]["device"].type == "meta"
    assert out.pixel_values.device.type == "cpu" and torch.equal(out.pixel_values, ref.pixel_values)
    assert out.pixel_values_videos.device.type == "meta"
    _same(out, ref, pixels=False)
    assert out.source_digest() is not None                 # some rows are off the host: the digest keys them


def test_engine_option():
    from xllm_gen.runtime.engine.engine import _mm_preprocess_device as resolve
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve("auto", cuda, 1) == cuda
    assert resolve("auto", cuda, 2) is None                 # TP: rows travel pickled over the host anyway
    assert resolve("auto", cpu, 1) is None
    assert resolve("cpu", cuda, 1) is None and resolve(None, cuda, 1) is None
    assert resolve("cuda:1", cpu, 1) == torch.device("cuda:1")
    with pytest.raises(ValueError, match="mm_preprocess_device"):
        resolve("gpu-please", cuda, 1)


def test_generate_with_explicit_device_equals_default(vl_ckpt):
    """End to end through LLM: an explicit preprocessing device (cpu:0, so the processors get `device`)
    serves the same greedy tokens as the default host path, with prefix caching on (the digest keys it)."""
    from xllm_gen import LLM, SamplingParams
    prompt, mm = REQUESTS["image_and_video"]
    req = {"prompt": prompt, "multi_modal_data": mm}
    params = SamplingParams(max_tokens=4, temperature=0.0)
    outs = {}
    for option in ("auto", "cpu:0"):
        llm = LLM(str(vl_ckpt), device="cpu", dtype="float32", block_size=4, mm_preprocess_device=option)
        try:
            assert (llm.engine.mm_processor.device is None) == (option == "auto")
            outs[option] = [o.outputs[0].token_ids for o in llm.generate([req, req], params)]
        finally:
            llm.engine.shutdown()
    assert outs["auto"] == outs["cpu:0"] and outs["auto"][0] == outs["auto"][1]


def test_server_flag(monkeypatch):
    from xllm_gen.runtime.engine import engine as engine_mod
    from xllm_gen.runtime.serving import server
    seen = {}

    class FakeEngine:
        def __init__(self, model, **kw):
            seen.update(kw)
    monkeypatch.setattr(engine_mod, "LLMEngine", FakeEngine)
    monkeypatch.setattr(server, "check_model_path", lambda m: None)
    for argv, want in ((["x"], None), (["x", "--mm-preprocess-device", "auto"], "auto")):
        seen.clear()
        server.make_engine(server._parser().parse_args(argv))
        assert seen.get("mm_preprocess_device") == want
