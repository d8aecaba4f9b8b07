// The decode step of linear attention's two state-carrying ops (Gated DeltaNet: Qwen3-Next, Qwen3.5), one token
// per sequence; attention/gated_delta.py holds the reference versions and the state cache's layout.
//
// gated_delta_decode. Per value head, with q and k L2-normalised (q scaled by D_k^-0.5) and a = exp(g):
//     S' = a S + k delta^T,  delta = beta (v - a S^T k),  o = S'^T q = a S^T q + (k.q) delta
// so one pass over S [D_k, D_v] accumulates S^T k and S^T q, and a second writes S'. The state is what a step
// moves (D_k D_v float32 a head, read and written back); the vectors are small. Every column of S is independent
// of the others (S^T k's column j needs only column j of S), so a work item is (row, value head, block of
// columns) and both passes run over the block: its second read comes from the core's cache. Columns go in tiles
// of up to 8 vectors, whose two running sums stay in registers while the pass walks the rows.
//
// causal_conv1d_update. Per channel, the K - 1 inputs kept in the slot and the new one, times the channel's K
// weights, summed in float32 and through SiLU (in bfloat16 rounded where the reference's conv1d and silu round);
// the slot then keeps the last K - 1 inputs.
//
// Both read each row's slot (a negative slot: a padded row, whose output is zeros and which touches no slot) and,
// where `has_context` says a row has none (a one-token prompt), start from zeros instead of the slot.
#include "simd.h"

namespace {

// V: a vector of kLanes float32 lanes; the tile's accumulators fit the register file up to kMaxTile vectors.
#if defined(NANOINFER_AVX512)
using V = __m512;
constexpr int kLanes = 16, kMaxTile = 8;
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V x) { _mm512_storeu_ps(p, x); }
inline V vset(float x) { return _mm512_set1_ps(x); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
#elif defined(NANOINFER_AVX2)
using V = __m256;
constexpr int kLanes = 8, kMaxTile = 4;
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V x) { _mm256_storeu_ps(p, x); }
inline V vset(float x) { return _mm256_set1_ps(x); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
#else
using V = float;
constexpr int kLanes = 1, kMaxTile = 8;
inline V vload(const float* p) { return *p; }
inline void vstore(float* p, V x) { *p = x; }
inline V vset(float x) { return x; }
inline V vmul(V a, V b) { return a * b; }
inline V vsub(V a, V b) { return a - b; }
inline V vfma(V a, V b, V c) { return a * b + c; }
#endif

// One value head's inputs for the update, in float32.
struct Head {
  const float* k;   // [D_k], normalised
  const float* q;   // [D_k], normalised and scaled
  const float* v;   // [D_v]
  float decay;      // exp(g)
  float beta;
  float kq;         // k.q
  bool has_context;
  float* o;         // [D_v] output
};

// Columns [c, c + N kLanes) of the state S (rows of `ld` floats): pass 1 sums S^T k and S^T q over the rows, then
// delta and the output; pass 2 writes a S + k delta^T (k delta^T alone without context: the slot is not read).
template <int N>
inline void update_tile(float* __restrict S, int64_t ld, int64_t dk, const Head& h, int64_t c) {
  V sk[N], sq[N], delta[N];
  for (int j = 0; j < N; ++j) sk[j] = sq[j] = vset(0.f);
  if (h.has_context) {
    for (int64_t i = 0; i < dk; ++i) {
      const float* row = S + i * ld + c;
      const V ki = vset(h.k[i]), qi = vset(h.q[i]);
#pragma GCC unroll 8
      for (int j = 0; j < N; ++j) {
        const V s = vload(row + j * kLanes);
        sk[j] = vfma(ki, s, sk[j]);
        sq[j] = vfma(qi, s, sq[j]);
      }
    }
  }
  const V decay = vset(h.decay), beta = vset(h.beta), kq = vset(h.kq);
  for (int j = 0; j < N; ++j) {
    const int64_t col = c + j * kLanes;
    delta[j] = vmul(beta, vsub(vload(h.v + col), vmul(decay, sk[j])));
    vstore(h.o + col, vfma(kq, delta[j], vmul(decay, sq[j])));
  }
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * ld + c;
    const V ki = vset(h.k[i]);
    if (h.has_context) {
#pragma GCC unroll 8
      for (int j = 0; j < N; ++j) vstore(row + j * kLanes, vfma(ki, delta[j], vmul(decay, vload(row + j * kLanes))));
    } else {
#pragma GCC unroll 8
      for (int j = 0; j < N; ++j) vstore(row + j * kLanes, vmul(ki, delta[j]));
    }
  }
}

// The same for one column at a time: the columns past the last whole vector.
inline void update_column(float* S, int64_t ld, int64_t dk, const Head& h, int64_t c) {
  float sk = 0.f, sq = 0.f;
  if (h.has_context)
    for (int64_t i = 0; i < dk; ++i) {
      sk += h.k[i] * S[i * ld + c];
      sq += h.q[i] * S[i * ld + c];
    }
  const float delta = h.beta * (h.v[c] - h.decay * sk);
  h.o[c] = h.decay * sq + h.kq * delta;
  for (int64_t i = 0; i < dk; ++i)
    S[i * ld + c] = h.k[i] * delta + (h.has_context ? h.decay * S[i * ld + c] : 0.f);
}

// Columns [c0, c1) in the widest tiles that fit.
inline void update_columns(float* S, int64_t ld, int64_t dk, const Head& h, int64_t c0, int64_t c1) {
  int64_t c = c0;
  for (; c + kMaxTile * kLanes <= c1; c += kMaxTile * kLanes) update_tile<kMaxTile>(S, ld, dk, h, c);
  if (kMaxTile >= 4 && c + 4 * kLanes <= c1) update_tile<4>(S, ld, dk, h, c), c += 4 * kLanes;
  if (c + 2 * kLanes <= c1) update_tile<2>(S, ld, dk, h, c), c += 2 * kLanes;
  if (c + kLanes <= c1) update_tile<1>(S, ld, dk, h, c), c += kLanes;
  for (; c < c1; ++c) update_column(S, ld, dk, h, c);
}

// n values of x in float32 into out, times rsqrt(sum x^2 + 1e-6) * scale: the reference's l2norm, then q's scale.
template <typename T>
inline void load_normalised(const T* x, int64_t n, float scale, float* out) {
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = to_f(x[i]);
    total += out[i] * out[i];
  }
  const float factor = scale / std::sqrt(total + 1e-6f);
  for (int64_t i = 0; i < n; ++i) out[i] *= factor;
}

// Rows of q, k, v, out as [rows, heads, dim] with the last dim contiguous.
struct Rows3 {
  int64_t row, head;
  static Rows3 of(const torch::Tensor& t) { return {t.stride(0), t.stride(1)}; }
};

template <typename T>
void decode(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& g,
            const torch::Tensor& beta, torch::Tensor& ssm_state, const int32_t* slots, const bool* has_context,
            torch::Tensor& out) {
  const int64_t B = v.size(0), Hk = k.size(1), Hv = v.size(1), Dk = k.size(2), Dv = v.size(2);
  const int64_t ratio = Hv / Hk;
  const Rows3 sq = Rows3::of(q), sk = Rows3::of(k), sv = Rows3::of(v), so = Rows3::of(out);
  const T *qp = static_cast<const T*>(q.data_ptr()), *kp = static_cast<const T*>(k.data_ptr()),
          *vp = static_cast<const T*>(v.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  const int64_t gs = g.stride(0), bs = beta.stride(0);
  float* state = ssm_state.data_ptr<float>();
  const float scale = 1.f / std::sqrt(static_cast<float>(Dk));

  // Blocks of columns: enough work items for every thread (a decode step of few rows on many cores), each block
  // whole vectors wide.
  const int64_t threads = omp_get_max_threads(), vectors = std::max<int64_t>(1, Dv / kLanes);
  const int64_t want = (2 * threads + B * Hv - 1) / std::max<int64_t>(1, B * Hv);
  const int64_t blocks = std::min(vectors, std::max<int64_t>(1, want));
  const int64_t block_cols = (vectors + blocks - 1) / blocks * kLanes;
  const int64_t items = B * Hv * blocks;

#pragma omp parallel if (items > 1)
  {
    std::vector<float> buffer(2 * Dk + 2 * Dv);
    float *kn = buffer.data(), *qn = kn + Dk, *vf = qn + Dk, *of = vf + Dv;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = item / (Hv * blocks), h = item / blocks % Hv, block = item % blocks;
      const int64_t c0 = std::min(Dv, block * block_cols);
      const int64_t c1 = block == blocks - 1 ? Dv : std::min(Dv, c0 + block_cols);
      T* o_row = op + b * so.row + h * so.head;
      const int32_t slot = slots[b];
      if (slot < 0) {  // a padded row
        for (int64_t c = c0; c < c1; ++c) o_row[c] = static_cast<T>(0.f);
        continue;
      }
      const int64_t hk = h / ratio;
      load_normalised(kp + b * sk.row + hk * sk.head, Dk, 1.f, kn);
      load_normalised(qp + b * sq.row + hk * sq.head, Dk, scale, qn);
      const T* v_row = vp + b * sv.row + h * sv.head;
      for (int64_t c = c0; c < c1; ++c) vf[c] = to_f(v_row[c]);
      float kq = 0.f;
      for (int64_t i = 0; i < Dk; ++i) kq += kn[i] * qn[i];
      const Head head{kn, qn, vf, std::exp(gp[b * gs + h]), bp[b * bs + h], kq,
                      has_context == nullptr || has_context[b], of};
      update_columns(state + (slot * Hv + h) * Dk * Dv, Dv, Dk, head, c0, c1);
      for (int64_t c = c0; c < c1; ++c) o_row[c] = static_cast<T>(of[c]);
    }
  }
}

// Each row's slot (int32) and has-context flag (nullptr: every row has context), checked against B rows and
// `num_slots` slots.
struct Slots {
  torch::Tensor slots, has_context;
  const int32_t* ptr() const { return slots.data_ptr<int32_t>(); }
  const bool* context() const { return has_context.defined() ? has_context.data_ptr<bool>() : nullptr; }
};
Slots read_slots(const torch::Tensor& state_slots, const c10::optional<torch::Tensor>& has_context, int64_t B,
                 int64_t num_slots, const char* what) {
  Slots s;
  s.slots = state_slots.to(at::kInt).contiguous();
  TORCH_CHECK(s.slots.dim() == 1 && s.slots.size(0) == B, what, ": state_slots of ", B, " rows");
  const int32_t* p = s.slots.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(p[b] < num_slots, what, ": slot ", p[b], " of ", num_slots);
  if (has_context.has_value() && has_context->defined()) {
    s.has_context = has_context->to(at::kBool).contiguous();
    TORCH_CHECK(s.has_context.numel() == B, what, ": has_context of ", B, " rows");
  }
  return s;
}

// The conv's output for one row: y = silu(sum_j window[j] w[c, j]) per channel, window = the slot's K - 1 inputs
// and x; the slot keeps the window's last K - 1. In bfloat16 the sum is rounded (conv1d's output) before SiLU.
// A compile-time K (the models' 4) lets the compiler vectorize the channel loop over the interleaved state.
template <int K, typename T>
void conv_sums(const T* __restrict x, const T* __restrict weight, T* __restrict state, bool has_context, int64_t C,
               float* __restrict y) {
  if (has_context) {
    for (int64_t c = 0; c < C; ++c) {
      float sum = 0.f;
      for (int j = 0; j + 1 < K; ++j) sum += to_f(state[c * (K - 1) + j]) * to_f(weight[c * K + j]);
      y[c] = sum + to_f(x[c]) * to_f(weight[c * K + K - 1]);
      for (int j = 0; j + 2 < K; ++j) state[c * (K - 1) + j] = state[c * (K - 1) + j + 1];
      state[c * (K - 1) + K - 2] = x[c];
    }
  } else {
    for (int64_t c = 0; c < C; ++c) {
      y[c] = to_f(x[c]) * to_f(weight[c * K + K - 1]);
      for (int j = 0; j + 2 < K; ++j) state[c * (K - 1) + j] = static_cast<T>(0.f);
      state[c * (K - 1) + K - 2] = x[c];
    }
  }
}

template <typename T>
void conv_row(const T* x, const T* weight, T* state, bool has_context, int64_t C, int64_t K, float* y, T* out) {
  switch (K) {
    case 2: conv_sums<2>(x, weight, state, has_context, C, y); break;
    case 3: conv_sums<3>(x, weight, state, has_context, C, y); break;
    case 4: conv_sums<4>(x, weight, state, has_context, C, y); break;
    default:
      for (int64_t c = 0; c < C; ++c) {
        T* s = state + c * (K - 1);
        const T* w = weight + c * K;
        float sum = 0.f;
        for (int64_t j = 0; j + 1 < K; ++j) sum += has_context ? to_f(s[j]) * to_f(w[j]) : 0.f;
        y[c] = sum + to_f(x[c]) * to_f(w[K - 1]);
        for (int64_t j = 0; j + 2 < K; ++j) s[j] = has_context ? s[j + 1] : static_cast<T>(0.f);
        s[K - 2] = x[c];
      }
  }
  int64_t c = 0;
#ifdef NANOINFER_AVX2
  const __m256 one = _mm256_set1_ps(1.f);
  for (; c + 8 <= C; c += 8) {
    __m256 v = _mm256_loadu_ps(y + c);
    if constexpr (!std::is_same<T, float>::value) v = rnd8(v);
    _mm256_storeu_ps(y + c, _mm256_div_ps(v, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), v)))));
  }
#endif
  for (; c < C; ++c) {
    const float v = std::is_same<T, float>::value ? y[c] : rnd(y[c]);
    y[c] = v / (1.f + std::exp(-v));
  }
  for (c = 0; c < C; ++c) out[c] = static_cast<T>(y[c]);
}

}  // namespace

void gated_delta_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                        torch::Tensor ssm_state, torch::Tensor state_slots, torch::Tensor out,
                        const c10::optional<torch::Tensor>& has_context) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "gated_delta_decode: q, k [B, H_k, D_k] and v [B, H_v, D_v]");
  TORCH_CHECK(v.size(1) % k.size(1) == 0, "gated_delta_decode: H_v a multiple of H_k");
  TORCH_CHECK(q.scalar_type() == v.scalar_type() && k.scalar_type() == v.scalar_type() &&
                  out.scalar_type() == v.scalar_type(),
              "gated_delta_decode: q, k, v and out of one dtype");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1,
              "gated_delta_decode: the last dim of q, k, v, out contiguous");
  TORCH_CHECK(out.sizes() == v.sizes(), "gated_delta_decode: out shaped as v");
  const int64_t B = v.size(0), Hv = v.size(1);
  TORCH_CHECK(ssm_state.scalar_type() == at::kFloat && ssm_state.is_contiguous() && ssm_state.dim() == 4 &&
                  ssm_state.size(1) == Hv && ssm_state.size(2) == k.size(2) && ssm_state.size(3) == v.size(2),
              "gated_delta_decode: ssm_state contiguous float32 [S, H_v, D_k, D_v]");
  TORCH_CHECK(g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat && g.dim() == 2 &&
                  beta.dim() == 2 && g.size(0) == B && g.size(1) == Hv && beta.size(0) == B && beta.size(1) == Hv &&
                  g.stride(1) == 1 && beta.stride(1) == 1,
              "gated_delta_decode: g and beta float32 [B, H_v]");
  const Slots slots = read_slots(state_slots, has_context, B, ssm_state.size(0), "gated_delta_decode");
  if (B == 0) return;
  with_typed<false>(v, "gated_delta_decode", [&](auto* typed) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(typed)>>;
    decode<T>(q, k, v, g, beta, ssm_state, slots.ptr(), slots.context(), out);
  });
}

void causal_conv1d_update(torch::Tensor x, torch::Tensor weight, torch::Tensor conv_state, torch::Tensor state_slots,
                          torch::Tensor out, const c10::optional<torch::Tensor>& has_context) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(0) == x.size(1) && x.stride(1) == 1 &&
                  weight.is_contiguous(),
              "causal_conv1d_update: x [B, C] (rows contiguous), weight contiguous [C, K]");
  const int64_t B = x.size(0), C = x.size(1), K = weight.size(1);
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.is_contiguous() && conv_state.size(1) == C &&
                  K >= 2 && conv_state.size(2) == K - 1,
              "causal_conv1d_update: conv_state contiguous [S, C, K - 1]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && conv_state.scalar_type() == x.scalar_type() &&
                  out.scalar_type() == x.scalar_type() && out.sizes() == x.sizes() && out.stride(1) == 1,
              "causal_conv1d_update: x, weight, conv_state and out of one dtype, out shaped as x");
  const Slots slots = read_slots(state_slots, has_context, B, conv_state.size(0), "causal_conv1d_update");
  const int32_t* slot = slots.ptr();
  const bool* context = slots.context();
  if (B == 0) return;
  with_typed<false>(x, "causal_conv1d_update", [&](auto* xp) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(xp)>>;
    const T* w = weight.data_ptr<T>();
    T* states = conv_state.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    // Blocks of channels a work item: a few rows still spread over the threads.
    constexpr int64_t kBlock = 1024;
    const int64_t blocks = (C + kBlock - 1) / kBlock, items = B * blocks;
#pragma omp parallel if (B * C >= 4 * kBlock)
    {
      std::vector<float> y(std::min(C, kBlock));
#pragma omp for schedule(static)
      for (int64_t item = 0; item < items; ++item) {
        const int64_t b = item / blocks, c0 = item % blocks * kBlock, n = std::min(kBlock, C - c0);
        T* o = op + b * os + c0;
        if (slot[b] < 0) {
          for (int64_t c = 0; c < n; ++c) o[c] = static_cast<T>(0.f);
          continue;
        }
        conv_row(xp + b * xs + c0, w + c0 * K, states + (slot[b] * C + c0) * (K - 1),
                 context == nullptr || context[b], n, K, y.data(), o);
      }
    }
  });
}
