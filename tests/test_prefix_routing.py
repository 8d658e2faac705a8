"""Prefix-cache affinity end to end (tiny model): with two prefill replicas (or two colocated
ones), prompts that share a long prefix all go to the replica that computed it first, whose prefix
cache then serves the shared blocks. (Routing by load alone would split six such prompts over both
replicas in 31 of 32 cases.) With two decode replicas, such prompts, and the choices of one
prompt, go to the decode replica that received the prefix, which is not sent it again. The
disaggregated tests share one app of two replicas in each pool (each test counts from its start,
with prefixes of its own)."""

import json
import re

import pytest
from ray import serve

from serving.slo_autoscaling import CACHED, INPUT
from service_util import http, metrics, pools_all_free, tiny_app, wait_until

pytestmark = pytest.mark.slow


def _series(base: str, name: str, pool: str) -> dict[str, float]:
    return {r: v for (n, p, r), v in metrics(base).items() if n == name and p == pool}


@pytest.fixture(scope="module")
def two_each(ray_serve, tiny_llama_dir):
    """Two prefill and two decode replicas, shared by the disaggregated tests (each counts from its start)."""
    with tiny_app(ray_serve, tiny_llama_dir, "pa", prefill={"num_replicas": 2}, decode={"num_replicas": 2}) as base:
        yield base


@pytest.fixture(scope="module")
def two_colocated(ray_serve, tiny_llama_dir):
    with tiny_app(ray_serve, tiny_llama_dir, "pa-colocated", mode="colocated", colocated={"num_replicas": 2}) as base:
        yield base


def _since(base: str, before: dict, name: str, pool: str) -> dict[str, float]:
    """Each replica's `name` counted since the snapshot `before` (a `metrics` result)."""
    return {r: v - before.get((name, pool, r), 0) for r, v in _series(base, name, pool).items()}


def _decisions(base: str, pool: str) -> dict[str, float]:
    _, text = http(base, "/metrics")
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        rf'^pdserve_prefix_affinity_decisions_total{{pool="{pool}",decision="(\w+)"}} (\S+)$', text, re.M)}


@pytest.mark.parametrize("app,pool", [("two_each", "prefill"), ("two_colocated", "colocated")])
def test_shared_prefixes_stay_on_one_replica(request, ray_serve, app, pool):
    # (`ray_serve` named so that conftest's ordering sees a test on the session cluster)
    base, app_name = request.getfixturevalue(app), {"two_each": "pa", "two_colocated": "pa-colocated"}[app]
    pools = {"prefill", "decode"} if pool == "prefill" else {"colocated"}
    before, decided = metrics(base), _decisions(base, pool)
    shared = list(range(2100, 2260))                     # 10 blocks of 16 tokens
    for i in range(6):
        body = {"model": "tiny", "prompt": shared + [2300 + i] * 5, "max_tokens": 2, "temperature": 0}
        status, text = http(base, "/v1/completions", body)
        assert status == 200, text
    total = 6 * (len(shared) + 5)

    def queried() -> dict[str, float]:
        return _since(base, before, "pdserve_prefix_cache_query_tokens", pool)
    assert wait_until(lambda: len(queried()) == 2 and sum(queried().values()) == total, 30), queried()
    assert sorted(queried().values()) == [0, total]
    assert sum(_since(base, before, "pdserve_prefix_cache_hit_tokens", pool).values()) == 5 * len(shared)
    # the SLO policy's view: the router's window counts the cached prompt tokens as not prefilled (the
    # window holds this test's requests only: it runs first on its app)
    window = serve.get_deployment_handle("Router", app_name).record_autoscaling_stats.remote().result()
    assert window[CACHED] == pytest.approx(5 * len(shared) / 6) and window[INPUT] == len(shared) + 5
    decisions = {k: v - decided.get(k, 0) for k, v in _decisions(base, pool).items()}
    assert decisions.get("affinity", 0) >= 5 and decisions.get("no_match", 0) >= 1, decisions
    assert pools_all_free(base, pools)


def test_shared_prefixes_stay_on_one_decode_replica_which_is_not_sent_them_again(two_each):
    """Two decode replicas: the prompts after the first go to the decode replica that received the
    shared prefix, which reserves its cached blocks for it (`kv_blocks_reused`), so only each
    prompt's last block comes over the wire."""
    base = two_each
    assert pools_all_free(base, {"prefill", "decode"})
    before = metrics(base)
    _, text = http(base, "/metrics")
    affinity = _affinity_decisions(text)
    shared = list(range(100, 260))                       # 10 blocks of 16 tokens
    for i in range(6):
        body = {"model": "tiny", "prompt": shared + [300 + i] * 5, "max_tokens": 3, "temperature": 0,
                "ignore_eos": True}
        status, text = http(base, "/v1/completions", body)
        assert status == 200, text

    def landed() -> dict[str, float]:
        return _since(base, before, "pdserve_kv_transfers_landed", "decode")
    assert wait_until(lambda: sum(landed().values()) == 6, 30), landed()
    assert len(_series(base, "pdserve_kv_blocks_total", "decode")) == 2 and max(landed().values()) == 6
    assert sum(_since(base, before, "pdserve_kv_blocks_reused", "decode").values()) == 5 * 10

    def bytes_moved() -> tuple[float, float]:
        # each replica reports its counters on its own cadence, and the prefill counts a push
        # once its send returns, which can be after the decode side counted it landed
        return (sum(_since(base, before, "pdserve_kv_bytes_received", "decode").values()),
                sum(_since(base, before, "pdserve_kv_bytes_sent", "prefill").values()))
    assert wait_until(lambda: len(set(bytes_moved())) == 1, 30), bytes_moved()
    received, _ = bytes_moved()
    assert received > 0 and received % (11 + 5) == 0        # 11 blocks, then 1 a prompt
    _, text = http(base, "/metrics")
    assert _affinity_decisions(text) - affinity >= 5, text
    assert pools_all_free(base, {"prefill", "decode"})


def _affinity_decisions(metrics_text: str) -> float:
    m = re.search(r'^pdserve_prefix_affinity_decisions_total{pool="decode",decision="affinity"} (\S+)$',
                  metrics_text, re.M)
    return float(m.group(1)) if m else 0.0


def test_the_choices_of_one_prompt_share_its_blocks_in_one_decode_replica(two_each):
    """n = 4: the other choices start once choice 0's K/V landed (router/choices.py), follow it to
    its decode replica and reserve the prompt's full blocks there: one copy of the prompt's K/V for
    the four, each of the others receiving only the block with its last token."""
    base = two_each
    assert pools_all_free(base, {"prefill", "decode"})
    before = metrics(base)
    prompt = list(range(1100, 1260)) + [300] * 5           # 10 full blocks of 16 tokens, then 5
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "n": 4, "temperature": 1.0, "seed": 3,
            "ignore_eos": True}
    status, text = http(base, "/v1/completions", body)
    assert status == 200, text
    assert len(json.loads(text)["choices"]) == 4

    def landed() -> dict[str, float]:
        return _since(base, before, "pdserve_kv_transfers_landed", "decode")
    assert wait_until(lambda: sum(landed().values()) == 4, 30), landed()
    assert max(landed().values()) == 4
    assert sum(_since(base, before, "pdserve_kv_blocks_reused", "decode").values()) == 3 * 10
    assert pools_all_free(base, {"prefill", "decode"})
