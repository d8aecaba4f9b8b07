// Greedy tokens of a float32 model without its float32 LM head: the argmax of every row's float32 logits,
// found from bfloat16 logits (AMX) and an error bound, then confirmed in float32 on a few candidates.
//
// Why: the LM head is a fifth of SmolLM2-135M's multiply-adds per token (49,152 x 576 of 134.5M) and in float32
// it runs at the FMA ports' rate; with AMX the same product in bfloat16 costs ~a third (W's float32 decode on a
// 2-core Sapphire Rapids-class VM: 1.87 s of the LM head in a 13.6 s decode). Greedy decoding needs only the
// index of each row's largest logit, and that index can be found exactly without every float32 logit:
//
//   L_j  = the float32 logit our panel GEMM computes (gemm.cpp: a sequential fused multiply-add over k from 0)
//   B_j  = the bfloat16 logit: x and W rounded to bfloat16, multiplied on AMX, summed in float32, rounded
//   |B_j - L_j| <= E_j = C1 * ||x||_2 * ||w_j||_2 + C2 * |B_j| + tiny
//
// (rounding x and w_j to bfloat16 moves each product by at most (2u + u^2) |x_k w_jk|, u = 2^-8; summing K
// products in float32, both ways, by at most 2K * 2^-24 * sum_k |x_k w_jk| each; Cauchy-Schwarz bounds that
// sum by ||x|| ||w_j||; rounding the sum to bfloat16 moves it by at most u / (1 - u) of |B_j|; C1 and C2
// carry margins for the float32 arithmetic of the bound itself, and `tiny` for AMX flushing denormals.)
// Every token j with B_j + E_j below max_i (B_i - E_i) has L_j below some other L_i, so it cannot be the
// argmax; the rest (on SmolLM2 and W: ~9 a row, at most ~130) get their L_j computed exactly as the GEMM
// would, from its packed float32 panels, and the largest wins (the first index on a tie, as torch.argmax).
// So the token is the one the float32 logits give, bit for bit, never an approximation of it. A row whose
// hidden state or bfloat16 logits are not finite returns -1: the caller computes its logits in full.
#include "simd.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

torch::Tensor amx_linear(const torch::Tensor& input, const torch::Tensor& packed,
                         const c10::optional<torch::Tensor>& bias, int64_t N, bool gated);

namespace {

constexpr int64_t NR = 16;  // gemm.cpp's panel width: column j is lane j % 16 of panel j / 16, k-major

// The float32 logit of column j as gemm.cpp's tile computes it: one fused multiply-add per k, in k order.
inline float panel_logit(const float* x, const float* panels, int64_t K, int64_t j) {
  const float* w = panels + (j / NR) * K * NR + (j % NR);
  float acc = 0.0f;
  for (int64_t k = 0; k < K; ++k) acc = std::fma(x[k], w[k * NR], acc);
  return acc;
}

struct Bound {
  float c1, c2, tiny;
};

// E_j for one token and for 8 (a = C1 ||x||, the row's factor; wn = ||w_j||).
inline float error_bound(float a, float wn, float bj, const Bound& bound) {
  return a * wn + bound.c2 * std::fabs(bj) + bound.tiny;
}
#ifdef NANOINFER_AVX2
inline __m256 error_bound8(__m256 a, __m256 wn, __m256 bj, const Bound& bound) {
  const __m256 absb = _mm256_and_ps(bj, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  return _mm256_add_ps(_mm256_fmadd_ps(a, wn, _mm256_mul_ps(_mm256_set1_ps(bound.c2), absb)),
                       _mm256_set1_ps(bound.tiny));
}
#endif

// One row: the index of the largest float32 logit, or -1 (not finite: the caller takes the full path).
int64_t pick_row(const float* x, const at::BFloat16* b, const float* wnorm, const float* panels, int64_t K,
                 int64_t V, const Bound& bound) {
  double sq = 0.0;
  for (int64_t k = 0; k < K; ++k) sq += (double)x[k] * x[k];
  const double xn = std::sqrt(sq) * (1.0 + 1e-6);
  if (!std::isfinite(xn)) return -1;
  const float a = (float)(bound.c1 * xn);
  // Pass 1: the threshold max_j (B_j - E_j); any non-finite B_j sends the row to the full path.
  float threshold = -std::numeric_limits<float>::infinity();
  bool finite = true;
  int64_t j = 0;
#ifdef NANOINFER_AVX2
  const __m256 va = _mm256_set1_ps(a);
  {
    __m256 tmax = _mm256_set1_ps(threshold);
    __m256 bad = _mm256_setzero_ps();
    const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (; j + 8 <= V; j += 8) {
      const __m256 bj = load8(b + j);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(bj, abs_mask), inf, _CMP_NLT_UQ));  // inf or NaN
      tmax = _mm256_max_ps(tmax, _mm256_sub_ps(bj, error_bound8(va, _mm256_loadu_ps(wnorm + j), bj, bound)));
    }
    if (_mm256_movemask_ps(bad) != 0) finite = false;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, tmax);
    for (const float l : lanes) threshold = std::max(threshold, l);
  }
#endif
  for (; j < V; ++j) {
    const float bj = to_f(b[j]);
    if (!std::isfinite(bj)) finite = false;
    threshold = std::max(threshold, bj - error_bound(a, wnorm[j], bj, bound));
  }
  if (!finite) return -1;
  // Pass 2: every candidate's exact logit, in index order (a later equal value does not win).
  int64_t best = -1;
  float best_value = 0.0f;
  auto consider = [&](int64_t i) {
    const float value = panel_logit(x, panels, K, i);
    if (std::isnan(value)) return false;
    if (best < 0 || value > best_value) best = i, best_value = value;
    return true;
  };
  j = 0;
#ifdef NANOINFER_AVX2
  const __m256 vt = _mm256_set1_ps(threshold);
  for (; j + 8 <= V; j += 8) {
    const __m256 bj = load8(b + j);
    const __m256 upper = _mm256_add_ps(bj, error_bound8(va, _mm256_loadu_ps(wnorm + j), bj, bound));
    for (int hit = _mm256_movemask_ps(_mm256_cmp_ps(upper, vt, _CMP_GE_OQ)); hit; hit &= hit - 1)
      if (!consider(j + __builtin_ctz(hit))) return -1;
  }
#endif
  for (; j < V; ++j) {
    const float bj = to_f(b[j]);
    if (bj + error_bound(a, wnorm[j], bj, bound) >= threshold && !consider(j)) return -1;
  }
  return best;
}

}  // namespace

// hidden [R, K] float32 -> [R] int64: the argmax of hidden's float32 logits through the panel-packed weight
// `panels` (pack_linear_weight), found via `amx_packed` (pack_amx_weight of the same weight in bfloat16) and
// `weight_norms` [V] (each row's L2 norm, rounded up); -1 for a row to compute in full.
torch::Tensor greedy_lm_head(const torch::Tensor& hidden, const torch::Tensor& amx_packed,
                             const torch::Tensor& weight_norms, const torch::Tensor& panels, int64_t V) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.device().is_cpu(),
              "greedy_lm_head: hidden states [rows, hidden] float32 on CPU");
  const int64_t R = hidden.size(0), K = hidden.size(1);
  TORCH_CHECK(weight_norms.scalar_type() == at::kFloat && weight_norms.numel() == V && weight_norms.is_contiguous(),
              "greedy_lm_head: weight_norms [", V, "] float32");
  TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.dim() == 3 && panels.size(0) == (V + NR - 1) / NR &&
                  panels.size(1) == K && panels.size(2) == NR && panels.is_contiguous(),
              "greedy_lm_head: panels not packed by pack_linear_weight for this shape");
  auto out = torch::empty({R}, torch::kLong);
  if (R == 0) return out;
  const auto x = hidden.contiguous();
  const torch::Tensor logits = amx_linear(x.to(at::kBFloat16), amx_packed, c10::nullopt, V, false);  // [R, V]
  const double u = std::ldexp(1.0, -8);                            // bfloat16's unit roundoff
  const double gamma = 2.0 * K * std::ldexp(1.0, -24);             // float32 sums of up to 2K terms, either way
  const double margin = 1.0 + std::ldexp(1.0, -10);                // the bound's own float32 arithmetic
  const Bound bound{(float)((2 * u + u * u + 3 * gamma / (1 - gamma)) * margin),
                    (float)(u / (1 - u) * margin + std::ldexp(1.0, -20)), 1e-30f};
  const float* xp = x.data_ptr<float>();
  const at::BFloat16* bp = logits.data_ptr<at::BFloat16>();
  const float* wn = weight_norms.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = pick_row(xp + r * K, bp + r * V, wn, pp, K, V, bound);
  });
  return out;
}
