"""Property-based requests generated from the router's own OpenAPI schema (schemathesis), against
a running deployment with a tiny model: whatever the body, never a 5xx."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from ray import serve

from pdserve.app_builder import build_app
from pdserve.serve_config import AppConfig
from service_util import http, pools_all_free, wait_healthy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_app(ray_serve, tiny_llama_dir):
    cfg = AppConfig(mode="disaggregated", model=str(tiny_llama_dir), served_model_name="tiny", route_prefix="/st",
                    engine={"kv_cache_memory": "32MiB", "dtype": "float32", "device": "cpu", "num_threads": 1},
                    transfer={"host": "127.0.0.1"}, max_tokens_limit=8)
    serve.run(build_app(cfg), name="st", route_prefix="/st", blocking=False)
    base = ray_serve + "/st"
    wait_healthy(base)
    yield base
    serve.delete("st")


def test_no_server_errors(tiny_app):
    """Every operation of the schema, 25 generated requests each (schemathesis' strategies driven
    by hypothesis directly: its pytest plugin does not load under pytest 9)."""
    schema = schemathesis.openapi.from_url(tiny_app + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    failures = []
    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call(base_url=tiny_app, timeout=60)
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path} {case.body!r:.200}: {response.status_code}")
        check()
    assert not failures, failures[:5]


def test_nothing_leaked_after_fuzzing(tiny_app):
    assert http(tiny_app, "/health")[0] == 200
    assert pools_all_free(tiny_app, {"prefill", "decode"})
