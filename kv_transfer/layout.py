"""The KV pool layout as kv_transfer sees it, and the pure decisions made from it.

The engine owns one pool tensor per process, block-major:
`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` (dim 2: 0 = K, 1 = V).
One block, all layers, K and V, is one contiguous piece of memory, so any block can go on the
wire without a copy. A request's KV is a list of block ids into dim 0, in the request's token
order; it need not be contiguous or sorted. Exporting blocks is `kv[ids]`, importing is
`kv.index_copy_(0, ids, data)`. Nothing here allocates or frees blocks.
"""

from __future__ import annotations

import socket
from typing import Sequence

import torch
import torch.distributed as dist

from kv_transfer.protocol import PROTOCOL_VERSION, DeviceInfo, Fingerprint

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def fingerprint_for(kv: torch.Tensor, model_id: str) -> Fingerprint:
    """The compatibility fingerprint of pool `kv` holding KV of model `model_id`."""
    check_pool_shape(kv)
    _, layers, _, block_size, heads, head_dim = kv.shape
    return Fingerprint(
        protocol_version=PROTOCOL_VERSION, model_id=model_id, dtype=DTYPE_NAMES[kv.dtype],
        block_size=block_size, num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
    )


def check_pool_shape(kv: torch.Tensor) -> None:
    """Raise ValueError unless `kv` is a contiguous 6-d pool of a supported dtype."""
    if kv.dim() != 6 or kv.shape[2] != 2:
        raise ValueError(f"KV pool must be [num_blocks, L, 2, bs, H, D], got {tuple(kv.shape)}")
    if kv.dtype not in DTYPE_NAMES:
        raise ValueError(f"KV pool dtype {kv.dtype} not in {list(DTYPES)}")
    if not kv.is_contiguous():
        raise ValueError("KV pool must be contiguous")


def check_pool(kv: torch.Tensor, fingerprint: Fingerprint) -> None:
    """Raise ValueError unless pool `kv` is the one `fingerprint` describes."""
    mismatch = fingerprint.mismatch(fingerprint_for(kv, fingerprint.model_id))
    if mismatch:
        raise ValueError(f"fingerprint does not describe the KV pool: {mismatch}")


def block_bytes(kv: torch.Tensor) -> int:
    """Bytes of one block across all layers, K and V."""
    return kv[0].numel() * kv.element_size()


def transfer_shape(kv: torch.Tensor, num_blocks: int) -> tuple[int, ...]:
    """Shape of `kv[ids]` for `num_blocks` ids."""
    return (num_blocks, *kv.shape[1:])


def chunk_blocks_for(chunk_bytes: int, one_block_bytes: int) -> int:
    """How many blocks one message of at most `chunk_bytes` holds; at least one, so a block
    larger than `chunk_bytes` travels alone."""
    return max(1, chunk_bytes // one_block_bytes)


def chunk_plan(num_blocks: int, chunk_blocks: int) -> list[tuple[int, int]]:
    """(start, count) slices covering `num_blocks` blocks, `chunk_blocks` at a time."""
    assert num_blocks >= 1 and chunk_blocks >= 1
    return [(s, min(chunk_blocks, num_blocks - s)) for s in range(0, num_blocks, chunk_blocks)]


def run_start(ids: Sequence[int]) -> int | None:
    """ids[0] when `ids` is the run ids[0], ids[0]+1, ...; else None."""
    first = ids[0]
    return first if all(b == first + j for j, b in enumerate(ids)) else None


def run_segments(ids: Sequence[int], chunk_blocks: int) -> list[int]:
    """Block counts of consecutive segments of `ids`: its maximal ascending runs
    (b, b+1, ...), each cut into pieces of at most `chunk_blocks`."""
    assert ids and chunk_blocks >= 1
    counts, length = [], 1
    for prev, cur in zip(ids, ids[1:]):
        if cur == prev + 1 and length < chunk_blocks:
            length += 1
        else:
            counts.append(length)
            length = 1
    counts.append(length)
    return counts


def segment_slices(counts: Sequence[int]) -> list[tuple[int, int]]:
    """(start, count) of each segment given the segments' block counts."""
    out, start = [], 0
    for count in counts:
        out.append((start, count))
        start += count
    return out


def local_host_towards(peer_host: str) -> str:
    """The local address the OS would use to reach `peer_host` (no packet is sent). Raises OSError
    when there is no route: the sender's pairing turns it into an error value (falling back to
    127.0.0.1 would only move the failure to a peer that cannot reach us)."""
    family = socket.AF_INET6 if ":" in peer_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((peer_host, 9))
        return s.getsockname()[0]


def device_info(kv: torch.Tensor, host: str) -> DeviceInfo:
    """Describe where pool `kv` lives, for the handshake."""
    nccl = dist.is_nccl_available()
    if kv.device.type != "cuda":
        return DeviceInfo(kind="cpu", host=host, index=0, uuid="", nccl=nccl)
    index = kv.device.index if kv.device.index is not None else torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
    return DeviceInfo(kind="cuda", host=host, index=index, uuid=uuid, nccl=nccl)


def same_gpu(a: DeviceInfo, b: DeviceInfo) -> bool:
    """Whether two CUDA device descriptions name the same physical GPU."""
    if a.uuid and b.uuid:
        return a.uuid == b.uuid
    return (a.host, a.index) == (b.host, b.index)


def choose_backend(local: DeviceInfo, peer: DeviceInfo) -> str:
    """'nccl' when both pools are on CUDA, on distinct GPUs, and both ends have NCCL; else 'gloo'.

    Pure and symmetric: both ends of a pair compute the same answer from the two DeviceInfos
    exchanged in the handshake. (NCCL cannot pair two ranks on one GPU; gloo then stages
    through pinned host memory.)
    """
    both_cuda = local.kind == "cuda" and peer.kind == "cuda"
    if both_cuda and local.nccl and peer.nccl and not same_gpu(local, peer):
        return "nccl"
    return "gloo"
