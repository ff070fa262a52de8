"""Tensor-parallel faults on CPU with gloo (issue 11, TP): rank workers stopped (SIGSTOP), killed (SIGKILL)
or interrupted (SIGINT on rank 0), idle and mid-step.

- A stopped worker, idle or mid-step, or during a query, is an error within XLLM_TP_TIMEOUT_S that names
  the rank and says it is stopped (rank 0's control messages have the timeout too, not only collectives).
- A worker killed mid-step is reported at once; SIGINT to a worker, idle or mid-step, changes nothing.
- A second Ctrl-C interrupts a step blocked on a stopped worker at once (KeyboardInterrupt, long before
  the timeout); the group is torn down and the runner refuses further steps.
- Every case leaves no rank process behind.
The fake runner and the helpers are those of test_tp.py (spawned ranks import the runner by name).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_tp import _expected_logits, _rank_children, _seq, _tp, _wait_gone

TESTS_DIR = Path(__file__).resolve().parent


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:          # wait until the kernel shows it stopped
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.01)


def _no_orphans(pids) -> None:
    left = _wait_gone(pids, timeout=10.0)
    for pid in left:                           # never leave a stopped process behind, even on failure
        os.kill(pid, signal.SIGKILL)
    assert left == [] and _rank_children() == [], f"ranks left behind: {left}"


def test_bad_timeout_is_refused_before_any_process():
    with pytest.raises(ValueError, match="XLLM_TP_TIMEOUT_S"):
        _tp(2, timeout_s=-1)


@pytest.mark.slow     # multi-process fault arm: --runslow (the default keeps test_tp.py's killed-worker and load-error arms)
def test_timeout_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("XLLM_TP_TIMEOUT_S", "2.5")
    r = _tp(2)
    try:
        assert r.timeout_s == 2.5
    finally:
        pids = r.worker_pids()
        r.shutdown()
    _no_orphans(pids)


@pytest.mark.slow     # multi-process fault arm: --runslow (the default keeps the killed-worker arm)
def test_stopped_idle_worker_is_an_error_naming_the_rank():
    r = _tp(2, timeout_s=2)
    pids = r.worker_pids()
    try:
        r.run([_seq(0, [1, 2], [0], chunk=2)], True)
        _stop(pids[0])                          # stopped while idle, between two generate() calls
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) is stopped") as info:
            r.run([_seq(1, [3], [1], chunk=1)], True)
        assert time.monotonic() - t0 < 2 + 8, "not within the timeout"
        assert "XLLM_TP_TIMEOUT_S" in str(info.value) and "Traceback" not in str(info.value)
        with pytest.raises(RuntimeError, match="shut down"):
            r.run([_seq(2, [4], [2], chunk=1)], True)
    finally:
        r.shutdown()
    _no_orphans(pids)


@pytest.mark.slow     # multi-process fault arm: --runslow (the default keeps the killed-worker arm)
def test_stopped_worker_mid_step_is_an_error_naming_the_rank():
    r = _tp(2, timeout_s=2)
    pids = r.worker_pids()
    try:
        threading.Timer(0.5, _stop, args=(pids[0],)).start()   # inside the slow (1.5 s) step
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) is stopped"):
            r.run([_seq(0, [555], [0], chunk=1)], True)
        assert time.monotonic() - t0 < 1.5 + 2 + 8
    finally:
        r.shutdown()
    _no_orphans(pids)


@pytest.mark.slow     # multi-process fault arm: --runslow (the default keeps the killed-worker arm)
def test_stopped_worker_during_a_query_is_named():
    r = _tp(2, timeout_s=2)
    pids = r.worker_pids()
    try:
        _stop(pids[0])
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) is stopped"):
            r.rank_info()
    finally:
        r.shutdown()
    _no_orphans(pids)


@pytest.mark.slow     # multi-process fault arm: --runslow (the default keeps test_tp.py's killed-worker and load-error arms)
def test_shutdown_with_a_stopped_worker_is_prompt():
    r = _tp(2, timeout_s=60)
    pids = r.worker_pids()
    _stop(pids[0])
    t0 = time.monotonic()
    r.shutdown()
    assert time.monotonic() - t0 < 10, "shutdown waited on the stopped rank"
    _no_orphans(pids)


@pytest.mark.slow     # multi-process fault arm: --runslow (the default keeps test_tp.py's killed-worker and load-error arms)
def test_killed_worker_mid_step_is_reported_at_once():
    r = _tp(2, timeout_s=60)
    pids = r.worker_pids()
    try:
        threading.Timer(0.5, os.kill, args=(pids[0], signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="killed by signal 9|Connection closed|rank 1"):
            r.run([_seq(0, [555], [0], chunk=1)], True)
        assert time.monotonic() - t0 < 15, "waited for the timeout instead of noticing the dead rank"
    finally:
        r.shutdown()
    _no_orphans(pids)


@pytest.mark.slow     # multi-process fault arm: --runslow (the default keeps the killed-worker arm)
def test_sigint_to_a_worker_idle_or_mid_step_changes_nothing():
    """Ctrl-C belongs to rank 0: a worker ignores SIGINT (a terminal sends it to the whole process group)."""
    import torch

    r = _tp(2, timeout_s=30)
    pids = r.worker_pids()
    try:
        os.kill(pids[0], signal.SIGINT)                         # idle
        time.sleep(0.3)
        s = _seq(0, [1, 2], [0], chunk=2)
        assert torch.equal(r.run([s], True), _expected_logits([s], 2))
        threading.Timer(0.5, os.kill, args=(pids[0], signal.SIGINT)).start()   # inside the slow step
        s = _seq(1, [555], [1], chunk=1)
        assert torch.equal(r.run([s], True), _expected_logits([s], 2))
    finally:
        r.shutdown()
    _no_orphans(pids)


_SIGINT_SCRIPT = """
import os, signal, sys, threading, time
# a suite started in the background (`cmd &`) runs with SIGINT ignored, and children inherit that
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {tests!r})
from test_tp import _seq, _tp
from test_tp_faults import _stop

if __name__ == "__main__":
    mode = sys.argv[1]
    r = _tp(2, timeout_s=float(sys.argv[2]))
    pids = r.worker_pids()
    print("PIDS", *pids, flush=True)
    r.run([_seq(0, [1, 2], [0], chunk=2)], True)
    _stop(pids[0])                                  # the step below blocks on the stopped rank
    hits = 2 if mode == "twice" else 1
    for i in range(hits):
        threading.Timer(0.5 + 0.5 * i, os.kill, args=(os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        r.run([_seq(1, [3], [1], chunk=1)], True)
        print("NOT_INTERRUPTED", flush=True)
    except KeyboardInterrupt:
        print("INTERRUPTED_AFTER", round(time.monotonic() - t0, 2), flush=True)
    except RuntimeError as e:
        print("ERROR_AFTER", round(time.monotonic() - t0, 2), str(e).splitlines()[0], flush=True)
    try:
        r.run([_seq(2, [4], [2], chunk=1)], True)
    except RuntimeError as e:
        print("REFUSED", str(e).splitlines()[0], flush=True)
    print("EXITING", flush=True)
"""


def _run_sigint_script(tmp_path, mode: str, timeout_s: float):
    script = tmp_path / "tp_sigint.py"
    script.write_text(_SIGINT_SCRIPT.format(tests=str(TESTS_DIR)))
    proc = subprocess.run([sys.executable, str(script), mode, str(timeout_s)], capture_output=True, text=True,
                          timeout=120, start_new_session=True)
    out = proc.stdout
    pids = [int(p) for line in out.splitlines() if line.startswith("PIDS") for p in line.split()[1:]]
    assert pids, out + proc.stderr
    _no_orphans(pids)
    assert proc.returncode == 0 and "EXITING" in out, out + proc.stderr
    return out, proc.stderr


@pytest.mark.slow     # multi-process fault arm: --runslow (the default keeps the killed-worker arm)
def test_second_ctrl_c_interrupts_a_step_blocked_on_a_stopped_rank(tmp_path):
    out, err = _run_sigint_script(tmp_path, "twice", timeout_s=60)
    assert "INTERRUPTED_AFTER" in out, out + err
    waited = float(out.split("INTERRUPTED_AFTER")[1].split()[0])
    assert waited < 10, out                           # at once, not after the 60 s timeout
    assert "REFUSED" in out and "shut down" in out, out


@pytest.mark.slow
def test_one_ctrl_c_waits_for_the_timeout_then_the_error_names_the_rank(tmp_path):
    out, err = _run_sigint_script(tmp_path, "once", timeout_s=3)
    assert "ERROR_AFTER" in out and "rank 1" in out and "stopped" in out, out + err
    waited = float(out.split("ERROR_AFTER")[1].split()[0])
    assert 2.5 < waited < 15, out
