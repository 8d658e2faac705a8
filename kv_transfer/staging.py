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

from kv_transfer.layout import block_bytes, run_start, transfer_shape


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
        self.block_bytes = block_bytes(kv)
        self._cap = chunk_blocks * self.block_bytes
        self._buffers: list[torch.Tensor | None] = [None, None]

    def view(self, slot: int, count: int) -> torch.Tensor:
        """Buffer `slot` (0 or 1) viewed as `count` blocks shaped [count, L, 2, bs, H, D]."""
        nbytes = count * self.block_bytes
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


def pool_view(kv: torch.Tensor, ids: tuple[int, ...]) -> torch.Tensor | None:
    """The pool's own memory for `ids` ([n, L, 2, bs, H, D], contiguous) when they are one
    ascending run; else None."""
    first = run_start(ids)
    return None if first is None else kv[first:first + len(ids)]


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """[n, ...] viewed as [n, elements per block]: index_select on dim 0 of this 2-d view is a
    plain memcpy per block."""
    return t.view(t.shape[0], -1)


def _sync(kv: torch.Tensor) -> None:
    if kv.device.type == "cuda":
        torch.cuda.current_stream(kv.device).synchronize()


def gather(kv: torch.Tensor, ids: tuple[int, ...], out: torch.Tensor) -> None:
    """out <- kv[ids]; returns when `out` holds the data (synchronous for CUDA)."""
    run = pool_view(kv, ids)
    if run is not None:
        out.copy_(run)                          # one memcpy (device -> pinned host, or same device)
    elif out.device == kv.device:
        torch.index_select(_blocks(kv), 0, index_tensor(kv, ids), out=_blocks(out))
    else:
        out.copy_(kv.index_select(0, index_tensor(kv, ids)))  # gather on device, then to host
    _sync(kv)


def scatter(kv: torch.Tensor, ids: tuple[int, ...], src: torch.Tensor) -> None:
    """kv[ids] <- src; returns when the pool holds the data (synchronous for CUDA)."""
    run = pool_view(kv, ids)
    if run is not None:
        run.copy_(src)
    else:
        src = src if src.device == kv.device else src.to(kv.device)
        _blocks(kv).index_copy_(0, index_tensor(kv, ids), _blocks(src))
    _sync(kv)


def index_tensor(kv: torch.Tensor, ids: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=kv.device)


def copy_blocks(src: torch.Tensor, src_ids: tuple[int, ...], dst: torch.Tensor,
                dst_ids: tuple[int, ...]) -> None:
    """dst[dst_ids] <- src[src_ids] through at most one temporary of that size."""
    chunk = pool_view(src, src_ids)
    if chunk is None:
        chunk = _blocks(src).index_select(0, index_tensor(src, src_ids)).view(-1, *src.shape[1:])
    scatter(dst, dst_ids, chunk)
