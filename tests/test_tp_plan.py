"""tp_plan: the per-rank plan read from the layers themselves (meta-device builds under a fake TP rank), the
one plan behind the loader, the static TP check and `xllm-gen --explain --tp N`."""
from __future__ import annotations

import pytest
import torch
import transformers

from xllm_gen.runtime.executor import distributed as D
from xllm_gen.runtime.executor.sharding import ShardingError, padded_vocab
from xllm_gen.runtime.executor.tp_check import tensor_parallel_problems, tp_plan

H, KV, DH, HID, INTER, LAYERS, V = 4, 2, 16, 64, 128, 2, 520


@pytest.fixture(autouse=True)
def no_meta_leak():
    """A layer that caches tensors made without an explicit device must not keep meta tensors (the rotary tables are
    keyed by device: a table under a meta key, from a model run on the meta device, is no leak)."""
    from xllm_gen.runtime.layers import rotary
    tables = getattr(rotary, "_TABLES", None)
    saved = dict(tables) if isinstance(tables, dict) else None
    yield
    assert D.get_tp_size() == 1 and D.get_tp_rank() == 0           # the temporary TP state is restored
    if saved is not None:
        assert all(t.device.type != "meta" for k, v in tables.items() if k[-1] != "meta"
                   for t in v if isinstance(t, torch.Tensor))
        tables.clear()
        tables.update(saved)


@pytest.fixture(scope="module")
def qwen3():
    from xllm_gen.generated.qwen3 import model as M
    hf = transformers.Qwen3Config(vocab_size=V, hidden_size=HID, intermediate_size=INTER, num_hidden_layers=LAYERS,
                                  num_attention_heads=H, num_key_value_heads=KV, head_dim=DH,
                                  max_position_embeddings=64, tie_word_embeddings=False).to_dict()
    return M, M.Config.from_hf(hf)


def _per_rank_numel(tp: int) -> int:
    """By hand: what one rank holds (q heads split, KV heads split or replicated, vocab padded)."""
    vocab_rows = padded_vocab(V, tp) // tp
    qkv_rows = (H // tp + 2 * max(1, KV // tp)) * DH
    layer = (2 * HID + 2 * DH                                  # input/post norms, q/k norms: replicated
             + qkv_rows * HID                                  # qkv_proj: column, per segment
             + HID * (H * DH // tp)                            # o_proj: row
             + 2 * (INTER // tp) * HID                         # gate_up_proj: merged column
             + HID * (INTER // tp))                            # down_proj: row
    return 2 * vocab_rows * HID + LAYERS * layer + HID        # embed + untied head, layers, final norm


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_per_rank_bytes_sum(qwen3, tp):
    M, cfg = qwen3
    plan = tp_plan(M, cfg, tp, dtype=torch.bfloat16)
    assert [r.rank for r in plan.ranks] == list(range(tp))
    assert plan.nbytes_per_rank == (2 * _per_rank_numel(tp),) * tp
    assert plan.nbytes == sum(r.nbytes for r in plan.ranks) == tp * 2 * _per_rank_numel(tp)
    # every split parameter: the ranks' rows add up to the checkpoint's (times the replication of KV heads)
    for name in [p.name for p in plan.ranks[0].params]:
        parts = [r[name] for r in plan.ranks]
        p0 = parts[0]
        assert all(p.shape == p0.shape for p in parts), name
        if p0.kind == "replicated":
            assert p0.shape == p0.global_shape, name
            continue
        for i, seg in enumerate(p0.segments):
            rows = sum(p.segments[i].rows for p in parts)
            replication = tp // KV if seg.name in ("k", "v") and KV < tp else 1
            if p0.kind == "vocab":
                assert rows == padded_vocab(V, tp) and seg.size == V, name
            else:
                assert rows == seg.size * replication, (name, seg.name)
    # tp=1 equals a real (CPU) build of the model
    if tp == 1:
        real = M.Model(cfg)
        assert plan.ranks[0].numel == sum(p.numel() for p in real.parameters())


def test_kv_heads_replicated_at_tp4_with_2_kv_heads(qwen3):
    M, cfg = qwen3
    plan = tp_plan(M, cfg, 4)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    for r in plan.ranks:
        p = r[qkv]
        assert p.kind == "column" and p.dim == 0 and p.global_shape == ((H + 2 * KV) * DH, HID)
        assert p.shape == (3 * DH, HID)                        # 1 q head, 1 k head, 1 v head
        assert (p.segment("q").start, p.segment("q").stop) == (r.rank * DH, (r.rank + 1) * DH)
        head = r.rank // 2                                     # rank r holds KV head r // (tp // kv_heads)
        for s in ("k", "v"):
            assert (p.segment(s).start, p.segment(s).stop) == (head * DH, (head + 1) * DH), (r.rank, s)
        assert r.heads == tuple((f"model.layers.{i}.self_attn.qkv_proj", 1, 1) for i in range(LAYERS))
    ranks_of_head = [[r.rank for r in plan.ranks if r[qkv].segment("k").start == h * DH] for h in range(KV)]
    assert ranks_of_head == [[0, 1], [2, 3]]


def test_plan_shapes_are_the_real_per_rank_shapes(qwen3):
    M, cfg = qwen3
    plan = tp_plan(M, cfg, 2)
    for rank in (0, 1):
        D.init_tp(rank, 2)
        try:
            real = {n: tuple(p.shape) for n, p in M.Model(cfg).named_parameters()}
        finally:
            D.reset_tp()
        assert {p.name: p.shape for p in plan.ranks[rank].params} == real


def test_unsplittable_size_names_parameter_and_tp_size(qwen3):
    M, cfg = qwen3
    with pytest.raises(ShardingError) as err:
        tp_plan(M, cfg, 3)
    problems = err.value.problems
    assert "model.layers.*.self_attn.qkv_proj.weight: segment 'q' has 4 units: not divisible by tensor " \
           "parallel size 3" in problems, problems
    assert any(p.startswith("model.layers.*.self_attn.qkv_proj.weight: segment 'k' has 2 heads") for p in problems)
    assert not any(".mlp." in p for p in problems), problems   # the MLP's width is padded (tests/test_tp_padding.py)
    assert str(err.value).startswith("tensor parallel size 3: ")
    assert tensor_parallel_problems(M, cfg, 3) == problems
    assert tensor_parallel_problems(M, cfg, 8) != []           # 4 q heads over 8 ranks
    assert tensor_parallel_problems(M, cfg, 4) == []
    with pytest.raises(ValueError, match="integer >= 1"):
        tp_plan(M, cfg, 0)


def test_a_real_build_raises_the_layer_error(qwen3):
    M, cfg = qwen3
    D.init_tp(0, 3)
    try:
        with pytest.raises(ShardingError, match=r"QKVParallelLinear: segment 'q' has 4 units: not divisible by "
                                                r"tensor parallel size 3"):
            M.Model(cfg)
    finally:
        D.reset_tp()


@pytest.mark.vl
def test_vision_tower_split_or_replicated():
    """2 vision heads: split over 2 ranks, replicated over 4 (the vision MLP's 64 rows split at both)."""
    from xllm_gen.generated.qwen3_vl import model as M
    hf = transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=V, hidden_size=HID, intermediate_size=INTER, num_hidden_layers=3,
                         num_attention_heads=H, num_key_value_heads=KV, head_dim=DH, max_position_embeddings=64,
                         rope_parameters={"rope_type": "default", "rope_theta": 100.0, "mrope_section": [4, 2, 2],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=HID,
                           num_position_embeddings=64, deepstack_visual_indexes=[0, 1, 2]),
        tie_word_embeddings=True).to_dict()
    cfg = M.Config.from_hf(hf)
    qkv, fc1 = "model.visual.blocks.0.attn.qkv.weight", "model.visual.blocks.0.mlp.linear_fc1.weight"
    p2 = tp_plan(M, cfg, 2, ranks=(1,)).ranks[0]
    assert p2[qkv].kind == "column" and p2[qkv].shape == (48, 32) and p2[qkv].global_shape == (96, 32)
    assert [(s.name, s.start, s.stop) for s in p2[qkv].segments] == [("q", 16, 32), ("k", 16, 32), ("v", 16, 32)]
    assert p2["model.visual.blocks.0.attn.proj.bias"].kind == "replicated"
    p4 = tp_plan(M, cfg, 4, ranks=(3,)).ranks[0]
    assert p4[qkv].kind == "replicated" and p4[qkv].shape == (96, 32)
    assert p4[fc1].kind == "column" and p4[fc1].shape == (16, 32)
    names = [p.name for p in p4.params]
    assert "lm_head.weight" not in names                        # tied: the embedding's parameter, once
