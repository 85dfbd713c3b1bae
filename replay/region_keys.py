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
since graphs are recorded and replayed per device, and the global torch settings in force
(:mod:`replay.torch_state`). Where the caller asks (``flatten(..., walk_objects=True)``), an
object argument is walked rather than refused (:mod:`replay.objects`): its class, structure
and plain values are keyed and its tensors are leaves.
"""

from __future__ import annotations

import bisect
import collections
import enum
import itertools
import typing
from collections.abc import Iterable, Sequence

import attrs
import torch

from replay import objects
from replay.dynamic import Dynamic
from replay.errors import ReplayError
from replay.objects import ObjectWalk
from replay.torch_state import (  # noqa: F401 (what callers read here)
    MODE_NAMES,
    _settings_check_type,
    modes_changed,
    torch_modes,
)
from replay.value_keys import (
    constant_key,
    field_names,
    frozen_dataclass,
    leaf_key,
    no_extra_attributes,
    tuple_kind,
)

FLAT = "flat"  # spec of a call whose arguments are all positional leaves


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


def _flatten_into(
    value: object, leaves: list, path: str, paths: list, outputs: bool, walk: ObjectWalk | None
) -> object:
    cls = value.__class__
    if cls is tuple or cls is list:
        return (
            "tuple" if cls is tuple else "list",
            tuple(_flatten_into(v, leaves, f"{path}[{i}]", paths, outputs, walk) for i, v in enumerate(value)),
        )
    if cls is dict:
        keys = tuple(value)
        children = tuple(_flatten_into(value[k], leaves, f"{path}[{k!r}]", paths, outputs, walk) for k in keys)
        if outputs:  # no key compares an output's structure
            return ("dict", _output_keys(keys, path), children)
        # graph.py and _rebuild read the first three; the fourth makes the spec compare the
        # keys exactly ({1: x}, {1.0: x} and {True: x} are three structures), the second not at all
        return ("dict", RawKeys(keys), children, _exact_keys(keys, path))
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        paths.append(path)
        return None
    if isinstance(value, (tuple, dict, list)):
        return _flatten_subclass(value, cls, leaves, path, paths, outputs, walk)
    if hasattr(cls, "__dataclass_fields__") and (outputs or frozen_dataclass(cls)):
        names = field_names(cls)
        no_extra_attributes(value, names, path)
        return (
            "dataclass",
            cls,
            names,
            tuple(_flatten_into(getattr(value, n), leaves, f"{path}.{n}", paths, outputs, walk) for n in names),
        )
    if walk is not None and objects.is_object(value):
        return walk.carrier(value, path)
    leaves.append(value)
    paths.append(path)
    return None


def _flatten_subclass(
    value: object, cls: type, leaves: list, path: str, paths: list, outputs: bool, walk: ObjectWalk | None
) -> object:
    """A tuple, dict or list subclass: rebuilt as its own class, or a clear TypeError."""
    if isinstance(value, tuple):
        kind = tuple_kind(value, cls, path)
        items = tuple(_flatten_into(v, leaves, f"{path}[{i}]", paths, outputs, walk) for i, v in enumerate(value))
        return (kind, items)
    if isinstance(value, list) or cls not in _MAPPINGS:
        raise _container_refused(value, path)
    keys = tuple(value)
    factory: tuple = ()
    if cls is collections.defaultdict:  # the first leaf, as MappingOf takes it
        leaves.append(typing.cast(collections.defaultdict, value).default_factory)
        paths.append(f"{path}.default_factory")
        factory = (None,)
    children = tuple(_flatten_into(value[k], leaves, f"{path}[{k!r}]", paths, outputs, walk) for k in keys)
    children = (*factory, *children)
    return (MappingOf(cls, keys, _output_keys(keys, path) if outputs else _exact_keys(keys, path)), children)


def _exact_keys(keys: tuple, path: str) -> tuple:
    """The exact keys of a dict's keys (:func:`constant_key`), in order."""
    return tuple(constant_key(k, f"{path} key {k!r}") for k in keys)


def _output_keys(keys: tuple, path: str) -> tuple:
    """A returned dict's keys, which a replay returns as recorded: a tensor among them (or in a
    tuple or frozenset key) would be the recording's object at every replay, where eager
    returns the call's (``{x: y}``), so it is a TypeError naming the path."""
    pending = list(keys)
    while pending:
        key = pending.pop()
        if isinstance(key, torch.Tensor):
            raise TypeError(
                f"{path} is a dict keyed by a tensor: a replay would return the recording's tensor as its key "
                "(key it by something else, or return the tensor as a value)"
            )
        if isinstance(key, (tuple, frozenset)):
            pending.extend(key)
    return keys


#: The paths of flat calls, by argument count (shared: callers never change ``paths``), for
#: counts below ``_FLAT_PATHS_KEPT``: a call of more arguments makes its own.
_FLAT_PATHS: dict[int, list[str]] = {}
_FLAT_PATHS_KEPT = 256


def flatten(
    args: tuple, kwargs: dict, *, walk_dataclasses: bool = False, walk_objects: bool = False
) -> tuple[object, list, list[str]]:
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

    ``walk_objects=True`` walks object arguments (:mod:`replay.objects`: whatever a key would
    otherwise refuse as compared by identity, a dataclass that is not frozen included): each
    is a carrier leaf followed by its shadow leaves, and the spec gets a fourth element, an
    :class:`~replay.objects.ObjectLeaves` saying where they lie. Without it such arguments
    are leaves, which the key refuses.

    ``paths`` name each leaf for messages (``args[1]['kv']``); callers read them and never
    change them (flat calls share theirs)."""
    return _flatten(args, kwargs, walk_dataclasses, walk_objects, None)


def _flatten(
    args: tuple, kwargs: dict, walk_dataclasses: bool, walk_objects: bool, starts: list[int] | None
) -> tuple[object, list, list[str]]:
    """:func:`flatten`, noting in ``starts`` (where given) the first leaf of each argument."""
    plain = not kwargs and not walk_dataclasses
    if plain and not walk_objects:
        for a in args:
            cls = a.__class__
            if cls is torch.Tensor or cls in _FLAT_LEAVES:
                continue
            if _walked(a):
                break
        else:
            return _flat(args)
    leaves: list = []
    paths: list[str] = []
    walk = objects.ObjectWalk(leaves, paths) if walk_objects else None
    positional, keywords = [], []
    for i, a in enumerate(args):
        if starts is not None:
            starts.append(len(leaves))
        positional.append(_flatten_into(a, leaves, f"args[{i}]", paths, walk_dataclasses, walk))
    for k, v in kwargs.items():
        if starts is not None:
            starts.append(len(leaves))
        keywords.append(_flatten_into(v, leaves, k, paths, walk_dataclasses, walk))
    spec = (tuple(positional), tuple(kwargs), tuple(keywords))
    if walk is not None:
        if walk.carriers:
            return (*spec, walk.object_leaves()), leaves, paths
        if plain and positional.count(None) == len(args):  # nothing walked: the flat call's own form
            return (FLAT, len(args)), leaves, paths
    return spec, leaves, paths


def _flat(args: tuple) -> tuple[object, list, list[str]]:
    """(spec, leaves, paths) of a call whose arguments are all positional leaves."""
    count = len(args)
    paths = _FLAT_PATHS.get(count)
    if paths is None:
        paths = [f"args[{i}]" for i in range(count)]
        if count < _FLAT_PATHS_KEPT:
            _FLAT_PATHS[count] = paths
    return (FLAT, count), list(args), paths


@attrs.define(slots=True)
class FlatCall:
    """A region call flattened once (:func:`flat_call`): what every step of the call's way
    through the session reads (its count, its key, an eager run, a recording, its padding),
    so that none flattens it again. Never changed once made: a call with other leaves
    (padded, unpadded, a verified replay's copies) is another FlatCall
    (``attrs.evolve(call, leaves=...)``)."""

    spec: object
    leaves: list
    paths: list[str]
    #: The first leaf of each argument, positional ones first (None: each argument is a leaf,
    #: argument ``i`` leaf ``i``).
    starts: list[int] | None = None


def flat_call(args: tuple, kwargs: dict, *, walk_objects: bool = False) -> FlatCall:
    """A region call's arguments flattened (as :func:`flatten` does) into one :class:`FlatCall`.
    ``walk_objects``: object arguments walked (the session's full path), else leaves a key refuses."""
    starts: list[int] = []
    spec, leaves, paths = _flatten(args, kwargs, False, walk_objects, starts)
    return FlatCall(spec, leaves, paths, starts if spec[0] != FLAT else None)


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
    if kind == "object":  # the caller's object itself; its shadow leaves follow it
        value = leaves[position[0]]
        position[0] += 1 + spec[2]
        return value
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


class KeyMark(enum.Enum):
    """Key elements after the leaves' elements."""

    #: followed by the indices of the tensor leaves that require grad (see region_key)
    REQUIRES_GRAD = "requires grad"
    #: followed by (leaf index, data pointer) of the object tensors keyed by their address
    ADDRESSES = "at fixed addresses"


def region_key(
    device: int, spec: object, leaves: Sequence, paths: Sequence[str], addressed: Iterable[int] = ()
) -> tuple:
    """The full key of one call: device, the torch modes in force, the argument structure,
    how the tensor arguments overlap each other, and each leaf's signature; and which tensor
    arguments require grad, where any does: ``(..., (KeyMark.REQUIRES_GRAD, indices))``.
    Raises RefusedKey for a call no graph may serve (see :func:`constant_key`,
    :func:`torch_modes`): the session runs it eagerly. A walked object's carrier is keyed as
    :data:`CARRIER` (its class and structure are in the spec, what it holds in its shadow
    leaves' elements).

    ``addressed``: the shadow tensors (leaf indices) keyed by their data pointers as well,
    ``(..., (KeyMark.ADDRESSES, ((index, pointer), ...)))`` before the grad mark. Why: the
    region reads an object's tensors through the object, so nothing can stage them; where a
    node replay cannot rebind reads or writes one (a torch op: Hugging Face's ``index_copy_``
    into its cache), the graph holds its address, and so must the key (a decode loop keeps
    its cache, and its key; a new cache elsewhere is another key).

    Why the grad mark: a graph cannot carry autograd (a replay hands out detached views of
    its memory), so a call whose tensors require grad must never find the key of a call whose
    tensors do not (a graph recorded for ``x`` served ``w = x.requires_grad_()`` under grad
    mode and returned an output without ``grad_fn``: gradients silently lost). The tensor
    leaf's own signature does not hold ``requires_grad``; the pre-key guards compare it
    already (jitcore.guards), so both paths tell the two apart. Grad and inference mode are
    in every key already (its torch settings)."""
    key = exact_key(device, spec, leaves, paths)
    if addressed:
        key = (*key, (KeyMark.ADDRESSES, tuple((i, leaves[i].data_ptr()) for i in sorted(addressed))))
    for leaf in leaves:  # (a plain loop: every full key pays for it)
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            grads = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad)
            return (*key, (KeyMark.REQUIRES_GRAD, grads))
    return key


def exact_key(device: int, spec: object, leaves: Sequence, paths: Sequence[str]) -> tuple:
    """:func:`region_key` without its grad mark: what a call is, whatever its tensors require."""
    if len(spec) > 3:
        return _object_call_key(device, spec, leaves, paths)
    return (device, spec, torch_modes(), alias_pattern(leaves), *map(leaf_key, leaves, paths))


def grad_leaves(key: tuple) -> tuple[int, ...]:
    """The tensor leaves of ``key`` that require grad (see :func:`region_key`)."""
    last = key[-1] if len(key) > LEAVES_START else None
    return last[1] if last.__class__ is tuple and last and last[0] is KeyMark.REQUIRES_GRAD else ()


def addressed_leaves(key: tuple) -> tuple[int, ...]:
    """The object tensors ``key`` holds by their address (see :func:`region_key`)."""
    for element in key[-2:]:
        if element.__class__ is tuple and element and element[0] is KeyMark.ADDRESSES:
            return tuple(i for i, _ in element[1])
    return ()


#: The key element of a walked object itself (replay.objects): no identity.
CARRIER = ("carrier",)


def _object_call_key(device: int, spec: tuple, leaves: Sequence, paths: Sequence[str]) -> tuple:
    carriers = set(spec[3].carriers)
    elements = [CARRIER if i in carriers else leaf_key(leaf, path) for i, (leaf, path) in enumerate(zip(leaves, paths))]
    return (device, spec, torch_modes(), alias_pattern(leaves), *elements)


#: Key elements before the leaves' (device, spec, modes, aliasing).
LEAVES_START = 4


def outputs_requiring_grad(outputs: object) -> list[str]:
    """Where in a region's ``outputs`` tensors require grad (``output[0]``), as the recording
    refuses them (recording.own_outputs); outputs it cannot walk are left to the recording."""
    try:
        _spec, leaves, paths = flatten((outputs,), {}, walk_dataclasses=True)
    except (TypeError, ReplayError):  # (the recording refuses such outputs with its reason)
        return []
    return [
        path.replace("args[0]", "output", 1)
        for leaf, path in zip(leaves, paths)
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad
    ]


def tensor_ranges(leaves: Sequence) -> list[tuple[int, int, int]]:
    """(leaf index, first byte, one past the last byte) of every tensor leaf."""
    ranges = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            lo = leaf.data_ptr()
            ranges.append((i, lo, lo + extent_bytes(leaf)))
    return ranges


def alias_pattern(leaves: Sequence) -> tuple[tuple[int, ...], ...]:
    """How the tensor leaves' bytes overlap (the same tensor twice, overlapping views): the
    groups of leaves that share a byte, as :func:`overlap_groups` gives them. A graph recorded
    for one pattern must never serve another: a region that writes one argument and reads the
    other gives different results when they share memory.

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
    return overlap_groups(tensor_ranges(leaves))


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
    """The overlapping pairs among (leaf index, first byte, one past the last byte) ranges: the
    pairwise definition :func:`overlap_groups` holds the same information as, for the few
    ranges whose pairs a caller needs (n(n-1)/2 of them for one tensor passed n times)."""
    ranges = sorted(ranges, key=lambda r: r[1])
    pairs = []
    for n, (i, lo, hi) in enumerate(ranges):
        for j, other_lo, other_hi in ranges[n + 1 :]:
            if other_lo >= hi:
                break
            if other_lo < other_hi and lo < hi:
                pairs.append((min(i, j), max(i, j)))
    return tuple(sorted(pairs))


def overlap_groups(ranges: Iterable[tuple[int, int, int]]) -> tuple[tuple[int, ...], ...]:
    """The aliasing part of a key: the maximal groups, of two or more, of (leaf index, first
    byte, one past the last byte) ranges that all share a byte, each group its leaves in
    order, the groups in order. Two ranges overlap exactly where one group holds both, and a
    set of overlapping pairs has one set of maximal groups (its maximal cliques), so two calls
    share this pattern exactly where they share :func:`pattern_of`'s pairs.

    Why groups, not pairs: one tensor passed N times makes N(N-1)/2 pairs and one group. Ranges
    on a line that overlap pairwise share a point, so a sweep over the sorted ends finds every
    maximal group where a run of starts meets an end (at one address an end sorts first: ranges
    that touch share no byte): a sort, plus the groups' own size."""
    ends = []
    for i, lo, hi in ranges:
        if lo < hi:  # an empty range overlaps nothing
            ends += ((lo, 1, i), (hi, 0, i))
    ends.sort()
    open_now: dict[int, None] = {}
    groups = []
    grew = False
    for _address, starts, i in ends:
        if starts:
            open_now[i] = None
            grew = True
            continue
        if grew and len(open_now) > 1:
            groups.append(tuple(sorted(open_now)))
        grew = False
        del open_now[i]
    return tuple(sorted(groups))


def overlapping_pairs(pattern: Iterable[tuple[int, ...]]) -> set[tuple[int, int]]:
    """The pairs of leaves (lower index first) that an aliasing pattern (:func:`overlap_groups`)
    says overlap."""
    return {pair for group in pattern for pair in itertools.combinations(group, 2)}


def restricted_groups(pattern: Iterable[tuple[int, ...]], leaves: set[int]) -> tuple[tuple[int, ...], ...]:
    """An aliasing pattern (:func:`overlap_groups`) among some of its leaves only: what
    :func:`overlap_groups` gives for those leaves' ranges. Each maximal group of a subset lies in
    a maximal group of the whole, so the subset's groups are the largest of the restrictions."""
    cut = {tuple(i for i in group if i in leaves) for group in pattern}
    cut = {group for group in cut if len(group) > 1}
    return tuple(sorted(g for g in cut if not any(g != h and set(g) <= set(h) for h in cut)))


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
