/*
 * replay._checks: two of a replay's exactness checks in C.
 *
 * 1. SettingsCheck, the check of the global torch settings.
 *
 * Why: a graph bakes in what torch chose under the settings of its recording, so every replay
 * reads about 25 settings (replay.region_keys.modes_changed) and compares each with its
 * recorded value. Generated Python pays a name lookup, a call and a comparison in bytecode per
 * setting (2 to 4 us a replay on the H200 machine, the largest part of replay's host time
 * above the graph launch); the readers themselves are C functions. This type makes the same
 * calls and the same comparisons from C.
 *
 * SettingsCheck(readers, arguments, expected, ways)() -> bool: True as soon as one reader's
 * value differs from its expected value (the rest are not read, as with Python's `or`), False
 * when none does. Per setting, `ways` says how it is compared:
 *   'i': identity (`value is not expected`; bools, None, dtypes: singletons),
 *   'e': equality (`value != expected`; strings, lists),
 *   'v': a pybind enum by its int (`value.value != expected`).
 * A reader that raises, or a comparison that does, raises out of the call; where the optional
 * `unreadable` callable was given (replay.region_keys gives it, as its generated check does),
 * an Exception (not a KeyboardInterrupt or other BaseException) is cleared instead and the
 * check returns what `unreadable()` returns: the replay is refused (True) with a warning,
 * never made without the setting. The readers are called with their arguments (a tuple each)
 * through vectorcall.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *readers;   /* tuple of callables */
    PyObject *arguments; /* tuple of tuples */
    PyObject *expected;  /* tuple */
    PyObject *unreadable; /* callable or NULL: what a reader's exception turns into */
    char *ways;          /* one of "iev" per reader */
    Py_ssize_t count;
    vectorcallfunc vectorcall;
} SettingsCheck;

static PyObject *s_value;

static int settings_traverse(SettingsCheck *self, visitproc visit, void *arg) {
    Py_VISIT(self->readers);
    Py_VISIT(self->arguments);
    Py_VISIT(self->expected);
    Py_VISIT(self->unreadable);
    return 0;
}

static int settings_clear(SettingsCheck *self) {
    Py_CLEAR(self->readers);
    Py_CLEAR(self->arguments);
    Py_CLEAR(self->expected);
    Py_CLEAR(self->unreadable);
    return 0;
}

static void settings_dealloc(SettingsCheck *self) {
    PyObject_GC_UnTrack(self);
    settings_clear(self);
    PyMem_Free(self->ways);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* 1: differs, 0: the same, -1: an exception is set. */
static int differs(char way, PyObject *value, PyObject *expected) {
    switch (way) {
    case 'i':
        return value != expected;
    case 'e':
        return PyObject_RichCompareBool(value, expected, Py_NE);
    default: { /* 'v' */
        PyObject *number = PyObject_GetAttr(value, s_value);
        if (number == NULL)
            return -1;
        int result = PyObject_RichCompareBool(number, expected, Py_NE);
        Py_DECREF(number);
        return result;
    }
    }
}

/* A reader or a comparison raised: with `unreadable`, an Exception becomes its answer. */
static PyObject *settings_failed(SettingsCheck *self) {
    if (self->unreadable == NULL || !PyErr_ExceptionMatches(PyExc_Exception))
        return NULL;
    PyErr_Clear();
    PyObject *answer = PyObject_CallNoArgs(self->unreadable);
    if (answer == NULL)
        return NULL;
    int truth = PyObject_IsTrue(answer);
    Py_DECREF(answer);
    if (truth < 0)
        return NULL;
    return Py_NewRef(truth ? Py_True : Py_False);
}

static PyObject *settings_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    SettingsCheck *self = (SettingsCheck *)callable;
    if (PyVectorcall_NARGS(nargsf) != 0 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "a settings check takes no arguments");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < self->count; i++) {
        PyObject *arguments = PyTuple_GET_ITEM(self->arguments, i);
        PyObject *value = PyObject_Vectorcall(PyTuple_GET_ITEM(self->readers, i),
                                              &PyTuple_GET_ITEM(arguments, 0), PyTuple_GET_SIZE(arguments), NULL);
        if (value == NULL)
            return settings_failed(self);
        int result = differs(self->ways[i], value, PyTuple_GET_ITEM(self->expected, i));
        Py_DECREF(value);
        if (result < 0)
            return settings_failed(self);
        if (result)
            Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

static PyObject *settings_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *readers, *arguments, *expected, *unreadable = Py_None;
    const char *ways;
    Py_ssize_t ways_length;
    static char *names[] = {"readers", "arguments", "expected", "ways", "unreadable", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!O!s#|$O", names, &PyTuple_Type, &readers, &PyTuple_Type,
                                     &arguments, &PyTuple_Type, &expected, &ways, &ways_length, &unreadable))
        return NULL;
    if (unreadable != Py_None && !PyCallable_Check(unreadable)) {
        PyErr_SetString(PyExc_TypeError, "unreadable must be callable or None");
        return NULL;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(readers);
    if (PyTuple_GET_SIZE(arguments) != count || PyTuple_GET_SIZE(expected) != count || ways_length != count) {
        PyErr_SetString(PyExc_ValueError, "readers, arguments, expected and ways must have one entry per setting");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyCallable_Check(PyTuple_GET_ITEM(readers, i))) {
            PyErr_Format(PyExc_TypeError, "readers[%zd] is not callable", i);
            return NULL;
        }
        if (!PyTuple_Check(PyTuple_GET_ITEM(arguments, i))) {
            PyErr_Format(PyExc_TypeError, "arguments[%zd] must be a tuple", i);
            return NULL;
        }
        if (ways[i] != 'i' && ways[i] != 'e' && ways[i] != 'v') {
            PyErr_Format(PyExc_ValueError, "ways[%zd] must be 'i', 'e' or 'v', got %c", i, ways[i]);
            return NULL;
        }
    }
    SettingsCheck *self = (SettingsCheck *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->ways = PyMem_Malloc((size_t)count + 1);
    if (self->ways == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    memcpy(self->ways, ways, (size_t)count);
    self->ways[count] = '\0';
    self->count = count;
    self->readers = Py_NewRef(readers);
    self->arguments = Py_NewRef(arguments);
    self->expected = Py_NewRef(expected);
    self->unreadable = unreadable == Py_None ? NULL : Py_NewRef(unreadable);
    self->vectorcall = settings_vectorcall;
    return (PyObject *)self;
}

static PyObject *settings_ways(SettingsCheck *self, void *unused) {
    return PyUnicode_FromStringAndSize(self->ways, self->count);
}

static PyGetSetDef settings_getset[] = {
    {"ways", (getter)settings_ways, NULL, "how each setting is compared ('i', 'e' or 'v')", NULL},
    {NULL},
};

static PyMemberDef settings_members[] = {
    {"readers", T_OBJECT, offsetof(SettingsCheck, readers), READONLY, "the reader of each setting"},
    {"arguments", T_OBJECT, offsetof(SettingsCheck, arguments), READONLY, "each reader's arguments"},
    {"expected", T_OBJECT, offsetof(SettingsCheck, expected), READONLY, "each setting's recorded value"},
    {"unreadable", T_OBJECT, offsetof(SettingsCheck, unreadable), READONLY,
     "what a reader's exception turns into (None: it raises out)"},
    {NULL},
};

static PyTypeObject SettingsCheckType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "replay._checks.SettingsCheck",
    .tp_basicsize = sizeof(SettingsCheck),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(SettingsCheck, vectorcall),
    .tp_doc = "SettingsCheck(readers, arguments, expected, ways, *, unreadable=None)() -> True when a setting "
              "differs (see csrc/replay_checks.c).",
    .tp_new = settings_new,
    .tp_dealloc = (destructor)settings_dealloc,
    .tp_traverse = (traverseproc)settings_traverse,
    .tp_clear = (inquiry)settings_clear,
    .tp_call = PyVectorcall_Call,
    .tp_members = settings_members,
    .tp_getset = settings_getset,
};

/*
 * 2. disjoint(pointers, extents) -> bool, the aliasing check of a graph recorded with its
 * tensor arguments all apart: whether the byte ranges [pointers[i], pointers[i] + extents[i])
 * are still pairwise disjoint (every extent > 0: empty tensors overlap nothing and are left
 * out by the caller). Sorted by first byte, each range must end at or before the next
 * begins: O(n log n) in C, where generated Python compares n(n-1)/2 pairs (6 us for 16
 * arguments on the CPU machine) or calls numpy (about 4 us for any count).
 */
typedef struct {
    unsigned long long lo, hi;
} Range;

static int by_first_byte(const void *a, const void *b) {
    unsigned long long x = ((const Range *)a)->lo, y = ((const Range *)b)->lo;
    return (x > y) - (x < y);
}

static int read_u64(PyObject *value, unsigned long long *out, const char *what, Py_ssize_t i) {
    if (!PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "%s[%zd] must be an int", what, i);
        return -1;
    }
    *out = PyLong_AsUnsignedLongLong(value);
    if (*out == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    return 0;
}

static PyObject *disjoint(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyTuple_Check(args[0]) || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "disjoint(pointers, extents) takes two tuples of ints");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(args[0]);
    if (PyTuple_GET_SIZE(args[1]) != n) {
        PyErr_SetString(PyExc_ValueError, "disjoint: one extent per pointer");
        return NULL;
    }
    Range small[64];
    Range *ranges = n <= 64 ? small : PyMem_Malloc(sizeof(Range) * (size_t)n);
    if (ranges == NULL)
        return PyErr_NoMemory();
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long extent;
        if (read_u64(PyTuple_GET_ITEM(args[0], i), &ranges[i].lo, "pointers", i) < 0 ||
            read_u64(PyTuple_GET_ITEM(args[1], i), &extent, "extents", i) < 0)
            goto done;
        if (extent == 0) {
            PyErr_Format(PyExc_ValueError, "disjoint: extents[%zd] is 0 (leave empty ranges out)", i);
            goto done;
        }
        ranges[i].hi = ranges[i].lo + extent;
        if (ranges[i].hi < ranges[i].lo) { /* past the end of the address space: no real tensor */
            PyErr_Format(PyExc_OverflowError, "disjoint: range %zd passes 2**64", i);
            goto done;
        }
    }
    qsort(ranges, (size_t)n, sizeof(Range), by_first_byte);
    result = Py_True;
    for (Py_ssize_t i = 1; i < n; i++)
        if (ranges[i].lo < ranges[i - 1].hi) {
            result = Py_False;
            break;
        }
    Py_INCREF(result);
done:
    if (ranges != small)
        PyMem_Free(ranges);
    return result;
}

static PyMethodDef module_methods[] = {
    {"disjoint", (PyCFunction)(void (*)(void))disjoint, METH_FASTCALL,
     "disjoint(pointers, extents) -> whether the byte ranges are pairwise disjoint (see csrc/replay_checks.c)"},
    {NULL},
};

static struct PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT, "replay._checks", "Two of a replay's exactness checks in C (see csrc/replay_checks.c).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__checks(void) {
    if ((s_value = PyUnicode_InternFromString("value")) == NULL)
        return NULL;
    if (PyType_Ready(&SettingsCheckType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_definition);
    if (module == NULL)
        return NULL;
    Py_INCREF(&SettingsCheckType);
    if (PyModule_AddObject(module, "SettingsCheck", (PyObject *)&SettingsCheckType) < 0) {
        Py_DECREF(&SettingsCheckType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
