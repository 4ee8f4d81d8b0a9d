// The dspark_C operator library: schemas first, then the CUDA implementations (one launcher .cu per op).
// Add a new op with one m.def line here, one m.impl line below, and its launcher in csrc/torch/<op>.cu.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#if defined(TORCH_EXTENSION_NAME)
#include <Python.h>
#endif

namespace dspark_torch {
void rng_uniform_(at::Tensor& out, const at::Tensor& rng_key, int64_t stream);
}  // namespace dspark_torch

TORCH_LIBRARY(dspark_C, m) {
  m.def("rng_uniform_(Tensor(a!) out, Tensor rng_key, int stream) -> ()");
}

TORCH_LIBRARY_IMPL(dspark_C, CUDA, m) {
  m.impl("rng_uniform_", &dspark_torch::rng_uniform_);
}

#if defined(TORCH_EXTENSION_NAME)
// An empty Python module, so that `import dspark_kernels._C` (the ahead-of-time build) works; loading the
// shared object runs the registrations above. The JIT build loads the library with torch.ops.load_library.
#define DSPARK_CONCAT_(a, b) a##b
#define DSPARK_CONCAT(a, b) DSPARK_CONCAT_(a, b)
#define DSPARK_STR_(x) #x
#define DSPARK_STR(x) DSPARK_STR_(x)
extern "C" PyObject* DSPARK_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, DSPARK_STR(TORCH_EXTENSION_NAME),
                                   "dspark_kernels CUDA ops (torch.ops.dspark_C)", -1, nullptr};
  return PyModule_Create(&def);
}
#endif
