// The kernels' entry points, one declaration each: the Python module binds them (bindings.cpp) and the decoder
// layers' call chains them (decoder_layers.cpp).
#pragma once

#include <torch/extension.h>

#include <tuple>
#include <vector>

bool attention_supports(int64_t head_dim);
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor tables,
                              torch::Tensor which, torch::Tensor lo, torch::Tensor hi, double scale);
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales, bool wide);
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales, torch::Tensor mins, bool wide);
std::vector<torch::Tensor> int4_linears(torch::Tensor x, const std::vector<torch::Tensor>& specs, bool wide);
torch::Tensor log_softmax(torch::Tensor x);
torch::Tensor sample_tokens(torch::Tensor scores, torch::Tensor greedy, torch::Tensor temperature, torch::Tensor top_k,
                            torch::Tensor top_p, torch::Tensor log_min_p, torch::Tensor seeds, torch::Tensor steps);
torch::Tensor argmax_rows(torch::Tensor scores);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool in_order);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                                      double eps, bool in_order);
torch::Tensor rotary_write(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                           torch::Tensor keys, torch::Tensor values, torch::Tensor write);
