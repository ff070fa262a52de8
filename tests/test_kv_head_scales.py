"""fp8 KV-cache scales per KV head (compressed-tensors `kv_cache_scheme` strategy `attn_head`: `<attn>.k_scale` /
`.v_scale` of shape [kv_heads, 1, 1]; [kv_heads] read too): the cache holds round(K_h / k_scale[h]) per head h.

The tiny Llama is rescaled per KV head so that no single scale fits both heads: head 0's K times 300 (past fp8's
448) and head 1's divided by 300 (below e4m3's normal range), the query heads of each group divided by the same
factor (the scores are unchanged), V likewise with o_proj's columns: the same model up to rounding. Reference:
transformers with K / V rounded per head with the same scales (an attention-interface emulation written here).
Sensitivity: the heads' scales swapped, or one per-tensor scale (their max), move the logits far from the float32
model. On CUDA the same scales run through FlashInfer (q folded per KV head) and the Triton kernels
(tests/test_attention_epilogue.py; tests/gpu/test_gpu_sinks_kv_scales.py).
"""
from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from hf_ref import hf_greedy, hf_model, hf_prefill_logits
from safetensors.torch import load_file, save_file

ARCH = "LlamaForCausalLM"
PROMPTS = [[97, 11, 187, 0, 57, 67], [78, 67, 315, 96, 374], [3, 17, 99, 102, 7, 7, 300, 41, 5]]
N_NEW = 10
K_FACTORS, V_FACTORS = (300.0, 1 / 300.0), (1e-3, 30.0)       # per KV head
OPTS = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=8, max_model_len=256)
CT_HEAD = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "attn_head",
           "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax", "observer_kwargs": {}}


def _scaled_per_head(src: Path, ref: Path) -> Path:
    """`src` with each KV head's K and V moved by its own factor (the model unchanged up to rounding)."""
    cfg = json.loads((src / "config.json").read_text())
    H, Hk = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or cfg["hidden_size"] // H
    g = H // Hk
    sd = {k: v.float().clone() for k, v in load_file(str(src / "model.safetensors")).items()}
    for name in list(sd):
        for h in range(Hk):
            kf, vf = K_FACTORS[h], V_FACTORS[h]
            if name.endswith("self_attn.k_proj.weight"):
                sd[name][h * D:(h + 1) * D] *= kf
            elif name.endswith("self_attn.q_proj.weight"):
                sd[name][h * g * D:(h + 1) * g * D] /= kf
            elif name.endswith("self_attn.v_proj.weight"):
                sd[name][h * D:(h + 1) * D] *= vf
            elif name.endswith("self_attn.o_proj.weight"):
                sd[name][:, h * g * D:(h + 1) * g * D] /= vf
    ref.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (ref / f.name).write_bytes(f.read_bytes())
    save_file(sd, str(ref / "model.safetensors"), metadata={"format": "pt"})
    return ref


def _with_fp8_kv(ckpt, fn, scales=None, record=None):
    """Run `fn()` with transformers' attention seeing K / V [B, Hk, L, D] rounded to fp8 e4m3 per KV head
    (`scales` {layer: (k [Hk], v [Hk])}; None: 1.0), or recording each layer's per-head amax into `record`."""
    import transformers.models.llama.modeling_llama as ml
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    def rnd(x, s):
        s = s.view(1, -1, 1, 1)
        return (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float().mul(s).to(x.dtype)

    def attn(module, query, key, value, *args, **kwargs):
        i = module.layer_idx
        if record is not None:
            old = record.get(i, (torch.zeros(key.shape[1]), torch.zeros(key.shape[1])))
            record[i] = (torch.maximum(old[0], key.abs().amax((0, 2, 3))), torch.maximum(old[1], value.abs().amax((0, 2, 3))))
        elif scales is not None:
            key, value = rnd(key, scales[i][0]), rnd(value, scales[i][1])
        return ml.eager_attention_forward(module, query, key, value, *args, **kwargs)
    AttentionInterface.register("xllm_fp8_kv_head", attn)
    AttentionMaskInterface.register("xllm_fp8_kv_head", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    model = hf_model(ckpt)
    old = model.config._attn_implementation
    model.set_attn_implementation("xllm_fp8_kv_head")
    try:
        return fn()
    finally:
        model.set_attn_implementation(old)


def _write_scales(ref: Path, dst: Path, scales: dict, shape=(-1, 1, 1), scheme=CT_HEAD) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in ref.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(ref / "model.safetensors"))
    for i, (k, v) in scales.items():
        sd[f"model.layers.{i}.self_attn.k_scale"] = k.float().reshape(shape).contiguous()
        sd[f"model.layers.{i}.self_attn.v_scale"] = v.float().reshape(shape).contiguous()
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    if scheme is not None:
        cfg["quantization_config"] = {"config_groups": {}, "format": "float-quantized", "ignore": [],
                                      "kv_cache_scheme": scheme, "quant_method": "compressed-tensors",
                                      "quantization_status": "compressed"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def per_head(tiny_checkpoint, tmp_path_factory):
    d = tmp_path_factory.mktemp("kvhead")
    ref = _scaled_per_head(Path(tiny_checkpoint(ARCH)), d / "ref")
    amax: dict = {}
    with torch.no_grad():
        _with_fp8_kv(ref, lambda: hf_model(ref)(input_ids=torch.tensor([sum(PROMPTS, [])])), record=amax)
    scales = {i: (1.25 * 1.4143 * k / 448, 1.25 * v / 448) for i, (k, v) in amax.items()}
    return ref, scales, _write_scales(ref, d / "ckpt", scales)


def _llm(path, **kw):
    from xllm_gen import LLM
    return LLM(model=str(path), **OPTS, **kw)


def _greedy(llm, prompts=PROMPTS):
    from xllm_gen import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _err(llm, ref, seq) -> float:
    want = hf_prefill_logits(ref, seq)
    got = torch.as_tensor(llm.prefill_logits(seq)).float()[:, : want.shape[1]]
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.engine
def test_per_head_kv_scales(per_head, tmp_path):
    """Greedy tokens and prefill logits equal transformers' with K / V rounded per head with the same scales; each
    layer holds its heads' scales. Sensitivity: the two heads' scales swapped move the logits (relative to the
    float32 model) by far more than the per-head scales do."""
    ref, scales, ckpt = per_head
    ks = scales[0][0]
    assert ks[0] > 100 * ks[1], ks                       # the heads' ranges lie far apart
    llm = _llm(ckpt, kv_cache_dtype="fp8")
    attn = llm.engine.runner.model.model.layers[0].self_attn.attn
    assert isinstance(attn.k_scale, torch.Tensor) and torch.equal(attn.k_scale.flatten(), ks.float())
    got = _greedy(llm)
    assert got == _with_fp8_kv(ref, lambda: hf_greedy(ref, PROMPTS, N_NEW), scales)
    seq = PROMPTS[2] + got[2]
    want = _with_fp8_kv(ref, lambda: hf_prefill_logits(ref, seq), scales)
    assert (torch.as_tensor(llm.prefill_logits(seq)).float()[:, : want.shape[1]] - want).abs().max() < 1e-3
    err = _err(llm, ref, seq)
    swapped = {i: (k.flip(0), v.flip(0)) for i, (k, v) in scales.items()}
    err_swapped = _err(_llm(_write_scales(ref, tmp_path / "swapped", swapped), kv_cache_dtype="fp8"), ref, seq)
    print(f"\n[fp8 KV per head] relative logit error vs float32: per-head scales {err:.2e}, swapped {err_swapped:.2e}")
    assert err < 0.05 and err_swapped > 10 * err, (err, err_swapped)


@pytest.mark.slow
@pytest.mark.engine
def test_one_scale_per_tensor_is_worse(per_head, tmp_path):
    """The same checkpoint with one scale per tensor (the larger head's): measured 2.6e-2 with per-head scales,
    3.0e-1 with one per tensor (head 1's K underflows)."""
    ref, scales, ckpt = per_head
    seq = PROMPTS[2]
    err = _err(_llm(ckpt, kv_cache_dtype="fp8"), ref, seq)
    tensor = {i: (k.max().reshape(1), v.max().reshape(1)) for i, (k, v) in scales.items()}
    err_tensor = _err(_llm(_write_scales(ref, tmp_path / "t", tensor, shape=(1,)), kv_cache_dtype="fp8"), ref, seq)
    print(f"\n[fp8 KV] per-head scales {err:.2e}, one per tensor {err_tensor:.2e}")
    assert err_tensor > 4 * err, (err, err_tensor)


@pytest.mark.engine
def test_per_head_scale_forms_and_faults(per_head, tmp_path):
    """[kv_heads] without a kv_cache_scheme reads the same; one value per head, all equal, is per tensor (a float); a
    scale of another length names the tensor; kv_cache_scheme strategy 'channel' is refused naming the field."""
    from xllm_gen.runtime.loading.quant_config import QuantConfigError, parse_quant_config

    ref, scales, _ = per_head
    llm = _llm(_write_scales(ref, tmp_path / "flat", scales, shape=(-1,), scheme=None), kv_cache_dtype="fp8")
    attn = llm.engine.runner.model.model.layers[1].self_attn.attn
    assert torch.equal(attn.v_scale.flatten(), scales[1][1].float())
    same = {i: (k.max().expand(2), v.max().expand(2)) for i, (k, v) in scales.items()}
    llm = _llm(_write_scales(ref, tmp_path / "same", same), kv_cache_dtype="fp8")
    assert llm.engine.runner.model.model.layers[0].self_attn.attn.k_scale == float(scales[0][0].max())
    three = {0: (torch.ones(3), torch.ones(3)), **{i: v for i, v in scales.items() if i}}
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.self_attn\.k_scale' has shape \(3, 1, 1\): a "
                                         r"KV-cache scale is one value per tensor, or one per KV head .* holds 2 KV heads"):
        _llm(_write_scales(ref, tmp_path / "three", three), kv_cache_dtype="fp8")
    assert parse_quant_config({"quantization_config": {"config_groups": {}, "format": "float-quantized",
                                                       "quant_method": "compressed-tensors",
                                                       "kv_cache_scheme": CT_HEAD}}).kv_scheme == "head"
    with pytest.raises(QuantConfigError, match=r"kv_cache_scheme\.strategy='channel' is not supported"):
        parse_quant_config({"quantization_config": {"config_groups": {}, "format": "float-quantized",
                                                    "quant_method": "compressed-tensors",
                                                    "kv_cache_scheme": {**CT_HEAD, "strategy": "channel"}}})


def test_per_head_scales_shard_with_the_kv_heads():
    """Rank r holds its KV heads' scales: split when the heads outnumber the ranks, replicated (head r // (tp / H))
    when the ranks outnumber them, as the K / V projection rows are."""
    from xllm_gen.runtime.loading.kv_scales import KVScaleError, _scale_value

    t = torch.tensor([1.0, 2.0, 3.0, 4.0]).reshape(4, 1, 1)
    for tp, rank, local, want in ((1, 0, 4, [1, 2, 3, 4]), (2, 1, 2, [3, 4]), (8, 5, 1, [3])):
        got = _scale_value("k", t, types.SimpleNamespace(num_kv_heads=local), "attn", tp, rank, "cpu")
        assert got.flatten().tolist() == want and got.shape == (len(want), 1)
    with pytest.raises(KVScaleError, match="holds 3 KV heads on each of 2 TP ranks"):
        _scale_value("k", t, types.SimpleNamespace(num_kv_heads=3), "attn", 2, 0, "cpu")


def test_per_head_scales_served_on_cuda(monkeypatch):
    """Decided at load on the CPU (no GPU needed): per-head scales are no longer refused on CUDA (q folded per KV
    head before FlashInfer, the output times v_scale after it; the Triton decode and store kernels read them per
    head: tests/test_attention_epilogue.py); the FlashInfer backend (a recorder here) is built."""
    import xllm_gen.runtime.attention.flashinfer_backend as fb
    from xllm_gen.runtime.attention.base import make_variant
    from xllm_gen.runtime.executor.model_runner import ModelRunner

    class Recorder:
        workspace_size = staticmethod(fb.FlashInferBackend.workspace_size)

        def __init__(self, **kw):
            self.kw, self.num_sms, self.workspace, self.workspace_bytes = kw, 132, object(), 1 << 40

    monkeypatch.setattr(fb, "FlashInferBackend", Recorder)
    layer = types.SimpleNamespace(head_dim=64, num_heads=4, num_kv_heads=2, scale=0.125, variant=make_variant(),
                                  k_scale=torch.tensor([[2.0], [3.0]]), v_scale=1.0)
    runner = types.SimpleNamespace(device=torch.device("cuda"), debug={}, attn_layers=[layer], enforce_eager=False,
                                   graph_buckets=(1,), max_num_seqs=2, block_size=16, dtype=torch.bfloat16,
                                   max_model_len=64, num_kv_blocks=16, max_num_batched_tokens=64,
                                   kv_dtype=torch.float8_e4m3fn)
    assert isinstance(ModelRunner._make_backend(runner), Recorder)


@pytest.mark.slow
@pytest.mark.engine
def test_per_head_kv_scales_tp2(per_head):
    """TP 2: each rank holds one KV head and its own head's scales."""
    ref, scales, ckpt = per_head
    llm = _llm(ckpt, kv_cache_dtype="fp8", tensor_parallel_size=2)
    try:
        assert _greedy(llm) == _with_fp8_kv(ref, lambda: hf_greedy(ref, PROMPTS, N_NEW), scales)
    finally:
        llm.shutdown()
