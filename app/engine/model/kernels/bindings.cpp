// The Python module of saker's CPU kernels (app/engine/cpu_kernels.py builds it).
#include <torch/extension.h>

#include "kernels.h"
#include "lanes.h"

void bind_layers(pybind11::module& m);

// The kernels that compute run without Python's interpreter lock (``nogil``): they touch no Python object (pybind11
// converts the arguments before and the result after), and the request threads' Python (HTTP, the output side) runs
// on the other cores meanwhile instead of waiting for the model's arithmetic.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const pybind11::call_guard<pybind11::gil_scoped_release> nogil;
  bind_layers(m);
  m.def("paged_attention", &paged_attention, "fixed-order float32 attention over the block pool", nogil);
  m.def("attention_supports", &attention_supports, "whether a head dim is built");
  m.def("int8_linear", &int8_linear, "x @ (int8 w * scales).T in float32, fixed order", nogil);
  m.def("int4_linear", &int4_linear, "x @ int4 W.T by int16 x int4 dot products per group of 32, float32 out, fixed order", nogil);
  m.def("int4_linears", &int4_linears, "int4_linear of several products of one x in one parallel region, each's bits", nogil);
  m.def("wide_supported", &saker::wide_supported, "whether this CPU runs the linears' AVX-512 paths");
  m.def("rms_norm", &rms_norm, "transformers' RMSNorm per row, to the bit (its mean of squares PyTorch's)", nogil);
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(residual + x), residual + x)", nogil);
  m.def("rotary_write", &rotary_write, "q and k rotated by position; k and v written at their pool slots", nogil);
  m.def("log_softmax", &log_softmax, "each row's log-softmax, its normaliser summed in float64, fixed order", nogil);
  m.def("argmax_rows", &argmax_rows, "each row's first argmax (torch.argmax's answer), the rows over the threads", nogil);
  m.def("sample_tokens", &sample_tokens, "each row's token: argmax, or temperature, top-k, top-p, min-p and the draw", nogil);
}
