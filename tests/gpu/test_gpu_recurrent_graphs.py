"""Decode CUDA graphs of models with recurrent-state layers on the GPU (marker `gpu`; skipped without CUDA).

For each recurrent spec (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: gated DeltaNet; Mamba-2, Bamba, GraniteMoeHybrid:
Mamba-2; LFM2: short conv), on a tiny bf16 checkpoint (`checkpoint`: attention heads of 128, Mamba-2 heads of 64,
3 layers):
- the runner captures a decode graph per bucket (1, 2, 4, 8, 16), with the state-slot input, and says so in one
  log line; prefill graphs stay off (a prefill mixer runs per sequence from host slot values);
- greedy tokens with the graphs equal those of an engine built with enforce_eager=True: 7 concurrent sequences of
  different prompt lengths and different output lengths, so the decode batch shrinks 7 .. 1 and pads inside buckets
  8 and 4 (a divergence passes only at a bf16 near tie: fixtures/graph_compare.py);
- one padded graph step (3 sequences in bucket 4) changes exactly its sequences' state slots and the scratch slot;
- sensitivity, on the graph engine: zeroing the states before each decode step, or pointing the padding rows at
  slot 0 (a live sequence's) instead of the scratch slot, changes the tokens.
Numbers go to $XLLM_TEST_REPORT when set.
"""
from __future__ import annotations

import json
import logging
import random

import pytest
import torch
from fixtures.graph_compare import _compare, batch_noise
from fixtures.recurrent_graphs import RECURRENT_ARCHS, padded_step_keeps_other_slots
from fixtures.report import report as _report

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT_LENS = (5, 40, 100, 17, 63, 2, 31)
MAX_TOKENS = (24, 9, 17, 3, 30, 12, 6)        # batches 7, 6, 5, 4, 3, 2, 1 over the run
MAX_NUM_SEQS = 16
# attention heads of 128 (FlashInfer's kernels) where the model has attention; Mamba-2 mixers of 8 heads of 64
# (hidden 256 * expand 2); 3 layers, the tiny fixture's layer patterns (tests/fixtures/tiny_hf.py ARCH_DEFAULTS)
SIZES = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128, intermediate_size=512,
             max_position_embeddings=1024)
MAMBA = {"Mamba2ForCausalLM": dict(num_heads=8, head_dim=64),
         "BambaForCausalLM": dict(mamba_n_heads=8, mamba_d_head=64, mamba_expand=2),
         "GraniteMoeHybridForCausalLM": dict(mamba_n_heads=8, mamba_d_head=64, mamba_expand=2),
         # their specs' guards: MLA / shared-attention adapters with as many KV heads as query heads
         "KimiLinearForCausalLM": dict(num_key_value_heads=2, qk_nope_head_dim=64, qk_rope_head_dim=64,
                                       v_head_dim=128),   # MLA on CUDA: values as wide as q / k (else refused)
         "Zamba2ForCausalLM": dict(num_key_value_heads=2)}


def checkpoint(architecture: str, out):
    import transformers
    from fixtures.tiny_hf import make_tiny_checkpoint, model_class
    if not hasattr(transformers, architecture):
        pytest.skip(f"transformers {transformers.__version__} (the reference) has no {architecture}")
    default = model_class(architecture).config_class().to_dict()
    overrides = {k: v for k, v in SIZES.items() if k in default}
    if architecture == "Mamba2ForCausalLM":
        overrides = {"hidden_size": 256}
    overrides.update(MAMBA.get(architecture, {}))
    return make_tiny_checkpoint(architecture, out, overrides=overrides, seed=0)


def _prompts(ckpt):
    rng = random.Random(7)
    vocab = json.loads((ckpt / "config.json").read_text()).get("vocab_size", 1000)
    return [[rng.randrange(min(vocab, 5000)) for _ in range(n)] for n in PROMPT_LENS]


def _generate(llm, prompts, max_tokens=MAX_TOKENS):
    from xllm_gen import SamplingParams
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in max_tokens]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("architecture", RECURRENT_ARCHS)
def test_recurrent_decode_graphs_vs_eager(architecture, tmp_path, caplog):
    from xllm_gen import LLM
    ckpt = checkpoint(architecture, tmp_path / "ckpt")
    prompts = _prompts(ckpt)
    kw = dict(dtype="bfloat16", max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=512, max_model_len=512,
              enable_prefix_caching=False)

    try:
        llm = LLM(str(ckpt), enforce_eager=True, **kw)
    except NotImplementedError as e:     # a documented CUDA refusal at load (tests/test_cuda_refusal.py), by name
        pytest.skip(f"refused on CUDA: {e}")
    with llm:
        assert llm.engine.runner.graphs is None
        eager = _generate(llm, prompts)
        # the eager kernels' own noise between batch compositions (each request alone): a MoE's expert GEMMs change
        # with the row count as a padded graph bucket's do, and a router near-tie moves logits past the lm_head's step
        singles = [_generate(llm, [p], [n])[0] for p, n in zip(prompts, MAX_TOKENS)]
        noise = batch_noise(eager, singles)

    with caplog.at_level(logging.INFO, logger="xllm_gen"):
        llm = LLM(str(ckpt), **kw)
    try:
        runner = llm.engine.runner
        g = runner.graphs
        assert g is not None and g.capture and g.has_state, "decode graphs were not captured"
        assert sorted(g.graphs) == list(g.buckets) == [1, 2, 4, 8, 16]
        assert runner.prefill_graphs is None
        assert any("decode CUDA graphs captured" in r.getMessage() and "recurrent-state layers" in r.getMessage()
                   for r in caplog.records), "no log line of the captured recurrent decode graphs"
        graph = _generate(llm, prompts)

        def ref_logits(i, tokens):      # the eager path's logits (prefill runs eagerly in both engines)
            return torch.as_tensor(llm.prefill_logits(prompts[i] + tokens)).float().cpu()
        res = _compare(eager, graph, f"{architecture} recurrent decode graphs vs enforce_eager", ref_logits, noise)

        padding = padded_step_keeps_other_slots(runner, [5, 1, 3])
        assert padding == {"changed": [1, 3, 5], "scratch": True, "bucket": 4}, padding

        want = _tokens(graph)
        runner.debug["zero_state_at_decode"] = True
        zeroed = _tokens(_generate(llm, prompts))
        del runner.debug["zero_state_at_decode"]
        assert zeroed != want, "zeroing the states before each graph decode step did not change the tokens"
        g.scratch_slot = 0
        bad = _tokens(_generate(llm, prompts))
        g.scratch_slot = runner.state_scratch_slot
        assert bad != want, "padding rows on a live slot did not change the tokens"
        _report(test="recurrent_decode_graphs", architecture=architecture, buckets=list(g.buckets),
                capture_s=round(g.capture_seconds, 2), **{k: v for k, v in res.items() if k != "test"})
    finally:
        llm.shutdown()
