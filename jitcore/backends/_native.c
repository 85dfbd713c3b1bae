/*
 * jitcore.backends._native: three driver calls made from C instead of through a binding.
 *
 * Why: a cache-hit launch and a replay are one or two driver calls each, and from Python the
 * binding's own argument conversion costs about as much as the driver (cuda-bindings'
 * prepacked cuLaunchKernel takes 4.5-5 us on the H200 machine; the driver itself about half
 * of that). These functions take the same arguments as the binding's calls (raw handles as
 * ints, or objects that int() converts), call the vendor function through a pointer the
 * backend resolved, and return what the binding returns: a tuple whose first item is the
 * status, so generated code runs unchanged on either path.
 *
 * Vendor-neutral: nothing here includes a vendor header. The three prototypes are the ones
 * cuLaunchKernel / hipModuleLaunchKernel, cuGraphLaunch / hipGraphLaunch and
 * cuGraphExecKernelNodeSetParams / hipGraphExecKernelNodeSetParams share (every handle a
 * pointer, every dimension an unsigned int, the status an int enum). Which function a pointer
 * names, and that it matches its prototype, is the backend module's business.
 *
 * The GIL is released around each driver call, as the bindings do: a launch blocks while the
 * device's launch queue is full.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

typedef int (*kernel_launch_fn)(void *function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                                unsigned block_x, unsigned block_y, unsigned block_z,
                                unsigned shared_bytes, void *stream, void **params, void **extra);
typedef int (*graph_launch_fn)(void *graph_exec, void *stream);
typedef int (*node_set_fn)(void *graph_exec, void *node, const void *node_params);

static PyObject *SUCCESS; /* (0,): what every successful call returns, built once */

/* A handle or address: an int from 0 to 2**64-1 (the fast path), None (NULL), or an object
   int() converts (a binding's handle object). */
static int as_pointer(PyObject *value, void **out, const char *what) {
    unsigned long long wide;
    if (PyLong_CheckExact(value)) {
        wide = PyLong_AsUnsignedLongLong(value);
    } else if (value == Py_None) {
        *out = NULL;
        return 0;
    } else {
        PyObject *number = PyNumber_Long(value);
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
    address = PyLong_AsVoidPtr(args[2]);
    if (address == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "bind: address must not be 0");
        return NULL;
    }
    if (strcmp(kind, "kernel_launch") == 0)
        implementation = (PyCFunction)(void (*)(void))kernel_launch;
    else if (strcmp(kind, "graph_launch") == 0)
        implementation = (PyCFunction)(void (*)(void))graph_launch;
    else if (strcmp(kind, "kernel_node_set") == 0)
        implementation = (PyCFunction)(void (*)(void))node_set;
    else {
        PyErr_Format(PyExc_ValueError, "bind: kind must be kernel_launch, graph_launch or kernel_node_set, got %s",
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

static PyMethodDef module_methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(kind, name, address) -> function calling the vendor function at address (see the module source)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT, "jitcore.backends._native",
    "Driver calls from C for the hot paths (see jitcore/backends/_native.c).", -1, module_methods,
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
    return module;
}
