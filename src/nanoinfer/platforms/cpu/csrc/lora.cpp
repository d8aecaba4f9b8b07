// Batched multi-LoRA for one linear layer on the CPU (Punica's SGMV / BGMV): y[t] += (x[t] A_l^T) B_l for each
// row's own adapter slot l = row_slots[t] (-1: none), in place; float32 or bfloat16, float32 sums, h rounded to x's
// dtype and y rounded once, as Platform.add_lora.
//
// The shape of it:
// - the rows are grouped by slot (a stable counting sort of their indices; no row is copied), so an adapter's A and
//   B are read once per tile of its rows whether they are contiguous (a prompt) or interleaved (decode); a slot's
//   rows go in the fewest tiles of even size;
// - shrink, h = x A^T ([rows, S R]): A's rank rows and x's rows are both contiguous in k, so neither is packed. A
//   register tile of 6 rows x 4 rank rows loads 6 vectors of x and 4 of A per k-step for 24 FMAs (each x vector
//   serves 4 rank rows, each A vector 6 rows) and folds each sum's lanes at the end; the last k short of a vector
//   is one masked step (AVX-512). In bfloat16 on AVX512-BF16 one dot-product instruction multiplies 32 k (pairs of
//   bfloat16, exact products, float32 sums; subnormals read as 0). h is rounded to x's dtype;
// - expand, y += h_s B per slice s: B [R, N] is contiguous in the output columns, so a tile of 12 rows x 32 columns
//   (simd.h's GEMM tile; 6 x 16 on AVX2) broadcasts h and multiplies B's rows; the sums are added to y, rounded once;
// - one parallel region runs both phases, each split into work units, shrink (tile, 4 rank rows) and expand (tile,
//   32 columns of one slice), statically: a thread's units are consecutive, so in decode each thread reads only
//   some adapters' weights. A call too small to pay for waking a second thread runs on one.
#include "simd.h"

#include <type_traits>

namespace {

constexpr int kShrinkRows = 6;   // rows per shrink tile
constexpr int kShrinkRanks = 4;  // rank rows per shrink tile
#if defined(NANOINFER_AVX512)
using Vec = __m512;
constexpr int kLanes = 16;
constexpr int kExpandRows = 12;  // rows per expand tile: 24 of the 32 zmm registers accumulate
#elif defined(NANOINFER_AVX2)
using Vec = __m256;
constexpr int kLanes = 8;
constexpr int kExpandRows = 6;  // 12 of the 16 ymm registers accumulate
#else
constexpr int kLanes = 8;
constexpr int kExpandRows = 4;
#endif
constexpr int kBlock = 2 * kLanes;  // output columns per expand unit
// Below this many FLOPs a call runs on one thread: waking the others costs more than they save.
constexpr int64_t kParallelFlops = 1 << 19;

using ShrinkSums = float[kShrinkRows][kShrinkRanks];

// Up to `rows` consecutive rows of one slot, in the slot-sorted order.
struct Tile {
  int64_t slot, row0, rows;
};
// Columns col0 .. col0 + cols - 1 of one slice.
struct Block {
  int64_t slice, col0, cols;
};

#ifdef NANOINFER_AVX2
// One vector of float32 lanes: loads widen bfloat16 (exact), stores round to it (to nearest even).
#if defined(NANOINFER_AVX512)
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const bf16* p) { return load16(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline void vstore(bf16* p, Vec v) { store16(p, rnd16(v)); }
inline __m256 fold(Vec v) { return _mm256_add_ps(low8(v), high8(v)); }  // 8 lanes with the same sum
// The lanes of mask m loaded, the others 0 (never read); bfloat16 needs AVX512-BW's 16-bit masks.
inline Vec vload_masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
#if defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kMaskedBf16 = true;
inline Vec vload_masked(const bf16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
#else
constexpr bool kMaskedBf16 = false;
inline Vec vload_masked(const bf16* p, __mmask16) { return load16(p); }  // not called
#endif
#else
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const bf16* p) { return load8(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline void vstore(bf16* p, Vec v) { store8(p, rnd8(v)); }
inline __m256 fold(Vec v) { return v; }
#endif

// The lane sums of a, b, c, d as one vector of 4.
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // each 128-bit half: 4 partials
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// Each row's sums with JT (1..4) rank rows into sums[r][0..3] (the unused ones 0).
template <int RT, int JT, typename V, typename Fold>
inline void store_sums(const V (&s)[RT][JT], Fold&& fold_of, ShrinkSums& sums) {
  for (int r = 0; r < RT; ++r) {
    __m256 folded[kShrinkRanks] = {};
    for (int j = 0; j < JT; ++j) folded[j] = fold_of(s[r][j]);
    _mm_storeu_ps(sums[r], sum4(folded[0], folded[1], folded[2], folded[3]));
  }
}

// The dot products of RT rows and JT rank rows, vector by vector: step(s, x_vectors, a_vector) for each k-step,
// load(p, k) (a full vector at p + k) and load_tail(p, k) (the vector at p + k with zeros past K) give the vectors.
template <int RT, int JT, int STEP, typename T, typename Load, typename LoadTail, typename Step, typename Fold>
inline int64_t dot_tile(const T* const* xr, const T* a, int64_t K, bool tail, Load&& load, LoadTail&& load_tail,
                        Step&& step, Fold&& fold_of, ShrinkSums& sums) {
  using V = decltype(load(a, 0));
  using S = decltype(step(std::declval<Vec>(), load(a, 0), load(a, 0)));
  S s[RT][JT];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < JT; ++j) s[r][j] = S{};
  auto k_step = [&](int64_t k, auto&& ld) {
    V xv[RT];
    for (int r = 0; r < RT; ++r) xv[r] = ld(xr[r], k);
    for (int j = 0; j < JT; ++j) {
      const V av = ld(a + j * K, k);
      for (int r = 0; r < RT; ++r) s[r][j] = step(s[r][j], xv[r], av);
    }
  };
  int64_t k = 0;
  for (; k + STEP <= K; k += STEP) k_step(k, load);
  if (tail && k < K) k_step(k, load_tail), k = K;
  store_sums<RT, JT>(s, fold_of, sums);
  return k;
}
#endif

// sums[r][j] = x_r . a_j over k < K for RT rows of x (at xr[r]) and JT rank rows of A (at a + j * K).
template <int RT, int JT, typename T>
inline void shrink_tile(const T* const* xr, const T* __restrict a, int64_t K, ShrinkSums& sums) {
  int64_t k = 0;
#if defined(NANOINFER_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    // 32 k a step: each lane multiplies a pair of bfloat16 into its float32 sum; the last k short of 32 as one
    // step with zeros past K (their products are 0).
    const __mmask32 tail_mask = (__mmask32)((uint64_t(1) << (K % 32)) - 1);
    k = dot_tile<RT, JT, 32>(
        xr, a, K, true, [](const bf16* p, int64_t k) { return (__m512bh)_mm512_loadu_si512(p + k); },
        [&](const bf16* p, int64_t k) { return (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, p + k); },
        [](__m512 acc, __m512bh x, __m512bh w) { return _mm512_dpbf16_ps(acc, x, w); },
        [](__m512 v) { return fold(v); }, sums);
  } else
#endif
  {
#if defined(NANOINFER_AVX512)
    // The last k short of a vector as one step with zeros past K (bfloat16: where AVX512-BW loads 16-bit lanes).
    const __mmask16 tail_mask = (__mmask16)((1u << (K % 16)) - 1);
    constexpr bool masked = std::is_same_v<T, float> || kMaskedBf16;
    k = dot_tile<RT, JT, 16>(
        xr, a, K, masked, [](const T* p, int64_t k) { return vload(p + k); },
        [&](const T* p, int64_t k) { return vload_masked(p + k, tail_mask); },
        [](Vec acc, Vec x, Vec w) { return vfma(x, w, acc); }, [](Vec v) { return fold(v); }, sums);
#elif defined(NANOINFER_AVX2)
    k = dot_tile<RT, JT, 8>(
        xr, a, K, false, [](const T* p, int64_t k) { return vload(p + k); },
        [](const T* p, int64_t k) { return vload(p + k); }, [](Vec acc, Vec x, Vec w) { return vfma(x, w, acc); },
        [](Vec v) { return fold(v); }, sums);
#else
    for (int r = 0; r < RT; ++r)
      for (int j = 0; j < kShrinkRanks; ++j) sums[r][j] = 0.f;
#endif
  }
  for (; k < K; ++k)  // the last k short of a vector (AVX2)
    for (int r = 0; r < RT; ++r)
      for (int j = 0; j < JT; ++j) sums[r][j] += to_f(xr[r][k]) * to_f(a[j * K + k]);
}

// y_row[c] += sum[c] for c < cols (at most one vector's), rounded once to y's dtype.
template <typename T>
inline void add_into(T* __restrict y_row, const float* __restrict sum, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) y_row[c] = static_cast<T>(to_f(y_row[c]) + sum[c]);
}

// y_r[c] += sum_k h_r[k] b[k][c] (the sum over k < R first, then y added and rounded once) for RT rows of h (at
// h + r * ldh) and y (at y_rows[r]) and the first `cols` of W * kLanes columns of B (row k at b + k * ldb).
template <int RT, int W, typename T>
inline void expand_tile(const float* __restrict h, int64_t ldh, const T* __restrict b, int64_t ldb, int64_t R,
                        T* const* y_rows, int64_t cols) {
#ifdef NANOINFER_AVX2
  auto out = [&](int r, int j, Vec sum) {
    T* dst = y_rows[r] + j * kLanes;
    if ((j + 1) * kLanes <= cols) return vstore(dst, vadd(vload(dst), sum));
    alignas(64) float part[kLanes];
    vstore(part, sum);
    add_into(dst, part, cols - j * kLanes);
  };
#endif
#if defined(NANOINFER_AVX512)
  fma_tile_12x2<RT, W>(
      R, [](int64_t) {}, [&](int r, int64_t k) { return h[r * ldh + k]; },
      [&](int j, int64_t k) { return vload(b + k * ldb + j * kLanes); }, out);
#elif defined(NANOINFER_AVX2)
  __m256 s[RT][W];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < W; ++j) s[r][j] = vzero();
  for (int64_t k = 0; k < R; ++k) {
    __m256 w[W];
    for (int j = 0; j < W; ++j) w[j] = vload(b + k * ldb + j * kLanes);
    for (int r = 0; r < RT; ++r) {
      const __m256 hv = _mm256_set1_ps(h[r * ldh + k]);
      for (int j = 0; j < W; ++j) s[r][j] = vfma(hv, w[j], s[r][j]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < W; ++j) out(r, j, s[r][j]);
#else
  for (int r = 0; r < RT; ++r) {
    float sum[W * kLanes] = {};
    for (int64_t k = 0; k < R; ++k)
      for (int c = 0; c < W * kLanes; ++c) sum[c] += h[r * ldh + k] * to_f(b[k * ldb + c]);
    add_into(y_rows[r], sum, cols);
  }
#endif
}

// Calls f(std::integral_constant<int, R>) for R = r (1..N).
template <int N, typename F>
inline void with_count(int r, F&& f) {
  if constexpr (N > 0) {
    if (r == N) return f(std::integral_constant<int, N>{});
    with_count<N - 1>(r, f);
  }
}

// Each slot's rows (start[l] .. start[l + 1] of the sorted order) in the fewest tiles of at most `max_rows` rows,
// of even sizes (16 rows: 8 + 8, not 12 + 4, whose short tile would run at a third of the FMA rate).
std::vector<Tile> tiles_of(const std::vector<int64_t>& start, int64_t max_rows) {
  std::vector<Tile> tiles;
  for (int64_t l = 0; l + 1 < (int64_t)start.size(); ++l) {
    const int64_t rows = start[l + 1] - start[l], n = (rows + max_rows - 1) / max_rows;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t m0 = start[l] + rows * i / n, m1 = start[l] + rows * (i + 1) / n;
      tiles.push_back({l, m0, m1 - m0});
    }
  }
  return tiles;
}

template <typename T>
void run(T* y, int64_t ldy, const T* x, int64_t ldx, const T* A, const T* B, const int32_t* row_slots, int64_t num_rows,
         int64_t L, int64_t R, int64_t K, int64_t N, const std::vector<int64_t>& slice_offsets) {
  const int64_t S = (int64_t)slice_offsets.size() - 1, SR = S * R;
  // Group: a stable counting sort of the rows with an adapter by slot.
  std::vector<int64_t> start(L + 1, 0);
  for (int64_t t = 0; t < num_rows; ++t) {
    const int32_t slot = row_slots[t];
    TORCH_CHECK(slot < L, "add_lora: row ", t, " has slot ", slot, " of ", L, " adapters");
    if (slot >= 0) ++start[slot + 1];
  }
  for (int64_t l = 0; l < L; ++l) start[l + 1] += start[l];
  const int64_t active = start[L];
  if (!active || !SR) return;
  std::vector<int64_t> order(active);
  {
    std::vector<int64_t> cursor(start.begin(), start.end() - 1);
    for (int64_t t = 0; t < num_rows; ++t)
      if (row_slots[t] >= 0) order[cursor[row_slots[t]]++] = t;
  }
  // h [active, S R] in the sorted order; the caller's buffer, kept across calls (a fresh one would be
  // page-faulted in every time) and taken here: inside the parallel region it would be each worker's own.
  static thread_local std::vector<float> h_buffer;
  if ((int64_t)h_buffer.size() < active * SR) h_buffer.resize(active * SR);
  float* h = h_buffer.data();

  const auto shrink_tiles = tiles_of(start, kShrinkRows), expand_tiles = tiles_of(start, kExpandRows);
  std::vector<Block> blocks;
  int64_t columns = 0;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t c = slice_offsets[s]; c < slice_offsets[s + 1]; c += kBlock) {
      blocks.push_back({s, c, std::min<int64_t>(kBlock, slice_offsets[s + 1] - c)});
      columns += blocks.back().cols;
    }
  const int64_t groups = (SR + kShrinkRanks - 1) / kShrinkRanks;
  const int64_t shrink_units = (int64_t)shrink_tiles.size() * groups;
  const int64_t num_blocks = (int64_t)blocks.size(), expand_units = (int64_t)expand_tiles.size() * num_blocks;
  const int threads = 2 * active * (K * SR + R * columns) < kParallelFlops ? 1 : at::get_num_threads();

  #pragma omp parallel num_threads(threads)
  {
    #pragma omp for schedule(static)
    for (int64_t u = 0; u < shrink_units; ++u) {
      // Unit (tile, group of rank rows), groups fastest: the tile's rows of x stay in L1 while A streams past.
      const Tile& tile = shrink_tiles[u / groups];
      const int64_t j0 = (u % groups) * kShrinkRanks;
      const int rt = (int)tile.rows, jt = (int)std::min<int64_t>(kShrinkRanks, SR - j0);
      const T* xr[kShrinkRows];
      for (int r = 0; r < rt; ++r) xr[r] = x + order[tile.row0 + r] * ldx;
      const T* a = A + (tile.slot * SR + j0) * K;
      ShrinkSums sums;
      with_count<kShrinkRows>(rt, [&](auto rows) {
        with_count<kShrinkRanks>(jt, [&](auto ranks) {
          shrink_tile<decltype(rows)::value, decltype(ranks)::value>(xr, a, K, sums);
        });
      });
      for (int r = 0; r < rt; ++r)
        for (int j = 0; j < jt; ++j)  // rounded to x's dtype, as the reference's h
          h[(tile.row0 + r) * SR + j0 + j] = to_f(static_cast<T>(sums[r][j]));
    }
    // (the loop's barrier: every h is written before any is read)
    static thread_local std::vector<T> padded;  // a block short of kBlock columns, zero-padded: [R, kBlock]
    #pragma omp for schedule(static)
    for (int64_t u = 0; u < expand_units; ++u) {
      // Unit (tile, block of columns), blocks fastest: the tile's rows of h stay in L1 while B streams past.
      const Tile& tile = expand_tiles[u / num_blocks];
      const Block& block = blocks[u % num_blocks];
      const T* b = B + tile.slot * R * N + block.col0;
      int64_t ldb = N;
      if (block.cols < kBlock) {
        if ((int64_t)padded.size() < R * kBlock) padded.resize(R * kBlock);
        std::fill(padded.begin(), padded.begin() + R * kBlock, static_cast<T>(0.f));
        for (int64_t k = 0; k < R; ++k) std::copy(b + k * N, b + k * N + block.cols, padded.data() + k * kBlock);
        b = padded.data(), ldb = kBlock;
      }
      T* y_rows[kExpandRows];
      for (int64_t r = 0; r < tile.rows; ++r) y_rows[r] = y + order[tile.row0 + r] * ldy + block.col0;
      const float* hs = h + tile.row0 * SR + block.slice * R;
      with_count<kExpandRows>((int)tile.rows, [&](auto rows) {
        constexpr int RT = decltype(rows)::value;
        if (block.cols > kLanes)
          expand_tile<RT, 2>(hs, SR, b, ldb, R, y_rows, block.cols);
        else
          expand_tile<RT, 1>(hs, SR, b, ldb, R, y_rows, block.cols);
      });
    }
  }
}

}  // namespace

// y += each row's own adapter's delta, in place (Platform.add_lora): row t with slot l = row_slots[t] >= 0 gets
// h = x[t] lora_a[l]^T ([S R], slice s's rank rows at s R ...) and y[t, c] += h[s R : (s + 1) R] . lora_b[l, :, c]
// for each column c of slice s (slice_offsets[s] <= c < slice_offsets[s + 1]). x [T, K], y [T, N] (rows contiguous;
// one dtype, float32 or bfloat16, as the weights), lora_a [L, S R, K], lora_b [L, R, N], row_slots int32 [T].
void add_lora(torch::Tensor y, const torch::Tensor& x, const torch::Tensor& lora_a, const torch::Tensor& lora_b,
              const torch::Tensor& row_slots, std::vector<int64_t> slice_offsets) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "add_lora: x [T, K] and y [T, N], got ",
              x.sizes(), " and ", y.sizes());
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "add_lora: x's and y's rows must be contiguous");
  TORCH_CHECK(lora_a.dim() == 3 && lora_b.dim() == 3 && lora_a.size(0) == lora_b.size(0) &&
                  lora_a.size(2) == x.size(1) && lora_b.size(2) == y.size(1) && lora_a.is_contiguous() &&
                  lora_b.is_contiguous(),
              "add_lora: lora_a [L, S * R, ", x.size(1), "] and lora_b [L, R, ", y.size(1), "] (contiguous), got ",
              lora_a.sizes(), " and ", lora_b.sizes());
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && x.scalar_type() == lora_a.scalar_type() &&
                  x.scalar_type() == lora_b.scalar_type(),
              "add_lora: x, y, lora_a and lora_b of one dtype, got ", x.scalar_type(), ", ", y.scalar_type(), ", ",
              lora_a.scalar_type(), ", ", lora_b.scalar_type());
  TORCH_CHECK(row_slots.dim() == 1 && row_slots.size(0) == x.size(0) && row_slots.scalar_type() == at::kInt &&
                  row_slots.is_contiguous(),
              "add_lora: row_slots is int32 [", x.size(0), "]");
  TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu() && lora_a.device().is_cpu() && lora_b.device().is_cpu() &&
                  row_slots.device().is_cpu(),
              "add_lora: CPU tensors");
  const int64_t L = lora_a.size(0), R = lora_b.size(1), K = x.size(1), N = y.size(1);
  const int64_t S = (int64_t)slice_offsets.size() - 1;
  TORCH_CHECK(S >= 1 && lora_a.size(1) == S * R, "add_lora: ", S, " slices of rank ", R, " need lora_a [L, ", S * R,
              ", K], got ", lora_a.sizes());
  TORCH_CHECK(slice_offsets[0] == 0 && slice_offsets[S] == N, "add_lora: the slices cover y's ", N,
              " columns: offsets from 0 to ", N);
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(slice_offsets[s] <= slice_offsets[s + 1], "add_lora: slice offsets must not decrease");
  if (!x.size(0)) return;
  with_typed<false>(x, "add_lora", [&](auto* xp) {
    using T = std::remove_pointer_t<decltype(xp)>;
    run<T>(y.data_ptr<T>(), y.stride(0), xp, x.stride(0), lora_a.data_ptr<T>(), lora_b.data_ptr<T>(),
           row_slots.data_ptr<int32_t>(), x.size(0), L, R, K, N, slice_offsets);
  });
}
