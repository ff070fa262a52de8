"""Mamba-1's selective scan (the `mamba` block kind, runtime/layers/recurrent/mamba.py L.Mamba) on the tiny Mamba,
FalconMamba and Jamba checkpoints (features ON: projection and conv biases; Jamba: attention and MoE layers by their
periods, weighted inner norms):

- greedy parity with transformers float32 with chunked prefill (chunks of 5 tokens) over concurrent sequences;
- the state carries: zeroing only the SSM state (not the conv state) before every decode step changes the tokens;
- the inner RMSNorms of dt, B, C matter: the FalconMamba checkpoint served as a plain Mamba one (no norms), or a
  Jamba checkpoint with its inner-norm weights scaled, changes the tokens (and transformers agrees on the latter);
- residual_in_fp32 (decoder.residual_float32): bfloat16 tokens equal transformers' bfloat16 with the float32
  residual stream, and serving the stream in bfloat16 changes them (slow);
- TP: a channel count the TP size does not divide is refused naming the field; TP 2 parity (slow: x_proj's
  output all-reduced).
The plain parity arms (TP 1, TP 2) and the features-ON config are also the spec / conformance batteries'.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

PROMPTS = [[5, 17, 99, 3, 250, 8, 77, 41, 9, 300, 12], [7, 8, 9], list(range(20, 90, 3))]
MAX_TOKENS = 10


def _hf(ckpt, arch, dtype=torch.float32, prompts=PROMPTS):
    import transformers
    model = getattr(transformers, arch).from_pretrained(ckpt, dtype=dtype).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


def _engine(ckpt, dtype="float32", prompts=PROMPTS, **kw):
    from xllm_gen import LLM, SamplingParams
    with LLM(str(ckpt), device="cpu", dtype=dtype, **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["MambaForCausalLM",
                                  pytest.param("JambaForCausalLM", marks=pytest.mark.slow)])
def test_chunked_prefill_and_state(tiny_checkpoint, arch):
    ckpt = tiny_checkpoint(arch)
    want = _hf(ckpt, arch)
    assert _engine(ckpt, enable_chunked_prefill=True, max_num_batched_tokens=5, max_num_seqs=2) == want
    zeroed = _engine(ckpt, _debug={"zero_state_at_decode": ("ssm",)})
    assert zeroed != want, "zeroing the SSM state between decode steps did not change the tokens"


def test_falcon_mamba_inner_norms_matter(tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint("FalconMambaForCausalLM")
    want = _hf(ckpt, "FalconMambaForCausalLM", prompts=PROMPTS[:2])
    assert _engine(ckpt, prompts=PROMPTS[:2]) == want
    plain = tmp_path / "as_mamba"          # the same weights served by specs/mamba.yaml: no norms of dt, B, C
    shutil.copytree(ckpt, plain)
    cfg = json.loads((plain / "config.json").read_text())
    cfg.update(architectures=["MambaForCausalLM"], model_type="mamba")
    cfg.pop("mixer_rms_eps")
    (plain / "config.json").write_text(json.dumps(cfg))
    assert _engine(plain, prompts=PROMPTS[:2]) != want, "the weightless inner norms did not change the tokens"


@pytest.mark.slow
def test_jamba_inner_norm_weights_matter(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file
    ckpt = tiny_checkpoint("JambaForCausalLM")
    changed = tmp_path / "scaled"
    shutil.copytree(ckpt, changed)
    f = changed / "model.safetensors"
    tensors = load_file(f)
    names = [n for n in tensors if n.endswith(("dt_layernorm.weight", "b_layernorm.weight", "c_layernorm.weight"))]
    assert names
    g = torch.Generator().manual_seed(0)
    for n in names:
        tensors[n] = tensors[n] * (0.2 + 3 * torch.rand(tensors[n].shape, generator=g))
    save_file(tensors, str(f), metadata={"format": "pt"})
    want = _hf(changed, "JambaForCausalLM", prompts=PROMPTS[:2])
    assert want != _hf(ckpt, "JambaForCausalLM", prompts=PROMPTS[:2])
    assert _engine(changed, prompts=PROMPTS[:2]) == want


def test_tp_refuses_an_indivisible_channel_count(tiny_checkpoint):
    from xllm_gen.runtime.executor.tp_check import check_tensor_parallel
    from xllm_gen.runtime.loading import registry
    hf = json.loads((tiny_checkpoint("MambaForCausalLM") / "config.json").read_text())
    hf["intermediate_size"] = 150                      # 150 channels over 4 ranks
    model_module, _ = registry.resolve(hf)
    with pytest.raises(ValueError, match=r"150 channels \(config.json intermediate_size\)"):
        check_tensor_parallel(model_module, hf, 4)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["MambaForCausalLM", "FalconMambaForCausalLM", "JambaForCausalLM"])
def test_tp2_chunked_prefill(tiny_checkpoint, arch):
    ckpt = tiny_checkpoint(arch)
    assert _engine(ckpt, tensor_parallel_size=2, enable_chunked_prefill=True, max_num_batched_tokens=5) == \
        _hf(ckpt, arch)


@pytest.mark.slow
def test_residual_in_fp32_bfloat16(tiny_checkpoint):
    ckpt = tiny_checkpoint("MambaForCausalLM")
    want = _hf(ckpt, "MambaForCausalLM", dtype=torch.bfloat16)
    got = _engine(ckpt, dtype="bfloat16")
    assert got == want
    plain = tiny_checkpoint("MambaForCausalLM", overrides={"residual_in_fp32": False})
    assert _engine(plain, dtype="bfloat16") != got, "a bfloat16 residual stream gave the float32 stream's tokens"


def test_residual_float32_needs_plain_norm_steps(tmp_path):
    import contextlib
    import io
    from pathlib import Path

    from xllm_gen.codegen.cli import main as cli_main
    specs = tmp_path / "specs"
    specs.mkdir()
    shutil.copy(Path(__file__).resolve().parents[1] / "specs" / "llama.yaml", specs / "llama.yaml")
    (specs / "x.yaml").write_text(
        "extends: llama.yaml\nname: x\nclass_prefix: X\narchitectures: [XForCausalLM]\n"
        "variants: {Llama-3.2-1B: ~, Llama-3.1-8B: ~}\n"
        "decoder:\n  residual_float32: true\n  layers:\n    blocks:\n      post_attention_layernorm: ~\n"
        "    dataflow:\n      - parallel: [{norm: input_layernorm, block: self_attn}, "
        "{norm: input_layernorm, block: mlp}]\n", encoding="utf-8")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli_main(["--dry-run", str(specs / "x.yaml")]) != 0
    assert "x.yaml:" in err.getvalue() and "decoder.residual_float32: every residual step" in err.getvalue()


def test_mamba2_time_step_max_none_is_no_bound():
    """codegen/README.md's mamba2 `time_step_max`: none means no bound; an expression that gives None (a config
    whose limit is unset) builds the mixer with an infinite upper clamp instead of failing at compile time."""
    from xllm_gen.runtime.layers.recurrent.mamba2 import Mamba2
    m = Mamba2(heads=2, head_dim=4, groups=1, state_size=4, conv_kernel=2, chunk_size=4, eps=1e-5,
               time_step_limit=(0.001, None))
    assert m.time_step_limit == (0.001, float("inf"))
