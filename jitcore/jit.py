"""``@jit`` launchers: a lean-key hit path in front of traced call states.

``@jit`` returns a generated dispatcher with the launcher's own parameter list (so Python
binds arguments and reports a wrong count or an unknown keyword itself). Its source names the
arguments ``_a0``, ``_a1``, ...; the user's names are given to the compiled code's parameter
slots (:func:`~jitcore.generated.rename_parameters`), so any parameter name works, ``key``,
``_m`` or ``_MRU`` included (only ``stream``, jit's keyword, is refused). A call:

1. builds the lean key (inlined :class:`~jitcore.keys.KeyPlan` statements, the current
   device first),
2. looks the call state up in a bounded LRU cache,
3. checks the launcher's globals for drift (one ``is`` per identity-stable global),
4. calls the call state, which packs parameters and launches.

Anything unusual (a new key, a dynamic scalar, a bad argument) takes the miss path: the full
key (DLPack-built adaptors; equal to the lean key by construction and by test), then tracing,
compiling and storing the new call state. Nothing is stored when any step fails.

``compile(fn, *args)`` returns the call state itself as a pinned handle (see its docstring).
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch

from jitcore import generated, guards, keys, recorder, tensors
from jitcore.backends import Backend, get_backend
from jitcore.codegen import CallState, StateRun, never
from jitcore.drift import GlobalsSnapshot
from jitcore.errors import (
    ArgumentError,
    BackendUnavailableError,
    CaptureMissError,
    DeviceError,
    LayoutError,
    UnsupportedTensorError,
)
from jitcore.generated import dump_enabled
from jitcore.symbolic import Sym
from jitcore.tracing import Trace, TracedTensor

DEFAULT_CACHE_SIZE = 4096
_UNBUILT = object()


@attrs.frozen
class CacheInfo:
    states: int
    capacity: int
    compiles: int
    evictions: int


class JitFunction:
    """The controller behind one ``@jit`` launcher (reachable as ``launcher.jit``)."""

    def __init__(self, fn: Callable, *, cache_size: int = DEFAULT_CACHE_SIZE):
        if not callable(fn) or not hasattr(fn, "__code__"):
            raise TypeError(f"@jit expects a Python function, got {fn!r}")
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f"cache_size must be a positive int, got {cache_size!r}")
        self.fn = fn
        self.name = fn.__name__
        self.cache_size = cache_size
        self.parameters = keys.parameters_of(fn)
        if "stream" in (p.name for p in self.parameters):
            raise TypeError(f"{self.name}: a launcher parameter may not be called 'stream' (it is jit's keyword)")
        self.plan = keys.KeyPlan(self.parameters)
        # key -> the call state's generated run function (its CallState is run.call_state)
        self.states: OrderedDict[tuple, StateRun] = OrderedDict()
        self.snapshot: GlobalsSnapshot | None = None
        self.compiles = 0
        self.evictions = 0
        self._lock = threading.RLock()
        self.namespace: dict[str, object] = dict(self.plan.namespace)
        # The most recently used state and its guard, swapped as one tuple (atomic under the GIL).
        self.mru: list[tuple[Callable, Callable | None]] = [(never, None)]
        self.namespace.update(
            {
                "_STATES": self.states,
                "_touch": self.states.move_to_end,
                "_miss": self.miss,
                "_device": self._bootstrap_device,
                "_MRU": self.mru,
                "_promote": self._promote,
            }
        )
        for index, param in enumerate(self.parameters):
            if param.default is not keys._NO_DEFAULT:
                self.namespace[f"_default{index}"] = param.default
        where = f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', self.name)}"
        self.filename = generated.source_filename(f"dispatcher {where}")
        weakref.finalize(self, generated.forget_source, self.filename)
        self.dispatcher = self._make_dispatcher()

    # --- the generated hit path ----------------------------------------------------------
    def _bootstrap_device(self) -> int:
        """First call only: bind the backend's current-device reader, then use it."""
        reader = get_backend().hot_namespace["_current_device"]
        self.namespace["_device"] = reader
        return reader()

    def _dispatcher_source(self) -> str:
        names = [f"_a{i}" for i in range(len(self.parameters))]
        params = ", ".join(
            a if p.default is keys._NO_DEFAULT else f"{a}=_default{i}"
            for i, (a, p) in enumerate(zip(names, self.parameters))
        )
        args_tuple = "(" + "".join(f"{n}, " for n in names) + ")"
        call_args = ", ".join(names) + (", " if names else "")
        drift = ["    " + line for line in self.snapshot.check_lines] if self.snapshot is not None else []
        mapping = ", ".join(f"{a} = {p.name}" for a, p in zip(names, self.parameters)) or "none"
        lines = [
            f"def {generated.python_name(self.name)}({params}{', ' if params else ''}*, stream=None):",
            f"    # {generated.comment(f'dispatcher of {self.name}; arguments: {mapping}')}",
            "    _m = _MRU[0]",
            f"    if _m[0]({', '.join(names)}):",
            *["    " + line for line in drift],
            f"        return _m[1]({call_args}stream)",
            "    try:",
        ]
        lines += ["        " + line for line in self.plan.key_lines(hit_path=True, leading="_device(), ")]
        lines += [
            "        _state = _STATES[_key]",
            "    except Exception:",
            f"        return _miss({args_tuple}, stream)",
            "    _touch(_key)",
            *drift,
            "    if _state is not _m[1]:",
            f"        _promote(_key, _state, {args_tuple})",
            f"    return _state({call_args}stream)",
        ]
        return "\n".join(lines) + "\n"

    def _promote(self, key: tuple, run: StateRun, args: tuple) -> None:
        """Make ``run`` the guarded fast path (its guard is built once, from these args)."""
        state = run.call_state
        guard = getattr(state, "guard", _UNBUILT)
        if guard is _UNBUILT:
            guard = state.guard = self._make_guard(key, args)
        self.mru[0] = (guard or never, run)

    def _make_guard(self, key: tuple, args: tuple) -> Callable | None:
        """A generated ``guard(*args) -> bool`` accepting exactly arguments this state was
        compiled for (stricter than the key, never looser), or None when some argument
        cannot be guarded (adaptors, subclasses, unusual constexpr types)."""
        device, elements = key[0], key[1:]
        checks = []
        for param, element, arg in zip(self.parameters, elements, args):
            if param.constexpr:
                if type(arg) is float and (arg != arg or arg == 0.0):
                    return None  # NaN and the two zeros: == cannot tell them apart, the key can
                if type(arg) not in keys._CONSTEXPR_TYPE_NAMES and type(arg) is not float:
                    return None
                checks.append(guards.ArgumentCheck.equal(arg))
            elif isinstance(element, tensors.SignatureToken):
                if type(arg) is not torch.Tensor:
                    return None
                _dtype, shape_spec, stride_spec, *_ = element.signature
                sizes = [s if isinstance(s, int) else None for s in shape_spec]
                strides = [s if isinstance(s, int) else None for s in stride_spec]
                checks.append(guards.ArgumentCheck.tensor(arg, sizes, strides))
            elif isinstance(element, str) and type(arg) in keys.SCALAR_SIGNATURES:
                checks.append(guards.ArgumentCheck.of_class(type(arg)))
            else:
                return None
        return guards.make_guard(
            checks,
            device=device,
            current_device=self.namespace["_device"],
            description=f"guard of {self.name}",
        )

    def _compile_dispatcher(self, source: str) -> Any:  # a generated function, given the jit's attributes
        """The dispatcher function of ``source``, its parameters renamed to the user's."""
        dispatcher = generated.define(source, self.filename, self.namespace)[generated.python_name(self.name)]
        dispatcher.__code__ = generated.rename_parameters(dispatcher.__code__, [p.name for p in self.parameters])
        return dispatcher

    def _make_dispatcher(self) -> Callable:
        source = self._dispatcher_source()
        dispatcher = self._compile_dispatcher(source)
        functools.update_wrapper(dispatcher, self.fn)
        dispatcher.__wrapped__ = self.fn
        dispatcher.jit = self
        dispatcher.dump = self.dump
        dispatcher.cache_info = self.cache_info
        dispatcher.cache_clear = self.cache_clear
        self.source = source
        return dispatcher

    def _install_drift_check(self, snapshot: GlobalsSnapshot) -> None:
        """Inline the drift check into the dispatcher (same function object, new code)."""
        self.namespace.update(snapshot.namespace)
        self.snapshot = snapshot
        source = self._dispatcher_source()
        self.dispatcher.__code__ = self._compile_dispatcher(source).__code__
        self.source = source
        if dump_enabled():
            print(f"# jitcore dispatcher\n{source}")

    # --- the miss path -------------------------------------------------------------------
    def miss(self, args: tuple, stream: object = None) -> object:
        concrete, run = self._lookup(args)
        if any(a is not c for a, c in zip(args, concrete)):
            return run.call_state.run_recording(concrete, args, stream)
        return run(*concrete, stream=stream)

    def state_for(self, args: tuple) -> CallState:
        """The call state for these arguments, built if needed, without launching."""
        return self._lookup(args)[1].call_state

    def _lookup(self, args: tuple) -> tuple[tuple, StateRun]:
        """The full-key lookup: validate everything, check drift, find or build the state."""
        concrete = tuple(_unwrap_scalar(a) for a in args)
        try:
            elements = self.plan.full_key(*args)
        except (UnsupportedTensorError, LayoutError) as error:
            raise self._name_refused_tensor(error, args) from None
        backend, device = self._backend_and_device(elements)
        key = (device, *elements)
        if self.snapshot is not None:
            self.snapshot.check()
        run = self.states.get(key)
        if run is None:
            run = self._build(key, concrete, device, backend).run
        else:
            self.states.move_to_end(key)
        return concrete, run

    def _backend_and_device(self, elements: tuple) -> tuple[Backend, int]:
        """The backend and its current device; where there is none (no GPU build of torch, no
        vendor binding), jitcore's DeviceError naming the first CPU tensor argument, since
        passing a CPU tensor is then the mistake to fix first (torch's own error, that it has
        no CUDA, is the cause of an error for a launcher without one)."""
        try:
            backend = get_backend()
            return backend, backend.current_device()
        except Exception as error:
            cpu = [
                p.name
                for p, e in zip(self.parameters, elements)
                if isinstance(e, tensors.SignatureToken) and e.signature[-1] == "cpu"
            ]
            if cpu:
                raise DeviceError(
                    f"{self.name}: parameter {cpu[0]!r} is a CPU tensor, but kernels launch on a GPU and a GPU "
                    f"tensor was expected (no GPU device is usable here: {error})"
                ) from None
            if isinstance(error, BackendUnavailableError):
                raise
            raise DeviceError(f"{self.name}: no GPU device is usable here: {error}") from error

    def _name_refused_tensor(self, error: Exception, args: tuple) -> Exception:
        """``error`` (a tensor the key refused: its description says what the tensor is, not
        which argument it was) as the same exception naming the launcher and the parameter,
        found by describing each argument again; ``error`` itself where none refuses."""
        for param, value in zip(self.parameters, args):
            if param.constexpr:
                continue
            try:
                keys.argument_signature(value, param.name, full=True)
            except type(error) as found:
                return type(error)(f"{self.name}: parameter {param.name!r}: {found}")
            except Exception:
                continue  # refused otherwise: not the argument that raised this error
        return error

    def _build(self, key: tuple, args: tuple, device: int, backend) -> CallState:
        hook = recorder.current()
        if hook is not None:
            hook.miss(f"{self.name}: no call state for key {key!r}")
        elif backend.is_capturing():
            raise CaptureMissError(
                f"{self.name}: a new key during graph capture would compile inside the capture; "
                f"call it once with these argument types before capturing (key {key!r})"
            )
        with recorder.CAPTURES.shared(), self._lock:  # compiling loads a module: never during a capture
            run = self.states.get(key)
            if run is not None:
                return run.call_state
            snapshot = self.snapshot or GlobalsSnapshot(self.fn, owner=f"@jit {self.name}", prefix="_d")
            trace = Trace(
                self.name,
                device,
                backend.device_name(device),
                backend.device_limits(device),
                [p.name for p in self.parameters],
                loader=lambda kernel: kernel.function(device),
            )
            traced = [
                self._traced(trace, i, param, arg, key[i + 1])
                for i, (param, arg) in enumerate(zip(self.parameters, args))
            ]
            with trace:
                result = self.fn(*traced)
            returns = _returns(self.name, result, traced)
            state = CallState(self.name, self.compiles, key, trace, backend, returns)
            if self.snapshot is None:
                self._install_drift_check(snapshot)
            state.check_globals = self.snapshot.check
            self.states[key] = state.run
            self.compiles += 1
            while len(self.states) > self.cache_size:
                _key, evicted = self.states.popitem(last=False)
                self.evictions += 1
                if self.mru[0][1] is evicted:
                    self.mru[0] = (never, None)
            if dump_enabled():
                print(f"# jitcore call state\n{state.source}")
        return state

    def _traced(self, trace: Trace, index: int, param: keys.Parameter, arg: object, signature: Any) -> object:
        # (signature: the argument's part of the key; a tensor's is a SignatureToken)
        if param.constexpr or arg is None:
            return arg  # static for this call state (None: a left-out optional tensor, a null pointer)
        if isinstance(arg, torch.Tensor) or isinstance(arg, tensors.TensorAdaptor):
            return _traced_tensor(trace, index, arg, signature.signature)
        if hasattr(arg, "__cache_signature__"):
            return arg  # declares its own signature: static for the launcher
        if hasattr(arg, "__dlpack__"):
            raise ArgumentError(
                f"{self.name}: parameter {param.name!r} is a {type(arg).__qualname__}; wrap DLPack "
                "producers other than torch tensors with jitcore.from_dlpack(...)"
            )
        return trace.leaf(index, "scalar", is_float=isinstance(arg, (float, np.floating)), value_type=type(arg))

    # --- introspection -------------------------------------------------------------------
    def dump(self, file=None) -> str:
        """The generated dispatcher and every call state, printed and returned."""
        text = f"# dispatcher\n{self.source}"
        for run in self.states.values():
            text += f"\n# call state\n{run.source}"
        print(text, file=file)
        return text

    def cache_info(self) -> CacheInfo:
        return CacheInfo(len(self.states), self.cache_size, self.compiles, self.evictions)

    def cache_clear(self) -> None:
        with self._lock:
            self.states.clear()
            self.mru[0] = (never, None)


def _unwrap_scalar(value: object) -> object:
    carried = getattr(value, "__jit_scalar__", None)
    return carried() if carried is not None and not isinstance(value, torch.Tensor) else value


def _traced_tensor(trace: Trace, index: int, arg: object, signature: tuple) -> TracedTensor:
    from jitcore import dtypes

    dtype_name, shape_spec, stride_spec, _unit, _align, device = signature
    name = trace.param_names[index]
    if device != trace.device_name:
        where = "a CPU tensor" if device == "cpu" else f"a tensor on {device}"
        raise DeviceError(
            f"{trace.owner}: parameter {name!r} is {where}, but kernels launch on the current "
            f"device {trace.device_name}; move it there or switch devices with torch.cuda.device(...)"
        )
    shape = tuple(s if isinstance(s, int) else trace.leaf(index, "size", d) for d, s in enumerate(shape_spec))
    strides = tuple(s if isinstance(s, int) else trace.leaf(index, "stride", d) for d, s in enumerate(stride_spec))
    numel = None
    if any(isinstance(s, Sym) for s in shape):
        numel = trace.leaf(index, "numel")
    return TracedTensor(trace, index, dtypes.BY_NAME[dtype_name], shape, strides, torch.device(device), numel=numel)


def _returns(owner: str, result: object, traced: list) -> tuple[int, ...] | int | None:
    """Launchers may return None or their own (unsliced) tensor arguments."""

    def index_of(value: object) -> int:
        for i, t in enumerate(traced):
            if value is t and isinstance(t, TracedTensor):
                return i
        raise ArgumentError(
            f"{owner}: a launcher may return None or its own tensor arguments (not views or other "
            f"values), got {value!r}"
        )

    if result is None:
        return None
    if isinstance(result, tuple):
        return tuple(index_of(v) for v in result)
    return index_of(result)


def jit(fn: Callable | None = None, *, cache_size: int = DEFAULT_CACHE_SIZE) -> Callable:
    """Decorate a launcher: ``@jit`` or ``@jit(cache_size=...)``."""
    if fn is None:
        return lambda f: JitFunction(f, cache_size=cache_size).dispatcher
    return JitFunction(fn, cache_size=cache_size).dispatcher


def compile(fn: Callable, *args: object, **kwargs: object) -> Callable:
    """Trace and compile ``fn`` for ``args`` without launching; return a pinned handle.

    ``args`` and ``kwargs`` are bound to the launcher's parameters as a call of the launcher
    binds them (``inspect.Signature.bind``: keywords by name, then the launcher's defaults
    for what is left out), so ``compile(f, x, 3)`` compiles what ``f(x, 3)`` would run, a
    defaulted ``Constexpr`` at its default; a call the launcher would refuse (a missing or
    unknown argument) is Python's own ``TypeError``, naming the launcher.

    The handle is the call state itself: ``handle(*args, stream=None)`` with every argument
    positional, defaulted ones included (the handle applies no defaults: it was compiled for
    the values bound here), no key and no drift check, so it costs what the packing and the
    driver launch cost. Between calls these may change: tensor data pointers, dynamic sizes and
    strides (those a layout-dynamic or marked argument leaves dynamic), and runtime scalar
    values. These must not: dtypes, ranks, the unit-stride axis, static sizes and strides,
    scalar types, Constexpr values, the device, and the globals the launcher read. The handle
    does not check them; passing other arguments is undefined behaviour, as with a C function
    pointer. Use the ``@jit`` function itself when arguments vary.
    """
    controller = getattr(fn, "jit", None)
    if not isinstance(controller, JitFunction):
        controller = JitFunction(fn)
    try:
        bound = inspect.signature(controller.fn).bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"jitcore.compile({controller.name}, ...): {error}") from None
    bound.apply_defaults()
    return controller.state_for(bound.args).run


def hit_path_parts(launcher: Callable, *args: object, **kwargs: object) -> dict[str, Callable[[], object]]:
    """The steps of a ``@jit`` cache hit on these arguments (passed as to the launcher), each as
    a callable that runs that step alone: the hook behind the breakdown in
    ``docs/benchmarks/jit.md``.

    The dispatcher inlines every step of a hit into one generated function, so timing the
    launcher says what a hit costs but not where the time goes. The parts, in the order a hit
    (one that misses the guarded most-recent state) runs them:

    - ``"key"``: the current device and the lean key of the arguments;
    - ``"lookup"``: finding the call state in the launcher's LRU cache and moving it to the end;
    - ``"drift check"``: the check of the globals the launcher read;
    - ``"fill"``: the call state, built again for a backend whose launch is a no-op: reading
      pointers and sizes and packing the changed parameters, with no driver call.

    The call state for the arguments is built first if the launcher has none (tracing and
    compiling, as a first call would); nothing is launched, neither then nor by any part.
    The parts keep the arguments alive; they are for measuring, not for serving calls.
    """
    controller = getattr(launcher, "jit", None)
    if not isinstance(controller, JitFunction):
        raise TypeError(f"hit_path_parts expects a @jit launcher, got {launcher!r}")
    bound = inspect.signature(controller.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    args = bound.args
    state = controller.state_for(args)
    concrete = tuple(_unwrap_scalar(a) for a in args)
    device = state.backend.hot_namespace["_current_device"]
    lean_key, states, key = controller.plan.lean_key, controller.states, state.key
    backend = _NoLaunch(state.backend)
    fill = CallState(f"{controller.name}_fill", state.index, key, state.trace, backend, state.returns).run

    def lookup() -> None:
        states[key]
        states.move_to_end(key)

    return {
        "key": lambda: (device(), lean_key(*args)),
        "lookup": lookup,
        "drift check": controller.snapshot.check,
        "fill": lambda: fill(*concrete),
    }


def _no_launch(*args: object) -> tuple[int]:
    return (0,)


class _NoLaunch:
    """``backend`` as a call state sees it, with the driver launch replaced by a no-op that
    takes the same arguments (so what a call of the state costs is the fill alone)."""

    def __init__(self, backend: Backend) -> None:
        self.hot_namespace = dict(backend.hot_namespace, _no_launch=_no_launch)
        self.launch_template = (
            "_r = _no_launch({function}, {gx}, {gy}, {gz}, {bx}, {by}, {bz}, {shared}, {stream}, {params}, 0)"
        )
        self.set_dynamic_shared_limit = backend.set_dynamic_shared_limit
        self.launch_function = backend.launch_function
        self.raw_stream_handles = backend.raw_stream_handles

    def packed_launcher(self, *args: object, **kwargs: object) -> None:
        return None  # the fill packs with struct, then the no-op launch: a packed launch packs and launches at once
