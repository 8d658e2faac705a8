"""Embeddings: a request that pools its prompt's final hidden states into one vector instead of
generating (OpenAI's /v1/embeddings; torch-free: the engine's `Pooled` does the arithmetic).

`Pooling` says how (sentence-transformers' pooling modes, as vLLM's pooler runs them):
  * "last": the last prompt token's hidden state (decoder embedding models: Qwen3-Embedding,
    gte-Qwen2, e5-mistral; the default where the model says nothing);
  * "mean": the mean over every prompt token's (such a request takes no prefix-cache hits: each
    position must be computed, as for prompt logprobs);
  * "cls": the first token's (likewise computed in full).
Then the first `dimensions` values only (a Matryoshka model's shorter embedding), then scaled to
length 1 where `normalize`. Hidden states are the model's after its final norm, what its LM head
reads; the vector is float32.

With `labels` (token ids; the scores of /score and /rerank, router/score_api.py) the answer is not
the hidden state but what the LM head makes of it: the log-probabilities of those tokens as the
next token after the whole prompt ("last" only, under the model's own distribution over its whole
vocabulary), as vLLM scores with a causal LM (its generative scores; Qwen3-Reranker's
`classifier_from_token: ["no", "yes"]`).
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("last", "mean", "cls")
MAX_LABELS = 16


@dataclass(frozen=True)
class Pooling:
    kind: str = "last"
    normalize: bool = True
    dimensions: int | None = None
    labels: tuple[int, ...] = ()

    def problem(self) -> str | None:
        """Why these settings cannot be served, or None (the labels' range: the engine's admission)."""
        if self.kind not in KINDS:
            return f"pooling must be one of {', '.join(KINDS)}, got {self.kind!r}"
        if not isinstance(self.labels, tuple) or len(self.labels) > MAX_LABELS \
                or any(type(t) is not int or t < 0 for t in self.labels):
            return f"labels must be at most {MAX_LABELS} token ids"
        if self.labels and (self.kind != "last" or self.normalize or self.dimensions is not None):
            return "labels are scored at the last token, not normalized or cut to dimensions"
        if not isinstance(self.normalize, bool):
            return "pooling's normalize must be a boolean"
        if self.dimensions is not None and (type(self.dimensions) is not int or self.dimensions < 1):
            return f"dimensions must be a positive integer, got {self.dimensions!r}"
        return None

    @property
    def whole_prompt(self) -> bool:
        """Whether every prompt position must be computed (no prefix-cache hits)."""
        return self.kind != "last"

    def rows(self, start: int, num_tokens: int, num_prompt_tokens: int, pooled_upto: int) -> tuple[int, int] | None:
        """The rows (first, last) within a chunk of `num_tokens` prompt tokens from position `start`
        whose hidden states this pooling still needs, or None: `pooled_upto` prompt positions were
        pooled already (a request recomputed after preemption feeds its chunks again)."""
        end = start + num_tokens
        if self.kind == "last":
            return (num_tokens - 1, num_tokens) if end == num_prompt_tokens else None
        if self.kind == "cls":
            return (0, 1) if start == 0 and pooled_upto == 0 else None
        first = max(start, pooled_upto)
        return (first - start, num_tokens) if first < end else None
