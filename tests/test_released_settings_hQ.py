"""(hQ) Fast checks of the fixes the released-settings trials (tests/test_real_settings_hQ.py) found:

- gpt-neox-japanese-2.7b names its rotary base and fraction `rotary_emb_base` / `rotary_pct` (transformers reads
  them into rope_parameters): refused as unknown before; read now, where transformers reads them.
- openai-gpt's `n_ctx` / `n_special` / `predict_special_tokens`, Salesforce/ctrl's `attn_pdrop` / `from_tf` / `n_ctx` /
  `summary_*`, xLSTM-7b's `force_bos_token_insert`, the Ettin decoders' `layer_norm_eps` / `position_embedding_type`:
  fields transformers never reads, refused as unknown before.
- xLSTM-7b's config.json names the width `embedding_dim` only: refused before ("no field 'hidden_size'"); transformers
  takes hidden_size's default (4096) and the spec does too, refusing by name an embedding_dim other than it.
- verify compared per-layer states wrongly where transformers' block returns a list (GPT-1: a traceback) and where a
  layer scales the whole stream after itself (RWKV's rescale_every: a false mismatch of 0.5 on every rescaled layer).
- bitnet-b1.58-2B-4T as released (its ternary quantization_config) stays refused, naming the method.
"""
from __future__ import annotations

import pytest
import torch
from test_real_settings import _real


def _read(cfg: dict):
    from xllm_gen.runtime.loading import registry
    module, _ = registry.resolve(cfg)
    return module.Config.from_hf(cfg)


def test_gpt_neox_japanese_rotary_names_are_read_as_transformers_reads_them():
    from transformers import GPTNeoXJapaneseConfig

    cfg = _real("gpt_neox_japanese__gpt-neox-japanese-2.7b")
    cfg.update(rotary_emb_base=20000, rotary_pct=0.5)        # other values than the defaults, to see them read
    hf = GPTNeoXJapaneseConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    c = _read(cfg)
    assert c.rope_theta == hf.rope_parameters["rope_theta"] == 20000
    assert c.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"] == 0.5


@pytest.mark.parametrize("stem", ["openai_gpt__openai-gpt", "ctrl__ctrl", "modernbert_decoder__ettin-decoder-150m",
                                  "gpt_neox_japanese__gpt-neox-japanese-2.7b"])
def test_released_leftovers_are_accepted(stem):
    _read(_real(stem))


def test_ettin_layer_norm_eps_leftover_does_not_move_the_norms():
    cfg = _real("modernbert_decoder__ettin-decoder-150m")
    cfg["layer_norm_eps"] = 1e-3                              # transformers reads norm_eps alone
    assert _read(cfg).norm_eps == cfg["norm_eps"]


def test_xlstm_7b_embedding_dim_only_is_served_at_transformers_width():
    from transformers import xLSTMConfig

    cfg = _real("xlstm__xLSTM-7b")
    assert "hidden_size" not in cfg
    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "force_bos_token_insert",
                                                    "chunkwise_kernel", "sequence_kernel", "step_kernel")}
    hf = xLSTMConfig(**kw)
    c = _read(cfg)
    assert (c.hidden_size, c.num_hidden_layers) == (hf.hidden_size, hf.num_blocks)
    cfg["embedding_dim"] = 2048                                # an embedding narrower than the blocks: refused
    with pytest.raises(ValueError, match="embedding_dim"):
        _read(cfg)


def test_bitnet_2b_4t_quantization_config_is_refused_by_name():
    cfg = _real("bitnet__bitnet-b1.58-2B-4T")
    with pytest.raises(ValueError, match="quant_method='bitnet'"):
        _read(cfg)


class _ListBlock(torch.nn.Module):
    def forward(self, x):
        return [x * 2.0]


class _ScaledLayer(torch.nn.Module):
    stream_scale = 0.5

    def forward(self, x):
        return (x * 3.0 * self.stream_scale, None)


def test_verify_records_list_outputs_and_the_stream_before_its_scale():
    from xllm_gen.codegen.verify import _Recorder

    x = torch.ones(1, 2, 4)
    hf_block, eng_layer = _ListBlock(), _ScaledLayer()
    hf_rec, eng_rec = _Recorder([hf_block], engine=False), _Recorder([eng_layer], engine=True)
    hf_rec.arm()
    eng_rec.arm()
    hf_block(x)
    eng_layer(x)
    assert torch.equal(hf_rec.take()[0], (x * 2.0).reshape(-1, 4))
    assert torch.equal(eng_rec.take()[0], (x * 3.0).reshape(-1, 4))
