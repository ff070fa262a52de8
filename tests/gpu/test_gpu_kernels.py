"""GPU tests (marker `gpu`; skipped without CUDA): every Triton kernel vs its torch reference on the GPU,
the custom ops inside a captured CUDA graph, and FlashInferBackend vs TorchPagedBackend for prefill (ragged
and paged with a cached prefix) and decode (eager, and bucket wrappers under CUDA-graph replay) with GQA,
random page tables and padding rows. Max errors are printed (run with -s to see them)."""
from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"


def _rel(a, b):
    return (a.float() - b.float()).abs().max().item() / max(1.0, b.float().abs().max().item())


# ---------------------------------------------------------------------------------------------- Triton kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_vs_reference(dtype):
    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime.ops import reference as R
    from xllm_gen.runtime.ops import triton_kernels as T
    torch.manual_seed(0)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    errs = {}
    for D in (1024, 1000):
        x = torch.randn(37, D + 64, device=DEV, dtype=dtype)[:, :D]
        r = torch.randn(37, D, device=DEV, dtype=dtype)
        w = torch.randn(D, device=DEV, dtype=dtype)
        errs[f"rms_norm_{D}"] = _rel(T.rms_norm(x, w, 1e-6), R.rms_norm(x, w, 1e-6))
        y, nr = T.fused_add_rms_norm(x, r, w, 1e-6)
        y2, nr2 = R.fused_add_rms_norm(x, r, w, 1e-6)
        errs[f"fused_add_rms_norm_{D}"] = max(_rel(y, y2), _rel(nr, nr2))
        g = torch.randn(37, 2 * 3072, device=DEV, dtype=dtype)
        errs["silu_and_mul"] = _rel(T.silu_and_mul(g), R.silu_and_mul(g))
    N, H, Hk, D = 29, 16, 8, 128
    qkv = torch.randn(N, (H + 2 * Hk) * D, device=DEV, dtype=dtype)
    q, k, v = qkv.split([H * D, Hk * D, Hk * D], -1)
    q, k, v = q.view(N, H, D), k.view(N, Hk, D), v.view(N, Hk, D)
    qw, kw = torch.randn(D, device=DEV, dtype=dtype), torch.randn(D, device=DEV, dtype=dtype)
    for kind in ("neox", "mrope_interleaved", "mrope_blocked"):
        rot = L.Rotary(D, 1e6, 40960, kind, None if kind == "neox" else [24, 20, 20])
        rot._to(torch.device(DEV))
        pos = torch.randint(0, 40960, (N,) if kind == "neox" else (3, N), device=DEV)
        for norm in (True, False):
            a = T.qk_norm_rope(q, k, qw if norm else None, kw if norm else None, 1e-6, pos, rot.cos_sin_cache,
                               rot.axis_map)
            b = R.qk_norm_rope(q, k, qw if norm else None, kw if norm else None, 1e-6, pos, rot.inv_freq,
                               rot.axis_map)
            errs[f"qk_norm_rope_{kind}_{norm}"] = max(_rel(a[0], b[0]), _rel(a[1], b[1]))
    kc = torch.randn(40, 16, Hk, D, device=DEV, dtype=dtype)
    vc = torch.randn(40, 16, Hk, D, device=DEV, dtype=dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    slots = torch.randperm(640, device=DEV)[:N]
    slots[::5] = -1
    T.store_kvcache(k, v, kc, vc, slots)
    R.store_kvcache(k, v, kc2, vc2, slots)
    errs["store_kvcache"] = 0.0 if (torch.equal(kc, kc2) and torch.equal(vc, vc2)) else 1.0
    print(f"\n[triton vs reference, {dtype}] max error (relative to max |ref|):",
          {k: f"{v:.2e}" for k, v in errs.items()})
    bad = {k: v for k, v in errs.items() if v > tol}
    assert not bad, bad


def test_custom_ops_dispatch_and_graph_capture():
    """The xllm:: ops run the Triton kernels on CUDA, and can be captured in a CUDA graph and replayed."""
    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime import ops
    from xllm_gen.runtime.ops import reference as R
    torch.manual_seed(1)
    N, H, Hk, D = 8, 4, 2, 128
    norm = L.RMSNorm(D, 1e-6).to(DEV, torch.bfloat16)
    knorm = L.RMSNorm(D, 1e-6).to(DEV, torch.bfloat16)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(knorm.weight)
    rot = L.Rotary(D, 1e6, 4096, "mrope_interleaved", [24, 20, 20])
    q = torch.randn(N, H, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(N, Hk, D, device=DEV, dtype=torch.bfloat16)
    pos = torch.randint(0, 4096, (3, N), device=DEV)
    slots = torch.arange(N, device=DEV)
    slots[-2:] = -1
    kc = torch.zeros(4, 16, Hk, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)

    def step():
        qo, ko = L.qk_norm_rope(pos, q, k, norm, knorm, rot)
        ops.store_kvcache(ko, ko, kc, vc, slots)
        return qo

    out_eager = step().clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_graph = step()
    q.copy_(torch.randn_like(q))
    pos.copy_(torch.randint(0, 4096, (3, N), device=DEV))
    kc.zero_()
    g.replay()
    torch.cuda.synchronize()
    want_q, want_k = R.qk_norm_rope(q, k, norm.weight, knorm.weight, 1e-6, pos, rot.inv_freq, rot.axis_map)
    assert _rel(out_graph, want_q) < 3e-2
    assert not torch.equal(out_graph, out_eager)
    qo2, ko2 = L.qk_norm_rope(pos, q, k, norm, knorm, rot)        # eager Triton on the new inputs
    assert torch.equal(out_graph, qo2)
    assert torch.equal(kc.view(-1, Hk, D)[: N - 2], ko2[: N - 2])
    assert _rel(ko2, want_k) < 3e-2
    assert kc.view(-1, Hk, D)[N - 2:].abs().sum() == 0             # slot -1 rows wrote nothing


# ---------------------------------------------------------------------------------------------- skinny GEMM
QWEN3_06B_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]   # (N, K): qkv, o, gate_up, down


@pytest.mark.parametrize("M", [1, 2, 4, 8])
def test_skinny_gemm_vs_f_linear(M):
    """The decode GEMV kernel on Qwen3-0.6B shapes vs cuBLAS (F.linear) and an fp32 product: within bf16 rounding
    of the output (one bf16 ulp at the max is 2^-8 = 3.9e-3 of it)."""
    from xllm_gen.runtime.ops import triton_kernels as T
    torch.manual_seed(M)
    errs = {}
    for N, K in QWEN3_06B_SHAPES:
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * K ** -0.5
        b = torch.randn(N, device=DEV, dtype=torch.bfloat16)
        for bias in (None, b):
            exact = x.float() @ w.float().t() + (0 if bias is None else bias.float())
            for i, cfg in enumerate(T.skinny_gemm_candidates(M, N, K)):    # the table's first, then the tuner's
                y = T.skinny_gemm(x, w, bias, config=cfg)
                assert y.shape == (M, N) and y.dtype == torch.bfloat16
                key = f"{N}x{K}{'+b' if bias is not None else ''}{'' if i == 0 else f' {cfg}'}"
                errs[key] = (_rel(y, torch.nn.functional.linear(x, w, bias)), _rel(y, exact))
    print(f"\n[skinny_gemm M={M}] max error vs F.linear / vs fp32:",
          {k: f"{a:.1e}/{e:.1e}" for k, (a, e) in errs.items()})
    bad = {k: v for k, v in errs.items() if v[0] > 8e-3 or v[1] > 5e-3}
    assert not bad, bad


@pytest.mark.parametrize("M", [9, 16, 32, 48, 64])
def test_skinny_mma_vs_f_linear(M):
    """The tensor-core skinny GEMM (9..64 decode rows, split-K reduced by the last program of each column block) on
    Qwen3-0.6B shapes and the lm_head's, every tuning candidate: within bf16 rounding of cuBLAS and of an fp32
    product; rows padded into the bucket give each row the same bits; the split-K counters end at 0."""
    from xllm_gen.runtime.ops import triton_kernels as T
    torch.manual_seed(M)
    errs = {}
    for N, K in QWEN3_06B_SHAPES + [(151936, 1024)]:
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * K ** -0.5
        b = torch.randn(N, device=DEV, dtype=torch.bfloat16)
        for bias in (None, b):
            exact = x.float() @ w.float().t() + (0 if bias is None else bias.float())
            for cfg in T.skinny_mma_candidates(M, N, K):
                y = T.skinny_gemm(x, w, bias, config=cfg)
                assert y.shape == (M, N) and y.dtype == torch.bfloat16
                errs[f"{N}x{K}{'+b' if bias is not None else ''} {cfg}"] = (
                    _rel(y, torch.nn.functional.linear(x, w, bias)), _rel(y, exact))
                assert torch.equal(T.skinny_gemm(x[:M - 3], w, bias, config=cfg), y[:M - 3])
    print(f"\n[skinny_mma M={M}] max error vs F.linear / vs fp32:", {k: f"{a:.1e}/{e:.1e}" for k, (a, e) in errs.items()})
    bad = {k: v for k, v in errs.items() if v[0] > 8e-3 or v[1] > 5e-3}
    assert not bad, bad
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for c in T._SPLITK_COUNTERS.values())


def test_decode_gemm_tuning_picks_a_kernel_per_shape(monkeypatch):
    """tune_decode_gemms measures every (rows, N, K) of a model's linear layers once per process and the layers
    then run the chosen kernel: its output equals that kernel's, bit for bit; a shape measured before is kept."""
    from xllm_gen.runtime.layers import linear as LL
    from xllm_gen.runtime.ops import triton_kernels as T
    monkeypatch.setenv("XLLM_TUNING_CACHE", "0")       # measure, not read a previous process's decisions
    monkeypatch.setattr(LL, "_FORCE", None)
    monkeypatch.setattr(LL, "DECODE_GEMM_CHOICE", {})
    torch.manual_seed(5)
    model = torch.nn.Sequential(LL.ReplicatedLinear(2048, 1024, bias=False), LL.ReplicatedLinear(1024, 4096, bias=False),
                                LL.ReplicatedLinear(2048, 1024, bias=False)).to(DEV, torch.bfloat16)
    for m in model:
        torch.nn.init.normal_(m.weight, std=0.02)
    report = LL.tune_decode_gemms(model, [1, 2, 4, 8, 16])
    print("\n[decode GEMM tuning] (M, N, K): (cuBLAS us, best Triton us, Triton config chosen)", report)
    assert set(report) == {(M, N, K) for M in (1, 2, 4, 8, 16) for N, K in ((1024, 2048), (4096, 1024))}
    for (M, N, K), (tc, tt, chosen) in report.items():
        assert tc > 0 and tt > 0 and bool(chosen) == (tt < 0.9 * tc)
        assert not chosen or chosen in (T.skinny_gemm_candidates(M, N, K) if M <= 8 else T.skinny_mma_candidates(M, N, K))
        lin = model[0] if N == 1024 else model[1]
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        want = T.skinny_gemm(x, lin.weight, config=chosen) if chosen else torch.nn.functional.linear(x, lin.weight)
        assert torch.equal(lin(x), want)
    for N, K in ((1024, 2048), (4096, 1024)):                # 3 rows run what their bucket of 4 runs
        assert LL.DECODE_GEMM_CHOICE[(3, N, K, torch.bfloat16)] == LL.DECODE_GEMM_CHOICE[(4, N, K, torch.bfloat16)]
    assert LL.tune_decode_gemms(model, [1, 2]) == {}          # decided once per process


def test_skinny_gemm_graph_capture_and_dispatch(monkeypatch):
    """skinny_gemm (direct and through the linear layers' _linear with XLLM_SKINNY_GEMM on) captured in a CUDA graph
    and replayed on new inputs equals the eager kernel bit for bit; the layer dispatch routes <= 8 rows to it."""
    from xllm_gen.runtime import ops
    from xllm_gen.runtime.layers import linear as LL
    from xllm_gen.runtime.ops import triton_kernels as T
    monkeypatch.setattr(LL, "_FORCE", True)
    torch.manual_seed(3)
    M = 4
    lin = LL.ReplicatedLinear(1024, 6144, bias=True).to(DEV, torch.bfloat16)
    torch.nn.init.normal_(lin.weight, std=0.03)
    torch.nn.init.normal_(lin.bias)
    w2 = torch.randn(1024, 3072, device=DEV, dtype=torch.bfloat16) * 0.02
    x = torch.randn(M, 1024, device=DEV, dtype=torch.bfloat16)

    def step():
        h = lin(x)                                     # [M, 6144] through _linear -> skinny kernel
        return ops.skinny_gemm(h[:, :3072], w2)        # strided rows (row stride 6144)

    assert torch.equal(lin(x), T.skinny_gemm(x, lin.weight, lin.bias))
    x9 = torch.randn(9, 1024, device=DEV, dtype=torch.bfloat16)        # 9..64 rows: the tensor-core kernel
    assert torch.equal(LL._linear(x9, lin.weight), T.skinny_mma_gemm(x9, lin.weight))
    x65 = torch.randn(65, 1024, device=DEV, dtype=torch.bfloat16)
    assert torch.equal(LL._linear(x65, lin.weight), torch.nn.functional.linear(x65, lin.weight))   # 65 rows: cuBLAS
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_graph = step()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        want = step()
        assert torch.equal(out_graph, want)
        ref = torch.nn.functional.linear(torch.nn.functional.linear(x, lin.weight, lin.bias)[:, :3072], w2)
        assert _rel(out_graph, ref) < 2e-2


def test_skinny_mma_split_k_in_cuda_graph():
    """The split-K tensor-core GEMM captured in a CUDA graph (two GEMMs sharing the counter buffer, the second on
    the first's output) and replayed on new inputs equals the eager kernel bit for bit, every replay."""
    from xllm_gen.runtime.ops import triton_kernels as T
    torch.manual_seed(4)
    x = torch.randn(16, 2048, device=DEV, dtype=torch.bfloat16)
    w1 = torch.randn(1024, 2048, device=DEV, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(1024, 1024, device=DEV, dtype=torch.bfloat16) * 0.03
    c1, c2 = T.skinny_mma_config(16, 1024, 2048), T.skinny_mma_config(16, 1024, 1024)
    assert c1[-1] > 1 and c2[-1] > 1

    def step():
        return T.skinny_gemm(T.skinny_gemm(x, w1, config=c1), w2, config=c2)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_graph = step()
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_graph, step())
        ref = torch.nn.functional.linear(torch.nn.functional.linear(x, w1), w2)
        assert _rel(out_graph, ref) < 2e-2


# ---------------------------------------------------------------------------------------------- FlashInfer
flashinfer = pytest.importorskip("flashinfer") if torch.cuda.is_available() else None


def _make_ctx(seq_lens, query_lens, bs, num_blocks, pad_rows=0, seed=0, is_prefill=None):
    from xllm_gen.runtime.executor.context import ForwardContext
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    nblk = [(L + bs - 1) // bs for L in seq_lens]
    maxb = max(nblk + [1])
    tables, slots = [], []
    for L, Q, nb in zip(seq_lens, query_lens, nblk):
        blocks = [free.pop() for _ in range(nb)]
        tables.append(blocks + [-1] * (maxb - nb))
        slots += [blocks[p // bs] * bs + p % bs for p in range(L - Q, L)]
    tables += [[-1] * maxb] * pad_rows
    slots += [-1] * pad_rows
    seq_lens = list(seq_lens) + [0] * pad_rows
    query_lens = list(query_lens) + [1] * pad_rows
    cu = [0]
    for Q in query_lens:
        cu.append(cu[-1] + Q)
    if is_prefill is None:
        is_prefill = any(Q > 1 for Q in query_lens)
    return ForwardContext(is_prefill=is_prefill, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEV),
                          seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
                          slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV),
                          block_tables=torch.tensor(tables, dtype=torch.int32, device=DEV), block_size=bs,
                          seq_lens_cpu=seq_lens, query_lens_cpu=query_lens)


def _run_both(fi, ctx, q, k, v, kc, vc, scale):
    from xllm_gen.runtime import ops
    from xllm_gen.runtime.attention import TorchPagedBackend
    ops.store_kvcache(k, v, kc, vc, ctx.slot_mapping)
    fi.plan(ctx)
    out = fi.forward(q, k, v, kc, vc, ctx, scale)
    ref = TorchPagedBackend()
    ref.plan(ctx)
    want = ref.forward(q, k, v, kc, vc, ctx, scale)
    return out, want


@pytest.mark.parametrize("decode_kernel", ["flashinfer", "triton"])
@pytest.mark.parametrize("H,Hk", [(16, 8), (32, 4)])
def test_flashinfer_vs_torch_paged(H, Hk, decode_kernel):
    """Prefill (FlashInfer) and decode (FlashInfer's wrappers, or the Triton split-KV kernel) against the torch
    backend: eager, graph replays after re-plans with padding rows, a batch of 256."""
    from xllm_gen.runtime.attention import FlashInferBackend
    from xllm_gen.runtime.attention.triton_decode import TritonDecodeWrapper
    torch.manual_seed(H)
    D, bs, num_blocks, dt = 128, 16, 512, torch.bfloat16
    scale = D ** -0.5
    fi = FlashInferBackend(H, Hk, D, dt, DEV, block_size=bs, max_batch=64, max_model_len=2048,
                           max_num_tokens=4096, graph_buckets=(1, 2, 4, 8), decode_kernel=decode_kernel)
    triton_decode = decode_kernel == "triton"
    kc = torch.randn(num_blocks, bs, Hk, D, device=DEV, dtype=dt)      # garbage in unused pages
    vc = torch.randn(num_blocks, bs, Hk, D, device=DEV, dtype=dt)
    errs = {}

    def rand_qkv(n):
        return (torch.randn(n, H, D, device=DEV, dtype=dt), torch.randn(n, Hk, D, device=DEV, dtype=dt),
                torch.randn(n, Hk, D, device=DEV, dtype=dt))

    # 1. prefill, no cached prefix: ragged on the step's k/v
    ctx = _make_ctx([37, 100, 5, 1], [37, 100, 5, 1], bs, num_blocks, seed=1)
    q, k, v = rand_qkv(143)
    out, want = _run_both(fi, ctx, q, k, v, kc, vc, scale)
    assert fi._mode == "ragged"
    errs["prefill_ragged"] = (out.float() - want.float()).abs().max().item()
    # 2. prefill with a cached prefix (chunked): paged, causal bottom-right
    ctx = _make_ctx([50, 130, 17], [10, 33, 17], bs, num_blocks, seed=2)
    q, k, v = rand_qkv(60)
    out, want = _run_both(fi, ctx, q, k, v, kc, vc, scale)
    assert fi._mode == "paged_prefill"
    errs["prefill_paged"] = (out.float() - want.float()).abs().max().item()
    # 3. decode, eager wrapper (batch 5 is no bucket)
    lens = [1 + random.Random(3).randrange(1000) for _ in range(5)]
    ctx = _make_ctx(lens, [1] * 5, bs, num_blocks, seed=3, is_prefill=False)
    q, k, v = rand_qkv(5)
    out, want = _run_both(fi, ctx, q, k, v, kc, vc, scale)
    if triton_decode:       # batch 5 pads to bucket 8: the Triton kernel with bucket 8's split count
        assert isinstance(fi._wrapper, TritonDecodeWrapper) and fi._wrapper.splits == fi.decode_splits(8) > 1
    else:
        assert fi._wrapper is fi.decode
    errs["decode_eager"] = (out.float() - want.float()).abs().max().item()
    # 4. decode through bucket 8's graph wrapper with 3 padding rows, captured once, replayed after re-plans
    from xllm_gen.runtime import ops
    rng = random.Random(4)
    ctx = _make_ctx([rng.randrange(1, 700) for _ in range(5)], [1] * 5, bs, num_blocks, pad_rows=3, seed=4,
                    is_prefill=False)
    qb, kb, vb = rand_qkv(8)
    fi.plan(ctx)
    assert fi._wrapper is fi.graph_wrappers[8]
    slot_buf = ctx.slot_mapping.clone()

    def step():
        ops.store_kvcache(kb, vb, kc, vc, slot_buf)
        return fi.forward(qb, kb, vb, kc, vc, ctx, scale)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_g = step()
    worst = 0.0
    for trial in range(3):
        n_real = [5, 8, 1][trial]
        lens = [rng.randrange(1, 900) for _ in range(n_real)]
        c2 = _make_ctx(lens, [1] * n_real, bs, num_blocks, pad_rows=8 - n_real, seed=10 + trial, is_prefill=False)
        qb.copy_(torch.randn_like(qb))
        kb.copy_(torch.randn_like(kb))
        vb.copy_(torch.randn_like(vb))
        slot_buf.copy_(c2.slot_mapping)
        fi.plan(c2)                                     # outside the graph
        g.replay()
        from xllm_gen.runtime.attention import TorchPagedBackend
        ref = TorchPagedBackend()
        ref.plan(c2)
        want = ref.forward(qb, kb, vb, kc, vc, c2, scale)
        worst = max(worst, (out_g[:n_real].float() - want[:n_real].float()).abs().max().item())
    errs["decode_graph_replay"] = worst
    # 5. large batch x heads decode does not overflow the workspace
    big = FlashInferBackend(H, Hk, D, dt, DEV, block_size=bs, max_batch=256, max_model_len=4096,
                            max_num_tokens=8192, decode_kernel=decode_kernel)
    kc2 = torch.randn(4096, bs, Hk, D, device=DEV, dtype=dt)
    vc2 = torch.randn_like(kc2)
    lens = [random.Random(i).randrange(1, 250) for i in range(256)]
    if sum((L + bs - 1) // bs for L in lens) <= 4096:
        ctx = _make_ctx(lens, [1] * 256, bs, 4096, seed=5, is_prefill=False)
        q, k, v = rand_qkv(256)
        out, want = _run_both(big, ctx, q, k, v, kc2, vc2, scale)
        errs["decode_b256"] = (out.float() - want.float()).abs().max().item()
    print(f"\n[flashinfer vs torch paged, H={H} Hk={Hk} bf16, decode {decode_kernel}] max abs error:",
          {k: f"{v:.2e}" for k, v in errs.items()}, f"workspace {fi.workspace_bytes >> 20} MiB")
    bad = {k: v for k, v in errs.items() if not v < 2e-2}
    assert not bad, bad


def test_auto_decode_kernel_is_measured_per_bucket():
    """decode_kernel="auto": each graph bucket where the Triton kernel is a candidate is timed against FlashInfer once
    per process, and its wrapper (graph and eager) is the kernel measured faster; a second backend of the same
    shapes reuses the choice without timing again; buckets past the candidates stay on FlashInfer untimed."""
    import flashinfer

    from xllm_gen.runtime.attention import triton_decode as TD
    from xllm_gen.runtime.attention.flashinfer_backend import FlashInferBackend

    for H, Hk in ((16, 8), (32, 4)):
        kw = dict(block_size=16, max_batch=64, max_model_len=2048, max_num_tokens=4096,
                  graph_buckets=(1, 4, 16, 64), decode_kernel="auto")
        be = FlashInferBackend(H, Hk, 128, torch.bfloat16, "cuda", **kw)
        sms = be.num_sms
        for b in (1, 4, 16, 64):
            times = be.decode_kernel_times.get(b)
            if not TD.decode_splits(b, Hk, sms, "auto"):
                assert times is None and be.decode_splits(b) == 0
                assert isinstance(be.graph_wrappers[b], flashinfer.BatchDecodeWithPagedKVCacheWrapper)
                continue
            assert 0 in times and len(times) >= 2, times
            choice = TD.pick_decode_kernel(times)
            assert be.decode_splits(b) == (choice[0] if choice else 0)
            if choice:
                assert (be.graph_wrappers[b].block_n, be.graph_wrappers[b].num_warps) == choice[1:]
            assert isinstance(be.graph_wrappers[b], TD.TritonDecodeWrapper) == bool(choice)
            print({"H": H, "Hk": Hk, "bucket": b, "us": times, "choice": choice})
        again = FlashInferBackend(H, Hk, 128, torch.bfloat16, "cuda", **kw)
        assert again.decode_kernel_times == {} and all(again.decode_splits(b) == be.decode_splits(b) for b in (1, 4, 16, 64))
