// Every decoder layer of a pure-decode step in one call (one CPU process, no tensor parallelism): float32
// through our panel GEMM, or bfloat16 through the AMX GEMM (`amx`).
//
// Why: with the kernels at this machine's ceilings, what was left of W's decode outside them was Python:
// ~0.3 ms a layer of module calls, views and checks around ~9 kernel calls (2.5 s of a 26.6 s decode,
// benchmarks/README.md). Here the same kernels run in the same order on the same tensors (model/cpu_decode.py
// says when this path applies), so the output is bit for bit the per-layer Python path's.
#include "simd.h"

#include <tuple>

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                      torch::Tensor sin);
void store_kvcache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slot_mapping);
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
torch::Tensor packed_linear(const torch::Tensor& input, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias, int64_t N, bool gated,
                            const c10::optional<torch::Tensor>& compact,
                            const c10::optional<torch::Tensor>& compact_amx);
torch::Tensor amx_linear(const torch::Tensor& input, const torch::Tensor& packed,
                         const c10::optional<torch::Tensor>& bias, int64_t N, bool gated);

// What one layer passes, in this order (kLayerTensors of them): input norm weight, qkv packed weight, qkv bias
// (an empty tensor: none), o_proj packed weight, post-attention norm weight, gate_up weight packed gated,
// down_proj packed weight, key cache, value cache, then the four weights' exact 4-bit forms for packed_linear's
// compact (qkv, o_proj, gate_up, down_proj; empty tensors: none) and the same for its compact_amx. Weights packed
// for packed_linear, or (amx) amx_linear.
constexpr size_t kLayerTensors = 17;

// hidden [T, hidden] (the embeddings) -> (hidden, residual) after the last layer, before the final norm.
std::tuple<torch::Tensor, torch::Tensor> decode_layers(
    torch::Tensor hidden, torch::Tensor positions, torch::Tensor slot_mapping, torch::Tensor block_tables,
    torch::Tensor seq_lens, const std::vector<torch::Tensor>& layers, torch::Tensor cos, torch::Tensor sin,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double eps,
    double scale, bool amx) {
  // compact, compact_amx: the weight's exact 4-bit forms, or empty tensors (csrc/q4_panels.h, q4_amx_gemm.cpp)
  auto linear = [amx](const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                      int64_t N, bool gated, const torch::Tensor& compact, const torch::Tensor& compact_amx) {
    if (amx) return amx_linear(x, w, bias, N, gated);
    return packed_linear(x, w, bias, N, gated, compact.numel() ? c10::optional<torch::Tensor>(compact) : c10::nullopt,
                         compact_amx.numel() ? c10::optional<torch::Tensor>(compact_amx) : c10::nullopt);
  };
  TORCH_CHECK(layers.size() % kLayerTensors == 0, "decode_layers: ", kLayerTensors, " tensors a layer, got ",
              layers.size());
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "decode_layers: contiguous [tokens, hidden] input");
  const int64_t T = hidden.size(0), H = hidden.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  torch::Tensor residual;
  for (size_t i = 0; i < layers.size(); i += kLayerTensors) {
    const torch::Tensor* w = layers.data() + i;
    if (!residual.defined()) {
      residual = hidden;
      hidden = rms_norm(hidden, w[0], eps);
    } else {
      fused_add_rms_norm(hidden, residual, w[0], eps);
    }
    const auto qkv_bias = w[2].numel() ? c10::optional<torch::Tensor>(w[2]) : c10::nullopt;
    const auto qkv = linear(hidden, w[1], qkv_bias, q_size + 2 * kv_size, false, w[9], w[13]);
    const auto q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
    const auto k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
    const auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
    rotary_embedding(positions, q, k, cos, sin);
    store_kvcache(k, v, w[7], w[8], slot_mapping);
    const auto attn = paged_decode(q, w[7], w[8], block_tables, seq_lens, scale);  // q read in place
    hidden = linear(attn.view({T, q_size}), w[3], c10::nullopt, H, false, w[10], w[14]);
    fused_add_rms_norm(hidden, residual, w[4], eps);
    hidden = linear(linear(hidden, w[5], c10::nullopt, intermediate_size, true, w[11], w[15]), w[6], c10::nullopt, H,
                    false, w[12], w[16]);
  }
  return {hidden, residual};
}
