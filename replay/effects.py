"""What a region's run may do that no graph replays: a Python assignment to an object it was
passed or to the state its watch sees, a draw from the CPU generator, a torch setting left
changed.

Why they refuse a key rather than drop or re-key: a graph replays what the GPU did while it
was recorded, never the Python that ran (``cache.seen_tokens += 1``, ``self.calls += 1``), and
a draw from the CPU generator reaches the graph as a value (a 0-dim CPU tensor in a GPU op is
a kernel argument), so every replay would repeat the recording's numbers. The session reads
:class:`RunEffects` before the observed warm-up and the captured run of a key and asks
:meth:`RunEffects.after` after them; a key whose run did one of these runs eagerly from then
on (its own run is exact: the Python ran once, as eagerly), and its region remembers it in
its :class:`Unreplayable`, kept across a drift of the region's globals (which its own
assignments to watched state cause).

A first call's lazy initialisation (``is_initialized`` set, tensors made) changes an object's
structure, so the call has a key of its own that the next calls do not share: refused
quietly the first time an object's structure changes at a path (a new cache per generation
is a new object each time; the warning comes where the same object changes its structure
again: a list grown on every call). State the watch sees is refused where the same key's
captured run changed it twice: the first change may be a closed-over cache's lazy
initialisation, which re-keys the region once, as any change of its globals does.
"""

from __future__ import annotations

from collections import OrderedDict

import attrs
import torch

from jitcore import GlobalDriftError
from replay import objects, torch_state
from replay.region_keys import FlatCall

#: Why a key whose run drew from the CPU generator runs eagerly.
CPU_DRAW = "the region draws from the CPU generator: a graph would repeat its recording's numbers"

#: Keys a region remembers as unreplayable (and as suspected): a loop of ever-new keys keeps
#: bounded sets (a key forgotten is refused again when its run is seen again).
MAX_KEYS = 1024


def setting(name: str) -> str:
    """Why a key whose run left a torch setting changed runs eagerly."""
    return f"the region changes a torch setting ({name}) and leaves it changed: a graph cannot replay that"


def assignment(path: str) -> str:
    """Why a key whose run set ``path`` runs eagerly."""
    return f"the region changes {path}: a Python assignment a graph cannot replay"


@attrs.frozen
class Effect:
    """What a run did that no graph replays: ``reason`` (a refusal's words), ``path`` (the
    attribute it set, "" for a draw) and, where it changed an object's structure (an
    attribute added or removed, a container grown: a first call's lazy initialisation), the
    identity of that object (``changed``, else None)."""

    reason: str
    path: str = ""
    changed: int | None = None
    settings: bool = False  # a torch setting: the key is the one of the settings before the run


@attrs.define
class RunEffects:
    """The state a run of the region is compared against: its object arguments (their
    structure and plain values, :func:`replay.objects.snapshot`) and the CPU generator's state,
    read before the run (:meth:`before`)."""

    call: FlatCall
    objects_before: objects.Snapshot | None
    random_before: torch.Tensor
    settings_before: tuple | None = None

    @classmethod
    def before(cls, call: FlatCall) -> RunEffects:
        snapshot = objects.snapshot(call.spec, call.leaves, call.paths)
        return cls(call, snapshot, torch_state.cpu_random_state(), torch_state.settings_or_none())

    def after(self) -> Effect | None:
        """What the run did since :meth:`before` that no graph replays (None: nothing)."""
        if torch_state.cpu_random_advanced(self.random_before):
            return Effect(CPU_DRAW)
        name = torch_state.setting_changed(self.settings_before)
        if name is not None:
            return Effect(setting(name), settings=True)
        if self.objects_before is None:
            return None
        call = self.call
        now = objects.snapshot(call.spec, call.leaves, call.paths)
        path = objects.first_change(self.objects_before, now)
        if path is None:
            return None
        number = objects.structure_changed(self.objects_before, now)
        changed = id(call.leaves[call.spec[3].carriers[number]]) if number is not None else None
        return Effect(assignment(path), path, changed)


def watched_change(snapshot) -> str | None:
    """What changed in the state a region's globals snapshot (its watch included) holds, or
    None: a global's name, or the watch's path (``counter.n``, ``model.calls``)."""
    if snapshot is None:
        return None
    try:
        snapshot.check()
    except GlobalDriftError as drift:
        watch = getattr(snapshot, "watch", None)
        changed = watch.first_change() if watch else None
        return changed or str(drift).split(" read by ", 1)[0]
    return None


class Unreplayable:
    """A region's keys no graph may serve, with why (bounded, oldest first out), and what it
    saw change once: the keys whose captured run changed watched state (a second change
    refuses), the objects whose structure a run changed at a path (a second change warns;
    an object by its identity, which a later object may take: at worst a warning)."""

    def __init__(self) -> None:
        self.keys: OrderedDict[tuple, str] = OrderedDict()
        self.suspects: OrderedDict[tuple, str] = OrderedDict()
        self.structural: OrderedDict[tuple[int, str], None] = OrderedDict()

    def reason(self, key: tuple) -> str | None:
        return self.keys.get(key)

    def mark(self, key: tuple, reason: str) -> None:
        _put(self.keys, key, reason)

    def suspected_before(self, key: tuple, path: str) -> bool:
        """Whether ``key``'s captured run changed watched state before (else it is noted now)."""
        if key in self.suspects:
            return True
        _put(self.suspects, key, path)
        return False

    def structure_seen_before(self, changed: int, path: str) -> bool:
        """Whether a run changed the structure of object ``changed`` (an identity) at ``path``
        before (else it is noted now)."""
        if (changed, path) in self.structural:
            return True
        _put(self.structural, (changed, path), None)
        return False


def _put(table: OrderedDict, key: object, value: object) -> None:
    table[key] = value
    table.move_to_end(key)
    if len(table) > MAX_KEYS:
        table.popitem(last=False)
