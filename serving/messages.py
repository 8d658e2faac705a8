"""Every message between the router and the prefill/decode/colocated replicas (and its response store).

One frozen dataclass per message; `encode` and `decode` turn them into msgpack bytes with
a version and a type tag, and `decode` refuses oversized, malformed or unknown input with
`MessageError`. Ray carries the bytes; nothing is pickled on our wire.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgpack

from engine.outputs import TokenLogprobs
from engine.pooling import Pooling
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput

VERSION = 1
MAX_MESSAGE_BYTES = 64 * 2**20


class MessageError(ValueError):
    pass


@dataclass(frozen=True)
class WireSamplingParams:
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    min_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    seed: int | None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: tuple | None = None     # StructuredOutput's kind, value and think (None or 3 values)
    min_p: float = 0.0
    allowed_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    bad_words: tuple[tuple[int, ...], ...] = ()
    lora: str | None = None             # the LoRA adapter's name (SamplingParams.lora)
    priority: int = 0
    lora_path: str | None = None        # one loaded at run time: its directory and load id
    lora_id: int = 0
    cache_salt: str | None = None
    prediction: tuple[int, ...] = ()    # a predicted output's token ids (SamplingParams.prediction)
    # an embedding request's Pooling: kind, normalize, dimensions, and its labels where it has some
    # (without: the three fields senders and receivers before the labels exchange)
    pooling: tuple | None = None

    @classmethod
    def of(cls, p: SamplingParams) -> "WireSamplingParams":
        s = p.structured
        structured = None if s is None else (s.kind, s.value, s.think)
        pooling = None if p.pooling is None else dataclasses.astuple(p.pooling)[:4 if p.pooling.labels else 3]
        return cls(p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens, tuple(p.stop),
                   tuple(p.stop_token_ids), p.ignore_eos, p.seed, p.presence_penalty,
                   p.frequency_penalty, p.repetition_penalty, p.logprobs, p.prompt_logprobs,
                   tuple(p.logit_bias), structured, p.min_p, tuple(p.allowed_token_ids),
                   p.include_stop_str_in_output, p.skip_special_tokens, tuple(map(tuple, p.bad_words)), p.lora,
                   p.priority, p.lora_path, p.lora_id, p.cache_salt, tuple(p.prediction), pooling)

    @property
    def cache_key(self) -> tuple | None:
        """SamplingParams.cache_key, without building the parameters."""
        lora = None if self.lora is None else (self.lora, self.lora_id)
        return None if lora is None and self.cache_salt is None else (lora, self.cache_salt)

    def to_params(self) -> SamplingParams:
        fields = dataclasses.asdict(self)
        fields["structured"] = None if self.structured is None else StructuredOutput(*self.structured)
        fields["pooling"] = None if self.pooling is None else Pooling(*self.pooling)
        return SamplingParams(**fields)

    @classmethod
    def from_body(cls, body: dict) -> "WireSamplingParams":
        """From msgpack's map (lists back to tuples, the bias pairs too)."""
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in body.items()}
        if "logit_bias" in fields:
            fields["logit_bias"] = tuple((int(t), float(b)) for t, b in fields["logit_bias"])
        if "bad_words" in fields:
            fields["bad_words"] = tuple(tuple(word) for word in fields["bad_words"])
        if fields.get("structured") is not None:
            kind, value, think = fields["structured"]
            if think is not None:
                think = tuple(think)
                if len(think) != 3 or not all(type(t) is int for t in think[:2]) or type(think[2]) is not bool:
                    raise ValueError(f"structured output's think is not (int, int, bool): {think!r}")
            fields["structured"] = (str(kind), str(value), think)
        if fields.get("pooling") is not None:
            pooling = fields["pooling"]
            if len(pooling) not in (3, 4) or (len(pooling) == 4 and not isinstance(pooling[3], (list, tuple))):
                raise ValueError(f"pooling is not (kind, normalize, dimensions[, labels]): {pooling!r}")
            fields["pooling"] = (*pooling[:3], *((tuple(pooling[3]),) if len(pooling) == 4 else ()))
        return cls(**fields)


@dataclass(frozen=True)
class GenerateRequest:
    """Router -> colocated replica: run a prompt to the end, streaming `TokenEvent`s.
    `resumed_token_ids`: a resumed request's output tokens the client already has (the router
    moves a request whose replica died mid-stream), of whose text it was shown `shown_chars`
    characters; the events go on after them (their counts the whole request's)."""
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: WireSamplingParams
    resumed_token_ids: tuple[int, ...] = ()
    shown_chars: int = 0


@dataclass(frozen=True)
class PrefillRequest:
    """Router -> prefill replica (a streaming call): compute the prompt, answer with the first
    token (a `PrefillResult`), push the K/V into the reservation (`request_id` at the decode
    replica's `kv_address`, from its `Reserved` event) unless the first token ends the request,
    and end the stream with a `HandoffDone` once the push has ended. A resumed request (see
    `GenerateRequest`): the K/V pushed is the prompt's and the resumed tokens', the first token
    the one after them, `first_text` the text after `shown_chars`. `skip_blocks`: the leading
    blocks of that K/V the decode replica holds already (its `Reserved`'s `cached_blocks`): the
    push leaves them out (at least the last block is always pushed)."""
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: WireSamplingParams
    kv_address: str
    resumed_token_ids: tuple[int, ...] = ()
    shown_chars: int = 0
    skip_blocks: int = 0


@dataclass(frozen=True)
class EmbedRequest:
    """Router -> prefill or colocated replica (a streaming call of one answer): pool each prompt's
    final hidden states into its embedding (`params.pooling`; in the engine as `<request_id>-<i>`),
    answered by an `Embedded` or, where a prompt failed, an `ErrorEvent`. No K/V leaves the replica."""
    request_id: str
    prompts: tuple[tuple[int, ...], ...]
    params: WireSamplingParams


@dataclass(frozen=True)
class Embedded:
    """Replica -> router: each prompt's embedding in order, little-endian float32 bytes
    (RequestOutput.embedding); the prompts' tokens, and those of them found in the prefix cache."""
    request_id: str
    embeddings: tuple[bytes, ...]
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class PrefillResult:
    """Prefill replica -> router. `finish_reason` set: the request ended at its first token
    and no K/V was sent. `error` set: nothing was produced and nothing is held.
    `queue_seconds`: from the replica receiving the call to the engine first scheduling the
    request; `prefill_seconds`: from then to the first token (0.0 from older senders).
    `first_text`: the text of the first token that is safe to show now (the engine's incremental
    detokenizer: no split UTF-8 character, no possible start of a stop string).
    `first_logprobs`: the first token's, when the request asked for logprobs; `prompt_logprobs`:
    the prompt's tokens after the first, when it asked for those. `stop_reason`: where the first
    token ended it, the stop string or token id that did (TokenEvent's)."""
    request_id: str
    first_token: int = -1
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    prefill_seconds: float = 0.0
    queue_seconds: float = 0.0
    error: str | None = None
    error_code: int = 0
    first_text: str = ""
    first_logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    stop_reason: str | int | None = None


@dataclass(frozen=True)
class DecodeRequest:
    """Router -> decode replica (a streaming call, made before the prefill): reserve blocks for
    the prompt's K/V and answer `Reserved` (or an `ErrorEvent` at once), receive the K/V with a
    `KVHandoff` and answer `Landed`, then stream `TokenEvent`s from its first token. Or, where the
    replica's prefix cache holds all but a few of the prompt's tokens (`routing.local_prefill_tokens`),
    prefill it there: then the stream's first event is already the first `TokenEvent` (no
    `Reserved`, no prefill replica). A resumed request (see `GenerateRequest`): the reservation holds
    the resumed tokens' K/V too, and the KVHandoff's `shown_chars` counts their text; a local
    prefill goes on after the `shown_chars` characters shown."""
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: WireSamplingParams
    resumed_token_ids: tuple[int, ...] = ()
    shown_chars: int = 0


@dataclass(frozen=True)
class Reserved:
    """Decode replica -> router, the first event of a decode stream: blocks for `num_blocks`
    blocks of K/V are reserved under `request_id` at the KV receiver `kv_address` (the
    reservation's identity, which the router hands to the prefill replica). `cached_blocks`: the
    K/V's leading full blocks the decode replica holds already (its prefix cache), which come
    before those `num_blocks` and are not to be pushed (the router hands it on as the
    PrefillRequest's `skip_blocks`)."""
    request_id: str
    kv_address: str
    num_blocks: int
    cached_blocks: int = 0


@dataclass(frozen=True)
class Landed:
    """Decode replica -> router, the second event of a decode stream: the K/V pushed for
    `request_id` is in the reserved blocks (the prefill replica is no longer needed). A router
    that learns the push is lost before this event (its prefill replica died after the first
    token, or its HandoffDone reports a failed push) drops the reservation at once instead of
    waiting for its lease."""
    request_id: str


@dataclass(frozen=True)
class KVHandoff:
    """Prefill replica -> decode replica, inside the KV push (the transfer's `meta`): how to go
    on from the K/V. `first_token`: the token the prefill sampled; `shown_chars`: characters of
    output text the client already has (the prefill replica's `first_text`, after a resumed
    request's `shown_chars`): the decode replica's text starts after them."""
    first_token: int
    shown_chars: int = 0


@dataclass(frozen=True)
class HandoffDone:
    """Prefill replica -> router, the last event of a prefill stream that pushed K/V: the push
    ended (`ok`: it landed; else `error`). The prefill replica's blocks are free by then."""
    request_id: str
    ok: bool
    error: str = ""


@dataclass(frozen=True)
class TokenEvent:
    """Replica -> router, streamed: new tokens and text; `finished` on the last one.
    `logprobs`: one per token of `token_ids` when the request asked for them, else empty; the
    decode replica's first event (the first token again) has none. `prompt_logprobs`: on the
    first event only, the prompt's tokens after the first, when the request asked for them.
    `stop_reason`: on a last event ended by a stop string or stop token, that string or token id.
    `accepted_prediction_tokens`, `rejected_prediction_tokens`: so far, the draft tokens taken from
    the request's predicted output that it repeated and the others (RequestOutput's)."""
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    stop_reason: str | int | None = None
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


@dataclass(frozen=True)
class ErrorEvent:
    """Replica -> router: the request failed; `code` is the HTTP status to report."""
    request_id: str
    message: str
    code: int = 500
    kind: str = "server_error"


@dataclass(frozen=True)
class ReplicaStats:
    """Replica -> stats registry, periodically: what /metrics and the routers read.
    `extra`: counters by name; `histograms`: name -> `serving.histogram.Histogram.to_wire()`;
    `lora_waiting`: of the `waiting`, those whose LoRA adapter loaded at run time has no place yet."""
    pool: str
    replica_id: str
    kv_blocks_total: int
    kv_blocks_free: int
    running: int
    waiting: int
    waiting_prompt_tokens: int
    extra: dict = field(default_factory=dict)
    histograms: dict = field(default_factory=dict)
    lora_waiting: int = 0


@dataclass(frozen=True)
class StoredResponse:
    """Router <-> ResponseStore (router/response_store.py): a response of the Responses API as kept.
    `response`: the Response object, JSON; `context`: the input items the model saw before its
    output (an earlier response's context and output, then this request's input), a JSON list.
    `owner`: while a background response runs (queued, in_progress), the router instance running
    it, whose lease the store keeps (ResponseLog.renew); empty once it ended, or for any other."""
    response_id: str
    response: str
    context: str
    owner: str = ""


@dataclass(frozen=True)
class RuntimeLoraRegistry:
    """Router <-> ResponseStore (router/runtime_lora.py): the LoRA adapters loaded at run time, so
    a router that restarts serves them again. Entry i: `names[i]` at `paths[i]` under load id
    `lora_ids[i]`."""
    names: tuple[str, ...]
    paths: tuple[str, ...]
    lora_ids: tuple[int, ...]


@dataclass(frozen=True)
class ResponseEventBatch:
    """Router -> ResponseStore: the next events of a background response's stream (server-sent
    event text, sequence numbers `first` on, in order; router/responses_api.py's EventWriter);
    `end`: the stream has no more (its last event is among these, or it was cancelled), and with
    it `response` (JSON, with its `context`, JSON): the response as it ended, kept in the same
    call as the last event (so no reader sees one without the other)."""
    response_id: str
    first: int
    events: tuple[str, ...]
    end: bool = False
    response: str = ""
    context: str = ""


@dataclass(frozen=True)
class ResponseEventQuery:
    """Router -> ResponseStore: the events of a background response's stream after sequence number
    `after` (-1: from the first), waiting up to `wait_s` for one where there is none yet."""
    response_id: str
    after: int
    wait_s: float = 0.0


@dataclass(frozen=True)
class ResponseEventPage:
    """ResponseStore -> router: the events asked for (as many as one page holds: ask again from the
    last); `ended`: none will follow these. `response`: where the stream ended without its last
    event (its router failed, it was cancelled, or its events stopped reaching the store), the
    Response as stored then, JSON; else empty."""
    events: tuple[str, ...]
    ended: bool
    response: str = ""


MESSAGES = {cls.__name__: cls for cls in (GenerateRequest, PrefillRequest, PrefillResult, DecodeRequest,
                                           Reserved, Landed, KVHandoff, HandoffDone, TokenEvent, ErrorEvent,
                                           ReplicaStats, StoredResponse, RuntimeLoraRegistry, ResponseEventBatch,
                                           ResponseEventQuery, ResponseEventPage, EmbedRequest, Embedded)}


def encode(msg) -> bytes:
    name = type(msg).__name__
    assert name in MESSAGES, f"not a wire message: {name}"
    return msgpack.packb([VERSION, name, dataclasses.asdict(msg)], use_bin_type=True)


def decode(data: bytes, expect: type | None = None):
    if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_MESSAGE_BYTES:
        raise MessageError("message is not bytes or exceeds the size limit")
    try:
        version, name, body = msgpack.unpackb(data, raw=False, max_bin_len=MAX_MESSAGE_BYTES,
                                              max_str_len=MAX_MESSAGE_BYTES, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - any malformed input is one error
        raise MessageError(f"malformed message: {exc}") from None
    if version != VERSION:
        raise MessageError(f"unsupported message version {version!r} (this side speaks {VERSION})")
    cls = MESSAGES.get(name)
    if cls is None or (expect is not None and cls is not expect):
        raise MessageError(f"unexpected message type {name!r}")
    if not isinstance(body, dict):
        raise MessageError("message body is not a map")
    try:
        return _build(cls, body)
    except (TypeError, ValueError) as exc:
        raise MessageError(f"bad {name}: {exc}") from None


def _build(cls, body: dict):
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in body:
            continue
        value = body[f.name]
        if f.name == "params":
            value = WireSamplingParams.from_body(value)
        elif f.name == "first_logprobs":
            value = None if value is None else _logprobs(value)
        elif f.name in ("logprobs", "prompt_logprobs"):
            value = tuple(_logprobs(v) for v in value)
        elif f.name == "prompts":
            value = tuple(tuple(p) for p in value)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)


def _logprobs(body: dict) -> TokenLogprobs:
    lp = TokenLogprobs(**body)
    top = tuple((int(t), float(v)) for t, v in lp.top)
    if not isinstance(lp.token_id, int) or not isinstance(lp.logprob, float):
        raise TypeError("logprobs: token_id must be an int and logprob a float")
    if lp.rank is not None and not isinstance(lp.rank, int):
        raise TypeError("logprobs: rank must be an int or null")
    return TokenLogprobs(lp.token_id, lp.logprob, top, lp.rank)
