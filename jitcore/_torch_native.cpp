// The torch-side native helper: what a hit path reads from tensors, read through torch's C++
// API instead of Python calls. Built against the installed torch by jitcore/torch_native.py
// (its C++ ABI is that torch's alone, so it is compiled per torch build and cached, never
// shipped). Two things, both optional (Python does the same where it is not built):
//
// - tensor_guard(examples, sizes, strides): a check(*tensors) -> bool with the semantics of
//   torch's dynamo TensorGuards (torch/csrc/dynamo/guards.cpp, TensorCheck): the Python type,
//   the dispatch key set with this thread's included and excluded keys applied, dtype, device
//   index, requires_grad, the number of dimensions and every size and stride given (None: not
//   checked), and no tensor passed twice. It never masks keys that torch's may mask, so it
//   says yes only where torch's would. About 60 to 100 ns for three tensors on the CPU
//   machine, against 380 to 650 for torch's (which builds a LocalState, a hash set of the
//   arguments and reads symbolic sizes).
// - a capsule, "data_pointer_reader", with int read(PyObject *, uint64_t *): a plain tensor's
//   data_ptr() without the Python method call (about 20 ns against 130), for the C launch
//   helper's 'P' code. It answers 0 (not read: call the method) for anything but a
//   torch.Tensor or Parameter, while a torch function mode is active (the method would go to
//   the mode), and where torch throws (the method raises the same error properly).
//
// Every entry point catches C++ exceptions: a check that cannot read a tensor says no.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/Tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

struct Expectation {
    PyTypeObject *type;
    uint64_t keys;  // the dispatch key set with the building thread's included/excluded applied
    c10::ScalarType dtype;
    c10::DeviceIndex device_index;
    bool requires_grad;
    std::vector<std::optional<int64_t>> sizes, strides;  // one per dimension
};

struct Guard {
    std::vector<Expectation> tensors;
    // a reference to each example's type, so that no other type can take its address
    ~Guard() {
        for (const Expectation &expected : tensors)
            Py_DECREF(reinterpret_cast<PyObject *>(expected.type));
    }
};

uint64_t applied_keys(const at::Tensor &tensor) {
    c10::impl::LocalDispatchKeySet local = c10::impl::tls_local_dispatch_key_set();
    return ((tensor.key_set() | local.included_) - local.excluded_).raw_repr();
}

bool matches(const Expectation &expected, PyObject *object) {
    if (Py_TYPE(object) != expected.type)
        return false;
    const at::Tensor &tensor = THPVariable_Unpack(object);
    if (applied_keys(tensor) != expected.keys || tensor.scalar_type() != expected.dtype ||
        tensor.device().index() != expected.device_index || tensor.requires_grad() != expected.requires_grad)
        return false;
    size_t dims = expected.sizes.size();
    if (tensor.dim() != static_cast<int64_t>(dims))
        return false;
    // the keys matched a plain strided example's: sizes and strides are plain ints here (a
    // nested, sparse or symbolic tensor has other keys; torch throws if not, caught below)
    c10::IntArrayRef sizes = tensor.sizes(), strides = tensor.strides();
    for (size_t d = 0; d < dims; ++d) {
        if (expected.sizes[d] && *expected.sizes[d] != sizes[d])
            return false;
        if (expected.strides[d] && *expected.strides[d] != strides[d])
            return false;
    }
    return true;
}

// Whether no object is passed twice: torch's evaluator says no to one tensor given as two
// arguments (dynamo guards "x is y" elsewhere and relies on this for "x is not y"), and so
// does this one. A few arguments are compared pairwise, more through a sorted copy.
bool distinct(PyObject *const *args, Py_ssize_t count) {
    if (count <= 16) {
        for (Py_ssize_t i = 1; i < count; ++i)
            for (Py_ssize_t j = 0; j < i; ++j)
                if (args[i] == args[j])
                    return false;
        return true;
    }
    std::vector<PyObject *> sorted(args, args + count);
    std::sort(sorted.begin(), sorted.end());
    return std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
}

const char *GUARD_CAPSULE = "jitcore._torch_native.guard";

void guard_destructor(PyObject *capsule) {
    delete static_cast<Guard *>(PyCapsule_GetPointer(capsule, GUARD_CAPSULE));
}

PyObject *guard_check(PyObject *capsule, PyObject *const *args, Py_ssize_t count) {
    Guard *guard = static_cast<Guard *>(PyCapsule_GetPointer(capsule, GUARD_CAPSULE));
    if (guard == nullptr)
        return nullptr;
    if (static_cast<size_t>(count) != guard->tensors.size()) {
        PyErr_Format(PyExc_TypeError, "this tensor guard checks %zd tensors, got %zd",
                     static_cast<Py_ssize_t>(guard->tensors.size()), count);
        return nullptr;
    }
    try {
        for (Py_ssize_t i = 0; i < count; ++i)
            if (!matches(guard->tensors[i], args[i]))
                Py_RETURN_FALSE;
    } catch (...) {
        Py_RETURN_FALSE;
    }
    return PyBool_FromLong(distinct(args, count));
}

PyMethodDef GUARD_CHECK = {"check", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(guard_check)),
                           METH_FASTCALL, "check(*tensors) -> bool"};

// One optional int per dimension from a sequence of int or None.
bool optional_ints(PyObject *sequence, Py_ssize_t dims, std::vector<std::optional<int64_t>> &out, const char *what) {
    PyObject *items = PySequence_Fast(sequence, what);
    if (items == nullptr)
        return false;
    bool ok = PySequence_Fast_GET_SIZE(items) == dims;
    if (!ok)
        PyErr_Format(PyExc_ValueError, "%s: one entry per dimension (%zd)", what, dims);
    for (Py_ssize_t d = 0; ok && d < dims; ++d) {
        PyObject *item = PySequence_Fast_GET_ITEM(items, d);
        if (item == Py_None) {
            out.emplace_back(std::nullopt);
            continue;
        }
        long long value = PyLong_AsLongLong(item);
        ok = !(value == -1 && PyErr_Occurred());
        if (ok)
            out.emplace_back(static_cast<int64_t>(value));
    }
    Py_DECREF(items);
    return ok;
}

PyObject *tensor_guard(PyObject *, PyObject *args) {
    PyObject *examples, *sizes, *strides;
    if (!PyArg_ParseTuple(args, "O!O!O!:tensor_guard", &PyTuple_Type, &examples, &PyTuple_Type, &sizes,
                          &PyTuple_Type, &strides))
        return nullptr;
    Py_ssize_t count = PyTuple_GET_SIZE(examples);
    if (PyTuple_GET_SIZE(sizes) != count || PyTuple_GET_SIZE(strides) != count) {
        PyErr_SetString(PyExc_ValueError, "tensor_guard: one sizes and one strides entry per example");
        return nullptr;
    }
    Guard *guard = new Guard();
    try {
        for (Py_ssize_t i = 0; i < count; ++i) {
            PyObject *example = PyTuple_GET_ITEM(examples, i);
            if (!THPVariable_Check(example)) {
                PyErr_Format(PyExc_TypeError, "tensor_guard: example %zd is not a tensor", i);
                delete guard;
                return nullptr;
            }
            const at::Tensor &tensor = THPVariable_Unpack(example);
            if (tensor.layout() != c10::kStrided || tensor.is_nested()) {
                PyErr_Format(PyExc_ValueError, "tensor_guard: example %zd is not a plain strided tensor", i);
                delete guard;
                return nullptr;
            }
            Expectation expected{Py_TYPE(example), applied_keys(tensor), tensor.scalar_type(),
                                 tensor.device().index(), tensor.requires_grad(), {}, {}};
            Py_ssize_t dims = tensor.dim();
            if (!optional_ints(PyTuple_GET_ITEM(sizes, i), dims, expected.sizes, "tensor_guard sizes") ||
                !optional_ints(PyTuple_GET_ITEM(strides, i), dims, expected.strides, "tensor_guard strides")) {
                delete guard;
                return nullptr;
            }
            Py_INCREF(reinterpret_cast<PyObject *>(expected.type));
            guard->tensors.push_back(std::move(expected));
        }
    } catch (const std::exception &error) {
        delete guard;
        PyErr_Format(PyExc_ValueError, "tensor_guard: %s", error.what());
        return nullptr;
    }
    PyObject *capsule = PyCapsule_New(guard, GUARD_CAPSULE, guard_destructor);
    if (capsule == nullptr) {
        delete guard;
        return nullptr;
    }
    PyObject *check = PyCFunction_New(&GUARD_CHECK, capsule);  // the capsule is its self
    Py_DECREF(capsule);
    return check;
}

int read_data_pointer(PyObject *object, uint64_t *out) {
    if (!THPVariable_CheckExact(object) || at::impl::torch_function_mode_enabled())
        return 0;
    try {
        *out = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(THPVariable_Unpack(object).data_ptr()));
        return 1;
    } catch (...) {
        return 0;
    }
}

PyObject *data_pointer(PyObject *, PyObject *object) {
    uint64_t address;
    if (!read_data_pointer(object, &address))
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(address);
}

PyMethodDef METHODS[] = {
    {"tensor_guard", tensor_guard, METH_VARARGS,
     "tensor_guard(examples, sizes, strides) -> check(*tensors) -> bool, as torch's TensorGuards"},
    {"data_pointer", data_pointer, METH_O,
     "data_pointer(tensor) -> int, what the capsule's reader reads (None where it would not read)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_torch_native", nullptr, -1, METHODS};

}  // namespace

PyMODINIT_FUNC PyInit__torch_native(void) {
    PyObject *module = PyModule_Create(&MODULE);
    if (module == nullptr)
        return nullptr;
    PyObject *reader = PyCapsule_New(reinterpret_cast<void *>(read_data_pointer),
                                     "jitcore._torch_native.data_pointer_reader", nullptr);
    if (reader == nullptr || PyModule_AddObject(module, "data_pointer_reader", reader) < 0) {
        Py_XDECREF(reader);
        Py_DECREF(module);
        return nullptr;
    }
    if (PyModule_AddStringConstant(module, "TORCH_VERSION", TORCH_VERSION_FOR_CHECK) < 0) {
        Py_DECREF(module);
        return nullptr;
    }
    return module;
}
