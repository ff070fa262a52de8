"""Tensor parallelism on CPU with gloo (runtime/tp.py).

Machinery, with a tiny fake runner (module level, so spawned ranks import it by name):
- steps reach every rank exactly (token mirror, block tables, chunking, recompute, multimodal tensors);
  finished sequences are dropped on the workers; the KV block count is the minimum over ranks;
- a worker exception at load time or in a step surfaces in the caller as a RuntimeError carrying the
  worker's traceback (no hang), a killed worker is reported, a stuck worker hits the collective timeout;
  each leaves no child process, and the runner refuses further steps;
- no orphans after shutdown(), garbage collection, a normal interpreter exit without shutdown, Ctrl-C
  (deferred to the end of the step; the group stays usable) and SIGKILL of rank 0.
Qwen3 end to end (generated module, tiny checkpoints from conftest; tied and untied lm_head): greedy tokens
at TP=2 and TP=4 (2 KV heads < 4 ranks: replicated) identical to TP=1 and to HF in float32; prefill logits;
on every rank the loaded set equals the parameter set, shapes are 1/N, replicated KV heads are the right
checkpoint rows. Qwen3-VL at TP=2 with images and a video: identical to TP=1 and HF. A torchrun launch
(env:// rendezvous, two processes). Static checks: an impossible tensor_parallel_size fails with one
ValueError before any process starts; real model sizes (Qwen3-0.6B/8B/32B shapes) give the expected
verdicts; the vision tower is replicated where its heads do not divide.
"""
from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from xllm_gen.runtime.engine.sampling_params import SamplingParams
from xllm_gen.runtime.engine.sequence import Sequence, SequenceStatus
from xllm_gen.runtime.executor.distributed import get_tp_rank, get_tp_size

try:
    import psutil
except ImportError:  # pragma: no cover
    psutil = None

TESTS_DIR = Path(__file__).resolve().parent


# ============================================================================================ fake runner
@dataclasses.dataclass
class FakeMM:
    pixels: torch.Tensor
    delta: int


def seq_feature(seq: Sequence) -> float:
    """What the fake runner computes from a sequence: every field a step description must carry."""
    f = (sum(seq.token_ids) + 1000 * len(seq.token_ids) + 7 * seq.num_computed_tokens + 11 * seq.chunk_len
         + 13 * sum(seq.block_table) + 17 * seq.num_prompt_tokens)
    if seq.mm_inputs is not None:
        f += float(seq.mm_inputs.pixels.sum()) + 19 * seq.mm_inputs.delta
    return float(f)


class FakeRunner:
    """Logits [B, tp]: column r is (r + 1) * seq_feature as rank r sees the sequence (all-gathered), so a
    wrong mirror on any rank shows. hf_config switches: fail_load / fail_step (a rank), stall_step."""
    model_module = None

    def __init__(self, model_dir, hf_config, *, device, num_kv_blocks=None, **kwargs):
        self.rank, self.size = get_tp_rank(), get_tp_size()
        self.config = hf_config
        self.device = device
        if hf_config.get("fail_load") == self.rank:
            raise ValueError(f"boom at load on rank {self.rank}")
        self.model = nn.Linear(2, 2)
        self.loaded_params = {"weight", "bias"}
        self.num_kv_blocks = num_kv_blocks or self._auto_num_blocks(0.9)

    def _auto_num_blocks(self, gpu_memory_utilization):
        return 100 - 7 * self.rank                 # differs per rank: the group must agree on the minimum

    def run(self, seqs, is_prefill, all_rows=False):
        for s in seqs:
            if 666 in s.token_ids and self.config.get("fail_step") == self.rank:
                raise RuntimeError(f"boom in step on rank {self.rank}")
            if 777 in s.token_ids and self.config.get("stall_step") == self.rank:
                time.sleep(60)
            if 555 in s.token_ids:
                time.sleep(1.5)                    # a slow step (Ctrl-C test)
        x = torch.tensor([seq_feature(s) for s in seqs], dtype=torch.float64).unsqueeze(1) * (self.rank + 1)
        # Plain torch.distributed here: the runtime's custom ops (xllm::all_gather, ...) import torch._dynamo
        # on first use (seconds per process); the Qwen3 tests below exercise them.
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1).float()


class FakeRunnerNoHook(FakeRunner):
    """KV blocks differ per rank without the _auto_num_blocks hook: the group resizes after the build."""
    _auto_num_blocks = None

    def __init__(self, model_dir, hf_config, **kw):
        self.rank = get_tp_rank()
        super().__init__(model_dir, hf_config, num_kv_blocks=50 + self.rank, **kw)


def _expected_logits(seqs, tp):
    return torch.tensor([[seq_feature(s) * (r + 1) for r in range(tp)] for s in seqs], dtype=torch.float32)


def _seq(sid, tokens, table, chunk, computed=0, mm=None):
    s = Sequence(sid, tokens, SamplingParams(), mm_inputs=mm)
    s.block_table = list(table)
    s.chunk_len = chunk
    s.num_computed_tokens = computed
    s.status = SequenceStatus.RUNNING
    return s


def _tp(tp=2, cls=FakeRunner, **cfg):
    from xllm_gen.runtime.executor.tp import TensorParallelRunner

    timeout = cfg.pop("timeout_s", None)
    return TensorParallelRunner(cls, "/nonexistent", dict(cfg), tp, {"device": torch.device("cpu")},
                                timeout_s=timeout)


# --------------------------------------------------------------------------------------- process checks
def _alive(pid: int) -> bool:
    if psutil is not None:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _rank_children() -> list:
    """Our spawned rank processes still around (multiprocessing's resource tracker is not one)."""
    procs = [p for p in multiprocessing.active_children() if p.name.startswith("xllm-tp-rank")]
    if psutil is not None:
        for c in psutil.Process().children(recursive=True):
            try:
                cmd = " ".join(c.cmdline())
            except psutil.Error:
                continue
            if "spawn_main" in cmd and c.status() != psutil.STATUS_ZOMBIE:
                procs.append(c)
    return procs


def _wait_gone(pids, timeout=5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


# ================================================================================== machinery (fake runner)
@pytest.mark.slow     # a second process group; the default keeps TP 2 parity (test_qwen3_tp_matches_tp1_and_hf)
def test_steps_reach_every_rank_exactly():
    r = _tp(3)
    try:
        assert r.num_kv_blocks == 100 - 7 * 2                     # MIN over ranks
        assert [i["num_kv_blocks"] for i in r.rank_info()] == [86, 86, 86]
        assert r.loaded_param_sets() == [({"weight", "bias"}, {"weight", "bias"})] * 3
        mm = FakeMM(torch.arange(6, dtype=torch.float32).reshape(2, 3), delta=-4)
        a = _seq(0, [5, 6, 7, 8, 9], [3, 4], chunk=3)                 # chunked prefill: first chunk
        b = _seq(1, [1, 2, 3], [7], chunk=3, mm=mm)
        torch.testing.assert_close(r.run([a, b], True), _expected_logits([a, b], 3), rtol=0, atol=0)
        a.num_computed_tokens, a.chunk_len = 3, 2                     # second chunk
        b.num_computed_tokens = 3
        b.append_token(42)
        torch.testing.assert_close(r.run([a], True), _expected_logits([a], 3), rtol=0, atol=0)
        a.num_computed_tokens = 5
        for step in range(3):                                        # decode: one new token per step
            a.append_token(100 + step)
            b.append_token(200 + step)
            for s in (a, b):
                s.chunk_len = 1
            b.block_table.append(9 + step)
            torch.testing.assert_close(r.run([a, b], False), _expected_logits([a, b], 3), rtol=0, atol=0)
            a.num_computed_tokens += 1
            b.num_computed_tokens = b.num_tokens - 1
        # Recompute after preemption: tokens kept, KV recomputed into new blocks from 0.
        b.num_computed_tokens, b.chunk_len, b.block_table = 0, b.num_tokens, [11, 12, 13]
        torch.testing.assert_close(r.run([b], True), _expected_logits([b], 3), rtol=0, atol=0)
        # A finished sequence is dropped from the workers' mirrors at the next step.
        a.status = SequenceStatus.FINISHED
        c = _seq(2, [4, 4], [1], chunk=2)
        torch.testing.assert_close(r.run([c], True), _expected_logits([c], 3), rtol=0, atol=0)
        assert r.gather("mirror") == [[1, 2]] * 3
        del b, mm, s
        gc.collect()                                                   # collected: dropped as well
        r.run([c], True)
        assert r.gather("mirror") == [[2]] * 3
        pids = r.worker_pids()
    finally:
        r.shutdown()
    assert _wait_gone(pids) == [] and _rank_children() == []
    r.shutdown()                                                        # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        r.run([c], True)


@pytest.mark.slow     # a second process group (--runslow)
def test_kv_blocks_agree_without_hook():
    r = _tp(2, FakeRunnerNoHook)
    try:
        assert [i["num_kv_blocks"] for i in r.rank_info()] == [50, 50]
    finally:
        r.shutdown()


@pytest.mark.slow     # a second process group; test_rank0_error_at_load_is_raised_as_is covers load errors by default
def test_worker_error_at_load_surfaces_with_traceback():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        _tp(2, fail_load=1)
    msg = str(err.value)
    assert "rank 1" in msg and "ValueError: boom at load on rank 1" in msg and "Traceback" in msg, msg
    assert "in __init__" in msg                          # the worker's own frames, not only a summary
    assert time.monotonic() - t0 < 30
    assert _rank_children() == []


def test_rank0_error_at_load_is_raised_as_is():
    with pytest.raises(ValueError, match="boom at load on rank 0"):
        _tp(2, fail_load=0)
    assert _rank_children() == []


@pytest.mark.slow     # a second process group; test_killed_worker_is_reported covers a failing rank by default
def test_worker_error_in_step_surfaces_and_stops_the_group():
    r = _tp(2, fail_step=1)
    pids = r.worker_pids()
    ok = _seq(0, [1, 2], [0], chunk=2)
    r.run([ok], True)
    bad = _seq(1, [666, 3], [1], chunk=2)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        r.run([bad], True)
    assert time.monotonic() - t0 < 30
    msg = str(err.value)
    assert "rank 1" in msg and "RuntimeError: boom in step on rank 1" in msg and "Traceback" in msg, msg
    assert _wait_gone(pids) == [] and _rank_children() == []
    with pytest.raises(RuntimeError, match="shut down"):
        r.run([ok], True)


def test_killed_worker_is_reported():
    r = _tp(2)
    pids = r.worker_pids()
    os.kill(pids[0], signal.SIGKILL)
    s = _seq(0, [1, 2], [0], chunk=2)
    with pytest.raises(RuntimeError, match="killed by signal 9|Connection closed"):
        time.sleep(0.5)
        r.run([s], True)
    assert _wait_gone(pids) == [] and _rank_children() == []


@pytest.mark.slow     # waits out a worker timeout in a second process (--runslow)
def test_stuck_worker_hits_the_timeout():
    r = _tp(2, stall_step=1, timeout_s=3)
    pids = r.worker_pids()
    s = _seq(0, [777], [0], chunk=1)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="Timed out|timed out|timeout"):
        r.run([s], True)
    assert time.monotonic() - t0 < 20
    assert _wait_gone(pids) == [] and _rank_children() == []


@pytest.mark.slow     # a second process group (--runslow)
def test_garbage_collection_stops_the_ranks():
    r = _tp(2)
    pids = r.worker_pids()
    r.run([_seq(0, [1], [0], chunk=1)], True)
    del r
    gc.collect()
    assert _wait_gone(pids) == [] and _rank_children() == []


_SCRIPT = """
import os, signal, sys, threading, time
# a suite started in the background (`cmd &`) runs with SIGINT ignored, and children inherit that
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {tests!r})
import torch
from test_tp import _seq, _tp

if __name__ == "__main__":
    mode = sys.argv[1]
    r = _tp(2)
    print("PIDS", *r.worker_pids(), flush=True)
    r.run([_seq(0, [1, 2], [0], chunk=2)], True)
    if mode == "sigint":                 # Ctrl-C in a terminal: SIGINT to the whole process group
        threading.Timer(0.5, lambda: os.killpg(os.getpgrp(), signal.SIGINT)).start()
        t0 = time.monotonic()
        try:
            r.run([_seq(1, [555], [1], chunk=1)], True)
        except KeyboardInterrupt:
            print("INTERRUPTED_AFTER", round(time.monotonic() - t0, 2), flush=True)
        out = r.run([_seq(2, [3], [2], chunk=1)], True)      # the group is still usable
        print("STILL_OK", out.tolist(), flush=True)
    elif mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    print("EXITING", flush=True)         # no shutdown(): interpreter exit must stop the ranks
"""

_TORCHRUN_SCRIPT = """
import os, sys
sys.path.insert(0, {tests!r})
import torch
from test_tp import _expected_logits, _seq, _tp
from xllm_gen.runtime.executor.tp import is_driver

print("BEFORE", os.environ["RANK"], is_driver(), flush=True)
r = _tp(2)                                  # ranks other than 0 serve inside this call, then exit
print("DRIVER", os.environ["RANK"], flush=True)
s = _seq(0, [1, 2, 3], [0], chunk=3)
assert torch.equal(r.run([s], True), _expected_logits([s], 2))
s.num_computed_tokens, s.chunk_len = 3, 1
s.append_token(4)
assert torch.equal(r.run([s], False), _expected_logits([s], 2))
print("PIDS", *[i["pid"] for i in r.rank_info()], flush=True)
print("OK", flush=True)                     # no shutdown(): rank 0's exit releases rank 1
"""


@pytest.mark.slow     # signals to a whole process tree, ~6 s each (--runslow); serving's SIGTERM test runs by default
@pytest.mark.parametrize("mode", ["sigint", "kill"])   # kill: also test_killed_worker_is_reported
def test_no_orphans_after_exit_ctrl_c_or_kill(mode, tmp_path):
    script = tmp_path / "tp_script.py"
    script.write_text(_SCRIPT.format(tests=str(TESTS_DIR)))
    proc = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=120,
                          start_new_session=True)
    out = proc.stdout
    pids = [int(p) for line in out.splitlines() if line.startswith("PIDS") for p in line.split()[1:]]
    assert pids, out + proc.stderr
    if mode == "kill":
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == 0, out + proc.stderr
        assert "EXITING" in out
    if mode == "sigint":
        waited = float(out.split("INTERRUPTED_AFTER")[1].split()[0])
        assert waited >= 1.2, out                          # deferred until the slow step ended
        assert "STILL_OK" in out, out + proc.stderr
    assert _wait_gone(pids, timeout=5.0) == [], f"orphaned ranks after {mode}: {pids}\n{proc.stderr}"


# ======================================================================================== static checks
@pytest.fixture
def no_meta_leak():
    """build=True builds rank 0's model under torch.device("meta"); a layer that caches tensors made
    without an explicit device (rotary tables) would keep meta tensors for the rest of the session."""
    from xllm_gen.runtime.layers import rotary

    tables = getattr(rotary, "_TABLES", None)
    saved = dict(tables) if isinstance(tables, dict) else None
    yield
    if saved is not None:
        tables.clear()
        tables.update(saved)


def _qwen3_cfg(**kw):
    base = dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, tie_word_embeddings=False)
    base.update(kw)
    return base


def test_static_checks_on_real_sizes(no_meta_leak):
    from xllm_gen.generated.qwen3 import model as M
    from xllm_gen.runtime.executor.tp import check_tensor_parallel, tensor_parallel_problems

    q8b = M.Config.from_hf(_qwen3_cfg())
    for tp in (1, 2, 4, 8, 16, 32):                 # 16, 32: KV heads (8) replicated
        assert tensor_parallel_problems(M, q8b, tp) == [], tp
    p3 = tensor_parallel_problems(M, q8b, 3)
    assert any("segment 'q' has 32" in p for p in p3) and any("'k' has 8 heads" in p for p in p3), p3
    assert all(".*." in p or "layers" not in p for p in p3)          # one line for all layers, not 36
    q32b = M.Config.from_hf(_qwen3_cfg(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                                       num_attention_heads=64, num_key_value_heads=8))
    assert tensor_parallel_problems(M, q32b, 8) == []
    assert any("'k' has 8 heads" in p for p in tensor_parallel_problems(M, q32b, 12))
    q06b = _qwen3_cfg(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                      tie_word_embeddings=True)
    with pytest.raises(ValueError) as err:
        check_tensor_parallel(M, q06b, 6)
    msg = str(err.value)
    assert msg.startswith("tensor_parallel_size=6 is not possible") and "sizes that divide it" in msg, msg
    assert "1, 2, 4, 8, 16" in msg
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="integer >= 1"):
            check_tensor_parallel(M, q06b, bad)
    # With build=True rank 0's model is also built on the meta device (layer checks, per-rank shapes).
    tiny = M.Config.from_hf(_qwen3_cfg(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       vocab_size=300, max_position_embeddings=64))
    assert tensor_parallel_problems(M, tiny, 4, build=True) == []
    assert tensor_parallel_problems(M, tiny, 3, build=True) != []


def test_meta_build_catches_plan_model_mismatch(no_meta_leak):
    """A weight rule whose per-rank rows differ from the layer's per-rank shape is a static error."""
    import types

    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime.executor.sharding import Segment
    from xllm_gen.runtime.executor.tp import tensor_parallel_problems
    from xllm_gen.runtime.loading.weights import WeightRule

    class Model(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.up = L.ColumnParallelLinear(8, 12)
            self.down = L.RowParallelLinear(12, 8)

    def plan(config, rows):
        return [WeightRule("up.weight", ("up.weight",), "colwise", (Segment("up", rows),)),
                WeightRule("down.weight", ("down.weight",), "rowwise", (Segment("down", 12),))]

    good = types.SimpleNamespace(Model=Model, weight_plan=lambda c: plan(c, 12))
    bad = types.SimpleNamespace(Model=Model, weight_plan=lambda c: plan(c, 16))
    assert tensor_parallel_problems(good, None, 2, build=True) == []
    problems = tensor_parallel_problems(bad, None, 2, build=True)
    assert len(problems) == 1 and problems[0].startswith("up.weight: the model's per-rank shape (6, 8)"), problems
    assert get_tp_size() == 1                                   # the temporary TP state is restored


@pytest.mark.parametrize("tp, part", [(3, "segment 'q' has 4 units: not divisible by tensor parallel size 3"),
                                      (8, "segment 'q' has 4 units: not divisible by tensor parallel size 8")])
def test_impossible_size_fails_before_any_process(qwen3_tied, monkeypatch, tp, part):
    import torch.multiprocessing as tmp

    from xllm_gen import LLM

    def no_spawn(*a, **k):
        raise AssertionError("a process was about to start")
    monkeypatch.setattr(tmp, "get_context", no_spawn)
    monkeypatch.setattr(multiprocessing, "get_context", no_spawn)
    with pytest.raises(ValueError) as err:
        LLM(str(qwen3_tied), device="cpu", dtype="float32", tensor_parallel_size=tp)
    msg = str(err.value)
    assert f"tensor_parallel_size={tp} is not possible" in msg and part in msg, msg
    assert "qkv_proj" in msg
    assert _rank_children() == []


# ============================================================================================= Qwen3 e2e
MAX_TOKENS = 12


def _prompts(ckpt):
    from hf_ref import hf_tokenizer

    n = len(hf_tokenizer(ckpt))
    rng = random.Random(7)
    ids = [[rng.randrange(n) for _ in range(k)] for k in (5, 9, 23)]
    ids.append(hf_tokenizer(ckpt)("The capital of France is")["input_ids"])
    return ids


@pytest.mark.parametrize("ckpt_name, tp", [pytest.param("qwen3_tied", 2, marks=pytest.mark.slow), pytest.param("qwen3_tied", 4, marks=pytest.mark.slow),
                                           ("qwen3_untied", 2), pytest.param("qwen3_untied", 4, marks=pytest.mark.slow)])
def test_qwen3_tp_matches_tp1_and_hf(request, make_llm, ckpt_name, tp):
    from hf_ref import hf_greedy
    from safetensors import safe_open

    from xllm_gen import LLM, SamplingParams

    ckpt = request.getfixturevalue(ckpt_name)
    ids = _prompts(ckpt)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref = hf_greedy(ckpt, ids, MAX_TOKENS)
    assert len({tuple(t) for t in ref}) > 1 and any(len(set(t)) > 2 for t in ref)   # not flat
    tp1 = make_llm(ckpt)
    tp1_tokens = [o.outputs[0].token_ids for o in tp1.generate([{"prompt_token_ids": p} for p in ids], sp)]
    tp1_logits = tp1.prefill_logits(ids[2])
    assert tp1_tokens == ref

    t0 = time.monotonic()
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, tensor_parallel_size=tp)
    start_s = time.monotonic() - t0
    runner = llm.engine.runner
    pids = runner.worker_pids()
    # async scheduling stays off at TP > 1: the ranks take each step's input tokens from rank 0's host
    assert llm.engine._async is None and not runner.supports_async_decode
    try:
        t0 = time.monotonic()
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], sp)
        gen_s = time.monotonic() - t0
        tokens = [o.outputs[0].token_ids for o in outs]
        assert tokens == tp1_tokens == ref
        torch.testing.assert_close(llm.prefill_logits(ids[2]), tp1_logits, rtol=1e-5, atol=1e-4)

        # Every parameter of every rank loaded exactly once.
        sets = runner.loaded_param_sets()
        assert len(sets) == tp
        for rank, (loaded, params) in enumerate(sets):
            assert loaded == params, (rank, sorted(loaded ^ params))
        # Per-rank shapes, and the KV heads each rank holds (replicated when kv_heads < tp).
        cfg = llm.engine.config
        D, H, KV = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        h, kv = H // tp, max(1, KV // tp)
        name = "model.layers.0.self_attn.qkv_proj.weight"
        for info in runner.rank_info():
            shapes = info["param_shapes"]
            assert shapes[name] == ((h + 2 * kv) * D, cfg.hidden_size)
            assert shapes["model.layers.0.mlp.down_proj.weight"] == (cfg.hidden_size, cfg.intermediate_size // tp)
            assert info["num_kv_blocks"] == runner.num_kv_blocks
        with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
            k_ckpt = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
            q_ckpt = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        for rank, w in enumerate(runner.gather("param", name)):
            k_head = rank // (tp // KV) if KV < tp else None
            k_rows = (k_ckpt[k_head * D:(k_head + 1) * D] if k_head is not None
                      else k_ckpt[rank * kv * D:(rank + 1) * kv * D])
            assert torch.equal(w[:h * D], q_ckpt[rank * h * D:(rank + 1) * h * D])
            assert torch.equal(w[h * D:(h + kv) * D], k_rows), rank
        print(f"\n{ckpt_name} TP={tp}: start {start_s:.2f} s, generate {len(ids)}x{MAX_TOKENS} tokens "
              f"{gen_s:.2f} s")
    finally:
        llm.shutdown()
    assert _wait_gone(pids) == [] and _rank_children() == []


@pytest.mark.slow     # torchrun launches its own process group (--runslow)
def test_torchrun_launch(tmp_path):
    """Under torchrun (env:// rendezvous) every rank runs the script; rank 0 drives, rank 1 serves inside
    the constructor and exits when rank 0 is done."""
    import socket

    script = tmp_path / "tp_torchrun.py"
    script.write_text(_TORCHRUN_SCRIPT.format(tests=str(TESTS_DIR)))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={port}", str(script)], capture_output=True, text=True, timeout=120,
                          env=env, start_new_session=True)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    # the two ranks share one stdout pipe: their lines may interleave mid-line ("BEFOREBEFORE 1 False"), so the
    # records are read as patterns, not as whole lines
    assert sorted(re.findall(r"BEFORE (\d) (True|False)", out)) == [("0", "True"), ("1", "False")], out
    assert re.findall(r"DRIVER (\d)", out) == ["0"], out
    assert "OK" in out
    pids = [int(p) for line in out.splitlines() if line.startswith("PIDS") for p in line.split()[1:]]
    assert len(pids) == 2 and _wait_gone(pids) == []


# =========================================================================================== Qwen3-VL e2e
def _image(h, w, seed):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / (w - 1), yy * 255 / (h - 1), np.full((h, w), 60.0)], -1)
    return Image.fromarray(np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8))


def _video(t, h, w, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    v = rng.integers(0, 120, (t, h, w, 3), dtype=np.uint8)
    for i in range(t):
        v[i, (i * 7) % (h - 16):(i * 7) % (h - 16) + 16, (i * 11) % (w - 16):(i * 11) % (w - 16) + 16] = 250
    return v


@pytest.mark.vl
def test_qwen3_vl_static_checks(qwen3_vl_tied, no_meta_leak):
    """The vision tower splits by heads where they divide and is replicated otherwise: not an error."""
    import json

    from xllm_gen.generated.qwen3_vl import model as M
    from xllm_gen.runtime.executor.tp import tensor_parallel_problems

    cfg = M.Config.from_hf(json.loads((qwen3_vl_tied / "config.json").read_text()))
    assert cfg.vision_num_heads == 2
    for tp in (2, 4):      # 2 vision heads: split over 2 ranks, replicated over 4
        assert tensor_parallel_problems(M, cfg, tp, build=True) == [], tp
    assert any("segment 'q' has 4 units" in p for p in tensor_parallel_problems(M, cfg, 3))


@pytest.mark.vl
@pytest.mark.slow       # a TP 2 process group of the VL model (~4 s); the text TP 2 parity stays in the default run
def test_qwen3_vl_tp2_matches_tp1_and_hf(qwen3_vl_tied, make_llm):
    """Images and a video at TP=2 (vision inputs travel with the step description to rank 1): greedy
    tokens identical to TP=1 and to HF."""
    from hf_ref import hf_vl_greedy, hf_vl_inputs

    from xllm_gen import LLM, SamplingParams

    img, vid = "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"
    no_sampling = {"do_sample_frames": False}
    requests = [
        {"prompt": f"{img}Describe the image.", "multi_modal_data": {"image": [_image(64, 96, 1)]}},
        {"prompt": f"{vid}Describe the video.", "multi_modal_data": {"video": [_video(8, 64, 64, 2)]},
         "mm_processor_kwargs": no_sampling},
        {"prompt": f"First {img} then {vid} Which moves?",
         "multi_modal_data": {"image": [_image(96, 64, 3)], "video": [_video(4, 64, 96, 4)]},
         "mm_processor_kwargs": no_sampling},
        {"prompt": "Describe the weather today in one sentence."},
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref = []
    for r in requests:
        mm = r.get("multi_modal_data", {})
        inputs = hf_vl_inputs(qwen3_vl_tied, r["prompt"], mm.get("image"), mm.get("video"),
                              r.get("mm_processor_kwargs"))
        ref.append(hf_vl_greedy(qwen3_vl_tied, inputs, MAX_TOKENS))
    tp1 = [o.outputs[0].token_ids for o in make_llm(qwen3_vl_tied).generate(requests, sp)]
    llm = LLM(str(qwen3_vl_tied), device="cpu", dtype="float32", block_size=4, tensor_parallel_size=2)
    pids = llm.engine.runner.worker_pids()
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(requests, sp)]
        for loaded, params in llm.engine.runner.loaded_param_sets():
            assert loaded == params
    finally:
        llm.shutdown()
    assert tp1 == ref
    assert tokens == ref
    assert _wait_gone(pids) == [] and _rank_children() == []
