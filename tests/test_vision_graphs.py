"""Vision tower CUDA graphs per bucket of patch counts (runtime/executor/vision_graphs.py): the padding and
bucketing logic on the CPU, float32, with the generated Qwen3-VL tower (capture=False: the graph's inputs,
padded to the bucket, run eagerly; attention through the varlen path over device-style boundaries).

- the real rows of a bucketed call equal the unpadded eager tower's (images, a video's frames, both);
- the padding rows' content cannot reach the real rows (garbage padding: bit-identical real rows), and the
  sensitivity arm: padding rows put into the last real segment do change them (the test can fail);
- bucket / slot selection, the eager fallback beyond the largest bucket or slot count (the eager result
  exactly), and varlen_attention with empty segments equals SDPA per segment.
The GPU half (graph replay == the same padded inputs run eagerly, bit for bit) is tests/gpu/test_gpu_vision_graphs.py.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from xllm_gen.runtime.executor.vision_graphs import VisionGraphs
from xllm_gen.runtime.layers import vision as V

TOL = 2e-5


@pytest.fixture(scope="module")
def tower(tmp_path_factory):
    from fixtures.tiny_hf import make_tiny_qwen3_vl

    from xllm_gen.generated.qwen3_vl import model as M
    d = make_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny_qwen3_vl_vgraph"), seed=0)
    cfg = M.Config.from_hf(json.loads((d / "config.json").read_text()))
    t = M.Qwen3VLVisionModel(cfg).float().eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(t.named_parameters()):
            if "norm" in name and name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith("pos_embed.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(math.prod(p.shape[1:])))
    return t


def _pixels(tower, grid, seed=0):
    n = sum(t * h * w for t, h, w in grid)
    return torch.randn(n, tower.patch_embed.patch_dim, generator=torch.Generator().manual_seed(seed))


GRIDS = {
    "one_image": [(1, 4, 6)],
    "three_images": [(1, 4, 4), (1, 6, 2), (1, 8, 10)],
    "video": [(3, 4, 6)],
    "image_and_video": [(1, 2, 8), (2, 6, 6), (1, 10, 4)],
}


def _err(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case", list(GRIDS))
def test_bucketed_rows_equal_unpadded_eager(tower, case):
    grid = torch.tensor(GRIDS[case])
    pix = _pixels(tower, GRIDS[case])
    vg = VisionGraphs(tower, sizes=(20, 68, 140, 260), slots=(2, 4, 8), capture=False)
    with torch.no_grad():
        ref_e, ref_d = tower(pix, grid)
        emb, ds = vg(pix, grid)
    key = vg.key(pix.shape[0], sum(t for t, _, _ in GRIDS[case]))
    assert key is not None and key[0] > pix.shape[0] and list(vg.buckets) == [key]    # padded, bucketed
    assert emb.shape == ref_e.shape and ds.shape == ref_d.shape
    assert _err(emb, ref_e) < TOL and _err(ds, ref_d) < TOL, (_err(emb, ref_e), _err(ds, ref_d))


def test_one_segment_filling_a_bucket_is_the_eager_call(tower):
    grid = torch.tensor([(1, 4, 6)])
    pix = _pixels(tower, [(1, 4, 6)], seed=4)
    vg = VisionGraphs(tower, sizes=(24, 64), slots=(2, 4), capture=False)
    with torch.no_grad():
        out, ref = vg(pix, grid), tower(pix, grid)
    assert list(vg.buckets) == [(24, 1)] and vg.buckets[(24, 1)].inputs.segments.cu_seqlens is None
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_padding_content_never_reaches_real_rows(tower):
    grid = torch.tensor(GRIDS["image_and_video"])
    pix = _pixels(tower, GRIDS["image_and_video"], seed=1)
    vg = VisionGraphs(tower, sizes=(256,), slots=(8,), capture=False)
    with torch.no_grad():
        a = vg(pix, grid)
        b = vg.buckets[(256, 8)]
        p = pix.shape[0]
        for buf in (b.pixels, b.pos, b.cos, b.sin):          # garbage in every padding row
            buf[p:] = torch.randn(buf[p:].shape) * 100
        b.fill(pix, vg.tower.prepare(grid))
        again = vg.tower(b.pixels, inputs=b.inputs)
        m = a[0].shape[0]
        assert torch.equal(again[0][:m], a[0]) and torch.equal(again[1][:, :m], a[1])
        # sensitivity: the padding rows inside the last real segment (a wrong boundary) change the real rows
        wrong = list(b.inputs.segments.bounds)
        n_real = len(vg.tower.prepare(grid).segments.bounds)
        wrong[n_real - 1:] = [256] * (len(wrong) - n_real + 1)
        b.cu.copy_(torch.tensor(wrong, dtype=torch.int32))
        leaked = vg.tower(b.pixels, inputs=b.inputs)
        assert _err(leaked[0][:m], a[0]) > 1e-3


def test_keys_and_eager_fallback(tower):
    vg = VisionGraphs(tower, sizes=(16, 64), slots=(2, 4), capture=False)
    assert vg.key(12, 1) == (16, 2)          # rows fit 16, one segment + padding: 2 slots
    assert vg.key(17, 1) == (64, 2)
    assert vg.key(10, 2) == (16, 4)
    assert vg.key(64, 1) == (64, 1) and vg.key(64, 2) == (64, 4)  # one segment filling a bucket: no padding
    assert vg.key(65, 1) is None and vg.key(10, 4) is None        # beyond the largest bucket / slot count
    for grid in ([(1, 10, 8)], [(4, 2, 2)]):                        # 80 rows; 4 frames = 5 slots > 4
        g = torch.tensor(grid)
        pix = _pixels(tower, grid, seed=2)
        with torch.no_grad():
            ref = tower(pix, g)
            out = vg(pix, g)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]) and not vg.buckets
    with pytest.raises(ValueError, match="slots"):
        VisionGraphs(tower, slots=(1,))


def test_varlen_attention_with_empty_segments():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(20, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 6, 6, 15, 20, 20], dtype=torch.int32)
    out = V.varlen_attention(q, k, v, cu, 20, 0.3)
    ref = V.segment_attention(q, k, v, [0, 6, 15, 20], 0.3)
    assert _err(out, ref) < 1e-6
    segs = V.VisionSegments([0, 6, 15, 20], cu, 20)              # with device-style boundaries: varlen
    assert _err(V.segment_attention(q, k, v, segs, 0.3), ref) < 1e-6
    # consecutive equal segments (a video's frames): one batched SDPA over views == one call per segment
    eq = V.segment_attention(q, k, v, [0, 5, 10, 15, 20], 0.3)
    per = torch.cat([V.segment_attention(q[a:a + 5], k[a:a + 5], v[a:a + 5], [0, 5], 0.3) for a in (0, 5, 10, 15)])
    assert _err(eq, per) < 1e-6
