"""The response store's bookkeeping (router/response_store.py): least recently used first out past
either bound, replacing and deleting keep the byte count, and the input items' pages. Over HTTP in
tests/test_responses_service.py."""

import json

import pytest

from router.response_store import Found, ResponseLog, page
from serving.messages import StoredResponse


def stored(rid: str, size: int = 10) -> StoredResponse:
    return StoredResponse(rid, "r" * (size - 2), "[]")


def test_least_recently_used_go_first_past_the_count():
    log = ResponseLog(max_stored=3, max_bytes=10**6)
    for rid in "abc":
        assert log.put(stored(rid))
    assert log.get("a") is not None               # read: now the most recent
    assert log.put(stored("d"))
    assert log.get("b") is None and [r for r in "acd" if log.get(r)] == ["a", "c", "d"] and len(log) == 3


def test_bytes_are_bounded_and_counted_through_replace_and_delete():
    log = ResponseLog(max_stored=100, max_bytes=100)
    for i in range(5):
        log.put(stored(str(i), 30))
    assert len(log) == 3 and log.bytes == 90 and log.get("1") is None and log.get("2") is not None
    log.put(stored("3", 50))     # replaces 3: 2 (just read) + 4 + 3 = 110 > 100 drops 4, the least recently used
    assert log.get("4") is None and log.bytes == 80 and [len(log.get(r).response) for r in "23"] == [28, 48]
    assert log.delete("3") and not log.delete("3") and log.bytes == 30
    assert not log.put(stored("huge", 101)) and log.get("huge") is None and log.bytes == 30


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


def test_a_chain_starts_with_the_context_then_the_output():
    found = Found(json.dumps({"id": "resp_1", "output": [{"id": "msg_2", "type": "message"}]}), ITEMS[:2])
    assert [i["id"] for i in found.history()] == ["i0", "i1", "msg_2"]
