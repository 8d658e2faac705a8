// The GEMMs on Intel AMX tiles: bf16 (amx_bf16_cpu.cpp), which bf16_gemv (dense_gemv_cpu.cpp) hands
// its calls of many rows where this CPU has AMX-BF16: the same blocked weight, no other copy; and
// int4_gemv its calls of many rows, its weight widened to bf16 a chunk at a time. int8 on AMX-INT8
// tiles (amx_int8_cpu.cpp), which int8_gemv hands its calls of many rows, on its own weight.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "kernel_common.h"

// The AMX kernels build with GCC 11 and later on x86-64 (their functions enable AMX by target
// attribute; -march=native leaves it off, build.py) and run only where `available()`
#if defined(PDSERVE_AVX512) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define PDSERVE_AMX 1
#endif

namespace pdserve_amx {

// True where the kernels were built for an x86-64 CPU with AVX512-BF16, this CPU has AMX-BF16
// and the OS lets this process use its tiles (Linux's ARCH_REQ_XCOMP_PERM, asked once). False
// elsewhere, including a VM that advertises AMX but does not enable it.
bool available();

// Where gemm's B tiles come from: the bf16 GEMV's blocked weight itself (`blocked`), or a function
// that writes blocks [c0, c1) of that layout into a thread's buffer (`dequantize`, with `ctx`: a
// quantized format's weight widened to bf16; called once per block a call, on the calling pool
// thread).
struct Weights {
  const pdserve_cpu::bf16* blocked = nullptr;
  void (*dequantize)(const void* ctx, int64_t c0, int64_t c1, int64_t K, pdserve_cpu::bf16* out) = nullptr;
  const void* ctx = nullptr;
};

// y [M, N] = x [M, K] @ w.T (+ bias), rounded to bf16 once. w's bf16 layout is the
// GEMV's, [ceil(N/16), K/2, 32] (element 2c + e of w[b, j] is channel 16b + c's weight at input
// 2j + e), which is the layout of AMX's B tiles. K a multiple of 32; x, y contiguous; bias
// nullable. Only where `available()`. Runs on torch's threads (at::parallel_for over blocks of
// channels).
void gemm(const pdserve_cpu::bf16* x, int64_t M, int64_t K, const Weights& w, const pdserve_cpu::bf16* bias,
          pdserve_cpu::bf16* y, int64_t N);

// `available()` and the CPU has AMX-INT8 as well (amx_int8_cpu.cpp)
bool int8_available();

// y [M, N] = x [M, K] @ ((q - 128) * scale).T (+ bias), rounded to bf16 once, on AMX-INT8 tiles: q
// in int8_gemv's layout [ceil(N/16), Kp/4, 64] (uint8, weight + 128), which is `tdpbsud`'s B tile
// layout as it is; Kp (K rounded up to 32) a multiple of 64. Each row of x is split into two int8
// limbs, x ~ s (128 hi + lo) with |128 hi + lo| <= 16383 (15 bits a row, s = max |x| / 16383),
// summed exactly in int32. Only where `int8_available()`; on torch's threads.
void int8_gemm(const pdserve_cpu::bf16* x, int64_t M, int64_t K, const uint8_t* q, int64_t Kp, const float* scale,
               const pdserve_cpu::bf16* bias, pdserve_cpu::bf16* y, int64_t N);

#ifdef PDSERVE_AMX
constexpr int64_t kTileRows = 16;               // every tile: 16 rows of 64 bytes
constexpr int64_t kChunkBytes = 256 * 1024;     // a thread's blocks walked again from L2 for more rows

// The calling thread's tiles for the AMX kernels: ldtilecfg with every tile 16 rows of 64 bytes
// (A, B and accumulators alike); release_tiles() after its last tile op
void configure_tiles();
void release_tiles();
#endif

// The same for x [M, K] (contiguous bf16): returns y [M, n], bf16
at::Tensor gemm(const at::Tensor& x, const Weights& w, const pdserve_cpu::bf16* bias, int64_t n);

inline void bf16_gemm(const pdserve_cpu::bf16* x, int64_t M, int64_t K, const pdserve_cpu::bf16* w,
                      const pdserve_cpu::bf16* bias, pdserve_cpu::bf16* y, int64_t N) {
  gemm(x, M, K, Weights{w}, bias, y, N);
}

}  // namespace pdserve_amx
