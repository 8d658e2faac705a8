"""The data plane of one pair: a 2-rank process group (receiver rank 0, sender rank 1).

Built with the low-level backend constructors on a PrefixStore of the receiver's TCPStore; no
global world exists, and one process may hold many channels at once. Only KV bytes travel
here; every control message goes through the store (see rendezvous.py), so the receiver always
knows each message's exact size before posting its receive.

Every wait takes an explicit deadline. When one passes, or the peer dies, the operation raises
(RuntimeError / torch.distributed.DistError); the owner must then close() the channel with
failed=True and build a new one: a gloo pair closes itself on timeout, and NCCL must abort.

CUDA pools: a transfer's device work (gathers, scatters, NCCL sends and receives and their
waits) runs inside `device_stream`, on the pair's own stream, ordered after the work already
queued on the caller's stream; so an NCCL message waiting for its peer never stalls the engine's
stream, and several pairs never chain their engines' streams into one another. NCCL's watchdog
is told to abort a failed communicator without tearing the process down
(TORCH_NCCL_ASYNC_ERROR_HANDLING=2, unless the environment sets it): one broken pair must not
take the replica with it; its owner closes it and the next transfer builds a fresh one.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store

from kv_transfer.rendezvous import group_prefix, seconds

SENDER_RANK, RECEIVER_RANK = 1, 0


def _gloo_group(store: Store, rank: int, timeout_s: float, local_host: str):
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
    opts._timeout = seconds(timeout_s)
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def _nccl_group(store: Store, rank: int, timeout_s: float):
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        raise RuntimeError("this torch build has no NCCL")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")   # read by the constructor
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    opts = nccl.Options()
    opts._timeout = seconds(timeout_s)
    opts.is_high_priority_stream = False
    return nccl(store, rank, 2, opts)


class Channel:
    """One side of a pair's process group. Not thread-safe: one transfer at a time."""

    def __init__(self, backend: str, store: Store, pair_id: int, rank: int,
                 connect_timeout_s: float, local_host: str, op_timeout_s: float = 0.0) -> None:
        """Join the pair's group; blocks until the peer joins or `connect_timeout_s` passes
        (then raises). `store` is the pair's control client: gloo uses it only inside this
        constructor, so it is shared; NCCL keeps using its store from its own threads
        (communicator set-up, watchdog), so it gets a clone of its own. `op_timeout_s` (NCCL):
        the watchdog's limit on one operation, a backstop that must outlast the longest
        legitimate wait (a receiver waiting for its reservation, then the transfer); every
        wait here is bounded by its own deadline first."""
        assert backend in ("gloo", "nccl") and rank in (SENDER_RANK, RECEIVER_RANK)
        self.backend = backend
        self.peer = 1 - rank
        if backend == "nccl":
            store = store.clone()
        prefixed = PrefixStore(group_prefix(pair_id), store)
        if backend == "nccl":
            self._pg = _nccl_group(prefixed, rank, max(connect_timeout_s, op_timeout_s))
        else:
            self._pg = _gloo_group(prefixed, rank, connect_timeout_s, local_host)
        self._store = store  # keep the client alive as long as the group
        self._cuda_stream = None

    @contextlib.contextmanager
    def device_stream(self, kv: torch.Tensor):
        """Run the enclosed device work on this pair's own CUDA stream, after what is already
        queued on the caller's current stream (see the module docstring); no-op for CPU pools."""
        if kv.device.type != "cuda":
            yield
            return
        if self._cuda_stream is None:
            self._cuda_stream = torch.cuda.Stream(device=kv.device)
        self._cuda_stream.wait_stream(torch.cuda.current_stream(kv.device))
        with torch.cuda.stream(self._cuda_stream):
            yield

    def post_send(self, tensor: torch.Tensor):
        """Start sending `tensor` (contiguous) to the peer; returns the work to wait()."""
        return self._pg.send([_as_bytes(tensor)], self.peer, 0)

    def post_recv(self, tensor: torch.Tensor):
        """Start receiving exactly `tensor`'s bytes from the peer into `tensor`."""
        return self._pg.recv([_as_bytes(tensor)], self.peer, 0)

    @staticmethod
    def wait(work, deadline: float) -> None:
        """Wait for `work` until `deadline` (time.monotonic()); raises on timeout or fault."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("transfer deadline passed")
        work.wait(seconds(remaining))

    def close(self, failed: bool) -> None:
        """Release the group. failed=True aborts (mandatory for NCCL after an error)."""
        pg, self._pg = self._pg, None
        if pg is None:
            return
        try:
            pg.abort() if failed else pg.shutdown()
        except Exception:  # closing must not raise; the peer may already be gone
            pass


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    assert tensor.is_contiguous()
    return tensor.reshape(-1).view(torch.uint8)
