// Shared by the CPU kernels: element access for float32 / bfloat16 and, where the compiler targets AVX2 +
// FMA + F16C (-march=native on such a CPU), 8-lane helpers. Every kernel keeps a plain-loop path for other CPUs.
#pragma once
#include <torch/extension.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define NANOINFER_AVX2 1
#endif
// AVX-512 (Intel Skylake-SP and later, AMD Zen 4): the GEMM's register tile doubles in width (csrc/gemm.cpp).
#if defined(NANOINFER_AVX2) && defined(__AVX512F__)
#define NANOINFER_AVX512 1
#endif

// A share of the next panel's 64-byte lines for one GEMM register tile to prefetch into L2, spread over its k-steps
// (gemm.cpp, moe.cpp). A tile's share is at most one line per k-step (a panel has K * 16 * 4 / 64 = K lines in
// float32, and every tile takes its share), so the kernel prefetches on every k-step, the line advancing by
// `step` / 2^32: no branch in the loop: a branch that fired every few k-steps instead cost a fifth or more of the
// kernel's speed in mispredictions.
struct Prefetch {
  const char* line = nullptr;
  uint64_t step = 0;  // 64-byte lines per k-step, 32.32 fixed point; 0: no prefetch (the line is re-read)
};
// Below this many rows a thread leaves its next panel to the hardware prefetchers: a tile of so few rows
// computes too briefly to spread the software prefetches over, and they only crowded the core's line fill
// buffers; from 12 rows on they pay (benchmarks/README.md).
constexpr int64_t kPrefetchMinRows = 12;

#ifdef NANOINFER_AVX2
// A tile's walk over its Prefetch share: next() prefetches one k-step's line (without a share, `own`: the tile's
// first weight line, which it reads anyway).
class PrefetchWalk {
 public:
  PrefetchWalk(Prefetch pf, const void* own)
      : line_(pf.line ? pf.line : static_cast<const char*>(own)), step_(pf.step) {}
  void next() {
    _mm_prefetch(line_ + ((pos_ >> 32) << 6), _MM_HINT_T1);
    pos_ += step_;
  }

 private:
  const char* line_;
  uint64_t step_;
  uint64_t pos_ = 0;
};
#endif
#ifdef NANOINFER_AVX512
// k-steps ahead that a tile asks for its weights and rows of x into L1. Left to the hardware, the two streams
// from L2 kept the FMA ports partly idle; with the prefetches the decode and prefill shapes ran faster
// (benchmarks/README.md).
constexpr int64_t kL1Ahead = 16;
#endif

// Zero-filled, on 2 MiB pages where Linux grants them (csrc/huge_pages.cpp).
torch::Tensor zeros_on_huge_pages(at::IntArrayRef sizes, at::ScalarType dtype);

template <typename T> static inline float to_f(T x);
template <> inline float to_f<float>(float x) { return x; }
template <> inline float to_f<at::BFloat16>(at::BFloat16 x) { return static_cast<float>(x); }
template <> inline float to_f<c10::Float8_e4m3fn>(c10::Float8_e4m3fn x) { return static_cast<float>(x); }
template <> inline float to_f<c10::Float8_e5m2>(c10::Float8_e5m2 x) { return static_cast<float>(x); }

// A KV cache element from a float32 value, as torch's .to() rounds it (to nearest even). fp8 caches
// (kv_cache_dtype fp8_e4m3 / fp8_e5m2, scale 1) saturate at the largest finite value, as vLLM's do: e4m3's
// conversion already does, e5m2's would give inf, so it is clamped first.
template <typename T> static inline T from_f(float x) { return static_cast<T>(x); }
template <> inline c10::Float8_e5m2 from_f<c10::Float8_e5m2>(float x) {
  return static_cast<c10::Float8_e5m2>(std::min(std::max(x, -57344.f), 57344.f));
}

// Calls f with the data pointer of `t` typed by its dtype: activations and weights float32 / bfloat16
// (CACHE false), KV caches also fp8 e4m3 / e5m2 (kv_cache_dtype). A compile-time CACHE: f is instantiated for
// fp8 only where it can be called with it (the GEMM has no fp8 output, and a query is never fp8).
template <bool CACHE, typename F>
static void with_typed(const torch::Tensor& t, const char* what, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: return f(t.data_ptr<float>());
    case at::kBFloat16: return f(t.data_ptr<at::BFloat16>());
    case at::kFloat8_e4m3fn:
      if constexpr (CACHE) return f(static_cast<c10::Float8_e4m3fn*>(t.data_ptr()));
      break;
    case at::kFloat8_e5m2:
      if constexpr (CACHE) return f(static_cast<c10::Float8_e5m2*>(t.data_ptr()));
      break;
    default: break;
  }
  TORCH_CHECK(false, what, ": float32 or bfloat16", CACHE ? " (or fp8 e4m3 / e5m2)" : "", ", got ", t.scalar_type());
}

// What a packed linear kernel (csrc/gemm.cpp, csrc/amx_gemm.cpp) works on: x as contiguous [M, K] rows, the
// [M, N] output, the shape to return it in (input's, with N features) and the bias in float32 (or none).
struct LinearIO {
  torch::Tensor x, out, bias;
  std::vector<int64_t> sizes;
  const float* bias_ptr() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
};
static inline LinearIO linear_io(const torch::Tensor& input, int64_t K, int64_t N,
                                 const c10::optional<torch::Tensor>& bias, const char* what) {
  LinearIO io;
  io.sizes = input.sizes().vec();
  io.sizes.back() = N;
  io.x = input.reshape({-1, K}).contiguous();
  io.out = torch::empty({io.x.size(0), N}, io.x.options());
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, what, ": bias of ", N, " values, got ", bias->numel());
    io.bias = bias->to(at::kFloat).contiguous();
  }
  return io;
}

#ifdef NANOINFER_AVX2
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::BFloat16* p) {  // bfloat16 is the top half of a float32
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// fp8 (one byte an element) through float16's layout and F16C's conversion: e5m2 is the top byte of a
// float16; e4m3 (bias 7) placed as s.eeee.mmm in a float16 (bias 15) reads 2^-8 of its value, subnormals
// included, so one multiply by 256 restores it (the NaN byte, never stored, would read 480).
static inline __m256 load8(const c10::Float8_e5m2* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8));
}
static inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
  const __m128i rest = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7);
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, rest)), _mm256_set1_ps(256.f));
}

// silu(g) * u, 8 lanes: one definition for the SiLU-and-mul kernel and the GEMM that fuses it (csrc/gemm.cpp),
// so the two give the same bits.
static inline __m256 exp8(__m256 x);
static inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
  return _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
}

#ifdef NANOINFER_AVX512
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
template <typename T>  // fp8: two 8-lane widenings
static inline __m512 load16(const T* p) {
  const __m256d lo = _mm256_castps_pd(load8(p)), hi = _mm256_castps_pd(load8(p + 8));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(lo), hi, 1));
}
// Rows x0..x3 (each 16 values at k..k+15) transposed 4 x 4 within each 128-bit lane: the 4 rows' values at k + j
// leave as one 16-byte store at out + j * stride (a register tile's rows, k-major; gemm.cpp and moe.cpp pack so).
static inline void store_transposed_4x16(__m512 x0, __m512 x1, __m512 x2, __m512 x3, float* out, int64_t stride) {
  const __m512d d0 = _mm512_castps_pd(_mm512_unpacklo_ps(x0, x1)), d1 = _mm512_castps_pd(_mm512_unpackhi_ps(x0, x1));
  const __m512d d2 = _mm512_castps_pd(_mm512_unpacklo_ps(x2, x3)), d3 = _mm512_castps_pd(_mm512_unpackhi_ps(x2, x3));
  // u[i], lane L: rows 0..3 at k + 4 L + i.
  const __m512 u[4] = {_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d2)), _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d2)),
                       _mm512_castpd_ps(_mm512_unpacklo_pd(d1, d3)), _mm512_castpd_ps(_mm512_unpackhi_pd(d1, d3))};
  for (int i = 0; i < 4; ++i) {
    _mm_storeu_ps(out + i * stride, _mm512_castps512_ps128(u[i]));
    _mm_storeu_ps(out + (4 + i) * stride, _mm512_extractf32x4_ps(u[i], 1));
    _mm_storeu_ps(out + (8 + i) * stride, _mm512_extractf32x4_ps(u[i], 2));
    _mm_storeu_ps(out + (12 + i) * stride, _mm512_extractf32x4_ps(u[i], 3));
  }
}
static inline __m256 low8(__m512 v) { return _mm512_castps512_ps256(v); }
static inline __m256 high8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
#endif

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x): Cephes' range reduction and degree-5 polynomial, ~1 ulp; clamped to [-87.3, 88] (0 and ~1.6e38
// at the ends), which is all softmax (x <= 0) and SiLU (exp(-x) for any x) need.
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.0f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

#ifdef NANOINFER_AVX512
// exp8's steps on 16 lanes, in the same order: each lane gives exp8's bits.
static inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.0f));
  __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  __m512i pow2n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(pow2n));
}

// silu_mul8 on 16 lanes, the same steps: each lane gives silu_mul8's bits.
static inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  return _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
}

// 16 floats rounded to bfloat16 (to nearest even; finite inputs), kept as floats: rnd8 on 16 lanes.
static inline __m512 rnd16(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// 16 floats already rounded to bfloat16 (rnd16), stored as bfloat16.
static inline void store16(at::BFloat16* p, __m512 rounded) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
}

// The AVX-512 register tile of the GEMM-shaped kernels (csrc/gemm.cpp's linears, csrc/prefill_attention.cpp's
// two products): R (at most 12) rows x W (1 or 2) blocks of 16 columns, float32 sums over k = 0..kdim-1 in
// order, 12 broadcasts and W loads per 12 W FMAs. Each k-step runs step(k) first (a prefetch, or nothing),
// multiplies a(r, k) (row r's k-th value) into b(j, k) (block j's 16 values), and out(r, j, sum) takes each
// sum at the end. Named accumulators, not an array: with an array GCC keeps them on the stack. The _from form
// starts each sum at init(r, j) instead of 0 (a sum over k carried on from an earlier call: the same bits).
template <int R, int W, typename Init, typename Step, typename A, typename B, typename Out>
__attribute__((always_inline)) inline void fma_tile_12x2_from(int64_t kdim, Init&& init, Step&& step, A&& a, B&& b,
                                                              Out&& out) {
  static_assert(R >= 1 && R <= 12 && (W == 1 || W == 2), "fma_tile_12x2: at most 12 rows of 2 blocks");
  const __m512 z = _mm512_setzero_ps();
#define NANOINFER_INIT(r) \
  __m512 c##r##_0 = R > r ? init(r, 0) : z, c##r##_1 = R > r && W == 2 ? init(r, 1) : z;
  NANOINFER_INIT(0) NANOINFER_INIT(1) NANOINFER_INIT(2) NANOINFER_INIT(3) NANOINFER_INIT(4) NANOINFER_INIT(5)
  NANOINFER_INIT(6) NANOINFER_INIT(7) NANOINFER_INIT(8) NANOINFER_INIT(9) NANOINFER_INIT(10) NANOINFER_INIT(11)
#undef NANOINFER_INIT
  for (int64_t k = 0; k < kdim; ++k) {
    step(k);
    const __m512 w0 = b(0, k);
    const __m512 w1 = W == 2 ? b(1, k) : w0;
#define NANOINFER_ROW(r)                                                  \
  if constexpr (R > r) {                                                  \
    const __m512 av = _mm512_set1_ps(a(r, k));                            \
    c##r##_0 = _mm512_fmadd_ps(av, w0, c##r##_0);                         \
    if constexpr (W == 2) c##r##_1 = _mm512_fmadd_ps(av, w1, c##r##_1);   \
  }
    NANOINFER_ROW(0) NANOINFER_ROW(1) NANOINFER_ROW(2) NANOINFER_ROW(3) NANOINFER_ROW(4) NANOINFER_ROW(5)
    NANOINFER_ROW(6) NANOINFER_ROW(7) NANOINFER_ROW(8) NANOINFER_ROW(9) NANOINFER_ROW(10) NANOINFER_ROW(11)
#undef NANOINFER_ROW
  }
  const __m512 acc[12][2] = {{c0_0, c0_1}, {c1_0, c1_1}, {c2_0, c2_1}, {c3_0, c3_1},   {c4_0, c4_1},   {c5_0, c5_1},
                             {c6_0, c6_1}, {c7_0, c7_1}, {c8_0, c8_1}, {c9_0, c9_1}, {c10_0, c10_1}, {c11_0, c11_1}};
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) out(r, j, acc[r][j]);
}
template <int R, int W, typename Step, typename A, typename B, typename Out>
__attribute__((always_inline)) inline void fma_tile_12x2(int64_t kdim, Step&& step, A&& a, B&& b, Out&& out) {
  fma_tile_12x2_from<R, W>(kdim, [](int, int) { return _mm512_setzero_ps(); }, step, a, b, out);
}
#endif
#endif

// --- bfloat16: a float32 value rounded as a bfloat16 torch op's result is (to nearest even).
using bf16 = at::BFloat16;
static inline float rnd(float x) { return static_cast<float>(static_cast<bf16>(x)); }

#ifdef NANOINFER_AVX2
// 8 floats rounded to bfloat16 (to nearest even; finite inputs), kept as floats; and stored as bfloat16.
static inline __m256 rnd8(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
static inline void store8(bf16* p, __m256 rounded) {
  const __m256i b = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
#endif

// out = silu(gate) * up, n elements; in bfloat16 F.silu(gate) rounded, then the product rounded. One definition
// for the SiLU-and-mul kernel (csrc/fused_ops.cpp) and the AMX GEMM that fuses it (csrc/amx_gemm.cpp).
static inline void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
#ifdef NANOINFER_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, silu_mul8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
#endif
  for (; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}
static inline void silu_mul_row(const bf16* gate, const bf16* up, bf16* out, int64_t n) {
  int64_t i = 0;
#ifdef NANOINFER_AVX2
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = load8(gate + i);
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    store8(out + i, rnd8(_mm256_mul_ps(rnd8(silu), load8(up + i))));
  }
#endif
  for (; i < n; ++i) {
    const float g = static_cast<float>(gate[i]);
    out[i] = static_cast<bf16>(rnd(g / (1.f + std::exp(-g))) * static_cast<float>(up[i]));
  }
}
