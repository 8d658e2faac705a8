"""Small helpers the replicas share: the KV bind address, event encoding, an engine stream's events
and an embedding's answer."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.outputs import Rejected, RequestOutput
from serving import messages


def kv_bind_host(configured: str) -> str:
    if configured != "auto":
        return configured
    import ray
    return ray.util.get_node_ip_address()


def token_event(out: RequestOutput) -> bytes:
    return messages.encode(messages.TokenEvent(
        out.request_id, tuple(out.new_token_ids), out.new_text, out.finished, out.finish_reason,
        out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens, tuple(out.logprobs or ()),
        tuple(out.prompt_logprobs or ()), out.stop_reason, out.accepted_prediction_tokens,
        out.rejected_prediction_tokens))


def error_event(request_id: str, message: str, code: int = 500, kind: str = "server_error") -> bytes:
    return messages.encode(messages.ErrorEvent(request_id, message, code, kind))


def engine_event(out: RequestOutput | Rejected) -> bytes:
    """What an engine stream yields, as a replica's event: a token event, an error event with
    the status of a request the engine rejected at admission (Rejected.code: 400, or 503 to
    retry), or its own status (RequestOutput.error_code) for one that failed on its own."""
    if isinstance(out, Rejected):
        return error_event(out.request_id, out.reason, out.code,
                           "invalid_request_error" if out.code == 400 else "overloaded")
    if out.error is not None:
        return error_event(out.request_id, out.error, out.error_code,
                           "invalid_request_error" if out.error_code == 400 else "server_error")
    return token_event(out)


async def engine_events(aengine: AsyncEngine, request_id: str, admit: Callable, min_interval_s: float,
                        hold_first: bool = False) -> AsyncIterator[bytes]:
    """A replica's events for one request streamed from its engine (`AsyncEngine.stream`: `admit`
    checks and admits it in one engine call; leaving early aborts it there, which frees its blocks):
    each output as `engine_event`, and an engine that died as a 500 error event."""
    try:
        async for out in aengine.stream(request_id, admit, min_interval_s, hold_first=hold_first):
            yield engine_event(out)
    except EngineDeadError as exc:
        yield error_event(request_id, str(exc), 500)


async def embed_events(aengine: AsyncEngine, data: bytes) -> AsyncIterator[bytes]:
    """A prefill or colocated replica's answer to an `EmbedRequest` (its `embed` call): each prompt
    is checked and queued by an engine call of its own (a bad one is a 400 error event), the engine
    runs them in chunks beside its other requests and pools their final hidden states
    (engine/pooling.py); the one answer is an `Embedded` or an error event. A prompt's blocks are
    freed when its last chunk ran, or at once when the caller leaves (each stream's end aborts it)."""
    try:
        req = messages.decode(data, expect=messages.EmbedRequest)
    except messages.MessageError as exc:
        yield error_event("", str(exc), 400, "invalid_request_error")
        return
    rid, params = req.request_id, req.params.to_params()
    if params.pooling is None or not req.prompts:
        yield error_event(rid, "an EmbedRequest needs prompts and its parameters' pooling", 400,
                          "invalid_request_error")
        return
    await aengine.prepare(params)           # a LoRA adapter loaded at run time is read off the engine thread

    async def pooled(i: int, ids: list[int]) -> RequestOutput | Rejected:
        last, pid = None, f"{rid}-{i}"
        async with contextlib.aclosing(aengine.stream(pid, lambda e: e.add_request(pid, ids, params))) as outs:
            async for out in outs:
                last = out
        return last
    tasks = [asyncio.ensure_future(pooled(i, list(ids))) for i, ids in enumerate(req.prompts)]
    try:
        outs = await asyncio.gather(*tasks)
    except EngineDeadError as exc:
        outs = exc
    finally:
        for task in tasks:            # after a failure, the other prompts (each stream's end aborts its own)
            task.cancel()
    if isinstance(outs, EngineDeadError):
        yield error_event(rid, str(outs), 500)
        return
    for out in outs:
        if isinstance(out, Rejected) or out.error is not None:
            yield engine_event(out)
            return
    assert all(out.finished and out.embedding is not None for out in outs)
    yield messages.encode(messages.Embedded(rid, tuple(out.embedding for out in outs),
                                            sum(out.num_prompt_tokens for out in outs),
                                            sum(out.num_cached_tokens for out in outs)))
