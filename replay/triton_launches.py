"""Triton kernels as first-class launches of a recording (optional: Triton need not be installed).

While a region is captured, ``triton.runtime.jit.JITFunction.run`` is wrapped (installed for
the capture only, passing through on every other thread): each Triton launch of the capturing
thread is reported to the capture's recorder as a :class:`jitcore.recorder.LaunchRecord` (the
record jit launches make), with the same provenance a jit launch reports, so its pointers are
rebound and its ``dynamic(...)`` scalars and grid sizes recomputed instead of its inputs being
staged.

How a Python call maps to the kernel's C parameters (Triton 3.x, the NVIDIA launcher): the
compiled signature (``kernel.src.signature``, one type per Triton parameter) drops every
``"constexpr"`` entry (declared constexprs and ints specialized to ``1``); the rest are passed
in order, a pointer as the tensor's ``data_ptr()``, ints and bools as their C type, floats
packed to their storage type; two hidden pointers follow (global and profile scratch, NULL
when the kernel asks for none). The driver's parameter sizes (``cuFuncGetParamInfo``) must
agree with that list, and the analysis checks every byte against the captured node, so a
mapping that is wrong is refused, never used.

Triton *specializes*: an int equal to 1 becomes a constant, ints and pointers divisible by 16
get an alignment assumption, an int's type follows its range (i32, i64, u64). A replay must
not run a binary specialized for other values, so:

- each dynamic scalar a launch receives carries a check that its new value specializes exactly
  as the recorded one did (Triton's own ``specialize_impl``); otherwise the call is declined
  (runs eagerly, where Triton picks or compiles the right binary);
- each rebound pointer whose alignment the kernel specialized on carries its recorded
  16-byte divisibility, checked every replay (declined when it differs);
- a dynamic scalar reaching a ``tl.constexpr`` parameter is refused (DynamicScalarError).

What cannot be mapped (tuples, tensor descriptors, scratch memory, unknown types, a backend
other than CUDA) is left to the capture as any foreign kernel is, its inputs staged. Where
such a launch receives a dynamic scalar, it is refused (its value would be baked).
"""

from __future__ import annotations

import contextlib
import inspect
import struct
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import attrs

from jitcore.for_replay import CheckRecord, ConfigRecord, LaunchRecord, ParamLayout, ParamRecord, ParamType
from replay.dynamic import DynamicScalar
from replay.errors import DynamicScalarError

#: Set ``ENABLED[0] = False`` to leave Triton launches foreign (staged), as without this
#: module (benchmarks compare both).
ENABLED = [True]


def record_triton_launches(enabled: bool) -> bool:
    """Whether captures record Triton launches (the default) or leave them foreign, their
    inputs staged (for comparisons). Returns the previous setting."""
    previous, ENABLED[0] = ENABLED[0], bool(enabled)
    return previous


_local = threading.local()
_install_lock = threading.Lock()
_installed: list = []  # [(JITFunction class, the original run)] while a capture is on

# Triton type -> (C spelling, struct format, size, kind)
_SCALAR_TYPES = {
    "i1": ("int8_t", "b", 1, "int"),
    "i8": ("int8_t", "b", 1, "int"),
    "i16": ("int16_t", "h", 2, "int"),
    "i32": ("int32_t", "i", 4, "int"),
    "i64": ("int64_t", "q", 8, "int"),
    "u1": ("uint8_t", "B", 1, "bool"),
    "u8": ("uint8_t", "B", 1, "uint"),
    "u16": ("uint16_t", "H", 2, "uint"),
    "u32": ("uint32_t", "I", 4, "uint"),
    "u64": ("uint64_t", "Q", 8, "uint"),
    "fp16": ("uint16_t", "e", 2, "float"),
    "fp32": ("uint32_t", "f", 4, "float"),
    "f32": ("uint32_t", "f", 4, "float"),
    "fp64": ("uint64_t", "d", 8, "float"),
}
_POINTER = ParamType("void*", "Q", 8, 8, "pointer", pointee="void")


class Unmappable(Exception):
    """This launch cannot be described exactly: it stays a foreign kernel (staged)."""


@attrs.frozen
class TritonParamRecord(ParamRecord):
    """A :class:`jitcore.recorder.ParamRecord` with what Triton's specialization assumed of a
    pointer: ``aligned`` is whether its address was divisible by 16 (None: the kernel did
    not specialize on it), which a replay must keep."""

    aligned: bool | None = None


@attrs.frozen
class _Arg:
    """``scalars[k]``: the value of a launch's argument ``k`` (an evaluator, no source)."""

    k: int

    def __call__(self, scalars):
        return scalars[self.k]


def specializer(param, backend) -> object:
    """The specialization of one (non-constexpr) Triton parameter as a function of its value,
    exactly as ``triton.runtime.jit.create_function_from_signature`` computes it."""
    from triton.runtime.jit import native_specialize_impl

    is_const, align = bool(param.is_const), not param.do_not_specialize_on_alignment
    specialize = not param.do_not_specialize
    annotation = param.annotation_type
    if annotation and isinstance(annotation, str) and (annotation == "u1" or annotation[:2] in ("fp", "bf")):
        specialize = False
    if annotation and not specialize:
        return lambda value: (annotation, None)

    def spec(value):
        result = native_specialize_impl(backend, value, is_const, specialize, align)
        return (annotation, *result[1:]) if annotation else tuple(result)

    return spec


@attrs.frozen
class SpecializationCheck:
    """A launch's argument ``k`` must specialize as recorded. Expressed as an index check of
    the plan (``-size <= value < size`` passes): value 0, size 1 when it specializes as
    recorded, else 0, so a replay declines (runs eagerly) when it would not."""

    k: int
    spec: object
    recorded: tuple

    def value(self, scalars) -> int:
        return 0

    def size(self, scalars) -> int:
        try:
            return 1 if tuple(self.spec(scalars[self.k])) == self.recorded else 0
        except Exception:  # a value Triton cannot specialize: eager raises its error
            return 0


def _value(arg):
    return arg.value if isinstance(arg, DynamicScalar) else arg


def _param_type(ty: str) -> ParamType:
    if ty.startswith("*"):
        return _POINTER
    if ty not in _SCALAR_TYPES:
        raise Unmappable(f"parameter type {ty!r}")
    spelling, fmt, size, kind = _SCALAR_TYPES[ty]
    return ParamType(spelling, fmt, size, size, kind)


def _pointer_value(value) -> int:
    if value is None:
        return 0
    if hasattr(value, "data_ptr") and type(value).__module__.startswith("torch"):
        return int(value.data_ptr())
    raise Unmappable(f"a pointer argument of type {type(value).__qualname__}")


def _bound_arguments(fn, args: Sequence, kwargs: dict) -> dict:
    """The call's value of each of the kernel's parameters, by name (defaults filled in);
    launch options among ``kwargs`` left out."""
    names = fn.arg_names
    bound = fn.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
    bound.apply_defaults()
    return dict(bound.arguments)


def map_launch(fn, kernel, args: Sequence, kwargs: dict, specialization: Sequence, backend, sizes=None):
    """The C parameters of one launch: (layout, param_bytes, params, checks, Triton arguments
    in order). Pure: ``kernel`` needs ``src.signature`` and the launcher's scratch sizes;
    ``specialization`` is what Triton's binder computed (with values); ``args``/``kwargs``
    the call as made (dynamic scalars in it). Raises Unmappable."""
    names = list(fn.arg_names)
    arguments = _bound_arguments(fn, args, kwargs)
    values = [arguments[name] for name in names]
    signature = kernel.src.signature
    _refuse_unmappable_kernel(kernel)
    types, params, checks, parts = [], [], [], []
    for k, (name, param) in enumerate(zip(names, fn.params)):
        mapped = _map_parameter(
            fn, k, name, param, signature.get(name, signature.get(k)), values[k], specialization, backend, len(types)
        )
        if mapped.check is not None:
            checks.append(mapped.check)
        if mapped.type is not None:
            types.append(mapped.type)
            parts.append(mapped.data)
            params.append(mapped.record)
    for scratch in ("global_scratch", "profile_scratch"):  # the launcher's hidden pointers, NULL here
        types.append(_POINTER)
        parts.append(bytes(8))
        params.append(ParamRecord(len(types) - 1, scratch, 0, 8, "Q", "constant"))
    layout = ParamLayout.of(types)
    if sizes is not None and list(sizes) != [t.size for t in types]:
        raise Unmappable(f"the driver reports parameter sizes {list(sizes)}, expected {[t.size for t in types]}")
    params = [attrs.evolve(p, offset=layout.offsets[p.index]) for p in params]
    return layout, layout.assemble(parts), tuple(params), tuple(checks), values


def _refuse_unmappable_kernel(kernel) -> None:
    """Launches whose C parameters or launch are more than the mapping describes."""
    launcher = getattr(kernel, "_run", None)
    metadata = kernel.metadata
    if getattr(metadata, "num_ctas", 1) != 1 or getattr(metadata, "launch_cooperative_grid", False):
        raise Unmappable("a cluster or cooperative launch")
    if getattr(metadata, "launch_pdl", False) or getattr(launcher, "launch_pdl", False):
        raise Unmappable("a programmatic-dependent launch")
    for size_name in ("global_scratch_size", "profile_scratch_size"):
        if getattr(launcher, size_name, 0) or getattr(metadata, size_name, 0):
            raise Unmappable("the kernel uses scratch memory")


class _Mapped(NamedTuple):
    """One Triton parameter as the kernel's C parameters hold it: its type, bytes and record
    (None: compiled in), and the check a dynamic scalar's specialization needs (None where
    it needs none)."""

    type: ParamType | None = None
    data: bytes | None = None
    record: ParamRecord | None = None
    check: CheckRecord | None = None


def _map_parameter(fn, k: int, name: str, param, ty, value, specialization: Sequence, backend, index: int) -> _Mapped:
    """Triton parameter ``k`` (``ty``: its compiled type; ``index``: its C parameter's, if it
    has one). Raises Unmappable, or DynamicScalarError for a value that would be compiled in."""
    dynamic = isinstance(value, DynamicScalar)
    if param.is_constexpr:
        if dynamic:
            raise DynamicScalarError(
                f"dynamic scalar {value.name} reaches constexpr parameter {name!r} of Triton kernel "
                f"{fn.__name__}: its value would be compiled in (pass it as a plain argument)"
            )
        return _Mapped()
    if not isinstance(ty, str):
        raise Unmappable(f"parameter {name!r} of type {ty!r}")
    check = _specialization_check(k, name, param, value, specialization, backend) if dynamic else None
    if ty == "constexpr":
        return _Mapped(check=check)  # specialized away (an int equal to 1): checked when dynamic
    if ty.startswith("tensordesc") or ty == "nvTmaDesc":
        raise Unmappable(f"tensor descriptor parameter {name!r}")
    ptype = _param_type(ty)
    if dynamic and ty in ("fp16", "bf16"):
        raise Unmappable(f"a dynamic scalar packed to {ty} (its rounding is Triton's own)")
    if ptype.is_pointer:
        data, record = _pointer_parameter(k, name, value, specialization, index)
    else:
        data, record = _scalar_parameter(k, name, value, ptype, index)
    return _Mapped(ptype, data, record, check)


def _specialization_check(k: int, name: str, param, value: DynamicScalar, specialization: Sequence, backend):
    """The check that a dynamic scalar's every value specializes as the recorded one did."""
    recorded = tuple(specialization[k])
    spec = specializer(param, backend)
    if tuple(spec(value.value)) != recorded:
        raise Unmappable(f"parameter {name!r}: the specialization could not be reproduced")
    check = SpecializationCheck(k, spec, recorded)
    return CheckRecord((k,), check.value, check.size, f"specialization of {{{k}}}")


def _pointer_parameter(k: int, name: str, value, specialization: Sequence, index: int) -> tuple[bytes, ParamRecord]:
    """A pointer parameter's bytes and record, with the 16-byte alignment Triton specialized
    on (if it did), which every replay must keep."""
    if isinstance(value, DynamicScalar):
        raise Unmappable(f"a dynamic scalar passed as pointer {name!r}")
    address = _pointer_value(value)
    attr = specialization[k][1] if len(specialization[k]) > 1 else None
    aligned = None if attr is None else attr == "D"
    if aligned is not None and aligned != (address % 16 == 0):
        raise Unmappable(f"pointer {name!r}: alignment specialization not reproduced")
    record = TritonParamRecord(index, name, 0, 8, "Q", "pointer", arg_index=k, aligned=aligned)
    return struct.pack("<Q", address), record


def _scalar_parameter(k: int, name: str, value, ptype: ParamType, index: int) -> tuple[bytes, ParamRecord]:
    """A scalar parameter's bytes and record: a dynamic scalar's recomputed from argument
    ``k`` every replay, any other value's fixed."""
    try:
        data = struct.pack("<" + ptype.fmt, _value(value))
    except (struct.error, OverflowError, TypeError) as exc:
        raise Unmappable(f"parameter {name!r}: {exc}") from None
    if not isinstance(value, DynamicScalar):
        return data, ParamRecord(index, name, 0, ptype.size, ptype.fmt, "constant")
    record = ParamRecord(
        index, name, 0, ptype.size, ptype.fmt, "scalar", scalar_args=(k,), evaluate=_Arg(k), expression=f"{{{k}}}"
    )
    return data, record


def _grid(grid, values: dict) -> tuple:
    if callable(grid):
        grid = grid(values)
    grid = tuple(grid)
    if not 1 <= len(grid) <= 3:
        raise Unmappable(f"a grid of {len(grid)} dimensions")
    return grid + (1,) * (3 - len(grid))


def _record_launch(recorder, original, fn, args, kwargs, grid):
    """Launch through Triton with the dynamic scalars' values, then report the launch."""
    from triton.runtime import driver as triton_driver

    from jitcore.for_replay import get_backend

    backend = get_backend()
    arguments = _bound_arguments(fn, args, kwargs)
    grid3 = _grid(grid, dict(arguments))  # a copy: a grid function may change what it is given
    _refuse_dynamic_launch_options(fn, kwargs)
    has_dynamic = any(isinstance(v, DynamicScalar) for v in (*arguments.values(), *grid3))
    plain_args = [_value(a) for a in args]
    plain_kwargs = {k: _value(v) for k, v in kwargs.items()}
    plain_grid = tuple(_value(g) for g in grid3)
    device = triton_driver.active.get_current_device()
    stream = triton_driver.active.get_current_stream(device)
    triton_backend, specialization = _specialization(fn, device, plain_args, plain_kwargs)
    kernel = original(fn, *plain_args, grid=plain_grid, warmup=False, **plain_kwargs)
    try:
        if specialization is None or backend.name != "cuda" or kernel is None:
            raise Unmappable("no specialization or not CUDA")
        if hasattr(kernel, "result"):
            kernel = kernel.result()
        sizes = backend.kernel_param_sizes(int(kernel.function))
        mapped = map_launch(fn, kernel, args, kwargs, specialization, triton_backend, sizes)
    except Unmappable as exc:
        if has_dynamic:
            raise DynamicScalarError(
                f"Triton kernel {fn.__name__} receives a dynamic scalar but its launch cannot be recorded "
                f"exactly ({exc}): its value would be baked into the graph"
            ) from None
        return kernel  # a foreign kernel, as without this module: its inputs are staged
    recorder.launch(_launch_record(fn, kernel, mapped, grid3, plain_grid, device, stream))
    return kernel


def _refuse_dynamic_launch_options(fn, kwargs: dict) -> None:
    """A dynamic scalar passed as a launch option (``num_warps``...) would be compiled in."""
    names = fn.arg_names
    for name, value in kwargs.items():
        if name not in names and isinstance(value, DynamicScalar):
            raise DynamicScalarError(
                f"dynamic scalar {value.name} is Triton launch option {name!r} of {fn.__name__}: it would be baked"
            )


def _specialization(fn, device, plain_args: Sequence, plain_kwargs: dict) -> tuple[object, Sequence | None]:
    """(Triton's backend, what its binder computes for this call), as ``JITFunction.run``
    finds them; (None, None) where they cannot be had (the launch then stays foreign)."""
    try:
        _, _, _, triton_backend, binder = fn.device_caches[device]
        _, specialization, _ = binder(*plain_args, **plain_kwargs)
    except Exception:
        return None, None
    return triton_backend, specialization


def _launch_record(fn, kernel, mapped: tuple, grid3: tuple, plain_grid: tuple, device, stream) -> LaunchRecord:
    """The launch as jit launches report theirs: each dynamic grid size an extra argument
    after the kernel's own, recomputed from it every replay."""
    layout, param_bytes, params, checks, values = mapped
    config = []
    extra = list(values)
    for axis, size in enumerate(grid3):
        if isinstance(size, DynamicScalar):
            config.append(ConfigRecord(f"grid_{'xyz'[axis]}", (len(extra),), _Arg(len(extra)), f"{{{len(extra)}}}"))
            extra.append(size)
    metadata = kernel.metadata
    return LaunchRecord(
        jit_function=f"triton:{fn.__name__}",
        kernel=f"{fn.__name__} (Triton)",
        function=int(kernel.function),
        device=int(device),
        grid=tuple(int(g) for g in plain_grid),
        block=(int(metadata.num_warps) * 32, 1, 1),
        shared_bytes=int(metadata.shared),
        layout=layout,
        param_bytes=param_bytes,
        params=params,
        args=tuple(extra),
        stream=int(stream),
        launched=all(int(g) > 0 for g in plain_grid),
        dynamic_config=tuple(config),
        checks=checks,
    )


def _wrap(original):
    def run(self, *args, grid, warmup, **kwargs):
        recorder = getattr(_local, "recorder", None)
        if recorder is None or warmup:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        _local.recorder = None  # a nested run (Triton makes none) passes through
        try:
            return _record_launch(recorder, original, self, args, kwargs, grid)
        finally:
            _local.recorder = recorder

    # (attributes on a wrapper function: the type checker has no way to declare them on a def)
    run.__wrapped__ = original  # type: ignore[attr-defined]
    run._replay_triton_hook = True  # type: ignore[attr-defined]
    return run


@contextlib.contextmanager
def recording(recorder) -> Iterator[None]:
    """Report this thread's Triton launches to ``recorder`` for the block (a no-op where
    Triton was never imported, or with :data:`ENABLED` off). Installs the wrapper of
    ``JITFunction.run`` for the block; other threads' launches pass through it unchanged."""
    module = sys.modules.get("triton.runtime.jit")
    if module is None or not ENABLED[0]:
        yield
        return
    cls = module.JITFunction
    with _install_lock:
        original = cls.run
        installed = not getattr(original, "_replay_triton_hook", False)
        if installed:
            cls.run = _wrap(original)
    previous = getattr(_local, "recorder", None)
    _local.recorder = recorder
    try:
        yield
    finally:
        _local.recorder = previous
        if installed:
            with _install_lock:
                if getattr(cls.run, "__wrapped__", None) is original:
                    cls.run = original


def parameter_names(fn) -> list[str]:
    """The kernel's Python parameter names (for messages and tests)."""
    return list(inspect.signature(fn.fn).parameters)
