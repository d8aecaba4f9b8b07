// Every decoder layer of a pure-decode step in one call (one CPU process, no tensor parallelism): float32
// through our panel GEMM, or bfloat16 through the AMX GEMM (`amx`).
//
// Why: with the kernels at the CPU's ceilings, the Python around them (module calls, views, checks, per layer)
// was what remained of a decode step (benchmarks/README.md). The same kernels run here in the same order on the
// same tensors (platforms/cpu/decode_runner.py says when this path applies), so the output is bit for bit the
// per-layer path's. The layers' tensors are handed over once, by name (decode_runner.LAYER_TENSORS), and kept.
#include "simd.h"

#include <array>
#include <string>
#include <tuple>
#include <unordered_map>

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                      torch::Tensor sin);
void store_kvcache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slot_mapping);
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window,
                           double soft_cap, const c10::optional<torch::Tensor>& sinks);
torch::Tensor packed_linear(const torch::Tensor& input, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias, int64_t N, bool gated,
                            const c10::optional<torch::Tensor>& compact,
                            const c10::optional<torch::Tensor>& compact_amx);
torch::Tensor amx_linear(const torch::Tensor& input, const torch::Tensor& packed,
                         const c10::optional<torch::Tensor>& bias, int64_t N, bool gated);

namespace {

using Named = std::unordered_map<std::string, torch::Tensor>;

c10::optional<torch::Tensor> present(const torch::Tensor& t) {
  return t.defined() && t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// One packed projection: the packed weight, and its exact 4-bit forms where it has them (csrc/q4_panels.h,
// q4_amx_gemm.cpp).
struct Projection {
  torch::Tensor packed, compact, compact_amx;
};

struct Layer {
  torch::Tensor input_layernorm, post_attention_layernorm, qkv_bias, k_cache, v_cache;
  Projection qkv_proj, o_proj, gate_up_proj, down_proj;
};

torch::Tensor take(const Named& named, const std::string& name, size_t layer, bool optional = false) {
  auto it = named.find(name);
  TORCH_CHECK(it != named.end() || optional, "DecodeLayers: layer ", layer, " has no tensor named '", name, "'");
  return it == named.end() ? torch::Tensor() : it->second;
}

Projection take_projection(const Named& named, const std::string& name, size_t layer) {
  return {take(named, name, layer), take(named, name + ".compact", layer, true),
          take(named, name + ".compact_amx", layer, true)};
}

}  // namespace

class DecodeLayers {
 public:
  // layers: one {name: tensor} a layer (decode_runner.LAYER_TENSORS names them); cos/sin: the rotary tables.
  DecodeLayers(const std::vector<Named>& layers, torch::Tensor cos, torch::Tensor sin, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double eps, double scale,
               bool amx)
      : cos_(cos), sin_(sin), num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
        intermediate_size_(intermediate_size), eps_(eps), scale_(scale), amx_(amx) {
    for (size_t i = 0; i < layers.size(); ++i) {
      const Named& n = layers[i];
      layers_.push_back({take(n, "input_layernorm", i), take(n, "post_attention_layernorm", i),
                         take(n, "qkv_bias", i, true), take(n, "k_cache", i), take(n, "v_cache", i),
                         take_projection(n, "qkv_proj", i), take_projection(n, "o_proj", i),
                         take_projection(n, "gate_up_proj", i), take_projection(n, "down_proj", i)});
    }
  }

  // hidden [T, hidden] (the embeddings) -> (hidden, residual) after the last layer, before the final norm.
  std::tuple<torch::Tensor, torch::Tensor> run(torch::Tensor hidden, torch::Tensor positions,
                                               torch::Tensor slot_mapping, torch::Tensor block_tables,
                                               torch::Tensor seq_lens) {
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "DecodeLayers: contiguous [tokens, hidden] input");
    const int64_t T = hidden.size(0), H = hidden.size(1);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    torch::Tensor residual;
    for (const Layer& w : layers_) {
      if (!residual.defined()) {
        residual = hidden;
        hidden = rms_norm(hidden, w.input_layernorm, eps_);
      } else {
        fused_add_rms_norm(hidden, residual, w.input_layernorm, eps_);
      }
      const auto qkv = linear(hidden, w.qkv_proj, present(w.qkv_bias), q_size + 2 * kv_size, false);
      const auto q = qkv.narrow(1, 0, q_size).view({T, num_heads_, head_dim_});
      const auto k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads_, head_dim_});
      const auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads_, head_dim_});
      rotary_embedding(positions, q, k, cos_, sin_);
      store_kvcache(k, v, w.k_cache, w.v_cache, slot_mapping);
      // q read in place; no window, soft cap or sinks (decode_runner.py takes no layer with them)
      const auto attn = paged_decode(q, w.k_cache, w.v_cache, block_tables, seq_lens, scale_, 0, 0.0, c10::nullopt);
      hidden = linear(attn.view({T, q_size}), w.o_proj, c10::nullopt, H, false);
      fused_add_rms_norm(hidden, residual, w.post_attention_layernorm, eps_);
      hidden = linear(linear(hidden, w.gate_up_proj, c10::nullopt, intermediate_size_, true), w.down_proj,
                      c10::nullopt, H, false);
    }
    return {hidden, residual};
  }

 private:
  torch::Tensor linear(const torch::Tensor& x, const Projection& w, const c10::optional<torch::Tensor>& bias,
                       int64_t N, bool gated) const {
    if (amx_) return amx_linear(x, w.packed, bias, N, gated);
    return packed_linear(x, w.packed, bias, N, gated, present(w.compact), present(w.compact_amx));
  }

  std::vector<Layer> layers_;
  torch::Tensor cos_, sin_;
  int64_t num_heads_, num_kv_heads_, head_dim_, intermediate_size_;
  double eps_, scale_;
  bool amx_;
};

void bind_decode_layers(pybind11::module& m) {
  pybind11::class_<DecodeLayers>(m, "DecodeLayers",
                                 "every decoder layer of a pure-decode step, over tensors handed over once by name")
      .def(pybind11::init<const std::vector<Named>&, torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t,
                          int64_t, double, double, bool>(),
           pybind11::arg("layers"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("num_heads"),
           pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("intermediate_size"),
           pybind11::arg("eps"), pybind11::arg("scale"), pybind11::arg("amx"))
      .def("run", &DecodeLayers::run, "(hidden, residual) after the last layer, before the final norm",
           pybind11::arg("hidden"), pybind11::arg("positions"), pybind11::arg("slot_mapping"),
           pybind11::arg("block_tables"), pybind11::arg("seq_lens"));
}
