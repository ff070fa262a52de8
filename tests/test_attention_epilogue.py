"""Attention sinks and per-KV-head KV-cache scales on the CUDA path, checked on the CPU (issues 20, 21).

FlashInfer's kernels know neither; runtime/attention/flashinfer_run.py computes both around a wrapper's run:
sinks as out * sigmoid(lse_e - s_h) from the kernel's base-2 log-sum-exp (lse_e = lse2 * ln 2), per-head scales as
q * k_scale[kh] before the kernel and out * v_scale[kh] after it. Here:
- the math: the rescale equals softmax with the extra sink logit (exact); reading the base-2 LSE as natural is wrong
  (sensitivity); folded scales equal attention over the dequantized cache; swapped heads' scales do not;
- the wiring: run_attention over a stand-in FlashInfer wrapper (its run() has FlashInfer's contract: per-tensor
  k_scale folded into the softmax scale, out *= v_scale, return_lse giving a base-2 LSE) equals the torch attention
  (TorchPagedBackend, the CPU semantics) with sinks, per-head and per-tensor scales, and padding rows stay zero;
- the Triton kernels under TRITON_INTERPRET=1 (in a subprocess): the epilogue and q-folding kernels, the KV store
  with per-head scales (bit for bit as the torch store), and the Triton decode kernel with per-head scale pointers
  (with sinks, one and several splits), each against its torch reference;
- the CUDA runner no longer refuses sinks or per-head scales at load (decided on the CPU).
The GPU runs (FlashInfer itself, GPT-OSS with graphs against transformers) are tests/gpu/test_gpu_sinks_kv_scales.py.
"""
from __future__ import annotations

import json
import math
import os
import sys
import types

import pytest
import torch
from interpreted import run_interpreted

# --------------------------------------------------------------------------------------------- the math


def _attend(x, v):
    return torch.einsum("nhl,nhld->nhd", x.softmax(-1), v)


def test_sink_rescale_is_softmax_with_the_sink_logit():
    from xllm_gen.runtime.ops import reference as R
    g = torch.Generator().manual_seed(0)
    N, H, L, D = 6, 4, 9, 8
    x, v = torch.randn(N, H, L, generator=g) * 4, torch.randn(N, H, L, D, generator=g)
    sinks = torch.randn(H, generator=g) * 3
    want = torch.einsum("nhl,nhld->nhd", torch.cat([x, sinks.view(1, H, 1).expand(N, H, 1)], -1).softmax(-1)[..., :L],
                        v)
    out, lse_e = _attend(x, v), torch.logsumexp(x, -1)
    got2 = R.attention_epilogue(out, lse_e / math.log(2), sinks)                  # FlashInfer's base-2 LSE
    got_e = R.attention_epilogue(out, lse_e, sinks, lse_base2=False)
    assert (got2 - want).abs().max() < 1e-5 and (got_e - want).abs().max() < 1e-5
    # sensitivity: the base-2 LSE read as natural, or no sinks, is far off
    assert (R.attention_epilogue(out, lse_e / math.log(2), sinks, lse_base2=False) - want).abs().max() > 1e-2
    assert (out - want).abs().max() > 1e-2
    # a row without keys (lse -inf, or a NaN from a kernel's empty row) gives zeros, whatever the output held
    lse = (lse_e / math.log(2)).clone()
    lse[0, 1], lse[2, 3] = float("-inf"), float("nan")
    junk = out.clone()
    junk[2, 3] = float("nan")
    got = R.attention_epilogue(junk, lse, sinks)
    assert got[0, 1].abs().max() == 0 and got[2, 3].abs().max() == 0 and torch.isfinite(got).all()


def test_folded_per_head_scales_equal_the_dequantized_cache():
    """q_h * k_scale[kh] against the raw cache at the unchanged softmax scale, the output times v_scale[kh]: the
    attention over cache * scale per KV head (GQA group 3); the scales swapped between heads are far off."""
    from xllm_gen.runtime.ops import reference as R
    g = torch.Generator().manual_seed(1)
    N, Hk, G, L, D = 5, 2, 3, 11, 16
    H = Hk * G
    q = torch.randn(N, H, D, generator=g)
    kc, vc = torch.randn(L, Hk, D, generator=g) * 50, torch.randn(L, Hk, D, generator=g) * 50
    ks, vs = torch.tensor([[0.02], [0.005]]), torch.tensor([[0.001], [0.03]])
    scale = D ** -0.5

    def attention(q, k, v):          # [N, H, D] over [L, Hk, D]
        kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        return torch.einsum("nhl,lhd->nhd", (torch.einsum("nhd,lhd->nhl", q, kk) * scale).softmax(-1), vv)

    want = attention(q, kc * ks, vc * vs)
    got = R.attention_epilogue(attention(R.fold_k_scale(q, ks), kc, vc), v_scale=vs)
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    swapped = R.attention_epilogue(attention(R.fold_k_scale(q, ks.flip(0)), kc, vc), v_scale=vs.flip(0))
    assert (swapped - want).abs().max() > 0.1 * want.abs().max()


# --------------------------------------------------------------------------------------------- the wiring
class FakeFlashInferWrapper:
    """A planned decode wrapper with FlashInfer 0.6's run() contract, computed in float32 over a CSR page table:
    run(q, (k_cache, v_cache), k_scale=, v_scale=, return_lse=) -> out or (out, lse base 2); a row without pages
    gives zeros and lse -inf."""

    def __init__(self, indptr, indices, last, page, sm_scale):
        self.table, self.page, self.sm_scale = (indptr.tolist(), indices.long(), last.tolist()), page, sm_scale
        self.calls = []

    def run(self, q, kv, *, k_scale=None, v_scale=None, return_lse=False):
        self.calls.append(dict(k_scale=k_scale, v_scale=v_scale, return_lse=return_lse))
        assert not isinstance(k_scale, torch.Tensor) and not isinstance(v_scale, torch.Tensor)   # floats only
        kc, vc = kv
        ptr, idx, last = self.table
        B, H, D = q.shape
        Hk = kc.shape[2]
        out = torch.zeros(B, H, D)
        lse = torch.full((B, H), float("-inf"))
        for b in range(B):
            pages = idx[ptr[b]: ptr[b + 1]]
            if not len(pages):
                continue
            L = (len(pages) - 1) * self.page + last[b]
            k = kc[pages].reshape(-1, Hk, D)[:L].float().repeat_interleave(H // Hk, 1)
            v = vc[pages].reshape(-1, Hk, D)[:L].float().repeat_interleave(H // Hk, 1)
            s = torch.einsum("hd,lhd->hl", q[b].float(), k) * self.sm_scale * (k_scale or 1.0)
            out[b] = torch.einsum("hl,lhd->hd", s.softmax(-1), v) * (v_scale or 1.0)
            lse[b] = torch.logsumexp(s, -1) / math.log(2)
        out = out.to(q.dtype)
        return (out, lse) if return_lse else out


def _decode_step(lens, page, Hk, D, pool, seed):
    from xllm_gen.runtime.executor.context import ForwardContext
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(pool, generator=g).tolist()
    ptr, idx, last, tables = [0], [], [], []
    for L in lens:
        n = (L + page - 1) // page
        tables.append(perm[len(idx): len(idx) + n])
        idx += tables[-1]
        ptr.append(ptr[-1] + n)
        last.append(L - (n - 1) * page if n else 1)
    B, width = len(lens), max(len(t) for t in tables)
    ctx = ForwardContext(is_prefill=False, cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32),
                         seq_lens=torch.tensor(lens, dtype=torch.int32), slot_mapping=torch.full((B,), -1),
                         block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
                         block_size=page, seq_lens_cpu=list(lens), query_lens_cpu=[1] * B)
    table = tuple(torch.tensor(a, dtype=torch.int32) for a in (ptr, idx, last))
    kc = (torch.randn(pool, page, Hk, D, generator=g) * 100).to(torch.float8_e4m3fn)
    vc = (torch.randn(pool, page, Hk, D, generator=g) * 100).to(torch.float8_e4m3fn)
    return ctx, table, kc, vc


@pytest.mark.parametrize("scales", ["none", "tensor", "head"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_run_attention_matches_the_torch_attention(scales, with_sinks):
    """run_attention over the stand-in wrapper (rows of 1..23 tokens, a padding row, GQA 3) equals TorchPagedBackend
    on the same float8 cache: sinks through return_lse + the epilogue, per-tensor scales passed to run(), per-head
    ones folded into q and applied to the output. Padding rows stay zero."""
    from xllm_gen.runtime.attention.base import AttentionVariant
    from xllm_gen.runtime.attention.flashinfer_run import run_attention
    from xllm_gen.runtime.attention.torch_ref import TorchPagedBackend
    Hk, G, D, page = 2, 3, 16, 4
    H = Hk * G
    lens = [1, 9, 23, 0, 4]
    ctx, (ip, ix, lp), kc, vc = _decode_step(lens, page, Hk, D, 32, seed=2)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(len(lens), H, D, generator=g) * 0.05
    sinks = torch.randn(H, generator=g) * 2 + 1 if with_sinks else None
    kv = {"none": {}, "tensor": {"k_scale": 0.03, "v_scale": 0.004},
          "head": {"k_scale": torch.tensor([[0.05], [0.01]]), "v_scale": torch.tensor([[0.002], [0.02]])}}[scales]
    fake = FakeFlashInferWrapper(ip, ix, lp, page, D ** -0.5)
    got = run_attention(fake, q, (kc, vc), sinks=sinks, **kv)
    oracle = TorchPagedBackend()
    oracle.plan(ctx)
    step = torch.zeros(len(lens), Hk, D)
    want = oracle.forward(q, step, step, kc, vc, ctx, D ** -0.5, AttentionVariant(sinks=with_sinks),
                          **({"sinks": sinks} if with_sinks else {}), **kv)
    live = torch.tensor([n > 0 for n in lens])
    assert (got[live] - want[live]).abs().max() < 1e-5 * max(1.0, want.abs().max().item())
    assert got[~live].abs().max() == 0
    call = fake.calls[-1]
    assert call["return_lse"] == with_sinks
    assert (call["k_scale"], call["v_scale"]) == ((0.03, 0.004) if scales == "tensor" else (None, None))
    if scales == "head":        # sensitivity: the heads' scales swapped move the output
        swapped = run_attention(fake, q, (kc, vc), sinks=sinks, k_scale=kv["k_scale"].flip(0),
                                v_scale=kv["v_scale"].flip(0))
        assert (swapped[live] - want[live]).abs().max() > 0.1 * want.abs().max()


def test_decode_graph_bucket_runs_sinks_and_per_head_scales():
    """The decode graphs' bucket backend (what the layers see inside a captured graph) routes sinks and per-head
    scales through run_attention to its variant's wrapper: the same as the torch attention."""
    from xllm_gen.runtime.attention.base import AttentionVariant
    from xllm_gen.runtime.attention.torch_ref import TorchPagedBackend
    from xllm_gen.runtime.executor.cuda_graph import _BucketAttention
    Hk, G, D, page = 2, 2, 16, 4
    H, lens = Hk * G, [3, 14, 0]
    ctx, (ip, ix, lp), kc, vc = _decode_step(lens, page, Hk, D, 16, seed=4)
    var = AttentionVariant(sliding_window=None, sinks=True)
    bucket = _BucketAttention(types.SimpleNamespace(), {var: FakeFlashInferWrapper(ip, ix, lp, page, D ** -0.5)}, 3)
    g = torch.Generator().manual_seed(5)
    q, sinks = torch.randn(3, H, D, generator=g) * 0.05, torch.randn(H, generator=g) + 2
    ks, vs = torch.tensor([[0.05], [0.01]]), torch.tensor([[0.002], [0.02]])
    step = torch.zeros(3, Hk, D)
    got = bucket.forward(q, step, step, kc, vc, ctx, D ** -0.5, variant=var, sinks=sinks, k_scale=ks, v_scale=vs)
    oracle = TorchPagedBackend()
    oracle.plan(ctx)
    want = oracle.forward(q, step, step, kc, vc, ctx, D ** -0.5, var, sinks=sinks, k_scale=ks, v_scale=vs)
    assert (got[:2] - want[:2]).abs().max() < 1e-5 * want.abs().max() and got[2].abs().max() == 0


def test_run_attention_refuses_scales_on_a_ragged_prefill():
    from xllm_gen.runtime.attention.flashinfer_run import run_attention
    with pytest.raises(RuntimeError, match="ragged prefill"):
        run_attention(object(), torch.zeros(1, 2, 4), (torch.zeros(1, 1, 4), torch.zeros(1, 1, 4)),
                      k_scale=torch.ones(1, 1), v_scale=1.0, ragged=True)


def test_cuda_runner_serves_sinks_and_per_head_scales(monkeypatch):
    """Decided at load, on the CPU: a model with attention sinks and per-KV-head fp8 scales gets the FlashInfer
    backend (replaced by a recorder here), no refusal."""
    import xllm_gen.runtime.attention.flashinfer_backend as fb
    from xllm_gen.runtime.attention.base import cuda_attention_refusal, make_variant
    from xllm_gen.runtime.executor.model_runner import ModelRunner

    class Recorder:
        workspace_size = staticmethod(fb.FlashInferBackend.workspace_size)

        def __init__(self, **kw):
            self.kw, self.num_sms, self.workspace, self.workspace_bytes = kw, 132, object(), 1 << 40

    monkeypatch.setattr(fb, "FlashInferBackend", Recorder)
    layers = [types.SimpleNamespace(head_dim=64, num_heads=4, num_kv_heads=2, scale=0.125,
                                    variant=make_variant(sliding_window=w, sinks=True),
                                    k_scale=torch.tensor([[2.0], [3.0]]), v_scale=torch.tensor([[0.5], [0.25]]))
              for w in (None, 32)]
    runner = types.SimpleNamespace(device=torch.device("cuda"), debug={}, attn_layers=layers, enforce_eager=False,
                                   graph_buckets=(1, 2), max_num_seqs=4, block_size=16, dtype=torch.bfloat16,
                                   max_model_len=64, num_kv_blocks=32, max_num_batched_tokens=256,
                                   kv_dtype=torch.float8_e4m3fn)
    backend = ModelRunner._make_backend(runner)
    assert isinstance(backend, Recorder) and backend.kw["kv_dtype"] == torch.float8_e4m3fn
    assert cuda_attention_refusal([64]) is None


# --------------------------------------------------------------------------------------------- Triton, interpreted
def _checks() -> dict:
    from xllm_gen.runtime.ops import reference as R
    from xllm_gen.runtime.ops import triton_kernels as T
    from xllm_gen.runtime.ops.attention_epilogue import attention_epilogue_triton, fold_k_scale_triton
    from xllm_gen.runtime.ops.decode_attention import DecodeScratch, paged_decode_attention
    g = torch.Generator().manual_seed(0)
    out = {}

    def err(a, b):
        return ((a.float() - b.float()).abs().max() / max(1.0, b.float().abs().max().item())).item()

    # the epilogue: H 6 (not a power of 2) x D 48 (padded), several head blocks (D 256 x H 40 > one tile)
    for N, Hk, G, D in ((7, 2, 3, 48), (3, 8, 5, 256)):
        H = Hk * G
        for dt in (torch.float32, torch.float16):
            o = torch.randn(N, H, D, generator=g).to(dt)
            lse = torch.randn(N, H, generator=g) * 3
            lse[0, 1] = float("-inf")
            sinks = (torch.randn(H, generator=g) * 2).to(dt)
            vs = torch.rand(Hk, 1, generator=g) + 0.1
            for name, kw in (("sinks_v", dict(lse=lse, sinks=sinks, v_scale=vs)), ("sinks", dict(lse=lse, sinks=sinks)),
                             ("v", dict(v_scale=vs))):
                want = R.attention_epilogue(o, **kw)
                got = attention_epilogue_triton(o.clone(), **kw)
                out[f"epilogue_{name}_H{H}_D{D}_{str(dt)[6:]}"] = (err(got, want), 1e-6 if dt == torch.float32 else 1e-3)
            q = (torch.randn(N, H + 1, D, generator=g) * 3).to(dt)[:, :H]          # strided rows
            ks = torch.rand(Hk, 1, generator=g) * 10
            out[f"fold_k_scale_H{H}_D{D}_{str(dt)[6:]}"] = (err(fold_k_scale_triton(q, ks), R.fold_k_scale(q, ks)),
                                                             0.0)
    # the KV store with per-KV-head scales (K per head, V per head; K per head with V per tensor): bit for bit, into
    # a float16 cache (the interpreter's float8 conversion is not the GPU's: the float8 bytes are checked on a GPU)
    f16 = torch.float16
    N, Hk, D, pool, page = 9, 3, 40, 6, 4
    k, v = torch.randn(N, Hk, D, generator=g) * 200, torch.randn(N, Hk, D, generator=g) * 1e-3
    slots = torch.tensor([0, 5, -1, 7, 8, 13, 22, 3, 1])
    for name, ks, vs in (("head_head", torch.tensor([[0.5], [3.0], [0.05]]), torch.tensor([[1e-5], [4e-6], [1e-6]])),
                         ("head_tensor", torch.tensor([[0.5], [3.0], [0.05]]), 4e-6)):
        kc, vc = torch.zeros(pool, page, Hk, D, dtype=f16), torch.zeros(pool, page, Hk, D, dtype=f16)
        kr, vr = kc.clone(), vc.clone()
        T.store_kvcache(k, v, kc, vc, slots, ks, vs)
        R.store_kvcache(k, v, kr, vr, slots, ks, vs)
        out[f"store_kvcache_per_head_{name}"] = (float(not (torch.equal(kc, kr) and torch.equal(vc, vr))), 0.0)
        T.store_kvcache(k, v, kc, vc, slots, ks.flip(0), vs)       # sensitivity: the heads' scales swapped
        out[f"store_kvcache_per_head_{name}_swapped_differ"] = (float(torch.equal(kc, kr)), 0.0)
    # the Triton decode kernel with per-KV-head scale pointers (and sinks), one and three splits
    page, pool, D, Hk, G = 4, 40, 48, 2, 2
    H = Hk * G
    lens = [1, 9, 0, 23, 6]
    ctx_tables = _decode_step(lens, page, Hk, D, pool, seed=5)
    _, (ip, ix, lp), kc8, vc8 = ctx_tables
    q = torch.randn(len(lens), H, D, generator=g) * 0.05
    ks, vs = torch.tensor([[0.05], [0.008]]), torch.tensor([[0.002], [0.03]])
    for sinks in (None, torch.randn(H, generator=g) * 2):
        want = R.paged_decode_attention(q, kc8, vc8, ip, ix, lp, D ** -0.5, sinks=sinks, k_scale=ks, v_scale=vs)
        for splits in (1, 3):
            got = paged_decode_attention(q, kc8, vc8, ip, ix, lp, D ** -0.5, DecodeScratch(8, H, Hk, D, splits, "cpu"),
                                         block_n=16, sinks=sinks, k_scale=ks, v_scale=vs)
            out[f"decode_per_head_scales_{'sinks' if sinks is not None else 'plain'}_splits{splits}"] = (
                err(got, want), 1e-5)
    flipped = paged_decode_attention(q, kc8, vc8, ip, ix, lp, D ** -0.5, DecodeScratch(8, H, Hk, D, 1, "cpu"),
                                     block_n=16, k_scale=ks.flip(0), v_scale=vs.flip(0))
    want = R.paged_decode_attention(q, kc8, vc8, ip, ix, lp, D ** -0.5, k_scale=ks, v_scale=vs)
    out["decode_per_head_scales_swapped_differ"] = (float(not err(flipped, want) > 1e-2), 0.0)
    return out


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--interpret":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print("RESULT " + json.dumps(_checks()))
    sys.exit(0)


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(__file__, timeout=300)


@pytest.mark.parametrize("case", ["epilogue_sinks_v", "epilogue_sinks_", "epilogue_v_", "fold_k_scale",
                                  "store_kvcache_per_head", "decode_per_head_scales"])
def test_triton_kernels_interpreted_vs_reference(interpreted, case):
    got = {k: v for k, v in interpreted.items() if k.startswith(case)}
    assert got, sorted(interpreted)
    for name, (e, tol) in got.items():
        assert e <= tol, f"{name}: max error {e} > {tol}"
