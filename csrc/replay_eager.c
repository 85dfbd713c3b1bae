/*
 * replay._eager: a region's flat dispatch (replay/dispatch.py, FlatDispatch) and its call
 * (replay/region.py, Region.__call__) made in C.
 *
 * Why: in a loop whose shapes rarely repeat nearly every call of a region runs eagerly, and what
 * the session adds to such a call is bookkeeping: the call's shapes, a lookup of keys with
 * graphs, a count, the decision that it only warms or is too rare, the capture exclusion. Inside
 * a real region's loop, whose own work leaves the interpreter's caches cold, the same steps in
 * Python cost several times what they cost alone; from C a call of such a loop enters Python
 * only in the region's function, and a replayed call only in its guard and its replay
 * (docs/replay.md, "The eager path").
 *
 * The contract with Python is one object, replay.dispatch.DispatchProgram, read by field name.
 * Its fixed fields are read once, here at construction (the program refuses to set them later);
 * its live fields (the rare paths back into Python, the globals check) are read at their slots
 * on each use, the slots found once by name and checked to be plain attrs slots. The ints the
 * gate reads and bumps in the program's objects (admission's counts, the session's counters)
 * are read at their slots too where those are plain slots (see slot_of); a field that is missing
 * fails loudly at construction. tests/replay/test_session.py runs this gate and FlatDispatch over
 * the same calls and compares every count.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <structmember.h>

/* The live fields of a program: read at their slots on each use. */
enum { LIVE_DECIDE, LIVE_TOOK, LIVE_REPLAYED, LIVE_FULL_PATH, LIVE_REGION_DRIFT, LIVE_COUNT };
static const char *live_names[LIVE_COUNT] = {"decide", "took", "replayed", "full_path", "region_drift"};

/* The ints the gate reads and bumps in the program's objects: (field, its attribute, written). */
enum { AT_CALLS, AT_WINDOW, AT_COUNTS, AT_RECORD_AFTER, AT_VERSION, AT_TOO_RARE, AT_EAGER_RUNS,
       AT_FORGOTTEN_RUNS, AT_QUIET_BELOW, AT_QUIET_VERSION, AT_REPLAY_RUNS, AT_COUNT };
static const struct {
    const char *field, *name;
    int written;
} int_slots[AT_COUNT] = {
    {"sketch", "calls", 1},      {"sketch", "window", 0},     {"sketch", "counts", 0},
    {"admission", "record_after", 0}, {"budget", "version", 0},  {"counters", "too_rare", 1},
    {"counters", "eager_runs", 1}, {"forgotten", "eager_runs", 1}, {"quiet", "below", 0},
    {"quiet", "version", 0},     {"replay_times", "runs", 1},
};

typedef struct {
    PyObject_HEAD
    PyObject *program; /* the DispatchProgram; NULL until __init__ */
    /* its fixed fields, held */
    PyObject *region, *by_pre_key, *entry_shapes, *session, *owners[AT_COUNT], *fn, *enter, *exit, *touch, *clock,
        *padded_type, *buckets, *specs, *flat, *tensor_type, *dynamic_type, *dynamic_mark, *plain, *miss, *eagerly,
        *declined;
    long long largest, mask, settled, settled_mask;
    int time_replays; /* whether hits' replays are counted and timed here */
    Py_ssize_t live[LIVE_COUNT]; /* the live fields' slots in the program */
    Py_ssize_t at[AT_COUNT];     /* the ints' slots in their owners, or -1: read as attributes */
    vectorcallfunc vectorcall;
} Gate;

#define HELD(X)                                                                                                     \
    X(program) X(region) X(by_pre_key) X(entry_shapes) X(session) X(fn) X(enter) X(exit) X(touch) X(clock)           \
        X(padded_type) X(buckets) X(specs) X(flat) X(tensor_type) X(dynamic_type) X(dynamic_mark) X(plain) X(miss)   \
            X(eagerly) X(declined)

static PyObject *s_tensor, *s_dim, *s_closed, *s_gpu, *s_halve, *s_shape, *s_enter, *s_exit;
/* int_slots' and live_names' names, interned (read as attributes where they have no slot) */
static PyObject *s_int_slots[AT_COUNT], *s_live[LIVE_COUNT];

static void gate_clear_refs(Gate *g) {
#define CLEAR(field) Py_CLEAR(g->field);
    HELD(CLEAR)
#undef CLEAR
    for (int i = 0; i < AT_COUNT; i++)
        Py_CLEAR(g->owners[i]);
}

static int gate_traverse(Gate *g, visitproc visit, void *arg) {
#define VISIT(field) Py_VISIT(g->field);
    HELD(VISIT)
#undef VISIT
    for (int i = 0; i < AT_COUNT; i++)
        Py_VISIT(g->owners[i]);
    return 0;
}

static int gate_clear(Gate *g) {
    gate_clear_refs(g);
    return 0;
}

static void gate_dealloc(Gate *g) {
    PyObject_GC_UnTrack(g);
    gate_clear_refs(g);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

/* A gate made with __new__ alone, or whose __init__ failed, has no program: every use raises. */
static int gate_ready(Gate *g) {
    if (g->program != NULL)
        return 1;
    PyErr_SetString(PyExc_RuntimeError, "EagerGate has no program: make it as EagerGate(program)");
    return 0;
}

/* Whether ``owner`` has attribute ``name``: a field renamed on one side fails here, at
   construction, naming it (``where``: the owner as the program reaches it). */
static int has_field(PyObject *owner, const char *where, const char *name) {
    PyObject *value = PyObject_GetAttrString(owner, name);
    if (value == NULL) {
        PyErr_Format(PyExc_AttributeError, "EagerGate: %s (%s) has no field '%s'", where, Py_TYPE(owner)->tp_name,
                     name);
        return -1;
    }
    Py_DECREF(value);
    return 0;
}

/* Where attribute ``name`` of ``owner`` lies in its object: the offset of a plain __slots__
   member (an attrs class's field), or -1 (read and written as an attribute; ``written``: the
   gate writes it too, so a type that hooks setting attributes keeps its hook). Why slots:
   inside a loop whose own work leaves the caches cold, an attribute lookup cost more than the
   value itself; a slot read at its offset is what the lookup ends in, for a type that neither
   overrides getting or setting attributes nor the member's kind (checked once, here). */
static Py_ssize_t slot_of(PyObject *owner, const char *name, int written) {
#ifdef Py_GIL_DISABLED
    return -1; /* (a free-threaded build locks an object's attributes: no access past that) */
#endif
    PyTypeObject *type = Py_TYPE(owner);
    if (type->tp_getattro != PyObject_GenericGetAttr || (written && type->tp_setattro != PyObject_GenericSetAttr))
        return -1;
    PyObject *descriptor = PyObject_GetAttrString((PyObject *)type, name);
    if (descriptor == NULL) {
        PyErr_Clear(); /* an instance attribute (a __dict__): read as an attribute */
        return -1;
    }
    Py_ssize_t offset = -1;
    if (Py_TYPE(descriptor) == &PyMemberDescr_Type) {
        PyMemberDef *member = ((PyMemberDescrObject *)descriptor)->d_member;
        if (member->type == T_OBJECT_EX && !(member->flags & READONLY))
            offset = member->offset;
    }
    Py_DECREF(descriptor);
    return offset;
}

/* The slot of a live field of the program: a plain attrs slot, read on each use. */
static int live_slot(PyObject *program, const char *name, Py_ssize_t *offset) {
    if (has_field(program, "the program", name) < 0)
        return -1;
    *offset = slot_of(program, name, 0);
#ifndef Py_GIL_DISABLED
    if (*offset < 0) {
        PyErr_Format(PyExc_TypeError, "EagerGate: program field '%s' must be a plain slot of an attrs class (%s)", name,
                     Py_TYPE(program)->tp_name);
        return -1;
    }
#endif
    return 0;
}

/* program.name (a new reference), checked to be of ``type`` where one is given. */
static PyObject *field_of(PyObject *program, const char *name, PyTypeObject *type) {
    PyObject *value = PyObject_GetAttrString(program, name);
    if (value != NULL && type != NULL && !PyObject_TypeCheck(value, type)) {
        PyErr_Format(PyExc_TypeError, "EagerGate: program.%s must be a %s, got %s", name, type->tp_name,
                     Py_TYPE(value)->tp_name);
        Py_CLEAR(value);
    }
    return value;
}

static int read_number(PyObject *program, const char *name, long long *out) {
    PyObject *value = field_of(program, name, &PyLong_Type);
    if (value == NULL)
        return -1;
    *out = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* The program's fixed fields, read by name into the gate (which is cleared first). */
static int read_fixed(Gate *g, PyObject *program) {
#define FIELD(member, name, type)                                                                                   \
    if ((g->member = field_of(program, name, type)) == NULL)                                                        \
        return -1;
    FIELD(region, "region", NULL)
    FIELD(by_pre_key, "by_pre_key", &PyDict_Type)
    FIELD(entry_shapes, "entry_shapes", &PyDict_Type)
    FIELD(session, "session", NULL)
    FIELD(fn, "fn", NULL)
    FIELD(touch, "touch", NULL)
    FIELD(clock, "clock", NULL)
    FIELD(padded_type, "padded_type", NULL)
    FIELD(buckets, "buckets", &PyFrozenSet_Type)
    FIELD(specs, "specs", &PyTuple_Type)
    FIELD(flat, "flat", NULL)
    FIELD(tensor_type, "tensor_type", &PyType_Type)
    FIELD(dynamic_type, "dynamic_type", &PyType_Type)
    FIELD(dynamic_mark, "dynamic_mark", NULL)
    FIELD(plain, "plain", &PyFrozenSet_Type)
    FIELD(miss, "miss", NULL)
    FIELD(eagerly, "eagerly", NULL)
    FIELD(declined, "declined", NULL)
#undef FIELD
    if (read_number(program, "largest", &g->largest) < 0 || read_number(program, "mask", &g->mask) < 0 ||
        read_number(program, "settled", &g->settled) < 0 || read_number(program, "settled_mask", &g->settled_mask) < 0)
        return -1;
    PyObject *time_replays = field_of(program, "time_replays", &PyBool_Type);
    if (time_replays == NULL)
        return -1;
    g->time_replays = time_replays == Py_True;
    Py_DECREF(time_replays);
    PyObject *exclusion = field_of(program, "exclusion", NULL);
    if (exclusion == NULL)
        return -1;
    g->enter = PyObject_GetAttr(exclusion, s_enter);
    g->exit = g->enter == NULL ? NULL : PyObject_GetAttr(exclusion, s_exit);
    Py_DECREF(exclusion);
    return g->exit == NULL ? -1 : 0;
}

/* The live fields' slots, and the ints' owners and slots. */
static int read_slots(Gate *g, PyObject *program) {
    for (int i = 0; i < LIVE_COUNT; i++)
        if (live_slot(program, live_names[i], &g->live[i]) < 0)
            return -1;
    for (int i = 0; i < AT_COUNT; i++) {
        if ((g->owners[i] = field_of(program, int_slots[i].field, NULL)) == NULL)
            return -1;
        PyObject *where = PyUnicode_FromFormat("program.%s", int_slots[i].field);
        int missing = where == NULL ? -1 : has_field(g->owners[i], PyUnicode_AsUTF8(where), int_slots[i].name);
        Py_XDECREF(where);
        if (missing < 0)
            return -1;
        g->at[i] = slot_of(g->owners[i], int_slots[i].name, int_slots[i].written);
    }
    return 0;
}

static int gate_init(Gate *g, PyObject *args, PyObject *kwargs) {
    PyObject *program;
    static char *names[] = {"program", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O", names, &program))
        return -1;
    gate_clear_refs(g); /* (a second __init__ starts over) */
    if (read_fixed(g, program) < 0 || read_slots(g, program) < 0) {
        gate_clear_refs(g);
        return -1;
    }
    g->program = Py_NewRef(program);
    return 0;
}

static PyObject *gate_vectorcall(PyObject *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames);

static PyObject *gate_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    Gate *g = (Gate *)PyType_GenericNew(type, args, kwargs);
    if (g != NULL) {
        g->vectorcall = gate_vectorcall;
        for (int i = 0; i < AT_COUNT; i++)
            g->at[i] = -1;
        for (int i = 0; i < LIVE_COUNT; i++)
            g->live[i] = -1;
    }
    return (PyObject *)g;
}

/* A live field of the program (a new reference). */
static PyObject *live(Gate *g, int which) {
    if (g->live[which] < 0) /* (a free-threaded build) */
        return PyObject_GetAttr(g->program, s_live[which]);
    PyObject *value = *(PyObject **)((char *)g->program + g->live[which]);
    if (value == NULL)
        PyErr_Format(PyExc_AttributeError, "EagerGate: program.%s is unset", live_names[which]);
    return Py_XNewRef(value);
}

/* owners[which].name (a new reference), read at its slot where it has one. */
static PyObject *get_at(Gate *g, int which) {
    Py_ssize_t at = g->at[which];
    PyObject *owner = g->owners[which];
    if (at >= 0) {
        PyObject *value = *(PyObject **)((char *)owner + at);
        if (value != NULL)
            return Py_NewRef(value);
    }
    return PyObject_GetAttr(owner, s_int_slots[which]); /* (an unset slot raises its AttributeError here) */
}

/* owners[which].name = value, written at its slot where it has one. */
static int set_at(Gate *g, int which, PyObject *value) {
    Py_ssize_t at = g->at[which];
    if (at >= 0) {
        PyObject **place = (PyObject **)((char *)g->owners[which] + at);
        PyObject *old = *place;
        *place = Py_NewRef(value);
        Py_XDECREF(old);
        return 0;
    }
    return PyObject_SetAttr(g->owners[which], s_int_slots[which], value);
}

/* An int of the program's objects as a C long long; -1 with an exception set on failure. */
static int read_int_at(Gate *g, int which, long long *out) {
    PyObject *value = get_at(g, which);
    if (value == NULL)
        return -1;
    *out = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* owners[which].name += 1; the new value in *out. */
static int bump_at(Gate *g, int which, long long *out) {
    long long value;
    if (read_int_at(g, which, &value) < 0)
        return -1;
    PyObject *bumped = PyLong_FromLongLong(value + 1);
    if (bumped == NULL)
        return -1;
    int status = set_at(g, which, bumped);
    Py_DECREF(bumped);
    if (out != NULL)
        *out = value + 1;
    return status;
}

static int truth_of(PyObject *owner, PyObject *name) {
    PyObject *value = PyObject_GetAttr(owner, name);
    if (value == NULL)
        return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

static double clock_now(Gate *g, int *failed) {
    PyObject *now = PyObject_CallNoArgs(g->clock);
    if (now == NULL) {
        *failed = 1;
        return 0.0;
    }
    double seconds = PyFloat_AsDouble(now);
    Py_DECREF(now);
    if (seconds == -1.0 && PyErr_Occurred())
        *failed = 1;
    return seconds;
}

/* Count a call of (region, shapes) in the sketch, as FrequencySketch.add does. */
static long long count_call(Gate *g, PyObject *counted) {
    PyObject *counts = get_at(g, AT_COUNTS);
    if (counts == NULL)
        return -1;
    if (!PyDict_CheckExact(counts)) {
        Py_DECREF(counts);
        PyErr_SetString(PyExc_TypeError, "the sketch's counts: expected a dict");
        return -1;
    }
    long long count = 1;
    PyObject *known = PyDict_GetItemWithError(counts, counted); /* borrowed */
    if (known != NULL && ((count = PyLong_AsLongLong(known) + 1) == 0 && PyErr_Occurred())) {
        Py_DECREF(counts);
        return -1;
    }
    if (known == NULL && PyErr_Occurred()) {
        Py_DECREF(counts);
        return -1;
    }
    PyObject *value = PyLong_FromLongLong(count);
    int status = value == NULL ? -1 : PyDict_SetItem(counts, counted, value);
    Py_XDECREF(value);
    Py_DECREF(counts);
    long long calls, window;
    if (status < 0 || bump_at(g, AT_CALLS, &calls) < 0 || read_int_at(g, AT_WINDOW, &window) < 0)
        return -1;
    if (calls >= window) {
        PyObject *owner = g->owners[AT_CALLS], *done = PyObject_CallMethodNoArgs(owner, s_halve);
        if (done == NULL)
            return -1;
        Py_DECREF(done);
    }
    return count;
}

/* The capture exclusion's __exit__ after the region's function; ``result`` NULL: it raised. */
static PyObject *left_exclusion(Gate *g, PyObject *result) {
    PyObject *type = NULL, *value = NULL, *traceback = NULL, *left;
    if (result == NULL) {
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
    }
    left = PyObject_CallFunctionObjArgs(g->exit, type ? type : Py_None, value ? value : Py_None,
                                        traceback ? traceback : Py_None, NULL);
    if (left == NULL) { /* the exit's own error replaces the call's, as in a with block */
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        Py_XDECREF(result);
        return NULL;
    }
    Py_DECREF(left); /* the shared side never suppresses an error */
    if (result == NULL)
        PyErr_Restore(type, value, traceback);
    return result;
}

/* Whether the runs-th eager run (or replay) is timed: one in mask + 1, from the settled-th on one
   in settled_mask + 1. */
static int is_timed(Gate *g, long long runs) {
    return (runs & (runs < g->settled ? g->mask : g->settled_mask)) == 0;
}

/* ``result`` of a call timed from ``started`` on, reported to the live field ``which`` (took,
   replayed); NULL (``result`` released) where the clock or the report raised. */
static PyObject *reported(Gate *g, PyObject *result, double started, int which) {
    int failed = 0;
    double now = clock_now(g, &failed);
    PyObject *seconds = failed ? NULL : PyFloat_FromDouble(now - started);
    PyObject *report = seconds == NULL ? NULL : live(g, which);
    PyObject *done = report == NULL ? NULL : PyObject_CallOneArg(report, seconds);
    Py_XDECREF(seconds);
    Py_XDECREF(report);
    if (done == NULL) {
        Py_DECREF(result);
        return NULL;
    }
    Py_DECREF(done);
    return result;
}

/* The region's function run eagerly under the exclusion, counted, some timed (is_timed:
   FlatDispatch.run_eagerly). */
static PyObject *run_eagerly(Gate *g, PyObject *args) {
    long long runs;
    if (bump_at(g, AT_EAGER_RUNS, NULL) < 0 || bump_at(g, AT_FORGOTTEN_RUNS, &runs) < 0)
        return NULL;
    int timed = is_timed(g, runs), failed = 0;
    PyObject *entered = PyObject_CallNoArgs(g->enter);
    if (entered == NULL)
        return NULL;
    Py_DECREF(entered);
    double started = timed ? clock_now(g, &failed) : 0.0;
    PyObject *result = left_exclusion(g, failed ? NULL : PyObject_Call(g->fn, args, NULL));
    if (result == NULL || !timed)
        return result;
    return reported(g, result, started, LIVE_TOOK);
}

/* A hit's replay (``run``, a candidate's): counted where the gate times replays, and then one
   timed as eager runs are (is_timed; FlatDispatch.known_pre_key), unless it declines. */
static PyObject *replay_hit(Gate *g, PyObject *run, PyObject *const *argv, Py_ssize_t count) {
    long long runs = 0;
    if (g->time_replays && bump_at(g, AT_REPLAY_RUNS, &runs) < 0)
        return NULL;
    if (!g->time_replays || !is_timed(g, runs))
        return PyObject_Vectorcall(run, argv, count, NULL);
    int failed = 0;
    double started = clock_now(g, &failed);
    if (failed)
        return NULL;
    PyObject *result = PyObject_Vectorcall(run, argv, count, NULL);
    if (result == NULL || result == g->declined)
        return result;
    return reported(g, result, started, LIVE_REPLAYED);
}

/* The whole admission rule (program.decide), for a count the quiet bound does not settle. */
static PyObject *decided(Gate *g, PyObject *args, PyObject *counted, PyObject *spec, long long calls) {
    PyObject *number = PyLong_FromLongLong(calls);
    PyObject *decide = number == NULL ? NULL : live(g, LIVE_DECIDE);
    PyObject *result = decide == NULL ? NULL : PyObject_CallFunctionObjArgs(decide, args, counted, spec, number, NULL);
    Py_XDECREF(number);
    Py_XDECREF(decide);
    if (result != g->eagerly)
        return result;
    Py_DECREF(result);
    return run_eagerly(g, args);
}

/* The flat spec of a call of ``count`` arguments (a new reference). */
static PyObject *flat_spec(Gate *g, Py_ssize_t count) {
    if (count < PyTuple_GET_SIZE(g->specs))
        return Py_NewRef(PyTuple_GET_ITEM(g->specs, count));
    PyObject *number = PyLong_FromSsize_t(count);
    PyObject *spec = number == NULL ? NULL : PyTuple_Pack(2, g->flat, number);
    Py_XDECREF(number);
    return spec;
}

/* FlatDispatch.unrecorded: a flat call of shapes no key has an entry for, counted. */
static PyObject *unrecorded(Gate *g, PyObject *args, PyObject *pre) {
    int closed = truth_of(g->session, s_closed);
    int gpu = closed ? 0 : truth_of(g->session, s_gpu);
    if (closed < 0 || gpu < 0)
        return NULL;
    if (closed || !gpu)
        return Py_NewRef(g->miss); /* the full path raises, or says once that everything runs eagerly */
    PyObject *spec = flat_spec(g, PyTuple_GET_SIZE(args));
    PyObject *shapes = spec == NULL ? NULL : PyTuple_Pack(2, spec, pre);
    int has_entry = shapes == NULL ? -1 : PyDict_Contains(g->entry_shapes, shapes);
    PyObject *counted = has_entry != 0 ? NULL : PyTuple_Pack(2, g->region, shapes);
    Py_XDECREF(shapes);
    if (counted == NULL) {
        Py_XDECREF(spec);
        return has_entry > 0 ? Py_NewRef(g->miss) : NULL; /* a key with these shapes has an entry */
    }
    long long calls = count_call(g, counted), record_after, below, quiet_version, version;
    PyObject *result = NULL;
    if (calls < 0 || read_int_at(g, AT_RECORD_AFTER, &record_after) < 0 || read_int_at(g, AT_QUIET_BELOW, &below) < 0 ||
        read_int_at(g, AT_QUIET_VERSION, &quiet_version) < 0 || read_int_at(g, AT_VERSION, &version) < 0)
        goto done;
    if (!(calls < below && calls != record_after && quiet_version == version)) {
        result = decided(g, args, counted, spec, calls);
        goto done;
    }
    if (calls <= record_after || bump_at(g, AT_TOO_RARE, NULL) == 0)
        result = run_eagerly(g, args); /* warming or too rare, as the rule would say */
done:
    Py_DECREF(counted);
    Py_DECREF(spec);
    return result;
}

/* A replay.padded marker (Padded) whose size needs no padding: its tensor (a new reference)
   and, in *shape, the tensor's shape (a new reference); *rows and *dim say what it pads. NULL
   without an exception where the full path must take the call (a size to pad, a marker of
   an unusual tensor); NULL with one on an error. replay.buckets' rule: no padding beyond the
   largest bucket or at a bucket's size. */
static PyObject *unpadded_marker(Gate *g, PyObject *marker, PyObject **shape, long long *rows, long long *dim) {
    *shape = NULL;
    PyObject *tensor = PyObject_GetAttr(marker, s_tensor);
    if (tensor == NULL)
        return NULL;
    PyObject *axis = Py_TYPE(tensor) == (PyTypeObject *)g->tensor_type ? PyObject_GetAttr(marker, s_dim) : NULL;
    if (axis == NULL)
        goto full_path;
    *dim = PyLong_AsLongLong(axis);
    Py_DECREF(axis);
    if (*dim == -1 && PyErr_Occurred())
        goto full_path;
    *shape = PyObject_GetAttr(tensor, s_shape);
    if (*shape == NULL || !PyTuple_Check(*shape) || *dim < 0 || *dim >= PyTuple_GET_SIZE(*shape))
        goto full_path; /* a strided nested tensor's shape raises: the full path refuses it */
    PyObject *size = PyTuple_GET_ITEM(*shape, *dim);
    *rows = PyLong_AsLongLong(size);
    if (*rows == -1 && PyErr_Occurred())
        goto full_path;
    int unpadded = *rows > g->largest ? 1 : PySet_Contains(g->buckets, size);
    if (unpadded > 0)
        return tensor;
    if (unpadded < 0) {
        Py_CLEAR(*shape);
        Py_DECREF(tensor);
        return NULL;
    }
full_path:
    PyErr_Clear();
    Py_CLEAR(*shape);
    Py_DECREF(tensor);
    return NULL;
}

/* The candidates of a recorded pre-key, tried as FlatDispatch.known_pre_key tries them: the
   replay's result (a new reference); NULL with an exception set; NULL without one when none
   served the call (no guard said yes, or every replay declined). The list may change while a
   candidate runs (an eviction, a new graph): read by index, each item held while used. */
static PyObject *serve_candidates(Gate *g, PyObject *args, PyObject *candidates) {
    PyObject *const *argv = &PyTuple_GET_ITEM(args, 0);
    Py_ssize_t count = PyTuple_GET_SIZE(args);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(candidates); i++) {
        PyObject *item = Py_NewRef(PyList_GET_ITEM(candidates, i)); /* (guard, replay, entry) */
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
            Py_DECREF(item);
            PyErr_SetString(PyExc_TypeError, "a pre-key candidate is a (guard, replay, entry) tuple");
            return NULL;
        }
        PyObject *answer = PyObject_Vectorcall(PyTuple_GET_ITEM(item, 0), argv, count, NULL);
        int yes = answer == NULL ? -1 : PyObject_IsTrue(answer);
        Py_XDECREF(answer);
        if (yes <= 0) {
            Py_DECREF(item);
            if (yes < 0)
                return NULL;
            continue;
        }
        PyObject *drift = live(g, LIVE_REGION_DRIFT); /* None: no globals to check */
        PyObject *checked = drift == NULL ? NULL : drift == Py_None ? Py_NewRef(Py_None) : PyObject_CallNoArgs(drift);
        Py_XDECREF(drift);
        PyObject *touched = checked == NULL ? NULL : PyObject_CallOneArg(g->touch, PyTuple_GET_ITEM(item, 2));
        Py_XDECREF(checked);
        PyObject *result = touched == NULL ? NULL : replay_hit(g, PyTuple_GET_ITEM(item, 1), argv, count);
        Py_XDECREF(touched);
        Py_DECREF(item);
        if (result != g->declined)
            return result; /* the replay's outputs, or NULL with its exception */
        Py_DECREF(result); /* declined: another candidate may serve it */
    }
    return NULL;
}

/* FlatDispatch.known_pre_key: a recorded key's hit replays; a call none serves, of tensors and
   plain constants (``plain``), goes to the eager path, anything else to the full path. */
static PyObject *known_pre_key(Gate *g, PyObject *args, PyObject *pre, int plain) {
    if (PyDict_GET_SIZE(g->by_pre_key)) {
        PyObject *candidates = PyDict_GetItemWithError(g->by_pre_key, pre); /* borrowed */
        if (candidates == NULL && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_RuntimeError)) {
                PyErr_Clear(); /* an unhashable constant: the full path's */
                return Py_NewRef(g->miss);
            }
            return NULL;
        }
        if (candidates != NULL) {
            if (!PyList_Check(candidates)) {
                PyErr_SetString(PyExc_TypeError, "a region's pre-key table maps pre-keys to lists of candidates");
                return NULL;
            }
            Py_INCREF(candidates); /* the table may change while its candidates run */
            PyObject *result = serve_candidates(g, args, candidates);
            Py_DECREF(candidates);
            if (result != NULL || PyErr_Occurred())
                return result;
        }
    }
    return plain ? unrecorded(g, args, pre) : Py_NewRef(g->miss);
}

/* A call's markers as the call without them: the first marker makes ``*unpadded`` (a copy of
   the arguments), each puts its tensor in its place and its shape in *item. 0, or 1 where the
   call must take the full path (a marker to pad, markers that disagree), -1 on an error. */
static int take_marker(Gate *g, PyObject *args, Py_ssize_t i, PyObject **unpadded, PyObject **item,
                       long long *marked_rows, long long *marked_dim) {
    long long rows = 0, dim = 0;
    PyObject *tensor = unpadded_marker(g, PyTuple_GET_ITEM(args, i), item, &rows, &dim);
    if (tensor != NULL && *marked_dim >= 0 && (rows != *marked_rows || dim != *marked_dim)) {
        Py_DECREF(tensor); /* markers that disagree: the full path says how */
        Py_CLEAR(*item);
        tensor = NULL;
    }
    if (tensor == NULL)
        return PyErr_Occurred() ? -1 : 1;
    *marked_rows = rows, *marked_dim = dim;
    if (*unpadded == NULL) { /* a new tuple (a whole slice would be the call's own) */
        Py_ssize_t count = PyTuple_GET_SIZE(args);
        if ((*unpadded = PyTuple_New(count)) == NULL) {
            Py_DECREF(tensor);
            Py_CLEAR(*item);
            return -1;
        }
        for (Py_ssize_t j = 0; j < count; j++)
            PyTuple_SET_ITEM(*unpadded, j, Py_NewRef(PyTuple_GET_ITEM(args, j)));
    }
    Py_SETREF(PyTuple_GET_ITEM(*unpadded, i), tensor);
    return 0;
}

/* The pre-key of a flat call (its item for argument i in *item, a new reference): 0, 1 where
   the call must take the full path, -1 on an error. ``*plain`` drops to 0 for anything but
   tensors, markers and plain constants. */
static int pre_item(Gate *g, PyObject *args, Py_ssize_t i, PyObject **item, int *plain, PyObject **unpadded,
                    long long *marked_rows, long long *marked_dim) {
    PyObject *arg = PyTuple_GET_ITEM(args, i);
    PyObject *kind = (PyObject *)Py_TYPE(arg);
    if (kind == g->padded_type)
        return take_marker(g, args, i, unpadded, item, marked_rows, marked_dim);
    if (kind == g->tensor_type) {
        if ((*item = PyObject_GetAttr(arg, s_shape)) != NULL)
            return 0;
        if (!PyErr_ExceptionMatches(PyExc_RuntimeError))
            return -1;
        PyErr_Clear(); /* a strided nested tensor: the full path refuses it */
        return 1;
    }
    if (kind == g->dynamic_type) {
        *item = Py_NewRef(g->dynamic_mark);
        *plain = 0;
        return 0;
    }
    int constant = PySet_Contains(g->plain, kind);
    if (constant < 0)
        return -1;
    *plain &= constant;
    *item = Py_NewRef(arg);
    return 0;
}

/* FlatDispatch.__call__: the pre-key of positional tensors (their shapes) and constants, the
   markers that need no padding taken as their tensors; anything else is the full path's. */
static PyObject *gate_call(Gate *g, PyObject *args) {
    Py_ssize_t count = PyTuple_GET_SIZE(args);
    PyObject *pre = PyTuple_New(count), *unpadded = NULL, *result = NULL;
    if (pre == NULL)
        return NULL;
    int plain = 1, status = 0; /* plain: every argument a tensor, a marker or a plain constant */
    long long marked_rows = 0, marked_dim = -1;
    for (Py_ssize_t i = 0; i < count && status == 0; i++) {
        PyObject *item = NULL;
        status = pre_item(g, args, i, &item, &plain, &unpadded, &marked_rows, &marked_dim);
        if (status == 0)
            PyTuple_SET_ITEM(pre, i, item);
    }
    if (status != 0) {
        result = status < 0 ? NULL : Py_NewRef(g->miss);
    } else if (unpadded == NULL) {
        result = known_pre_key(g, args, pre, plain);
    } else if (!plain) {
        result = Py_NewRef(g->miss); /* (markers beside a dynamic scalar or another constant: the full path) */
    } else if ((result = known_pre_key(g, unpadded, pre, 1)) == g->miss) {
        PyObject *full = live(g, LIVE_FULL_PATH), *no_keywords = full == NULL ? NULL : PyDict_New();
        Py_SETREF(result, no_keywords == NULL ? NULL : PyObject_CallFunctionObjArgs(full, unpadded, no_keywords, NULL));
        Py_XDECREF(no_keywords);
        Py_XDECREF(full);
    }
    Py_DECREF(pre);
    Py_XDECREF(unpadded);
    return result;
}

static PyObject *gate_vectorcall(PyObject *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames)) ||
        !PyTuple_CheckExact(argv[0])) {
        PyErr_SetString(PyExc_TypeError, "an eager gate takes the call's argument tuple");
        return NULL;
    }
    return gate_ready((Gate *)self) ? gate_call((Gate *)self, argv[0]) : NULL;
}

static PyObject *gate_tp_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "an eager gate takes the call's argument tuple");
        return NULL;
    }
    return gate_vectorcall(self, &PyTuple_GET_ITEM(args, 0), PyTuple_GET_SIZE(args), NULL);
}

/* The ints read and written at their slots (see slot_of), as "field.name", for the tests. */
static PyObject *gate_direct_slots(Gate *g, void *unused) {
    PyObject *found = PyList_New(0);
    for (int i = 0; found != NULL && g->program != NULL && i < AT_COUNT; i++) {
        if (g->at[i] < 0)
            continue;
        PyObject *name = PyUnicode_FromFormat("%s.%s", int_slots[i].field, int_slots[i].name);
        if (name == NULL || PyList_Append(found, name) < 0)
            Py_CLEAR(found);
        Py_XDECREF(name);
    }
    return found;
}

static PyObject *gate_program(Gate *g, void *unused) {
    return gate_ready(g) ? Py_NewRef(g->program) : NULL;
}

static PyGetSetDef gate_getset[] = {
    {"direct_slots", (getter)gate_direct_slots, NULL, "the ints read and written at their slots", NULL},
    {"program", (getter)gate_program, NULL, "the DispatchProgram this gate runs", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject GateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "replay._eager.EagerGate",
    .tp_basicsize = sizeof(Gate),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Gate, vectorcall),
    .tp_doc = "A region's flat dispatch (replay.dispatch.FlatDispatch) in C: EagerGate(program); see "
              "csrc/replay_eager.c.",
    .tp_new = gate_new,
    .tp_init = (initproc)gate_init,
    .tp_dealloc = (destructor)gate_dealloc,
    .tp_traverse = (traverseproc)gate_traverse,
    .tp_clear = (inquiry)gate_clear,
    .tp_call = gate_tp_call,
    .tp_getset = gate_getset,
};

/* Region.__call__ (replay/region.py) in C: a method descriptor, so a call of a region reaches
   its dispatch (the gate above, or FlatDispatch) without a Python frame of its own. The same
   steps: without keyword arguments, region.dispatch(args); its RegionDrift means the region's
   globals changed (rekey); MISS, or keyword arguments, take the full path (full_path). */
typedef struct {
    PyObject_HEAD
    PyObject *miss;  /* replay.dispatch.MISS; NULL until __init__ */
    PyObject *drift; /* replay.dispatch.RegionDrift (an exception class) */
    vectorcallfunc vectorcall;
} RegionCall;

static PyObject *s_dispatch, *s_rekey, *s_full_path;

/* The call's keyword arguments as a dict (a new reference). */
static PyObject *keywords_of(PyObject *const *argv, Py_ssize_t given, PyObject *kwnames) {
    PyObject *kwargs = PyDict_New();
    Py_ssize_t count = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; kwargs != NULL && i < count; i++)
        if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), argv[given + i]) < 0)
            Py_CLEAR(kwargs);
    return kwargs;
}

static PyObject *region_call_vectorcall(PyObject *callable, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    RegionCall *rc = (RegionCall *)callable;
    Py_ssize_t given = PyVectorcall_NARGS(nargsf);
    if (rc->miss == NULL || rc->drift == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "RegionCall was not initialised: make it as RegionCall(miss=..., drift=...)");
        return NULL;
    }
    if (given < 1) {
        PyErr_SetString(PyExc_TypeError, "Region.__call__ needs the region");
        return NULL;
    }
    PyObject *region = argv[0], *args = PyTuple_New(given - 1), *result = NULL;
    if (args == NULL)
        return NULL;
    for (Py_ssize_t i = 1; i < given; i++)
        PyTuple_SET_ITEM(args, i - 1, Py_NewRef(argv[i]));
    int rekey = 0;
    if (kwnames == NULL || !PyTuple_GET_SIZE(kwnames)) {
        PyObject *dispatch = PyObject_GetAttr(region, s_dispatch);
        result = dispatch == NULL ? NULL : PyObject_CallOneArg(dispatch, args);
        Py_XDECREF(dispatch);
        if (result == NULL && dispatch != NULL && PyErr_ExceptionMatches(rc->drift)) {
            PyErr_Clear();
            rekey = 1;
        } else if (result == NULL || result != rc->miss) {
            Py_DECREF(args);
            return result; /* the usual call: no keyword dictionary made */
        }
        Py_CLEAR(result);
    }
    PyObject *kwargs = keywords_of(argv, given, kwnames);
    if (kwargs != NULL)
        result = PyObject_CallMethodObjArgs(region, rekey ? s_rekey : s_full_path, args, kwargs, NULL);
    Py_DECREF(args);
    Py_XDECREF(kwargs);
    return result;
}

static int region_call_init(RegionCall *self, PyObject *args, PyObject *kwargs) {
    PyObject *miss, *drift;
    static char *names[] = {"miss", "drift", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO", names, &miss, &drift))
        return -1;
    if (!PyExceptionClass_Check(drift)) {
        PyErr_Format(PyExc_TypeError, "RegionCall: drift must be an exception class, got %s", Py_TYPE(drift)->tp_name);
        return -1;
    }
    Py_XSETREF(self->miss, Py_NewRef(miss));
    Py_XSETREF(self->drift, Py_NewRef(drift));
    return 0;
}

static PyObject *region_call_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    RegionCall *self = (RegionCall *)PyType_GenericNew(type, args, kwargs);
    if (self != NULL)
        self->vectorcall = region_call_vectorcall;
    return (PyObject *)self;
}

static int region_call_traverse(RegionCall *self, visitproc visit, void *arg) {
    Py_VISIT(self->miss);
    Py_VISIT(self->drift);
    return 0;
}

static int region_call_clear(RegionCall *self) {
    Py_CLEAR(self->miss);
    Py_CLEAR(self->drift);
    return 0;
}

static void region_call_dealloc(RegionCall *self) {
    PyObject_GC_UnTrack(self);
    region_call_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* region.__call__ read as an attribute: the method bound to the region. */
static PyObject *region_call_get(PyObject *self, PyObject *instance, PyObject *owner) {
    if (instance == NULL || instance == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, instance);
}

static PyTypeObject RegionCallType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "replay._eager.RegionCall",
    .tp_basicsize = sizeof(RegionCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_vectorcall_offset = offsetof(RegionCall, vectorcall),
    .tp_doc = "Region.__call__ in C (see csrc/replay_eager.c).",
    .tp_new = region_call_new,
    .tp_init = (initproc)region_call_init,
    .tp_dealloc = (destructor)region_call_dealloc,
    .tp_traverse = (traverseproc)region_call_traverse,
    .tp_clear = (inquiry)region_call_clear,
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = region_call_get,
};

static struct PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT, "replay._eager", "A region's flat dispatch and call in C (see csrc/replay_eager.c).", -1, NULL,
};

static int add_type(PyObject *module, const char *name, PyTypeObject *type) {
    if (PyType_Ready(type) < 0)
        return -1;
    Py_INCREF(type);
    if (PyModule_AddObject(module, name, (PyObject *)type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}

PyMODINIT_FUNC PyInit__eager(void) {
    struct {
        PyObject **var;
        const char *text;
    } interned[] = {{&s_tensor, "tensor"}, {&s_dim, "dim"},         {&s_closed, "closed"},       {&s_gpu, "_gpu"},
                    {&s_halve, "halve"},   {&s_shape, "shape"},     {&s_enter, "__enter__"},     {&s_exit, "__exit__"},
                    {&s_dispatch, "dispatch"}, {&s_rekey, "rekey"}, {&s_full_path, "full_path"}};
    for (size_t i = 0; i < sizeof(interned) / sizeof(interned[0]); i++)
        if ((*interned[i].var = PyUnicode_InternFromString(interned[i].text)) == NULL)
            return NULL;
    for (int i = 0; i < AT_COUNT; i++)
        if ((s_int_slots[i] = PyUnicode_InternFromString(int_slots[i].name)) == NULL)
            return NULL;
    for (int i = 0; i < LIVE_COUNT; i++)
        if ((s_live[i] = PyUnicode_InternFromString(live_names[i])) == NULL)
            return NULL;
    PyObject *module = PyModule_Create(&module_definition);
    if (module == NULL)
        return NULL;
    if (add_type(module, "EagerGate", &GateType) < 0 || add_type(module, "RegionCall", &RegionCallType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
