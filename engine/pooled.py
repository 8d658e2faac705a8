"""One embedding request's pooling as its prompt's chunks run (engine/pooling.py says what is
pooled; the engine feeds `add` each chunk's rows that `rows` asks for, and takes `vector` once the
prompt's last chunk ran)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.pooling import Pooling


class Pooled:
    def __init__(self, pooling: Pooling):
        self.pooling = pooling
        self.upto = 0                         # leading prompt positions pooled
        self.total: torch.Tensor | None = None  # float32 [hidden]: the rows' sum ("mean"), else the row

    def rows(self, start: int, num_tokens: int, num_prompt_tokens: int) -> tuple[int, int] | None:
        """Pooling.rows for a chunk of this request."""
        return self.pooling.rows(start, num_tokens, num_prompt_tokens, self.upto)

    def add(self, position: int, hidden: torch.Tensor) -> None:
        """The final hidden states [rows, hidden] of prompt positions `position`, `position` + 1, ..."""
        rows = hidden if self.pooling.labels else hidden.float()    # the LM head's input, as it is
        if self.pooling.kind == "mean":
            total = rows.sum(0)
            self.total = total if self.total is None else self.total + total
        else:
            self.total = rows[-1].clone()
        self.upto = position + rows.shape[0]

    def vector(self, num_prompt_tokens: int, lm_head: Callable[[torch.Tensor], torch.Tensor]) -> bytes:
        """The embedding as little-endian float32 bytes (OpenAI's base64 encoding's bytes); with
        labels, their log-probabilities (`lm_head`: final hidden states [n, hidden] -> logits)."""
        assert self.total is not None and (self.pooling.kind == "cls" or self.upto == num_prompt_tokens)
        if self.pooling.labels:
            logprobs = lm_head(self.total[None]).float().log_softmax(-1)[0]
            v = logprobs[torch.tensor(self.pooling.labels, device=logprobs.device)]
            return v.to("cpu").numpy().astype("<f4").tobytes()
        v = self.total / num_prompt_tokens if self.pooling.kind == "mean" else self.total
        if self.pooling.dimensions is not None:
            v = v[:self.pooling.dimensions]
        if self.pooling.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        return v.to("cpu", torch.float32).numpy().astype("<f4").tobytes()
