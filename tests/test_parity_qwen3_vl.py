"""Qwen3-VL parity with transformers' Qwen3VLForConditionalGeneration (float32, CPU) on tiny checkpoints
built offline with the real Qwen3-VL processor classes.

Greedy tokens identical to HF for: text only; one image; three images of different sizes; one video
(frames as given, and frames sampled by fps); image + video in one prompt; all of these mixed in one
generate call; untied lm_head. Sensitivity arms (test hooks of LLM(..., _debug=...)): zeroed deepstack
and the blocked mRoPE layout must change image outputs (blocked must not change text-only ones), and
must equal HF with the same change. Bad multimodal input fails only its own request. A text request
after an image request sees no stale deepstack features.

HF reference inputs come from the checkpoint's AutoProcessor called as
`processor(text=[prompt], images=..., videos=..., return_tensors="pt", **mm_processor_kwargs)`.
"""
from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch
from hf_ref import (
    hf_blocked_mrope,
    hf_model,
    hf_processor,
    hf_tokenizer,
    hf_vl_greedy,
    hf_vl_inputs,
    hf_vl_prefill_logits,
    hf_zero_deepstack,
)

pytestmark = pytest.mark.vl

MAX_TOKENS = 24
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
VID = "<|vision_start|><|video_pad|><|vision_end|>"


def image(h: int, w: int, seed: int, mode: str = "pil"):
    """A deterministic image: a smooth colour gradient plus noise (PIL, or a uint8 (H, W, 3) array)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / max(w - 1, 1), yy * 255 / max(h - 1, 1), np.full((h, w), 40 * (seed % 6))], -1)
    arr = np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    return arr if mode == "np" else Image.fromarray(arr)


def video(t: int, h: int, w: int, seed: int) -> np.ndarray:
    """A deterministic uint8 video (T, H, W, 3): a moving bright square over noise."""
    rng = np.random.default_rng(seed)
    v = rng.integers(0, 120, (t, h, w, 3), dtype=np.uint8)
    for i in range(t):
        y, x = (i * 7) % max(h - 16, 1), (i * 11) % max(w - 16, 1)
        v[i, y:y + 16, x:x + 16] = (255, 200 - 10 * i % 200, 50)
    return v


# name -> engine request (a dict as LLM.generate takes it). HF gets the same prompt / data / kwargs.
REQUESTS: dict[str, dict] = {
    "text": {"prompt": "Describe the weather today in one sentence."},
    "image": {"prompt": f"{IMG}Describe the image.", "multi_modal_data": {"image": [image(64, 64, 1)]}},
    "three_images": {
        "prompt": f"First {IMG} then {IMG} and last {IMG} Which one is red?",
        # 64x64 -> 2x2 merged tokens, 96x128 -> 3x4, 40x200 -> 1x6 (different sizes and aspect ratios)
        "multi_modal_data": {"image": [image(64, 64, 2), image(96, 128, 3), image(40, 200, 4)]},
    },
    "image_np": {"prompt": f"Look: {IMG}", "multi_modal_data": {"image": [image(50, 90, 9, mode="np")]}},
    "video": {
        "prompt": f"{VID}Describe the video.",
        "multi_modal_data": {"video": [video(8, 64, 96, 5)]},  # 8 frames -> 4 temporal patches
        "mm_processor_kwargs": {"do_sample_frames": False},
    },
    "video_sampled": {
        "prompt": f"What happens in {VID}?",
        "multi_modal_data": {"video": [video(16, 64, 64, 6)]},  # sampled by fps (HF assumes 24 fps input)
        "mm_processor_kwargs": {"fps": 12},
    },
    "image_video": {
        "prompt": f"Compare {IMG} with {VID} please.",
        "multi_modal_data": {"image": [image(80, 48, 7)], "video": [video(5, 64, 64, 8)]},  # 5: odd, padded
        "mm_processor_kwargs": {"do_sample_frames": False},
    },
}
SINGLE = ["text", "image", "three_images", "video", "video_sampled", "image_video"]


def _hf_inputs(ckpt, req: dict):
    mm = req.get("multi_modal_data") or {}
    return hf_vl_inputs(ckpt, req["prompt"], mm.get("image"), mm.get("video"), req.get("mm_processor_kwargs"))


@functools.lru_cache(maxsize=None)
def hf_ref(ckpt: str, name: str, arm: str = "") -> tuple[int, ...]:
    """HF greedy tokens of REQUESTS[name] on ckpt, optionally under a sensitivity arm."""
    inputs = _hf_inputs(ckpt, REQUESTS[name])
    if arm == "zero_deepstack":
        with hf_zero_deepstack():
            return tuple(hf_vl_greedy(ckpt, inputs, MAX_TOKENS))
    if arm == "blocked":
        with hf_blocked_mrope():
            return tuple(hf_vl_greedy(ckpt, inputs, MAX_TOKENS))
    return tuple(hf_vl_greedy(ckpt, inputs, MAX_TOKENS))


def _sp(**kw):
    from xllm_gen import SamplingParams

    base = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    base.update(kw)
    return SamplingParams(**base)


def _tokens(out) -> tuple[int, ...]:
    assert getattr(out, "error", None) is None, out.error
    return tuple(out.outputs[0].token_ids)


def _check(ckpt, names, outs, label=""):
    assert len(outs) == len(names)
    for name, out in zip(names, outs):
        want = hf_ref(str(ckpt), name)
        got = _tokens(out)
        if got != want:
            k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            pytest.fail(f"{label}{name}: first divergence at output position {k}\n  engine: {list(got)}\n"
                        f"  HF:     {list(want)}")
        hf_ids = _hf_inputs(ckpt, REQUESTS[name])["input_ids"][0].tolist()
        assert list(out.prompt_token_ids) == hf_ids, f"{name}: prompt token ids differ from the HF processor's"


# ------------------------------------------------------------------------------- the fixtures themselves
def test_fixture_checkpoint_is_consistent(qwen3_vl_tied, qwen3_vl_untied):
    import json

    for ckpt in (qwen3_vl_tied, qwen3_vl_untied):
        cfg = json.loads((ckpt / "config.json").read_text())
        assert cfg["architectures"] == ["Qwen3VLForConditionalGeneration"]
        tok = hf_tokenizer(ckpt)
        for key, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                           ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
            assert cfg[key] == tok.convert_tokens_to_ids(token), key
        proc = hf_processor(ckpt)
        assert type(proc).__name__ == "Qwen3VLProcessor"
        assert type(proc.video_processor).__name__ == "Qwen3VLVideoProcessor"
        assert proc.image_processor.patch_size == cfg["vision_config"]["patch_size"]
        tc = cfg["text_config"]
        sec = (tc.get("rope_parameters") or tc.get("rope_scaling"))["mrope_section"]
        assert 2 * sum(sec) == cfg["text_config"]["head_dim"]
    assert json.loads((qwen3_vl_tied / "config.json").read_text())["tie_word_embeddings"] is True
    assert json.loads((qwen3_vl_untied / "config.json").read_text())["tie_word_embeddings"] is False
    m = hf_model(qwen3_vl_untied)
    assert not torch.equal(m.lm_head.weight, m.model.language_model.embed_tokens.weight)


@pytest.mark.parametrize("ckpt_name", ["qwen3_vl_tied", "qwen3_vl_untied"])
def test_fixture_greedy_is_not_flat_and_images_matter(ckpt_name, request):
    ckpt = str(request.getfixturevalue(ckpt_name))
    outs = {n: hf_ref(ckpt, n) for n in SINGLE}
    for n, toks in outs.items():
        assert len(set(toks)) >= 3, f"{ckpt_name} {n}: flat greedy continuation {toks}"
    assert len(set(outs.values())) == len(outs), "two different requests gave the same continuation"
    # Another image in the same prompt changes the output.
    other = dict(REQUESTS["image"], multi_modal_data={"image": [image(64, 64, 99)]})
    toks = tuple(hf_vl_greedy(ckpt, _hf_inputs(ckpt, other), MAX_TOKENS))
    assert toks != outs["image"]


def test_fixture_sensitivity_arms_on_hf(qwen3_vl_tied):
    ckpt = str(qwen3_vl_tied)
    for name in ("image", "three_images", "video"):
        assert hf_ref(ckpt, name, "zero_deepstack") != hf_ref(ckpt, name), f"zeroed deepstack: {name} unchanged"
    for name in ("image", "video"):
        assert hf_ref(ckpt, name, "blocked") != hf_ref(ckpt, name), f"blocked mRoPE: {name} unchanged"
    # Text only: three equal position rows, so the layout cannot matter.
    assert hf_ref(ckpt, "text", "blocked") == hf_ref(ckpt, "text")


def test_hf_video_facts(qwen3_vl_tied):
    """What the HF processor does with videos (the engine must produce the same prompts)."""
    ckpt = str(qwen3_vl_tied)
    proc = hf_processor(ckpt)
    x = _hf_inputs(ckpt, REQUESTS["video"])
    assert x["video_grid_thw"].tolist() == [[4, 4, 6]]
    text = proc.tokenizer.decode(x["input_ids"][0]).replace("<|video_pad|>", "")
    # One timestamp + vision_start/end block per temporal patch; timestamps assume 24 fps without metadata.
    assert re.findall(r"<([0-9.]+) seconds>", text) == ["0.0", "0.1", "0.2", "0.3"]
    # Odd frame counts are padded by repeating the last frame: 5 frames -> 3 temporal patches.
    y = _hf_inputs(ckpt, REQUESTS["image_video"])
    assert y["video_grid_thw"][0, 0].item() == 3
    # Fewer frames than temporal_patch_size: the processor itself refuses.
    with pytest.raises(ValueError):
        hf_vl_inputs(ckpt, VID, videos=[video(1, 64, 64, 0)], mm_processor_kwargs={"do_sample_frames": False})


# ----------------------------------------------------------------------------------------------- parity
@pytest.mark.engine
@pytest.mark.parametrize("name", SINGLE)
def test_vl_greedy_matches_hf(name, qwen3_vl_tied, make_llm):
    llm = make_llm(qwen3_vl_tied)
    _check(qwen3_vl_tied, [name], llm.generate([REQUESTS[name]], _sp()))


@pytest.mark.engine
def test_vl_all_mixed_in_one_call(qwen3_vl_tied, make_llm):
    names = ["image", "text", "three_images", "video", "image_np", "image_video", "video_sampled", "text", "image"]
    llm = make_llm(qwen3_vl_tied)
    _check(qwen3_vl_tied, names, llm.generate([REQUESTS[n] for n in names], _sp()), "mixed: ")


@pytest.mark.engine
def test_vl_untied_lm_head(qwen3_vl_untied, make_llm):
    names = ["text", "image", "three_images", "video", "image_video"]
    llm = make_llm(qwen3_vl_untied)
    _check(qwen3_vl_untied, names, llm.generate([REQUESTS[n] for n in names], _sp()), "untied: ")


@pytest.mark.engine
def test_vl_preemption_keeps_tokens(qwen3_vl_tied, make_llm):
    """A tiny KV pool forces preemption of multimodal requests; resumed ones (vision features and deepstack
    recomputed or kept) give the same tokens."""
    import math

    names = ["image", "video", "three_images", "image_video", "text"]
    lens = [_hf_inputs(qwen3_vl_tied, REQUESTS[n])["input_ids"].shape[1] for n in names]
    need = [math.ceil((n + MAX_TOKENS) / 4) for n in lens]
    llm = make_llm(qwen3_vl_tied, num_kv_blocks=max(need) + 2)
    before = llm.engine.scheduler.num_preemptions
    outs = llm.generate([REQUESTS[n] for n in names], _sp())
    assert llm.engine.scheduler.num_preemptions > before, "the small KV pool did not force any preemption"
    _check(qwen3_vl_tied, names, outs, "preemption: ")


@pytest.mark.engine
def test_vl_prefill_logits_match_hf(qwen3_vl_tied, make_llm):
    llm = make_llm(qwen3_vl_tied)
    worst = 0.0
    for name in ("text", "image", "image_video"):
        want = hf_vl_prefill_logits(qwen3_vl_tied, _hf_inputs(qwen3_vl_tied, REQUESTS[name]))
        got = torch.as_tensor(llm.prefill_logits(REQUESTS[name])).float().cpu()
        assert got.shape == want.shape, (name, got.shape, want.shape)
        worst = max(worst, (got - want).abs().max().item())
    print(f"\n[parity] qwen3_vl: prefill logits max abs error vs HF float32 = {worst:.3e}")
    assert worst < 1e-4


@pytest.mark.engine
def test_vl_prompt_token_ids_with_one_placeholder_per_item(qwen3_vl_tied, make_llm):
    """prompt_token_ids carrying one placeholder token per item are expanded by the engine exactly as the
    processor expands the text prompt."""
    tok = hf_tokenizer(qwen3_vl_tied)
    names = ["three_images", "image_video"]
    reqs = []
    for n in names:
        r = dict(REQUESTS[n])
        r["prompt_token_ids"] = tok(r.pop("prompt"))["input_ids"]
        reqs.append(r)
    _check(qwen3_vl_tied, names, make_llm(qwen3_vl_tied).generate(reqs, _sp()), "token ids: ")


@pytest.mark.engine
def test_vl_no_stale_deepstack(qwen3_vl_tied, make_llm):
    llm = make_llm(qwen3_vl_tied)
    _check(qwen3_vl_tied, ["image"], llm.generate([REQUESTS["image"]], _sp()))
    _check(qwen3_vl_tied, ["text"], llm.generate([REQUESTS["text"]], _sp()), "text after image: ")
    _check(qwen3_vl_tied, ["video", "text"], llm.generate([REQUESTS["video"], REQUESTS["text"]], _sp()))
    _check(qwen3_vl_tied, ["text"], llm.generate([REQUESTS["text"]], _sp()), "text after video: ")


@pytest.mark.engine
def test_deepstack_buffers_fixed_used_and_cleared(qwen3_vl_tied, make_llm):
    """The generated runner's deepstack buffers keep their size and address, carry the image's features into
    the prefill step (ctx.deepstack), and hold zeros again after every step."""
    llm = make_llm(qwen3_vl_tied, enable_prefix_caching=False)    # every visual row is computed here
    runner = llm.engine.runner
    before = [(t.data_ptr(), tuple(t.shape)) for t in (runner.deepstack_rows, runner.deepstack_embeds)]
    steps = []                                       # (deepstack rows used, nonzero features, clean after)
    orig = runner.after_step

    def spy(ctx):
        ds = ctx.deepstack
        used = (0, False) if ds is None else (ds.visual_rows.numel(), bool(ds.embeds.any()))
        orig(ctx)
        steps.append(used + (not runner.deepstack_embeds.any() and not runner.deepstack_rows.any(),))

    runner.after_step = spy
    try:
        outs = llm.generate([REQUESTS["image"], REQUESTS["text"]], _sp())
    finally:
        del runner.after_step
    assert _tokens(outs[0]) == hf_ref(str(qwen3_vl_tied), "image")
    n_visual = outs[0].prompt_token_ids.count(llm.engine.hf_config["image_token_id"])
    used = [s for s in steps if s[0]]
    assert used and all(nonzero for _, nonzero, _ in used), steps
    assert sum(n for n, _, _ in used) == n_visual > 0
    assert all(clean for _, _, clean in steps), "deepstack buffers not cleared after a step"
    assert [(t.data_ptr(), tuple(t.shape)) for t in (runner.deepstack_rows, runner.deepstack_embeds)] == before


# ------------------------------------------------------------------------------------ sensitivity arms
@pytest.mark.engine
def test_zeroed_deepstack_changes_image_output(qwen3_vl_tied, make_llm):
    llm = make_llm(qwen3_vl_tied, _debug={"zero_deepstack": True})
    outs = llm.generate([REQUESTS["image"], REQUESTS["text"]], _sp())
    assert _tokens(outs[0]) != hf_ref(str(qwen3_vl_tied), "image"), "zeroing deepstack did not change the output"
    assert _tokens(outs[1]) == hf_ref(str(qwen3_vl_tied), "text")


@pytest.mark.engine
def test_zeroed_deepstack_equals_hf_without_deepstack(qwen3_vl_tied, make_llm):
    llm = make_llm(qwen3_vl_tied, _debug={"zero_deepstack": True})
    outs = llm.generate([REQUESTS["image"], REQUESTS["video"]], _sp())
    assert _tokens(outs[0]) == hf_ref(str(qwen3_vl_tied), "image", "zero_deepstack")
    assert _tokens(outs[1]) == hf_ref(str(qwen3_vl_tied), "video", "zero_deepstack")


@pytest.mark.engine
def test_blocked_mrope_changes_image_output_not_text(qwen3_vl_tied, make_llm):
    llm = make_llm(qwen3_vl_tied, _debug={"mrope_layout": "blocked"})
    outs = llm.generate([REQUESTS["image"], REQUESTS["text"]], _sp())
    assert _tokens(outs[0]) != hf_ref(str(qwen3_vl_tied), "image"), "blocked mRoPE did not change the output"
    assert _tokens(outs[1]) == hf_ref(str(qwen3_vl_tied), "text"), "blocked mRoPE changed a text-only output"


@pytest.mark.engine
def test_blocked_mrope_equals_hf_blocked(qwen3_vl_tied, make_llm):
    llm = make_llm(qwen3_vl_tied, _debug={"mrope_layout": "blocked"})
    outs = llm.generate([REQUESTS["image"], REQUESTS["video"]], _sp())
    assert _tokens(outs[0]) == hf_ref(str(qwen3_vl_tied), "image", "blocked")
    assert _tokens(outs[1]) == hf_ref(str(qwen3_vl_tied), "video", "blocked")


# --------------------------------------------------------------------------------------------- bad input
def _bad_vl_requests():
    """(request, regex the error must match besides the request index)."""
    img = image(64, 64, 1)
    from PIL import Image

    return [
        ({"prompt": f"{IMG}x", "multi_modal_data": {"image": [img, img]}}, r"image"),          # more images
        ({"prompt": f"{IMG}{IMG}x", "multi_modal_data": {"image": [img]}}, r"image"),          # fewer images
        ({"prompt": f"{IMG}x"}, r"image|placeholder"),                                        # no image at all
        ({"prompt": f"{IMG}x", "multi_modal_data": {"image": ["/etc/passwd"]}}, r"type|str"),  # unsupported type
        ({"prompt": f"{IMG}x", "multi_modal_data": {"image": [Image.new("RGB", (0, 0))]}}, r"size|empty|zero"),
        ({"prompt": f"{IMG}x", "multi_modal_data": {"image": [np.zeros((0, 32, 3), np.uint8)]}},
         r"size|empty|zero"),
        ({"prompt": f"{VID}x", "multi_modal_data": {"video": [video(1, 64, 64, 0)]},
          "mm_processor_kwargs": {"do_sample_frames": False}}, r"frame"),                       # 1 frame < 2
        ({"prompt": f"{VID}x", "multi_modal_data": {"video": [np.zeros((0, 64, 64, 3), np.uint8)]}},
         r"frame|empty"),                                                                     # 0 frames
        ({"prompt": f"{VID}x", "multi_modal_data": {"image": [img]}}, r"image|video"),         # wrong modality
    ]


@pytest.mark.engine
def test_vl_bad_input_fails_only_its_request(qwen3_vl_tied, make_llm):
    llm = make_llm(qwen3_vl_tied)
    bad = _bad_vl_requests()
    prompts, names, expect = [REQUESTS["image"]], {0: "image"}, {}
    for k, (req, pattern) in enumerate(bad):
        expect[len(prompts)] = pattern
        prompts.append(req)
        if k == 3:
            names[len(prompts)] = "text"
            prompts.append(REQUESTS["text"])
    names[len(prompts)] = "video"
    prompts.append(REQUESTS["video"])
    outs = llm.generate(prompts, _sp(), on_error="return")
    assert len(outs) == len(prompts)
    for i, pattern in expect.items():
        err = outs[i].error
        assert err, f"request {i} was not rejected"
        assert re.search(rf"request\W*{i}\b", err, re.IGNORECASE), f"error does not name request {i}: {err!r}"
        assert re.search(pattern, err, re.IGNORECASE), f"request {i}: {err!r} does not match {pattern!r}"
        assert all(len(c.token_ids) == 0 for c in outs[i].outputs)
    good = sorted(names)
    _check(qwen3_vl_tied, [names[i] for i in good], [outs[i] for i in good], "served beside bad input: ")
    # Default mode raises a ValueError naming the bad requests, after serving the others.
    with pytest.raises(ValueError) as ei:
        llm.generate(prompts, _sp())
    for i in expect:
        assert re.search(rf"request\W*{i}\b", str(ei.value), re.IGNORECASE)
