// Paged decode attention for CPU: each (sequence, KV head) reads its keys and values in place from the
// paged cache (no gathered copy), computes the scores of the G query heads that share the KV head, a
// softmax in float32, and the weighted sum of values. Memory-bound: every cached K/V row is read once.
// Layouts as in reference.py: q [B, H_q, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D].
#include <torch/extension.h>
#include <omp.h>
#include <cmath>
#include <vector>
#include <cstring>

template <typename T> static inline float to_f(T x);
template <> inline float to_f<float>(float x) { return x; }
template <> inline float to_f<at::BFloat16>(at::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
static void decode_impl(const T* q, const T* k, const T* v, const int* tables, const int* lens, T* out,
                        int B, int Hq, int Hkv, int D, int bs, int max_blocks, float scale) {
  const int G = Hq / Hkv;
  #pragma omp parallel
  {
    std::vector<float> scores;
    std::vector<float> qf(G * D), acc(G * D);
    #pragma omp for collapse(2) schedule(dynamic, 1)
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < Hkv; ++h) {
        const int len = lens[b];
        scores.resize((size_t)G * len);
        for (int g = 0; g < G; ++g)
          for (int d = 0; d < D; ++d) qf[g * D + d] = to_f(q[((size_t)b * Hq + h * G + g) * D + d]) * scale;
        const int* table = tables + (size_t)b * max_blocks;
        for (int t = 0; t < len; ++t) {
          const T* kp = k + (((size_t)table[t / bs] * bs + t % bs) * Hkv + h) * D;
          for (int g = 0; g < G; ++g) {
            float s = 0.f;
            const float* qg = qf.data() + g * D;
            #pragma omp simd reduction(+:s)
            for (int d = 0; d < D; ++d) s += qg[d] * to_f(kp[d]);
            scores[(size_t)g * len + t] = s;
          }
        }
        for (int g = 0; g < G; ++g) {
          float* sg = scores.data() + (size_t)g * len;
          float m = -INFINITY;
          for (int t = 0; t < len; ++t) m = std::max(m, sg[t]);
          float sum = 0.f;
          for (int t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
          const float inv = 1.f / sum;
          for (int t = 0; t < len; ++t) sg[t] *= inv;
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int t = 0; t < len; ++t) {
          const T* vp = v + (((size_t)table[t / bs] * bs + t % bs) * Hkv + h) * D;
          for (int g = 0; g < G; ++g) {
            const float p = scores[(size_t)g * len + t];
            float* ag = acc.data() + g * D;
            #pragma omp simd
            for (int d = 0; d < D; ++d) ag[d] += p * to_f(vp[d]);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int d = 0; d < D; ++d) out[((size_t)b * Hq + h * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
      }
    }
  }
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  auto out = torch::empty_like(q);
  const int B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int bs = k_cache.size(1), Hkv = k_cache.size(2);
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  if (q.scalar_type() == at::kFloat) {
    decode_impl<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
      tables.data_ptr<int>(), lens.data_ptr<int>(), out.data_ptr<float>(), B, Hq, Hkv, D, bs, tables.size(1), (float)scale);
  } else {
    decode_impl<at::BFloat16>(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
      tables.data_ptr<int>(), lens.data_ptr<int>(), out.data_ptr<at::BFloat16>(), B, Hq, Hkv, D, bs, tables.size(1), (float)scale);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over the block tables (CPU)");
}
