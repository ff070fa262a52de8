"""Low-precision decode GEMMs alone, at Qwen3-8B layer shapes, M = 1, 2, 4, 8, 16 rows, bf16 activations, one call:
bf16 cuBLAS (F.linear) and the bf16 Triton skinny GEMM (M <= 8) against the weight-only kernels of
runtime/ops/quant_gemv.py, each form on both decode kernels: "mma" (the tensor-core tile padded to 16 rows, the old
path) and "splitk" (ops/quant_splitk.py, the split-K GEMV on the CUDA cores, M <= 16): int4 (AWQ / GPTQ, group
128) and fp8 e4m3 (128 x 128 block scales, and per channel); and torch._scaled_mm (cuBLASLt fp8, row-wise scales,
activations quantized per token; where this torch has it).
Each timing replays a CUDA graph of 20 calls over 20 different weights (no call finds its weight in L2), median of
20 replays; GB/s counts the bytes of the weight form read (packed weights + scales + zeros). Every kernel's result
is checked against F.linear on its dequantized weight first (max relative error printed; a wrong result is marked).
A kernel or config that fails (compile, launch, memory) is reported in its row and the run goes on.

    python bench/bench_quant.py [--out bench/results/h200_quant.md] [--rows 1,2,4,8,16] [--sweep]
    python bench/bench_quant.py --e2e Qwen3-0.6B,Qwen3-8B   # + decode TPOT: bf16 vs int4 vs fp8 (dummy weights)

--sweep times the kernels' other launch configs (quant_gemv.wq_gemm_candidates, quant_splitk.splitk_candidates)
and reports the best five per shape (set the tables / SPLITK_AUTO_MAX_M from them).
--e2e VARIANTS: batch-1 and batch-16 decode TPOT of Qwen3 variants (bench/bench_decode.py's configs) with random
weights (load_format=dummy) in bf16, and quantized in place and packed (`_debug={"dummy_quantize": "int4" | "fp8"}`:
int4 round-to-nearest groups of 128 with zero points, fp8 e4m3 per channel, weights only) under each kernel choice
(XLLM_QUANT_GEMV=mma, splitk, auto: auto measures both per shape at start), each engine in its own process, with a
time limit (--e2e-timeout seconds). An MoE variant (Qwen3-30B-A3B) quantizes its experts too (fp8 / fp8_block: kept
float8, the grouped kernels reading them; int4 leaves them bf16).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (24576, 4096), "8B down": (4096, 12288)}
CALLS = 20


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()


def make_weights(N: int, K: int, group: int = 128):
    """CALLS random weights of [N, K] in each form: bf16, int4 (packed, scales, zeros), fp8 block 128, fp8 channel."""
    from xllm_gen.runtime.ops import quant_gemv as Q
    out = []
    for _ in range(CALLS):
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        codes = torch.randint(0, 16, (N, K), device="cuda", dtype=torch.uint8)
        scales = (torch.rand(N, K // group, device="cuda") * 0.004 + 0.001).to(torch.float16)
        zeros = torch.randint(0, 16, (N, K // group), device="cuda", dtype=torch.uint8)
        f8 = (torch.randn(N, K, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        sb = torch.rand(-(-N // 128), -(-K // 128), device="cuda") * 1e-3 + 1e-4
        sc = torch.rand(N, 1, device="cuda") * 1e-3 + 1e-4
        out.append(dict(bf16=w, int4=(Q.pack_int4(codes), scales, zeros), fp8b=(f8, sb), fp8c=(f8, sc),
                        tinygemm=_tinygemm_pack(codes, scales, zeros, group)))
    return out


def _tinygemm_pack(codes, scales, zeros, group):
    """The same int4 weight in tinygemm's layout (torch.ops.aten._weight_int4pack_mm), built on first use:
    w = (q - 8) * s + z_f, so an AWQ / GPTQ zero point z becomes z_f = (8 - z) * s."""
    cache = []

    def get():
        if not cache:
            u8 = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(u8.contiguous(), 8)
            s = scales.to(torch.bfloat16)
            zf = ((8 - zeros.float()) * scales.float()).to(torch.bfloat16)
            sz = torch.stack([s, zf], dim=-1).transpose(0, 1).contiguous()       # [K / group, N, 2]
            cache.extend([packed, sz])
        return cache
    return get


def kernels(x, M: int, group: int = 128):
    """name -> fn(weights, config=None) -> y. Each weight-only form runs on both decode kernels of
    runtime/ops/quant_gemv.py: "mma" (the tensor-core tile, the old path) and "splitk" (ops/quant_splitk.py, the
    split-K GEMV on the CUDA cores, up to its SPLITK_MAX_M rows)."""
    from xllm_gen.runtime.ops import quant_gemv as Q
    from xllm_gen.runtime.ops import triton_kernels as T
    ks = {"bf16 cuBLAS": lambda d: F.linear(x, d["bf16"])}
    if M <= T.SKINNY_MAX_M:
        ks["bf16 skinny"] = lambda d: T.skinny_gemm(x, d["bf16"])
    kinds = ("mma", "splitk") if M <= Q.SPLITK_MAX_M else ("mma",)
    for k in kinds:
        ks[f"int4 g128 {k}"] = lambda d, cfg=None, k=k: Q.int4_gemm(x, *d["int4"], group, config=cfg, kernel=k)
        ks[f"fp8 block128 {k}"] = lambda d, cfg=None, k=k: Q.fp8_gemm(x, *d["fp8b"], (128, 128), config=cfg, kernel=k)
        ks[f"fp8 channel {k}"] = lambda d, cfg=None, k=k: Q.fp8_gemm(x, d["fp8c"][0], d["fp8c"][1], (1, x.shape[1]),
                                                                      config=cfg, kernel=k)
    if M <= T.SKINNY_MAX_M:     # the skinny GEMM streaming the float8 weight (ops/skinny_fma.py fp8_skinny_gemm)
        ks["fp8 block128 fma"] = lambda d, cfg=None: Q.fp8_gemm(x, *d["fp8b"], (128, 128), config=cfg, kernel="fma")
        ks["fp8 channel fma"] = lambda d, cfg=None: Q.fp8_gemm(x, d["fp8c"][0], d["fp8c"][1], (1, x.shape[1]),
                                                               config=cfg, kernel="fma")
    from xllm_gen.runtime.ops import quant_int4_codes as C
    if C.fits(M, x.shape[1], group, x.dtype):       # the tensor cores over the raw codes (ops/quant_int4_codes.py)
        ks["int4 g128 codes"] = lambda d, cfg=None: C.int4_codes_gemm(x, *d["int4"], group, config=cfg)
    if hasattr(torch.ops.aten, "_weight_int4pack_mm"):      # tinygemm (gpt-fast / torchao's int4 weight-only)
        ks["int4 g128 tinygemm"] = lambda d: torch.ops.aten._weight_int4pack_mm(x, d["tinygemm"]()[0], group,
                                                                                 d["tinygemm"]()[1])
    try:    # FlashInfer's DeepGEMM fp8 block GEMM for Hopper: bf16 input quantized inside, per token and 128 columns
        from flashinfer.gemm import fp8_blockscale_gemm_sm90
        ks["fp8 block128 flashinfer deepgemm (act quant)"] = lambda d: fp8_blockscale_gemm_sm90(x, d["fp8b"][0], None,
                                                                                            d["fp8b"][1])
    except ImportError:
        pass
    if hasattr(torch, "_scaled_mm"):
        def scaled_mm(d):
            xs = (x.float().abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
            xq = (x.float() / xs).to(torch.float8_e4m3fn)
            w, s = d["fp8c"]
            return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s.t().contiguous(), out_dtype=torch.bfloat16)
        ks["fp8 _scaled_mm rowwise"] = scaled_mm
    return ks


def candidates(name: str, M: int, N: int, K: int) -> list:
    """The launch configs --sweep times for a weight-only kernel."""
    from xllm_gen.runtime.ops import quant_gemv as Q
    from xllm_gen.runtime.ops import quant_splitk as S
    from xllm_gen.runtime.ops import triton_kernels as T
    int4 = name.startswith("int4")
    s_cols = 128 if (int4 or "block" in name) else K
    if name.endswith("fma"):
        return [T.skinny_gemm_config(M, N, K, 1)], T.skinny_gemm_candidates(M, N, K, 1) + [
            (bn, bk, w, 1) for bn in (1, 2, 4) for bk in (512, 1024, 2048) for w in (2, 4, 8)]
    if name.endswith("codes"):
        from xllm_gen.runtime.ops import quant_int4_codes as C
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        return [C.codes_config(M, N, K, 128, sms)], C.codes_candidates(M, N, K, 128, sms)
    if name.endswith("splitk"):
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        return [S.splitk_config(M, N, K, int4, s_cols, sms)], S.splitk_candidates(M, N, K, int4, s_cols, sms)
    return [Q.wq_gemm_config(M, N, K, int4, s_cols)], Q.wq_gemm_candidates(M, N, K, int4, s_cols)


def ref_of(name: str, x, d, group: int = 128):
    from xllm_gen.runtime.ops import quant_gemv as Q
    if name.startswith("int4"):
        return F.linear(x, Q.dequant_int4(*d["int4"], group, x.dtype))
    if name.startswith("fp8 block"):
        return F.linear(x, Q.dequant_fp8(*d["fp8b"], (128, 128), x.dtype))
    if name.startswith("fp8"):
        return F.linear(x, Q.dequant_fp8(d["fp8c"][0], d["fp8c"][1], (1, x.shape[1]), x.dtype))
    return F.linear(x, d["bf16"])


def weight_bytes(name: str, N: int, K: int, group: int = 128) -> int:
    if name.startswith("int4"):
        return N * K // 2 + 3 * N * K // group
    if name.startswith("fp8 block"):
        return N * K + 4 * -(-N // 128) * -(-K // 128)
    if name.startswith("fp8"):
        return N * K + 4 * N
    return 2 * N * K


def bench_gemms(args) -> list:
    from xllm_gen.runtime.layers.linear import graph_time_ms
    torch.manual_seed(0)
    rows = [int(m) for m in args.rows.split(",")]
    res = []
    for shape, (N, K) in SHAPES.items():
        ws = make_weights(N, K)
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            base_us = None
            for name, fn in kernels(x, M).items():
                if args.only and name != "bf16 cuBLAS" and not any(o in name for o in args.only.split(",")):
                    continue
                row = dict(shape=shape, N=N, K=K, M=M, kernel=name)
                try:
                    err = _rel(fn(ws[0]), ref_of(name, x, ws[0]))
                    us = graph_time_ms(lambda: [fn(d) for d in ws], reps=20) / CALLS * 1e3
                except Exception as e:   # noqa: BLE001 - report and go on with the other kernels
                    row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
                    print(json.dumps(row), flush=True)
                    res.append(row)
                    continue
                base_us = us if name == "bf16 cuBLAS" else base_us
                row.update(us=round(us, 2), gbs=round(weight_bytes(name, N, K) / us / 1e3, 1),
                           vs_bf16_cublas=round(us / base_us, 3) if base_us else None, rel_err=err,
                           ok=err < (0.05 if "_scaled_mm" in name or "act quant" in name else 0.01))
                if args.sweep and name.endswith(tuple(args.sweep_kernels.split(","))):
                    table, cands = candidates(name, M, N, K)
                    if args.configs:        # the configs given, for a short sweep (kept only where they fit)
                        cands = [tuple(c) for c in json.loads(args.configs)]
                    timed = []
                    for cfg in cands:
                        try:
                            t = graph_time_ms(lambda: [fn(d, cfg) for d in ws], reps=10) / CALLS * 1e3
                            timed.append((round(t, 2), cfg))
                        except Exception as e:  # noqa: BLE001 - a config that does not compile / fit
                            timed.append((float("inf"), f"{cfg}: {type(e).__name__}"))
                    row["table"] = table[0]
                    row["best"] = sorted(timed, key=lambda t: t[0])[:5]
                print(json.dumps(row), flush=True)
                res.append(row)
        ws = None
        torch.cuda.empty_cache()
    return res


E2E_CHILD = r"""
import json, sys, time, torch
from xllm_gen import LLM, SamplingParams
model, quant, batch, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
debug = {} if quant == "bf16" else {"dummy_quantize": quant}
llm = LLM(model, dtype="bfloat16", load_format="dummy", max_model_len=1024, max_num_seqs=max(batch, 16),
          num_kv_blocks=2048, block_size=16, enable_prefix_caching=False, _debug=debug)
try:
    packed = sum(1 for m in llm.engine.runner.model.modules() if getattr(m, "packed", None) is not None)
except AttributeError:       # the engine runs the model elsewhere (another process)
    packed = -1
prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(32)]} for i in range(batch)]
def run(k):
    torch.cuda.synchronize(); t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True))
    torch.cuda.synchronize(); return time.perf_counter() - t
run(8)
tpot = sorted((run(n + 1) - run(1)) / n * 1e3 for _ in range(3))[1]
from xllm_gen.runtime.ops import quant_gemv as Q
splitk = sorted({k[1:] for k, v in Q.QUANT_GEMV_CHOICE.items() if v != "mma" and k[1] == batch})
print("E2E " + json.dumps(dict(quant=quant, batch=batch, tpot_ms=round(tpot, 3), packed_layers=packed,
                               splitk_shapes=len(splitk))), flush=True)
if len(sys.argv) > 5 and sys.argv[5] == "profile":   # where the step's GPU time goes (bench_decode.profile_decode)
    sys.path.insert(0, sys.argv[6])
    from bench_decode import profile_decode
    p = profile_decode(llm, batch, 32, steps=20, top=24)
    print("PROFILE " + json.dumps(dict(gpu_replay_ms=p.get("gpu_replay_ms"), kernels=p.get("kernels"))), flush=True)
"""


E2E_KERNELS = ("mma", "splitk", "fma", "auto")     # XLLM_QUANT_GEMV for the packed layers' decode GEMMs


def bench_e2e(args) -> list:
    """Decode TPOT (median of 3: (time of n + 1 tokens - time of 1) / n) of Qwen3 shapes with random weights, bf16
    and quantized in place (runtime/layers/quant_linear.quantize_dummy: int4 RTN groups of 128, fp8 per channel,
    weights only; fp8_block: a scale per 128 x 128 block and the inputs quantized per token and 128 columns, as the
    official *-FP8 releases), each engine in its own process under a time limit."""
    import tempfile
    sys.path.insert(0, str(REPO / "bench"))
    import bench_moe
    from bench_decode import write_config
    root = Path(tempfile.mkdtemp(prefix="bench_quant_"))
    res = []
    for name in args.e2e.split(","):
        moe = "-A" in name                          # Qwen3-30B-A3B: specs/qwen3_moe.yaml's variant (experts float8)
        d = bench_moe.write_config(root, name) if moe else write_config(root, name)
        for batch in [int(b) for b in args.e2e_batches.split(",")]:
            kernels = args.e2e_kernels.split(",")
            quants = args.e2e_quants.split(",")
            for quant, kernel in [("bf16", "")] + [(q, k) for q in quants for k in kernels]:
                row = dict(model=name, quant=quant, kernel=kernel, batch=batch)
                cmd = [sys.executable, "-c", E2E_CHILD, str(d), quant, str(batch), "64"]
                if args.e2e_profile:
                    cmd += ["profile", str(REPO / "bench")]
                env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
                if kernel:
                    env["XLLM_QUANT_GEMV"] = kernel
                t0 = time.time()
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.e2e_timeout, env=env)
                    line = [ln for ln in p.stdout.splitlines() if ln.startswith("E2E ")]
                    if line:
                        row.update(json.loads(line[-1][4:]))
                    prof = [ln for ln in p.stdout.splitlines() if ln.startswith("PROFILE ")]
                    if prof:
                        row["profile"] = json.loads(prof[-1][8:])
                    else:
                        row["error"] = (p.stderr.strip().splitlines() or ["no output"])[-1][:300]
                except subprocess.TimeoutExpired:
                    row["error"] = f"timed out after {args.e2e_timeout} s"
                except Exception as e:  # noqa: BLE001 - report and go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                row["wall_s"] = round(time.time() - t0, 1)
                print(json.dumps(row), flush=True)
                res.append(row)
    base = {(r["model"], r["batch"]): r.get("tpot_ms") for r in res if r["quant"] == "bf16"}
    for r in res:
        if r.get("tpot_ms") and base.get((r["model"], r["batch"])):
            r["vs_bf16"] = round(r["tpot_ms"] / base[(r["model"], r["batch"])], 3)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "h200_quant.md"))
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--configs", default="", help="JSON list of launch configs --sweep times instead of the candidates")
    ap.add_argument("--sweep-kernels", default="mma,splitk,fma,codes", help="kernels --sweep times the configs of")
    ap.add_argument("--only", default="", help="kernels whose name holds one of these (comma list; bf16 cuBLAS kept)")
    ap.add_argument("--no-gemm", action="store_true", help="skip the GEMM table (e.g. only --e2e)")
    ap.add_argument("--e2e", default="", help="Qwen3 variants for the decode-TPOT arm, e.g. Qwen3-0.6B,Qwen3-8B, "
                                                  "Qwen3-30B-A3B (random weights: load_format=dummy)")
    ap.add_argument("--e2e-timeout", type=int, default=600)
    ap.add_argument("--e2e-kernels", default=",".join(E2E_KERNELS), help="XLLM_QUANT_GEMV values to run, e.g. auto")
    ap.add_argument("--e2e-batches", default="1,16")
    ap.add_argument("--e2e-profile", action="store_true", help="also the top kernels of one graph decode step")
    ap.add_argument("--e2e-quants", default="int4,fp8", help="quantized forms of the decode-TPOT arm (comma list of int4, "
                    "fp8 (per channel), fp8_block (128 x 128 blocks))")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_quant needs a CUDA GPU", file=sys.stderr)
        return 2
    res = [] if args.no_gemm else bench_gemms(args)
    e2e = bench_e2e(args) if args.e2e else []
    L = ["# Low-precision decode GEMMs (weight-only int4 / fp8 Triton kernels) vs bf16\n",
         f"command: `python bench/bench_quant.py {' '.join(argv or sys.argv[1:])}`\n",
         f"torch {torch.__version__}, {torch.cuda.get_device_name()}; CUDA graph of {CALLS} calls over {CALLS} "
         "weights, median of 20 replays; GB/s of the weight form's bytes (packed + scales + zeros)\n",
         "| shape | N | K | M | kernel | us | GB/s | time / bf16 cuBLAS | rel. error | best configs (us) |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res:
        if "error" in r:
            L.append(f"| {r['shape']} | {r['N']} | {r['K']} | {r['M']} | {r['kernel']} | failed: {r['error']} |||||")
            continue
        best = "; ".join(f"{t} {c}" for t, c in r.get("best", []))
        L.append(f"| {r['shape']} | {r['N']} | {r['K']} | {r['M']} | {r['kernel']} | {r['us']:.1f} | {r['gbs']:.0f} | "
                 f"{r['vs_bf16_cublas']} | {r['rel_err']:.1e}{'' if r['ok'] else ' WRONG'} | {best} |")
    if e2e:
        L += ["", "## Decode TPOT (load_format=dummy, quantized in place)", "",
              "| model | weights | XLLM_QUANT_GEMV | batch | TPOT ms | / bf16 | packed layers | split-K shapes |",
              "|---|---|---|---|---|---|---|---|"]
        for r in e2e:
            L.append(f"| {r['model']} | {r['quant']} | {r.get('kernel', '')} | {r['batch']} | "
                     f"{r.get('tpot_ms', r.get('error'))} | {r.get('vs_bf16', '')} | {r.get('packed_layers', '')} | "
                     f"{r.get('splitk_shapes', '')} |")
        for r in e2e:
            if r.get("profile"):
                L += ["", f"### Top kernels of one decode step: {r['model']} {r['quant']} {r.get('kernel', '')} batch "
                      f"{r['batch']} (graph replay {r['profile'].get('gpu_replay_ms')} ms)", "",
                      "| kernel | calls | ms |", "|---|---|---|"]
                L += [f"| {k} | {c} | {ms:.4f} |" for k, c, ms in r["profile"].get("kernels") or []]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(L) + "\n")
    out.with_suffix(".json").write_text(json.dumps(dict(gemm=res, e2e=e2e), indent=1))
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
