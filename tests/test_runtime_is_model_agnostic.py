"""The runtime names no model family; what is model-specific comes from a generated module.

- runtime/ (engine, scheduler, KV, sampler, loader, attention, ops, graphs, TP, layers, multimodal, serving)
  mentions no model family in code, identifiers, docstrings or comments, with no exception: transformers'
  rope_type names (e.g. the one named after a model family) are translated to the rotary's neutral scaling
  kinds by the compiler (codegen/resolver.py HF_ROPE_TYPES) and the generated config reader. The embedded
  default checkpoint of the README's main job, which must build a real model, lives outside runtime/
  (xllm_gen/default_model.py).
- ModelRunner's hooks have neutral defaults; each generated runner overrides exactly the hooks its spec implies.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RUNTIME = REPO / "runtime"
FAMILIES = re.compile(r"qwen|llama|mistral|gemma", re.IGNORECASE)
ALLOWED_FILES: set = set()                        # relative to runtime/: none
TEXT_SUFFIXES = {".py", ".pyi", ".md", ".txt", ".j2", ".json", ".yaml", ".yml", ".toml", ".cfg"}


def family_mentions(root: Path = RUNTIME) -> list[str]:
    """'file:line: text' of every mention of a model family under root, minus the explicit exceptions."""
    hits = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if not path.is_file() or "__pycache__" in path.parts or path.suffix not in TEXT_SUFFIXES:
            continue
        if rel in ALLOWED_FILES:
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if FAMILIES.search(line):
                hits.append(f"{path.relative_to(root.parent).as_posix()}:{n}: {line.strip()}")
    return hits


def test_runtime_names_no_model_family():
    hits = family_mentions()
    assert not hits, "runtime/ names a model family (describe the primitive instead):\n" + "\n".join(hits)


def test_the_grep_can_fail(tmp_path):
    (tmp_path / "a.py").write_text('"""Neutral."""\nROPE = "llama3"\n')
    (tmp_path / "b.py").write_text("x = 1\n# as in Qwen3-VL\n")
    (tmp_path / "tiny.py").write_text("# the default: a tiny Qwen3\n")     # no file is exempt
    (tmp_path / "c.py").write_text("inv_freq_llama = 0\n")
    hits = family_mentions(tmp_path)
    assert [h.split(": ", 1)[0].rsplit("/", 1)[-1] for h in hits] == ["a.py:2", "b.py:2", "c.py:1", "tiny.py:1"]


HOOKS = ("positions_of", "decode_positions", "allocate_step_buffers", "prefill_embeds", "after_step")


def _seq(tokens, mm=None):
    from xllm_gen.runtime.engine.sampling_params import SamplingParams
    from xllm_gen.runtime.engine.sequence import Sequence
    return Sequence(0, list(tokens), SamplingParams(), mm_inputs=mm)


def test_model_runner_hooks_are_neutral():
    from xllm_gen.runtime.executor.model_runner import ModelRunner
    r = ModelRunner.__new__(ModelRunner)
    assert r.position_rows == 1 and not r.multimodal
    assert r.positions_of(_seq(range(5)), 2, 5).tolist() == [2, 3, 4]
    assert r.decode_positions([_seq(range(5)), _seq(range(2))]) == [4, 1]
    assert r.prefill_embeds([_seq(range(3))], torch.zeros(3, dtype=torch.long), None) is None
    assert r.allocate_step_buffers() is None and r.after_step(None) is None


def _runner(name):
    return importlib.import_module(f"xllm_gen.generated.{name}.runner").Runner


def test_generated_runners_override_what_their_spec_implies():
    specs = sorted(p.stem for p in (REPO / "specs").glob("*.yaml"))
    assert "qwen3_vl" in specs
    for name in specs:
        runner = _runner(name)
        overridden = {h for h in HOOKS if h in vars(runner)}
        if runner.position_rows == 1 and not runner.multimodal:        # text model, 1-D positions
            assert overridden == set(), (name, overridden)
    vl = _runner("qwen3_vl")                  # mRoPE, vision tower, deepstack
    assert vl.position_rows == 3 and vl.multimodal
    assert {h for h in HOOKS if h in vars(vl)} == set(HOOKS)


class _MM:
    """What the generated mRoPE runner reads of a request's multimodal inputs."""
    def __init__(self, positions, delta):
        self.mrope_positions, self.mrope_delta = positions, delta


def test_generated_mrope_positions():
    vl = _runner("qwen3_vl")
    r = vl.__new__(vl)
    prompt = torch.tensor([[0, 1, 2, 2, 4], [0, 1, 2, 3, 4], [0, 1, 3, 2, 4]])   # 5 prompt tokens
    mm = _MM(prompt, -1)
    seq = _seq(range(7), mm)                                                      # 2 generated tokens
    assert r.positions_of(seq, 1, 4).tolist() == prompt[:, 1:4].tolist()
    # a chunk across the prompt's end: the prompt's columns, then p + delta on all rows
    assert r.positions_of(seq, 3, 7).tolist() == [row[3:] + [4, 5] for row in prompt.tolist()]
    assert r.positions_of(_seq(range(4)), 1, 3).tolist() == [[1, 2]] * 3          # text request: equal rows
    assert r.decode_positions([seq, _seq(range(3))]) == [5, 2] * 3
