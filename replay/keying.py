"""The session's part of a key: what admission counts a call under (without keeping its
arguments alive), a region's keys of its calls, and a key in a few words.

region_keys makes the exact key of a call; this module adds what the session needs around
it: the cheaper count a call is admitted by before any key is made, both with the addresses a
region's argument structure keys by (:class:`CallKeys`), and the key's wording for logs and
reports.
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from replay import region_keys
from replay.dynamic import Dynamic
from replay.region_keys import KeyMark

#: What a ``replay.dynamic`` argument is in a pre-key and in admission's count: one mark for
#: every value (the value is rebound at each replay, never part of the key).
DYNAMIC_MARK = ("replay.dynamic",)

#: Argument types a flat call's pre-key holds as they are: constants that are leaves of the key
#: as they are (hashable, compared by value).
PLAIN_CONSTANTS = region_keys.PLAIN_CONSTANTS


# --- what admission counts a call under ---------------------------------------------------------
#: Leaves admission counts as they are: values that hold no other object (an enum member lives
#: as long as its class anyway).
_VALUE_LEAVES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum, np.generic)
#: How deep :func:`counted_shapes` looks into constants (dataclasses, tuples of their fields).
_COUNT_DEPTH = 8


def counted_shapes(device_of, spec: object, leaves: Sequence, paths: list, addressed: Sequence[int] = ()) -> tuple:
    """What admission counts a call under, with its region: the call's structure with each
    tensor's shape and each constant (cheap). Calls of one full key always share it (the full
    key holds all of it), so its count bounds the key's from above: a call it leaves warming
    or refuses needs no full key at all. Keys that share shapes but differ otherwise (dtypes,
    strides, aliasing, torch modes) share a count, which can only make them record sooner.
    Unhashable constants, and tensors without a shape (a strided nested tensor), take the full
    key (``device_of()`` gives its device), which refuses those loudly.

    Constants other than plain values are counted without keeping what they hold alive
    (:func:`_count_element`): admission's counts outlive the call by up to two windows of
    calls, and a ``Batch`` object of tensors new every step kept every batch of the window
    alive. (The hash of the constant itself is taken first, so an unhashable one is still
    refused.)

    A walked object (a carrier, :mod:`replay.objects`) counts as
    :data:`~replay.region_keys.CARRIER`, as its key does: a new cache per generation counts
    with the one before (its structure is the spec's, what it holds its shadow leaves').
    ``addressed``: the object tensors its key holds by their address (region_keys.region_key),
    counted by it too, so that an object given new tensors every call (read by torch ops: a
    key each) warms each of them, rather than counting them all as one key that records at
    every call."""
    try:
        counted = tuple(
            leaf.shape
            if isinstance(leaf, torch.Tensor)
            else (
                DYNAMIC_MARK
                if isinstance(leaf, Dynamic)
                else leaf
                if leaf.__class__ in PLAIN_CONSTANTS
                else _counted_constant(leaf)
            )
            for leaf in (_without_carriers(spec, leaves) if len(spec) > 3 else leaves)
        )
        shapes = (spec, counted)
        if addressed:
            shapes += (tuple(leaves[i].data_ptr() for i in sorted(addressed)),)
        hash(shapes)
    except (TypeError, RuntimeError):  # unhashable constants; a nested tensor's .shape raises
        shapes = (spec, region_keys.exact_key(device_of(), spec, leaves, paths))
    return shapes


def _without_carriers(spec: tuple, leaves: Sequence) -> list:
    """The leaves of a call that walked objects, each carrier as its key element."""
    counted = list(leaves)
    for i in spec[3].carriers:
        counted[i] = region_keys.CARRIER
    return counted


class WeakIdentity:
    """An object's identity in admission's counts, without keeping the object alive.

    Why: the counts keep up to two windows of keys (``2 * max(1024, 16 * max_graphs)``), and a
    constant argument that holds tensors (a ``Batch`` object new every step) kept every batch
    of the window alive, memory eager would have freed at once. Equal while both name the
    same live object; once the object is gone, equal to nothing new: a later object at the
    same address is another object, which the strong reference this replaces would have told
    apart too (it kept the address taken). So counts are the same as before, for objects
    compared by identity."""

    __slots__ = ("_ref", "_hash")

    def __init__(self, target: object):
        self._ref = weakref.ref(target)  # TypeError where the type has no weak references
        self._hash = id(target)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not WeakIdentity:
            return NotImplemented
        target = self._ref()
        return target is not None and target is other._ref()  # type: ignore[attr-defined]


def _count_element(leaf: object, depth: int = 0) -> object:
    """What admission counts a constant leaf under, holding no tensor and no object compared
    by identity (see WeakIdentity): values as they are; tensors and objects hashed by
    identity as weak identities; dataclasses compared by value (``Batch(ids)``, frozen) as
    their type and their compared fields' elements, and tuples inside them item by item, so
    a new ``Batch`` of the same tensors still counts as the same constant. Anything else
    (hashed by value, or without weak references) is kept as it is: counted by value, it
    must stay alive to be compared."""
    if isinstance(leaf, _VALUE_LEAVES):
        return leaf
    kind = type(leaf)
    if isinstance(leaf, torch.Tensor) or kind.__hash__ is object.__hash__:
        try:
            return WeakIdentity(leaf)
        except TypeError:  # no weak references (__slots__ without __weakref__): kept
            return leaf
    if depth < _COUNT_DEPTH:
        if isinstance(leaf, tuple):
            return (kind, tuple(_count_element(item, depth + 1) for item in leaf))
        params = getattr(kind, "__dataclass_params__", None)
        if params is not None and params.eq and dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            compared = [f.name for f in dataclasses.fields(leaf) if f.compare]
            return (kind, tuple(_count_element(getattr(leaf, name), depth + 1) for name in compared))
    return leaf


def _counted_constant(leaf: object) -> object:
    """:func:`_count_element` of a constant argument, hashed first: an unhashable constant raises
    TypeError here, as its key would (counted_shapes then takes the key, which says why)."""
    hash(leaf)
    return _count_element(leaf)


# --- a key in words -------------------------------------------------------------------------------
def describe_key(key: tuple, limit: int = 96) -> str:
    """A key in a few words: each leaf's kind and shape, constant or dynamic scalar."""
    parts = []
    for element in key[region_keys.LEAVES_START :]:
        if isinstance(element, tuple) and element and element[0] is KeyMark.REQUIRES_GRAD:
            parts.append(f"requiring grad: leaf {', '.join(map(str, element[1]))}")
        elif isinstance(element, tuple) and element and element[0] is KeyMark.ADDRESSES:
            parts.append(f"at fixed addresses: leaf {', '.join(str(i) for i, _ in element[1])}")
        elif element == region_keys.CARRIER:
            parts.append("an object")
        elif isinstance(element, tuple) and len(element) == 6 and isinstance(element[1], tuple):
            parts.append(f"{element[0]}[{','.join(map(str, element[1]))}]")
        elif isinstance(element, tuple) and element and element[0] == "dynamic":
            parts.append(f"dynamic {element[1]}")
        else:
            parts.append(repr(element[1] if isinstance(element, tuple) and len(element) == 2 else element))
    text = "(" + ", ".join(parts) + ")"
    return text if len(text) <= limit else text[: limit - 4] + " ...)"


class KeyText:
    """A key as :func:`describe_key` words it, worded only when a log record is emitted
    (eviction storms and every recording log one)."""

    __slots__ = ("key",)

    def __init__(self, key: tuple) -> None:
        self.key = key

    def __str__(self) -> str:
        return describe_key(self.key)


# --- a region's keys of its calls ---------------------------------------------------------------
class CallKeys:
    """A region's keys of its flattened calls: what admission counts a call under and the call's
    full key, both holding the addresses of the object tensors that the call's argument
    structure keys by address (its hints, learnt by replay.orchestration), and why a key about
    to record under grad mode must run eagerly. One place, because admission, the full path,
    the recording and the memos of object calls must agree on what a key is."""

    def __init__(self, region) -> None:
        self.region = region

    def addressed(self, spec: object) -> set[int] | tuple:
        """The object tensors the keys of ``spec`` hold by their address (Hints.addressed): those
        its hints say a node replay cannot rebind reads or writes."""
        hints = self.region.hints.get(spec) if len(spec) > 3 else None
        return hints.addressed if hints is not None else ()

    def counted(self, call) -> tuple:
        """What admission counts ``call`` under (:func:`counted_shapes`), with its region."""
        region = self.region
        device_of = region.session.current_device
        return (region, counted_shapes(device_of, call.spec, call.leaves, call.paths, self.addressed(call.spec)))

    def key_of(self, call, device: int) -> tuple:
        """The full key of a call (replay.region_keys.region_key), with the addresses of the
        object tensors its structure's keys hold by address."""
        return region_keys.region_key(device, call.spec, call.leaves, call.paths, self.addressed(call.spec))

    def needs_autograd(self, key: tuple, call) -> str:
        """Why a key about to be recorded under grad mode must run eagerly instead ("" if
        nothing says so): tensor arguments that require grad (its key says which), or outputs
        that required grad in its structure's observed warm-up (Hints.autograd). A graph's
        outputs are detached views of its memory: it would return them without ``grad_fn``.
        Outputs requiring grad in a capture are refused by the recording itself
        (recording.own_outputs), for the keys no observed warm-up spoke for."""
        grads = region_keys.grad_leaves(key)
        if grads:
            paths = call.paths
            return f"{', '.join(paths[i] for i in grads)} {'requires' if len(grads) == 1 else 'require'} grad"
        hints = self.region.hints.get(call.spec)
        return hints.autograd if hints is not None else ""
