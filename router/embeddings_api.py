"""OpenAI's /v1/embeddings: each input's prompt runs in the prefill pool (colocated: its pool),
whose engine pools its final hidden states into the vector (engine/pooling.py): prefill only, no
decode replica, no KV hand-off.

Life cycle of a request (router/app.py validated the body: router/embeddings_protocol.py)
  1. model     the served model or a LoRA adapter (which then runs in the pool), else a 404
  2. tokenize  the text inputs in a worker thread; token-id inputs checked against the vocabulary;
               each cut as `truncate_prompt_tokens` asks
  3. check     every input within the model's context, `dimensions` within the hidden size, the
               pooling one pdserve runs: a refused request is an OpenAI-format 400
  4. run       the inputs in groups of consecutive ones (`groups`: up to GROUP_INPUTS inputs and
               GROUP_TOKENS tokens), each group one call to the pool (Orchestrator.embed: one
               call's cost for many short inputs; groups spread over the pool's replicas), at most
               MAX_IN_FLIGHT groups at once, under the request deadline (a 504 past it); the first
               failure fails the request and cancels the rest
  5. respond   OpenAI's list: each vector as numbers or base64, `usage` the inputs' tokens; the
               JSON written in a worker thread one vector at a time (the encoder holds the GIL
               for a whole call: one call for 64 vectors of 576 numbers held the router's event
               loop, and every stream on it, for 24 ms, FastAPI's own encoding 64 ms more)
A client that disconnects cancels step 4: each call is cancelled and its replica aborts the
request, freeing its blocks.
"""

from __future__ import annotations

import array
import asyncio
import base64
import json
import logging
import sys
import uuid
from pathlib import Path

from fastapi.responses import JSONResponse, Response

from engine.pooling import Pooling
from engine.sampling_params import SamplingParams
from router.embeddings_protocol import EmbeddingRequest
from router.openai_responses import error_response
from router.orchestrator import Orchestrator, RequestFailed
from router.request_checks import RequestChecks
from serving.config import EmbeddingOptions

log = logging.getLogger(__name__)
GROUP_INPUTS, GROUP_TOKENS = 32, 4096     # one call to the pool carries at most these
MAX_IN_FLIGHT = 8       # calls one request has in the pool at once
_ST_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def model_pooling(model_dir: Path) -> tuple[str, bool] | str:
    """What a model's sentence-transformers files (modules.json, its Pooling module's config.json)
    say: (pooling kind, normalize), or why pdserve cannot pool as they say. A model without them:
    the last token, normalized (vLLM's default for a decoder served for embeddings)."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return "last", True
    try:
        modules = json.loads(path.read_text())
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
        other = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
        if other:
            return f"the model's sentence-transformers modules include {', '.join(other)}, which pdserve does not run"
        pooling = [m for m, kind in zip(modules, kinds) if kind == "Pooling"]
        if not pooling:
            return "last", "Normalize" in kinds
        config = json.loads((model_dir / pooling[0]["path"] / "config.json").read_text())
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        return f"the model's sentence-transformers files cannot be read ({type(exc).__name__}: {exc})"
    modes = sorted(k for k, on in config.items() if k.startswith("pooling_mode_") and on)
    if len(modes) != 1 or modes[0] not in _ST_POOLING:
        return f"the model's pooling ({', '.join(modes) or 'none'}) is not one pdserve runs (last, mean, cls)"
    return _ST_POOLING[modes[0]], "Normalize" in kinds


class EmbeddingsApi:
    """`/v1/embeddings` for the router (router/app.py). `hidden_size`: the model's (the vectors'
    length); `max_model_len`: the longest input served."""

    def __init__(self, options: EmbeddingOptions, model_dir: Path, checks: RequestChecks, orchestrator: Orchestrator,
                 metrics, hidden_size: int, max_model_len: int, model_name: str, timeout_s: float):
        self.checks, self.orchestrator, self.metrics, self.timeout_s = checks, orchestrator, metrics, timeout_s
        self.hidden_size, self.max_model_len, self.model_name = hidden_size, max_model_len, model_name
        found = model_pooling(model_dir) if options.pooling == "auto" or options.normalize is None else ("last", True)
        self.problem = None                 # why the model's own pooling is not served (auto only)
        if isinstance(found, str):
            if options.pooling == "auto":
                self.problem = f"{found}; set the server's embeddings.pooling"
                log.warning("/v1/embeddings: %s", self.problem)
            found = ("last", True)
        self.kind = found[0] if options.pooling == "auto" else options.pooling
        self.normalize = found[1] if options.normalize is None else options.normalize

    async def create(self, body: EmbeddingRequest):
        """Steps 1-5 of the module's docstring: the answer, or an OpenAI-format error."""
        if (problem := self.checks.model_problem(body.model)) is not None:
            return problem
        if self.problem is not None:
            return error_response(400, self.problem)
        prompts = await self._prompts(body)
        if not isinstance(prompts, list):
            return prompts
        if body.dimensions is not None and body.dimensions > self.hidden_size:
            return error_response(400, f"dimensions must be at most the model's {self.hidden_size}",
                                  param="dimensions")
        params = self.checks.with_lora(SamplingParams(max_tokens=1, pooling=Pooling(
            self.kind, self.normalize, body.dimensions)), body.model)
        vectors = await self.pool(f"embd-{uuid.uuid4().hex}", prompts, params)
        if not isinstance(vectors, list):
            return vectors
        tokens = sum(map(len, prompts))
        return Response(await asyncio.to_thread(_answer, vectors, body.encoding_format, body.model or self.model_name,
                                                tokens), media_type="application/json")

    async def pool(self, rid: str, prompts: list[list[int]], params: SamplingParams) -> list[bytes] | JSONResponse:
        """Step 4 (/v1/score's and /v1/rerank's too, router/score_api.py): each prompt's answer in
        order (float32 bytes: `params.pooling`'s vector), or the error that ends the request; its end
        counted in the request metrics. A client that leaves cancels the calls (CancelledError)."""
        gate = asyncio.Semaphore(MAX_IN_FLIGHT)

        async def one(g: int, group: range):
            async with gate:
                return await self.orchestrator.embed(f"{rid}-{g}", [prompts[i] for i in group], params)
        tasks = [asyncio.ensure_future(one(g, group)) for g, group in enumerate(groups(list(map(len, prompts))))]
        try:
            async with asyncio.timeout(self.timeout_s):
                answers = await asyncio.gather(*tasks)
        except TimeoutError:
            self.metrics.finish("error")
            return error_response(504, f"request exceeded its deadline of {self.timeout_s} s", "timeout")
        except RequestFailed as exc:
            self.metrics.finish("error")
            return error_response(exc.code, exc.message, exc.kind,
                                  headers={"Retry-After": "1"} if exc.code in (429, 503) else None)
        except asyncio.CancelledError:      # the client left
            self.metrics.finish("aborted")
            raise
        finally:
            for task in tasks:              # the rest of a failed request's calls (each cancels its own)
                task.cancel()
        self.metrics.finish("ok")
        return [v for answer in answers for v in answer.embeddings]

    async def _prompts(self, body: EmbeddingRequest):
        """Step 2 and the context check of step 3: each input's token ids, or the error refusing them."""
        encoded = await self.checks.token_ids(body.inputs(), body.add_special_tokens, "input")
        if not isinstance(encoded, list):
            return encoded
        prompts = []
        for i, ids in enumerate(encoded):
            ids = body.truncated(ids, self.max_model_len)
            if not ids:
                return error_response(400, f"input {i} has no tokens", param="input")
            if len(ids) > self.max_model_len:
                return error_response(400, f"this model's maximum context length is {self.max_model_len} tokens; "
                                      f"input {i} has {len(ids)} tokens", param="input")
            prompts.append(ids)
        return prompts


def groups(lengths: list[int], max_inputs: int = GROUP_INPUTS, max_tokens: int = GROUP_TOKENS) -> list[range]:
    """The inputs (by their token counts) in runs of consecutive ones, each at most `max_inputs`
    inputs and `max_tokens` tokens (an input longer than that alone)."""
    out, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and (i - start == max_inputs or tokens + n > max_tokens):
            out.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if lengths:
        out.append(range(start, len(lengths)))
    return out


def _answer(vectors: list[bytes], encoding_format: str, model: str, tokens: int) -> bytes:
    """The answer's JSON (OpenAI's embedding list), encoded a vector at a time (step 5)."""
    data = ",".join('{"object":"embedding","index":%d,"embedding":%s}' % (i, json.dumps(_encoded(v, encoding_format)))
                    for i, v in enumerate(vectors))
    usage = '{"prompt_tokens":%d,"total_tokens":%d}' % (tokens, tokens)
    return ('{"object":"list","data":[%s],"model":%s,"usage":%s}' % (data, json.dumps(model), usage)).encode()


def _encoded(vector: bytes, encoding_format: str) -> list[float] | str:
    """An `Embedded` vector (little-endian float32 bytes) as the request asked for it."""
    if encoding_format == "base64":
        return base64.b64encode(vector).decode("ascii")
    return floats(vector)


def floats(vector: bytes) -> list[float]:
    """An `Embedded` vector's numbers."""
    values = array.array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()
