"""Draft tokens by prompt lookup (n-gram speculation), torch-free.

Output often repeats its context: a quoted passage, code being edited, a name or a list from the
prompt. `NgramIndex.propose` finds the longest suffix of the sequence (MAX_N tokens down to MIN_N)
that occurred before and proposes the tokens that followed its latest earlier occurrence. The
engine feeds them with the sequence's token and keeps those the model itself picks (see
`LLMEngine._postprocess`), so a wrong draft costs compute, not output.

The index maps each n-gram to where its latest occurrence ends. It covers the n-grams ending
before the last token, so a look-up of the suffix finds an earlier occurrence, never the suffix
itself; `extend` keeps it current in O(new tokens).
"""

from __future__ import annotations

from engine.prediction import TAIL, PredictionIndex

MIN_N = 2
MAX_N = 4


class NgramIndex:
    def __init__(self, tokens: list[int]):
        self._last: dict[tuple[int, ...], int] = {}
        self._indexed = 0          # n-grams ending at positions < _indexed are in `_last`
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Index `tokens` (the whole sequence so far; the engine passes its token list)."""
        self._tokens = tokens
        for end in range(self._indexed, len(tokens) - 1):
            for n in range(MIN_N, min(MAX_N, end + 1) + 1):
                self._last[tuple(tokens[end - n + 1:end + 1])] = end
        self._indexed = max(self._indexed, len(tokens) - 1)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of the sequence's suffix."""
        tokens = self._tokens
        for n in range(min(MAX_N, len(tokens) - 1), MIN_N - 1, -1):
            end = self._last.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + k]
        return []


def propose_drafts(running: list, requests: dict, k: int, max_batch: int, max_model_len: int,
                   k_predicted: int = 0) -> list:
    """Speculative decoding's step: append up to `k` draft tokens to each decoding Sequence in
    `running` (the scheduler's), while at most `max_batch` run; `requests`: request id to the
    engine's EngineRequest, whose `ngram` index is built at its first draft and extended after.
    A request with a predicted output (SamplingParams.prediction) drafts up to `k_predicted` from
    it first (engine/prediction.py; its index built at its first draft), by prompt lookup where
    the prediction proposes nothing.
    Returns the sequences that got a draft: the engine takes every draft back in the same step.
    A sequence drafts only when it has one token to compute (no chunk of a prompt under way), is
    not a prefill-role request nor an embedding (its last prompt token may be the one left), and
    has room for a token after its draft (max_tokens, context)."""
    if not (k or k_predicted) or len(running) > max_batch:
        return []
    drafted = []
    for seq in running:
        predicted = bool(k_predicted and seq.params.prediction)
        if not (k or predicted) or seq.num_uncomputed_tokens != 1 or seq.hold_blocks or seq.params.pooling:
            continue
        room = min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - len(seq)) - 1
        if room < 1:
            continue
        req, draft = requests[seq.request_id], []
        if predicted:
            if req.prediction is None:
                req.prediction = PredictionIndex(seq.params.prediction)
            tail = seq.token_ids[max(seq.num_prompt_tokens, len(seq.token_ids) - TAIL):]
            draft = req.prediction.propose(tail, seq.num_output_tokens, min(k_predicted, room))
        req.draft_predicted = bool(draft)
        if not draft and k:
            if req.ngram is None:
                req.ngram = NgramIndex(seq.token_ids)
            else:
                req.ngram.extend(seq.token_ids)
            draft = req.ngram.propose(min(k, room))
        if draft:
            seq.add_draft(draft)
            drafted.append(seq)
    return drafted
