// Shared by the kernels that use Intel AMX (Sapphire Rapids and later): the build test, the permission Linux
// asks for, the one tile shape they all use, and how a B tile is filled from rows of k values.
// amx_gemm.cpp (linears), paged_attention.cpp (decode's key pass) and prefill_attention.cpp include it;
// without AMX in the build NANOINFER_AMX is undefined and each keeps its other paths.
#pragma once
#include "simd.h"

#include <vector>

// greedy_lm_head's bound (see there): E_j = row_scale[r] * weight_norms[j] + c2 * |B_j| + tiny for row r.
struct LogitBound {
  const float* weight_norms = nullptr;  // [N]
  const float* row_scale = nullptr;     // [rows]
  float c2 = 0.0f, tiny = 0.0f;
};
// For each row of x [rows, K] bfloat16 times a weight from pack_amx_weight: the columns j whose bfloat16 logit
// B_j (the sum rounded as amx_linear rounds it) has B_j + E_j >= max_i (B_i - E_i), in no particular order;
// none for a row whose B holds an infinity or a NaN, or for which more columns than fit kept reaching the
// threshold (the caller computes the row in full). Taken in the GEMM's epilogue: the [rows, N] logits are never written (amx_gemm.cpp).
std::vector<std::vector<int32_t>> amx_logit_candidates(const torch::Tensor& x, const torch::Tensor& packed,
                                                       int64_t N, const LogitBound& bound);

#if defined(NANOINFER_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#define NANOINFER_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

// Linux keeps AMX's tile state off until a process asks for it (arch_prctl, kernel 5.16+); asked once.
static inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes: a float32 accumulator of 16 x 16, a bfloat16 A of 16 rows x 32, a B of 16
// k-pairs x 16 columns. Per thread; a kernel loads it on entry to its parallel region and releases on exit.
static inline void load_tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

constexpr int kTileElems = 16 * 32;  // bfloat16 elements of an A or B tile (16 rows of 64 bytes)

// 32 consecutive k values of one column (16 dword pairs, as loaded from a row-major source) into column n of
// a B tile: pair i goes to row i. One scatter, where the packing loops stored 32 scalars.
static inline void scatter_b_column(at::BFloat16* tile, int n, __m512i pairs) {
  const __m512i rows = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  _mm512_i32scatter_epi32(reinterpret_cast<int*>(tile) + n, rows, pairs, 4);
}
#endif
