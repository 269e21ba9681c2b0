// The Python module of saker's CPU kernels (app/engine/cpu_kernels.py builds it).
#include <torch/extension.h>

#include "lanes.h"

bool attention_supports(int64_t head_dim);
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor tables,
                              torch::Tensor which, torch::Tensor lo, torch::Tensor hi, double scale);
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales, bool wide);
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales, torch::Tensor mins, bool wide);
torch::Tensor log_softmax(torch::Tensor x);
torch::Tensor sample_tokens(torch::Tensor scores, torch::Tensor greedy, torch::Tensor temperature, torch::Tensor top_k,
                            torch::Tensor top_p, torch::Tensor log_min_p, torch::Tensor seeds, torch::Tensor steps);
torch::Tensor argmax_rows(torch::Tensor scores);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool in_order);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                                      double eps, bool in_order);
torch::Tensor rotary_write(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                           torch::Tensor keys, torch::Tensor values, torch::Tensor write);

void bind_layers(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_layers(m);
  m.def("paged_attention", &paged_attention, "fixed-order float32 attention over the block pool");
  m.def("attention_supports", &attention_supports, "whether a head dim is built");
  m.def("int8_linear", &int8_linear, "x @ (int8 w * scales).T in float32, fixed order");
  m.def("int4_linear", &int4_linear, "x @ int4 W.T by int16 x int4 dot products per group of 32, float32 out, fixed order");
  m.def("wide_supported", &saker::wide_supported, "whether this CPU runs the linears' AVX-512 paths");
  m.def("rms_norm", &rms_norm, "transformers' RMSNorm per row, to the bit (its mean of squares PyTorch's)");
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(residual + x), residual + x)");
  m.def("rotary_write", &rotary_write, "q and k rotated by position; k and v written at their pool slots");
  m.def("log_softmax", &log_softmax, "each row's log-softmax, its normaliser summed in float64, fixed order");
  m.def("argmax_rows", &argmax_rows, "each row's first argmax (torch.argmax's answer), the rows over the threads");
  m.def("sample_tokens", &sample_tokens, "each row's token: argmax, or temperature, top-k, top-p, min-p and the draw");
}
