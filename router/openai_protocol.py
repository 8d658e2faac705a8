"""OpenAI-compatible request models: what the server accepts, and the request half of the
OpenAPI document (router/contract.py adds what depends on the configuration). Here the fields
every completion request shares (`Sampling`) and the completions request; the chat request:
router/chat_protocol.py.

Requests are validated strictly (JSON types as declared, no coercion, no text with a lone
surrogate escape; unknown fields and out-of-range values are 400 errors in OpenAI's error
format), and every bound lives on a field, so the document states it. The rules that span fields
are model validators, stated in the model's description and, as if/then, in its JSON schema
(allowed_token_ids' and bad_words' exclusions, and prompt_logprobs' with stream, in words only: one
more rule across two fields and either request's schema is past what schemathesis' canonicalizer
models, so the fuzzing tests could no longer generate from it). `sampling_params` maps a request
to the engine's SamplingParams, adding vLLM's widely used extensions (top_k, min_p, min_tokens,
ignore_eos, repetition_penalty, stop_token_ids, allowed_token_ids, include_stop_str_in_output,
skip_special_tokens, prompt_logprobs; bad_words through the tokenizer: `bad_word_ids`;
truncate_prompt_tokens acts on the prompt's ids: `truncated`), and vLLM's `structured_outputs`
(beside OpenAI's `response_format`; their models: router/structured_protocol.py). /tokenize's and
/detokenize's: router/tokenize_protocol.py. Responses: router/openai_responses.py.
"""

from __future__ import annotations

from typing import Annotated, Callable, Literal

from pydantic import ConfigDict, Field, model_validator

from engine.sampling_params import (LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_REPETITION_PENALTY,
                                    SamplingParams)
from engine.structured_output import StructuredOutput
from router.protocol_types import MODEL_FIELD, REQUEST_ID_FIELD, Int, NonEmptyText, RequestId, Strict, Text, implies
from router.structured_protocol import ResponseFormat, StructuredOutputs
from router.tools import HERMES, CallSyntax

MAX_TOKENS_DEFAULT_COMPLETION = 16
MAX_CHOICES = 16   # most choices in one request (n, times the prompts of a batched completion)
MAX_PROMPTS = 16   # most prompts in one completion request
MAX_STOPS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_ALLOWED_TOKEN_IDS = 2**18   # above any vocabulary served today
MAX_BAD_WORDS = 64
MAX_TOP_K = 2**31 - 1
# The engine samples in float32 (or bf16): a positive value below these would underflow there, or
# overflow the logits it divides, and the step fails. Each clamp keeps the request's meaning:
GREEDY_BELOW_TEMPERATURE = 1e-5   # as vLLM: a temperature this small is greedy
MIN_TOP_P = 1e-9                  # any top_p below the top token's probability (>= 1/vocab) keeps only that token
MIN_REPETITION_PENALTY = 1e-6     # already divides a repeated token's positive logit by a million
TokenIds = Annotated[list[Int(ge=0)], Field(min_length=1)]
Stop = NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOPS)] | None
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                           Annotated[float, Field(ge=-LOGIT_BIAS_RANGE, le=LOGIT_BIAS_RANGE)]],
                      Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={"additionalProperties": False})]


def truncate(ids: list[int], keep: int | None, side: str | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the first (`side` "right") or else the last `keep` of `ids` (-1: the
    model's context; None: all); `ids` itself when nothing is cut."""
    keep = max_model_len if keep == -1 else keep
    if keep is None or len(ids) <= keep:
        return ids
    return ids[:keep] if side == "right" else ids[-keep:]


def _batch_at_most(k: int) -> dict:
    """`prompt`: a string, a token list, or a batch of at most k."""
    return {"properties": {"prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}},
                                                {"type": "array", "maxItems": k}]}}}


# prompts x n <= MAX_CHOICES: the n from which each smaller batch bound holds
_BATCH_BOUNDS = {n: MAX_CHOICES // n for n in range(2, MAX_CHOICES + 1)
                 if MAX_CHOICES // n < MAX_CHOICES // (n - 1)}
COMPLETION_CROSS_FIELD = {"allOf": [
    implies("max_tokens", {"const": 0}, {"properties": {"echo": {"const": True}}, "required": ["echo"]}),
    *(implies("n", {"type": "integer", "minimum": n}, _batch_at_most(k)) for n, k in _BATCH_BOUNDS.items())]}
# response_format and structured_outputs, not both
ONE_STRUCTURE = {"not": {"properties": {"response_format": {"type": "object"},
                                        "structured_outputs": {"type": "object"}},
                         "required": ["response_format", "structured_outputs"]}}
COMPLETION_CROSS_FIELD["allOf"].append(ONE_STRUCTURE)


class StreamOptions(Strict):
    include_usage: bool = Field(False, description="Send a last chunk with `usage` (and no choices) before [DONE].")
    continuous_usage_stats: bool = Field(False, description="vLLM's: with include_usage, every chunk also carries "
                                         "`usage` so far.")


class Sampling(Strict):
    model: str | None = Field(None, description=MODEL_FIELD)
    temperature: float = Field(1.0, ge=0.0, le=2.0, description=f"0 (or below {GREEDY_BELOW_TEMPERATURE:g}) is "
                               "greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int(ge=-1, le=MAX_TOP_K) = Field(-1, description="vLLM's; -1 or 0: off.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM's and llama.cpp's: drop the tokens less likely "
                         "than min_p x the likeliest one (after top_k and top_p); 0: off.")
    min_tokens: Int(ge=0) = Field(0, description="vLLM's: no EOS or stop before this many tokens (at most max_tokens).")
    ignore_eos: bool = Field(False, description="vLLM's: go on past EOS.")
    n: Int(ge=1, le=MAX_CHOICES) = Field(1, description=f"Choices per prompt (prompts x n at most {MAX_CHOICES}).")
    stream: bool = Field(False, description="Server-sent events (text/event-stream), ending in `data: [DONE]`.")
    stream_options: StreamOptions | None = None
    stop: Stop = Field(None, description=f"Up to {MAX_STOPS} non-empty strings that end the output (not included, "
                       "unless include_stop_str_in_output).")
    stop_token_ids: Annotated[list[Int(ge=0)], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="vLLM's: token ids that end the output (the last of its tokens; its text only with "
                          "include_stop_str_in_output).")
    include_stop_str_in_output: bool = Field(False, description="vLLM's: keep the stop string that ended the "
                                             "output, or the text of the stop token (EOS or of stop_token_ids), "
                                             "in the text.")
    skip_special_tokens: bool = Field(True, description="vLLM's: false shows special tokens in the text.")
    spaces_between_special_tokens: bool = Field(True, description="vLLM's; accepted, not applied (as vLLM V1 with a "
                                                "fast tokenizer): special tokens shown are written as the tokenizer "
                                                "decodes them.")
    allowed_token_ids: Annotated[list[Int(ge=0)], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None = (
        Field(None, description="vLLM's: the only tokens the output may hold (EOS too only if listed); not with "
                                "response_format, structured_outputs or a forced tool call."))
    bad_words: Annotated[list[NonEmptyText], Field(max_length=MAX_BAD_WORDS)] | None = Field(
        None, description=f"vLLM's: up to {MAX_BAD_WORDS} words (or phrases) the output may not contain, as they "
                          "tokenize alone and after a space; not with response_format, structured_outputs or a "
                          "forced tool call.")
    truncate_prompt_tokens: Int(ge=1) | Literal[-1] | None = Field(
        None, description="vLLM's: keep only the prompt's last k tokens (after the chat template); -1: the "
                          "model's context.")
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="vLLM's: where truncate_prompt_tokens cuts: left (the default) keeps the last k "
                          "tokens, right the first k.")
    seed: Int(ge=0) | None = Field(None, description="Any non-negative integer, used modulo 2^63; choice j of a "
                                   "prompt uses seed + j.")
    user: Text | None = None
    priority: Int(ge=-2**31, le=2**31 - 1) = Field(
        0, description="vLLM's: with the server's scheduling_policy priority, lower values are scheduled first "
                       "(and preempted last); with fcfs (the default) only 0.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_REPETITION_PENALTY,
                                      description=f"vLLM's (Hugging Face's); below {MIN_REPETITION_PENALTY:g} it "
                                                  f"acts as {MIN_REPETITION_PENALTY:g}.")
    logit_bias: LogitBias | None = Field(None, description="Token id (as a string) to a bias added to its logit "
                                         "before sampling.")
    response_format: ResponseFormat | None = Field(None, description="JSON output: any object, or a value of a "
                                                   "schema (the output follows it token by token).")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's; not with response_format.")
    prompt_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = Field(
        None, description="vLLM's: the log-probability and rank of each prompt token after the first, with this "
                          "many likeliest alternatives, as `prompt_logprobs` (a completion choice's; chat: the "
                          "response's): null for the first token, then token id (a string) to {logprob, rank, "
                          "decoded_token}. Not with stream above 0 (as vLLM; 0 with stream shows nothing); "
                          "vLLM's -1 (the whole vocabulary) is not served.")
    cache_salt: NonEmptyText | None = Field(
        None, description="vLLM's: prompts share cached prefixes (the prefix cache, here and in the decode pool's "
                          "K/V it keeps) only with requests of the same salt, so no other client can tell from "
                          "the timing what was asked before. Use a long random secret per tenant.")
    return_tokens_as_token_ids: bool | None = Field(
        None, description="vLLM's: with logprobs, each token (and alternative) shown as `token_id:{id}`, so "
                          "that a token no string stands for alone (a piece of a character) is identified.")
    request_id: RequestId | None = Field(None, description=REQUEST_ID_FIELD)
    return_token_ids: bool | None = Field(
        None, description="vLLM's: the prompt's token ids as `prompt_token_ids` (chat: the response's, on a stream's "
                          "first chunk; completions: each choice's, on its first chunk) and each choice's output "
                          "token ids as `token_ids` (streamed: a chunk's new ones).")

    @model_validator(mode="after")
    def _one_structure(self):
        if self.structured_outputs is not None and self.response_format is not None:
            raise ValueError("give response_format or structured_outputs, not both")
        if self.prompt_logprobs and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true")
        for name in ("allowed_token_ids", "bad_words"):
            if getattr(self, name) is not None and Sampling.structured(self) is not None:
                raise ValueError(f"{name} cannot be combined with response_format or structured_outputs")
        return self

    def structured(self, syntax: CallSyntax = HERMES) -> StructuredOutput | None:
        """The grammar the output follows; `syntax`: the template's tool call syntax (chat)."""
        if self.structured_outputs is not None:
            return self.structured_outputs.structured()
        return None if self.response_format is None else self.response_format.structured()

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(t), b) for t, b in (self.logit_bias or {}).items())

    def stop_list(self, syntax: CallSyntax = HERMES) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def logprob_count(self) -> int | None:
        """Alternatives per token the client asked for; None = no logprobs."""
        raise NotImplementedError

    def prompt_logprob_count(self) -> int | None:
        """The same for the prompt's tokens (vLLM's prompt_logprobs, and completions' `echo`), as
        the engine computes them; None = none."""
        return self.shown_prompt_logprobs()

    def shown_prompt_logprobs(self) -> int | None:
        """vLLM's `prompt_logprobs` where the response shows them (not streamed); None = not."""
        return None if self.stream else self.prompt_logprobs

    @property
    def prompt_only(self) -> bool:
        """Return the prompt alone, nothing generated (completions: echo with max_tokens 0)."""
        return False

    def sampling_params(self, max_tokens: int, syntax: CallSyntax = HERMES) -> SamplingParams:
        """`syntax`: the chat template's tool call syntax (router/tools.py)."""
        temperature = 0.0 if self.temperature < GREEDY_BELOW_TEMPERATURE else self.temperature
        return SamplingParams(temperature=temperature, top_p=max(self.top_p, MIN_TOP_P), top_k=max(self.top_k, 0),
                              min_p=self.min_p, max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens),
                              stop=self.stop_list(syntax), stop_token_ids=tuple(self.stop_token_ids or ()),
                              ignore_eos=self.ignore_eos,
                              seed=None if self.seed is None else self.seed % 2**63,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=max(self.repetition_penalty, MIN_REPETITION_PENALTY),
                              logprobs=self.logprob_count(),
                              prompt_logprobs=self.prompt_logprob_count(),
                              logit_bias=self.logit_bias_pairs(), structured=self.structured(syntax),
                              allowed_token_ids=tuple(self.allowed_token_ids or ()),
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skips_special_tokens(syntax), priority=self.priority,
                              cache_salt=self.cache_salt)

    def skips_special_tokens(self, syntax: CallSyntax) -> bool:
        """skip_special_tokens as the engine applies it (chat: false where calls open with a special
        token, as vLLM's Mistral parser has it, or they could not be found in the text)."""
        return self.skip_special_tokens

    def bad_word_ids(self, encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
        """bad_words as the engine bans them: each word's tokens as `encode` (no special tokens)
        gives them at the start of a text and after a space (vLLM's two spellings), each once."""
        ids = dict.fromkeys(tuple(encode(prefix + word.lstrip())) for word in self.bad_words or ()
                            for prefix in ("", " "))
        return tuple(word for word in ids if word)

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's token ids after truncate_prompt_tokens (`ids` itself when nothing is cut)."""
        return truncate(ids, self.truncate_prompt_tokens, self.truncation_side, max_model_len)

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the output's <tool_call> blocks are tool calls (chat with tools)."""
        return False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk with `usage` so far (vLLM's continuous_usage_stats, only with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


def as_prompts(v) -> list:
    """A completion's `prompt` (or an embedding request's `input`) as a list of prompts: a string or a
    token list is one prompt."""
    return [v] if isinstance(v, str) or (v and isinstance(v[0], int)) else list(v)


class CompletionRequest(Sampling):
    """A completion of one prompt or a batch. Across fields: prompts x n is at most 16,
    max_tokens 0 needs echo, and allowed_token_ids and bad_words take no response_format or
    structured_outputs."""
    model_config = ConfigDict(json_schema_extra=COMPLETION_CROSS_FIELD)
    prompt: (NonEmptyText | TokenIds | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]) = Field(
        description=f"A string, a list of token ids, or a batch of up to {MAX_PROMPTS} of either (one kind).")
    max_tokens: Int(ge=0) | None = Field(MAX_TOKENS_DEFAULT_COMPLETION, description="0 only with echo: the prompt "
                                         "alone (with its logprobs), nothing generated; null: as many as the "
                                         "context allows. The default is at most the server's limit.")
    echo: bool = Field(False, description="The prompt before the completion (its tokens' logprobs with `logprobs`).")
    add_special_tokens: bool = Field(True, description="vLLM's: a text prompt is tokenized with the tokenizer's "
                                     "special tokens (e.g. a BOS it adds); false: as written. Token ids are "
                                     "taken as given either way.")
    logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = Field(None, description="Alternatives per token (0: the "
                                                        "chosen token's logprob only).")
    suffix: None = None
    best_of: Int(ge=1, le=1) | None = None

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

    def max_tokens_within(self, limit: int) -> int | None:
        """max_tokens as asked for; the default no higher than the server's `limit`."""
        return self.max_tokens if "max_tokens" in self.model_fields_set else min(self.max_tokens, limit)

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch (a list of strings or of token lists)."""
        return as_prompts(self.prompt)

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_logprob_count(self) -> int | None:
        counts = [k for k in (self.logprobs if self.echo else None, self.shown_prompt_logprobs()) if k is not None]
        return max(counts) if counts else None
