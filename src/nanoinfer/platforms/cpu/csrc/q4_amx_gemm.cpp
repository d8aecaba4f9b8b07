// Float32 linears on AMX for weights that are exactly 4-bit blocks (csrc/q4_panels.h): w = d * q + m, with d and
// m float16 per 32 inputs of an output and q an integer 0..15.
//
// Why: steps of many rows (a prefill, big decode steps) are bound by the FMA ports, which the panel GEMM keeps
// ~85% busy. With such weights, x W^T = sum over blocks b of d_b * (x_b . q_b) + m_b * sum(x_b), and x_b . q_b
// can run on AMX's bfloat16 tiles with no rounding of its products: q is exact in bfloat16, and x splits exactly
// into three bfloat16 parts (hi + mid + lo carry its 24 significant bits), so every product is exact (at most
// 12 significant bits) and only the float32 sums round, as an FMA GEMM's do. It is a float32 GEMM in a different
// summation order (relative error ~1e-7, as between any two float32 GEMMs), not the panel GEMM's bits.
//
// Layout (pack_q4_amx, from pack_q4_panels' panels): per pair of panels (32 output columns: 16 a panel, gated
// 8 gate and the 8 matching up ones) and 32-input block, two B tiles (16 k-pairs x 16 columns of q in bfloat16,
// 1 KB each), then the 32 columns' d and m in float32.
//
// The register block is 32 rows x 32 columns: four accumulator tiles, the A tiles of one part for the two row
// blocks, the two B tiles. Each block's four sums are stored and folded into float32 accumulators in L1 while the
// next block's products run (the fold waits on the tile store, and the store on the products).
#include "amx.h"
#include "q4_panels.h"

#include <atomic>

constexpr int64_t kAmxPairBytes = 2 * 1024 + 2 * 32 * 4;  // two B tiles, then 32 d and 32 m (float32)

// [P, K / 32, kQ4BlockBytes] 4-bit panels -> [ceil(P / 2), K / 32, kAmxPairBytes] (a missing last panel: zeros).
torch::Tensor pack_q4_amx(const torch::Tensor& compact) {
  TORCH_CHECK(compact.dim() == 3 && compact.scalar_type() == at::kByte && compact.size(2) == kQ4BlockBytes &&
                  compact.is_contiguous(),
              "pack_q4_amx: 4-bit panels from pack_q4_panels");
  const int64_t P = compact.size(0), KB = compact.size(1), pairs = (P + 1) / 2;
  auto out = zeros_on_huge_pages({pairs, KB, kAmxPairBytes}, at::kByte);
  const uint8_t* src = compact.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, pairs, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t cp = c0; cp < c1; ++cp)
      for (int64_t kb = 0; kb < KB; ++kb) {
        uint8_t* pair = dst + (cp * KB + kb) * kAmxPairBytes;
        float* dm = reinterpret_cast<float*>(pair + 2048);
        for (int64_t j = 0; j < 2 && 2 * cp + j < P; ++j) {
          const uint8_t* blk = src + ((2 * cp + j) * KB + kb) * kQ4BlockBytes;
          const c10::Half* h = reinterpret_cast<const c10::Half*>(blk);
          uint16_t* tile = reinterpret_cast<uint16_t*>(pair + j * 1024);
          for (int c = 0; c < 16; ++c) {
            dm[j * 16 + c] = static_cast<float>(h[c]);
            dm[32 + j * 16 + c] = static_cast<float>(h[16 + c]);
            for (int p = 0; p < 16; ++p) {
              const uint8_t both = blk[kQ4HeaderBytes + 16 * p + c];  // k = 2p (low nibble), 2p + 1 (high)
              tile[p * 32 + c * 2] = c10::BFloat16(static_cast<float>(both & 15)).x;
              tile[p * 32 + c * 2 + 1] = c10::BFloat16(static_cast<float>(both >> 4)).x;
            }
          }
        }
      }
  });
  return out;
}

#ifdef NANOINFER_AMX
namespace {

constexpr int64_t kRowGroup = 64;  // rows split and packed at a time (4 row blocks: their A tiles stay in L2)

// Rows [0, rows) of x (K columns, rows apart by K) as A tiles of their three bfloat16 parts,
// a[rb][kb][part][16][32] for rb < blocks (rows past `rows` zero), and each row's block sums x_sum[row][kb].
void split_rows(const float* x, int64_t K, int64_t rows, int64_t blocks, at::BFloat16* a, float* x_sum) {
  const int64_t KB = K / kQ4Group;
  for (int64_t rb = 0; rb < blocks; ++rb)
    for (int64_t kb = 0; kb < KB; ++kb) {
      at::BFloat16* tiles = a + (rb * KB + kb) * 3 * kTileElems;
      for (int r = 0; r < 16; ++r) {
        const int64_t row = rb * 16 + r;
        if (row >= rows) {
          for (int part = 0; part < 3; ++part) _mm512_storeu_si512(tiles + part * kTileElems + r * 32, _mm512_setzero_si512());
          x_sum[row * KB + kb] = 0.f;
          continue;
        }
        const float* src = x + row * K + kb * kQ4Group;
        __m512 v[2] = {_mm512_loadu_ps(src), _mm512_loadu_ps(src + 16)};
        x_sum[row * KB + kb] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
        for (int part = 0; part < 3; ++part) {
          for (int half = 0; half < 2; ++half) {
            const __m256bh b = _mm512_cvtneps_pbh(v[half]);  // to nearest even: the rest is exact in float32
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(tiles + part * kTileElems + r * 32 + half * 16),
                                reinterpret_cast<const __m256i&>(b));
            const __m512 back = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(b)), 16));
            v[half] = _mm512_sub_ps(v[half], back);
          }
        }
      }
    }
}

// Rows [0, rows) of one packed row group times column pairs [cp0, cp1) into out (rows ldc apart), with the
// bias (or, gated, silu(gate) * up).
void group_times_pairs(const at::BFloat16* a, const float* x_sum, int64_t rows, int64_t K, const uint8_t* w,
                       int64_t cp0, int64_t cp1, const float* bias, bool gated, int64_t N, float* out) {
  const int64_t KB = K / kQ4Group, blocks = (rows + 31) / 32 * 2;
  alignas(64) float sums[2][4][16][16];  // two blocks' tile sums, stored in turn
  alignas(64) float acc[2][16][32];      // 32 rows x 32 columns of float32 accumulators
  for (int64_t cp = cp0; cp < cp1; ++cp) {
    const uint8_t* wp = w + cp * KB * kAmxPairBytes;
    for (int64_t rb = 0; rb < blocks; rb += 2) {
      std::memset(acc, 0, sizeof acc);
      auto issue = [&](int64_t kb) {
        const at::BFloat16* a0 = a + (rb * KB + kb) * 3 * kTileElems;
        const at::BFloat16* a1 = a + ((rb + 1) * KB + kb) * 3 * kTileElems;
        const uint8_t* b = wp + kb * kAmxPairBytes;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_loadd(6, b, 64); _tile_loadd(7, b + 1024, 64);
        for (int part = 0; part < 3; ++part) {
          _tile_loadd(4, a0 + part * kTileElems, 64); _tile_loadd(5, a1 + part * kTileElems, 64);
          _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
      };
      auto store = [&](int64_t kb) {
        float(*s)[16][16] = sums[kb & 1];
        _tile_stored(0, s[0], 64); _tile_stored(1, s[1], 64); _tile_stored(2, s[2], 64); _tile_stored(3, s[3], 64);
      };
      auto fold = [&](int64_t kb) {  // acc += d * (x . q) + m * sum(x), per block
        float(*s)[16][16] = sums[kb & 1];
        const float* dm = reinterpret_cast<const float*>(wp + kb * kAmxPairBytes + 2048);
        const __m512 d0 = _mm512_loadu_ps(dm), d1 = _mm512_loadu_ps(dm + 16);
        const __m512 m0 = _mm512_loadu_ps(dm + 32), m1 = _mm512_loadu_ps(dm + 48);
        for (int h = 0; h < 2; ++h)
          for (int r = 0; r < 16; ++r) {
            const __m512 xs = _mm512_set1_ps(x_sum[((rb + h) * 16 + r) * KB + kb]);
            __m512 y0 = _mm512_load_ps(acc[h][r]), y1 = _mm512_load_ps(acc[h][r] + 16);
            y0 = _mm512_fmadd_ps(m0, xs, _mm512_fmadd_ps(d0, _mm512_load_ps(s[2 * h][r]), y0));
            y1 = _mm512_fmadd_ps(m1, xs, _mm512_fmadd_ps(d1, _mm512_load_ps(s[2 * h + 1][r]), y1));
            _mm512_store_ps(acc[h][r], y0), _mm512_store_ps(acc[h][r] + 16, y1);
          }
      };
      issue(0);
      for (int64_t kb = 0; kb < KB; ++kb) {
        store(kb);
        if (kb + 1 < KB) issue(kb + 1);
        fold(kb);
      }
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < 16; ++r) {
          const int64_t row = (rb + h) * 16 + r;
          if (row >= rows) break;
          float* o = out + row * N;
          const __m512 y0 = _mm512_load_ps(acc[h][r]), y1 = _mm512_load_ps(acc[h][r] + 16);
          if (gated) {  // panels of 8 gate then 8 up columns: 16 outputs from the pair
            const int64_t n = std::min<int64_t>(16, N - cp * 16);
            const __m512 g = _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(1, 0, 1, 0));
            const __m512 u = _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 2, 3, 2));
            _mm512_mask_storeu_ps(o + cp * 16, static_cast<__mmask16>((1u << n) - 1), silu_mul16(g, u));
            continue;
          }
          for (int j = 0; j < 2; ++j) {
            const int64_t col = cp * 32 + j * 16, n = std::min<int64_t>(16, N - col);
            if (n <= 0) break;
            const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
            const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
            _mm512_mask_storeu_ps(o + col, mask, _mm512_add_ps(j == 0 ? y0 : y1, b));
          }
        }
    }
  }
}

}  // namespace
#endif

// x [M, K] float32 times a weight packed by pack_q4_amx (`pairs` column pairs) -> out [M, N] (gated: N outputs of
// silu(gate) * up). False where this build or CPU has no AMX (the caller runs the panel GEMM).
bool q4_amx_linear(const float* x, int64_t M, int64_t K, int64_t N, bool gated, const uint8_t* w, int64_t pairs,
                   const float* bias, float* out) {
#ifdef NANOINFER_AMX
  if (!amx_permitted()) return false;
  const int threads = at::get_num_threads();
  const int64_t KB = K / kQ4Group;
  // Many rows: threads claim row groups and run every column pair. Fewer: every thread splits all the rows
  // (cheap next to the products) and runs its share of the column pairs.
  const bool by_rows = M >= 2 * kRowGroup * threads;
  std::atomic<int64_t> cursor{0};
  #pragma omp parallel num_threads(threads)
  {
    load_tile_config();
    const int t = omp_get_thread_num();
    const int64_t cp0 = by_rows ? 0 : pairs * t / threads, cp1 = by_rows ? pairs : pairs * (t + 1) / threads;
    static thread_local std::vector<at::BFloat16> a;
    static thread_local std::vector<float> x_sum;
    const int64_t group_blocks = kRowGroup / 16;
    if ((int64_t)a.size() < group_blocks * KB * 3 * kTileElems) a.resize(group_blocks * KB * 3 * kTileElems);
    if ((int64_t)x_sum.size() < kRowGroup * KB) x_sum.resize(kRowGroup * KB);
    for (int64_t mine = 0;; mine += kRowGroup) {
      const int64_t r0 = by_rows ? cursor.fetch_add(kRowGroup, std::memory_order_relaxed) : mine;
      if (r0 >= M) break;
      const int64_t rows = std::min(kRowGroup, M - r0);
      split_rows(x + r0 * K, K, rows, (rows + 31) / 32 * 2, a.data(), x_sum.data());
      if (cp1 > cp0) group_times_pairs(a.data(), x_sum.data(), rows, K, w, cp0, cp1, bias, gated, N, out + r0 * N);
    }
    _tile_release();
  }
  return true;
#else
  (void)x, (void)M, (void)K, (void)N, (void)gated, (void)w, (void)pairs, (void)bias, (void)out;
  return false;
#endif
}
