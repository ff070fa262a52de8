"""Where the generated code fuses an op into the decode GEMV of the linear layer after it (runtime layers/fused.py).

Decided from the IR, so a spec whose layers do not have the pattern keeps the plain code:

- norm prologue: a residual step `norm -> block` (not a parallel branch; a per-layer choice alternative by
  alternative, the layer's `self.<module>_fused` flag choosing the call) whose norm is an
  RMSNorm without bias (any weight_offset) and whose block's first op is a column-parallel linear of the normed
  input (attention: the fused q/k/v projection; gated MLP: gate/up; MLP: up). The layer then calls
  `block(..., hidden_states, residual, norm)` and the block computes `L.norm_linear(norm, first_linear, ...)`,
  returning (output, residual). A block is fused only if every step that uses it is such a step.
- KV-cache store in the rotary kernel: an attention block whose q/k norm + rotary is the fused qk_norm_rope form
  (per-head RMSNorm before a rotary, shared weights), or that has no q/k norm and rotary on every layer, calls
  `L.qk_norm_rope_store(..., v, ..., self.attn)`, which at decode also writes k and v into the attention's paged
  cache, and passes `kv_stored` to the attention layer (which then does not store them again).
- activation prologue: a gated MLP whose activation is one the fused kernels compute (silu / swish, gelu,
  gelu_pytorch_tanh, gelu_new) or a config symbol choosing it at load (the runtime falls back to the plain ops for
  other values) calls `L.act_linear(act_fn, down, gate_up)`.
- whole-layer kernel: a layer that is exactly `norm -> attention`, `norm -> gated MLP` (both steps norm prologues,
  the attention's q/k norm + rotary the fused store form, no other feature of either block, no per-layer choice)
  first calls `L.decoder_layer_kernel(...)` with its four modules; at a small CUDA decode step that runs the layer
  as one persistent kernel (runtime/ops/layer_kernel.py) and returns its output, else None and the steps follow.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ir import AttentionIR, GatedMLPIR, ModelIR, NormIR

NORM_PROLOGUE_KINDS = ("attention", "gated_mlp", "mlp")
FUSED_GATED_ACTS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new")


# attention features the whole-layer kernel does not compute: each must be off (None / False / empty)
LAYER_KERNEL_ATTENTION_OFF = ("softcap", "chunk_size", "query_scale", "clip_qkv", "sinks", "out_gate", "alibi",
                              "q_gate", "sub_norm", "differential", "v_head_dim", "value_scale", "v_norm",
                              "values_from_keys", "kv_source", "sinks_when", "input_width", "lora", "qkv_scale",
                              "out_scale", "experts", "key_bias", "kv_nvfp4")


@dataclass(frozen=True)
class FusionPlan:
    norm_prologue: frozenset      # names of the blocks whose step norm runs in their first linear's GEMV
    layer_kernel: tuple = ()      # (norm, attention, norm, gated MLP, q norm, k norm) of a layer the whole-layer
                                  # kernel may run (the q / k norms None where the attention has none)

    @staticmethod
    def act_prologue(b: GatedMLPIR) -> bool:
        """The gated MLP's activation runs in its down projection's GEMV."""
        if b.activation_params or b.sub_norm is not None:   # a sub_norm runs between the activation and down
            return False
        return b.activation.literal is None or b.activation.literal in FUSED_GATED_ACTS

    @staticmethod
    def rope_store(b: AttentionIR) -> str | None:
        """"qk_norm_rope" / "rope": the attention's rotary step (with its q/k norm) also stores k, v; None: not."""
        if b.differential is not None or b.experts is not None:   # paired values / routed q: the plain path
            return None
        if b.v_head_dim is not None or b.value_scale is not None:   # v of its own width, or scaled: the attention stores
            return None
        if b.kv_nvfp4 is not None:        # k, v are rounded after the rotary step, before the cache: the attention stores
            return None
        if b.v_norm is not None or b.values_from_keys is not None or b.kv_source is not None:  # the attention stores
            return None
        n = b.qk_norm
        if n is not None:
            return "qk_norm_rope" if n.fusable else None
        return "rope" if b.rotary is not None and b.rotary.enabled.literal is True else None


def _layer_kernel(ir: ModelIR, norm_prologue: frozenset) -> tuple:
    """(norm, attention, norm, gated MLP, q norm, k norm) where the layer is exactly those two pre-norm steps (see the module
    docstring), else ()."""
    layer = ir.layer
    if (layer.alt_cond is not None or layer.shared or layer.output_scale or layer.uses_per_layer_input
            or ir.per_layer_input is not None
            or layer.uses_embeddings or len(layer.steps) != 2 or len(layer.blocks) != 4):
        return ()
    blocks = {b.name: b for b in layer.blocks}
    s1, s2 = layer.steps
    for s in (s1, s2):
        if (type(s).__name__ != "StepIR" or s.choice is not None or s.norm is None or s.post_norm or s.scale
                or s.after_norm or s.add or s.input_scale or s.residual_normed or s.when is not None
                or s.residual_scale is not None or s.gate is not None
                or s.block not in norm_prologue):
            return ()
    attn, mlp = blocks[s1.block], blocks[s2.block]
    if not (isinstance(attn, AttentionIR) and attn.kind == "attention" and isinstance(mlp, GatedMLPIR)):
        return ()
    if any(getattr(attn, f) not in (None, False, ()) for f in LAYER_KERNEL_ATTENTION_OFF):
        return ()
    if FusionPlan.rope_store(attn) is None or attn.rotary is None or not FusionPlan.act_prologue(mlp):
        return ()
    if mlp.lora is not None or mlp.gate_up_scale or mlp.down_scale is not None:
        return ()
    qk = (attn.qk_norm.q, attn.qk_norm.k) if attn.qk_norm is not None else (None, None)
    return (s1.norm, s1.block, s2.norm, s2.block) + qk


def fusion_plan(ir: ModelIR) -> FusionPlan:
    layer = ir.layer
    if ir.residual_float32.literal is not False:    # the step norms add into a float32 stream: the plain ops
        return FusionPlan(frozenset())
    blocks = {b.name: b for b in layer.blocks}
    ok, bad = set(), set()
    for s in layer.all_steps:
        parallel = hasattr(s, "branches")
        for st in (s.branches if parallel else (s,)):
            names = st.choice.alternatives if st.choice is not None else (st.block,)
            norm = blocks.get(st.norm) if st.norm else None
            # in a parallel step the first branch only, where no other branch reads its norm's output (they read
            # the stream the fused call returns, or their own norm of it)
            alone = not parallel or (getattr(s, "value", None) is None and st is s.branches[0]   # not a branch step
                                     and all(b.norm != st.norm for b in s.branches[1:]))
            step_ok = (alone and (st.choice is None or not parallel)   # a choice: per layer, in a plain step
                       and st.input_scale is None                            # the GEMV reads norm(x) itself
                       and isinstance(norm, NormIR) and norm.kind == "rmsnorm" and norm.gate_rank is None
                       and not norm.bias and norm.always
                       and getattr(st, "add", None) is None                  # the norm reads residual + a value
                       and getattr(st, "hyper", None) is None                # the norm reads a stream mix, no add
                       and not getattr(st, "residual_normed", False))        # the stream becomes norm(x) itself
            for name in names:        # a per-layer choice: each alternative on its own (the layer's flag picks the call)
                b = blocks[name]
                fusable = (step_ok and b.kind in NORM_PROLOGUE_KINDS
                           and not getattr(b, "out_gate", None)   # the gate reads the normed input
                           and not getattr(b, "lora", None)       # the adapters read the normed input
                           and not getattr(b, "experts", None)    # the router reads it too
                           and not getattr(b, "multiply", False))  # it takes a per-layer input too
                (ok if fusable else bad).add(name)
    norm_prologue = frozenset(ok - bad)
    return FusionPlan(norm_prologue, _layer_kernel(ir, norm_prologue))
