"""The whole-layer decode kernel (runtime/ops/layer_kernel.py, runtime/layers/layer_kernel.py; generated code's
L.decoder_layer_kernel), on CPU under TRITON_INTERPRET=1 in its staged form (the interpreter runs a launch's programs
one after another, so the one-launch form's grid barriers run on the GPU: tests/gpu/test_gpu_layer_kernel.py):

- kernel: one decoder layer (q/k/v bias, per-head q/k norm, neox rotary, GQA, paged cache with shuffled pages,
  rows of different lengths incl. a padding row, a sliding window, 1 to 5 rows, splits of the KV range or not)
  against the layer written in float32 torch ops; the step's k, v land in the cache at their slots; every counter
  is back at 0 after a launch;
- sensitivity: a rotary of the wrong position, the second norm's weight dropped, a KV cache whose step token was not
  written change the output;
- model: a tiny Qwen3 greedy decode with the kernel on (XLLM_LAYER_KERNEL=staged) gives the tokens of the plain path,
  and the kernel ran once per layer per decode step;
- generated code: the call is emitted exactly for layers of the pattern.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 6


def reference_layer(x, res, g1, eps, wqkv, bqkv, qw, kw, pos, cs, slots, kc, vc, tables, lens, scale, window, wo,
                    g2, wgu, wd, H, HK, HD):
    """One pre-norm attention + gated-SiLU-MLP layer in float32 torch ops: (out, residual, k cache, v cache)."""
    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w

    h = x if res is None else x + res
    qkv = rms(h, g1) @ wqkv.T + (0 if bqkv is None else bqkv)
    M = x.shape[0]
    q, k, v = qkv.split([H * HD, HK * HD, HK * HD], -1)
    q, k, v = q.reshape(M, H, HD), k.reshape(M, HK, HD), v.reshape(M, HK, HD)
    if qw is not None:
        q, k = rms(q, qw), rms(k, kw)
    c, s = cs[pos, : HD // 2][:, None], cs[pos, HD // 2:][:, None]

    def rope(t):
        a, b = t[..., : HD // 2], t[..., HD // 2:]
        return torch.cat([a * c - b * s, b * c + a * s], -1)

    q, k = rope(q), rope(k)
    kc, vc = kc.clone(), vc.clone()
    page = kc.shape[1]
    out = torch.zeros(M, H, HD)
    for b in range(M):
        if slots[b] < 0:
            continue
        kc.view(-1, HK, HD)[int(slots[b])] = k[b]
        vc.view(-1, HK, HD)[int(slots[b])] = v[b]
        L = int(lens[b])
        start = max(0, L - 1 - window) if window >= 0 else 0
        idx = [int(tables[b][t // page]) * page + t % page for t in range(start, L)]
        K_ = kc.view(-1, HK, HD)[idx].repeat_interleave(H // HK, 1)
        V_ = vc.view(-1, HK, HD)[idx].repeat_interleave(H // HK, 1)
        out[b] = torch.einsum("ht,thd->hd", (torch.einsum("hd,thd->ht", q[b], K_) * scale).softmax(-1), V_)
    r2 = out.reshape(M, -1) @ wo.T + h
    gu = rms(r2, g2) @ wgu.T
    inter = wgu.shape[0] // 2
    return (F.silu(gu[:, :inter]) * gu[:, inter:]) @ wd.T, r2, kc, vc


def _kernel_checks(full: bool) -> dict:
    from xllm_gen.runtime.ops import layer_kernel as LK

    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * 0.3

    D, H, HK, HD, inter, page = 64, 4, 2, 16, 96, 4
    dims = LK.LayerDims(D, H, HK, HD, inter, page)
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD))
    fr = torch.arange(64).float()[:, None] * inv[None]
    cs = torch.cat([fr.cos(), fr.sin()], -1)
    out = {}
    # (rows, programs, window, lengths (0: a padding row), launch config: K split in stages 3 / 5, K chunks)
    # the default run: K splits with masked chunks, a padding row, the window, the compiler-pipelined K loops;
    # the slow arm adds the rest
    cases = [(3, 8, 5, [13, 0, 22], dict(s3=2, s5=3, bk3=16, bk5=16, pipeline=2)), (1, 64, -1, [13], {})]
    if full:
        cases += [(5, 32, 5, [13, 1, 22, 7, 9], dict(s5=2)), (2, 8, -1, [10, 0], dict(bk1=16)),
                  (4, 16, -1, [30, 2, 17, 5], dict(bn1=64, bn4=64, bk4=16))]
    for ci, (M, P, window, lens, cfg) in enumerate(cases):
        x, res = rnd(M, D), rnd(M, D)
        g1, g2 = 1 + rnd(D), 1 + rnd(D)
        wqkv, bqkv = rnd((H + 2 * HK) * HD, D), rnd((H + 2 * HK) * HD)
        qw, kw = 1 + rnd(HD), 1 + rnd(HD)
        wo, wgu, wd = rnd(D, H * HD), rnd(2 * inter, D), rnd(D, inter)
        npages = 64
        kc, vc = rnd(npages, page, HK, HD), rnd(npages, page, HK, HD)
        perm = torch.randperm(npages, generator=gen).tolist()
        tables, ip, ix, last = [], [0], [], []
        for L in lens:
            n = -(-L // page)
            tables.append(perm[:n])
            ix += perm[:n]
            perm = perm[n:]
            ip.append(ip[-1] + n)
            last.append(L - (n - 1) * page if n else 0)
        slots = torch.tensor([tables[b][(L - 1) // page] * page + (L - 1) % page if L else -1
                              for b, L in enumerate(lens)])
        pos = torch.tensor([max(L - 1, 0) for L in lens])
        table = (torch.tensor(ip, dtype=torch.int32), torch.tensor(ix, dtype=torch.int32),
                 torch.tensor(last, dtype=torch.int32))
        scale = HD ** -0.5
        scratch = LK.LayerScratch(dims, P, torch.float32, "cpu", tile_budget=512, num_warps=4, **cfg)

        def run(cs_=cs, g2_=g2, kc0=kc, store=True):
            kc1, vc1 = kc0.clone(), vc.clone()
            sl = slots if store else torch.full_like(slots, -1)
            o, r = LK.decoder_layer(x, res, g1, 0.0, 1e-6, wqkv, bqkv, qw, kw, 1e-6, pos, cs_, sl, kc1, vc1, *table,
                                    scale, window, wo, g2_, 0.0, 1e-6, wgu, "silu", wd, scratch, staged=True)
            return o, r, kc1, vc1

        o, r, kc1, vc1 = run()
        ro, rr, rkc, rvc = reference_layer(x, res, g1, 1e-6, wqkv, bqkv, qw, kw, pos, cs, slots, kc, vc, tables, lens,
                                           scale, window, wo, g2, wgu, wd, H, HK, HD)
        live = torch.tensor([L > 0 for L in lens])
        name = f"M{M}_P{P}_w{window}"
        scale_o = ro.abs().max().item()
        out[name + "_out"] = ((o - ro)[live].abs().max().item() / scale_o, 2e-6)
        out[name + "_residual"] = ((r - rr).abs().max().item() / rr.abs().max().item(), 2e-6)
        out[name + "_cache"] = (max((kc1 - rkc).abs().max().item(), (vc1 - rvc).abs().max().item()), 2e-6)
        out[name + "_counters_reset"] = (float(scratch.counters.abs().sum()), 0.0)
        # sensitivity: each change must move the output (a relative change > 1e-3)
        for arm, kw_ in (("wrong_position", dict(cs_=cs.roll(1, 0))), ("norm2_weight_dropped", dict(g2_=g2 * 0 + 1)),
                         ("token_not_stored", dict(store=False)))[: 3 if ci == 0 or full else 0]:
            o2 = run(**kw_)[0]
            out[f"{name}_sensitive_{arm}"] = (-((o2 - o)[live].abs().max().item() / scale_o), -1e-3)
    return out


def _model_checks(ckpt: str) -> dict:
    from xllm_gen import LLM, SamplingParams
    from xllm_gen.runtime.layers import layer_kernel as LKL
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 3]}, {"prompt_token_ids": [9, 2, 44, 7, 31, 12, 8, 1, 6, 70, 3]}]
    out = {}
    with LLM(model=ckpt, device="cpu", dtype="float32", block_size=4) as llm:
        def run():
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        LKL.MODE = "0"
        out["plain"] = run()
        out["plain_calls"] = LKL.CALLS["fused"]
        LKL.MODE = "staged"
        out["fused"] = run()
        out["fused_calls"] = LKL.CALLS["fused"]
    return out


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--interpret":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    res = _kernel_checks(sys.argv[2] == "kernels_full") if sys.argv[2].startswith("kernels") else \
        _model_checks(sys.argv[3])
    print("RESULT " + json.dumps(res))
    sys.exit(0)


def _interpret(*args) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", XLLM_LAYER_KERNEL="0", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--interpret", *args], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow       # ~8 s interpreted; the whole-layer kernel is off by default (XLLM_LAYER_KERNEL; slower than the
# default path on the H100 / H200), and tests/gpu/test_gpu_layer_kernel.py runs it on a GPU
def test_layer_kernel_matches_reference_layer():
    res = _interpret("kernels")
    assert len(res) == 7 + 4, sorted(res)
    bad = {k: v for k, v in res.items() if v[0] > v[1]}
    assert not bad, bad


@pytest.mark.slow       # every case with its sensitivity arms
def test_layer_kernel_matches_reference_layer_all_cases():
    res = _interpret("kernels_full")
    assert len(res) == 5 * 7, sorted(res)
    bad = {k: v for k, v in res.items() if v[0] > v[1]}
    assert not bad, bad


@pytest.mark.slow       # a minute under the interpreter; the GPU test runs the engine with the one-launch form
def test_layer_kernel_model_tokens(qwen3_tied):
    res = _interpret("model", str(qwen3_tied))
    assert res["plain_calls"] == 0, res
    # 2 layers, one call per layer per decode step (the prefill step runs the plain steps)
    assert res["fused_calls"] >= 2 * (NEW_TOKENS - 1), res
    assert res["fused"] == res["plain"], res


def test_layer_kernel_emitted_where_the_pattern_holds():
    qwen3 = (ROOT / "generated" / "qwen3" / "model.py").read_text()
    assert "L.decoder_layer_kernel(positions, hidden_states, residual, self.input_layernorm, self.self_attn" in qwen3
    assert "self.self_attn.q_norm, self.self_attn.k_norm" in qwen3
    llama = (ROOT / "generated" / "llama" / "model.py").read_text()
    assert "L.decoder_layer_kernel(" in llama and "None, None)" in llama
    # sandwich norms (Gemma 2), MoE (Qwen3-MoE), parallel residual (GPT-NeoX): the plain steps only
    for family in ("gemma2", "qwen3_moe", "gpt_neox"):
        assert "decoder_layer_kernel" not in (ROOT / "generated" / family / "model.py").read_text(), family


def test_layer_kernel_off_cpu_without_interpreter():
    """On CPU without the interpreter (the default suite's engines) the call returns None: the plain steps run."""
    from xllm_gen.runtime.layers import layer_kernel as LKL
    x = torch.zeros(1, 8)
    assert LKL._mode_allows(x) is None or os.environ.get("TRITON_INTERPRET") == "1"
