"""Helpers for tests against a running service: deployment, HTTP calls and /metrics parsing."""

import contextlib
import json
import re
import socket
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(base: str, path: str, body=None, timeout=120, raw: bytes | None = None, headers=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json",
                                                                   **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metrics(base: str, headers=None) -> dict[tuple[str, str, str], float]:
    """{(metric, pool, replica): value} for per-replica series."""
    _, text = http(base, "/metrics", headers=headers)
    out = {}
    for m in re.finditer(r'^(\w+)\{pool="([^"]*)",replica="([^"]*)"\} (\S+)$', text, re.M):
        out[(m.group(1), m.group(2), m.group(3))] = float(m.group(4))
    return out


def pools_all_free(base: str, pools: set[str], timeout=30.0, headers=None) -> bool:
    """Wait until every replica of `pools` reports all KV blocks free."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(base, headers)
        totals = {(p, r): v for (n, p, r), v in m.items() if n == "pdserve_kv_blocks_total" and p in pools}
        free = {(p, r): v for (n, p, r), v in m.items() if n == "pdserve_kv_blocks_free" and p in pools}
        if totals and {p for p, _ in totals} == pools and all(free.get(k) == v for k, v in totals.items()):
            return True
        time.sleep(0.5)
    return False


def wait_healthy(base: str, timeout=300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if http(base, "/health", timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError("service not healthy")


def sse_events(text: str) -> list:
    events = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[6:]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def wait_until(pred, timeout: float, every: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every)
    return False


def _open_stream(base: str, path: str, body: dict, headers=None):
    import http.client
    host, _, rest = base.split("//", 1)[1].partition("/")
    hostname, port = host.split(":")
    conn = http.client.HTTPConnection(hostname, int(port), timeout=60)
    conn.request("POST", f"/{rest}{path}" if rest else path, json.dumps(body),
                 {"Content-Type": "application/json", **(headers or {})})
    return conn, conn.getresponse()


def leave_at_first_token(base: str, body: dict, headers=None, path: str = "/v1/completions") -> None:
    """Stream `body` and close the connection as soon as the first token's event arrives."""
    conn, resp = _open_stream(base, path, body, headers)
    assert resp.status == 200, resp.status
    for line in resp:
        if line.startswith(b"data: {"):
            break
    conn.close()


def stream_times(base: str, body: dict, headers=None, path: str = "/v1/completions") -> tuple[list[float], str]:
    """Stream `body` to the end: (arrival time of each event with a choice, the text)."""
    conn, resp = _open_stream(base, path, body, headers)
    assert resp.status == 200, resp.status
    times, text = [], ""
    for line in resp:
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            if event.get("choices"):
                times.append(time.monotonic())
                text += event["choices"][0].get("text") or ""
    conn.close()
    return times, text


TINY_ENGINE = {"kv_cache_memory": "32MiB", "dtype": "float32", "device": "cpu", "num_threads": 1}


@contextlib.contextmanager
def deployed_app(ray_serve: str, name: str, model_dir, served: str, engine: dict, **overrides):
    """A pdserve app (disaggregated unless `mode` says otherwise) at <ray_serve>/<name>, deleted on
    exit. Dict-valued overrides (transfer, prefill, decode, ...) are merged into the defaults."""
    from ray import serve

    from pdserve.app_builder import build_app
    from serving.config import AppConfig
    fields = {"mode": "disaggregated", "model": str(model_dir), "served_model_name": served,
              "route_prefix": f"/{name}", "engine": engine, "transfer": {"host": "127.0.0.1"}}
    for key, value in overrides.items():
        base_value = fields.get(key)
        fields[key] = {**base_value, **value} if isinstance(value, dict) and isinstance(base_value, dict) else value
    serve.run(build_app(AppConfig(**fields)), name=name, route_prefix=f"/{name}", blocking=False)
    try:
        base = f"{ray_serve}/{name}"
        wait_healthy(base)
        yield base
    finally:
        serve.delete(name)


def tiny_app(ray_serve: str, model_dir, name: str, **overrides):
    """`deployed_app` of the tiny model, served as "tiny"."""
    return deployed_app(ray_serve, name, model_dir, "tiny", TINY_ENGINE, **overrides)
