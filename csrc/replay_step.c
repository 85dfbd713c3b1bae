/*
 * replay._step: a recorded graph's replay run from C, in its steady state.
 *
 * Why: a replay is two driver calls (a node update, the graph launch) and bookkeeping, and run
 * as generated Python (replay.graph_source) the bookkeeping costs more than the driver calls.
 * Here the same steps run in C: the pointer reads, the aliasing and output-memory checks, the
 * node patch and the launch (after the streams callers read the output memory on, where they
 * named any), the counters, and the fresh outputs (through the torch-side helper's
 * replay_support, csrc/replay_support.h, and the objects the generated function makes them with).
 *
 * ReplayStep(program) -> step(*leaves): the program is a replay.step_program.StepProgram, which
 * replay.graph_step builds only for graphs whose generated replay has no step outside what this
 * file runs. Its fields are read by name, once, here in build(): every object kept is owned by
 * the step, and a call reads only this struct's fields. The generated function stays the
 * reference: the step calls it, with the same arguments, for the whole call wherever this file
 * would have to decide something it does not decide, before doing anything:
 *   - a tensor's data pointer the helper's reader does not read (anything but a plain tensor,
 *     a torch function mode active);
 *   - the output slot to write is not the one the graph wrote last, nor the slot its copies
 *     write with nobody holding outputs in it, or a lane of it no longer spans the memory it was
 *     made over (a caller resized an output's storage: OutputSlots.choose decides, and drops it);
 *   - a graph's own output buffer that moved the same way (the function spoils the graph);
 *   - a rebound pointer plus its recorded delta outside 0 .. 2**64-1 (the function raises).
 * Otherwise it makes the generated function's calls, in its order, with its results: the
 * launchers' globals checks and the torch settings check (read from the function's namespace
 * at every call, so the benchmark hooks that swap them there apply to both), MISMATCH where
 * the function returns it, the same exceptions, the same rollback of an interrupted patch.
 * tests/replay/test_graph.py runs every generated-replay test both ways.
 *
 * Misuse from Python raises, never crashes: a step exists only built (tp_new builds it, there is
 * no tp_init to skip, and no tp_clear leaves it half emptied), a malformed program is refused
 * naming the field, and what the program's lists may become after the build (emptied, shrunk)
 * is checked where a call reads them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "replay_support.h"

#define MAX_TENSORS 64
#define MAX_LANES 64 /* lanes of a slot a step writes (replay.graph_step.STEP_MAX_LANES) */
/* A call's scratch objects (values, dynamic values, argument tuples) live on the stack up to this
   many, on the heap beyond (a program of any size runs; the usual one allocates nothing). */
#define STACK_SCRATCH 64

/* The attribute names read: the program's fields at build time, the graph's, its slots' and the
   counters' at call time (interned once). */
#define NAMES(X)                                                                                                       \
    X(fallback) X(namespace) X(check_names) X(modes_check_name) X(mismatch) X(leaf_count) X(tensors) X(leaf)          \
    X(extent) X(owned_memory) X(start) X(size) X(alignments) X(delta) X(aligned) X(staged_inputs)                     \
    X(fixed_addresses) X(dynamic_leaves) X(launch_count) X(argument_sources) X(argument_maker) X(scalars) X(launch)   \
    X(evaluate) X(convert) X(packer) X(arithmetic_errors) X(nodes) X(node) X(buffer) X(set_call) X(set_args)         \
    X(values) X(last) X(input) X(scalar) X(writes) X(offset) X(rollback) X(set_failed) X(current_stream) X(device)    \
    X(last_stream) X(stream_switch) X(graph_exec) X(launch_failed) X(slotted) X(lane_count) X(retarget)              \
    X(use_count_reader) X(support) X(outputs) X(kind) X(number) X(value) X(in_tuple) X(graph) X(counters)            \
    X(staged_copies) X(own) X(own_storage_refs_c) X(storage) X(use_count) X(slot) X(writer) X(freed) X(bound_slot)   \
    X(held) X(lanes) X(address) X(streams) X(views) X(replays) X(patches) X(holder) X(readers)                   \
    X(wait_for_readers) X(written_from) X(own_readers) X(notes_stream) X(stream)

#define DECLARE_NAME(name) static PyObject *s_##name;
NAMES(DECLARE_NAME)
#undef DECLARE_NAME
static PyObject *ONE;

/* One value a node may be given: the pointer of input `input` (writes: pointer writes), or
   the packed bytes of scalar `scalar` (writes: byte copies). */
typedef struct {
    Py_ssize_t last;   /* its index in the shared `last` list */
    Py_ssize_t input;  /* pointer: the leaf; -1 for a scalar */
    Py_ssize_t tensor; /* pointer: the leaf's place among the tensors */
    Py_ssize_t scalar; /* scalar: its number; -1 for a pointer */
    Py_ssize_t writes; /* count */
    char **targets;    /* where each write goes (the node's parameter buffer + offset) */
    long long *deltas; /* pointer writes: the recorded delta */
    Py_ssize_t *sizes; /* scalar writes: bytes */
} value_slot;

typedef struct {
    PyObject *set_call, *set_args; /* the updater's call and its argument tuple */
    Py_ssize_t node;
    Py_buffer view; /* the node's parameter buffer, held while the step lives (view.obj: held) */
    Py_ssize_t count;
    value_slot *slots;
} node_patch;

typedef struct {
    Py_ssize_t launch_argument; /* which argument tuple it is computed from */
    PyObject *evaluate, *convert, *packer;
} scalar_value;

/* replay.step_program.OutputKind */
enum { OUTPUT_SLOT_VIEW = 0, OUTPUT_LEAF = 1, OUTPUT_VALUE = 2, OUTPUT_MADE = 3, OUTPUT_MADE_FROM_LEAF = 4, OUTPUT_SAME_AS = 5 };

typedef struct {
    PyObject_HEAD
    PyObject *program;    /* the StepProgram it was built from (the `program` attribute) */
    PyObject **owned;     /* every object the fields below point at, one reference each */
    Py_ssize_t owned_count, owned_room;
    PyObject *fallback;   /* the generated replay */
    PyObject *namespace_;
    PyObject *check_names; /* tuple of str: each called, result ignored */
    PyObject *modes_name;  /* called, true -> MISMATCH */
    PyObject *mismatch;
    PyObject *graph;       /* the RecordedGraph: replays counted; slot attributes (slotted) */
    int slotted;
    Py_ssize_t leaves;
    Py_ssize_t tensor_count;
    Py_ssize_t tensor_index[MAX_TENSORS];
    unsigned long long extent[MAX_TENSORS];
    Py_ssize_t lane_count;     /* slotted: lanes checked against the tensors */
    Py_ssize_t owned_range_count; /* unslotted: output memory (start, size) pairs */
    unsigned long long *owned_ranges; /* 2 * owned_range_count */
    PyObject **owned_holders;         /* per range: a tensor over its storage (borrowed from `owned`), or NULL */
    Py_ssize_t aligned_count;
    long long *aligned; /* triples: the input's place among the tensors, delta, 1 aligned / 0 not */
    Py_ssize_t staged_count;
    Py_ssize_t *staged; /* the staged inputs' places among the tensors */
    Py_ssize_t fixed_count;
    unsigned long long *fixed; /* the addresses the graph holds fixed, sorted */
    Py_ssize_t dynamic_count;
    Py_ssize_t *dynamic; /* leaves whose .value is read */
    Py_ssize_t argument_count;
    PyObject *argument_maker;      /* a function of the dynamic values making every argument tuple, or NULL */
    Py_ssize_t *argument_sizes;    /* per argument tuple, its length (without a maker) */
    Py_ssize_t **argument_sources; /* per argument, its dynamic value's place in `dynamic`, or -1 (None) */
    Py_ssize_t scalar_count;
    scalar_value *scalars;
    PyObject *arithmetic; /* the exceptions a computation declines the call on */
    Py_ssize_t node_count;
    node_patch *nodes;
    Py_ssize_t value_count; /* slots over all nodes */
    value_slot **flat;      /* each, in node order (the order of `values` in a call) */
    PyObject *last;         /* list */
    PyObject *rollback, *set_failed, *retarget;
    PyObject *current_stream, *device, *last_stream, *stream_switch;
    PyObject *launch, *exec, *launch_failed;
    int own_readers;  /* the graph notes the readers of its own output memory (no slots) */
    int notes_stream; /* the graph keeps the stream of its last launch */
    PyObject *stats;
    Py_ssize_t staged_copies;
    Py_ssize_t output_count;
    int *output_kind;
    PyObject **output_item; /* OUTPUT_VALUE: the value; OUTPUT_MADE(_FROM_LEAF): what makes it */
    Py_ssize_t *output_number; /* SLOT_VIEW: the view's place; LEAF, MADE_FROM_LEAF: the leaf; SAME_AS: the output */
    int in_tuple;
    const replay_support *support;
    PyObject *use_count; /* output_slots' own use-count reader: the slots whose held() this file may answer */
    vectorcallfunc vectorcall;
} ReplayStep;

static int step_traverse(ReplayStep *self, visitproc visit, void *arg) {
    Py_VISIT(self->program);
    for (Py_ssize_t i = 0; i < self->owned_count; i++)
        Py_VISIT(self->owned[i]);
    return 0;
}

static void free_nodes(ReplayStep *self) {
    if (self->nodes == NULL)
        return;
    for (Py_ssize_t n = 0; n < self->node_count; n++) {
        node_patch *node = &self->nodes[n];
        if (node->view.obj != NULL)
            PyBuffer_Release(&node->view);
        for (Py_ssize_t k = 0; node->slots != NULL && k < node->count; k++) {
            PyMem_Free(node->slots[k].targets);
            PyMem_Free(node->slots[k].deltas);
            PyMem_Free(node->slots[k].sizes);
        }
        PyMem_Free(node->slots);
    }
    PyMem_Free(self->nodes);
}

static void step_dealloc(ReplayStep *self) {
    PyObject_GC_UnTrack(self);
    free_nodes(self);
    Py_CLEAR(self->program);
    for (Py_ssize_t i = 0; i < self->owned_count; i++)
        Py_DECREF(self->owned[i]);
    PyMem_Free(self->owned);
    PyMem_Free(self->owned_ranges);
    PyMem_Free(self->owned_holders);
    PyMem_Free(self->aligned);
    PyMem_Free(self->staged);
    PyMem_Free(self->fixed);
    PyMem_Free(self->dynamic);
    if (self->argument_sources != NULL)
        for (Py_ssize_t i = 0; i < self->argument_count; i++)
            PyMem_Free(self->argument_sources[i]);
    PyMem_Free(self->argument_sources);
    PyMem_Free(self->argument_sizes);
    PyMem_Free(self->scalars);
    PyMem_Free(self->flat);
    PyMem_Free(self->output_kind);
    PyMem_Free(self->output_item);
    PyMem_Free(self->output_number);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* --- reading the program by name ----------------------------------------------------------- */

/* Zeroed memory for count items (one more, so that none is a zero-size request); NULL with
   MemoryError set where none is left. */
static void *allocate(Py_ssize_t count, size_t size) {
    void *memory = PyMem_Calloc((size_t)count + 1, size);
    if (memory == NULL)
        PyErr_NoMemory();
    return memory;
}

/* `object`, owned by the step from now on (its reference is the step's): borrowed by the caller. */
static PyObject *keep(ReplayStep *self, PyObject *object) {
    if (self->owned_count == self->owned_room) {
        Py_ssize_t room = self->owned_room ? 2 * self->owned_room : 32;
        PyObject **grown = PyMem_Realloc(self->owned, (size_t)room * sizeof(PyObject *));
        if (grown == NULL) {
            Py_DECREF(object);
            PyErr_NoMemory();
            return NULL;
        }
        self->owned = grown;
        self->owned_room = room;
    }
    self->owned[self->owned_count++] = object;
    return object;
}

static int wrong_type(PyObject *name, const char *where, const char *expected, PyObject *got) {
    PyErr_Format(PyExc_TypeError, "ReplayStep: %s's field '%U' must be %s, not %.100s", where, name, expected,
                 Py_TYPE(got)->tp_name);
    return -1;
}

static int out_of_range(PyObject *name, const char *where, const char *why) {
    PyErr_Format(PyExc_ValueError, "ReplayStep: %s's field '%U' %s", where, name, why);
    return -1;
}

/* owner.name, kept by the step (a borrowed reference); TypeError naming the field where it is
   missing. */
static PyObject *field(ReplayStep *self, PyObject *owner, PyObject *name, const char *where) {
    PyObject *value = PyObject_GetAttr(owner, name);
    if (value == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "ReplayStep: %s has no field '%U'", where, name);
        return NULL;
    }
    return keep(self, value);
}

static PyObject *tuple_field(ReplayStep *self, PyObject *owner, PyObject *name, const char *where) {
    PyObject *value = field(self, owner, name, where);
    if (value != NULL && !PyTuple_Check(value)) {
        wrong_type(name, where, "a tuple", value);
        return NULL;
    }
    return value;
}

static PyObject *callable_field(ReplayStep *self, PyObject *owner, PyObject *name, const char *where, int or_none) {
    PyObject *value = field(self, owner, name, where);
    if (value != NULL && !PyCallable_Check(value) && !(or_none && value == Py_None)) {
        wrong_type(name, where, or_none ? "callable or None" : "callable", value);
        return NULL;
    }
    return value;
}

/* An int that fits 64 bits (unsigned for addresses and sizes); -1 with TypeError or ValueError. */
static int int_value(PyObject *value, PyObject *name, const char *where, long long *out, int non_negative) {
    if (!PyLong_Check(value))
        return wrong_type(name, where, "an int", value);
    int overflow = 0;
    *out = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (*out == -1 && PyErr_Occurred())
        return -1;
    if (overflow || (non_negative && *out < 0))
        return out_of_range(name, where, non_negative ? "must be from 0 to 2**63 - 1" : "must fit 64 bits");
    return 0;
}

static int int_field(ReplayStep *self, PyObject *owner, PyObject *name, const char *where, long long *out,
                     int non_negative) {
    PyObject *value = field(self, owner, name, where);
    return value == NULL ? -1 : int_value(value, name, where, out, non_negative);
}

/* A count or an index (Py_ssize_t, at least 0). */
static int index_field(ReplayStep *self, PyObject *owner, PyObject *name, const char *where, Py_ssize_t *out) {
    long long wide;
    if (int_field(self, owner, name, where, &wide, 1) < 0)
        return -1;
    if (wide > PY_SSIZE_T_MAX)
        return out_of_range(name, where, "is too large");
    *out = (Py_ssize_t)wide;
    return 0;
}

/* An index or None (-1). */
static int optional_index(PyObject *value, PyObject *name, const char *where, Py_ssize_t *out) {
    long long wide = -1;
    if (value != Py_None && int_value(value, name, where, &wide, 1) < 0)
        return -1;
    if (wide > PY_SSIZE_T_MAX)
        return out_of_range(name, where, "is too large");
    *out = (Py_ssize_t)wide;
    return 0;
}

static int address_value(PyObject *value, PyObject *name, const char *where, unsigned long long *out) {
    if (!PyLong_Check(value))
        return wrong_type(name, where, "an int", value);
    *out = PyLong_AsUnsignedLongLong(value);
    if (*out == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return out_of_range(name, where, "must be from 0 to 2**64 - 1");
    }
    return 0;
}

static int bool_field(ReplayStep *self, PyObject *owner, PyObject *name, const char *where, int *out) {
    PyObject *value = field(self, owner, name, where);
    if (value == NULL)
        return -1;
    if (!PyBool_Check(value))
        return wrong_type(name, where, "a bool", value);
    *out = value == Py_True;
    return 0;
}

/* Where leaf `input` is among the tensors read (the place of its pointer); -1 with
   ValueError where it is none of them. */
static Py_ssize_t tensor_place(ReplayStep *self, Py_ssize_t input, PyObject *name, const char *where) {
    for (Py_ssize_t t = 0; t < self->tensor_count; t++)
        if (self->tensor_index[t] == input)
            return t;
    out_of_range(name, where, "is a leaf that is not a tensor read");
    return -1;
}

/* --- building: the call's arguments and the checks on them ------------------------------------ */

static int build_tensors(ReplayStep *self, PyObject *program) {
    PyObject *tensors = tuple_field(self, program, s_tensors, "the program");
    if (tensors == NULL)
        return -1;
    if (PyTuple_GET_SIZE(tensors) > MAX_TENSORS)
        return out_of_range(s_tensors, "the program", "holds more than 64 tensors");
    self->tensor_count = PyTuple_GET_SIZE(tensors);
    for (Py_ssize_t i = 0; i < self->tensor_count; i++) {
        PyObject *tensor = PyTuple_GET_ITEM(tensors, i);
        long long extent;
        if (index_field(self, tensor, s_leaf, "a tensor", &self->tensor_index[i]) < 0 ||
            int_field(self, tensor, s_extent, "a tensor", &extent, 1) < 0)
            return -1;
        self->extent[i] = (unsigned long long)extent;
        if (self->tensor_index[i] >= self->leaves)
            return out_of_range(s_leaf, "a tensor", "is beyond the leaf count");
    }
    return 0;
}

static int build_memory_checks(ReplayStep *self, PyObject *program) {
    PyObject *owned = tuple_field(self, program, s_owned_memory, "the program");
    if (owned == NULL ||
        (self->owned_ranges = allocate(2 * PyTuple_GET_SIZE(owned), sizeof(unsigned long long))) == NULL ||
        (self->owned_holders = allocate(PyTuple_GET_SIZE(owned), sizeof(PyObject *))) == NULL)
        return -1;
    self->owned_range_count = PyTuple_GET_SIZE(owned);
    for (Py_ssize_t i = 0; i < self->owned_range_count; i++) {
        long long start, size;
        PyObject *holder;
        if (int_field(self, PyTuple_GET_ITEM(owned, i), s_start, "a memory range", &start, 1) < 0 ||
            int_field(self, PyTuple_GET_ITEM(owned, i), s_size, "a memory range", &size, 1) < 0 ||
            (holder = field(self, PyTuple_GET_ITEM(owned, i), s_holder, "a memory range")) == NULL)
            return -1;
        self->owned_ranges[2 * i] = (unsigned long long)start;
        self->owned_ranges[2 * i + 1] = (unsigned long long)size;
        self->owned_holders[i] = holder == Py_None ? NULL : holder;
    }
    PyObject *aligned = tuple_field(self, program, s_alignments, "the program");
    if (aligned == NULL || (self->aligned = allocate(3 * PyTuple_GET_SIZE(aligned), sizeof(long long))) == NULL)
        return -1;
    self->aligned_count = PyTuple_GET_SIZE(aligned);
    for (Py_ssize_t i = 0; i < self->aligned_count; i++) {
        PyObject *item = PyTuple_GET_ITEM(aligned, i);
        Py_ssize_t leaf, place;
        int want;
        if (index_field(self, item, s_leaf, "an alignment", &leaf) < 0 ||
            int_field(self, item, s_delta, "an alignment", &self->aligned[3 * i + 1], 0) < 0 ||
            bool_field(self, item, s_aligned, "an alignment", &want) < 0 ||
            (place = tensor_place(self, leaf, s_leaf, "an alignment")) < 0)
            return -1;
        self->aligned[3 * i] = place;
        self->aligned[3 * i + 2] = want;
    }
    return 0;
}

static int build_staged_check(ReplayStep *self, PyObject *program) {
    PyObject *staged = tuple_field(self, program, s_staged_inputs, "the program");
    PyObject *fixed = staged == NULL ? NULL : tuple_field(self, program, s_fixed_addresses, "the program");
    if (fixed == NULL)
        return -1;
    if (PyTuple_GET_SIZE(staged) > MAX_TENSORS)
        return out_of_range(s_staged_inputs, "the program", "holds more than 64 inputs");
    if ((self->staged = allocate(PyTuple_GET_SIZE(staged), sizeof(Py_ssize_t))) == NULL ||
        (self->fixed = allocate(PyTuple_GET_SIZE(fixed), sizeof(unsigned long long))) == NULL)
        return -1;
    self->staged_count = PyTuple_GET_SIZE(staged);
    for (Py_ssize_t i = 0; i < self->staged_count; i++) {
        Py_ssize_t leaf;
        if (optional_index(PyTuple_GET_ITEM(staged, i), s_staged_inputs, "the program", &leaf) < 0 ||
            (self->staged[i] = tensor_place(self, leaf, s_staged_inputs, "the program")) < 0)
            return -1;
    }
    self->fixed_count = PyTuple_GET_SIZE(fixed);
    for (Py_ssize_t i = 0; i < self->fixed_count; i++) {
        if (address_value(PyTuple_GET_ITEM(fixed, i), s_fixed_addresses, "the program", &self->fixed[i]) < 0)
            return -1;
        if (i > 0 && self->fixed[i] <= self->fixed[i - 1])
            return out_of_range(s_fixed_addresses, "the program", "must be sorted and unique");
    }
    return 0;
}

/* --- building: the values computed from dynamic scalars ------------------------------------- */

static int build_dynamic(ReplayStep *self, PyObject *program) {
    PyObject *dynamic = tuple_field(self, program, s_dynamic_leaves, "the program");
    if (dynamic == NULL || (self->dynamic = allocate(PyTuple_GET_SIZE(dynamic), sizeof(Py_ssize_t))) == NULL)
        return -1;
    self->dynamic_count = PyTuple_GET_SIZE(dynamic);
    for (Py_ssize_t i = 0; i < self->dynamic_count; i++) {
        if (optional_index(PyTuple_GET_ITEM(dynamic, i), s_dynamic_leaves, "the program", &self->dynamic[i]) < 0)
            return -1;
        if (self->dynamic[i] < 0 || self->dynamic[i] >= self->leaves)
            return out_of_range(s_dynamic_leaves, "the program", "holds a leaf beyond the leaf count");
    }
    return 0;
}

/* One launch's argument sources: each kept as its dynamic leaf's place in `dynamic`, or -1. */
static int build_argument_sources(ReplayStep *self, Py_ssize_t a, PyObject *sources) {
    if (!PyTuple_Check(sources))
        return wrong_type(s_argument_sources, "the program", "a tuple of tuples", sources);
    Py_ssize_t n = PyTuple_GET_SIZE(sources);
    if ((self->argument_sources[a] = allocate(n, sizeof(Py_ssize_t))) == NULL)
        return -1;
    self->argument_sizes[a] = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t source, place = -1;
        if (optional_index(PyTuple_GET_ITEM(sources, i), s_argument_sources, "the program", &source) < 0)
            return -1;
        for (Py_ssize_t d = 0; source >= 0 && d < self->dynamic_count; d++)
            if (self->dynamic[d] == source)
                place = d;
        if (source >= 0 && place < 0)
            return out_of_range(s_argument_sources, "the program", "holds a leaf that is not a dynamic leaf read");
        self->argument_sources[a][i] = place;
    }
    return 0;
}

static int build_arguments(ReplayStep *self, PyObject *program) {
    Py_ssize_t count;
    PyObject *maker = callable_field(self, program, s_argument_maker, "the program", 1);
    PyObject *sources = maker == NULL ? NULL : field(self, program, s_argument_sources, "the program");
    if (sources == NULL || index_field(self, program, s_launch_count, "the program", &count) < 0)
        return -1;
    if ((maker == Py_None) == (sources == Py_None))
        return out_of_range(s_argument_maker, "the program",
                            "must be None exactly where 'argument_sources' is not");
    if (sources != Py_None && (!PyTuple_Check(sources) || PyTuple_GET_SIZE(sources) != count))
        return wrong_type(s_argument_sources, "the program", "a tuple of launch_count tuples", sources);
    if ((self->argument_sizes = allocate(count, sizeof(Py_ssize_t))) == NULL ||
        (self->argument_sources = allocate(count, sizeof(Py_ssize_t *))) == NULL)
        return -1;
    self->argument_count = count;
    self->argument_maker = maker == Py_None ? NULL : maker;
    for (Py_ssize_t a = 0; sources != Py_None && a < count; a++)
        if (build_argument_sources(self, a, PyTuple_GET_ITEM(sources, a)) < 0)
            return -1;
    return 0;
}

static int build_scalars(ReplayStep *self, PyObject *program) {
    PyObject *scalars = tuple_field(self, program, s_scalars, "the program");
    if (scalars == NULL || (self->scalars = allocate(PyTuple_GET_SIZE(scalars), sizeof(scalar_value))) == NULL)
        return -1;
    self->scalar_count = PyTuple_GET_SIZE(scalars);
    for (Py_ssize_t i = 0; i < self->scalar_count; i++) {
        PyObject *item = PyTuple_GET_ITEM(scalars, i);
        scalar_value *scalar = &self->scalars[i];
        if (index_field(self, item, s_launch, "a scalar", &scalar->launch_argument) < 0 ||
            (scalar->evaluate = callable_field(self, item, s_evaluate, "a scalar", 0)) == NULL ||
            (scalar->convert = callable_field(self, item, s_convert, "a scalar", 1)) == NULL ||
            (scalar->packer = callable_field(self, item, s_packer, "a scalar", 0)) == NULL)
            return -1;
        if (scalar->convert == Py_None)
            scalar->convert = NULL;
        if (scalar->launch_argument >= self->argument_count)
            return out_of_range(s_launch, "a scalar", "is beyond the launch count");
    }
    PyObject *errors = tuple_field(self, program, s_arithmetic_errors, "the program");
    if (errors == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(errors); i++)
        if (!PyExceptionClass_Check(PyTuple_GET_ITEM(errors, i)))
            return wrong_type(s_arithmetic_errors, "the program", "a tuple of exception classes",
                              PyTuple_GET_ITEM(errors, i));
    self->arithmetic = errors;
    return 0;
}

/* --- building: the nodes -------------------------------------------------------------------- */

/* A value's writes into its node's buffer: each inside it (a pointer's 8 bytes, a scalar's size). */
static int build_writes(ReplayStep *self, node_patch *node, value_slot *value, PyObject *writes) {
    Py_ssize_t count = PyTuple_GET_SIZE(writes);
    if ((value->targets = allocate(count, sizeof(char *))) == NULL ||
        (value->deltas = allocate(count, sizeof(long long))) == NULL ||
        (value->sizes = allocate(count, sizeof(Py_ssize_t))) == NULL)
        return -1;
    for (Py_ssize_t w = 0; w < count; w++) {
        PyObject *write = PyTuple_GET_ITEM(writes, w);
        Py_ssize_t offset, size = 8;
        if (index_field(self, write, s_offset, "a write", &offset) < 0)
            return -1;
        if (value->input >= 0 && int_field(self, write, s_delta, "a pointer write", &value->deltas[w], 0) < 0)
            return -1;
        if (value->input < 0 && index_field(self, write, s_size, "a scalar write", &size) < 0)
            return -1;
        if (offset > node->view.len || size > node->view.len - offset)
            return out_of_range(s_offset, "a write", "lies outside its node's buffer");
        value->targets[w] = (char *)node->view.buf + offset;
        value->sizes[w] = size;
        value->writes = w + 1;
    }
    return 0;
}

static int build_value(ReplayStep *self, node_patch *node, value_slot *value, PyObject *item) {
    PyObject *input = field(self, item, s_input, "a node value");
    PyObject *scalar = input == NULL ? NULL : field(self, item, s_scalar, "a node value");
    PyObject *writes = scalar == NULL ? NULL : tuple_field(self, item, s_writes, "a node value");
    if (writes == NULL || index_field(self, item, s_last, "a node value", &value->last) < 0 ||
        optional_index(input, s_input, "a node value", &value->input) < 0 ||
        optional_index(scalar, s_scalar, "a node value", &value->scalar) < 0)
        return -1;
    if ((value->input < 0) == (value->scalar < 0))
        return out_of_range(s_input, "a node value", "must be None exactly where 'scalar' is not");
    if (value->scalar >= self->scalar_count)
        return out_of_range(s_scalar, "a node value", "is beyond the scalars");
    if (value->input >= 0 && (value->tensor = tensor_place(self, value->input, s_input, "a node value")) < 0)
        return -1;
    if (value->last >= PyList_GET_SIZE(self->last))
        return out_of_range(s_last, "a node value", "is beyond the program's last list");
    return build_writes(self, node, value, writes);
}

static int build_node(ReplayStep *self, node_patch *node, PyObject *item) {
    PyObject *buffer = field(self, item, s_buffer, "a node");
    PyObject *values = buffer == NULL ? NULL : tuple_field(self, item, s_values, "a node");
    if (values == NULL || index_field(self, item, s_node, "a node", &node->node) < 0 ||
        (node->set_call = callable_field(self, item, s_set_call, "a node", 0)) == NULL ||
        (node->set_args = tuple_field(self, item, s_set_args, "a node")) == NULL)
        return -1;
    if (PyObject_GetBuffer(buffer, &node->view, PyBUF_WRITABLE) < 0) {
        PyErr_Clear();
        node->view.obj = NULL;
        return wrong_type(s_buffer, "a node", "a writable buffer", buffer);
    }
    if ((node->slots = allocate(PyTuple_GET_SIZE(values), sizeof(value_slot))) == NULL)
        return -1;
    node->count = PyTuple_GET_SIZE(values); /* (set once its slots exist: the deallocator reads them) */
    for (Py_ssize_t k = 0; k < node->count; k++)
        if (build_value(self, node, &node->slots[k], PyTuple_GET_ITEM(values, k)) < 0)
            return -1;
    self->value_count += node->count;
    return 0;
}

static int build_nodes(ReplayStep *self, PyObject *program) {
    self->last = field(self, program, s_last, "the program");
    if (self->last == NULL)
        return -1;
    if (!PyList_CheckExact(self->last))
        return wrong_type(s_last, "the program", "a list", self->last);
    PyObject *nodes = tuple_field(self, program, s_nodes, "the program");
    if (nodes == NULL || (self->nodes = allocate(PyTuple_GET_SIZE(nodes), sizeof(node_patch))) == NULL)
        return -1;
    for (Py_ssize_t n = 0; n < PyTuple_GET_SIZE(nodes); n++) {
        self->node_count = n + 1; /* the deallocator releases what this node holds so far */
        if (build_node(self, &self->nodes[n], PyTuple_GET_ITEM(nodes, n)) < 0)
            return -1;
    }
    if ((self->flat = allocate(self->value_count, sizeof(value_slot *))) == NULL)
        return -1;
    for (Py_ssize_t n = 0, at = 0; n < self->node_count; n++)
        for (Py_ssize_t k = 0; k < self->nodes[n].count; k++)
            self->flat[at++] = &self->nodes[n].slots[k];
    return 0;
}

/* --- building: the outputs, the launch, the rest ------------------------------------------- */

/* One output's kind, checked against its number and value. */
static int build_output(ReplayStep *self, Py_ssize_t i, Py_ssize_t kind) {
    Py_ssize_t number = self->output_number[i];
    if (kind > OUTPUT_SAME_AS || (kind == OUTPUT_SLOT_VIEW && !self->slotted))
        return out_of_range(s_kind, "an output", "is a slot view (of a slotted graph), a leaf, a value, made or the same");
    if ((kind == OUTPUT_LEAF || kind == OUTPUT_MADE_FROM_LEAF) && number >= self->leaves)
        return out_of_range(s_number, "an output", "is beyond the leaf count");
    if (kind == OUTPUT_SAME_AS && number >= i)
        return out_of_range(s_number, "an output", "is not an earlier output");
    if ((kind == OUTPUT_MADE || kind == OUTPUT_MADE_FROM_LEAF) && !PyCallable_Check(self->output_item[i]))
        return wrong_type(s_value, "an output made per call", "callable", self->output_item[i]);
    self->output_kind[i] = (int)kind;
    return 0;
}

static int build_outputs(ReplayStep *self, PyObject *program) {
    PyObject *outputs = tuple_field(self, program, s_outputs, "the program");
    Py_ssize_t count = outputs == NULL ? 0 : PyTuple_GET_SIZE(outputs);
    if (outputs == NULL || (self->output_kind = allocate(count, sizeof(int))) == NULL ||
        (self->output_item = allocate(count, sizeof(PyObject *))) == NULL ||
        (self->output_number = allocate(count, sizeof(Py_ssize_t))) == NULL)
        return -1;
    self->output_count = count;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyTuple_GET_ITEM(outputs, i);
        Py_ssize_t kind;
        if (index_field(self, item, s_kind, "an output", &kind) < 0 ||
            index_field(self, item, s_number, "an output", &self->output_number[i]) < 0 ||
            (self->output_item[i] = field(self, item, s_value, "an output")) == NULL)
            return -1;
        if (build_output(self, i, kind) < 0)
            return -1;
    }
    if (bool_field(self, program, s_in_tuple, "the program", &self->in_tuple) < 0)
        return -1;
    if (!self->in_tuple && self->output_count != 1)
        return out_of_range(s_in_tuple, "the program", "is False with other than one output");
    return 0;
}

static int build_launch(ReplayStep *self, PyObject *program) {
    const char *p = "the program";
    if ((self->rollback = callable_field(self, program, s_rollback, p, 0)) == NULL ||
        (self->set_failed = callable_field(self, program, s_set_failed, p, 0)) == NULL ||
        (self->current_stream = callable_field(self, program, s_current_stream, p, 0)) == NULL ||
        (self->stream_switch = callable_field(self, program, s_stream_switch, p, 0)) == NULL ||
        (self->launch = callable_field(self, program, s_launch, p, 0)) == NULL ||
        (self->launch_failed = callable_field(self, program, s_launch_failed, p, 0)) == NULL ||
        (self->exec = field(self, program, s_graph_exec, p)) == NULL ||
        (self->device = field(self, program, s_device, p)) == NULL ||
        (self->last_stream = field(self, program, s_last_stream, p)) == NULL)
        return -1;
    if (!PyLong_Check(self->device))
        return wrong_type(s_device, p, "an int", self->device);
    if (!PyList_CheckExact(self->last_stream) || PyList_GET_SIZE(self->last_stream) < 1)
        return wrong_type(s_last_stream, p, "a list of one item", self->last_stream);
    return 0;
}

static int build_slots_and_counts(ReplayStep *self, PyObject *program) {
    const char *p = "the program";
    if (bool_field(self, program, s_slotted, p, &self->slotted) < 0 ||
        index_field(self, program, s_lane_count, p, &self->lane_count) < 0 ||
        bool_field(self, program, s_own_readers, p, &self->own_readers) < 0 ||
        bool_field(self, program, s_notes_stream, p, &self->notes_stream) < 0 ||
        (self->retarget = callable_field(self, program, s_retarget, p, !self->slotted)) == NULL ||
        (self->use_count = field(self, program, s_use_count_reader, p)) == NULL ||
        (self->graph = field(self, program, s_graph, p)) == NULL ||
        (self->stats = field(self, program, s_counters, p)) == NULL ||
        index_field(self, program, s_staged_copies, p, &self->staged_copies) < 0)
        return -1;
    if (self->lane_count > MAX_LANES)
        return out_of_range(s_lane_count, p, "is more than 64");
    PyObject *support = field(self, program, s_support, p);
    if (support == NULL || (self->support = replay_support_from(support, "ReplayStep")) == NULL)
        return -1;
    return 0;
}

static int build_fallback(ReplayStep *self, PyObject *program) {
    const char *p = "the program";
    if ((self->fallback = callable_field(self, program, s_fallback, p, 0)) == NULL ||
        (self->namespace_ = field(self, program, s_namespace, p)) == NULL ||
        (self->check_names = tuple_field(self, program, s_check_names, p)) == NULL ||
        (self->modes_name = field(self, program, s_modes_check_name, p)) == NULL ||
        (self->mismatch = field(self, program, s_mismatch, p)) == NULL ||
        index_field(self, program, s_leaf_count, p, &self->leaves) < 0)
        return -1;
    if (!PyDict_Check(self->namespace_))
        return wrong_type(s_namespace, p, "a dict", self->namespace_);
    if (!PyUnicode_Check(self->modes_name))
        return wrong_type(s_modes_check_name, p, "a str", self->modes_name);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->check_names); i++)
        if (!PyUnicode_Check(PyTuple_GET_ITEM(self->check_names, i)))
            return wrong_type(s_check_names, p, "a tuple of str", PyTuple_GET_ITEM(self->check_names, i));
    return 0;
}

/* Every field, in an order where each part finds what it reads already built. */
static int build(ReplayStep *self, PyObject *program) {
    if (build_fallback(self, program) < 0 || build_slots_and_counts(self, program) < 0 ||
        build_tensors(self, program) < 0 || build_memory_checks(self, program) < 0 ||
        build_staged_check(self, program) < 0 || build_dynamic(self, program) < 0 ||
        build_arguments(self, program) < 0 || build_scalars(self, program) < 0 || build_nodes(self, program) < 0 ||
        build_outputs(self, program) < 0 || build_launch(self, program) < 0)
        return -1;
    return 0;
}

/* --- one call: small steps ---------------------------------------------------------------- */

/* obj.name += 1 */
static int bump(PyObject *owner, PyObject *name, PyObject *by) {
    PyObject *value = PyObject_GetAttr(owner, name);
    if (value == NULL)
        return -1;
    PyObject *sum = PyNumber_InPlaceAdd(value, by);
    Py_DECREF(value);
    if (sum == NULL)
        return -1;
    int failed = PyObject_SetAttr(owner, name, sum);
    Py_DECREF(sum);
    return failed;
}

/* Whether a status tuple's first item says the call failed (`if _r[0]:`); -1 on error. */
static int failed_status(PyObject *status, PyObject **first) {
    *first = PySequence_GetItem(status, 0);
    if (*first == NULL)
        return -1;
    int truth = PyObject_IsTrue(*first);
    if (truth <= 0)
        Py_CLEAR(*first);
    return truth;
}

/* What one call works with: the pointers read, the slot chosen and where its lanes are, the
   scratch objects. */
typedef struct {
    uint64_t pointers[MAX_TENSORS];
    uint64_t storage_base[MAX_TENSORS], storage_end[MAX_TENSORS]; /* per staged input */
    PyObject *slot; /* the output slot written, a new reference (slotted graphs), else NULL */
    uint64_t lane_start[MAX_LANES], lane_size[MAX_LANES]; /* the slot's lanes this graph writes */
    PyObject **values, **dynamic, **arguments;
    char *changed;
    PyObject **heap; /* where the scratch did not fit the stack arrays below */
    PyObject *stack[STACK_SCRATCH];
    char stack_changed[STACK_SCRATCH];
} call_state;

/* A lane's storage object's reference count, as read with one reference of the reader's own
   (what `own_storage_refs_c` holds of a lane with nothing else referring to it). */
static Py_ssize_t references(PyObject *storage) { return Py_REFCNT(storage); }

static long long int_attribute(PyObject *owner, PyObject *name, int *failed) {
    PyObject *value = PyObject_GetAttr(owner, name);
    if (value == NULL) {
        *failed = 1;
        return -1;
    }
    long long read = PyLong_AsLongLong(value);
    Py_DECREF(value);
    if (read == -1 && PyErr_Occurred())
        *failed = 1;
    return read;
}

/* One lane of Slot.held(): 1 held, 0 not, -1 error, -2 where this file cannot answer. */
static int lane_held(ReplayStep *self, PyObject *lane) {
    PyObject *storage = PyObject_GetAttr(lane, s_storage);
    if (storage == NULL)
        return -1;
    int answer = 0;
    if (storage != Py_None) {
        int failed = 0;
        long long own = int_attribute(lane, s_own, &failed);
        long long baseline = failed ? -1 : int_attribute(lane, s_own_storage_refs_c, &failed);
        int64_t uses = self->support->storage_use_count(storage);
        if (failed)
            answer = -1;
        else if (baseline < 0 || uses < 0)
            answer = -2;
        else if (uses > own || references(storage) > baseline)
            answer = 1;
    }
    Py_DECREF(storage);
    return answer;
}

/* Slot.held() (replay.output_slots) answered in C: 1 held, 0 not, -1 error, -2 where this
   file cannot answer it (a use-count reader of the tests', a lane without its C baseline, not
   a torch storage): the method answers then. Per lane, as Lane.held: its storage's use count
   above what the lane holds itself, or its storage object referred to by more than the lane. */
static int slot_held(ReplayStep *self, PyObject *slot) {
    PyObject *reader = PyObject_GetAttr(slot, s_use_count);
    if (reader == NULL)
        return -1;
    int ours = reader == self->use_count;
    Py_DECREF(reader);
    if (!ours)
        return -2;
    PyObject *lanes = PyObject_GetAttr(slot, s_lanes);
    if (lanes == NULL)
        return -1;
    PyObject *fast = PySequence_Fast(lanes, "slot lanes");
    Py_DECREF(lanes);
    if (fast == NULL)
        return -1;
    int answer = 0;
    for (Py_ssize_t l = 0; l < PySequence_Fast_GET_SIZE(fast) && answer == 0; l++) {
        PyObject *lane = Py_NewRef(PySequence_Fast_GET_ITEM(fast, l)); /* the list may change meanwhile */
        answer = lane_held(self, lane);
        Py_DECREF(lane);
    }
    Py_DECREF(fast);
    return answer;
}

/* Whether slot.freed is true: 1, 0, or -1 on error. */
static int freed(PyObject *slot) {
    PyObject *value = PyObject_GetAttr(slot, s_freed);
    if (value == NULL)
        return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* 1: the bound slot is free to write (not freed, nobody holds outputs in it), 0: not, -1 error. */
static int usable(ReplayStep *self, PyObject *slot) {
    if (slot == Py_None)
        return 0;
    int truth = freed(slot);
    if (truth != 0)
        return truth < 0 ? -1 : 0;
    truth = slot_held(self, slot);
    if (truth == -2) { /* the method answers what this file cannot */
        PyObject *held = PyObject_CallMethodNoArgs(slot, s_held);
        if (held == NULL)
            return -1;
        truth = PyObject_IsTrue(held);
        Py_DECREF(held);
    }
    return truth < 0 ? -1 : !truth;
}

/* 1 where `slot` is the one the graph wrote last and nobody else wrote since, 0 not, -1 error. */
static int still_mine(ReplayStep *self, PyObject *slot) {
    if (slot == Py_None)
        return 0;
    PyObject *writer = PyObject_GetAttr(slot, s_writer);
    if (writer == NULL)
        return -1;
    int mine = writer == self->graph;
    Py_DECREF(writer);
    if (!mine)
        return 0;
    int truth = freed(slot);
    return truth < 0 ? -1 : !truth;
}

/* An int attribute as an address or a size, into *out: 0, or -1 with the error set. */
static int address_attribute(PyObject *owner, PyObject *name, uint64_t *out) {
    PyObject *value = PyObject_GetAttr(owner, name);
    if (value == NULL)
        return -1;
    unsigned long long read = PyLong_AsUnsignedLongLong(value);
    Py_DECREF(value);
    if (read == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = read;
    return 0;
}

/* One lane where the graph's copies write: its address and size into the call, and whether its
   storage still spans them (a caller's resize_ moves it): 1, 0 moved (or not read), -1 error. */
static int lane_in_place(ReplayStep *self, PyObject *lane, call_state *call, Py_ssize_t l) {
    PyObject *buffer = PyObject_GetAttr(lane, s_buffer);
    if (buffer == NULL)
        return -1;
    uint64_t base = 0, nbytes = 0;
    int read = buffer != Py_None && self->support->read_storage_span(buffer, &base, &nbytes);
    Py_DECREF(buffer);
    if (address_attribute(lane, s_address, &call->lane_start[l]) < 0 ||
        address_attribute(lane, s_size, &call->lane_size[l]) < 0)
        return -1;
    return read && base == call->lane_start[l] && nbytes == call->lane_size[l];
}

/* Every lane of `slot` this graph writes, as lane_in_place: 1, 0 (choose decides), -1 error. */
static int lanes_in_place(ReplayStep *self, PyObject *slot, call_state *call) {
    PyObject *lanes = PyObject_GetAttr(slot, s_lanes);
    if (lanes == NULL)
        return -1;
    int answer = 1;
    for (Py_ssize_t l = 0; l < self->lane_count && answer == 1; l++) {
        PyObject *lane = PySequence_GetItem(lanes, l);
        answer = lane == NULL ? -1 : lane_in_place(self, lane, call, l);
        Py_XDECREF(lane);
    }
    Py_DECREF(lanes);
    return answer;
}

/* The slot decided without OutputSlots.choose, its lanes where they were (a new reference),
   or NULL with *decided 0 where choose must decide (no error), -1 on error. */
static PyObject *decided_slot(ReplayStep *self, int *decided) {
    *decided = -1;
    PyObject *slot = PyObject_GetAttr(self->graph, s_slot);
    if (slot == NULL)
        return NULL;
    int mine = still_mine(self, slot);
    if (mine == 0) {
        Py_SETREF(slot, PyObject_GetAttr(self->graph, s_bound_slot));
        mine = slot == NULL ? -1 : usable(self, slot);
    }
    if (mine <= 0) {
        Py_XDECREF(slot);
        *decided = mine;
        return NULL;
    }
    *decided = 1;
    return slot;
}

/* The slot this replay writes when it is decided without OutputSlots.choose (a new reference),
   its lanes' places in `call`; Py_None (borrowed, not to be released) where choose must decide
   (no slot of its own or bound free to write, or a lane a caller moved), NULL on error. */
static PyObject *own_slot(ReplayStep *self, call_state *call) {
    int decided;
    PyObject *slot = decided_slot(self, &decided);
    if (slot == NULL)
        return decided < 0 ? NULL : Py_None;
    int in_place = lanes_in_place(self, slot, call);
    if (in_place > 0)
        return slot;
    Py_DECREF(slot);
    return in_place < 0 ? NULL : Py_None;
}

/* Each nonempty tensor against [lo, hi): 1 if one overlaps. */
static int overlaps(ReplayStep *self, const uint64_t *pointers, unsigned long long lo, unsigned long long hi) {
    for (Py_ssize_t t = 0; t < self->tensor_count; t++) {
        unsigned long long extent = self->extent[t];
        if (extent && pointers[t] < hi && lo < pointers[t] + extent)
            return 1;
    }
    return 0;
}

/* 1 where two nonempty tensors overlap (the key says every argument lies apart). */
static int any_overlap(ReplayStep *self, const uint64_t *pointers) {
    for (Py_ssize_t i = 0; i < self->tensor_count; i++) {
        if (!self->extent[i])
            continue;
        for (Py_ssize_t j = i + 1; j < self->tensor_count; j++) {
            if (!self->extent[j])
                continue;
            if (pointers[i] < pointers[j] + self->extent[j] && pointers[j] < pointers[i] + self->extent[i])
                return 1;
        }
    }
    return 0;
}

/* Whether a fixed address lies in [lo, hi): the first one at or after lo, by bisection. */
static int holds_fixed(ReplayStep *self, uint64_t lo, uint64_t hi) {
    Py_ssize_t first = 0, last = self->fixed_count;
    while (first < last) {
        Py_ssize_t middle = first + (last - first) / 2;
        if (self->fixed[middle] < lo)
            first = middle + 1;
        else
            last = middle;
    }
    return first < self->fixed_count && self->fixed[first] < hi;
}

/* 1 where each of the graph's own output buffers is where its copies write (a caller's resize_
   moves it: the generated function then spoils the graph), 0 where one is not, or not read. */
static int own_memory_in_place(ReplayStep *self) {
    for (Py_ssize_t i = 0; i < self->owned_range_count; i++) {
        uint64_t base = 0, nbytes = 0;
        if (self->owned_holders[i] != NULL &&
            (!self->support->read_storage_span(self->owned_holders[i], &base, &nbytes) ||
             base != self->owned_ranges[2 * i] || nbytes != self->owned_ranges[2 * i + 1]))
            return 0;
    }
    return 1;
}

/* 1 where this file reads every pointer and storage span and every rebound pointer's write
   fits '<Q' (the function raises struct.error there), and the own output memory is in place:
   else the generated function decides. */
static int read_arguments(ReplayStep *self, PyObject *const *leaves, call_state *call) {
    uint64_t *pointers = call->pointers;
    if (!own_memory_in_place(self))
        return 0;
    for (Py_ssize_t t = 0; t < self->tensor_count; t++)
        if (!self->support->read_data_pointer(leaves[self->tensor_index[t]], &pointers[t]) ||
            pointers[t] > UINT64_MAX - self->extent[t]) /* ranges past 2**64: Python's ints compare them */
            return 0;
    for (Py_ssize_t i = 0; i < self->staged_count; i++) {
        uint64_t nbytes;
        PyObject *leaf = leaves[self->tensor_index[self->staged[i]]];
        if (!self->support->read_storage_span(leaf, &call->storage_base[i], &nbytes) ||
            call->storage_base[i] > UINT64_MAX - nbytes)
            return 0;
        call->storage_end[i] = call->storage_base[i] + nbytes;
    }
    for (Py_ssize_t v = 0; v < self->value_count; v++) {
        value_slot *value = self->flat[v];
        if (value->input < 0)
            continue;
        uint64_t pointer = pointers[value->tensor];
        for (Py_ssize_t w = 0; w < value->writes; w++) {
            long long delta = value->deltas[w];
            if ((delta < 0 && pointer < (uint64_t)(-(delta + 1)) + 1) ||
                (delta > 0 && pointer > UINT64_MAX - (uint64_t)delta))
                return 0;
        }
    }
    return 1;
}

/* The call's scratch arrays, zeroed: on the stack where they fit, else on the heap. */
static int scratch_begin(ReplayStep *self, call_state *call) {
    Py_ssize_t objects = self->value_count + self->dynamic_count + self->argument_count;
    call->heap = NULL;
    PyObject **room = call->stack;
    call->changed = call->stack_changed;
    if (objects > STACK_SCRATCH) {
        call->heap = allocate(objects + self->value_count, sizeof(PyObject *));
        if (call->heap == NULL)
            return -1;
        room = call->heap;
        call->changed = (char *)(call->heap + objects);
    } else {
        memset(room, 0, (size_t)objects * sizeof(PyObject *));
    }
    call->values = room;
    call->dynamic = room + self->value_count;
    call->arguments = call->dynamic + self->dynamic_count;
    return 0;
}

static void scratch_end(ReplayStep *self, call_state *call) {
    for (Py_ssize_t i = 0; i < self->value_count + self->dynamic_count + self->argument_count; i++)
        Py_XDECREF(call->values[i]);
    PyMem_Free(call->heap);
    Py_XDECREF(call->slot);
}

/* The launchers' globals checks and the torch settings check, as the namespace has them now:
   0 to go on, 1 for MISMATCH, -1 on error. */
static int check_settings(ReplayStep *self) {
    Py_ssize_t count = PyTuple_GET_SIZE(self->check_names);
    for (Py_ssize_t i = 0; i <= count; i++) {
        PyObject *name = i < count ? PyTuple_GET_ITEM(self->check_names, i) : self->modes_name;
        PyObject *check = PyDict_GetItemWithError(self->namespace_, name);
        if (check == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, name);
            return -1;
        }
        Py_INCREF(check); /* a check may change the namespace */
        PyObject *answer = PyObject_CallNoArgs(check);
        Py_DECREF(check);
        if (answer == NULL)
            return -1;
        int truth = i < count ? 0 : PyObject_IsTrue(answer); /* the globals checks' answers are ignored */
        Py_DECREF(answer);
        if (truth != 0)
            return truth;
    }
    return 0;
}

/* No argument may lie in the output slot this replay writes (its lanes as own_slot read them):
   0 to go on, 1 MISMATCH. */
static int check_lanes(ReplayStep *self, call_state *call) {
    for (Py_ssize_t l = 0; l < self->lane_count; l++)
        if (overlaps(self, call->pointers, call->lane_start[l], call->lane_start[l] + call->lane_size[l]))
            return 1;
    return 0;
}

/* The generated function's checks on the arguments' memory, in its order: 0, 1 MISMATCH, -1. */
static int check_memory(ReplayStep *self, call_state *call) {
    const uint64_t *pointers = call->pointers;
    if (any_overlap(self, pointers))
        return 1;
    if (call->slot != NULL) {
        int answer = check_lanes(self, call);
        if (answer != 0)
            return answer;
    }
    for (Py_ssize_t i = 0; i < self->owned_range_count; i++) {
        unsigned long long start = self->owned_ranges[2 * i];
        if (overlaps(self, pointers, start, start + self->owned_ranges[2 * i + 1]))
            return 1;
    }
    for (Py_ssize_t i = 0; i < self->staged_count; i++) /* the generated function's staged storage checks */
        if (holds_fixed(self, call->storage_base[i], call->storage_end[i]))
            return 1;
    for (Py_ssize_t i = 0; i < self->aligned_count; i++) {
        long long place = self->aligned[3 * i], delta = self->aligned[3 * i + 1], want = self->aligned[3 * i + 2];
        if ((((pointers[place] + (uint64_t)delta) & 15) == 0) != (int)want)
            return 1;
    }
    return 0;
}

/* An exception raised computing a value: the arithmetic errors decline the call (1), others
   are raised (-1). */
static int declined_on(ReplayStep *self) {
    if (!PyErr_ExceptionMatches(self->arithmetic))
        return -1;
    PyErr_Clear();
    return 1;
}

/* The dynamic values and each launch's argument tuple: 0, 1 MISMATCH, -1 error. */
static int compute_arguments(ReplayStep *self, PyObject *const *leaves, call_state *call) {
    PyObject **dynamic = call->dynamic, **arguments = call->arguments;
    for (Py_ssize_t i = 0; i < self->dynamic_count; i++) /* outside the computation's try, as generated */
        if ((dynamic[i] = PyObject_GetAttr(leaves[self->dynamic[i]], s_value)) == NULL)
            return -1;
    if (self->argument_maker != NULL) { /* inside the try: an arithmetic error declines the call */
        PyObject *made = PyObject_Vectorcall(self->argument_maker, dynamic, self->dynamic_count, NULL);
        if (made == NULL)
            return declined_on(self);
        if (!PyTuple_CheckExact(made) || PyTuple_GET_SIZE(made) != self->argument_count) {
            Py_DECREF(made);
            PyErr_SetString(PyExc_TypeError, "ReplayStep: the argument maker returned another shape");
            return -1;
        }
        for (Py_ssize_t a = 0; a < self->argument_count; a++)
            arguments[a] = Py_NewRef(PyTuple_GET_ITEM(made, a));
        Py_DECREF(made);
        return 0;
    }
    for (Py_ssize_t a = 0; a < self->argument_count; a++) {
        Py_ssize_t n = self->argument_sizes[a];
        if ((arguments[a] = PyTuple_New(n)) == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t place = self->argument_sources[a][i];
            PyTuple_SET_ITEM(arguments[a], i, Py_NewRef(place >= 0 ? dynamic[place] : Py_None));
        }
    }
    return 0;
}

/* The steps before the patch that can still decline the call: the values. 0 to go on, 1 for
   MISMATCH, -1 on error. Fills the call's values (new references). */
static int compute(ReplayStep *self, PyObject *const *leaves, call_state *call) {
    int declined = compute_arguments(self, leaves, call);
    if (declined != 0)
        return declined;
    PyObject **values = call->values;
    for (Py_ssize_t v = 0; v < self->value_count; v++)
        if (self->flat[v]->input >= 0 &&
            (values[v] = PyLong_FromUnsignedLongLong(call->pointers[self->flat[v]->tensor])) == NULL)
            return -1;
    for (Py_ssize_t s = 0; s < self->scalar_count; s++) { /* inside the try: an arithmetic error declines */
        scalar_value *scalar = &self->scalars[s];
        PyObject *computed = PyObject_CallOneArg(scalar->evaluate, call->arguments[scalar->launch_argument]);
        if (computed != NULL && scalar->convert != NULL)
            Py_SETREF(computed, PyObject_CallOneArg(scalar->convert, computed));
        if (computed != NULL)
            Py_SETREF(computed, PyObject_CallOneArg(scalar->packer, computed));
        if (computed == NULL)
            return declined_on(self);
        for (Py_ssize_t v = 0; v < self->value_count; v++) /* every value of this scalar is it */
            if (self->flat[v]->scalar == s)
                Py_XSETREF(values[v], Py_NewRef(computed));
        Py_DECREF(computed);
    }
    return 0;
}

/* Which values differ from what their node holds (the list may have shrunk since the build:
   IndexError then); 1 where any does, 0 none, -1 on error. */
static int find_changes(ReplayStep *self, call_state *call) {
    int any = 0;
    for (Py_ssize_t v = 0; v < self->value_count; v++) {
        if (self->flat[v]->last >= PyList_GET_SIZE(self->last)) {
            PyErr_SetString(PyExc_IndexError, "ReplayStep: the last values list shrank");
            return -1;
        }
        PyObject *held = Py_NewRef(PyList_GET_ITEM(self->last, self->flat[v]->last));
        int differs = PyObject_RichCompareBool(call->values[v], held, Py_NE);
        Py_DECREF(held);
        if (differs < 0)
            return -1;
        call->changed[v] = (char)differs;
        any |= differs;
    }
    return any;
}

/* A node's changed values written into its parameter buffer; -1 on error. */
static int write_node(node_patch *node, PyObject **values, const char *changed, const uint64_t *pointers) {
    for (Py_ssize_t k = 0; k < node->count; k++) {
        value_slot *value = &node->slots[k];
        if (!changed[k])
            continue;
        for (Py_ssize_t w = 0; w < value->writes; w++) {
            if (value->input >= 0) {
                uint64_t address = pointers[value->tensor] + (uint64_t)value->deltas[w];
                memcpy(value->targets[w], &address, 8); /* '<Q' on a little-endian host */
                continue;
            }
            char *bytes;
            Py_ssize_t size;
            if (PyBytes_AsStringAndSize(values[k], &bytes, &size) < 0)
                return -1;
            if (size != value->sizes[w]) {
                PyErr_SetString(PyExc_ValueError, "ReplayStep: a packed scalar of another size");
                return -1;
            }
            memcpy(value->targets[w], bytes, (size_t)size);
        }
    }
    return 0;
}

/* Push a written node to the exec: `set_failed` raises for a failed status; -1 on error. */
static int push_node(ReplayStep *self, node_patch *node) {
    PyObject *status = PyObject_Call(node->set_call, node->set_args, NULL);
    if (status == NULL)
        return -1;
    PyObject *first;
    int bad = failed_status(status, &first);
    Py_DECREF(status);
    if (bad <= 0)
        return bad;
    PyObject *node_number = PyLong_FromSsize_t(node->node);
    PyObject *raised =
        node_number == NULL ? NULL : PyObject_CallFunctionObjArgs(self->set_failed, first, node_number, NULL);
    Py_DECREF(first);
    Py_XDECREF(node_number);
    if (raised == NULL)
        return -1;
    Py_DECREF(raised);
    return 0;
}

/* Phase 2: write each changed value and push each dirty node, remembering what the driver took;
   -1 (after the rollback) on error. */
static int patch(ReplayStep *self, call_state *call) {
    Py_ssize_t at = 0;
    for (Py_ssize_t n = 0; n < self->node_count; at += self->nodes[n].count, n++) {
        node_patch *node = &self->nodes[n];
        int dirty = 0;
        for (Py_ssize_t k = 0; k < node->count; k++)
            dirty |= call->changed[at + k];
        if (!dirty)
            continue;
        if (write_node(node, call->values + at, call->changed + at, call->pointers) < 0 || push_node(self, node) < 0)
            goto failed;
        for (Py_ssize_t k = 0; k < node->count; k++)
            if (call->changed[at + k] &&
                PyList_SetItem(self->last, node->slots[k].last, Py_NewRef(call->values[at + k])) < 0)
                goto failed;
        if (bump(self->stats, s_patches, ONE) < 0)
            goto failed;
    }
    return 0;
failed: {
    PyObject *type, *error, *trace;
    PyErr_Fetch(&type, &error, &trace);
    PyObject *done = PyObject_CallNoArgs(self->rollback);
    if (done == NULL) { /* the rollback's own error is raised (Python would chain the first one to it) */
        Py_XDECREF(type);
        Py_XDECREF(error);
        Py_XDECREF(trace);
        return -1;
    }
    Py_DECREF(done);
    PyErr_Restore(type, error, trace);
    return -1;
}
}

/* Point the output copies at the slot chosen where they write another; -1 on error. */
static int retarget_if_moved(ReplayStep *self, PyObject *slot) {
    PyObject *bound = PyObject_GetAttr(self->graph, s_bound_slot);
    if (bound == NULL)
        return -1;
    int same = bound == slot;
    Py_DECREF(bound);
    if (same)
        return 0;
    PyObject *retargeted = PyObject_CallOneArg(self->retarget, slot);
    if (retargeted == NULL)
        return -1;
    Py_DECREF(retargeted);
    return 0;
}

/* Before a launch writes the memory `holder` (the slot, or the graph for its own output
   buffers) notes readers of: the stream waits for them where a caller named any
   (`holder.wait_for_readers(stream)`); 0, or -1 on error. */
static int wait_for_readers(PyObject *holder, PyObject *stream) {
    PyObject *readers = PyObject_GetAttr(holder, s_readers);
    if (readers == NULL)
        return -1;
    int any = PyObject_IsTrue(readers);
    Py_DECREF(readers);
    if (any <= 0)
        return any;
    PyObject *waited = PyObject_CallMethodOneArg(holder, s_wait_for_readers, stream);
    if (waited == NULL)
        return -1;
    Py_DECREF(waited);
    return 0;
}

/* Launch on the current stream, telling the session where it changed, once the readers of the
   memory it writes are done (`slot`: the slot written, NULL for none): the stream (a new
   reference), NULL on error. */
static PyObject *launch(ReplayStep *self, PyObject *slot) {
    PyObject *stream = PyObject_CallOneArg(self->current_stream, self->device);
    if (stream == NULL)
        return NULL;
    if (PyList_GET_SIZE(self->last_stream) < 1) { /* emptied since the build: what `_LAST_STREAM[0]` raises */
        PyErr_SetString(PyExc_IndexError, "list index out of range");
        goto failed;
    }
    PyObject *last = Py_NewRef(PyList_GET_ITEM(self->last_stream, 0));
    int switched = PyObject_RichCompareBool(stream, last, Py_NE);
    Py_DECREF(last);
    if (switched < 0)
        goto failed;
    if (switched) {
        PyObject *told = PyObject_CallOneArg(self->stream_switch, stream);
        if (told == NULL)
            goto failed;
        Py_DECREF(told);
    }
    PyObject *holder = slot != NULL ? slot : (self->own_readers ? self->graph : NULL);
    if (holder != NULL && wait_for_readers(holder, stream) < 0)
        goto failed;
    PyObject *launch_args[2] = {self->exec, stream};
    PyObject *status = PyObject_Vectorcall(self->launch, launch_args, 2, NULL);
    if (status == NULL)
        goto failed;
    PyObject *first;
    int bad = failed_status(status, &first);
    Py_DECREF(status);
    if (bad == 0)
        return stream;
    if (bad > 0) {
        PyObject *raised = PyObject_CallOneArg(self->launch_failed, first);
        Py_DECREF(first);
        if (raised != NULL) {
            Py_DECREF(raised);
            return stream;
        }
    }
failed:
    Py_DECREF(stream);
    return NULL;
}

/* The slot now holds this graph's outputs, written from `stream`: a stream it had not been
   written from yet is told to it (`slot.written_from(stream)`); 0, or -1 on error. */
static int mark_written(ReplayStep *self, PyObject *slot, PyObject *stream) {
    if (PyObject_SetAttr(slot, s_writer, self->graph) < 0 || PyObject_SetAttr(self->graph, s_slot, slot) < 0)
        return -1;
    PyObject *streams = PyObject_GetAttr(slot, s_streams);
    if (streams == NULL)
        return -1;
    int known = PySequence_Contains(streams, stream);
    Py_DECREF(streams);
    if (known != 0)
        return known < 0 ? -1 : 0;
    PyObject *told = PyObject_CallMethodOneArg(slot, s_written_from, stream);
    if (told == NULL)
        return -1;
    Py_DECREF(told);
    return 0;
}

/* After the launch: the graph's stream where it keeps it, the slot written (mark_written), and
   the counters; -1 on error. */
static int after_launch(ReplayStep *self, PyObject *slot, PyObject *stream) {
    if (self->notes_stream && PyObject_SetAttr(self->graph, s_stream, stream) < 0)
        return -1;
    if (slot != NULL && mark_written(self, slot, stream) < 0)
        return -1;
    if (bump(self->graph, s_replays, ONE) < 0 || bump(self->stats, s_replays, ONE) < 0)
        return -1;
    if (!self->staged_copies)
        return 0;
    PyObject *copies = PyLong_FromSsize_t(self->staged_copies);
    int failed = copies == NULL ? -1 : bump(self->stats, s_staged_copies, copies);
    Py_XDECREF(copies);
    return failed;
}

/* One output, a new reference (`made`: the outputs made so far, for SAME_AS; NULL for the one
   output itself). */
static PyObject *output(ReplayStep *self, PyObject *const *leaves, PyObject *views, PyObject *made, Py_ssize_t i) {
    switch (self->output_kind[i]) {
    case OUTPUT_LEAF:
        return Py_NewRef(leaves[self->output_number[i]]);
    case OUTPUT_VALUE:
        return Py_NewRef(self->output_item[i]);
    case OUTPUT_MADE:
        return PyObject_CallNoArgs(self->output_item[i]);
    case OUTPUT_MADE_FROM_LEAF:
        return PyObject_CallOneArg(self->output_item[i], leaves[self->output_number[i]]);
    case OUTPUT_SAME_AS:
        return Py_NewRef(PyTuple_GET_ITEM(made, self->output_number[i])); /* built: an earlier output */
    default: {
        PyObject *view = PySequence_GetItem(views, self->output_number[i]);
        PyObject *fresh = view == NULL ? NULL : self->support->fresh_output(view);
        Py_XDECREF(view);
        return fresh;
    }
    }
}

/* The outputs: the one output itself, or a fresh tuple. */
static PyObject *outputs(ReplayStep *self, PyObject *const *leaves) {
    PyObject *views = NULL;
    for (Py_ssize_t i = 0; i < self->output_count && views == NULL; i++)
        if (self->output_kind[i] == OUTPUT_SLOT_VIEW && (views = PyObject_GetAttr(self->graph, s_views)) == NULL)
            return NULL;
    PyObject *result = NULL;
    if (!self->in_tuple) {
        result = output(self, leaves, views, NULL, 0);
    } else if ((result = PyTuple_New(self->output_count)) != NULL) {
        for (Py_ssize_t i = 0; i < self->output_count; i++) {
            PyObject *item = output(self, leaves, views, result, i);
            if (item == NULL) {
                Py_CLEAR(result);
                break;
            }
            PyTuple_SET_ITEM(result, i, item);
        }
    }
    Py_XDECREF(views);
    return result;
}

/* --- one call ----------------------------------------------------------------------------- */

/* The call once this file decides it: checks, values, patch, launch, counts, outputs. */
static PyObject *run(ReplayStep *self, PyObject *const *leaves, call_state *call) {
    int declined = check_settings(self);
    if (declined == 0)
        declined = check_memory(self, call);
    if (declined == 0)
        declined = compute(self, leaves, call);
    if (declined != 0)
        return declined < 0 ? NULL : Py_NewRef(self->mismatch);
    int any = find_changes(self, call);
    if (any < 0 || (any && patch(self, call) < 0))
        return NULL;
    if (call->slot != NULL && retarget_if_moved(self, call->slot) < 0)
        return NULL;
    PyObject *stream = launch(self, call->slot);
    if (stream == NULL)
        return NULL;
    int failed = after_launch(self, call->slot, stream);
    Py_DECREF(stream);
    return failed < 0 ? NULL : outputs(self, leaves);
}

static PyObject *step_call(ReplayStep *self, PyObject *const *leaves, Py_ssize_t count) {
    if (count != self->leaves) /* the generated function raises the TypeError */
        return PyObject_Vectorcall(self->fallback, leaves, count, NULL);
    call_state call;
    call.slot = NULL;
    if (!read_arguments(self, leaves, &call))
        return PyObject_Vectorcall(self->fallback, leaves, count, NULL);
    if (self->slotted) {
        PyObject *slot = own_slot(self, &call);
        if (slot == NULL)
            return NULL;
        if (slot == Py_None)
            return PyObject_Vectorcall(self->fallback, leaves, count, NULL);
        call.slot = slot;
    }
    if (scratch_begin(self, &call) < 0) {
        Py_XDECREF(call.slot);
        return NULL;
    }
    PyObject *result = run(self, leaves, &call);
    scratch_end(self, &call);
    return result;
}

static PyObject *step_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    ReplayStep *self = (ReplayStep *)callable;
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames))
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    return step_call(self, args, PyVectorcall_NARGS(nargsf));
}

/* The only way to make a step: built here, or not made at all. */
static PyObject *step_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *program;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "ReplayStep(program) takes no keywords");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O:ReplayStep", &program))
        return NULL;
    ReplayStep *self = (ReplayStep *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = step_vectorcall;
    self->program = Py_NewRef(program);
    if (build(self, program) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static PyObject *step_get_fallback(ReplayStep *self, void *unused) { return Py_NewRef(self->fallback); }

static PyObject *step_get_program(ReplayStep *self, void *unused) { return Py_NewRef(self->program); }

static PyGetSetDef step_getset[] = {
    {"fallback", (getter)step_get_fallback, NULL, "the generated replay this step runs otherwise", NULL},
    {"program", (getter)step_get_program, NULL, "the StepProgram it was built from (read once, when built)", NULL},
    {NULL},
};

static PyTypeObject ReplayStepType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "replay._step.ReplayStep",
    .tp_basicsize = sizeof(ReplayStep),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "ReplayStep(program) -> step(*leaves): a recorded graph's replay, run from C (csrc/replay_step.c)",
    .tp_new = step_new,
    .tp_dealloc = (destructor)step_dealloc,
    .tp_traverse = (traverseproc)step_traverse,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(ReplayStep, vectorcall),
    .tp_getset = step_getset,
};

/* storage_references(lane) -> the lane's storage object's reference count as slot_held reads
   it (with its one reference of its own): replay.output_slots keeps it as the lane's
   `own_storage_refs_c` when the lane is made, nothing else referring to the storage. */
static PyObject *storage_references(PyObject *module, PyObject *lane) {
    PyObject *storage = PyObject_GetAttr(lane, s_storage);
    if (storage == NULL)
        return NULL;
    PyObject *count = PyLong_FromSsize_t(references(storage));
    Py_DECREF(storage);
    return count;
}

/* held(step, slot) -> True/False, or None where the step leaves it to Slot.held (for tests). */
static PyObject *held_for_tests(PyObject *module, PyObject *const *args, Py_ssize_t count) {
    if (count != 2 || !PyObject_TypeCheck(args[0], &ReplayStepType)) {
        PyErr_SetString(PyExc_TypeError, "held(step, slot)");
        return NULL;
    }
    int answer = slot_held((ReplayStep *)args[0], args[1]);
    if (answer == -1)
        return NULL;
    if (answer == -2)
        Py_RETURN_NONE;
    return PyBool_FromLong(answer);
}

static PyMethodDef module_methods[] = {
    {"storage_references", storage_references, METH_O,
     "storage_references(lane) -> its storage object's reference count, as the step reads it"},
    {"held", (PyCFunction)(void (*)(void))held_for_tests, METH_FASTCALL,
     "held(step, slot) -> whether the step sees the slot held (None: Slot.held() answers)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "replay._step",
                                        "A recorded graph's replay run from C (see csrc/replay_step.c).", -1,
                                        module_methods};

PyMODINIT_FUNC PyInit__step(void) {
#define INTERN(name)                                                                                                   \
    if ((s_##name = PyUnicode_InternFromString(#name)) == NULL)                                                        \
        return NULL;
    NAMES(INTERN)
#undef INTERN
    if ((ONE = PyLong_FromLong(1)) == NULL || PyType_Ready(&ReplayStepType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "ReplayStep", (PyObject *)&ReplayStepType) < 0 ||
        PyModule_AddStringConstant(module, "SUPPORT_LAYOUT", REPLAY_SUPPORT_LAYOUT) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
