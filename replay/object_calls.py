"""The repeated object call: a call passing the same objects as the last replayed call of its
key, served by that key's entry without walking the objects or computing the key again.

Why: the full path walks every object argument (replay.objects), counts the call and computes
its full key on every call, which for a decode loop passing its cache costs many times the
replay itself. Such a loop passes the SAME cache every step, its tensors where they were; only
the small arguments change. What the full key reads of the objects is the walk's: classes,
``__dict__``s, slots, containers, plain values and each tensor's signature, address and
``requires_grad``. A :class:`Memo`, made where the full path replays an object call, holds a
watch (:class:`replay.watch.WatchProgram`, checked in C where built) over exactly the holders
that walk read, recorded by walking them again with :class:`HolderWalk` (the same walk, noting
what it reads), and is used only while the watch says nothing changed: every holder holds the
same objects (scalars too: an equal value set again is a change here), every tensor the same
state. The rest of the key (the other arguments' signatures, their aliasing with the objects'
tensors, the device, the torch settings, the addresses the structure's hints key by, the
grad marks) is computed for each call and compared with the memo's key, element by element.
So a memo serves a call only where the full path would compute the same key and find the same
entry REPLAYING, and it serves it as the full path would: the globals checked, the entry's
recency kept, :meth:`replay.region.Region.replay`.

What a memo keeps alive: the objects' ``__dict__``s, containers and tensors, never the objects
passed (held weakly: a memo goes with its object, so a finished generation's cache is freed).
No memo is made where that cannot hold (an object that reaches itself or another argument,
an argument object with slots or without weak references) or where the watch cannot be exact
(a mutable set, a tensor whose state Python cannot read, a key holding grad marks).
"""

from __future__ import annotations

import collections
import enum
import operator
import weakref
from types import ModuleType
from typing import Any

import attrs
import torch

from jitcore import GlobalDriftError
from jitcore.for_replay import torch_native_module
from replay import objects, region_keys, value_keys, watch
from replay.dynamic import Dynamic
from replay.errors import ReplayError
from replay.lifecycle import REPLAYING, Entry
from replay.region_keys import FlatCall
from replay.torch_state import torch_modes

#: Memos a region keeps (the most recent first): a loop over a few caches at once keeps each.
MAX_MEMOS = 4

#: Plain arguments whose key element fixes what admission counts them under (a float by its
#: value: a NaN is counted apart from every other NaN, so it needs the full path).
_COUNTED_BY_KEY = frozenset({int, bool, str, bytes, type(None), torch.dtype, torch.device})
_PLAIN_CONTAINERS = (tuple, list, dict, collections.OrderedDict, collections.defaultdict)


class Strict(watch.WatchProgram):
    """A watch whose holders must hold the very objects they held: a scalar set again to an
    equal value is a change (the key would be the same, but what admission counts it under may
    not: NaN), so the call takes the full path once and the memo is made anew."""

    def same(self, kind: str, index: int) -> bool:
        if kind == "t":
            return super().same(kind, index)
        if kind == "o":
            return self.other_holders[index].same()
        return False  # (the check asks only where some held object is not the one recorded)


@attrs.frozen(eq=False)
class Identical(watch.Other):
    """A slot (or a defaultdict's factory) that must hold the very object it held."""

    def same(self) -> bool:
        return self.now() is self.recorded


@attrs.frozen(eq=False)
class InOrder(watch.Other):
    """An ``OrderedDict``'s own order, the very keys in it (``move_to_end`` changes it, not the
    dict beneath, which the watch of its items compares): the walk keys that order."""

    def now(self) -> tuple:
        return tuple(collections.OrderedDict.__iter__(self.holder))

    def same(self) -> bool:
        now = self.now()
        return len(now) == len(self.recorded) and all(map(operator.is_, now, self.recorded))


class HolderWalk(objects.ObjectWalk):
    """The objects' walk (replay.objects.ObjectWalk, unchanged), noting each holder it reads:
    what :class:`Strict` must watch for the walk to find the same again. ``unwatchable`` says
    why no memo may be made (empty: one may)."""

    __slots__ = ("fields", "helper", "tops", "top", "carrier_state", "unwatchable")

    def __init__(self, helper: ModuleType | None) -> None:
        super().__init__([], [])
        self.fields: dict[str, list] = {f.name: [] for f in attrs.fields(Strict) if f.name not in ("reader",)}
        self.helper = helper
        self.tops: set[int] = set()  # the objects passed as arguments
        self.top: object = None  # the argument whose own meeting comes next
        self.carrier_state: list[tuple[type, dict]] = []  # each argument object's class and __dict__
        self.unwatchable = ""

    def carrier(self, value: object, path: str) -> tuple:
        if id(value) in self.seen and id(value) not in self.tops:
            self.unwatchable = f"{path} is reached through another argument"
        self.tops.add(id(value))
        self.top = value
        try:
            return super().carrier(value, path)
        finally:
            self.top = None

    def _first_meeting(self, value: object) -> tuple | None:
        if value is self.top:
            self.top = None
        elif id(value) in self.tops:
            self.unwatchable = "an argument object is reached through an object (it would be kept alive)"
        return super()._first_meeting(value)

    def _leaf(self, value: object, path: str, token: str) -> str:
        if token == objects.TENSOR:
            self._tensor(value, path)
        elif isinstance(value, (int, float, complex, str, bytes)) and not isinstance(value, enum.Enum):
            if value.__class__ not in objects.PLAIN and objects.state_of(value) is not None:
                self.unwatchable = f"{path} is a {type(value).__name__} with attributes"
        return super()._leaf(value, path, token)

    def _tensor(self, tensor: torch.Tensor, path: str) -> None:
        state = watch.python_tensor_state(tensor)
        if state is None:
            self.unwatchable = f"{path} is a tensor whose state cannot be read"
        helper = self.helper
        self._add(
            tensors=tensor, states=state, tensor_paths=path, words=helper.tensor_state(tensor) if helper else None
        )
        attributes = objects.state_of(tensor)  # its own Python attributes, keyed by the walk (even none yet)
        if attributes is not None:
            self._holder_object(tensor, tensor.__class__, attributes, path)

    def _add(self, **values: object) -> None:
        for name, value in values.items():
            self.fields[name].append(value)

    def _dict(self, value: dict, path: str, role: str) -> None:
        items = tuple(dict.items(value))
        self._add(
            dicts=value,
            dict_keys=tuple(k for k, _ in items),
            dict_values=tuple(v for _, v in items),
            dict_paths=(path, role),
        )

    def _holder_object(self, value: object, cls: type, state: object, path: str) -> None:
        """An object whose class and ``__dict__`` the walk reads (an argument's, weakly)."""
        if state is not None and type(state) is not dict:
            self.unwatchable = f"{path} has a __dict__ that is not a dict"
        state = state if type(state) is dict else None
        if value is self.top:
            self.carrier_state.append((cls, state))
        else:
            self._add(objects=value, types=cls, object_dicts=state, object_paths=path)
        if state is not None:
            self._dict(state, path, watch.ATTRIBUTES)

    def _sequence(self, value: tuple | list, cls: type, path: str, depth: int) -> tuple:
        if isinstance(value, list) and id(value) not in self.seen:
            self._add(lists=value, list_items=tuple(list.copy(value)), list_paths=path)
        return super()._sequence(value, cls, path, depth)

    def _mapping(self, value: dict, cls: type, path: str, depth: int) -> tuple:
        if id(value) not in self.seen:
            self._dict(value, path, watch.ITEMS)
            if isinstance(value, collections.OrderedDict) and dict.__len__(value) > 1:  # (fewer: no order to change)
                order = tuple(collections.OrderedDict.__iter__(value))
                self._add(other_holders=InOrder(value, None, order, f"{path} (its order)"))
            if isinstance(value, collections.defaultdict):
                factory = watch.slot_value(value, "default_factory")
                self._add(other_holders=Identical(value, "default_factory", factory, f"{path}.default_factory"))
        return super()._mapping(value, cls, path, depth)

    def _set(self, value: set | frozenset, cls: type, path: str) -> tuple:
        if cls is not frozenset:
            self.unwatchable = f"{path} is a {cls.__name__} (a set's items are not watched)"
        return super()._set(value, cls, path)

    def _own_attributes(self, value: object, cls: type, path: str, depth: int) -> tuple | None:
        if cls not in _PLAIN_CONTAINERS:  # its class (assignable) and its own attributes
            self._holder_object(value, cls, objects.state_of(value), path)
        return super()._own_attributes(value, cls, path, depth)

    def _object(self, value: object, cls: type, path: str, depth: int) -> tuple:
        if id(value) not in self.seen or value is self.top:
            walk = objects.class_walk(cls)
            state = objects.state_of(value)
            self._holder_object(value, cls, state, path)
            if walk.slots and value is self.top:
                self.unwatchable = f"{path} has slots (an argument object is held weakly)"
            for name in walk.slots:
                recorded = watch.slot_value(value, name)
                self._add(other_holders=Identical(value, name, recorded, objects.member_path(path, name)))
            if walk.module and type(state) is dict:
                for registry, _ in objects.MODULE_SECTIONS:
                    members = state.get(registry)
                    if type(members) is dict:
                        self._dict(members, path, watch.REGISTRY)
                    elif members is not None:
                        self.unwatchable = f"{path}.{registry} is not a dict"
        return super()._object(value, cls, path, depth)

    def program(self) -> Strict:
        reader = getattr(self.helper, "replay_support", None) if self.helper is not None else None
        return Strict(**{name: tuple(values) for name, values in self.fields.items()}, reader=reader)


# --- the memo ------------------------------------------------------------------------------------
@attrs.define(eq=False)
class Memo:
    """What serves a repeated object call (see the module's docstring): the full call it was
    made from (its spec, paths, argument starts, key, counted shapes and entry), where its
    argument objects and other leaves lie among the leaves of the call without the walk
    (``region_keys.flatten``), and the watch of what the walk read."""

    entry: Entry
    key: tuple
    spec: object
    paths: list
    starts: list | None
    template: list  # the objects' leaves (the argument objects, held weakly in `objects`, and the rest: None)
    plain_spec: object  # the spec of the call flattened without walking its objects
    objects: tuple  # weak references to the argument objects, one per argument object
    object_at: tuple[int, ...]  # where each lies among the unwalked call's leaves...
    object_full: tuple[int, ...]  # ... and in the full call
    object_state: tuple  # each one's class and __dict__
    plain_at: tuple[int, ...]  # the other leaves of the unwalked call...
    full_at: tuple[int, ...]  # ... where each lies in the full call
    classes: tuple  # ... and its class
    values: tuple  # ... and, where its key does not fix what admission counts it under, the value itself
    check: object  # () -> True where something watched changed
    object_tensors: tuple  # (requires_grad is part of the key)
    object_ranges: tuple  # (leaf index, first byte, end) of each of the objects' tensors
    merged: region_keys.MergedRanges
    object_groups: tuple  # their aliasing among themselves
    hints: Any | None  # what the structure's hints were (their addressed tensors shape the key)
    addressed: frozenset


def remember(region, call: FlatCall, key: tuple, counted: tuple, entry) -> Memo | None:
    """The memo of a call the full path is about to replay from ``entry`` (keyed ``key``,
    counted ``counted``), or None where no memo may serve its repeats exactly."""
    if len(call.spec) <= 3 or region_keys.grad_leaves(key) or counted != entry.counted:
        return None
    spec, leaves = call.spec, call.leaves
    helper = torch_native_module()
    if helper is not None and not (hasattr(helper, "replay_support") and hasattr(helper, "tensor_state")):
        helper = None
    walk = HolderWalk(helper)
    walked = sorted((*spec[3].carriers, *spec[3].shadows))
    try:
        layouts = [walk.carrier(leaves[i], call.paths[i])[1] for i in spec[3].carriers]
    except (ReplayError, TypeError):
        return None
    found: list = []
    for node in (*spec[0], *spec[2]):
        _object_layouts(node, found)
    same_walk = len(walk.leaves) == len(walked) and all(map(operator.is_, walk.leaves, (leaves[i] for i in walked)))
    if walk.unwatchable or layouts != found or not same_walk:
        return None
    return _memo(region, call, key, entry, walk, set(walked))


def _object_layouts(node: object, found: list) -> None:
    """The layouts of a spec's walked objects, in order (replay.region_keys' spec nodes)."""
    if node is None:
        return
    head = node[0]
    if head == "object":
        found.append(node[1])
        return
    children = node[3] if head == "dataclass" else node[2] if head == "dict" else node[1]
    for child in children:
        _object_layouts(child, found)


def _memo(region, call: FlatCall, key: tuple, entry, walk: HolderWalk, walked: set) -> Memo | None:
    """The memo, once the walk found what the key's walk found (see :func:`remember`)."""
    leaves = call.leaves
    args, kwargs = region_keys.unflatten(call.spec, leaves)
    plain_spec, plain, _ = region_keys.flatten(args, kwargs)
    full_at = [i for i in range(len(leaves)) if i not in walked or i in call.spec[3].carriers]
    if len(full_at) != len(plain) or not all(map(operator.is_, plain, (leaves[i] for i in full_at))):
        return None
    carriers = set(call.spec[3].carriers)
    object_at = tuple(j for j, i in enumerate(full_at) if i in carriers)
    plain_at = tuple(j for j, i in enumerate(full_at) if i not in carriers)
    ranges = tuple(
        (i, *region_keys.byte_range(leaves[i])) for i in sorted(walked) if isinstance(leaves[i], torch.Tensor)
    )
    hints = region.hints.get(call.spec)
    template = [leaf if i in walked and i not in carriers else None for i, leaf in enumerate(leaves)]
    program = walk.program()
    memo = Memo(
        entry=entry,
        key=key,
        spec=call.spec,
        paths=call.paths,
        starts=call.starts,
        template=template,
        plain_spec=plain_spec,
        objects=(),
        object_at=object_at,
        object_full=tuple(full_at[j] for j in object_at),
        object_state=tuple(walk.carrier_state),
        plain_at=plain_at,
        full_at=tuple(full_at[j] for j in plain_at),
        classes=tuple(plain[j].__class__ for j in plain_at),
        values=tuple(None if _counted_by_key(plain[j]) else plain[j] for j in plain_at),
        check=watch.watch_check(program),
        object_tensors=tuple(program.tensors),
        object_ranges=ranges,
        merged=region_keys.MergedRanges((lo, hi) for _, lo, hi in ranges),
        object_groups=region_keys.overlap_groups(ranges),
        hints=hints,
        addressed=frozenset(hints.addressed) if hints is not None else frozenset(),
    )
    try:
        memo.objects = tuple(weakref.ref(leaves[i], _forgetting(region, memo)) for i in memo.object_full)
    except TypeError:  # an object without weak references
        return None
    return memo


def _forgetting(region, memo: Memo):
    """A weak reference's callback: the memo goes with its object (and what it holds with it)."""
    region_ref = weakref.ref(region)

    def gone(_reference: weakref.ref) -> None:
        held = region_ref()
        if held is not None:
            forget(held, memo)

    return gone


def keep(region, memo: Memo) -> None:
    """The memo first among the region's (one of the same entry and objects before it goes),
    at most MAX_MEMOS of them."""
    mine = [ref() for ref in memo.objects]
    others = [
        m
        for m in region.object_memos
        if not (m.entry is memo.entry and all(map(operator.is_, (ref() for ref in m.objects), mine)))
    ]
    region.object_memos = (memo, *others[: MAX_MEMOS - 1])


def forget(region, memo: Memo) -> None:
    """The memo goes (a copy of the tuple: a call iterating the old one is unaffected)."""
    region.object_memos = tuple(m for m in region.object_memos if m is not memo)


def _counted_by_key(leaf: object) -> bool:
    """Whether a leaf's key element fixes what admission counts it under (a float does unless
    it is a NaN, counted apart from every other NaN)."""
    cls = leaf.__class__
    if cls in _COUNTED_BY_KEY or isinstance(leaf, (torch.Tensor, Dynamic)):
        return True
    return cls is float and leaf == leaf


# --- the repeated call ---------------------------------------------------------------------------
def serve(region, args: tuple, kwargs: dict, miss: object) -> object:
    """A call that a memo of ``region`` serves, replayed; else ``miss`` (the full path)."""
    try:
        plain_spec, plain, _ = region_keys.flatten(args, kwargs)
    except (ReplayError, TypeError):
        return miss
    for memo in region.object_memos:
        if memo.plain_spec == plain_spec and _same_objects(memo, plain):
            call = _repeat(region, memo, plain)
            if call is not None:
                return region.replay(memo.entry, call)
    return miss


def _same_objects(memo: Memo, plain: list) -> bool:
    """Whether the call passes the memo's objects, each with its class and __dict__."""
    state_of = objects.state_of
    for j, ref, (cls, state) in zip(memo.object_at, memo.objects, memo.object_state):
        value = plain[j]
        if value is not ref() or value.__class__ is not cls or state_of(value) is not state:
            return False
    return True


def _repeat(region, memo: Memo, plain: list) -> FlatCall | None:
    """The full call of a call passing the memo's objects, where its key is the memo's and its
    entry replays (None: the full path decides). A change the watch saw drops the memo."""
    session, entry = region.session, memo.entry
    if entry.state is not REPLAYING or memo.check():
        forget(region, memo)
        return None
    if not session.can_record() or session.current_device() != memo.key[0] or _any_requires_grad(memo.object_tensors):
        return None
    leaves = _leaves(memo, plain)
    if leaves is None or _aliasing(memo, leaves) != memo.key[3]:
        return None
    hints = region.hints.get(memo.spec)
    if hints is not memo.hints or (hints is not None and hints.addressed != memo.addressed):
        return None
    try:
        if torch_modes() != memo.key[2]:
            return None
    except (ReplayError, RuntimeError):  # (a setting the key refuses: the full path says why)
        return None
    if region.snapshot is not None:
        try:
            region.snapshot.check()
        except GlobalDriftError:
            region.forget_globals()  # (the full path then keys the call anew, as after its own check)
            return None
    session.keys.called(entry)
    return FlatCall(memo.spec, leaves, memo.paths, memo.starts)


def _any_requires_grad(tensors: tuple) -> bool:
    """Whether one of the objects' tensors requires grad now (the key's grad mark would say so)."""
    for tensor in tensors:
        if tensor.requires_grad:
            return True
    return False


def _leaves(memo: Memo, plain: list) -> list | None:
    """The full call's leaves: the memo's objects' with this call's other leaves, each keyed as
    the memo's key keys it (None where one is not, or is counted otherwise)."""
    leaves, key, paths = list(memo.template), memo.key, memo.paths
    for j, i in zip(memo.object_at, memo.object_full):
        leaves[i] = plain[j]
    leaf_key = value_keys.leaf_key
    for j, i, cls, value in zip(memo.plain_at, memo.full_at, memo.classes, memo.values):
        leaf = plain[j]
        if leaf.__class__ is not cls or (value is not None and leaf is not value):
            return None
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            return None
        try:
            if leaf_key(leaf, paths[i]) != key[region_keys.LEAVES_START + i]:
                return None
        except (ReplayError, TypeError):
            return None
        if value is None and not _counted_by_key(leaf):
            return None
        leaves[i] = leaf
    return leaves


def _aliasing(memo: Memo, leaves: list) -> tuple:
    """The aliasing part of the full call's key (region_keys.alias_pattern: the maximal groups
    of overlapping tensors): the objects' own groups where the other tensors overlap nothing."""
    ranges = [(i, *region_keys.byte_range(leaves[i])) for i in memo.full_at if isinstance(leaves[i], torch.Tensor)]
    merged = memo.merged
    if not any(merged.overlaps(lo, hi) for _, lo, hi in ranges) and not region_keys.overlap_groups(ranges):
        return memo.object_groups
    return region_keys.overlap_groups([*memo.object_ranges, *ranges])
