"""Quantized checkpoints on the GPU (marker `gpu`; skipped without CUDA): the fp8 block-wise and
compressed-tensors per-token paths (weights dequantized at load, activations quantized by ActQuant, torch ops)
give on CUDA what they give on the CPU (float32: same teacher-forced top-1, relative logit error < 1e-3), and
with FlashInfer, bf16 decode CUDA graphs give the eager path's tokens. The fp8 KV cache (scale 1.0, and the
checkpoint's per-tensor scales: the Triton store kernel, FlashInfer's prefill / decode wrappers and the Triton decode
kernel) gives the torch attention's results on the same cache."""
from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[97, 11, 187, 0, 57, 67], [3, 17, 99, 102, 7, 7, 300, 41, 5]]


@pytest.mark.parametrize("fmt", ["fp8_block", "ct_token"])
def test_quantized_cuda_matches_cpu(tmp_path, fmt):
    from fixtures.tiny_hf import make_tiny_qwen3
    from quant_ckpt import write_ct_fp8, write_fp8_block

    from xllm_gen import LLM, SamplingParams
    base = make_tiny_qwen3(tmp_path / "base", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
    if fmt == "fp8_block":
        ckpt, _ = write_fp8_block(base, tmp_path / "c", tmp_path / "r", (128, 128))
    else:
        ckpt, _ = write_ct_fp8(base, tmp_path / "c", tmp_path / "r", strategy="channel", act="token")
    kw = dict(dtype="float32", block_size=16, max_num_seqs=4, max_model_len=256, num_kv_blocks=64)
    cpu = LLM(str(ckpt), device="cpu", enforce_eager=True, **kw)
    gpu = LLM(str(ckpt), device="cuda", enforce_eager=True, _debug={"torch_attention": True}, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in cpu.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)]
    for p, w in zip(PROMPTS, want):
        seq = p + w
        a = torch.as_tensor(cpu.prefill_logits(seq)).float()
        b = torch.as_tensor(gpu.prefill_logits(seq)).float().cpu()
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        err = (a - b).abs().amax(-1) / a.abs().max()              # per position
        crossed = (err >= 1e-3).nonzero()
        first = int(crossed[0]) if len(crossed) else len(err)
        print(f"\n[{fmt}] cuda vs cpu float32: top-1 {agree:.3f}, relative logit error max {err.max():.2e}, "
              f"first position >= 1e-3: {first} of {len(err)}")
        # quantized activations are a step function of the float32 input: CPU and CUDA float32 differ by ~1e-7,
        # which now and then moves an activation across an fp8 rounding boundary (one fp8 step, ~6%, in one
        # element: ~1e-2 in that position's logits), and from there on through the KV cache into every later
        # position. So the positions before the first crossing agree to float32 rounding, at least the first
        # half of each sequence has none, and after it the logits stay within a few such steps with the same top-1
        # (wrong scales or layouts move every position from the first on, by far more).
        assert agree == 1.0 and err[:first].max() < 1e-5 and first >= len(err) // 2 and err.max() < 5e-2
    gpu.shutdown()
    cpu.shutdown()
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer not installed: bf16 graph arm not run")
    # graph vs eager on ONE engine (two engines may tune their decode GEMMs differently): bf16 tokens equal but
    # at a near tie, logprobs close (fixtures/graph_compare.py, as tests/gpu/test_gpu_graphs.py)
    from fixtures.graph_compare import _compare, _eager
    spl = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    llm = LLM(str(ckpt), device="cuda", cuda_graph_sizes=[1, 2, 4], **dict(kw, dtype="bfloat16"))
    assert llm.engine.runner.graphs is not None
    g = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], spl)
    with _eager(llm):
        e = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], spl)
    llm.shutdown()
    _compare(e, g, f"quant_{fmt}_graph_vs_eager")


# ---------------------------------------------------------------------------------------------- weight-only GEMMs
# runtime/ops/quant_gemv.py on the GPU, bf16 activations, Qwen3-8B layer shapes and odd ones (K tail, group 32,
# N not a multiple of the tile), M 1 / 4 / 16 (and 3, 5: both product paths), against F.linear on the weight
# dequantized to bf16 (the exact values the reference layer holds): fp32 accumulation in both, so the relative
# error is rounding only (< 1e-2 of the output's max; a wrong nibble order / scale / zero gives > 0.1).
INT4_SHAPES = [(6144, 4096, 128), (4096, 12288, 128), (1000, 4096, 64), (4096, 1024, 32), (520, 8200, 8200)]
FP8_SHAPES = [(6144, 4096, (128, 128)), (4096, 12288, (128, 128)), (4096, 4096, (1, 4096)), (1000, 1000, (1000, 1000)),
              (24576, 4096, (128, 128))]


def _rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 16])
def test_int4_gemm_cuda(M):
    from xllm_gen.runtime.ops import quant_gemv as Q
    torch.manual_seed(0)
    for N, K, g in INT4_SHAPES:
        codes = torch.randint(0, 16, (N, K), device="cuda", dtype=torch.uint8)
        qw = Q.pack_int4(codes)
        s = (torch.rand(N, K // g, device="cuda") * 0.004 + 0.001).to(torch.float16)
        z = torch.randint(0, 16, (N, K // g), device="cuda", dtype=torch.uint8)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, Q.dequant_int4(qw, s, z, g, torch.bfloat16), b)
        from xllm_gen.runtime.ops import quant_tinygemm as TG
        tiny, tiny_bad = TG.pack(codes, s, z, g), TG.pack(codes, s, (z + 1) % 16, g)
        # the tensor-core tile, the split-K GEMV (ops/quant_splitk.py), torch's tinygemm (ops/quant_tinygemm.py) and
        # the tensor cores over the raw codes (ops/quant_int4_codes.py: the bf16 magic, which the interpreter can't)
        from xllm_gen.runtime.ops import quant_int4_codes as QC
        for kernel in (("mma", "splitk") + (("tinygemm",) if tiny is not None else ())
                       + (("codes",) if QC.fits(M, K, g, x.dtype) else ())):
            e = _rel_err(Q.int4_gemm(x, qw, s, z, g, b, kernel=kernel, tinygemm=tiny), ref)
            bad = _rel_err(Q.int4_gemm(x, qw, s, (z + 1) % 16, g, b, kernel=kernel, tinygemm=tiny_bad), ref)
            print(f"\n[int4 g{g} {kernel}] M {M} N {N} K {K}: relative error {e:.2e} (zeros off by one: {bad:.2e})")
            assert e < 1e-2 and bad > 5e-2
        if M == 1:      # the prefill path: the dequantize kernel, bit for bit the reference, then cuBLAS
            assert torch.equal(Q.int4_dequantize(qw, s, z, g, torch.bfloat16), Q.dequant_int4(qw, s, z, g, torch.bfloat16))
            from xllm_gen.runtime.layers.quant_linear import PackedInt4
            xb = torch.randn(100, K, device="cuda", dtype=torch.bfloat16)
            want = torch.nn.functional.linear(xb, Q.dequant_int4(qw, s, z, g, torch.bfloat16), b)
            assert torch.equal(PackedInt4(qw, s, z, g)(xb, b), want)


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 16])
def test_fp8_gemm_cuda(M):
    from xllm_gen.runtime.ops import quant_gemv as Q
    torch.manual_seed(0)
    for N, K, blk in FP8_SHAPES:
        w = (torch.randn(N, K, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        sc = torch.rand(-(-N // blk[0]), -(-K // blk[1]), device="cuda") * 1e-3 + 1e-4
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, Q.dequant_fp8(w, sc, blk, torch.bfloat16))
        # the tensor-core tile, split-K, and (up to 8 rows) the skinny GEMM streaming the float8 weight
        for kernel in ("mma", "splitk") + (("fma",) if M <= 8 else ()):
            e = _rel_err(Q.fp8_gemm(x, w, sc, blk, kernel=kernel), ref)
            bad = _rel_err(Q.fp8_gemm(x, w, sc.flip(0), blk, kernel=kernel), ref) if sc.shape[0] > 1 else 1.0
            print(f"\n[fp8 {blk[0]}x{blk[1]} {kernel}] M {M} N {N} K {K}: relative error {e:.2e} (scales flipped: "
                  f"{bad:.2e})")
            assert e < 1e-2 and bad > 5e-2
        if M == 1:
            assert torch.equal(Q.fp8_dequantize(w, sc, blk, torch.bfloat16), Q.dequant_fp8(w, sc, blk, torch.bfloat16))


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer")
@pytest.mark.parametrize("M", [65, 300, 1024])
def test_fp8_block_prefill_gemm_cuda(M):
    """A prefill chunk of a float8 layer whose input is quantized per token and 128 columns (the *-FP8 releases)
    runs the block-scaled float8 GEMM (ops/fp8_block_gemm.py, sm 9.0): against the reference layer (F.linear on the
    bf16 round trip of the input and the weight dequantized to bf16) and against the float32 product of the same
    quantized operands. It skips the reference's bf16 roundings of q * s, so it is about as close to the float32
    product as the reference is (asserted), and within bf16 rounding of the reference. Scales one block off: far
    from both. 128 x 128 block scales, per channel, per 256 columns, N not a multiple of 128, a bias; captured in
    a CUDA graph."""
    from xllm_gen.runtime.layers.quant import ActQuant
    from xllm_gen.runtime.layers.quant_linear import PackedFp8
    from xllm_gen.runtime.ops import fp8_block_gemm as B
    from xllm_gen.runtime.ops import quant_gemv as Q
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the block-scaled float8 GEMM is sm 9.0's")
    torch.manual_seed(0)
    aq = ActQuant("group", 128)
    for N, K, bc, shared in ((6144, 4096, 128, True), (4096, 12288, 128, True), (1024, 4096, 4096, True),
                             (576, 1024, 256, True), (1024, 4096, 128, False)):
        w = (torch.randn(N, K, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        sc = torch.rand(N, -(-K // bc), device="cuda") * 1e-3 + 1e-4
        if shared:                                  # 128 x 128 blocks, held per row as a loaded checkpoint's
            sc = sc[::128].repeat_interleave(128, 0)[:N].contiguous()
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        x = aq(torch.randn(M, K, device="cuda", dtype=torch.bfloat16))         # as the fused norm hands it over
        w16 = Q.dequant_fp8(w, sc, (1, bc), torch.bfloat16)
        ref16 = torch.nn.functional.linear(x, w16, bias)
        exact = x.float() @ Q.dequant_fp8(w, sc, (1, bc), torch.float32).T + bias.float()
        layer = PackedFp8(w, sc, bc)
        if not shared:          # a scale per row: not the kernel's (its per-row form computed wrong products)
            assert layer.kernel_scale is None and torch.equal(layer(x, bias, act_quant=aq), ref16)
            continue
        assert layer.kernel_scale is not None and layer.kernel_scale.shape == (-(-N // 128), K // 128)
        got = layer(x, bias, act_quant=aq)
        assert torch.equal(got, B.fp8_block_linear(x, w, layer.kernel_scale, bias))       # the layer took it
        bad = B.fp8_block_linear(x, w, layer.kernel_scale.roll(1, 0), bias)
        e, e_ref, e_bad = _rel_err(got, exact), _rel_err(ref16, exact), _rel_err(bad, exact)
        print(f"\n[fp8 block prefill] M {M} N {N} K {K} per {bc}: vs float32 {e:.2e} (reference layer {e_ref:.2e}), "
              f"vs reference {_rel_err(got, ref16):.2e}; scales rolled {e_bad:.2e}")
        # bf16 output rounding alone is up to 2^-8 of the largest output; both sides have it
        assert e < 8e-3 and e <= e_ref * 1.5 + 2 ** -9 and _rel_err(got, ref16) < 1e-2 and e_bad > 5e-2
        assert torch.equal(layer(x, bias, act_quant=None), ref16)       # no group quantization: the dequant path
    x2 = aq(torch.randn(M, K, device="cuda", dtype=torch.bfloat16))
    want = layer(x2, bias, act_quant=aq)
    static_x = torch.zeros_like(x2)
    layer(static_x, bias, act_quant=aq)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = layer(static_x, bias, act_quant=aq)
    static_x.copy_(x2)
    g.replay()
    assert torch.equal(static_y, want)


def test_quant_gemms_in_cuda_graph():
    """Captured in a CUDA graph (the decode graphs) and replayed on new inputs: the eager result."""
    from xllm_gen.runtime.ops import quant_gemv as Q
    torch.manual_seed(0)
    N, K = 4096, 4096
    qw = Q.pack_int4(torch.randint(0, 16, (N, K), device="cuda", dtype=torch.uint8))
    s = (torch.rand(N, K // 128, device="cuda") * 0.004).to(torch.float16)
    z = torch.randint(0, 16, (N, K // 128), device="cuda", dtype=torch.uint8)
    # clamped: float8_e4m3fn has no infinity, a value past 448 casts to NaN (and NaN != NaN)
    w8 = (torch.randn(N, K, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s8 = torch.rand(N // 128, K // 128, device="cuda") * 1e-3
    x = torch.randn(4, K, device="cuda", dtype=torch.bfloat16)
    from xllm_gen.runtime.ops import quant_tinygemm as TG
    tiny = TG.pack(Q.unpack_int4(qw), s, z, 128)
    # split-K and codes: their counters zero again after every call, graph or not; tinygemm and codes (int4 only, the
    # fp8 call takes mma)
    # fma: the fp8 skinny GEMM (its int4 call takes mma)
    for kernel in ("mma", "splitk", "fma", "codes") + (("tinygemm",) if tiny is not None else ()):
        fn = lambda: (Q.int4_gemm(x, qw, s, z, 128, kernel=kernel if kernel != "fma" else "mma", tinygemm=tiny),  # noqa: E731
                      Q.fp8_gemm(x, w8, s8, (128, 128), kernel=kernel if kernel not in ("tinygemm", "codes") else "mma"))
        out = fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn()
        for _ in range(3):
            x.copy_(torch.randn(4, K, device="cuda", dtype=torch.bfloat16))
            g.replay()
            want = fn()
            assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]), kernel
    from xllm_gen.runtime.ops.quant_splitk import _LOCKS
    assert _LOCKS and all(int(b.abs().sum()) == 0 for b in _LOCKS.values())


# ---------------------------------------------------------------------------------------------- packed layers
# AWQ / GPTQ / fp8 checkpoints on CUDA keep their weights packed (runtime/layers/quant_linear.py) and run the
# weight-only GEMM for bf16 decode (and dequantize + cuBLAS for prefill chunks past GEMV_MAX_M rows). Against the
# same checkpoint dequantized at load (XLLM_PACKED_QUANT=0), bf16 on the same GPU: teacher-forced top-1 agreement
# >= 0.95 and relative logit error < 5e-2 (the kernel's fp32 accumulation order differs from cuBLAS'); decode CUDA
# graphs give the eager path's tokens (with FlashInfer).
def _quant_ckpt(tmp_path, fmt):
    from fixtures.tiny_hf import make_tiny_qwen3
    from quant_ckpt import write_awq, write_fp8_block, write_gptq
    base = make_tiny_qwen3(tmp_path / "base", hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
    if fmt == "awq":
        return write_awq(base, tmp_path / "c", tmp_path / "r", group=128)[0]
    if fmt == "gptq":
        return write_gptq(base, tmp_path / "c", tmp_path / "r", bits=4, group=64, sym=False)[0]
    return write_fp8_block(base, tmp_path / "c", tmp_path / "r", (128, 128))[0]


@pytest.mark.parametrize("fmt", ["awq", "gptq", "fp8_block"])
def test_packed_layers_cuda(tmp_path, monkeypatch, fmt):
    from xllm_gen import LLM, SamplingParams
    ckpt = _quant_ckpt(tmp_path, fmt)
    kw = dict(dtype="bfloat16", block_size=16, max_num_seqs=4, max_model_len=256, num_kv_blocks=64,
              _debug={"torch_attention": True})
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    monkeypatch.setenv("XLLM_PACKED_QUANT", "0")
    deq = LLM(str(ckpt), device="cuda", enforce_eager=True, **kw)
    seqs = [p + o.outputs[0].token_ids for p, o in zip(PROMPTS, deq.generate(prompts, sp))]
    # and one prompt past GEMV_MAX_M rows: a prefill chunk of packed fp8 layers runs the block-scaled float8 GEMM
    seqs.append([(7 * i + 3) % 400 for i in range(150)])
    want = [torch.as_tensor(deq.prefill_logits(s)).float().cpu() for s in seqs]
    deq.shutdown()
    monkeypatch.setenv("XLLM_PACKED_QUANT", "1")
    packed = LLM(str(ckpt), device="cuda", enforce_eager=True, **kw)
    lay = packed.engine.runner.model.model.layers[0]
    assert lay.mlp.down_proj.packed is not None and lay.mlp.down_proj.weight.numel() == 0
    for s, w in zip(seqs, want):
        got = torch.as_tensor(packed.prefill_logits(s)).float().cpu()
        agree = (got.argmax(-1) == w.argmax(-1)).float().mean().item()
        err = ((got - w).abs().max() / w.abs().max()).item()
        print(f"\n[{fmt} packed vs dequantized, bf16] top-1 {agree:.3f}, relative logit error {err:.2e}")
        assert err < 5e-2
        # fp8_block quantizes each layer's input per token group: a bf16 difference in the GEMM's summation order
        # can flip an fp8 code and move the logits by the error measured here; a top-1 flip is admitted only where
        # the reference's own margin between the two tokens is within that measured logit difference
        flips = (got.argmax(-1) != w.argmax(-1)).nonzero().flatten().tolist()
        abs_err = (got - w).abs().max().item()
        margins = [(w[i, w[i].argmax()] - w[i, got[i].argmax()]).item() for i in flips]
        assert all(m <= abs_err for m in margins) and (agree >= 0.95 or fmt == "fp8_block"), (agree, margins, abs_err)
    packed.shutdown()
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer not installed: graph arm not run")
    from fixtures.graph_compare import _compare, _eager
    kwg = {k: v for k, v in kw.items() if k != "_debug"}
    spl = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    llm = LLM(str(ckpt), device="cuda", cuda_graph_sizes=[1, 2, 4], **kwg)
    assert llm.engine.runner.graphs is not None
    g = llm.generate(prompts, spl)
    with _eager(llm):
        e = llm.generate(prompts, spl)
    llm.shutdown()
    _compare(e, g, f"packed_{fmt}_graph_vs_eager")


@pytest.mark.parametrize("fmt", ["fp8_block", "awq"])
def test_packed_fp8_experts_cuda(tmp_path, monkeypatch, fmt):
    """A Qwen3-MoE fp8 block checkpoint (128 x 128), or AWQ (int4, group 128), in bf16 on CUDA: the experts kept
    packed (float8, or 4-bit codes two to a byte; the grouped kernels reading them) give the dequantized experts'
    prefill logits (the kernels read each weight as bf16(value x scale) / bf16((q - zero) x scale), the dequantized
    weight's values): float8 bit for bit. AWQ: XLLM_PACKED_QUANT also moves the dense int4 layers between the int4
    GEMV kernels and dequantize + cuBLAS (other fp32 summation orders; the tensor cores also order k differently for a
    tile dequantized in registers, tests/gpu/test_gpu_moe.py), and a tiny random model grows any rounding difference
    to the size of its bf16 noise (0.109 between the two on an H100, where each is ~0.1 from float32). So each side is
    measured against the float32 model of the same dequantized weights: packed within twice the dequantized one's
    distance (a wrong code, zero or scale moves the logits by far more). Graphs equal eager."""
    from fixtures.tiny_hf import make_tiny_checkpoint
    from quant_ckpt import write_awq, write_fp8_block

    from xllm_gen import LLM, SamplingParams
    from xllm_gen.runtime.ops import fp8_block_gemm
    # the dense float8 layers stay on the GEMVs / dequantize + cuBLAS in both arms: packed, they would otherwise take
    # FlashInfer's block-scaled GEMM (its own activation quantization: close to the dequantized layer, not bit-equal;
    # test_packed_layers_cuda bounds it), and this test isolates the experts
    monkeypatch.setattr(fp8_block_gemm, "PREFILL_MODE", "dequant")
    base = make_tiny_checkpoint("Qwen3MoeForCausalLM", tmp_path / "base", overrides={
        "hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 512, "num_local_experts": 8})
    if fmt == "awq":
        ckpt = write_awq(base, tmp_path / "c", tmp_path / "r", group=128)[0]
    else:
        ckpt = write_fp8_block(base, tmp_path / "c", tmp_path / "r", (128, 128))[0]
    kw = dict(dtype="bfloat16", block_size=16, max_num_seqs=4, max_model_len=256, num_kv_blocks=64)
    logits = {}
    for packed in ("0", "1"):
        monkeypatch.setenv("XLLM_PACKED_QUANT", packed)
        llm = LLM(str(ckpt), device="cuda", enforce_eager=True, **kw)
        experts = llm.engine.runner.model.model.layers[0].mlp.experts
        assert (experts.packed is not None) == (packed == "1")
        logits[packed] = [torch.as_tensor(llm.prefill_logits(p)).float().cpu() for p in PROMPTS]
        llm.shutdown()
    if fmt == "awq":
        monkeypatch.setenv("XLLM_PACKED_QUANT", "0")
        llm = LLM(str(ckpt), device="cuda", enforce_eager=True, **{**kw, "dtype": "float32"})
        ref = [torch.as_tensor(llm.prefill_logits(p)).float().cpu() for p in PROMPTS]
        llm.shutdown()
    for i, (a, b) in enumerate(zip(logits["0"], logits["1"])):
        if fmt != "awq":
            assert torch.equal(a, b), (a - b).abs().max().item()
            continue
        err_u, err_p = (a - ref[i]).abs().max().item(), (b - ref[i]).abs().max().item()
        print(f"\nprompt {i}: vs float32: dequantized {err_u:.3e}, packed {err_p:.3e}; packed vs dequantized "
              f"{(a - b).abs().max().item():.3e}")
        assert err_p <= 2 * err_u + 1e-3, (err_p, err_u)
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer not installed: graph arm not run")
    from fixtures.graph_compare import _compare, _eager
    spl = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    llm = LLM(str(ckpt), device="cuda", cuda_graph_sizes=[1, 2, 4], **kw)
    g = llm.generate(prompts, spl)
    with _eager(llm):
        e = llm.generate(prompts, spl)
    llm.shutdown()
    _compare(e, g, "packed_fp8_experts_graph_vs_eager")


# ---------------------------------------------------------------------------------------------- FP8 KV cache
@pytest.mark.parametrize("decode_kernel", ["flashinfer", "triton"])
def test_fp8_kv_cache_cuda(tmp_path, decode_kernel):
    """kv_cache_dtype="fp8" on CUDA (FlashInfer prefill / decode with a float8 cache, or the Triton decode kernel;
    graphs on, chunked prefill so that later chunks read the cache) gives the torch attention's tokens on the same
    float8 cache (the CPU semantics: K / V rounded when written, prefill reading them back), up to bf16 near ties;
    and the rounding counts: a bf16 cache moves the logprobs."""
    from fixtures.report import report as _report
    from fixtures.tiny_hf import make_tiny_qwen3

    from xllm_gen import LLM, SamplingParams
    ckpt = make_tiny_qwen3(tmp_path / "base", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=128)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 900 + 5 for j in range(n)]} for i, n in enumerate((5, 40, 130))]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    kw = dict(dtype="bfloat16", max_num_seqs=4, max_model_len=512, num_kv_blocks=128, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    llm = LLM(str(ckpt), kv_cache_dtype="fp8", _debug={"decode_attention": decode_kernel}, **kw)
    kc = next(m.k_cache for m in llm.engine.runner.model.modules() if getattr(m, "k_cache", None) is not None
              and m.k_cache.numel())
    assert kc.dtype == torch.float8_e4m3fn and llm.engine.runner.graphs is not None
    got = llm.generate(prompts, sp)
    llm.shutdown()
    ref = LLM(str(ckpt), kv_cache_dtype="fp8", enforce_eager=True, _debug={"torch_attention": True}, **kw)
    want = ref.generate(prompts, sp)
    # the two attention implementations round differently in bf16: the logprobs of shared steps stay close, and a
    # greedy run may part from the reference only where the reference's top two logits are one bf16 step apart
    # (a tie at the lm_head's precision: the first H200 run parted at gaps of 0.0625 and 0.125, one step of a
    # logit in [8, 16) and [16, 32)); the step is computed from the reference's own logit there, not assumed
    worst, parted = 0.0, []
    for i, (p, r, t) in enumerate(zip(prompts, want, got)):
        a, b = r.outputs[0], t.outputs[0]
        n = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        for j in range(len(a.token_ids) if n is None else n):
            worst = max(worst, abs(a.logprobs[j][a.token_ids[j]].logprob - b.logprobs[j][a.token_ids[j]].logprob))
        if n is not None:
            logits = torch.as_tensor(ref.prefill_logits(p["prompt_token_ids"] + list(a.token_ids[:n]))).float()
            top = logits[-1].topk(2).values
            step = 2.0 ** (torch.floor(torch.log2(top[0].abs())).item() - 7)     # bf16: 8 significand bits
            parted.append((i, n, (top[0] - top[1]).item(), step))
    ref.shutdown()
    _report(test=f"fp8_kv_{decode_kernel}_vs_torch", max_logprob_diff=worst, parted=parted)
    assert worst < 0.1, f"fp8 KV ({decode_kernel}) logprobs differ from the torch attention's by {worst}"
    assert all(gap <= step * 1.001 for _, _, gap, step in parted), \
        f"fp8 KV ({decode_kernel}) parted from the torch attention away from a bf16 tie: {parted}"
    bf16 = LLM(str(ckpt), **kw)
    plain = bf16.generate(prompts, sp)
    bf16.shutdown()
    moved = max(abs(a.outputs[0].logprobs[j][t].logprob - b.outputs[0].logprobs[j][t].logprob)
                for a, b in zip(got, plain) for j, t in enumerate(a.outputs[0].token_ids[:4]))
    print(f"\n[fp8 KV, {decode_kernel}] logprob change against a bf16 cache (first 4 steps): {moved:.4f}")
    assert moved > 1e-3, "the float8 cache changes nothing: is it really float8?"


# ---------------------------------------------------------------------------------------------- FP8 KV cache scales
def _paged_ctx(lens, qlens, page, perm, device):
    """A step's ForwardContext over pages `perm` (each sequence's pages in turn): KV lengths `lens`, the last
    `qlens` tokens of each being the step's queries."""
    from xllm_gen.runtime.executor.context import ForwardContext
    tables, used = [], 0
    for L in lens:
        n = (L + page - 1) // page
        tables.append(perm[used: used + n])
        used += n
    width = max(len(t) for t in tables)
    cu = [0]
    for q in qlens:
        cu.append(cu[-1] + q)
    slots = [tables[i][p // page] * page + p % page for i, (L, q) in enumerate(zip(lens, qlens))
             for p in range(L - q, L)]
    return ForwardContext(is_prefill=any(q > 1 for q in qlens),
                          cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
                          seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                          slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                          block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                                    device=device),
                          block_size=page, seq_lens_cpu=list(lens), query_lens_cpu=list(qlens))


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer")
@pytest.mark.parametrize("decode_kernel", ["flashinfer", "triton"])
def test_fp8_kv_scales_kernels_cuda(decode_kernel):
    """A float8 KV cache with per-tensor scales far from 1 (K past 448, V below e4m3's subnormals without them):
    the Triton store kernel writes round(k / k_scale) bit for bit as the torch reference (on the CPU) does; then
    FlashInferBackend (FlashInfer's paged prefill and decode wrappers with run(k_scale=, v_scale=), or the Triton
    decode kernel) on that cache equals the torch attention (TorchPagedBackend: cache * scale in float32) within bf16
    rounding, and the same run without the scales is far off (the scales reach the kernels)."""
    from xllm_gen.runtime import ops
    from xllm_gen.runtime.attention.flashinfer_backend import FlashInferBackend
    from xllm_gen.runtime.attention.torch_ref import TorchPagedBackend
    from xllm_gen.runtime.ops import reference as R
    torch.manual_seed(0)
    dev, f8 = torch.device("cuda"), torch.float8_e4m3fn
    H, Hk, D, page, pool = 8, 2, 128, 16, 96
    lens = [1, 17, 130, 64, 300]
    perm = torch.randperm(pool).tolist()
    ks, vs = 2.5, 4e-6
    kc = torch.zeros(pool, page, Hk, D, dtype=f8, device=dev)
    vc = torch.zeros_like(kc)
    # the whole context written once (a prefill of every token), by the Triton store kernel and by the reference
    full = _paged_ctx(lens, lens, page, perm, dev)
    N = sum(lens)
    k = (torch.randn(N, Hk, D, device=dev) * 300).to(torch.bfloat16)
    v = (torch.randn(N, Hk, D, device=dev) * 1e-3).to(torch.bfloat16)
    ops.store_kvcache(k, v, kc, vc, full.slot_mapping, ks, vs)
    kr, vr = torch.zeros(pool, page, Hk, D, dtype=f8), torch.zeros(pool, page, Hk, D, dtype=f8)
    R.store_kvcache(k.cpu(), v.cpu(), kr, vr, full.slot_mapping.cpu(), ks, vs)
    assert torch.equal(kc.cpu().view(torch.uint8), kr.view(torch.uint8))
    assert torch.equal(vc.cpu().view(torch.uint8), vr.view(torch.uint8))
    assert (kc.float().abs().max() > 100) and (vc.float().abs().max() > 100)      # the scaled values fill fp8's range
    worst, off = {}, {}
    for name, qlens in (("decode", [1] * len(lens)), ("prefill", [1, 9, 40, 64, 7])):
        ctx = _paged_ctx(lens, qlens, page, perm, dev)
        q = torch.randn(sum(qlens), H, D, device=dev).to(torch.bfloat16) * 0.005     # scores of order 1
        kv_step = torch.zeros(sum(qlens), Hk, D, device=dev, dtype=torch.bfloat16)
        be = FlashInferBackend(num_heads=H, num_kv_heads=Hk, head_dim=D, dtype=torch.bfloat16, device=dev,
                               block_size=page, max_batch=8, max_model_len=512, max_num_blocks=pool,
                               kv_dtype=f8, sm_scale=D ** -0.5, decode_kernel=decode_kernel)
        be.plan(ctx)
        got = be.forward(q, kv_step, kv_step, kc, vc, ctx, D ** -0.5, k_scale=ks, v_scale=vs)
        unscaled = be.forward(q, kv_step, kv_step, kc, vc, ctx, D ** -0.5)
        ref = TorchPagedBackend()
        ref.plan(ctx)
        want = ref.forward(q, kv_step, kv_step, kc, vc, ctx, D ** -0.5, k_scale=ks, v_scale=vs)
        worst[name], off[name] = _rel_err(got, want), _rel_err(unscaled, want)
    print(f"\n[fp8 KV scales, {decode_kernel}] relative error vs torch: {worst}; without the scales: {off}")
    assert all(e < 2e-2 for e in worst.values()) and all(e > 0.5 for e in off.values())


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer")
@pytest.mark.parametrize("decode_kernel", ["flashinfer", "triton"])
def test_fp8_kv_cache_checkpoint_scales_cuda(tmp_path, decode_kernel):
    """A checkpoint with per-tensor k_scale / v_scale (K past fp8's range, V below it: tests/quant_ckpt.py
    write_kv_scaled) served with kv_cache_dtype="fp8" on CUDA (graphs, chunked prefill, FlashInfer or the Triton
    decode kernel) gives the torch attention's logprobs on the same scaled cache, and the bf16 model's greedy tokens
    on most steps; dropping the scales moves the logprobs far."""
    from fixtures.tiny_hf import make_tiny_qwen3
    from hf_ref import hf_model
    from quant_ckpt import calibrate_kv_scales, write_kv_scaled, write_kv_scales

    from xllm_gen import LLM, SamplingParams
    base = make_tiny_qwen3(tmp_path / "base", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=128)
    ref = write_kv_scaled(base, tmp_path / "ref")
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 900 + 5 for j in range(n)]} for i, n in enumerate((5, 40, 130))]
    scales = calibrate_kv_scales(hf_model(ref), torch.tensor([sum((p["prompt_token_ids"] for p in prompts), [])]))
    ckpt = write_kv_scales(ref, tmp_path / "ckpt", scales)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    kw = dict(dtype="bfloat16", max_num_seqs=4, max_model_len=512, num_kv_blocks=128, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    seqs = []

    def run(path, **extra):
        """(outputs, prefill logits of `seqs` (the reference's prompts + tokens), float32 on the host)."""
        llm = LLM(str(path), **{**kw, **extra})
        out = llm.generate(prompts, sp)
        if not seqs:
            seqs.extend(p["prompt_token_ids"] + list(o.outputs[0].token_ids) for p, o in zip(prompts, out))
        logits = [torch.as_tensor(llm.prefill_logits(x)).float().cpu() for x in seqs]
        llm.shutdown()
        return out, logits

    def lp_diff(a_out, b_out, ref_logits, steps=8):
        """max over each prompt's shared first steps of |logprob difference| of the token both runs chose, less one
        bfloat16 step of that token's logit (ref_logits: the reference's prefill logits of its sequences): the
        logprobs are log_softmax of bf16 logits, so two kernels whose logit rounds one step apart differ by that
        step (0.125 for a logit in [16, 32)) whatever their accuracy."""
        worst = 0.0
        for a, b, lg, p in zip(a_out, b_out, ref_logits, prompts):
            x, y = a.outputs[0], b.outputs[0]
            for j, (t, u) in enumerate(zip(x.token_ids[:steps], y.token_ids[:steps])):
                if t != u:
                    break
                step = 2.0 ** (torch.floor(torch.log2(lg[len(p["prompt_token_ids"]) - 1 + j, t].abs())).item() - 7)
                worst = max(worst, abs(x.logprobs[j][t].logprob - y.logprobs[j][t].logprob) - step)
        return worst

    def rel(a, b):
        return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))

    want, want_l = run(ckpt, kv_cache_dtype="fp8", enforce_eager=True, _debug={"torch_attention": True})
    got, got_l = run(ckpt, kv_cache_dtype="fp8", _debug={"decode_attention": decode_kernel})
    dropped, dropped_l = run(ref, kv_cache_dtype="fp8", _debug={"decode_attention": decode_kernel})
    _, bf16_l = run(ref)
    same, same_l, near_l, far_l = (lp_diff(got, want, want_l), rel(got_l, want_l), rel(bf16_l, want_l),
                                   rel(dropped_l, want_l))
    print(f"\n[fp8 KV checkpoint scales, {decode_kernel}] vs the torch attention on the same cache: logprobs "
          f"(beyond one bf16 step of the logit) {same:.4f}, prefill logits (relative) {same_l:.2e}; a bf16 cache {near_l:.2e}; scales dropped {far_l:.2e} "
          f"(tokens {'differ' if [o.outputs[0].token_ids for o in dropped] != [o.outputs[0].token_ids for o in want] else 'same'})")
    assert same < 0.1 and same_l < 0.05 and near_l < 0.2 and far_l > 0.3      # CPU bf16: near 0.08, far 1.1


def test_quant_gemv_tuning_measures_and_caches(tmp_path, monkeypatch):
    """layers/quant_tuning.py: per (form, M, N, K) a decision between the decode kernels, for the rows between
    measured counts too, written to the tuning cache and read back by a fresh process state."""
    from xllm_gen.runtime.layers import quant_tuning
    from xllm_gen.runtime.layers.linear import ReplicatedLinear
    from xllm_gen.runtime.layers.quant_linear import quantize_dummy
    from xllm_gen.runtime.ops import quant_gemv as Q
    monkeypatch.setenv("XLLM_TUNING_CACHE", str(tmp_path / "tune.json"))
    monkeypatch.setattr(Q, "QUANT_GEMV_MODE", "auto")
    monkeypatch.setattr(Q, "QUANT_GEMV_CHOICE", {})
    model = torch.nn.Sequential(ReplicatedLinear(4096, 1024), ReplicatedLinear(4096, 1024)).to("cuda", torch.bfloat16)
    for m in model:          # the layers start zeroed: a zero weight would make every kernel "agree"
        torch.nn.init.normal_(m.weight, std=0.02)
    assert quantize_dummy(model[:1], "int4") == 1 and quantize_dummy(model[1:], "fp8") == 1
    report = quant_tuning.tune_quant_gemvs(model, [1, 4, 64])
    assert {k[:2] for k in report} == {("int4", 1), ("int4", 4), ("fp8", 1), ("fp8", 4)}, report
    assert ("int4", 3, 1024, 4096, 128, torch.bfloat16) in Q.QUANT_GEMV_CHOICE
    print("\n" + "\n".join(f"{k}: mma {v[0]:.1f} us, split-K {v[1]:.1f} us -> {v[2]}" for k, v in report.items()))
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x, model[0].packed.dequantized(torch.bfloat16))
    assert _rel_err(model[0](x), ref) < 1e-2
    monkeypatch.setattr(Q, "QUANT_GEMV_CHOICE", {})
    assert quant_tuning.tune_quant_gemvs(model, [1, 4]) == {}          # read back from the cache, nothing measured
    assert len(Q.QUANT_GEMV_CHOICE) == 8


def test_fp8_act_quant_cuda_bit_exact():
    """ActQuant on CUDA (one Triton launch, runtime/ops/fp8_act_quant.py) equals its torch ops bit for bit: per
    token-group, per token, static scale, float32 and bfloat16, ties / subnormals / saturation included."""
    from test_fp8_act_quant import _inputs

    from xllm_gen.runtime.layers.quant import ActQuant
    for x in _inputs():
        x = x.cuda()
        for kind, group, scale in (("group", 128, None), ("token", 0, None), ("static", 0, 0.37)):
            q = ActQuant(kind, group, scale)
            assert torch.equal(q(x), q.reference(x)), (kind, x.dtype)


def test_fp8_act_epilogue_cuda_bit_exact():
    """The round trip as the epilogue of RMSNorm / silu / gelu and mul (ops/norm_act_kernels.py `quant`) on CUDA:
    bit for bit the op followed by the one-launch round trip, in float32 also ActQuant's torch ops; norm_linear /
    act_linear of a quantized linear take it and equal the plain ops (tests/test_fp8_act_epilogue.py's checks)."""
    from test_fp8_act_epilogue import _checks
    res = _checks("cuda")
    bad = [k for k, v in res.items() if not v]
    assert not bad and len(res) == 77, bad
