// y = x @ W^T for a few rows of x, W a quantised copy of a weight (selfspec.models.quantised): the draft
// passes of a quantised self-draft (issue 69). On a memory-bound CPU a draft costs what it reads; these
// weights read a quarter (int8) or about a sixth (int4) of float32's bytes.
//
// Formats, one row of W per row of the packed tensor, in blocks of 32 values along K:
//   int8 (torch.int8, [N, K + K/8] bytes): the K values q (int8), then K/32 float32 scales s_b;
//        w[k] = s_b * q[k] for k in block b (Q8_0's rounding: s = amax/127).
//   int4 (torch.uint8, [N, K/2 + K/8] bytes): per pair of blocks (0 and 1, 2 and 3, ...) 32 bytes, byte j
//        holding the first block's value j in its low nibble and the second's in its high nibble (one load, two
//        masks: two blocks), each stored as q + 8 (q in [-7, 7]); a row's last block without a pair 16 bytes,
//        value j low and value j + 16 high; then the K/32 float32 scales (symmetric: s = amax/7).
//   q4_1 (torch.int16 holding [N, K/2 + K/4] bytes): the nibbles as int4's (in pairs of blocks), each q itself
//        (q in [0, 15]); then
//        the K/32 float32 scales s_b, then the K/32 float32 minimums m_b; w[k] = s_b * q[k] + m_b (llama.cpp's
//        Q4_1 scheme, with float32 scale and minimum).
//
// Integer dot products, as llama.cpp's quantised kernels do: each row of x is rounded per block of 32 to
// int8 with its own scale (s_x = amax/127, round half to even), each block's 32 products summed in int32
// lanes (exact), and the block's sum times s_w * s_x accumulated in float32 lanes by FMA over the blocks
// in order, then reduced by a fixed horizontal sum. For q4_1 (whose weights may be the target's own, exactly)
// each block of x is rounded in two int8 terms, s_x (128 q + q2) (about 15 bits of its largest value, where one
// term keeps 8: on SmolLM2 one term agreed with the target on 0.977 of greedy tokens), the block's integer sum
// 128 dot(q_w, q) + dot(q_w, q2), and m_b times the block's sum of x as rounded is added, one FMA lane per block,
// into the same accumulators. On the AVX2 path int8 weights go through the sign trick
// (|w| times x carrying w's sign: vpmaddubsw, which cannot saturate at |values| <= 127); on the VNNI path
// their bytes with the top bit flipped are the unsigned q + 128, and 128 times x's sums per lane are taken
// off (vpdpbusd cannot saturate); int4 weights are the unsigned nibbles q + 8, and 8 times x's sums per lane
// are taken off (exact). x may be float32 or bfloat16: y comes back in x's dtype, written by the kernel.
//
// Every output element's arithmetic is fixed by the weight's shape: a row's result does not depend on the
// other rows of the call or on the thread count, and the two paths (AVX2; AVX-512-VNNI where the CPU has
// it, one instruction for each block's integer sums) give the same bits, so a draft is the same on every
// CPU that runs it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "avx2.h"
#include "isa.h"
#include "prefetch.h"

namespace {

using selfspec_avx2::hsum;

constexpr int64_t QB = 32;  // values per block
constexpr int MB = 4;       // rows of x per block of the tile loop
#ifndef QNB
#define QNB 32
#endif
constexpr int64_t NB = QNB;  // weight rows per parallel task
#ifndef QPD
#define QPD 4  // tiles prefetched ahead
#endif
#ifndef QPF_HINT
#define QPF_HINT _MM_HINT_T0
#endif

// x rounded per block: q (int8, M x K), s (float, M x K/32) and, where an offset is to be taken off the
// integer sums, that factor times each block's 8 lane sums of 4 consecutive values (int32, M x K/4), where the
// sums start: -8 for the int4 format's nibbles q + 8, -128 for int8 values read as q + 128 (the VNNI path). In
// two terms (the q4_1 format's x): each block also rounded a second time, its remainder v - s q in steps of
// s/128 (q2, int8, M x K: |q2| <= 64), s then s/128 (so that x as rounded is s (128 q + q2)), and each block's
// sum of x as rounded for the minimums, s times 128 times the sum of q plus the sum of q2 (float, M x K/32; the
// integers exact).
struct Rounded {
  std::vector<int8_t> q, q2;
  std::vector<float> s;
  std::vector<int32_t> lane_sums, lane_sums2;  // lane_sums2: the second term's, times the same factor
  std::vector<float> block_sums;
};

constexpr int TWO_TERMS_SHIFT = 7;  // the second term's step: s / 2^7

// the 8 int32 lane sums of a block's 32 int8 values (4 consecutive values a lane)
inline __m256i lane_sums_of(const int8_t* q) {
  return _mm256_madd_epi16(
      _mm256_maddubs_epi16(_mm256_set1_epi8(1), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))),
      _mm256_set1_epi16(1));
}

inline int32_t total_of(__m256i lanes) {
  alignas(32) int32_t v[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(v), lanes);
  int32_t total = 0;
  for (int32_t x : v) total += x;
  return total;
}

// 32 int32 values (4 vectors of 8) as int8 in order, saturated
inline void store_packed(const __m256i* n, int8_t* q) {
  // the packs work per 128-bit half: groups of 4 values come out as 0 2 4 6 | 1 3 5 7
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(packed, order));
}

// s = amax/127 and q = v / s rounded half to even (vdivps and vcvtps2dq, exact-rounded: the scalar
// nearbyint(v / s) to the bit); in two terms, q2 = (v - s q) / (s/128) rounded the same way, v - s q by one
// FMA; x float32 or bfloat16 (widened exactly as it is read)
template <typename T>
Rounded round_rows(const T* x, int64_t M, int64_t K, int sum_factor, bool two_terms) {
  Rounded r;
  const int64_t blocks = M * K / QB;
  r.q.resize(M * K);
  r.s.resize(blocks);
  if (sum_factor) r.lane_sums.resize(M * K / 4);
  if (two_terms) {
    r.q2.resize(M * K);
    r.block_sums.resize(blocks);
    if (sum_factor) r.lane_sums2.resize(M * K / 4);
  }
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t i = 0; i < blocks; ++i) {
    const T* v = x + i * QB;
    __m256 a[4];
    for (int c = 0; c < 4; ++c) a[c] = selfspec_avx2::load8(v + 8 * c);
    const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float s = _mm_cvtss_f32(m4) / 127.f;
    const float s2 = s / static_cast<float>(1 << TWO_TERMS_SHIFT);  // exact: a power of two
    r.s[i] = two_terms ? s2 : s;
    int8_t* q = &r.q[i * QB];
    int8_t* q2 = two_terms ? &r.q2[i * QB] : nullptr;
    if (s > 0.f) {
      const __m256 sv = _mm256_set1_ps(s);
      __m256i n[4];
      for (int c = 0; c < 4; ++c) n[c] = _mm256_cvtps_epi32(_mm256_div_ps(a[c], sv));
      store_packed(n, q);
      if (two_terms) {
        const __m256 s2v = _mm256_set1_ps(s2);
        __m256i n2[4];
        for (int c = 0; c < 4; ++c)
          n2[c] = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_fnmadd_ps(sv, _mm256_cvtepi32_ps(n[c]), a[c]), s2v));
        store_packed(n2, q2);
      }
    } else {
      std::memset(q, 0, QB);
      if (two_terms) std::memset(q2, 0, QB);
    }
    if (!sum_factor && !two_terms) continue;
    const __m256i lane_sums = lane_sums_of(q);
    if (sum_factor)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&r.lane_sums[i * 8]),
                          _mm256_mullo_epi32(lane_sums, _mm256_set1_epi32(sum_factor)));
    if (!two_terms) continue;
    const __m256i lane_sums2 = lane_sums_of(q2);
    if (sum_factor)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&r.lane_sums2[i * 8]),
                          _mm256_mullo_epi32(lane_sums2, _mm256_set1_epi32(sum_factor)));
    // the integers exact, then one product
    r.block_sums[i] = s2 * static_cast<float>(total_of(lane_sums) * (1 << TWO_TERMS_SHIFT) + total_of(lane_sums2));
  }
  return r;
}

// the packed formats (module comment)
enum Fmt : int { kInt8 = 0, kInt4 = 1, kQ41 = 2 };
// whether a format's x is rounded in two terms: int8's and q4_1's, whose weights are close to the target's (or are
// them), so that one term's rounding would be most of what the draft gets wrong; int4's own rounding is far coarser
template <int F>
constexpr bool kTwoTerms = F != kInt4;

template <int F>
struct Layout {
  static constexpr bool Q4 = F != kInt8;  // nibbles
  int64_t K, stride, scales, mins;  // values per row, bytes per row, offsets of the scales and (q4_1) minimums
  explicit Layout(int64_t k)
      : K(k), stride(F == kInt8 ? k + k / 8 : (F == kInt4 ? k / 2 + k / 8 : k / 2 + k / 4)),
        scales(Q4 ? k / 2 : k), mins(k / 2 + k / 8) {}
  // nibble formats: block b (even) of a row as the unsigned operand (int4's q + 8, q4_1's q), value j in byte j,
  // and block b + 1 into `odd` from the same 32 bytes, its values in their high nibbles; a row's last block
  // without a pair (an odd block count) from 16 bytes, value j low and value j + 16 high
  __m256i pair(const uint8_t* row, int64_t b, __m256i& odd) const {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if (b + 1 < K / QB) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 16));
      odd = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      return _mm256_and_si256(bytes, low4);
    }
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), low4);
  }
  // int8 block b of a row as |q|, its signs in `sign` (the AVX2 path's sign trick)
  __m256i signed_block(const uint8_t* row, int64_t b, __m256i& sign) const {
    sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * QB));
    return _mm256_sign_epi8(sign, sign);  // |q|
  }
};

// The tile loop on each instruction set: AVX2's dot is vpmaddubsw then vpmaddwd; AVX-512-VNNI's (on its 256-bit
// form) is vpdpbusd, one instruction, the same exact int32 sums (neither saturates at |values| <= 127).
namespace avx2_path {
// vpmaddubsw's pair sums of (q + 128) x would saturate: int8 takes the sign trick here
constexpr bool kUnsignedInt8 = false;
inline __m256i dot(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
inline __m256i dot_from(__m256i c, __m256i u, __m256i s) { return _mm256_add_epi32(c, dot(u, s)); }
#include "quant_tiles.h"
}  // namespace avx2_path

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512dq,avx512bw,avx512vl,avx512vnni")
namespace vnni_path {
constexpr bool kUnsignedInt8 = true;
inline __m256i dot(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
// c plus the sums (vpdpbusd accumulates into its source)
inline __m256i dot_from(__m256i c, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(c, u, s); }
#include "quant_tiles.h"
}  // namespace vnni_path
#pragma GCC pop_options

// the VNNI path where the CPU has AVX-512-VNNI (with VL) and the runtime's AVX-512 paths are not switched
// off (torch.ops.selfspec.skinny_isa("avx2") runs this kernel's AVX2 path too)
bool use_vnni() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  }();
  return has && selfspec_isa::avx512();
}

template <int F, typename T>
void run(const T* xp, const uint8_t* w, T* y, int64_t M, int64_t N, int64_t K) {
  if (use_vnni())
    vnni_path::run_tiles<F>(xp, w, y, M, N, K);
  else
    avx2_path::run_tiles<F>(xp, w, y, M, N, K);
}

template <typename T>
at::Tensor run_as(const at::Tensor& x, const at::Tensor& packed, Fmt fmt, int64_t N, int64_t K) {
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* w = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  switch (fmt) {
    case kInt8: run<kInt8>(x.data_ptr<T>(), w, y.data_ptr<T>(), M, N, K); break;
    case kInt4: run<kInt4>(x.data_ptr<T>(), w, y.data_ptr<T>(), M, N, K); break;
    case kQ41: run<kQ41>(x.data_ptr<T>(), w, y.data_ptr<T>(), M, N, K); break;
  }
  return y;
}

// quant_path(): the path quant_linear takes now, "avx512_vnni" or "avx2"
std::string quant_path() { return use_vnni() ? "avx512_vnni" : "avx2"; }

at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& packed) {
  const auto dtype = packed.scalar_type();
  TORCH_CHECK(dtype == at::kChar || dtype == at::kByte || dtype == at::kShort, "quant_linear: an int8 (int8 format), "
              "uint8 (int4 format) or int16 (q4_1 format) packed weight");
  const Fmt fmt = dtype == at::kChar ? kInt8 : (dtype == at::kByte ? kInt4 : kQ41);
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous(), "quant_linear: a contiguous 2-D packed weight");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "quant_linear: float32 or bfloat16 x");
  const int64_t K = x_in.size(-1), N = packed.size(0);
  TORCH_CHECK(K % QB == 0, "quant_linear: in_features must be a multiple of 32, got ", K);
  const int64_t row_bytes = packed.size(1) * packed.element_size();
  const int64_t want = fmt == kInt8 ? K + K / 8 : (fmt == kInt4 ? K / 2 + K / 8 : K / 2 + K / 4);
  const char* name = fmt == kInt8 ? "int8" : (fmt == kInt4 ? "int4" : "q4_1");
  TORCH_CHECK(row_bytes == want, "quant_linear: a packed row of ", row_bytes, " bytes does not hold ", K,
              " values in the ", name, " format");
  auto out_shape = x_in.sizes().vec();
  out_shape.back() = N;
  // bfloat16 x is read and y written in bfloat16 by the kernel itself: the same bits as converting x to
  // float32 and the float32 result back (round to nearest even), without two tensors' copies a call
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const at::Tensor y = x.scalar_type() == at::kBFloat16 ? run_as<at::BFloat16>(x, packed, fmt, N, K)
                                                        : run_as<float>(x, packed, fmt, N, K);
  return y.view(out_shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(selfspec, m) {
  m.def("quant_linear(Tensor x, Tensor packed) -> Tensor");
  m.def("quant_path() -> str", &quant_path);
}
TORCH_LIBRARY_IMPL(selfspec, CPU, m) { m.impl("quant_linear", &quant_linear); }
