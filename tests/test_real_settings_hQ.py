"""(hQ) Released settings of Zamba, RWKV-4, xLSTM, BitNet, LFM2-MoE, GPT-NeoX-Japanese, GPT-1, CTRL, the ModernBERT
decoder (Ettin) and NanoChat: each release's config.json (tests/data/real_configs, provenance in its MANIFEST), every
non-size field as published, only the sizes shrunk; the tiny checkpoint from transformers' own class
(test_real_settings._build); `verify` must find the same greedy tokens and per-layer states as transformers.
"""
from __future__ import annotations

import pytest
from test_real_settings import ROOT, _build, _real


def _sized(stem: str, drop: tuple[str, ...] = (), **sizes) -> dict:
    c = _real(stem)
    for k in drop:
        c.pop(k)
    c.update(sizes)
    return c


def _zamba_7b() -> dict:
    # 8 layers: the release's pattern (mamba, mamba, hybrid, then a hybrid every 6 at offset 4) cut to them keeps
    # two hybrid layers (2 and 7) sharing the tied transformer block
    c = _real("zamba__Zamba-7B-v1")
    c.update(hidden_size=64, attention_hidden_size=128, attention_head_dim=32, num_attention_heads=4,
             num_key_value_heads=4, intermediate_size=160, num_hidden_layers=8, mamba_dt_rank=4, mamba_d_state=8,
             vocab_size=512, layers_block_type=c["layers_block_type"][:8])
    return c


def _lfm2_8b_a1b() -> dict:
    # 8 layers: the release's first 8 layer types (attention at 2 and 6), its 2 dense layers, 32 experts top-4 -> 8
    # top-4
    c = _real("lfm2_moe__LFM2-8B-A1B")
    c.update(hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=8, num_experts=8, vocab_size=512,
             layer_types=c["layer_types"][:8])
    return c


# the release's kernels (chunkwise--triton_xl_chunk, native_sequence__triton, triton) are the `xlstm` package's:
# without it transformers' config refuses them (its Literal types), so the tiny checkpoint names the native ones
# (the same sums; the engine ignores the kernel choice)
_XLSTM = dict(hidden_size=128, embedding_dim=128, num_blocks=3, num_heads=4, vocab_size=512,
              chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native",
              step_kernel="native")
_RWKV = dict(hidden_size=64, attention_hidden_size=64, intermediate_size=256, num_hidden_layers=8, vocab_size=512)

CASES = {
    "zamba-7b-v1": ("ZambaForCausalLM", "zamba", _zamba_7b, (3, 9, 17, 30)),
    # 8 layers: the release's rescale_every 6 halves the stream after layer 5
    "rwkv-4-169m-pile": ("RwkvForCausalLM", "rwkv", lambda: _sized("rwkv__rwkv-4-169m-pile", **_RWKV),
                         (3, 9, 17, 30)),
    "rwkv-raven-1b5": ("RwkvForCausalLM", "rwkv", lambda: _sized("rwkv__rwkv-raven-1b5", **_RWKV), (3, 9, 17, 30)),
    "xlstm-7b": ("xLSTMForCausalLM", "xlstm", lambda: _sized("xlstm__xLSTM-7b", **_XLSTM), (3, 9, 17, 30)),
    # the master weights (bitnet-b1.58-2B-4T-bf16: the release without its quantization_config)
    "bitnet-b1.58-2b-4t-bf16": ("BitNetForCausalLM", "bitnet",
                                lambda: _sized("bitnet__bitnet-b1.58-2B-4T", drop=("quantization_config",),
                                               hidden_size=80, intermediate_size=160, num_attention_heads=4,
                                               num_key_value_heads=1, num_hidden_layers=3, vocab_size=512),
                                (3, 9, 17, 30)),
    "lfm2-8b-a1b": ("Lfm2MoeForCausalLM", "lfm2_moe", _lfm2_8b_a1b, (3, 9, 17, 30)),
    "gpt-neox-japanese-2.7b": ("GPTNeoXJapaneseForCausalLM", "gpt_neox_japanese",
                               lambda: _sized("gpt_neox_japanese__gpt-neox-japanese-2.7b", hidden_size=64,
                                              num_attention_heads=4, num_hidden_layers=3, vocab_size=512),
                               (3, 9, 17, 30)),
    # the file as recalled may lack a tie field the Hub file has (tie_word_embeddings: false): both served
    "gpt-neox-japanese-2.7b-untied": ("GPTNeoXJapaneseForCausalLM", "gpt_neox_japanese",
                                      lambda: _sized("gpt_neox_japanese__gpt-neox-japanese-2.7b", hidden_size=64,
                                                     num_attention_heads=4, num_hidden_layers=3, vocab_size=512,
                                                     tie_word_embeddings=False), (3, 9, 17, 30)),
    "openai-gpt": ("OpenAIGPTLMHeadModel", "openai_gpt",
                   lambda: _sized("openai_gpt__openai-gpt", n_embd=64, n_head=4, n_layer=3, vocab_size=512),
                   (3, 9, 17, 30)),
    "ctrl": ("CTRLLMHeadModel", "ctrl",
             lambda: _sized("ctrl__ctrl", n_embd=64, n_head=4, n_layer=3, dff=160, vocab_size=512), (3, 9, 17, 30)),
    # 4 layers (global, local, local, global); the window 128 -> 12 (local_attention // 2 = 6 crossed by the prompts)
    "ettin-decoder-150m": ("ModernBertDecoderForCausalLM", "modernbert_decoder",
                           lambda: _sized("modernbert_decoder__ettin-decoder-150m", hidden_size=64,
                                          num_attention_heads=4, num_hidden_layers=4, intermediate_size=160,
                                          local_attention=12, vocab_size=512), (3, 9, 17, 30)),
    "nanochat-d32": ("NanoChatForCausalLM", "nanochat",
                     lambda: _sized("nanochat__nanochat-d32", hidden_size=64, num_attention_heads=4,
                                    num_key_value_heads=4, num_hidden_layers=3, intermediate_size=256,
                                    vocab_size=512), (3, 9, 17, 30)),
}


# what the build alone needs: _build derives head_dim = hidden / heads where the release has none (Zamba's alias of
# attention_head_dim, 2 * hidden / heads there); ModernBERT-decoder's rope bases from the release's global / local
# fields (transformers reads them so), not _build's flat rope_parameters
_BUILD_ONLY = {
    "zamba-7b-v1": {"head_dim": 32},
    "ettin-decoder-150m": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 160000.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 160000.0}}},
}


@pytest.mark.slow      # ~10 s each: a transformers model and an engine per checkpoint
@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_real_settings_hq_verify(case, tmp_path):
    from xllm_gen.codegen.verify import verify

    arch, spec, make, prompt_lens = CASES[case]
    ckpt = _build(tmp_path / case, arch, make(), _BUILD_ONLY.get(case))
    report = verify(ROOT / "specs" / f"{spec}.yaml", ckpt, prompt_lens=prompt_lens)
    assert report.ok, report.text()
