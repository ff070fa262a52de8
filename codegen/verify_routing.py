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

A position routed otherwise also moves every later position, through attention: one flip early in a sequence
contaminates the rest, which no per-position rule tells from an error. So the 16-bit run's teacher-forced logits
are compared with its routing forced to the float32 run's (`forced_routing`: the float32 router logits fed to every
MoE layer): the same experts and weights at every position, only the arithmetic in 16 bits, compared everywhere.
A free-running comparison (greedy decode) sets aside the positions after the first differing experts
(`contaminated`).
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

MIN_MARGIN = 0.01


def moe_layers(model) -> list:
    from xllm_gen.runtime.layers.moe import FusedMoE
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


class Routing(NamedTuple):
    """How one sequence was routed, per MoE layer: FusedMoE.routing_view, and the router logits (float32, host)."""
    views: list
    logits: list


def _router_logits(args, kwargs):
    return args[1] if len(args) > 1 else kwargs["router_logits"]


@contextlib.contextmanager
def _hooked(model, runner, hook):
    """`hook` as a forward pre-hook (with kwargs) on every MoE layer of `model`; a runner's piecewise prefill graphs
    are off meanwhile (hooks do not run inside a replayed graph)."""
    hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in moe_layers(model)]
    graphs = getattr(runner, "prefill_graphs", None)
    if graphs is not None:
        runner.prefill_graphs = None
    try:
        yield
    finally:
        if graphs is not None:
            runner.prefill_graphs = graphs
        for h in hooks:
            h.remove()


def record_routing(model, run, runner=None) -> Routing:
    """run() (the prefill of one sequence) with hooks on `model`'s MoE layers: per MoE layer its
    FusedMoE.routing_view and router logits over the sequence's positions (the chunks of a chunked prefill joined),
    on the host."""
    import torch
    layers = moe_layers(model)
    calls = {id(m): [] for m in layers}

    def hook(module, args, kwargs):
        logits = _router_logits(args, kwargs)
        bias = args[2] if len(args) > 2 else kwargs.get("score_bias")
        calls[id(module)].append([t.cpu() for t in module.routing_view(logits, bias)] + [logits.float().cpu()])
    with _hooked(model, runner, hook):
        run()
    from xllm_gen.runtime.layers.moe import RoutingView
    joined = [[torch.cat(parts) for parts in zip(*calls[id(m)])] for m in layers if calls[id(m)]]
    return Routing([RoutingView(*j[:3]) for j in joined], [j[3] for j in joined])


@contextlib.contextmanager
def forced_routing(model, logits: list, runner=None):
    """Within it, a run of the same sequence routes as `logits` say (Routing.logits of a float32 run of `model`'s
    spec, one [T, E] per MoE layer): each MoE layer's router logits are replaced by those rows, in float32, so the
    experts and their weights are the float32 run's. Only for one process (tensor parallel ranks elsewhere would
    route by their own logits). Raises if the run's positions do not match the logits'."""
    layers = moe_layers(model)
    if len(layers) != len(logits):
        raise ValueError(f"forced_routing: {len(logits)} MoE layers' logits for a model of {len(layers)}")
    slot = {id(m): i for i, m in enumerate(layers)}
    taken = [0] * len(layers)
    plain = [m.plain_routing for m in layers]

    def hook(module, args, kwargs):
        i = slot[id(module)]
        got = _router_logits(args, kwargs)
        t0, t1 = taken[i], taken[i] + got.shape[0]
        if t1 > logits[i].shape[0]:
            raise ValueError(f"forced_routing: MoE layer {i} routes positions {t0}..{t1 - 1}, the float32 run "
                             f"had {logits[i].shape[0]}")
        taken[i] = t1
        forced = logits[i][t0:t1].to(got.device)
        if len(args) > 1:
            return (args[0], forced, *args[2:]), kwargs
        return args, {**kwargs, "router_logits": forced}
    for m in layers:             # the general routing casts the float32 weights to the activations' dtype
        m.plain_routing = False
    try:
        with _hooked(model, runner, hook):
            yield
    finally:
        for m, p in zip(layers, plain):
            m.plain_routing = p
    short = [(i, n, lg.shape[0]) for i, (n, lg) in enumerate(zip(taken, logits)) if n != lg.shape[0]]
    if short:
        raise ValueError(f"forced_routing: (MoE layer, positions routed, positions of the float32 run) {short}")


def contaminated(differs) -> "torch.Tensor":  # noqa: F821
    """[n] bool: the positions at and after the first one whose experts differ (`differs`, [n] bool): a free run's
    later positions attend to it, so they are not comparable with the reference's."""
    return differs.cumsum(0) > 0


class RoutingTies(NamedTuple):
    tie: "torch.Tensor"          # noqa: F821  [n] bool: positions set aside (experts differ, or within noise of a tie)
    differs: "torch.Tensor"      # noqa: F821  [n] bool: positions whose experts differ in some MoE layer
    errors: list                 # [(MoE layer, positions, float32 margins, noise)]: routing errors


def routing_ties(views: list, views32: list, n: int) -> RoutingTies:
    """The positions set aside and the routing errors, from the 16-bit run's routing views and the float32 run's, per
    MoE layer, over the same n positions."""
    import torch
    tie = torch.zeros(n, dtype=torch.bool)
    any_differs = torch.zeros(n, dtype=torch.bool)
    errors = []
    for layer, (v, v32) in enumerate(zip(views, views32)):
        noise = (v.unbiased - v32.unbiased).abs().amax(-1)
        spread = v32.unbiased.amax(-1) - v32.unbiased.amin(-1)
        differs = (v.experts != v32.experts).any(-1)
        wrong = (differs & (v32.margin > 4 * noise + 1e-6 * spread)).nonzero().flatten().tolist()
        if wrong:
            errors.append((layer, wrong, v32.margin[wrong].tolist(), noise[wrong].tolist()))
        tie |= differs | (v.margin < torch.maximum(2 * noise, MIN_MARGIN * spread))
        any_differs |= differs
    return RoutingTies(tie, any_differs, errors)
