/* The attach hot loop in C: build a view per manifest row and swap it into the module.
 *
 * Same contract as `rebind.bind_manifest`'s Python path, minus the diagnostics: one walk of
 * the module tree, one strided view per manifest row (made a run of like rows at a time,
 * see `make_views`), each resolved to the module's own
 * parameter or buffer and checked for shape and dtype, and -- only once every row checked
 * out -- each view's storage swapped into that tensor. Anything unusual (a row with no
 * owner, a shape or dtype that disagrees, a tensor left on meta, a name that collides with
 * an attribute) returns None having changed nothing, and the Python path then produces the
 * error that names every case. A malformed manifest raises ValueError / TypeError.
 *
 * Plain CPython API: torch is reached only through the Python objects handed in (the bound
 * `as_strided` of the arena per form, `torch._C._swap_tensor_impl`), so one build works
 * with every torch version.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *s_parameters, *s_buffers, *s_modules, *s_shape, *s_dtype, *s_is_meta, *s_dot;

typedef struct {
    PyObject *modules;   /* qualified name -> module */
    PyObject *declared;  /* qualified name -> the module's non-None parameter or buffer */
} Tree;

/* nn.Module keeps these in its instance dict; the generic lookup skips the __getattr__ hook. */
static PyObject *table_of(PyObject *module, PyObject *attr) {
    PyObject *table = PyObject_GenericGetAttr(module, attr);
    if (table != NULL && !PyDict_Check(table)) {
        PyErr_Format(PyExc_TypeError, "module %R.%U is not a dict", module, attr);
        Py_CLEAR(table);
    }
    return table;
}

/* `dot` + `leaf`, or `leaf` itself at the root (`dot` NULL). */
static PyObject *qualify(PyObject *dot, PyObject *leaf) {
    return dot == NULL ? Py_NewRef(leaf) : PyUnicode_Concat(dot, leaf);
}

static int walk(PyObject *root, Tree *tree) {
    PyObject *order = PyList_New(0);  /* (qualified name, module), appended while it is walked */
    PyObject *first = PyUnicode_FromString("");
    PyObject *pair = first ? PyTuple_Pack(2, first, root) : NULL;
    int rc = -1;
    if (order == NULL || pair == NULL || PyDict_SetItem(tree->modules, first, root) < 0 || PyList_Append(order, pair) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(order); i++) {
        PyObject *prefix = PyTuple_GET_ITEM(PyList_GET_ITEM(order, i), 0);
        PyObject *module = PyTuple_GET_ITEM(PyList_GET_ITEM(order, i), 1);
        PyObject *dot = PyUnicode_GET_LENGTH(prefix) ? PyUnicode_Concat(prefix, s_dot) : NULL;
        if (PyUnicode_GET_LENGTH(prefix) && dot == NULL)
            goto done;
        PyObject *attrs[3] = {s_parameters, s_buffers, s_modules};
        int failed = 0;
        for (int a = 0; a < 3 && !failed; a++) {
            PyObject *table = table_of(module, attrs[a]);
            if (table == NULL) {
                failed = 1;
                break;
            }
            Py_ssize_t pos = 0;
            PyObject *leaf, *value;
            while (!failed && PyDict_Next(table, &pos, &leaf, &value)) {
                if (value == Py_None)
                    continue;
                PyObject *name = qualify(dot, leaf);
                if (name == NULL) {
                    failed = 1;
                } else if (a < 2) {
                    failed = PyDict_SetItem(tree->declared, name, value) < 0;
                } else {
                    PyObject *next = PyTuple_Pack(2, name, value);
                    failed = next == NULL || PyDict_SetItem(tree->modules, name, value) < 0 || PyList_Append(order, next) < 0;
                    Py_XDECREF(next);
                }
                Py_XDECREF(name);
            }
            Py_DECREF(table);
        }
        Py_XDECREF(dot);
        if (failed)
            goto done;
    }
    rc = 0;
done:
    Py_XDECREF(order);
    Py_XDECREF(first);
    Py_XDECREF(pair);
    return rc;
}

/* 1 if a declared tensor is still on meta and not among `bound`, 0 if none, -1 on error. */
static int left_on_meta(PyObject *declared, PyObject *bound) {
    Py_ssize_t pos = 0;
    PyObject *name, *tensor;
    while (PyDict_Next(declared, &pos, &name, &tensor)) {
        PyObject *is_meta = PyObject_GetAttr(tensor, s_is_meta);
        if (is_meta == NULL)
            return -1;
        int meta = is_meta == Py_True;
        Py_DECREF(is_meta);
        if (!meta)
            continue;
        PyObject *id = PyLong_FromVoidPtr(tensor);
        int in = id ? PySet_Contains(bound, id) : -1;
        Py_XDECREF(id);
        if (in <= 0)
            return in < 0 ? -1 : 1;
    }
    return 0;
}

/* A row the module does not declare: 1 with *owner and *leaf (new references) where it can become a
 * buffer of its owner, 0 where it cannot (no owner, the name taken), -1 on error. */
static int extra_place(Tree *tree, PyObject *name, PyObject **owner, PyObject **leaf) {
    *owner = *leaf = NULL;
    Py_ssize_t len = PyUnicode_GET_LENGTH(name);
    Py_ssize_t dot = PyUnicode_FindChar(name, '.', 0, len, -1);
    if (dot == -2)
        return -1;
    PyObject *prefix = dot < 0 ? PyUnicode_FromString("") : PyUnicode_Substring(name, 0, dot);
    if (prefix == NULL)
        return -1;
    PyObject *found = PyDict_GetItemWithError(tree->modules, prefix);  /* borrowed */
    Py_DECREF(prefix);
    if (found == NULL)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *tail = PyUnicode_Substring(name, dot + 1, len);
    if (tail == NULL)
        return -1;
    PyObject *attrs[2] = {s_parameters, s_buffers};
    int taken = 0;
    for (int a = 0; a < 2 && !taken; a++) {  /* an entry holding None (Linear(bias=False)) is taken too */
        PyObject *table = table_of(found, attrs[a]);
        taken = table == NULL ? -1 : PyDict_Contains(table, tail);
        Py_XDECREF(table);
    }
    if (taken == 0)
        taken = PyObject_HasAttr(found, tail);
    if (taken != 0) {
        Py_DECREF(tail);
        return taken < 0 ? -1 : 0;
    }
    *owner = Py_NewRef(found);
    *leaf = tail;
    return 1;
}

/* A view of `form` at element `start`; with count > 0, a view of `count` of them `step` elements apart. */
static PyObject *strided(PyObject *form, long long start, Py_ssize_t count, long long step) {
    PyObject *shape = PyTuple_GET_ITEM(form, 1), *stride = PyTuple_GET_ITEM(form, 2);
    PyObject *first = PyLong_FromLongLong(start);
    if (first == NULL)
        return NULL;
    if (count > 0) {
        PyObject *lead_shape = Py_BuildValue("(n)", count), *lead_stride = Py_BuildValue("(L)", step);
        shape = lead_shape ? PySequence_Concat(lead_shape, shape) : NULL;
        stride = lead_stride && shape ? PySequence_Concat(lead_stride, stride) : NULL;
        Py_XDECREF(lead_shape);
        Py_XDECREF(lead_stride);
        if (stride == NULL) {
            Py_XDECREF(shape);
            Py_DECREF(first);
            return NULL;
        }
    }
    PyObject *call_args[3] = {shape, stride, first};
    PyObject *view = PyObject_Vectorcall(PyTuple_GET_ITEM(form, 0), call_args, 3, NULL);
    if (count > 0) {
        Py_DECREF(shape);
        Py_DECREF(stride);
    }
    Py_DECREF(first);
    return view;
}

#define MAX_PERIOD 16  /* tensors of one form in one layer, at most, for runs to be found */

/* A view per row into views[], made a run at a time: rows of one form whose starts step evenly
 * -- the same tensor of every layer, one of `period` rows of that form per layer -- come out of
 * one view of the whole run, unbound along its first dimension. That is one torch call per
 * run, where a view each from `as_strided` costs twice what unbinding one does. A run torch
 * refuses (it reaches past the arena) is made row by row, so the error is the row's own. */
static int make_views(PyObject *forms, const Py_ssize_t *form_of, const long long *start, Py_ssize_t n,
                      PyObject **views) {
    Py_ssize_t nforms = PyList_GET_SIZE(forms);
    Py_ssize_t *next = PyMem_Calloc(nforms + 1, sizeof *next), *order = PyMem_Malloc((n + 1) * sizeof *order);
    PyObject *parts = NULL;
    int rc = -1;
    if (next == NULL || order == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)  /* rows grouped by form, manifest order kept within a form */
        next[form_of[i] + 1]++;
    for (Py_ssize_t f = 0; f < nforms; f++)
        next[f + 1] += next[f];
    for (Py_ssize_t i = 0; i < n; i++)
        order[next[form_of[i]]++] = i;
    /* next[f] is now where form f's rows end in `order`; a row is done once views[row] is set */
    for (Py_ssize_t k = 0, f = 0; k < n; k++) {
        while (next[f] <= k)
            f++;
        Py_ssize_t row = order[k], period = 0, length = 1;
        if (views[row] != NULL)
            continue;
        for (Py_ssize_t p = 1; p <= MAX_PERIOD && k + p < next[f]; p++) {
            long long step = start[order[k + p]] - start[row];
            Py_ssize_t len = 1;
            while (step >= 0 && k + len * p < next[f] && views[order[k + len * p]] == NULL &&
                   start[order[k + len * p]] - start[order[k + (len - 1) * p]] == step)
                len++;
            if (len > length)
                length = len, period = p;
        }
        PyObject *form = PyList_GET_ITEM(forms, f);
        if (length >= 2) {
            PyObject *run = strided(form, start[row], length, start[order[k + period]] - start[row]);
            parts = run ? PyObject_CallMethod(run, "unbind", NULL) : NULL;
            Py_XDECREF(run);
            if (parts != NULL && PyTuple_Check(parts) && PyTuple_GET_SIZE(parts) == length) {
                for (Py_ssize_t t = 0; t < length; t++)
                    views[order[k + t * period]] = Py_NewRef(PyTuple_GET_ITEM(parts, t));
                Py_CLEAR(parts);
                continue;
            }
            Py_CLEAR(parts);
            PyErr_Clear();
        }
        if ((views[row] = strided(form, start[row], 0, 0)) == NULL)
            goto done;
    }
    rc = 0;
done:
    PyMem_Free(next);
    PyMem_Free(order);
    return rc;
}

/* bind(module, names, form_index, offsets, forms, swap) -> (tensors, extras) or None
 *
 * forms: list of (as_strided of the arena viewed as the form's dtype, shape tuple, stride tuple,
 * itemsize, dtype). extras: (owner, leaf, name) of rows the module does not declare. */
static PyObject *bind(PyObject *self, PyObject *args) {
    PyObject *module, *names, *form_index, *offsets, *forms, *swap;
    if (!PyArg_ParseTuple(args, "OO!O!O!O!O", &module, &PyList_Type, &names, &PyList_Type, &form_index,
                          &PyList_Type, &offsets, &PyList_Type, &forms, &swap))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(names), nforms = PyList_GET_SIZE(forms);
    if (PyList_GET_SIZE(form_index) != n || PyList_GET_SIZE(offsets) != n) {
        PyErr_Format(PyExc_ValueError, "manifest columns differ in length: %zd names, %zd forms, %zd offsets", n,
                     PyList_GET_SIZE(form_index), PyList_GET_SIZE(offsets));
        return NULL;
    }
    for (Py_ssize_t f = 0; f < nforms; f++) {
        PyObject *form = PyList_GET_ITEM(forms, f);
        if (!PyTuple_Check(form) || PyTuple_GET_SIZE(form) != 5 || !PyTuple_Check(PyTuple_GET_ITEM(form, 1)) ||
            !PyTuple_Check(PyTuple_GET_ITEM(form, 2)) || !PyLong_Check(PyTuple_GET_ITEM(form, 3))) {
            PyErr_SetString(PyExc_TypeError, "forms must be (as_strided, shape, stride, itemsize, dtype) tuples");
            return NULL;
        }
    }
    Tree tree = {PyDict_New(), PyDict_New()};
    PyObject *targets = PyList_New(0), *bound = PySet_New(NULL), *tensors = PyDict_New(), *extras = PyList_New(0);
    Py_ssize_t *form_of = PyMem_Malloc((n + 1) * sizeof *form_of);
    long long *start = PyMem_Malloc((n + 1) * sizeof *start);
    PyObject **views = PyMem_Calloc(n + 1, sizeof *views);
    PyObject *result = NULL;
    Py_ssize_t covered = 0;
    if (form_of == NULL || start == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyList_GET_ITEM(names, i), *fi = PyList_GET_ITEM(form_index, i);
        PyObject *offset = PyList_GET_ITEM(offsets, i);
        if (!PyUnicode_Check(name) || !PyLong_Check(fi) || !PyLong_Check(offset)) {
            PyErr_Format(PyExc_TypeError, "manifest row %zd: name must be a str, form and offset ints", i);
            goto done;
        }
        Py_ssize_t f = PyLong_AsSsize_t(fi);
        long long at = PyLong_AsLongLong(offset);
        if (PyErr_Occurred())
            goto done;
        if (f < 0 || f >= nforms) {
            PyErr_Format(PyExc_ValueError, "tensor %R: form %zd is not one of the %zd forms", name, f, nforms);
            goto done;
        }
        long long itemsize = PyLong_AsLongLong(PyTuple_GET_ITEM(PyList_GET_ITEM(forms, f), 3));
        if (itemsize <= 0 || at < 0 || at % itemsize) {
            PyErr_Format(PyExc_ValueError, "tensor %R at offset %lld is not aligned to its elements", name, at);
            goto done;
        }
        form_of[i] = f;
        start[i] = at / itemsize;
    }
    if (!tree.modules || !tree.declared || !targets || !bound || !tensors || !extras || walk(module, &tree) < 0 ||
        make_views(forms, form_of, start, n, views) < 0)
        goto done;

    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyList_GET_ITEM(names, i), *view = views[i];
        PyObject *form = PyList_GET_ITEM(forms, form_of[i]);
        if (PyDict_SetItem(tensors, name, view) < 0)
            goto done;

        PyObject *current = PyDict_GetItemWithError(tree.declared, name);  /* borrowed */
        if (current == NULL) {
            PyObject *owner = NULL, *leaf = NULL;
            int place = PyErr_Occurred() ? -1 : extra_place(&tree, name, &owner, &leaf);
            PyObject *extra = place == 1 ? PyTuple_Pack(3, owner, leaf, name) : NULL;
            Py_XDECREF(owner);
            Py_XDECREF(leaf);
            if (place == 0)
                goto unclean;
            if (extra == NULL || PyList_Append(extras, extra) < 0) {
                Py_XDECREF(extra);
                goto done;
            }
            Py_DECREF(extra);
            continue;
        }
        covered++;
        PyObject *id = PyLong_FromVoidPtr(current);
        int seen = id ? PySet_Contains(bound, id) : -1;
        if (seen != 0) {  /* a tied tensor the cache also holds under another name: bound once */
            Py_XDECREF(id);
            if (seen < 0)
                goto done;
            continue;
        }
        PyObject *shape = PyObject_GetAttr(current, s_shape);
        PyObject *dtype = shape ? PyObject_GetAttr(current, s_dtype) : NULL;
        int same = dtype == NULL ? -1 : PyObject_RichCompareBool(shape, PyTuple_GET_ITEM(form, 1), Py_EQ);
        if (same == 1)
            same = dtype == PyTuple_GET_ITEM(form, 4);
        Py_XDECREF(shape);
        Py_XDECREF(dtype);
        PyObject *target = same == 1 ? PyTuple_Pack(3, name, current, view) : NULL;
        int failed = same < 0 || (same == 1 && (target == NULL || PySet_Add(bound, id) < 0 ||
                                                PyList_Append(targets, target) < 0));
        Py_XDECREF(target);
        Py_DECREF(id);
        if (failed)
            goto done;
        if (!same)
            goto unclean;
    }
    if (covered != PyDict_GET_SIZE(tree.declared)) {  /* the cache did not name every declared tensor */
        int left = left_on_meta(tree.declared, bound);
        if (left < 0)
            goto done;
        if (left)
            goto unclean;
    }
    for (Py_ssize_t t = 0; t < PyList_GET_SIZE(targets); t++) {
        PyObject *target = PyList_GET_ITEM(targets, t);
        PyObject *pair[2] = {PyTuple_GET_ITEM(target, 1), PyTuple_GET_ITEM(target, 2)};
        PyObject *ok = PyObject_Vectorcall(swap, pair, 2, NULL);
        if (ok == NULL || PyDict_SetItem(tensors, PyTuple_GET_ITEM(target, 0), pair[0]) < 0) {
            Py_XDECREF(ok);
            goto done;
        }
        Py_DECREF(ok);
    }
    result = PyTuple_Pack(2, tensors, extras);
    goto done;
unclean:  /* nothing swapped: the Python path names every problem */
    result = Py_NewRef(Py_None);
done:
    if (views != NULL)
        for (Py_ssize_t i = 0; i < n; i++)
            Py_XDECREF(views[i]);
    PyMem_Free(views);
    PyMem_Free(form_of);
    PyMem_Free(start);
    Py_XDECREF(tree.modules);
    Py_XDECREF(tree.declared);
    Py_XDECREF(targets);
    Py_XDECREF(bound);
    Py_XDECREF(tensors);
    Py_XDECREF(extras);
    return result;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS, "bind(module, names, form_index, offsets, forms, swap) -> (tensors, extras) | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_bindfast", NULL, -1, methods};

PyMODINIT_FUNC PyInit__bindfast(void) {
    if (!(s_parameters = PyUnicode_InternFromString("_parameters")) ||
        !(s_buffers = PyUnicode_InternFromString("_buffers")) || !(s_modules = PyUnicode_InternFromString("_modules")) ||
        !(s_shape = PyUnicode_InternFromString("shape")) || !(s_dtype = PyUnicode_InternFromString("dtype")) ||
        !(s_is_meta = PyUnicode_InternFromString("is_meta")) || !(s_dot = PyUnicode_InternFromString(".")))
        return NULL;
    return PyModule_Create(&moduledef);
}
