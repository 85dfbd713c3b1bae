// The torch-side native helper: what the hot paths read from torch (tensors, its global
// settings), read through torch's C++ API instead of Python calls. Built against the installed
// torch by jitcore/torch_native.py (its C++ ABI is that torch's alone, so it is compiled per
// torch build and cached, never shipped). Three things, each optional (Python does the same
// where it is not built):
//
// - tensor_guard(examples, sizes, strides): a check(*tensors) -> bool with the semantics of
//   torch's dynamo TensorGuards (torch/csrc/dynamo/guards.cpp, TensorCheck): the Python type,
//   the dispatch key set with this thread's included and excluded keys applied, dtype, device
//   index, requires_grad, the number of dimensions and every size and stride given (None: not
//   checked), and no tensor passed twice. It never masks keys that torch's may mask, so it
//   says yes only where torch's would; it costs a fraction of torch's, which builds a
//   LocalState, a hash set of the arguments and reads symbolic sizes on every call.
// - a capsule, "data_pointer_reader", with int read(PyObject *, uint64_t *): a plain tensor's
//   data_ptr() without the Python method call, for the C launch helper's 'P' code. It
//   answers 0 (not read: call the method) for anything but a torch.Tensor or Parameter, while
//   a torch function mode is active (the method would go to the mode), and where torch throws
//   (the method raises the same error properly).
//
// - settings_watch(exact, residual): a check() -> bool of the global torch settings a recorded
//   graph bakes in (replay's per-replay check, replay.region_keys.modes_changed). It reads
//   them through the C++ getters that torch's Python getters call (about 30 reads, each a
//   fraction of a Python getter's call) into a state, and
//   answers from it: while the state equals the one it had when `exact` (replay's full check,
//   in Python or csrc/replay_checks.c) last said "unchanged", it calls only `residual` (the check
//   of the settings this build does not read, or None); any other state calls `exact`, and
//   keeps the state as the new reference where `exact` says "unchanged" and nothing moved
//   while it ran. So it can only ever say what `exact` would: the state is a function of the
//   settings read, so an equal state means equal settings. settings_state() is the state as
//   a tuple and SETTINGS_COVERED names the Python getters (with their arguments) whose value
//   it determines; tests/replay/test_torch_state.py changes each of them and checks that the
//   state moves. SETTINGS_READER, a capsule of Py_ssize_t read(int64_t *values, Py_ssize_t
//   capacity), reads the same state into an array: replay's settings check (csrc/replay_checks.c).
//
// - tensor_state(tensor): what a graph bakes of a tensor it reads where it lies (its type, data
//   pointer, dispatch keys, dtype, device, sizes and strides) as words, which replay_support's
//   read_tensor_state and tensor_states_unlike read and compare for replay's watch of the tensors
//   a region reaches through its globals and objects (csrc/replay_checks.c's WatchCheck).
//
// - a capsule, "replay_support", the replay_support struct of csrc/replay_support.h (its layout
//   check, then functions) for the C replay step (csrc/replay_step.c): the data pointer reader
//   above, and `fresh_output`, a replay's handed-out output made from its template view:
//   exactly `template.detach()` (torch's own C++ detach, through the dispatcher, wrapped as
//   torch's Python method wraps it), without the Python method call's argument parsing. While
//   a torch function mode is active it calls the Python method itself (the mode must see the
//   call); fresh_output(template) is the same, for tests. And a storage's use count, for the
//   output slots' check that nobody holds a slot's outputs. REPLAY_SUPPORT_LAYOUT is the layout
//   text it was built with (tests compare it with replay._step.SUPPORT_LAYOUT).
//
// - op_observer_begin(ranges) / op_observer_end(token): replay's torch-op observer
//   (replay.observe) without a Python frame per op. A thread-local at::RecordFunction callback
//   sees every operator the dispatcher runs on this thread with its inputs, and notes, per
//   watched byte range, whether an op read it, wrote it (an argument the schema marks written),
//   or reached it through a tensor that no range holds whole. It skips what TorchOpObserver
//   skips: metadata-only ops (the same names), ops whose schema makes an argument an alias
//   (views), and the composite ops a torch dispatch mode never sees outside inference mode
//   (CompositeImplicitAutograd kernels with no backend kernel: they run as the ops they are
//   made of, which the callback sees), without the Python frame per op that the dispatch mode
//   costs. Where record functions are off for this thread, or the callback fails, the
//   observation says it failed and replay assumes the worst.
//
// Every entry point catches C++ exceptions: a check that cannot read a tensor says no. Misuse
// from Python raises (TypeError, ValueError, OverflowError), never crashes: sequences are read
// from a tuple copy taken at the call (an item's __index__ may change the caller's list).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "replay_support.h"

#include <ATen/Context.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/DeviceType.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/jit/codegen/fuser/interface.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/jit/passes/tensorexpr_fuser.h>
#include <torch/csrc/jit/python/update_graph_executor_opt.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/csrc/tensor/python_tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>

#ifndef NDEBUG
// RecordFunction::inputs() asserts, in builds without NDEBUG, a flag that only such builds of
// torch set: the observer's callback would throw on every op (jitcore/torch_native.py passes it)
#error "build the torch-side helper with -DNDEBUG"
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <thread>
#include <utility>
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

// A tuple copy of a sequence (a new reference), or nullptr with a TypeError naming `what`:
// read from the copy, an item's __index__ cannot change what the loop reads.
PyObject *tuple_of(PyObject *sequence, const char *what) {
    if (!PySequence_Check(sequence)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a sequence, got %.200s", what, Py_TYPE(sequence)->tp_name);
        return nullptr;
    }
    return PySequence_Tuple(sequence);
}

// One optional int per dimension from a sequence of int or None.
bool optional_ints(PyObject *sequence, Py_ssize_t dims, std::vector<std::optional<int64_t>> &out, const char *what) {
    PyObject *items = tuple_of(sequence, what);
    if (items == nullptr)
        return false;
    bool ok = PyTuple_GET_SIZE(items) == dims;
    if (!ok)
        PyErr_Format(PyExc_ValueError, "%s: one entry per dimension (%zd)", what, dims);
    for (Py_ssize_t d = 0; ok && d < dims; ++d) {
        PyObject *item = PyTuple_GET_ITEM(items, d);
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

// Whether a tensor has dimension names (torch builds without named tensors have no such
// method: none has names there).
template <class T, class = void> struct names_readable : std::false_type {};
template <class T> struct names_readable<T, std::void_t<decltype(std::declval<const T &>().has_names())>> : std::true_type {};
template <class T> bool named(const T &tensor) {
    if constexpr (names_readable<T>::value)
        return tensor.has_names();
    else
        return false;
}

// A replay's output from its template view: template.detach(), made in C++ where nothing in
// Python could see the difference (a plain tensor, no torch function mode). New reference, or
// NULL with the error set.
PyObject *make_fresh_output(PyObject *view) {
    if (!THPVariable_CheckExact(view) || at::impl::torch_function_mode_enabled())
        return PyObject_CallMethod(view, "detach", nullptr);
    try {
        const at::Tensor &tensor = THPVariable_Unpack(view);
        if (c10::InferenceMode::is_enabled() || c10::impl::TorchDispatchModeTLS::any_modes_set() ||
            tensor.requires_grad() || named(tensor) || at::hasCallbacks())
            return THPVariable_Wrap(tensor.detach());
        // What detach's two kernels make of a plain tensor that does not require grad: the
        // native one a shallow copy, ADInplaceOrView's a non-differentiable view of it, a
        // shallow copy sharing the base's version counter, metadata changes refused, no
        // autograd meta (make_variable_non_differentiable_view); nothing else is left of
        // them here (no names to propagate, no profiler callbacks to record with).
        c10::intrusive_ptr<c10::TensorImpl> copy = tensor.getIntrusivePtr()->shallow_copy_and_detach(
            torch::autograd::impl::version_counter(tensor), /*allow_tensor_metadata_change=*/false);
        copy->set_autograd_meta(nullptr);
        return THPVariable_Wrap(at::Tensor(std::move(copy)));
    } catch (...) {
        return PyObject_CallMethod(view, "detach", nullptr);  // raises the same error properly
    }
}

PyObject *fresh_output(PyObject *, PyObject *view) { return make_fresh_output(view); }

// A storage's use count, what torch._C._storage_Use_Count(storage._cdata) answers; -1 for
// anything but a torch storage (the caller then asks Python).
int64_t storage_use_count(PyObject *storage) {
    if (!THPStorage_Check(storage))
        return -1;
    return static_cast<int64_t>(THPStorage_Unpack(storage).use_count());
}

PyObject *use_count_of(PyObject *, PyObject *storage) {
    int64_t count = storage_use_count(storage);
    if (count < 0)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(count);
}

// The first byte and the size of a plain tensor's storage, as tensor.untyped_storage()'s
// data_ptr() and nbytes() answer them (csrc/replay_step.c's check of staged inputs); 0 where the
// reader would not read the tensor, or it has no storage.
int read_storage_span(PyObject *object, uint64_t *base, uint64_t *nbytes) {
    if (!THPVariable_CheckExact(object) || at::impl::torch_function_mode_enabled())
        return 0;
    try {
        const at::Tensor &tensor = THPVariable_Unpack(object);
        if (!tensor.has_storage())
            return 0;
        const c10::Storage &storage = tensor.storage();
        *base = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(storage.data()));
        *nbytes = static_cast<uint64_t>(storage.nbytes());
        return 1;
    } catch (...) {
        return 0;
    }
}

PyObject *storage_span(PyObject *, PyObject *object) {
    uint64_t base = 0, nbytes = 0;
    if (!read_storage_span(object, &base, &nbytes))
        Py_RETURN_NONE;
    return Py_BuildValue("(KK)", static_cast<unsigned long long>(base), static_cast<unsigned long long>(nbytes));
}

// --- a watched tensor's state (read_tensor_state, tensor_states_unlike, tensor_state) -------------

// What a graph bakes of a tensor it reads where it lies (a weight a region reaches through an
// object), as int64 words: its Python type, data pointer (what data_ptr() answers), dispatch key
// set (its device type, conjugate and negative bits among them), dtype, device index, number of
// dimensions, then each size and each stride. replay's watch (replay.watch, csrc/replay_checks.c's
// WatchCheck) compares them on every replay: `.data =`, `.half()`, `.to()`, `resize_`, `set_` or
// an in-place view op each change one. Read from the tensor's C++ state through the accessors that
// inline (a few loads), since a replay reads every tensor it watches. The count of words, written
// only where it is at most `capacity`; -1 where it does not read the tensor: anything but a
// torch.Tensor or Parameter (a subclass may answer otherwise in Python), or a tensor whose sizes,
// strides or data torch refuses to give (nested, sparse, symbolic, without storage).
inline Py_ssize_t tensor_state_into(PyObject *object, int64_t *values, Py_ssize_t capacity) {
    if (!THPVariable_CheckExact(object))
        return -1;
    try {
        const c10::TensorImpl *impl = THPVariable_Unpack(object).unsafeGetTensorImpl();
        int64_t dims = impl->dim();
        Py_ssize_t count = 6 + 2 * static_cast<Py_ssize_t>(dims);
        if (count > capacity)
            return count;
        c10::IntArrayRef sizes = impl->sizes(), strides = impl->strides();
        values[0] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(Py_TYPE(object)));
        values[1] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(impl->data()));
        values[2] = static_cast<int64_t>(impl->key_set().raw_repr());
        values[3] = static_cast<int64_t>(impl->dtype().toScalarType());
        values[4] = static_cast<int64_t>(impl->device().index());
        values[5] = dims;
        for (int64_t d = 0; d < dims; ++d) {
            values[6 + d] = sizes[d];
            values[6 + dims + d] = strides[d];
        }
        return count;
    } catch (...) {
        return -1;
    }
}

Py_ssize_t read_tensor_state(PyObject *object, int64_t *values, Py_ssize_t capacity) {
    return tensor_state_into(object, values, capacity);
}

// Whether a tensor's state is still `then` (read_tensor_state's words for it): the same reads,
// compared as they are made, the cheapest first, so that a watch's usual answer (the same) costs
// no more loads than it must. The type first: words were only read of a torch.Tensor or
// Parameter, so a tensor of the recorded type is one of those and may be unpacked.
inline bool tensor_state_equals(PyObject *object, const int64_t *then) {
    if (static_cast<int64_t>(reinterpret_cast<uintptr_t>(Py_TYPE(object))) != then[0])
        return false;
    const c10::TensorImpl *impl = THPVariable_Unpack(object).unsafeGetTensorImpl();
    int64_t dims = then[5];
    if (static_cast<int64_t>(impl->key_set().raw_repr()) != then[2] || impl->dim() != dims)
        return false;
    c10::IntArrayRef sizes = impl->sizes(), strides = impl->strides();
    for (int64_t d = 0; d < dims; ++d)
        if (sizes[d] != then[6 + d] || strides[d] != then[6 + dims + d])
            return false;
    return static_cast<int64_t>(impl->dtype().toScalarType()) == then[3] &&
           static_cast<int64_t>(reinterpret_cast<uintptr_t>(impl->data())) == then[1] &&
           static_cast<int64_t>(impl->device().index()) == then[4];
}

// The first of `count` tensors whose state is not `words[i]` (read_tensor_state's words, whose
// sixth is the number of dimensions) or is not read; `count` where every one is: a watch's
// tensors in one call, where nothing changed (the usual case), without a call per tensor.
Py_ssize_t tensor_states_unlike(PyObject *const *tensors, const int64_t *const *words, Py_ssize_t count) {
    Py_ssize_t i = 0;
    try {
        for (; i < count; ++i)
            if (!tensor_state_equals(tensors[i], words[i]))
                return i;
    } catch (...) {
        return i;  // torch refused a read: the caller reads this one alone
    }
    return count;
}

// tensor_state(tensor) -> the words read_tensor_state reads, as a tuple (None where it would not).
PyObject *tensor_state(PyObject *, PyObject *object) {
    int64_t values[64];
    Py_ssize_t count = read_tensor_state(object, values, 64);
    std::vector<int64_t> more;
    if (count > 64) {  // more dimensions than the stack holds
        more.resize(static_cast<size_t>(count));
        count = read_tensor_state(object, more.data(), count);
    }
    if (count < 0)
        Py_RETURN_NONE;
    const int64_t *read = more.empty() ? values : more.data();
    PyObject *result = PyTuple_New(count);
    for (Py_ssize_t i = 0; result != nullptr && i < count; ++i) {
        PyObject *word = PyLong_FromLongLong(read[i]);
        if (word == nullptr) {
            Py_CLEAR(result);
            break;
        }
        PyTuple_SET_ITEM(result, i, word);
    }
    return result;
}

// What csrc/replay_step.c and csrc/replay_checks.c's watch read from torch (csrc/replay_support.h),
// each function set by its field's name, with the layout they compare before reading any.
replay_support make_replay_support() {
    replay_support support{};
    support.layout = REPLAY_SUPPORT_LAYOUT;
    support.size = sizeof(replay_support);
    support.read_data_pointer = read_data_pointer;
    support.fresh_output = make_fresh_output;
    support.storage_use_count = storage_use_count;
    support.read_storage_span = read_storage_span;
    support.read_tensor_state = read_tensor_state;
    support.tensor_states_unlike = tensor_states_unlike;
    return support;
}

const replay_support REPLAY_SUPPORT = make_replay_support();

PyObject *data_pointer(PyObject *, PyObject *object) {
    uint64_t address;
    if (!read_data_pointer(object, &address))
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(address);
}

// --- the global torch settings (settings_watch) --------------------------------------------------

// A string read is kept in the state as its number in the table of strings seen so far (the
// same string, the same number, for the life of the process). Called with the GIL held.
int64_t intern(const std::string &text) {
    static std::vector<std::string> seen;
    for (size_t i = 0; i < seen.size(); ++i)
        if (seen[i] == text)
            return static_cast<int64_t>(i);
    seen.push_back(text);
    return static_cast<int64_t>(seen.size() - 1);
}

// The values read, in a fixed order: bools, enums and dtypes as ints, strings interned, arrays
// as their length and then their items.
struct SettingsState {
    static constexpr size_t CAPACITY = 256;
    std::array<int64_t, CAPACITY> values;
    size_t count = 0;
    bool overflow = false;

    void push(int64_t value) {
        if (count < CAPACITY)
            values[count++] = value;
        else
            overflow = true;
    }

    template <class T> void add(const T &value) {
        if constexpr (std::is_enum<T>::value || std::is_integral<T>::value) {
            push(static_cast<int64_t>(value));
        } else if constexpr (std::is_convertible<const T &, std::string>::value) {
            push(intern(value));
        } else {
            push(static_cast<int64_t>(std::size(value)));
            for (const auto &item : value)
                add(item);
        }
    }

    bool same_as(const SettingsState &other) const {
        return !overflow && !other.overflow && count == other.count &&
               std::memcmp(values.data(), other.values.data(), count * sizeof(int64_t)) == 0;
    }
};

// The Python getters (torch._C names, with their arguments) whose values a state determines.
using Covered = std::vector<std::pair<std::string, std::vector<std::string>>>;

// at::Context's getters, each with the torch._C getter that returns it to Python. A getter this
// torch does not have is skipped at compile time (has_<member> below), so one source builds
// against every torch; the Python side checks what SETTINGS_COVERED leaves out itself.
#define CONTEXT_SETTINGS(_)                                                                         \
    _(deterministicAlgorithms, "_get_deterministic_algorithms")                                     \
    _(deterministicAlgorithmsWarnOnly, "_get_deterministic_algorithms_warn_only")                   \
    _(deterministicFillUninitializedMemory, "_get_deterministic_fill_uninitialized_memory")         \
    _(allowFP16ReductionCuBLAS, "_get_cublas_allow_fp16_reduced_precision_reduction")               \
    _(allowBF16ReductionCuBLAS, "_get_cublas_allow_bf16_reduced_precision_reduction")               \
    _(allowFP16AccumulationCuBLAS, "_get_cublas_allow_fp16_accumulation")                           \
    _(userEnabledCuDNN, "_get_cudnn_enabled")                                                       \
    _(benchmarkCuDNN, "_get_cudnn_benchmark")                                                       \
    _(deterministicCuDNN, "_get_cudnn_deterministic")                                               \
    _(cudnnDepthwiseKernel, "_get_cudnn_depthwise_kernel")                                          \
    _(userEnabledFlashSDP, "_get_flash_sdp_enabled")                                                \
    _(userEnabledMemEfficientSDP, "_get_mem_efficient_sdp_enabled")                                 \
    _(userEnabledMathSDP, "_get_math_sdp_enabled")                                                  \
    _(userEnabledCuDNNSDP, "_get_cudnn_sdp_enabled")                                                \
    _(userEnabledFA3SDP, "_get_fa3_sdp_enabled")                                                    \
    _(allowFP16BF16ReductionMathSDP, "_get_math_sdp_allow_fp16_bf16_reduction")                     \
    _(sDPPriorityOrder, "_get_sdp_priority_order")                                                  \
    _(blasPreferredBackend, "_get_blas_preferred_backend")                                          \
    _(linalgPreferredBackend, "_get_linalg_preferred_backend")                                      \
    _(getROCmFAPreferredBackend, "_get_rocm_fa_preferred_backend")                                  \
    _(immediateMiopen, "_get_miopen_immediate")

// The legacy TF32 getters: read only in a torch without the per-backend float32 precisions,
// where they are the state (in one with them, they throw once the new API was used).
#define LEGACY_TF32_SETTINGS(_)                                                                     \
    _(float32MatmulPrecision, "_get_float32_matmul_precision")                                      \
    _(allowTF32CuBLAS, "_get_cublas_allow_tf32")                                                    \
    _(allowTF32CuDNN, "_get_cudnn_allow_tf32")

#define SETTING_PROBE(member, getter)                                                               \
    template <class C, class = void> struct has_##member : std::false_type {};                      \
    template <class C>                                                                              \
    struct has_##member<C, std::void_t<decltype(std::declval<C &>().member())>> : std::true_type {};
CONTEXT_SETTINGS(SETTING_PROBE)
LEGACY_TF32_SETTINGS(SETTING_PROBE)
#undef SETTING_PROBE

// float32Precision(backend, op): its parameter types, from the member's type (strings in some
// torch versions, enums in others).
template <class F> struct two_parameters {
    static constexpr bool known = false;
};
template <class R, class K, class A, class B> struct two_parameters<R (K::*)(A, B) const> {
    static constexpr bool known = true;
    using first = std::decay_t<A>;
    using second = std::decay_t<B>;
};
template <class R, class K, class A, class B>
struct two_parameters<R (K::*)(A, B)> : two_parameters<R (K::*)(A, B) const> {};
template <class C, class = void> struct has_float32Precision : std::false_type {};
template <class C>
struct has_float32Precision<C, std::void_t<decltype(&C::float32Precision)>>
    : std::integral_constant<bool, two_parameters<decltype(&C::float32Precision)>::known> {};
template <class C> using Float32Parameters = two_parameters<decltype(&C::float32Precision)>;

// The (backend, operation) pairs replay keys (replay.region_keys._FP32_PRECISIONS).
const std::array<std::pair<const char *, const char *>, 5> FP32_PAIRS = {
    {{"generic", "all"}, {"cuda", "all"}, {"cuda", "matmul"}, {"cuda", "conv"}, {"cuda", "rnn"}}};

// Where float32Precision takes enums: every (backend, op) pair of small ints it answers for
// without throwing, found once. The state holds them all, so each pair Python asks for by name
// (one of these, however torch maps names to enums) is determined by it.
template <class C> const std::vector<std::pair<int, int>> &float32_pairs(C &context) {
    static const std::vector<std::pair<int, int>> pairs = [&context] {
        using Backend = typename Float32Parameters<C>::first;
        using Op = typename Float32Parameters<C>::second;
        std::vector<std::pair<int, int>> found;
        for (int backend = 0; backend < 4; ++backend)
            for (int op = 0; op < 4; ++op) {
                try {
                    context.float32Precision(static_cast<Backend>(backend), static_cast<Op>(op));
                } catch (...) {
                    continue;
                }
                found.emplace_back(backend, op);
            }
        return found;
    }();
    return pairs;
}

// The device types autocast answers for (is_autocast_enabled throws for the others), found once.
const std::vector<c10::DeviceType> &autocast_devices() {
    static std::vector<c10::DeviceType> devices = [] {
        std::vector<c10::DeviceType> found;
        for (int i = 0; i < static_cast<int>(c10::COMPILE_TIME_MAX_DEVICE_TYPES); ++i) {
            c10::DeviceType device = static_cast<c10::DeviceType>(i);
            try {
                at::autocast::is_autocast_enabled(device);
                at::autocast::get_autocast_dtype(device);
            } catch (...) {
                continue;
            }
            found.push_back(device);
        }
        return found;
    }();
    return devices;
}

// Name what a read covers, where asked (once, at import); the arguments are not even made on
// the per-call reads.
#define COVER(covered, getter, ...)                                                                 \
    if ((covered) != nullptr)                                                                       \
        (covered)->emplace_back(getter, std::vector<std::string>{__VA_ARGS__});

template <class C> void read_context(C &context, SettingsState &state, Covered *covered) {
#define READ_SETTING(member, getter)                                                                \
    if constexpr (has_##member<C>::value) {                                                         \
        state.add(context.member());                                                                \
        COVER(covered, getter);                                                                     \
    }
    CONTEXT_SETTINGS(READ_SETTING)
    if constexpr (has_float32Precision<C>::value) {
        using Backend = typename Float32Parameters<C>::first;
        using Op = typename Float32Parameters<C>::second;
        if constexpr (std::is_convertible<const char *, Backend>::value) {
            for (const auto &pair : FP32_PAIRS)
                state.add(context.float32Precision(pair.first, pair.second));
        } else {
            for (const auto &pair : float32_pairs(context))
                state.add(context.float32Precision(static_cast<Backend>(pair.first), static_cast<Op>(pair.second)));
        }
        for (const auto &pair : FP32_PAIRS)
            COVER(covered, "_get_fp32_precision_getter", pair.first, pair.second);
    } else {
        LEGACY_TF32_SETTINGS(READ_SETTING)
    }
#undef READ_SETTING
}

// The thread's torch function and dispatch modes and tracing, the default tensor type's device,
// the thread's local dispatch key sets (included and excluded), cuBLAS's SM carveout and
// TorchScript's executor switches. The tracing state is covered as far as a key can hold it: a
// key requires None, which the state's "not tracing" determines.
void read_modes(SettingsState &state, Covered *covered) {
    state.add(at::impl::PythonTorchFunctionTLS::stack_len());
    COVER(covered, "_len_torch_function_stack");
    state.add(at::impl::PythonTorchFunctionTLS::get_disabled_state() ==
              at::impl::TorchFunctionDisabledState::ALL_DISABLED);
    COVER(covered, "_is_torch_function_all_disabled");
    state.add(c10::impl::TorchDispatchModeTLS::stack_len());
    COVER(covered, "_len_torch_dispatch_stack");
    state.add(torch::jit::tracer::isTracing());
    COVER(covered, "_get_tracing_state");
    state.add(torch::tensors::get_default_dispatch_key());
    COVER(covered, "_get_default_device");
    c10::impl::LocalDispatchKeySet keys = c10::impl::tls_local_dispatch_key_set();
    state.add(keys.included_.raw_repr());
    COVER(covered, "_dispatch_tls_local_include_set");
    state.add(keys.excluded_.raw_repr());
    COVER(covered, "_dispatch_tls_local_exclude_set");
    std::optional<int32_t> carveout = at::globalContext()._SMCarveout_EXPERIMENTAL();
    state.add(carveout.has_value() ? static_cast<int64_t>(*carveout) : int64_t{-1});
    COVER(covered, "_get_sm_carveout_experimental");
    state.add(torch::jit::getGraphExecutorOptimize());
    COVER(covered, "_get_graph_executor_optimize");
    state.add(torch::jit::tensorExprFuserEnabled());
    COVER(covered, "_jit_texpr_fuser_enabled");
    state.add(torch::jit::texprReductionsEnabled());
    COVER(covered, "_jit_texpr_reductions_enabled");
    state.add(torch::jit::tensorExprDynamicShapeFusionEnabled());
    COVER(covered, "_jit_texpr_dynamic_shape_enabled");
    state.add(torch::jit::canFuseOnGPU());
    COVER(covered, "_jit_can_fuse_on_gpu");
    state.add(static_cast<int64_t>(torch::jit::getNumProfiledRuns().load()));
    COVER(covered, "_jit_get_num_profiled_runs");
}

// The whole state: the thread's grad, inference and autocast modes, the default dtype and
// at::Context's settings. False where a getter threw (the caller then asks `exact`).
bool read_settings(SettingsState &state, Covered *covered) {
    try {
        state.add(c10::GradMode::is_enabled());
        COVER(covered, "is_grad_enabled");
        state.add(c10::InferenceMode::is_enabled());
        COVER(covered, "is_inference_mode_enabled");
        for (c10::DeviceType device : autocast_devices()) {
            state.add(at::autocast::is_autocast_enabled(device));
            state.add(at::autocast::get_autocast_dtype(device));
            COVER(covered, "is_autocast_enabled", c10::DeviceTypeName(device, /*lower_case=*/true));
            COVER(covered, "get_autocast_dtype", c10::DeviceTypeName(device, /*lower_case=*/true));
        }
        COVER(covered, "_is_any_autocast_enabled");  // any of the devices above
        state.add(at::autocast::is_autocast_cache_enabled());
        COVER(covered, "is_autocast_cache_enabled");
        state.add(c10::get_default_dtype_as_scalartype());
        COVER(covered, "get_default_dtype");
        read_context(at::globalContext(), state, covered);
        read_modes(state, covered);
    } catch (...) {
        return false;
    }
    return !state.overflow;
}

struct Watch {
    PyObject *exact;     // replay's full check: () -> bool, True where a setting changed
    PyObject *residual;  // the check of the settings not covered, or nullptr
    SettingsState reference;
    bool armed = false;  // reference is a state in which `exact` said False
    ~Watch() {
        Py_XDECREF(exact);
        Py_XDECREF(residual);
    }
};

const char *WATCH_CAPSULE = "jitcore._torch_native.settings_watch";

void watch_destructor(PyObject *capsule) {
    delete static_cast<Watch *>(PyCapsule_GetPointer(capsule, WATCH_CAPSULE));
}

PyObject *watch_check(PyObject *capsule, PyObject *const *, Py_ssize_t count) {
    Watch *watch = static_cast<Watch *>(PyCapsule_GetPointer(capsule, WATCH_CAPSULE));
    if (watch == nullptr)
        return nullptr;
    if (count != 0) {
        PyErr_SetString(PyExc_TypeError, "a settings watch takes no arguments");
        return nullptr;
    }
    SettingsState now;
    bool read = read_settings(now, nullptr);
    if (read && watch->armed && now.same_as(watch->reference)) {
        if (watch->residual == nullptr)
            Py_RETURN_FALSE;
        return PyObject_CallNoArgs(watch->residual);
    }
    PyObject *changed = PyObject_CallNoArgs(watch->exact);
    if (changed == Py_False && read) {
        // keep it only where nothing moved while `exact` ran (another thread may set a global)
        SettingsState after;
        if (read_settings(after, nullptr) && after.same_as(now)) {
            watch->reference = now;
            watch->armed = true;
        }
    }
    return changed;
}

PyMethodDef WATCH_CHECK = {"check", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(watch_check)),
                           METH_FASTCALL, "check() -> bool: whether a setting changed, as exact() says"};

PyObject *settings_watch(PyObject *, PyObject *args) {
    PyObject *exact, *residual;
    if (!PyArg_ParseTuple(args, "OO:settings_watch", &exact, &residual))
        return nullptr;
    if (!PyCallable_Check(exact) || (residual != Py_None && !PyCallable_Check(residual))) {
        PyErr_SetString(PyExc_TypeError, "settings_watch(exact, residual): exact callable, residual callable or None");
        return nullptr;
    }
    Watch *watch = new Watch();
    Py_INCREF(exact);
    watch->exact = exact;
    watch->residual = nullptr;
    if (residual != Py_None) {
        Py_INCREF(residual);
        watch->residual = residual;
    }
    PyObject *capsule = PyCapsule_New(watch, WATCH_CAPSULE, watch_destructor);
    if (capsule == nullptr) {
        delete watch;
        return nullptr;
    }
    PyObject *check = PyCFunction_New(&WATCH_CHECK, capsule);
    Py_DECREF(capsule);
    return check;
}

PyObject *settings_state(PyObject *, PyObject *) {
    SettingsState state;
    if (!read_settings(state, nullptr)) {
        PyErr_SetString(PyExc_RuntimeError, "a torch setting could not be read through its C++ getter");
        return nullptr;
    }
    PyObject *values = PyTuple_New(static_cast<Py_ssize_t>(state.count));
    if (values == nullptr)
        return nullptr;
    for (size_t i = 0; i < state.count; ++i) {
        PyObject *value = PyLong_FromLongLong(state.values[i]);
        if (value == nullptr) {
            Py_DECREF(values);
            return nullptr;
        }
        PyTuple_SET_ITEM(values, static_cast<Py_ssize_t>(i), value);
    }
    return values;
}

// SETTINGS_READER's function, for replay's settings check (csrc/replay_checks.c): the state into
// `values`, its length, or -1 where a getter threw or it does not fit.
Py_ssize_t settings_reader(int64_t *values, Py_ssize_t capacity) {
    SettingsState state;
    if (!read_settings(state, nullptr) || static_cast<Py_ssize_t>(state.count) > capacity)
        return -1;
    std::memcpy(values, state.values.data(), state.count * sizeof(int64_t));
    return static_cast<Py_ssize_t>(state.count);
}

// SETTINGS_COVERED: ((getter name, (arguments...)), ...), or None where the settings cannot be read.
PyObject *settings_covered() {
    SettingsState state;
    Covered covered;
    if (!read_settings(state, &covered))
        Py_RETURN_NONE;
    PyObject *result = PyTuple_New(static_cast<Py_ssize_t>(covered.size()));
    if (result == nullptr)
        return nullptr;
    for (size_t i = 0; i < covered.size(); ++i) {
        PyObject *arguments = PyTuple_New(static_cast<Py_ssize_t>(covered[i].second.size()));
        if (arguments == nullptr) {
            Py_DECREF(result);
            return nullptr;
        }
        for (size_t j = 0; j < covered[i].second.size(); ++j) {
            PyObject *text = PyUnicode_FromString(covered[i].second[j].c_str());
            if (text == nullptr) {
                Py_DECREF(arguments);
                Py_DECREF(result);
                return nullptr;
            }
            PyTuple_SET_ITEM(arguments, static_cast<Py_ssize_t>(j), text);
        }
        PyObject *entry = Py_BuildValue("(sN)", covered[i].first.c_str(), arguments);
        if (entry == nullptr) {
            Py_DECREF(result);
            return nullptr;
        }
        PyTuple_SET_ITEM(result, static_cast<Py_ssize_t>(i), entry);
    }
    return result;
}


// --- the torch-op observer --------------------------------------------------------------------

struct OpObservation {
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    std::vector<char> read, written, beyond;
    const char *failure = nullptr;  // why the observation cannot be trusted (a static string)
    bool ended = false;
    std::thread::id thread;
};

// What the callback needs of one operator: whether it is skipped, and which arguments it writes.
struct OpInfo {
    std::string name, overload;  // to tell a reused name pointer from the operator it was cached for
    bool skip = true;
    std::vector<char> writes;
};

// The ops a dispatch mode's observer treats as reading nothing: replay.observe's
// METADATA_ONLY_NAMES, by operator name (all overloads); tests/replay/test_observe.py checks
// that the two lists (exported as OBSERVER_METADATA_ONLY) are the same.
const char *const METADATA_ONLY_OP_NAMES[] = {
    "aten::size",         "aten::stride",      "aten::numel",      "aten::dim",
    "aten::sym_size",     "aten::sym_stride",  "aten::sym_numel",  "aten::sym_storage_offset",
    "aten::is_contiguous", "aten::is_same_size", "aten::empty_like", "aten::zeros_like",
    "aten::ones_like",    "aten::full_like",   "aten::rand_like",  "aten::randn_like",
    "aten::randint_like", "aten::new_empty",   "aten::new_empty_strided", "aten::new_zeros",
    "aten::new_ones",     "aten::new_full",    "aten::is_pinned"};

const std::unordered_set<std::string> &metadata_only_ops() {
    static const std::unordered_set<std::string> names(std::begin(METADATA_ONLY_OP_NAMES),
                                                        std::end(METADATA_ONLY_OP_NAMES));
    return names;
}

// Kernels that make an op more than its parts: replay.observe.OWN_KERNEL_KEYS (exported as
// OBSERVER_OWN_KERNEL_KEYS, compared by the same test).
const c10::DispatchKey OWN_KERNEL_KEYS[] = {
    c10::DispatchKey::CPU, c10::DispatchKey::CUDA, c10::DispatchKey::HIP, c10::DispatchKey::Meta,
    c10::DispatchKey::MPS, c10::DispatchKey::XPU, c10::DispatchKey::PrivateUse1,
    c10::DispatchKey::QuantizedCPU, c10::DispatchKey::QuantizedCUDA, c10::DispatchKey::SparseCPU,
    c10::DispatchKey::SparseCUDA, c10::DispatchKey::NestedTensorCPU, c10::DispatchKey::NestedTensorCUDA,
    c10::DispatchKey::CompositeExplicitAutograd, c10::DispatchKey::CompositeExplicitAutogradNonFunctional,
    c10::DispatchKey::Autograd, c10::DispatchKey::AutogradCPU, c10::DispatchKey::AutogradCUDA,
    c10::DispatchKey::Python, c10::DispatchKey::FuncTorchBatched};

// A composite op that only ever runs as the ops it is made of (its CompositeImplicitAutograd
// kernel, and no kernel of its own for any backend): a dispatch mode sees those ops, not it.
bool runs_as_its_parts(const c10::FunctionSchema &schema) {
    auto handle = c10::Dispatcher::singleton().findOp(c10::OperatorName(schema.name(), schema.overload_name()));
    if (!handle || !handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd))
        return false;
    for (c10::DispatchKey key : OWN_KERNEL_KEYS)
        if (handle->hasKernelForDispatchKey(key))
            return false;
    return true;
}

// The two lists above as tuples of names, for the test that compares them with Python's.
PyObject *observer_lists(PyObject *module) {
    PyObject *names = PyTuple_New(static_cast<Py_ssize_t>(std::size(METADATA_ONLY_OP_NAMES)));
    PyObject *keys = PyTuple_New(static_cast<Py_ssize_t>(std::size(OWN_KERNEL_KEYS)));
    if (names == nullptr || keys == nullptr)
        goto failed;
    for (size_t i = 0; i < std::size(METADATA_ONLY_OP_NAMES); ++i) {
        PyObject *name = PyUnicode_FromString(METADATA_ONLY_OP_NAMES[i]);
        if (name == nullptr)
            goto failed;
        PyTuple_SET_ITEM(names, static_cast<Py_ssize_t>(i), name);
    }
    for (size_t i = 0; i < std::size(OWN_KERNEL_KEYS); ++i) {
        PyObject *key = PyUnicode_FromString(c10::toString(OWN_KERNEL_KEYS[i]));
        if (key == nullptr)
            goto failed;
        PyTuple_SET_ITEM(keys, static_cast<Py_ssize_t>(i), key);
    }
    if (PyModule_AddObject(module, "OBSERVER_METADATA_ONLY", names) < 0)
        goto failed;
    names = nullptr;  // the module holds it
    if (PyModule_AddObject(module, "OBSERVER_OWN_KERNEL_KEYS", keys) < 0)
        goto failed;
    return module;
failed:
    Py_XDECREF(names);
    Py_XDECREF(keys);
    return nullptr;
}

struct NamePairHash {
    size_t operator()(const std::pair<const char *, const char *> &names) const {
        return std::hash<const void *>()(names.first) * 31u + std::hash<const void *>()(names.second);
    }
};

// Per thread (the callback runs on the thread that dispatches, with no lock held): the
// observations open on it, the callback's handle while any is, and the operators seen.
thread_local std::vector<OpObservation *> open_observations;
thread_local at::CallbackHandle observer_callback = 0;
thread_local std::unordered_map<std::pair<const char *, const char *>, OpInfo, NamePairHash> op_infos;

const OpInfo *op_info(const at::RecordFunction &record) {
    const char *name = record.name(), *overload = record.overload_name();
    auto found = op_infos.find({name, overload});
    if (found != op_infos.end() && found->second.name == name && found->second.overload == overload)
        return &found->second;
    OpInfo info;
    info.name = name;
    info.overload = overload;
    std::optional<c10::FunctionSchema> schema = record.operator_schema();
    if (schema) {  // (no schema: a named scope, not an operator; its operators report themselves)
        bool view = false;
        for (const c10::Argument &argument : schema->arguments()) {
            const c10::AliasInfo *alias = argument.alias_info();
            info.writes.push_back(alias != nullptr && alias->isWrite());
            view = view || (alias != nullptr && !alias->isWrite());
        }
        info.skip = view || metadata_only_ops().count(schema->name()) > 0 || runs_as_its_parts(*schema);
    }
    return &(op_infos[{name, overload}] = std::move(info));
}

void note_tensor(const at::Tensor &tensor, bool written) {
    if (!tensor.defined() || tensor.layout() != c10::kStrided || tensor.device().is_meta())
        return;
    uint64_t lo = reinterpret_cast<uint64_t>(tensor.data_ptr());
    int64_t extent = 0;  // as replay.region_keys.extent_bytes
    if (tensor.is_contiguous()) {
        extent = tensor.numel() * static_cast<int64_t>(tensor.element_size());
    } else if (tensor.numel() != 0) {
        int64_t last = 0;
        c10::IntArrayRef sizes = tensor.sizes(), strides = tensor.strides();
        for (size_t d = 0; d < sizes.size(); ++d)
            if (sizes[d] > 0)
                last += (sizes[d] - 1) * strides[d];
        extent = (last + 1) * static_cast<int64_t>(tensor.element_size());
    }
    uint64_t hi = lo + static_cast<uint64_t>(extent);
    if (lo == hi)
        return;
    for (OpObservation *observation : open_observations) {
        bool any = false, whole = false;
        const auto &ranges = observation->ranges;
        for (size_t i = 0; i < ranges.size(); ++i) {
            if (ranges[i].first < hi && lo < ranges[i].second) {
                any = true;
                observation->read[i] = 1;
                if (written)
                    observation->written[i] = 1;
            }
            whole = whole || (ranges[i].first <= lo && hi <= ranges[i].second);
        }
        if (any && !whole)
            for (size_t i = 0; i < ranges.size(); ++i)
                if (ranges[i].first < hi && lo < ranges[i].second)
                    observation->beyond[i] = 1;
    }
}

std::unique_ptr<at::ObserverContext> observe_op(const at::RecordFunction &record) {
    if (open_observations.empty())
        return nullptr;
    try {
        const OpInfo *info = op_info(record);
        if (info->skip)
            return nullptr;
        c10::ArrayRef<const c10::IValue> inputs = record.inputs();
        for (size_t i = 0; i < inputs.size(); ++i) {
            bool written = i < info->writes.size() && info->writes[i];
            const c10::IValue &value = inputs[i];
            if (value.isTensor()) {
                note_tensor(value.toTensor(), written);
            } else if (value.isList()) {  // Tensor[], Tensor?[]
                for (const c10::IValue &item : value.toListRef())
                    if (item.isTensor())
                        note_tensor(item.toTensor(), written);
            } else if (value.isTuple()) {
                for (const c10::IValue &item : value.toTupleRef().elements())
                    if (item.isTensor())
                        note_tensor(item.toTensor(), written);
            }
        }
    } catch (...) {
        for (OpObservation *observation : open_observations)
            observation->failure = "an operator's inputs could not be read";
    }
    return nullptr;
}

// Record functions off on the thread now: the callback may have missed ops since the start.
void notice_record_functions_off(OpObservation *observation) {
    if (!at::isRecordFunctionEnabled() && observation->failure == nullptr)
        observation->failure = "record functions were turned off on this thread while it watched";
}

void end_observation(OpObservation *observation) {
    auto &open = open_observations;
    open.erase(std::remove(open.begin(), open.end(), observation), open.end());
    if (open.empty() && observer_callback != 0) {
        at::removeCallback(observer_callback);
        observer_callback = 0;
    }
    notice_record_functions_off(observation);
    observation->ended = true;
}

const char *const OBSERVATION = "jitcore._torch_native.op_observation";

void drop_observation(PyObject *capsule) {
    auto *observation = static_cast<OpObservation *>(PyCapsule_GetPointer(capsule, OBSERVATION));
    if (observation == nullptr)
        return;
    if (!observation->ended) {
        if (observation->thread != std::this_thread::get_id())
            return;  // still open on another thread, whose callback may write it: kept (leaked)
        end_observation(observation);
    }
    delete observation;
}

// An address from 0 to 2**64-1 (an int, or an object with __index__); false with the error set.
bool read_address(PyObject *value, unsigned long long &out) {
    PyObject *number = PyNumber_Index(value);
    if (number == nullptr)
        return false;
    out = PyLong_AsUnsignedLongLong(number);
    Py_DECREF(number);
    if (out == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        PyErr_SetString(PyExc_OverflowError, "op_observer_begin: a range's byte address must be from 0 to 2**64-1");
        return false;
    }
    return true;
}

// The (lo, hi) byte ranges of `ranges` (a sequence of pairs, read from a copy); false with the error set.
bool read_ranges(PyObject *ranges, std::vector<std::pair<uint64_t, uint64_t>> &out) {
    PyObject *items = tuple_of(ranges, "op_observer_begin: ranges");
    if (items == nullptr)
        return false;
    bool ok = true;
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(items); ++i) {
        PyObject *pair = PyTuple_GET_ITEM(items, i);
        unsigned long long lo = 0, hi = 0;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_Format(PyExc_TypeError, "op_observer_begin: range %zd is not a (lo, hi) tuple", i);
            ok = false;
        } else if ((ok = read_address(PyTuple_GET_ITEM(pair, 0), lo) && read_address(PyTuple_GET_ITEM(pair, 1), hi))) {
            out.emplace_back(lo, hi);
        }
    }
    Py_DECREF(items);
    return ok;
}

// op_observer_begin(ranges) -> token: starts watching [(lo, hi), ...] on this thread.
PyObject *op_observer_begin(PyObject *, PyObject *ranges) {
    auto observation = std::make_unique<OpObservation>();
    if (!read_ranges(ranges, observation->ranges))
        return nullptr;
    observation->read.assign(observation->ranges.size(), 0);
    observation->written.assign(observation->ranges.size(), 0);
    observation->beyond.assign(observation->ranges.size(), 0);
    observation->thread = std::this_thread::get_id();
    if (!at::isRecordFunctionEnabled())
        observation->failure = "record functions are turned off on this thread";
    PyObject *token = PyCapsule_New(observation.get(), OBSERVATION, drop_observation);
    if (token == nullptr)
        return nullptr;
    try {
        if (observer_callback == 0)
            observer_callback = at::addThreadLocalCallback(
                at::RecordFunctionCallback(observe_op).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
        open_observations.push_back(observation.get());
    } catch (const std::exception &error) {
        observation->ended = true;
        observation.release();
        Py_DECREF(token);
        PyErr_Format(PyExc_RuntimeError, "the torch-op observer could not start: %s", error.what());
        return nullptr;
    }
    observation.release();  // the token owns it
    return token;
}

PyObject *flags_to_tuple(const std::vector<char> &flags) {
    PyObject *result = PyList_New(0);
    if (result == nullptr)
        return nullptr;
    for (size_t i = 0; i < flags.size(); ++i) {
        if (!flags[i])
            continue;
        PyObject *index = PyLong_FromSize_t(i);
        if (index == nullptr || PyList_Append(result, index) < 0) {
            Py_XDECREF(index);
            Py_DECREF(result);
            return nullptr;
        }
        Py_DECREF(index);
    }
    PyObject *tuple = PyList_AsTuple(result);
    Py_DECREF(result);
    return tuple;
}

// (read, written, reached beyond, failure or None) of an observation, open or ended.
PyObject *observation_answers(const OpObservation *observation) {
    PyObject *result = PyTuple_New(4);
    if (result == nullptr)
        return nullptr;
    PyObject *parts[4] = {flags_to_tuple(observation->read), flags_to_tuple(observation->written),
                          flags_to_tuple(observation->beyond),
                          observation->failure ? PyUnicode_FromString(observation->failure) : Py_NewRef(Py_None)};
    bool complete = true;
    for (Py_ssize_t i = 0; i < 4; ++i) {
        complete = complete && parts[i] != nullptr;
        PyTuple_SET_ITEM(result, i, parts[i] ? parts[i] : Py_NewRef(Py_None));
    }
    if (!complete) {
        Py_DECREF(result);
        return nullptr;
    }
    return result;
}

// The observation behind a token, on the thread that began it (its callback writes it there).
OpObservation *own_observation(PyObject *token, const char *caller) {
    auto *observation = static_cast<OpObservation *>(PyCapsule_GetPointer(token, OBSERVATION));
    if (observation == nullptr)
        return nullptr;
    if (observation->thread != std::this_thread::get_id()) {
        PyErr_Format(PyExc_RuntimeError, "%s: the observation was begun on another thread", caller);
        return nullptr;
    }
    return observation;
}

// op_observer_peek(token) -> op_observer_end's answer so far, still watching: what the
// region's ops did up to now, for the checks made before the observation ends.
PyObject *op_observer_peek(PyObject *, PyObject *token) {
    OpObservation *observation = own_observation(token, "op_observer_peek");
    if (observation == nullptr)
        return nullptr;
    if (!observation->ended)
        notice_record_functions_off(observation);
    return observation_answers(observation);
}

// op_observer_end(token) -> (read, written, reached beyond, failure or None): stops watching.
PyObject *op_observer_end(PyObject *, PyObject *token) {
    OpObservation *observation = own_observation(token, "op_observer_end");
    if (observation == nullptr)
        return nullptr;
    if (!observation->ended) {
        try {
            end_observation(observation);
        } catch (const std::exception &error) {
            PyErr_Format(PyExc_RuntimeError, "the torch-op observer could not stop: %s", error.what());
            return nullptr;
        }
    }
    return observation_answers(observation);
}

PyMethodDef METHODS[] = {
    {"tensor_guard", tensor_guard, METH_VARARGS,
     "tensor_guard(examples, sizes, strides) -> check(*tensors) -> bool, as torch's TensorGuards"},
    {"data_pointer", data_pointer, METH_O,
     "data_pointer(tensor) -> int, what the capsule's reader reads (None where it would not read)"},
    {"settings_watch", settings_watch, METH_VARARGS,
     "settings_watch(exact, residual) -> check() -> bool, exact()'s answer from a state read in C++"},
    {"fresh_output", fresh_output, METH_O, "fresh_output(view) -> view.detach(), as csrc/replay_step.c makes it"},
    {"tensor_state", tensor_state, METH_O,
     "tensor_state(tensor) -> tuple of ints, what replay_support's read_tensor_state reads (None where it would not)"},
    {"storage_span", storage_span, METH_O,
     "storage_span(tensor) -> (first byte, bytes) of its storage as csrc/replay_step.c reads it (None where it would not)"},
    {"storage_use_count", use_count_of, METH_O,
     "storage_use_count(storage) -> its use count, as csrc/replay_step.c reads it (None: not a storage)"},
    {"settings_state", settings_state, METH_NOARGS, "settings_state() -> tuple of ints, the settings read in C++"},
    {"op_observer_begin", op_observer_begin, METH_O,
     "op_observer_begin(ranges) -> token: note which of the byte ranges this thread's torch ops read and write"},
    {"op_observer_peek", op_observer_peek, METH_O,
     "op_observer_peek(token) -> op_observer_end's answer so far, without ending the observation"},
    {"op_observer_end", op_observer_end, METH_O,
     "op_observer_end(token) -> (read, written, reached_beyond, failure): the ranges' indices, and why not to trust "
     "them (None: trusted)"},
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
    PyObject *support = PyCapsule_New(const_cast<replay_support *>(&REPLAY_SUPPORT), REPLAY_SUPPORT_CAPSULE, nullptr);
    if (support == nullptr || PyModule_AddObject(module, "replay_support", support) < 0) {
        Py_XDECREF(support);
        Py_DECREF(module);
        return nullptr;
    }
    if (PyModule_AddStringConstant(module, "REPLAY_SUPPORT_LAYOUT", REPLAY_SUPPORT_LAYOUT) < 0) {
        Py_DECREF(module);
        return nullptr;
    }
    PyObject *settings = PyCapsule_New(reinterpret_cast<void *>(settings_reader),
                                       "jitcore._torch_native.settings_reader", nullptr);
    if (settings == nullptr || PyModule_AddObject(module, "SETTINGS_READER", settings) < 0) {
        Py_XDECREF(settings);
        Py_DECREF(module);
        return nullptr;
    }
    PyObject *covered = settings_covered();
    if (covered == nullptr || PyModule_AddObject(module, "SETTINGS_COVERED", covered) < 0) {
        Py_XDECREF(covered);
        Py_DECREF(module);
        return nullptr;
    }
    if (observer_lists(module) == nullptr) {
        Py_DECREF(module);
        return nullptr;
    }
    if (PyModule_AddStringConstant(module, "TORCH_VERSION", TORCH_VERSION_FOR_CHECK) < 0) {
        Py_DECREF(module);
        return nullptr;
    }
    return module;
}
