"""Mixture-of-experts ops: routing (softmax top-k; the general `select_experts`: sigmoid scores, a selection-only
bias, grouped top-k, a routed scale), alignment of (token, slot) pairs by expert, and the
experts' stacked gated MLP as a grouped GEMM.

Shapes: x [T, H]; w13 [E, 2 * I, H] (gate rows | up rows per expert); w2 [E, H, I]; topk_ids / topk_weights
[T, K]. An id outside 0..E-1 (use E) routes the pair nowhere: it contributes zero (padding rows of a
captured batch, experts held by another rank).

Everything here has static shapes and never reads a tensor on the host, so it can be captured in a CUDA
graph. `moe_align` is the data the grouped kernels consume (the torch reference here and the Triton kernel
in ops/moe_triton.py): the pairs sorted by expert, each expert's group padded to a multiple of `block_m`,
one expert per block of `block_m` rows.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over the experts (float32), the top_k largest probabilities and their experts; with
    `renormalize` the top_k weights are divided by their sum. Weights are returned in the logits' dtype."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("top2_sum", "max")
BIAS_ON = ("scores", "logits")     # what a selection-only bias is added to


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax",
                   n_group: int = 1, topk_group: int = 1, group_score: str = "top2_sum",
                   score_bias: Optional[torch.Tensor] = None, routed_scale: float = 1.0,
                   renormalize_min: float = 0.0, bias_on: str = "scores",
                   renormalize_epsilon: Optional[float] = None,
                   group_dropped: str = "excluded") -> tuple[torch.Tensor, torch.Tensor]:
    """The general routing, in float32 (as transformers' routers compute it): scores = softmax or sigmoid of the
    logits; the experts are chosen by `scores + score_bias` (a selection-only bias, transformers'
    e_score_correction_bias), among the `topk_group` of `n_group` equal groups of experts with the highest group
    score (`top2_sum`: the sum of the group's two highest choice scores, transformers' noaux_tc routers; `max`: its highest,
    transformers' group_limited_greedy); the weights are the chosen experts' `scores` (without the bias), divided by
    their sum when `renormalize` (+ 1e-20 for sigmoid scores, as transformers; with `renormalize_min` > 0 the sum
    clamped to at least it instead, ERNIE 4.5's moe_norm_min; with `renormalize_epsilon` the sum + it, LFM2-MoE's
    1e-6), times `routed_scale`. `bias_on="logits"`: the experts
    are chosen by `logits + score_bias` instead (a router that biases its logits); the weights are still the scores.
    `group_dropped="zero"`: the experts of the groups not kept get a choice score of 0 instead of -inf (they may
    still be chosen over experts of negative choice score: A.X-K2's router)."""
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    if bias_on not in BIAS_ON:
        raise ValueError(f"select_experts: bias_on must be one of {BIAS_ON}, got {bias_on!r}")
    base = logits if bias_on == "logits" else scores
    choice = base if score_bias is None else base + score_bias.float()
    if n_group > 1 and topk_group < n_group:
        choice = _keep_groups(choice, _group_scores(choice, n_group, group_score), topk_group, group_dropped)
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize and renormalize_min > 0.0:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=renormalize_min)
    elif renormalize and renormalize_epsilon is not None:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + renormalize_epsilon)
    elif renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    if routed_scale != 1.0:
        weights = weights * routed_scale
    return weights.to(router_logits.dtype), ids


def _group_scores(choice: torch.Tensor, n_group: int, group_score: str) -> torch.Tensor:
    """[T, n_group]: each group's score, the sum of its two best choice scores (top2_sum) or its best (max)."""
    T, E = choice.shape
    grouped = choice.view(T, n_group, E // n_group)
    return grouped.topk(2, dim=-1)[0].sum(dim=-1) if group_score == "top2_sum" else grouped.max(dim=-1).values


def _keep_groups(choice: torch.Tensor, gscore: torch.Tensor, topk_group: int, group_dropped: str) -> torch.Tensor:
    """The choice scores with the experts outside the topk_group best groups dropped (-inf, or 0 for "zero")."""
    T, E = choice.shape
    n_group = gscore.shape[1]
    gidx = torch.topk(gscore, k=topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, gidx, True)
    return choice.masked_fill(~keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E),
                              0.0 if group_dropped == "zero" else float("-inf"))


def choice_scores(router_logits: torch.Tensor, scoring: Optional[str] = "softmax",
                  score_bias: Optional[torch.Tensor] = None, bias_on: str = "scores") -> torch.Tensor:
    """[T, E] float32: the scores `select_experts` chooses experts by (`scoring` None: the logits themselves, as
    sparsemixer ranks them), a selection-only bias included."""
    logits = router_logits.float()
    scores = logits if scoring is None else torch.softmax(logits, -1) if scoring == "softmax" else torch.sigmoid(logits)
    return (logits if bias_on == "logits" else scores) + (0.0 if score_bias is None else score_bias.float())


def routing_margin(choice: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1,
                   group_score: str = "top2_sum", group_dropped: str = "excluded") -> torch.Tensor:
    """[T] how near each token's choice of experts is to a tie, from its `choice_scores`, as `select_experts`
    chooses, in score units: the gap between the top_k-th and the next choice score, and with groups half the gap
    between the topk_group-th and the next group score (a group score sums up to two choice scores), the smaller.
    Scores that each move by less than half of it keep the choice. A model run in bf16 may choose other experts than
    float32 where its rounding moves them by more: a discrete difference that no tolerance on the logits covers,
    which parity tests must tell from a routing error (codegen/verify_routing.py)."""
    T, E = choice.shape
    margin = torch.full((T,), float("inf"), device=choice.device)
    if n_group > 1 and topk_group < n_group:
        gscore = _group_scores(choice, n_group, group_score)
        g = gscore.sort(-1, descending=True).values
        margin = (g[:, topk_group - 1] - g[:, topk_group]) / 2
        choice = _keep_groups(choice, gscore, topk_group, group_dropped)
    if top_k < E:
        c = choice.sort(-1, descending=True).values
        margin = torch.minimum(margin, torch.where(torch.isinf(c[:, top_k]), torch.inf, c[:, top_k - 1] - c[:, top_k]))
    return margin


def sparsemixer(router_logits: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseMixer routing in eval mode (as transformers' sparsemixer with training=False): two
    experts, in the logits' dtype, static shapes.

    First: the top logit s1 (expert i1); the logits s_j with (s1 - s_j) / max(|s_j|, s1) > 2 * jitter_eps are masked
    out, and the weight of i1 is its softmax probability among the rest. Second: with i1's logit set to -inf, the
    top remaining logit s2 (expert i2) and the same relative mask around s2 (measured on the unmasked logits) give
    i2's weight. Nothing is renormalized. Returns (weights [T, 2], ids [T, 2])."""
    scores = router_logits
    top1, ids1 = scores.max(dim=-1, keepdim=True)
    factor = scores.abs().clamp(min=top1)
    gates1 = scores.masked_fill(((top1 - scores) / factor) > (2 * jitter_eps), float("-inf"))
    w1 = torch.softmax(gates1, dim=-1).gather(dim=-1, index=ids1)
    masked = torch.scatter(scores, -1, ids1, float("-inf"))
    top2, ids2 = masked.max(dim=-1, keepdim=True)
    factor = scores.abs().clamp(min=top2)
    gates2 = masked.masked_fill(((top2 - scores) / factor) > (2 * jitter_eps), float("-inf"))
    w2 = torch.softmax(gates2, dim=-1).gather(dim=-1, index=ids2)
    return torch.cat((w1, w2), dim=-1), torch.cat((ids1, ids2), dim=-1)


ROUTINGS = ("topk", "sparsemixer")


def localize(weights: torch.Tensor, ids: torch.Tensor, num_experts: int, first_expert: int = 0,
             num_local: Optional[int] = None, padding_slots: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed (weights, ids) with the ids made local to the experts [first_expert, first_expert + num_local) this
    rank holds, and every other pair routed nowhere (id num_local), as `route` does."""
    num_local = num_experts if num_local is None else num_local
    local = ids - first_expert
    keep = (local >= 0) & (local < num_local)
    if padding_slots is not None:
        keep = keep & (padding_slots >= 0).unsqueeze(-1)
    return weights, torch.where(keep, local, torch.full_like(local, num_local))


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, first_expert: int = 0,
          num_local: Optional[int] = None, padding_slots: Optional[torch.Tensor] = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_softmax, with the ids made local to the experts this rank holds, [first_expert, first_expert +
    num_local) (default: all), and every other pair routed nowhere (id num_local): another rank's expert, or a row
    whose `padding_slots` entry (the decode step's KV slot) is negative, a padding row of a captured batch.
    On CUDA one Triton launch (ops/moe_triton.py route_topk), else torch."""
    from xllm_gen.runtime.ops import use_triton
    if use_triton(router_logits) and router_logits.dim() == 2:
        from xllm_gen.runtime.ops.moe_triton import route_topk
        return route_topk(router_logits, top_k, renormalize, first_expert, num_local, padding_slots)
    return route_reference(router_logits, top_k, renormalize, first_expert, num_local, padding_slots)


def route_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool, first_expert: int = 0,
                    num_local: Optional[int] = None, padding_slots: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` in torch."""
    weights, ids = topk_softmax(router_logits, top_k, renormalize)
    num_local = router_logits.shape[-1] if num_local is None else num_local
    local = ids - first_expert
    keep = (local >= 0) & (local < num_local)
    if padding_slots is not None:
        keep = keep & (padding_slots >= 0).unsqueeze(-1)
    return weights, torch.where(keep, local, torch.full_like(local, num_local))


class Alignment(NamedTuple):
    sorted_pairs: torch.Tensor     # [P] int64: index of a (token, slot) pair (t * K + k), or T * K for padding
    block_expert: torch.Tensor     # [P / block_m] int64: the expert of each block of block_m rows (E: unused)
    num_rows: torch.Tensor         # [1] int64: rows in use (the padded groups of experts 0..E-1)


def padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The static row count P: every pair, plus at most block_m - 1 padding rows per expert in use (at most
    min(experts, pairs) of them), in whole blocks. A decode step of T tokens thus has at most T * top_k blocks."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return (rows + block_m - 1) // block_m * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sorts the (token, slot) pairs by expert (stable: tokens in order within an expert) and pads each
    expert's group to a multiple of block_m rows. Pairs routed nowhere (ids outside 0..E-1) are dropped."""
    E, device = num_experts, topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    flat = torch.where((flat >= 0) & (flat < E), flat, torch.full_like(flat, E))     # E: nowhere
    counts = torch.zeros(E + 1, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[E:].zero_()                                            # a kernel: no host copy (graph capture)
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)                     # pair indices sorted by expert
    expert_sorted = flat[order]
    first = torch.cumsum(counts, 0) - counts                     # where each expert's pairs start in `order`
    within = torch.arange(n, device=device) - first[expert_sorted]
    P = padded_rows(n, E, block_m)
    dest = torch.where(expert_sorted < E, starts[expert_sorted] + within, torch.full_like(within, P))
    sorted_pairs = torch.full((P + 1,), n, dtype=torch.int64, device=device)
    sorted_pairs.scatter_(0, dest, order)
    block_start = torch.arange(0, P, block_m, device=device)
    block_expert = torch.searchsorted(ends[:E].contiguous(), block_start, right=True)
    return Alignment(sorted_pairs[:P], block_expert, ends[E - 1:E].clone())


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
                        block_m: int = 16, b13: Optional[torch.Tensor] = None,
                        b2: Optional[torch.Tensor] = None, weights_on_input: bool = False,
                        out_norm: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * (w2[e] @ act(w13[e] @ x[t] + b13[e]) + b2[e]) with e = topk_ids[t, k], grouped
    by expert (the biases b13 [E, 2I], b2 [E, H] where given).

    `act` is the gated activation ([..., 2I] -> [..., I]: act(gate) * up). Each block of block_m rows (one
    expert) is one batched GEMM against that expert's weights; each token's outputs are summed in increasing
    expert order (as a per-expert loop with index_add would). Static shapes, no host sync.
    `weights_on_input`: sum_k w2[e] @ act(w13[e] @ (topk_weights[t, k] * x[t])) instead (the routing weights scale
    each chosen expert's input; the outputs are summed unweighted). `out_norm(y, expert)`: each pair's expert output
    normalized by its expert's own norm before the routing weight (layers/expert_norm.py)."""
    T, H = x.shape
    E, K = w13.shape[0], topk_ids.shape[-1]
    al = moe_align(topk_ids, E, block_m)
    nb = al.block_expert.numel()
    token = al.sorted_pairs // K                                  # T for padding rows
    xs = torch.cat([x, x.new_zeros(1, H)])[token].view(nb, block_m, H)
    w = torch.cat([topk_weights.reshape(-1), topk_weights.new_zeros(1)])[al.sorted_pairs]
    if weights_on_input:
        xs = (xs * w.view(nb, block_m, 1).to(xs.dtype))
    expert = al.block_expert.clamp(max=E - 1)                     # unused blocks read expert E-1, rows are zero
    h = torch.bmm(xs, w13[expert].transpose(1, 2))                # [nb, block_m, 2I]
    if b13 is not None:
        h = h + b13[expert].unsqueeze(1)
    y = torch.bmm(act(h), w2[expert].transpose(1, 2))             # [nb, block_m, H]
    if b2 is not None:
        y = y + b2[expert].unsqueeze(1)
    y = y.view(-1, H)                                             # [P, H]
    if out_norm is not None:                                      # per expert, before the routing weights
        y = out_norm(y, expert.repeat_interleave(block_m))
    if weights_on_input:                                          # padding rows: zero input, but b2 would add
        y = y * (al.sorted_pairs < topk_ids.numel()).unsqueeze(1).to(y.dtype)
    else:
        y = y * w.unsqueeze(1).to(y.dtype)
    out = x.new_zeros(T + 1, H)
    out.index_add_(0, token, y.to(x.dtype))
    return out[:T]


def dequantize_experts(codes: torch.Tensor, scale: torch.Tensor, bk: int, dtype: torch.dtype,
                       zeros: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Packed expert weights [E, rows, K] in `dtype`: what the dequantized experts hold. Float8 codes times their
    scales [E, rows, ceil(K / bk)] (one per row and bk columns); or, with `zeros`, 4-bit codes two to a byte
    (uint8 [E, rows, K / 2], column 2c in the low nibble of byte c, 2c + 1 in the high one) read as (q - zero) x scale
    in float32, rounded once, with a zero (uint8) and a scale per row and group of bk columns (pack_int4_experts)."""
    K = codes.shape[-1]
    if zeros is not None:
        q = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(*codes.shape[:-1], 2 * K).to(torch.float32)
        z = zeros.to(torch.float32).repeat_interleave(bk, -1)
        return ((q - z) * scale.to(torch.float32).repeat_interleave(bk, -1)).to(dtype)
    from xllm_gen.runtime.ops.quant_gemv import dequant_fp8  # the dense layers' (PackedFp8), row by row
    return dequant_fp8(codes.reshape(-1, K), scale.reshape(-1, scale.shape[-1]), (1, bk), dtype).view(codes.shape)


def dequantize_packed(packed: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A FusedMoE.packed entry, (codes, scale, bk) float8 or (codes, scale, bk, zeros) 4-bit, dequantized."""
    codes, scale, bk, *zeros = packed
    return dequantize_experts(codes, scale, bk, dtype, *zeros)


def pack_int4_experts(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                      group: int) -> Optional[tuple]:
    """This rank's experts [E, rows, K] as per-element 4-bit codes, zeros and scales (float32, the loader's parts)
    -> (codes two to a byte [E, rows, K / 2], scales [E, rows, K / group] (float16 where exact, else float32),
    group, zeros uint8 [E, rows, K / group]): FusedMoE.packed's int4 form; None where the codes do not pack so
    (act-order GPTQ, a TP split that cuts a group, 8 bits): the experts then keep their dequantized weight."""
    from xllm_gen.runtime.layers.int_quant import int4_groups  # the dense layers' rule (pack_components)
    groups = None if codes.shape[-1] % 2 else int4_groups(codes, zeros, scales, group)
    if groups is None:
        return None
    s, z = groups
    return pack_nibbles(codes.to(torch.uint8)), s, group, z


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes uint8 [..., K] -> two to a byte [..., K / 2]: column 2c in the low nibble of byte c."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str, act: Callable[[torch.Tensor], torch.Tensor],
              b13: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None,
              mid: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
              scales13: Optional[tuple] = None, scales2: Optional[tuple] = None) -> torch.Tensor:
    """The experts' output: the Triton grouped kernel (ops/moe_triton.py) for a SiLU gate without expert biases
    on CUDA, else the torch reference (on any device; static shapes, graph-capturable). `activation` names the
    gate ("silu", "gelu_tanh", "swiglu_clamped", ...), `act` is its gated module (with `mid` applied to its output,
    when given); b13 / b2 the expert biases. `mid`: what the intermediate goes through before the down projections
    (a quantized checkpoint's activation quantization), for the Triton path, which fuses the activation.
    `scales13` / `scales2`: w13 / w2 are packed with these (scale, bk) (float8) or (scale, bk, zeros) (4-bit codes two
    to a byte; dequantize_experts): the Triton kernels read them as they are, the torch path dequantizes them."""
    if (scales13 is not None or scales2 is not None) and not (x.is_cuda and activation == "silu" and b13 is None
                                                               and b2 is None and _triton(x)):
        w13 = w13 if scales13 is None else dequantize_packed((w13, *scales13), x.dtype)
        w2 = w2 if scales2 is None else dequantize_packed((w2, *scales2), x.dtype)
        scales13 = scales2 = None
    if b13 is not None or b2 is not None:
        return fused_moe_reference(x, w13, w2, topk_weights, topk_ids, act, b13=b13, b2=b2)
    if x.is_cuda and activation == "silu" and _triton(x):
        from xllm_gen.runtime.ops.moe_triton import fused_moe_silu
        return fused_moe_silu(x, w13, w2, topk_weights, topk_ids, mid=mid, scales13=scales13, scales2=scales2)
    return fused_moe_reference(x, w13, w2, topk_weights, topk_ids, act)


def _triton(x: torch.Tensor) -> bool:
    from xllm_gen.runtime.ops import use_triton
    return use_triton(x)
