// Attention of a few query rows (a decoding or verification step), one (head, row) at a time, AVX2.
//
// SDPA's CPU kernels multiply a block of queries at once, so row i of a k-row call differs in the
// last bits from a one-row call; in bfloat16 that flips argmaxes at near-ties. Here every output
// row is computed by the same instruction sequence whatever the number of rows: the scores of
// the keys its mask allows, in key order (8-lane FMA over the head dimension, a fixed horizontal
// sum, times the scale), their maximum, exp(s - max) summed in key order, the values accumulated
// in key order with those weights, divided by the sum; fp32 throughout (bfloat16 keys and values
// widen exactly). Row i of a k-row call therefore equals a one-row call over the same keys, and
// a tree node's row (ancestors scattered in the cache) equals the one-row call over those keys
// gathered in order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

#include "avx2.h"

namespace {

using selfspec_avx2::hsum;
using selfspec_avx2::load8;

template <typename T>
void run(const float* q, const T* k, const T* v, const bool* allowed, float* out, int64_t H, int64_t M,
         int64_t D, int64_t L, int64_t group, int64_t ks_h, int64_t ks_l, int64_t vs_h, int64_t vs_l, float scale) {
  at::parallel_for(0, H * M, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(L);
    std::vector<__m256> acc(D / 8);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t / M, i = t % M, g = h / group;
      const float* qi = q + (h * M + i) * D;
      const T* kh = k + g * ks_h;
      const T* vh = v + g * vs_h;
      const bool* row = allowed ? allowed + i * L : nullptr;
      float mx = -INFINITY;
      for (int64_t j = 0; j < L; ++j) {
        if (row && !row[j]) continue;
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(load8(qi + d), load8(kh + j * ks_l + d), a);
        s[j] = hsum(a) * scale;
        mx = std::max(mx, s[j]);
      }
      for (auto& x : acc) x = _mm256_setzero_ps();
      float sum = 0.f;
      for (int64_t j = 0; j < L; ++j) {
        if (row && !row[j]) continue;
        const float p = std::exp(s[j] - mx);
        sum += p;
        const __m256 pv = _mm256_set1_ps(p);
        for (int64_t d = 0; d < D; d += 8) acc[d / 8] = _mm256_fmadd_ps(pv, load8(vh + j * vs_l + d), acc[d / 8]);
      }
      const __m256 inv = _mm256_set1_ps(1.f / sum);
      float* o = out + (h * M + i) * D;
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(acc[d / 8], inv));
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
