"""The router's guards (API key, body size, overload) on a plain FastAPI app, no Ray."""

import asyncio
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from router.guards import Guards, GuardSettings


@pytest.fixture
def app_and_settings():
    settings = GuardSettings(api_key="sekret", max_body_bytes=100, max_inflight=1)
    app = FastAPI()
    app.add_middleware(Guards, settings=settings)
    gate = {"event": None}

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.post("/v1/messages")
    @app.post("/v1/echo")
    async def echo(request: Request):
        body = await request.body()
        if gate["event"] is not None:
            await gate["event"].wait()
        return {"n": len(body)}

    return app, settings, gate


AUTH = {"Authorization": "Bearer sekret"}


def test_api_key_required_except_health(app_and_settings):
    client = TestClient(app_and_settings[0])
    assert client.get("/health").status_code == 200
    r = client.post("/v1/echo", content=b"x")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client.post("/v1/echo", content=b"x", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.post("/v1/echo", content=b"x", headers=AUTH).json() == {"n": 1}


def test_anthropic_clients_key_header_and_their_error_format(app_and_settings):
    client = TestClient(app_and_settings[0])
    assert client.post("/v1/echo", content=b"x", headers={"x-api-key": "sekret"}).json() == {"n": 1}
    assert client.post("/v1/echo", content=b"x", headers={"x-api-key": "wrong"}).status_code == 401
    r = client.post("/v1/messages", content=b"x", headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json() == {"type": "error", "error": {
        "type": "authentication_error", "message": r.json()["error"]["message"]}}
    r = client.post("/v1/messages", content=b"x" * 101, headers={"x-api-key": "sekret"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_no_key_configured_means_open(app_and_settings):
    app, settings, _ = app_and_settings
    settings.configure("", 100, 10)
    assert TestClient(app).post("/v1/echo", content=b"abc").json() == {"n": 3}


def test_oversized_body_is_413(app_and_settings):
    client = TestClient(app_and_settings[0])
    r = client.post("/v1/echo", content=b"x" * 101, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks():                      # no content-length: counted while streaming
        for _ in range(5):
            yield b"y" * 40
    r = client.post("/v1/echo", content=chunks(), headers=AUTH)
    assert r.status_code == 413
    assert client.post("/v1/echo", content=b"x" * 100, headers=AUTH).status_code == 200


def test_overload_is_429_with_retry_after(app_and_settings):
    app, settings, gate = app_and_settings
    import httpx

    async def scenario():
        gate["event"] = asyncio.Event()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            first = asyncio.create_task(client.post("/v1/echo", content=b"a", headers=AUTH))
            await asyncio.sleep(0.1)
            second = await client.post("/v1/echo", content=b"b", headers=AUTH)
            gate["event"].set()
            return (await first), second

    first, second = asyncio.run(scenario())
    assert first.status_code == 200
    assert second.status_code == 429 and second.headers["retry-after"] == "1"
    assert second.json()["error"]["type"] == "overloaded"


async def _reader_app(scope, receive, send):
    """An app that reads the whole body, then answers 200."""
    while (await receive()).get("more_body", False):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def _drive(settings, headers, chunks, ends=True, auth=True):
    """One request through Guards (before `_reader_app`) with a receive that hands out `chunks`
    (the last without more_body when `ends`; else more_body throughout, then nothing: a client that
    never finishes); returns (status, chunks read, seconds taken)."""
    read, sent = [], []

    async def receive():
        if len(read) == len(chunks):
            await asyncio.sleep(3600)          # nothing more comes: only a timeout ends this
        read.append(chunks[len(read)])
        return {"type": "http.request", "body": read[-1], "more_body": not ends or len(read) < len(chunks)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/echo",
             "headers": [*([(b"authorization", b"Bearer sekret")] if auth else []), *headers]}
    t0 = time.perf_counter()
    asyncio.run(Guards(_reader_app, settings)(scope, receive, send))
    return sent[0]["status"], len(read), time.perf_counter() - t0


def test_a_refused_body_is_read_to_its_end_before_the_refusal(app_and_settings):
    """RFC 9112's lingering close: a client still sending a refused body gets the error, not a reset
    connection (seen under load with a 5 MiB body: a broken pipe instead of the 413). The refusal
    comes after the whole body, at most LINGER_S late."""
    settings = app_and_settings[1]
    body = [b"x" * 60] * 4                                             # 240 bytes > 100
    declared = [(b"content-length", b"240")]
    assert _drive(settings, declared, body)[:2] == (413, 4)            # every chunk read, then the 413
    assert _drive(settings, [], body)[:2] == (413, 4)                  # streamed: over at chunk 2, read to 4
    status, read, took = _drive(settings, [], [b"x" * 150])            # over in the last chunk: no wait
    assert (status, read) == (413, 1) and took < 1
    assert _drive(settings, [], [b"x" * 50, b"x" * 50])[:2] == (200, 2)  # at the limit: served
    assert _drive(settings, [], [b"x" * 50, b"x" * 50], auth=False)[:2] == (401, 2)
    settings.configure("sekret", 100, 0)                                # overloaded: 429, body read too
    assert _drive(settings, [(b"content-length", b"60")], [b"x" * 60])[:2] == (429, 1)


def test_a_body_that_never_ends_delays_the_refusal_by_linger_s_at_most(app_and_settings, monkeypatch):
    import router.guards as guards_module
    monkeypatch.setattr(guards_module._discard_body, "__defaults__", (0.3,))    # LINGER_S, shortened
    status, read, took = _drive(app_and_settings[1], [(b"content-length", b"10000")], [b"x" * 60] * 3, ends=False)
    assert (status, read) == (413, 3) and 0.25 < took < 2
