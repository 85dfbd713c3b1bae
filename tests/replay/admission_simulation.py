"""The cache policy driven as a session drives it, over synthetic call streams, with modelled
costs: what a loop's calls would cost under it, against eager (tests/replay/test_admission.py).

A call of a key is served as the session serves it (replay.region, replay.orchestration,
replay.lifecycle): a key with a graph replays; a key whose capture awaits its analysis is
analysed, then replays; any other call is counted, and the rule (warming, payback, admission,
budget) says whether it records or runs eagerly. A capture
takes a place at once (``max_graphs`` + 1 at most, as Keys.make_room allows), a graph when
analysed. Every call is charged its modelled cost; the session's own bookkeeping on an eager
call is ``Costs.overhead``. The region's eager estimate is known from its ``timed_after``-th
eager run on (dispatch.EagerCost: one run in eight timed, the first not trusted); its replay
estimate is timed on its replays as the session times them (ReplayTimes: one in eight, later
one in 64, a graph's first never), at ``Costs.replay_host``.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable, Iterable

import attrs

from replay.admission import Admission, ReplayTimes
from replay.dispatch import TIMING_MASK, TIMING_MASK_SETTLED, TIMING_SETTLED
from samples import decode_loop


@attrs.frozen
class Costs:
    """Seconds per call of one region, as the loop pays them and as the session measures them."""

    eager: float  # an eager call (what the session times, and what eager alone costs a step)
    replay: float  # a replayed call as the loop pays it (the GPU's time where it bounds the step)
    capture: float  # the call that records (capture, instantiate, first launch)
    analysis: float  # the analysis on the key's next call (its replay besides)
    replay_host: float | None = None  # a replay's host time, what the session measures (None: ``replay``)
    first_capture: float | None = None  # the session's first capture (one-time costs; None: ``capture``)
    overhead: float = 0.0  # the session's bookkeeping on each eager call


@attrs.define
class Counts:
    """What happened to the calls (as replay.stats counts them: a recording's call is served by
    the graph's first launch, so it counts as a replay)."""

    calls: int = 0
    replays: int = 0
    eager: int = 0
    records: int = 0
    too_rare: int = 0
    refused: int = 0
    deferred: int = 0
    evictions: int = 0


class Simulation:
    """One region's calls through the session's admission, each charged its modelled cost."""

    def __init__(
        self,
        costs: Costs,
        *,
        record_after: int = 1,
        max_graphs: int = 64,
        budget: float = 0.03,
        timed_after: int = 16,
    ) -> None:
        self.costs = costs
        self.timed_after = timed_after
        self.replays: dict[Hashable, int] = {}  # a key's replays across its graphs (Entry.replays)
        self.replay_times = ReplayTimes()
        self.admission: Admission[Hashable] = Admission(
            record_after=record_after,
            max_graphs=max_graphs,
            budget=budget,
            replays=lambda key: self.replays.get(key, 0),
            saving=lambda key: self.replay_times.saving(self.eager_estimate),
        )
        self.lru: OrderedDict[Hashable, None] = OrderedDict()  # graphs, least recently replayed first
        self.pending: dict[Hashable, None] = {}  # captures awaiting their analysis
        self.eager_runs = 0
        self.eager_estimate = 0.0
        self.counts = Counts()
        self.seconds = 0.0  # the loop's modelled time under the session
        self.eager_seconds = 0.0  # the same calls run eagerly
        self.recordings: list[tuple[int, Hashable]] = []  # (call index, key)

    def run(self, keys: Iterable[Hashable]) -> Simulation:
        for key in keys:
            self.call(key)
        return self

    def call(self, key: Hashable) -> None:
        self.counts.calls += 1
        self.eager_seconds += self.costs.eager
        if key in self.lru:
            self.lru.move_to_end(key)
            self._replay(key)
        elif key in self.pending:
            self._analyse(key)
        else:
            self._unrecorded(key)

    def _replay(self, key: Hashable, first: bool = False) -> None:
        """A replay (``first``: the graph's first, on its key's analysis call), counted and
        timed as the session times replays."""
        self.replays[key] = self.replays.get(key, 0) + 1
        self.counts.replays += 1
        self.seconds += self.costs.replay
        times = self.replay_times
        times.runs = runs = times.runs + 1
        if not first and not runs & (TIMING_MASK if runs < TIMING_SETTLED else TIMING_MASK_SETTLED):
            costs = self.costs
            times.took(costs.replay if costs.replay_host is None else costs.replay_host)

    def _analyse(self, key: Hashable) -> None:
        """Keys.analyse, the analysis charged, Keys.serve, then the graph's first replay."""
        admission, costs = self.admission, self.costs
        del self.pending[key]
        admission.dropped(key)
        admission.analysed(costs.analysis)
        self.seconds += costs.analysis
        self._make_room(key, allowance=0)
        self.lru[key] = None
        admission.held(key, key)
        self._replay(key, first=True)

    def _unrecorded(self, key: Hashable) -> None:
        """Region._decide, then the capture (Keys.capture) or an eager run."""
        admission, counts = self.admission, self.counts
        count = admission.called(key)
        eager, replay = self.eager_estimate, self.replay_times.seconds
        if count <= admission.record_after:
            return self._eagerly()
        if not admission.pays_back(count, eager, replay):
            counts.too_rare += 1
            return self._eagerly()
        if not admission.admits(key, self.lru, self.pending):
            counts.refused += 1
            return self._eagerly()
        if not admission.may_record(count, eager, replay):
            counts.deferred += 1
            return self._eagerly()
        return self._record(key)

    def _record(self, key: Hashable) -> None:
        costs = self.costs
        first = costs.first_capture if costs.first_capture is not None and not self.counts.records else costs.capture
        self.admission.captured(first)
        self.seconds += first
        self.counts.records += 1
        self.counts.replays += 1  # the first launch serves the call
        self.recordings.append((self.counts.calls - 1, key))
        self.pending[key] = None
        self.admission.held(key, key)
        self._make_room(key, allowance=1)

    def _eagerly(self) -> None:
        self.counts.eager += 1
        self.eager_runs += 1
        self.seconds += self.costs.eager + self.costs.overhead
        if self.eager_runs >= self.timed_after:
            self.eager_estimate = self.costs.eager

    def _make_room(self, key: Hashable, allowance: int) -> None:
        """Keys.make_room: evict the least used graphs and captures until, with ``key``, at most
        ``max_graphs + allowance`` are held."""
        limit = self.admission.max_graphs + allowance
        while len(self.lru) + len(self.pending) + (key not in self.pending) > limit:
            others = [k for k in self.pending if k != key]
            _admit, victim = self.admission.victim(key, self.lru, others)
            if victim is None:
                return
            self.lru.pop(victim, None)
            self.pending.pop(victim, None)
            self.admission.dropped(victim)
            self.counts.evictions += 1

    @property
    def ratio(self) -> float:
        """The loop's modelled time under the session over its time run eagerly."""
        return self.seconds / self.eager_seconds


# --- call streams -------------------------------------------------------------------------------
def cycle(sizes: list[int], steps: int) -> list[int]:
    """``steps`` calls going round ``sizes``."""
    return [sizes[step % len(sizes)] for step in range(steps)]


def random_walk(steps: int, largest: int, seed: int) -> list[int]:
    """The decode-loop sample's batch sizes, from its own request stream (samples/decode_loop.py:
    from half of ``largest``, each step moves by -2..2, within 1..``largest``); its default run
    draws them with seed 1."""
    config = decode_loop.Config()
    return [
        len(tokens) for _pos, tokens in decode_loop.request_stream(steps, largest, config.max_len, config.vocab, seed)
    ]


def uniform(steps: int, largest: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, largest) for _ in range(steps)]


def each_once(steps: int, seed: int) -> list[int]:
    """Prefill-like lengths: each seen once, in random order."""
    lengths = list(range(1, steps + 1))
    random.Random(seed).shuffle(lengths)
    return lengths
