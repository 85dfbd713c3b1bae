"""The life of a key: its states, the moves between them (a table), and the one writer of the
state and of every index that follows it.

A key is one exact signature of a region's arguments (replay.region_keys); its :class:`Entry`
says where it stands. What follows the state lives in the region (``entries``,
``entry_shapes``, ``by_pre_key``, ``variants``, ``bucket_bases``) and in the session (``lru``,
``pending``, admission's residents). :class:`Keys` is the only code that writes any of them:
one method per event of :data:`TRANSITIONS`, each moving the state and every index together,
so that no caller keeps them in step by hand. A move the table does not list raises
:class:`TransitionError`: a bug in replay, never a user's error.

Why the states are these: each one is what decides how a call of the key is served. An
evicted or invalidated key is served exactly as a warming one (it runs eagerly until
admission lets it record again), so eviction and invalidation are events into WARMING, not
states of their own. RECORDING and ANALYSING last while the session's lock is held; they keep
a key whose capture or analysis is running apart from the keys at rest.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from replay.keying import KeyText

log = logging.getLogger("replay")

#: Entries a region keeps for keys without a graph (eager-only keys, evicted ones), beyond its
#: graphs: the least recently called go first, their counts kept in the region's totals.
MAX_IDLE_ENTRIES = 256

#: The most sizes a polymorphic region remembers a state of (a variant, or why it is padded).
MAX_VARIANT_STATES = 1024

#: Argument structures a region keeps hints of (``Region.hints``): beyond, the least recently
#: used one goes, and its structure's next warm-up is observed again.
MAX_HINTS = 256


class RecentlyUsed(collections.OrderedDict):
    """A mapping that keeps its ``limit`` most recently used entries: reading one with
    :meth:`get`, or writing one, makes it the most recent; a write beyond ``limit`` drops the
    least recent. Why: bookkeeping that callers grow by passing ever-new structures (a dict
    keyed by request id) stays within a stated count, and what goes is what was used longest
    ago, the cheapest to relearn. ``in`` leaves the order alone."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def get(self, key, default=None):
        value = super().get(key, _ABSENT)
        if value is _ABSENT:
            return default
        with contextlib.suppress(KeyError):  # (another thread dropped it meanwhile)
            self.move_to_end(key)
        return value

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


_ABSENT = object()


class KeyState(enum.Enum):
    """Where a key stands (its value is what ``report()`` shows)."""

    NO_ENTRY = "no entry"
    WARMING = "warming"
    RECORDING = "recording"
    AWAITING_ANALYSIS = "recorded, not yet analysed"
    ANALYSING = "analysing"
    REPLAYING = "recorded"
    EAGER_ONLY = "eager-only"
    SIZE_VARIANT = "a size its bucket's graph serves"


NO_ENTRY, WARMING, RECORDING, AWAITING_ANALYSIS, ANALYSING, REPLAYING, EAGER_ONLY, SIZE_VARIANT = KeyState

#: How a call of a key in each state is served.
MEANINGS: dict[KeyState, str] = {
    NO_ENTRY: "counted by admission only; its calls run eagerly (the region's forgotten totals)",
    WARMING: "runs eagerly until admission lets it record",
    RECORDING: "its capture runs (the session's lock is held)",
    AWAITING_ANALYSIS: "captured; its next call analyses the capture, then replays",
    ANALYSING: "its capture is analysed into a graph (the session's lock is held)",
    REPLAYING: "its graph serves its calls",
    EAGER_ONLY: "runs eagerly from now on (its reason says why)",
    SIZE_VARIANT: "a padded size its bucket's graph serves at its own size (polymorphic sessions)",
}

#: The indices a key is in, by state: what follows the state (``problems`` checks it). A flat
#: call's key also has its guard in the region's ``by_pre_key`` while REPLAYING.
INDICES: dict[KeyState, frozenset[str]] = {
    NO_ENTRY: frozenset(),
    WARMING: frozenset({"entries"}),
    RECORDING: frozenset({"entries"}),
    AWAITING_ANALYSIS: frozenset({"entries", "pending", "residents"}),
    ANALYSING: frozenset({"entries"}),
    REPLAYING: frozenset({"entries", "lru", "residents"}),
    EAGER_ONLY: frozenset({"entries"}),
    SIZE_VARIANT: frozenset({"variants"}),
}


@attrs.frozen
class Transition:
    """``event`` moves a key in one of ``sources`` to ``target``; ``meaning`` says when and why."""

    event: str
    sources: tuple[KeyState, ...]
    target: KeyState
    meaning: str


#: Every move a key may make. Keys applies them; the docs' table and diagram are drawn from it.
TRANSITIONS: tuple[Transition, ...] = (
    Transition("admit", (NO_ENTRY,), WARMING, "admission lets a call record it: its entry is made"),
    Transition("record", (WARMING, ANALYSING), RECORDING, "a capture starts (again, staging more, after an analysis)"),
    Transition("capture", (RECORDING,), AWAITING_ANALYSIS, "captured: held as a resident until its next call"),
    Transition("analyse", (AWAITING_ANALYSIS,), ANALYSING, "its next call takes the capture out to analyse it"),
    Transition("serve", (ANALYSING,), REPLAYING, "its graph is built and held: LRU, resident, pre-key table"),
    Transition("recapture", (REPLAYING,), REPLAYING, "a compaction recorded it again into a fresh pool"),
    Transition("retry", (RECORDING, ANALYSING), WARMING, "the capture or analysis was aborted: it records again later"),
    Transition("give_up", (RECORDING, ANALYSING), EAGER_ONLY, "the capture failed, or kept failing"),
    Transition("refuse", (WARMING,), EAGER_ONLY, "under grad mode it needs autograd, which a graph cannot record"),
    Transition("evict", (AWAITING_ANALYSIS, REPLAYING), WARMING, "a key called more often takes its place"),
    Transition(
        "release",
        (AWAITING_ANALYSIS, REPLAYING),
        WARMING,
        "its pool was retired or compacted away, or its graph's own output memory was moved",
    ),
    Transition(
        "invalidate", (AWAITING_ANALYSIS, REPLAYING), WARMING, "Session.invalidate() or close(): counts restart"
    ),
    Transition(
        "drift",
        (WARMING, AWAITING_ANALYSIS, REPLAYING, EAGER_ONLY),
        NO_ENTRY,
        "the region's globals changed: what was recorded against them goes",
    ),
    Transition("bound", (WARMING, EAGER_ONLY), NO_ENTRY, "beyond MAX_IDLE_ENTRIES idle entries, the least recent go"),
    Transition("vary", (NO_ENTRY,), SIZE_VARIANT, "an observed size runs its bucket's graph at its own size"),
    Transition(
        "drop_variant",
        (SIZE_VARIANT,),
        NO_ENTRY,
        "its bucket's graph was released, or beyond MAX_VARIANT_STATES it was replayed least",
    ),
)

_TARGETS: dict[tuple[KeyState, str], KeyState] = {
    (source, move.event): move.target for move in TRANSITIONS for source in move.sources
}


class TransitionError(RuntimeError):
    """A key was moved in a way :data:`TRANSITIONS` does not list: a bug in replay."""


def _move(entry: Entry, event: str) -> None:
    """The one place a key's state is written."""
    target = _TARGETS.get((entry.state, event))
    if target is None:
        raise TransitionError(f"a key in state {entry.state.name} cannot {event} (replay.lifecycle.TRANSITIONS)")
    entry.state = target


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

    def __init__(self, region, key: tuple, counted: tuple):
        self.region = region
        self.key = key
        self.counted = counted  # what admission counts its calls under (replay.keying.CallKeys.counted)
        self.state = NO_ENTRY  # (Keys moves it)
        self.eager_runs = 0
        self.graph: Any | None = None  # its RecordedGraph while REPLAYING (a VariantGraph as a SIZE_VARIANT)
        self.guard: Callable | None = None  # its flat calls' guard (replay.dispatch.make_guard)
        self.stage_hint: set[int] = set()
        self.copy_back_hint: set[int] = set()
        self.reason = ""
        self.retries = 0
        self.generation = 0  # replays so far: outputs handed out remember it (check_stale)
        self.unanalysed = None  # its capture, waiting for the analysis (AWAITING_ANALYSIS)
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
class Forgotten:
    """A region's calls that no entry holds: keys that never got one (called too rarely to be
    recorded, or without a GPU), entries dropped to keep the bookkeeping bounded, and sizes
    that were served by their bucket's graph. Slotted (attrs): the C gate bumps ``eager_runs``."""

    keys: int = 0  # entries dropped
    eager_runs: int = 0
    replays: int = 0


class Keys:
    """The writer of every key's state and of the indices that follow it, for one session."""

    def __init__(self, session) -> None:
        self.session = session
        self.touch: Callable = session.lru.move_to_end  # a replay's recency: the hot paths call it

    # --- entries -----------------------------------------------------------------------------
    def lookup(self, region, key: tuple) -> Entry | None:
        """``key``'s entry in ``region``, made the most recently called (None: no entry)."""
        entry = region.entries.get(key)
        if entry is not None:
            region.entries.move_to_end(key)
        return entry

    def called(self, entry: Entry) -> None:
        """A call of ``entry``'s key served without its lookup (replay.object_calls): made the
        most recently called, as :meth:`lookup` makes it (from the end, without hashing the
        key, where it is the most recent already)."""
        entry.region.entries.move_to_end(entry.key)

    def admit(self, region, key: tuple, counted: tuple) -> Entry:
        """NO_ENTRY -> WARMING: the entry of a key admission lets record; the region's idle
        entries beyond ``MAX_IDLE_ENTRIES`` go (``bound``)."""
        entry = Entry(region, key, counted)
        _move(entry, "admit")
        region.entries[key] = entry
        region.entry_shapes[counted[1]] = region.entry_shapes.get(counted[1], 0) + 1
        self._bound(region)
        return entry

    def _bound(self, region) -> None:
        """Keep at most ``MAX_IDLE_ENTRIES`` entries without a graph: a loop over thousands of
        distinct keys keeps bounded bookkeeping. A forgotten eager-only key is retried if it
        comes back (it warns again, once)."""
        if len(region.entries) <= MAX_IDLE_ENTRIES:  # no more idle entries than entries: none to drop
            return
        idle = [entry for entry in region.entries.values() if entry.state in (WARMING, EAGER_ONLY)]
        for entry in idle[: max(len(idle) - MAX_IDLE_ENTRIES, 0)]:
            self._forget(entry, "bound")
            region.forgotten.keys += 1
            region.forgotten.eager_runs += entry.eager_runs
            region.forgotten.replays += entry.replays_before

    def _forget(self, entry: Entry, event: str) -> None:
        """An entry leaves its region (NO_ENTRY), with its graph or capture if it holds one."""
        held = entry.state in (AWAITING_ANALYSIS, REPLAYING)
        _move(entry, event)
        if held:
            self._let_go(entry)
        region = entry.region
        del region.entries[entry.key]
        shapes = entry.counted[1]
        region.entry_shapes[shapes] -= 1
        if not region.entry_shapes[shapes]:
            del region.entry_shapes[shapes]
        for bucket in [b for b, base in region.bucket_bases.items() if base is entry]:
            del region.bucket_bases[bucket]  # (its readers treat a base without a graph as none)

    # --- recording -------------------------------------------------------------------------------
    def record(self, entry: Entry) -> None:
        """WARMING (or ANALYSING, to stage more) -> RECORDING: its capture starts."""
        _move(entry, "record")

    def capture(self, entry: Entry, taken) -> None:
        """RECORDING -> AWAITING_ANALYSIS: the capture is held, a resident like a graph (see
        :meth:`make_room`), until the key's next call analyses it."""
        _move(entry, "capture")
        entry.unanalysed = taken
        entry.region.router.outputs_changed()
        session = self.session
        session.pending[entry] = None
        session.admission.held(entry, entry.counted)
        self.make_room(entry, allowance=1)

    def analyse(self, entry: Entry):
        """AWAITING_ANALYSIS -> ANALYSING: the capture, taken out of the pending ones."""
        _move(entry, "analyse")
        capture, entry.unanalysed = entry.unanalysed, None
        entry.region.router.outputs_changed()
        self.session.pending.pop(entry, None)
        self.session.admission.dropped(entry)  # served again with its graph
        return capture

    def serve(self, entry: Entry, graph, guard: Callable | None, pre_key: tuple | None) -> None:
        """ANALYSING -> REPLAYING: hold the graph (beyond ``max_graphs``, the least frequently
        used other one goes: admission let this key in only if it was called more often) and
        put a flat call's key in its region's pre-key table (``guard`` None: it has none)."""
        _move(entry, "serve")
        entry.graph = graph
        entry.region.router.outputs_changed()
        session = self.session
        self.make_room(entry, allowance=0)
        session.lru[entry] = None
        session.admission.held(entry, entry.counted)
        session.counters.graphs = len(session.lru)
        if guard is not None:
            entry.guard, entry.pre_key = guard, pre_key
            candidates = entry.region.by_pre_key.setdefault(pre_key, [])
            candidates[:] = [c for c in candidates if c[2] is not entry] + [(guard, self._run_of(entry), entry)]

    def _run_of(self, entry: Entry) -> Callable:
        """What a pre-key hit of ``entry`` calls: its graph's replay, or the region's full
        replay where every ``verify_every``-th replay is verified."""
        if self.session.policy.verify_every:
            return functools.partial(entry.region.replay_flat, entry)
        return entry.graph.replay

    def recapture(self, entry: Entry, graph) -> None:
        """REPLAYING -> REPLAYING: a compaction's new graph takes the old one's place, with the
        use the old one had."""
        _move(entry, "recapture")
        admission = self.session.admission
        frequency = admission.frequency(entry)
        old, entry.graph = entry.graph, graph
        entry.replays_before += old.replays
        admission.restarted(entry, frequency)  # its new graph counts replays from 0
        old.release()
        entry.region.router.outputs_changed()
        candidates = entry.region.by_pre_key.get(entry.pre_key) if entry.pre_key is not None else None
        if candidates and not self.session.policy.verify_every:
            candidates[:] = [(g, self._run_of(e), e) if e is entry else (g, r, e) for g, r, e in candidates]

    def stop_recording(self, entry: Entry, event: str, reason: str = "") -> None:
        """RECORDING or ANALYSING -> WARMING (``retry``) or EAGER_ONLY (``give_up``, ``reason``)."""
        _move(entry, event)
        if event == "give_up":
            entry.reason = reason
            self.session.counters.eager_only_keys += 1

    def refuse(self, entry: Entry, reason: str) -> None:
        """WARMING -> EAGER_ONLY: a key no graph may serve (``reason``)."""
        _move(entry, "refuse")
        entry.reason = reason
        self.session.counters.eager_only_keys += 1

    # --- graphs going --------------------------------------------------------------------------------
    def make_room(self, entry: Entry, allowance: int) -> None:
        """Evict the least frequently used graphs and captures awaiting analysis (``pending``;
        the oldest first among equals, pending ones before graphs) other than ``entry`` until,
        with ``entry``, at most ``max_graphs + allowance`` of them are held.

        Why pending captures too: a key recorded on its last call is never analysed, and its
        capture kept a place in ``max_graphs`` (and its pool memory) for good: once
        ``max_graphs`` of them were pending, no key was ever admitted again. They are
        admission's residents from their capture on, used as often as their key was called,
        and go as graphs go. A new capture (``allowance`` 1) leaves the graph it will replace
        serving until its analysis, when it joins the graphs (``allowance`` 0): a key that
        never comes back then evicted nothing; a second capture before that makes room at
        once, so at most one is held beyond ``max_graphs``."""
        session = self.session
        limit = session.policy.max_graphs + allowance
        while len(session.lru) + len(session.pending) + (entry not in session.pending) > limit:
            others = [e for e in session.pending if e is not entry]
            _admit, victim = session.admission.victim(entry.counted, session.lru, others)
            if victim is None:
                return
            what = "capture (never analysed)" if victim in session.pending else "graph"
            self.release(victim, "evict")
            session.counters.evictions += 1
            log.info(
                "region %s, key %s: %s released for key %s, used more recently",
                victim.region.name,
                KeyText(victim.key),
                what,
                KeyText(entry.key),
            )

    def release(self, entry: Entry, event: str = "release") -> None:
        """AWAITING_ANALYSIS or REPLAYING -> WARMING: its graph or capture goes (a retired pool,
        a compaction; ``event`` says why: the transition table's "release", "evict" or
        "invalidate"); the key records again later."""
        _move(entry, event)
        self._let_go(entry)

    def _let_go(self, entry: Entry) -> None:
        """Drop an entry's graph or capture (its memory returns to the pool) and every index
        entry that follows it."""
        session, region = self.session, entry.region
        session.lru.pop(entry, None)
        session.pending.pop(entry, None)
        session.admission.dropped(entry)
        if entry.graph is not None:
            entry.replays_before += entry.graph.replays
            entry.graph.release()  # (a bucket's graph takes its size variants with it: drop_variant)
        self._withdraw(entry)
        if entry.unanalysed is not None:
            entry.unanalysed.graph.reset()
            entry.unanalysed = None
        entry.graph = None
        region.router.outputs_changed()
        entry.guard = None
        session.counters.graphs = len(session.lru)

    def _withdraw(self, entry: Entry) -> None:
        """Take ``entry`` off its region's pre-key table."""
        table = entry.region.by_pre_key
        candidates = table.get(entry.pre_key) if entry.pre_key is not None else None
        if candidates:
            candidates[:] = [c for c in candidates if c[2] is not entry]
            if not candidates:
                del table[entry.pre_key]

    def invalidate(self) -> None:
        """Every graph and capture of the session goes (``invalidate``); eager-only keys stay
        so, and every key warms up again (admission forgets its counts)."""
        session = self.session
        for entry in list(session.lru):
            self.release(entry, "invalidate")
        for region in session.regions:
            for entry in list(region.entries.values()):
                if entry.state is AWAITING_ANALYSIS:
                    self.release(entry, "invalidate")
        session.admission.forget(lambda counted: True)

    def drift(self, region) -> None:
        """The region's globals changed (``drift``): every entry goes, with its graph or
        capture, and every size variant and learnt bucket base with them."""
        with self.session.lock:
            for entry in list(region.entries.values()):
                self._forget(entry, "drift")
            for value in list(region.variants.values()):
                if value.__class__ is not str:
                    self.drop_variant(value)
            region.variants.clear()
            region.bucket_bases.clear()

    # --- polymorphic sizes (replay.polymorphic) ---------------------------------------------------------
    def learn_base(self, region, bucket: tuple, entry: Entry) -> None:
        """``entry``'s graph is the one the sizes of ``bucket`` are observed against."""
        region.bucket_bases[bucket] = entry

    def vary(self, entry: Entry, variant) -> None:
        """NO_ENTRY -> SIZE_VARIANT: ``entry``'s size is served by ``variant`` of its bucket's graph."""
        self._room_for_a_variant(entry.region)
        _move(entry, "vary")
        entry.graph = variant
        entry.region.variants[entry.key] = variant

    def not_a_variant(self, region, key: tuple, why: str) -> None:
        """Remember why the bucket's graph cannot serve ``key`` at its size (it is padded),
        within ``MAX_VARIANT_STATES`` (:meth:`_room_for_a_variant`)."""
        self._room_for_a_variant(region)
        region.variants[key] = why

    def _room_for_a_variant(self, region) -> None:
        """Keep a region's size states below ``MAX_VARIANT_STATES`` before one is added: the
        reasons for padding go first (a size that comes back is observed again), then the
        variant replayed least (its size is padded until observed again), the oldest among
        equals."""
        variants = region.variants
        if len(variants) < MAX_VARIANT_STATES:
            return
        for stale in [k for k, v in variants.items() if v.__class__ is str]:
            del variants[stale]
        if len(variants) >= MAX_VARIANT_STATES:
            least = min(variants.values(), key=lambda variant: variant.replays)
            least.release()  # (leaves its family: its bucket's graph serves on)
            self.drop_variant(least)

    def drop_variant(self, variant) -> None:
        """SIZE_VARIANT -> NO_ENTRY: the size's bucket graph went, or the region's size states
        are full and it was replayed least; it is observed again when it comes back."""
        entry = variant.entry
        _move(entry, "drop_variant")
        region = entry.region
        if region.variants.get(variant.key) is variant:
            del region.variants[variant.key]
        region.forgotten.replays += variant.replays


# --- instrumentation ------------------------------------------------------------------------------------
@contextlib.contextmanager
def runs_replaced(region, replace: Callable[[Callable], Callable]) -> Iterator[None]:
    """Inside the context, each of ``region``'s pre-key candidates runs ``replace(run)``
    (benchmarks: a replay through another path); the candidates it held come back after."""
    saved = [(candidates, list(candidates)) for candidates in region.by_pre_key.values()]
    for candidates, held in saved:
        candidates[:] = [(guard, replace(run), entry) for guard, run, entry in held]
    try:
        yield
    finally:
        for candidates, held in saved:
            candidates[:] = held


# --- the invariants ----------------------------------------------------------------------------------
def problems(session) -> list[str]:
    """Where a key's state and the indices that follow it disagree, in ``session`` (empty: in
    step). Tests ask after every move; it walks everything, so nothing else does."""
    found: list[str] = []
    for region in session.regions:
        found += _region_problems(region, session)
    for index, state in ((session.lru, REPLAYING), (session.pending, AWAITING_ANALYSIS)):
        for entry in index:
            if entry.state is not state or entry.region.entries.get(entry.key) is not entry:
                found.append(f"{KeyText(entry.key)} in the session's {state.name} index: {entry.state.name}")
    if set(session.admission.residents()) != {*session.lru, *session.pending}:
        found.append("admission's residents differ from the LRU and the pending captures")
    if session.counters.graphs != len(session.lru):
        found.append("the graphs counted differ from the LRU")
    return found


def _region_problems(region, session) -> list[str]:
    found = []
    held = {AWAITING_ANALYSIS: "unanalysed", REPLAYING: "graph"}
    indices = {"lru": session.lru, "pending": session.pending, "residents": set(session.admission.residents())}
    for key, entry in region.entries.items():
        where = f"region {region.name}, {KeyText(key)} ({entry.state.name})"
        if entry.key != key or entry.region is not region or entry.state in (NO_ENTRY, SIZE_VARIANT):
            found.append(f"{where}: not an entry of this region")
        for state, slot in held.items():
            if (getattr(entry, slot) is not None) != (entry.state is state):
                found.append(f"{where}: {slot} {'missing' if entry.state is state else 'held'}")
        held_in = {name for name, index in indices.items() if entry in index}
        if held_in != INDICES[entry.state] - {"entries", "variants"}:
            found.append(f"{where}: in {sorted(held_in)}")
        if bool(entry.reason) != (entry.state is EAGER_ONLY):
            found.append(f"{where}: a reason without being eager-only, or none")
    if region.entry_shapes != dict(collections.Counter(e.counted[1] for e in region.entries.values())):
        found.append(f"region {region.name}: entry_shapes differ from its entries' shapes")
    for pre_key, candidates in region.by_pre_key.items():
        entries = [c[2] for c in candidates]
        if not candidates or len(set(map(id, entries))) != len(entries):
            found.append(f"region {region.name}: pre-key {pre_key} lists no candidate, or one twice")
        for entry in entries:
            if entry.state is not REPLAYING or entry.pre_key != pre_key or region.entries.get(entry.key) is not entry:
                found.append(f"region {region.name}: pre-key {pre_key} lists {KeyText(entry.key)}")
    for key, value in region.variants.items():
        if value.__class__ is not str and (value.entry.state is not SIZE_VARIANT or value.key != key):
            found.append(f"region {region.name}: variant {KeyText(key)} is {value.entry.state.name}")
    for bucket, entry in region.bucket_bases.items():
        if region.entries.get(entry.key) is not entry:
            found.append(f"region {region.name}: bucket base {bucket} is no entry of the region")
    return found


# --- the table, as the docs show it ------------------------------------------------------------------
def transition_table() -> str:
    """:data:`TRANSITIONS` as a markdown table."""
    rows = ["| event | from | to | when, and why |", "|---|---|---|---|"]
    for move in TRANSITIONS:
        sources = ", ".join(state.name for state in move.sources)
        rows.append(f"| `{move.event}` | {sources} | {move.target.name} | {move.meaning} |")
    return "\n".join(rows)


def state_diagram() -> str:
    """:data:`TRANSITIONS` as a mermaid state diagram."""
    lines = ["stateDiagram-v2", f"    [*] --> {NO_ENTRY.name}"]
    for move in TRANSITIONS:
        lines += [f"    {source.name} --> {move.target.name}: {move.event}" for source in move.sources]
    return "\n".join(lines)


def life_of_a_key() -> str:
    """The start of the docs' section "The life of a key" (docs/replay.md): the states, the
    table of moves and its diagram, drawn from :data:`MEANINGS`, :data:`INDICES` and
    :data:`TRANSITIONS`."""
    states = "\n".join(
        f"| {state.name} | {state.value} | {MEANINGS[state]} | {', '.join(sorted(INDICES[state])) or '-'} |"
        for state in KeyState
    )
    return (
        "### States and moves\n\n"
        "A key's state decides how its calls are served; replay/lifecycle.py moves it, and the indices\n"
        "that follow it, in one place. Evicted and invalidated keys are served as warming ones: those\n"
        "are events, not states. A move the table does not list raises (a bug in replay).\n\n"
        "| state | report() says | a call | indices it is in |\n|---|---|---|---|\n"
        f"{states}\n\n{transition_table()}\n\n```mermaid\n{state_diagram()}\n```\n"
    )
