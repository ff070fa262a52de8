"""OpenAI chat messages -> one engine prompt: the checkpoint's chat template (its processor's for multimodal
checkpoints) and the media of `image_url` / `video` content parts.

Images: `{"type": "image_url", "image_url": {"url": U}}` where U is a `data:image/...;base64,...` URL, a
`file://` URL or a local path. Videos: `{"type": "video", "video": [U, ...]}` (one URL or path per frame) or
`{"type": "video_url", "video_url": {"url": U}}` with U a local `.npy` file of uint8 frames (T, H, W, 3).
Remote (http/https) URLs are refused: the server has no network. Local paths and file:// URLs are refused
unless they resolve (symbolic links followed) under the server's --allowed-local-media-path; the error for a
path outside it is the same whether the file exists or not."""
from __future__ import annotations

import base64
import binascii
import io
import json
import os
from typing import Any, Optional
from urllib.parse import unquote, urlparse

from xllm_gen.runtime.engine.chat_template import message_problem, takes_content_parts, template_of
from xllm_gen.runtime.serving.protocol import APIError


def _local_path(path: str, where: str, allowed: Optional[str]) -> str:
    """`path` when it lies under `allowed` (the real paths compared); an APIError that says nothing about the
    file otherwise."""
    if not allowed:
        raise APIError(f"{where}: local file paths are refused; the server must be started with "
                       "--allowed-local-media-path DIR to read media under DIR", param="messages")
    real, root = os.path.realpath(path), os.path.realpath(allowed)
    try:
        inside = os.path.commonpath([real, root]) == root
    except ValueError:
        inside = False
    if not inside:
        raise APIError(f"{where}: local file paths are only read under --allowed-local-media-path", param="messages")
    return real


def _open_image(url: Any, where: str, allowed: Optional[str] = None):
    from PIL import Image

    if not isinstance(url, str) or not url:
        raise APIError(f"{where}: the image url must be a non-empty string", param="messages")
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        if ";base64" not in head:
            raise APIError(f"{where}: only base64 data: URLs are supported", param="messages")
        try:
            raw = base64.b64decode(data, validate=False)
        except (binascii.Error, ValueError) as e:
            raise APIError(f"{where}: bad base64 in the data: URL ({e})", param="messages") from None
        src: Any = io.BytesIO(raw)
    else:
        scheme = urlparse(url).scheme.lower()
        if scheme in ("http", "https", "ftp"):
            raise APIError(f"{where}: remote URLs are not supported (the server has no network access); "
                           "send the image as a data: URL (base64) or a local file path", param="messages")
        path = _local_path(unquote(urlparse(url).path) if scheme == "file" else url, where, allowed)
        if not os.path.isfile(path):
            raise APIError(f"{where}: no such local image file under --allowed-local-media-path", param="messages")
        src = path
    try:
        img = Image.open(src)
        img.load()
        return img.convert("RGB")
    except Exception as e:
        raise APIError(f"{where}: cannot read the image ({type(e).__name__}: {e})", param="messages") from None


def _open_video(part: dict, where: str, allowed: Optional[str] = None):
    import numpy as np

    if part.get("type") == "video":
        frames = part.get("video")
        if not isinstance(frames, list) or not frames:
            raise APIError(f"{where}: a video part is a list of frame URLs or paths", param="messages")
        return [np.asarray(_open_image(f, f"{where} frame {k}", allowed)) for k, f in enumerate(frames)]
    url = (part.get("video_url") or {}).get("url") if isinstance(part.get("video_url"), dict) else None
    if not isinstance(url, str):
        raise APIError(f"{where}: video_url needs {{'url': ...}}", param="messages")
    scheme = urlparse(url).scheme.lower()
    if scheme in ("http", "https", "ftp", "data"):
        raise APIError(f"{where}: video_url takes a local .npy file of uint8 frames (T, H, W, 3); remote and data "
                       "URLs are not supported", param="messages")
    path = _local_path(unquote(urlparse(url).path) if scheme == "file" else url, where, allowed)
    if not os.path.isfile(path):
        raise APIError(f"{where}: no such local video file under --allowed-local-media-path", param="messages")
    try:
        return np.load(path, allow_pickle=False)
    except Exception as e:
        raise APIError(f"{where}: cannot read the video ({type(e).__name__}: {e})", param="messages") from None


def _turn(msg, content) -> dict:
    """One message for the chat template: role and content, plus an assistant's tool_calls (arguments as a dict
    when they are JSON text, as Hugging Face templates expect), a tool result's tool_call_id and name."""
    turn: dict = {"role": msg.role, "content": content}
    if msg.tool_calls:
        calls = []
        for call in msg.tool_calls:
            call = dict(call)
            fn = call.get("function")
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    call["function"] = {**fn, "arguments": json.loads(fn["arguments"])}
                except ValueError:
                    pass
            calls.append(call)
        turn["tool_calls"] = calls
    for key in ("tool_call_id", "name", "reasoning_content"):
        if getattr(msg, key, None) is not None:
            turn[key] = getattr(msg, key)
    return turn


# content part kinds that hold text (vLLM's): the kind -> the key of its text
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def render_chat(engine, messages: list, chat_template: Optional[str] = None,
                add_generation_prompt: bool = True, tools: Optional[list] = None,
                template_kwargs: Optional[dict] = None, allowed_media: Optional[str] = None,
                continue_final_message: bool = False) -> dict:
    """The engine prompt dict ({"prompt": text[, "multi_modal_data": ...]}) of an OpenAI conversation.
    `tools` (OpenAI's list) and `template_kwargs` (e.g. enable_thinking) reach the chat template; a template
    that does not render the tools is refused (the model would never see them). `continue_final_message`
    (vLLM's): the last (assistant) message is left open, for the reply to continue it."""
    multimodal = engine.mm_processor is not None
    renderer = engine.mm_processor.processor if multimodal else engine.tokenizer
    if renderer is None:
        raise APIError("this model has no tokenizer, so chat is not available; use /v1/completions with token ids",
                       param="messages")
    media: dict[str, list] = {"image": [], "video": []}
    conv = []
    # a text model's template that loops over a message's parts gets them; another gets their text joined by
    # newlines (vLLM's "openai" and "string" content formats)
    as_parts = not multimodal and any(isinstance(msg.content, list) for msg in messages) and \
        takes_content_parts(template_of(renderer, chat_template, tools))
    for m, msg in enumerate(messages):
        content = msg.content
        problem = message_problem(f"messages[{m}]", {"role": msg.role, "content": content,
                                                     "tool_calls": msg.tool_calls})
        if problem:     # a null user / system / tool content (OpenAI's 400), an empty role, malformed tool_calls
            raise APIError(problem, param="messages")
        if content is None or isinstance(content, str):
            conv.append(_turn(msg, content or ""))
            continue
        parts = []
        for k, part in enumerate(content):
            where = f"messages[{m}].content[{k}]"
            kind = part.get("type")
            if kind in _TEXT_PARTS:           # vLLM's text kinds: the Responses API's names, an assistant's refusal
                key = _TEXT_PARTS[kind]
                if not isinstance(part.get(key), str):
                    raise APIError(f"{where}: a {kind!r} part needs {key!r} (a string)",
                                   param="messages")
                parts.append({"type": "text", "text": part[key]})
            elif kind in ("image_url", "image", "input_image"):
                if not multimodal:
                    raise APIError(f"{where}: this model takes no images", param="messages")
                ref = part.get("image_url", part.get("image"))
                url = ref.get("url") if isinstance(ref, dict) else ref
                media["image"].append(_open_image(url, where, allowed_media))
                parts.append({"type": "image", "image": media["image"][-1]})
            elif kind in ("video", "video_url"):
                if not multimodal:
                    raise APIError(f"{where}: this model takes no videos", param="messages")
                media["video"].append(_open_video(part, where, allowed_media))
                parts.append({"type": "video", "video": media["video"][-1]})
            else:
                raise APIError(f"{where}: unsupported content part type {kind!r}", param="messages")
        if not multimodal:
            conv.append(_turn(msg, parts if as_parts else "\n".join(p["text"] for p in parts)))
        else:
            conv.append(_turn(msg, parts))
    kwargs = dict(template_kwargs or {})
    if continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        text = renderer.apply_chat_template(conv, chat_template=chat_template, tokenize=False,
                                            add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        if tools and text == renderer.apply_chat_template(conv, chat_template=chat_template, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt, **kwargs):
            raise APIError("the chat template does not render tools, so the model cannot see them; serve with a "
                           "tool-aware --chat-template or pass chat_template", param="tools")
    except APIError:
        raise
    except Exception as e:
        raise APIError(f"cannot apply the chat template: {e}", param="messages") from None
    prompt: dict = {"prompt": text, "add_special_tokens": False}     # the template wrote them (vLLM's chat default)
    if media["image"] or media["video"]:
        prompt["multi_modal_data"] = {k: v for k, v in media.items() if v}
    return prompt
