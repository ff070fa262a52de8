"""Decode CUDA graphs of models with recurrent-state layers, what the CPU can prove (the GPU arms are
tests/gpu/test_gpu_recurrent_graphs.py):

- the graph-safe decode step of each mixer (gated DeltaNet, Mamba-2, short conv: index_select / index_copy_ on the
  slot tensor) equals the previous path (advanced indexing of the pool) bit for bit, and a batch padded to a bucket
  (padding rows on the scratch slot) gives the real rows' outputs and states bit for bit, leaves every other slot
  untouched and writes the scratch slot; a padding row on a live slot would change it (sensitivity);
- no host sync in the decode step of any recurrent model: the whole decode step of each spec's model on the meta
  device (no data: any value read on the host fails) under a dispatch mode that fails on _local_scalar_dense /
  is_nonzero / nonzero, the state slots a tensor only (as in a captured bucket); a mixer that reads its slots on the
  host fails it (sensitivity);
- the decode-graph path run uncaptured (DecodeGraphs(capture=False): its static inputs, padding rows, state-slot
  row and planning; each bucket's forward eager) on every generated model with a recurrent mixer (RECURRENT_ARCHS,
  found from the generated sources): greedy tokens equal to transformers float32 with sequences of different lengths
  finishing at different steps (batches 5 .. 1 padded into buckets 8, 4, 2, 1); pointing padding rows at a live slot instead of
  the scratch slot, or (slow) zeroing the states before each decode step, changes the tokens (sensitivity); a
  padded DecodeGraphs.run step changes exactly its sequences' slots and the scratch slot.
"""
from __future__ import annotations

import importlib
import json

import pytest
import torch
from fixtures.recurrent_graphs import RECURRENT_ARCHS, NoHostSync, padded_step_keeps_other_slots

from xllm_gen.runtime import layers as L
from xllm_gen.runtime.executor.context import ForwardContext, reset_context, set_context
from xllm_gen.runtime.layers import recurrent as R

NUM_SLOTS = 6                     # handed out; the pool has one more, the scratch slot
SCRATCH = NUM_SLOTS


def _mixer(kind: str, device="cpu", wide: bool = False):
    # wide: every per-row width a multiple of 64 (64 heads), as real checkpoints' are (see the note above the
    # padded-step test)
    torch.manual_seed(0)
    with torch.device(device):
        if kind == "gated_delta_net":
            m = L.GatedDeltaNet(16, 64, 8, 8, 4, 1e-6) if wide else L.GatedDeltaNet(2, 4, 8, 8, 4, 1e-6)
            width = lambda N: (torch.randn(N, m.key_dim * 2 + m.value_dim), torch.randn(N, m.value_dim),  # noqa: E731
                               torch.randn(N, m.value_heads), torch.randn(N, m.value_heads))
        elif kind == "mamba2":
            H, G, S = (64, 4, 16) if wide else (4, 2, 8)
            m = L.Mamba2(H, 8, G, S, 4, 8, 1e-6)
            width = lambda N: (torch.randn(N, H * 8), torch.randn(N, H * 8 + 2 * G * S), torch.randn(N, H))  # noqa: E731
        else:
            m = L.ShortConv(16, 3)
            width = lambda N: (torch.randn(N, 16), torch.randn(N, 16), torch.randn(N, 16))  # noqa: E731
        if device != "meta":
            for p in m.parameters():
                p.data.copy_(torch.randn(p.shape) * 0.5)
        m.init_states(NUM_SLOTS + 1, torch.device(device), torch.float32)
    return m, width


def _decode_ctx(slots, device="cpu"):
    B = len(slots)
    return ForwardContext(is_prefill=False, cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32, device=device),
                          seq_lens=torch.ones(B, dtype=torch.int32, device=device),
                          slot_mapping=torch.full((B,), -1, dtype=torch.int64, device=device),
                          block_tables=torch.zeros(B, 0, dtype=torch.int32, device=device), query_lens_cpu=[1] * B,
                          state_slots=torch.tensor(slots, dtype=torch.int64, device=device))


def _step(m, inputs, slots):
    set_context(_decode_ctx(slots))
    try:
        return m.mix(*inputs)
    finally:
        reset_context()


def _old_gather(pool, slots):            # the decode path before the graph-safe one: advanced indexing
    return pool[slots]


def _old_scatter(pool, slots, new):
    pool[slots] = new.to(pool.dtype)


# Why the padded step is bit for bit only with wide rows on the CPU (diagnosed 2026-12-03, issue 23 note): the decode
# step has no matmul; the difference comes from PyTorch's CPU elementwise kernels (softplus, sigmoid, silu): a
# TensorIterator loop runs its SIMD body (Sleef) over whole blocks of 2 vectors (16 floats with AVX2, 32 with
# AVX-512) and the scalar libm function over the remaining elements, and the two differ in the last bit. Whether an
# element is in the body or the tail depends on the tensor's total size, so on a [rows, width] tensor whose width is
# no multiple of the block (the tiny mixers' 4 heads: g, beta, dt are [rows, 4]) one row more moves elements from
# the tail into the body. That is the CPU kernels', not the runtime's: a CUDA kernel computes every element with the
# same code whatever the size, and only the decode CUDA graphs pad (the CPU pads only in the uncaptured test path);
# making every elementwise op of every mixer pad its rows to the block would cost the CPU path and buy nothing on
# the GPU. So the contract (a padding row changes no real row, bit for bit) is tested with wide rows (every width a
# multiple of 64: no tail on AVX2 or AVX-512); the narrow mixers keep every exact check that does not go through
# such a kernel (slot isolation, the graph-safe path against the previous one) and their real rows to within
# float32 rounding.
# The short conv runs no such kernel (products and sums only): bit for bit at any width.


def _ulps_close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind,wide", [("gated_delta_net", True), ("mamba2", True), ("short_conv", False),
                                       ("gated_delta_net", False), ("mamba2", False)])
def test_graph_safe_decode_step_bit_for_bit(kind, wide, monkeypatch):
    m, make = _mixer(kind, wide=wide)
    same = torch.equal if wide or kind == "short_conv" else _ulps_close    # see the note above
    gen = torch.Generator().manual_seed(1)
    init = {k: torch.randn(t.shape, generator=gen).to(t.dtype) for k, t in m.states.items()}
    live = [4, 0, 2]                                           # three sequences; bucket 4 pads one row
    steps = [make(len(live) + 1) for _ in range(2)]            # the padding row's inputs: whatever is there

    def run(slots, rows, gather=None, scatter=None):
        for k, t in m.states.items():
            t.copy_(init[k])
        with monkeypatch.context() as mp:
            if gather is not None:
                mp.setattr(R, "gather_states", gather)
                mp.setattr(R, "scatter_states", scatter)
            outs = [_step(m, [x[:rows] for x in inputs], slots) for inputs in steps]
        return outs, {k: t.clone() for k, t in m.states.items()}

    with torch.no_grad():
        new_out, new_st = run(live, 3)
        old_out, old_st = run(live, 3, _old_gather, _old_scatter)
        pad_out, pad_st = run(live + [SCRATCH], 4)
        bad_out, bad_st = run(live + [1], 4)                   # a padding row on another sequence's slot
    for a, b, c in zip(new_out, old_out, pad_out):
        assert torch.equal(a, b), "the graph-safe decode step differs from the previous path"
        assert same(a, c[:3]) is not False, "a padded batch changes the real rows' outputs"
    for k in init:
        assert torch.equal(new_st[k], old_st[k])
        assert same(pad_st[k][live], new_st[k][live]) is not False, f"{k}: padding changed a live slot's state"
        untouched = [s for s in range(NUM_SLOTS) if s not in live]
        assert torch.equal(pad_st[k][untouched], init[k][untouched]), f"{k}: padding touched another slot"
        for s in (1, 3, 5):                                    # slots not in the step
            assert torch.equal(new_st[k][s], init[k][s])
        for s in live:
            assert not torch.equal(new_st[k][s], init[k][s]), f"{k}: slot {s} of the step was not written"
        assert torch.equal(new_st[k][SCRATCH], init[k][SCRATCH])
        assert not torch.equal(pad_st[k][SCRATCH], init[k][SCRATCH]), f"{k}: the padding row did not run"
    assert any(not torch.equal(bad_st[k][1], init[k][1]) for k in init), \
        "sensitivity: a padding row on a live slot must change that slot"


def test_decode_slots_only_for_decode_steps():
    ctx = _decode_ctx([0, 1])
    assert R.decode_slots(ctx) is ctx.state_slots
    ctx.is_prefill = True
    assert R.decode_slots(ctx) is None
    ctx.is_prefill, ctx.query_lens_cpu = False, [1, 2]
    assert R.decode_slots(ctx) is None
    ctx.query_lens_cpu, ctx.state_slots = [1, 1], None
    with pytest.raises(RuntimeError, match="decode step without state slots"):
        R.decode_slots(ctx)


def _meta_decode_step(architecture: str, ckpt, Bk: int = 4):
    """The whole decode step of the spec's model on the meta device, as a captured bucket runs it: positions, ids,
    KV slots and state slots are tensors only (padding rows: slot -1 / the scratch slot). Attention's KV store and
    backend are stubbed (on CUDA: FlashInfer and the KV-store kernel, captured for every attention model)."""
    from xllm_gen.runtime.attention.base import AttentionBackend
    from xllm_gen.runtime.loading import registry

    class Stub(AttentionBackend):
        def plan(self, ctx):
            pass

        def forward(self, q, k, v, k_cache, v_cache, ctx, scale, variant=None, **kw):
            return q.new_zeros(q.shape[:-1] + v.shape[-1:])      # value heads may have a width of their own

    mod = importlib.import_module(f"{registry.generated_packages()[architecture]}.model")
    config = mod.Config.from_hf(json.loads((ckpt / "config.json").read_text()))
    dev = torch.device("meta")
    with torch.device(dev):
        model = mod.Model(config)
    for m in model.modules():
        if isinstance(m, L.RecurrentMixer):
            m.init_states(NUM_SLOTS + 1, dev, torch.float32)
        if isinstance(m, L.Attention):
            m.k_cache = torch.zeros(4, 16, m.num_kv_heads, m.head_dim, device=dev)
            m.v_cache = torch.zeros(4, 16, m.num_kv_heads, m.v_head_dim, device=dev)
    ctx = _decode_ctx([0, 2, SCRATCH, SCRATCH], dev)
    ctx.backend = Stub()
    ids = torch.zeros(Bk, dtype=torch.int64, device=dev)
    return model, ctx, ids


@pytest.mark.parametrize("architecture", RECURRENT_ARCHS)
def test_decode_step_has_no_host_sync(architecture, tiny_checkpoint, monkeypatch):
    from xllm_gen.runtime import ops
    model, ctx, ids = _meta_decode_step(architecture, tiny_checkpoint(architecture))
    monkeypatch.setattr(ops, "store_kvcache", lambda *a: None)
    set_context(ctx)
    try:
        with torch.inference_mode(), NoHostSync():
            out = model(ids, ids, None)
    finally:
        reset_context()
    assert out.shape[0] == ids.shape[0]


def test_no_host_sync_check_is_sensitive(monkeypatch):
    # the mode catches each way of reading a value on the host (on CPU tensors, which have values)
    t = torch.ones(3)
    for read in (lambda: t.sum().item(), lambda: int(t.sum()), lambda: bool(t.sum() > 0), lambda: t.nonzero()):
        with torch.inference_mode(), NoHostSync(), pytest.raises(AssertionError, match="host sync"):
            read()
    # a mixer that reads its slots on the host fails the meta run
    m, make = _mixer("short_conv", device="meta")
    monkeypatch.setattr(R, "gather_states", lambda pool, slots: pool[slots.tolist()])
    set_context(_decode_ctx([0, SCRATCH], "meta"))
    try:
        with torch.inference_mode(), NoHostSync(), pytest.raises((AssertionError, RuntimeError, NotImplementedError)):
            m.mix(*(torch.empty(2, 16, device="meta") for _ in range(3)))
    finally:
        reset_context()


# ---------------------------------------------------------------------------------- the uncaptured graph path
PROMPTS = [[5, 17, 99, 3, 250, 8, 77, 41, 9, 300, 12], [7, 8, 9], list(range(20, 90, 3)), [400, 401, 3, 2, 1, 0, 9],
           [11, 12]]
MAX_TOKENS = [7, 3, 5, 6, 2]          # sequences finish at different steps: batches 5, 4, 3, 2, 1


def _hf(ckpt, architecture):
    import transformers
    model = getattr(transformers, architecture).from_pretrained(ckpt, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p, n in zip(PROMPTS, MAX_TOKENS):
            g = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)
            out.append(g[0, len(p):].tolist())
    return out


def _engine(ckpt, debug, sensitivity=False):
    """Greedy tokens of PROMPTS with the decode-graph path uncaptured; with `sensitivity`, also the padded-step
    check and the tokens again with padding rows on slot 0 (a live sequence's) instead of the scratch slot."""
    from xllm_gen import LLM, SamplingParams
    with LLM(str(ckpt), device="cpu", dtype="float32", max_num_seqs=8, cuda_graph_sizes=[1, 2, 4, 8],
             _debug=debug) as llm:
        runner = llm.engine.runner
        assert runner.graphs is not None and not runner.graphs.capture and runner.graphs.has_state
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]

        def generate():
            return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
        outs = generate()
        if not sensitivity:
            return outs, None, None
        padding = padded_step_keeps_other_slots(runner, [5, 1, 3])
        runner.graphs.scratch_slot = 0
        return outs, padding, generate()


@pytest.mark.parametrize("architecture", RECURRENT_ARCHS)     # every generated model with a recurrent mixer
def test_uncaptured_decode_graphs_match_transformers(architecture, tiny_checkpoint):
    if architecture == "Qwen4ExpForCausalLM":
        pytest.skip("transformers 5.25 cannot generate Qwen4-Exp with a cache of DeltaNet layers only "
                    "(get_mask_sizes on LinearAttention layers); its parity runs cache-less in test_hyper_connections")
    ckpt = tiny_checkpoint(architecture)
    want = _hf(ckpt, architecture)
    got, padding, bad = _engine(ckpt, {"uncaptured_decode_graphs": True}, sensitivity=True)
    assert got == want
    assert padding == {"changed": [1, 3, 5], "scratch": True, "bucket": 4}
    # sensitivity: padding rows on slot 0 (a live sequence's) instead of the scratch slot change the tokens
    assert bad != want, "padding rows on a live slot did not change the tokens"


@pytest.mark.slow
def test_uncaptured_decode_graphs_read_the_state(tiny_checkpoint):
    ckpt = tiny_checkpoint("Qwen3NextForCausalLM")
    zeroed, _, _ = _engine(ckpt, {"uncaptured_decode_graphs": True, "zero_state_at_decode": True})
    assert zeroed != _hf(ckpt, "Qwen3NextForCausalLM"), \
        "zeroing the states before each graph decode step did not change the tokens"
