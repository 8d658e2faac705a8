"""ASGI middleware in front of the router's FastAPI app: authentication, body size, overload.

Order for each HTTP request:
  1. authenticate  when an API key is configured, every path but /health needs
                   `Authorization: Bearer <key>` or (Anthropic's clients) `x-api-key: <key>`
                   (401 otherwise)
  2. admit         more than `max_inflight` requests in flight -> 429 with Retry-After
  3. bound the body a declared or streamed body above `max_body_bytes` -> 413
All refusals are OpenAI-format JSON errors (Anthropic's on its Messages API's routes); nothing
reaches the pools. Before a refusal goes out, the rest of the request's body is read and dropped
for up to LINGER_S: a client still sending would otherwise meet a closed connection (a broken pipe
or a reset) instead of the error, as a 5 MiB body did under load (RFC 9112 9.6's lingering close;
nginx drops a refused body too). Even a client that sent `Expect: 100-continue` sends its body:
Serve's proxy answers "100 Continue" before the router sees the request.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from router.messages_output import anthropic_path, error_object

OPEN_PATHS = ("/health",)
LINGER_S = 5.0


async def _discard_body(receive, seconds: float = LINGER_S) -> None:
    """Read and drop the rest of a request's body, for at most `seconds`."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while (left := end - loop.time()) > 0:
        try:
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return
        if message.get("type") != "http.request" or not message.get("more_body", False):
            return


async def _send_error(send, path: str, status: int, message: str, kind: str, code: str, headers=()) -> None:
    error = (error_object(status, message) if anthropic_path(path)
             else {"error": {"message": message, "type": kind, "param": None, "code": code}})
    body = json.dumps(error).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


async def _refuse(receive, send, path: str, status: int, message: str, kind: str, code: str, headers=(),
                  body_pending: bool = True) -> None:
    """The refusal of a request to `path`, after the body still on its way (`body_pending`) has
    been read and dropped."""
    if body_pending:
        await _discard_body(receive)
    await _send_error(send, path, status, message, kind, code, headers)


class _BodyTooLarge(Exception):
    pass


class GuardSettings:
    """Filled by the Router replica at start; read on every request."""

    def __init__(self, api_key: str = "", max_body_bytes: int = 4 * 2**20, max_inflight: int = 1024):
        self.configure(api_key, max_body_bytes, max_inflight)

    def configure(self, api_key: str, max_body_bytes: int, max_inflight: int) -> None:
        self.api_key, self.max_body_bytes, self.max_inflight = api_key.encode(), max_body_bytes, max_inflight


class Guards:
    def __init__(self, app, settings: GuardSettings):
        self.app = app
        self.settings = settings
        self.inflight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        # 1. authenticate
        if self.settings.api_key and not any(path.endswith(p) for p in OPEN_PATHS) and not self._authorized(scope):
            return await _refuse(receive, send, path, 401, "missing or invalid API key (use 'Authorization: "
                                 "Bearer <key>' or 'x-api-key: <key>')", "invalid_request_error", "invalid_api_key")
        # 2. admit
        if self.inflight >= self.settings.max_inflight:
            return await _refuse(receive, send, path, 429, f"server overloaded: {self.inflight} requests in flight; "
                                 "retry later", "overloaded", "rate_limit_exceeded", [(b"retry-after", b"1")])
        # 3. bound the body
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.settings.max_body_bytes:
            return await _refuse(receive, send, path, 413, f"request body above {self.settings.max_body_bytes} bytes",
                                 "invalid_request_error", "body_too_large")
        received = 0
        started = more = False

        async def bounded_receive():
            nonlocal received, more
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                more = message.get("more_body", False)
                if received > self.settings.max_body_bytes:
                    raise _BodyTooLarge()
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        self.inflight += 1
        try:
            await self.app(scope, bounded_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _refuse(receive, send, path, 413, f"request body above {self.settings.max_body_bytes} bytes",
                              "invalid_request_error", "body_too_large", body_pending=more)
        finally:
            self.inflight -= 1

    def _authorized(self, scope) -> bool:
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.settings.api_key):
            return True
        return hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.settings.api_key)
