"""GPT-OSS's primitives (specs/gpt_oss.yaml): attention sinks, router bias, per-expert biases, the clamped
SwiGLU, softmax over the top-k logits, and the experts' transposed / interleaved checkpoint layout.

Sensitivity arms: each feature switched off or changed changes transformers' greedy tokens, and the engine
still gives transformers' tokens (the spec battery checks parity with all of them on). Unit tests: the
layout view, the clamped SwiGLU, the sinks in the torch attention against transformers' eager formula, and
the compile errors of the new keys."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

ARCH = "GptOssForCausalLM"
ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "specs" / "gpt_oss.yaml"


def _prompts(seed: int = 5):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 400, n).tolist() for n in (5, 11, 19)]


def _engine_tokens(ckpt, prompts, tp=1):
    from xllm_gen import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4, tensor_parallel_size=tp) as llm:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _rewrite_tensors(ckpt, out: Path, suffix: str, fn) -> Path:
    """A copy of checkpoint `ckpt` whose tensors ending in `suffix` are replaced by fn(tensor)."""
    from fixtures.tiny_hf import edit_config
    from safetensors.torch import load_file, save_file

    arm = edit_config(ckpt, out, lambda cfg: None)
    hits = 0
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        tensors = load_file(f)
        for name in tensors:
            if name.endswith(suffix):
                tensors[name] = fn(tensors[name])
                hits += 1
        (arm / f.name).unlink()
        save_file(tensors, arm / f.name, metadata={"format": "pt"})
    assert hits == 3, f"{suffix}: {hits} tensors (one per layer expected)"
    return arm


# ------------------------------------------------------------------------------------- sensitivity arms
def _strong(t: torch.Tensor) -> torch.Tensor:
    """Sink logits of a few units (the tiny checkpoint's are N(0, 0.1), too weak to move greedy tokens)."""
    return torch.randn(t.shape, generator=torch.Generator().manual_seed(7)) * 2 + 1


@pytest.mark.engine
@pytest.mark.parametrize("suffix, fn", [("self_attn.sinks", _strong), ("mlp.router.bias", torch.zeros_like),
                                        ("mlp.experts.gate_up_proj_bias", torch.zeros_like),
                                        ("mlp.experts.down_proj_bias", torch.zeros_like)],
                         ids=["sinks_strong", "router_bias_zeroed", "gate_up_bias_zeroed", "down_bias_zeroed"])
def test_changing_a_feature_changes_the_output(suffix, fn, tiny_checkpoint, tmp_path):
    from hf_ref import hf_greedy

    ckpt = tiny_checkpoint(ARCH)
    prompts = _prompts()
    base = hf_greedy(ckpt, prompts, 12)          # the engine gives these: the spec battery's parity arm
    arm = _rewrite_tensors(ckpt, tmp_path / "arm", suffix, fn)
    want = hf_greedy(arm, prompts, 12)
    assert want != base, f"changing {suffix} does not change transformers' output"
    assert _engine_tokens(arm, prompts) == want


@pytest.mark.engine
@pytest.mark.parametrize("field, value", [("swiglu_limit", 0.25), ("swiglu_alpha", 0.5)])
def test_activation_parameters_matter(field, value, tiny_checkpoint, tmp_path):
    """The clamp limit (bound in the tiny config) and alpha are read from config.json and reach the experts."""
    from fixtures.tiny_hf import edit_config
    from hf_ref import hf_greedy

    ckpt = tiny_checkpoint(ARCH)
    prompts = _prompts()
    base = hf_greedy(ckpt, prompts, 12)
    arm = edit_config(ckpt, tmp_path / "arm", lambda cfg: cfg.__setitem__(field, value))
    want = hf_greedy(arm, prompts, 12)
    assert want != base, f"{field}={value} does not change transformers' output"
    assert _engine_tokens(arm, prompts) == want


@pytest.mark.engine
def test_softmax_before_the_top_k_changes_the_output(tiny_checkpoint, tmp_path, monkeypatch):
    """GPT-OSS takes the softmax over the top-k logits (the spec: norm_topk_prob: true). Softmax over all experts
    first, unrenormalized (a child spec with norm_topk_prob: false), changes the output, and matches a
    transformers router patched to do the same."""
    import torch.nn.functional as F
    from fixtures.tiny_hf import edit_config
    from hf_ref import hf_greedy
    from transformers.models.gpt_oss import modeling_gpt_oss as hf

    from xllm_gen.codegen.cli import main as cli_main

    ckpt = tiny_checkpoint(ARCH)
    prompts = _prompts()
    base = hf_greedy(ckpt, prompts, 12)
    child = tmp_path / "child.yaml"
    child.write_text(f"spec_version: 2\nextends: {SPEC}\nname: gpt_oss_softmax_first\n"
                     "architectures: [GptOssSoftmaxFirstForCausalLM]\n"
                     "decoder:\n  layers:\n    blocks:\n      mlp: {norm_topk_prob: false}\n")
    assert cli_main([str(child), "--out", str(tmp_path / "generated")]) == 0
    monkeypatch.setenv("XLLM_GEN_PATH", str(tmp_path / "generated"))
    arm = edit_config(ckpt, tmp_path / "arm",
                      lambda cfg: cfg.__setitem__("architectures", ["GptOssSoftmaxFirstForCausalLM"]))
    got = _engine_tokens(arm, prompts)

    def softmax_first(self, hidden_states):
        logits = F.linear(hidden_states, self.weight, self.bias)
        scores, ids = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        return logits, scores, ids

    monkeypatch.setattr(hf.GptOssTopKRouter, "forward", softmax_first)
    want = hf_greedy(ckpt, prompts, 12)
    assert want != base, "softmax before the top-k does not change transformers' output"
    assert got == want


@pytest.mark.engine
def test_sinks_with_chunked_prefill_and_batched_decode(tiny_checkpoint, tmp_path):
    """Strong sinks through the other attention paths: prompts prefilled in chunks of 4 tokens (later chunks
    attend to cached keys) and all prompts decoded in one batch give transformers' tokens."""
    from hf_ref import hf_greedy

    from xllm_gen import LLM, SamplingParams

    arm = _rewrite_tensors(tiny_checkpoint(ARCH), tmp_path / "arm", "self_attn.sinks", _strong)
    prompts = _prompts(9)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(model=str(arm), device="cpu", dtype="float32", block_size=4, enable_chunked_prefill=True,
             max_num_batched_tokens=4) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == hf_greedy(arm, prompts, 12)


def test_cuda_path_serves_sinks():
    """The CUDA attention path no longer refuses attention sinks (decided at load, on the CPU): FlashInfer's output
    is rescaled from its log-sum-exp (tests/test_attention_epilogue.py; on a GPU tests/gpu/test_gpu_sinks_kv_scales.py
    runs GPT-OSS with graphs against transformers)."""
    import inspect

    from xllm_gen.runtime.attention.base import cuda_attention_refusal
    assert cuda_attention_refusal([64]) is None and "sinks" not in inspect.signature(cuda_attention_refusal).parameters


# ------------------------------------------------------------------------------------------------ units
def test_layout_view_reads_transposed_interleaved_slices():
    from xllm_gen.runtime.loading.weights import LayoutView, TensorLayout

    E, H, I = 3, 5, 4
    canon = torch.randn(E, 2 * I, H)                                   # per expert: gate rows | up rows
    stored = torch.stack([canon[:, :I], canon[:, I:]], dim=2).reshape(E, 2 * I, H).transpose(1, 2).contiguous()
    v = LayoutView(stored, TensorLayout("x", transpose=True, interleave=2, dim=1))
    assert v.get_shape() == [E, 2 * I, H]
    assert torch.equal(v[:], canon)
    assert torch.equal(v[1:2, I + 1:I + 3, 1:4], canon[1:2, I + 1:I + 3, 1:4])       # one rank's rows of `up`
    bias = torch.randn(E, 2 * I)
    inter = torch.stack([bias[:, :I], bias[:, I:]], dim=2).reshape(E, 2 * I)
    assert torch.equal(LayoutView(inter, TensorLayout("b", interleave=2, dim=1))[:, 1:3], bias[:, 1:3])


def test_clamped_swiglu_matches_transformers():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from xllm_gen.runtime.layers import gated_act

    cfg = GptOssConfig(hidden_size=8, intermediate_size=6, num_local_experts=2, swiglu_limit=0.7, swiglu_alpha=1.3)
    x = torch.randn(10, 12) * 2
    inter = torch.stack([x[:, :6], x[:, 6:]], dim=-1).reshape(10, 12)      # HF's gate / up interleaving
    want = GptOssExperts(cfg)._apply_gate(inter)
    assert torch.equal(gated_act("swiglu_clamped", alpha=1.3, limit=0.7)(x), want)
    assert not torch.allclose(gated_act("swiglu_clamped", alpha=1.3, limit=None)(x), want)


@pytest.mark.parametrize("window", [None, 3])
def test_sinks_in_torch_attention_match_transformers_eager(window):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from xllm_gen.runtime.attention.torch_ref import attend

    torch.manual_seed(0)
    L, H, Hk, D = 7, 4, 2, 8
    q, k, v = torch.randn(L, H, D), torch.randn(L, Hk, D), torch.randn(L, Hk, D)
    sinks = torch.randn(H)
    mask = torch.zeros(L, L)
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    hidden = (j > i) | ((j <= i - window) if window else torch.zeros(L, L, dtype=torch.bool))
    mask = mask.masked_fill(hidden, float("-inf"))

    class M(torch.nn.Module):
        num_key_value_groups, training = H // Hk, False

    m = M()
    m.sinks = sinks
    want, _ = eager_attention_forward(m, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                      mask[None, None], scaling=D ** -0.5)
    got = attend(q, k, v, D ** -0.5, 0, window, None, sinks)
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(attend(q, k, v, D ** -0.5, 0, window), want[0], atol=1e-3)


def _compile_child(tmp_path, body: str):
    from xllm_gen.codegen.compiler import compile_spec

    p = tmp_path / "child.yaml"
    p.write_text(f"spec_version: 2\nextends: {SPEC}\nname: gpt_oss_child\narchitectures: [GptOssChild]\n" + body)
    return compile_spec(p)


@pytest.mark.parametrize("body, match", [
    ("weights:\n  model.layers.{i}.mlp.experts.down_proj_bias: {transpose: true}\n",
     r"down_proj_bias'\]\.transpose: .* is not a matrix"),
    ("weights:\n  model.layers.{i}.mlp.experts.down_proj: {segments_interleaved: true}\n",
     r"segments_interleaved: the parameter has no segments"),
    ("weights:\n  model.layers.{i}.mlp.router.weight: {transpose: false}\n",
     r"give `from` \(the checkpoint tensor\(s\)\), or a layout"),
    ("decoder:\n  layers:\n    blocks:\n      mlp: {activation: {kind: swiglu_clamped, alpha: 1.0, limit: -1}}\n",
     r"activation\.limit"),
])
def test_layout_and_activation_errors_are_located(tmp_path, body, match):
    from xllm_gen.codegen.errors import SpecError

    with pytest.raises(SpecError, match=match) as e:
        _compile_child(tmp_path, body)
    assert "child.yaml:" in str(e.value)


@pytest.mark.engine
@pytest.mark.slow
def test_expert_parallel_with_biases_matches_hf_at_tp2(tiny_checkpoint, tmp_path, monkeypatch):
    """GPT-OSS with `parallel: expert` (whole experts per rank, each rank adding its own experts' down biases),
    compiled from a child spec, serves the tiny checkpoint at TP 2 with transformers' greedy tokens (the battery's
    TP 2 arm covers `parallel: tensor`, where rank 0 alone adds the down biases)."""
    from fixtures.tiny_hf import edit_config
    from hf_ref import hf_greedy

    from xllm_gen.codegen.cli import main as cli_main

    child = tmp_path / "child.yaml"
    child.write_text(f"spec_version: 2\nextends: {SPEC}\nname: gpt_oss_ep\narchitectures: [GptOssEPForCausalLM]\n"
                     "decoder:\n  layers:\n    blocks:\n      mlp: {parallel: expert}\n")
    assert cli_main([str(child), "--out", str(tmp_path / "generated")]) == 0
    monkeypatch.setenv("XLLM_GEN_PATH", str(tmp_path / "generated"))
    ckpt = tiny_checkpoint(ARCH)
    ep = edit_config(ckpt, tmp_path / "ep", lambda cfg: cfg.__setitem__("architectures", ["GptOssEPForCausalLM"]))
    prompts = _prompts()
    assert _engine_tokens(ep, prompts, tp=2) == hf_greedy(ckpt, prompts, 12)


def test_clamped_swiglu_in_a_dense_gated_mlp(tmp_path):
    """The activation form is general: a dense gated MLP (here Llama's) takes it as the experts do; the generated
    module builds its activation with the spec's parameters (config symbols and literals) and --explain --tp 2
    builds the model."""
    from xllm_gen.codegen.cli import main as cli_main
    from xllm_gen.codegen.compiler import compile_spec

    p = tmp_path / "dense.yaml"
    p.write_text(f"spec_version: 2\nextends: {ROOT / 'specs' / 'llama.yaml'}\nname: dense_clamped\n"
                 "architectures: [DenseClampedForCausalLM]\n"
                 "config:\n  swiglu_limit: {type: float, from: swiglu_limit, optional: true}\n  hidden_act: ~\n"
                 "config_ignore: [hidden_act]\n"
                 "decoder:\n  layers:\n    blocks:\n"
                 "      mlp: {activation: {kind: swiglu_clamped, alpha: 1.5, limit: swiglu_limit}}\n")
    compiled = compile_spec(p)
    src = compiled.files["model.py"]
    assert "self.act_fn = L.gated_act('swiglu_clamped', alpha=1.5, limit=config.swiglu_limit)" in src
    assert cli_main(["--explain", str(p), "--tp", "2"]) == 0


# the config.json of the released gpt-oss-20b (transformers 4.55 form)
RELEASED_CONFIG = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}


def test_released_config_is_read():
    """The released config.json reads as the gpt-oss-20b variant, with its MXFP4 quantization_config (served:
    tests/test_mxfp4.py) or without it (a dequantized copy)."""
    import copy

    from xllm_gen.generated.gpt_oss.model import Config

    for cfg in (copy.deepcopy(RELEASED_CONFIG), {k: v for k, v in RELEASED_CONFIG.items() if k != "quantization_config"}):
        c = Config.from_hf(cfg)
        assert (c.num_local_experts, c.num_experts_per_tok, c.swiglu_limit, c.rope_scaling["rope_type"]) == \
            (32, 4, 7.0, "yarn")
        assert c.layer_types[:2] == ("sliding_attention", "full_attention") and c.sliding_window == 128
    bad = copy.deepcopy(RELEASED_CONFIG)
    bad["quantization_config"]["quant_method"] = "mxfp8"
    with pytest.raises(ValueError, match="quantization_config: quant_method='mxfp8' is not supported"):
        Config.from_hf(bad)
