// Linear attention's two state-carrying ops (Gated DeltaNet: Qwen3-Next, Qwen3.5): a decode step's kernels (one
// token per sequence) and a prompt step's (several rows per sequence); attention/gated_delta.py holds the
// reference versions and the state cache's layout.
//
// gated_delta_decode. Per value head, with q and k L2-normalised (q scaled by D_k^-0.5) and a = exp(g):
//     S' = a S + k delta^T,  delta = beta (v - a S^T k),  o = S'^T q = a S^T q + (k.q) delta
// so one pass over S [D_k, D_v] accumulates S^T k and S^T q, and a second writes S'. The state is what a step
// moves (D_k D_v float32 a head, read and written back); the vectors are small. Every column of S is independent
// of the others (S^T k's column j needs only column j of S), so a work item is (row, value head, block of
// columns) and both passes run over the block: its second read comes from the core's cache. Columns go in tiles
// of up to 8 vectors, whose two running sums stay in registers while the pass walks the rows.
//
// gated_delta_prefill. The same step token after token over each sequence's rows (the recurrent form; the
// reference's chunked form agrees to rounding). A work item is (sequence, value head, tile of 32 columns; 8
// without SIMD): it copies its tile of the state into a contiguous buffer (in L1) once, runs every token on it,
// one pass a token (writing a S + k delta^T and, in the same pass, accumulating the next token's S^T k and
// S^T q), and writes it back once. Each token's norms are found once per step for every key head; the items,
// longest sequences first, are handed out one at a time (a step's prompts differ in length a hundredfold). A
// one-token sequence gets the decode kernel's bits.
//
// causal_conv1d_update. Per channel, the K - 1 inputs kept in the slot and the new one, times the channel's K
// weights, summed in float32 and through SiLU (in bfloat16 rounded where the reference's conv1d and silu round);
// the slot then keeps the last K - 1 inputs. causal_conv1d_prefill: the same over each sequence's rows, a work item
// (sequence, block of 512 channels) keeping the last K inputs in a float32 ring in L1.
//
// All read each sequence's slot (a negative slot: a padded row, whose output is zeros and which touches no slot)
// and, where `has_context` says a sequence has none (a prompt's first chunk), start from zeros instead of the slot.
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

// Sum of the lanes of x.
#if defined(NANOINFER_AVX512)
inline float vsum(V x) { return _mm512_reduce_add_ps(x); }
#elif defined(NANOINFER_AVX2)
inline float vsum(V x) { return hsum(x); }
#else
inline float vsum(V x) { return x; }
#endif

// x.y over n floats: kLanes running sums, then their total (a single chain of n adds would be latency-bound).
inline float dot(const float* x, const float* y, int64_t n) {
  V acc = vset(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = vfma(vload(x + i), vload(y + i), acc);
  float total = vsum(acc);
  for (; i < n; ++i) total += x[i] * y[i];
  return total;
}

// n values of x in float32 into out, times rsqrt(sum x^2 + 1e-6) * scale: the reference's l2norm, then q's scale.
// The decode and prefill kernels share it: a one-token sequence gets the same bits from either.
// norm_factor leaves x in float32 in out and returns the factor; load_scaled multiplies x by a factor found before.
template <typename T>
inline float norm_factor(const T* x, int64_t n, float scale, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_f(x[i]);
  return scale / std::sqrt(dot(out, out, n) + 1e-6f);
}
template <typename T>
inline void load_scaled(const T* x, int64_t n, float factor, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_f(x[i]) * factor;
}
template <typename T>
inline void load_normalised(const T* x, int64_t n, float scale, float* out) {
  const float factor = norm_factor(x, n, scale, out);
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
      const Head head{kn, qn, vf, std::exp(gp[b * gs + h]), bp[b * bs + h], dot(kn, qn, Dk),
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

// out = silu(y) over C channels, y rounded to T first (bfloat16: conv1d's output) and the result rounded to T.
template <typename T>
void silu_store(float* y, int64_t C, T* out) {
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
  silu_store(y, C, out);
}


// ---- Prompt chunks: several rows a sequence (gated_delta_prefill, causal_conv1d_prefill).

// The lanes of a prefill tile: whole vectors, or single floats (the columns past the last whole vector).
struct WideLanes {
  using W = V;
  static constexpr int lanes = kLanes;
  static W load(const float* p) { return vload(p); }
  static void store(float* p, W x) { vstore(p, x); }
  static W set(float x) { return vset(x); }
  static W mul(W a, W b) { return vmul(a, b); }
  static W sub(W a, W b) { return vsub(a, b); }
  static W fma(W a, W b, W c) { return vfma(a, b, c); }
};
struct OneLane {
  using W = float;
  static constexpr int lanes = 1;
  static W load(const float* p) { return *p; }
  static void store(float* p, W x) { *p = x; }
  static W set(float x) { return x; }
  static W mul(W a, W b) { return a * b; }
  static W sub(W a, W b) { return a - b; }
  static W fma(W a, W b, W c) { return a * b + c; }
};

// Vectors of columns a prefill tile spans: its copy of the state, D_k x 32 columns of float32 (16 KiB at D_k = 128),
// stays in L1 (32 KiB or more) for the whole sequence beside the rows of q, k, v streaming through. On a Zen 5
// core (48 KiB L1), 64 columns ran at most 5% faster; 32 leave room on a 32 KiB L1.
#if defined(NANOINFER_AVX512)
constexpr int kPrefillVecs = 2;
#elif defined(NANOINFER_AVX2)
constexpr int kPrefillVecs = 4;
#else
constexpr int kPrefillVecs = 8;
#endif

// Tokens ahead that a prefill work item asks for its rows of q, k, v and out.
constexpr int64_t kPrefillAhead = 4;

inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b);
}

// One sequence's rows at one value head (q and k at its key head): row 0's pointers and the strides between rows.
template <typename T>
struct SeqHead {
  const T *q, *k, *v;
  int64_t q_row, k_row, v_row;
  const float *g, *beta;
  int64_t g_row, beta_row;
  T* o;
  int64_t o_row;
  const float* norms;  // per row: the factors normalising k and q (q's with its scale), and k.q normalised
  int64_t norms_row;
  int64_t n;
  bool has_context;
};

// One token's pass over a tile's rows (S at its first column, rows `ld` floats apart): with READ, S = a S + k
// delta^T (without, the state entering is zeros and is not read: S = k delta^T, as the decode kernel writes it);
// with NEXT, the next token's sums S^T k' and S^T q' over the rows just written, so that each token reads and
// writes the tile once.
template <typename L, int N, bool READ, bool NEXT>
__attribute__((always_inline)) inline void prefill_rows(float* __restrict S, int64_t ld, int64_t dk,
                                                        const float* __restrict k, const typename L::W* delta,
                                                        typename L::W decay, const float* __restrict k_next,
                                                        const float* __restrict q_next, typename L::W* sk,
                                                        typename L::W* sq) {
  using W = typename L::W;
  for (int j = 0; j < N; ++j) sk[j] = sq[j] = L::set(0.f);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * ld;
    const W ki = L::set(k[i]);
    W kn = ki, qn = ki;
    if constexpr (NEXT) kn = L::set(k_next[i]), qn = L::set(q_next[i]);
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) {
      W s;
      if constexpr (READ) s = L::fma(ki, delta[j], L::mul(decay, L::load(row + j * L::lanes)));
      else s = L::mul(ki, delta[j]);
      L::store(row + j * L::lanes, s);
      if constexpr (NEXT) {
        sk[j] = L::fma(kn, s, sk[j]);
        sq[j] = L::fma(qn, s, sq[j]);
      }
    }
  }
}

// The recurrent rule over one sequence's rows for the N lane groups of columns from c of one value head's state S
// (D_k x ld floats): the decode kernel's step row after row (its sums S^T k, S^T q, delta and output, the same
// operations in the same order), each token's sums taken in the pass that writes the previous token's update.
// buf: 4 D_k floats (this and the next token's normalised k and q, from the step's norms: the same bits as
// load_normalised and dot give).
template <typename L, int N, typename T>
void prefill_tile(float* head, int64_t ld, int64_t dk, const SeqHead<T>& s, int64_t c, float* buf, float* tile) {
  using W = typename L::W;
  constexpr int kCols = N * L::lanes;
  float *k0 = buf, *q0 = buf + dk, *k1 = buf + 2 * dk, *q1 = buf + 3 * dk;
  // The tile is copied in once and back once: in place its rows would lie ld floats apart, a power of two that
  // maps them onto a fraction of L1's sets (evicting one another), while the copy's D_k x kCols floats lie
  // together.
  float* const S = tile;
  if (s.has_context)
    for (int64_t i = 0; i < dk; ++i) std::memcpy(S + i * kCols, head + i * ld + c, kCols * sizeof(float));
  float vf[kCols], of[kCols];
  W sk[N], sq[N], delta[N];
  load_scaled(s.k, dk, s.norms[0], k0);
  load_scaled(s.q, dk, s.norms[1], q0);
  float kq = s.norms[2];
  for (int j = 0; j < N; ++j) sk[j] = sq[j] = L::set(0.f);
  if (s.has_context) {
    for (int64_t i = 0; i < dk; ++i) {
      const float* row = S + i * kCols;
      const W ki = L::set(k0[i]), qi = L::set(q0[i]);
#pragma GCC unroll 8
      for (int j = 0; j < N; ++j) {
        const W x = L::load(row + j * L::lanes);
        sk[j] = L::fma(ki, x, sk[j]);
        sq[j] = L::fma(qi, x, sq[j]);
      }
    }
  }
  for (int64_t t = 0; t < s.n; ++t) {
    if (t + kPrefillAhead < s.n) {  // rows lie a page or more apart: the hardware's prefetchers would not follow
      const int64_t a = t + kPrefillAhead;
      prefetch_lines(s.k + a * s.k_row, dk * sizeof(T));
      prefetch_lines(s.q + a * s.q_row, dk * sizeof(T));
      prefetch_lines(s.v + a * s.v_row + c, kCols * sizeof(T));
      prefetch_lines(s.o + a * s.o_row + c, kCols * sizeof(T));
    }
    const W decay = L::set(std::exp(s.g[t * s.g_row])), beta = L::set(s.beta[t * s.beta_row]), kqv = L::set(kq);
    const T* v = s.v + t * s.v_row + c;
    for (int j = 0; j < kCols; ++j) vf[j] = to_f(v[j]);
    for (int j = 0; j < N; ++j) {
      delta[j] = L::mul(beta, L::sub(L::load(vf + j * L::lanes), L::mul(decay, sk[j])));
      L::store(of + j * L::lanes, L::fma(kqv, delta[j], L::mul(decay, sq[j])));
    }
    T* o = s.o + t * s.o_row + c;
    for (int j = 0; j < kCols; ++j) o[j] = static_cast<T>(of[j]);
    const bool read = t > 0 || s.has_context;
    if (t + 1 < s.n) {
      const float* norms = s.norms + (t + 1) * s.norms_row;
      load_scaled(s.k + (t + 1) * s.k_row, dk, norms[0], k1);
      load_scaled(s.q + (t + 1) * s.q_row, dk, norms[1], q1);
      kq = norms[2];
      if (read) prefill_rows<L, N, true, true>(S, kCols, dk, k0, delta, decay, k1, q1, sk, sq);
      else prefill_rows<L, N, false, true>(S, kCols, dk, k0, delta, decay, k1, q1, sk, sq);
      std::swap(k0, k1);
      std::swap(q0, q1);
    } else if (read) {
      prefill_rows<L, N, true, false>(S, kCols, dk, k0, delta, decay, nullptr, nullptr, sk, sq);
    } else {
      prefill_rows<L, N, false, false>(S, kCols, dk, k0, delta, decay, nullptr, nullptr, sk, sq);
    }
  }
  for (int64_t i = 0; i < dk; ++i) std::memcpy(head + i * ld + c, S + i * kCols, kCols * sizeof(float));
}

template <typename T>
using TileFn = void (*)(float*, int64_t, int64_t, const SeqHead<T>&, int64_t, float*, float*);
template <typename T>
struct Tile {
  int64_t c0, c1;
  TileFn<T> run;
};

template <typename L, typename T>
TileFn<T> tile_fn(int n) {
  switch (n) {
    case 8: return &prefill_tile<L, 8, T>;
    case 4: return &prefill_tile<L, 4, T>;
    case 2: return &prefill_tile<L, 2, T>;
    default: return &prefill_tile<L, 1, T>;
  }
}

// A head's D_v columns as tiles of `vecs` vectors (a power of two), the rest in halves, then single-float lanes.
template <typename T>
std::vector<Tile<T>> prefill_tiles(int64_t Dv, int vecs) {
  std::vector<Tile<T>> tiles;
  int64_t c = 0;
  for (; c + vecs * kLanes <= Dv; c += vecs * kLanes)
    tiles.push_back({c, c + vecs * kLanes, tile_fn<WideLanes, T>(vecs)});
  for (int n = vecs / 2; n >= 1; n /= 2)
    if (c + n * kLanes <= Dv) tiles.push_back({c, c + n * kLanes, tile_fn<WideLanes, T>(n)}), c += n * kLanes;
  for (int n = 8; n >= 1; n /= 2)
    while (c + n <= Dv) tiles.push_back({c, c + n, tile_fn<OneLane, T>(n)}), c += n;
  return tiles;
}

template <typename T>
void prefill(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& g,
             const torch::Tensor& beta, torch::Tensor& ssm_state, const int32_t* slots, const bool* has_context,
             const int64_t* starts, int64_t B, torch::Tensor& out) {
  const int64_t Hk = k.size(1), Hv = v.size(1), Dk = k.size(2), Dv = v.size(2), ratio = Hv / Hk;
  const Rows3 sq = Rows3::of(q), sk = Rows3::of(k), sv = Rows3::of(v), so = Rows3::of(out);
  const T *qp = static_cast<const T*>(q.data_ptr()), *kp = static_cast<const T*>(k.data_ptr()),
          *vp = static_cast<const T*>(v.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* state = ssm_state.data_ptr<float>();
  const float scale = 1.f / std::sqrt(static_cast<float>(Dk));

  // Work items (sequence, value head, tile), the longest sequences first and handed out one at a time: lengths
  // differ by a hundredfold in a step. Narrower tiles where there are too few items for the threads.
  const int64_t threads = omp_get_max_threads();
  int vecs = kPrefillVecs;
  while (vecs > 1 && B * Hv * ((Dv + vecs * kLanes - 1) / (vecs * kLanes)) < 2 * threads) vecs /= 2;
  const std::vector<Tile<T>> tiles = prefill_tiles<T>(Dv, vecs);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size()), items = B * Hv * num_tiles;
  std::vector<int64_t> order(B);
  for (int64_t b = 0; b < B; ++b) order[b] = b;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return starts[a + 1] - starts[a] > starts[b + 1] - starts[b]; });

  // Each row's norms at each key head, found once for the step (the items, H_v / H_k heads and a head's tiles
  // each, repeat only the multiplications).
  const int64_t T_rows = v.size(0);
  std::vector<float> norms(T_rows * Hk * 3);

#pragma omp parallel if (items > 1)
  {
    // 4 D_k floats for the normalised vectors, then the state tile, on a 64-byte line.
    std::vector<float> buffer(4 * Dk + Dk * kPrefillVecs * kLanes + 16);
    float* tile_buffer = buffer.data() + 4 * Dk;
    tile_buffer += (64 - reinterpret_cast<uintptr_t>(tile_buffer) % 64) % 64 / sizeof(float);
#pragma omp for schedule(static)
    for (int64_t row = 0; row < T_rows * Hk; ++row) {
      const int64_t t = row / Hk, hk = row % Hk;
      float *kn = buffer.data(), *qn = kn + Dk, *found = norms.data() + row * 3;
      found[0] = norm_factor(kp + t * sk.row + hk * sk.head, Dk, 1.f, kn);
      found[1] = norm_factor(qp + t * sq.row + hk * sq.head, Dk, scale, qn);
      for (int64_t i = 0; i < Dk; ++i) kn[i] *= found[0], qn[i] *= found[1];
      found[2] = dot(kn, qn, Dk);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = order[item / (Hv * num_tiles)], h = item / num_tiles % Hv;
      const Tile<T>& tile = tiles[item % num_tiles];
      const int64_t t0 = starts[b], n = starts[b + 1] - t0;
      if (n == 0) continue;
      const int32_t slot = slots[b];
      if (slot < 0) {  // a padded sequence
        for (int64_t t = t0; t < t0 + n; ++t)
          for (int64_t c = tile.c0; c < tile.c1; ++c) op[t * so.row + h * so.head + c] = static_cast<T>(0.f);
        continue;
      }
      const int64_t hk = h / ratio;
      const SeqHead<T> seq{qp + t0 * sq.row + hk * sq.head, kp + t0 * sk.row + hk * sk.head,
                           vp + t0 * sv.row + h * sv.head, sq.row, sk.row, sv.row,
                           gp + t0 * g.stride(0) + h, bp + t0 * beta.stride(0) + h, g.stride(0), beta.stride(0),
                           op + t0 * so.row + h * so.head, so.row, norms.data() + (t0 * Hk + hk) * 3, Hk * 3, n,
                           has_context == nullptr || has_context[b]};
      tile.run(state + (slot * Hv + h) * Dk * Dv, Dv, Dk, seq, tile.c0, buffer.data(), tile_buffer);
    }
  }
}

// Channels a conv work item takes: its window (K rows) and weights (K) in float32 stay in L1.
constexpr int64_t kConvBlock = 512;
constexpr int64_t kConvAhead = 4;  // rows ahead that a conv work item prefetches its inputs

// Row t of the conv (its input xt, into `in`: the ring's row for input t) in whole vectors of channels from 0:
// the decode kernel's steps (the sum over the taps in order, rounded to T, silu through exp8's bits, rounded to
// T). Returns the channels done (none without SIMD).
template <typename T>
int64_t conv_vectors(const T* xt, const float* w, int64_t K, const float* ring, int64_t t, float* in, int64_t nc,
                     T* ot) {
  int64_t c = 0;
#ifdef NANOINFER_AVX2
  constexpr bool kRound = !std::is_same<T, float>::value;
  if (K > 16) return 0;
  const float* taps[16];  // the ring's rows in tap order
  for (int64_t j = 0; j < K; ++j) taps[j] = ring + (t + j) % K * nc;
#ifdef NANOINFER_AVX512
  const __m512 one16 = _mm512_set1_ps(1.f);
  for (; c + 16 <= nc; c += 16) {
    _mm512_storeu_ps(in + c, load16(xt + c));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < K; ++j)
      sum = _mm512_fmadd_ps(_mm512_loadu_ps(taps[j] + c), _mm512_loadu_ps(w + j * nc + c), sum);
    if constexpr (kRound) sum = rnd16(sum);
    const __m512 silu = _mm512_div_ps(sum, _mm512_add_ps(one16, exp16(_mm512_sub_ps(_mm512_setzero_ps(), sum))));
    if constexpr (kRound) store16(reinterpret_cast<bf16*>(ot + c), rnd16(silu));
    else _mm512_storeu_ps(reinterpret_cast<float*>(ot + c), silu);
  }
#endif
  const __m256 one = _mm256_set1_ps(1.f);
  for (; c + 8 <= nc; c += 8) {
    _mm256_storeu_ps(in + c, load8(xt + c));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < K; ++j)
      sum = _mm256_fmadd_ps(_mm256_loadu_ps(taps[j] + c), _mm256_loadu_ps(w + j * nc + c), sum);
    if constexpr (kRound) sum = rnd8(sum);
    const __m256 silu = _mm256_div_ps(sum, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), sum))));
    if constexpr (kRound) store8(reinterpret_cast<bf16*>(ot + c), rnd8(silu));
    else _mm256_storeu_ps(reinterpret_cast<float*>(ot + c), silu);
  }
#else
  (void)xt, (void)w, (void)K, (void)ring, (void)t, (void)in, (void)nc, (void)ot;
#endif
  return c;
}

// The conv over one sequence's n rows for nc channels (x, weight, state and out at the block's first channel):
// the K - 1 inputs before row 0 from the slot (zeros without context), each row's sum over the K inputs ending at
// it in float32 (the decode kernel's order), silu_store; the slot then keeps the last K - 1 inputs. buf: the
// last K inputs as float32 rows (a ring: input p at row (p + K - 1) % K), the weights by tap, the sums.
template <typename T>
void conv_prefill_block(const T* x, int64_t xs, const T* weight, int64_t K, T* state, bool has_context, int64_t n,
                        int64_t nc, T* out, int64_t os, float* buf) {
  float *ring = buf, *w = buf + K * nc, *y = buf + 2 * K * nc;
  for (int64_t c = 0; c < nc; ++c)
    for (int64_t j = 0; j < K; ++j) w[j * nc + c] = to_f(weight[c * K + j]);
  for (int64_t j = 0; j + 1 < K; ++j)
    for (int64_t c = 0; c < nc; ++c) ring[j * nc + c] = has_context ? to_f(state[c * (K - 1) + j]) : 0.f;
  for (int64_t t = 0; t < n; ++t) {
    float* in = ring + (t + K - 1) % K * nc;
    const T* xt = x + t * xs;
    T* ot = out + t * os;
    // Rows lie C channels apart, a page or more: each row's lines are asked for a few rows ahead, where the
    // hardware's prefetchers (which stay within a page) would leave each row's first lines to memory latency.
    if (t + kConvAhead < n) prefetch_lines(xt + kConvAhead * xs, nc * sizeof(T));
    const int64_t c = conv_vectors(xt, w, K, ring, t, in, nc, ot);
    if (c < nc) {  // the channels past the last whole vector (all of them without SIMD)
      for (int64_t i = c; i < nc; ++i) in[i] = to_f(xt[i]), y[i] = 0.f;
      for (int64_t j = 0; j < K; ++j) {
        const float *r = ring + (t + j) % K * nc, *wj = w + j * nc;
        for (int64_t i = c; i < nc; ++i) y[i] += r[i] * wj[i];
      }
      silu_store(y + c, nc - c, ot + c);
    }
  }
  for (int64_t j = 0; j + 1 < K; ++j) {
    const float* r = ring + (n + j) % K * nc;  // input n - (K - 1) + j
    for (int64_t c = 0; c < nc; ++c) state[c * (K - 1) + j] = static_cast<T>(r[c]);
  }
}

}  // namespace

namespace {

// The rule's tensors as both kernels take them (T rows: a decode step's rows, or a step's tokens).
void check_rule(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& g,
                const torch::Tensor& beta, const torch::Tensor& ssm_state, const torch::Tensor& out, const char* what) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0), what,
              ": q, k [T, H_k, D_k] and v [T, H_v, D_v]");
  TORCH_CHECK(k.size(1) > 0 && v.size(1) % k.size(1) == 0, what, ": H_v a multiple of H_k");
  TORCH_CHECK(q.scalar_type() == v.scalar_type() && k.scalar_type() == v.scalar_type() &&
                  out.scalar_type() == v.scalar_type(),
              what, ": q, k, v and out of one dtype");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1, what,
              ": the last dim of q, k, v, out contiguous");
  TORCH_CHECK(out.sizes() == v.sizes(), what, ": out shaped as v");
  const int64_t T = v.size(0), Hv = v.size(1);
  TORCH_CHECK(ssm_state.scalar_type() == at::kFloat && ssm_state.is_contiguous() && ssm_state.dim() == 4 &&
                  ssm_state.size(1) == Hv && ssm_state.size(2) == k.size(2) && ssm_state.size(3) == v.size(2),
              what, ": ssm_state contiguous float32 [S, H_v, D_k, D_v]");
  TORCH_CHECK(g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat && g.dim() == 2 &&
                  beta.dim() == 2 && g.size(0) == T && g.size(1) == Hv && beta.size(0) == T && beta.size(1) == Hv &&
                  g.stride(1) == 1 && beta.stride(1) == 1,
              what, ": g and beta float32 [T, H_v]");
}

// The conv's tensors as both kernels take them.
void check_conv(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& conv_state,
                const torch::Tensor& out, const char* what) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(0) == x.size(1) && x.stride(1) == 1 &&
                  weight.is_contiguous(),
              what, ": x [T, C] (rows contiguous), weight contiguous [C, K]");
  const int64_t C = x.size(1), K = weight.size(1);
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.is_contiguous() && conv_state.size(1) == C && K >= 2 &&
                  conv_state.size(2) == K - 1,
              what, ": conv_state contiguous [S, C, K - 1]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && conv_state.scalar_type() == x.scalar_type() &&
                  out.scalar_type() == x.scalar_type() && out.sizes() == x.sizes() && out.stride(1) == 1,
              what, ": x, weight, conv_state and out of one dtype, out shaped as x");
}

// query_start_loc as int64 [B + 1]: 0, then each sequence's end, non-decreasing, the last at T.
torch::Tensor read_starts(const torch::Tensor& query_start_loc, int64_t B, int64_t T, const char* what) {
  torch::Tensor starts = query_start_loc.to(at::kLong).contiguous();
  TORCH_CHECK(starts.dim() == 1 && starts.size(0) == B + 1, what, ": query_start_loc of ", B + 1, " values");
  const int64_t* p = starts.data_ptr<int64_t>();
  TORCH_CHECK(p[0] == 0 && p[B] == T, what, ": query_start_loc from 0 to ", T);
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(p[b] <= p[b + 1], what, ": query_start_loc non-decreasing");
  return starts;
}

}  // namespace

void gated_delta_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                        torch::Tensor ssm_state, torch::Tensor state_slots, torch::Tensor out,
                        const c10::optional<torch::Tensor>& has_context) {
  check_rule(q, k, v, g, beta, ssm_state, out, "gated_delta_decode");
  const int64_t B = v.size(0);
  const Slots slots = read_slots(state_slots, has_context, B, ssm_state.size(0), "gated_delta_decode");
  if (B == 0) return;
  with_typed<false>(v, "gated_delta_decode", [&](auto* typed) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(typed)>>;
    decode<T>(q, k, v, g, beta, ssm_state, slots.ptr(), slots.context(), out);
  });
}

void gated_delta_prefill(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                         torch::Tensor ssm_state, torch::Tensor state_slots, torch::Tensor query_start_loc,
                         torch::Tensor out, const c10::optional<torch::Tensor>& has_context) {
  check_rule(q, k, v, g, beta, ssm_state, out, "gated_delta_prefill");
  const int64_t B = state_slots.numel();
  const torch::Tensor starts = read_starts(query_start_loc, B, v.size(0), "gated_delta_prefill");
  const Slots slots = read_slots(state_slots, has_context, B, ssm_state.size(0), "gated_delta_prefill");
  if (B == 0 || v.size(0) == 0) return;
  with_typed<false>(v, "gated_delta_prefill", [&](auto* typed) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(typed)>>;
    prefill<T>(q, k, v, g, beta, ssm_state, slots.ptr(), slots.context(), starts.data_ptr<int64_t>(), B, out);
  });
}

void causal_conv1d_update(torch::Tensor x, torch::Tensor weight, torch::Tensor conv_state, torch::Tensor state_slots,
                          torch::Tensor out, const c10::optional<torch::Tensor>& has_context) {
  check_conv(x, weight, conv_state, out, "causal_conv1d_update");
  const int64_t B = x.size(0), C = x.size(1), K = weight.size(1);
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

void causal_conv1d_prefill(torch::Tensor x, torch::Tensor weight, torch::Tensor conv_state, torch::Tensor state_slots,
                           torch::Tensor query_start_loc, torch::Tensor out,
                           const c10::optional<torch::Tensor>& has_context) {
  check_conv(x, weight, conv_state, out, "causal_conv1d_prefill");
  const int64_t B = state_slots.numel(), C = x.size(1), K = weight.size(1);
  const torch::Tensor starts_t = read_starts(query_start_loc, B, x.size(0), "causal_conv1d_prefill");
  const Slots slots = read_slots(state_slots, has_context, B, conv_state.size(0), "causal_conv1d_prefill");
  const int32_t* slot = slots.ptr();
  const bool* context = slots.context();
  const int64_t* starts = starts_t.data_ptr<int64_t>();
  if (B == 0 || x.size(0) == 0) return;
  with_typed<false>(x, "causal_conv1d_prefill", [&](auto* xp) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(xp)>>;
    const T* w = weight.data_ptr<T>();
    T* states = conv_state.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    // Work items (sequence, block of channels), the longest sequences first, handed out one at a time.
    const int64_t blocks = (C + kConvBlock - 1) / kConvBlock, items = B * blocks;
    std::vector<int64_t> order(B);
    for (int64_t b = 0; b < B; ++b) order[b] = b;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return starts[a + 1] - starts[a] > starts[b + 1] - starts[b]; });
#pragma omp parallel if (items > 1 && x.size(0) * C >= 4 * kConvBlock)
    {
      std::vector<float> buf((2 * K + 1) * std::min(C, kConvBlock));
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < items; ++item) {
        const int64_t b = order[item / blocks], c0 = item % blocks * kConvBlock, nc = std::min(kConvBlock, C - c0);
        const int64_t t0 = starts[b], n = starts[b + 1] - t0;
        T* o = op + t0 * os + c0;
        if (slot[b] < 0) {  // a padded sequence
          for (int64_t t = 0; t < n; ++t)
            for (int64_t c = 0; c < nc; ++c) o[t * os + c] = static_cast<T>(0.f);
          continue;
        }
        if (n == 0) continue;
        conv_prefill_block(xp + t0 * xs + c0, xs, w + c0 * K, K, states + (slot[b] * C + c0) * (K - 1),
                           context == nullptr || context[b], n, nc, o, os, buf.data());
      }
    }
  });
}
