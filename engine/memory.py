"""How big the KV pool may be: the budget arithmetic (pure, unit-tested) and, on CUDA, the
profiling run that measures what the model needs besides the pool.

CUDA (as vLLM's `gpu_memory_utilization`): the replica may use `utilization` of the device's
*total* memory for everything it holds; the pool gets what is left after the weights and the
peak activations of the largest step, measured by one dummy forward of `max_num_batched_tokens`
tokens (plus the LM head on `max_num_seqs` rows) before the pool exists. Memory other processes
hold does not shrink a replica's share, so two replicas at 0.45 share one GPU (`num_gpus: 0.5`),
but the pool never takes more than is free now.
CPU: the pool gets a fraction of the RAM available now (auto: min(1 GiB, 25 %)); activations on
CPU are small next to it and come from the allocator as needed. Before the budget is taken, what
building the model freed goes back to the OS (`return_freed_heap`), so "available" counts it.
"""

from __future__ import annotations

import ctypes
import gc
from dataclasses import dataclass

GIB = 2**30
CUDA_AUTO_UTILIZATION = 0.9
FREE_MARGIN = 0.98        # never plan the last 2 % of free device memory (allocator slack)


@dataclass(frozen=True)
class CudaUsage:
    """What profiling measured, bytes."""
    total: int             # the device's memory
    free: int              # free right after profiling (other processes' use included)
    peak_torch: int        # torch's peak allocation: weights + the largest step's activations
    non_torch: int         # this process's memory outside torch's allocator (CUDA context, cuBLAS)

    @property
    def own(self) -> int:
        return self.peak_torch + self.non_torch


def cpu_kv_budget(kind: str, value: float, available: int) -> int:
    """Bytes for the pool on CPU; kind/value as `engine.config.parse_kv_memory` returns them."""
    if kind == "auto":
        return int(min(GIB, 0.25 * available))
    if kind == "fraction":
        return int(value * available)
    return int(value)


def cuda_kv_budget(kind: str, value: float, usage: CudaUsage) -> tuple[int, str]:
    """(bytes for the pool, how it was derived) on CUDA. A size is taken as given (capped by
    what is free); a fraction (auto: 0.9) is the share of total memory for the whole replica."""
    cap = int(FREE_MARGIN * usage.free)
    if kind == "bytes":
        return min(int(value), cap), f"{value / GIB:.2f} GiB asked, {cap / GIB:.2f} GiB free"
    utilization = CUDA_AUTO_UTILIZATION if kind == "auto" else value
    share = int(utilization * usage.total)
    budget = min(share - usage.own, cap)
    how = (f"{utilization:.2f} x {usage.total / GIB:.1f} GiB - weights and peak activations "
           f"{usage.peak_torch / GIB:.2f} GiB - CUDA context etc. {usage.non_torch / GIB:.2f} GiB"
           f" (capped at {cap / GIB:.2f} GiB free)")
    return budget, how


def return_freed_heap() -> bool:
    """Hand the memory freed while the model was built back to the OS; True where it could.

    Building the engine's weights frees much (the transformers model, fp32 or bf16 copies
    converted away, packing intermediates), but glibc keeps freed blocks below its mmap threshold
    (which grows to 32 MiB as large blocks come and go) in its heap, so the process's resident
    memory stays at the build's high-water mark: an engine of the default model held 170-200 MiB
    it no longer used (bf16, int8). `malloc_trim(0)` returns those pages. A C library without it (musl,
    macOS): nothing happens."""
    gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim      # the C library this process already has loaded
    except (OSError, AttributeError):
        return False
    trim(0)
    return True
