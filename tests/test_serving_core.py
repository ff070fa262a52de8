"""The server's engine core in its own process (runtime/serving/engine_core.py, core_client.py): it is another
process than the API's; a request survives while another client disconnects (the disconnect aborts only its
own request in the core); an error in the core's step reaches the client as a 500 naming it and the server
stays up; a dead core makes /health 503 and requests 503 (in every API process of --api-server-count); killing
the API process (even with SIGKILL) leaves no orphan core; --engine-in-process keeps the engine in a thread (no
child process) and serves the same text."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from serving_util import ServerProcess, descendants

pytestmark = pytest.mark.engine
psutil = pytest.importorskip("psutil")

ARGS = ("--block-size", "4", "--num-kv-blocks", "96", "--max-num-seqs", "8")
FAULT = "trigger-a-core-fault"
FAULT_ENV = "XLLM_TEST_FAIL_STEP_ON"               # the core's test hook (engine_core.FAULT_ENV)


def _core(srv) -> "psutil.Process":
    procs = [p for p in descendants(srv.proc.pid) if "xllm_gen.runtime.serving.engine_core" in " ".join(p.cmdline())]
    assert len(procs) == 1, [p.cmdline() for p in descendants(srv.proc.pid)]
    return procs[0]


def _greedy(local, prompt, n):
    from xllm_gen import SamplingParams

    return local.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].outputs[0].text


def _complete(srv, prompt, n, **kw):
    return httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                         "ignore_eos": True, **kw}, timeout=120)


@pytest.fixture(scope="module")
def server(qwen3_tied):
    import os

    os.environ[FAULT_ENV] = FAULT
    try:
        srv = ServerProcess(qwen3_tied, *ARGS, "--log-level", "info")
    finally:
        del os.environ[FAULT_ENV]
    yield srv
    srv.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def local(qwen3_tied, make_llm):
    return make_llm(qwen3_tied)


def test_core_is_its_own_process(server):
    core = _core(server)
    assert core.pid != server.proc.pid and core.ppid() == server.proc.pid
    assert f"engine core process pid {core.pid}" in server.log.read_text()
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_request_survives_another_client_disconnecting(server, local):
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("r", _complete(server, "The survivor", 40)))
    t.start()
    body = {"prompt": "The quitter", "max_tokens": 200, "stream": True, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n == 3:
                break                     # the client goes away mid-stream
    t.join(120)
    assert got["r"].status_code == 200, got["r"].text
    assert got["r"].json()["choices"][0]["text"] == _greedy(local, "The survivor", 40)
    m = server.wait_idle()
    assert m["xllm:request_success_total[('finished_reason', 'abort')]"] >= 1
    assert m["xllm:request_success_total[('finished_reason', 'length')]"] >= 1


def test_streamed_text_and_logprobs_detokenized_in_the_api_process(server, local):
    """Token ids cross the process boundary; text (multi-byte characters too) and logprob tokens are made in the
    API process, and equal what the in-process engine gives."""
    prompt = "日本語のテキスト 🎉"
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                            "stream": True, "logprobs": 2}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == _greedy(local, prompt, 24)
    toks = [t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(toks) == 24 and all(isinstance(t, str) for t in toks)
    s = text[3:5]                    # stop strings are found in the core, which detokenizes those requests
    stop = _complete(server, prompt, 24, stop=[s]).json()["choices"][0]
    assert stop["text"] == text[:text.find(s)] and stop["finish_reason"] == "stop" and stop["stop_reason"] == s


def test_core_error_is_a_500_and_the_server_stays_up(server, local):
    r = _complete(server, f"please {FAULT} now", 8)
    assert r.status_code == 500, r.text
    assert "the engine failed: RuntimeError: injected fault" in r.json()["error"]["message"]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": FAULT, "max_tokens": 8, "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and "injected fault" in lines[-2]
    ok = _complete(server, "still serving", 6)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == _greedy(local, "still serving", 6)
    assert httpx.get(server.url + "/health").status_code == 200
    server.wait_idle()


def test_sigkill_of_the_api_process_leaves_no_orphan(server):
    """Runs last on this server: SIGKILL gives the API process no chance to stop the core; the parent-death
    signal does."""
    core = _core(server)
    server.proc.kill()
    assert server.proc.wait(30) == -signal.SIGKILL
    core.wait(15)
    assert not core.is_running()


@pytest.mark.slow
def test_dead_core_fails_requests_and_health(qwen3_tied):
    """The core killed under an in-flight request: a 500 naming it, /health 503, new requests 503, and the API
    process still stops cleanly."""
    server = ServerProcess(qwen3_tied, *ARGS)
    try:
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("r", _complete(server, "cut short", 300)))
        t.start()
        deadline = time.monotonic() + 20
        while server.metrics()["xllm:num_requests_running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _core(server).kill()
        t.join(60)
        assert got["r"].status_code == 500 and "engine core process exited" in got["r"].json()["error"]["message"]
        h = httpx.get(server.url + "/health")
        assert h.status_code == 503 and "engine core process exited" in h.json()["error"]
        assert _complete(server, "after", 2).status_code == 503
        assert server.stop() == 0
    finally:
        server.stop(signal.SIGKILL)


def test_an_api_process_that_did_not_start_the_core_sees_it_die():
    """API process i > 0 (--api-server-count) is not the core's parent: it watches the core's pid (given at its
    start). Here a stand-in core is killed under a request in flight: the request fails naming the exit, the client is
    no longer alive (/health 503) and a new request is refused (503), all within the receiver's poll."""
    import asyncio
    import subprocess
    import sys
    import tempfile

    from xllm_gen.runtime.serving.async_engine import _Track
    from xllm_gen.runtime.serving.core_client import CoreClient

    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    d = tempfile.mkdtemp(prefix="xllm-watch-")
    client = CoreClient(None, index=1, addresses=(f"ipc://{d}/in", [f"ipc://{d}/out1"]), core_pid=core.pid)

    async def run():
        client.start(asyncio.get_running_loop())
        track = client._tracks["r"] = _Track(asyncio.Queue(), time.monotonic())
        await asyncio.sleep(0.5)
        assert client.alive and client._core_exited() is None
        core.kill()
        t0 = time.monotonic()
        item = await asyncio.wait_for(track.queue.get(), 5)
        assert time.monotonic() - t0 < 2
        assert isinstance(item, RuntimeError) and f"engine core process exited (pid {core.pid})" in str(item)
        assert not client.alive
        with pytest.raises(RuntimeError, match="not running"):
            await client.add("new", "x", None)

    try:
        asyncio.run(run())
    finally:
        core.kill()
        core.wait()
        client.stop()


@pytest.mark.slow
def test_dead_core_seen_by_every_api_process(qwen3_tied):
    """--api-server-count 2, the core killed under requests in flight on both API processes: every one fails at once
    (500 naming the exit), /health is 503 and new requests 503 whichever process answers, and SIGTERM stops all fast
    (API process 1 used to hang its requests, answer /health 200, and hold the shutdown for the graceful timeout)."""
    import re
    from concurrent.futures import ThreadPoolExecutor

    srv = ServerProcess(qwen3_tied, *ARGS, "--api-server-count", "2", "--log-level", "info")
    try:
        deadline = time.monotonic() + 60
        while "API server 1 of 2" not in srv.log.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(_complete, srv, f"in flight {i}", 300) for i in range(8)]
            deadline = time.monotonic() + 30
            while srv.metrics()["xllm:num_requests_running"] < 1:      # the core's gauge, either process
                assert time.monotonic() < deadline
                time.sleep(0.05)
            _core(srv).kill()
            t0 = time.monotonic()
            got = [f.result(60) for f in futs]
        assert time.monotonic() - t0 < 10
        assert all(r.status_code in (500, 503) and "engine" in r.json()["error"]["message"] for r in got), \
            [r.text for r in got]
        for _ in range(8):                        # a new connection each: either process may answer
            assert httpx.get(srv.url + "/health", timeout=5).status_code == 503
            assert _complete(srv, "after", 2).status_code == 503
        failed = set(re.findall(r"xllm_gen\.serving\[(\d+)\]: engine core failed", srv.log.read_text()))
        assert len(failed) == 2, srv.log.read_text()[-3000:]
        t0 = time.monotonic()
        assert srv.stop() == 0
        assert time.monotonic() - t0 < 20
    finally:
        srv.stop(signal.SIGKILL)


@pytest.mark.slow
def test_no_orphan_core_after_sigint(qwen3_tied):
    """Ctrl-C (SIGINT) to the API process: an orderly stop of the core, exit code 130."""
    srv = ServerProcess(qwen3_tied, *ARGS)
    try:
        core = _core(srv)
        assert _complete(srv, "hello", 4).status_code == 200
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(30) == 130
        core.wait(15)
        assert not core.is_running()
    finally:
        srv.stop(signal.SIGKILL)


def test_in_process_mode(qwen3_tied, local):
    """--engine-in-process: no child process; the same text, streamed and not; a disconnect frees the blocks."""
    srv = ServerProcess(qwen3_tied, *ARGS, "--engine-in-process", "--log-level", "info")
    try:
        assert descendants(srv.proc.pid) == [] and "engine in process" in srv.log.read_text()
        assert _complete(srv, "The quick brown fox", 12).json()["choices"][0]["text"] == \
            _greedy(local, "The quick brown fox", 12)
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                          json={"prompt": "The quick brown fox", "max_tokens": 200, "stream": True,
                                "ignore_eos": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 6:
                    break
        assert srv.wait_idle()["xllm:request_success_total[('finished_reason', 'abort')]"] >= 1
    finally:
        assert srv.stop() == 0


@pytest.mark.slow
def test_tensor_parallel_core(qwen3_tied, local):
    """TP 2 under the core process: the core spawns its rank; same greedy text; SIGKILL of the API process
    takes the core and the rank down."""
    srv = ServerProcess(qwen3_tied, *ARGS, "--tensor-parallel-size", "2", timeout=300)
    try:
        family = descendants(srv.proc.pid)
        assert len(family) >= 2, [p.cmdline() for p in family]
        assert _complete(srv, "Tensor parallel", 10).json()["choices"][0]["text"] == \
            _greedy(local, "Tensor parallel", 10)
        srv.proc.kill()
        srv.proc.wait(30)
        gone, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        srv.stop(signal.SIGKILL)


@pytest.mark.slow
def test_bench_serve_compares_the_modes(qwen3_tied, tmp_path):
    """bench/bench_serve.py --serve starts the server per mode and times the offline engine on the same prompts."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_serve.py"
    spec = importlib.util.spec_from_file_location("bench_serve", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = bench
    spec.loader.exec_module(bench)
    out = tmp_path / "cmp.json"
    rc = bench.main(["--serve", str(qwen3_tied), "--modes", "core,in-process,offline", "--serve-args",
                     "--device cpu --dtype float32 --block-size 4", "--num-prompts", "8", "--max-concurrency", "8",
                     "--input-len", "16", "--output-len", "6", "--vocab-size", "400", "--json", str(out)])
    modes = json.loads(out.read_text())["modes"]
    assert rc == 0 and set(modes) == {"core", "in-process", "offline"}
    assert all(r["completed"] == 8 and r["request_throughput"] > 0 for r in modes.values())


def _deltas(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(i, p, params[i])
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step_deltas()
    return outs


def test_api_side_detokenization_equals_the_engines(qwen3_tied, make_llm):
    """The core-process path without processes: an engine that does not detokenize (as in the core), its
    token-id deltas detokenized by the API side's _RequestDetok, gives every delta the text (and logprob token
    names) the detokenizing engine gives: sampled tokens (odd bytes, split multi-byte characters), special
    tokens kept or skipped, stop strings (left to the core), prompt logprobs."""
    import copy

    from xllm_gen import SamplingParams
    from xllm_gen.runtime.serving.core_client import _RequestDetok

    engine = make_llm(qwen3_tied).engine
    prompts = ["日本語 🎉 text", "The quick brown fox", {"prompt_token_ids": [5, 17, 99, 3]}, "stop here"]
    base = dict(temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=2)
    params = [SamplingParams(seed=1, **base), SamplingParams(seed=2, skip_special_tokens=False, **base),
              SamplingParams(seed=3, prompt_logprobs=1, **base), SamplingParams(seed=4, **base)]
    want = _deltas(engine, prompts, params)
    stop = next(o.outputs[0].text for o in want if o.request_id == 3 and len(o.outputs[0].text) >= 2)
    params[3] = SamplingParams(seed=4, stop=[stop[:2]], **base)
    want = _deltas(engine, prompts, params)
    assert any("\ufffd" not in o.outputs[0].text and o.outputs[0].text == "" and o.outputs[0].token_ids
               for o in want), "no delta held back a partial character: the check is weaker than meant"
    engine.detokenize = False
    try:
        got = _deltas(engine, prompts, params)
    finally:
        engine.detokenize = True
    assert [o.request_id for o in got] == [o.request_id for o in want]
    assert all(c.text == "" for o in got if o.request_id != 3 for c in o.outputs)    # ids only from the core
    dets = {i: _RequestDetok(engine.tokenizer, params[i]) for i in range(4)}
    for g, w in zip(got, want):
        g = copy.deepcopy(g)
        dets[g.request_id](g)
        assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in g.outputs] == \
            [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in w.outputs], g.request_id
        for gc, wc in zip(g.outputs, w.outputs):
            assert [{t: lp.decoded_token for t, lp in e.items()} for e in gc.logprobs] == \
                [{t: lp.decoded_token for t, lp in e.items()} for e in wc.logprobs]
        if w.prompt_logprobs is not None:
            assert [e and {t: lp.decoded_token for t, lp in e.items()} for e in g.prompt_logprobs] == \
                [e and {t: lp.decoded_token for t, lp in e.items()} for e in w.prompt_logprobs]


@pytest.mark.slow
def test_two_api_processes_share_the_port_and_the_core(qwen3_tied, local):
    """--api-server-count 2: a second API process on the same socket, both served by the one core (greedy text
    as the engine's); SIGTERM stops the API processes and the core; --engine-in-process refuses it."""
    import re
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    srv = ServerProcess(qwen3_tied, *ARGS, "--api-server-count", "2", "--log-level", "info")
    try:
        family = descendants(srv.proc.pid)
        api = [p for p in family if "--_api-server" in p.cmdline()]
        assert len(api) == 1 and len(family) == 2, [p.cmdline() for p in family]
        core = _core(srv)
        deadline = time.monotonic() + 30
        while "API server 1 of 2" not in srv.log.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        want = _greedy(local, "Shared port", 6)
        pids: set = set()
        with ThreadPoolExecutor(16) as pool:
            for _ in range(8):
                rs = list(pool.map(lambda _: _complete(srv, "Shared port", 6), range(16)))
                assert all(r.status_code == 200 and r.json()["choices"][0]["text"] == want for r in rs)
                pids = set(re.findall(r"xllm_gen\.access\[(\d+)\]: POST /v1/completions 200", srv.log.read_text()))
                if len(pids) == 2:
                    break
        assert pids == {str(srv.proc.pid), str(api[0].pid)}, pids
        assert srv.stop() == 0
        gone, alive = psutil.wait_procs([core, *api], timeout=30)
        assert not alive
    finally:
        srv.stop(signal.SIGKILL)
    p = subprocess.run([sys.executable, "-m", "xllm_gen.runtime.serving.server", str(qwen3_tied), "--port", "0",
                        "--api-server-count", "2", "--engine-in-process"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--api-server-count must be >= 1, and 1 with --engine-in-process" in p.stderr


def test_core_compiles_grammars_off_the_step_loop(qwen3_tied, make_llm):
    """EngineCore over inproc sockets: while a request's grammar compiles (slowed to 1.5 s), another request is
    admitted and stepped to its end; then the constrained one is admitted and its output fits the constraint."""
    import pickle

    import zmq

    from xllm_gen import SamplingParams
    from xllm_gen.runtime.engine.structured_outputs import StructuredOutputsParams
    from xllm_gen.runtime.serving.engine_core import EngineCore

    engine = make_llm(qwen3_tied).engine
    backend = engine.structured
    compile_ = backend.compile

    def slow(so, *a):
        time.sleep(1.5)
        return compile_(so, *a)

    ctx = zmq.Context()
    cmd_out, cmd_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    res_out, res_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    cmd_in.bind("inproc://cmd")
    cmd_out.connect("inproc://cmd")
    res_in.bind("inproc://res")
    res_out.connect("inproc://res")
    core = EngineCore(engine, cmd_in, [res_out])
    backend.compile = slow
    t = threading.Thread(target=core.run, daemon=True)
    t.start()
    try:
        choice = StructuredOutputsParams(choice=["yes please", "no thanks"])
        send = lambda m: cmd_out.send(pickle.dumps(m))      # noqa: E731
        send(("add", "g", "Answer:", SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice),
              time.monotonic(), 0))
        send(("add", "p", "Plain", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), time.monotonic(), 0))
        events, text = [], ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not res_in.poll(100):
                continue
            msg = pickle.loads(res_in.recv())
            if msg[0] == "added":
                events.append(("added", msg[1], msg[2]))
            elif msg[0] == "out":
                for o in msg[1]:
                    if o.finished:
                        events.append(("finished", o.request_id))
                    if o.request_id == "g":
                        text += engine.decode_text(o.outputs[0].token_ids)
            if ("finished", "g") in events:
                break
        assert events.index(("finished", "p")) < events.index(("added", "g", None)), events
        assert text in ("yes please", "no thanks"), text
    finally:
        backend.compile = compile_
        cmd_out.send(pickle.dumps(("shutdown",)))
        t.join(10)
        for s in (cmd_out, cmd_in, res_out, res_in):
            s.close(0)
        ctx.term()
