// Attention of a few query rows (a decoding or verification step), one (head, row) at a time, AVX2.
//
// SDPA's CPU kernels multiply a block of queries at once, so row i of a k-row call differs in the
// last bits from a one-row call; in bfloat16 that flips argmaxes at near-ties. Here every output
// row is computed by the same instruction sequence whatever the number of rows. For one (head,
// row): the keys its mask allows are listed in key order; their scores are computed 8 keys at a
// time (8-lane FMA over the head dimension, then one fixed transpose-and-add reduction that gives
// each key's sum in its own lane, times the scale); their maximum; exp(s - max) by a fixed
// polynomial, 8 keys at a time, and summed in a fixed order; the values accumulated in key order
// with those weights, divided by the sum; fp32 throughout (bfloat16 keys and values widen
// exactly). What a key's score, weight and contribution are depends only on its place in the
// row's list of allowed keys, so row i of a k-row call equals a one-row call over the same keys,
// and a tree node's row (ancestors scattered in the cache) equals the one-row call over those keys
// gathered in order.
//
// Two paths speed this up without giving up the property. Where the CPU has AVX-512 the value pass
// runs 16 dimensions a vector with every head of a row sharing each key's values: per dimension the
// same FMAs, so the same bits (weighted_values512). Where the process's bfloat16 products take a
// dot-product path (bf16_dot.h), bfloat16 scores are VDPBF16PS sums of the bfloat16 query and keys
// (dp_scores16): other bits than the widened scores, but the same for every row count, as the
// linears' products of that path are.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "avx2.h"
#include "bf16_dot.h"
#include "isa.h"

namespace {

using BF16 = at::BFloat16;

using selfspec_avx2::hsum;
using selfspec_avx2::load8;

// lane u = the sum of the 8 lanes of a[u], as ((0+1)+(2+3))+((4+5)+(6+7)) whatever the other vectors
inline __m256 reduce8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// e^x for x <= 0 (scores minus their maximum), 8 lanes: x = n ln2 + r, e^r by a degree-7 polynomial
// (Cephes' expf coefficients; relative error ~1e-7), times 2^n; below -87 the result is 0.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// acc[0..C) += p_j * v_j[d0, d0 + 8C) over the listed keys j in [j0, j1), in order; acc lives in
// `acc` between calls (C vectors of 8 lanes held in registers meanwhile; the fp32 round trip is exact)
template <int C, typename T>
inline void weighted_values(const float* p, const int64_t* idx, int64_t j0, int64_t j1, const T* vh, int64_t vs_l,
                            int64_t d0, float* acc_mem) {
  __m256 acc[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) acc[c] = _mm256_loadu_ps(acc_mem + d0 + 8 * c);
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 pv = _mm256_set1_ps(p[j]);
    const T* vj = vh + idx[j] * vs_l + d0;
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(pv, load8(vj + 8 * c), acc[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc_mem + d0 + 8 * c, acc[c]);
}

template <typename T>
inline void weighted_values_chunks(const float* p, const int64_t* idx, int64_t j0, int64_t j1, const T* vh,
                                   int64_t vs_l, int64_t D, float* acc_mem) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {  // chunks of up to 64 dimensions
    switch (std::min<int64_t>(8, (D - d0) / 8)) {
      case 8: weighted_values<8>(p, idx, j0, j1, vh, vs_l, d0, acc_mem); break;
      case 7: weighted_values<7>(p, idx, j0, j1, vh, vs_l, d0, acc_mem); break;
      case 6: weighted_values<6>(p, idx, j0, j1, vh, vs_l, d0, acc_mem); break;
      case 5: weighted_values<5>(p, idx, j0, j1, vh, vs_l, d0, acc_mem); break;
      case 4: weighted_values<4>(p, idx, j0, j1, vh, vs_l, d0, acc_mem); break;
      case 3: weighted_values<3>(p, idx, j0, j1, vh, vs_l, d0, acc_mem); break;
      case 2: weighted_values<2>(p, idx, j0, j1, vh, vs_l, d0, acc_mem); break;
      default: weighted_values<1>(p, idx, j0, j1, vh, vs_l, d0, acc_mem); break;
    }
  }
}

// The scores of bfloat16 queries and keys on AVX-512-BF16, where the process's bfloat16 path is a
// dot-product one (bf16_dot.h: the linears' path decides, so one process has one set of bits): for
// one (head, row), 16 listed keys at a time, each key's score accumulated by VDPBF16PS over 32
// dimensions per instruction in order (16 float32 lanes), then the 16 keys' lanes reduced in a fixed
// order (reduce16). What a key's score is depends only on q, the key and D: row-independent as the
// float32 scores above. The query is read as bfloat16, as the model holds it (no widening).
#define SELFSPEC_DPBF16 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512bf16")))

SELFSPEC_DPBF16 inline __m512bh load32(const BF16* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// out[u] = the sum of the 16 lanes of a[u]: each vector's halves added lane by lane, then reduce8 on
// each group of 8 vectors
SELFSPEC_DPBF16 inline void reduce16(const __m512* a, float* out) {
  __m256 h[16];
#pragma GCC unroll 16
  for (int u = 0; u < 16; ++u)
    h[u] = _mm256_add_ps(_mm512_castps512_ps256(a[u]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[u]), 1)));
  _mm256_storeu_ps(out, reduce8(h));
  _mm256_storeu_ps(out + 8, reduce8(h + 8));
}

// s[u] = q . k_u for the 16 keys kj[0..16) (D a multiple of 8; the last block of D masked)
SELFSPEC_DPBF16 inline void dp_scores16(const BF16* q, const BF16* const* kj, int64_t D, float* s) {
  __m512 a[16];
#pragma GCC unroll 16
  for (int u = 0; u < 16; ++u) a[u] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    const __mmask32 mask = D - d >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << (D - d)) - 1u);
    const __m512bh qv = load32(q + d, mask);
#pragma GCC unroll 16
    for (int u = 0; u < 16; ++u) a[u] = _mm512_dpbf16_ps(a[u], qv, load32(kj[u] + d, mask));
  }
  reduce16(a, s);
}

// The values of bfloat16 attention on a dot-product path: the weights exp(s - max) rounded to
// bfloat16 (as torch's own CPU flash attention rounds them before its value product; their sum, the
// normaliser, stays the float32 sum of the unrounded weights), and accumulated by VDPBF16PS over
// pairs of listed keys in list order (keys 2i and 2i+1 of the row's list: a row with an odd count
// pairs its last key with weight zero). A vector takes 32 dimensions of the two keys' values
// interleaved (unpacklo/unpackhi within 128-bit lanes), so the accumulators hold the dimensions in a
// fixed permuted order, put back in order once at the end (dp_unpermute). Per (row, head) the
// sequence depends only on the row's list: row-independent.
SELFSPEC_DPBF16 inline __m512i load_values32(const BF16* p, __mmask32 mask) {
  return _mm512_maskz_loadu_epi16(mask, p);
}

// acc[e][d0 .. d0 + 32C) (permuted) += w[e][j] v_j + w[e][j + 1] v_{j + 1} for the pairs of keys from
// j0 (even) to j1 in list order; w holds each (row, head)'s weights in bfloat16, zero past its count
template <int E, int C>
SELFSPEC_DPBF16 inline void dp_values(const BF16* const* w, const int64_t* idx, int64_t j0, int64_t j1,
                                      const BF16* vh, int64_t vs_l, int64_t d0, const __mmask32* masks,
                                      float* const* acc_mem) {
  __m512 acc[E][C][2];
#pragma GCC unroll 8
  for (int e = 0; e < E; ++e)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) acc[e][c][h] = _mm512_loadu_ps(acc_mem[e] + d0 + 32 * c + 16 * h);
  for (int64_t j = j0; j < j1; j += 2) {
    const BF16* v0 = vh + idx[j] * vs_l + d0;
    const BF16* v1 = vh + idx[j + 1] * vs_l + d0;
    __m512bh lo[C], hi[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512i a = load_values32(v0 + 32 * c, masks[c]), b = load_values32(v1 + 32 * c, masks[c]);
      lo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      hi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
#pragma GCC unroll 8
    for (int e = 0; e < E; ++e) {
      int32_t pair;
      std::memcpy(&pair, w[e] + j, sizeof(pair));
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        acc[e][c][0] = _mm512_dpbf16_ps(acc[e][c][0], lo[c], pv);
        acc[e][c][1] = _mm512_dpbf16_ps(acc[e][c][1], hi[c], pv);
      }
    }
  }
#pragma GCC unroll 8
  for (int e = 0; e < E; ++e)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) _mm512_storeu_ps(acc_mem[e] + d0 + 32 * c + 16 * h, acc[e][c][h]);
}

// heads [0, hb) of one row, at most 4 at a time, over every dimension in pieces of 64 (the last
// piece's loads masked to the dimensions left; the accumulators are padded to 32 dimensions)
SELFSPEC_DPBF16 void dp_values_heads(const BF16* const* w, int64_t hb, const int64_t* idx, int64_t j0, int64_t j1,
                                     const BF16* vh, int64_t vs_l, int64_t D, float* const* acc_mem) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __mmask32 masks[2];
    for (int c = 0; c < 2; ++c) {
      const int64_t left = D - d0 - 32 * c;
      masks[c] = left >= 32 ? ~__mmask32(0) : (left > 0 ? static_cast<__mmask32>((1u << left) - 1u) : 0);
    }
    const bool two = D - d0 > 32;
    for (int64_t e = 0; e < hb; e += 4) {
      const BF16* const* we = w + e;
      float* const* ae = acc_mem + e;
      switch (std::min<int64_t>(4, hb - e) * 2 + two) {
        case 9: dp_values<4, 2>(we, idx, j0, j1, vh, vs_l, d0, masks, ae); break;
        case 8: dp_values<4, 1>(we, idx, j0, j1, vh, vs_l, d0, masks, ae); break;
        case 7: dp_values<3, 2>(we, idx, j0, j1, vh, vs_l, d0, masks, ae); break;
        case 6: dp_values<3, 1>(we, idx, j0, j1, vh, vs_l, d0, masks, ae); break;
        case 5: dp_values<2, 2>(we, idx, j0, j1, vh, vs_l, d0, masks, ae); break;
        case 4: dp_values<2, 1>(we, idx, j0, j1, vh, vs_l, d0, masks, ae); break;
        case 3: dp_values<1, 2>(we, idx, j0, j1, vh, vs_l, d0, masks, ae); break;
        default: dp_values<1, 1>(we, idx, j0, j1, vh, vs_l, d0, masks, ae); break;
      }
    }
  }
}

// out[0 .. D) = acc (permuted, padded to 32 dimensions) in order, times inv. Within each 128-bit
// lane of the 32 dimensions' two vectors, unpacklo took dimensions 0-3 and unpackhi 4-7 of each 8.
SELFSPEC_DPBF16 void dp_unpermute(const float* acc, int64_t D, float inv, float* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t d = 0; d < D; d += 32) {
    const __m512 lo = _mm512_loadu_ps(acc + d), hi = _mm512_loadu_ps(acc + d + 16);
    const int64_t left = D - d;
    const __mmask16 m0 = left >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
    const __mmask16 m1 = left >= 32 ? __mmask16(0xffff) : (left > 16 ? static_cast<__mmask16>((1u << (left - 16)) - 1u) : 0);
    _mm512_mask_storeu_ps(out + d, m0, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), vinv));
    _mm512_mask_storeu_ps(out + d + 16, m1, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), vinv));
  }
}

// the weights of one (row, head) in bfloat16 (round to nearest even), zero from `n` to `padded`
SELFSPEC_DPBF16 void dp_weights(const float* p, int64_t n, int64_t padded, BF16* w) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + j)));
  if (j < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - j)) - 1u);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + j), (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, p + j)));
    j += 16;
  }
  for (; j < padded; ++j) w[j] = BF16(0.f);
}

// The values on AVX-512 (where the CPU has it; torch.ops.selfspec.skinny_isa("avx2") forces the
// AVX2 loop above): each of E heads that share a row's listed keys (the task's heads of one row)
// accumulates p_j * v_j in key order, 16 dimensions a vector, each key's values read (and bfloat16
// widened) once for all E heads. Per dimension that is the FMA sequence weighted_values performs, so
// the outputs are its bits.
#define SELFSPEC_AVX512 __attribute__((target("avx2,fma,avx512f,avx512dq,avx512bw,avx512vl")))

SELFSPEC_AVX512 inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
SELFSPEC_AVX512 inline __m512 load16(const BF16* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

// acc[e][d0, d0 + 16C) += p[e][j] * v_j[d0, d0 + 16C) over the listed keys j in [j0, j1), in order;
// `masks` select the dimensions of each vector that exist
template <int E, int C, typename T>
SELFSPEC_AVX512 inline void weighted_values512(const float* const* p, const int64_t* idx, int64_t j0, int64_t j1,
                                               const T* vh, int64_t vs_l, int64_t d0, const __mmask16* masks,
                                               float* const* acc_mem) {
  __m512 acc[E][C];
#pragma GCC unroll 8
  for (int e = 0; e < E; ++e)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[e][c] = _mm512_maskz_loadu_ps(masks[c], acc_mem[e] + d0 + 16 * c);
  for (int64_t j = j0; j < j1; ++j) {
    const T* vj = vh + idx[j] * vs_l + d0;
    __m512 vv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) vv[c] = load16(vj + 16 * c, masks[c]);
#pragma GCC unroll 8
    for (int e = 0; e < E; ++e) {
      const __m512 pv = _mm512_set1_ps(p[e][j]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[e][c] = _mm512_fmadd_ps(pv, vv[c], acc[e][c]);
    }
  }
#pragma GCC unroll 8
  for (int e = 0; e < E; ++e)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(acc_mem[e] + d0 + 16 * c, masks[c], acc[e][c]);
}

// every dimension in chunks of 64 (4 vectors; the last chunk's vectors masked to the dimensions left)
template <int E, typename T>
SELFSPEC_AVX512 void weighted_values512_chunks(const float* const* p, const int64_t* idx, int64_t j0, int64_t j1,
                                               const T* vh, int64_t vs_l, int64_t D, float* const* acc_mem) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __mmask16 masks[4];
    for (int c = 0; c < 4; ++c) {
      const int64_t left = D - d0 - 16 * c;
      masks[c] = left >= 16 ? __mmask16(0xffff) : (left > 0 ? static_cast<__mmask16>((1u << left) - 1u) : 0);
    }
    switch (std::min<int64_t>(4, (D - d0 + 15) / 16)) {
      case 4: weighted_values512<E, 4>(p, idx, j0, j1, vh, vs_l, d0, masks, acc_mem); break;
      case 3: weighted_values512<E, 3>(p, idx, j0, j1, vh, vs_l, d0, masks, acc_mem); break;
      case 2: weighted_values512<E, 2>(p, idx, j0, j1, vh, vs_l, d0, masks, acc_mem); break;
      default: weighted_values512<E, 1>(p, idx, j0, j1, vh, vs_l, d0, masks, acc_mem); break;
    }
  }
}

// heads [0, hb) of one row, at most 4 at a time (16 accumulators, 4 value vectors)
template <typename T>
SELFSPEC_AVX512 void weighted_values512_heads(const float* const* p, int64_t hb, const int64_t* idx, int64_t j0,
                                              int64_t j1, const T* vh, int64_t vs_l, int64_t D, float* const* acc_mem) {
  for (int64_t e = 0; e < hb; e += 4) {
    switch (std::min<int64_t>(4, hb - e)) {
      case 4: weighted_values512_chunks<4>(p + e, idx, j0, j1, vh, vs_l, D, acc_mem + e); break;
      case 3: weighted_values512_chunks<3>(p + e, idx, j0, j1, vh, vs_l, D, acc_mem + e); break;
      case 2: weighted_values512_chunks<2>(p + e, idx, j0, j1, vh, vs_l, D, acc_mem + e); break;
      default: weighted_values512_chunks<1>(p + e, idx, j0, j1, vh, vs_l, D, acc_mem + e); break;
    }
  }
}

//: keys per block of the value pass: the block's values stay in L1 while every head of the task uses them
constexpr int64_t VALUE_BLOCK = 32;

// Q is float (the scores by FMAs over widened keys) or BF16 (bfloat16 keys: the scores by
// VDPBF16PS, dp_scores16)
template <typename Q, typename T>
void run(const Q* q, const T* k, const T* v, const bool* allowed, float* out, int64_t H, int64_t M,
         int64_t D, int64_t L, int64_t group, int64_t ks_h, int64_t ks_l, int64_t vs_h, int64_t vs_l, float scale) {
  constexpr bool dp = std::is_same<Q, BF16>::value;
  constexpr int64_t block = dp ? 16 : 8;  // keys per block of the scores
  const bool wide = selfspec_isa::avx512();  // the values on AVX-512
  // A task is a block of `rb` rows of `hb` query heads that share one key/value head: a key or
  // value fetched into L1 serves every (row, head) of the task that attends to it. Only when there
  // would be a single task (one row, one key/value head) is a task one head, so that both threads
  // have work: uneven tasks cost less than reading the keys once per head (SmolLM2, 3 key/value
  // heads of 3 query heads, one row at 512 positions: 35 us a layer against 52 with a task per
  // head). What a (row, head) computes is the same whatever the task holds.
  const int64_t Hkv = H / group;
  const int64_t hb = Hkv * M >= 2 ? group : 1;
  const int64_t per_kv = group / hb;
  const int64_t rb = M >= 8 ? 4 : (M >= 4 ? 2 : 1);
  const int64_t row_blocks = (M + rb - 1) / rb;
  at::parallel_for(0, Hkv * row_blocks * per_kv, 1, [&](int64_t t0, int64_t t1) {
    const int64_t padded = (L + block - 1) / block * block;
    std::vector<int64_t> idx(rb * padded), count(rb);
    const int64_t acc_d = dp ? (D + 31) / 32 * 32 : D;  // the dot-product values' accumulators: whole 32s
    std::vector<float> s(rb * hb * padded), acc(rb * hb * acc_d), inv(rb * hb);
    std::vector<BF16> weights(dp ? rb * hb * padded : 0);
    std::vector<const float*> pe(hb);
    std::vector<const BF16*> we(hb);
    std::vector<float*> acc_e(hb);
    const __m256 vscale = _mm256_set1_ps(scale);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t t = t0; t < t1; ++t) {
      // t = (g * row_blocks + block) * per_kv + part: consecutive tasks share a key/value head
      const int64_t part = t % per_kv, gb = t / per_kv, g = gb / row_blocks, i0 = (gb % row_blocks) * rb;
      const int64_t rows = std::min(rb, M - i0), h0 = g * group + part * hb;
      const T* kh = k + g * ks_h;
      const T* vh = v + g * vs_h;
      int64_t longest = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const bool* row = allowed ? allowed + (i0 + r) * L : nullptr;
        int64_t* ir = idx.data() + r * padded;
        int64_t n = 0;
        for (int64_t j = 0; j < L; ++j)
          if (!row || row[j]) ir[n++] = j;
        for (int64_t j = n; n && j < padded; ++j) ir[j] = ir[n - 1];  // the last block's spare lanes (masked below)
        count[r] = n;
        longest = std::max(longest, n);
      }
      // scores, 8 keys at a time: 8 independent FMA chains over the head dimension, then reduce8
      // (bfloat16 on a dot-product path: 16 keys at a time, dp_scores16)
      for (int64_t b = 0; b < longest; b += block) {
        for (int64_t r = 0; r < rows; ++r) {
          if (b >= count[r]) continue;
          const int64_t* ir = idx.data() + r * padded;
          if constexpr (dp) {
            const T* kj[16];
            for (int u = 0; u < 16; ++u) kj[u] = kh + ir[b + u] * ks_l;
            for (int64_t e = 0; e < hb; ++e) {
              float* se = s.data() + (r * hb + e) * padded + b;
              dp_scores16(q + ((h0 + e) * M + i0 + r) * D, kj, D, se);
              for (int64_t half = 0; half < 16; half += 8) {
                const __m256 valid = _mm256_castsi256_ps(
                    _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count[r] - b - half)), lane));
                _mm256_storeu_ps(se + half, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                                             _mm256_mul_ps(_mm256_loadu_ps(se + half), vscale), valid));
              }
            }
          } else {
            const T* kj[8];
#pragma GCC unroll 8
            for (int u = 0; u < 8; ++u) kj[u] = kh + ir[b + u] * ks_l;
            const __m256 valid =
                _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count[r] - b)), lane));
            for (int64_t e = 0; e < hb; ++e) {
              const float* qi = q + ((h0 + e) * M + i0 + r) * D;
              __m256 a[8];
#pragma GCC unroll 8
              for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
              for (int64_t d = 0; d < D; d += 8) {
                const __m256 qd = _mm256_loadu_ps(qi + d);
#pragma GCC unroll 8
                for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(qd, load8(kj[u] + d), a[u]);
              }
              _mm256_storeu_ps(s.data() + (r * hb + e) * padded + b,
                               _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_mul_ps(reduce8(a), vscale), valid));
            }
          }
        }
      }
      // per (row, head): weights exp(s - max) (the masked spare lanes, -inf, give 0) and their sum
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = count[r];
        for (int64_t e = 0; e < hb && n; ++e) {
          float* se = s.data() + (r * hb + e) * padded;
          __m256 vmax = _mm256_set1_ps(-INFINITY);
          for (int64_t b = 0; b < n; b += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(se + b));
          alignas(32) float lanes[8];
          _mm256_store_ps(lanes, vmax);
          float mx = lanes[0];
          for (float x : lanes) mx = std::max(mx, x);
          const __m256 vmx = _mm256_set1_ps(mx);
          __m256 vsum = _mm256_setzero_ps();
          for (int64_t b = 0; b < n; b += 8) {
            const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(se + b), vmx));
            _mm256_storeu_ps(se + b, p);
            vsum = _mm256_add_ps(vsum, p);
          }
          inv[r * hb + e] = 1.f / hsum(vsum);
          if constexpr (dp) dp_weights(se, n, padded, weights.data() + (r * hb + e) * padded);
        }
      }
      // the values, a block of keys at a time for every (row, head) of the task
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j0 = 0; j0 < longest; j0 += VALUE_BLOCK)
        for (int64_t r = 0; r < rows; ++r) {
          if (j0 >= count[r]) continue;
          const int64_t j1 = std::min(count[r], j0 + VALUE_BLOCK);
          if constexpr (dp) {
            for (int64_t e = 0; e < hb; ++e) {
              we[e] = weights.data() + (r * hb + e) * padded;
              acc_e[e] = acc.data() + (r * hb + e) * acc_d;
            }
            dp_values_heads(we.data(), hb, idx.data() + r * padded, j0, j1, vh, vs_l, D, acc_e.data());
            continue;
          }
          if (wide) {
            for (int64_t e = 0; e < hb; ++e) {
              pe[e] = s.data() + (r * hb + e) * padded;
              acc_e[e] = acc.data() + (r * hb + e) * D;
            }
            weighted_values512_heads(pe.data(), hb, idx.data() + r * padded, j0, j1, vh, vs_l, D, acc_e.data());
            continue;
          }
          for (int64_t e = 0; e < hb; ++e)
            weighted_values_chunks(s.data() + (r * hb + e) * padded, idx.data() + r * padded, j0, j1, vh, vs_l, D,
                                   acc.data() + (r * hb + e) * D);
        }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t e = 0; e < hb; ++e) {
          float* o = out + ((h0 + e) * M + i0 + r) * D;
          if (!count[r]) {  // no key allowed: zeros, as a fully masked row
            for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
            continue;
          }
          if constexpr (dp) {
            dp_unpermute(acc.data() + (r * hb + e) * acc_d, D, inv[r * hb + e], o);
            continue;
          }
          const __m256 vinv = _mm256_set1_ps(inv[r * hb + e]);
          const float* a = acc.data() + (r * hb + e) * D;
          for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(a + d), vinv));
        }
    }
  });
}

// q [1, H, M, D]; k, v [1, Hkv, L, D] (last dim contiguous, any other strides: cache views);
// allowed [M, L] bool or an empty tensor (every key allowed). Returns [1, H, M, D] in q's dtype.
at::Tensor rowwise_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& allowed_in, double scale) {
  TORCH_CHECK(q_in.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q_in.size(0) == 1 && k.size(0) == 1,
              "rowwise_attention: [1, heads, rows, dim] tensors");
  TORCH_CHECK(k.scalar_type() == q_in.scalar_type() && v.scalar_type() == q_in.scalar_type() &&
              (q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16),
              "rowwise_attention: float32 or bfloat16 q, k, v of one dtype");
  const int64_t H = q_in.size(1), M = q_in.size(2), D = q_in.size(3), Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(D % 8 == 0 && k.size(3) == D && v.size(3) == D && v.size(2) == L && v.size(1) == Hkv && H % Hkv == 0,
              "rowwise_attention: shapes");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "rowwise_attention: contiguous head dim");
  // bfloat16 on a dot-product path: the scores by VDPBF16PS on the query as it is
  const bool dp = q_in.scalar_type() == at::kBFloat16 && selfspec_bf16::current() != selfspec_bf16::kWiden;
  const at::Tensor q = dp ? q_in.contiguous() : q_in.to(at::kFloat).contiguous();
  at::Tensor allowed;
  if (allowed_in.numel()) {
    allowed = allowed_in.reshape({M, L}).to(at::kBool).contiguous();
  }
  at::Tensor out = at::empty({1, H, M, D}, q.options().dtype(at::kFloat));
  const bool* ap = allowed.defined() ? allowed.data_ptr<bool>() : nullptr;
  if (dp)
    run(q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), ap, out.data_ptr<float>(),
        H, M, D, L, H / Hkv, k.stride(1), k.stride(2), v.stride(1), v.stride(2), static_cast<float>(scale));
  else if (k.scalar_type() == at::kBFloat16)
    run(q.data_ptr<float>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), ap, out.data_ptr<float>(), H, M,
        D, L, H / Hkv, k.stride(1), k.stride(2), v.stride(1), v.stride(2), static_cast<float>(scale));
  else
    run(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), ap, out.data_ptr<float>(), H, M, D, L, H / Hkv,
        k.stride(1), k.stride(2), v.stride(1), v.stride(2), static_cast<float>(scale));
  return out.to(q_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(selfspec, m) {
  m.def("rowwise_attention(Tensor q, Tensor k, Tensor v, Tensor allowed, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(selfspec, CPU, m) { m.impl("rowwise_attention", &rowwise_attention); }
