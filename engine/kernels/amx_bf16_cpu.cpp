// bf16 GEMM on Intel AMX tiles (Sapphire Rapids and later Xeons): bf16_gemv's calls of many rows
// (a decode batch, a prompt chunk) where the CPU has AMX-BF16.
//
//   bf16_gemm_amx(x [M, K] bf16, w [N/16, K/2, 32] bf16, bias [n] bf16?, n) -> [M, n] bf16
//       the AMX path on its own, for tests and benchmarks (an error where it is not available or
//       K is not a multiple of 32); bf16_gemv takes it by itself from `kAmxFrom` rows
//   amx_available() -> bool: pdserve_amx::available(); amx_int8_available(): int8_available()
//
// Why: `vdpbf16ps` (AVX512-BF16), the GEMV's instruction, does 32 multiply-adds; one AMX
// `tdpbf16ps` does 16 x 16 x 32. From a few rows on, the GEMV is bound by arithmetic, not by
// streaming the weight: on a 2-core AMX Xeon its step's linears took 26 / 43 / 85 ms at 8 / 32 /
// 64 rows against 10 at one (benchmarks/linear_bench.py, 2 threads); on tiles 11 / 15 / 19.
//
// The weight's blocked layout (16 output channels, pairs of inputs, 64 bytes a pair) is AMX's B
// tile layout as it is: 16 pairs of one block are a 16 x 64-byte tile at stride 64. A pass takes
// two blocks against up to two tiles of 16 rows of x (accumulator tile 2i + j for x tile i and
// block j; A tiles 4-5, B tiles 6-7: all eight), the blocks' weight read once a pass, x's tiles
// from L1/L2, so up to 32 rows stream the weight once; more rows walk the thread's blocks in
// L2-sized chunks, each chunk once per 32 rows. On that Xeon a 1 KiB tile load took ~15 ns even
// from L1 and a tile product ~5 ns, so loads set the pace: 2 x 2 (4 loads for 4 products) beat 4
// tiles of x against one block (two A tiles in turn) by 10-20 %; prefetching the weight ahead
// changed nothing. The last partial tile of x rows comes from a zero-padded copy. Sums in fp32
// (AMX's bf16 products are exact in fp32; denormal inputs and results are flushed to zero),
// rounded to bf16 once with the bias, as the GEMV; each row's sums do not depend on the others.
//
// int4_gemv hands it its calls of many rows with a `Weights::dequantize` (amx_bf16.h): each thread
// widens a chunk of its blocks to bf16 into its own buffer (once a call, whatever the rows) and
// runs the same passes on it. (int8_gemv did too until its AMX-INT8 path, amx_int8_cpu.cpp.)
#include "amx_bf16.h"
#include "gemv_cpu.h"            // the GEMVs' bias-and-round store and argument checks

#include <algorithm>
#include <cstring>
#include <vector>

#ifdef PDSERVE_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pdserve_amx {

using pdserve_cpu::bf16;

#ifdef PDSERVE_AMX
namespace {

constexpr int kMaxTiles = 2;            // tiles of x a pass: 32 rows

// ldtilecfg's 64-byte operand (palette 1): every tile 16 rows of 64 bytes
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool request_tiles() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 22)) || !(d & (1u << 24))) return false;     // AMX-BF16, AMX-TILE
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;       // asm/prctl.h, the tile data's state
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}

}  // namespace

__attribute__((target("amx-tile"))) void configure_tiles() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  // not _tile_loadconfig: GCC 12's takes the operand as 8 bytes and drops the stores to the rest
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

namespace {

// NB blocks (16 channels each; wb[j]: block j's weights) against MT tiles of x (a[i]: its first
// row, rows K apart), NB, MT <= 2: tile 2i + j accumulates tile i of x (A tile 4 + i) times
// block j (B tile 6 + j), four independent chains at 2 x 2. The sums into out[2i + j][16][16].
template <int MT, int NB>
__attribute__((target("amx-tile,amx-bf16"))) void block_pass(const bf16* const* a, int64_t K, const bf16* const* wb,
                                                            float* out) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (MT > 1) _tile_zero(2);
  if constexpr (MT > 1 && NB > 1) _tile_zero(3);
  const int64_t stride = K * 2;
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(6, wb[0] + k * 16, 64);              // pairs k/2 .. k/2 + 15 of the block
    _tile_loadd(4, a[0] + k, stride);
    if constexpr (NB > 1) _tile_loadd(7, wb[1] + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (MT > 1) _tile_loadd(5, a[1] + k, stride);
    if constexpr (NB > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MT > 1 && NB > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, 64);
  if constexpr (NB > 1) _tile_stored(1, out + 256, 64);
  if constexpr (MT > 1) _tile_stored(2, out + 512, 64);
  if constexpr (MT > 1 && NB > 1) _tile_stored(3, out + 768, 64);
}

// rows [m0, m0 + rows) of y's channels [16b, 16b + 16) from out (+ bias), rounded to bf16
inline void store_block(const float* out, int64_t rows, const bf16* bias, bf16* y, int64_t N, int64_t m0, int64_t b) {
  for (int64_t r = 0; r < rows; ++r)
    pdserve_gemv::store16(y + (m0 + r) * N, bias, N, 16 * b, _mm512_loadu_ps(out + r * 16));
}

}  // namespace

bool available() {
  static const bool ok = request_tiles();
  return ok;
}

bool int8_available() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    return available() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25));    // AMX-INT8
  }();
  return ok;
}

void gemm(const bf16* x, int64_t M, int64_t K, const Weights& w, const bf16* bias, bf16* y, int64_t N) {
  TORCH_INTERNAL_ASSERT(available() && K % 32 == 0 && M >= 0, "gemm: AMX and K % 32 == 0");
  TORCH_INTERNAL_ASSERT((w.blocked != nullptr) != (w.dequantize != nullptr), "gemm: one weight source");
  const int64_t blocks = (N + 15) / 16, full = M / kTileRows * kTileRows;
  std::vector<bf16> pad;                              // x's last partial tile, zeros below its rows
  if (full < M) {
    pad.assign(kTileRows * K, bf16(0.f));
    std::memcpy(pad.data(), x + full * K, (M - full) * K * sizeof(bf16));
  }
  const int64_t chunk = std::max<int64_t>(2, kChunkBytes / (K * 32) / 2 * 2);   // whole pairs of blocks
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    configure_tiles();
    alignas(64) float out[4 * 256];
    thread_local std::vector<bf16> widened;           // a chunk of a quantized weight in bf16
    if (w.dequantize) widened.resize(chunk * K * 16);
    for (int64_t c0 = b0; c0 < b1; c0 += chunk) {
      const int64_t c1 = std::min(b1, c0 + chunk);
      const bf16* wc = w.blocked ? w.blocked + c0 * K * 16 : widened.data();   // block c0's weights
      if (w.dequantize) w.dequantize(w.ctx, c0, c1, K, widened.data());
      for (int64_t m0 = 0; m0 < M; m0 += kMaxTiles * kTileRows) {
        const bf16* a[kMaxTiles];
        const int tiles = M - m0 > kTileRows ? 2 : 1;
        for (int i = 0; i < tiles; ++i) {
          const int64_t row = m0 + i * kTileRows;
          a[i] = row < full ? x + row * K : pad.data();
        }
        const int64_t rows = std::min<int64_t>(M - m0, tiles * kTileRows);
        for (int64_t b = c0; b < c1; b += 2) {
          const bool two = b + 1 < c1;
          const bf16* wb[2] = {wc + (b - c0) * K * 16, wc + (two ? b + 1 - c0 : b - c0) * K * 16};
          if (tiles == 2) {
            if (two) block_pass<2, 2>(a, K, wb, out); else block_pass<2, 1>(a, K, wb, out);
          } else {
            if (two) block_pass<1, 2>(a, K, wb, out); else block_pass<1, 1>(a, K, wb, out);
          }
          for (int j = 0; j < (two ? 2 : 1); ++j) {
            store_block(out + 256 * j, std::min<int64_t>(rows, kTileRows), bias, y, N, m0, b + j);
            if (tiles == 2)
              store_block(out + 512 + 256 * j, rows - kTileRows, bias, y, N, m0 + kTileRows, b + j);
          }
        }
      }
    }
    release_tiles();
  });
}

#else

bool available() { return false; }
bool int8_available() { return false; }

void gemm(const bf16*, int64_t, int64_t, const Weights&, const bf16*, bf16*, int64_t) {
  TORCH_CHECK(false, "pdserve's AMX kernel is not built for this CPU");
}

#endif

at::Tensor gemm(const at::Tensor& x, const Weights& w, const bf16* bias, int64_t n) {
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  gemm(x.data_ptr<bf16>(), x.size(0), x.size(1), w, bias, y.data_ptr<bf16>(), n);
  return y;
}

}  // namespace pdserve_amx

namespace {

at::Tensor bf16_gemm_amx(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(pdserve_amx::available(), "AMX-BF16 is not available here");
  pdserve_gemv::check_x(x);
  TORCH_CHECK(x.size(1) % 32 == 0, "x: inputs a multiple of 32 (whole tiles)");
  const int64_t M = x.size(0), K = x.size(1), blocks = (n + 15) / 16;
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
              w.sizes() == at::IntArrayRef({blocks, K / 2, 32}), "w: [ceil(out/16), in/2, 32] bf16");
  return pdserve_amx::gemm(x.contiguous(), {w.data_ptr<pdserve_cpu::bf16>()}, pdserve_gemv::bias_ptr(bias, n), n);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("bf16_gemm_amx(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor");
  m.def("amx_available() -> bool", &pdserve_amx::available);
  m.def("amx_int8_available() -> bool", &pdserve_amx::int8_available);
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("bf16_gemm_amx", &bf16_gemm_amx); }
