"""Helpers for tests against a running service: HTTP calls and /metrics parsing."""

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
