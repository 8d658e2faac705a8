"""Decode steps replayed from CUDA graphs, one per batch bucket (as vLLM and nano-vllm capture).

At small batch a GPU decode step is launch-bound: a few hundred kernels of microseconds each. A
graph replays them with one launch. What makes a step capturable: every tensor it reads lives
in a static buffer (token ids, positions, KV slots, block tables, context lengths), attention is
the paged kernel whose loop bound is read on the device (engine.kernels.triton_attention), and
the batch is padded up to a bucket (1, 2, 4, 8, then multiples of 16 up to `max_num_seqs`).
Padded rows repeat row 0 (same token, position and slot): they write row 0's K/V again, the same
values, and their outputs are dropped. Only pure decode steps replay; prompt chunks run eagerly.
The LM head runs outside the graph (the rows that sample vary).

Contract: `DecodeGraphs.run(input_ids, positions, meta)` -> hidden [B, hidden] for a pure
decode step of B <= max_batch rows; the returned tensor is overwritten by the next replay, so
the caller consumes it first (ModelRunner.run does: the LM head reads it at once).
`capture=False` runs the same static-buffer path eagerly: how the padding is tested on CPU.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention import AttentionMetadata, DecodeBatch

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, ... up to max_batch (always included)."""
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch} | set(range(16, max_batch + 1, 16)) | {max_batch}
    return sorted(sizes)


class DecodeGraphs:
    def __init__(self, model, kv_pool: torch.Tensor, kernels, max_batch: int, max_blocks: int, capture: bool = True):
        assert kernels is not None, "a captured step needs the paged attention kernel"
        dev = kv_pool.device
        self.model, self.kv_pool, self.kernels = model, kv_pool, kernels
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = max_blocks
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.pos = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slots = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.long, device=dev)
        self.lens = torch.ones(max_batch, dtype=torch.long, device=dev)
        self.rows = torch.arange(max_batch, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    def _meta(self, bucket: int) -> AttentionMetadata:
        batch = DecodeBatch(self.rows[:bucket], tables=self.tables[:bucket], lens=self.lens[:bucket])
        return AttentionMetadata(self.kv_pool, self.slots[:bucket], batch, [], True, self.kernels)

    def _forward(self, bucket: int) -> torch.Tensor:
        return self.model.forward(self.ids[:bucket], self.pos[:bucket], self._meta(bucket))

    @torch.inference_mode()
    def _capture(self) -> None:
        """Largest bucket first, all sharing one memory pool. The dummy step (token 0 at position
        0, slot 0 of block 0) writes into block 0 before any request can hold it."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bucket in reversed(self.buckets):
                self._forward(bucket)                        # warm-up: kernels compiled and autotuned
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[bucket] = self._forward(bucket)
                self.graphs[bucket] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch %s in %.1f s", self.buckets, time.perf_counter() - t0)

    def fits(self, meta: AttentionMetadata) -> bool:
        dec = meta.decode
        return (meta.all_decode and dec is not None and dec.tables is not None
                and dec.tables.shape[0] <= self.buckets[-1] and dec.tables.shape[1] <= self.max_blocks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert self.fits(meta)
        b, dec = input_ids.shape[0], meta.decode
        bucket = next(size for size in self.buckets if size >= b)
        nb = dec.tables.shape[1]
        self.ids[:b].copy_(input_ids)
        self.pos[:b].copy_(positions)
        self.slots[:b].copy_(meta.slot_mapping)
        self.tables[:b, :nb].copy_(dec.tables)
        self.lens[:b].copy_(dec.lens)
        if bucket > b:                                   # padding repeats row 0
            for buf in (self.ids, self.pos, self.slots, self.lens):
                buf[b:bucket].copy_(buf[0].expand(bucket - b))
            self.tables[b:bucket].copy_(self.tables[0].expand(bucket - b, -1))
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            return self.outputs[bucket][:b]
        return self._forward(bucket)[:b]
