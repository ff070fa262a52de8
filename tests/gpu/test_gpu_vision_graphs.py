"""Vision tower CUDA graphs per bucket of patch counts on the GPU (marker `gpu`; skipped without CUDA):
runtime/executor/vision_graphs.py with the generated Qwen3-VL tower at Qwen3-VL-8B's vision widths (hidden
1152, 16 heads of 72, MLP 4304; 4 blocks, deepstack taps at 1 and 3), random bfloat16 weights.

- graph replay == the same padded bucket inputs run eagerly (same kernels: the flash varlen attention),
  bit for bit on the real rows, for one image that fills its bucket (its graph has no padding and SDPA's
  attention: equal to the plain eager tower bit for bit too), one that is padded, a 4-frame video and
  images + video together; a second call of a bucket reuses its graph;
- graph vs the plain eager tower (SDPA per group of equal segments, unpadded): bf16 agreement (other attention
  kernels and GEMM shapes, so not bitwise);
- the engine: a tiny VL LLM on CUDA captures a tower graph at its first image request and replays it, and the
  features it feeds equal the eager tower's to bf16 noise.
Numbers are printed (pytest -s) and appended as JSON lines to $XLLM_TEST_REPORT when set.
"""
from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from fixtures.report import report as _report

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("xllm_gen.generated.qwen3_vl.model") is None,
                                 reason="generated/qwen3_vl is not generated")]

GRIDS = {
    "image_fills_bucket": [(1, 32, 32)],               # 1024 patches: bucket 1024, no padding
    "image_padded": [(1, 30, 34)],                     # 1020 patches: padding rows in bucket 1024
    "video_4_frames": [(4, 16, 20)],                   # 1280 = a bucket, 4 segments (+ an empty padding one): 8 slots
    "images_and_video": [(1, 8, 12), (2, 14, 14), (1, 20, 6)],
}


@pytest.fixture(scope="module")
def tower(tmp_path_factory):
    from fixtures.tiny_hf import make_tiny_qwen3_vl

    from xllm_gen.generated.qwen3_vl import model as M
    d = make_tiny_qwen3_vl(tmp_path_factory.mktemp("vl_vgraph_gpu"), vision_depth=4, vision_hidden_size=1152,
                           vision_num_heads=16, vision_intermediate_size=4304, deepstack_visual_indexes=(1, 3),
                           num_position_embeddings=2304, seed=0)
    cfg = M.Config.from_hf(json.loads((d / "config.json").read_text()))
    with torch.device("cuda"):
        t = M.Qwen3VLVisionModel(cfg).to(torch.bfloat16).eval()
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(t.named_parameters()):
            if "norm" in name and name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=gen, device="cuda") + 0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * 0.1)
            elif name.endswith("pos_embed.weight"):
                p.copy_(torch.randn(p.shape, generator=gen, device="cuda"))
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device="cuda") / math.sqrt(math.prod(p.shape[1:])))
    return t


def _pixels(tower, grid, seed=0):
    n = sum(t * h * w for t, h, w in grid)
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, tower.patch_embed.patch_dim, generator=g, device="cuda").to(torch.bfloat16)


@pytest.mark.parametrize("case", list(GRIDS))
def test_graph_equals_eager_on_real_rows(tower, case):
    from xllm_gen.runtime.executor.vision_graphs import VisionGraphs
    grid = torch.tensor(GRIDS[case])
    pix = _pixels(tower, GRIDS[case])
    graphs, padded_eager = VisionGraphs(tower), VisionGraphs(tower, capture=False)
    with torch.no_grad():
        g = graphs(pix, grid)
        e = padded_eager(pix, grid)
        plain = tower(pix, grid)
        g2 = graphs(pix, grid)
    assert graphs.disabled is None, graphs.disabled
    assert graphs.replays == 2 and len(graphs.buckets) == 1
    key = next(iter(graphs.buckets))
    assert torch.equal(g[0], e[0]) and torch.equal(g[1], e[1]), "graph replay differs from the same inputs eager"
    assert torch.equal(g2[0], g[0]) and torch.equal(g2[1], g[1])
    assert g[0].shape == plain[0].shape and g[1].shape == plain[1].shape
    err = max((g[0].float() - plain[0].float()).abs().max().item(), (g[1].float() - plain[1].float()).abs().max().item())
    scale = max(plain[0].float().abs().max().item(), plain[1].float().abs().max().item())
    print(f"vision graph {case}: bucket {key}, rows {pix.shape[0]}; vs plain eager max err {err:.3g} "
          f"(max |x| {scale:.3g})")
    _report(test="gpu_vision_graph", case=case, bucket=list(key), rows=int(pix.shape[0]), err=err, scale=scale)
    if key[1] == 1:             # one segment filling its bucket: the eager call's kernels, captured
        assert err == 0.0, "graph of a full bucket differs from the eager tower"
    assert err < 0.05 * scale


def test_engine_replays_tower_graph(tmp_path):
    import numpy as np
    from fixtures.tiny_hf import make_tiny_qwen3_vl
    from PIL import Image

    from xllm_gen import LLM, SamplingParams
    d = make_tiny_qwen3_vl(tmp_path / "ckpt", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=128, intermediate_size=512, mrope_section=(24, 20, 20),
                           max_position_embeddings=4096, rope_theta=10000.0, vision_hidden_size=64,
                           vision_num_heads=4, seed=0)
    llm = LLM(str(d), dtype="bfloat16", max_num_seqs=4, num_kv_blocks=256, max_model_len=1024,
              enable_prefix_caching=False, _debug={"vision_graphs": True})
    try:
        runner = llm.engine.runner
        vg = runner.vision_graphs
        assert vg is not None
        img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8))
        req = {"prompt": "Describe <|vision_start|><|image_pad|><|vision_end|> the image.",
               "multi_modal_data": {"image": [img]}}
        out = llm.generate([req, req], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert vg.disabled is None, vg.disabled
        assert vg.replays >= 1 and len(vg.buckets) == 1
        assert out[0].outputs[0].token_ids == out[1].outputs[0].token_ids
        mm = llm.engine.mm_processor.process(0, req["prompt"], None, req["multi_modal_data"], {})
        pix, grid = mm.vision_batch()
        with torch.no_grad():
            g = runner.encode_vision(pix, grid)
            e = runner.model.encode_vision(pix.to(runner.device, runner.dtype), grid.to(runner.device))
        err = (g[0].float() - e[0].float()).abs().max().item()
        scale = e[0].float().abs().max().item()
        print(f"engine vision graph: features vs eager max err {err:.3g} (max |x| {scale:.3g})")
        assert err < 0.05 * scale
    finally:
        llm.shutdown()
