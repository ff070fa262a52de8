"""The app's outermost ASGI middleware: --api-key and the access log (app.py adds it)."""
from __future__ import annotations

import logging
import time

from fastapi.responses import JSONResponse

from xllm_gen.runtime.serving.protocol import APIError

access = logging.getLogger("xllm_gen.access")


class AuthAndLog:
    """--api-key: a Bearer token on /v1/* (401 in OpenAI's shape otherwise); one access line per request
    (method, path, status, latency to the last byte) unless --disable-log-requests. Pure ASGI: @app.middleware's
    wrapper keeps the client's http.disconnect from the endpoint, and a non-streaming request whose client had
    left ran to its end."""

    def __init__(self, app, api_key=None, log_requests: bool = True):
        self.app, self.api_key, self.log_requests = app, api_key, log_requests

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.monotonic()
        method, path = scope["method"], scope["path"]
        status, streaming = 500, False

        def log():
            if self.log_requests:
                access.info("%s %s %d %.1f ms%s", method, path, status, 1000 * (time.monotonic() - t0),
                            " (streaming)" if streaming else "")

        if self.api_key and path.startswith("/v1/") and method != "OPTIONS":
            import hmac

            from starlette.datastructures import Headers
            got = Headers(scope=scope).get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
                status = 401
                await JSONResponse(APIError("invalid or missing API key (Authorization: Bearer ...)", 401,
                                            type="authentication_error").body(), status_code=401)(
                    scope, receive, send)
                log()
                return

        async def send_(message):
            nonlocal status, streaming
            if message["type"] == "http.response.start":
                status = message["status"]
                streaming = any(k == b"content-type" and v.startswith(b"text/event-stream")
                                for k, v in message.get("headers", ()))
            await send(message)

        try:
            await self.app(scope, receive, send_)
        finally:
            log()

