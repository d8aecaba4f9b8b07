// Paged decode attention for CPU: each sequence reads its keys and values in place from the paged cache
// (no gathered copy), computes the scores of every query head against its KV head, a softmax in float32,
// and the weighted sum of values.
// Layouts as in reference.py: q [B, H_q, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D].
//
// Speed: decode reads every cached K/V row of every running sequence once per layer, so this loop is the
// step's biggest cost after the linears: whole cache rows per token, vectorized dot products, exponentials
// and value sums, several times faster than a KV head per work item with plain loops (benchmarks/README.md).
// Other CPUs take the portable scalar path, with the same results up to float32 rounding.
// The cache may be bfloat16 or fp8 (e4m3 / e5m2) under float32 queries (kv_cache_dtype): each element is
// widened in registers, and the whole-row reads move a half or a quarter of the bytes.
#include "amx.h"

#include <type_traits>

// The attention sinks' logits (gpt-oss), float32 [Hq], as the kernels read them; null for none. Also read by
// csrc/prefill_attention.cpp.
const float* sink_logits(const c10::optional<torch::Tensor>& sinks, int Hq, const char* what) {
  if (!sinks.has_value() || !sinks->defined()) return nullptr;
  TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == Hq, what,
              ": sinks as contiguous float32 [", Hq, "], got ", sinks->scalar_type(), " ", sinks->sizes());
  return sinks->data_ptr<float>();
}

// The softmax's max with a head's attention sink (gpt-oss) in it: the sink is one more logit, with no value.
static inline float with_sink(float max, const float* sinks, int qh) {
  return sinks != nullptr ? std::max(max, sinks[qh]) : max;
}

// The sink's term of the softmax's sum (0 without sinks).
static inline float sink_term(float max, const float* sinks, int qh) {
  return sinks != nullptr ? std::exp(sinks[qh] - max) : 0.f;
}

#ifdef NANOINFER_AVX2
// Each pass over the cache asks for the rows this many tokens ahead (their heads [h0, h1)) while it works on
// the current one: the hardware prefetcher alone left memory bandwidth unused; 3-8 rows ahead all paid
// (benchmarks/README.md; 4 here, a row is 768 bytes for SmolLM2).
constexpr int kPrefetchRows = 4;

// Asks for heads [h0, h1) of the row at `row` (a token's whole row of KV heads): into L1 (_MM_HINT_T0), or
// with _MM_HINT_T1 into L2 only. (`auto`: the hints are an enum in GCC's headers, ints in Clang's.)
template <auto HINT = _MM_HINT_T0, typename T>
static inline void prefetch_row(const T* row, int h0, int h1, int D) {
  const char* p = reinterpret_cast<const char*>(row + (size_t)h0 * D);
  const size_t bytes = (size_t)(h1 - h0) * D * sizeof(T);
  for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, HINT);
}

// The attention-logit soft cap (Gemma 2) on a head's scaled scores, in place: cap * tanh(s / cap); returns the
// capped max (tanh is increasing, so the max's image is the new max).
static inline float cap_scores(float* s, int len, float max, float cap) {
  for (int t = 0; t < len; ++t) s[t] = cap * std::tanh(s[t] / cap);
  return cap * std::tanh(max / cap);
}

// exp(s - m) for a head's `len` scores, in place; returns their sum.
static inline float softmax_numerators(float* sq, int len, float max) {
  const __m256 m = _mm256_set1_ps(max);
  __m256 sum8 = _mm256_setzero_ps();
  int t = 0;
  for (; t + 8 <= len; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sq + t), m));
    _mm256_storeu_ps(sq + t, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum(sum8);
  for (; t < len; ++t) {
    sq[t] = std::exp(sq[t] - max);
    sum += sq[t];
  }
  return sum;
}

// One sequence, KV heads [h0, h1): qf [Hq, D] pre-scaled queries; scores [Hq, len] scratch; acc [Hq, D] out.
// Token-major: each token's row holds all KV heads side by side (Hkv * D contiguous elements), and reading
// whole rows is what this machine's memory does well; one head's slice of every row (a 256-byte read every
// 768 bytes) measured 3x slower per byte than the whole rows.
template <typename T>
static void attend_avx2(const float* qf, const T* k, const T* v, const size_t* rows, int len, int G, int D,
                        int Hkv, int h0, int h1, float* scores, float* acc, float soft_cap = 0.f,
                        const float* sinks = nullptr) {
  const int chunks = D / 8;
  const int Hq = Hkv * G;
  std::vector<float> maxes(Hq, -INFINITY);
  // A narrower cache's key slice is widened once into kf and read by the G query heads from there (widening
  // it per head cost more than the bytes saved: an fp8 cache ran W's decode slower than a bfloat16 one).
  alignas(32) float kf[256];
  for (int t = 0; t < len; ++t) {
    const T* row = k + rows[t];
    if (t + kPrefetchRows < len) prefetch_row(k + rows[t + kPrefetchRows], h0, h1, D);
    for (int h = h0; h < h1; ++h) {
      const float* kp;
      if constexpr (std::is_same_v<T, float>) {
        kp = row + (size_t)h * D;
      } else {
        for (int c = 0; c < chunks; ++c) _mm256_store_ps(kf + 8 * c, load8(row + (size_t)h * D + 8 * c));
        kp = kf;
      }
      for (int g = 0; g < G; ++g) {
        const int qh = h * G + g;
        const float* qg = qf + qh * D;
        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(kp));
        for (int c = 1; c < chunks; ++c)
          s = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), _mm256_loadu_ps(kp + 8 * c), s);
        const float score = hsum(s);
        scores[(size_t)qh * len + t] = score;
        maxes[qh] = std::max(maxes[qh], score);
      }
    }
  }
  // Softmax numerators in place; 1/sum is applied to the output at the end.
  std::vector<float> inv_sums(Hq);
  for (int qh = h0 * G; qh < h1 * G; ++qh) {
    float* sq = scores + (size_t)qh * len;
    const float m = with_sink(soft_cap > 0.f ? cap_scores(sq, len, maxes[qh], soft_cap) : maxes[qh], sinks, qh);
    inv_sums[qh] = 1.f / (softmax_numerators(sq, len, m) + sink_term(m, sinks, qh));
  }
  std::fill(acc + (size_t)h0 * G * D, acc + (size_t)h1 * G * D, 0.f);
  for (int t = 0; t < len; ++t) {
    const T* row = v + rows[t];
    if (t + kPrefetchRows < len) prefetch_row(v + rows[t + kPrefetchRows], h0, h1, D);
    for (int h = h0; h < h1; ++h) {
      const T* vp = row + (size_t)h * D;
      for (int c = 0; c < chunks; ++c) {
        const __m256 vc = load8(vp + 8 * c);
        for (int g = 0; g < G; ++g) {
          const int qh = h * G + g;
          float* a = acc + qh * D + 8 * c;
          _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(scores[(size_t)qh * len + t]), vc, _mm256_loadu_ps(a)));
        }
      }
    }
  }
  for (int qh = h0 * G; qh < h1 * G; ++qh)
    for (int d = 0; d < D; ++d) acc[qh * D + d] *= inv_sums[qh];
}
#endif

#ifdef NANOINFER_AVX512
// The 8 horizontal sums of 8 vectors, in order.
static inline __m256 hsum8x8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// One token's key dots for float32 queries (pre-scaled, [Hq, D]) over a float32 cache or a narrower one widened
// in registers, parked as attend_avx512 parks them: KV heads [h0, h1) of the token's cache row. Each key slice
// is loaded into registers once for its G query heads, which read their queries from L1. C16 = D / 16 as a
// constant (0: `chunks` at run time, at most 16), so the chunk loops unroll: with the chunk count a run-time
// bound every dot was a short loop, and several rows of a sequence run as one (G = rows x heads a KV head)
// were bound by the core, not the cache's bytes (float32, 4 rows a sequence: twice one row's time).
// Each dot is the same multiply and chain of FMAs over its chunks as before, so the same bits.
// pk / pv (or null): the key and value rows (`lines` 64-byte lines each, from head h0) of the token
// kPrefetchRows ahead, asked for here two lines a query head's dot (keys into L1, values into L2), the rest
// at the end. Asked for all at once before the dots, they waited for line-fill buffers with the dots queued
// behind them (half of the pass's samples); spread out, the pass ran faster (benchmarks/README.md).
template <int C16, typename T>
static inline void key_dots_f32(const T* row, const float* qf, int h0, int h1, int G, int chunks, int q0, int i,
                                float* parked, const char* pk = nullptr, const char* pv = nullptr, int lines = 0) {
  constexpr int MAXC = C16 > 0 ? C16 : 16;
  const int C = C16 > 0 ? C16 : chunks;
  const int D = 16 * C;
  int issued = 0;  // of 2 * lines: the keys' into L1, then the values' into L2
  auto ask = [&] {
    if (issued < lines)
      _mm_prefetch(pk + 64 * issued, _MM_HINT_T0);
    else
      _mm_prefetch(pv + 64 * (issued - lines), _MM_HINT_T1);
    ++issued;
  };
  for (int h = h0; h < h1; ++h) {
    __m512 kc[MAXC];
    for (int c = 0; c < C; ++c) kc[c] = load16(row + (size_t)h * D + 16 * c);
    for (int g = 0; g < G; ++g) {
      if (pk != nullptr)
        for (int n = 0; n < 2 && issued < 2 * lines; ++n) ask();
      const int qh = h * G + g;
      const float* qg = qf + (size_t)qh * D;
      __m512 d = _mm512_mul_ps(_mm512_loadu_ps(qg), kc[0]);
      for (int c = 1; c < C; ++c) d = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kc[c], d);
      _mm256_storeu_ps(parked + ((qh - q0) * 8 + i) * 8, _mm256_add_ps(low8(d), high8(d)));
    }
  }
  while (pk != nullptr && issued < 2 * lines) ask();  // what too few query heads left unasked
}

#if defined(__AVX512BF16__)
// One token's key dots for bfloat16 queries over a bfloat16 cache (vdpbf16ps), parked as attend_avx512 parks
// them: KV heads [h0, h1) of the token's cache row, each slice loaded once for its G query heads. C32 = D / 32
// as a constant (0: read D at run time), so the chunk loop unrolls and each head's two or four products form
// one short chain; with D a run-time bound the loop was not unrolled and this pass ran at ~9 GB/s.
template <int C32>
static inline void key_dots_bf16(const at::BFloat16* row, const at::BFloat16* qb, int h0, int h1, int G, int D,
                                 int q0, int i, float* parked, float scale) {
  const int chunks = C32 > 0 ? C32 : D / 32;
  const __m256 scale8 = _mm256_set1_ps(scale);
  for (int h = h0; h < h1; ++h) {
    const at::BFloat16* kp = row + (size_t)h * D;
    for (int g = 0; g < G; ++g) {
      const int qh = h * G + g;
      const at::BFloat16* qg = qb + (size_t)qh * D;
      __m512 d = _mm512_setzero_ps();
      for (int c = 0; c < chunks; ++c)
        d = _mm512_dpbf16_ps(d, (__m512bh)_mm512_loadu_si512(qg + 32 * c), (__m512bh)_mm512_loadu_si512(kp + 32 * c));
      _mm256_storeu_ps(parked + ((qh - q0) * 8 + i) * 8, _mm256_mul_ps(_mm256_add_ps(low8(d), high8(d)), scale8));
    }
  }
}
#endif

// Part of value_pass_blocked: query heads [qa, qa + N) of KV head h over tokens [t0, t1), their N x C
// accumulators (at most 24 zmm) held in registers for the whole block. The 4-token loop of value_pass_avx512
// loads and stores each accumulator every 4 FMAs: with several rows of a sequence run as one (G = rows x
// heads a KV head) it was bound by those loads and stores, not by the cache's bytes. `prefetch`: ask for the
// rows kPrefetchRows tokens ahead (the first head group of a block does).
template <int C, int N, typename T>
static inline void value_block(const T* v, const size_t* rows, int len, int t0, int t1, int h, int h0, int h1, int qa,
                               int q0, const float* const* probs, float* acc, bool prefetch) {
  constexpr int D = 16 * C;
  __m512 a[N][C];
  for (int j = 0; j < N; ++j)
    for (int c = 0; c < C; ++c) a[j][c] = _mm512_loadu_ps(acc + (size_t)(qa + j) * D + 16 * c);
  const float* p[N];
  for (int j = 0; j < N; ++j) p[j] = probs[qa + j - q0];
  for (int t = t0; t < t1; ++t) {
    if (prefetch && t + kPrefetchRows < len) prefetch_row(v + rows[t + kPrefetchRows], h0, h1, D);
    const T* vp = v + rows[t] + (size_t)h * D;
    __m512 vc[C];
    for (int c = 0; c < C; ++c) vc[c] = load16(vp + 16 * c);
    for (int j = 0; j < N; ++j) {
      const __m512 pj = _mm512_set1_ps(p[j][t]);
      for (int c = 0; c < C; ++c) a[j][c] = _mm512_fmadd_ps(pj, vc[c], a[j][c]);
    }
  }
  for (int j = 0; j < N; ++j)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (size_t)(qa + j) * D + 16 * c, a[j][c]);
}

// value_pass_avx512 for D = 16 C (query head qh's probabilities at probs[qh - q0][t], as there):
// tokens in blocks of 32, whose value rows stay in L1 for the head groups after the first; each group of
// N = 24 / C query heads keeps its accumulators in registers over a block. Each output element still sums its tokens in order, one FMA each:
// the same bits. Faster than the 4-token loop for several rows a sequence, level for one (benchmarks/README.md).
// (attend_amx has a value pass of its own on tiles, value_pass_amx.)
template <int C, typename T>
static void value_pass_blocked(const T* v, const size_t* rows, int len, int G, int h0, int h1,
                               const float* const* probs, float* acc) {
  constexpr int D = 16 * C, N = 24 / C, TB = 32;
  const int q0 = h0 * G;
  std::fill(acc + (size_t)q0 * D, acc + (size_t)h1 * G * D, 0.f);
  for (int t0 = 0; t0 < len; t0 += TB) {
    const int t1 = std::min(len, t0 + TB);
    for (int h = h0; h < h1; ++h)
      for (int g = 0; g < G; g += N) {
        const int qa = h * G + g, n = std::min(N, G - g);
        const bool pf = h == h0 && g == 0;
        if (n == N) {
          value_block<C, N>(v, rows, len, t0, t1, h, h0, h1, qa, q0, probs, acc, pf);
          continue;
        }
        switch (n) {  // the last group of a KV head's query heads
#define NANOINFER_GROUP(k) \
  case k: if constexpr (k < N) value_block<C, k>(v, rows, len, t0, t1, h, h0, h1, qa, q0, probs, acc, pf); break;
          NANOINFER_GROUP(1) NANOINFER_GROUP(2) NANOINFER_GROUP(3) NANOINFER_GROUP(4) NANOINFER_GROUP(5)
#undef NANOINFER_GROUP
          default: break;
        }
      }
  }
}

// The value pass of one sequence, KV heads [h0, h1): acc [Hq, D] (query heads [h0 G, h1 G)) = the sum over its
// tokens of p(qh, t) times the token's value row, where p(qh, t) = probs[qh - h0 G][t] (the softmax
// numerators). 4 tokens at a time, so each accumulator is loaded
// and stored once per 4 FMAs; each output element still sums its tokens in order.
template <typename T>
static void value_pass_avx512(const T* v, const size_t* rows, int len, int G, int D, int h0, int h1,
                              const float* const* probs, float* acc) {
  const int C = D / 16;
  const int q0 = h0 * G, q1 = h1 * G;
  std::fill(acc + (size_t)q0 * D, acc + (size_t)q1 * D, 0.f);
  int t = 0;
  for (; t + 4 <= len; t += 4) {
    const T* r0 = v + rows[t];
    const T* r1 = v + rows[t + 1];
    const T* r2 = v + rows[t + 2];
    const T* r3 = v + rows[t + 3];
    for (int i = 0; i < 4; ++i)
      if (t + i + kPrefetchRows < len) prefetch_row(v + rows[t + i + kPrefetchRows], h0, h1, D);
    for (int h = h0; h < h1; ++h) {
      const size_t off = (size_t)h * D;
      for (int c = 0; c < C; ++c) {
        const __m512 v0 = load16(r0 + off + 16 * c), v1 = load16(r1 + off + 16 * c);
        const __m512 v2 = load16(r2 + off + 16 * c), v3 = load16(r3 + off + 16 * c);
        for (int g = 0; g < G; ++g) {
          const int qh = h * G + g;
          const float* p = probs[qh - q0] + t;
          float* a = acc + qh * D + 16 * c;
          __m512 x = _mm512_loadu_ps(a);
          x = _mm512_fmadd_ps(_mm512_set1_ps(p[0]), v0, x);
          x = _mm512_fmadd_ps(_mm512_set1_ps(p[1]), v1, x);
          x = _mm512_fmadd_ps(_mm512_set1_ps(p[2]), v2, x);
          x = _mm512_fmadd_ps(_mm512_set1_ps(p[3]), v3, x);
          _mm512_storeu_ps(a, x);
        }
      }
    }
  }
  for (; t < len; ++t) {
    const T* row = v + rows[t];
    for (int h = h0; h < h1; ++h)
      for (int c = 0; c < C; ++c) {
        const __m512 vc = load16(row + (size_t)h * D + 16 * c);
        for (int g = 0; g < G; ++g) {
          const int qh = h * G + g;
          float* a = acc + qh * D + 16 * c;
          _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(probs[qh - q0][t]), vc, _mm512_loadu_ps(a)));
        }
      }
  }
}

// attend_avx2's algorithm in about a quarter of its instructions, so that the cache's bytes, not the core,
// set the pace (a bfloat16 cache ran at under half the memory's rate with the AVX2 loop):
// - scores: 16-lane dot products, each folded to 8 lanes and parked; every 8 tokens one transposing
//   reduction (hsum8x8) gives a head's 8 scores, where the AVX2 loop reduced each dot on its own;
// - values: value_pass_avx512 (4 tokens at a time).
//
// qb: where both the queries and the cache are bfloat16 and the CPU has AVX512-BF16 but no AMX (else
// attend_amx runs), the unscaled bfloat16
// queries of this sequence ([Hq, D], D a multiple of 32), else null. The key dots then multiply bfloat16
// pairs straight from the cache (vdpbf16ps: exact products, float32 sums) and scale the sum, instead of
// widening each key slice to float32 first; bfloat16 W's attention was bound by that widening.
//
// col_lens (or null): each query head's own context length (indexed like the scores' heads), for several rows
// of one sequence run as one row with more query heads a KV head (decode_impl): a head's scores past its
// length count for nothing, out of its max and exact zeros in its value sums, so its bits are its row's alone.
template <typename T>
static void attend_avx512(const float* qf, const T* k, const T* v, const size_t* rows, int len, int G, int D,
                          int h0, int h1, float* scores, float* acc,
                          const at::BFloat16* qb = nullptr, float scale = 1.f, const int* col_lens = nullptr,
                          float soft_cap = 0.f, const float* sinks = nullptr) {
  const int C = D / 16;
  const int q0 = h0 * G, q1 = h1 * G, nq = q1 - q0;
  static thread_local std::vector<float> parked_buf, max_buf;
  if ((int)parked_buf.size() < nq * 64) parked_buf.resize(nq * 64);
  if ((int)max_buf.size() < nq * 8) max_buf.resize(nq * 8);
  float* parked = parked_buf.data();  // [nq][8 tokens][8 lanes]
  float* maxes8 = max_buf.data();     // [nq][8]: running maxima, lane-wise
  std::fill(maxes8, maxes8 + nq * 8, -INFINITY);
  const bool spread = qb == nullptr && (C == 4 || C == 8);  // key_dots_f32 asks for the rows ahead itself
  const int lines = (int)(((size_t)(h1 - h0) * D * sizeof(T) + 63) / 64);  // of a row's heads [h0, h1)
  for (int t0 = 0; t0 < len; t0 += 8) {
    const int nt = std::min(8, len - t0);
    for (int i = 0; i < nt; ++i) {
      const int t = t0 + i;
      const T* row = k + rows[t];
      const bool ahead = t + kPrefetchRows < len;
      if (!spread && ahead) {
        prefetch_row(k + rows[t + kPrefetchRows], h0, h1, D);
        // The value rows too, into L2 (a sequence's fit there), for the value pass after the softmax: it
        // then reads them from cache, where its own requests 4 rows ahead waited on DRAM.
        prefetch_row<_MM_HINT_T1>(v + rows[t + kPrefetchRows], h0, h1, D);
      }
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (qb != nullptr) {
          switch (D / 32) {
            case 1: key_dots_bf16<1>(row, qb, h0, h1, G, D, q0, i, parked, scale); break;
            case 2: key_dots_bf16<2>(row, qb, h0, h1, G, D, q0, i, parked, scale); break;
            case 4: key_dots_bf16<4>(row, qb, h0, h1, G, D, q0, i, parked, scale); break;
            default: key_dots_bf16<0>(row, qb, h0, h1, G, D, q0, i, parked, scale); break;
          }
          continue;
        }
      }
#endif
      const char* pk = ahead ? reinterpret_cast<const char*>(k + rows[t + kPrefetchRows] + (size_t)h0 * D) : nullptr;
      const char* pv = ahead ? reinterpret_cast<const char*>(v + rows[t + kPrefetchRows] + (size_t)h0 * D) : nullptr;
      switch (C) {
        case 4: key_dots_f32<4>(row, qf, h0, h1, G, C, q0, i, parked, pk, pv, lines); break;
        case 8: key_dots_f32<8>(row, qf, h0, h1, G, C, q0, i, parked, pk, pv, lines); break;
        default: key_dots_f32<0>(row, qf, h0, h1, G, C, q0, i, parked); break;
      }
    }
    for (int j = 0; j < nq; ++j) {
      __m256 lanes[8];
      for (int i = 0; i < 8; ++i) lanes[i] = i < nt ? _mm256_loadu_ps(parked + (j * 8 + i) * 8) : _mm256_setzero_ps();
      __m256 s = hsum8x8(lanes);
      float* out = scores + (size_t)(q0 + j) * len + t0;
      // Tokens of this block in the max: nt, or fewer where this head's own length ends sooner.
      const int live = col_lens ? std::clamp(col_lens[q0 + j] - t0, 0, nt) : nt;
      if (nt == 8) {
        _mm256_storeu_ps(out, s);
      } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, s);
        std::copy(tmp, tmp + nt, out);
      }
      if (live < 8) {
        s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s,
                             _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(live),
                                                                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
      }
      _mm256_storeu_ps(maxes8 + j * 8, _mm256_max_ps(_mm256_loadu_ps(maxes8 + j * 8), s));
    }
  }
  std::vector<float> inv_sums(nq);
  for (int j = 0; j < nq; ++j) {
    float m = *std::max_element(maxes8 + j * 8, maxes8 + j * 8 + 8);
    float* sj = scores + (size_t)(q0 + j) * len;
    const int own = col_lens ? col_lens[q0 + j] : len;
    if (soft_cap > 0.f) m = cap_scores(sj, own, m, soft_cap);
    m = with_sink(m, sinks, q0 + j);
    inv_sums[j] = 1.f / (softmax_numerators(sj, own, m) + sink_term(m, sinks, q0 + j));
    std::fill(sj + own, sj + len, 0.f);
  }
  std::vector<const float*> probs(nq);
  for (int j = 0; j < nq; ++j) probs[j] = scores + (size_t)(q0 + j) * len;
  if (D == 64)
    value_pass_blocked<4>(v, rows, len, G, h0, h1, probs.data(), acc);
  else if (D == 128)
    value_pass_blocked<8>(v, rows, len, G, h0, h1, probs.data(), acc);
  else
    value_pass_avx512(v, rows, len, G, D, h0, h1, probs.data(), acc);
  for (int j = 0; j < nq; ++j)
    for (int d = 0; d < D; ++d) acc[(q0 + j) * D + d] *= inv_sums[j];
}
#endif

#ifdef NANOINFER_AMX
// 16 x 16 dwords transposed in registers: element j of r[i] becomes element i of r[j]. Three rounds of
// shuffles (dwords, then qwords within 128-bit lanes, then the lanes), 64 instructions.
static inline void transpose16x16_epi32(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4 g + m], lane L: column m + 4 L of rows 4 g .. 4 g + 3.
  __m512i u[16];
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), v1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
    r[m] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[m + 4] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[m + 8] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[m + 12] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

// The value pass on AMX for one group of attend_amx (KV heads [a, b), their query heads the 16 columns of
// the key pass's scores, sg [token][16], the softmax numerators): acc[qh] (absolute query head, [D] each) =
// sum over tokens of p(qh, t) v(t). One tile product per 32 tokens and 16 value dims serves the group's
// query heads at once, where the AVX-512 pass ran an FMA per token, query head and 16 dims.
// - A: the probabilities as 16 rows (columns of sg) of 32 tokens, in two bfloat16 parts p = hi + lo (hi
//   rounded, lo the rest rounded), as the prefill's second product takes them: ~16 of p's bits (one rounding
//   of p cost the prefill a third of its correctly rounded outputs).
// - B: 32 tokens' values of one KV head, 16 dims a tile, tokens 2 i and 2 i + 1 interleaved dim by dim in
//   row i; padding tokens past `len` are zeros.
// - C: 16 x 16 float32 sums per 16 dims, in tiles over all blocks (64 dims at a time). Rows of another KV
//   head's query heads multiply this head's values too; those rows are never read (a tile row's sums depend
//   on its own A row alone, so every query head's bits are the same whatever shares its tile: a run of rows
//   as one, or not).
// Tokens go in blocks of 32 from the first, each block's products added hi then lo: a fixed order per query
// head. Tiles: 0-3 sums, 4 / 5 the parts, 6 the values.
// Faster for sequences of several rows (speculation), level for lone rows except very few of them (a tile
// product costs the same for 3 live rows as for 16; benchmarks/README.md). The key pass asks for the value rows too (into L2): left to this
// pass, its requests queued behind each other and lone rows ran 10% slower than the AVX-512 pass.
static void value_pass_amx(const at::BFloat16* v, const size_t* rows, int len, int G, int D, int a, int b,
                           const float* sg, float* acc) {
  using bf16 = at::BFloat16;
  const int CV = D / 16, nblk = (len + 31) / 32;
  static thread_local std::vector<bf16> ptile_buf, vtile_buf;
  static thread_local std::vector<float> cstage_buf;
  ptile_buf.resize((size_t)nblk * 2 * kTileElems);
  vtile_buf.resize((size_t)8 * kTileElems);
  cstage_buf.resize((size_t)16 * 64);
  bf16* ptiles = ptile_buf.data();  // [block][hi, lo][16 columns][32 tokens]
  bf16* vtile = vtile_buf.data();
  float* cstage = cstage_buf.data();  // [16 columns][64 dims]
  // A tiles of every block, rows = sg's columns, each 32 tokens' parts in order (zero past len). With the
  // group's query heads in at most 8 of the 16 columns (lone rows and split heads: G = 3 here), each live
  // column is gathered on its own; otherwise every column goes at once, dword i of phi[c] / plo[c] holding
  // tokens t0 + 2 i and t0 + 2 i + 1, transposed in registers. Both give a column the same bits. Dead
  // columns' rows are left as they are: they only reach sums nobody reads.
  const int live = (b - a) * G;
  const __m512i stride16 = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));
  for (int blk = 0; blk < nblk; ++blk) {
    const int t0 = 32 * blk;
    bf16* pt = ptiles + (size_t)blk * 2 * kTileElems;
    if (live <= 8) {
      const int n0 = std::clamp(len - t0, 0, 16), n1 = std::clamp(len - t0 - 16, 0, 16);
      const __mmask16 m0 = (__mmask16)((1u << n0) - 1), m1 = (__mmask16)((1u << n1) - 1);
      for (int c = 0; c < live; ++c) {
        const float* base = sg + (size_t)t0 * 16 + c;
        const __m512 x0 = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m0, stride16, base, 4);
        const __m512 x1 = n1 ? _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m1, stride16, base + 256, 4)
                             : _mm512_setzero_ps();
        const __m512 h0 = rnd16(x0), h1 = rnd16(x1);
        const __m512 l0 = rnd16(_mm512_sub_ps(x0, h0)), l1 = rnd16(_mm512_sub_ps(x1, h1));
        store16(pt + 32 * c, h0);
        store16(pt + 32 * c + 16, h1);
        store16(pt + kTileElems + 32 * c, l0);
        store16(pt + kTileElems + 32 * c + 16, l1);
      }
      continue;
    }
    __m512i phi[16], plo[16];
    for (int i = 0; i < 16; ++i) {
      const int t = t0 + 2 * i;
      const __m512 x0 = t < len ? _mm512_loadu_ps(sg + (size_t)t * 16) : _mm512_setzero_ps();
      const __m512 x1 = t + 1 < len ? _mm512_loadu_ps(sg + (size_t)(t + 1) * 16) : _mm512_setzero_ps();
      const __m512 h0 = rnd16(x0), h1 = rnd16(x1);
      const __m512i l0 = _mm512_castps_si512(rnd16(_mm512_sub_ps(x0, h0)));
      const __m512i l1 = _mm512_castps_si512(rnd16(_mm512_sub_ps(x1, h1)));
      phi[i] = _mm512_or_si512(_mm512_castps_si512(h1), _mm512_srli_epi32(_mm512_castps_si512(h0), 16));
      plo[i] = _mm512_or_si512(l1, _mm512_srli_epi32(l0, 16));
    }
    transpose16x16_epi32(phi);
    transpose16x16_epi32(plo);
    for (int c = 0; c < 16; ++c) {
      _mm512_storeu_si512(pt + 32 * c, phi[c]);
      _mm512_storeu_si512(pt + kTileElems + 32 * c, plo[c]);
    }
  }
  // B tiles of head h, tokens t0.. (see above), into vt: row i of tile j pairs tokens t0 + 2 i and t0 + 2 i + 1,
  // dim by dim, for 16 of the dims [16 cv0, 16 (cv0 + nc)). An unpack interleaves within 128-bit lanes, so a
  // 32-dim load of both tokens gives tile 2 c the dims 32 c + {0-3, 8-11, 16-19, 24-27} and tile 2 c + 1 the
  // rest; the sums are put back in order when they leave the tiles. In-order rows (permutex2var, as the
  // prefill packs its values) built into one buffer measured slower.
  auto build_values = [&](int h, int cv0, int nc, int t0, bf16* vt) {
    for (int i = 0; i < 16; ++i) {
      const int t = t0 + 2 * i;
      const bf16* r0 = t < len ? v + rows[t] + (size_t)h * D + 16 * cv0 : nullptr;
      const bf16* r1 = t + 1 < len ? v + rows[t + 1] + (size_t)h * D + 16 * cv0 : nullptr;
      for (int j = 0; j < nc; j += 2) {
        const __m512i x = r0 ? _mm512_loadu_si512(r0 + 16 * j) : _mm512_setzero_si512();
        const __m512i y = r1 ? _mm512_loadu_si512(r1 + 16 * j) : _mm512_setzero_si512();
        _mm512_storeu_si512(vt + (size_t)j * kTileElems + 32 * i, _mm512_unpacklo_epi16(x, y));
        _mm512_storeu_si512(vt + (size_t)(j + 1) * kTileElems + 32 * i, _mm512_unpackhi_epi16(x, y));
      }
    }
  };
  const __m512i order0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i order1 = _mm512_add_epi32(order0, _mm512_set1_epi32(8));
  for (int h = a; h < b; ++h) {
    for (int cv0 = 0; cv0 < CV; cv0 += 4) {  // 64 dims at a time: four sum tiles
      const int nc = std::min(4, CV - cv0);
      _tile_zero(0);
      _tile_zero(1);
      if (nc > 2) {
        _tile_zero(2);
        _tile_zero(3);
      }
      // Two buffers: a block's values are built while the previous block's products run, and the tile loads
      // read stores an iteration old (see above).
      build_values(h, cv0, nc, 0, vtile);
      for (int blk = 0; blk < nblk; ++blk) {
        const int t0 = 32 * blk;
        bf16* cur = vtile + (size_t)(blk % 2) * 4 * kTileElems;
        if (blk + 1 < nblk) build_values(h, cv0, nc, t0 + 32, vtile + (size_t)((blk + 1) % 2) * 4 * kTileElems);
        const bf16* pt = ptiles + (size_t)blk * 2 * kTileElems;
        _tile_loadd(4, pt, 64);
        _tile_loadd(5, pt + kTileElems, 64);
#define NANOINFER_PV(j)                                           \
  if (nc > j) {                                                   \
    _tile_loadd(6, cur + (size_t)j * kTileElems, 64);             \
    _tile_dpbf16ps(j, 4, 6);                                      \
    _tile_dpbf16ps(j, 5, 6);                                      \
  }
        NANOINFER_PV(0) NANOINFER_PV(1) NANOINFER_PV(2) NANOINFER_PV(3)
#undef NANOINFER_PV
      }
      _tile_stored(0, cstage, 256);
      _tile_stored(1, cstage + 16, 256);
      if (nc > 2) {
        _tile_stored(2, cstage + 32, 256);
        _tile_stored(3, cstage + 48, 256);
      }
      for (int g = 0; g < G; ++g) {
        const float* src = cstage + (size_t)((h - a) * G + g) * 64;
        float* dst = acc + (size_t)(h * G + g) * D + 16 * cv0;
        for (int j = 0; j < nc; j += 2) {
          const __m512 lo = _mm512_loadu_ps(src + 16 * j), hi = _mm512_loadu_ps(src + 16 * j + 16);
          _mm512_storeu_ps(dst + 16 * j, _mm512_permutex2var_ps(lo, order0, hi));
          _mm512_storeu_ps(dst + 16 * j + 16, _mm512_permutex2var_ps(lo, order1, hi));
        }
      }
    }
  }
}

// The key pass on AMX, for bfloat16 queries over a bfloat16 cache: one tile product gives 16 tokens' scores
// for up to 16 query heads. The keys are read in place as A tiles (16 tokens' rows, 32 dims of one KV head
// each; row stride Hkv * D); the queries are packed once per sequence as B tiles, each KV head's 32-dim chunk
// against all 16 query columns, zero in the columns of other KV heads' queries, so summing the products of
// every head's chunks leaves each column the dots with its own KV head. With vdpbf16ps (attend_avx512) the
// key pass was bound by the core, not the cache's bytes, even with the cache in L3; on tiles it is faster,
// and from DRAM both passes now wait on memory (benchmarks/README.md).
// The scores stay token-major ([token][16 columns], as the tile stores them): the softmax runs with query
// heads as lanes, and value_pass_amx turns them into rows of tokens for its tiles.
// One sequence, KV heads [h0, h1): qb its bfloat16 queries [Hq, D] (D a multiple of 32, G <= 16); acc [Hq, D]
// scratch; out its output rows [Hq, D].
// Several query rows of one sequence (speculative decoding's consecutive tokens) go through as one row with
// more query heads a KV head (G = rows x heads, see decode_impl), so the tiles and value rows each pass loads
// serve them all; col_lens then gives each such query head its own context length (its row's), and the
// scores past it count for nothing: masked out of the max, zero in the softmax and the value sums. Adding
// those exact zeros leaves every query head's sums what its row alone would give.
static void attend_amx(const at::BFloat16* qb, const at::BFloat16* k, const at::BFloat16* v, const size_t* rows,
                       int len, int G, int D, int Hkv, int h0, int h1, float scale, float* acc, at::BFloat16* out,
                       const int* col_lens = nullptr) {
  using bf16 = at::BFloat16;
  const int CD = D / 32, row_len = Hkv * D;     // a head's 32-dim chunks; elements of a token's cache row
  const int hg = 16 / G;                        // KV heads whose query heads share one tile's 16 columns
  const int groups = (h1 - h0 + hg - 1) / hg;
  const int lp = (len + 31) / 32 * 32;          // tokens, padded to whole pairs of tiles
  const int q0 = h0 * G, nq = (h1 - h0) * G;
  const int64_t stride = (int64_t)row_len * sizeof(bf16);
  static thread_local std::vector<float> scores_buf, inv_buf;
  static thread_local std::vector<bf16> qpack_buf, pad_buf;
  scores_buf.resize((size_t)lp * 16);  // one group's at a time: its value pass runs right after its softmax
  inv_buf.resize(nq);
  qpack_buf.resize((size_t)hg * CD * kTileElems);
  pad_buf.resize((size_t)32 * row_len);
  bf16* qpack = qpack_buf.data();
  bf16* pad = pad_buf.data();
  for (int gi = 0; gi < groups; ++gi) {
    const int a = h0 + gi * hg, b = std::min(h1, a + hg), nch = (b - a) * CD;
    float* sg = scores_buf.data();
    // B tiles: chunk j (head a + j / CD, dims 32 (j % CD)..): row kk / 2 holds dims kk, kk + 1 of column n.
    std::fill(qpack, qpack + (size_t)nch * kTileElems, bf16(0.f));
    for (int j = 0; j < nch; ++j) {
      const int h = a + j / CD, c = j % CD;
      for (int g = 0; g < G; ++g)
        scatter_b_column(qpack + (size_t)j * kTileElems, (h - a) * G + g,
                         _mm512_loadu_si512(qb + (size_t)(h * G + g) * D + 32 * c));
    }
    for (int t0 = 0; t0 < len; t0 += 32) {
      // A tiles: 16 tokens' rows in place when they are evenly spaced (one block of the cache), else copied
      // into a zero-padded buffer (the last tokens, or a block boundary inside a tile when block_size < 16).
      const bf16* tile_rows[2];
      const int ntiles = len - t0 > 16 ? 2 : 1;
      for (int i = 0; i < ntiles; ++i) {
        const int tb = t0 + 16 * i, nt = std::min(16, len - tb);
        bool even = nt == 16;
        for (int m = 1; even && m < 16; ++m) even = rows[tb + m] == rows[tb] + (size_t)m * row_len;
        if (even) {
          tile_rows[i] = k + rows[tb];
        } else {
          bf16* dst = pad + (size_t)i * 16 * row_len;
          for (int m = 0; m < 16; ++m) {
            if (m < nt) std::memcpy(dst + (size_t)m * row_len, k + rows[tb + m], row_len * sizeof(bf16));
            else std::memset(dst + (size_t)m * row_len, 0, row_len * sizeof(bf16));
          }
          tile_rows[i] = dst;
        }
      }
      // The next 32 tokens' keys, while these compute (a few percent; prefetching 64-128 tokens ahead, or
      // into L2, measured the same).
      // The values of these tokens too, into L2, for the value pass after the softmax (a sequence's value
      // rows fit there); asked for in the value pass instead, the requests queued behind each other.
      for (int t = t0 + 32; t < std::min(len, t0 + 64); ++t) {
        prefetch_row(k + rows[t], a, b, D);
        prefetch_row<_MM_HINT_T1>(v + rows[t], a, b, D);
      }
      if (t0 == 0)
        for (int t = 0; t < std::min(len, 32); ++t) prefetch_row<_MM_HINT_T1>(v + rows[t], a, b, D);
      _tile_zero(0);
      _tile_zero(1);
      for (int j = 0; j < nch; ++j) {
        const int off = (a + j / CD) * D + 32 * (j % CD);
        _tile_loadd(4, qpack + (size_t)j * kTileElems, 64);
        _tile_loadd(2, tile_rows[0] + off, stride);
        _tile_dpbf16ps(0, 2, 4);
        if (ntiles == 2) {
          _tile_loadd(3, tile_rows[1] + off, stride);
          _tile_dpbf16ps(1, 3, 4);
        }
      }
      _tile_stored(0, sg + (size_t)t0 * 16, 64);
      if (ntiles == 2) _tile_stored(1, sg + (size_t)(t0 + 16) * 16, 64);
    }
    // Softmax numerators, query heads as lanes: the max of the raw dots, then exp(dot * scale - max * scale)
    // (one FMA) and the sums. Scaling in a pass of its own cost a store per token.
    const __m512 scale16 = _mm512_set1_ps(scale);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    __m512 sum = _mm512_setzero_ps();
    if (col_lens == nullptr) {
      for (int t = 0; t < len; ++t) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + t * 16));
      const __m512 mx_scaled = _mm512_mul_ps(mx, scale16);
      for (int t = 0; t < len; ++t) {
        const __m512 e = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(sg + t * 16), scale16, mx_scaled));
        _mm512_storeu_ps(sg + t * 16, e);
        sum = _mm512_add_ps(sum, e);
      }
    } else {
      alignas(64) int lane_lens[16];
      for (int c = 0; c < 16; ++c) lane_lens[c] = a * G + c < b * G ? col_lens[a * G + c] : len;
      const __m512i lens16 = _mm512_load_si512(lane_lens);
      for (int t = 0; t < len; ++t) {
        const __mmask16 live = _mm512_cmpgt_epi32_mask(lens16, _mm512_set1_epi32(t));
        mx = _mm512_mask_max_ps(mx, live, mx, _mm512_loadu_ps(sg + t * 16));
      }
      const __m512 mx_scaled = _mm512_mul_ps(mx, scale16);
      for (int t = 0; t < len; ++t) {
        const __mmask16 live = _mm512_cmpgt_epi32_mask(lens16, _mm512_set1_epi32(t));
        const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_fmsub_ps(_mm512_loadu_ps(sg + t * 16), scale16, mx_scaled)));
        _mm512_storeu_ps(sg + t * 16, e);
        sum = _mm512_add_ps(sum, e);
      }
    }
    alignas(64) float sums[16];
    _mm512_store_ps(sums, sum);
    for (int qh = a * G; qh < b * G; ++qh) inv_buf[qh - q0] = 1.f / sums[qh - a * G];
    value_pass_amx(v, rows, len, G, D, a, b, sg, acc);
  }
  for (int j = 0; j < nq; ++j) {
    const __m512 inv = _mm512_set1_ps(inv_buf[j]);
    for (int d = 0; d < D; d += 16)
      store16(out + (size_t)(q0 + j) * D + d, rnd16(_mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)(q0 + j) * D + d), inv)));
  }
}
#endif

// The portable path: same algorithm, plain loops.
template <typename T>
static void attend_scalar(const float* qf, const T* k, const T* v, const size_t* rows, int len, int G, int D,
                          int h0, int h1, float* scores, float* acc, float soft_cap = 0.f,
                          const float* sinks = nullptr) {
  for (int t = 0; t < len; ++t) {
    const T* row = k + rows[t];
    for (int qh = h0 * G; qh < h1 * G; ++qh) {
      const T* kp = row + (size_t)(qh / G) * D;
      float s = 0.f;
      for (int d = 0; d < D; ++d) s += qf[qh * D + d] * to_f(kp[d]);
      scores[(size_t)qh * len + t] = s;
    }
  }
  for (int qh = h0 * G; qh < h1 * G; ++qh) {
    float* sq = scores + (size_t)qh * len;
    float m = -INFINITY;
    for (int t = 0; t < len; ++t) m = std::max(m, sq[t]);
    if (soft_cap > 0.f) m = cap_scores(sq, len, m, soft_cap);
    m = with_sink(m, sinks, qh);
    float sum = sink_term(m, sinks, qh);
    for (int t = 0; t < len; ++t) { sq[t] = std::exp(sq[t] - m); sum += sq[t]; }
    for (int t = 0; t < len; ++t) sq[t] /= sum;
  }
  std::fill(acc + (size_t)h0 * G * D, acc + (size_t)h1 * G * D, 0.f);
  for (int t = 0; t < len; ++t) {
    const T* row = v + rows[t];
    for (int qh = h0 * G; qh < h1 * G; ++qh) {
      const T* vp = row + (size_t)(qh / G) * D;
      const float p = scores[(size_t)qh * len + t];
      for (int d = 0; d < D; ++d) acc[qh * D + d] += p * to_f(vp[d]);
    }
  }
}

// Rows of a run that attend_avx512 takes as one row (their query heads are its rows' heads side by side).
constexpr int kMaxRunRows = 8;

// R rows of a run as one row with R * G query heads a KV head: f(vh, i, qh) for each of KV heads [h0, h1)'s
// query heads, where query head vh of the one row is query head qh of the run's row i.
template <typename F>
inline void for_run_heads(int h0, int h1, int R, int G, F&& f) {
  for (int h = h0; h < h1; ++h)
    for (int i = 0; i < R; ++i)
      for (int g = 0; g < G; ++g) f((size_t)h * R * G + i * G + g, i, (size_t)h * G + g);
}

// TQ: the queries' and output's type (the model's dtype); TC: the cache's (kv_cache_dtype), e.g. a float32
// model over a bfloat16 cache, which halves the bytes this kernel reads.
template <typename TQ, typename TC>
static void decode_impl(const TQ* q, const TC* k, const TC* v, const int* tables, const int* lens, TQ* out,
                        int B, int Hq, int Hkv, int D, int bs, int max_blocks, float scale, int64_t q_stride,
                        int window, float soft_cap, const float* sinks) {
  const int G = Hq / Hkv;
#ifdef NANOINFER_AVX2
  const bool vector = D % 8 == 0 && D <= 256;  // attend_avx2 widens a key slice into a 256-float buffer
#else
  const bool vector = false;
#endif
#ifdef NANOINFER_AVX512
  const bool vector512 = D % 16 == 0 && D <= 256;
  // A run's rows as one row (see the run loop below) on attend_avx512's float32 query path: every case but
  // bfloat16 queries over a bfloat16 cache with AVX512-BF16, whose key dots take the bfloat16 queries as they are.
  bool rows_as_one = vector512;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<TQ, at::BFloat16> && std::is_same_v<TC, at::BFloat16>) rows_as_one = D % 32 != 0;
#endif
#endif
#ifdef NANOINFER_AMX
  // The key pass on AMX (attend_amx) where queries and cache are bfloat16 and the CPU lets this process use
  // its tiles. -DNANOINFER_NO_AMX_ATTN builds without it: the A/B switch of a standalone build (the numbers
  // above attend_amx were measured that way).
  bool amx = std::is_same_v<TQ, at::BFloat16> && std::is_same_v<TC, at::BFloat16> && D % 32 == 0 &&
             D <= 256 && G <= 16 && soft_cap == 0.f && sinks == nullptr &&
             amx_permitted();  // its softmax is uncapped, without sinks
#ifdef NANOINFER_NO_AMX_ATTN
  amx = false;
#endif
#endif
  // Runs of rows that are one sequence's consecutive tokens (speculative decoding lays out a sequence's last
  // token and its proposed tokens as decode rows of one block table and lengths n, n + 1, ...): one work
  // item computes a run, as one row with R x G query heads a KV head on AMX and AVX-512 (each key and value
  // row loaded once for all R rows), else its rows one after another on one thread (the rows after the first
  // read the sequence's keys and values from this core's L2). Each row's bits are a lone row's.
  std::vector<int> run_starts{0};
  for (int b = 1; b < B; ++b) {
    const int* prev = tables + (size_t)(b - 1) * max_blocks;
    // With a sliding window each row reads its own last `window` keys: rows stay apart (and with a soft cap or
    // sinks, which the runs' softmax does not apply).
    const bool same = window == 0 && soft_cap == 0.f && sinks == nullptr && lens[b] == lens[b - 1] + 1 &&
                      std::equal(prev, prev + max_blocks, tables + (size_t)b * max_blocks);
    if (!same) run_starts.push_back(b);
  }
  const int num_runs = run_starts.size();
  run_starts.push_back(B);
  // Work items: whole runs (sequences) from one a thread, else one KV head of a run, so that a lone long
  // sequence still uses every thread. A head's slice of each cache row is a short read every row, which
  // memory serves at a fraction of the rate of whole rows, so a decode tail of a few sequences ran faster as
  // whole runs than as heads (benchmarks/README.md). Each row's
  // result is the same either way (the same per-head arithmetic), only who computes it differs.
  const int splits = num_runs >= omp_get_max_threads() ? 1 : Hkv;
  const int heads_per_item = Hkv / splits;
  // Longest runs first (longest context, then most rows): threads claim items dynamically, and the last item
  // claimed is what the other threads wait for at the end, so it should be a short one (benchmarks/README.md).
  std::vector<int> order(num_runs);
  for (int r = 0; r < num_runs; ++r) order[r] = r;
  auto work = [&](int r) {
    return std::make_pair(lens[run_starts[r + 1] - 1], run_starts[r + 1] - run_starts[r]);
  };
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return work(x) > work(y); });
  #pragma omp parallel
  {
    std::vector<float> scores, qf((size_t)Hq * D), acc((size_t)Hq * D);
    std::vector<size_t> rows;  // where each token's row starts (elements into either cache)
#ifdef NANOINFER_AVX512
    std::vector<float> run_qf, run_accf;  // a run's rows as one (attend_avx512): scaled queries, output sums
    std::vector<int> run_lens512;
#endif
#ifdef NANOINFER_AMX
    std::vector<at::BFloat16> run_q, run_out;  // a run's rows as one (attend_amx): queries, output
    std::vector<float> run_acc;
    std::vector<int> run_lens;
    if (amx) load_tile_config();
#endif
    #pragma omp for collapse(2) schedule(dynamic, 1)
    for (int ri = 0; ri < num_runs; ++ri) {
      for (int part = 0; part < splits; ++part) {
        const int r = order[ri];
        const int b_first = run_starts[r], b_last = run_starts[r + 1] - 1;
        const int h0 = part * heads_per_item, h1 = h0 + heads_per_item;
        const int* table = tables + (size_t)b_first * max_blocks;
        // Each token's row, walked block by block once for both passes (and every row of the run): the
        // kernels computed t / bs and t % bs per token, for the row and again for the row they prefetch
        // (8% of the kernel, standalone).
        const int run_len = lens[b_last];
        rows.resize(run_len);
        for (int t = 0, blk = 0, off = 0; t < run_len; ++t) {
          rows[t] = ((size_t)table[blk] * bs + off) * (size_t)(Hkv * D);
          if (++off == bs) off = 0, ++blk;
        }
        for (int b = b_first; b <= b_last; ++b) {
          // A sliding window reads the last `window` keys only: the same rows from a later start (the softmax
          // does not depend on where its keys begin).
          const int first = window > 0 ? std::max(0, lens[b] - window) : 0;
          const int len = lens[b] - first;
          const size_t* row0 = rows.data() + first;
#ifdef NANOINFER_AMX
          if (amx) {
            if constexpr (std::is_same_v<TQ, at::BFloat16> && std::is_same_v<TC, at::BFloat16>) {
              if (b == b_last || G > 8) {  // a lone row, or one row already fills half the tile's columns
                attend_amx(q + (size_t)b * q_stride, k, v, row0, len, G, D, Hkv, h0, h1, scale, acc.data(),
                           out + (size_t)b * Hq * D);
              } else {
                // R rows of the run at once, as one row with R * G query heads a KV head (attend_amx); the
                // tile's 16 columns bound R * G.
                const int R = std::min(b_last - b + 1, 16 / G), GR = R * G;
                run_q.resize((size_t)Hkv * GR * D);
                run_out.resize((size_t)Hkv * GR * D);
                run_acc.resize((size_t)Hkv * GR * D);
                run_lens.resize((size_t)Hkv * GR);
                for_run_heads(h0, h1, R, G, [&](size_t vh, int i, size_t qh) {
                  std::memcpy(run_q.data() + vh * D, q + (size_t)(b + i) * q_stride + qh * D, D * sizeof(TQ));
                  run_lens[vh] = lens[b + i];
                });
                attend_amx(run_q.data(), k, v, rows.data(), lens[b + R - 1], GR, D, Hkv, h0, h1, scale,
                           run_acc.data(), run_out.data(), run_lens.data());
                for_run_heads(h0, h1, R, G, [&](size_t vh, int i, size_t qh) {
                  std::memcpy(out + ((size_t)(b + i) * Hq + qh) * D, run_out.data() + vh * D, D * sizeof(TQ));
                });
                b += R - 1;
              }
            }
            continue;
          }
#endif
#ifdef NANOINFER_AVX512
          if (rows_as_one && b < b_last) {
            // R rows of the run at once, as one row with R * G query heads a KV head: each key and value row
            // is loaded once for all of them (benchmarks/README.md). The queries, not the cache, are most of
            // the loads now.
            const int R = std::min(b_last - b + 1, kMaxRunRows), GR = R * G, run_len = lens[b + R - 1];
            run_qf.resize((size_t)Hkv * GR * D);
            run_accf.resize((size_t)Hkv * GR * D);
            run_lens512.resize((size_t)Hkv * GR);
            scores.resize((size_t)Hkv * GR * run_len);
            for_run_heads(h0, h1, R, G, [&](size_t vh, int i, size_t qh) {
              const TQ* src = q + (size_t)(b + i) * q_stride + qh * D;
              for (int d = 0; d < D; ++d) run_qf[vh * D + d] = to_f(src[d]) * scale;
              run_lens512[vh] = lens[b + i];
            });
            attend_avx512(run_qf.data(), k, v, rows.data(), run_len, GR, D, h0, h1, scores.data(), run_accf.data(),
                          nullptr, 1.f, run_lens512.data());
            for_run_heads(h0, h1, R, G, [&](size_t vh, int i, size_t qh) {
              TQ* dst = out + ((size_t)(b + i) * Hq + qh) * D;
              for (int d = 0; d < D; ++d) dst[d] = static_cast<TQ>(run_accf[vh * D + d]);
            });
            b += R - 1;
            continue;
          }
#endif
          {
            scores.resize((size_t)Hq * len);
            for (int qh = h0 * G; qh < h1 * G; ++qh)
              for (int d = 0; d < D; ++d) qf[qh * D + d] = to_f(q[(size_t)b * q_stride + (size_t)qh * D + d]) * scale;
#ifdef NANOINFER_AVX512
            if (vector512) {
              const at::BFloat16* qb = nullptr;
              if constexpr (std::is_same_v<TQ, at::BFloat16> && std::is_same_v<TC, at::BFloat16>)
                if (D % 32 == 0) qb = q + (size_t)b * q_stride;
              attend_avx512(qf.data(), k, v, row0, len, G, D, h0, h1, scores.data(), acc.data(), qb, scale, nullptr,
                            soft_cap, sinks);
            } else
#endif
#ifdef NANOINFER_AVX2
            if (vector)
              attend_avx2(qf.data(), k, v, row0, len, G, D, Hkv, h0, h1, scores.data(), acc.data(), soft_cap,
                          sinks);
            else
#endif
              attend_scalar(qf.data(), k, v, row0, len, G, D, h0, h1, scores.data(), acc.data(), soft_cap, sinks);
          }
          for (int qh = h0 * G; qh < h1 * G; ++qh)
            for (int d = 0; d < D; ++d) out[((size_t)b * Hq + qh) * D + d] = static_cast<TQ>(acc[qh * D + d]);
        }
      }
    }
#ifdef NANOINFER_AMX
    if (amx) _tile_release();
#endif
  }
  (void)vector;
}

// q [B, Hq, D]: each token's heads contiguous, any stride between tokens (a view of the fused qkv output
// is read in place: copying it out took ~20 us a layer in decode, 0.15-0.2 s of W). out: contiguous.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window,
                           double soft_cap, const c10::optional<torch::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "paged_decode: q [tokens, heads, D] with each token's heads contiguous");
  const int B = q.size(0), Hq = q.size(1), D = q.size(2);
  auto out = torch::empty({B, Hq, D}, q.options());
  const int bs = k_cache.size(1), Hkv = k_cache.size(2);
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "paged_decode: key and value caches of one dtype");
  const int mb = tables.size(1);
  const int* tp = tables.data_ptr<int>();
  const int* lp = lens.data_ptr<int>();
  const float* sp = sink_logits(sinks, Hq, "paged_decode");
  with_typed<false>(q, "paged_decode queries", [&](auto* qp) {
    using TQ = std::remove_pointer_t<decltype(qp)>;
    with_typed<true>(k_cache, "paged_decode cache", [&](auto* kp) {
      using TC = std::remove_pointer_t<decltype(kp)>;
      decode_impl(qp, kp, static_cast<TC*>(v_cache.data_ptr()), tp, lp, out.data_ptr<TQ>(), B, Hq, Hkv, D, bs, mb,
                  (float)scale, q.stride(0), (int)window, (float)soft_cap, sp);
    });
  });
  return out;
}

// One row of n elements into the cache's dtype: a memcpy when the types match, else a rounding conversion
// (to nearest even, as torch's .to() does; fp8 saturates, see from_f).
template <typename TS, typename TC>
static inline void store_row(const TS* src, TC* dst, int64_t n) {
  if constexpr (std::is_same_v<TS, TC>) {
    std::memcpy(dst, src, n * sizeof(TC));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = from_f<TC>(to_f(src[i]));
  }
}

// Rows are stored by all threads from 16 rows a step up: a store into fresh pages is mostly the OS committing
// them, which two threads fault in side by side (the CPU KV cache now commits a block whole before its first
// store: platforms/cpu/kv_cache.py). On resident pages the parallel region costs more than it saves below ~32
// rows (benchmarks/README.md); the tail's few rows stay on the calling thread.
constexpr int64_t kParallelStoreRows = 16;

template <typename TS, typename TC>
static void store_impl(const TS* kp, const TS* vp, int64_t k_stride, int64_t v_stride, TC* kc, TC* vc,
                       const int64_t* slots, int64_t T, int64_t row, int64_t num_slots) {
  for (int64_t t = 0; t < T; ++t)  // checked first: nothing may throw inside the parallel loop
    TORCH_CHECK(slots[t] < num_slots, "store_kvcache: slot ", slots[t], " outside the cache (", num_slots, " slots)");
  #pragma omp parallel for schedule(static) if (T >= kParallelStoreRows)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    store_row(kp + t * k_stride, kc + slot * row, row);
    store_row(vp + t * v_stride, vc + slot * row, row);
  }
}

// Writes this step's keys and values into their cache slots (slot -1: padding, skipped). key/value
// [T, H_kv, D] may be views of the fused qkv output (any row stride, each row's H_kv * D contiguous); the
// caches are contiguous, in the model's dtype or in kv_cache_dtype (float32 / bfloat16 / fp8). One
// memcpy (or one converting pass) per row: for a decode step's few dozen rows, index_copy_'s dispatch and
// the -1 filter cost more than the copy.
void store_kvcache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && key.stride(1) == key.size(2), "store_kvcache: key rows");
  TORCH_CHECK(value.dim() == 3 && value.stride(2) == 1 && value.stride(1) == value.size(2), "store_kvcache: value rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "store_kvcache: contiguous caches");
  TORCH_CHECK(value.scalar_type() == key.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "store_kvcache: one dtype for K and V");
  const auto slots = slot_mapping.contiguous();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == key.size(0), "store_kvcache: int64 slots");
  const int64_t T = key.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row = key.size(1) * key.size(2);
  TORCH_CHECK(row == k_cache.size(2) * k_cache.size(3), "store_kvcache: row size differs from the cache's");
  const int64_t* s = slots.data_ptr<int64_t>();
  with_typed<false>(key, "store_kvcache keys", [&](auto* kp) {
    using TS = std::remove_pointer_t<decltype(kp)>;
    with_typed<true>(k_cache, "store_kvcache cache", [&](auto* kc) {
      using TC = std::remove_pointer_t<decltype(kc)>;
      store_impl(kp, static_cast<const TS*>(value.data_ptr()), key.stride(0), value.stride(0), kc,
                 static_cast<TC*>(v_cache.data_ptr()), s, T, row, num_slots);
    });
  });
}
