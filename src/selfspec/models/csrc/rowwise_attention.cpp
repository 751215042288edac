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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "avx2.h"

namespace {

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

//: keys per block of the value pass: the block's values stay in L1 while every head of the task uses them
constexpr int64_t VALUE_BLOCK = 32;

template <typename T>
void run(const float* q, const T* k, const T* v, const bool* allowed, float* out, int64_t H, int64_t M,
         int64_t D, int64_t L, int64_t group, int64_t ks_h, int64_t ks_l, int64_t vs_h, int64_t vs_l, float scale) {
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
    const int64_t padded = (L + 7) / 8 * 8;
    std::vector<int64_t> idx(rb * padded), count(rb);
    std::vector<float> s(rb * hb * padded), acc(rb * hb * D), inv(rb * hb);
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
      for (int64_t b = 0; b < longest; b += 8) {
        for (int64_t r = 0; r < rows; ++r) {
          if (b >= count[r]) continue;
          const int64_t* ir = idx.data() + r * padded;
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
        }
      }
      // the values, a block of keys at a time for every (row, head) of the task
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j0 = 0; j0 < longest; j0 += VALUE_BLOCK)
        for (int64_t r = 0; r < rows; ++r) {
          if (j0 >= count[r]) continue;
          for (int64_t e = 0; e < hb; ++e)
            weighted_values_chunks(s.data() + (r * hb + e) * padded, idx.data() + r * padded, j0,
                                   std::min(count[r], j0 + VALUE_BLOCK), vh, vs_l, D, acc.data() + (r * hb + e) * D);
        }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t e = 0; e < hb; ++e) {
          float* o = out + ((h0 + e) * M + i0 + r) * D;
          if (!count[r]) {  // no key allowed: zeros, as a fully masked row
            for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
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
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  at::Tensor allowed;
  if (allowed_in.numel()) {
    allowed = allowed_in.reshape({M, L}).to(at::kBool).contiguous();
  }
  at::Tensor out = at::empty({1, H, M, D}, q.options());
  const bool* ap = allowed.defined() ? allowed.data_ptr<bool>() : nullptr;
  if (k.scalar_type() == at::kBFloat16)
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
