"""An image chat on the tiny Qwen3-VL through the server: `image_url` parts as base64 data: URLs and local
paths give the tokens LLM.chat gives in-process; remote URLs and unreadable images are refused with 400."""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from serving_util import ENGINE_MODES, ServerProcess, mode_args

pytestmark = pytest.mark.engine

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module", params=ENGINE_MODES)
def vl_server(qwen3_vl_tied, media_dir, request):
    srv = ServerProcess(qwen3_vl_tied, "--block-size", "4", "--allowed-local-media-path", str(media_dir),
                        *mode_args(request.param))
    yield srv
    assert srv.stop() == 0


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_image_chat_matches_llm_chat(vl_server, qwen3_vl_tied, make_llm, tmp_path, media_dir):
    from PIL import Image

    from xllm_gen import SamplingParams

    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    path = media_dir / "img.png"
    path.write_bytes(_png(img))
    outside = tmp_path / "img.png"
    outside.write_bytes(_png(img))
    (media_dir / "link.png").unlink(missing_ok=True)       # media_dir is shared by both layouts' arms
    (media_dir / "link.png").symlink_to(outside)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = make_llm(qwen3_vl_tied).chat(
        [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "What is it?"}]}],
        sp)[0]
    n_prompt, want = len(want.prompt_token_ids), want.outputs[0]
    client = openai.OpenAI(base_url=vl_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    data_url = "data:image/png;base64," + base64.b64encode(_png(img)).decode()
    for url in (data_url, str(path), path.as_uri()):
        r = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=12, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "What is it?"}]}])
        assert r.choices[0].message.content == want.text
        assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == n_prompt
    for url, pattern in (("http://example.com/cat.png", "remote"), ("data:image/png;base64,AAAA", "cannot read"),
                         (str(media_dir / "missing.png"), "no such"),
                         # outside the allowed dir: one answer whether the file exists or not (also via a link)
                         (str(outside), "only read under"), (outside.as_uri(), "only read under"),
                         (str(tmp_path / "missing.png"), "only read under"), ("/etc/passwd", "only read under"),
                         (str(media_dir / ".." / outside.parent.name / "img.png"), "only read under"),
                         (str(media_dir / "link.png"), "only read under")):
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
        res = httpx.post(vl_server.url + "/v1/chat/completions", json=body, timeout=30)
        assert res.status_code == 400 and pattern in res.json()["error"]["message"], res.text
        assert str(tmp_path) not in res.text
    assert httpx.get(vl_server.url + "/health").status_code == 200
    vl_server.wait_idle()
