"""The split-K GEMV (runtime/ops/quant_splitk.py) compiled for sm_90 without a GPU (Triton's CUDA backend and its
bundled ptxas): the loop keeps the weight tile's layout (no layout conversion, which goes through shared memory, in
the K loop: a 3-D broadcast form did that every tile) and ptxas spills no register, at the launch table's tiles for
int4 and fp8, M = 1 and 4. Skipped where this Triton has no CUDA backend or ptxas."""
from __future__ import annotations

import re

import pytest
from fixtures.sm90 import assemble, compile_sm90, ptxas

triton = pytest.importorskip("triton")


def _compile(int4: bool, bm: int, bn: int, bk: int, chunk: int, split: int, warps: int):
    from xllm_gen.runtime.ops import quant_splitk as S
    fn = S._splitk_gemv_kernel
    sig = {a: "i32" for a in fn.arg_names}
    sig.update(x_ptr="*bf16", q_ptr="*i32" if int4 else "*fp8e4nv", s_ptr="*fp16" if int4 else "*fp32",
               z_ptr="*u8" if int4 else "*fp32", b_ptr="*bf16", y_ptr="*bf16", part_ptr="*fp32", lock_ptr="*i32")
    const = dict(INT4=int4, HAS_BIAS=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CHUNK=chunk, SPLIT_K=split,
                 SCALE_PER_CHUNK=True, SERIAL=True, EVEN_K=True)
    sig.update({k: "constexpr" for k in const})
    aligned = ["x_ptr", "q_ptr", "s_ptr", "z_ptr", "b_ptr", "y_ptr", "part_ptr", "lock_ptr", "N", "KW", "stride_xm",
               "stride_qn", "stride_sn", "stride_zn", "stride_ym", "S_COLS"]     # what the JIT specializes on
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    return compile_sm90(fn, sig, const, attrs, num_warps=warps, num_stages=2)


@pytest.mark.slow
@pytest.mark.parametrize("int4,M", [(True, 1), (True, 4), (False, 1), (False, 4)])
def test_splitk_loop_keeps_its_layout_and_registers_on_sm90(int4, M):
    from xllm_gen.runtime.ops import quant_splitk as S
    path = ptxas()
    N, K = 6144, 4096
    bn, bk, chunk, warps = S.splitk_config(M, N, K, int4, 128)
    bk = max(bk, M)
    k = _compile(int4, M, bn, bk, max(chunk, bk), (K // 8 if int4 else K) // max(chunk, bk), warps)
    ttgir = k.asm["ttgir"]
    loop = ttgir[ttgir.index("scf.for"):]
    loop = loop[:loop.index("scf.yield")]
    assert "convert_layout" not in loop and "local_alloc" not in loop, "layout conversion in the K loop"
    rc, report, spill = assemble(k, path)
    regs = re.search(r"Used (\d+) registers", report)
    print(f"\n{'int4' if int4 else 'fp8'} M {M} ({bn}, {bk}, {chunk}, {warps}): {regs.group(0) if regs else report}")
    assert rc == 0 and spill == 0, report[-2000:]


def test_fp8_skinny_gemm_compiles_for_sm90_without_spills():
    """The fp8 skinny GEMM (ops/skinny_fma.py, SCALED) at its default launch config for one row, compiled for sm_90
    without a GPU: it builds, and ptxas spills no register."""
    from xllm_gen.runtime.ops import skinny_fma as F
    path = ptxas()
    fn = F._skinny_gemm_kernel
    sig = {a: "i32" for a in fn.arg_names}
    sig.update(x_ptr="*bf16", w_ptr="*fp8e4nv", b_ptr="*bf16", y_ptr="*bf16", s_ptr="*fp32")
    bn, bk, warps, stages = F.skinny_gemm_candidates(1, 6144, 4096, 1)[0]
    const = dict(M=1, HAS_BIAS=False, BLOCK_N=bn, BLOCK_K=bk, VEC=16, EVEN_K=True, NUM_STAGES=stages, PDL=0, KP=1,
                 LINE=64, SCALED=True)
    sig.update({k: "constexpr" for k in const})
    k = compile_sm90(fn, sig, const, num_warps=warps, num_stages=stages)
    rc, report, spill = assemble(k, path)
    assert rc == 0 and spill == 0, report[-2000:]
