// A mixture-of-experts layer's experts on the CPU: out[t] = sum_j w[t, j] * expert_{id[t, j]}(x[t]), each expert a
// gated MLP (gate/up projection, activation, down projection), float32 or bfloat16, float32 sums.
//
// The shape of it (vLLM's fused_moe, on the panel GEMM of csrc/gemm.cpp):
// - the token-expert pairs are sorted by expert (a stable counting sort: token order within an expert), so each
//   expert's rows are consecutive; an expert's rows go in chunks that keep their packed rows in L2;
// - each projection is ONE parallel region over work units (a chunk of one expert's rows x one register tile of
//   two 16-column panels) of all experts at once. Threads claim runs of consecutive units (so a chunk's rows are
//   packed once a run) whose size, in rows x panels plus a fixed cost for streaming each panel, shrinks towards
//   the end: an expert hit by many tokens is split over threads, and a thread slowed by a neighbour takes fewer;
// - the gate/up projection's epilogue adds the biases and applies the gated activation (SiLU, GELU-tanh or
//   gpt-oss's clamped SwiGLU) and writes the hidden rows straight into the packed layout the down projection
//   reads them in; the down projection's epilogue adds its bias into one float32 row per pair;
// - each token's output is the sum of its pairs' rows times their weights, in float32, in expert order (the
//   order the reference adds them in), rounded once to the output dtype.
//
// Weights are packed once at load (pack_moe_weights), per expert: float32 exactly as pack_linear_weight /
// pack_gated_weight lay out a linear (panels of 16 columns, k-major; gated panels hold 8 gate and the 8 matching
// up columns); bfloat16 the same columns with each panel's k-steps in pairs, [steps / 2][16 columns][2], the
// operand layout of AVX512-BF16's dot product, which multiplies bfloat16 pairs into float32 sums at twice the
// float32 FMA rate (CPUs without it widen the pairs to float32 in registers: the same sums, in float32). In
// bfloat16 the hidden rows are rounded to bfloat16 once, as the reference's bfloat16 ops round them.
#include "simd.h"

#include <atomic>

namespace {

constexpr int NR = 16;  // output columns per panel; a unit is a register tile of two panels
#ifdef NANOINFER_AVX512
constexpr int MR = 12;  // rows per register tile (csrc/gemm.cpp's AVX-512 tile: 12 rows x 2 panels)
#else
constexpr int MR = 6;
#endif
constexpr int64_t kChunkBytes = 1 << 20;  // one chunk of an expert's packed rows, at most: stays in L2 (2 MB)
// A unit's cost is (rows + kPanelCost) for each panel: streaming a panel from memory takes about as long as
// multiplying this many rows by it, so units of an expert hit by one token are not counted as free.
constexpr int64_t kPanelCost = 16;
constexpr int64_t RUN_DIV = 2;  // a thread's run of units: 1 / (RUN_DIV * threads) of the cost left...
constexpr int64_t MIN_RUN = 2;  // ...and at least this many units
// Tokens go in passes whose per-pair buffers (hidden rows, down-projection rows) take at most this many bytes;
// a pass reads the experts' weights again, which a pass of this size hides behind its FMAs.
constexpr int64_t kPassBytes = 128 << 20;

constexpr int64_t kMaxTopK = 64;

enum Activation : int64_t { kSilu = 0, kGeluTanh = 1, kSwigluOai = 2 };

// Per weight dtype: what a packed row of x (the A operand) holds per k-step, and how many k a step covers.
template <typename T> struct Layout;
template <> struct Layout<float> {
  using A = float;
  static constexpr int KP = 1;
};
template <> struct Layout<at::BFloat16> {
  using A = uint32_t;  // two bfloat16 inputs, k even in the low half
  static constexpr int KP = 2;
};
inline int64_t steps_of(int64_t K, int kp) { return (K + kp - 1) / kp; }

// A tile's sums: row r's panel j at acc[r][16 j ..].
using Acc = float[MR][2 * NR];

#if defined(NANOINFER_AVX512)
// float32: gemm.cpp's register tile (simd.h's fma_tile_12x2) over R packed rows and NPT panels at b.
template <int R, int NPT>
inline void tile(const float* __restrict a, const float* __restrict b, int64_t steps, Prefetch pf, Acc& acc) {
  const float* __restrict b1 = b + steps * NR;
  PrefetchWalk walk(pf, b);
  fma_tile_12x2<R, NPT>(
      steps,
      [&](int64_t k) {
        walk.next();
        _mm_prefetch(reinterpret_cast<const char*>(b + (k + kL1Ahead) * NR), _MM_HINT_T0);
        if constexpr (NPT == 2) _mm_prefetch(reinterpret_cast<const char*>(b1 + (k + kL1Ahead) * NR), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(a + (k + kL1Ahead) * R), _MM_HINT_T0);
      },
      [&](int r, int64_t k) { return a[k * R + r]; },
      [&](int j, int64_t k) { return _mm512_loadu_ps((j ? b1 : b) + k * NR); },
      [&](int r, int j, __m512 sum) { _mm512_store_ps(acc[r] + j * NR, sum); });
}

#if defined(__AVX512BF16__)
// bfloat16: the same tile with AVX512-BF16's dot product: each k-step multiplies a pair of inputs (one 32-bit
// broadcast) by the pair-interleaved weights of 16 columns and adds both products into the float32 sums.
template <int R, int NPT>
inline void tile(const uint32_t* __restrict a, const at::BFloat16* __restrict b, int64_t steps, Prefetch pf, Acc& acc) {
  const at::BFloat16* __restrict b1 = b + steps * 2 * NR;
  PrefetchWalk walk(pf, b);
  const __m512 z = _mm512_setzero_ps();
#define MOE_INIT(r) __m512 c##r##_0 = z, c##r##_1 = z;
  MOE_INIT(0) MOE_INIT(1) MOE_INIT(2) MOE_INIT(3) MOE_INIT(4) MOE_INIT(5)
  MOE_INIT(6) MOE_INIT(7) MOE_INIT(8) MOE_INIT(9) MOE_INIT(10) MOE_INIT(11)
#undef MOE_INIT
  for (int64_t k = 0; k < steps; ++k) {
    walk.next();
    _mm_prefetch(reinterpret_cast<const char*>(b + (k + kL1Ahead) * 2 * NR), _MM_HINT_T0);
    if constexpr (NPT == 2) _mm_prefetch(reinterpret_cast<const char*>(b1 + (k + kL1Ahead) * 2 * NR), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(a + (k + kL1Ahead) * R), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b + k * 2 * NR);
    const __m512bh w1 = NPT == 2 ? (__m512bh)_mm512_loadu_si512(b1 + k * 2 * NR) : w0;
#define MOE_ROW(r)                                                              \
  if constexpr (R > r) {                                                        \
    const __m512bh av = (__m512bh)_mm512_set1_epi32((int)a[k * R + r]);         \
    c##r##_0 = _mm512_dpbf16_ps(c##r##_0, av, w0);                              \
    if constexpr (NPT == 2) c##r##_1 = _mm512_dpbf16_ps(c##r##_1, av, w1);      \
  }
    MOE_ROW(0) MOE_ROW(1) MOE_ROW(2) MOE_ROW(3) MOE_ROW(4) MOE_ROW(5)
    MOE_ROW(6) MOE_ROW(7) MOE_ROW(8) MOE_ROW(9) MOE_ROW(10) MOE_ROW(11)
#undef MOE_ROW
  }
  const __m512 sums[12][2] = {{c0_0, c0_1}, {c1_0, c1_1}, {c2_0, c2_1}, {c3_0, c3_1},   {c4_0, c4_1},   {c5_0, c5_1},
                              {c6_0, c6_1}, {c7_0, c7_1}, {c8_0, c8_1}, {c9_0, c9_1}, {c10_0, c10_1}, {c11_0, c11_1}};
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NPT; ++j) _mm512_store_ps(acc[r] + j * NR, sums[r][j]);
}
#else
// bfloat16 without AVX512-BF16: each pair widened to float32 (exact), two k-steps of gemm.cpp's tile.
template <int R, int NPT>
inline void tile(const uint32_t* __restrict a, const at::BFloat16* __restrict b, int64_t steps, Prefetch pf, Acc& acc) {
  const at::BFloat16* __restrict b1 = b + steps * 2 * NR;
  PrefetchWalk walk(pf, b);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  fma_tile_12x2<R, NPT>(
      2 * steps,
      [&](int64_t k) {
        if (k % 2) return;
        walk.next();
      },
      [&](int r, int64_t k) {
        const uint32_t pair = a[k / 2 * R + r];
        uint32_t bits = k % 2 ? pair & 0xFFFF0000u : pair << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        return f;
      },
      [&](int j, int64_t k) {
        const __m512i w = _mm512_loadu_si512((j ? b1 : b) + k / 2 * 2 * NR);
        return _mm512_castsi512_ps(k % 2 ? _mm512_and_si512(w, high) : _mm512_slli_epi32(w, 16));
      },
      [&](int r, int j, __m512 sum) { _mm512_store_ps(acc[r] + j * NR, sum); });
}
#endif
#else
// Other CPUs: plain loops (the compiler vectorizes the 16 columns).
inline float a_value(const float* a, int64_t i, int) { return a[i]; }
inline float a_value(const uint32_t* a, int64_t i, int half) {
  const uint32_t bits = half ? a[i] & 0xFFFF0000u : a[i] << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float w_value(const float* b, int64_t s, int c, int) { return b[s * NR + c]; }
inline float w_value(const at::BFloat16* b, int64_t s, int c, int half) {
  return static_cast<float>(b[(s * NR + c) * 2 + half]);
}

template <int R, int NPT, typename A, typename W>
inline void tile(const A* a, const W* b, int64_t steps, Prefetch, Acc& acc) {
  constexpr int KP = std::is_same_v<W, float> ? 1 : 2;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * NR; ++c) acc[r][c] = 0.f;
  for (int j = 0; j < NPT; ++j) {
    const W* bj = b + j * steps * KP * NR;
    for (int64_t s = 0; s < steps; ++s)
      for (int half = 0; half < KP; ++half)
        for (int r = 0; r < R; ++r) {
          const float av = a_value(a, s * R + r, half);
          for (int c = 0; c < NR; ++c) acc[r][j * NR + c] += av * w_value(bj, s, c, half);
        }
  }
}
#endif

// Calls f(std::integral_constant<int, R>) for R = r (1..MR).
template <int R, typename F>
inline void with_rows(int r, F&& f) {
  if constexpr (R > 0) {
    if (r == R) return f(std::integral_constant<int, R>{});
    with_rows<R - 1>(r, f);
  }
}

// silu(g) * u, gelu_tanh(g) * u or gpt-oss's (clamp(u) + 1) * g' * sigmoid(alpha g'), g' = min(g, limit), as
// expert_activation in platforms/interface.py. gelu_tanh(g) = 0.5 g (1 + tanh(z)) = g * sigmoid(2 z) exactly.
inline float activate(float g, float u, int64_t act, float alpha, float limit) {
  if (act == kSilu) return g / (1.f + std::exp(-g)) * u;
  if (act == kGeluTanh) {
    const float z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return g / (1.f + std::exp(-2.f * z)) * u;
  }
  g = std::isnan(g) ? g : std::min(g, limit);
  u = std::isnan(u) ? u : std::max(std::min(u, limit), -limit);
  return (u + 1.f) * (g / (1.f + std::exp(-alpha * g)));
}

#if defined(NANOINFER_AVX512)
inline __m512 sigmoid16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}
inline __m512 activate16(__m512 g, __m512 u, int64_t act, float alpha, float limit) {
  if (act == kSilu) return silu_mul16(g, u);
  if (act == kGeluTanh) {
    const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 z = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                   _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
    return _mm512_mul_ps(_mm512_mul_ps(g, sigmoid16(_mm512_add_ps(z, z))), u);
  }
  const __m512 lim = _mm512_set1_ps(limit);
  g = _mm512_min_ps(lim, g);  // NaN stays NaN (min and max return their second operand on a NaN)
  u = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), lim), _mm512_min_ps(lim, u));
  const __m512 glu = _mm512_mul_ps(g, sigmoid16(_mm512_mul_ps(_mm512_set1_ps(alpha), g)));
  return _mm512_mul_ps(_mm512_add_ps(u, _mm512_set1_ps(1.f)), glu);
}
#endif

// The first 32-bit elements (floats, or bfloat16 pairs) of R gathered rows into dst[s * R + r] (a register tile's
// rows, k-major), 16 at a time for 4 rows, transposed 4 x 4 within each 128-bit lane as gemm.cpp's pack_rows does;
// returns how many elements it packed (the caller packs the rest).
inline int64_t transpose_rows(const char* const* rows, int R, int64_t n, void* dst) {
  int64_t s = 0;
#if defined(NANOINFER_AVX512)
  if (R % 4) return 0;
  float* out = static_cast<float*>(dst);
  for (; s + 16 <= n; s += 16)
    for (int g = 0; g < R; g += 4) {
      auto load = [&](int r) { return _mm512_loadu_ps(reinterpret_cast<const float*>(rows[g + r]) + s); };
      store_transposed_4x16(load(0), load(1), load(2), load(3), out + s * R + g, R);
    }
#else
  (void)rows, (void)R, (void)n, (void)dst;
#endif
  return s;
}

// A run of consecutive rows of one expert, in the sorted pair order; starts at a multiple of MR of the expert's
// rows (so register tiles of the two projections cover the same rows).
struct Chunk {
  int64_t expert, row0, rows;
};

// An expert's rows in chunks of at most kChunkBytes of packed rows, of equal size in whole tiles.
std::vector<Chunk> make_chunks(const std::vector<int64_t>& offsets, int64_t row_bytes) {
  const int64_t max_rows = std::max<int64_t>(MR, kChunkBytes / row_bytes / MR * MR);
  std::vector<Chunk> chunks;
  for (int64_t e = 0; e + 1 < (int64_t)offsets.size(); ++e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    if (!rows) continue;
    const int64_t n = (rows + max_rows - 1) / max_rows;
    const int64_t size = ((rows + n - 1) / n + MR - 1) / MR * MR;
    for (int64_t r = 0; r < rows; r += size) chunks.push_back({e, offsets[e] + r, std::min(size, rows - r)});
  }
  return chunks;
}

// One projection over every chunk: units (chunk c, tile q = panels 2q, 2q + 1) of P panels of `steps` k-steps,
// weights w [E, P, steps, 16 KP]. rows_of(c, buffer) -> chunk c's packed rows (packing them into `buffer` if
// needed; called again only when the chunk changes); epilogue(chunk, m, R, q, npanels, acc) takes a tile's sums.
template <typename W, typename A, typename RowsOf, typename Epilogue>
void run_projection(const std::vector<Chunk>& chunks, int64_t P, int64_t steps, const W* w, RowsOf&& rows_of,
                    Epilogue&& epilogue) {
  constexpr int KP = std::is_same_v<W, float> ? 1 : 2;
  const int64_t panel_elems = steps * KP * NR, panel_bytes = panel_elems * (int64_t)sizeof(W);
  const int64_t Q = (P + 1) / 2, C = (int64_t)chunks.size(), U = C * Q;
  if (!U) return;
  std::vector<int64_t> before(C + 1, 0);  // cost of the units of the chunks before c
  for (int64_t c = 0; c < C; ++c) before[c + 1] = before[c] + Q * (chunks[c].rows + kPanelCost);
  auto cost_before = [&](int64_t u) {
    const int64_t c = u / Q;
    return c >= C ? before[C] : before[c] + (u % Q) * (chunks[c].rows + kPanelCost);
  };
  const int threads = at::get_num_threads();
  std::atomic<int64_t> cursor{0};
  // -> the first unit of a run of `len` (the cost left / (RUN_DIV * threads), at least MIN_RUN units), or -1
  auto claim = [&](int64_t& len) {
    int64_t start = cursor.load(std::memory_order_relaxed), end;
    do {
      if (start >= U) return int64_t(-1);
      const int64_t base = cost_before(start);
      const int64_t target = std::max<int64_t>(1, (before[C] - base) / (RUN_DIV * threads));
      int64_t lo = start + 1, hi = U;  // the first end whose run costs at least target
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (cost_before(mid) - base >= target) hi = mid; else lo = mid + 1;
      }
      end = std::max(lo, std::min(U, start + MIN_RUN));
    } while (!cursor.compare_exchange_weak(start, end, std::memory_order_relaxed));
    len = end - start;
    return start;
  };
  auto panels_of = [&](int64_t u) { return w + chunks[u / Q].expert * P * panel_elems + (u % Q) * 2 * panel_elems; };
  #pragma omp parallel num_threads(threads)
  {
    static thread_local std::vector<A> buffer;
    int64_t packed = -1;  // the chunk whose rows `buffer` holds
    const A* rows_a = nullptr;
    alignas(64) Acc acc;
    int64_t len = 0, u0 = claim(len);
    while (u0 >= 0) {
      int64_t next_len = 0, next_u0 = -1;
      for (int64_t u = u0; u < u0 + len; ++u) {
        int64_t next = u + 1;
        if (next == u0 + len) next = next_u0 = claim(next_len);  // the next run, known before this unit runs
        const int64_t c = u / Q, q = u % Q;
        const Chunk& chunk = chunks[c];
        if (c != packed) rows_a = rows_of(c, buffer), packed = c;
        const int npanels = (int)std::min<int64_t>(2, P - 2 * q);
        const W* b = panels_of(u);
        const int64_t tiles = (chunk.rows + MR - 1) / MR;
        const int64_t lines = next >= 0 && chunk.rows >= kPrefetchMinRows
                                  ? (std::min<int64_t>(2, P - 2 * (next % Q)) * panel_bytes + 63) / 64 : 0;
        const char* next_b = next >= 0 ? reinterpret_cast<const char*>(panels_of(next)) : nullptr;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t m = t * MR;
          const int r = (int)std::min<int64_t>(MR, chunk.rows - m);
          // Each tile prefetches a share of the next panels in proportion to its rows (the time it computes), so
          // a chunk's short last tile does not issue its share in a burst.
          Prefetch pf;
          const int64_t first = lines * m / chunk.rows, last = lines * (m + r) / chunk.rows;
          if (last > first) {
            pf.line = next_b + 64 * first;
            pf.step = (static_cast<uint64_t>(last - first) << 32) / static_cast<uint64_t>(steps);
          }
          with_rows<MR>(r, [&](auto rr) {
            constexpr int R = decltype(rr)::value;
            if (npanels == 2)
              tile<R, 2>(rows_a + m * steps, b, steps, pf, acc);
            else
              tile<R, 1>(rows_a + m * steps, b, steps, pf, acc);
          });
          epilogue(chunk, m, r, q, npanels, acc);
        }
      }
      u0 = next_u0, len = next_len;
    }
  }
}

// Tokens [t0, t0 + T) of a call: route, both projections, the weighted sums into out.
template <typename T>
void run_pass(const T* x, const int64_t* ids, const float* weights, int64_t num_tokens, int64_t k, int64_t H, int64_t I,
              int64_t E, const T* w13, const T* w2, const float* b13, const float* b2, int64_t act, float alpha,
              float limit, T* out) {
  using A = typename Layout<T>::A;
  constexpr int KP = Layout<T>::KP;
  const int64_t N = num_tokens * k, steps1 = steps_of(H, KP), steps2 = steps_of(I, KP);
  const int64_t P1 = (I + NR / 2 - 1) / (NR / 2), P2 = (H + NR - 1) / NR;
  // Route: a stable counting sort of the pairs by expert.
  std::vector<int64_t> offsets(E + 1, 0), slot_of(N), token_of(N);
  std::vector<float> weight_of(N);
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < E, "fused_moe: expert id ", ids[i], " out of range for ", E, " experts");
    ++offsets[ids[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  {
    std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1);
    for (int64_t i = 0; i < N; ++i) {
      const int64_t slot = cursor[ids[i]]++;
      // rounded to x's dtype, as the reference multiplies by them
      slot_of[i] = slot, token_of[slot] = i / k, weight_of[slot] = static_cast<float>(static_cast<T>(weights[i]));
    }
  }
  // The caller's buffers, kept across calls: a fresh allocation would be page-faulted in every time.
  static thread_local std::vector<A> hidden;  // [N, steps2] in MR-row blocks, k-major (the down projection's rows)
  static thread_local std::vector<float> down;  // [N, H]: each pair's down projection (+ bias)
  if ((int64_t)hidden.size() < N * steps2) hidden.resize(N * steps2);
  if ((int64_t)down.size() < N * H) down.resize(N * H);
  A* h = hidden.data();
  float* y = down.data();

  // Gate/up: each chunk's rows of x gathered and packed (MR-row blocks, k-major) as the tile reads them.
  const auto chunks1 = make_chunks(offsets, steps1 * (int64_t)sizeof(A));
  const int64_t max_rows1 = std::max<int64_t>(MR, kChunkBytes / (steps1 * (int64_t)sizeof(A)) / MR * MR);
  auto pack_x = [&](int64_t c, std::vector<A>& buffer) -> const A* {
    if ((int64_t)buffer.size() < max_rows1 * steps1) buffer.resize(max_rows1 * steps1);
    const Chunk& chunk = chunks1[c];
    A* a = buffer.data();
    const int64_t whole = H / KP;  // 32-bit elements of a row: floats, or whole bfloat16 pairs
    for (int64_t m = 0; m < chunk.rows; m += MR) {
      const int R = (int)std::min<int64_t>(MR, chunk.rows - m);
      A* block = a + m * steps1;
      const T* rows[MR];
      for (int r = 0; r < R; ++r) rows[r] = x + token_of[chunk.row0 + m + r] * H;
      const int64_t s0 = transpose_rows(reinterpret_cast<const char* const*>(rows), R, whole, block);
      for (int r = 0; r < R; ++r) {
        if constexpr (KP == 1) {
          for (int64_t s = s0; s < whole; ++s) block[s * R + r] = rows[r][s];
        } else {
          const uint16_t* bits = reinterpret_cast<const uint16_t*>(rows[r]);
          for (int64_t s = s0; s < whole; ++s) block[s * R + r] = bits[2 * s] | (uint32_t)bits[2 * s + 1] << 16;
          if (H % 2) block[whole * R + r] = bits[H - 1];  // the zero-padded last pair
        }
      }
    }
    return a;
  };
  auto gate_up_epilogue = [&](const Chunk& chunk, int64_t m, int R, int64_t q, int, const Acc& acc) {
    const int64_t o0 = q * NR;  // this tile's 16 outputs: panel 2q's 8 then panel 2q + 1's 8
    const int n = (int)std::min<int64_t>(NR, I - o0);
    const float* bg = b13 ? b13 + chunk.expert * 2 * I + o0 : nullptr;
    const float* bu = b13 ? bg + I : nullptr;
    A* block = h + (chunk.row0 + m) * steps2;  // this tile's MR-row block of hidden rows
    for (int r = 0; r < R; ++r) {
      alignas(64) float hv[NR];
#if defined(NANOINFER_AVX512)
      const __m512 p0 = _mm512_load_ps(acc[r]), p1 = _mm512_load_ps(acc[r] + NR);
      __m512 g = _mm512_shuffle_f32x4(p0, p1, _MM_SHUFFLE(1, 0, 1, 0));
      __m512 u = _mm512_shuffle_f32x4(p0, p1, _MM_SHUFFLE(3, 2, 3, 2));
      if (bg) {
        const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
        g = _mm512_add_ps(g, _mm512_maskz_loadu_ps(mask, bg));
        u = _mm512_add_ps(u, _mm512_maskz_loadu_ps(mask, bu));
      }
      _mm512_store_ps(hv, activate16(g, u, act, alpha, limit));
#else
      for (int i = 0; i < n; ++i) {
        const int lane = i % 8 + (i / 8) * NR;  // panel i / 8, its gate lane; the up lane is 8 further
        hv[i] = activate(acc[r][lane] + (bg ? bg[i] : 0.f), acc[r][lane + 8] + (bu ? bu[i] : 0.f), act, alpha, limit);
      }
#endif
      if constexpr (KP == 1) {
        for (int i = 0; i < n; ++i) block[(o0 + i) * R + r] = hv[i];
      } else {
        uint16_t* bits = reinterpret_cast<uint16_t*>(block);
        for (int i = 0; i < n; ++i) {
          const int64_t o = o0 + i;
          bits[((o / 2) * R + r) * 2 + o % 2] = static_cast<at::BFloat16>(hv[i]).x;
        }
        if (I % 2 && o0 + n == I) bits[((I / 2) * R + r) * 2 + 1] = 0;  // the zero-padded last pair
      }
    }
  };
  run_projection<T, A>(chunks1, P1, steps1, w13, pack_x, gate_up_epilogue);

  // Down: the hidden rows are already packed; one float32 row per pair.
  const auto chunks2 = make_chunks(offsets, steps2 * (int64_t)sizeof(A));
  auto hidden_rows = [&](int64_t c, std::vector<A>&) -> const A* { return h + chunks2[c].row0 * steps2; };
  auto down_epilogue = [&](const Chunk& chunk, int64_t m, int R, int64_t q, int, const Acc& acc) {
    const int64_t c0 = q * 2 * NR;
    const int n = (int)std::min<int64_t>(2 * NR, H - c0);
    const float* bias = b2 ? b2 + chunk.expert * H + c0 : nullptr;
    for (int r = 0; r < R; ++r) {
      float* dst = y + (chunk.row0 + m + r) * H + c0;
#if defined(NANOINFER_AVX512)
      for (int j = 0; j * NR < n; ++j) {
        const int nj = std::min(NR, n - j * NR);
        const __mmask16 mask = static_cast<__mmask16>((1u << nj) - 1);
        __m512 v = _mm512_load_ps(acc[r] + j * NR);
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + j * NR));
        _mm512_mask_storeu_ps(dst + j * NR, mask, v);
      }
#else
      for (int i = 0; i < n; ++i) dst[i] = acc[r][i] + (bias ? bias[i] : 0.f);
#endif
    }
  };
  run_projection<T, A>(chunks2, P2, steps2, w2, hidden_rows, down_epilogue);

  // Each token's weighted sum of its pairs' rows, in expert order (its pairs' slots ascending), rounded once.
  const int threads = at::get_num_threads();
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < num_tokens; ++t) {
    int64_t slots[kMaxTopK];
    const int64_t kk = k;
    for (int64_t j = 0; j < kk; ++j) {
      int64_t s = slot_of[t * k + j], i = j;
      for (; i > 0 && slots[i - 1] > s; --i) slots[i] = slots[i - 1];
      slots[i] = s;
    }
    T* dst = out + t * H;
    int64_t c = 0;
#if defined(NANOINFER_AVX512)
    for (; c < H; c += NR) {
      const int nc = (int)std::min<int64_t>(NR, H - c);
      const __mmask16 mask = static_cast<__mmask16>((1u << nc) - 1);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < kk; ++j)
        sum = _mm512_add_ps(sum, _mm512_mul_ps(_mm512_set1_ps(weight_of[slots[j]]),
                                               _mm512_maskz_loadu_ps(mask, y + slots[j] * H + c)));
      if constexpr (std::is_same_v<T, float>) {
        _mm512_mask_storeu_ps(dst + c, mask, sum);
      } else {
        alignas(64) float row[NR];
        _mm512_store_ps(row, sum);
        for (int i = 0; i < nc; ++i) dst[c + i] = static_cast<T>(row[i]);
      }
    }
#endif
    for (; c < H; ++c) {
      float sum = 0.f;
      for (int64_t j = 0; j < kk; ++j) sum += weight_of[slots[j]] * y[slots[j] * H + c];
      dst[c] = static_cast<T>(sum);
    }
  }
}

}  // namespace

// [E, N, K] expert weights (gated: each expert's [2I, K] gate rows then up rows) -> per expert, panels of 16
// columns, k-major (gated: 8 gate and the 8 matching up columns a panel): float32 [E, ceil(N/16), K, 16] as
// pack_linear_weight / pack_gated_weight lay out one expert, bfloat16 [E, P, ceil(K/2), 32] with each column's
// k-steps in pairs. Zero past N and K; on huge pages, as decode streams them every step.
torch::Tensor pack_moe_weights(const torch::Tensor& weight, bool gated) {
  TORCH_CHECK(weight.dim() == 3 && (!gated || weight.size(1) % 2 == 0),
              "pack_moe_weights: an [E, N, K] weight (gated: N = 2 I)");
  const auto w = weight.contiguous();
  const int64_t E = w.size(0), K = w.size(2), N = gated ? w.size(1) / 2 : w.size(1);
  const int64_t cols = gated ? NR / 2 : NR, P = (N + cols - 1) / cols;
  const bool pairs = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(pairs || w.scalar_type() == at::kFloat, "pack_moe_weights: float32 or bfloat16, got ", w.scalar_type());
  const int KP = pairs ? 2 : 1;
  const int64_t steps = steps_of(K, KP);
  auto packed = zeros_on_huge_pages({E, P, steps, NR * KP}, w.scalar_type());
  with_typed<false>(w, "pack_moe_weights", [&](auto* src) {
    using T = std::remove_pointer_t<decltype(src)>;
    T* dst = packed.data_ptr<T>();
    at::parallel_for(0, E * P, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t e = i / P, p = i % P;
        T* panel = dst + i * steps * NR * KP;
        for (int64_t j = 0; j < NR; ++j) {
          // Panel column j: output p * 16 + j, or gated gate row p * 8 + j (j < 8) / up row I + p * 8 + j - 8.
          const int64_t out = gated ? p * cols + j % cols : p * NR + j;
          if (out >= N) continue;
          const T* row = src + (e * w.size(1) + (gated && j >= cols ? N + out : out)) * K;
          for (int64_t kk = 0; kk < K; ++kk) panel[((kk / KP) * NR + j) * KP + kk % KP] = row[kk];
        }
      }
    });
  });
  return packed;
}

// sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for x [T, H] (float32 or bfloat16, the weights'
// dtype), with w13 and w2 from pack_moe_weights (w13 gated), biases float32 [E, 2I] and [E, H] or none.
torch::Tensor fused_moe(const torch::Tensor& x, const torch::Tensor& topk_ids, const torch::Tensor& topk_weights,
                        const torch::Tensor& w13, const torch::Tensor& w2, const c10::optional<torch::Tensor>& b13,
                        const c10::optional<torch::Tensor>& b2, int64_t intermediate_size, int64_t activation,
                        double alpha, double limit) {
  TORCH_CHECK(x.dim() == 2, "fused_moe: x is [tokens, hidden]");
  TORCH_CHECK(x.scalar_type() == w13.scalar_type() && x.scalar_type() == w2.scalar_type(),
              "fused_moe: x is ", x.scalar_type(), " but the weights ", w13.scalar_type());
  TORCH_CHECK(activation >= kSilu && activation <= kSwigluOai, "fused_moe: unknown activation ", activation);
  const int64_t T = x.size(0), H = x.size(1), I = intermediate_size, E = w13.size(0);
  const int KP = x.scalar_type() == at::kBFloat16 ? 2 : 1;
  TORCH_CHECK(w13.dim() == 4 && w13.size(1) == (I + NR / 2 - 1) / (NR / 2) && w13.size(2) == steps_of(H, KP) &&
                  w13.size(3) == NR * KP && w13.is_contiguous(),
              "fused_moe: w13 is not pack_moe_weights(gated=True) of [E, 2 * ", I, ", ", H, "]");
  TORCH_CHECK(w2.dim() == 4 && w2.size(0) == E && w2.size(1) == (H + NR - 1) / NR && w2.size(2) == steps_of(I, KP) &&
                  w2.size(3) == NR * KP && w2.is_contiguous(),
              "fused_moe: w2 is not pack_moe_weights of [E, ", H, ", ", I, "]");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T && topk_ids.scalar_type() == at::kLong,
              "fused_moe: topk_ids is int64 [tokens, k]");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.scalar_type() == at::kFloat,
              "fused_moe: topk_weights is float32 [tokens, k]");
  auto bias = [&](const c10::optional<torch::Tensor>& b, int64_t n, const char* name) -> torch::Tensor {
    if (!b.has_value() || !b->defined()) return {};
    TORCH_CHECK(b->scalar_type() == at::kFloat && b->numel() == E * n && b->is_contiguous(), "fused_moe: ", name,
                " is float32 [", E, ", ", n, "]");
    return *b;
  };
  const auto bias13 = bias(b13, 2 * I, "b13"), bias2 = bias(b2, H, "b2");
  const auto xs = x.contiguous(), ids = topk_ids.contiguous(), weights = topk_weights.contiguous();
  auto out = torch::empty({T, H}, x.options());
  const int64_t k = ids.size(1);
  TORCH_CHECK(k <= kMaxTopK, "fused_moe: at most ", kMaxTopK, " experts a token, got ", k);
  if (T == 0 || k == 0) return out.zero_();
  const float* b13p = bias13.defined() ? bias13.data_ptr<float>() : nullptr;
  const float* b2p = bias2.defined() ? bias2.data_ptr<float>() : nullptr;
  with_typed<false>(xs, "fused_moe", [&](auto* xp) {
    using T_ = std::remove_pointer_t<decltype(xp)>;
    using A = typename Layout<T_>::A;
    const int64_t pair_bytes = steps_of(I, KP) * (int64_t)sizeof(A) + H * (int64_t)sizeof(float);
    const int64_t pass = std::max<int64_t>(1, kPassBytes / (k * pair_bytes));
    for (int64_t t0 = 0; t0 < T; t0 += pass)
      run_pass<T_>(xp + t0 * H, ids.data_ptr<int64_t>() + t0 * k, weights.data_ptr<float>() + t0 * k,
                   std::min(pass, T - t0), k, H, I, E, w13.data_ptr<T_>(), w2.data_ptr<T_>(), b13p, b2p, activation,
                   (float)alpha, (float)limit, out.data_ptr<T_>() + t0 * H);
  });
  return out;
}
