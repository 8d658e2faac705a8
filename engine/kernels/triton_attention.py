"""Paged decode attention in Triton: the CUDA counterpart of paged_attention_cpu.cpp.

One program per (sequence, KV head) walks the sequence's block table, reads each block's K/V
rows straight from the block-major pool and keeps an online softmax for the query heads of
that KV head's group (GQA without repeating heads, no `[batch, context]` copy). The loop bound
is read from `lens` on the device (with a sliding window of W keys, the loop starts at the block
of key `len - W`, and keys before it are masked), so a launch's shape depends only on the batch: CUDA graphs
capture it once per batch bucket (engine.cuda_graphs).

`TritonKernels().paged_decode_attention(query, pool, tables, lens, layer, scale, window, softcap, sinks)` has
the signature of `torch.ops.pdserve.paged_decode_attention`. Attention sinks (gpt-oss: a logit per
query head, with a zero value) start each head's online softmax: its max at the sink, its sum at 1.
Triton ships with CUDA builds of torch; on CPU the kernel runs under Triton's interpreter
(`TRITON_INTERPRET=1`), which is how the tests check it without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode(Q, POOL, TABLES, LENS, OUT, SINKS, scale, table_stride, block_stride, k_offset, v_offset,
                  token_stride, SINK: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HEADS: tl.constexpr,
                  GROUP: tl.constexpr, GROUP_P: tl.constexpr, DIM: tl.constexpr, DIM_P: tl.constexpr,
                  BLOCK: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, DIM_P)
    t = tl.arange(0, BLOCK)
    q_mask = (g < GROUP)[:, None] & (d < DIM)[None, :]
    q_rows = (b * HEADS + h * GROUP + g)[:, None] * DIM + d[None, :]
    q = tl.load(Q + q_rows, mask=q_mask, other=0.0).to(tl.float32) * scale          # [G, D]
    length = tl.load(LENS + b)
    first = 0
    if WINDOW > 0:
        first = tl.maximum(length - WINDOW, 0)
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    if SINK:                            # gpt-oss: the sink's exp(sink - max) is in the sum from the start
        m_i = tl.load(SINKS + h * GROUP + g, mask=g < GROUP, other=float("-inf")).to(tl.float32)
        l_i = tl.where(g < GROUP, 1.0, 0.0)
    acc = tl.zeros([GROUP_P, DIM_P], tl.float32)
    for j in range(first // BLOCK, tl.cdiv(length, BLOCK)):
        block = tl.load(TABLES + b * table_stride + j).to(tl.int64)
        valid = (j * BLOCK + t < length) & (j * BLOCK + t >= first)
        rows = POOL + block * block_stride + t[:, None] * token_stride + h * DIM + d[None, :]
        kv_mask = valid[:, None] & (d < DIM)[None, :]
        k = tl.load(rows + k_offset, mask=kv_mask, other=0.0).to(tl.float32)        # [BLOCK, D]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)                            # [G, BLOCK]
        if SOFTCAP > 0:                 # Gemma 2: C * tanh(s / C), tanh(u) = 1 - 2 / (e^2u + 1)
            s = SOFTCAP * (1.0 - 2.0 / (tl.exp(s * (2.0 / SOFTCAP)) + 1.0))
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(rows + v_offset, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(OUT + q_rows, out.to(OUT.dtype.element_ty), mask=q_mask)


class TritonKernels:
    """The `paged_decode_attention` op of engine.kernels, for CUDA pools."""

    @staticmethod
    def paged_decode_attention(query: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                               layer: int, scale: float, window: int = 0, softcap: float = 0.0,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
        batch, heads, dim = query.shape
        layers, block_size, kv_heads = pool.shape[1], pool.shape[3], pool.shape[4]
        assert pool.is_contiguous() and tables.is_contiguous() and lens.is_contiguous()
        assert heads % kv_heads == 0 and pool.shape[5] == dim and 0 <= layer < layers
        assert sinks is None or (sinks.dtype == torch.float32 and sinks.numel() == heads and sinks.is_contiguous())
        q = query.contiguous()
        out = torch.empty(batch, heads * dim, dtype=query.dtype, device=query.device)
        token_stride = kv_heads * dim
        half = block_size * token_stride
        group = heads // kv_heads
        _paged_decode[(batch, kv_heads)](
            q, pool, tables, lens, out, q if sinks is None else sinks, scale, tables.stride(0), layers * 2 * half,
            layer * 2 * half, layer * 2 * half + half, token_stride, SINK=sinks is not None, WINDOW=window,
            SOFTCAP=float(softcap), HEADS=heads, GROUP=group, GROUP_P=triton.next_power_of_2(group), DIM=dim,
            DIM_P=triton.next_power_of_2(dim), BLOCK=block_size)
        return out
