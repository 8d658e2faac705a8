"""Colocated replica: one engine does both phases (the baseline and the fallback mode).

Life cycle of a request here (`generate`)
  1. decode the request; 2. admit: one engine call checks it (a bad one is a 400 event) and
  queues the prompt (the engine prefills it in chunks and decodes it with continuous batching; a
  structured-output request's grammar is compiled before, on a worker thread); 3. stream
  TokenEvents until it finishes. Leaving early aborts the request, which frees its blocks.
An embedding (`embed`, /v1/embeddings) is a prompt whose final hidden states are pooled at its last
chunk instead of a token sampled (serving/replica_util.py `embed_events`).
"""

from __future__ import annotations

from ray import serve

from serving import messages
from serving.config import AppConfig
from serving.engine_host import EngineHost, EngineReplica
from serving.replica_util import embed_events, engine_events, error_event


@serve.deployment
class ColocatedServer(EngineReplica):
    def __init__(self, config: dict, registry=None):
        cfg = AppConfig.model_validate(config)
        self.host = EngineHost(cfg, "colocated", registry)
        self.stream_interval_s = cfg.stream_interval_ms / 1000

    async def generate(self, data: bytes):
        self.host.start_stats_pusher()
        try:
            req = messages.decode(data, expect=messages.GenerateRequest)
        except messages.MessageError as exc:
            yield error_event("", str(exc), 400, "invalid_request_error")
            return
        rid, ids, params = req.request_id, list(req.prompt_token_ids), req.params.to_params()
        resumed = list(req.resumed_token_ids)
        await self.host.aengine.prepare(params)
        async for event in engine_events(
                self.host.aengine, rid,
                lambda e: e.add_request(rid, ids, params, resumed=resumed, shown_chars=req.shown_chars),
                self.stream_interval_s):
            yield event

    async def embed(self, data: bytes):
        """An `EmbedRequest`'s one answer (`embed_events`)."""
        self.host.start_stats_pusher()
        async for event in embed_events(self.host.aengine, data):
            yield event
