// Fused elementwise ops for the CPU decoder layer, float32 and bfloat16 (other dtypes stay on the torch ops).
// Each torch op of RMSNorm, rotary and SiLU-and-mul is a full pass over the activations plus a dispatch;
// in a 64-sequence decode step they cost ~10% of the step and in a long prefill ~25% (the passes over
// [tokens, intermediate] tensors leave the cache). Here each is one pass, rows split across torch's threads.
// Numerics follow the Hugging Face modules (float32 throughout), up to summation order. In bfloat16 each
// step is rounded where the Hugging Face modules' bfloat16 ops round it (the `rnd` calls), so the two agree
// but for a rare last-bit difference from summation order.
#include "simd.h"
#include <ATen/Parallel.h>

namespace {

// Rows per thread: at least ~64K elements, so a decode step's small tensors stay on one thread (waking the
// other cost more than it saved: silu_and_mul of 64 x 1536 took 0.24 ms on one thread, 0.9 ms on two).
inline int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(row_elems, 1)); }
// fused_add_rms_norm's and rotary's: ~16K elements (28 rows of 576). They run between a decode step's GEMMs,
// whose threads are still spinning, so the other thread joins in a microsecond or two and the split pays even
// at decode's row counts (benchmarks/README.md).
inline int64_t step_row_grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

// sum(x^2) over n floats.
inline float sum_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#ifdef NANOINFER_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  total = hsum(acc);
#endif
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

// out = weight * (x * rsqrt(mean(x^2) + eps)).
inline void normalize_row(const float* x, const float* weight, float* out, int64_t n, float eps) {
  const float inv = 1.f / std::sqrt(sum_squares(x, n) / n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
}

// out = rnd(weight * rnd(x * rsqrt(mean(x^2) + eps))): HF's RMSNorm in bfloat16 (norm in float32, cast, scale).
// The sum of squares runs 8 lanes wide on every vector CPU (one summation order); the elementwise passes
// 16 wide where AVX-512 is built (each element the same bits either way).
inline void normalize_row(const bf16* x, const bf16* weight, bf16* out, int64_t n, float eps) {
  int64_t i = 0;
  float total = 0.f;
#ifdef NANOINFER_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  total = hsum(acc);
#endif
  for (; i < n; ++i) total += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float inv = 1.f / std::sqrt(total / n + eps);
  i = 0;
#ifdef NANOINFER_AVX512
  const __m512 inv16 = _mm512_set1_ps(inv);
  for (; i + 16 <= n; i += 16)
    store16(out + i, rnd16(_mm512_mul_ps(load16(weight + i), rnd16(_mm512_mul_ps(load16(x + i), inv16)))));
#endif
#ifdef NANOINFER_AVX2
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8) store8(out + i, rnd8(_mm256_mul_ps(load8(weight + i), rnd8(_mm256_mul_ps(load8(x + i), inv8)))));
#endif
  for (; i < n; ++i) out[i] = static_cast<bf16>(static_cast<float>(weight[i]) * rnd(static_cast<float>(x[i]) * inv));
}

#ifdef NANOINFER_AVX512
// out = rnd(weight * rnd(x * inv)), n a multiple of 16: normalize_row's elementwise pass.
inline void scale_row16(const bf16* x, const bf16* weight, bf16* out, int64_t n, float inv) {
  const __m512 inv16 = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 16)
    store16(out + i, rnd16(_mm512_mul_ps(load16(weight + i), rnd16(_mm512_mul_ps(load16(x + i), inv16)))));
}

// Two rows of fused_add_rms_norm in one pass (n a multiple of 16): residual += x, rounded, and each row's
// sum of squares taken from the sums in registers, in normalize_row's order (8 lanes, ascending: the low
// then the high half of each 16), so the bits are those of add_row then normalize_row. One row's sum is a
// chain of n / 8 dependent multiply-adds; two rows' interleaved, each waits half as long on its own
// (benchmarks/README.md).
inline void add_norm_rows2(bf16* x0, bf16* r0, bf16* x1, bf16* r1, const bf16* weight, int64_t n, float eps) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 s0 = rnd16(_mm512_add_ps(load16(r0 + i), load16(x0 + i)));
    const __m512 s1 = rnd16(_mm512_add_ps(load16(r1 + i), load16(x1 + i)));
    store16(r0 + i, s0);
    store16(r1 + i, s1);
    const __m256 l0 = _mm512_castps512_ps256(s0), l1 = _mm512_castps512_ps256(s1);
    const __m256 h0 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s0), 1));  // AVX-512F only
    const __m256 h1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s1), 1));
    a0 = _mm256_fmadd_ps(l0, l0, a0);
    a1 = _mm256_fmadd_ps(l1, l1, a1);
    a0 = _mm256_fmadd_ps(h0, h0, a0);
    a1 = _mm256_fmadd_ps(h1, h1, a1);
  }
  scale_row16(r0, weight, x0, n, 1.f / std::sqrt(hsum(a0) / n + eps));
  scale_row16(r1, weight, x1, n, 1.f / std::sqrt(hsum(a1) / n + eps));
}
#endif

// residual += x, n elements.
inline void add_row(const float* x, float* residual, int64_t n) {
  for (int64_t i = 0; i < n; ++i) residual[i] += x[i];
}
inline void add_row(const bf16* x, bf16* residual, int64_t n) {  // rounded, as a bfloat16 add
  int64_t i = 0;
#ifdef NANOINFER_AVX512
  for (; i + 16 <= n; i += 16) store16(residual + i, rnd16(_mm512_add_ps(load16(residual + i), load16(x + i))));
#endif
#ifdef NANOINFER_AVX2
  for (; i + 8 <= n; i += 8) store8(residual + i, rnd8(_mm256_add_ps(load8(residual + i), load8(x + i))));
#endif
  for (; i < n; ++i) residual[i] = static_cast<bf16>(static_cast<float>(residual[i]) + static_cast<float>(x[i]));
}

// Calls f with x's element type (float32 or bfloat16), after checking that rows are contiguous and that the
// weight (when given) has x's dtype.
template <typename F>
void with_row_type(const torch::Tensor& x, const torch::Tensor* weight, const char* name, F&& f) {
  TORCH_CHECK(x.stride(-1) == 1, name, " must have contiguous rows");
  TORCH_CHECK(weight == nullptr || weight->scalar_type() == x.scalar_type(), "the weight must have ", name,
              "'s dtype (", x.scalar_type(), ")");
  if (x.scalar_type() == at::kBFloat16) return f(bf16{});
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, " must be float32 or bfloat16");
  f(float{});
}

}  // namespace

// x [..., n] -> rms_norm(x) * weight (new tensor); rows may be strided (the per-head q/k norms of Qwen3).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  auto rows = x.reshape({-1, x.size(-1)});
  auto out = torch::empty({rows.size(0), rows.size(1)}, x.options());
  const auto w = weight.contiguous();
  with_row_type(x, &w, "x", [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = rows.size(1), stride = rows.stride(0);
    const T* xp = rows.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows.size(0), row_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) normalize_row(xp + r * stride, wp, op + r * n, n, (float)eps);
    });
  });
  return out.view(x.sizes());
}

// residual += x; x = rms_norm(residual) * weight. Both [T, n] contiguous, updated in place (the pre-norm
// step between sub-layers: the caller owns both buffers).
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes() &&
              x.scalar_type() == residual.scalar_type(), "x and residual must be contiguous and of one shape and dtype");
  const auto w = weight.contiguous();
  with_row_type(x, &w, "x", [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = x.size(-1), T_ = x.numel() / n;
    T* xp = x.data_ptr<T>();
    T* rp = residual.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    at::parallel_for(0, T_, step_row_grain(n), [&](int64_t begin, int64_t end) {
      int64_t r = begin;
#ifdef NANOINFER_AVX512
      if constexpr (std::is_same_v<T, bf16>) {
        if (n % 16 == 0)
          for (; r + 2 <= end; r += 2)
            add_norm_rows2(xp + r * n, rp + r * n, xp + (r + 1) * n, rp + (r + 1) * n, wp, n, (float)eps);
      }
#endif
      for (; r < end; ++r) {
        add_row(xp + r * n, rp + r * n, n);
        normalize_row(rp + r * n, wp, xp + r * n, n, (float)eps);
      }
    });
  });
}

// x [T, 2I] (gate | up) -> silu(gate) * up [T, I].
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [tokens, 2 * intermediate] matrix");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
  with_row_type(x, nullptr, "x", [&](auto zero) {
    using E = decltype(zero);
    const E* xp = x.data_ptr<E>();
    E* op = out.data_ptr<E>();
    at::parallel_for(0, T, row_grain(3 * I), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_mul_row(xp + r * 2 * I, xp + r * 2 * I + I, op + r * I, I);
    });
  });
  return out;
}

// Neox-style rotary in place on q [T, Hq, D] and k [T, Hk, D] (strided views of the fused qkv output are
// fine: rows of D must be contiguous). cos/sin [max_position, D] float32, both halves equal (HF's layout).
// bfloat16 q/k: HF's q * cos + rotate_half(q) * sin with cos/sin cast to bfloat16, every op rounded.
template <typename T>
static void rotary_impl(const int64_t* pos, T* qp, T* kp, const torch::Tensor& q, const torch::Tensor& k,
                        const float* cp, const float* sp) {
  const int64_t T_ = q.size(0), D = q.size(2), half = D / 2;
  constexpr bool kBf16 = std::is_same_v<T, bf16>;
  auto r = [](float x) { return kBf16 ? rnd(x) : x; };
  auto rotate = [&](T* base, int64_t heads, int64_t token_stride, int64_t head_stride, int64_t t) {
    const float* c = cp + pos[t] * D;
    const float* s = sp + pos[t] * D;
#ifdef NANOINFER_AVX512
    // bfloat16 with head_dim up to 128: the position's cos / sin, rounded, once for all its heads rather than
    // again per head.
    constexpr int kMaxChunks = 4;  // of 16 lanes, in half a head
    __m512 rc1[kMaxChunks], rc2[kMaxChunks], rs1[kMaxChunks], rs2[kMaxChunks];
    const bool hoisted = kBf16 && half % 16 == 0 && half <= 16 * kMaxChunks;
    if (hoisted)
      for (int64_t j = 0; j < half / 16; ++j) {
        rc1[j] = rnd16(_mm512_loadu_ps(c + 16 * j)), rc2[j] = rnd16(_mm512_loadu_ps(c + 16 * j + half));
        rs1[j] = rnd16(_mm512_loadu_ps(s + 16 * j)), rs2[j] = rnd16(_mm512_loadu_ps(s + 16 * j + half));
      }
#endif
    for (int64_t h = 0; h < heads; ++h) {
      T* x = base + t * token_stride + h * head_stride;
      int64_t i = 0;
#ifdef NANOINFER_AVX512
      if constexpr (kBf16) {  // the scalar loop's roundings, 16 (or 8) lanes at a time: 55 -> ~15 us a W step
        for (; i + 16 <= half; i += 16) {
          const __m512 x1 = load16(x + i), x2 = load16(x + i + half);
          const int64_t j = i / 16;
          const __m512 c1 = hoisted ? rc1[j] : rnd16(_mm512_loadu_ps(c + i));
          const __m512 c2 = hoisted ? rc2[j] : rnd16(_mm512_loadu_ps(c + i + half));
          const __m512 s1 = hoisted ? rs1[j] : rnd16(_mm512_loadu_ps(s + i));
          const __m512 s2 = hoisted ? rs2[j] : rnd16(_mm512_loadu_ps(s + i + half));
          const __m512 neg_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
          store16(x + i, rnd16(_mm512_add_ps(rnd16(_mm512_mul_ps(x1, c1)), rnd16(_mm512_mul_ps(neg_x2, s1)))));
          store16(x + i + half, rnd16(_mm512_add_ps(rnd16(_mm512_mul_ps(x2, c2)), rnd16(_mm512_mul_ps(x1, s2)))));
        }
      }
#endif
#ifdef NANOINFER_AVX2
      if constexpr (kBf16) {
        for (; i + 8 <= half; i += 8) {
          const __m256 x1 = load8(x + i), x2 = load8(x + i + half);
          const __m256 c1 = rnd8(_mm256_loadu_ps(c + i)), c2 = rnd8(_mm256_loadu_ps(c + i + half));
          const __m256 s1 = rnd8(_mm256_loadu_ps(s + i)), s2 = rnd8(_mm256_loadu_ps(s + i + half));
          const __m256 neg_x2 = _mm256_sub_ps(_mm256_setzero_ps(), x2);
          store8(x + i, rnd8(_mm256_add_ps(rnd8(_mm256_mul_ps(x1, c1)), rnd8(_mm256_mul_ps(neg_x2, s1)))));
          store8(x + i + half, rnd8(_mm256_add_ps(rnd8(_mm256_mul_ps(x2, c2)), rnd8(_mm256_mul_ps(x1, s2)))));
        }
      }
#endif
      for (; i < half; ++i) {
        const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
        const float c1 = r(c[i]), c2 = r(c[i + half]), s1 = r(s[i]), s2 = r(s[i + half]);
        if constexpr (kBf16) {
          x[i] = static_cast<T>(rnd(x1 * c1) + rnd(-x2 * s1));
          x[i + half] = static_cast<T>(rnd(x2 * c2) + rnd(x1 * s2));
        } else {
          x[i] = x1 * c1 - x2 * s1;
          x[i + half] = x2 * c2 + x1 * s2;
        }
      }
    }
  };
  at::parallel_for(0, T_, step_row_grain(q.size(1) * D + k.size(1) * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate(qp, q.size(1), q.stride(0), q.stride(1), t);
      rotate(kp, k.size(1), k.stride(0), k.stride(1), t);
    }
  });
}

void rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                      torch::Tensor sin) {
  TORCH_CHECK(q.stride(-1) == 1 && k.stride(-1) == 1, "q and k must have contiguous rows");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k of one dtype");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat,
              "cos/sin tables must be contiguous float32");
  const int64_t* pos = positions.data_ptr<int64_t>();
  with_row_type(q, nullptr, "q", [&](auto zero) {
    using E = decltype(zero);
    rotary_impl(pos, q.data_ptr<E>(), k.data_ptr<E>(), q, k, cos.data_ptr<float>(), sin.data_ptr<float>());
  });
}
