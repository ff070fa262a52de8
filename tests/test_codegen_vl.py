"""The compiler on specs/qwen3_vl.yaml: it compiles and is up to date, malformed VL specs give positioned
errors, the resolved-spec golden, and the generated model against Hugging Face's Qwen3-VL: strict weight
loading through the rendered weight plan and encode_vision == HF's visual model (float32, CPU).

Refresh the golden after an intended change:
    xllm-gen --explain specs/qwen3_vl.yaml > tests/golden/qwen3_vl.resolved.txt
(or run this file with XLLM_GEN_UPDATE_GOLDEN=1).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from xllm_gen.codegen import cli
from xllm_gen.codegen.compiler import compile_spec

REPO = Path(__file__).resolve().parent.parent
QWEN3 = REPO / "specs" / "qwen3.yaml"
VL = REPO / "specs" / "qwen3_vl.yaml"
VL_TEXT = VL.read_text()
GOLDEN = REPO / "tests" / "golden" / "qwen3_vl.resolved.txt"


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def line_of(text: str, needle: str) -> int:
    idx = text.index(needle)
    return text.count("\n", 0, idx) + 1


def mutated(tmp_path, old: str, new: str) -> tuple[Path, str]:
    base = VL_TEXT.replace("extends: qwen3.yaml", f"extends: {QWEN3}", 1)
    assert base.count(old) == 1, old
    text = base.replace(old, new, 1)
    path = tmp_path / "bad_vl.yaml"
    path.write_text(text)
    return path, text


# ---- compiles, up to date ------------------------------------------------------------------------------
def test_vl_spec_compiles():
    c = compile_spec(VL)
    assert c.ir.name == "qwen3_vl" and c.ir.model_class == "Qwen3VLForConditionalGeneration"
    assert len(c.ir.spec_files) == 2                                    # extends specs/qwen3.yaml
    assert c.ir.decoder_prefix == "model.language_model"
    assert c.ir.runner.multimodal and c.ir.runner.position_kind == "mrope"
    assert c.ir.runner.deepstack_levels_field == "deepstack_levels"
    att = c.ir.attention_blocks[0]
    assert att.rotary.kind == "mrope_interleaved" and str(att.rotary.mrope_section) == "mrope_section"
    assert str(att.rotary.theta) == "rope_theta"                        # inherited, merged
    # the decoder's weights section is Qwen3's, renamed by the prefix rule
    base = [w.param.name for w in compile_spec(QWEN3).ir.weights]
    ours = [w.param.name for w in c.ir.weights]
    assert ours == [n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n for n in base]
    v = {x.name: x for x in c.ir.variants}
    assert set(v) == {"Qwen3-VL-2B", "Qwen3-VL-8B", "Qwen3-VL-32B"}   # Qwen3's text variants deleted
    assert v["Qwen3-VL-2B"].tied and not v["Qwen3-VL-8B"].tied and not v["Qwen3-VL-32B"].tied
    assert dict(v["Qwen3-VL-8B"].values)["deepstack_levels"] == 3
    runner = c.files["runner.py"]
    # the step logic the spec implies is in the generated runner: mRoPE positions, vision merge, deepstack
    assert "multimodal = True" in runner and "position_rows = 3" in runner
    for hook in ("def positions_of(", "def decode_positions(", "def allocate_step_buffers(",
                 "def prefill_embeds(", "def vision_features(", "def after_step("):
        assert hook in runner, hook
    assert "self.deepstack_levels = self.config.deepstack_levels" in runner
    assert "ctx.deepstack = DeepstackInput(" in runner
    model = c.files["model.py"]
    assert "for level, layer in enumerate(self.layers[:self.deepstack_levels]):" in model


def test_check_clean_for_both_specs(capsys):
    code, out, err = run_cli(capsys, "--check", QWEN3, VL)
    assert code == 0, out + err
    assert "up to date: generated/qwen3/" in out and "up to date: generated/qwen3_vl/" in out


def test_explain_vl_tables(capsys):
    code, out, _ = run_cli(capsys, "--explain", VL)
    assert code == 0
    assert "variant Qwen3-VL-2B (28 layers, tied lm_head, bfloat16)" in out
    assert "variant Qwen3-VL-8B (36 layers, untied lm_head, bfloat16)" in out
    code, out, _ = run_cli(capsys, "--explain", "--tp", "8", VL)
    assert code == 0
    # 16 vision heads / 8 ranks: sharded; 1152/16 = 72 head_dim -> qkv rows 3 * 2 * 72 per rank
    assert "[432, 1152]" in out


# ---- malformed VL specs: (old, new, message, the text whose line the error names) -----------------------
BAD = {
    "mrope_sections_sum": (
        "mrope_section: [24, 20, 20], max_position_embeddings: 262144, eos_token_id: [151645],\n"
        "     vision_depth: 27, vision_hidden_size: 1152, vision_num_heads: 16, vision_intermediate_size: 4304,\n"
        "     patch_size: 16, temporal_patch_size: 2, spatial_merge_size: 2, vision_out_hidden_size: 4096",
        "mrope_section: [24, 20, 24], max_position_embeddings: 262144, eos_token_id: [151645],\n"
        "     vision_depth: 27, vision_hidden_size: 1152, vision_num_heads: 16, vision_intermediate_size: 4304,\n"
        "     patch_size: 16, temporal_patch_size: 2, spatial_merge_size: 2, vision_out_hidden_size: 4096",
        "variants.Qwen3-VL-8B: mrope_section [24, 20, 24] sums to 68, expected head_dim / 2 = 64",
        "mrope_section: [24, 20, 24]"),
    "deepstack_levels_over_layers": (
        "{hidden_size: 2048, num_hidden_layers: 28,", "{hidden_size: 2048, num_hidden_layers: 2,",
        "variants.Qwen3-VL-2B: decoder.deepstack.levels is 3, but deepstack levels are injected after decoder "
        "layers 0..levels-1 and there are 2 layers", "deepstack_visual_indexes: [5, 11, 17]"),
    "deepstack_tap_over_vision_depth": (
        "deepstack_visual_indexes: [8, 16, 24]}\n  Qwen3-VL-32B", "deepstack_visual_indexes: [8, 16, 27]}\n  Qwen3-VL-32B",
        "variants.Qwen3-VL-8B: vision.deepstack.taps [8, 16, 27] must be unique vision block indices in 0..26",
        "deepstack_visual_indexes: [8, 16, 27]"),
    "unknown_vision_block_kind": (
        "mlp: {kind: vision_mlp,", "mlp: {kind: vision_mpl,",
        "vision.blocks.blocks.mlp: unknown block kind 'vision_mpl' (did you mean 'vision_mlp'?)", "vision_mpl"),
    "merger_width_not_text_width": (
        "vision_out_hidden_size: 2048", "vision_out_hidden_size: 1024",
        # the spec's guard-only derived symbol (a relation transformers requires) refuses it first
        "variants.Qwen3-VL-2B: config.vision_out_width_gap = vision_out_hidden_size - hidden_size: -1024 is outside "
        "[0, 0]", "vision_out_width_gap:"),
    "deepstack_levels_not_the_tap_count": (
        'deepstack_levels:         {type: int, expr: "len(deepstack_visual_indexes)"}',
        'deepstack_levels:         {type: int, expr: "len(vision_depth)"}',
        "vision.deepstack.taps: declare the number of levels as a derived symbol", "taps: deepstack_visual_indexes"),
    "vision_weights_key_without_param": (
        "\ndecoder:\n",
        "\nweights:\n  model.visual.blocks.{i}.attn.q_norm.weight:\n    from: model.visual.blocks.{i}.attn.q_norm.weight"
        "\ndecoder:\n",
        "'model.visual.blocks.{i}.attn.q_norm.weight' is not a parameter of the model", "attn.q_norm.weight:\n"),
    "inherited_segments_out_of_order": (
        "\ndecoder:\n",
        "\nweights:\n  model.layers.{i}.self_attn.qkv_proj.weight:\n    from:\n      q: a.{i}.q\n      v: a.{i}.v\n"
        "      k: a.{i}.k\ndecoder:\n",
        "segments must be ['q', 'k', 'v'] in this order, got ['q', 'v', 'k']", "      q: a.{i}.q"),
    "variant_sets_derived_symbol": (
        "num_position_embeddings: 2304, deepstack_visual_indexes: [5, 11, 17]}",
        "num_position_embeddings: 2304, deepstack_visual_indexes: [5, 11, 17], deepstack_levels: 3}",
        "variants.Qwen3-VL-2B.deepstack_levels: 'deepstack_levels' is derived (len(deepstack_visual_indexes)): "
        "set the symbols it reads instead", "deepstack_levels: 3}"),
    "decoder_prefix_without_container": (
        "  prefix: model.language_model", "  prefix: model",
        "decoder.prefix: with a vision tower the decoder lives beside it in the container `model`",
        "  prefix: model\n"),
    "vision_dataflow_reference": (
        "      - {norm: norm2, block: mlp}", "      - {norm: norm2, block: mpl}",
        "vision.blocks.dataflow[1].block: no block 'mpl' in vision.blocks.blocks (did you mean 'mlp'?)",
        "block: mpl"),
    "unknown_vision_key": (
        "  merge: spatial_merge_size", "  merg: spatial_merge_size",
        "vision: unknown key 'merg' (did you mean 'merge'?)", "merg: spatial"),
    "deepstack_levels_vs_mergers": (
        "  deepstack: {levels: deepstack_levels}", "  deepstack: {levels: 2}",
        "decoder.deepstack.levels: is 2, but vision.deepstack has deepstack_levels levels", "levels: 2}"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_vl_spec(case, tmp_path, capsys):
    old, new, message, locate = BAD[case]
    path, text = mutated(tmp_path, old, new)
    code, _, err = run_cli(capsys, path, "--dry-run")
    assert code == 2, err
    assert "Traceback" not in err
    assert message in err, err
    line = line_of(text, locate)
    assert f"bad_vl.yaml:{line}:" in err, f"expected line {line}:\n{err}"


def test_inherited_weights_use_model_names_under_a_prefix(tmp_path, capsys):
    """A decoder key written with the real prefix is not the spec's convention: the error says so."""
    path, text = mutated(tmp_path, "\ndecoder:\n", "\nweights:\n  model.language_model.norm.weight: "
                                                "{from: model.language_model.norm.weight}\ndecoder:\n")
    code, _, err = run_cli(capsys, path, "--dry-run")
    assert code == 2 and "is not a parameter of the model" in err
    assert f"bad_vl.yaml:{line_of(text, 'model.language_model.norm.weight')}:" in err


# ---- golden ---------------------------------------------------------------------------------------------
def test_resolved_golden_vl(capsys):
    code, out, _ = run_cli(capsys, "--explain", VL)
    assert code == 0
    if os.environ.get("XLLM_GEN_UPDATE_GOLDEN"):
        GOLDEN.write_text(out)
    assert out == GOLDEN.read_text(), ("resolved spec changed; if intended, refresh with: "
                                       "xllm-gen --explain specs/qwen3_vl.yaml > tests/golden/qwen3_vl.resolved.txt")


# ---- the generated model against Hugging Face -----------------------------------------------------------
TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [4, 2, 2],
                             "mrope_interleaved": True})
VISION = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=16, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, deepstack_visual_indexes=[0, 1, 2],
              num_position_embeddings=64, hidden_act="gelu_pytorch_tanh", in_channels=3)
GRIDS = {"one_image": [(1, 4, 6)], "images_and_video": [(1, 4, 4), (2, 6, 8), (1, 12, 10)]}


def _widen(model, seed=0):
    """Random weights large enough that every block matters (HF's init leaves biases 0 and norms 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name and name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif p.dim() == 1 or name.endswith("pos_embed.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(math.prod(p.shape[1:])))


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def hf_checkpoint(request, tmp_path_factory):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    cfg = Qwen3VLConfig(text_config=dict(TEXT), vision_config=dict(VISION), tie_word_embeddings=request.param)
    torch.manual_seed(0)
    hf = Qwen3VLForConditionalGeneration(cfg).float().eval()
    _widen(hf)
    d = tmp_path_factory.mktemp(f"tiny_qwen3_vl_{'tied' if request.param else 'untied'}")
    hf.save_pretrained(d)
    return hf, d, request.param


@pytest.fixture(scope="module")
def generated(hf_checkpoint):
    from xllm_gen.generated.qwen3_vl import model as gen
    from xllm_gen.runtime.loading.loader import load_weights
    hf, d, tied = hf_checkpoint
    config = gen.Config.from_hf(json.loads((d / "config.json").read_text()))
    m = gen.Model(config).float().eval()
    loaded = load_weights(m, gen.weight_plan(m), d, ignored=gen.IGNORED_CHECKPOINT_TENSORS)
    return m, config, loaded


def test_config_from_hf_checkpoint(hf_checkpoint, generated):
    _, _, tied = hf_checkpoint
    _, c, _ = generated
    assert c.mrope_section == (4, 2, 2) and c.rope_theta == 5000.0 and c.tie_word_embeddings is tied
    assert c.deepstack_visual_indexes == (0, 1, 2) and c.deepstack_levels == 3 and c.vision_depth == 3
    assert c.vision_rope_theta == 10000.0 and c.image_token_id == 151655


def test_config_fallbacks_for_older_checkpoints():
    """transformers < 5 wrote text_config.rope_theta and text_config.rope_scaling.mrope_section."""
    from xllm_gen.generated.qwen3_vl import model as gen
    text = {k: v for k, v in TEXT.items() if k != "rope_parameters"}
    text.update(rope_theta=5e6, rope_scaling={"mrope_section": [24, 20, 20], "mrope_interleaved": True},
                eos_token_id=151645, tie_word_embeddings=True)
    vision = {k: v for k, v in VISION.items()}
    c = gen.Config.from_hf({"text_config": text, "vision_config": vision})
    assert c.rope_theta == 5e6 and c.mrope_section == (24, 20, 20) and c.eos_token_id == (151645,)
    # transformers 5 ties the head by the top-level flag alone (false where absent), never by text_config's (hS)
    assert c.tie_word_embeddings is False and c.vision_rope_theta == 10000.0
    assert gen.Config.from_hf({"text_config": text, "vision_config": vision,
                               "tie_word_embeddings": True}).tie_word_embeddings is True
    del vision["deepstack_visual_indexes"]
    with pytest.raises(ValueError, match="deepstack_visual_indexes"):
        gen.Config.from_hf({"text_config": text, "vision_config": vision})


def test_weight_plan_loads_strictly(hf_checkpoint, generated):
    hf, _, tied = hf_checkpoint
    m, _, loaded = generated
    params = dict(m.named_parameters())
    assert loaded == set(params)                                        # every parameter, once
    hf_names = set(hf.state_dict())
    fused = {n for n in params if "qkv_proj" in n or "gate_up_proj" in n}   # stacked from q/k/v, gate/up
    assert set(params) - fused <= hf_names                             # same names as HF's modules ...
    for name, p in params.items():                                      # ... and the same values
        if "qkv_proj" in name or "gate_up_proj" in name:
            continue
        assert torch.equal(p, hf.state_dict()[name]), name
    assert ("lm_head.weight" in params) is (not tied)
    if tied:
        assert m.lm_head.weight is m.model.language_model.embed_tokens.weight
    else:
        assert torch.equal(m.lm_head.weight, hf.lm_head.weight)


def _pixels(grid, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(t * h * w for t, h, w in grid)
    dim = VISION["in_channels"] * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2
    return torch.randn(n, dim, generator=g)


@pytest.mark.parametrize("case", list(GRIDS))
def test_encode_vision_matches_hf(hf_checkpoint, generated, case):
    hf, _, _ = hf_checkpoint
    m, config, _ = generated
    grid = torch.tensor(GRIDS[case])
    pixels = _pixels(GRIDS[case], seed=len(case))
    with torch.no_grad():
        ref = hf.model.visual(pixels, grid_thw=grid)
        embeds, deepstack = m.encode_vision(pixels, grid)
    n = sum(t * h * w for t, h, w in GRIDS[case]) // 4
    assert embeds.shape == (n, config.hidden_size)
    assert deepstack.shape == (config.deepstack_levels, n, config.hidden_size)
    err = (embeds - ref.pooler_output).abs().max().item()
    ds_err = max((a - b).abs().max().item() for a, b in zip(deepstack, ref.deepstack_features))
    print(f"{case}: encode_vision max abs err embeds {err:.2e}, deepstack {ds_err:.2e}")
    assert err < 1e-5 and ds_err < 1e-5
    assert ref.pooler_output.abs().max() > 0.1                          # not a degenerate comparison
    # the deepstack levels are distinct features (a level fed from the wrong block would show)
    assert (deepstack[0] - deepstack[1]).abs().max() > 1e-2


def test_embed_input_ids_matches_hf(hf_checkpoint, generated):
    hf, _, _ = hf_checkpoint
    m, _, _ = generated
    ids = torch.tensor([1, 5, 200, 255])
    with torch.no_grad():
        assert torch.equal(m.embed_input_ids(ids), hf.get_input_embeddings()(ids))


def test_generated_vl_imports_without_the_compiler():
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("jinja2", "yaml", "pydantic") or name.startswith("xllm_gen.codegen"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import xllm_gen.generated.qwen3_vl as pkg
        assert pkg.ARCHITECTURES == ("Qwen3VLForConditionalGeneration",)
        from xllm_gen.generated.qwen3_vl import model, runner
        assert model.Model.__name__ == "Qwen3VLForConditionalGeneration"
        assert runner.Runner.multimodal and runner.Runner.position_rows == 3
        assert "prefill_embeds" in vars(runner.Runner) and "allocate_step_buffers" in vars(runner.Runner)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("tp", [2, 4])
def test_weight_plan_shards_fit_the_layers(hf_checkpoint, tp):
    """Every rank's slices fit the rank's parameters: at tp=4 the 2 vision heads are replicated, the vision
    MLP (64 rows) and the text layers are split; the fused attn.qkv is split into q/k/v before sharding."""
    from xllm_gen.generated.qwen3_vl import model as gen
    from xllm_gen.runtime.executor import distributed as D
    from xllm_gen.runtime.loading.loader import load_weights
    _, d, _ = hf_checkpoint
    config = gen.Config.from_hf(json.loads((d / "config.json").read_text()))
    for rank in (0, tp - 1):
        D.init_tp(rank, tp)
        try:
            m = gen.Model(config).float()
            loaded = load_weights(m, gen.weight_plan(m), d, tp_size=tp, tp_rank=rank,
                                  ignored=gen.IGNORED_CHECKPOINT_TENSORS)
            assert loaded == {n for n, _ in m.named_parameters()}
            attn = m.model.visual.blocks[0].attn
            assert attn.sharded is (tp == 2) and m.model.visual.blocks[0].mlp.sharded
        finally:
            D.reset_tp()
