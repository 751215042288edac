// bfloat16 linears on a CPU's bfloat16 dot-product units: y = x @ W^T for bfloat16 x and W, float32
// accumulation, with the rows of a pass independent of one another by construction.
//
// Why: widening each bfloat16 weight to float32 and multiplying with float32 FMAs (the skinny
// kernel's AVX2 and AVX-512 paths) halves the bytes a step reads, but not the arithmetic of a pass of
// k rows, so a bfloat16 verification pass costs more steps' worth than a float32 one. The CPUs' own
// bfloat16 instructions do twice (VDPBF16PS, AVX-512-BF16) or many times (TDPBF16PS, AMX) the
// products per instruction.
//
// Row independence. Each output element y[m][n] has one float32 accumulator. K is walked in blocks
// of 32 values, in order; each block adds its 32 products x[m][k] * W[n][k] to the accumulator by
// the path's instruction (VDPBF16PS: 16 float32 lanes, each adding two products per instruction,
// then one fixed reduction of the 16 lanes; TDPBF16PS: one lane per element, adding the block's
// products in the instruction's order). Nothing in that sequence depends on M, on which rows share a
// tile, or on the thread that runs it: the tile shapes, blocks of rows and tasks only decide which
// elements are computed together. So row i of an M-row pass equals a one-row step on row i, bit for
// bit, and a bfloat16 verification pass sees exactly what one-token decoding would. The two paths
// (and the widening path) give different bits from each other; a process takes one of them for
// every row count (skinny_linear.cpp).
//
// Layouts. Both paths read W as the model holds it (row-major [N, K], one copy). The AVX-512-BF16
// path multiplies 32 values of a weight row with 32 values of an x row per instruction. The AMX path
// computes y^T: a tile of 16 weight rows by 32 values is TDPBF16PS's first operand as it lies in
// memory (a row stride of K), and x^T is packed per call into the pairs its second operand reads
// (16 rows of k-pairs by 16 columns of x rows; a pass of M rows takes ceil(M / 16) such tiles, the
// unused columns zero). Rows of W beyond the last 16-row tile, and every row of a W whose K is not a
// multiple of 32, take the AVX-512-BF16 path (every AMX CPU has it), decided by the shape alone.
//
// AMX needs the kernel's permission to use tile data (Linux: arch_prctl ARCH_REQ_XCOMP_PERM),
// asked once per process by supported(kAmx). kAmxEmulated runs the AMX path's code with each tile
// instruction done in software by the rules the hardware checks (tests run it on every CPU; it is
// slow and never chosen by auto).
#include "bf16_dot.h"

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "avx2.h"
#include "prefetch.h"

#ifndef BF16_NB
#define BF16_NB 48  // weight rows per parallel task (AVX-512-BF16 path)
#endif
#ifndef BF16_PD
// AVX-512-BF16 path: tiles of weight rows prefetched ahead, into L2 (BF16_PF_HINT). Into L1 4 tiles
// ahead measured 4 against 1 and 2 on 2 Zen 5 cores (SmolLM2's linears, built in turns three times:
// one row 8.0-9.0 against 8.6-9.6 ms, eight rows 9.1-9.6 against 10.1-12.0 ms); into L2 8 tiles
// ahead against that, on 2 Zen 4 cores (4 rounds in turns): eight rows 10.6-12.4 against 13.8-17.6 ms,
// one row the same (docs/2026-12-01-bfloat16-on-the-cpu.md). A prefetch does no arithmetic: the bits
// are the same at every distance and hint.
#define BF16_PD 8
#endif
#ifndef BF16_PF_HINT
#define BF16_PF_HINT _MM_HINT_T1
#endif
#ifndef AMX_PF
#define AMX_PF 4  // AMX path: blocks of 32 values of K prefetched ahead in each weight row (0: none)
#endif

namespace selfspec_bf16 {
namespace {

using BF16 = at::BFloat16;

#define SELFSPEC_DPBF16 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512bf16")))
#define SELFSPEC_AMX __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512bf16,amx-tile,amx-bf16")))

// ---------------------------------------------------------------------------------------------
// AVX-512-BF16: VDPBF16PS

SELFSPEC_DPBF16 inline __m512bh load32(const BF16* p) { return (__m512bh)_mm512_loadu_si512(p); }
// the first values of p that `mask` selects, the others zero (the last, short block of K)
SELFSPEC_DPBF16 inline __m512bh load32(const BF16* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// the 16 lanes' sum in a fixed order: the two halves added lane by lane, then avx2.h's hsum
SELFSPEC_DPBF16 inline float sum16(__m512 v) {
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return selfspec_avx2::hsum(_mm256_add_ps(lo, hi));
}

// MB rows of x times NR rows of W: MB * NR accumulators of 16 lanes held in registers; meanwhile
// `lines` cache lines from `pf` on (a later tile's weight rows) are prefetched, spread over K (prefetch.h).
template <int MB, int NR>
SELFSPEC_DPBF16 inline void dp_tile(const BF16* x, const BF16* w, int64_t K, BF16* y, int64_t ldy, const char* pf,
                                    int64_t lines) {
  __m512 acc[MB][NR];
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  selfspec_prefetch::Spread<BF16_PF_HINT> prefetch(pf, lines, (K + 31) / 32);
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    prefetch.step();
    __m512bh wv[NR];
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) wv[r] = load32(w + r * K + k);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = load32(x + m * K + k);
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  }
  if (k < K) {  // 8, 16 or 24 values left: the same instruction with the missing values zero
    const __mmask32 mask = static_cast<__mmask32>((1u << (K - k)) - 1u);
    __m512bh wv[NR];
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) wv[r] = load32(w + r * K + k, mask);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = load32(x + m * K + k, mask);
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) y[m * ldy + r] = BF16(sum16(acc[m][r]));  // rounded as torch rounds
}

template <int NR>
SELFSPEC_DPBF16 inline void dp_tile_rows(int mb, const BF16* x, const BF16* w, int64_t K, BF16* y, int64_t ldy,
                                         const char* pf, int64_t lines) {
  switch (mb) {
    case 8: dp_tile<8, NR>(x, w, K, y, ldy, pf, lines); break;
    case 7: dp_tile<7, NR>(x, w, K, y, ldy, pf, lines); break;
    case 6: dp_tile<6, NR>(x, w, K, y, ldy, pf, lines); break;
    case 5: dp_tile<5, NR>(x, w, K, y, ldy, pf, lines); break;
    case 4: dp_tile<4, NR>(x, w, K, y, ldy, pf, lines); break;
    case 3: dp_tile<3, NR>(x, w, K, y, ldy, pf, lines); break;
    case 2: dp_tile<2, NR>(x, w, K, y, ldy, pf, lines); break;
    default: dp_tile<1, NR>(x, w, K, y, ldy, pf, lines); break;
  }
}

// Weight rows [n, n_end) against all M rows of x: tiles of NR weight rows, each read from memory once
// and reused from L1 for every block of up to MB rows of x, the tile BF16_PD tiles ahead prefetched
// meanwhile; then the leftover rows one at a time. A block of 6 rows against 4 weight rows holds 24
// accumulators, 4 weight vectors and one x vector (29 of the 32 registers); a pass of one or two rows
// takes 8 weight rows a tile (more loads in flight while the weights stream).
template <int MB, int NR>
SELFSPEC_DPBF16 void dp_task(const BF16* x, const BF16* w, BF16* y, int64_t M, int64_t N, int64_t K, int64_t n,
                             int64_t n_end) {
  const int64_t lines_per_block = selfspec_prefetch::lines_per_block(NR * K * 2, (M + MB - 1) / MB);
  const char* end = reinterpret_cast<const char*>(w + n_end * K);
  for (; n + NR <= n_end; n += NR) {
    const char* ahead = reinterpret_cast<const char*>(w + (n + NR * BF16_PD) * K);
    for (int64_t m0 = 0, b = 0; m0 < M; m0 += MB, ++b) {
      const auto pf = selfspec_prefetch::share(ahead, b, lines_per_block, end);
      dp_tile_rows<NR>(static_cast<int>(std::min<int64_t>(MB, M - m0)), x + m0 * K, w + n * K, K, y + m0 * N + n, N,
                       pf.from, pf.lines);
    }
  }
  for (; n < n_end; ++n)
    for (int64_t m0 = 0; m0 < M; m0 += MB)
      dp_tile_rows<1>(static_cast<int>(std::min<int64_t>(MB, M - m0)), x + m0 * K, w + n * K, K, y + m0 * N + n, N,
                      nullptr, 0);
}

// weight rows [n0, n1) by VDPBF16PS, split into parallel tasks of BF16_NB rows
void dp_rows(const BF16* x, const BF16* w, BF16* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  constexpr int64_t NB = BF16_NB;
  at::parallel_for(0, (n1 - n0 + NB - 1) / NB, 1, [&](int64_t b0, int64_t b1) {
    const int64_t n = n0 + b0 * NB, n_end = std::min(n1, n0 + b1 * NB);
    if (M <= 2)
      dp_task<2, 4>(x, w, y, M, N, K, n, n_end);
    else if (M <= 8)
      dp_task<8, 3>(x, w, y, M, N, K, n, n_end);
    else
      dp_task<6, 4>(x, w, y, M, N, K, n, n_end);
  });
}

// ---------------------------------------------------------------------------------------------
// AMX-BF16: TDPBF16PS

// the tile configuration LDTILECFG reads (palette 1)
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// The tiles the AMX path uses: C0..C3 accumulate y^T for 4 blocks of 16 weight rows by 16 x rows
// (float32); B holds a block of packed x^T (16 k-pairs by 16 x rows); A0 and A1 take turns holding a
// block of 16 weight rows by 32 values of K. Every tile is 16 rows of 64 bytes.
enum Tile : int { C0 = 0, C1 = 1, C2 = 2, C3 = 3, B = 4, A0 = 5, A1 = 6 };
constexpr int kTiles = 7;

TileConfig tile_config() {
  TileConfig c;
  for (int t = 0; t < kTiles; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  return c;
}

// The tile instructions, in hardware. Each takes its tile numbers as template arguments: the
// intrinsics take them as literals.
struct Hardware {
  SELFSPEC_AMX static void configure(const TileConfig* c) { _tile_loadconfig(c); }
  SELFSPEC_AMX static void release() { _tile_release(); }
  template <int T>
  SELFSPEC_AMX static void zero() {
    if constexpr (T == C0) _tile_zero(0);
    else if constexpr (T == C1) _tile_zero(1);
    else if constexpr (T == C2) _tile_zero(2);
    else if constexpr (T == C3) _tile_zero(3);
    else static_assert(T == C0, "only the accumulators are zeroed");
  }
  template <int T>
  SELFSPEC_AMX static void load(const void* p, int64_t stride) {
    if constexpr (T == B) _tile_loadd(4, p, stride);
    else if constexpr (T == A0) _tile_loadd(5, p, stride);
    else if constexpr (T == A1) _tile_loadd(6, p, stride);
    else static_assert(T == B, "only the operands are loaded");
  }
  template <int T>
  SELFSPEC_AMX static void store(void* p, int64_t stride) {
    if constexpr (T == C0) _tile_stored(0, p, stride);
    else if constexpr (T == C1) _tile_stored(1, p, stride);
    else if constexpr (T == C2) _tile_stored(2, p, stride);
    else if constexpr (T == C3) _tile_stored(3, p, stride);
    else static_assert(T == C0, "only the accumulators are stored");
  }
  template <int C, int A>
  SELFSPEC_AMX static void dot() {  // C += A . B
    static_assert(A == A0 || A == A1, "the first operand is a weight tile");
    if constexpr (C == C0 && A == A0) _tile_dpbf16ps(0, 5, 4);
    else if constexpr (C == C0) _tile_dpbf16ps(0, 6, 4);
    else if constexpr (C == C1 && A == A0) _tile_dpbf16ps(1, 5, 4);
    else if constexpr (C == C1) _tile_dpbf16ps(1, 6, 4);
    else if constexpr (C == C2 && A == A0) _tile_dpbf16ps(2, 5, 4);
    else if constexpr (C == C2) _tile_dpbf16ps(2, 6, 4);
    else if constexpr (C == C3 && A == A0) _tile_dpbf16ps(3, 5, 4);
    else _tile_dpbf16ps(3, 6, 4);
  }
};

// The tile instructions in software, for tests on CPUs without AMX: the state is per thread, as the
// hardware's; each instruction checks what the hardware checks (a configured palette 1, a tile's
// rows and bytes per row within 16 x 64, the operands' shapes agreeing) and raises where the
// hardware would fault. Products as TDPBF16PS defines them: each bfloat16 widened to float32
// (denormals read as zero), each product added to the element's accumulator in K's order, round to
// nearest even, denormal results flushed to zero.
struct Emulated {
  struct State {
    bool configured = false;
    TileConfig config;
    alignas(64) uint8_t tiles[8][16 * 64];
  };
  static State& state() {
    static thread_local State s;
    return s;
  }
  static void configure(const TileConfig* c) {
    TORCH_CHECK(c->palette == 1 && c->start_row == 0, "emulated AMX: LDTILECFG faults: palette 1, start_row 0");
    for (int t = 0; t < 16; ++t)
      TORCH_CHECK(c->rows[t] <= 16 && c->colsb[t] <= 64 && (t < 8 || (c->rows[t] == 0 && c->colsb[t] == 0)),
                  "emulated AMX: LDTILECFG faults: tile ", t, " is ", int(c->rows[t]), " x ", c->colsb[t]);
    State& s = state();
    s.config = *c;
    s.configured = true;
    std::memset(s.tiles, 0, sizeof(s.tiles));
  }
  static void release() { state().configured = false; }
  static void check(int t) {
    const State& s = state();
    TORCH_CHECK(s.configured, "emulated AMX: a tile instruction before LDTILECFG (#UD)");
    TORCH_CHECK(s.config.rows[t] && s.config.colsb[t], "emulated AMX: tile ", t, " is not configured (#UD)");
  }
  template <int T>
  static void zero() {
    check(T);
    std::memset(state().tiles[T], 0, sizeof(state().tiles[T]));
  }
  template <int T>
  static void load(const void* p, int64_t stride) {
    check(T);
    State& s = state();
    std::memset(s.tiles[T], 0, sizeof(s.tiles[T]));
    for (int r = 0; r < s.config.rows[T]; ++r)
      std::memcpy(s.tiles[T] + r * 64, static_cast<const uint8_t*>(p) + r * stride, s.config.colsb[T]);
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    check(T);
    const State& s = state();
    for (int r = 0; r < s.config.rows[T]; ++r)
      std::memcpy(static_cast<uint8_t*>(p) + r * stride, s.tiles[T] + r * 64, s.config.colsb[T]);
  }
  static float widen(uint16_t v) {
    if ((v & 0x7f80u) == 0) v &= 0x8000u;  // denormals are zero
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  static float flush(float f) { return std::fpclassify(f) == FP_SUBNORMAL ? std::copysign(0.f, f) : f; }
  template <int C, int A>
  static void dot() {
    check(C), check(A), check(B);
    State& s = state();
    const TileConfig& c = s.config;
    TORCH_CHECK(c.colsb[A] / 4 == c.rows[B] && c.colsb[C] == c.colsb[B] && c.rows[C] == c.rows[A] &&
                    c.colsb[A] % 4 == 0 && c.colsb[C] % 4 == 0,
                "emulated AMX: TDPBF16PS faults on these shapes (#UD)");
    float* dst = reinterpret_cast<float*>(s.tiles[C]);
    const uint16_t* a = reinterpret_cast<const uint16_t*>(s.tiles[A]);
    const uint16_t* b = reinterpret_cast<const uint16_t*>(s.tiles[B]);
    for (int m = 0; m < c.rows[C]; ++m)
      for (int k = 0; k < c.colsb[A] / 4; ++k)
        for (int n = 0; n < c.colsb[C] / 4; ++n) {
          float acc = dst[m * 16 + n];
          acc = flush(acc + widen(a[m * 32 + 2 * k]) * widen(b[k * 32 + 2 * n]));
          acc = flush(acc + widen(a[m * 32 + 2 * k + 1]) * widen(b[k * 32 + 2 * n + 1]));
          dst[m * 16 + n] = acc;
        }
  }
};

// x^T packed for TDPBF16PS's second operand: for each block j of 16 rows of x and each block kb of
// 32 values of K, 16 rows (k-pairs p) of 16 pairs (x[16j + c][32kb + 2p], x[16j + c][32kb + 2p + 1]),
// zero for rows of x past M: 1 KiB a block, the blocks of one j consecutive in kb.
std::vector<BF16> pack_columns(const BF16* x, int64_t M, int64_t K) {
  const int64_t column_blocks = (M + 15) / 16, k_blocks = K / 32;
  std::vector<BF16> packed(column_blocks * k_blocks * 512, BF16(0.f));
  for (int64_t m = 0; m < M; ++m) {
    BF16* out = packed.data() + (m / 16) * k_blocks * 512 + (m % 16) * 2;
    for (int64_t k = 0; k < K; k += 2) {
      BF16* pair = out + (k / 32) * 512 + ((k % 32) / 2) * 32;
      pair[0] = x[m * K + k];
      pair[1] = x[m * K + k + 1];
    }
  }
  return packed;
}

// Weight rows [n, n + 16 * NT) (NT blocks of 16) against all of x: per block j of 16 x rows, NT
// accumulator tiles over every block of K in order (B loaded once per block of K, the weight tiles
// alternating between A0 and A1), then stored and written into y (transposed). The weight rows of
// the next AMX_PF blocks of K are prefetched meanwhile.
template <class T, int NT>
SELFSPEC_AMX void amx_rows(const BF16* packed, const BF16* w, BF16* y, int64_t M, int64_t N, int64_t K, int64_t n) {
  static_assert(NT >= 1 && NT <= 4, "4 accumulator tiles");
  const int64_t k_blocks = K / 32, stride = K * 2;
  alignas(64) float c[4][16 * 16];
  for (int64_t j = 0; j * 16 < M; ++j) {
    T::template zero<C0>();
    if constexpr (NT > 1) T::template zero<C1>();
    if constexpr (NT > 2) T::template zero<C2>();
    if constexpr (NT > 3) T::template zero<C3>();
    const BF16* bj = packed + j * k_blocks * 512;
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      if (AMX_PF > 0 && j == 0 && kb + AMX_PF < k_blocks)
        for (int64_t r = 0; r < 16 * NT; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (n + r) * K + (kb + AMX_PF) * 32), _MM_HINT_T0);
      T::template load<B>(bj + kb * 512, 64);
      const BF16* wk = w + n * K + kb * 32;
      T::template load<A0>(wk, stride);
      T::template dot<C0, A0>();
      if constexpr (NT > 1) {
        T::template load<A1>(wk + 16 * K, stride);
        T::template dot<C1, A1>();
      }
      if constexpr (NT > 2) {
        T::template load<A0>(wk + 32 * K, stride);
        T::template dot<C2, A0>();
      }
      if constexpr (NT > 3) {
        T::template load<A1>(wk + 48 * K, stride);
        T::template dot<C3, A1>();
      }
    }
    T::template store<C0>(c[0], 64);
    if constexpr (NT > 1) T::template store<C1>(c[1], 64);
    if constexpr (NT > 2) T::template store<C2>(c[2], 64);
    if constexpr (NT > 3) T::template store<C3>(c[3], 64);
    // c[t][r * 16 + col] = y[16j + col][n + 16t + r]
    for (int64_t col = 0; col < 16 && j * 16 + col < M; ++col)
      for (int t = 0; t < NT; ++t)
        for (int r = 0; r < 16; ++r) y[(j * 16 + col) * N + n + 16 * t + r] = BF16(c[t][r * 16 + col]);
  }
}

// the AMX path over every weight row in whole blocks of 16 (tasks of 64 rows, the last one shorter);
// the rows after the last whole block by VDPBF16PS
template <class T>
void amx_linear(const BF16* x, const BF16* w, BF16* y, int64_t M, int64_t N, int64_t K) {
  const std::vector<BF16> packed = pack_columns(x, M, K);
  const int64_t blocks = N / 16, tasks = (blocks + 3) / 4;
  static const TileConfig config = tile_config();
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    T::configure(&config);  // tile state is per thread
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * 64;
      switch (std::min<int64_t>(4, blocks - t * 4)) {
        case 4: amx_rows<T, 4>(packed.data(), w, y, M, N, K, n); break;
        case 3: amx_rows<T, 3>(packed.data(), w, y, M, N, K, n); break;
        case 2: amx_rows<T, 2>(packed.data(), w, y, M, N, K, n); break;
        default: amx_rows<T, 1>(packed.data(), w, y, M, N, K, n); break;
      }
    }
    T::release();
  });
  if (blocks * 16 < N) dp_rows(x, w, y, M, N, K, blocks * 16, N);
}

// ---------------------------------------------------------------------------------------------
// What the CPU has

struct Cpuid {
  unsigned a = 0, b = 0, c = 0, d = 0;
};
Cpuid cpuid(unsigned leaf, unsigned sub) {
  Cpuid r;
  if (!__get_cpuid_count(leaf, sub, &r.a, &r.b, &r.c, &r.d)) r = Cpuid{};
  return r;
}
uint64_t xcr0() {
  if (!(cpuid(1, 0).c & (1u << 27))) return 0;  // OSXSAVE
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

bool has_dpbf16() {
  static const bool has = [] {
    const Cpuid l7 = cpuid(7, 0), l71 = cpuid(7, 1);
    const uint64_t x = xcr0();
    const bool os_zmm = (x & 0xe6) == 0xe6;  // SSE, AVX, opmask and both halves of the ZMM state
    const bool f = l7.b & (1u << 16), dq = l7.b & (1u << 17), bw = l7.b & (1u << 30);
    return os_zmm && f && dq && bw && (l71.a & (1u << 5));  // AVX512_BF16: CPUID.(7,1):EAX[5]
  }();
  return has;
}

bool has_amx() {
  static const bool has = [] {
    const Cpuid l7 = cpuid(7, 0);
    const bool tile = l7.d & (1u << 24), bf16 = l7.d & (1u << 22);
    if (!tile || !bf16 || !has_dpbf16()) return false;
    if ((xcr0() & (3u << 17)) != (3u << 17)) return false;  // the OS saves XTILECFG and XTILEDATA
    // Linux grants tile data per process on request (ARCH_REQ_XCOMP_PERM = 0x1023, XTILEDATA = 18)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return has;
}

}  // namespace

namespace {
std::atomic<int> setting{-1};  // -1: auto
}  // namespace

Path current() {
  const int chosen = setting.load(std::memory_order_relaxed);
  if (chosen >= 0) return static_cast<Path>(chosen);
  static const Path automatic = supported(kAmx) ? kAmx : (supported(kDpbf16) ? kDpbf16 : kWiden);
  return automatic;
}

void choose(int path) { setting.store(path, std::memory_order_relaxed); }

bool supported(Path path) {
  switch (path) {
    case kWiden: return true;
    case kDpbf16: return has_dpbf16();
    case kAmx: return has_amx();
    case kAmxEmulated: return has_dpbf16();  // its leftover rows take the AVX-512-BF16 path
  }
  return false;
}

void linear(Path path, const BF16* x, const BF16* w, BF16* y, int64_t M, int64_t N, int64_t K) {
  TORCH_CHECK(path != kWiden && supported(path), "bf16_dot: path ", int(path), " cannot run on this CPU");
  TORCH_CHECK(K % 8 == 0, "bf16_dot: K must be a multiple of 8, got ", K);
  if (path == kDpbf16 || K % 32 != 0) {
    dp_rows(x, w, y, M, N, K, 0, N);
  } else if (path == kAmx) {
    amx_linear<Hardware>(x, w, y, M, N, K);
  } else {
    amx_linear<Emulated>(x, w, y, M, N, K);
  }
}

}  // namespace selfspec_bf16
