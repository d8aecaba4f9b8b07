// Fused elementwise ops for the CPU decoder layer, float32 (other dtypes stay on the torch ops).
// Each torch op of RMSNorm, rotary and SiLU-and-mul is a full pass over the activations plus a dispatch;
// in a 64-sequence decode step they cost ~10% of the step and in a long prefill ~25% (the passes over
// [tokens, intermediate] tensors leave the cache). Here each is one pass, rows split across torch's threads.
// Numerics follow the Hugging Face modules (float32 throughout), up to summation order.
#include "simd.h"
#include <ATen/Parallel.h>

namespace {

// Rows per thread: at least ~64K elements, so a decode step's small tensors stay on one thread (waking the
// other cost more than it saved: silu_and_mul of 64 x 1536 took 0.24 ms on one thread, 0.9 ms on two).
inline int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(row_elems, 1)); }

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

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
  TORCH_CHECK(t.stride(-1) == 1, name, " must have contiguous rows");
}

}  // namespace

// x [..., n] -> rms_norm(x) * weight (new tensor); rows may be strided (the per-head q/k norms of Qwen3).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  auto rows = x.reshape({-1, x.size(-1)});
  auto out = torch::empty({rows.size(0), rows.size(1)}, x.options());
  const int64_t n = rows.size(1), stride = rows.stride(0);
  const float* xp = rows.data_ptr<float>();
  const float* wp = weight.contiguous().data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows.size(0), row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalize_row(xp + r * stride, wp, op + r * n, n, (float)eps);
  });
  return out.view(x.sizes());
}

// residual += x; x = rms_norm(residual) * weight. Both [T, n] contiguous, updated in place (the pre-norm
// step between sub-layers: the caller owns both buffers).
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes(),
              "x and residual must be contiguous and of one shape");
  const int64_t n = x.size(-1), T = x.numel() / n;
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.contiguous().data_ptr<float>();
  at::parallel_for(0, T, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * n;
      float* rr = rp + r * n;
      for (int64_t i = 0; i < n; ++i) rr[i] += xr[i];
      normalize_row(rr, wp, xr, n, (float)eps);
    }
  });
}

// x [T, 2I] (gate | up) -> silu(gate) * up [T, I].
torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [tokens, 2 * intermediate] matrix");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, row_grain(3 * I), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = xp + r * 2 * I;
      const float* up = gate + I;
      float* o = op + r * I;
      int64_t i = 0;
#ifdef NANOINFER_AVX2
      for (; i + 8 <= I; i += 8) _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
#endif
      for (; i < I; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

// Neox-style rotary in place on q [T, Hq, D] and k [T, Hk, D] (strided views of the fused qkv output are
// fine: rows of D must be contiguous). cos/sin [max_position, D] float32, both halves equal (HF's layout).
void rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                      torch::Tensor sin) {
  check_rows(q, "q");
  check_rows(k, "k");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "cos/sin tables must be contiguous");
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  auto rotate = [&](float* base, int64_t heads, int64_t token_stride, int64_t head_stride, int64_t t) {
    const float* c = cp + pos[t] * D;
    const float* s = sp + pos[t] * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* x = base + t * token_stride + h * head_stride;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i + half] + x1 * s[i + half];
      }
    }
  };
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  at::parallel_for(0, T, row_grain(q.size(1) * D + k.size(1) * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate(qp, q.size(1), q.stride(0), q.stride(1), t);
      rotate(kp, k.size(1), k.stride(0), k.stride(1), t);
    }
  });
}
