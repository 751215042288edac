// y = x @ W^T for a few rows of x (the k new tokens of a decoding or verification step), AVX2:
// fp32 weights, or bfloat16 weights and activations with fp32 accumulation (rounded to bfloat16 once).
//
// Why a kernel of our own: on the CPUs selfspec is developed on (AMD, AVX2) the BLAS behind
// torch.nn.functional.linear takes 2-3x as long for 8 rows as for 1, so verifying a draft of k
// tokens costs far more than one decoding step. Here each block of weight rows is read once and
// multiplied with up to 6 rows of x held in registers, so k rows cost far less than k one-row calls.
//
// Every output element is computed by the same instruction sequence whatever the number of rows
// (8-lane FMA accumulation over K in order, then a fixed horizontal sum), so row i of a k-row call
// is bit-identical to a 1-row call on row i alone: a verification pass sees exactly the linear
// outputs that one-token decoding would. With bfloat16 weights each weight element is widened to
// fp32 exactly (a 16-bit shift) and the same fp32 sequence runs, then y is rounded to bfloat16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>

#include "avx2.h"

#ifndef SKINNY_NB
#define SKINNY_NB 48
#endif
#ifndef SKINNY_PD
#define SKINNY_PD 2
#endif

namespace {

using selfspec_avx2::hsum;
using selfspec_avx2::load8;

// MB rows of x times NR rows of W: MB*NR accumulators of 8 lanes, kept in registers (every loop
// over m and r is unrolled; K is a multiple of 8, checked by the caller). Meanwhile ``lines`` cache
// lines from ``pf`` on are prefetched, spread over the K loop, so that memory streams the weight
// rows a later tile needs while this one computes.
template <int MB, int NR, typename W>
inline void tile(const float* x, const W* w, int64_t K, float* y, int64_t ldy, const char* pf, int64_t lines) {
  __m256 acc[MB][NR];
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  const int64_t per_step = (lines + K / 8 - 1) / (K / 8);
  int64_t line = 0;
  for (int64_t k = 0; k < K; k += 8) {
    for (int64_t p = 0; p < per_step && line < lines; ++p, ++line) _mm_prefetch(pf + line * 64, _MM_HINT_T0);
    __m256 wv[NR];
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) wv[r] = load8(w + r * K + k);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) y[m * ldy + r] = hsum(acc[m][r]);
}

template <int NR, typename W>
inline void tile_rows(int mb, const float* x, const W* w, int64_t K, float* y, int64_t ldy, const char* pf,
                      int64_t lines) {
  switch (mb) {
    case 6: tile<6, NR, W>(x, w, K, y, ldy, pf, lines); break;
    case 5: tile<5, NR, W>(x, w, K, y, ldy, pf, lines); break;
    case 4: tile<4, NR, W>(x, w, K, y, ldy, pf, lines); break;
    case 3: tile<3, NR, W>(x, w, K, y, ldy, pf, lines); break;
    case 2: tile<2, NR, W>(x, w, K, y, ldy, pf, lines); break;
    default: tile<1, NR, W>(x, w, K, y, ldy, pf, lines); break;
  }
}

// Each thread walks its weight rows in tiles of NR = 2. While a tile multiplies the blocks of up
// to MB = 6 rows of x, the tile SKINNY_PD tiles ahead is prefetched, a share of it during each
// block: with k > MB rows the arithmetic of the later blocks then overlaps the memory traffic
// instead of following it (measured on 2 Zen 3 cores, all SmolLM2-135M weights: 16 rows 88 -> 46 ms).
// A block of 6 rows holds 12 accumulators, 2 weight vectors and 1 x vector: 15 of the 16 AVX2
// registers. Tiles of 2 weight rows against the earlier 3 (and blocks of 4), on 2 Zen 4 cores over
// all of SmolLM2-135M's linears and its LM head, interleaved, medians of 21-31: one row 15.0 -> 12.7 ms,
// four rows 22.7 -> 18.2 ms, six rows 28.9 -> 23.8 ms, eight and more the same.
constexpr int NR = 2;  // weight rows per tile
constexpr int MB = 6;  // rows of x per block
template <typename W>
void run(const float* xp, const W* wp, float* yp, int64_t M, int64_t N, int64_t K) {
  constexpr int64_t NB = SKINNY_NB;  // weight rows per parallel task
  const int64_t blocks = (M + MB - 1) / MB;
  const int64_t tile_lines = (NR * K * static_cast<int64_t>(sizeof(W)) + 63) / 64;
  const int64_t lines_per_block = (tile_lines + blocks - 1) / blocks;
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t b0, int64_t b1) {
    const int64_t n_end = std::min(N, b1 * NB);
    const char* end = reinterpret_cast<const char*>(wp + n_end * K);
    int64_t n = b0 * NB;
    // a tile of NR weight rows is read from memory once and reused from L1 for every block of x rows
    for (; n + NR <= n_end; n += NR) {
      const char* ahead = reinterpret_cast<const char*>(wp + (n + NR * SKINNY_PD) * K);
      for (int64_t m0 = 0, b = 0; m0 < M; m0 += MB, ++b) {
        const char* pf = ahead + b * lines_per_block * 64;
        const int64_t lines = std::max<int64_t>(0, std::min<int64_t>(lines_per_block, (end - pf) / 64));
        tile_rows<NR, W>(static_cast<int>(std::min<int64_t>(MB, M - m0)), xp + m0 * K, wp + n * K, K,
                         yp + m0 * N + n, N, pf, lines);
      }
    }
    for (; n < n_end; ++n)
      for (int64_t m0 = 0; m0 < M; m0 += MB)
        tile_rows<1, W>(static_cast<int>(std::min<int64_t>(MB, M - m0)), xp + m0 * K, wp + n * K, K, yp + m0 * N + n,
                        N, nullptr, 0);
  });
}

at::Tensor skinny_linear(const at::Tensor& x_in, const at::Tensor& weight) {
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK((weight.scalar_type() == at::kFloat || bf16) && x_in.scalar_type() == weight.scalar_type(),
              "skinny_linear: float32 or bfloat16 x and weight, of one dtype");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "skinny_linear: contiguous 2-D weight");
  const int64_t K = weight.size(1), N = weight.size(0);
  TORCH_CHECK(x_in.size(-1) == K, "skinny_linear: x has ", x_in.size(-1), " features, weight ", K);
  TORCH_CHECK(K % 8 == 0, "skinny_linear: in_features must be a multiple of 8, got ", K);
  auto out_shape = x_in.sizes().vec();
  out_shape.back() = N;
  // bfloat16 activations widen to fp32 exactly; the product accumulates in fp32
  const at::Tensor x = x_in.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (bf16)
    run(x.data_ptr<float>(), weight.data_ptr<at::BFloat16>(), y.data_ptr<float>(), M, N, K);
  else
    run(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), M, N, K);
  return (bf16 ? y.to(at::kBFloat16) : y).view(out_shape);
}

}  // namespace

TORCH_LIBRARY(selfspec, m) { m.def("skinny_linear(Tensor x, Tensor weight) -> Tensor"); }
TORCH_LIBRARY_IMPL(selfspec, CPU, m) { m.impl("skinny_linear", &skinny_linear); }
