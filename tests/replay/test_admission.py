"""The cache policy's bookkeeping on the CPU (the session's use of it: test_session.py), and the policy
driven over synthetic call streams with modelled costs (tests/replay/admission_simulation.py)."""

from __future__ import annotations

import random

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay import admission
from replay.admission import Admission, CompactionRule, FrequencySketch, Peers, RecordingBudget, ReplayTimes
from tests.replay.admission_simulation import Costs, Simulation, cycle, each_once, random_walk, uniform


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=3000), st.integers(1, 64))
def test_the_sketch_stays_bounded_and_counts_exactly_within_a_window(calls, window):
    sketch = FrequencySketch(window=window)
    exact: dict[int, int] = {}
    for key in calls:
        halvings = sketch.halvings
        count = sketch.add(key)
        if sketch.halvings == halvings:
            exact[key] = exact.get(key, 0) + 1
            assert count == exact[key]
        else:
            exact = dict(sketch.counts)
        # the counts' total halves with each halving: it stays below the window, and a window
        # adds at most its own number of keys
        assert sum(sketch.counts.values()) <= 2 * window and len(sketch.counts) <= 2 * window


def test_a_halving_halves_counts_and_forgets_keys_seen_once():
    sketch = FrequencySketch(window=6)
    for key in "aaaab":
        sketch.add(key)
    sketch.add("c")  # the sixth call: a halving
    assert sketch.counts == {"a": 2} and sketch.halvings == 1


def test_a_held_graph_ages_with_the_sketch():
    replays = {"graph": 0}
    policy = Admission(record_after=1, max_graphs=1, budget=1.0, replays=lambda r: replays[r])
    for _ in range(3):
        policy.called("k")
    policy.held("graph", "k")
    replays["graph"] = 5
    assert policy.frequency("graph") == 8
    policy.sketch.halve()
    policy.sketch.halve()
    assert policy.frequency("graph") == 2  # 8 >> 2
    replays["graph"] = 7
    assert policy.frequency("graph") == 4


def test_admission_needs_twice_the_victims_use_and_picks_the_oldest_of_equals():
    replays = {"a": 0, "b": 0}
    policy = Admission(record_after=0, max_graphs=2, budget=1.0, replays=lambda r: replays[r])
    assert policy.victim("x", []) == (True, None)
    policy.held("a", "ka")
    policy.held("b", "kb")
    replays.update(a=3, b=3)
    for _ in range(6):
        policy.called("new")
    assert policy.victim("new", ["a", "b"]) == (False, "a")  # 6 is not more than 2 * 3
    policy.called("new")
    assert policy.victim("new", ["a", "b"]) == (True, "a")
    replays["a"] = 4
    assert policy.victim("new", ["a", "b"])[1] == "b"


def test_recording_may_run_ahead_of_what_replays_saved_by_the_grace():
    replays = {"a": 0, "b": 0}
    saving = {"a": 1e-3, "b": 2e-3}  # what one replay of each saves
    policy = Admission(
        record_after=1, max_graphs=4, budget=0.03, replays=lambda r: replays[r], saving=lambda r: saving[r]
    )
    budget = policy.budget
    assert budget.grace == 0.03 * admission.GRACE_SECONDS
    assert policy.may_record()  # nothing spent yet
    budget.spent = budget.grace  # recording spent the grace, no replay saved anything
    assert not policy.may_record() and policy.saved() == 0
    policy.held("a", "ka")
    policy.held("b", "kb")
    replays.update(a=3, b=1)
    assert policy.saved() == pytest.approx(5e-3) and policy.may_record()
    budget.spent = budget.grace + policy.saved()  # exactly what was saved beyond the grace: spent
    assert not policy.may_record()
    policy.dropped("a")  # its savings are banked as it goes
    replays.update(a=100, b=2)  # (replays of a graph no longer held are not its)
    assert policy.saved() == pytest.approx(3e-3 + 4e-3) and policy.may_record()
    replays["b"] = 3  # a replay the budget has not summed yet, then a compaction's new graph:
    frequency = policy.frequency("b")
    replays["b"] = 0  # its counter starts at 0, the old one's last replay is not counted (the budget errs low)
    policy.restarted("b", frequency)
    replays["b"] = 1
    assert policy.saved() == pytest.approx(3e-3 + 4e-3 + 2e-3)
    unbudgeted = Admission(record_after=1, max_graphs=4, budget=1.0, replays=lambda r: 0)
    unbudgeted.budget.spent = 1e9
    assert unbudgeted.may_record()  # record_budget=1: no budget


def test_the_first_recordings_are_made_as_soon_as_admitted_with_the_analyses_to_come_counted():
    policy = Admission(record_after=1, max_graphs=4, budget=0.03, replays=lambda r: 0)
    budget = policy.budget
    assert admission.FIRST_RECORDINGS_SHARE * budget.grace == pytest.approx(0.03)
    assert policy.pays_back(2, 0.0)  # nothing measured yet: an admitted key records
    for _ in range(3):
        policy.captured(0.004)  # 12 ms, and three analyses to come (as dear as a capture: none measured yet)
    assert budget.awaiting == 3 and policy.pays_back(2, 0.0)  # 24 ms
    policy.captured(0.004)  # 16 ms spent and 16 to come
    assert not policy.pays_back(2, 0.0)
    policy.analysed(0.001)  # 17 ms spent, three analyses of 1 ms to come
    assert budget.awaiting == 3 and policy.pays_back(2, 0.0)
    policy.recorded(0.012)  # a compaction's recordings: no analysis to come
    assert budget.awaiting == 3 and budget.spent == pytest.approx(0.029) and not policy.pays_back(2, 0.0)
    cold = Admission(record_after=1, max_graphs=4, budget=0.03, replays=lambda r: 0)
    cold.captured(1.0)  # a process's first capture and analysis, with one-time costs
    cold.analysed(1.0)
    assert cold.budget.spent == 2 * admission.FIRST_CHARGE_CAP  # beyond the share, yet
    assert cold.pays_back(2, 0.0)  # fewer than FIRST_RECORDINGS captures measured: still the first recordings
    cold.captured(0.002)
    assert cold.pays_back(2, 0.0)
    cold.captured(0.002)
    assert not cold.pays_back(2, 0.0) and cold.budget.usual == pytest.approx(0.002 + admission.FIRST_CHARGE_CAP)


def test_a_recording_usually_costs_the_median_capture_and_the_median_analysis():
    budget = RecordingBudget(fraction=0.03)
    assert budget.usual == 0.0
    budget.charge(0.004)
    assert budget.usual == pytest.approx(0.008)  # no analysis measured yet: taken as dear as the capture
    budget.charge(0.002)
    assert budget.usual == pytest.approx(0.004)  # of two captures the cheaper (the first pays one-time costs)
    budget.charge_analysis(0.001)
    assert budget.usual == pytest.approx(0.003)
    budget.recent = [0.001, 0.005, 0.003]
    assert budget.usual == pytest.approx(0.004)


def test_a_regions_replay_time_drops_at_once_and_rises_an_eighth_at_a_time():
    # as an eager call's estimate does: a replay that waited does not make every replay look slow
    times = ReplayTimes()
    assert times.seconds is None
    assert times.saving(100e-6) == pytest.approx(100e-6 - admission.REPLAY_SECONDS_GUESS)  # none timed: the guess
    for seconds, expected in [(40e-6, 40e-6), (20e-6, 20e-6), (100e-6, 30e-6), (10e-6, 10e-6), (-1.0, 0.0)]:
        times.took(seconds)
        assert times.seconds == pytest.approx(expected)
    times.took(10e-6)
    assert times.saving(100e-6) == pytest.approx(98.75e-6) and times.saving(1e-6) == 0.0


def test_one_time_costs_are_charged_up_to_three_times_a_usual_recording():
    budget = RecordingBudget(fraction=0.1)
    budget.charge(0.5)  # the process's first recording: compiles, the capture machinery
    assert budget.spent == admission.FIRST_CHARGE_CAP
    for _ in range(5):
        budget.charge(0.004)
    budget.charge(1.0)  # a one-off spike: three times the median (0.004)
    assert budget.spent == pytest.approx(0.02 + 5 * 0.004 + 3 * 0.004)
    steady = RecordingBudget(fraction=0.1)
    for _ in range(10):  # a region whose every recording takes 50 ms is charged in full
        steady.charge(0.05)
    assert steady.spent == pytest.approx(0.02 + 9 * 0.05)


def simulate_shapes(order: list[int], rule: CompactionRule | None) -> tuple[int, int, int, int]:
    """A pool as the caching allocator grows it: a shape larger than every shape recorded since
    the last compaction needs new blocks (the smaller ones cannot serve it); a compaction
    records every graph again, largest first, after which they all share the largest one's
    blocks. Returns (recordings, compactions, final pool, largest shape's pool)."""
    unit = 1 << 20
    pool = largest = recordings = compactions = 0
    held = 0
    for records, shape in enumerate(order, start=1):
        grew = 0
        if shape > largest:
            grew = shape * unit
            pool += grew
            largest = shape
        recordings += 1
        held += 1
        if rule is None:
            continue
        rule.recorded(0, pool, grew)
        if rule.due(0, pool, held, records):
            recordings += held
            compactions += 1
            pool = largest * unit
            rule.done(0, pool, held)
    return recordings, compactions, pool, largest * unit


def test_compaction_stays_proportional_to_the_shapes_and_keeps_the_pool_small():
    compacted = 0
    for seed in range(50):
        order = list(range(1, 257))
        random.Random(seed).shuffle(order)
        recordings, compactions, pool, _ = simulate_shapes(order, CompactionRule())
        assert recordings <= 1.5 * len(order), (seed, recordings)
        assert pool <= simulate_shapes(order, None)[2], seed
        compacted += compactions > 0
    assert compacted >= 25  # most random orders start small and grow: they compact early
    # growing shapes, the worst order for fragmentation: a compaction after every recording
    # (the storm) would record 256 * 257 / 2 graphs; the rule allows the early, cheap ones and
    # then stops (this order's memory is item 6's business: shared outputs, bucketing)
    recordings, compactions, _, _ = simulate_shapes(list(range(1, 257)), CompactionRule())
    assert compactions >= 3 and recordings <= 1.5 * 256 + admission.RECAPTURE_ALLOWANCE


def test_compaction_waits_for_the_pool_to_grow_by_half():
    rule = CompactionRule()
    rule.recorded(0, 100, grew_by=100)
    assert not rule.due(0, 149, graphs=1, records=10)
    assert rule.due(0, 150, graphs=1, records=10)
    rule.done(0, 120, graphs=1)
    assert not rule.due(0, 179, graphs=1, records=10) and rule.due(0, 180, graphs=1, records=10)
    rule.recorded(0, 400, grew_by=250)  # one graph needs 250: a pool of 374 is no waste
    assert not rule.due(0, 374, graphs=1, records=10) and rule.due(0, 375, graphs=1, records=10)
    assert not rule.due(0, 10_000, graphs=30, records=10)  # 1 + 30 > half of 10 recordings + 16


def test_admits_answers_as_victim_does_whatever_happened_since_its_bound():
    # random calls, replays, halvings, graphs held and dropped: the shortcut never changes a
    # decision
    rng = random.Random(7)
    replays: dict[str, int] = {}
    policy = Admission(record_after=0, max_graphs=4, budget=1.0, replays=lambda r: replays[r])
    held: list[str] = []
    asked = 0
    for step in range(5000):
        action = rng.random()
        key = f"k{rng.randint(0, 30)}"
        if action < 0.5:
            policy.called(key)
        elif action < 0.75 and held:
            replays[rng.choice(held)] += rng.randint(1, 3)
        elif action < 0.8:
            policy.sketch.halve()
        elif action < 0.9 and len(held) < 4:
            name = f"g{step}"
            replays[name] = 0
            held.append(name)
            policy.held(name, key)
        elif held:
            gone = held.pop(rng.randrange(len(held)))
            policy.dropped(gone)
        # the first graph held stands for a recording awaiting its analysis, now and then
        pending, graphs = (held[:1], held[1:]) if rng.random() < 0.3 else ([], held)
        assert policy.admits(key, graphs, pending) == policy.victim(key, graphs, pending)[0]
        asked += 1
    assert asked == 5000


def test_pending_recordings_are_victims_like_graphs_the_least_used_first_and_before_equal_graphs():
    # A key recorded on its last call is never analysed: its recording must not keep its place
    # for good (the finding: four such keys with max_graphs=4 refused a hot key 9,999 times).
    replays = {"p1": 0, "p2": 0, "g": 0}
    policy = Admission(record_after=1, max_graphs=3, budget=1.0, replays=lambda r: replays[r])
    for key, calls in (("k1", 3), ("k2", 2), ("kg", 2)):
        for _ in range(calls):
            policy.called(key)
    policy.held("p1", "k1")  # captured at its key's third call, never analysed
    policy.held("p2", "k2")
    policy.held("g", "kg")  # a graph, as often used as p2
    for _ in range(4):
        policy.called("hot")
    assert policy.victim("hot", ["g"], ["p1", "p2"]) == (False, "p2")  # 4 is not more than 2 * 2
    assert not policy.admits("hot", ["g"], ["p1", "p2"])
    policy.called("hot")
    assert policy.victim("hot", ["g"], ["p1", "p2"]) == (True, "p2")  # the pending one of equals
    assert policy.admits("hot", ["g"], ["p1", "p2"])
    # with room left, pending recordings are no victims
    assert policy.victim("hot", ["g"], ["p1"]) == (True, None)
    # with no graph held at all, the pending recordings alone are the victims
    assert policy.victim("hot", [], ["p1", "p2", "g"]) == (True, "p2")


def _past_the_first_recordings(policy: Admission, capture: float, analysis: float) -> None:
    policy.budget.spent = policy.budget.grace
    policy.budget.recent = [capture] * admission.FIRST_RECORDINGS
    policy.budget.analyses = [analysis]


def test_a_key_pays_back_when_its_expected_calls_save_what_a_recording_costs(monkeypatch):
    monkeypatch.setattr(admission, "PAYBACK_HORIZON", 4)
    policy = Admission(record_after=0, max_graphs=4, budget=0.03, replays=lambda r: 0)
    policy.sketch.halve()  # past the first window: the horizon is PAYBACK_HORIZON (no peers: counts as they are)
    _past_the_first_recordings(policy, capture=0.002, analysis=0.001)  # a recording costs 3 ms
    assert policy.expected_calls(3) == 12
    # an eager call of 1.1 ms, a replay of 0.1 ms: 1 ms saved a call, 4 ms a count
    assert [policy.pays_back(count, 1.1e-3, 0.1e-3) for count in (0, 1, 2)] == [False, True, True]
    assert [policy.pays_back(count, 0.6e-3, 0.1e-3) for count in (1, 2)] == [False, True]  # 0.5 ms a call
    assert not policy.pays_back(10**6, 1e-3, 1e-3)  # a replay that saves nothing never pays back
    monkeypatch.setattr(admission, "REPLAY_SECONDS_GUESS", 0.6e-3)  # no replay of the region timed yet
    assert [policy.pays_back(count, 1.1e-3) for count in (1, 2)] == [False, True]
    unbudgeted = Admission(record_after=0, max_graphs=4, budget=1.0, replays=lambda r: 0)
    unbudgeted.budget.spent = 1e9
    assert unbudgeted.pays_back(1, 0.0)  # record_budget=1: no budget, no payback rule


def test_before_the_first_halving_a_key_is_bet_to_come_back_over_the_early_calls():
    # a loop over three sizes (THREE_SIZES' costs: repaid after 16 calls), at the second call
    # of its second size: back once in 5 calls, expected back 256 / 5 = 51 times. In a uniform
    # mix of 256 sizes a key comes back after dozens of calls: expected back a few times, not
    # worth it; and a first call says nothing of a key's rate
    policy = Admission(record_after=0, max_graphs=64, budget=0.03, replays=lambda r: 0)
    _past_the_first_recordings(policy, capture=0.0014, analysis=0.0008)
    for key in "abcab":
        policy.called(key)
    assert policy.expected_calls(2) == pytest.approx(admission.EARLY_CALLS / 5)
    assert policy.pays_back(2, 168e-6, 34e-6)
    assert policy.expected_calls(1) == admission.PAYBACK_HORIZON and not policy.pays_back(1, 168e-6, 34e-6)
    policy.sketch.calls = 60
    assert policy.expected_calls(2) == pytest.approx(256 / 60)
    assert not policy.pays_back(2, 168e-6, 34e-6) and policy.pays_back(5, 168e-6, 34e-6)
    policy.sketch.calls = 200  # (fewer than EARLY_PEERS_AFTER: no peers yet)
    assert policy.expected_calls(5) == 5 * admission.PAYBACK_HORIZON  # the early bet is less by now
    policy.sketch.calls = 1
    policy.sketch.counts.clear()  # (no peers at the halving)
    policy.sketch.halve()
    assert policy.expected_calls(5) == 5 * admission.PAYBACK_HORIZON


def test_a_key_whose_past_calls_paid_for_a_recording_records_with_the_budget_spent():
    policy = Admission(record_after=0, max_graphs=4, budget=0.03, replays=lambda r: 0)
    policy.budget.spent = 1.0  # far beyond the grace, nothing saved
    policy.budget.recent = [0.01] * admission.FIRST_RECORDINGS
    policy.budget.analyses = [0.01]  # a recording costs 20 ms
    assert not policy.may_record()
    # an eager call of 1.5 ms, a replay of 0.5 ms: a key has paid for a recording after 20 calls
    assert [policy.may_record(count, 1.5e-3, 0.5e-3) for count in (0, 1, 19, 21, 500)] == [
        False,
        False,
        False,
        True,
        True,
    ]
    assert not policy.may_record(10**9, 0.5e-3, 0.5e-3)  # a replay that saves nothing never has


@settings(max_examples=300, deadline=None)
@given(
    record_after=st.integers(0, 5),
    fraction=st.sampled_from([0.001, 0.03, 0.5, 1.0]),
    spent=st.floats(0.0, 10.0),
    recent=st.lists(st.floats(0.0, 0.05), max_size=6),
    analyses=st.lists(st.floats(0.0, 0.05), max_size=3),
    eager_seconds=st.floats(0.0, 0.01),
    replay_seconds=st.none() | st.floats(0.0, 0.002),
    counts=st.none() | st.lists(st.integers(1, 10_000), min_size=1, max_size=40),
    calls=st.integers(0, 2000),
    later=st.integers(0, 2000),
)
def test_quiet_below_is_the_least_count_past_the_warm_up_that_pays_back_and_stays_a_bound(
    record_after, fraction, spent, recent, analyses, eager_seconds, replay_seconds, counts, calls, later
):
    # the region's eager path skips the rule for counts below it: any count below it must be
    # refused by pays_back (past the warm-up), the count itself accepted; with or without the
    # peers of a halving (counts: what the sketch held just before it), before the first
    # halving (calls counted so far) or after it (calls None); and counts below it are still
    # refused once more calls were counted (the early horizon only falls)
    policy = Admission(record_after=record_after, max_graphs=4, budget=fraction, replays=lambda r: 0)
    policy.budget.spent = spent
    policy.budget.recent = recent
    policy.budget.analyses = analyses
    policy.sketch.peers = None if counts is None else Peers.of(counts)
    policy.sketch.calls = min(calls, admission.EARLY_PEERS_AFTER - 1)  # (no early peers taken)
    if calls >= admission.EARLY_PEERS_AFTER:
        policy.sketch.halvings = 1
    quiet = policy.quiet_below(eager_seconds, replay_seconds)
    assert quiet >= record_after + 1
    pays = lambda count: policy.pays_back(count, eager_seconds, replay_seconds)
    if quiet == admission.QUIET_FOREVER:
        assert not any(pays(count) for count in (record_after + 1, 10**6, 10**12))
        return
    assert pays(quiet)
    below = random.Random(quiet).sample(range(record_after + 1, quiet), min(50, quiet - record_after - 1))
    assert not any(pays(count) for count in below)
    assert quiet == record_after + 1 or not pays(quiet - 1)
    policy.sketch.calls = min(policy.sketch.calls + later, admission.EARLY_PEERS_AFTER - 1)
    assert not any(pays(count) for count in below) and (quiet == record_after + 1 or not pays(quiet - 1))


def test_every_change_the_payback_rule_reads_bumps_the_budget_version():
    policy = Admission(record_after=1, max_graphs=4, budget=0.03, replays=lambda r: 0)
    budget = policy.budget
    seen = {budget.version}
    for change in (
        lambda: budget.charge(0.001),
        lambda: budget.charge(0.001, awaits_analysis=True),
        lambda: budget.charge_analysis(0.001),
        lambda: setattr(budget, "spent", 1.0),
        lambda: setattr(budget, "recent", [0.002]),
        lambda: setattr(budget, "analyses", [0.002]),
        lambda: setattr(budget, "awaiting", 3),
        lambda: setattr(budget, "fraction", 0.5),
        policy.sketch.halve,  # the peers the rule judges counts against
    ):
        change()
        assert budget.version not in seen
        seen.add(budget.version)


@settings(max_examples=300, deadline=None)
@given(counts=st.lists(st.integers(1, 1000), min_size=1, max_size=300), asked=st.integers(0, 2000))
def test_a_key_is_expected_back_at_most_as_often_as_it_was_counted_and_more_for_a_higher_count(counts, asked):
    peers = Peers.of(counts)
    assert 0.0 <= peers.credibility <= 1.0
    assert peers.expected(asked) <= asked
    assert peers.expected(asked) <= peers.expected(asked + 1)  # quiet_below relies on it
    if asked >= peers.outlier:
        assert peers.expected(asked) == asked


def test_peers_that_spread_no_more_than_counting_does_earn_no_credit_and_real_differences_earn_nearly_all():
    rng = random.Random(3)
    poisson = [sum(rng.random() < 8 / 1024 for _ in range(1024)) + 1 for _ in range(256)]  # one rate for all
    assert Peers.of(poisson).credibility < 0.2
    assert Peers.of([5] * 40).credibility == 0.0  # no spread at all
    assert Peers.of([1] * 30 + [500] * 3).credibility > 0.95  # a few hot keys among rare ones
    hot = Peers.of([1] * 30 + [500] * 3)
    assert hot.expected(500) > 450 and hot.expected(1) == 1


# --- the policy over call streams (admission_simulation) -------------------------------------
#: A loop of 3 sizes with the costs of the finding's (its recording and analysis together repaid
#: after about 16 calls; each size is called a hundred times).
THREE_SIZES = Costs(eager=168e-6, replay=34e-6, capture=1.4e-3, analysis=0.8e-3, overhead=5e-6)
#: The decode-loop sample (4 layers, batch 1..16) with the costs of the finding's: a replayed
#: step bound by the GPU (its replay's host time far less), an analysis about as dear as a
#: capture (docs/benchmarks/replay.md).
SAMPLE = Costs(eager=1e-3, replay=350e-6, replay_host=50e-6, capture=6e-3, analysis=5e-3, overhead=5e-6)
#: The shapes benchmark's region (6 layers, batch 1..256; docs/benchmarks/shapes.md): the
#: session's bookkeeping on an eager call, a replay bound by the GPU, the first capture with
#: one-time costs.
SHAPES = Costs(
    eager=240e-6, replay=75e-6, replay_host=20e-6, capture=2.5e-3, analysis=2e-3, first_capture=0.02, overhead=7e-6
)
#: The decode-loop sample with the costs a GPU run of it measured (docs/benchmarks/admission-simulation.md): a step
#: bound by the GPU when replayed, sixteen recordings whose analyses cost about as much again
#: as their captures.
SAMPLE_MEASURED = Costs(
    eager=0.44e-3, replay=0.16e-3, replay_host=50e-6, capture=2.5e-3, analysis=3.1e-3, overhead=5e-6
)


#: The ported loops of the uniform-mix tests: recordings of 5 ms, a saving per call given.
def loop_costs(saving: float) -> Costs:
    return Costs(eager=saving + 15e-6, replay=15e-6, capture=2.5e-3, analysis=2.5e-3)


@pytest.mark.parametrize("first_capture", [None, admission.FIRST_CHARGE_CAP])
def test_a_loop_over_three_sizes_records_each_on_its_second_call_and_replays_from_its_third(first_capture):
    # the finding: only 1 or 2 of the 3 sizes recorded in 300 steps (99 and 198 replays); a
    # session's first capture may pay one-time costs (charged up to FIRST_CHARGE_CAP)
    sim = Simulation(attrs.evolve(THREE_SIZES, first_capture=first_capture)).run(cycle([8, 16, 32], 300))
    assert sim.counts.replays >= 250 and sim.counts.records == 3
    recorded_at = [index for index, _ in sim.recordings]
    assert recorded_at == [3, 4, 5] if first_capture is None else max(recorded_at) <= 8  # 2nd or 3rd call
    assert sim.ratio < 0.5 if first_capture is None else sim.ratio < 0.85


@pytest.mark.parametrize("others", [20, 40])
def test_three_sizes_record_within_their_first_calls_after_the_first_recordings_by_the_rule(others):
    # the first recordings spent on other sizes (their graphs replayed since): the three sizes
    # are judged by the payback rule. The early horizon counts the session's calls so far, so
    # it bets less on a loop that comes later in it: a few calls more than the second
    sim = Simulation(THREE_SIZES).run(cycle(list(range(100, 100 + others)), 10 * others))
    assert not sim.admission.budget.first_recordings() and sim.admission.sketch.halvings == 0
    calls, replays = sim.counts.calls, sim.counts.replays
    sim.run(cycle([8, 16, 32], 300))
    assert max(index - calls for index, key in sim.recordings if key in (8, 16, 32)) < 3 * 12
    assert sim.counts.replays - replays >= 250


@pytest.mark.parametrize("seed", range(2))
def test_three_new_sizes_after_a_long_uniform_mix_record_once_they_stand_out(seed):
    # a uniform mix taught the peers that counts are luck (no credibility): three new sizes that
    # take every call are bets only once they stand out beyond counting noise
    # (OUTLIER_SIGMAS): within their first 25 calls
    sim = Simulation(THREE_SIZES).run(uniform(4000, 256, seed))
    assert sim.admission.sketch.halvings >= 1 and sim.admission.sketch.peers.credibility < 0.1
    calls, replays = sim.counts.calls, sim.counts.replays
    sim.run(cycle([1000, 1001, 1002], 300))
    assert max(index - calls for index, key in sim.recordings if key >= 1000) < 3 * 25
    assert sim.counts.replays - replays >= 225


@pytest.mark.parametrize("seed", range(6))
def test_the_decode_samples_sizes_record_from_their_first_calls(seed):
    # the finding: 400 steps ran slower than eagerly, most sizes recorded late in the run
    keys = random_walk(400, 16, seed)
    sim = Simulation(SAMPLE).run(keys)
    first_repeat = next(index for index, key in enumerate(keys) if key in keys[:index])
    assert sim.recordings[0][0] == first_repeat  # the first size to come back records at once
    seen = len(set(keys[:100]))
    assert sum(index < 100 for index, _ in sim.recordings) >= seen // 2  # most of the first 100 steps' sizes
    assert {key for key in keys if keys.count(key) >= 5} <= {key for _, key in sim.recordings}
    assert sim.ratio < 1 / 1.1  # faster than eager, its recordings included


@pytest.mark.parametrize("steps", [400, 2000])
def test_the_decode_sample_at_its_measured_costs_comes_within_a_tenth_of_recording_each_size_at_once(steps):
    # what no policy beats: each size recorded on its first call, analysed on its second, every
    # other call replayed. The policy's caution (a size's first call is no evidence; the payback
    # rule past the first recordings) costs the sample's default run at most a tenth over it
    keys = random_walk(steps, 16, 1)
    sim = Simulation(SAMPLE_MEASURED).run(keys)
    sizes, costs = len(set(keys)), SAMPLE_MEASURED
    at_once = sizes * (costs.capture + costs.analysis) + (len(keys) - sizes) * costs.replay
    assert sim.seconds <= 1.1 * at_once and sim.counts.records == sizes


@pytest.mark.parametrize("seed", range(3))
def test_a_uniform_mix_of_256_sizes_costs_at_most_5_percent_over_eager(seed):
    # the guarantee: 6,000 steps of sizes 1..256 at random, at most 1.05x eager's time, the
    # session's bookkeeping on every eager call included
    sim = Simulation(SHAPES).run(uniform(6000, 256, seed))
    assert sim.ratio <= 1.05
    assert all(index < sim.admission.sketch.window for index, _ in sim.recordings)


def test_prefill_lengths_seen_once_record_nothing():
    sim = Simulation(SHAPES).run(each_once(1000, 0))
    assert sim.counts.records == 0 and sim.ratio <= 1.05


def test_uniform_sizes_padded_to_buckets_run_at_least_2_5x_faster_than_eager_in_the_second_half():
    # a padded call is its bucket's key (replay.buckets): 9 keys for 1..256
    sizes = uniform(6000, 256, 0)
    sim = Simulation(SHAPES).run([1 << max(size - 1, 0).bit_length() for size in sizes[:3000]])
    seconds, eager = sim.seconds, sim.eager_seconds
    sim.run([1 << max(size - 1, 0).bit_length() for size in sizes[3000:]])
    assert (sim.eager_seconds - eager) / (sim.seconds - seconds) >= 2.5


@settings(max_examples=40, deadline=None)
@given(sizes=st.integers(1, 8), seed=st.integers(0, 10_000), shuffled=st.booleans())
def test_a_loop_over_a_few_sizes_records_them_all_early_in_any_order(sizes, seed, shuffled):
    # each size called 100 times, in turn or at random: each records within its first calls,
    # and nearly every call replays
    keys = cycle(list(range(sizes)), 100 * sizes)
    if shuffled:
        random.Random(seed).shuffle(keys)
    sim = Simulation(THREE_SIZES).run(keys)
    assert sim.counts.records == sizes
    for index, key in sim.recordings:
        assert keys[: index + 1].count(key) <= 6, (index, key)
    assert sim.counts.replays >= 0.9 * len(keys)


@pytest.mark.parametrize("seed", range(4))
def test_a_uniform_mix_of_hundreds_of_keys_stops_recording_once_its_counts_spread_is_known(seed):
    # every key of a uniform mix comes back equally often: its high counts are luck. Without
    # the peers, 14 keys recorded in 6,000 calls (most past the first windows) and were
    # never repaid; with them, none past the counts' first halving
    rng = random.Random(seed)
    sim = Simulation(loop_costs(265e-6)).run([rng.randint(1, 256) for _ in range(6000)])
    first_halving = sim.admission.sketch.window
    assert sim.admission.sketch.halvings >= 4
    assert [index for index, _ in sim.recordings if index > first_halving] == []
    assert len(sim.recordings) <= 8


@pytest.mark.parametrize("seed", range(4))
def test_a_uniform_mix_records_few_keys_past_its_first_recordings_in_its_first_window(seed, monkeypatch):
    # before the first halving, counts are judged against their peers as they stand
    # (EARLY_PEERS_AFTER): a key counted 8 times among keys counted 4 times on average is
    # expected back 4 times. With a saving large enough that a count of 7 pays back, the
    # first window (1,024 calls) recorded 13 to 18 keys of 256 without them
    def first_window(early_after: int) -> list:
        monkeypatch.setattr(admission, "EARLY_PEERS_AFTER", early_after)
        rng = random.Random(seed)
        return Simulation(loop_costs(600e-6)).run([rng.randint(1, 256) for _ in range(1024)]).recordings

    # the first recordings: those of 5 ms that fit their share of the grace
    first = int(admission.FIRST_RECORDINGS_SHARE * 0.03 * admission.GRACE_SECONDS / 5e-3)
    assert len(first_window(256)) <= first + 4
    assert len(first_window(10**9)) >= first + 7


@pytest.mark.parametrize("saving", [100e-6, 265e-6])
def test_early_peers_hold_back_no_key_of_a_loop_of_a_few_dozen_sizes(saving, monkeypatch):
    # 16 sizes: each counted about 16 times by call 256, its peers no different: they record
    # at the same calls with or without the early peers
    def recorded(early_after: int) -> list:
        monkeypatch.setattr(admission, "EARLY_PEERS_AFTER", early_after)
        rng = random.Random(0)
        return Simulation(loop_costs(saving)).run([rng.randint(1, 16) for _ in range(3000)]).recordings

    with_early = recorded(256)
    assert len(with_early) == 16 and with_early == recorded(10**9)


def test_early_peers_are_taken_when_asked_and_again_once_the_calls_grew():
    policy = Admission(record_after=1, max_graphs=4, budget=0.03, replays=lambda r: 0)
    sketch, budget = policy.sketch, policy.budget
    for number in range(admission.EARLY_PEERS_AFTER - 1):
        sketch.add(number % 50)
    assert sketch.current_peers() is None  # too few calls yet
    sketch.add(0)
    version = budget.version
    first = sketch.current_peers()
    assert first == Peers.of(sketch.counts.values()) and budget.version == version + 1
    for number in range(int(admission.EARLY_PEERS_AFTER * (admission.EARLY_PEERS_GROWTH - 1)) - 1):
        sketch.add(number % 50)
    assert sketch.current_peers() is first and budget.version == version + 1  # not grown enough
    sketch.add(1)
    sketch.add(2)
    assert sketch.current_peers() != first and budget.version == version + 2
    sketch.halve()  # from the first halving on: the window's peers, as before
    assert sketch.current_peers() is sketch.peers and sketch.early_at


@pytest.mark.parametrize("seed", range(4))
def test_frequent_keys_among_a_uniform_mix_record(seed):
    rng = random.Random(seed)
    hot = [1, 8, 32, 64, 128, 256]
    keys = [rng.choice(hot) if rng.random() < 0.7 else rng.randint(1, 256) for _ in range(4000)]
    recorded = Simulation(loop_costs(265e-6)).run(keys).recordings
    assert set(hot) <= {key for _, key in recorded}
    assert len(recorded) <= 12


@pytest.mark.parametrize("seed", range(4))
def test_a_key_that_turns_hot_after_a_uniform_mix_records_without_waiting_for_the_next_halving(seed):
    # the peers of a uniform mix earn no credit; a size that then takes half the calls stands
    # out by far more than counting could give it (OUTLIER_SIGMAS) and records within about
    # 50 calls (about 150, at the next halving, without that rule)
    rng = random.Random(seed)
    sim = Simulation(loop_costs(265e-6)).run([rng.randint(1, 256) for _ in range(4000)])
    assert sim.admission.sketch.peers.credibility < 0.1
    before = len(sim.recordings)
    sim.run([1000 if rng.random() < 0.5 else rng.randint(1, 256) for _ in range(2000)])
    assert next(index - 4000 for index, key in sim.recordings[before:] if key == 1000) < 100
