// bfloat16 linear layers on Intel AMX (Sapphire Rapids and later): y = x W^T (+ b), W packed once at load.
//
// Why our own: oneDNN's bfloat16 kernels run a decode step's shapes well only at full batch, and every new row
// count costs milliseconds to build a primitive, while a batch shrinks one sequence at a time
// (benchmarks/README.md). In decode the multiply is memory-bound (the weights stream
// from DRAM once a step), so a kernel that keeps DRAM busy at any row count is what pays.
//
// Layout (AMX's: a B tile is 16 rows of 16 column pairs, each pair two consecutive k values):
// - W [N, K] is packed in "pairs" of 32 output columns, k-major: a k-step of a pair is two B tiles, 2 KB
//   contiguous, so a thread streams its pairs sequentially; K and N are zero-padded to 32;
// - gated (the MLP's [gate; up] weight): a pair is 16 gate columns and the 16 matching up columns, so the
//   two accumulator tiles of a row block hold gate and up for the same 16 outputs, and the epilogue
//   stores silu(gate) * up with the roundings of the separate bfloat16 ops (as silu_and_mul does);
// - a register block is 16 rows x one pair: two accumulator tiles, one of x, two of weights. A 32-row block
//   (2 x 2 accumulators, the textbook AMX block) ran slower on every shape measured (benchmarks/README.md);
// - rows are read in place (K a multiple of 32); the last block of rows, and x when K is not, goes
//   through a zero-padded copy, so tiles never read past the input; each thread's first pair of a run of
//   rows also stores the x tiles it loads, and its other pairs read those 1 KB contiguous tiles instead of
//   16 rows K apart.
// Sums are float32, rounded to bfloat16 once (to nearest even), as oneDNN's are; they differ from it by
// summation order only.
#include "amx.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <limits>
#include <memory>
#include <vector>

namespace {

constexpr int64_t TK = 32;                 // k values in a tile row (16 pairs, 64 bytes)
constexpr int64_t TN = 16;                 // output columns of a B tile
constexpr int64_t TM = 16;                 // rows of an A / C tile
constexpr int64_t PAIR_COLS = 2 * TN;      // output columns of a pair (gated: 16 gate + 16 up)
constexpr int64_t PAIR_STEP = PAIR_COLS * TK;  // elements of one k-step of a pair (two B tiles)
constexpr int64_t BLOCK_ROWS = TM;         // rows of a register block

// Which source row feeds column j (0..31) of pair p, or -1 (zero padding).
inline int64_t source_row(int64_t p, int64_t j, int64_t N, bool gated) {
  if (gated) {  // N = 2I: columns 0-15 gate rows 16p.., 16-31 the up rows I + 16p..
    const int64_t I = N / 2, i = p * TN + j % TN;
    return i < I ? (j < TN ? i : I + i) : -1;
  }
  const int64_t n = p * PAIR_COLS + j;
  return n < N ? n : -1;
}

}  // namespace

// [N, K] bfloat16 weight -> [pairs, ceil(K / 32), 2, 16, 32] (see the layout above); gated: [2I, K] -> I / 16 pairs.
torch::Tensor pack_amx_weight(const torch::Tensor& weight, bool gated) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_amx_weight: a 2-D bfloat16 weight");
  TORCH_CHECK(!gated || weight.size(0) % 2 == 0, "pack_amx_weight: a gated weight has 2 * I rows");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), KB = (K + TK - 1) / TK;
  const int64_t pairs = gated ? (N / 2 + TN - 1) / TN : (N + PAIR_COLS - 1) / PAIR_COLS;
  auto packed = zeros_on_huge_pages({pairs, KB, 2, TK / 2, PAIR_COLS}, w.scalar_type());  // streamed every step
  const bf16* src = w.data_ptr<bf16>();
  bf16* dst = packed.data_ptr<bf16>();
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < PAIR_COLS; ++j) {
        const int64_t row = source_row(p, j, N, gated);
        if (row < 0) continue;
        const int64_t half = j / TN, n = j % TN;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t kb = k / TK, kr = (k % TK) / 2, e = k % 2;
          dst[(((p * KB + kb) * 2 + half) * (TK / 2) + kr) * PAIR_COLS + n * 2 + e] = src[row * K + k];
        }
      }
  });
  return packed;
}

#ifdef NANOINFER_AMX
namespace {

// 16 floats -> bfloat16 (to nearest even, as torch rounds; an already rounded value stays), n of them stored.
inline void store16_masked(bf16* out, __m512 v, int n) {
  const __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  _mm256_mask_storeu_epi16(out, static_cast<__mmask16>((1u << n) - 1), b);
}

// Greedy mode (amx_greedy_argmax): a row's largest logit so far, as bfloat16 would hold it, and its first index
// (-1 before any); `nan` marks a row whose sums hold a NaN (the caller computes its logits in full). Each
// thread keeps its own over the pairs it runs; they are merged by the same rule at the end.
struct RowBest {
  float value = -std::numeric_limits<float>::infinity();
  int32_t index = -1;
  int32_t nan = 0;
  // Does (value, index) beat this one? Larger wins; on a tie the lower index, as torch.argmax takes the first.
  bool beaten_by(float v, int64_t i) const { return index < 0 || v > value || (v == value && i < index); }
};

// One row's 32 sums of a pair, as the greedy epilogues read them: the two halves and the masks of the ncols
// valid columns.
struct PairRow {
  __mmask16 m0, m1;
  __m512 r0, r1;
  PairRow(const float* row, int ncols)
      : m0((__mmask16)(ncols >= TN ? 0xFFFFu : (1u << ncols) - 1)),
        m1((__mmask16)(ncols <= TN ? 0u : ncols >= 2 * TN ? 0xFFFFu : (1u << (ncols - TN)) - 1)),
        r0(_mm512_load_ps(row)),
        r1(_mm512_load_ps(row + TN)) {}
  bool has_nan() const {
    return (_mm512_mask_cmp_ps_mask(m0, r0, r0, _CMP_UNORD_Q) | _mm512_mask_cmp_ps_mask(m1, r1, r1, _CMP_UNORD_Q)) != 0;
  }
};

// One row's 32 sums of a pair (ncols of them valid, column col0 first) into its RowBest: rounded to bfloat16
// (rnd16 is store16_masked's rounding on finite values), the largest and the first lane holding it.
inline void update_best(const float* row, int ncols, int64_t col0, RowBest& best) {
  const PairRow pr(row, ncols);
  const __mmask16 m0 = pr.m0, m1 = pr.m1;
  if (pr.has_nan()) {
    best.nan = 1;
    return;
  }
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 v0 = _mm512_mask_mov_ps(ninf, m0, rnd16(pr.r0)), v1 = _mm512_mask_mov_ps(ninf, m1, rnd16(pr.r1));
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(v0, v1));
  if (!best.beaten_by(top, col0)) return;  // not even at the pair's first column: most pairs end here
  const __m512 t = _mm512_set1_ps(top);
  const uint32_t hit = _mm512_mask_cmp_ps_mask(m0, v0, t, _CMP_EQ_OQ) |
                       ((uint32_t)_mm512_mask_cmp_ps_mask(m1, v1, t, _CMP_EQ_OQ) << TN);
  const int64_t index = col0 + __builtin_ctz(hit);
  if (best.beaten_by(top, index)) best.value = top, best.index = (int32_t)index;
}

// Bounded mode (amx_logit_candidates): a row's running threshold max_j (B_j - E_j) over the columns seen, and
// the columns whose B_j + E_j reached it when seen (with that upper value). The threshold only grows, so a
// column below it once is below the final one and is never kept; the survivors are filtered by the final
// threshold at the end. Slots: kMaxCandidates a row and thread. When they run out, the ones the threshold has
// passed are dropped; if none has, the new column is dropped and its upper value remembered (`dropped`): the
// row is still exact if the final threshold passes that, else its caller computes it in full, as a row
// holding an infinity or a NaN (`full`). A thread's first columns may all be near-equal (a run of duplicated
// rows of W), so the threshold may rise only after the slots are gone.
constexpr int kMaxCandidates = 256;
struct Candidate {
  int32_t index;
  float upper;
};
struct RowCandidates {
  float threshold = -std::numeric_limits<float>::infinity();
  float dropped = -std::numeric_limits<float>::infinity();
  int32_t count = 0;
  int32_t full = 0;
};

// One row's 32 sums of a pair (ncols valid, column col0 first) into its RowCandidates; `scale` is the row's
// factor of E_j, `slots` its candidate slots.
inline void update_candidates(const float* row, int ncols, int64_t col0, float scale, const LogitBound& lb,
                              RowCandidates& rc, Candidate* slots) {
  if (rc.full) return;
  const PairRow pr(row, ncols);
  const __mmask16 m0 = pr.m0, m1 = pr.m1;
  if (pr.has_nan()) {
    rc.full = 1;
    return;
  }
  const __m512 b0 = rnd16(pr.r0), b1 = rnd16(pr.r1);
  const __m512 abs0 = _mm512_abs_ps(b0), abs1 = _mm512_abs_ps(b1);
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  if (_mm512_mask_cmp_ps_mask(m0, abs0, inf, _CMP_EQ_OQ) | _mm512_mask_cmp_ps_mask(m1, abs1, inf, _CMP_EQ_OQ)) {
    rc.full = 1;  // a sum past bfloat16's range: the bound says nothing there
    return;
  }
  // E_j (greedy_lm_head.cpp derives it): fma(scale, ||w_j||, c2 |B_j|) + tiny.
  const __m512 a = _mm512_set1_ps(scale), c2 = _mm512_set1_ps(lb.c2), tiny = _mm512_set1_ps(lb.tiny);
  const __m512 e0 = _mm512_add_ps(
      _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(m0, lb.weight_norms + col0), _mm512_mul_ps(c2, abs0)), tiny);
  const __m512 e1 = _mm512_add_ps(
      _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(m1, lb.weight_norms + col0 + TN), _mm512_mul_ps(c2, abs1)), tiny);
  __m512 t = _mm512_set1_ps(rc.threshold);
  const __m512 lo0 = _mm512_sub_ps(b0, e0), lo1 = _mm512_sub_ps(b1, e1);
  if (_mm512_mask_cmp_ps_mask(m0, lo0, t, _CMP_GT_OQ) | _mm512_mask_cmp_ps_mask(m1, lo1, t, _CMP_GT_OQ)) {
    const __m512 ninf = _mm512_sub_ps(_mm512_setzero_ps(), inf);
    rc.threshold = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(ninf, m0, lo0), _mm512_mask_mov_ps(ninf, m1, lo1)));
    t = _mm512_set1_ps(rc.threshold);
  }
  const __m512 up0 = _mm512_add_ps(b0, e0), up1 = _mm512_add_ps(b1, e1);
  alignas(64) float upper[2 * TN];
  uint32_t hit = _mm512_mask_cmp_ps_mask(m0, up0, t, _CMP_GE_OQ) |
                 ((uint32_t)_mm512_mask_cmp_ps_mask(m1, up1, t, _CMP_GE_OQ) << TN);
  if (!hit) return;  // most pairs, once a row's threshold has risen
  _mm512_store_ps(upper, up0);
  _mm512_store_ps(upper + TN, up1);
  for (; hit; hit &= hit - 1) {
    if (rc.count == kMaxCandidates) {  // drop the ones the threshold has passed since they came in
      int32_t kept = 0;
      for (int32_t i = 0; i < rc.count; ++i)
        if (slots[i].upper >= rc.threshold) slots[kept++] = slots[i];
      rc.count = kept;
    }
    const int lane = __builtin_ctz(hit);
    if (rc.count == kMaxCandidates)
      rc.dropped = std::max(rc.dropped, upper[lane]);
    else
      slots[rc.count++] = Candidate{(int32_t)(col0 + lane), upper[lane]};
  }
}

// What a greedy run (the LM head) collects in place of its output, per thread and row ([threads][M]).
struct GreedySinks {
  RowBest* best = nullptr;            // amx_greedy_argmax
  RowCandidates* candidates = nullptr;  // amx_logit_candidates, with:
  Candidate* slots = nullptr;         // [threads][M][kMaxCandidates]
  const LogitBound* bound = nullptr;
};

// A block's sums (c [16][32]) on their way to the output: `rows` rows, `ncols` valid outputs of the pair at out
// (row stride ldc), the first `done` of them written. Gated: gate and up rounded to bfloat16, silu(gate)
// rounded, the product rounded: silu_mul_row's steps on 16 lanes (exp16 is exp8's), so the bits are those of
// the gate_up linear followed by silu_and_mul.
// The next block writes a few rows of it between its tile instructions, which the core then runs alongside
// them. Written after the block, with the tile unit idle, it took a large share of the GEMM's time
// (benchmarks/README.md).
struct Epilogue {
  const float* c = nullptr;
  int rows = 0, done = 0;
  bf16* out = nullptr;
  int64_t ldc = 0;
  int ncols = 0;
  const float* bias = nullptr;
  RowBest* best = nullptr;  // greedy mode: the block's rows' RowBest, in place of out
  int64_t col0 = 0;         // greedy and bounded modes: the pair's first column
  RowCandidates* candidates = nullptr;  // bounded mode: the block's rows' RowCandidates, in place of out,
  Candidate* slots = nullptr;           // their slots,
  const LogitBound* bound = nullptr;    // the bound,
  int64_t row0 = 0;                     // and the block's first row

  template <bool GATED>
  void write_rows_until(int end) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (end = std::min(end, rows); done < end; ++done) {
      const float* row = c + done * PAIR_COLS;
      if (!GATED && best) {
        update_best(row, ncols, col0, best[done]);
        continue;
      }
      if (!GATED && candidates) {
        update_candidates(row, ncols, col0, bound->row_scale[row0 + done], *bound, candidates[done],
                          slots + done * kMaxCandidates);
        continue;
      }
      bf16* o = out + done * ldc;
      if constexpr (GATED) {
        const __m512 g = rnd16(_mm512_load_ps(row)), u = rnd16(_mm512_load_ps(row + TN));
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        store16_masked(o, _mm512_mul_ps(rnd16(silu), u), ncols);
      } else {
        for (int h = 0; h < 2 && h * TN < ncols; ++h) {
          const int n = std::min<int>(TN, ncols - h * TN);
          __m512 v = _mm512_load_ps(row + h * TN);
          if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), bias + h * TN));
          store16_masked(o + h * TN, v, n);
        }
      }
    }
  }
};

// One register block: 16 rows of x times one pair, float32 sums into c [16][32] (each row: the pair's first
// 16 columns, then the next 16). Tiles 0-1 accumulate, 4 holds x, 6-7 the weights. x's k-step kb is read from
// x + kb * 32 with row stride lda elements and stored to xt + kb * 512 (a copy of the tiles, 1 KB each,
// contiguous), or (FROM_TILES) read from that copy.
// pf: `pf_lines` 64-byte lines to prefetch into L2 each k-step, from pf on (the weights this thread runs next).
// prev: the block before's sums, `rows_per_step` rows of them written each k-step, all of them before c is
// stored (prev's sums may be in c).
template <bool GATED, bool FROM_TILES>
inline void block(const bf16* x, int64_t lda, bf16* xt, const bf16* b, int64_t KB, float* c, const char* pf,
                  int pf_lines, Epilogue& prev, int rows_per_step) {
  _tile_zero(0);
  _tile_zero(1);
  const int64_t stride = lda * (int64_t)sizeof(bf16);
  for (int64_t kb = 0; kb < KB; ++kb) {
    const bf16* bk = b + kb * PAIR_STEP;
    for (int l = 0; l < pf_lines; ++l) _mm_prefetch(pf + (kb * pf_lines + l) * 64, _MM_HINT_T1);
    if constexpr (FROM_TILES) {
      _tile_loadd(4, xt + kb * kTileElems, 64);
    } else {
      _tile_loadd(4, x + kb * TK, stride);
      _tile_stored(4, xt + kb * kTileElems, 64);
    }
    _tile_loadd(6, bk, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, bk + TN * TK, 64);
    _tile_dpbf16ps(1, 4, 7);
    prev.write_rows_until<GATED>((int)(kb + 1) * rows_per_step);
  }
  prev.write_rows_until<GATED>(BLOCK_ROWS);
  _tile_stored(0, c, PAIR_COLS * sizeof(float));
  _tile_stored(1, c + TN, PAIR_COLS * sizeof(float));
}

// A range of pair indices [front, back) that its owner takes from the front and other threads from the back,
// both through one atomic word (front in the low 32 bits, back in the high), so no pair is taken twice.
struct alignas(64) PairRange {
  std::atomic<uint64_t> word{0};
  void reset(int64_t front, int64_t back) { word.store((uint64_t)front | ((uint64_t)back << 32)); }
  int64_t front() const { return (int64_t)(word.load(std::memory_order_relaxed) & 0xffffffffu); }
  int64_t back() const { return (int64_t)(word.load(std::memory_order_relaxed) >> 32); }
  int64_t take_front() { return take(true); }
  int64_t take_back() { return take(false); }

 private:
  int64_t take(bool from_front) {
    uint64_t w = word.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t f = w & 0xffffffffu, b = w >> 32;
      if (f >= b) return -1;
      const uint64_t taken = from_front ? w + 1 : f | ((b - 1) << 32);
      if (word.compare_exchange_weak(w, taken, std::memory_order_acq_rel)) return (int64_t)(from_front ? f : b - 1);
    }
  }
};

// out [M, N], or (greedy, not GATED) no output: its sinks collect each row's result instead.
template <bool GATED>
void run_amx(const bf16* x, int64_t M, int64_t K, const bf16* b, int64_t pairs, int64_t KB, const float* bias,
             bf16* out, int64_t N, const GreedySinks* greedy = nullptr) {
  const int64_t KP = KB * TK;
  const int64_t cols = GATED ? TN : PAIR_COLS;  // outputs of a pair
  // Rows read in place: whole blocks when K is a multiple of 32. The rest from a zero-padded copy.
  const int64_t direct = (K == KP) ? (M / BLOCK_ROWS) * BLOCK_ROWS : 0;
  const int64_t padded_rows = (M - direct + BLOCK_ROWS - 1) / BLOCK_ROWS * BLOCK_ROWS;
  static thread_local std::vector<bf16> pad;
  if ((int64_t)pad.size() < padded_rows * KP) pad.resize(padded_rows * KP);
  bf16* padp = pad.data();
  for (int64_t r = 0; r < padded_rows; ++r) {
    bf16* dst = padp + r * KP;
    const int64_t m = direct + r;
    if (m < M) std::memcpy(dst, x + m * K, K * sizeof(bf16));
    std::memset(dst + (m < M ? K : 0), 0, (KP - (m < M ? K : 0)) * sizeof(bf16));
  }
  const int64_t blocks = (M + BLOCK_ROWS - 1) / BLOCK_ROWS;
  // Rows go in runs of up to 16 blocks (256 rows): a run's x stays in L2 while each pair's weights stay in
  // L1 / L2 across its blocks; in decode (<= 64 rows) one run covers every row.
  constexpr int64_t RUN = 16;
  const int64_t runs = (blocks + RUN - 1) / RUN;
  const int threads = at::get_num_threads();
  constexpr int64_t PAIR_LINES_PER_STEP = PAIR_STEP * sizeof(bf16) / 64;  // 32
  // Each thread owns a contiguous range of a run's pairs, so it knows the pair it runs next and prefetches it
  // while it computes this one (in decode the weights come from DRAM: without it the loads waited on memory
  // while the tiles computed, then the tiles waited on the loads). A thread done with its range takes pairs
  // from the end of another's: virtual CPUs do not all run at one speed, and with fixed ranges one thread
  // waited on the other for a good part of the linears' time.
  std::unique_ptr<PairRange[]> ranges(new PairRange[runs * threads]);
  // Each thread's copy of a run's rows of x as A tiles (by block, then k-step: 16 x 32 values, 1 KB
  // contiguous). A thread's first pair of a run reads x in place (row stride K) and stores each tile it loads
  // there; its other pairs read the copy: faster, the same bits (benchmarks/README.md).
  const int64_t run_tiles = std::min(blocks, RUN) * KB * kTileElems;
  static thread_local std::vector<bf16> tile_buf;
  if ((int64_t)tile_buf.size() < threads * run_tiles + 32) tile_buf.resize(threads * run_tiles + 32);
  bf16* const all_tiles = reinterpret_cast<bf16*>((reinterpret_cast<uintptr_t>(tile_buf.data()) + 63) & ~uintptr_t{63});
  for (int64_t run = 0; run < runs; ++run)
    for (int t = 0; t < threads; ++t) ranges[run * threads + t].reset(pairs * t / threads, pairs * (t + 1) / threads);
  #pragma omp parallel num_threads(threads)
  {
    load_tile_config();
    // A block's sums. block() writes the last block's rows out of it before it stores its own, so one buffer
    // serves both.
    alignas(64) float c[BLOCK_ROWS * PAIR_COLS];
    Epilogue prev;  // the last block's, written during the next
    const int rows_per_step = (int)((BLOCK_ROWS + KB - 1) / KB);
    // Ranges were made for `threads`; a team given fewer leaves some unowned, and the others take all of them.
    const int t = omp_get_thread_num();
    bf16* const tiles = all_tiles + t * run_tiles;
    int64_t tiles_run = -1;  // the run whose x `tiles` holds
    // One pair over the run's blocks of rows, prefetching `next`'s weights (or none) spread over them.
    auto run_pair = [&](int64_t run, int64_t p, const bf16* next) {
      const int64_t blk_begin = run * RUN, blk_end = std::min(blocks, (run + 1) * RUN);
      const int64_t nblk = blk_end - blk_begin;
      const bf16* bp = b + p * KB * PAIR_STEP;
      const int ncols = (int)std::min<int64_t>(cols, N - p * cols);
      const float* biasp = bias ? bias + p * cols : nullptr;
      const int pf_lines = next ? (int)((PAIR_LINES_PER_STEP + nblk - 1) / nblk) : 0;
      const bool from_tiles = tiles_run == run;
      tiles_run = run;
      for (int64_t blk = blk_begin; blk < blk_end; ++blk) {
        const int64_t m0 = blk * BLOCK_ROWS;
        const int rows = (int)std::min<int64_t>(BLOCK_ROWS, M - m0);
        const bf16* xa = m0 < direct ? x + m0 * K : padp + (m0 - direct) * KP;
        const int64_t lda = m0 < direct ? K : KP;
        bf16* xt = tiles + (blk - blk_begin) * KB * kTileElems;
        const char* pf = next ? reinterpret_cast<const char*>(next) + (blk - blk_begin) * pf_lines * KB * 64 : nullptr;
        if (from_tiles)
          block<GATED, true>(xa, lda, xt, bp, KB, c, pf, pf_lines, prev, rows_per_step);
        else
          block<GATED, false>(xa, lda, xt, bp, KB, c, pf, pf_lines, prev, rows_per_step);
        if (!greedy) {
          prev = Epilogue{c, rows, 0, out + m0 * N + p * cols, N, ncols, biasp};
        } else {
          const int64_t r = t * M + m0;
          prev = Epilogue{c, rows, 0, nullptr, N, ncols, nullptr, greedy->best ? greedy->best + r : nullptr, p * cols};
          if (greedy->candidates) {
            prev.candidates = greedy->candidates + r;
            prev.slots = greedy->slots + r * kMaxCandidates;
            prev.bound = greedy->bound;
            prev.row0 = m0;
          }
        }
      }
    };
    auto pair_ptr = [&](int64_t p) { return b + p * KB * PAIR_STEP; };
    for (int64_t run = 0; run < runs; ++run) {
      PairRange& own = ranges[run * threads + t];
      for (int64_t p; (p = own.take_front()) >= 0;) {
        // Next: the following pair while the range lasts, else the first of this thread's range in the next run.
        const bf16* next = p + 1 < own.back() ? pair_ptr(p + 1)
                           : run + 1 < runs   ? pair_ptr(ranges[(run + 1) * threads + t].front())
                                              : nullptr;
        run_pair(run, p, next);
      }
      for (int v = 1; v < threads; ++v) {  // then the other ranges' leftovers, from their ends
        PairRange& other = ranges[run * threads + (t + v) % threads];
        for (int64_t p; (p = other.take_back()) >= 0;) run_pair(run, p, p > other.front() ? pair_ptr(p - 1) : nullptr);
      }
    }
    prev.write_rows_until<GATED>(BLOCK_ROWS);
    _tile_release();
  }
}

}  // namespace
#endif

bool amx_available() {
#ifdef NANOINFER_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// x [..., K] bfloat16 times a weight from pack_amx_weight -> [..., N] bfloat16 (gated: silu(x Wg^T) * (x Wu^T),
// N = I).
torch::Tensor amx_linear(const torch::Tensor& input, const torch::Tensor& packed,
                         const c10::optional<torch::Tensor>& bias, int64_t N, bool gated) {
  TORCH_CHECK(amx_available(), "amx_linear: this CPU (or build) has no AMX bfloat16");
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "amx_linear: bfloat16 input and weight");
  TORCH_CHECK(packed.dim() == 5 && packed.size(2) == 2 && packed.size(3) == TK / 2 && packed.size(4) == PAIR_COLS,
              "amx_linear: weight not packed by pack_amx_weight");
  const int64_t pairs = packed.size(0), KB = packed.size(1);
  TORCH_CHECK(pairs == (gated ? (N + TN - 1) / TN : (N + PAIR_COLS - 1) / PAIR_COLS),
              "amx_linear: weight packed for another output size than ", N);
  TORCH_CHECK(!gated || !(bias.has_value() && bias->defined()), "amx_linear: no bias with gated");
  const int64_t K = input.size(-1);
  TORCH_CHECK((K + TK - 1) / TK == KB, "amx_linear: input has ", K, " features, weight ", KB * TK, " (padded)");
  const LinearIO io = linear_io(input, K, N, bias, "amx_linear");
  [[maybe_unused]] const int64_t M = io.x.size(0);  // (used with AMX only)
#ifdef NANOINFER_AMX
  if (M > 0) {
    const bf16* xp = io.x.data_ptr<bf16>();
    bf16* op = io.out.data_ptr<bf16>();
    if (gated)
      run_amx<true>(xp, M, K, packed.data_ptr<bf16>(), pairs, KB, io.bias_ptr(), op, N);
    else
      run_amx<false>(xp, M, K, packed.data_ptr<bf16>(), pairs, KB, io.bias_ptr(), op, N);
  }
#endif
  return io.out.view(io.sizes);
}

// Greedy tokens of a bfloat16 LM head: hidden [R, K] bfloat16 times a weight from pack_amx_weight -> [R] int64,
// the argmax of each row of amx_linear's logits (the first index on a tie), or -1 for a row whose logits hold
// a NaN (the caller computes those in full: torch.argmax takes the first NaN). The logits are never written:
// each block's sums go straight into its rows' running maxima, where amx_linear stores [R, V] bfloat16 (17 MB
// for a 174-row step of W) that the sampler then reads back.
torch::Tensor amx_greedy_argmax(const torch::Tensor& hidden, const torch::Tensor& packed, int64_t N) {
  TORCH_CHECK(amx_available(), "amx_greedy_argmax: this CPU (or build) has no AMX bfloat16");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "amx_greedy_argmax: bfloat16 hidden states [rows, hidden] and weight");
  TORCH_CHECK(packed.dim() == 5 && packed.size(2) == 2 && packed.size(3) == TK / 2 && packed.size(4) == PAIR_COLS &&
                  packed.size(0) == (N + PAIR_COLS - 1) / PAIR_COLS,
              "amx_greedy_argmax: weight not packed by pack_amx_weight for ", N, " outputs");
  const int64_t K = hidden.size(1), KB = packed.size(1), M = hidden.size(0);
  TORCH_CHECK((K + TK - 1) / TK == KB, "amx_greedy_argmax: hidden has ", K, " features, weight ", KB * TK, " (padded)");
  auto out = torch::empty({M}, torch::kLong);
#ifdef NANOINFER_AMX
  if (M > 0) {
    const auto x = hidden.contiguous();
    const int threads = at::get_num_threads();
    std::vector<RowBest> best(threads * M);
    GreedySinks sinks;
    sinks.best = best.data();
    run_amx<false>(x.data_ptr<bf16>(), M, K, packed.data_ptr<bf16>(), packed.size(0), KB, nullptr, nullptr, N, &sinks);
    int64_t* op = out.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m) {
      RowBest row = best[m];
      for (int t = 1; t < threads; ++t) {
        const RowBest& other = best[t * M + m];
        row.nan |= other.nan;
        if (other.index >= 0 && row.beaten_by(other.value, other.index)) row.value = other.value, row.index = other.index;
      }
      op[m] = row.nan ? -1 : row.index;
    }
  }
#endif
  return out;
}

std::vector<std::vector<int32_t>> amx_logit_candidates(const torch::Tensor& x, const torch::Tensor& packed,
                                                       int64_t N, const LogitBound& bound) {
  TORCH_CHECK(amx_available(), "amx_logit_candidates: this CPU (or build) has no AMX bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "amx_logit_candidates: contiguous bfloat16 rows [rows, hidden] and weight");
  TORCH_CHECK(packed.dim() == 5 && packed.size(2) == 2 && packed.size(3) == TK / 2 && packed.size(4) == PAIR_COLS &&
                  packed.size(0) == (N + PAIR_COLS - 1) / PAIR_COLS,
              "amx_logit_candidates: weight not packed by pack_amx_weight for ", N, " outputs");
  const int64_t M = x.size(0), K = x.size(1), KB = packed.size(1);
  TORCH_CHECK((K + TK - 1) / TK == KB, "amx_logit_candidates: rows have ", K, " features, weight ", KB * TK);
  std::vector<std::vector<int32_t>> out(M);
#ifdef NANOINFER_AMX
  if (M == 0) return out;
  const int threads = at::get_num_threads();
  std::vector<RowCandidates> rows(threads * M);
  static thread_local std::vector<Candidate> slots;  // 2 KB a row and thread: kept for the next step
  if ((int64_t)slots.size() < threads * M * kMaxCandidates) slots.resize(threads * M * kMaxCandidates);
  GreedySinks sinks;
  sinks.candidates = rows.data();
  sinks.slots = slots.data();
  sinks.bound = &bound;
  run_amx<false>(x.data_ptr<bf16>(), M, K, packed.data_ptr<bf16>(), packed.size(0), KB, nullptr, nullptr, N, &sinks);
  for (int64_t m = 0; m < M; ++m) {  // merge the threads': the final threshold, then who reaches it
    float threshold = -std::numeric_limits<float>::infinity(), dropped = threshold;
    bool full = false;
    for (int t = 0; t < threads; ++t) {
      const RowCandidates& rc = rows[t * M + m];
      full |= rc.full != 0;
      threshold = std::max(threshold, rc.threshold);
      dropped = std::max(dropped, rc.dropped);
    }
    if (full || dropped >= threshold) continue;  // a dropped column may be the argmax
    for (int t = 0; t < threads; ++t) {
      const Candidate* s = slots.data() + (t * M + m) * kMaxCandidates;
      for (int32_t i = 0; i < rows[t * M + m].count; ++i)
        if (s[i].upper >= threshold) out[m].push_back(s[i].index);
    }
  }
#endif
  return out;
}
