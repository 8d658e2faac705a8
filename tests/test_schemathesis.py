"""Property-based requests generated from the router's own OpenAPI schema (schemathesis), against
a running deployment with a tiny model: whatever the body, never a 5xx."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from service_util import http, pools_all_free, tiny_app

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def app(ray_serve, tiny_llama_dir):
    with tiny_app(ray_serve, tiny_llama_dir, "st", max_tokens_limit=8) as base:
        yield base


def test_no_server_errors(app):
    """Every operation of the schema, 25 generated requests each (schemathesis' strategies driven
    by hypothesis directly: its pytest plugin does not load under pytest 9)."""
    schema = schemathesis.openapi.from_url(app + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    failures = []
    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call(base_url=app, timeout=60)
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path} {case.body!r:.200}: {response.status_code}")
        check()
    assert not failures, failures[:5]


def test_nothing_leaked_after_fuzzing(app):
    assert http(app, "/health")[0] == 200
    assert pools_all_free(app, {"prefill", "decode"})
