// Paged prefill attention for CPU: every prompt chunk of a step in one call, reading its keys and values in
// place from the paged cache (this step's rows are stored before attention runs, so a prompt with a cached
// prefix and one without take the same path, and nothing is gathered into a copy).
// Layouts as in reference.py: q and out [T, H_q, D] (rows contiguous, any row stride); caches
// [num_blocks, block_size, H_kv, D]; the queries of chunk i are q[q_starts[i] : q_starts[i] + q_lens[i]], at
// positions seq_lens[i] - q_lens[i] ... seq_lens[i] - 1, each attending to the keys at positions up to its own.
//
// The algorithm is flash attention's (tiles of queries against tiles of keys, a running max and sum per row,
// so the score matrix is never materialised), shaped for GQA: the G query heads that share a KV head are
// the rows of one work item, so every key tile packed is used by G x kQueryTile rows. Both products (scores =
// Q K^T and out += P V) run through one register tile, the GEMM's (csrc/gemm.cpp): 6 x 16 on AVX2, 12 x 32 on
// AVX-512 (two 16-key groups, or 32 value dims, at once), each lane summing in the same order, so the same bits.
//
// bfloat16 queries over a bfloat16 cache on a CPU with AMX take attend_amx instead: the same algorithm with
// both products on tiles, faster still.
//
// Why our own: torch's SDPA takes one call per prompt per layer, at a small fraction of this kernel's rate on a
// batch of short prompts (benchmarks/README.md).
#include "amx.h"

#include <array>
#include <type_traits>

const float* sink_logits(const c10::optional<torch::Tensor>& sinks, int Hq, const char* what);  // paged_attention.cpp

namespace {

constexpr int kQueryTile = 16;  // query positions per work item (x G heads = its rows)
constexpr int kKeyTile = 64;    // keys per step; divides every block_size (a multiple of 256), so a key tile
                                // is kKeyTile consecutive rows of one cache block
constexpr int NR = 16;          // columns of a register tile's block (a group of keys, or of value dims)
#ifdef NANOINFER_AVX512
constexpr int MR = 12;          // rows of the register tile
constexpr int NB = 2;           // blocks of NR columns it spans
#else
constexpr int MR = 6;
constexpr int NB = 1;
#endif

#if defined(NANOINFER_AVX512)
// c[R x 16 W] (+)= a[R x kdim] * [b0 | b1][kdim x 16 W] (W = 1 or 2 blocks); a row-major (lda), row k of block
// j is 16 values at bj + k * ldb (widened from the cache's type): simd.h's fma_tile_12x2, twice the AVX2 tile's
// rows and columns per broadcast.
template <int R, int W, bool ACC, typename TB>
inline void tile(const float* __restrict a, int64_t lda, const TB* __restrict b0, const TB* __restrict b1,
                 int64_t ldb, int kdim, float* __restrict c, int64_t ldc) {
  fma_tile_12x2<R, W>(
      kdim, [](int64_t) {}, [&](int r, int64_t k) { return a[r * lda + k]; },
      [&](int j, int64_t k) { return load16((j == 0 ? b0 : b1) + k * ldb); },
      [&](int r, int j, __m512 sum) {
        float* out = c + r * ldc + j * NR;
        _mm512_storeu_ps(out, ACC ? _mm512_add_ps(_mm512_loadu_ps(out), sum) : sum);
      });
}

// R (at most MR) rows x 16 w (w blocks, at most NB) of c: tile<R, w> for a run-time R and w.
template <bool ACC, typename TB>
void tile_rows(int R, int w, const float* a, int64_t lda, const TB* b0, const TB* b1, int64_t ldb, int kdim,
               float* c, int64_t ldc) {
#define NANOINFER_CASE(r)                                                          \
  case r:                                                                          \
    if (w == 2) tile<r, 2, ACC>(a, lda, b0, b1, ldb, kdim, c, ldc);                \
    else tile<r, 1, ACC>(a, lda, b0, b1, ldb, kdim, c, ldc);                       \
    break;
  switch (R) {
    NANOINFER_CASE(12) NANOINFER_CASE(11) NANOINFER_CASE(10) NANOINFER_CASE(9) NANOINFER_CASE(8)
    NANOINFER_CASE(7) NANOINFER_CASE(6) NANOINFER_CASE(5) NANOINFER_CASE(4) NANOINFER_CASE(3)
    NANOINFER_CASE(2) NANOINFER_CASE(1)
    default: break;
  }
#undef NANOINFER_CASE
}
#else
#ifdef NANOINFER_AVX2
// c[R x 16] (+)= a[R x kdim] * b[kdim x 16]; a row-major (lda), b's row k is 16 values at b + k * ldb (widened
// from the cache's type). Named accumulators: with an array GCC spills them (see gemm.cpp).
template <int R, bool ACC, typename TB>
inline void tile(const float* __restrict a, int64_t lda, const TB* __restrict b, int64_t ldb, int kdim,
                 float* __restrict c, int64_t ldc) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int k = 0; k < kdim; ++k) {
    const __m256 b0 = load8(b + k * ldb), b1 = load8(b + k * ldb + 8);
    __m256 av;
#define NANOINFER_ROW(r)                                       \
  if constexpr (R > r) {                                       \
    av = _mm256_broadcast_ss(a + r * lda + k);                 \
    c##r##0 = _mm256_fmadd_ps(av, b0, c##r##0);                \
    c##r##1 = _mm256_fmadd_ps(av, b1, c##r##1);                \
  }
    NANOINFER_ROW(0) NANOINFER_ROW(1) NANOINFER_ROW(2) NANOINFER_ROW(3) NANOINFER_ROW(4) NANOINFER_ROW(5)
#undef NANOINFER_ROW
  }
  const __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int r = 0; r < R; ++r) {
    float* out = c + r * ldc;
    if constexpr (ACC) {
      _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), acc[r][0]));
      _mm256_storeu_ps(out + 8, _mm256_add_ps(_mm256_loadu_ps(out + 8), acc[r][1]));
    } else {
      _mm256_storeu_ps(out, acc[r][0]);
      _mm256_storeu_ps(out + 8, acc[r][1]);
    }
  }
}
#else
template <int R, bool ACC, typename TB>
inline void tile(const float* a, int64_t lda, const TB* b, int64_t ldb, int kdim, float* c, int64_t ldc) {
  float acc[MR][NR] = {};
  for (int k = 0; k < kdim; ++k)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] += a[r * lda + k] * to_f(b[k * ldb + j]);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) c[r * ldc + j] = ACC ? c[r * ldc + j] + acc[r][j] : acc[r][j];
}
#endif

// R (at most MR) rows x 16 of c: tile<R> for a run-time R (one block: b1 and w are for the AVX-512 tile's
// second block, which this one does not have).
template <bool ACC, typename TB>
void tile_rows(int R, int /*w*/, const float* a, int64_t lda, const TB* b, const TB* /*b1*/, int64_t ldb, int kdim,
               float* c, int64_t ldc) {
  switch (R) {
    case 6: tile<6, ACC>(a, lda, b, ldb, kdim, c, ldc); break;
    case 5: tile<5, ACC>(a, lda, b, ldb, kdim, c, ldc); break;
    case 4: tile<4, ACC>(a, lda, b, ldb, kdim, c, ldc); break;
    case 3: tile<3, ACC>(a, lda, b, ldb, kdim, c, ldc); break;
    case 2: tile<2, ACC>(a, lda, b, ldb, kdim, c, ldc); break;
    case 1: tile<1, ACC>(a, lda, b, ldb, kdim, c, ldc); break;
    default: break;
  }
}
#endif  // NANOINFER_AVX512

// exp(s - m) in place for n values, zero from n to `padded`; returns their sum.
inline float exp_shifted(float* s, int n, int padded, float m) {
  float sum = 0.f;
  int j = 0;
#ifdef NANOINFER_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum8 = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  sum = hsum(sum8);
#endif
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  std::fill(s + n, s + padded, 0.f);
  return sum;
}

// The largest of s[0, n).
inline float max_of(const float* s, int n, float init) {
  int j = 0;
#ifdef NANOINFER_AVX2
  __m256 m8 = _mm256_set1_ps(init);
  for (; j + 8 <= n; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m8);
  init = *std::max_element(lanes, lanes + 8);
#endif
  for (; j < n; ++j) init = std::max(init, s[j]);
  return init;
}

struct Chunk {  // one sequence's queries in this step
  int64_t q_start;  // first row in q / out
  int q_len, seq_len;
  const int* table;
};

// Where each chunk's packed keys (and values) go in one buffer: chunk i's KV head h at offsets[i] + h *
// sizes[i] elements, its keys padded to a multiple of `keys_multiple`, D elements each.
struct PackedLayout {
  std::vector<int64_t> offsets, sizes;
  int64_t total = 0;
  PackedLayout(const std::vector<Chunk>& chunks, int keys_multiple, int D, int Hkv)
      : offsets(chunks.size()), sizes(chunks.size()) {
    for (size_t i = 0; i < chunks.size(); ++i) {
      sizes[i] = (int64_t)(chunks[i].seq_len + keys_multiple - 1) / keys_multiple * keys_multiple * D;
      offsets[i] = total;
      total += sizes[i] * Hkv;
    }
  }
};

// The keys of chunk c's KV head h, transposed in groups of 16: kt[g][d][j] = key 16 g + j, element d (zero
// past the last key). Packed once per chunk and head, then read by all of its work items.
template <typename TC>
void pack_keys(const TC* kc, const Chunk& c, int h, int Hkv, int D, int bs, float* kt) {
  const int64_t kv_stride = (int64_t)Hkv * D;
  const int groups = (c.seq_len + NR - 1) / NR;
  for (int g = 0; g < groups; ++g)
    for (int j = 0; j < NR; ++j) {
      float* dst = kt + (size_t)g * D * NR + j;
      const int key = g * NR + j;
      if (key < c.seq_len) {
        const TC* src = kc + ((int64_t)c.table[key / bs] * bs + key % bs) * kv_stride + (int64_t)h * D;
        for (int d = 0; d < D; ++d) dst[d * NR] = to_f(src[d]);
      } else {
        for (int d = 0; d < D; ++d) dst[d * NR] = 0.f;
      }
    }
}

// One work item: query positions [p0, p1) of chunk c (local to its queries) x the G heads of KV head h.
// Rows are position-major: row r is position p0 + r / G, query head h * G + r % G. A register tile of rows
// computes only the 16-key groups its last row can see: on the diagonal the rest would be masked anyway.
template <typename TQ, typename TC>
void attend(const TQ* q, int64_t q_stride, const float* kt, const TC* vc, TQ* out, int64_t out_stride,
            const Chunk& c, int p0, int p1, int h, int G, int Hkv, int D, int bs, float scale, int window,
            float soft_cap, const float* sinks, std::vector<float>& work) {
  const int rows = (p1 - p0) * G;
  const int64_t kv_stride = (int64_t)Hkv * D;  // elements from one token's cache row to the next
  work.resize((size_t)rows * D * 2 + (size_t)rows * kKeyTile + 2 * (size_t)rows);
  float* Q = work.data();            // [rows, D], scaled
  float* O = Q + (size_t)rows * D;   // [rows, D], unnormalised
  float* S = O + (size_t)rows * D;   // [rows, kKeyTile]: scores, then probabilities
  float* m = S + (size_t)rows * kKeyTile;  // running max per row
  float* l = m + rows;                     // running sum per row
  const int first_pos = c.seq_len - c.q_len;  // absolute position of the chunk's first query
  auto pos = [&](int r) { return first_pos + p0 + r / G; };
  for (int r = 0; r < rows; ++r) {
    const TQ* src = q + (c.q_start + p0 + r / G) * q_stride + (int64_t)(h * G + r % G) * D;
    for (int d = 0; d < D; ++d) Q[(size_t)r * D + d] = to_f(src[d]) * scale;
    // An attention sink (gpt-oss) is a logit with no value: the online softmax starts from it.
    m[r] = sinks != nullptr ? sinks[h * G + r % G] : -INFINITY;
    l[r] = sinks != nullptr ? 1.f : 0.f;
  }
  std::fill(O, O + (size_t)rows * D, 0.f);
  const int keys = pos(rows - 1) + 1;  // the last row sees keys [0, keys)
  // With a sliding window the first row sees nothing before its window: start at the tile that holds its first key.
  const int first_key = window > 0 ? std::max(0, pos(0) - window + 1) / kKeyTile * kKeyTile : 0;
  for (int k0 = first_key; k0 < keys; k0 += kKeyTile) {
    const int n = std::min(kKeyTile, keys - k0);
    const int64_t row0 = (int64_t)c.table[k0 / bs] * bs + k0 % bs;  // the tile's first cache row
    const TC* vbase = vc + row0 * kv_stride + (int64_t)h * D;
    for (int r0 = 0; r0 < rows; r0 += MR) {
      const int R = std::min(MR, rows - r0);
      const int seen = std::min(n, pos(r0 + R - 1) + 1 - k0);  // keys of this tile the tile's rows can see
      if (seen <= 0) continue;
      const int groups = (seen + NR - 1) / NR;
      for (int g = 0; g < groups; g += NB) {
        const int w = std::min(NB, groups - g);
        const float* kg = kt + ((size_t)k0 / NR + g) * D * NR;
        tile_rows<false>(R, w, Q + (size_t)r0 * D, D, kg, kg + (size_t)D * NR, NR, D,
                         S + (size_t)r0 * kKeyTile + g * NR, kKeyTile);
      }
      // Online softmax; a row's keys past its own position, or before its sliding window, get probability 0.
      for (int r = r0; r < r0 + R; ++r) {
        float* sr = S + (size_t)r * kKeyTile;
        const int valid = std::min(n, pos(r) + 1 - k0);
        const int lo = window > 0 ? std::max(0, pos(r) - window + 1 - k0) : 0;  // first key inside the window
        if (valid <= lo) {
          std::fill(sr, sr + seen, 0.f);
          continue;
        }
        if (soft_cap > 0.f)  // cap * tanh(score / cap), on the scaled score, as transformers applies it
          for (int j = lo; j < valid; ++j) sr[j] = soft_cap * std::tanh(sr[j] / soft_cap);
        std::fill(sr, sr + lo, 0.f);  // keys before the window: exactly 0 (exp8 clamps, exp(-inf) would not be)
        const float mx = max_of(sr + lo, valid - lo, m[r]);
        const float alpha = std::exp(m[r] - mx);  // 0 on the first tile (m = -inf) but with a sink
        l[r] = l[r] * alpha + exp_shifted(sr + lo, valid - lo, seen - lo, mx);
        m[r] = mx;
        if (alpha != 1.f)
          for (int d = 0; d < D; ++d) O[(size_t)r * D + d] *= alpha;
      }
      for (int d0 = 0; d0 < D; d0 += NB * NR) {
        const int w = std::min(NB, (D - d0) / NR);
        tile_rows<true>(R, w, S + (size_t)r0 * kKeyTile, kKeyTile, vbase + d0, vbase + d0 + NR, kv_stride, seen,
                        O + (size_t)r0 * D + d0, D);
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    TQ* dst = out + (c.q_start + p0 + r / G) * out_stride + (int64_t)(h * G + r % G) * D;
    const float inv = 1.f / l[r];
    for (int d = 0; d < D; ++d) dst[d] = static_cast<TQ>(O[(size_t)r * D + d] * inv);
  }
}

#ifdef NANOINFER_AMX
// The same flash attention on AMX, for bfloat16 queries over a bfloat16 cache: both products are tile products
// (16 rows x 16 columns x 32 per instruction), and what stays on the vector units is the online softmax.
// Per chunk and KV head, keys and values are packed once as B tiles (a B tile's row holds 16 columns' pairs
// of consecutive k values):
// - keys: kb[g][c] (16 keys 16 g.., dims 32 c..), row i = dims 32 c + 2 i, + 1 of each key;
// - values: vb[g][c] (32 keys 32 g.., dims 16 c..), row i = keys 32 g + 2 i, + 1 of each dim.
// The probabilities enter the second product as two bfloat16 parts, p = hi + lo (hi = p rounded, lo = the
// rest rounded), so P V keeps ~16 of p's bits: with p rounded once (as torch's bfloat16 CPU flash attention
// does) about a third of the outputs missed their correctly rounded value, with both parts almost none did (the
// float32 path's accuracy), for about a fifth more time (benchmarks/README.md). Sums are float32.
void pack_kv_amx(const bf16* kc, const bf16* vc, const Chunk& c, int h, int Hkv, int D, int bs, bf16* kb, bf16* vb) {
  const int64_t kv_stride = (int64_t)Hkv * D;
  const int keys = (c.seq_len + kKeyTile - 1) / kKeyTile * kKeyTile;
  const int CK = D / 32, CV = D / 16;
  auto row = [&](int key) { return ((int64_t)c.table[key / bs] * bs + key % bs) * kv_stride + (int64_t)h * D; };
  // Keys: a key's 32 dims are column key % 16 of its group's tile.
  for (int key = 0; key < keys; ++key) {
    const bool real = key < c.seq_len;
    bf16* tiles = kb + (size_t)(key / 16) * CK * kTileElems;
    for (int ck = 0; ck < CK; ++ck)
      scatter_b_column(tiles + (size_t)ck * kTileElems, key % 16,
                       real ? _mm512_loadu_si512(kc + row(key) + 32 * ck) : _mm512_setzero_si512());
  }
  // Values: keys 2 i and 2 i + 1 interleaved dim by dim make row i of a tile (16 dims: one 32-dim load of
  // both keys gives two tiles' rows).
  const __m512i lo = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                       0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002A000A, 0x002B000B,
                                       0x002C000C, 0x002D000D, 0x002E000E, 0x002F000F);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int key = 0; key < keys; key += 2) {
    bf16* dst = vb + (size_t)(key / 32) * CV * kTileElems + ((key % 32) / 2) * 32;
    for (int ck = 0; ck < CK; ++ck) {
      const __m512i a = key < c.seq_len ? _mm512_loadu_si512(vc + row(key) + 32 * ck) : _mm512_setzero_si512();
      const __m512i b = key + 1 < c.seq_len ? _mm512_loadu_si512(vc + row(key + 1) + 32 * ck) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + (size_t)(2 * ck) * kTileElems, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(dst + (size_t)(2 * ck + 1) * kTileElems, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// attend's work item on tiles: rows in blocks of 16 (position-major as there), each against the key tile's
// 16-key groups its last row can see.
void attend_amx(const bf16* q, int64_t q_stride, const bf16* kb, const bf16* vb, bf16* out, int64_t out_stride,
                const Chunk& c, int p0, int p1, int h, int G, int D, float scale, std::vector<float>& work,
                std::vector<bf16>& qwork) {
  const int rows = (p1 - p0) * G;
  const int rtiles = (rows + 15) / 16;
  const int CK = D / 32, CV = D / 16;
  work.resize((size_t)rtiles * 16 * D + 16 * kKeyTile + 2 * (size_t)rtiles * 16);
  qwork.resize((size_t)rtiles * 16 * D + 2 * 16 * kKeyTile);
  float* O = work.data();                       // [rtiles * 16, D], unnormalised
  float* S = O + (size_t)rtiles * 16 * D;       // [16, kKeyTile]: one row block's scores
  float* m = S + 16 * kKeyTile;                 // running max per row
  float* l = m + (size_t)rtiles * 16;           // running sum per row
  bf16* Q = qwork.data();                       // [rtiles * 16, D], zero past the last row
  bf16* P = Q + (size_t)rtiles * 16 * D;        // [2][16, kKeyTile]: probabilities, high and low parts
  const int first_pos = c.seq_len - c.q_len;
  auto pos = [&](int r) { return first_pos + p0 + r / G; };
  for (int r = 0; r < rtiles * 16; ++r) {
    if (r < rows)
      std::memcpy(Q + (size_t)r * D, q + (c.q_start + p0 + r / G) * q_stride + (int64_t)(h * G + r % G) * D,
                  D * sizeof(bf16));
    else
      std::memset(Q + (size_t)r * D, 0, D * sizeof(bf16));
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  std::fill(O, O + (size_t)rtiles * 16 * D, 0.f);
  const int64_t q_bytes = (int64_t)D * sizeof(bf16), o_bytes = (int64_t)D * sizeof(float);
  const int keys = pos(rows - 1) + 1;
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int k0 = 0; k0 < keys; k0 += kKeyTile) {
    const int n = std::min(kKeyTile, keys - k0);
    for (int rt = 0; rt < rtiles; ++rt) {
      const int r0 = rt * 16, R = std::min(16, rows - r0);
      const int seen = std::min(n, pos(r0 + R - 1) + 1 - k0);
      if (seen <= 0) continue;
      const int groups = (seen + 15) / 16;  // 1..4 (kKeyTile = 64)
      // S = Q K^T for the groups seen: tiles 0-3 accumulate, 4 holds Q, 5-7 the keys.
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int ck = 0; ck < CK; ++ck) {
        const bf16* kt = kb + ((size_t)(k0 / 16) * CK + ck) * kTileElems;
        _tile_loadd(4, Q + (size_t)r0 * D + 32 * ck, q_bytes);
        _tile_loadd(5, kt, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (groups > 1) {
          _tile_loadd(6, kt + (size_t)CK * kTileElems, 64);
          _tile_dpbf16ps(1, 4, 6);
        }
        if (groups > 2) {
          _tile_loadd(7, kt + (size_t)2 * CK * kTileElems, 64);
          _tile_dpbf16ps(2, 4, 7);
        }
        if (groups > 3) {
          _tile_loadd(5, kt + (size_t)3 * CK * kTileElems, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      constexpr int64_t s_bytes = kKeyTile * sizeof(float);
      _tile_stored(0, S, s_bytes);
      if (groups > 1) _tile_stored(1, S + 16, s_bytes);
      if (groups > 2) _tile_stored(2, S + 32, s_bytes);
      if (groups > 3) _tile_stored(3, S + 48, s_bytes);
      // Online softmax, a row at a time; keys past a row's own position, and padding rows, get 0.
      const int width = (seen + 31) / 32 * 32;  // keys the second product reads
      for (int r = 0; r < 16; ++r) {
        const float* sr = S + (size_t)r * kKeyTile;
        bf16* pr = P + (size_t)r * kKeyTile;
        const int valid = r < R ? std::min(n, pos(r0 + r) + 1 - k0) : 0;
        if (valid <= 0) {
          std::memset(pr, 0, width * sizeof(bf16));
          std::memset(pr + 16 * kKeyTile, 0, width * sizeof(bf16));
          continue;
        }
        // kKeyTile = 64: four vectors, lanes past `valid` masked.
        __m512 sv[4];
        __mmask16 mk[4];
        __m512 mxv = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < 4; ++j) {
          const int left = valid - 16 * j;
          mk[j] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
          sv[j] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), mk[j], _mm512_loadu_ps(sr + 16 * j), scale16);
          mxv = _mm512_max_ps(mxv, sv[j]);
        }
        const int row = r0 + r;
        const float mx = std::max(m[row], _mm512_reduce_max_ps(mxv));
        const float alpha = std::exp(m[row] - mx);  // 0 on the first tile (m = -inf)
        const __m512 mx16 = _mm512_set1_ps(mx);
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < width / 16; ++j) {
          const __m512 e = _mm512_maskz_mov_ps(mk[j], exp16(_mm512_sub_ps(sv[j], mx16)));
          sum = _mm512_add_ps(sum, e);
          const __m512 hi = rnd16(e);
          store16(pr + 16 * j, hi);
          store16(pr + 16 * kKeyTile + 16 * j, rnd16(_mm512_sub_ps(e, hi)));
        }
        l[row] = l[row] * alpha + _mm512_reduce_add_ps(sum);
        m[row] = mx;
        if (alpha != 1.f) {
          const __m512 a16 = _mm512_set1_ps(alpha);
          float* orow = O + (size_t)row * D;
          for (int d = 0; d < D; d += 16) _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), a16));
        }
      }
      // O += P V, for P's high part then its low part, 64 output dims at a time: tiles 0-3 accumulate them
      // (loaded from O: four independent chains, where one tile per 16 dims in turn left each product waiting
      // on the last), 4 / 6 hold the part's two 32-key halves, 5 / 7 the values.
      constexpr int64_t p_bytes = kKeyTile * sizeof(bf16);
      const bool two = width > 32;
      for (int part = 0; part < 2; ++part) {
        _tile_loadd(4, P + part * 16 * kKeyTile, p_bytes);
        if (two) _tile_loadd(6, P + part * 16 * kKeyTile + 32, p_bytes);
        for (int cv0 = 0; cv0 < CV; cv0 += 4) {
          const int nc = std::min(4, CV - cv0);
          float* oc = O + (size_t)r0 * D + 16 * cv0;
          const bf16* vt = vb + ((size_t)(k0 / 32) * CV + cv0) * kTileElems;  // 32 keys' values, dims 16 cv0..
          const bf16* vt2 = vt + (size_t)CV * kTileElems;                     // the next 32 keys'
#define NANOINFER_PV(t)                                      \
  if (nc > t) {                                              \
    _tile_loadd(t, oc + 16 * t, o_bytes);                    \
    _tile_loadd(5, vt + (size_t)t * kTileElems, 64);         \
    _tile_dpbf16ps(t, 4, 5);                                 \
    if (two) {                                               \
      _tile_loadd(7, vt2 + (size_t)t * kTileElems, 64);      \
      _tile_dpbf16ps(t, 6, 7);                               \
    }                                                        \
  }
          NANOINFER_PV(0) NANOINFER_PV(1) NANOINFER_PV(2) NANOINFER_PV(3)
#undef NANOINFER_PV
          _tile_stored(0, oc, o_bytes);
          if (nc > 1) _tile_stored(1, oc + 16, o_bytes);
          if (nc > 2) _tile_stored(2, oc + 32, o_bytes);
          if (nc > 3) _tile_stored(3, oc + 48, o_bytes);
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    bf16* dst = out + (c.q_start + p0 + r / G) * out_stride + (int64_t)(h * G + r % G) * D;
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int d = 0; d < D; d += 16) store16(dst + d, rnd16(_mm512_mul_ps(_mm512_loadu_ps(O + (size_t)r * D + d), inv)));
  }
}
#endif

}  // namespace

void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                   torch::Tensor q_starts, torch::Tensor q_lens, torch::Tensor seq_lens, double scale,
                   torch::Tensor out, int64_t window, double soft_cap, const c10::optional<torch::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_prefill: query rows");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "paged_prefill: out like the queries");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "paged_prefill: out in the queries' dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_prefill: contiguous key and value caches of one dtype");
  const int Hq = q.size(1), D = q.size(2), bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0 && bs % kKeyTile == 0 && D % NR == 0,
              "paged_prefill: head sizes, or a block size not a multiple of 64");
  const float* sp = sink_logits(sinks, Hq, "paged_prefill");
  const auto tables = block_tables.contiguous(), starts = q_starts.contiguous();
  const auto qlens = q_lens.contiguous(), lens = seq_lens.contiguous();
  const int n = starts.numel(), mb = tables.size(1);
  TORCH_CHECK(qlens.numel() == n && lens.numel() == n && tables.size(0) == n, "paged_prefill: one row per chunk");
  std::vector<Chunk> chunks(n);
  std::vector<std::array<int, 3>> items;  // (chunk, first position, KV head)
  for (int i = 0; i < n; ++i) {  // checked here: nothing may throw inside the parallel loop
    chunks[i] = {starts.data_ptr<int>()[i], qlens.data_ptr<int>()[i], lens.data_ptr<int>()[i],
                 tables.data_ptr<int>() + (size_t)i * mb};
    const Chunk& c = chunks[i];
    TORCH_CHECK(c.q_len >= 1 && c.q_len <= c.seq_len && (c.seq_len + bs - 1) / bs <= mb &&
                    c.q_start + c.q_len <= q.size(0),
                "paged_prefill: chunk ", i, " out of range");
    for (int p = 0; p < c.q_len; p += kQueryTile)
      for (int h = 0; h < Hkv; ++h) items.push_back({i, p, h});
  }
  // The longest items first (the last positions of the longest prompts see the most keys), so the dynamic
  // schedule does not end on one thread working through a long item alone.
  std::stable_sort(items.begin(), items.end(), [&](const auto& x, const auto& y) {
    return chunks[x[0]].seq_len - chunks[x[0]].q_len + x[1] > chunks[y[0]].seq_len - chunks[y[0]].q_len + y[1];
  });
#ifdef NANOINFER_AMX
  // The AMX path attends causally, uncapped and without sinks: a window, a soft cap or sinks take the float path
  // below.
  if (q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 && D % 32 == 0 && window == 0 &&
      soft_cap == 0 && sp == nullptr && amx_permitted()) {
    // Keys and values packed as tiles (pack_kv_amx), per chunk and KV head, kKeyTile-padded.
    const PackedLayout lay(chunks, kKeyTile, D, Hkv);
    const std::vector<int64_t>& offsets = lay.offsets;
    const std::vector<int64_t>& sizes = lay.sizes;
    const int64_t total = lay.total;
    static thread_local std::vector<bf16> kv_tiles;
    if ((int64_t)kv_tiles.size() < 2 * total) kv_tiles.resize(2 * total);
    bf16* kb = kv_tiles.data();
    bf16* vb = kb + total;
    const bf16* qp = q.data_ptr<bf16>();
    const bf16* kp = k_cache.data_ptr<bf16>();
    const bf16* vp = v_cache.data_ptr<bf16>();
    bf16* op = out.data_ptr<bf16>();
    #pragma omp parallel
    {
      load_tile_config();
      #pragma omp for schedule(dynamic, 1)
      for (int ih = 0; ih < n * Hkv; ++ih) {
        const int i = ih / Hkv, h = ih % Hkv;
        const int64_t off = offsets[i] + h * sizes[i];
        pack_kv_amx(kp, vp, chunks[i], h, Hkv, D, bs, kb + off, vb + off);
      }
      std::vector<float> work;
      std::vector<bf16> qwork;
      #pragma omp for schedule(dynamic, 1)
      for (size_t it = 0; it < items.size(); ++it) {
        const auto [i, p0, h] = items[it];
        const Chunk& c = chunks[i];
        const int64_t off = offsets[i] + h * sizes[i];
        attend_amx(qp, q.stride(0), kb + off, vb + off, op, out.stride(0), c, p0, std::min(c.q_len, p0 + kQueryTile),
                   h, Hq / Hkv, D, (float)scale, work, qwork);
      }
      _tile_release();
    }
    return;
  }
#endif
  // Every chunk's keys, transposed (pack_keys), in one buffer reused across calls on the calling thread (a
  // fresh one would be page-faulted in on every layer).
  const PackedLayout kt_lay(chunks, NR, D, Hkv);
  const std::vector<int64_t>& kt_offsets = kt_lay.offsets;
  const std::vector<int64_t>& kt_sizes = kt_lay.sizes;
  const int64_t kt_total = kt_lay.total;
  static thread_local std::vector<float> kt_buffer;
  if ((int64_t)kt_buffer.size() < kt_total) kt_buffer.resize(kt_total);
  float* keys_t = kt_buffer.data();
  with_typed<false>(q, "paged_prefill queries", [&](auto* qp) {
    using TQ = std::remove_pointer_t<decltype(qp)>;
    with_typed<true>(k_cache, "paged_prefill cache", [&](auto* kp) {
      using TC = std::remove_pointer_t<decltype(kp)>;
      const TC* vp = static_cast<const TC*>(v_cache.data_ptr());
      TQ* op = out.data_ptr<TQ>();
      #pragma omp parallel
      {
        #pragma omp for schedule(dynamic, 1)
        for (int ih = 0; ih < n * Hkv; ++ih)
          pack_keys(kp, chunks[ih / Hkv], ih % Hkv, Hkv, D, bs, keys_t + kt_offsets[ih / Hkv] + (ih % Hkv) * kt_sizes[ih / Hkv]);
        // (implicit barrier: every chunk's keys are packed before any item reads them)
        std::vector<float> work;
        #pragma omp for schedule(dynamic, 1)
        for (size_t it = 0; it < items.size(); ++it) {
          const auto [i, p0, h] = items[it];
          const Chunk& c = chunks[i];
          attend(qp, q.stride(0), keys_t + kt_offsets[i] + h * kt_sizes[i], vp, op, out.stride(0), c, p0,
                 std::min(c.q_len, p0 + kQueryTile), h, Hq / Hkv, Hkv, D, bs, (float)scale, (int)window,
                 (float)soft_cap, sp, work);
        }
      }
    });
  });
}
