"""Tensor parallelism 2 (CPU, gloo: one worker process) of the remote-code specs, against the same plain-PyTorch
references as their TP 1 tests (tests/test_remote_*.py, written from the releases' modeling code): greedy tokens and
top-5 log-probabilities in float32. What shards unusually in these families:

- InternLM2's `wqkv` laid out per KV group ([q.. k v] of each group): 2 KV groups, one a rank;
- ChatGLM's `query_key_value` blocked [q (heads) | k (groups) | v (groups)] with 2 multi-query groups (one a rank)
  and a bias, `dense_h_to_4h` [gate | up]; and 1 group (replicated on both ranks);
- Qwen v1's `c_attn` [q | k | v] with its bias, MLP halves w2 (gated) / w1;
- Baichuan 2 13B's ALiBi (each rank's heads keep their global slopes, 6 heads: the non-power-of-two series) and
  NormHead (F.normalize of lm_head rows: a row's norm is its own, so vocabulary-sharded rows normalize alone),
  `W_pack` [q | k | v];
- MiniCPM's scaled embedding / residuals / logits with the head tied to a vocabulary-sharded embedding.

Each family's fixture shows that the mistakes TP makes likely here change the greedy tokens (`_naive_split`: a fused
tensor cut into contiguous row blocks per rank as if each block were [q | k | v] of that rank; ALiBi slopes computed
from each rank's head count; NormHead normalized over each rank's half of the hidden dims), so the parity arms can
fail. Each engine starts a worker process (~6-10 s on two cores); `slow`: Baichuan's 7B form (hidden 4096, ~30 s) and
ChatGLM's one-group arm (replicated KV heads are covered by tests/test_tp.py too)."""
from __future__ import annotations

import pytest
import remote_ref as R
import torch
import torch.nn.functional as F

TP = 2


def _naive_split(w: torch.Tensor, sizes: list[int], tp: int = TP) -> torch.Tensor:
    """The fused tensor a wrong loader would effectively serve: rank r takes rows [r * n / tp, (r + 1) * n / tp) and
    reads them as its [seg_0 / tp | seg_1 / tp | ...]; returned in the checkpoint's layout (segments concatenated)."""
    chunks = w.chunk(tp, 0)
    segs = [torch.cat([c.split([s // tp for s in sizes], 0)[i] for c in chunks], 0) for i in range(len(sizes))]
    return torch.cat(segs, 0)


def _naive(t: dict, suffix: str, sizes: list[int]) -> dict:
    return {k: (_naive_split(v, sizes) if k.endswith(suffix) else v) for k, v in t.items()}


# ---- ChatGLM: multi-query groups 2 (one a rank) and 1 (replicated) ---------------------------------------------------
def test_chatglm_tp2_fixture_is_sensitive():
    import test_remote_chatglm as m
    t, cfg = m._tensors(), m.CONFIG
    want = m.reference(t, cfg)
    qkv = [m.HEADS * m.D, m.G * m.D, m.G * m.D]
    assert R.distinct(want, m.reference(_naive(_naive(t, "query_key_value.weight", qkv), "query_key_value.bias", qkv),
                                        cfg)), "fixture: a per-rank row block of query_key_value read as [q | k | v]"
    assert R.distinct(want, m.reference(_naive(t, "dense_h_to_4h.weight", [m.I, m.I]), cfg)), \
        "fixture: a per-rank row block of dense_h_to_4h read as [gate | up]"


def test_chatglm_tp2_matches_reference(tmp_path):
    import test_remote_chatglm as m
    t = m._tensors()
    ckpt = R.write_checkpoint(tmp_path / "chatglm", m.CONFIG, t)
    R.assert_matches(R.engine_greedy(ckpt, tp=TP), m.reference(t, m.CONFIG), what="chatglm tp2 (2 groups)")


@pytest.mark.slow
def test_chatglm_one_group_tp2_matches_reference(tmp_path, monkeypatch):
    """multi_query_group_num 1 (fewer KV heads than ranks): the one K / V head on both ranks."""
    import test_remote_chatglm as m
    monkeypatch.setattr(m, "G", 1)
    t, cfg = m._tensors(), {**m.CONFIG, "multi_query_group_num": 1}
    ckpt = R.write_checkpoint(tmp_path / "chatglm_g1", cfg, t)
    R.assert_matches(R.engine_greedy(ckpt, tp=TP), m.reference(t, cfg), what="chatglm tp2 (1 group)")


# ---- InternLM2: wqkv per KV group ---------------------------------------------------------------------------------------
def test_internlm2_tp2_matches_reference(tmp_path):
    import test_remote_internlm2 as m
    t = m._tensors()
    assert R.distinct(m.reference(t, m.CONFIG), m.reference(t, m.CONFIG, blocked=True)), "fixture: the layout matters"
    ckpt = R.write_checkpoint(tmp_path / "internlm2", m.CONFIG, t)
    R.assert_matches(R.engine_greedy(ckpt, tp=TP), m.reference(t, m.CONFIG), what="internlm2 tp2")


# ---- Qwen v1: c_attn [q | k | v] with bias ---------------------------------------------------------------------------
@pytest.mark.slow     # plain row / column sharding; the default run keeps the unusual ones
def test_qwen_tp2_matches_reference(tmp_path):
    """seq_length 64 (beyond the prompts + 8 tokens: logn attention and dynamic NTK are the identity there)."""
    import test_remote_qwen as m
    t, cfg = m._tensors(), {**m.CONFIG, "seq_length": 64}
    want = m.reference(t, cfg)
    sizes = [m.H] * 3
    assert R.distinct(want, m.reference(_naive(_naive(t, "c_attn.weight", sizes), "c_attn.bias", sizes), cfg)), \
        "fixture: a per-rank row block of c_attn read as [q | k | v]"
    ckpt = R.write_checkpoint(tmp_path / "qwen", cfg, t)
    R.assert_matches(R.engine_greedy(ckpt, tp=TP), want, what="qwen tp2")


# ---- Baichuan 2 13B form: ALiBi + NormHead; W_pack ---------------------------------------------------------------------
def test_baichuan_tp2_fixture_is_sensitive(monkeypatch):
    import test_remote_baichuan as m
    cfg, one = m.ALIBI, R.PROMPTS[:1]           # one prompt: each step's logits span Baichuan 2's 125696 tokens
    t, h, heads = m._tensors(cfg), cfg["hidden_size"], cfg["num_attention_heads"]
    want = m.reference(t, cfg, alibi=True, norm_head=True)
    assert R.distinct(want, m.reference(_naive(t, "W_pack.weight", [h] * 3), cfg, alibi=True, norm_head=True), one), \
        "fixture: a per-rank row block of W_pack read as [q | k | v]"
    w = t["lm_head.weight"]
    halves = torch.cat([F.normalize(c) for c in w.chunk(TP, 1)], 1)       # each rank's hidden half normalized alone
    assert R.distinct(want, m.reference({**t, "lm_head.weight": halves}, cfg, alibi=True, norm_head=False), one), \
        "fixture: NormHead normalized per hidden shard"
    local = R.alibi_slopes(heads // TP).repeat(TP)                       # slopes from each rank's own head count
    monkeypatch.setattr(R, "alibi_slopes", lambda n: local)
    assert R.distinct(want, m.reference(t, cfg, alibi=True, norm_head=True), one), "fixture: per-rank ALiBi slopes"


def test_baichuan2_13b_form_tp2_matches_reference(tmp_path):
    import test_remote_baichuan as m
    t = m._tensors(m.ALIBI)
    ckpt = R.write_checkpoint(tmp_path / "b13", m.ALIBI, t)
    R.assert_matches(R.engine_greedy(ckpt, tp=TP), m.reference(t, m.ALIBI, alibi=True, norm_head=True),
                     what="baichuan tp2 (ALiBi, NormHead)")


@pytest.mark.slow
def test_baichuan_7b_form_tp2_matches_reference(tmp_path):
    import test_remote_baichuan as m
    t = m._tensors(m.ROPE)
    ckpt = R.write_checkpoint(tmp_path / "b7", m.ROPE, t)
    R.assert_matches(R.engine_greedy(ckpt, tp=TP), m.reference(t, m.ROPE, alibi=False, norm_head=False),
                     what="baichuan tp2 (rotary)")


# ---- MiniCPM: tied, scaled --------------------------------------------------------------------------------------------
@pytest.mark.slow     # plain row / column sharding; the default run keeps the unusual ones
def test_minicpm_tp2_matches_reference(tmp_path):
    import test_remote_minicpm as m
    t = m._tensors()
    ckpt = R.write_checkpoint(tmp_path / "minicpm", m.CONFIG, t)
    R.assert_matches(R.engine_greedy(ckpt, tp=TP), m.reference(t, m.CONFIG), what="minicpm tp2")
