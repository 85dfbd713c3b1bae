/*
 * replay._eager: a region's flat eager path (Region._eager_flat, _eager_flat_shapes and
 * _run_flat_eagerly in replay/session.py) made in C.
 *
 * Why: in a loop whose shapes rarely repeat (a uniform mix of hundreds of batch sizes, a
 * prefill of lengths seen once) nearly every call of a region runs eagerly, and what the
 * session adds to such a call is bookkeeping: the call's shapes, a lookup of keys with
 * graphs, a count, the decision that it only warms or is too rare, the capture exclusion.
 * Timed alone that is about 2 us of Python; inside a loop of a real region, whose own work
 * (torch, the jit, the driver) leaves the interpreter's caches cold, the same Python took 13
 * to 19 us a call on the H200 machine (a time stamp at each step showed every step of it
 * slower, none singled out). The same steps from C took about 5 us a call less there
 * (docs/replay.md, "The eager path").
 *
 * Where the region has recorded keys the gate also looks the call's pre-key up in their table
 * (region.fast): a miss goes on to the eager path above, a hit tries the candidates found as
 * the generated dispatch (Region._fast_keys) would: each (guard, replay, entry) in turn, the
 * first whose guard says yes checks the region's globals (region._region_drift, generated
 * Python, which raises when they changed), is touched in the session's LRU and replays; a
 * replay that declines leaves the call to the next candidate, then to the eager path. A call
 * of a loop whose shapes rarely repeat then enters Python only in the region's function, and
 * a replayed call only in its guard and its replay.
 *
 * In a session with buckets (without verify_every or polymorphic replay), a replay.padded
 * argument whose size needs no padding (beyond the largest bucket, or a bucket's size) is
 * taken as its tensor here, as replay.buckets.call would take it (Region._call_padded), so a
 * prefill-like loop whose lengths mostly lie beyond the buckets costs what an ordinary call
 * costs instead of a trip through the padded path's Python; every other padded call, and any
 * disagreement between markers, is the full path's.
 *
 * What stays in Python: every decision other than "warming or too rare, as the rule would
 * say" (admission.quiet_below, kept by the region), the rule itself (Region._eager_decide,
 * called with the count already made), the halving of the counts, the eager-time estimate
 * (Region._eager_took), the capture exclusion (its __enter__ and __exit__, bound once; in C
 * too where jitcore._exclusion is built). Every value is read from the same Python objects
 * the Python path reads, on every call, so the two paths cannot drift apart in state (the
 * ints of slotted objects, the attrs classes', at their slots: see slot_of);
 * tests/replay/test_session.py runs both over the same calls and compares every count (on
 * the CPU, no GPU needed).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *region;       /* the Region */
    PyObject *session;      /* its Session: closed, _gpu, counters */
    PyObject *admission;    /* record_after */
    PyObject *sketch;       /* admission.sketch: counts (rebound when halved), calls, window */
    PyObject *budget;       /* admission.budget: version */
    PyObject *counters;     /* session.counters: too_rare, eager_runs */
    PyObject *forgotten;    /* region.forgotten: eager_runs */
    PyObject *quiet;        /* region.quiet: below, version (Region._refresh_quiet) */
    PyObject *entry_shapes; /* region.entry_shapes: shapes that have an entry */
    PyObject *table;        /* region.fast: pre-key -> candidates, the recorded keys of flat calls */
    PyObject *fn;           /* the region's function */
    PyObject *enter;        /* the capture exclusion's shared side: its bound __enter__ */
    PyObject *exit;         /* and __exit__ (looked up once) */
    PyObject *specs;        /* tuple: the flat argument specs, by argument count */
    PyObject *tensor_type;  /* torch.Tensor (exactly) */
    PyObject *dynamic_type; /* replay.Dynamic (exactly) */
    PyObject *dynamic_mark; /* what a Dynamic argument is in a pre-key */
    PyObject *plain;        /* frozenset of the plain constant types */
    PyObject *miss;         /* the session's _MISS */
    PyObject *clock;        /* time.perf_counter */
    PyObject *padded_type;  /* replay.buckets.Padded, or None where markers always take the full path */
    PyObject *buckets;      /* frozenset of the session's bucket sizes (markers of those sizes are not padded) */
    PyObject *touch;        /* the session's LRU's move_to_end */
    PyObject *declined;     /* what a replay that declines returns (replay.graph.MISMATCH) */
    long long largest;      /* the largest bucket (markers beyond it are not padded) */
    /* where the ints the gate reads and bumps lie in their (slotted) owners, or -1 (see slot_of) */
    Py_ssize_t at_calls, at_window, at_counts, at_record_after, at_version, at_too_rare, at_eager_runs, at_forgotten_runs,
        at_quiet_below, at_quiet_version;
    long long mask;         /* EAGER_TIMING_MASK */
    long long settled;      /* EAGER_TIMING_SETTLED: from this run on, */
    long long settled_mask; /* EAGER_TIMING_MASK_SETTLED */
    vectorcallfunc vectorcall;
} Gate;

static PyObject *s_below, *s_tensor, *s_dim, *s_full, *s_closed, *s_gpu, *s_counts, *s_calls, *s_window, *s_halve, *s_record_after, *s_version,
    *s_too_rare, *s_eager_runs, *s_shape, *s_enter, *s_exit, *s_decide,
    *s_took, *s_shapes_py, *s_region_drift;

static void gate_clear_refs(Gate *g) {
    Py_CLEAR(g->region);
    Py_CLEAR(g->session);
    Py_CLEAR(g->admission);
    Py_CLEAR(g->sketch);
    Py_CLEAR(g->budget);
    Py_CLEAR(g->counters);
    Py_CLEAR(g->forgotten);
    Py_CLEAR(g->quiet);
    Py_CLEAR(g->entry_shapes);
    Py_CLEAR(g->table);
    Py_CLEAR(g->fn);
    Py_CLEAR(g->enter);
    Py_CLEAR(g->exit);
    Py_CLEAR(g->specs);
    Py_CLEAR(g->tensor_type);
    Py_CLEAR(g->dynamic_type);
    Py_CLEAR(g->dynamic_mark);
    Py_CLEAR(g->plain);
    Py_CLEAR(g->miss);
    Py_CLEAR(g->clock);
    Py_CLEAR(g->padded_type);
    Py_CLEAR(g->buckets);
    Py_CLEAR(g->touch);
    Py_CLEAR(g->declined);
}

static int gate_traverse(Gate *g, visitproc visit, void *arg) {
    Py_VISIT(g->region);
    Py_VISIT(g->session);
    Py_VISIT(g->admission);
    Py_VISIT(g->sketch);
    Py_VISIT(g->budget);
    Py_VISIT(g->counters);
    Py_VISIT(g->forgotten);
    Py_VISIT(g->quiet);
    Py_VISIT(g->entry_shapes);
    Py_VISIT(g->table);
    Py_VISIT(g->fn);
    Py_VISIT(g->enter);
    Py_VISIT(g->exit);
    Py_VISIT(g->specs);
    Py_VISIT(g->tensor_type);
    Py_VISIT(g->dynamic_type);
    Py_VISIT(g->dynamic_mark);
    Py_VISIT(g->plain);
    Py_VISIT(g->miss);
    Py_VISIT(g->clock);
    Py_VISIT(g->padded_type);
    Py_VISIT(g->buckets);
    Py_VISIT(g->touch);
    Py_VISIT(g->declined);
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

static Py_ssize_t slot_of(PyObject *owner, PyObject *name, int written);

static int gate_init(Gate *g, PyObject *args, PyObject *kwargs) {
    PyObject *region, *session, *admission, *sketch, *budget, *counters, *forgotten, *quiet, *entry_shapes, *table, *fn,
        *exclusion, *specs, *tensor_type, *dynamic_type, *dynamic_mark, *plain, *miss, *clock, *padded_type, *buckets,
        *touch, *declined;
    long long mask, settled, settled_mask, largest;
    static char *names[] = {"region",       "session",   "admission", "sketch",      "budget",
                            "counters",     "forgotten", "quiet",     "entry_shapes", "table",    "fn",
                            "exclusion",    "specs",     "tensor_type", "dynamic_type", "dynamic_mark",
                            "plain",        "miss",      "clock",     "mask",        "settled",
                            "settled_mask", "padded_type", "buckets",  "largest",   "touch",
                            "declined",     NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOOOO!O!OOO!OOOO!OOLLLOO!LOO", names, &region, &session,
                                     &admission, &sketch, &budget, &counters, &forgotten, &quiet, &PyDict_Type,
                                     &entry_shapes, &PyDict_Type, &table, &fn, &exclusion, &PyTuple_Type, &specs,
                                     &tensor_type, &dynamic_type, &dynamic_mark, &PyFrozenSet_Type, &plain, &miss,
                                     &clock, &mask, &settled, &settled_mask, &padded_type, &PyFrozenSet_Type,
                                     &buckets, &largest, &touch, &declined))
        return -1;
    PyObject *enter = PyObject_GetAttr(exclusion, s_enter);
    PyObject *exit = enter == NULL ? NULL : PyObject_GetAttr(exclusion, s_exit);
    if (exit == NULL) {
        Py_XDECREF(enter);
        return -1;
    }
    gate_clear_refs(g);
    g->enter = enter;
    g->exit = exit;
#define KEEP(field) (Py_INCREF(field), g->field = field)
    KEEP(region);
    KEEP(session);
    KEEP(admission);
    KEEP(sketch);
    KEEP(budget);
    KEEP(counters);
    KEEP(forgotten);
    KEEP(quiet);
    KEEP(entry_shapes);
    KEEP(table);
    KEEP(fn);
    KEEP(specs);
    KEEP(tensor_type);
    KEEP(dynamic_type);
    KEEP(dynamic_mark);
    KEEP(plain);
    KEEP(miss);
    KEEP(clock);
    KEEP(padded_type);
    KEEP(buckets);
    KEEP(touch);
    KEEP(declined);
#undef KEEP
    g->largest = largest;
    g->at_calls = slot_of(sketch, s_calls, 1);
    g->at_window = slot_of(sketch, s_window, 0);
    g->at_counts = slot_of(sketch, s_counts, 0);
    g->at_record_after = slot_of(admission, s_record_after, 0);
    g->at_version = slot_of(budget, s_version, 0);
    g->at_too_rare = slot_of(counters, s_too_rare, 1);
    g->at_eager_runs = slot_of(counters, s_eager_runs, 1);
    g->at_forgotten_runs = slot_of(forgotten, s_eager_runs, 1);
    g->at_quiet_below = slot_of(quiet, s_below, 0);
    g->at_quiet_version = slot_of(quiet, s_version, 0);
    g->mask = mask;
    g->settled = settled;
    g->settled_mask = settled_mask;
    return 0;
}

static PyObject *gate_vectorcall(PyObject *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames);

static PyObject *gate_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    Gate *g = (Gate *)PyType_GenericNew(type, args, kwargs);
    if (g != NULL)
        g->vectorcall = gate_vectorcall;
    return (PyObject *)g;
}

/* Where attribute ``name`` of ``owner`` lies in its object: the offset of a plain __slots__
   member (an attrs class's field), or -1 (read and written as an attribute; ``written``: the
   gate writes it too, so a type that hooks setting attributes keeps its hook). Why: inside a
   loop whose own work leaves the caches cold, an attribute lookup (the type's cache, its
   dictionaries, the descriptor) cost more than the value itself; a slot read at its offset is
   what the attribute lookup ends in, for a type that neither overrides getting or setting
   attributes nor the member's kind (checked once, here). */
static Py_ssize_t slot_of(PyObject *owner, PyObject *name, int written) {
#ifdef Py_GIL_DISABLED
    return -1; /* (a free-threaded build locks an object's attributes: no access past that) */
#endif
    PyTypeObject *type = Py_TYPE(owner);
    if (type->tp_getattro != PyObject_GenericGetAttr || (written && type->tp_setattro != PyObject_GenericSetAttr))
        return -1;
    PyObject *descriptor = PyObject_GetAttr((PyObject *)type, name);
    if (descriptor == NULL) {
        PyErr_Clear();
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

/* owner.name (a new reference), read at its slot where ``at`` is one. */
static PyObject *get_at(PyObject *owner, PyObject *name, Py_ssize_t at) {
    if (at >= 0) {
        PyObject *value = *(PyObject **)((char *)owner + at);
        if (value != NULL)
            return Py_NewRef(value);
    }
    return PyObject_GetAttr(owner, name); /* (an unset slot raises its AttributeError here) */
}

/* owner.name = value, written at its slot where ``at`` is one. */
static int set_at(PyObject *owner, PyObject *name, Py_ssize_t at, PyObject *value) {
    if (at >= 0) {
        PyObject **place = (PyObject **)((char *)owner + at);
        PyObject *old = *place;
        *place = Py_NewRef(value);
        Py_XDECREF(old);
        return 0;
    }
    return PyObject_SetAttr(owner, name, value);
}

/* An int attribute (at its slot where ``at`` is one) as a C long long; -1 with an exception
   set on failure. */
static int read_int_at(PyObject *owner, PyObject *name, Py_ssize_t at, long long *out) {
    PyObject *value = get_at(owner, name, at);
    if (value == NULL)
        return -1;
    *out = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* owner.name += 1 (at its slot where ``at`` is one); the new value in *out. */
static int bump_at(PyObject *owner, PyObject *name, Py_ssize_t at, long long *out) {
    long long value;
    if (read_int_at(owner, name, at, &value) < 0)
        return -1;
    PyObject *bumped = PyLong_FromLongLong(value + 1);
    if (bumped == NULL)
        return -1;
    int status = set_at(owner, name, at, bumped);
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
    PyObject *counts = get_at(g->sketch, s_counts, g->at_counts);
    if (counts == NULL)
        return -1;
    if (!PyDict_CheckExact(counts)) {
        Py_DECREF(counts);
        PyErr_SetString(PyExc_TypeError, "the sketch's counts: expected a dict");
        return -1;
    }
    long long count = 1;
    PyObject *known = PyDict_GetItemWithError(counts, counted); /* borrowed */
    if (known != NULL) {
        count = PyLong_AsLongLong(known) + 1;
        if (count == 0 && PyErr_Occurred()) {
            Py_DECREF(counts);
            return -1;
        }
    } else if (PyErr_Occurred()) {
        Py_DECREF(counts);
        return -1;
    }
    PyObject *value = PyLong_FromLongLong(count);
    int status = value == NULL ? -1 : PyDict_SetItem(counts, counted, value);
    Py_XDECREF(value);
    Py_DECREF(counts);
    if (status < 0)
        return -1;
    long long calls, window;
    if (bump_at(g->sketch, s_calls, g->at_calls, &calls) < 0 ||
        read_int_at(g->sketch, s_window, g->at_window, &window) < 0)
        return -1;
    if (calls >= window) {
        PyObject *done = PyObject_CallMethodNoArgs(g->sketch, s_halve);
        if (done == NULL)
            return -1;
        Py_DECREF(done);
    }
    return count;
}

/* The region's function run eagerly under the exclusion, counted, some timed (one in mask + 1,
   from the settled-th run on one in settled_mask + 1: Region._run_flat_eagerly, _timed_run). */
static PyObject *run_eagerly(Gate *g, PyObject *args) {
    long long runs;
    if (bump_at(g->counters, s_eager_runs, g->at_eager_runs, NULL) < 0 ||
        bump_at(g->forgotten, s_eager_runs, g->at_forgotten_runs, &runs) < 0)
        return NULL;
    int timed = (runs & (runs < g->settled ? g->mask : g->settled_mask)) == 0, failed = 0;
    PyObject *entered = PyObject_CallNoArgs(g->enter);
    if (entered == NULL)
        return NULL;
    Py_DECREF(entered);
    double started = timed ? clock_now(g, &failed) : 0.0;
    PyObject *result = failed ? NULL : PyObject_Call(g->fn, args, NULL);
    PyObject *type, *value, *traceback, *left;
    if (result == NULL) {
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        left = PyObject_CallFunctionObjArgs(g->exit, type ? type : Py_None, value ? value : Py_None,
                                            traceback ? traceback : Py_None, NULL);
        if (left == NULL) { /* the exit's own error replaces the call's, as in a with block */
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(traceback);
            return NULL;
        }
        Py_DECREF(left); /* the shared side never suppresses an error */
        PyErr_Restore(type, value, traceback);
        return NULL;
    }
    left = PyObject_CallFunctionObjArgs(g->exit, Py_None, Py_None, Py_None, NULL);
    if (left == NULL) {
        Py_DECREF(result);
        return NULL;
    }
    Py_DECREF(left);
    if (timed) {
        double now = clock_now(g, &failed);
        PyObject *seconds = failed ? NULL : PyFloat_FromDouble(now - started);
        PyObject *took = seconds == NULL ? NULL : PyObject_CallMethodOneArg(g->region, s_took, seconds);
        Py_XDECREF(seconds);
        if (took == NULL) {
            Py_DECREF(result);
            return NULL;
        }
        Py_DECREF(took);
    }
    return result;
}

/* Region._eager_flat_shapes: the call's pre-key computed by the caller. */
static PyObject *with_shapes(Gate *g, PyObject *args, PyObject *pre) {
    int closed = truth_of(g->session, s_closed);
    if (closed < 0)
        return NULL;
    int gpu = closed ? 0 : truth_of(g->session, s_gpu);
    if (gpu < 0)
        return NULL;
    if (closed || !gpu)
        return Py_NewRef(g->miss); /* the full path raises, or says once that everything runs eagerly */
    Py_ssize_t count = PyTuple_GET_SIZE(args);
    if (count >= PyTuple_GET_SIZE(g->specs)) /* an unusual arity: the Python path builds its spec */
        return PyObject_CallMethodObjArgs(g->region, s_shapes_py, args, pre, NULL);
    PyObject *spec = PyTuple_GET_ITEM(g->specs, count);
    PyObject *shapes = PyTuple_Pack(2, spec, pre);
    if (shapes == NULL)
        return NULL;
    int has_entry = PyDict_Contains(g->entry_shapes, shapes);
    if (has_entry) {
        Py_DECREF(shapes);
        return has_entry < 0 ? NULL : Py_NewRef(g->miss); /* a key with these shapes has an entry */
    }
    PyObject *counted = PyTuple_Pack(2, g->region, shapes);
    Py_DECREF(shapes);
    if (counted == NULL)
        return NULL;
    long long calls = count_call(g, counted);
    long long record_after, quiet_below, quiet_version, version;
    if (calls < 0 || read_int_at(g->admission, s_record_after, g->at_record_after, &record_after) < 0 ||
        read_int_at(g->quiet, s_below, g->at_quiet_below, &quiet_below) < 0 ||
        read_int_at(g->quiet, s_version, g->at_quiet_version, &quiet_version) < 0 ||
        read_int_at(g->budget, s_version, g->at_version, &version) < 0) {
        Py_DECREF(counted);
        return NULL;
    }
    if (!(calls < quiet_below && calls != record_after && quiet_version == version)) {
        /* the whole rule: Region._eager_decide, with this call counted already */
        PyObject *number = PyLong_FromLongLong(calls);
        PyObject *result =
            number == NULL ? NULL : PyObject_CallMethodObjArgs(g->region, s_decide, args, counted, spec, number, NULL);
        Py_XDECREF(number);
        Py_DECREF(counted);
        return result;
    }
    Py_DECREF(counted);
    if (calls > record_after && bump_at(g->counters, s_too_rare, g->at_too_rare, NULL) < 0)
        return NULL;
    return run_eagerly(g, args);
}

/* A replay.padded marker (Padded) whose size needs no padding: its tensor (a new reference)
   and, in *shape, the tensor's shape (a new reference); *rows and *dim say what it pads. NULL
   without an exception where the full path must take the call (a size to pad, a marker of
   an unusual tensor); NULL with one on an error. replay.buckets.call's rule: no padding
   beyond the largest bucket or at a bucket's size. */
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

/* The candidates of a recorded pre-key, tried as Region._fast_keys tries them: the replay's
   result (a new reference); NULL with an exception set; NULL without one when none served
   the call (no guard said yes, or every replay declined). The list may change while a
   candidate runs (an eviction, a new graph): read by index, each item held while used. */
static PyObject *serve_candidates(Gate *g, PyObject *args, PyObject *candidates) {
    PyObject *const *argv = &PyTuple_GET_ITEM(args, 0);
    Py_ssize_t count = PyTuple_GET_SIZE(args);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(candidates); i++) {
        PyObject *item = Py_NewRef(PyList_GET_ITEM(candidates, i)); /* (guard, replay, entry) */
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
            Py_DECREF(item);
            PyErr_SetString(PyExc_TypeError, "a fast-path candidate is a (guard, replay, entry) tuple");
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
        PyObject *drift = PyObject_GetAttr(g->region, s_region_drift); /* None: no globals to check */
        PyObject *checked = drift == NULL ? NULL : drift == Py_None ? Py_NewRef(Py_None) : PyObject_CallNoArgs(drift);
        Py_XDECREF(drift);
        PyObject *touched = checked == NULL ? NULL : PyObject_CallOneArg(g->touch, PyTuple_GET_ITEM(item, 2));
        Py_XDECREF(checked);
        PyObject *result = touched == NULL ? NULL : PyObject_Vectorcall(PyTuple_GET_ITEM(item, 1), argv, count, NULL);
        Py_XDECREF(touched);
        Py_DECREF(item);
        if (result != g->declined)
            return result; /* the replay's outputs, or NULL with its exception */
        Py_DECREF(result); /* declined: another candidate may serve it */
    }
    return NULL;
}

/* A flat call whose pre-key is known: a recorded key's hit tries its candidates; a call none
   of them serves, of tensors and plain constants (``plain``), goes to the eager path,
   anything else to the full path. */
static PyObject *dispatch_flat(Gate *g, PyObject *args, PyObject *pre, int plain) {
    if (PyDict_GET_SIZE(g->table)) { /* recorded keys: a hit tries their candidates */
        PyObject *candidates = PyDict_GetItemWithError(g->table, pre); /* borrowed */
        if (candidates == NULL && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_RuntimeError)) {
                PyErr_Clear(); /* an unhashable constant: the full path's */
                return Py_NewRef(g->miss);
            }
            return NULL;
        }
        if (candidates != NULL) {
            if (!PyList_Check(candidates)) {
                PyErr_SetString(PyExc_TypeError, "a region's fast table maps pre-keys to lists of candidates");
                return NULL;
            }
            Py_INCREF(candidates); /* the table may change while its candidates run */
            PyObject *result = serve_candidates(g, args, candidates);
            Py_DECREF(candidates);
            if (result != NULL || PyErr_Occurred())
                return result;
        }
    }
    return plain ? with_shapes(g, args, pre) : Py_NewRef(g->miss);
}

/* Region._eager_flat: the pre-key of positional tensors (their shapes) and plain constants;
   anything else is the full path's. */
static PyObject *gate_call(Gate *g, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t given = PyVectorcall_NARGS(nargsf);
    if (given != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "an eager gate takes the call's argument tuple");
        return NULL;
    }
    PyObject *args = argv[0];
    if (!PyTuple_CheckExact(args)) {
        PyErr_SetString(PyExc_TypeError, "an eager gate takes the call's argument tuple");
        return NULL;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(args);
    PyObject *pre = PyTuple_New(count);
    if (pre == NULL)
        return NULL;
    int plain = 1; /* every argument a tensor or a plain constant: the eager path may take it */
    PyObject *unpadded = NULL; /* the call with its markers taken as their tensors, if it has any */
    long long marked_rows = 0, marked_dim = -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *arg = PyTuple_GET_ITEM(args, i), *item;
        PyObject *kind = (PyObject *)Py_TYPE(arg);
        if (kind == g->padded_type) {
            long long rows = 0, dim = 0;
            PyObject *tensor = unpadded_marker(g, arg, &item, &rows, &dim);
            if (tensor != NULL && marked_dim >= 0 && (rows != marked_rows || dim != marked_dim)) {
                Py_DECREF(tensor); /* markers that disagree: the full path says how */
                Py_DECREF(item);
                tensor = NULL;
            }
            if (tensor == NULL) {
                Py_DECREF(pre);
                Py_XDECREF(unpadded);
                return PyErr_Occurred() ? NULL : Py_NewRef(g->miss);
            }
            marked_rows = rows, marked_dim = dim;
            if (unpadded == NULL) { /* a new tuple (a whole slice would be the call's own) */
                if ((unpadded = PyTuple_New(count)) == NULL) {
                    Py_DECREF(tensor);
                    Py_DECREF(item);
                    Py_DECREF(pre);
                    return NULL;
                }
                for (Py_ssize_t j = 0; j < count; j++)
                    PyTuple_SET_ITEM(unpadded, j, Py_NewRef(PyTuple_GET_ITEM(args, j)));
            }
            Py_SETREF(PyTuple_GET_ITEM(unpadded, i), tensor);
        } else if (kind == g->tensor_type) {
            item = PyObject_GetAttr(arg, s_shape);
            if (item == NULL) {
                Py_DECREF(pre);
                Py_XDECREF(unpadded);
                if (PyErr_ExceptionMatches(PyExc_RuntimeError)) { /* a strided nested tensor: the full path refuses it */
                    PyErr_Clear();
                    return Py_NewRef(g->miss);
                }
                return NULL;
            }
        } else if (kind == g->dynamic_type) {
            item = Py_NewRef(g->dynamic_mark);
            plain = 0;
        } else {
            int constant = PySet_Contains(g->plain, kind);
            if (constant < 0) {
                Py_DECREF(pre);
                Py_XDECREF(unpadded);
                return NULL;
            }
            plain &= constant;
            item = Py_NewRef(arg);
        }
        PyTuple_SET_ITEM(pre, i, item);
    }
    PyObject *result;
    if (unpadded != NULL && plain) { /* the call as replay.buckets.call makes it: unpadded, its own key */
        result = dispatch_flat(g, unpadded, pre, 1);
        if (result == g->miss) { /* the unpadded call's full path (not the markers' again) */
            PyObject *no_keywords = PyDict_New();
            Py_SETREF(result, no_keywords == NULL ? NULL
                                                  : PyObject_CallMethodObjArgs(g->region, s_full, unpadded, no_keywords, NULL));
            Py_XDECREF(no_keywords);
        }
    } else { /* (markers with a Dynamic argument: the full path) */
        result = unpadded != NULL ? Py_NewRef(g->miss) : dispatch_flat(g, args, pre, plain);
    }
    Py_DECREF(pre);
    Py_XDECREF(unpadded);
    return result;
}

static PyObject *gate_vectorcall(PyObject *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    return gate_call((Gate *)self, argv, nargsf, kwnames);
}

static PyObject *gate_tp_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "an eager gate takes the call's argument tuple");
        return NULL;
    }
    return gate_call((Gate *)self, &PyTuple_GET_ITEM(args, 0), PyTuple_GET_SIZE(args), NULL);
}

static PyObject *gate_with_shapes(Gate *g, PyObject *const *argv, Py_ssize_t count) {
    if (count != 2 || !PyTuple_CheckExact(argv[0]) || !PyTuple_CheckExact(argv[1])) {
        PyErr_SetString(PyExc_TypeError, "with_shapes(args, pre): expected two tuples");
        return NULL;
    }
    return with_shapes(g, argv[0], argv[1]);
}

/* The attributes the gate reads and writes at their slots (see slot_of), for the tests. */
static PyObject *gate_direct_slots(Gate *g, void *unused) {
    const char *names[] = {"sketch.calls",         "sketch.window",  "sketch.counts",     "admission.record_after",
                           "budget.version",       "counters.too_rare", "counters.eager_runs", "forgotten.eager_runs",
                           "quiet.below",          "quiet.version"};
    Py_ssize_t at[] = {g->at_calls,        g->at_window,       g->at_counts,     g->at_record_after,
                       g->at_version,      g->at_too_rare,     g->at_eager_runs, g->at_forgotten_runs,
                       g->at_quiet_below,  g->at_quiet_version};
    PyObject *found = PyList_New(0);
    for (size_t i = 0; found != NULL && i < sizeof(at) / sizeof(at[0]); i++) {
        if (at[i] < 0)
            continue;
        PyObject *name = PyUnicode_FromString(names[i]);
        if (name == NULL || PyList_Append(found, name) < 0)
            Py_CLEAR(found);
        Py_XDECREF(name);
    }
    return found;
}

static PyGetSetDef gate_getset[] = {
    {"direct_slots", (getter)gate_direct_slots, NULL, "the attributes read and written at their slots", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef gate_methods[] = {
    {"with_shapes", (PyCFunction)(void (*)(void))gate_with_shapes, METH_FASTCALL,
     "with_shapes(args, pre): the call with its pre-key computed (Region._eager_flat_shapes)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject GateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "replay._eager.EagerGate",
    .tp_basicsize = sizeof(Gate),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Gate, vectorcall),
    .tp_doc = "A region's flat eager path (Region._eager_flat), in C; see csrc/replay_eager.c.",
    .tp_new = gate_new,
    .tp_init = (initproc)gate_init,
    .tp_dealloc = (destructor)gate_dealloc,
    .tp_traverse = (traverseproc)gate_traverse,
    .tp_clear = (inquiry)gate_clear,
    .tp_call = gate_tp_call,
    .tp_methods = gate_methods,
    .tp_getset = gate_getset,
};

/* Region.__call__ (replay/session.py) in C: a method descriptor, so a call of a region reaches
   its dispatcher (the generated _fast, or the gate above) without a Python frame of its own.
   The same steps: without keyword arguments, _fast(args); its _RegionDrift means the region's
   globals changed (_rekey); _MISS, or keyword arguments, take the full path (_call). */
typedef struct {
    PyObject_HEAD
    PyObject *miss;  /* the session's _MISS */
    PyObject *drift; /* the session's _RegionDrift (an exception class) */
    vectorcallfunc vectorcall;
} RegionCall;

static PyObject *s_fast, *s_rekey, *s_call;

static PyObject *region_call_vectorcall(PyObject *callable, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    RegionCall *rc = (RegionCall *)callable;
    Py_ssize_t given = PyVectorcall_NARGS(nargsf);
    if (given < 1) {
        PyErr_SetString(PyExc_TypeError, "Region.__call__ needs the region");
        return NULL;
    }
    PyObject *region = argv[0];
    Py_ssize_t count = given - 1, keywords = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    PyObject *args = PyTuple_New(count);
    if (args == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++)
        PyTuple_SET_ITEM(args, i, Py_NewRef(argv[1 + i]));
    PyObject *kwargs = NULL, *result = NULL;
    int rekey = 0;
    if (!keywords) {
        PyObject *fast = PyObject_GetAttr(region, s_fast);
        if (fast == NULL)
            goto done;
        result = PyObject_CallOneArg(fast, args);
        Py_DECREF(fast);
        if (result == NULL) {
            if (!PyErr_ExceptionMatches(rc->drift))
                goto done;
            PyErr_Clear();
            rekey = 1;
        } else if (result != rc->miss) {
            goto done; /* the usual call: no keyword dictionary made */
        } else {
            Py_CLEAR(result);
        }
    }
    kwargs = PyDict_New();
    if (kwargs == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < keywords; i++)
        if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), argv[given + i]) < 0)
            goto done;
    result = PyObject_CallMethodObjArgs(region, rekey ? s_rekey : s_call, args, kwargs, NULL);
done:
    Py_DECREF(args);
    Py_XDECREF(kwargs);
    return result;
}

static int region_call_init(RegionCall *self, PyObject *args, PyObject *kwargs) {
    PyObject *miss, *drift;
    static char *names[] = {"miss", "drift", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO", names, &miss, &drift))
        return -1;
    Py_INCREF(miss);
    Py_INCREF(drift);
    Py_XSETREF(self->miss, miss);
    Py_XSETREF(self->drift, drift);
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
    PyModuleDef_HEAD_INIT, "replay._eager", "A region's flat eager path in C (see csrc/replay_eager.c).", -1, NULL,
};

#define INTERN(var, text)                                                                                       \
    do {                                                                                                        \
        if ((var = PyUnicode_InternFromString(text)) == NULL)                                                   \
            return NULL;                                                                                        \
    } while (0)

PyMODINIT_FUNC PyInit__eager(void) {
    INTERN(s_below, "below");
    INTERN(s_tensor, "tensor");
    INTERN(s_dim, "dim");
    INTERN(s_full, "_call");
    INTERN(s_closed, "closed");
    INTERN(s_gpu, "_gpu");
    INTERN(s_counts, "counts");
    INTERN(s_calls, "calls");
    INTERN(s_window, "window");
    INTERN(s_halve, "halve");
    INTERN(s_record_after, "record_after");
    INTERN(s_version, "version");
    INTERN(s_too_rare, "too_rare");
    INTERN(s_eager_runs, "eager_runs");
    INTERN(s_shape, "shape");
    INTERN(s_enter, "__enter__");
    INTERN(s_exit, "__exit__");
    INTERN(s_decide, "_eager_decide");
    INTERN(s_took, "_eager_took");
    INTERN(s_region_drift, "_region_drift");
    INTERN(s_shapes_py, "_eager_flat_shapes");
    INTERN(s_fast, "_fast");
    INTERN(s_rekey, "_rekey");
    INTERN(s_call, "_call");
    if (PyType_Ready(&GateType) < 0 || PyType_Ready(&RegionCallType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_definition);
    if (module == NULL)
        return NULL;
    Py_INCREF(&GateType);
    if (PyModule_AddObject(module, "EagerGate", (PyObject *)&GateType) < 0) {
        Py_DECREF(&GateType);
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&RegionCallType);
    if (PyModule_AddObject(module, "RegionCall", (PyObject *)&RegionCallType) < 0) {
        Py_DECREF(&RegionCallType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
