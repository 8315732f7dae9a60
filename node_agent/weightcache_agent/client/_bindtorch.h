/* What the torch-native row binder (_bindtorch.cpp) hands the C bind (_bindfast.c), in a capsule.
 *
 * The C bind is plain CPython and works with every torch; this part is compiled against one
 * torch (see native_build.py) and does per row, inside torch, what costs the C bind three
 * Python-level torch calls: read a tensor's shape and dtype, make a view of the arena, and
 * swap the view's storage into the module's tensor. Either function may decline a tensor it
 * does not handle (a tensor subclass, an inference tensor, a symbolic shape): the C bind then
 * does that row the Python-level way.
 */
#ifndef WEIGHTCACHE_BINDTORCH_H
#define WEIGHTCACHE_BINDTORCH_H

#include <Python.h>
#include <stdint.h>

#define WC_TORCH_ROWS_CAPSULE "weightcache._bindtorch.rows"

typedef struct {
    /* 1: `tensor` has shape[ndim] and the dtype of `arena` (the arena viewed as the form's dtype);
     * 0: it has not; 2: declined. Never raises. */
    int (*same_form)(PyObject *tensor, PyObject *arena, Py_ssize_t ndim, const int64_t *shape);
    /* `tensor` (keeping its identity, attributes and version counter) now holds the strided view
     * of `arena` at element `start`: 0. Declined, nothing changed: 1. Error set, nothing changed: -1.
     * It checks the view lies inside the arena's storage and raises IndexError where not. */
    int (*take)(PyObject *tensor, PyObject *arena, Py_ssize_t ndim, const int64_t *shape, const int64_t *stride,
                int64_t start);
} WcTorchRows;

#endif
