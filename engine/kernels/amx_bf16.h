// The bf16 GEMM on Intel AMX tiles (amx_bf16_cpu.cpp), which bf16_gemv (dense_gemv_cpu.cpp) hands
// its calls of many rows where this CPU has AMX-BF16: the same blocked weight, no other copy; and
// int8_gemv / int4_gemv their calls of many rows, their weights widened to bf16 a chunk at a time.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "kernel_common.h"

namespace pdserve_amx {

// True where the kernels were built for an x86-64 CPU with AVX512-BF16, this CPU has AMX-BF16
// and the OS lets this process use its tiles (Linux's ARCH_REQ_XCOMP_PERM, asked once). False
// elsewhere, including a VM that advertises AMX but does not enable it.
bool available();

// Where gemm's B tiles come from: the bf16 GEMV's blocked weight itself (`blocked`), or a function
// that writes blocks [c0, c1) of that layout into a thread's buffer (`dequantize`, with `ctx`: a
// quantized format's weight widened to bf16; called once per block a call, on the calling pool
// thread). `scale` (nullable; ceil(N/16) * 16 floats) multiplies channel n's sum before the bias.
struct Weights {
  const pdserve_cpu::bf16* blocked = nullptr;
  void (*dequantize)(const void* ctx, int64_t c0, int64_t c1, int64_t K, pdserve_cpu::bf16* out) = nullptr;
  const void* ctx = nullptr;
  const float* scale = nullptr;
};

// y [M, N] = x [M, K] @ w.T (* scale) (+ bias), rounded to bf16 once. w's bf16 layout is the
// GEMV's, [ceil(N/16), K/2, 32] (element 2c + e of w[b, j] is channel 16b + c's weight at input
// 2j + e), which is the layout of AMX's B tiles. K a multiple of 32; x, y contiguous; bias
// nullable. Only where `available()`. Runs on torch's threads (at::parallel_for over blocks of
// channels).
void gemm(const pdserve_cpu::bf16* x, int64_t M, int64_t K, const Weights& w, const pdserve_cpu::bf16* bias,
          pdserve_cpu::bf16* y, int64_t N);

// The same for x [M, K] (contiguous bf16): returns y [M, n], bf16
at::Tensor gemm(const at::Tensor& x, const Weights& w, const pdserve_cpu::bf16* bias, int64_t n);

inline void bf16_gemm(const pdserve_cpu::bf16* x, int64_t M, int64_t K, const pdserve_cpu::bf16* w,
                      const pdserve_cpu::bf16* bias, pdserve_cpu::bf16* y, int64_t N) {
  gemm(x, M, K, Weights{w}, bias, y, N);
}

}  // namespace pdserve_amx
