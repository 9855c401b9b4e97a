// PyTorch's own conversions between a Python `torch.Tensor` and a C++ `at::Tensor` (tch's
// C_tensor), from libtorch_python: no copy, the same tensor, autograd graph included. Called with
// the GIL held, after `import torch`.

#include <torch/csrc/autograd/python_variable.h>

#include "trainerd_shim.h"

extern "C" {

// A new reference to a Python tensor that is `t`; null with a Python error set on failure.
PyObject *tdp_wrap(at::Tensor *t) {
  try {
    return THPVariable_Wrap(*t);
  } catch (const std::exception &e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// A new at::Tensor that is the Python tensor `o`; null when `o` is not a tensor.
at::Tensor *tdp_unpack(PyObject *o) {
  if (!THPVariable_Check(o)) {
    return nullptr;
  }
  return new at::Tensor(THPVariable_Unpack(o));
}

} // extern "C"
