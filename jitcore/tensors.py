"""Tensor signatures: what a compiled kernel depends on, read two ways.

A signature is the tuple ``(dtype, shape, strides, unit_axis, align, device)``:

- ``dtype``: a name from :mod:`jitcore.dtypes` ("float32", "float8_e4m3fn", ...);
- ``shape`` and ``strides``: one entry per dimension, an ``int`` when static or a marker
  string when dynamic: ``"?"``, or ``"?16"`` when the value is promised divisible by 16;
- ``unit_axis``: the axis whose stride is a static 1 (the last such axis), or -1;
- ``align``: the byte alignment the kernel may assume for the data pointer;
- ``device``: ``"cpu"`` or ``"cuda:N"`` (ROCm builds of torch also say "cuda").

The *full* path (:class:`TensorAdaptor`) reads a DLPack export and works for any producer;
the *lean* path (:func:`lean_cache_signature`) reads ``dtype``, ``stride()`` and the device
straight from a torch tensor. Both must produce the same bytes for every input, and refuse the
same inputs with the same exception; ``tests/jitcore/test_tensors.py`` holds them to it.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from jitcore import dlpack, dtypes, generated
from jitcore.errors import ArgumentError, LayoutError, UnsupportedTensorError

DYNAMIC = "?"

Signature = tuple  # (dtype: str, shape: tuple, strides: tuple, unit_axis: int, align: int, device: str)


def dynamic_marker(divisibility: int) -> str:
    """The shape/stride entry for a dynamic value promised divisible by ``divisibility``.

    Strings in signatures are interned, so both paths share the very same objects and even a
    pickle of a key (which records object sharing) is byte-identical."""
    return DYNAMIC if divisibility == 1 else sys.intern(f"{DYNAMIC}{divisibility}")


def last_unit_axis(strides: Sequence[int]) -> int:
    """The last axis whose stride is 1, or -1. Chosen from the framework's own strides."""
    for axis in range(len(strides) - 1, -1, -1):
        if strides[axis] == 1:
            return axis
    return -1


_layout_dynamic_specs: dict[tuple[int, int, int], tuple[tuple, tuple]] = {}


def layout_dynamic_specs(ndim: int, unit_axis: int, divisibility: int = 1) -> tuple[tuple, tuple]:
    """Shape and stride specs of a layout-dynamic tensor: every size dynamic, every stride
    dynamic except the unit-stride axis. ``divisibility`` is promised for the unit axis's size
    and for every dynamic stride. Cached: the same tuple objects come back every time."""
    key = (ndim, unit_axis, divisibility)
    specs = _layout_dynamic_specs.get(key)
    if specs is None:
        marker = dynamic_marker(divisibility)
        shape = tuple(marker if axis == unit_axis else DYNAMIC for axis in range(ndim))
        strides = tuple(1 if axis == unit_axis else marker for axis in range(ndim))
        specs = _layout_dynamic_specs[key] = (shape, strides)
    return specs


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return sys.intern(f"cuda:{device.index if device.index is not None else 0}")
    return sys.intern(device.type)


_plain_torch_dispatch = torch.Tensor.__torch_dispatch__
_strided = torch.strided

try:  # functorch's wrappers (BatchedTensor, GradTrackingTensor, functionalize's) have no memory of their own
    _functorch_wrapped: Callable[[torch.Tensor], bool] = torch._C._functorch.is_functorch_wrapped_tensor
except AttributeError:  # pragma: no cover - torch builds without functorch

    def _functorch_wrapped(tensor: torch.Tensor) -> bool:
        return False


def describe_torch_tensor(tensor: torch.Tensor) -> dtypes.DType:
    """Refuse what no signature can describe; both paths call this, in this order, so they
    refuse the same inputs with the same exception and message."""
    cls = type(tensor)
    if cls is not torch.Tensor and cls.__torch_dispatch__ is not _plain_torch_dispatch:
        raise UnsupportedTensorError(
            f"tensor subclass {cls.__qualname__} overrides __torch_dispatch__; its memory is not "
            "a plain strided buffer (pass the underlying torch.Tensor)"
        )
    if tensor.is_nested:
        raise UnsupportedTensorError("nested tensors are not supported (pass each component)")
    if tensor.layout is not _strided:
        raise UnsupportedTensorError(
            f"layout {tensor.layout} is not supported: only strided (dense) tensors have a "
            "data pointer and strides a kernel can use"
        )
    dtype = dtypes.BY_TORCH.get(tensor.dtype)
    if dtype is None:
        raise UnsupportedTensorError(
            f"dtype {tensor.dtype} is not supported (supported: {', '.join(d.name for d in dtypes.ALL)})"
        )
    device_type = tensor.device.type
    if device_type == "meta":
        raise UnsupportedTensorError("meta tensors have no memory; a kernel cannot read them")
    if device_type not in ("cpu", "cuda"):
        raise UnsupportedTensorError(f"device type {device_type!r} is not supported (cpu, cuda)")
    if dtype.is_complex and tensor.is_conj():
        raise UnsupportedTensorError(
            "tensor has the conjugate bit set: its memory does not hold the values it shows; call .resolve_conj() first"
        )
    if tensor.is_neg():
        raise UnsupportedTensorError(
            "tensor has the negative bit set: its memory holds the negated values; call .resolve_neg() first"
        )
    if tensor._is_zerotensor():
        raise UnsupportedTensorError(
            "tensor is an efficient zero tensor (torch._efficientzerotensor, as autograd makes for "
            "undefined gradients): it has no memory, its data pointer is null; pass "
            "torch.zeros(t.shape, dtype=t.dtype, device=t.device) instead"
        )
    if _functorch_wrapped(tensor) or torch._is_functional_tensor(tensor):
        raise UnsupportedTensorError(
            "tensor is a wrapper of a torch.func transform (vmap, grad, jvp, functionalize): its "
            "memory is not that of the values it shows (a batched tensor has no data pointer); "
            "call the launcher outside the transform"
        )
    return dtype


def _no_unit_axis(strides: Sequence[int]) -> LayoutError:
    return LayoutError(
        f"tensor with strides {tuple(strides)} has no unit-stride axis, so it cannot be passed "
        "layout-dynamic; wrap it with jitcore.from_dlpack(t) to pass it with a static layout"
    )


class SignatureToken:
    """The one object standing for a signature inside cache keys.

    Keys hold tokens rather than signature tuples: a token hashes and compares by identity
    (no recursive tuple hashing on every lookup), and :func:`token_of` returns the same token
    for equal signatures, so keys built by the lean and the full path are still equal (and
    print identically: a token's repr is its signature's)."""

    __slots__ = ("__weakref__", "signature")

    def __init__(self, signature: object):
        self.signature = signature

    def __repr__(self) -> str:
        return repr(self.signature)

    def __reduce__(self):
        return (token_of, (self.signature,))


_tokens: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_tokens_lock = threading.Lock()


def token_of(signature: object) -> SignatureToken:
    """The interned token of a (hashable) signature."""
    token = _tokens.get(signature)
    if token is None:
        with _tokens_lock:
            token = _tokens.get(signature)
            if token is None:
                token = SignatureToken(signature)
                _tokens[signature] = token
    return token


# Lean fast path: (torch dtype, ndim, unit axis, get_device()) -> token, filled by the slow
# path only after full validation, so a hit here is always a tensor both paths accept.
_lean_tokens: dict[tuple, SignatureToken] = {}


def _lean_slow(tensor: torch.Tensor) -> SignatureToken:
    dtype = describe_torch_tensor(tensor)
    strides = tensor.stride()
    ndim = len(strides)
    unit = last_unit_axis(strides)
    if unit < 0 and ndim:
        raise _no_unit_axis(strides)
    shape_spec, stride_spec = layout_dynamic_specs(ndim, unit)
    token = token_of((dtype.name, shape_spec, stride_spec, unit, dtype.itemsize, device_name(tensor.device)))
    if ndim and type(tensor) is torch.Tensor and not dtype.is_complex:
        # complex tensors stay on this path: only here is the conjugate bit checked
        _lean_tokens[(tensor.dtype, ndim, unit, tensor.get_device())] = token
    return token


#: What the lean lookup's statements (:func:`lean_token_lines`) read, under these names: the
#: namespace of every function they are compiled into includes it.
LEAN_NAMESPACE: dict[str, object] = {
    "_Tensor": torch.Tensor,
    "_LEAN": _lean_tokens,
    "_last_unit": last_unit_axis,
    "_strided": _strided,
    "_lean_slow": _lean_slow,
}


def lean_token_lines(value: str, result: str) -> list[str]:
    """Statements that leave in ``result`` the lean token of ``value``, a tensor whose class is
    exactly ``torch.Tensor``, reading the names of :data:`LEAN_NAMESPACE` (and using ``_s``,
    ``_n`` and ``_d`` as scratch locals).

    The one definition of the lean fast path: :func:`lean_token` is generated from these lines
    and the jit dispatcher inlines them once per tensor parameter
    (:meth:`~jitcore.keys.KeyPlan.key_lines`), so the two cannot drift apart and the hit path
    makes no call for them. A hit is one dict lookup on (dtype, ndim, unit axis, device
    index); everything else (a key never validated, 0-d, negative bit, meta or non-strided
    CPU-side tensors, a stride() that raises) falls back to the validating slow path. So does
    a tensor without a data pointer of its own (``data_ptr()`` 0 or raising): efficient zero
    tensors, torch.func wrappers, meta tensors, which the slow path refuses, and empty
    tensors, whose data pointer may be null too (the slow path accepts them, at its cost)."""
    return [
        "try:",
        f"    _s = {value}.stride()",
        "    _n = len(_s)",
        f"    _d = {value}.get_device()",
        f"    {result} = _LEAN[({value}.dtype, _n, _n - 1 if _s[-1] == 1 else _last_unit(_s), _d)]",
        f"    if {value}.is_neg() or not {value}.data_ptr()"
        f" or _d < 0 and ({value}.is_meta or {value}.layout is not _strided):",
        f"        {result} = _lean_slow({value})",
        "except (KeyError, IndexError, RuntimeError):",
        f"    {result} = _lean_slow({value})",
    ]


def _define_lean_token() -> Callable[[torch.Tensor], SignatureToken]:
    """:func:`lean_token`, generated from :func:`lean_token_lines` (the lines the dispatcher
    inlines), so the Python function and the inline key are one definition."""
    body = "".join(f"        {line}\n" for line in lean_token_lines("tensor", "_token"))
    source = (
        "def lean_token(tensor):\n"
        "    if type(tensor) is _Tensor:\n"
        f"{body}"
        "        return _token\n"
        "    return _lean_slow(tensor)\n"
    )
    namespace: dict[str, object] = dict(LEAN_NAMESPACE)
    function = generated.define(source, generated.source_filename("lean token"), namespace)["lean_token"]
    function.__doc__ = "The key token of a raw torch tensor's layout-dynamic signature, without DLPack."
    function.__module__ = __name__
    function.source = source
    return function


lean_token: Callable[[torch.Tensor], SignatureToken] = _define_lean_token()


def lean_cache_signature(tensor: torch.Tensor) -> Signature:
    """The layout-dynamic signature of a raw torch tensor, without DLPack.

    Equal, byte for byte, to ``TensorAdaptor(tensor).__cache_signature__()``.
    """
    return lean_token(tensor).signature


def lean_static_signature(tensor: torch.Tensor) -> Signature:
    """The static (shape-exact) signature of a raw torch tensor, without DLPack.

    Equal to ``from_dlpack(tensor).__cache_signature__()``. The replay layer keys graphs on it.
    """
    dtype = describe_torch_tensor(tensor)
    strides = tuple(tensor.stride())
    return (
        dtype.name,
        tuple(tensor.shape),
        strides,
        last_unit_axis(strides),
        dtype.itemsize,
        device_name(tensor.device),
    )


def _is_power_of_two(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0 and not value & (value - 1)


def _check_divisibility(divisibility: object, method: str) -> int:
    if not _is_power_of_two(divisibility):
        raise ValueError(f"{method}: divisibility must be a power of two >= 1, got {divisibility!r}")
    return divisibility  # type: ignore[return-value]


class TensorAdaptor:
    """The full-path description of a tensor argument, built from its DLPack export.

    ``TensorAdaptor(t)`` describes ``t`` layout-dynamic (as a raw torch tensor is passed);
    ``from_dlpack(t)`` describes it static, and the ``mark_*`` methods make parts dynamic.
    Works for torch tensors and any DLPack producer (numpy arrays at least).
    """

    __slots__ = (
        "source",
        "dtype",
        "shape",
        "strides",
        "data",
        "device",
        "align",
        "_size_marks",
        "_stride_marks",
        "_leading_dim",
        "_signature",
        "_live",
        "_checked",
        "_recorded",
    )

    def __init__(self, tensor: object, *, static: bool = False, assumed_align: int | None = None):
        if isinstance(tensor, TensorAdaptor):
            tensor = tensor.source
        self.source = tensor
        if isinstance(tensor, torch.Tensor):
            dtype = describe_torch_tensor(tensor)
            exported = tensor.detach() if tensor.requires_grad else tensor
            view = dlpack.read_capsule(torch.utils.dlpack.to_dlpack(exported))
            strides = tuple(tensor.stride())  # the framework's own strides, not DLPack's
            if view.strides is not None and tensor.numel():
                for axis, (ours, theirs) in enumerate(zip(strides, view.strides)):
                    if view.shape[axis] > 1 and ours != theirs:
                        raise AssertionError(f"DLPack stride {theirs} != torch stride {ours} on axis {axis}")
        elif hasattr(tensor, "__dlpack__"):
            view = dlpack.export(tensor)
            dtype = dtypes.BY_DLPACK.get((view.dtype_code, view.dtype_bits, view.dtype_lanes))
            if dtype is None:
                raise UnsupportedTensorError(
                    f"DLPack dtype (code={view.dtype_code}, bits={view.dtype_bits}, "
                    f"lanes={view.dtype_lanes}) is not supported"
                )
            strides = _framework_strides(tensor, view, dtype)
        else:
            raise TypeError(f"expected a torch tensor or an object with __dlpack__, got {type(tensor).__qualname__}")
        self.dtype = dtype
        self.shape = tuple(view.shape)
        self.strides = strides
        self.data = view.data
        self.device = _dlpack_device_name(view)
        if assumed_align is None:
            self.align = dtype.itemsize
        else:
            if not _is_power_of_two(assumed_align) or assumed_align < dtype.itemsize:
                raise ValueError(
                    f"assumed_align must be a power of two >= the element size {dtype.itemsize}, got {assumed_align!r}"
                )
            if self.data % assumed_align:
                raise ValueError(
                    f"assumed_align={assumed_align} but the data pointer {self.data:#x} is "
                    f"only {self.data & -self.data}-byte aligned"
                )
            self.align = assumed_align
        ndim = len(self.shape)
        self._size_marks: list[int | None] = [None] * ndim
        self._stride_marks: list[int | None] = [None] * ndim
        self._leading_dim: int | None = None
        self._signature: Signature | None = None
        # A torch source can change under the adaptor (resize_, set_, .data = ...), a numpy
        # array too (a.resize, a.shape = ..., a.dtype = ...): the adaptor is a snapshot, so it
        # re-checks every fact its description depends on whenever it is used (see _stale).
        self._live = tensor if isinstance(tensor, torch.Tensor) else None
        self._checked: object = tensor if self._live is not None or isinstance(tensor, np.ndarray) else None
        self._recorded = _facts(self._checked) if self._checked is not None else None
        if not static:
            unit = last_unit_axis(strides)
            if unit < 0 and ndim:
                raise _no_unit_axis(strides)
            if ndim:
                self.mark_layout_dynamic(unit)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    # torch-like accessors: call states read adaptors and raw tensors with the same code.
    def data_ptr(self) -> int:
        live = self._live
        if live is not None and live.data_ptr() != self.data:
            self._stale()
        return self.data

    def check_fresh(self) -> None:
        """Raise if the tensor behind this adaptor is no longer what the adaptor describes:
        a torch tensor's data pointer, shape, strides, dtype, device, class, conjugate,
        negative or zero-tensor bit changed in place (``resize_``, ``set_``, ``.data =``;
        ``t.data = t.conj()`` keeps the pointer), or a numpy array's data pointer, shape,
        strides or dtype (``a.resize``, ``a.shape =``, ``a.dtype =``).
        Every one of them is in the adaptor's description (its signature, its alignment, or
        the refusals of :func:`describe_torch_tensor`), so a change of any is a stale
        adaptor. Other DLPack producers are not re-checked: rewrap them after changing one."""
        checked = self._checked
        if checked is not None and _facts(checked) != self._recorded:
            self._stale()

    def _stale(self) -> None:
        """Refuse a stale snapshot. After ``t.resize_(...)`` the old storage may be freed, so
        launching with the recorded pointer and shape would read freed memory; after
        ``t.data = t.view(torch.int32)`` a kernel compiled for float32 would read int32 bits.
        Refreshing in place would change a signature the caller may have marked, so the
        caller rewraps."""
        now = _facts(self._checked)
        changed = [
            f"{name} {_shown(name, before)} -> {_shown(name, after)}"
            for name, before, after in zip(_FACT_NAMES, self._recorded, now)
            if before != after
        ]
        how = "torch tensor (resize_, set_ or .data =)" if self._live is not None else "array (resize, shape or dtype)"
        raise ArgumentError(
            f"stale jitcore.from_dlpack adaptor {self!r}: its {how} changed in place after it was "
            f"wrapped: {'; '.join(changed)}. Call jitcore.from_dlpack(t) again after changing the "
            "tensor (and re-apply any mark_* calls)"
        )

    def stride(self, dim: int | None = None):
        return self.strides if dim is None else self.strides[dim]

    def numel(self) -> int:
        total = 1
        for size in self.shape:
            total *= size
        return total

    def _normalize_dims(self, dims: int | Iterable[int], method: str) -> list[int]:
        if isinstance(dims, bool) or not isinstance(dims, (int, Iterable)):
            raise ValueError(f"{method}: dims must be an int or a sequence of ints, got {dims!r}")
        dims_list = [dims] if isinstance(dims, int) else list(dims)
        ndim = self.ndim
        normalized = []
        for dim in dims_list:
            if isinstance(dim, bool) or not isinstance(dim, int):
                raise ValueError(f"{method}: dims must be ints, got {dim!r}")
            if not -ndim <= dim < ndim:
                raise ValueError(f"{method}: dim {dim} is out of range for a {ndim}-d tensor")
            normalized.append(dim % ndim)
        return normalized

    def _check_divides(self, values: tuple, dim: int, divisibility: int, what: str, method: str):
        if values[dim] % divisibility:
            raise ValueError(f"{method}: {what} {values[dim]} of dim {dim} is not divisible by {divisibility}")

    def mark_layout_dynamic(self, leading_dim: int | None = None, divisibility: int = 1) -> TensorAdaptor:
        """Make every size and every stride dynamic except the stride of ``leading_dim``
        (default: the last unit-stride axis), which stays a static 1. ``divisibility`` is
        promised for the leading dimension's size and for every other stride."""
        method = "mark_layout_dynamic"
        divisibility = _check_divisibility(divisibility, method)
        if self.ndim == 0:
            raise ValueError(f"{method}: a 0-d tensor has no layout to make dynamic")
        if leading_dim is None:
            leading = last_unit_axis(self.strides)
            if leading < 0:
                raise ValueError(f"{method}: strides {self.strides} have no unit-stride axis")
        else:
            (leading,) = self._normalize_dims(leading_dim, method)
            if self.strides[leading] != 1:
                raise ValueError(f"{method}: leading_dim {leading_dim} has stride {self.strides[leading]}, expected 1")
        self._check_divides(self.shape, leading, divisibility, "size", method)
        for dim in range(self.ndim):
            if dim != leading:
                self._check_divides(self.strides, dim, divisibility, "stride", method)
        self._size_marks = [divisibility if dim == leading else 1 for dim in range(self.ndim)]
        self._stride_marks = [None if dim == leading else divisibility for dim in range(self.ndim)]
        self._leading_dim = leading
        self._signature = None
        return self

    def mark_shape_dynamic(self, dims: int | Iterable[int], divisibility: int = 1) -> TensorAdaptor:
        """Make the sizes of ``dims`` dynamic, promised divisible by ``divisibility``."""
        method = "mark_shape_dynamic"
        divisibility = _check_divisibility(divisibility, method)
        for dim in self._normalize_dims(dims, method):
            self._check_divides(self.shape, dim, divisibility, "size", method)
            self._size_marks[dim] = divisibility
        self._signature = None
        return self

    def mark_stride_dynamic(self, dims: int | Iterable[int], divisibility: int = 1) -> TensorAdaptor:
        """Make the strides of ``dims`` dynamic, promised divisible by ``divisibility``."""
        method = "mark_stride_dynamic"
        divisibility = _check_divisibility(divisibility, method)
        for dim in self._normalize_dims(dims, method):
            self._check_divides(self.strides, dim, divisibility, "stride", method)
            self._stride_marks[dim] = divisibility
            if dim == self._leading_dim:
                self._leading_dim = None
        self._signature = None
        return self

    @property
    def unit_axis(self) -> int:
        """The axis whose stride the signature fixes at 1 (the last one), or -1."""
        if self._leading_dim is not None:
            return self._leading_dim
        for axis in range(self.ndim - 1, -1, -1):
            if self._stride_marks[axis] is None and self.strides[axis] == 1:
                return axis
        return -1

    def __cache_signature__(self) -> Signature:
        if self._checked is not None:
            self.check_fresh()
        return self._recorded_signature()

    def _recorded_signature(self) -> Signature:
        signature = self._signature
        if signature is None:
            shape = tuple(
                size if mark is None else dynamic_marker(mark) for size, mark in zip(self.shape, self._size_marks)
            )
            strides = tuple(
                stride if mark is None else dynamic_marker(mark)
                for stride, mark in zip(self.strides, self._stride_marks)
            )
            cached = layout_dynamic_specs(self.ndim, self._leading_dim, 1) if self._leading_dim is not None else None
            if cached is not None and cached == (shape, strides):
                shape, strides = cached  # share the interned tuples with the lean path
            signature = self._signature = (self.dtype.name, shape, strides, self.unit_axis, self.align, self.device)
        return signature

    def __repr__(self) -> str:
        return f"TensorAdaptor({self._recorded_signature()})"


#: What an adaptor records of its source and re-checks on every use (:meth:`TensorAdaptor.check_fresh`).
_FACT_NAMES = (
    "data pointer",
    "shape",
    "strides",
    "dtype",
    "device",
    "class",
    "conjugate bit",
    "negative bit",
    "efficient zero tensor",
)


def _facts(source: torch.Tensor | np.ndarray) -> tuple:
    """The facts of ``source`` (a torch tensor or a numpy array) that an adaptor's description
    depends on, in the order of :data:`_FACT_NAMES` (a numpy array has the first four).

    For a torch tensor these are what ``.data =``, ``set_`` and ``resize_`` can change on a
    plain tensor: the dispatch bits among them (conjugate, negative, zero tensor) travel with
    ``t.data = t.conj()``; a tensor cannot become sparse, nested, meta or a functorch wrapper
    in place (torch refuses ``.data =`` across those kinds). Read one by one: comparing the
    whole dispatch key set would cost twice as much."""
    if isinstance(source, torch.Tensor):
        return (
            source.data_ptr(),
            source.shape,
            source.stride(),
            source.dtype,
            source.device,
            source.__class__,
            source.is_conj(),
            source.is_neg(),
            source._is_zerotensor(),
        )
    return (source.__array_interface__["data"][0], source.shape, source.strides, source.dtype)


def _shown(name: str, value: object) -> str:
    if name == "data pointer":
        return f"{value:#x}"
    return str(tuple(value)) if name in ("shape", "strides") else str(value)


def _framework_strides(obj: object, view: dlpack.DLPackView, dtype: dtypes.DType) -> tuple[int, ...]:
    """Prefer the producer's own strides (numpy's, in bytes) over DLPack's, which some
    producers normalise on unit and zero-size dimensions."""
    byte_strides = getattr(obj, "strides", None)
    if isinstance(byte_strides, tuple) and len(byte_strides) == len(view.shape):
        if all(isinstance(s, int) and s % dtype.itemsize == 0 for s in byte_strides):
            return tuple(s // dtype.itemsize for s in byte_strides)
    if view.strides is not None:
        return tuple(view.strides)
    strides, running = [], 1
    for size in reversed(view.shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def _dlpack_device_name(view: dlpack.DLPackView) -> str:
    if view.device_type == dlpack.DL_CPU:
        return "cpu"
    if view.device_type in (dlpack.DL_CUDA, dlpack.DL_ROCM):
        return sys.intern(f"cuda:{view.device_id}")
    raise UnsupportedTensorError(f"DLPack device type {view.device_type} is not supported (cpu, cuda, rocm)")


def from_dlpack(tensor: object, *, assumed_align: int | None = None) -> TensorAdaptor:
    """A static description of ``tensor``: concrete shape and strides in the signature.

    Use it for tensors a layout-dynamic signature cannot describe (no unit-stride axis) or to
    specialise a kernel on exact sizes; ``mark_*`` methods make chosen parts dynamic.
    """
    return TensorAdaptor(tensor, static=True, assumed_align=assumed_align)
