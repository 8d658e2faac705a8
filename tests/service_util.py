"""Helpers for tests against a running service: deployment, HTTP calls and /metrics parsing."""

import contextlib
import json
import random
import re
import socket
import threading
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999) and above Ray's worker ports
    (10002-19999), for a server that binds it only after Ray has started its processes: a port
    `free_port` picks can be taken meanwhile by any of them binding port 0 (a session's Serve proxy
    once failed to bind so, and every test on the cluster errored)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


def running_replicas(app: str, deployment: str) -> int:
    """Replicas of `deployment` in Serve application `app` that Serve reports RUNNING.

    Each call is one `serve.status()`: ~30 ms of this process's CPU (and ~4 of the controller's).
    A wait polls it every STATUS_POLL_S or slower, and one call reads every pool (`running_by_pool`):
    two calls every 0.25 s took a quarter of a core from the replicas starting meanwhile."""
    return running_by_pool(app)[deployment]


STATUS_POLL_S = 0.5


def running_by_pool(app: str) -> dict[str, int]:
    """{deployment: RUNNING replicas} of Serve application `app`, from one `serve.status()`."""
    from ray import serve
    deployments = serve.status().applications[app].deployments
    return {name: d.replica_states.get("RUNNING", 0) for name, d in deployments.items()}


CORS_ORIGIN = "https://app.example"      # the `disagg` app (conftest.py) lets pages from here call it


def http(base: str, path: str, body=None, timeout=120, raw: bytes | None = None, headers=None,
         method: str | None = None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json",
                                                                   **(headers or {})}, method=method)
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


def ray_metrics_url() -> str:
    """This node's Ray metrics export URL (the driver's cluster); skips the calling test where no
    metrics agent answers."""
    import pytest
    import ray
    port = ray._private.worker.global_worker.node.metrics_export_port
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        urllib.request.urlopen(url, timeout=5).read()
    except OSError:
        pytest.skip(f"no metrics agent answers on port {port}")
    return url


def wait_healthy(base: str, timeout=300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if http(base, "/health", timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.25)
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
    exit. Dict-valued overrides (transfer, prefill, decode, ...) are merged into the defaults. Every
    prompt goes through the prefill pool and a KV hand-off (`routing.local_prefill_tokens` 0) unless
    the overrides say otherwise: the tests' short prompts would otherwise be prefilled in the decode
    replica (tests/test_local_prefill.py tests that)."""
    from ray import serve

    from pdserve.app_builder import build_app
    from serving.config import AppConfig
    fields = {"mode": "disaggregated", "model": str(model_dir), "served_model_name": served,
              "route_prefix": f"/{name}", "engine": engine, "transfer": {"host": "127.0.0.1"},
              "routing": {"local_prefill_tokens": 0}}
    for key, value in overrides.items():
        base_value = fields.get(key)
        fields[key] = {**base_value, **value} if isinstance(value, dict) and isinstance(base_value, dict) else value
    wait_until(lambda: name not in serve.status().applications, 60)     # a same-named app still going
    serve.run(build_app(AppConfig(**fields)), name=name, route_prefix=f"/{name}", blocking=False)
    try:
        base = f"{ray_serve}/{name}"
        wait_healthy(base)
        yield base
    finally:
        delete_app(name)


def delete_app(name: str) -> None:
    """Delete Serve application `name` without waiting for its replicas to stop: each waits Serve's
    graceful_shutdown_wait_loop_s (2 s) before it goes, ~3 s an app that the next test's deployment
    can overlap (the replicas reserve no CPUs: TINY_ENGINE and the service apps use num_cpus 0)."""
    from ray import serve
    serve.delete(name, _blocking=False)


def tiny_app(ray_serve: str, model_dir, name: str, **overrides):
    """`deployed_app` of the tiny model, served as "tiny"."""
    return deployed_app(ray_serve, name, model_dir, "tiny", TINY_ENGINE, **overrides)


@contextlib.contextmanager
def closed_loop_load(base: str, clients: int, max_tokens: int, model: str = "tiny"):
    """`clients` threads, each sending a completion of 200-400 random tokens as soon as its last one
    ended, until the block exits (then joined); yields the list of HTTP statuses, filled as they end."""
    statuses, stop = [], threading.Event()

    def client(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(200, 400))]
            statuses.append(http(base, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                          "ignore_eos": True, "temperature": 0})[0])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        yield statuses
    finally:
        stop.set()
        for t in threads:
            t.join()


def reaches(peak: dict[str, int], app: str, target: dict[str, int], timeout: float) -> bool:
    """Wait until each deployment of Serve application `app` has had `target[name]` RUNNING replicas;
    `peak` keeps the highest count seen per deployment (for the failure message)."""
    def done():
        running = running_by_pool(app)
        for name in peak:
            peak[name] = max(peak[name], running[name])
        return all(peak[name] >= n for name, n in target.items())
    return wait_until(done, timeout, every=STATUS_POLL_S)


def kill_replica(deployment: str, replica_id: str | None = None, app_name: str = "ft") -> str:
    """Kill a replica's process and return once it is gone (`ray.kill` only asks for it: a request
    sent right after it could otherwise still reach the replica and die with it mid-way)."""
    import os

    import ray
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if (name.startswith(f"SERVE_REPLICA::{app_name}#{deployment}#")
                and (replica_id is None or name.endswith(replica_id))):
            handle = ray.get_actor(name, namespace=actor["namespace"])
            pid = ray.get(handle.__ray_call__.remote(lambda _: os.getpid()))
            ray.kill(handle, no_restart=True)
            assert wait_until(lambda: not _running(pid), 30), f"{name} (pid {pid}) still runs after ray.kill"
            return name
    raise LookupError(f"no live replica of {deployment} {replica_id or ''}")


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
