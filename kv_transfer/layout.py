"""The KV pool layout as kv_transfer sees it, and the pure decisions made from it.

The engine owns one pool tensor per process, shaped
`[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` (dim 1: 0 = K, 1 = V).
A request's KV is a list of block ids into dim 2, in the request's token order; it need not be
contiguous or sorted. Exporting blocks is `kv[:, :, ids]`, importing is
`kv.index_copy_(2, ids, data)`. Nothing here allocates or frees blocks.
"""

from __future__ import annotations

import socket
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
    layers, _, _, block_size, heads, head_dim = kv.shape
    return Fingerprint(
        protocol_version=PROTOCOL_VERSION, model_id=model_id, dtype=DTYPE_NAMES[kv.dtype],
        block_size=block_size, num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
    )


def check_pool_shape(kv: torch.Tensor) -> None:
    """Raise ValueError unless `kv` is a contiguous 6-d pool of a supported dtype."""
    if kv.dim() != 6 or kv.shape[1] != 2:
        raise ValueError(f"KV pool must be [L, 2, num_blocks, bs, H, D], got {tuple(kv.shape)}")
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
    layers, two, _, block_size, heads, head_dim = kv.shape
    return layers * two * block_size * heads * head_dim * kv.element_size()


def transfer_shape(kv: torch.Tensor, num_blocks: int) -> tuple[int, ...]:
    """Shape of `kv[:, :, ids]` for `num_blocks` ids."""
    layers, two, _, block_size, heads, head_dim = kv.shape
    return (layers, two, num_blocks, block_size, heads, head_dim)


def chunk_blocks_for(chunk_bytes: int, one_block_bytes: int) -> int:
    """How many blocks one chunk of at most `chunk_bytes` holds (>= 1); ValueError if none fit."""
    if one_block_bytes > chunk_bytes:
        raise ValueError(f"chunk_bytes {chunk_bytes} is smaller than one block ({one_block_bytes} B)")
    return chunk_bytes // one_block_bytes


def chunk_plan(num_blocks: int, chunk_blocks: int) -> list[tuple[int, int]]:
    """(start, count) slices covering `num_blocks` blocks, `chunk_blocks` at a time."""
    assert num_blocks >= 1 and chunk_blocks >= 1
    return [(s, min(chunk_blocks, num_blocks - s)) for s in range(0, num_blocks, chunk_blocks)]


def local_host_towards(peer_host: str) -> str:
    """The local address the OS would use to reach `peer_host` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer_host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


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
