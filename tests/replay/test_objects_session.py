"""Object arguments through the session, on the CPU with the recording double (the GPU tests
capture for real): walked on the full path and keyed there on every call, their tensors
rebound or keyed by their address (never staged), and every run that does what no graph
replays (a Python assignment to an object or to watched state, a draw from the CPU
generator) refusing its key, exactly as eager, with one warning naming what changed."""

from __future__ import annotations

import collections
import copy
import threading
import time
import warnings

import pytest
import torch

import replay
from jitcore.backends import use_backend
from jitcore.backends.null import NullBackend
from replay import compaction, objects, recording, region_keys
from replay.graph import bitwise_equal, clone_preserving_sharing
from replay.lifecycle import EAGER_ONLY, REPLAYING, WARMING
from replay.rebinding import Plan
from replay.region_keys import KeyMark
from tests.replay.cache_standin import CountingCache, StandInCache, attention_step, attention_weights
from tests.replay.test_lifecycle import _RecapturedGraph as RecapturedGraph
from tests.replay.test_objects import tiny_llama
from tests.replay.test_session import DoubleSession, FakeGraph


class ObjectSession(DoubleSession):
    """The recording double, noting which object tensors each capture was told about."""

    def __init__(self, **policy):
        super().__init__(**policy)
        self.shadows: list[frozenset[int]] = []

    @staticmethod
    def record_key(fn, spec, leaves, paths, *, shadows=frozenset(), **options):
        ObjectSession.current.shadows.append(frozenset(shadows))
        return DoubleSession.record_key(fn, spec, leaves, paths, **options)


@pytest.fixture
def make():
    with use_backend(NullBackend()):

        def made(**policy):
            session = ObjectSession(**policy)
            DoubleSession.current = ObjectSession.current = session
            return session

        yield made


class State:
    def __init__(self, **values):
        self.__dict__.update(values)


def replay_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, replay.ReplayWarning)]


def addresses(key: tuple) -> tuple:
    return next((e[1] for e in key[-2:] if isinstance(e, tuple) and e and e[0] is KeyMark.ADDRESSES), ())


# --- tensors of objects: rebound, or keyed by their address -------------------------------------
def scaled(x, state):
    return x * state.scale  # reads a plain value of the object; its tensor only through the object


def test_an_object_whose_tensors_no_torch_op_touches_shares_its_graph_with_every_object_like_it(make):
    session = make(record_after=1)
    step = session.region(scaled)
    x = torch.randn(4)
    for _ in range(6):  # a new object per call, holding a new tensor
        assert torch.equal(step(x, State(scale=2.0, t=torch.zeros(3))), x * 2.0)
    assert len(step.entries) == 1 and session.stats().replays >= 3
    (key,) = step.entries
    assert not addresses(key) and region_keys.CARRIER in key
    assert isinstance(session.captures[0][1][3], torch.Tensor)  # an input of the capture: rebound
    assert session.shadows == [frozenset({3})]  # told, so that a capture never stages it
    for _ in range(2):
        assert torch.equal(step(x, State(scale=3.0, t=torch.zeros(3))), x * 3.0)  # a plain value: another key
    assert len(step.entries) == 2


def added(x, state):
    return x + state.t  # a torch op reads the object's tensor


def test_a_torch_op_reading_an_objects_tensor_keys_it_by_its_address(make):
    session = make(record_after=1)
    step = session.region(added)
    x, state = torch.randn(3), State(t=torch.randn(3))
    for _ in range(4):
        assert torch.equal(step(x, state), x + state.t)
    recorded = [key for key, entry in step.entries.items() if entry.state is REPLAYING]
    assert len(recorded) == 1 and addresses(recorded[0]) == ((2, state.t.data_ptr()),)
    assert session.captures[0][1][2] is objects.BAKED  # never an input: no staging, no rebinding
    assert 2 not in session.captures[0][2]  # (and never staged)
    other = State(t=torch.randn(3))  # a new object elsewhere: another key
    for _ in range(3):
        assert torch.equal(step(x, other), x + other.t)
    assert sum(entry.state is REPLAYING for entry in step.entries.values()) == 2


def test_an_analysis_asking_to_stage_an_objects_tensor_keys_it_by_address_and_records_again(make):
    session = make(record_after=0)  # no observed warm-up: the analysis finds it
    session.analyse_script = [recording.CaptureRetry(Plan(needs_staging={0, 2}, needs_copy_back={2}))]
    step = session.region(added)
    x, state = torch.randn(3), State(t=torch.randn(3))
    for _ in range(4):
        assert torch.equal(step(x, state), x + state.t)
    first, second = session.captures[0], session.captures[1]
    assert isinstance(first[1][2], torch.Tensor) and first[2] == set()
    assert second[1][2] is objects.BAKED and second[2] == {0}  # the argument staged, the object's tensor baked
    states = {addresses(key): entry.state for key, entry in step.entries.items()}
    assert states == {(): WARMING, ((2, state.t.data_ptr()),): REPLAYING}
    assert session.stats().record_retries == 1 and step.hints[first[0]].addressed == {2}


def test_keys_and_counts_of_objects_hold_the_addresses_their_structure_keys_by(make):
    session = make(record_after=1)
    step = session.region(added)
    x = torch.randn(3)
    state = State(t=torch.randn(3))
    step(x, state)  # the observed warm-up: teaches the address
    call = region_keys.flat_call((x, state), {}, walk_objects=True)
    counted, key = step.keying.counted(call), step.keying.key_of(call, -1)
    assert counted[1][2] == (state.t.data_ptr(),) and addresses(key) == ((2, state.t.data_ptr()),)
    fresh = region_keys.flat_call((x, State(t=torch.randn(3))), {}, walk_objects=True)
    assert step.keying.counted(fresh) != counted and step.keying.key_of(fresh, -1) != key
    assert "at fixed addresses: leaf 2" in replay.keying.describe_key(key, limit=1000)


def test_a_cpu_tensor_inside_an_object_is_refused_before_anything_is_captured():
    state = State(t=torch.ones(2))
    call = region_keys.flat_call((state,), {}, walk_objects=True)
    with pytest.raises(recording.CaptureFailed, match=r"args\[0\]\.t is a CPU tensor inside an object argument"):
        recording._prepare_inputs(call.leaves, call.paths, device=0, stage=set(), shadows=frozenset({1}))


# --- what no graph replays: refused, exactly as eager --------------------------------------------
def counting(x, state):
    state.n += 1
    return x + state.n


@pytest.mark.parametrize("record_after", [0, 1, 2])
def test_a_python_assignment_to_an_object_is_refused_naming_it_and_never_dropped(make, record_after):
    session = make(record_after=record_after)
    step = session.region(counting)
    x, state, eager_state = torch.randn(2), State(n=0), State(n=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(8):
            assert torch.equal(step(x, state), counting(x, eager_state))
            assert state.n == eager_state.n
    assert session.stats().replays - session.stats().records <= 0  # nothing but first launches
    said = [
        f"region {step.name}: runs eagerly: the region changes args[1].n: a Python assignment a graph cannot replay"
    ]
    # (from record_after=2 on, no run of such a key is observed or recorded: each call has a key of its own)
    assert replay_warnings(caught) == (said if record_after < 2 else [])


def scaling_its_tensor(x, state):
    state.t.scale = state.t.scale * 2.0  # a tensor's own Python attribute, set in Python
    return x * state.t.scale


def test_a_python_assignment_to_a_tensors_own_attribute_is_refused_naming_it(make):
    session = make(record_after=1)
    step = session.region(scaling_its_tensor)
    x, tensor, eager_tensor = torch.randn(2), torch.zeros(2), torch.zeros(2)
    tensor.scale = eager_tensor.scale = 1.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            tensor.scale = eager_tensor.scale = 1.0  # the same key every call, changed by every run
            assert torch.equal(step(x, State(t=tensor)), scaling_its_tensor(x, State(t=eager_tensor)))
            assert tensor.scale == eager_tensor.scale == 2.0
    assert session.stats().replays - session.stats().records <= 0
    assert replay_warnings(caught) == [
        f"region {step.name}: runs eagerly: the region changes args[1].t.scale: a Python assignment a graph "
        "cannot replay"
    ]


def rotating(x, state):
    out = torch.cat([x, *state.parts.values()])
    state.parts.move_to_end(next(iter(state.parts)))  # reorders the OrderedDict alone
    return out


def test_a_region_reordering_an_ordered_dict_of_an_object_is_never_replayed(make):
    session = make(record_after=1)
    step = session.region(rotating)
    x = torch.ones(1)

    def made() -> State:
        return State(parts=collections.OrderedDict(a=torch.zeros(1), b=torch.full((1,), 2.0)))

    state, eager_state = made(), made()
    for _ in range(8):
        assert torch.equal(step(x, state), rotating(x, eager_state))
        assert list(state.parts) == list(eager_state.parts)
    assert session.stats().replays == 0


def test_a_counting_cache_is_refused_where_its_key_comes_back(make):
    """A key whose run changed an object, seen again with an object in the same state (a new
    cache per generation): eager, not recorded again."""
    session = make(record_after=1)
    step = session.region(lambda hidden, cache: attention_step(WEIGHTS, cache, hidden))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            cache, eager_cache = CountingCache(2, 8), CountingCache(2, 8)
            for _ in range(3):
                hidden = torch.randn(1, 1, 8)
                assert bitwise_equal(step(hidden, cache), attention_step(WEIGHTS, eager_cache, hidden.clone()))
                assert cache.seen_tokens == eager_cache.seen_tokens
    assert session.stats().records == 0 and session.stats().replays == 0
    assert any("args[1].seen_tokens" in said for said in replay_warnings(caught))


WEIGHTS = attention_weights(2, 8)


def cache_tensors(cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("record_after", [0, 1])
def test_a_static_cache_stand_in_replays_after_its_lazy_first_call_quietly(make, record_after):
    session = make(record_after=record_after)
    step = session.region(lambda hidden, cache: attention_step(WEIGHTS, cache, hidden))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # a new cache per generation
            cache, eager_cache = StandInCache(2, 8), StandInCache(2, 8)
            for _ in range(5):
                hidden = torch.randn(1, 1, 8)
                assert bitwise_equal(step(hidden, cache), attention_step(WEIGHTS, eager_cache, hidden.clone()))
                assert all(map(bitwise_equal, cache_tensors(cache), cache_tensors(eager_cache)))
    assert not replay_warnings(caught)  # the lazy initialisation: a key of its own, refused quietly
    assert REPLAYING in [entry.state for entry in step.entries.values()] and session.stats().replays >= 4


def drawing(x):
    return x * torch.rand(())  # a CPU draw: a graph would bake its number


@pytest.mark.parametrize("record_after", [0, 1])
def test_a_draw_from_the_cpu_generator_refuses_the_key(make, record_after):
    session = make(record_after=record_after)
    step = session.region(drawing)
    x = torch.ones(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(3)
        got = [step(x) for _ in range(6)]
    torch.manual_seed(3)
    assert all(map(torch.equal, got, [drawing(x) for _ in range(6)]))
    assert session.stats().replays == session.stats().records <= 1  # a first launch at most
    assert replay_warnings(caught) == [
        f"region {step.name}: runs eagerly: the region draws from the CPU generator: a graph would repeat its "
        "recording's numbers"
    ]
    assert [entry.state for entry in step.entries.values()] == [EAGER_ONLY]


def sets_the_default_dtype(x):
    torch.set_default_dtype(torch.float64)  # and leaves it so: every eager call sets it
    return x + torch.ones(3)


@pytest.mark.parametrize("record_after", [0, 1])
def test_a_region_leaving_a_torch_setting_changed_is_refused_under_the_settings_it_began_with(make, record_after):
    """A replay runs none of the region's Python: where the caller puts the setting back before
    each call, a replayed key would leave it as the caller set it, where eager changes it. Such
    a key runs eagerly; the key of the settings the region leaves (nothing changes there)
    replays."""
    session = make(record_after=record_after)
    step = session.region(sets_the_default_dtype)
    x = torch.ones(3, dtype=torch.float64)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(6):
                torch.set_default_dtype(torch.float32)  # the caller puts it back at every call
                assert torch.equal(step(x), x + 1) and torch.get_default_dtype() is torch.float64
            changing = [entry.state for entry in step.entries.values()]
            for _ in range(6):
                assert torch.equal(step(x), x + 1)
    finally:
        torch.set_default_dtype(torch.float32)
    assert changing == [EAGER_ONLY]
    assert replay_warnings(caught) == [
        f"region {step.name}: runs eagerly: the region changes a torch setting (default dtype) and leaves it "
        "changed: a graph cannot replay that"
    ]
    assert REPLAYING in [entry.state for entry in step.entries.values()] and session.stats().replays >= 4


def test_a_region_changing_watched_state_is_refused_at_its_second_change_not_recorded_again_and_again(make):
    counter = State(n=0)

    def counted(x):
        counter.n += 1
        return x + 1

    session = make(record_after=0)
    step = session.region(counted)
    x = torch.ones(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for calls in range(1, 21):
            assert torch.equal(step(x), x + 1) and counter.n == calls
    assert session.stats().records == 2  # the first change re-keys (a lazy initialisation may), the second refuses
    assert replay_warnings(caught) == [
        f"region {step.name}: runs eagerly: the region changes counter.n: a Python assignment a graph cannot replay"
    ]


def test_a_closed_over_cache_initialised_by_its_first_capture_replays_after_one_re_key(make):
    cache = StandInCache(2, 8)
    eager_cache = copy.deepcopy(cache)
    session = make(record_after=0)
    step = session.region(lambda hidden: attention_step(WEIGHTS, cache, hidden))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            hidden = torch.randn(1, 1, 8)
            assert bitwise_equal(step(hidden), attention_step(WEIGHTS, eager_cache, hidden.clone()))
    assert not replay_warnings(caught) and session.stats().records == 2 and session.stats().replays >= 5


def test_unreplayable_keys_are_bounded_and_kept_across_a_drift(make, monkeypatch):
    monkeypatch.setattr(replay.effects, "MAX_KEYS", 4)
    table = replay.effects.Unreplayable()
    for n in range(10):
        table.mark((n,), "why")
    assert list(table.keys) == [(6,), (7,), (8,), (9,)]
    assert not table.suspected_before((1,), "a") and table.suspected_before((1,), "a")
    session = make(record_after=0)
    step = session.region(drawing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(torch.ones(2))
    step.forget_globals()
    assert step.unreplayable.keys  # (a region's own assignments drift its globals: kept)


# --- verification runs on copies of the objects --------------------------------------------------
class VerifyingGraph(FakeGraph):
    """FakeGraph whose verification runs the eager function on copies, as RecordedGraph's."""

    def verify(self, leaves, eager):
        self.verified += 1
        copies = clone_preserving_sharing(leaves)
        result = self.replay(*leaves)
        expected = eager(copies)
        assert bitwise_equal(result, expected)
        for leaf, copied in zip(leaves, copies):
            assert not isinstance(leaf, torch.Tensor) or bitwise_equal(leaf, copied)
        return result


def test_a_verified_replay_runs_the_region_on_copies_of_the_objects_never_twice_on_the_callers(make):
    session = make(record_after=1, verify_every=1)
    session.build_graph = VerifyingGraph
    step = session.region(lambda hidden, cache: attention_step(WEIGHTS, cache, hidden))
    cache, eager_cache = StandInCache(2, 8), StandInCache(2, 8)
    for _ in range(7):  # (its first call and its second structure observed, one warm: addressed)
        hidden = torch.randn(1, 1, 8)
        assert bitwise_equal(step(hidden, cache), attention_step(WEIGHTS, eager_cache, hidden.clone()))
        assert all(map(bitwise_equal, cache_tensors(cache), cache_tensors(eager_cache)))  # written once per call
    assert session.stats().verifications >= 2


def test_copies_of_objects_hold_the_copied_tensors_and_keep_their_sharing():
    t = torch.ones(2)
    state = State(a=t, b=t, inner=State(c=torch.zeros(1)), n=3)
    call = region_keys.flat_call((state,), {}, walk_objects=True)
    copies = clone_preserving_sharing(call.leaves)
    (copied, *_rest) = objects.with_copied_objects(call.spec, call.leaves, copies)
    assert copied is not state and copied.a is copied.b and copied.a is not t and copied.n == 3
    assert {id(copied.a), id(copied.inner.c)} <= {id(c) for c in copies}
    copied.inner.c.add_(1)
    assert state.inner.c.item() == 0
    assert objects.copyable(call.spec, call.leaves)
    spec = ((None,), (), (), objects.ObjectLeaves((0,), ()))  # (a lock: a walk refuses it, a copy too)
    assert not objects.copyable(spec, [State(lock=threading.Lock())])


# --- compaction: each key under its own settings; keys of objects record again when called -------
def test_a_compaction_records_again_only_keys_of_its_settings_and_releases_the_others(make, monkeypatch):
    session = make(record_after=0)
    session.build_graph = RecapturedGraph
    step = session.region(scaled)
    plain = session.region(lambda x: x * 2, name="plain")
    x = torch.ones(2)
    for _ in range(2):
        step(x, State(scale=2.0))
        plain(x)
        with torch.no_grad():
            plain(torch.ones(3))  # another key: grad mode is one of its settings
    monkeypatch.setattr(recording, "KeptPool", lambda device, stream: type("Pool", (), {"id": (0, 2)})())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    held = {entry: entry.graph for entry in session.lru}
    assert len(held) == 3 and session.compaction.compact(-1)
    by_kind = {("object" if len(e.key[1]) > 3 else "grad" if e.key[2] == _modes() else "no grad"): e for e in held}
    assert by_kind["object"].state is WARMING and by_kind["no grad"].state is WARMING  # released: recorded when called
    assert by_kind["grad"].state is REPLAYING and by_kind["grad"].graph is not held[by_kind["grad"]]
    assert not compaction.recordable_now(by_kind["object"].key) and compaction.recordable_now(by_kind["grad"].key)
    with torch.no_grad():
        assert torch.equal(plain(torch.ones(3)), torch.full((3,), 2.0))


def _modes() -> tuple:
    return replay.torch_state.torch_modes()


# --- what the full key of an object call costs (the walk of every call) ---------------------------
def test_the_full_key_of_a_six_layer_cache_is_the_walk_of_its_layers():
    cache, hidden = StandInCache(6, 64), torch.randn(1, 1, 8)
    attention_step(attention_weights(6, 8), cache, hidden)
    call = region_keys.flat_call((hidden, cache), {}, walk_objects=True)
    assert len(call.leaves) == 2 + 6 * 9 + 2 and call.spec[3].carriers == (1,)
    started = time.perf_counter()
    addressed = objects.shadow_tensors(call.spec, call.leaves)
    assert len(addressed) == 18
    for _ in range(50):
        call = region_keys.flat_call((hidden, cache), {}, walk_objects=True)
        region_keys.region_key(-1, call.spec, call.leaves, call.paths, addressed)
    assert (time.perf_counter() - started) / 50 < 0.01  # (figures: notes; a bound that catches a blow-up)


# --- transformers' own StaticCache and LlamaForCausalLM, where installed ------------------------
def test_a_transformers_static_cache_as_an_argument_is_keyed_alike_every_step_and_replays(make):
    transformers = pytest.importorskip("transformers")
    model, config = tiny_llama(transformers)

    def step(ids, positions, cache):
        return model(input_ids=ids, cache=cache, position_ids=positions, cache_position=positions[0]).logits

    session = make(record_after=1)
    region = session.region(step)
    keys = []
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # a new cache per generation
            cache = transformers.StaticCache(config=config, max_cache_len=16)
            eager_cache = transformers.StaticCache(config=config, max_cache_len=16)
            for position in range(6):
                ids, positions = torch.tensor([[position * 7 % 64]]), torch.tensor([[position]])
                call = region_keys.flat_call((ids, positions, cache), {}, walk_objects=True)
                keys.append(region.keying.key_of(call, -1))
                before = objects.snapshot(call.spec, call.leaves, call.paths)
                assert bitwise_equal(region(ids, positions, cache), step(ids, positions, eager_cache))
                change = objects.first_change(before, objects.snapshot(call.spec, call.leaves, call.paths))
                assert change == ("args[2].layers[0].keys" if position == 0 else None)  # lazy, then in place
    assert not replay_warnings(caught)
    assert keys[0] != keys[1] and len(set(keys[2:6])) == 1  # the lazy first call; then one key per step
    assert session.stats().replays >= 5 and session.stats().records <= 2
