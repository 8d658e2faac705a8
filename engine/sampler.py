"""Next-token sampling for a batch of sequences with per-request parameters.

Greedy rows take the argmax. Sampled rows apply temperature, top-k and top-p (vectorized
over the rows that use them) and draw with the request's own generator, so a request with a
seed gets the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


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


@torch.inference_mode()
def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
           banned: list[list[int]]) -> list[int]:
    """Pick one token per row. `banned[i]` lists token ids row i may not pick (EOS and stop
    tokens before `min_tokens`)."""
    assert logits.shape[0] == len(params) == len(generators) == len(banned)
    for i, ids in enumerate(banned):
        if ids:
            logits[i, ids] = float("-inf")
    out = logits.argmax(dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    dev = logits.device
    sub = logits[rows] / torch.tensor([params[i].temperature for i in rows], device=dev)[:, None]
    if any(params[i].top_k > 0 or params[i].top_p < 1.0 for i in rows):
        top_k = torch.tensor([max(params[i].top_k, 0) for i in rows], device=dev)
        top_p = torch.tensor([params[i].top_p for i in rows], device=dev, dtype=sub.dtype)
        sub = _filter_top_k_top_p(sub, top_k, top_p)
    probs = sub.softmax(dim=-1)
    for j, i in enumerate(rows):
        out[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]).item())
    return out
