/*
 * replay._modes: the per-replay check of the global torch settings, in C.
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
 * A reader that raises, or a comparison that does, raises out of the call, as the Python
 * check does. The readers are called with their arguments (a tuple each) through vectorcall.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <string.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *readers;   /* tuple of callables */
    PyObject *arguments; /* tuple of tuples */
    PyObject *expected;  /* tuple */
    char *ways;          /* one of "iev" per reader */
    Py_ssize_t count;
    vectorcallfunc vectorcall;
} SettingsCheck;

static PyObject *s_value;

static int settings_traverse(SettingsCheck *self, visitproc visit, void *arg) {
    Py_VISIT(self->readers);
    Py_VISIT(self->arguments);
    Py_VISIT(self->expected);
    return 0;
}

static int settings_clear(SettingsCheck *self) {
    Py_CLEAR(self->readers);
    Py_CLEAR(self->arguments);
    Py_CLEAR(self->expected);
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
            return NULL;
        int result = differs(self->ways[i], value, PyTuple_GET_ITEM(self->expected, i));
        Py_DECREF(value);
        if (result < 0)
            return NULL;
        if (result)
            Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

static PyObject *settings_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *readers, *arguments, *expected;
    const char *ways;
    Py_ssize_t ways_length;
    static char *names[] = {"readers", "arguments", "expected", "ways", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!O!s#", names, &PyTuple_Type, &readers, &PyTuple_Type,
                                     &arguments, &PyTuple_Type, &expected, &ways, &ways_length))
        return NULL;
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
    {NULL},
};

static PyTypeObject SettingsCheckType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "replay._modes.SettingsCheck",
    .tp_basicsize = sizeof(SettingsCheck),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(SettingsCheck, vectorcall),
    .tp_doc = "SettingsCheck(readers, arguments, expected, ways)() -> True when a setting differs "
              "(see replay/_modes.c).",
    .tp_new = settings_new,
    .tp_dealloc = (destructor)settings_dealloc,
    .tp_traverse = (traverseproc)settings_traverse,
    .tp_clear = (inquiry)settings_clear,
    .tp_call = PyVectorcall_Call,
    .tp_members = settings_members,
    .tp_getset = settings_getset,
};

static struct PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT, "replay._modes", "The per-replay check of torch's settings in C (see replay/_modes.c).", -1,
    NULL,
};

PyMODINIT_FUNC PyInit__modes(void) {
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
