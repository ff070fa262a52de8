"""Model building blocks used by generated code: `from xllm_gen.runtime import layers as L`.

Constructor sizes are global (unsharded); layers derive per-rank shapes from get_tp_size()/get_tp_rank().
Parameters are created with torch.empty and filled by the loader.
"""
from xllm_gen.runtime.layers.activation import (
                                            ACTIVATIONS,
                                            GATED_ACTIVATIONS,
                                            GELU,
                                            GeluAndMul,
                                            SiluAndMul,
                                            act,
                                            gated_act,
)
from xllm_gen.runtime.layers.attention import (
                                            Attention,
                                            DifferentialAttention,
                                            QueryScale,
                                            alibi_slopes,
                                            attention_sinks,
                                            gate_output,
                                            head_bias,
                                            share_kv,
)
from xllm_gen.runtime.layers.deepstack import inject_deepstack
from xllm_gen.runtime.layers.embedding import (
                                            LearnedPositionEmbedding,
                                            ParallelLMHead,
                                            SinusoidalPositionEmbedding,
                                            VocabParallelEmbedding,
)
from xllm_gen.runtime.layers.fused import act_linear, norm_linear, qk_norm_rope_store
from xllm_gen.runtime.layers.head_transform import HeadTransform
from xllm_gen.runtime.layers.hyper_connection import HyperConnection, expand_streams
from xllm_gen.runtime.layers.indexer import SparseIndexer, shared_selection
from xllm_gen.runtime.layers.key_bias import ValueKeyBias
from xllm_gen.runtime.layers.layer_kernel import decoder_layer_kernel
from xllm_gen.runtime.layers.lightning import LightningAttention
from xllm_gen.runtime.layers.linear import (
                                            ColumnParallelLinear,
                                            MergedColumnParallelLinear,
                                            QKVParallelLinear,
                                            ReplicatedLinear,
                                            RowParallelLinear,
                                            segment_scale,
)
from xllm_gen.runtime.layers.mla import latent_attention
from xllm_gen.runtime.layers.moe import FusedMoE, linear_float32, routing_bias
from xllm_gen.runtime.layers.norm import (
                                            HeadNorm,
                                            IdentityNorm,
                                            LayerNorm,
                                            LowRankGatedNorm,
                                            ProjectionNorm,
                                            RMSNorm,
                                            keep_residual_float32,
)
from xllm_gen.runtime.layers.nvfp4_round import nvfp4_round
from xllm_gen.runtime.layers.per_layer import learned_scalar, per_layer_inputs, rank_columns
from xllm_gen.runtime.layers.recurrent import (
                                            MLSTM,
                                            RGLRU,
                                            WKV,
                                            CausalConv1d,
                                            GatedDeltaNet,
                                            GatedRMSNorm,
                                            Mamba,
                                            Mamba2,
                                            RecurrentMixer,
                                            ShortConv,
                                            TokenShiftMLP,
)
from xllm_gen.runtime.layers.residual_gate import ResidualGate
from xllm_gen.runtime.layers.rope_scaling import rope_parameters, yarn_mscale
from xllm_gen.runtime.layers.rotary import (
                                            ROTARY_KINDS,
                                            Rotary,
                                            mrope_axis_map,
                                            qk_norm_rope,
)
from xllm_gen.runtime.layers.routed import RoutedLinear, output_bias, topk_softmax
from xllm_gen.runtime.layers.router import RouterInput, expert_scale
from xllm_gen.runtime.layers.shared import (
                                            LoRA,
                                            SegmentLoRA,
                                            check_schedule,
                                            learned_vector,
                                            relocate_layers,
                                            share_blocks,
                                            share_layers,
)
from xllm_gen.runtime.rope_kinds import ROPE_KINDS

__all__ = [
    "check_schedule",
    "learned_vector",
    "relocate_layers",
    "share_layers",
    "HyperConnection",
    "expand_streams",
    "ResidualGate",
    "learned_scalar", "per_layer_inputs", "rank_columns", "share_kv",
    "RMSNorm", "LayerNorm", "LowRankGatedNorm", "IdentityNorm", "ProjectionNorm", "HeadNorm", "VocabParallelEmbedding", "ParallelLMHead", "QKVParallelLinear",
    "MergedColumnParallelLinear", "ColumnParallelLinear", "RowParallelLinear", "ReplicatedLinear",
    "SiluAndMul", "GeluAndMul", "gated_act", "GATED_ACTIVATIONS", "act", "ACTIVATIONS", "GELU", "Rotary", "ROTARY_KINDS", "ROPE_KINDS",
    "rope_parameters", "mrope_axis_map", "qk_norm_rope", "Attention", "inject_deepstack", "FusedMoE",
    "attention_sinks", "head_bias", "gate_output", "routing_bias", "yarn_mscale", "latent_attention", "SparseIndexer",
    "shared_selection",
    "linear_float32", "ValueKeyBias", "nvfp4_round", "alibi_slopes", "LearnedPositionEmbedding", "SinusoidalPositionEmbedding",
    "norm_linear", "act_linear", "qk_norm_rope_store", "decoder_layer_kernel", "QueryScale", "DifferentialAttention",
    "RecurrentMixer", "GatedDeltaNet", "GatedRMSNorm", "CausalConv1d", "Mamba", "Mamba2", "ShortConv", "RGLRU",
    "LightningAttention", "WKV", "TokenShiftMLP", "MLSTM",
    "keep_residual_float32", "LoRA", "SegmentLoRA", "share_blocks", "segment_scale", "HeadTransform", "RoutedLinear", "topk_softmax", "output_bias",
    "RouterInput", "expert_scale",
]
