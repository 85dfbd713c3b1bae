"""Sessions and regions: keys, the recording policy, replay, fallbacks, bounds.

    with capture() as cap:                 # a session: memory pool, graphs, policy, stats
        step = cap.region(decode_step)     # also usable as a decorator
        for batch in batches:
            logits = step(batch.tokens, kv_cache, replay.dynamic(pos))
    print(cap.report())

Per call: the recorded keys of the region are checked first by their guards (one C++ tensor
check per tensor argument); otherwise the key is computed. A new key runs eagerly (compiling
what it needs) until it has been called more than ``record_after`` times recently and the
cache policy admits it (replay.admission: recent frequency, ``max_graphs``, the recording
budget), then is recorded into a graph, then replayed. A key whose capture fails runs eagerly
from then on, with one warning naming the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch

import jitcore
from jitcore.backends import compiled_helpers_enabled, get_backend
from jitcore.codegen import never
from jitcore.errors import GlobalDriftError
from jitcore.guards import ArgumentCheck, make_guard
from replay import buckets, instrumentation, observe, padding, polymorphic, recording, region_keys
from replay.admission import Admission, CompactionRule
from replay.dynamic import Dynamic
from replay.errors import DynamicScalarError, ReplayError, ReplayWarning, SessionClosedError
from replay.graph import (
    MISMATCH,
    RecordedGraph,
    compile_function,
    generated_replay,
    guard_outputs,
    measure_with_settings_check,
    measure_without_checks,
)
from replay.observe import op_observer
from replay.output_slots import OutputSlots
from replay.policy import Policy
from replay.rebinding import STAGED
from replay.stats import InputChoice, Stats, report


class EntryState(enum.Enum):
    """Where a key stands (its value is what ``report()`` shows)."""

    WARMING = "warming"  # runs eagerly until admitted (replay.admission)
    PENDING = "recorded, not yet analysed"  # captured; its next call analyses the graph
    RECORDED = "recorded"  # replays
    EAGER_ONLY = "eager-only"  # its capture failed: runs eagerly from now on


WARMING, PENDING, RECORDED, EAGER_ONLY = EntryState


class _Decision(enum.Enum):
    """What admission lets a call of a key without a graph do."""

    WARM = "runs eagerly, warming up"
    OBSERVE = "runs eagerly, warming up, observed"
    REFUSED = "runs eagerly, not admitted"
    TOO_RARE = "runs eagerly, its recent calls would not pay for a recording"
    DEFERRED = "runs eagerly, the recording budget is spent"
    RECORD = "is recorded"


_WARM, _OBSERVE, _REFUSED, _TOO_RARE, _DEFERRED, _RECORD = _Decision
_MISS = object()
#: Argument types a flat call may hold for :meth:`Region._eager_flat`: constants that are
#: leaves of the key as they are (hashable, compared by value).
_PLAIN_CONSTANTS = region_keys.PLAIN_CONSTANTS
#: ``with`` it around an eager run: it may load kernels, so not while another thread captures
#: (jitcore.recorder.CaptureExclusion). The one shared-holding object, looked up once.
_SHARED_CAPTURE_EXCLUSION = recording.CAPTURES.shared()

try:  # a region's call and its flat eager path in C (csrc/replay_eager.c; optional, built by setup.py)
    from replay._eager import EagerGate, RegionCall
except ImportError:
    EagerGate = RegionCall = None


def _native_enabled() -> bool:
    """Whether replay._eager was built and ``JITCORE_NATIVE`` does not turn compiled helpers off."""
    return EagerGate is not None and compiled_helpers_enabled()


def _plain_when_unpadded(policy: Policy) -> bool:
    """Whether a call whose ``replay.padded`` markers need no padding runs as the plain call
    before the padded path (the gate in C, or Region._call_padded without it): where the
    session has buckets, and neither verifies padded calls nor serves them polymorphically."""
    return policy.buckets is not None and not policy.verify_every and not policy.polymorphic


def _holds_a_pad_of(buffer: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether a graph's staged ``buffer`` may take ``tensor`` padded (Region._pad_in_place).
    The pre-key that found the graph holds shapes only, and its guard sees the buffer in the
    argument's place, so the buffer stands for the padded tensor and must be what a pad of it
    would be: of its dtype and device (the padded shape by the pre-key; contiguity, plain
    type and no grad by padding.pad_into). A call of the same shapes in int32 or float64 has
    a graph of its own, or none: never a float32 graph's buffer."""
    return buffer.dtype is tensor.dtype and buffer.device == tensor.device


def _eager_gate(region: Region):
    """The region's flat eager path in C, or None where it was not built or ``JITCORE_NATIVE=0``
    turns the compiled helpers off (the Python methods then run: same decisions, same counts)."""
    if not _native_enabled():
        return None
    session = region.session
    policy = session.policy
    unpadded_markers = _plain_when_unpadded(policy)  # the gate takes those markers as their tensors
    return EagerGate(
        region=region,
        session=session,
        admission=session.admission,
        sketch=session.admission.sketch,
        budget=session.admission.budget,
        counters=session.counters,
        forgotten=region.forgotten,
        quiet=region.quiet,
        entry_shapes=region.entry_shapes,
        table=region.fast,
        fn=region.fn,
        exclusion=_SHARED_CAPTURE_EXCLUSION,
        specs=tuple(_FLAT_SPECS),
        tensor_type=torch.Tensor,
        dynamic_type=Dynamic,
        dynamic_mark=_DYNAMIC_MARK,
        plain=_PLAIN_CONSTANTS,
        miss=_MISS,
        clock=time.perf_counter,
        mask=EAGER_TIMING_MASK,
        settled=EAGER_TIMING_SETTLED,
        settled_mask=EAGER_TIMING_MASK_SETTLED,
        padded_type=buckets.Padded if unpadded_markers else None,
        buckets=frozenset(policy.buckets or ()),
        largest=max(policy.buckets or (0,)),
        touch=session.lru.move_to_end,
        declined=MISMATCH,
    )


log = logging.getLogger("replay")

#: The flat eager path times one call in ``EAGER_TIMING_MASK + 1`` (admission's payback rule
#: needs what an eager call usually costs, not every call's time), and from the region's
#: ``EAGER_TIMING_SETTLED``-th eager run on one in ``EAGER_TIMING_MASK_SETTLED + 1``: by then
#: the estimate has had 32 samples, and a timed call costs the loop a call of Python from the
#: C eager path (Region._eager_took), which took 2 to 3 us a call of a loop that runs mostly
#: eagerly when one call in eight was timed (a probe on the CPU machine, a 6-layer region).
EAGER_TIMING_MASK = 7
EAGER_TIMING_SETTLED = 256
EAGER_TIMING_MASK_SETTLED = 63


def _timed_run(runs: int) -> bool:
    """Whether a region's ``runs``-th eager run of the flat path is timed."""
    return not runs & (EAGER_TIMING_MASK if runs < EAGER_TIMING_SETTLED else EAGER_TIMING_MASK_SETTLED)


#: The quiet bound (Region._refresh_quiet) is computed for an eager cost this many times the
#: region's estimate, and asked again only when the estimate leaves the band around the
#: estimate it was computed for (that divided by this, to that times this). Why: the estimate moves at
#: nearly every timed call (one in eight of a loop that runs mostly eagerly), and asking the
#: payback rule again cost 4 us (peers, counts) each time, a Python call chain inside the C
#: eager path (about 2 us a call in a loop whose own work leaves the caches cold). Why it
#: stays exact: what pays back only grows with the eager cost (a longer eager call saves more
#: per replay), so no count below a bound computed for a higher cost pays back at a lower one;
#: the counts between it and the exact bound ask the whole rule, as every count above does.
QUIET_HEADROOM = 1.125

#: Entries a region keeps for keys without a graph (eager-only keys, evicted ones), beyond its
#: graphs: the least recently called go first, their counts kept in the region's totals.
MAX_IDLE_ENTRIES = 256

#: Keys listed one by one in ``Session.report()``; the rest are summed up in one row.
REPORT_KEYS = 24


class _RegionDrift(Exception):
    pass


def _raise_region_drift(name: str) -> None:
    raise _RegionDrift(name)


_DYNAMIC_MARK = ("replay.dynamic",)

#: The argument structure of a flat call of n arguments, made once for the usual arities
#: (the eager path of every flat call needs it).
_FLAT_SPECS = tuple((region_keys.FLAT, count) for count in range(32))


class Entry:
    """One key of one region: its state and, once recorded, its graph."""

    __slots__ = (
        "unanalysed",
        "copy_back_hint",
        "generation",
        "observed_clean",
        "eager_runs",
        "graph",
        "uses_rng",
        "rng_epoch",
        "analysed_staging",
        "later",
        "replays_before",
        "guard",
        "key",
        "pre_key",
        "counted",
        "reason",
        "region",
        "retries",
        "stage_hint",
        "state",
    )

    def __init__(self, region: Region, key: tuple, counted: tuple):
        self.region = region
        self.key = key
        self.counted = counted  # what admission counts its calls under (see Region._counted)
        self.state = WARMING
        self.eager_runs = 0
        self.graph: RecordedGraph | None = None
        self.guard: Callable | None = None
        self.stage_hint: set[int] = set()
        self.copy_back_hint: set[int] = set()
        self.reason = ""
        self.retries = 0
        self.generation = 0  # replays so far: outputs handed out remember it (check_stale)
        self.unanalysed = None  # its capture, waiting for the analysis (state PENDING)
        self.observed_clean = False  # the warm-up ran under the observer and no torch op touched an input
        self.pre_key: tuple | None = None
        self.uses_rng = False  # the graph advances a generator's offset (it draws random numbers)
        self.rng_epoch = 0  # recording.GENERATOR_EPOCH when its graph was captured
        self.analysed_staging = False  # the staging hints come from an analysis of a graph
        self.later = 0  # recordings the analysis asked to redo later
        self.replays_before = 0  # replays by graphs of this key released since

    @property
    def replays(self) -> int:
        return self.replays_before + (self.graph.replays if self.graph is not None else 0)


@attrs.define
class Hints:
    """What the keys of one argument structure (spec) of a region taught about its inputs:
    which ones torch ops read or write (to be staged, or copied back), from an observed
    warm-up and from analyses of their graphs. A new key of the spec starts from them, so
    its first calls need no observer of their own (they cost what eager costs) and its first
    capture rarely needs a second. Hints only choose what a first capture stages: the
    analysis of every graph still checks each input exactly."""

    observed_key: tuple | None = None  # the key whose warm-up ran under the observer
    stage: set[int] = attrs.Factory(set)
    copy_back: set[int] = attrs.Factory(set)
    clean: bool = False  # the observed warm-up saw no torch op touch an input
    #: Why keys of this structure run eagerly under grad mode ("" if nothing says so): the
    #: observed warm-up ran under grad mode, none of its tensor arguments required grad, and
    #: outputs did (weights the region reads that require grad, as module parameters do).
    autograd: str = ""


@attrs.define
class _QuietBound:
    """Below which recent count (``below``) a call of a region's keys without an entry only
    warms or is too rare, valid while the budget's version is ``version`` (-1: ask the rule)
    and the region's eager estimate stays in the band around ``computed_for`` (see
    Region._refresh_quiet, QUIET_HEADROOM). Slotted (attrs): the C gate reads it on every
    eager call."""

    below: int = 0
    version: int = -1
    computed_for: float = 0.0


@attrs.define
class _Forgotten:
    """A region's calls that no entry holds: keys that never got one (called too rarely to be
    recorded, or without a GPU) and entries dropped to keep the bookkeeping bounded."""

    keys: int = 0  # entries dropped
    eager_runs: int = 0
    replays: int = 0


class _KeyMark(enum.Enum):
    """Key elements the session adds to region_keys' key (after the leaves' elements)."""

    #: followed by the indices of the tensor leaves that require grad (see _region_key)
    REQUIRES_GRAD = "requires grad"


def _region_key(device: int, spec: object, leaves: Sequence, paths: Sequence[str]) -> tuple:
    """The full key of a call (region_keys.region_key), plus which tensor arguments require
    grad, where any does: ``(..., (_KeyMark.REQUIRES_GRAD, indices))``.

    Why: a graph cannot carry autograd (a replay hands out detached views of its memory), so
    a call whose tensors require grad must never find the key of a call whose tensors do not
    (the finding: a graph recorded for ``x`` served ``w = x.requires_grad_()`` under grad mode
    and returned an output without ``grad_fn``: gradients silently lost). The tensor leaf's
    own signature (jitcore's lean static signature) does not hold ``requires_grad``; the fast
    path's guards compare it already (jitcore.guards), so both paths tell the two apart. A
    call with no tensor requiring grad keeps region_keys' key unchanged. Grad and inference
    mode are in every key already (its torch settings)."""
    key = region_keys.region_key(device, spec, leaves, paths)
    for leaf in leaves:  # a plain loop: about 0.1 us a tensor (a generator cost 0.5 us more per key)
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            grads = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad)
            return (*key, (_KeyMark.REQUIRES_GRAD, grads))
    return key


def _grad_leaves(key: tuple) -> tuple[int, ...]:
    """The tensor leaves of ``key`` that require grad (see :func:`_region_key`)."""
    last = key[-1] if len(key) > region_keys.LEAVES_START else None
    return last[1] if last.__class__ is tuple and last and last[0] is _KeyMark.REQUIRES_GRAD else ()


def _outputs_requiring_grad(outputs: object) -> list[str]:
    """Where in a region's ``outputs`` tensors require grad (``output[0]``), as the recording
    refuses them (recording.own_outputs); outputs it cannot walk are left to the recording."""
    try:
        _spec, leaves, paths = region_keys.flatten((outputs,), {}, walk_dataclasses=True)
    except (TypeError, ReplayError):  # (the recording refuses such outputs with its reason)
        return []
    return [
        path.replace("args[0]", "output", 1)
        for leaf, path in zip(leaves, paths)
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad
    ]


#: Leaves admission counts as they are (Region._counted): values that hold no other object
#: (an enum member lives as long as its class anyway).
_VALUE_LEAVES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum, np.generic)
#: How deep Region._counted looks into constants (dataclasses, tuples of their fields).
_COUNT_DEPTH = 8


class _WeakIdentity:
    """An object's identity in admission's counts, without keeping the object alive.

    Why: the counts keep up to two windows of keys (``2 * max(1024, 16 * max_graphs)``), and a
    constant argument that holds tensors (a ``Batch`` object new every step) kept every batch
    of the window alive, memory eager would have freed at once (500 steps held 500 batches).
    Equal while both name the same live object; once the object is gone, equal to nothing new:
    a later object at the same address is another object, which the strong reference this
    replaces would have told apart too (it kept the address taken). So counts are the same
    as before, for objects compared by identity."""

    __slots__ = ("_ref", "_hash")

    def __init__(self, target: object):
        self._ref = weakref.ref(target)  # TypeError where the type has no weak references
        self._hash = id(target)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not _WeakIdentity:
            return NotImplemented
        target = self._ref()
        return target is not None and target is other._ref()  # type: ignore[attr-defined]


def _count_element(leaf: object, depth: int = 0) -> object:
    """What admission counts a constant leaf under, holding no tensor and no object compared
    by identity (see _WeakIdentity): values as they are; tensors and objects hashed by
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
            return _WeakIdentity(leaf)
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
    TypeError here, as its key would (Region._counted then takes the key, which says why)."""
    hash(leaf)
    return _count_element(leaf)


def _describe_key(key: tuple, limit: int = 96) -> str:
    parts = []
    for element in key[region_keys.LEAVES_START :]:
        if isinstance(element, tuple) and element and element[0] is _KeyMark.REQUIRES_GRAD:
            parts.append(f"requiring grad: leaf {', '.join(map(str, element[1]))}")
        elif isinstance(element, tuple) and len(element) == 6 and isinstance(element[1], tuple):
            parts.append(f"{element[0]}[{','.join(map(str, element[1]))}]")
        elif isinstance(element, tuple) and element and element[0] == "dynamic":
            parts.append(f"dynamic {element[1]}")
        else:
            parts.append(repr(element[1] if isinstance(element, tuple) and len(element) == 2 else element))
    text = "(" + ", ".join(parts) + ")"
    return text if len(text) <= limit else text[: limit - 4] + " ...)"


class _KeyText:
    """A key as :func:`_describe_key` words it, worded only when a log record is emitted
    (eviction storms and every recording log one)."""

    __slots__ = ("key",)

    def __init__(self, key: tuple) -> None:
        self.key = key

    def __str__(self) -> str:
        return _describe_key(self.key)


#: The most sizes a polymorphic region remembers a state of (a variant, or why it is padded).
MAX_VARIANT_STATES = 1024
#: Marks a size's count in admission's sketch, apart from its key's (see _call_polymorphic).
_VARIANT = "variant"


class Region:
    """A function whose calls are recorded into graphs and replayed, key by key."""

    def __init__(self, session: Session, fn: Callable, name: str | None = None):
        if not callable(fn):
            raise TypeError(f"region expects a callable, got {fn!r}")
        self.session = session
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", type(fn).__qualname__)
        # keys that were recorded at least once, least recently called first
        self.entries: OrderedDict[tuple, Entry] = OrderedDict()
        self.forgotten = _Forgotten()  # calls of keys that have (or kept) no entry
        self.refusals: set[str] = set()  # reasons of calls no key could be made for, warned once each
        self.padded_calls = 0  # calls that took the padded path (for verify_every)
        self.eager_seconds = 0.0  # what an eager call usually takes, 0 until known (see _eager_took)
        self.eager_sample = 0.0  # the same, from the first timed call on
        self.quiet = _QuietBound()  # counts that only warm or are too rare (see _refresh_quiet)
        self.hints: dict[object, Hints] = {}  # spec -> what its keys taught about the inputs
        self.entry_shapes: dict[tuple, int] = {}  # Region._counted shapes -> entries that have them
        self.snapshot: jitcore.GlobalsSnapshot | None = None
        # recorded keys of flat calls, by a cheap pre-key (tensor shapes, constants); each
        # candidate's guard then checks everything the key holds
        self.fast: dict[tuple, list[tuple]] = {}  # pre-key -> [(guard, replay, entry)]
        # the flat eager path: replay._eager's gate where it was built, else the methods below
        gate = self._gate = _eager_gate(self)
        self._eager_entry: Callable = gate or self._eager_flat  # (args) -> result or _MISS
        self._eager_with_shapes: Callable = gate.with_shapes if gate else self._eager_flat_shapes
        # the call's dispatcher: with the gate, always the gate (it looks recorded keys up itself
        # and tries a hit's candidates itself); without it, the generated function once keys are
        # recorded (_rebuild_fast)
        self._fast: Callable = self._eager_entry
        self._fast_keys: Callable | None = None  # the generated dispatch of recorded keys (_rebuild_fast)
        # the check of the region's globals a hit makes before replaying, on its own (the gate
        # calls it; _fast_keys has it inline); None while there is nothing to check
        self._region_drift: Callable | None = None
        self._fast_shape: tuple | None = None  # (arities, globals snapshot) _fast_keys was generated for
        # the output memory of this region's graphs and unanalysed captures, merged
        # (see _replay_writes); None when a graph or capture came or went since it was built
        self._output_ranges: region_keys.MergedRanges | None = None
        # polymorphic sessions: unpadded key of a padded call -> its VariantGraph, or why the
        # bucket's graph cannot serve it (str); (bucket, argument structure) -> the entry whose
        # graph the sizes of that bucket are observed against
        self.variants: dict[tuple, object] = {}
        self.bucket_bases: dict[tuple, Entry] = {}
        self._stream_now: Callable[[int], int] | None = None  # the current stream's handle (_pad_in_place)
        self.said_autograd = False  # the ReplayWarning of keys that need autograd was given (_refuse_autograd)
        functools.update_wrapper(self, fn)

    # --- the call ------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """Replay, or run eagerly. (Where replay._eager was built, RegionCall takes this
        method's place: see PYTHON_REGION_CALL below the class.)"""
        if not kwargs:
            try:
                result = self._fast(args)  # a replay, or the eager path of a flat call
            except _RegionDrift:
                return self._rekey(args, kwargs)
            if result is not _MISS:
                return result
        return self._call(args, kwargs)

    def _eager_flat(self, args: tuple) -> object:
        """``_fast`` of a region without recorded flat keys: :meth:`_eager_flat_shapes` once
        the call's shapes are known (``_MISS`` for arguments other than tensors and plain
        constants: the full path takes those)."""
        pre = []
        try:
            for arg in args:
                kind = arg.__class__
                if kind is torch.Tensor:
                    pre.append(arg.shape)  # a strided nested tensor raises: the full path refuses it
                elif kind in _PLAIN_CONSTANTS:
                    pre.append(arg)
                else:
                    return _MISS
        except RuntimeError:
            return _MISS
        return self._eager_flat_shapes(args, tuple(pre))

    def _eager_flat_shapes(self, args: tuple, pre: tuple) -> object:
        """The call that most often runs eagerly (positional tensors and plain constants, with
        shapes no key has an entry for: a warm-up, a refused or postponed key, a length seen
        once) decided and run without flattening, without ``Dynamic`` or padded handling and
        without rebuilding the arguments, so it costs little more than eager. ``pre`` is the
        call's pre-key (each tensor's shape, each constant), computed once by the caller:
        :meth:`_eager_flat`, or the generated dispatch after its lookup of recorded keys
        missed (with replay._eager, the gate in C does all of this). Anything else, and a
        call admission lets record or observe, takes the full path (``_MISS``, or
        :meth:`_keyed_call` with the decision already counted). Same decisions, same counts
        as :meth:`_call`."""
        session = self.session
        if session.closed or not session._gpu:  # can_record(), read directly (every eager call)
            return _MISS  # the full path raises, or says once that everything runs eagerly
        count = len(args)
        spec = _FLAT_SPECS[count] if count < len(_FLAT_SPECS) else (region_keys.FLAT, count)
        shapes = (spec, pre)
        if shapes in self.entry_shapes:
            return _MISS  # a key with these shapes has an entry: its full key decides
        counted = (self, shapes)
        admission = session.admission
        count = admission.called(counted)
        record_after = admission.record_after
        quiet = self.quiet
        if count < quiet.below and count != record_after and quiet.version == admission.budget.version:
            # warming or too rare, as _decide would say (see _refresh_quiet), without asking it
            if count > record_after:
                session.counters.too_rare += 1
            return self._run_flat_eagerly(args)
        return self._eager_decide(args, counted, spec, count)

    def _eager_decide(self, args: tuple, counted: tuple, spec: object, count: int) -> object:
        """The flat eager path's call whose count needs the whole rule (:meth:`_decide`): it
        may record or be observed (the full path), else it runs eagerly."""
        decision = self._decide(counted, spec, count)
        if decision is _RECORD or decision is _OBSERVE:
            spec, leaves, paths = region_keys.flatten(args, {})
            if decision is _OBSERVE:
                return self._run_eagerly(decision, spec, leaves, paths)
            return self._keyed_call(args, {}, spec, leaves, paths, counted, decision)
        return self._run_flat_eagerly(args)

    def _run_flat_eagerly(self, args: tuple) -> object:
        """Run a flat call eagerly, counted; some timed (see ``EAGER_TIMING_MASK``)."""
        self.session.counters.eager_runs += 1  # _count_eager(None), inline
        forgotten = self.forgotten
        forgotten.eager_runs += 1
        if not _timed_run(forgotten.eager_runs):
            with _SHARED_CAPTURE_EXCLUSION:  # may load kernels: not while another thread captures
                return self.fn(*args)
        with _SHARED_CAPTURE_EXCLUSION:
            started = time.perf_counter()
            result = self.fn(*args)
        self._eager_took(time.perf_counter() - started)
        return result

    def _rebuild_fast(self) -> None:
        """Generate ``fast(args, pre=None, candidates=None)``: for each arity with recorded
        keys, compute the pre-key and look it up (unless the caller did: ``pre`` and its
        ``candidates``), try each candidate's guard, check the region's globals, touch the LRU,
        replay. One function, so a replayed call pays for no other Python call than the guard
        and the replay itself. When no recorded key fits, a call of tensors and plain constants
        goes on to the eager path with the pre-key already computed (:meth:`_eager_flat_shapes`);
        other arities take :meth:`_eager_flat`; anything else returns _MISS (the full path).

        With the gate (replay._eager), the gate computes the pre-key and looks it up in C on
        every call: a miss, the usual call of a loop whose shapes rarely repeat, goes to the
        eager path without entering Python at all, and a hit tries the candidates in C the same
        way (calling ``_region_drift``, the globals check alone, made here too). Without the
        gate, this function is the region's ``_fast``."""
        arities = sorted({len(key) for key in self.fast})
        # the source depends on the arities and the globals snapshot only (the candidates are
        # read from self.fast at call time): a key of a known arity needs no new function
        known = self._fast_shape
        if known is not None and known[0] == arities and known[1] is self.snapshot:
            return
        self._fast_shape = (arities, self.snapshot)
        namespace: dict[str, object] = {
            "_Tensor": torch.Tensor,
            "_Dynamic": Dynamic,
            "_DYN": _DYNAMIC_MARK,
            "_PLAIN": _PLAIN_CONSTANTS,
            "_FAST": self.fast,
            "_MISS": _MISS,
            "_TOUCH": self.session.lru.move_to_end,
            "_DECLINED": MISMATCH,
            "_EAGER": self._eager_with_shapes,
            "_EAGER_FLAT": self._eager_entry,
        }
        drift: list[str] = []
        self._region_drift = None
        if self.snapshot is not None:
            namespace.update(self.snapshot.namespace)
            namespace["_rdrift"] = _raise_region_drift
            drift = self.snapshot.check_lines
            if drift:  # the same check on its own, for the gate's hits (replay._eager)
                checks = {**self.snapshot.namespace, "_rdrift": _raise_region_drift}
                source = "def region_drift():\n" + "".join(f"    {line}\n" for line in drift)
                self._region_drift = compile_function(
                    source, "region_drift", f"globals check of region {self.name}", checks
                )
        lines = ["def fast(args, pre=None, candidates=None):", "    count = len(args)"]
        for count in arities:
            names = [f"a{i}" for i in range(count)]
            parts = "".join(
                f"({n}.shape if {n}.__class__ is _Tensor else (_DYN if {n}.__class__ is _Dynamic else {n})), "
                for n in names
            )
            joined = ", ".join(names)
            plain = " and ".join(f"({n}.__class__ is _Tensor or {n}.__class__ in _PLAIN)" for n in names) or "True"
            lines += [
                f"    if count == {count}:",
                f"        {joined}{',' if count == 1 else ''} = args" if count else "        pass",
                "        if pre is None:",  # else the gate looked it up, and found candidates
                "            try:",
                f"                pre = ({parts})",
                "                candidates = _FAST.get(pre)",
                # unhashable constants; a strided nested tensor, whose .shape raises
                "            except (TypeError, RuntimeError):",
                "                return _MISS",
                "        if candidates is not None:",
                "            for guard, run, entry in candidates:",
                f"                if guard({joined}):",
                *["                    " + line for line in drift],
                "                    _TOUCH(entry)",
                f"                    result = run({joined})",
                "                    if result is not _DECLINED:",  # else another candidate may serve it
                "                        return result",
                f"        if {plain}:",  # no recorded key fits: the eager path, the pre-key known
                "            return _EAGER(args, pre)",
                "        return _MISS",
            ]
        lines.append("    return _EAGER_FLAT(args)")
        source = "\n".join(lines) + "\n"
        dispatch = compile_function(source, "fast", "replay dispatch of a region", namespace)
        self._fast_keys = dispatch
        if self._gate is None:  # no gate: this function dispatches every call
            self._fast = dispatch

    @staticmethod
    def pre_key(leaves: Sequence) -> tuple:
        return tuple(
            leaf.shape if type(leaf) is torch.Tensor else (_DYNAMIC_MARK if isinstance(leaf, Dynamic) else leaf)
            for leaf in leaves
        )

    def _call(self, args: tuple, kwargs: dict):
        session = self.session
        session.check_open()
        if buckets.has_padded(args, kwargs):
            return self._call_padded(args, kwargs)
        try:
            spec, leaves, paths = region_keys.flatten(args, kwargs)
        except region_keys.RefusedKey as refused:  # a dict key no graph may bake
            return self._refused(refused, None, args, kwargs)
        if not session.can_record():
            session.say_eager_once()
            return self._eager(spec, leaves)
        try:
            counted = self._counted(spec, leaves, paths)
        except region_keys.RefusedKey as refused:
            return self._refused(refused, spec, leaves)
        decision = None
        if counted[1] not in self.entry_shapes:
            # No key with these shapes has an entry, so whatever this call's full key is, it
            # has no graph: admission decides before the key (and the globals' drift check)
            # is computed, and a call that runs eagerly costs what eager costs.
            decision = self._decide(counted, spec)
            if decision is not _RECORD:
                return self._run_eagerly(decision, spec, leaves, paths)
        return self._keyed_call(args, kwargs, spec, leaves, paths, counted, decision)

    def _keyed_call(
        self,
        args: tuple,
        kwargs: dict,
        spec: object,
        leaves: list,
        paths: list,
        counted: tuple,
        decision: _Decision | None,
    ):
        """A call that needs its full key: one with an entry, or one admission lets record
        (``decision``, already counted; None when the shapes have an entry)."""
        session = self.session
        if self.snapshot is not None:
            try:
                self.snapshot.check()
            except GlobalDriftError:
                return self._rekey(args, kwargs)
        device = session.current_device()
        try:
            key = _region_key(device, spec, leaves, paths)
        except region_keys.RefusedKey as refused:
            return self._refused(refused, spec, leaves)
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            if entry.state == RECORDED:
                return self._replay(entry, leaves)
            if entry.state == PENDING:
                return self._finish(entry, key, spec, leaves, paths, device)
            if entry.state == EAGER_ONLY:
                return self._eager(spec, leaves, entry)
        if decision is None:
            decision = self._decide(counted, spec)
            if decision is not _RECORD:
                return self._run_eagerly(decision, spec, leaves, paths, entry, key)
        autograd = self._needs_autograd(key, spec, paths) if torch.is_grad_enabled() else ""
        if entry is None:
            entry = self.entries[key] = Entry(self, key, counted)
            self.entry_shapes[counted[1]] = self.entry_shapes.get(counted[1], 0) + 1
            self._bound_entries()
            hints = self.hints.get(spec)
            if hints is not None:
                entry.stage_hint, entry.copy_back_hint = set(hints.stage), set(hints.copy_back)
                entry.observed_clean = hints.clean and hints.observed_key == key
        if autograd:
            return self._refuse_autograd(entry, spec, leaves, autograd)
        return self._record(entry, key, spec, leaves, paths, device)

    def _needs_autograd(self, key: tuple, spec: object, paths: Sequence[str]) -> str:
        """Why a key about to be recorded under grad mode must run eagerly instead ("" if
        nothing says so): tensor arguments that require grad (its key says which), or outputs
        that required grad in its structure's observed warm-up (Hints.autograd). A graph's
        outputs are detached views of its memory: it would return them without ``grad_fn``.
        Outputs requiring grad in a capture are refused by the recording itself
        (recording.own_outputs), for the keys no observed warm-up spoke for."""
        grads = _grad_leaves(key)
        if grads:
            return f"{', '.join(paths[i] for i in grads)} {'requires' if len(grads) == 1 else 'require'} grad"
        hints = self.hints.get(spec)
        return hints.autograd if hints is not None else ""

    def _refuse_autograd(self, entry: Entry, spec: object, leaves: Sequence, why: str):
        """The key runs eagerly from now on (exactly as eager: outputs keep their ``grad_fn``),
        with one ReplayWarning per region saying why and what to do. The key holds grad mode
        and which tensors require grad, so the same shapes under ``torch.no_grad()``, or with
        tensors that do not require grad, are other keys: they record and replay as usual."""
        reason = f"under grad mode {why}; a graph cannot record autograd"
        entry.state = EAGER_ONLY
        entry.reason = reason
        self.session.counters.eager_only_keys += 1
        log.info("region %s, key %s: runs eagerly from now on: %s", self.name, _KeyText(entry.key), reason)
        if not self.said_autograd:
            self.said_autograd = True
            warnings.warn(
                ReplayWarning(
                    f"region {self.name}: runs eagerly under grad mode: {why}, and a CUDA graph cannot record "
                    "autograd (its outputs would come back without grad_fn, and gradients would be lost). Run the "
                    "loop under torch.no_grad() or torch.inference_mode() to replay it"
                ),
                stacklevel=4,
            )
        return self._eager(spec, leaves, entry)

    def _counted(self, spec: object, leaves: Sequence, paths: list) -> tuple:
        """What admission counts a call under: ``(region, shapes)``, the call's structure with
        each tensor's shape and each constant (cheap, about a microsecond). Calls of one full
        key always share it (the full key holds all of it), so its count bounds the key's from
        above: a call it leaves warming or refuses needs no full key at all. Keys that share
        shapes but differ otherwise (dtypes, strides, aliasing, torch modes) share a count,
        which can only make them record sooner. Unhashable constants, and tensors without a
        shape (a strided nested tensor), take the full key, which refuses those loudly.

        Constants other than plain values are counted without keeping what they hold alive
        (:func:`_count_element`): admission's counts outlive the call by up to two windows of
        calls, and a ``Batch`` object of tensors new every step kept every batch of the window
        alive. (The hash of the constant itself is taken first, so an unhashable one is still
        refused.)"""
        try:
            shapes = (
                spec,
                tuple(
                    leaf.shape
                    if isinstance(leaf, torch.Tensor)
                    else (
                        _DYNAMIC_MARK
                        if isinstance(leaf, Dynamic)
                        else leaf
                        if leaf.__class__ in _PLAIN_CONSTANTS
                        else _counted_constant(leaf)
                    )
                    for leaf in leaves
                ),
            )
            hash(shapes)
        except (TypeError, RuntimeError):  # unhashable constants; a nested tensor's .shape raises
            shapes = (spec, region_keys.region_key(self.session.current_device(), spec, leaves, paths))
        return (self, shapes)

    def _decide(self, counted: tuple, spec: object, count: int | None = None) -> _Decision:
        """Count a call of a key without a graph (unless the caller did: ``count``) and say
        what it does (see replay.admission). A call kept from recording always runs
        eagerly; it is counted here, by its reason."""
        session = self.session
        admission = session.admission
        if count is None:
            count = admission.called(counted)
        if self.quiet.version != admission.budget.version:
            self._refresh_quiet(admission)
        if count <= admission.record_after:  # still warming (replay.admission: record_after)
            if count == admission.record_after and spec not in self.hints:
                return _OBSERVE  # the first key of its argument structure: its warm-up is observed
            return _WARM
        if not admission.pays_back(count, self.eager_seconds):
            session.counters.too_rare += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("region %s, shapes %s: not recorded, too rare to pay for a recording", self.name, spec)
            return _TOO_RARE
        if not admission.admits(counted, session.lru, session.pending):
            session.counters.refused += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("region %s, shapes %s: not recorded, graphs held are used more", self.name, spec)
            return _REFUSED
        if not admission.may_record(count, self.eager_seconds):
            session.counters.deferred += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("region %s, shapes %s: recording postponed, the budget is spent", self.name, spec)
            return _DEFERRED
        return _RECORD

    def _refresh_quiet(self, admission) -> None:
        """Remember below which recent count a call of this region's keys only warms or is too
        rare (admission.quiet_below), so that the flat eager path, where a loop of hundreds
        of shapes spends most of its calls, skips :meth:`_decide` for those: same decisions,
        same counts. Computed for ``QUIET_HEADROOM`` times the eager estimate, so that it holds
        while the estimate stays in that band. Asked again when the budget changes (its
        version: by the next :meth:`_decide`) or this region's eager estimate leaves the band
        (:meth:`_eager_took`, at once); not used where debug logging was on when it was last
        asked (the rule then says why for each call)."""
        quiet = self.quiet
        quiet.version = admission.budget.version
        quiet.computed_for = self.eager_seconds
        ceiling = self.eager_seconds * QUIET_HEADROOM
        quiet.below = 0 if log.isEnabledFor(logging.DEBUG) else admission.quiet_below(ceiling)

    def _run_eagerly(
        self,
        decision: _Decision,
        spec: object,
        leaves: Sequence,
        paths: list,
        entry: Entry | None = None,
        key: tuple | None = None,
    ):
        """A call that admission keeps from recording (still warming, refused, or the budget
        spent) runs eagerly; the first warm-up of an argument structure is observed."""
        hints = None
        if decision is _OBSERVE:
            if key is None:
                try:
                    key = _region_key(self.session.current_device(), spec, leaves, paths)
                except region_keys.RefusedKey as refused:
                    return self._refused(refused, spec, leaves)
            hints = self.hints[spec] = Hints(observed_key=key)
        return self._eager(spec, leaves, entry, observe=hints)

    def _call_padded(self, args: tuple, kwargs: dict):
        """Pad to the bucket, call (the bucket's key replays like any other), slice back; every
        ``verify_every``-th padded call is also run unpadded and compared (replay.buckets). In a
        polymorphic session a size the bucket's graph serves at its own size is not padded
        (:meth:`_call_polymorphic`)."""
        policy = self.session.policy
        if self._gate is None and not kwargs and _plain_when_unpadded(policy):
            # (the gate in C took such calls already: what reaches here with it needs padding)
            plain = buckets.without_padding(args, policy.buckets)
            if plain is not None:  # every marker's size needs no padding: an ordinary call
                return self(*plain)
        unseen = None
        if policy.polymorphic:
            result, unseen = self._call_polymorphic(args, kwargs)
            if result is not _MISS:
                return result
        self.padded_calls += 1
        if policy.verify_every and self.padded_calls % policy.verify_every == 0:
            self.session.counters.verifications += 1
            return buckets.verify(self.fn, args, kwargs, lambda: self._pad_and_run(args, kwargs, unseen), self.name)
        return self._pad_and_run(args, kwargs, unseen)

    def _pad_and_run(self, args: tuple, kwargs: dict, unseen: tuple | None):
        """The padded call itself (buckets.call), and in a polymorphic session the bucket's
        base learned from it (``unseen``: see :meth:`_call_polymorphic`)."""
        result, rows, bucket, pads = buckets.call(
            self,
            args,
            kwargs,
            self.session.policy.buckets,
            self.name,
            run_eagerly=self._eager_declined,
            replay_writes=self._replay_writes,
            in_place=self._pad_in_place,
        )
        if unseen is not None and bucket != rows:
            self._learn_base(unseen, args, kwargs, pads)
        return result

    def _pad_in_place(self, args: tuple, dim: int, bucket: int) -> tuple[object, list] | None:
        """A positional padded call whose bucket's graph stages a padded argument (a torch op
        or a foreign kernel reads it): pad it straight into the graph's staged buffer and
        replay with that buffer as the argument, so the graph skips its copy in and back
        (RecordedGraph.in_place_buffer). Returns (result, [(marker, padded)]), or None: the
        usual path then pads into temporaries (and this call may have written the buffer,
        which every replay writes before reading it).

        The buffer is the graph's own, so it goes to nothing but that graph's replay: not
        with ``verify_every`` (a verified or declined call runs the region on its
        arguments), nor before the key's guard passed, nor from a stream other than the one
        the session replayed on last (a replay there may still read it: the stream switch of
        the replay comes after the pad); a replay that declines leaves the call to the usual
        path. Outputs never view it (those inputs are not taken in place)."""
        session = self.session
        if not self.fast or session.policy.verify_every:  # (its candidates' runs verify: never graph.replay)
            return None
        padded = []  # the markers' places
        pre = []  # the pre-key of the padded call (Region.pre_key), built in one pass
        try:
            for i, arg in enumerate(args):
                kind = arg.__class__
                if kind is buckets.Padded:
                    shape = [*arg.tensor.shape]  # (cheaper than slicing a torch.Size)
                    shape[dim] = bucket
                    pre.append(tuple(shape))  # equal to the torch.Size the key holds, and hashed alike
                    padded.append(i)
                elif kind is torch.Tensor:
                    pre.append(arg.shape)
                else:
                    pre.append(_DYNAMIC_MARK if isinstance(arg, Dynamic) else arg)
            candidates = self.fast.get(tuple(pre))
        except (TypeError, RuntimeError):  # an unhashable constant; a strided nested tensor's shape
            return None  # the usual path refuses them
        if not candidates:
            return None
        temporaries: dict[int, torch.Tensor] = {}  # padded arguments no graph takes in place, padded once
        for guard, run, entry in candidates:
            graph = entry.graph
            if graph is None or not graph.in_place or run is not graph.replay:
                continue
            taken = graph.in_place  # input -> (buffer, its copy nodes)
            leaves = list(args)
            buffers = []  # (place, buffer)
            for i in padded:
                held = taken.get(i)
                if held is not None:
                    if not _holds_a_pad_of(held[0], args[i].tensor):
                        break  # a buffer of another dtype or device: another key's graph
                    leaves[i] = held[0]
                    buffers.append((i, held[0]))
            else:
                if not buffers:
                    continue
                for i in padded:
                    if leaves[i] is args[i]:  # not taken in place: padded into a temporary
                        if i not in temporaries:
                            marker = args[i]
                            temporaries[i] = padding.pad(marker.tensor, dim, bucket, marker.fill, marker.bits)
                        leaves[i] = temporaries[i]
                if guard(*leaves):
                    return self._replay_padded_into(entry, run, args, leaves, buffers, padded, dim)
        return None

    def _replay_padded_into(
        self, entry: Entry, run: Callable, args: tuple, leaves: list, buffers: list, padded: list, dim: int
    ) -> tuple[object, list] | None:
        """:meth:`_pad_in_place` once ``entry``'s guard passed: pad into its buffers and
        replay, or None (the usual path takes the call)."""
        session = self.session
        if self.snapshot is not None:
            try:
                self.snapshot.check()
            except GlobalDriftError:
                return None  # the usual path drops the graphs
        stream_now = self._stream_now
        if stream_now is None:  # the backend's, read once (get_backend reads the environment)
            stream_now = self._stream_now = get_backend().hot_namespace["_current_stream"]
        if stream_now(entry.key[0]) != session.last_stream[0]:
            return None
        for i, buffer in buffers:
            marker = args[i]
            if not padding.pad_into(marker.tensor, dim, marker.bits, buffer):
                return None
        session.lru.move_to_end(entry)  # session.touch, inline
        result = run(*leaves)
        if result is MISMATCH:
            return None
        session.counters.padded_in_place += len(buffers)
        return result, [(args[i], leaves[i]) for i in padded]

    # --- polymorphic replay (replay.polymorphic) -----------------------------------------------
    def _call_polymorphic(self, args: tuple, kwargs: dict) -> tuple[object, tuple | None]:
        """A padded call smaller than its bucket, at its own size: replayed by its variant of
        the bucket's graph, or observed (an eager run, this call's result) to make one once
        the bucket's graph is known. Returns (result or ``_MISS``: pad it, the call's unpadded
        key when the padded call should tell which graph serves its bucket)."""
        session = self.session
        markers = buckets.markers(args, kwargs)
        first = markers[0]
        rows = first.tensor.shape[first.dim]
        bucket = buckets.bucket_for(rows, session.policy.buckets)
        if bucket is None or bucket == rows or not session.can_record():
            return _MISS, None
        if buckets.agreed_size(markers) is None:
            return _MISS, None  # the padded path refuses it with its message
        spec, leaves, paths = region_keys.flatten(*buckets.unwrapped(args, kwargs))
        if self.snapshot is not None:
            try:
                self.snapshot.check()
            except GlobalDriftError:
                return self._rekey(args, kwargs), None
        try:
            key = _region_key(session.current_device(), spec, leaves, paths)
        except region_keys.RefusedKey as refused:
            return self._refused(refused, spec, leaves), None
        if _grad_leaves(key) and torch.is_grad_enabled():
            return _MISS, None  # padded: its key runs eagerly (Region._needs_autograd)
        state = self.variants.get(key)
        if isinstance(state, polymorphic.VariantGraph):
            return self._run_graph(state, spec, leaves, None), None
        if state is not None:
            return _MISS, None  # the bucket's graph cannot serve this size: padded
        entry = self.bucket_bases.get((bucket, spec))
        if entry is None or entry.state != RECORDED or entry.graph is None:
            return _MISS, (bucket, spec)
        # An observation costs several eager calls (replay.polymorphic), so sizes are admitted
        # to one as keys are to a recording: called more than ``record_after`` times recently,
        # within the recording budget (which it is charged to). A size that never comes back,
        # or comes while the budget is spent, is padded: a replay, cheaper than eager.
        admission = session.admission
        count = admission.called((self, _VARIANT, self._counted(spec, leaves, paths)[1]))  # (not the key: see _counted)
        if count <= admission.record_after or not admission.may_record():
            return _MISS, None
        started = time.perf_counter()
        try:
            return self._observe_variant(entry.graph, key, spec, leaves, paths), None
        finally:
            admission.recorded(time.perf_counter() - started)

    def _learn_base(self, bucket: tuple, args: tuple, kwargs: dict, pads: list) -> None:
        """After a padded call: the graph of its bucket, once recorded, is the one the sizes of
        that bucket are observed against from then on (``bucket``: (size, argument structure))."""
        grown = iter([tensor for _marker, tensor in pads])
        padded_args = tuple(next(grown) if a.__class__ is buckets.Padded else a for a in args)
        padded_kwargs = {k: next(grown) if v.__class__ is buckets.Padded else v for k, v in kwargs.items()}
        try:
            spec, leaves, paths = region_keys.flatten(padded_args, padded_kwargs)
            entry = self.entries.get(_region_key(self.session.current_device(), spec, leaves, paths))
        except region_keys.RefusedKey:
            return  # its calls run eagerly
        if entry is not None and entry.state == RECORDED and entry.graph is not None:
            self.bucket_bases[bucket] = entry

    def _observe_variant(self, base: RecordedGraph, key: tuple, spec: object, leaves: list, paths: list):
        """Run the call eagerly under observation (its result is this call's) and make the
        size a variant of ``base``, or remember why it cannot be one."""
        session = self.session
        self._count_eager(None)
        with _SHARED_CAPTURE_EXCLUSION:
            try:
                observation = polymorphic.observe(self.fn, spec, leaves, paths, self._tensors_held_by_name())
            except DynamicScalarError as error:
                raise ReplayError(
                    f"region {self.name}: at this size it uses a dynamic() value where the bucket's graph does not "
                    f"({error}); the call stopped part way, so its arguments may be changed. Its Python takes "
                    "another path at this size: polymorphic=False pads it instead"
                ) from error
        result = polymorphic.plain_outputs(observation.outputs)
        with session.lock:
            if base.released:
                return result
            entry = Entry(self, key, (self, key))
            entry.state = RECORDED
            try:
                variant = polymorphic.make_variant(
                    base, key, entry, spec, leaves, paths, observation, self._forget_variant
                )
            except polymorphic.Unmatched as why:
                if len(self.variants) >= MAX_VARIANT_STATES:  # forget why sizes were padded, not variants
                    self.variants = {k: v for k, v in self.variants.items() if isinstance(v, polymorphic.VariantGraph)}
                self.variants[key] = str(why)
                session.counters.not_polymorphic += 1
                log.info("region %s, key %s: padded, not served at its size: %s", self.name, _KeyText(key), why)
                return result
            entry.graph = variant
            self.variants[key] = variant
            session.counters.variants += 1
            log.info("region %s, key %s: served by its bucket's graph at its own size", self.name, _KeyText(key))
        return result

    def _forget_variant(self, variant: RecordedGraph) -> None:
        """A variant went with its base graph: its size is observed again when it comes back."""
        if self.variants.get(variant.key) is variant:
            del self.variants[variant.key]
        self.forgotten.replays += variant.replays

    def polymorphic_report(self) -> list[str]:
        """Which sizes of this region its buckets' graphs serve at their own size, and why the
        others are padded (the first reason of each kind)."""
        served = sum(isinstance(v, polymorphic.VariantGraph) for v in self.variants.values())
        reasons: dict[str, int] = {}
        for value in self.variants.values():
            if isinstance(value, str):
                reasons[value] = reasons.get(value, 0) + 1
        lines = [f"region {self.name}: {served} sizes served at their own size, {sum(reasons.values())} padded"]
        lines += [f"  padded ({count}): {reason}" for reason, count in sorted(reasons.items(), key=lambda r: -r[1])]
        return lines

    def _replay_writes(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` overlaps the output memory of one of this region's graphs (asked
        on every padded call that copies an argument: a search of the merged ranges, rebuilt
        only when a graph or a capture of the region came or went)."""
        ranges = self._output_ranges
        if ranges is None:
            spans = []
            for entry in self.entries.values():
                if entry.graph is not None:
                    memory = entry.graph.output_memory
                elif entry.unanalysed is not None:  # its next call analyses it, then replays
                    memory = recording.owned_output_memory(entry.unanalysed)
                else:
                    continue
                spans += [(start, start + size) for start, size in memory.items()]
            spans += self.session.output_slot_ranges(self)
            ranges = self._output_ranges = region_keys.MergedRanges(spans)
        return ranges.overlaps(*region_keys.byte_range(tensor))

    def outputs_changed(self) -> None:
        """A graph or capture of this region came or went: its output memory is looked up afresh."""
        self._output_ranges = None

    def _refused(self, refused: region_keys.RefusedKey, spec: object, leaves: Sequence, kwargs: dict | None = None):
        """A call whose key cannot be made exactly (region_keys.RefusedKey: an argument a graph
        would bake without seeing it change, a constant whose equality is not exact, a torch
        setting that cannot be read) runs eagerly, with one ReplayWarning per reason (naming
        the argument). ``spec`` None: flatten refused it, ``leaves`` are then the arguments."""
        if refused.reason not in self.refusals:
            if len(self.refusals) < MAX_IDLE_ENTRIES:
                self.refusals.add(refused.reason)
            log.info("region %s: runs eagerly: %s", self.name, refused.reason)
            warnings.warn(ReplayWarning(f"region {self.name}: runs eagerly: {refused.reason}"), stacklevel=4)
        if spec is None:
            self._count_eager(None)
            with _SHARED_CAPTURE_EXCLUSION:
                return self.fn(*leaves, **(kwargs or {}))
        return self._eager(spec, leaves)

    def _eager_declined(self, *args, **kwargs):
        """A call no graph may serve exactly (see buckets.call): eagerly, counted as declined."""
        self.session.counters.declined += 1
        spec, leaves, _paths = region_keys.flatten(args, kwargs)
        return self._eager(spec, leaves)

    def _replay(self, entry: Entry, leaves: Sequence):
        self.session.touch(entry)
        return self._run_graph(entry.graph, entry.key[1], leaves, entry)

    def _run_graph(self, graph: RecordedGraph, spec: object, leaves: Sequence, entry: Entry | None):
        """Replay ``graph`` (every ``verify_every``-th replay verified); a call it declines
        runs eagerly, counted under ``entry`` (None: a variant, counted with the region)."""
        every = self.session.policy.verify_every
        if every and (graph.replays + 1) % every == 0:
            self.session.counters.verifications += 1
            result = graph.verify(leaves, lambda snapshot: self._eager(spec, snapshot))
        else:
            result = graph.replay(*leaves)
        if result is MISMATCH:
            # the graph cannot serve these values exactly (see replay.graph): the eager run
            # gives the exact result, or the exact error
            self.session.counters.declined += 1
            return self._eager(spec, leaves, entry)
        return result

    def _rekey(self, args: tuple, kwargs: dict):
        """The region's globals changed: its graphs were recorded against the old ones."""
        self.session.counters.invalidations += 1
        log.info("region %s: its globals changed, its graphs are dropped", self.name)
        self.drop_graphs()  # the variants go too
        self.bucket_bases.clear()
        self.entries.clear()
        self.entry_shapes.clear()
        self.hints.clear()
        self.session.admission.forget(lambda counted: counted[0] is self)
        self.snapshot = None
        return self._call(args, kwargs)

    def _bound_entries(self) -> None:
        """Keep at most ``MAX_IDLE_ENTRIES`` entries without a graph (eager-only keys, evicted
        ones): a loop over thousands of distinct keys keeps bounded bookkeeping. A forgotten
        eager-only key is retried if it comes back (it warns again, once)."""
        if len(self.entries) <= MAX_IDLE_ENTRIES:  # no more idle entries than entries: none to drop
            return
        idle = [k for k, e in self.entries.items() if e.state in (WARMING, EAGER_ONLY)]
        for key in idle[: max(len(idle) - MAX_IDLE_ENTRIES, 0)]:
            entry = self.entries.pop(key)
            shapes = entry.counted[1]
            self.entry_shapes[shapes] -= 1
            if not self.entry_shapes[shapes]:
                del self.entry_shapes[shapes]
            self.forgotten.keys += 1
            self.forgotten.eager_runs += entry.eager_runs
            self.forgotten.replays += entry.replays_before

    def _count_eager(self, entry: Entry | None) -> None:
        """Count an eager run: the session's, and the key's (in the region's aggregate for a
        key without an entry)."""
        self.session.counters.eager_runs += 1
        if entry is not None:
            entry.eager_runs += 1
        else:
            self.forgotten.eager_runs += 1

    def _eager_took(self, seconds: float) -> None:
        """Track what an eager call of this region costs (what a replay would save, for
        admission's payback rule): a drop is taken at once, a rise an eighth at a time, so a
        call that compiled or waited for the GPU does not make recordings look cheap. The
        first call is not trusted at all (it loads kernels, allocates): until a second one
        is timed, the estimate stays 0 and no key pays back."""
        usual = self.eager_sample
        self.eager_sample = seconds if seconds < usual or not usual else usual + (seconds - usual) / 8
        if usual:
            estimate = self.eager_seconds = self.eager_sample
            quiet = self.quiet
            computed_for = quiet.computed_for
            if not computed_for / QUIET_HEADROOM <= estimate <= computed_for * QUIET_HEADROOM:
                self._refresh_quiet(self.session.admission)  # out of the band: what pays back may have changed
            elif quiet.below and log.isEnabledFor(logging.DEBUG):
                self._refresh_quiet(self.session.admission)  # debug logging turned on: every call says why

    def _eager(self, spec: object, leaves: Sequence, entry: Entry | None = None, observe: Hints | None = None):
        self._count_eager(entry)
        args, kwargs = region_keys.unflatten(spec, region_keys.plain_leaves(leaves))
        if observe is None:
            with _SHARED_CAPTURE_EXCLUSION:  # may load kernels: not while another thread captures
                started = time.perf_counter()
                result = self.fn(*args, **kwargs)
            self._eager_took(time.perf_counter() - started)  # rarer than the flat path's: every call
            return result
        tensors = [(i, leaf) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        observer = op_observer([region_keys.byte_range(t) for _, t in tensors])
        with _SHARED_CAPTURE_EXCLUSION, observer:
            result = self.fn(*args, **kwargs)
        observe.stage |= {tensors[w][0] for w in observer.read}
        observe.copy_back |= {tensors[w][0] for w in observer.written}
        observe.clean = not observer.read and not observer.written
        if torch.is_grad_enabled() and not _grad_leaves(observe.observed_key or ()):
            # no argument required grad, so outputs that do come from what the region reads
            # (its weights): its keys under grad mode would record a graph that drops them
            grads = _outputs_requiring_grad(result)
            if grads:
                shown = f"{', '.join(grads[:3])}{', ...' if len(grads) > 3 else ''}"
                observe.autograd = (
                    f"{shown} of an eager run required grad with no argument requiring it (tensors the region "
                    "reads require it: module parameters do by default)"
                )
        return result

    # --- recording -----------------------------------------------------------------------
    def _tensors_held_by_name(self) -> recording.HeldTensors:
        """The tensors the region reaches other than through its arguments: those its globals
        and closures hold (the snapshot's), and a module region's parameters and buffers
        (``forward`` reads them as attributes, which the snapshot does not follow). An
        argument that is one of them is reached both ways (recording.input_doubts)."""
        named = self.snapshot.tensors_by_name() if self.snapshot is not None else jitcore.TensorsByName([], True)
        module = self.fn if isinstance(self.fn, torch.nn.Module) else getattr(self.fn, "__self__", None)
        attributes = [*module.parameters(), *module.buffers()] if isinstance(module, torch.nn.Module) else []
        return recording.HeldTensors(named.tensors, attributes, complete=named.complete)

    def _record(self, entry: Entry, key: tuple, spec: object, leaves: list, paths: list, device: int):
        """Capture the key and launch the new graph once (this call's result). The node
        analysis and the replay code wait for the key's next call (see :meth:`_finish`)."""
        session = self.session
        with session.lock:
            if self.snapshot is None:
                self.snapshot = jitcore.GlobalsSnapshot(self.fn, owner=f"region {self.name}", prefix="_r")
            # Arguments that overlap each other are never staged by a first capture (a warm-up
            # hint): staged apart, they would stop sharing memory, which is exact only once an
            # analysis of the graph has shown that nothing writes them.
            overlapping = set() if entry.analysed_staging else {i for pair in key[3] for i in pair}
            started = time.perf_counter()
            try:
                capture = session.record_key(
                    self.fn,
                    spec,
                    leaves,
                    paths,
                    device=device,
                    pool=session.pool(device),
                    stream=session.capture_stream(device),
                    stage=entry.stage_hint - overlapping,
                    copy_back=entry.copy_back_hint - overlapping,
                    observe=not entry.observed_clean,
                    storages=session.policy.polymorphic,
                    held=self._tensors_held_by_name(),
                )
            except jitcore.recorder.CaptureBusy:
                return self._eager(spec, leaves, entry)  # called inside another region's eager run
            except recording.CaptureAborted as aborted:
                return self._retry_later(entry, spec, leaves, aborted)
            except recording.CaptureFailed as failure:
                if isinstance(failure, recording.SpoiledPool):
                    session.retire_pool(device)
                return self._give_up(entry, spec, leaves, failure.reason)
            finally:
                session.admission.recorded(time.perf_counter() - started)  # failed captures cost time too
            entry.unanalysed = capture
            self.outputs_changed()
            entry.state = PENDING
            session.pending[entry] = None
            session.admission.held(entry, entry.counted)  # a candidate for eviction like a graph
            session.make_room(entry, allowance=1)
            stats = session.counters
            stats.records += 1
            stats.replays += 1  # the first launch of the new graph serves this call
            entry.replays_before += 1
            stats.capture_seconds += capture.seconds
            log.info(
                "region %s, key %s: recorded in %.2f ms, %.1f MiB",
                self.name,
                _KeyText(key),
                capture.seconds * 1e3,
                capture.memory / 2**20,
            )
            session.stream_switch(get_backend().current_stream(device))
            generator = _cuda_generator(device)
            offset = generator.get_offset() if generator is not None else 0
            capture.graph.replay()  # torch's replay: it advances the generators the graph draws from
            if getattr(capture, "host", None) is not None:
                capture.host.launched()  # it reads the host inputs' pinned buffers until done
            entry.uses_rng = generator is not None and generator.get_offset() != offset
            entry.rng_epoch = recording.GENERATOR_EPOCH[0]
            outputs = recording.first_outputs(capture, leaves)
            if session.policy.clone_outputs:
                outputs = _clone_tensors(outputs)
            elif session.policy.check_stale:
                outputs = guard_outputs(outputs, entry)
            return outputs

    def _finish(self, entry: Entry, key: tuple, spec: object, leaves: list, paths: list, device: int):
        """The key's second call: analyse its capture and build the replay (or record again
        with more inputs staged, or give up), then replay."""
        session = self.session
        with session.lock:
            capture, entry.unanalysed = entry.unanalysed, None
            self.outputs_changed()
            session.pending.pop(entry, None)
            session.admission.dropped(entry)  # add_graph holds it again, with its graph
            analysed = time.perf_counter()
            try:
                session.analyse(capture)
                instrumentation.steps.start()
                graph = session.build_graph(self, key, capture, spec, leaves, paths, session, len(session.lru))
                instrumentation.steps.mark("build replay")
                session.admission.recorded(time.perf_counter() - analysed)
            except recording.CaptureRetry as retry:
                capture.graph.reset()
                entry.state = WARMING
                plan = retry.args[0]
                entry.stage_hint |= plan.needs_staging
                entry.copy_back_hint |= plan.needs_copy_back
                hints = self.hints.setdefault(spec, Hints())
                hints.stage |= plan.needs_staging
                hints.copy_back |= plan.needs_copy_back
                entry.analysed_staging = True
                entry.retries += 1
                session.counters.record_retries += 1
                if entry.retries > 2:
                    return self._give_up(entry, spec, leaves, "staging did not settle after three captures")
                return self._record(entry, key, spec, leaves, paths, device)
            except recording.CaptureFailed as failure:
                capture.graph.reset()
                return self._give_up(entry, spec, leaves, failure.reason)
            except recording.CaptureAborted as aborted:
                capture.graph.reset()
                entry.state = WARMING
                return self._retry_later(entry, spec, leaves, aborted)
            except BaseException:  # anything else (a driver error): leave nothing half-built
                capture.graph.reset()
                entry.state = WARMING
                raise
            entry.graph = graph
            self.outputs_changed()
            entry.state = RECORDED
            described = _describe_key(key)
            stats = session.counters
            for input_range in capture.inputs:
                choice = capture.plan.choices.get(input_range.index, "unused")
                if choice == STAGED and input_range.index in capture.copied_back:
                    choice = "staged+copied back"
                reason = "; ".join(capture.plan.reasons.get(input_range.index, []))
                stats.inputs.append(InputChoice(self.name, described, input_range.path, choice, reason))
            host = getattr(capture, "host", None)
            for i in sorted(host.buffers) if host is not None else ():
                stats.inputs.append(
                    InputChoice(self.name, described, host.paths[i], STAGED, "a host tensor: through a pinned buffer")
                )
            session.add_graph(entry)
            session.after_record(entry, capture)
            self._promote(entry, spec, leaves)
            return self._replay(entry, leaves)

    def recapture(self, entry: Entry, pool: tuple) -> RecordedGraph:
        """Record ``entry``'s key again into ``pool``, from placeholders of its inputs."""
        old = entry.graph
        leaves = old.placeholder_leaves()
        session = self.session
        capture = session.record_key(
            self.fn,
            old.spec,
            leaves,
            old.paths,
            device=old.device,
            pool=pool,
            stream=session.capture_stream(old.device),
            stage=entry.stage_hint,
            copy_back=entry.copy_back_hint,
            storages=session.policy.polymorphic,
        )
        session.counters.capture_seconds += capture.seconds
        try:
            session.analyse(capture)
            entry.rng_epoch = recording.GENERATOR_EPOCH[0]  # registered with today's generator state
            return session.build_graph(self, entry.key, capture, old.spec, leaves, old.paths, session, len(session.lru))
        except BaseException:
            capture.graph.reset()
            raise

    def _retry_later(self, entry: Entry, spec: object, leaves: Sequence, aborted: Exception):
        """This call runs eagerly (compiling what the capture could not); the key records
        again on its next call. Recordings the analysis turned down (``RecordLater``) are
        retried three times at most."""
        self.session.counters.record_retries += 1
        log.info("region %s, key %s: recording retried later: %s", self.name, _KeyText(entry.key), aborted)
        if isinstance(aborted, recording.RecordLater):
            entry.later += 1
            if entry.later > 3:
                return self._give_up(entry, spec, leaves, f"recording kept failing: {aborted}")
        return self._eager(spec, leaves, entry)

    def _give_up(self, entry: Entry, spec: object, leaves: Sequence, reason: str):
        entry.state = EAGER_ONLY
        entry.reason = reason
        self.session.counters.eager_only_keys += 1
        log.info("region %s, key %s: runs eagerly from now on: %s", self.name, _KeyText(entry.key), reason)
        warnings.warn(
            ReplayWarning(f"region {self.name}, key {_describe_key(entry.key)}: runs eagerly from now on: {reason}"),
            stacklevel=4,
        )
        return self._eager(spec, leaves, entry)

    # --- the guarded fast path -----------------------------------------------------------
    def _promote(self, entry: Entry, spec: object, leaves: Sequence) -> None:
        """Put a recorded key of a flat call on the fast dispatch path."""
        if entry.guard is None:
            entry.guard = self._make_guard(entry, spec, leaves) or never
        if entry.guard is never:
            return
        try:
            pre_key = self.pre_key(leaves)
            candidates = self.fast.setdefault(pre_key, [])
        except TypeError:
            return
        if self.session.policy.verify_every:  # verification needs the full replay path
            run = functools.partial(self._replay_args, entry)
        else:
            run = entry.graph.replay
        candidates[:] = [c for c in candidates if c[2] is not entry] + [(entry.guard, run, entry)]
        entry.pre_key = pre_key
        self._rebuild_fast()

    def serve_new_graph(self, entry: Entry) -> None:
        """The entry has a new graph (compaction): serve it on the fast path."""
        self.outputs_changed()
        candidates = self.fast.get(entry.pre_key) if entry.pre_key is not None else None
        if candidates and not self.session.policy.verify_every:
            candidates[:] = [(g, entry.graph.replay, e) if e is entry else (g, r, e) for g, r, e in candidates]
            self._rebuild_fast()

    def _replay_args(self, entry: Entry, *leaves):
        return self._replay(entry, leaves)

    def withdraw(self, entry: Entry) -> None:
        """Take a released key off the fast dispatch path."""
        candidates = self.fast.get(entry.pre_key) if entry.pre_key is not None else None
        if candidates:
            candidates[:] = [c for c in candidates if c[2] is not entry]
            if not candidates:
                del self.fast[entry.pre_key]
            self._rebuild_fast()

    def _make_guard(self, entry: Entry, spec: object, leaves: Sequence) -> Callable | None:
        """``guard(*args) -> bool``: exactly this key, for calls with positional leaves only."""
        if spec[0] != region_keys.FLAT:
            return None
        checks = []
        for leaf in leaves:
            if type(leaf) is torch.Tensor:
                checks.append(ArgumentCheck.tensor(leaf, list(leaf.shape), list(leaf.stride())))
            elif isinstance(leaf, Dynamic):
                checks.append(ArgumentCheck.wrapping(Dynamic, "value", type(leaf.value)))
            elif isinstance(leaf, float):  # by bits: -0.0 is not 0.0, a NaN is itself
                checks.append(ArgumentCheck.equal_through(leaf, region_keys.float_bits))
            elif isinstance(leaf, (bool, int, str, type(None))):
                checks.append(ArgumentCheck.equal(leaf))
            else:
                return None
        return make_guard(
            checks,
            device=entry.key[0],
            current_device=get_backend().hot_namespace["_current_device"],
            description="replay guard of a key",
            packed=True,
        )

    # --- maintenance ---------------------------------------------------------------------
    def drop_graphs(self) -> None:
        for entry in list(self.entries.values()):
            if entry.graph is not None:
                self.session.release(entry)
        self.variants.clear()  # the sizes are observed again against the graphs recorded next
        self.clear_fast_path()
        self.session.release_output_slots(self)

    def clear_fast_path(self) -> None:
        self.fast.clear()
        self._fast = self._eager_entry
        self._fast_keys = None
        self._fast_shape = None

    def measure_without_checks(self):
        """Benchmarks only (see :func:`replay.graph.measure_without_checks`): this region's
        graphs held now skip the torch-settings and launcher-globals checks inside the
        context."""
        return measure_without_checks([e.graph for e in self.entries.values() if e.graph is not None])

    @contextlib.contextmanager
    def measure_generated_python(self):
        """Benchmarks only: inside the context, this region's recorded keys replay through
        their generated Python function alone, without csrc/replay_step.c in front of it (what
        a replay costs where that file is not built)."""
        saved = [(candidates, list(candidates)) for candidates in self.fast.values()]
        for candidates, held in saved:
            candidates[:] = [(guard, generated_replay(run), entry) for guard, run, entry in held]
        try:
            yield
        finally:
            for candidates, held in saved:
                candidates[:] = held

    def measure_with_settings_check(self, way: str):
        """Benchmarks only (see :func:`replay.graph.measure_with_settings_check`): this
        region's graphs held now check the torch settings the way named inside the context."""
        return measure_with_settings_check([e.graph for e in self.entries.values() if e.graph is not None], way)

    def __repr__(self) -> str:
        return f"<replay region {self.name}: {len(self.entries)} keys>"


#: Region.__call__ as Python runs it; replaced below by its C version where that was built
#: (csrc/replay_eager.c, RegionCall: the same steps, without a Python frame of its own on every call).
PYTHON_REGION_CALL = Region.__call__
if _native_enabled():
    Region.__call__ = RegionCall(miss=_MISS, drift=_RegionDrift)


class Session:
    """A capture session: one memory pool per device, the graph cache, policy and stats."""

    #: How a key is captured and turned into a replayable graph; CPU tests of the session's
    #: logic replace these with doubles (the GPU tests run the real ones).
    record_key = staticmethod(recording.capture)
    analyse = staticmethod(recording.analyse)
    build_graph = RecordedGraph

    def __init__(self, **policy: object):
        self.policy = Policy(**policy)
        observe.prepare()
        self.counters = Stats()
        self.lock = threading.RLock()
        self.regions: list[Region] = []
        self.lru: OrderedDict[Entry, None] = OrderedDict()  # graphs held, least recently replayed first
        self.admission: Admission[Entry] = Admission(
            record_after=self.policy.record_after,
            max_graphs=self.policy.max_graphs,
            budget=self.policy.record_budget,
            replays=lambda entry: entry.graph.replays if entry.graph is not None else 0,
            clock=time.perf_counter,
        )
        self.compaction_rule = CompactionRule()
        self.pending: dict[Entry, None] = {}  # recorded, not yet analysed: they take a place in the cache
        self._pools: dict[int, recording.KeptPool] = {}
        self._retired_pools: list[recording.KeptPool] = []
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._output_slots: dict[tuple[Region, int], OutputSlots] = {}  # (region, device) -> its slots
        self.last_stream: list[int | None] = [None]
        self.closed = False
        self.compaction = True  # off for good once a compaction stops paying
        self._said_eager = False
        self._gpu = torch.cuda.is_available()  # asked once: it costs a microsecond per call

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- regions -------------------------------------------------------------------------
    def region(self, fn: Callable | None = None, *, name: str | None = None):
        """Wrap ``fn`` as a region of this session (usable as ``@cap.region``)."""
        if fn is None:
            return lambda f: self.region(f, name=name)
        self.check_open()
        region = Region(self, fn, name)
        self.regions.append(region)
        return region

    def current_device(self) -> int:
        """The device graphs are recorded for (-1 without a GPU)."""
        return get_backend().current_device() if self._gpu else -1

    def can_record(self) -> bool:
        """Without a GPU every call runs eagerly (the same results, no graphs)."""
        return self._gpu

    def say_eager_once(self) -> None:
        if not self._said_eager:
            self._said_eager = True
            warnings.warn(
                ReplayWarning("no CUDA GPU: every call of this capture() session runs eagerly (the same results)"),
                stacklevel=4,
            )

    def check_open(self) -> None:
        if self.closed:
            raise SessionClosedError("this capture() session is closed (its with-block ended); open a new one")

    # --- resources -----------------------------------------------------------------------
    def pool(self, device: int) -> tuple:
        """The id of this session's memory pool on ``device``."""
        pool = self._pools.get(device)
        if pool is None:
            pool = self._pools[device] = recording.KeptPool(device, self.capture_stream(device))
        return pool.id

    def capture_stream(self, device: int) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def stream_switch(self, stream: int) -> None:
        """Replays of one session share a pool: order a replay on a new stream after the last
        replay on the previous one, so they never run concurrently."""
        previous = self.last_stream[0]
        if previous is not None and previous != stream:
            event = torch.cuda.Event()
            event.record(torch.cuda.ExternalStream(previous))
            torch.cuda.ExternalStream(stream).wait_event(event)
        self.last_stream[0] = stream

    def output_slots(self, region: Region, device: int) -> OutputSlots:
        """The output slots ``region``'s graphs on ``device`` share (replay.output_slots)."""
        slots = self._output_slots.get((region, device))
        if slots is None:
            target = f"cuda:{device}"
            slots = self._output_slots[(region, device)] = OutputSlots(
                lambda size: torch.empty(size, dtype=torch.uint8, device=target),
                changed=region.outputs_changed,  # a slot came or went
            )
        return slots

    def output_slot_ranges(self, region: Region) -> list[tuple[int, int]]:
        """The memory ``region``'s replays may write into its output slots, on every device."""
        return [span for (owner, _), slots in self._output_slots.items() if owner is region for span in slots.ranges()]

    def release_output_slots(self, region: Region | None = None) -> None:
        """Drop the output slots of ``region`` (of every region when None) once its graphs are
        gone: free ones are freed, held ones go when their outputs go."""
        for key in [k for k in self._output_slots if region is None or k[0] is region]:
            self._output_slots.pop(key).release()

    def touch(self, entry: Entry) -> None:
        self.lru.move_to_end(entry)

    def add_graph(self, entry: Entry) -> None:
        """Hold ``entry``'s new graph; beyond ``max_graphs`` graphs and captures awaiting their
        analysis, release the least frequently used other one (admission let this key in only
        if it was called more often)."""
        self.make_room(entry, allowance=0)
        self.lru[entry] = None
        self.admission.held(entry, entry.counted)
        self.counters.graphs = len(self.lru)

    def make_room(self, entry: Entry, allowance: int) -> None:
        """Release the least frequently used graphs and captures awaiting analysis (``pending``;
        the oldest first among equals, pending ones before graphs) other than ``entry`` until,
        with ``entry``, at most ``max_graphs + allowance`` of them are held.

        Why pending captures too: a key recorded on its last call is never analysed, and its
        capture kept a place in ``max_graphs`` (and its pool memory) for good: once
        ``max_graphs`` of them were pending, no key was ever admitted again (a hot key refused
        9,999 times of 10,000). They are admission's residents from their capture on, used
        as often as their key was called, and go as graphs go. A new capture (``allowance``
        1) leaves the graph it will replace serving until its analysis, when it joins the
        graphs (``allowance`` 0): a key that never comes back then evicted nothing; a second
        capture before that makes room at once, so at most one is held beyond ``max_graphs``."""
        limit = self.policy.max_graphs + allowance
        while len(self.lru) + len(self.pending) + (entry not in self.pending) > limit:
            others = [e for e in self.pending if e is not entry]
            _admit, victim = self.admission.victim(entry.counted, self.lru, others)
            if victim is None:
                return
            what = "capture (never analysed)" if victim in self.pending else "graph"
            self.release(victim)
            self.counters.evictions += 1
            log.info(
                "region %s, key %s: %s released for key %s, used more recently",
                victim.region.name,
                _KeyText(victim.key),
                what,
                _KeyText(entry.key),
            )

    def retire_pool(self, device: int) -> None:
        """Record into a fresh pool from now on (a failed capture left the current one
        unusable for captures). Graphs recorded into the old pool keep it alive. The failure
        also gave the device's generator a new state, which graphs that draw random numbers
        no longer advance: those are dropped and record again."""
        old = self._pools.pop(device, None)
        if old is not None:
            self._retired_pools.append(old)
        for region in self.regions:
            for entry in list(region.entries.values()):
                held = entry.graph if entry.graph is not None else entry.unanalysed  # recorded or pending
                if entry.uses_rng and held is not None and held.device == device:
                    # torch registered the old state with it: its replay would advance that
                    # state (and raise, the old state being stuck in capture mode)
                    self.release(entry)

    def pool_bytes(self, device: int) -> int:
        """The device's pool size, measured now (compaction compares before and after)."""
        return recording.pool_bytes(device, self.pool(device))

    def memory_bytes(self) -> int:
        """The pools' size (as each recording last measured it) plus the output memory: the
        graphs' own output buffers and the regions' output slots."""
        outputs = sum(getattr(e.graph.capture, "output_bytes", 0) for e in self.lru if e.graph is not None)
        outputs += sum(slots.nbytes() for slots in self._output_slots.values())
        retired = sum(self.known_pool_bytes(p.device, p.id) for p in self._retired_pools)
        pools = sum(self.known_pool_bytes(device) for device in self._pools)
        return pools + retired + outputs

    def known_pool_bytes(self, device: int, pool: tuple | None = None) -> int:
        """A pool's size as its last recording measured it (recording.known_pool_bytes),
        measured now if never: no allocator snapshot after every recording."""
        pool = self.pool(device) if pool is None else pool
        known = recording.known_pool_bytes(device, pool)
        if known is not None:
            return known
        return self.pool_bytes(device) if pool == self.pool(device) else recording.pool_bytes(device, pool)

    def after_record(self, entry: Entry, capture) -> None:
        """A recording that grew the pool substantially may have fragmented it (a bigger shape
        cannot reuse the blocks smaller shapes were recorded into): record the device's graphs
        again, largest inputs first, into a fresh pool, so they share one set of blocks."""
        device = capture.device
        size = self.known_pool_bytes(device)  # measured by the recording
        self.compaction_rule.recorded(device, size, capture.memory - getattr(capture, "output_bytes", 0))
        others = [e for e in self.lru if e is not entry and e.graph is not None and e.graph.device == device]
        if (
            self.compaction
            and others
            and capture.memory >= max(1 << 20, size // 10)
            and self.compaction_rule.due(device, size, len(others) + 1, self.counters.records)
            and self.admission.may_record()
        ):
            self.compact(device)

    def compact(self, device: int) -> bool:
        """Record every graph of ``device`` again into a fresh pool (largest inputs first) and
        free the old pool. Keeps the old graphs if any recording fails."""
        if recording.CAPTURES.holds_shared():
            return False  # inside another region's eager run: no capture can start here
        entries = sorted(
            (e for e in self.lru if e.graph is not None and e.graph.device == device),
            key=lambda e: e.graph.input_bytes,
            reverse=True,
        )
        for region in self.regions:  # captures still awaiting analysis live in the old pool:
            for entry in region.entries.values():  # drop them; they record again when called
                if entry.unanalysed is not None and entry.unanalysed.device == device:
                    self.release(entry)
        started = time.perf_counter()
        before = self.pool_bytes(device)
        new_pool = recording.KeptPool(device, self.capture_stream(device))
        fresh: dict[Entry, RecordedGraph] = {}
        try:
            for entry in entries:
                fresh[entry] = entry.region.recapture(entry, new_pool.id)
        except (recording.CaptureFailed, recording.CaptureAborted, recording.CaptureRetry) as failure:
            for graph in fresh.values():
                graph.release()
            self.compaction = False
            if isinstance(failure, recording.SpoiledPool):
                self.retire_pool(device)
            return False
        except BaseException:
            for graph in fresh.values():
                graph.release()
            self.compaction = False
            raise
        for entry, graph in fresh.items():
            frequency = self.admission.frequency(entry)
            old, entry.graph = entry.graph, graph
            entry.replays_before += old.replays
            self.admission.restarted(entry, frequency)  # its new graph counts replays from 0
            old.release()
            entry.region.serve_new_graph(entry)
        self._pools[device] = new_pool  # the old KeptPool goes, and with it the old pool
        with recording.CAPTURES.exclusive():  # both would break another thread's capture
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        after = self.pool_bytes(device)
        self.admission.recorded(time.perf_counter() - started)
        self.compaction_rule.done(device, after, len(fresh))
        self.counters.compactions += 1
        self.counters.recaptures += len(fresh)
        log.info(
            "cuda:%d: %d graphs recorded again into a fresh pool: %.1f MiB -> %.1f MiB",
            device,
            len(fresh),
            before / 2**20,
            after / 2**20,
        )
        if after > 0.9 * before:
            self.compaction = False
        return True

    def release(self, entry: Entry) -> None:
        """Drop an entry's graph; its memory returns to the pool. The key records again later."""
        self.lru.pop(entry, None)
        self.pending.pop(entry, None)
        self.admission.dropped(entry)
        if entry.graph is not None:
            entry.replays_before += entry.graph.replays
            entry.graph.release()
        entry.region.withdraw(entry)
        if entry.unanalysed is not None:
            entry.unanalysed.graph.reset()
            entry.unanalysed = None
        entry.graph = None
        entry.region.outputs_changed()
        entry.guard = None
        entry.state = WARMING
        self.counters.graphs = len(self.lru)

    def invalidate(self) -> None:
        """Drop every graph of the session; keys record again after their eager runs."""
        with self.lock:
            for entry in list(self.lru):
                self.release(entry)
            for region in self.regions:
                region.clear_fast_path()
                for entry in region.entries.values():
                    if entry.state == EAGER_ONLY:
                        continue
                    if entry.unanalysed is not None:
                        self.release(entry)
                    entry.state = WARMING
            self.admission.forget(lambda counted: True)  # every key warms up again
            self.release_output_slots()
            self.counters.invalidations += 1
            log.info("session invalidated: every graph dropped")

    def close(self) -> None:
        if not self.closed:
            self.invalidate()
            self.counters.invalidations -= 1  # closing is not an invalidation by the user
            self._retired_pools.clear()
            self._pools.clear()  # the pools go (memory the caller still holds stays until it is freed)
            self.closed = True

    # --- introspection -------------------------------------------------------------------
    def stats(self) -> Stats:
        with self.lock:  # (memory_bytes walks the graphs another thread may be recording)
            stats = self.counters.copy()
            # measured when asked, not after every recording: it walks every graph and slot set
            stats.graph_memory_bytes = 0 if self.closed else self.memory_bytes()
        stats.calls = stats.replays + stats.eager_runs  # every call either replays or runs eagerly
        return stats

    def report(self) -> str:
        """Totals, then the most called keys (``REPORT_KEYS``) one per row, then one row per
        region for the rest: calls of keys without an entry (never recorded, or forgotten to
        keep the bookkeeping bounded) and keys beyond the listed ones. The rows add up to the
        totals."""
        keyed = []
        rest: dict[str, list[int]] = {}  # region -> [keys, calls, replays, eager runs]
        for region in self.regions:
            forgotten = region.forgotten
            if forgotten.eager_runs or forgotten.replays:
                calls = forgotten.eager_runs + forgotten.replays
                rest[region.name] = [0, calls, forgotten.replays, forgotten.eager_runs]
            for entry in region.entries.values():
                keyed.append((entry.replays + entry.eager_runs, region, entry))
        keyed.sort(key=lambda item: item[0], reverse=True)
        rows = []
        for calls, region, entry in keyed[:REPORT_KEYS]:
            graph = entry.graph
            rows.append(
                (
                    region.name,
                    _describe_key(entry.key),
                    entry.state.value if not entry.reason else f"{entry.state.value}: {entry.reason}",
                    calls,
                    entry.replays,
                    entry.eager_runs,
                    f"{graph.capture.seconds * 1e3:.2f}" if graph else "-",
                    f"{graph.memory / 2**20:.1f}" if graph else "-",
                )
            )
        for calls, region, entry in keyed[REPORT_KEYS:]:
            total = rest.setdefault(region.name, [0, 0, 0, 0])
            total[0] += 1
            total[1] += calls
            total[2] += entry.replays
            total[3] += entry.eager_runs
        for name, (count, calls, replays, eager_runs) in rest.items():
            described = f"({count} more keys and keys without an entry)" if count else "(keys without an entry)"
            rows.append((name, described, "-", calls, replays, eager_runs, "-", "-"))
        for region in self.regions:
            variants = [v for v in region.variants.values() if isinstance(v, polymorphic.VariantGraph)]
            if variants:
                replays = sum(v.replays for v in variants)
                rows.append(
                    (
                        region.name,
                        f"({len(variants)} sizes served by their bucket's graph)",
                        "-",
                        replays,
                        replays,
                        0,
                        "-",
                        "-",
                    )
                )
        text = report(self.stats(), rows)
        if self.policy.polymorphic:
            text += "\n" + "\n".join("  " + line for region in self.regions for line in region.polymorphic_report())
        if not self.can_record():
            text += "\n  no CUDA GPU: every call ran eagerly (the same results, no graphs)"
        return text

    def dump(self) -> str:
        """The generated replay source of every graph held, each after a line saying whether
        csrc/replay_step.c runs it (and if not, why)."""
        parts = []
        for entry in self.lru:
            graph = entry.graph
            if graph is not None:
                how = graph.how_it_replays() if hasattr(graph, "how_it_replays") else "replayed by this function"
                source = graph.full_source() if hasattr(graph, "full_source") else graph.source
                parts.append(f"# {how}\n{source}")
        return "\n".join(parts)


def _cuda_generator(device: int):
    try:
        return torch.cuda.default_generators[device]
    except (IndexError, RuntimeError, AttributeError):
        return None


def _clone_tensors(value: object) -> object:
    spec, leaves, _ = region_keys.flatten((value,), {}, walk_dataclasses=True)
    return region_keys.unflatten(spec, [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])[
        0
    ][0]


def capture(**policy: object) -> Session:
    """A capture session (a context manager): ``with capture(record_after=1) as cap: ...``.

    Policy (replay.policy.Policy): ``record_after`` (recent calls of a key before it may be
    recorded, default 1), ``max_graphs`` (default 64), ``record_budget`` (share of the time
    recording may take, default 0.03), ``clone_outputs`` (default False), ``verify_every``
    (0 = off), ``check_stale`` (default off, on with REPLAY_DEBUG=1).
    """
    return Session(**policy)


def graphed(fn: Callable | None = None, **policy: object):
    """A region with its own session: ``@graphed`` or ``@graphed(record_after=2)``."""
    if fn is None:
        return lambda f: graphed(f, **policy)
    return Session(**policy).region(fn)
