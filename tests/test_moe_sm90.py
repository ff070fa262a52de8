"""The grouped MoE kernels reading packed experts (runtime/ops/moe_triton.py: float8, and 4-bit codes two to a byte),
compiled for sm_90 without a GPU (Triton's CUDA backend and its bundled ptxas) at Qwen3-30B-A3B's shapes and the
default configs of decode (16-row blocks) and prefill (64-row blocks), each scale-read form the configs reach: they
build and ptxas assembles them. The interpreter runs what the GPU compiler rejects: a `return` under a constexpr `if`
followed by more code compiled the rest for the GPU too, and the packed kernels did not build (caught here, not by
the interpreted tests). Spills are printed, not asserted: the bf16 kernels at these configs already spill at 64-row
blocks (gate / up: 360 bytes), and the float8 ones measured 0.77-0.99x bf16 on an H200 as they are.
Skipped where this Triton has no CUDA backend or ptxas."""
from __future__ import annotations

import pytest
from fixtures.sm90 import assemble, compile_sm90, ptxas

triton = pytest.importorskip("triton")

H, I, E, TOP_K = 2048, 768, 128, 8


def _compile(kernel: str, wq: int, T: int):
    from xllm_gen.runtime.ops import moe_triton as M
    cfg = M.default_config(T, E, TOP_K, H, I)
    fn = M._moe_gate_up_kernel if kernel == "gate_up" else M._moe_down_kernel
    block_n, block_k, kdim = (cfg.block_n1, cfg.block_k1, H) if kernel == "gate_up" else (cfg.block_n2, cfg.block_k2, I)
    sig = {a: "i32" for a in fn.arg_names}
    sig.update({p: "*bf16" for p in ("x_ptr", "h_ptr", "y_ptr", "weights_ptr") if p in fn.arg_names})
    sig.update(pairs_ptr="*i64", block_expert_ptr="*i64", w_ptr="*fp8e4nv" if wq == 1 else "*u8",
               s_ptr="*fp32" if wq == 1 else "*fp16", z_ptr="*fp32" if wq == 1 else "*u8")
    const = dict(BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=block_k, PREC="tf32", WQ=wq, SBK=128,
                 SCALES=M._scale_mode(128, block_k, kdim))
    sig.update({k: "constexpr" for k in const})
    return compile_sm90(fn, sig, const, num_warps=cfg.num_warps, num_stages=cfg.num_stages), const["SCALES"]


@pytest.mark.parametrize("wq", [1, 2], ids=["float8", "int4"])
@pytest.mark.parametrize("kernel", ["gate_up", "down"])
@pytest.mark.parametrize("T", [1, 512], ids=["decode", "prefill"])
def test_packed_expert_kernels_build_for_sm90(wq, kernel, T):
    path = ptxas()
    k, mode = _compile(kernel, wq, T)
    rc, report, spill = assemble(k, path)
    print(f"\n{kernel} WQ {wq} T {T} scale form {mode}: {spill} bytes spill stores")
    assert rc == 0 and spill is not None, f"scale form {mode}: {report[-2000:]}"
