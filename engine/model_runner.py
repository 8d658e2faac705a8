"""The only part of the engine that touches tensors: weights, the KV pool, the forward.

`ModelRunner.run(chunks)` does one ragged forward for a step: every scheduled chunk's
tokens in one flat row with explicit position ids, paged attention (engine.attention),
and the LM head only on the last position of each chunk that samples. transformers loads
the checkpoint; the forward is engine.decoder's, in the configured weight format. The device,
dtype, weight format and attention kernels it runs with are engine/backends.py's choices.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from engine.attention import AttentionMetadata, DecodeBatch, PrefillSpan, token_slots, window_mask
from engine.backends import (KERNEL_CHUNK_ROWS, attention_kernels, chunk_sdpa_from, cuda_snapshot, kv_shape_of,
                             paged_kernel_problem, prefill_kernel_applies, resolve_device, resolve_dtype,
                             weight_format)
from engine.config import EngineConfig, context_limit, parse_kv_memory, rope_pin
from engine.cuda_graphs import DecodeGraphs
from engine.decoder import DecoderModel
from engine.kernels import cpu_kernels
from engine.lora import LoraSet
from engine.memory import CudaUsage, cpu_kv_budget, cuda_kv_budget, return_freed_heap
from engine.sequence import ScheduledChunk

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    logits: torch.Tensor | None        # [n_sampling_chunks, vocab], float32
    hidden: dict[int, torch.Tensor]    # chunk index -> [rows, hidden] (see ModelRunner.run)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        # on CUDA, what was in use before this runner (another engine in this process counts as
        # someone else's; see _profile_cuda)
        at_start = cuda_snapshot(self.device) if self.device.type == "cuda" else None
        self.dtype = resolve_dtype(config.dtype, self.device, config.cpu_gemv)
        self.weight_format = weight_format(config, self.device, self.dtype)
        self.kernels, self.attention_backend = attention_kernels(config.attention_backend, self.device, self.dtype)
        # quantized formats start from fp32 weights; the others load in their own dtype
        load_dtype = torch.float32 if config.quantization else self.dtype
        hf_model = AutoModelForCausalLM.from_pretrained(config.model, dtype=load_dtype,
                                                        **_dequantized(config.model)).to(self.device).eval()
        # on CPU: the engine's GEMV (unless cpu_gemv is off) and bf16 norm kernels (None where they
        # cannot build)
        kernels = cpu_kernels() if self.device.type == "cpu" else None
        pin = rope_pin(hf_model.config, config.max_model_len)
        self.model = DecoderModel(hf_model, self.weight_format, self.dtype, kernels, gemv=config.cpu_gemv,
                                  rope_pin=pin)
        # LoRA adapters served beside the base model (engine.lora): the configuration's now, those
        # loaded at run time at their first request (LoraSet.use)
        self.loras = LoraSet(self.model, self.device, kernels, config.max_loras)
        self.loras.add_configured(config.lora_modules)
        self.generation_config = hf_model.generation_config
        self.hf_config = hf_config = hf_model.config
        del hf_model
        return_freed_heap()
        self.kv_shape = kv_shape_of(hf_config, config.block_size, self.dtype)
        self.context_limit = context_limit(hf_config, config.max_model_len)
        if self.context_limit < self.max_position_embeddings:
            log.warning("sequences are limited to %d of the model's %d positions: its RoPE changes frequencies "
                        "with the length (longrope/dynamic), which in a batch would make one sequence's RoPE "
                        "depend on another's; engine.max_model_len above %d serves more, every sequence with "
                        "that length's RoPE", self.context_limit, self.max_position_embeddings, self.context_limit)
        elif pin is not None:
            log.warning("RoPE pinned at the frequencies of a %d-token sequence for every sequence "
                        "(engine.max_model_len above the original length, as vLLM does): shorter sequences "
                        "get other frequencies than transformers gives them alone", pin + 1)
        # the sliding windows of the model's layers (engine.config.layer_windows), for the torch
        # paths' masks; the kernels take a layer's window as an argument
        self.windows = sorted({w for w in self.model.windows if w})
        # bf16 on CPU with the paged backend: prompt chunks through the in-place prefill kernel
        self.prefill_kernel = prefill_kernel_applies(self.kernels, self.device, self.dtype, self.kv_shape.head_dim)
        # ... except chunks from this many tokens on, which run sdpa (None: none do)
        # (never with soft-capped scores, Gemma 2's, or attention sinks, gpt-oss's: sdpa has neither, its
        # math written out is slower)
        eager = self.model.attn_softcap or self.model.sinks
        self.sdpa_from = chunk_sdpa_from(self.kernels) if self.prefill_kernel and not eager else None
        self.num_blocks = self._num_blocks(at_start)
        s = self.kv_shape
        # Block-major: one block is contiguous across layers (see attention.token_slots).
        self.kv_pool = torch.zeros(self.num_blocks, s.num_layers, 2, s.block_size, s.num_kv_heads,
                                   s.head_dim, dtype=self.dtype, device=self.device)
        log.info("KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB on %s (%s); decode attention: %s",
                 self.num_blocks, s.block_size, self.num_blocks * s.block_size,
                 self.kv_pool.numel() * self.kv_pool.element_size() / 2**20, self.device, s.dtype,
                 self.attention_backend)
        self.graphs = None
        if self.device.type == "cuda" and self.kernels is not None:
            self._check_cuda_kernels()
        # a mixture of experts' step depends on its routing (engine/moe.py): eager
        if self.device.type == "cuda" and config.cuda_graphs and self.kernels is not None and not self.model.moe:
            try:
                self.graphs = DecodeGraphs(self.model, self.kv_pool, self.kernels, config.max_num_seqs,
                                           -(-self.max_model_len // s.block_size))
            except Exception as exc:  # noqa: BLE001 - eager decode still works
                log.warning("CUDA graph capture failed (%s: %s); decode runs eagerly", type(exc).__name__, exc)

    def _check_cuda_kernels(self) -> None:
        """At start on CUDA, the Triton kernel must agree with the torch backend on a small
        random case; if it fails to compile or disagrees, auto falls back to torch (a warning),
        an explicit `paged` refuses to start."""
        problem = paged_kernel_problem(self.kernels, self.model.num_heads, self.kv_shape, self.device, self.dtype)
        if problem is None:
            return
        if self.config.attention_backend == "paged":
            raise ValueError(f"attention_backend='paged': the paged kernel failed its check on {self.device}: "
                             f"{problem}")
        log.warning("paged attention kernel failed its check on %s (%s); using the torch backend",
                    self.device, problem)
        self.kernels, self.attention_backend = None, "torch"

    # ---- sizing ----------------------------------------------------------------------------
    def _num_blocks(self, at_start: tuple[int, int, int] | None) -> int:
        kind, value = parse_kv_memory(self.config.kv_cache_memory)
        if self.device.type == "cuda":
            budget, how = cuda_kv_budget(kind, value, self._profile_cuda(at_start))
            log.info("KV pool budget on %s: %.2f GiB = %s", self.device, budget / 2**30, how)
        else:
            import psutil
            budget = cpu_kv_budget(kind, value, psutil.virtual_memory().available)
            how = f"kv_cache_memory={self.config.kv_cache_memory!r} on CPU"
        n = int(max(budget, 0) // self.kv_shape.bytes_per_block)
        if n < 1:
            raise ValueError(f"kv_cache_memory={self.config.kv_cache_memory!r} leaves no room for a KV block "
                             f"({self.kv_shape.bytes_per_block} bytes each; budget {budget} bytes: {how})")
        return n

    def _profile_cuda(self, at_start: tuple[int, int, int]) -> CudaUsage:
        """Run the largest step once (a prompt chunk of `max_num_batched_tokens` tokens, the LM head
        on as many rows as a step or a prompt-logprobs slice can have) with a throwaway pool just
        big enough, and measure torch's peak (weights + activations) and this process's memory
        outside torch. See engine.memory."""
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        temp_pool_bytes = self.run_largest_step()
        torch.cuda.synchronize(dev)
        free0, allocated0, reserved0 = at_start
        peak = torch.cuda.max_memory_allocated(dev) - allocated0 - temp_pool_bytes
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        non_torch = max(0, (free0 - free) - (torch.cuda.memory_reserved(dev) - reserved0))
        return CudaUsage(total=total, free=free, peak_torch=peak, non_torch=non_torch)

    @torch.inference_mode()
    def run_largest_step(self) -> int:
        """The largest step a replica runs, on dummy tokens: a prompt chunk of
        `max_num_batched_tokens` tokens into a throwaway pool just big enough, and the LM head on
        as many rows as a step or a prompt-logprobs slice can have. Returns the throwaway pool's
        bytes (the profiler subtracts them); everything it allocated is freed on return."""
        dev, s = self.device, self.kv_shape
        tokens = max(1, min(self.config.max_num_batched_tokens, self.max_position_embeddings))
        n_blocks = -(-tokens // s.block_size)
        pool = torch.zeros(n_blocks, s.num_layers, 2, s.block_size, s.num_kv_heads, s.head_dim,
                           dtype=self.dtype, device=dev)
        slots = token_slots(torch.arange(n_blocks), s.block_size, s.num_layers)[:tokens].to(dev)
        meta = AttentionMetadata(pool, slots, None, [self._sdpa_span(0, 0, tokens)], False)
        states = self.model.forward(torch.zeros(tokens, dtype=torch.long, device=dev),
                                    torch.arange(tokens, device=dev), meta)
        rows = min(tokens, max(self.config.max_num_seqs, 256))
        self.model.lm_head(states[:rows]).float()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return pool.numel() * pool.element_size()

    @property
    def vocab_size(self) -> int:
        """Width of the logits (the LM head's outputs; may exceed the tokenizer's vocabulary)."""
        return self.model.vocab_size

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] (model dtype) of final hidden states [rows, hidden]."""
        return self.model.lm_head(hidden)

    @property
    def max_position_embeddings(self) -> int:
        return int(getattr(self.hf_config, "max_position_embeddings", 2048))

    @property
    def max_model_len(self) -> int:
        """Longest sequence this runner serves: the configured or the model's limit
        (`context_limit`), capped by the pool."""
        limit = self.context_limit
        return min(self.config.max_model_len or limit, limit, self.num_blocks * self.config.block_size)

    # ---- the forward -----------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk],
            hidden_spans: dict[int, tuple[int, int]] | None = None) -> StepOutput:
        """Feed every chunk; return float32 logits in chunk order, `num_logits` rows a chunk (one
        for a chunk whose `sample` is true, one more per draft token; None when no chunk samples),
        and for each
        `hidden_spans` entry {chunk index: (first, last) row offsets within the chunk} the final
        hidden states of those rows (prompt logprobs: sampler.prompt_logprobs turns them into
        log-probabilities slice by slice, never a [tokens, vocab] tensor at once)."""
        input_ids, positions, sample_rows, meta = self._prepare(chunks)
        lora = self._lora_batch(chunks)
        if self.graphs is not None and not hidden_spans and lora is None and self.graphs.fits(meta):
            states = self.graphs.run(input_ids, positions, meta)
        else:
            states = self.model.forward(input_ids, positions, meta, lora)
        hidden = {}
        if hidden_spans:
            offsets = [0]
            for ch in chunks:
                offsets.append(offsets[-1] + ch.num_tokens)
            hidden = {i: states[offsets[i] + a:offsets[i] + b] for i, (a, b) in hidden_spans.items()}
        logits = None
        if sample_rows:
            logits = self.model.lm_head(states[torch.tensor(sample_rows, device=self.device)]).float()
        return StepOutput(logits, hidden)

    def _lora_batch(self, chunks: list[ScheduledChunk]):
        """The step's rows by LoRA adapter (engine.lora), None when no chunk's request names one."""
        if self.loras.empty or all(ch.seq.params.lora is None for ch in chunks):
            return None
        slots = []
        for ch in chunks:
            slots.extend([self.loras.slot(ch.seq.params.lora_key)] * ch.num_tokens)
        return self.loras.batch(slots, self.device)

    def _prepare(self, chunks: list[ScheduledChunk]):
        bs = self.config.block_size
        dev = self.device
        ids, pos, slots, sample_rows = [], [], [], []
        dec_rows, dec_tables, dec_lens = [], [], []
        prefills: list[PrefillSpan] = []
        row = 0
        block_stride = self.kv_shape.num_layers * 2 * bs       # token_slots' stride of one block
        for ch in chunks:
            seq, start, n = ch.seq, ch.start, ch.num_tokens
            end = start + n
            ids.extend(seq.token_ids[start:end])
            if n == 1 or (start > 0 and n <= KERNEL_CHUNK_ROWS and self.kernels is not None):
                # decode, or a short chunk after a past (a prefix-cache tail): each token is a row of
                # the paged kernel's call over its own causal context; O(n) bookkeeping
                table = seq.block_table[:-(-end // bs)]
                for p in range(start, end):
                    pos.append(p)
                    slots.append(table[p // bs] * block_stride + p % bs)
                    dec_rows.append(row + p - start)
                    dec_tables.append(table)
                    dec_lens.append(p + 1)
            else:
                layers = self.kv_shape.num_layers
                table = torch.tensor(seq.block_table[:-(-end // bs)], dtype=torch.long)
                pos.extend(range(start, end))
                # the chunk's own slots, from the blocks it lands in: O(n), whatever its past
                slots.extend(token_slots(table[start // bs:], bs, layers)[start % bs:start % bs + n].tolist())
                if self.prefill_kernel and (self.sdpa_from is None or n < self.sdpa_from):
                    prefills.append(PrefillSpan(row, row + n, None, None, table.to(dev), start))
                else:
                    prefills.append(self._sdpa_span(row, start, n, table))
            row += n
            sample_rows.extend(range(row - ch.num_logits, row))
        decode = None
        if dec_rows:
            decode = self._decode_batch(dec_rows, dec_tables, dec_lens)
        all_decode = len(dec_rows) == row
        meta = AttentionMetadata(self.kv_pool, torch.tensor(slots, dtype=torch.long, device=dev), decode,
                                 prefills, all_decode, self.kernels)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        return input_ids, positions, sample_rows, meta

    def _sdpa_span(self, row: int, start: int, n: int, table: torch.Tensor | None = None) -> PrefillSpan:
        """A prompt chunk of n tokens from position `start` for sdpa: after a past, its context's
        slots (from `table`) and offset-causal mask; with sliding windows, a mask for each."""
        dev, end = self.device, start + n
        q_pos = torch.arange(start, end)
        span = PrefillSpan(row, row + n, None, None)
        if start > 0:
            span.context_slots = token_slots(table, self.config.block_size, self.kv_shape.num_layers)[:end].to(dev)
            span.mask = (torch.arange(end)[None, :] <= q_pos[:, None])[None, None].to(dev)
        if self.windows:
            span.window_masks = {w: window_mask(q_pos, end, w).to(dev) for w in self.windows}
        return span

    def _decode_batch(self, rows: list[int], tables: list[list[int]], lens: list[int]) -> DecodeBatch:
        """Block tables padded to the longest (with block 0), in the form the backend reads."""
        dev, bs = self.device, self.config.block_size
        nb = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (nb - len(t)) for t in tables], dtype=torch.long)
        batch = DecodeBatch(torch.tensor(rows, device=dev))
        if self.kernels is not None:
            batch.tables, batch.lens = padded.to(dev), torch.tensor(lens, dtype=torch.long, device=dev)
            return batch
        k_rows = padded * (2 * self.kv_shape.num_layers)
        batch.blocks = torch.stack((k_rows, k_rows + 1)).view(-1).to(dev)   # see DecodeBatch.blocks
        last = torch.tensor(lens) - 1
        batch.mask = (torch.arange(nb * bs)[None, :] <= last[:, None])[:, None, None, :].to(dev)
        if self.windows:
            batch.window_masks = {w: window_mask(last, nb * bs, w)[0, 0][:, None, None, :].to(dev)
                                  for w in self.windows}
        return batch

    # ---- threads ------------------------------------------------------------------------------
    def num_threads(self) -> int:
        return torch.get_num_threads()

    def set_num_threads(self, n: int) -> int:
        """The calling thread's torch threads (the engine thread's: OpenMP's count is per
        thread); only on CPU, where they run the step."""
        assert n >= 1
        if self.device.type == "cpu" and n != torch.get_num_threads():
            torch.set_num_threads(n)
        return torch.get_num_threads()

    # ---- KV export / import ----------------------------------------------------------------
    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy [n, layers, 2, block_size, kv_heads, head_dim] of the blocks."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return self.kv_pool.index_select(0, idx)

    def import_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write exported blocks into this pool's `block_ids` (same geometry and dtype)."""
        expected = (len(block_ids), *self.kv_pool.shape[1:])
        assert tuple(data.shape) == expected, f"KV shape {tuple(data.shape)} != {expected}"
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.kv_pool.index_copy_(0, idx, data.to(self.device, self.dtype))


def _dequantized(model: str) -> dict:
    """`from_pretrained` options for a checkpoint quantized in a format the engine does not run:
    gpt-oss's MXFP4 experts, dequantized by transformers at load (to the load dtype), which the
    engine's weight formats then take as any other weights. Where transformers' MXFP4 kernels
    are installed it would keep them packed, a layout the engine's MoE cannot read."""
    from transformers import AutoConfig
    quant = getattr(AutoConfig.from_pretrained(model), "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if getattr(method, "value", method) != "mxfp4":
        return {}
    from transformers import Mxfp4Config
    return {"quantization_config": Mxfp4Config(dequantize=True)}
