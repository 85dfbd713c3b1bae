"""Tracing a launcher once, on a cache miss.

The launcher runs with :class:`TracedTensor` arguments (dynamic sizes and strides are
:class:`~jitcore.symbolic.Sym` values) and symbolic runtime scalars. Each ``kernel[grid,
block](...)`` it makes is checked against the kernel's parameter list and recorded as a
:class:`TraceLaunch`, with the provenance of every parameter. Nothing is launched.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from typing import Any

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

    variable: str  # the generated code's local: ``_a{arg_index}`` plus a suffix, never a user name
    arg_index: int
    arg_name: str
    kind: str  # "size", "stride", "numel", "scalar"
    dim: int = -1
    value_type: type | None = None  # scalars: the Python type of the argument traced with


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
    kernel: Any
    function: LoadedFunction
    grid: tuple
    block: tuple
    shared: object
    sources: list[ParamSource]


@attrs.define
class IndexCheck:
    """An integer index that only the call state can bounds-check.

    Fields:

    - ``value``: the index as the launcher wrote it (int or :class:`Sym`), before a negative
      value is counted from the end;
    - ``size``: the size of the indexed dimension at that point (int or :class:`Sym`);
    - ``dim``: the dimension torch's message names (the position of the index in the
      subscript, as torch counts it);
    - ``message``: torch's IndexError text as a ``str.format`` template with ``{value}`` and
      ``{size}`` (see :meth:`format`).

    The requirement is ``-size <= value < size`` when the call state runs; torch raises
    IndexError otherwise, and so must generated code, before any launch (a violating index
    would give the kernel a pointer outside the tensor). ``value`` and ``size`` are
    symbolic when they depend on runtime scalars or dynamic sizes, so :meth:`violated`
    takes the concrete leaf values (the same mapping :meth:`Sym.evaluate` takes, e.g. from
    ``jitcore.codegen.leaf_values``).
    """

    value: object
    size: object
    dim: int
    message: str

    def expressions(self) -> tuple[object, object]:
        """(value, size): the expressions whose leaves generated code must read."""
        return self.value, self.size

    def concrete(self, values: dict[str, object]) -> tuple[object, object]:
        value = self.value.evaluate(values) if isinstance(self.value, Sym) else self.value
        size = self.size.evaluate(values) if isinstance(self.size, Sym) else self.size
        return value, size

    def violated(self, values: dict[str, object]) -> bool:
        """True when these leaf values put the index out of bounds (torch would raise)."""
        value, size = self.concrete(values)
        return not -size <= value < size

    def format(self, value: object, size: object) -> str:
        return self.message.format(value=value, size=size)

    def error(self, values: dict[str, object]) -> IndexError:
        """The IndexError torch raises for these values (call only when violated)."""
        return IndexError(self.format(*self.concrete(values)))


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
        # Integer indexes the call state must bounds-check before launching (see IndexCheck).
        self.runtime_checks: list[IndexCheck] = []

    def __enter__(self) -> Trace:
        if current_trace() is not None:
            raise RuntimeError("a jit launcher called another jit function while being traced")
        _local.trace = self
        return self

    def __exit__(self, *exc) -> None:
        _local.trace = None

    def leaf(
        self, arg_index: int, kind: str, dim: int = -1, *, is_float: bool = False, value_type: type | None = None
    ) -> Sym:
        """The symbolic value of one runtime quantity of jit argument ``arg_index``. Generated
        code reads it into a mangled local (``_a0`` for a scalar, ``_a0_size1``, ...), so
        the user's parameter names never become identifiers; labels keep them for messages."""
        name = self.param_names[arg_index]
        mangled = f"_a{arg_index}"
        variable = {
            "size": f"{mangled}_size{dim}",
            "stride": f"{mangled}_stride{dim}",
            "numel": f"{mangled}_numel",
            "scalar": mangled,
        }[kind]
        label = {
            "size": f"{name}.shape[{dim}]",
            "stride": f"{name}.stride({dim})",
            "numel": f"{name}.numel()",
            "scalar": name,
        }[kind]
        self.leaves.setdefault(variable, Leaf(variable, arg_index, name, kind, dim, value_type))
        # sizes, strides and numel are Python ints; a scalar is an integer (for the identities
        # of jitcore.symbolic and exact index arithmetic) only as an int or numpy integer,
        # never as a bool (nor an int subclass, whose arithmetic is its own)
        is_pyint = kind != "scalar" or value_type is int
        is_int = value_type is not None and issubclass(value_type, np.integer)
        return Sym.leaf(variable, label, is_float=is_float, is_int=is_int, is_pyint=is_pyint)

    def bare_scalar_type(self, value: object) -> type | None:
        """The type of the launcher argument ``value`` is, when it is one scalar argument
        itself (a bare leaf), else None: callers refuse a bare bool where Python or torch
        would (``x[flag]`` is advanced indexing to torch, not ``x[1]``)."""
        if isinstance(value, Sym) and value.op == "leaf":
            leaf = self.leaves.get(value.args[0])
            if leaf is not None and leaf.kind == "scalar":
                return leaf.value_type
        return None

    def plain_int(self, value: object) -> object:
        """``value`` (an int or an integer :class:`Sym`) as address, size and launch arithmetic
        must use it: a plain Python int on every call, exactly as Python and torch use an
        index. A Sym over scalar arguments that are not all Python ints (numpy integers, bools,
        int subclasses) is wrapped in ``operator.index`` (:func:`symbolic.as_index`): a numpy
        int32 index would otherwise make ``data_ptr + i * stride`` an int32, which overflows
        (NEP 50). Sizes, strides and Python int arguments need nothing, so their generated code
        is unchanged."""
        if not isinstance(value, Sym) or value.is_pyint:
            return value
        return symbolic.as_index(value)

    # --- launches ------------------------------------------------------------------------
    def record_launch(self, kernel, grid, block, shared, args: Sequence[object]) -> None:
        label = kernel.name_expression
        check_argument_count(kernel, args)
        sources = [
            self._source(kernel, index, param, value)
            for index, (param, value) in enumerate(zip(kernel.param_types, args))
        ]
        grid3, block3, shared = launch_dims(grid, block, shared, label)
        grid3 = tuple(self._config_int(label, "grid", dim) for dim in grid3)
        block3 = tuple(self._config_int(label, "block", dim) for dim in block3)
        shared = self._config_int(label, "shared memory", shared)
        function = self.loader(kernel)
        check_static_config(label, grid3, block3, shared, self.limits, function)
        self.launches.append(TraceLaunch(kernel, function, grid3, block3, shared, sources))

    def _config_int(self, label: str, what: str, value: int | Sym) -> object:
        """A launch dimension or shared-memory size as the driver must get it: a plain int on
        every call (:meth:`plain_int`); a bare bool argument is refused as a static bool is."""
        if self.bare_scalar_type(value) in (bool, np.bool_):
            raise LaunchConfigError(f"{label}: {what} sizes must be ints, got the bool argument {value.describe()}")
        return self.plain_int(value)

    def _source(self, kernel, index: int, param: abi.ParamType, value: object) -> ParamSource:
        where = f"{self.owner}: {argument_place(index, param, kernel.name_expression)}"
        if isinstance(value, TracedTensor):
            check_tensor_argument(where, param, value.jdtype.name, f"tensor {value.arg_name!r}")
            return ParamSource("pointer", value.arg_index, value.offset, value.jdtype.itemsize)
        if isinstance(value, torch.Tensor) or hasattr(value, "__dlpack__") or hasattr(value, "__cache_signature__"):
            raise ArgumentError(
                f"{where}: this tensor is not an argument of the launcher; pass every tensor a "
                "kernel uses as a launcher argument (a tensor read at trace time would be baked "
                "into the call state)"
            )
        if isinstance(value, Sym):
            if param.is_pointer:
                raise ArgumentError(f"{where}: expects a tensor, got the value {value.describe()}")
            if value.is_float and param.kind in ("int", "uint", "bool"):
                raise ArgumentError(f"{where}: {value.describe()} is a float; the parameter is an integer")
            if param.kind == "bool":
                leaf = self.leaves.get(value.args[0]) if value.op == "leaf" else None
                if leaf is None or leaf.kind != "scalar" or leaf.value_type not in (bool, np.bool_):
                    raise ArgumentError(
                        f"{where}: a bool parameter takes a bool launcher argument, got {value.describe()} "
                        "(pass a bool, or compare in the kernel)"
                    )
            return ParamSource("value", value=value)
        packed = plain_argument(where, param, value)
        if value is None:
            return ParamSource("constant", value=packed)  # nullptr
        if isinstance(value, np.generic):
            value = value.item()
        return ParamSource("constant", value=value)


# --- checks of one launch, shared by tracing and kernel.launch_direct ---------------------------
def check_argument_count(kernel, args: Sequence[object]) -> None:
    """Refuse a launch whose argument count is not the kernel's parameter count."""
    params = kernel.param_types
    if len(args) != len(params):
        listing = ", ".join(p.describe() for p in params)
        raise ArgumentError(f"{kernel.name_expression} takes {len(params)} arguments ({listing}), got {len(args)}")


def argument_place(index: int, param: abi.ParamType, label: str) -> str:
    """How messages name one kernel argument: ``argument 1 (const float* x) of axpy<float>``."""
    return f"argument {index} ({param.describe()}) of {label}"


def check_tensor_argument(where: str, param: abi.ParamType, dtype: str, tensor: str) -> None:
    """Refuse a tensor (of element type ``dtype``, named ``tensor`` in messages) for ``param``
    unless it is a pointer whose pointee takes that dtype."""
    if not param.is_pointer:
        raise ArgumentError(f"{where}: got a tensor for a parameter passed by value")
    if not param.accepts_dtype(dtype):
        raise ArgumentError(f"{where}: {tensor} has dtype {dtype}, which a {param.pointee}* cannot take")


def plain_argument(where: str, param: abi.ParamType, value: object) -> object:
    """What ``struct`` packs for an argument that is neither a tensor nor symbolic: 0 for None
    given to a pointer (nullptr), a scalar checked by :func:`abi.scalar_value` for a by-value
    parameter; an ArgumentError for anything else."""
    if value is None:
        if not param.is_pointer:
            raise ArgumentError(f"{where}: None is only accepted for pointer parameters (nullptr)")
        return 0
    if param.is_pointer:
        raise ArgumentError(f"{where}: expects a tensor, got {type(value).__qualname__}")
    try:
        return abi.scalar_value(param, value)
    except abi.ScalarError as exc:
        raise ArgumentError(
            f"{where}: cannot take the {type(value).__qualname__} {value!r} without a lossy cast: {exc}"
        ) from None


def launch_dims(grid: object, block: object, shared: object, label: str) -> tuple[tuple, tuple, object]:
    """``kernel[grid, block, shared]`` checked and normalized: grid and block as three
    dimensions each, shared memory as an int (or an integer :class:`Sym` while tracing)."""
    grid3 = _dims(grid, "grid", label)
    block3 = _dims(block, "block", label)
    if isinstance(shared, bool) or not isinstance(shared, (int, Sym)):
        raise LaunchConfigError(f"{label}: shared memory must be an int number of bytes, got {shared!r}")
    if isinstance(shared, Sym) and shared.is_float:
        raise LaunchConfigError(f"{label}: shared memory size {shared.describe()} is not an integer")
    if isinstance(shared, int):
        shared = operator.index(shared)  # an IntEnum member or other int subclass: its plain int
    return grid3, block3, shared


def is_empty_grid(grid: tuple) -> bool:
    """Whether a grid has a static dimension of 0 (a launch over no work, which is skipped)."""
    return any(symbolic.is_static(size) and size == 0 for size in grid)


def _dims(value: object, what: str, label: str) -> tuple:
    dims = value if isinstance(value, tuple) else (value,)
    if not 1 <= len(dims) <= 3:
        raise LaunchConfigError(f"{label}: {what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    for dim in dims:
        if isinstance(dim, bool) or not isinstance(dim, (int, Sym)) or (isinstance(dim, Sym) and dim.is_float):
            raise LaunchConfigError(f"{label}: {what} dimensions must be ints, got {value!r}")
    # int subclasses (IntEnum members) become plain ints: generated code writes ints as literals
    dims = tuple(operator.index(d) if isinstance(d, int) else d for d in dims)
    return dims + (1,) * (3 - len(dims))


def check_static_config(
    label: str, grid: tuple, block: tuple, shared: object, limits: DeviceLimits, function: LoadedFunction
) -> None:
    """Check every static part of a launch configuration against the device's limits.

    A grid dimension of 0 is allowed: the launch covers no work and is skipped (see
    :func:`is_empty_grid`); negative sizes, empty blocks and sizes beyond the device are not."""
    for axis, (size, limit) in enumerate(zip(grid, limits.max_grid)):
        if symbolic.is_static(size) and not 0 <= size <= limit:
            raise LaunchConfigError(
                f"{label}: grid dimension {'xyz'[axis]} is {size}; it must be in 0..{limit} (0 launches nothing)"
            )
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


_OUT_OF_BOUNDS = "index {value} is out of bounds for dimension {dim} with size {size}"
_ZERO_DIM_INT = (
    "invalid index of a 0-dim tensor. Use `tensor.item()` in Python or `tensor.item<T>()` in "
    "C++ to convert a 0-dim tensor to a number"
)
_INDEX_KINDS = (
    "only integers, slices (`:`), ellipsis (`...`), None and long or byte Variables are valid indices (got {type})"
)
_ADVANCED = (
    "{what} as an index inside a launcher: torch's advanced indexing (tensors, lists, bools) "
    "copies the data, so there is no view to pass to a kernel. A launcher takes ints, slices "
    "with a positive step, None and one Ellipsis; index the tensor outside the launcher"
)


def _index_kind(item: object) -> tuple[str, object]:
    """Classify one subscript item as torch does: ("int" | "slice" | "none" | "ellipsis",
    the item with ints made exact), or refuse it."""
    if item is None:
        return "none", None
    if item is Ellipsis:
        return "ellipsis", item
    if isinstance(item, slice):
        return "slice", item
    if isinstance(item, bool) or isinstance(item, np.bool_):
        raise ArgumentError(_ADVANCED.format(what=f"the bool {item!r}"))
    if isinstance(item, Sym):
        if item.is_float:
            raise IndexError(_INDEX_KINDS.format(type=f"float: {item.describe()}"))
        return "int", item
    if isinstance(item, (torch.Tensor, TracedTensor, list, tuple, np.ndarray)):
        raise ArgumentError(_ADVANCED.format(what=f"a {type(item).__qualname__}"))
    if isinstance(item, int) or hasattr(type(item), "__index__"):
        value = operator.index(item)
        if not -(2**63) <= value < 2**63:
            raise ValueError("Overflow when unpacking long long")
        return "int", value
    raise IndexError(_INDEX_KINDS.format(type=type(item).__qualname__))


_SLICE_TYPES = "slice indices must be integers or None or have an __index__ method"


def _slice_bound(value: object, trace: Trace | None = None) -> object:
    """A slice bound as Python's ``slice.indices`` reads it: ``operator.index`` of it (also on
    every call, for a runtime bound: see :meth:`Trace.plain_int`)."""
    if value is None:
        return None
    if isinstance(value, Sym):
        if value.is_float:
            raise TypeError(f"{_SLICE_TYPES} (got the float {value.describe()})")
        if trace is None:
            return value
        if trace.bare_scalar_type(value) is np.bool_:  # no __index__: Python and torch refuse it too
            raise TypeError(f"{_SLICE_TYPES} (got the numpy bool {value.describe()})")
        return trace.plain_int(value)
    if isinstance(value, int) or hasattr(type(value), "__index__"):
        return operator.index(value)
    raise TypeError(_SLICE_TYPES)


def _slice_step(value: object) -> int:
    if value is None:
        return 1
    if isinstance(value, Sym):
        raise ArgumentError(
            f"slice step {value.describe()} is a runtime value; a launcher's slice steps must be "
            "static ints (pass the step as a jitcore.Constexpr[int] parameter)"
        )
    step = _slice_bound(value)
    if step == 0:
        raise ValueError("slice step cannot be zero")
    if step < 0:
        raise ValueError("step must be greater than zero")  # torch has no negative strides
    return step


def _slice_length(start: object, stop: object, step: int, given: tuple[bool, bool]) -> object:
    """Elements in ``[start, stop)`` by ``step``, both already normalized into [0, size]."""
    span = stop - start
    length = span if step == 1 else symbolic.cdiv(span, step)
    if all(given):  # only two given bounds can cross; a default one never does
        length = symbolic.maximum(length, 0)
    return length


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
        """A view, with exactly torch's semantics for basic indexing.

        Mirrors torch's ``applySlicing``: items apply left to right to the view built so far;
        an int selects (negative counts from the end, out of range raises torch's IndexError),
        a slice keeps a dimension with Python's bound normalization (negative bounds count from
        the end, then clamp to the size), None inserts a size-1 dimension and the one Ellipsis
        stands for the unspecified dimensions. Where a bound, an index or a size is only known
        at call time, the normalization is a symbolic expression (so each call computes it)
        and an int index adds an :class:`IndexCheck` to ``trace.runtime_checks``. Refused:
        slice steps below 1 (torch has no negative strides), runtime steps, more than one
        Ellipsis (torch's multi-ellipsis results are inconsistent) and advanced indexing.
        """
        single = not isinstance(index, tuple)
        items = [self._exact_item(*_index_kind(item)) for item in (index if isinstance(index, tuple) else [index])]
        if sum(1 for kind, _ in items if kind == "ellipsis") > 1:
            raise IndexError("an index can only have a single ellipsis ('...') inside a launcher")
        ndim = self.ndim
        specified = sum(1 for kind, _ in items if kind in ("int", "slice"))
        if single and ndim == 0 and items[0][0] in ("int", "slice"):
            kind, value = items[0]
            if kind == "slice":
                raise IndexError("slice() cannot be applied to a 0-dim tensor.")
            if isinstance(value, int) and value != 0:
                raise IndexError(_OUT_OF_BOUNDS.format(value=value, dim=0, size=0))
            raise IndexError(_ZERO_DIM_INT)  # every int fails on a 0-d tensor
        if specified > ndim:
            raise IndexError(f"too many indices for tensor of dimension {ndim}")
        offset = self.offset
        shape, strides = list(self.shape), list(self._strides)
        dim = 0
        for position, (kind, item) in enumerate(items):
            if kind == "ellipsis":
                dim += ndim - specified
            elif kind == "none":
                # torch's unsqueeze: the new stride is size * stride of the dimension it lands
                # before (1 past the end); it only matters to a kernel that reads it.
                stride = shape[dim] * strides[dim] if dim < len(shape) else 1
                shape.insert(dim, 1)
                strides.insert(dim, stride)
                dim += 1
            elif kind == "int":
                offset = offset + self._select(item, shape[dim], position) * strides[dim]
                del shape[dim], strides[dim]
            else:
                start, length, step = _slice_view(item, shape[dim], self.trace)
                offset = offset + start * strides[dim]
                shape[dim] = length
                strides[dim] = strides[dim] * step
                dim += 1
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

    def _exact_item(self, kind: str, item: object) -> tuple[str, object]:
        """A runtime int index as torch reads it: a bare bool argument is advanced indexing
        (refused, as a static bool is), anything else its ``operator.index`` on every call."""
        if kind == "int" and isinstance(item, Sym):
            if self.trace.bare_scalar_type(item) in (bool, np.bool_):
                raise ArgumentError(_ADVANCED.format(what=f"the bool argument {item.describe()}"))
            item = self.trace.plain_int(item)
        return kind, item

    def _select(self, value: object, size: object, position: int) -> object:
        """The element index an int selects, checked now when static, else at call time."""
        message = _OUT_OF_BOUNDS.replace("{dim}", str(position))
        if symbolic.is_static(value) and symbolic.is_static(size):
            if -size <= value < size:
                return value + size if value < 0 else value
            if not self.trace.runtime_checks:
                raise IndexError(message.format(value=value, size=size))
            # An earlier index is checked at call time, and torch reports the first bad index:
            # this one fails on every call, after those (the 0 below is never launched).
            self.trace.runtime_checks.append(IndexCheck(value, size, position, message))
            return 0
        self.trace.runtime_checks.append(IndexCheck(value, size, position, message))
        return symbolic.wrap_index(value, size)

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


def _slice_view(item: slice, size: object, trace: Trace) -> tuple[object, object, int]:
    """(start element, length, step) of ``item`` over a dimension of ``size``, exactly as
    Python's ``slice.indices`` (which torch follows) for a positive step."""
    start, stop, step = _slice_bound(item.start, trace), _slice_bound(item.stop, trace), _slice_step(item.step)
    if all(symbolic.is_static(v) for v in (start, stop, size)):
        first, last, _ = slice(start, stop, step).indices(size)
        return first, max(0, -(-(last - first) // step)), step
    first = 0 if start is None or _is_zero(start) else symbolic.slice_index(start, size)
    last = size if stop is None else symbolic.slice_index(stop, size)
    return first, _slice_length(first, last, step, (start is not None, stop is not None)), step


def _is_zero(value: object) -> bool:
    return symbolic.is_static(value) and value == 0
