/*
 * jitcore.backends._native: driver calls made from C instead of through a binding.
 *
 * Why: a cache-hit launch and a replay are one or two driver calls each, and from Python the
 * binding's own argument conversion costs about as much as the driver call itself (see
 * docs/benchmarks for the figures). These functions take the same arguments as the binding's
 * calls (raw handles as ints, or handle objects that int() converts), call the vendor function
 * through a pointer the backend resolved, and return what the binding returns: a tuple whose
 * first item is the status, so generated code runs unchanged on either path.
 *
 * Nothing here includes a vendor header. The prototypes are the ones cuLaunchKernel /
 * hipModuleLaunchKernel, cuGraphLaunch / hipGraphLaunch, cuGraphExecKernelNodeSetParams /
 * hipGraphExecKernelNodeSetParams, cuStreamGetCaptureInfo_v2 / hipStreamGetCaptureInfo_v2,
 * cuGraphGetNodes / hipGraphGetNodes and cuGraphNodeGetType / hipGraphNodeGetType share
 * (every handle a pointer, every dimension an unsigned int, the status, capture status and
 * node type int enums), and cuGraphKernelNodeGetParams_v2, whose struct is CUDA's. Which
 * function a pointer names, and that it matches its prototype, is the backend module's
 * business.
 *
 * The capture query is not on a hot path but on every launch of a recording (replay maps each
 * launch to its graph node by it): through cuda-bindings most of its cost is building the
 * binding's node objects, and CaptureTail answers it whole in C, where a packed launch's record
 * asks it without a Python call. The node reads (the graph's nodes, each node's type, a kernel
 * node's parameters and their values) are made once per recording, for every node, where the
 * binding builds objects again: NodeReads makes them all in one call. The kernel node's
 * parameter struct is CUDA's (see kernel_node_params_head), as is the copy node's
 * (graph_add_memcpy, which takes the struct the binding made): those kinds are bound by the
 * CUDA backend only.
 *
 * Misuse from Python raises (TypeError, ValueError, OverflowError; PackedLaunch's values
 * struct.error, as struct's pack), never crashes: sequences are read from a copy taken at the
 * call (an item's __index__ may change the caller's), and every bound is checked without
 * overflowing. What cannot be checked is an address itself: a raw handle, a vendor function's
 * or a parameter array's address is taken as given, as ctypes takes one.
 *
 * The GIL is released around each driver call, as the bindings do: a launch blocks while the
 * device's launch queue is full.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>

typedef int (*kernel_launch_fn)(void *function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                                unsigned block_x, unsigned block_y, unsigned block_z,
                                unsigned shared_bytes, void *stream, void **params, void **extra);
typedef int (*graph_launch_fn)(void *graph_exec, void *stream);
typedef int (*node_set_fn)(void *graph_exec, void *node, const void *node_params);
typedef int (*capture_info_fn)(void *stream, int *capture_status, unsigned long long *capture_id, void **graph,
                               void *const **dependencies, size_t *dependency_count);
typedef int (*graph_get_nodes_fn)(void *graph, void **nodes, size_t *count);
typedef int (*node_get_type_fn)(void *node, int *type);
typedef int (*kernel_node_get_params_fn)(void *node, void *node_params);
typedef int (*graph_add_memcpy_fn)(void **node, void *graph, void *const *dependencies, size_t dependency_count,
                                   const void *copy_params, void *context);

/* The head of CUDA_KERNEL_NODE_PARAMS(_v2) (cuda.h), field for field: what replay reads of a
   kernel node. The driver writes the whole struct (_v2 adds extra, kern and ctx after these),
   so it is read into a zeroed buffer with room to spare. HIP's hipKernelNodeParams orders its
   fields otherwise: this kind is the CUDA backend's only. */
typedef struct {
    void *function;
    unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
    void **kernel_params;
} kernel_node_params_head;

static PyObject *SUCCESS; /* (0,): what every successful call returns, built once */

/* A handle or address: an int from 0 to 2**64-1 (the fast path), None (NULL), or an object
   int() converts (a binding's handle object), but not text, bytes or a float, which int()
   would parse or truncate into some address. */
static int as_pointer(PyObject *value, void **out, const char *what) {
    unsigned long long wide;
    if (PyLong_CheckExact(value)) {
        wide = PyLong_AsUnsignedLongLong(value);
    } else if (value == Py_None) {
        *out = NULL;
        return 0;
    } else {
        PyObject *number = PyUnicode_Check(value) || PyBytes_Check(value) || PyByteArray_Check(value) ||
                                   PyFloat_Check(value)
                               ? NULL
                               : PyNumber_Long(value);
        if (number == NULL) {
            PyErr_Format(PyExc_TypeError, "%s: expected a raw handle (int), got %.200s", what,
                         Py_TYPE(value)->tp_name);
            return -1;
        }
        wide = PyLong_AsUnsignedLongLong(number);
        Py_DECREF(number);
    }
    if (wide == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_OverflowError, "%s: expected a raw handle from 0 to 2**64-1", what);
        return -1;
    }
    *out = (void *)(uintptr_t)wide;
    return 0;
}

/* A launch dimension or byte count: an int in [0, UINT_MAX] (objects with __index__ too). */
static int as_unsigned(PyObject *value, unsigned *out, const char *what) {
    unsigned long long wide;
    if (PyLong_Check(value)) {
        wide = PyLong_AsUnsignedLongLong(value);
    } else {
        PyObject *index = PyNumber_Index(value);
        if (index == NULL)
            return -1;
        wide = PyLong_AsUnsignedLongLong(index);
        Py_DECREF(index);
    }
    if (wide == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_OverflowError, "%s: expected an int from 0 to %u", what, UINT_MAX);
        return -1;
    }
    if (wide > UINT_MAX) {
        PyErr_Format(PyExc_OverflowError, "%s: expected an int from 0 to %u, got %llu", what, UINT_MAX, wide);
        return -1;
    }
    *out = (unsigned)wide;
    return 0;
}

static PyObject *status_tuple(int status) {
    if (status == 0) {
        Py_INCREF(SUCCESS);
        return SUCCESS;
    }
    return Py_BuildValue("(i)", status);
}

static int check_count(Py_ssize_t given, Py_ssize_t expected) {
    if (given == expected)
        return 0;
    PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", expected, given);
    return -1;
}

/* self is the int address of the vendor function. */
static void *target_of(PyObject *self) { return PyLong_AsVoidPtr(self); }

static PyObject *kernel_launch(PyObject *self, PyObject *const *args, Py_ssize_t count) {
    static const char *const names[] = {"grid x", "grid y", "grid z", "block x", "block y", "block z", "shared bytes"};
    void *function, *stream, *params, *extra;
    unsigned dims[7];
    int status;
    kernel_launch_fn call = (kernel_launch_fn)target_of(self);
    if (check_count(count, 11) < 0)
        return NULL;
    if (as_pointer(args[0], &function, "function") < 0)
        return NULL;
    for (int i = 0; i < 7; i++)
        if (as_unsigned(args[1 + i], &dims[i], names[i]) < 0)
            return NULL;
    if (as_pointer(args[8], &stream, "stream") < 0 || as_pointer(args[9], &params, "kernel params") < 0 ||
        as_pointer(args[10], &extra, "extra") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    status = call(function, dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], stream, (void **)params,
                  (void **)extra);
    Py_END_ALLOW_THREADS
    return status_tuple(status);
}

static PyObject *graph_launch(PyObject *self, PyObject *const *args, Py_ssize_t count) {
    void *graph_exec, *stream;
    int status;
    graph_launch_fn call = (graph_launch_fn)target_of(self);
    if (check_count(count, 2) < 0)
        return NULL;
    if (as_pointer(args[0], &graph_exec, "graph exec") < 0 || as_pointer(args[1], &stream, "stream") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    status = call(graph_exec, stream);
    Py_END_ALLOW_THREADS
    return status_tuple(status);
}

static PyObject *node_set(PyObject *self, PyObject *const *args, Py_ssize_t count) {
    void *graph_exec, *node, *node_params;
    int status;
    node_set_fn call = (node_set_fn)target_of(self);
    if (check_count(count, 3) < 0)
        return NULL;
    if (as_pointer(args[0], &graph_exec, "graph exec") < 0 || as_pointer(args[1], &node, "node") < 0 ||
        as_pointer(args[2], &node_params, "node params") < 0)
        return NULL;
    if (node_params == NULL) {
        PyErr_SetString(PyExc_ValueError, "node params: expected the address of a node-params struct, got 0");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    status = call(graph_exec, node, node_params);
    Py_END_ALLOW_THREADS
    return status_tuple(status);
}

/* capture_info(stream) -> (status, capture status, (dependency node handles...)): the nodes
   a captured stream's next node would depend on (right after a launch, that launch's node);
   () unless the status is 0. */
static PyObject *capture_info(PyObject *self, PyObject *const *args, Py_ssize_t count) {
    void *stream, *graph = NULL;
    void *const *dependencies = NULL;
    size_t dependency_count = 0;
    unsigned long long capture_id = 0;
    int status, capture_status = 0;
    PyObject *nodes;
    capture_info_fn call = (capture_info_fn)target_of(self);
    if (check_count(count, 1) < 0)
        return NULL;
    if (as_pointer(args[0], &stream, "stream") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    status = call(stream, &capture_status, &capture_id, &graph, &dependencies, &dependency_count);
    Py_END_ALLOW_THREADS
    if (status != 0 || dependencies == NULL)
        dependency_count = 0;
    if (dependency_count > (size_t)PY_SSIZE_T_MAX) {
        PyErr_SetString(PyExc_OverflowError, "capture info: more dependencies than a tuple holds");
        return NULL;
    }
    nodes = PyTuple_New((Py_ssize_t)dependency_count);
    if (nodes == NULL)
        return NULL;
    for (size_t i = 0; i < dependency_count; i++) {
        PyObject *node = PyLong_FromVoidPtr(dependencies[i]);
        if (node == NULL) {
            Py_DECREF(nodes);
            return NULL;
        }
        PyTuple_SET_ITEM(nodes, (Py_ssize_t)i, node);
    }
    return Py_BuildValue("(iiN)", status, capture_status, nodes);
}

/* graph_get_nodes(graph) -> (status, (node handles...)): the graph's nodes in the driver's
   order (asked for the count, then the handles); () unless the status is 0. */
static PyObject *graph_get_nodes(PyObject *self, PyObject *const *args, Py_ssize_t count) {
    void *graph, **nodes;
    size_t node_count = 0, filled;
    int status;
    PyObject *handles;
    graph_get_nodes_fn call = (graph_get_nodes_fn)target_of(self);
    if (check_count(count, 1) < 0 || as_pointer(args[0], &graph, "graph") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    status = call(graph, NULL, &node_count);
    Py_END_ALLOW_THREADS
    if (status != 0 || node_count == 0)
        return Py_BuildValue("(i())", status);
    if (node_count > (size_t)PY_SSIZE_T_MAX / sizeof(void *))
        return PyErr_NoMemory();
    nodes = PyMem_Malloc(node_count * sizeof(void *));
    if (nodes == NULL)
        return PyErr_NoMemory();
    filled = node_count;
    Py_BEGIN_ALLOW_THREADS
    status = call(graph, nodes, &filled);
    Py_END_ALLOW_THREADS
    if (status != 0) {
        PyMem_Free(nodes);
        return Py_BuildValue("(i())", status);
    }
    if (filled > node_count) /* the graph grew in between: the handles asked for room for */
        filled = node_count;
    handles = PyTuple_New((Py_ssize_t)filled);
    for (size_t i = 0; handles != NULL && i < filled; i++) {
        PyObject *handle = PyLong_FromVoidPtr(nodes[i]);
        if (handle == NULL)
            Py_CLEAR(handles);
        else
            PyTuple_SET_ITEM(handles, (Py_ssize_t)i, handle);
    }
    PyMem_Free(nodes);
    return handles == NULL ? NULL : Py_BuildValue("(iN)", status, handles);
}

/* node_get_type(node) -> (status, the node type's int) */
static PyObject *node_get_type(PyObject *self, PyObject *const *args, Py_ssize_t count) {
    void *node;
    int status, type = -1;
    node_get_type_fn call = (node_get_type_fn)target_of(self);
    if (check_count(count, 1) < 0 || as_pointer(args[0], &node, "node") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    status = call(node, &type);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(ii)", status, type);
}

/* kernel_node_get_params(node) -> (status, function, grid x, y, z, block x, y, z, shared
   bytes, the address of the node's kernel-parameter array); zeros unless the status is 0. */
static PyObject *kernel_node_get_params(PyObject *self, PyObject *const *args, Py_ssize_t count) {
    void *node;
    int status;
    union {
        kernel_node_params_head head;
        unsigned char room[512];
    } params;
    kernel_node_get_params_fn call = (kernel_node_get_params_fn)target_of(self);
    if (check_count(count, 1) < 0 || as_pointer(args[0], &node, "node") < 0)
        return NULL;
    memset(&params, 0, sizeof params);
    Py_BEGIN_ALLOW_THREADS
    status = call(node, &params);
    Py_END_ALLOW_THREADS
    if (status != 0)
        memset(&params, 0, sizeof params);
    return Py_BuildValue("(iKIIIIIIIK)", status, (unsigned long long)(uintptr_t)params.head.function,
                         params.head.grid_x, params.head.grid_y, params.head.grid_z, params.head.block_x,
                         params.head.block_y, params.head.block_z, params.head.shared_bytes,
                         (unsigned long long)(uintptr_t)params.head.kernel_params);
}

/* The values a kernel-parameter array (one pointer per parameter, as a kernel node holds it at
   `address`) points to, sizes[i] bytes each (`sizes` a tuple the caller owns); empty bytes for
   every parameter where `address` is NULL. A new tuple, or NULL with the error set. */
static PyObject *param_values(void *address, PyObject *sizes) {
    Py_ssize_t n = PyTuple_GET_SIZE(sizes);
    PyObject *values = PyTuple_New(n);
    for (Py_ssize_t i = 0; values != NULL && i < n; i++) {
        Py_ssize_t size = PyNumber_AsSsize_t(PyTuple_GET_ITEM(sizes, i), PyExc_OverflowError);
        const char *value = address == NULL ? NULL : ((const char *const *)address)[i];
        PyObject *item = NULL;
        if (size == -1 && PyErr_Occurred()) {
        } else if (size < 0) {
            PyErr_Format(PyExc_ValueError, "read_params: size %zd of parameter %zd is negative", size, i);
        } else if (address == NULL) {
            item = PyBytes_FromStringAndSize(NULL, 0);
        } else if (value == NULL && size > 0) {
            PyErr_Format(PyExc_ValueError, "read_params: parameter %zd has no value (a NULL pointer)", i);
        } else {
            item = PyBytes_FromStringAndSize(value, size);
        }
        if (item == NULL)
            Py_CLEAR(values);
        else
            PyTuple_SET_ITEM(values, i, item);
    }
    return values;
}

/* read_params(address, sizes) -> (bytes, ...): param_values of a kernel node's parameter
   array. Replay reads every kernel node's parameters once per recording: this is one call
   where ctypes made two per parameter. */
static PyObject *read_params(PyObject *module, PyObject *const *args, Py_ssize_t count) {
    void *address;
    PyObject *sizes, *values;
    if (check_count(count, 2) < 0 || as_pointer(args[0], &address, "params address") < 0)
        return NULL;
    if (!PySequence_Check(args[1])) {
        PyErr_Format(PyExc_TypeError, "read_params: sizes must be a sequence of ints, got %.200s",
                     Py_TYPE(args[1])->tp_name);
        return NULL;
    }
    sizes = PySequence_Tuple(args[1]); /* a copy: a size's __index__ may change a list */
    if (sizes == NULL)
        return NULL;
    values = param_values(address, sizes);
    Py_DECREF(sizes);
    return values;
}

/* graph_add_memcpy(graph, dependencies, copy params, context) -> (status, the new node's handle):
   a copy node added to a graph that is not instantiated yet, after every node in `dependencies`
   (a sequence of node handles, read from a copy taken at the call); `copy params` is the address
   of the driver's copy-parameters struct (CUDA_MEMCPY3D, which the caller made and keeps alive).
   The handle is 0 unless the status is 0. */
static PyObject *graph_add_memcpy(PyObject *self, PyObject *const *args, Py_ssize_t count) {
    void *graph, *params, *context, *node = NULL, **dependencies = NULL;
    graph_add_memcpy_fn call = (graph_add_memcpy_fn)target_of(self);
    if (check_count(count, 4) < 0 || as_pointer(args[0], &graph, "graph") < 0 ||
        as_pointer(args[2], &params, "copy params") < 0 || as_pointer(args[3], &context, "context") < 0)
        return NULL;
    if (params == NULL) {
        PyErr_SetString(PyExc_ValueError, "copy params: expected the address of a copy-parameters struct, got 0");
        return NULL;
    }
    if (!PyList_Check(args[1]) && !PyTuple_Check(args[1])) {
        PyErr_Format(PyExc_TypeError, "dependencies: expected a list or tuple of node handles, got %.200s",
                     Py_TYPE(args[1])->tp_name);
        return NULL;
    }
    PyObject *handles = PySequence_Tuple(args[1]); /* a copy: a handle's __int__ may change a list */
    if (handles == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(handles);
    if (n > 0 && (dependencies = PyMem_Malloc(sizeof(void *) * (size_t)n)) == NULL) {
        Py_DECREF(handles);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (as_pointer(PyTuple_GET_ITEM(handles, i), &dependencies[i], "dependency") < 0) {
            PyMem_Free(dependencies);
            Py_DECREF(handles);
            return NULL;
        }
    Py_DECREF(handles);
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = call(&node, graph, dependencies, (size_t)n, params, context);
    Py_END_ALLOW_THREADS
    PyMem_Free(dependencies);
    return Py_BuildValue("(iK)", status, status == 0 ? (unsigned long long)(uintptr_t)node : 0ULL);
}

/* The kinds bind() knows: each a prototype above, by its name. */
static const struct {
    const char *kind;
    PyCFunction implementation;
} KINDS[] = {
    {"kernel_launch", (PyCFunction)(void (*)(void))kernel_launch},
    {"graph_launch", (PyCFunction)(void (*)(void))graph_launch},
    {"kernel_node_set", (PyCFunction)(void (*)(void))node_set},
    {"capture_info", (PyCFunction)(void (*)(void))capture_info},
    {"graph_get_nodes", (PyCFunction)(void (*)(void))graph_get_nodes},
    {"node_get_type", (PyCFunction)(void (*)(void))node_get_type},
    {"kernel_node_get_params", (PyCFunction)(void (*)(void))kernel_node_get_params},
    {"graph_add_memcpy", (PyCFunction)(void (*)(void))graph_add_memcpy},
};

/* bind(kind, name, address): a builtin function named `name` calling the vendor function at
   `address` with the prototype of `kind`. The method definition outlives the function, so it
   is allocated and never freed (a backend binds a handful, once). */
static PyObject *bind(PyObject *module, PyObject *const *args, Py_ssize_t count) {
    const char *kind, *name;
    Py_ssize_t name_length;
    PyCFunction implementation;
    PyMethodDef *definition;
    char *name_copy;
    void *address;
    PyObject *function;
    if (count != 3) {
        PyErr_Format(PyExc_TypeError, "bind(kind, name, address): expected 3 arguments, got %zd", count);
        return NULL;
    }
    kind = PyUnicode_AsUTF8(args[0]);
    if (kind == NULL)
        return NULL;
    name = PyUnicode_AsUTF8AndSize(args[1], &name_length);
    if (name == NULL)
        return NULL;
    if (!PyLong_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "bind: address must be an int");
        return NULL;
    }
    if (as_pointer(args[2], &address, "bind: address") < 0) /* 0 to 2**64-1: target_of reads it back */
        return NULL;
    if (address == NULL) {
        PyErr_SetString(PyExc_ValueError, "bind: address must not be 0");
        return NULL;
    }
    implementation = NULL;
    for (size_t i = 0; i < sizeof KINDS / sizeof KINDS[0]; i++)
        if (strcmp(kind, KINDS[i].kind) == 0)
            implementation = KINDS[i].implementation;
    if (implementation == NULL) {
        PyErr_Format(PyExc_ValueError,
                     "bind: kind must be kernel_launch, graph_launch, kernel_node_set, capture_info, graph_get_nodes, "
                     "node_get_type, kernel_node_get_params or graph_add_memcpy, got %s",
                     kind);
        return NULL;
    }
    definition = PyMem_RawMalloc(sizeof(PyMethodDef));
    name_copy = PyMem_RawMalloc((size_t)name_length + 1);
    if (definition == NULL || name_copy == NULL) {
        PyMem_RawFree(definition);
        PyMem_RawFree(name_copy);
        return PyErr_NoMemory();
    }
    memcpy(name_copy, name, (size_t)name_length + 1);
    definition->ml_name = name_copy;
    definition->ml_meth = implementation;
    definition->ml_flags = METH_FASTCALL;
    definition->ml_doc = NULL;
    function = PyCFunction_NewEx(definition, args[2], NULL);
    if (function == NULL) {
        PyMem_RawFree(definition);
        PyMem_RawFree(name_copy);
    }
    return function;
}

/* --- PackedLaunch: a kernel launch that packs its own parameters --------------------------
 *
 * A call state's launch packs its changing parameters into a per-thread buffer with
 * struct.pack_into, then calls the launch with the buffer's void* array. PackedLaunch does
 * both in one C call: it copies the launch's template (the constant parameters, packed when
 * the call state was built) into a buffer on the C stack, packs the values by the same
 * struct codes the call state's packers use, and calls the vendor launch with a void* array
 * into that buffer (the driver copies the parameters before it returns, so the stack buffer
 * suffices, and threads share nothing).
 *
 * Exactly struct's rules, code by code (CPython's _struct.c, standard sizes, little-endian):
 * integers accept ints and objects with __index__ (bool included), anything else is a
 * struct.error; a value out of the code's range is a struct.error; '?' takes any object's
 * truth; 'e', 'f', 'd' take what float() would (PyFloat_AsDouble; else struct.error) and
 * round to nearest, a finite value too large for the format an OverflowError (a struct.error
 * where the value was an int, as struct's pack says it). The call state
 * catches both (its _PACK_ERRORS) and names the argument, as it does for struct's own.
 * One more code, 'P': the value is a tensor (any object with data_ptr()), and what its
 * data_ptr() returns is packed as 'Q' (the call state passes tensors whose pointer goes to
 * the kernel unchanged, and saves the Python call). Every value is packed before anything is
 * launched, and a launch whose grid has a zero dimension packs (so a bad value is refused all
 * the same) and returns success without calling the driver: an empty launch. A launch the
 * driver refuses calls `failed` with its status, which raises the backend's error. */

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "PackedLaunch writes parameters in the host's byte order, which must be little-endian (as struct's '<')"
#endif

static PyObject *STRUCT_ERROR; /* struct.error */

#define MAX_PACKED_CODES 4096

typedef struct {
    PyObject_HEAD
    kernel_launch_fn call;
    void *function;
    char *template;     /* the constants, packed; size bytes */
    Py_ssize_t size;
    Py_ssize_t *offsets; /* each parameter's offset in the buffer */
    Py_ssize_t count;    /* parameters */
    char *codes;         /* the struct codes of the values, in order, 'x' for a pad byte */
    Py_ssize_t *places;  /* where each code writes */
    Py_ssize_t codes_count, values;
    PyObject *failed; /* called with a failed launch's status (it raises), or NULL */
    vectorcallfunc vectorcall;
} PackedLaunch;

static PyObject *S_DATA_PTR; /* "data_ptr" */

/* A faster reader of a tensor's data pointer for 'P', from the torch-side helper
 * (csrc/jitcore_torch_native.cpp, built against the installed torch): it answers 1 with the
 * address where it read what data_ptr() would return, 0 where the method must be called
 * (anything but a plain tensor, a torch function mode, an error). NULL: always the method. */
typedef int (*data_pointer_reader_fn)(PyObject *, uint64_t *);
static data_pointer_reader_fn DATA_POINTER_READER;
static PyObject *DATA_POINTER_READER_OWNER; /* the capsule, kept while its function is in use */
#define DATA_POINTER_READER_NAME "jitcore._torch_native.data_pointer_reader"

static void packed_dealloc(PackedLaunch *self) {
    Py_XDECREF(self->failed);
    PyMem_Free(self->template);
    PyMem_Free(self->offsets);
    PyMem_Free(self->codes);
    PyMem_Free(self->places);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int code_size(char code) {
    switch (code) {
    case 'x': case 'b': case 'B': case '?': return 1;
    case 'h': case 'H': case 'e': return 2;
    case 'i': case 'I': case 'l': case 'L': case 'f': return 4;
    case 'q': case 'Q': case 'd': case 'P': return 8;
    default: return 0;
    }
}

static PyObject *packed_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames);

/* Each parameter's offset in the buffer, from a tuple of ints: 0 with self->offsets filled, or
   -1 with the error set. */
static int read_offsets(PackedLaunch *self, PyObject *offsets_obj) {
    for (Py_ssize_t i = 0; i < self->count; i++) {
        Py_ssize_t offset = PyLong_AsSsize_t(PyTuple_GET_ITEM(offsets_obj, i));
        if (offset == -1 && PyErr_Occurred())
            return -1;
        if (offset < 0 || offset > self->size) {
            PyErr_Format(PyExc_ValueError, "parameter %zd: offset %zd outside the %zd-byte buffer", i, offset, self->size);
            return -1;
        }
        self->offsets[i] = offset;
    }
    return 0;
}

/* The codes and places of the runs, each an (offset, '<' format) tuple: 0 with self->codes,
   places, codes_count and values filled, or -1 with the error set. Every code must lie inside
   the buffer, checked without overflowing (an offset near 2**63 is refused, not wrapped). */
static int read_runs(PackedLaunch *self, PyObject *runs_obj) {
    for (Py_ssize_t r = 0; r < PyTuple_GET_SIZE(runs_obj); r++) {
        PyObject *run = PyTuple_GET_ITEM(runs_obj, r);
        Py_ssize_t at;
        const char *format;
        if (!PyTuple_Check(run)) {
            PyErr_Format(PyExc_TypeError, "run %zd: expected an (offset, format) tuple", r);
            return -1;
        }
        if (!PyArg_ParseTuple(run, "ns", &at, &format))
            return -1;
        if (format[0] != '<') {
            PyErr_Format(PyExc_ValueError, "run %zd: expected a little-endian struct format ('<...'), got %s", r, format);
            return -1;
        }
        for (const char *c = format + 1; *c; c++) {
            int size = code_size(*c);
            if (size == 0) {
                PyErr_Format(PyExc_ValueError, "run %zd: struct code %c is not one PackedLaunch packs", r, *c);
                return -1;
            }
            if (self->codes_count >= MAX_PACKED_CODES || at < 0 || at > self->size - size) { /* no overflow */
                PyErr_Format(PyExc_ValueError, "run %zd: code %c at %zd outside the %zd-byte buffer", r, *c, at, self->size);
                return -1;
            }
            self->codes[self->codes_count] = *c;
            self->places[self->codes_count++] = at;
            if (*c != 'x')
                self->values++;
            at += size;
        }
    }
    return 0;
}

/* PackedLaunch(launch_address, function, template, offsets, runs, failed=None): runs are
   (offset, format) pairs, each format a struct format of '<' and single codes (as
   ParamLayout.struct_for makes), where 'P' is a 'Q' whose value is an object's data_ptr();
   failed is called with a launch's non-zero status (it raises). */
static PyObject *packed_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *address_obj, *function_obj, *offsets_obj, *runs_obj, *failed = Py_None;
    Py_buffer template;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "PackedLaunch takes positional arguments only");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OOy*O!O!|O", &address_obj, &function_obj, &template, &PyTuple_Type, &offsets_obj,
                          &PyTuple_Type, &runs_obj, &failed))
        return NULL;
    PackedLaunch *self = (PackedLaunch *)type->tp_alloc(type, 0);
    if (self == NULL)
        goto failed;
    self->vectorcall = packed_vectorcall;
    if (failed != Py_None) {
        if (!PyCallable_Check(failed)) {
            PyErr_SetString(PyExc_TypeError, "failed: expected a callable or None");
            goto failed;
        }
        self->failed = Py_NewRef(failed);
    }
    void *address;
    if (as_pointer(address_obj, &address, "launch address") < 0 || as_pointer(function_obj, &self->function, "function") < 0)
        goto failed;
    if (address == NULL) {
        PyErr_SetString(PyExc_ValueError, "launch address: expected the vendor launch's address, got 0");
        goto failed;
    }
    self->call = (kernel_launch_fn)address;
    self->size = template.len;
    self->template = PyMem_Malloc(template.len > 0 ? (size_t)template.len : 1);
    self->count = PyTuple_GET_SIZE(offsets_obj);
    self->offsets = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(self->count > 0 ? self->count : 1));
    self->codes = PyMem_Malloc(MAX_PACKED_CODES);
    self->places = PyMem_Malloc(sizeof(Py_ssize_t) * MAX_PACKED_CODES);
    if (self->template == NULL || self->offsets == NULL || self->codes == NULL || self->places == NULL) {
        PyErr_NoMemory();
        goto failed;
    }
    memcpy(self->template, template.buf, (size_t)template.len);
    if (read_offsets(self, offsets_obj) < 0 || read_runs(self, runs_obj) < 0)
        goto failed;
    PyBuffer_Release(&template);
    return (PyObject *)self;
failed:
    PyBuffer_Release(&template);
    Py_XDECREF(self);
    return NULL;
}

/* An integer the way struct's get_pylong takes it: an int, or an object with __index__. */
static PyObject *struct_integer(PyObject *value) {
    if (PyLong_Check(value))
        return Py_NewRef(value);
    if (PyIndex_Check(value))
        return PyNumber_Index(value);
    PyErr_SetString(STRUCT_ERROR, "required argument is not an integer");
    return NULL;
}

static int pack_integer(char code, PyObject *value, char *place) {
    PyObject *number = struct_integer(value);
    if (number == NULL)
        return -1;
    int is_signed = code == 'b' || code == 'h' || code == 'i' || code == 'l' || code == 'q';
    int size = code_size(code);
    unsigned long long bits;
    if (is_signed) {
        long long x = PyLong_AsLongLong(number);
        Py_DECREF(number);
        if (x == -1 && PyErr_Occurred())
            goto out_of_range;
        if (size < 8) {
            long long limit = 1LL << (8 * size - 1);
            if (x < -limit || x >= limit)
                goto out_of_range;
        }
        bits = (unsigned long long)x;
    } else {
        unsigned long long x = PyLong_AsUnsignedLongLong(number);
        Py_DECREF(number);
        if (x == (unsigned long long)-1 && PyErr_Occurred())
            goto out_of_range;
        if (size < 8 && x >= (1ULL << (8 * size)))
            goto out_of_range;
        bits = x;
    }
    memcpy(place, &bits, (size_t)size); /* little-endian: the low bytes first */
    return 0;
out_of_range:
    PyErr_Clear();
    PyErr_Format(STRUCT_ERROR, "argument out of range for struct code '%c'", code);
    return -1;
}

static int pack_one(char code, PyObject *value, char *place) {
    double x;
    switch (code) {
    case '?': {
        int truth = PyObject_IsTrue(value);
        if (truth < 0)
            return -1;
        *place = (char)(truth ? 1 : 0);
        return 0;
    }
    case 'e': case 'f': case 'd':
        x = PyFloat_AsDouble(value);
        if (x == -1.0 && PyErr_Occurred()) {
            PyErr_SetString(STRUCT_ERROR, "required argument is not a float");
            return -1;
        }
#if PY_VERSION_HEX >= 0x030B0000
        return code == 'e' ? PyFloat_Pack2(x, place, 1) : code == 'f' ? PyFloat_Pack4(x, place, 1) : PyFloat_Pack8(x, place, 1);
#else
        return code == 'e' ? _PyFloat_Pack2(x, (unsigned char *)place, 1)
               : code == 'f' ? _PyFloat_Pack4(x, (unsigned char *)place, 1)
                             : _PyFloat_Pack8(x, (unsigned char *)place, 1);
#endif
    case 'P': { /* a tensor's data pointer, packed as 'Q' (what value.data_ptr() returns) */
        uint64_t address;
        if (DATA_POINTER_READER != NULL && DATA_POINTER_READER(value, &address)) {
            memcpy(place, &address, sizeof address);
            return 0;
        }
        PyObject *pointer = PyObject_CallMethodNoArgs(value, S_DATA_PTR);
        if (pointer == NULL)
            return -1;
        int status = pack_integer('Q', pointer, place);
        Py_DECREF(pointer);
        return status;
    }
    default:
        return pack_integer(code, value, place);
    }
}

/* The launch itself: pack, launch, and return the launch's (status,), or with `reporting`
 * the packed parameter bytes (the recording path reports them: codegen.CallState._report),
 * a refused launch raising there even without `failed`. */
static PyObject *packed_run(PackedLaunch *self, PyObject *const *args, Py_ssize_t count, int reporting,
                            int *launched) {
    static const char *const names[] = {"grid x", "grid y", "grid z", "block x", "block y", "block z", "shared bytes"};
    unsigned dims[7];
    void *stream;
    if (check_count(count, 8 + self->values) < 0)
        return NULL;
    for (int i = 0; i < 7; i++)
        if (as_unsigned(args[i], &dims[i], names[i]) < 0)
            return NULL;
    if (as_pointer(args[7], &stream, "stream") < 0)
        return NULL;
    char small[512];
    void *small_params[64];
    char *buffer = self->size <= (Py_ssize_t)sizeof(small) ? small : PyMem_Malloc((size_t)self->size);
    void **params = self->count <= 64 ? small_params : PyMem_Malloc(sizeof(void *) * (size_t)self->count);
    PyObject *result = NULL;
    if (buffer == NULL || params == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(buffer, self->template, (size_t)self->size);
    Py_ssize_t value = 8;
    for (Py_ssize_t i = 0; i < self->codes_count; i++) {
        char code = self->codes[i];
        if (code == 'x')
            continue;
        PyObject *item = args[value++];
        if (pack_one(code, item, buffer + self->places[i]) < 0) {
            if (PyLong_Check(item) && PyErr_ExceptionMatches(PyExc_OverflowError)) /* as struct's pack does */
                PyErr_SetString(STRUCT_ERROR, "int too large to convert");
            goto done;
        }
    }
    if (launched != NULL)
        *launched = dims[0] != 0 && dims[1] != 0 && dims[2] != 0;
    if (dims[0] == 0 || dims[1] == 0 || dims[2] == 0) { /* an empty launch: nothing to run */
        result = reporting ? PyBytes_FromStringAndSize(buffer, self->size) : status_tuple(0);
        goto done;
    }
    for (Py_ssize_t i = 0; i < self->count; i++)
        params[i] = buffer + self->offsets[i];
    int status;
    kernel_launch_fn call = self->call;
    void *function = self->function;
    Py_BEGIN_ALLOW_THREADS
    status = call(function, dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], stream,
                  self->count ? params : NULL, NULL);
    Py_END_ALLOW_THREADS
    if (status != 0 && self->failed != NULL) { /* the backend's error for the status */
        PyObject *code = PyLong_FromLong(status);
        PyObject *raised = code == NULL ? NULL : PyObject_CallOneArg(self->failed, code);
        Py_XDECREF(code);
        if (raised == NULL)
            goto done;
        Py_DECREF(raised);
    }
    if (!reporting)
        result = status_tuple(status);
    else if (status != 0)
        PyErr_Format(PyExc_RuntimeError, "the kernel launch failed with status %d", status);
    else
        result = PyBytes_FromStringAndSize(buffer, self->size);
done:
    if (buffer != small)
        PyMem_Free(buffer);
    if (params != small_params)
        PyMem_Free(params);
    return result;
}

static PyObject *packed_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames)) {
        PyErr_SetString(PyExc_TypeError, "a packed launch takes positional arguments only");
        return NULL;
    }
    return packed_run((PackedLaunch *)callable, args, PyVectorcall_NARGS(nargsf), 0, NULL);
}

/* launcher.reporting(*the call's arguments): the same launch, returning the bytes it packed. */
static PyObject *packed_reporting(PyObject *self, PyObject *const *args, Py_ssize_t count) {
    return packed_run((PackedLaunch *)self, args, count, 1, NULL);
}

/* --- the capture query and the node reads as objects ----------------------------------------
 *
 * CaptureTail: the capture query (cuStreamGetCaptureInfo_v2) with the backend's answer made
 * in C: tail(stream) -> the node handles the stream's next node would depend on, while it
 * captures (status 0 and the capture status `active`), else None. A recording asks it after
 * every launch; PackedLaunch.recorded calls it directly where a sink's tail is one, so no
 * Python runs for the query.
 *
 * NodeReads: a graph's nodes, their types and kernel nodes' parameters read in one call, the
 * driver calls made with the GIL released once for all of them (see node_reads_call). */

typedef struct {
    PyObject_HEAD
    capture_info_fn call;
    int active;
    vectorcallfunc vectorcall;
} CaptureTail;

/* 1 with the dependencies where the stream captures, 0 where it does not (or the query failed). */
static int tail_query(CaptureTail *self, void *stream, void *const **dependencies, size_t *count) {
    void *graph = NULL;
    unsigned long long capture_id = 0;
    int status, capture_status = 0;
    capture_info_fn call = self->call;
    *dependencies = NULL;
    *count = 0;
    Py_BEGIN_ALLOW_THREADS
    status = call(stream, &capture_status, &capture_id, &graph, dependencies, count);
    Py_END_ALLOW_THREADS
    if (status != 0 || capture_status != self->active)
        return 0;
    if (*dependencies == NULL)
        *count = 0;
    return 1;
}

static PyObject *capture_tail_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    void *stream;
    void *const *dependencies;
    size_t count;
    if ((kwnames != NULL && PyTuple_GET_SIZE(kwnames)) || check_count(PyVectorcall_NARGS(nargsf), 1) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "a capture tail takes the stream, positionally");
        return NULL;
    }
    if (as_pointer(args[0], &stream, "stream") < 0)
        return NULL;
    if (!tail_query((CaptureTail *)callable, stream, &dependencies, &count))
        Py_RETURN_NONE;
    if (count > (size_t)PY_SSIZE_T_MAX) {
        PyErr_SetString(PyExc_OverflowError, "capture tail: more dependencies than a tuple holds");
        return NULL;
    }
    PyObject *nodes = PyTuple_New((Py_ssize_t)count);
    for (size_t i = 0; nodes != NULL && i < count; i++) {
        PyObject *node = PyLong_FromVoidPtr(dependencies[i]);
        if (node == NULL)
            Py_CLEAR(nodes);
        else
            PyTuple_SET_ITEM(nodes, (Py_ssize_t)i, node);
    }
    return nodes;
}

/* CaptureTail(address, active): address is the driver's capture query, active the capture
   status that means "capturing". */
static PyObject *capture_tail_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *address_obj;
    int active;
    void *address;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "CaptureTail takes positional arguments only");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "Oi", &address_obj, &active) || as_pointer(address_obj, &address, "address") < 0)
        return NULL;
    if (address == NULL) {
        PyErr_SetString(PyExc_ValueError, "CaptureTail: address must not be 0");
        return NULL;
    }
    CaptureTail *self = (CaptureTail *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->call = (capture_info_fn)address;
    self->active = active;
    self->vectorcall = capture_tail_vectorcall;
    return (PyObject *)self;
}

static PyTypeObject CaptureTailType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "jitcore.backends._native.CaptureTail",
    .tp_basicsize = sizeof(CaptureTail),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(CaptureTail, vectorcall),
    .tp_doc = "CaptureTail(address, active): tail(stream) -> the node handles a capturing stream's next node "
              "depends on, else None (see csrc/jitcore_native.c)",
    .tp_new = capture_tail_new,
    .tp_call = PyVectorcall_Call,
};

/* What one node read gave: its type, and a kernel node's parameter head. */
typedef struct {
    void *handle;
    int type;
    kernel_node_params_head head;
} node_fields;

typedef struct {
    PyObject_HEAD
    graph_get_nodes_fn get_nodes;
    node_get_type_fn get_type;
    kernel_node_get_params_fn get_params;
    int kernel;
} NodeReads;

/* Every node of the graph read into `fields` (the caller frees it with PyMem_RawFree): the status
   of the first read that failed (and `which`: 0 the nodes, 1 a type, 2 a kernel node's
   parameters), else 0 (`which` -1: out of memory). Runs without the GIL. */
static int read_nodes(NodeReads *self, void *graph, node_fields **fields, size_t *count, int *which) {
    size_t n = 0, filled;
    void **nodes = NULL;
    *fields = NULL, *count = 0, *which = 0;
    int status = self->get_nodes(graph, NULL, &n);
    if (status != 0 || n == 0)
        return status;
    if (n <= (size_t)PY_SSIZE_T_MAX / sizeof(node_fields)) {
        nodes = PyMem_RawMalloc(n * sizeof(void *));
        *fields = PyMem_RawCalloc(n, sizeof(node_fields));
    }
    if (nodes == NULL || *fields == NULL) {
        PyMem_RawFree(nodes);
        PyMem_RawFree(*fields);
        *fields = NULL, *which = -1;
        return 0;
    }
    filled = n;
    status = self->get_nodes(graph, nodes, &filled);
    if (filled > n) /* the graph grew in between: the handles asked for room for */
        filled = n;
    for (size_t i = 0; status == 0 && i < filled; i++) {
        node_fields *f = &(*fields)[i];
        f->handle = nodes[i];
        *which = 1;
        status = self->get_type(nodes[i], &f->type);
        if (status == 0 && f->type == self->kernel) {
            union {
                kernel_node_params_head head;
                unsigned char room[512];
            } params;
            memset(&params, 0, sizeof params);
            *which = 2;
            status = self->get_params(nodes[i], &params);
            f->head = params.head;
        }
    }
    PyMem_RawFree(nodes);
    if (status == 0)
        *which = 0, *count = filled;
    return status;
}

/* One node's row (see node_reads_call): a new tuple, or NULL with the error set. */
static PyObject *node_row(const node_fields *f, int kernel, PyObject *sizes) {
    PyObject *params = Py_NewRef(Py_None);
    if (f->type == kernel && sizes != Py_None) {
        PyObject *function = PyLong_FromVoidPtr(f->head.function);
        PyObject *found = function == NULL ? NULL : PyDict_GetItemWithError(sizes, function);
        Py_XDECREF(function);
        if (found == NULL && PyErr_Occurred())
            goto failed;
        if (found != NULL) {
            if (!PyTuple_Check(found)) {
                PyErr_SetString(PyExc_TypeError, "node reads: sizes must map each function to a tuple of ints");
                goto failed;
            }
            Py_SETREF(params, param_values((void *)f->head.kernel_params, found));
            if (params == NULL)
                return NULL;
        }
    }
    return Py_BuildValue("(NiKIIIIIIIKN)", PyLong_FromVoidPtr(f->handle), f->type,
                         (unsigned long long)(uintptr_t)f->head.function, f->head.grid_x, f->head.grid_y,
                         f->head.grid_z, f->head.block_x, f->head.block_y, f->head.block_z, f->head.shared_bytes,
                         (unsigned long long)(uintptr_t)f->head.kernel_params, params);
failed:
    Py_DECREF(params);
    return NULL;
}

/* reads(graph, sizes) -> (status, which read failed (0 the nodes, 1 a type, 2 a kernel node's
   parameters), rows): every node in the driver's order, each row (handle, type, function,
   grid x, y, z, block x, y, z, shared bytes, parameter array address, parameters): a kernel
   node's fields (zeros for other nodes), its parameters the bytes read_params gives for the
   sizes `sizes` (a dict {function: tuple of sizes}, or None) holds for its function, else
   None. () unless the status is 0. */
static PyObject *node_reads_call(PyObject *callable, PyObject *args, PyObject *kwargs) {
    NodeReads *self = (NodeReads *)callable;
    PyObject *graph_obj, *sizes;
    void *graph;
    node_fields *fields;
    size_t count;
    int status, which;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "node reads take positional arguments only");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OO", &graph_obj, &sizes) || as_pointer(graph_obj, &graph, "graph") < 0)
        return NULL;
    if (sizes != Py_None && !PyDict_Check(sizes)) {
        PyErr_SetString(PyExc_TypeError, "node reads: sizes must be a dict or None");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    status = read_nodes(self, graph, &fields, &count, &which);
    Py_END_ALLOW_THREADS
    if (which == -1)
        return PyErr_NoMemory();
    PyObject *rows = PyTuple_New(status == 0 ? (Py_ssize_t)count : 0);
    for (size_t i = 0; rows != NULL && status == 0 && i < count; i++) {
        PyObject *row = node_row(&fields[i], self->kernel, sizes);
        if (row == NULL)
            Py_CLEAR(rows);
        else
            PyTuple_SET_ITEM(rows, (Py_ssize_t)i, row);
    }
    PyMem_RawFree(fields);
    return rows == NULL ? NULL : Py_BuildValue("(iiN)", status, which, rows);
}

/* NodeReads(get_nodes, get_type, get_params, kernel): the driver's cuGraphGetNodes,
   cuGraphNodeGetType and cuGraphKernelNodeGetParams_v2 (their addresses), and the node type of
   a kernel node. */
static PyObject *node_reads_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *addresses[3];
    void *pointers[3];
    int kernel;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "NodeReads takes positional arguments only");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OOOi", &addresses[0], &addresses[1], &addresses[2], &kernel))
        return NULL;
    for (int i = 0; i < 3; i++) {
        if (as_pointer(addresses[i], &pointers[i], "NodeReads: address") < 0)
            return NULL;
        if (pointers[i] == NULL) {
            PyErr_SetString(PyExc_ValueError, "NodeReads: an address must not be 0");
            return NULL;
        }
    }
    NodeReads *self = (NodeReads *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->get_nodes = (graph_get_nodes_fn)pointers[0];
    self->get_type = (node_get_type_fn)pointers[1];
    self->get_params = (kernel_node_get_params_fn)pointers[2];
    self->kernel = kernel;
    return (PyObject *)self;
}

static PyTypeObject NodeReadsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "jitcore.backends._native.NodeReads",
    .tp_basicsize = sizeof(NodeReads),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "NodeReads(get_nodes, get_type, get_params, kernel): reads(graph, sizes) -> (status, which read failed, "
              "rows): every node of a graph in one call (see csrc/jitcore_native.c)",
    .tp_new = node_reads_new,
    .tp_call = node_reads_call,
};

/* --- launch records made beside the launch ----------------------------------------------------
 *
 * A recording (replay's capture) hears of every launch a call state makes. Made in Python, each
 * launch's record costs more than the launch itself; here the record is a copy of a template the
 * call state made once (jitcore.recorder.LaunchRecord, every field that does not change from call
 * to call written), with the call's own fields filled in: its grid, block, shared bytes, the
 * parameter bytes packed, its arguments as passed, its stream and whether it launched. Which
 * fields those are is told once by use_launch_record (from jitcore.codegen). */

enum { RECORD_GRID, RECORD_BLOCK, RECORD_SHARED, RECORD_BYTES, RECORD_ARGS, RECORD_STREAM, RECORD_LAUNCHED,
       RECORD_CALL_FIELDS };
static PyTypeObject *RECORD_TYPE; /* LaunchRecord, once told */
static Py_ssize_t RECORD_FIELD[RECORD_CALL_FIELDS];

/* use_launch_record(record_type, positions): the record class (a tuple subclass) and where its
   per-call fields sit, in the order grid, block, shared bytes, parameter bytes, arguments, stream,
   launched. */
static PyObject *use_launch_record(PyObject *module, PyObject *const *args, Py_ssize_t count) {
    Py_ssize_t positions[RECORD_CALL_FIELDS];
    if (check_count(count, 2) < 0)
        return NULL;
    if (!PyType_Check(args[0]) || !PyType_IsSubtype((PyTypeObject *)args[0], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "use_launch_record: record_type must be a tuple subclass");
        return NULL;
    }
    if (!PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != RECORD_CALL_FIELDS) {
        PyErr_Format(PyExc_TypeError, "use_launch_record: positions must be a tuple of %d ints", RECORD_CALL_FIELDS);
        return NULL;
    }
    for (int i = 0; i < RECORD_CALL_FIELDS; i++) {
        positions[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[1], i));
        if (positions[i] == -1 && PyErr_Occurred())
            return NULL;
        if (positions[i] < 0 || positions[i] > 255) {
            PyErr_Format(PyExc_ValueError, "use_launch_record: position %zd outside 0..255", positions[i]);
            return NULL;
        }
    }
    PyTypeObject *previous = RECORD_TYPE;
    RECORD_TYPE = (PyTypeObject *)Py_NewRef(args[0]);
    memcpy(RECORD_FIELD, positions, sizeof positions);
    Py_XDECREF(previous);
    Py_RETURN_NONE;
}

/* A copy of the template with the call's fields: a new reference, or NULL with the error set. */
static PyObject *record_from(PyObject *template, PyObject *const call[RECORD_CALL_FIELDS]) {
    Py_ssize_t size = PyTuple_GET_SIZE(template);
    PyObject *record = Py_TYPE(template)->tp_alloc(Py_TYPE(template), size);
    if (record == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < size; i++)
        PyTuple_SET_ITEM(record, i, Py_NewRef(PyTuple_GET_ITEM(template, i)));
    for (int f = 0; f < RECORD_CALL_FIELDS; f++) {
        PyObject *old = PyTuple_GET_ITEM(record, RECORD_FIELD[f]);
        PyTuple_SET_ITEM(record, RECORD_FIELD[f], Py_NewRef(call[f]));
        Py_DECREF(old);
    }
    return record;
}

/* The graph node a launch became, as the sink's tail says: its only item, else None. */
static PyObject *tail_node(PyObject *tail, PyObject *stream) {
    if (Py_TYPE(tail) == &CaptureTailType) { /* the query made here, no Python call */
        void *raw;
        void *const *dependencies;
        size_t count;
        if (as_pointer(stream, &raw, "stream") < 0)
            return NULL;
        if (tail_query((CaptureTail *)tail, raw, &dependencies, &count) && count == 1)
            return PyLong_FromVoidPtr(dependencies[0]);
        Py_RETURN_NONE;
    }
    PyObject *nodes = PyObject_CallOneArg(tail, stream);
    if (nodes == NULL || nodes == Py_None)
        return nodes;
    Py_ssize_t length = PyObject_Length(nodes);
    PyObject *node = length < 0 ? NULL : length == 1 ? PySequence_GetItem(nodes, 0) : Py_NewRef(Py_None);
    Py_DECREF(nodes);
    return node;
}

/* The sink's parts: (records list, nodes list or None, tail callable or None). */
static int sink_parts(PyObject *sink, PyObject **records, PyObject **nodes, PyObject **tail) {
    if (!PyTuple_Check(sink) || PyTuple_GET_SIZE(sink) != 3) {
        PyErr_SetString(PyExc_TypeError, "recorded: sink must be a (records, nodes, tail) tuple");
        return -1;
    }
    *records = PyTuple_GET_ITEM(sink, 0);
    *nodes = PyTuple_GET_ITEM(sink, 1);
    *tail = PyTuple_GET_ITEM(sink, 2);
    if (!PyList_Check(*records) || (*nodes != Py_None && !PyList_Check(*nodes)) ||
        (*tail != Py_None && !PyCallable_Check(*tail))) {
        PyErr_SetString(PyExc_TypeError, "recorded: sink must hold a list, a list or None, a callable or None");
        return -1;
    }
    return 0;
}

/* A template the call's fields can be written into: an instance of the told record class. */
static int check_template(PyObject *template) {
    if (RECORD_TYPE == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "recorded: no launch record class told (use_launch_record)");
        return -1;
    }
    if (Py_TYPE(template) != RECORD_TYPE) {
        PyErr_Format(PyExc_TypeError, "recorded: template must be a %s", RECORD_TYPE->tp_name);
        return -1;
    }
    for (int f = 0; f < RECORD_CALL_FIELDS; f++)
        if (RECORD_FIELD[f] >= PyTuple_GET_SIZE(template)) {
            PyErr_SetString(PyExc_ValueError, "recorded: the template has fewer fields than use_launch_record said");
            return -1;
        }
    return 0;
}

/* Append the launch's record, and the node it became, to the sink (both checked again: the
   launch let other threads run, which may have told another record class). */
static int report_launch(PyObject *sink, PyObject *template, PyObject *const call[RECORD_CALL_FIELDS]) {
    PyObject *records, *nodes, *tail, *node = Py_NewRef(Py_None);
    if (sink_parts(sink, &records, &nodes, &tail) < 0 || check_template(template) < 0)
        goto failed;
    PyObject *record = record_from(template, call);
    if (record == NULL)
        goto failed;
    int appended = PyList_Append(records, record);
    Py_DECREF(record);
    if (appended < 0 || nodes == Py_None)
        goto done;
    if (call[RECORD_LAUNCHED] == Py_True && tail != Py_None) {
        Py_DECREF(node);
        node = tail_node(tail, call[RECORD_STREAM]);
        if (node == NULL)
            return -1;
    }
    appended = PyList_Append(nodes, node);
done:
    Py_DECREF(node);
    return appended;
failed:
    Py_DECREF(node);
    return -1;
}

/* launcher.recorded(sink, template, original, gx, gy, gz, bx, by, bz, shared, stream, *values): the
   launch, then its record (the template with this call's fields; `original`, the call's arguments
   as passed) appended to the sink's records, and the node `tail(stream)` names (None for an empty
   launch) to its nodes. The sink and the template are checked before anything is launched. */
static PyObject *packed_recorded(PyObject *self, PyObject *const *args, Py_ssize_t count) {
    PyObject *records, *nodes, *tail;
    int launched = 0;
    if (count < 11) {
        PyErr_Format(PyExc_TypeError, "recorded: expected at least 11 arguments, got %zd", count);
        return NULL;
    }
    if (sink_parts(args[0], &records, &nodes, &tail) < 0 || check_template(args[1]) < 0)
        return NULL;
    PyObject *bytes = packed_run((PackedLaunch *)self, args + 3, count - 3, 1, &launched);
    if (bytes == NULL)
        return NULL;
    PyObject *grid = PyTuple_Pack(3, args[3], args[4], args[5]);
    PyObject *block = PyTuple_Pack(3, args[6], args[7], args[8]);
    int reported = -1;
    if (grid != NULL && block != NULL) {
        PyObject *const call[RECORD_CALL_FIELDS] = {grid, block, args[9], bytes, args[2], args[10],
                                                    launched ? Py_True : Py_False};
        reported = report_launch(args[0], args[1], call);
    }
    Py_XDECREF(grid);
    Py_XDECREF(block);
    Py_DECREF(bytes);
    if (reported < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* Whether an argument stays in a kept record: exact ints and floats, instances of `kept`, and
   objects with `attribute` (replay.recording.scalar_or_none's rule); 1, 0, or -1 with the error
   set. Exact instances of `dropped` (tensors, most arguments) are answered first. */
static int argument_kept(PyObject *value, PyObject *dropped, PyObject *kept, PyObject *attribute) {
    if ((PyObject *)Py_TYPE(value) == dropped)
        return 0;
    if (PyLong_CheckExact(value) || PyFloat_CheckExact(value))
        return 1;
    int is = PyObject_IsInstance(value, kept);
    if (is != 0)
        return is;
    PyObject *found = PyObject_GetAttr(value, attribute);
    if (found != NULL) {
        Py_DECREF(found);
        return 1;
    }
    if (!PyErr_ExceptionMatches(PyExc_AttributeError))
        return -1;
    PyErr_Clear();
    return 0;
}

/* A copy of `record` (a tuple, of its own class) with its arguments at `position` kept or None. */
static PyObject *record_without(PyObject *record, Py_ssize_t position, PyObject *dropped, PyObject *kept,
                                PyObject *attribute) {
    if (!PyTuple_Check(record) || position >= PyTuple_GET_SIZE(record) ||
        !PyTuple_Check(PyTuple_GET_ITEM(record, position))) {
        PyErr_SetString(PyExc_TypeError, "without_tensors: each record must be a tuple holding a tuple at position");
        return NULL;
    }
    PyObject *args = PyTuple_GET_ITEM(record, position);
    Py_ssize_t count = PyTuple_GET_SIZE(args), size = PyTuple_GET_SIZE(record);
    PyObject *stripped = PyTuple_New(count);
    if (stripped == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *value = PyTuple_GET_ITEM(args, i);
        int keep = argument_kept(value, dropped, kept, attribute);
        if (keep < 0) {
            Py_DECREF(stripped);
            return NULL;
        }
        PyTuple_SET_ITEM(stripped, i, Py_NewRef(keep ? value : Py_None));
    }
    PyObject *copy = Py_TYPE(record)->tp_alloc(Py_TYPE(record), size);
    if (copy == NULL) {
        Py_DECREF(stripped);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < size; i++)
        PyTuple_SET_ITEM(copy, i, i == position ? stripped : Py_NewRef(PyTuple_GET_ITEM(record, i)));
    return copy;
}

/* without_tensors(records, position, dropped, kept, attribute) -> list: each record (a tuple
   whose item `position` is its launch's arguments) copied with only the arguments analysis
   keeps, the others None (see argument_kept): a recording's records, which must not hold its
   tensors once it ends. */
static PyObject *without_tensors(PyObject *module, PyObject *const *args, Py_ssize_t count) {
    if (check_count(count, 5) < 0)
        return NULL;
    Py_ssize_t position = PyLong_AsSsize_t(args[1]);
    if (position == -1 && PyErr_Occurred())
        return NULL;
    if (position < 0 || !PyList_Check(args[0]) || !PyType_Check(args[2]) || !PyUnicode_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "without_tensors(records list, position >= 0, dropped type, kept types, attribute name)");
        return NULL;
    }
    PyObject *records = PySequence_Tuple(args[0]); /* a copy: the caller's list may change */
    if (records == NULL)
        return NULL;
    PyObject *result = PyList_New(0);
    for (Py_ssize_t i = 0; result != NULL && i < PyTuple_GET_SIZE(records); i++) {
        PyObject *copy = record_without(PyTuple_GET_ITEM(records, i), position, args[2], args[3], args[4]);
        if (copy == NULL || PyList_Append(result, copy) < 0)
            Py_CLEAR(result);
        Py_XDECREF(copy);
    }
    Py_DECREF(records);
    return result;
}

static PyMethodDef packed_methods[] = {
    {"reporting", (PyCFunction)(void (*)(void))packed_reporting, METH_FASTCALL,
     "reporting(gx, gy, gz, bx, by, bz, shared, stream, *values): the same launch, returning the parameter "
     "bytes it packed (a launch the driver refused raises)"},
    {"recorded", (PyCFunction)(void (*)(void))packed_recorded, METH_FASTCALL,
     "recorded(sink, template, original, gx, gy, gz, bx, by, bz, shared, stream, *values): the same launch, its "
     "record appended to the sink (see the module source)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PackedLaunchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "jitcore.backends._native.PackedLaunch",
    .tp_basicsize = sizeof(PackedLaunch),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(PackedLaunch, vectorcall),
    .tp_doc = "PackedLaunch(launch_address, function, template, offsets, runs, failed=None): a kernel launch "
              "that packs its own parameters (see csrc/jitcore_native.c)",
    .tp_new = packed_new,
    .tp_methods = packed_methods,
    .tp_dealloc = (destructor)packed_dealloc,
    .tp_call = PyVectorcall_Call,
};

/* A launch that runs nothing and succeeds: what the null backend (jitcore.backends.null) puts
   behind a PackedLaunch, so that CPU tests and benchmarks run the C packing and a recording's
   launch records without a driver. Exported as NULL_LAUNCH, its address. */
static int null_kernel_launch(void *function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                              unsigned block_y, unsigned block_z, unsigned shared_bytes, void *stream, void **params,
                              void **extra) {
    (void)function, (void)grid_x, (void)grid_y, (void)grid_z, (void)block_x, (void)block_y, (void)block_z;
    (void)shared_bytes, (void)stream, (void)params, (void)extra;
    return 0;
}

/* A capture query that answers "not capturing": what the null backend puts behind a CaptureTail,
   so that CPU benchmarks of a recording's launches ask the tail from C as the CUDA backend's do.
   Exported as NULL_CAPTURE_INFO, its address. */
static int null_capture_info(void *stream, int *capture_status, unsigned long long *capture_id, void **graph,
                             void *const **dependencies, size_t *dependency_count) {
    (void)stream, (void)capture_id, (void)graph;
    *capture_status = 0;
    *dependencies = NULL;
    *dependency_count = 0;
    return 0;
}

/* use_data_pointer_reader(capsule or None): the reader 'P' tries first (None: the method only). */
static PyObject *use_data_pointer_reader(PyObject *module, PyObject *capsule) {
    data_pointer_reader_fn reader = NULL;
    if (capsule != Py_None) {
        reader = (data_pointer_reader_fn)PyCapsule_GetPointer(capsule, DATA_POINTER_READER_NAME);
        if (reader == NULL)
            return NULL;
    }
    PyObject *previous = DATA_POINTER_READER_OWNER;
    Py_INCREF(capsule);
    DATA_POINTER_READER = reader;
    DATA_POINTER_READER_OWNER = capsule;
    Py_XDECREF(previous);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"use_data_pointer_reader", use_data_pointer_reader, METH_O,
     "use_data_pointer_reader(capsule or None): how 'P' reads a tensor's data pointer (see the module source)"},
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(kind, name, address) -> function calling the vendor function at address (see the module source)"},
    {"without_tensors", (PyCFunction)(void (*)(void))without_tensors, METH_FASTCALL,
     "without_tensors(records, position, dropped, kept, attribute) -> the records with only the arguments kept "
     "(see the module source)"},
    {"use_launch_record", (PyCFunction)(void (*)(void))use_launch_record, METH_FASTCALL,
     "use_launch_record(record_type, positions): the launch record class PackedLaunch.recorded makes, and where "
     "its per-call fields sit"},
    {"read_params", (PyCFunction)(void (*)(void))read_params, METH_FASTCALL,
     "read_params(address, sizes) -> the bytes each pointer of a kernel-parameter array points to"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT, "jitcore.backends._native",
    "Driver calls from C for the hot paths (see csrc/jitcore_native.c).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *module;
    SUCCESS = Py_BuildValue("(i)", 0);
    if (SUCCESS == NULL)
        return NULL;
    module = PyModule_Create(&module_definition);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObject(module, "SUCCESS", SUCCESS) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(SUCCESS);
    PyObject *struct_module = PyImport_ImportModule("struct");
    if (struct_module == NULL) {
        Py_DECREF(module);
        return NULL;
    }
    STRUCT_ERROR = PyObject_GetAttrString(struct_module, "error");
    Py_DECREF(struct_module);
    S_DATA_PTR = PyUnicode_InternFromString("data_ptr");
    if (STRUCT_ERROR == NULL || S_DATA_PTR == NULL || PyType_Ready(&PackedLaunchType) < 0 ||
        PyType_Ready(&CaptureTailType) < 0 || PyType_Ready(&NodeReadsType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    if (PyModule_AddObject(module, "NULL_LAUNCH", PyLong_FromVoidPtr((void *)(uintptr_t)null_kernel_launch)) < 0 ||
        PyModule_AddObject(module, "NULL_CAPTURE_INFO", PyLong_FromVoidPtr((void *)(uintptr_t)null_capture_info)) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "PackedLaunch", (PyObject *)&PackedLaunchType) < 0 ||
        PyModule_AddObjectRef(module, "CaptureTail", (PyObject *)&CaptureTailType) < 0 ||
        PyModule_AddObjectRef(module, "NodeReads", (PyObject *)&NodeReadsType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
