// Greedy tokens of a float32 model without its float32 LM head: the argmax of every row's float32 logits,
// found from bfloat16 logits (AMX) and an error bound, then confirmed in float32 on a few candidates.
//
// Why: the LM head is a fifth of SmolLM2-135M's multiply-adds per token (49,152 x 576 of 134.5M) and in float32
// it runs at the FMA ports' rate; with AMX the same product in bfloat16 costs ~a third, and the float32 head was
// a large part of a float32 decode (benchmarks/README.md). Greedy decoding needs only the
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
// The bfloat16 logits are never stored: the AMX GEMM's epilogue keeps each row's running max_i (B_i - E_i) and
// the columns that reach it (amx_logit_candidates, amx_gemm.cpp). Storing [rows, V] and reading it back
// twice cost 15.9 ms for 175 rows where the GEMM alone took 6.2.
#include "amx.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

namespace {

constexpr int64_t NR = 16;  // gemm.cpp's panel width: column j is lane j % 16 of panel j / 16, k-major

// The float32 logit of column j as gemm.cpp's tile computes it: one fused multiply-add per k, in k order.
inline float panel_logit(const float* x, const float* panels, int64_t K, int64_t j) {
  const float* w = panels + (j / NR) * K * NR + (j % NR);
  float acc = 0.0f;
  for (int64_t k = 0; k < K; ++k) acc = std::fma(x[k], w[k * NR], acc);
  return acc;
}

// The index of the largest float32 logit among a row's candidates (the first on a tie), or -1: none (the
// bfloat16 logits were not finite) or a NaN logit, either way the caller computes the row in full.
int64_t pick_row(const float* x, const std::vector<int32_t>& candidates, const float* panels, int64_t K) {
  int64_t best = -1;
  float best_value = 0.0f;
  for (const int32_t j : candidates) {
    const float value = panel_logit(x, panels, K, j);
    if (std::isnan(value)) return -1;
    if (best < 0 || value > best_value || (value == best_value && j < best)) best = j, best_value = value;
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
  const double u = std::ldexp(1.0, -8);                            // bfloat16's unit roundoff
  const double gamma = 2.0 * K * std::ldexp(1.0, -24);             // float32 sums of up to 2K terms, either way
  const double margin = 1.0 + std::ldexp(1.0, -10);                // the bound's own float32 arithmetic
  const double c1 = (2 * u + u * u + 3 * gamma / (1 - gamma)) * margin;
  const float* xp = x.data_ptr<float>();
  // Each row's factor of E_j, c1 ||x|| (rounded up); a row whose norm is not finite takes the full path.
  std::vector<float> scale(R);
  std::vector<char> finite(R);
  for (int64_t r = 0; r < R; ++r) {
    double sq = 0.0;
    for (int64_t k = 0; k < K; ++k) sq += (double)xp[r * K + k] * xp[r * K + k];
    const double xn = std::sqrt(sq) * (1.0 + 1e-6);
    finite[r] = std::isfinite(xn);
    scale[r] = finite[r] ? (float)(c1 * xn) : 0.0f;
  }
  LogitBound bound;
  bound.weight_norms = weight_norms.data_ptr<float>();
  bound.row_scale = scale.data();
  bound.c2 = (float)(u / (1 - u) * margin + std::ldexp(1.0, -20));
  bound.tiny = 1e-30f;
  const auto candidates = amx_logit_candidates(x.to(at::kBFloat16), amx_packed, V, bound);
  const float* pp = panels.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = finite[r] ? pick_row(xp + r * K, candidates[r], pp, K) : -1;
  });
  return out;
}
