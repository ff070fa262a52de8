"""Mixture-of-experts decode benchmark: TPOT of the generated Qwen3-MoE runner (random bf16 weights of
Qwen3-30B-A3B's shapes, from specs/qwen3_moe.yaml) at batch 1 / 16 / 64, eager and CUDA-graph decode, beside
the floor of the bytes a decode step actually reads (the active experts only) and transformers in the same run;
plus a kernel table (Triton fused MoE vs the torch reference at one layer's shapes).

    python bench/bench_moe.py --out bench/results/h200_moe.md                 # one GPU
    python bench/bench_moe.py --tp 2 --out bench/results/h200x2_moe.md        # TP 2 (nvidia-h200-x2)

Floor: a decode step of B tokens reads every non-expert parameter once and, per MoE layer, the experts its
B * top_k (token, slot) pairs pick; with the random router those are ~uniform, so the expected number of
distinct experts per layer is E * (1 - (1 - K/E)^B). Floor = bytes / device copy bandwidth (bench_decode).
Timing as in bench_decode.py (its step driver and medians). At TP N the floor and bytes are per rank.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as BD  # noqa: E402  (the shared step driver, bandwidth and HF baseline)

VARIANT = "Qwen3-30B-A3B"
BATCHES = [1, 16, 64]


def moe_variant(name: str = VARIANT) -> dict:
    import yaml
    spec = yaml.safe_load((REPO / "specs" / "qwen3_moe.yaml").read_text())
    return dict(spec["variants"][name])


def write_config(root: Path, name: str = VARIANT) -> Path:
    v = moe_variant(name)
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
           "attention_bias": False, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "bos_token_id": 151643,
           "use_cache": True, "decoder_sparse_step": 1, "mlp_only_layers": [], **v}
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta", 1000000.0)}
    if isinstance(cfg.get("eos_token_id"), list) and len(cfg["eos_token_id"]) == 1:
        cfg["eos_token_id"] = cfg["eos_token_id"][0]
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


def expected_distinct_experts(E: int, K: int, B: int) -> float:
    """Expected distinct experts hit by B tokens choosing K of E experts each, uniformly without replacement."""
    return E * (1.0 - (1.0 - K / E) ** B)


def step_bytes(model: torch.nn.Module, B: int) -> dict:
    """Bytes one decode step of B tokens reads on this rank: non-expert parameters + the expected active experts."""
    from xllm_gen.runtime.layers.moe import FusedMoE

    expert_params = set()
    active = 0.0
    for m in model.modules():
        if isinstance(m, FusedMoE):
            per_expert = sum(p[0].numel() * p.element_size() for p in (m.gate_up_proj, m.down_proj))
            expert_params.update(id(p) for p in (m.gate_up_proj, m.down_proj))
            local = expected_distinct_experts(m.num_experts, m.top_k, B) * m.num_local_experts / m.num_experts
            active += local * per_expert
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_params)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(dense=dense, active_experts=active, step=dense + active, all_params=total)


def make_llm(model_dir: Path, tp: int, max_num_seqs: int, max_model_len: int, num_kv_blocks: int):
    from xllm_gen import LLM
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), dtype="bfloat16", load_format="dummy", max_num_seqs=max_num_seqs,
              max_model_len=max_model_len, num_kv_blocks=num_kv_blocks, tensor_parallel_size=tp)
    torch.cuda.synchronize()
    return llm, time.perf_counter() - t0


def kernel_table(log, tokens=(1, 16, 64, 512), tp: int = 1) -> list:
    """One MoE layer of the variant's shapes (experts split over `tp` by intermediate rows): Triton fused MoE
    vs the torch reference, CUDA-event medians."""
    import torch.nn.functional as F

    from xllm_gen.runtime.ops.moe import fused_moe_reference, topk_softmax
    from xllm_gen.runtime.ops.moe_triton import fused_moe_silu

    v = moe_variant()
    H, I, E, K = v["hidden_size"], v["moe_intermediate_size"] // tp, v["num_experts"], v["num_experts_per_tok"]
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) / I ** 0.5

    def act(h):
        return F.silu(h[..., :I]) * h[..., I:]

    rows = []
    for T in tokens:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        w, ids = topk_softmax(torch.randn(T, E, device="cuda", dtype=torch.bfloat16), K, True)
        row = dict(tokens=T, experts_hit=int(ids.unique().numel()))
        row["bytes"] = row["experts_hit"] * (w13[0].numel() + w2[0].numel()) * 2
        for name, fn in (("triton", lambda: fused_moe_silu(x, w13, w2, w, ids)),
                         ("torch_ref", lambda: fused_moe_reference(x, w13, w2, w, ids, act))):
            try:
                fn()                                  # warm-up (Triton compiles on the first call)
                row[name + "_ms"] = BD._ev_ms(fn, 20)
            except Exception as e:   # noqa: BLE001  (keep the other results)
                row[name + "_ms"] = None
                row[name + "_error"] = f"{type(e).__name__}: {e}"
        log(f"kernel T={T}: {row}")
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "h200_moe.md"))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--batch-sizes", default=",".join(map(str, BATCHES)))
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--sections", default="kernel,engine,hf", help="comma list of kernel, engine, hf")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe needs a CUDA GPU", file=sys.stderr)
        return 2
    sections = set(args.sections.split(","))
    batches = [int(b) for b in args.batch_sizes.split(",")]
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)

    import tempfile
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_moe_"))
    model_dir = write_config(root)
    R: dict = dict(versions=BD.versions(), variant=VARIANT, tp=args.tp, input_len=args.input_len,
                   output_len=args.output_len)
    bw = BD.copy_bandwidth()
    R["copy_bandwidth_GBs"] = bw / 1e9
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    if "kernel" in sections:
        R["kernel"] = kernel_table(log, tp=args.tp)
    if "engine" in sections:
        blocks = max(batches) * math.ceil((args.input_len + args.output_len) / 16) + 64
        llm, load_s = make_llm(model_dir, args.tp, max(batches), args.input_len + args.output_len + 16, blocks)
        R["load_and_capture_s"] = load_s
        model = llm.engine.runner.model
        rows, saved = [], {}
        for B in batches:
            b = step_bytes(model, B)
            row = dict(batch=B, **{k + "_bytes": v for k, v in b.items()}, floor_ms=b["step"] / bw * 1e3)
            for mode in ("graph", "eager"):
                BD.set_mode(llm, mode, saved)
                try:
                    row[mode] = BD.bench_batch(llm, B, args.input_len, args.output_len,
                                               1 if mode == "eager" else BD.runs_for(B), seed=B)
                except Exception as e:   # noqa: BLE001
                    row[mode] = dict(error=f"{type(e).__name__}: {e}")
                log(f"B={B} {mode}: {row[mode]}  (floor {row['floor_ms']:.3f} ms)")
            BD.set_mode(llm, "graph", saved)
            rows.append(row)
        R["engine"] = rows
        del llm, model
        BD.free_cuda()
    if "hf" in sections and args.tp == 1:
        try:
            R["hf"] = BD.hf_baseline(model_dir, args.input_len, args.output_len, log)
        except Exception as e:   # noqa: BLE001
            R["hf"] = dict(error=f"{type(e).__name__}: {e}")
    lines.append(f"# Qwen3-MoE decode ({VARIANT}, random bf16 weights, TP {args.tp})\n")
    lines.append(f"versions: {R['versions']}; copy bandwidth {R['copy_bandwidth_GBs']:.0f} GB/s; input "
                 f"{args.input_len}, output {args.output_len}\n")
    if "engine" in R:
        lines.append("| batch | floor (active experts) ms | graph TPOT ms | eager TPOT ms | step bytes (GB) | all params (GB) |")
        lines.append("|---:|---:|---:|---:|---:|---:|")
        for r in R["engine"]:
            lines.append(f"| {r['batch']} | {r['floor_ms']:.3f} | {BD.fmt(r['graph'].get('tpot_ms'))} | "
                         f"{BD.fmt(r['eager'].get('tpot_ms'))} | {r['step_bytes'] / 1e9:.2f} | "
                         f"{r['all_params_bytes'] / 1e9:.2f} |")
    if "hf" in R:
        lines.append(f"\ntransformers (batch 1): {json.dumps(R['hf'])}\n")
    if "kernel" in R:
        lines.append("\n| tokens | experts hit | expert bytes (MB) | Triton ms | torch reference ms |")
        lines.append("|---:|---:|---:|---:|---:|")
        for r in R["kernel"]:
            lines.append(f"| {r['tokens']} | {r['experts_hit']} | {r['bytes'] / 1e6:.1f} | "
                         f"{BD.fmt(r['triton_ms'])} | {BD.fmt(r['torch_ref_ms'])} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(R, indent=1, default=str))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
