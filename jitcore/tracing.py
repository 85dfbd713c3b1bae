"""Tracing a launcher once, on a cache miss.

The launcher runs with :class:`TracedTensor` arguments (dynamic sizes and strides are
:class:`~jitcore.symbolic.Sym` values) and symbolic runtime scalars. Each ``kernel[grid,
block](...)`` it makes is checked against the kernel's parameter list and recorded as a
:class:`TraceLaunch`, with the provenance of every parameter. Nothing is launched.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from jitcore import dtypes, symbolic
from jitcore.backends import abi
from jitcore.backends.base import DeviceLimits, LoadedFunction
from jitcore.errors import ArgumentError, LaunchConfigError, SymbolicValueError
from jitcore.symbolic import Sym

_local = threading.local()


def current_trace() -> Trace | None:
    return getattr(_local, "trace", None)


@attrs.define
class Leaf:
    """How generated code reads one symbolic leaf from the raw arguments."""

    variable: str
    arg_index: int
    arg_name: str
    kind: str  # "size", "stride", "numel", "scalar"
    dim: int = -1


@attrs.define
class ParamSource:
    """Where a kernel parameter's value comes from, in trace terms."""

    kind: str  # "pointer", "value", "constant"
    arg_index: int | None = None  # pointer: which launcher argument
    offset: object = 0  # pointer: element offset (int or Sym)
    itemsize: int = 0
    value: object = None  # value: Sym; constant: Python value


@attrs.define
class TraceLaunch:
    kernel: object  # KernelSpecialization
    function: LoadedFunction
    grid: tuple
    block: tuple
    shared: object
    sources: list[ParamSource]


class Trace:
    """What one run of a launcher did, plus what generated code must read to redo it."""

    def __init__(
        self, owner: str, device: int, device_name: str, limits: DeviceLimits, param_names: Sequence[str], loader
    ):
        self.owner = owner
        self.device = device
        self.device_name = device_name
        self.limits = limits
        self.param_names = tuple(param_names)
        self.loader = loader  # callable(specialization) -> LoadedFunction on self.device
        self.leaves: dict[str, Leaf] = {}
        self.launches: list[TraceLaunch] = []

    def __enter__(self) -> Trace:
        if current_trace() is not None:
            raise RuntimeError("a jit launcher called another jit function while being traced")
        _local.trace = self
        return self

    def __exit__(self, *exc) -> None:
        _local.trace = None

    def leaf(self, arg_index: int, kind: str, dim: int = -1, *, is_float: bool = False) -> Sym:
        name = self.param_names[arg_index]
        variable = {
            "size": f"{name}_size{dim}",
            "stride": f"{name}_stride{dim}",
            "numel": f"{name}_numel",
            "scalar": name,
        }[kind]
        label = {
            "size": f"{name}.shape[{dim}]",
            "stride": f"{name}.stride({dim})",
            "numel": f"{name}.numel()",
            "scalar": name,
        }[kind]
        self.leaves.setdefault(variable, Leaf(variable, arg_index, name, kind, dim))
        return Sym.leaf(variable, label, is_float=is_float)

    # --- launches ------------------------------------------------------------------------
    def record_launch(self, kernel, grid, block, shared, args: Sequence[object]) -> None:
        params = kernel.param_types
        label = kernel.name_expression
        if len(args) != len(params):
            listing = ", ".join(p.describe() for p in params)
            raise ArgumentError(f"{label} takes {len(params)} arguments ({listing}), got {len(args)}")
        sources = [self._source(kernel, index, param, value) for index, (param, value) in enumerate(zip(params, args))]
        grid3 = _dims(grid, "grid", label)
        block3 = _dims(block, "block", label)
        if isinstance(shared, bool) or not isinstance(shared, (int, Sym)):
            raise LaunchConfigError(f"{label}: shared memory must be an int number of bytes, got {shared!r}")
        if isinstance(shared, Sym) and shared.is_float:
            raise LaunchConfigError(f"{label}: shared memory size {shared.describe()} is not an integer")
        function = self.loader(kernel)
        check_static_config(label, grid3, block3, shared, self.limits, function)
        self.launches.append(TraceLaunch(kernel, function, grid3, block3, shared, sources))

    def _source(self, kernel, index: int, param: abi.ParamType, value: object) -> ParamSource:
        where = f"argument {index} ({param.describe()}) of {kernel.name_expression}"
        if isinstance(value, TracedTensor):
            if not param.is_pointer:
                raise ArgumentError(f"{where}: got a tensor for a parameter passed by value")
            if not param.accepts_dtype(value.jdtype.name):
                raise ArgumentError(
                    f"{where}: tensor {value.arg_name!r} has dtype {value.jdtype.name}, which "
                    f"a {param.pointee}* cannot take"
                )
            return ParamSource("pointer", value.arg_index, value.offset, value.jdtype.itemsize)
        if isinstance(value, torch.Tensor) or hasattr(value, "__dlpack__") or hasattr(value, "__cache_signature__"):
            raise ArgumentError(
                f"{where}: this tensor is not an argument of the launcher; pass every tensor a "
                "kernel uses as a launcher argument (a tensor read at trace time would be baked "
                "into the call state)"
            )
        if value is None:
            if not param.is_pointer:
                raise ArgumentError(f"{where}: None is only accepted for pointer parameters (nullptr)")
            return ParamSource("constant", value=0)
        if isinstance(value, Sym):
            if param.is_pointer:
                raise ArgumentError(f"{where}: expects a tensor, got the value {value.describe()}")
            if value.is_float and param.kind in ("int", "uint", "bool"):
                raise ArgumentError(f"{where}: {value.describe()} is a float; the parameter is an integer")
            return ParamSource("value", value=value)
        if param.is_pointer:
            raise ArgumentError(f"{where}: expects a tensor, got {type(value).__qualname__}")
        if not abi.accepts_scalar(param, value):
            raise ArgumentError(f"{where}: cannot take a {type(value).__qualname__} ({value!r}) without a lossy cast")
        if isinstance(value, np.generic):
            value = value.item()
        return ParamSource("constant", value=value)


def _dims(value: object, what: str, label: str) -> tuple:
    dims = value if isinstance(value, tuple) else (value,)
    if not 1 <= len(dims) <= 3:
        raise LaunchConfigError(f"{label}: {what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    for dim in dims:
        if isinstance(dim, bool) or not isinstance(dim, (int, Sym)) or (isinstance(dim, Sym) and dim.is_float):
            raise LaunchConfigError(f"{label}: {what} dimensions must be ints, got {value!r}")
    return tuple(dims) + (1,) * (3 - len(dims))


def check_static_config(
    label: str, grid: tuple, block: tuple, shared: object, limits: DeviceLimits, function: LoadedFunction
) -> None:
    """Check every static part of a launch configuration against the device's limits."""
    for axis, (size, limit) in enumerate(zip(grid, limits.max_grid)):
        if symbolic.is_static(size) and not 0 < size <= limit:
            raise LaunchConfigError(f"{label}: grid dimension {'xyz'[axis]} is {size}; it must be in 1..{limit}")
    for axis, (size, limit) in enumerate(zip(block, limits.max_block)):
        if symbolic.is_static(size) and not 0 < size <= limit:
            raise LaunchConfigError(f"{label}: block dimension {'xyz'[axis]} is {size}; it must be in 1..{limit}")
    if all(symbolic.is_static(b) for b in block):
        threads = block[0] * block[1] * block[2]
        limit = min(limits.max_threads_per_block, function.max_threads_per_block or limits.max_threads_per_block)
        if threads > limit:
            raise LaunchConfigError(f"{label}: a block of {threads} threads exceeds this kernel's limit of {limit}")
    if symbolic.is_static(shared):
        available = limits.max_shared_per_block_optin - function.static_shared_bytes
        if not 0 <= shared <= available:
            raise LaunchConfigError(
                f"{label}: {shared} bytes of dynamic shared memory requested; the device allows "
                f"{available} for this kernel"
            )


def _normalize_index(index: object, ndim: int) -> list:
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(1 for i in items if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = ndim - (len(items) - 1)
        items[at : at + 1] = [slice(None)] * fill
    if len(items) > ndim:
        raise IndexError(f"too many indices for a {ndim}-d tensor")
    return items + [slice(None)] * (ndim - len(items))


class TracedTensor:
    """A launcher's view of a tensor argument while it is traced.

    Static sizes and strides are ints; dynamic ones are symbolic. Supports what launchers
    need: ``dtype``, ``shape``/``size()``, ``stride()``, ``numel()``, ``ndim``/``dim()``,
    ``element_size()``, ``device`` and basic indexing (ints and slices with a positive step),
    which yields a view whose element offset is carried to the kernel's pointer parameter.
    """

    __slots__ = (
        "trace",
        "arg_index",
        "arg_name",
        "jdtype",
        "dtype",
        "shape",
        "_strides",
        "offset",
        "_numel",
        "device",
        "is_view",
    )

    def __init__(
        self,
        trace: Trace,
        arg_index: int,
        jdtype: dtypes.DType,
        shape: tuple,
        strides: tuple,
        device: torch.device,
        *,
        offset: object = 0,
        numel: object = None,
        is_view: bool = False,
    ):
        self.trace = trace
        self.arg_index = arg_index
        self.arg_name = trace.param_names[arg_index]
        self.jdtype = jdtype
        self.dtype = jdtype.torch_dtype
        self.shape = tuple(shape)
        self._strides = tuple(strides)
        self.offset = offset
        self._numel = numel
        self.device = device
        self.is_view = is_view

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def stride(self, dim: int | None = None):
        return self._strides if dim is None else self._strides[dim]

    def element_size(self) -> int:
        return self.jdtype.itemsize

    def numel(self):
        if self._numel is not None:
            return self._numel
        total: object = 1
        for size in self.shape:
            total = total * size
        return total

    def data_ptr(self):
        raise ArgumentError(
            f"{self.arg_name}.data_ptr() inside a launcher: pass the tensor itself to the kernel; "
            "its pointer is read on every call"
        )

    def __getitem__(self, index: object) -> TracedTensor:
        items = _normalize_index(index, self.ndim)
        offset, shape, strides = self.offset, [], []
        for dim, item in enumerate(items):
            size, stride = self.shape[dim], self._strides[dim]
            if isinstance(item, slice):
                step = 1 if item.step is None else item.step
                if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
                    raise IndexError(f"slice step must be a positive int, got {item.step!r}")
                if symbolic.is_static(size) and all(symbolic.is_static(v) for v in (item.start, item.stop)):
                    start, stop, _ = slice(item.start, item.stop, step).indices(size)
                    length = max(0, -(-(stop - start) // step))
                else:
                    # Python clamps slice bounds to the size; so does the symbolic view.
                    start = 0 if item.start is None else symbolic.minimum(_bound(item.start, size, 0), size)
                    stop = size if item.stop is None else symbolic.minimum(_bound(item.stop, size, size), size)
                    length = symbolic.cdiv(stop - start, step) if step > 1 else stop - start
                    if item.start is not None and item.stop is not None:
                        length = symbolic.maximum(length, 0)
                offset = offset + start * stride
                shape.append(length)
                strides.append(stride * step)
            elif isinstance(item, (int, Sym)) and not isinstance(item, bool):
                if isinstance(item, int) and item < 0:
                    item = size + item
                offset = offset + item * stride
            else:
                raise IndexError(f"unsupported index {item!r} in a launcher (ints and slices only)")
        return TracedTensor(
            self.trace,
            self.arg_index,
            self.jdtype,
            tuple(shape),
            tuple(strides),
            self.device,
            offset=offset,
            is_view=True,
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise TypeError(
            f"{getattr(func, '__name__', func)} on a traced tensor: a @jit launcher runs once, at "
            "trace time, and only its kernel launches are replayed; do torch work outside it"
        )

    def __bool__(self):
        raise SymbolicValueError("bool() of a traced tensor inside a launcher")

    def __repr__(self) -> str:
        shape = ", ".join(str(s) if symbolic.is_static(s) else s.describe() for s in self.shape)
        return f"TracedTensor({self.arg_name}: {self.jdtype.name}[{shape}] on {self.device})"


def _bound(value: object, size: object, default: object) -> object:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, Sym)):
        raise IndexError(f"slice bounds must be ints, got {value!r}")
    if isinstance(value, int) and value < 0:
        return size + value
    return value
