// A walk of Llama-layout decoder layers over the few rows of a decoding step or verification
// pass (or of several sequences' such passes at once: a batch), as one operator: per layer the same operators, with the same inputs and in the same order,
// as the runtime's Python layer (selfspec.models.layered: LayeredModel.attention and .mlp with the
// CPU operators), called from here instead of from Python.
//
// Why: a one-token step of a small model launches ~25 tensor operations per layer from Python;
// on 2 CPU cores SmolLM2-135M's 30 layers spent ~4 ms of a ~24 ms step launching them (the same
// walk with negligible weights took 4.3 ms). A batch of B sequences called each sequence's attention
// from Python, B calls a layer. The arithmetic is unchanged, so every output is bit-identical to the
// Python walk (tests/test_runtime.py and tests/test_batch.py check it).
//
// Per layer i of `layers`: x = rms_norm(h, norm1[i]); q|k|v = skinny_linear(x, qkv[i]) (+ qkv_bias[i] where
// the model has q/k/v biases: Qwen2; `qkv_bias` is empty where it has none), split,
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

// Rows [bounds[b], bounds[b + 1]) of h belong to sequence b of a batch (one sequence: bounds {0, n}).
// Each sequence has its own cache (keys[b * L + i], values[b * L + i] for layer i of L), rotary
// tables, mask (`allowed`; empty for one row without a mask) and cached length `starts[b]`; the
// norms and linears run over every sequence's rows at once, in blocks of at most `block` rows, and
// the attention runs each sequence's rows over its own cache. The linear kernel's rows do not depend
// on the block (skinny_linear.cpp), so each row equals the one its sequence's walk alone computes.
at::Tensor layer_walk(const at::Tensor& h_in, at::IntArrayRef bounds, at::IntArrayRef layers, at::TensorList norm1,
                      at::TensorList qkv, at::TensorList qkv_bias, at::TensorList out, at::TensorList norm2, at::TensorList gate_up,
                      at::TensorList down, at::TensorList keys, at::TensorList values, at::TensorList cos,
                      at::TensorList sin, at::TensorList allowed, at::IntArrayRef starts, int64_t head_dim,
                      double eps, double scaling, int64_t block, at::IntArrayRef keep_layers,
                      at::IntArrayRef keep_seqs, at::TensorList keep, at::IntArrayRef skip_attn,
                      at::IntArrayRef skip_mlp) {
  static const auto linear_op = op<Linear>("selfspec::skinny_linear");
  static const auto quant_op = op<Linear>("selfspec::quant_linear");
  static const auto norm = op<Norm>("selfspec::rms_norm");
  static const auto rotary = op<Rotary>("selfspec::rotary");
  static const auto attention = op<Attention>("selfspec::rowwise_attention");
  TORCH_CHECK(h_in.dim() == 3 && h_in.size(0) == 1, "layer_walk: h is [1, n, d]");
  const int64_t n = h_in.size(1), L = static_cast<int64_t>(qkv.size());
  const int64_t B = static_cast<int64_t>(bounds.size()) - 1;
  TORCH_CHECK(B >= 1 && bounds[0] == 0 && bounds[B] == n, "layer_walk: bounds split h's rows into sequences");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == B * L && static_cast<int64_t>(values.size()) == B * L &&
                  static_cast<int64_t>(cos.size()) == B && static_cast<int64_t>(sin.size()) == B &&
                  static_cast<int64_t>(allowed.size()) == B && static_cast<int64_t>(starts.size()) == B,
              "layer_walk: one cache (a key and a value per layer), rotary table, mask and start per sequence");
  TORCH_CHECK(keep_layers.size() == keep.size() && keep_seqs.size() == keep.size(),
              "layer_walk: one kept-state buffer per kept layer and sequence");
  TORCH_CHECK(block >= 1, "layer_walk: blocks of at least one row");
  TORCH_CHECK(qkv_bias.empty() || static_cast<int64_t>(qkv_bias.size()) == L,
              "layer_walk: a q/k/v bias for every layer, or none");
  // x @ W^T over every row, in blocks of at most `block` rows; a quantised copy of W (int8, uint8 or int16 packed
  // rows, selfspec.models.quantised: a draft's weights) through its own kernel, whose rows never depend on
  // the call's
  const auto linear = [&](const at::Tensor& x, const at::Tensor& w) {
    if (w.scalar_type() == at::kChar || w.scalar_type() == at::kByte || w.scalar_type() == at::kShort)
      return quant_op.call(x, w);
    if (x.size(1) <= block) return linear_op.call(x, w);
    std::vector<at::Tensor> parts;
    for (const at::Tensor& rows : x.split(block, 1)) parts.push_back(linear_op.call(rows.contiguous(), w));
    return at::cat(parts, 1);
  };
  at::Tensor h = h_in;
  size_t kept = 0, no_attn = 0, no_mlp = 0;  // keep_layers, skip_attn and skip_mlp follow the walk's order
  for (const int64_t i : layers) {
    TORCH_CHECK(i >= 0 && i < L, "layer_walk: layer ", i, " out of range");
    const int64_t kv_size = keys[i].size(1) * head_dim;
    const int64_t q_size = qkv[i].size(0) - 2 * kv_size;
    const bool attend = !(no_attn < skip_attn.size() && skip_attn[no_attn] == i);
    const bool mlp = !(no_mlp < skip_mlp.size() && skip_mlp[no_mlp] == i);
    no_attn += !attend;
    no_mlp += !mlp;
    if (attend) {  // attention sublayer
      const at::Tensor x = norm.call(h, norm1[i], eps, false);
      // the bias added after the product, as the Python walk's linear adds it (selfspec.models.kernels.linear)
      const at::Tensor qkv_out = qkv_bias.empty() ? linear(x, qkv[i]) : linear(x, qkv[i]) + qkv_bias[i];
      const auto parts = qkv_out.split_with_sizes({q_size, kv_size, kv_size}, -1);
      std::vector<at::Tensor> attended;
      attended.reserve(B);
      for (int64_t b = 0; b < B; ++b) {  // each sequence's rows over its own cache
        const int64_t a = bounds[b], m = bounds[b + 1] - a, start = starts[b];
        const at::Tensor q = parts[0].narrow(1, a, m).view({1, m, -1, head_dim}).transpose(1, 2);
        const at::Tensor k = parts[1].narrow(1, a, m).view({1, m, -1, head_dim}).transpose(1, 2);
        const at::Tensor v = parts[2].narrow(1, a, m).view({1, m, -1, head_dim}).transpose(1, 2);
        const auto [q_rot, k_rot] = rotary.call(q, k, cos[b], sin[b]);
        const at::Tensor& key = keys[b * L + i];
        const at::Tensor& value = values[b * L + i];
        key.narrow(2, start, m).copy_(k_rot);
        value.narrow(2, start, m).copy_(v);
        attended.push_back(attention.call(q_rot, key.narrow(2, 0, start + m), value.narrow(2, 0, start + m),
                                          allowed[b], scaling)
                               .transpose(1, 2)
                               .reshape({1, m, -1}));
      }
      const at::Tensor all = B == 1 ? attended[0].contiguous() : at::cat(attended, 1);
      h = h + linear(all, out[i]);
    }
    if (mlp) {  // MLP sublayer
      const auto gu = linear(norm.call(h, norm2[i], eps, false), gate_up[i]).split(gate_up[i].size(0) / 2, -1);
      h = h + linear(at::silu(gu[0]) * gu[1], down[i]);
    }
    for (; kept < keep_layers.size() && keep_layers[kept] == i; ++kept) {
      const at::Tensor& to = keep[kept];
      const int64_t b = keep_seqs[kept];
      TORCH_CHECK(b >= 0 && b < B && to.size(0) <= bounds[b + 1] - bounds[b],
                  "layer_walk: keeps at most its sequence's rows");
      to.copy_(h[0].narrow(0, bounds[b + 1] - to.size(0), to.size(0)));
    }
  }
  TORCH_CHECK(kept == keep_layers.size() && no_attn == skip_attn.size() && no_mlp == skip_mlp.size(),
              "layer_walk: a kept or skipped layer is not walked, or not in the walk's order");
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(selfspec, m) {
  m.def(
      "layer_walk(Tensor h, int[] bounds, int[] layers, Tensor[] norm1, Tensor[] qkv, Tensor[] qkv_bias, Tensor[] out, "
      "Tensor[] norm2, "
      "Tensor[] gate_up, Tensor[] down, Tensor[] keys, Tensor[] values, Tensor[] cos, Tensor[] sin, "
      "Tensor[] allowed, int[] starts, int head_dim, float eps, float scaling, int block, int[] keep_layers, "
      "int[] keep_seqs, Tensor[] keep, int[] skip_attn, int[] skip_mlp) -> Tensor");
}
TORCH_LIBRARY_IMPL(selfspec, CPU, m) { m.impl("layer_walk", &layer_walk); }
