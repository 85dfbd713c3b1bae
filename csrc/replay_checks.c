/*
 * replay._checks: two of a replay's exactness checks in C, and two readers the first one calls.
 *
 * 1. SettingsCheck, the check of the global torch settings.
 *
 * Why: a graph bakes in what torch chose under the settings of its recording, so every replay
 * reads every setting the key holds (replay.torch_state.modes_changed) and compares each with
 * its recorded value. In generated Python each costs a name lookup, a call and a comparison in
 * bytecode; the readers themselves are C functions. This type makes the same calls and the
 * same comparisons from C, and where the torch-side helper is loaded it answers from the
 * helper's state (most settings read through torch's C++ getters into one tuple) instead.
 *
 * SettingsCheck(program, *, unreadable=None)() -> bool: True as soon as one test's value
 * differs from its expected value (the rest are not read, as with Python's `or`), False when
 * none does. `program` is a replay.torch_state.SettingsProgram, read by name once:
 *   readers, arguments, expected: a tuple each, one entry per test (a reader is called with
 *     its arguments through vectorcall);
 *   ways: a str, one of "iev" per test:
 *     'i': identity (`value is not expected`; bools, None, dtypes: singletons),
 *     'e': equality (`value != expected`; strings, lists, ints),
 *     'v': a pybind enum by its int (`value.value != expected`);
 *   state: None, or a capsule named "jitcore._torch_native.settings_reader" (the torch-side
 *     helper's SETTINGS_READER) holding Py_ssize_t read(int64_t *values, Py_ssize_t capacity):
 *     the settings state, the count of values written, or -1 where it cannot be read;
 *   uncovered: the indices of the tests the state does not determine.
 * With a state: while the state read now equals the reference (a state in which every test
 * said "the same"), only the uncovered tests run; otherwise every test runs, and where none
 * differs and the state read again afterwards is still the one read before (nothing moved
 * meanwhile, another thread may set a global), that state becomes the reference. A state that
 * cannot be read runs every test and arms nothing.
 * A reader that raises, or a comparison that does, raises out of the call; where the optional
 * `unreadable` callable was given (replay.torch_state gives it, as its generated check does),
 * an Exception (not a KeyboardInterrupt or other BaseException) is cleared instead and the
 * check returns what `unreadable()` returns: the replay is refused (True) with a warning,
 * never made without the setting.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <structmember.h>

#define SETTINGS_CAPACITY 256
#define READER_CAPSULE "jitcore._torch_native.settings_reader"

typedef struct {
    PyObject_HEAD
    PyObject *readers;    /* tuple of callables */
    PyObject *arguments;  /* tuple of tuples */
    PyObject *expected;   /* tuple */
    PyObject *unreadable; /* callable or NULL: what a reader's exception turns into */
    PyObject *state;      /* the reader's capsule, or NULL */
    Py_ssize_t (*read)(int64_t *values, Py_ssize_t capacity); /* the state reader, or NULL */
    int64_t reference[SETTINGS_CAPACITY]; /* the state in which every test last said "the same" */
    Py_ssize_t reference_count; /* its length; -1: none yet */
    PyObject *uncovered;  /* tuple of ints, kept for inspection */
    Py_ssize_t *uncovered_at; /* the same indices, read per call */
    Py_ssize_t uncovered_count;
    char *ways;           /* one of "iev" per reader */
    Py_ssize_t count;
    vectorcallfunc vectorcall;
} SettingsCheck;

static PyObject *s_value, *s_readers, *s_arguments, *s_expected, *s_ways, *s_state, *s_uncovered;

static int settings_traverse(SettingsCheck *self, visitproc visit, void *arg) {
    Py_VISIT(self->readers);
    Py_VISIT(self->arguments);
    Py_VISIT(self->expected);
    Py_VISIT(self->unreadable);
    Py_VISIT(self->state);
    Py_VISIT(self->uncovered);
    return 0;
}

static int settings_clear(SettingsCheck *self) {
    Py_CLEAR(self->readers);
    Py_CLEAR(self->arguments);
    Py_CLEAR(self->expected);
    Py_CLEAR(self->unreadable);
    Py_CLEAR(self->state);
    self->read = NULL;
    Py_CLEAR(self->uncovered);
    return 0;
}

static void settings_dealloc(SettingsCheck *self) {
    PyObject_GC_UnTrack(self);
    settings_clear(self);
    PyMem_Free(self->ways);
    PyMem_Free(self->uncovered_at);
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

/* Test i: 1 differs, 0 the same, -1 an exception is set. */
static int test_differs(SettingsCheck *self, Py_ssize_t i) {
    PyObject *arguments = PyTuple_GET_ITEM(self->arguments, i);
    PyObject *value = PyObject_Vectorcall(PyTuple_GET_ITEM(self->readers, i), &PyTuple_GET_ITEM(arguments, 0),
                                          PyTuple_GET_SIZE(arguments), NULL);
    if (value == NULL)
        return -1;
    int result = differs(self->ways[i], value, PyTuple_GET_ITEM(self->expected, i));
    Py_DECREF(value);
    return result;
}

/* Every test (`at` NULL), or the `count` tests at the indices `at`: the first difference ends it. */
static int tests_differ(SettingsCheck *self, const Py_ssize_t *at, Py_ssize_t count) {
    for (Py_ssize_t n = 0; n < count; n++) {
        int result = test_differs(self, at == NULL ? n : at[n]);
        if (result != 0)
            return result;
    }
    return 0;
}

/* The state now into `values` (SETTINGS_CAPACITY of them): its length, or -1 where it cannot be read. */
static Py_ssize_t read_state(SettingsCheck *self, int64_t *values) {
    return self->read(values, SETTINGS_CAPACITY);
}

/* Every test said "the same" in the state `now`: it becomes the reference if nothing moved
 * meanwhile (read again: another thread may set a global). */
static void arm(SettingsCheck *self, const int64_t *now, Py_ssize_t count) {
    int64_t after[SETTINGS_CAPACITY];
    if (read_state(self, after) == count && memcmp(after, now, sizeof(int64_t) * (size_t)count) == 0) {
        memcpy(self->reference, now, sizeof(int64_t) * (size_t)count);
        self->reference_count = count;
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

static PyObject *answer(SettingsCheck *self, int result) {
    if (result < 0)
        return settings_failed(self);
    return Py_NewRef(result ? Py_True : Py_False);
}

/* The check with a state: the uncovered tests alone while the state is the reference. */
static PyObject *check_with_state(SettingsCheck *self) {
    int64_t now[SETTINGS_CAPACITY];
    Py_ssize_t count = read_state(self, now);
    if (count >= 0 && count == self->reference_count &&
        memcmp(now, self->reference, sizeof(int64_t) * (size_t)count) == 0)
        return answer(self, tests_differ(self, self->uncovered_at, self->uncovered_count));
    int result = tests_differ(self, NULL, self->count);
    if (result == 0 && count >= 0)
        arm(self, now, count);
    return answer(self, result);
}

static PyObject *settings_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    SettingsCheck *self = (SettingsCheck *)callable;
    if (PyVectorcall_NARGS(nargsf) != 0 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "a settings check takes no arguments");
        return NULL;
    }
    if (self->read != NULL)
        return check_with_state(self);
    return answer(self, tests_differ(self, NULL, self->count));
}

/* Read the program's fields by name into `self` (new references), checking every entry. */
static int read_tests(SettingsCheck *self, PyObject *program) {
    self->readers = PyObject_GetAttr(program, s_readers);
    self->arguments = self->readers ? PyObject_GetAttr(program, s_arguments) : NULL;
    self->expected = self->arguments ? PyObject_GetAttr(program, s_expected) : NULL;
    PyObject *ways = self->expected ? PyObject_GetAttr(program, s_ways) : NULL;
    if (ways == NULL)
        return -1;
    if (!PyTuple_Check(self->readers) || !PyTuple_Check(self->arguments) || !PyTuple_Check(self->expected) ||
        !PyUnicode_Check(ways)) {
        Py_DECREF(ways);
        PyErr_SetString(PyExc_TypeError, "a settings program's readers, arguments and expected are tuples, ways a str");
        return -1;
    }
    Py_ssize_t length;
    const char *text = PyUnicode_AsUTF8AndSize(ways, &length);
    self->count = PyTuple_GET_SIZE(self->readers);
    if (text != NULL && (PyTuple_GET_SIZE(self->arguments) != self->count ||
                         PyTuple_GET_SIZE(self->expected) != self->count || length != self->count))
        PyErr_SetString(PyExc_ValueError, "readers, arguments, expected and ways must have one entry per setting");
    else if (text != NULL && (self->ways = PyMem_Malloc((size_t)self->count + 1)) == NULL)
        PyErr_NoMemory();
    else if (text != NULL)
        memcpy(self->ways, text, (size_t)self->count + 1);
    Py_DECREF(ways);
    if (self->ways == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < self->count; i++) {
        if (!PyCallable_Check(PyTuple_GET_ITEM(self->readers, i)))
            return PyErr_Format(PyExc_TypeError, "readers[%zd] is not callable", i), -1;
        if (!PyTuple_Check(PyTuple_GET_ITEM(self->arguments, i)))
            return PyErr_Format(PyExc_TypeError, "arguments[%zd] must be a tuple", i), -1;
        if (self->ways[i] != 'i' && self->ways[i] != 'e' && self->ways[i] != 'v')
            return PyErr_Format(PyExc_ValueError, "ways[%zd] must be 'i', 'e' or 'v', got %c", i, self->ways[i]), -1;
    }
    return 0;
}

/* Read the program's state and uncovered tests (a state reader None: every test, every call). */
static int read_state_fields(SettingsCheck *self, PyObject *program) {
    PyObject *state = PyObject_GetAttr(program, s_state);
    if (state == NULL)
        return -1;
    self->reference_count = -1;
    if (state == Py_None) {
        Py_DECREF(state);
    } else if (!PyCapsule_IsValid(state, READER_CAPSULE)) {
        Py_DECREF(state);
        PyErr_SetString(PyExc_TypeError, "a settings program's state must be None or a " READER_CAPSULE " capsule");
        return -1;
    } else {
        self->state = state;
        self->read = (Py_ssize_t(*)(int64_t *, Py_ssize_t))PyCapsule_GetPointer(state, READER_CAPSULE);
    }
    self->uncovered = PyObject_GetAttr(program, s_uncovered);
    if (self->uncovered == NULL)
        return -1;
    if (!PyTuple_Check(self->uncovered)) {
        PyErr_SetString(PyExc_TypeError, "a settings program's uncovered must be a tuple of ints");
        return -1;
    }
    self->uncovered_count = PyTuple_GET_SIZE(self->uncovered);
    self->uncovered_at = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(self->uncovered_count + 1));
    if (self->uncovered_at == NULL)
        return PyErr_NoMemory(), -1;
    for (Py_ssize_t n = 0; n < self->uncovered_count; n++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(self->uncovered, n));
        if (i == -1 && PyErr_Occurred())
            return -1;
        if (i < 0 || i >= self->count)
            return PyErr_Format(PyExc_ValueError, "uncovered[%zd] is not the index of a test", n), -1;
        self->uncovered_at[n] = i;
    }
    return 0;
}

static PyObject *settings_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *program, *unreadable = Py_None;
    static char *names[] = {"program", "unreadable", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|$O", names, &program, &unreadable))
        return NULL;
    if (unreadable != Py_None && !PyCallable_Check(unreadable)) {
        PyErr_SetString(PyExc_TypeError, "unreadable must be callable or None");
        return NULL;
    }
    SettingsCheck *self = (SettingsCheck *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (read_tests(self, program) < 0 || read_state_fields(self, program) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->unreadable = unreadable == Py_None ? NULL : Py_NewRef(unreadable);
    self->vectorcall = settings_vectorcall;
    return (PyObject *)self;
}

static PyObject *settings_ways(SettingsCheck *self, void *unused) {
    return PyUnicode_FromStringAndSize(self->ways, self->count);
}

static PyObject *settings_armed(SettingsCheck *self, void *unused) {
    return Py_NewRef(self->reference_count >= 0 ? Py_True : Py_False);
}

static PyGetSetDef settings_getset[] = {
    {"ways", (getter)settings_ways, NULL, "how each setting is compared ('i', 'e' or 'v')", NULL},
    {"armed", (getter)settings_armed, NULL, "whether a reference state answers for the covered tests", NULL},
    {NULL},
};

static PyMemberDef settings_members[] = {
    {"readers", T_OBJECT, offsetof(SettingsCheck, readers), READONLY, "the reader of each setting"},
    {"arguments", T_OBJECT, offsetof(SettingsCheck, arguments), READONLY, "each reader's arguments"},
    {"expected", T_OBJECT, offsetof(SettingsCheck, expected), READONLY, "each setting's recorded value"},
    {"state", T_OBJECT, offsetof(SettingsCheck, state), READONLY, "the settings state reader's capsule, or None"},
    {"uncovered", T_OBJECT, offsetof(SettingsCheck, uncovered), READONLY, "the tests the state does not decide"},
    {"unreadable", T_OBJECT, offsetof(SettingsCheck, unreadable), READONLY,
     "what a reader's exception turns into (None: it raises out)"},
    {NULL},
};

static PyTypeObject SettingsCheckType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "replay._checks.SettingsCheck",
    .tp_basicsize = sizeof(SettingsCheck),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(SettingsCheck, vectorcall),
    .tp_doc = "SettingsCheck(program, *, unreadable=None)() -> True when a setting differs (see "
              "csrc/replay_checks.c).",
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
 * begins: O(n log n) in C, where generated Python compares n(n-1)/2 pairs or calls numpy.
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

/*
 * 3. Two readers of global state that torch has no getter for, so that the settings check
 * calls a C function for them as for torch's own getters (replay.torch_state has the same in
 * Python, used where this module was not built):
 * flush_denormal() -> bool, whether the CPU flushes denormals on this thread
 * (torch.set_flush_denormal): the smallest double times one is zero under flush-to-zero or
 * denormals-are-zero, computed at run time (volatile) on the same floating-point unit;
 * total_length(*sized) -> int, the sum of the arguments' lengths (the global module hooks:
 * any registered hook refuses a key).
 */
static PyObject *flush_denormal(PyObject *module, PyObject *unused) {
    volatile double smallest = 5e-324, one = 1.0;
    double product = smallest * one;
    return Py_NewRef(product == 0.0 ? Py_True : Py_False);
}

static PyObject *total_length(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        Py_ssize_t length = PyObject_Length(args[i]);
        if (length < 0)
            return NULL;
        if (length > PY_SSIZE_T_MAX - total) {
            PyErr_SetString(PyExc_OverflowError, "total_length: the lengths add up past the largest size");
            return NULL;
        }
        total += length;
    }
    return PyLong_FromSsize_t(total);
}

static PyMethodDef module_methods[] = {
    {"disjoint", (PyCFunction)(void (*)(void))disjoint, METH_FASTCALL,
     "disjoint(pointers, extents) -> whether the byte ranges are pairwise disjoint (see csrc/replay_checks.c)"},
    {"flush_denormal", (PyCFunction)flush_denormal, METH_NOARGS,
     "flush_denormal() -> whether the CPU flushes denormals on this thread (see csrc/replay_checks.c)"},
    {"total_length", (PyCFunction)(void (*)(void))total_length, METH_FASTCALL,
     "total_length(*sized) -> the sum of the arguments' lengths"},
    {NULL},
};

static struct PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT, "replay._checks", "A replay's exactness checks in C: torch's settings, the aliasing of arguments (see csrc/replay_checks.c).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__checks(void) {
    PyObject **names[] = {&s_value, &s_readers, &s_arguments, &s_expected, &s_ways, &s_state, &s_uncovered};
    const char *texts[] = {"value", "readers", "arguments", "expected", "ways", "state", "uncovered"};
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++)
        if ((*names[i] = PyUnicode_InternFromString(texts[i])) == NULL)
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
