/*
 * replay._checks: three of a replay's exactness checks in C, and two readers the first one calls
 * (the watch of what a region reaches is section 4).
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

#include "replay_support.h"

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

/*
 * 4. WatchCheck, the watch of the state a region reaches through its globals, closures and
 * objects (replay.watch): the dicts, lists and objects that hold what it reads, and the tensors
 * among them, as they were when its graphs were recorded.
 *
 * Why: a graph bakes the tensors it reads where they lie (a module's weights) and the Python
 * values the region read while it was recorded (`self.scale`, `self.training`), so a parameter
 * replaced (`load_state_dict(..., assign=True)`), moved (`.data =`, `.half()`, `.to()`), resized,
 * or an attribute set, must make the region record again. The check runs on every call that may
 * replay; in generated Python it would cost a bytecode step per value.
 *
 * WatchCheck(program, *, tags=True)() -> bool: True as soon as something watched changed, False
 * where nothing did. `program` is a replay.watch.WatchProgram, read by name once:
 *   dicts, dict_keys, dict_values: the dicts held, and per dict the keys and the values it held
 *     (tuples in the dict's own order, as PyDict_Next and dict.items walk it);
 *   lists, list_items: the same for lists;
 *   objects, types, object_dicts: objects, their classes and their __dict__ (None: none);
 *   tensors, words, reader: the tensors, each one's state as the torch-side helper's
 *     read_tensor_state read it (a tuple of ints; None: compared in Python), and the helper's
 *     replay_support capsule (csrc/replay_support.h; None: every tensor is compared in Python);
 *   others: how many other holders (sets, slots) there are, each compared in Python;
 *   same(kind, index) -> bool: the exact comparison, in Python, of holder `index` of a kind
 *     ('d' a dict, 'l' a list, 't' a tensor, 'o' another holder).
 * A dict or list is the same where its size and every key and value are the same objects in the
 * same order; where one differs, `same` decides (a scalar set to an equal value is the same). An
 * object must have its class and its __dict__. A tensor must read the words it had: all of them
 * are compared by one call of the helper's tensor_states_unlike, and only a tensor it stops at is
 * read again alone (and, where the helper does not read it now, compared in Python).
 *
 * Dicts are most of what a module tree holds (eight per nn.Module), so they are not walked on
 * every call where the interpreter can say that none changed. From CPython 3.12 (with the GIL), a
 * dict watcher (PyDict_AddWatcher) watches every dict a check holds and moves one epoch on any
 * change to any of them: while the epoch is the one at which a check last found its dicts the
 * same, it skips them, except, from 3.13, the objects' __dict__s (3.13 writes an object's
 * attributes into its values without telling the watchers). Otherwise, where the interpreter
 * moves a dict's version tag on every change (3.10 to 3.12: 3.13 leaves it too), a dict whose
 * tag is the one it had when it last compared the same is not walked again; else it is walked.
 * An epoch or tag is taken as the reference only where it did not move while the dicts were
 * compared. `tags` False walks every dict on every call (for tests and measurements).
 */
#define WATCH_WORDS 64
#if PY_VERSION_HEX < 0x030D0000 && !defined(Py_GIL_DISABLED)
#define WATCH_TAGS 1
#else
#define WATCH_TAGS 0
#endif
#if PY_VERSION_HEX >= 0x030C0000 && !defined(Py_GIL_DISABLED)
#define WATCH_EPOCH 1
/* whether the watchers hear of every write to an object's attributes (not from 3.13) */
#define WATCH_EPOCH_ATTRIBUTES (PY_VERSION_HEX < 0x030D0000)
static int dict_watcher = -1;          /* the dict watcher's id; -1: none could be added */
static uint64_t watched_epoch = 1;     /* moved by every change of a dict any check watches */

static int on_watched_dict(PyDict_WatchEvent event, PyObject *dict, PyObject *key, PyObject *value) {
    (void)dict, (void)key, (void)value;
    if (event != PyDict_EVENT_DEALLOCATED) /* a dict no check holds any more */
        watched_epoch++;
    return 0;
}
#else
#define WATCH_EPOCH 0
#endif

typedef struct {
    PyObject_HEAD
    PyObject *dicts, *dict_keys, *dict_values; /* tuples */
    PyObject *lists, *list_items;
    PyObject *objects, *types, *object_dicts;
    PyObject *tensors, *words, *reader;
    PyObject *same;                  /* callable(kind, index) -> bool */
    Py_ssize_t others;
    const replay_support *support;   /* the helper's functions; NULL: every tensor in Python */
    PyObject **batch;                /* the tensors with words, compared by one call */
    const int64_t **batch_words;     /* their words */
    Py_ssize_t *batch_index;         /* their indices among the tensors */
    Py_ssize_t batch_count;
    uint64_t *tags;                  /* per dict: the tag it had when it last compared the same; 0 none */
    char *covered;                   /* per dict: whether the epoch says when it changed */
    int64_t *recorded;               /* every tensor's words, one after another */
    Py_ssize_t *at, *count;          /* per tensor: where its words start, how many (-1: in Python) */
    int use_tags, use_epoch;
    uint64_t epoch;                  /* the epoch at which the dicts last compared the same; 0 none */
    vectorcallfunc vectorcall;
} WatchCheck;

static PyObject *s_dicts, *s_dict_keys, *s_dict_values, *s_lists, *s_list_items, *s_objects, *s_types,
    *s_object_dicts, *s_tensors, *s_words, *s_reader, *s_same, *s_others;
static PyObject *kind_dict, *kind_list, *kind_tensor, *kind_other;

static int watch_traverse(WatchCheck *self, visitproc visit, void *arg) {
    Py_VISIT(self->dicts);
    Py_VISIT(self->dict_keys);
    Py_VISIT(self->dict_values);
    Py_VISIT(self->lists);
    Py_VISIT(self->list_items);
    Py_VISIT(self->objects);
    Py_VISIT(self->types);
    Py_VISIT(self->object_dicts);
    Py_VISIT(self->tensors);
    Py_VISIT(self->words);
    Py_VISIT(self->reader);
    Py_VISIT(self->same);
    return 0;
}

static int watch_clear(WatchCheck *self) {
    Py_CLEAR(self->dicts);
    Py_CLEAR(self->dict_keys);
    Py_CLEAR(self->dict_values);
    Py_CLEAR(self->lists);
    Py_CLEAR(self->list_items);
    Py_CLEAR(self->objects);
    Py_CLEAR(self->types);
    Py_CLEAR(self->object_dicts);
    Py_CLEAR(self->tensors);
    Py_CLEAR(self->words);
    Py_CLEAR(self->reader);
    Py_CLEAR(self->same);
    self->support = NULL;
    self->batch_count = 0;
    return 0;
}

static void watch_dealloc(WatchCheck *self) {
    PyObject_GC_UnTrack(self);
    watch_clear(self);
    PyMem_Free(self->tags);
    PyMem_Free(self->covered);
    PyMem_Free(self->recorded);
    PyMem_Free(self->at);
    PyMem_Free(self->count);
    PyMem_Free(self->batch);
    PyMem_Free(self->batch_words);
    PyMem_Free(self->batch_index);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static uint64_t dict_tag(PyObject *dict) {
#if WATCH_TAGS
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif
    return ((PyDictObject *)dict)->ma_version_tag;
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
#else
    (void)dict;
    return 0;
#endif
}

/* `same(kind, index)`: 1 the same, 0 changed, -1 an exception is set. */
static int same_in_python(WatchCheck *self, PyObject *kind, Py_ssize_t index) {
    PyObject *number = PyLong_FromSsize_t(index);
    if (number == NULL)
        return -1;
    PyObject *args[2] = {kind, number};
    PyObject *answer = PyObject_Vectorcall(self->same, args, 2, NULL);
    Py_DECREF(number);
    if (answer == NULL)
        return -1;
    int truth = PyObject_IsTrue(answer);
    Py_DECREF(answer);
    return truth;
}

/* Whether `dict` holds `keys` and `values` (tuples), the same objects in its own order and no
 * more: 1 it does, 0 not. */
static int dict_holds(PyObject *dict, PyObject *keys, PyObject *values) {
    Py_ssize_t n = PyTuple_GET_SIZE(keys), position = 0, i = 0;
    if (!PyDict_Check(dict) || PyDict_GET_SIZE(dict) != n)
        return 0;
    PyObject *key, *value;
    while (PyDict_Next(dict, &position, &key, &value)) {
        if (i >= n || key != PyTuple_GET_ITEM(keys, i) || value != PyTuple_GET_ITEM(values, i))
            return 0;
        i++;
    }
    return i == n;
}

static int list_holds(PyObject *list, PyObject *items) {
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != n)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyList_GET_ITEM(list, i) != PyTuple_GET_ITEM(items, i))
            return 0;
    return 1;
}

/* Dict i: 1 the same, 0 changed, -1 an exception is set. */
static int dict_same(WatchCheck *self, Py_ssize_t i) {
    PyObject *dict = PyTuple_GET_ITEM(self->dicts, i);
    uint64_t before = self->use_tags ? dict_tag(dict) : 0;
    if (self->use_tags && before == self->tags[i])
        return 1;
    int same = dict_holds(dict, PyTuple_GET_ITEM(self->dict_keys, i), PyTuple_GET_ITEM(self->dict_values, i));
    if (!same)
        same = same_in_python(self, kind_dict, i);
    if (same == 1 && self->use_tags && dict_tag(dict) == before)
        self->tags[i] = before; /* nothing moved it meanwhile: the reference */
    return same;
}

/* Object i: its class and its __dict__ are the ones recorded. */
static int object_same(WatchCheck *self, Py_ssize_t i) {
    PyObject *object = PyTuple_GET_ITEM(self->objects, i), *expected = PyTuple_GET_ITEM(self->object_dicts, i);
    if ((PyObject *)Py_TYPE(object) != PyTuple_GET_ITEM(self->types, i))
        return 0;
    if (expected == Py_None)
        return 1;
#if PY_VERSION_HEX < 0x030E0000
    PyObject **slot = _PyObject_GetDictPtr(object); /* the slot itself: no reference taken */
    return slot != NULL && *slot == expected;
#else
    PyObject *now = PyObject_GenericGetDict(object, NULL);
    if (now == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return -1;
        PyErr_Clear(); /* an object whose __dict__ cannot be read: not the one recorded */
        return 0;
    }
    Py_DECREF(now);
    return now == expected;
#endif
}

/* Tensor i alone: the helper reads the words recorded (else Python decides). */
static int tensor_same(WatchCheck *self, Py_ssize_t i) {
    if (self->support != NULL && self->count[i] >= 0) {
        int64_t now[WATCH_WORDS];
        Py_ssize_t count = self->support->read_tensor_state(PyTuple_GET_ITEM(self->tensors, i), now, WATCH_WORDS);
        if (count == self->count[i]) {
            const int64_t *recorded = self->recorded + self->at[i];
            for (Py_ssize_t w = 0; w < count; w++)
                if (now[w] != recorded[w])
                    return 0;
            return 1;
        }
        if (count >= 0)
            return 0; /* read, and of another length: another number of dimensions */
    }
    return same_in_python(self, kind_tensor, i);
}

/* The dicts: 1 all the same, 0 one changed, -1 an exception is set. */
static int dicts_same(WatchCheck *self) {
    int skip = 0; /* whether the dicts the epoch covers are the same */
#if WATCH_EPOCH
    uint64_t epoch = watched_epoch;
    skip = self->use_epoch && epoch == self->epoch;
#endif
    int same = 1;
    Py_ssize_t n = PyTuple_GET_SIZE(self->dicts);
    for (Py_ssize_t i = 0; same == 1 && i < n; i++)
        if (!(skip && self->covered[i]))
            same = dict_same(self, i);
#if WATCH_EPOCH
    if (same == 1 && self->use_epoch && !skip && watched_epoch == epoch)
        self->epoch = epoch; /* nothing moved it meanwhile: the reference */
#endif
    return same;
}

/* The tensors: those with words by the helper's one call, each it stops at alone, the others in
 * Python. 1 all the same, 0 one changed, -1 an exception is set. */
static int tensors_same(WatchCheck *self) {
    Py_ssize_t start = 0, n = self->batch_count;
    while (start < n) {
        Py_ssize_t i = start + self->support->tensor_states_unlike(self->batch + start, self->batch_words + start, n - start);
        if (i >= n)
            break;
        int same = tensor_same(self, self->batch_index[i]);
        if (same != 1)
            return same;
        start = i + 1;
    }
    int same = 1;
    for (Py_ssize_t i = 0; same == 1 && i < PyTuple_GET_SIZE(self->tensors); i++)
        if (self->count[i] < 0)
            same = same_in_python(self, kind_tensor, i);
    return same;
}

/* 1 the same, 0 changed, -1 an exception is set: the cheapest holders first. */
static int watch_same(WatchCheck *self) {
    int same = dicts_same(self);
    Py_ssize_t n = PyTuple_GET_SIZE(self->lists);
    for (Py_ssize_t i = 0; same == 1 && i < n; i++)
        if (!list_holds(PyTuple_GET_ITEM(self->lists, i), PyTuple_GET_ITEM(self->list_items, i)))
            same = same_in_python(self, kind_list, i);
    n = PyTuple_GET_SIZE(self->objects);
    for (Py_ssize_t i = 0; same == 1 && i < n; i++)
        same = object_same(self, i);
    if (same == 1)
        same = tensors_same(self);
    for (Py_ssize_t i = 0; same == 1 && i < self->others; i++)
        same = same_in_python(self, kind_other, i);
    return same;
}

static PyObject *watch_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    WatchCheck *self = (WatchCheck *)callable;
    if (PyVectorcall_NARGS(nargsf) != 0 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "a watch check takes no arguments");
        return NULL;
    }
    if (self->same == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "WatchCheck was not initialised: make it as WatchCheck(program)");
        return NULL;
    }
    int same = watch_same(self);
    if (same < 0)
        return NULL;
    return Py_NewRef(same ? Py_False : Py_True);
}

/* The field `name` of the program, a tuple (a new reference), or NULL with TypeError set. */
static PyObject *tuple_field(PyObject *program, PyObject *name) {
    PyObject *value = PyObject_GetAttr(program, name);
    if (value != NULL && !PyTuple_Check(value)) {
        PyErr_Format(PyExc_TypeError, "a watch program's %U must be a tuple, not %.100s", name, Py_TYPE(value)->tp_name);
        Py_CLEAR(value);
    }
    return value;
}

/* Whether every item of `tuple` passes `check` and `per` (where given) has as many items. */
static int items_are(PyObject *tuple, int (*check)(PyObject *), const char *what, PyObject *per) {
    Py_ssize_t n = PyTuple_GET_SIZE(tuple);
    if (per != NULL && PyTuple_GET_SIZE(per) != n) {
        PyErr_Format(PyExc_ValueError, "a watch program needs one entry of %s per holder", what);
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!check(PyTuple_GET_ITEM(tuple, i))) {
            PyErr_Format(PyExc_TypeError, "a watch program's %s[%zd] is a %.100s", what, i,
                         Py_TYPE(PyTuple_GET_ITEM(tuple, i))->tp_name);
            return 0;
        }
    return 1;
}

static int is_dict(PyObject *o) { return PyDict_Check(o); }
static int is_list(PyObject *o) { return PyList_Check(o); }
static int is_tuple(PyObject *o) { return PyTuple_Check(o); }
static int is_type(PyObject *o) { return PyType_Check(o); }
static int is_dict_or_none(PyObject *o) { return o == Py_None || PyDict_Check(o); }
static int is_words(PyObject *o) { return o == Py_None || PyTuple_Check(o); }

/* The holders' fields: read, and checked item by item. */
static int read_holders(WatchCheck *self, PyObject *program) {
    if ((self->dicts = tuple_field(program, s_dicts)) == NULL ||
        (self->dict_keys = tuple_field(program, s_dict_keys)) == NULL ||
        (self->dict_values = tuple_field(program, s_dict_values)) == NULL ||
        (self->lists = tuple_field(program, s_lists)) == NULL ||
        (self->list_items = tuple_field(program, s_list_items)) == NULL ||
        (self->objects = tuple_field(program, s_objects)) == NULL ||
        (self->types = tuple_field(program, s_types)) == NULL ||
        (self->object_dicts = tuple_field(program, s_object_dicts)) == NULL)
        return -1;
    if (!items_are(self->dicts, is_dict, "dicts", NULL) || !items_are(self->dict_keys, is_tuple, "dict_keys", self->dicts) ||
        !items_are(self->dict_values, is_tuple, "dict_values", self->dicts) ||
        !items_are(self->lists, is_list, "lists", NULL) || !items_are(self->list_items, is_tuple, "list_items", self->lists) ||
        !items_are(self->types, is_type, "types", self->objects) ||
        !items_are(self->object_dicts, is_dict_or_none, "object_dicts", self->objects))
        return -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->dicts); i++)
        if (PyTuple_GET_SIZE(PyTuple_GET_ITEM(self->dict_keys, i)) != PyTuple_GET_SIZE(PyTuple_GET_ITEM(self->dict_values, i)))
            return PyErr_Format(PyExc_ValueError, "a watch program's dict_keys[%zd] and dict_values[%zd] differ in length", i, i), -1;
    self->tags = PyMem_Calloc((size_t)PyTuple_GET_SIZE(self->dicts) + 1, sizeof(uint64_t));
    return self->tags == NULL ? (PyErr_NoMemory(), -1) : 0;
}

#if WATCH_EPOCH
/* Whether `dict` is the __dict__ of one of the objects. */
static int an_objects_dict(WatchCheck *self, PyObject *dict) {
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(self->object_dicts); j++)
        if (PyTuple_GET_ITEM(self->object_dicts, j) == dict)
            return 1;
    return 0;
}
#endif

/* Watch every dict for the epoch (where there is a watcher and `tags`) and note which ones it
 * covers; a dict that cannot be watched turns the epoch off for this check. 0, or -1 with
 * MemoryError set. */
static int watch_dicts(WatchCheck *self, int tags) {
    Py_ssize_t n = PyTuple_GET_SIZE(self->dicts);
    self->use_epoch = 0;
    self->covered = PyMem_Calloc((size_t)n + 1, 1);
    if (self->covered == NULL)
        return PyErr_NoMemory(), -1;
#if WATCH_EPOCH
    if (!tags || dict_watcher < 0)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyDict_Watch(dict_watcher, PyTuple_GET_ITEM(self->dicts, i)) < 0) {
            PyErr_Clear();
            return 0;
        }
        self->covered[i] = WATCH_EPOCH_ATTRIBUTES || !an_objects_dict(self, PyTuple_GET_ITEM(self->dicts, i));
    }
    self->use_epoch = 1;
#else
    (void)tags;
#endif
    return 0;
}

/* The recorded words of tensor i into self->recorded at `*used` (checked: ints, at most
 * WATCH_WORDS, holding their dimensions). A tensor the helper does not read now is compared in
 * Python: only what it reads (a torch.Tensor or Parameter) goes to tensor_states_unlike, which
 * unpacks a tensor whose type is the recorded one. */
static int read_words(WatchCheck *self, Py_ssize_t i, Py_ssize_t *used) {
    PyObject *words = PyTuple_GET_ITEM(self->words, i);
    int64_t now[WATCH_WORDS];
    self->count[i] = -1;
    if (words == Py_None || self->support == NULL || PyTuple_GET_SIZE(words) > WATCH_WORDS ||
        self->support->read_tensor_state(PyTuple_GET_ITEM(self->tensors, i), now, WATCH_WORDS) < 0)
        return 0; /* compared in Python */
    if (PyTuple_GET_SIZE(words) < 6)
        return PyErr_Format(PyExc_ValueError, "a watch program's words[%zd] are too few", i), -1;
    self->at[i] = *used;
    for (Py_ssize_t w = 0; w < PyTuple_GET_SIZE(words); w++) {
        long long value = PyLong_AsLongLong(PyTuple_GET_ITEM(words, w));
        if (value == -1 && PyErr_Occurred())
            return -1;
        self->recorded[(*used)++] = (int64_t)value;
    }
    self->count[i] = PyTuple_GET_SIZE(words);
    if (self->recorded[self->at[i] + 5] != (self->count[i] - 6) / 2 || self->count[i] % 2)
        return PyErr_Format(PyExc_ValueError, "a watch program's words[%zd] do not hold their dimensions", i), -1;
    Py_ssize_t b = self->batch_count++;
    self->batch[b] = PyTuple_GET_ITEM(self->tensors, i);
    self->batch_index[b] = i;
    return 0;
}

/* The tensors' fields: the reader's capsule and each tensor's recorded words. */
static int read_tensors(WatchCheck *self, PyObject *program) {
    if ((self->tensors = tuple_field(program, s_tensors)) == NULL || (self->words = tuple_field(program, s_words)) == NULL ||
        (self->reader = PyObject_GetAttr(program, s_reader)) == NULL)
        return -1;
    if (!items_are(self->words, is_words, "words", self->tensors))
        return -1;
    if (self->reader != Py_None && (self->support = replay_support_from(self->reader, "WatchCheck")) == NULL)
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(self->tensors), total = 0;
    self->at = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    self->count = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    self->recorded = PyMem_Calloc((size_t)n * WATCH_WORDS + 1, sizeof(int64_t));
    self->batch = PyMem_Calloc((size_t)n + 1, sizeof(PyObject *));
    self->batch_words = PyMem_Calloc((size_t)n + 1, sizeof(int64_t *));
    self->batch_index = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    if (self->at == NULL || self->count == NULL || self->recorded == NULL || self->batch == NULL ||
        self->batch_words == NULL || self->batch_index == NULL)
        return PyErr_NoMemory(), -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (read_words(self, i, &total) < 0)
            return -1;
    for (Py_ssize_t b = 0; b < self->batch_count; b++) /* recorded is final now: point into it */
        self->batch_words[b] = self->recorded + self->at[self->batch_index[b]];
    return 0;
}

static PyObject *watch_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *program;
    int tags = 1;
    static char *names[] = {"program", "tags", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|$p", names, &program, &tags))
        return NULL;
    WatchCheck *self = (WatchCheck *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = watch_vectorcall;
    self->use_tags = tags && WATCH_TAGS;
    PyObject *others = NULL;
    if (read_holders(self, program) < 0 || read_tensors(self, program) < 0 ||
        (others = PyObject_GetAttr(program, s_others)) == NULL || (self->others = PyLong_AsSsize_t(others)) < 0 ||
        (self->same = PyObject_GetAttr(program, s_same)) == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "a watch program's others must be a count, 0 or more");
        Py_XDECREF(others);
        Py_DECREF(self);
        return NULL;
    }
    Py_DECREF(others);
    if (!PyCallable_Check(self->same)) {
        PyErr_SetString(PyExc_TypeError, "a watch program's same must be callable");
        Py_DECREF(self);
        return NULL;
    }
    if (watch_dicts(self, tags) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static PyObject *watch_tags(WatchCheck *self, void *unused) {
    return Py_NewRef(self->use_tags ? Py_True : Py_False);
}

static PyObject *watch_epoch(WatchCheck *self, void *unused) {
    return Py_NewRef(self->use_epoch ? Py_True : Py_False);
}

static PyGetSetDef watch_getset[] = {
    {"tags", (getter)watch_tags, NULL, "whether dicts whose version tag did not move are skipped", NULL},
    {"epoch", (getter)watch_epoch, NULL, "whether the dicts are skipped while no watched dict changed", NULL},
    {NULL},
};

static PyTypeObject WatchCheckType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "replay._checks.WatchCheck",
    .tp_basicsize = sizeof(WatchCheck),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(WatchCheck, vectorcall),
    .tp_doc = "WatchCheck(program, *, tags=True)() -> True when something watched changed (see csrc/replay_checks.c).",
    .tp_new = watch_new,
    .tp_dealloc = (destructor)watch_dealloc,
    .tp_traverse = (traverseproc)watch_traverse,
    .tp_clear = (inquiry)watch_clear,
    .tp_call = PyVectorcall_Call,
    .tp_getset = watch_getset,
};

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
    PyModuleDef_HEAD_INIT, "replay._checks", "A replay's exactness checks in C: torch's settings, the aliasing of arguments, the watch of what a region reaches (see csrc/replay_checks.c).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__checks(void) {
    PyObject **names[] = {&s_value, &s_readers, &s_arguments, &s_expected, &s_ways, &s_state, &s_uncovered,
                          &s_dicts, &s_dict_keys, &s_dict_values, &s_lists, &s_list_items, &s_objects, &s_types,
                          &s_object_dicts, &s_tensors, &s_words, &s_reader, &s_same, &s_others,
                          &kind_dict, &kind_list, &kind_tensor, &kind_other};
    const char *texts[] = {"value", "readers", "arguments", "expected", "ways", "state", "uncovered",
                           "dicts", "dict_keys", "dict_values", "lists", "list_items", "objects", "types",
                           "object_dicts", "tensors", "words", "reader", "same", "others",
                           "d", "l", "t", "o"};
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++)
        if ((*names[i] = PyUnicode_InternFromString(texts[i])) == NULL)
            return NULL;
    if (PyType_Ready(&SettingsCheckType) < 0 || PyType_Ready(&WatchCheckType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_definition);
    if (module == NULL)
        return NULL;
    PyTypeObject *types[] = {&SettingsCheckType, &WatchCheckType};
    const char *type_names[] = {"SettingsCheck", "WatchCheck"};
    for (size_t i = 0; i < 2; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(module, type_names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(module);
            return NULL;
        }
    }
#if WATCH_EPOCH
    if (dict_watcher < 0 && (dict_watcher = PyDict_AddWatcher(on_watched_dict)) < 0)
        PyErr_Clear(); /* every watcher id taken: the checks compare their dicts' tags or entries */
#endif
    if (PyModule_AddIntConstant(module, "WATCH_TAGS", WATCH_TAGS) < 0 ||
        PyModule_AddIntConstant(module, "WATCH_EPOCH", WATCH_EPOCH) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
