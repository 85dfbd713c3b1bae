"""The rebinding plan: for each region input, rebind it or stage it, and how.

Pure logic over plain data (addresses, parameter bytes, node lists), so it is tested on the CPU
with made-up graphs; :mod:`replay.recording` feeds it what a real capture produced.

- Every jit launch recorded during capture is paired with the kernel node it became: by the
  node's identity where the backend reports it at capture time (the capturing stream's tail
  right after the launch), else by equal function and parameter bytes, refusing launches that
  are byte-identical but whose parameters come from different places (swapping them would
  patch the wrong node).
- A jit pointer parameter whose value lies inside exactly one input's byte range becomes a
  :class:`PointerBinding` (node, offset, input, delta): at replay, ``new pointer + delta`` is
  written when the input moved, so views and slices rebase. Where the view's offset itself
  was computed from a dynamic scalar (``cache[pos]``), the offset is recomputed too.
- A jit scalar parameter computed from dynamic region scalars becomes a
  :class:`ScalarBinding`; a grid or block size computed from one, a :class:`ConfigBinding`.
- A pointer into memory the region allocated itself never depends on a dynamic value (the
  plan refuses the capture if it would), and a launch skipped because a dynamic size was 0
  at recording time has no node to patch (the plan asks for a later recording).
- An input that something other than a jit launch touches (a torch op, seen by the observer;
  a foreign kernel or copy node, seen by scanning parameters) cannot be patched: it is staged
  (copied into a recorded buffer at the start of the graph) and, if written, copied back at
  the end. A kernel node whose parameters cannot be read stages every input. Inputs that
  overlap each other are staged too (which one a pointer belongs to is ambiguous);
  overlapping inputs that are also written cannot be graphed at all.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import struct
import types
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import attrs
import numpy as np

REBOUND, STAGED, UNUSED = "rebound", "staged", "unused"


@attrs.frozen
class InputRange:
    index: int  # leaf index
    path: str
    lo: int
    hi: int  # one past the last byte (lo == hi for empty tensors)


@attrs.frozen
class Extent:
    """The byte range ``[lo, hi)`` of the tensor a pointer parameter came from, recorded for a
    pointer into an input where the plan cannot take the address alone as proof that the
    pointer follows the input: the tensor was not the input itself (a view the region made, or
    another tensor over the same memory), or the recording call's arguments gave another route
    to that memory. ``doubt`` says why the pointer may belong to another holder of the memory,
    whose address stays where it is while the input moves (empty: only the range decides)."""

    lo: int
    hi: int
    doubt: str = ""


@attrs.frozen
class ParamView:
    """A jit parameter as the plan needs it (a subset of jitcore's ParamRecord).

    ``evaluate(scalars)`` recomputes a scalar parameter from ``scalars[k]``, the value of jit
    argument ``k``; ``offset_evaluate(scalars)`` likewise recomputes a pointer's byte offset
    from its tensor's data pointer, where ``offset_scalar_args`` is not empty."""

    index: int
    offset: int
    size: int
    fmt: str
    kind: str  # "pointer", "scalar", "constant"
    read_only: bool = False
    expression: str | None = None  # scalars, for messages: with {k} for jit argument k
    convert: object = None
    scalar_args: tuple[int, ...] = ()  # scalars: the jit arguments the value depends on
    evaluate: Callable | None = None
    byte_offset: int = 0  # pointers: the address minus the tensor argument's data pointer
    offset_scalar_args: tuple[int, ...] = ()
    offset_evaluate: Callable | None = None
    # pointers: whether the kernel was specialized on the address being 16-byte aligned
    # (Triton): True/False must hold on every replay; None: no assumption
    aligned: bool | None = None


@attrs.frozen
class ConfigView:
    """A launch dimension computed from runtime scalar arguments."""

    field: str  # "grid_x" ... "block_z", "shared"
    scalar_args: tuple[int, ...]
    evaluate: Callable
    expression: str = ""


@attrs.frozen
class CheckView:
    """An index bounds check of the call state, computed from runtime scalar arguments:
    passes when ``-size(scalars) <= value(scalars) < size(scalars)``."""

    scalar_args: tuple[int, ...]
    value: Callable
    size: Callable


#: The empty mapping a launch view's optional tables default to (shared, so read-only).
_EMPTY: Mapping = types.MappingProxyType({})


class LaunchView(NamedTuple):
    """A recorded jit launch as the plan needs it.

    A named tuple rather than an attrs class: the analysis makes one per launch of every
    recording, and a named tuple of these thirteen fields is the cheaper to make.
    ``view.replace(**fields)`` copies it with fields changed."""

    function: int
    kernel: str
    param_bytes: bytes
    params: tuple[ParamView, ...]
    # jit argument index -> Python source of its value: an expression over the dynamic leaves
    # (``_d2``) and named constants (``_k0``, values in ``constants``); other arguments absent
    scalar_sources: Mapping[int, str] = _EMPTY
    dynamic_args: frozenset[int] = frozenset()
    constants: Mapping[str, object] = _EMPTY
    config: tuple[ConfigView, ...] = ()
    launched: bool = True  # False: a grid dimension was 0, so nothing was launched
    node: int | None = None  # the graph node it became (raw handle), where the backend says
    checks: tuple[CheckView, ...] = ()
    staging_input: int | None = None  # a staging copy of this input (leaf index) made by replay itself
    # pointer parameter -> where the jit argument it came from lies, for pointers into an input
    # whose provenance the plan must check (replay.recording.pointer_extents)
    extents: Mapping[int, Extent] = _EMPTY

    def replace(self, **changes: object) -> LaunchView:
        return self._replace(**changes)


class NodeView(NamedTuple):
    """A graph node as the plan needs it. A named tuple, as LaunchView: the analysis makes one
    per node of every recording."""

    index: int
    kind: str  # "kernel", "memcpy", "memset", "other"
    function: int = 0
    params: tuple[bytes, ...] | None = None  # kernel nodes: each parameter's bytes, if known
    pointers: tuple[int, ...] | None = ()  # memcpy/memset: addresses touched; None = unknown
    handle: int = 0  # the node's raw handle


@attrs.frozen
class PointerBinding:
    node: int  # node index in the graph
    launch: int  # launch index
    param: int
    offset: int
    input: int  # leaf index
    delta: int  # recorded address minus the input's recorded data pointer
    dynamic: bool = False  # the view offset depends on dynamic scalars (recomputed each replay)
    recorded_offset: int = 0  # dynamic: the byte offset the recording used
    offset_evaluate: Callable | None = None
    aligned: bool | None = None  # the address's 16-byte divisibility every replay must keep


@attrs.frozen
class ScalarBinding:
    node: int
    launch: int
    param: int
    offset: int
    fmt: str
    evaluate: Callable
    convert: object = None
    expression: str = ""


@attrs.frozen
class ConfigBinding:
    node: int
    launch: int
    field: str
    evaluate: Callable
    expression: str = ""


@attrs.frozen
class CheckBinding:
    launch: int
    value: Callable
    size: Callable


@attrs.define
class Plan:
    matches: list[tuple[int, int]] = attrs.Factory(list)  # (launch index, node index)
    pointers: list[PointerBinding] = attrs.Factory(list)
    scalars: list[ScalarBinding] = attrs.Factory(list)
    configs: list[ConfigBinding] = attrs.Factory(list)
    checks: list[CheckBinding] = attrs.Factory(list)  # index checks every replay must pass
    # launch index -> the Python source of each jit argument replay recomputes (None elsewhere)
    arguments: dict[int, tuple[str | None, ...]] = attrs.Factory(dict)
    constants: dict[str, object] = attrs.Factory(dict)
    choices: dict[int, str] = attrs.Factory(dict)  # input leaf index -> REBOUND / STAGED / UNUSED
    reasons: dict[int, list[str]] = attrs.Factory(dict)
    needs_staging: set[int] = attrs.Factory(set)  # inputs that must be staged (not staged this capture)
    needs_copy_back: set[int] = attrs.Factory(set)
    failure: str | None = None  # why this capture cannot be used at all
    retry_later: str | None = None  # why this capture cannot be used, though a later one may


_POINTER = struct.Struct("<Q")


def inputs_at(inputs: Sequence[InputRange], address: int) -> list[InputRange]:
    """The inputs ``address`` points into: those whose bytes hold it, else an empty input at
    exactly that (nonzero) address."""
    found = [r for r in inputs if r.lo <= address < r.hi]
    if not found and address:
        found = [r for r in inputs if r.lo == r.hi == address]
    return found


_NO_WORDS = np.zeros(0, dtype=np.uint64)
_NO_NUMBERS = np.zeros(0, dtype=np.intp)
_WINDOW = np.arange(8)


def pointer_words_of(params: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Every 8-byte window at a 4-byte aligned offset of each parameter's bytes (where a
    pointer could be, also inside packed structs), and the parameter each comes from: all
    parameters at once, their bytes joined and read in one pass (a library kernel's parameter
    structs hold hundreds of words, and a capture of a few dozen torch ops has thousands). A
    word that merely looks like an input's address makes the plan stage that input, which is
    safe. No window crosses from one parameter into the next."""
    if not params:
        return _NO_WORDS, _NO_NUMBERS
    lengths = np.fromiter(map(len, params), dtype=np.intp, count=len(params))
    if not (lengths & 3).any():  # every parameter whole 4-byte halves: the windows of the joined halves
        return _words_by_halves(b"".join(params), lengths >> 2)
    windows = np.maximum((lengths - 4) // 4, 0)  # at offsets 0, 4, ..., len - 8 of each
    total = int(windows.sum())
    if not total:
        return _NO_WORDS, _NO_NUMBERS
    param_of = np.repeat(np.arange(len(params)), windows)
    first = np.cumsum(windows) - windows  # each parameter's first window among all
    starts = np.cumsum(lengths) - lengths  # each parameter's first byte in the joined bytes
    offsets = starts[param_of] + 4 * (np.arange(total) - first[param_of])
    data = b"".join(params)
    if not (starts & 3).any():  # every parameter 4-byte aligned in the joined bytes: by halves
        halves = np.frombuffer(data, dtype="<u4", count=len(data) // 4).astype(np.uint64)
        at = offsets >> 2
        return halves[at] | (halves[at + 1] << np.uint64(32)), param_of
    octets = np.frombuffer(data, dtype=np.uint8)[offsets[:, None] + _WINDOW]
    return octets.view("<u8").reshape(total), param_of


def _words_by_halves(data: bytes, halves_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`pointer_words_of` where each parameter is ``halves_of[k]`` 4-byte halves joined in
    ``data``: the window at each half and the next, kept where both are one parameter's."""
    halves = np.frombuffer(data, dtype="<u4").astype(np.uint64)
    if len(halves) < 2:
        return _NO_WORDS, _NO_NUMBERS
    param_of = np.repeat(np.arange(len(halves_of)), halves_of)
    within = param_of[:-1] == param_of[1:]
    return (halves[:-1] | (halves[1:] << np.uint64(32)))[within], param_of[:-1][within]


def inputs_reached(inputs: Sequence[InputRange], words: np.ndarray) -> list[InputRange]:
    """The inputs some word points into: :func:`inputs_at` of every word at once (an empty
    input at an address counts only where no other input holds that address); the inputs
    in their order, the empty ones last."""
    return inputs_reached_by_group(inputs, words, np.zeros(len(words), dtype=np.intp), 1)[0]


def inputs_reached_by_group(
    inputs: Sequence[InputRange], words: np.ndarray, group_of: np.ndarray, groups: int
) -> list[list[InputRange]]:
    """:func:`inputs_reached` of each group of ``words`` (``group_of[k]``: the group of word k,
    below ``groups``; a graph's foreign nodes), for all groups in one pass. Whether a word is
    held by a non-empty input depends on the word alone, so this decides as the word-by-word
    rule does."""
    reached: list[list[InputRange]] = [[] for _ in range(groups)]
    if not len(words):
        return reached
    words = np.asarray(words, dtype=np.uint64)
    placed = _placed_bounds(inputs)
    if not placed or placed[-1] < 1 << 64:  # (an empty input at the last address ends past uint64)
        if not (np.searchsorted(np.array(placed, dtype=np.uint64), words, side="right") & 1).any():
            return reached  # no word in any input (usually: a library kernel's words point into the pool)
    found: dict[int, set[int]] = {}  # group -> the places in ``inputs`` of the non-empty inputs reached
    held = _held_words(inputs, words, group_of, found)
    empty_found: dict[int, set[int]] = {}
    _empty_inputs_at(inputs, words[~held], group_of[~held], empty_found)
    for group in {*found, *empty_found}:
        places = sorted(found.get(group, ())) + sorted(empty_found.get(group, ()))
        reached[group] = [inputs[n] for n in places]
    return reached


def _held_words(inputs: Sequence[InputRange], words: np.ndarray, group_of: np.ndarray, found: dict) -> np.ndarray:
    """Which words a non-empty input holds, adding each word's holders (their places in
    ``inputs``) to its group's set in ``found``. The inputs' bounds are sorted once and each
    word placed among them by one ``searchsorted``; the inputs may overlap, so a stretch
    between two bounds is held where more inputs begin than end before it, and its holders
    are listed only for the stretches some word falls in (usually none: a library kernel's
    words point into the pool)."""
    full = [(n, r) for n, r in enumerate(inputs) if r.lo < r.hi]
    if not full:
        return np.zeros(len(words), dtype=bool)
    starts = np.array([r.lo for _, r in full], dtype=np.uint64)
    ends = np.array([r.hi for _, r in full], dtype=np.uint64)
    bounds = np.unique(np.concatenate([starts, ends]))
    covering = np.zeros(len(bounds) + 1, dtype=np.intp)  # stretch k: [bounds[k], bounds[k + 1])
    np.add.at(covering, np.searchsorted(bounds, starts), 1)
    np.add.at(covering, np.searchsorted(bounds, ends), -1)
    holds = np.cumsum(covering) > 0  # the last entry: below every input (stretch -1), never held
    stretch = np.searchsorted(bounds, words, side="right") - 1
    held = holds[stretch]
    if held.any():
        for group, lo in set(zip(group_of[held].tolist(), bounds[stretch[held]].tolist())):
            found.setdefault(group, set()).update(n for n, r in full if r.lo <= lo < r.hi)
    return held


def _empty_inputs_at(inputs: Sequence[InputRange], words: np.ndarray, group_of: np.ndarray, found: dict) -> None:
    """Add the empty inputs at some word's address (nonzero) to that word's group's set."""
    by_address: dict[int, list[int]] = {}
    for n, r in enumerate(inputs):
        if r.lo == r.hi and r.lo:
            by_address.setdefault(r.lo, []).append(n)
    if not by_address or not len(words):
        return
    addresses = np.array(sorted(by_address), dtype=np.uint64)
    at = np.minimum(np.searchsorted(addresses, words), len(addresses) - 1)
    hit = addresses[at] == words
    for group, address in set(zip(group_of[hit].tolist(), words[hit].tolist())):
        found.setdefault(group, set()).update(by_address[address])


def overlapping_inputs(inputs: Sequence[InputRange]) -> dict[int, set[int]]:
    """Each input that overlaps others, with the leaf indices of those others."""
    overlaps: dict[int, set[int]] = {}
    for i, a in enumerate(inputs):
        for b in inputs[i + 1 :]:
            if a.lo < b.hi and b.lo < a.hi:
                overlaps.setdefault(a.index, set()).add(b.index)
                overlaps.setdefault(b.index, set()).add(a.index)
    return overlaps


def _provenance(launch: LaunchView) -> tuple:
    """What decides how a launch is patched: equal for launches that may be swapped."""
    return (
        tuple(
            (p.kind, p.read_only, p.scalar_args, p.expression, p.offset_scalar_args, p.byte_offset)
            for p in launch.params
        ),
        tuple(sorted((k, v) for k, v in launch.scalar_sources.items())),
        tuple((c.field, c.scalar_args, c.expression) for c in launch.config),
    )


def match_launches(
    launches: Sequence[LaunchView], nodes: Sequence[NodeView]
) -> tuple[list[tuple[int, int]], str | None]:
    """Pair each jit launch that ran with the kernel node that holds it."""
    kernels = [n for n in nodes if n.kind == "kernel"]
    by_handle = {n.handle: n for n in kernels if n.handle}
    used: set[int] = set()
    matches = []
    cursor = 0
    for number, launch in enumerate(launches):
        if not launch.launched:
            continue
        wanted = _param_slices(launch.params)(launch.param_bytes)
        if launch.node is not None:
            node = by_handle.get(launch.node)
            if node is None or node.function != launch.function or node.index in used:
                return matches, f"jit launch {number} ({launch.kernel}) is not the graph node the capture reported"
            if node.params is not None and tuple(node.params) != wanted:
                return matches, f"the graph node of jit launch {number} ({launch.kernel}) holds other parameters"
            used.add(node.index)
            matches.append((number, node.index))
            continue
        twins = [
            other
            for other in launches
            if other is not launch
            and other.launched
            and other.function == launch.function
            and other.param_bytes == launch.param_bytes
        ]
        if any(_provenance(other) != _provenance(launch) for other in twins):
            return (
                matches,
                f"jit launch {number} ({launch.kernel}) has the same parameter bytes as another launch whose "
                "parameters come from elsewhere, and this backend cannot say which graph node is which",
            )
        order = kernels[cursor:] + kernels[:cursor]
        for node in order:
            if node.index in used or node.function != launch.function or node.params is None:
                continue
            if tuple(node.params) == wanted:
                used.add(node.index)
                matches.append((number, node.index))
                cursor = (kernels.index(node) + 1) % max(len(kernels), 1)
                break
        else:
            return (
                matches,
                f"jit launch {number} ({launch.kernel}) was not found among the captured graph's kernel nodes",
            )
    return matches, None


#: Per params tuple (by id, the tuple kept beside): what the plan reads of it, made once
#: (launches share their params tuples, see replay.recording._param_views): the parameters'
#: slices (:func:`_param_slices`) and kinds (:func:`_param_kinds`).
_SLICES: dict[int, tuple[tuple, Callable]] = {}
_KINDS: dict[int, tuple[tuple, tuple]] = {}
_BY_PARAMS_LIMIT = 4096


def _remember(cache: dict, params: Sequence, answer: object) -> object:
    if isinstance(params, tuple):  # immutable: the answer holds as long as it lives
        if len(cache) >= _BY_PARAMS_LIMIT:
            cache.clear()
        cache[id(params)] = (params, answer)
    return answer


def _param_slices(params: Sequence[ParamView]) -> Callable[[bytes], tuple[bytes, ...]]:
    """A function of a launch's parameter bytes that answers each parameter's own bytes, as
    a kernel node holding the launch reads them (one C call: an itemgetter of slices)."""
    cached = _SLICES.get(id(params))
    if cached is not None and cached[0] is params:
        return cached[1]
    spans = [slice(p.offset, p.offset + p.size) for p in params]
    if len(spans) == 1:  # (an itemgetter of one item answers the item itself)
        return _remember(_SLICES, params, lambda data, only=spans[0]: (data[only],))
    return _remember(_SLICES, params, operator.itemgetter(*spans) if spans else lambda data: ())


def _param_kinds(params: Sequence[ParamView]) -> tuple[tuple[ParamView, ...], tuple[ParamView, ...], Callable]:
    """(the pointer parameters, the scalar parameters computed from runtime scalars, a function
    of a launch's parameter bytes answering every pointer parameter's address in their order:
    one C call, a Struct reading them all where their offsets follow each other)."""
    cached = _KINDS.get(id(params))
    if cached is not None and cached[0] is params:
        return cached[1]
    pointers = tuple(p for p in params if p.kind == "pointer")
    scalars = tuple(p for p in params if p.kind == "scalar" and p.evaluate is not None)
    return _remember(_KINDS, params, (pointers, scalars, _pointer_reader([p.offset for p in pointers])))


def _pointer_reader(offsets: Sequence[int]) -> Callable[[bytes], tuple[int, ...]]:
    """``read(data)``: the 8-byte little-endian words of ``data`` at ``offsets``, as
    ``_POINTER.unpack_from`` reads each (struct.error where ``data`` is too short)."""
    if all(b >= a + 8 for a, b in itertools.pairwise(offsets)):
        fmt, position = "<", 0
        for offset in offsets:
            fmt += "x" * (offset - position) + "Q"
            position = offset + 8
        return struct.Struct(fmt).unpack_from
    unpack = _POINTER.unpack_from
    return lambda data: tuple(unpack(data, offset)[0] for offset in offsets)


def _placed_bounds(inputs: Sequence[InputRange]) -> list[int]:
    """Where :func:`inputs_at` finds an input, as the sorted bounds of disjoint stretches
    ``[b0, b1), [b2, b3), ...``: an address is in some input exactly where
    ``bisect_right(bounds, address)`` is odd (an empty input at a nonzero address counts as
    the stretch of that one address)."""
    spans = sorted(
        [(r.lo, r.hi) for r in inputs if r.lo < r.hi] + [(r.lo, r.lo + 1) for r in inputs if r.lo == r.hi and r.lo]
    )
    bounds: list[int] = []
    for lo, hi in spans:
        if bounds and lo <= bounds[-1]:
            bounds[-1] = max(bounds[-1], hi)
        else:
            bounds += [lo, hi]
    return bounds


def _arguments_source(launch: LaunchView, needed: set[int]) -> tuple[str | None, ...]:
    count = max(needed) + 1
    return tuple(launch.scalar_sources.get(k) for k in range(count))


class _Refused(Exception):
    """The capture cannot be used at all: ``reason`` becomes :attr:`Plan.failure`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _skipped_with_a_dynamic_grid(launches: Sequence[LaunchView]) -> str | None:
    """Why the capture must wait for a later one: a launch whose grid, computed from a dynamic
    scalar, was 0 while recording left no node to patch when the grid grows."""
    for launch in launches:
        if not launch.launched and any(set(c.scalar_args) & launch.dynamic_args for c in launch.config):
            return (
                f"{launch.kernel} was skipped while recording (a grid size computed from a dynamic scalar was 0), "
                "so the graph has no node for it"
            )
    return None


def addresses_readable(node: NodeView) -> bool:
    """Whether the addresses a node may reach memory through were read: a kernel's parameter
    bytes, a copy's or memset's addresses (a copy moves bytes somewhere: no address read means
    none could be)."""
    if node.kind == "kernel":
        return node.params is not None
    return node.pointers is not None and not (node.kind == "memcpy" and not node.pointers)


def addresses_of(nodes: Sequence[NodeView]) -> tuple[np.ndarray, np.ndarray]:
    """Every address each node may reach memory through, all nodes at once: the words of
    kernel nodes' parameters (:func:`pointer_words_of`) and the addresses of copies and
    memsets; with the place in ``nodes`` of each word's node. Every node's addresses must be
    readable (:func:`addresses_readable`)."""
    if not nodes:
        return _NO_WORDS, _NO_NUMBERS
    kernels = [node for node in nodes if node.kind == "kernel"]
    numbers = [n for n, node in enumerate(nodes) if node.kind == "kernel"]
    counts = [len(node.params) for node in kernels]
    words, param_of = pointer_words_of([p for node in kernels for p in node.params])
    node_of = np.repeat(np.array(numbers, dtype=np.intp), counts)[param_of]
    others = [(n, node.pointers) for n, node in enumerate(nodes) if node.kind != "kernel"]
    if not others:
        return words, node_of
    pointers = np.array([p for _, listed in others for p in listed], dtype=np.uint64)
    pointer_of = np.repeat(np.array([n for n, _ in others], dtype=np.intp), [len(listed) for _, listed in others])
    return np.concatenate([words, pointers]), np.concatenate([node_of, pointer_of])


def addresses_in(node: NodeView) -> np.ndarray | None:
    """Every address a foreign node may reach an input through (None: they cannot be read)."""
    return addresses_of([node])[0] if addresses_readable(node) else None


#: No allocation starts below this (Linux keeps the first 64 KiB unmapped, and device and host
#: allocators map far above it): a smaller word in a node's parameters is a number.
LOWEST_ADDRESS = 1 << 16


def fixed_addresses(nodes: Sequence[NodeView], per_call: Sequence[tuple[int, int]]) -> tuple[int, ...] | None:
    """Every address the graph's nodes hold that no replay changes: the words of each kernel
    node's parameters (where a pointer could be, as :func:`pointer_words_of`) and the addresses
    of its copies and memsets, sorted, without those inside ``per_call`` (the recorded
    inputs, rebound or staged per call, and the graph's own staging buffers). A word that
    merely looks like an address only makes a replay decline; words below
    :data:`LOWEST_ADDRESS` (sizes, strides, counts: most of a library kernel's parameters) are
    no address of any allocation. None where a node's addresses cannot be read."""
    listed = [node for node in nodes if node.kind in ("kernel", "memcpy", "memset")]
    if not all(map(addresses_readable, listed)):
        return None
    every = np.unique(addresses_of(listed)[0])
    keep = every >= LOWEST_ADDRESS
    for lo, hi in per_call:
        keep &= (every < lo) | (every >= hi)
    return tuple(every[keep].tolist())


@attrs.define
class _Stager:
    """What one :func:`build_plan` finds must be staged (and copied back) in the next capture,
    where patching a node cannot follow an input: the inputs that foreign nodes, torch ops or
    ambiguous pointers reach."""

    plan: Plan
    inputs: Sequence[InputRange]
    staged: set[int]  # inputs staged in this capture
    copied_back: set[int]  # inputs copied back in this capture
    by_index: dict[int, InputRange] = attrs.field(init=False)
    overlaps: dict[int, set[int]] = attrs.field(init=False)
    written_by_jit: set[int] = attrs.Factory(set)  # inputs a jit launch writes through a pointer

    def __attrs_post_init__(self) -> None:
        self.by_index = {r.index: r for r in self.inputs}
        self.overlaps = overlapping_inputs(self.inputs)

    def require_staging(self, index: int, reason: str, copy_back: bool = False) -> None:
        """Input ``index`` cannot be patched: it must be staged (and copied back when written)
        in the next capture, where this one did not already."""
        self.plan.reasons.setdefault(index, []).append(reason)
        if index not in self.staged:
            self.plan.needs_staging.add(index)
        if copy_back and index not in self.copied_back:
            self.plan.needs_copy_back.add(index)

    def require_staging_of_every_input(self, reason: str) -> None:
        for owner in self.inputs:
            self.require_staging(owner.index, reason, copy_back=True)

    def stage_pointed_into(self, owner: InputRange, param: ParamView, reason: str) -> None:
        """Stage an input a pointer parameter points into (copied back where the launch may
        write through the pointer)."""
        self.require_staging(owner.index, reason, copy_back=not param.read_only)
        if not param.read_only:
            self.written_by_jit.add(owner.index)

    def stage_inputs_foreign_nodes_touch(self, nodes: Sequence[NodeView], scanned: bool) -> None:
        """Stage every input a node other than a jit launch's may reach (every input, where
        a node's addresses cannot be read)."""
        jit_nodes = {node for _, node in self.plan.matches}
        foreign = [
            node for node in nodes if node.index not in jit_nodes and node.kind in ("kernel", "memcpy", "memset")
        ]
        readable = list(map(addresses_readable, foreign))
        scanned_nodes = list(itertools.compress(foreign, readable))
        reached = iter(inputs_reached_by_group(self.inputs, *addresses_of(scanned_nodes), len(scanned_nodes)))
        unknown_kernel = False
        for node, known in zip(foreign, readable):
            if not known:
                if node.kind == "kernel":
                    unknown_kernel = True
                else:
                    self.require_staging_of_every_input(
                        f"a {node.kind} node whose addresses cannot be read may touch it"
                    )
                continue
            for owner in next(reached):
                if owner.index not in self.staged:
                    self.require_staging(owner.index, f"a non-jit {node.kind} node reads or writes it", copy_back=True)
        if unknown_kernel or not scanned:
            self.require_staging_of_every_input("a kernel node whose parameters cannot be read may touch it")

    def stage_inputs_torch_touches(self, torch_read: set[int], torch_written: set[int]) -> None:
        """Stage the inputs torch ops read or write: their kernels are not ours to patch."""
        for index in torch_read:
            if index in self.by_index:
                self.require_staging(index, "a torch op reads it", copy_back=index in torch_written)
        for index in torch_written:
            if index in self.by_index:
                self.require_staging(index, "a torch op writes it", copy_back=True)

    def copy_back_what_jit_writes(self) -> None:
        """An input to be staged that a jit launch writes must be copied back too."""
        for index in self.written_by_jit & self.plan.needs_staging:
            if index not in self.copied_back:
                self.plan.needs_copy_back.add(index)

    def refuse_written_overlaps(self, torch_written: set[int]) -> None:
        """Staged buffers are separate copies: they keep overlapping inputs apart, which is
        exact only while nothing writes them. Refuse before any graph of that kind is
        launched (the plan's other decisions are still made)."""
        written = torch_written | self.written_by_jit | self.copied_back | self.plan.needs_copy_back
        for index, partners in self.overlaps.items():
            if index in written and partners:
                self.plan.failure = (
                    f"input {self.by_index[index].path} overlaps "
                    f"{', '.join(self.by_index[p].path for p in sorted(partners))} "
                    "and is written: its aliasing cannot be reproduced by a graph"
                )

    def choose(self) -> None:
        """What each input became in this capture: staged, rebound, or not reached at all."""
        bound = {b.input for b in self.plan.pointers}
        for r in self.inputs:
            self.plan.choices[r.index] = STAGED if r.index in self.staged else REBOUND if r.index in bound else UNUSED


@attrs.define
class _Binder:
    """What one :func:`build_plan` patches in each jit launch's node: pointers, scalars, grid
    sizes, and the index checks every replay makes. A pointer that cannot follow its input
    leaves the input to ``stager``.

    A step that finds the capture unusable raises :class:`_Refused`; the plan keeps what the
    steps before had filled in."""

    plan: Plan
    launches: Sequence[LaunchView]
    stager: _Stager
    # where inputs_at places an address in some input (_placed_bounds)
    placed: list[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.placed = _placed_bounds(self.stager.inputs)

    def depends_on_dynamic(self, launch: LaunchView, args: Sequence[int], what: str) -> bool:
        """Whether a value computed from jit arguments ``args`` changes from replay to replay
        (it depends on a dynamic scalar): refused where replay cannot recompute it."""
        if not (args and launch.dynamic_args and not launch.dynamic_args.isdisjoint(args)):
            return False  # depends on constants only: fixed for this graph
        missing = [k for k in args if k not in launch.scalar_sources]
        if missing:
            raise _Refused(f"{launch.kernel}: {what} depends on arguments {missing} whose values replay cannot follow")
        return True

    def recompute_arguments(self, launch_number: int, launch: LaunchView, needed: set[int]) -> None:
        """Replay rebuilds the jit arguments ``needed`` of a launch from the dynamic leaves."""
        self.plan.arguments[launch_number] = _arguments_source(launch, needed)
        self.plan.constants.update(launch.constants)

    def bind_launch(self, launch_number: int, node_index: int) -> None:
        """Bind the pointers, scalars and grid sizes of a jit launch to its graph node. (A
        launch without dynamic arguments has no scalar or grid size to recompute, and its
        pointers into no input, at a fixed offset, are left as recorded: both answered here,
        without a call, as :meth:`bind_pointer` would answer them.)"""
        launch = self.launches[launch_number]
        pointers, scalars, read_pointers = _param_kinds(launch.params)
        needed: set[int] = set()
        if pointers:
            placed, own = self.placed, self.staging_copy_address(launch)
            for param, address in zip(pointers, read_pointers(launch.param_bytes)):
                if param.offset_scalar_args or bisect.bisect_right(placed, address) & 1 or address == own:
                    needed |= self.bind_pointer(launch, launch_number, node_index, param)
        if launch.dynamic_args:
            for param in scalars:
                needed |= self.bind_scalar(launch, launch_number, node_index, param)
            for config in launch.config:
                needed |= self.bind_grid(launch, launch_number, node_index, config)
        if needed:
            self.recompute_arguments(launch_number, launch, needed)

    def staging_copy_address(self, launch: LaunchView) -> int | None:
        """The address of replay's own staging copy of the launch's input (None: it has none)."""
        own = self.stager.by_index.get(launch.staging_input) if launch.staging_input is not None else None
        return None if own is None else own.lo

    def pointer_owners(self, launch: LaunchView, address: int) -> tuple[list[InputRange], bool]:
        """The inputs a pointer points into, and whether it is replay's own staging copy of
        its launch's input (bound to that input, overlaps or not)."""
        staging_copy = address == self.staging_copy_address(launch)
        if staging_copy:  # our own copy of this very input: bound to it, overlaps or not
            return [self.stager.by_index[launch.staging_input]], True
        return inputs_at(self.stager.inputs, address), False

    def bind_pointer(self, launch: LaunchView, launch_number: int, node_index: int, param: ParamView) -> set[int]:
        """Rebind a pointer into exactly one input; stage the inputs it may point into where
        that is ambiguous. Returns the jit arguments its offset is recomputed from."""
        (address,) = _POINTER.unpack_from(launch.param_bytes, param.offset)
        owners, staging_copy = self.pointer_owners(launch, address)
        dynamic = bool(param.offset_scalar_args) and self.depends_on_dynamic(
            launch, param.offset_scalar_args, f"the offset of pointer {param.index}"
        )
        if dynamic:
            _refuse_dynamic_offset(launch, param, owners)
        if len(owners) == 1 and (owners[0].index not in self.stager.overlaps or staging_copy):
            # (a staged input's own memory is reached only by our staging copies,
            # whose pointers must follow the input like any other)
            place = _PointerPlace(launch_number, node_index, address, owners[0], dynamic, staging_copy)
            return self.bind_to_input(launch, param, place)
        if owners:
            if dynamic:
                raise _Refused(
                    f"{launch.kernel}: pointer parameter {param.index} points into overlapping inputs at an "
                    "offset computed from a dynamic scalar"
                )
            for owner in owners:
                self.stager.stage_pointed_into(
                    owner, param, f"it overlaps another input and {launch.kernel} points into it"
                )
        return set()

    def bind_to_input(self, launch: LaunchView, param: ParamView, place: _PointerPlace) -> set[int]:
        """Rebind a pointer into one input, unless the tensor it came from reaches beyond the
        input (refused) or may be another holder's (the input staged)."""
        owner = place.owner
        extent = None if place.staging_copy else launch.extents.get(param.index)
        if extent is not None and not (owner.lo <= extent.lo and extent.hi <= owner.hi):
            raise _Refused(
                f"{launch.kernel}: pointer parameter {param.index} points into input {owner.path} but came from "
                "a tensor that reaches beyond it (a global or closure tensor holding the input, or a view wider "
                "than it): replay cannot tell whether it moves with the input"
            )
        if extent is not None and extent.doubt:
            return self.stage_for_doubt(launch, param, owner, extent.doubt)
        self.plan.pointers.append(
            PointerBinding(
                place.node,
                place.launch,
                param.index,
                param.offset,
                owner.index,
                place.address - owner.lo,
                place.dynamic,
                param.byte_offset,
                param.offset_evaluate if place.dynamic else None,
                param.aligned,
            )
        )
        if not param.read_only:
            self.stager.written_by_jit.add(owner.index)
        return set(param.offset_scalar_args) if place.dynamic else set()

    def stage_for_doubt(self, launch: LaunchView, param: ParamView, owner: InputRange, doubt: str) -> set[int]:
        """A pointer into an input that may be another holder's of the input's memory: the
        input is staged, so that in the next capture the region's own views of it point into
        the graph's buffer, and a pointer still into the caller's memory is the other holder's
        (the capture refuses it: recording's staged inputs reached otherwise). Already staged,
        this pointer is such a one: refused."""
        if owner.index in self.stager.staged:
            raise _Refused(
                f"{launch.kernel}: pointer parameter {param.index} points into input {owner.path}, but {doubt}: "
                "replay cannot tell whether the pointer moves with the input"
            )
        self.stager.stage_pointed_into(
            owner,
            param,
            f"{launch.kernel} points into it through another tensor, which another holder of its memory may have given",
        )
        return set()

    def bind_scalar(self, launch: LaunchView, launch_number: int, node_index: int, param: ParamView) -> set[int]:
        """Recompute a scalar parameter computed from dynamic scalars. Returns the jit
        arguments it is recomputed from."""
        if not self.depends_on_dynamic(launch, param.scalar_args, f"scalar parameter {param.index}"):
            return set()
        self.plan.scalars.append(
            ScalarBinding(
                node_index,
                launch_number,
                param.index,
                param.offset,
                param.fmt,
                param.evaluate,
                param.convert,
                param.expression or "",
            )
        )
        return set(param.scalar_args)

    def bind_grid(self, launch: LaunchView, launch_number: int, node_index: int, config: ConfigView) -> set[int]:
        """Recompute a grid size computed from dynamic scalars (other launch dimensions
        cannot be patched). Returns the jit arguments it is recomputed from."""
        if not self.depends_on_dynamic(launch, config.scalar_args, f"launch dimension {config.field}"):
            return set()
        if not config.field.startswith("grid"):
            raise _Refused(
                f"{launch.kernel}: its {config.field.replace('_', ' ')} size is computed from a dynamic scalar; "
                "replay patches grid sizes only (pass that value as a plain argument: one graph per value)"
            )
        self.plan.configs.append(
            ConfigBinding(node_index, launch_number, config.field, config.evaluate, config.expression)
        )
        return set(config.scalar_args)

    def bind_index_checks(self, launch_number: int) -> None:
        """Check, every replay, the launch's index bounds computed from dynamic scalars (the
        call state's checks, launched or not)."""
        launch = self.launches[launch_number]
        needed: set[int] = set()
        for check in launch.checks:
            if not self.depends_on_dynamic(launch, check.scalar_args, "an index"):
                continue
            needed |= set(check.scalar_args)
            self.plan.checks.append(CheckBinding(launch_number, check.value, check.size))
        if needed:
            needed |= {k for k, s in enumerate(self.plan.arguments.get(launch_number, ())) if s is not None}
            self.recompute_arguments(launch_number, launch, needed)


class _PointerPlace(NamedTuple):
    """Where a pointer bound to one input sits: its launch and node, its recorded address,
    the input, whether its offset is recomputed every replay, and whether it is replay's own
    staging copy of that input."""

    launch: int
    node: int
    address: int
    owner: InputRange
    dynamic: bool
    staging_copy: bool


def _refuse_dynamic_offset(launch: LaunchView, param: ParamView, owners: Sequence[InputRange]) -> None:
    """A pointer whose offset a dynamic scalar computes can only follow an input, and only
    where the kernel assumed nothing of its alignment."""
    if not owners:
        raise _Refused(
            f"{launch.kernel}: pointer parameter {param.index} points into memory the region allocated, "
            "at an offset computed from a dynamic scalar; replay rebinds only region inputs"
        )
    if param.aligned is not None:
        raise _Refused(
            f"{launch.kernel}: pointer parameter {param.index} was specialized on its alignment and its "
            "offset is computed from a dynamic scalar"
        )


def build_plan(
    inputs: Sequence[InputRange],
    launches: Sequence[LaunchView],
    nodes: Sequence[NodeView],
    *,
    staged: set[int],
    copied_back: set[int],
    torch_read: set[int],
    torch_written: set[int],
    scanned: bool = True,
) -> Plan:
    """Decide, for one capture, what each input becomes and which parameters to patch.

    ``staged``/``copied_back``: inputs that were staged (and copied back) in this capture.
    ``torch_read``/``torch_written``: inputs the observer saw torch ops read/write.
    ``scanned``: whether every foreign kernel's parameters could be read (False on HIP).
    """
    plan = Plan()
    plan.retry_later = _skipped_with_a_dynamic_grid(launches)
    if plan.retry_later:
        return plan
    plan.matches, plan.failure = match_launches(launches, nodes)
    if plan.failure:
        return plan
    stager = _Stager(plan, inputs, staged, copied_back)
    binder = _Binder(plan, launches, stager)
    try:
        for launch_number, node_index in plan.matches:
            binder.bind_launch(launch_number, node_index)
        for launch_number, launch in enumerate(launches):  # launched or not: the call state checked
            if launch.checks:
                binder.bind_index_checks(launch_number)
    except _Refused as refused:
        plan.failure = refused.reason
        return plan
    stager.stage_inputs_foreign_nodes_touch(nodes, scanned)
    stager.stage_inputs_torch_touches(torch_read, torch_written)
    stager.copy_back_what_jit_writes()
    stager.refuse_written_overlaps(torch_written)
    if plan.needs_staging or plan.needs_copy_back:
        return plan  # the caller re-records with these staged; choices come from that capture
    stager.choose()
    return plan
