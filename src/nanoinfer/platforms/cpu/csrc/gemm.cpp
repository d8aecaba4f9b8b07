// Linear layers for the CPU: y = x W^T (+ b) with W packed once at load; float32 or bfloat16 (bfloat16
// weights and inputs are widened to float32 in registers, which is exact, and summed in float32, so
// AVX2 CPUs without native bfloat16 run a bfloat16 model at float32 speed on half the weight bytes).
//
// Why our own: oneDNN's packed sgemm runs decode's shapes (a few dozen rows, K = 576..1536) at well under this
// kernel's rate and is level with it on prefill shapes (benchmarks/README.md, design measurements). The layout is the classic one (GotoBLAS, BLIS):
// - W [N, K] is packed into panels of 16 output columns, k-major: panel p is K rows of 16 floats, so the
//   kernel streams it sequentially and every 64-byte line feeds 16 columns;
// - x is repacked per call into 6-row blocks, k-major, so the 6 broadcasts of a k-step are adjacent;
// - a 6 x 16 register tile: 12 accumulators + 2 weight vectors + 1 broadcast = 15 of the 16 ymm registers,
//   6 broadcasts and 2 loads per 12 FMAs, so the FMA ports, not the loads, set the pace; built for
//   AVX-512, a 12 x 32 tile over two panels instead (24 of the 32 zmm registers accumulate), same bits;
// - rows go in chunks of 120, each packed just before use, so a chunk of x (120 x K floats) stays in L2
//   while the panels stream past it; threads claim runs of consecutive panels that shorten towards the
//   end (a core slowed by a neighbour takes fewer), so each knows the panel it runs next; from two chunks
//   a thread (a prefill), threads claim whole chunks of rows instead and each runs every panel, and write
//   an output too large for the next op to find in cache with streaming stores (AVX-512, float32);
// - the MLP's gate_up weight can be packed "gated" instead: 8 gate columns and the 8 matching up columns
//   per panel, so a tile's two accumulator halves hold gate and up for the same 8 outputs and it stores
//   silu(gate) * up; the [rows, 2I] projection never goes to memory;
// - that next panel is prefetched into L2 a line at a time, spread over all of the current panel's
//   register tiles. In decode the weights come from DRAM once per step, and without this the first tile
//   of each panel waited on memory while the others left the bus idle (benchmarks/README.md);
// - a float32 weight that is exactly 4-bit blocks (csrc/q4_panels.h) is read in that form by steps of up to
//   kQ4MaxRows rows, expanded into float32 in registers or L1 just before the tiles multiply it (the same bits).
#include "q4_panels.h"

#include <atomic>
#include <type_traits>

namespace {

constexpr int NR = 16;        // output columns per panel (two ymm vectors, or one zmm)
#ifdef NANOINFER_AVX512
// AVX-512: a tile is 12 rows of two panels side by side (24 zmm accumulators, 2 weight vectors and a
// broadcast of the 32 registers): 12 broadcasts and 2 loads per 24 FMAs, twice the AVX2 tile's work per
// instruction. Each lane sums in the same order as the AVX2 tile's, so the two give the same bits.
constexpr int MR = 12;
constexpr int NP = 2;         // panels per register tile
#else
constexpr int MR = 6;         // rows per register tile
constexpr int NP = 1;
#endif
constexpr int64_t MC = 120;   // rows per chunk of x kept in L2
constexpr int64_t DECODE_CHUNK_BYTES = 1280 << 10;  // a decode step's chunk of packed x, at most (L2: 2 MB)
constexpr int64_t RUN_DIV = 2;  // a thread's run of panels: 1 / (RUN_DIV * threads) of those left...
constexpr int64_t MIN_RUN = 2;  // ...and at least this many
constexpr int64_t kStreamOutputBytes = 16 << 20;  // a row-split output over this is written with streaming stores
constexpr int64_t ROW_SPLIT_CHUNKS = 2;  // threads split the rows, not the panels, from this many chunks each
// Up to this many rows a call given a weight's exact 4-bit form (pack_q4_panels) runs on it: below, the step is
// bound by streaming the float32 weights; above, by the FMAs, and expanding costs more than the bytes it saves
// (benchmarks/README.md, design measurements). More rows run on AMX
// where the weight also has that form (csrc/q4_amx_gemm.cpp), else on the float32 panels.
constexpr int64_t kQ4MaxRows = 48;

// A tile's weights as exact 4-bit blocks (csrc/q4_panels.h): its first panel's bytes; a second follows at once.
struct Q4Panels {
  const uint8_t* q;
};

// Output element from a float32 sum: bfloat16 rounds to nearest even (what torch's conversion does).
inline float store_as(float x, float*) { return x; }
inline at::BFloat16 store_as(float x, at::BFloat16*) { return static_cast<at::BFloat16>(x); }

#if defined(NANOINFER_AVX512)

// R rows x NPT panels of float32 (or bfloat16) weights at b (panel j at b + j * K * NR): the sums into acc.
template <int R, int NPT, typename W>
inline void accumulate(const float* __restrict a, const W* __restrict b, int64_t K, Prefetch pf,
                       __m512 (&acc)[MR][2]) {
  const W* __restrict b1 = b + K * NR;
  PrefetchWalk walk(pf, b);
  fma_tile_12x2<R, NPT>(
      K,
      [&](int64_t k) {
        walk.next();
        _mm_prefetch(reinterpret_cast<const char*>(b + (k + kL1Ahead) * NR), _MM_HINT_T0);
        if constexpr (NPT == 2) _mm_prefetch(reinterpret_cast<const char*>(b1 + (k + kL1Ahead) * NR), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(a + (k + kL1Ahead) * R), _MM_HINT_T0);
      },
      [&](int r, int64_t k) { return a[k * R + r]; },
      [&](int j, int64_t k) { return load16((j == 0 ? b : b1) + k * NR); },
      [&](int r, int j, __m512 sum) { acc[r][j] = sum; });
}

// The same sums with the weights expanded from 4-bit blocks in registers, two k-steps from each 16 bytes: the same
// float32 values multiplied in the same order (fma(q, d, m), as expand_q4_blocks), so the same bits, without
// writing the panel out and reading it back (which kept a 1-row step at 7.2 ms against ~2-3 of arithmetic).
template <int R, int NPT>
inline void accumulate(const float* __restrict a, Q4Panels b, int64_t K, Prefetch pf, __m512 (&acc)[MR][2]) {
  const uint8_t* __restrict q0 = b.q;
  const uint8_t* __restrict q1 = b.q + q4_panel_bytes(K);
  const char* pf_line = pf.line;
  uint64_t pf_pos = 0;
  const __m512i low = _mm512_set1_epi32(15);
  __m512 d0, m0, d1, m1;
  __m512i v0, v1;
  fma_tile_12x2<R, NPT>(
      K,
      [&](int64_t k) {
        if (pf_line) {
          _mm_prefetch(pf_line + ((pf_pos >> 32) << 6), _MM_HINT_T1);
          pf_pos += pf.step;
        }
        const int64_t blk = k / kQ4Group * kQ4BlockBytes;
        if (k % kQ4Group == 0) {
          d0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q0 + blk)));
          m0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q0 + blk + 32)));
          if constexpr (NPT == 2) {
            d1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q1 + blk)));
            m1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q1 + blk + 32)));
          }
        }
        if (k % 2 == 0) {
          const int64_t pair = blk + kQ4HeaderBytes + 16 * (k % kQ4Group / 2);
          v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q0 + pair)));
          if constexpr (NPT == 2) v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q1 + pair)));
        }
      },
      [&](int r, int64_t k) { return a[k * R + r]; },
      [&](int j, int64_t k) {
        const __m512i v = j == 0 ? v0 : v1;
        const __m512i q = k % 2 == 0 ? _mm512_and_si512(v, low) : _mm512_srli_epi32(v, 4);
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), j == 0 ? d0 : d1, j == 0 ? m0 : m1);
      },
      [&](int r, int j, __m512 sum) { acc[r][j] = sum; });
}

// R rows of NPT (1 or 2) consecutive panels: panel j's weights at b + j * K * NR (or its 4-bit blocks), its
// outputs at c + j * COLS (COLS = 8 gated, else 16), `ncols[j]` of them valid, its bias at bias + j * NR.
// GATED: a panel holds 8 gate columns then the 8 matching up columns (pack_gated_weight): each accumulator's
// low half is gate, its high half up, and the tile stores silu(gate) * up (two whole panels' halves gathered
// into one 16-lane SiLU, a lone or partial panel's on 8 lanes).
template <int R, int NPT, bool GATED, typename O>
inline void store_tile(const __m512 (&acc)[MR][2], O* __restrict c, int64_t ldc, const int* ncols,
                       const float* __restrict bias, bool stream);

template <int R, int NPT, bool GATED, typename B, typename O>
inline void tile(const float* __restrict a, B b, int64_t K, O* __restrict c, int64_t ldc,
                 const int* ncols, const float* __restrict bias, Prefetch pf, bool stream) {
  __m512 acc[MR][2];
  accumulate<R, NPT>(a, b, K, pf, acc);
  store_tile<R, NPT, GATED>(acc, c, ldc, ncols, bias, stream);
}

// A tile's sums to its outputs (+ bias, or silu(gate) * up when GATED).
template <int R, int NPT, bool GATED, typename O>
inline void store_tile(const __m512 (&acc)[MR][2], O* __restrict c, int64_t ldc, const int* ncols,
                       const float* __restrict bias, bool stream) {
  constexpr int COLS = GATED ? NR / 2 : NR;
  // Streaming (non-temporal) stores, for outputs too large for the next op to find in cache (run_linear says
  // when and why): a line goes to memory without first being read in for ownership. Only for an aligned line the
  // store writes whole (the callers check it is whole: all 16 columns of it valid).
  auto streamable = [&](const O* out) {
    return std::is_same_v<O, float> && stream && (reinterpret_cast<uintptr_t>(out) & 63) == 0;
  };
  if constexpr (GATED && NPT == 2) {
    // Two whole gated panels are 16 adjacent outputs a row: their gates (the accumulators' low halves) and ups
    // (high halves) gathered into one vector each, so SiLU runs on 16 lanes, not twice on 8. With two 8-lane
    // SiLUs the gated GEMM ran 7% slower than the plain one of its shape at 175 rows; now it runs level.
    if (ncols[0] == COLS && ncols[1] == COLS) {
      for (int r = 0; r < R; ++r) {
        const __m512 g = _mm512_shuffle_f32x4(acc[r][0], acc[r][1], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512 u = _mm512_shuffle_f32x4(acc[r][0], acc[r][1], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512 y = silu_mul16(g, u);
        O* out = c + r * ldc;
        if constexpr (std::is_same_v<O, float>) {
          if (streamable(out))
            _mm512_stream_ps(out, y);
          else
            _mm512_storeu_ps(out, y);
        } else {
          alignas(64) float row[NR];
          _mm512_store_ps(row, y);
          for (int i = 0; i < NR; ++i) out[i] = store_as(row[i], out);
        }
      }
      return;
    }
  }
  for (int j = 0; j < NPT; ++j) {
    const int n = ncols[j];
    if constexpr (GATED) {  // no bias: the gated MLPs nanoinfer runs have none (packed_linear refuses one)
      for (int r = 0; r < R; ++r) {
        const __m256 y = silu_mul8(low8(acc[r][j]), high8(acc[r][j]));
        O* out = c + r * ldc + j * COLS;
        if constexpr (std::is_same_v<O, float>) {
          if (n == COLS) {
            _mm256_storeu_ps(out, y);
            continue;
          }
        }
        alignas(32) float row[COLS];
        _mm256_store_ps(row, y);
        for (int i = 0; i < n; ++i) out[i] = store_as(row[i], out);
      }
      continue;
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    const __m512 bias_v = bias ? _mm512_maskz_loadu_ps(mask, bias + j * NR) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 y = _mm512_add_ps(acc[r][j], bias_v);
      O* out = c + r * ldc + j * COLS;
      if constexpr (std::is_same_v<O, float>) {
        if (n == COLS && streamable(out))
          _mm512_stream_ps(out, y);
        else
          _mm512_mask_storeu_ps(out, mask, y);
      } else {
        alignas(64) float row[NR];
        _mm512_store_ps(row, y);
        for (int i = 0; i < n; ++i) out[i] = store_as(row[i], out);
      }
    }
  }
}
#elif defined(NANOINFER_AVX2)
// GATED: the panel holds 8 gate columns then the 8 matching up columns (pack_gated_weight), and the tile
// stores silu(gate) * up: 8 outputs a row, `ncols` of them valid. One panel a tile (NPT 1).
template <int R, int NPT, bool GATED, typename W, typename O>
inline void tile(const float* __restrict a, const W* __restrict b, int64_t K, O* __restrict c, int64_t ldc,
                 const int* ncols_of, const float* __restrict bias, Prefetch pf, bool) {
  static_assert(NPT == 1, "the AVX2 tile covers one panel");
  const int ncols = ncols_of[0];
  // Named accumulators, not an array: with an array GCC spills all twelve to the stack every k-step.
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  PrefetchWalk walk(pf, b);
  for (int64_t k = 0; k < K; ++k) {
    walk.next();
    const __m256 b0 = load8(b + k * NR), b1 = load8(b + k * NR + 8);  // bfloat16 widens exactly
    const float* ak = a + k * R;
    __m256 av;
#define NANOINFER_ROW(r)                                                                     \
  if constexpr (R > r) {                                                                     \
    av = _mm256_broadcast_ss(ak + r);                                                        \
    c##r##0 = _mm256_fmadd_ps(av, b0, c##r##0);                                              \
    c##r##1 = _mm256_fmadd_ps(av, b1, c##r##1);                                              \
  }
    NANOINFER_ROW(0) NANOINFER_ROW(1) NANOINFER_ROW(2) NANOINFER_ROW(3) NANOINFER_ROW(4) NANOINFER_ROW(5)
#undef NANOINFER_ROW
  }
  const __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  if constexpr (GATED) {  // no bias: the gated MLPs nanoinfer runs have none (packed_linear refuses one)
    for (int r = 0; r < R; ++r) {
      const __m256 y = silu_mul8(acc[r][0], acc[r][1]);
      if constexpr (std::is_same_v<O, float>) {
        if (ncols == NR / 2) {
          _mm256_storeu_ps(c + r * ldc, y);
          continue;
        }
      }
      alignas(32) float row[NR / 2];
      _mm256_store_ps(row, y);
      O* out = c + r * ldc;
      for (int j = 0; j < ncols; ++j) out[j] = store_as(row[j], out);
    }
    return;
  }
  alignas(32) float bias_tile[NR] = {};
  if (bias) std::copy(bias, bias + ncols, bias_tile);
  const __m256 bias0 = _mm256_load_ps(bias_tile), bias1 = _mm256_load_ps(bias_tile + 8);
  for (int r = 0; r < R; ++r) {
    if constexpr (std::is_same_v<O, float>) {
      if (ncols == NR) {
        _mm256_storeu_ps(c + r * ldc, _mm256_add_ps(acc[r][0], bias0));
        _mm256_storeu_ps(c + r * ldc + 8, _mm256_add_ps(acc[r][1], bias1));
        continue;
      }
    }
    alignas(32) float row[NR];
    _mm256_store_ps(row, _mm256_add_ps(acc[r][0], bias0));
    _mm256_store_ps(row + 8, _mm256_add_ps(acc[r][1], bias1));
    O* out = c + r * ldc;
    for (int j = 0; j < ncols; ++j) out[j] = store_as(row[j], out);
  }
}
#else
template <int R, int NPT, bool GATED, typename W, typename O>
inline void tile(const float* a, const W* b, int64_t K, O* c, int64_t ldc, const int* ncols_of, const float* bias,
                 Prefetch, bool) {
  static_assert(NPT == 1, "the plain tile covers one panel");
  const int ncols = ncols_of[0];
  float acc[MR][NR] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] += a[k * R + r] * to_f(b[k * NR + j]);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < ncols; ++j) {
      const float g = acc[r][j], y = GATED ? g / (1.f + std::exp(-g)) * acc[r][j + NR / 2] : g + (bias ? bias[j] : 0.f);
      c[r * ldc + j] = store_as(y, c);
    }
}
#endif

// Calls tile<r> for the last r < MR rows of a panel (r from 1 to MR - 1; nothing for 0).
template <int R, int NPT, bool GATED, typename B, typename O>
inline void tail_tile(int r, const float* a, B b, int64_t K, O* c, int64_t ldc, const int* ncols,
                      const float* bias, Prefetch pf, bool stream) {
  if constexpr (R > 0) {
    if (r == R) return tile<R, NPT, GATED>(a, b, K, c, ldc, ncols, bias, pf, stream);
    tail_tile<R - 1, NPT, GATED>(r, a, b, K, c, ldc, ncols, bias, pf, stream);
  }
}

// rows x NPT panels' outputs; x's rows are packed in MR-row blocks (the last may be shorter). `next` is where
// the panels this thread runs after these start (or null), `next_bytes` of them, prefetched evenly over all of
// these panels' tiles: the first tile alone would ask DRAM for a line per k-step, faster than a core's share
// of the bandwidth.
template <int NPT, bool GATED, typename B, typename O>
void panel(const float* a, B b, int64_t K, O* c, int64_t ldc, const int* ncols, int64_t rows,
           const float* bias, const void* next, int64_t next_bytes, bool stream) {
  const int64_t tiles = (rows + MR - 1) / MR;
  // 4-bit weights are prefetched at any row count: expanding them keeps even a 1-row tile busy long enough to
  // spread the prefetches over.
  const int64_t min_rows = std::is_same_v<B, Q4Panels> ? 0 : kPrefetchMinRows;
  const int64_t lines = next && rows >= min_rows ? (next_bytes + 63) / 64 : 0;
  auto share = [&](int64_t t) {  // tile t's lines of the next panels
    const int64_t first = lines * t / tiles, last = lines * (t + 1) / tiles;
    Prefetch pf;
    if (last > first) {
      pf.line = reinterpret_cast<const char*>(next) + 64 * first;
      pf.step = (static_cast<uint64_t>(last - first) << 32) / static_cast<uint64_t>(K);
    }
    return pf;
  };
  int64_t m = 0;
  for (; m + MR <= rows; m += MR) tile<MR, NPT, GATED>(a + m * K, b, K, c + m * ldc, ldc, ncols, bias, share(m / MR), stream);
  tail_tile<MR - 1, NPT, GATED>((int)(rows - m), a + m * K, b, K, c + m * ldc, ldc, ncols, bias, share(m / MR), stream);
}

#if defined(NANOINFER_AVX512)
// Calls f(std::integral_constant<int, R>) for R = r (1..MR).
template <int R, typename F>
inline void with_rows(int r, F&& f) {
  if constexpr (R > 0) {
    if (r == R) return f(std::integral_constant<int, R>{});
    with_rows<R - 1>(r, f);
  }
}

// k-steps of a tile's panels expanded from 4-bit blocks at a time: 2 x 192 x 16 floats, 24 KB, which stay in L1
// while every row tile runs over them.
constexpr int64_t kQ4Chunk = 192;

// One row tile over a chunk of kc k-steps of expanded panels (w; panel 1 at w + kc * NR), its sums carried on
// from `sums` (unless first) and left there (unless last, which stores the outputs as tile() does).
template <int R, int NPT, bool GATED, typename O>
inline void q4_chunk_tile(const float* __restrict a, const float* __restrict w, int64_t kc, float* __restrict sums,
                          bool first, bool last, O* __restrict c, int64_t ldc, const int* ncols,
                          const float* __restrict bias, bool stream) {
  __m512 acc[MR][2];
  const float* __restrict w1 = w + kc * NR;
  fma_tile_12x2_from<R, NPT>(
      kc, [&](int r, int j) { return first ? _mm512_setzero_ps() : _mm512_load_ps(sums + (2 * r + j) * NR); },
      [&](int64_t k) { _mm_prefetch(reinterpret_cast<const char*>(a + (k + kL1Ahead) * R), _MM_HINT_T0); },
      [&](int r, int64_t k) { return a[k * R + r]; },
      [&](int j, int64_t k) { return _mm512_load_ps((j == 0 ? w : w1) + k * NR); },
      [&](int r, int j, __m512 sum) { acc[r][j] = sum; });
  if (last) return store_tile<R, NPT, GATED>(acc, c, ldc, ncols, bias, stream);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NPT; ++j) _mm512_store_ps(sums + (2 * r + j) * NR, acc[r][j]);
}

// rows x NPT panels of 4-bit blocks (q: the first panel's bytes; panel() says what the rest is). One register
// tile of rows expands the weights in registers (tile() with Q4Panels); more expand them kQ4Chunk k-steps at a
// time into L1, and every row tile runs over each chunk, its sums carried from chunk to chunk in L1 (the same
// order of k, so the same bits). Expanding whole panels instead (72-192 KB, in L2) had every tile read them back
// from L2; expanding in registers for every tile repeated the expansion per tile.
template <int NPT, bool GATED, typename O>
void q4_panel(const float* a, const uint8_t* q, int64_t K, O* c, int64_t ldc, const int* ncols, int64_t rows,
              const float* bias, const uint8_t* next, int64_t next_bytes, bool stream) {
  if (rows <= MR) return panel<NPT, GATED>(a, Q4Panels{q}, K, c, ldc, ncols, rows, bias, next, next_bytes, stream);
  static thread_local std::vector<float> buffer;
  const int64_t tiles = (rows + MR - 1) / MR;
  const size_t need = NPT * kQ4Chunk * NR + tiles * MR * 2 * NR + 16;
  if (buffer.size() < need) buffer.resize(need);
  float* w = buffer.data() + (16 - reinterpret_cast<uintptr_t>(buffer.data()) / 4 % 16) % 16;  // 64-byte aligned
  float* sums = w + NPT * kQ4Chunk * NR;
  const int64_t bytes = q4_panel_bytes(K);
  for (int64_t k0 = 0; k0 < K; k0 += kQ4Chunk) {
    const int64_t kc = std::min(kQ4Chunk, K - k0);
    const int64_t pf0 = next_bytes * k0 / K, pf1 = next_bytes * (k0 + kc) / K;  // this chunk's share of the next
    for (int j = 0; j < NPT; ++j)
      expand_q4_blocks(q + j * bytes + k0 / kQ4Group * kQ4BlockBytes, kc / kQ4Group, w + j * kc * NR,
                       j == 0 && next ? next + pf0 : nullptr, pf1 - pf0);
    const bool first = k0 == 0, last = k0 + kc == K;
    for (int64_t m = 0; m < rows; m += MR) {
      const int r = (int)std::min<int64_t>(MR, rows - m);
      with_rows<MR>(r, [&](auto rr) {
        constexpr int R = decltype(rr)::value;
        q4_chunk_tile<R, NPT, GATED>(a + m * K + k0 * R, w, kc, sums + m * 2 * NR, first, last, c + m * ldc, ldc,
                                     ncols, bias, stream);
      });
    }
  }
}
#endif

}  // namespace

template <typename T>
static void pack_panels(const T* src, T* dst, int64_t N, int64_t K) {
  at::parallel_for(0, (N + NR - 1) / NR, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < NR && p * NR + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * NR + j] = src[(p * NR + j) * K + k];
  });
}

// The fused [2I, K] gate_up weight (gate rows, then up rows) into panels of 8 gate columns and the 8 matching
// up columns, for packed_linear(..., gated): the MLP's silu(gate) * up is then computed in the GEMM's
// registers, and the [rows, 2I] gate_up output is never written to memory and read back.
template <typename T>
static void pack_gated_panels(const T* src, T* dst, int64_t I, int64_t K) {
  constexpr int H = NR / 2;
  at::parallel_for(0, (I + H - 1) / H, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < H && p * H + j < I; ++j)
        for (int64_t k = 0; k < K; ++k) {
          dst[(p * K + k) * NR + j] = src[(p * H + j) * K + k];
          dst[(p * K + k) * NR + H + j] = src[(I + p * H + j) * K + k];
        }
  });
}

// Both layouts from one place: [N, K] -> [ceil(N / 16), K, 16] panels, or gated [2I, K] -> [ceil(I / 8), K, 16].
static torch::Tensor pack(const torch::Tensor& weight, bool gated, const char* what) {
  const auto w = weight.contiguous();
  const int64_t cols = gated ? NR / 2 : NR;  // output columns of one panel
  const int64_t N = gated ? w.size(0) / 2 : w.size(0), K = w.size(1);
  // Zero columns past N; on huge pages, as decode streams it every step.
  auto packed = zeros_on_huge_pages({(N + cols - 1) / cols, K, NR}, w.scalar_type());
  with_typed<false>(w, what, [&](auto* src) {
    using T = std::remove_pointer_t<decltype(src)>;
    if (gated)
      pack_gated_panels(src, packed.data_ptr<T>(), N, K);
    else
      pack_panels(src, packed.data_ptr<T>(), N, K);
  });
  return packed;
}

torch::Tensor pack_gated_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % 2 == 0, "pack_gated_weight: a 2-D [2 * I, K] weight");
  return pack(weight, true, "pack_gated_weight");
}

torch::Tensor pack_linear_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear_weight: 2-D weight");
  return pack(weight, false, "pack_linear_weight");
}

// Rows [blk0 * MR, blk1 * MR) of a chunk of `rows` rows of x [.., K] into `a` as float32 MR-row blocks,
// k-major (the last block of the chunk may be shorter).
template <typename T>
static void pack_rows(const T* xs, float* a, int64_t rows, int64_t K, int64_t blk0, int64_t blk1) {
  for (int64_t blk = blk0; blk < blk1; ++blk) {
    const int64_t r0 = blk * MR;
    const int n = (int)std::min<int64_t>(MR, rows - r0);
    float* dst = a + r0 * K;
    int64_t k = 0;
#if defined(NANOINFER_AVX512)
    // float32, whole blocks: 16 k-values of 4 rows at a time, transposed 4 x 4 within each 128-bit lane, so each
    // k's 4 values leave as one 16-byte store where the scalar loop took 4 (it was ~4% of a prefill's GEMM time).
    if constexpr (std::is_same_v<T, float>) {
      if (n == MR) {
        for (; k + 16 <= K; k += 16)
          for (int g = 0; g < MR; g += 4) {
            const float* src = xs + (r0 + g) * K + k;
            const __m512 x0 = _mm512_loadu_ps(src), x1 = _mm512_loadu_ps(src + K);
            const __m512 x2 = _mm512_loadu_ps(src + 2 * K), x3 = _mm512_loadu_ps(src + 3 * K);
            store_transposed_4x16(x0, x1, x2, x3, dst + k * MR + g, MR);
          }
      }
    }
#endif
    for (; k < K; ++k)
      for (int r = 0; r < n; ++r) dst[k * n + r] = to_f(xs[(r0 + r) * K + k]);
  }
}

// x [M, K] (float32 or bfloat16, summed in float32) times the packed weight of the same dtype -> [M, N].
// q4 (or null): the same weight as exact 4-bit blocks (pack_q4_panels, float32 only); each panel is then expanded
// from them into float32 just before its tiles run, in place of reading its float32 panel.
template <bool GATED, typename T>
static void run_linear(const T* xs, const T* b, const float* bias, T* c, int64_t M, int64_t K, int64_t N, int64_t P,
                       const uint8_t* q4) {
  constexpr int64_t COLS = GATED ? NR / 2 : NR;  // output columns of one panel
  // x is repacked (as float32) one chunk of MC rows at a time, in MR-row blocks, k-major, just before its
  // panels run: the packed chunk is then still in L2 when the kernel reads it, and a prefill of thousands
  // of rows needs no repacked copy of all of x. One buffer per calling thread, reused across calls (a
  // fresh allocation would be page-faulted in every time).
  static thread_local std::vector<float> buffer;
  const int threads = at::get_num_threads();
  bool stream = false;  // streaming stores for the output (the row-split path below decides)
  // Panels [p, p + n) (n <= NP: one register tile spans them) over `rows` packed rows of x (`a`, rows m0..),
  // prefetching `next_panels` panels from panel `next` (-1: none).
  auto run_panels = [&](int64_t p, int n, int64_t next, int next_panels, const float* a, int64_t m0, int64_t rows) {
    int ncols[NP];
    for (int j = 0; j < n; ++j) ncols[j] = (int)std::min<int64_t>(COLS, N - (p + j) * COLS);
    T* cp = c + m0 * N + p * COLS;
    const float* biasp = bias ? bias + p * NR : nullptr;
#if defined(NANOINFER_AVX512)
    if constexpr (std::is_same_v<T, float>) {
      if (q4) {
        const int64_t bytes = q4_panel_bytes(K);
        const uint8_t* q4next = next >= 0 ? q4 + next * bytes : nullptr;
        if (NP == 2 && n == 2)
          q4_panel<NP, GATED>(a, q4 + p * bytes, K, cp, N, ncols, rows, biasp, q4next, next_panels * bytes, stream);
        else
          q4_panel<1, GATED>(a, q4 + p * bytes, K, cp, N, ncols, rows, biasp, q4next, next_panels * bytes, stream);
        return;
      }
    }
#endif
    const T* bp = b + p * K * NR;  // (b is null for a weight without float32 panels, which takes the branch above)
    const T* nextp = next >= 0 ? b + next * K * NR : nullptr;
    if (NP == 2 && n == 2)
      panel<NP, GATED>(a, bp, K, cp, N, ncols, rows, biasp, nextp, next_panels * K * NR * (int64_t)sizeof(T), stream);
    else
      panel<1, GATED>(a, bp, K, cp, N, ncols, rows, biasp, nextp, next_panels * K * NR * (int64_t)sizeof(T), stream);
  };
  if (M >= ROW_SPLIT_CHUNKS * MC * threads) {
    // Many rows (a prefill): each thread claims chunks of rows and runs every panel over its own chunk,
    // packed into its own buffer, with no barrier at all: sharing each chunk's panels cost two barriers a
    // chunk and the packing of half of it by the other core (benchmarks/README.md). Chunks shrink towards the
    // end so threads finish together;
    // a row's sums are the same whichever thread or chunk computes it.
    // Each line a store misses is first read in for ownership: a second stream of the output's bytes, on the
    // path the weights and x come by. Streaming stores write whole lines to memory without that read, but
    // then the next op reads the output from memory, not from L3: a gain for outputs far larger than L3, a
    // loss for those of a few MB, so only outputs over 16 MiB stream (benchmarks/README.md).
    stream = std::is_same_v<T, float> && M * N * (int64_t)sizeof(T) > kStreamOutputBytes;
    std::atomic<int64_t> cursor{0};
    #pragma omp parallel num_threads(threads)
    {
      if ((int64_t)buffer.size() < MC * K) buffer.resize(MC * K);  // this worker's own
      float* a = buffer.data();
      for (;;) {
        int64_t m0 = cursor.load(std::memory_order_relaxed), rows = 0;
        do {
          if (m0 >= M) break;
          const int64_t guided = (M - m0) / (2 * threads);  // half of an even share of the rows left
          rows = std::min(M - m0, std::clamp<int64_t>((guided + MR - 1) / MR * MR, MR, MC));
        } while (!cursor.compare_exchange_weak(m0, m0 + rows, std::memory_order_relaxed));
        if (m0 >= M) break;
        pack_rows(xs + m0 * K, a, rows, K, 0, (rows + MR - 1) / MR);
        for (int64_t p = 0; p < P;) {
          const int n = (int)std::min<int64_t>(NP, P - p);
          const int64_t next = p + n < P ? p + n : 0;  // the next chunk starts again from panel 0
          run_panels(p, n, next, (int)std::min<int64_t>(NP, P - next), a, m0, rows);
          p += n;
        }
      }
#if defined(NANOINFER_AVX512)
      if (stream) _mm_sfence();  // this thread's streamed stores are ordered before the region's barrier
#endif
    }
    return;
  }
  // Fewer rows (a decode step): the threads split each chunk's panels, and every chunk streams all of the
  // weights again, so the rows go in as few chunks as keep a chunk of x in L2 (DECODE_CHUNK_BYTES), of
  // equal size: in MC-row chunks, 128 rows ran as 120 + 8, and the short chunk cost a full pass over the
  // weights (benchmarks/README.md).
  const int64_t max_rows = std::max<int64_t>(MC, DECODE_CHUNK_BYTES / (K * (int64_t)sizeof(float)) / MR * MR);
  const int64_t chunks = (M + max_rows - 1) / max_rows;
  const int64_t chunk_rows = ((M + chunks - 1) / chunks + MR - 1) / MR * MR;
  if ((int64_t)buffer.size() < chunk_rows * K) buffer.resize(chunk_rows * K);
  float* a = buffer.data();  // taken here: inside the parallel region `buffer` would be each worker's own
  std::atomic<int64_t> cursor{0};
  #pragma omp parallel num_threads(threads)
  for (int64_t m0 = 0; m0 < M; m0 += chunk_rows) {
    const int64_t rows = std::min<int64_t>(chunk_rows, M - m0);
    #pragma omp for schedule(static)
    for (int64_t blk = 0; blk < (rows + MR - 1) / MR; ++blk) pack_rows(xs + m0 * K, a, rows, K, blk, blk + 1);
    // implicit barrier: the chunk is packed before any panel reads it
    // Threads take runs of consecutive panels, each 1 / (RUN_DIV * threads) of the panels left, so
    // runs shorten towards the end and a core slowed by a neighbour takes fewer of them. A thread claims
    // its next run as it starts the last panel of the current one: it always knows the panel it runs
    // next, and prefetches it.
    const int64_t first = (m0 / chunk_rows) * P, end = first + P;  // this chunk's panels count on from the last's
    auto claim = [&](int64_t& len) {  // -> the first panel of a run of `len`, or -1 when none are left
      int64_t start = cursor.load(std::memory_order_relaxed);
      do {
        if (start >= end) return int64_t(-1);
        // Whole register tiles (NP panels): a run of odd length ends in a one-panel tile, which does half
        // the FMAs per broadcast.
        len = std::max<int64_t>(MIN_RUN, (end - start) / (RUN_DIV * threads));
        len = std::min(end - start, (len + NP - 1) / NP * NP);
      } while (!cursor.compare_exchange_weak(start, start + len, std::memory_order_relaxed));
      return start - first;
    };
    // Within a run, panels go NP at a time, the last one alone if left over (an odd number of panels).
    int64_t len = 0, p0 = claim(len);
    while (p0 >= 0) {
      int64_t next_len = 0, next_p0 = -1;
      for (int64_t p = p0; p < p0 + len;) {
        const int n = (int)std::min<int64_t>(NP, p0 + len - p);
        int64_t next = p + n, next_end = p0 + len;
        if (next == p0 + len) next = next_p0 = claim(next_len), next_end = next + next_len;
        run_panels(p, n, next, next >= 0 ? (int)std::min<int64_t>(NP, next_end - next) : 0, a, m0, rows);
        p += n;
      }
      p0 = next_p0, len = next_len;
    }
    #pragma omp barrier
    // (the barrier: every panel is done before the next chunk overwrites the buffer)
  }
}

bool q4_amx_linear(const float* x, int64_t M, int64_t K, int64_t N, bool gated, const uint8_t* w, int64_t pairs,
                   const float* bias, float* out);

torch::Tensor packed_linear(const torch::Tensor& input, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias, int64_t N, bool gated,
                            const c10::optional<torch::Tensor>& compact, const c10::optional<torch::Tensor>& compact_amx) {
  // An empty `packed`: no float32 panels, the weight's two 4-bit forms run every step (pack_weight leaves the
  // panels out where both exist: no step reads them then).
  const bool has_panels = packed.numel() > 0;
  const bool has_compact = compact.has_value() && compact->numel() > 0;
  const bool both_forms = has_compact && compact_amx.has_value() && compact_amx->numel() > 0;
  TORCH_CHECK(has_panels || both_forms, "packed_linear: no float32 panels and not both 4-bit forms of the weight");
  TORCH_CHECK(input.scalar_type() == packed.scalar_type(), "packed_linear: input ", input.scalar_type(),
              " but weight ", packed.scalar_type());
  const int64_t cols = gated ? NR / 2 : NR;
  const int64_t P = has_panels ? packed.size(0) : compact->size(0);
  TORCH_CHECK(!has_panels || (packed.dim() == 3 && packed.size(2) == NR), "packed_linear: weight not packed by ",
              gated ? "pack_gated_weight" : "pack_linear_weight");
  TORCH_CHECK(P == (N + cols - 1) / cols, "packed_linear: weight not packed by ",
              gated ? "pack_gated_weight" : "pack_linear_weight", " for ", N, " outputs");
  TORCH_CHECK(!gated || !(bias.has_value() && bias->defined()), "packed_linear: no bias with gated");
  const int64_t K = has_panels ? packed.size(1) : compact->size(1) * kQ4Group;
  TORCH_CHECK(input.size(-1) == K, "packed_linear: input has ", input.size(-1), " features, weight ", K);
  const LinearIO io = linear_io(input, K, N, bias, "packed_linear");
  const auto& x = io.x;
  const int64_t M = x.size(0);
  const float* bias_ptr = io.bias_ptr();
  const uint8_t* q4 = nullptr;
  if (has_compact && M <= kQ4MaxRows) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && compact->scalar_type() == at::kByte && compact->dim() == 3 &&
                    compact->size(0) == P && compact->size(1) * kQ4Group == K &&
                    compact->size(2) == kQ4BlockBytes && compact->is_contiguous(),
                "packed_linear: compact is not pack_q4_panels' form of this float32 weight");
    q4 = compact->data_ptr<uint8_t>();
  }
  if (M > kQ4MaxRows && compact_amx.has_value() && compact_amx->numel() > 0) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && compact_amx->scalar_type() == at::kByte && compact_amx->dim() == 3 &&
                    compact_amx->size(0) == (P + 1) / 2 && compact_amx->size(1) * kQ4Group == K &&
                    compact_amx->is_contiguous(),
                "packed_linear: compact_amx is not pack_q4_amx's form of this float32 weight");
    if (q4_amx_linear(x.data_ptr<float>(), M, K, N, gated, compact_amx->data_ptr<uint8_t>(), compact_amx->size(0),
                      bias_ptr, io.out.data_ptr<float>()))
      return io.out.view(io.sizes);
  }
  TORCH_CHECK(has_panels || M <= kQ4MaxRows, "packed_linear: no float32 panels, and AMX is not available");
  if (M > 0) {
    with_typed<false>(x, "packed_linear", [&](auto* xp) {
      using T = std::remove_pointer_t<decltype(xp)>;
      const T* b = packed.data_ptr<T>();
      if (gated)
        run_linear<true>(xp, b, bias_ptr, io.out.data_ptr<T>(), M, K, N, P, q4);
      else
        run_linear<false>(xp, b, bias_ptr, io.out.data_ptr<T>(), M, K, N, P, q4);
    });
  }
  return io.out.view(io.sizes);
}

bool has_avx2() {
#ifdef NANOINFER_AVX2
  return true;
#else
  return false;
#endif
}
