"""Region keys: the structure of the arguments plus a shape-exact signature of every leaf.

A graph bakes in grids and sizes, so a replay key is shape-exact even where a jit key is
shape-dynamic: tensors contribute jitcore's lean static signature (dtype, shape, strides,
unit-stride axis, alignment, device, read straight from the tensor, no DLPack); dynamic
scalars their type; every other leaf its exact type (the type object, never a name) and
value, floats and complex numbers by their bits wherever they sit (inside tuples, frozensets,
dict keys, numpy scalars). A graph bakes every leaf that is not a tensor or a dynamic scalar,
so two calls may share a key only where a graph recorded for one computes exactly what the
other would compute eagerly: values whose equality is looser than that (``1 == 1.0 == True``,
``0.0 == -0.0``), and objects compared by identity whose attributes the region reads, are
refused (:class:`RefusedKey`) rather than keyed. The key also carries the current device,
since graphs are recorded and replayed per device.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import decimal
import enum
import fractions
import itertools
import struct
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence

import attrs
import numpy as np
import torch

import jitcore
from jitcore import generated
from jitcore.backends import compiled_helpers_enabled
from replay.dynamic import Dynamic
from replay.errors import ReplayError, ReplayWarning

try:  # the settings check in C (csrc/replay_checks.c; optional, built by setup.py)
    from replay._checks import SettingsCheck as _SettingsCheck
except ImportError:
    _SettingsCheck = None

FLAT = "flat"  # spec of a call whose arguments are all positional leaves


class RefusedKey(ReplayError):
    """A call whose key cannot be made exactly, so no graph may be recorded or replayed for it:
    an argument a graph would bake without the key seeing its changes (an object compared by
    identity, whose attributes the region reads), a constant whose equality is not known to be
    exact (two values it calls equal could share a graph that bakes one of them), a tensor
    inside a constant, or a torch setting that cannot be read. The session runs such a call
    eagerly, with a ReplayWarning naming :attr:`reason` (once per reason and region); ``path``
    names the argument (``args[1].cfg``), None for a setting."""

    def __init__(self, reason: str, path: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.path = path


#: Classes of positional arguments flatten's short path takes as leaves without a look at
#: what they hold (tensors are checked apart, subclasses too).
_FLAT_LEAVES = frozenset({int, float, bool, type(None), str, bytes, Dynamic, torch.dtype, torch.device})


def _walked(value: object) -> bool:
    """Whether a positional argument is a container flatten walks (or refuses): a tuple, list
    or dict of any class, or a dataclass instance."""
    return isinstance(value, (tuple, list, dict)) or hasattr(value.__class__, "__dataclass_fields__")


class RawKeys(tuple):
    """A dict argument's keys as they are, for rebuilding it: a spec compares its keys through
    their exact keys, never through these (``1 == 1.0``; an ``__eq__`` of a user's class may
    even raise, as numpy's does on arrays), so two of these are always equal."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return other.__class__ is RawKeys

    def __ne__(self, other: object) -> bool:
        return other.__class__ is not RawKeys

    def __hash__(self) -> int:
        return 0


@attrs.frozen
class NamedTupleOf:
    """The spec kind of a named tuple: ``kind(*items)`` rebuilds it through ``_make`` (no
    ``__new__`` of a subclass runs again), as graph.py's generated replay calls a kind."""

    cls: type

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


@attrs.frozen
class MappingOf:
    """The spec kind of an ``OrderedDict`` or ``defaultdict``: ``kind(*items)`` rebuilds the
    same class with the same keys in the same order; a defaultdict's first item is its
    ``default_factory`` (a leaf of its own, keyed like any constant). ``exact`` is what the
    key compares (the keys' exact keys for arguments), ``keys`` what rebuilds."""

    cls: type
    keys: tuple = attrs.field(eq=False)
    exact: object

    def __call__(self, *items: object) -> dict:
        if self.cls is collections.defaultdict:
            factory, *values = items
            return collections.defaultdict(factory, zip(self.keys, values))
        return self.cls(zip(self.keys, items))


#: The rebuildable dict subclasses (exact classes): what a region receives and returns is of
#: the class it was given or built.
_MAPPINGS = (collections.OrderedDict, collections.defaultdict)

#: Field names of dataclasses, by class (dataclasses.fields costs microseconds per call).
_FIELD_NAMES: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _no_extra_attributes(value: object, names: Sequence[str], path: str) -> None:
    """Refuse an instance holding attributes beyond ``names``: a rebuilt one would lack them."""
    extra = set(getattr(value, "__dict__", ())) - set(names)
    if extra:
        raise TypeError(
            f"{path}: a {type(value).__qualname__} with attributes that are not fields "
            f"({', '.join(sorted(extra))}) cannot be rebuilt for each replay"
        )


def _tuple_kind(value: tuple, cls: type, path: str) -> object:
    """The spec kind of a tuple subclass, or a clear TypeError for one that cannot be rebuilt."""
    if cls is torch.Size:
        return _SIZE
    fields = getattr(cls, "_fields", None)
    if isinstance(fields, tuple) and len(fields) == len(value) and hasattr(cls, "_make"):
        _no_extra_attributes(value, fields, path)
        return NamedTupleOf(cls)
    sequence_fields = getattr(cls, "n_sequence_fields", None)
    if isinstance(sequence_fields, int) and isinstance(getattr(cls, "n_fields", None), int):  # a structseq
        if cls.n_fields != sequence_fields:
            raise TypeError(
                f"{path} is a {cls.__qualname__}, a structseq with fields that are not items "
                f"({cls.n_fields} fields, {sequence_fields} items): it cannot be rebuilt; pass tuple({path})"
            )
        return StructSeqOf(cls)
    raise TypeError(
        f"{path} is a {cls.__module__}.{cls.__qualname__}, a tuple subclass that cannot be rebuilt (named "
        f"tuples, torch.Size and structseqs such as torch.return_types.topk can be); pass tuple({path})"
    )


def _container_refused(value: object, path: str) -> TypeError:
    base = "dict" if isinstance(value, dict) else "list"
    cls = type(value)
    return TypeError(
        f"{path} is a {cls.__module__}.{cls.__qualname__} (a {base} subclass): region arguments and outputs are "
        f"rebuilt for each call, and of the {base} subclasses only "
        f"{'collections.OrderedDict and collections.defaultdict' if base == 'dict' else 'none'} can be rebuilt "
        f"exactly (the class and its attributes kept); pass a plain {base} ({base}({path})) or the values "
        "themselves, or return them"
    )


def _flatten_into(value: object, leaves: list, path: str, paths: list, outputs: bool) -> object:
    cls = value.__class__
    if cls is tuple or cls is list:
        return (
            "tuple" if cls is tuple else "list",
            tuple(_flatten_into(v, leaves, f"{path}[{i}]", paths, outputs) for i, v in enumerate(value)),
        )
    if cls is dict:
        keys = tuple(value)
        children = tuple(_flatten_into(value[k], leaves, f"{path}[{k!r}]", paths, outputs) for k in keys)
        if outputs:  # no key compares an output's structure
            return ("dict", keys, children)
        # graph.py and _rebuild read the first three; the fourth makes the spec compare the
        # keys exactly ({1: x}, {1.0: x} and {True: x} are three structures), the second not at all
        return ("dict", RawKeys(keys), children, _exact_keys(keys, path))
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        paths.append(path)
        return None
    if isinstance(value, tuple):
        kind = _tuple_kind(value, cls, path)
        return (kind, tuple(_flatten_into(v, leaves, f"{path}[{i}]", paths, outputs) for i, v in enumerate(value)))
    if isinstance(value, dict):
        if cls not in _MAPPINGS:
            raise _container_refused(value, path)
        keys = tuple(value)
        factory: tuple = ()
        if cls is collections.defaultdict:  # the first leaf, as MappingOf takes it
            leaves.append(value.default_factory)
            paths.append(f"{path}.default_factory")
            factory = (None,)
        children = tuple(_flatten_into(value[k], leaves, f"{path}[{k!r}]", paths, outputs) for k in keys)
        children = (*factory, *children)
        return (MappingOf(cls, keys, keys if outputs else _exact_keys(keys, path)), children)
    if isinstance(value, list):
        raise _container_refused(value, path)
    if hasattr(cls, "__dataclass_fields__") and (outputs or cls.__dataclass_params__.frozen):
        names = _field_names(cls)
        _no_extra_attributes(value, names, path)
        return (
            "dataclass",
            cls,
            names,
            tuple(_flatten_into(getattr(value, n), leaves, f"{path}.{n}", paths, outputs) for n in names),
        )
    leaves.append(value)
    paths.append(path)
    return None


def _exact_keys(keys: tuple, path: str) -> tuple:
    """The exact keys of a dict's keys (:func:`constant_key`), in order."""
    return tuple(constant_key(k, f"{path} key {k!r}") for k in keys)


#: The paths of flat calls, by argument count (shared: callers never change ``paths``).
_FLAT_PATHS: dict[int, list[str]] = {}


def flatten(args: tuple, kwargs: dict, *, walk_dataclasses: bool = False) -> tuple[object, list, list[str]]:
    """(spec, leaves, paths): nested tuples, lists and dicts are walked, and so are named
    tuples, ``torch.Size``, structseqs (``torch.return_types.*``), ``OrderedDict``,
    ``defaultdict`` and frozen dataclasses, each rebuilt as its own class by :func:`unflatten`
    (and by a graph's replay, which calls a spec's kind); everything else is a leaf. Other
    tuple, list and dict subclasses raise a clear TypeError naming the path: rebuilt as plain
    containers they would reach the region (or the caller) as another type than eagerly.

    Frozen dataclasses are walked so that the tensors they hold are leaves (rebound like any
    tensor argument) and their other fields constants of the key; a dataclass that is not
    frozen stays a leaf (an unhashable one is refused with a TypeError, a hashable one as a
    constant whose equality is not exact), since a rebuilt copy would take the writes the
    region makes to it. ``walk_dataclasses=True`` (outputs) walks every dataclass, and leaves
    dict keys out of the spec's comparison (no key compares an output's structure).

    ``paths`` name each leaf for messages (``args[1]['kv']``); callers read them and never
    change them (flat calls share theirs)."""
    if not kwargs and not walk_dataclasses:
        for a in args:
            cls = a.__class__
            if cls is torch.Tensor or cls in _FLAT_LEAVES:
                continue
            if _walked(a):
                break
        else:
            count = len(args)
            paths = _FLAT_PATHS.get(count)
            if paths is None:
                paths = _FLAT_PATHS[count] = [f"args[{i}]" for i in range(count)]
            return (FLAT, count), list(args), paths
    leaves: list = []
    paths: list[str] = []
    spec = (
        tuple(_flatten_into(a, leaves, f"args[{i}]", paths, walk_dataclasses) for i, a in enumerate(args)),
        tuple(kwargs),
        tuple(_flatten_into(v, leaves, k, paths, walk_dataclasses) for k, v in kwargs.items()),
    )
    return spec, leaves, paths


def make_dataclass_instance(cls: type, names: Sequence[str], values: Sequence) -> object:
    """A new instance of a dataclass with these field values (frozen ones too), without
    running ``__init__``/``__post_init__``: what a region returned, with new outputs."""
    instance = object.__new__(cls)
    for name, value in zip(names, values):
        object.__setattr__(instance, name, value)
    return instance


def _rebuild(spec: object, leaves: Sequence, position: list[int]) -> object:
    if spec is None:
        value = leaves[position[0]]
        position[0] += 1
        return value
    kind = spec[0]
    if kind == "dict":
        return {k: _rebuild(s, leaves, position) for k, s in zip(spec[1], spec[2])}
    if kind == "dataclass":
        return make_dataclass_instance(spec[1], spec[2], [_rebuild(s, leaves, position) for s in spec[3]])
    items = [_rebuild(s, leaves, position) for s in spec[1]]
    if kind == "tuple":
        return tuple(items)
    if kind == "list":
        return items
    return kind(*items)  # NamedTupleOf, StructSeqOf, SizeOf, MappingOf: as graph.py's replay calls it


def unflatten(spec: object, leaves: Sequence) -> tuple[tuple, dict]:
    """Rebuild (args, kwargs) from a spec and (possibly replaced) leaves."""
    if spec[0] == FLAT:
        return tuple(leaves), {}
    position = [0]
    args = tuple(_rebuild(s, leaves, position) for s in spec[0])
    kwargs = {k: _rebuild(s, leaves, position) for k, s in zip(spec[1], spec[2])}
    return args, kwargs


#: Constants keyed by their class and value as they are: equality of two values of one of
#: these exact classes is exact (the same value, the same behaviour).
_BY_VALUE = frozenset(
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
        return jitcore.lean_static_signature(leaf)
    if cls in _BY_VALUE:
        return (cls, leaf)
    if cls is float:  # by bit pattern: -0.0 == 0.0 and nan != nan, yet each is its own constant
        return (float, _pack_double(leaf))
    if isinstance(leaf, torch.Tensor):
        return jitcore.lean_static_signature(leaf)
    if isinstance(leaf, Dynamic):
        return ("dynamic", leaf.value.__class__)  # the type object: np.bool_ is not bool
    return _other_constant_key(leaf, cls, path)


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
    if cls in _BY_VALUE:
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


def _other_constant_key(value: object, cls: type, path: str) -> object:
    """:func:`constant_key` beyond its commonest classes (see there)."""
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
        kind = _tuple_kind(value, cls, path)
        return (kind, tuple(constant_key(v, f"{path}[{i}]") for i, v in enumerate(value)))
    if hasattr(cls, "__dataclass_fields__") and cls.__dataclass_params__.frozen:
        names = _field_names(cls)
        _no_extra_attributes(value, names, path)
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
_BASE_VALUE: dict[type, Callable[[object], object]] = {
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
            f"region argument {path} is an nn.Module ({name}), compared by identity: a graph bakes what the "
            "region reads from it besides its tensors (Python attributes, submodules replaced later), and "
            "changing those keeps the key, so calls passing it run eagerly. Close over the module instead (a "
            "global or closure of the region: its parameters are read at their addresses, its attributes are "
            "baked, see docs/replay.md), or pass the tensors and values the region needs"
        )
    if cls.__hash__ is object.__hash__:
        return (
            f"region argument {path} is a {name}, an object compared by identity: a graph bakes the attributes "
            "the region reads from it, and changing one (obj.attr = value) keeps the key, so calls passing it "
            "run eagerly. Pass the values themselves (replay.dynamic for numbers that change), a frozen "
            "dataclass or named tuple of them, or close over the object (its attributes are then baked, as "
            "docs/replay.md says)"
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


def region_key(device: int, spec: object, leaves: Sequence, paths: Sequence[str]) -> tuple:
    """The full key of one call: device, the torch modes in force, the argument structure,
    how the tensor arguments overlap each other, and each leaf's signature. Raises
    RefusedKey for a call no graph may serve (see :func:`constant_key`, :func:`torch_modes`):
    the session runs it eagerly."""
    return (device, spec, torch_modes(), alias_pattern(leaves), *map(leaf_key, leaves, paths))


#: Key elements before the leaves' (device, spec, modes, aliasing).
LEAVES_START = 4


def tensor_ranges(leaves: Sequence) -> list[tuple[int, int, int]]:
    """(leaf index, first byte, one past the last byte) of every tensor leaf."""
    ranges = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            lo = leaf.data_ptr()
            ranges.append((i, lo, lo + extent_bytes(leaf)))
    return ranges


def alias_pattern(leaves: Sequence) -> tuple[tuple[int, int], ...]:
    """The pairs of tensor leaves whose bytes overlap (the same tensor twice, overlapping
    views). A graph recorded for one pattern must never serve another: a region that writes
    one argument and reads the other gives different results when they share memory.

    Most calls pass tensors of distinct allocations: when the storages' byte spans are
    disjoint, no two tensors can overlap and the exact element ranges are not computed."""
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if len(tensors) < 2:
        return ()
    try:
        spans = sorted((s.data_ptr(), s.nbytes()) for s in (t.untyped_storage() for t in tensors))
    except (RuntimeError, NotImplementedError):  # a tensor without a plain storage
        spans = None
    if spans is not None and all(lo + size <= next_lo for (lo, size), (next_lo, _) in itertools.pairwise(spans)):
        return ()
    return pattern_of(tensor_ranges(leaves))


#: Argument types that hold no tensor and are keyed by value as they are.
PLAIN_CONSTANTS = frozenset({int, float, bool, type(None), str, torch.dtype, torch.device})


class MergedRanges:
    """Byte ranges merged into disjoint, sorted spans, for asking many times whether a range
    overlaps any of them (a binary search instead of a walk over every range)."""

    __slots__ = ("_starts", "_ends")

    def __init__(self, ranges: Iterable[tuple[int, int]]):
        starts: list[int] = []
        ends: list[int] = []
        for lo, hi in sorted(r for r in ranges if r[0] < r[1]):
            if ends and lo <= ends[-1]:
                ends[-1] = max(ends[-1], hi)
            else:
                starts.append(lo)
                ends.append(hi)
        self._starts, self._ends = starts, ends

    def overlaps(self, lo: int, hi: int) -> bool:
        """Whether ``[lo, hi)`` shares a byte with a span (an empty range shares none). Spans
        are disjoint and sorted, so the last one starting before ``hi`` reaches furthest."""
        if hi <= lo:
            return False
        last = bisect.bisect_left(self._starts, hi) - 1
        return last >= 0 and self._ends[last] > lo


def pattern_of(ranges: Sequence[tuple[int, int, int]]) -> tuple[tuple[int, int], ...]:
    """The overlapping pairs among (leaf index, first byte, one past the last byte) ranges."""
    ranges = sorted(ranges, key=lambda r: r[1])
    pairs = []
    for n, (i, lo, hi) in enumerate(ranges):
        for j, other_lo, other_hi in ranges[n + 1 :]:
            if other_lo >= hi:
                break
            if other_lo < other_hi and lo < hi:
                pairs.append((min(i, j), max(i, j)))
    return tuple(sorted(pairs))


@attrs.frozen
class _ModeReader:
    """One global torch setting: the function that reads it and its arguments. A reader
    returning a list is keyed as a tuple (keys hold hashable values)."""

    what: str
    getter: str  # its name in torch._C (or torch): what the torch-side helper's SETTINGS_COVERED names
    function: Callable
    args: tuple
    returns_list: bool

    def read(self) -> object:
        value = self.function(*self.args)
        return tuple(value) if self.returns_list else value


#: torch >= 2.9's reader of its per-backend float32 precisions (``torch.backends.fp32_precision``,
#: ``torch.backends.cuda.matmul.fp32_precision``, ``torch.backends.cudnn.fp32_precision``,
#: ``.cudnn.conv``/``.cudnn.rnn``, ``torch.backends.mkldnn.*``); None in an older torch.
_FP32_PRECISION = getattr(torch._C, "_get_fp32_precision_getter", None)
#: The (backend, operation) pairs it reads: each is keyed as stored (``"none"`` defers to the
#: backend's ``"all"``, which defers to the generic one), so the precision every op uses follows.
#: Not the ``mkldnn`` ones: oneDNN runs CPU ops, and a graph holds GPU work only (a region's
#: CPU tensor work is refused or runs eagerly under the settings of the moment), so they change
#: nothing a replay does; reading them cost four more calls (about 0.8 us) on every replay.
_FP32_PRECISIONS = (
    ("generic", "all"),
    ("cuda", "all"),
    ("cuda", "matmul"),
    ("cuda", "conv"),
    ("cuda", "rnn"),
)
#: The legacy TF32 getters those values replace where they exist. Why: torch >= 2.9 keeps the
#: TF32 state in the per-backend map (the legacy setters write it: set_float32_matmul_precision,
#: cuda.matmul.allow_tf32, cudnn.allow_tf32), and its legacy getters only answer while they
#: agree with it: once the new API was used (before or after replay was imported) they raise
#: RuntimeError ("mix of the legacy and new APIs"), about 14 us each on the CPU machine, which
#: would make every key and every replay check either fail or pay it.
_SUPERSEDED_BY_FP32_PRECISION = frozenset({"float32 matmul precision", "cuBLAS TF32", "cuDNN TF32"})


def _mode_readers() -> list[_ModeReader]:
    """A reader for every global torch setting that changes what a region's torch ops
    compute. A graph bakes in the kernels chosen under the settings in force when it was
    recorded, so these are part of every region key. Settings the installed torch does not
    have (no reader function, a float32-precision pair it does not know) are left out; a
    reader it has is never left out, even one that fails now (torch_modes then refuses the
    call: RefusedKey, the session runs it eagerly with a warning, rather than a key without it)."""
    C = torch._C
    wanted: list[tuple[str, str, tuple, bool]] = [
        ("grad mode", "is_grad_enabled", (), False),
        ("inference mode", "is_inference_mode_enabled", (), False),
        ("autocast (cuda)", "is_autocast_enabled", ("cuda",), False),
        ("autocast dtype (cuda)", "get_autocast_dtype", ("cuda",), False),
        ("autocast (cpu)", "is_autocast_enabled", ("cpu",), False),
        ("autocast dtype (cpu)", "get_autocast_dtype", ("cpu",), False),
        ("autocast cache", "is_autocast_cache_enabled", (), False),
        ("default dtype", "get_default_dtype", (), False),
        ("deterministic algorithms", "_get_deterministic_algorithms", (), False),
        ("deterministic algorithms (warn only)", "_get_deterministic_algorithms_warn_only", (), False),
        # torch.empty and the like fill their memory (NaN, max ints) under deterministic algorithms
        ("deterministic fill of uninitialized memory", "_get_deterministic_fill_uninitialized_memory", (), False),
        ("float32 matmul precision", "_get_float32_matmul_precision", (), False),
        ("cuBLAS TF32", "_get_cublas_allow_tf32", (), False),
        *((f"fp32 precision ({b} {op})", "_get_fp32_precision_getter", (b, op), False) for b, op in _FP32_PRECISIONS),
        ("cuBLAS fp16 reduced precision", "_get_cublas_allow_fp16_reduced_precision_reduction", (), False),
        ("cuBLAS bf16 reduced precision", "_get_cublas_allow_bf16_reduced_precision_reduction", (), False),
        ("cuBLAS fp16 accumulation", "_get_cublas_allow_fp16_accumulation", (), False),
        ("cuDNN TF32", "_get_cudnn_allow_tf32", (), False),
        ("cuDNN enabled", "_get_cudnn_enabled", (), False),
        ("cuDNN benchmark", "_get_cudnn_benchmark", (), False),
        ("cuDNN deterministic", "_get_cudnn_deterministic", (), False),
        ("cuDNN depthwise kernel", "_get_cudnn_depthwise_kernel", (), False),
        ("SDPA flash", "_get_flash_sdp_enabled", (), False),
        ("SDPA memory-efficient", "_get_mem_efficient_sdp_enabled", (), False),
        ("SDPA math", "_get_math_sdp_enabled", (), False),
        ("SDPA cuDNN", "_get_cudnn_sdp_enabled", (), False),
        ("SDPA FlashAttention-3", "_get_fa3_sdp_enabled", (), False),
        ("SDPA math fp16/bf16 reduction", "_get_math_sdp_allow_fp16_bf16_reduction", (), False),
        ("SDPA priority order", "_get_sdp_priority_order", (), True),
        ("preferred BLAS library", "_get_blas_preferred_backend", (), False),
        ("preferred linalg library", "_get_linalg_preferred_backend", (), False),
        ("preferred ROCm flash-attention library", "_get_rocm_fa_preferred_backend", (), False),
    ]
    readers = []
    for what, name, args, returns_list in wanted:
        if _FP32_PRECISION is not None and what in _SUPERSEDED_BY_FP32_PRECISION:
            continue
        function = getattr(C, name, None) or getattr(torch, name, None)
        if function is None:
            continue  # not a setting of this torch
        if function is _FP32_PRECISION:
            try:  # the new API never refuses a pair it knows (no legacy state to disagree with)
                function(*args)
            except (RuntimeError, ValueError, TypeError):
                continue  # a backend or operation this torch does not have
        readers.append(_ModeReader(what, name, function, args, returns_list))
    return readers


_MODE_READERS = _mode_readers()
MODE_NAMES = tuple(reader.what for reader in _MODE_READERS)


def _call_source(number: int, reader: _ModeReader, namespace: dict) -> str:
    """``_m3(_m3_arg0)``: the reader called with its arguments bound by name."""
    namespace[f"_m{number}"] = reader.function
    names = []
    for position, value in enumerate(reader.args):
        namespace[f"_m{number}_arg{position}"] = value
        names.append(f"_m{number}_arg{position}")
    return f"_m{number}({', '.join(names)})"


def _unreadable_settings() -> list[tuple[str, BaseException]]:
    """The settings whose reader raises now, with what it raised (read one by one: the slow
    path after a reading failed)."""
    failed = []
    for reader in _MODE_READERS:
        try:
            reader.read()
        except Exception as error:
            failed.append((reader.what, error))
    return failed


def _describe_unreadable(failed: list[tuple[str, BaseException]], error: BaseException) -> str:
    if not failed:  # it failed once and not again: say what it raised
        return f"a torch setting could not be read ({type(error).__name__}: {_first_line(error)})"
    return "; ".join(
        f"the torch setting {what} cannot be read ({type(e).__name__}: {_first_line(e)})" for what, e in failed
    )


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:200] if lines else type(error).__name__


def _refuse_unreadable(error: BaseException) -> None:
    """torch_modes failed: refuse the call (RefusedKey: the session runs it eagerly and warns),
    never a key without the setting. Why: a graph recorded under a setting the key does not
    hold would serve calls made under another value of it."""
    reason = _describe_unreadable(_unreadable_settings(), error)
    raise RefusedKey(f"{reason}: no graph may serve a call while a setting it bakes cannot be read") from error


def _make_torch_modes() -> Callable[[], tuple]:
    """One generated function reading every mode into a tuple (a call per setting, no loop);
    a reader that raises makes it raise RefusedKey naming the setting."""
    namespace: dict[str, object] = {"_tuple": tuple, "_refuse": _refuse_unreadable}
    calls = []
    for number, reader in enumerate(_MODE_READERS):
        call = _call_source(number, reader, namespace)
        calls.append(f"_tuple({call}), " if reader.returns_list else f"{call}, ")
    source = (
        "def torch_modes():\n"
        "    try:\n"
        f"        return ({''.join(calls)})\n"
        "    except Exception as error:\n"
        "        _refuse(error)\n"
    )
    return generated.define(source, "<replay torch modes>", namespace)["torch_modes"]


torch_modes: Callable[[], tuple] = _make_torch_modes()
torch_modes.__doc__ = (
    "The global torch settings in force now, in MODE_NAMES order (see _mode_readers); RefusedKey when one "
    "cannot be read."
)

#: Settings whose unreadability a replay check has warned about (once each).
_WARNED_UNREADABLE: set[str] = set()


def _unreadable_in_check() -> bool:
    """A replay's settings check could not read a setting: the replay is refused (True: the
    graph declines, the call runs eagerly), with a ReplayWarning once per setting. The C check
    and the generated one both call it, in place of raising."""
    failed = _unreadable_settings()
    names = [what for what, _ in failed] or ["(one that failed once)"]
    new = [name for name in names if name not in _WARNED_UNREADABLE]
    if new:
        _WARNED_UNREADABLE.update(new)
        reason = _describe_unreadable(failed, RuntimeError("it raised while checked"))
        warnings.warn(
            ReplayWarning(f"{reason}: replays are refused (the calls run eagerly) while it cannot be read"),
            stacklevel=3,
        )
    return True


#: Values a reader returns as the same object whenever the setting is the same (bools, None,
#: torch's dtype singletons): compared by identity, the cheapest check there is.
_SINGLETON_TYPES = (bool, type(None), torch.dtype)
#: The settings that change what an op computes only while autocast is on (for CUDA or the CPU).
_AUTOCAST_SETTINGS = frozenset(
    {"autocast (cuda)", "autocast dtype (cuda)", "autocast (cpu)", "autocast dtype (cpu)", "autocast cache"}
)
#: One call saying whether autocast is on for any device (None in a torch without it).
_any_autocast: Callable[[], bool] | None = getattr(torch._C, "_is_any_autocast_enabled", None)
_modes_changed_cache: dict[tuple, Callable[[], bool]] = {}  # (recorded, the C type or None) -> check


def _is_pybind_enum(value: object) -> bool:
    """A pybind11 enum member (torch's preferred-library settings): its ``.value`` is its int."""
    return hasattr(type(value), "__members__") and isinstance(getattr(value, "value", None), int)


def modes_changed(recorded: tuple, *, compiled: bool = True, watch: bool = True) -> Callable[[], bool]:
    """A function telling whether any torch setting differs from ``recorded`` (a
    ``torch_modes()`` tuple) in a way that can change what a region computes, for replay's
    per-call check. It reads the same settings as ``torch_modes`` but builds no tuple and
    compares each value the cheapest exact way: singletons by identity, lists as lists,
    pybind enums by their int ``.value`` (their ``!=`` costs about 0.4 us), others (strings)
    by equality; the first difference ends it.

    Where autocast was off for both CUDA and the CPU when recorded, one call checks that it
    is still off for every device (``torch._C._is_any_autocast_enabled``) instead of the five
    autocast settings: the autocast dtypes and cache change nothing while autocast is off, so
    a change of them then is no change of what the graph computes (the region's key, which
    holds every setting, still tells such calls apart on the eager path).

    Three ways to run those tests, the fastest one built:

    - the torch-side helper's settings watch (:mod:`jitcore.torch_native`, where it is built):
      every setting it covers is read through torch's C++ getters into one state, and while
      that state equals the one in which the full check last said "unchanged", only the
      settings it does not cover are tested (none on the torches tested); any other state runs
      the full check. About 0.6 us against 4.7 on the CPU machine.
    - replay._checks.SettingsCheck where that C helper was built (the same calls and
      comparisons in the same order, without a bytecode step per setting: see
      csrc/replay_checks.c);
    - a generated function (``JITCORE_NATIVE=0`` or ``compiled=False`` picks it).

    ``watch=False`` leaves the helper's watch out (benchmarks time each way).

    Made once per distinct recorded tuple and helper. Where a setting cannot be read (its
    reader raises), every way says True, a change, so the replay is refused and the call runs
    eagerly, and warns once per setting (:func:`_unreadable_in_check`): never a replay checked
    without it."""
    native = _settings_check_type() if compiled else None
    helper = _settings_helper() if compiled and watch else None
    cache_key = (recorded, native, helper)
    check = _modes_changed_cache.get(cache_key)
    if check is not None:
        return check
    tests = _mode_tests(recorded)
    check = _full_modes_check(tests, native)
    if helper is not None:
        covered = set(helper.SETTINGS_COVERED)
        residual = [test for test in tests if (test.getter, test.args) not in covered]
        check = helper.settings_watch(check, _full_modes_check(residual, native) if residual else None)
    _modes_changed_cache[cache_key] = check
    return check


def _full_modes_check(tests: list[_ModeTest], native: type | None) -> Callable[[], bool]:
    """``tests`` as one check: csrc/replay_checks.c's type where given, else generated Python."""
    if native is None:
        return _generated_modes_check(tests)
    return native(
        tuple(test.function for test in tests),
        tuple(test.args for test in tests),
        tuple(test.value for test in tests),
        "".join(test.way for test in tests),
        unreadable=_unreadable_in_check,
    )


def _settings_helper() -> object | None:
    """The torch-side helper where it is loaded and reads this torch's settings (its
    ``settings_watch``), else None."""
    helper = jitcore.torch_native.module()
    if helper is None or getattr(helper, "SETTINGS_COVERED", None) is None:
        return None
    return helper


def _settings_check_type() -> type | None:
    """replay._checks.SettingsCheck, or None where it was not built or ``JITCORE_NATIVE=0``."""
    if _SettingsCheck is None or not compiled_helpers_enabled():
        return None
    return _SettingsCheck


#: How a mode test compares a reader's value with the recorded one (csrc/replay_checks.c's ways).
_IDENTITY, _EQUALITY, _ENUM_VALUE = "i", "e", "v"


@attrs.frozen
class _ModeTest:
    """One per-replay test: call ``function(*args)`` (torch's getter ``getter``) and compare
    its value with ``value`` the ``way`` given."""

    getter: str
    function: Callable
    args: tuple
    value: object
    way: str


def _mode_tests(recorded: tuple) -> list[_ModeTest]:
    """The per-replay tests of ``recorded``, in order, as :func:`modes_changed` describes."""
    tests: list[_ModeTest] = []
    values = dict(zip(MODE_NAMES, recorded, strict=True))
    autocast_off = (
        _any_autocast is not None
        and _AUTOCAST_SETTINGS <= values.keys()
        and values["autocast (cuda)"] is False
        and values["autocast (cpu)"] is False
    )
    if autocast_off:
        tests.append(_ModeTest("_is_any_autocast_enabled", _any_autocast, (), False, _IDENTITY))
    for reader, value in zip(_MODE_READERS, recorded, strict=True):
        if autocast_off and reader.what in _AUTOCAST_SETTINGS:
            continue
        if reader.returns_list:
            way, value = _EQUALITY, list(value)
        elif isinstance(value, _SINGLETON_TYPES):
            way = _IDENTITY
        elif _is_pybind_enum(value):
            way, value = _ENUM_VALUE, value.value
        else:
            way = _EQUALITY
        tests.append(_ModeTest(reader.getter, reader.function, reader.args, value, way))
    return tests


def _generated_modes_check(tests: list[_ModeTest]) -> Callable[[], bool]:
    """The tests as one generated ``or`` chain (the check without the C helpers)."""
    namespace: dict[str, object] = {}
    lines = []
    for number, test in enumerate(tests):
        name = "_any_autocast" if test.function is _any_autocast else f"_m{number}"  # named in dumps
        namespace[name] = test.function
        way, value = test.way, test.value
        names = []
        for position, argument in enumerate(test.args):
            namespace[f"_m{number}_arg{position}"] = argument
            names.append(f"_m{number}_arg{position}")
        call = f"{name}({', '.join(names)})"
        namespace[f"_v{number}"] = value
        if way == _IDENTITY:
            lines.append(f"{call} is not _v{number}")
        elif way == _ENUM_VALUE:
            lines.append(f"{call}.value != _v{number}")
        else:
            lines.append(f"{call} != _v{number}")
    body = "\n            or ".join(lines) or "False"
    namespace["_unreadable"] = _unreadable_in_check
    source = (
        "def modes_changed():\n"
        "    try:\n"
        f"        return (\n            {body}\n        )\n"
        "    except Exception:\n"
        "        return _unreadable()\n"
    )
    return generated.define(source, generated.source_filename("replay torch modes check"), namespace)["modes_changed"]


def describe_mode_change(recorded: tuple, now: tuple) -> str:
    changed = [f"{name} {a!r} -> {b!r}" for name, a, b in zip(MODE_NAMES, recorded, now) if a != b]
    return ", ".join(changed) or "none"


def plain_leaves(leaves: Sequence) -> list:
    """Leaves with dynamic markers replaced by their values: what an eager run receives."""
    return [leaf.value if isinstance(leaf, Dynamic) else leaf for leaf in leaves]


def byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """(first byte, one past the last byte) the tensor can reach."""
    start = tensor.data_ptr()
    return start, start + extent_bytes(tensor)


def storage_range(tensor: torch.Tensor) -> tuple[int, int]:
    """(first byte, one past the last byte) of the tensor's whole storage."""
    storage = tensor.untyped_storage()
    start = storage.data_ptr()
    return start, start + storage.nbytes()


def extent_bytes(tensor: torch.Tensor) -> int:
    """Bytes from the data pointer to one past the last element the tensor can reach."""
    if tensor.is_contiguous():  # the usual tensor, without a walk of its sizes and strides
        return tensor.numel() * tensor.element_size()
    if tensor.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()) if size > 0)
    return (last + 1) * tensor.element_size()
