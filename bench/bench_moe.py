"""Mixture-of-experts decode benchmark: TPOT of the generated Qwen3-MoE runner (random bf16 weights of
Qwen3-30B-A3B's shapes, from specs/qwen3_moe.yaml) at batch 1 / 16 / 64, eager and CUDA-graph decode, beside
the floor of the bytes a decode step actually reads (the active experts only) and transformers in the same run;
plus a kernel table (Triton fused MoE with bf16 and with float8 experts (128 x 128 block scales, as the FP8
releases) vs the torch reference at one layer's shapes, GPU time inside CUDA graphs)
and a sweep of the fused MoE's tile configs per number of tokens (the JSON's "kernel_sweep": the data for
ops/moe_triton.py default_config). The report (.md + .json) is rewritten after every section.

    python bench/bench_moe.py --out bench/results/h200_moe.md                 # one GPU
    python bench/bench_moe.py --sections kernel,sweep --out /tmp/moe_k.md     # the kernel sections only (~1 min)
    python bench/bench_moe.py --tp 2 --out bench/results/h200x2_moe.md        # TP 2 (nvidia-h200-x2)

transformers runs eager only (its static cache + torch.compile takes minutes for this model: --hf-compile).

Floor: a decode step of B tokens reads every non-expert parameter once and, per MoE layer, the experts its
B * top_k (token, slot) pairs pick; with the random router those are ~uniform, so the expected number of
distinct experts per layer is E * (1 - (1 - K/E)^B). Floor = bytes / device copy bandwidth (bench_decode).
Timing as in bench_decode.py (its step driver and medians). At TP N the floor and bytes are per rank.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as BD  # noqa: E402  (the shared step driver, bandwidth and HF baseline)

VARIANT = "Qwen3-30B-A3B"
BATCHES = [1, 16, 64]
TOKENS = (1, 16, 64, 512)


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


# ------------------------------------------------------------------------------------------------ kernels
def graph_ms(fn, inner: int = 10, reps: int = 20) -> float:
    """GPU time of one fn() call with static inputs, host launch overhead excluded: `inner` calls captured in one
    CUDA graph (after two warm-up calls on a side stream: Triton compiles there), the graph replayed `reps` times
    back to back, each replay between two CUDA events; median / inner (ms)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    ms = statistics.median(a.elapsed_time(b) for a, b in ev) / inner
    del g
    return ms


class Layer:
    """One MoE layer of the variant's shapes (experts split over `tp` by intermediate rows), random bf16 weights,
    and seeded inputs for T tokens (the same routing for the kernel table and the sweep)."""

    def __init__(self, tp: int = 1):
        v = moe_variant()
        self.H, self.I = v["hidden_size"], v["moe_intermediate_size"] // tp
        self.E, self.K = v["num_experts"], v["num_experts_per_tok"]
        g = torch.Generator(device="cuda").manual_seed(0)
        self.w13 = torch.randn(self.E, 2 * self.I, self.H, device="cuda", dtype=torch.bfloat16, generator=g)
        self.w13 /= self.H ** 0.5
        self.w2 = torch.randn(self.E, self.H, self.I, device="cuda", dtype=torch.bfloat16, generator=g)
        self.w2 /= self.I ** 0.5
        # the same experts as an FP8 release holds them (e4m3, a scale per 128 x 128 block, kept per row and 128
        # columns: runtime/loading/quant_load.py _pack_experts)
        self.fp8 = [self._fp8(w) for w in (self.w13, self.w2)]
        # and as an AWQ / GPTQ release (4-bit codes, a zero and a scale per row and 128 columns; kept two codes to
        # a byte: ops/moe.py pack_int4_experts)
        self.int4 = [self._int4(w) for w in (self.w13, self.w2)]

    @staticmethod
    def _fp8(w: torch.Tensor, b: int = 128):
        E, N, K = w.shape
        pad = torch.nn.functional.pad(w.float(), (0, (-K) % b, 0, (-N) % b))
        s = (pad.abs().reshape(E, pad.shape[1] // b, b, pad.shape[2] // b, b).amax((2, 4)) / 448.0).clamp(min=1e-12)
        s = s.repeat_interleave(b, 1)[:, :N]                                    # [E, N, ceil(K / b)]
        q = (w.float() / s.repeat_interleave(b, 2)[..., :K]).clamp(-448, 448).to(torch.float8_e4m3fn)
        return q, s.contiguous(), b

    @staticmethod
    def _int4(w: torch.Tensor, g: int = 128):
        from xllm_gen.runtime.layers.quant_linear import rtn_int4
        from xllm_gen.runtime.ops.moe import pack_nibbles
        q, s, z = (torch.stack(t) for t in zip(*(rtn_int4(w[e], g) for e in range(w.shape[0]))))
        return pack_nibbles(q), s, g, z

    def experts(self, form: str) -> tuple:
        """(w13, w2, fused_moe_silu's scales keywords) of the experts in `form`: bf16, or kept packed as fp8 / int4."""
        if form == "bf16":
            return self.w13, self.w2, {}
        p13, p2 = {"fp8": self.fp8, "int4": self.int4}[form]
        return p13[0], p2[0], dict(scales13=tuple(p13[1:]), scales2=tuple(p2[1:]))

    def logits(self, T: int) -> torch.Tensor:
        g = torch.Generator(device=self.w13.device).manual_seed(2000 + T)
        return torch.randn(T, self.E, device=self.w13.device, dtype=self.w13.dtype, generator=g)

    def inputs(self, T: int):
        from xllm_gen.runtime.ops.moe import topk_softmax
        dev, dt = self.w13.device, self.w13.dtype
        g = torch.Generator(device=dev).manual_seed(1000 + T)
        x = torch.randn(T, self.H, device=dev, dtype=dt, generator=g)
        w, ids = topk_softmax(self.logits(T), self.K, True)
        hit = int(ids.unique().numel())
        return x, w, ids, hit, hit * (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()

    def act(self, h):
        import torch.nn.functional as F
        return F.silu(h[..., :self.I]) * h[..., self.I:]


def kernel_table(log, layer: Layer, tokens=TOKENS) -> list:
    """Per T: the Triton fused MoE (default config) eager (host launches included) and inside a CUDA graph (GPU
    time only); in graphs, its parts: the routing (route_topk, from router logits) and the alignment
    (moe_align_triton), beside the torch alignment (ops.moe.moe_align) and the torch reference of the whole layer;
    the achieved bandwidth = bytes of the experts hit / graph time."""
    from xllm_gen.runtime.ops.moe import fused_moe_reference, moe_align
    from xllm_gen.runtime.ops.moe_triton import default_config, fused_moe_silu, moe_align_triton, route_topk

    L = layer
    rows = []
    for T in tokens:
        x, w, ids, hit, nbytes = L.inputs(T)
        logits = L.logits(T)
        cfg = default_config(T, L.E, L.K, L.H, L.I)
        row = dict(tokens=T, experts_hit=hit, bytes=nbytes, config=asdict(cfg))
        f13, f2, fk = L.experts("fp8")
        i13, i2, ik = L.experts("int4")
        cases = (("triton_eager", lambda: fused_moe_silu(x, L.w13, L.w2, w, ids, config=cfg), None),
                 ("triton_graph", lambda: fused_moe_silu(x, L.w13, L.w2, w, ids, config=cfg), 10),
                 ("triton_fp8_graph", lambda: fused_moe_silu(x, f13, f2, w, ids, config=cfg, **fk), 10),
                 ("triton_int4_graph", lambda: fused_moe_silu(x, i13, i2, w, ids, config=cfg, **ik), 10),
                 ("route_graph", lambda: route_topk(logits, L.K, True), 10),
                 ("align_graph", lambda: moe_align_triton(ids, L.E, cfg.block_m), 10),
                 ("torch_align_graph", lambda: moe_align(ids, L.E, cfg.block_m), 10),
                 ("torch_ref_graph", lambda: fused_moe_reference(x, L.w13, L.w2, w, ids, L.act), 2))
        for name, fn, inner in cases:
            try:
                if inner is None:
                    fn()                                  # warm-up (Triton compiles on the first call)
                    row[name + "_ms"] = BD._ev_ms(fn, 20)
                else:
                    row[name + "_ms"] = graph_ms(fn, inner=inner)
            except Exception as e:   # noqa: BLE001  (keep the other results)
                row[name + "_ms"] = None
                row[name + "_error"] = f"{type(e).__name__}: {e}"[:500]
        if row.get("triton_graph_ms"):
            row["triton_graph_GBs"] = nbytes / (row["triton_graph_ms"] * 1e-3) / 1e9
        if row.get("triton_fp8_graph_ms") and row.get("triton_graph_ms"):   # float8 experts: half the bytes
            row["triton_fp8_graph_GBs"] = nbytes / 2 / (row["triton_fp8_graph_ms"] * 1e-3) / 1e9
            row["fp8_vs_bf16"] = row["triton_fp8_graph_ms"] / row["triton_graph_ms"]
        if row.get("triton_int4_graph_ms") and row.get("triton_graph_ms"):  # 4-bit experts: a quarter (+ groups)
            row["triton_int4_graph_GBs"] = nbytes / 4 / (row["triton_int4_graph_ms"] * 1e-3) / 1e9
            row["int4_vs_bf16"] = row["triton_int4_graph_ms"] / row["triton_graph_ms"]
        log(f"kernel T={T}: {row}")
        rows.append(row)
    return rows


def flashinfer_table(log, layer: Layer, tokens=TOKENS) -> dict:
    """FlashInfer's fused MoE (cutlass_fused_moe: TensorRT-LLM's CUTLASS grouped GEMMs, built by FlashInfer's JIT on
    first use, for SM90 here) beside our Triton fused MoE at the same routing, both in CUDA graphs. Its gate/up
    weight layout is found by comparing both halves' orders with our output (rel_err_*)."""
    from flashinfer.fused_moe import cutlass_fused_moe

    from xllm_gen.runtime.ops.moe_triton import fused_moe_silu

    L = layer
    w31 = torch.cat([L.w13[:, L.I:], L.w13[:, :L.I]], 1).contiguous()       # [up; gate] per expert
    res: dict = dict(rows=[])
    t0 = time.perf_counter()
    for T in tokens:
        x, w, ids, hit, nbytes = L.inputs(T)
        ids32, scales = ids.to(torch.int32), w.float()
        ours = fused_moe_silu(x, L.w13, L.w2, w, ids).float()
        row: dict = dict(tokens=T, experts_hit=hit, bytes=nbytes)

        def fi(fc1):
            out = cutlass_fused_moe(x, ids32, scales, fc1, L.w2, torch.bfloat16, quant_scales=[])
            return out[0] if isinstance(out, (list, tuple)) else out

        for name, fc1 in (("gate_up", L.w13), ("up_gate", w31)):
            row[f"rel_err_{name}"] = ((fi(fc1).float() - ours).abs().max() / ours.abs().max()).item()
        res.setdefault("first_call_s", time.perf_counter() - t0)         # the JIT build, if it was not cached
        row["layout"] = min(("gate_up", "up_gate"), key=lambda n: row[f"rel_err_{n}"])
        fc1 = L.w13 if row["layout"] == "gate_up" else w31
        try:
            row["flashinfer_graph_ms"] = graph_ms(lambda: fi(fc1), inner=10)
        except Exception as e:   # noqa: BLE001  (not capturable: time it eagerly)
            row["graph_error"] = f"{type(e).__name__}: {e}"[:300]
            row["flashinfer_eager_ms"] = BD._ev_ms(lambda: fi(fc1), 20)
        row["triton_graph_ms"] = graph_ms(lambda: fused_moe_silu(x, L.w13, L.w2, w, ids), inner=10)
        log(f"flashinfer T={T}: {row}")
        res["rows"].append(row)
    return res


def sweep_candidates(T: int, layer: Layer) -> list:
    """~10 configs per T (block_n 32/64/128, block_k 64/128/256, 4/8 warps, 2-4 stages; more rows per block only
    where blocks fill up); the default first. Combinations a GPU cannot compile (shared memory) are skipped."""
    from xllm_gen.runtime.ops.moe_triton import MoeConfig, default_config
    c = [default_config(T, layer.E, layer.K, layer.H, layer.I)]
    for t in [(16, 32, 128, 32, 128, 4, 3), (16, 32, 256, 64, 128, 4, 3), (16, 64, 128, 64, 128, 4, 3),
              (16, 64, 128, 128, 64, 4, 4), (16, 64, 256, 128, 128, 8, 3), (16, 128, 64, 128, 64, 4, 4),
              (16, 128, 128, 128, 128, 8, 3), (16, 32, 64, 32, 64, 4, 2), (16, 64, 64, 64, 64, 8, 4),
              (16, 16, 256, 32, 256, 4, 3), (16, 16, 128, 32, 128, 2, 4)]:        # narrow: more programs
        c.append(MoeConfig(*t))
    if T >= 64:
        c += [MoeConfig(32, 64, 128, 64, 128, 4, 3), MoeConfig(64, 128, 64, 128, 64, 8, 3)]
    return list(dict.fromkeys(c))                       # frozen dataclass: hashable, duplicates dropped


def config_sweep(log, layer: Layer, tokens=TOKENS, budget_s: float = 45.0, form: str = "bf16") -> dict:
    """Per T, each candidate config of fused_moe_silu (the experts in `form`: bf16, or kept packed as fp8 / int4)
    timed in a CUDA graph (graph_ms), its output checked
    against the default config's (max |diff| / max |default|; bf16, so differences of a rounding are expected,
    > 3e-2 marks it wrong and it cannot be best); the best config, its time and bandwidth. Stops trying configs
    after budget_s (compiles included), the rest marked skipped (the default config is always timed)."""
    from xllm_gen.runtime.ops.moe_triton import default_config, fused_moe_silu

    L = layer
    w13, w2, packed = L.experts(form)
    t0 = time.perf_counter()
    out = dict(shapes=dict(H=L.H, I=L.I, E=L.E, top_k=L.K, dtype=str(L.w13.dtype).replace("torch.", ""), form=form),
               budget_s=budget_s, by_tokens=[])
    for T in tokens:
        x, w, ids, hit, nbytes = L.inputs(T)
        dflt = default_config(T, L.E, L.K, L.H, L.I)
        ref = fused_moe_silu(x, w13, w2, w, ids, config=dflt, **packed).float()
        scale = ref.abs().max().clamp(min=1e-6)
        res = []
        for cfg in sweep_candidates(T, L):
            r = dict(config=asdict(cfg), default=cfg == dflt)
            if time.perf_counter() - t0 > budget_s and not r["default"]:      # the default is always timed
                r["skipped"] = "sweep time budget spent"
                res.append(r)
                continue
            try:
                fn = (lambda c=cfg: fused_moe_silu(x, w13, w2, w, ids, config=c, **packed))
                r["rel_err"] = ((fn().float() - ref).abs().max() / scale).item()      # compiles here
                r["ms"] = graph_ms(fn, inner=10)
                r["GBs"] = nbytes / (r["ms"] * 1e-3) / 1e9
            except Exception as e:   # noqa: BLE001  (a config the GPU cannot run: skipped)
                r["error"] = f"{type(e).__name__}: {e}"[:300]
            res.append(r)
        ok = [r for r in res if r.get("ms") is not None and r["rel_err"] <= 3e-2]
        best = min(ok, key=lambda r: r["ms"]) if ok else None
        d = next((r for r in res if r["default"]), {})
        entry = dict(tokens=T, experts_hit=hit, bytes=nbytes, results=res, default_ms=d.get("ms"),
                     best=None if best is None else dict(config=best["config"], ms=best["ms"], GBs=best["GBs"]))
        out["by_tokens"].append(entry)
        log(f"sweep T={T}: best {entry['best']} (default {entry['default_ms']} ms; "
            f"{sum('ms' in r for r in res)} timed, {sum('error' in r for r in res)} failed, "
            f"{sum('skipped' in r for r in res)} skipped; {time.perf_counter() - t0:.0f} s)")
    out["seconds"] = time.perf_counter() - t0
    return out


# ------------------------------------------------------------------------------------------------ report
def _cfg_str(c: dict) -> str:
    return (f"m{c['block_m']} gu {c['block_n1']}x{c['block_k1']} dn {c['block_n2']}x{c['block_k2']} "
            f"w{c['num_warps']} s{c['num_stages']}")


def markdown(R: dict) -> str:
    f = BD.fmt
    L = [f"# Qwen3-MoE decode ({R['variant']}, random bf16 weights, TP {R['tp']})\n",
         f"command: `{R['command']}`; versions: {R['versions']}; copy bandwidth "
         f"{R.get('copy_bandwidth_GBs', 0):.0f} GB/s; input {R['input_len']}, output {R['output_len']}\n"]
    if "engine" in R:
        L.append("| batch | floor (active experts) ms | graph TPOT ms | eager TPOT ms | step bytes (GB) | all params (GB) |")
        L.append("|---:|---:|---:|---:|---:|---:|")
        for r in R["engine"]:
            L.append(f"| {r['batch']} | {r['floor_ms']:.3f} | {f(r['graph'].get('tpot_ms'))} | "
                     f"{f(r['eager'].get('tpot_ms'))} | {r['step_bytes'] / 1e9:.2f} | "
                     f"{r['all_params_bytes'] / 1e9:.2f} |")
    if "engine_error" in R:
        L.append(f"\nengine: {R['engine_error']}\n")
    if R.get("profile"):
        L += [""] + BD.profile_markdown(R["profile"], R["variant"])
    if "hf" in R:
        L.append(f"\ntransformers (batch 1, eager{'' if R.get('hf_compile') else '; static cache + compile not run'}):"
                 f" {json.dumps(R['hf'])}\n")
    if "kernel" in R:
        L.append("\nOne MoE layer, Triton fused MoE (default config) vs the torch reference. *graph*: GPU time inside a "
                 "CUDA graph (10 calls per replay, median of 20 replays); *eager*: host launches included; "
                 "GB/s: bytes of the experts hit / Triton graph time.\n")
        L.append("| tokens | experts hit | expert bytes (MB) | Triton eager ms | Triton graph ms | of it: align ms "
                 "| Triton GB/s | fp8 experts graph ms | fp8 / bf16 | fp8 GB/s | int4 experts graph ms | int4 / bf16 "
                 "| routing ms | torch align ms | torch ref graph ms |")
        L.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in R["kernel"]:
            L.append(f"| {r['tokens']} | {r['experts_hit']} | {r['bytes'] / 1e6:.1f} | {f(r.get('triton_eager_ms'))} "
                     f"| {f(r.get('triton_graph_ms'))} | {f(r.get('align_graph_ms'))} | "
                     f"{f(r.get('triton_graph_GBs'), 0)} | {f(r.get('triton_fp8_graph_ms'))} | "
                     f"{f(r.get('fp8_vs_bf16'), 2)} | {f(r.get('triton_fp8_graph_GBs'), 0)} | "
                     f"{f(r.get('triton_int4_graph_ms'))} | {f(r.get('int4_vs_bf16'), 2)} | "
                     f"{f(r.get('route_graph_ms'))} | "
                     f"{f(r.get('torch_align_graph_ms'))} | {f(r.get('torch_ref_graph_ms'))} |")
        errs = {f"T={r['tokens']} {k}": v for r in R["kernel"] for k, v in r.items() if k.endswith("_error")}
        if errs:
            L.append(f"\nerrors: {json.dumps(errs)}\n")
    F = R.get("flashinfer")
    if F:
        L.append(f"\nFlashInfer's fused MoE (cutlass_fused_moe, SM90 CUTLASS) vs our Triton fused MoE, one layer, CUDA "
                 f"graphs (ms); first call {F.get('first_call_s', 0):.0f} s (JIT build); rel err: vs ours, per gate/up "
                 "layout tried.\n")
        L.append("| tokens | experts hit | FlashInfer ms | Triton ms | FlashInfer / Triton | layout | rel err |")
        L.append("|---:|---:|---:|---:|---:|---|---:|")
        for r in F.get("rows", []):
            t_fi = r.get("flashinfer_graph_ms") or r.get("flashinfer_eager_ms")
            L.append(f"| {r['tokens']} | {r['experts_hit']} | {f(t_fi)}{'' if r.get('flashinfer_graph_ms') else ' (eager)'}"
                     f" | {f(r.get('triton_graph_ms'))} | "
                     f"{f(t_fi / r['triton_graph_ms'] if t_fi and r.get('triton_graph_ms') else None, 2)} | "
                     f"{r['layout']} | {r['rel_err_' + r['layout']]:.1e} |")
    if "flashinfer_error" in R:
        L.append(f"\nFlashInfer fused MoE: {R['flashinfer_error']}\n")
    if "kernel_error" in R:
        L.append(f"\nkernel table: {R['kernel_error']}\n")
    S = R.get("kernel_sweep")
    if S:
        L.append(f"\nConfig sweep of fused_moe_silu (CUDA graph, ms; shapes {S['shapes']}; {S.get('seconds', 0):.0f} s). "
                 "Config: rows per block, gate/up tile N x K, down tile N x K, warps, stages.\n")
        L.append("| tokens | best config | best ms | best GB/s | default ms | speed-up |")
        L.append("|---:|---|---:|---:|---:|---:|")
        for e in S["by_tokens"]:
            b = e["best"]
            if b is None:
                L.append(f"| {e['tokens']} | - | - | - | {f(e['default_ms'])} | - |")
                continue
            up = f"{e['default_ms'] / b['ms']:.2f}x" if e.get("default_ms") else "-"
            L.append(f"| {e['tokens']} | {_cfg_str(b['config'])} | {b['ms']:.4f} | {b['GBs']:.0f} | "
                     f"{f(e['default_ms'], 4)} | {up} |")
        cfgs = list(dict.fromkeys(_cfg_str(r["config"]) for e in S["by_tokens"] for r in e["results"]))
        dflt = {_cfg_str(r["config"]) for e in S["by_tokens"] for r in e["results"] if r["default"]}
        Ts = [e["tokens"] for e in S["by_tokens"]]
        L.append("\n| config | " + " | ".join(f"T={t} ms" for t in Ts) + " |")
        L.append("|---|" + "---:|" * len(Ts))
        for c in cfgs:
            cells = []
            for e in S["by_tokens"]:
                r = next((r for r in e["results"] if _cfg_str(r["config"]) == c), None)
                if r is None:
                    cells.append("")
                elif "ms" in r:
                    cells.append(f"{r['ms']:.4f}" + (" (wrong)" if r["rel_err"] > 3e-2 else ""))
                else:
                    cells.append("skipped" if "skipped" in r else "failed")
            L.append(f"| {c}{' (default)' if c in dflt else ''} | " + " | ".join(cells) + " |")
    if "kernel_sweep_error" in R:
        L.append(f"\nconfig sweep: {R['kernel_sweep_error']}\n")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "h200_moe.md"))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--batch-sizes", default=",".join(map(str, BATCHES)))
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--sections", default="kernel,sweep,engine,hf",
                    help="comma list of kernel (Triton vs torch, CUDA graphs), sweep (fused MoE configs), flashinfer "
                         "(FlashInfer's fused MoE vs ours; JIT-builds it on first use), engine, "
                         "profile (with engine: where a graph decode step goes, per batch), hf")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts of the kernel table and sweep")
    ap.add_argument("--sweep-budget-s", type=float, default=45.0, help="time limit of the config sweep (compiles included)")
    ap.add_argument("--sweep-form", default="bf16", choices=("bf16", "fp8", "int4"),
                    help="the experts' form in the config sweep: bf16, or kept packed as fp8 / int4")
    ap.add_argument("--hf-compile", action="store_true",
                    help="also run transformers' static cache + torch.compile (minutes for this model; off by default)")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe needs a CUDA GPU", file=sys.stderr)
        return 2
    sections = set(args.sections.split(","))
    batches = [int(b) for b in args.batch_sizes.split(",")]
    tokens = tuple(int(t) for t in args.tokens.split(","))

    def log(msg: str) -> None:
        print(msg, flush=True)

    import tempfile
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_moe_"))
    model_dir = write_config(root)
    command = "python " + " ".join(shlex.quote(a) for a in ["bench/bench_moe.py"] +
                                   list(argv if argv is not None else sys.argv[1:]))
    R: dict = dict(command=command, versions=BD.versions(), variant=VARIANT, tp=args.tp, input_len=args.input_len,
                   output_len=args.output_len)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:                      # after every section: a timeout later keeps what was measured
        out.write_text(markdown(R))
        out.with_suffix(".json").write_text(json.dumps(R, indent=1, default=str))
        log(f"wrote {out}")

    bw = BD.copy_bandwidth()
    R["copy_bandwidth_GBs"] = bw / 1e9
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    save()
    if sections & {"kernel", "sweep", "flashinfer"}:
        layer = Layer(args.tp)
        if "flashinfer" in sections:
            try:
                R["flashinfer"] = flashinfer_table(log, layer, tokens)
            except Exception as e:   # noqa: BLE001
                R["flashinfer_error"] = f"{type(e).__name__}: {e}"[:1000]
            save()
        if "kernel" in sections:
            t = time.perf_counter()
            try:
                R["kernel"] = kernel_table(log, layer, tokens)
            except Exception as e:   # noqa: BLE001
                R["kernel_error"] = f"{type(e).__name__}: {e}"[:1000]
            log(f"kernel table: {time.perf_counter() - t:.0f} s")
            save()
        if "sweep" in sections:
            try:
                R["kernel_sweep"] = config_sweep(log, layer, tokens, args.sweep_budget_s, args.sweep_form)
            except Exception as e:   # noqa: BLE001
                R["kernel_sweep_error"] = f"{type(e).__name__}: {e}"[:1000]
            save()
        del layer
        BD.free_cuda()
    if "engine" in sections:
        try:
            blocks = max(batches) * math.ceil((args.input_len + args.output_len) / 16) + 64
            llm, load_s = make_llm(model_dir, args.tp, max(batches), args.input_len + args.output_len + 16, blocks)
            R["load_and_capture_s"] = load_s
            model = llm.engine.runner.model
            R["engine"], saved = [], {}
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
                R["engine"].append(row)
                save()
            if "profile" in sections:          # where a graph step goes (host, replay, top kernels)
                R["profile"] = []
                for B in batches:
                    try:
                        R["profile"].append(BD.profile_decode(llm, B, args.input_len, top=24))
                    except Exception as e:   # noqa: BLE001
                        R["profile"].append(dict(batch=B, error=f"{type(e).__name__}: {e}"))
                    log(f"profile: {R['profile'][-1]}")
                save()
            del llm, model
        except Exception as e:   # noqa: BLE001
            R["engine_error"] = f"{type(e).__name__}: {e}"[:1000]
            save()
        BD.free_cuda()
    if "hf" in sections and args.tp == 1:
        R["hf_compile"] = args.hf_compile
        try:
            R["hf"] = BD.hf_baseline(model_dir, args.input_len, args.output_len, log, compile=args.hf_compile)
        except Exception as e:   # noqa: BLE001
            R["hf"] = dict(error=f"{type(e).__name__}: {e}")
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
