// Packing a float32 weight as exact 4-bit blocks (csrc/q4_panels.h says why and the layout), when it is one.
#include "q4_panels.h"

#include <atomic>

namespace {

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

// One column's 32 values as fma(q, d, m), bit for bit, with d and m float16 and q in 0..15: d, m and the q's
// (one a byte) written, true; false if they are not exactly that. A Q4_1 block's smallest value is its m (the
// quantizer gives it q = 0) and its largest is top * d + m, top almost always 15; d is looked for from there,
// a float16 step either side too (the quantizer rounds d after using it). The check that every value comes
// back bit for bit is what decides; real blocks pass at the first try, and a weight that is not one fails at
// its first block.
bool fit_block(const float* x, c10::Half& d_out, c10::Half& m_out, uint8_t* q) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < kQ4Group; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
  const c10::Half m(lo);
  const float mf = static_cast<float>(m);
  if (bits_of(mf) != bits_of(lo) || !std::isfinite(hi)) return false;  // NaN or inf: never a block value
  for (int top = 15; top >= 1; --top) {
    const uint16_t d0 = c10::Half((hi - lo) / static_cast<float>(top)).x;
    for (const int step : {0, 1, -1}) {
      const c10::Half d(static_cast<uint16_t>(d0 + step), c10::Half::from_bits());
      const float df = static_cast<float>(d);
      if (!(df >= 0.f) || !std::isfinite(df)) continue;
      bool exact = true;
      for (int i = 0; i < kQ4Group && exact; ++i) {
        const float qf = df == 0.f ? 0.f : std::min(15.f, std::max(0.f, std::nearbyint((x[i] - mf) / df)));
        exact = bits_of(std::fma(qf, df, mf)) == bits_of(x[i]);
        q[i] = static_cast<uint8_t>(qf);
      }
      if (exact) {
        d_out = d, m_out = m;
        return true;
      }
    }
    if (hi == lo) break;  // d = 0 was tried
  }
  return false;
}

}  // namespace

// [N, K] float32 weight (or gated [2I, K]: panels of 8 gate and the 8 matching up columns) -> its panels as exact
// 4-bit blocks, uint8 [panels, K / 32, kQ4BlockBytes]; an empty tensor when any value is not exactly one (or K is
// not a multiple of 32), decided at the first block that fails.
torch::Tensor pack_q4_panels(const torch::Tensor& weight, bool gated) {
  TORCH_CHECK(weight.dim() == 2 && (!gated || weight.size(0) % 2 == 0), "pack_q4_panels: a 2-D weight");
  const auto none = torch::empty({0}, torch::kUInt8);
#ifndef NANOINFER_AVX512
  return none;  // the GEMM expands 4-bit weights with AVX-512 only (csrc/gemm.cpp)
#endif
  if (weight.scalar_type() != at::kFloat || weight.size(1) % kQ4Group != 0 || weight.size(1) == 0) return none;
  const auto w = weight.contiguous();
  const float* src = w.data_ptr<float>();
  const int64_t K = w.size(1), blocks = K / kQ4Group;
  const int64_t N = gated ? w.size(0) / 2 : w.size(0), cols = gated ? 8 : 16, P = (N + cols - 1) / cols;
  // Panel p's column j comes from this row of the weight (-1: a column past N, which the float32 panels hold
  // as zeros: d = m = q = 0 gives the same +0.0).
  auto row_of = [&](int64_t p, int64_t j) -> int64_t {
    if (!gated) return p * 16 + j < N ? p * 16 + j : -1;
    const int64_t i = p * 8 + j % 8;
    return i < N ? (j < 8 ? i : N + i) : -1;
  };
  auto packed = zeros_on_huge_pages({P, blocks, kQ4BlockBytes}, torch::kUInt8);
  uint8_t* dst = packed.data_ptr<uint8_t>();
  std::atomic<bool> inexact{false};
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    uint8_t q[kQ4Group];
    for (int64_t p = p0; p < p1 && !inexact.load(std::memory_order_relaxed); ++p)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* blk = dst + (p * blocks + b) * kQ4BlockBytes;
        c10::Half* header = reinterpret_cast<c10::Half*>(blk);
        uint8_t* nibbles = blk + kQ4HeaderBytes;
        for (int64_t j = 0; j < 16; ++j) {
          const int64_t r = row_of(p, j);
          if (r < 0) continue;  // zeros already
          if (!fit_block(src + r * K + b * kQ4Group, header[j], header[16 + j], q)) {
            inexact.store(true, std::memory_order_relaxed);
            return;
          }
          for (int k = 0; k < kQ4Group; k += 2) nibbles[16 * (k / 2) + j] = q[k] | (q[k + 1] << 4);
        }
      }
  });
  return inexact.load() ? none : packed;
}
