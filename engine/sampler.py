"""Next-token sampling for a batch of sequences with per-request parameters.

Order per row: log-probabilities of the raw logits (only when asked), penalties, logit bias,
allowed_token_ids, bans, the structured-output mask (tokens its grammar allows), then greedy
rows take the argmax and sampled rows apply temperature, top-k, top-p and min-p and draw with the
request's own generator, so a request with a seed gets the same tokens whatever else shares its
batch. Every draw is the Gumbel-max trick with noise hashed per token id from one random key a
row: a row with top-k or top-p among its candidates only (topk of a few hundred tokens, not a sort
of the vocabulary), one with neither over the whole vocabulary (on CPU one pass of the engine's
kernel, which computes exact noise only for the few tokens that could win).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from engine.kernels import cpu_kernels
from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _kernels_for(x: torch.Tensor):
    """The engine's CPU kernels (torch.ops.pdserve) where `x` may go through them (fp32 on the CPU,
    and they built), else None."""
    return cpu_kernels() if x.device.type == "cpu" and x.dtype == torch.float32 else None


def skip_draw(generator: torch.Generator) -> None:
    """Advance `generator` past one draw of `sample` (every draw takes one `_key`, whatever the
    parameters, logits or vocabulary). The decode engine calls it for a seeded request whose first
    token the prefill engine drew from the same seed: the second token then gets fresh random
    numbers, as in one engine."""
    _key(generator, generator.device)


def _key(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The one random number a draw takes: an int64 (`_noise`'s key)."""
    return torch.randint(-2**63, 2**63 - 1, (1,), generator=generator, device=device)


def _u64(v: int) -> int:
    return v - 2**64 if v >= 2**63 else v        # a uint64 constant as the int64 of the same bits


_GOLDEN, _MIX1, _MIX2 = _u64(0x9E3779B97F4A7C15), _u64(0xBF58476D1CE4E5B9), _u64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)      # logical shift of int64 bits


def _noise(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise [n, m] (float64) for tokens `ids` ([n, m] or [1, m], int64) from each row's key
    ([n]): token t's is splitmix64's (t + 1)-th output from the key, so it depends on the token, not
    on which other tokens are candidates or in which order (torch's int64 arithmetic wraps as
    uint64's). engine/kernels/gumbel_argmax_cpu.cpp computes the same."""
    x = keys[:, None] + (ids + 1) * _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = x ^ _shr(x, 31)
    u = (_shr(x, 11).double() + 0.5) * 2.0 ** -53           # uniform in (0, 1)
    return -(-u.log()).log()


NUCLEUS_WIDTH = 256     # a row's likeliest tokens sorted first for its top-k / nucleus


def _candidate_groups(logits: torch.Tensor, params: list[SamplingParams]
                      ) -> list[tuple[list[int], torch.Tensor, torch.Tensor | None]]:
    """The rows of `logits` ([n, vocab]) in groups: (their indices, their candidates' logits [len, m],
    -inf outside the row's top-k and nucleus, the candidates' token ids [len, m]; None: every token
    in id order). The nucleus is the smallest run of likeliest tokens (ties in sort order) holding
    top_p of the top-k's mass. A group's rows have the same `_width`; those whose nucleus reaches
    past it are sorted whole, a group of their own."""
    vocab = logits.shape[-1]
    widths = [_width(p, vocab) for p in params]
    groups = []
    for width in set(widths):
        rows = [j for j, w in enumerate(widths) if w == width]
        part = logits if len(rows) == len(params) else logits[rows]
        if width is None:
            groups.append((rows, part, None))
            continue
        k = torch.tensor([_top_k(params[j], vocab) for j in rows], device=logits.device)
        top_p = torch.tensor([params[j].top_p for j in rows], device=logits.device, dtype=logits.dtype)
        values, ids, spill = _candidates(part, k, top_p, width)
        if not bool(spill.any()):
            groups.append((rows, values, ids))
            continue
        kept, spilled = (~spill).nonzero()[:, 0], spill.nonzero()[:, 0]      # a flat distribution's nucleus
        if len(kept):
            groups.append(([rows[j] for j in kept.tolist()], values[kept], ids[kept]))
        whole, whole_ids, _ = _candidates(part[spilled], k[spilled], top_p[spilled], vocab)
        groups.append(([rows[j] for j in spilled.tolist()], whole, whole_ids))
    return groups


def _top_k(params: SamplingParams, vocab: int) -> int:
    """A row's top-k, 1..vocab (vocab: none)."""
    return params.top_k if 0 < params.top_k < vocab else vocab


def _width(params: SamplingParams, vocab: int) -> int | None:
    """How many of a row's likeliest tokens `_candidates` sorts first: max(NUCLEUS_WIDTH, its
    top-k); None where the row has no top-k or nucleus (every token a candidate). A row's own
    parameters alone decide it, so its draw does not depend on what shares its batch."""
    k = _top_k(params, vocab)
    if k == vocab and params.top_p >= 1.0:
        return None
    return min(vocab, max(NUCLEUS_WIDTH, k if k < vocab else 0))


def _candidates(logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's `width` likeliest tokens in order (topk; `k`: each row's top-k, 1..vocab, at most
    `width` unless vocab): (their logits, -inf outside the row's top-k and nucleus [n, width], their
    ids [n, width], the rows whose nucleus reaches past them [n]: no top-k and less than top_p of the
    mass in these). (A full sort of 49,152 logits: 3.1 ms a row on one CPU thread here; topk 256:
    0.15.)"""
    vocab = logits.shape[-1]
    values, ids, log_row = _top(logits, width)
    ranks = torch.arange(width, device=logits.device)[None, :]
    values = values.masked_fill(ranks >= k[:, None], float("-inf"))
    # the top-k's mass: the whole row's (k = vocab), else these tokens' (k <= width)
    log_total = torch.where(k >= vocab, log_row, values.logsumexp(dim=-1))[:, None]
    probs = (values - log_total).exp()
    before = probs.cumsum(dim=-1) - probs          # mass strictly before each token
    values = values.masked_fill((before >= top_p[:, None]) & (top_p[:, None] < 1.0), float("-inf"))
    spill = (k > width) & (top_p < 1.0) & (before[:, -1] + probs[:, -1] < top_p)
    return values, ids, spill


def _top(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's `width` largest logits in order, their ids, and the row's logsumexp: on CPU the
    engine's kernel (the row's maximum, then its exp summed and the candidates above a threshold
    found by counting; equal logits by the smaller id first), 0.05 ms a row of 49,152 here against
    0.25 for torch's topk and logsumexp, which run elsewhere (ties in their own order)."""
    kernels = _kernels_for(logits)
    if kernels is not None:
        return kernels.top_candidates(logits, width)
    values, ids = logits.topk(width, dim=-1)
    return values, ids, logits.logsumexp(dim=-1)


def _filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask each row's tokens less likely than min_p x its likeliest token with -inf (Hugging
    Face's MinPLogitsWarper; a row's min_p 0 keeps the row)."""
    probs = logits.softmax(dim=-1)
    floor = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < floor, float("-inf"))


class PenaltyState:
    """The token statistics a penalized request's penalties read, kept on the logits' device:
    which ids appear in the prompt or the output (repetition) and how often each appears in the
    output (frequency, presence). Built once from the tokens so far, then `add`ed to with each
    sampled token, so a step costs a few vocabulary-wide operations per penalized row instead of
    a pass over the whole prompt."""

    def __init__(self, token_ids: list[int], num_prompt_tokens: int, vocab: int, device: torch.device):
        self.vocab = vocab
        seen = torch.tensor([t for t in token_ids if t < vocab], dtype=torch.long, device=device)
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.seen[seen] = True
        output = torch.tensor([t for t in token_ids[num_prompt_tokens:] if t < vocab], dtype=torch.long,
                              device=device)
        self.counts = torch.bincount(output, minlength=vocab).to(torch.float32)

    def add(self, token: int) -> None:
        if token < self.vocab:
            self.seen[token] = True
            self.counts[token] += 1


@dataclass
class SampleRow:
    """What the sampler needs of one sequence that yields a token this step."""

    params: SamplingParams
    generator: torch.Generator | None
    banned: list[int]          # ids it may not pick now (EOS and stop tokens before min_tokens)
    penalty: PenaltyState | None = None   # the request's, when params.penalized; sample() adds the new token
    allowed: bytes | None = None   # structured output: bit t % 8 of byte t // 8 set if token t may come next


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """In place, per penalized row: repetition over prompt and output, then frequency and
    presence over the output (see SamplingParams)."""
    for i, row in enumerate(rows):
        p, state = row.params, row.penalty
        if not p.penalized:
            continue
        row_logits = logits[i]
        if p.repetition_penalty != 1.0:
            scaled = torch.where(row_logits > 0, row_logits / p.repetition_penalty, row_logits * p.repetition_penalty)
            row_logits.copy_(torch.where(state.seen, scaled, row_logits))
        if p.frequency_penalty or p.presence_penalty:
            counts = state.counts.to(logits.dtype)
            row_logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _apply_logit_bias(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            ids, biases = zip(*row.params.logit_bias)
            logits[i, list(ids)] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)


def _apply_allowed(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """-inf for the tokens a row's structured output does not allow next."""
    masked = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not masked:
        return
    packed = np.frombuffer(b"".join(rows[i].allowed for i in masked), dtype=np.uint8).reshape(len(masked), -1)
    forbidden = torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little") == 0)[:, :logits.shape[-1]]
    forbidden = forbidden.to(logits.device)
    for j, i in enumerate(masked):
        logits[i].masked_fill_(forbidden[j], float("-inf"))


def _apply_allowed_ids(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """-inf for every token outside a row's `allowed_token_ids` (when it lists any)."""
    for i, row in enumerate(rows):
        ids = row.params.allowed_token_ids
        if ids:
            index = torch.tensor(ids, device=logits.device)
            kept = logits[i, index]
            logits[i].fill_(float("-inf"))
            logits[i, index] = kept


def _logprobs(raw: torch.Tensor, k: int, token: int) -> TokenLogprobs:
    """`raw`: one row of log-probabilities."""
    top = ()
    if k:
        values, ids = raw.topk(k)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(token, float(raw[token]), top)


PROMPT_LOGPROB_SLICE = 256   # rows through the LM head at once


@torch.inference_mode()
def prompt_logprobs(lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: list[int],
                    k: int) -> list[TokenLogprobs]:
    """Log-probability of each `targets[i]` (the prompt token after row i) under the model's
    distribution at row i of `hidden` ([len(targets), hidden]), its rank there, and the k most
    likely tokens; computed PROMPT_LOGPROB_SLICE rows at a time."""
    assert hidden.shape[0] == len(targets)
    out: list[TokenLogprobs] = []
    for a in range(0, len(targets), PROMPT_LOGPROB_SLICE):
        lp = lm_head(hidden[a:a + PROMPT_LOGPROB_SLICE]).float().log_softmax(dim=-1)
        tgt = torch.tensor(targets[a:a + PROMPT_LOGPROB_SLICE], device=lp.device)
        chosen = lp.gather(1, tgt[:, None])
        ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
        tops = [()] * len(ranks)
        if k:
            values, ids = lp.topk(k, dim=-1)
            tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        out += [TokenLogprobs(t, c, top, r) for t, c, top, r
                in zip(targets[a:a + PROMPT_LOGPROB_SLICE], chosen[:, 0].tolist(), tops, ranks)]
    return out


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)`; on CPU through the engine's kernel where it builds (the same
    indices, ties and NaN included; aten's took 0.9 ms of a batch-32 step on one thread here)."""
    kernels = _kernels_for(logits)
    return logits.argmax(dim=-1) if kernels is None else kernels.argmax_rows(logits)


def _sample_rows(logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
    """A token per row of `logits` ([n, vocab], divided by the temperatures; modified): its top-k,
    nucleus and min-p candidates, drawn with its generator, a group of rows at a time."""
    tokens = [0] * len(rows)
    for members, values, ids in _candidate_groups(logits, [r.params for r in rows]):
        for j, token in zip(members, _draw_from(values, ids, [rows[j] for j in members])):
            tokens[j] = token
    return tokens


def _draw_from(values: torch.Tensor, ids: torch.Tensor | None, rows: list[SampleRow]) -> list[int]:
    """A token per row of candidate logits `values` ([n, m]; -inf: not a candidate) after min-p, with
    each row's generator: the Gumbel-max trick, the argmax of the logits plus `_noise` from one
    random key a row (`_gumbel_argmax`). `ids`: the candidates' token ids; None: `values` are whole
    rows. The likeliest token after noise wins, so logits a rounding error apart (a split request's
    prefill and decode engines, another batch) draw the same token but at a near tie."""
    if any(r.params.min_p > 0.0 for r in rows):
        values = _filter_min_p(values, torch.tensor([r.params.min_p for r in rows], device=values.device,
                                                    dtype=values.dtype))
    keys = torch.cat([_key(r.generator, values.device) for r in rows])
    best = _gumbel_argmax(values, keys, ids)[:, None]
    if not bool(torch.isfinite(values.gather(1, best)).all()):
        raise RuntimeError("a sampled row has no candidate token")
    return (best if ids is None else ids.gather(1, best))[:, 0].tolist()


GUMBEL_ROWS = 16     # rows whose noise the torch path holds at once (whole rows: five [rows, vocab] int64s)


def _gumbel_argmax(values: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's index of its largest `values` ([n, m]) plus `_noise` from its key for the tokens
    `ids` ([n, m]; None: m is the vocabulary, every token in id order). Whole rows on CPU go through
    the engine's kernel (one pass, exact noise only where a token could win: 0.03 ms a row of
    49,152 on one thread here, torch.multinomial's draw 1.2), the rest through torch ops (whole
    rows: 0.7-1 ms a row on the CPU). The two agree but at near ties."""
    kernels = _kernels_for(values) if ids is None else None
    if kernels is not None:
        return kernels.gumbel_argmax_rows(values, keys)
    if ids is None:
        ids = torch.arange(values.shape[-1], device=values.device).expand(values.shape)
    return torch.cat([(values[a:a + GUMBEL_ROWS].double() + _noise(keys[a:a + GUMBEL_ROWS], ids[a:a + GUMBEL_ROWS]))
                      .argmax(dim=-1) for a in range(0, len(values), GUMBEL_ROWS)])


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Pick one token per row of `logits` ([len(rows), vocab], float32; modified in place).
    Returns the tokens and, for rows whose request asked for logprobs, their TokenLogprobs."""
    assert logits.shape[0] == len(rows)
    wants = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw = logits[wants].log_softmax(dim=-1) if wants else None   # the model's own distribution
    _apply_penalties(logits, rows)
    _apply_logit_bias(logits, rows)
    _apply_allowed_ids(logits, rows)
    for i, row in enumerate(rows):
        if row.banned:
            logits[i, row.banned] = float("-inf")
    _apply_allowed(logits, rows)
    out = [0] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        for i, token in zip(greedy, _argmax(logits if len(greedy) == len(rows) else logits[greedy]).tolist()):
            out[i] = token
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        # in place where every row is sampled (the logprobs above are taken)
        sub = logits if len(sampled) == len(rows) else logits[sampled]
        temperatures = [rows[i].params.temperature for i in sampled]
        if any(t != 1.0 for t in temperatures):      # x / 1 is x: OpenAI's default skips the pass
            sub.div_(torch.tensor(temperatures, device=sub.device)[:, None])
        for i, token in zip(sampled, _sample_rows(sub, [rows[i] for i in sampled])):
            out[i] = token
    for i, row in enumerate(rows):
        if row.penalty is not None:
            row.penalty.add(out[i])
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    if wants:
        raw = raw.cpu()
        for j, i in enumerate(wants):
            logprobs[i] = _logprobs(raw[j], rows[i].params.logprobs, out[i])
    return out, logprobs
