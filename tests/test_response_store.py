"""The response store (router/response_store.py): least recently used first out past either bound,
replacing and deleting keep the byte count, the input items' pages, and the router's side giving up
on a store that hangs or fails. Over HTTP in tests/test_responses_service.py."""

import asyncio
import json

import pytest

from router.response_store import Found, ResponseLog, StoredResponses, StoreUnavailable, page, unique_ids
from fake_store import FakeHandle, log_handle
from serving.messages import ResponseEventBatch, StoredResponse


def stored(rid: str, size: int = 10) -> StoredResponse:
    return StoredResponse(rid, "r" * (size - 2), "[]")


def test_least_recently_used_go_first_past_the_count():
    log = ResponseLog(max_stored=3, max_bytes=10**6)
    for rid in "abc":
        assert log.put(stored(rid))
    assert log.get("a") is not None               # read: now the most recent
    assert log.put(stored("d"))
    assert log.get("b") is None and [r for r in "acd" if log.get(r)] == ["a", "c", "d"] and len(log) == 3


def test_a_background_response_whose_owner_stopped_renewing_reads_as_failed():
    now = [0.0]
    log = ResponseLog(max_stored=10, max_bytes=10**6, lease_s=30, clock=lambda: now[0])
    running = json.dumps({"id": "resp_a", "status": "in_progress", "error": None, "background": True})
    assert log.put(StoredResponse("resp_a", running, "[]", owner="router-1"))        # renews router-1
    assert log.put(StoredResponse("resp_b", running.replace("_a", "_b"), "[]", owner="router-2"))
    assert log.put(stored("resp_c"))                  # no owner: never expires
    now[0] = 25.0
    log.renew("router-1")
    now[0] = 45.0                                      # router-1 renewed 20 s ago, router-2 last 45 s ago
    assert json.loads(log.get("resp_a").response)["status"] == "in_progress"
    failed = log.get("resp_b")
    body = json.loads(failed.response)
    assert body["status"] == "failed" and body["error"]["code"] == "server_error" and body["background"]
    assert "create the response again" in body["error"]["message"] and failed.owner == ""
    assert log.get("resp_b") == failed and log.get("resp_c") is not None     # stored failed: read again, the same
    now[0] = 1000.0
    assert json.loads(log.get("resp_a").response)["status"] == "failed"


def test_bytes_are_bounded_and_counted_through_replace_and_delete():
    log = ResponseLog(max_stored=100, max_bytes=100)
    for i in range(5):
        log.put(stored(str(i), 30))
    assert len(log) == 3 and log.bytes == 90 and log.get("1") is None and log.get("2") is not None
    log.put(stored("3", 50))     # replaces 3: 2 (just read) + 4 + 3 = 110 > 100 drops 4, the least recently used
    assert log.get("4") is None and log.bytes == 80 and [len(log.get(r).response) for r in "23"] == [28, 48]
    assert log.delete("3") and not log.delete("3") and log.bytes == 30
    assert not log.put(stored("huge", 101)) and log.get("huge") is None and log.bytes == 30


def test_a_streams_events_are_kept_in_order_with_its_response_and_paged(monkeypatch):
    log = ResponseLog(max_stored=100, max_bytes=200)
    running = StoredResponse("a", json.dumps({"status": "in_progress"}), "[]")
    assert not log.add_events(ResponseEventBatch("a", 0, ("e0",)))      # no such response
    assert log.put(running) and log.events("a", -1) is None              # not streamed (yet)
    assert log.add_events(ResponseEventBatch("a", 0, ("e0", "e1")))
    assert not log.add_events(ResponseEventBatch("a", 3, ("e3",)))       # a batch lost before it: refused
    assert log.add_events(ResponseEventBatch("a", 2, ("e2",))) and log.bytes == len(running.response) + 2 + 6
    monkeypatch.setattr("router.response_store.EVENT_PAGE_BYTES", 4)
    assert log.events("a", -1) == messages_page(("e0", "e1"), False)   # a page: then ask from e1 on
    assert log.events("a", 1) == messages_page(("e2",), False)
    assert log.events("a", 2) == messages_page((), False)
    assert log.put(running)                                               # saved again, running: events kept
    # the last events come with the response as it ended, kept in the same call
    done = json.dumps({"status": "completed"})
    assert log.add_events(ResponseEventBatch("a", 3, ("e3",), end=True, response=done, context="[1]"))
    assert log.get("a") == StoredResponse("a", done, "[1]")
    assert log.events("a", 0) == messages_page(("e1", "e2"), False)
    assert log.events("a", 2) == messages_page(("e3",), True)
    assert not log.add_events(ResponseEventBatch("a", 4, ("e4",)))       # ended: nothing after
    # a response saved as ended (cancelled, failed by its lease) ends its stream without a last event
    assert log.put(StoredResponse("b", json.dumps({"status": "in_progress"}), "[]"))
    assert log.add_events(ResponseEventBatch("b", 0, ("f0",)))
    cancelled = json.dumps({"status": "cancelled"})
    assert log.put(StoredResponse("b", cancelled, "[]")) and log.events("b", 0) == messages_page((), True, cancelled)
    assert not log.add_events(ResponseEventBatch("b", 1, (), end=True))
    # the events count in the bytes bound and go with their response: a's 26 + 8 bytes, b's 25 + 2 and
    # c's 145 are over 200 (without a's events a would stay)
    assert log.get("b") and log.bytes == 26 + 8 + 25 + 2
    big = StoredResponse("c", "y" * 143, "[]")
    assert log.put(big) and log.get("a") is None and log.events("a", -1) is None and log.get("b")
    assert log.bytes == 27 + 145


def messages_page(events, ended, response=""):
    from serving.messages import ResponseEventPage
    return ResponseEventPage(events, ended, response)


ITEMS = [{"id": f"i{k}", "type": "message"} for k in range(5)]


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_pages_walk_every_item_once_in_order(order):
    expect = ITEMS if order == "asc" else ITEMS[::-1]
    seen, after = [], None
    while True:
        p = page(ITEMS, 2, order, after)
        assert p["object"] == "list" and p["first_id"] == p["data"][0]["id"] and p["last_id"] == p["data"][-1]["id"]
        seen += p["data"]
        if not p["has_more"]:
            break
        after = p["last_id"]
    assert seen == expect
    assert page(ITEMS, 100, order, None)["data"] == expect and not page(ITEMS, 5, order, None)["has_more"]
    assert page(ITEMS, 2, order, "nope") == {"object": "list", "data": [], "first_id": None, "last_id": None,
                                             "has_more": False}


def test_an_item_sent_again_gets_a_new_id_so_pages_end():
    items = unique_ids([{"id": "msg_a"}, {"id": "fc_b"}, {"id": "msg_a"}, {"id": "fc_b"}, {"id": "msg_c"}])
    assert [i["id"] for i in items[:2] + items[4:]] == ["msg_a", "fc_b", "msg_c"]
    assert items[2]["id"].startswith("msg_") and items[3]["id"].startswith("fc_") and len({i["id"] for i in items}) == 5
    after, pages = None, 0
    while (p := page(items, 1, "asc", after))["has_more"]:
        after, pages = p["last_id"], pages + 1
    assert pages == 4


def test_a_chain_starts_with_the_context_then_the_output():
    found = Found(json.dumps({"id": "resp_1", "output": [{"id": "msg_2", "type": "message"}]}), json.dumps(ITEMS[:2]))
    assert [i["id"] for i in found.history()] == ["i0", "i1", "msg_2"]


def test_the_router_side_gives_up_on_a_store_that_does_not_answer():
    async def run():
        log = ResponseLog(10, 10**6)
        live = StoredResponses(log_handle(log))
        response = {"id": "resp_1", "output": [{"id": "msg_1", "type": "message"}], "store": True}
        assert await live.save(response, [{"id": "i0", "type": "message"}])
        found = await live.find("resp_1")
        assert json.loads(found.response) == response and [i["id"] for i in found.history()] == ["i0", "msg_1"]
        assert await live.find("resp_2") is None and await live.delete("resp_1") and not await live.delete("resp_1")
        hung = StoredResponses(FakeHandle(put="hang", get="hang", delete="hang"), timeout_s=0.05)
        assert not await hung.save(response, [])              # the answer goes out unstored
        with pytest.raises(StoreUnavailable, match="no answer in 0.05 s"):
            await hung.find("resp_1")
        broken = StoredResponses(FakeHandle(put=RuntimeError("replica died"), get=RuntimeError("replica died"),
                                         delete=RuntimeError("replica died")))
        assert not await broken.save(response, [])
        with pytest.raises(StoreUnavailable, match="replica died"):
            await broken.delete("resp_1")
    asyncio.run(run())
