"""A checkpoint is served by the name its config.json gives in `architectures`: ChatGLM2/3 and GLM-4 (remote code)
save `ChatGLMModel` or, where the release was re-saved through its AutoModelForCausalLM class,
`ChatGLMForConditionalGeneration` (a text decoder despite the suffix: transformers registers it nowhere, so
specs/chatglm.yaml may claim it; codegen/README.md `architectures`). Both pick the chatglm package and match the
plain-PyTorch reference of tests/test_remote_chatglm.py."""
from __future__ import annotations

import pytest
import remote_ref as R
import test_remote_chatglm as glm

from xllm_gen.runtime.loading import registry


@pytest.mark.parametrize("arch", ["ChatGLMModel", "ChatGLMForConditionalGeneration"])
def test_chatglm_architecture_names_pick_the_chatglm_package(arch):
    model, runner = registry.resolve({"architectures": [arch]})
    assert model.__name__ == "xllm_gen.generated.chatglm.model" and not getattr(runner.Runner, "multimodal", False)


def test_an_unclaimed_suffixed_name_is_not_served():
    """Sensitivity: the lookup is by name (a *ForConditionalGeneration no spec lists is refused, naming it)."""
    with pytest.raises(ValueError, match="ChatGLMXForConditionalGeneration"):
        registry.resolve({"architectures": ["ChatGLMXForConditionalGeneration"]})


def test_chatglm_for_conditional_generation_checkpoint_is_served(tmp_path):
    t = glm._tensors()
    cfg = {**glm.CONFIG, "architectures": ["ChatGLMForConditionalGeneration"]}
    ckpt = R.write_checkpoint(tmp_path / "chatglm_cg", cfg, t)
    R.assert_matches(R.engine_greedy(ckpt), glm.reference(t, cfg), what="ChatGLMForConditionalGeneration")
