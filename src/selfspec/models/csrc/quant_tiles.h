// The tile loop of quant_linear.cpp, included there once per instruction set: inside a namespace that
// defines dot(u, s) (8 int32 lanes, each the exact sum of 4 products u8 x s8) and under that set's target.
// Both sets' dot give the same integers, and everything after it is the same arithmetic, so the paths
// give the same bits. No include guard: it is meant to be included more than once.

// MBR rows of x times NR rows of W: MBR*NR float accumulators of 8 lanes. The blocks go in groups of 8: each
// row's 8 weight scales times each x row's 8 (one vector multiply, the same products as one at a time), each
// block's taken from its lane by a permute. An int8 block's integer sums: on the VNNI path its values with the
// top bit flipped (q + 128, unsigned) times x, started from -128 times x's lane sums, so no sign trick per x row;
// on the AVX2 path |q| times x carrying q's sign. The same integers either way. A nibble format's blocks are
// read in pairs, two blocks from one 32-byte load (Layout::pair): against a 16-byte load, two shifts and an
// insert per block, SmolLM2's linears in pass order took 0.88 (int4) and 0.92 (q4_1) of the time, the same bits
// (docs/2026-12-08-zen4.md). An int4 block's sums start from -8 times x's lane sums (its nibbles are q + 8).
// A q4_1 block's nibbles are q itself (no offset), times x's two terms (128 dot(u, q) + dot(u, q2): exact,
// |sums| < 2^21; the two products apart, as a chain through one accumulating product took 1.1 of the time),
// and each group of 8 blocks first adds its 8 minimums times x's 8 block sums (one FMA, lane j the group's
// block j) to the accumulators.
template <int MBR, int NR, int F, typename T>
inline void tile(const Rounded& x, int64_t m0, const uint8_t* w, const Layout<F>& L, T* y, int64_t ldy,
                 bool pf) {
  constexpr bool Q4 = Layout<F>::Q4;
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
  const float* xs = x.s.data();
  const int8_t* xq_all = x.q.data();
  const int8_t* xq2_all = x.q2.data();  // x's second term (int8, q4_1)
  const int32_t* lane_sums2 = x.lane_sums2.data();  // int8 on the VNNI path: -128 times the second term's lane sums
  const int32_t* lane_sums = x.lane_sums.data();  // int4: -8 times x's lane sums; int8: -128 times them
  for (int64_t b0 = 0; b0 < blocks; b0 += 8) {
    const int nb = static_cast<int>(std::min<int64_t>(8, blocks - b0));
    const __m256i in_group = _mm256_cmpgt_epi32(_mm256_set1_epi32(nb), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 scales[MBR][NR];
    __m256i odd_block[NR];  // nibble formats: block b + 1 of each row, unpacked from block b's pair (Layout::pair)
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m256 sw = _mm256_maskload_ps(reinterpret_cast<const float*>(w + r * L.stride + L.scales) + b0, in_group);
#pragma GCC unroll 8
      for (int m = 0; m < MBR; ++m)
        scales[m][r] = _mm256_mul_ps(sw, _mm256_maskload_ps(xs + (m0 + m) * blocks + b0, in_group));
      if constexpr (F == kQ41) {
        const __m256 mins = _mm256_maskload_ps(reinterpret_cast<const float*>(w + r * L.stride + L.mins) + b0, in_group);
#pragma GCC unroll 8
        for (int m = 0; m < MBR; ++m)
          acc[m][r] = _mm256_fmadd_ps(mins, _mm256_maskload_ps(x.block_sums.data() + (m0 + m) * blocks + b0, in_group),
                                      acc[m][r]);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      if (j >= nb) break;
      const int64_t b = b0 + j;
      prefetch.step();
      const __m256i lane = _mm256_set1_epi32(j);
      __m256i xq[MBR], xq2[MBR];
#pragma GCC unroll 8
      for (int m = 0; m < MBR; ++m) {
        xq[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq_all + (m0 + m) * K + b * QB));
        if constexpr (kTwoTerms<F>)
          xq2[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq2_all + (m0 + m) * K + b * QB));
      }
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        const uint8_t* row = w + r * L.stride;
        __m256i u, sign;
        if constexpr (Q4)
          u = (j & 1) ? odd_block[r] : L.pair(row, b, odd_block[r]);  // b0 is a multiple of 8: b is even at even j
        else if constexpr (!kUnsignedInt8)
          u = L.signed_block(row, b, sign);
        else
          u = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * QB)),
                               _mm256_set1_epi8(static_cast<char>(0x80)));
#pragma GCC unroll 8
        for (int m = 0; m < MBR; ++m) {
          // the block's integer sums over x's first term, and (two terms) 2^7 times them plus those over its second
          __m256i d;
          if constexpr (F == kQ41) {
            d = _mm256_add_epi32(_mm256_slli_epi32(dot(u, xq[m]), TWO_TERMS_SHIFT), dot(u, xq2[m]));
          } else if constexpr (F == kInt4) {
            const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane_sums + ((m0 + m) * blocks + b) * 8));
            d = dot_from(c, u, xq[m]);
          } else if constexpr (kUnsignedInt8) {
            const int64_t at = ((m0 + m) * blocks + b) * 8;
            const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane_sums + at));
            const __m256i c2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane_sums2 + at));
            d = _mm256_add_epi32(_mm256_slli_epi32(dot_from(c, u, xq[m]), TWO_TERMS_SHIFT), dot_from(c2, u, xq2[m]));
          } else {
            d = _mm256_add_epi32(_mm256_slli_epi32(dot(u, _mm256_sign_epi8(xq[m], sign)), TWO_TERMS_SHIFT),
                                 dot(u, _mm256_sign_epi8(xq2[m], sign)));
          }
          acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_permutevar8x32_ps(scales[m][r], lane), acc[m][r]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MBR; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) y[m * ldy + r] = static_cast<T>(hsum(acc[m][r]));
}

template <int NR, int F, typename T>
inline void tile_rows(int mb, const Rounded& x, int64_t m0, const uint8_t* w, const Layout<F>& L, T* y,
                      int64_t ldy, bool pf) {
  switch (mb) {
    case 4: tile<4, NR, F>(x, m0, w, L, y, ldy, pf); break;
    case 3: tile<3, NR, F>(x, m0, w, L, y, ldy, pf); break;
    case 2: tile<2, NR, F>(x, m0, w, L, y, ldy, pf); break;
    default: tile<1, NR, F>(x, m0, w, L, y, ldy, pf); break;
  }
}

// weight rows per tile. Two rows, with the tile 4 ahead prefetched line by line, against the earlier four rows
// with each row's block 4 tiles ahead prefetched as it was read (its scales not), on 2 Zen 4 cores, all of
// SmolLM2's linear shapes, one row, medians of 15 per build, builds in turns: int8 4.8-5.7 against 7.2-8.0 ms
// (one thread 7.5-9.0 against 12.7-14.2), int4 3.8-4.7 against 4.1-5.1 (docs/2026-12-06-zen4.md).
constexpr int NR = 2;

template <int F, typename T>
void task(const Rounded& x, const uint8_t* w, T* y, int64_t M, int64_t N, const Layout<F>& L, int64_t n,
          int64_t n_end) {
  for (; n + NR <= n_end; n += NR)
    for (int64_t m0 = 0; m0 < M; m0 += MB)  // the tile QPD tiles ahead prefetched during the first block of x
      tile_rows<NR, F>(static_cast<int>(std::min<int64_t>(MB, M - m0)), x, m0, w + n * L.stride, L,
                        y + m0 * N + n, N, m0 == 0 && n + (QPD + 1) * NR <= n_end);
  for (; n < n_end; ++n)
    for (int64_t m0 = 0; m0 < M; m0 += MB)
      tile_rows<1, F>(static_cast<int>(std::min<int64_t>(MB, M - m0)), x, m0, w + n * L.stride, L,
                       y + m0 * N + n, N, false);
}

template <int F, typename T>
void run_tiles(const T* xp, const uint8_t* w, T* y, int64_t M, int64_t N, int64_t K) {
  const Layout<F> L(K);
  const Rounded x = round_rows(xp, M, K, F == kInt4 ? -8 : (F == kInt8 && kUnsignedInt8 ? -128 : 0), kTwoTerms<F>);
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t b0, int64_t b1) {
    const int64_t n = b0 * NB, n_end = std::min(N, b1 * NB);
    task<F>(x, w, y, M, N, L, n, n_end);
  });
}
