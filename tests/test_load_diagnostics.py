"""Issue 22 leftovers around loading: two generated packages claiming one architecture block only that
architecture (named, with the way to choose: XLLM_GEN_PREFER), every other one still resolves; weight loading
shows progress (lines on stderr with XLLM_PROGRESS=1, or the server's INFO log), and is quiet by default."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from xllm_gen.runtime.loading import registry

GEN = Path(__file__).resolve().parents[1] / "generated"


@pytest.fixture
def twin_qwen3(tmp_path, monkeypatch):
    """A user's generated/ dir with a copy of the qwen3 package: Qwen3ForCausalLM is claimed twice."""
    user = tmp_path / "generated"
    shutil.copytree(GEN / "qwen3", user / "qwen3_copy", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv(registry.SEARCH_PATH_ENV, str(user))
    monkeypatch.delenv(registry.PREFER_ENV, raising=False)
    return "xllm_gen_user.qwen3_copy"


def test_two_claims_block_only_that_architecture(twin_qwen3, monkeypatch):
    with pytest.raises(registry.RegistryError) as info:
        registry.resolve({"architectures": ["Qwen3ForCausalLM"]})
    msg = str(info.value)
    assert "Qwen3ForCausalLM is claimed by 2 generated packages: xllm_gen.generated.qwen3, " \
           f"{twin_qwen3}" in msg and registry.PREFER_ENV in msg
    model, _ = registry.resolve({"architectures": ["LlamaForCausalLM"]})      # the others are not affected
    assert model.__name__ == "xllm_gen.generated.llama.model"
    assert "Qwen3ForCausalLM" not in registry.generated_packages()
    monkeypatch.setenv(registry.PREFER_ENV, twin_qwen3)                        # the user's choice
    model, _ = registry.resolve({"architectures": ["Qwen3ForCausalLM"]})
    assert model.__name__ == f"{twin_qwen3}.model"
    monkeypatch.setenv(registry.PREFER_ENV, "xllm_gen.generated.qwen3")
    assert registry.resolve({"architectures": ["Qwen3ForCausalLM"]})[0].__name__ == "xllm_gen.generated.qwen3.model"


def test_no_conflict_without_the_copy():
    assert registry.generated_packages()["Qwen3ForCausalLM"] == "xllm_gen.generated.qwen3"


def _load(ckpt, monkeypatch, progress, capfd):
    from xllm_gen import LLM

    if progress is None:
        monkeypatch.delenv("XLLM_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("XLLM_PROGRESS", progress)
    LLM(str(ckpt), device="cpu", dtype="float32", num_kv_blocks=8, block_size=4).shutdown()
    return capfd.readouterr().err


def test_load_progress_lines(qwen3_tied, monkeypatch, capfd):
    err = _load(qwen3_tied, monkeypatch, "1", capfd)
    lines = [ln for ln in err.splitlines() if ln.startswith("xllm-gen: ")]
    assert lines[0].startswith("xllm-gen: loading weights: ") and "reading model.safetensors" in lines[0], err
    pcts = [int(ln.split("weights: ")[1].split("%")[0]) for ln in lines[:-1]]
    assert pcts == sorted(pcts) and pcts[-1] == 100 and len(pcts) >= 4, lines       # every 25% at least
    assert lines[-1].startswith("xllm-gen: loaded ") and " parameters in " in lines[-1], lines


@pytest.mark.parametrize("progress", [None, "0"])
def test_load_is_quiet_by_default(qwen3_tied, monkeypatch, capfd, progress):
    assert "loading weights" not in _load(qwen3_tied, monkeypatch, progress, capfd)
