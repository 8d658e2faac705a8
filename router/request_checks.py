"""What the router checks of a request before any pool sees it, and what it answers a request that
fails them (an OpenAI-format error: nothing runs, nothing is held).

Order of the checks of a completion or chat request (`params`)
  1. model     the served model under any of its names, an adapter of the configuration
               (`lora_modules`) or one loaded at run time: a 404 otherwise
  2. prompts   none empty; the longest and `max_tokens` within the context and `max_tokens_limit`
               (no `max_tokens`: what the context leaves, up to the limit)
  3. params    the body's sampling parameters (`sampling_params`), with the adapter, the bad
               words' and the prediction's token ids, and the grammar's start after reasoning;
               then `SamplingParams.validate` (compiling a grammar: on a worker thread)
  4. ids       token ids the parameters name (logit_bias, stop_token_ids, allowed_token_ids)
               within the vocabulary
Who calls: the Router (router/app.py) on its event loop, after restoring the adapters loaded at run
time (router/runtime_lora_api.py), so that `names` is complete.
"""

from __future__ import annotations

import asyncio
import dataclasses

from fastapi.responses import JSONResponse

from engine.sampling_params import SamplingParams
from router.openai_responses import above_limit, error_response
from router.runtime_lora import RuntimeLoras
from serving.config import AppConfig


class RequestChecks:
    """`config`: the app's; `tokenizer`: the model's; `max_model_len`: the served context;
    `tool_syntax`: the model's tool-call syntax (router/tools.py), or None; `loras`: the adapters
    loaded at run time."""

    def __init__(self, config: AppConfig, tokenizer, max_model_len: int, tool_syntax, loras: RuntimeLoras):
        self.config, self.tokenizer, self.max_model_len = config, tokenizer, max_model_len
        self.tool_syntax, self.loras = tool_syntax, loras
        self.model_names = config.model_names              # a request may name any; the first is the default
        self.lora_names = tuple(config.lora_modules)       # a request naming one runs that LoRA adapter
        self.vocab_size = len(tokenizer)

    @property
    def names(self) -> tuple[str, ...]:
        """What a request's `model` may name: the model, and the LoRA adapters."""
        return (*self.model_names, *self.lora_names, *self.loras.names)

    def model_problem(self, name: str | None) -> JSONResponse | None:
        """Step 1: the 404 for a `model` this server does not serve, or None (also for no `model`)."""
        if name in (None, *self.names):
            return None
        served = ", ".join(repr(n) for n in self.names)
        return error_response(404, f"model {name!r} does not exist; this server serves {served}",
                              param="model", code="model_not_found")

    async def token_ids(self, prompts: list, add_special_tokens: bool, param: str) -> list[list[int]] | JSONResponse:
        """A batch of prompts (texts or token ids: a completion's `prompt`, an embedding request's
        `input`) as token ids, the texts tokenized in a worker thread; or the 400 for token ids beyond
        the vocabulary."""
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(await asyncio.to_thread(lambda: [self.tokenizer.encode(
            t, add_special_tokens=add_special_tokens) for t in texts]) if texts else ())
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append(next(encoded))
            elif (problem := self.out_of_vocabulary(p, param)) is not None:
                return problem
            else:
                out.append(list(p))
        return out

    def out_of_vocabulary(self, ids, param: str, what: str = "token id") -> JSONResponse | None:
        """The 400 for token ids beyond the vocabulary, or None."""
        if any(t >= self.vocab_size for t in ids):
            return error_response(400, f"{what} out of range (vocabulary size {self.vocab_size})", param=param)
        return None

    async def params(self, body, prompts: list[list[int]], max_tokens: int | None,
                     think: tuple[int, int, bool] | None) -> SamplingParams | JSONResponse:
        """The request's sampling parameters, or the error refusing it (steps 1-4). `think`: where a
        grammar starts after the prompt leaves a reasoning block open (router/reasoning.py)."""
        if (problem := self.model_problem(body.model)) is not None:
            return problem
        if not all(prompts):
            return error_response(400, "the prompt is empty", param="prompt")
        longest, limit = max(len(ids) for ids in prompts), self.config.max_tokens_limit
        room = self.max_model_len - longest
        if max_tokens is None:
            max_tokens = min(room, limit)
        if max_tokens > limit:
            return above_limit("max_tokens", max_tokens, limit)
        if room < 1 or max_tokens > room:
            return error_response(400, f"this model's maximum context length is {self.max_model_len} tokens; "
                                  f"the prompt has {longest} tokens and max_tokens is {max_tokens}",
                                  param="max_tokens")
        params = body.sampling_params(max_tokens, self.tool_syntax)
        if params.priority and self.config.scheduling_policy != "priority":
            return error_response(400, "priority needs the server's scheduling_policy priority (it schedules first "
                                  "come, first served)", param="priority")
        params = self.with_lora(params, body.model)
        if body.bad_words:
            params = dataclasses.replace(params, bad_words=body.bad_word_ids(
                lambda text: self.tokenizer.encode(text, add_special_tokens=False)))
        if (prediction := getattr(body, "prediction", None)) is not None:      # chat only, as OpenAI's
            ids = await asyncio.to_thread(self.tokenizer.encode, prediction.text(), add_special_tokens=False)
            if len(ids) > self.max_model_len:
                return error_response(400, f"the prediction has {len(ids)} tokens, more than this model's "
                                      f"context of {self.max_model_len}", param="prediction")
            params = dataclasses.replace(params, prediction=tuple(ids))
        if think is not None and params.structured is not None:    # the grammar after the reasoning
            params = dataclasses.replace(params, structured=dataclasses.replace(params.structured, think=think))
        # a grammar's check compiles it (llguidance releases the GIL): off the event loop
        error = await asyncio.to_thread(params.validate) if params.structured is not None else params.validate()
        if error:
            return error_response(400, error)
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids)):
            if (problem := self.out_of_vocabulary(ids, name, f"{name}: token id")) is not None:
                return problem
        return params

    def with_lora(self, params: SamplingParams, model: str | None) -> SamplingParams:
        """`params` running the adapter `model` names, if it names one."""
        if model in self.lora_names:
            return dataclasses.replace(params, lora=model)
        if (loaded := self.loras.loaded.get(model)) is not None:
            return dataclasses.replace(params, lora=model, lora_path=loaded.path, lora_id=loaded.lora_id)
        return params
