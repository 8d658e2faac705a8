"""The router's guards (API key, body size, overload) on a plain FastAPI app, no Ray."""

import asyncio

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
