// pybind11 bindings of the emulator self-test (selftest_kernels.cu): _cuda_emu_selftest.
#include <pybind11/pybind11.h>

#include "selftest.h"

namespace py = pybind11;
namespace selftest = pagedserve_emu_selftest;

PYBIND11_MODULE(_cuda_emu_selftest, m) {
  m.def("neighbour", &selftest::neighbour);
  m.def("warp_ops", &selftest::warp_ops);
  m.def("divergent_shuffle", &selftest::divergent_shuffle);
  m.def("shuffle_after_exit", &selftest::shuffle_after_exit);
  m.def("barrier_in_one_warp", &selftest::barrier_in_one_warp);
  m.def("read_unwritten_shared", &selftest::read_unwritten_shared);
  m.def("launch_config", &selftest::launch_config);
  m.def("strided_loads", &selftest::strided_loads);
  m.def("convert", &selftest::convert);
}
