"""codegen/README.md cannot rot: every ```yaml block marked `<!-- spec: NAME.yaml -->` is a complete spec that
compiles (`xllm-gen --dry-run`, next to copies of specs/*.yaml so that examples may `extends` them), and every
key and block kind of the language (codegen/schema/) is named in the document.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from pydantic import BaseModel

from xllm_gen.codegen import cli
from xllm_gen.codegen import schema as S

REPO = Path(__file__).resolve().parent.parent
README = REPO / "codegen" / "README.md"
TEXT = README.read_text(encoding="utf-8")
MARKED = re.compile(r"<!-- spec: ([A-Za-z0-9_]+\.yaml) -->\n```yaml\n(.*?)\n```", re.S)
EXAMPLES = MARKED.findall(TEXT)


def test_readme_has_complete_examples():
    names = [n for n, _ in EXAMPLES]
    assert len(names) >= 4 and len(set(names)) == len(names), names
    # a marker must sit right above its yaml block
    assert TEXT.count("<!-- spec: ") == len(EXAMPLES)


@pytest.mark.parametrize("name, text", EXAMPLES, ids=[n for n, _ in EXAMPLES])
def test_readme_example_compiles(name, text, tmp_path, capsys):
    specs = tmp_path / "specs"
    specs.mkdir()
    for spec in (REPO / "specs").glob("*.yaml"):
        if spec.name != name:
            shutil.copy(spec, specs / spec.name)
    path = specs / name
    path.write_text(text + "\n", encoding="utf-8")
    code = cli.main(["--dry-run", str(path)])
    out, err = capsys.readouterr()
    assert code == 0, f"codegen/README.md example {name} does not compile:\n{err}"
    assert "dry run" in out


def _schema_models():
    return [c for c in vars(S).values()
            if isinstance(c, type) and issubclass(c, BaseModel) and c.__module__ == S.__name__ and c is not S.Strict]


def test_readme_names_every_key_and_kind():
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", TEXT))
    missing = [f"{c.__name__}.{f.alias or n}" for c in _schema_models() for n, f in c.model_fields.items()
               if (f.alias or n) not in words]
    missing += [f"block kind {k}" for k in S.BLOCK_KINDS if k not in words]
    assert not missing, f"codegen/README.md does not document: {', '.join(missing)}"
