"""Object arguments: a plain object a region receives (a Hugging Face cache, a user's state
class, an ``nn.Module``, a config) walked like a container, so that the key sees what the
region may read from it.

Why walk rather than refuse or compare by identity: a graph bakes what the region reads from
an object (its tensors' addresses, its Python values), so an object compared by identity would
let a changed attribute keep its key, and refusing it runs every call of a decode loop that
passes its cache eagerly. Walked, the object's class, its attribute names and its plain values
(ints, floats by their bits, bools, strings, enums, None, dtypes, devices, classes and
functions by identity, as constants are keyed) are keyed, and its tensors are leaves like
tensor arguments: a fresh object of the same structure (a new cache per generation) has the
same key, and no identity enters it.

What a call's spec holds for an object is a *carrier*: the object itself is a leaf, which
:func:`replay.region_keys.unflatten` returns as it is (the region, eager or under capture,
gets the caller's object, which it may write), followed by its *shadow leaves*: what the walk
found, each with its path (``args[2].layers[0].keys``). The key, the rebinding and the
analysis see the shadow leaves; nothing substitutes them at a capture (the region reads them
through the carrier), so a shadow tensor is keyed by its address or rebound, never staged.

Walked: an object's ``__dict__`` (in its order) and ``__slots__`` (an unset slot is a value of
its own); lists, tuples, dicts (keys keyed exactly), sets and their subclasses inside (the
class keyed, a subclass's own attributes walked too); nested objects; an ``nn.Module``'s
parameters, buffers and submodules by name (``args[0].layers[3].self_attn.q_proj.weight``)
and its other attributes, without its state-dict hooks (which a call never runs); a tensor's
own Python attributes (``t.scale``), as an object's. An object reached twice is keyed as a
reference to where it was first met, so sharing is part of the structure (and a cycle ends).
Bounds: :data:`MAX_DEPTH` levels of nesting and :data:`MAX_LEAVES` leaves for all the objects
of a call.

Refused (:class:`replay.errors.RefusedKey` naming the path): objects of C extension
types that keep state Python cannot read (a ``torch.Generator``, a lock, a ``functools.partial``),
objects whose class computes what they hold (no instance state, but properties, other
descriptors, ``__getattr__`` or ``__getattribute__``), a dynamic scalar or a padded marker
inside an object (pass it as an argument of its own), a walk beyond the bounds, and values a
constant may not be (a tensor as a dict key, an object compared by its own equality inside a
set).

Side effects: a graph cannot replay a Python assignment. :func:`snapshot` records the
structure and the plain values of a call's objects (and which tensor each attribute holds, at
which address), and :func:`first_change` names the first path where two snapshots differ
(``args[2].seen_tokens``): the session compares them around a recording's runs and refuses
the key of a region that changes one.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import types
import typing
from collections.abc import Sequence

import attrs
import torch

from replay import value_keys
from replay.dynamic import Dynamic
from replay.errors import RefusedKey
from replay.padding import Padded

#: Levels of nesting a walk follows (an object, a container inside it, ...).
MAX_DEPTH = 32
#: Shadow leaves (tensors and plain values) of all the objects of one call.
MAX_LEAVES = 4096

#: A shadow leaf's token in a layout: a tensor, or a plain value (keyed by the key's leaf keys).
TENSOR, VALUE = "t", "v"


@attrs.frozen
class ObjectLeaves:
    """Where a call's walked objects lie among its leaves: the carriers (the objects
    themselves, returned as they are by unflatten) and their shadow leaves (what the walks
    found). The fourth element of a spec that walked objects."""

    carriers: tuple[int, ...]
    shadows: tuple[int, ...]


def refused(reason: str, path: str) -> Exception:
    return RefusedKey(f"region argument {path} {reason}", path)


# --- which values are objects ------------------------------------------------------------------
#: Per class: whether its values are walked as objects, and how (plain dicts: a class lookup on
#: every object argument; emptied when they grow past this many classes, as classes made on the
#: fly would otherwise stay alive).
_CACHED_CLASSES = 4096
_OBJECT_CLASSES: dict[type, bool] = {}


def is_object(value: object) -> bool:
    """Whether flatten walks ``value`` as an object (else it is a constant or a container):
    whatever a key would otherwise refuse or compare by identity."""
    cls = value.__class__
    known = _OBJECT_CLASSES.get(cls)
    if known is None:
        if len(_OBJECT_CLASSES) >= _CACHED_CLASSES:
            _OBJECT_CLASSES.clear()
        known = _OBJECT_CLASSES[cls] = not _constant_class(cls)
    return known


def _constant_class(cls: type) -> bool:
    """Whether values of ``cls`` are constants of a key or containers flatten walks (a frozen
    dataclass is rebuilt), or markers (a padded tensor: an argument of its own), not objects to
    walk."""
    if cls in value_keys.BY_VALUE or issubclass(cls, (*value_keys.NOT_OBJECTS, *_MARKERS)):
        return True
    return value_keys.frozen_dataclass(cls)


# --- how a class is walked ---------------------------------------------------------------------
#: An nn.Module's attributes a call never reads (the state-dict hooks, the names of the
#: buffers left out of a state dict); its parameters, buffers and submodules are walked by name.
_MODULE_SKIPPED = frozenset(
    {
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_non_persistent_buffers_set",
    }
)
MODULE_SECTIONS = (("_parameters", "p"), ("_buffers", "b"), ("_modules", "m"))
#: Classes defined in C whose instances keep no state, or all of it in their __dict__.
_STATELESS_C_CLASSES = frozenset(
    {
        object,
        types.SimpleNamespace,
        *(getattr(typing, name) for name in ("Generic", "Protocol") if hasattr(typing, name)),
    }
)


@attrs.frozen
class ClassWalk:
    """How the instances of one class are walked: ``refusal`` (why they cannot be, or ""),
    the names of their slots, whether the class computes what its instances hold (descriptors,
    ``__getattr__``, ``__getattribute__``), whether it is an ``nn.Module``."""

    refusal: str
    slots: tuple[str, ...]
    computed: bool
    module: bool


def _slot_names(cls: type) -> tuple[str, ...]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(f"_{klass.__name__.lstrip('_')}{name}" if name.startswith("__") else name)
    return tuple(names)


#: What a class body may hold that computes nothing an instance shows: methods, and the
#: descriptors of slots and of ``__dict__``. Any other descriptor (a property, a custom
#: ``__get__``) computes what it shows, from wherever it reads.
_PLAIN_ATTRIBUTES = (
    types.FunctionType,
    classmethod,
    staticmethod,
    types.MemberDescriptorType,
    types.GetSetDescriptorType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.ClassMethodDescriptorType,
    types.BuiltinFunctionType,
)


def _computes_state(cls: type) -> bool:
    """Whether the class computes what its instances show: ``__getattr__``,
    ``__getattribute__``, a property or any other descriptor with ``__get__``."""
    for klass in cls.__mro__[:-1]:
        if "__getattr__" in klass.__dict__ or "__getattribute__" in klass.__dict__:
            return True
        for value in klass.__dict__.values():
            if not isinstance(value, _PLAIN_ATTRIBUTES) and hasattr(type(value), "__get__"):
                return True
    return False


def _python_class(cls: type) -> bool:
    """Made by a class statement: a heap type that is not immutable (C extension types are
    static, or heap types made immutable, as ``functools.partial`` and locks are)."""
    heap, immutable = 1 << 9, 1 << 8  # Py_TPFLAGS_HEAPTYPE, Py_TPFLAGS_IMMUTABLETYPE
    return bool(cls.__flags__ & heap) and not cls.__flags__ & immutable


def _class_walk(cls: type) -> ClassWalk:
    foreign = [klass for klass in cls.__mro__ if not _python_class(klass) and klass not in _STATELESS_C_CLASSES]
    refusal = ""
    if foreign:
        refusal = f"is a {_name(cls)}, an object of a C extension type ({_name(foreign[0])}) whose state cannot be read"
    return ClassWalk(refusal, _slot_names(cls), _computes_state(cls), issubclass(cls, torch.nn.Module))


_CLASS_WALKS: dict[type, ClassWalk] = {}


def class_walk(cls: type) -> ClassWalk:
    walk = _CLASS_WALKS.get(cls)
    if walk is None:
        if len(_CLASS_WALKS) >= _CACHED_CLASSES:
            _CLASS_WALKS.clear()
        walk = _CLASS_WALKS[cls] = _class_walk(cls)
    return walk


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


_UNSET = ("unset",)  # an unset slot's layout


#: Markers that are arguments of their own only: a dynamic scalar, a padded tensor.
_MARKERS = (Dynamic, Padded)


def _item_path(path: str, key: object) -> str:
    return f"{path}[{key!r}]"


def member_path(path: str, name: str) -> str:
    return f"{path}.{name}" if name.isidentifier() else f"{path}[{int(name) if name.isdigit() else repr(name)}]"


# --- the walk ----------------------------------------------------------------------------------
#: Classes of plain values taken as shadow leaves without a look inside (keyed by the key's leaf keys).
PLAIN = frozenset({int, float, bool, type(None), str, bytes, complex, torch.dtype, torch.device})


def state_of(value: object) -> dict | None:
    """The instance's ``__dict__`` as stored (no ``__getattribute__`` of the class runs), or None."""
    try:
        return object.__getattribute__(value, "__dict__")
    except AttributeError:
        return None


def stored_items(value: dict) -> tuple:
    """A dict's items as stored (no ``__getitem__`` or ``__iter__`` of a subclass runs), an
    ``OrderedDict``'s in its own order: ``move_to_end`` reorders it, not the dict beneath, and
    the region iterates it in its own order (a reordered one is another key)."""
    if isinstance(value, collections.OrderedDict):
        return tuple((k, dict.__getitem__(value, k)) for k in collections.OrderedDict.__iter__(value))
    return tuple(dict.items(value))


class ObjectWalk:
    """The walk of one call's objects: appends each object (a carrier) and then what it holds
    (its shadow leaves) to the call's leaves and paths, and returns the layout that the spec
    keeps for it: nested tuples naming classes, attribute names, exact dict keys and, for each
    shadow leaf, whether it is a tensor or a plain value (the leaves themselves are keyed as
    the key keys every leaf). Objects and mutable containers met before in the same call are
    references (``("ref", n)``, n their order of first meeting): sharing is keyed, cycles end."""

    __slots__ = ("leaves", "paths", "carriers", "shadows", "seen", "kept")

    def __init__(self, leaves: list, paths: list) -> None:
        self.leaves, self.paths = leaves, paths
        self.carriers: list[int] = []
        self.shadows: list[int] = []
        self.seen: dict[int, int] = {}
        self.kept: list = []  # what `seen` names, alive while the walk lasts

    def carrier(self, value: object, path: str) -> tuple:
        """The spec node of an object argument: the object as a leaf, then its shadow leaves."""
        index = len(self.leaves)
        self.leaves.append(value)
        self.paths.append(path)
        self.carriers.append(index)
        layout = self.value(value, path, 1)
        return ("object", layout, len(self.leaves) - index - 1)

    def object_leaves(self) -> ObjectLeaves:
        return ObjectLeaves(tuple(self.carriers), tuple(self.shadows))

    def _leaf(self, value: object, path: str, token: str) -> str:
        if len(self.shadows) >= MAX_LEAVES:
            raise refused(f"holds more than {MAX_LEAVES} values for a key (replay.objects.MAX_LEAVES)", path)
        self.shadows.append(len(self.leaves))
        self.leaves.append(value)
        self.paths.append(path)
        return token

    def _first_meeting(self, value: object) -> tuple | None:
        """A reference to ``value`` if the walk met it before, else None (and it is noted)."""
        number = self.seen.get(id(value))
        if number is not None:
            return ("ref", number)
        self.seen[id(value)] = len(self.kept)
        self.kept.append(value)
        return None

    def value(self, value: object, path: str, depth: int) -> object:
        """The layout of any value inside an object (its shadow leaves appended)."""
        cls = value.__class__
        if cls is torch.Tensor or isinstance(value, torch.Tensor):
            token = self._leaf(value, path, TENSOR)
            state = state_of(value)  # its own Python attributes (t.scale = 2.0), read as any object's
            return self._tensor_attributes(value, state, path, depth) if state else token
        if cls in PLAIN:
            return self._leaf(value, path, VALUE)
        if depth > MAX_DEPTH:
            raise refused(
                f"lies deeper than {MAX_DEPTH} levels of objects and containers (replay.objects.MAX_DEPTH)", path
            )
        if isinstance(value, _MARKERS):
            kind = "dynamic scalar" if isinstance(value, Dynamic) else "padded tensor"
            raise refused(f"is a {kind} inside an object: pass it as an argument of its own", path)
        if isinstance(value, (tuple, list)):
            return self._sequence(value, cls, path, depth)
        if isinstance(value, dict):
            return self._mapping(value, cls, path, depth)
        if isinstance(value, (set, frozenset)):
            return self._set(value, cls, path)
        if is_object(value) or (dataclasses.is_dataclass(cls) and not isinstance(value, type)):
            return self._object(value, cls, path, depth)
        return self._leaf(value, path, VALUE)  # a constant: an enum, a class, a function, a numpy scalar...

    def _tensor_attributes(self, value: torch.Tensor, state: dict, path: str, depth: int) -> tuple:
        """The layout of a tensor holding Python attributes: its token and its attributes, walked
        as an object's (a region reading ``cache.keys.scale`` bakes it as it bakes ``cache.scale``)."""
        if depth > MAX_DEPTH:
            raise refused(
                f"lies deeper than {MAX_DEPTH} levels of objects and containers (replay.objects.MAX_DEPTH)", path
            )
        reference = self._first_meeting(state)  # a tensor met twice, or its attributes reaching it: a reference
        return ("tensor", reference or self._members(state, path, depth))

    def _sequence(self, value: tuple | list, cls: type, path: str, depth: int) -> tuple:
        if not isinstance(value, tuple):
            reference = self._first_meeting(value)
            if reference is not None:
                return reference
        children = tuple(self.value(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
        return ("seq", cls, children, self._own_attributes(value, cls, path, depth))

    def _mapping(self, value: dict, cls: type, path: str, depth: int) -> tuple:
        constant_key = value_keys.constant_key
        reference = self._first_meeting(value)
        if reference is not None:
            return reference
        items = stored_items(value)
        exact = tuple(constant_key(k, f"{path} key {k!r}") for k, _ in items)
        children = tuple(self.value(item, f"{path}[{k!r}]", depth + 1) for k, item in items)
        factory = getattr(value, "default_factory", None) if isinstance(value, collections.defaultdict) else None
        factory_key = constant_key(factory, f"{path}.default_factory") if factory is not None else None
        return ("map", cls, exact, children, factory_key, self._own_attributes(value, cls, path, depth))

    def _set(self, value: set | frozenset, cls: type, path: str) -> tuple:
        constant_key = value_keys.constant_key
        if not isinstance(value, frozenset):
            reference = self._first_meeting(value)
            if reference is not None:
                return reference
        return ("set", cls, tuple(constant_key(item, f"{path} item {item!r}") for item in value))

    def _own_attributes(self, value: object, cls: type, path: str, depth: int) -> tuple | None:
        """A container subclass's own attributes (a plain container has none): walked too."""
        if cls in (tuple, list, dict, collections.OrderedDict, collections.defaultdict):
            return None
        state = state_of(value)
        return self._members(state, path, depth) if state else None

    def _members(self, state: dict, path: str, depth: int) -> tuple:
        names, children = [], []
        for name, item in tuple(state.items()):
            if not isinstance(name, str):
                raise refused(f"holds an attribute named by a {type(name).__name__}, not a string", path)
            names.append(name)
            children.append(self.value(item, member_path(path, name), depth + 1))
        return (tuple(names), tuple(children))

    def _object(self, value: object, cls: type, path: str, depth: int) -> tuple:
        reference = self._first_meeting(value)
        if reference is not None:
            return reference
        walk = class_walk(cls)
        if walk.refusal:
            raise refused(walk.refusal, path)
        state = state_of(value)
        if walk.module and state is not None:
            return ("module", cls, self._module_members(state, path, depth))
        names, children = self._members(state, path, depth) if state else ((), ())
        slots = []
        for name in walk.slots:
            try:
                item = object.__getattribute__(value, name)
            except AttributeError:
                slots.append(_UNSET)
            else:
                slots.append(self.value(item, member_path(path, name), depth + 1))
        if not names and not any(slot is not _UNSET for slot in slots) and walk.computed:
            raise refused(
                f"is a {_name(cls)} that holds no state of its own (its class computes what it shows, through "
                "properties, other descriptors, __getattr__ or __getattribute__), so a key cannot see what the "
                "region reads from it",
                path,
            )
        return ("object", cls, names, children, walk.slots, tuple(slots))

    def _module_members(self, state: dict, path: str, depth: int) -> tuple:
        """An nn.Module's parameters, buffers and submodules by name, then its other attributes."""
        sections = []
        for attribute, section in MODULE_SECTIONS:
            members = state.get(attribute)
            if isinstance(members, dict):
                names = tuple(members)
                children = tuple(self.value(members[n], member_path(path, n), depth + 1) for n in names)
                sections.append((section, names, children))
        skipped = _MODULE_SKIPPED.union(attribute for attribute, _ in MODULE_SECTIONS)
        rest = {name: item for name, item in state.items() if name not in skipped}
        return (tuple(sections), self._members(rest, path, depth))


# --- side effects: what a run changed in the objects -------------------------------------------
@attrs.frozen
class Snapshot:
    """The structure and plain values of a call's objects at one moment (:func:`snapshot`):
    per carrier, its path, the layout of its walk (or, where it could not be walked, the
    path that stopped it) and a token per shadow leaf: a plain value's exact key, a tensor's
    identity, address, dtype, shape and strides (an in-place write changes none of these; an
    attribute given another tensor, or a tensor given other memory, does)."""

    carriers: tuple[tuple[str, object, tuple, tuple], ...]  # (path, layout or ("unwalkable", path), tokens, paths)


def _token(leaf: object, path: str) -> object:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", id(leaf), leaf.data_ptr(), leaf.dtype, tuple(leaf.shape), leaf.stride())
    try:
        return value_keys.constant_key(leaf, path)
    except (RefusedKey, TypeError):
        return ("identity", id(leaf))


def snapshot(spec: object, leaves: Sequence, paths: Sequence[str]) -> Snapshot | None:
    """The objects of a call (``flatten(..., walk_objects=True)``'s spec, leaves and paths)
    as they are now, walked again; None for a call without objects."""
    objects = spec[3] if len(spec) > 3 else None
    if objects is None:
        return None
    carriers = []
    for index in objects.carriers:
        walk = ObjectWalk([], [])
        try:
            layout = walk.carrier(leaves[index], paths[index])[1]
        except (RefusedKey, TypeError) as error:
            carriers.append((paths[index], ("unwalkable", getattr(error, "path", None) or paths[index]), (), ()))
            continue
        tokens = tuple(_token(walk.leaves[i], walk.paths[i]) for i in walk.shadows)
        carriers.append((paths[index], layout, tokens, tuple(walk.paths[i] for i in walk.shadows)))
    return Snapshot(tuple(carriers))


def first_change(before: Snapshot | None, after: Snapshot | None) -> str | None:
    """The path of the first thing that differs between two snapshots of the same call's
    objects (an attribute set, added or removed, a list grown, a tensor attribute replaced or
    moved), or None where nothing did. What a graph cannot replay: the session refuses the key
    of a region whose recorded run changed one (a first call's lazy initialisation is a call
    of another key: the objects it leaves have another structure)."""
    if before is None or after is None:
        return None if before is after else "the call's objects"
    for (path, layout, tokens, leaf_paths), (_, other, other_tokens, _) in zip(before.carriers, after.carriers):
        if layout != other:
            if layout[0] == "unwalkable" or other[0] == "unwalkable":
                return (other if other[0] == "unwalkable" else layout)[1]
            return _difference(layout, other, path) or path
        for token, other_token, leaf_path in zip(tokens, other_tokens, leaf_paths):
            if token != other_token:
                return leaf_path
    return None


def _difference(a: object, b: object, path: str) -> str | None:
    """Where two layouts of the same carrier first differ (None where they are equal)."""
    if a == b:
        return None
    if isinstance(a, tuple) and isinstance(b, tuple) and a[0] == b[0] == "tensor":  # a tensor's attributes
        if "ref" in (a[1][0], b[1][0]):
            return path
        return _members_difference(a[1], b[1], path) or path
    if not (isinstance(a, tuple) and isinstance(b, tuple)) or a[0] != b[0] or a[1] != b[1] or a[0] in ("ref", "set"):
        return path
    if a[0] == "seq":
        if len(a[2]) != len(b[2]):
            return path
        return _first_of(_difference(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a[2], b[2]))) or (
            _members_difference(a[3], b[3], path)
        )
    if a[0] == "map":
        if a[2] != b[2]:
            keys = [k for k, other in zip(a[2], b[2]) if k != other]
            longer = max(a[2], b[2], key=len)
            return f"{path}[{_shown(keys[0] if keys else longer[min(len(a[2]), len(b[2]))])}]"
        found = _first_of(_difference(x, y, f"{path}[{_shown(k)}]") for k, x, y in zip(a[2], a[3], b[3]))
        return found or _members_difference(a[5], b[5], path) or path
    if a[0] == "module":
        for (_, names, children), (_, other_names, other_children) in zip(a[2][0], b[2][0]):
            found = _members_difference((names, children), (other_names, other_children), path)
            if found:
                return found
        return _members_difference(a[2][1], b[2][1], path) or path
    found = _members_difference((a[2], a[3]), (b[2], b[3]), path)  # an object
    return found or _members_difference((a[4], a[5]), (b[4], b[5]), path) or path


def _members_difference(a: tuple | None, b: tuple | None, path: str) -> str | None:
    """Where two (names, children) pairs first differ: a name set, removed, or its value."""
    if a == b:
        return None
    if a is None or b is None:
        return path
    (names, children), (other_names, other_children) = a, b
    for position, name in enumerate(names):
        if position >= len(other_names) or other_names[position] != name:
            return member_path(path, name)
        found = _difference(children[position], other_children[position], member_path(path, name))
        if found:
            return found
    return member_path(path, other_names[len(names)]) if len(other_names) > len(names) else None


def structure_changed(before: Snapshot, after: Snapshot) -> int | None:
    """Which of a call's objects (its number among them) first differs in its structure
    between two snapshots (an attribute added or removed, a container grown, a class changed:
    a first call's lazy initialisation), not only in its plain values or which tensors it
    holds; None where none does."""
    return next((n for n, (b, a) in enumerate(zip(before.carriers, after.carriers)) if b[1] != a[1]), None)


def _first_of(found) -> str | None:
    return next((f for f in found if f), None)


def _shown(exact_key: object) -> str:
    """A dict key for a path, from its exact key (``(str, 'kv')`` shows as ``'kv'``)."""
    if isinstance(exact_key, tuple) and len(exact_key) == 2 and exact_key[0] in (str, int, bool, type(None)):
        return repr(exact_key[1])
    return repr(exact_key)


# --- what a recording and a graph are given in their place -------------------------------------
class _Baked:
    """The leaf a recording or a graph is given in place of a value it never takes as an
    argument: an object's tensor keyed by its address (the graph reads it where it lies), or
    the object itself in a graph's leaves (a graph keeps no caller's object alive)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "replay.objects.BAKED"

    def __copy__(self) -> _Baked:  # one marker: copies are itself
        return self

    def __deepcopy__(self, memo: dict) -> _Baked:
        return self


BAKED = _Baked()


def shadow_tensors(spec: object, leaves: Sequence) -> frozenset[int]:
    """The leaves of a call's objects that are tensors (none for a call without objects)."""
    if len(spec) <= 3:
        return frozenset()
    return frozenset(i for i in spec[3].shadows if isinstance(leaves[i], torch.Tensor))


def recording_leaves(leaves: Sequence, addressed: Sequence[int]) -> Sequence:
    """The leaves a recording takes: ``addressed`` (object tensors keyed by their address)
    replaced by :data:`BAKED`, so that no input is made of them (no staging, no rebinding:
    the region reads them through the object, where they lie)."""
    if not addressed:
        return leaves
    baked = list(leaves)
    for i in addressed:
        baked[i] = BAKED
    return baked


def graph_leaves(spec: object, leaves: Sequence, addressed: Sequence[int]) -> Sequence:
    """:func:`recording_leaves` with each carrier :data:`BAKED` too: what a graph is built
    from (its templates would keep the caller's object, and all it holds, alive)."""
    if len(spec) <= 3:
        return leaves
    baked = list(recording_leaves(leaves, addressed))
    for i in spec[3].carriers:
        baked[i] = BAKED
    return baked


def copyable(spec: object, leaves: Sequence) -> bool:
    """Whether a call's objects can be copied for a verification (:func:`with_copied_objects`):
    a deep copy of each, its tensors kept as they are (only the structure is tried)."""
    if len(spec) <= 3:
        return True
    return with_copied_objects(spec, leaves, leaves) is not None


def with_copied_objects(spec: object, leaves: Sequence, copies: Sequence) -> list | None:
    """``copies`` (of ``leaves``, tensors cloned as graph.clone_preserving_sharing clones
    them) with each object a deep copy of the caller's whose tensors are those copies: what a
    verification runs the region on eagerly, so that its writes reach the copies and never
    the caller's objects (which the replay wrote already). None where an object cannot be
    copied (the replay is then not verified)."""
    if len(spec) <= 3:
        return list(copies)
    memo: dict[int, object] = {id(leaves[i]): copies[i] for i in spec[3].shadows if isinstance(leaves[i], torch.Tensor)}
    result = list(copies)
    try:
        for i in spec[3].carriers:
            result[i] = copy.deepcopy(leaves[i], memo)
    except Exception:  # an object deepcopy cannot copy (whatever its class raises)
        return None
    return result
