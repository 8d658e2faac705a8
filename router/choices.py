"""The choices of one request (OpenAI's `n`, times the prompts of a batched completion), each
run as one request through the pools.

Choices come in groups, one per prompt, in index order (prompt p's choice j has index p*n + j).
Life cycle (the router's `_generate` drives it):
  1. start    the first choice of every group runs until its prompt's K/V is where the others
              find it (it calls its `ready`): disaggregated, landed in its decode replica (its
              prefill replica's prefix cache has held the full blocks since its first token), or
              at its first token where the decode replica prefilled it itself; colocated, at its
              first token. The group's other choices start then (or when the
              first one ended, whatever happened to it), and prefix affinity
              (router/prefix_affinity.py) sends them to those replicas: the prefill replica
              computes only the prompt's last, partial block for each, and the decode replica
              shares the prompt's full blocks with them, receiving only that last block (one copy
              of the prompt's K/V for the group, not n; the decode replica registers them when it
              admits choice 0, which it queues as it answers `Landed`, so before the others'
              reservations arrive, unless its structured-output grammar is still compiling:
              then they get their own copies). The first events of all choices are
              returned together, so any failure so far is still an HTTP status: `start` closes
              every choice and raises the first RequestFailed.
  2. events   the other events of all choices, merged as they come, tagged with their index;
              a choice that fails raises its RequestFailed here (the others are closed).
  3. aclose   always, at the end (finished, failed, client gone): every choice still running
              is cancelled, which aborts it in its replicas and frees its blocks.
A choice whose output is complete before its run ends (router/reply.py: its one tool call with
parallel_tool_calls false) is `stop`ped between 1 and 3: cancelled as aclose would, its events
after that never yielded.
Each choice is an async iterator of TokenEvents that raises only RequestFailed (the router's
`_timed` wraps the orchestrator's run), made by calling its `Run` with its `ready` callback (which
it may call any number of times); one task per choice pumps it into a queue.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from router.orchestrator import RequestFailed
from serving import messages

Run = Callable[[Callable[[], None]], AsyncIterator[messages.TokenEvent]]

_END = object()
_STOPPED = object()


class Choices:
    def __init__(self, groups: list[list[Run]]):
        assert groups and all(groups)
        self._runs = [run for group in groups for run in group]
        starts = [0]
        for group in groups[:-1]:
            starts.append(starts[-1] + len(group))
        self._leaders = starts
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: dict[int, asyncio.Task] = {}
        self._firsts: list[asyncio.Future] = []
        self._open = 0
        self._stopped: set[int] = set()

    async def start(self) -> list[messages.TokenEvent]:
        """1. The first event of every choice, in index order; raises RequestFailed."""
        async def group(leader: int, end: int) -> list[messages.TokenEvent]:
            ready = asyncio.get_running_loop().create_future()
            first, pump = await self._launch(leader, lambda: ready.done() or ready.set_result(None))
            if end > leader + 1:      # its K/V where the others find it, or it ended
                await asyncio.wait({ready, pump}, return_when=asyncio.FIRST_COMPLETED)
            others = await asyncio.gather(*(self._launch(i) for i in range(leader + 1, end)))
            return [first, *(event for event, _ in others)]

        ends = self._leaders[1:] + [len(self._runs)]
        starting = [asyncio.ensure_future(group(a, b)) for a, b in zip(self._leaders, ends)]
        try:
            groups = await asyncio.gather(*starting)
            return [event for firsts in groups for event in firsts]
        except BaseException:
            for task in starting:     # no group may launch a choice after this
                task.cancel()
            await asyncio.gather(*starting, return_exceptions=True)
            await self.aclose()
            raise

    async def _launch(self, index: int, ready: Callable[[], None] = lambda: None
                      ) -> tuple[messages.TokenEvent, asyncio.Task]:
        """Start choice `index`: its first event, and the task pumping the rest."""
        first: asyncio.Future = asyncio.get_running_loop().create_future()
        self._firsts.append(first)
        pump = asyncio.ensure_future(self._pump(index, first, ready))
        self._tasks[index] = pump
        self._open += 1
        return await first, pump

    async def _pump(self, index: int, first: asyncio.Future, ready: Callable[[], None]) -> None:
        events = self._runs[index](ready)
        try:
            async for event in events:
                if not first.done():
                    first.set_result(event)
                else:
                    await self._queue.put((index, event))
            if not first.done():
                first.set_exception(RequestFailed(500, "a choice ended without any event"))
        except Exception as exc:  # noqa: BLE001 - RequestFailed, or a bug: the request fails, the router stays up
            failure = exc if isinstance(exc, RequestFailed) else RequestFailed(500, f"internal error: {exc!r}")
            if not first.done():
                first.set_exception(failure)
            else:
                await self._queue.put((index, failure))
            return
        finally:
            await events.aclose()
        await self._queue.put((index, _END))

    async def events(self) -> AsyncIterator[tuple[int, messages.TokenEvent]]:
        """2. (index, event) for every event after the first ones, until every choice ended."""
        while self._open:
            index, item = await self._queue.get()
            if index in self._stopped and item is not _STOPPED:
                continue
            if item is _END or item is _STOPPED:
                self._open -= 1
            elif isinstance(item, RequestFailed):
                raise item
            else:
                yield index, item

    def stop(self, index: int) -> None:
        """End a started choice that needs no more events: it is cancelled (aborted in its
        replicas, its blocks freed; `aclose` waits for it) and `events` yields nothing more of it,
        nor its failure."""
        assert index in self._tasks and index not in self._stopped
        self._stopped.add(index)
        self._tasks[index].cancel()
        self._queue.put_nowait((index, _STOPPED))

    async def aclose(self) -> None:
        """3. Cancel whatever still runs and wait for it to wind down."""
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        for first in self._firsts:
            if not first.done():
                first.cancel()      # whoever still waits for it wakes up
            elif not first.cancelled():
                first.exception()   # retrieved: no "never retrieved" warning
