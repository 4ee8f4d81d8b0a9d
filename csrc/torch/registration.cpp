// The dspark_C operator library (dspark_simt in the SIMT build). Each op's launcher (csrc/torch/<op>.cu) declares its schema (a
// TORCH_LIBRARY_FRAGMENT, mutation declared) and its implementation next to its argument checks; this file only
// creates the namespace and, in the ahead-of-time GPU build, the Python module `dspark_kernels._C`.
#include "common.h"

#define DSPARK_LIBRARY_(ns, m) TORCH_LIBRARY(ns, m)
DSPARK_LIBRARY_(DSPARK_TORCH_LIBRARY, m) {}

#if defined(TORCH_EXTENSION_NAME) && !defined(DSPARK_SIMT)
#include <Python.h>
// An empty Python module, so that `import dspark_kernels._C` (the ahead-of-time build) works; loading the
// shared object runs the registrations. The JIT build loads the library with torch.ops.load_library.
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
