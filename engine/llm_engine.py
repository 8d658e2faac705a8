"""The engine: one step is schedule, run, postprocess.

Life cycle of a request in the engine
  1. `add_request` (colocated or prefill role) queues a prompt; `add_prefilled` (decode
     role) admits a prompt whose K/V was imported into reserved blocks, with its first token.
     Both check the request first (`check_request`) and return a `Rejected` instead of
     admitting one that cannot be served: check and admit are one engine call
     (engine/admission.py checks and builds the request's state; a request bringing the path
     of a LoRA adapter loaded at run time has it read here, engine/lora.py). Both also take a
     resumed request: the prompt plus the output tokens a client already has (`resumed`; the
     router moves a request whose replica died this way), which count as output (max_tokens,
     min_tokens, penalties, stop strings, structured output) and whose text is not shown again.
  2. `step` places the LoRA adapters loaded at run time of the waiting requests it may start
     (engine/lora_places.py: a request whose adapter finds `max_loras` in use waits while one of
     them drains), drafts tokens when it speculates (prompt lookup, engine/ngram.py), schedules
     chunks under the token budget, runs one ragged forward (collecting the
     prompt logprobs of requests that ask for them), samples the chunks that reached their
     last token (a structured-output request among the tokens its grammar allows next), and
     checks stop conditions.
  3. A finished request's blocks are freed in the same step, except in the prefill role
     (`hold_blocks`), where they stay held for export until `release`.
  4. `abort` ends a request at any stage and frees whatever it holds.
Only one thread may call an `LLMEngine` (the async wrapper owns that thread), `prepare` and
`needs_prepare` excepted.
"""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from engine.admission import Admission, EngineRequest
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.lora_config import NO_ROOM
from engine.lora_places import LoraPlaces
from engine.model_runner import ModelRunner
from engine.ngram import propose_drafts
from engine.outputs import Completion, Rejected, RequestOutput, TokenLogprobs
from engine.sampler import PenaltyState, SampleRow, prompt_logprobs, sample
from engine.sampling_params import SamplingParams, banned_next
from engine.scheduler import Scheduler
from engine.sequence import ScheduledChunk, Sequence, SequenceStatus


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        windows = self.runner.model.windows       # per layer: 0 (every key) or its sliding window
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                          window=max(windows) if all(windows) else 0)
        self.lora_places = LoraPlaces(self.runner.loras)      # for adapters loaded at run time
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.scheduling_policy, gate=self.lora_places.gate)
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = self._eos_ids()
        self.admission = Admission(self.tokenizer, self.runner.vocab_size, self.max_model_len, self.eos_token_ids,
                                   self.runner.device, config.seed, frozenset(config.lora_modules),
                                   config.scheduling_policy == "priority")
        self._requests: dict[str, EngineRequest] = {}
        self.num_draft_tokens = 0        # speculative decoding: draft tokens fed, and those kept
        self.num_accepted_tokens = 0

    def _eos_ids(self) -> frozenset[int]:
        ids = set()
        gen = self.runner.generation_config
        eos = getattr(gen, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        ids.add(self.tokenizer.eos_token_id)
        return frozenset(i for i in ids if i is not None)

    # ---- 1. admission -------------------------------------------------------------------------
    def check_request(self, request_id: str, num_prompt_tokens: int, params: SamplingParams) -> str | None:
        """The reason a request cannot be served, or None. `add_request` and `add_prefilled`
        call it before admitting anything (engine/admission.py)."""
        return self._id_in_use(request_id) or self.admission.check(num_prompt_tokens, params)

    def prepare(self, params: SamplingParams) -> None:
        """Any thread, before `add_request`/`add_prefilled`: what admission would do on the
        engine thread while every running request waits, done ahead: compile a structured-output
        request's grammar (`Admission.precompile`) and read a LoRA adapter loaded at run time
        (`LoraSet.prepare`). A failure is left for admission to report."""
        if params.structured is not None:
            self.admission.precompile(params.structured)
        if params.lora_path is not None:
            self.runner.loras.prepare(params.lora, params.lora_id, params.lora_path)

    def needs_prepare(self, params: SamplingParams) -> bool:
        """Any thread: whether `prepare` has work to do for these parameters."""
        return ((params.structured is not None and not self.admission.compiled(params.structured))
                or (params.lora_path is not None and self.runner.loras.needs(params.lora_key)))

    def _id_in_use(self, request_id: str) -> str | None:
        return f"request id {request_id!r} is already in use" if request_id in self._requests else None

    def _new_request(self, request_id, prompt, params, hold_blocks, resumed=(), shown_chars=0,
                     draws=0, landed=False) -> EngineRequest | Rejected:
        """A LoRA adapter loaded at run time is read here and placed before the step that starts the
        request (engine/lora_places.py); `landed`: the request's K/V is here already (decode role): its
        adapter is placed now where a place is free and none is parked (else the request is parked:
        add_prefilled)."""
        if in_use := self._id_in_use(request_id):
            return Rejected(request_id, in_use)
        req = self.admission.admit(request_id, prompt, params, hold_blocks, resumed, shown_chars, draws)
        if isinstance(req, EngineRequest) and params.lora_path is not None:     # loaded at run time
            why = self.lora_places.admit(params, landed, self.scheduler)
            if why is not None and why is not NO_ROOM:
                return Rejected(request_id, why)
        if isinstance(req, EngineRequest):
            self._requests[request_id] = req
        return req

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    hold_blocks: bool = False, resumed: list[int] = (), shown_chars: int = 0) -> Rejected | None:
        """Queue a prompt, or return why it cannot be served (nothing queued). `hold_blocks`
        (prefill role): finish after the first token and keep the blocks for `export_kv` until
        `release`. `resumed`: output tokens the client already has (their K/V is computed with the
        prompt's, the first token sampled is the one after them; no prompt logprobs), of which it
        was shown `shown_chars` characters of text: the text returned starts after them. A seeded
        request draws what one uninterrupted engine would have."""
        req = self._new_request(request_id, prompt_token_ids, params, hold_blocks, resumed, shown_chars,
                                draws=len(resumed))
        if isinstance(req, Rejected):
            return req
        self.scheduler.add(req.seq)
        return None

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token: int, params: SamplingParams,
                      block_ids: list[int], shown_chars: int = 0, resumed: list[int] = ()) -> RequestOutput | Rejected:
        """Decode role: admit a request whose prompt K/V now lies in `block_ids` (from
        `reserve`, filled by `import_kv` or a transfer). Ownership of the blocks passes to
        the engine here, even when the first token already ends the request; a `Rejected`
        request leaves them with the caller (who releases the reservation). `shown_chars`
        characters of output text were already shown (the prefill engine's first output's
        `new_text`): the text returned from here on starts after them. The returned output
        (the first token) has no logprobs: the prefill engine computed them. A seeded sampled
        request continues its random stream after the first token's draw, so the split draws
        what one engine draws. `resumed` (a resumed request, see `add_request`): the output tokens
        before `first_token`, whose K/V came with the prompt's; `shown_chars` then counts their
        text too. A request whose LoRA adapter loaded at run time finds `max_loras` in use is parked
        with its blocks (Scheduler.add_running) and decodes once one is free."""
        # the prefill engine drew `first_token` (after the resumed ones) from this seed
        req = self._new_request(request_id, list(prompt_token_ids), params, False, list(resumed), shown_chars,
                                draws=len(resumed) + 1, landed=True)
        if isinstance(req, Rejected):
            return req
        seq = req.seq
        if req.matcher is not None and not req.matcher.accept(first_token):
            del self._requests[request_id]
            return Rejected(request_id, "the first token does not follow the structured output's grammar")
        self.block_manager.adopt(seq, block_ids, len(seq))
        seq.token_ids.append(first_token)
        self.scheduler.add_running(seq)
        return self._after_token(req, first_token)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request wherever it is and free what it holds. None if unknown."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        seq = req.seq
        if seq.status is SequenceStatus.FINISHED:
            if seq.block_table:          # a prefill-role request still held for export
                self.block_manager.free(seq)
        else:
            self.scheduler.finish(seq, "abort")
        return self._output(req, [], "abort", True)

    # ---- 2. the step ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def live_request_ids(self) -> list[str]:
        """Requests not yet ended: queued, running, or held for export."""
        return list(self._requests)

    def unfinished_request_ids(self) -> list[str]:
        """Requests a step may still touch: queued or running, not those held for export
        (finished; their blocks stay held until `release`, whatever happens to later steps)."""
        return [rid for rid, req in self._requests.items() if not req.seq.is_finished]

    def step(self) -> list[RequestOutput]:
        failed = self.lora_places.place(self.scheduler, lambda seq, why: self._fail(self._requests[seq.request_id],
                                                                                     why, 400))
        drafted = propose_drafts(self.scheduler.running, self._requests, self.config.speculative_tokens,
                                 self.config.speculative_max_batch, self.max_model_len, self.config.prediction_tokens)
        try:
            chunks = self.scheduler.schedule()
            if not chunks:
                for seq in drafted:
                    seq.take_draft()
                return failed
            spans = self._hidden_spans(chunks)
            out = self.runner.run(chunks, spans)
        except BaseException:
            for seq in drafted:       # a failed step leaves no proposed token behind
                seq.take_draft()
            raise
        for i, (a, b) in spans.items():
            ch = chunks[i]
            req = self._requests[ch.seq.request_id]
            if req.pooled is not None:
                req.pooled.add(ch.start + a, out.hidden[i])
                continue
            targets = ch.seq.token_ids[ch.start + a + 1:ch.start + b + 1]
            req.prompt_logprobs += prompt_logprobs(self.runner.lm_head, out.hidden[i], targets,
                                                   ch.seq.params.prompt_logprobs)
        outputs = self._postprocess(chunks, out.logits, drafted)
        return failed + self._embedded(chunks) + outputs

    def _hidden_spans(self, chunks: list[ScheduledChunk]) -> dict[int, tuple[int, int]]:
        """{chunk index: (first, last) row offsets} of the rows in this step whose final hidden states
        a request still lacks: the prompt positions whose logprobs it asked for (position p gives token
        p + 1's), or those an embedding request pools (engine/pooling.py); a recomputation after
        preemption collects none twice."""
        spans = {}
        for i, ch in enumerate(chunks):
            req = self._requests[ch.seq.request_id]
            if req.pooled is not None:
                rows = req.pooled.rows(ch.start, ch.num_tokens, ch.seq.num_prompt_tokens)
                if rows is not None:
                    spans[i] = rows
                continue
            if req.prompt_logprobs is None:
                continue
            first = max(ch.start, len(req.prompt_logprobs))
            last = min(ch.start + ch.num_tokens, ch.seq.num_prompt_tokens - 1)
            if first < last:
                spans[i] = (first - ch.start, last - ch.start)
        return spans

    def _embedded(self, chunks: list[ScheduledChunk]) -> list[RequestOutput]:
        """The embedding requests whose prompt's last chunk ran this step: each ends with its vector
        (RequestOutput.embedding), its blocks freed (their K/V stays in the prefix cache)."""
        outputs = []
        for ch in chunks:
            if ch.seq.params.pooling is None or ch.start + ch.num_tokens < len(ch.seq):
                continue
            req = self._requests[ch.seq.request_id]
            self.scheduler.finish(req.seq, "stop")
            del self._requests[req.seq.request_id]
            out = self._output(req, [], "stop", True)
            out.embedding = req.pooled.vector(req.seq.num_prompt_tokens, self.runner.lm_head)
            outputs.append(out)
        return outputs

    def _postprocess(self, chunks: list[ScheduledChunk], logits, drafted: list[Sequence]) -> list[RequestOutput]:
        """Count the fed tokens as computed, take every draft back, then sample in rounds: round j
        samples row j of each chunk still in play, and a chunk goes on to round j + 1 only while
        its token j equals its draft token j (whose K/V this step computed). Each token is sampled
        as without drafts (same row processing, one draw of its generator), so drafts change how
        many tokens a step yields, not which: exactly in float32, where a row's logits do not
        depend on the rows beside it (in bf16 they do a little, as in any bigger batch)."""
        for ch in chunks:
            ch.seq.num_computed_tokens += ch.num_tokens
            if not ch.num_draft:
                self.block_manager.mark_computed(ch.seq)
        drafts = {seq.request_id: seq.take_draft() for seq in drafted}
        play, row = [], 0          # (request, its first logits row, its draft) per sampling chunk
        for ch in chunks:
            if ch.sample:
                draft = drafts.get(ch.seq.request_id, [])
                assert len(draft) == ch.num_draft     # the scheduler trimmed the draft to the chunk
                req = self._requests[ch.seq.request_id]
                if draft and req.draft_predicted:
                    req.prediction_fed += len(draft)
                play.append((req, row, draft))
            row += ch.num_logits
        for req, _, _ in play:
            if req.penalty is None and req.seq.params.penalized:   # built once, then kept up by sample()
                req.penalty = PenaltyState(req.seq.token_ids, req.seq.num_prompt_tokens, logits.shape[-1],
                                           logits.device)
        outputs: dict[str, RequestOutput] = {}
        j = 0
        while play:
            play = self._sample_round(play, j, logits, outputs)
            j += 1
        for ch in chunks:
            if ch.num_draft:
                self.block_manager.mark_computed(ch.seq)
                self.num_draft_tokens += ch.num_draft
        return list(outputs.values())

    def _sample_round(self, play: list, j: int, logits, outputs: dict[str, RequestOutput]) -> list:
        """Sample token j of every request in `play` (its row first + j); add each output to
        `outputs` (merged with the request's earlier one this step); return those whose token j
        was their draft token j and that go on."""
        rows, kept = [], []
        for req, first, draft in play:
            allowed = None if req.matcher is None else req.matcher.bitmask()
            if req.matcher is not None and req.matcher.problem() is not None:
                self._add_output(outputs, self._grammar_failed(req))
                continue
            banned = banned_next(req.seq.params, self.eos_token_ids, req.seq.token_ids, req.seq.num_output_tokens)
            if req.seq.params.allowed_token_ids and not self._any_allowed(req.seq.params, banned):
                self._add_output(outputs, self._fail(req, "no token may come next: bad_words ban every token of "
                                                          "allowed_token_ids here", 400))
                continue
            kept.append((req, first, draft))
            rows.append(SampleRow(req.seq.params, req.generator, banned, req.penalty, allowed))
        if not rows:
            return []
        index = [first + j for _, first, _ in kept]
        whole = index == list(range(logits.shape[0]))
        tokens, logprobs = sample(logits if whole else logits[index], rows)
        going_on = []
        for (req, first, draft), tok, lp in zip(kept, tokens, logprobs):
            # The mask lets only tokens the matcher accepts through, except where llguidance's mask
            # and parser disagree (a regex of control bytes that SmolLM2's vocabulary cannot write)
            if req.matcher is not None and not req.matcher.accept(tok):
                self._add_output(outputs, self._grammar_failed(req))
                continue
            req.seq.token_ids.append(tok)
            kept_draft = j < len(draft) and tok == draft[j]       # the model picked draft token j
            if kept_draft and req.draft_predicted:
                req.prediction_kept += 1
            out = self._after_token(req, tok, lp)
            self._add_output(outputs, out)
            if kept_draft and not out.finished:
                req.seq.num_computed_tokens += 1            # the draft token's K/V is this token's
                self.num_accepted_tokens += 1
                going_on.append((req, first, draft))
        return going_on

    @staticmethod
    def _add_output(outputs: dict[str, RequestOutput], out: RequestOutput) -> None:
        earlier = outputs.get(out.request_id)
        outputs[out.request_id] = out if earlier is None else earlier.merge(out)

    def _grammar_failed(self, req: EngineRequest) -> RequestOutput:
        """The request's grammar cannot go on with this vocabulary: a 400, as a grammar that fails
        at admission is."""
        return self._fail(req, f"the output cannot follow the structured output's grammar: {req.matcher.problem()}",
                          400)

    def _fail(self, req: EngineRequest, error: str, code: int) -> RequestOutput:
        """End one request that cannot go on (its blocks freed), the step's others unharmed."""
        out = self.abort(req.seq.request_id)
        out.error, out.error_code = error, code
        return out

    @staticmethod
    def _any_allowed(p: SamplingParams, banned: list[int]) -> bool:
        """Whether a token of `p.allowed_token_ids` is left after `banned`."""
        return not banned or not set(p.allowed_token_ids) <= set(banned)

    # ---- 3. stop checks and outputs ------------------------------------------------------------
    def _after_token(self, req: EngineRequest, token: int, logprobs: TokenLogprobs | None = None) -> RequestOutput:
        seq, p = req.seq, req.seq.params
        k = seq.num_output_tokens
        stop_token = k >= p.min_tokens and ((not p.ignore_eos and token in self.eos_token_ids)
                                            or token in p.stop_token_ids)
        if req.detok is not None:
            req.detok.check_stop = k >= p.min_tokens
            if not stop_token or p.include_stop_str_in_output:   # the token that ends it: not in the text
                req.detok.add(token)
        reason = stop_reason = None
        if stop_token:                     # vLLM's stop_reason: a stop token's id, none for EOS
            reason = "stop"
            stop_reason = None if not p.ignore_eos and token in self.eos_token_ids else token
        elif k >= p.min_tokens and req.detok is not None and req.detok.stopped:
            reason, stop_reason = "stop", req.detok.stop_string
        elif k >= p.max_tokens or len(seq) >= self.max_model_len:
            reason = "length"
        done = reason is not None or seq.hold_blocks
        if done:
            self.scheduler.finish(seq, reason, keep_blocks=seq.hold_blocks)
            if not seq.hold_blocks:
                del self._requests[seq.request_id]
        out = self._output(req, [token], reason, done, None if logprobs is None else [logprobs])
        out.stop_reason = stop_reason
        if req.prompt_logprobs:            # with the first token, once
            out.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
        return out

    def _output(self, req: EngineRequest, new_ids: list[int], reason, finished: bool,
                logprobs: list[TokenLogprobs] | None = None) -> RequestOutput:
        seq = req.seq
        # A prefill-role request that goes on decoding elsewhere keeps its held-back tail (a
        # possible start of a stop string): the decode engine decides it.
        final = finished and not (seq.hold_blocks and reason is None)
        text = req.detok.take(final=final) if req.detok is not None else ""
        return RequestOutput(seq.request_id, new_ids, text, finished, reason, seq.num_prompt_tokens,
                             seq.num_output_tokens, seq.num_cached_tokens, seq.first_scheduled_time, logprobs,
                             accepted_prediction_tokens=req.prediction_kept,
                             rejected_prediction_tokens=req.prediction_fed - req.prediction_kept)

    # ---- 4. KV hand-off ---------------------------------------------------------------------------
    def held_blocks(self, request_id: str) -> list[int]:
        """Prefill role: the blocks holding a finished request's prompt K/V (in order; a resumed
        request's resumed tokens' too: every token before the first one sampled)."""
        seq = self._requests[request_id].seq
        assert seq.hold_blocks and seq.is_finished and not seq.num_released_blocks
        return seq.block_table[:self.block_manager.blocks_for(seq.num_computed_tokens)]

    def export_kv(self, request_id: str) -> torch.Tensor:
        return self.runner.export_blocks(self.held_blocks(request_id))

    def release(self, request_id: str) -> None:
        """Prefill role: the K/V was sent (or the send failed); free the held blocks."""
        req = self._requests.pop(request_id)
        assert req.seq.hold_blocks and req.seq.is_finished
        self.block_manager.free(req.seq)

    def reserve(self, num_tokens: int) -> list[int] | None:
        """Decode role: blocks for incoming K/V; the caller owns them until `add_prefilled`
        or `release_reservation`."""
        return self.block_manager.reserve(num_tokens)

    def reserve_cached(self, token_ids: list[int], key: tuple | None = None,
                       priority: int = 0) -> tuple[list[int], int] | None:
        """Decode role: blocks for the incoming K/V of `token_ids` (of cache key `key`, the request's
        SamplingParams.cache_key: its LoRA adapter and cache salt), the first of them cached blocks
        that already hold it (this replica decoded or received those tokens before): (block ids,
        how many are cached; only the rest is to be received). The caller owns them all until
        `add_prefilled` or `release_reservation`; None when too few blocks are free, even after the
        `priority` policy preempted the running requests of a lower priority than `priority`
        (Scheduler.make_room)."""
        bm = self.block_manager
        reserved = bm.reserve_cached(token_ids, key)
        if reserved is None and self.scheduler.make_room(priority, lambda: bm.can_reserve(token_ids, key)):
            reserved = bm.reserve_cached(token_ids, key)       # running requests of a lower priority preempted
        return reserved

    def cached_prompt_tokens(self, token_ids: list[int], params: SamplingParams) -> int:
        """How many leading tokens of `token_ids` a prefill here would take from the prefix cache
        now (none where every prompt position is to be computed: SamplingParams.whole_prompt).
        Nothing changes."""
        if params.whole_prompt:
            return 0
        return self.block_manager.cached_tokens(token_ids, params.cache_key)

    def prefill_backlog(self, token_ids: list[int], params: SamplingParams, cached: int | None = None) -> int:
        """The prompt tokens this engine would have to compute if it queued `token_ids` now: those
        after its cached ones (`cached_prompt_tokens`, or `cached` where the caller has it), plus
        those it has queued or mid-prefill already (`Scheduler.num_waiting_tokens`). Nothing changes
        (decode role: whether to prefill here)."""
        if cached is None:
            cached = self.cached_prompt_tokens(token_ids, params)
        return len(token_ids) - cached + self.scheduler.num_waiting_tokens

    def release_reservation(self, block_ids: list[int]) -> None:
        self.block_manager.release(block_ids)

    def import_kv(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.runner.import_blocks(block_ids, data)

    # ---- colocated, synchronous ------------------------------------------------------------------
    def generate(self, prompts: list[list[int]] | list[str], params: SamplingParams | list[SamplingParams],
                 ) -> list[Completion]:
        """Run prompts (token ids or text) to completion; results in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        results = {}
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"generate-{id(results)}-{i}"
            results[rid] = Completion(rid, ids)
            rejected = self.add_request(rid, ids, p)
            if rejected is not None:
                for queued in results:
                    self.abort(queued)
                raise ValueError(f"prompt {i}: {rejected.reason}")
        while self.has_work():
            for out in self.step():
                results[out.request_id].add(out)
        return list(results.values())

    def num_threads(self) -> int:
        """The torch threads this engine's steps run on (CPU; call on the engine's thread)."""
        return self.runner.num_threads()

    def set_num_threads(self, n: int) -> int:
        """Step on `n` torch threads from now on (CPU; a no-op on CUDA); returns the count."""
        return self.runner.set_num_threads(n)

    def stats(self) -> dict:
        bm = self.block_manager
        return {"kv_blocks_total": bm.num_blocks, "kv_blocks_free": bm.num_free_blocks,
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting) + len(self.scheduler.parked),
                "waiting_prompt_tokens": self.scheduler.num_waiting_tokens,
                "preemptions": self.scheduler.num_preemptions,
                "prefix_cache_hit_tokens": bm.prefix_hits, "prefix_cache_query_tokens": bm.prefix_queries,
                "spec_draft_tokens": self.num_draft_tokens, "spec_accepted_tokens": self.num_accepted_tokens,
                "lora_loads": self.runner.loras.loads, "lora_evictions": self.runner.loras.evictions,
                "lora_waiting": self.lora_places.waiting(self.scheduler)}
