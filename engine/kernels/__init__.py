"""The engine's compiled CPU kernels, built once per machine and loaded on first use.

`paged_decode_attention` (paged_attention_cpu.cpp) reads K/V from the block-major pool in
place: decode attention without the `[batch, context]` copy per layer that gathering costs.
`rms_norm` / `add_rms_norm` (norm_cpu.cpp) are the bf16 decoder's one-pass norms, and
`int8_gemv` / `int4_gemv` (int8_gemv_cpu.cpp, int4_gemv_cpu.cpp; gemv_cpu.h) the quantized
linears' few-row kernels, `fp32_gemv` / `bf16_gemv` (dense_gemv_cpu.cpp) the dense ones
(engine.linear), `rope_store` (rope_store_cpu.cpp) a bf16 step's RoPE and K/V store in one op
(engine.attention.fused_attention), and `paged_prefill_attention`
(prefill_attention_cpu.cpp) a bf16 prompt chunk's causal attention over its blocks in place;
`silu_mul` (silu_mul_cpu.cpp) the bf16 MLP's activation, `argmax_rows` (argmax_cpu.cpp) greedy
sampling's argmax, `gumbel_argmax_rows` (gumbel_argmax_cpu.cpp) a whole row's sampled draw,
`top_candidates` (top_candidates_cpu.cpp) a top-k / nucleus row's candidates and logsumexp,
`lora_add_` (lora_cpu.cpp) a LoRA adapter's update of a bf16 linear's few rows,
`bf16_gemm_amx` (amx_bf16_cpu.cpp) the bf16 GEMM on AMX tiles that `bf16_gemv` runs from 2 rows
where the CPU has AMX-BF16 (`amx_available()`), and `int4_gemv` from
`int4_gemv_amx_from()` rows on its weight widened to bf16 (`int4_gemm_amx` alone); `int8_gemv` runs
on AMX-INT8 tiles (amx_int8_cpu.cpp) from `int8_gemv_amx_from()` rows where the CPU has them
(`amx_int8_available()`; `int8_gemm_amx` alone). They are C++ compiled at run time with
`torch.utils.cpp_extension` (g++ and ninja, both standard on Linux build images) into torch's
extension cache (`~/.cache/torch_extensions`, or `TORCH_EXTENSIONS_DIR`), keyed by the sources
(ninja also rebuilds on a changed header), the flags, this CPU's instruction set and the
checkout's path (two checkouts sharing the cache would otherwise rebuild each other's build
under one lock: a replica of one waited minutes for the other's compiler), so a
later start loads it in well under a second; a first build took 31-46 s here (with 10 sources), and a lock
makes concurrent replicas wait for one build. `make install` builds it ahead
(`python -m engine.kernels.build`). The lock is an OS file lock (`flock`, released when its holder
dies), taken around torch's own: torch's is a file that a build killed midway (Ctrl-C during a first
start, a CI run stopped) leaves behind, after which every later build waits for it forever.

Where they cannot be built (no compiler), `cpu_kernels()` logs why once and returns None;
the engine then uses its pure-torch attention (see engine.attention), aten's norms and aten's
weight-only int8/int4 kernels (see engine.linear; int8 then keeps bf16 activations).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import platform
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name) for name in
            ("paged_attention_cpu.cpp", "norm_cpu.cpp", "int8_gemv_cpu.cpp", "int4_gemv_cpu.cpp",
              "dense_gemv_cpu.cpp", "rope_store_cpu.cpp", "prefill_attention_cpu.cpp",
              "silu_mul_cpu.cpp", "argmax_cpu.cpp", "gumbel_argmax_cpu.cpp", "top_candidates_cpu.cpp",
              "amx_bf16_cpu.cpp", "amx_int8_cpu.cpp", "lora_cpu.cpp")]
# -march=native: the build is keyed by this CPU's flags (below), so the cache never runs code
# built for another CPU. -mno-amx-*: the compiler emits no AMX instruction of its own accord; the
# AMX kernels (amx_bf16_cpu.cpp, amx_int8_cpu.cpp) enable it for their own functions and run only
# after the OS has granted this process the tiles (some kernels/VMs advertise AMX without enabling it).
# -fopenmp: at::parallel_for is an inline template that runs on torch's OpenMP threads only when
# the extension itself is compiled with OpenMP (without it, every kernel runs on one thread); the
# library it links is the libgomp.so.1 torch has already loaded.
_CFLAGS = ["-O3", "-ffast-math", "-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16", "-fopenmp"]


def _cpu_fingerprint() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor() or platform.machine()
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _extension_name() -> str:
    """The build's name in the cache: this CPU's flags and where these sources live (ninja's build
    file names the sources by path, so a checkout elsewhere needs a build of its own)."""
    checkout = hashlib.sha1(str(Path(__file__).resolve().parent).encode()).hexdigest()[:8]
    return f"pdserve_cpu_kernels_{_cpu_fingerprint()}_{checkout}"


@functools.lru_cache(maxsize=1)
def cpu_kernels():
    """torch.ops.pdserve with the CPU kernels registered, or None where they cannot be built."""
    import torch
    from torch.utils.cpp_extension import _get_build_directory, load

    name = _extension_name()
    try:
        directory = Path(_get_build_directory(name, verbose=False))
        with open(directory / "pdserve.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)           # one build at a time; released if we die
            (directory / "lock").unlink(missing_ok=True)   # torch's: under our lock, a dead build's
            load(name=name, sources=[str(p) for p in _SOURCES],
                 extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch path"
        log.warning("pdserve's CPU kernels could not be built (%s: %s); using the slower pure-torch "
                    "attention, norms and int8/int4 linears", type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "")
        return None
    return torch.ops.pdserve
