"""Quantized mixture-of-experts checkpoints: per-expert fp8 / int weights (Qwen3-30B-A3B-FP8, DeepSeek-V3's FP8
release and V3.1's UE8M0 form, llm-compressor's MoE FP8 / W8A8, AWQ / GPTQ MoE) load into FusedMoE's stacked
experts, with the checkpoint's activation quantization on the experts' input and on the intermediate
(FusedMoE.act_quant / act_quant_down), against transformers on the dequantized weights, float32 on CPU. Float8
experts kept packed (XLLM_PACKED_QUANT=1, the CUDA default): built on the meta device, filled packed, read by the
grouped kernels bit for bit as the dequantized experts (interpreter); their fallbacks made real.

- The reference quantizes the same activations with code written independently of the runtime: forward pre-hooks
  on the linear layers (tests/quant_ckpt.py act_quant_hooks) and a per-expert loop replacing transformers' experts
  forward (expert_act_quant), itself checked against transformers' own forward.
- Sensitivity: the reference without the experts' quantization, and altered expert scales, are far from the
  engine.
- TP 2 (slow): expert weights and activation groups split over the ranks; a split the activation groups cannot
  follow is refused naming the parameter.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_ref import hf_greedy, hf_model, hf_prefill_logits
from quant_ckpt import (
    act_quant_hooks,
    calibrate_input_scales,
    edit_ckpt,
    emulate,
    emulate_int8,
    expert_act_quant,
    int8_act_hooks,
    write_awq,
    write_ct_fp8,
    write_ct_int8,
    write_fp8_block,
    write_gptq,
)

from tests.fixtures.tiny_hf import make_tiny_checkpoint

BLOCK = (16, 16)       # moe_intermediate_size 32: two activation groups per expert row, one per TP-2 rank
PROMPTS = [[97, 11, 187, 0, 57, 67], [78, 67, 315, 96, 374], [3, 17, 99, 102, 7, 7, 300, 41, 5]]
N_NEW = 10
TOL_SAME = 1e-3        # the reference quantizes the same activations: float rounding only
OPTS = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=8, max_model_len=256,
            enforce_eager=True)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("moe") / "base")


@pytest.fixture(scope="module")
def fp8_block(moe, tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_fp8b")
    return write_fp8_block(moe, d / "ckpt", d / "ref", BLOCK)


def _llm(path, **kw):
    from xllm_gen import LLM
    return LLM(model=str(path), **{**OPTS, **kw})


def _greedy(llm, prompts=PROMPTS, n=N_NEW) -> list[list[int]]:
    from xllm_gen import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _fp8(kind, group=0):
    return lambda x, which: emulate(x, kind, group)


def _reference(ref, linear=None, experts=None, prompts=PROMPTS, n=N_NEW, logits_of=None):
    """transformers' greedy tokens on the dequantized checkpoint (or, with `logits_of`, its prefill logits of that
    sequence), the linear layers' inputs quantized by `linear` (hooks installer) and the experts' by `experts`."""
    model = hf_model(ref)
    handles = (linear(model) if linear else []) + expert_act_quant(model, experts)
    try:
        return hf_prefill_logits(ref, logits_of) if logits_of is not None else hf_greedy(ref, prompts, n)
    finally:
        for h in handles:
            h.remove()


def _err(llm, ref, seq, **kw) -> float:
    want = _reference(ref, logits_of=seq, **kw)
    got = torch.as_tensor(llm.prefill_logits(seq)).float()[:, : want.shape[1]]
    return ((got - want).abs().max() / want.abs().max()).item()


def test_reference_experts_loop_is_transformers(fp8_block):
    """The reference's per-expert loop without quantization gives transformers' own logits (so what the
    quantizing loop adds is the quantization alone)."""
    _, ref = fp8_block
    seq = PROMPTS[2] + PROMPTS[0]
    plain = hf_prefill_logits(ref, seq)
    looped = _reference(ref, logits_of=seq)
    assert (looped - plain).abs().max().item() <= 1e-5 * plain.abs().max().item()


def test_fp8_block_experts_match_hf(fp8_block):
    """Qwen3-*-FP8's format on an MoE: every expert's gate / up / down weight float8 with 16x16 block scales, the
    experts' input and intermediate quantized per token and group of 16: greedy tokens equal transformers with the
    same quantization, logits within float rounding; without the experts' activation quantization the reference
    is far off (the engine does quantize them)."""
    ckpt, ref = fp8_block
    llm = _llm(ckpt)
    moe_layer = llm.engine.runner.model.model.layers[0].mlp.experts
    assert repr(moe_layer.act_quant) == repr(moe_layer.act_quant_down) == "ActQuant(group, group=16)"
    hooks = lambda m: act_quant_hooks(m, "group", BLOCK[1])                                  # noqa: E731
    assert _greedy(llm) == _reference(ref, hooks, _fp8("group", BLOCK[1]))
    seq = PROMPTS[2] + PROMPTS[1]
    same = _err(llm, ref, seq, linear=hooks, experts=_fp8("group", BLOCK[1]))
    without = _err(llm, ref, seq, linear=hooks)
    print(f"\n[moe fp8 block] relative logit error {same:.2e}; reference without the experts' quantization {without:.2e}")
    assert same < TOL_SAME and without > 10 * max(same, 1e-6), (same, without)


def test_fp8_block_expert_scales_matter(fp8_block, tmp_path):
    """Expert scales read wrong (all expert scales doubled) -> far from the reference."""
    ckpt, ref = fp8_block

    def double(sd):
        for k in sd:
            if ".experts." in k and k.endswith("weight_scale_inv"):
                sd[k] = sd[k] * 2
    bad = edit_ckpt(ckpt, tmp_path / "bad", tensors=double)
    err = _err(_llm(bad), ref, PROMPTS[2] + PROMPTS[1], linear=lambda m: act_quant_hooks(m, "group", BLOCK[1]),
               experts=_fp8("group", BLOCK[1]))
    assert err > 0.05, err


def test_fp8_expert_scale_missing_names_the_tensor(fp8_block, tmp_path):
    ckpt, _ = fp8_block
    name = "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"
    bad = edit_ckpt(ckpt, tmp_path / "bad", tensors=lambda sd: sd.pop(name))
    with pytest.raises(ValueError, match=rf"missing tensor '{name}'"):
        _llm(bad)


def test_ct_fp8_experts_per_token(moe, tmp_path):
    """llm-compressor's FP8_DYNAMIC on an MoE (per-channel weight scales, dynamic per-token activations)."""
    ckpt, ref = write_ct_fp8(moe, tmp_path / "ckpt", tmp_path / "ref", strategy="channel", act="token")
    assert _greedy(_llm(ckpt)) == _reference(ref, lambda m: act_quant_hooks(m, "token"), _fp8("token"))


def test_ct_fp8_experts_static_scales(moe, tmp_path):
    """Static per-tensor input scales, one per expert and projection (llm-compressor calibrates each expert): the
    experts' input takes the largest gate / up scale of the layer's experts, the intermediate the largest down
    scale (vLLM's fused MoE); tokens equal the reference quantizing with those maxima, and differ from one that
    takes the first expert's scales."""
    import json
    ref0 = write_ct_fp8(moe, tmp_path / "probe", tmp_path / "probe_ref", strategy="channel", act=None)[1]
    model = hf_model(ref0)
    ids = torch.tensor([sum(PROMPTS, [])])
    scales = calibrate_input_scales(model, ids)
    seen: dict = {}

    def record(x, which):
        seen[which] = max(seen.get(which, 0.0), float(x.abs().max()))
        return x
    handles = expert_act_quant(model, record)
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    cfg = json.loads((moe / "config.json").read_text())
    E = cfg["num_local_experts"]
    for i in range(cfg["num_hidden_layers"]):
        for e in range(E):      # distinct per expert: the last expert's are the largest
            for proj, which in (("gate_proj", "in"), ("up_proj", "in"), ("down_proj", "down")):
                scales[f"model.layers.{i}.mlp.experts.{e}.{proj}"] = seen[which] / 448.0 * (0.6 + 0.2 * e)
    ckpt, ref = write_ct_fp8(moe, tmp_path / "ckpt", tmp_path / "ref", strategy="channel", act="static",
                             input_scales=scales)
    got = _greedy(_llm(ckpt))
    top = {"in": seen["in"] / 448.0 * (0.6 + 0.2 * (E - 1)), "down": seen["down"] / 448.0 * (0.6 + 0.2 * (E - 1))}
    first = {k: v / (0.6 + 0.2 * (E - 1)) * 0.6 for k, v in top.items()}
    linear = lambda m: act_quant_hooks(m, "static", scales=scales)                        # noqa: E731
    assert got == _reference(ref, linear, lambda x, which: emulate(x, "static", scale=top[which]))
    seq = PROMPTS[2] + PROMPTS[1]
    llm = _llm(ckpt)
    wrong = _err(llm, ref, seq, linear=linear, experts=lambda x, which: emulate(x, "static", scale=first[which]))
    assert wrong > 10 * TOL_SAME, wrong


def test_ct_int8_w8a8_experts(moe, tmp_path):
    """compressed-tensors W8A8 int8 on an MoE: int8 expert weights, per-token int8 activations."""
    ckpt, ref = write_ct_int8(moe, tmp_path / "ckpt", tmp_path / "ref", strategy="channel", act="token")
    got = _greedy(_llm(ckpt))
    assert got == _reference(ref, lambda m: int8_act_hooks(m, "token"), lambda x, which: emulate_int8(x, "token"))


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_int4_experts_weight_only(moe, tmp_path, fmt, monkeypatch):
    """AWQ / GPTQ int4 MoE checkpoints (every expert's projections packed, group 16): weights only, greedy tokens
    equal transformers on the dequantized weights; with XLLM_PACKED_QUANT=1 (the CUDA default) the experts are held
    as 4-bit codes two to a byte with a zero and a scale per row and 16 columns (a quarter of bf16's bytes, the
    stacked parameters emptied), and serve the same tokens."""
    writer = write_awq if fmt == "awq" else write_gptq
    ckpt, ref = writer(moe, tmp_path / "ckpt", tmp_path / "ref", group=16)
    want = _reference(ref)
    assert _greedy(_llm(ckpt)) == want
    monkeypatch.setenv("XLLM_PACKED_QUANT", "1")
    llm = _llm(ckpt)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert sorted(experts.packed) == ["down_proj", "gate_up_proj"] and experts.gate_up_proj.numel() == 0
    codes, scale, group, zeros = experts.packed["gate_up_proj"]
    assert codes.dtype == torch.uint8 and group == 16 and codes.shape[-1] * 2 == 64 == scale.shape[-1] * 16
    assert zeros.dtype == torch.uint8 and zeros.shape == scale.shape
    assert _greedy(llm) == want


def test_act_order_int4_experts_fall_back_to_dequantized(moe, tmp_path, monkeypatch):
    """GPTQ with desc_act (a permuted group per column): the codes are not group-constant, so the experts (built on
    the meta device for packing) are made real and held dequantized, and serve transformers' tokens."""
    ckpt, ref = write_gptq(moe, tmp_path / "ckpt", tmp_path / "ref", group=16, desc_act=True)
    monkeypatch.setenv("XLLM_PACKED_QUANT", "1")
    llm = _llm(ckpt)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.packed is None and experts.gate_up_proj.numel() > 0 and not experts.gate_up_proj.is_meta
    assert _greedy(llm) == _reference(ref)


@pytest.mark.slow
@pytest.mark.parametrize("packed", ["0", "1"])
def test_tp2_fp8_block_experts(fp8_block, packed, monkeypatch):
    """TP 2: each rank holds half of every expert's intermediate (one activation group of 16), dequantized or
    packed (XLLM_PACKED_QUANT): tokens equal."""
    ckpt, ref = fp8_block
    monkeypatch.setenv("XLLM_PACKED_QUANT", packed)
    llm = _llm(ckpt, tensor_parallel_size=2)
    try:
        got = _greedy(llm)
    finally:
        llm.shutdown()
    assert got == _reference(ref, lambda m: act_quant_hooks(m, "group", BLOCK[1]), _fp8("group", BLOCK[1]))


@pytest.mark.slow
def test_tp2_packed_int4_experts(moe, tmp_path, monkeypatch):
    """TP 2, AWQ experts kept packed: each rank packs its half of every expert's intermediate (one group of 16):
    tokens equal transformers on the dequantized weights."""
    ckpt, ref = write_awq(moe, tmp_path / "ckpt", tmp_path / "ref", group=16)
    monkeypatch.setenv("XLLM_PACKED_QUANT", "1")
    llm = _llm(ckpt, tensor_parallel_size=2)
    try:
        got = _greedy(llm)
    finally:
        llm.shutdown()
    assert got == _reference(ref)


@pytest.mark.slow
def test_tp2_expert_split_off_the_groups_refused(moe, tmp_path):
    """Groups of 32 over an intermediate of 32 split in two: rank 1's columns start at 16, inside a group: refused
    naming the experts' parameter (the dense layer 1's MLP, whose split would be refused first, stays float)."""
    ckpt, _ = write_fp8_block(moe, tmp_path / "ckpt", tmp_path / "ref", (32, 32), skip=("layers.1.mlp.",))
    with pytest.raises(Exception, match=r"experts\.down_proj.*do not fall on the activation groups of 32"):
        _llm(ckpt, tensor_parallel_size=2)


@pytest.mark.parametrize("ue8m0", [None, "f32"], ids=["v3", "v3.1_ue8m0"])
def test_deepseek_v3_fp8_release_format(tmp_path, ue8m0):
    """DeepSeek-V3's FP8 release format: block fp8 on everything its release quantizes (the latent attention's
    q_a / q_b / kv_a / kv_b / o projections, the dense and shared-expert MLPs and every routed expert), grouped
    sigmoid routing with the correction bias: greedy tokens equal transformers with the same activation
    quantization, logits within float rounding. V3.1's `scale_fmt: ue8m0`: power-of-two scales, weights and
    activations (the experts' too)."""
    base = make_tiny_checkpoint("DeepseekV3ForCausalLM", tmp_path / "base")
    ckpt, ref = write_fp8_block(base, tmp_path / "ckpt", tmp_path / "ref", BLOCK, ue8m0=ue8m0)
    llm = _llm(ckpt)
    pow2 = ue8m0 is not None
    attn = llm.engine.runner.model.model.layers[1].self_attn
    linears = [m for m in attn.modules() if hasattr(m, "act_quant") and hasattr(m, "weight")]
    assert len(linears) >= 4 and all(m.act_quant is not None for m in linears), linears
    assert llm.engine.runner.model.model.layers[1].mlp.experts.act_quant.pow2 == pow2
    hooks = lambda m: act_quant_hooks(m, "group", BLOCK[1], pow2=pow2)                      # noqa: E731
    experts = lambda x, which: emulate(x, "group", BLOCK[1], pow2=pow2)                     # noqa: E731
    assert _greedy(llm) == _reference(ref, hooks, experts)
    same = _err(llm, ref, PROMPTS[2] + PROMPTS[1], linear=hooks, experts=experts)
    assert same < TOL_SAME, same


# ------------------------------------------------------------------------------------ float8 experts kept packed
_KERNEL = r"""
import json, torch
from xllm_gen.runtime.ops.moe import dequantize_experts, topk_softmax
from xllm_gen.runtime.ops.moe_triton import fused_moe_silu
torch.manual_seed(0)
out = {}
def fp8(w, bk):
    E, N, K = w.shape
    nb = -(-K // bk)
    s = torch.stack([w[..., j * bk:(j + 1) * bk].abs().amax(-1) for j in range(nb)], -1) / 448.0 + 1e-6
    q = (w / s.repeat_interleave(bk, -1)[..., :K]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s
from xllm_gen.runtime.ops.moe_triton import MoeConfig, _scale_mode, default_config
modes = set()
# the scale reads of _weight_tile: 1 (a column per tile), 2 (several per tile, a partial last one), 0 (gathered)
for T, H, I, E, K, bk13, bk2, dtype, cfg in [
        (5, 48, 16, 4, 2, 16, 16, torch.float32, None), (9, 32, 24, 6, 3, 32, 24, torch.float32, None),
        (7, 64, 32, 4, 2, 16, 32, torch.float16, None), (6, 96, 40, 4, 2, 24, 40, torch.float32, None),
        (4, 64, 32, 4, 2, 32, 16, torch.float32, MoeConfig(block_k1=16, block_k2=16))]:
    c = cfg or default_config(T, E, K, H, I)
    modes |= {_scale_mode(bk13, c.block_k1, H), _scale_mode(bk2, c.block_k2, I)}
    x = torch.randn(T, H).to(dtype)
    q13, s13 = fp8(torch.randn(E, 2 * I, H) / H ** .5, bk13)
    q2, s2 = fp8(torch.randn(E, H, I) / I ** .5, bk2)
    w, ids = topk_softmax(torch.randn(T, E), K, True)
    w = w.to(dtype)
    ids[0, 0] = E                                   # routed nowhere
    d13, d2 = dequantize_experts(q13, s13, bk13, dtype), dequantize_experts(q2, s2, bk2, dtype)
    a = fused_moe_silu(x, q13, q2, w, ids, config=cfg, scales13=(s13, bk13), scales2=(s2, bk2))
    b = fused_moe_silu(x, d13, d2, w, ids, config=cfg)
    s13[1] *= 2
    s2[2] *= 2
    c = fused_moe_silu(x, q13, q2, w, ids, config=cfg, scales13=(s13, bk13), scales2=(s2, bk2))
    out[f"{T}x{H}x{I}x{E}x{K}-{bk13}-{bk2}-{dtype}"] = [bool(torch.equal(a, b)), not torch.equal(a, c)]
out["modes"] = [sorted(modes) == [0, 1, 2]]
# 4-bit codes two to a byte, a zero and a scale per row and group (AWQ / GPTQ experts kept packed)
from xllm_gen.runtime.ops.moe import dequantize_packed, pack_int4_experts
def int4(E, N, K, g):
    codes = torch.randint(0, 16, (E, N, K)).float()
    zeros = torch.randint(0, 16, (E, N, K // g)).float().repeat_interleave(g, -1)
    scales = (torch.rand(E, N, K // g) * 0.02 + 0.005).half().float().repeat_interleave(g, -1)
    return pack_int4_experts(codes, zeros, scales, g)
modes = set()
for T, H, I, E, K, g13, g2, dtype, cfg in [
        (5, 64, 32, 4, 2, 16, 16, torch.float32, None), (6, 96, 48, 4, 2, 32, 16, torch.float16, None),
        (4, 64, 32, 4, 2, 32, 16, torch.float32, MoeConfig(block_k1=16, block_k2=16)),
        (5, 96, 40, 4, 2, 48, 40, torch.float32, None)]:
    c = cfg or default_config(T, E, K, H, I)
    modes |= {_scale_mode(g13, c.block_k1, H), _scale_mode(g2, c.block_k2, I)}
    x = torch.randn(T, H).to(dtype)
    p13, p2 = int4(E, 2 * I, H, g13), int4(E, H, I, g2)
    w, ids = topk_softmax(torch.randn(T, E), K, True)
    w = w.to(dtype)
    ids[0, 0] = E
    a = fused_moe_silu(x, p13[0], p2[0], w, ids, config=cfg, scales13=p13[1:], scales2=p2[1:])
    b = fused_moe_silu(x, dequantize_packed(p13, dtype), dequantize_packed(p2, dtype), w, ids, config=cfg)
    p13[3][1] += 1
    c = fused_moe_silu(x, p13[0], p2[0], w, ids, config=cfg, scales13=p13[1:], scales2=p2[1:])
    out[f"int4-{T}x{H}x{I}x{E}x{K}-{g13}-{g2}-{dtype}"] = [bool(torch.equal(a, b)), not torch.equal(a, c)]
out["int4_modes"] = [sorted(modes) == [0, 1, 2]]
print("RESULT " + json.dumps(out))
"""


def test_fp8_experts_kernel_bit_exact_interpreted():
    """The grouped kernels reading float8 experts (scales per row and bk columns, bk a divisor of K or not; each of
    the kernel's three ways of reading the scales) give the dequantized experts' result bit for bit (float32 and
    float16, under TRITON_INTERPRET=1); an expert's scales doubled changes it."""
    import json
    import os
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-c", _KERNEL], env=dict(os.environ, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    got = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert got and all(all(v) for v in got.values()), got


def test_packed_fp8_experts_serve_as_dequantized(fp8_block, monkeypatch):
    """XLLM_PACKED_QUANT=1 (the CUDA default) on CPU: the experts are held as float8 codes and scales per row and 16
    columns (the stacked parameters emptied: half the bytes of bf16, a quarter of float32's) and serve the same
    tokens as the dequantized experts and as transformers."""
    ckpt, ref = fp8_block
    monkeypatch.setenv("XLLM_PACKED_QUANT", "1")
    llm = _llm(ckpt)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert sorted(experts.packed) == ["down_proj", "gate_up_proj"] and experts.gate_up_proj.numel() == 0
    codes, scale, bk = experts.packed["gate_up_proj"]
    assert codes.dtype == torch.float8_e4m3fn and bk == BLOCK[1] and scale.shape == (*codes.shape[:2], 64 // 16)
    got = _greedy(llm)
    monkeypatch.setenv("XLLM_PACKED_QUANT", "0")
    assert got == _greedy(_llm(ckpt))
    assert got == _reference(ref, lambda m: act_quant_hooks(m, "group", BLOCK[1]), _fp8("group", BLOCK[1]))


def test_packed_experts_never_allocated_at_compute_size(fp8_block, moe, tmp_path, monkeypatch):
    """With the experts kept packed, the model builds them on the meta device (no memory at the compute dtype's
    size); where they cannot be packed after all (a scale layout the packing refuses, simulated) or are stored
    float (modules_to_not_convert), the load makes them real and fills them: the same tokens each way."""
    from xllm_gen.runtime.layers import moe as moe_layer
    from xllm_gen.runtime.layers import quant_linear
    ckpt, ref = fp8_block
    monkeypatch.setenv("XLLM_PACKED_QUANT", "1")
    built = []
    real_weight = moe_layer._expert_weight
    monkeypatch.setattr(moe_layer, "_expert_weight", lambda *s: built.append(real_weight(*s)) or built[-1])
    want = _reference(ref, lambda m: act_quant_hooks(m, "group", BLOCK[1]), _fp8("group", BLOCK[1]))
    llm = _llm(ckpt)
    assert built and all(p.is_meta for p in built)
    assert _greedy(llm) == want
    monkeypatch.setattr(quant_linear, "pack_fp8_components", lambda *a, **k: None)
    llm = _llm(ckpt)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.packed is None and not experts.gate_up_proj.is_meta and experts.gate_up_proj.numel() > 0
    assert _greedy(llm) == want
    float_experts, float_ref = write_fp8_block(moe, tmp_path / "c", tmp_path / "r", BLOCK, skip=(".experts.",))
    llm = _llm(float_experts)
    assert not llm.engine.runner.model.model.layers[0].mlp.experts.down_proj.is_meta
    assert _greedy(llm) == _reference(float_ref, lambda m: act_quant_hooks(m, "group", BLOCK[1], skip=(".experts.",)))


def test_packed_expert_nan_is_named(fp8_block, tmp_path, monkeypatch):
    """A NaN float8 code in an expert: kept packed (never dequantized at load), refused naming the parameter;
    dequantized, naming the stored tensor (the NaN check re-reads the float8 tensor in float32: it could not)."""
    ckpt, _ = fp8_block
    name = "model.layers.2.mlp.experts.1.down_proj.weight"

    def poison(sd):
        w = sd[name].view(torch.uint8).clone()
        w[0, 0] = 0x7F                                      # float8 e4m3fn NaN
        sd[name] = w.view(torch.float8_e4m3fn)
    bad = edit_ckpt(ckpt, tmp_path / "bad", tensors=poison)
    monkeypatch.setenv("XLLM_PACKED_QUANT", "1")
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.down_proj: its experts' quantized checkpoint "
                                         r"tensors hold a NaN"):
        _llm(bad)
    monkeypatch.setenv("XLLM_PACKED_QUANT", "0")                # dequantized: the stored tensor is named
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.1\.down_proj\.weight"):
        _llm(bad)


def test_packing_rule_of_meta_experts_follows_the_model_device(monkeypatch):
    """The load keeps meta experts packed by the same rule the model was built by (the model's device and dtype,
    not the meta tensor's): on CUDA in bf16 with XLLM_PACKED_QUANT unset, packed; in float32, not."""
    from xllm_gen.runtime.layers.moe import FusedMoE, experts_on_meta
    from xllm_gen.runtime.loading.quant_config import parse_quant_config
    from xllm_gen.runtime.loading.quant_load import QuantLoad, packs_experts
    monkeypatch.delenv("XLLM_PACKED_QUANT", raising=False)
    qc = parse_quant_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}})
    with experts_on_meta():
        model = torch.nn.ModuleDict({"experts": FusedMoE(4, 32, 16, 2, True, "silu"),
                                     "norm": torch.nn.LayerNorm(32)})
    ql = QuantLoad(model, type("Ckpt", (), {"names": lambda self: []})(), qc)
    ql.device = torch.device("cuda")
    for dtype, want in ((torch.bfloat16, True), (torch.float32, False)):
        meta = torch.empty(4, 32, 32, device="meta", dtype=dtype)
        assert ql.packs("experts.gate_up_proj", meta) is want
        assert packs_experts(qc, torch.device("cuda"), dtype) is want
    assert model["experts"].gate_up_proj.is_meta


@pytest.mark.parametrize("packed", ["0", "1"])
def test_online_fp8_quantizes_the_experts(moe, tmp_path, packed, monkeypatch):
    """quantization="fp8" on a float MoE checkpoint: the experts stored per expert are quantized per row at load as
    the dense layers are (kept float8 with XLLM_PACKED_QUANT=1), with dynamic per-token activations on their input
    and intermediate; the router stays float. The reference: llm-compressor's FP8_DYNAMIC checkpoint of the same
    weights (per-channel scales, per-token activations) under transformers."""
    monkeypatch.setenv("XLLM_PACKED_QUANT", packed)
    _, ref = write_ct_fp8(moe, tmp_path / "ckpt", tmp_path / "ref", strategy="channel", act="token")
    llm = _llm(moe, quantization="fp8")
    layer = llm.engine.runner.model.model.layers[0].mlp
    assert layer.experts.act_quant.kind == "token" and layer.experts.act_quant_down.kind == "token"
    assert layer.gate.act_quant is None and (layer.experts.packed is not None) == (packed == "1")
    assert _greedy(llm) == _reference(ref, lambda m: act_quant_hooks(m, "token"), _fp8("token"))
