// The elementwise pieces of a Llama-family decoder layer as one CPU operator each, with the
// arithmetic of transformers' own modules: a decoding step otherwise spends more time launching
// their ~20 small tensor operations per layer than computing them.
//
// rms_norm: LlamaRMSNorm (also Mistral's and Qwen2's): the mean of the squares in fp32, x times
// 1/sqrt(mean + eps), rounded to the input dtype, times the weight (rounded again). With
// unit_offset, Gemma3RMSNorm instead: the normalised x times (1 + weight), both in fp32, rounded
// once. Each row is one fixed instruction sequence, so a row's result does not depend on the
// other rows.
// rotary: apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, each product and the sum rounded
// to the dtype as torch rounds them (built with -ffp-contract=off: no fused multiply-add).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <cmath>

namespace {

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

template <typename T, bool UnitOffset>
void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t d, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    T* yr = y + r * d;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t j = 0;
    for (; j + 8 <= d; j += 8)
      for (int u = 0; u < 8; ++u) {
        const float v = static_cast<float>(xr[j + u]);
        acc[u] += v * v;
      }
    for (; j < d; ++j) {
      const float v = static_cast<float>(xr[j]);
      acc[0] += v * v;
    }
    const float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
    for (j = 0; j < d; ++j) {
      if constexpr (UnitOffset) {
        yr[j] = round_to<T>((static_cast<float>(xr[j]) * inv) * (1.f + static_cast<float>(w[j])));
      } else {
        const T normed = round_to<T>(static_cast<float>(xr[j]) * inv);
        yr[j] = round_to<T>(static_cast<float>(w[j]) * static_cast<float>(normed));
      }
    }
  }
}

template <typename T>
void rms_dispatch(const at::Tensor& x, const at::Tensor& weight, at::Tensor& y, int64_t rows, int64_t d, float eps,
                  bool unit_offset) {
  if (unit_offset)
    rms_rows<T, true>(x.data_ptr<T>(), weight.data_ptr<T>(), y.data_ptr<T>(), rows, d, eps);
  else
    rms_rows<T, false>(x.data_ptr<T>(), weight.data_ptr<T>(), y.data_ptr<T>(), rows, d, eps);
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps, bool unit_offset) {
  TORCH_CHECK((x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16) &&
                  weight.scalar_type() == x_in.scalar_type(),
              "rms_norm: float32 or bfloat16 x and weight, of one dtype");
  const int64_t d = weight.numel();
  TORCH_CHECK(x_in.size(-1) == d && weight.is_contiguous(), "rms_norm: weight of the last dimension's size");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t rows = x.numel() / d;
  if (x.scalar_type() == at::kBFloat16)
    rms_dispatch<at::BFloat16>(x, weight, y, rows, d, static_cast<float>(eps), unit_offset);
  else
    rms_dispatch<float>(x, weight, y, rows, d, static_cast<float>(eps), unit_offset);
  return y;
}

// x [1, H, n, D] (any strides), cos/sin [1, n, D] -> [1, H, n, D] contiguous
template <typename T>
void rotate(const at::Tensor& x, const T* cs, const T* sn, T* out) {
  const int64_t H = x.size(1), n = x.size(2), D = x.size(3), half = D / 2;
  const int64_t sh = x.stride(1), si = x.stride(2), sd = x.stride(3);
  const T* xp = x.data_ptr<T>();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n; ++i) {
      const T* xi = xp + h * sh + i * si;
      const T* c = cs + i * D;
      const T* s = sn + i * D;
      T* o = out + (h * n + i) * D;
      for (int64_t d = 0; d < D; ++d) {
        const float v = static_cast<float>(xi[d * sd]);
        const float rot = d < half ? -static_cast<float>(xi[(d + half) * sd]) : static_cast<float>(xi[(d - half) * sd]);
        const T a = round_to<T>(v * static_cast<float>(c[d]));
        const T b = round_to<T>(rot * static_cast<float>(s[d]));
        o[d] = round_to<T>(static_cast<float>(a) + static_cast<float>(b));
      }
    }
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos_in,
                                          const at::Tensor& sin_in) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && q.size(0) == 1 && k.size(0) == 1 && q.size(2) == k.size(2) &&
                  q.size(3) == k.size(3) && q.size(3) % 2 == 0,
              "rotary: q and k of shape [1, heads, n, head_dim]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos_in.scalar_type() == q.scalar_type() &&
                  sin_in.scalar_type() == q.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "rotary: float32 or bfloat16 q, k, cos, sin of one dtype");
  const int64_t n = q.size(2), D = q.size(3);
  const at::Tensor c = cos_in.reshape({n, D}).contiguous(), s = sin_in.reshape({n, D}).contiguous();
  at::Tensor qo = at::empty({1, q.size(1), n, D}, q.options()), ko = at::empty({1, k.size(1), n, D}, k.options());
  if (q.scalar_type() == at::kBFloat16) {
    rotate(q, c.data_ptr<at::BFloat16>(), s.data_ptr<at::BFloat16>(), qo.data_ptr<at::BFloat16>());
    rotate(k, c.data_ptr<at::BFloat16>(), s.data_ptr<at::BFloat16>(), ko.data_ptr<at::BFloat16>());
  } else {
    rotate(q, c.data_ptr<float>(), s.data_ptr<float>(), qo.data_ptr<float>());
    rotate(k, c.data_ptr<float>(), s.data_ptr<float>(), ko.data_ptr<float>());
  }
  return {qo, ko};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(selfspec, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset=False) -> Tensor");
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(selfspec, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
}
