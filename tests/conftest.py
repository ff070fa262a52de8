"""Shared fixtures: tiny complete HF checkpoints built offline once per session, and a cached LLM factory.

`tiny_checkpoint(architecture, overrides=None, seed=0, ...)` (session-scoped) builds any architecture's tiny
checkpoint (tests/fixtures/tiny_hf.py, make_tiny_checkpoint) once per session per distinct arguments.

Named Qwen checkpoints (session-scoped fixtures, each a Path to a checkpoint dir):

    qwen3_tied      Qwen3, tied lm_head, heads 4 / kv_heads 2, head_dim 16, 2 layers (the default)
    qwen3_untied    Qwen3, untied lm_head, heads 4 / kv_heads 2, head_dim 32 (q width 128 != hidden 64), 3 layers
    qwen3_kv1       Qwen3, tied, heads 4 / kv_heads 1 (MQA)
    qwen3_mha       Qwen3, untied, heads 8 / kv_heads 8, head_dim 8 (MHA)
    qwen3_sharded   same weights as qwen3_tied, split into several safetensors files + index
    qwen3_hub_config Qwen3, untied, config.json written as older Hub checkpoints do (rope_theta at the top
                    level, torch_dtype), seed 4
    qwen3_vl_tied   Qwen3-VL, tied lm_head, 3 text layers, vision depth 3, deepstack [0, 1, 2], seed 1
    qwen3_vl_untied Qwen3-VL, untied lm_head, 4 text layers, deepstack [0, 2], seed 1, Hub-style config.json
                    (text rope_theta + rope_scaling {mrope_section, mrope_interleaved}, as Qwen3-VL-8B ships)

`QWEN3_VARIANTS` / `QWEN3_VL_VARIANTS` hold the make_tiny_qwen3 / make_tiny_qwen3_vl kwargs of each,
`qwen3_variant(name)` builds by name (for parametrized tests use `request.getfixturevalue(name)`).

`make_llm(ckpt_dir, **overrides)` (session-scoped) returns a cached `xllm_gen.LLM` built with the test
defaults device="cpu", dtype="float32", tensor_parallel_size=1, block_size=4 (small, so that prompts cross
page boundaries); a different override set gives a different engine.

Set XLLM_TEST_CKPT_DIR to build the checkpoints there (reused across runs when the files exist).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from fixtures.tiny_hf import CheckpointCache, make_tiny_qwen3, make_tiny_qwen3_vl

QWEN3_VARIANTS: dict[str, dict] = {
    "qwen3_tied": dict(tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=2, seed=0),
    "qwen3_untied": dict(
        tie_word_embeddings=False, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_hidden_layers=3, intermediate_size=96, seed=1,
    ),
    "qwen3_kv1": dict(tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=1, seed=2),
    "qwen3_mha": dict(
        tie_word_embeddings=False, num_attention_heads=8, num_key_value_heads=8, head_dim=8, seed=3,
    ),
    # Same arguments as qwen3_tied (so the same weights), several files.
    "qwen3_sharded": dict(
        tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=2, seed=0, max_shard_size="64KB",
    ),
    "qwen3_hub_config": dict(tie_word_embeddings=False, hub_style_config=True, seed=4),
}

QWEN3_VL_VARIANTS: dict[str, dict] = {
    "qwen3_vl_tied": dict(tie_word_embeddings=True, seed=1),
    "qwen3_vl_untied": dict(
        tie_word_embeddings=False, num_hidden_layers=4, deepstack_visual_indexes=(0, 2), seed=1,
        hub_style_config=True,
    ),
}

LLM_DEFAULTS = dict(device="cpu", dtype="float32", tensor_parallel_size=1, block_size=4)


def _share_cores_between_workers() -> None:
    """Under pytest-xdist (README's `-n 2`) each worker gets its share of the cores: torch's default of one
    intra-op thread per core in every worker oversubscribes them, and spinning threads make both workers slower
    than one. Subprocesses the tests start inherit OMP_NUM_THREADS."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    share = str(max(1, (os.cpu_count() or 1) // workers))
    os.environ.setdefault("OMP_NUM_THREADS", share)
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_configure(config):
    _share_cores_between_workers()
    config.addinivalue_line("markers", "vl: Qwen3-VL parity tests (tiny checkpoint, CPU)")
    config.addinivalue_line("markers", "engine: needs the xllm_gen engine (LLM.generate)")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the tests marked slow (long multi-process runs; or set XLLM_RUN_SLOW=1)")


def pytest_collection_modifyitems(config, items):
    """The default run (README's test command, CI) skips tests marked slow: TP 4 repeats of what TP 2 covers and
    long multi-process fault runs. `--runslow` (or XLLM_RUN_SLOW=1) runs them too."""
    if config.getoption("--runslow") or os.environ.get("XLLM_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow or XLLM_RUN_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


_CACHE: list[CheckpointCache] = []


def _cache(tmp_path_factory) -> CheckpointCache:
    """The session's checkpoint cache (XLLM_TEST_CKPT_DIR: built there and reused across sessions)."""
    if not _CACHE:
        env = os.environ.get("XLLM_TEST_CKPT_DIR")
        if env:
            Path(env).mkdir(parents=True, exist_ok=True)
            _CACHE.append(CheckpointCache(env, reuse=True))
        else:
            _CACHE.append(CheckpointCache(tmp_path_factory.getbasetemp() / "tiny_ckpts"))
    return _CACHE[0]


def _build(tmp_path_factory, name: str) -> Path:
    if name in QWEN3_VARIANTS:
        return _cache(tmp_path_factory).get(name, make_tiny_qwen3, **QWEN3_VARIANTS[name])
    return _cache(tmp_path_factory).get(name, make_tiny_qwen3_vl, **QWEN3_VL_VARIANTS[name])


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(architecture, overrides=None, seed=0, **make_tiny_checkpoint kwargs) -> checkpoint dir,
    built once per session per distinct arguments."""
    return lambda architecture, **kwargs: _cache(tmp_path_factory).tiny(architecture, **kwargs)


@pytest.fixture(scope="session")
def qwen3_variant(tmp_path_factory):
    """Build (once) and return the checkpoint dir of a variant by name."""
    return lambda name: _build(tmp_path_factory, name)


@pytest.fixture(scope="session")
def qwen3_tied(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, "qwen3_tied")


@pytest.fixture(scope="session")
def qwen3_untied(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, "qwen3_untied")


@pytest.fixture(scope="session")
def qwen3_kv1(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, "qwen3_kv1")


@pytest.fixture(scope="session")
def qwen3_mha(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, "qwen3_mha")


@pytest.fixture(scope="session")
def qwen3_sharded(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, "qwen3_sharded")


@pytest.fixture(scope="session")
def qwen3_hub_config(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, "qwen3_hub_config")


@pytest.fixture(scope="session")
def qwen3_vl_tied(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, "qwen3_vl_tied")


@pytest.fixture(scope="session")
def qwen3_vl_untied(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, "qwen3_vl_untied")


@pytest.fixture(scope="session")
def make_llm():
    """make_llm(ckpt_dir, **overrides) -> xllm_gen.LLM, cached per (dir, overrides)."""
    cache: dict = {}

    def make(ckpt_dir, **overrides):
        from xllm_gen import LLM

        kwargs = {**LLM_DEFAULTS, **overrides}
        key = (str(ckpt_dir), repr(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = LLM(model=str(ckpt_dir), **kwargs)
        return cache[key]

    yield make
    cache.clear()
