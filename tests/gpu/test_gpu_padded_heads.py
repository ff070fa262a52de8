"""Head dims FlashInfer lacks (Phi-3-mini's 96, Phi-2's 80) on the GPU (marker `gpu`): served with zero-padded heads
(Attention.pad_head_dim, a 128-wide KV cache), FlashInfer prefill / decode and CUDA graphs, against the torch paged
attention on the unpadded heads (debug torch_attention) in bf16 on the same GPU: the prefill logits within bf16
rounding, the greedy tokens equal but at a near tie. tests/test_padded_heads.py checks the padding itself on the CPU
in float32."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[97, 11, 187, 0, 57, 67], [3, 17, 99, 102, 7, 7, 300, 41, 5] * 5]


@pytest.mark.parametrize("head_dim", [80, 96])
def test_padded_heads_cuda(tmp_path, head_dim):
    from fixtures.tiny_hf import make_tiny_qwen3

    from xllm_gen import LLM, SamplingParams
    ckpt = make_tiny_qwen3(tmp_path / "c", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=head_dim, tie_word_embeddings=False)
    kw = dict(dtype="bfloat16", block_size=16, max_num_seqs=4, max_model_len=256, num_kv_blocks=64)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    res = {}
    # the reference arm eagerly: CUDA graphs are built around FlashInfer's wrappers
    for name, debug, eager in (("padded", {}, False), ("torch", {"torch_attention": True}, True)):
        llm = LLM(str(ckpt), device="cuda", _debug=debug, enforce_eager=eager, **kw)
        layers = llm.engine.runner.attn_layers
        assert all((m.model_head_dim, m.head_dim) == ((head_dim, 128) if name == "padded" else (None, head_dim))
                   for m in layers)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
        logits = [torch.as_tensor(llm.prefill_logits(p)).float().cpu() for p in PROMPTS]
        res[name] = (outs, logits)
        llm.shutdown()
    for a, b in zip(res["padded"][1], res["torch"][1]):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 2e-2, err
    for a, b in zip(res["padded"][0], res["torch"][0]):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        if ta != tb:                     # a bf16 near tie only: the first differing step's top-2 gap
            j = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
            lp = b.outputs[0].logprobs[j]
            gap = abs(lp[tb[j]].logprob - lp[ta[j]].logprob) if ta[j] in lp else float("inf")
            assert gap < 0.05, (j, gap)
