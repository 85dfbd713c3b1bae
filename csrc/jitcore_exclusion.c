/*
 * jitcore._exclusion: the lock-free shared side of the capture exclusion
 * (jitcore.recorder._Shared) in C.
 *
 * Why: every eager run of a replay region holds the exclusion shared (an eager run may load
 * kernels, which would break another thread's capture). In Python its __enter__ and
 * __exit__ are two calls, each reading the thread's id and the holders' dict, and slower still
 * inside a loop of a real region whose own work leaves the interpreter's caches cold
 * (docs/benchmarks/shapes.md, the eager path).
 *
 * The protocol is _Shared's, step for step (its docstring has the argument): entering writes
 * the thread's entry in the holders' dict first, then reads the exclusion's _owner and
 * _waiting; a capture running or waiting takes the entry back and goes the slow way
 * (CaptureExclusion.wake_waiting_capture, enter_shared_waiting: Python methods). Leaving
 * deletes the entry, then reads _waiting and wakes a waiting capture. The exclusion's _owner and
 * _waiting live in this object (its members owner and waiting; CaptureExclusion reads and writes
 * them through it), so that the shared side reads them without an attribute lookup (two on
 * the way in and one on the way out, each costly inside a loop whose own work leaves the
 * interpreter's caches cold). The thread's id object is kept from one call
 * to the next (the same thread, usually). Each of the two runs as
 * one C call under the GIL (the dictionary operations on int keys and the reads of plain
 * attributes run no Python code), so no other thread runs between its steps: the order the
 * Python version gets from the GIL's one order of bytecodes, and more. Only for builds with a
 * GIL: free-threaded builds use the locked side (jitcore.recorder._LockedShared).
 *
 * Misuse raises, never crashes: a SharedSide made without __init__ (SharedSide.__new__) is
 * refused by both methods (RuntimeError), an exclusion without a _holders dict by __init__
 * (TypeError), and a depth in the holders' dict that is not a positive int by the method
 * that reads it (TypeError, ValueError, OverflowError).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <pythread.h>
#include <stddef.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *exclusion;   /* the CaptureExclusion */
    PyObject *holders;     /* its _holders: thread id -> depth */
    PyObject *owner;       /* its _owner: the capturing thread's id, or None */
    Py_ssize_t waiting;    /* its _waiting: threads waiting to take it exclusively */
    PyObject *me;          /* the id object of the thread that last took it, */
    unsigned long me_ident; /* and that id */
} SharedSide;

static PyObject *s_wake, *s_enter_waiting;

static int shared_init(SharedSide *self, PyObject *args, PyObject *kwargs) {
    PyObject *exclusion, *holders;
    static char *names[] = {"exclusion", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O", names, &exclusion))
        return -1;
    holders = PyObject_GetAttrString(exclusion, "_holders");
    if (holders == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "SharedSide: expected a CaptureExclusion (with a _holders dict), got %.200s",
                         Py_TYPE(exclusion)->tp_name);
        }
        return -1;
    }
    if (!PyDict_CheckExact(holders)) {
        Py_DECREF(holders);
        PyErr_SetString(PyExc_TypeError, "SharedSide: the exclusion's _holders must be a dict");
        return -1;
    }
    Py_INCREF(exclusion);
    Py_XSETREF(self->exclusion, exclusion);
    Py_XSETREF(self->holders, holders);
    Py_XSETREF(self->owner, Py_NewRef(Py_None));
    self->waiting = 0;
    return 0;
}

static int shared_traverse(SharedSide *self, visitproc visit, void *arg) {
    Py_VISIT(self->exclusion);
    Py_VISIT(self->holders);
    Py_VISIT(self->owner);
    Py_VISIT(self->me);
    return 0;
}

static int shared_clear(SharedSide *self) {
    Py_CLEAR(self->exclusion);
    Py_CLEAR(self->holders);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->me);
    return 0;
}

static void shared_dealloc(SharedSide *self) {
    PyObject_GC_UnTrack(self);
    shared_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The depth this thread holds it at (0 if no entry); -1 with the error set. */
static long depth_of(SharedSide *self, PyObject *me) {
    PyObject *depth = PyDict_GetItemWithError(self->holders, me); /* borrowed */
    if (depth == NULL)
        return PyErr_Occurred() ? -1 : 0;
    long value = PyLong_AsLong(depth);
    if (value == -1 && PyErr_Occurred())
        return -1;
    if (value < 1 || value == LONG_MAX) { /* an entry is a depth of at least 1, and one more must fit */
        PyErr_Format(PyExc_ValueError, "SharedSide: the holders' entry of this thread is %ld, not a depth", value);
        return -1;
    }
    return value;
}

/* The side's exclusion and holders, or a RuntimeError for a side made without __init__. */
static int initialised(SharedSide *self) {
    if (self->holders != NULL && self->exclusion != NULL)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "SharedSide: not initialised (made without SharedSide(exclusion))");
    return -1;
}

static int set_depth(SharedSide *self, PyObject *me, long depth) {
    PyObject *value = PyLong_FromLong(depth);
    if (value == NULL)
        return -1;
    int status = PyDict_SetItem(self->holders, me, value);
    Py_DECREF(value);
    return status;
}

/* This thread's id as an int object (a new reference), kept for the next call. */
static PyObject *thread_id(SharedSide *self) {
    unsigned long ident = PyThread_get_thread_ident();
    if (self->me != NULL && self->me_ident == ident)
        return Py_NewRef(self->me);
    PyObject *me = PyLong_FromUnsignedLong(ident);
    if (me == NULL)
        return NULL;
    Py_XSETREF(self->me, Py_NewRef(me));
    self->me_ident = ident;
    return me;
}

static PyObject *call_exclusion(SharedSide *self, PyObject *method, PyObject *arg) {
    return arg == NULL ? PyObject_CallMethodNoArgs(self->exclusion, method)
                       : PyObject_CallMethodOneArg(self->exclusion, method, arg);
}

static PyObject *shared_enter(SharedSide *self, PyObject *unused) {
    if (initialised(self) < 0)
        return NULL;
    PyObject *me = thread_id(self);
    if (me == NULL)
        return NULL;
    long depth = depth_of(self, me);
    if (depth < 0 || set_depth(self, me, depth + 1) < 0)
        goto failed;
    if (depth) /* inside already: enter again at once (waiting would be for itself) */
        goto entered;
    int owned = self->owner != NULL && self->owner != Py_None, waits = self->waiting != 0;
    if (!owned && !waits)
        goto entered;
    /* a capture runs or waits (maybe this thread's own): take the entry back, the way in while
       a capture is under way decides */
    if (PyDict_DelItem(self->holders, me) < 0)
        goto failed;
    if (waits) { /* it may have seen the entry and gone to wait */
        PyObject *woken = call_exclusion(self, s_wake, NULL);
        if (woken == NULL)
            goto failed;
        Py_DECREF(woken);
    }
    PyObject *waited = call_exclusion(self, s_enter_waiting, me);
    if (waited == NULL)
        goto failed;
    Py_DECREF(waited);
entered:
    Py_DECREF(me);
    Py_RETURN_NONE;
failed:
    Py_DECREF(me);
    return NULL;
}

static PyObject *shared_exit(SharedSide *self, PyObject *const *args, Py_ssize_t count) {
    if (count != 3) {
        PyErr_Format(PyExc_TypeError, "__exit__ expected 3 arguments, got %zd", count);
        return NULL;
    }
    if (initialised(self) < 0)
        return NULL;
    PyObject *me = thread_id(self);
    if (me == NULL)
        return NULL;
    long depth = depth_of(self, me);
    if (depth < 0)
        goto failed;
    if (depth > 1) {
        if (set_depth(self, me, depth - 1) < 0)
            goto failed;
    } else if (depth) {
        if (PyDict_DelItem(self->holders, me) < 0)
            goto failed;
        if (self->waiting) {
            PyObject *woken = call_exclusion(self, s_wake, NULL);
            if (woken == NULL)
                goto failed;
            Py_DECREF(woken);
        }
    }
    /* no entry: taken inside this thread's own capture, which held nothing */
    Py_DECREF(me);
    Py_RETURN_NONE; /* never suppresses an exception */
failed:
    Py_DECREF(me);
    return NULL;
}

static PyMemberDef shared_members[] = {
    {"owner", T_OBJECT, offsetof(SharedSide, owner), 0, "the exclusion's _owner (the capturing thread's id, or None)"},
    {"waiting", T_PYSSIZET, offsetof(SharedSide, waiting), 0, "the exclusion's _waiting (captures waiting)"},
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef shared_methods[] = {
    {"__enter__", (PyCFunction)shared_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))shared_exit, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SharedSideType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "jitcore._exclusion.SharedSide",
    .tp_basicsize = sizeof(SharedSide),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The capture exclusion's lock-free shared side (jitcore.recorder._Shared) in C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)shared_init,
    .tp_dealloc = (destructor)shared_dealloc,
    .tp_traverse = (traverseproc)shared_traverse,
    .tp_clear = (inquiry)shared_clear,
    .tp_methods = shared_methods,
    .tp_members = shared_members,
};

static struct PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT, "jitcore._exclusion",
    "The capture exclusion's lock-free shared side in C (see csrc/jitcore_exclusion.c).", -1, NULL,
};

PyMODINIT_FUNC PyInit__exclusion(void) {
    if ((s_wake = PyUnicode_InternFromString("wake_waiting_capture")) == NULL ||
        (s_enter_waiting = PyUnicode_InternFromString("enter_shared_waiting")) == NULL)
        return NULL;
    if (PyType_Ready(&SharedSideType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_definition);
    if (module == NULL)
        return NULL;
    Py_INCREF(&SharedSideType);
    if (PyModule_AddObject(module, "SharedSide", (PyObject *)&SharedSideType) < 0) {
        Py_DECREF(&SharedSideType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
