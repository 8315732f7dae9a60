/* The attach hot loop in C: build a view per manifest row and swap it into the module.
 *
 * Same contract as `rebind.bind_manifest`'s Python path, minus the diagnostics:
 *   survey  one walk of the module tree, every parameter and buffer by qualified name; it needs
 *           the module alone, so an engine takes it while the agent prepares its answer;
 *   bind    one strided view per manifest row (made a run of like rows at a time, see
 *           `make_views`), each looked up in the survey and checked for shape and dtype (a row
 *           the module does not declare is resolved from the root, see `resolve`, and becomes a
 *           buffer of its owner), then -- only once every row checked out, and `before_swap`
 *           returned -- each view's storage swapped into that tensor.
 * Anything unusual (a row with no owner, a shape or dtype that disagrees, a tensor left on
 * meta, a name that collides with an attribute, a tree nested deeper than MAX_DEPTH) returns
 * None having changed nothing, and the Python path then produces the error that names every
 * case. A malformed manifest raises ValueError / TypeError.
 *
 * Plain CPython API: torch is reached only through the Python objects handed in (the bound
 * `as_strided` of the arena per form, `torch._C._swap_tensor_impl`), so one build works
 * with every torch version.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *s_parameters, *s_buffers, *s_modules, *s_shape, *s_dtype, *s_is_meta;

/* nn.Module keeps these in its instance dict; the generic lookup skips the __getattr__ hook. */
static PyObject *table_of(PyObject *module, PyObject *attr) {
    PyObject *table = PyObject_GenericGetAttr(module, attr);
    if (table != NULL && !PyDict_Check(table)) {
        PyErr_Format(PyExc_TypeError, "module %R.%U is not a dict", module, attr);
        Py_CLEAR(table);
    }
    return table;
}

/* A set of object addresses (open addressing): the tensors surveyed, the tensors bound. */
typedef struct {
    void **slots;
    size_t mask;
} PtrSet;

static int ptrset_init(PtrSet *set, Py_ssize_t expected) {
    size_t size = 16;
    while (size < (size_t)expected * 2)
        size <<= 1;
    set->mask = size - 1;
    set->slots = PyMem_Calloc(size, sizeof(void *));
    if (set->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* 1 if `p` was added, 0 if already there. The set never fills: callers size it for every insert. */
static int ptrset_add(PtrSet *set, void *p) {
    size_t i = ((size_t)p >> 4) * 0x9E3779B97F4A7C15ull & set->mask;
    while (set->slots[i] != NULL) {
        if (set->slots[i] == p)
            return 0;
        i = (i + 1) & set->mask;
    }
    set->slots[i] = p;
    return 1;
}

static int ptrset_has(const PtrSet *set, void *p) {
    size_t i = ((size_t)p >> 4) * 0x9E3779B97F4A7C15ull & set->mask;
    while (set->slots[i] != NULL) {
        if (set->slots[i] == p)
            return 1;
        i = (i + 1) & set->mask;
    }
    return 0;
}

#define MAX_DEPTH 64  /* submodule nesting a name may have; deeper trees go to the Python path */

/* A qualified name being built, component by component, in one buffer. */
typedef struct {
    char *text;
    Py_ssize_t len, cap;
} NameBuf;

static int namebuf_put(NameBuf *buf, Py_ssize_t at, PyObject *leaf, int dot) {
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(leaf, &n);
    if (s == NULL)
        return -1;
    if (at + n + 1 > buf->cap) {
        Py_ssize_t cap = (at + n + 1) * 2;
        char *text = PyMem_Realloc(buf->text, cap);
        if (text == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        buf->text = text, buf->cap = cap;
    }
    memcpy(buf->text + at, s, n);
    buf->len = at + n;
    if (dot)
        buf->text[buf->len++] = '.';
    return 0;
}

typedef struct {
    PyObject *declared;  /* qualified name -> the module's non-None parameter or buffer */
    PtrSet tensors;      /* the distinct tensors among them */
    Py_ssize_t places;   /* how many */
    NameBuf name;
} Survey;

/* 0 done, 1 for the Python path (nested deeper than MAX_DEPTH, a name not UTF-8), -1 error. */
static int survey_module(Survey *sv, PyObject *module, Py_ssize_t at, int depth) {
    if (depth > MAX_DEPTH)
        return 1;
    PyObject *attrs[3] = {s_parameters, s_buffers, s_modules};
    for (int a = 0; a < 3; a++) {
        PyObject *table = table_of(module, attrs[a]), *leaf, *value;
        if (table == NULL)
            return -1;
        Py_ssize_t pos = 0;
        int rc = 0;
        while (rc == 0 && PyDict_Next(table, &pos, &leaf, &value)) {
            if (value == Py_None)
                continue;
            if ((rc = namebuf_put(&sv->name, at, leaf, a == 2)) < 0) {
                if (PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {  /* a name the Python path handles */
                    PyErr_Clear();
                    rc = 1;
                }
                break;
            }
            if (a == 2) {
                rc = survey_module(sv, value, sv->name.len, depth + 1);
                continue;
            }
            PyObject *name = PyUnicode_DecodeUTF8(sv->name.text, sv->name.len, NULL);
            rc = name == NULL || PyDict_SetItem(sv->declared, name, value) < 0 ? -1 : 0;
            Py_XDECREF(name);
            if (rc == 0 && (Py_ssize_t)(sv->tensors.mask / 2) <= sv->places) {  /* keep the set half empty */
                PtrSet bigger;
                rc = ptrset_init(&bigger, (Py_ssize_t)(sv->tensors.mask + 1));
                for (size_t k = 0; rc == 0 && k <= sv->tensors.mask; k++)
                    if (sv->tensors.slots[k] != NULL)
                        ptrset_add(&bigger, sv->tensors.slots[k]);
                if (rc == 0) {
                    PyMem_Free(sv->tensors.slots);
                    sv->tensors = bigger;
                }
            }
            if (rc == 0)
                sv->places += ptrset_add(&sv->tensors, value);
        }
        Py_DECREF(table);
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* survey(module) -> (declared, places) or None
 *
 * One walk of the module tree: every non-None parameter and buffer by qualified name, and how
 * many distinct tensors they are. It depends on the module alone, so an engine takes it while
 * the agent prepares its answer. None where the Python path must walk it instead (nested deeper
 * than MAX_DEPTH, or a name with a lone surrogate). */
static PyObject *survey(PyObject *self, PyObject *module) {
    Survey sv = {PyDict_New(), {NULL, 0}, 0, {NULL, 0, 0}};
    PyObject *result = NULL;
    if (sv.declared != NULL && ptrset_init(&sv.tensors, 4096) == 0) {
        int rc = survey_module(&sv, module, 0, 0);
        if (rc == 0)
            result = Py_BuildValue("(On)", sv.declared, sv.places);
        else if (rc == 1)
            result = Py_NewRef(Py_None);
    }
    PyMem_Free(sv.tensors.slots);
    PyMem_Free(sv.name.text);
    Py_XDECREF(sv.declared);
    return result;
}

/* 1 if a declared tensor is still on meta and not among `bound`, 0 if none, -1 on error. */
static int left_on_meta(PyObject *declared, const PtrSet *bound) {
    Py_ssize_t pos = 0;
    PyObject *name, *tensor;
    while (PyDict_Next(declared, &pos, &name, &tensor)) {
        if (ptrset_has(bound, tensor))
            continue;
        PyObject *is_meta = PyObject_GetAttr(tensor, s_is_meta);
        if (is_meta == NULL)
            return -1;
        int meta = is_meta == Py_True;
        Py_DECREF(is_meta);
        if (meta)
            return 1;
    }
    return 0;
}

/* The submodules of the last name resolved, one per component: consecutive manifest rows
 * mostly share all but their last component or two ("model.layers.7.mlp." ...), which are
 * then the only dict lookups a row costs. */
typedef struct {
    const char *name;          /* the last name's UTF-8 (owned by its str, alive for the bind) */
    Py_ssize_t depth;          /* its components resolved to submodules */
    Py_ssize_t end[MAX_DEPTH]; /* where component d ends (its '.') */
    PyObject *mod[MAX_DEPTH + 1];  /* mod[0]: the root; mod[d + 1]: component d's submodule (strong) */
} Path;

static void path_cut(Path *path, Py_ssize_t depth) {
    for (Py_ssize_t d = depth; d < path->depth; d++)
        Py_CLEAR(path->mod[d + 1]);
    path->depth = depth;
}

/* The owner of dotted `name` (borrowed, via path) and its last component as a new str in *leaf:
 * 1 found, 0 no such submodule (or nested too deep, or not UTF-8), -1 error. */
static int resolve(Path *path, PyObject *name, PyObject **owner, PyObject **leaf) {
    Py_ssize_t len, pos = 0, d = 0;
    const char *s = PyUnicode_AsUTF8AndSize(name, &len);
    *owner = *leaf = NULL;
    if (s == NULL) {  /* a lone surrogate: no submodule is named so, and the Python path says where */
        if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    while (d < path->depth) {  /* the components this name shares with the last one */
        Py_ssize_t e = path->end[d];
        if (e >= len || s[e] != '.' || memcmp(s + pos, path->name + pos, e - pos) != 0)
            break;
        pos = e + 1;
        d++;
    }
    path_cut(path, d);
    path->name = s;
    for (const char *dot; (dot = memchr(s + pos, '.', len - pos)) != NULL; pos = dot - s + 1) {
        if (d >= MAX_DEPTH)
            return 0;
        PyObject *part = PyUnicode_DecodeUTF8(s + pos, dot - s - pos, NULL);
        PyObject *children = part ? table_of(path->mod[d], s_modules) : NULL;
        PyObject *child = children ? PyDict_GetItemWithError(children, part) : NULL;  /* borrowed */
        Py_XINCREF(child);
        Py_XDECREF(children);
        Py_XDECREF(part);
        if (child == NULL)
            return PyErr_Occurred() ? -1 : 0;
        if (child == Py_None) {
            Py_DECREF(child);
            return 0;
        }
        path->mod[d + 1] = child;
        path->end[d] = dot - s;
        path->depth = ++d;
    }
    *leaf = PyUnicode_DecodeUTF8(s + pos, len - pos, NULL);
    if (*leaf == NULL)
        return -1;
    *owner = path->mod[d];
    return 1;
}

/* What `leaf` is on `owner`: *current (borrowed) its parameter or buffer and 1; 0 where it names
 * nothing (an extra row may become a buffer there); 2 where the name is taken otherwise (an
 * entry holding None, as Linear(bias=False) does, or another attribute); -1 on error. */
static int place_of(PyObject *owner, PyObject *leaf, PyObject **current) {
    PyObject *attrs[2] = {s_parameters, s_buffers};
    *current = NULL;
    for (int a = 0; a < 2; a++) {
        PyObject *table = table_of(owner, attrs[a]);
        PyObject *found = table ? PyDict_GetItemWithError(table, leaf) : NULL;
        Py_XDECREF(table);  /* the module still holds it, and so `found` */
        if (found != NULL) {
            *current = found;
            return found == Py_None ? 2 : 1;
        }
        if (PyErr_Occurred())
            return -1;
    }
    int taken = PyObject_HasAttr(owner, leaf);
    return taken ? 2 : 0;
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

/* bind(module, survey, names, form_index, offsets, forms, swap, before_swap=None) -> (tensors, extras) or None
 *
 * survey: what `survey(module)` returned, or None to survey here. forms: list of (as_strided of
 * the arena viewed as the form's dtype, shape tuple, stride tuple, itemsize, dtype). before_swap:
 * called once every row has checked out, before the first swap. extras: (owner, leaf, name) of
 * rows the module does not declare. */
static PyObject *bind(PyObject *self, PyObject *args) {
    PyObject *module, *surveyed, *names, *form_index, *offsets, *forms, *swap, *before_swap = Py_None;
    if (!PyArg_ParseTuple(args, "OOO!O!O!O!O|O", &module, &surveyed, &PyList_Type, &names, &PyList_Type, &form_index,
                          &PyList_Type, &offsets, &PyList_Type, &forms, &swap, &before_swap))
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
    if (surveyed == Py_None)
        surveyed = survey(NULL, module);
    else
        Py_INCREF(surveyed);
    if (surveyed == NULL)
        return NULL;
    Path path = {.name = NULL, .depth = 0, .mod = {Py_NewRef(module)}};
    PtrSet bound = {NULL, 0};
    PyObject *tensors = PyDict_New(), *extras = PyList_New(0), *result = NULL;
    Py_ssize_t *form_of = PyMem_Malloc((n + 1) * sizeof *form_of), *target_row = PyMem_Malloc((n + 1) * sizeof *target_row);
    long long *start = PyMem_Malloc((n + 1) * sizeof *start);
    PyObject **views = PyMem_Calloc(n + 1, sizeof *views), **current_of = PyMem_Calloc(n + 1, sizeof *current_of);
    PyObject *declared = NULL;
    Py_ssize_t targets = 0;
    if (surveyed == Py_None)  /* nested too deep for the C walk */
        goto unclean;
    if (!PyTuple_Check(surveyed) || PyTuple_GET_SIZE(surveyed) != 2 || !PyDict_Check(PyTuple_GET_ITEM(surveyed, 0))) {
        PyErr_SetString(PyExc_TypeError, "survey must be what _bindfast.survey returned");
        goto done;
    }
    declared = PyTuple_GET_ITEM(surveyed, 0);
    if (form_of == NULL || target_row == NULL || start == NULL || views == NULL || current_of == NULL ||
        ptrset_init(&bound, n + 1) < 0) {
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
    if (tensors == NULL || extras == NULL || make_views(forms, form_of, start, n, views) < 0)
        goto done;

    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyList_GET_ITEM(names, i), *form = PyList_GET_ITEM(forms, form_of[i]);
        if (PyDict_SetItem(tensors, name, views[i]) < 0)
            goto done;
        PyObject *current = PyDict_GetItemWithError(declared, name);  /* borrowed */
        if (current == NULL) {  /* a row the module does not declare: a buffer of its owner, if free */
            PyObject *owner = NULL, *leaf = NULL, *taken;
            int found = PyErr_Occurred() ? -1 : resolve(&path, name, &owner, &leaf);
            int place = found == 1 ? place_of(owner, leaf, &taken) : found == 0 ? 2 : -1;
            PyObject *extra = place == 0 ? PyTuple_Pack(3, owner, leaf, name) : NULL;
            int failed = place < 0 || (place == 0 && (extra == NULL || PyList_Append(extras, extra) < 0));
            Py_XDECREF(extra);
            Py_XDECREF(leaf);
            if (failed)
                goto done;
            if (place != 0)  /* no such submodule, or the name is taken (1: declared since the survey) */
                goto unclean;
            continue;
        }
        if (!ptrset_add(&bound, current))  /* a tied tensor the cache also holds under another name: bound once */
            continue;
        PyObject *shape = PyObject_GetAttr(current, s_shape);
        PyObject *dtype = shape ? PyObject_GetAttr(current, s_dtype) : NULL;
        int same = dtype == NULL ? -1 : PyObject_RichCompareBool(shape, PyTuple_GET_ITEM(form, 1), Py_EQ);
        if (same == 1)
            same = dtype == PyTuple_GET_ITEM(form, 4);
        Py_XDECREF(shape);
        Py_XDECREF(dtype);
        if (same < 0)
            goto done;
        if (!same)
            goto unclean;
        current_of[targets] = Py_NewRef(current);
        target_row[targets++] = i;
    }
    /* Fewer tensors bound than the module holds: one may still be on meta (or a tie named once). */
    if (targets != PyLong_AsSsize_t(PyTuple_GET_ITEM(surveyed, 1))) {
        int left = PyErr_Occurred() ? -1 : left_on_meta(declared, &bound);
        if (left < 0)
            goto done;
        if (left)
            goto unclean;
    }
    if (before_swap != Py_None) {
        PyObject *ok = PyObject_CallNoArgs(before_swap);
        if (ok == NULL)
            goto done;
        Py_DECREF(ok);
    }
    for (Py_ssize_t t = 0; t < targets; t++) {
        PyObject *pair[2] = {current_of[t], views[target_row[t]]};
        PyObject *ok = PyObject_Vectorcall(swap, pair, 2, NULL);
        if (ok == NULL || PyDict_SetItem(tensors, PyList_GET_ITEM(names, target_row[t]), pair[0]) < 0) {
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
    for (Py_ssize_t i = 0; views != NULL && i < n; i++)
        Py_XDECREF(views[i]);
    for (Py_ssize_t t = 0; t < targets; t++)
        Py_DECREF(current_of[t]);
    path_cut(&path, 0);
    Py_DECREF(path.mod[0]);
    PyMem_Free(views);
    PyMem_Free(current_of);
    PyMem_Free(target_row);
    PyMem_Free(form_of);
    PyMem_Free(start);
    PyMem_Free(bound.slots);
    Py_DECREF(surveyed);
    Py_XDECREF(tensors);
    Py_XDECREF(extras);
    return result;
}

static PyMethodDef methods[] = {
    {"survey", survey, METH_O, "survey(module) -> (tables, places): the tree's parameter and buffer dicts, and their tensors"},
    {"bind", bind, METH_VARARGS,
     "bind(module, survey, names, form_index, offsets, forms, swap, before_swap=None) -> (tensors, extras) | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_bindfast", NULL, -1, methods};

PyMODINIT_FUNC PyInit__bindfast(void) {
    if (!(s_parameters = PyUnicode_InternFromString("_parameters")) ||
        !(s_buffers = PyUnicode_InternFromString("_buffers")) || !(s_modules = PyUnicode_InternFromString("_modules")) ||
        !(s_shape = PyUnicode_InternFromString("shape")) || !(s_dtype = PyUnicode_InternFromString("dtype")) ||
        !(s_is_meta = PyUnicode_InternFromString("is_meta")))
        return NULL;
    return PyModule_Create(&moduledef);
}
