// The prefetch schedule of the tiled linear kernels (skinny_linear.cpp's AVX2 and AVX-512 paths,
// bf16_dot.cpp's AVX-512-BF16 path). Each thread walks its weight rows in tiles; while a tile
// multiplies the blocks of x rows, the tile some distance ahead is prefetched, a share of it during
// each block (share), and each block's share spread over the steps of its K loop (Spread), so that
// memory streams the weight rows a later tile needs while this one computes. Nothing at or past the
// end of the task's weight rows is prefetched. A prefetch does no arithmetic: the schedule, its
// distance and its cache hint change no output bit.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace selfspec_prefetch {

constexpr int64_t kLine = 64;  // bytes of a cache line

// the cache lines each block of x rows prefetches: a tile of `tile_bytes` bytes shared out over
// `blocks` blocks
inline int64_t lines_per_block(int64_t tile_bytes, int64_t blocks) {
  return ((tile_bytes + kLine - 1) / kLine + blocks - 1) / blocks;
}

// block b's share of the tile that starts at `ahead`: `lines` cache lines from `from` on, at most
// `per_block` of them, none at or past `end`
struct Share {
  const char* from;
  int64_t lines;
};
inline Share share(const char* ahead, int64_t b, int64_t per_block, const char* end) {
  const char* from = ahead + b * per_block * kLine;
  return {from, std::max<int64_t>(0, std::min<int64_t>(per_block, (end - from) / kLine))};
}

// a share spread over `steps` steps of a K loop: each step() prefetches the next
// ceil(lines / steps) of its lines (at the end, those left), with the cache hint `Hint`
template <int Hint>
struct Spread {
  const char* from;
  int64_t lines;
  int64_t per_step;
  int64_t line = 0;
  Spread(const char* from_, int64_t lines_, int64_t steps)
      : from(from_), lines(lines_), per_step((lines_ + steps - 1) / steps) {}
  __attribute__((always_inline)) inline void step() {
    for (int64_t p = 0; p < per_step && line < lines; ++p, ++line)
      _mm_prefetch(from + line * kLine, static_cast<decltype(_MM_HINT_T0)>(Hint));
  }
};

}  // namespace selfspec_prefetch
