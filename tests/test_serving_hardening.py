"""The server's hardening: --api-key (Bearer on /v1/*), CORS, an access log line per request, 404 and JSON
decode errors in OpenAI's error shape, a busy --port found before the model loads, --help / --version without
importing torch, max_model_len above the model's context refused, a chat template that does not compile refused
at start (file and line), missing model paths and hub ids named, local media paths refused unless under
--allowed-local-media-path (with the same answer whether a file exists)."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest
from serving_util import ENGINE_MODES, ServerProcess, free_port, mode_args

pytestmark = pytest.mark.engine

openai = pytest.importorskip("openai")

KEY = "s3cret"
ORIGIN = "http://app.example"
SERVE = [sys.executable, "-m", "xllm_gen.runtime.serving.server"]


@pytest.fixture(scope="module", params=ENGINE_MODES)
def server(qwen3_tied, request):
    srv = ServerProcess(qwen3_tied, "--block-size", "4", "--api-key", KEY, "--allowed-origins", ORIGIN,
                        "--log-level", "info", "--log-stats-interval", "0.01", *mode_args(request.param))
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-3000:]


def _is_openai_error(r, status):
    err = r.json()["error"]
    return r.status_code == status and err["message"] and err["type"] and err["code"] == status


def test_api_key(server):
    body = {"prompt": "hi", "max_tokens": 2}
    assert _is_openai_error(httpx.post(server.url + "/v1/completions", json=body), 401)
    assert _is_openai_error(httpx.post(server.url + "/v1/completions", json=body,
                                       headers={"Authorization": "Bearer wrong"}), 401)
    assert httpx.get(server.url + "/health").status_code == 200           # health stays open
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=client.models.list().data[0].id, prompt="hi",
                                     max_tokens=2).usage.completion_tokens >= 1


def test_cors(server):
    pre = httpx.options(server.url + "/v1/chat/completions",
                        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                 "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(server.url + "/v1/chat/completions",
                          headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert other.headers.get("access-control-allow-origin") != "http://evil.example"


def test_404_and_json_errors_in_openai_shape(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.get(server.url + "/v1/nope", headers=auth)
    assert _is_openai_error(r, 404) and "/v1/nope" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x",', headers={**auth,
                   "content-type": "application/json"})
    assert _is_openai_error(r, 400) and "not valid JSON" in r.json()["error"]["message"], r.text


def test_access_log_line(server):
    httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    deadline = time.monotonic() + 10
    while "GET /v1/models 200" not in server.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "GET /v1/models 200" in server.log.read_text()
    assert "device cpu, tensor parallel 1" in server.log.read_text()          # the start-up line
    assert "stats: running" in server.log.read_text() and "KV usage" in server.log.read_text()


def _fails_fast(args, words, limit=60.0):
    t0 = time.monotonic()
    p = subprocess.run(SERVE + args, capture_output=True, text=True, timeout=limit)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert all(w in p.stderr for w in words), p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    return time.monotonic() - t0


def test_busy_port_found_before_loading(qwen3_tied):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        # --load-format would matter only if the model loaded: a huge KV request proves it never does
        _fails_fast([str(qwen3_tied), "--port", str(port), "--device", "cpu", "--num-kv-blocks", str(10 ** 12)],
                    ["cannot listen", str(port)])


def test_missing_model_and_hub_id():
    _fails_fast(["/no/such/checkpoint", "--port", str(free_port())], ["does not exist"])
    _fails_fast(["Qwen/Qwen3-0.6B", "--port", str(free_port())], ["hub id", "downloads are not supported"])


def test_unknown_parsers_are_named():
    _fails_fast(["--reasoning-parser", "nope", "--port", str(free_port())],
                ["unknown reasoning parser 'nope'", "qwen3", "think"])
    _fails_fast(["--tool-call-parser", "nope", "--port", str(free_port())], ["unknown tool-call parser", "hermes"])
    from xllm_gen.runtime.serving import reasoning_parsers, tool_parsers

    assert reasoning_parsers.get("qwen3") is reasoning_parsers.get("think")           # family alias -> format
    assert tool_parsers.get("qwen3") is tool_parsers.get("hermes")


@pytest.mark.slow                   # three server starts (~19 s); tests/test_chat.py checks the same at load, offline
def test_a_chat_template_that_does_not_compile_is_refused_at_start(qwen3_tied, tmp_path):
    """Every chat request would fail on it: the server does not start, naming the file and the line (the
    checkpoint's or --chat-template's, before the model loads); --chat-template replaces a broken checkpoint's."""
    import shutil

    _fails_fast(["--chat-template", "{% for m in messages %}{{ m }", "--port", str(free_port())],
                ["--chat-template does not compile: line 1: unexpected '}'"])
    ckpt = tmp_path / "ckpt"
    shutil.copytree(qwen3_tied, ckpt)
    (ckpt / "chat_template.jinja").write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    _fails_fast([str(ckpt), "--port", str(free_port())],
                [f"{ckpt / 'chat_template.jinja'}, line 2: unexpected '}}'", "--chat-template"])
    # with a template of its own it gets past the check (to the next refusal, found while reading config.json)
    _fails_fast([str(ckpt), "--port", str(free_port()), "--chat-template", "{{ messages }}", "--device", "cpu",
                 "--max-model-len", "100000"], ["max_model_len 100000 exceeds"])


def test_max_model_len_above_the_model_is_refused(qwen3_tied):
    _fails_fast([str(qwen3_tied), "--port", str(free_port()), "--device", "cpu", "--max-model-len", "100000"],
                ["max_model_len 100000 exceeds", "512"])


@pytest.mark.parametrize("module", ["xllm_gen.runtime.serving.server", "xllm_gen.runtime.cli", "xllm_gen.codegen.cli"])
def test_help_and_version_do_not_import_torch(module):
    for flag in ("--help", "--version"):
        p = subprocess.run([sys.executable, "-X", "importtime", "-m", module, flag], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0 and p.stdout.strip(), p.stderr[-2000:]
        mods = {line.split("|")[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time")}
        assert "torch" not in mods, flag


def test_dtype_choices_match_the_engine():
    from xllm_gen.runtime.engine.engine import _DTYPES
    from xllm_gen.runtime.serving.server import DTYPES

    assert set(DTYPES) == set(_DTYPES)


def test_local_media_refused_without_the_flag(tmp_path):
    from xllm_gen.runtime.serving.chat import _local_path
    from xllm_gen.runtime.serving.protocol import APIError

    real = tmp_path / "a.png"
    real.write_bytes(b"x")
    msgs = []
    for path, allowed in ((str(real), None), (str(tmp_path / "missing.png"), None),
                          (str(real), str(tmp_path / "sub")), (str(tmp_path / "missing.png"), str(tmp_path / "sub"))):
        with pytest.raises(APIError) as e:
            _local_path(path, "messages[0]", allowed)
        msgs.append(e.value.message)
        assert str(tmp_path) not in e.value.message
    assert msgs[0] == msgs[1] and msgs[2] == msgs[3]          # nothing tells whether the file exists
    (tmp_path / "sub").mkdir()
    assert _local_path(str(tmp_path / "sub" / "b.png"), "m", str(tmp_path / "sub")).endswith("b.png")
