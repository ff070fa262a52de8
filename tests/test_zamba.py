"""Zamba v1 (specs/zamba.yaml): Zamba2's layer structure (one shared transformer block over [residual | embeddings],
a per-layer linear into the Mamba layer's input) with MULTI-HEAD Mamba-1 layers (the `mamba` block's `heads` /
`head_dim`: per-head x_proj / dt_proj, B and C per head in the scan; in_proj rows interleaving x and the gate,
`segments_interleaved` on a per-layer computed checkpoint name). On the tiny checkpoint (tests/fixtures/tiny_hf.py
ARCH_DEFAULTS: 2 Mamba heads, two hybrid layers sharing one block, projection biases on):

- greedy parity with transformers float32 with chunked prefill (chunks of 5 tokens) over concurrent sequences;
- the state carries: zeroing the SSM state before every decode step changes the tokens;
- the interleaved in_proj layout is load-bearing: the spec without `segments_interleaved` diverges (slow, verify);
- the guard: an attention width other than 2 * hidden_size, a conv activation other than silu are refused by name.
The plain parity arms (TP 1, TP 2) and the features-ON config are the spec / conformance batteries'.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ARCH = "ZambaForCausalLM"
PROMPTS = [[5, 17, 99, 3, 250, 8, 77, 41, 9, 300, 12], [7, 8, 9], list(range(20, 90, 3))]
MAX_TOKENS = 10


def _hf(ckpt, prompts=PROMPTS):
    import transformers
    model = transformers.ZambaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None          # as the engine's ignore_eos
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


def _engine(ckpt, prompts=PROMPTS, **kw):
    from xllm_gen import LLM, SamplingParams
    with LLM(str(ckpt), device="cpu", dtype="float32", **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_chunked_prefill_and_state(tiny_checkpoint):
    ckpt = tiny_checkpoint(ARCH)
    want = _hf(ckpt)
    assert _engine(ckpt, enable_chunked_prefill=True, max_num_batched_tokens=5, max_num_seqs=2) == want
    zeroed = _engine(ckpt, _debug={"zero_state_at_decode": ("ssm",)})
    assert zeroed != want, "zeroing the SSM state between decode steps did not change the tokens"


def test_guard_refuses_by_name():
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.generated.zamba.model import Config
    base = tiny_config(ARCH).to_dict()
    Config.from_hf(base)
    for field, value in (("attention_hidden_size", 3 * base["hidden_size"]), ("hidden_mamba_act", "gelu"),
                         ("mamba_dt_rank", "auto")):
        with pytest.raises(Exception, match=field):
            Config.from_hf({**base, field: value})


@pytest.mark.slow
def test_interleaved_in_proj_is_load_bearing(tiny_checkpoint, tmp_path):
    from xllm_gen.codegen.verify import verify
    ckpt = tiny_checkpoint(ARCH)
    text = (ROOT / "specs" / "zamba.yaml").read_text()
    assert text.count("    segments_interleaved: true\n") == 2
    spec = tmp_path / "zamba.yaml"
    spec.write_text(text.replace("    segments_interleaved: true\n", ""))
    shutil.copy(ROOT / "specs" / "spec.schema.json", tmp_path / "spec.schema.json")
    assert not verify(spec, ckpt, max_tokens=8).ok
