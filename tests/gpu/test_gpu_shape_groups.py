"""Attention layers of several shapes on CUDA (runtime/attention/shape_groups.py): Laguna with per-layer query head
counts [4, 2, 4, 2] (head_dim 128) runs one FlashInfer backend per shape, eagerly, in bf16; its greedy tokens and
their log-probabilities are compared with Hugging Face transformers in float32 (eager attention), within the bf16
noise HF's own bf16 run shows on the same weights."""
from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_laguna_per_layer_heads_bf16_vs_hf(tmp_path):
    from fixtures.tiny_hf import make_tiny_checkpoint
    from transformers import AutoModelForCausalLM

    from xllm_gen import LLM, SamplingParams
    from xllm_gen.runtime.attention.shape_groups import ShapeGroupBackend

    ckpt = make_tiny_checkpoint("LagunaForCausalLM", tmp_path / "ckpt", seed=0, overrides=dict(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=512,
        num_hidden_layers=4, max_position_embeddings=1024, sliding_window=32,
        layer_types=["sliding_attention", "full_attention"] * 2, num_attention_heads_per_layer=[4, 2, 4, 2]))
    rng = random.Random(3)
    prompts = [[rng.randrange(400) for _ in range(n)] for n in (5, 40, 100)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    with LLM(str(ckpt), dtype="bfloat16", max_num_seqs=8, num_kv_blocks=256, max_model_len=512) as llm:
        runner = llm.engine.runner
        assert isinstance(runner.backend, ShapeGroupBackend) and len(runner.backend.groups) == 2
        assert runner.graphs is None                       # several shapes: eager decode
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    worst = worst16 = 0.0
    hf32, hf16 = (AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=d, attn_implementation="eager").cuda().eval()
                  for d in (torch.float32, torch.bfloat16))
    with torch.inference_mode():
        for p, o in zip(prompts, outs):
            toks = list(o.token_ids)
            full = torch.tensor([p + toks], device="cuda")
            lp32 = torch.log_softmax(hf32(full).logits[0].float(), -1)
            lp16 = torch.log_softmax(hf16(full).logits[0].float(), -1)
            for j, t in enumerate(toks):
                r = len(p) - 1 + j
                worst = max(worst, abs(o.logprobs[j][t].logprob - lp32[r, t].item()))
                worst16 = max(worst16, abs(lp16[r, t].item() - lp32[r, t].item()))
    assert worst <= max(3 * worst16, 0.05), (worst, worst16)
