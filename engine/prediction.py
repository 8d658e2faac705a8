"""Draft tokens from a predicted output (OpenAI's `prediction`: text the client expects most of the
output to repeat, such as a file it asks the model to edit), torch-free.

The output follows its prediction in order, with changes here and there. `PredictionIndex.propose`
proposes the prediction's tokens after the place the output has reached in it: where the last
draft was taken from, moved on by the tokens output since, while those are the prediction's there;
else (an edit) where the output's last tokens (its last MAX_N down to 1) occur next in the
prediction after that place (else anywhere); with no output yet, the prediction's first tokens.
The engine feeds them as it feeds prompt-lookup drafts (engine/ngram.py) and keeps those the model
itself picks, so a prediction changes how many tokens a step yields, never which.
"""

from __future__ import annotations

import bisect

MAX_N = 4
TAIL = MAX_N + 20      # output tokens `propose` reads: the longest draft (16), its step's own token, and MAX_N


class PredictionIndex:
    def __init__(self, prediction: tuple[int, ...]):
        self.tokens = prediction
        self._ends: dict[tuple[int, ...], list[int]] = {}     # n-gram -> where each occurrence ends, ascending
        for end in range(len(prediction)):
            for n in range(1, min(MAX_N, end + 1) + 1):
                self._ends.setdefault(tuple(prediction[end - n + 1:end + 1]), []).append(end)
        self._last: tuple[int, int] | None = None   # (where the output ended in the prediction, its length then)

    def propose(self, tail: list[int], num_output: int, k: int) -> list[int]:
        """Up to k tokens of the prediction to follow the output, which has `num_output` tokens, the
        last of them `tail` (up to TAIL of them are read)."""
        place = -1 if num_output == 0 else self._place(tail[-TAIL:], num_output)
        if place is None:
            return []
        self._last = (place, num_output)
        return list(self.tokens[place + 1:place + 1 + k])

    def _place(self, tail: list[int], num_output: int) -> int | None:
        """Where the output ends in the prediction: the last draft's place moved on by the tokens
        output since, where they all are the prediction's there; else where its last tokens occur
        next past those that were (an edit), else None."""
        after = 0
        if self._last is not None:
            place, seen = self._last
            after = place + 1
            if 0 < num_output - seen <= len(tail):
                new, went_on = tail[len(tail) - (num_output - seen):], 0
                while (went_on < len(new) and place + 1 + went_on < len(self.tokens)
                       and new[went_on] == self.tokens[place + 1 + went_on]):
                    went_on += 1
                if went_on == len(new):
                    return place + went_on
                after = place + 1 + went_on
        return self._search(tail[-MAX_N:], after)

    def _search(self, tail: list[int], after: int) -> int | None:
        """Where the longest suffix of `tail` occurs first at or past `after`, else where the
        longest occurs last."""
        behind = None
        for n in range(len(tail), 0, -1):
            ends = self._ends.get(tuple(tail[-n:]))
            if not ends:
                continue
            i = bisect.bisect_left(ends, after)
            if i < len(ends):
                return ends[i]
            if behind is None:
                behind = ends[-1]
        return behind
