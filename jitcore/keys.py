"""Cache keys of jit calls: one element per launcher parameter, built two ways.

A :class:`KeyPlan` is made once per jit function from its parameter list. It generates a
straight-line ``lean_key`` function for the hit path (no DLPack, no per-argument dispatch
through helpers for plain tensors and Python scalars) and offers ``full_key`` for the miss path
(a :class:`~jitcore.tensors.TensorAdaptor` per tensor). Both return byte-identical tuples for
every input both accept and refuse the same inputs with the same exception type.

Key elements:

- tensors: their signature (see :mod:`jitcore.tensors`), as its interned token;
- objects with ``__cache_signature__`` (duck-typed with ``hasattr``): what it returns, as a token;
- runtime scalars: the type only (``"int"``, ``"float"``, ``"bool"``, ``"numpy.float32"``, ...);
  objects with ``__jit_scalar__`` (the replay layer's dynamic scalars) by the type of the value
  they carry;
- ``Constexpr`` parameters: ``(type, value)`` (a builtin type by its name, any other by the
  class: ``np.True_`` is not ``True``); the value must be hashable by value (see
  :func:`constexpr_signature`: one hashed by identity is refused). Floats (and complex numbers,
  and floats inside tuples, frozensets and dataclasses) are keyed by their bit pattern, so
  ``-0.0`` never shares ``0.0``'s call state and a NaN finds its own entry again; container
  elements are keyed with their types (``(1, 2.0)`` is not ``(1.0, 2.0)``): :func:`exact`.

The generated ``lean_key`` (and the dispatcher lines of :meth:`KeyPlan.key_lines`) read the
arguments as ``_a0``, ``_a1``, ...; the user's parameter names are never identifiers in them.
"""

from __future__ import annotations

import dataclasses
import inspect
import struct
import typing
import weakref
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch

from jitcore import generated, tensors
from jitcore.errors import ArgumentError

T = typing.TypeVar("T")


class Constexpr(typing.Generic[T]):
    """Annotation for a launcher parameter that is compile-time: ``n: jc.Constexpr[int]``.

    Its value is part of the cache key and a plain Python value while tracing, so Python
    control flow on it works; every distinct value compiles its own call state.
    """


def is_constexpr_annotation(annotation: object) -> bool:
    if annotation is Constexpr or typing.get_origin(annotation) is Constexpr:
        return True
    if isinstance(annotation, str):  # an annotation that could not be evaluated
        return annotation.split("[", 1)[0].rsplit(".", 1)[-1].strip() == "Constexpr"
    return False


#: The Python and numpy number types (bool included), as ``isinstance`` tests them: what a
#: runtime scalar may be (replay's dynamic arguments and the constants arithmetic on them takes).
NUMBERS: tuple[type, ...] = (int, float, bool, np.integer, np.floating, np.bool_)

# Keyed by class alone (their values reach call states at run time). None is here too: an
# optional tensor left out (a null pointer) selects its own call state, apart from tensors.
SCALAR_SIGNATURES: dict[type, str] = {bool: "bool", int: "int", float: "float", type(None): "None"}


def _numpy_scalar_types() -> dict[type, str]:
    """Every numpy scalar type a kernel parameter can take exactly, found by what it is (a
    bool, an integer or a float of at most 8 bytes: dtype kind and itemsize), not by a list of
    names: ``numpy.longlong`` is a type of its own next to ``numpy.int64`` on Linux (what
    ``np.array([3], dtype='q')[0]`` is), ``numpy.intc`` next to ``numpy.int32`` elsewhere. Each
    is keyed by its dtype's name (``"numpy.int64"`` for both), since their values are the same
    numbers in the same width. ``numpy.longdouble`` (wider than a double) stays refused."""
    found: dict[type, str] = {}
    for kind in set(np.sctypeDict.values()):
        if issubclass(kind, (np.bool_, np.integer, np.floating)):
            dtype = np.dtype(kind)
            if dtype.kind in "biuf" and dtype.itemsize <= 8:
                found[kind] = f"numpy.{dtype.name}"
    return found


SCALAR_SIGNATURES.update(_numpy_scalar_types())

# Constexpr values of these types are hashable, immutable and equal only to themselves: the lean
# path keys them inline. (Not float: 0.0 == -0.0 and NaN != NaN; floats are keyed by their bits.)
_CONSTEXPR_TYPE_NAMES: dict[type, str] = {t: t.__qualname__ for t in (bool, int, str, type(None), torch.dtype)}

# Types hashed by identity (object.__hash__) whose values are immutable singletons: a Constexpr
# may be one of them. Any other value hashed by identity is refused (see constexpr_signature).
_IDENTITY_HASHED_VALUES: frozenset[type] = frozenset(
    [type(None), type(Ellipsis), type(NotImplemented), torch.dtype, torch.layout, torch.memory_format]
)
_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: a class whose attributes cannot be set


def scalar_signature(value: object, name: str) -> str:
    carried = getattr(value, "__jit_scalar__", None)
    if carried is not None:
        value = carried()
    signature = SCALAR_SIGNATURES.get(type(value))
    if signature is None:
        raise ArgumentError(
            f"parameter {name!r}: unsupported argument type {type(value).__qualname__}; expected "
            "a tensor, an int, float or bool (or numpy scalar), or an object with "
            "__cache_signature__"
        )
    return signature


_HASHABLE_BY_VALUE = (
    "ints, floats, bools, strings, None, torch dtypes, enums, and tuples, frozensets and frozen dataclasses of those"
)


def constexpr_signature(value: object, name: str) -> tuple:
    """The key element of a Constexpr argument: ``(type, exact value)`` (see :func:`exact`).

    The value must be hashable *by value*: a call state is found again by the value's hash and
    ``==``, and its launcher ran with the value's contents. A value hashed by identity (a
    plain object, a function, a class whose attributes can be set: ``object.__hash__``) would
    find the call state built for its old contents after an in-place change, so it is refused
    with a ``TypeError``, also where a tuple, frozenset or frozen dataclass holds one."""
    if isinstance(value, torch.Tensor) or hasattr(value, "__dlpack__"):
        raise TypeError(f"Constexpr parameter {name!r} needs a hashable Python value, got a tensor")
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"Constexpr parameter {name!r} needs a hashable value, got unhashable {type(value).__qualname__}"
        ) from None
    culprit = _hashed_by_identity(value)
    if culprit is not None:
        held = "" if culprit is value else f", which holds a {type(culprit).__qualname__}"
        raise TypeError(
            f"Constexpr parameter {name!r} needs a value hashed by its value ({_HASHABLE_BY_VALUE}), "
            f"got a {type(value).__qualname__}{held} hashed by identity: a change made to it in place "
            "would find the call state compiled for its old contents. Pass the values it holds instead"
        )
    element = (constexpr_type(type(value)), exact(value))
    try:
        hash(element)
    except TypeError:  # a field left out of the value's own hash (dataclasses.field(hash=False))
        raise TypeError(
            f"Constexpr parameter {name!r} needs a hashable value, got a {type(value).__qualname__} "
            "holding an unhashable field"
        ) from None
    return element


def constexpr_type(kind: type) -> object:
    """How a Constexpr key names a value's type: a builtin type (and ``torch.dtype``) by its
    name, so keys read ``("int", 3)``; any other type by the class itself, since names collide
    (``numpy.bool``'s qualname is ``"bool"``, and two classes may share a qualname), and
    ``np.True_`` must not share ``True``'s call state."""
    name = _CONSTEXPR_TYPE_NAMES.get(kind)
    if name is not None:
        return name
    return kind.__qualname__ if kind.__module__ == "builtins" else kind


def _hashed_by_identity(value: object) -> object | None:
    """``value`` itself, or the value it holds (in a tuple, frozenset or dataclass field), that
    is hashed by identity and may change in place; None when there is none."""
    kind = type(value)
    if isinstance(value, (tuple, frozenset)):
        return next((found for item in value if (found := _hashed_by_identity(item)) is not None), None)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = (getattr(value, field.name) for field in dataclasses.fields(value))
        return next((found for item in fields if (found := _hashed_by_identity(item)) is not None), None)
    if kind.__hash__ is not object.__hash__ or kind in _IDENTITY_HASHED_VALUES:
        return None
    if isinstance(value, type) and value.__flags__ & _IMMUTABLE_TYPE:
        return None  # a builtin or extension class (int, numpy.float32): nothing to change in place
    return value


def _float_bits(value: object) -> bytes:
    return value.tobytes() if isinstance(value, np.generic) else struct.pack("<d", value)


def exact(value: object) -> object:
    """A stand-in for a value that equals another's only for the same value, where ``==``
    says more: floats (and complex numbers) by their bit pattern, so ``-0.0`` is not ``0.0``
    and a NaN equals a NaN of the same bits; tuple, frozenset and dataclass elements with
    their types (``(1, 2.0)`` is not ``(1.0, 2.0)``, nor ``(True,)`` ``(1,)``). Other values
    stand for themselves. Constexpr keys use it, and so does the drift check of globals
    (:mod:`jitcore.drift`): one rule for what "the same value" means."""
    if isinstance(value, (float, np.floating)):
        return ("bits", _float_bits(value))
    if isinstance(value, (complex, np.complexfloating)):
        return ("bits", _float_bits(value.real), _float_bits(value.imag))
    if isinstance(value, tuple):
        return tuple((constexpr_type(type(v)), exact(v)) for v in value)
    if isinstance(value, frozenset):
        return frozenset((constexpr_type(type(v)), exact(v)) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(field.name, getattr(value, field.name)) for field in dataclasses.fields(value)]
        return ("fields", tuple((field, constexpr_type(type(v)), exact(v)) for field, v in items))
    return value


def argument_signature(value: object, name: str, *, full: bool) -> object:
    """The key element of one non-Constexpr argument (the generic, slower dispatch).

    Tensors and objects with ``__cache_signature__`` are represented by the interned token of
    their signature (see :class:`~jitcore.tensors.SignatureToken`)."""
    if isinstance(value, torch.Tensor):
        if full:
            return tensors.token_of(tensors.TensorAdaptor(value).__cache_signature__())
        return tensors.lean_token(value)
    if hasattr(value, "__cache_signature__"):
        signature = value.__cache_signature__()
        try:
            return tensors.token_of(signature)
        except TypeError:
            raise TypeError(
                f"parameter {name!r}: __cache_signature__() of {type(value).__qualname__} returned an unhashable value"
            ) from None
    if hasattr(value, "__dlpack__") and not hasattr(value, "__jit_scalar__"):
        return tensors.token_of(tensors.TensorAdaptor(value).__cache_signature__())
    return scalar_signature(value, name)


def _argument_signature_hit(value: object, name: str, *, full: bool) -> object:
    if hasattr(value, "__jit_scalar__"):
        raise LookupError("dynamic scalars take the miss path")
    return argument_signature(value, name, full=full)


_NO_DEFAULT = inspect.Parameter.empty


@attrs.frozen
class Parameter:
    """One launcher parameter as the key plan sees it."""

    name: str
    constexpr: bool = False
    default: object = _NO_DEFAULT


def parameters_of(fn: Callable) -> tuple[Parameter, ...]:
    """Read a launcher's parameter list; *args, **kwargs and keyword-only parameters are
    refused because a key plan needs a fixed, positional parameter list."""
    try:
        signature = inspect.signature(fn, eval_str=True)
    except (NameError, TypeError, SyntaxError):
        signature = inspect.signature(fn)
    result = []
    for param in signature.parameters.values():
        if param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            raise TypeError(
                f"{fn.__qualname__}: parameter {param.name!r} is {param.kind.description}; jit "
                "launchers take a fixed list of positional-or-keyword parameters"
            )
        result.append(Parameter(param.name, is_constexpr_annotation(param.annotation), param.default))
    return tuple(result)


class KeyPlan:
    """Key construction for one parameter list, built once per jit function."""

    @classmethod
    def of(cls, fn: Callable) -> KeyPlan:
        """The plan ``@jit`` builds for launcher ``fn``'s parameter list (``Constexpr``
        annotations read as ``@jit`` reads them).

        Public so that keys can be computed, compared or timed without a backend or a compiled
        call state: ``plan.lean_key(*args)`` (the hit path's key) and ``plan.full_key(*args)``
        (the miss path's) return the key's elements, without the current device that a jit key
        starts with. ``benchmarks/keys.py`` times the two against each other."""
        return cls(parameters_of(fn))

    def __init__(self, parameters: Sequence[Parameter]):
        self.parameters = tuple(parameters)
        self.names = tuple(p.name for p in self.parameters)
        self.namespace: dict[str, object] = {
            "_NAMES": self.names,
            **tensors.LEAN_NAMESPACE,
            "_SCALAR": SCALAR_SIGNATURES,
            "_CONSTEXPR": _CONSTEXPR_TYPE_NAMES,
            "_generic": argument_signature,
            "_generic_hit": _argument_signature_hit,
            "_constexpr": constexpr_signature,
        }
        args = ", ".join(f"_a{i}" for i in range(len(self.names)))
        body = "\n".join("    " + line for line in self.key_lines())
        mapping = ", ".join(f"_a{i} = {name}" for i, name in enumerate(self.names)) or "none"
        self.source = (
            f"def lean_key({args}):\n    # {generated.comment(f'arguments: {mapping}')}\n{body}\n    return _key\n"
        )
        self.filename = generated.source_filename(f"key plan ({', '.join(self.names)})")
        lean_key = generated.define(self.source, self.filename, self.namespace)["lean_key"]
        weakref.finalize(self, generated.forget_source, self.filename)
        lean_key.__code__ = generated.rename_parameters(lean_key.__code__, self.names)
        self.lean_key: Callable[..., tuple] = lean_key  # type: ignore[assignment]

    def key_lines(self, *, hit_path: bool = False, leading: str = "") -> list[str]:
        """Statements that leave the lean key in ``_key``, reading the arguments as ``_a0``, ...
        The jit dispatcher inlines them (``hit_path=True``), so the hit path makes no extra
        call for them; a tensor's are :func:`~jitcore.tensors.lean_token_lines`, the lines
        :func:`~jitcore.tensors.lean_token` is generated from, so the inline key and the
        Python one are one definition. There, dynamic scalars (``__jit_scalar__``) raise
        LookupError so the call takes the miss path, which unwraps them."""
        generic = "_generic_hit" if hit_path else "_generic"
        lines = []
        for index, param in enumerate(self.parameters):
            value, element, name = f"_a{index}", f"_k{index}", f"_NAMES[{index}]"
            if param.constexpr:
                slow = f"_constexpr({value}, {name})"
                lines += [
                    f"_t = _CONSTEXPR.get({value}.__class__)",
                    f"{element} = (_t, {value}) if _t else {slow}",
                ]
                continue
            lines += [
                f"if {value}.__class__ is _Tensor:",
                *["    " + line for line in tensors.lean_token_lines(value, element)],
                "else:",
                f"    {element} = _SCALAR.get({value}.__class__) or {generic}({value}, {name}, full=False)",
            ]
        elements = "".join(f"_k{i}, " for i in range(len(self.parameters)))
        lines.append(f"_key = ({leading}{elements})")
        return lines

    def full_key(self, *args: object) -> tuple:
        """The miss-path key: DLPack-built adaptors for tensors, the same bytes as lean_key."""
        if len(args) != len(self.parameters):
            raise TypeError(f"expected {len(self.parameters)} arguments, got {len(args)}")
        elements = []
        for param, value in zip(self.parameters, args):
            if param.constexpr:
                elements.append(constexpr_signature(value, param.name))
            else:
                elements.append(argument_signature(value, param.name, full=True))
        return tuple(elements)
