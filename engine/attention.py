"""Paged attention as a transformers attention function.

The model runner flattens a ragged step (prompt chunks and single decode tokens of many
sequences) into one row of tokens and passes an `AttentionMetadata` as the `pd_attn`
keyword; transformers forwards it to this function in every layer. Per layer it
  1. writes the new K/V into the KV pool at `slot_mapping`,
  2. attends every decode token over its sequence's blocks (one batched sdpa call, padded
     keys masked out),
  3. attends every prompt chunk over its past blocks plus itself (explicit offset-causal
     mask: sdpa's `is_causal` is aligned top-left, wrong once the chunk has a past).
GQA, scaling and kernel choice are left to transformers' own sdpa helper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTN_IMPLEMENTATION = "pdserve_paged"


@dataclass
class PrefillSpan:
    q_start: int                       # first query row in the flat batch
    q_end: int
    context_slots: torch.Tensor | None  # layer-0 K slots of all keys (past + chunk); None when no past
    mask: torch.Tensor | None          # [1, 1, q, ctx] bool; None when no past (plain causal)


@dataclass
class AttentionMetadata:
    kv_pool: torch.Tensor              # [blocks, layers, 2, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor         # [T] layer-0 K slot of each new token (see token_slots)
    decode_rows: torch.Tensor | None   # [B] query rows of decode tokens
    decode_blocks: torch.Tensor | None  # [B, max_blocks] block tables, padded with block 0
    decode_mask: torch.Tensor | None   # [B, 1, 1, max_blocks * block_size] bool, True = attend
    prefills: list[PrefillSpan]
    all_decode: bool = False           # every row is a decode token, in order (rows = arange)


def token_slots(block_table: torch.Tensor, block_size: int, num_layers: int) -> torch.Tensor:
    """Layer-0 K slots [len(table) * block_size] of a block table, in token order.

    The pool is block-major, `[blocks, layers, 2, block_size, kv_heads, head_dim]`: one block
    is contiguous across all layers (so KV transfer can move any block without a copy). Viewed
    as rows of [kv_heads, head_dim], token t of block b in layer l, K (c = 0) or V (c = 1), is
    row `b * L * 2 * bs + t + (2 * l + c) * bs`; this returns the part without `(2l + c) * bs`.
    """
    offsets = torch.arange(block_size)
    return (block_table[:, None] * (num_layers * 2 * block_size) + offsets).flatten()


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None,
                            dropout=0.0, pd_attn: AttentionMetadata | None = None, **kwargs):
    assert pd_attn is not None, "pdserve_paged attention needs the runner's metadata"
    meta = pd_attn
    _, n_heads, n_tokens, head_dim = query.shape
    pool = meta.kv_pool
    _, n_layers, _, block_size, n_kv, _ = pool.shape
    flat = pool.view(-1, n_kv, head_dim)              # token rows, see token_slots
    k_shift = 2 * module.layer_idx * block_size       # layer-0 K slot -> this layer's K slot
    v_shift = k_shift + block_size
    # 1. store the new K/V
    flat.index_copy_(0, meta.slot_mapping + k_shift, key[0].transpose(0, 1))
    flat.index_copy_(0, meta.slot_mapping + v_shift, value[0].transpose(0, 1))

    out = None if meta.all_decode else query.new_empty(1, n_tokens, n_heads, head_dim)
    # 2. decode tokens, batched; keys gathered a whole block at a time
    if meta.decode_rows is not None:
        rows = meta.decode_rows
        q = (query[0] if meta.all_decode else query[0, :, rows]).transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
        b, nb = meta.decode_blocks.shape
        k_rows = meta.decode_blocks * (2 * n_layers) + 2 * module.layer_idx  # V: k_rows + 1
        block_rows = pool.view(-1, block_size * n_kv * head_dim)
        kv = block_rows.index_select(0, torch.stack((k_rows, k_rows + 1)).view(-1))
        kv = kv.view(2, b, nb * block_size, n_kv, head_dim)
        k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)                 # [B, Hkv, L, D]
        o, _ = sdpa_attention_forward(module, q, k, v, meta.decode_mask, scaling=scaling,
                                      is_causal=False)
        if meta.all_decode:
            return o.view(1, n_tokens, n_heads, head_dim), None
        out[0, rows] = o[:, 0]
    # 3. prompt chunks, one at a time
    for span in meta.prefills:
        q = query[:, :, span.q_start:span.q_end]
        if span.context_slots is None:
            k = key[:, :, span.q_start:span.q_end]
            v = value[:, :, span.q_start:span.q_end]
        else:
            k = flat[span.context_slots + k_shift].transpose(0, 1).unsqueeze(0)
            v = flat[span.context_slots + v_shift].transpose(0, 1).unsqueeze(0)
        o, _ = sdpa_attention_forward(module, q, k, v, span.mask, scaling=scaling,
                                      is_causal=span.mask is None)
        out[0, span.q_start:span.q_end] = o[0]
    return out, None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
