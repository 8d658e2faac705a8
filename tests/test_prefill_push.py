"""The prefill replica's push (prefill_service/server.py `_push`), its engine and sender stood in
for: it sends the held blocks less the `skip` leading ones the decode replica holds, refuses a
`skip` that would leave nothing (the last block carries the hand-off) without sending, and
releases the request's blocks on every path."""

import asyncio
import concurrent.futures

import pytest

from kv_transfer import TransferResult
from prefill_service.server import PrefillServer
from serving import messages

HELD = [7, 3, 9, 4]


class Engine:
    def __init__(self):
        self.released = []

    def held_blocks(self, rid):
        return list(HELD)

    def release(self, rid):
        self.released.append(rid)


class AsyncEngine:
    def __init__(self, engine):
        self.engine = engine

    async def call(self, fn):
        return fn(self.engine)

    def submit(self, fn):
        fn(self.engine)


class Host:
    def __init__(self):
        self.engine = Engine()
        self.aengine = AsyncEngine(self.engine)
        self.counters = {}

    def count(self, name, amount=1):
        self.counters[name] = self.counters.get(name, 0) + amount

    def observe(self, key, value):
        pass


class Sender:
    def __init__(self, fail=False):
        self.sent, self.fail = [], fail

    def send(self, address, rid, blocks, meta):
        self.sent.append(list(blocks))
        if self.fail:
            return TransferResult.failure(rid, "peer gone")
        return TransferResult(rid, True, nbytes=100 * len(blocks), seconds=0.01)

    def cancel(self, rid):
        pass


def push(skip: int, fail: bool = False):
    server = object.__new__(PrefillServer.func_or_class)
    server.host, server.sender, server._abandoned = Host(), Sender(fail), set()
    server._send_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    handoff = messages.KVHandoff(first_token=5)
    try:
        res = asyncio.run(server._push("addr", "r", handoff, skip))
    finally:
        server._send_pool.shutdown()
    return res, server


@pytest.mark.parametrize("skip", [0, 1, 3])
def test_the_blocks_after_skip_are_sent_and_all_are_released(skip):
    res, server = push(skip)
    assert res.ok and server.sender.sent == [HELD[skip:]]
    assert server.host.counters == {"kv_transfers_sent": 1, "kv_bytes_sent": 100 * (len(HELD) - skip)}
    assert server.host.engine.released == ["r"]


@pytest.mark.parametrize("skip", [4, 9, -1])
def test_a_skip_leaving_no_block_is_a_failed_push_that_sends_nothing_and_still_releases(skip):
    res, server = push(skip)
    assert not res.ok and "out of range" in res.error
    assert server.sender.sent == [] and server.host.counters == {"kv_transfers_failed": 1}
    assert server.host.engine.released == ["r"]


def test_a_failed_send_still_releases():
    res, server = push(1, fail=True)
    assert not res.ok and server.sender.sent == [HELD[1:]]
    assert server.host.counters == {"kv_transfers_failed": 1} and server.host.engine.released == ["r"]
