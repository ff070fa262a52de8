"""Recurrent-state token mixers: layers that keep a per-sequence state instead of (or beside) a KV cache.

A `RecurrentMixer` declares its state tensors (`state_shapes()`: name -> (per-sequence shape, dtype), this rank's
shapes). The runner allocates each as `[num_slots, *shape]` (a state pool beside the paged KV cache, one slot per
running sequence, runtime/executor/model_runner.py) and attaches them as `self.states[name]`; the block manager hands
a sequence its slot at admission and takes it back when it finishes, is aborted or preempted. A step's forward
context says, per sequence, which slot it owns (`ctx.state_slots`) and whether the slot continues a state
(`ctx.state_continue_cpu`: False at a sequence's first prefill chunk, whose state starts at zero; so a sequence
preempted and recomputed from its tokens starts over). The mixer reads its rows of the pool, computes, and writes them
back: a prefill step per sequence (`step_sequences`, host values), a decode step batched from the slot tensor alone
(`decode_slots`, `gather_states` / `scatter_states`: index_select / index_copy_, no host value, no data-dependent
shape), which the decode CUDA graphs capture with the slots as a static input (padding rows on the pool's scratch
slot, runtime/executor/cuda_graph.py).

Math (torch reference, float32 state; the GPU runs the same torch code):
- `causal_conv1d`: a depthwise causal conv1d over time, its state the last kernel - 1 inputs of each channel;
- `gated_delta_rule`: the gated delta rule (Gated DeltaNet): per value head, S <- exp(g) S, then
  S <- S + k (beta (v - S^T k))^T, output S^T q (q and k L2-normalized, q scaled by dk ** -0.5); a prompt chunk runs
  the chunked (UT-transform) form of transformers' torch_chunk_gated_delta_rule, a decode step the recurrent form of
  torch_recurrent_gated_delta_rule, both from the slot's state;
  the decay g is a scalar per value head ([T, Hv], Gated DeltaNet) or a vector per value head over the key channels
  ([T, Hv, Dk], Kimi Delta Attention's fine-grained decay: S <- diag(exp(g)) S), one core for both;
- `GatedRMSNorm`: RMSNorm of the mixer output per value head, times silu(z) (or sigmoid(z)).
- `RGLRU`: the real-gated linear recurrent unit (Griffin's RG-LRU): h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t),
  a reset (a_t := 0, no normalisation) at position 0; a prompt chunk runs the recurrence in chunks of 64 tokens
  (`rg_lru_scan_chunked`, log-space decays within a chunk), a decode step as one batched update.
- `MLSTM`: the matrix-memory LSTM cell per head (exponential input gate, sigmoid forget gate, a running-maximum
  stabilizer; state C [Dk, Dv], n [Dk], m float32), a prompt chunk token by token (`mlstm_scan`), a decode step batched
  (`mlstm_step`), then a per-head LayerNorm;
- `WKV` / `TokenShiftMLP`: the token-shift mixers (each token mixes its input with its predecessor's, a `shift`
  state); `WKV`'s receptance-weighted key-value recurrence keeps float32 (num, den, running max) per channel
  (`wkv_scan` a prompt chunk token by token, `wkv_step` a batched decode step).

Modules (one per idea; every name is importable from this package, as it was from the one module):
- state.py: the shared state helpers (`RecurrentMixer`, `decode_slots`, `gather_states` / `scatter_states`,
  `slot_state`, `step_sequences`);
- conv.py: the causal conv1d of every mixer (`CausalConv1d`, `causal_conv1d`, `causal_conv1d_step`);
- gated_delta.py (`GatedDeltaNet`, `GatedRMSNorm`), mamba2.py (`Mamba2`), mamba.py (`Mamba`, `HeadwiseLinear`), short_conv.py
  (`ShortConv`), rg_lru.py (`RGLRU`), wkv.py (`WKV`, `TokenShiftMLP`), mlstm.py (`MLSTM`): one mixer each, with its kernels.
The mixers call the state helpers and kernels through this package (`R.gather_states(...)`), so a test that patches
`recurrent.<name>` reaches every mixer.
"""
from xllm_gen.runtime.layers.recurrent.conv import CausalConv1d, causal_conv1d, causal_conv1d_step  # noqa: F401
from xllm_gen.runtime.layers.recurrent.gated_delta import (  # noqa: F401
    GatedDeltaNet,
    GatedRMSNorm,
    _delta_rule_chunked_per_channel,
    _l2norm,
    gated_delta_rule_chunked,
    gated_delta_rule_step,
)
from xllm_gen.runtime.layers.recurrent.mamba import HeadwiseLinear, Mamba, selective_scan, selective_state_step  # noqa: F401
from xllm_gen.runtime.layers.recurrent.mamba2 import (  # noqa: F401
    GroupedGatedRMSNorm,
    Mamba2,
    _segment_sum,
    ssd_chunk_scan,
    ssd_step,
)
from xllm_gen.runtime.layers.recurrent.mlstm import MLSTM, MultiHeadLayerNorm, mlstm_scan, mlstm_step  # noqa: F401
from xllm_gen.runtime.layers.recurrent.rg_lru import RGLRU, RGLRUGates, rg_lru_scan, rg_lru_scan_chunked  # noqa: F401
from xllm_gen.runtime.layers.recurrent.short_conv import ShortConv  # noqa: F401
from xllm_gen.runtime.layers.recurrent.state import (  # noqa: F401
    RecurrentMixer,
    _fields_named,
    decode_slots,
    gather_states,
    scatter_states,
    slot_state,
    step_sequences,
)
from xllm_gen.runtime.layers.recurrent.wkv import (  # noqa: F401
    WKV,
    TokenShiftMixer,
    TokenShiftMLP,
    fresh_wkv_state,
    wkv_scan,
    wkv_step,
)
