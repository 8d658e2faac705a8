"""One request's state inside an engine (torch-free).

A `Sequence` is created by the engine when a request is added and dropped when it
finishes or is aborted. Its `block_table` lists the KV blocks that hold its tokens in
order; the `BlockManager` fills and empties it, nobody else writes it.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # queued; holds no blocks
    RUNNING = "running"      # holds blocks; takes part in steps
    FINISHED = "finished"    # done; blocks already freed unless `hold_blocks`


_counter = itertools.count()


class Sequence:
    """Token ids, progress and block table of one request.

    `num_computed_tokens` counts the leading tokens whose K/V is in the cache. The tokens
    still to feed are `token_ids[num_computed_tokens:]`; when exactly the last one is left
    and the prompt is done, the sequence is decoding.
    """

    def __init__(self, request_id: str, token_ids: list[int], params: SamplingParams,
                 hold_blocks: bool = False, num_prompt_tokens: int | None = None):
        """`token_ids`: the prompt, then (a resumed request) output tokens generated before, which
        count as output (`num_prompt_tokens`: the prompt's length; default all of `token_ids`)."""
        assert token_ids, "a sequence needs at least one token"
        self.request_id = request_id
        self.arrival = next(_counter)
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
        assert 1 <= self.num_prompt_tokens <= len(token_ids)
        self.params = params
        # The prefill role keeps the blocks after the first token so they can be exported.
        self.hold_blocks = hold_blocks
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        # the leading blocks of the table already given back, past every layer's sliding window
        # (BlockManager.mark_computed): their entries are stale and attention never weighs them
        self.num_released_blocks = 0
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0     # prefix-cache hits at the last allocation
        self.block_hashes: list[int] = []  # chained hashes of the leading full, computed blocks
        self.finish_reason: str | None = None
        self.first_scheduled_time: float | None = None  # time.monotonic() at first admission
        # Speculative decoding: the last `num_draft` token ids are proposed, not sampled. They live
        # only within one step (the engine adds them before scheduling and takes them back after
        # the forward), so outside `LLMEngine.step` the count is 0.
        self.num_draft = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def add_draft(self, tokens: list[int]) -> None:
        assert self.num_draft == 0 and self.num_uncomputed_tokens == 1
        self.token_ids.extend(tokens)
        self.num_draft = len(tokens)

    def take_draft(self, keep: int | None = None) -> list[int]:
        """Remove the proposed tokens (all, or all but the first `keep`) and return those removed;
        computed counts shrink with them."""
        cut = self.num_draft if keep is None else self.num_draft - keep
        assert 0 <= cut <= self.num_draft
        if cut == 0:
            return []
        removed = self.token_ids[-cut:]
        del self.token_ids[-cut:]
        self.num_draft -= cut
        self.num_computed_tokens = min(self.num_computed_tokens, len(self.token_ids))
        return removed

    def block_tokens(self, index: int, block_size: int) -> list[int]:
        return self.token_ids[index * block_size:(index + 1) * block_size]

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, len={len(self)}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)}, {self.status.value})")


@dataclass(frozen=True)
class ScheduledChunk:
    """Feed `seq.token_ids[start:start + num_tokens]` this step.

    `sample` is true when the chunk ends at the last token, so the step yields a new token (never
    for an embedding request, SamplingParams.pooling: its step yields the pooled vector).
    `num_draft`: the chunk's last tokens that are proposed (speculative decoding): the step
    yields logits after each of them too (`num_logits` rows in all), to verify them.
    """

    seq: Sequence
    start: int
    num_tokens: int
    sample: bool
    num_draft: int = 0

    @property
    def num_logits(self) -> int:
        return 1 + self.num_draft if self.sample else 0

    @classmethod
    def next_for(cls, seq: Sequence, budget: int) -> "ScheduledChunk":
        """The next chunk of at most `budget` tokens for a sequence."""
        if seq.num_draft and seq.num_uncomputed_tokens > budget:   # as many drafts as fit beside its token
            seq.take_draft(keep=budget - 1)
        n = min(seq.num_uncomputed_tokens, budget)
        start = seq.num_computed_tokens
        return cls(seq, start, n, start + n == len(seq) and seq.params.pooling is None, seq.num_draft)
