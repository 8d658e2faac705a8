"""Log-probabilities of one completion two ways, to compare the engine's forward with transformers':
the engine's as it reported them, and a transformers model's fp32 forward over the same tokens."""

from __future__ import annotations

import torch


def engine_logprobs(done) -> torch.Tensor:
    """A completion's log-probabilities: prompt tokens 2..n (prompt_logprobs), then each generated token."""
    return torch.tensor([lp.logprob for lp in [*done.prompt_logprobs, *done.logprobs]])


def hf_logprobs(model, prompt: list[int], done) -> torch.Tensor:
    """The same targets' log-probabilities from a transformers model's fp32 forward over prompt + output."""
    ids = torch.tensor([prompt + done.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return ref[torch.arange(ids.shape[1] - 1), ids[0, 1:]]
