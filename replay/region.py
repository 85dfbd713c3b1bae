"""A region: a function whose calls are recorded into graphs and replayed, key by key.

A call is first offered to the region's flat dispatch (replay.dispatch: a pre-key hit
replays, a call of shapes without an entry is counted and usually runs eagerly at once).
What that leaves is this module's full path: a call with ``replay.padded`` markers is routed
by replay.routing; any other is flattened once, into the
:class:`~replay.region_keys.FlatCall` every later step reads, counted by admission
(replay.keying.counted_shapes) and, where the rule lets it or its shapes have an entry, keyed
(replay.region_keys.region_key); the key's state (replay.lifecycle) says whether it replays,
records (replay.orchestration), or runs eagerly.

Object arguments (a Hugging Face cache, a state class, a module) are walked on this path
(replay.objects): the flat dispatch hands every call passing one here, so each such call
computes its full key, which checks the objects' structure and plain values. A key whose
observed or captured run did what no graph replays (a Python assignment to an object or to
watched state, a draw from the CPU generator: replay.effects) runs eagerly from then on.
"""

from __future__ import annotations

import enum
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import attrs
import torch

from jitcore import GlobalDriftError
from replay import buckets, effects, object_calls, objects, region_keys, watch
from replay.dispatch import MISS as _MISS
from replay.dispatch import (
    RUN_EAGERLY,
    SHARED_CAPTURE_EXCLUSION,
    DispatchProgram,
    EagerCost,
    RegionDrift,
    globals_check,
    make_dispatch,
    native_enabled,
    plain_when_unpadded,
)
from replay.errors import RefusedKey
from replay.graph import MISMATCH, RecordedGraph
from replay.keying import CallKeys
from replay.lifecycle import (
    AWAITING_ANALYSIS,
    EAGER_ONLY,
    MAX_HINTS,
    REPLAYING,
    WARMING,
    Entry,
    Forgotten,
    RecentlyUsed,
)
from replay.orchestration import KeyRecorder
from replay.region_keys import FlatCall
from replay.routing import Router
from replay.warn import warn

log = logging.getLogger("replay")

#: Reasons of refused calls a region remembers (each warned once): a loop of ever-new reasons
#: keeps a bounded set.
MAX_REFUSALS = 256


class Decision(enum.Enum):
    """What admission lets a call of a key without a graph do."""

    WARM = "runs eagerly, warming up"
    OBSERVE = "runs eagerly, warming up, observed"
    REFUSED = "runs eagerly, not admitted"
    TOO_RARE = "runs eagerly, its recent calls would not pay for a recording"
    DEFERRED = "runs eagerly, the recording budget is spent"
    RECORD = "is recorded"


WARM, OBSERVE, REFUSED, TOO_RARE, DEFERRED, RECORD = Decision


class Region:
    """A function whose calls are recorded into graphs and replayed, key by key."""

    def __init__(self, session, fn: Callable, name: str | None = None):
        if not callable(fn):
            raise TypeError(f"region expects a callable, got {fn!r}")
        self.session = session
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", type(fn).__qualname__)
        # the indices of its keys (replay.lifecycle.Keys writes them): keys with an entry, least
        # recently called first; admission's shapes -> entries that have them; recorded keys of
        # flat calls by pre-key -> [(guard, replay, entry)]; polymorphic sessions: unpadded key
        # -> its VariantGraph or why its bucket's graph cannot serve it, and (bucket, argument
        # structure) -> the entry whose graph that bucket's sizes are observed against
        self.entries: OrderedDict[tuple, Entry] = OrderedDict()
        self.entry_shapes: dict[tuple, int] = {}
        self.by_pre_key: dict[tuple, list[tuple]] = {}
        self.variants: dict[tuple, object] = {}
        self.bucket_bases: dict[tuple, Entry] = {}
        self.forgotten = Forgotten()  # calls of keys that have (or kept) no entry
        self.refusals: set[str] = set()  # reasons of calls no key could be made for, warned once each
        self.unreplayable = effects.Unreplayable()  # keys whose runs did what no graph replays
        self.hints: RecentlyUsed = RecentlyUsed(MAX_HINTS)  # spec -> what its keys taught about the inputs
        self.snapshot = None  # its globals as its graphs were recorded against (take_snapshot)
        self.object_memos: tuple = ()  # what serves repeated object calls (replay.object_calls)
        self.cost = EagerCost(session.admission, time.perf_counter)
        self.said_autograd = False  # the ReplayWarning of keys that need autograd was given
        self.router = Router(self)
        self.keying = CallKeys(self)
        self.recorder = KeyRecorder(self)
        self.program = self._program()
        self.dispatch: Callable = make_dispatch(self.program)  # (args) -> result or MISS
        functools.update_wrapper(self, fn)

    def _program(self) -> DispatchProgram:
        session = self.session
        policy = session.policy
        unpadded = plain_when_unpadded(policy)  # the dispatch takes such markers as their tensors
        return DispatchProgram(
            region=self,
            by_pre_key=self.by_pre_key,
            entry_shapes=self.entry_shapes,
            session=session,
            admission=session.admission,
            sketch=session.admission.sketch,
            budget=session.admission.budget,
            counters=session.counters,
            forgotten=self.forgotten,
            quiet=self.cost.quiet,
            replay_times=self.cost.replay,
            fn=self.fn,
            exclusion=SHARED_CAPTURE_EXCLUSION,
            touch=session.keys.touch,
            clock=time.perf_counter,
            padded_type=buckets.Padded if unpadded else None,
            buckets=frozenset(policy.buckets or ()),
            largest=max(policy.buckets or (0,)),
            decide=self.decide_flat,
            took=self.cost.took,
            replayed=self.cost.replayed,
            time_replays=not policy.verify_every,  # (a verified session's hits replay through run_graph)
            full_path=self.full_path,
        )

    # --- the call ------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """Replay, or run eagerly. (Where replay._eager was built, RegionCall takes this
        method's place: see PYTHON_REGION_CALL below the class.)"""
        if not kwargs:
            try:
                result = self.dispatch(args)  # a replay, or the eager path of a flat call
            except RegionDrift:
                return self.rekey(args, kwargs)
            if result is not _MISS:
                return result
        return self.full_path(args, kwargs)

    def full_path(self, args: tuple, kwargs: dict):
        """A call the flat dispatch did not serve: routed where it pads (replay.routing), else
        flattened once, into the record every later step reads (:meth:`call_flat`)."""
        self.session.check_open()
        if self.object_memos:  # the same objects as a replayed call's, unchanged: its entry
            served = object_calls.serve(self, args, kwargs, _MISS)
            if served is not _MISS:
                return served
        if buckets.has_padded(args, kwargs):
            return self.router.call_padded(args, kwargs)
        try:
            call = region_keys.flat_call(args, kwargs, walk_objects=True)
        except RefusedKey as refused:  # a dict key no graph may bake, an object no walk can read
            return self.refused_arguments(refused, args, kwargs)
        return self.call_flat(call)

    def call_flat(self, call: FlatCall):
        """A flattened call: counted by admission (replay.keying.counted_shapes) and, where
        the rule lets it or its shapes have an entry, keyed (:meth:`_keyed_call`)."""
        session = self.session
        if not session.can_record():
            session.say_eager_once()
            return self.run_eagerly(call)
        try:
            counted = self.keying.counted(call)
        except RefusedKey as refused:
            return self.refused(refused, call)
        decision = None
        if counted[1] not in self.entry_shapes:
            # No key with these shapes has an entry, so whatever this call's full key is, it
            # has no graph: admission decides before the key (and the globals' drift check)
            # is computed, and a call that runs eagerly costs what eager costs.
            decision = self._decide(counted, call.spec)
            if decision is not RECORD and decision is not OBSERVE:
                return self.run_eagerly(call)
        return self._keyed_call(call, counted, decision)

    def _keyed_call(self, call: FlatCall, counted: tuple, decision: Decision | None):
        """A call that needs its full key: one with an entry, one admission lets record, or
        the observed warm-up of its argument structure (``decision``, already counted; None
        when the shapes have an entry). Only a call that may replay checks the globals."""
        session = self.session
        if self.snapshot is not None and decision is not OBSERVE:
            try:
                self.snapshot.check()
            except GlobalDriftError:
                self.forget_globals()
                return self.call_flat(call)
        device = session.current_device()
        try:
            key = self.keying.key_of(call, device)
        except RefusedKey as refused:
            return self.refused(refused, call)
        entry = session.keys.lookup(self, key)
        if entry is not None:
            if decision is None and entry.state is REPLAYING and len(call.spec) > 3:
                memo = object_calls.remember(self, call, key, counted, entry)
                if memo is not None:
                    object_calls.keep(self, memo)
            served = self.serve_entry(entry, key, call, device)
            if served is not _MISS:
                return served
        if decision is None:
            decision = self._decide(counted, call.spec)
        if decision is not RECORD:
            if decision is OBSERVE:  # the first warm-up of its argument structure
                return self.recorder.observed_warm_up(call, entry, key, device)
            return self.run_eagerly(call, entry)
        autograd = self.keying.needs_autograd(key, call) if torch.is_grad_enabled() else ""
        if entry is None:
            entry = session.keys.admit(self, key, counted)
            hints = self.hints.get(call.spec)
            if hints is not None:
                entry.stage_hint, entry.copy_back_hint = set(hints.stage), set(hints.copy_back)
                entry.observed_clean = hints.clean and hints.observed_key == key
        if autograd:
            return self.recorder.refuse_autograd(entry, call, autograd)
        unreplayable = self.unreplayable.reason(key)
        if unreplayable is not None and entry.state is WARMING:
            return self.recorder.refuse_unreplayable(entry, call, unreplayable)
        return self.recorder.record(entry, key, call, device)

    def keyed_call_recorded(self, call: FlatCall):
        """A call admission let record, counted and keyed again (its structure's hints changed
        its key: replay.orchestration's addressed tensors)."""
        return self._keyed_call(call, self.keying.counted(call), RECORD)

    def serve_entry(self, entry: Entry, key: tuple, call: FlatCall, device: int):
        """A call of a key with an entry, as its state says: replayed, eagerly, or analysed
        then replayed; MISS where the key has yet to record (admission decides)."""
        state = entry.state
        if state is REPLAYING:
            return self.replay(entry, call)
        if state is EAGER_ONLY:
            return self.run_eagerly(call, entry)
        if state is AWAITING_ANALYSIS:
            return self.recorder.finish(entry, key, call, device)
        return _MISS

    # --- admission -----------------------------------------------------------------------
    def decide_flat(self, args: tuple, counted: tuple, spec: object, count: int) -> object:
        """The flat dispatch's call whose count needs the whole rule (:meth:`_decide`): it
        may record or be observed (the full path serves it), else RUN_EAGERLY (the dispatch
        runs it)."""
        decision = self._decide(counted, spec, count)
        if decision is RECORD or decision is OBSERVE:
            return self._keyed_call(region_keys.flat_call(args, {}), counted, decision)
        return RUN_EAGERLY

    def _decide(self, counted: tuple, spec: object, count: int | None = None) -> Decision:
        """Count a call of a key without a graph (unless the caller did: ``count``) and say
        what it does (see replay.admission). A call kept from recording always runs
        eagerly; it is counted here, by its reason."""
        session = self.session
        admission = session.admission
        if count is None:
            count = admission.called(counted)
        if self.cost.quiet.version != admission.budget.version:
            self.cost.refresh()
        if count <= admission.record_after:  # still warming (replay.admission: record_after)
            if count == admission.record_after and spec not in self.hints:
                return OBSERVE  # the first key of its argument structure: its warm-up is observed
            return WARM
        seconds, replay = self.cost.seconds, self.cost.replay.seconds
        if not admission.pays_back(count, seconds, replay):
            return self._kept(TOO_RARE, "not recorded, too rare to pay for a recording", spec)
        if not admission.admits(counted, session.lru, session.pending):
            return self._kept(REFUSED, "not recorded, graphs held are used more", spec)
        if not admission.may_record(count, seconds, replay):
            return self._kept(DEFERRED, "recording postponed, the budget is spent", spec)
        return RECORD

    def _kept(self, decision: Decision, why: str, spec: object) -> Decision:
        """A call admission keeps from recording, counted by its reason."""
        counters = self.session.counters
        if decision is TOO_RARE:
            counters.too_rare += 1
        elif decision is REFUSED:
            counters.refused += 1
        else:
            counters.deferred += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("region %s, shapes %s: %s", self.name, spec, why)
        return decision

    # --- eager runs ------------------------------------------------------------------------
    def run_eagerly(self, call: FlatCall, entry: Entry | None = None):
        """Run the region's function on a flattened call, counted under ``entry`` (None: the
        region's aggregate), timed (the eager cost admission weighs)."""
        self.count_eager(entry)
        args, kwargs = region_keys.unflatten(call.spec, region_keys.plain_leaves(call.leaves))
        with SHARED_CAPTURE_EXCLUSION:  # may load kernels: not while another thread captures
            started = time.perf_counter()
            result = self.fn(*args, **kwargs)
        self.cost.took(time.perf_counter() - started)  # (rarer than the flat path's: every call)
        return result

    def count_eager(self, entry: Entry | None) -> None:
        """Count an eager run: the session's, and the key's (in the region's aggregate for a
        key without an entry)."""
        self.session.counters.eager_runs += 1
        if entry is not None:
            entry.eager_runs += 1
        else:
            self.forgotten.eager_runs += 1

    def refused(self, refused: RefusedKey, call: FlatCall):
        """A call whose key cannot be made exactly (RefusedKey: an argument a graph
        would bake without seeing it change, a constant whose equality is not exact, a torch
        setting that cannot be read) runs eagerly, with one ReplayWarning per reason (naming
        the argument)."""
        self.warn_once(refused.reason)
        return self.run_eagerly(call)

    def refused_arguments(self, refused: RefusedKey, args: tuple, kwargs: dict):
        """:meth:`refused`, for a call flatten itself refused: it runs on its arguments."""
        self.warn_once(refused.reason)
        self.count_eager(None)
        with SHARED_CAPTURE_EXCLUSION:
            return self.fn(*args, **kwargs)

    def warn_once(self, reason: str) -> None:
        """One ReplayWarning per reason calls run eagerly (a bounded set of reasons kept)."""
        if reason not in self.refusals:
            if len(self.refusals) < MAX_REFUSALS:
                self.refusals.add(reason)
            log.info("region %s: runs eagerly: %s", self.name, reason)
            warn(f"region {self.name}: runs eagerly: {reason}")

    def run_declined(self, call: FlatCall):
        """A call no graph may serve exactly (see buckets.call): eagerly, counted as declined."""
        self.session.counters.declined += 1
        return self.run_eagerly(call)

    # --- replays ---------------------------------------------------------------------------
    def replay(self, entry: Entry, call: FlatCall):
        """Replay ``entry``'s graph on a call of its key (the LRU touched)."""
        self.session.keys.touch(entry)
        return self.run_graph(entry.graph, call, entry)

    def replay_flat(self, entry: Entry, *args):
        """A pre-key hit's replay where replays are verified (lifecycle.Keys._run_of): a flat
        call's arguments, as the dispatch passes them."""
        return self.replay(entry, region_keys.flat_call(args, {}))

    def run_graph(self, graph: RecordedGraph, call: FlatCall, entry: Entry | None):
        """Replay ``graph`` on ``call`` (every ``verify_every``-th replay verified); a call it
        declines runs eagerly, counted under ``entry`` (None: a variant, counted with the region)."""
        every = self.session.policy.verify_every
        if every and (graph.replays + 1) % every == 0 and objects.copyable(call.spec, call.leaves):
            self.session.counters.verifications += 1
            result = graph.verify(call.leaves, lambda snapshot: self._run_on_copies(call, snapshot))
        else:
            result = self.cost.replay_graph(graph, call.leaves)  # (counted, some timed)
        if result is MISMATCH:
            # the graph cannot serve these values exactly (see replay.graph): the eager run
            # gives the exact result, or the exact error
            self.session.counters.declined += 1
            if graph.spoiled is not None and entry is not None and entry.graph is graph:
                # its own output memory moved (a resize_ of a handed-out output): it declines
                # every call from now on, so it goes and the key records again
                self.session.keys.release(entry)
            return self.run_eagerly(call, entry)
        return result

    def _run_on_copies(self, call: FlatCall, copies: list):
        """A verification's eager run, on copies of the call's tensors (and objects: a deep
        copy of each, holding those copies, so that the region's writes never reach the
        caller's objects a second time)."""
        return self.run_eagerly(attrs.evolve(call, leaves=objects.with_copied_objects(call.spec, call.leaves, copies)))

    # --- its globals -----------------------------------------------------------------------
    def take_snapshot(self) -> None:
        """Snapshot the globals the region reads, before its first recording: a change of
        them re-keys (:meth:`rekey`), checked on every pre-key hit and keyed call."""
        if self.snapshot is None:
            self.snapshot = watch.RegionSnapshot(self.fn, owner=f"region {self.name}", prefix="_r")
            self.program.region_drift = globals_check(self.snapshot, self.name)

    def rekey(self, args: tuple, kwargs: dict):
        """The region's globals changed (its dispatch found it): its graphs were recorded
        against the old ones."""
        self.forget_globals()
        return self.full_path(args, kwargs)

    def forget_globals(self) -> None:
        """Drop what the region learnt under its old globals: its keys, hints and counts."""
        session = self.session
        session.counters.invalidations += 1
        log.info("region %s: its globals changed, its graphs are dropped", self.name)
        session.keys.drift(self)
        session.release_output_slots(self)
        self.hints.clear()
        self.object_memos = ()
        session.admission.forget(lambda counted: counted[0] is self)
        self.snapshot = None
        self.program.region_drift = None

    def __repr__(self) -> str:
        return f"<replay region {self.name}: {len(self.entries)} keys>"


#: Region.__call__ as Python runs it; replaced below by its C version where that was built
#: (csrc/replay_eager.c, RegionCall: the same steps, without a Python frame of its own on every call).
PYTHON_REGION_CALL = Region.__call__
if native_enabled():
    from replay.dispatch import RegionCall

    Region.__call__ = RegionCall(miss=_MISS, drift=RegionDrift)
