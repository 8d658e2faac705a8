"""One block of memory for a CPU model's linear weights, in huge pages where Linux gives them.

Who calls: engine.decoder, once at load: every `engine.linear.make_linear` appends the tensors its
layer reads on each call to a list, in the order the forward calls the layers (layer by layer,
then the LM head); `pack(that list)` then moves them into one arena in that order. The tensors
are rebound in place (`Tensor.set_`), so the layers' closures, which hold the same tensor objects,
read the arena from then on; each old copy is freed as soon as its tensor is moved (the resident
peak grows by one tensor, not by the model).

Why: a decode step streams every weight once. In separate allocations on 4 KiB pages each page
is a TLB miss and a new start for the hardware prefetcher, and each linear's weight starts a new
stream; one arena, advised MADV_HUGEPAGE (2 MiB pages where transparent huge pages are
`madvise` or `always`), read front to back in call order, streamed a bf16 decode step's linears
0.84-0.93x the time at 1-8 rows, 1 and 2 threads (session 22, AVX2 EPYC, SmolLM2's shapes,
/tmp script alternating both layouts in one process). The advice is best effort: elsewhere
(another OS, THP `never`) the arena is still one contiguous block in call order.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64                        # each tensor starts on a cache line (the kernels' blocks do)
_MADV_HUGEPAGE = 14


def pack(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """Moves `tensors` (CPU, contiguous; each listed once) into one uint8 arena in list order and
    returns it (None when there is nothing to move). Values, shapes, strides and dtypes stay;
    the tensors' `data_ptr` changes."""
    if not tensors:
        return None
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
    assert len({id(t) for t in tensors}) == len(tensors), "a tensor listed twice"
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    span = -(-total // HUGE_PAGE) * HUGE_PAGE                      # whole huge pages
    raw = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)          # not touched yet: no pages
    start = -raw.data_ptr() % HUGE_PAGE                             # the first 2 MiB boundary in it
    _advise_huge_pages(raw.data_ptr() + start, span)
    storage = raw.untyped_storage()
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            n = t.numel() * t.element_size()
            raw[start + off:start + off + n].view(t.dtype).copy_(t.reshape(-1))
            t.set_(storage, (start + off) // t.element_size(), t.shape, t.stride())
    return raw


def _advise_huge_pages(address: int, length: int) -> None:
    """madvise(MADV_HUGEPAGE) on [address, address + length) (whole huge pages inside the arena);
    nothing on other platforms or where libc refuses (best effort, logged)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(address, length, _MADV_HUGEPAGE) != 0:
            log.info("weight arena: madvise(MADV_HUGEPAGE) failed (errno %d); 4 KiB pages", ctypes.get_errno())
    except (OSError, AttributeError) as exc:                       # no libc symbol: another libc
        log.info("weight arena: no madvise (%s); 4 KiB pages", exc)
