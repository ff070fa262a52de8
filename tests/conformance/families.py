"""The conformance battery's data: transformers' decoder-only families, the specs that serve them, and the
feature-ON tiny config of each served family. Nothing here runs a model (docs/coverage.md is built from it).

Enumeration (`decoder_families()`): the classes of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES whose name
ends in `ForCausalLM` / `LMHeadModel`, one row per class (the model types mapping to it listed), minus
  - model types of the seq2seq / speech-seq2seq mappings (the decoder half of an encoder-decoder) and of the
    masked-LM mapping (encoders run as decoders: BERT, RoBERTa, ...);
  - classes whose every model type is multimodal (image-text / multimodal-LM mappings, or a config with a
    vision / audio / encoder sub-config);
  - NOT_DECODER_ONLY (a reason each, shown in docs/coverage.md).
A class is served when a spec in specs/ (globbed) lists it in `architectures`.

Feature-ON config (`feature_toggles`): generic rules over the fields of the family's config class (its default
config at the decoder level), each rule one toggle {dotted field: value}:
  - every bool field named `*bias` (attention_bias, mlp_bias, use_bias, qkv_bias, ...) -> true;
  - every `*softcap*` field -> a finite, small value (attention 5.0, final logits 2.0);
  - a sliding window smaller than the prompts: `sliding_window` 6 (+ `use_sliding_window` true, and
    `max_window_layers` 1 where the config has them, so that layers past the first use the window);
  - partial rotary: `partial_rotary_factor` (top level or in rope_parameters) / `rotary_pct` 0.5 where the
    default rotates the whole head;
  - q/k norms: every bool field named `*qk_norm*` / `*qk_layernorm*` -> true;
  - scalings: `*multiplier*` fields 0.5 (embedding: 3.0), `logits_scaling` / `logit_scale` doubled,
    `query_pre_attn_scalar` twice the tiny head_dim;
  - `clip_qkv` 1.0 where the field exists and is off;
  - `norm_topk_prob` flipped; `tie_word_embeddings` flipped; multi-query: `num_key_value_heads` 1;
  - rope scaling: the first of llama3 / yarn / linear that the spec's `type: rope` symbol admits, with the
    spec battery's standard parameters (ROPE_ARMS).
FEATURE_OVERRIDES adds per-architecture toggles where no generic rule can decide.

Each toggle is probed alone against the spec's config guard (the generated `Config.from_hf` on the config.json
that the tiny checkpoint would get): a toggle the guard refuses is recorded as refused (with the guard's
message, which must name the field); the accepted toggles together are the family's feature-ON config.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "tests") not in sys.path:          # `python -m tests.conformance.coverage` from the repo root
    sys.path.insert(0, str(ROOT / "tests"))

from spec_yaml import read_yaml  # noqa: E402

# A class whose model types all pass the mapping rules but that is not a decoder-only text model.
NOT_DECODER_ONLY: dict[str, str] = {
    "TrOCRForCausalLM": "the text decoder of a vision encoder-decoder (cross-attention)",
    "XLNetLMHeadModel": "permutation language model (two-stream attention), not a causal decoder",
}

# Decoder-only classes that no spec claims because the language (or the runtime) lacks what they need: {class: the
# reason}, shown in docs/coverage.md (status "not expressible") instead of a bare "not yet".
_DRAFTER = ("a drafter for its target model's assisted generation, not a standalone LM: it takes no token ids (its "
            "input is pre_projection of the target's [embedding | last hidden state], 2 * backbone_hidden_size wide), "
            "every layer attends over the target's KV states (shared_kv_states of the target's last full and last "
            "sliding layer, under bidirectional masks) instead of a cache of its own, and it returns "
            "post_projection(h) to the target besides its logits (optionally through centroid-masked ordered "
            "embeddings). The engine's draft_model proposer runs a standalone checkpoint on its own tokens and KV "
            "cache; a drafter fed by the target's hidden states and KV cache is not in the runtime or the language")
_INKLING = (
    "a per-(query, distance) relative-position logit on every score (r_proj(x) per query head times a learned bank "
    "rel_logits_proj.proj [d_rel, rel_extent], gathered by i - j, zero beyond rel_extent; scaled with q by the "
    "log_scaling_* temperature on the full layers), which no attention backend takes (ALiBi's per-head slope is the "
    "only score bias); short causal convolutions with a skip (float32, a conv state per sequence) on k and v inside "
    "the attention (k_sconv / v_sconv) and on the attention and MLP outputs before the residual adds (attn_sconv / "
    "mlp_sconv): a conv state inside an attention block and on a step's output, which neither the attention block "
    "nor a dataflow step has a form for; a router that scores the shared experts beside the routed ones (weights: softmax over "
    "logsigmoid of [top-k routed logits, shared logits], times route_scale and a learned global_scale; the shared "
    "experts [n_shared, I, H] each weighted by its own share), which the moe block's shared expert (unweighted or "
    "sigmoid-gated, outside the routing) is not (codegen/README.md, Not expressible yet)")
_INKLING2 = (
    "Inkling's per-(query, distance) relative-position logit and in-attention short convolutions, plus: block "
    "attention residuals (each layer's attention / MLP input, and the final norm's, is an attention with learned "
    "queries over the RMS-normed outputs of the earlier blocks of n_layers_per_attn_res_block layers and the running "
    "partial block, 3 queries giving separate q / k / v inputs on the full layers), per-token attention sinks "
    "(sink_proj(x): a logit per query head and token), L2-clipped q / k / relative states with learned per-dim "
    "scales, dynamic short convolutions of k and v on the full layers (per-token taps projected from the layer "
    "input), scaled short convolutions on the residual branches, softcapped SwiGLU experts "
    "(softcap(g) * sigmoid(g) * softcap(u)) (codegen/README.md, Not expressible yet)")

# Served families whose spec serves less than the family's whole range on purpose (refusing the rest by name):
# {architecture: what is refused and why}, shown in docs/coverage.md's last column
SERVED_LIMITS = {
    "Kolibri1_1ForCausalLM": (
        "context capped at the indexer's dense budget (index_topk + index_num_local_tokens + index_num_sink_tokens: "
        "2184 tokens at transformers' defaults, max_model_len): past it transformers attends to a weightless per-query "
        "key selection over a cross-layer pool that the paged attention lacks, so longer requests are refused "
        "(codegen/README.md, Not expressible yet)"),
}

NOT_EXPRESSIBLE: dict[str, str] = {
    "Gemma3nForCausalLM": (
        "AltUp: the residual is altup_num_inputs streams with per-token learned mixing (predict / correct around each "
        "layer, projections in and out at the ends), which the one-stream dataflow cannot carry; LAuReL: a low-rank "
        "branch of the attention's normed input added to the stream, the sum scaled by 1/sqrt(2); the per-layer input "
        "added to the non-active streams only; activation sparsity: a per-layer Gaussian top-k of the MLP gate "
        "(codegen/README.md, Not expressible yet)"),
    "DeepseekV4ForCausalLM": (
        "its attention: shared-KV multi-query attention (one kv_proj head read as key and value after rotary), a "
        "weightless RMSNorm per q head, rotary on the trailing rope dims with the conjugate rotation of the attention "
        "output, a grouped low-rank output projection (o_a_proj over o_groups, o_b_proj); the compressed / heavily "
        "compressed attention layers (pooled KV entries of their own cache, an indexer over them) and the hash-routed "
        "MoE layers (tid2eid[input_ids]) that every released config has (codegen/README.md, Not expressible yet)"),
    "CpmAntForCausalLM": (
        "a prefix-LM: the whole prefill (the prompt and prompt_length virtual prompt tokens, ids vocab_size + "
        "2 * prompt_length onwards, prepended to every sequence) is attended bidirectionally and the decode steps "
        "causally, so the output depends on where the prefill ended (transformers' cached and uncached greedy tokens "
        "differ); a learned per-head score bias read at a bidirectional T5 log bucket of key - query, or at a "
        "segment-pair bucket between segments; segments (and a segment embedding) from the token ids; token id 0 as "
        "left padding (the first z text positions masked, z recounted each step). The paged attention has no "
        "prefix-LM mask, per-(query, key) bias table or data-dependent key mask, and the engine no per-model token "
        "prefix (codegen/README.md, Not expressible yet)"),
    "ZayaForCausalLM": (
        "compressed convolutional attention: q / k through a causal depthwise + grouped conv over time with a conv "
        "state, half of each value head from the previous token's delayed projection (a recurrent state inside an "
        "attention block); an L2 q / k norm with a per-KV-head key scale; a router MLP over a down-projected state "
        "carried from the previous layer's router (a value handed across layers) with a skip expert and balancing "
        "biases; affine residual joins (x + b) * s on both inputs (codegen/README.md, Not expressible yet)"),
    "InklingForCausalLM": _INKLING,
    "Inkling2ForCausalLM": _INKLING2,
    "Inkling2LoopForCausalLM": (
        _INKLING2 + "; besides, layers loop_layer_index_start .. loop_layer_index_end - 1 run loop_num_passes times "
        "with the same weights and a KV cache and conv states per pass (a layer visited several times per step), each "
        "later pass restarting from the pre-loop states and mixing in messages of the previous pass (an attention "
        "over its block states with 4 learned queries per loop layer, joined by low-rank tanh forget / message gates "
        "per q / k / v / MLP input)"),
    "Gemma4AssistantForCausalLM": _DRAFTER,
    "Gemma4UnifiedAssistantForCausalLM": _DRAFTER,
    "DoryForCausalLM": (
        "its loops are expressible (layers.stored_as + decoder.schedule), its nGPT layers are not: the L2 norm "
        "x * rsqrt(sum(x^2) + eps) (a sum, not a mean) on every norm (the four layer norms, q / k per head, the "
        "attention and MLP sub-norms over all heads / the intermediate, the final and loop norms); a residual that "
        "interpolates, x <- N(x) + |lambda * s| * (P(B(N(x))) - N(x)), at learned per-channel rates; learned "
        "per-channel scales squared on q after rotary (sqk) and inside the output gate's sigmoid (s_gate), learned "
        "scales on the MLP's gate / up outputs (suv_gate, suv_up); a learned per-vocab logit scale; the released "
        "config form (layer_types interleaving 'mlp' entries, doubled layer counts) (codegen/README.md, Not "
        "expressible yet)"),
}

# Toggles no generic rule can decide: {architecture: [toggle, ...]}, a toggle {dotted field: value, ...} (a refusal
# must name its first field). Forms that released checkpoints use besides transformers' default.
FEATURE_OVERRIDES: dict[str, list[dict[str, Any]]] = {
    # StableLM 2 12B: parallel attention / MLP (the 1.6B and 3B: sequential, the default)
    "StableLmForCausalLM": [{"use_parallel_residual": True}],
    # GPT-NeoX checkpoints with sequential residuals (Pythia and NeoX-20B: parallel, the default)
    "GPTNeoXForCausalLM": [{"use_parallel_residual": False}],
    # Falcon-40B / 180B: the new decoder architecture with grouped kv heads; Falcon-RW style: no multi-query;
    # Falcon-RW (falcon-rw-1b / 7b): ALiBi, sequential blocks, biases, as many KV heads as heads (its q/k/v per head)
    "FalconForCausalLM": [{"new_decoder_architecture": True, "num_kv_heads": 2}, {"multi_query": False},
                          {"alibi": True, "parallel_attn": False, "new_decoder_architecture": False,
                           "multi_query": False, "bias": True, "num_kv_heads": 4}],
    # GPT-2: the per-layer attention scale (Mistral-era GPT-2 variants), unscaled attention, the untied head
    "GPT2LMHeadModel": [{"scale_attn_by_inverse_layer_idx": True}, {"scale_attn_weights": False},
                        {"tie_word_embeddings": False}],
    # MPT-7B-storywriter / MPT-30B: q/k/v clipping and an explicit softmax scale, inside attn_config
    "MptForCausalLM": [{"attn_config.clip_qkv": 0.5}, {"attn_config.softmax_scale": 0.5}],
    # SantaCoder / StarCoder are multi-query (the default); the multi-head form stores c_attn per head
    "GPTBigCodeForCausalLM": [{"multi_query": False}],
    # GraniteMoeShared without its shared MLP (transformers' default; the tiny checkpoint has one)
    "GraniteMoeSharedForCausalLM": [{"shared_intermediate_size": 0}],
    # DBRX's GQA is attn_config.kv_n_heads (the top-level num_key_value_heads is derived from it): multi-query
    "DbrxForCausalLM": [{"attn_config.kv_n_heads": 1}, {"attn_config.clip_qkv": 0.25}],
    # opt-350m's post-LN layers and embedding projections (refused by name)
    "OPTForCausalLM": [{"do_layer_norm_before": False}, {"word_embed_proj_dim": 32}],
    # Cohere 2 MoE (tiny default: sigmoid scores, where norm_topk_prob matters): transformers' default softmax over
    # the top-k logits, a shared expert averaged with the routed ones (the default strategy); the RMSNorm form
    # (refused by name)
    "Cohere2MoeForCausalLM": [{"expert_selection_fn": "softmax"}, {"num_shared_experts": 1}, {"rms_norm_eps": 1e-5}],
    # RecurrentGemma: its final logit soft-cap small (the field is `logits_soft_cap`, which the generic softcap rule
    # does not match), and another layer pattern (attention first: attention, recurrent, attention, recurrent)
    "RecurrentGemmaForCausalLM": [{"logits_soft_cap": 2.0}, {"block_types": ["attention", "recurrent"]}],
    # Falcon-H1: the muP multipliers given as lists (per in_proj segment z, x, B, C, dt; the MLP's gate and down), the
    # mixer's gated RMSNorm (mamba_rms_norm; released checkpoints: off, transformers' default; normalized before the
    # gate, the default mamba_norm_before_gate)
    "FalconH1ForCausalLM": [{"ssm_multipliers": [0.5, 1.5, 0.75, 1.25, 0.6]}, {"mlp_multipliers": [0.6, 1.4]},
                            {"mamba_rms_norm": True}],
    # AFMoE with muP's embedding scale (sqrt(hidden_size))
    "AfmoeForCausalLM": [{"mup_enabled": True}],
    # Laguna: a routed scale; a per-element gate (refused by name; router logit soft-capping: the generic softcap rule)
    "LagunaForCausalLM": [{"moe_routed_scaling_factor": 2.5}, {"gating": "per-element"}],
    # GPT-1: `afn` names transformers' own activation table ("swish" is silu, "gelu" the tanh approximation)
    "OpenAIGPTLMHeadModel": [{"afn": "swish"}],
    # Apertus 1.5: the LM head pruned to the text ids (released checkpoints, untied: a pruned tied head is refused)
    # Cohere Compass (rope mappings per layer type, which the generic rope rule does not see in the empty default):
    # linear scaling on the sliding layers' rotary, a logit scale
    "CohereCompassForCausalLM": [{"rope_parameters.sliding_attention": {"rope_type": "linear", "factor": 4.0}},
                                 {"logit_scale": 0.25}],
    # Bailing hybrid (transformers >= 5.25): per-layer SwiGLU limits of the routed and of the shared experts (0: none)
    "BailingHybridForCausalLM": [{"expert_swiglu_limit_list": [0, 0.02, 0, 0.02]},
                                 {"share_expert_swiglu_limit_list": [0, 0, 0.02, 0.02]}],
    # MiniMax-M3 text: a SwiGLU clamp that bites at the tiny scale
    "MiniMaxM3VLForCausalLM": [{"swiglu_limit": 0.5}],
    "Apertus1p5TextForCausalLM": [{"output_vocab_size": 256, "tie_word_embeddings": False}],
    # Gemma 4: the full layers' values from their keys (26B / 31B: attention_k_eq_v, one KV head there); KV sharing
    "Gemma4ForCausalLM": [{"attention_k_eq_v": True,
                           "per_layer_config": {"0": {"head_dim": 32, "num_key_value_heads": 1},
                                                "2": {"head_dim": 32, "num_key_value_heads": 1}}},
                          # E2B / E4B: the last layer reads layer 0's KV cache, with a double-wide MLP
                          {"num_kv_shared_layers": 1, "use_double_wide_mlp": True},
                          # 26B-A4B: the MoE block beside the dense MLP
                          {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                           "moe_intermediate_size": 24}],
    # Gemma 4 unified (12B): the full layers' values from their keys, one KV head there
    "Gemma4UnifiedForCausalLM": [{"attention_k_eq_v": True,
                                  "per_layer_config": {"0": {"head_dim": 32, "num_key_value_heads": 1},
                                                       "2": {"head_dim": 32, "num_key_value_heads": 1}}}],
    # MiMo-V2-Flash: a routed scale, another value scale, the released config's sliding_window_size (W previous
    # tokens + the query)
    "MiMoV2FlashForCausalLM": [{"routed_scaling_factor": 2.5}, {"attention_value_scale": 0.3},
                               {"sliding_window_size": 3}],
    # Kimi Linear: MLA with a low-rank q (the released model: q_proj), routing weights not renormalized (config.json
    # moe_renormalize), a shorter KDA short-conv kernel
    "KimiLinearForCausalLM": [{"q_lora_rank": 24}, {"moe_renormalize": False},
                              {"linear_attn_config": {"full_attn_layers": [2], "kda_layers": [1, 3], "num_heads": 4,
                                                      "head_dim": 8, "short_conv_kernel_size": 3}}],
    # Doge: a keep window shorter than the prompts (the dynamic mask's top-k of keys per query bites); the
    # cross-domain MoE (refused by name: its router mixes tokens within a prefill)
    "DogeForCausalLM": [{"keep_window_size": 5}, {"is_moe": True}],
    # Zamba2: rotary in the shared attention (the tiny default has the q/k/v adapters on, see tiny_hf.ARCH_DEFAULTS)
    "Zamba2ForCausalLM": [{"use_mem_rope": True}],
}

# The rope type a feature-ON config uses: the first of these that the spec admits (ROPE_ARMS' parameters).
ROPE_PREFERENCE = ("llama3", "yarn", "linear")

TINY_HEAD_DIM = 16


# ------------------------------------------------------------------------------------------ enumeration
@dataclasses.dataclass(frozen=True)
class Family:
    architecture: str                 # the transformers class (config.json `architectures`)
    model_types: tuple[str, ...]      # the model types transformers maps to it
    excluded: str | None = None       # why it is not a decoder-only text family (None: it is one)


def _multimodal(model_type: str) -> bool:
    from transformers.models.auto import modeling_auto as ma
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type in ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES or \
            model_type in ma.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES:
        return True
    import transformers
    try:
        default = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])().to_dict()
    except Exception:             # a config class without usable defaults: judged by its model class only
        return False
    return any(isinstance(v, dict) and "model_type" in v and any(w in k for w in ("vision", "audio", "encoder",
                                                                                  "vq_", "patcher"))
               for k, v in default.items())


@functools.lru_cache(maxsize=1)
def all_causal_lm_classes() -> tuple[Family, ...]:
    """Every class of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, with `excluded` set for those that are not
    decoder-only text families (sorted by class name)."""
    from transformers.models.auto import modeling_auto as ma

    seq2seq = set(ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES) | set(ma.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES)
    masked = set(ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    by_class: dict[str, list[str]] = {}
    for model_type, cls in ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        by_class.setdefault(cls, []).append(model_type)
    out = []
    for cls, types in sorted(by_class.items(), key=lambda kv: kv[0].lower()):
        why = None
        if not (cls.endswith("ForCausalLM") or cls.endswith("LMHeadModel")):
            why = "not a causal-LM head class"
        elif all(t in seq2seq for t in types):
            why = "the decoder of an encoder-decoder model"
        elif all(t in masked or t in seq2seq for t in types):
            why = "an encoder (masked LM) run as a decoder"
        elif all(_multimodal(t) for t in types):
            why = "multimodal (vision / audio inputs)"
        elif cls in NOT_DECODER_ONLY:
            why = NOT_DECODER_ONLY[cls]
        out.append(Family(cls, tuple(sorted(types)), why))
    return tuple(out)


def decoder_families() -> tuple[Family, ...]:
    """The decoder-only text families of the installed transformers (see the module doc)."""
    return tuple(f for f in all_causal_lm_classes() if f.excluded is None)


# ------------------------------------------------------------------------------------------------ specs
@dataclasses.dataclass(frozen=True)
class SpecInfo:
    path: Path
    name: str
    architectures: tuple[str, ...]

    @property
    def rel(self) -> str:
        return str(self.path.relative_to(ROOT))


@functools.lru_cache(maxsize=1)
def specs() -> tuple[SpecInfo, ...]:
    """Every spec in specs/ (globbed), with its name and architectures."""
    out = []
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        try:
            doc = read_yaml(path) or {}
        except Exception:
            continue            # a broken spec fails the spec battery
        archs = tuple(a for a in (doc.get("architectures") or ()) if isinstance(a, str))
        out.append(SpecInfo(path, str(doc.get("name") or path.stem), archs))
    return tuple(out)


def spec_for(architecture: str) -> SpecInfo | None:
    for s in specs():
        if architecture in s.architectures:
            return s
    return None


@functools.lru_cache(maxsize=None)
def _rope_symbols(spec: SpecInfo):
    from test_spec_battery import _read_spec
    return _read_spec(spec.path).rope


# -------------------------------------------------------------------------------------- feature toggles
@dataclasses.dataclass(frozen=True)
class Toggle:
    name: str                       # what it turns on, for reports: "attention_bias=True"
    overrides: dict                 # tiny_config overrides (dotted keys)
    field: str                      # the config.json field that a refusal must name


def _text_prefix(default: dict) -> str:
    return "text_config." if isinstance(default.get("text_config"), dict) else ""


def feature_toggles(architecture: str, spec: SpecInfo | None = None) -> list[Toggle]:
    """The feature-ON toggles of an architecture (module doc), in a stable order."""
    from fixtures.tiny_hf import model_class, tiny_config

    full = model_class(architecture).config_class().to_dict()
    prefix = _text_prefix(full)
    default = full["text_config"] if prefix else full
    tiny = tiny_config(architecture).to_dict()              # the spec battery's config (ARCH_DEFAULTS applied)
    base = tiny["text_config"] if prefix else tiny
    toggles: list[Toggle] = []

    def add(field: str, value: Any, *extra: tuple[str, Any]) -> None:
        if isinstance(default.get(field), int) and not isinstance(default.get(field), bool):
            value = int(value)                     # the config class checks types strictly
        ov = {prefix + field: value, **{prefix + k: v for k, v in extra}}
        shown = ", ".join(f"{k.removeprefix(prefix)}={v!r}" for k, v in ov.items())
        toggles.append(Toggle(shown, ov, field.split(".")[-1]))

    def away(key: str, preferred: float) -> float:
        """`preferred`, or half the tiny config's value where that already is `preferred`."""
        cur = base.get(key)
        return preferred if cur != preferred else float(cur) * 0.5

    for key, value in default.items():
        low = key.lower()
        value = base.get(key, value)
        if isinstance(value, bool):
            if low.endswith("bias") and value is False:
                add(key, True)
            elif ("qk_norm" in low or "qk_layernorm" in low) and value is False:
                add(key, True)
            elif key == "norm_topk_prob":
                add(key, not value)
        elif "softcap" in low and (value is None or isinstance(value, (int, float))):
            add(key, away(key, 5.0 if "attn" in low or "attention" in low else 2.0))
        elif "multiplier" in low and isinstance(value, (int, float)):
            add(key, away(key, 3.0 if "embedding" in low else 0.5))
        elif key in ("logits_scaling", "logit_scale") and isinstance(value, (int, float)):
            add(key, float(value) * 2.0)
        elif key == "query_pre_attn_scalar":
            add(key, away(key, 2.0 * TINY_HEAD_DIM))
        elif key == "clip_qkv" and value is None:
            add(key, 1.0)
        elif key in ("partial_rotary_factor", "rotary_pct") and value == 1.0:
            add(key, 0.5)
    rope = default.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("partial_rotary_factor") == 1.0:
        add("rope_parameters", {"partial_rotary_factor": 0.5})
        toggles[-1] = dataclasses.replace(toggles[-1], name="rope_parameters.partial_rotary_factor=0.5",
                                          field="partial_rotary_factor")
    if "sliding_window" in default and not (base.get("sliding_window") is not None
                                            and base.get("use_sliding_window", True) is not False):
        extra = []
        if "use_sliding_window" in default:
            extra.append(("use_sliding_window", True))
        if "max_window_layers" in default:
            extra.append(("max_window_layers", 1))
        add("sliding_window", 6, *extra)
    if isinstance(base.get("num_key_value_heads"), int) and base["num_key_value_heads"] > 1:
        add("num_key_value_heads", 1)                      # multi-query attention (KV heads replicated at TP 2)
    if isinstance(tiny.get("tie_word_embeddings"), bool):
        flip = not tiny["tie_word_embeddings"]
        toggles.append(Toggle(f"tie_word_embeddings={flip}", {"tie_word_embeddings": flip}, "tie_word_embeddings"))
    if spec is not None:
        from test_spec_battery import ROPE_ARMS
        for sym in _rope_symbols(spec):
            kind = next((k for k in ROPE_PREFERENCE if k in sym.values), None)
            if kind is None:
                continue
            node: Any = full
            for part in sym.location.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            theta = (node or {}).get("rope_theta") if isinstance(node, dict) else None
            if theta is None:
                continue
            ov = {sym.location: {"rope_type": kind, "rope_theta": theta, **ROPE_ARMS[kind]}}
            toggles.append(Toggle(f"{sym.location}.rope_type={kind}", ov, "rope_type"))
            break
    for ov in FEATURE_OVERRIDES.get(architecture, []):
        shown = ", ".join(f"{k}={v!r}" for k, v in ov.items())
        toggles.append(Toggle(shown, dict(ov), next(iter(ov)).split(".")[-1]))
    return toggles


# ------------------------------------------------------------------------------------------------ guard
def config_json(architecture: str, overrides: dict | None = None) -> dict:
    """The config.json the tiny checkpoint of these overrides gets (save_pretrained writes the diff against
    the class defaults), without building weights."""
    from fixtures.tiny_hf import tiny_config
    return json.loads(tiny_config(architecture, overrides).to_json_string(use_diff=True))


@functools.lru_cache(maxsize=None)
def generated_model(spec: SpecInfo):
    """The generated model module of a spec (the package the runtime's registry serves the spec's
    architectures with)."""
    import importlib

    from xllm_gen.runtime.loading import registry
    package = registry.generated_packages().get(spec.architectures[0])
    if package is None:
        raise LookupError(f"{spec.rel}: no generated package serves {spec.architectures[0]}: run xllm-gen {spec.rel}")
    return importlib.import_module(f"{package}.model")


class FixtureError(Exception):
    """transformers' own config class rejects the toggle (not a verdict on the spec)."""


def guard_refusal(spec: SpecInfo, architecture: str, overrides: dict) -> str | None:
    """None when the spec's config guard accepts the tiny config.json of `overrides`, else its message."""
    try:
        cfg = config_json(architecture, overrides)
    except Exception as e:
        raise FixtureError(f"transformers rejects {overrides}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    try:
        generated_model(spec).Config.from_hf(cfg)
    except ValueError as e:
        return str(e)
    return None


@dataclasses.dataclass(frozen=True)
class Plan:
    family: Family
    spec: SpecInfo | None
    accepted: tuple[Toggle, ...] = ()
    refused: tuple[tuple[Toggle, str], ...] = ()    # (toggle, the guard's message)
    base_refused: str | None = None                 # the guard refuses even the default tiny config
    error: str | None = None                        # the check could not be set up (e.g. generated/ missing)

    @property
    def overrides(self) -> dict:
        out: dict = {}
        for t in self.accepted:
            for k, v in t.overrides.items():
                out[k] = {**out[k], **v} if isinstance(out.get(k), dict) and isinstance(v, dict) else v
        return out

    @property
    def status(self) -> str:
        if self.spec is None:
            return "not expressible" if self.family.architecture in NOT_EXPRESSIBLE else "not yet"
        if self.error:
            return "error"
        return "refused" if self.base_refused else "served"


def plan(family: Family) -> Plan:
    spec = spec_for(family.architecture)
    if spec is None:
        return Plan(family, None)
    try:
        base = guard_refusal(spec, family.architecture, {})
    except (LookupError, ImportError, FixtureError) as e:
        return Plan(family, spec, error=f"{type(e).__name__}: {e}")
    if base:
        return Plan(family, spec, base_refused=base)
    accepted, refused = [], []
    for t in feature_toggles(family.architecture, spec):
        try:
            msg = guard_refusal(spec, family.architecture, t.overrides)
        except FixtureError:
            continue                 # the toggle is not a valid config of this family
        if msg is None:
            accepted.append(t)
        else:
            refused.append((t, msg))
    return Plan(family, spec, tuple(accepted), tuple(refused))


@functools.lru_cache(maxsize=None)
def served_plans() -> tuple[Plan, ...]:
    """The plan of every served family (cached: the conformance battery and the spec battery's sampling read it)."""
    return tuple(plan(f) for f in decoder_families() if spec_for(f.architecture) is not None)


def other_served(families=None) -> list[tuple[str, SpecInfo]]:
    """(architecture, spec) for spec architectures that are not in the decoder-only enumeration (vision-language
    classes, classes this transformers does not ship)."""
    known = {f.architecture for f in (families or decoder_families())}
    return [(a, s) for s in specs() for a in s.architectures if a not in known]
