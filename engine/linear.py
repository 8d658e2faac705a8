"""Linear layers in the engine's weight formats: what a decode step spends most of its time in.

A decode step reads every weight once, so at small batch its linears are bound by memory
bandwidth (bytes per weight decide), at large batch by compute (the matrix unit decides).
`make_linear(weight, bias, fmt, ...)` returns a callable `y = f(x)` for x [rows, in]:

  dense (fp32, bf16, fp16)  `F.linear`; on a CPU with native bf16 (AVX512-BF16 / AMX) a bf16
                            weight is prepacked once into oneDNN's blocked layout
                            (`mkldnn._linear_pointwise`): 2-4x faster than plain bf16 `mm`.
  int8 / int4 (CPU)         weight-only quantization with bf16 activations: int8 per output
                            channel (`_weight_int8pack_mm`), int4 in groups of 32 input columns
                            with a scale and zero point each (`_weight_int4pack_mm_for_cpu`, the
                            gpt-fast/torchao scheme). These GEMV-style kernels read 2-4x fewer
                            bytes than bf16 but do not use the matrix unit, so steps with more than
                            `small_rows` rows run a prepacked bf16 copy of the *dequantized* weight
                            instead (the same quantized model, computed on the matrix unit). That
                            copy makes quantization pay at every batch size, at the cost of memory:
                            a quantized model holds both (documented in the README).

Exactness: fp32 is plain `F.linear` (the exact mode). Every other format rounds.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

WEIGHT_FORMATS = ("float32", "bfloat16", "float16", "int8", "int4")
INT4_GROUP = 32
SMALL_ROWS = 4       # at most this many rows: the quantized kernel; more: the bf16 copy

Linear = Callable[[torch.Tensor], torch.Tensor]


def cpu_has_native_bf16() -> bool:
    """True where oneDNN runs bf16 matmuls natively (AVX512-BF16 or AMX)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, dtype: torch.dtype,
                small_rows: int = SMALL_ROWS) -> Linear:
    """A linear layer for `weight` [out, in] (+ `bias`) in format `fmt` computing in `dtype`
    (the activations' dtype). Raises ValueError for a shape the format cannot take."""
    assert fmt in WEIGHT_FORMATS, fmt
    bias = None if bias is None else bias.to(dtype)
    if fmt in ("int8", "int4"):
        assert weight.device.type == "cpu" and dtype == torch.bfloat16, "weight-only quantization is CPU + bf16"
        quant, dequantized = (_int8 if fmt == "int8" else _int4)(weight, bias)
        dense = _dense(dequantized.to(torch.bfloat16), bias)
        return lambda x: quant(x) if x.shape[0] <= small_rows else dense(x)
    return _dense(weight.to(dtype), bias)


def _dense(w: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    if w.device.type == "cpu" and w.dtype == torch.bfloat16 and cpu_has_native_bf16():
        packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 16)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    w = w.contiguous()
    return lambda x: F.linear(x, w, bias)


def _int8(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[Linear, torch.Tensor]:
    """Symmetric int8 per output channel; returns the layer and the dequantized weight."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
    scale = scale.to(torch.bfloat16)

    def linear(x):
        y = torch.ops.aten._weight_int8pack_mm(x, q, scale)
        return y if bias is None else y + bias
    return linear, q.float() * scale.float()[:, None]


def _int4(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[Linear, torch.Tensor]:
    """Asymmetric int4 in groups of INT4_GROUP inputs; returns the layer and the dequantized weight."""
    out_f, in_f = weight.shape
    if in_f % INT4_GROUP:
        raise ValueError(f"int4 quantizes groups of {INT4_GROUP} inputs; this model has a linear with "
                         f"{in_f} inputs (use int8)")
    w = weight.float().reshape(out_f, in_f // INT4_GROUP, INT4_GROUP)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = ((w - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(out_f, in_f)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    # the kernel computes (q - 8) * scale + zero, so zero = lo + 8 * scale; layout [groups, out, 2]
    scales_zeros = torch.stack([scale.reshape(out_f, -1).t(), (lo + 8 * scale).reshape(out_f, -1).t()], dim=-1)
    scales_zeros = scales_zeros.to(torch.bfloat16).contiguous()

    def linear(x):
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, scales_zeros)
        return y if bias is None else y + bias
    sz = scales_zeros.float()
    dequantized = (q.reshape(out_f, -1, INT4_GROUP) - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]
    return linear, dequantized.reshape(out_f, in_f)
