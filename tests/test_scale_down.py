"""A prefill replica removed while hand-offs run (issue 14, item 5): the app is redeployed from
2 prefill replicas to 1 under a steady stream of requests (the changed configuration makes Serve
replace the decode replica too, gracefully: a harder case). Each prefill call lasts until its KV push
ends, so Serve's graceful shutdown of the removed replica waits for its pushes: no request
fails, every greedy output equals the one the same prompt gets alone afterwards, and both
pools end with every block free. Local Ray cluster, tiny model."""

import random
import threading

import pytest
from ray import serve

from service_util import STATUS_POLL_S, TINY_ENGINE, http, pools_all_free, tiny_app, wait_until

pytestmark = pytest.mark.slow
PROMPTS = [[random.Random(i).randrange(100, 40000) for _ in range(60 + 7 * i)] for i in range(8)]


def complete(base: str, prompt: list[int]) -> tuple[int, str]:
    status, text = http(base, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 6,
                                                  "temperature": 0, "ignore_eos": True})
    return status, text


def text_of(answer: str) -> str:
    import json
    return json.loads(answer)["choices"][0]["text"]


def test_prefill_scale_down_in_the_middle_of_hand_offs(ray_serve, tiny_llama_dir):
    from pdserve.app_builder import build_app
    from serving.config import AppConfig

    with tiny_app(ray_serve, tiny_llama_dir, "sd", prefill={"num_replicas": 2}) as base:
        results, stop = [], threading.Event()

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                i = rng.randrange(len(PROMPTS))
                status, answer = complete(base, PROMPTS[i])
                results.append((i, status, answer))

        threads = [threading.Thread(target=client, args=(s,), daemon=True) for s in range(4)]
        for t in threads:
            t.start()
        assert wait_until(lambda: len(results) >= 8, 60)
        cfg = AppConfig(mode="disaggregated", model=str(tiny_llama_dir), served_model_name="tiny",
                        route_prefix="/sd", engine=TINY_ENGINE, transfer={"host": "127.0.0.1"},
                        prefill={"num_replicas": 1})
        serve.run(build_app(cfg), name="sd", route_prefix="/sd", blocking=False)   # one prefill replica goes
        def one_prefill_replica() -> bool:
            app = serve.status().applications["sd"]
            return app.deployments["PrefillServer"].replica_states == {"RUNNING": 1} and app.status == "RUNNING"
        assert wait_until(one_prefill_replica, 180, every=STATUS_POLL_S)
        done_before = len(results)
        assert wait_until(lambda: len(results) >= done_before + 8, 60)   # and service goes on
        stop.set()
        for t in threads:
            t.join(60)
        failed = [(i, s, a[:200]) for i, s, a in results if s != 200]
        assert not failed, failed
        expected = {i: text_of(complete(base, prompt)[1]) for i, prompt in enumerate(PROMPTS)}
        assert all(text_of(a) == expected[i] for i, _, a in results)
        assert pools_all_free(base, {"prefill", "decode"}, timeout=30)
