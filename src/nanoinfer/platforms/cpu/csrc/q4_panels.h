// A float32 weight kept as 4-bit blocks when every value of it is exactly one: the layout, and the expansion
// back to float32 panel rows (csrc/gemm.cpp's layout) that the panel GEMM runs on (AVX-512 builds).
//
// Why: a decode step of a few dozen rows is bound by streaming every weight from DRAM once (424 MB a step for
// SmolLM2-135M in float32), not by its FMAs. A model dequantized from a GGUF Q4_1
// file (nanoinfer's built-in default is one) holds float32 values that are each d * q + m, with d and m
// float16 per 32 consecutive inputs of an output and q in 0..15: 5 bits carry each value exactly. Stored so,
// a step reads ~1/6 of the bytes and expands the weights into float32 (in registers, or a chunk at a time into
// L1) just before the register tiles multiply them; the tiles multiply the very same float32 values in the same
// order, so the output is the float32 GEMM's, bit for bit. A weight with any value that is not exactly such a
// block value keeps its float32 form only (pack_q4_panels returns an empty tensor). The float32 panels stay too:
// steps of many rows are bound by the FMAs, and run on them (csrc/gemm.cpp, kQ4MaxRows).
//
// Layout, for the 16 columns of one panel (pack_linear_weight's or pack_gated_weight's columns): K / 32 blocks
// of kQ4BlockBytes, each 16 float16 scales d, 16 float16 offsets m (one per column), then 16 pairs of k-steps:
// byte c of pair j holds column c's q at k = 2j (low nibble) and at k = 2j + 1 (high nibble).
#pragma once
#include "simd.h"

#include <cstdint>

constexpr int64_t kQ4Group = 32;                                   // inputs per scale and offset
constexpr int64_t kQ4HeaderBytes = 2 * 16 * 2;                     // 16 float16 d, then 16 float16 m
constexpr int64_t kQ4BlockBytes = kQ4HeaderBytes + kQ4Group * 16 / 2;  // + 32 k-steps of 16 nibbles: 320
static inline int64_t q4_panel_bytes(int64_t K) { return K / kQ4Group * kQ4BlockBytes; }

#if defined(NANOINFER_AVX512)
// `blocks` consecutive 4-bit blocks of one panel (at src) -> float32 panel rows [blocks * 32][16] at dst (64-byte
// aligned), each value fma(q, d, m): q * d is exact (11 by 4 significant bits), so this is d * q + m rounded
// once, as the GGUF dequantizer computes it. `next` (or null): next_bytes of 4-bit weights read soon after these,
// asked into L2 a share a block, so the panels after these do not wait on DRAM.
static inline void expand_q4_blocks(const uint8_t* __restrict src, int64_t blocks, float* __restrict dst,
                                    const uint8_t* next, int64_t next_bytes) {
  const int64_t lines = next ? (next_bytes + 63) / 64 : 0;
  const __m512i low = _mm512_set1_epi32(15);
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* blk = src + i * kQ4BlockBytes;
    float* out = dst + i * kQ4Group * 16;
    for (int64_t l = lines * i / blocks; l < lines * (i + 1) / blocks; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(next) + 64 * l, _MM_HINT_T1);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
    const uint8_t* q = blk + kQ4HeaderBytes;
    for (int j = 0; j < kQ4Group / 2; ++j) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * j)));
      _mm512_store_ps(out + (2 * j) * 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), d, m));
      _mm512_store_ps(out + (2 * j + 1) * 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d, m));
    }
  }
}
#endif
