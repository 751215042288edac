// y = x @ W^T for a few rows of x, W a quantised copy of a weight (selfspec.models.quantised): the draft
// passes of a quantised self-draft (issue 69). On a memory-bound CPU a draft costs what it reads; these
// weights read a quarter (int8) or about a sixth (int4) of float32's bytes.
//
// Formats, one row of W per row of the packed tensor, in blocks of 32 values along K:
//   int8 (torch.int8, [N, K + K/8] bytes): the K values q (int8), then K/32 float32 scales s_b;
//        w[k] = s_b * q[k] for k in block b (Q8_0's rounding: s = amax/127).
//   int4 (torch.uint8, [N, K/2 + K/8] bytes): per block 16 bytes, byte j holding the block's value j in
//        its low nibble and value j + 16 in its high nibble, each stored as q + 8 (q in [-7, 7]); then the
//        K/32 float32 scales (symmetric: s = amax/7).
//
// Integer dot products, as llama.cpp's quantised kernels do: each row of x is rounded per block of 32 to
// int8 with its own scale (s_x = amax/127, round half to even), each block's 32 products summed in int32
// lanes (exact), and the block's sum times s_w * s_x accumulated in float32 lanes by FMA over the blocks
// in order, then reduced by a fixed horizontal sum. On the AVX2 path int8 weights go through the sign trick
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
// integer sums, that factor times each block's 8 lane sums of 4 consecutive values (int32, M x K/4): 8 for the
// int4 format's nibbles q + 8, -128 for int8 values read as q + 128 (the VNNI path)
struct Rounded {
  std::vector<int8_t> q;
  std::vector<float> s;
  std::vector<int32_t> lane_sums;
};

// s = amax/127 and q = v / s rounded half to even (vdivps and vcvtps2dq, exact-rounded: the scalar
// nearbyint(v / s) to the bit); x float32 or bfloat16 (widened exactly as it is read)
template <typename T>
Rounded round_rows(const T* x, int64_t M, int64_t K, int sum_factor) {
  Rounded r;
  const int64_t blocks = M * K / QB;
  r.q.resize(M * K);
  r.s.resize(blocks);
  if (sum_factor) r.lane_sums.resize(M * K / 4);
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
    r.s[i] = s;
    int8_t* q = &r.q[i * QB];
    if (s > 0.f) {
      const __m256 sv = _mm256_set1_ps(s);
      __m256i n[4];
      for (int c = 0; c < 4; ++c) n[c] = _mm256_cvtps_epi32(_mm256_div_ps(a[c], sv));
      // the packs work per 128-bit half: groups of 4 values come out as 0 2 4 6 | 1 3 5 7
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(packed, order));
    } else {
      std::memset(q, 0, QB);
    }
    if (!sum_factor) continue;
    const __m256i lane_sums = _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_set1_epi8(1), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))),
        _mm256_set1_epi16(1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&r.lane_sums[i * 8]),
                        _mm256_mullo_epi32(lane_sums, _mm256_set1_epi32(sum_factor)));
  }
  return r;
}

template <bool Q4>
struct Layout {
  int64_t K, stride, scales;  // values per row, bytes per row, offset of the scales
  explicit Layout(int64_t k) : K(k), stride(Q4 ? k / 2 + k / 8 : k + k / 8), scales(Q4 ? k / 2 : k) {}
  float scale(const uint8_t* row, int64_t b) const {
    float s;
    std::memcpy(&s, row + scales + 4 * b, 4);
    return s;
  }
  // block b of a row as the unsigned operand: int8's |q| (its signs in `sign`), int4's nibbles q + 8
  __m256i unsigned_block(const uint8_t* row, int64_t b, __m256i& sign) const {
    if constexpr (Q4) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
      const __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
      return _mm256_set_m128i(hi, lo);
    } else {
      sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * QB));
      return _mm256_sign_epi8(sign, sign);  // |q|
    }
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

template <bool Q4, typename T>
void run(const T* xp, const uint8_t* w, T* y, int64_t M, int64_t N, int64_t K) {
  if (use_vnni())
    vnni_path::run_tiles<Q4>(xp, w, y, M, N, K);
  else
    avx2_path::run_tiles<Q4>(xp, w, y, M, N, K);
}

template <typename T>
at::Tensor run_as(const at::Tensor& x, const at::Tensor& packed, bool q4, int64_t N, int64_t K) {
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* w = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  if (q4)
    run<true>(x.data_ptr<T>(), w, y.data_ptr<T>(), M, N, K);
  else
    run<false>(x.data_ptr<T>(), w, y.data_ptr<T>(), M, N, K);
  return y;
}

// quant_path(): the path quant_linear takes now, "avx512_vnni" or "avx2"
std::string quant_path() { return use_vnni() ? "avx512_vnni" : "avx2"; }

at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& packed) {
  const bool q4 = packed.scalar_type() == at::kByte;
  TORCH_CHECK(q4 || packed.scalar_type() == at::kChar, "quant_linear: an int8 (int8 format) or uint8 (int4 format) "
              "packed weight");
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous(), "quant_linear: a contiguous 2-D packed weight");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "quant_linear: float32 or bfloat16 x");
  const int64_t K = x_in.size(-1), N = packed.size(0);
  TORCH_CHECK(K % QB == 0, "quant_linear: in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(packed.size(1) == (q4 ? K / 2 + K / 8 : K + K / 8), "quant_linear: a packed row of ", packed.size(1),
              " bytes does not hold ", K, " values in the ", q4 ? "int4" : "int8", " format");
  auto out_shape = x_in.sizes().vec();
  out_shape.back() = N;
  // bfloat16 x is read and y written in bfloat16 by the kernel itself: the same bits as converting x to
  // float32 and the float32 result back (round to nearest even), without two tensors' copies a call
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const at::Tensor y = x.scalar_type() == at::kBFloat16 ? run_as<at::BFloat16>(x, packed, q4, N, K)
                                                        : run_as<float>(x, packed, q4, N, K);
  return y.view(out_shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(selfspec, m) {
  m.def("quant_linear(Tensor x, Tensor packed) -> Tensor");
  m.def("quant_path() -> str", &quant_path);
}
TORCH_LIBRARY_IMPL(selfspec, CPU, m) { m.impl("quant_linear", &quant_linear); }
