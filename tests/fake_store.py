"""Test helper: a stand-in for the ResponseStore deployment's handle (router/response_store.py),
answering as told, or from a real `ResponseLog` (`log_handle`)."""

from __future__ import annotations

import asyncio

from router.response_store import ResponseLog
from serving.messages import decode, encode


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
            return self.answer(*args) if callable(self.answer) else self.answer
        return call()


class FakeHandle:
    """A deployment handle's shape: `options(...)` and `method.remote(arg)` awaitable."""

    def __init__(self, **methods):
        self.__dict__.update({name: Method(answer) for name, answer in methods.items()})

    def options(self, **_):
        return self


def log_handle(log: ResponseLog) -> FakeHandle:
    """A handle whose store is `log` (what the ResponseStore deployment does with it)."""
    return FakeHandle(put=lambda data: log.put(decode(data)),
                      get=lambda rid: (lambda s: s and encode(s))(log.get(rid)), delete=log.delete, renew=log.renew)
