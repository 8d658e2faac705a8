"""An `LLMEngine` on its own thread, driven from asyncio.

Contract
  * The engine is built on the engine thread: `make_engine` runs there first, and the
    constructor waits for it (raising its error). So every torch op of the engine (loading,
    packing, steps, KV export and import) runs on one thread, and OpenMP keeps one pool of
    worker threads in the process. A second pool (from an engine built on the caller's thread)
    makes libgomp count more threads than CPUs, after which its workers stop spinning between
    parallel regions and a step of 2+ threads pays a futex wake-up per region: a served decode
    replica with 2 threads took 26-27 ms a token against 12 ms a step in a plain loop.
  * Every engine call runs on the engine thread: `submit` queues a function of the engine
    and returns a concurrent Future; `call` is its awaitable form.
  * `stream(request_id, admit)` runs `admit(engine)` in one engine call, which checks and adds
    the request and returns a first output, None, or a `Rejected` (then the stream yields that
    one value and ends: nothing was admitted, nothing to abort). An admitted request's output
    queue is registered on the engine thread right after `admit`, before any step can produce
    an output; the stream yields the outputs until the request finishes, outputs that are ready
    together (the reader fell behind the engine) merged into one (`RequestOutput.merge`): one
    message for the replica to send instead of one per step. With `min_interval_s` the stream
    sends at most one message per interval: outputs that come sooner after the last message wait
    and go as one with what follows, except the first (TTFT) and a finishing one, which go at
    once; with `hold_first` the first waits like the others (a decode replica's first output only
    repeats the token the prefill replica already sent). Every hop after the engine (Ray's stream
    to the router, the router, Serve's proxy) costs CPU per message, not per token. Leaving the
    iterator early (client gone, task cancelled) aborts the request, which frees its blocks.
  * If a step raises, every request the step could have touched (queued or running) gets the
    error and is aborted; the loop goes on. Requests held for export (prefill role, finished,
    blocks under a running KV push) are left alone: their blocks stay held until `release`,
    so a failed step never frees blocks a send thread is still reading.
  * With a `share` (serving.cpu_share: the machine's idle replicas lend their CPU threads) the
    engine thread calls `share.busy()` before each step and steps with the threads it returns,
    and `share.idle()` whenever it has no work; the engine starts on its own configured threads.
  * `prepare(params)` compiles a structured-output request's grammar and reads a LoRA adapter
    loaded at run time on a worker thread (`LLMEngine.prepare`), before the request's `stream`:
    the engine thread then copies the compiled matcher and places the adapter's tensors instead
    of compiling and reading while every running request waits.
  * `health()` says why the engine can no longer serve ('' while it can): its thread is dead or
    stopped, or its last MAX_STEP_FAILURES steps in a row all raised.
The loop: 1. run queued calls, 2. step if there is work (on the threads `share` allows), 3. hand
outputs to their streams, 4. sleep until a call arrives when idle (lending the threads).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import AsyncIterator, Callable, Protocol

from engine.llm_engine import LLMEngine
from engine.outputs import Rejected, RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


MAX_STEP_FAILURES = 3   # failed steps in a row (no successful one between) that make it unhealthy
_SEND = object()        # a paced stream's timer: its held outputs are due


class EngineDeadError(RuntimeError):
    pass


class ThreadShare(Protocol):
    """CPU threads shared with other engines on the machine (serving.cpu_share.CpuShare)."""

    def busy(self) -> int: ...

    def idle(self) -> None: ...


class AsyncEngine:
    engine: LLMEngine                  # set by the engine thread once built, before the constructor returns

    def __init__(self, make_engine: Callable[[], LLMEngine], share: ThreadShare | None = None):
        self._share = share
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = threading.Event()
        self._step_failures = 0    # consecutive failed steps; written by the engine thread only
        self._prepare_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-prepare")
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(make_engine, built), name="pdserve-engine",
                                        daemon=True)
        self._thread.start()
        built.result()                 # the build's error, raised here; `self.engine` is set

    # ---- calls ----------------------------------------------------------------------------------
    def submit(self, fn: Callable[[LLMEngine], object]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopped.is_set():
            fut.set_exception(EngineDeadError("the engine is shut down"))
            return fut
        self._calls.put((fn, fut))
        return fut

    async def call(self, fn: Callable[[LLMEngine], object]):
        return await asyncio.wrap_future(self.submit(fn))

    async def prepare(self, params: SamplingParams) -> None:
        """Compile `params`' grammar and read its LoRA adapter, if any, off the engine thread (a
        failure is left for the request's admission to report). Parameters with nothing left to
        prepare are not queued behind others'."""
        if not self.engine.needs_prepare(params):
            return
        try:
            await asyncio.wrap_future(self._prepare_pool.submit(self.engine.prepare, params))
        except Exception:  # noqa: BLE001 - admission does it again and reports it
            log.exception("preparing a request ahead failed")

    async def stream(self, request_id: str, admit: Callable[[LLMEngine], RequestOutput | Rejected | None],
                     min_interval_s: float = 0.0, hold_first: bool = False
                     ) -> AsyncIterator[RequestOutput | Rejected]:
        entry = (asyncio.get_running_loop(), asyncio.Queue())
        loop, q = entry

        def admit_and_register(engine: LLMEngine):
            result = admit(engine)
            if not isinstance(result, Rejected):
                self._streams[request_id] = entry
            return result

        def end(engine: LLMEngine) -> None:
            # queued after `admit_and_register`, so it sees whether this stream admitted the request
            if self._streams.get(request_id) is entry:
                del self._streams[request_id]
                engine.abort(request_id)

        finished = False
        timer: asyncio.TimerHandle | None = None   # puts _SEND in `q` when held outputs are due
        try:
            # shielded: once submitted, `admit` runs even if we are cancelled, and the abort
            # queued by `finally` runs after it, so nothing it allocated is stranded
            first = await asyncio.shield(asyncio.wrap_future(self.submit(admit_and_register)))
            if isinstance(first, Rejected):
                finished = True
                yield first
                return
            if first is not None:
                q.put_nowait(first)
            held: RequestOutput | None = None    # outputs not sent yet, merged
            # loop time before which `held` waits for more
            send_at = loop.time() + min_interval_s if hold_first else 0.0
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    if held is not None:                       # what came before the failure
                        out, held = held, None
                        yield out
                    finished = True
                    raise item
                due = item is _SEND
                if due:
                    timer = None
                    if held is None:                           # sent already (a cancel came late)
                        continue
                else:
                    held = item if held is None else held.merge(item)
                while not held.finished and not q.empty():    # fell behind: what is ready, as one
                    later = q.get_nowait()
                    if later is _SEND:
                        timer, due = None, True
                    elif isinstance(later, BaseException):
                        q.put_nowait(later)                    # the engine's last word: it stays last
                        break
                    else:
                        held = held.merge(later)
                if not (due or held.finished or loop.time() >= send_at):
                    if timer is None:                          # too soon after the last message
                        timer = loop.call_at(send_at, q.put_nowait, _SEND)
                    continue
                if timer is not None:
                    timer.cancel()
                    timer = None
                out, held, finished = held, None, held.finished
                yield out
                if finished:
                    return
                send_at = loop.time() + min_interval_s
        finally:
            if timer is not None:
                timer.cancel()
            if not finished:
                self.submit(end)
            elif self._streams.get(request_id) is entry:
                del self._streams[request_id]

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def health(self) -> str:
        """'' while the engine can step; else why not (for a replica's health check)."""
        if not self.alive():
            return "the engine thread is dead or stopped"
        if self._step_failures >= MAX_STEP_FAILURES:
            return f"the engine's last {self._step_failures} steps all failed"
        return ""

    def shutdown(self) -> None:
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)
        self._stopped.set()
        self._calls.put((None, None))
        self._thread.join(timeout=10)

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self, make_engine: Callable[[], LLMEngine], built: concurrent.futures.Future) -> None:
        try:
            engine = make_engine()
        except BaseException as exc:  # noqa: BLE001 - raised again by the constructor
            self._stopped.set()
            built.set_exception(exc)
            return
        self.engine = engine
        built.set_result(None)
        self._loop()

    def _loop(self) -> None:
        threads = self.engine.num_threads()
        while not self._stopped.is_set():
            idle = not self.engine.has_work()
            if idle and self._share is not None:
                self._share.idle()
            self._run_calls(block=idle)
            if self._stopped.is_set() or not self.engine.has_work():
                continue
            if self._share is not None and (wanted := self._share.busy()) != threads:
                threads = self.engine.set_num_threads(wanted)
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - reported to every stream, then recovered
                self._step_failures += 1
                log.exception("engine step failed (%d in a row); aborting its requests", self._step_failures)
                self._fail_all(exc)
                continue
            self._step_failures = 0
            self._deliver([(out.request_id, out) for out in outputs])

    def _run_calls(self, block: bool) -> None:
        try:
            item = self._calls.get(timeout=0.5) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, fut = item
            if fn is not None and fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                item = None

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        """Each item to its request's stream: one wake-up per event loop, not one per item."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)

    def _fail_all(self, exc: Exception) -> None:
        failed = []
        for request_id in self.engine.unfinished_request_ids():   # not those held for export
            self.engine.abort(request_id)
            failed.append((request_id, EngineDeadError(f"engine step failed: {exc}")))
        self._deliver(failed)


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in puts:
        q.put_nowait(item)
