"""What a model runner runs on, chosen once at its start: the device, the activation dtype and
the linears' weight format, the KV pool's geometry (`KVShape`), and the attention kernels with
where each applies (decode: the paged kernel, checked against the torch backend at start; prompt
chunks: the decode kernel's rows, the bf16 prefill kernel, or sdpa). engine/model_runner.py calls
these; they hold no state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import DecodeBatch, gathered_decode, window_mask
from engine.config import EngineConfig
from engine.kernels import cpu_kernels
from engine.linear import cpu_serves_bf16
from engine.model_dims import Dims

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def resolve_dtype(spec: str, device: torch.device, gemv: bool = True) -> torch.dtype:
    """'auto': bf16 on a GPU that supports it (fp16 on older ones); on CPU bf16 where it is the
    faster format (`engine.linear.cpu_serves_bf16`: native bf16, or the engine's GEMVs built for
    AVX2 unless `gemv` (EngineConfig.cpu_gemv) is off), else fp32."""
    if spec == "auto":
        if device.type != "cuda":
            return torch.bfloat16 if cpu_serves_bf16(gemv) else torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return _TORCH_DTYPES[spec]


def cuda_snapshot(device: torch.device) -> tuple[int, int, int]:
    """(free device memory, torch allocated, torch reserved) now, bytes."""
    return torch.cuda.mem_get_info(device)[0], torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


# Prompt chunks after a past of at most this many tokens join the paged decode kernel's call, a row
# per token; longer ones run the prefill kernel (bf16, `prefill_kernel_applies`) or gather their
# context and run sdpa. Measured per layer (SmolLM2 shapes, one thread, past 32-2048,
# `benchmarks/attention_bench.py --chunks`): in bf16 the rows take 0.6-1x the prefill kernel's time
# at 2-4 tokens and lose from 6-8 on (1.7-3.3x at 16-256); both beat gather + sdpa 1.2-6x. (In fp32 the
# rows now beat sdpa up to 16 tokens, 1.1-4.8x; the threshold stays one for both.)
KERNEL_CHUNK_ROWS = 4


def prefill_kernel_applies(kernels, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether prompt chunks (those not run as rows of the decode kernel) go through
    `paged_prefill_attention` (engine/kernels/prefill_attention_cpu.cpp: bf16, head size 64, 128 or
    256, AVX512-BF16 or AVX2; 4-6x sdpa's CPU flash attention from 128 to 2048 tokens with
    AVX512-BF16, 1.4-2.4x on AVX2, measured by benchmarks/attention_bench.py) instead of sdpa: with the CPU paged backend in bf16 where it
    is built. fp32 keeps sdpa, whose sums the exact mode's equality with Hugging Face relies on."""
    return (kernels is not None and device.type == "cpu" and dtype == torch.bfloat16
            and kernels.prefill_attention_supported(head_dim))


# Where the CPU has AMX-BF16, prompt chunks of at least this many tokens run sdpa instead (fresh,
# or after a past, whose context they gather): torch's CPU flash attention multiplies on AMX tiles
# (oneDNN's brgemm), the prefill kernel on AVX512-BF16 dot products. Measured on a 2-core AMX Xeon,
# per layer (`benchmarks/attention_bench.py --chunks`, 1 thread, us): fresh 16 / 128 / 512 / 2048
# tokens sdpa 32 / 169 / 1781 / 16172 against the kernel's 16 / 262 / 3383 / 51669; after a past of
# 256, 16 / 64 / 256 tokens 138 / 243 / 1104 against 130 / 495 / 2448; after 2048, 970 / 1677 /
# 4908 against 1056 / 3483 / 13722. Whole bf16 prefills (`--prefills`, the kernel's time / sdpa's):
# 1 thread 0.95x / 1.01x / 1.11x / 1.40x / 1.73x at 128 / 256 / 512 / 1024 / 2048 tokens (2 threads
# 0.90x / 0.99x / 1.08x / 1.37x / 1.74x).
AMX_SDPA_FROM = 16


def chunk_sdpa_from(kernels) -> int | None:
    """The prompt chunk's length from which it runs sdpa though the prefill kernel applies
    (AMX_SDPA_FROM where the CPU has AMX-BF16), or None: never."""
    return AMX_SDPA_FROM if kernels is not None and kernels.amx_available() else None


def attention_kernels(spec: str, device: torch.device, dtype: torch.dtype):
    """(kernels, backend name) of decode attention: an object with `paged_decode_attention`
    (the C++ op on CPU, Triton on CUDA) and "cpu_paged"/"triton_paged", or (None, "torch")."""
    if spec == "torch":
        return None, "torch"
    if device.type == "cpu":
        if dtype not in (torch.float32, torch.bfloat16):
            if spec == "paged":
                raise ValueError(f"attention_backend='paged' runs on CPU in float32 or bfloat16, not {dtype}; "
                                 "use auto or torch")
            return None, "torch"
        kernels = cpu_kernels()
        if kernels is None and spec == "paged":
            raise ValueError("attention_backend='paged': the CPU kernel could not be built (see the warning "
                             "above); use auto or torch")
        return kernels, "cpu_paged" if kernels is not None else "torch"
    try:
        from engine.kernels.triton_attention import TritonKernels
    except ImportError as exc:
        if spec == "paged":
            raise ValueError(f"attention_backend='paged' on {device} needs Triton ({exc}); use auto or torch") from exc
        return None, "torch"
    return TritonKernels(), "triton_paged"


def paged_kernel_problem(kernels, num_heads: int, shape: KVShape, device: torch.device,
                         dtype: torch.dtype) -> str | None:
    """None if `kernels.paged_decode_attention` gives the torch backend's decode attention on a
    small random pool of this geometry (shuffled blocks, ragged lengths), else what went wrong."""
    try:
        g = torch.Generator().manual_seed(0)
        bs, layers = shape.block_size, 2
        n_blocks, width = 7, 3
        pool = torch.randn(n_blocks, layers, 2, bs, shape.num_kv_heads, shape.head_dim, generator=g)
        pool = pool.to(device, dtype)
        tables = torch.randperm(n_blocks, generator=g)[:2 * width].view(2, width).to(device)
        lens = torch.tensor([2 * bs + 1, 3 if bs > 3 else 1], device=device)
        q = torch.randn(2, num_heads, shape.head_dim, generator=g).to(device, dtype)
        scale = shape.head_dim ** -0.5
        # full attention, and a sliding window of bs + 2 keys (past the first block of the longer row)
        out = torch.cat([kernels.paged_decode_attention(q, pool, tables, lens, 1, scale, w).float()
                         for w in (0, bs + 2)])
        k_rows = tables * (2 * layers)
        mask = (torch.arange(width * bs, device=device)[None, :] < lens[:, None])[:, None, None, :]
        dec = DecodeBatch(torch.arange(2, device=device), blocks=torch.stack((k_rows, k_rows + 1)).view(-1), mask=mask)
        windowed = mask & window_mask(lens - 1, width * bs, bs + 2)[0, 0][:, None, None, :]
        ref = torch.cat([gathered_decode(1, q, pool, dec, scale, m).float() for m in (mask, windowed)])
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return f"{type(exc).__name__}: {exc}"
    err = (out - ref).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if not err <= tol * max(1.0, ref.abs().max().item()):
        return f"max difference {err:.3g} from the torch backend"
    return None


def dtype_name(dtype: torch.dtype) -> str:
    """"float32", "bfloat16" or "float16": the engine's name of a dtype (a dense weight format's, the
    KV pool's in KVShape)."""
    return {v: k for k, v in _TORCH_DTYPES.items()}[dtype]


def weight_format(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> str:
    """The linears' format: the quantization if one is set (CPU, bf16 activations), else the dtype."""
    if config.quantization is None:
        return dtype_name(dtype)
    if device.type != "cpu" or dtype != torch.bfloat16:
        raise ValueError(f"quantization={config.quantization!r} runs on CPU with bfloat16 activations "
                         f"(device {device}, dtype {dtype}); unset it or use dtype bfloat16 on cpu")
    return config.quantization


@dataclass(frozen=True)
class KVShape:
    """Geometry of the KV pool; also the compatibility fingerprint for KV transfer."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=_TORCH_DTYPES[self.dtype]).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize


def kv_shape_of(hf_config, block_size: int, dtype: torch.dtype) -> KVShape:
    dims = Dims.of_config(hf_config)
    return KVShape(dims.num_layers, dims.num_kv_heads, dims.head_dim, block_size, dtype_name(dtype))
