// A walk of Llama-layout decoder layers over the few rows of a decoding step or verification
// pass, as one operator: per layer the same operators, with the same inputs and in the same order,
// as the runtime's Python layer (selfspec.models.layered: LayeredModel.attention and .mlp with the
// CPU operators), called from here instead of from Python.
//
// Why: a one-token step of a small model launches ~25 tensor operations per layer from Python;
// on 2 CPU cores SmolLM2-135M's 30 layers spent ~4 ms of a ~24 ms step launching them (the same
// walk with negligible weights took 4.3 ms). The arithmetic is unchanged, so every output is
// bit-identical to the Python walk (tests/test_runtime.py checks it).
//
// Per layer i of `layers`: x = rms_norm(h, norm1[i]); q|k|v = skinny_linear(x, qkv[i]), split,
// viewed as heads and transposed; q, k = rotary(q, k, cos, sin); k and v written to the layer's
// cache at [start, start + n); attention of q over the cache's first start + n keys
// (rowwise_attention, under `allowed` when given); h += skinny_linear(attention, out[i]);
// x = rms_norm(h, norm2[i]); gate|up = skinny_linear(x, gate_up[i]), split;
// h += skinny_linear(silu(gate) * up, down[i]). After layer keep_layers[j], the last keep[j].size(0)
// rows of h are copied into keep[j] (early exit's exit-query states, DEL's shadow-token states: the
// `keep` of LayeredModel.run_layers). A layer in skip_attn (skip_mlp) leaves its attention (MLP)
// sublayer out, and then its cache too (Draft & Verify's drafting with a skip set).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace {

using Linear = at::Tensor(const at::Tensor&, const at::Tensor&);
using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double, bool);
using Rotary = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&);
using Attention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double);

template <typename F>
c10::TypedOperatorHandle<F> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

at::Tensor layer_walk(const at::Tensor& h_in, at::IntArrayRef layers, at::TensorList norm1, at::TensorList qkv,
                      at::TensorList out, at::TensorList norm2, at::TensorList gate_up, at::TensorList down,
                      at::TensorList keys, at::TensorList values, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& allowed, int64_t start, int64_t head_dim, double eps, double scaling,
                      at::IntArrayRef keep_layers, at::TensorList keep, at::IntArrayRef skip_attn,
                      at::IntArrayRef skip_mlp) {
  static const auto linear = op<Linear>("selfspec::skinny_linear");
  static const auto norm = op<Norm>("selfspec::rms_norm");
  static const auto rotary = op<Rotary>("selfspec::rotary");
  static const auto attention = op<Attention>("selfspec::rowwise_attention");
  TORCH_CHECK(h_in.dim() == 3 && h_in.size(0) == 1, "layer_walk: h is [1, n, d]");
  const int64_t n = h_in.size(1);
  TORCH_CHECK(keep_layers.size() == keep.size(), "layer_walk: one kept-state buffer per kept layer");
  at::Tensor h = h_in;
  size_t kept = 0, no_attn = 0, no_mlp = 0;  // keep_layers, skip_attn and skip_mlp follow the walk's order
  for (const int64_t i : layers) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(qkv.size()), "layer_walk: layer ", i, " out of range");
    const int64_t kv_size = keys[i].size(1) * head_dim;
    const int64_t q_size = qkv[i].size(0) - 2 * kv_size;
    const bool attend = !(no_attn < skip_attn.size() && skip_attn[no_attn] == i);
    const bool mlp = !(no_mlp < skip_mlp.size() && skip_mlp[no_mlp] == i);
    no_attn += !attend;
    no_mlp += !mlp;
    if (attend) {  // attention sublayer
      const at::Tensor x = norm.call(h, norm1[i], eps, false);
      const auto parts = linear.call(x, qkv[i]).split_with_sizes({q_size, kv_size, kv_size}, -1);
      const at::Tensor q = parts[0].view({1, n, -1, head_dim}).transpose(1, 2);
      const at::Tensor k = parts[1].view({1, n, -1, head_dim}).transpose(1, 2);
      const at::Tensor v = parts[2].view({1, n, -1, head_dim}).transpose(1, 2);
      const auto [q_rot, k_rot] = rotary.call(q, k, cos, sin);
      keys[i].narrow(2, start, n).copy_(k_rot);
      values[i].narrow(2, start, n).copy_(v);
      const at::Tensor attended = attention.call(q_rot, keys[i].narrow(2, 0, start + n),
                                                 values[i].narrow(2, 0, start + n), allowed, scaling)
                                      .transpose(1, 2)
                                      .contiguous();
      h = h + linear.call(attended.reshape({1, n, -1}).contiguous(), out[i]);
    }
    if (mlp) {  // MLP sublayer
      const auto gu = linear.call(norm.call(h, norm2[i], eps, false), gate_up[i]).split(gate_up[i].size(0) / 2, -1);
      h = h + linear.call(at::silu(gu[0]) * gu[1], down[i]);
    }
    if (kept < keep_layers.size() && keep_layers[kept] == i) {
      const at::Tensor& out = keep[kept++];
      TORCH_CHECK(out.size(0) <= n, "layer_walk: keeps at most the pass's rows");
      out.copy_(h[0].narrow(0, n - out.size(0), out.size(0)));
    }
  }
  TORCH_CHECK(kept == keep_layers.size() && no_attn == skip_attn.size() && no_mlp == skip_mlp.size(),
              "layer_walk: a kept or skipped layer is not walked, or not in the walk's order");
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(selfspec, m) {
  m.def(
      "layer_walk(Tensor h, int[] layers, Tensor[] norm1, Tensor[] qkv, Tensor[] out, Tensor[] norm2, "
      "Tensor[] gate_up, Tensor[] down, Tensor[] keys, Tensor[] values, Tensor cos, Tensor sin, Tensor allowed, "
      "int start, int head_dim, float eps, float scaling, int[] keep_layers, Tensor[] keep, int[] skip_attn, int[] skip_mlp) -> Tensor");
}
TORCH_LIBRARY_IMPL(selfspec, CPU, m) { m.impl("layer_walk", &layer_walk); }
