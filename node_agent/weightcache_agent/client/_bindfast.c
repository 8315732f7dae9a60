/* The attach hot loop in C: build a view per manifest row and swap it into the module.
 *
 * Same contract as `rebind.bind_manifest`'s Python path, minus the diagnostics:
 *   survey  one walk of the module tree, every parameter and buffer by qualified name (UTF-8
 *           bytes in a hash table: no str is made); it needs the module alone, so an engine
 *           takes it while the agent prepares its answer;
 *   bind    reads the packed rows (`packed_rows`) where they lie; checks every row first -- its
 *           name looked up in the survey, its shape and dtype, its view inside the arena (a
 *           row the module does not declare is resolved from the root, see `resolve`, and
 *           becomes a buffer of its owner) -- then, once `before_swap` returned, makes one
 *           strided view per row a run of like rows at a time (see `make_views`) and swaps
 *           each view's storage into that tensor.
 * Anything unusual (a row with no owner, a shape or dtype that disagrees, a tensor left on
 * meta, a view reaching past the arena, a name that collides with an attribute, a tree nested
 * deeper than MAX_DEPTH) returns None having changed nothing, and the Python path then
 * produces the error that names every case. Malformed rows raise ValueError.
 *
 * Plain CPython API: torch is reached only through the Python objects handed in (the bound
 * `as_strided` of the arena per form, `torch._C._swap_tensor_impl`), so one build works
 * with every torch version. Where the torch-native row binder was built for the running torch
 * (_bindtorch.h), its table is handed in too and does each row's check and take inside torch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_bindtorch.h"

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

static int namebuf_reserve(NameBuf *buf, Py_ssize_t size) {
    if (size + 1 > buf->cap) {
        Py_ssize_t cap = (size + 1) * 2;
        char *text = PyMem_Realloc(buf->text, cap);
        if (text == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        buf->text = text, buf->cap = cap;
    }
    return 0;
}

static int namebuf_put(NameBuf *buf, Py_ssize_t at, PyObject *leaf, int dot) {
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(leaf, &n);
    if (s == NULL || namebuf_reserve(buf, at + n + 1) < 0)
        return -1;
    memcpy(buf->text + at, s, n);
    buf->len = at + n;
    if (dot)
        buf->text[buf->len++] = '.';
    return 0;
}

/* A name's hash, its bytes taken eight at a time. */
static uint64_t name_hash(const char *s, Py_ssize_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n, w;
    for (; n >= 8; s += 8, n -= 8) {
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
    }
    w = 0;
    memcpy(&w, s, (size_t)n);
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ull;
    return h ^ (h >> 29);
}

typedef struct {
    Py_ssize_t at, len;  /* the qualified name, in Survey.text */
    uint64_t hash;
    PyObject *tensor;    /* the module's non-None parameter or buffer (strong); NULL: a free slot */
} Entry;

typedef struct {
    Entry *slots;        /* open addressing, kept at most half full */
    size_t mask;
    Py_ssize_t used;
    NameBuf text;        /* every name, one after another */
    PtrSet tensors;      /* the distinct tensors among them */
    Py_ssize_t places;   /* how many */
    NameBuf name;        /* the name being built during the walk */
} Survey;

static const char SURVEY[] = "weightcache._bindfast.survey";

static void survey_free(Survey *sv) {
    for (size_t i = 0; sv->slots != NULL && i <= sv->mask; i++)
        Py_XDECREF(sv->slots[i].tensor);
    PyMem_Free(sv->slots);
    PyMem_Free(sv->text.text);
    PyMem_Free(sv->tensors.slots);
    PyMem_Free(sv->name.text);
    PyMem_Free(sv);
}

static void survey_capsule_free(PyObject *capsule) {
    survey_free(PyCapsule_GetPointer(capsule, SURVEY));
}

static Entry *survey_slot(const Survey *sv, const char *s, Py_ssize_t n, uint64_t h) {
    size_t i = h & sv->mask;
    while (sv->slots[i].tensor != NULL) {
        Entry *e = &sv->slots[i];
        if (e->hash == h && e->len == n && memcmp(sv->text.text + e->at, s, (size_t)n) == 0)
            break;
        i = (i + 1) & sv->mask;
    }
    return &sv->slots[i];
}

/* The tensor named `s`, borrowed, or NULL. */
static PyObject *survey_find(const Survey *sv, const char *s, Py_ssize_t n) {
    return survey_slot(sv, s, n, name_hash(s, n))->tensor;
}

static int survey_grow(Survey *sv) {
    size_t size = (sv->mask + 1) * 2;
    Entry *old = sv->slots, *slots = PyMem_Calloc(size, sizeof *slots);
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t old_size = sv->mask + 1;
    sv->slots = slots, sv->mask = size - 1;
    for (size_t i = 0; i < old_size; i++)
        if (old[i].tensor != NULL)
            *survey_slot(sv, "", -1, old[i].hash) = old[i];  /* a length no name has: the first free slot */
    PyMem_Free(old);
    return 0;
}

/* Record the name being built (sv->name) as `tensor`'s. */
static int survey_put(Survey *sv, PyObject *tensor) {
    if ((size_t)(sv->used + 1) * 2 > sv->mask + 1 && survey_grow(sv) < 0)
        return -1;
    const char *s = sv->name.text;
    Py_ssize_t n = sv->name.len;
    uint64_t h = name_hash(s, n);
    Entry *e = survey_slot(sv, s, n, h);
    if (e->tensor != NULL) {  /* named again (a table changed under the walk): the last one holds */
        Py_SETREF(e->tensor, Py_NewRef(tensor));
        return 0;
    }
    Py_ssize_t at = sv->text.len;
    if (namebuf_reserve(&sv->text, at + n) < 0)
        return -1;
    memcpy(sv->text.text + at, s, (size_t)n);
    sv->text.len = at + n;
    *e = (Entry){at, n, h, Py_NewRef(tensor)};
    sv->used++;
    return 0;
}

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
            rc = survey_put(sv, value);
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

/* survey(module) -> an opaque survey, or None
 *
 * One walk of the module tree: every non-None parameter and buffer by qualified name, and how
 * many distinct tensors they are. It depends on the module alone, so an engine takes it while
 * the agent prepares its answer. None where the Python path must walk it instead (nested deeper
 * than MAX_DEPTH, or a name with a lone surrogate). */
static PyObject *survey(PyObject *self, PyObject *module) {
    Survey *sv = PyMem_Calloc(1, sizeof *sv);
    if (sv == NULL)
        return PyErr_NoMemory();
    sv->mask = 4095;
    sv->slots = PyMem_Calloc(sv->mask + 1, sizeof *sv->slots);
    if (sv->slots == NULL) {
        survey_free(sv);
        return PyErr_NoMemory();
    }
    int rc = ptrset_init(&sv->tensors, 4096);
    if (rc == 0)
        rc = survey_module(sv, module, 0, 0);
    if (rc != 0) {
        survey_free(sv);
        return rc < 0 ? NULL : Py_NewRef(Py_None);
    }
    PyObject *capsule = PyCapsule_New(sv, SURVEY, survey_capsule_free);
    if (capsule == NULL)
        survey_free(sv);
    return capsule;
}

/* 1 if a surveyed tensor is still on meta and not among `bound`, 0 if none, -1 on error. */
static int left_on_meta(const Survey *sv, const PtrSet *bound) {
    for (size_t i = 0; i <= sv->mask; i++) {
        PyObject *tensor = sv->slots[i].tensor;
        if (tensor == NULL || ptrset_has(bound, tensor))
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
    const char *name;          /* the last name's UTF-8 (in the packed rows, alive for the bind) */
    Py_ssize_t depth;          /* its components resolved to submodules */
    Py_ssize_t end[MAX_DEPTH]; /* where component d ends (its '.') */
    PyObject *mod[MAX_DEPTH + 1];  /* mod[0]: the root; mod[d + 1]: component d's submodule (strong) */
} Path;

/* 0 where no error is set or the error is a name that is not UTF-8 (a lone surrogate passed
 * through: no module names one so, and the Python path says where it goes), else -1. */
static int not_utf8_or_error(void) {
    if (!PyErr_Occurred())
        return 0;
    if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
        return -1;
    PyErr_Clear();
    return 0;
}

static void path_cut(Path *path, Py_ssize_t depth) {
    for (Py_ssize_t d = depth; d < path->depth; d++)
        Py_CLEAR(path->mod[d + 1]);
    path->depth = depth;
}

/* The owner of the dotted name `s` (borrowed, via path) and its last component as a new str in
 * *leaf: 1 found, 0 no such submodule (or nested too deep, or not UTF-8), -1 error. */
static int resolve(Path *path, const char *s, Py_ssize_t len, PyObject **owner, PyObject **leaf) {
    Py_ssize_t pos = 0, d = 0;
    *owner = *leaf = NULL;
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
            return not_utf8_or_error();
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
        return not_utf8_or_error();
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

/* Where make_views hands each view (borrowed): the row's tensor takes the view's storage,
 * and the row is bound to that tensor; a row with no tensor of its own (a tie named again, a
 * buffer to be) is bound to the view. */
typedef struct {
    PyObject *swap, *bound, **current_of;
} Binding;

/* A form as the torch-native row binder takes it: the arena viewed as the form's dtype (borrowed
 * from the form tuple), and the shape and stride as C integers. */
typedef struct {
    PyObject *arena;
    Py_ssize_t ndim;
    int64_t *shape, *stride;
} NativeForm;

typedef struct {
    const WcTorchRows *rows;  /* NULL: every row the Python-level way */
    NativeForm *forms;
} Native;

static int bind_view(Binding *b, Py_ssize_t row, PyObject *view) {
    PyObject *current = b->current_of[row];
    if (current != NULL) {
        PyObject *pair[2] = {current, view};
        PyObject *ok = PyObject_Vectorcall(b->swap, pair, 2, NULL);
        if (ok == NULL)
            return -1;
        Py_DECREF(ok);
    }
    PyList_SET_ITEM(b->bound, row, Py_NewRef(current ? current : view));
    return 0;
}

/* A view per row, handed to `bind_view` a run at a time: rows of one form whose starts step
 * evenly -- the same tensor of every layer, one of `period` rows of that form per layer -- come
 * out of one view of the whole run, unbound along its first dimension. That is one torch call
 * per run, where a view each from `as_strided` costs twice what unbinding one does. A run's
 * views are dropped before the next run is made, so the next run's tensors take the memory
 * they (and the meta tensors they replaced) held: a bind touches about one run's worth of fresh
 * memory, where views made all at once cost a page fault per ~10 rows, and dearly in a process
 * whose host just streamed a checkpoint through its page cache. A run torch refuses is made
 * row by row, so the error is the row's own. With the torch-native row binder, a row's tensor
 * takes its place in the arena directly and no view is made; rows it declines go as above. */
static int make_views(PyObject *forms, const Py_ssize_t *form_of, const long long *start, Py_ssize_t n,
                      Binding *binding, const Native *native) {
    Py_ssize_t nforms = PyList_GET_SIZE(forms);
    Py_ssize_t *next = PyMem_Calloc(nforms + 1, sizeof *next), *order = PyMem_Malloc((n + 1) * sizeof *order);
    char *made = PyMem_Calloc(n + 1, 1);
    PyObject *parts = NULL;
    int rc = -1;
    if (next == NULL || order == NULL || made == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)  /* rows grouped by form, manifest order kept within a form */
        next[form_of[i] + 1]++;
    for (Py_ssize_t f = 0; f < nforms; f++)
        next[f + 1] += next[f];
    for (Py_ssize_t i = 0; i < n; i++)
        order[next[form_of[i]]++] = i;
    /* next[f] is now where form f's rows end in `order` */
    for (Py_ssize_t k = 0, f = 0; k < n; k++) {
        while (next[f] <= k)
            f++;
        Py_ssize_t row = order[k], period = 0, length = 1;
        if (made[row])
            continue;
        PyObject *current = binding->current_of[row];
        const NativeForm *nf = &native->forms[f];
        if (native->rows != NULL && current != NULL && nf->shape != NULL) {  /* no view: the tensor takes the arena */
            int taken = native->rows->take(current, nf->arena, nf->ndim, nf->shape, nf->stride, start[row]);
            if (taken < 0)
                goto done;
            if (taken == 0) {
                made[row] = 1;
                PyList_SET_ITEM(binding->bound, row, Py_NewRef(current));
                continue;
            }
        }
        for (Py_ssize_t p = 1; p <= MAX_PERIOD && k + p < next[f]; p++) {
            long long step = start[order[k + p]] - start[row];
            Py_ssize_t len = 1;
            while (step >= 0 && k + len * p < next[f] && !made[order[k + len * p]] &&
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
                for (Py_ssize_t t = 0; t < length; t++) {
                    made[order[k + t * period]] = 1;
                    if (bind_view(binding, order[k + t * period], PyTuple_GET_ITEM(parts, t)) < 0)
                        goto done;
                }
                Py_CLEAR(parts);
                continue;
            }
            Py_CLEAR(parts);
            PyErr_Clear();
        }
        PyObject *view = strided(form, start[row], 0, 0);
        made[row] = 1;
        int taken = view ? bind_view(binding, row, view) : -1;
        Py_XDECREF(view);
        if (taken < 0)
            goto done;
    }
    rc = 0;
done:
    Py_XDECREF(parts);
    PyMem_Free(next);
    PyMem_Free(order);
    PyMem_Free(made);
    return rc;
}

/* `form`'s shape and stride as C integers, for the torch-native row binder (one allocation, freed
 * through nf->shape). A form it cannot express (shape and stride of different lengths, a value
 * that is no C integer) keeps nf->shape NULL: its rows go the Python-level way, where torch
 * names the problem. */
static int native_form(NativeForm *nf, PyObject *form) {
    PyObject *shape = PyTuple_GET_ITEM(form, 1), *stride = PyTuple_GET_ITEM(form, 2);
    Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
    if (PyTuple_GET_SIZE(stride) != ndim)
        return 0;
    if ((nf->shape = PyMem_Malloc((2 * ndim + 1) * sizeof(int64_t))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    nf->stride = nf->shape + ndim;
    nf->ndim = ndim;
    nf->arena = PyTuple_GET_ITEM(form, 7);
    for (Py_ssize_t d = 0; d < ndim; d++) {
        PyObject *size = PyTuple_GET_ITEM(shape, d), *step = PyTuple_GET_ITEM(stride, d);
        nf->shape[d] = PyLong_Check(size) ? PyLong_AsLongLong(size) : -1;
        nf->stride[d] = PyLong_Check(step) ? PyLong_AsLongLong(step) : -1;
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        if (PyErr_Occurred() || nf->shape[d] < 0 || nf->stride[d] < 0) {
            PyErr_Clear();
            PyMem_Free(nf->shape);
            nf->shape = nf->stride = NULL;
            return 0;
        }
    }
    return 0;
}

/* Packed rows (see packed_rows.py): offsets int64[n], form indices uint32[n], name ends uint32[n], names. */
typedef struct {
    const char *offsets, *forms, *ends, *names;
    Py_ssize_t names_len;
} Rows;

static uint32_t row_u32(const char *column, Py_ssize_t i) {
    uint32_t v;
    memcpy(&v, column + 4 * i, 4);
    return v;
}

/* Row i's name: where it starts in rows->names, and its length. */
static Py_ssize_t row_name(const Rows *rows, Py_ssize_t i, Py_ssize_t *len) {
    Py_ssize_t begin = i ? row_u32(rows->ends, i - 1) : 0;
    *len = row_u32(rows->ends, i) - begin;
    return begin;
}

/* bind(module, survey, rows, count, forms, swap, before_swap=None, torch_rows=None) -> (bound, extras) or None
 *
 * survey: what `survey(module)` returned, or None to survey here. rows: `count` packed rows, any
 * bytes-like object. forms: list of (as_strided of the arena viewed as the form's dtype, shape
 * tuple, stride tuple, itemsize, dtype, extent, limit, the arena viewed as the form's dtype): a
 * tensor of the form spans `extent` elements, and the arena holds `limit` of them. before_swap:
 * called once every row has checked out, before the first swap. torch_rows: the torch-native
 * row binder's capsule (_bindtorch.h), or None. bound: per row, the tensor now bound (the module's own,
 * or the view where the module does not declare the row); extras: (owner, leaf, row) of those
 * rows. Every row is checked -- its tensor, shape, dtype, and that its view lies inside the
 * arena -- before the first view is made, so views and swaps then go a run at a time and
 * nothing after the checks can fail but memory running out. */
static PyObject *bind(PyObject *self, PyObject *args) {
    PyObject *module, *surveyed, *forms, *swap, *before_swap = Py_None, *torch_rows = Py_None;
    Py_buffer packed;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OOy*nO!O|OO", &module, &surveyed, &packed, &n, &PyList_Type, &forms, &swap,
                          &before_swap, &torch_rows))
        return NULL;
    Py_ssize_t nforms = PyList_GET_SIZE(forms);
    if (n < 0 || packed.len / 16 < n) {
        PyErr_Format(PyExc_ValueError, "packed rows: %zd bytes cannot hold %zd rows", packed.len, n);
        PyBuffer_Release(&packed);
        return NULL;
    }
    const char *data = packed.buf;
    Rows rows = {data, data + 8 * n, data + 12 * n, data + 16 * n, packed.len - 16 * n};
    if (surveyed == Py_None)
        surveyed = survey(NULL, module);
    else
        Py_INCREF(surveyed);
    if (surveyed == NULL) {
        PyBuffer_Release(&packed);
        return NULL;
    }
    Path path = {.name = NULL, .depth = 0, .mod = {Py_NewRef(module)}};
    PtrSet bound_set = {NULL, 0};
    PyObject *extras = PyList_New(0), *result = NULL;
    Binding binding = {swap, NULL, PyMem_Calloc(n + 1, sizeof(PyObject *))};
    Py_ssize_t *form_of = PyMem_Malloc((n + 1) * sizeof *form_of);
    long long *start = PyMem_Malloc((n + 1) * sizeof *start);
    long long *extent = PyMem_Malloc((nforms + 1) * sizeof *extent);
    long long *limit = PyMem_Malloc((nforms + 1) * sizeof *limit);
    Native native = {NULL, PyMem_Calloc(nforms + 1, sizeof(NativeForm))};
    const Survey *sv = NULL;
    Py_ssize_t targets = 0;
    if (extras == NULL || form_of == NULL || start == NULL || extent == NULL || limit == NULL ||
        native.forms == NULL || binding.current_of == NULL || ptrset_init(&bound_set, n + 1) < 0) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t f = 0; f < nforms; f++) {
        PyObject *form = PyList_GET_ITEM(forms, f);
        if (!PyTuple_Check(form) || PyTuple_GET_SIZE(form) != 8 || !PyTuple_Check(PyTuple_GET_ITEM(form, 1)) ||
            !PyTuple_Check(PyTuple_GET_ITEM(form, 2)) || !PyLong_Check(PyTuple_GET_ITEM(form, 3))) {
            PyErr_SetString(PyExc_TypeError,
                            "forms must be (as_strided, shape, stride, itemsize, dtype, extent, limit, arena) tuples");
            goto done;
        }
        extent[f] = PyLong_AsLongLong(PyTuple_GET_ITEM(form, 5));
        limit[f] = extent[f] == -1 && PyErr_Occurred() ? -1 : PyLong_AsLongLong(PyTuple_GET_ITEM(form, 6));
        if (PyErr_Occurred() || (torch_rows != Py_None && native_form(&native.forms[f], form) < 0))
            goto done;
    }
    if (torch_rows != Py_None && (native.rows = PyCapsule_GetPointer(torch_rows, WC_TORCH_ROWS_CAPSULE)) == NULL)
        goto done;
    if (surveyed == Py_None)  /* nested too deep for the C walk */
        goto unclean;
    if ((sv = PyCapsule_GetPointer(surveyed, SURVEY)) == NULL) {
        PyErr_SetString(PyExc_TypeError, "survey must be what _bindfast.survey returned");
        goto done;
    }
    for (Py_ssize_t i = 0, end = 0; i < n; i++) {
        long long at;
        memcpy(&at, rows.offsets + 8 * i, 8);
        uint32_t f = row_u32(rows.forms, i), next_end = row_u32(rows.ends, i);
        if (next_end < end || next_end > rows.names_len) {
            PyErr_Format(PyExc_ValueError, "packed rows: row %zd's name ends at byte %u, outside %zd..%zd", i,
                         next_end, end, rows.names_len);
            goto done;
        }
        end = next_end;
        if (f >= (uint32_t)nforms) {
            PyErr_Format(PyExc_ValueError, "row %zd: form %u is not one of the %zd forms", i, f, nforms);
            goto done;
        }
        long long itemsize = PyLong_AsLongLong(PyTuple_GET_ITEM(PyList_GET_ITEM(forms, f), 3));
        if (itemsize <= 0 || at < 0 || at % itemsize) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "row %zd at offset %lld is not aligned to its elements", i, at);
            goto done;
        }
        form_of[i] = f;
        start[i] = at / itemsize;
        if (start[i] > limit[f] || extent[f] > limit[f] - start[i])  /* torch says why */
            goto unclean;
    }

    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len, at = row_name(&rows, i, &len);
        const char *name = rows.names + at;
        PyObject *form = PyList_GET_ITEM(forms, form_of[i]);
        PyObject *current = survey_find(sv, name, len);  /* borrowed */
        if (current == NULL) {  /* a row the module does not declare: a buffer of its owner, if free */
            PyObject *owner = NULL, *leaf = NULL, *taken, *row = NULL, *extra = NULL;
            int found = resolve(&path, name, len, &owner, &leaf);
            int place = found == 1 ? place_of(owner, leaf, &taken) : found == 0 ? 2 : -1;
            if (place == 0 && (row = PyLong_FromSsize_t(i)) != NULL)
                extra = PyTuple_Pack(3, owner, leaf, row);
            int failed = place < 0 || (place == 0 && (extra == NULL || PyList_Append(extras, extra) < 0));
            Py_XDECREF(extra);
            Py_XDECREF(row);
            Py_XDECREF(leaf);
            if (failed)
                goto done;
            if (place != 0)  /* no such submodule, or the name is taken (1: declared since the survey) */
                goto unclean;
            continue;
        }
        if (!ptrset_add(&bound_set, current))  /* a tied tensor the cache also holds under another name: bound once */
            continue;
        const NativeForm *nf = &native.forms[form_of[i]];
        int same = native.rows && nf->shape ? native.rows->same_form(current, nf->arena, nf->ndim, nf->shape) : 2;
        if (same == 2) {  /* the Python-level way */
            PyObject *shape = PyObject_GetAttr(current, s_shape);
            PyObject *dtype = shape ? PyObject_GetAttr(current, s_dtype) : NULL;
            same = dtype == NULL ? -1 : PyObject_RichCompareBool(shape, PyTuple_GET_ITEM(form, 1), Py_EQ);
            if (same == 1)
                same = dtype == PyTuple_GET_ITEM(form, 4);
            Py_XDECREF(shape);
            Py_XDECREF(dtype);
        }
        if (same < 0)
            goto done;
        if (!same)
            goto unclean;
        binding.current_of[i] = Py_NewRef(current);
        targets++;
    }
    /* Fewer tensors bound than the module holds: one may still be on meta (or a tie named once). */
    if (targets != sv->places) {
        int left = left_on_meta(sv, &bound_set);
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
    if ((binding.bound = PyList_New(n)) == NULL || make_views(forms, form_of, start, n, &binding, &native) < 0)
        goto done;
    result = PyTuple_Pack(2, binding.bound, extras);
    goto done;
unclean:  /* nothing swapped: the Python path names every problem */
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; binding.current_of != NULL && i < n; i++)
        Py_XDECREF(binding.current_of[i]);
    path_cut(&path, 0);
    Py_DECREF(path.mod[0]);
    PyMem_Free(binding.current_of);
    PyMem_Free(form_of);
    PyMem_Free(start);
    PyMem_Free(extent);
    PyMem_Free(limit);
    for (Py_ssize_t f = 0; native.forms != NULL && f < nforms; f++)
        PyMem_Free(native.forms[f].shape);
    PyMem_Free(native.forms);
    PyMem_Free(bound_set.slots);
    Py_DECREF(surveyed);
    Py_XDECREF(binding.bound);
    Py_XDECREF(extras);
    PyBuffer_Release(&packed);
    return result;
}

static PyMethodDef methods[] = {
    {"survey", survey, METH_O, "survey(module) -> the tree's parameters and buffers by name (opaque), or None"},
    {"bind", bind, METH_VARARGS,
     "bind(module, survey, rows, count, forms, swap, before_swap=None, torch_rows=None) -> (bound, extras) | None"},
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
