"""A region's flat call dispatched: its pre-key, the recorded keys' guards, the eager path.

A flat call (positional tensors and constants, the usual call of a loop) is served without
flattening it or computing its full key: its pre-key (each tensor's shape, each constant) is
looked up in the region's table of recorded keys (``by_pre_key``), whose candidates' guards
check everything else the key holds; a call no candidate serves, of shapes no key has an
entry for, is counted by admission and, unless the count calls for the whole rule, run
eagerly at once. Everything else is the region's full path (replay.region).

Two implementations, driven by one :class:`DispatchProgram`: ``EagerGate`` in C
(csrc/replay_eager.c), and :class:`FlatDispatch`, its Python fallback where that file is not
built or ``JITCORE_NATIVE=0``. Why in C at all: in a loop whose shapes rarely repeat nearly
every call runs eagerly, and what the session adds to such a call is this bookkeeping; from
Python, inside a real region's loop, it cost several times what it costs alone (the loop's
own work leaves the interpreter's caches cold). tests/replay/test_session.py runs both over
the same calls and compares every count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import attrs
import torch

from jitcore.for_replay import ArgumentCheck, compiled_helpers_enabled, current_device_reader, make_guard
from replay import recording, region_keys, value_keys
from replay.admission import ReplayTimes, replay_or_guess
from replay.dynamic import Dynamic
from replay.graph import MISMATCH, compile_function
from replay.keying import DYNAMIC_MARK, PLAIN_CONSTANTS

try:  # the region's call and its flat dispatch in C (csrc/replay_eager.c; optional, built by setup.py)
    from replay._eager import EagerGate, RegionCall
except ImportError:
    EagerGate = RegionCall = None

log = logging.getLogger("replay")

#: The flat eager path times one call in ``TIMING_MASK + 1`` (admission's payback rule needs
#: what an eager call usually costs, not every call's time), and from the region's
#: ``TIMING_SETTLED``-th eager run on one in ``TIMING_MASK_SETTLED + 1``: by then the estimate
#: has had 32 samples, and each timed call costs the loop a call into Python. The region's
#: replays are timed on the same schedule, counted apart (ReplayTimes.runs).
TIMING_MASK = 7
TIMING_SETTLED = 256
TIMING_MASK_SETTLED = 63

#: The quiet bound (EagerCost.refresh) is computed for an eager cost this many times the
#: region's estimate and a replay cost this many times less than its estimate, and asked again
#: only when an estimate leaves the band around the one it was computed for (that divided by
#: this, to that times this). Why: the estimates move at nearly every timed call, and asking
#: the payback rule again each time is a chain of Python calls inside the eager path. Why it
#: stays exact: what pays back only grows with what a replay saves (a longer eager call, a
#: shorter replay), so no count below a bound computed for a larger saving pays back at a
#: smaller one; the counts between it and the exact bound ask the whole rule, as every count
#: above does.
QUIET_HEADROOM = 1.125

#: ``with`` it around an eager run: it may load kernels, so not while another thread captures
#: (jitcore.recorder.CaptureExclusion). The one shared-holding object, looked up once.
SHARED_CAPTURE_EXCLUSION = recording.CAPTURES.shared()

#: What the dispatch returns for a call the region's full path must take.
MISS = object()
#: What :attr:`DispatchProgram.decide` returns for a call that runs eagerly (the dispatch runs it).
RUN_EAGERLY = object()
#: The argument structure of a flat call of n arguments, made once for the usual arities.
FLAT_SPECS = tuple((region_keys.FLAT, count) for count in range(32))


def native_enabled() -> bool:
    """Whether replay._eager was built and ``JITCORE_NATIVE`` does not turn compiled helpers off."""
    return EagerGate is not None and compiled_helpers_enabled()


def plain_when_unpadded(policy) -> bool:
    """Whether a call whose ``replay.padded`` markers need no padding is dispatched as the plain
    call: where the session has buckets, and neither verifies padded calls nor serves them
    polymorphically."""
    return policy.buckets is not None and not policy.verify_every and not policy.polymorphic


class RegionDrift(Exception):
    """The region's globals changed since its graphs were recorded: raised by its globals check
    on a pre-key hit, before any replay; the region's call re-keys."""


def _raise_region_drift(name: str) -> None:
    raise RegionDrift(name)


def globals_check(snapshot, name: str) -> Callable[[], None] | None:
    """The region's globals check as a function of its own, raising RegionDrift (None: nothing
    to check). Generated from the snapshot's check lines, as the snapshot's own check is."""
    if not snapshot.check_lines:
        return None
    namespace = {**snapshot.namespace, "_rdrift": _raise_region_drift}
    source = "def region_drift():\n" + "".join(f"    {line}\n" for line in snapshot.check_lines)
    return compile_function(source, "region_drift", f"globals check of region {name}", namespace)


@attrs.define
class QuietBound:
    """Below which recent count (``below``) a call of a region's keys without an entry only
    warms or is too rare, valid while the budget's version is ``version`` (-1: ask the rule)
    and the region's estimates stay in the bands around ``computed_for`` (its eager call) and
    ``replay_for`` (its replay, or the guess) (EagerCost). Slotted (attrs): the C gate reads it
    on every eager call."""

    below: int = 0
    version: int = -1
    computed_for: float = 0.0
    replay_for: float = 0.0


class EagerCost:
    """What an eager call of a region usually costs and what a replay of its graphs costs
    (their difference is what a replay saves: admission's payback rule), and the quiet bound
    derived from them. ``clock``: what its timings read (the region's)."""

    def __init__(self, admission, clock: Callable[[], float]) -> None:
        self.admission = admission
        self.clock = clock
        self.seconds = 0.0  # the estimate, 0 until a second call was timed
        self.sample = 0.0  # the same, from the first timed call on
        self.replay = ReplayTimes()
        self.quiet = QuietBound()

    def replayed(self, seconds: float) -> None:
        """A timed steady replay of one of the region's graphs (ReplayTimes)."""
        self.replay.took(seconds)
        self._moved()

    def saving(self) -> float:
        """What one replay saves over an eager call (admission's budget counts it per replay)."""
        return self.replay.saving(self.seconds)

    def took(self, seconds: float) -> None:
        """A timed eager call: a drop is taken at once, a rise an eighth at a time, so a call
        that compiled or waited for the GPU does not make recordings look cheap. The first
        call is not trusted at all (it loads kernels, allocates): until a second one is timed,
        the estimate stays 0 and no key pays back."""
        usual = self.sample
        self.sample = seconds if seconds < usual or not usual else usual + (seconds - usual) / 8
        if usual:
            self.seconds = self.sample
            self._moved()

    def _moved(self) -> None:
        """An estimate moved: the quiet bound is asked again where one left its band."""
        quiet = self.quiet
        replay = replay_or_guess(self.replay.seconds)
        if not (
            quiet.computed_for / QUIET_HEADROOM <= self.seconds <= quiet.computed_for * QUIET_HEADROOM
            and quiet.replay_for / QUIET_HEADROOM <= replay <= quiet.replay_for * QUIET_HEADROOM
        ):
            self.refresh()  # out of a band: what pays back may have changed
        elif quiet.below and log.isEnabledFor(logging.DEBUG):
            self.refresh()  # debug logging turned on: every call says why

    def refresh(self) -> None:
        """Remember below which recent count a call of the region's keys only warms or is too
        rare (admission.quiet_below), computed for ``QUIET_HEADROOM`` times the eager estimate
        and the replay's over it, so that the flat eager path skips the rule for those: same
        decisions, same counts. Asked again when the budget changes (its version) or an
        estimate leaves its band; not used where debug logging was on when it was last asked
        (the rule then says why each time)."""
        quiet, admission = self.quiet, self.admission
        quiet.version = admission.budget.version
        quiet.computed_for = self.seconds
        quiet.replay_for = replay_or_guess(self.replay.seconds)
        if log.isEnabledFor(logging.DEBUG):
            quiet.below = 0
        else:
            quiet.below = admission.quiet_below(self.seconds * QUIET_HEADROOM, quiet.replay_for / QUIET_HEADROOM)

    def replay_graph(self, graph, leaves: Sequence) -> object:
        """``graph`` replayed on a call's leaves by the region's full path (the calls its flat
        dispatch does not serve, every replay of a session that verifies replays, a variant's),
        counted and timed as the dispatch times the replays it serves; a graph's first replay
        never (cold: see ReplayTimes), a replay that declines neither."""
        times = self.replay
        times.runs = runs = times.runs + 1
        if runs & (TIMING_MASK if runs < TIMING_SETTLED else TIMING_MASK_SETTLED) or not graph.replays:
            return graph.replay(*leaves)
        clock = self.clock
        started = clock()
        result = graph.replay(*leaves)
        if result is not MISMATCH:
            self.replayed(clock() - started)
        return result


_fixed = attrs.setters.frozen  # read once, when a dispatcher is made: setting one later raises


@attrs.define
class DispatchProgram:
    """What a region's flat call is dispatched by: the one object EagerGate (C) and
    FlatDispatch (Python) read, by field name. Fixed fields are read when the dispatcher is
    made; the others on each use (tests and instrumentation may swap them)."""

    # the region's state the call reads and writes (each object is updated in place)
    region: object = attrs.field(on_setattr=_fixed)  # counted under (region, shapes)
    by_pre_key: dict = attrs.field(on_setattr=_fixed)  # pre-key -> [(guard, replay, entry)]
    entry_shapes: dict = attrs.field(on_setattr=_fixed)  # shapes with an entry: their calls need the full key
    session: Any = attrs.field(on_setattr=_fixed)  # closed, _gpu
    admission: Any = attrs.field(on_setattr=_fixed)  # record_after
    sketch: Any = attrs.field(on_setattr=_fixed)  # admission's counts (calls, window, counts, halve)
    budget: Any = attrs.field(on_setattr=_fixed)  # version
    counters: Any = attrs.field(on_setattr=_fixed)  # the session's Stats: too_rare, eager_runs
    forgotten: Any = attrs.field(on_setattr=_fixed)  # eager_runs of keys without an entry
    quiet: QuietBound = attrs.field(on_setattr=_fixed)
    replay_times: ReplayTimes = attrs.field(on_setattr=_fixed)  # runs: the region's replays, counted
    fn: Callable = attrs.field(on_setattr=_fixed)  # the region's function
    exclusion: AbstractContextManager = attrs.field(on_setattr=_fixed)  # the capture exclusion's shared side
    touch: Callable = attrs.field(on_setattr=_fixed)  # a replay's recency in the session's LRU
    clock: Callable[[], float] = attrs.field(on_setattr=_fixed)
    # replay.padded markers taken as their tensors where they need no padding (None: never)
    padded_type: type | None = attrs.field(on_setattr=_fixed)
    buckets: frozenset = attrs.field(on_setattr=_fixed)
    largest: int = attrs.field(on_setattr=_fixed)
    # the rare paths, in Python (read on each use)
    decide: Callable  # (args, counted, spec, count) -> result or RUN_EAGERLY: the whole admission rule
    took: Callable[[float], None]  # a timed eager run (EagerCost.took)
    replayed: Callable[[float], None]  # a timed replay (EagerCost.replayed)
    full_path: Callable  # (args, kwargs): the region's full path, for a call taken unpadded
    region_drift: Callable[[], None] | None = None  # the globals check of a hit (globals_check)
    # constants
    specs: tuple = attrs.field(default=FLAT_SPECS, on_setattr=_fixed)
    flat: object = attrs.field(default=region_keys.FLAT, on_setattr=_fixed)  # a spec's head beyond specs
    tensor_type: type = attrs.field(default=torch.Tensor, on_setattr=_fixed)  # exactly
    dynamic_type: type = attrs.field(default=Dynamic, on_setattr=_fixed)  # exactly
    dynamic_mark: tuple = attrs.field(default=DYNAMIC_MARK, on_setattr=_fixed)
    plain: frozenset = attrs.field(default=PLAIN_CONSTANTS, on_setattr=_fixed)
    miss: object = attrs.field(default=MISS, on_setattr=_fixed)
    eagerly: object = attrs.field(default=RUN_EAGERLY, on_setattr=_fixed)  # decide's answer: run it eagerly
    declined: object = attrs.field(default=MISMATCH, on_setattr=_fixed)  # a replay that declines
    # whether the replays of hits are counted and timed here (False: each times its own, as a
    # session that verifies replays does: its hits replay through the region's full replay)
    time_replays: bool = attrs.field(default=True, on_setattr=_fixed)
    mask: int = attrs.field(default=TIMING_MASK, on_setattr=_fixed)
    settled: int = attrs.field(default=TIMING_SETTLED, on_setattr=_fixed)
    settled_mask: int = attrs.field(default=TIMING_MASK_SETTLED, on_setattr=_fixed)


def make_dispatch(program: DispatchProgram) -> Callable:
    """The region's flat dispatch: ``dispatch(args) -> result or MISS``, in C where built."""
    return EagerGate(program) if native_enabled() else FlatDispatch(program)


#: The program's fixed fields, which FlatDispatch holds as its own slots (as EagerGate does).
_HELD = tuple(field.name for field in attrs.fields(DispatchProgram) if field.on_setattr is _fixed)


class FlatDispatch:
    """EagerGate's Python fallback (csrc/replay_eager.c): the same steps, from the same program
    (its fixed fields held here when made, its live ones read from it on each use)."""

    __slots__ = ("program", *_HELD)

    # the held fields (set from the program in __init__), typed as DispatchProgram types them
    program: DispatchProgram
    region: object
    by_pre_key: dict
    entry_shapes: dict
    session: Any
    admission: Any
    sketch: Any
    budget: Any
    counters: Any
    forgotten: Any
    quiet: QuietBound
    replay_times: ReplayTimes
    fn: Callable
    exclusion: AbstractContextManager
    touch: Callable
    clock: Callable[[], float]
    padded_type: type | None
    buckets: frozenset
    largest: int
    specs: tuple
    flat: object
    tensor_type: type
    dynamic_type: type
    dynamic_mark: tuple
    plain: frozenset
    miss: object
    eagerly: object
    declined: object
    time_replays: bool
    mask: int
    settled: int
    settled_mask: int

    def __init__(self, program: DispatchProgram) -> None:
        self.program = program
        for name in _HELD:
            setattr(self, name, getattr(program, name))

    def __call__(self, args: tuple) -> object:
        """A flat call: its pre-key, its markers that need no padding taken as their tensors."""
        pre, plain, unpadded = [], True, None
        tensor_type, dynamic_type = self.tensor_type, self.dynamic_type
        try:
            for arg in args:
                kind = arg.__class__
                if kind is tensor_type:
                    pre.append(arg.shape)  # a strided nested tensor raises: the full path refuses it
                elif kind is dynamic_type:
                    pre.append(self.dynamic_mark)
                    plain = False
                elif kind is self.padded_type:
                    tensor = self._unpadded(arg, unpadded)
                    if tensor is None:
                        return self.miss  # padded, or markers that disagree: the full path
                    unpadded = unpadded or [list(args), arg.dim, tensor.shape[arg.dim]]
                    unpadded[0][len(pre)] = tensor
                    pre.append(tensor.shape)
                else:
                    pre.append(arg)
                    plain = plain and kind in self.plain
        except RuntimeError:
            return self.miss
        if unpadded is None:
            return self.known_pre_key(args, tuple(pre), plain)
        if not plain:
            return self.miss  # (markers beside a dynamic scalar or another constant: the full path)
        args = tuple(unpadded[0])
        result = self.known_pre_key(args, tuple(pre), True)
        return self.program.full_path(args, {}) if result is self.miss else result

    def _unpadded(self, marker: Any, unpadded: list | None) -> torch.Tensor | None:
        """A marker's tensor where its size needs no padding (beyond the largest bucket, or a
        bucket's size) and it agrees with the markers before it; else None."""
        tensor: torch.Tensor = marker.tensor  # (a replay.buckets.Padded)
        dim = marker.dim
        if tensor.__class__ is not self.tensor_type or dim.__class__ is not int:
            return None
        try:
            rows = tensor.shape[dim] if dim >= 0 else None
        except (IndexError, RuntimeError):  # a marker whose tensor changed, a nested one
            return None
        if rows is None or (unpadded is not None and (dim != unpadded[1] or rows != unpadded[2])):
            return None
        return tensor if rows > self.largest or rows in self.buckets else None

    def known_pre_key(self, args: tuple, pre: tuple, plain: bool) -> object:
        """A recorded key's hit replays; a call none serves, of tensors and plain constants
        (``plain``), takes the eager path; anything else the full path."""
        table = self.by_pre_key
        if table:
            try:
                candidates = table.get(pre)
            except (TypeError, RuntimeError):  # an unhashable constant: the full path's
                return self.miss
            for guard, run, entry in candidates or ():
                if guard(*args):
                    drift = self.program.region_drift
                    if drift is not None:
                        drift()
                    self.touch(entry)
                    if self.time_replays:  # counted; one in mask + 1 timed, as eager runs are
                        times = self.replay_times
                        times.runs = runs = times.runs + 1
                        if not runs & (self.mask if runs < self.settled else self.settled_mask):
                            result = self.timed_replay(run, args)
                        else:
                            result = run(*args)
                    else:
                        result = run(*args)
                    if result is not self.declined:  # else another candidate may serve it
                        return result
        return self.unrecorded(args, pre) if plain else self.miss

    def timed_replay(self, run: Callable, args: tuple) -> object:
        """A hit's replay, timed (a replay that declines is not)."""
        clock = self.clock
        started = clock()
        result = run(*args)
        if result is not self.declined:
            self.program.replayed(clock() - started)
        return result

    def unrecorded(self, args: tuple, pre: tuple) -> object:
        """A flat call of shapes no key has an entry for, counted: warming or too rare as the
        rule would say (the quiet bound) runs eagerly at once; any other count asks the rule."""
        session = self.session
        if session.closed or not session._gpu:
            return self.miss  # the full path raises, or says once that everything runs eagerly
        count, specs = len(args), self.specs
        spec = specs[count] if count < len(specs) else (self.flat, count)
        shapes = (spec, pre)
        if shapes in self.entry_shapes:
            return self.miss  # a key with these shapes has an entry: its full key decides
        counted = (self.region, shapes)
        calls = self.sketch.add(counted)
        record_after = self.admission.record_after
        quiet = self.quiet
        if calls < quiet.below and calls != record_after and quiet.version == self.budget.version:
            if calls > record_after:
                self.counters.too_rare += 1
            return self.run_eagerly(args)
        result = self.program.decide(args, counted, spec, calls)
        return self.run_eagerly(args) if result is self.eagerly else result

    def run_eagerly(self, args: tuple) -> object:
        """The region's function on the call's arguments, counted; some calls timed."""
        self.counters.eager_runs += 1
        forgotten = self.forgotten
        forgotten.eager_runs += 1
        runs = forgotten.eager_runs
        if runs & (self.mask if runs < self.settled else self.settled_mask):
            with self.exclusion:  # may load kernels: not while another thread captures
                return self.fn(*args)
        clock = self.clock
        with self.exclusion:
            started = clock()
            result = self.fn(*args)
        self.program.took(clock() - started)
        return result


# --- the recorded keys' guards ---------------------------------------------------------------------
def pre_key(leaves: Sequence) -> tuple:
    """A flat call's pre-key: each tensor's shape, each dynamic scalar's mark, each constant."""
    return tuple(
        leaf.shape if type(leaf) is torch.Tensor else (DYNAMIC_MARK if isinstance(leaf, Dynamic) else leaf)
        for leaf in leaves
    )


def flat_guard(device: int, spec: object, leaves: Sequence) -> tuple[Callable | None, tuple | None]:
    """``(guard, pre-key)`` of a recorded key of flat calls: ``guard(*args) -> bool`` says the
    call is exactly this key. (None, None) for a key no pre-key serves (keyword arguments,
    nested ones, constants other than plain values)."""
    if spec[0] != region_keys.FLAT:
        return None, None
    checks = []
    for leaf in leaves:
        if type(leaf) is torch.Tensor:
            checks.append(ArgumentCheck.tensor(leaf, list(leaf.shape), list(leaf.stride())))
        elif isinstance(leaf, Dynamic):
            checks.append(ArgumentCheck.wrapping(Dynamic, "value", type(leaf.value)))
        elif isinstance(leaf, float):  # by bits: -0.0 is not 0.0, a NaN is itself
            checks.append(ArgumentCheck.equal_through(leaf, value_keys.float_bits))
        elif isinstance(leaf, (bool, int, str, type(None))):
            checks.append(ArgumentCheck.equal(leaf))
        else:
            return None, None
    pre = pre_key(leaves)
    try:
        hash(pre)
    except TypeError:
        return None, None
    guard = make_guard(
        checks,
        device=device,
        current_device=current_device_reader(),
        description="replay guard of a key",
        packed=True,
    )
    return guard, pre
