"""How one value is keyed: a tensor by its static signature, a dynamic scalar by its type, and
a constant (a value a graph bakes) by its exact class and value, floats and complex numbers by
their bits wherever they sit; and what kind of tuple a tuple subclass is, to rebuild it.

Why apart from :mod:`replay.region_keys`: a call's key is made of these elements, and the walk
of object arguments (:mod:`replay.objects`) keys an object's plain values by the same rules;
both stand on this module, which knows nothing of calls.
"""

from __future__ import annotations

import dataclasses
import decimal
import enum
import fractions
import struct
import types
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import torch

import jitcore
from replay.dynamic import Dynamic
from replay.errors import RefusedKey


# --- the kinds of tuples ------------------------------------------------------------------------
class _NamedTupleClass(Protocol):
    """A named tuple class, as :class:`NamedTupleOf` rebuilds its values."""

    def _make(self, iterable: Iterable) -> tuple: ...


@attrs.frozen
class NamedTupleOf:
    """The spec kind of a named tuple: ``kind(*items)`` rebuilds it through ``_make`` (no
    ``__new__`` of a subclass runs again), as graph.py's generated replay calls a kind."""

    cls: _NamedTupleClass

    def __call__(self, *items: object) -> tuple:
        return self.cls._make(items)


@attrs.frozen
class StructSeqOf:
    """The spec kind of a structseq (``torch.return_types.topk``, ``max``, ``sort``...): its
    constructor takes one sequence, not the items."""

    cls: type

    def __call__(self, *items: object) -> tuple:
        return self.cls(items)


@attrs.frozen
class SizeOf:
    """The spec kind of a ``torch.Size``: built from one sequence of ints."""

    def __call__(self, *items: object) -> torch.Size:
        return torch.Size(items)


_SIZE = SizeOf()


#: Field names of dataclasses, by class (dataclasses.fields rebuilds them on every call).
_FIELD_NAMES: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()


def field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def no_extra_attributes(value: object, names: Sequence[str], path: str) -> None:
    """Refuse an instance holding attributes beyond ``names``: a rebuilt one would lack them."""
    extra = set(getattr(value, "__dict__", ())) - set(names)
    if extra:
        raise TypeError(
            f"{path}: a {type(value).__qualname__} with attributes that are not fields "
            f"({', '.join(sorted(extra))}) cannot be rebuilt for each replay"
        )


def tuple_kind(value: tuple, cls: type, path: str) -> object:
    """The spec kind of a tuple subclass, or a clear TypeError for one that cannot be rebuilt."""
    if cls is torch.Size:
        return _SIZE
    fields = getattr(cls, "_fields", None)
    if isinstance(fields, tuple) and len(fields) == len(value) and hasattr(cls, "_make"):
        no_extra_attributes(value, fields, path)
        return NamedTupleOf(cls)
    sequence_fields, n_fields = getattr(cls, "n_sequence_fields", None), getattr(cls, "n_fields", None)
    if isinstance(sequence_fields, int) and isinstance(n_fields, int):  # a structseq
        if n_fields != sequence_fields:
            raise TypeError(
                f"{path} is a {cls.__qualname__}, a structseq with fields that are not items "
                f"({n_fields} fields, {sequence_fields} items): it cannot be rebuilt; pass tuple({path})"
            )
        return StructSeqOf(cls)
    raise TypeError(
        f"{path} is a {cls.__module__}.{cls.__qualname__}, a tuple subclass that cannot be rebuilt (named "
        f"tuples, torch.Size and structseqs such as torch.return_types.topk can be); pass tuple({path})"
    )


# --- the key of one value ------------------------------------------------------------------------
#: Constants keyed by their class and value as they are: equality of two values of one of
#: these exact classes is exact (the same value, the same behaviour).
BY_VALUE = frozenset(
    {int, bool, str, bytes, type(None), type(Ellipsis), torch.dtype, torch.device, torch.layout, torch.memory_format}
)
_DOUBLE = struct.Struct("<d")
_pack_double = _DOUBLE.pack


def leaf_key(leaf: object, path: str) -> object:
    """The key element of one leaf: a tensor's static signature, a dynamic scalar's type, any
    other leaf's :func:`constant_key`. Raises RefusedKey for a leaf a graph cannot bake exactly,
    TypeError for an unhashable one."""
    cls = leaf.__class__
    if cls is torch.Tensor:
        return tensor_signature(leaf)
    if cls in BY_VALUE:
        return (cls, leaf)
    if cls is float:  # by bit pattern: -0.0 == 0.0 and nan != nan, yet each is its own constant
        return (float, _pack_double(leaf))
    if isinstance(leaf, torch.Tensor):
        return tensor_signature(leaf)
    if isinstance(leaf, Dynamic):
        return ("dynamic", leaf.value.__class__)  # the type object: np.bool_ is not bool
    return _other_constant_key(leaf, cls, path)


#: Tensor signatures as keys hold them, one object for equal ones (``_SIGNATURES_KEPT`` at most).
_SIGNATURES: dict[tuple, tuple] = {}
_SIGNATURES_KEPT = 4096


def tensor_signature(tensor: torch.Tensor) -> tuple:
    """A tensor's static signature (``jitcore.lean_static_signature``), the same object for
    equal signatures: keys outlive their call (entries, hints), and a list of one tensor passed
    many times held one signature per element where one object per layout is the same key."""
    signature = jitcore.lean_static_signature(tensor)
    shared = _SIGNATURES.get(signature)
    if shared is None:
        if len(_SIGNATURES) >= _SIGNATURES_KEPT:
            _SIGNATURES.clear()
        shared = _SIGNATURES[signature] = signature
    return shared


def constant_key(value: object, path: str) -> object:
    """The exact key of a constant, one a graph may bake: equal keys mean the same class (the
    class object itself, so ``np.True_`` is not ``True``) and the same value, floats and complex
    numbers by their bits wherever they sit. Tuples, frozensets (in their iteration order),
    named tuples, structseqs and frozen dataclasses are keyed element by element.

    Allowed besides numbers (int, float, complex, bool, numpy scalars, Fraction, Decimal),
    strings and bytes: None, Ellipsis, torch dtypes, devices, layouts and memory formats, numpy
    dtypes, enum members, classes, functions and builtins (a bound one by what it is bound
    to), modules, ranges. Refused (RefusedKey, naming ``path``): objects compared by identity
    (a graph bakes the attributes the region reads, and a change to them keeps the key), other
    hashables whose equality is their own (not known to be exact), tensors inside constants.
    Unhashable values raise TypeError."""
    cls = value.__class__
    if cls in BY_VALUE:
        return (cls, value)
    if cls is float:
        return (float, _pack_double(value))
    return _other_constant_key(value, cls, path)


#: Unbound callables and modules: compared by identity, and holding no state a call passes in.
_IDENTITY_CONSTANTS: tuple[type, ...] = (
    types.FunctionType,
    types.ModuleType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.ClassMethodDescriptorType,
    np.ufunc,
    *(getattr(torch._ops, name) for name in ("OpOverload", "OpOverloadPacket") if hasattr(torch._ops, name)),
)
#: Bound callables: keyed by their name and what they are bound to (``x.add`` of a tensor is refused).
_BOUND_CALLABLES = (types.BuiltinFunctionType, types.MethodWrapperType, types.MethodType)
#: Classes (and their subclasses) whose values constant_key takes by what they are, or which
#: flatten walks as containers: never walked as objects (replay.objects), nor are BY_VALUE's.
NOT_OBJECTS = (
    torch.Tensor,
    Dynamic,
    tuple,
    list,
    dict,
    set,
    frozenset,
    enum.Enum,
    type,
    int,
    float,
    complex,
    str,
    bytes,
    np.generic,
    np.dtype,
    range,
    slice,
    fractions.Fraction,
    decimal.Decimal,
    *_IDENTITY_CONSTANTS,
    *_BOUND_CALLABLES,
)


def frozen_dataclass(cls: type) -> bool:
    """Whether ``cls`` is a frozen dataclass (its instances are constants a key holds by value)."""
    # (__dataclass_params__ is what @dataclass sets on the class; the type checker does not model it)
    return hasattr(cls, "__dataclass_fields__") and cls.__dataclass_params__.frozen  # type: ignore[attr-defined]


def _other_constant_key(value: Any, cls: type, path: str) -> object:
    """:func:`constant_key` beyond its commonest classes (see there). (``value`` is of any
    class: each branch reads what its exact class ``cls``, ``value.__class__``, has.)"""
    if cls is complex:
        return (complex, _pack_double(value.real) + _pack_double(value.imag))
    if cls is tuple or cls is frozenset:
        return (cls, tuple(constant_key(v, f"{path}[{i}]") for i, v in enumerate(value)))
    if isinstance(value, np.generic):  # every numpy scalar by its bytes; the dtype holds datetime units
        return (cls, value.dtype, value.tobytes())
    if isinstance(value, enum.Enum):  # members are singletons
        return (cls, value)
    if isinstance(value, type) or isinstance(value, _IDENTITY_CONSTANTS):
        return (cls, value)
    if isinstance(value, _BOUND_CALLABLES):
        bound = getattr(value, "__self__", None)
        if bound is None or isinstance(bound, (types.ModuleType, type)):
            return (cls, value)
        function = value.__func__ if cls is types.MethodType else value.__name__
        return (cls, constant_key(function, f"{path}.__func__"), constant_key(bound, f"{path}.__self__"))
    if isinstance(value, (torch.Tensor, Dynamic)):
        raise RefusedKey(
            f"region argument {path} is a {'tensor' if isinstance(value, torch.Tensor) else 'dynamic scalar'} "
            "inside a constant (a dict key, a frozenset, what a method is bound to): a graph would bake it. Pass "
            "it as an argument of its own",
            path,
        )
    if isinstance(value, tuple):  # named tuples, structseqs, torch.Size inside a constant
        kind = tuple_kind(value, cls, path)
        return (kind, tuple(constant_key(v, f"{path}[{i}]") for i, v in enumerate(value)))
    if frozen_dataclass(cls):
        names = field_names(cls)
        no_extra_attributes(value, names, path)
        return (cls, names, tuple(constant_key(getattr(value, n), f"{path}.{n}") for n in names))
    if cls is range:
        return (range, value.start, value.stop, value.step)  # range(0) == range(2, 2)
    if cls is fractions.Fraction:
        return (cls, value.numerator, value.denominator)
    if cls is decimal.Decimal:
        return (cls, value.as_tuple())  # Decimal("1.0") == Decimal("1.00"), yet they print apart
    if cls is slice:
        return (
            slice,
            *(
                constant_key(v, f"{path}.{n}")
                for n, v in zip(("start", "stop", "step"), (value.start, value.stop, value.step))
            ),
        )
    if isinstance(value, np.dtype):
        return (cls, value)
    return _subclass_or_refused_key(value, cls, path)


def _subclass_or_refused_key(value: object, cls: type, path: str) -> object:
    """The key of a subclass of a plain constant (its value through the base class), else the
    refusal of a value no key may hold: TypeError where it is unhashable, RefusedKey else."""
    for base in (int, float, complex, str, bytes):  # subclasses of the plain constants (enums came first)
        if isinstance(value, base):
            if getattr(value, "__dict__", None):
                break  # attributes a graph would bake: an opaque object
            return (cls, constant_key(_BASE_VALUE[base](value), path))
    try:
        hash(value)
    except TypeError:
        advice = (
            " (a dataclass that is not frozen: make it @dataclass(frozen=True), whose fields are then keyed, and "
            "its tensors rebound, one by one)"
            if hasattr(cls, "__dataclass_fields__")
            else ""
        )
        raise TypeError(
            f"region argument {path} is an unhashable {cls.__qualname__}{advice}; region arguments are "
            "tensors, scalars (wrap runtime ones in replay.dynamic), hashable constants, and tuples, "
            "lists, dicts, named tuples and frozen dataclasses of those"
        ) from None
    raise RefusedKey(_refusal_reason(value, cls, path), path)


#: The plain value of a subclass of a plain constant, through the base class's own slot (never
#: an override of ``__int__`` and the like).
_BASE_VALUE: dict[type, Callable[[Any], object]] = {
    int: int.__int__,
    float: float.__float__,
    complex: lambda v: complex(float.__float__(v.real), float.__float__(v.imag)),
    str: str.__str__,
    bytes: bytes.__bytes__,
}


def _refusal_reason(value: object, cls: type, path: str) -> str:
    """Why a hashable constant is refused, and what to pass instead."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    if isinstance(value, torch.nn.Module):
        return (
            f"region argument {path} is an nn.Module ({name}) where no walk reads it (a padded call, a "
            "constant): compared by identity, a graph would bake what the region reads from it besides its "
            "tensors, and a change to those would keep the key, so calls passing it run eagerly. Pass it as a "
            "plain argument (walked), close over the module instead (a global or closure of the region: what "
            "it reads there is watched, see docs/replay.md), or pass the tensors and values the region needs"
        )
    if cls.__hash__ is object.__hash__:
        return (
            f"region argument {path} is a {name}, an object compared by identity where no walk reads it (a "
            "padded call, a constant): a graph would bake the attributes the region reads from it, and changing "
            "one (obj.attr = value) would keep the key, so calls passing it run eagerly. Pass the values "
            "themselves (replay.dynamic for numbers that change), a frozen dataclass or named tuple of them, "
            "pass the object as a plain argument (walked), or close over it (watched, as docs/replay.md says)"
        )
    return (
        f"region argument {path} is a {name}, a constant whose equality is its own (__eq__ and __hash__), not "
        "known to be exact: two values it calls equal (as 1 == 1.0) would share a graph that bakes one of "
        "them, so calls passing it run eagerly. Pass its values themselves, or a frozen dataclass or named "
        "tuple of them"
    )


def float_bits(value: object) -> bytes:
    """The exact bits of a float (or complex) constant: what tells -0.0 from 0.0 and one NaN
    from another. Numpy scalars (of any kind) by their bytes."""
    if isinstance(value, complex):
        return _DOUBLE.pack(value.real) + _DOUBLE.pack(value.imag)
    if isinstance(value, np.generic):
        return value.tobytes()
    return _DOUBLE.pack(value)
