"""Fused ops: every Triton kernel runs on CPU under TRITON_INTERPRET=1 (in a subprocess, since the variable
must be set before triton is imported) against its torch reference; the custom ops pass torch.library.opcheck
(schema, fake implementation, mutation annotations) on the CPU path."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from interpreted import run_interpreted

# ------------------------------------------------------------------------------------------------ kernel checks
# Each check returns the error of the Triton kernel vs the reference (max |a-b| / max(1, max |ref|)) and the
# tolerance it must meet.


def _checks():
    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime.ops import reference as R
    from xllm_gen.runtime.ops import triton_kernels as T

    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    def err(a, b):
        """max |a - b| / max(1, max |b|): the error in units of the output's scale."""
        if not a.numel():
            return 0.0
        return (a.float() - b.float()).abs().max().item() / max(1.0, b.float().abs().max().item())

    tol = {torch.float32: 1e-6, torch.bfloat16: 3e-2}   # bf16: a few ulps at the max
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        n = str(dt).split(".")[-1]
        t = tol[dt]
        x = rnd(5, 64, dtype=dt)[:, :48]                       # strided rows, D not a power of 2
        w = rnd(48, dtype=dt)
        r = rnd(5, 48, dtype=dt)
        out[f"rms_norm_{n}"] = (err(T.rms_norm(x, w, 1e-6), R.rms_norm(x, w, 1e-6)), t)
        y, nr = T.fused_add_rms_norm(x, r, w, 1e-6)
        y2, nr2 = R.fused_add_rms_norm(x, r, w, 1e-6)
        out[f"fused_add_rms_norm_{n}"] = (max(err(y, y2), err(nr, nr2)), t)
        x3 = rnd(2, 3, 2 * 40, dtype=dt)
        out[f"silu_and_mul_{n}"] = (err(T.silu_and_mul(x3), R.silu_and_mul(x3)), t)
        D, H, Hk, N = 32, 4, 2, 7
        qkv = rnd(N, (H + 2 * Hk) * D, dtype=dt)
        q, k, v = qkv.split([H * D, Hk * D, Hk * D], -1)
        q, k, v = q.view(N, H, D), k.view(N, Hk, D), v.view(N, Hk, D)
        qw, kw = rnd(D, dtype=dt), rnd(D, dtype=dt)
        for kind in ("neox", "mrope_interleaved", "mrope_blocked"):
            rot = L.Rotary(D, 1e6, 256, kind, None if kind == "neox" else [6, 5, 5])
            pos = torch.randint(0, 256, (N,) if kind == "neox" else (3, N), generator=g)
            for norm in (True, False):
                a = T.qk_norm_rope(q, k, qw if norm else None, kw if norm else None, 1e-6, pos, rot.cos_sin_cache,
                                   rot.axis_map)
                b = R.qk_norm_rope(q, k, qw if norm else None, kw if norm else None, 1e-6, pos, rot.inv_freq,
                                   rot.axis_map)
                # cos/sin: the kernel reads the table, the reference computes on the fly (1 ulp apart in fp32)
                out[f"qk_norm_rope_{kind}_{'norm' if norm else 'nonorm'}_{n}"] = (
                    max(err(a[0], b[0]), err(a[1], b[1])), t)
        # vision rotary, in place on the q / k views of a fused qkv output; half width 36 (not a power of 2)
        P, Hv, Dv = 5, 3, 72
        qkv_v = rnd(P, 3, Hv, Dv, dtype=dt)
        ang = rnd(P, Dv // 2).float()
        cos_v, sin_v = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        want = R.vision_rope(qkv_v[:, 0], qkv_v[:, 1], cos_v, sin_v)
        v_before = qkv_v[:, 2].clone()
        T.vision_rope_(qkv_v[:, 0], qkv_v[:, 1], cos_v, sin_v)
        out[f"vision_rope_{n}"] = (max(err(qkv_v[:, 0], want[0]), err(qkv_v[:, 1], want[1]),
                                       err(qkv_v[:, 2], v_before)), t)
        kc, vc = rnd(6, 4, Hk, D, dtype=dt), rnd(6, 4, Hk, D, dtype=dt)
        kc2, vc2 = kc.clone(), vc.clone()
        slots = torch.tensor([3, -1, 23, 0, 9, -1, 17])
        T.store_kvcache(k, v, kc, vc, slots)
        R.store_kvcache(k, v, kc2, vc2, slots)
        out[f"store_kvcache_{n}"] = (max(err(kc, kc2), err(vc, vc2)), 0.0)
        # per-tensor KV scales: the cache holds k / k_scale, correctly rounded as the reference's division (float32
        # exactly; bfloat16 within an ulp: the interpreter's float32-to-bfloat16 conversion). On a cache of the
        # step's dtype here: the Triton 3.8 interpreter's float-to-float8 conversion is wrong on CPU
        # (124.0 -> 64.0, 100.0 -> 104.0: the mantissa carry), so the float8 store runs in tests/gpu
        kc, vc = torch.zeros(6, 4, Hk, D, dtype=dt), torch.zeros(6, 4, Hk, D, dtype=dt)
        kc2, vc2 = kc.clone(), vc.clone()
        T.store_kvcache(k, v, kc, vc, slots, 0.37, 3e-3)
        R.store_kvcache(k, v, kc2, vc2, slots, 0.37, 3e-3)
        out[f"store_kvcache_scaled_{n}"] = (max(err(kc, kc2), err(vc, vc2)), 0.0 if dt == torch.float32 else t)
    # skinny GEMM (decode GEMV) vs F.linear: M rows <= 8, K a multiple of BLOCK_K (64, 32) or not (96, 160: masked
    # K tail), with and without bias. BLOCK_N is raised (fewer interpreted programs): 8 for N 64, 64 for N 96 (the
    # second program's rows 96..127 are clamped reads, never stored)
    import torch.nn.functional as F
    for dt in (torch.float32, torch.bfloat16):
        n = str(dt).split(".")[-1]
        for M in (1, 3, 8):
            for N, K in ((64, 32), (96, 160)):
                xs = rnd(M, K + 16, dtype=dt)[:, :K]                # strided rows
                ws = rnd(N, K, dtype=dt)
                bs = rnd(N, dtype=dt)
                for has_bias in (False, True):
                    b = bs if has_bias else None
                    key = f"skinny_gemm_M{M}_N{N}_K{K}_{'bias' if has_bias else 'nobias'}_{n}"
                    out[key] = (err(T.skinny_gemm(xs, ws, b, block_n=8 if N == 64 else 64), F.linear(xs, ws, b)),
                                1e-5 if dt == torch.float32 else tol[dt])
                if N == 96 and dt == torch.float32:    # the tuner's other launch configs (BLOCK_K 256 > K: masked)
                    for cfg in T.skinny_gemm_candidates(M, N, K, 4)[1:]:
                        out[f"skinny_gemm_M{M}_N{N}_K{K}_config{'_'.join(map(str, cfg))}_{n}"] = (
                            err(T.skinny_gemm(xs, ws, bs, config=cfg), F.linear(xs, ws, bs)), 1e-5)
    # the tensor-core skinny GEMM (9..64 rows): split-K 1 and 3 (the last program of a column block reduces the
    # workspace, then resets its counter), a masked K tail, padded rows; float16 (the interpreter's bfloat16 dot is
    # wrong on CPU; bfloat16 runs in tests/gpu)
    for M, N, K, cfg in ((9, 70, 384, (16, 32, 128, 4, 3, 3)), (16, 64, 130, (16, 32, 64, 4, 3, 1)),
                         (33, 40, 200, (64, 32, 64, 4, 3, 2))):
        xs, ws, bs = rnd(M, K + 16, dtype=torch.float16)[:, :K], rnd(N, K, dtype=torch.float16), rnd(N, dtype=torch.float16)
        y = T.skinny_gemm(xs, ws, bs, config=cfg)
        out[f"skinny_mma_M{M}_N{N}_K{K}_split{cfg[-1]}"] = (err(y, F.linear(xs.float(), ws.float(), bs.float())), 2e-3)
        # each row's result does not depend on the other rows (a batch padded into its graph bucket)
        out[f"skinny_mma_M{M}_rows_independent"] = (err(T.skinny_gemm(xs[:M - 5], ws, bs, config=cfg), y[:M - 5]), 0.0)
    out["skinny_mma_counters_reset"] = (float(sum(int(c.abs().sum()) for c in T._SPLITK_COUNTERS.values())), 0.0)
    out.update(_decode_attention_checks(rnd, err))
    # empty inputs launch nothing
    e = torch.empty(0, 48)
    out["empty"] = (float(T.rms_norm(e, torch.ones(48), 1e-6).shape != (0, 48)), 0.0)
    return out


def _decode_attention_checks(rnd, err):
    """Paged decode attention (ops/decode_attention.py) vs its reference, which is itself checked against the
    CPU attention backend (TorchPagedBackend, the HF-semantics oracle). Rows of 1 token, a page boundary, a
    padding row (no pages), pages shuffled; GQA groups 1, 2 and 4 (padded to 16 rows); head_dim 48 (masked);
    1 and 3 splits (merge in the kernel), the same scratch for every launch (its tickets must return to 0);
    sliding window, soft-cap and attention sinks (with a window). float32 and float16: the Triton 3.8 interpreter's bfloat16 dot is wrong on
    CPU (bfloat16 runs in the GPU tests)."""
    from xllm_gen.runtime.attention import TorchPagedBackend
    from xllm_gen.runtime.attention.base import AttentionVariant
    from xllm_gen.runtime.executor.context import ForwardContext
    from xllm_gen.runtime.ops import reference as R
    from xllm_gen.runtime.ops.decode_attention import DecodeScratch, paged_decode_attention

    out = {}
    page, pool, D = 4, 48, 48
    lens = [1, 9, 0, 23, 4, 8]
    perm = torch.randperm(pool, generator=torch.Generator().manual_seed(1)).tolist()
    ptr, idx, last, tables = [0], [], [], []
    for L in lens:
        n = (L + page - 1) // page
        tables.append(perm[len(idx): len(idx) + n])
        idx += tables[-1]
        ptr.append(ptr[-1] + n)
        last.append(L - (n - 1) * page if n else 1)
    ip, ix, lp = (torch.tensor(a, dtype=torch.int32) for a in (ptr, idx, last))
    B = len(lens)
    width = max(len(t) for t in tables)
    ctx = ForwardContext(is_prefill=False, cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32),
                         seq_lens=torch.tensor(lens, dtype=torch.int32), slot_mapping=torch.full((B,), -1),
                         block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
                         block_size=page, seq_lens_cpu=lens, query_lens_cpu=[1] * B)
    variants = {"full": (-1, None), "window5": (4, None), "softcap": (-1, 2.5), "sinks": (4, None),
                "chunk4": (-1, None), "chunk8window5": (4, None)}
    chunks = {"chunk4": 4, "chunk8window5": 8}          # chunked local attention (Llama 4), alone and with a window
    # (H, Hk, head_dim, variant, [(dtype, splits)]): every variant at group 2, groups 1 and 4 once each; head_dim
    # 48 (padded to 64, masked) and 32 (unpadded: the loads' masks are per row only); one and several splits
    f32, f16 = torch.float32, torch.float16
    cases = [(4, 2, D, "full", [(f32, 1), (f16, 3)]), (4, 2, D, "window5", [(f32, 3)]),
             (4, 2, D, "softcap", [(f32, 3)]), (3, 3, D, "window5", [(f32, 3)]), (8, 2, 32, "softcap", [(f32, 3)]),
             (4, 2, 32, "full", [(f32, 1)]), (4, 2, D, "sinks", [(f32, 1), (f32, 3), (f16, 3)]),
             (4, 2, D, "chunk4", [(f32, 1), (f32, 3)]), (4, 2, D, "chunk8window5", [(f32, 3)])]
    tol = {torch.float32: 1e-6, torch.float16: 3e-3}
    live = torch.tensor([L > 0 for L in lens])
    for H, Hk, D, name, runs in cases:
        wl, cap = variants[name]
        ch = chunks.get(name)
        kc32, vc32 = rnd(pool, page, Hk, D), rnd(pool, page, Hk, D)
        q32 = rnd(B, H + 1, D)[:, :H]                          # strided rows
        sk = rnd(H) * 2 if name == "sinks" else None           # attention sinks (with a window): logits per head
        ref = R.paged_decode_attention(q32, kc32, vc32, ip, ix, lp, D ** -0.5, wl, cap, sinks=sk, chunk_size=ch)
        oracle = TorchPagedBackend()
        oracle.plan(ctx)
        kv_step = torch.zeros(B, Hk, D)                        # already in the cache: only its shape is read
        want = oracle.forward(q32.contiguous(), kv_step, kv_step, kc32, vc32, ctx, D ** -0.5,
                              AttentionVariant(None if wl < 0 else wl + 1, cap, sk is not None, False, ch),
                              **({} if sk is None else {"sinks": sk}))
        out[f"decode_attention_reference_vs_backend_H{H}_Hk{Hk}_D{D}_{name}"] = (
            max(err(ref[live], want[live]), err(ref[~live], torch.zeros_like(ref[~live]))), 1e-6)
        if name != "full":                                     # the variant changes the output (sensitivity)
            plain = R.paged_decode_attention(q32, kc32, vc32, ip, ix, lp, D ** -0.5,
                                             *((wl, cap) if name in ("sinks", "chunk8window5") else ()))
            out[f"decode_attention_variant_changes_output_H{H}_Hk{Hk}_D{D}_{name}"] = (
                float(not err(plain, ref) > 1e-2), 0.0)
        for dt, splits in runs:
            q, kc, vc = q32.to(dt), kc32.to(dt), vc32.to(dt)
            want = R.paged_decode_attention(q, kc, vc, ip, ix, lp, D ** -0.5, wl, cap, sinks=sk, chunk_size=ch)
            scratch = DecodeScratch(8, H, Hk, D, splits, "cpu")
            # the merge of several splits: the vectorized one (the default at these sizes) and head by head
            for merge_vec in (None, False) if splits > 1 and name in ("full", "sinks") and dt == f32 else (None,):
                worst = 0.0
                for _ in range(2 if (splits > 1 and name == "full") else 1):     # a second launch reuses the tickets
                    got = paged_decode_attention(q, kc, vc, ip, ix, lp, D ** -0.5, scratch, window_left=wl,
                                                 soft_cap=cap, block_n=16, sinks=sk, chunk_size=ch, merge_vec=merge_vec)
                    worst = max(worst, err(got, want), float(scratch.counters.abs().sum()))
                out[f"decode_attention_H{H}_Hk{Hk}_D{D}_{name}_splits{splits}_{str(dt).split('.')[-1]}"
                    f"{'_merge_by_head' if merge_vec is False else ''}"] = (worst, tol[dt])
    # a float8 cache with per-tensor KV scales: the kernel folds k_scale into the softmax scale and multiplies the
    # output by v_scale; the reference reads cache * scale; the CPU backend (the oracle) the same
    f8 = torch.float8_e4m3fn
    H, Hk, D = 4, 2, 48
    ks, vs = 0.05, 7e-3
    kc8, vc8 = (rnd(pool, page, Hk, D) * 200).to(f8), (rnd(pool, page, Hk, D) * 200).to(f8)
    q = rnd(B, H, D) * 0.1
    want = R.paged_decode_attention(q, kc8, vc8, ip, ix, lp, D ** -0.5, k_scale=ks, v_scale=vs)
    oracle = TorchPagedBackend()
    oracle.plan(ctx)
    kv_step = torch.zeros(B, Hk, D)
    back = oracle.forward(q, kv_step, kv_step, kc8, vc8, ctx, D ** -0.5, k_scale=ks, v_scale=vs)
    out["decode_attention_fp8_scaled_reference_vs_backend"] = (err(want, back), 1e-6)
    unscaled = R.paged_decode_attention(q, kc8, vc8, ip, ix, lp, D ** -0.5)
    out["decode_attention_fp8_scales_change_output"] = (float(not err(unscaled[live], want[live]) > 1e-2), 0.0)
    for splits in (1, 3):
        got = paged_decode_attention(q, kc8, vc8, ip, ix, lp, D ** -0.5, DecodeScratch(8, H, Hk, D, splits, "cpu"),
                                     block_n=16, k_scale=ks, v_scale=vs)
        out[f"decode_attention_fp8_scaled_splits{splits}_float32"] = (err(got, want), 1e-5)
    # the wrapper of a graph bucket: persistent buffers (bucket 8: 6 rows + 2 padding rows), re-planned with a
    # second table; what a captured launch reads (the buffers) gives each plan's result
    from xllm_gen.runtime.attention.triton_decode import TritonDecodeWrapper
    H, Hk = 4, 2
    kc, vc, q = rnd(pool, page, Hk, D), rnd(pool, page, Hk, D), rnd(8, H, D)
    bufs = (torch.zeros(9, dtype=torch.int32), torch.ones(8, dtype=torch.int32), torch.zeros(pool, dtype=torch.int32))
    w = TritonDecodeWrapper(H, Hk, D, 2, 8, torch.device("cpu"), buffers=bufs, block_n=16)
    worst = 0.0
    for shift in (0, 5):
        ix2 = torch.tensor([perm[(i + shift) % pool] for i in range(len(idx))], dtype=torch.int32)
        ip8, lp8 = torch.cat([ip, ip[-1:].repeat(2)]), torch.cat([lp, torch.ones(2, dtype=torch.int32)])
        w.plan(ip8, ix2, lp8, H, Hk, D, page, sm_scale=D ** -0.5)
        got = w.run(q, (kc, vc))
        want = R.paged_decode_attention(q, kc, vc, bufs[0], bufs[2], bufs[1], D ** -0.5)
        want2 = R.paged_decode_attention(q, kc, vc, ip8, ix2, lp8, D ** -0.5)
        worst = max(worst, err(got, want), err(got, want2), err(got[6:], torch.zeros_like(got[6:])))
    out["decode_attention_graph_bucket_wrapper_float32"] = (worst, 1e-6)
    return out


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--interpret":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print("RESULT " + json.dumps(_checks()))
    sys.exit(0)


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(__file__, timeout=300)


KERNEL_CASES = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "qk_norm_rope_neox", "qk_norm_rope_mrope_interleaved",
                "qk_norm_rope_mrope_blocked", "store_kvcache", "skinny_gemm", "vision_rope", "decode_attention"]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_kernel_interpreted_vs_reference(interpreted, case):
    got = {k: v for k, v in interpreted.items() if k.startswith(case + "_")}
    if case == "rms_norm":
        got = {k: v for k, v in got.items() if not k.startswith("rms_norm_") or k.count("_") == 2}
    assert got, interpreted.keys()
    for name, (e, tol) in got.items():
        assert e <= tol, f"{name}: max error {e} > {tol}"
    assert interpreted["empty"][0] == 0.0


# ------------------------------------------------------------------------------------------------ custom ops
def test_custom_ops_opcheck():
    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime import ops  # noqa: F401  (registers xllm::*)
    x = torch.randn(3, 16)
    w = torch.randn(16)
    xo = torch.ops.xllm
    torch.library.opcheck(xo.rms_norm, (x, w, 1e-6))
    torch.library.opcheck(xo.fused_add_rms_norm, (x, torch.randn(3, 16), w, 1e-6))
    torch.library.opcheck(xo.silu_and_mul, (torch.randn(3, 32),))
    rot = L.Rotary(16, 1e4, 64, "mrope_interleaved", [4, 2, 2])
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    pos = torch.randint(0, 64, (3, 3))
    torch.library.opcheck(xo.qk_norm_rope, (q, k, w, w, 1e-6, pos, rot.inv_freq, rot.cos_sin_cache, rot.axis_map))
    torch.library.opcheck(xo.qk_norm_rope, (q, k, None, None, 0.0, pos[0], rot.inv_freq, rot.cos_sin_cache, None))
    kc, vc = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    torch.library.opcheck(xo.store_kvcache, (k, k, kc, vc, torch.tensor([1, -1, 6])))
    torch.library.opcheck(xo.store_kvcache, (k, k, kc, vc, torch.tensor([1, -1, 6]), 0.25, 3.0))   # KV scales
    x8, w8 = torch.randn(3, 16), torch.randn(24, 16)
    torch.library.opcheck(xo.skinny_gemm, (x8, w8, torch.randn(24)))
    torch.library.opcheck(xo.skinny_gemm, (x8, w8, None))
    qv, kv_ = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    torch.library.opcheck(xo.vision_rope_, (qv, kv_, torch.randn(3, 8), torch.randn(3, 8)))
    # the custom op on CPU equals the direct reference call
    from xllm_gen.runtime.ops import reference as R
    assert torch.equal(xo.rms_norm(x, w, 1e-6), R.rms_norm(x, w, 1e-6))


def test_fake_impls_trace():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from xllm_gen.runtime import ops  # noqa: F401
    with FakeTensorMode():
        x = torch.empty(4, 8, dtype=torch.bfloat16)
        w = torch.empty(8, dtype=torch.bfloat16)
        assert torch.ops.xllm.rms_norm(x, w, 1e-6).shape == (4, 8)
        y, r = torch.ops.xllm.fused_add_rms_norm(x, x, w, 1e-6)
        assert y.shape == r.shape == (4, 8) and y.dtype == torch.bfloat16
        assert torch.ops.xllm.silu_and_mul(x).shape == (4, 4)
        y = torch.ops.xllm.skinny_gemm(x, torch.empty(12, 8, dtype=torch.bfloat16), None)
        assert y.shape == (4, 12) and y.dtype == torch.bfloat16


def test_skinny_gemm_config_table():
    """The fixed launch table: enough programs for 132 SMs, mask-free K loop on the Qwen3-0.6B shapes."""
    from xllm_gen.runtime.ops import triton_kernels as T
    for M in range(1, 9):
        for N, K in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)):
            bn, bk, warps, stages = T.skinny_gemm_config(M, N, K)
            assert K % bk == 0 and bk == 1024 and warps == 4 and stages == 3
            assert -(-N // bn) >= 256 and 1 <= bn <= 8
    assert T.skinny_gemm_config(1, 96, 160) == (1, 256, 4, 3)
    assert T.skinny_gemm_config(1, 4096, 1536)[1] == 512        # largest divisor of K, mask-free
    assert T.skinny_gemm_config(1, 4096, 1000)[1] == 1024       # no divisor >= 128: masked tail


def test_linear_dispatch_cpu_is_f_linear():
    """On CPU (and with XLLM_SKINNY_GEMM off) the linear layers stay F.linear, bit for bit."""
    import torch.nn.functional as F

    from xllm_gen.runtime.layers import linear as LL
    x, w, b = torch.randn(3, 16), torch.randn(24, 16), torch.randn(24)
    assert torch.equal(LL._linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(LL._linear(x, w), F.linear(x, w))


def test_no_ops_submodule_shadows_an_op():
    """Importing a submodule sets it as an attribute of its package: a module runtime/ops/X.py would replace the
    function ops.X the first time anything imports it (a layer that bound `from ops import X` earlier or later then
    calls a module). So no op of ops.__all__ shares its name with a module of runtime/ops (reference is the module)."""
    import importlib
    from pathlib import Path

    from xllm_gen.runtime import ops
    modules = {p.stem for p in Path(ops.__file__).parent.glob("*.py")} - {"__init__"}
    assert not (set(ops.__all__) - {"reference"}) & modules
    for name in sorted(modules - {"triton_kernels"}):
        importlib.import_module(f"xllm_gen.runtime.ops.{name}")
    assert callable(ops.skinny_gemm) and callable(ops.rms_norm)
    from xllm_gen.runtime.layers import linear
    assert callable(linear.skinny_gemm)
