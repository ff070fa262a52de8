"""The spec-level regression battery: the same checks for every spec in specs/.

For each spec: generated/ is up to date, the resolved spec equals its golden, and a tiny random-weight
checkpoint of the architecture gives the same greedy tokens as Hugging Face transformers (float32, CPU),
alone and at tensor parallel size 2 (gloo). Graph vs eager runs on a GPU host (tests/gpu/).
A new spec fails here until it has a tiny checkpoint maker and requests in BATTERY below.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_ref import hf_greedy, hf_vl_greedy, hf_vl_inputs

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted(p.stem for p in (ROOT / "specs").glob("*.yaml"))
MAX_TOKENS = 16


def _image(h: int, w: int, seed: int):
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))


def _text_requests(ckpt):
    return [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 6, 13)]


def _vl_requests(ckpt):
    img = "<|vision_start|><|image_pad|><|vision_end|>"
    return _text_requests(ckpt) + [
        {"prompt": f"{img}What is this?", "multi_modal_data": {"image": [_image(64, 96, 1)]}},
        {"prompt": f"A {img} and a {img}.", "multi_modal_data": {"image": [_image(32, 64, 2), _image(64, 64, 3)]}},
    ]


def _make(name: str, out: Path) -> Path:
    from xllm_gen.runtime import tiny
    return {"qwen3": tiny.make_tiny_qwen3, "qwen3_vl": tiny.make_tiny_qwen3_vl}[name](out)


BATTERY = {"qwen3": _text_requests, "qwen3_vl": _vl_requests}


def _hf_tokens(ckpt, request) -> list[int]:
    if "multi_modal_data" in request:
        inputs = hf_vl_inputs(ckpt, request["prompt"], images=request["multi_modal_data"].get("image"))
        return hf_vl_greedy(ckpt, inputs, MAX_TOKENS)
    return hf_greedy(ckpt, [request["prompt_token_ids"]], MAX_TOKENS)[0]


@pytest.fixture(scope="module", params=SPECS)
def spec(request, tmp_path_factory):
    name = request.param
    if name not in BATTERY:
        pytest.fail(f"specs/{name}.yaml has no entry in tests/test_spec_battery.py BATTERY (tiny checkpoint + requests)")
    return name, _make(name, tmp_path_factory.mktemp(name) / "ckpt")


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xllm_gen.codegen.cli", *args], cwd=ROOT,
                          capture_output=True, text=True)


@pytest.mark.parametrize("name", SPECS)
def test_generated_is_up_to_date(name):
    r = _cli("--check", f"specs/{name}.yaml")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", SPECS)
def test_resolved_spec_equals_golden(name):
    r = _cli("--explain", f"specs/{name}.yaml")
    assert r.returncode == 0, r.stderr
    golden = ROOT / "tests" / "golden" / f"{name}.resolved.txt"
    assert golden.exists(), f"no golden for {name}: xllm-gen --explain specs/{name}.yaml > {golden}"
    assert r.stdout == golden.read_text(), f"resolved spec changed; refresh {golden} if intended"


@pytest.mark.engine
def test_greedy_matches_hf_at_tp1_and_tp2(spec):
    from xllm_gen import LLM, SamplingParams

    name, ckpt = spec
    requests = BATTERY[name](ckpt)
    want = [_hf_tokens(ckpt, r) for r in requests]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for tp in (1, 2):
        with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4, tensor_parallel_size=tp) as llm:
            got = [o.outputs[0].token_ids for o in llm.generate(requests, params)]
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"{name} tp={tp} request {i}: engine {g} != HF {w}"
