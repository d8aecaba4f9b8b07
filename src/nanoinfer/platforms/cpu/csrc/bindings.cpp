// The Python module of nanoinfer's CPU kernels (built by platforms/cpu/ops.py).
#include "simd.h"

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window,
                           double soft_cap, const c10::optional<torch::Tensor>& sinks);
void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                   torch::Tensor q_starts, torch::Tensor q_lens, torch::Tensor seq_lens, double scale,
                   torch::Tensor out, int64_t window, double soft_cap, const c10::optional<torch::Tensor>& sinks);
void store_kvcache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slot_mapping);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
void rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                      torch::Tensor sin);
torch::Tensor greedy_argmax(torch::Tensor logits);
void bind_decode_layers(pybind11::module& m);
torch::Tensor pack_linear_weight(const torch::Tensor& weight);
torch::Tensor pack_gated_weight(const torch::Tensor& weight);
torch::Tensor packed_linear(const torch::Tensor& input, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias, int64_t N, bool gated,
                            const c10::optional<torch::Tensor>& compact,
                            const c10::optional<torch::Tensor>& compact_amx);
torch::Tensor pack_q4_panels(const torch::Tensor& weight, bool gated);
torch::Tensor pack_q4_amx(const torch::Tensor& compact);
torch::Tensor pack_amx_weight(const torch::Tensor& weight, bool gated);
torch::Tensor amx_linear(const torch::Tensor& input, const torch::Tensor& packed,
                         const c10::optional<torch::Tensor>& bias, int64_t N, bool gated);
bool amx_available();
torch::Tensor amx_greedy_argmax(const torch::Tensor& hidden, const torch::Tensor& packed, int64_t N);
torch::Tensor greedy_lm_head(const torch::Tensor& hidden, const torch::Tensor& amx_packed,
                             const torch::Tensor& weight_norms, const torch::Tensor& panels, int64_t V);
torch::Tensor pack_moe_weights(const torch::Tensor& weight, bool gated);
torch::Tensor fused_moe(const torch::Tensor& x, const torch::Tensor& topk_ids, const torch::Tensor& topk_weights,
                        const torch::Tensor& w13, const torch::Tensor& w2, const c10::optional<torch::Tensor>& b13,
                        const c10::optional<torch::Tensor>& b2, int64_t intermediate_size, int64_t activation,
                        double alpha, double limit);
void add_lora(torch::Tensor y, const torch::Tensor& x, const torch::Tensor& lora_a, const torch::Tensor& lora_b,
              const torch::Tensor& row_slots, std::vector<int64_t> slice_offsets);
// linear attention (gated_delta.cpp)
void gated_delta_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                        torch::Tensor ssm_state, torch::Tensor state_slots, torch::Tensor out,
                        const c10::optional<torch::Tensor>& has_context);
void causal_conv1d_update(torch::Tensor x, torch::Tensor weight, torch::Tensor conv_state, torch::Tensor state_slots,
                          torch::Tensor out, const c10::optional<torch::Tensor>& has_context);
void gated_delta_prefill(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                         torch::Tensor ssm_state, torch::Tensor state_slots, torch::Tensor query_start_loc,
                         torch::Tensor out, const c10::optional<torch::Tensor>& has_context);
void causal_conv1d_prefill(torch::Tensor x, torch::Tensor weight, torch::Tensor conv_state, torch::Tensor state_slots,
                           torch::Tensor query_start_loc, torch::Tensor out,
                           const c10::optional<torch::Tensor>& has_context);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode,
        "paged decode attention over the block tables, of each row's last `window` keys (0: all of them), scores "
        "soft-capped at soft_cap (0: none), with each head's sink logit (float32 [H_q]) in the softmax (None: none)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("seq_lens"), pybind11::arg("scale"), pybind11::arg("window"), pybind11::arg("soft_cap"),
        pybind11::arg("sinks") = pybind11::none());
  m.def("zeros_on_huge_pages", &zeros_on_huge_pages,
        "a zero-filled tensor on 2 MiB pages where Linux grants them, committed as it is written");
  m.def("paged_prefill", &paged_prefill,
        "causal prefill attention of every prompt chunk of a step, reading the paged cache in place, into out "
        "(keys in each query's last `window` positions, 0: all; scores soft-capped at soft_cap, 0: none; each head's "
        "sink logit, float32 [H_q], in the softmax, None: none)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("q_starts"), pybind11::arg("q_lens"), pybind11::arg("seq_lens"), pybind11::arg("scale"),
        pybind11::arg("out"), pybind11::arg("window"), pybind11::arg("soft_cap"),
        pybind11::arg("sinks") = pybind11::none());
  m.def("store_kvcache", &store_kvcache, "key/value rows into their cache slots (-1 skipped)");
  m.def("rms_norm", &rms_norm, "RMSNorm of the last dimension (float32)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = RMSNorm(residual), in place (float32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a [tokens, 2 * intermediate] matrix (float32)");
  m.def("rotary_embedding", &rotary_embedding, "neox-style rotary of q and k in place (float32)");
  bind_decode_layers(m);
  m.def("greedy_argmax", &greedy_argmax, "index of each row's largest value, as torch.argmax (float32)");
  m.def("pack_linear_weight", &pack_linear_weight, "[N, K] float32/bfloat16 weight -> [ceil(N/16), K, 16] panels");
  m.def("pack_gated_weight", &pack_gated_weight,
        "[2I, K] gate_up weight -> [ceil(I/8), K, 16] panels of 8 gate and the 8 matching up columns");
  m.def("packed_linear", &packed_linear,
        "x W^T + b with W from pack_linear_weight (float32 or bfloat16, float32 sums); gated: W from "
        "pack_gated_weight, out = silu(x Wg^T) * (x Wu^T); compact: the same weight from pack_q4_panels, read "
        "instead of the float32 panels by steps of few rows (the same bits); compact_amx: from pack_q4_amx, run "
        "on AMX by steps of more rows (float32 sums in another order)",
        pybind11::arg("input"), pybind11::arg("packed"), pybind11::arg("bias"), pybind11::arg("out_features"),
        pybind11::arg("gated") = false, pybind11::arg("compact") = pybind11::none(),
        pybind11::arg("compact_amx") = pybind11::none());
  m.def("pack_q4_amx", &pack_q4_amx,
        "pack_q4_panels' 4-bit panels -> AMX tiles of q in bfloat16 with d and m in float32, for packed_linear's "
        "compact_amx: steps of many rows then run on AMX (x split into three exact bfloat16 parts)");
  m.def("pack_q4_panels", &pack_q4_panels,
        "[N, K] float32 weight (gated: [2I, K]) -> its panels as exact 4-bit blocks (d * q + m, float16 d and m "
        "per 32 inputs) for packed_linear's compact, or an empty tensor when a value is not exactly one",
        pybind11::arg("weight"), pybind11::arg("gated") = false);
  m.def("amx_available", &amx_available, "can this build and CPU run amx_linear (AMX bfloat16, OS permission)?");
  m.def("pack_amx_weight", &pack_amx_weight,
        "[N, K] bfloat16 weight -> AMX pairs of 32 columns (gated: [2I, K] -> 16 gate + 16 up columns a pair)",
        pybind11::arg("weight"), pybind11::arg("gated") = false);
  m.def("amx_linear", &amx_linear,
        "x W^T + b in bfloat16 on AMX with W from pack_amx_weight (float32 sums, rounded once); gated: "
        "silu(x Wg^T) * (x Wu^T) with the roundings of the separate bfloat16 ops",
        pybind11::arg("input"), pybind11::arg("packed"), pybind11::arg("bias"), pybind11::arg("out_features"),
        pybind11::arg("gated") = false);
  m.def("amx_greedy_argmax", &amx_greedy_argmax,
        "argmax of each row of amx_linear(hidden, packed)'s bfloat16 logits (first index on a tie) without "
        "writing them; -1 for a row with a NaN",
        pybind11::arg("hidden"), pybind11::arg("packed"), pybind11::arg("out_features"));
  m.def("greedy_lm_head", &greedy_lm_head,
        "argmax of float32 logits x W^T (W panel-packed) found from bfloat16 AMX logits and an error bound, "
        "confirmed in float32 on the candidates; -1 for a row to compute in full",
        pybind11::arg("hidden"), pybind11::arg("amx_packed"), pybind11::arg("weight_norms"), pybind11::arg("panels"),
        pybind11::arg("vocab_size"));
#ifdef NANOINFER_AVX2
  m.attr("vectorized") = true;
#else
  m.attr("vectorized") = false;
#endif
  // The widest vector code the build uses (the GEMM's tile; the other kernels are AVX2 at most).
#if defined(NANOINFER_AVX512)
  m.attr("simd") = "avx512";
#elif defined(NANOINFER_AVX2)
  m.attr("simd") = "avx2";
#else
  m.attr("simd") = "none";
#endif
  m.def("pack_moe_weights", &pack_moe_weights,
        "[E, N, K] expert weights (gated: [E, 2I, K], gate rows then up rows) -> fused_moe's panels: float32 "
        "[E, P, K, 16] (each expert as pack_linear_weight / pack_gated_weight), bfloat16 [E, P, ceil(K/2), 32] "
        "(k-steps in pairs)",
        pybind11::arg("weight"), pybind11::arg("gated"));
  m.def("fused_moe", &fused_moe,
        "sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for x [T, H] (float32 / bfloat16) with "
        "pack_moe_weights' w13 (gated) and w2, float32 biases [E, 2I] and [E, H] or None; activation 0 silu, "
        "1 gelu_tanh, 2 swigluoai (alpha, limit)",
        pybind11::arg("x"), pybind11::arg("topk_ids"), pybind11::arg("topk_weights"), pybind11::arg("w13"),
        pybind11::arg("w2"), pybind11::arg("b13"), pybind11::arg("b2"), pybind11::arg("intermediate_size"),
        pybind11::arg("activation"), pybind11::arg("alpha"), pybind11::arg("limit"));
  m.def("add_lora", &add_lora,
        "y += each row's own adapter's LoRA delta, in place (Platform.add_lora): x [T, K], y [T, N] (rows "
        "contiguous), lora_a [L, S * R, K], lora_b [L, R, N], one dtype (float32 / bfloat16, float32 sums, h rounded "
        "to it); row_slots int32 [T] (-1: no adapter); slice s is columns slice_offsets[s] .. slice_offsets[s + 1]",
        pybind11::arg("y"), pybind11::arg("x"), pybind11::arg("lora_a"), pybind11::arg("lora_b"),
        pybind11::arg("row_slots"), pybind11::arg("slice_offsets"));
  // linear attention (gated_delta.cpp)
  m.def("gated_delta_decode", &gated_delta_decode,
        "one decode step of the gated delta rule into out [B, H_v, D_v]: q, k [B, H_k, D_k] (normalised inside), "
        "v [B, H_v, D_v] (float32 / bfloat16, the last dim contiguous), g and beta float32 [B, H_v]; row b reads and "
        "writes ssm_state (float32 [S, H_v, D_k, D_v]) at slot state_slots[b] (negative: output zeros, no slot), "
        "from zeros where has_context (bool [B], None: all) is false",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("g"), pybind11::arg("beta"),
        pybind11::arg("ssm_state"), pybind11::arg("state_slots"), pybind11::arg("out"),
        pybind11::arg("has_context") = pybind11::none());
  m.def("causal_conv1d_update", &causal_conv1d_update,
        "one decode step of the depthwise causal conv + SiLU into out [B, C]: x [B, C], weight [C, K], conv_state "
        "[S, C, K - 1] (one dtype, float32 / bfloat16) read and shifted at slot state_slots[b] (negative: output "
        "zeros, no slot), from zeros where has_context (bool [B], None: all) is false",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("conv_state"), pybind11::arg("state_slots"),
        pybind11::arg("out"), pybind11::arg("has_context") = pybind11::none());
  m.def("gated_delta_prefill", &gated_delta_prefill,
        "the gated delta rule, token by token (the recurrent form), over each sequence's rows into out [T, H_v, D_v]: "
        "sequence b has rows query_start_loc[b] .. query_start_loc[b + 1] (int [B + 1]) of q, k [T, H_k, D_k] "
        "(normalised inside), v [T, H_v, D_v] (float32 / bfloat16, the last dim contiguous), g and beta float32 "
        "[T, H_v]; it reads and writes ssm_state (float32 [S, H_v, D_k, D_v]) at slot state_slots[b] (negative: "
        "output zeros, no slot), from zeros where has_context (bool [B], None: all) is false",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("g"), pybind11::arg("beta"),
        pybind11::arg("ssm_state"), pybind11::arg("state_slots"), pybind11::arg("query_start_loc"),
        pybind11::arg("out"), pybind11::arg("has_context") = pybind11::none());
  m.def("causal_conv1d_prefill", &causal_conv1d_prefill,
        "the depthwise causal conv + SiLU over each sequence's rows into out [T, C]: sequence b has rows "
        "query_start_loc[b] .. query_start_loc[b + 1] (int [B + 1]) of x [T, C], weight [C, K], conv_state "
        "[S, C, K - 1] (one dtype, float32 / bfloat16), continuing from slot state_slots[b] (negative: output zeros, "
        "no slot; from zeros where has_context, bool [B] or None: all, is false), which keeps its last K - 1 inputs",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("conv_state"), pybind11::arg("state_slots"),
        pybind11::arg("query_start_loc"), pybind11::arg("out"), pybind11::arg("has_context") = pybind11::none());
}
