"""The global torch state a graph bakes: the settings a region key holds, the check every
replay makes of them, the states that refuse a key, and the list of every global torch state
with how it is handled.

Why a graph needs them: it bakes in the kernels torch chose under the settings in force when
it was recorded (a TF32 matmul, a cuDNN algorithm, an SDPA backend, autocast's casts), the
Python that ran around the ops (a dispatch or function mode, a module hook, an einsum path)
and what only ran once (a draw from the CPU generator). So the settings are part of every key
(:func:`torch_modes`), a replay checks that they are still those of its recording
(:func:`modes_changed`), and a state a graph cannot reproduce at all refuses the key
(:class:`replay.errors.RefusedKey`: the call runs eagerly). :data:`GLOBAL_STATE` lists
every global torch state that changes what an op computes, with what is done about it;
tests/replay/test_torch_state.py holds torch's getters against it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Protocol, TypeGuard

import attrs
import torch
import torch.autograd.forward_ad
import torch.backends.mha
import torch.backends.opt_einsum
import torch.nn.modules.module

try:  # torch's registry of pluggable flash-attention implementations (FA3, FA4)
    import torch.nn.attention._registry as _flash_registry
except ImportError:  # a torch without it
    _flash_registry = None

from jitcore.for_replay import compiled_helpers_enabled, generated, torch_native_module
from replay.errors import RefusedKey, ReplayError, ReplayWarning

try:  # the settings check in C (csrc/replay_checks.c; optional, built by setup.py)
    import replay._checks as _checks
except ImportError:
    _checks = None
_SettingsCheck = getattr(_checks, "SettingsCheck", None)


def _refused_key(reason: str) -> ReplayError:
    """The refusal of a key whose settings cannot be read (the call runs eagerly)."""
    return RefusedKey(reason)


#: Marks a setting any value of which is keyed (the others must have their ``required`` value).
ANY = "any value"


@attrs.frozen
class Setting:
    """One global torch setting: the function that reads it and its arguments. A reader
    returning a list is keyed as a tuple (keys hold hashable values). Where ``required`` is
    not :data:`ANY`, any other value refuses the key with ``refusal``: a state no graph can
    reproduce. ``shortcut`` is ``(recorded, function, args, expected)``: where the recorded
    value is ``recorded``, a replay tests ``function(*args) == expected`` instead (one C call
    for a reader written in Python)."""

    what: str
    getter: str  # torch's name for it: what the torch-side helper's SETTINGS_COVERED names
    function: Callable
    args: tuple = ()
    returns_list: bool = False
    required: object = ANY
    refusal: str = ""
    shortcut: tuple | None = None

    def read(self) -> object:
        value = self.function(*self.args)
        return tuple(value) if self.returns_list else value


def function_modes() -> tuple:
    """The active torch function modes, innermost last: a ``torch.device`` context (``with
    torch.device(...)``, ``torch.set_default_device``) by the device it makes factory functions
    use; any other mode refuses the key (RefusedKey): a graph's replay would not call it."""
    count = torch._C._len_torch_function_stack()
    if not count:
        return ()
    from torch.utils._device import DeviceContext

    devices = []
    for position in range(count):
        mode = torch._C._get_function_stack_at(position)
        if type(mode) is not DeviceContext:
            raise _refused_key(
                f"a TorchFunctionMode ({type(mode).__module__}.{type(mode).__qualname__}) is active at the call: a "
                "graph's replay would not call it"
            )
        devices.append(mode.device)
    return tuple(devices)


#: The smallest double: zero once multiplied under flush-to-zero or denormals-are-zero.
_SMALLEST_DOUBLE = 5e-324
_ONE = 1.0


def python_flush_denormal() -> bool:
    """Whether the CPU flushes denormals on this thread (``torch.set_flush_denormal``, which
    has no getter): a Python float multiplication runs on the same floating-point unit.
    csrc/replay_checks.c's ``flush_denormal`` answers the same from C."""
    return _SMALLEST_DOUBLE * _ONE == 0.0


def python_total_length(*sized: object) -> int:
    """The sum of the arguments' lengths (csrc/replay_checks.c's ``total_length``)."""
    return sum(map(len, sized))


def dispatch_keys_included() -> int:
    """The thread's local dispatch keys included, as bits: what an op dispatches to beyond its
    tensors' keys (``torch._C._IncludeDispatchKeyGuard``, ``_set_meta_in_tls_dispatch_include``,
    the Python dispatcher). The torch-side helper reads the same set in C++."""
    return torch._C._dispatch_tls_local_include_set().raw_repr()


def dispatch_keys_excluded() -> int:
    """The thread's local dispatch keys excluded, as bits: layers an op skips
    (``torch._C._AutoDispatchBelowAutograd``: outputs without autograd history;
    ``_ExcludeDispatchKeyGuard`` of ``Conjugate``: a conjugate view read unconjugated)."""
    return torch._C._dispatch_tls_local_exclude_set().raw_repr()


#: The readers of state torch has no getter for: C functions where csrc/replay_checks.c was
#: built (a settings check calls them as it calls torch's getters), else the same in Python.
flush_denormal: Callable[[], bool] = getattr(_checks, "flush_denormal", python_flush_denormal)
total_length: Callable[..., int] = getattr(_checks, "total_length", python_total_length)


#: The globals of torch.backends.opt_einsum's own module (the name is a PropModule in front of it).
_OPT_EINSUM = torch.backends.opt_einsum._get_enabled.__globals__
_MODULE_HOOKS = torch.nn.modules.module
#: The global hooks that run when a module is called (the registration hooks run at registration).
_HOOK_KINDS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")
_HOOK_REFUSAL = (
    "a global module hook is registered (torch.nn.modules.module.register_module_forward_hook and the like): a "
    "graph's replay would not call it"
)

#: The settings every key holds, in order: (what, torch's getter name, reader or None for the
#: torch._C function named, arguments, extra Setting fields).
_WANTED: list[tuple[str, str, Callable | None, tuple, dict]] = [
    ("grad mode", "is_grad_enabled", None, (), {}),
    ("inference mode", "is_inference_mode_enabled", None, (), {}),
    ("autocast (cuda)", "is_autocast_enabled", None, ("cuda",), {}),
    ("autocast dtype (cuda)", "get_autocast_dtype", None, ("cuda",), {}),
    ("autocast (cpu)", "is_autocast_enabled", None, ("cpu",), {}),
    ("autocast dtype (cpu)", "get_autocast_dtype", None, ("cpu",), {}),
    ("autocast cache", "is_autocast_cache_enabled", None, (), {}),
    ("default dtype", "get_default_dtype", None, (), {}),
    ("deterministic algorithms", "_get_deterministic_algorithms", None, (), {}),
    ("deterministic algorithms (warn only)", "_get_deterministic_algorithms_warn_only", None, (), {}),
    # torch.empty and the like fill their memory (NaN, max ints) under deterministic algorithms
    ("deterministic fill of uninitialized memory", "_get_deterministic_fill_uninitialized_memory", None, (), {}),
    ("float32 matmul precision", "_get_float32_matmul_precision", None, (), {}),
    ("cuBLAS TF32", "_get_cublas_allow_tf32", None, (), {}),
    ("fp32 precision (generic all)", "_get_fp32_precision_getter", None, ("generic", "all"), {}),
    ("fp32 precision (cuda all)", "_get_fp32_precision_getter", None, ("cuda", "all"), {}),
    ("fp32 precision (cuda matmul)", "_get_fp32_precision_getter", None, ("cuda", "matmul"), {}),
    ("fp32 precision (cuda conv)", "_get_fp32_precision_getter", None, ("cuda", "conv"), {}),
    ("fp32 precision (cuda rnn)", "_get_fp32_precision_getter", None, ("cuda", "rnn"), {}),
    ("cuBLAS fp16 reduced precision", "_get_cublas_allow_fp16_reduced_precision_reduction", None, (), {}),
    ("cuBLAS bf16 reduced precision", "_get_cublas_allow_bf16_reduced_precision_reduction", None, (), {}),
    ("cuBLAS fp16 accumulation", "_get_cublas_allow_fp16_accumulation", None, (), {}),
    ("cuDNN TF32", "_get_cudnn_allow_tf32", None, (), {}),
    ("cuDNN enabled", "_get_cudnn_enabled", None, (), {}),
    ("cuDNN benchmark", "_get_cudnn_benchmark", None, (), {}),
    ("cuDNN deterministic", "_get_cudnn_deterministic", None, (), {}),
    ("cuDNN depthwise kernel", "_get_cudnn_depthwise_kernel", None, (), {}),
    ("SDPA flash", "_get_flash_sdp_enabled", None, (), {}),
    ("SDPA memory-efficient", "_get_mem_efficient_sdp_enabled", None, (), {}),
    ("SDPA math", "_get_math_sdp_enabled", None, (), {}),
    ("SDPA cuDNN", "_get_cudnn_sdp_enabled", None, (), {}),
    ("SDPA FlashAttention-3", "_get_fa3_sdp_enabled", None, (), {}),
    ("SDPA math fp16/bf16 reduction", "_get_math_sdp_allow_fp16_bf16_reduction", None, (), {}),
    ("SDPA priority order", "_get_sdp_priority_order", None, (), {"returns_list": True}),
    ("preferred BLAS library", "_get_blas_preferred_backend", None, (), {}),
    ("preferred linalg library", "_get_linalg_preferred_backend", None, (), {}),
    ("preferred ROCm flash-attention library", "_get_rocm_fa_preferred_backend", None, (), {}),
    ("cuBLAS SM carveout", "_get_sm_carveout_experimental", None, (), {}),
    ("MIOpen immediate mode", "_get_miopen_immediate", None, (), {}),
    ("cuDNN benchmark limit", "_cuda_get_cudnn_benchmark_limit", None, (), {}),
    ("TunableOp", "_cuda_tunableop_is_enabled", None, (), {}),
    ("TunableOp tuning", "_cuda_tunableop_tuning_is_enabled", None, (), {}),
    ("TorchScript executor optimization", "_get_graph_executor_optimize", None, (), {}),
    ("TorchScript tensor-expression fuser", "_jit_texpr_fuser_enabled", None, (), {}),
    ("TorchScript tensor-expression reductions", "_jit_texpr_reductions_enabled", None, (), {}),
    ("TorchScript tensor-expression dynamic shapes", "_jit_texpr_dynamic_shape_enabled", None, (), {}),
    ("TorchScript GPU fusion", "_jit_can_fuse_on_gpu", None, (), {}),
    ("TorchScript profiled runs", "_jit_get_num_profiled_runs", None, (), {}),
    ("default device (C++)", "_get_default_device", None, (), {}),
    # torch.DisableTorchFunction turns the function modes (the default device) off too
    ("torch function handling disabled", "_is_torch_function_all_disabled", None, (), {}),
    (
        "torch function modes",
        "torch.overrides._get_current_function_mode_stack",
        function_modes,
        (),
        {"shortcut": ((), torch._C._len_torch_function_stack, (), 0)},
    ),
    (
        "torch dispatch modes",
        "_len_torch_dispatch_stack",
        None,
        (),
        {"required": 0, "refusal": "a TorchDispatchMode is active at the call: a graph's replay would not call it"},
    ),
    (
        "torch.func transform",
        "torch._C._functorch.maybe_current_level",
        getattr(torch._C._functorch, "maybe_current_level", None),
        (),
        {"required": None, "refusal": "the call is inside a torch.func transform (vmap, grad, jvp, ...)"},
    ),
    (
        "TorchScript tracing",
        "_get_tracing_state",
        None,
        (),
        {"required": None, "refusal": "torch.jit.trace is tracing the call: a graph's replay would not be traced"},
    ),
    (
        "forward-mode AD",
        "torch.autograd.forward_ad._current_level",
        vars(torch.autograd.forward_ad).get,
        ("_current_level",),
        {
            "required": -1,
            "refusal": "forward-mode AD is active (inside torch.autograd.forward_ad.dual_level()): a graph would drop "
            "the tangents of dual tensors",
        },
    ),
    (
        "global module hooks",
        "torch.nn.modules.module._global_*_hooks",
        total_length,
        tuple(getattr(_MODULE_HOOKS, f"_global_{name}") for name in _HOOK_KINDS),
        {"required": 0, "refusal": _HOOK_REFUSAL},
    ),
    (
        "MHA fast path",
        "torch.backends.mha.get_fastpath_enabled",
        vars(torch.backends.mha).get,
        ("_is_fastpath_enabled",),
        {},
    ),
    *(
        (f"opt_einsum {name}", f"torch.backends.opt_einsum.{name}", _OPT_EINSUM.get, (name,), {})
        for name in ("enabled", "strategy")
        if torch.backends.opt_einsum.is_available()  # else torch never reads them (and cannot set them)
    ),
    ("flush denormal", "torch.set_flush_denormal", flush_denormal, (), {}),
    # the thread's dispatch key sets: inference mode and autocast are among them, and so is every
    # guard that makes an op skip a layer (autograd, conjugation) or reach another (Meta, Python)
    ("thread-local dispatch keys included", "_dispatch_tls_local_include_set", dispatch_keys_included, (), {}),
    ("thread-local dispatch keys excluded", "_dispatch_tls_local_exclude_set", dispatch_keys_excluded, (), {}),
    (
        "flash-attention implementation",
        "torch.nn.attention.current_flash_attention_impl",
        None if _flash_registry is None else vars(_flash_registry).get,
        ("_FLASH_ATTENTION_ACTIVE",),  # (name, handle) of activate_flash_attention_impl, or None
        {},
    ),
]

#: torch >= 2.9's reader of its per-backend float32 precisions (``torch.backends.fp32_precision``,
#: ``torch.backends.cuda.matmul.fp32_precision``, ``torch.backends.cudnn.fp32_precision``,
#: ``.cudnn.conv``/``.cudnn.rnn``, ``torch.backends.mkldnn.*``); None in an older torch.
_FP32_PRECISION = getattr(torch._C, "_get_fp32_precision_getter", None)
#: The (backend, operation) pairs it reads: each is keyed as stored (``"none"`` defers to the
#: backend's ``"all"``, which defers to the generic one), so the precision every op uses follows.
#: Not the ``mkldnn`` ones: oneDNN runs CPU ops, and a graph holds GPU work only (a region's
#: CPU tensor work is refused or runs eagerly under the settings of the moment), so they change
#: nothing a replay does.
_FP32_PRECISIONS = tuple(args for what, getter, _, args, _ in _WANTED if getter == "_get_fp32_precision_getter")
#: The legacy TF32 getters those values replace where they exist. Why: torch >= 2.9 keeps the
#: TF32 state in the per-backend map (the legacy setters write it: set_float32_matmul_precision,
#: cuda.matmul.allow_tf32, cudnn.allow_tf32), and its legacy getters only answer while they
#: agree with it: once the new API was used (before or after replay was imported) they raise
#: RuntimeError ("mix of the legacy and new APIs"), an exception on every key and replay.
_SUPERSEDED_BY_FP32_PRECISION = frozenset({"float32 matmul precision", "cuBLAS TF32", "cuDNN TF32"})


def _settings() -> list[Setting]:
    """A Setting for every entry of ``_WANTED`` this torch has. Settings the installed torch
    does not have (no reader function, a float32-precision pair it does not know) are left
    out; a reader it has is never left out, even one that fails now (torch_modes then refuses
    the call: RefusedKey, the session runs it eagerly with a warning, rather than a key
    without it)."""
    settings = []
    for what, getter, function, args, extra in _WANTED:
        if _FP32_PRECISION is not None and what in _SUPERSEDED_BY_FP32_PRECISION:
            continue
        if _FP32_PRECISION is None and getter == "_get_fp32_precision_getter":
            continue
        if function is None:
            function = getattr(torch._C, getter, None) or getattr(torch, getter, None)
        if function is None:
            continue  # not a setting of this torch
        if function is _FP32_PRECISION:
            try:  # the new API never refuses a pair it knows (no legacy state to disagree with)
                function(*args)
            except (RuntimeError, ValueError, TypeError):
                continue  # a backend or operation this torch does not have
        settings.append(Setting(what, getter, function, args, **extra))
    return settings


_SETTINGS = _settings()
MODE_NAMES = tuple(setting.what for setting in _SETTINGS)


def _unreadable_settings() -> list[tuple[str, BaseException]]:
    """The settings whose reader raises now, with what it raised (read one by one: the slow
    path after a reading failed). A reader refusing the state (RefusedKey) is not one."""
    failed = []
    for setting in _SETTINGS:
        try:
            setting.read()
        except RefusedKey:
            continue
        except Exception as error:
            failed.append((setting.what, error))
    return failed


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:200] if lines else type(error).__name__


def _describe_unreadable(failed: list[tuple[str, BaseException]], error: BaseException) -> str:
    if not failed:  # it failed once and not again: say what it raised
        return f"a torch setting could not be read ({type(error).__name__}: {_first_line(error)})"
    return "; ".join(
        f"the torch setting {what} cannot be read ({type(e).__name__}: {_first_line(e)})" for what, e in failed
    )


def _unreadable(error: BaseException) -> None:
    """torch_modes failed: raise RefusedKey (the session runs the call eagerly and warns),
    never a key without the setting. Why: a graph recorded under a setting the key does not
    hold would serve calls made under another value of it."""
    if isinstance(error, RefusedKey):
        raise error
    reason = _describe_unreadable(_unreadable_settings(), error)
    raise _refused_key(f"{reason}: no graph may serve a call while a setting it bakes cannot be read") from error


def _refuse_required(modes: tuple) -> None:
    """A setting torch_modes read has a value no graph may be recorded under: say which."""
    for setting, value in zip(_SETTINGS, modes):
        if setting.required is not ANY and value != setting.required:
            raise _refused_key(f"{setting.refusal} ({setting.what}: {value!r})")


def _call_source(number: int, setting: Setting, namespace: dict) -> str:
    """``_m3(_m3_arg0)``: the reader called with its arguments bound by name."""
    namespace[f"_m{number}"] = setting.function
    names = []
    for position, value in enumerate(setting.args):
        namespace[f"_m{number}_arg{position}"] = value
        names.append(f"_m{number}_arg{position}")
    return f"_m{number}({', '.join(names)})"


def _make_torch_modes() -> Callable[[], tuple]:
    """One generated function reading every setting into a tuple (a call per setting, no loop)
    and then comparing the settings that have a required value with it; a reader that raises,
    or a value not the required one, raises RefusedKey naming the setting."""
    namespace: dict[str, object] = {"_tuple": tuple, "_unreadable": _unreadable, "_refuse": _refuse_required}
    calls, required = [], []
    for number, setting in enumerate(_SETTINGS):
        call = _call_source(number, setting, namespace)
        calls.append(f"_tuple({call}), " if setting.returns_list else f"{call}, ")
        if setting.required is not ANY:
            namespace[f"_r{number}"] = setting.required
            required.append(f"modes[{number}] != _r{number}")
    source = (
        "def torch_modes():\n"
        "    try:\n"
        f"        modes = ({''.join(calls)})\n"
        "    except Exception as error:\n"
        "        _unreadable(error)\n"
        f"    if {' or '.join(required) or 'False'}:\n"
        "        _refuse(modes)\n"
        "    return modes\n"
    )
    return generated.define(source, "<replay torch modes>", namespace)["torch_modes"]


torch_modes: Callable[[], tuple] = _make_torch_modes()
torch_modes.__doc__ = (
    "The global torch settings in force now, in MODE_NAMES order; RefusedKey when one cannot be read or has a "
    "value no graph may be recorded under."
)

#: Settings whose unreadability a replay check has warned about (once each).
_WARNED_UNREADABLE: set[str] = set()


def _unreadable_in_check() -> bool:
    """A replay's settings check could not read a setting (or a reader refused the state): the
    replay is refused (True: the graph declines, the call runs eagerly), with a ReplayWarning
    once per setting that cannot be read. The C check and the generated one both call it, in
    place of raising."""
    failed = _unreadable_settings()
    new = [what for what, _ in failed if what not in _WARNED_UNREADABLE]
    if new:
        _WARNED_UNREADABLE.update(new)
        reason = _describe_unreadable(failed, RuntimeError("it raised while checked"))
        warnings.warn(
            ReplayWarning(f"{reason}: replays are refused (the calls run eagerly) while it cannot be read"),
            stacklevel=3,
        )
    return True


def describe_mode_change(recorded: tuple, now: tuple) -> str:
    changed = [f"{name} {a!r} -> {b!r}" for name, a, b in zip(MODE_NAMES, recorded, now) if a != b]
    return ", ".join(changed) or "none"


# --- the check every replay makes -------------------------------------------------------------
#: How a test compares a reader's value with the recorded one (csrc/replay_checks.c's ways):
#: identity (bools, None, dtypes: singletons), equality (strings, lists, ints), a pybind enum by
#: its int ``.value`` (their ``!=`` is slower than reading the int).
_IDENTITY, _EQUALITY, _ENUM_VALUE = "i", "e", "v"
#: Values a reader returns as the same object whenever the setting is the same.
_SINGLETON_TYPES = (bool, type(None), torch.dtype)
#: The settings that change what an op computes only while autocast is on (for CUDA or the CPU).
_AUTOCAST_SETTINGS = frozenset(
    {"autocast (cuda)", "autocast dtype (cuda)", "autocast (cpu)", "autocast dtype (cpu)", "autocast cache"}
)
#: One call saying whether autocast is on for any device (None in a torch without it).
_any_autocast: Callable[[], bool] | None = getattr(torch._C, "_is_any_autocast_enabled", None)


@attrs.frozen
class SettingTest:
    """One per-replay test: call ``function(*args)`` (torch's getter ``getter``) and compare
    its value with ``value`` the ``way`` given."""

    getter: str
    function: Callable
    args: tuple
    value: object
    way: str


@attrs.frozen
class SettingsProgram:
    """What a replay checks of the torch settings, read by name by csrc/replay_checks.c's
    SettingsCheck and by the generated Python check: a test per setting (``readers`` called
    with ``arguments``, compared with ``expected`` the way ``ways`` says, the first difference
    ends it), and where ``state`` is given (the torch-side helper's ``SETTINGS_READER``, a C
    function reading most settings through torch's C++ getters into an array) the C check
    answers from it: while the state equals one in which every test said "the same", only the tests it
    does not determine (``uncovered``, indices) run; any other state runs them all, and
    becomes the reference only where they all said "the same" and nothing moved meanwhile.
    So the state can only ever answer what the tests answer."""

    tests: tuple[SettingTest, ...]
    uncovered: tuple[int, ...]
    state: object | None  # the helper's SETTINGS_READER capsule

    @property
    def readers(self) -> tuple:
        return tuple(test.function for test in self.tests)

    @property
    def arguments(self) -> tuple:
        return tuple(test.args for test in self.tests)

    @property
    def expected(self) -> tuple:
        return tuple(test.value for test in self.tests)

    @property
    def ways(self) -> str:
        return "".join(test.way for test in self.tests)


class _PybindEnum(Protocol):
    value: int


def _is_pybind_enum(value: object) -> TypeGuard[_PybindEnum]:
    """A pybind11 enum member (torch's preferred-library settings): its ``.value`` is its int."""
    return hasattr(type(value), "__members__") and isinstance(getattr(value, "value", None), int)


def _test_of(setting: Setting, value: object) -> SettingTest:
    """The per-replay test of one setting recorded with ``value``."""
    if setting.shortcut is not None and setting.shortcut[0] == value:
        _, function, args, expected = setting.shortcut
        return SettingTest(getattr(function, "__name__", setting.getter), function, args, expected, _EQUALITY)
    if setting.returns_list:
        way, value = _EQUALITY, list(value)
    elif isinstance(value, _SINGLETON_TYPES):
        way = _IDENTITY
    elif _is_pybind_enum(value):
        way, value = _ENUM_VALUE, value.value
    else:
        way = _EQUALITY
    return SettingTest(setting.getter, setting.function, setting.args, value, way)


def setting_tests(recorded: tuple) -> list[SettingTest]:
    """The per-replay tests of ``recorded`` (a ``torch_modes()`` tuple), in order. Where
    autocast was off for both CUDA and the CPU, one call checks that it is still off for every
    device (``torch._C._is_any_autocast_enabled``) instead of the five autocast settings: the
    autocast dtypes and cache change nothing while autocast is off (the key, which holds every
    setting, still tells such calls apart on the eager path)."""
    tests: list[SettingTest] = []
    values = dict(zip(MODE_NAMES, recorded, strict=True))
    autocast_off = (
        _any_autocast is not None
        and _AUTOCAST_SETTINGS <= values.keys()
        and values["autocast (cuda)"] is False
        and values["autocast (cpu)"] is False
    )
    if autocast_off:
        tests.append(SettingTest("_is_any_autocast_enabled", _any_autocast, (), False, _IDENTITY))
    for setting, value in zip(_SETTINGS, recorded, strict=True):
        if not (autocast_off and setting.what in _AUTOCAST_SETTINGS):
            tests.append(_test_of(setting, value))
    return tests


def settings_program(recorded: tuple, state_reader: ModuleType | None = None) -> SettingsProgram:
    """The program of ``recorded``'s check; ``state_reader`` the torch-side helper (its
    ``settings_state`` and ``SETTINGS_COVERED``), or None for a check that runs every test."""
    tests = tuple(setting_tests(recorded))
    if state_reader is None:
        return SettingsProgram(tests, tuple(range(len(tests))), None)
    covered = set(state_reader.SETTINGS_COVERED)
    getters = {getter for getter, _ in covered}  # first: some tests' arguments are not hashable (a dict)
    uncovered = tuple(
        i for i, test in enumerate(tests) if test.getter not in getters or (test.getter, test.args) not in covered
    )
    return SettingsProgram(tests, uncovered, state_reader.SETTINGS_READER)


_modes_changed_cache: dict[tuple, Callable[[], bool]] = {}  # (recorded, the C type or None, helper) -> check


def modes_changed(recorded: tuple, *, compiled: bool = True, watch: bool = True) -> Callable[[], bool]:
    """A function telling whether any torch setting differs from ``recorded`` (a
    ``torch_modes()`` tuple) in a way that can change what a region computes: replay's
    per-call check. Two ways, both running the same :class:`SettingsProgram`:

    - csrc/replay_checks.c's SettingsCheck where that C helper was built, answering from the
      torch-side helper's settings state where that is loaded too (``watch``; see
      :class:`SettingsProgram`);
    - a generated Python function of the same tests (``JITCORE_NATIVE=0``, ``compiled=False``).

    Made once per distinct recorded tuple and helper. Where a setting cannot be read (its
    reader raises), both say True, a change, so the replay is refused and the call runs
    eagerly, and warn once per setting (:func:`_unreadable_in_check`): never a replay checked
    without it. A state the key refuses (a dispatch mode pushed since) is a change too."""
    native = _settings_check_type() if compiled else None
    helper = _settings_helper() if native is not None and watch else None
    cache_key = (recorded, native, helper)
    check = _modes_changed_cache.get(cache_key)
    if check is None:
        program = settings_program(recorded, helper)
        if native is None:
            check = _generated_check(program)
        else:
            check = native(program, unreadable=_unreadable_in_check)
        _modes_changed_cache[cache_key] = check
    return check


def _settings_helper() -> ModuleType | None:
    """The torch-side helper where it is loaded and reads this torch's settings, else None."""
    helper = torch_native_module()
    if helper is None or getattr(helper, "SETTINGS_COVERED", None) is None or not hasattr(helper, "SETTINGS_READER"):
        return None
    return helper


def _settings_check_type() -> type | None:
    """replay._checks.SettingsCheck, or None where it was not built or ``JITCORE_NATIVE=0``."""
    if _SettingsCheck is None or not compiled_helpers_enabled():
        return None
    return _SettingsCheck


def _generated_check(program: SettingsProgram) -> Callable[[], bool]:
    """The program's tests as one generated ``or`` chain (the check without the C helpers)."""
    namespace: dict[str, object] = {"_unreadable": _unreadable_in_check}
    lines = []
    for number, test in enumerate(program.tests):
        name = "_any_autocast" if test.function is _any_autocast else f"_m{number}"  # named in dumps
        namespace[name] = test.function
        names = []
        for position, argument in enumerate(test.args):
            namespace[f"_m{number}_arg{position}"] = argument
            names.append(f"_m{number}_arg{position}")
        call = f"{name}({', '.join(names)})"
        namespace[f"_v{number}"] = test.value
        if test.way == _IDENTITY:
            lines.append(f"{call} is not _v{number}")
        elif test.way == _ENUM_VALUE:
            lines.append(f"{call}.value != _v{number}")
        else:
            lines.append(f"{call} != _v{number}")
    body = "\n            or ".join(lines) or "False"
    source = (
        "def modes_changed():\n"
        "    try:\n"
        f"        return (\n            {body}\n        )\n"
        "    except Exception:\n"
        "        return _unreadable()\n"
    )
    return generated.define(source, generated.source_filename("replay torch modes check"), namespace)["modes_changed"]


# --- random draws from the CPU generator ------------------------------------------------------
def settings_or_none() -> tuple | None:
    """``torch_modes()``, or None where the key would be refused (a setting unreadable, a
    state no graph holds): what :func:`setting_changed` compares a run's settings by."""
    try:
        return torch_modes()
    except RefusedKey:
        return None


def setting_changed(before: tuple | None) -> str | None:
    """The first setting a key holds (its MODE_NAMES words) that differs from ``before``
    (:func:`settings_or_none`, read before a run of the region), or None. Why it refuses a key:
    a region that sets a torch setting and leaves it set (``torch.set_default_dtype``, a TF32
    switch, ``torch.set_grad_enabled``) changes it on every eager call, and a replay, which
    runs none of the region's Python, would leave the caller's setting as it was."""
    now = settings_or_none()
    if now == before:
        return None
    if now is None or before is None:
        return "a state the key refuses (a torch function or dispatch mode, a setting unreadable)"
    return next(name for name, a, b in zip(MODE_NAMES, before, now) if a != b)


def cpu_random_state() -> torch.Tensor:
    """The default CPU generator's state, a copy: what :func:`cpu_random_advanced` compares."""
    return torch.default_generator.get_state()


def cpu_random_advanced(before: torch.Tensor) -> bool:
    """Whether the default CPU generator drew since ``before`` (:func:`cpu_random_state`) was
    read. Why it refuses a key: a CPU draw inside a region (``torch.rand(())`` on the CPU, a
    CPU tensor's ``random_``, ``random`` of numpy or Python aside) runs once, while the graph is
    recorded, and its numbers reach the graph as values (a 0-dim CPU tensor in a GPU op is a
    kernel argument): every replay would repeat them where eager draws new ones. The session
    reads the state before the observed or captured run of a key and asks this after it."""
    return not torch.equal(before, torch.default_generator.get_state())


# --- every global torch state that changes what an op computes --------------------------------
@attrs.frozen
class Handling:
    """How one global torch state is handled: ``"keyed"`` (a setting of every key, checked by
    every replay: ``names`` its MODE_NAMES), ``"refused"`` (a value no graph may be recorded
    or replayed under refuses the key: ``names`` the settings that say so, empty where a check
    function of this module does), or ``"outside"`` (it changes nothing a graph holds:
    ``why``). ``getters`` are torch's own names for it (``torch._C`` functions, or dotted
    names), which the test of this table holds torch's getters against."""

    how: str
    getters: tuple[str, ...]
    names: tuple[str, ...] = ()
    why: str = ""


def _keyed(*names: str) -> Handling:
    getters = tuple(dict.fromkeys(getter for what, getter, *_ in _WANTED if what in names))
    return Handling("keyed", getters, names)


def _refused(*names: str, getters: tuple[str, ...] = ()) -> Handling:
    getters = getters or tuple(dict.fromkeys(getter for what, getter, *_ in _WANTED if what in names))
    return Handling("refused", getters, names)


def _outside(why: str, *getters: str) -> Handling:
    return Handling("outside", getters, (), why)


_AUTOGRAD_ONLY = (
    "autograd's backward pass only: a graph holds no backward, and a key under grad mode whose outputs need "
    "autograd runs eagerly"
)
_CPU_ONLY = (
    "CPU kernels only (oneDNN, NNPACK, XNNPACK, the quantized engines, CPU threads): a graph holds the GPU's work; "
    "a region's CPU ops run eagerly or, inside a capture, once"
)
#: Every global torch state that changes what an op computes, by what it is: how it is
#: handled. tests/replay/test_torch_state.py requires every torch._C getter of such state to
#: be named here, so a torch that grows a setting fails it until the setting is handled.
GLOBAL_STATE: dict[str, Handling] = {
    "grad and inference mode": _keyed("grad mode", "inference mode"),
    "autocast": Handling(
        "keyed",
        (
            "is_autocast_enabled",
            "get_autocast_dtype",
            "is_autocast_cache_enabled",
            "_is_any_autocast_enabled",
            "is_autocast_cpu_enabled",
        ),
        tuple(sorted(_AUTOCAST_SETTINGS)),
    ),
    "autocast of other devices": _outside(
        "autocast for devices replay records nothing on (IPU, XLA)",
        "is_autocast_ipu_enabled",
        "is_autocast_xla_enabled",
    ),
    "default dtype": _keyed("default dtype"),
    "deterministic algorithms": _keyed(
        "deterministic algorithms",
        "deterministic algorithms (warn only)",
        "deterministic fill of uninitialized memory",
    ),
    "matmul precision and TF32": _keyed(
        "float32 matmul precision",
        "cuBLAS TF32",
        "cuDNN TF32",
        *(f"fp32 precision ({b} {op})" for b, op in _FP32_PRECISIONS),
    ),
    "cuBLAS reduced precision": _keyed(
        "cuBLAS fp16 reduced precision", "cuBLAS bf16 reduced precision", "cuBLAS fp16 accumulation"
    ),
    "cuBLAS SM carveout": _keyed("cuBLAS SM carveout"),
    "cuDNN": _keyed(
        "cuDNN enabled", "cuDNN benchmark", "cuDNN deterministic", "cuDNN depthwise kernel", "cuDNN benchmark limit"
    ),
    "MIOpen": _keyed("MIOpen immediate mode"),
    "SDPA backends": _keyed(
        "SDPA flash",
        "SDPA memory-efficient",
        "SDPA math",
        "SDPA cuDNN",
        "SDPA FlashAttention-3",
        "SDPA math fp16/bf16 reduction",
        "SDPA priority order",
    ),
    "preferred libraries": _keyed(
        "preferred BLAS library", "preferred linalg library", "preferred ROCm flash-attention library"
    ),
    "TunableOp": _keyed("TunableOp", "TunableOp tuning"),
    "TorchScript executor": _keyed(
        "TorchScript executor optimization",
        "TorchScript tensor-expression fuser",
        "TorchScript tensor-expression reductions",
        "TorchScript tensor-expression dynamic shapes",
        "TorchScript GPU fusion",
        "TorchScript profiled runs",
    ),
    "TorchScript code generation": _outside(
        "how the TorchScript fusers generate a fused group's code (block sizes, loop levels, LLVM on the CPU), "
        "whether a graph is inlined, its logging: not the arithmetic a fused group does (which the executor's "
        "switches, keyed, decide)",
        "_jit_get_te_cuda_pointwise_block_count",
        "_jit_get_te_cuda_pointwise_block_size",
        "_jit_get_te_cuda_pointwise_loop_levels",
        "_jit_get_te_generate_block_code",
        "_jit_get_te_must_use_llvm_cpu",
        "_jit_get_inline_everything_mode",
        "_jit_get_emit_hooks",
        "_jit_get_logging_option",
        "_jit_get_tracer_state_warn",
        "_jit_is_onnx_log_enabled",
        "_jit_symbolic_shapes_test_mode_enabled",
        "_jit_can_fuse_on_cpu",
        "_jit_can_fuse_on_cpu_legacy",
        "_jit_llga_enabled",
        "_jit_nvfuser_can_be_enabled",
        "_jit_nvfuser_enabled",  # a no-op that warns: nvFuser left TorchScript
        "_llvm_enabled",
        "_jit_texpr_fallback_allowed",  # a fused group that fails to compile runs unfused
    ),
    "default device": _keyed("default device (C++)", "torch function modes", "torch function handling disabled"),
    "MHA fast path": _keyed("MHA fast path"),
    "flash-attention implementation": _keyed("flash-attention implementation"),
    "thread-local dispatch keys": Handling(
        "keyed",
        (
            "_dispatch_tls_local_include_set",
            "_dispatch_tls_local_exclude_set",
            "_dispatch_tls_is_dispatch_key_included",
            "_dispatch_tls_is_dispatch_key_excluded",
            "_meta_in_tls_dispatch_include",
        ),
        ("thread-local dispatch keys included", "thread-local dispatch keys excluded"),
    ),
    "opt_einsum": _keyed("opt_einsum enabled", "opt_einsum strategy")
    if torch.backends.opt_einsum.is_available()
    else _outside(
        "opt_einsum is not installed: torch never reads the flags (and refuses to set them)",
        "torch.backends.opt_einsum.enabled",
        "torch.backends.opt_einsum.strategy",
    ),
    "flush denormal": _keyed("flush denormal"),
    "torch function modes other than a device": _refused(
        "torch function modes", getters=("_len_torch_function_stack", "_get_function_stack_at")
    ),
    "torch dispatch modes": _refused(
        "torch dispatch modes", getters=("_len_torch_dispatch_stack", "_get_dispatch_mode", "_get_dispatch_stack_at")
    ),
    "torch.func transforms": _refused(
        "torch.func transform",
        getters=("torch._C._functorch.maybe_current_level", "_are_functorch_transforms_active"),
    ),
    "torch.jit tracing": _refused("TorchScript tracing", getters=("_get_tracing_state", "_is_tracing")),
    "forward-mode AD": _refused(
        "forward-mode AD", getters=("torch.autograd.forward_ad._current_level", "_is_fwd_grad_enabled")
    ),
    "global module hooks": _refused("global module hooks"),
    "the CPU generator": Handling("refused", ("torch.default_generator",), (), "cpu_random_advanced"),
    "autograd": _outside(
        _AUTOGRAD_ONLY,
        "is_anomaly_enabled",
        "is_anomaly_check_nan_enabled",
        "_is_multithreading_enabled",
        "_is_grad_layout_enforcement_enabled",
        "_is_view_replay_enabled",
        "_get_autograd_fallback_mode",
    ),
    "CPU kernels": _outside(
        _CPU_ONLY,
        "_get_mkldnn_enabled",
        "_get_mkldnn_deterministic",
        "_get_onednn_allow_tf32",
        "_get_cpu_allow_fp16_reduced_precision_reduction",
        "_get_nnpack_enabled",
        "_is_xnnpack_enabled",
        "_get_qengine",
        "get_num_threads",
        "_get_cpu_capability",
    ),
    "DTensor": _outside(
        "DTensor's implicit replication: DTensors are tensor subclasses, refused as arguments",
        "_get_dtensor_allow_implicit_replication",
    ),
    "functionalization": _outside(
        "whether functionalization re-applies views: only functional tensors (a subclass, refused as an argument, "
        "or torch.func.functionalize, a refused transform) run it",
        "_functionalization_reapply_views_tls",
    ),
    "activation checkpointing": _outside(
        "the graph-execution group of torch.utils.checkpoint: which recomputation a backward pass makes",
        "_get_graph_exec_group",
    ),
    "PrivateUse1 SDPA": _outside(
        "the SDPA backend of out-of-tree (PrivateUse1) devices: replay records CUDA and HIP",
        "_get_overrideable_sdp_enabled",
    ),
    "torch function for subclasses": _outside(
        "tensor subclasses are refused as arguments; DisableTorchFunctionSubclass leaves plain tensors and the "
        "function modes alone (DisableTorchFunction, which does not, is keyed)",
        "_is_torch_function_enabled",
        "_is_torch_function_mode_enabled",
        "_get_torch_function_state",
    ),
    "warnings and diagnostics": _outside(
        "warnings, backtraces and checks that raise: no value changes",
        "_get_warnAlways",
        "_get_backcompat_broadcast_warn",
        "_get_backcompat_keepdim_warn",
        "_get_cpp_backtrace",
        "_cuda_get_sync_debug_mode",
        "_get_check_sparse_tensor_invariants",
        "_get_cudnn_batch_norm_reserve_space_size",
        "_cuda_get_conv_benchmark_empty_cache",
    ),
}
