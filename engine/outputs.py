"""What the engine hands back per step and per finished request (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprobs:
    """One output token's log-probability under the model and the `k` most likely tokens
    with theirs, most likely first (k = the request's `logprobs`; may or may not include the
    chosen token). `rank`: the token's place in the model's distribution (1: the likeliest;
    1 + the number of tokens more likely than it), computed for prompt tokens only (vLLM's
    `prompt_logprobs` show it), else None. Also a wire type: the replicas send it to the router
    inside messages."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class Rejected:
    """A request the engine refused at admission (`LLMEngine.check_request`'s reason, e.g. a
    prompt longer than the context): nothing was allocated and the caller still owns whatever it
    passed in (a decode replica's reservation). A value, not an exception, so a replica turns it
    into an error (`code`, an HTTP status: 400, or 503 for a refusal to retry) without a second
    engine round trip."""

    request_id: str
    reason: str
    code: int = 400


@dataclass
class RequestOutput:
    """One request's progress in one step.

    finish_reason: "stop" (EOS, stop token or stop string), "length" (max_tokens or the
    model's context), "abort", or None while running. A prefill-role request finishes after
    its first token with finish_reason None when it should go on decoding elsewhere. `error`: the
    request failed on its own (its grammar could not go on; the other requests of the step went
    on): finished, "abort", its blocks freed, and the replica reports the error with the HTTP
    status `error_code` (400: the request's grammar cannot be followed with this vocabulary).
    `accepted_prediction_tokens`, `rejected_prediction_tokens`: so far, of the draft tokens taken
    from the request's predicted output (SamplingParams.prediction), those its output repeated and
    the others (OpenAI's usage details). `embedding`: an embedding request's vector
    (SamplingParams.pooling), little-endian float32 bytes, on its one output.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() the scheduler first admitted it
    logprobs: list[TokenLogprobs] | None = None  # one per new token when the request asked for them
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 2..n, with the first token
    error: str | None = None
    error_code: int = 500
    stop_reason: str | int | None = None   # vLLM's: the stop string or stop token id that ended it (not EOS)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    embedding: bytes | None = None

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This output and the same request's next one as a single output (the tokens, text and
        logprobs of both, in order; the later one's state). A stream whose reader fell behind hands
        on what is ready this way: one message instead of one per step."""
        assert later.request_id == self.request_id and not self.finished
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            [*(self.logprobs or ()), *(later.logprobs or ())]
        return RequestOutput(self.request_id, self.new_token_ids + later.new_token_ids,
                             self.new_text + later.new_text, later.finished, later.finish_reason,
                             later.num_prompt_tokens, later.num_output_tokens,
                             max(self.num_cached_tokens, later.num_cached_tokens),
                             self.first_scheduled_time if self.first_scheduled_time is not None
                             else later.first_scheduled_time,
                             logprobs, self.prompt_logprobs or later.prompt_logprobs, later.error,
                             later.error_code, later.stop_reason, later.accepted_prediction_tokens,
                             later.rejected_prediction_tokens, later.embedding)


@dataclass
class Completion:
    """A whole finished request, as the synchronous `generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop_reason: str | int | None = None

    def add(self, out: RequestOutput) -> None:
        self.prompt_logprobs.extend(out.prompt_logprobs or ())
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.logprobs or ())
        self.text += out.new_text
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
