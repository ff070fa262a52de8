"""The whole-layer decode kernel on the GPU (marker `gpu`; skipped without CUDA): runtime/ops/layer_kernel.py in its
one-launch form (grid barriers between the stages) and the generated code's L.decoder_layer_kernel.

- kernel, Qwen3-0.6B and -8B layer shapes in bf16, 1 / 4 / 16 rows of different context lengths: the one-launch
  form equals the staged form (five launches of the same code) bit for bit, and the float32 torch layer within bf16
  rounding; a CUDA graph of 28 launches replays to the same output as eager launches and leaves every counter at 0;
- a tiny bf16 Qwen3 (head_dim 128): greedy decode with the kernel (XLLM_LAYER_KERNEL=1) against the plain steps (=0):
  tokens equal up to bf16 near-ties; the kernel ran; CUDA-graph decode == eager decode.
Numbers are printed (pytest -s) and appended as JSON lines to $XLLM_TEST_REPORT when set.
"""
from __future__ import annotations

import pytest
import torch
from fixtures.report import report as _report

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = {"0.6B": (1024, 16, 8, 128, 3072), "8B": (4096, 32, 8, 128, 12288)}


def _layer_inputs(D, H, HK, HD, inter, lens, page=16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch.bfloat16

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, device="cuda", generator=g) * scale).to(dt)

    M = len(lens)
    npages = sum(-(-L // page) for L in lens) + 8
    perm = torch.randperm(npages, device="cuda", generator=g).tolist()
    tables, ip, ix, last = [], [0], [], []
    for L in lens:
        n = -(-L // page)
        tables.append(perm[:n])
        ix += perm[:n]
        perm = perm[n:]
        ip.append(ip[-1] + n)
        last.append(L - (n - 1) * page)
    inv = 1.0 / (1e6 ** (torch.arange(0, HD, 2, device="cuda").float() / HD))
    fr = torch.arange(max(lens) + 1, device="cuda").float()[:, None] * inv[None]
    return dict(
        x=rnd(M, D), res=rnd(M, D), g1=(1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(dt),
        g2=(1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(dt),
        wqkv=rnd((H + 2 * HK) * HD, D, scale=D ** -0.5), qw=(1 + 0.1 * torch.randn(HD, device="cuda", generator=g)).to(dt),
        kw=(1 + 0.1 * torch.randn(HD, device="cuda", generator=g)).to(dt), wo=rnd(D, H * HD, scale=(H * HD) ** -0.5),
        wgu=rnd(2 * inter, D, scale=D ** -0.5), wd=rnd(D, inter, scale=inter ** -0.5),
        kc=rnd(npages, page, HK, HD), vc=rnd(npages, page, HK, HD), tables=tables,
        table=(torch.tensor(ip, dtype=torch.int32, device="cuda"), torch.tensor(ix, dtype=torch.int32, device="cuda"),
               torch.tensor(last, dtype=torch.int32, device="cuda")),
        slots=torch.tensor([tables[b][(L - 1) // page] * page + (L - 1) % page for b, L in enumerate(lens)],
                           device="cuda"),
        pos=torch.tensor([L - 1 for L in lens], device="cuda"), cs=torch.cat([fr.cos(), fr.sin()], -1), page=page)


def _run(LK, t, scratch, staged, kc=None, vc=None):
    kc = t["kc"].clone() if kc is None else kc
    vc = t["vc"].clone() if vc is None else vc
    HD = t["kc"].shape[-1]
    out, r2 = LK.decoder_layer(t["x"], t["res"], t["g1"], 0.0, 1e-6, t["wqkv"], None, t["qw"], t["kw"], 1e-6, t["pos"],
                               t["cs"], t["slots"], kc, vc, *t["table"], HD ** -0.5, -1, t["wo"], t["g2"], 0.0, 1e-6,
                               t["wgu"], "silu", t["wd"], scratch, staged=staged)
    return out, r2, kc, vc


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("lens", [[1000], [37, 513, 1024, 5], [int(17 + 61 * i) for i in range(16)]])
def test_layer_kernel_one_launch(shape, lens):
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from test_layer_kernel import reference_layer

    from xllm_gen.runtime.ops import layer_kernel as LK
    D, H, HK, HD, inter = SHAPES[shape]
    t = _layer_inputs(D, H, HK, HD, inter, lens)
    P = torch.cuda.get_device_properties(0).multi_processor_count
    scratch = LK.LayerScratch(LK.LayerDims(D, H, HK, HD, inter, t["page"]), P, torch.bfloat16, "cuda")
    staged = _run(LK, t, scratch, True)
    one = _run(LK, t, scratch, False)
    torch.cuda.synchronize()
    same = [torch.equal(a, b) for a, b in zip(staged, one)]
    f = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in t.items()}
    ro, rr, rkc, rvc = reference_layer(f["x"].cpu(), f["res"].cpu(), f["g1"].cpu(), 1e-6, f["wqkv"].cpu(), None,
                                       f["qw"].cpu(), f["kw"].cpu(), t["pos"].cpu(), f["cs"].cpu(), t["slots"].cpu(),
                                       f["kc"].cpu(), f["vc"].cpu(), t["tables"], lens, HD ** -0.5, -1, f["wo"].cpu(),
                                       f["g2"].cpu(), f["wgu"].cpu(), f["wd"].cpu(), H, HK, HD)
    err_out = ((one[0].float().cpu() - ro).abs().max() / ro.abs().max()).item()
    err_res = ((one[1].float().cpu() - rr).abs().max() / rr.abs().max()).item()
    # a CUDA graph of 28 launches (a model's layers, each on the previous one's output) vs the same eagerly
    x0, r0 = t["x"], t["res"]

    def chain():
        x, r = x0, r0
        for _ in range(28):
            t["x"], t["res"] = x, r
            x, r, _, _ = _run(LK, t, scratch, False, kc=t["kc"], vc=t["vc"])
        return x, r
    eager = chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain()
    graph.replay()
    torch.cuda.synchronize()
    t["x"], t["res"] = x0, r0
    res = dict(test="layer_kernel_one_launch", shape=shape, rows=len(lens), staged_equal=same, err_out=err_out,
               err_res=err_res, graph_equal=[torch.equal(a, b) for a, b in zip(eager, captured)],
               counters=int(scratch.counters.abs().sum()))
    _report(**res)
    print(res)
    assert all(same), res
    assert err_out < 3e-2 and err_res < 1e-2, res
    assert all(res["graph_equal"]) and res["counters"] == 0, res


def test_layer_kernel_engine_tokens(tmp_path_factory, monkeypatch):
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from fixtures.tiny_hf import make_tiny_qwen3
    from test_gpu_fused_decode import _compare, _params, _prompts

    from xllm_gen import LLM
    from xllm_gen.runtime.layers import layer_kernel as LKL
    tiny = make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_layer"), hidden_size=256, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=512,
                           max_position_embeddings=2048, seed=0)
    saved = LKL.MODE
    try:
        out = {}
        for mode in ("0", "1"):
            LKL.MODE = mode
            llm = LLM(str(tiny), dtype="bfloat16", max_num_seqs=16, num_kv_blocks=1024, max_model_len=256,
                      enable_prefix_caching=False)
            prompts = {B: _prompts(B, llm.engine.vocab_size, B) for B in (1, 3, 16)}
            before = LKL.CALLS["fused"]
            out[mode] = {B: llm.generate(p, _params()) for B, p in prompts.items()}
            out[mode + "_calls"] = LKL.CALLS["fused"] - before
            if mode == "1":
                runner = llm.engine.runner
                graphs, runner.graphs = runner.graphs, None
                try:
                    eager = {B: llm.generate(p, _params()) for B, p in prompts.items()}
                finally:
                    runner.graphs = graphs
                for B in prompts:
                    r = _compare(eager[B], out["1"][B], f"layer_kernel_graph_vs_eager_b{B}")
                    assert r["diverged"] == 0, r
            llm.shutdown()
        _report(test="layer_kernel_calls", plain=out["0_calls"], fused=out["1_calls"])
        assert out["0_calls"] == 0 and out["1_calls"] > 0, (out["0_calls"], out["1_calls"])
        for B in (1, 3, 16):
            _compare(out["0"][B], out["1"][B], f"layer_kernel_vs_plain_b{B}", max_diff=None)
    finally:
        LKL.MODE = saved
