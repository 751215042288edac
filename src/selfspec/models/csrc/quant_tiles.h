// The tile loop of quant_linear.cpp, included there once per instruction set: inside a namespace that
// defines dot(u, s) (8 int32 lanes, each the exact sum of 4 products u8 x s8) and under that set's target.
// Both sets' dot give the same integers, and everything after it is the same arithmetic, so the paths
// give the same bits. No include guard: it is meant to be included more than once.

// MBR rows of x times NR rows of W: MBR*NR float accumulators of 8 lanes
template <int MBR, int NR, bool Q4>
inline void tile(const Rounded& x, int64_t m0, const uint8_t* w, const Layout<Q4>& L, float* y, int64_t ldy,
                 bool pf) {
  __m256 acc[MBR][NR];
#pragma GCC unroll 8
  for (int m = 0; m < MBR; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  const int64_t K = L.K, blocks = K / QB;
  // the tile QPD tiles ahead, values and scales, each cache line once, spread over the blocks
  selfspec_prefetch::Spread<QPF_HINT> prefetch(reinterpret_cast<const char*>(w + QPD * NR * L.stride),
                                               pf ? (NR * L.stride + selfspec_prefetch::kLine - 1) / selfspec_prefetch::kLine : 0,
                                               blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch.step();
    __m256i xq[MBR];
#pragma GCC unroll 8
    for (int m = 0; m < MBR; ++m) xq[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&x.q[(m0 + m) * K + b * QB]));
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      __m256i sign;
      const uint8_t* row = w + r * L.stride;
      const __m256i u = L.unsigned_block(row, b, sign);
      const float sw = L.scale(row, b);
#pragma GCC unroll 8
      for (int m = 0; m < MBR; ++m) {
        const __m256i s = Q4 ? xq[m] : _mm256_sign_epi8(xq[m], sign);
        __m256i d = dot(u, s);
        if constexpr (Q4)  // the nibbles are q + 8: take 8 x's lane sums off
          d = _mm256_sub_epi32(d, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&x.sum4x8[((m0 + m) * blocks + b) * 8])));
        const __m256 scale = _mm256_set1_ps(sw * x.s[(m0 + m) * blocks + b]);
        acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), scale, acc[m][r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MBR; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) y[m * ldy + r] = hsum(acc[m][r]);
}

template <int NR, bool Q4>
inline void tile_rows(int mb, const Rounded& x, int64_t m0, const uint8_t* w, const Layout<Q4>& L, float* y,
                      int64_t ldy, bool pf) {
  switch (mb) {
    case 4: tile<4, NR, Q4>(x, m0, w, L, y, ldy, pf); break;
    case 3: tile<3, NR, Q4>(x, m0, w, L, y, ldy, pf); break;
    case 2: tile<2, NR, Q4>(x, m0, w, L, y, ldy, pf); break;
    default: tile<1, NR, Q4>(x, m0, w, L, y, ldy, pf); break;
  }
}

// weight rows per tile. Two rows, with the tile 4 ahead prefetched line by line, against the earlier four rows
// with each row's block 4 tiles ahead prefetched as it was read (its scales not), on 2 Zen 4 cores, all of
// SmolLM2's linear shapes, one row, medians of 15 per build, builds in turns: int8 4.8-5.7 against 7.2-8.0 ms
// (one thread 7.5-9.0 against 12.7-14.2), int4 3.8-4.7 against 4.1-5.1 (docs/2026-12-06-zen4.md).
constexpr int NR = 2;

template <bool Q4>
void task(const Rounded& x, const uint8_t* w, float* y, int64_t M, int64_t N, const Layout<Q4>& L, int64_t n,
          int64_t n_end) {
  for (; n + NR <= n_end; n += NR)
    for (int64_t m0 = 0; m0 < M; m0 += MB)  // the tile QPD tiles ahead prefetched during the first block of x
      tile_rows<NR, Q4>(static_cast<int>(std::min<int64_t>(MB, M - m0)), x, m0, w + n * L.stride, L,
                        y + m0 * N + n, N, m0 == 0 && n + (QPD + 1) * NR <= n_end);
  for (; n < n_end; ++n)
    for (int64_t m0 = 0; m0 < M; m0 += MB)
      tile_rows<1, Q4>(static_cast<int>(std::min<int64_t>(MB, M - m0)), x, m0, w + n * L.stride, L,
                       y + m0 * N + n, N, false);
}

template <bool Q4>
void run_tiles(const float* xp, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  const Layout<Q4> L(K);
  const Rounded x = round_rows(xp, M, K, Q4);
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t b0, int64_t b1) {
    const int64_t n = b0 * NB, n_end = std::min(N, b1 * NB);
    task<Q4>(x, w, y, M, N, L, n, n_end);
  });
}
