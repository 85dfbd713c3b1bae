"""The exactness checks at the top of a generated replay function, before anything changes.

Each returns MISMATCH for a call the graph cannot serve exactly (the caller then runs it
eagerly, which gives the exact result or the exact error): other torch settings or launcher
globals, arguments overlapping otherwise than when recorded, an argument in memory the replay
writes or reaches at a fixed address, a pointer whose alignment a kernel was specialised on
changed. csrc/replay_step.c makes the same checks for the graphs it runs.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from jitcore.for_replay import compiled_helpers_enabled
from replay import recording, region_keys

if TYPE_CHECKING:
    from replay.source_text import Source

try:  # the aliasing check in C (csrc/replay_checks.c; optional, built by setup.py)
    from replay._checks import disjoint as _disjoint
except ImportError:
    _disjoint = None

#: Above this many non-empty tensor arguments recorded apart, replay checks that they are still
#: apart with numpy: a few calls for any count, where the general pattern is a Python loop.
NUMPY_DISJOINT_FROM = 12
#: From this many, with csrc/replay_checks.c built, by its ``disjoint`` (one sort in C, where the
#: generated check compares every pair).
C_DISJOINT_FROM = 4


def disjoint_check() -> Callable | None:
    """replay._checks.disjoint where it was built and ``JITCORE_NATIVE`` allows it, else None."""
    if _disjoint is None or not compiled_helpers_enabled():
        return None
    return _disjoint


def tensor_extents(leaves: Sequence) -> list[tuple[int, int]]:
    """(leaf, byte extent) of each tensor argument, in leaf order."""
    return [(i, region_keys.extent_bytes(leaf)) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]


def emit_guards(code: Source, graph, count: int) -> tuple[str, ...]:
    """The signature, then what must hold for any call: the region's globals unchanged,
    the torch modes of the recording, and (drawing random numbers) the generator state
    the graph was registered with. Returns the names the globals checks are bound under."""
    ns = code.namespace
    code.lines.append(f"def {graph.name}({', '.join(f'l{i}' for i in range(count))}):")
    code.line(f"# a recorded graph: {count} arguments, {len(graph.updaters)} patchable kernel nodes")
    names = tuple(code.bind(check, "_check") for check in graph.checks)
    for name in names:
        code.line(f"{name}()")
    ns["_modes_changed"] = region_keys.modes_changed(graph.key[2])
    code.line("if _modes_changed():")
    code.line("return _MISMATCH", 2)
    if graph.uses_rng:  # registered with the generator state of its recording (see recording)
        ns["_GENERATOR_EPOCH"] = recording.GENERATOR_EPOCH
        code.line(f"if _GENERATOR_EPOCH[0] != {int(getattr(graph.entry, 'rng_epoch', 0))}:")
        code.line("return _MISMATCH", 2)
    return names


def alias_checks(code: Source, graph, leaves: Sequence) -> None:
    """Read every tensor argument's pointer and its byte extent (``_e{i}``), and return
    MISMATCH unless the arguments overlap exactly as they did when the graph was recorded
    (the key's pattern)."""
    tensors = tensor_extents(leaves)
    for i, extent in tensors:
        code.namespace[f"_e{i}"] = extent
    for i, _ in tensors:
        code.line(f"_p{i} = l{i}.data_ptr()")
    # the key's groups among the tensors passed as such (an object's tensor keyed by its address
    # is not one: the full key every call passing objects computes holds its groups)
    groups = region_keys.restricted_groups(graph.key[3], {i for i, _ in tensors})
    ranges = [(i, extent) for i, extent in tensors if extent]  # an empty tensor overlaps nothing
    if not groups and _apart_in_bulk(code, ranges):
        return
    if len(tensors) > 8:  # one sort instead of n^2/2 comparisons
        code.namespace["_overlap_groups"] = region_keys.overlap_groups
        code.namespace["_PATTERN"] = groups
        listed = "".join(f"({i}, _p{i}, _p{i} + _e{i}), " for i, _extent in tensors)
        code.line(f"if _overlap_groups([{listed}]) != _PATTERN:")
        code.line("return _MISMATCH", 2)
        return
    pattern = region_keys.overlapping_pairs(groups)
    for n, (i, extent_i) in enumerate(tensors):
        for j, extent_j in tensors[n + 1 :]:
            if not extent_i or not extent_j:
                continue  # an empty tensor overlaps nothing
            overlap = f"_p{i} < _p{j} + _e{j} and _p{j} < _p{i} + _e{i}"
            code.line(f"if {'not (' + overlap + ')' if (i, j) in pattern else overlap}:")
            code.line("return _MISMATCH", 2)


def _apart_in_bulk(code: Source, ranges: list[tuple[int, int]]) -> bool:
    """Arguments recorded all apart, checked still so in one step where there are many: one
    sort in C (csrc/replay_checks.c), else numpy (sorted by first byte, each range ends at or
    before the next begins). False where the general pattern checks them."""
    ns = code.namespace
    disjoint = disjoint_check()
    if disjoint is not None and len(ranges) >= C_DISJOINT_FROM:
        ns["_disjoint"] = disjoint
        ns["_EXTENTS"] = tuple(int(extent) for _, extent in ranges)
        code.line(f"if not _disjoint(({''.join(f'_p{i}, ' for i, _ in ranges)}), _EXTENTS):")
        code.line("return _MISMATCH", 2)
        return True
    if len(ranges) > NUMPY_DISJOINT_FROM:
        ns["_np_array"], ns["_np_int64"] = np.array, np.int64
        ns["_EXTENTS"] = np.array([extent for _, extent in ranges], dtype=np.int64)
        code.line(f"_a = _np_array([{', '.join(f'_p{i}' for i, _ in ranges)}], _np_int64)")
        code.line("_o = _a.argsort()")
        code.line("if ((_a + _EXTENTS)[_o[:-1]] > _a[_o[1:]]).any():")
        code.line("return _MISMATCH", 2)
        return True
    return False


def same_argument_checks(code: Source, graph) -> None:
    """Decline a call that passes distinct objects where the recording passed one object it
    returned (``step(x, x)`` returning it): which argument the region returns cannot be told,
    so only a call passing one object there too is served (the aliasing check alone would take
    ``step(x, x.view(x.shape))``, whose eager result is one of two objects)."""
    for group in getattr(graph, "same_arguments", ()):
        first = int(group[0])
        for other in group[1:]:
            code.line(f"if l{int(other)} is not l{first}:")
            code.line("return _MISMATCH", 2)


def staged_storage_checks(code: Source, graph) -> None:
    """Decline a call whose staged input shares its storage with memory the graph reaches
    at a fixed address (``step(cache[0])`` where a node reads ``cache`` itself, recorded
    while the argument was a tensor of its own): staged, the input is copied apart from
    that memory, so a write through one is not seen through the other, where eagerly it
    is. Storage by storage: the graph's fixed addresses (replay.rebinding.fixed_addresses)
    are sorted, so one bisection per staged input. Where a node's addresses could not be
    read, a staged input must be its storage's whole."""
    if not graph.staged or graph.fixed_addresses == ():
        return
    ns = code.namespace
    if graph.fixed_addresses is None:
        for i in sorted(graph.staged):
            code.line(f"_st = l{i}.untyped_storage()")
            code.line(f"if _st.data_ptr() != _p{i} or _st.nbytes() != _e{i}:")
            code.line("return _MISMATCH", 2)
        return
    ns["_bisect"], ns["_FIXED"] = bisect.bisect_left, graph.fixed_addresses
    ns["_FIXED_COUNT"] = len(graph.fixed_addresses)
    for i in sorted(graph.staged):
        code.line(f"_st = l{i}.untyped_storage()")
        code.line("_sb = _st.data_ptr()")
        code.line("_sn = _bisect(_FIXED, _sb)")
        code.line("if _sn < _FIXED_COUNT and _FIXED[_sn] < _sb + _st.nbytes():")
        code.line("return _MISMATCH", 2)


#: Why a graph keeping its own output memory can serve no call any more (graph.spoil).
RESIZED = "a caller resized the storage of an output the graph writes (its memory moved)"


def own_output_checks(code: Source, graph, leaves: Sequence) -> None:
    """Decline a call whose tensor argument lies in the output memory this replay writes
    (its previous output passed back in, ``h = step(h)``): the replay would overwrite that
    argument with the new output, where an eager call leaves it as it was. A graph using
    the region's output slots first chooses its slot (``_o``: the one it wrote last, while
    no other graph wrote it since, so usually a few attribute reads); an argument anyone
    still holds keeps every other slot from being chosen, so only that slot can hold it.

    Before either, the memory is where the graph's copies write: a caller may have resized
    an output's storage (``resize_``), which moves it and gives its old memory back to the
    allocator. A slot that moved is left to choose (which drops it); a graph's own buffer
    that moved spoils the graph (its copies cannot be pointed elsewhere): the call runs
    eagerly, and the session drops the graph."""
    tensors = [(i, extent) for i, extent in tensor_extents(leaves) if extent]
    if graph.output_slots is None:
        _own_buffer_checks(code, graph)
        for i, extent in tensors:
            for lo, size in graph.output_memory.items():
                code.line(f"if _p{i} < {lo + size} and {lo} < _p{i} + {extent}:")
                code.line("return _MISMATCH", 2)
        return
    need = code.bind(graph.slot_need, "_need")
    code.line("_o = _me.slot")
    code.line("if _o is None or _o.writer is not _me or _o.freed:")
    # OutputSlots.choose's second rule inline (graphs taking turns take it on every
    # replay): the slot its copies write, if nobody holds outputs in it (it fits: the
    # copies only ever point at a slot choose gave this graph, and slots never shrink)
    code.line("_o = _me.bound_slot", 2)
    code.line("if _o is None or _o.freed or _o.held():", 2)
    code.line(f"_o = _choose(_me, {need})", 3)
    lanes = range(len(graph.slot_need))
    _read_lanes(code, lanes, 1)  # where each lane it writes is: its first byte, its size, its storage
    moved = " or ".join(f"_ls{k}.data_ptr() != _la{k} or _ls{k}.nbytes() != _lb{k}" for k in lanes)
    code.line(f"if {moved}:")  # a caller resized it: choose drops it, and gives another
    code.line(f"_o = _choose(_me, {need})", 2)
    _read_lanes(code, lanes, 2)
    for lane in lanes:  # each lane read once, not once per argument
        for i, _extent in tensors:
            code.line(f"if _p{i} < _la{lane} + _lb{lane} and _la{lane} < _p{i} + _e{i}:")
            code.line("return _MISMATCH", 2)


def _read_lanes(code: Source, lanes: range, depth: int) -> None:
    for lane in lanes:
        code.line(f"_ln = _o.lanes[{lane}]", depth)
        code.line(f"_la{lane} = _ln.address", depth)
        code.line(f"_lb{lane} = _ln.size", depth)
        code.line(f"_ls{lane} = _ln.storage", depth)


def _own_buffer_checks(code: Source, graph) -> None:
    """Each of the graph's own output buffers where its copies write (see own_output_checks)."""
    lanes = getattr(graph, "own_lanes", ())
    if not lanes:
        return
    code.namespace["_RESIZED"] = RESIZED
    for lane in lanes:
        storage = code.bind(lane.storage, "_own")
        code.line(f"if {storage}.data_ptr() != {int(lane.address)} or {storage}.nbytes() != {int(lane.size)}:")
        code.line("return _me.spoil(_RESIZED)", 2)


def alignment_checks(code: Source, graph) -> None:
    """Decline a call whose rebound pointer would lose (or gain) the 16-byte alignment a
    kernel was specialised on when recorded (Triton's ``tt.divisibility``): the eager run
    picks the binary compiled for the new alignment."""
    seen = set()
    for binding in graph.plan.pointers:
        if binding.aligned is None:
            continue
        key = (binding.input, binding.delta % 16, binding.aligned)
        if key in seen:
            continue
        seen.add(key)
        test = "==" if binding.aligned else "!="
        code.line(f"if not (((_p{binding.input} + {int(binding.delta)}) & 15) {test} 0):")
        code.line("return _MISMATCH", 2)
