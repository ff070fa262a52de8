"""TorchPagedBackend and the Attention layer vs a dense causal attention (and HF's eager attention)."""
from __future__ import annotations

import random

import pytest
import torch

from xllm_gen.runtime import layers as L
from xllm_gen.runtime.attention import AttentionBackend, TorchPagedBackend
from xllm_gen.runtime.executor.context import ForwardContext, reset_context, set_context


def dense_causal(q, k, v, scale):
    """q [Q, H, D] are the last Q positions of k [L, Hk, D], v [L, Hk, Dv]; plain float64 math."""
    Q, H, D = q.shape
    Lk, Hk, _ = k.shape
    g = H // Hk
    out = torch.empty(Q, H, v.shape[-1], dtype=torch.float64)
    for h in range(H):
        s = (q[:, h].double() @ k[:, h // g].double().T) * scale
        for i in range(Q):
            lim = Lk - Q + i
            s[i, lim + 1:] = float("-inf")
        out[:, h] = torch.softmax(s, -1) @ v[:, h // g].double()
    return out


def make_step(seq_lens, query_lens, block_size, num_blocks, max_blocks=None, seed=0, pad_rows=0):
    """Random page tables. Returns ctx pieces and the per-sequence block lists."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots = [], []
    nblk = [(L + block_size - 1) // block_size for L in seq_lens]
    max_blocks = max_blocks or max(nblk + [1])
    for n, Q, nb in zip(seq_lens, query_lens, nblk):
        blocks = [free.pop() for _ in range(nb)]
        tables.append(blocks + [-1] * (max_blocks - nb))
        for p in range(n - Q, n):
            slots.append(blocks[p // block_size] * block_size + p % block_size)
    for _ in range(pad_rows):                           # padding rows: one query token, no KV, slot -1
        tables.append([-1] * max_blocks)
        slots.append(-1)
    seq_lens = list(seq_lens) + [0] * pad_rows
    query_lens = list(query_lens) + [1] * pad_rows
    cu = [0]
    for Q in query_lens:
        cu.append(cu[-1] + Q)
    ctx = ForwardContext(is_prefill=any(q > 1 for q in query_lens),
                         cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                         seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                         slot_mapping=torch.tensor(slots, dtype=torch.int64),
                         block_tables=torch.tensor(tables, dtype=torch.int32), block_size=block_size,
                         seq_lens_cpu=seq_lens, query_lens_cpu=query_lens)
    return ctx, tables


# Dv: the value heads' width, q / k's (16) or one of their own (an attention `v_head_dim`)
@pytest.mark.parametrize("H,Hk,Dv", [(4, 4, 16), (8, 2, 16), (4, 1, 16), (8, 2, 12)])
@pytest.mark.parametrize("mode", ["prefill", "chunked", "decode"])
def test_attention_layer_paged_vs_dense(H, Hk, mode, Dv):
    torch.manual_seed(0)
    D, bs, num_blocks = 16, 4, 64
    if mode == "prefill":
        seq_lens, query_lens = [5, 9, 1], [5, 9, 1]
    elif mode == "chunked":                                # cached prefix + new chunk
        seq_lens, query_lens = [13, 6, 4], [5, 6, 2]
    else:
        seq_lens, query_lens = [7, 1, 16, 3], [1, 1, 1, 1]
    pad = 2 if mode == "decode" else 0
    ctx, tables = make_step(seq_lens, query_lens, bs, num_blocks, pad_rows=pad, seed=H * 10 + Hk)
    k_cache = torch.randn(num_blocks, bs, Hk, D)      # garbage everywhere...
    v_cache = torch.randn(num_blocks, bs, Hk, Dv)
    # ...and the true history of each sequence written at its cached positions
    full_k = [torch.randn(Lq, Hk, D) for Lq in seq_lens]
    full_v = [torch.randn(Lq, Hk, Dv) for Lq in seq_lens]
    for i, (Lq, Q) in enumerate(zip(seq_lens, query_lens)):
        for p in range(Lq - Q):
            b = tables[i][p // bs]
            k_cache[b, p % bs] = full_k[i][p]
            v_cache[b, p % bs] = full_v[i][p]
    N = sum(query_lens) + pad
    q = torch.randn(N, H, D)
    k = torch.cat([fk[Lq - Q:] for fk, Lq, Q in zip(full_k, seq_lens, query_lens)] + [torch.randn(pad, Hk, D)])
    v = torch.cat([fv[Lq - Q:] for fv, Lq, Q in zip(full_v, seq_lens, query_lens)] + [torch.randn(pad, Hk, Dv)])
    before = k_cache.clone()
    attn = L.Attention(H, Hk, D, scale=D ** -0.5, v_head_dim=Dv)
    attn.k_cache, attn.v_cache = k_cache, v_cache
    backend = TorchPagedBackend()
    assert isinstance(backend, AttentionBackend)
    backend.plan(ctx)
    ctx.backend = backend
    set_context(ctx)
    try:
        out = attn(q, k.reshape(N, -1), v.reshape(N, -1))
    finally:
        reset_context()
    assert out.shape == (N, H * Dv)
    out = out.view(N, H, Dv)
    row = 0
    for i, (Lq, Q) in enumerate(zip(seq_lens, query_lens)):
        ref = dense_causal(q[row:row + Q], full_k[i], full_v[i], D ** -0.5)
        torch.testing.assert_close(out[row:row + Q].double(), ref, atol=2e-5, rtol=1e-5)
        row += Q
    assert torch.equal(out[row:], torch.zeros(pad, H, Dv))         # padding rows: zeros
    # the step's K went to its slots; slot -1 (padding rows) wrote nothing
    expected = before.clone()
    for r, s in enumerate(ctx.slot_mapping.tolist()):
        if s >= 0:
            expected[s // bs, s % bs] = k[r]
    assert torch.equal(k_cache, expected)

def test_paged_matches_hf_eager_attention():
    """Single-sequence prefill vs HF's eager_attention_forward (float32)."""
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward
    torch.manual_seed(1)
    H, Hk, D, Lq = 8, 2, 16, 11
    q, k, v = torch.randn(Lq, H, D), torch.randn(Lq, Hk, D), torch.randn(Lq, Hk, D)
    ctx, _ = make_step([Lq], [Lq], 4, 8)
    kc, vc = torch.zeros(8, 4, Hk, D), torch.zeros(8, 4, Hk, D)
    from xllm_gen.runtime import ops
    ops.store_kvcache(k, v, kc, vc, ctx.slot_mapping)
    out = TorchPagedBackend().forward(q, k, v, kc, vc, ctx, D ** -0.5)

    class M(torch.nn.Module):
        num_key_value_groups = H // Hk
        training = False

    mask = torch.full((Lq, Lq), float("-inf")).triu(1)[None, None]
    ref, _ = eager_attention_forward(M(), q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                     mask, scaling=D ** -0.5)
    torch.testing.assert_close(out, ref[0], atol=1e-6, rtol=1e-5)
    # cache-less path (no KV cache attached) gives the same result
    out2 = TorchPagedBackend().forward(q, k, v, torch.tensor([]), torch.tensor([]), ctx, D ** -0.5)
    torch.testing.assert_close(out2, out, atol=1e-6, rtol=0)


def _nan_paged_caches(seq_lens, tables, bs, num_blocks, Hk, D):
    """K/V caches holding random values at each sequence's positions and NaN in every other slot."""
    kc = torch.full((num_blocks, bs, Hk, D), float("nan"))
    vc = torch.full((num_blocks, bs, Hk, D), float("nan"))
    for n, t in zip(seq_lens, tables):
        for p in range(n):
            kc[t[p // bs], p % bs] = torch.randn(Hk, D)
            vc[t[p // bs], p % bs] = torch.randn(Hk, D)
    return kc, vc


def _pages_of(kc, vc, table, n):
    """A sequence's first n keys and values, read through its block table."""
    bs, Hk, D = kc.shape[1:]
    idx = [table[p // bs] * bs + p % bs for p in range(n)]
    return kc.view(-1, Hk, D)[idx], vc.view(-1, Hk, D)[idx]


@pytest.mark.parametrize("variant", [(None, None), (5, None), (None, 3.0), (7, 2.5), (None, None, False, False, 8),
                                     (None, 3.0, False, False, 4)], ids=str)
def test_batched_paged_equals_per_sequence_oracle(variant):
    """The batched gather/mask path equals `attend` run sequence by sequence (the oracle), for a step that mixes
    whole prefills, chunked prefills, decodes and padding rows, with NaN in every page the step does not own
    (a row must never read past its own length)."""
    from xllm_gen.runtime.attention.base import AttentionVariant
    from xllm_gen.runtime.attention.torch_ref import attend
    torch.manual_seed(0)
    H, Hk, D, bs, num_blocks = 8, 2, 16, 4, 64
    seq_lens, query_lens = [9, 23, 1, 14, 30], [9, 6, 1, 1, 30]
    ctx, tables = make_step(seq_lens, query_lens, bs, num_blocks, seed=3, pad_rows=2)
    kc, vc = _nan_paged_caches(seq_lens, tables, bs, num_blocks, Hk, D)
    N = sum(query_lens) + 2
    q = torch.randn(N, H, D) * 3
    var = AttentionVariant(*variant)
    out = TorchPagedBackend().forward(q, torch.zeros(N, Hk, D), torch.zeros(N, Hk, D), kc, vc, ctx, D ** -0.5, var)
    start = 0
    for n, Q, t in zip(seq_lens, query_lens, tables):
        ks, vs = _pages_of(kc, vc, t, n)
        want = attend(q[start:start + Q], ks, vs, D ** -0.5, n - Q, var.sliding_window, var.logit_softcap,
                      chunk_size=var.chunk_size)
        torch.testing.assert_close(out[start:start + Q], want, rtol=1e-5, atol=1e-5)
        start += Q
    assert torch.equal(out[start:], torch.zeros(2, H, D))          # padding rows


@pytest.mark.parametrize("variant", [(None, None), (5, None), (None, 3.0), (None, None, False, False, 8)], ids=str)
def test_decode_step_fast_path_equals_oracle(variant):
    """A pure decode step (one query per sequence: the SDPA fast path; soft-capped variants take the general
    path) equals `attend` per sequence, with NaN in every page the step does not own."""
    from xllm_gen.runtime.attention.base import AttentionVariant
    from xllm_gen.runtime.attention.torch_ref import attend
    torch.manual_seed(1)
    H, Hk, D, bs, num_blocks = 8, 2, 16, 4, 64
    seq_lens = [9, 23, 1, 14, 30, 4]
    ctx, tables = make_step(seq_lens, [1] * len(seq_lens), bs, num_blocks, seed=5)
    kc, vc = _nan_paged_caches(seq_lens, tables, bs, num_blocks, Hk, D)
    q = torch.randn(len(seq_lens), H, D) * 3
    var = AttentionVariant(*variant)
    backend = TorchPagedBackend()
    backend.plan(ctx)
    assert backend._decode
    out = backend.forward(q, torch.zeros(len(seq_lens), Hk, D), torch.zeros(len(seq_lens), Hk, D), kc, vc, ctx,
                          D ** -0.5, var)
    for i, (n, t) in enumerate(zip(seq_lens, tables)):
        ks, vs = _pages_of(kc, vc, t, n)
        want = attend(q[i:i + 1], ks, vs, D ** -0.5, n - 1, var.sliding_window, var.logit_softcap,
                      chunk_size=var.chunk_size)
        torch.testing.assert_close(out[i:i + 1], want, rtol=1e-5, atol=1e-5)


def test_chunked_oracle_is_transformers_chunked_mask():
    """`attend` with a chunk size masks as transformers' chunked_causal_mask_function (Llama 4): key j visible to
    query i iff j <= i and j // C == i // C; and chunking changes the output of a sequence longer than a chunk."""
    from transformers.masking_utils import chunked_causal_mask_function

    from xllm_gen.runtime.attention.torch_ref import attend
    torch.manual_seed(4)
    H, Hk, D, L, Q, C = 4, 2, 8, 21, 13, 8
    q, k, v = torch.randn(Q, H, D) * 3, torch.randn(L, Hk, D), torch.randn(L, Hk, D)
    fn = chunked_causal_mask_function(C, torch.zeros(1, dtype=torch.long))
    off = L - Q
    visible = torch.tensor([[bool(fn(0, 0, torch.tensor(off + i), torch.tensor(j))) for j in range(L)]
                            for i in range(Q)])
    kf, vf = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
    s = torch.einsum("qhd,khd->hqk", q, kf) * D ** -0.5
    want = torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~visible, float("-inf")), -1), vf)
    got = attend(q, k, v, D ** -0.5, off, chunk_size=C)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, attend(q, k, v, D ** -0.5, off), atol=1e-3)


def test_decode_step_mixing_fast_and_general_variants():
    """One decode step whose layers alternate a plain variant (SDPA fast path) and a soft-capped one (general
    path, same window): each path keeps its own masks, and both equal the oracle."""
    from xllm_gen.runtime.attention.base import AttentionVariant
    from xllm_gen.runtime.attention.torch_ref import attend
    torch.manual_seed(2)
    H, Hk, D, bs, num_blocks = 4, 2, 8, 4, 32
    seq_lens = [5, 11, 3]
    ctx, tables = make_step(seq_lens, [1] * len(seq_lens), bs, num_blocks, seed=7)
    kc, vc = _nan_paged_caches(seq_lens, tables, bs, num_blocks, Hk, D)
    q = torch.randn(len(seq_lens), H, D) * 3
    backend = TorchPagedBackend()
    backend.plan(ctx)
    zeros = torch.zeros(len(seq_lens), Hk, D)
    for var in (AttentionVariant(None, None), AttentionVariant(None, 2.0), AttentionVariant(None, None)):
        out = backend.forward(q, zeros, zeros, kc, vc, ctx, D ** -0.5, var)
        for i, (n, t) in enumerate(zip(seq_lens, tables)):
            ks, vs = _pages_of(kc, vc, t, n)
            want = attend(q[i:i + 1], ks, vs, D ** -0.5, n - 1, var.sliding_window, var.logit_softcap)
            torch.testing.assert_close(out[i:i + 1], want, rtol=1e-5, atol=1e-5)


def test_decode_kernel_choice_and_splits(monkeypatch):
    """The decode-attention kernel per batch: auto gives the Triton kernel only while rows x KV heads leave SMs
    idle, with enough splits for ~2 programs per SM (capped); the settings and the variable are validated."""
    from xllm_gen.runtime.attention.triton_decode import decode_kernel_choice, decode_splits
    assert decode_splits(1, 8, 132) == 32                  # 264 programs wanted, capped at 32 splits
    assert decode_splits(4, 8, 132) == 9
    assert decode_splits(16, 8, 132) == 3                  # 128 rows x heads < 132 SMs
    assert decode_splits(17, 8, 132) == 0                  # 136: FlashInfer
    assert decode_splits(256, 8, 132, "triton") == 1
    assert decode_splits(1, 8, 132, "flashinfer") == 0
    assert all(decode_splits(b, 4, 132, "triton") >= decode_splits(b + 1, 4, 132, "triton") for b in range(1, 300))
    monkeypatch.setenv("XLLM_DECODE_ATTENTION", "Triton")
    assert decode_kernel_choice() == "triton" and decode_kernel_choice("flashinfer") == "flashinfer"
    monkeypatch.setenv("XLLM_DECODE_ATTENTION", "cudnn")
    with pytest.raises(ValueError, match="XLLM_DECODE_ATTENTION"):
        decode_kernel_choice()


def test_auto_keeps_the_measured_faster_decode_kernel():
    """"auto" times FlashInfer (0) against the Triton kernel at a few split counts and keeps the fastest; the
    Triton kernel must win by the margin (a near tie keeps FlashInfer's); the candidates are the rule's split
    count and the powers of two from an eighth of it to twice it."""
    from xllm_gen.runtime.attention.triton_decode import TUNE_MARGIN, pick_decode_kernel, split_candidates
    assert pick_decode_kernel({0: 10.3, 32: 13.6, 16: 14.0, 8: 15.9}) == 0          # Qwen3-30B-A3B's heads, batch 1
    assert pick_decode_kernel({0: 10.9, 32: 9.0, 16: 8.7, 8: 9.5}) == (16, 64, 4)     # (splits, BLOCK_N, warps)
    assert pick_decode_kernel({0: 10.0, 32: 10.0 * TUNE_MARGIN + 1e-6}) == 0
    assert pick_decode_kernel({32: 5.0, 8: 4.0}) == (8, 64, 4)                         # FlashInfer not timed
    # the launch variants timed at the best split count compete with it (16 rows on an H200: (8, 16, 2))
    assert pick_decode_kernel({0: 29.1, 8: 28.2, 3: 28.5, (8, 16, 2): 25.2, (8, 64, 2): 26.6}) == (8, 16, 2)
    assert pick_decode_kernel({0: 3.0}) == 0 and pick_decode_kernel({}) == 0
    # a float8 cache's default tile holds as many bytes as a bf16 one's: twice the tokens
    assert pick_decode_kernel({32: 5.0, 8: 4.0}, kv_dtype=torch.float8_e4m3fn) == (8, 128, 4)
    assert pick_decode_kernel({32: 5.0}, kv_dtype=torch.bfloat16) == (32, 64, 4)
    # timed at 1k, and at a long context where the engine admits one (the KV tokens of the timing capped)
    from xllm_gen.runtime.attention.triton_decode import combine_timings, tune_contexts
    assert tune_contexts(1, 40960) == [1024, 32768] and tune_contexts(16, 40960) == [1024, 4096]
    assert tune_contexts(1, 2048) == [1024] and tune_contexts(1, None) == [1024] and tune_contexts(1, 512) == [512]
    # the H100's in-engine figures at one row: 16 splits win at 1k by 2%, starve a 32k context; 32 suit both
    both = combine_timings([{0: 11.0, 32: 9.0, 16: 8.8}, {0: 54.0, 32: 55.0, 16: 74.0}])
    assert pick_decode_kernel(both) == (32, 64, 4) and pick_decode_kernel({0: 11.0, 32: 9.0, 16: 8.8}) == (16, 64, 4)
    assert pick_decode_kernel(combine_timings([{0: 11.0, 16: 8.8}, {0: 54.0, 16: 74.0}])) == 0
    assert split_candidates(1, 8, 132) == [32, 16, 8, 4]
    assert split_candidates(4, 8, 132) == [32, 16, 9, 8, 4, 2]
    assert split_candidates(16, 8, 132) == [8, 4, 3, 2, 1]
    assert split_candidates(64, 4, 132) == [8, 4, 2, 1]


@pytest.mark.parametrize("fast", ["1", "0"])
def test_graph_bucket_replan_on_triton_buffers(monkeypatch, fast):
    """A decode-graph bucket on the Triton kernel, re-planned every step (with or without FlashInfer's fast
    re-plan enabled, which does not apply to it): the bucket's persistent buffers, which the captured launches
    read, hold each step's table, and the variants keep their window."""
    from xllm_gen.runtime.attention.base import FULL, AttentionVariant
    from xllm_gen.runtime.attention.triton_decode import TritonDecodeWrapper
    from xllm_gen.runtime.executor.cuda_graph import _BucketAttention

    monkeypatch.setenv("XLLM_GRAPH_FAST_PLAN", fast)

    class Backend:
        num_heads, num_kv_heads, head_dim, block_size = 4, 2, 8, 4
        dtype = kv_dtype = torch.float32
        sm_scale = 8 ** -0.5

    ip, lp = torch.zeros(5, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
    pages = torch.zeros(32, dtype=torch.int32)
    window = AttentionVariant(5, None)
    wrappers = {v: TritonDecodeWrapper(4, 2, 8, 3, 4, torch.device("cpu"), buffers=(ip, lp, pages))
                for v in (FULL, window)}
    attn = _BucketAttention(Backend(), wrappers, 4)
    steps = [([0, 2, 3, 3, 3], [3, 1, 1, 1]), ([0, 2, 4, 5, 5], [4, 2, 4, 1]), ([0, 1, 1, 1, 1], [2, 1, 1, 1])]
    for i, (ptr, last) in enumerate(steps):
        attn.plan_decode(torch.tensor(ptr, dtype=torch.int32), torch.tensor(last, dtype=torch.int32), pages[:ptr[-1]])
        assert ip.tolist() == ptr and lp.tolist() == last, f"step {i}"
        assert attn._replan is None
    assert wrappers[window]._kw["window_left"] == 4 and wrappers[FULL]._kw["window_left"] == -1
    assert all(w._table[0] is ip and w._table[2] is lp for w in wrappers.values())
