"""router/choices.py with scripted runs (no Ray): choice 0 alone until it is ready (its K/V
landed: it calls `ready`) or ended, the rest after; events merged; failures before the first
events raise from `start`, later ones from `events`; every choice still running is closed at the
end."""

import asyncio

import pytest

from router.choices import Choices
from router.orchestrator import RequestFailed
from serving.messages import TokenEvent


class Script:
    """A run yielding `n` events (the last finished), optionally failing after `fail_after`;
    ready (its `ready` called) after its event `ready_after` (None: never)."""

    def __init__(self, log: list, index: int, n: int = 3, fail_after: int | None = None, delay: float = 0.0,
                 ready_after: int | None = 0):
        self.log, self.index, self.n, self.fail_after, self.delay = log, index, n, fail_after, delay
        self.ready_after = ready_after

    async def __call__(self, ready):
        self.log.append(("start", self.index))
        try:
            for k in range(self.n):
                if self.fail_after is not None and k == self.fail_after:
                    raise RequestFailed(503, f"choice {self.index} failed")
                await asyncio.sleep(self.delay)
                self.log.append(("yield", self.index, k))
                yield TokenEvent(f"r{self.index}", (k,), f"{self.index}.{k} ", k == self.n - 1)
                if k == self.ready_after:
                    self.log.append(("ready", self.index))
                    ready()
        finally:
            self.log.append(("closed", self.index))


def test_choice_zero_first_then_the_rest_merged():
    async def main():
        log = []
        choices = Choices([[Script(log, i, n=3 + i) for i in range(3)]])
        firsts = await choices.start()
        assert [ev.text for ev in firsts] == ["0.0 ", "1.0 ", "2.0 "]
        assert log.index(("start", 1)) > log.index(("yield", 0, 0))   # choice 0's first token came first
        assert log.index(("start", 2)) > log.index(("yield", 0, 0))
        seen = {0: [], 1: [], 2: []}
        async for i, ev in choices.events():
            seen[i].append(ev.text)
        await choices.aclose()
        assert seen == {i: [f"{i}.{k} " for k in range(1, 3 + i)] for i in range(3)}
        assert sorted(e for e in log if e[0] == "closed") == [("closed", i) for i in range(3)]
    asyncio.run(main())


def test_a_failure_before_the_first_events_raises_from_start_and_closes_the_others():
    async def main():
        log = []
        choices = Choices([[Script(log, 0), Script(log, 1, n=1000, delay=0.01), Script(log, 2, fail_after=0)]])
        with pytest.raises(RequestFailed) as err:
            await choices.start()
        assert err.value.code == 503 and "choice 2" in err.value.message
        assert ("closed", 1) in log        # the long choice was cancelled, not left running
    asyncio.run(main())


def test_a_later_failure_raises_from_events_and_aclose_stops_the_rest():
    async def main():
        log = []
        choices = Choices([[Script(log, 0, n=1000, delay=0.01), Script(log, 1, fail_after=2)]])
        await choices.start()
        with pytest.raises(RequestFailed):
            async for _ in choices.events():
                pass
        await choices.aclose()
        assert ("closed", 0) in log and ("closed", 1) in log
    asyncio.run(main())


def test_the_others_wait_for_choice_zero_to_be_ready_or_to_end():
    """Its K/V landed in the decode replica after its third event: the others start then (their
    reservations share its blocks); a choice 0 that never says so releases them when it ends."""
    async def main(ready_after, n, after):
        log = []
        choices = Choices([[Script(log, 0, n=n, delay=0.01, ready_after=ready_after), Script(log, 1)]])
        await choices.start()
        assert log.index(("start", 1)) > log.index(after)
        async for _ in choices.events():
            pass
        await choices.aclose()
    asyncio.run(main(2, 6, ("ready", 0)))
    asyncio.run(main(None, 2, ("closed", 0)))


def test_an_unforeseen_exception_becomes_a_500_not_a_hang():
    async def broken(ready):
        raise ValueError("bug")
        yield  # noqa: unreachable - makes this an async generator

    async def main():
        choices = Choices([[broken]])
        with pytest.raises(RequestFailed) as err:
            await asyncio.wait_for(choices.start(), 5)
        assert err.value.code == 500 and "bug" in err.value.message
    asyncio.run(main())


def test_groups_start_their_leaders_at_once_and_followers_after_their_leader():
    async def main():
        log = []
        choices = Choices([[Script(log, 0, delay=0.05), Script(log, 1)], [Script(log, 2), Script(log, 3)]])
        firsts = await choices.start()
        assert [ev.request_id for ev in firsts] == ["r0", "r1", "r2", "r3"]
        assert log.index(("start", 2)) < log.index(("yield", 0, 0))      # both leaders at once
        assert log.index(("start", 1)) > log.index(("yield", 0, 0))      # followers after their leader
        assert log.index(("start", 3)) > log.index(("yield", 2, 0))
        n = 0
        async for _ in choices.events():
            n += 1
        await choices.aclose()
        assert n == 4 * 2
    asyncio.run(main())
