"""Bounded staging buffers and the copies between a KV pool and them.

Each pair side owns one `Staging`: two flat byte buffers of at most `chunk_bytes` each
(double buffering: one is on the wire while the other is being filled or emptied), allocated
on first use and released with the pair. Where they live:

    pool on CPU                  -> CPU memory
    pool on CUDA, backend gloo   -> pinned CPU memory (gloo moves host memory only)
    pool on CUDA, backend nccl   -> the pool's GPU (NCCL moves device memory)
"""

from __future__ import annotations

import torch

from kv_transfer.layout import block_bytes, transfer_shape


def staging_device(kv: torch.Tensor, backend: str) -> torch.device:
    """Where the staging buffers for pool `kv` on `backend` live."""
    if kv.device.type == "cuda" and backend == "nccl":
        return kv.device
    return torch.device("cpu")


class Staging:
    """Two reusable byte buffers for chunks of pool `kv`. Not thread-safe: one pair, one user
    at a time (the pair's lock or thread serializes transfers)."""

    def __init__(self, kv: torch.Tensor, backend: str, chunk_blocks: int) -> None:
        self._kv = kv
        self.device = staging_device(kv, backend)
        self._pin = self.device.type == "cpu" and kv.device.type == "cuda"
        self._block_bytes = block_bytes(kv)
        self._cap = chunk_blocks * self._block_bytes
        self._buffers: list[torch.Tensor | None] = [None, None]

    def view(self, slot: int, count: int) -> torch.Tensor:
        """Buffer `slot` (0 or 1) viewed as `count` blocks shaped [L, 2, count, bs, H, D]."""
        nbytes = count * self._block_bytes
        assert 0 < nbytes <= self._cap, (count, self._cap)
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            # Grow to the need of this transfer, never beyond one chunk.
            size = min(self._cap, max(nbytes, 2 * (0 if buf is None else buf.numel())))
            buf = torch.empty(size, dtype=torch.uint8, device=self.device, pin_memory=self._pin)
            self._buffers[slot] = buf
        flat = buf[:nbytes].view(self._kv.dtype)
        return flat.view(transfer_shape(self._kv, count))

    def release(self) -> None:
        self._buffers = [None, None]


def index_tensor(kv: torch.Tensor, ids: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=kv.device)


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """[L, 2, n, bs, H, D] viewed as [L*2, n, bs*H*D]. Indexing dim 1 of this view is far
    faster on CPU than indexing dim 2 of the 6-d tensor (which can be ~30x slower)."""
    return t.view(t.shape[0] * t.shape[1], t.shape[2], -1)


def gather(kv: torch.Tensor, ids: tuple[int, ...], out: torch.Tensor) -> None:
    """out <- kv[:, :, ids]; returns when `out` holds the data (synchronous for CUDA)."""
    idx = index_tensor(kv, ids)
    if out.device == kv.device:
        torch.index_select(rows_view(kv), 1, idx, out=rows_view(out))
    else:
        out.copy_(rows_view(kv).index_select(1, idx).view(out.shape))  # device -> pinned host
    if kv.device.type == "cuda":
        torch.cuda.current_stream(kv.device).synchronize()


def scatter(kv: torch.Tensor, ids: tuple[int, ...], src: torch.Tensor) -> None:
    """kv[:, :, ids] <- src; returns when the pool holds the data (synchronous for CUDA)."""
    idx = index_tensor(kv, ids)
    src = src if src.device == kv.device else src.to(kv.device)
    rows_view(kv).index_copy_(1, idx, rows_view(src))
    if kv.device.type == "cuda":
        torch.cuda.current_stream(kv.device).synchronize()


def copy_blocks(src: torch.Tensor, src_ids: tuple[int, ...], dst: torch.Tensor,
                dst_ids: tuple[int, ...]) -> None:
    """dst[:, :, dst_ids] <- src[:, :, src_ids] through one temporary of that size."""
    chunk = rows_view(src).index_select(1, index_tensor(src, src_ids))
    rows_view(dst).index_copy_(1, index_tensor(dst, dst_ids), chunk.to(dst.device))
