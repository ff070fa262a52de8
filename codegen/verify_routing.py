"""MoE routing near-ties for 16-bit comparisons (`xllm-gen verify --dtype bfloat16`, tests/gpu/test_gpu_specs.py).

In bf16 / fp16 a token whose experts nearly tie may be routed to other experts than in float32: a discrete
difference at that position that no tolerance on hidden states or log-probabilities covers, and that transformers'
own 16-bit run makes at other positions (a tiny GLM-4-MoE's position 92 was 0.6 off: its top-2 experts 0.0015 apart).
The reference routing is the engine's own in float32 (which matches transformers float32: the CPU batteries); per
MoE layer and position, `noise` is the largest change of a choice score between the two runs (without the
selection-only bias, a parameter that rounding does not move). A choice changes only where two scores move by more
than its margin (runtime/ops/moe.py routing_margin, in score units), so by less than twice the noise. A position is
set aside where its experts differ, or where its margin is within twice the noise or MIN_MARGIN of the scores'
spread (a decode step rounds otherwise than the teacher-forced prefill recorded here); experts that differ although
the float32 margin is over 4x the noise (twice what rounding can overturn) are a routing error.
"""
from __future__ import annotations

MIN_MARGIN = 0.01


def moe_layers(model) -> list:
    from xllm_gen.runtime.layers.moe import FusedMoE
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def record_routing(model, run, runner=None) -> list:
    """run() (the prefill of one sequence) with hooks on `model`'s MoE layers: per MoE layer its
    FusedMoE.routing_view over the sequence's positions (the chunks of a chunked prefill joined), on the host. A
    runner's piecewise prefill graphs are off meanwhile (hooks do not run inside a replayed graph)."""
    import torch
    layers = moe_layers(model)
    calls = {id(m): [] for m in layers}

    def hook(module, args, kwargs):
        logits = args[1] if len(args) > 1 else kwargs["router_logits"]
        bias = args[2] if len(args) > 2 else kwargs.get("score_bias")
        calls[id(module)].append([t.cpu() for t in module.routing_view(logits, bias)])
    hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in layers]
    graphs = getattr(runner, "prefill_graphs", None)
    if graphs is not None:
        runner.prefill_graphs = None
    try:
        run()
    finally:
        if graphs is not None:
            runner.prefill_graphs = graphs
        for h in hooks:
            h.remove()
    from xllm_gen.runtime.layers.moe import RoutingView
    return [RoutingView(*(torch.cat(parts) for parts in zip(*calls[id(m)]))) for m in layers if calls[id(m)]]


def routing_ties(views: list, views32: list, n: int):
    """([n] bool: positions set aside, [(MoE layer, positions, float32 margins, noise)] routing errors) from the
    16-bit run's routing views and the float32 run's, per MoE layer, over the same n positions."""
    import torch
    tie = torch.zeros(n, dtype=torch.bool)
    errors = []
    for layer, (v, v32) in enumerate(zip(views, views32)):
        noise = (v.unbiased - v32.unbiased).abs().amax(-1)
        spread = v32.unbiased.amax(-1) - v32.unbiased.amin(-1)
        differs = (v.experts != v32.experts).any(-1)
        wrong = (differs & (v32.margin > 4 * noise + 1e-6 * spread)).nonzero().flatten().tolist()
        if wrong:
            errors.append((layer, wrong, v32.margin[wrong].tolist(), noise[wrong].tolist()))
        tie |= differs | (v.margin < torch.maximum(2 * noise, MIN_MARGIN * spread))
    return tie, errors
