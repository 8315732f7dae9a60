/* The attach's per-row torch work in C++: no Python tensor object per row.
 *
 * The C bind (_bindfast.c) spends most of a bind in three Python-level torch calls per row:
 * reading the module tensor's shape and dtype, making a view of the arena (a new tensor object),
 * and swapping that view's storage into the module's tensor. Here each row is one C call on the
 * tensors' TensorImpls: the module's tensor takes the view's metadata in place -- storage,
 * device, dispatch keys, sizes, strides, offset -- the way `tensor.data = view` does, from one
 * scratch TensorImpl, and stops requiring grad (as the swap leaves it). Its Python object,
 * attributes and version counter stay; no view object is ever made.
 *
 * Compiled against one torch build (native_build.py keys the file by torch version, git
 * revision and Python ABI), so it may use torch's C++ API; the C bind reaches it through the
 * function table in _bindtorch.h and falls back to its own path for a row it declines.
 */
#include <Python.h>

#include <c10/core/TensorImpl.h>
#include <torch/csrc/autograd/python_variable.h>

#include <exception>
#include <typeinfo>

#include "_bindtorch.h"

#ifndef WEIGHTCACHE_TORCH_KEY
#error "WEIGHTCACHE_TORCH_KEY: the torch build this is compiled for (native_build.py defines it)"
#endif

namespace {

/* The tensor behind `obj`, or nullptr where it is not one this module handles: only a plain
 * dense TensorImpl (no subclass impl, no Python dispatch, no symbolic sizes, no inference mode)
 * may be rewritten in place. */
const at::Tensor *plain(PyObject *obj) {
    if (!THPVariable_Check(obj))
        return nullptr;
    const at::Tensor &tensor = THPVariable_Unpack(obj);
    c10::TensorImpl *impl = tensor.unsafeGetTensorImpl();
    if (impl == nullptr || typeid(*impl) != typeid(c10::TensorImpl) || impl->is_python_dispatch() ||
        impl->has_symbolic_sizes_strides() || impl->is_inference() || impl->is_sparse() || impl->is_quantized())
        return nullptr;
    return &tensor;
}

int same_form(PyObject *tensor, PyObject *arena, Py_ssize_t ndim, const int64_t *shape) {
    const at::Tensor *t = plain(tensor), *a = plain(arena);
    if (t == nullptr || a == nullptr)
        return 2;
    if (t->scalar_type() != a->scalar_type())
        return 0;
    return t->sizes().equals(c10::IntArrayRef(shape, static_cast<size_t>(ndim))) ? 1 : 0;
}

int take(PyObject *tensor, PyObject *arena, Py_ssize_t ndim, const int64_t *shape, const int64_t *stride,
         int64_t start) {
    const at::Tensor *t = plain(tensor), *a = plain(arena);
    if (t == nullptr || a == nullptr || !t->is_leaf())
        return 1;
    /* The last element the view reaches, in the arena's elements: inside its storage, or no view. */
    int64_t last = a->storage_offset() + start, itemsize = static_cast<int64_t>(a->element_size());
    bool empty = false;
    for (Py_ssize_t d = 0; d < ndim; d++) {
        if (shape[d] < 0 || stride[d] < 0) {
            PyErr_Format(PyExc_ValueError, "a view with shape or stride below zero (dimension %zd)", d);
            return -1;
        }
        empty |= shape[d] == 0;
        int64_t reach;
        if (shape[d] > 0 && (__builtin_mul_overflow(shape[d] - 1, stride[d], &reach) ||
                             __builtin_add_overflow(last, reach, &last))) {
            PyErr_SetString(PyExc_IndexError, "a view reaching past the arena");
            return -1;
        }
    }
    int64_t nbytes = static_cast<int64_t>(a->storage().nbytes());
    if (start < 0 || (!empty && (last + 1 > nbytes / itemsize))) {
        PyErr_Format(PyExc_IndexError, "a view ending at element %lld of an arena of %lld", (long long)last + 1,
                     (long long)(nbytes / itemsize));
        return -1;
    }
    try {
        auto scratch = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(a->storage()),
                                                            a->key_set(), a->dtype());
        scratch->set_sizes_and_strides(c10::IntArrayRef(shape, static_cast<size_t>(ndim)),
                                       c10::IntArrayRef(stride, static_cast<size_t>(ndim)),
                                       a->storage_offset() + start);
        c10::TensorImpl *impl = t->unsafeGetTensorImpl();
        if (t->requires_grad())
            impl->set_requires_grad(false);
        impl->shallow_copy_from(scratch);
    } catch (const std::exception &e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return -1;
    }
    return 0;
}

const WcTorchRows rows = {same_form, take};

struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_bindtorch",
                                "The attach's per-row torch work in C++ (see _bindtorch.cpp).", -1, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__bindtorch(void) {
    PyObject *module = PyModule_Create(&moduledef);
    if (module == nullptr)
        return nullptr;
    PyObject *capsule = PyCapsule_New(const_cast<WcTorchRows *>(&rows), WC_TORCH_ROWS_CAPSULE, nullptr);
    if (capsule == nullptr || PyModule_AddObject(module, "rows", capsule) < 0 ||
        PyModule_AddStringConstant(module, "built_for", WEIGHTCACHE_TORCH_KEY) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(module);
        return nullptr;
    }
    return module;
}
