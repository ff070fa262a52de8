"""The compiler: malformed specs (message + line), --check/--dry-run/--explain, determinism, the
generated modules' imports, the resolved-spec golden, and spec composition (`extends`).

Refresh the golden after an intended change:
    xllm-gen --explain specs/qwen3.yaml > tests/golden/qwen3.resolved.txt
(or run this file with XLLM_GEN_UPDATE_GOLDEN=1).
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from xllm_gen.codegen import cli
from xllm_gen.codegen.compiler import compile_spec
from xllm_gen.codegen.resolver import default_buckets

REPO = Path(__file__).resolve().parent.parent
QWEN3 = REPO / "specs" / "qwen3.yaml"
QWEN3_TEXT = QWEN3.read_text()
GOLDEN = REPO / "tests" / "golden" / "qwen3.resolved.txt"


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def line_of(text: str, needle: str) -> int:
    idx = text.index(needle)
    return text.count("\n", 0, idx) + 1


def mutated(tmp_path, old: str, new: str, name: str = "bad.yaml") -> tuple[Path, str]:
    assert QWEN3_TEXT.count(old) >= 1, old
    text = QWEN3_TEXT.replace(old, new, 1)
    path = tmp_path / name
    path.write_text(text)
    return path, text


# ---- malformed specs: (old, new, expected message, the text whose line the error names) ---------------
BAD = {
    "unknown_key_did_you_mean": (
        "  prefill_mode: whole", "  prefil_mode: whole",
        "runner: unknown key 'prefil_mode' (did you mean 'prefill_mode'?)", "prefil_mode"),
    "unknown_key_in_block": (
        "        qk_norm: {kind: rmsnorm", "        qk_nrom: {kind: rmsnorm",
        "unknown key 'qk_nrom' (did you mean 'qk_norm'?)", "qk_nrom"),
    "wrong_type": (
        "  max_batch: 256", "  max_batch: lots",
        "runner.max_batch: expected a valid integer, got 'lots'", "max_batch: lots"),
    "wrong_type_size": (
        "    count: num_hidden_layers", "    count: 2.5",
        "decoder.layers.count: expected an integer or a string (config symbol name), got 2.5", "count: 2.5"),
    "missing_field": (
        "        intermediate: intermediate_size\n", "",
        "decoder.layers.blocks.mlp: missing required key 'intermediate'", "      mlp:"),
    "unknown_block_kind": (
        "        kind: gated_mlp", "        kind: gated_mpl",
        "unknown block kind 'gated_mpl' (did you mean 'gated_mlp'?)", "kind: gated_mpl"),
    "bad_literal": (
        "rotary: {kind: neox,", "rotary: {kind: neo,",
        "'neo' (str) is not allowed (did you mean 'neox'?)", "rotary: {kind: neo,"),
    "malformed_yaml": (
        "  sizes: [1, 2, 4, 8]", "  sizes: [1, 2, 4, 8\nrunner2: 1",
        "malformed YAML", "runner2"),
    "duplicate_key": (
        "  max_batch: 256", "  max_batch: 256\n  max_batch: 128",
        "duplicate key 'max_batch'", "max_batch: 128"),
    "head_kv_mismatch": (
        "num_attention_heads: 32, num_key_value_heads: 8", "num_attention_heads: 32, num_key_value_heads: 6",
        "variants: Qwen3-8B: self_attn.heads (32) must be a multiple of self_attn.kv_heads (6)".replace("variants: ", "variants."),
        "num_key_value_heads: 6"),
    "param_without_weights_entry": (
        "  model.layers.{i}.self_attn.k_norm.weight: {shard: replicated}\n", "",
        "parameter 'model.layers.{i}.self_attn.k_norm.weight' has no entry in `weights`", "      self_attn:"),
    "weights_key_without_param": (
        "  model.norm.weight: {shard: replicated}",
        "  model.norm.weight: {shard: replicated}\n  model.layers.{i}.self_attn.v_norm.weight: {shard: replicated}",
        "weights: 'model.layers.{i}.self_attn.v_norm.weight' is not a parameter of the model (did you mean "
        "'model.layers.{i}.self_attn.q_norm.weight'?)", "self_attn.v_norm.weight"),
    "wrong_shard": (
        "  model.layers.{i}.self_attn.o_proj.weight: {shard: rowwise}",
        "  model.layers.{i}.self_attn.o_proj.weight: {shard: colwise}",
        "shard: 'colwise' does not fit the parameter (its layer is row-parallel): expected 'rowwise'",
        "o_proj.weight: {shard: colwise}"),
    "fused_segment_mismatch": (
        "      gate: model.layers.{i}.mlp.gate_proj.weight", "      gat: model.layers.{i}.mlp.gate_proj.weight",
        "segments must be ['gate', 'up'] in this order, got ['gat', 'up'] (did you mean 'gate'?)", "gat:"),
    "unsorted_buckets": (
        "  max_batch: 256", "  max_batch: 256\n  graph_buckets: [1, 4, 2, 8]",
        "runner.graph_buckets[2]: buckets must be sorted ascending and unique: 2 after 4", "graph_buckets"),
    "bucket_over_max_batch": (
        "  max_batch: 256", "  max_batch: 256\n  graph_buckets: [1, 2, 512]",
        "runner.graph_buckets[2]: bucket 512 exceeds runner.max_batch 256", "graph_buckets"),
    "indivisible_tp": (
        "  sizes: [1, 2, 4, 8]", "  sizes: [1, 2, 3]",
        "tensor parallel size 3, variant Qwen3-0.6B: model.layers.{i}.self_attn.qkv_proj.weight: segment 'q' "
        "has 16 units: not divisible by tensor parallel size 3", "sizes: [1, 2, 3]"),
    "kv_heads_not_replicable": (
        "num_attention_heads: 64, num_key_value_heads: 8", "num_attention_heads: 48, num_key_value_heads: 6",
        "tensor parallel size 4, variant Qwen3-32B: model.layers.{i}.self_attn.qkv_proj.weight: segment 'k' "
        "has 6 heads: tensor parallel size 4 must divide it or be a multiple of it", "sizes: [1, 2, 4, 8]"),
    "bad_dataflow_reference": (
        "{norm: post_attention_layernorm, block: mlp}", "{norm: post_attention_layernorm, block: mpl}",
        "decoder.layers.dataflow[1].block: no block 'mpl' in decoder.layers.blocks (did you mean 'mlp'?)",
        "block: mpl"),
    "unknown_symbol": (
        "  embed_tokens: {kind: embedding, vocab: vocab_size, dim: hidden_size}",
        "  embed_tokens: {kind: embedding, vocab: vocab_size, dim: hidden_sise}",
        "decoder.embed_tokens.dim: unknown config symbol 'hidden_sise' (did you mean 'hidden_size'?)",
        "hidden_sise"),
    "tied_head_shape": (
        "lm_head: {kind: lm_head, vocab: vocab_size, dim: hidden_size",
        "lm_head: {kind: lm_head, vocab: intermediate_size, dim: hidden_size",
        "lm_head: a tied head must have the embedding's shape", "lm_head: {kind"),
    "unused_block": (
        "      post_attention_layernorm: {kind: rmsnorm, dim: hidden_size, eps: rms_norm_eps}",
        "      post_attention_layernorm: {kind: rmsnorm, dim: hidden_size, eps: rms_norm_eps}\n"
        "      extra_norm: {kind: rmsnorm, dim: hidden_size, eps: rms_norm_eps}",
        "decoder.layers.blocks.extra_norm: block is never used by decoder.layers.dataflow", "extra_norm"),
    "variant_unknown_symbol": (
        "  Qwen3-8B:\n    {hidden_size: 4096,", "  Qwen3-8B:\n    {hiden_size: 4096,",
        "variants.Qwen3-8B: unknown config symbol 'hiden_size' (did you mean 'hidden_size'?)", "hiden_size"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_spec(case, tmp_path, capsys):
    old, new, message, locate = BAD[case]
    path, text = mutated(tmp_path, old, new)
    code, out, err = run_cli(capsys, path, "--dry-run")
    assert code == 2, err
    assert "Traceback" not in err
    assert message in err, err
    line = line_of(text, locate)
    assert f"bad.yaml:{line}:" in err, f"expected line {line}:\n{err}"
    assert err.strip().splitlines()[0].split(":")[0].endswith("bad.yaml")


def test_every_error_names_file_line_column(tmp_path, capsys):
    path, _ = mutated(tmp_path, "  max_batch: 256", "  max_batch: 256\n  bogus: 1\n  prefill_mode: sideways")
    path.write_text(path.read_text().replace("  prefill_mode: whole     # whole prompts (or chunked)\n", ""))
    code, _, err = run_cli(capsys, path)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 2
    for ln in lines:
        file, lineno, col, rest = ln.split(":", 3)
        assert file.endswith("bad.yaml") and int(lineno) > 0 and int(col) > 0 and rest.startswith(" error: ")


def test_not_a_mapping_and_empty_and_missing_file(tmp_path, capsys):
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "empty.yaml").write_text("# nothing\n")
    for name, msg in (("list.yaml", "must be a mapping"), ("empty.yaml", "the spec is empty"),
                      ("nope.yaml", "cannot read spec")):
        code, _, err = run_cli(capsys, tmp_path / name, "--dry-run")
        assert code == 2 and msg in err and "Traceback" not in err, err


def test_bad_yaml_tag_is_one_message(tmp_path, capsys):
    path, text = mutated(tmp_path, "  max_batch: 256", "  max_batch: !!python/name:os.system 256")
    code, _, err = run_cli(capsys, path)
    assert code == 2 and "malformed YAML" in err and "Traceback" not in err
    assert f":{line_of(text, '!!python')}:" in err


# ---- CLI modes ------------------------------------------------------------------------------------------
def test_check_passes_on_committed_tree(capsys):
    specs = sorted((REPO / "specs").glob("*.yaml"))
    code, out, err = run_cli(capsys, "--check", *specs)
    assert code == 0, out + err
    assert "up to date: generated/qwen3/" in out


def test_check_fails_with_diff_after_hand_edit(tmp_path, capsys):
    shutil.copytree(REPO / "generated" / "qwen3", tmp_path / "qwen3", ignore=shutil.ignore_patterns("__pycache__"))
    code, out, _ = run_cli(capsys, "--check", QWEN3, "--out", tmp_path)
    assert code == 0, out
    model = tmp_path / "qwen3" / "model.py"
    model.write_text(model.read_text().replace("self.head_dim ** -0.5", "0.125"))
    code, out, err = run_cli(capsys, "--check", QWEN3, "--out", tmp_path)
    assert code == 1
    assert "-        self.attn = L.Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=0.125)" in out
    assert "+        self.attn = L.Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim ** -0.5)" in out
    assert "stale or was edited by hand" in err
    # a missing file is stale too
    model.unlink()
    code, out, _ = run_cli(capsys, "--check", QWEN3, "--out", tmp_path)
    assert code == 1 and "(missing)" in out
    # so is a file the spec does not generate
    code, _, _ = run_cli(capsys, QWEN3, "--out", tmp_path)
    (tmp_path / "qwen3" / "helpers.py").write_text("x = 1\n")
    code, out, _ = run_cli(capsys, "--check", QWEN3, "--out", tmp_path)
    assert code == 1 and "helpers.py: not generated by the spec" in out


def test_write_only_what_changed(tmp_path, capsys):
    code, out, _ = run_cli(capsys, QWEN3, "--out", tmp_path)
    assert code == 0 and out.count("wrote:") == 3
    runner = tmp_path / "qwen3" / "runner.py"
    runner.write_text(runner.read_text() + "# edited\n")
    mtime = (tmp_path / "qwen3" / "model.py").stat().st_mtime_ns
    code, out, _ = run_cli(capsys, QWEN3, "--out", tmp_path)
    assert code == 0 and out.count("wrote:") == 1 and "runner.py" in out and out.count("unchanged:") == 2
    assert (tmp_path / "qwen3" / "model.py").stat().st_mtime_ns == mtime


def test_dry_run_writes_nothing(tmp_path, capsys):
    out_dir = tmp_path / "out"
    code, out, _ = run_cli(capsys, "--dry-run", QWEN3, "--out", out_dir)
    assert code == 0 and "dry run" in out
    assert not out_dir.exists()


def test_explain_tables(capsys):
    code, out, _ = run_cli(capsys, "--explain", QWEN3)
    assert code == 0
    assert "variant Qwen3-0.6B (28 layers, tied lm_head, bfloat16)" in out
    assert "total (28 layers)" in out and "596,049,920" in out          # Qwen3-0.6B: 0.6B parameters, tied
    assert "8,190,735,360" in out                                        # Qwen3-8B
    assert "32,762,123,264" in out                                       # Qwen3-32B


def test_explain_tp(capsys):
    code, out, _ = run_cli(capsys, "--explain", "--tp", "2", QWEN3)
    assert code == 0
    assert "self_attn: 8 q heads, 4 kv heads per rank" in out           # Qwen3-0.6B at tp=2
    assert "model.layers.{i}.self_attn.qkv_proj.weight  [2048, 1024]" in out.replace("   ", "  ").replace("   ", "  ") or \
        "[2048, 1024]" in out
    assert "[75968, 1024]" in out                                        # vocab rows per rank
    code, out, _ = run_cli(capsys, "--explain", "--tp", "16", QWEN3)     # kv heads 8 < 16: replicated
    assert code == 0 and "self_attn: 1 q heads, 1 kv heads per rank" in out
    code, out, err = run_cli(capsys, "--explain", "--tp", "3", QWEN3)
    assert code == 2 and "Traceback" not in err
    assert err.startswith("error: --tp 3:") and "not divisible by tensor parallel size 3" in err
    code, _, err = run_cli(capsys, "--tp", "2", QWEN3)
    assert code == 2 and "--tp only goes with --explain" in err


def test_default_buckets():
    assert default_buckets(256)[:6] == (1, 2, 4, 8, 16, 32) and default_buckets(256)[-1] == 256
    assert default_buckets(40) == (1, 2, 4, 8, 16, 32)
    assert default_buckets(3) == (1, 2)


# ---- rendering ------------------------------------------------------------------------------------------
def test_render_is_deterministic(tmp_path, monkeypatch):
    a = compile_spec(QWEN3).files
    monkeypatch.chdir(tmp_path)               # the banner's spec path does not depend on the cwd
    b = compile_spec(QWEN3).files
    assert a == b
    for name, text in a.items():
        assert text.startswith("# generated by xllm-gen, do not edit.\n# xllm-gen "), name
        assert "specs/qwen3.yaml" in text.splitlines()[1]
        assert "sha256(spec + templates): " in text.splitlines()[2]


def test_hash_follows_spec(tmp_path):
    spec = tmp_path / "qwen3.yaml"
    spec.write_text(QWEN3_TEXT + "\n# a comment changes the hash\n")
    banner = lambda files: files["model.py"].splitlines()[2]
    assert banner(compile_spec(spec).files) != banner(compile_spec(QWEN3).files)


ALLOWED_IMPORTS = ("torch", "xllm_gen.runtime", "dataclasses", "__future__", "typing")


def test_generated_imports_only_torch_and_runtime():
    for path in sorted((REPO / "generated").glob("*/*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:            # relative: inside the generated package
                    continue
                mods = [node.module]
            else:
                continue
            for m in mods:
                assert any(m == a or m.startswith(a + ".") for a in ALLOWED_IMPORTS), f"{path}: imports {m}"


def test_generated_model_imports_without_the_compiler():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("jinja2", "yaml", "pydantic") or name.startswith("xllm_gen.codegen"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import xllm_gen.generated.qwen3 as pkg
        assert pkg.ARCHITECTURES == ("Qwen3ForCausalLM",)
        from xllm_gen.generated.qwen3 import model
        assert model.Model.__name__ == "Qwen3ForCausalLM"
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr


def test_generated_is_specialized():
    text = (REPO / "generated" / "qwen3" / "model.py").read_text()
    assert 'kind="neox"' in text and "L.qk_norm_rope(" in text and "L.QKVParallelLinear(" in text
    assert "inject_deepstack" not in text                               # Qwen3 has no deepstack
    # the only run-time `if` on config is the checkpoint's tie_word_embeddings
    ifs = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("if ")]
    assert ifs == ["if config.tie_word_embeddings:  # decided by the checkpoint's config",
                   "if not config.tie_word_embeddings:"], ifs


def _hf_config(**kw):
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512,
               tie_word_embeddings=True, rope_parameters={"rope_theta": 5000.0, "rope_type": "default"},
               eos_token_id=[7, 8])
    cfg.update(kw)
    return cfg


def test_config_from_hf():
    from xllm_gen.generated.qwen3 import model
    c = model.Config.from_hf(_hf_config())
    assert c.rope_theta == 5000.0 and c.eos_token_id == (7, 8) and c.tie_word_embeddings is True
    hub = _hf_config(rope_theta=1e6, eos_token_id=3)
    del hub["rope_parameters"]
    c = model.Config.from_hf(hub)
    assert c.rope_theta == 1e6 and c.eos_token_id == (3,)
    no_eos = _hf_config()
    del no_eos["eos_token_id"], no_eos["num_key_value_heads"]
    c = model.Config.from_hf(no_eos)
    assert c.eos_token_id == () and c.num_key_value_heads == 4
    bad = _hf_config()
    del bad["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        model.Config.from_hf(bad)


@pytest.mark.parametrize("tied", [True, False])
def test_weight_plan_and_ir_match_model_parameters(tied):
    """The resolver's parameter list, the rendered model and the rendered weight plan agree."""
    import torch
    from xllm_gen.generated.qwen3 import model
    config = model.Config.from_hf(_hf_config(tie_word_embeddings=tied))
    with torch.device("meta"):
        m = model.Model(config)
    names = {n: tuple(p.shape) for n, p in m.named_parameters()}
    plan = model.weight_plan(config)
    assert [r.param for r in plan] == list(names) or sorted(r.param for r in plan) == sorted(names)
    ir = compile_spec(QWEN3).ir
    expanded = set()
    for p in ir.params:
        if p.only_if_untied and tied:
            continue
        expanded |= {p.name.format(i=i) for i in range(config.num_hidden_layers)} if p.per_layer else {p.name}
    assert expanded == set(names)
    values = {f.name: getattr(config, f.name) for f in ir.config}
    for p in ir.params:
        if p.only_if_untied and tied:
            continue
        name = p.name.format(i=0)
        shape = tuple(s.eval(values) for s in p.shape)
        if p.shard == "vocab":
            assert names[name][1:] == shape[1:] and names[name][0] >= shape[0]
        else:
            assert names[name] == shape, name


# ---- golden ---------------------------------------------------------------------------------------------
def test_resolved_golden(capsys):
    code, out, _ = run_cli(capsys, "--explain", QWEN3)
    assert code == 0
    if os.environ.get("XLLM_GEN_UPDATE_GOLDEN"):
        GOLDEN.write_text(out)
    assert out == GOLDEN.read_text(), ("resolved spec changed; if intended, refresh with: "
                                       "xllm-gen --explain specs/qwen3.yaml > tests/golden/qwen3.resolved.txt")


# ---- composition ----------------------------------------------------------------------------------------
CHILD = """\
# Qwen3's decoder with interleaved mRoPE and deepstack injection: what Qwen3-VL's text model reuses.
extends: {base}
name: qwen3_mrope_text
class_prefix: Qwen3MropeText
architectures: [Qwen3MropeTextForCausalLM]
config:
  mrope_section: {{type: int_tuple, from: rope_parameters.mrope_section, default: {section}}}
decoder:
  layers:
    blocks:
      self_attn:
        rotary: {{kind: mrope_interleaved, mrope_section: mrope_section}}
  deepstack: {{after_layers: [0, 1, 2]}}
runner:
  max_batch: 64
"""


def _child(tmp_path, section="[24, 20, 20]", extra=""):
    path = tmp_path / "child.yaml"
    text = CHILD.format(base=QWEN3, section=section) + extra
    path.write_text(text)
    return path, text


def test_extends_composes(tmp_path, capsys):
    path, _ = _child(tmp_path)
    c = compile_spec(path)
    assert c.ir.name == "qwen3_mrope_text" and len(c.ir.spec_files) == 2
    att = c.ir.attention_blocks[0]
    assert att.rotary.kind == "mrope_interleaved" and str(att.rotary.theta) == "rope_theta"   # merged, not replaced
    assert [w.param.name for w in c.ir.weights] == [w.param.name for w in compile_spec(QWEN3).ir.weights]
    model = c.files["model.py"]
    assert 'kind="mrope_interleaved"' in model and "mrope_section=config.mrope_section" in model
    assert "for level, layer in enumerate(self.layers[:3]):" in model and "L.inject_deepstack(hidden_states, level)" in model
    runner = c.files["runner.py"]
    assert 'position_kind = "mrope"' in runner and "max_batch = 64" in runner
    assert "graph_buckets = (1, 2, 4, 8, 16, 32, 48, 64)" in runner
    code, out, _ = run_cli(capsys, path, "--out", tmp_path / "gen")
    assert code == 0 and (tmp_path / "gen" / "qwen3_mrope_text" / "model.py").is_file()
    ast.parse((tmp_path / "gen" / "qwen3_mrope_text" / "model.py").read_text())


def test_extends_errors_point_at_the_right_file(tmp_path, capsys):
    # an error in the child: mRoPE sections must sum to head_dim / 2
    path, text = _child(tmp_path, section="[24, 20, 21]")
    code, _, err = run_cli(capsys, path)
    assert code == 2 and "mrope_section [24, 20, 21] sums to 65, expected head_dim / 2 = 64" in err
    # (no variant sets mrope_section: the default's node in the child is named)
    # an inherited node broken by the child: the error names the base file's line
    path, text = _child(tmp_path, extra="  deepstack_typo: 1\n".replace("  deepstack_typo", "  deepstak"))
    path.write_text(text.replace("  deepstack: {after_layers: [0, 1, 2]}\n", "  deepstak: {after_layers: [0]}\n"))
    code, _, err = run_cli(capsys, path)
    assert code == 2 and "child.yaml:" in err and "unknown key 'deepstak' (did you mean 'deepstack'?)" in err
    path, text = _child(tmp_path)
    path.write_text(text.replace("config:\n", "config:\n  head_dim: {type: float, from: head_dim}\n"))
    code, _, err = run_cli(capsys, path)
    assert code == 2 and "config symbol 'head_dim' is float, expected int" in err
    assert f"specs/qwen3.yaml:{line_of(QWEN3_TEXT, '        head_dim: head_dim')}:" in err


def test_extends_requires_own_name_and_no_cycles(tmp_path, capsys):
    path, text = _child(tmp_path)
    path.write_text(text.replace("name: qwen3_mrope_text\n", ""))
    code, _, err = run_cli(capsys, path)
    assert code == 2 and "`name` is inherited ('qwen3')" in err
    (tmp_path / "a.yaml").write_text("extends: b.yaml\nname: a\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\nname: b\n")
    code, _, err = run_cli(capsys, tmp_path / "a.yaml")
    assert code == 2 and "`extends` cycle" in err and "b.yaml:1:" in err


def test_deepstack_layers_within_decoder(tmp_path, capsys):
    path, text = _child(tmp_path)
    path.write_text(text.replace("after_layers: [0, 1, 2]", "after_layers: [0, 1, 40]"))
    code, _, err = run_cli(capsys, path)
    assert code == 2 and "layer 40 does not exist in variant Qwen3-0.6B (28 layers)" in err
    assert f"child.yaml:{line_of(text, 'after_layers')}:" in err
    path.write_text(text.replace("after_layers: [0, 1, 2]", "after_layers: [3, 9]"))
    model = compile_spec(path).files["model.py"]      # not a prefix: rendered as explicit layer ranges
    assert "for layer in self.layers[0:4]:" in model and "L.inject_deepstack(hidden_states, 1)" in model


def test_extends_null_deletes(tmp_path):
    path, text = _child(tmp_path, extra="ignore_checkpoint_tensors: ~\n")
    assert compile_spec(path).ir.ignored == ()


def test_all_specs_in_one_call_and_name_clash(tmp_path, capsys):
    path, _ = _child(tmp_path)
    code, out, _ = run_cli(capsys, "--dry-run", QWEN3, path)
    assert code == 0 and out.count("ok:") == 2
    clash = tmp_path / "clash.yaml"
    clash.write_text(f"extends: {QWEN3}\nname: qwen3\n")
    code, _, err = run_cli(capsys, "--dry-run", QWEN3, clash)
    assert code == 2 and "both would write generated/qwen3/" in err
