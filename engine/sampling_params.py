"""Per-request sampling parameters (torch-free).

`SamplingParams.validate()` returns an error string instead of raising, so the HTTP
boundary can turn it into an OpenAI error body; the engine asserts the params are valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.pooling import Pooling
from engine.structured_output import StructuredOutput

MAX_LOGPROBS = 20              # alternatives per token, as OpenAI's top_logprobs
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 300           # entries, as OpenAI
LOGIT_BIAS_RANGE = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 disable those filters; `min_p` > 0
    then drops the tokens less likely than min_p x the likeliest one (Hugging Face's order:
    temperature, top-k, top-p, min-p).
    `min_tokens` suppresses EOS and stop tokens until that many tokens were generated.
    `ignore_eos` keeps generating past EOS (benchmarks use it to fix output lengths).
    Penalties (OpenAI's and vLLM's semantics, applied before temperature, greedy included):
    `presence_penalty` is subtracted once from the logit of every token already in the output,
    `frequency_penalty` once per occurrence there; `repetition_penalty` (Hugging Face's) divides a
    positive logit and multiplies a negative one of every token in the prompt or the output.
    `logprobs` = k asks for each output token's log-probability and the k most likely
    alternatives (k = 0: the chosen token's only), under the model's own distribution: before
    penalties, temperature, filters and bans. `prompt_logprobs` = k asks the same for every
    prompt token after the first (the request then takes no prefix-cache hits: each prompt
    position must be computed).
    `logit_bias`: (token id, bias) pairs, each bias added to its token's logit after the penalties
    (OpenAI's; -100 in effect bans a token, 100 all but forces it).
    `structured`: a grammar the output must follow (engine/structured_output.py); tokens that
    would leave it are masked after the bias. Not with `min_tokens` or `ignore_eos` (a grammar
    that is complete allows only EOS).
    `allowed_token_ids` (vLLM's): when not empty, the only tokens the output may hold (masked
    after the bias; EOS too only if listed). Not with `structured`.
    `bad_words` (vLLM's, as token sequences): a sequence's last token is banned wherever the
    output's last tokens are the rest of it (a one-token sequence: always). Not with `structured`.
    Text (vLLM's semantics): a stop string is cut from the text, and the token that ended the
    output (EOS or one of `stop_token_ids`) is not in it, unless `include_stop_str_in_output`;
    either way the token is among the output's token ids. `skip_special_tokens` false shows
    special tokens (e.g. a template's markers) in the text.
    `lora`: the name of a LoRA adapter the engine serves (EngineConfig.lora_modules) to run the
    request with, None for the base model; or, with `lora_path` (the adapter's directory) and
    `lora_id` (its load's id: a name loaded again is another adapter), one the router loaded at run
    time, which the engine loads at its first request (engine.lora.LoraSet.use); `priority`
    (vLLM's): with the engine's `priority` scheduling policy, lower values are scheduled first and
    preempted last (engine/scheduler.py), with `fcfs` only 0 is accepted. `prediction` (OpenAI's
    predicted output, as token ids): what the output is expected to repeat; the engine drafts from
    it (EngineConfig.prediction_tokens), which changes how fast the output comes, not what it is.
    `pooling` (an embedding request, engine/pooling.py): the prompt's final hidden states pooled
    into one vector, no token generated.
    (Not sampling choices, but per-request settings every engine of a request needs, so they travel
    here.)
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    lora: str | None = None
    lora_path: str | None = None
    lora_id: int = 0
    priority: int = 0
    cache_salt: str | None = None
    prediction: tuple[int, ...] = ()
    detokenize: bool = True
    pooling: Pooling | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def lora_key(self) -> tuple[str, int] | None:
        """The adapter's identity in an engine (LoraSet)."""
        return None if self.lora is None else (self.lora, self.lora_id)

    @property
    def cache_key(self) -> tuple | None:
        """Whose prefix cache the request's K/V joins (BlockManager's chain_seed): its LoRA adapter's
        (its K/V differs from the base model's) and its `cache_salt`'s (vLLM's: only requests with
        the same salt share cached prefixes); None for the base model, unsalted."""
        return None if self.lora is None and self.cache_salt is None else (self.lora_key, self.cache_salt)

    @property
    def whole_prompt(self) -> bool:
        """Whether every prompt position must be computed, none taken from the prefix cache (prompt
        logprobs; a pooling over every token)."""
        return self.prompt_logprobs is not None or (self.pooling is not None and self.pooling.whole_prompt)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def validate(self) -> str | None:
        """Return a human-readable error, or None when the parameters are usable."""
        if not isinstance(self.priority, int) or not -2**31 <= self.priority < 2**31:
            return "priority must be a 32-bit integer"
        if (self.lora_path is not None or self.lora_id) and (self.lora is None or self.lora_path is None
                                                             or not 0 < self.lora_id < 2**63):
            return "a LoRA adapter loaded at run time needs its name, its path and a positive 64-bit lora_id"
        if any(type(t) is not int or t < 0 for t in self.prediction):
            return "prediction must be token ids"
        if self.pooling is not None:
            if self.logprobs is not None or self.prompt_logprobs is not None or self.structured is not None \
                    or self.prediction:
                return "an embedding request has no logprobs, structured output or prediction"
            return self.pooling.problem()
        if not 0.0 <= self.temperature <= 2.0:
            return f"temperature must be in [0, 2], got {self.temperature}"
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if not 0.0 <= self.min_p <= 1.0:
            return f"min_p must be in [0, 1], got {self.min_p}"
        if self.top_k < -1:
            return f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"
        if self.max_tokens < 1:
            return f"max_tokens must be at least 1, got {self.max_tokens}"
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            return f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            return "stop must be non-empty strings"
        if len(self.stop) > 16:
            return "at most 16 stop strings are allowed"
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            return "stop_token_ids must be non-negative integers"
        if self.seed is not None and not 0 <= self.seed < 2**63:
            return "seed must be a non-negative 64-bit integer"
        if not (-2.0 <= self.presence_penalty <= 2.0 and -2.0 <= self.frequency_penalty <= 2.0):
            return "presence_penalty and frequency_penalty must be in [-2, 2]"
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            return f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}"
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            return f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            return f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            return f"logit_bias may have at most {MAX_LOGIT_BIAS} entries"
        if any(not (isinstance(t, int) and t >= 0 and -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE)
               for t, b in self.logit_bias):
            return f"logit_bias maps token ids to biases in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]"
        if len({t for t, _ in self.logit_bias}) < len(self.logit_bias):
            return "logit_bias names a token id twice"
        if any((not isinstance(t, int)) or t < 0 for t in self.allowed_token_ids):
            return "allowed_token_ids must be non-negative integers"
        if any(not w or any((not isinstance(t, int)) or t < 0 for t in w) for w in self.bad_words):
            return "bad_words must be non-empty sequences of non-negative token ids"
        if self.structured is not None:
            if self.allowed_token_ids or self.bad_words:
                return ("structured output (response_format, a forced tool call) cannot be combined with "
                        "allowed_token_ids or bad_words")
            if self.min_tokens or self.ignore_eos:
                return "structured output (response_format) cannot be combined with min_tokens or ignore_eos"
            return self.structured.problem()
        return None


def banned_next(p: SamplingParams, eos_token_ids, token_ids: list[int], num_output_tokens: int) -> list[int]:
    """The tokens a sequence may not take next: EOS (unless ignore_eos) and stop tokens before
    min_tokens, and the last token of each bad word whose other tokens end the output
    (`token_ids`: the sequence's, prompt then output). Called each step by the engine, and by
    admission for the first token (no output yet)."""
    banned = []
    if num_output_tokens < p.min_tokens:
        banned += [*p.stop_token_ids, *([] if p.ignore_eos else eos_token_ids)]
    for word in p.bad_words:
        before = len(word) - 1
        if before <= num_output_tokens and tuple(token_ids[len(token_ids) - before:]) == word[:-1]:
            banned.append(word[-1])
    return banned
