"""The life of a key (replay.lifecycle) on the CPU: every move of the table walked through the
session with the recording double, every index checked after each; moves the table does not
list raise; nothing else in replay writes a key's state or its indices; the docs' table and
diagram are the ones drawn from the table."""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import pathlib
import tracemalloc
import warnings

import attrs
import pytest
import torch

from jitcore.backends import use_backend
from jitcore.backends.null import NullBackend
from replay import lifecycle, recording, region_keys, value_keys
from replay import region as region_module
from replay import stats as stats_module
from replay.lifecycle import (
    ANALYSING,
    AWAITING_ANALYSIS,
    EAGER_ONLY,
    NO_ENTRY,
    RECORDING,
    REPLAYING,
    SIZE_VARIANT,
    TRANSITIONS,
    WARMING,
    Entry,
    Keys,
    KeyState,
    TransitionError,
)
from replay.rebinding import Plan

from .test_session import DoubleSession, FakeGraph

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def walked(monkeypatch):
    """Every move made, as (source, event); after each outermost call of a Keys method, the
    indices are checked against the states (lifecycle.problems)."""
    moves: list[tuple[KeyState, str]] = []
    sessions: list = []
    original_move = lifecycle._move

    def move(entry, event):
        moves.append((entry.state, event))
        original_move(entry, event)

    monkeypatch.setattr(lifecycle, "_move", move)
    depth = [0]

    def checked(method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            depth[0] += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    assert lifecycle.problems(self.session) == [], method.__name__

        return wrapper

    for name, method in vars(Keys).items():
        if callable(method) and not name.startswith("__"):
            monkeypatch.setattr(Keys, name, checked(method))

    def make(**policy):
        with use_backend(NullBackend()):
            session = DoubleSession(**policy)
        DoubleSession.current = session
        sessions.append(session)
        return session

    with use_backend(NullBackend()):
        yield moves, make
    for session in sessions:
        assert lifecycle.problems(session) == []


def add(x, y):
    return x + y


def _scale(x):
    return x * _SCALE[0]


_SCALE = [2.0]


def _calls(step, n, rows=3):
    x = torch.full((rows,), 1.0)
    for _ in range(n):
        assert torch.equal(step(x, x), x + x)


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_every_move_of_the_table_is_made_and_every_index_follows(walked, monkeypatch):
    moves, make = walked
    session = make(record_after=0)
    step = session.region(add)
    _calls(step, 3)  # admit, record, capture, analyse, serve
    session.capture_script = [recording.CaptureAborted("a jit miss")]
    _calls(step, 1, rows=4)  # RECORDING -retry-> WARMING
    _calls(step, 2, rows=4)
    session.analyse_script = [recording.CaptureRetry(Plan(choices={}, needs_staging={0}))]
    _calls(step, 2, rows=5)  # ANALYSING -record-> RECORDING (more inputs staged)
    session.analyse_script = [recording.CaptureAborted("later")]
    _calls(step, 2, rows=6)  # ANALYSING -retry-> WARMING
    with _quiet():
        session.capture_script = [recording.CaptureFailed("no")]
        _calls(step, 1, rows=7)  # RECORDING -give_up-> EAGER_ONLY
        session.analyse_script = [recording.CaptureFailed("no")]
        _calls(step, 2, rows=8)  # ANALYSING -give_up-> EAGER_ONLY
        w = torch.ones(2, requires_grad=True)
        step(w, w)  # WARMING -refuse-> EAGER_ONLY
    _evict(make)
    _release_and_invalidate(session, step)
    _recapture(session, step, monkeypatch)
    _drift_and_bound(make, monkeypatch)
    _vary(session, step)
    made = set(moves)
    listed = {(source, move.event) for move in TRANSITIONS for source in move.sources}
    assert made <= listed
    assert listed - made == set(), "moves of the table never walked"


def _evict(make):
    """AWAITING_ANALYSIS and REPLAYING -evict-> WARMING: hot keys take the places of others."""
    session = make(record_after=1, max_graphs=4)
    step = session.region(lambda x: x + 1)
    for n in range(1, 5):
        for _ in range(2):
            step(torch.zeros(n))  # four captures awaiting their analysis
    for _ in range(50):
        step(torch.zeros(100))  # a hot key: a capture gives way
    for n in range(2, 5):
        step(torch.zeros(n))  # the others analysed: graphs
    for _ in range(200):
        step(torch.zeros(200))  # another hot key: a graph gives way
    assert session.stats().evictions == 2


def _release_and_invalidate(session, step):
    """AWAITING_ANALYSIS and REPLAYING -release-> WARMING (a retired pool), then -invalidate->."""
    held = [e for e in step.entries.values() if e.state in (AWAITING_ANALYSIS, REPLAYING)]
    states = {e.state for e in held}
    assert states == {AWAITING_ANALYSIS, REPLAYING}, states
    for entry in held:
        entry.uses_rng = True
    session.retire_pool(-1)
    assert all(e.state is WARMING for e in held)
    _calls(step, 3, rows=12)
    _calls(step, 1, rows=13)
    assert {e.state for e in step.entries.values()} >= {AWAITING_ANALYSIS, REPLAYING}
    session.invalidate()
    assert not session.lru and not session.pending and not step.by_pre_key


class _RecapturedGraph(FakeGraph):
    """FakeGraph with what a compaction reads of a graph to record it again."""

    def __init__(self, region, key, capture, spec, leaves, paths, session, number):
        super().__init__(region, key, capture, spec, leaves, paths, session, number)
        self.spec, self.paths, self.leaves, self.input_bytes = spec, paths, list(leaves), 0

    def placeholder_leaves(self):
        return self.leaves


def _recapture(session, step, monkeypatch):
    """REPLAYING -recapture-> REPLAYING: a compaction records every graph again."""
    monkeypatch.setattr(session, "build_graph", _RecapturedGraph)
    _calls(step, 3, rows=14)
    _calls(step, 3, rows=15)
    monkeypatch.setattr(recording, "KeptPool", lambda device, stream: type("Pool", (), {"id": (0, 2)})())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    old = {e: e.graph for e in session.lru}
    assert session.compaction.compact(-1)
    assert all(e.graph is not old[e] and old[e].released for e in session.lru)
    _calls(step, 1, rows=14)  # the new graph serves its pre-key


def _drift_and_bound(make, monkeypatch):
    """Every entry state -drift-> NO_ENTRY; idle entries -bound-> NO_ENTRY."""
    session = make(record_after=0)
    step = session.region(_scale)
    x = torch.ones(2)
    for _ in range(3):
        step(x)  # REPLAYING
    step(torch.ones(3))  # AWAITING_ANALYSIS
    session.capture_script = [recording.CaptureAborted("a jit miss")]
    step(torch.ones(4))  # WARMING
    with _quiet():
        session.capture_script = [recording.CaptureFailed("no")]
        step(torch.ones(5))  # EAGER_ONLY
    assert {e.state for e in step.entries.values()} == {REPLAYING, AWAITING_ANALYSIS, WARMING, EAGER_ONLY}
    _SCALE[0] = 3.0
    try:
        assert torch.equal(step(x), x * 3)  # drift: every entry goes, then the call records anew
    finally:
        _SCALE[0] = 2.0
    assert list(session.pending) == list(step.entries.values()) and len(step.entries) == 1  # (the new key only)
    monkeypatch.setattr(lifecycle, "MAX_IDLE_ENTRIES", 2)
    bounded = make(record_after=0, max_graphs=1)
    many = bounded.region(add)
    with _quiet():
        for rows in range(1, 5):
            bounded.capture_script = [recording.CaptureFailed("no")]
            _calls(many, 1, rows=rows)  # eager-only keys
        for rows in range(5, 9):
            bounded.capture_script = [recording.CaptureAborted("a jit miss")]
            _calls(many, 1, rows=rows)  # warming keys
    assert len(many.entries) == 2 and many.forgotten.keys == 6


@attrs.define(eq=False)
class _Variant:
    """What Keys reads of a size variant (replay.polymorphic.VariantGraph)."""

    entry: Entry
    key: tuple
    replays: int = 0
    released: bool = False

    def release(self) -> None:
        self.released = True


def _vary(session, step):
    """NO_ENTRY -vary-> SIZE_VARIANT -drop_variant-> NO_ENTRY, as replay.routing and its bucket
    graph's family make them (the observation of a size needs the GPU)."""
    key = ("a size variant",)
    entry = Entry(step, key, (step, key))
    variant = _Variant(entry, key, replays=4)
    session.keys.vary(entry, variant)
    assert step.variants[key] is variant and entry.state is SIZE_VARIANT and entry.graph is variant
    before = step.forgotten.replays
    session.keys.drop_variant(variant)
    assert key not in step.variants and entry.state is NO_ENTRY and step.forgotten.replays == before + 4


def test_a_move_the_table_does_not_list_raises():
    listed = {(source, move.event) for move in TRANSITIONS for source in move.sources}
    events = {move.event for move in TRANSITIONS}
    for state in KeyState:
        for event in events:
            entry = Entry(None, ("k",), (None, ()))
            entry.state = state
            if (state, event) in listed:
                lifecycle._move(entry, event)
            else:
                with pytest.raises(TransitionError, match=f"state {state.name} cannot {event}"):
                    lifecycle._move(entry, event)
                assert entry.state is state  # unchanged


def test_a_misplaced_move_through_the_session_raises_and_changes_nothing():
    with use_backend(NullBackend()):
        session = DoubleSession(record_after=0)
        DoubleSession.current = session
        step = session.region(add)
        _calls(step, 1)
        (entry,) = step.entries.values()
        assert entry.state is AWAITING_ANALYSIS
        with pytest.raises(TransitionError, match="AWAITING_ANALYSIS cannot record"):
            session.keys.record(entry)
        with pytest.raises(TransitionError, match="AWAITING_ANALYSIS cannot serve"):
            session.keys.serve(entry, None, None, None)
        assert lifecycle.problems(session) == []


def test_a_key_recorded_by_another_thread_while_this_call_waited_is_served_by_its_state():
    # the second of two calls admitted to record one key finds it recorded once it holds the
    # session's lock: it does not record it again, it is served as the key's state says
    with use_backend(NullBackend()):
        session = DoubleSession(record_after=0)
        DoubleSession.current = session
        step = session.region(add)
        x = torch.ones(3)
        _calls(step, 1)
        (entry,) = step.entries.values()
        assert entry.state is AWAITING_ANALYSIS
        result = step.recorder.record(entry, entry.key, region_keys.flat_call((x, x), {}), -1)
        assert torch.equal(result, x + x) and entry.state is REPLAYING and session.stats().records == 1


# --- one writer ---------------------------------------------------------------------------------------
#: The indices that follow a key's state, by attribute name, and how they are written.
_INDICES = {"entries", "entry_shapes", "by_pre_key", "variants", "bucket_bases", "lru", "pending"}
_MUTATORS = {"pop", "popitem", "clear", "setdefault", "update", "move_to_end", "append", "remove", "__setitem__"}
_RESIDENTS = {"held", "dropped", "restarted"}  # admission's residents


def _a_counter(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "counters"


def _writes(tree: ast.AST) -> list[str]:
    """Writes of a key's state or of an index, outside an ``__init__`` making the index."""
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                base = target.value if isinstance(target, ast.Subscript) else target
                if _a_counter(base):
                    continue  # (the session's Stats count variants too: a number, no index)
                if isinstance(base, ast.Attribute) and (
                    base.attr == "state"
                    or (base.attr in _INDICES and (target is not base or function.name != "__init__"))
                ):
                    found.append(f"{function.name}:{node.lineno} writes .{base.attr}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if node.func.attr in _MUTATORS and isinstance(owner, ast.Attribute) and owner.attr in _INDICES:
                    found.append(f"{function.name}:{node.lineno} calls .{owner.attr}.{node.func.attr}")
                if node.func.attr in _RESIDENTS and isinstance(owner, ast.Attribute) and owner.attr == "admission":
                    found.append(f"{function.name}:{node.lineno} calls admission.{node.func.attr}")
    return found


def test_only_the_lifecycle_writes_a_key_state_or_the_indices_that_follow_it():
    writes = {}
    for path in sorted((ROOT / "replay").glob("*.py")):
        if path.name != "lifecycle.py":
            found = _writes(ast.parse(path.read_text()))
            if found:
                writes[path.name] = found
    assert writes == {}
    seen = _writes(
        ast.parse("def f(r):\n    r.entries.pop(1)\n    r.state = 2\n    del r.lru[3]\n    r.counters.variants += 1\n")
    )
    assert sorted(seen) == ["f:2 calls .entries.pop", "f:3 writes .state", "f:4 writes .lru"]  # (the scan itself)


# --- the docs --------------------------------------------------------------------------------------------
def test_the_docs_show_the_table_and_the_diagram_drawn_from_it():
    """docs/replay.md's section "The life of a key" is lifecycle.life_of_a_key() word for word:
    change the table in replay/lifecycle.py, then paste the function's output again."""
    assert lifecycle.life_of_a_key() in (ROOT / "docs" / "replay.md").read_text()


def test_the_diagram_has_one_arrow_per_move_of_the_table():
    lines = lifecycle.state_diagram().splitlines()
    arrows = {line.strip() for line in lines[2:]}
    expected = {f"{s.name} --> {m.target.name}: {m.event}" for m in TRANSITIONS for s in m.sources}
    assert lines[0] == "stateDiagram-v2" and arrows == expected and len(lines) == 2 + len(expected)
    table = lifecycle.transition_table().splitlines()
    assert len(table) == 2 + len(TRANSITIONS) and all(f"`{m.event}`" in table[2 + i] for i, m in enumerate(TRANSITIONS))
    assert {NO_ENTRY, RECORDING, ANALYSING} <= {s for m in TRANSITIONS for s in (*m.sources, m.target)}


# --- bounded bookkeeping ----------------------------------------------------------------------------
def test_recently_used_keeps_its_most_recently_read_or_written_entries():
    table = lifecycle.RecentlyUsed(3)
    for key in "abc":
        table[key] = key.upper()
    assert table.get("a") == "A" and "b" in table  # a read makes "a" recent; ``in`` changes nothing
    table["d"] = "D"
    assert list(table) == ["c", "a", "d"]  # "b", the least recent, went
    assert table.setdefault("e", "E") == "E" and list(table) == ["a", "d", "e"]
    assert table.get("b") is None and table.get("b", 0) == 0
    table["a"] = "A2"  # a write of a held key makes it recent too
    assert list(table.items()) == [("d", "D"), ("e", "E"), ("a", "A2")]


def test_a_region_keeps_the_hints_of_its_most_recent_structures(walked, monkeypatch):
    monkeypatch.setattr(region_module, "MAX_HINTS", 4)
    session = walked[1]()
    step = session.region(lambda batch: torch.full((3,), 2.0))  # touches no input: a clean warm-up
    x = torch.ones(3)
    observed = []
    original = step.recorder.observed_warm_up

    def observed_warm_up(call, *args):
        observed.append(call.spec)
        return original(call, *args)

    monkeypatch.setattr(step.recorder, "observed_warm_up", observed_warm_up)
    for number in range(10):
        assert torch.equal(step({"x": x, f"request {number}": 1}), x * 2)
    assert len(observed) == 10 and len(set(observed)) == 10 and len(step.hints) == 4

    def requests():
        return [spec[0][0][1][1] for spec in step.hints]  # (the dict's keys, in the spec)

    assert requests() == [f"request {n}" for n in range(6, 10)]
    step({"x": x, "request 7": 1})  # recorded: its hint is read (the capture needs no observer)
    step({"x": x, "request 0": 1})  # recorded, its hint forgotten: the capture observes instead
    assert [observe for *_, observe in session.captures] == [False, True]
    assert requests() == ["request 6", "request 8", "request 9", "request 7"]  # "request 7" the most recent


def test_a_regions_size_states_are_bounded_the_least_replayed_variant_going_last(walked, monkeypatch):
    monkeypatch.setattr(lifecycle, "MAX_VARIANT_STATES", 3)
    session = walked[1]()
    step = session.region(add)
    variants = []
    for number, replays in enumerate((5, 2, 7)):
        key = ("size", number)
        variants.append(_Variant(Entry(step, key, (step, key)), key, replays=replays))
        session.keys.vary(variants[-1].entry, variants[-1])
    session.keys.not_a_variant(step, ("size", 3), "its launches differ")  # full: the variant replayed least goes
    assert variants[1].released and variants[1].entry.state is NO_ENTRY and step.forgotten.replays == 2
    assert list(step.variants) == [("size", 0), ("size", 2), ("size", 3)]
    key = ("size", 4)
    newest = _Variant(Entry(step, key, (step, key)), key, replays=0)
    session.keys.vary(newest.entry, newest)  # full: the reasons go first, then no variant need go
    assert list(step.variants) == [("size", 0), ("size", 2), ("size", 4)] and not variants[0].released


#: What a region and its session keep of a loop of ever-new argument structures, at most
#: (tracemalloc: what stays allocated). While lists of up to 1000 tensors are the newest: the
#: counts of two windows of calls and MAX_HINTS keys, each as large as its call's structure.
HELD_FOR_LARGE_STRUCTURES = 64 * 2**20
#: ... and once small structures have taken their places.
HELD_FOR_SMALL_STRUCTURES = 8 * 2**20


def _a_tensor(*args, **kwargs):
    return _ONE


_ONE = torch.ones(2)


def test_a_hundred_thousand_distinct_structures_keep_bounded_bookkeeping():
    """Lists of lengths 1..1000 (of one tensor), dicts keyed by request id, distinct keyword
    names: 100,000 structures, each new, through a region (each call's warm-up observed, each
    leaving a hint and a count), within a stated memory whatever their number."""
    x = _ONE
    with use_backend(NullBackend()):
        session = DoubleSession()
        DoubleSession.current = session
        step = session.region(_a_tensor)
        step(x)
        gc.collect()
        tracemalloc.start()
        try:
            start = tracemalloc.get_traced_memory()[0]
            large = small = 0
            for length in range(1, 1001):
                step([x] * length)
                large = max(large, tracemalloc.get_traced_memory()[0] - start)
            for number in range(99_000):
                if number % 2:
                    step({f"request {number}": x})
                else:
                    step(x, **{f"name_{number}": x})
                if number >= 4 * session.admission.sketch.window:  # (two windows replaced the lists' counts)
                    small = max(small, tracemalloc.get_traced_memory()[0] - start)
        finally:
            tracemalloc.stop()
    assert large < HELD_FOR_LARGE_STRUCTURES and small < HELD_FOR_SMALL_STRUCTURES, (large, small)
    assert len(step.hints) == lifecycle.MAX_HINTS and len(session.admission.sketch.counts) <= 2 * 1024  # (2 windows)
    assert len(step.entries) == 0 and session.stats().eager_runs == 100_001


def _few_structures(session) -> tuple:
    """A loop over five argument structures (one tensor many times in a list, a dict keyed by
    request id, keywords, a flat call, overlapping views in a list), 40 calls each: the
    session's counts, and each key's state, eager runs and replays."""
    step = session.region(_total)
    x, y = torch.ones(3), torch.full((3,), 2.0)
    structures = [
        (([x] * 300,), {}),
        (({"request 1": x, "request 2": y},), {}),
        ((x,), {"scale": y}),
        ((x, y), {}),
        (([x, y, x[1:]],), {}),
    ]
    for _ in range(40):
        for args, kwargs in structures:
            assert torch.equal(step(*args, **kwargs), _total(*args, **kwargs))
    stats = session.stats()
    keys = [(e.state, e.eager_runs, e.replays) for e in step.entries.values()]
    return stats.calls, stats.replays, stats.eager_runs, stats.records, stats.too_rare, len(step.hints), keys


def _total(*args, **kwargs):
    return sum(t.sum() for t in region_keys.flatten(args, kwargs)[1])


def test_a_loop_of_few_structures_counts_and_decides_as_it_did_without_bounds(monkeypatch):
    with use_backend(NullBackend()):
        DoubleSession.current = session = DoubleSession()
        bounded = _few_structures(session)
        for module, name in ((region_module, "MAX_HINTS"), (lifecycle, "MAX_IDLE_ENTRIES")):
            monkeypatch.setattr(module, name, 10**9)
        monkeypatch.setattr(stats_module, "MAX_INPUT_CHOICES", None)
        monkeypatch.setattr(value_keys, "_SIGNATURES_KEPT", 0)  # (no signature shared)
        DoubleSession.current = session = DoubleSession()
        unbounded = _few_structures(session)
    # each structure: its first call eager (observed, before its key has an entry), its second
    # recorded (the capture's launch is its result), every later one replayed (as before the
    # bounds were there: the same figures)
    assert bounded == unbounded == (200, 195, 5, 5, 0, 5, [(REPLAYING, 0, 39)] * 5)
