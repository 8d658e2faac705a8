// The bf16 GEMM on Intel AMX tiles (amx_bf16_cpu.cpp), which bf16_gemv (dense_gemv_cpu.cpp) hands
// its calls of many rows where this CPU has AMX-BF16: the same blocked weight, no other copy.
#pragma once

#include <cstdint>

#include "kernel_common.h"

namespace pdserve_amx {

// True where the kernels were built for an x86-64 CPU with AVX512-BF16, this CPU has AMX-BF16
// and the OS lets this process use its tiles (Linux's ARCH_REQ_XCOMP_PERM, asked once). False
// elsewhere, including a VM that advertises AMX but does not enable it.
bool available();

// y [M, N] = x [M, K] @ w.T (+ bias), rounded to bf16 once, bias included. w: bf16_gemv's layout,
// [ceil(N/16), K/2, 32] (element 2c + e of w[b, j] is channel 16b + c's weight at input 2j + e),
// which is the layout of AMX's B tiles. K a multiple of 32; x, y contiguous; bias nullable.
// Only where `available()`. Runs on torch's threads (at::parallel_for over blocks of channels).
void bf16_gemm(const pdserve_cpu::bf16* x, int64_t M, int64_t K, const pdserve_cpu::bf16* w,
               const pdserve_cpu::bf16* bias, pdserve_cpu::bf16* y, int64_t N);

}  // namespace pdserve_amx
