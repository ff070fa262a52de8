"""The JSON Schema of the spec language (`xllm-gen --json-schema`, committed as specs/spec.schema.json for
yaml-language-server): up to date with codegen/schema/, accepts every spec in specs/ (as written, `extends`
overlays included, and merged), and refuses unknown keys.

Refresh after a change of codegen/schema/:  xllm-gen --json-schema specs/spec.schema.json
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from spec_sample import sampled

from xllm_gen.codegen import cli
from xllm_gen.codegen.yaml_loader import load_tree, load_yaml

REPO = Path(__file__).resolve().parent.parent
SCHEMA_PATH = REPO / "specs" / "spec.schema.json"
SPECS = sorted((REPO / "specs").glob("*.yaml"))

try:
    import jsonschema
except ImportError:  # pragma: no cover - the structural check below stands in
    jsonschema = None


def _schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def _errors(data) -> list[str]:
    """Validation errors of one spec document against the committed schema."""
    schema = _schema()
    if jsonschema is not None:
        return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                for e in jsonschema.Draft202012Validator(schema).iter_errors(data)]
    # structural fallback: top-level keys and the required keys of a complete spec
    top = schema["$defs"]["SpecExtension" if "extends" in data else "Spec"]
    errs = [f"{k}: not allowed" for k in data if k not in top["properties"]]
    errs += [f"{k}: required" for k in top.get("required", []) if k not in data]
    return errs


def test_committed_schema_is_up_to_date():
    assert SCHEMA_PATH.read_text(encoding="utf-8") == cli.spec_json_schema_text(), (
        "specs/spec.schema.json is stale: run  xllm-gen --json-schema specs/spec.schema.json")


def test_cli_prints_and_writes_the_schema(tmp_path, capsys):
    assert cli.main(["--json-schema"]) == 0
    out = capsys.readouterr().out
    assert out == cli.spec_json_schema_text() and json.loads(out)["$defs"]["Spec"]
    target = tmp_path / "spec.schema.json"
    assert cli.main(["--json-schema", str(target)]) == 0
    assert "wrote:" in capsys.readouterr().out
    assert target.read_text(encoding="utf-8") == out
    assert cli.main(["--json-schema", str(target)]) == 0
    assert "unchanged:" in capsys.readouterr().out
    assert cli.main([]) == 2                     # neither specs nor --json-schema
    assert cli.main(["--json-schema", "-", "--check"]) == 2


def test_check_reports_a_stale_schema_beside_the_specs(tmp_path, capsys):
    specs = tmp_path / "specs"
    specs.mkdir()
    shutil.copy(REPO / "specs" / "llama.yaml", specs / "llama.yaml")
    assert cli.main([str(specs / "llama.yaml"), "--out", str(tmp_path / "gen")]) == 0
    (specs / "spec.schema.json").write_text(cli.spec_json_schema_text(), encoding="utf-8")
    capsys.readouterr()
    assert cli.main(["--check", str(specs / "llama.yaml"), "--out", str(tmp_path / "gen")]) == 0
    assert "up to date:" in capsys.readouterr().out
    (specs / "spec.schema.json").write_text("{}\n", encoding="utf-8")
    assert cli.main(["--check", str(specs / "llama.yaml"), "--out", str(tmp_path / "gen")]) == 1
    assert "spec.schema.json is stale" in capsys.readouterr().err


@pytest.mark.parametrize("spec", sampled("schema", SPECS, lambda p: p.stem), ids=[p.stem for p in SPECS])
def test_schema_accepts_every_spec(spec):
    raw, _ = load_yaml(spec)                     # as an editor sees the file (`extends` overlays included)
    assert _errors(raw) == []
    merged = load_tree(spec).data                # after `extends`: a complete spec
    assert "extends" not in merged and _errors(merged) == []


@pytest.mark.parametrize("spec", sampled("schema_key", SPECS, lambda p: p.stem), ids=[p.stem for p in SPECS])
def test_schema_rejects_an_unknown_top_level_key(spec):
    raw, _ = load_yaml(spec)
    errs = _errors({**raw, "runner": {"max_batch": 8}})
    assert errs and any("runner" in e for e in errs), errs


def test_schema_rejects_bad_nested_values():
    if jsonschema is None:
        pytest.skip("jsonschema is not installed")
    data = load_tree(REPO / "specs" / "llama.yaml").data
    attn = data["decoder"]["layers"]["blocks"]["self_attn"]
    for bad in ({**attn, "qk_nrom": 1}, {**attn, "rotary": {**attn["rotary"], "kind": 5}},
                {k: v for k, v in attn.items() if k != "heads"}):
        doc = json.loads(json.dumps(data))
        doc["decoder"]["layers"]["blocks"]["self_attn"] = bad
        assert _errors(doc), bad
    doc = json.loads(json.dumps(data))
    doc["weights"]["model.layers.{i}.mlp.gate_up_proj.weight"]["shard"] = "colwise"   # the v1 key is gone
    assert _errors(doc)
    # a complete spec needs its required keys; an `extends` overlay does not, and `~` deletes
    assert _errors({k: v for k, v in data.items() if k != "decoder"})
    assert _errors({"extends": "llama.yaml", "name": "x", "decoder": {"layers": {"count": None}}}) == []
    assert _errors({"extends": "llama.yaml", "name": "x", "decodr": {}})


def test_fields_carry_descriptions_for_hover():
    defs = _schema()["$defs"]
    spec = defs["Spec"]["properties"]
    for key in ("name", "architectures", "config", "config_assume", "config_ignore", "weights", "tensor_parallel",
                "variants", "extends"):
        assert spec[key].get("description"), key
    assert "first present wins" in defs["ConfigField"]["properties"]["from"]["description"]
    assert "size" in defs["AttentionBlock"]["properties"]["heads"]["description"]
    assert defs["AttentionBlock"]["description"]
