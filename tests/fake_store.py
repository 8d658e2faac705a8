"""Test helper: a stand-in for the ResponseStore deployment's handle (router/response_store.py),
answering as told, or the store's own calls over a real `ResponseLog` (`log_handle`)."""

from __future__ import annotations

import asyncio
import inspect
import weakref

from router.response_store import ResponseKeeper, ResponseLog


class Method:
    """`handle.method.remote(arg)`: awaitable; `answer` a value, a function of the argument, an
    exception to raise, or "hang"."""

    def __init__(self, answer):
        self.answer = answer

    def remote(self, *args):
        async def call():
            if self.answer == "hang":
                await asyncio.Event().wait()
            if isinstance(self.answer, Exception):
                raise self.answer
            answer = self.answer(*args) if callable(self.answer) else self.answer
            return await answer if inspect.isawaitable(answer) else answer
        return call()


class FakeHandle:
    """A deployment handle's shape: `options(...)` and `method.remote(arg)` awaitable."""

    def __init__(self, **methods):
        self.__dict__.update({name: Method(answer) for name, answer in methods.items()})

    def options(self, **_):
        return self


_KEEPERS: "weakref.WeakKeyDictionary[ResponseLog, ResponseKeeper]" = weakref.WeakKeyDictionary()


def log_handle(log: ResponseLog) -> FakeHandle:
    """A handle whose store is `log`, called as the ResponseStore deployment calls it (Serve aside):
    one store per log, whichever router's handle calls it."""
    keeper = _KEEPERS.setdefault(log, ResponseKeeper(log))
    return FakeHandle(**{name: getattr(keeper, name) for name in
                         ("put", "get", "delete", "renew", "add_events", "events", "runtime_loras",
                          "keep_runtime_loras")})
