"""Piecewise prefill CUDA graphs (runtime/executor/prefill_graphs.py), the parts that do not need a GPU:

- bucket options: validated, capped at max_num_batched_tokens, [] switches them off;
- the piece boundary protocol, for every spec in specs/: with the forward context's `graph_break` set, each
  attention layer of the generated model hands its (q, k, v) to the break exactly once per forward, in layer
  order, with [T, heads, head_dim] shapes, and the model consumes what the break returns (the output changes
  with it). A model that attended any other way would be captured wrongly, so it must fail here.
- which runners may use them: every generated runner (its step is model(ids, positions, inputs_embeds));
  multimodal ones are captured on inputs_embeds, with their deepstack buffers in the capture context (the
  deepstack rows of that context must reach the output: zero vs non-zero features differ).
Replay against eager prefill runs on a GPU (tests/gpu/test_gpu_prefill_graphs.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from fixtures.tiny_hf import tiny_config
from spec_sample import sampled

from xllm_gen.runtime.executor.context import ForwardContext, reset_context, set_context
from xllm_gen.runtime.executor.model_runner import ModelRunner
from xllm_gen.runtime.executor.prefill_graphs import DEFAULT_PREFILL_GRAPH_SIZES, prefill_graph_sizes
from xllm_gen.runtime.loading import registry

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted((ROOT / "specs").glob("*.yaml"))


def test_bucket_options():
    assert prefill_graph_sizes(None, 10**6) == DEFAULT_PREFILL_GRAPH_SIZES
    assert prefill_graph_sizes(None, 1000) == tuple(b for b in DEFAULT_PREFILL_GRAPH_SIZES if b <= 1000)
    assert prefill_graph_sizes([64, 16, 64, 5000], 4096) == (16, 64)
    assert prefill_graph_sizes([], 4096) == ()
    for bad in ([0], [16, -1], [1.5], [True]):
        with pytest.raises(ValueError, match="prefill_graph_sizes"):
            prefill_graph_sizes(bad, 4096)


def _architecture(path: Path) -> str:
    spec = yaml.safe_load(path.read_text())
    while "architectures" not in spec:
        spec = yaml.safe_load((path.parent / spec["extends"]).read_text())
    return spec["architectures"][0]


@pytest.mark.parametrize("spec", sampled("prefill_breaks", SPECS, lambda p: p.stem), ids=[p.stem for p in SPECS])
def test_every_attention_layer_breaks_once(spec):
    import transformers
    arch = _architecture(spec)
    if not hasattr(getattr(transformers, arch, None), "config_class"):
        pytest.skip(f"{arch} is remote code (no transformers config class to build the tiny config from); "
                    f"tests/test_remote_{spec.stem}.py serves it")
    torch.manual_seed(0)
    cfg = tiny_config(arch).to_dict()
    model_module, runner_module = registry.resolve(cfg)
    if getattr(model_module, "RECURRENT_LAYERS", ()):
        pytest.skip("recurrent-state layers: the runner serves the model eagerly (no prefill or decode graphs)")
    runner_cls = runner_module.Runner
    with torch.device("cpu"):
        model = model_module.Model(model_module.Config.from_hf(cfg)).float().eval()
    with torch.no_grad():                      # parameters are allocated uninitialised (the loader fills them)
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name and p.dim() == 1 else 0.05 * torch.randn_like(p))
    embeds_input = runner_cls.prefill_embeds is not ModelRunner.prefill_embeds
    assert runner_cls.forward is ModelRunner.forward, f"{spec.stem}: a runner overriding forward prefills eagerly"
    assert embeds_input == runner_cls.multimodal
    assert not embeds_input or callable(getattr(model, "embed_input_ids", None)), (
        f"{spec.stem}: a multimodal runner's prefill graphs embed text-only steps with model.embed_input_ids")
    from xllm_gen.runtime import layers as L
    # what the CUDA attention path refuses at load (runner_backend.py): no prefill graphs to break
    if any(isinstance(m, (L.SparseIndexer, L.ValueKeyBias)) for m in model.modules()):
        pytest.skip("a sparse-attention indexer or a per-key score bias: refused on CUDA at load (no prefill graphs)")
    if any(isinstance(m, L.Attention) and m.kv_owner is not None for m in model.modules()):
        pytest.skip("KV shared across layers: refused on CUDA at load (no prefill graphs)")
    attn = [m for m in model.modules() if isinstance(m, L.Attention)]
    T = 7
    ids = torch.randint(0, 100, (T,))
    cfg_obj = model_module.Config.from_hf(cfg)
    pos = torch.arange(T) if runner_cls.position_rows == 1 else torch.arange(T).expand(runner_cls.position_rows, T)
    embeds = model.embed_input_ids(ids) if embeds_input else None
    levels = getattr(cfg_obj, "deepstack_levels", 0)
    deepstack = None
    calls = []

    def run(fill: float):
        def graph_break(layer, q, k, v, sinks=None):
            calls.append(layer)
            assert (sinks is not None) == layer.variant.sinks      # a layer with sinks hands them to the break
            assert sinks is None or sinks.shape == (layer.num_heads,)
            assert q.shape == (T, layer.num_heads, layer.head_dim)
            assert k.shape == (T, layer.num_kv_heads, layer.head_dim)
            assert v.shape == (T, layer.num_kv_heads, layer.v_head_dim)      # value heads: a width of their own
            return torch.full((T, layer.num_heads * layer.v_head_dim), fill)
        set_context(ForwardContext(is_prefill=True, cu_seqlens_q=None, seq_lens=None, slot_mapping=None,
                                   block_tables=None, graph_break=graph_break, deepstack=deepstack))
        try:
            with torch.inference_mode():
                return model(ids, pos, embeds) if embeds_input else model(ids, pos)
        finally:
            reset_context()

    out_a = run(0.5)
    assert torch.isfinite(out_a).all()
    assert calls == attn, f"{spec.stem}: {len(calls)} attention breaks for {len(attn)} attention layers"
    calls.clear()
    out_b = run(-0.5)
    assert out_a.shape == (T, cfg_obj.hidden_size)
    assert not torch.allclose(out_a, out_b), f"{spec.stem}: the attention output does not reach the model's output"
    if levels:       # deepstack buffers as prefill_graph_context gives them: rows of the step, zero elsewhere
        from xllm_gen.runtime.executor.context import DeepstackInput
        rows = torch.zeros(T, dtype=torch.int64)
        feats = torch.zeros(levels, T, cfg_obj.hidden_size)
        deepstack = DeepstackInput(rows, feats)
        calls.clear()
        assert torch.equal(run(0.5), out_a), f"{spec.stem}: zero deepstack rows must change nothing"
        rows[:2] = torch.tensor([3, 5])
        feats[:, :2] = torch.randn(levels, 2, cfg_obj.hidden_size)
        calls.clear()
        out_c = run(0.5)
        changed = (out_c - out_a).abs().amax(dim=-1) > 1e-6
        assert changed[3] and changed[5], f"{spec.stem}: deepstack features in the context do not reach the output"


def test_server_flags():
    from xllm_gen.runtime.serving.server import _parser
    ap = _parser()
    assert ap.parse_args([]).prefill_graph_sizes is None                    # the default buckets
    assert ap.parse_args(["--prefill-graph-sizes"]).prefill_graph_sizes == []     # eager prefill
    a = ap.parse_args(["--prefill-graph-sizes", "16", "256", "--cuda-graph-sizes", "1", "8"])
    assert a.prefill_graph_sizes == [16, 256] and a.cuda_graph_sizes == [1, 8]
    assert all(action.help for action in ap._actions), "every flag has help text"


def test_prefill_steps_keep_gemms_off_the_skinny_kernels():
    """Decode steps (and the tunings' timing calls, outside any step) may take the skinny-GEMM kernels; a prefill
    step may not (layers/linear.py decode_step): their launch config follows the row count, so an eager prefill and
    the same prompt padded into a prefill graph's bucket would sum in different orders."""
    from xllm_gen.runtime.layers.linear import decode_step
    reset_context()
    assert decode_step()
    for prefill in (True, False):
        set_context(ForwardContext(is_prefill=prefill, cu_seqlens_q=None, seq_lens=None, slot_mapping=None,
                                   block_tables=None))
        try:
            assert decode_step() is not prefill
        finally:
            reset_context()
