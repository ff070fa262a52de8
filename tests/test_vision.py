"""Vision-tower layers (runtime.layers.vision) and multimodal request preparation (runtime.multimodal)
against Hugging Face Qwen3-VL, float32 on CPU."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
from transformers.vision_utils import (
    get_vision_cu_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
)

from xllm_gen.runtime.layers import vision as V

TOL = 1e-5

VCFG = dict(depth=3, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=64, num_heads=2,
            in_channels=3, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=48,
            num_position_embeddings=36, deepstack_visual_indexes=[0, 2])

GRIDS = {
    "one_image": [(1, 4, 6)],
    "three_images": [(1, 4, 4), (1, 6, 2), (1, 8, 10)],
    "video": [(3, 4, 6)],
    "image_and_video": [(1, 2, 8), (2, 6, 6), (1, 10, 4)],
    "large_image": [(1, 16, 12)],        # bigger than the 6x6 table: interpolation stretches it
}


def _widen(model: nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name and name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith("pos_embed.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = math.prod(p.shape[1:])
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))


@pytest.fixture(scope="module")
def hf_vision():
    cfg = Qwen3VLVisionConfig(**VCFG)
    cfg._attn_implementation = "sdpa"
    model = Qwen3VLVisionModel(cfg).float().eval()
    _widen(model)
    return model


class Tower(nn.Module):
    """The tower composed from runtime.layers.vision (what the generated module renders)."""

    def __init__(self, c: dict):
        super().__init__()
        h = c["hidden_size"]
        self.patch_embed = V.VisionPatchEmbed(c["in_channels"], c["temporal_patch_size"], c["patch_size"], h)
        self.pos_embed = V.VisionPosEmbedInterpolate(c["num_position_embeddings"], h, c["spatial_merge_size"])
        self.rotary_pos_emb = V.VisionRotary2D(h // c["num_heads"], 10000.0, c["spatial_merge_size"])
        self.blocks = nn.ModuleList(V.VisionBlock(h, c["num_heads"], c["intermediate_size"])
                                    for _ in range(c["depth"]))
        self.merger = V.PatchMerger(h, c["out_hidden_size"], c["spatial_merge_size"], False)
        self.deepstack_merger_list = nn.ModuleList(
            V.PatchMerger(h, c["out_hidden_size"], c["spatial_merge_size"], True)
            for _ in c["deepstack_visual_indexes"])
        self.taps = list(c["deepstack_visual_indexes"])

    def forward(self, pixels, grid):
        cu = V.vision_cu_seqlens(grid)
        rot = self.rotary_pos_emb(grid)
        x = self.patch_embed(pixels) + self.pos_embed(grid)
        ds = []
        for i, b in enumerate(self.blocks):
            x = b(x, cu, rot)
            if i in self.taps:
                ds.append(self.deepstack_merger_list[self.taps.index(i)](x))
        return x, self.merger(x), ds


@pytest.fixture(scope="module")
def tower(hf_vision):
    t = Tower(VCFG).float().eval()
    missing = t.load_state_dict(hf_vision.state_dict(), strict=False)
    assert not missing.missing_keys, missing.missing_keys
    assert set(missing.unexpected_keys) <= set(), missing.unexpected_keys
    return t


def _pixels(grid, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(t * h * w for t, h, w in grid)
    dim = VCFG["in_channels"] * VCFG["temporal_patch_size"] * VCFG["patch_size"] ** 2
    return torch.randn(n, dim, generator=g)


def _maxerr(a, b):
    return (a - b).abs().max().item()


def test_param_names_match_hf(hf_vision, tower):
    ours = {k: tuple(v.shape) for k, v in tower.state_dict().items()}
    ref = {k: tuple(v.shape) for k, v in hf_vision.state_dict().items()}
    assert ours == ref


@pytest.mark.parametrize("case", list(GRIDS))
def test_embeddings_and_rotary(hf_vision, tower, case):
    grid = torch.tensor(GRIDS[case])
    x = _pixels(GRIDS[case])
    assert _maxerr(tower.patch_embed(x), hf_vision.patch_embed(x)) < TOL
    idx, w = get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=hf_vision.num_grid_per_side, mode="bilinear", align_corners=True,
        spatial_merge_size=VCFG["spatial_merge_size"])
    ref_pos = (hf_vision.pos_embed(idx) * w[:, :, None]).sum(1)
    assert _maxerr(tower.pos_embed(grid), ref_pos) < TOL
    pid = get_vision_position_ids(grid, VCFG["spatial_merge_size"])
    cos_ref, sin_ref = hf_vision.rotary_pos_emb(ref_pos, pid)
    cos, sin = tower.rotary_pos_emb(grid)
    assert _maxerr(cos, cos_ref) < TOL and _maxerr(sin, sin_ref) < TOL
    assert torch.equal(V.vision_cu_seqlens(grid), get_vision_cu_seqlens(grid))


@pytest.mark.parametrize("case", ["three_images", "image_and_video"])
def test_each_block_and_merger(hf_vision, tower, case):
    grid = torch.tensor(GRIDS[case])
    g = torch.Generator().manual_seed(1)
    n = sum(t * h * w for t, h, w in GRIDS[case])
    x = torch.randn(n, VCFG["hidden_size"], generator=g)
    cu = V.vision_cu_seqlens(grid)
    rot = tower.rotary_pos_emb(grid)
    pid = get_vision_position_ids(grid, VCFG["spatial_merge_size"])
    rot_ref = hf_vision.rotary_pos_emb(x, pid)
    for ours, ref in zip(tower.blocks, hf_vision.blocks):
        assert _maxerr(ours.attn(x, cu, rot), ref.attn(x, cu_seqlens=cu, position_embeddings=rot_ref)) < TOL
        assert _maxerr(ours.mlp(x), ref.mlp(x)) < TOL
        y, y_ref = ours(x, cu, rot), ref(x, cu_seqlens=cu, position_embeddings=rot_ref)
        assert _maxerr(y, y_ref) < TOL
    assert _maxerr(tower.merger(x), hf_vision.merger(x)) < TOL
    for ours, ref in zip(tower.deepstack_merger_list, hf_vision.deepstack_merger_list):
        assert _maxerr(ours(x), ref(x)) < TOL


def test_attention_is_restricted_to_each_frame(tower):
    """Changing one frame of a video (or one image) leaves the other frames' outputs unchanged."""
    grid = torch.tensor([(2, 4, 4), (1, 4, 4)])
    x = torch.randn(48, VCFG["hidden_size"])
    cu = V.vision_cu_seqlens(grid)
    rot = tower.rotary_pos_emb(grid)
    attn = tower.blocks[0].attn
    y = attn(x, cu, rot)
    x2 = x.clone()
    x2[16:32] += 1.0                                   # second frame of the video
    y2 = attn(x2, cu, rot)
    assert torch.allclose(y[:16], y2[:16]) and torch.allclose(y[32:], y2[32:])
    assert not torch.allclose(y[16:32], y2[16:32])


@pytest.mark.parametrize("case", list(GRIDS))
def test_whole_tower_matches_hf(hf_vision, tower, case):
    grid = torch.tensor(GRIDS[case])
    x = _pixels(GRIDS[case], seed=3)
    with torch.no_grad():
        ref = hf_vision(x, grid_thw=grid)
        last, merged, ds = tower(x, grid)
    assert _maxerr(last, ref.last_hidden_state) < TOL
    assert _maxerr(merged, ref.pooler_output) < TOL
    assert len(ds) == len(ref.deepstack_features) == 2
    for a, b in zip(ds, ref.deepstack_features):
        assert _maxerr(a, b) < TOL
    print(f"{case}: max err merged {_maxerr(merged, ref.pooler_output):.2e}")


def test_items_encode_independently(tower):
    """Encoding images and videos in one call equals encoding each alone (the runner may batch them)."""
    grids = [(1, 4, 6), (2, 4, 4), (1, 8, 2)]
    pix = [_pixels([g], seed=i) for i, g in enumerate(grids)]
    with torch.no_grad():
        _, together, _ = tower(torch.cat(pix), torch.tensor(grids))
        alone = torch.cat([tower(p, torch.tensor([g]))[1] for p, g in zip(pix, grids)])
    assert _maxerr(together, alone) < TOL


# ------------------------------------------------------------------------------- tiny checkpoint
@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory):
    from fixtures.tiny_hf import make_tiny_qwen3_vl
    return make_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny_qwen3_vl"), seed=0)


@pytest.fixture(scope="module")
def mmp(vl_ckpt):
    from xllm_gen.runtime.multimodal.processor import MultiModalProcessor
    return MultiModalProcessor(str(vl_ckpt), json.loads((vl_ckpt / "config.json").read_text()))


def _image(h, w, seed=0):
    from PIL import Image
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _video(t, h, w, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


IMG_PH = "<|vision_start|><|image_pad|><|vision_end|>"
VID_PH = "<|vision_start|><|video_pad|><|vision_end|>"

REQUESTS = {
    "text": ("The capital of France is", {}),
    "one_image": (f"Describe {IMG_PH} the image.", {"image": [_image(50, 70)]}),
    "three_images": (f"A {IMG_PH} B {IMG_PH}{IMG_PH} C", {"image": [_image(40, 40, 1), _image(90, 33, 2),
                                                                     _image(64, 128, 3)]}),
    "one_video": (f"Describe the video. {VID_PH}", {"video": [_video(20, 48, 64)]}),
    "image_and_video": (f"{IMG_PH} then {VID_PH} and {IMG_PH}",
                        {"image": [_image(30, 60), _image(80, 50, 5)], "video": [_video(12, 40, 40, 4)]}),
}


def _hf_rope(ids, mm_types, image_grid, video_grid, merge=2):
    import functools
    from types import SimpleNamespace

    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel
    self = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge)),
                           get_vision_position_ids=functools.partial(Qwen3VLModel.get_vision_position_ids, None))
    pos, d = Qwen3VLModel.get_rope_index(self, ids, mm_token_type_ids=mm_types, image_grid_thw=image_grid,
                                         video_grid_thw=video_grid)
    return pos[:, 0], int(d[0, 0])


@pytest.mark.parametrize("case", list(REQUESTS))
def test_processor_matches_hf(mmp, case):
    prompt, mm = REQUESTS[case]
    proc = mmp.processor
    ref = proc(text=[prompt], images=mm.get("image"), videos=mm.get("video"), return_tensors="pt")
    out = mmp.process(0, prompt, None, mm, {})
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        a, b = getattr(out, key), ref.get(key)
        assert (a is None) == (b is None), key
        if a is not None:
            assert torch.equal(a, b), key
    if case == "text":
        assert out.mrope_delta == 0 and torch.equal(out.mrope_positions[0], out.mrope_positions[2])
    else:
        pos, d = _hf_rope(ref["input_ids"], ref["mm_token_type_ids"], ref.get("image_grid_thw"),
                          ref.get("video_grid_thw"))
        assert torch.equal(out.mrope_positions, pos) and out.mrope_delta == d
    # the same request as token ids with one placeholder token per item gives the same expansion
    ids = proc.tokenizer(prompt)["input_ids"]
    out2 = mmp.process(1, None, ids, mm, {})
    assert out2.prompt_token_ids == out.prompt_token_ids
    assert torch.equal(out2.mrope_positions, out.mrope_positions) and out2.mrope_delta == out.mrope_delta
    if out.pixel_values_videos is not None:
        assert torch.equal(out2.pixel_values_videos, out.pixel_values_videos)
    n_vis = int((torch.tensor(out.prompt_token_ids)[:, None] == torch.tensor(
        [mmp.image_token_id, mmp.video_token_id])).any(-1).sum())
    assert out.num_visual_tokens == n_vis


def test_video_timestamps_and_kwargs(mmp):
    """mm_processor_kwargs reach the processor (fps / frame count) and the timestamps are HF's."""
    vid = _video(48, 32, 32, 7)
    prompt = f"Watch {VID_PH}"
    for kw in ({}, {"fps": 4}, {"num_frames": 8, "fps": None}, {"do_sample_frames": False}):
        ref = mmp.processor(text=[prompt], videos=[vid], return_tensors="pt", **kw)
        out = mmp.process(0, prompt, None, {"video": [vid]}, kw)
        assert out.prompt_token_ids == ref["input_ids"][0].tolist(), kw
        ids = mmp.processor.tokenizer(prompt)["input_ids"]
        assert mmp.process(0, None, ids, {"video": [vid]}, kw).prompt_token_ids == out.prompt_token_ids
    text = mmp.tokenizer.decode(out.prompt_token_ids)
    assert "seconds>" in text
    # metadata given with the video (real fps): timestamps follow it
    out = mmp.process(0, prompt, None, {"video": [(vid, {"fps": 8.0, "total_num_frames": 48})]}, {})
    ref = mmp.processor(text=[prompt], videos=[vid], return_tensors="pt",
                        video_metadata=[{"fps": 8.0, "total_num_frames": 48}])
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()


def test_bad_inputs_raise_value_error_naming_request(mmp):
    img = _image(40, 40)
    bad = [
        (f"{IMG_PH}{IMG_PH}", {"image": [img]}, "image"),                       # fewer images than placeholders
        (f"{IMG_PH}", {"image": [img, img]}, "image"),                          # more images
        (f"{VID_PH}", {}, "video"),                                             # missing video
        (f"{IMG_PH}", {"image": ["cat.png"]}, "unsupported type"),
        (f"{IMG_PH}", {"image": [np.zeros((0, 10, 3), np.uint8)]}, "zero size"),
        (f"{IMG_PH}", {"image": [__import__("PIL.Image").Image.new("RGB", (0, 5))]}, "zero size"),
        (f"{IMG_PH}", {"image": [np.zeros((10, 10, 3), np.float64)]}, "dtype"),
        (f"{IMG_PH}", {"image": [np.zeros((10, 10, 3, 2), np.uint8)]}, "shape"),
        (f"{VID_PH}", {"video": [_video(1, 32, 32)]}, "too short"),
        (f"{VID_PH}", {"video": [np.zeros((0, 32, 32, 3), np.uint8)]}, "empty"),
        (f"{VID_PH}", {"video": [np.zeros((4, 32, 32), np.uint8)]}, "shape"),
        (f"{VID_PH}", {"video": [np.zeros((4, 32, 32, 3), np.int64)]}, "dtype"),
        ("hi", {"audio": [1]}, "audio"),
    ]
    for prompt, mm, what in bad:
        with pytest.raises(ValueError, match=r"request 7:.*" + what):
            mmp.process(7, prompt, None, mm, {})
    ids = mmp.tokenizer(f"{IMG_PH} x")["input_ids"]
    with pytest.raises(ValueError, match="request 3:.*2 image"):
        mmp.process(3, None, ids, {"image": [img, img]}, {})
    with pytest.raises(ValueError, match="request 4:.*no image"):
        mmp.check_no_placeholders(4, ids)
    mmp.check_no_placeholders(4, [1, 2, 3])


def test_text_only_positions(mmp):
    out = mmp.process(0, None, [5, 6, 7, 8], {}, {})
    assert out.prompt_token_ids == [5, 6, 7, 8] and out.mrope_delta == 0 and not out.has_vision
    assert out.mrope_positions.tolist() == [[0, 1, 2, 3]] * 3


# ------------------------------------------------------------------------ whole model (the draft)
DRAFT = Path(os.environ.get("XLLM_QWEN3_VL_DRAFT", "/tmp/drafts/qwen3_vl_model_target.py"))


def _load_draft():
    if not DRAFT.exists():
        pytest.skip(f"no draft model module at {DRAFT}")
    spec = importlib.util.spec_from_file_location("qwen3_vl_draft", DRAFT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _draft_prefill(mod, ckpt: Path, mm, zero_deepstack=False, blocked=False, device="cpu", dtype=torch.float32):
    from xllm_gen.runtime.attention.torch_ref import TorchPagedBackend
    from xllm_gen.runtime.executor.context import DeepstackInput, ForwardContext, reset_context, set_context
    from xllm_gen.runtime.loading.loader import load_weights

    cfg = mod.Config.from_hf(json.loads((ckpt / "config.json").read_text()))
    with torch.device(device):
        model = mod.Model(cfg).to(dtype).eval()
    load_weights(model, mod.weight_plan(cfg), ckpt, ignored=mod.IGNORED_CHECKPOINT_TENSORS)
    if blocked:
        for m in model.modules():
            if getattr(m, "kind", None) == "mrope_interleaved":    # L.Rotary: the layout lives in axis_map
                from xllm_gen.runtime.layers import mrope_axis_map
                m.kind = "mrope_blocked"
                m.axis_map = mrope_axis_map("mrope_blocked", m.mrope_section, m.head_dim // 2)
    ids = torch.tensor(mm.prompt_token_ids, device=device)
    n = ids.numel()
    with torch.no_grad():
        embeds = model.embed_input_ids(ids)
        deepstack = None
        pix, grid = mm.vision_batch()
        if pix is not None:
            vis, ds = model.encode_vision(pix, grid)
            rows = mm.visual_token_positions.to(device)
            embeds = embeds.index_copy(0, rows, vis.to(embeds.dtype))
            if zero_deepstack:
                ds = torch.zeros_like(ds)
            deepstack = DeepstackInput(visual_rows=rows, embeds=ds)
        backend = TorchPagedBackend()
        ctx = ForwardContext(is_prefill=True, cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
                             seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
                             slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
                             block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device), seq_lens_cpu=[n],
                             query_lens_cpu=[n], backend=backend, deepstack=deepstack)
        backend.plan(ctx)
        set_context(ctx)
        try:
            hidden = model(ids, mm.mrope_positions.to(device), embeds)
            return model.compute_logits(hidden).float()
        finally:
            reset_context()


@pytest.fixture(scope="module")
def hf_vl(vl_ckpt):
    from transformers import Qwen3VLForConditionalGeneration
    return Qwen3VLForConditionalGeneration.from_pretrained(vl_ckpt, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", list(REQUESTS))
def test_draft_model_prefill_logits_match_hf(vl_ckpt, mmp, hf_vl, case):
    mod = _load_draft()
    prompt, mm = REQUESTS[case]
    inputs = mmp.process(0, prompt, None, mm, {})
    ref_in = mmp.processor(text=[prompt], images=mm.get("image"), videos=mm.get("video"), return_tensors="pt")
    with torch.no_grad():
        ref = hf_vl(**ref_in).logits[0].float()
    ours = _draft_prefill(mod, vl_ckpt, inputs)
    err = _maxerr(ours, ref)
    print(f"{case}: prefill logits max abs err {err:.2e} (|logits| max {ref.abs().max():.1f})")
    assert err < 1e-3, err
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    if inputs.has_vision:      # sensitivity arms: zeroed deepstack and the blocked mRoPE layout change logits
        assert _maxerr(_draft_prefill(mod, vl_ckpt, inputs, zero_deepstack=True), ref) > 1e-2
        assert _maxerr(_draft_prefill(mod, vl_ckpt, inputs, blocked=True), ref) > 1e-2


# ------------------------------------------------------------------------------------ TP over gloo
def _vision_tp_worker(rank, world, port, result_q):
    import torch.distributed as dist

    from xllm_gen.runtime.executor import distributed as D
    from xllm_gen.runtime.executor.sharding import Segment, segment_range
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        D.init_tp(rank, world)
        cfg = Qwen3VLVisionConfig(**VCFG)
        cfg._attn_implementation = "sdpa"
        ref_model = Qwen3VLVisionModel(cfg).float().eval()
        _widen(ref_model)
        tower = Tower(VCFG).float().eval()
        heads, hd, inter = VCFG["num_heads"], VCFG["hidden_size"] // VCFG["num_heads"], VCFG["intermediate_size"]
        attn_tp, mlp_tp = V.vision_tp_sharded(heads), V.vision_tp_sharded(inter)

        def shard(t, segs, dim):
            parts, start = [], 0
            for s in segs:
                a, b = segment_range(s, world, rank)
                parts.append(t.narrow(dim, start + a, b - a))
                start += s.size
            return torch.cat(parts, dim)

        qkv = [Segment(n, heads, hd) for n in "qkv"]
        sd = {}
        for name, t in ref_model.state_dict().items():
            if attn_tp and (name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias")):
                t = shard(t, qkv, 0)
            elif attn_tp and name.endswith("attn.proj.weight"):
                t = shard(t, [Segment("o", heads, hd)], 1)
            elif mlp_tp and ".mlp.linear_fc1." in name:
                t = shard(t, [Segment("fc1", inter)], 0)
            elif mlp_tp and name.endswith("mlp.linear_fc2.weight"):
                t = shard(t, [Segment("fc1", inter)], 1)
            sd[name] = t
        tower.load_state_dict(sd, strict=True)
        grid = torch.tensor(GRIDS["image_and_video"])
        x = _pixels(GRIDS["image_and_video"], seed=3)
        with torch.no_grad():
            ref = ref_model(x, grid_thw=grid)
            _, merged, ds = tower(x, grid)
        err = max([_maxerr(merged, ref.pooler_output)] + [_maxerr(a, b) for a, b in zip(ds, ref.deepstack_features)])
        result_q.put((rank, {"err": err, "attn_tp": attn_tp, "mlp_tp": mlp_tp,
                             "heads_per_rank": tower.blocks[0].attn.num_heads}))
        dist.destroy_process_group()
    except BaseException:
        import traceback
        result_q.put((rank, traceback.format_exc()))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_vision_tower_tp_equals_hf(world):
    """world 2: heads and MLP split; world 4: 2 heads don't divide -> attention replicated, MLP split."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_vision_tp_worker, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, res = q.get(timeout=180)
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=30)
    for rank, res in results.items():
        assert isinstance(res, dict), res
        assert res["err"] < TOL, (rank, res)
        assert res["mlp_tp"] is True
        assert res["attn_tp"] is (world == 2)
        assert res["heads_per_rank"] == (1 if world == 2 else 2)


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_tower_and_draft_prefill(vl_ckpt, mmp, hf_vl, hf_vision, tower, dtype):
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    grid = torch.tensor(GRIDS["image_and_video"])
    x = _pixels(GRIDS["image_and_video"], seed=3)
    hv, tw = hf_vision.to(dev, dtype), tower.to(dev, dtype)
    try:
        with torch.no_grad():
            ref = hv(x.to(dev, dtype), grid_thw=grid.to(dev))
            _, merged, ds = tw(x.to(dev, dtype), grid)
        err = _maxerr(merged.float(), ref.pooler_output.float())
        scale = ref.pooler_output.float().abs().max().item()
        print(f"GPU tower {dtype}: merged max err {err:.2e} (max |x| {scale:.1f})")
        assert err < (1e-4 if dtype == torch.float32 else 0.05 * scale)
    finally:
        hf_vision.to("cpu", torch.float32)
        tower.to("cpu", torch.float32)

    mod = _load_draft()
    prompt, mm = REQUESTS["image_and_video"]
    inputs = mmp.process(0, prompt, None, mm, {})
    ref_in = mmp.processor(text=[prompt], images=mm.get("image"), videos=mm.get("video"), return_tensors="pt")
    hf = hf_vl.to(dev, dtype)
    try:
        with torch.no_grad():
            ref = hf(**{k: v.to(dev) for k, v in ref_in.items()}).logits[0].float().cpu()
    finally:
        hf_vl.to("cpu", torch.float32)
    ours = _draft_prefill(mod, vl_ckpt, inputs, device=dev, dtype=dtype).cpu()
    err = _maxerr(ours, ref)
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"GPU draft prefill {dtype}: logits max err {err:.2e}, argmax agreement {agree:.3f}")
    assert err < (1e-3 if dtype == torch.float32 else 0.5)
