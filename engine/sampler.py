"""Next-token sampling for a batch of sequences with per-request parameters.

Order per row: log-probabilities of the raw logits (only when asked), penalties, logit bias,
allowed_token_ids, bans, the structured-output mask (tokens its grammar allows), then greedy
rows take the argmax and sampled rows apply temperature, top-k, top-p and min-p (vectorized over
the rows that use them) and draw with the request's own generator, so a request with a seed gets
the same tokens whatever else shares its batch.
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


def skip_draw(generator: torch.Generator, vocab: int) -> None:
    """Advance `generator` past one draw of `sample` (one multinomial over a `vocab` row; the
    random numbers it takes depend on the row's size, not its values). The decode engine calls it
    for a seeded request whose first token the prefill engine drew from the same seed: the
    second token then gets fresh random numbers, as in one engine."""
    torch.multinomial(torch.ones(vocab, device=generator.device), 1, generator=generator)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k / nucleus with -inf (rows: [n, vocab])."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs          # mass strictly before each token
    sorted_logits = sorted_logits.masked_fill(before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


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
    kernels = cpu_kernels() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    return logits.argmax(dim=-1) if kernels is None else kernels.argmax_rows(logits)


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
    out = _argmax(logits).tolist()
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        dev = logits.device
        sub = logits[sampled] / torch.tensor([rows[i].params.temperature for i in sampled], device=dev)[:, None]
        if any(rows[i].params.top_k > 0 or rows[i].params.top_p < 1.0 for i in sampled):
            top_k = torch.tensor([max(rows[i].params.top_k, 0) for i in sampled], device=dev)
            top_p = torch.tensor([rows[i].params.top_p for i in sampled], device=dev, dtype=sub.dtype)
            sub = _filter_top_k_top_p(sub, top_k, top_p)
        if any(rows[i].params.min_p > 0.0 for i in sampled):
            min_p = torch.tensor([rows[i].params.min_p for i in sampled], device=dev, dtype=sub.dtype)
            sub = _filter_min_p(sub, min_p)
        probs = sub.softmax(dim=-1)
        for j, i in enumerate(sampled):
            out[i] = int(torch.multinomial(probs[j], 1, generator=rows[i].generator).item())
    for i, row in enumerate(rows):
        if row.penalty is not None:
            row.penalty.add(out[i])
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    if wants:
        raw = raw.cpu()
        for j, i in enumerate(wants):
            logprobs[i] = _logprobs(raw[j], rows[i].params.logprobs, out[i])
    return out, logprobs
