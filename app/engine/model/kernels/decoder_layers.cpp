// An int4 Llama-shaped model's decoder layers over one flat step in one call (app/engine/model/fused_forward.py,
// ``Plan.layers_call``): the same kernels in the same order as fused_forward's Python loop (products of one input
// grouped, each output the bits it has alone: tests/unit/test_cpu_kernels.py), so the same bits, without a Python
// call and a pybind crossing for each of a layer's dozen operations (on a 1-row step they cost more than the
// arithmetic of most of them).
//
// Per layer: (add_)rms_norm -> q, k, v int4 products (one ``int4_linears`` call: x quantized once, one parallel
// region) -> rotary_write -> paged_attention -> o product -> add_rms_norm -> silu(gate product) * up product (the two
// in one call) -> down product. The weights are gathered once (``Layers``); a step passes its own inputs and the
// pool's per-layer keys and values.
#include <torch/extension.h>

#include <tuple>
#include <vector>

#include "kernels.h"

namespace {
constexpr size_t PER_LAYER = 23;  // norm, q, k, v, o (3 each), norm, gate, up, down (3 each)
}

struct Layers {
  // weights: PER_LAYER tensors per layer in the order above, each product (packed, scales, mins); eps: the two
  // norms' per layer; head_dims, scales: each layer's attention's
  Layers(std::vector<torch::Tensor> weights, std::vector<double> eps, std::vector<int64_t> head_dims,
         std::vector<double> scales, bool in_order, bool wide)
      : weights(std::move(weights)), eps(std::move(eps)), head_dims(std::move(head_dims)), scales(std::move(scales)),
        in_order(in_order), wide(wide) {
    TORCH_CHECK(this->weights.size() == PER_LAYER * this->head_dims.size() &&
                    this->eps.size() == 2 * this->head_dims.size() && this->scales.size() == this->head_dims.size(),
                "one set of weights, two epsilons, a head dim and a scale per layer");
  }

  // hidden (T, width) float32, the embeddings; cos, sin (T, head dim); the step's spans and writes; keys, values the
  // pool's layers. Returns (hidden, residual) after the last layer, before the final norm.
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin,
                                                   torch::Tensor tables, torch::Tensor which, torch::Tensor lo,
                                                   torch::Tensor hi, torch::Tensor write,
                                                   const std::vector<torch::Tensor>& keys,
                                                   const std::vector<torch::Tensor>& values) const {
    const size_t layers = head_dims.size();
    TORCH_CHECK(keys.size() >= layers && values.size() >= layers, "the pool's keys and values for every layer");
    const int64_t count = hidden.size(0);
    torch::Tensor residual, x;
    auto product = [&](const torch::Tensor& in, size_t at) {
      return int4_linear(in, weights[at], weights[at + 1], weights[at + 2], wide);
    };
    for (size_t i = 0; i < layers; ++i) {
      const size_t w = i * PER_LAYER;
      if (i == 0) {
        x = rms_norm(hidden, weights[w], eps[2 * i], in_order);
        residual = hidden;
      } else {
        std::tie(x, residual) = add_rms_norm(hidden, residual, weights[w], eps[2 * i], in_order);
      }
      const int64_t hd = head_dims[i];
      const auto& W = weights;
      auto qkv = int4_linears(
          x, {W[w + 1], W[w + 2], W[w + 3], W[w + 4], W[w + 5], W[w + 6], W[w + 7], W[w + 8], W[w + 9]}, wide);
      auto q = qkv[0].view({count, -1, hd}), k = qkv[1].view({count, -1, hd}), v = qkv[2].view({count, -1, hd});
      q = rotary_write(q, k, v, cos, sin, keys[i], values[i], write);
      auto attended = paged_attention(q, keys[i], values[i], tables, which, lo, hi, scales[i]);
      hidden = product(attended.view({count, -1}), w + 10);
      std::tie(x, residual) = add_rms_norm(hidden, residual, weights[w + 13], eps[2 * i + 1], in_order);
      auto gate_up = int4_linears(x, {W[w + 14], W[w + 15], W[w + 16], W[w + 17], W[w + 18], W[w + 19]}, wide);
      hidden = product(at::silu(gate_up[0]).mul_(gate_up[1]), w + 20);
    }
    return {hidden, residual};
  }

  std::vector<torch::Tensor> weights;
  std::vector<double> eps;
  std::vector<int64_t> head_dims;
  std::vector<double> scales;
  bool in_order, wide;
};

void bind_layers(pybind11::module& m) {
  pybind11::class_<Layers>(m, "Layers")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<double>, std::vector<int64_t>, std::vector<double>,
                          bool, bool>())
      .def("forward", &Layers::forward, "every decoder layer over a flat step: (hidden, residual)",
           pybind11::call_guard<pybind11::gil_scoped_release>());  // nogil, as the kernels (bindings.cpp)
}
