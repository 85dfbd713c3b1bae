"""Which of a region's output leaves are objects the caller already holds, decided where the
region ran; and what the recording call itself hands out.

Why: an eager call returns the very argument it was given (``return x``, ``return x.add_(1)``,
an ``out`` argument) and the very tensor a global or a module holds (``return self.cache``),
but a new tensor object for anything it makes, a view included (``x[:]``, ``x.view(x.shape)``,
``W[0]``). A replay must hand out the same: the object itself where eager does, and a fresh
object at every call otherwise, or a caller changing an output's metadata (``unsqueeze_``,
``as_strided_``, ``resize_``, ``set_``) would change the caller's argument, or every later
result. Which one it is cannot be read from the tensor afterwards (a view covering its whole
input has the input's layout; a global may itself be a view), only from the objects while the
region's call is at hand: so a capture (replay.recording) and an observed run
(replay.polymorphic) record it here, and replay.graph_outputs classifies the outputs by it.

The capture's own output objects stay private: the recording call hands out fresh objects
(:func:`first_outputs`) exactly as its replays will, so nothing the caller does to them
changes what the graph was recorded with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs
import torch

from replay.dynamic import DynamicScalar
from replay.region_keys import extent_bytes, flatten, unflatten


@attrs.frozen
class OutputIdentity:
    """What each output leaf (numbered as ``region_keys.flatten`` numbers the result) is."""

    inputs: Mapping[int, int] = attrs.Factory(dict)  # output leaf -> the argument leaf it is, itself
    held: frozenset[int] = frozenset()  # output leaves that are tensors the region reaches by name
    repeats: Mapping[int, int] = attrs.Factory(dict)  # output leaf -> the earlier leaf it is the same object as
    # output leaf -> (its storage's first byte, its bytes) when the capture gave it memory of its
    # own: where that memory is, whatever a caller later does to the storage (resize_)
    owned: Mapping[int, tuple[int, int]] = attrs.Factory(dict)
    # output leaf -> its first byte where the region ran: a view of an argument is found by it,
    # whatever a caller does later to the storage it shares with the argument
    addresses: Mapping[int, int] = attrs.Factory(dict)
    # argument leaves the region was given one object for, an output being that object: which
    # of them the region returned cannot be told, so a replay serves only calls passing one
    # object there too (then it is every one of them)
    same: tuple[tuple[int, ...], ...] = ()


UNKNOWN = OutputIdentity()  # nothing known: every output is handed out as a fresh object


def identify(outputs: object, given: Mapping[int, object], held: object = None) -> OutputIdentity:
    """``outputs`` as the region returned them; ``given``: argument leaf -> the object the region
    was given in its place (the caller's tensor, or the staged or pinned buffer standing in for
    it); ``held``: what the region reaches by name (a recording.HeldTensors, or None)."""
    try:
        _spec, leaves, _paths = flatten((outputs,), {}, walk_dataclasses=True)
    except (TypeError, ValueError):
        return UNKNOWN  # a result no graph can return (the capture refuses it)
    by_id: dict[int, list[int]] = {}
    for i, value in sorted(given.items()):
        if isinstance(value, torch.Tensor):
            by_id.setdefault(id(value), []).append(i)
    named = {id(t) for t in _held_tensors(held)}
    inputs, by_name, repeats, first, same = {}, set(), {}, {}, []
    for n, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        earlier = first.setdefault(id(leaf), n)
        if earlier != n:
            repeats[n] = earlier
        elif id(leaf) in by_id:
            arguments = by_id[id(leaf)]
            inputs[n] = arguments[0]
            if len(arguments) > 1:
                same.append(tuple(arguments))
        elif id(leaf) in named:
            by_name.add(n)
    return OutputIdentity(inputs, frozenset(by_name), repeats, same=tuple(same))


def _held_tensors(held: object) -> Iterable[torch.Tensor]:
    if held is None:
        return ()
    return (*getattr(held, "named", ()), *getattr(held, "attributes", ()))


def given_objects(leaves: Sequence, staged: Mapping[int, object], host: Mapping[int, object] | None) -> dict:
    """Argument leaf -> the object a capture gives the region in its place."""
    host = host or {}
    return {i: staged.get(i, host.get(i, leaf)) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}


def with_memory(identity: OutputIdentity, outputs: object, owned_storages: set[int]) -> OutputIdentity:
    """``identity`` with where each tensor output is (its first byte) and the storage span of
    each the capture gave memory of its own (``owned_storages``: those storages' first bytes),
    read now, before anyone else holds them. An output in memory of its own is a new object the
    graph writes at every replay, whatever it was when the region returned it (a tensor it made
    and also stored where it reaches it by name)."""
    _spec, leaves, _paths = flatten((outputs,), {}, walk_dataclasses=True)
    addresses, owned = {}, {}
    for n, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        addresses[n] = leaf.data_ptr()
        storage = leaf.untyped_storage()
        if leaf.numel() and storage.data_ptr() in owned_storages:
            owned[n] = (storage.data_ptr(), storage.nbytes())
    return attrs.evolve(identity, owned=owned, addresses=addresses, held=identity.held - owned.keys())


def first_outputs(capture, inputs: Sequence, hand_out: Callable | None = None) -> object:
    """What the first launch of a fresh capture returns, as every replay returns it: an
    argument returned as is is the caller's argument, a tensor the region reaches by name that
    tensor, anything else a fresh object (a view of the caller's input for a view of an input
    or its staged buffer, a ``detach()`` of memory the graph owns, a fresh view of a global,
    a fresh empty tensor), the same object where the region returned one object twice; dynamic
    scalars as their recorded values. The capture's own objects are never handed out.
    ``hand_out``: applied to each tensor in memory the graph writes, and to nothing else (a
    copy under ``clone_outputs``, a stale guard under ``check_stale``), as a replay applies it:
    the caller's argument, a global and views of them are what eager returns."""
    spec, leaves, _ = flatten((capture.outputs,), {}, walk_dataclasses=True)
    identity = getattr(capture, "identity", None) or UNKNOWN
    owned = getattr(capture, "owned_outputs", set())
    buffers = {**capture.staged, **(capture.host.buffers if getattr(capture, "host", None) is not None else {})}
    values: list = []
    for n, leaf in enumerate(leaves):
        if n in identity.repeats:
            values.append(values[identity.repeats[n]])
        elif isinstance(leaf, DynamicScalar):
            values.append(leaf.value)
        elif not isinstance(leaf, torch.Tensor) or n in identity.held:
            values.append(leaf)
        elif n in identity.inputs:
            values.append(inputs[identity.inputs[n]])
        else:
            values.append(_fresh(leaf, buffers, inputs, owned, hand_out))
    return unflatten(spec, values)[0][0]


def _fresh(leaf: torch.Tensor, buffers: Mapping[int, torch.Tensor], inputs: Sequence, owned: set[int], hand_out=None):
    """A fresh object for a tensor output of the recording call (see :func:`first_outputs`)."""
    if not leaf.numel():
        return torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device=leaf.device)
    for i, buffer in buffers.items():
        lo = buffer.data_ptr()
        if lo <= leaf.data_ptr() and leaf.data_ptr() + extent_bytes(leaf) <= lo + extent_bytes(buffer):
            return _same_view_of(inputs[i], leaf, leaf.data_ptr() - lo)  # the same view of the caller's memory
    if leaf.untyped_storage().data_ptr() in owned:
        return leaf.detach() if hand_out is None else hand_out(leaf.detach())
    return torch.as_strided(leaf, leaf.shape, leaf.stride(), leaf.storage_offset())


def _same_view_of(source: torch.Tensor, leaf: torch.Tensor, delta: int) -> torch.Tensor:
    """``leaf``'s layout at ``delta`` bytes from ``source``'s first element: a view of ``source``
    where the dtype is its own (as a replay makes it), else over its storage."""
    start = source.storage_offset() * source.element_size() + delta
    if leaf.dtype == source.dtype and not delta % leaf.element_size():
        return torch.as_strided(source, leaf.shape, leaf.stride(), start // leaf.element_size())
    view = torch.empty(0, dtype=leaf.dtype, device=leaf.device)
    view.set_(source.untyped_storage(), start // leaf.element_size(), leaf.shape, leaf.stride())
    return view
