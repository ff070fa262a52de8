"""The Triton fused MoE's tile configuration (ops/moe_triton.py MoeConfig): non-default tiles, rows per block,
warps and stages give the torch reference's result (under TRITON_INTERPRET=1 on CPU, float32), pairs and whole
padding rows routed nowhere (id == E) included; the default config keeps the former fixed tiles."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from xllm_gen.runtime.ops.moe_triton import MoeConfig, default_config

CONFIGS = [
    dict(block_m=16, block_n1=16, block_k1=32, block_n2=32, block_k2=16, num_warps=2, num_stages=2),
    dict(block_m=32, block_n1=32, block_k1=16, block_n2=16, block_k2=32, num_warps=8, num_stages=4),
    dict(block_m=64, block_n1=64, block_k1=128, block_n2=128, block_k2=64, num_warps=4, num_stages=3),  # > dims
]

_INTERPRETED = r"""
import json, sys, torch, torch.nn.functional as F
from xllm_gen.runtime.ops.moe import fused_moe_reference, topk_softmax
from xllm_gen.runtime.ops.moe_triton import MoeConfig, fused_moe_silu
def act(h):
    n = h.shape[-1] // 2
    return F.silu(h[..., :n]) * h[..., n:]
configs = [MoeConfig(**c) for c in json.loads(sys.argv[1])]
T, E, K, H, I = 5, 4, 2, 64, 32
torch.manual_seed(0)
x = torch.randn(T, H)
w13, w2 = torch.randn(E, 2 * I, H) / H ** .5, torch.randn(E, H, I) / I ** .5
w, ids = topk_softmax(torch.randn(T, E), K, True)
ids[0, 1] = E                                   # one pair routed nowhere
ids[T - 1] = E                                  # a padding row: every pair routed nowhere
ref = fused_moe_reference(x, w13, w2, w, ids, act)
out = {}
for i, cfg in enumerate([None] + configs):
    a = fused_moe_silu(x, w13, w2, w, ids, config=cfg)
    out[str(i)] = dict(rel=((a - ref).abs().max() / ref.abs().max()).item(),
                       pad_zero=bool(torch.all(a[T - 1] == 0)), shape=list(a.shape))
print("RESULT " + json.dumps(out))
"""


def test_default_config_follows_the_sweep():
    # Qwen3-30B-A3B's shapes: the H200 sweep's best configs for decode-sized and prefill-sized steps
    assert default_config(1, 128, 8, 2048, 768) == MoeConfig(16, 32, 256, 64, 128, 4, 3)
    assert default_config(64, 128, 8, 2048, 768) == MoeConfig(16, 32, 256, 64, 128, 4, 3)
    assert default_config(512, 128, 8, 2048, 768) == MoeConfig(64, 128, 64, 128, 64, 8, 3)
    # small dimensions cap the tiles (at least 16: tl.dot's minimum)
    assert default_config(5, 4, 2, 64, 32) == MoeConfig(16, 32, 64, 64, 32, 4, 3)
    assert default_config(5, 4, 2, 8, 8) == MoeConfig(16, 16, 16, 16, 16, 4, 3)


@pytest.mark.parametrize("bad", [dict(block_m=8), dict(block_n1=48), dict(block_k2=0), dict(num_warps=3),
                                 dict(num_stages=0)])
def test_config_rejects_invalid_tiles(bad):
    with pytest.raises(ValueError):
        MoeConfig(**bad)


def test_configs_match_reference_interpreted():
    """Each config (and the default) under TRITON_INTERPRET=1 on CPU equals fused_moe_reference within 1e-4
    (relative to the output's largest magnitude); the padding row's output is exactly zero."""
    p = subprocess.run([sys.executable, "-c", _INTERPRETED, json.dumps(CONFIGS)],
                       env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    res = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert len(res) == 1 + len(CONFIGS)
    for i, r in res.items():
        cfg = "default" if i == "0" else CONFIGS[int(i) - 1]
        assert r["shape"] == [5, 64], (cfg, r)
        assert r["rel"] <= 1e-4, f"{cfg}: max relative error {r['rel']}"
        assert r["pad_zero"], f"{cfg}: the padding row's output is not zero"


_ALIGN = r"""
import random, torch
from xllm_gen.runtime.ops.moe import moe_align, route_reference
from xllm_gen.runtime.ops.moe_triton import moe_align_triton, route_topk
rng = random.Random(0)
torch.manual_seed(0)
# routing: top-k ids exactly, weights to float32 rounding; renormalized or not, local experts of an expert-parallel
# rank (first, count), decode padding rows (a negative KV slot), experts not a power of two, top_k = E
for T, E, K, renorm, first, count, padded in [(1, 128, 8, True, 0, 128, False), (7, 6, 2, False, 0, 6, True),
                                             (33, 60, 4, True, 16, 20, True), (5, 8, 8, True, 0, 8, False),
                                             (40, 128, 8, False, 64, 64, True)]:
    logits = torch.randn(T, E)
    slots = torch.randint(-1, 5, (T,)) if padded else None
    (wa, ia), (wb, ib) = route_topk(logits, K, renorm, first, count, slots), route_reference(logits, K, renorm, first, count, slots)
    assert torch.equal(ia, ib) and torch.allclose(wa, wb, rtol=1e-6, atol=1e-7), (T, E, K, ia, ib, wa, wb)
    assert (ia == count).any() == (padded or count < E), "pairs routed nowhere"
cases = [(E, K, T, bm) for E, K, T, bm in [(2, 1, 1, 16), (4, 2, 5, 16), (8, 2, 40, 32), (60, 4, 7, 16),
                                            (128, 8, 1, 16), (32, 8, 33, 64), (5, 2, 600, 16)]]
for i, (E, K, T, bm) in enumerate(cases):
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    if i % 2:
        ids[0, 0] = E                     # one pair routed nowhere
        ids[-1] = -1 if i % 4 == 1 else E     # a padding row (any id outside 0..E-1)
    a, b = moe_align(ids, E, bm), moe_align_triton(ids, E, bm)
    for x, y, name in zip(a, b, a._fields):
        assert torch.equal(x, y), (E, K, T, bm, name)
print("ALIGN OK")
"""


def test_triton_route_and_align_equal_torch_interpreted():
    """route_topk gives ops.moe.route_reference's ids exactly (and its weights); moe_align_triton gives exactly
    ops.moe.moe_align's rows, block experts and row count: several chunks of pairs (1200 pairs: stable order within
    an expert), up to 128 experts, 16-64 rows per block, pairs routed nowhere."""
    p = subprocess.run([sys.executable, "-c", _ALIGN], env=dict(os.environ, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "ALIGN OK" in p.stdout, p.stdout[-2000:] + p.stderr[-4000:]
