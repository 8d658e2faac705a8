"""The router: a FastAPI ingress deployment serving the OpenAI-compatible API.

Life cycle of an HTTP request
  1. validate  the body (pydantic, strict); errors are 400s in OpenAI's error format; its
               `model` names the served model (any of its names) or a LoRA adapter
               (`lora_modules`, or one loaded at run time: router/runtime_lora_api.py), which then
               runs in every pool (SamplingParams.lora)
  2. tokenize  the prompt or apply the chat template (tokenization lives here, not in pools),
               with the tools shown as router/tools.py says; in a worker thread, since the
               tokenizers' encode releases the GIL (a 16.5k-token chat took 24 ms, all of it a
               stall of this router's event loop and every stream on it before; the loop's longest
               gap 30.8-32.3 -> 2.7-4.1 ms: benchmarks/tokenize_stall_bench.py)
  3. check     the model, the context, the limits and the sampling parameters
               (router/request_checks.py): a refused request is an OpenAI-format error
  4. run       the orchestrator, once per choice (`n`, router/choices.py): decode replica
               chosen, prefill there, decode streams back
  5. respond   one JSON body, or server-sent events ending in `data: [DONE]` (router/reply.py);
               a failure before the first tokens is an HTTP error, after them an error event in
               the stream. A chat choice's output is split into reasoning (a template with
               <think> blocks), content and tool calls (with tools): router/chat_output.py
A client that disconnects cancels step 4, which aborts the request in every pool.
/v1/embeddings runs each input's prompt in the prefill pool alone (router/embeddings_api.py).
/v1/responses (router/responses_api.py) and Anthropic's /v1/messages (router/messages_api.py) are
chat completions underneath; /v1/messages' errors are in Anthropic's format.

(No `from __future__ import annotations` here: Serve's class-based ingress rebuilds the endpoint
signatures and FastAPI then cannot resolve string annotations of the request bodies.)
"""


import asyncio
import logging
import time
import uuid
from typing import Annotated, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from jinja2 import TemplateError
from pydantic import ValidationError
from ray import serve
from transformers import AutoConfig, AutoTokenizer

from engine.config import context_limit
from engine.model_dims import Dims
from router.chat_output import ChatOutputShape
from router.chat_prompt import chat_prompt_ids
from router.chat_protocol import ChatCompletionRequest
from router.choice_view import choice_params
from router.choices import Choices
from router.contract import Served, openapi_document
from router.cors import Cors, CorsSettings
from router.embeddings_api import EmbeddingsApi
from router.embeddings_protocol import EmbeddingRequest
from router.guards import Guards, GuardSettings
from router.logprobs import TokenStrings
from router.messages_api import MessagesApi
from router.messages_output import anthropic_error, anthropic_path
from router.messages_protocol import CountTokensRequest, MessagesRequest
from router.metrics import RequestMetrics, render
from router.openai_protocol import CompletionRequest
from router.openai_responses import above_limit, error_response, refused
from router.orchestrator import Orchestrator, RequestFailed
from router.protocol_types import reply_id
from router.reasoning import grammar_think, reasoning_template, starts_inside, think_tokens
from router.reply import Reply
from router.request_checks import RequestChecks
from router.response_store import MAX_PAGE
from router.responses_api import ResponsesApi
from router.responses_protocol import ResponsesRequest
from router.runtime_lora import LoadLoraAdapterRequest, RuntimeLoras, UnloadLoraAdapterRequest
from router.runtime_lora_api import RuntimeLoraApi
from router.score_api import ScoreApi
from router.score_protocol import RerankRequest, ScoreRequest
from router.tokenize_protocol import DetokenizeRequest, TokenizeRequest
from router.tools import template_tools
from router.validation_errors import describe
from router.wake import at_zero
from serving import messages
from serving.config import AppConfig
from serving.models import resolve_model
from serving.serve_logging import log_through_serve
from serving.serve_metrics import RouterSeries

log = logging.getLogger(__name__)
# /openapi.json and /docs are the Router's own endpoints: the document depends on its configuration.
app = FastAPI(title="pdserve", description="Disaggregated prefill/decode LLM serving (OpenAI-compatible)",
              openapi_url=None, docs_url=None, redoc_url=None)
guard_settings, cors_settings = GuardSettings(), CorsSettings()
app.add_middleware(Guards, settings=guard_settings)
app.add_middleware(Cors, settings=cors_settings)      # added last: outermost, a preflight never meets the guards


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    message, param = describe(exc.errors(), skip=1)      # skip FastAPI's "body"
    if anthropic_path(request.url.path):
        return anthropic_error(400, message)
    return error_response(400, message, param=param)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    """FastAPI's own errors (unparsable body, unknown route, wrong method) in OpenAI's format
    (Anthropic's on its routes)."""
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    if anthropic_path(request.url.path):
        return anthropic_error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))
    return error_response(exc.status_code, str(exc.detail), kind, headers=getattr(exc, "headers", None))


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception):
    """A bug: a 500 in OpenAI's format (Anthropic's on its routes; Starlette logs the exception)."""
    if anthropic_path(request.url.path):
        return anthropic_error(500, f"internal error: {type(exc).__name__}")
    return error_response(500, f"internal error: {type(exc).__name__}", "server_error")


@serve.deployment
@serve.ingress(app)
class Router:
    def __init__(self, config: dict, prefill=None, decode=None, colocated=None, registry=None, store=None):
        log_through_serve()
        self.config = AppConfig.model_validate(config)
        guard_settings.configure(self.config.api_key, self.config.max_body_bytes, self.config.max_inflight_requests)
        cors = self.config.cors
        cors_settings.configure(cors.allowed_origins, cors.allow_credentials, cors.max_age_s)
        model_dir = resolve_model(self.config.model, self.config.model_cache, progress=False)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if self.config.chat_template is not None:          # the config's, in place of the model's own
            self.tokenizer.chat_template = self.config.chat_template
        self.token_strings = TokenStrings(self.tokenizer)
        self.tool_syntax, native = template_tools(self.tokenizer)
        self.native_tools = self.tool_syntax if native else None    # the template writes calls itself
        self.reasoning = reasoning_template(self.tokenizer)
        self.think_tokens = think_tokens(self.tokenizer) if self.reasoning else None
        hf = AutoConfig.from_pretrained(model_dir)
        dims = Dims.of_config(hf)
        configured = self.config.engine_for("colocated" if self.config.mode == "colocated" else "decode").max_model_len
        self.max_model_len = min(configured or 10**9, context_limit(hf, configured))
        # adapters loaded at run time (runtime_lora_updating) may take no name served otherwise
        self.runtime_loras = RuntimeLoras(dims, (*self.config.model_names, *self.config.lora_modules))
        self.checks = RequestChecks(self.config, self.tokenizer, self.max_model_len, self.tool_syntax,
                                    self.runtime_loras)
        self.model_name = self.config.model_names[0]        # the default a request's `model` may leave out
        self.served = Served(self.names, self.config.max_tokens_limit, len(self.tokenizer),
                             self.max_model_len, api_key=bool(self.config.api_key),
                             priorities=self.config.scheduling_policy == "priority",
                             runtime_loras=self.config.runtime_lora_updating, hidden_size=dims.hidden_size)
        self._documents: dict[str, dict] = {}
        self.registry = registry
        slo = self.config.autoscaling
        self.request_metrics = RequestMetrics(export=RouterSeries(),   # also on Ray's metrics port
                                              window_s=slo.window_s if slo else 30.0,
                                              goodput=self.config.goodput_targets)
        self.orchestrator = Orchestrator(self.config.mode, prefill, decode, colocated, metrics=self.request_metrics,
                                         wake_prefill=self.config.mode == "disaggregated")
        pools = {"prefill": prefill, "decode": decode, "colocated": colocated}
        self.pool_deployments = {pool: h.deployment_name for pool, h in pools.items() if h is not None}
        self.responses_api = ResponsesApi(
            store, self.config.max_tokens_limit, self.model_name, self.chat_completions,
            saved=self.request_metrics.response_saved, max_model_len=self.max_model_len,
            prompt_tokens=self._prompt_tokens,
            lease_s=self.config.responses.background_lease_s, refusal=self.chat_refusal)
        # ... restored from the ResponseStore at the first request (a router that restarted)
        self.loras = RuntimeLoraApi(self.runtime_loras, self.responses_api.stored, self.config.runtime_lora_updating)
        self.embeddings_api = EmbeddingsApi(self.config.embeddings, model_dir, self.checks, self.orchestrator,
                                            self.request_metrics, dims.hidden_size, self.max_model_len,
                                            self.model_name, self.config.request_timeout_s)
        self.score_api = ScoreApi(self.config.score, self.checks, self.embeddings_api, model_dir, self.max_model_len,
                                  self.model_name)
        self.messages_api = MessagesApi(self.chat_completions, self._prompt_tokens, self.checks.model_problem,
                                        self.model_name)

    def _prompt_tokens(self, chat: ChatCompletionRequest) -> int:
        """The tokens of a chat completion's prompt (its template's errors raised): the Responses
        API's truncation, the Messages API's count_tokens."""
        return len(chat_prompt_ids(self.tokenizer, chat, self.native_tools))

    @property
    def names(self) -> tuple[str, ...]:
        """What a request's `model` may name: the model, and the LoRA adapters."""
        return self.checks.names

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's hook (collected when the SLO policy autoscales the router at 1 replica): the window."""
        return self.request_metrics.window.snapshot(time.monotonic())

    # ---- plain endpoints ----------------------------------------------------------------------
    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request):
        """The API contract (router/contract.py) of this deployment."""
        root = request.scope.get("root_path", "").rstrip("/")
        if root not in self._documents:
            self._documents[root] = openapi_document(request.app, self.served, root)
        return self._documents[root]

    @app.get("/docs", include_in_schema=False)
    async def docs(self, request: Request):
        root = request.scope.get("root_path", "").rstrip("/")
        return get_swagger_ui_html(openapi_url=root + "/openapi.json", title="pdserve")

    @app.get("/health")
    async def health(self):
        pools = {s.pool for s in await self._stats()}
        needed = {"colocated"} if self.config.mode == "colocated" else {"prefill", "decode"}
        missing = needed - pools
        if missing:        # a pool at zero by design is ready with none: a request starts one
            missing -= await at_zero({p: self.pool_deployments[p] for p in missing})
        if missing:
            return error_response(503, f"no ready replica yet in: {', '.join(sorted(missing))}", "unavailable")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self):
        await self.loras.restore()
        return {"object": "list", "data": [self._model_card(name) for name in self.names]}

    @app.get("/v1/models/{model:path}")
    async def model(self, model: str):
        """OpenAI's model retrieval (`client.models.retrieve`): the served model under any of its
        names (a name may hold slashes) or a LoRA adapter, any other a 404."""
        await self.loras.restore()
        problem = self.checks.model_problem(model)
        return self._model_card(model) if problem is None else problem

    def _model_card(self, name: str) -> dict:
        """A model's card; a LoRA adapter's names the model it adapts as its `parent` (vLLM's)."""
        card = {"id": name, "object": "model", "created": 0, "owned_by": "pdserve", "max_model_len": self.max_model_len}
        if name in self.checks.lora_names or name in self.runtime_loras.loaded:
            card["parent"] = self.model_name
        return card

    @app.get("/metrics")
    async def metrics(self):
        m = self.request_metrics
        return PlainTextResponse(render(await self._stats(), m.outcomes, m), media_type="text/plain; version=0.0.4")

    async def _stats(self) -> list[messages.ReplicaStats]:
        if self.registry is None:
            return []
        return [messages.decode(d, expect=messages.ReplicaStats) for d in await self.registry.snapshot.remote()]

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest):
        """vLLM's: the token ids a prompt, or a chat's messages, become (what `usage` counts)."""
        await self.loras.restore()
        if (problem := self.checks.model_problem(body.model)) is not None:
            return problem
        if body.prompt is not None:
            ids = await asyncio.to_thread(self.tokenizer.encode, body.prompt,
                                          add_special_tokens=body.add_special_tokens is not False)
        else:
            try:
                chat = body.chat(self.model_name)
                ids = await asyncio.to_thread(chat_prompt_ids, self.tokenizer, chat, self.native_tools)
            except ValidationError as exc:
                return refused(exc)
            except (ValueError, TemplateError) as exc:
                return error_response(400, str(exc), param="messages")
        out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest):
        """vLLM's: token ids back to text."""
        await self.loras.restore()
        if (problem := self.checks.model_problem(body.model)) is not None:
            return problem
        if (problem := self.checks.out_of_vocabulary(body.tokens, "tokens")) is not None:
            return problem
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, body.tokens)}

    # ---- LoRA adapters loaded at run time (router/runtime_lora_api.py) -----------------------------
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, body: LoadLoraAdapterRequest):
        """vLLM's: serve the PEFT adapter at `lora_path` as `lora_name` (with runtime_lora_updating)."""
        return await self.loras.load(body)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, body: UnloadLoraAdapterRequest):
        """vLLM's: stop serving the adapter loaded as `lora_name` (with runtime_lora_updating)."""
        return await self.loras.unload(body)

    # ---- generation -----------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        raw = body.prompts()
        prompts = await self.checks.token_ids(raw, body.add_special_tokens, "prompt")
        if isinstance(prompts, JSONResponse):
            return prompts
        whole = prompts
        prompts = [body.truncated(ids, self.max_model_len) for ids in prompts]
        echoes = None
        if body.echo:      # a string prompt as given, unless truncated
            echoes = [(p if isinstance(p, str) and ids is all_ids
                       else self.tokenizer.decode(ids, skip_special_tokens=False), ids)
                      for p, ids, all_ids in zip(raw, prompts, whole)]
        max_tokens = 1 if body.prompt_only else body.max_tokens_within(self.config.max_tokens_limit)
        return await self._generate(body, prompts, max_tokens, chat=False,
                                    prefix="cmpl", echoes=echoes, headers=request.headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request = None):
        """OpenAI's chat completions; `request` (its headers) is None where the Responses API calls it."""
        prepared = await self._chat_prompt(body)
        if isinstance(prepared, JSONResponse):
            return prepared
        ids, shape, think = prepared
        return await self._generate(body, [ids], body.max_completion_tokens or body.max_tokens, chat=True,
                                    prefix="chatcmpl", shape=shape, think=think,
                                    headers=request.headers if request is not None else None)

    async def _chat_prompt(self, body: ChatCompletionRequest):
        """A chat completion's prompt ids, output shape and grammar start (`think`), or the error
        answering it."""
        # a forced call's grammars compile (tens of ms for a new tool set): off the event loop
        if body.forces_call and (problem := await asyncio.to_thread(body.tools_problem, self.tool_syntax)):
            return error_response(400, problem, param="tools")
        try:
            ids = await asyncio.to_thread(chat_prompt_ids, self.tokenizer, body, self.native_tools)
        except (ValueError, TemplateError) as exc:     # the template refused the conversation
            return error_response(400, str(exc), param="messages")
        ids = body.truncated(ids, self.max_model_len)
        if body.max_completion_tokens is not None and (body.max_tokens or 0) > self.config.max_tokens_limit:
            return above_limit("max_tokens", body.max_tokens, self.config.max_tokens_limit)   # overridden, yet bounded
        reasoning = think = None
        if self.reasoning:       # where the output starts: inside a <think> the prompt left open, or not
            tail = self.tokenizer.decode(ids[-16:], skip_special_tokens=False)
            reasoning, think = starts_inside(tail), grammar_think(self.think_tokens, tail)
        shape = ChatOutputShape.of(body, self.tool_syntax, reasoning)
        return ids, shape, think

    async def chat_refusal(self, body: ChatCompletionRequest) -> JSONResponse | None:
        """What the chat endpoint would refuse `body` with before it runs (its prompt, model, limits
        and parameters), or None: a background response's checks before it is answered `queued`."""
        prepared = await self._chat_prompt(body)
        if isinstance(prepared, JSONResponse):
            return prepared
        ids, _, think = prepared
        checked = await self._checked(body, [ids], body.max_completion_tokens or body.max_tokens, think)
        return checked if isinstance(checked, JSONResponse) else None

    @app.post("/v1/messages")
    async def messages(self, body: MessagesRequest):
        """Anthropic's Messages API, a chat completion underneath (router/messages_api.py)."""
        return await self.messages_api.create(body)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(self, body: CountTokensRequest):
        """Anthropic's token count of a message's prompt."""
        await self.loras.restore()
        return await self.messages_api.count_tokens(body)

    @app.post("/v1/embeddings")
    async def embeddings(self, body: EmbeddingRequest):
        """OpenAI's embeddings: each input's prompt pooled in the prefill pool (router/embeddings_api.py)."""
        await self.loras.restore()
        return await self.embeddings_api.create(body)

    @app.post("/score", include_in_schema=False)
    @app.post("/v1/score")
    async def score(self, body: ScoreRequest):
        """vLLM's score: each text pair scored by the label tokens' probability after it, in the
        prefill pool (router/score_api.py)."""
        await self.loras.restore()
        return await self.score_api.score(body)

    @app.post("/rerank", include_in_schema=False)
    @app.post("/v2/rerank", include_in_schema=False)
    @app.post("/v1/rerank")
    async def rerank(self, body: RerankRequest):
        """Jina's and Cohere's rerank (vLLM's): the documents by their score against the query."""
        await self.loras.restore()
        return await self.score_api.rerank(body)

    # ---- the Responses API (router/responses_api.py) ------------------------------------------------
    @app.post("/v1/responses")
    async def responses(self, body: ResponsesRequest):
        """OpenAI's Responses API: the chat endpoint's path, as a Response or the Responses stream."""
        return await self.responses_api.create(body)

    @app.get("/v1/responses/{response_id}")
    async def get_response(self, response_id: str, stream: bool = False,
                           starting_after: Annotated[int | None, Query(ge=0)] = None):
        """A stored response; with `stream`, a background stream's events again (after sequence
        number `starting_after`), live to its end."""
        if stream:
            return await self.responses_api.stream_again(response_id, starting_after)
        return await self.responses_api.retrieve(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(self, response_id: str, limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 20,
                          order: Literal["asc", "desc"] = "desc", after: str | None = None):
        """The items a stored response's model saw before its output (its instructions aside), a page."""
        return await self.responses_api.input_items(response_id, limit, order, after)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str):
        """Forget a stored response (a background one still running is cancelled)."""
        return await self.responses_api.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(self, response_id: str):
        """Cancel a background response."""
        return await self.responses_api.cancel(response_id)

    async def _generate(self, body, prompts: list[list[int]], max_tokens: int | None, chat: bool, prefix: str,
                        echoes: list[tuple[str, list[int]]] | None = None, shape: ChatOutputShape | None = None,
                        think: tuple[int, int, bool] | None = None, headers=None):
        """A completion or chat request through the pools under the request id `<prefix>-<random>`;
        its answer's id is `<prefix>-` and the client's id where it gave one (`reply_id`)."""
        params = await self._checked(body, prompts, max_tokens, think)
        if isinstance(params, JSONResponse):
            return params
        rid = f"{prefix}-{uuid.uuid4().hex}"
        return await self._run(body, rid, prompts, params, chat, echoes, shape,
                               reply_id(prefix, headers or {}, body.request_id) or rid)

    async def _checked(self, body, prompts: list[list[int]], max_tokens: int | None,
                       think: tuple[int, int, bool] | None):
        """The request's sampling parameters, or the error refusing it (router/request_checks.py)."""
        await self.loras.restore()
        return await self.checks.params(body, prompts, max_tokens, think)

    async def _run(self, body, rid: str, prompts: list[list[int]], params, chat: bool,
                   echoes: list[tuple[str, list[int]]] | None, shape: ChatOutputShape | None, answer_id: str):
        """Run a checked request (`_checked`'s parameters) through the pools as `rid` and answer it
        as `answer_id`."""
        start = time.monotonic()
        if params.lora is not None:
            self.request_metrics.lora_request(params.lora)
        for ids in prompts:
            for _ in range(body.n):
                self.request_metrics.window.arrived(start, len(ids))
        n = body.n
        choices = Choices([[self._choice(rid, p * n + j, j, ids, params) for j in range(n)]
                           for p, ids in enumerate(prompts)])
        try:
            firsts = await choices.start()
            first_at = time.monotonic()
        except RequestFailed as exc:
            self.request_metrics.finish("error")
            return error_response(exc.code, exc.message, exc.kind,
                                  headers={"Retry-After": "1"} if exc.code in (429, 503) else None)
        except asyncio.CancelledError:      # the client left before the first tokens
            self.request_metrics.finish("aborted")
            raise
        reply = Reply(body, answer_id, body.model or self.model_name, chat, choices, firsts,   # the model as asked
                      (start, first_at), self.request_metrics, self.token_strings, echoes, shape, params.lora,
                      prompts if body.return_token_ids else None)
        if body.stream:
            return StreamingResponse(reply.stream(), media_type="text/event-stream")
        return await reply.collect()

    def _choice(self, rid: str, index: int, j: int, ids: list[int], params):
        """Choice `index` of a request, the `j`-th of its prompt: its own request id in the pools
        and its sampling parameters (`choice_params`)."""
        if index:
            rid = f"{rid}-{index}"
        params = choice_params(params, j)
        return lambda ready: self._timed(self.orchestrator.run(rid, ids, params, ready))

    async def _timed(self, events):
        """`events` under the request deadline; every failure comes out as a RequestFailed, so a
        stream always ends with an error event and [DONE] rather than a cut connection."""
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                async for ev in events:
                    yield ev
        except (GeneratorExit, asyncio.CancelledError):
            await events.aclose()     # the orchestrator cancels its replica calls now
            raise
        except TimeoutError:
            raise RequestFailed(504, f"request exceeded its deadline of {self.config.request_timeout_s} s",
                                "timeout") from None
        except RequestFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug or an unforeseen failure: report, stay up
            log.exception("request failed unexpectedly")
            raise RequestFailed(500, f"internal error: {type(exc).__name__}") from None
