/*
 * replay._step: a recorded graph's replay run from C, in its steady state.
 *
 * Why: a replay is two driver calls (a node update, the graph launch) and bookkeeping. Run as
 * generated Python (replay.graph), the bookkeeping costs about 5 us a step on the H200 machine,
 * twice the driver calls, where torch's own CUDAGraph.replay() spends about 1.5 us above its
 * launch. Here the same steps run in C: the pointer reads, the aliasing and output-memory
 * checks, the node patch and the launch, the counters, and the fresh outputs (through the
 * torch-side helper's replay_support capsule, csrc/jitcore_torch_native.cpp).
 *
 * ReplayStep(program) -> step(*leaves): a program is a tuple that replay.graph builds (see
 * RecordedGraph._step_program, which says what each field is) only for graphs whose generated
 * replay has no step outside what this file runs. The generated function stays the reference:
 * the step calls it, with the same arguments, for the whole call wherever this file would have
 * to decide something it does not decide, before doing anything:
 *   - a tensor's data pointer the helper's reader does not read (anything but a plain tensor,
 *     a torch function mode active);
 *   - the output slot to write is not the one the graph wrote last, nor the slot its copies
 *     write with nobody holding outputs in it (OutputSlots.choose decides);
 *   - a rebound pointer plus its recorded delta outside 0 .. 2**64-1 (the function raises).
 * Otherwise it makes the generated function's calls, in its order, with its results: the
 * launchers' globals checks and the torch settings check (read from the function's namespace
 * at every call, so the benchmark hooks that swap them there apply to both), MISMATCH where
 * the function returns it, the same exceptions, the same rollback of an interrupted patch.
 * tests/replay/test_graph.py runs every generated-replay test both ways.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* What the torch-side helper exports (its copy of this struct, version 3). */
typedef struct {
    int version;
    int (*read_data_pointer)(PyObject *, uint64_t *);
    PyObject *(*fresh_output)(PyObject *);
    int64_t (*storage_use_count)(PyObject *); /* -1: not a storage */
    int (*read_storage_span)(PyObject *, uint64_t *, uint64_t *);
} replay_support;
#define SUPPORT_VERSION 3

#define SUPPORT_NAME "jitcore._torch_native.replay_support"
#define MAX_TENSORS 64

/* One value a node may be given: the pointer of input `input` (writes: pointer writes), or
   the packed bytes of scalar `scalar` (writes: byte copies). */
typedef struct {
    Py_ssize_t last;    /* its index in the shared `_last` list */
    Py_ssize_t input;   /* pointer: the leaf; -1 for a scalar */
    Py_ssize_t tensor;  /* pointer: the leaf's place among the tensors */
    Py_ssize_t scalar;  /* scalar: its number; -1 for a pointer */
    Py_ssize_t writes;  /* count */
    char **targets;     /* where each write goes (the node's parameter buffer + offset) */
    long long *deltas;  /* pointer writes: the recorded delta */
    Py_ssize_t *sizes;  /* scalar writes: bytes */
} value_slot;

typedef struct {
    PyObject *set_call, *set_args; /* the updater's call and its argument tuple */
    Py_ssize_t node;
    Py_ssize_t count;
    value_slot *slots;
} node_patch;

typedef struct {
    Py_ssize_t launch_argument; /* which argument tuple it is computed from */
    PyObject *evaluate, *convert, *packer;
} scalar_value;

typedef struct {
    PyObject_HEAD
    PyObject *program;  /* kept: it owns every object below */
    PyObject *fallback; /* the generated replay */
    PyObject *namespace_;
    PyObject *check_names; /* tuple of str: each called, result ignored */
    PyObject *modes_name;  /* "_modes_changed": called, true -> MISMATCH */
    PyObject *mismatch;
    PyObject *me;          /* the graph (slots), or None */
    Py_ssize_t leaves;
    Py_ssize_t tensor_count;
    Py_ssize_t tensor_index[MAX_TENSORS];
    unsigned long long extent[MAX_TENSORS];
    Py_ssize_t lane_count;     /* slotted: lanes checked against the tensors */
    Py_ssize_t owned_count;    /* unslotted: output memory (lo, size) pairs */
    unsigned long long *owned; /* 2 * owned_count */
    Py_ssize_t aligned_count;
    long long *aligned; /* triples: the input's place among the tensors, delta, 1 aligned / 0 not */
    Py_ssize_t staged_count;
    Py_ssize_t *staged;            /* the staged inputs' places among the tensors */
    Py_ssize_t fixed_count;
    unsigned long long *fixed;     /* the addresses the graph holds fixed, sorted */
    Py_ssize_t dynamic_count;
    Py_ssize_t *dynamic; /* leaves whose .value is read */
    Py_ssize_t argument_count;
    PyObject *argument_maker;   /* a function of the dynamic values making every argument tuple, or NULL */
    Py_ssize_t *argument_sizes; /* per argument tuple, its length (without a maker) */
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
    PyObject *stats, *entry;
    Py_ssize_t staged_copies;
    Py_ssize_t output_count;
    int *output_kind;       /* 0 slot view, 1 leaf, 2 constant */
    PyObject **output_item; /* kind 0: its number (int), 1: its leaf (int), 2: the value */
    Py_ssize_t *output_number;
    int container; /* 0: the one output, 1: a tuple */
    const replay_support *support;
    PyObject *use_count; /* output_slots' own use-count reader: the slots whose held() this file may answer */
    vectorcallfunc vectorcall;
} ReplayStep;

static PyObject *s_own, *s_own_storage_refs_c, *s_storage, *s_use_count, *s_slot, *s_writer, *s_freed, *s_bound_slot, *s_held, *s_lanes, *s_address, *s_size, *s_streams,
    *s_views, *s_value, *s_replays, *s_patches, *s_staged_copies, *s_add, *ONE;

static int step_traverse(ReplayStep *self, visitproc visit, void *arg) {
    Py_VISIT(self->program);
    return 0;
}

static int step_clear(ReplayStep *self) {
    Py_CLEAR(self->program);
    return 0;
}

static void step_dealloc(ReplayStep *self) {
    PyObject_GC_UnTrack(self);
    step_clear(self);
    PyMem_Free(self->owned);
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
    if (self->nodes != NULL)
        for (Py_ssize_t n = 0; n < self->node_count; n++) {
            for (Py_ssize_t k = 0; k < self->nodes[n].count; k++) {
                PyMem_Free(self->nodes[n].slots[k].targets);
                PyMem_Free(self->nodes[n].slots[k].deltas);
                PyMem_Free(self->nodes[n].slots[k].sizes);
            }
            PyMem_Free(self->nodes[n].slots);
        }
    PyMem_Free(self->nodes);
    PyMem_Free(self->flat);
    PyMem_Free(self->output_kind);
    PyMem_Free(self->output_item);
    PyMem_Free(self->output_number);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* --- building from the program tuple ------------------------------------------------------ */

static int as_index(PyObject *value, Py_ssize_t *out, const char *what) {
    *out = PyLong_AsSsize_t(value);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "ReplayStep: %s must be an int", what);
        return -1;
    }
    return 0;
}

static PyObject *tuple_field(PyObject *program, Py_ssize_t at, const char *what) {
    PyObject *item = PyTuple_GET_ITEM(program, at);
    if (!PyTuple_Check(item)) {
        PyErr_Format(PyExc_TypeError, "ReplayStep: %s must be a tuple", what);
        return NULL;
    }
    return item;
}

/* Zeroed memory for count items (one more, so that none is a zero-size request); NULL with
   MemoryError set where none is left. */
static void *allocate(Py_ssize_t count, size_t size) {
    void *memory = PyMem_Calloc((size_t)count + 1, size);
    if (memory == NULL)
        PyErr_NoMemory();
    return memory;
}

/* A container's item `at`, which must be a tuple (of `size` items, unless size < 0). */
static PyObject *item_tuple(PyObject *container, Py_ssize_t at, Py_ssize_t size, const char *what) {
    PyObject *item = PyTuple_GET_ITEM(container, at);
    if (!PyTuple_Check(item) || (size >= 0 && PyTuple_GET_SIZE(item) != size)) {
        if (size >= 0)
            PyErr_Format(PyExc_TypeError, "ReplayStep: %s must be a tuple of %zd items", what, size);
        else
            PyErr_Format(PyExc_TypeError, "ReplayStep: %s must be a tuple", what);
        return NULL;
    }
    return item;
}

/* Where leaf `input` is among the tensors read (the place of its pointer); -1 with
   ValueError where it is none of them. */
static Py_ssize_t tensor_place(ReplayStep *self, Py_ssize_t input) {
    for (Py_ssize_t t = 0; t < self->tensor_count; t++)
        if (self->tensor_index[t] == input)
            return t;
    PyErr_SetString(PyExc_ValueError, "ReplayStep: a pointer of a leaf that is not a tensor read");
    return -1;
}

/* A writable address from an int. */
static int as_address(PyObject *value, char **out) {
    unsigned long long wide = PyLong_AsUnsignedLongLong(value);
    if (wide == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (char *)(uintptr_t)wide;
    return 0;
}

/* Program layout (a tuple, positions fixed; replay.graph.RecordedGraph._step_program):
   0 fallback, 1 namespace, 2 check names, 3 mismatch, 4 me or None, 5 leaf count,
   6 tensors ((leaf, extent), ...), 7 lane count, 8 owned ((lo, size), ...),
   9 aligned ((input, delta, aligned), ...), 10 dynamic leaves (int, ...),
   11 arguments ((source or -1, ...), ...) or (maker, count), 12 scalars ((argument, evaluate, convert or None, packer), ...),
   13 arithmetic errors, 14 nodes ((set_call, set_args, node, ((last, input, scalar,
   ((address, delta or size), ...)), ...)), ...), 15 last, 16 rollback, 17 set_failed, 18 retarget,
   19 current_stream, 20 device, 21 last_stream, 22 stream_switch, 23 launch, 24 exec,
   25 launch_failed, 26 stats, 27 entry, 28 staged copies, 29 outputs ((kind, item), ...),
   30 container (0 one, 1 tuple), 31 the support capsule, 32 modes name,
   33 replay.output_slots' use-count reader, 34 staged inputs checked against the fixed
   addresses ((leaf, ...), (address, ...) sorted) */
#define PROGRAM_FIELDS 35

static int build(ReplayStep *self, PyObject *program) {
    if (!PyTuple_Check(program) || PyTuple_GET_SIZE(program) != PROGRAM_FIELDS) {
        PyErr_Format(PyExc_TypeError, "ReplayStep: the program must be a tuple of %d fields", PROGRAM_FIELDS);
        return -1;
    }
#define FIELD(i) PyTuple_GET_ITEM(program, i)
    self->fallback = FIELD(0);
    self->namespace_ = FIELD(1);
    if (!PyDict_Check(self->namespace_)) {
        PyErr_SetString(PyExc_TypeError, "ReplayStep: the namespace must be a dict");
        return -1;
    }
    if ((self->check_names = tuple_field(program, 2, "check names")) == NULL)
        return -1;
    self->mismatch = FIELD(3);
    self->me = FIELD(4);
    if (as_index(FIELD(5), &self->leaves, "the leaf count") < 0)
        return -1;
    PyObject *tensors = tuple_field(program, 6, "tensors");
    if (tensors == NULL)
        return -1;
    self->tensor_count = PyTuple_GET_SIZE(tensors);
    if (self->tensor_count > MAX_TENSORS) {
        PyErr_Format(PyExc_ValueError, "ReplayStep: at most %d tensors", MAX_TENSORS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < self->tensor_count; i++) {
        PyObject *pair = item_tuple(tensors, i, 2, "a tensor");
        if (pair == NULL || as_index(PyTuple_GET_ITEM(pair, 0), &self->tensor_index[i], "a tensor's leaf") < 0)
            return -1;
        self->extent[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(pair, 1));
        if (PyErr_Occurred())
            return -1;
        if (self->tensor_index[i] < 0 || self->tensor_index[i] >= self->leaves) {
            PyErr_SetString(PyExc_ValueError, "ReplayStep: a tensor's leaf is out of range");
            return -1;
        }
    }
    if (as_index(FIELD(7), &self->lane_count, "the lane count") < 0)
        return -1;
    PyObject *owned = tuple_field(program, 8, "owned");
    if (owned == NULL || (self->owned = allocate(2 * PyTuple_GET_SIZE(owned), sizeof(unsigned long long))) == NULL)
        return -1;
    self->owned_count = PyTuple_GET_SIZE(owned);
    for (Py_ssize_t i = 0; i < self->owned_count; i++) {
        PyObject *pair = item_tuple(owned, i, 2, "an owned output range");
        if (pair == NULL)
            return -1;
        self->owned[2 * i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(pair, 0));
        self->owned[2 * i + 1] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(pair, 1));
        if (PyErr_Occurred())
            return -1;
    }
    PyObject *aligned = tuple_field(program, 9, "aligned");
    if (aligned == NULL || (self->aligned = allocate(3 * PyTuple_GET_SIZE(aligned), sizeof(long long))) == NULL)
        return -1;
    self->aligned_count = PyTuple_GET_SIZE(aligned);
    for (Py_ssize_t i = 0; i < self->aligned_count; i++) {
        PyObject *triple = item_tuple(aligned, i, 3, "an alignment");
        if (triple == NULL)
            return -1;
        for (int k = 0; k < 3; k++) {
            self->aligned[3 * i + k] = PyLong_AsLongLong(PyTuple_GET_ITEM(triple, k));
            if (PyErr_Occurred())
                return -1;
        }
        Py_ssize_t place = tensor_place(self, (Py_ssize_t)self->aligned[3 * i]); /* kept as its place */
        if (place < 0)
            return -1;
        self->aligned[3 * i] = place;
    }
    PyObject *dynamic = tuple_field(program, 10, "dynamic");
    if (dynamic == NULL || (self->dynamic = allocate(PyTuple_GET_SIZE(dynamic), sizeof(Py_ssize_t))) == NULL)
        return -1;
    self->dynamic_count = PyTuple_GET_SIZE(dynamic);
    for (Py_ssize_t i = 0; i < self->dynamic_count; i++)
        if (as_index(PyTuple_GET_ITEM(dynamic, i), &self->dynamic[i], "a dynamic leaf") < 0)
            return -1;
    PyObject *arguments = tuple_field(program, 11, "arguments");
    if (arguments == NULL)
        return -1;
    int made = PyTuple_GET_SIZE(arguments) == 2 && PyCallable_Check(PyTuple_GET_ITEM(arguments, 0));
    Py_ssize_t argument_count = PyTuple_GET_SIZE(arguments);
    if (made) { /* (maker, count): the arguments' generated expressions, in one function of the values */
        self->argument_maker = PyTuple_GET_ITEM(arguments, 0);
        if (as_index(PyTuple_GET_ITEM(arguments, 1), &argument_count, "the argument count") < 0)
            return -1;
    }
    if ((self->argument_sizes = allocate(argument_count, sizeof(Py_ssize_t))) == NULL ||
        (self->argument_sources = allocate(argument_count, sizeof(Py_ssize_t *))) == NULL)
        return -1;
    self->argument_count = argument_count;
    for (Py_ssize_t a = 0; !made && a < self->argument_count; a++) {
        PyObject *sources = item_tuple(arguments, a, -1, "a launch's arguments");
        if (sources == NULL)
            return -1;
        Py_ssize_t n = PyTuple_GET_SIZE(sources);
        if ((self->argument_sources[a] = allocate(n, sizeof(Py_ssize_t))) == NULL)
            return -1;
        self->argument_sizes[a] = n;
        for (Py_ssize_t i = 0; i < n; i++) { /* each kept as its dynamic leaf's place, or -1 */
            Py_ssize_t source;
            if (as_index(PyTuple_GET_ITEM(sources, i), &source, "an argument source") < 0)
                return -1;
            Py_ssize_t place = -1;
            for (Py_ssize_t d = 0; source >= 0 && d < self->dynamic_count; d++)
                if (self->dynamic[d] == source)
                    place = d;
            if (source >= 0 && place < 0) {
                PyErr_SetString(PyExc_ValueError, "ReplayStep: an argument's source is not a dynamic leaf read");
                return -1;
            }
            self->argument_sources[a][i] = place;
        }
    }
    PyObject *scalars = tuple_field(program, 12, "scalars");
    if (scalars == NULL || (self->scalars = allocate(PyTuple_GET_SIZE(scalars), sizeof(scalar_value))) == NULL)
        return -1;
    self->scalar_count = PyTuple_GET_SIZE(scalars);
    for (Py_ssize_t i = 0; i < self->scalar_count; i++) {
        PyObject *item = item_tuple(scalars, i, 4, "a scalar");
        if (item == NULL ||
            as_index(PyTuple_GET_ITEM(item, 0), &self->scalars[i].launch_argument, "a scalar's argument") < 0)
            return -1;
        if (self->scalars[i].launch_argument < 0 || self->scalars[i].launch_argument >= self->argument_count) {
            PyErr_SetString(PyExc_ValueError, "ReplayStep: a scalar's argument tuple is out of range");
            return -1;
        }
        self->scalars[i].evaluate = PyTuple_GET_ITEM(item, 1);
        self->scalars[i].convert = PyTuple_GET_ITEM(item, 2) == Py_None ? NULL : PyTuple_GET_ITEM(item, 2);
        self->scalars[i].packer = PyTuple_GET_ITEM(item, 3);
    }
    self->arithmetic = FIELD(13);
    PyObject *nodes = tuple_field(program, 14, "nodes");
    if (nodes == NULL || (self->nodes = allocate(PyTuple_GET_SIZE(nodes), sizeof(node_patch))) == NULL)
        return -1;
    self->node_count = PyTuple_GET_SIZE(nodes);
    self->value_count = 0;
    for (Py_ssize_t n = 0; n < self->node_count; n++) {
        PyObject *item = item_tuple(nodes, n, 4, "a node");
        if (item == NULL)
            return -1;
        node_patch *node = &self->nodes[n];
        node->set_call = PyTuple_GET_ITEM(item, 0);
        node->set_args = item_tuple(item, 1, -1, "a node's set arguments");
        PyObject *slots = item_tuple(item, 3, -1, "a node's values");
        if (node->set_args == NULL || slots == NULL || as_index(PyTuple_GET_ITEM(item, 2), &node->node, "a node") < 0)
            return -1;
        if ((node->slots = allocate(PyTuple_GET_SIZE(slots), sizeof(value_slot))) == NULL)
            return -1;
        node->count = PyTuple_GET_SIZE(slots); /* (set once its slots exist: the deallocator reads them) */
        for (Py_ssize_t k = 0; k < node->count; k++) {
            PyObject *slot = item_tuple(slots, k, 4, "a node value");
            value_slot *value = &node->slots[k];
            if (slot == NULL || as_index(PyTuple_GET_ITEM(slot, 0), &value->last, "a last index") < 0 ||
                as_index(PyTuple_GET_ITEM(slot, 1), &value->input, "a pointer's input") < 0 ||
                as_index(PyTuple_GET_ITEM(slot, 2), &value->scalar, "a scalar's number") < 0)
                return -1;
            if ((value->input < 0) == (value->scalar < 0) || value->scalar >= self->scalar_count) {
                PyErr_SetString(PyExc_ValueError, "ReplayStep: a value is one tensor's pointer or one scalar");
                return -1;
            }
            if (value->input >= 0 && (value->tensor = tensor_place(self, value->input)) < 0)
                return -1;
            if (value->last < 0) {
                PyErr_SetString(PyExc_ValueError, "ReplayStep: a last index is negative");
                return -1;
            }
            PyObject *writes = item_tuple(slot, 3, -1, "a value's writes");
            if (writes == NULL || (value->targets = allocate(PyTuple_GET_SIZE(writes), sizeof(char *))) == NULL ||
                (value->deltas = allocate(PyTuple_GET_SIZE(writes), sizeof(long long))) == NULL ||
                (value->sizes = allocate(PyTuple_GET_SIZE(writes), sizeof(Py_ssize_t))) == NULL)
                return -1;
            value->writes = PyTuple_GET_SIZE(writes);
            for (Py_ssize_t w = 0; w < value->writes; w++) {
                PyObject *write = item_tuple(writes, w, 3, "a write");
                if (write == NULL || as_address(PyTuple_GET_ITEM(write, 0), &value->targets[w]) < 0)
                    return -1;
                if (value->input >= 0) {
                    value->deltas[w] = PyLong_AsLongLong(PyTuple_GET_ITEM(write, 1));
                } else {
                    value->sizes[w] = PyLong_AsSsize_t(PyTuple_GET_ITEM(write, 1));
                }
                if (PyErr_Occurred())
                    return -1;
            }
            self->value_count++;
        }
    }
    if ((self->flat = allocate(self->value_count, sizeof(value_slot *))) == NULL)
        return -1;
    for (Py_ssize_t n = 0, at = 0; n < self->node_count; n++)
        for (Py_ssize_t k = 0; k < self->nodes[n].count; k++)
            self->flat[at++] = &self->nodes[n].slots[k];
    self->last = FIELD(15);
    if (!PyList_CheckExact(self->last)) {
        PyErr_SetString(PyExc_TypeError, "ReplayStep: last must be a list");
        return -1;
    }
    for (Py_ssize_t v = 0; v < self->value_count; v++)
        if (self->flat[v]->last >= PyList_GET_SIZE(self->last)) {
            PyErr_SetString(PyExc_ValueError, "ReplayStep: a last index beyond the list");
            return -1;
        }
    self->rollback = FIELD(16);
    self->set_failed = FIELD(17);
    self->retarget = FIELD(18);
    self->current_stream = FIELD(19);
    self->device = FIELD(20);
    self->last_stream = FIELD(21);
    if (!PyList_CheckExact(self->last_stream) || PyList_GET_SIZE(self->last_stream) < 1) {
        PyErr_SetString(PyExc_TypeError, "ReplayStep: the last stream must be a list of one item");
        return -1;
    }
    self->stream_switch = FIELD(22);
    self->launch = FIELD(23);
    self->exec = FIELD(24);
    self->launch_failed = FIELD(25);
    self->stats = FIELD(26);
    self->entry = FIELD(27);
    if (as_index(FIELD(28), &self->staged_copies, "the staged copies") < 0)
        return -1;
    PyObject *outputs = tuple_field(program, 29, "outputs");
    if (outputs == NULL || (self->output_kind = allocate(PyTuple_GET_SIZE(outputs), sizeof(int))) == NULL ||
        (self->output_item = allocate(PyTuple_GET_SIZE(outputs), sizeof(PyObject *))) == NULL ||
        (self->output_number = allocate(PyTuple_GET_SIZE(outputs), sizeof(Py_ssize_t))) == NULL)
        return -1;
    self->output_count = PyTuple_GET_SIZE(outputs);
    for (Py_ssize_t i = 0; i < self->output_count; i++) {
        PyObject *pair = item_tuple(outputs, i, 2, "an output");
        Py_ssize_t kind;
        if (pair == NULL || as_index(PyTuple_GET_ITEM(pair, 0), &kind, "an output's kind") < 0)
            return -1;
        if (kind < 0 || kind > 2 || (kind == 0 && self->me == Py_None)) {
            PyErr_SetString(PyExc_ValueError, "ReplayStep: an output is a slot view (of a slotted graph), a leaf or a value");
            return -1;
        }
        self->output_kind[i] = (int)kind;
        self->output_item[i] = PyTuple_GET_ITEM(pair, 1);
        if (kind != 2 && as_index(self->output_item[i], &self->output_number[i], "an output's number") < 0)
            return -1;
        if (kind == 1 && (self->output_number[i] < 0 || self->output_number[i] >= self->leaves)) {
            PyErr_SetString(PyExc_ValueError, "ReplayStep: an output's leaf is out of range");
            return -1;
        }
    }
    Py_ssize_t container;
    if (as_index(FIELD(30), &container, "the container") < 0)
        return -1;
    self->container = (int)container;
    if (self->container == 0 && self->output_count != 1) {
        PyErr_SetString(PyExc_ValueError, "ReplayStep: one output unless in a tuple");
        return -1;
    }
    self->support = PyCapsule_GetPointer(FIELD(31), SUPPORT_NAME);
    if (self->support == NULL)
        return -1;
    if (self->support->version != SUPPORT_VERSION) {
        PyErr_SetString(PyExc_ValueError, "ReplayStep: the torch-side helper's replay support is another version");
        return -1;
    }
    self->modes_name = FIELD(32);
    self->use_count = FIELD(33);
    PyObject *storage_check = item_tuple(program, 34, 2, "the staged inputs' storage check");
    if (storage_check == NULL)
        return -1;
    PyObject *staged = tuple_field(storage_check, 0, "the staged inputs");
    PyObject *fixed = staged == NULL ? NULL : tuple_field(storage_check, 1, "the fixed addresses");
    if (fixed == NULL || (self->staged = allocate(PyTuple_GET_SIZE(staged), sizeof(Py_ssize_t))) == NULL ||
        (self->fixed = allocate(PyTuple_GET_SIZE(fixed), sizeof(unsigned long long))) == NULL)
        return -1;
    self->staged_count = PyTuple_GET_SIZE(staged);
    for (Py_ssize_t i = 0; i < self->staged_count; i++) {
        Py_ssize_t leaf;
        if (as_index(PyTuple_GET_ITEM(staged, i), &leaf, "a staged input") < 0 ||
            (self->staged[i] = tensor_place(self, leaf)) < 0)
            return -1;
    }
    self->fixed_count = PyTuple_GET_SIZE(fixed);
    for (Py_ssize_t i = 0; i < self->fixed_count; i++) {
        self->fixed[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(fixed, i));
        if (PyErr_Occurred())
            return -1;
        if (i > 0 && self->fixed[i] <= self->fixed[i - 1]) {
            PyErr_SetString(PyExc_ValueError, "ReplayStep: the fixed addresses must be sorted and unique");
            return -1;
        }
    }
#undef FIELD
    return 0;
}

/* --- one call ----------------------------------------------------------------------------- */

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
        PyObject *lane = PySequence_Fast_GET_ITEM(fast, l);
        PyObject *storage = PyObject_GetAttr(lane, s_storage);
        if (storage == NULL) {
            answer = -1;
            break;
        }
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
    }
    Py_DECREF(fast);
    return answer;
}

/* 1: the bound slot is free to write (not freed, nobody holds outputs in it), 0: not, -1 error. */
static int usable(ReplayStep *self, PyObject *slot) {
    if (slot == Py_None)
        return 0;
    PyObject *freed = PyObject_GetAttr(slot, s_freed);
    if (freed == NULL)
        return -1;
    int truth = PyObject_IsTrue(freed);
    Py_DECREF(freed);
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

/* The slot this replay writes when it is decided without OutputSlots.choose (a new reference),
   Py_None (borrowed, not to be released) where choose must decide, NULL on error. */
static PyObject *own_slot(ReplayStep *self) {
    PyObject *slot = PyObject_GetAttr(self->me, s_slot);
    if (slot == NULL)
        return NULL;
    if (slot != Py_None) {
        PyObject *writer = PyObject_GetAttr(slot, s_writer);
        if (writer == NULL) {
            Py_DECREF(slot);
            return NULL;
        }
        int mine = writer == self->me;
        Py_DECREF(writer);
        if (mine) {
            PyObject *freed = PyObject_GetAttr(slot, s_freed);
            if (freed == NULL) {
                Py_DECREF(slot);
                return NULL;
            }
            int truth = PyObject_IsTrue(freed);
            Py_DECREF(freed);
            if (truth < 0) {
                Py_DECREF(slot);
                return NULL;
            }
            if (!truth)
                return slot; /* the slot it wrote last, nobody else wrote since */
        }
    }
    Py_DECREF(slot);
    PyObject *bound = PyObject_GetAttr(self->me, s_bound_slot);
    if (bound == NULL)
        return NULL;
    int free_to_write = usable(self, bound);
    if (free_to_write > 0)
        return bound;
    Py_DECREF(bound);
    return free_to_write < 0 ? NULL : Py_None;
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

static PyObject *fall_back(ReplayStep *self, PyObject *const *leaves, Py_ssize_t count) {
    return PyObject_Vectorcall(self->fallback, leaves, count, NULL);
}

static PyObject *mismatch(ReplayStep *self) { return Py_NewRef(self->mismatch); }

/* The steps before the launch that can still decline the call: the checks, the values. 0 to
   go on, 1 for MISMATCH, -1 on error. Fills values (new references) and changed. */
static int compute(ReplayStep *self, PyObject *const *leaves, const uint64_t *pointers, PyObject **values,
                   PyObject **dynamic, PyObject **arguments) {
    /* the dynamic leaves' values, outside the computation's try (as generated) */
    for (Py_ssize_t i = 0; i < self->dynamic_count; i++) {
        dynamic[i] = PyObject_GetAttr(leaves[self->dynamic[i]], s_value);
        if (dynamic[i] == NULL)
            return -1;
    }
    if (self->argument_maker != NULL) { /* inside the try: an arithmetic error declines the call */
        PyObject *made = PyObject_Vectorcall(self->argument_maker, dynamic, self->dynamic_count, NULL);
        if (made == NULL) {
            if (PyErr_ExceptionMatches(self->arithmetic)) {
                PyErr_Clear();
                return 1;
            }
            return -1;
        }
        if (!PyTuple_CheckExact(made) || PyTuple_GET_SIZE(made) != self->argument_count) {
            Py_DECREF(made);
            PyErr_SetString(PyExc_TypeError, "ReplayStep: the argument maker returned another shape");
            return -1;
        }
        for (Py_ssize_t a = 0; a < self->argument_count; a++)
            arguments[a] = Py_NewRef(PyTuple_GET_ITEM(made, a));
        Py_DECREF(made);
    }
    for (Py_ssize_t a = 0; self->argument_maker == NULL && a < self->argument_count; a++) {
        Py_ssize_t n = self->argument_sizes[a];
        arguments[a] = PyTuple_New(n);
        if (arguments[a] == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t place = self->argument_sources[a][i];
            PyTuple_SET_ITEM(arguments[a], i, Py_NewRef(place >= 0 ? dynamic[place] : Py_None));
        }
    }
    /* the scalars inside the try: an arithmetic error declines the call */
    for (Py_ssize_t v = 0; v < self->value_count; v++)
        if (self->flat[v]->input >= 0) {
            values[v] = PyLong_FromUnsignedLongLong(pointers[self->flat[v]->tensor]);
            if (values[v] == NULL)
                return -1;
        }
    for (Py_ssize_t s = 0; s < self->scalar_count; s++) {
        scalar_value *scalar = &self->scalars[s];
        PyObject *computed = PyObject_CallOneArg(scalar->evaluate, arguments[scalar->launch_argument]);
        if (computed != NULL && scalar->convert != NULL)
            Py_SETREF(computed, PyObject_CallOneArg(scalar->convert, computed));
        if (computed != NULL)
            Py_SETREF(computed, PyObject_CallOneArg(scalar->packer, computed));
        if (computed == NULL) {
            if (PyErr_ExceptionMatches(self->arithmetic)) {
                PyErr_Clear();
                return 1;
            }
            return -1;
        }
        for (Py_ssize_t v = 0; v < self->value_count; v++) /* every value of this scalar is it */
            if (self->flat[v]->scalar == s)
                Py_XSETREF(values[v], Py_NewRef(computed));
        Py_DECREF(computed);
    }
    return 0;
}

/* Phase 2: write each changed value and push each dirty node; -1 (after the rollback) on
   error. */
static int patch(ReplayStep *self, PyObject **values, const char *changed, const uint64_t *pointers) {
    Py_ssize_t slot = 0;
    for (Py_ssize_t n = 0; n < self->node_count; n++) {
        node_patch *node = &self->nodes[n];
        int dirty = 0;
        for (Py_ssize_t k = 0; k < node->count; k++)
            dirty |= changed[slot + k];
        if (!dirty) {
            slot += node->count;
            continue;
        }
        for (Py_ssize_t k = 0; k < node->count; k++) {
            value_slot *value = &node->slots[k];
            if (!changed[slot + k])
                continue;
            for (Py_ssize_t w = 0; w < value->writes; w++) {
                if (value->input >= 0) {
                    uint64_t address = pointers[value->tensor] + (uint64_t)value->deltas[w];
                    memcpy(value->targets[w], &address, 8); /* '<Q' on a little-endian host */
                } else {
                    char *bytes;
                    Py_ssize_t size;
                    if (PyBytes_AsStringAndSize(values[slot + k], &bytes, &size) < 0)
                        goto failed;
                    if (size != value->sizes[w]) {
                        PyErr_SetString(PyExc_ValueError, "ReplayStep: a packed scalar of another size");
                        goto failed;
                    }
                    memcpy(value->targets[w], bytes, (size_t)size);
                }
            }
        }
        PyObject *status = PyObject_Call(node->set_call, node->set_args, NULL);
        if (status == NULL)
            goto failed;
        PyObject *first;
        int bad = failed_status(status, &first);
        Py_DECREF(status);
        if (bad < 0)
            goto failed;
        if (bad) {
            PyObject *node_number = PyLong_FromSsize_t(node->node);
            PyObject *raised = node_number == NULL
                                   ? NULL
                                   : PyObject_CallFunctionObjArgs(self->set_failed, first, node_number, NULL);
            Py_DECREF(first);
            Py_XDECREF(node_number);
            Py_XDECREF(raised);
            if (raised == NULL)
                goto failed;
        }
        for (Py_ssize_t k = 0; k < node->count; k++)
            if (changed[slot + k] &&
                PyList_SetItem(self->last, node->slots[k].last, Py_NewRef(values[slot + k])) < 0)
                goto failed;
        if (bump(self->stats, s_patches, ONE) < 0)
            goto failed;
        slot += node->count;
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

static PyObject *outputs(ReplayStep *self, PyObject *const *leaves) {
    PyObject *views = NULL;
    for (Py_ssize_t i = 0; i < self->output_count; i++)
        if (self->output_kind[i] == 0) {
            views = PyObject_GetAttr(self->me, s_views);
            if (views == NULL)
                return NULL;
            break;
        }
    PyObject *made[self->output_count > 0 ? self->output_count : 1];
    Py_ssize_t done = 0;
    for (; done < self->output_count; done++) {
        PyObject *item;
        switch (self->output_kind[done]) {
        case 0: {
            PyObject *view = PySequence_GetItem(views, self->output_number[done]);
            item = view == NULL ? NULL : self->support->fresh_output(view);
            Py_XDECREF(view);
            break;
        }
        case 1:
            item = Py_NewRef(leaves[self->output_number[done]]);
            break;
        default:
            item = Py_NewRef(self->output_item[done]);
        }
        if (item == NULL)
            break;
        made[done] = item;
    }
    Py_XDECREF(views);
    if (done < self->output_count) {
        for (Py_ssize_t i = 0; i < done; i++)
            Py_DECREF(made[i]);
        return NULL;
    }
    if (self->container == 0)
        return made[0];
    PyObject *result = PyTuple_New(self->output_count);
    if (result == NULL) {
        for (Py_ssize_t i = 0; i < self->output_count; i++)
            Py_DECREF(made[i]);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < self->output_count; i++)
        PyTuple_SET_ITEM(result, i, made[i]);
    return result;
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

static PyObject *step_call(ReplayStep *self, PyObject *const *leaves, Py_ssize_t count) {
    if (count != self->leaves) /* the generated function raises the TypeError */
        return fall_back(self, leaves, count);
    uint64_t pointers[MAX_TENSORS];
    for (Py_ssize_t t = 0; t < self->tensor_count; t++)
        if (!self->support->read_data_pointer(leaves[self->tensor_index[t]], &pointers[t]) ||
            pointers[t] > UINT64_MAX - self->extent[t]) /* ranges past 2**64: Python's ints compare them */
            return fall_back(self, leaves, count);
    uint64_t storage_end[MAX_TENSORS]; /* per staged input: one past its storage's last byte */
    uint64_t storage_base[MAX_TENSORS];
    for (Py_ssize_t i = 0; i < self->staged_count; i++) {
        uint64_t nbytes;
        if (!self->support->read_storage_span(leaves[self->tensor_index[self->staged[i]]], &storage_base[i], &nbytes) ||
            storage_base[i] > UINT64_MAX - nbytes)
            return fall_back(self, leaves, count);
        storage_end[i] = storage_base[i] + nbytes;
    }
    /* every rebound pointer's write must fit '<Q' (the function raises struct.error there) */
    for (Py_ssize_t n = 0; n < self->node_count; n++)
        for (Py_ssize_t k = 0; k < self->nodes[n].count; k++) {
            value_slot *value = &self->nodes[n].slots[k];
            if (value->input < 0)
                continue;
            Py_ssize_t t = value->tensor;
            for (Py_ssize_t w = 0; w < value->writes; w++) {
                long long delta = value->deltas[w];
                if ((delta < 0 && pointers[t] < (uint64_t)(-(delta + 1)) + 1) ||
                    (delta > 0 && pointers[t] > UINT64_MAX - (uint64_t)delta))
                    return fall_back(self, leaves, count);
            }
        }
    PyObject *slot = NULL; /* the output slot written, a new reference (slotted graphs) */
    if (self->me != Py_None) {
        slot = own_slot(self);
        if (slot == NULL)
            return NULL;
        if (slot == Py_None)
            return fall_back(self, leaves, count);
    }
    PyObject *result = NULL, *lanes = NULL, *stream = NULL;
    PyObject *values[self->value_count > 0 ? self->value_count : 1];
    char changed[self->value_count > 0 ? self->value_count : 1];
    PyObject *dynamic[self->dynamic_count > 0 ? self->dynamic_count : 1];
    PyObject *arguments[self->argument_count > 0 ? self->argument_count : 1];
    memset(values, 0, sizeof(values));
    memset(dynamic, 0, sizeof(dynamic));
    memset(arguments, 0, sizeof(arguments));
    /* the launchers' globals checks and the torch settings check, as the namespace has them */
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->check_names); i++) {
        PyObject *check = PyDict_GetItemWithError(self->namespace_, PyTuple_GET_ITEM(self->check_names, i));
        if (check == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, PyTuple_GET_ITEM(self->check_names, i));
            goto done;
        }
        PyObject *ignored = PyObject_CallNoArgs(check);
        if (ignored == NULL)
            goto done;
        Py_DECREF(ignored);
    }
    {
        PyObject *modes = PyDict_GetItemWithError(self->namespace_, self->modes_name);
        if (modes == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, self->modes_name);
            goto done;
        }
        PyObject *moved = PyObject_CallNoArgs(modes);
        if (moved == NULL)
            goto done;
        int truth = PyObject_IsTrue(moved);
        Py_DECREF(moved);
        if (truth < 0)
            goto done;
        if (truth) {
            result = mismatch(self);
            goto done;
        }
    }
    if (any_overlap(self, pointers)) {
        result = mismatch(self);
        goto done;
    }
    if (slot != NULL) { /* no argument may lie in the output memory this replay writes */
        lanes = PyObject_GetAttr(slot, s_lanes);
        if (lanes == NULL)
            goto done;
        for (Py_ssize_t l = 0; l < self->lane_count; l++) {
            PyObject *lane = PySequence_GetItem(lanes, l);
            if (lane == NULL)
                goto done;
            PyObject *address = PyObject_GetAttr(lane, s_address);
            PyObject *size = address == NULL ? NULL : PyObject_GetAttr(lane, s_size);
            Py_DECREF(lane);
            if (size == NULL) {
                Py_XDECREF(address);
                goto done;
            }
            unsigned long long lo = PyLong_AsUnsignedLongLong(address), bytes = PyLong_AsUnsignedLongLong(size);
            Py_DECREF(address);
            Py_DECREF(size);
            if (PyErr_Occurred())
                goto done;
            if (overlaps(self, pointers, lo, lo + bytes)) {
                result = mismatch(self);
                goto done;
            }
        }
    }
    for (Py_ssize_t i = 0; i < self->owned_count; i++)
        if (overlaps(self, pointers, self->owned[2 * i], self->owned[2 * i] + self->owned[2 * i + 1])) {
            result = mismatch(self);
            goto done;
        }
    for (Py_ssize_t i = 0; i < self->staged_count; i++) /* the generated function's _staged_storage_checks */
        if (holds_fixed(self, storage_base[i], storage_end[i])) {
            result = mismatch(self);
            goto done;
        }
    for (Py_ssize_t i = 0; i < self->aligned_count; i++) {
        long long place = self->aligned[3 * i], delta = self->aligned[3 * i + 1], want = self->aligned[3 * i + 2];
        int is_aligned = ((pointers[place] + (uint64_t)delta) & 15) == 0;
        if (is_aligned != (int)want) {
            result = mismatch(self);
            goto done;
        }
    }
    {
        int declined = compute(self, leaves, pointers, values, dynamic, arguments);
        if (declined < 0)
            goto done;
        if (declined) {
            result = mismatch(self);
            goto done;
        }
    }
    int any = 0;
    for (Py_ssize_t v = 0; v < self->value_count; v++) {
        if (self->flat[v]->last >= PyList_GET_SIZE(self->last)) {
            PyErr_SetString(PyExc_IndexError, "ReplayStep: the last values list shrank");
            goto done;
        }
        PyObject *held = PyList_GET_ITEM(self->last, self->flat[v]->last);
        Py_INCREF(held);
        int differs = PyObject_RichCompareBool(values[v], held, Py_NE);
        Py_DECREF(held);
        if (differs < 0)
            goto done;
        changed[v] = (char)differs;
        any |= differs;
    }
    if (any && patch(self, values, changed, pointers) < 0)
        goto done;
    if (slot != NULL) {
        PyObject *bound = PyObject_GetAttr(self->me, s_bound_slot);
        if (bound == NULL)
            goto done;
        int same = bound == slot;
        Py_DECREF(bound);
        if (!same) {
            PyObject *retargeted = PyObject_CallOneArg(self->retarget, slot);
            if (retargeted == NULL)
                goto done;
            Py_DECREF(retargeted);
        }
    }
    stream = PyObject_CallOneArg(self->current_stream, self->device);
    if (stream == NULL)
        goto done;
    {
        int switched = PyObject_RichCompareBool(stream, PyList_GET_ITEM(self->last_stream, 0), Py_NE);
        if (switched < 0)
            goto done;
        if (switched) {
            PyObject *told = PyObject_CallOneArg(self->stream_switch, stream);
            if (told == NULL)
                goto done;
            Py_DECREF(told);
        }
        PyObject *launch_args[2] = {self->exec, stream};
        PyObject *status = PyObject_Vectorcall(self->launch, launch_args, 2, NULL);
        if (status == NULL)
            goto done;
        PyObject *first;
        int bad = failed_status(status, &first);
        Py_DECREF(status);
        if (bad < 0)
            goto done;
        if (bad) {
            PyObject *raised = PyObject_CallOneArg(self->launch_failed, first);
            Py_DECREF(first);
            if (raised == NULL)
                goto done;
            Py_DECREF(raised);
        }
    }
    if (slot != NULL) {
        if (PyObject_SetAttr(slot, s_writer, self->me) < 0 || PyObject_SetAttr(self->me, s_slot, slot) < 0)
            goto done;
        PyObject *streams = PyObject_GetAttr(slot, s_streams);
        if (streams == NULL)
            goto done;
        PyObject *added = PyObject_CallMethodOneArg(streams, s_add, stream);
        Py_DECREF(streams);
        if (added == NULL)
            goto done;
        Py_DECREF(added);
    }
    if (bump(self->entry, s_replays, ONE) < 0 || bump(self->stats, s_replays, ONE) < 0)
        goto done;
    if (self->staged_copies) {
        PyObject *copies = PyLong_FromSsize_t(self->staged_copies);
        int failed = copies == NULL ? -1 : bump(self->stats, s_staged_copies, copies);
        Py_XDECREF(copies);
        if (failed < 0)
            goto done;
    }
    result = outputs(self, leaves);
done:
    for (Py_ssize_t v = 0; v < self->value_count; v++)
        Py_XDECREF(values[v]);
    for (Py_ssize_t i = 0; i < self->dynamic_count; i++)
        Py_XDECREF(dynamic[i]);
    for (Py_ssize_t a = 0; a < self->argument_count; a++)
        Py_XDECREF(arguments[a]);
    Py_XDECREF(stream);
    Py_XDECREF(lanes);
    if (slot != NULL && slot != Py_None)
        Py_DECREF(slot);
    return result;
}

static PyObject *step_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    ReplayStep *self = (ReplayStep *)callable;
    Py_ssize_t count = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames))
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    return step_call(self, args, count);
}

static PyObject *step_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *program;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "ReplayStep(program) takes no keywords");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!:ReplayStep", &PyTuple_Type, &program))
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

static PyGetSetDef step_getset[] = {
    {"fallback", (getter)step_get_fallback, NULL, "the generated replay this step runs otherwise", NULL},
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
    .tp_clear = (inquiry)step_clear,
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
#define INTERN(var, text)                                                                                              \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                                              \
        return NULL;
    INTERN(s_own, "own")
    INTERN(s_own_storage_refs_c, "own_storage_refs_c")
    INTERN(s_storage, "storage")
    INTERN(s_use_count, "use_count")
    INTERN(s_slot, "slot")
    INTERN(s_writer, "writer")
    INTERN(s_freed, "freed")
    INTERN(s_bound_slot, "bound_slot")
    INTERN(s_held, "held")
    INTERN(s_lanes, "lanes")
    INTERN(s_address, "address")
    INTERN(s_size, "size")
    INTERN(s_streams, "streams")
    INTERN(s_views, "views")
    INTERN(s_value, "value")
    INTERN(s_replays, "replays")
    INTERN(s_patches, "patches")
    INTERN(s_staged_copies, "staged_copies")
    INTERN(s_add, "add")
#undef INTERN
    if ((ONE = PyLong_FromLong(1)) == NULL)
        return NULL;
    if (PyType_Ready(&ReplayStepType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "ReplayStep", (PyObject *)&ReplayStepType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
