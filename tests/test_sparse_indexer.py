"""The sparse-attention indexer (an `mla_attention` block's `indexer`: DeepSeek-V3.2's DSA, GLM-MoE-DSA) against
transformers (float32, CPU, greedy).

The spec battery checks the default tiny checkpoints (tests/fixtures/tiny_hf.py: index_topk 6, shorter than most
test prompts, so the selection bites; GLM's middle layer shares the first layer's selection). Here: each feature
switched or corrupted must change transformers' tokens with the engine still agreeing (index_topk covering every key,
negated indexer weights); zeroed indexer weights change the engine's tokens; chunked prefill and prefix-cache hits
(the indexer's keys read back from the paged cache) keep parity; configs the specs do not model are refused by name.
"""
from __future__ import annotations

import json
import random
import shutil

import pytest
from hf_ref import hf_greedy

V32, GLM = "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"
PROMPT_LENS = (3, 9, 17, 30)
MAX_TOKENS = 10


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENS]


_HF: dict = {}


def _hf(ckpt, prompts=None) -> list[list[int]]:
    prompts = prompts or _prompts()
    key = (str(ckpt), json.dumps(prompts))
    if key not in _HF:
        _HF[key] = [list(hf_greedy(ckpt, [p], MAX_TOKENS)[0]) for p in prompts]
    return _HF[key]


def _engine(ckpt, prompts=None, tp: int = 1, sequential: bool = False, **kw) -> list[list[int]]:
    from xllm_gen import LLM, SamplingParams
    prompts = prompts or _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4, tensor_parallel_size=tp, **kw) as llm:
        if sequential:      # one request after the other: the later ones hit the earlier ones' cached blocks
            return [list(llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids) for p in prompts]
        return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _edit_tensors(src, dst, edit) -> None:
    """Copy checkpoint `src` to `dst` with edit(name, tensor) -> tensor applied to every tensor."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({n: edit(n, t).contiguous() for n, t in tensors.items()}, f, metadata={"format": "pt"})


@pytest.mark.engine
def test_topk_covering_every_key_changes_tokens(tiny_checkpoint):
    """index_topk 64 (>= every sequence here: dense attention) against the default 6: transformers' tokens differ,
    and the engine agrees with both."""
    sparse = tiny_checkpoint(V32)
    dense = tiny_checkpoint(V32, overrides={"index_topk": 64})
    assert _hf(dense) != _hf(sparse), "fixture: index_topk does not change transformers' tokens"
    assert _engine(dense) == _hf(dense)


@pytest.mark.slow
@pytest.mark.engine
def test_corrupted_indexer_weights_change_tokens(tiny_checkpoint, tmp_path):
    """The indexer's per-head weights negated: another selection, transformers' tokens change and the engine
    agrees; zeroed (every score 0): the engine's tokens change."""
    base = tiny_checkpoint(V32)
    neg = tmp_path / "neg"
    _edit_tensors(base, neg, lambda n, t: -t if n.endswith("indexer.weights_proj.weight") else t)
    assert _hf(neg) != _hf(base), "fixture: negated indexer weights do not change transformers' tokens"
    assert _engine(neg) == _hf(neg)
    zero = tmp_path / "zero"
    _edit_tensors(base, zero, lambda n, t: t * 0 if n.endswith("indexer.wk.weight") else t)
    assert _engine(zero) != _hf(base)


@pytest.mark.engine
@pytest.mark.parametrize("arch", [V32, pytest.param(GLM, marks=pytest.mark.slow)])
def test_chunked_prefill_and_prefix_hits(arch, tiny_checkpoint):
    """Prompts prefilled in chunks of 8 tokens (the indexer scores each chunk's queries against the keys cached by
    the earlier chunks), and requests that reuse the cached blocks of an earlier one (their prefix's indexer keys
    come from the paged cache, never recomputed)."""
    ckpt = tiny_checkpoint(arch)
    assert _engine(ckpt, enable_chunked_prefill=True, max_num_batched_tokens=8) == _hf(ckpt)
    long = _prompts()[-1]
    prompts = [long, long[:20] + [7, 8, 9, 10, 11], long[:24] + [42]]
    assert _engine(ckpt, prompts, sequential=True, enable_prefix_caching=True) == _hf(ckpt, prompts)


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("arch", [V32, GLM])
def test_preemption_and_speculative_steps(arch, tiny_checkpoint):
    """A KV cache of 14 blocks of 4 tokens for 107 tokens of work: sequences are preempted and recomputed (their
    indexer keys with them); n-gram speculative decoding verifies several tokens of a sequence in one step."""
    ckpt = tiny_checkpoint(arch)
    assert _engine(ckpt, num_kv_blocks=14) == _hf(ckpt)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    assert _engine(ckpt, speculative_config=spec) == _hf(ckpt)


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("arch", [V32, GLM, "AXK2ForCausalLM"])
def test_tp2(arch, tiny_checkpoint):
    """TP 2: the MLA split by heads, the indexer replicated (every rank selects the same keys)."""
    ckpt = tiny_checkpoint(arch)
    assert _engine(ckpt, tp=2) == _hf(ckpt)


@pytest.mark.slow
@pytest.mark.engine
def test_glm_all_full_layers(tiny_checkpoint):
    """GLM-MoE-DSA with an indexer on every layer (indexer_types all 'full', transformers' default schedule)."""
    ckpt = tiny_checkpoint(GLM, overrides={"indexer_types": ["full", "full", "full"]})
    assert _engine(ckpt) == _hf(ckpt)


@pytest.mark.parametrize("arch, edit, field", [
    (V32, {"layer_types": ["indexed_attention", "full_attention", "indexed_attention"]}, "non_indexed_layers"),
    (V32, {"mlp_bias": True}, "mlp_bias"),
    (GLM, {"indexer_types": ["shared", "full", "full"]}, "first_layer_shares"),
    (GLM, {"indexer_types": ["full", "skip", "full"]}, "unknown_indexer_types"),
    (GLM, {"index_topk_pattern": "FSF"}, "index_topk_pattern"),
])
def test_unmodeled_configs_refused_by_name(arch, edit, field, tiny_checkpoint):
    from xllm_gen.runtime.loading.hf_config import ConfigError
    ckpt = tiny_checkpoint(arch)
    cfg = {**json.loads((ckpt / "config.json").read_text()), **edit}
    name = "deepseek_v32" if arch == V32 else "glm_moe_dsa"
    module = __import__(f"xllm_gen.generated.{name}.model", fromlist=["Config"])
    with pytest.raises(ConfigError, match=field):
        module.Config.from_hf(cfg)


def test_selection_reference():
    """SparseIndexer.select against a direct transcription of transformers' scoring (scores over the whole row with
    the causal mask, top-min(topk, T)) for a prefill of 3 sequences (one computed from its cached keys after an
    earlier chunk), topk smaller and larger than the rows."""
    import torch

    from xllm_gen.runtime.executor.context import ForwardContext
    from xllm_gen.runtime.layers.indexer import SparseIndexer

    g = torch.Generator().manual_seed(0)
    H, D = 4, 16
    for topk in (3, 50):
        ix = SparseIndexer(32, 8, H, D, 8, topk, 10000.0, 64)
        lens, qlens = [5, 12, 9], [5, 12, 4]         # the last sequence: 4 new queries after 5 cached keys
        keys = [torch.randn(n, D, generator=g) for n in lens]
        bs = 4
        blocks = [(n + bs - 1) // bs for n in lens]
        ix.k_cache = torch.zeros(sum(blocks), bs, D)
        table = torch.full((3, max(blocks)), -1, dtype=torch.int32)
        b0 = 0
        for i, n in enumerate(lens):
            table[i, :blocks[i]] = torch.arange(b0, b0 + blocks[i])
            ix.k_cache.view(-1, D)[b0 * bs: b0 * bs + n] = keys[i]
            b0 += blocks[i]
        q = torch.randn(sum(qlens), H, D, generator=g)
        w = torch.randn(sum(qlens), H, generator=g)
        cu = torch.tensor([0, 5, 17, 21])
        ctx = ForwardContext(is_prefill=True, cu_seqlens_q=cu, seq_lens=torch.tensor(lens), slot_mapping=None,
                             block_tables=table, block_size=bs, seq_lens_cpu=lens)
        got = ix.select(q, None, w, ctx)
        for i, n in enumerate(lens):
            qi, wi = q[cu[i]:cu[i + 1]], w[cu[i]:cu[i + 1]]
            s = torch.relu(torch.matmul(qi, keys[i].t()) * D ** -0.5)             # [Q, H, n]
            score = torch.matmul(wi.unsqueeze(1), s).squeeze(1)
            qpos = torch.arange(n - qlens[i], n)[:, None]
            causal = torch.arange(n)[None, :] <= qpos
            score = score + torch.where(causal, 0.0, torch.finfo(torch.float32).min)
            idx = score.topk(min(topk, n), dim=-1).indices
            want = torch.zeros(qlens[i], n, dtype=torch.bool).scatter_(1, idx, True) & causal
            assert torch.equal(got[cu[i]:cu[i + 1], :n], want), (topk, i)
            assert not got[cu[i]:cu[i + 1], n:].any()


AXK2 = "AXK2ForCausalLM"


def _zero_gate_rows(n, t, qk: int = 24, v: int = 12):
    """The output-gate half of each head's rows of A.X-K2's fused q_b_proj [heads * (qk + v), 2 * rank] zeroed."""
    if not n.endswith("self_attn.q_b_proj.weight"):
        return t
    t = t.clone().view(-1, qk + v, t.shape[-1])
    t[:, qk:] = 0
    return t.view(-1, t.shape[-1])


@pytest.mark.engine
@pytest.mark.parametrize("arm", ["norm_gate", pytest.param("output_gate", marks=pytest.mark.slow)])
def test_axk2_gates_matter(arm, tiny_checkpoint, tmp_path):
    """A.X-K2's two gates, each made constant (sigmoid(0) = 0.5): the gated norms' W_up zeroed, or the output-gate
    rows of the fused q_b_proj zeroed; transformers' tokens change and the engine agrees."""
    base = tiny_checkpoint(AXK2)
    ckpt = tmp_path / arm
    if arm == "norm_gate":
        _edit_tensors(base, ckpt, lambda n, t: t * 0 if n.endswith("W_up.weight") else t)
    else:
        _edit_tensors(base, ckpt, _zero_gate_rows)
    assert _hf(ckpt) != _hf(base), f"fixture: {arm} does not change transformers' tokens"
    assert _engine(ckpt) == _hf(ckpt)


def test_axk2_half_set_groups_refused_by_name(tiny_checkpoint):
    from xllm_gen.runtime.loading.hf_config import ConfigError
    cfg = {**json.loads((tiny_checkpoint(AXK2) / "config.json").read_text()), "topk_group": None}
    module = __import__("xllm_gen.generated.axk2.model", fromlist=["Config"])
    with pytest.raises(ConfigError, match="groups_half_set"):
        module.Config.from_hf(cfg)


@pytest.mark.slow
@pytest.mark.engine
def test_axk2_ungrouped(tiny_checkpoint):
    """A.X-K2-Light's ungrouped routing (n_group / topk_group null)."""
    ckpt = tiny_checkpoint(AXK2, overrides={"n_group": None, "topk_group": None})
    assert _engine(ckpt) == _hf(ckpt)


def test_axk2_router_reference():
    """select_experts(group_dropped="zero") against transformers' own AXK2TopkRouter on random logits with a
    negative selection bias (dropped groups' experts, at choice score 0, beat negative kept ones); -inf differs."""
    import torch
    from transformers import AXK2Config
    from transformers.models.axk2.modeling_axk2 import AXK2TopkRouter

    from xllm_gen.runtime.ops import moe as moe_ops

    cfg = AXK2Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2)
    router = AXK2TopkRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(8, generator=g) - 0.8)
    x = torch.randn(64, 16, generator=g)
    _, w, ids = router(x)
    logits = torch.nn.functional.linear(x, router.weight)
    args = (logits, 3, True, "sigmoid", 4, 2, "top2_sum", router.e_score_correction_bias, cfg.routed_scaling_factor)
    got_w, got_ids = moe_ops.select_experts(*args, group_dropped="zero")
    order, got_order = ids.sort(-1), got_ids.sort(-1)
    assert torch.equal(order.values, got_order.values)
    assert torch.allclose(w.gather(1, order.indices), got_w.gather(1, got_order.indices))
    _, excl_ids = moe_ops.select_experts(*args)
    assert not torch.equal(excl_ids.sort(-1).values, got_order.values)


@pytest.mark.parametrize("base, body, match", [
    # the indexer reads the query latent: a direct q_proj (an optional rank) cannot feed it
    ("deepseek_v32", "config:\n  q_lora_rank: {optional: true}\n",
     r"q_lora_rank: with an indexer the low-rank q must exist in every checkpoint"),
    ("deepseek_v32", "decoder:\n  layers:\n    blocks:\n      self_attn: {indexer: {share: true}}\n",
     r"indexer\.share: true on every layer leaves no layer to select"),
    ("deepseek_v32", "decoder:\n  layers:\n    blocks:\n      self_attn: {indexer: {rope_layout: hidden_act}}\n",
     r"indexer\.rope_layout: config symbol 'hidden_act' selects the indexer's rope layout"),
    ("deepseek_v32", "decoder:\n  layers:\n    blocks:\n      self_attn: {indexer: {rope_dims: 9}}\n",
     r"indexer: 9 rope dims in indexer heads of 128: the rope dims must be even"),
    ("deepseek_v32", "decoder:\n  layers:\n    blocks:\n      self_attn: {indexer: {share: \"layer == 0\"}}\n",
     r"indexer\.share \(layer == 0\) holds on layer 0"),
    ("deepseek_v3", "decoder:\n  layers:\n    blocks:\n      self_attn: {q_gate: q_gate_proj}\n",
     r"q_gate: the fused q \+ gate projection reads the query latent"),
    ("axk2", "decoder:\n  norm: {gate: {rank: 4}}\n", r"decoder\.norm\.gate: only a decoder layer's norm may have a gate"),
])
def test_compile_errors(tmp_path, base, body, match):
    from pathlib import Path

    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.codegen.errors import SpecError

    repo = Path(__file__).resolve().parents[1]
    child = tmp_path / "child.yaml"
    child.write_text(f"spec_version: 2\nextends: {repo / 'specs' / (base + '.yaml')}\nname: ix_child\n" + body)
    with pytest.raises(SpecError, match=match):
        compile_spec(child)
