"""Paged attention over the block-major KV pool.

The model runner flattens a ragged step (prompt chunks and single decode tokens of many
sequences) into one row of tokens and builds an `AttentionMetadata`; the decoder
(`engine.decoder`) calls `paged_attention` in every layer. Per layer it
  1. writes the new K/V into the KV pool at `slot_mapping`,
  2. attends every decode token over its sequence's blocks, one call for the whole batch:
       backend "paged": the engine's kernel (engine.kernels: C++ on CPU, Triton on CUDA) reads
         K/V from the pool in place, block table by block table; the tokens of short prompt
         chunks after a past (backends.KERNEL_CHUNK_ROWS) are rows of the same call, each
         over its own causal context;
       backend "torch": K/V gathered a whole block at a time into a [batch, max_context] copy
         per layer, then one sdpa call with the padding masked out (any device and dtype),
  3. attends every other prompt chunk over its past blocks plus itself: with the CPU paged
     backend in bf16, the engine's prefill kernel reads them from the pool in place by block
     table (`PrefillSpan.table`); otherwise sdpa on the chunk's context gathered once (explicit
     offset-causal mask: sdpa's `is_causal` is aligned top-left, wrong once the chunk has a past).
A sliding-window layer (`window` W > 0: Mistral v0.1, Qwen2/3 with `use_sliding_window`, Gemma 3's
local layers) attends each query's last W keys, itself included (transformers' `kv_idx > q_idx - W`):
the kernels take W and start at the window's first key; the torch paths use the step's masks for W
(`DecodeBatch.window_masks`, `PrefillSpan.window_masks`, built by the runner). Where every layer has
a window, the blocks a sequence's window has passed go back to the pool (BlockManager.mark_computed)
and their entries in its table are stale: the kernels never read them, and a torch path reads
whatever K/V they now hold (finite, another sequence's or zeros) under a mask that weighs it 0.
Attention sinks (gpt-oss: `sinks`, one learned logit per query head) join each row's softmax as
one more score whose value is zero: they only add exp(sink - max) to its denominator (the kernels
add that term; the torch paths run `eager_sdpa`, transformers' eager math with the sink column).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    q_start: int                       # first query row in the flat batch
    q_end: int
    context_slots: torch.Tensor | None  # sdpa: layer-0 K slots of all keys (past + chunk); None when no past
    mask: torch.Tensor | None          # sdpa: [1, 1, q, ctx] bool; None when no past (plain causal)
    table: torch.Tensor | None = None  # prefill kernel: the sequence's block table (int64), covering past + chunk
    past: int = 0                      # prefill kernel: tokens before the chunk
    window_masks: dict | None = None   # sdpa: {W: [1, 1, q, ctx] bool} of the model's sliding windows


@dataclass
class DecodeBatch:
    """The decode tokens of a step (and, with the paged backend, the tokens of short prompt chunks
    after a past), in the form their backend reads."""
    rows: torch.Tensor                 # [B] query rows of decode tokens
    tables: torch.Tensor | None = None  # paged: [B, max_blocks] int64 block tables (padded)
    lens: torch.Tensor | None = None   # paged: [B] int64 context lengths, new token included
    blocks: torch.Tensor | None = None  # torch: [2 * B * max_blocks] layer-0 K then V rows of the
                                        # block tables (padded with block 0) in the pool viewed
                                        # as [blocks * layers * 2, block]; see paged_attention
    mask: torch.Tensor | None = None   # torch: [B, 1, 1, max_blocks * block_size] bool, True = attend
    window_masks: dict | None = None   # torch: {W: mask as above, only each row's last W keys}


@dataclass
class AttentionMetadata:
    kv_pool: torch.Tensor              # [blocks, layers, 2, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor         # [T] layer-0 K slot of each new token (see token_slots)
    decode: DecodeBatch | None
    prefills: list[PrefillSpan]
    all_decode: bool = False           # every row is a decode token, in order (rows = arange)
    kernels: object | None = None      # backend paged: has paged_decode_attention; torch: None

    @property
    def in_place(self) -> bool:
        """Every attention of the step reads K/V from the pool (no sdpa span): the decode rows
        and, with the prefill kernel, every prompt chunk."""
        return self.kernels is not None and all(span.table is not None for span in self.prefills)


def token_slots(block_table: torch.Tensor, block_size: int, num_layers: int) -> torch.Tensor:
    """Layer-0 K slots [len(table) * block_size] of a block table, in token order.

    The pool is block-major, `[blocks, layers, 2, block_size, kv_heads, head_dim]`: one block
    is contiguous across all layers (so KV transfer can move any block without a copy). Viewed
    as rows of [kv_heads, head_dim], token t of block b in layer l, K (c = 0) or V (c = 1), is
    row `b * L * 2 * bs + t + (2 * l + c) * bs`; this returns the part without `(2l + c) * bs`.
    """
    offsets = torch.arange(block_size)
    return (block_table[:, None] * (num_layers * 2 * block_size) + offsets).flatten()


def window_mask(q_pos: torch.Tensor, context: int, window: int) -> torch.Tensor:
    """[1, 1, q, context] bool, True = attend: queries at positions `q_pos` [q] over keys 0 ..
    context - 1, causal and within a sliding window of `window` keys (k > q - window)."""
    k = torch.arange(context, device=q_pos.device)[None, :]
    return ((k <= q_pos[:, None]) & (k > q_pos[:, None] - window))[None, None]


def fused_attention(layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                    meta: AttentionMetadata, scale: float, rope_store, window: int = 0,
                    softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attention` for a step of the bf16 CPU decoder whose every attention reads the pool
    in place (`meta.in_place`: decode rows through the paged decode kernel, prompt chunks through
    the prefill kernel), RoPE included: qkv [T, (H + 2 Hkv) * D] un-rotated, cos/sin [T, D] ->
    [T, H * D]. `rope_store` (engine.kernels) rotates q and k and stores k and v (1. below) in one
    call, then the kernels attend (2., 3.). The caller checks `meta.in_place` and `meta.kernels`."""
    assert meta.in_place and meta.kernels is not None
    n_kv = meta.kv_pool.shape[4]
    q = rope_store(qkv, cos, sin, meta.kv_pool, meta.slot_mapping, layer, num_heads, n_kv)
    return _attend(layer, q, None, None, meta, scale, window, softcap, sinks)


def paged_attention(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of layer `layer` for a ragged step: query [T, H, D], key/value [T, Hkv, D]
    (RoPE applied) -> [T, H * D]; `window` 0, or W for a sliding-window layer; `softcap` 0, or C
    for scores soft-capped to C * tanh(s / C) (Gemma 2: the kernels cap them, sdpa spans run
    `eager_sdpa`); `sinks` None, or the layer's attention sinks [H] fp32 (gpt-oss).
    K/V heads are never repeated for GQA: decode queries of one KV head attend as a group (the
    group is sdpa's query axis), prompt chunks use sdpa's `enable_gqa`."""
    head_dim = query.shape[2]
    pool = meta.kv_pool
    block_size, n_kv = pool.shape[3], pool.shape[4]
    flat = pool.view(-1, n_kv, head_dim)              # token rows, see token_slots
    k_shift = 2 * layer * block_size                  # layer-0 K slot -> this layer's K slot
    # 1. store the new K/V
    flat.index_copy_(0, meta.slot_mapping + k_shift, key)
    flat.index_copy_(0, meta.slot_mapping + k_shift + block_size, value)
    return _attend(layer, query, key, value, meta, scale, window, softcap, sinks)


def _attend(layer: int, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
            meta: AttentionMetadata, scale: float, window: int, softcap: float = 0.0,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """2. and 3. of the module docstring, the new K/V already in the pool; `key`/`value` (the
    step's own, RoPE applied) are read only by sdpa spans without a past."""
    n_tokens, n_heads, head_dim = query.shape
    sdpa = F.scaled_dot_product_attention
    if softcap or sinks is not None:      # sinks [H] as a column of the spans' [1, H, n, 1] scores
        sdpa = functools.partial(eager_sdpa, softcap=softcap, sinks=None if sinks is None else sinks.view(-1, 1, 1))
    pool = meta.kv_pool
    block_size, n_kv = pool.shape[3], pool.shape[4]
    group = n_heads // n_kv
    flat = pool.view(-1, n_kv, head_dim)
    k_shift = 2 * layer * block_size
    v_shift = k_shift + block_size
    out = None if meta.all_decode else query.new_empty(n_tokens, n_heads * head_dim)
    # 2. decode tokens, batched
    dec = meta.decode
    if dec is not None:
        q = query if meta.all_decode else query[dec.rows]
        if meta.kernels is not None:
            o = meta.kernels.paged_decode_attention(q, pool, dec.tables, dec.lens, layer, scale, window, softcap,
                                                    sinks)
        else:
            o = gathered_decode(layer, q, pool, dec, scale, dec.window_masks[window] if window else dec.mask,
                                sdpa if sinks is None else functools.partial(
                                    eager_sdpa, softcap=softcap, sinks=sinks.view(n_kv, group, 1)))
        if meta.all_decode:
            return o
        out[dec.rows] = o
    # 3. prompt chunks, one at a time
    for span in meta.prefills:
        if span.table is not None:
            out[span.q_start:span.q_end] = meta.kernels.paged_prefill_attention(
                query[span.q_start:span.q_end], pool, span.table, span.past, layer, scale, window, softcap, sinks)
            continue
        q = query[span.q_start:span.q_end].transpose(0, 1)[None]             # [1, H, n, D]
        if span.context_slots is None:
            k = key[span.q_start:span.q_end]
            v = value[span.q_start:span.q_end]
        else:
            k = flat[span.context_slots + k_shift]
            v = flat[span.context_slots + v_shift]
        mask = span.window_masks[window] if window else span.mask
        o = sdpa(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                 scale=scale, enable_gqa=group > 1)
        out[span.q_start:span.q_end] = o[0].transpose(0, 1).reshape(-1, n_heads * head_dim)
    return out


def gathered_decode(layer: int, q: torch.Tensor, pool: torch.Tensor, dec: DecodeBatch, scale: float,
                    mask: torch.Tensor, sdpa=F.scaled_dot_product_attention):
    """The torch backend: keys gathered a whole block at a time, then one sdpa call under `mask`
    (`dec.mask`, or a sliding window's; `sdpa`: torch's, or `eager_sdpa`, whose sinks are then
    [Hkv, group, 1]).
    The query heads of one KV head attend as a group (sdpa's query axis), so K/V heads are
    never repeated for GQA."""
    b, n_heads, head_dim = q.shape
    block_size, n_kv = pool.shape[3], pool.shape[4]
    q = q.view(b, n_kv, n_heads // n_kv, head_dim)                           # [B, Hkv, g, D]
    block_rows = pool.view(-1, block_size * n_kv * head_dim)
    kv = block_rows.index_select(0, dec.blocks + 2 * layer).view(2, b, -1, n_kv, head_dim)
    k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)                     # [B, Hkv, L, D]
    o = sdpa(q, k, v, attn_mask=mask, scale=scale)
    return o.reshape(b, n_heads * head_dim)


def eager_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
               is_causal: bool = False, scale: float = 1.0, enable_gqa: bool = False,
               softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """sdpa's math with the scores soft-capped (Gemma 2) or with attention sinks (gpt-oss), written
    out as transformers' eager attention computes it: s = (q @ k^T) * scale, then s / C, tanh, * C,
    masked, softmax in fp32 back to the model's dtype, @ v; with `sinks` (broadcast to the scores'
    [..., n, 1]) gpt-oss's: the sink column beside the scores, the row's max subtracted, softmax
    in the scores' dtype, the column dropped. q [B, H, n, D], k/v [B, Hkv, L, D]; `attn_mask` bool,
    True = attend, broadcast to [B, H, n, L]; `is_causal`: top-left aligned, as sdpa's."""
    if enable_gqa and k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if is_causal:
        n, length = s.shape[-2], s.shape[-1]
        attn_mask = torch.ones(n, length, dtype=torch.bool, device=s.device).tril()
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, torch.finfo(s.dtype).min)
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).expand(*s.shape[:-1], 1)], dim=-1)
        s = s - s.max(dim=-1, keepdim=True).values
        return torch.matmul(torch.softmax(s, dim=-1, dtype=s.dtype)[..., :-1].to(v.dtype), v)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v)
