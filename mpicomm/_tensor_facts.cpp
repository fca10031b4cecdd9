// The fast path's remembered-call check in one C call (python -m mpicomm.build_native builds it).
//
// same(t, address, nbytes, dtype) is True when t's memory starts at address and holds nbytes,
// its dtype is dtype, and it is contiguous, on the CPU and without torch's negative bit; False
// otherwise (also when torch raises reading a fact: the general path then reports it).
// same2(a, b, address_a, address_b, nbytes_a, nbytes_b, dtype) is same() of both tensors.
// Each fact is read with the C++ accessor torch's own Python getter calls (Tensor.data_ptr(),
// .nbytes, .dtype, .is_contiguous(), .is_cpu, .is_neg()), so the answers are theirs, without
// six trips through the interpreter and torch's argument parser per tensor.
#include <Python.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

bool same_one(PyObject* t, void* address, size_t nbytes, c10::ScalarType dtype) noexcept {
  try {
    const at::Tensor& x = THPVariable_Unpack(t);
    return x.is_cpu() && !x.is_neg() && x.is_contiguous() && x.scalar_type() == dtype &&
        x.nbytes() == nbytes && x.data_ptr() == address;
  } catch (...) {
    return false;
  }
}

bool is_tensor(PyObject* t) {
  return THPVariableClass != nullptr && PyObject_TypeCheck(t, (PyTypeObject*)THPVariableClass);
}

// One tensor's arguments: false with a Python error set when one has the wrong type.
bool unpack(PyObject* t, PyObject* address, PyObject* nbytes, void** a, size_t* n) {
  if (!is_tensor(t) || !PyLong_Check(address) || !PyLong_Check(nbytes)) {
    PyErr_SetString(PyExc_TypeError,
                    "_tensor_facts: expected (torch.Tensor, int address, int nbytes, ...)");
    return false;
  }
  *a = PyLong_AsVoidPtr(address);
  *n = PyLong_AsSize_t(nbytes);
  return !PyErr_Occurred();
}

bool dtype_of(PyObject* d, c10::ScalarType* out) {
  if (!THPDtype_Check(d)) {
    PyErr_SetString(PyExc_TypeError, "_tensor_facts: expected a torch.dtype as the last argument");
    return false;
  }
  *out = reinterpret_cast<THPDtype*>(d)->scalar_type;
  return true;
}

PyObject* same(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  void* a;
  size_t n;
  c10::ScalarType d;
  if (nargs != 4) {
    PyErr_Format(PyExc_TypeError, "same: expected 4 arguments, got %zd", nargs);
    return nullptr;
  }
  if (!unpack(args[0], args[1], args[2], &a, &n) || !dtype_of(args[3], &d)) return nullptr;
  return PyBool_FromLong(same_one(args[0], a, n, d));
}

PyObject* same2(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  void *a0, *a1;
  size_t n0, n1;
  c10::ScalarType d;
  if (nargs != 7) {
    PyErr_Format(PyExc_TypeError, "same2: expected 7 arguments, got %zd", nargs);
    return nullptr;
  }
  if (!unpack(args[0], args[2], args[4], &a0, &n0) ||
      !unpack(args[1], args[3], args[5], &a1, &n1) || !dtype_of(args[6], &d))
    return nullptr;
  return PyBool_FromLong(same_one(args[0], a0, n0, d) && same_one(args[1], a1, n1, d));
}

PyMethodDef methods[] = {
    {"same", (PyCFunction)(void (*)(void))same, METH_FASTCALL,
     "same(t, address, nbytes, dtype): t still has that memory, size and dtype, contiguous, "
     "on the CPU, without the negative bit."},
    {"same2", (PyCFunction)(void (*)(void))same2, METH_FASTCALL,
     "same2(a, b, address_a, address_b, nbytes_a, nbytes_b, dtype): same() of both."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tensor_facts", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__tensor_facts(void) {
  PyObject* m = PyModule_Create(&module);
  if (m != nullptr && PyModule_AddStringConstant(m, "torch_version", MPICOMM_TORCH_VERSION) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
