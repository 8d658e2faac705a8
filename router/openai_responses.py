"""OpenAI-compatible responses: the builders the router answers with, and the pydantic models
that describe what they build, for the OpenAPI document (router/contract.py).

The router builds plain dicts (one per response or stream chunk: no model validation on the hot
path); the models say what those dicts are, and the schemathesis tests hold the server to them.
Streams: each server-sent event's `data` is a chunk object or, when the request fails after its
first tokens, an error object; the stream ends with `data: [DONE]`.
"""

from __future__ import annotations

import time
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

# ---- builders ----------------------------------------------------------------------------------


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error object. A message quoting a client's lone surrogate stays encodable."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers, content=error_body(message, kind, param, code))


def above_limit(name: str, value: int, limit: int) -> JSONResponse:
    """The 400 for a token count (`name`: max_tokens, max_output_tokens) above the server's `max_tokens_limit`."""
    return error_response(400, f"{name} {value} is above this server's limit of {limit}", param=name)


def refused(exc) -> JSONResponse:
    """A 400 for a request built inside an endpoint (a chat request from /tokenize's messages or
    from a response's input) that its model refuses (`exc`: pydantic's ValidationError)."""
    return error_response(400, "; ".join(e["msg"] for e in exc.errors()[:5]))


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0,
          predicted: tuple[int, int] | None = None) -> dict:
    """`predicted` (a chat request with a `prediction`): its accepted and rejected prediction tokens."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
    if predicted is not None:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": predicted[0],
                                            "rejected_prediction_tokens": predicted[1]}
    return out


def choice_body(index: int, text: str | None, finish: str | None, chat: bool, chunk: bool, first: bool = False,
                logprobs: dict | None = None, tool_calls: list[dict] | None = None,
                reasoning: str | None = None) -> dict:
    """One choice of a response (chunk=False) or of a stream chunk; `first` (chat chunks): the
    choice's opening chunk, which carries the role. `logprobs`: the choice's OpenAI logprobs
    object (router/logprobs.py), when asked for. `tool_calls` (chat): the calls (in a chunk,
    call deltas since the last, each with its call's `index`: router/tool_parser.py); the content
    is null when empty.
    `reasoning` (chat): the message's (a chunk's: its piece, when it has one)."""
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    body = {"role": "assistant", "content": text} if first or not chunk else {"content": text}
    if reasoning is not None and (reasoning or not chunk):
        body["reasoning"] = reasoning
    if tool_calls:
        body["content"] = text or None
        body["tool_calls"] = tool_calls
    return {"index": index, "delta" if chunk else "message": body, "logprobs": logprobs, "finish_reason": finish}


def completion_body(rid: str, model: str, choices: list[dict], chat: bool, chunk: bool,
                    use: dict | None = None) -> dict:
    """A response (chunk=False) or one stream chunk; no choices and `use` = a usage-only chunk."""
    obj = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices}
    if use is not None or not chunk:
        body["usage"] = use
    return body


# ---- models (documentation) --------------------------------------------------------------------
FinishReason = Literal["stop", "length"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, overloaded, unavailable, timeout, server_error, ...")
    param: str | None = Field(description="The request field at fault, when one is.")
    code: str | int | None = Field(description="e.g. model_not_found, invalid_api_key, body_too_large, "
                                                "rate_limit_exceeded.")


class ErrorResponse(BaseModel):
    """OpenAI's error format, for every 4xx and 5xx."""
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(ge=0, description="Prompt tokens served from a prefix cache.")


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = Field(ge=0, description="Tokens drafted from the prediction that the "
                                            "output repeated.")
    rejected_prediction_tokens: int = Field(ge=0, description="Tokens drafted from the prediction that it did "
                                            "not (computed, not output: not in completion_tokens).")


class Usage(BaseModel):
    prompt_tokens: int = Field(ge=0, description="Each prompt counted once.")
    completion_tokens: int = Field(ge=0, description="Over every choice.")
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="With a chat request's `prediction` only.")


class CompletionLogprobs(BaseModel):
    """The legacy completions API's logprobs; with echo the prompt's tokens come first, the very
    first with null."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokenLogprob(BaseModel):
    logprob: float
    rank: int = Field(ge=1, description="1: the likeliest token there.")
    decoded_token: str


PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]
PROMPT_LOGPROBS = ("With vLLM's prompt_logprobs: null for the prompt's first token, then per token its id (a "
                   "string) to its logprob, rank and text, and the same for the k likeliest tokens there.")
STOP_REASON = ("vLLM's: the stop string or stop token id that ended the choice; null for EOS or a limit (a "
               "chunk's: on the choice's last).")
TOKEN_IDS = "With vLLM's return_token_ids: the choice's output token ids (a chunk's: those since its last chunk)."
PROMPT_IDS = "With vLLM's return_token_ids: the prompt's token ids (streamed: on the first chunk only)."


class CompletionChunkChoice(BaseModel):
    index: int = Field(ge=0, description="prompt x n + j")
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None = Field(description="Set on the choice's last chunk.")
    stop_reason: str | int | None = Field(None, description=STOP_REASON)
    token_ids: list[int] | None = Field(None, description=TOKEN_IDS)
    prompt_token_ids: list[int] | None = Field(None, description=PROMPT_IDS)


class CompletionChoice(CompletionChunkChoice):
    finish_reason: FinishReason
    prompt_logprobs: PromptLogprobs | None = Field(None, description=PROMPT_LOGPROBS)


class _Body(BaseModel):
    id: str
    created: int
    model: str


class Completion(_Body):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Body):
    """One event of a streamed completion; the last one (`stream_options.include_usage`) has no
    choices and carries `usage` (with `continuous_usage_stats` every one carries the usage so far)."""
    object: Literal["text_completion"]
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str = Field(description="JSON text, as the model wrote it (a forced call's follows the schema).")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class CalledFunctionDelta(BaseModel):
    name: str | None = Field(None, description="On the call's first delta.")
    arguments: str = Field(description="The next piece of the arguments' JSON text (pieces add up to it).")


class ToolCallDelta(BaseModel):
    index: int = Field(ge=0, description="The call's place among the choice's calls.")
    id: str | None = Field(None, description="On the call's first delta, with `type` and the function's name.")
    type: Literal["function"] | None = None
    function: CalledFunctionDelta


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="Null when the turn is calls alone.")
    reasoning: str | None = Field(None, description="With a template that has <think> blocks: the text "
                                  "inside them (not in content).")
    tool_calls: list[ToolCall] | None = Field(None, description="With tools: the calls the output made "
                                              "(finish_reason tool_calls).")


class ChatChoice(BaseModel):
    index: int = Field(ge=0)
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason
    stop_reason: str | int | None = Field(None, description=STOP_REASON)
    token_ids: list[int] | None = Field(None, description=TOKEN_IDS)


class ChatCompletion(_Body):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(None, description=PROMPT_LOGPROBS)
    prompt_token_ids: list[int] | None = Field(None, description=PROMPT_IDS)


class Delta(BaseModel):
    role: Literal["assistant"] | None = Field(None, description="On each choice's first chunk.")
    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = Field(ge=0)
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None
    stop_reason: str | int | None = Field(None, description=STOP_REASON)
    token_ids: list[int] | None = Field(None, description=TOKEN_IDS)


class ChatCompletionChunk(_Body):
    """One event of a streamed chat completion; the last one (`stream_options.include_usage`) has
    no choices and carries `usage` (with `continuous_usage_stats` every one carries the usage so far)."""
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = Field(None, description=PROMPT_IDS)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int = Field(description="Longest prompt + output, in tokens.")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


class Tokenized(BaseModel):
    count: int = Field(ge=0)
    max_model_len: int = Field(description="Longest prompt + output, in tokens.")
    tokens: list[int]
    token_strs: list[str] | None = Field(None, description="With return_token_strs: each token's piece.")


class Detokenized(BaseModel):
    prompt: str
