"""Linear layers in the engine's weight formats: what a decode step spends most of its time in.

A decode step reads every weight once, so at small batch its linears are bound by memory
bandwidth (bytes per weight decide), at large batch by compute (the matrix unit decides).
`make_linear(weight, bias, fmt, ...)` returns a callable `y = f(x)` for x [rows, in]:

  dense (fp32, bf16, fp16)  `F.linear`; on a CPU with native bf16 (AVX512-BF16 / AMX) a bf16
                            weight is prepacked once into oneDNN's blocked layout
                            (`mkldnn._linear_pointwise`): 2-4x faster than plain bf16 `mm`.
                            Where the engine's kernels build vectorized (AVX512-BF16, or
                            AVX2 + FMA, where bf16 is widened to fp32 in registers), its GEMVs
                            run instead (engine/kernels/dense_gemv_cpu.cpp), which stream
                            the weight once per call near the memory bound (rows past the first
                            pass's 8, bf16's 16: further passes re-read each chunk of it from L2):
                            `kernels.bf16_gemv` at every row count on a bf16 copy in blocks of 16
                            output channels (int8's layout), the layer's only copy (on a CPU
                            with AMX-BF16 it runs 2 rows and more on AMX tiles, on the same
                            copy: a decode batch of 32 / 64 and a 512-row prompt chunk took
                            0.35 / 0.22 / 0.15x the GEMV's time and 0.6-1.0x oneDNN's; see
                            engine/kernels/dense_gemv_cpu.cpp);
                            `kernels.fp32_gemv` on the row-major fp32 weight itself up to
                            `dense_small_rows` rows, `F.linear` above. Measured on this project's
                            CPU (benchmarks/linear_bench.py, the step's linears): oneDNN's bf16
                            and MKL's fp32 small-row paths run at about 0.75x and 0.3-0.45x the
                            GEMVs' speed; the bf16 GEMV ran 1.08-1.4x oneDNN's packed weight's
                            speed at 8-64 rows on 1 thread, 1.2-1.5x on 2, and took 0.89-0.97x its
                            time at the prompt chunks' 128-512 rows
                            (2 threads, twice: 39.2-39.5 / 161.2-161.7 ms against 43.8-44.6 /
                            169.7-172.2 at 128 / 512; 1 thread 74.5-75.0 / 313.3-314.0 against
                            76.8-79.4 / 316.6-328.1) and 1.04-1.08x at 1024-2048 (the prefill
                            pool's 2048-token chunks; 1 and 2 threads), where a whole 2000-token
                            prefill on 1 thread stayed within the noise (benchmarks/
                            prefill_bench.py: 1563, 1578 -> 1623, 1462 ms), so bf16 keeps no
                            packed copy (until then it held both: 2x its weight bytes). fp32 up
                            to 64 rows, the largest decode batch (MKL's fp32 GEMM stayed 2x
                            slower even at 256 rows on this AMD CPU; on CPUs where MKL is strong
                            it would win for prompt chunks, which keep `F.linear`, the exact
                            mode's reference path); fp32 shares its one weight between the two.
  int8 / int4 (CPU)         int8 weights symmetric per output channel; int4 weights asymmetric in
                            groups of 32 inputs with a bf16 scale and zero point each (the
                            gpt-fast/torchao scheme). Where the engine's kernels build with
                            AVX512-VNNI, `kernels.int8_gemv` / `int4_gemv`
                            (engine/kernels/int8_gemv_cpu.cpp, int4_gemv_cpu.cpp; weights in
                            blocks of 16 output channels) run every row count: they round the
                            activations to int8 too, per row in groups of 32 inputs (llama.cpp's
                            Q8_0 scheme, which its Q4/Q8 dot products use), and sum the integer
                            products in int32 with `vpdpbusd` (twice the multiply-adds of a bf16
                            instruction, and no widening of the weights), so they need no bf16
                            copy: 1 byte a weight (int4: 0.625). Measured
                            (`benchmarks/linear_bench.py`, the step's linears, builds alternated):
                            int8 1 row as the weight-only kernel before it (memory-bound), 8 / 16 /
                            32 rows 0.53 / 0.65 / 0.64x its time on 1 thread; int4 1-64 rows
                            0.45-0.65x the weight-only one (which was bound by turning nibbles
                            into bf16 numbers); against oneDNN on a bf16 copy, 1 and 2 threads,
                            both: 0.6-0.8x at 64 rows, 0.8-1.0x at 128, 1.0-1.1x at 512 (prompt
                            chunks pay up to 10 % for the memory). Quality (benchmarks/
                            format_quality.py's text, log-likelihood against fp32): int8 +0.008
                            (weight-only +0.003, bf16 +0.002), int4 -0.077 (weight-only -0.085);
                            one activation scale a row instead of a group of 32 cost as much as
                            int4 (see the int8 kernel's header). On AVX2 without AVX512 the same
                            kernels run at every row count with AVX2's byte multiplies
                            (`vpmaddubsw`, as llama.cpp's AVX2 dot products). On a CPU with
                            AMX-BF16 they hand calls of many rows (int8 32, int4 24: big decode
                            batches, prompt chunks) to bf16's AMX GEMM, their weights widened to
                            bf16 a chunk at a time, the activations not rounded (a 512-row chunk
                            0.4x the VNNI kernels' time; see their headers). Without either
                            they run as scalar loops up to
                            KERNEL_SMALL_ROWS rows and a prepacked bf16 copy of the dequantized
                            weight above; without the engine's kernels, weight-only through
                            aten's `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` (bf16
                            activations) up to SMALL_ROWS rows and the bf16 copy above.

Exactness: fp32 (the exact mode) computes in fp32 throughout: `F.linear` or the fp32 GEMV, whose
sums run in another order than MKL's (as MKL's own GEMV and GEMM differ), so logits match
Hugging Face's to fp32 rounding and greedy tokens stay identical on the exactness prompts
(tests/test_engine_exact.py). Every other format rounds.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

WEIGHT_FORMATS = ("float32", "bfloat16", "float16", "int8", "int4")
INT4_GROUP = 32
# at most this many rows: the quantized GEMV kernel; more: the bf16 copy (see above)
SMALL_ROWS = 4            # aten's kernels (measured)
KERNEL_SMALL_ROWS = 32    # the engine's kernels' scalar loops; with VNNI or AVX2 they take every row count
# at most this many rows: the engine's dense GEMV (measured; see above); None: every row count, no
# other copy of the weight
DENSE_SMALL_ROWS: dict[torch.dtype, int | None] = {torch.bfloat16: None, torch.float32: 64}

Linear = Callable[[torch.Tensor], torch.Tensor]


def cpu_has_native_bf16() -> bool:
    """True where oneDNN runs bf16 matmuls natively (AVX512-BF16 or AMX)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_serves_bf16(gemv: bool = True) -> bool:
    """True where bf16 is the faster CPU format, `engine.dtype: auto`'s choice: native bf16, or the
    engine's kernels built with vectorized GEMVs (`gemv`: EngineConfig.cpu_gemv), which on an
    AVX2-only CPU widen bf16 weights to fp32 in registers: half fp32's bytes at the same FMAs.
    Measured on an AVX2 AMD EPYC (Zen 3, 2 threads, `benchmarks/engine_bench.py`, two runs):
    decode steps bf16 23.0-24.1 / 47.1-49.4 / 137.7-146.9 ms at batch 1 / 8 / 32 against fp32's
    44.6-53.8 / 62.7-67.2 / 172.2-190.9; a 2 x 512-token prefill 3.5 s against 3.0
    (`benchmarks/prefill_bench.py`). With the packed bf16 GEMV path (session 18): bf16 20.7 / 39.5 /
    108.8 against fp32's 38.3 / 56.4 / 151.1, the prefill 3.2 s against 2.9-3.5."""
    if cpu_has_native_bf16():
        return True
    from engine.kernels import cpu_kernels
    kernels = cpu_kernels() if gemv else None
    return kernels is not None and bool(kernels.gemv_vectorized())


def quantized_small_rows(kernels) -> int | None:
    """Rows up to which a quantized layer runs its int kernel (more: the bf16 copy); None: every row
    count, without a bf16 copy (the engine's int8 and int4 kernels where they build with
    AVX512-VNNI or AVX2)."""
    if kernels is None:
        return SMALL_ROWS
    return None if kernels.int_gemv_vectorized() else KERNEL_SMALL_ROWS


def dense_small_rows(dtype: torch.dtype, kernels) -> int | None:
    """Rows up to which a dense layer of `dtype` runs the engine's GEMV (0: never; None: every row
    count, and the layer keeps no other copy of its weight)."""
    if kernels is None or dtype not in DENSE_SMALL_ROWS or not kernels.gemv_vectorized():
        return 0                             # vectorized: built for this CPU's AVX512-BF16 or AVX2
    return DENSE_SMALL_ROWS[dtype]


def fused_weight(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of one linear made of `linears` (torch.nn.Linear modules) side by side, their
    outputs in order ([q; k; v], [gate; up]); the bias None when none has one, zeros for those
    without one when another has one."""
    weight = torch.cat([p.weight.detach() for p in linears])
    biases = [None if p.bias is None else p.bias.detach() for p in linears]
    if all(b is None for b in biases):
        return weight, None
    like = next(b for b in biases if b is not None)
    return weight, torch.cat([b if b is not None else like.new_zeros(p.out_features) for b, p in zip(biases, linears)])


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, dtype: torch.dtype,
                kernels=None, keep: list[torch.Tensor] | None = None) -> Linear:
    """A linear layer for `weight` [out, in] (+ `bias`) in format `fmt` computing in `dtype`
    (the activations' dtype). `kernels`: the engine's CPU kernels (`engine.kernels.cpu_kernels()`)
    for the quantized formats' steps of at most `quantized_small_rows(kernels)` rows and the
    dense formats' steps of at most `dense_small_rows(dtype, kernels)` rows, or None for aten's.
    Called once per layer at model load; the layer keeps what it needs (the packed weight, and where
    the int kernel stops at some row count the dequantized bf16 copy). `keep`: a list to which the
    layer appends the CPU tensors it made and reads on every call to the engine's kernels (its
    packed weight; not the caller's own tensors), for engine.weight_arena to move.
    Raises ValueError for a shape the format cannot take."""
    assert fmt in WEIGHT_FORMATS, fmt
    bias = None if bias is None else bias.to(dtype).contiguous()
    if fmt in ("int8", "int4"):
        assert weight.device.type == "cpu" and dtype == torch.bfloat16, "int8/int4 quantization is CPU + bf16"
        quant, dequantize = (_int8 if fmt == "int8" else _int4)(weight, bias, kernels, keep)
        if quant is None:                    # a shape only the bf16 copy takes
            return _dense(dequantize().to(torch.bfloat16), bias, kernels, keep)
        few = quantized_small_rows(kernels)
        if few is None:                      # the int kernel at every row count, no copy
            return quant
        dense = _dense(dequantize().to(torch.bfloat16), bias)
        return lambda x: quant(x) if x.shape[0] <= few else dense(x)
    return _dense(weight.to(dtype), bias, kernels, keep)


def _dense(w: torch.Tensor, bias: torch.Tensor | None, kernels=None, keep: list | None = None) -> Linear:
    """`kernels`: the engine's CPU kernels for the GEMVs at few rows, or None."""
    w = w.contiguous()
    few = dense_small_rows(w.dtype, kernels) if w.device.type == "cpu" else 0
    if few is None:                          # the GEMV at every row count (bf16): no packed copy
        blocks, out_f = _blocks_of_16(w), w.shape[0]
        _keep(keep, blocks)
        return lambda x: kernels.bf16_gemv(x, blocks, bias, out_f)
    if w.device.type == "cpu" and w.dtype == torch.bfloat16 and cpu_has_native_bf16():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        many = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # noqa: E731
    else:
        many = lambda x: F.linear(x, w, bias)  # noqa: E731
    if not few:
        return many
    if w.dtype == torch.bfloat16:
        blocks, out_f = _blocks_of_16(w), w.shape[0]
        _keep(keep, blocks)
        return lambda x: kernels.bf16_gemv(x, blocks, bias, out_f) if x.shape[0] <= few else many(x)
    # fp32 reads the caller's weight itself (often the checkpoint's own tensor, which the embedding
    # may share): not moved
    return lambda x: kernels.fp32_gemv(x, w, bias) if x.shape[0] <= few else many(x)


def _keep(keep: list | None, *tensors: torch.Tensor) -> None:
    if keep is not None:
        keep.extend(t for t in tensors if t.device.type == "cpu")


def _int8(weight: torch.Tensor, bias: torch.Tensor | None,
          kernels, keep: list | None = None) -> tuple[Linear, Callable[[], torch.Tensor]]:
    """Symmetric int8 per output channel; returns the layer and a function giving the dequantized
    weight (fp32), which only a layer that also keeps a bf16 copy calls."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
    q = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8).contiguous()
    scale = scale.to(torch.bfloat16)
    dequantize = lambda: q.float() * scale.float()[:, None]  # noqa: E731
    if kernels is not None:
        blocks, scale32 = _int8_quads(q), F.pad(scale.float(), (0, -len(scale) % 16))
        out_f = weight.shape[0]
        _keep(keep, blocks)
        return lambda x: kernels.int8_gemv(x, blocks, scale32, bias, out_f), dequantize

    def linear(x):
        y = torch.ops.aten._weight_int8pack_mm(x, q, scale)
        return y if bias is None else y + bias
    return linear, dequantize


def _int4(weight: torch.Tensor, bias: torch.Tensor | None,
          kernels, keep: list | None = None) -> tuple[Linear | None, Callable[[], torch.Tensor]]:
    """Asymmetric int4 in groups of INT4_GROUP inputs; returns the layer (None where only the bf16
    copy can run it: aten's kernel and a number of outputs not a multiple of 16) and a function
    giving the dequantized weight (fp32)."""
    out_f, in_f = weight.shape
    if in_f % INT4_GROUP:
        raise ValueError(f"int4 quantizes groups of {INT4_GROUP} inputs; this model has a linear with "
                         f"{in_f} inputs (use int8)")
    w = weight.float().reshape(out_f, in_f // INT4_GROUP, INT4_GROUP)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = ((w - lo) / scale).round_().clamp_(0, 15).to(torch.uint8).reshape(out_f, in_f)
    # a weight is (q - 8) * scale + zero, so zero = lo + 8 * scale; both rounded to bf16
    scale, zero = scale.reshape(out_f, -1).to(torch.bfloat16), (lo + 8 * scale).reshape(out_f, -1).to(torch.bfloat16)

    def dequantize() -> torch.Tensor:
        grouped = q.reshape(out_f, -1, INT4_GROUP).float() - 8
        return (grouped * scale.float()[..., None] + zero.float()[..., None]).reshape(out_f, in_f)
    if kernels is not None:
        packed, sz = _int4_blocks(q, scale, zero)
        _keep(keep, packed, sz)
        return lambda x: kernels.int4_gemv(x, packed, sz, bias, out_f), dequantize
    if out_f % 16:                           # aten's int4 packing takes multiples of 16 outputs only
        return None, dequantize
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()      # [groups, out, 2]

    def linear(x):
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, scales_zeros)
        return y if bias is None else y + bias
    return linear, dequantize


def _blocks_of_16(q: torch.Tensor) -> torch.Tensor:
    """int8 or bf16 [out, in] in int8_gemv's and bf16_gemv's layout (engine/kernels/
    int8_gemv_cpu.cpp, dense_gemv_cpu.cpp): [out/16, in/2, 32], element 2c + e of [b, j] =
    q[16b + c, 2j + e]; zeros pad out to a multiple of 16, in to even."""
    q = F.pad(q, (0, q.shape[1] % 2, 0, -q.shape[0] % 16))
    return q.view(-1, 16, q.shape[1] // 2, 2).transpose(1, 2).reshape(-1, q.shape[1] // 2, 32).contiguous()


def _int8_quads(q: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] in int8_gemv's layout (engine/kernels/int8_gemv_cpu.cpp): uint8 q + 128 as
    [out/16, in/4, 64], byte 4c + e of [b, j] = q[16b + c, 4j + e] + 128; zero weights pad out to a
    multiple of 16 and in to a multiple of 32 (the kernel's activation groups)."""
    q = F.pad(q.view(torch.uint8) ^ 0x80, (0, -q.shape[1] % 32, 0, -q.shape[0] % 16), value=128)  # q + 128
    return q.view(-1, 16, q.shape[1] // 4, 4).transpose(1, 2).reshape(-1, q.shape[1] // 4, 64).contiguous()


def _int4_blocks(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 [out, in] values 0..15 and their bf16 [out, groups] scales and zeros in int4_gemv's
    layout (engine/kernels/int4_gemv_cpu.cpp): blocks of 16 output channels, output channels
    padded with zeros to a multiple of 16."""
    out_f, in_f = q.shape
    pad = -out_f % 16
    q = F.pad(q, (0, 0, 0, pad)).to(torch.uint8)
    blocks, groups = (out_f + pad) // 16, in_f // INT4_GROUP
    q = q.view(blocks, 16, groups, 4, 8)                              # [block, channel, group, vector, 8 inputs]
    byte = q[..., :4] | (q[..., 4:] << 4)                             # inputs 8v + e and 8v + 4 + e
    packed = byte.permute(0, 2, 3, 1, 4).reshape(blocks, groups, 256).contiguous()
    sz = torch.stack([F.pad(t, (0, 0, 0, pad)).view(blocks, 16, groups).transpose(1, 2) for t in (scale, zero)], 2)
    return packed, sz.contiguous()                                    # [block, group, 2, 16]
