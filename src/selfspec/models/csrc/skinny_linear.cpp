// y = x @ W^T for a few rows of x (the k new tokens of a decoding or verification step), AVX2:
// fp32 weights, or bfloat16 weights and activations with fp32 accumulation (rounded to bfloat16 once).
// On a CPU with AVX-512F an AVX-512 path runs passes of more than 6 rows (on a Zen 4 from 5 rows,
// and over weights of 1,024 columns or more at every row count), chosen at runtime (the library is
// still compiled with -mavx2 -mfma and runs on AVX2-only CPUs). Its outputs are
// bit-identical to the AVX2 path's (how: the comment opening the AVX-512 part below), so results do
// not depend on which path ran; torch.ops.selfspec.skinny_isa forces one path (tests).
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
#include <atomic>
#include <cpuid.h>
#include <limits>
#include <vector>
#include <string>

#include "avx2.h"
#include "bf16_dot.h"
#include "isa.h"
#include "prefetch.h"

#ifndef SKINNY_NB
#define SKINNY_NB 48
#endif
#ifndef SKINNY_PD
#define SKINNY_PD 2
#endif
#ifndef SKINNY512_NP
#define SKINNY512_NP 2  // AVX-512 path: packed pairs of weight rows per tile (at most 4: registers)
#endif
#ifndef SKINNY512_PD
// AVX-512 path: tiles prefetched ahead, into L2 (SKINNY512_PF_HINT). Into L2 4 tiles ahead against
// into L1 one tile ahead, on 2 Zen 4 cores, whole SmolLM2 passes after 512 positions in turns, 5
// rounds: eight rows 29.0-32.6 against 41.1-46.0 ms, one row 19.7-22.7 against 19.1-26.4 ms
// (docs/2026-12-01-bfloat16-on-the-cpu.md). A prefetch does no arithmetic: the bits are the same.
#define SKINNY512_PD 4
#endif
#ifndef SKINNY512_PF_HINT
#define SKINNY512_PF_HINT _MM_HINT_T1
#endif

namespace {

using selfspec_avx2::hsum;
using selfspec_avx2::load8;
using selfspec_prefetch::Spread;

// MB rows of x times NR rows of W: MB*NR accumulators of 8 lanes, kept in registers (every loop
// over m and r is unrolled; K is a multiple of 8, checked by the caller). Meanwhile ``lines`` cache
// lines from ``pf`` on are prefetched, spread over the K loop, so that memory streams the weight
// rows a later tile needs while this one computes (prefetch.h).
template <int MB, int NR, typename W>
inline void tile(const float* x, const W* w, int64_t K, float* y, int64_t ldy, const char* pf, int64_t lines) {
  __m256 acc[MB][NR];
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  Spread<_MM_HINT_T0> prefetch(pf, lines, K / 8);
  for (int64_t k = 0; k < K; k += 8) {
    prefetch.step();
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
void run_avx2(const float* xp, const W* wp, float* yp, int64_t M, int64_t N, int64_t K) {
  constexpr int64_t NB = SKINNY_NB;  // weight rows per parallel task
  const int64_t lines_per_block =
      selfspec_prefetch::lines_per_block(NR * K * static_cast<int64_t>(sizeof(W)), (M + MB - 1) / MB);
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t b0, int64_t b1) {
    const int64_t n_end = std::min(N, b1 * NB);
    const char* end = reinterpret_cast<const char*>(wp + n_end * K);
    int64_t n = b0 * NB;
    // a tile of NR weight rows is read from memory once and reused from L1 for every block of x rows
    for (; n + NR <= n_end; n += NR) {
      const char* ahead = reinterpret_cast<const char*>(wp + (n + NR * SKINNY_PD) * K);
      for (int64_t m0 = 0, b = 0; m0 < M; m0 += MB, ++b) {
        const auto pf = selfspec_prefetch::share(ahead, b, lines_per_block, end);
        tile_rows<NR, W>(static_cast<int>(std::min<int64_t>(MB, M - m0)), xp + m0 * K, wp + n * K, K,
                         yp + m0 * N + n, N, pf.from, pf.lines);
      }
    }
    for (; n < n_end; ++n)
      for (int64_t m0 = 0; m0 < M; m0 += MB)
        tile_rows<1, W>(static_cast<int>(std::min<int64_t>(MB, M - m0)), xp + m0 * K, wp + n * K, K, yp + m0 * N + n,
                        N, nullptr, 0);
  });
}

// The AVX-512 path, bit-identical to the one above. A 512-bit register holds a PAIR of weight rows:
// lanes 0..7 are w[r][k..k+7], lanes 8..15 are w[r+1][k..k+7] (bfloat16 halves widened exactly as
// load8 widens them), and the 8 values x[m][k..k+7] are broadcast into both halves. One 16-lane FMA
// then performs per lane exactly the FMA that the AVX2 path's accumulators of rows r and r+1
// perform, over K in the same order; at the end each accumulator is split into its two 256-bit
// halves and each is reduced by the same hsum. Only AVX-512F instructions are used (the functions
// carry a target attribute, so this file still compiles with -mavx2 -mfma).
// Tiles: NP = SKINNY512_NP pairs (4 weight rows) against blocks of up to MB = 6 rows of x: 12
// accumulators, 2 weight vectors and 1 x vector. The next tile is prefetched as in the AVX2 path.
// 4 pairs (8 rows; 29 of the 32 zmm registers) and prefetching 2 tiles ahead measured the same or
// slower at 8-32 rows. Leftover rows of a task: pairs one at a time, then a last odd row through
// the AVX2 tile (the same arithmetic).
#define SELFSPEC_AVX512 __attribute__((target("avx512f")))

SELFSPEC_AVX512 inline __m512 load8x2(const float* p0, const float* p1) {
  const __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(p0)));
  return _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_loadu_ps(p1)), 1));
}
SELFSPEC_AVX512 inline __m512 load8x2(const at::BFloat16* p0, const at::BFloat16* p1) {
  const __m256i h = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// x[k..k+7] in both halves
SELFSPEC_AVX512 inline __m512 broadcast8(const float* p) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}

// MB rows of x times NP pairs of rows of W (rows 2p and 2p+1 of w); as tile() above otherwise
template <int MB, int NP, typename W>
SELFSPEC_AVX512 inline void tile512(const float* x, const W* w, int64_t K, float* y, int64_t ldy, const char* pf,
                                    int64_t lines) {
  __m512 acc[MB][NP];
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  Spread<SKINNY512_PF_HINT> prefetch(pf, lines, K / 8);
  for (int64_t k = 0; k < K; k += 8) {
    prefetch.step();
    __m512 wv[NP];
#pragma GCC unroll 16
    for (int p = 0; p < NP; ++p) wv[p] = load8x2(w + 2 * p * K + k, w + (2 * p + 1) * K + k);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = broadcast8(x + m * K + k);
#pragma GCC unroll 16
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_fmadd_ps(wv[p], xv, acc[m][p]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int p = 0; p < NP; ++p) {
      const __m512d a = _mm512_castps_pd(acc[m][p]);
      y[m * ldy + 2 * p] = hsum(_mm256_castpd_ps(_mm512_castpd512_pd256(a)));
      y[m * ldy + 2 * p + 1] = hsum(_mm256_castpd_ps(_mm512_extractf64x4_pd(a, 1)));
    }
}

template <int NP, typename W>
SELFSPEC_AVX512 inline void tile512_rows(int mb, const float* x, const W* w, int64_t K, float* y, int64_t ldy,
                                         const char* pf, int64_t lines) {
  switch (mb) {
    case 6: tile512<6, NP, W>(x, w, K, y, ldy, pf, lines); break;
    case 5: tile512<5, NP, W>(x, w, K, y, ldy, pf, lines); break;
    case 4: tile512<4, NP, W>(x, w, K, y, ldy, pf, lines); break;
    case 3: tile512<3, NP, W>(x, w, K, y, ldy, pf, lines); break;
    case 2: tile512<2, NP, W>(x, w, K, y, ldy, pf, lines); break;
    default: tile512<1, NP, W>(x, w, K, y, ldy, pf, lines); break;
  }
}

constexpr int NP512 = SKINNY512_NP;  // pairs of weight rows per tile
constexpr int NR512 = 2 * NP512;     // weight rows per tile
static_assert(NP512 >= 1 && NP512 <= 4, "SKINNY512_NP: 1..4 pairs (6 x-rows x 4 pairs = 24 accumulators)");

// weight rows [b0 * NB, min(N, b1 * NB)) of one parallel task (a named function, not the lambda:
// a lambda does not inherit its enclosing function's target attribute)
template <typename W>
SELFSPEC_AVX512 void task512(const float* xp, const W* wp, float* yp, int64_t M, int64_t N, int64_t K, int64_t n,
                             int64_t n_end, int64_t lines_per_block) {
  const char* end = reinterpret_cast<const char*>(wp + n_end * K);
  for (; n + NR512 <= n_end; n += NR512) {
    const char* ahead = reinterpret_cast<const char*>(wp + (n + NR512 * SKINNY512_PD) * K);
    for (int64_t m0 = 0, b = 0; m0 < M; m0 += MB, ++b) {
      const auto pf = selfspec_prefetch::share(ahead, b, lines_per_block, end);
      tile512_rows<NP512, W>(static_cast<int>(std::min<int64_t>(MB, M - m0)), xp + m0 * K, wp + n * K, K,
                             yp + m0 * N + n, N, pf.from, pf.lines);
    }
  }
  for (; n + 2 <= n_end; n += 2)
    for (int64_t m0 = 0; m0 < M; m0 += MB)
      tile512_rows<1, W>(static_cast<int>(std::min<int64_t>(MB, M - m0)), xp + m0 * K, wp + n * K, K,
                         yp + m0 * N + n, N, nullptr, 0);
  for (; n < n_end; ++n)
    for (int64_t m0 = 0; m0 < M; m0 += MB)
      tile_rows<1, W>(static_cast<int>(std::min<int64_t>(MB, M - m0)), xp + m0 * K, wp + n * K, K, yp + m0 * N + n,
                      N, nullptr, 0);
}

template <typename W>
void run_avx512(const float* xp, const W* wp, float* yp, int64_t M, int64_t N, int64_t K) {
  constexpr int64_t NB = SKINNY_NB;  // weight rows per parallel task
  const int64_t lines_per_block =
      selfspec_prefetch::lines_per_block(NR512 * K * static_cast<int64_t>(sizeof(W)), (M + MB - 1) / MB);
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t b0, int64_t b1) {
    task512<W>(xp, wp, yp, M, N, K, b0 * NB, std::min(N, b1 * NB), lines_per_block);
  });
}

// Which path runs: chosen per call from the CPU's features (read once) and what skinny_isa last
// set ("auto": AVX-512 where the CPU has AVX-512F, for passes of avx512_rows rows or more or over
// avx512_k columns or more; "avx2"/"avx512": that path, for tests).
using selfspec_isa::cpu_has_avx512;
using selfspec_isa::kAuto;
using selfspec_isa::kAvx2;
using selfspec_isa::kAvx512;
std::atomic<int> isa_setting{kAuto};

// "auto" takes the AVX-512 path for passes of avx512_rows rows or more, and for every pass over
// weights of avx512_k columns or more (where avx512_k is not 0). Up to one block of x rows a pass is
// bound by the weights' stream, and there the AVX2 path was faster on a Xeon (SmolLM2 at 512
// context, 2 Sapphire Rapids cores, the paths alternating in one process, medians: 1 row 28.2
// against 31.7 ms, 6 rows 35.9 against 38.3); from two blocks on the arithmetic counts and AVX-512
// halves it (7 rows 38.5 against 36.1 ms, 16 rows 60.2 against 50.1, 32 rows 102.6 against 78.5;
// scripts/bench_kernel_paths.py): from 7 rows, no column rule. A Zen 4 (AMD family 0x19 with
// AVX-512; 2 cores, 2026-12-07) differs twice. Its AVX2 path's blocks of 5 and 6 rows run at their
// arithmetic's speed already (SmolLM2: 5 rows 23.6 against 22.3 ms, 6 rows 26.3 against 22.5, 4 a
// tie); and over weights of 1,024 columns or more the AVX-512 path is faster at every row count
// (each of its tiles reads the x rows, 4 KB each and more, for twice the weight rows): weights
// streamed from memory, 1 / 4 rows, 1536 x 1536 0.357 / 0.464 against 0.312 / 0.336 ms, 8960 x 1536
// 1.77 / 2.65 against 1.67 / 1.78, while 1536 x 576 stays the AVX2 path's at 1-4 rows (0.119 /
// 0.116 against 0.132 / 0.124). Qwen2.5-Coder-1.5B's step (1,536 and 8,960 columns) took 190 ms on
// the AVX2 path and 173 on the AVX-512 path, 4 rows 1.64 and 1.00 of that. So there: from 5 rows,
// and from 1,024 columns at any rows. skinny_crossover sets others (benchmarks, tests).
constexpr int64_t kXeonRows = MB + 1;
bool zen4() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx))
    return false;
  const bool amd = ebx == 0x68747541 && edx == 0x69746e65 && ecx == 0x444d4163;  // "AuthenticAMD"
  if (!amd || !__get_cpuid(1, &eax, &ebx, &ecx, &edx))
    return false;
  const unsigned base = (eax >> 8) & 0xf;
  const unsigned family = base + (base == 0xf ? (eax >> 20) & 0xff : 0);
  return family == 0x19;  // a Zen 3 too, which has no AVX-512 path to take
}
int64_t default_avx512_rows() { return zen4() ? 5 : kXeonRows; }
int64_t default_avx512_k() { return zen4() ? 1024 : 0; }
std::atomic<int64_t> avx512_rows{default_avx512_rows()};
std::atomic<int64_t> avx512_k{default_avx512_k()};

bool use_avx512(int64_t rows, int64_t k) {
  const int setting = isa_setting.load(std::memory_order_relaxed);
  if (setting != kAuto)
    return setting == kAvx512;
  const int64_t from_k = avx512_k.load(std::memory_order_relaxed);
  return (rows >= avx512_rows.load(std::memory_order_relaxed) || (from_k > 0 && k >= from_k)) && cpu_has_avx512();
}

// skinny_crossover(rows, k): where "auto" takes the AVX-512 path: from `rows` rows, and over weights
// of `k` columns or more at any rows (k = -2: no column rule). 0 leaves a value as it is, -1 restores
// this CPU's default; returns both as they are now, [rows, k] (k 0: no column rule).
std::vector<int64_t> skinny_crossover(int64_t rows, int64_t k) {
  TORCH_CHECK(rows >= -1, "skinny_crossover: rows >= 1, 0 (as it is) or -1 (this CPU's default), got ", rows);
  TORCH_CHECK(k >= -2, "skinny_crossover: k >= 1, 0 (as it is), -1 (this CPU's default) or -2 (no column rule), got ", k);
  if (rows == -1)
    avx512_rows.store(default_avx512_rows());
  else if (rows > 0)
    avx512_rows.store(rows);
  if (k == -1)
    avx512_k.store(default_avx512_k());
  else if (k == -2)
    avx512_k.store(0);
  else if (k > 0)
    avx512_k.store(k);
  return {avx512_rows.load(), avx512_k.load()};
}

// every caller of the kernel (skinny_linear, hence layer_walk through the dispatcher) comes here
template <typename W>
void run(const float* xp, const W* wp, float* yp, int64_t M, int64_t N, int64_t K) {
  if (use_avx512(M, K))
    run_avx512(xp, wp, yp, M, N, K);
  else
    run_avx2(xp, wp, yp, M, N, K);
}

// skinny_isa(mode): "auto", "avx2" or "avx512" sets the path skinny_linear takes ("avx512" needs
// AVX-512F), "" changes nothing; returns the path a call of many rows takes now: "avx2" or "avx512".
std::string skinny_isa(c10::string_view mode) {
  if (mode == "auto")
    isa_setting.store(kAuto);
  else if (mode == "avx2")
    isa_setting.store(kAvx2);
  else if (mode == "avx512") {
    TORCH_CHECK(cpu_has_avx512(), "skinny_isa: this CPU lacks AVX-512 (F, DQ, BW, VL); the AVX-512 path cannot run");
    isa_setting.store(kAvx512);
  } else
    TORCH_CHECK(mode.empty(), "skinny_isa: \"auto\", \"avx2\", \"avx512\" or \"\" (query), got \"",
                std::string(mode), "\"");
  return use_avx512(std::numeric_limits<int64_t>::max(), 0) ? "avx512" : "avx2";
}

const char* bf16_name(selfspec_bf16::Path path) {
  switch (path) {
    case selfspec_bf16::kDpbf16: return "avx512_bf16";
    case selfspec_bf16::kAmx: return "amx";
    case selfspec_bf16::kAmxEmulated: return "amx_emulated";
    default: return "widen";
  }
}

// skinny_bf16(mode): "auto", "widen", "avx512_bf16", "amx" or "amx_emulated" (the AMX path's code
// with the tile instructions done in software: tests) sets the path of bfloat16 linears, refusing
// one this CPU cannot run; "" changes nothing. Returns the path they take now.
std::string skinny_bf16(c10::string_view mode) {
  using namespace selfspec_bf16;
  if (mode == "auto") {
    choose(-1);
  } else if (!mode.empty()) {
    Path path;
    if (mode == "widen") path = kWiden;
    else if (mode == "avx512_bf16") path = kDpbf16;
    else if (mode == "amx") path = kAmx;
    else if (mode == "amx_emulated") path = kAmxEmulated;
    else TORCH_CHECK(false, "skinny_bf16: \"auto\", \"widen\", \"avx512_bf16\", \"amx\", \"amx_emulated\" or \"\" "
                     "(query), got \"", std::string(mode), "\"");
    TORCH_CHECK(supported(path), "skinny_bf16: this CPU cannot run the ", std::string(mode), " path",
                path == kAmx ? " (no AMX-BF16, or the OS did not grant tile data)" : " (no AVX-512-BF16)");
    choose(path);
  }
  return bf16_name(current());
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
  if (bf16) {
    const selfspec_bf16::Path path = selfspec_bf16::current();
    if (path != selfspec_bf16::kWiden) {  // bfloat16 products on the dot-product units, float32 sums
      const at::Tensor x = x_in.reshape({-1, K}).contiguous();
      const int64_t M = x.size(0);
      at::Tensor y = at::empty({M, N}, x.options());
      selfspec_bf16::linear(path, x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                            y.data_ptr<at::BFloat16>(), M, N, K);
      return y.view(out_shape);
    }
  }
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

namespace selfspec_isa {
Isa setting() { return static_cast<Isa>(isa_setting.load(std::memory_order_relaxed)); }
bool cpu_has_avx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  }();
  return has;
}
}  // namespace selfspec_isa

TORCH_LIBRARY(selfspec, m) {
  m.def("skinny_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("skinny_isa(str mode) -> str", &skinny_isa);
  m.def("skinny_crossover(int rows, int k) -> int[]", &skinny_crossover);
  m.def("skinny_bf16(str mode) -> str", &skinny_bf16);
}
TORCH_LIBRARY_IMPL(selfspec, CPU, m) { m.impl("skinny_linear", &skinny_linear); }
