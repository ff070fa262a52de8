"""Kolibri 1 (specs/kolibri1.yaml): its router chooses experts by the top-k of float32 logits + a correction bias
and weighs them by the sigmoid of their logits (the `moe` block's `selection_bias_on: logits`). The routing op
against transformers' own Kolibri1TopKRouter, and the sensitivity arm: the bias added to the sigmoid scores instead
(`selection_bias_on: scores`, DeepSeek-V3's form) chooses other experts. The conformance battery checks the tiny
checkpoint as built (a nonzero bias, a NoPE full layer between sliding ones, the shared expert)."""
from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_logits_bias_routing_matches_transformers(norm_topk_prob):
    import transformers

    from xllm_gen.runtime.ops import moe as moe_ops

    cfg = transformers.Kolibri1Config(hidden_size=32, num_experts=16, num_experts_per_tok=4,
                                      norm_topk_prob=norm_topk_prob, num_hidden_layers=1)
    router = transformers.models.kolibri1.modeling_kolibri1.Kolibri1TopKRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 2.0)
    x = torch.randn(64, 32, generator=g)
    logits, want_w, want_ids = router(x)
    got_w, got_ids = moe_ops.select_experts(logits, 4, norm_topk_prob, "sigmoid",
                                            score_bias=router.e_score_correction_bias, bias_on="logits")
    order_w, order_g = want_ids.sort(dim=-1), got_ids.sort(dim=-1)
    assert torch.equal(order_w.values, order_g.values)
    torch.testing.assert_close(got_w.gather(1, order_g.indices), want_w.gather(1, order_w.indices))
    # the arm: the same bias on the sigmoid scores chooses other experts for some tokens
    _, arm_ids = moe_ops.select_experts(logits, 4, norm_topk_prob, "sigmoid",
                                        score_bias=router.e_score_correction_bias, bias_on="scores")
    assert not torch.equal(arm_ids.sort(dim=-1).values, order_w.values)


def test_selection_bias_on_needs_a_bias(tmp_path, capsys):
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    spec = yaml.safe_load((root / "specs" / "kolibri1.yaml").read_text())
    spec["extends"] = str(root / "specs" / "exaone4.yaml")
    spec["decoder"]["layers"]["blocks"]["mlp"]["selection_bias"] = False
    p = tmp_path / "k.yaml"
    p.write_text(yaml.safe_dump(spec, sort_keys=False))
    from codegen.cli import main
    assert main(["--dry-run", str(p)]) == 2
    assert "selection_bias_on: 'logits' needs a `selection_bias`" in capsys.readouterr().err
