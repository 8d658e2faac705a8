"""Admission: whether the engine can serve a request, and the state it keeps beside the
request's Sequence once it does.

Who calls: `LLMEngine.add_request` and `add_prefilled`, once per request, through `admit`
(`LLMEngine.check_request` through `check`); both on the engine's thread. `precompile` (any
thread, through `LLMEngine.prepare`) compiles a request's grammar ahead, so that `admit` finds
it compiled. Admission allocates no
blocks (the scheduler allocates a queued prompt's, a decode-role request comes with its
reservation) and keeps nothing of a request it rejects. A request admitted here is rebuilt to
where its client stands: `resumed` output tokens replayed through its detokenizer and its grammar
matcher, its random stream advanced past the draws made for them.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.ngram import NgramIndex
from engine.outputs import Rejected, TokenLogprobs
from engine.pooled import Pooled
from engine.prediction import PredictionIndex
from engine.sampler import PenaltyState, make_generator, skip_draw
from engine.sampling_params import SamplingParams, banned_next
from engine.sequence import Sequence
from engine.structured_output import GrammarCompiler, Matcher, StructuredOutput, ThinkFirst


@dataclass
class EngineRequest:
    seq: Sequence
    detok: IncrementalDetokenizer | None
    generator: torch.Generator | None
    # Prompt logprobs collected so far (position p's entry is token p + 1's); None once handed
    # out with the first token, or when the request did not ask for them.
    prompt_logprobs: list[TokenLogprobs] | None = None
    penalty: PenaltyState | None = None   # penalized requests, from their first sampling step
    matcher: Matcher | ThinkFirst | None = None   # structured output: where its output stands in the grammar
    ngram: NgramIndex | None = None       # speculative decoding: its tokens' n-grams, from its first draft
    prediction: PredictionIndex | None = None   # its predicted output's n-grams, from its first draft
    draft_predicted: bool = False    # its draft this step came from the prediction (read only with a draft)
    prediction_fed: int = 0          # draft tokens taken from the prediction so far, and those the output repeated
    prediction_kept: int = 0
    pooled: Pooled | None = None     # an embedding request's pooling so far (SamplingParams.pooling)


class Admission:
    """`vocab_size`: the model's (logits' width); `seed`: the engine's, for the seeds of sampled
    requests that bring none; `loras`: the names of the LoRA adapters the engine serves from its
    configuration (a request may also bring one's path: LLMEngine loads it);
    `priorities`: whether the engine schedules by priority (else only priority 0 is served)."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int],
                 device: torch.device, seed: int | None, loras: frozenset[str] = frozenset(),
                 priorities: bool = False):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.loras, self.priorities = loras, priorities
        self.eos_token_ids, self.device = eos_token_ids, device
        self._rng = random.Random(seed)
        self.grammars: GrammarCompiler | None = None   # at the first structured-output request
        self._grammars_lock = threading.Lock()

    def check(self, num_prompt_tokens: int, params: SamplingParams) -> str | None:
        """The reason a request cannot be served, or None."""
        if num_prompt_tokens < 1:
            return "the prompt is empty"
        error = params.validate()
        if error:
            return error
        if params.priority and not self.priorities:
            return "priority is only served with scheduling_policy priority (this engine's is fcfs)"
        if params.lora is not None and params.lora_path is None and params.lora not in self.loras:
            served = ', '.join(sorted(self.loras)) or 'none'
            return f"LoRA adapter {params.lora!r} is not served here (adapters served: {served})"
        if any(t >= self.vocab_size for t, _ in params.logit_bias):
            return f"logit_bias: token id out of range (vocabulary size {self.vocab_size})"
        for name, ids in (("allowed_token_ids", params.allowed_token_ids),
                          ("bad_words", [t for word in params.bad_words for t in word]),
                          ("prediction", params.prediction),                 # fed to the model as drafts
                          ("labels", params.pooling.labels if params.pooling is not None else ())):
            if any(t >= self.vocab_size for t in ids):
                return f"{name}: token id out of range (vocabulary size {self.vocab_size})"
        if params.allowed_token_ids:       # what the first token may not be
            if set(params.allowed_token_ids) <= set(banned_next(params, self.eos_token_ids, [], 0)):
                return ("allowed_token_ids: every allowed token is banned at first (by bad_words, or as EOS or a "
                        "stop token before min_tokens)")
        if params.structured is not None and params.structured.think is not None and any(
                t >= self.vocab_size for t in params.structured.think[:2]):
            return f"structured output's think: token id out of range (vocabulary size {self.vocab_size})"
        if params.pooling is not None:          # no output tokens
            if num_prompt_tokens > self.max_model_len:
                return (f"this model's maximum context length is {self.max_model_len} tokens; the input has "
                        f"{num_prompt_tokens} tokens")
        elif num_prompt_tokens + params.max_tokens > self.max_model_len:
            return (f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                    f"{num_prompt_tokens} tokens and max_tokens is {params.max_tokens}")
        return None

    def admit(self, request_id: str, prompt: list[int], params: SamplingParams, hold_blocks: bool,
              resumed: list[int] = (), shown_chars: int = 0, draws: int = 0) -> EngineRequest | Rejected:
        """The request's state, or why it cannot be served. `resumed` output tokens are replayed
        through the detokenizer, `shown_chars` of their text counted as shown; a seeded request's
        random stream skips `draws` draws (one per token sampled before)."""
        error = self.check(len(prompt), params)
        if error is None and len(resumed) >= params.max_tokens:
            error = f"the resumed output already has {len(resumed)} tokens of max_tokens {params.max_tokens}"
        if error is not None:
            return Rejected(request_id, error)
        seq = Sequence(request_id, [*prompt, *resumed], params, hold_blocks=hold_blocks, num_prompt_tokens=len(prompt))
        detok = None
        if params.detokenize and params.pooling is None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt, params.stop, params.include_stop_str_in_output,
                                           params.skip_special_tokens)
            for k, token in enumerate(resumed, 1):
                detok.check_stop = k >= params.min_tokens
                detok.add(token)
            if detok.stopped:
                return Rejected(request_id, "the resumed output already ends at a stop string")
            detok.emitted = shown_chars
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            generator = make_generator(seed, self.device)
            for _ in range(draws):
                skip_draw(generator)
        req = EngineRequest(seq, detok, generator, [] if params.prompt_logprobs is not None and not resumed else None)
        if params.pooling is not None:
            req.pooled = Pooled(params.pooling)
        if params.structured is not None:
            req.matcher = self._matcher(params, resumed)
            if isinstance(req.matcher, str):
                return Rejected(request_id, req.matcher)
        return req

    def precompile(self, spec: StructuredOutput) -> None:
        """Any thread: check `spec` and compile its grammar into the compiler's cache (building the
        compiler at the first spec), so that admitting a request with it copies a compiled matcher
        (~0.02 ms) on the engine thread instead of compiling there (up to tens of ms for a tool set,
        while every running request waits). A spec that fails is left for `admit` to report."""
        compiler = self._compiler()
        if spec.problem() is None and isinstance(compiler, GrammarCompiler):
            compiler.compile(spec)

    def compiled(self, spec: StructuredOutput) -> bool:
        """Any thread: whether `spec`'s grammar is compiled already (admission only copies it)."""
        return self.grammars is not None and self.grammars.has(spec)

    def _compiler(self) -> GrammarCompiler | str:
        """The engine's grammar compiler, or why this tokenizer has none."""
        with self._grammars_lock:
            if self.grammars is None:
                try:
                    self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, list(self.eos_token_ids))
                except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer llguidance cannot read (not a fast one)
                    return f"structured output is not available with this model's tokenizer ({exc})"
            return self.grammars

    def _matcher(self, params: SamplingParams, resumed: list[int]) -> Matcher | ThinkFirst | str:
        """A request's grammar matcher, past its `resumed` output tokens, or why there is none."""
        compiler = self._compiler()
        if isinstance(compiler, str):
            return compiler
        matcher = compiler.matcher(params.structured)
        problem = matcher.problem()
        if problem is not None:
            return f"structured output: {problem}"
        if not all(matcher.accept(t) for t in resumed):
            return "the resumed output does not follow the structured output's grammar"
        return matcher
