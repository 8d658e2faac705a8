"""OpenAI-compatible request models and response builders.

Requests are validated strictly (unknown fields and out-of-range values are 400 errors in
OpenAI's error format); `sampling_params` maps them to the engine's SamplingParams, adding
vLLM's widely used extensions top_k, min_tokens, ignore_eos and repetition_penalty.
"""

from __future__ import annotations

import time
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.sampling_params import MAX_LOGPROBS, MAX_REPETITION_PENALTY, SamplingParams

MAX_TOKENS_DEFAULT_COMPLETION = 16
MAX_CHOICES = 16   # most choices in one request (n, times the prompts of a batched completion)
MAX_PROMPTS = 16   # most prompts in one completion request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_REPETITION_PENALTY)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def logprob_count(self) -> int | None:
        """Alternatives per token the client asked for; None = no logprobs."""
        raise NotImplementedError

    def prompt_logprob_count(self) -> int | None:
        """The same for the prompt's tokens (completions with `echo`); None = none."""
        return None

    @property
    def prompt_only(self) -> bool:
        """Return the prompt alone, nothing generated (completions: echo with max_tokens 0)."""
        return False

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
                              max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens),
                              stop=self.stop_list(), ignore_eos=self.ignore_eos, seed=self.seed,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, logprobs=self.logprob_count(),
                              prompt_logprobs=self.prompt_logprob_count())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _as_prompts(v) -> list:
    """A completion's `prompt` as a list of prompts: a string or a token list is one prompt."""
    return [v] if isinstance(v, str) or (v and isinstance(v[0], int)) else list(v)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(MAX_TOKENS_DEFAULT_COMPLETION, ge=0, description="0 only with echo: the prompt "
                                   "alone (with its logprobs), nothing generated")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: None = None
    best_of: int | None = Field(None, ge=1, le=1)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        prompts = _as_prompts(v)
        if not prompts:
            raise ValueError("prompt must not be empty")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        for p in prompts:
            if not p:
                raise ValueError("prompt must not be empty")
            if not isinstance(p, str) and any((not isinstance(t, int)) or t < 0 for t in p):
                raise ValueError("token prompts must be non-negative integers")
        return v

    @model_validator(mode="after")
    def _choices_in_all(self):
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"prompts x n must be at most {MAX_CHOICES}")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo (it returns the prompt alone)")
        return self

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) and nothing generated; the pools
        still run one token, which the router drops."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch (a list of strings or of token lists)."""
        return _as_prompts(self.prompt)

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_logprob_count(self) -> int | None:
        return self.logprobs if self.echo else None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: None = None
    response_format: dict | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("response_format")
    @classmethod
    def _format(cls, v):
        if v is not None and v.get("type") != "text":
            raise ValueError("only response_format type 'text' is supported")
        return v

    def conversation(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


# ---- responses --------------------------------------------------------------------------------
def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers,
                        content={"error": {"message": message, "type": kind, "param": param, "code": code}})


def error_body(message: str, kind: str, code: int | str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def choice_body(index: int, text: str, finish: str | None, chat: bool, chunk: bool, first: bool = False,
                logprobs: dict | None = None) -> dict:
    """One choice of a response (chunk=False) or of a stream chunk; `first` (chat chunks): the
    choice's opening chunk, which carries the role. `logprobs`: the choice's OpenAI logprobs
    object (router/logprobs.py), when asked for."""
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if not chunk:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish}
    delta = {"role": "assistant", "content": text} if first else {"content": text}
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def completion_body(rid: str, model: str, choices: list[dict], chat: bool, chunk: bool,
                    use: dict | None = None) -> dict:
    """A response (chunk=False) or one stream chunk; no choices and `use` = a usage-only chunk."""
    obj = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices}
    if use is not None or not chunk:
        body["usage"] = use
    return body
