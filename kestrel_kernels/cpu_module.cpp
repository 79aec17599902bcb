// The Python module of the CPU kernels (built by kestrel_kernels/cpu_build.py).
#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_1_linear", &q4_1_linear, "x [M, K] float32 @ Q4_1 weights^T -> [M, N] float32");
  m.def("q8_0_linear", &q8_0_linear, "x [M, K] float32 @ the first rows of Q8_0 weights^T -> [M, rows] float32");
  m.def("set_q4_isa", &set_q4_isa, "the block kernels' code products: 'auto' (VNNI where present) or 'avx2'");
  m.def("q4_isa", &q4_isa, "the block kernels' instruction set in use: 'avxvnni', 'avx512vnni' or 'avx2'");
  m.def("quantize_activations", &quantize_activations, "x [M, K] -> (q int8, scale, scale * sum(q)), in input order");
  m.def("paged_attention", &paged_attention, "attention of q [T, H, D] over paged K/V -> [T, H, D] float32");
  m.def("add_rmsnorm", &add_rmsnorm, "(rmsnorm(x + residual) * weight, x + residual)");
  m.def("rope", &rope, "x [T, heads, D] rotated by cos, sin [T, D]");
  pybind11::class_<PackedStack>(m, "PackedStack")
      .def(pybind11::init<std::vector<torch::Tensor>, torch::Tensor, int64_t, int64_t, int64_t, double>())
      .def("forward", &PackedStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "a decode or verify forward of the decoder layers -> [normed hidden, aux...]");
  m.def("silu_and_mul", &silu_and_mul, "gate_up [T, 2I] -> silu(gate) * up [T, I]");
}
