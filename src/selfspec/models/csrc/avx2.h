// AVX2 helpers shared by the runtime's CPU kernels (skinny_linear.cpp, rowwise_attention.cpp).
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

namespace selfspec_avx2 {

// the sum of 8 lanes in a fixed order
inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  s = _mm_add_ss(s, _mm_movehl_ps(sh, s));
  return _mm_cvtss_f32(s);
}

// 8 consecutive values as fp32 (bfloat16 widens exactly: a 16-bit shift)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

}  // namespace selfspec_avx2
