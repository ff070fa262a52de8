"""OPT-350m's form on tiny checkpoints (specs/opt.yaml): classic post-LN layers (`after_norm` steps: the residual
stream is normalized after each add, `do_layer_norm_before: false`, no final LayerNorm) and the embedding's own
width (`word_embed_proj_dim` 32 of hidden 64: decoder.project_in / project_out).

- greedy parity with transformers (float32, CPU) on the opt-350m-like checkpoint;
- sensitivity, same weights: the config switched to pre-LN layers (with `_remove_final_layer_norm`, so that no
  tensor is missing) changes transformers' tokens, and the engine follows (the post-LN step is live); project_in
  negated in the checkpoint changes transformers' tokens, and the engine follows (the projection is live);
- the final-LayerNorm switch `_remove_final_layer_norm` on a pre-LN checkpoint is served as transformers does.
"""
from __future__ import annotations

import numpy as np
import pytest

ARCH = "OPTForCausalLM"
PROMPTS = [np.random.default_rng(0).integers(0, 200, n).tolist() for n in (3, 9, 17, 30)]
STEPS = 16
OPT_350M = {"word_embed_proj_dim": 32, "do_layer_norm_before": False}
INIT = {"embed_std": 0.3}           # post-LN decodes flat with the default gains on the tiny config


def _engine(ckpt):
    from xllm_gen import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4) as llm:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def _hf(ckpt):
    from hf_ref import hf_greedy

    return hf_greedy(ckpt, PROMPTS, STEPS)


@pytest.mark.engine
@pytest.mark.slow      # ~25 s; the default run serves the same form through the conformance battery's OPT arm
def test_opt350m_form_matches_hf_and_each_feature_matters(tiny_checkpoint, tmp_path):
    import json

    from fixtures.tiny_hf import edit_config
    from safetensors.torch import load_file, save_file

    ckpt = tiny_checkpoint(ARCH, overrides=OPT_350M, init=INIT)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["word_embed_proj_dim"] == 32 and cfg["do_layer_norm_before"] is False
    want = _hf(ckpt)
    assert any(len(set(t)) > 3 for t in want), f"fixture: flat greedy output {want}"
    assert _engine(ckpt) == want

    pre = edit_config(ckpt, tmp_path / "pre_ln", lambda c: c.update(do_layer_norm_before=True,
                                                                    _remove_final_layer_norm=True))
    pre_want = _hf(pre)
    assert pre_want != want, "fixture: the post-LN form changes nothing in transformers' output"
    assert _engine(pre) == pre_want

    flipped = tmp_path / "project_in_negated"
    edit_config(ckpt, flipped, lambda c: None)
    (flipped / "model.safetensors").unlink()
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.decoder.project_in.weight"] = -tensors["model.decoder.project_in.weight"]
    save_file(tensors, flipped / "model.safetensors", metadata={"format": "pt"})
    flipped_want = _hf(flipped)
    assert flipped_want != want, "fixture: project_in changes nothing in transformers' output"
    assert _engine(flipped) == flipped_want


@pytest.mark.engine
@pytest.mark.slow
def test_remove_final_layer_norm(tiny_checkpoint, tmp_path):
    from fixtures.tiny_hf import edit_config

    ckpt = tiny_checkpoint(ARCH)
    no_final = edit_config(ckpt, tmp_path / "no_final", lambda c: c.update(_remove_final_layer_norm=True))
    want = _hf(no_final)
    assert want != _hf(ckpt), "fixture: the final LayerNorm changes nothing in transformers' output"
    assert _engine(no_final) == want
