"""Session logic on the CPU with a recording double (the GPU tests capture for real)."""

from __future__ import annotations

import collections
import dataclasses
import gc
import inspect
import logging
import pydoc
import random
import time
import tracemalloc
import types
import warnings
import weakref

import attrs
import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import jitcore
import replay
from jitcore.backends import use_backend
from jitcore.backends.null import NullBackend
from replay import admission, keying, lifecycle, orchestration, recording, region_keys
from replay import dispatch as dispatch_module
from replay import region as region_module
from replay.admission import Admission
from replay.graph import MISMATCH
from replay.lifecycle import AWAITING_ANALYSIS, EAGER_ONLY, REPLAYING, WARMING
from replay.rebinding import REBOUND, InputRange, Plan
from replay.region import Region
from replay.session import Session


@attrs.define
class FakeTorchGraph:
    resets: int = 0
    launches: int = 0

    def reset(self):
        self.resets += 1

    def replay(self):
        self.launches += 1


class FakeGraph:
    """Stands in for RecordedGraph: 'replays' by running the region eagerly, and counts."""

    instances: list = []

    def __init__(self, region, key, capture, spec, leaves, paths, session, number):
        self.region, self.key, self.capture, self.session = region, key, capture, session
        self.device = capture.device
        self.replays = self.generation = 0
        self.memory = 0
        self.output_memory = {}  # {start: bytes} its replays write
        self.in_place = {}  # no staged buffer a padded argument could be written into
        self.released = False
        self.spoiled = None  # (RecordedGraph.spoiled: its own output memory moved)
        self.verified = 0
        self.source = f"# fake graph {number}"
        FakeGraph.instances.append(self)

    def replay(self, *leaves):
        assert not self.released
        self.replays += 1
        self.session.counters.replays += 1
        args, kwargs = region_keys.unflatten(self.key[1], region_keys.plain_leaves(leaves))
        return self.region.fn(*args, **kwargs)

    def verify(self, leaves, eager):
        self.verified += 1
        return self.replay(*leaves)

    def release(self):
        self.released = True


class DoubleSession(Session):
    """The session with capture and analysis replaced: a 'capture' runs the region eagerly
    (its result is what the first launch returns); scripted exceptions simulate failures."""

    build_graph = FakeGraph

    def __init__(self, **policy):
        # The recording budget charges each recording its wall time, so under the default 3%
        # a loaded machine (CI) could postpone a recording these tests expect: a test of any
        # other logic must not depend on the machine's speed. Tests of the budget pass their own
        # fraction and set what it reads (spent, recent, its clock).
        policy.setdefault("record_budget", 1.0)
        super().__init__(**policy)
        self.captures = []
        self.capture_script = []  # exceptions for the next captures, in order
        self.analyse_script = []  # exceptions for the next analyses, in order
        self._gpu = True  # as can_record says: flat calls take the session's flat eager path too

    @staticmethod
    def record_key(
        fn,
        spec,
        leaves,
        paths,
        *,
        device,
        pool,
        stream,
        stage,
        copy_back,
        observe=True,
        storages=False,
        held=None,
        shadows=frozenset(),
    ):
        session = DoubleSession.current
        session.captures.append((spec, list(leaves), set(stage), set(copy_back), observe))
        if session.capture_script:
            raise session.capture_script.pop(0)
        args, kwargs = region_keys.unflatten(spec, region_keys.plain_leaves(leaves))
        outputs = fn(*args, **kwargs)
        inputs = [InputRange(i, paths[i], 0, 0) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        return recording.Capture(
            graph=FakeTorchGraph(),
            device=device,
            outputs=outputs,
            records=[],
            inputs=inputs,
            input_dtypes={},
            dynamic_values={},
            staged={},
            copied_back=set(),
            torch_read=set(),
            torch_written=set(),
            seconds=0.001,
            memory=1024,
        )

    @staticmethod
    def analyse(capture):
        session = DoubleSession.current
        if session.analyse_script:
            raise session.analyse_script.pop(0)
        capture.plan = Plan(choices={r.index: REBOUND for r in capture.inputs})

    def can_record(self):
        return True

    def current_device(self):
        return -1

    def pool(self, device):
        return (0, 1)

    def pool_bytes(self, device):
        return 0

    def capture_stream(self, device):
        return None


@pytest.fixture
def session_factory():
    with use_backend(NullBackend()):

        def make(**policy):
            session = DoubleSession(**policy)
            DoubleSession.current = session
            return session

        yield make


class StepClock:
    """A controlled clock for the session's timings (replay.region and replay.orchestration read
    ``time.perf_counter``, set to this one): the calls move it. A call of a function wrapped by
    :meth:`takes` takes ``eager``, or replayed by a ClockedGraph ``replay`` (a graph's first
    replay ``cold``); a capture takes ``capture`` more, an analysis ``analysis``."""

    def __init__(self, eager=150e-6, replay=30e-6, cold=150e-6, capture=1.2e-3, analysis=1e-3):
        self.eager, self.replay, self.cold, self.capture, self.analysis = eager, replay, cold, capture, analysis
        # the time, and what the call under way takes: in an array, which the region's watch
        # compares by identity, never by its values (moved in plain values, the clock that a
        # region reaches would re-key it on every call)
        self.state = numpy.array([0.0, eager])

    def perf_counter(self) -> float:
        return float(self.state[0])

    def advance(self, seconds: float) -> None:
        self.state[0] += seconds

    def takes(self, fn):
        state = self.state

        def timed(*args, **kwargs):
            state[0] += state[1]
            return fn(*args, **kwargs)

        return timed


class ClockedGraph(FakeGraph):
    """A FakeGraph whose replays take the session's clock's replay time."""

    def replay(self, *leaves):
        clock = self.session.clock
        clock.state[1] = clock.replay if self.replays else clock.cold
        try:
            return super().replay(*leaves)
        finally:
            clock.state[1] = clock.eager


class ClockedSession(DoubleSession):
    """The double session on a StepClock: captures, analyses and replays take its times."""

    build_graph = ClockedGraph

    def __init__(self, clock: StepClock, **policy):
        super().__init__(**policy)
        self.clock = clock

    @staticmethod
    def record_key(fn, *args, **kwargs):
        DoubleSession.current.clock.advance(DoubleSession.current.clock.capture)
        return DoubleSession.record_key(fn, *args, **kwargs)

    @staticmethod
    def analyse(capture):
        DoubleSession.current.clock.advance(DoubleSession.current.clock.analysis)
        DoubleSession.analyse(capture)


@pytest.fixture
def clocked_session(monkeypatch):
    """``make(clock, **policy)``: a ClockedSession whose timings all read ``clock``."""
    with use_backend(NullBackend()):

        def make(clock: StepClock, **policy):
            monkeypatch.setattr(region_module, "time", clock)
            monkeypatch.setattr(orchestration, "time", clock)
            session = ClockedSession(clock, **policy)
            DoubleSession.current = session
            return session

        yield make


def add(x, y):
    return x + y


def test_record_after_counts_eager_runs_then_records_then_replays(session_factory):
    session = session_factory(record_after=2)
    step = session.region(add)
    x, y = torch.randn(4), torch.randn(4)
    for _ in range(5):
        assert torch.equal(step(x, y), x + y)
    stats = session.stats()
    assert (stats.calls, stats.eager_runs, stats.records, stats.replays) == (5, 2, 1, 3)
    assert len(session.captures) == 1


def test_record_after_zero_records_on_the_first_call(session_factory):
    session = session_factory(record_after=0)
    step = session.region(add)
    step(torch.randn(2), torch.randn(2))
    assert session.stats().records == 1 and session.stats().eager_runs == 0


def test_each_shape_is_its_own_key(session_factory):
    session = session_factory(record_after=1)
    step = session.region(add)
    for n in (2, 3, 2, 3):  # warm-up runs, then recordings (whose first launch serves the call)
        step(torch.randn(n), torch.randn(n))
    assert {e.state for e in step.entries.values()} == {AWAITING_ANALYSIS}
    for n in (2, 3, 2):  # the next call analyses, then replays
        step(torch.randn(n), torch.randn(n))
    stats = session.stats()
    assert (stats.eager_runs, stats.records, stats.replays) == (2, 2, 5)
    assert {e.state for e in step.entries.values()} == {REPLAYING}


def test_a_full_cache_admits_a_key_only_when_twice_as_hot_as_the_graph_it_replaces(session_factory):
    session = session_factory(record_after=0, max_graphs=2)
    step = session.region(add)
    tensors = {n: (torch.randn(n), torch.randn(n)) for n in (1, 2, 3)}
    for n in (1, 1, 1, 2, 2):  # 1: recorded, analysed, replayed; 2: recorded, analysed
        step(*tensors[n])

    def state(n):
        return {key[region_keys.LEAVES_START][1][0]: e.state for key, e in step.entries.items()}.get(n, "no entry")

    step(*tensors[3])  # called once: colder than both graphs (2 was called twice)
    assert (state(3), session.stats().refused) == ("no entry", 1)
    for _ in range(3):  # up to four times: not twice as hot as 2 (equals do not take turns)
        step(*tensors[3])
    assert (state(3), session.stats().refused, session.stats().evictions) == ("no entry", 4, 0)
    step(*tensors[3])  # five times: more than twice as hot as 2: recorded
    assert (state(1), state(2), state(3)) == (REPLAYING, REPLAYING, AWAITING_ANALYSIS)
    step(*tensors[3])  # its graph joins the cache: 2 goes, 1 (used most) stays
    assert (state(1), state(2), state(3)) == (REPLAYING, WARMING, REPLAYING)
    assert session.stats().evictions == 1 and session.stats().graphs == 2
    for n in (1, 2, 3):  # every call is still exact, replayed or not
        assert torch.equal(step(*tensors[n]), tensors[n][0] + tensors[n][1])


def test_many_shapes_do_not_thrash_the_cache(session_factory):
    # a batch size drawn uniformly from 32 sizes with room for 8 graphs: plain LRU recorded a
    # graph on almost every miss; admission keeps the 8 it has and runs the rest eagerly
    session = session_factory(record_after=1, max_graphs=8)
    step = session.region(add)
    generator = torch.Generator().manual_seed(0)
    tensors = {n: (torch.randn(n), torch.randn(n)) for n in range(1, 33)}
    for _ in range(2000):
        n = int(torch.randint(1, 33, (1,), generator=generator))
        assert torch.equal(step(*tensors[n]), tensors[n][0] + tensors[n][1])
    stats = session.stats()
    assert stats.records <= 16 and stats.evictions <= 8, session.report()
    assert stats.graphs == 8 and stats.refused > 1000


def test_a_hot_key_is_never_evicted_for_a_cold_one(session_factory):
    session = session_factory(record_after=0, max_graphs=1)
    step = session.region(add)
    hot, cold = (torch.randn(4), torch.randn(4)), (torch.randn(5), torch.randn(5))
    for _ in range(50):
        step(*hot)
    for _ in range(20):  # called 20 times, but the hot graph was replayed 48 times
        step(*cold)
    (hot_key,) = [k for k, e in step.entries.items() if e.state == REPLAYING]
    assert hot_key[region_keys.LEAVES_START][1] == (4,) and session.stats().evictions == 0


def test_keys_that_never_repeat_leave_no_entry_and_run_no_observer(session_factory, monkeypatch):
    # a prefill-like loop: hundreds of lengths, each seen once. Each call costs its eager run
    # plus the key: no entry, no observer, no recording
    observed = []
    original = replay.orchestration.op_observer
    monkeypatch.setattr(replay.orchestration, "op_observer", lambda *a: observed.append(a) or original(*a))
    session = session_factory(record_after=1)
    step = session.region(add)
    step(torch.randn(1), torch.randn(1))  # the region's first key: its warm-up is observed once
    for n in range(2, 300):
        x = torch.randn(n)
        assert torch.equal(step(x, x), x + x)
    assert len(observed) == 1 and step.entries == {} and session.stats().records == 0
    assert session.stats().eager_runs == 299


def test_calls_of_shapes_without_an_entry_compute_no_full_key_and_no_drift_check(session_factory, monkeypatch):
    # the eager path of a key that admission keeps warming (or refuses, or postpones) costs
    # what eager costs: no region key (about 6 us) and no check of the region's globals
    computed = []
    original_key = region_keys.region_key
    monkeypatch.setattr(region_keys, "region_key", lambda *a: computed.append(a) or original_key(*a))
    session = session_factory(record_after=2, max_graphs=1)
    scale = [2.0]
    step = session.region(lambda x, y: x * scale[0] + y, name="scaled")
    x = torch.randn(3)
    for _ in range(4):  # two warm-up runs (the first observed: its key is computed), record, analyse
        assert torch.equal(step(x, x), x * 2 + x)
    assert session.stats().records == 1 and len(computed) == 3
    drifts = []
    snapshot_check = step.snapshot.check
    monkeypatch.setattr(step.snapshot, "check", lambda: drifts.append(1) or snapshot_check())
    computed.clear()
    for n in range(4, 200):  # one call each: they stay warming
        y = torch.randn(n)
        assert torch.equal(step(y, y), y * 2 + y)
    for _ in range(5):  # called often enough, but the one graph held is used more: refused
        z = torch.randn(200)
        assert torch.equal(step(z, z), z * 2 + z)
    assert computed == [] and drifts == []
    assert session.stats().refused >= 1 and session.stats().records == 1
    strided = torch.randn(3, 2)[:, 0]  # the recorded key's shapes, other strides: the full path
    assert torch.equal(step(strided, strided), strided * 2 + strided)
    assert len(computed) == 1 and drifts == [1]


def test_a_padded_argument_in_a_graphs_output_memory_runs_eagerly(session_factory):
    # h = step(replay.padded(h)) with h a previous output: the graph sees only the padded copy,
    # so the region itself must keep the replay from writing (and returning) h's memory
    session = session_factory(record_after=0, buckets=[4])
    step = session.region(lambda h: h * 2, name="double")
    h = torch.randn(3, 2)
    for _ in range(2):  # recorded, analysed
        assert torch.equal(step(replay.padded(h)), h * 2)
    (graph,) = [e.graph for e in step.entries.values() if e.graph is not None]
    replays = graph.replays
    graph.output_memory = {h.data_ptr(): h.untyped_storage().nbytes()}  # as if h were its output
    assert torch.equal(step(replay.padded(h)), h * 2)
    assert graph.replays == replays and session.stats().declined == 1
    other = torch.randn(3, 2)
    assert torch.equal(step(replay.padded(other)), other * 2) and graph.replays == replays + 1
    # the same for a capture still awaiting its analysis (the next call would analyse and replay it)
    increment = session.region(lambda h: h + 1, name="increment")
    g = torch.randn(3, 2)
    increment(replay.padded(g))  # recorded; its first launch served the call
    (entry,) = increment.entries.values()
    assert entry.state == AWAITING_ANALYSIS
    entry.unanalysed.outputs, entry.unanalysed.owned_outputs = g, {g.untyped_storage().data_ptr()}
    assert torch.equal(increment(replay.padded(g)), g + 1)
    assert session.stats().declined == 2 and entry.state == AWAITING_ANALYSIS


def test_the_output_memory_a_padded_call_is_checked_against_follows_graphs_coming_and_going(session_factory):
    # the region keeps its graphs' output memory merged for the padded calls' check; a graph
    # recorded, released or replaced must show in the next call's answer
    session = session_factory(record_after=0, buckets=[4])
    step = session.region(lambda h: h * 2, name="double")
    h = torch.randn(3, 2)
    for _ in range(2):  # recorded, analysed
        step(replay.padded(h))
    (entry,) = [e for e in step.entries.values() if e.graph is not None]
    entry.graph.output_memory = {h.data_ptr(): h.untyped_storage().nbytes()}  # as if h were its output
    step.router.outputs_changed()  # what the region's own bookkeeping does when a graph comes
    assert torch.equal(step(replay.padded(h)), h * 2) and session.stats().declined == 1
    session.keys.release(entry)  # its memory is no longer written by a replay: no reason to decline
    assert torch.equal(step(replay.padded(h)), h * 2) and session.stats().declined == 1
    for _ in range(2):  # recorded again, analysed: the new graph's memory is not h's
        step(replay.padded(h))
    assert session.stats().declined == 1


def test_keys_that_share_shapes_share_a_count_and_stay_exact(session_factory):
    # admission counts calls by shapes (replay.keying.CallKeys.counted): a float16 key after two float32 calls of
    # the same shape is recorded on its first call, which is exact (record_after=0 does the same)
    session = session_factory(record_after=1)
    step = session.region(add)
    for dtype in (torch.float32, torch.float32, torch.float16, torch.float16, torch.float32):
        x = torch.randn(5).to(dtype)
        assert torch.equal(step(x, x), x + x) and step(x, x).dtype == dtype
    assert [capture[1][0].dtype for capture in session.captures] == [torch.float32, torch.float16]


def test_new_keys_start_from_what_the_first_key_of_their_structure_taught(session_factory):
    session = session_factory(record_after=1)
    step = session.region(add)  # a torch op reads both inputs: they are staged
    for n in (3, 3, 4, 4):
        step(torch.randn(n), torch.randn(n))
    (_, _, stage, _, observed), (_, _, stage2, _, observed2) = session.captures
    assert (stage, observed) == ({0, 1}, True)
    assert (stage2, observed2) == ({0, 1}, True)  # inherited stage hints; the capture is observed
    keyword = session.region(lambda x, *, y: x + y, name="keyword")  # another structure: its own warm-up
    for _ in range(2):
        keyword(torch.randn(2), y=torch.randn(2))
    assert session.captures[2][2] == {0, 1}


def test_the_recording_budget_postpones_recordings_and_charges_failed_ones(session_factory, monkeypatch):
    # every key pays back at once over a long horizon, and none has paid for a 10 ms
    # recording by its own few calls (about 1 ms saved each): the budget alone decides
    monkeypatch.setattr(admission, "PAYBACK_HORIZON", 100)
    monkeypatch.setattr(admission, "REPLAY_SECONDS_GUESS", -1e-3)
    session = session_factory(record_after=0, record_budget=0.1)
    budget = session.admission.budget
    step = session.region(add)
    x = torch.randn(3)
    assert torch.equal(step(x, x), x + x)  # the first recording: one of the session's first
    budget.spent += 10.0  # as if recording had taken 10 s
    budget.recent = [0.005] * 4  # a recording usually costs 10 ms
    y = torch.randn(4)
    for _ in range(3):
        assert torch.equal(step(y, y), y + y)
    assert session.stats().deferred == 3 and session.stats().records == 1
    monkeypatch.setattr(step.cost, "saving", lambda: 2.0)  # as if each replay saved 2 s
    for _ in range(5):  # x's analysis and its replay, then 4 more: 10 s saved
        assert torch.equal(step(x, x), x + x)
    assert session.admission.saved() == 10.0 and step.cost.replay.seconds is None  # (none timed: the guess)
    step(y, y)  # 10 s saved, and the grace: room again
    assert session.stats().records == 2
    spent = budget.spent
    session.capture_script = [recording.CaptureFailed("no")]
    with pytest.warns(replay.ReplayWarning):
        step(torch.randn(5), torch.randn(5))
    assert budget.spent > spent  # a failed capture took time too


def test_a_keys_analysis_is_charged_and_its_first_replay_not_timed(session_factory):
    # what the payback rule reads, measured by the session: the capture on the key's recording
    # call, the analysis (failed ones too) on its next call; that call's replay, the graph's
    # first (cold), is counted but not timed
    session = session_factory(record_after=0, record_budget=0.1)
    budget = session.admission.budget
    step = session.region(add)
    x = torch.randn(3)
    step(x, x)
    assert len(budget.recent) == 1 and budget.analyses == [] and budget.awaiting == 1
    step(x, x)
    assert len(budget.analyses) == 1 and budget.awaiting == 0
    assert step.cost.replay.runs == 1 and step.cost.replay.seconds is None
    step(x, x)  # a replay on the flat path: counted
    assert step.cost.replay.runs == 2 and step.cost.replay.seconds is None
    session.analyse_script = [recording.CaptureFailed("no")]
    y = torch.randn(4)
    step(y, y)
    with pytest.warns(replay.ReplayWarning):
        step(y, y)  # its analysis fails: charged all the same
    assert len(budget.analyses) == 2 and step.cost.replay.runs == 2


def _timed_replays(monkeypatch) -> list[tuple[int, float]]:
    """(the replay's number, its seconds) of each replay timed from now on."""
    timed = []
    took = admission.ReplayTimes.took

    def taking(self, seconds: float) -> None:
        timed.append((self.runs, seconds))
        took(self, seconds)

    monkeypatch.setattr(admission.ReplayTimes, "took", taking)
    return timed


@pytest.mark.parametrize("path", ["c", "python", "full"])
def test_replays_are_timed_one_in_8_then_one_in_64_and_a_graphs_first_never(clocked_session, monkeypatch, path):
    # the replays the flat dispatch serves (in C, in Python) and those of the full path (a
    # keyword call), on one schedule; a graph's first replay (its analysis call's) is cold
    if path == "c" and not dispatch_module.native_enabled():
        pytest.skip("replay._eager is not built here (or JITCORE_NATIVE=0)")
    clock = StepClock()
    session = clocked_session(clock, record_after=0)
    step = _region(session, clock.takes(lambda x, y=None: x + y), path == "c")
    timed = _timed_replays(monkeypatch)
    x = torch.ones(2)
    call = (lambda: step(x, y=x)) if path == "full" else (lambda: step(x, x))
    call()  # recorded (the capture's own launch is no replay)
    call()  # analysed, and the graph's first replay: counted, not timed
    assert step.cost.replay.runs == 1 and timed == []
    for runs in range(2, 1025):
        clock.replay = runs * 1e-6
        call()
    settled = dispatch_module.TIMING_SETTLED
    assert [runs for runs, _ in timed] == [*range(8, settled, 8), *range(settled, 1025, 64)]
    assert all(seconds == pytest.approx(runs * 1e-6) for runs, seconds in timed)
    assert 8e-6 < step.cost.replay.seconds < 1024e-6  # the rises, an eighth at a time
    clock.replay = 1e-6
    for _ in range(64):
        call()
    assert step.cost.replay.seconds == pytest.approx(1e-6)  # a drop, at once


@pytest.mark.parametrize("gate", [True, False], ids=["c", "python"])
def test_a_replay_that_declines_is_not_timed(clocked_session, monkeypatch, gate):
    if gate and not dispatch_module.native_enabled():
        pytest.skip("replay._eager is not built here (or JITCORE_NATIVE=0)")
    clock = StepClock()
    session = clocked_session(clock, record_after=0)
    step = _region(session, clock.takes(add), gate)
    x = torch.ones(2)
    for _ in range(3):
        step(x, x)
    timed = _timed_replays(monkeypatch)
    ((guard, run, entry),) = step.by_pre_key[(x.shape, x.shape)]
    step.by_pre_key[(x.shape, x.shape)][0] = (guard, lambda *args: (run(*args), MISMATCH)[1], entry)
    step.cost.replay.runs = 7  # the next one is timed: it declines (the full path then replays it)
    assert torch.equal(step(x, x), x + x)
    assert timed == [] and step.cost.replay.runs == 9 and step.cost.replay.seconds is None


def test_a_session_that_verifies_replays_times_only_those_not_verified(clocked_session, monkeypatch):
    # its hits replay through the region's full replay (Keys._run_of), which counts and times
    # them; the dispatch leaves them alone
    clock = StepClock(eager=100e-6, replay=10e-6)
    session = clocked_session(clock, record_after=0, verify_every=2)
    step = session.region(clock.takes(add))
    assert step.program.time_replays is False
    timed = _timed_replays(monkeypatch)
    x = torch.ones(2)
    for _ in range(2 + 32):
        step(x, x)
    assert session.stats().verifications == 16 and step.cost.replay.runs == 17
    assert [runs for runs, _ in timed] == [8, 16] and step.cost.replay.seconds == pytest.approx(10e-6)


def test_three_sizes_after_the_first_recordings_record_though_a_graphs_first_replay_costs_more_than_eager(
    clocked_session,
):
    # a freshly built replay's first launch (the analysis call's) took longer than an eager
    # call: taken as what a replay costs, no replay saved anything, and no size past the
    # session's first recordings was recorded (0 replays of 300). A steady replay's time is
    clock = StepClock(eager=150e-6, replay=34e-6, cold=160e-6, capture=1.2e-3, analysis=1e-3)
    session = clocked_session(clock, record_budget=0.03)
    step = session.region(clock.takes(add))
    others = [torch.ones(n) for n in range(40, 56)]
    for _ in range(30):
        for x in others:
            step(x, x)
    assert not session.admission.budget.first_recordings()
    assert step.cost.replay.seconds == pytest.approx(34e-6)
    before = session.stats().replays
    sizes = [torch.ones(n) for n in (8, 16, 32)]
    for number in range(300):
        x = sizes[number % 3]
        step(x, x)
    assert session.stats().replays - before >= 250, session.report()


def test_after_the_first_recordings_only_keys_whose_calls_pay_for_a_recording_record(session_factory, monkeypatch):
    # ski rental: a recording (here 2.5 ms, as usual) is made once the key's recent calls
    # would have saved that much eager time (here about 1 ms a call: an eager call of a few
    # microseconds, and a replay taken to cost 1 ms less)
    monkeypatch.setattr(admission, "PAYBACK_HORIZON", 1)
    monkeypatch.setattr(admission, "EARLY_CALLS", 1)  # no early bet to speak of: the count itself
    monkeypatch.setattr(admission, "REPLAY_SECONDS_GUESS", -1e-3)
    session = session_factory(record_after=0, record_budget=0.1)
    budget = session.admission.budget
    step = session.region(add)
    x = torch.zeros(1)
    assert torch.equal(step(x, x), x + x)  # one of the first recordings: recorded at once
    assert session.stats().records == 1
    budget.spent = (
        admission.FIRST_RECORDINGS_SHARE * budget.grace
    )  # the first recordings are made, the budget not spent
    budget.recent = [0.00125] * 4  # a capture and an analysis of 1.25 ms each: a recording costs 2.5 ms
    y = torch.zeros(2)
    for calls in (1, 2):  # about 1 and 2 ms of savings: not yet
        assert torch.equal(step(y, y), y + y)
        assert session.stats().records == 1 and session.stats().too_rare == calls
    assert torch.equal(step(y, y), y + y)  # about 3 ms
    assert session.stats().records == 2 and session.stats().too_rare == 2
    assert "too rare to pay back 2" in session.report()
    for rows in range(3, 21):  # shapes seen once each never pay back
        z = torch.zeros(rows)
        assert torch.equal(step(z, z), z + z)
    assert session.stats().records == 2 and session.stats().too_rare == 20
    assert step.cost.seconds > 0  # one eager call in eight is timed, the first of them not trusted


def test_with_the_budget_spent_a_key_records_once_its_own_calls_paid_for_a_recording(session_factory, monkeypatch):
    # a short loop of a few frequent shapes (the decode sample): the budget alone held most of
    # them back for the whole run; a key whose calls already saved a recording's cost records
    monkeypatch.setattr(admission, "REPLAY_SECONDS_GUESS", -1e-3)  # a replay saves about 1 ms
    monkeypatch.setattr(admission, "PAYBACK_HORIZON", 2)
    monkeypatch.setattr(admission, "EARLY_CALLS", 1)  # no early bet to speak of: twice the count
    session = session_factory(record_after=0, record_budget=0.01)
    budget = session.admission.budget
    step = session.region(add)
    x = torch.zeros(1)
    step(x, x)  # one of the first recordings: recorded at once
    budget.spent = 1e3  # the budget is spent for a long while
    budget.recent = [0.00125] * 4  # a recording costs 2.5 ms
    budget.recent = [0.0025] * 4  # a recording costs 5 ms
    y = torch.randn(2)
    seen = []
    for _ in range(6):
        assert torch.equal(step(y, y), y + y)
        stats = session.stats()
        seen.append((stats.too_rare, stats.deferred, stats.records))
    assert seen == [
        (1, 0, 1),  # 1 ms saved, twice over: less than a recording (too rare)
        (2, 0, 1),  # 2 ms, twice over: 4 ms
        (2, 1, 1),  # 3 ms, twice over, pays back; but the budget is spent: postponed
        (2, 2, 1),  # 4 ms
        (2, 2, 2),  # 5 ms saved by its own calls: recorded, budget or not
        (2, 2, 2),  # and replayed
    ]


def test_the_eager_cost_ignores_the_first_call_follows_drops_at_once_and_rises_slowly(session_factory):
    step = session_factory().region(add)
    for seconds, expected in [(1.0, 0.0), (0.002, 0.002), (0.010, 0.003), (0.001, 0.001), (0.009, 0.002)]:
        step.cost.took(seconds)  # the first call (which loaded kernels) is not trusted
        assert step.cost.seconds == pytest.approx(expected)
    fresh = session_factory().region(add)
    fresh.cost.took(0.001)
    fresh.cost.took(0.5)  # a slow second call: the estimate rises from the first by an eighth
    assert fresh.cost.seconds == pytest.approx(0.001 + 0.499 / 8)


@settings(max_examples=60, deadline=None)
@given(
    samples=st.lists(st.tuples(st.booleans(), st.floats(1e-6, 5e-3)), min_size=2, max_size=60),
    usual=st.floats(1e-4, 0.05),
    record_after=st.integers(0, 3),
)
def test_the_quiet_bound_never_hides_a_count_that_pays_back_whatever_the_estimates_did(samples, usual, record_after):
    # the bound is asked again only when the eager estimate or the replay's leaves its band
    # (QUIET_HEADROOM): after any run of timed calls and replays, no count below it pays back
    # at the estimates as they stand
    with use_backend(NullBackend()):
        session = DoubleSession(record_after=record_after, record_budget=0.03)
        policy = session.admission
        policy.budget.spent = 1.0  # past the first recordings
        policy.budget.recent = [usual / 2] * 3
        step = session.region(add)
        for replayed, seconds in samples:
            (step.cost.replayed if replayed else step.cost.took)(seconds)
            if step.cost.quiet.version != policy.budget.version:
                step.cost.refresh()  # as the next _decide would
            quiet, eager, replay = step.cost.quiet.below, step.cost.seconds, step.cost.replay.seconds
            if quiet == admission.QUIET_FOREVER:
                assert not policy.pays_back(10**9, eager, replay)
            else:
                assert not any(policy.pays_back(count, eager, replay) for count in range(record_after + 1, quiet))


def test_a_timed_call_asks_the_payback_rule_again_only_when_the_estimate_leaves_its_band(session_factory, monkeypatch):
    step = session_factory(record_after=1).region(add)
    asked = []
    original = Admission.quiet_below

    def asking(self, seconds, replay_seconds=None):
        asked.append(seconds)
        return original(self, seconds, replay_seconds)

    monkeypatch.setattr(Admission, "quiet_below", asking)
    step.cost.took(0.001)  # not trusted: no estimate yet
    step.cost.took(0.001)  # the first estimate: asked, for the band's top
    assert asked == [pytest.approx(0.001 * dispatch_module.QUIET_HEADROOM)]
    for seconds in (0.00095, 0.00092, 0.0009):  # drops inside the band
        step.cost.took(seconds)
    assert len(asked) == 1
    step.cost.took(0.0008)  # below 1 ms / headroom: asked again, from the new estimate
    assert asked[-1] == pytest.approx(0.0008 * dispatch_module.QUIET_HEADROOM) and len(asked) == 2
    while step.cost.seconds <= 0.0008 * dispatch_module.QUIET_HEADROOM:  # rises an eighth at a time
        step.cost.took(0.005)
        assert len(asked) == 2 or step.cost.seconds > 0.0008 * dispatch_module.QUIET_HEADROOM
    assert len(asked) == 3  # past the band's top: asked again


def test_debug_logging_turned_on_takes_the_quiet_bound_away_at_the_next_timed_call(session_factory):
    # with debug logging on, every call asks the rule (which says why it did not record); the
    # band keeps the bound across timed calls, but not past logging turned on
    step = session_factory(record_after=1).region(add)
    step.cost.took(0.001)
    step.cost.took(0.001)
    assert step.cost.quiet.below > 0
    logger = logging.getLogger("replay")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        step.cost.took(0.001)  # inside the band
        assert step.cost.quiet.below == 0
    finally:
        logger.setLevel(level)


@pytest.mark.parametrize("gate", [True, False], ids=["c", "python"])
def test_the_eager_path_times_one_call_in_8_then_one_in_64(session_factory, monkeypatch, gate):
    if gate and not dispatch_module.native_enabled():
        pytest.skip("replay._eager is not built here (or JITCORE_NATIVE=0)")
    session = session_factory(record_after=10**6)  # every call warms: the flat eager path
    step = _region(session, add, gate)
    timed = []
    step.program.took = lambda seconds: timed.append(step.forgotten.eager_runs)  # (read on each timed call)
    x = torch.ones(2)
    for _ in range(1024):
        step(x, x)
    settled = dispatch_module.TIMING_SETTLED
    assert timed == [*range(8, settled, 8), *range(settled, 1025, 64)]


def test_a_failed_capture_marks_the_key_eager_only_with_one_warning(session_factory):
    session = session_factory(record_after=0)
    session.capture_script = [recording.CaptureFailed("RuntimeError while capturing: operation not permitted")]
    step = session.region(add)
    x = torch.randn(3)
    with pytest.warns(replay.ReplayWarning, match="runs eagerly from now on: RuntimeError") as caught:
        for _ in range(4):
            assert torch.equal(step(x, x), x + x)
    assert len([w for w in caught if issubclass(w.category, replay.ReplayWarning)]) == 1
    assert session.stats().eager_only_keys == 1 and session.stats().eager_runs == 4
    assert next(iter(step.entries.values())).state == EAGER_ONLY
    assert "operation not permitted" in session.report()


def test_a_jit_miss_during_capture_runs_eagerly_and_records_next_time(session_factory):
    session = session_factory(record_after=0)
    session.capture_script = [recording.CaptureAborted("no call state")]
    step = session.region(add)
    x = torch.randn(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(x, x)
        step(x, x)
    stats = session.stats()
    assert (stats.record_retries, stats.eager_runs, stats.records, stats.replays) == (1, 1, 1, 1)


def test_a_capture_asking_to_retry_later_gives_up_after_three_retries(session_factory):
    session = session_factory(record_after=0)
    session.capture_script = [recording.RecordLater("a dynamic grid was 0")] * 4
    step = session.region(add)
    x = torch.randn(3)
    for _ in range(3):
        step(x, x)
    assert session.stats().eager_only_keys == 0
    with pytest.warns(replay.ReplayWarning, match="recording kept failing: a dynamic grid was 0"):
        step(x, x)
    assert session.stats().eager_only_keys == 1 and session.stats().record_retries == 4


def test_jit_misses_during_capture_are_retried_without_a_limit(session_factory):
    session = session_factory(record_after=0)
    session.capture_script = [recording.CaptureAborted("no call state")] * 6
    step = session.region(add)
    x = torch.randn(3)
    for _ in range(7):
        step(x, x)
    assert session.stats().eager_only_keys == 0 and session.stats().records == 1


def test_a_retry_asked_for_by_the_analysis_records_again_later(session_factory):
    session = session_factory(record_after=0)
    session.analyse_script = [recording.RecordLater("skipped launch")]
    step = session.region(add)
    x = torch.randn(3)
    step(x, x)  # records
    step(x, x)  # its analysis asks for a later recording: eager
    step(x, x)  # records again
    step(x, x)  # replays
    stats = session.stats()
    assert (stats.records, stats.record_retries, stats.replays) == (2, 1, 3)


def test_a_call_the_graph_declines_runs_eagerly(session_factory, monkeypatch):
    session = session_factory(record_after=0)
    step = session.region(add)
    x = torch.randn(3)
    step(x, x)
    step(x, x)
    entry = next(iter(step.entries.values()))
    monkeypatch.setattr(entry.graph, "replay", lambda *leaves: MISMATCH)
    candidates = step.by_pre_key[dispatch_module.pre_key([x, x])]
    candidates[:] = [(guard, entry.graph.replay, e) for guard, _run, e in candidates]  # the pre-key's run, patched
    eager_before = session.stats().eager_runs
    assert torch.equal(step(x, x), x + x)  # through the fast path
    assert session.stats().declined == 1 and session.stats().eager_runs == eager_before + 1


def test_more_staging_found_by_a_capture_records_again_with_it(session_factory):
    session = session_factory(record_after=0)
    session.analyse_script = [recording.CaptureRetry(Plan(needs_staging={1}, needs_copy_back={1}))]
    step = session.region(add)
    step(torch.randn(3), torch.randn(3))  # records
    step(torch.randn(3), torch.randn(3))  # its analysis asks for staging: records again
    assert [c[2] for c in session.captures] == [set(), {1}]
    assert [c[3] for c in session.captures] == [set(), {1}]


def test_recorded_keys_are_served_by_pre_key_and_guard_without_computing_a_key(session_factory, monkeypatch):
    session = session_factory(record_after=0)
    step = session.region(add)
    x, y = torch.randn(5), torch.randn(5)
    step(x, y)
    step(x, y)
    calls = []
    original = step._keyed_call
    monkeypatch.setattr(step, "_keyed_call", lambda *a: calls.append(1) or original(*a))
    step(torch.randn(5), torch.randn(5))
    assert calls == []  # guarded hit
    step(torch.randn(6), torch.randn(6))
    assert calls == [1]  # another shape: the key path
    entry = next(iter(step.entries.values()))
    assert "_tensor_guard0(_a0, _a1)" in entry.guard.source
    assert [c[2] for c in step.by_pre_key[dispatch_module.pre_key([x, y])]] == [entry]


def test_one_dispatch_serves_keys_of_every_arity_from_the_pre_key_table(session_factory):
    """The region's dispatch (the gate in C, or FlatDispatch) is made once and reads the
    pre-key table at call time: keys of new arities, and keys recorded again after an
    invalidation, need nothing generated or swapped."""
    session = session_factory(record_after=0)
    step = session.region(lambda *tensors: sum(tensors))
    dispatch = step.dispatch
    for size in (5, 5, 6, 6):
        step(torch.randn(size), torch.randn(size))
    for _ in range(2):
        step(torch.randn(4), torch.randn(4), torch.randn(4))
    assert {len(k) for k in step.by_pre_key} == {2, 3} and len(step.by_pre_key) == 3
    x, y = torch.randn(6), torch.randn(6)
    replays = session.stats().replays
    assert torch.equal(step(x, y), x + y) and session.stats().replays == replays + 1
    session.invalidate()
    assert step.by_pre_key == {} and lifecycle.problems(session) == []
    for _ in range(3):
        step(torch.randn(7), torch.randn(7))
    assert step.dispatch is dispatch and len(step.by_pre_key) == 1


def test_region_globals_drift_rekeys(session_factory, monkeypatch):
    session = session_factory(record_after=0)
    namespace = {"scale": 2.0}
    exec("def scaled(x):\n    return x * scale", namespace)
    step = session.region(namespace["scaled"])
    x = torch.randn(3)
    assert torch.equal(step(x), x * 2)
    step(x)
    namespace["scale"] = 3.0
    assert torch.equal(step(x), x * 3)
    assert session.stats().invalidations == 1
    assert session.stats().records == 2


def test_invalidate_drops_graphs_and_keys_record_again(session_factory):
    session = session_factory(record_after=1)
    step = session.region(add)
    x = torch.randn(3)
    for _ in range(3):
        step(x, x)
    session.invalidate()
    assert session.stats().graphs == 0 and FakeGraph.instances[-1].released
    for _ in range(3):
        step(x, x)
    stats = session.stats()
    assert (stats.records, stats.eager_runs, stats.invalidations) == (2, 2, 1)


def test_verify_every(session_factory):
    session = session_factory(record_after=0, verify_every=3)
    step = session.region(add)
    x = torch.randn(3)
    for _ in range(10):
        step(x, x)
    assert FakeGraph.instances[-1].verified == 3 and session.stats().verifications == 3


def test_closed_sessions_refuse_calls(session_factory):
    with session_factory() as session:
        step = session.region(add)
        step(torch.randn(2), torch.randn(2))
    assert "calls 1" in session.report()
    with pytest.raises(replay.SessionClosedError, match="closed"):
        step(torch.randn(2), torch.randn(2))


def test_report_lists_keys_and_input_choices(session_factory):
    session = session_factory(record_after=0)
    step = session.region(add, name="decode")
    step(torch.randn(2, 3), torch.randn(2, 3))
    step(torch.randn(2, 3), torch.randn(2, 3))
    text = session.report()
    assert "decode" in text and "float32[2,3]" in text and "args[0]: rebound" in text


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)]),
        lambda: torch.nested.nested_tensor([torch.randn(2, 3)], layout=torch.jagged),
        lambda: torch.randn(2, 3).to_sparse(),
    ],
    ids=["nested", "nested_jagged", "sparse"],
)
@pytest.mark.parametrize("after_a_recorded_key", [False, True])
def test_unusual_tensors_are_refused_cleanly_on_the_fast_and_slow_paths(session_factory, make, after_a_recorded_key):
    """A strided nested tensor's ``.shape`` raises torch's internal error: the fast path and
    the admission count must hand it to the key, which refuses it with jitcore's error."""
    session = session_factory(record_after=0)
    step = session.region(lambda x: x * 2)
    if after_a_recorded_key:
        for _ in range(3):
            step(torch.ones(2, 3))
        assert [entry.state for entry in step.entries.values()] == [REPLAYING]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: nested tensors are a prototype
        unusual = make()
    with pytest.raises(jitcore.UnsupportedTensorError):
        step(unusual)
    assert session.stats().calls == (3 if after_a_recorded_key else 0)


def test_nested_arguments_and_dynamic_scalars(session_factory):
    session = session_factory(record_after=1)

    @session.region
    def step(batch, pos, scale=1.0):
        return batch["x"] * pos + scale

    x = torch.randn(4)
    for pos in range(4):
        assert torch.equal(step({"x": x}, replay.dynamic(pos), scale=2.0), x * pos + 2.0)
    assert session.stats().records == 1


def test_without_a_gpu_every_call_runs_eagerly():
    session = replay.capture()
    if session.can_record():
        pytest.skip("a GPU is present")
    step = session.region(add)
    x = torch.randn(3)
    for _ in range(3):
        assert torch.equal(step(x, x), x + x)
    assert session.stats().eager_runs == 3 and session.stats().records == 0


def test_graphed_decorator_has_its_own_session():
    @replay.graphed(record_after=3)
    def double(x):
        return x * 2

    assert double.session.policy.record_after == 3
    assert torch.equal(double(torch.ones(2)), torch.full((2,), 2.0))


@pytest.mark.parametrize(
    "policy, match",
    [
        ({"record_after": -1}, "record_after"),
        ({"max_graphs": 0}, "max_graphs"),
        ({"clone_outputs": 1}, "clone_outputs"),
        ({"verify_every": 1.5}, "verify_every"),
        ({"check_stale": "yes"}, "check_stale"),
    ],
)
def test_bad_policy_values_name_the_field(policy, match):
    with pytest.raises(ValueError, match=match):
        replay.capture(**policy)
    with pytest.raises(TypeError):
        replay.capture(record_afterr=1)


@pytest.mark.parametrize("entry_point", [replay.capture, replay.graphed], ids=["capture", "graphed"])
def test_capture_and_graphed_list_every_option_of_the_policy_with_its_type_and_default(entry_point, monkeypatch):
    # help(replay.capture) shows each option: keyword-only, typed, the Policy's default
    parameters = inspect.signature(entry_point).parameters
    options = {name: p for name, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    fields = attrs.fields(replay.Policy)
    assert list(options) == [field.name for field in fields]
    assert {name: p.default for name, p in options.items()} == {field.name: field.default for field in fields}
    assert all(p.annotation is not inspect.Parameter.empty for p in options.values())
    shown = pydoc.render_doc(entry_point, renderer=pydoc.plaintext)
    assert all(f"{field.name}:" in shown for field in fields)
    monkeypatch.setenv("REPLAY_DEBUG", "1")
    assert replay.Policy().check_stale and replay.capture().policy.check_stale  # None: from REPLAY_DEBUG
    assert not replay.capture(check_stale=False).policy.check_stale


def test_a_session_takes_a_policy_and_overrides_of_its_fields():
    policy = replay.Policy(max_graphs=3, buckets=[8, 2])
    session = Session(policy, record_after=4)
    assert (session.policy.max_graphs, session.policy.record_after, session.policy.buckets) == (3, 4, (2, 8))
    assert Session(policy).policy is not policy and Session(policy).policy == policy
    with pytest.raises(TypeError, match="policy must be a replay.Policy, got dict"):
        Session({"record_after": 1})
    with pytest.raises(ValueError, match="record_after"):
        Session(policy, record_after=-1)


def _warned_here(call, *args) -> tuple[str, int, int]:
    """The file and line a ReplayWarning given by ``call(*args)`` names, and this line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        call(*args)
    (warning,) = [w for w in caught if issubclass(w.category, replay.ReplayWarning)]
    return warning.filename, warning.lineno, line


@pytest.mark.parametrize("gate", [True, False], ids=["c", "python"])
def test_replay_warnings_name_the_users_line_on_the_c_and_the_python_path(session_factory, monkeypatch, gate):
    """A warning points at the line that called the region, whether the call went through the C
    region call and gate or through Python: a failed capture (the flat dispatch's rule, then the
    full path), a key that needs autograd (the full path), no GPU (the dispatch's miss)."""
    if gate and not dispatch_module.native_enabled():
        pytest.skip("replay._eager is not built here (or JITCORE_NATIVE=0)")
    if not gate:
        monkeypatch.setattr(Region, "__call__", region_module.PYTHON_REGION_CALL)
    session = session_factory(record_after=0)
    step = _region(session, add, gate)
    assert _in_c(step) == gate
    session.capture_script = [recording.CaptureFailed("no")]
    x = torch.ones(2)
    filename, lineno, line = _warned_here(step, x, x)
    assert (filename, lineno) == (__file__, line)
    w = torch.ones(3, requires_grad=True)
    filename, lineno, line = _warned_here(step, w, w)
    assert (filename, lineno) == (__file__, line)
    with use_backend(NullBackend()):
        cpu = Session(record_after=0)
    cpu._gpu = False
    eager = _region(cpu, add, gate)
    filename, lineno, line = _warned_here(eager, x, x)
    assert (filename, lineno) == (__file__, line)


def test_the_capture_is_observed_unless_a_clean_warm_up_was(session_factory):
    session = session_factory(record_after=1)
    reads = session.region(add)  # x + y: a torch op reads both inputs
    writes_nothing = session.region(lambda x: torch.empty_like(x), name="alloc")  # metadata only
    x, y = torch.randn(3), torch.randn(3)
    for _ in range(2):
        reads(x, y)
        writes_nothing(x)
    (_, _, stage, _, observed), (_, _, stage2, _, observed2) = session.captures
    assert (stage, observed) == ({0, 1}, True)
    assert (stage2, observed2) == (set(), False)
    for _ in range(2):  # the same tensor twice: a first capture never stages them apart
        reads(x, x)
    assert session.captures[2][2] == set()
    session0 = session_factory(record_after=0)
    session0.region(lambda x: torch.empty_like(x))(x)
    assert session0.captures[0][4] is True  # no warm-up: observe the capture itself


def test_a_spoiled_pool_is_retired_and_random_drawing_graphs_record_again(session_factory, monkeypatch):
    session = session_factory(record_after=0)
    retired = []
    monkeypatch.setattr(
        session, "retire_pool", lambda device: retired.append(device) or Session.retire_pool(session, device)
    )
    draws = session.region(add, name="draws")
    x = torch.randn(3)
    draws(x, x)
    draws(x, x)  # recorded and analysed
    (entry,) = draws.entries.values()
    entry.uses_rng = True
    session.capture_script = [recording.SpoiledPool("the capture was invalidated: a host sync")]
    other = session.region(lambda x: x * 2, name="other")
    with pytest.warns(replay.ReplayWarning, match="invalidated"):
        other(x)
    assert retired == [-1]
    assert entry.state == WARMING and entry.graph is None  # dropped: it records again
    assert torch.equal(draws(x, x), x + x)
    # a capture awaiting its analysis is dropped too
    pending = session.region(lambda x: x + 1, name="pending")
    pending(x)
    (waiting,) = pending.entries.values()
    assert waiting.state == AWAITING_ANALYSIS
    waiting.uses_rng = True
    session.capture_script = [recording.SpoiledPool("the capture could not start")]
    with pytest.warns(replay.ReplayWarning):
        session.region(lambda x: x * 3, name="third")(x)
    assert waiting.state == WARMING and waiting.unanalysed is None
    assert torch.equal(pending(x), x + 1)


def test_an_unexpected_error_in_the_analysis_leaves_the_key_recordable(session_factory):
    session = session_factory(record_after=0)
    session.analyse_script = [RuntimeError("cuGraphGetNodes failed")]
    step = session.region(add)
    x = torch.randn(3)
    step(x, x)  # records
    with pytest.raises(RuntimeError, match="cuGraphGetNodes"):
        step(x, x)  # its analysis fails: the error is raised, nothing is left half-built
    (entry,) = step.entries.values()
    assert entry.state == WARMING and entry.unanalysed is None and session.captures[0] is not None
    assert torch.equal(step(x, x), x + x)  # records again
    assert torch.equal(step(x, x), x + x)  # replays
    assert entry.state == REPLAYING


def _report_rows(report: str) -> list[list[str]]:
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("region")) + 2
    rows = []
    for line in lines[start:]:
        if not line.strip() or line.startswith("  no CUDA") or line.strip() == "inputs:":
            break
        rows.append(line.split())
    return rows


def _row_totals(session) -> tuple[int, int, int]:
    # columns from the right: calls, replays, eager, capture ms, MiB
    rows = _report_rows(session.report())
    return tuple(sum(int(row[i]) for row in rows) for i in (-5, -4, -3))


def test_a_loop_over_thousands_of_plain_floats_keeps_bounded_bookkeeping(monkeypatch):
    # no GPU (on a GPU machine too): the real session runs everything eagerly and says so once
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replay.capture() as session:
            scale = session.region(lambda x, factor: x * factor, name="scale")
            x = torch.randn(4)
            for number in range(2000):
                assert torch.equal(scale(x, number + 0.5), x * (number + 0.5))
    said = [w for w in caught if issubclass(w.category, replay.ReplayWarning)]
    assert len(said) == 1 and "no CUDA GPU" in str(said[0].message)
    assert scale.entries == {}
    text = session.report()
    assert len(text) < 2000 and "no CUDA GPU" in text
    stats = session.stats()
    assert _row_totals(session) == (stats.calls, stats.replays, stats.eager_runs) == (2000, 0, 2000)


def test_eager_only_keys_are_bounded_and_the_report_adds_up(session_factory, monkeypatch):
    monkeypatch.setattr("replay.lifecycle.MAX_IDLE_ENTRIES", 10)
    session = session_factory(record_after=0)
    step = session.region(add)
    for n in (1, 1, 1):  # a recorded key, replayed
        step(torch.randn(n), torch.randn(n))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", replay.ReplayWarning)
        for n in range(2, 60):  # every other key fails to record: eager-only, one entry each
            session.capture_script = [recording.CaptureFailed("no")]
            for _ in range(2):
                x = torch.randn(n)
                assert torch.equal(step(x, x), x + x)
    assert len(step.entries) == 11  # the recorded key and the 10 most recent eager-only ones
    assert next(iter(step.entries.values())).state == REPLAYING  # called long ago, but it holds a graph
    stats = session.stats()
    assert _row_totals(session) == (stats.calls, stats.replays, stats.eager_runs)
    assert len(_report_rows(session.report())) <= replay.session.REPORT_KEYS + 1


def test_one_tensor_passed_two_thousand_times_costs_about_what_distinct_tensors_cost(session_factory):
    """The aliasing part of its key is one group of 2000 leaves, not 2000 * 1999 / 2 pairs: every
    call (the observed warm-up, the recording, the replays) takes little time and keeps little."""
    session = session_factory()
    step = session.region(lambda xs: xs[0] * 2)
    x = torch.ones(4)
    seconds = []
    for _ in range(6):
        started = time.perf_counter()
        assert torch.equal(step([x] * 2000), x * 2)
        seconds.append(time.perf_counter() - started)
    # (the median: a loaded machine's pauses are not the key's; pairs took about a second each)
    assert session.stats().replays == 5 and sorted(seconds)[3] < 0.2 and sum(seconds) < 1.2, seconds
    tracemalloc.start()
    try:
        step([x] * 2000)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept < 2**20 and peak < 8 * 2**20, (kept, peak)
    (entry,) = step.entries.values()
    assert entry.key[3] == (tuple(range(2000)),)


def test_recordings_evictions_invalidations_and_fallbacks_are_logged(session_factory, caplog):
    caplog.set_level(logging.DEBUG, logger="replay")
    session = session_factory(record_after=0, max_graphs=1)
    step = session.region(add)
    session.capture_script = [recording.CaptureFailed("no")]
    with pytest.warns(replay.ReplayWarning):
        step(torch.randn(5), torch.randn(5))
    hot, cold = torch.randn(2), torch.randn(3)
    step(hot, hot)
    step(hot, hot)
    step(cold, cold)  # refused: the held graph is used more
    for _ in range(4):
        step(cold, cold)
    step(cold, cold)  # its graph replaces the other
    session.invalidate()
    messages = [r.getMessage() for r in caplog.records if r.name == "replay"]
    assert any("recorded in" in m and "float32[2]" in m for m in messages)
    assert any("not recorded, graphs held are used more" in m for m in messages)
    assert any("graph released for key" in m for m in messages)
    assert any("runs eagerly from now on: no" in m for m in messages)
    assert any("session invalidated" in m for m in messages)


def test_under_a_skewed_mix_the_hottest_keys_hold_the_graphs(session_factory):
    # batch sizes 1..128 drawn with Zipf-like weights, room for 12 graphs: the held graphs end
    # up being the most called keys, recorded about once each
    session = session_factory(record_after=1, max_graphs=12)
    step = session.region(add)
    generator = random.Random(3)
    sizes = list(range(1, 129))
    generator.shuffle(sizes)
    weights = [1 / rank**1.2 for rank in range(1, 129)]
    tensors = {n: (torch.randn(n), torch.randn(n)) for n in sizes}
    calls = collections.Counter()
    for n in generator.choices(sizes, weights=weights, k=6000):
        calls[n] += 1
        assert torch.equal(step(*tensors[n]), tensors[n][0] + tensors[n][1])
    held = {key[region_keys.LEAVES_START][1][0] for key, e in step.entries.items() if e.state == REPLAYING}
    hottest = {n for n, _ in calls.most_common(12)}
    assert len(held & hottest) >= 10, (sorted(held), sorted(hottest))
    stats = session.stats()
    assert stats.records <= 24 and stats.replays >= 0.6 * 6000, session.report()


_SCALE = [1.0]  # a global the region below reads: changing it is drift


def _scaled_add(x, y, *, bias=0.0):
    return x * _SCALE[0] + y + bias


@settings(max_examples=60, deadline=None)
@given(
    record_after=st.integers(0, 2),
    max_graphs=st.integers(1, 3),
    calls=st.lists(
        st.tuples(
            st.sampled_from(["call", "call", "call", "keyword", "fail", "invalidate", "drift"]),
            st.integers(1, 5),
            st.sampled_from([torch.float32, torch.float64]),
        ),
        max_size=40,
    ),
)
def test_property_admission_by_shapes_keeps_its_index_and_every_result_exact(record_after, max_graphs, calls):
    # whatever the calls (new shapes, other dtypes under the same shapes, keyword calls, failed
    # captures, invalidations, drift of the region's globals, entries dropped to stay bounded),
    # the index of the shapes that have entries matches the entries, and every call is exact
    original = replay.lifecycle.MAX_IDLE_ENTRIES
    replay.lifecycle.MAX_IDLE_ENTRIES = 3
    _SCALE[0] = 1.0
    try:
        with use_backend(NullBackend()), warnings.catch_warnings():
            warnings.simplefilter("ignore", replay.ReplayWarning)
            session = DoubleSession(record_after=record_after, max_graphs=max_graphs)
            DoubleSession.current = session
            step = session.region(_scaled_add)
            for what, n, dtype in calls:
                if what == "invalidate":
                    session.invalidate()
                    continue
                if what == "drift":
                    _SCALE[0] += 1.0
                    continue
                if what == "fail":
                    session.capture_script = [recording.CaptureFailed("scripted")]
                x, y = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
                expected = _scaled_add(x, y, bias=0.5) if what == "keyword" else _scaled_add(x, y)
                got = step(x, y, bias=0.5) if what == "keyword" else step(x, y)
                assert got.dtype == dtype and torch.equal(got, expected)
                session.capture_script = []
                held = collections.Counter(entry.counted[1] for entry in step.entries.values())
                assert step.entry_shapes == dict(held)
                assert all(entry.counted[0] is step for entry in step.entries.values())
            stats = session.stats()
            assert stats.calls == stats.replays + stats.eager_runs
    finally:
        replay.lifecycle.MAX_IDLE_ENTRIES = original
        _SCALE[0] = 1.0


@settings(max_examples=25, deadline=None)
@given(
    calls=st.lists(st.integers(1, 12), min_size=1, max_size=400),
    record_after=st.integers(0, 3),
    budget_changes=st.dictionaries(
        st.integers(0, 199), st.tuples(st.floats(0, 1.0), st.floats(1e-4, 0.02)), max_size=5
    ),
    start=st.tuples(st.floats(0, 1.0), st.floats(1e-4, 0.02)),
    window=st.sampled_from([1024, 16, 5]),
    durations=st.lists(st.floats(1e-4, 4e-3), min_size=12, max_size=12),
    replay_share=st.floats(0.02, 1.2),
)
def test_the_eager_paths_shortcut_decides_and_counts_as_the_rule_does(
    calls, record_after, budget_changes, start, window, durations, replay_share
):
    # Region._eager_flat_shapes skips _decide below admission.quiet_below: a run with the
    # shortcut and a run without it (quiet_below 0) make the same recordings, the same counts;
    # with short windows, across halvings (each one changes the peers the rule judges by); an
    # eager call takes a time of its own per size, so the region's estimate moves in and out
    # of the band its quiet bound holds for (QUIET_HEADROOM), through the timing schedule's
    # change (TIMING_SETTLED); a replay takes a share of it, so the replay's estimate moves too
    def run(shortcut: bool, gate: bool = True) -> tuple[list[tuple], int]:
        state = numpy.zeros(2)  # the time; 1 while a graph replays (the watch never reads an array's values)
        clock = types.SimpleNamespace(perf_counter=lambda: float(state[0]))

        def timed_add(x, y):
            state[0] += durations[len(x) - 1] * (replay_share if state[1] else 1.0)  # however often the clock is read
            return x + y

        class Replaying(FakeGraph):
            def replay(self, *leaves):
                state[1] = 1.0
                try:
                    return super().replay(*leaves)
                finally:
                    state[1] = 0.0

        class Replays(DoubleSession):
            build_graph = Replaying

        original_quiet, original_decide, original_time = Admission.quiet_below, Region._decide, region_module.time
        decided = []

        def counting_decide(self, *args):
            decided.append(1)
            return original_decide(self, *args)

        original_gate = dispatch_module.EagerGate
        Admission.quiet_below = original_quiet if shortcut else (lambda self, eager_seconds, replay_seconds=None: 0)
        Region._decide = counting_decide
        region_module.time = clock  # an eager call takes its size's duration
        if not gate:
            dispatch_module.EagerGate = None  # the Python methods
        try:
            with use_backend(NullBackend()):
                session = Replays(record_after=record_after, record_budget=0.05, max_graphs=4)
                DoubleSession.current = session
                session.admission.sketch.window = window
                step = session.region(timed_add)  # its gate, if any, times calls by the clock above
                seen = []
                budget_changes.setdefault(0, start)  # past the first recordings or not, a recording's usual cost
                for number, rows in enumerate(calls):
                    if number in budget_changes:
                        spent, usual = budget_changes[number]
                        session.admission.budget.spent = spent
                        session.admission.budget.recent = [usual / 2] * 3
                    x = torch.full((rows,), float(number))
                    assert torch.equal(step(x, x), x + x)
                    s = session.stats()
                    seen.append((s.records, s.too_rare, s.deferred, s.refused, s.eager_runs, s.replays))
                assert s.invalidations == 0  # (a clock the region reaches in plain values would re-key it)
                session.close()
                return seen, len(decided)
        finally:
            Admission.quiet_below, Region._decide, region_module.time = original_quiet, original_decide, original_time
            dispatch_module.EagerGate = original_gate

    (fast, asked_fast), (slow, asked_slow) = run(shortcut=True), run(shortcut=False, gate=False)
    assert fast == slow
    assert asked_fast <= asked_slow
    assert run(shortcut=True, gate=False)[0] == slow  # the Python methods' shortcut too


_GATE = pytest.mark.skipif(
    not dispatch_module.native_enabled(), reason="replay._eager is not built here (or JITCORE_NATIVE=0)"
)


def _in_c(region) -> bool:
    return dispatch_module.EagerGate is not None and type(region.dispatch) is dispatch_module.EagerGate


def _region(session, fn, gate: bool):
    """``session.region(fn)`` with its dispatch in C (``gate``) or its Python fallback."""
    saved = dispatch_module.EagerGate
    if not gate:
        dispatch_module.EagerGate = None
    try:
        return session.region(fn)
    finally:
        dispatch_module.EagerGate = saved


@_GATE
def test_a_region_takes_its_flat_eager_path_in_c_where_built(session_factory, monkeypatch):
    session = session_factory(record_after=100)
    step = session.region(add)
    assert type(step.dispatch) is dispatch_module.EagerGate and step.dispatch.program is step.program
    monkeypatch.setenv("JITCORE_NATIVE", "0")
    other = session.region(add)
    assert type(other.dispatch) is dispatch_module.FlatDispatch  # turned off: the Python fallback
    assert other.dispatch.program is other.program


@_GATE
def test_the_gate_reads_and_bumps_plain_slots_directly_and_anything_else_as_attributes(session_factory):
    # the ints of slotted objects (the sketch, the session's counters, the region's aggregate)
    # are read and written at their slots; an object that hooks setting attributes is written
    # through them (its hook sees every write), and the counts come out the same either way
    session = session_factory(record_after=100)
    step = session.region(add)
    assert set(step.dispatch.direct_slots) == {
        "sketch.calls",
        "sketch.window",
        "sketch.counts",
        "counters.too_rare",
        "counters.eager_runs",
        "forgotten.eager_runs",
        "budget.version",  # (read only: its hooked __setattr__ is never bypassed)
        "quiet.below",
        "quiet.version",
        "replay_times.runs",
    }
    x = torch.ones(2)
    for _ in range(5):
        step(x, x)
    assert (session.stats().eager_runs, session.admission.sketch.calls, step.forgotten.eager_runs) == (5, 5, 5)

    written = []

    class Hooked(type(session.counters)):
        __slots__ = ()

        def __setattr__(self, name, value):
            written.append(name)
            super().__setattr__(name, value)

    hooked_session = session_factory(record_after=100)
    hooked_session.counters = Hooked()
    hooked = hooked_session.region(add)
    assert not any(name.startswith("counters.") for name in hooked.dispatch.direct_slots)
    written.clear()  # (the counters' own construction)
    for _ in range(5):
        hooked(x, x)
    assert written.count("eager_runs") == 5 and hooked_session.stats().eager_runs == 5


@_GATE
def test_the_c_eager_path_runs_errors_through_and_releases_the_exclusion(session_factory):
    session = session_factory(record_after=100)
    holders = recording.CAPTURES._holders

    def broken(x):
        assert holders, "the exclusion is held shared while the region runs"
        raise ValueError("from the region")

    step = session.region(broken)
    for _ in range(10):  # timed calls among them
        with pytest.raises(ValueError, match="from the region"):
            step(torch.ones(1))
        assert not holders
    assert session.stats().eager_runs == 10


@_GATE
@pytest.mark.parametrize(
    "args",
    [
        (torch.ones(2), 3),  # a tensor and a plain constant: the gate
        (torch.ones(2), [1, 2]),  # a list: the full path
        (torch.ones(2).to_sparse(),),  # not a strided tensor: the full path refuses loudly
        tuple(torch.ones(1) for _ in range(40)),  # more arguments than the flat specs: the Python method
        (torch.ones(2), replay.Dynamic(3)),  # a Dynamic scalar: the full path
    ],
    ids=["tensor-and-int", "list", "sparse", "40-args", "dynamic"],
)
def test_the_c_eager_path_and_the_python_one_agree_on_every_kind_of_call(session_factory, args):
    def region(*xs):
        return sum(float(x.sum()) if isinstance(x, torch.Tensor) else 0.0 for x in xs)

    results = []
    for gate in (True, False):
        session = session_factory(record_after=100)
        step = _region(session, region, gate)
        try:
            outcome = [step(*args) for _ in range(3)]
        except Exception as error:  # both paths must refuse alike
            outcome = (type(error), str(error))
        s = session.stats()
        results.append((outcome, s.eager_runs, s.too_rare, s.records, s.calls))
    assert results[0] == results[1]


@_GATE
def test_with_recorded_keys_the_c_dispatch_and_the_python_one_agree_on_every_kind_of_call(session_factory):
    # with keys recorded the gate computes the pre-key and looks it up in C, handing a hit to
    # the generated dispatch (_fast_keys) and a miss straight to the eager path: every kind
    # of call, hit and miss, gives the same results and the same counts as the Python path
    def region(*xs):
        total = sum(float(x.sum()) if isinstance(x, torch.Tensor) else 0.0 for x in xs)
        return torch.full((1,), total)

    def calls():
        two, three = torch.ones(2), torch.ones(3)
        return [
            (two, 3),  # recorded (record_after=0: its second call)
            (two, 3),
            (two, 3),  # replayed: a hit
            (three, 3),  # same arity, other shapes: a miss, eagerly
            (two, 4),  # another constant: a miss
            (two, replay.Dynamic(3)),  # a Dynamic scalar: the full path, which records it
            (two, replay.Dynamic(5)),
            (two, replay.Dynamic(7)),  # a hit of the Dynamic key
            (two, [1, 2]),  # a list: not flat, the full path
            (two, {"a": 1}),  # unhashable in a pre-key: the full path
            (two.to_sparse(),),  # not strided: refused loudly
            (two,),  # an arity without recorded keys
            tuple(torch.ones(1) for _ in range(40)),  # beyond the flat specs
            (two, 3),  # the first key again: a hit
        ]

    results = []
    for gate in (True, False):
        session = session_factory(record_after=0)
        step = _region(session, region, gate)
        assert _in_c(step) == gate
        seen = []
        for args in calls():
            try:
                seen.append(step(*args).tolist())
            except Exception as error:  # both paths must refuse alike
                seen.append((type(error), str(error)))
            s = session.stats()
            seen.append((s.calls, s.replays, s.eager_runs, s.records, s.too_rare, step.cost.replay.runs))
        assert step.by_pre_key, "keys were recorded and put on the fast path"
        results.append(seen)
    assert results[0] == results[1]
    replays = [entry for entry in results[0] if isinstance(entry, tuple) and len(entry) == 6][-1][1]
    assert replays >= 3  # hits were served by graphs, through the gate's lookup


@_GATE
def test_the_gate_sends_a_miss_to_the_eager_path_and_a_hit_to_its_candidates(session_factory, monkeypatch):
    # the point of the lookup in C: a call whose shapes have no graph never enters Python
    # before the region's function; a hit calls its candidate's guard and replay from C (no
    # generated dispatch, no full path)
    session = session_factory(record_after=1)
    step = session.region(add)
    x = torch.ones(4)
    for _ in range(4):
        step(x, x)  # warmed, recorded, analysed and replayed, replayed
    replays = session.stats().replays
    assert step.by_pre_key and _in_c(step)
    full, served = [], []
    pre = (x.shape, x.shape)
    ((guard, run, entry),) = step.by_pre_key[pre]

    def counting(*args):
        served.append(args)
        return run(*args)

    step.by_pre_key[pre][0] = (guard, counting, entry)

    original_call = Region.full_path
    monkeypatch.setattr(Region, "full_path", lambda self, *a: (full.append(1), original_call(self, *a))[1])
    for rows in (5, 6, 7, 8):  # each seen once: warming, eagerly
        y = torch.full((rows,), 2.0)
        assert torch.equal(step(y, y), y + y)
    assert served == [] and full == []  # misses: the gate ran them eagerly itself
    assert session.stats().eager_runs == 5
    assert torch.equal(step(x, x), x + x)
    assert len(served) == 1 and served[0][0] is x and full == []
    assert session.stats().replays == replays + 1
    assert next(reversed(session.lru)) is entry  # touched


@pytest.mark.parametrize("gate", [True, False], ids=["c", "python"])
def test_candidates_are_tried_in_turn_and_a_declined_one_leaves_the_call_to_the_next(
    session_factory, monkeypatch, gate
):
    """Candidates of one pre-key are tried guard by guard; the first yes checks the globals,
    is touched and replays; a replay that declines leaves the call to the next candidate,
    then to the eager path; a drift of the globals re-keys before any replay. The gate in C
    and its Python fallback alike, each reading the program's globals check on every hit."""
    if gate and not dispatch_module.native_enabled():
        pytest.skip("replay._eager is not built here (or JITCORE_NATIVE=0)")
    session = session_factory(record_after=0)
    step = _region(session, add, gate)
    x = torch.ones(4)
    for _ in range(3):
        step(x, x)
    pre = (x.shape, x.shape)
    (first,) = step.by_pre_key[pre]
    log = []

    def candidate(name, says, result):
        def guard(*args):
            log.append(("guard", name))
            return says

        def run(*args):
            log.append(("run", name))
            return result

        return (guard, run, first[2])

    step.by_pre_key[pre][:] = [
        candidate("a", False, None),
        candidate("b", True, MISMATCH),
        candidate("c", True, "served"),
        candidate("d", True, "never"),
    ]
    drift_checks = []
    monkeypatch.setattr(step.program, "region_drift", lambda: drift_checks.append(1))
    assert step(x, x) == "served"
    assert log == [("guard", "a"), ("guard", "b"), ("run", "b"), ("guard", "c"), ("run", "c")]
    assert len(drift_checks) == 2  # before each replay
    log.clear()
    step.by_pre_key[pre][:] = [candidate("a", False, None), candidate("b", True, MISMATCH)]
    full = []
    original_call = Region.full_path
    monkeypatch.setattr(Region, "full_path", lambda self, *a: (full.append(1), original_call(self, *a))[1])
    assert torch.equal(step(x, x), x + x)  # none served: the eager path, which leaves a recorded key to the full path
    assert log == [("guard", "a"), ("guard", "b"), ("run", "b")] and full == [1]

    def drifted():
        raise dispatch_module.RegionDrift("x")

    step.by_pre_key[pre][:] = [candidate("c", True, "served")]
    monkeypatch.setattr(step.program, "region_drift", drifted)
    rekeyed = []
    monkeypatch.setattr(Region, "rekey", lambda self, args, kwargs: rekeyed.append(args) or "rekeyed")
    log.clear()
    assert step(x, x) == "rekeyed" and log == [("guard", "c")]  # the drift check comes before the replay


def test_a_loop_of_shapes_too_rare_to_record_skips_the_rule(session_factory, monkeypatch):
    # the shortcut is taken: after the first recordings, calls of keys far from paying back do not ask
    # _decide (but are counted as too rare all the same)
    session = session_factory(record_after=1, record_budget=0.03)
    session.admission.budget.spent = 1.0  # past the first recordings
    session.admission.budget.recent = [0.5] * 3  # a recording costs a second: nothing pays back soon
    step = session.region(add)
    decided = []
    original = Region._decide
    monkeypatch.setattr(Region, "_decide", lambda self, *args: (decided.append(1), original(self, *args))[1])
    for number in range(400):
        x = torch.full((number % 50 + 1,), 1.0)
        assert torch.equal(step(x, x), x + x)
    stats = session.stats()
    assert stats.records == 0 and stats.eager_runs == 400
    assert stats.too_rare == 400 - 50  # every call past each key's first
    assert len(decided) < 400 / 2  # the rule asked again only at each change of the eager estimate


@_GATE
def test_region_call_in_c_and_in_python_agree(session_factory, monkeypatch):
    # Region.__call__ is replay._eager.RegionCall where built: the same steps as the Python
    # method (flat calls, keyword arguments, the globals' drift), the same results and counts
    assert type(Region.__call__) is dispatch_module.RegionCall
    scale = [2.0]

    def region(x, y=None, *, twice=False):
        out = x * scale[0] if y is None else x + y
        return out * 2 if twice else out

    def run() -> list:
        session = session_factory(record_after=1)
        step = session.region(region)
        seen = []
        for number in range(12):
            x = torch.full((number % 3 + 1,), float(number))
            seen.append(step(x).tolist())
            seen.append(step(x, x, twice=number % 2 == 0).tolist())
            seen.append(step(x, y=x).tolist())
        s = session.stats()
        seen.append((s.records, s.replays, s.eager_runs, s.too_rare))
        assert step.__call__(torch.ones(1)).tolist() == [2.0]  # read as an attribute: bound to the region
        return seen

    native = run()
    monkeypatch.setattr(Region, "__call__", region_module.PYTHON_REGION_CALL)
    assert run() == native


@_GATE
def test_region_call_in_c_rekeys_when_the_globals_change(session_factory):
    session = session_factory(record_after=0)
    step = session.region(_factored)
    x = torch.ones(2)
    for _ in range(3):
        assert step(x).tolist() == [3.0, 3.0]
    global _FACTOR
    _FACTOR = 5.0
    try:
        assert step(x).tolist() == [5.0, 5.0]  # the drift raised inside _fast: _rekey, then the call
        assert session.stats().invalidations == 1
    finally:
        _FACTOR = 3.0


_FACTOR = 3.0


def _factored(x):
    return x * _FACTOR


# --- autograd (finding #2), pending captures (finding #9), what admission keeps alive (finding #8) ---


class DetachingGraph(FakeGraph):
    """FakeGraph returning what a real replay returns: outputs without autograd (RecordedGraph
    hands out detached views of its output memory)."""

    def replay(self, *leaves):
        outputs = super().replay(*leaves)
        return outputs.detach() if isinstance(outputs, torch.Tensor) else outputs


@pytest.fixture
def detaching_session_factory(session_factory, monkeypatch):
    monkeypatch.setattr(DoubleSession, "build_graph", DetachingGraph)
    return session_factory


def _double(x):
    return x * 2


@pytest.mark.parametrize("gate", [True, False], ids=["c", "python"])
def test_under_grad_mode_an_argument_requiring_grad_never_replays_and_keeps_its_grad_fn(
    detaching_session_factory, monkeypatch, gate
):
    # The finding: a graph recorded for x served w = x.requires_grad_() under grad mode (its
    # key did not hold requires_grad), and a real replay returns a detached output: w.grad
    # stayed None where eager gives 2.
    if not gate:
        monkeypatch.setattr(dispatch_module, "native_enabled", lambda: False)
    session = detaching_session_factory(record_after=1)
    step = session.region(_double)
    x = torch.ones(4)
    for _ in range(3):  # warm-up, recording, analysis and replay
        step(x)
    assert session.stats().replays == 2
    w = torch.ones(4, requires_grad=True)
    with pytest.warns(replay.ReplayWarning, match=r"args\[0\] requires grad.*torch\.no_grad\(\)") as caught:
        for _ in range(3):
            out = step(w)
            assert out.grad_fn is not None and out.requires_grad
            out.sum().backward()
        step(torch.ones(5, requires_grad=True))  # another shape: no second warning from this region
        step(torch.ones(5, requires_grad=True))
    assert len([w for w in caught if issubclass(w.category, replay.ReplayWarning)]) == 1
    assert w.grad.tolist() == [6.0] * 4  # three backward passes of 2 each, as eagerly
    stats = session.stats()
    assert stats.replays == 2 and stats.records == 1 and len(session.captures) == 1
    refused = [e for e in step.entries.values() if e.state == EAGER_ONLY]
    assert len(refused) == 2 and all("requires grad" in e.reason for e in refused)
    assert "requiring grad" in session.report()
    # the no-grad key of the same shape is another key: it still replays, and its graph was never touched
    assert step(x).grad_fn is None and session.stats().replays == 3
    # under torch.no_grad() the argument's requires_grad is keyed but nothing needs autograd:
    # recorded and replayed, its output as eager's (no grad_fn)
    with torch.no_grad():
        for _ in range(3):
            out = step(w)
            assert not out.requires_grad and torch.equal(out, torch.full((4,), 2.0))
    assert session.stats().records == 2 and session.stats().replays == 6  # (its recording launch serves a call)
    keys = [e.key for e in step.entries.values() if e.state == REPLAYING]
    assert len(keys) == 2 and keys[0] != keys[1]


class _Weighted:
    """A region reading a weight that requires grad, as a module's parameters do by default."""

    def __init__(self):
        self.weight = torch.full((4,), 3.0, requires_grad=True)

    def __call__(self, x):
        return x * self.weight


def test_outputs_requiring_grad_in_an_observed_warm_up_keep_its_keys_eager_under_grad_mode(
    detaching_session_factory,
):
    # No argument requires grad, the region's weight does: eagerly the output has a grad_fn
    # and backward reaches the weight; a graph would hand out detached outputs.
    session = detaching_session_factory(record_after=1)
    model = _Weighted()
    step = session.region(model, name="weighted")
    x = torch.ones(4)
    with pytest.warns(replay.ReplayWarning, match=r"output of an eager run required grad.*inference_mode") as caught:
        for _ in range(4):
            out = step(x)
            assert out.grad_fn is not None
            out.sum().backward()
        for _ in range(3):  # another shape of the same argument structure: eager too, no second warning
            assert step(torch.ones(2, 4)).grad_fn is not None
    assert len([w for w in caught if issubclass(w.category, replay.ReplayWarning)]) == 1
    assert model.weight.grad.tolist() == [4.0] * 4
    assert session.captures == [] and session.stats().replays == 0  # never even captured
    # under torch.inference_mode() the same calls record and replay
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(step(x), torch.full((4,), 3.0))
    assert session.stats().records == 1 and session.stats().replays >= 2


def test_pending_captures_never_analysed_give_way_to_a_hot_key_and_free_their_graphs(session_factory):
    # The finding: four sizes seen twice (recorded on their last call, never analysed), then
    # one hot size: pending 4, graphs 0, the hot key refused 9,999 times of 10,000 and the four
    # captures kept for good.
    session = session_factory(record_after=1, max_graphs=4, record_budget=1)
    step = session.region(lambda x: x + 1)
    for n in range(1, 5):
        for _ in range(2):
            step(torch.zeros(n))
    pending = list(session.pending)
    assert len(pending) == 4 and all(e.state == AWAITING_ANALYSIS for e in pending)
    captured = [e.unanalysed.graph for e in pending]
    hot = torch.zeros(100)
    for _ in range(1000):
        assert torch.equal(step(hot), torch.ones(100))
    stats = session.stats()
    assert stats.replays - 4 >= 990 and stats.refused <= 4  # the hot key records on its fifth call
    assert stats.graphs == 1 and len(session.pending) == 3 and stats.evictions == 1
    released = [graph for graph in captured if graph.resets]
    assert len(released) == 1 and released[0] is captured[0]  # the oldest of equals, its graph reset
    assert pending[0].unanalysed is None and pending[0].state == WARMING
    assert len(session.lru) + len(session.pending) <= 4


def test_captures_of_keys_that_never_come_back_are_evicted_as_graphs_are_and_stay_within_max_graphs(session_factory):
    # Keys each recorded on their last call, one after another, beside a hot graph: a capture
    # is a victim like a graph (least used first), the hot graph stays, and at most one
    # capture beyond max_graphs is held at any time.
    session = session_factory(record_after=4, max_graphs=2, record_budget=1)
    step = session.region(lambda x: x + 1)
    hot = torch.zeros(100)
    for _ in range(20):
        step(hot)
    captured = {}
    calls = {1: 5, 2: 11, 3: 11}  # 5: room left; 11: more than twice the 5 of the capture it replaces
    for n, count in calls.items():
        for _ in range(count):
            step(torch.zeros(n))
            assert len(session.lru) + len(session.pending) <= 3
        captured[n] = next(reversed(session.pending)).unanalysed.graph  # the capture just made
    state = {e.key[region_keys.LEAVES_START][1][0]: e for e in step.entries.values()}
    assert state[100].state == REPLAYING and state[100] in session.lru
    assert [e.key[region_keys.LEAVES_START][1][0] for e in session.pending] == [2, 3]
    assert state[1].state == WARMING and state[1].unanalysed is None and session.stats().evictions == 1
    assert [captured[n].resets for n in calls] == [1, 0, 0]  # key 1's capture released: its memory freed
    for _ in range(11):  # a key as often called as the captures held: not admitted (equals do not take turns)
        step(torch.zeros(4))
    assert session.stats().refused >= 6 and [e.key[region_keys.LEAVES_START][1][0] for e in session.pending] == [2, 3]


@dataclasses.dataclass(frozen=True)
class _Batch:
    """A constant holding a tensor (the finding's ``Batch``): compared field by field."""

    ids: torch.Tensor


class _Holder:
    """A constant compared by identity, holding a tensor."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids


def test_admission_keeps_no_argument_alive_and_counts_constants_as_before(session_factory):
    # The finding: a constant holding tensors, new every step, is a leaf of its key, and
    # admission's counts kept every key of a window (1024 calls) alive: 500 steps held 500
    # batches, memory eager frees at once. (An object is walked now: its tensor, which a
    # torch op reads, is counted and keyed by its address, never held.)
    session = session_factory(record_after=3, record_budget=1)
    step = session.region(lambda x, holder: x + holder.ids)
    x = torch.zeros(1024)
    refs = []
    for _ in range(500):
        ids = torch.ones(1024)
        refs.append(weakref.ref(ids))
        assert torch.equal(step(x, _Holder(ids)), x + 1)
        del ids
    session.captures.clear()  # (the recording double's own record of what it was given)
    gc.collect()
    assert sum(ref() is not None for ref in refs) == 0
    # two objects holding the same tensor count as one key, as their key is one; another tensor apart
    held, other = torch.ones(1024), torch.ones(1024)
    counted = [
        step.keying.counted(region_keys.flat_call((x, _Holder(t)), {}, walk_objects=True)) for t in (held, held, other)
    ]
    assert counted[0] == counted[1] != counted[2]
    # an unhashable constant is still refused loudly, by its key
    with pytest.raises(TypeError, match="unhashable set"):
        step(x, {1, 2})


def test_constants_are_counted_by_what_they_are_compared_by_without_holding_their_tensors():
    count = keying._count_element
    t = torch.ones(3)
    counted = count(_Batch(t))  # a dataclass compared field by field: its fields, the tensor by identity
    assert counted == count(_Batch(t)) and counted != count(_Batch(torch.ones(3)))
    assert count(_Batch(t)) == count(_Batch(t))
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None  # the count did not keep the tensor alive
    assert count(4) == 4 and count("a") == "a" and count(torch.float32) is torch.float32
    frozen = frozenset({1, 2})
    assert count(frozen) is frozen  # compared by value: kept, to be compared


def test_a_weak_identity_is_equal_only_to_the_same_live_object():
    a, b = _Holder(None), _Holder(None)
    assert keying.WeakIdentity(a) == keying.WeakIdentity(a)
    assert keying.WeakIdentity(a) != keying.WeakIdentity(b)
    gone = keying.WeakIdentity(a)
    address = id(a)
    del a
    later = keying.WeakIdentity(b)
    later._hash = address  # as if b had taken a's address: still another object
    assert gone != later and hash(gone) == hash(later)
    # tensors by identity too, never by their elements (a tensor's == is elementwise)
    t = torch.ones(3)
    assert keying.WeakIdentity(t) == keying.WeakIdentity(t)
    assert keying.WeakIdentity(t) != keying.WeakIdentity(torch.ones(3))


def test_a_module_regions_parameters_and_buffers_are_tensors_it_holds_by_name():
    """forward reads a module's parameters and buffers as attributes, which the globals
    snapshot does not follow: a module region (or its bound forward) counts them among the
    tensors it reaches other than through its arguments, beside its globals' (an argument
    that is one of them is refused at capture: recording.input_doubts)."""

    class Cached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.register_buffer("cache", torch.zeros(4))

        def forward(self, x, cache):
            return self.linear(x) + self.cache + cache + _GLOBAL_WEIGHT

    net = Cached()
    own = {id(t) for t in [*net.parameters(), *net.buffers()]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = replay.capture()
    for fn in (net, net.forward):
        region = session.region(fn)
        held = region.recorder.tensors_held_by_name()
        assert held.named == [] and {id(t) for t in held.attributes} == own  # no snapshot yet: no globals
        region.snapshot = jitcore.GlobalsSnapshot(fn, owner="test")
        held = region.recorder.tensors_held_by_name()
        assert [id(t) for t in held.named] == [id(_GLOBAL_WEIGHT)] and {id(t) for t in held.attributes} == own
    plain = session.region(lambda x: x + _GLOBAL_WEIGHT)
    plain.snapshot = jitcore.GlobalsSnapshot(plain.fn, owner="test")
    held = plain.recorder.tensors_held_by_name()
    assert [id(t) for t in held.named] == [id(_GLOBAL_WEIGHT)] and held.attributes == [] and held.complete


def test_a_region_reading_more_by_name_than_the_search_looks_through_holds_it_incomplete(monkeypatch):
    """Where the globals snapshot's tensor search stops at its bound, the region's held
    tensors say so (every argument is then in doubt: recording.input_doubts); a module
    region's parameters and buffers are listed all the same."""
    from jitcore import drift

    monkeypatch.setattr(drift, "_TENSOR_SEARCH_LIMIT", 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = replay.capture()

    def reads_the_list(x):
        return x + len(_MANY_NAMES)

    class ReadsTheList(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.linear(x) + len(_MANY_NAMES)

    net = ReadsTheList()
    for fn, attributes in ((reads_the_list, set()), (net, {id(p) for p in net.parameters()})):
        region = session.region(fn)
        region.snapshot = jitcore.GlobalsSnapshot(fn, owner="test")
        held = region.recorder.tensors_held_by_name()
        assert not held.complete and {id(t) for t in held.attributes} == attributes
    _MANY_NAMES[8:] = []  # the list and its 8 items: one value over the bound
    region.snapshot = jitcore.GlobalsSnapshot(net, owner="test")
    assert not region.recorder.tensors_held_by_name().complete
    _MANY_NAMES[7:] = []  # 8 values: all read
    region.snapshot = jitcore.GlobalsSnapshot(net, owner="test")
    assert region.recorder.tensors_held_by_name().complete


_GLOBAL_WEIGHT = torch.ones(4)
_MANY_NAMES = list(range(20))


def test_a_regions_output_slots_tell_its_router_that_the_output_memory_moved(session_factory):
    """The session's own output slots (not a test double's) reach the region's router: a slot
    that comes or goes forgets the output ranges the padded routing checks arguments against."""
    session = session_factory()
    step = session.region(add)
    slots = Session.output_slots(session, step, 0)
    assert Session.output_slots(session, step, 0) is slots
    step.router._output_ranges = object()
    slots._changed()
    assert step.router._output_ranges is None
