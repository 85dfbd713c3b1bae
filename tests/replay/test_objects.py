"""Object arguments walked like containers (replay/objects.py): what is keyed, what is a leaf,
what is refused and where, and the snapshots that tell a run's Python side effects."""

from __future__ import annotations

import dataclasses
import enum
import functools
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay import dynamic, objects, region_keys, value_keys
from replay.errors import RefusedKey
from replay.region_keys import CARRIER, FLAT, flatten, region_key, unflatten
from tests.replay.cache_standin import CountingCache, GrowingLayer, StandInCache, attention_step, attention_weights


def walked(*args, **kwargs):
    return flatten(args, kwargs, walk_objects=True)


def key_of(*args, **kwargs):
    return region_key(0, *walked(*args, **kwargs))


class State:
    def __init__(self, **values):
        self.__dict__.update(values)


class Slotted:
    __slots__ = ("a", "__hidden", "unset")

    def __init__(self, a, hidden):
        self.a = a
        self.__hidden = hidden


class Color(enum.Enum):
    RED = 1
    BLUE = 2


@dataclasses.dataclass
class Mutable:  # not frozen: an object, walked (flatten without objects refuses it)
    t: torch.Tensor
    n: int


class Computed:  # no state of its own: what it shows comes from elsewhere
    @property
    def scale(self):
        return 2.0


_SHOWN = {"scale": 2.0}


class _Shown:  # a descriptor of its own, reading what it shows from elsewhere
    def __get__(self, instance, owner):
        return _SHOWN["scale"]


class Described:
    scale = _Shown()


class Forwarding:  # every attribute through __getattribute__
    def __getattribute__(self, name):
        return _SHOWN[name] if name in _SHOWN else object.__getattribute__(self, name)


# --- structures ----------------------------------------------------------------------------------
def test_an_object_is_a_carrier_leaf_returned_as_it_is_with_its_contents_as_shadow_leaves():
    x, t = torch.randn(3), torch.randn(2, 2)
    state = State(t=t, items=[t, 1, {"k": 2.5}], pair=(None, "s"), inner=State(n=3))
    spec, leaves, paths = walked(x, state)
    assert leaves[1] is state and paths[1] == "args[1]"
    assert paths[2:] == [
        "args[1].t", "args[1].items[0]", "args[1].items[1]", "args[1].items[2]['k']", "args[1].pair[0]",
        "args[1].pair[1]", "args[1].inner.n",
    ]  # fmt: skip
    assert leaves[2] is t and leaves[3] is t and leaves[4] == 1 and leaves[5] == 2.5
    assert spec[3] == objects.ObjectLeaves(carriers=(1,), shadows=tuple(range(2, 9)))
    args, kwargs = unflatten(spec, leaves)
    assert args[0] is x and args[1] is state and kwargs == {}  # the caller's object itself
    key = key_of(x, state)
    assert key[region_keys.LEAVES_START + 1] == CARRIER
    assert key[region_keys.LEAVES_START + 2] == jitcore_signature(t)


def jitcore_signature(t):
    return value_keys.leaf_key(t, "t")


def test_objects_anywhere_in_the_arguments_and_keywords():
    inner = State(v=torch.zeros(2))
    spec, leaves, paths = walked([inner, 1], cfg={"s": inner}, n=State(k=4))
    assert paths == ["args[0][0]", "args[0][0].v", "args[0][1]", "cfg['s']", "n", "n.k"]
    assert spec[3].carriers == (0, 3, 4)
    args, kwargs = unflatten(spec, leaves)
    assert args[0][0] is inner and kwargs["cfg"]["s"] is inner and kwargs["n"].k == 4
    # the second meeting of inner is a reference to the first: keyed sharing, no leaves again
    assert spec[2][0][2][0] == ("object", ("ref", 0), 0)


def test_slots_are_walked_an_unset_slot_is_a_value_of_its_own():
    _spec, _leaves, paths = walked(Slotted(1, torch.ones(2)))
    assert paths == ["args[0]", "args[0].a", "args[0]._Slotted__hidden"]
    assert key_of(Slotted(1, torch.ones(2))) == key_of(Slotted(1, torch.ones(2)))
    other = Slotted(1, torch.ones(2))
    other.unset = 0
    assert key_of(other) != key_of(Slotted(1, torch.ones(2)))


def test_a_dataclass_that_is_not_frozen_is_an_object_and_a_frozen_one_inside_an_object_too():
    @dataclasses.dataclass(frozen=True)
    class Frozen:
        t: torch.Tensor

    spec, leaves, paths = walked(Mutable(torch.ones(2), 3), State(f=Frozen(torch.zeros(1))))
    assert paths == ["args[0]", "args[0].t", "args[0].n", "args[1]", "args[1].f.t"]
    assert unflatten(spec, leaves)[0][0] is leaves[0]


def test_an_nn_module_is_walked_by_its_parameters_buffers_and_submodules():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    _spec, leaves, paths = walked(model)
    named = dict(zip(paths, leaves))
    assert named["args[0][0].weight"] is model[0].weight and named["args[0][1].running_mean"] is model[1].running_mean
    assert named["args[0][0].in_features"] == 2 and named["args[0].training"] is True
    assert not any("state_dict" in path or "_non_persistent" in path for path in paths)
    fresh = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    assert key_of(model) == key_of(fresh)  # other weights, the same structure: one key
    assert key_of(model) != key_of(fresh.eval())  # training is a plain value of the key
    model._register_state_dict_hook(lambda *a: None)  # never run by a call: not in the key
    assert key_of(model) == key_of(torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3)))
    handle = model.register_forward_hook(lambda module, args, output: None)  # runs: keyed by identity
    assert key_of(model) != key_of(fresh.train())
    handle.remove()


def test_tensors_reached_twice_are_keyed_by_their_aliasing():
    t = torch.randn(4)
    tied, apart = State(a=t, b=t), State(a=torch.randn(4), b=torch.randn(4))
    assert key_of(tied) != key_of(apart)
    assert key_of(tied) == key_of(State(a=(u := torch.randn(4)), b=u))


def test_a_cycle_ends_in_a_reference():
    node = State(t=torch.ones(1))
    node.me = node
    node.children = [node]
    _spec, _leaves, paths = walked(node)
    assert paths == ["args[0]", "args[0].t"]
    assert key_of(node) != key_of(State(t=torch.ones(1), me=State(), children=[]))


def test_flat_calls_of_tensors_and_plain_constants_walk_nothing():
    x = torch.randn(2)
    spec, leaves, paths = walked(x, 1, 2.5, None, "s", torch.float32, dynamic(3))
    assert spec == (FLAT, 7) and len(spec) == 2
    assert region_key(0, spec, leaves, paths) == region_key(
        0, *flatten((x, 1, 2.5, None, "s", torch.float32, dynamic(3)), {})
    )


def test_without_walk_objects_an_object_is_a_leaf_the_key_refuses():
    spec, leaves, paths = flatten((State(t=1),), {})
    assert spec == (FLAT, 1)
    with pytest.raises(RefusedKey, match="an object compared by identity"):
        region_key(0, spec, leaves, paths)


# --- what the key holds ----------------------------------------------------------------------
def test_a_fresh_object_of_the_same_structure_has_the_same_key():
    def make():
        return State(kv=[torch.zeros(2, 3), torch.zeros(2, 3)], length=4, scale=0.5, name="cache", color=Color.RED)

    assert key_of(make()) == key_of(make())


def _float_bits(value):
    return struct.pack("<d", value)


@settings(max_examples=200, deadline=None)
@given(
    first=st.one_of(
        st.integers(-3, 3), st.floats(allow_nan=True), st.booleans(), st.none(), st.sampled_from(list(Color))
    ),
    second=st.one_of(
        st.integers(-3, 3), st.floats(allow_nan=True), st.booleans(), st.none(), st.sampled_from(list(Color))
    ),
)
def test_property_a_plain_value_shares_a_key_exactly_when_its_class_and_bits_agree(first, second):
    same = type(first) is type(second) and (
        _float_bits(first) == _float_bits(second) if isinstance(first, float) else first == second
    )
    assert (key_of(State(v=first)) == key_of(State(v=second))) is same


def test_changing_a_plain_value_or_the_structure_changes_the_key():
    base = key_of(State(n=1, t=torch.zeros(2)))
    assert key_of(State(n=2, t=torch.zeros(2))) != base
    assert key_of(State(n=1, t=torch.zeros(3))) != base  # shape-exact
    assert key_of(State(t=torch.zeros(2), n=1)) != base  # attribute order: another structure
    assert key_of(State(n=1, t=torch.zeros(2), extra=None)) != base
    assert key_of(State(n=1, t=None)) != base
    assert key_of(State(n=1, t=torch.zeros(2))) == base


def test_a_tensors_own_python_attributes_are_keyed_and_a_change_to_them_is_seen():
    tensor = torch.zeros(2)
    tensor.scale = 1.0  # what a region reading state.t.scale bakes, as it bakes state.scale
    state = State(t=tensor)
    spec, leaves, paths = walked(state)
    assert "args[0].t.scale" in paths
    base = region_key(0, spec, leaves, paths)
    before = objects.snapshot(spec, leaves, paths)
    tensor.scale = 2.0
    assert key_of(state) != base
    assert objects.first_change(before, objects.snapshot(spec, leaves, paths)) == "args[0].t.scale"
    tensor.scale = 1.0
    assert key_of(state) == base
    tensor.extra = None
    assert key_of(state) != base
    assert objects.first_change(before, objects.snapshot(spec, leaves, paths)) == "args[0].t.extra"
    tensor.itself, state.again = tensor, tensor  # reaching itself, met twice: references, as objects are
    spec, leaves, paths = walked(state)
    assert paths == ["args[0]", "args[0].t", "args[0].t.scale", "args[0].t.extra", "args[0].t.itself", "args[0].again"]


def test_classes_and_functions_held_as_attributes_are_keyed_by_identity():
    def f():
        return 1

    def g():
        return 1

    assert key_of(State(fn=f, cls=int)) == key_of(State(fn=f, cls=int))
    assert key_of(State(fn=f, cls=int)) != key_of(State(fn=g, cls=int))
    assert key_of(State(fn=f, cls=int)) != key_of(State(fn=f, cls=float))


def test_the_class_is_keyed():
    class Other(State):
        pass

    assert key_of(State(n=1)) != key_of(Other(n=1))


# --- refused, naming the path ----------------------------------------------------------------
REFUSED = {
    "a C extension object": (
        lambda: State(gen=torch.Generator()),
        r"args\[0\]\.gen is a .*Generator, an object of a C",
    ),
    "a functools.partial": (lambda: State(p=functools.partial(len)), r"args\[0\]\.p is a functools\.partial"),
    "a property-only object": (lambda: State(c=Computed()), r"args\[0\]\.c is a .*Computed that holds no state"),
    "a descriptor-only object": (lambda: State(c=Described()), r"args\[0\]\.c is a .*Described that holds no state"),
    "a __getattribute__ object": (lambda: State(c=Forwarding()), r"args\[0\]\.c is a .*Forwarding that holds no"),
    "a dynamic scalar inside": (lambda: State(pos=dynamic(3)), r"args\[0\]\.pos is a dynamic scalar inside an object"),
    "a tensor as a dict key": (lambda: State(d={torch.zeros(1): 1}), r"args\[0\]\.d key .* is a tensor inside"),
    "a tensor in a set": (lambda: State(s={1, 2}, f=frozenset({torch.zeros(1)})), r"args\[0\]\.f item"),
    "an equality of its own in a set": (lambda: State(s={_Loose(1)}), r"args\[0\]\.s item .* equality is its own"),
    "deep in a list": (lambda: State(layers=[State(), State(g=torch.Generator())]), r"args\[0\]\.layers\[1\]\.g "),
}


class _Loose:
    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, _Loose) and self.v == other.v

    def __hash__(self):
        return hash(self.v)


@pytest.mark.parametrize("name", REFUSED)
def test_what_cannot_be_walked_is_refused_naming_the_path(name):
    make, message = REFUSED[name]
    with pytest.raises(RefusedKey, match=message) as refused:
        key_of(make())
    assert refused.value.path.startswith("args[0].")


def test_a_generator_argument_itself_is_refused():
    with pytest.raises(RefusedKey, match=r"args\[1\] is a torch\._C\.Generator, an object of a C extension type"):
        key_of(torch.zeros(1), torch.Generator())


def test_the_bounds_refuse_naming_where_they_were_crossed(monkeypatch):
    deep = State()
    node = deep
    for _ in range(objects.MAX_DEPTH + 2):
        node.next = State()
        node = node.next
    with pytest.raises(RefusedKey, match=r"args\[0\](\.next)+ lies deeper than 32 levels") as refused:
        key_of(deep)
    assert refused.value.path.count(".next") == objects.MAX_DEPTH
    monkeypatch.setattr(objects, "MAX_LEAVES", 10)
    with pytest.raises(RefusedKey, match=r"args\[0\]\.values\[10\] holds more than 10 values"):
        key_of(State(values=list(range(20))))
    key_of(State(values=list(range(10))))  # at the bound: walked


# --- a Hugging Face StaticCache's shape (the stand-in; transformers' own below) ---------------
def _decode(cache, hidden, weights):
    with torch.no_grad():
        return attention_step(weights, cache, hidden)


def test_a_static_cache_is_keyed_by_structure_lazily_initialised_on_its_first_call():
    weights = attention_weights(2, 8)
    cache, hidden = StandInCache(2, 16), torch.randn(1, 1, 8)
    before = key_of(hidden, cache)
    _decode(cache, hidden, weights)
    after = key_of(hidden, cache)
    assert before != after  # the first call's lazy initialisation: another key
    _decode(cache, hidden, weights)
    assert key_of(hidden, cache) == after  # the steady state keeps its key
    fresh = StandInCache(2, 16)
    _decode(fresh, hidden, weights)
    assert key_of(hidden, fresh) == after  # a new cache per generation: the same key
    assert key_of(hidden, StandInCache(2, 32)) != before  # max_cache_len is a plain value of the key
    paths = walked(hidden, cache)[2]
    assert "args[1].layers[1].keys" in paths and "args[1].layers[0].cumulative_length" in paths


def test_a_steady_decode_step_changes_no_python_state_a_lazy_first_call_does():
    weights = attention_weights(2, 8)
    cache, hidden = StandInCache(2, 16), torch.randn(1, 1, 8)
    spec, leaves, paths = walked(hidden, cache)
    first = objects.snapshot(spec, leaves, paths)
    _decode(cache, hidden, weights)
    assert objects.first_change(first, objects.snapshot(spec, leaves, paths)) == "args[1].layers[0].keys"
    spec, leaves, paths = walked(hidden, cache)
    steady = objects.snapshot(spec, leaves, paths)
    for _ in range(3):
        _decode(cache, hidden, weights)  # in place: index_copy_, add_
        assert objects.first_change(steady, objects.snapshot(spec, leaves, paths)) is None


def test_a_python_side_effect_names_the_attribute():
    weights = attention_weights(2, 8)
    cache, hidden = CountingCache(2, 16), torch.randn(1, 1, 8)
    _decode(cache, hidden, weights)
    spec, leaves, paths = walked(hidden, cache)
    before = objects.snapshot(spec, leaves, paths)
    _decode(cache, hidden, weights)
    assert objects.first_change(before, objects.snapshot(spec, leaves, paths)) == "args[1].seen_tokens"


def test_a_tensor_attribute_replaced_or_given_other_memory_is_a_change():
    weights = attention_weights(1, 8)
    cache, hidden = StandInCache(1, 4), torch.randn(1, 1, 8)
    cache.layers[0] = GrowingLayer(4)  # transformers' DynamicLayer: torch.cat into the attribute
    _decode(cache, hidden, weights)
    spec, leaves, paths = walked(hidden, cache)
    before = objects.snapshot(spec, leaves, paths)
    _decode(cache, hidden, weights)
    assert objects.first_change(before, objects.snapshot(spec, leaves, paths)) == "args[1].layers[0].keys"
    layer = StandInCache(1, 4)
    _decode(layer, hidden, weights)
    spec, leaves, paths = walked(layer)
    before = objects.snapshot(spec, leaves, paths)
    layer.layers[0].values.data = torch.zeros_like(layer.layers[0].values)  # the same tensor, other memory
    assert objects.first_change(before, objects.snapshot(spec, leaves, paths)) == "args[0].layers[0].values"


CHANGES = {
    "an attribute set": (lambda s: setattr(s, "n", 2), "args[0].n"),
    "a float's sign": (lambda s: setattr(s, "f", -0.0), "args[0].f"),
    "an attribute added": (lambda s: setattr(s, "extra", 1), "args[0].extra"),
    "an attribute removed": (lambda s: delattr(s, "n"), "args[0].n"),
    "a list grown": (lambda s: s.items.append(3), "args[0].items"),
    "a list item set": (lambda s: s.items.__setitem__(1, 5), "args[0].items[1]"),
    "a dict key added": (lambda s: s.d.__setitem__("new", 1), "args[0].d['new']"),
    "a dict value set": (lambda s: s.d.__setitem__("k", 7), "args[0].d['k']"),
    "a nested attribute": (lambda s: setattr(s.inner, "m", "x"), "args[0].inner.m"),
    "made unwalkable": (lambda s: setattr(s.inner, "g", torch.Generator()), "args[0].inner.g"),
    "a tensor replaced": (lambda s: setattr(s, "t", torch.zeros(2)), "args[0].t"),
    "a tensor resized": (lambda s: s.t.resize_(3), "args[0].t"),
}


@pytest.mark.parametrize("name", CHANGES)
def test_first_change_names_the_first_thing_a_run_changed(name):
    change, path = CHANGES[name]
    state = State(n=1, f=0.0, items=[1, 2], d={"k": 1}, inner=State(m="m"), t=torch.zeros(2))
    spec, leaves, paths = walked(state)
    before = objects.snapshot(spec, leaves, paths)
    assert objects.first_change(before, objects.snapshot(spec, leaves, paths)) is None
    state.t.add_(1)  # written in place: what a graph replays
    assert objects.first_change(before, objects.snapshot(spec, leaves, paths)) is None
    change(state)
    assert objects.first_change(before, objects.snapshot(spec, leaves, paths)) == path


def test_a_call_without_objects_has_no_snapshot():
    assert objects.snapshot(*flatten((torch.zeros(1),), {})) is None
    assert objects.first_change(None, None) is None


# --- transformers' own StaticCache, where installed ------------------------------------------
def tiny_llama(transformers) -> tuple:
    """(model, config): a two-layer Llama with random weights (seed 0), on the CPU."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval(), config


def test_a_transformers_static_cache_keeps_its_key_and_its_python_state_through_decode_steps():
    transformers = pytest.importorskip("transformers")
    model, config = tiny_llama(transformers)

    def step(cache, position):
        ids = torch.tensor([[position % 64]])
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, cache_position=torch.tensor([position]), use_cache=True)

    cache = transformers.StaticCache(config=config, max_cache_len=16)
    step(cache, 0)
    spec, leaves, paths = walked(torch.zeros(1), cache)
    key = region_key(0, spec, leaves, paths)
    before = objects.snapshot(spec, leaves, paths)
    for position in range(1, 4):
        step(cache, position)
        assert objects.first_change(before, objects.snapshot(spec, leaves, paths)) is None
    assert region_key(0, *walked(torch.zeros(1), cache)) == key
    fresh = transformers.StaticCache(config=config, max_cache_len=16)
    step(fresh, 0)
    assert region_key(0, *walked(torch.zeros(1), fresh)) == key
    assert any(path.endswith(".layers[1].keys") for path in paths)
