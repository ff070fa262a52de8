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
        "  rope_theta:              {type: float, from:", "  rope_theta:              {type: float, form:",
        "config.rope_theta: unknown key 'form' (did you mean 'from'?)", "form:"),
    "unknown_key_in_block": (
        "        qk_norm: {kind: rmsnorm", "        qk_nrom: {kind: rmsnorm",
        "unknown key 'qk_nrom' (did you mean 'qk_norm'?)", "qk_nrom"),
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
        "  vocab_size:              {type: int, from: vocab_size}",
        "  vocab_size:              {type: int, from: vocab_size}\n  vocab_size: {type: int, from: v}",
        "duplicate key 'vocab_size'", "vocab_size: {type: int, from: v}"),
    "head_kv_mismatch": (
        "num_attention_heads: 32, num_key_value_heads: 8", "num_attention_heads: 32, num_key_value_heads: 6",
        "variants.Qwen3-8B: self_attn.heads (32) must be a multiple of self_attn.kv_heads (6)",
        "num_key_value_heads: 6"),
    "fused_param_without_weights_entry": (
        "  model.layers.{i}.mlp.gate_up_proj.weight:\n    from:\n      gate: model.layers.{i}.mlp.gate_proj.weight\n"
        "      up: model.layers.{i}.mlp.up_proj.weight\n", "",
        "fused parameter 'model.layers.{i}.mlp.gate_up_proj.weight' has no entry in `weights`", "      mlp:"),
    "weights_key_without_param": (
        "  model.layers.{i}.mlp.gate_up_proj.weight:\n",
        "  model.layers.{i}.self_attn.v_norm.weight: {from: 'x.{i}.v'}\n  model.layers.{i}.mlp.gate_up_proj.weight:\n",
        "weights: 'model.layers.{i}.self_attn.v_norm.weight' is not a parameter of the model (did you mean "
        "'model.layers.{i}.self_attn.q_norm.weight'?)", "self_attn.v_norm.weight"),
    "shard_is_implied": (
        "  model.layers.{i}.mlp.gate_up_proj.weight:\n",
        "  model.layers.{i}.mlp.gate_up_proj.weight:\n    shard: colwise\n",
        "unknown key 'shard'", "shard: colwise"),
    "runner_is_engine_config": (
        "tensor_parallel:\n", "runner:\n  max_batch: 256\ntensor_parallel:\n",
        "unknown key 'runner'", "runner:"),
    "fused_segment_mismatch": (
        "      gate: model.layers.{i}.mlp.gate_proj.weight", "      gat: model.layers.{i}.mlp.gate_proj.weight",
        "segments must be ['gate', 'up'] in this order, got ['gat', 'up'] (did you mean 'gate'?)", "gat:"),
    "fused_sources_swapped": (
        "      k: model.layers.{i}.self_attn.k_proj.weight\n      v: model.layers.{i}.self_attn.v_proj.weight",
        "      v: model.layers.{i}.self_attn.v_proj.weight\n      k: model.layers.{i}.self_attn.k_proj.weight",
        "segments must be ['q', 'k', 'v'] in this order, got ['q', 'v', 'k']",
        "      q: model.layers.{i}.self_attn.q_proj.weight"),
    "qkv_segments_swapped": (
        "segments: [q, k, v]", "segments: [q, v, k]",
        "the forward pass splits the fused projection as [q, k, v]; got ['q', 'v', 'k']", "segments: [q, v, k]"),
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
    "literal_alone_read_as_symbol": (   # a blind user's `chunk_size: "None"`: say it is YAML's ~ here
        "        sliding_window: \"sliding_window if layer_types[layer] == 'sliding_attention' else None\"",
        "        sliding_window: None",
        "sliding_window: 'None' alone is read as a config symbol's name; a bare value is YAML: `~` (null)", "sliding_window: None"),
    "no_context_length": (   # the engine reads it by name: a compile error, not an AttributeError at load
        '  max_position_embeddings: {type: int, from: max_position_embeddings, default: 32768}\n', "",
        "config.max_position_embeddings: the engine reads the context length", "config:"),
    "unknown_symbol_in_expression": (
        'from: head_dim, default: 128}', 'from: head_dim, default_expr: "hidden_size // num_atention_heads"}',
        "unknown config symbol 'num_atention_heads' (did you mean 'num_attention_heads'?)", "num_atention_heads"),
    "expression_not_allowed": (
        'from: head_dim, default: 128}', 'from: head_dim, default_expr: "__import__(\'os\').getpid()"}',
        "config.head_dim.default_expr: only the calls bool, float, int, len, max, min, round are allowed",
        "__import__"),
    "bare_range": (         # a range object is no spec value: it was refused at load as a config.json error
        'from: head_dim, default: 128}', 'from: head_dim, default_expr: "max(range(4))"}',
        "config.head_dim.default_expr: range(n) is only a list comprehension's iterable", "max(range"),
    "expression_cycle": (   # head_dim's default reads head_dim2, whose default reads head_dim
        'from: head_dim, default: 128}',
        'from: head_dim, default_expr: "head_dim2"}\n  head_dim2: {type: int, from: hd2, default_expr: "head_dim"}',
        "expressions form a cycle: head_dim -> head_dim2 -> head_dim", "  head_dim:"),
    "layer_outside_a_layer": (
        "  embed_tokens: {kind: embedding, vocab: vocab_size, dim: hidden_size}",
        "  embed_tokens: {kind: embedding, vocab: vocab_size, dim: \"hidden_size + layer\"}",
        "`layer` (the layer index) is only defined for per-layer values", "hidden_size + layer"),
    "unknown_rope_type": (
        "values: [default, linear, dynamic, yarn]}", "values: [default, linear, dynamic, yarm]}",
        "config.rope_scaling.values[3]: unknown rope type 'yarm' (did you mean 'yarn'?)", "yarm"),
    "rope_alias_to_unmodeled_type": (
        "values: [default, linear, dynamic, yarn]}", "values: [default, linear, dynamic, yarn], aliases: {su: longrope}}",
        "config.rope_scaling.aliases.su: 'longrope' is not one of the symbol's values (default, linear, dynamic, yarn)",
        "aliases"),
    "rope_alias_of_a_value": (
        "values: [default, linear, dynamic, yarn]}", "values: [default, linear, dynamic, yarn], aliases: {yarn: linear}}",
        "config.rope_scaling.aliases.yarn: 'yarn' is one of the symbol's values already", "aliases"),
    "enum_default_outside_values": (
        "hidden_act:              {type: str, from: hidden_act, default: silu, values: [silu]}",
        "hidden_act:              {type: str, from: hidden_act, default: gelu, values: [silu]}",
        "config.hidden_act.default: 'gelu' is not one of the values the spec models: silu", "default: gelu"),
    "activation_not_gated": (
        "        activation: hidden_act", "        activation: swiglu",
        "'swiglu' is neither an activation", "activation: swiglu"),
    "rope_default_unknown_key": (
        "values: [default, linear, dynamic, yarn]}",
        "values: [default, linear, dynamic, yarn],\n    default: {rope_type: yarn, factr: 4.0}}",
        "config.rope_scaling.default: rope type 'yarn' has no key 'factr' (did you mean 'factor'?)", "default: {"),
    "rope_default_missing_key": (
        "values: [default, linear, dynamic, yarn]}",
        "values: [default, linear, dynamic, yarn],\n    default: {rope_type: linear}}",
        "config.rope_scaling.default: rope type 'linear' needs 'factor'", "default: {"),
    "rope_default_bad_number": (
        "values: [default, linear, dynamic, yarn]}",
        "values: [default, linear, dynamic, yarn],\n    default: {rope_type: linear, factor: 0}}",
        "config.rope_scaling.default: 'factor' = 0 must be a positive number", "default: {"),
    "learned_activation_in_a_gated_mlp": (
        "        activation: hidden_act", "        activation: xielu",
        "'xielu' has learned parameters (act_fn.alpha_p, act_fn.alpha_n, act_fn.beta, act_fn.eps): only a plain `mlp` "
        "block", "activation: xielu"),
    "negative_eps": (
        "        qk_norm: {kind: rmsnorm, eps: rms_norm_eps,", "        qk_norm: {kind: rmsnorm, eps: -1.0e-6,",
        "decoder.layers.blocks.self_attn.qk_norm.eps: must be > 0, got -1e-06", "eps: -1.0e-6"),
    "zero_rope_theta_in_variant": (
        "tie_word_embeddings: false, rope_theta: 1000000.0,\n     max_position_embeddings: 40960, eos_token_id: [151645]}\n  Qwen3-32B",
        "tie_word_embeddings: false, rope_theta: 0.0,\n     max_position_embeddings: 40960, eos_token_id: [151645]}\n  Qwen3-32B",
        "variants.Qwen3-8B: decoder.layers.blocks.self_attn.rotary.theta is 0.0; it must be > 0", "rope_theta: 0.0"),
    "odd_head_dim_with_rotary": (
        "num_key_value_heads: 8, head_dim: 128,\n     intermediate_size: 3072",
        "num_key_value_heads: 8, head_dim: 127,\n     intermediate_size: 3072",
        "variants.Qwen3-0.6B: self_attn.head_dim is 127; rotary needs an even head_dim", "head_dim: 127"),
    "assume_a_read_field": (
        "decoder:\n", "config_assume:\n  hidden_act: silu\ndecoder:\n",
        "config_assume.hidden_act: this field is read by a config symbol", "  hidden_act: silu\ndecoder"),
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
    "variant_outside_values": (
        "  Qwen3-8B:\n    {hidden_size: 4096,", "  Qwen3-8B:\n    {hidden_act: gelu, hidden_size: 4096,",
        "variants.Qwen3-8B.hidden_act: 'gelu' is not one of the values the spec models: silu", "hidden_act: gelu"),
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
    path, _ = mutated(tmp_path, "  sizes: [1, 2, 4, 8]", "  sizes: [1, 2, 4, 8]\n  bogus: 1\n  zizes: [1]")
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
    path, text = mutated(tmp_path, "  vocab_size:              {type: int, from: vocab_size}",
                         "  vocab_size:              {type: int, from: !!python/name:os.system vocab_size}")
    code, _, err = run_cli(capsys, path)
    assert code == 2 and "malformed YAML" in err and "Traceback" not in err
    assert f":{line_of(text, '!!python')}:" in err


# ---- CLI modes ------------------------------------------------------------------------------------------
@pytest.mark.slow     # ~40 s: README's test command (and CI) runs this `xllm-gen --check specs/*.yaml` itself
def test_check_passes_on_committed_tree(capsys):
    specs = sorted((REPO / "specs").glob("*.yaml"))
    code, out, err = run_cli(capsys, "--check", *specs)
    assert code == 0, out + err
    assert "up to date: generated/qwen3/" in out


def test_check_of_a_spec_never_generated_says_so(tmp_path, capsys):
    """--check on a new spec (no generated directory yet): one line that says so and what to run, not a diff of
    every file as '(missing)' under 'stale or edited by hand'."""
    code, out, err = run_cli(capsys, "--check", QWEN3, "--out", tmp_path)
    assert code == 1 and "(missing)" not in out
    assert "was never generated" in err and "run: xllm-gen" in err


def test_check_fails_with_diff_after_hand_edit(tmp_path, capsys):
    shutil.copytree(REPO / "generated" / "qwen3", tmp_path / "qwen3", ignore=shutil.ignore_patterns("__pycache__"))
    code, out, _ = run_cli(capsys, "--check", QWEN3, "--out", tmp_path)
    assert code == 0, out
    model = tmp_path / "qwen3" / "model.py"
    model.write_text(model.read_text().replace("scale=self.head_dim ** -0.5", "scale=0.125"))
    code, out, err = run_cli(capsys, "--check", QWEN3, "--out", tmp_path)
    assert code == 1
    assert "-                                scale=0.125," in out
    assert "+                                scale=self.head_dim ** -0.5," in out
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
    assert "qkv_proj.bias" not in out.split("variant Qwen3-0.6B")[1]    # attention_bias false: no bias


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


def test_default_graph_sizes_are_engine_defaults():
    """Graph sizes are deployment: the engine's default follows max_num_seqs, not the spec."""
    from xllm_gen.runtime.executor.model_runner import default_graph_sizes
    assert default_graph_sizes(256)[:6] == (1, 2, 4, 8, 16, 32) and default_graph_sizes(256)[-1] == 256
    assert default_graph_sizes(40) == (1, 2, 4, 8, 16, 32, 40)
    assert default_graph_sizes(3) == (1, 2, 3)
    runner = (REPO / "generated" / "qwen3" / "runner.py").read_text()
    assert "graph_buckets" not in runner and "max_batch" not in runner


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
    # the only run-time `if` statement on config is the checkpoint's tie_word_embeddings (the other: whether the
    # whole-layer decode kernel ran the step, L.decoder_layer_kernel)
    ifs = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("if ")]
    assert ifs == ["if fused is not None:", "if config.tie_word_embeddings:  # decided by the checkpoint's config"], ifs


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
    # absent num_key_value_heads: transformers' Qwen3Config default (32), not num_attention_heads
    import transformers
    assert c.eos_token_id == () and c.num_key_value_heads == transformers.Qwen3Config.from_dict(
        dict(no_eos)).num_key_value_heads == 32
    bad = _hf_config()
    del bad["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        model.Config.from_hf(bad)
    # a whole-head partial_rotary_factor is what the spec computes; any other value is refused by name
    whole = _hf_config(rope_parameters={"rope_theta": 5000.0, "rope_type": "default", "partial_rotary_factor": 1.0})
    assert model.Config.from_hf(whole).rope_scaling == {"rope_type": "default"}
    half = _hf_config(rope_parameters={"rope_theta": 5000.0, "rope_type": "default", "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        model.Config.from_hf(half)
    # numbers the spec uses where they must be > 0 are checked at load: zero / negative eps or theta refused
    for field, value, shown in (("rms_norm_eps", 0.0, "rms_norm_eps' = 0.0"), ("rms_norm_eps", -1e-6, "-1e-06"),
                                ("rope_parameters", {"rope_theta": 0.0, "rope_type": "default"}, "rope_theta' = 0.0")):
        with pytest.raises(ValueError, match=f"{shown}.* must be > 0"):
            model.Config.from_hf(_hf_config(**{field: value}))


@pytest.mark.parametrize("tied", [True, False])
def test_weight_plan_covers_every_parameter_once(tied):
    """The plan comes from the model's own parameters: each once (a tied head shares the embedding's), fused
    parameters from their segments in the layer's order, every other from the tensor of its own name."""
    import torch

    from xllm_gen.generated.qwen3 import model
    config = model.Config.from_hf(_hf_config(tie_word_embeddings=tied))
    with torch.device("meta"):
        m = model.Model(config)
    plan = model.weight_plan(m)
    assert [r.param for r in plan] == [n for n, _ in m.named_parameters()]
    assert ("lm_head.weight" in {r.param for r in plan}) is not tied
    by = {r.param: r for r in plan}
    qkv = by["model.layers.1.self_attn.qkv_proj.weight"]
    assert qkv.segments == ("q", "k", "v")
    assert qkv.sources == tuple(f"model.layers.1.self_attn.{x}_proj.weight" for x in "qkv")
    assert by["model.layers.0.mlp.gate_up_proj.weight"].segments == ("gate", "up")
    assert by["model.norm.weight"].sources == ("model.norm.weight",) and not by["model.norm.weight"].segments


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
  rope_scaling: {{values: [default], guard: true}}   # mRoPE takes no rope scaling: only the default rope is modelled
decoder:
  layers:
    blocks:
      self_attn:
        rotary: {{kind: mrope_interleaved, mrope_section: mrope_section, scaling: ~}}
  deepstack: {{after_layers: [0, 1, 2]}}
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
    # text-only mRoPE: three equal rows of positions, no vision merge, no deepstack buffers
    assert "position_rows = 3" in runner and "def positions_of(" in runner and "def decode_positions(" in runner
    assert "multimodal = True" not in runner and "prefill_embeds" not in runner and "deepstack" not in runner
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
    path, text = _child(tmp_path)
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


# ---- the non-gated mlp block (specs/starcoder2.yaml) -------------------------------------------------------
@pytest.mark.parametrize("body, match", [
    ("decoder:\n  layers:\n    blocks:\n      mlp: {activation: swiglu}\n",
     r"child\.yaml:\d+:\d+: .*mlp\.activation: 'swiglu' is neither an activation \(silu, swish, relu, relu2, "
     r".*, gelu_pytorch_tanh, gelu_new, .*\) nor a str config symbol"),
    ("config:\n  hidden_act: {values: [gelu_pytorch_tanh, geglu]}\n",
     r"config\.hidden_act\.values: 'geglu' is not an activation the runtime has"),
    ("decoder:\n  layers:\n    blocks:\n      mlp: {down: {name: c_fc}}\n", r"module name 'c_fc' is already used"),
])
def test_mlp_block_errors(tmp_path, body, match):
    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.codegen.errors import SpecError

    child = tmp_path / "child.yaml"
    child.write_text(f"spec_version: 2\nextends: {REPO / 'specs' / 'starcoder2.yaml'}\nname: mlp_child\n" + body)
    with pytest.raises(SpecError, match=match):
        compile_spec(child)


def test_plain_activations_match_transformers():
    """layers.act gives transformers' ACT2FN function for every name the resolver admits for an mlp block."""
    import torch
    from transformers.activations import ACT2FN

    from xllm_gen.codegen.resolver import ACTIVATIONS
    from xllm_gen.runtime.layers import act

    x = torch.linspace(-6, 6, 1001)
    for name in ACTIVATIONS:
        torch.testing.assert_close(act(name)(x), ACT2FN[name](x), rtol=1e-6, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="unsupported activation 'swiglu'"):
        act("swiglu")


@pytest.mark.parametrize("pattern,match", [
    (r"'^model\.layers\.61\.'", r"child\.yaml:\d+:\d+: error: ignore_checkpoint_tensors\[0\]: .* matches no tensor name.*'\.\*'"),
    (r"'^mtp\.$'", r"matches no tensor name"),
    (r"'(?P<'", r"bad regex"),
])
def test_ignore_checkpoint_tensors_errors(tmp_path, pattern, match):
    """The loader matches ignore_checkpoint_tensors against whole tensor names (fullmatch): a prefix written without
    '.*' matched nothing, and eight specs' multi-token-prediction skips were dead that way (a release storing its MTP
    layer was refused as having unexpected tensors); such a pattern is now a located error."""
    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.codegen.errors import SpecError

    path, _ = _child(tmp_path, extra=f"ignore_checkpoint_tensors: [{pattern}]\n")
    with pytest.raises(SpecError, match=match):
        compile_spec(path)
    path, _ = _child(tmp_path, extra="ignore_checkpoint_tensors: ['^model\\.layers\\.61\\..*']\n")
    assert compile_spec(path).ir.ignored == (r"^model\.layers\.61\..*",)
