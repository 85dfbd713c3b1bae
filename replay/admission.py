"""Which keys get a graph, and when recording may spend time: the session's cache policy.

Why a policy at all: a loop whose batch size changes every step (1..256 at random) made the
plain rule "record a key on its second call, keep the most recently replayed ``max_graphs``"
thrash. Every miss recorded a graph (far dearer than a call) only to evict another that was
just as likely to come back, and the loop ran slower than eagerly. Yet caution has its own
cost: a loop over a few sizes that held its recordings back ran its first hundreds of steps
eagerly, slower than if it had recorded every size at once. A recording is an investment,
judged here by what the session measured: it costs what this session's recordings cost (a
capture, and the analysis on the key's next call), and every later call of the key saves
what an eager call of its region costs less what a replay of it costs.

- **Frequency-based admission** (after TinyLFU: Einziger, Friedman and Manes, 2017): a key is
  recorded once it has been called ``record_after + 1`` times *recently* (counts halve every
  ``window`` calls, so a key seen once an hour ago and once now is not "frequent"). When the
  cache is full, a new key is admitted only if it was called ``ADMISSION_MARGIN`` times as
  often recently as the graph it would replace, which is the least frequently replayed one
  (the least recently replayed among equals): a hot key is never evicted for a cold one, and
  keys of about equal frequency (a uniform mix of more shapes than graphs) do not take turns,
  each recording paid for by nothing. Recordings not analysed yet take a place and are
  victims like graphs (see Admission.victim): a key recorded on its last call is never
  analysed, and must not keep its place for good.
- **Recordings that pay back** (ski rental): a key is recorded once its expected calls times
  what each saves (the region's eager time less its replay time) reach what a recording
  usually costs here. The eager time is the region's estimate (replay.dispatch.EagerCost);
  the replay time is sampled on the region's steady replays (ReplayTimes; a key's first
  replay, cold, is never taken; ``REPLAY_SECONDS_GUESS`` until one was); a recording costs
  the median of the recent captures plus the median of the recent analyses. A key's expected
  calls are its recent count as its peers judge it (below) times ``PAYBACK_HORIZON``, or,
  before the first halving, its calls after the first, over the calls counted so far, times
  ``EARLY_CALLS``, where that is more. Why the early bet: until the first halving a count
  covers every call of the session, and a loop is bet to run at least ``EARLY_CALLS`` calls;
  a key that came back once in a loop's first five calls is expected back about a fifth of
  those, so a loop over three sizes records each on its second call, while in a uniform mix of
  hundreds of sizes a key comes back after dozens of calls, and is expected back a few times.
  (Its first call says nothing of a key's rate: every key has one, and a prefill of lengths
  seen once records none of them.)
- **Counts judged against their peers** (Buhlmann's credibility, empirical Bayes): the
  payback rule bets that a key comes back as often as it came recently. For the keys that
  stand out in a uniform mix, that bet loses: every key comes back equally often, and the
  highest counts are the ones counting happened to raise (a key seen 10 times among keys
  seen 7.5 times on average is expected back 7.5 times, not 10). So at each halving the
  sketch notes how its counts spread beyond what counting alone spreads them by
  (``Peers``), and the rule takes a key's expected count to be its peers' mean plus that
  share of its lead: the whole lead where rates really differ (a Zipf-like mix, a few hot
  sizes), none of it in a uniform mix, never more than its own count: a uniform mix records
  its first recordings, then hardly any (docs/benchmarks/shapes.md). Before
  the first halving the peers are the counts as they stand (``EARLY_PEERS_AFTER``), so the
  first window's lucky keys are not bets either. A count far beyond anything counting gives
  its peers (``OUTLIER_SIGMAS``) is taken as it is: a size that became hot after the last
  halving does not wait for the next one.
- **A budget of what replays saved**: recording (captures, analyses, compactions, failed ones
  too) may run ahead of what the replays of the session's graphs have saved (each replay: its
  region's eager time less its replay time) by at most a grace, ``record_budget`` times
  ``GRACE_SECONDS``. A key admitted while the budget is spent runs eagerly and records later.
  A loop whose recordings are never repaid thus loses at most the grace, however long it
  runs; one whose recordings pay back may record as much as they saved. The session's first
  recordings (``FIRST_RECORDINGS``, and on until they spent ``FIRST_RECORDINGS_SHARE`` of the
  grace) are made as soon as admitted: the payback rule's inputs (what a recording, a replay,
  an eager call cost) are measured on them. One-time costs of a recording (a process's first
  capture compiles replay's own kernels) are charged only up to a few times a usual one.
- **Keys that paid already are not held back by the budget**: a key whose recent eager
  calls alone would have saved what a recording usually costs (the payback rule with a
  horizon of 1, the ski-rental break-even: buying once the rent paid equals the price keeps
  the cost within twice the best choice in hindsight) records even with the budget spent.
  The budget exists against recordings that are never repaid; a key this frequent has
  shown it is not one.
- **Compaction without storms**: re-recording every graph of a device into a fresh pool (to
  undo fragmentation) happens only when the pool has grown by half since the last compaction
  (``COMPACTION_GROWTH``), and only while the graphs recorded again by compactions stay within
  half of the graphs recorded in all (plus ``RECAPTURE_ALLOWANCE``, so that the first, small
  compactions of a run can happen): a run over N shapes records at most 1.5 N +
  ``RECAPTURE_ALLOWANCE`` graphs.

This module is pure bookkeeping (no torch, no driver): the session asks it and obeys.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable
from typing import Generic, TypeVar

import attrs

#: The grace is ``record_budget`` times this many seconds: how far recording may run ahead of
#: what replays saved, the most a session loses to recordings never repaid.
GRACE_SECONDS = 2.0
#: The session's first recordings, made as soon as admitted, may spend this share of the
#: grace: the payback rule's inputs are measured on them. A uniform mix of hundreds of sizes
#: records these and, judged against their peers, hardly any other key; the rest of the grace
#: lets a loop of a few dozen sizes record ahead of its replays' savings (docs/benchmarks/shapes.md).
FIRST_RECORDINGS_SHARE = 0.5
#: ... and they are at least this many captures, whatever they spent: a process's first capture
#: and analysis pay one-time costs, and the rule's usual recording is the median of a few.
FIRST_RECORDINGS = 3

#: A recording's capture (or analysis) is charged at most this many times the median of the
#: last ``RECENT_CHARGES`` ones, and the first one at most ``FIRST_CHARGE_CAP`` seconds (see
#: RecordingBudget).
SPIKE_FACTOR = 3
RECENT_CHARGES = 16
FIRST_CHARGE_CAP = 0.02

#: Once the counts have been halved, a key is recorded only when its recent count (as its
#: peers judge it) times this many, times what a replay saves over an eager call, reaches what
#: a recording usually costs. The recent count covers about two windows (counts halve every
#: window); 2 bets that the key keeps coming about as long again. 4 let a uniform mix record
#: keys it never repaid (docs/benchmarks/shapes.md).
PAYBACK_HORIZON = 2

#: Before the first halving, the calls a loop is bet to run in all: a key counted ``c`` times
#: in the ``n`` calls counted so far is expected back ``(c - 1) * EARLY_CALLS / n`` times (when
#: that is more than the horizon above gives). As many calls as the early peers need: by then
#: the counts are judged against their peers.
EARLY_CALLS = 256

#: Counting noise (see Peers): counts of keys called at one steady rate spread, in variance,
#: by this share of their mean (a Poisson count's variance is its mean; counts aged by halvings
#: spread less, about 2/3 of it, so 1 errs toward doubting a lead).
COUNT_NOISE = 1.0

#: A count this many standard deviations of counting noise above its peers' mean is taken at
#: face value whatever the peers' credibility says (a key that became frequent since the last
#: halving: its peers' spread was measured without it). 6, not 4: the peers' mean was taken at
#: the last halving, and early in a loop (counts still growing window after window) a uniform
#: mix's ordinary counts reached 4 deviations above it.
OUTLIER_SIGMAS = 6

#: Before the first halving, counts are judged against their peers as they stand (Peers of
#: the counts so far) once this many calls were counted: without it a uniform mix recorded
#: keys in its first window at counts that counting alone gave them, none of them repaid. By
#: then a loop of a few dozen sizes has counted each of them several times.
EARLY_PEERS_AFTER = 256
#: ... and taken again once the calls have grown by this factor since (only when a decision
#: asks: a loop whose keys all run eagerly below the payback count never does).
EARLY_PEERS_GROWTH = 1.125

#: The host time a replay is taken to cost where none of its region's replays was timed yet
#: (the upper end of a replay's host time for regions of a few to a few dozen kernels:
#: docs/benchmarks/replay.md, scaling.md).
REPLAY_SECONDS_GUESS = 15e-6

#: Counts halve every ``window`` calls, with ``window = max(MIN_WINDOW, WINDOW_PER_GRAPH * max_graphs)``:
#: long enough for a key in a uniform mix of a few hundred shapes to be counted several times.
MIN_WINDOW = 1024
WINDOW_PER_GRAPH = 16

#: A new key replaces a held graph only when called this many times as often recently.
ADMISSION_MARGIN = 2

#: A compaction is due when the pool is this many times both its size after the last compaction
#: and the most any one recording needed: graph memory stays within this factor of what the
#: largest shape needs alone, while the pool's geometric growth between compactions keeps their
#: recordings proportional to the shapes.
COMPACTION_GROWTH = 1.5

#: Compaction may record again at most this fraction of the graphs recorded in all, plus
#: ``RECAPTURE_ALLOWANCE`` graphs.
RECAPTURE_SHARE = 0.5
RECAPTURE_ALLOWANCE = 16

#: quiet_below's answer when no count pays back (an eager call no dearer than a replay).
QUIET_FOREVER = 2**62

Resident = TypeVar("Resident")


def lower_median(values: list[float]) -> float:
    """The lower median (of two values, the smaller): one slow first sample among two does not
    make the usual value look slow."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


@attrs.frozen
class Peers:
    """What one window's counts said about keys in general, taken just before its halving.

    Counts spread for two reasons: keys are called at different rates, and counting itself
    spreads keys of one rate (by ``COUNT_NOISE`` times their mean, in variance). Only the first
    is worth betting on: ``credibility`` is the share of the counts' variance that counting
    does not explain (Buhlmann's Z, from the method of moments), and a key's expected count
    is its peers' mean plus that share of its lead, never more than the count itself (a key
    below the mean is not credited with its peers' calls: recording is a bet that must be
    paid for)."""

    mean: float
    credibility: float
    #: counts at or above this are taken as they are (``OUTLIER_SIGMAS``)
    outlier: float

    @classmethod
    def of(cls, counts: Collection[int]) -> Peers | None:
        if not counts:
            return None
        mean = sum(counts) / len(counts)
        spread = sum((count - mean) ** 2 for count in counts) / len(counts)
        noise = COUNT_NOISE * mean
        credibility = max(0.0, 1.0 - noise / spread) if spread > 0 else 0.0
        return cls(mean=mean, credibility=credibility, outlier=mean + OUTLIER_SIGMAS * noise**0.5)

    def expected(self, count: int) -> float:
        """The recent count to bet on for a key counted ``count`` times."""
        if count >= self.outlier:
            return count
        return min(count, self.mean + self.credibility * (count - self.mean))

    def least_count(self, expected: float) -> float:
        """About the least count whose :meth:`expected` reaches ``expected`` (exact up to
        rounding: the caller steps to the exact one with the rule's own arithmetic)."""
        if self.credibility > 0:
            shrunk = self.mean + (expected - self.mean) / self.credibility
        else:
            shrunk = expected if self.mean >= expected else float("inf")
        return min(max(expected, shrunk), max(expected, self.outlier))


@attrs.define
class FrequencySketch:
    """Recent call counts per key, halved every ``window`` counted calls.

    Exact counts in a dict (not a count-min sketch): a halving drops every key counted fewer
    than two times and halves the rest, so the counts' total after a halving stays below
    ``window`` and the dict holds at most ``2 * window`` keys, whatever the number of distinct
    keys a loop produces."""

    window: int
    counts: dict[Hashable, int] = attrs.Factory(dict)
    calls: int = 0
    halvings: int = 0
    #: the counts' spread at the last halving (before the first: as the counts stood at the
    #: last early estimate, see :meth:`current_peers`; None before that)
    peers: Peers | None = None
    #: called whenever ``peers`` changed (the admission bumps the payback rule's version)
    on_peers: Callable[[], None] | None = None
    #: the calls counted when the early peers were taken (0: not yet)
    early_at: int = 0

    def add(self, key: Hashable) -> int:
        """Count one call of ``key``; its recent count, this call included."""
        count = self.counts.get(key, 0) + 1
        self.counts[key] = count
        self.calls += 1
        if self.calls >= self.window:
            self.halve()
        return count

    def count(self, key: Hashable) -> int:
        return self.counts.get(key, 0)

    def forget(self, which: Callable[[Hashable], bool]) -> None:
        self.counts = {key: count for key, count in self.counts.items() if not which(key)}

    def halve(self) -> None:
        self.peers = Peers.of(self.counts.values())
        self.counts = {key: count // 2 for key, count in self.counts.items() if count >= 2}
        self.calls = 0
        self.halvings += 1
        if self.on_peers is not None:
            self.on_peers()

    def current_peers(self) -> Peers | None:
        """The peers the payback rule judges a count by: the last halving's; before the first
        halving, the counts as they stand, from ``EARLY_PEERS_AFTER`` calls on (taken again
        once the calls grew by ``EARLY_PEERS_GROWTH``; asked only when a decision needs them,
        a pass over the counts each time); None before that."""
        if self.halvings or self.calls < EARLY_PEERS_AFTER:
            return self.peers
        if not self.early_at or self.calls >= self.early_at * EARLY_PEERS_GROWTH:
            self.peers = Peers.of(self.counts.values())
            self.early_at = self.calls
            if self.on_peers is not None:
                self.on_peers()
        return self.peers

    def expected(self, count: int) -> float:
        """The recent count the payback rule bets on for a key counted ``count`` times (see
        Peers; the count itself while there are no peers yet)."""
        peers = self.current_peers()
        return count if peers is None else peers.expected(count)


@attrs.define
class RecordingBudget:
    """What recording spent, what a recording usually costs, and the grace (see the module
    docstring: recording runs ahead of what replays saved by at most the grace).

    Captures and analyses are charged apart (:meth:`charge`, :meth:`charge_analysis`), each at
    most ``SPIKE_FACTOR`` times the median of the recent ones of its kind (``FIRST_CHARGE_CAP``
    before there are any): the first recordings of a process also pay one-time costs (replay's
    own copy kernels compiled, the capture machinery and a collective's first capture
    initialised: many times a usual recording), which would otherwise hold every recording back
    for long. What the budget is for, a storm of recordings of about equal cost, is charged in
    full."""

    fraction: float = attrs.field(on_setattr=lambda self, _, value: self._changed(value))
    spent: float = attrs.field(default=0.0, on_setattr=lambda self, _, value: self._changed(value))
    #: the recent captures' charges; setting them (or ``analyses``) sets ``usual``
    recent: list[float] = attrs.field(factory=list, on_setattr=lambda self, _, recent: self._recent_set(recent))
    #: the recent analyses' charges (the key's next call after its capture)
    analyses: list[float] = attrs.field(factory=list, on_setattr=lambda self, _, done: self._analyses_set(done))
    #: captures of keys whose analysis is still to come (failed and evicted ones too: the first
    #: recordings err short)
    awaiting: int = attrs.field(default=0, on_setattr=lambda self, _, value: self._changed(value))
    #: What recording a key usually costs: the median capture plus the median analysis (twice
    #: the one measured while only one kind was; kept with the charges: the payback rule reads
    #: it on every call of a key past its warm-up).
    usual: float = attrs.field(default=0.0, init=False)
    #: Bumped by every change of what the payback rule reads (``fraction``, ``spent``, the
    #: charges, however it is made; the sketch's peers, through :meth:`inputs_changed` at each
    #: halving): answers derived from the rule are valid while it stays (Admission.quiet_below).
    version: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        self.usual = _usual(self.recent, self.analyses)

    def _changed(self, value: object) -> object:
        self.version += 1
        return value

    def inputs_changed(self) -> None:
        """Something else the payback rule reads changed (the sketch's peers)."""
        self.version += 1

    def _recent_set(self, recent: list[float]) -> list[float]:
        self.usual = _usual(recent, self.analyses)
        self.version += 1
        return recent

    def _analyses_set(self, analyses: list[float]) -> list[float]:
        self.usual = _usual(self.recent, analyses)
        self.version += 1
        return analyses

    @property
    def grace(self) -> float:
        """How far recording may run ahead of what replays saved (``record_budget`` times
        ``GRACE_SECONDS``)."""
        return self.fraction * GRACE_SECONDS

    def first_recordings(self) -> bool:
        """Whether keys record as soon as admitted: the session's first recordings (until
        ``FIRST_RECORDINGS`` captures were charged, and on until they spent
        ``FIRST_RECORDINGS_SHARE`` of the grace, counting the analyses still to come at what
        analyses cost), or no budget at all (``record_budget=1``). Why count the analyses to
        come: a mix of hundreds of sizes analyses a capture only when its key comes back, and
        made twice the first recordings meant."""
        if self.fraction >= 1 or len(self.recent) < FIRST_RECORDINGS:
            return True
        to_come = self.awaiting * lower_median(self.analyses or self.recent) if self.awaiting else 0.0
        return self.spent + to_come < FIRST_RECORDINGS_SHARE * self.grace

    def allows(self, saved: float) -> bool:
        """Whether recording, having spent ``spent``, is within ``saved`` plus the grace."""
        return self.fraction >= 1 or self.spent < saved + self.grace

    def charge(self, seconds: float, *, awaits_analysis: bool = False) -> None:
        """A capture took ``seconds`` (or a compaction's or a size observation's recordings;
        ``awaits_analysis``: a key's capture, analysed on its next call)."""
        charged = _capped(seconds, self.recent)
        self.spent += charged
        self.recent = [*self.recent[-(RECENT_CHARGES - 1) :], charged]
        if awaits_analysis:
            self.awaiting += 1

    def charge_analysis(self, seconds: float) -> None:
        """A capture's analysis (on its key's next call) took ``seconds``."""
        charged = _capped(seconds, self.analyses)
        self.spent += charged
        self.analyses = [*self.analyses[-(RECENT_CHARGES - 1) :], charged]
        if self.awaiting:
            self.awaiting -= 1


def _usual(captures: list[float], analyses: list[float]) -> float:
    parts = [lower_median(charges) for charges in (captures, analyses) if charges]
    return sum(parts) * 2 / len(parts) if parts else 0.0


def _capped(seconds: float, recent: list[float]) -> float:
    """``seconds`` charged against the recent charges of its kind (see RecordingBudget)."""
    cap = SPIKE_FACTOR * lower_median(recent) if recent else FIRST_CHARGE_CAP
    return min(max(seconds, 0.0), cap)


def replay_or_guess(seconds: float | None) -> float:
    """A replay's measured time, or ``REPLAY_SECONDS_GUESS`` where none was measured."""
    return REPLAY_SECONDS_GUESS if seconds is None else seconds


@attrs.define
class ReplayTimes:
    """What a steady replay of one region's graphs takes on the host (``seconds``; None until one
    was timed, where the rule takes ``REPLAY_SECONDS_GUESS``), and the region's replays counted
    (``runs``: which of them are timed).

    Which replays are timed: one in eight of the region's replays, later one in 64, as for its
    eager calls (replay.dispatch: the flat dispatch in C and in Python, and the full path's
    replays), never a graph's first. Why not its first: a freshly built replay's first launch
    (on the key's analysis call) pays one-time costs, and for a region of short calls it cost
    more than an eager call: taken as a replay's cost, no replay saved anything, and nothing
    past the session's first recordings was ever recorded. A drop is taken at once, a rise an
    eighth at a time (as replay.dispatch.EagerCost takes eager calls): a replay that waited for
    the GPU does not make every replay look slow.

    Slotted (attrs): the C gate bumps ``runs`` at its slot on every replay it serves."""

    runs: int = 0
    seconds: float | None = None

    def took(self, seconds: float) -> None:
        """A timed steady replay."""
        usual, seconds = self.seconds, max(seconds, 0.0)
        self.seconds = seconds if usual is None or seconds < usual else usual + (seconds - usual) / 8

    def saving(self, eager_seconds: float) -> float:
        """What one replay saves over an eager call of ``eager_seconds`` (never below 0)."""
        return max(0.0, eager_seconds - replay_or_guess(self.seconds))


@attrs.define
class ResidentCount:
    """A held graph's recent use: replays never pass through the sketch (the replay fast
    path only bumps the graph's own counter), so each resident keeps its own aged count."""

    aged: int  # the count carried over from earlier windows (halved at each halving)
    base: int  # the graph's replay counter when ``aged`` was last brought up to date
    halvings: int  # the sketch's halvings already applied
    paid: int  # the replay counter when its savings were last banked (Admission.saved)


def _no_saving(resident: object) -> float:
    return 0.0


class Admission(Generic[Resident]):
    """The session's admission and eviction decisions (see the module docstring).

    ``replays(resident)`` reads a held graph's replay counter, ``saving(resident)`` what one of
    its replays saves (its region's eager time less its replay time); the session registers
    graphs with :meth:`held` and :meth:`dropped`."""

    def __init__(
        self,
        *,
        record_after: int,
        max_graphs: int,
        budget: float,
        replays: Callable[[Resident], int],
        saving: Callable[[Resident], float] = _no_saving,
    ):
        self.record_after = record_after
        self.max_graphs = max_graphs
        self.budget = RecordingBudget(fraction=budget)
        self.sketch = FrequencySketch(
            window=max(MIN_WINDOW, WINDOW_PER_GRAPH * max_graphs), on_peers=self.budget.inputs_changed
        )
        #: ``called(key) -> int``: count a call of a key that has no graph; its recent count.
        #: The sketch's own method, not a wrapper: every call that runs eagerly asks it.
        self.called: Callable[[Hashable], int] = self.sketch.add
        self._replays = replays
        self._saving = saving
        self._banked = 0.0  # what the replays of graphs held before (and of those held, up to ``paid``) saved
        self._residents: dict[Resident, ResidentCount] = {}
        # a lower bound of the held graphs' least use, valid until a graph is held (or starts
        # over) or the counts halve: use only grows in between, and dropping a graph cannot
        # lower the least of the others (see admits)
        self._floor: tuple[int, int] | None = None  # (bound, halvings it was taken at)

    # --- calls ---------------------------------------------------------------------------
    def forget(self, which: Callable[[Hashable], bool]) -> None:
        """Drop the counts of the keys ``which`` selects (their region's graphs were dropped:
        they warm up again)."""
        self.sketch.forget(which)

    # --- graphs held -----------------------------------------------------------------------
    def held(self, resident: Resident, key: Hashable) -> None:
        """A graph was recorded for ``key`` (or captured, awaiting its analysis: see
        :meth:`victim`): it starts with the key's recent count."""
        self.restarted(resident, self.sketch.count(key))

    def restarted(self, resident: Resident, frequency: int) -> None:
        """A held graph starts (or, replaced by a new one in a compaction, starts again with its
        replay counter at 0) with ``frequency`` as its use so far. What the replays of the graph
        it replaces saved since the budget last summed them is not counted (the counter they
        were read from is gone): the budget errs low."""
        earlier = self._residents.get(resident)
        if earlier is not None:
            self._bank(resident, earlier)
        replays = self._replays(resident)
        self._residents[resident] = ResidentCount(frequency, replays, self.sketch.halvings, replays)
        self._floor = None

    def dropped(self, resident: Resident) -> None:
        count = self._residents.pop(resident, None)
        if count is not None:
            self._bank(resident, count)

    def _bank(self, resident: Resident, count: ResidentCount) -> None:
        replays = self._replays(resident)
        if replays > count.paid:  # (a counter that started over banks nothing: the budget errs low)
            self._banked += (replays - count.paid) * self._saving(resident)
            count.paid = replays

    def saved(self) -> float:
        """What the replays of the session's graphs, held or gone, have saved so far."""
        for resident, count in self._residents.items():
            self._bank(resident, count)
        return self._banked

    def residents(self) -> list[Resident]:
        """The graphs and pending recordings held now (registered with :meth:`held`)."""
        return list(self._residents)

    def frequency(self, resident: Resident) -> int:
        """A held graph's recent use: its aged count plus its replays since."""
        count = self._residents[resident]
        replays = self._replays(resident)
        missed = self.sketch.halvings - count.halvings
        if missed:
            count.aged = (count.aged + replays - count.base) >> missed
            count.base, count.halvings = replays, self.sketch.halvings
        return count.aged + replays - count.base

    def victim(
        self, key: Hashable, held_oldest_first: Iterable[Resident], pending: Iterable[Resident] = ()
    ) -> tuple[bool, Resident | None]:
        """(admit, victim) for recording ``key`` now. ``pending``: recordings on their way to
        the cache (captured, not analysed yet, oldest first), residents like the held graphs
        (registered with :meth:`held` at their capture, used as often as their key was called).
        With room left: (True, None). With the cache full: the least frequently used of the
        pending recordings and held graphs (among equals a pending one, then the oldest), and
        whether ``key`` was called ``ADMISSION_MARGIN`` times as often recently as it was used.

        Why pending recordings are victims too: a key recorded on its last call is never
        analysed, and its recording took a place for good; once they held every place, no key
        was admitted again (a hot key ran eagerly 9,999 times of 10,000)."""
        candidates = [*pending, *held_oldest_first]
        if len(candidates) < self.max_graphs:
            return True, None
        victim = min(candidates, key=self.frequency)  # min keeps the first (pending, then oldest) of equals
        least = self.frequency(victim)
        self._floor = (least, self.sketch.halvings)
        return self.sketch.count(key) > ADMISSION_MARGIN * least, victim

    def admits(self, key: Hashable, held: Collection[Resident], pending: Collection[Resident] = ()) -> bool:
        """:meth:`victim`'s first answer, without going over every resident when a lower bound of
        their least use, remembered from the last time, already refuses ``key``: a key that is
        not admitted is asked again on each of its calls, which then cost what eager costs."""
        floor = self._floor
        if floor is not None and floor[1] == self.sketch.halvings and len(held) + len(pending) >= self.max_graphs:
            if self.sketch.count(key) <= ADMISSION_MARGIN * floor[0]:
                return False
        return self.victim(key, held, pending)[0]

    # --- time --------------------------------------------------------------------------------
    def expected_calls(self, count: int) -> float:
        """The calls a key counted ``count`` times recently is bet to come back for: its count as
        its peers judge it (Peers) times ``PAYBACK_HORIZON``, or, before the first halving, its
        calls after the first over the calls counted so far, times ``EARLY_CALLS``, where that
        is more (see the module docstring; a key's first call says nothing of its rate: every
        key has one). The early bet only falls as calls are counted: a quiet bound
        (:meth:`quiet_below`) taken earlier stays a bound."""
        sketch = self.sketch
        expected = sketch.expected(count)
        if sketch.halvings:
            return expected * PAYBACK_HORIZON
        return max(expected * PAYBACK_HORIZON, (expected - 1) * EARLY_CALLS / max(sketch.calls, 1))

    def _expected_needed(self, calls: float) -> float:
        """The least expected count whose :meth:`expected_calls` reaches ``calls`` (up to
        rounding: the caller steps to the exact count with the rule's own arithmetic)."""
        needed = calls / PAYBACK_HORIZON
        if not self.sketch.halvings:
            needed = min(needed, 1 + calls * max(self.sketch.calls, 1) / EARLY_CALLS)
        return needed

    def pays_back(self, count: int, eager_seconds: float, replay_seconds: float | None = None) -> bool:
        """Whether a key called ``count`` times recently is worth recording: its expected calls,
        each saving ``eager_seconds`` less ``replay_seconds`` (None: ``REPLAY_SECONDS_GUESS``),
        save what a recording usually costs. Always, for the session's first recordings
        (RecordingBudget.first_recordings)."""
        budget = self.budget
        if budget.first_recordings():
            return True  # made as soon as admitted
        saving = eager_seconds - replay_or_guess(replay_seconds)
        return saving > 0 and self.expected_calls(count) * saving >= budget.usual

    def quiet_below(self, eager_seconds: float, replay_seconds: float | None = None) -> int:
        """The least recent count at which a call of a key without a graph may do anything
        but run eagerly, warming or too rare to pay back: ``record_after + 1``, or the count
        :meth:`pays_back` first accepts if that is more. Valid while ``budget.version`` (bumped
        by the sketch's halvings too) and ``record_after`` stay and the region's estimates save
        no more per replay than ``eager_seconds`` less ``replay_seconds`` (as calls are counted,
        the early bet only falls: no count below the bound pays back later either); a region's
        eager path uses it to skip the decision for the calls of a loop that runs mostly eagerly
        (a uniform mix of hundreds of shapes: every call of a key too rare to record asked the
        whole rule again)."""
        least = self.record_after + 1
        if self.pays_back(least, eager_seconds, replay_seconds):
            return least
        saving = eager_seconds - replay_or_guess(replay_seconds)
        usual = self.budget.usual
        if saving <= 0 or not usual:
            return QUIET_FOREVER  # no count pays back: every call runs eagerly (the rule again at each change)
        needed = self._expected_needed(usual / saving)  # the expected count that pays back
        peers = self.sketch.current_peers()
        bound = needed if peers is None else peers.least_count(needed)
        count = max(least, int(min(bound, QUIET_FOREVER)) - 1)
        while count < QUIET_FOREVER and not self.pays_back(count, eager_seconds, replay_seconds):
            count += 1  # pays_back's own arithmetic decides
        return count

    def may_record(self, count: int = 0, eager_seconds: float = 0.0, replay_seconds: float | None = None) -> bool:
        """Whether recording may spend time now: within what replays saved plus the grace, or
        for a key called ``count`` times recently whose eager calls alone (each saving
        ``eager_seconds`` less ``replay_seconds``) would already have saved what a recording
        usually costs (the module docstring: keys that paid already)."""
        budget = self.budget
        if budget.allows(self._banked) or budget.allows(self.saved()):  # (the sum over graphs only when needed)
            return True
        saving = eager_seconds - replay_or_guess(replay_seconds)
        return saving > 0 and budget.usual > 0 and count * saving >= budget.usual

    def captured(self, seconds: float) -> None:
        """A key's capture took ``seconds`` (failed ones too); its analysis comes on the key's
        next call (:meth:`analysed`)."""
        self.budget.charge(seconds, awaits_analysis=True)

    def recorded(self, seconds: float) -> None:
        """Recordings that need no analysis of their own took ``seconds`` (a compaction's, a
        size observation's)."""
        self.budget.charge(seconds)

    def analysed(self, seconds: float) -> None:
        """A capture's analysis took ``seconds`` (failed ones too)."""
        self.budget.charge_analysis(seconds)


@attrs.define
class CompactionRule:
    """When re-recording a device's graphs into a fresh pool is worth its cost.

    A compaction leaves a pool about as large as the largest graph's own need (every graph
    then reuses that graph's blocks). It is worth its recordings when the pool has grown to
    ``COMPACTION_GROWTH`` times that and its size after the last compaction (growth by a few
    blocks at a time does not call for one each time), and while its recordings fit the
    share of all recordings that compactions may take."""

    compacted_at: dict[int, int] = attrs.Factory(dict)  # device -> pool bytes after the last one
    largest_need: dict[int, int] = attrs.Factory(dict)  # device -> the most one recording grew the pool
    recaptured: int = 0  # graphs recorded again by compactions so far

    def recorded(self, device: int, pool_bytes: int, grew_by: int) -> None:
        """A recording on ``device`` grew its pool by ``grew_by`` to ``pool_bytes``."""
        self.compacted_at.setdefault(device, pool_bytes)
        self.largest_need[device] = max(self.largest_need.get(device, 0), grew_by)

    def due(self, device: int, pool_bytes: int, graphs: int, records: int) -> bool:
        """Whether to record ``graphs`` graphs again now, ``records`` recordings having been
        made in all."""
        base = max(self.compacted_at.get(device, 0), self.largest_need.get(device, 0))
        affordable = self.recaptured + graphs <= RECAPTURE_SHARE * records + RECAPTURE_ALLOWANCE
        return pool_bytes >= COMPACTION_GROWTH * base and affordable

    def done(self, device: int, pool_bytes: int, graphs: int) -> None:
        self.compacted_at[device] = pool_bytes
        self.recaptured += graphs
