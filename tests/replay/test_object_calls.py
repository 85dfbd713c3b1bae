"""The repeated object call (replay.object_calls), on the CPU with the recording double: served
from its memo only where the full path would compute the same key and find the same entry
replaying (an oracle computes the full path's key beside every call the memo serves), and
every change the key reads sending the call back to the full path."""

from __future__ import annotations

import collections
import gc
import math
import weakref

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jitcore.backends import use_backend
from jitcore.backends.null import NullBackend
from replay import object_calls, region_keys
from replay.errors import RefusedKey
from replay.lifecycle import REPLAYING
from tests.replay.test_session import DoubleSession


class Layer:
    def __init__(self) -> None:
        self.keys = torch.randn(2, 3)
        self.values = torch.zeros(2, 3)
        self.spare = torch.ones(4)  # no torch op reads it: rebound, not keyed by its address
        self.scale = 2.0


class Cache:
    def __init__(self, layers: int = 2) -> None:
        self.layers = [Layer() for _ in range(layers)]
        self.offloading = False


def step(ids, positions, cache):
    out = ids.float().sum() + (positions.float().sum() if isinstance(positions, torch.Tensor) else positions)
    for layer in cache.layers:
        out = out + layer.keys.sum() * layer.scale
        layer.values.add_(1.0)  # written in place: keyed by its address
    return out


class Oracle:
    """Beside every call a memo serves: the full path's key, counted shapes and entry,
    computed from the call's arguments as the full path computes them."""

    def __init__(self, monkeypatch) -> None:
        self.served = 0
        self.pending: list = []
        real_serve, real_repeat = object_calls.serve, object_calls._repeat

        def serve(region, args, kwargs, miss):
            try:
                call = region_keys.flat_call(args, kwargs, walk_objects=True)
                full = (call, region.keying.counted(call), region.keying.key_of(call, region.session.current_device()))
            except RefusedKey:
                full = None
            self.pending = [full]
            return real_serve(region, args, kwargs, miss)

        def repeat(region, memo, plain):
            made = real_repeat(region, memo, plain)
            if made is not None:
                self.check(region, memo, made, self.pending[0])
            return made

        monkeypatch.setattr(object_calls, "serve", serve)
        monkeypatch.setattr(object_calls, "_repeat", repeat)

    def check(self, region, memo, made, full) -> None:
        assert full is not None, "the memo served a call the full path refuses"
        call, counted, key = full
        assert key == memo.key and region.entries.get(key) is memo.entry and memo.entry.state is REPLAYING
        assert counted[1] in region.entry_shapes
        assert made.spec == call.spec and made.paths == call.paths and made.starts == call.starts
        assert len(made.leaves) == len(call.leaves) and all(a is b for a, b in zip(made.leaves, call.leaves))
        self.served += 1


@pytest.fixture
def session():
    with use_backend(NullBackend()):
        made = DoubleSession(record_after=1)
        DoubleSession.current = made
        yield made


@pytest.fixture
def oracle(monkeypatch):
    return Oracle(monkeypatch)


def run(region, cache, steps: int = 6, **plain):
    ids = plain.get("ids", torch.tensor([[3]]))
    positions = plain.get("positions", torch.tensor([[1]]))
    results = [region(ids, positions, cache) for _ in range(steps)]
    return results


def test_a_decode_loop_is_served_by_its_memo_after_its_first_replays(session, oracle):
    region = session.region(step)
    cache = Cache()
    run(region, cache, 8)
    assert len(region.object_memos) == 1 and oracle.served >= 3
    served = oracle.served
    run(region, cache, 5)
    assert oracle.served == served + 5


# --- every change the key reads: the full path ----------------------------------------------------
def _tensor_attribute_replaced(cache):
    cache.layers[0].keys = cache.layers[0].keys.clone()


def _data_set(cache):
    cache.layers[1].spare.data = torch.ones(4)


def _resized(cache):
    cache.layers[0].spare.resize_(5)


def _value_set(cache):
    cache.layers[1].scale = 3.0


def _equal_value_set_again(cache):
    cache.layers[1].scale = float("2.0")  # the same key; a memo made anew


def _attribute_added(cache):
    cache.extra = 1


def _layer_appended(cache):
    cache.layers.append(Layer())


def _dict_replaced(cache):
    cache.__dict__ = dict(cache.__dict__)


def _class_changed(cache):
    cache.__class__ = type("OtherCache", (Cache,), {})


def _requires_grad(cache):
    cache.layers[0].spare.requires_grad_()


class OtherLayer(Layer):
    pass


def _nested_class_changed(cache):
    cache.layers[0].__class__ = OtherLayer


def _attribute_moved_last(cache):
    keys = cache.layers[0].keys
    del cache.layers[0].keys
    cache.layers[0].keys = keys  # the same names and values, in another order


def _item_shared(cache):
    cache.layers[1] = cache.layers[0]


def _storage_set(cache):
    cache.layers[0].keys.set_(torch.randn(6).untyped_storage(), 0, (2, 3), (3, 1))


def _offset_moved(cache):
    cache.layers[0].spare.as_strided_((3,), (1,), 1)


def _dtype_view(cache):
    cache.layers[0].spare.data = cache.layers[0].spare.data.view(torch.int32)


def _negative_zero(cache):
    cache.layers[0].scale = -0.0


def _numpy_scalar(cache):
    cache.layers[0].scale = np.float64(2.0)


def _int_for_bool(cache):
    cache.offloading = 0


def _tensor_attribute_set(cache):
    cache.layers[0].keys.scale = 2.0  # a tensor's own Python attribute


@pytest.mark.parametrize(
    "change",
    [
        _tensor_attribute_replaced,
        _data_set,
        _resized,
        _value_set,
        _equal_value_set_again,
        _attribute_added,
        _layer_appended,
        _dict_replaced,
        _class_changed,
        _requires_grad,
        _nested_class_changed,
        _attribute_moved_last,
        _item_shared,
        _storage_set,
        _offset_moved,
        _dtype_view,
        _negative_zero,
        _numpy_scalar,
        _int_for_bool,
        _tensor_attribute_set,
    ],
)
def test_a_change_of_what_the_key_reads_takes_the_full_path(session, oracle, change):
    region = session.region(step)
    cache = Cache()
    run(region, cache, 8)
    served = oracle.served
    with torch.no_grad():
        change(cache)
    region(torch.tensor([[3]]), torch.tensor([[1]]), cache)
    assert oracle.served == served  # (the oracle: every call served after it has the full path's key)
    run(region, cache, 6)


def test_a_tensors_own_attribute_changed_takes_the_full_path(session, oracle):
    def scaled_step(ids, positions, cache):
        return step(ids, positions, cache) * cache.layers[0].keys.scale

    region = session.region(scaled_step)
    cache = Cache()
    cache.layers[0].keys.scale = 1.0
    run(region, cache, 8)
    served = oracle.served
    assert served
    cache.layers[0].keys.scale = 2.0
    region(torch.tensor([[3]]), torch.tensor([[1]]), cache)
    assert oracle.served == served
    run(region, cache, 6)
    assert oracle.served > served


def test_in_place_writes_keep_the_memo(session, oracle):
    region = session.region(step)
    cache = Cache()
    run(region, cache, 8)
    served = oracle.served
    cache.layers[0].keys.mul_(2.0)
    cache.layers[1].spare.zero_()
    run(region, cache, 2)
    assert oracle.served == served + 2


def test_an_argument_overlapping_an_objects_tensor_takes_the_full_path(session, oracle):
    region = session.region(step)
    cache = Cache()
    run(region, cache, 8)
    served = oracle.served
    view = cache.layers[0].values[0, :1].view(1, 1)
    region(view, torch.tensor([[1]]), cache)
    assert oracle.served == served
    positions = torch.tensor([[1]])
    region(positions, positions, cache)  # two arguments overlapping each other
    assert oracle.served == served


def test_other_objects_shapes_and_values_take_the_full_path(session, oracle):
    region = session.region(step)
    cache = Cache()
    run(region, cache, 8)
    served = oracle.served
    region(torch.tensor([[3]]), torch.tensor([[1]]), Cache())
    region(torch.tensor([[3, 4]]), torch.tensor([[1]]), cache)
    region(torch.tensor([[3.0]]), torch.tensor([[1]]), cache)
    assert oracle.served == served


class Ordered(Cache):
    def __init__(self) -> None:
        super().__init__()
        self.parts = collections.OrderedDict(a=torch.ones(2), b=torch.zeros(2))


def ordered_step(x, cache):
    return torch.cat([x, *cache.parts.values()])


def test_an_ordered_dict_reordered_takes_the_full_path_and_another_key(session, oracle):
    region = session.region(ordered_step)
    cache = Ordered()
    for _ in range(8):
        region(torch.ones(1), cache)
    served, replays = oracle.served, session.stats().replays
    assert served
    cache.parts.move_to_end("a")  # the dict beneath keeps its order: the walk reads the OrderedDict's
    assert torch.equal(region(torch.ones(1), cache), torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0]))
    assert oracle.served == served and session.stats().replays == replays


def test_arguments_moved_swapped_or_passed_by_keyword_take_the_full_path(session, oracle):
    def two(x, a, b):
        return x + a.layers[0].keys.sum() * 2.0 + b.layers[0].keys.sum()

    region = session.region(two)
    a, b = Cache(), Cache()
    for _ in range(6):
        region(torch.ones(1), a, b)
    served = oracle.served
    assert served
    region(torch.ones(1), b, a)
    region(torch.ones(1), a, b=b)
    region(torch.ones(1), a, a)
    assert oracle.served == served
    b.layers = a.layers  # shared between the two arguments: another structure
    for _ in range(6):
        region(torch.ones(1), a, b)


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("shift", torch.zeros(3))


@pytest.mark.parametrize(
    "change",
    [
        lambda m: setattr(m, "lin", torch.nn.Linear(3, 3)),
        lambda m: m.register_forward_hook(lambda *_: None),
        lambda m: m.lin.register_forward_pre_hook(lambda *_: None),
        lambda m: m.eval(),
        lambda m: setattr(m.lin, "weight", torch.nn.Parameter(torch.randn(3, 3))),
        lambda m: m.lin.weight.requires_grad_(False),
    ],
)
def test_a_changed_module_argument_takes_the_full_path(session, oracle, change):
    region = session.region(lambda x, m: m.lin(x) + m.shift)
    module = Stack()
    with torch.no_grad():
        for _ in range(8):
            region(torch.ones(3), module)
        served = oracle.served
        change(module)
        region(torch.ones(3), module)
        assert oracle.served == served
        for _ in range(4):
            region(torch.ones(3), module)


def test_nan_plain_arguments_take_the_full_path(session, oracle):
    def scaled(x, factor, cache):
        return x * factor + cache.layers[0].keys.sum()

    region = session.region(scaled)
    cache = Cache()
    for _ in range(8):
        region(torch.ones(2), 0.5, cache)
    served = oracle.served
    assert served
    for _ in range(3):
        region(torch.ones(2), float("nan"), cache)
    assert oracle.served == served  # (a NaN is counted apart from every other NaN)


# --- the entry going: never served from its memo ---------------------------------------------------
def _released(session, region):
    for entry in list(region.entries.values()):
        if entry.state is REPLAYING:
            session.keys.release(entry)


def _invalidated(session, region):
    session.invalidate()


@pytest.mark.parametrize("going", [_released, _invalidated])
def test_an_entry_released_or_invalidated_is_never_served_from_a_memo(session, oracle, going):
    region = session.region(step)
    cache = Cache()
    run(region, cache, 8)
    served = oracle.served
    going(session, region)
    region(torch.tensor([[3]]), torch.tensor([[1]]), cache)
    assert oracle.served == served
    assert not region.object_memos  # (dropped at the call that found it stale)


SCALE = 1.0


def global_scaled(ids, positions, cache):
    return step(ids, positions, cache) * SCALE


def test_a_change_of_the_globals_drops_every_memo(session, oracle):
    global SCALE
    region = session.region(global_scaled)
    cache = Cache()
    run(region, cache, 8)
    served = oracle.served
    assert region.object_memos
    try:
        SCALE = 2.0
        region(torch.tensor([[3]]), torch.tensor([[1]]), cache)
        assert oracle.served == served and session.stats().invalidations == 1
    finally:
        SCALE = 1.0


def test_a_change_of_the_structures_addresses_takes_the_full_path(session, oracle):
    region = session.region(step)
    cache = Cache()
    run(region, cache, 8)
    served = oracle.served
    (memo,) = region.object_memos
    region.hints.get(memo.spec).addressed.add(max(memo.object_full) + 3)  # what a recording would teach
    region(torch.tensor([[3]]), torch.tensor([[1]]), cache)
    assert oracle.served == served


def test_a_torch_setting_changed_takes_the_full_path(session, oracle):
    region = session.region(step)
    cache = Cache()
    run(region, cache, 8)
    served = oracle.served
    with torch.inference_mode():
        region(torch.tensor([[3]]), torch.tensor([[1]]), cache)
    assert oracle.served == served


# --- what a memo holds -------------------------------------------------------------------------------
def test_a_memo_goes_with_its_object_and_frees_its_tensors(session, oracle):
    region = session.region(step)
    cache = Cache()
    run(region, cache, 8)
    assert region.object_memos
    tensor = weakref.ref(cache.layers[0].keys)
    del cache
    session.captures.clear()  # (the recording double keeps what it captured)
    oracle.pending.clear()
    gc.collect()
    assert not region.object_memos and tensor() is None


class Slotted:
    __slots__ = ("layers", "__weakref__")

    def __init__(self) -> None:
        self.layers = [Layer()]


class WithSet(Cache):
    def __init__(self) -> None:
        super().__init__()
        self.seen = {1}


class Cyclic(Cache):
    def __init__(self) -> None:
        super().__init__()
        self.me = [self]


@pytest.mark.parametrize("made", [Slotted, WithSet, Cyclic])
def test_no_memo_where_its_watch_could_not_be_exact_or_would_keep_the_object(session, made):
    region = session.region(step)
    cache = made()
    results = run(region, cache, 8)
    assert not region.object_memos and session.stats().replays >= 3
    assert all(math.isfinite(r.item()) for r in results)


# --- random sequences: the memo's key and entry are the full path's ----------------------------------
OPERATIONS = st.sampled_from(
    [
        "call",
        "call",
        "call",
        "call_wide",
        "call_alias",
        "call_int",
        "call_int",
        "new_cache",
        "replace_tensor",
        "set_data",
        "resize",
        "write",
        "set_scale",
        "same_scale",
        "nan_scale",
        "add_attribute",
        "tensor_attribute",
        "grad",
        "release",
    ]
)


def _apply(operation: str, state: dict, region, session) -> None:
    cache = state["cache"]
    layer = cache.layers[0]
    ids, positions = torch.tensor([[3]]), torch.tensor([[1]])
    if operation == "call":
        region(ids, positions, cache)
    elif operation == "call_wide":
        region(torch.tensor([[3, 4]]), positions, cache)
    elif operation == "call_alias":
        region(layer.values[0, :1].view(1, 1), positions, cache)
    elif operation == "call_int":
        region(ids, 7, cache)
    elif operation == "new_cache":
        state["cache"] = Cache()
    elif operation == "replace_tensor":
        layer.keys = layer.keys.clone()
    elif operation == "set_data":
        layer.spare.data = torch.ones(layer.spare.numel())
    elif operation == "resize" and not layer.spare.requires_grad:
        layer.spare.resize_(5 if layer.spare.numel() == 4 else 4)
    elif operation == "write":
        layer.keys.add_(1.0)
    elif operation in ("set_scale", "same_scale", "nan_scale"):
        layer.scale = {"set_scale": layer.scale + 1.0, "same_scale": float(str(layer.scale))}.get(operation, math.nan)
    elif operation == "add_attribute":
        cache.__dict__.setdefault("extra", 0)
    elif operation == "tensor_attribute":
        layer.keys.note = getattr(layer.keys, "note", 0) + 1  # a tensor's own attribute, added then changed
    elif operation == "grad":
        layer.spare.requires_grad_(not layer.spare.requires_grad)
    elif operation == "release":
        _released(session, region)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(operations=st.lists(OPERATIONS, min_size=4, max_size=30))
def test_random_sequences_are_served_from_memos_only_with_the_full_paths_key(session, oracle, operations):
    region = session.region(step)
    state = {"cache": Cache()}
    with torch.no_grad():
        for _ in range(6):
            _apply("call", state, region, session)
        for operation in operations:
            _apply(operation, state, region, session)
        _apply("call", state, region, session)
