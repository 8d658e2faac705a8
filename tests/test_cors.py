"""CORS in front of the guards on a plain FastAPI app, no Ray (over Serve: tests/test_service.py)."""

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from router.cors import Cors, CorsSettings
from router.guards import Guards, GuardSettings

PAGE = "https://app.example"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.fixture
def app_and_settings():
    guards, cors = GuardSettings(api_key="sekret"), CorsSettings()
    app = FastAPI()
    app.add_middleware(Guards, settings=guards)
    app.add_middleware(Cors, settings=cors)

    @app.post("/v1/echo")
    async def echo():
        return {"ok": True}

    return app, cors


def test_without_allowed_origins_no_cors_headers(app_and_settings):
    client = TestClient(app_and_settings[0])
    r = client.post("/v1/echo", headers={"Origin": PAGE, "Authorization": "Bearer sekret"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    assert "access-control-allow-origin" not in client.options("/v1/echo", headers=PREFLIGHT).headers


def test_a_preflight_is_answered_before_the_api_key_and_refusals_carry_the_header(app_and_settings):
    app, cors = app_and_settings
    cors.configure([PAGE], allow_credentials=False, max_age_s=60)
    client = TestClient(app)
    r = client.options("/v1/echo", headers=PREFLIGHT)      # no Authorization: browsers send none here
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert r.headers["access-control-max-age"] == "60"
    ok = client.post("/v1/echo", headers={"Origin": PAGE, "Authorization": "Bearer sekret"})
    assert ok.json() == {"ok": True} and ok.headers["access-control-allow-origin"] == PAGE
    refused = client.post("/v1/echo", headers={"Origin": PAGE})        # a guard's 401, readable by the page
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == PAGE
    other = client.options("/v1/echo", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert "access-control-allow-origin" not in client.post(
        "/v1/echo", headers={"Origin": "https://evil.example", "Authorization": "Bearer sekret"}).headers


def test_any_origin_and_reconfiguring(app_and_settings):
    app, cors = app_and_settings
    cors.configure(["*"], allow_credentials=False, max_age_s=600)
    client = TestClient(app)
    r = client.options("/v1/echo", headers={**PREFLIGHT, "Origin": "http://localhost:3000"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    cors.configure([], allow_credentials=False, max_age_s=600)           # off again
    assert "access-control-allow-origin" not in client.options("/v1/echo", headers=PREFLIGHT).headers
