"""Region keys: structure plus shape-exact leaf signatures; flatten and unflatten agree."""

from __future__ import annotations

import collections
import copy
import dataclasses
import decimal
import enum
import fractions
import functools
import itertools
import os
import struct
import time
import tracemalloc
import typing
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import jitcore
import replay
from replay import dynamic, objects, region_keys, value_keys
from replay.errors import RefusedKey
from replay.keying import describe_key
from replay.region_keys import FLAT, extent_bytes, flatten, leaf_key, plain_leaves, region_key, unflatten

Pair = collections.namedtuple("Pair", "a b")


def key_of(*args, **kwargs):
    spec, leaves, paths = flatten(args, kwargs)
    return region_key(0, spec, leaves, paths)


def test_flat_calls_take_the_short_path():
    x = torch.randn(3)
    spec, leaves, paths = flatten((x, 1, dynamic(2)), {})
    assert spec == (FLAT, 3) and leaves[0] is x and paths == ["args[0]", "args[1]", "args[2]"]
    assert unflatten(spec, leaves) == (tuple(leaves), {})


def test_flat_calls_share_the_paths_of_few_arguments_and_make_their_own_beyond():
    few = flatten((1, 2), {})[2]
    assert flatten((3, 4), {})[2] is few
    count = region_keys._FLAT_PATHS_KEPT
    many = flatten(tuple(range(count)), {})[2]
    assert many == [f"args[{i}]" for i in range(count)] and flatten(tuple(range(count)), {})[2] is not many
    assert count not in region_keys._FLAT_PATHS and len(region_keys._FLAT_PATHS) < count


def test_keys_hold_one_signature_object_for_equal_tensor_layouts():
    x = torch.zeros(4, 2)
    key = key_of([x, x.clone(), x.t()])
    first, second, transposed = key[region_keys.LEAVES_START :]
    assert first is second and first == leaf_key(x.clone(), "x") and transposed != first
    assert value_keys.tensor_signature(x) == jitcore.lean_static_signature(x)


def test_nested_round_trip():
    x, y = torch.randn(2), torch.randn(3)
    args = ([x, (y, 3)], {"kv": y, "n": 4}, Pair(x, 5))
    kwargs = {"flag": True, "cache": [y]}
    spec, leaves, paths = flatten(args, kwargs)
    assert len(leaves) == 9
    assert "args[1]['kv']" in paths and "cache[0]" in paths
    rebuilt_args, rebuilt_kwargs = unflatten(spec, leaves)
    assert isinstance(rebuilt_args[2], Pair)
    assert rebuilt_args[0][1][0] is y and rebuilt_kwargs["cache"][0] is y and rebuilt_kwargs["flag"] is True


def test_keys_are_shape_exact_and_stride_exact():
    x = torch.randn(4, 6)
    assert key_of(x) == key_of(torch.randn(4, 6))
    assert key_of(x) != key_of(torch.randn(4, 7))
    assert key_of(x) != key_of(torch.randn(6, 4).t())
    assert key_of(x) != key_of(x.double())
    assert key_of(x) != key_of([x])  # the structure is part of the key


def test_dynamic_scalars_by_type_constants_by_value():
    x = torch.randn(2)
    assert key_of(x, dynamic(3)) == key_of(x, dynamic(7))
    assert key_of(x, dynamic(3)) != key_of(x, dynamic(3.0))
    assert key_of(x, 3) != key_of(x, 4)
    assert key_of(x, 1) != key_of(x, True)
    assert plain_leaves([dynamic(3), 4]) == [3, 4]


def test_unhashable_leaves_are_a_clear_error():
    with pytest.raises(TypeError, match=r"args\[1\] is an unhashable set"):
        key_of(torch.randn(2), {1, 2})


def test_refused_tensors_are_refused_in_keys_too():
    import jitcore

    with pytest.raises(jitcore.UnsupportedTensorError):
        leaf_key(torch.randn(3, dtype=torch.complex64).conj(), "args[0]")


def test_extent():
    assert extent_bytes(torch.empty(4, 6)) == 96
    assert extent_bytes(torch.empty(4, 6)[:, :2]) == (3 * 6 + 1 + 1) * 4
    assert extent_bytes(torch.empty(1, 5).expand(3, 5)) == 20
    assert extent_bytes(torch.empty(0, 5)) == 0


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 4), min_size=0, max_size=4),
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.int64, torch.uint8]),
)
def test_extent_of_any_layout_is_one_past_its_furthest_element(sizes, data, dtype):
    # contiguous tensors take a shortcut (numel * element size); every layout must agree with
    # the furthest element any index reaches, found by brute force over every index
    strides = data.draw(st.lists(st.integers(0, 6), min_size=len(sizes), max_size=len(sizes)), label="strides")
    if data.draw(st.booleans(), label="contiguous"):
        tensor = torch.empty(sizes, dtype=dtype)
    else:
        tensor = torch.empty(200, dtype=dtype).as_strided(sizes, strides)
    if tensor.numel() == 0:
        expected = 0
    else:
        furthest = max(
            sum(i * s for i, s in zip(index, tensor.stride()))
            for index in itertools.product(*(range(n) for n in tensor.shape))
        )
        expected = (furthest + 1) * tensor.element_size()
    assert extent_bytes(tensor) == expected


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_alias_pattern_shortcut_equals_the_exact_ranges(data):
    # views of two storages, and a storage aliased by another (a DLPack re-export): the
    # shortcut for disjoint storages must never hide an overlap
    base, other = torch.arange(64.0), torch.arange(32.0)
    aliased = torch.from_dlpack(base[8:40])  # a second storage over part of base's bytes
    sources = [base, other, aliased]
    leaves = []
    for _ in range(data.draw(st.integers(2, 5))):
        source = sources[data.draw(st.integers(0, 2))]
        start = data.draw(st.integers(0, source.numel() - 1))
        stop = data.draw(st.integers(start, source.numel()))
        step = data.draw(st.integers(1, 3))
        leaves.append(source[start:stop:step])
    ranges = region_keys.tensor_ranges(leaves)
    pattern = region_keys.alias_pattern(leaves)
    assert pattern == region_keys.overlap_groups(ranges)
    assert region_keys.overlapping_pairs(pattern) == set(region_keys.pattern_of(ranges))


#: Small layouts: (leaf index, first byte, one past the last byte) of a few ranges over a few
#: bytes, so that two draws often overlap alike, and empty, touching, nested and equal ranges
#: are common.
_LAYOUT = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4)), min_size=0, max_size=7).map(
    lambda spans: [(i, lo, lo + size) for i, (lo, size) in enumerate(spans)]
)


@settings(max_examples=1000, deadline=None)
@given(first=_LAYOUT, second=_LAYOUT, order=st.randoms(use_true_random=False))
def test_overlap_groups_hold_the_overlapping_pairs_exactly(first, second, order):
    """The groups say which pairs overlap, as the pairwise definition does, whatever order
    the ranges come in; two layouts share their groups exactly where they share their pairs."""
    groups = region_keys.overlap_groups(first)
    assert region_keys.overlapping_pairs(groups) == set(region_keys.pattern_of(first))
    shuffled = list(first)
    order.shuffle(shuffled)
    assert region_keys.overlap_groups(shuffled) == groups
    for group in groups:  # each group shares a byte
        assert max(first[i][1] for i in group) < min(first[i][2] for i in group)
    same_pairs = region_keys.pattern_of(first) == region_keys.pattern_of(second)
    assert (groups == region_keys.overlap_groups(second)) == same_pairs


@settings(max_examples=1000, deadline=None)
@given(layout=_LAYOUT, kept=st.sets(st.integers(0, 6)))
def test_groups_restricted_to_some_leaves_are_the_groups_of_those_leaves_ranges(layout, kept):
    """A graph checks the aliasing of the tensors it takes as arguments only (an object's tensor
    keyed by its address is not one): the whole call's groups cut down to them must be exactly
    the groups those tensors' ranges make on their own."""
    whole = region_keys.overlap_groups(layout)
    own = region_keys.overlap_groups([span for span in layout if span[0] in kept])
    assert region_keys.restricted_groups(whole, kept) == own


def test_one_tensor_passed_many_times_is_keyed_and_checked_in_about_linear_time_and_memory():
    """N copies of one tensor (and views of it): one group of N, not N(N-1)/2 pairs."""
    x = torch.zeros(64)
    leaves = [x] * 2000 + [x[:8], x[56:]]
    seconds = []
    for _ in range(3):  # (the least of three: a loaded machine's pauses are not the key's)
        started = time.perf_counter()
        region_keys.alias_pattern(leaves)
        key_of(leaves)
        seconds.append(time.perf_counter() - started)
    tracemalloc.start()
    try:
        pattern = region_keys.alias_pattern(leaves)
        key = key_of(leaves)
        kept, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert min(seconds) < 0.2, seconds
    assert kept < 2**20  # the key holds one signature per leaf and a group of 2000 indices
    assert pattern == (tuple(range(2001)), (*range(2000), 2001))
    assert key[3] == pattern


def test_the_groups_of_an_overlapping_staircase_are_its_maximal_cliques():
    # each range overlaps the next two: groups of three, one per position
    ranges = [(i, 2 * i, 2 * i + 5) for i in range(6)]
    assert region_keys.overlap_groups(ranges) == ((0, 1, 2), (1, 2, 3), (2, 3, 4), (3, 4, 5))
    assert region_keys.overlap_groups([(0, 0, 4), (1, 4, 8), (2, 8, 8)]) == ()  # touching, empty


_SPAN = st.tuples(st.integers(0, 200), st.integers(0, 40)).map(lambda t: (t[0], t[0] + t[1]))


@settings(max_examples=300, deadline=None)
@given(spans=st.lists(_SPAN, max_size=12), asked=_SPAN)
def test_merged_ranges_answer_as_a_walk_over_every_range_would(spans, asked):
    # overlapping, touching, nested, empty and repeated spans, in any order
    lo, hi = asked
    walk = any(a < b and lo < hi and lo < b and a < hi for a, b in spans)
    assert region_keys.MergedRanges(spans).overlaps(lo, hi) == walk


# --- constants: keyed by their exact class and value (floats by bits), or refused ------------
@dataclasses.dataclass(frozen=True)
class Cfg:
    n: object


class NT(typing.NamedTuple):
    a: object


class Color(enum.Enum):
    RED = 1


class Sampling:  # compared by identity (object.__hash__): a mutable holder of values
    def __init__(self, temperature):
        self.temperature = temperature


class Loose:  # equality of its own: not known to be exact
    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, Loose) and self.v == other.v

    def __hash__(self):
        return hash(self.v)


_X = torch.zeros(2)

#: Pairs the old keys (a type name and ==) merged, each of which a graph bakes differently.
COLLIDING_PAIRS = {
    "frozen dataclass field 4 vs 4.0": (Cfg(4), Cfg(4.0)),
    "frozen dataclass field True vs 1": (Cfg(True), Cfg(1)),
    "frozen dataclass field 0.0 vs -0.0": (Cfg(0.0), Cfg(-0.0)),
    "dict key 1 vs 1.0": ({1: _X}, {1.0: _X}),
    "dict key 1 vs True": ({1: _X}, {True: _X}),
    "dict key 0.0 vs -0.0": ({0.0: _X}, {-0.0: _X}),
    "frozenset {0.0} vs {-0.0}": (frozenset({0.0}), frozenset({-0.0})),
    "frozenset {1} vs {True}": (frozenset({1}), frozenset({True})),
    "True vs np.True_": (True, np.True_),
    "np.complex64 0 vs -0": (np.complex64(0), np.complex64(complex(-0.0, 0))),
    "np.float16 0 vs -0": (np.float16(0.0), np.float16(-0.0)),
    "np.int64(1) vs np.int32(1)": (np.int64(1), np.int32(1)),
    "datetime64 units": (np.datetime64(1, "D"), np.datetime64(1, "s")),
    "range(0) vs range(2, 2)": (range(0), range(2, 2)),
    "Decimal 1.0 vs 1.00": (decimal.Decimal("1.0"), decimal.Decimal("1.00")),
    "Fraction 1/2 vs 0.5": (fractions.Fraction(1, 2), 0.5),
    "torch.Size([2]) vs (2,)": (torch.Size([2]), (2,)),
    "named tuple 2 vs 2.0": (NT(2), NT(2.0)),
    "tuple in a frozenset (1,) vs (1.0,)": (frozenset({(1,)}), frozenset({(1.0,)})),
}


@pytest.mark.parametrize("name", COLLIDING_PAIRS)
def test_constants_that_differ_in_type_or_bits_get_keys_of_their_own(name):
    first, second = COLLIDING_PAIRS[name]
    assert key_of(_X, first) != key_of(_X, second)
    assert key_of(_X, first) == key_of(_X, first) and hash(key_of(_X, second)) == hash(key_of(_X, second))


def test_dynamic_scalars_are_keyed_by_their_type_object():
    assert key_of(_X, dynamic(True)) != key_of(_X, dynamic(np.True_))
    assert key_of(_X, dynamic(np.float32(1))) != key_of(_X, dynamic(np.float64(1)))
    assert key_of(_X, dynamic(np.float32(1))) == key_of(_X, dynamic(np.float32(2)))


def _exact(value):
    """What a graph bakes of a constant, written out plainly (the test's own reference): its
    class and, for floats and complex numbers anywhere, their bits."""
    if isinstance(value, float) and type(value) is float:
        return (float, struct.pack("<d", value))
    if type(value) is complex:
        return (complex, struct.pack("<dd", value.real, value.imag))
    if isinstance(value, np.generic):
        return (type(value), value.dtype.str, value.tobytes())
    if type(value) in (tuple, frozenset) or isinstance(value, NT):
        return (type(value), tuple(_exact(v) for v in value))
    if isinstance(value, Cfg):
        return (Cfg, _exact(value.n))
    return (type(value), value)


_NAN_PAYLOADS = [struct.unpack("<d", struct.pack("<Q", bits))[0] for bits in (0x7FF8000000000000, 0x7FF8000000000001)]
_SCALARS = st.sampled_from(
    [0, 1, -1, True, False, 0.0, -0.0, 1.0, *_NAN_PAYLOADS, float("inf"), 0j, complex(-0.0, 0.0), 1 + 0j]
    + [np.bool_(True), np.bool_(False), np.int64(1), np.int32(1), np.float32(0.0), np.float32(-0.0)]
    + [np.float64(1.0), np.float16(-0.0), np.complex64(0), np.complex64(complex(-0.0, 0)), "1", b"1", None]
)
_CONSTANTS = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.tuples(inner),
        st.tuples(inner, inner),
        st.frozensets(inner, max_size=1),  # one element: its iteration order is the only one
        inner.map(Cfg),
        inner.map(NT),
    ),
    max_leaves=4,
)
#: Where a constant may sit in a call: each place is walked or keyed element by element.
_PLACES = {
    "argument": lambda c: (c,),
    "inside a tuple": lambda c: ((c, 1),),
    "dict key": lambda c: ({c: _X},),
    "frozen dataclass field": lambda c: (Cfg(c),),
    "named tuple field": lambda c: (NT(c),),
    "keyword": lambda c: ((), {"flag": c}),
}


def _call_key(place, constant):
    made = _PLACES[place](constant)
    args, kwargs = (made[0], made[1]) if len(made) == 2 else (made, {})
    return key_of(_X, *args, **kwargs)


@settings(max_examples=400, deadline=None)
@given(first=_CONSTANTS, second=_CONSTANTS, place=st.sampled_from(sorted(_PLACES)))
def test_property_two_constants_share_a_key_exactly_when_their_types_and_bits_agree(first, second, place):
    """Any two constants that differ in class (anywhere inside) or in a float's bits get
    different keys, wherever they sit in the call; equal ones (distinct objects too) the same."""
    try:
        hash(first), hash(second)
    except TypeError:
        return  # a frozenset of a NaN and another value: not this test's subject
    assert (_call_key(place, first) == _call_key(place, second)) == (_exact(first) == _exact(second))
    rebuilt = copy.deepcopy(first)  # equal, other objects
    assert _call_key(place, rebuilt) == _call_key(place, first)


ALLOWED_CONSTANTS = {
    "a class": torch.nn.Linear,
    "a function": torch.nn.functional.relu,
    "a builtin": len,
    "a torch function": torch.relu,
    "a bound builtin of a string": "ab".upper,
    "a classmethod": dict.fromkeys,
    "a method descriptor": str.upper,
    "a ufunc": np.add,
    "a module": np,
    "an enum member": Color.RED,
    "a dtype": torch.float16,
    "a device": torch.device("cpu"),
    "a layout": torch.strided,
    "a memory format": torch.channels_last,
    "a numpy dtype": np.dtype("float32"),
    "None": None,
    "Ellipsis": ...,
    "bytes": b"x",
    "a Fraction": fractions.Fraction(1, 3),
    "a frozen dataclass of allowed values": Cfg((1, "a", torch.float32)),
    "a named tuple of allowed values": NT(Color.RED),
}


@pytest.mark.parametrize("name", ALLOWED_CONSTANTS)
def test_constants_that_hold_no_state_are_keyed(name):
    value = ALLOWED_CONSTANTS[name]
    assert key_of(_X, value) == key_of(_X, value)


REFUSED_ARGUMENTS = {
    "an object compared by identity": ((Sampling(1.0),), r"args\[1\] is a .*Sampling, an object compared by identity"),
    "the same, in a frozen dataclass": ((Cfg(Sampling(1.0)),), r"args\[1\]\.n is a .*Sampling"),
    "the same, in a named tuple": ((NT(Sampling(1.0)),), r"args\[1\]\[0\] is a .*Sampling"),
    "an nn.Module": ((torch.nn.Linear(2, 2),), r"args\[1\] is an nn.Module .*close over the module"),
    "a torch.Generator": ((torch.Generator(),), r"args\[1\] is a torch\._C\.Generator"),
    "a functools.partial": ((functools.partial(len),), r"args\[1\] is a functools\.partial"),
    "a bound method of a mutable object": ((Sampling(1.0).__init__,), r"args\[1\]\.__self__ is a .*Sampling"),
    "a tensor's bound method": ((torch.zeros(2).add,), r"args\[1\]\.__self__ is a tensor inside a constant"),
    "an equality of its own": ((Loose(1),), r"args\[1\] is a .*Loose, a constant whose equality is its own"),
    "a tensor as a dict key": (({torch.zeros(1): 1},), r"args\[1\] key .* is a tensor inside a constant"),
}


@pytest.mark.parametrize("name", REFUSED_ARGUMENTS)
def test_arguments_a_graph_would_bake_without_seeing_them_change_are_refused_naming_the_path(name):
    args, message = REFUSED_ARGUMENTS[name]
    with pytest.raises(RefusedKey, match=message) as refused:
        key_of(_X, *args)
    assert refused.value.path is not None and refused.value.path.startswith("args[")


def test_a_mutated_object_argument_never_keeps_its_key():
    """The finding's loop: params.temperature changed between calls. Refused, never the same key."""
    params = Sampling(1.0)
    with pytest.raises(RefusedKey, match="pass the values themselves|Pass the values themselves"):
        key_of(_X, params)
    assert key_of(_X, params.temperature) != key_of(_X, 0.5)  # what the message advises: keyed by value


def test_unhashable_dataclasses_say_to_freeze_them():
    @dataclasses.dataclass
    class Mutable:
        n: int

    with pytest.raises(TypeError, match=r"args\[1\] is an unhashable .*Mutable .*frozen=True"):
        key_of(_X, Mutable(1))


# --- containers: every kind flatten walks comes back as its own class ------------------------
class ModelOutput(collections.OrderedDict):  # transformers' pattern: keys as properties
    @property
    def logits(self):
        return self["logits"]


class Tagged(tuple):
    pass


class Items(list):
    pass


@dataclasses.dataclass(frozen=True)
class Batch:
    ids: torch.Tensor
    n: int


def _containers():
    t = torch.arange(6.0).reshape(2, 3)
    counts = collections.defaultdict(list, {"a": t})
    return {
        "tuple": (t, 1),
        "list": [t, 2.5],
        "dict": {"k": t, 3: None},
        "named tuple": Pair(t, 1),
        "typing.NamedTuple": NT(t),
        "torch.Size": t.shape,
        "empty torch.Size": torch.Size([]),
        "topk (structseq)": torch.topk(t.flatten(), 2),
        "max (structseq)": torch.max(t, 1),
        "sort (structseq)": torch.sort(t, 1),
        "OrderedDict": collections.OrderedDict([("b", t), ("a", 1)]),
        "defaultdict": counts,
        "frozen dataclass": Batch(t, 3),
        "nested": {"out": [Pair(torch.topk(t.flatten(), 1), t.shape)], "od": collections.OrderedDict(x=(t,))},
    }


def _same(a, b):
    """Equal, of the same class at every level (a defaultdict with the same factory)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a is b
    elif isinstance(a, dict):
        assert list(a) == list(b) and getattr(a, "default_factory", None) is getattr(b, "default_factory", None)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a == b


@pytest.mark.parametrize("name", list(_containers()))
@pytest.mark.parametrize("side", ["argument", "output"])
def test_every_container_kind_round_trips_as_its_own_class(name, side):
    value = _containers()[name]
    spec, leaves, _ = flatten((value,), {}, walk_dataclasses=side == "output")
    _same(unflatten(spec, leaves)[0][0], value)
    if side == "argument":
        assert key_of(value) == key_of(_containers()[name])  # equal containers, other objects: one key


@pytest.mark.parametrize("name", ["named tuple", "torch.Size", "topk (structseq)", "OrderedDict", "nested"])
def test_a_graphs_replay_rebuilds_every_container_kind(name):
    """The generated replay function (graph.py) calls a spec's kind: the same classes come back."""
    from replay.rebinding import Plan
    from tests.replay.test_graph import build

    value = _containers()[name]
    x = torch.randn(4)
    named = [leaf for leaf in flatten((value,), {}, walk_dataclasses=True)[1] if isinstance(leaf, torch.Tensor)]
    graph, _ = build([x], Plan(), outputs=value, held=named)  # tensors it reaches by name: returned themselves
    _same(graph.replay(x), value)


REFUSED_CONTAINERS = {
    "a dict subclass (ModelOutput-like)": (ModelOutput(logits=_X), r"args\[0\] is a .*ModelOutput \(a dict subclass\)"),
    "a list subclass": (Items([_X]), r"args\[0\] is a .*Items \(a list subclass\)"),
    "a tuple subclass": (Tagged((_X,)), r"args\[0\] is a .*Tagged, a tuple subclass that cannot be rebuilt"),
    "a structseq with hidden fields": (os.stat("."), r"args\[0\] is a stat_result, a structseq with fields"),
    "a dict subclass inside a list": ([ModelOutput(logits=_X)], r"args\[0\]\[0\] is a .*ModelOutput"),
}


@pytest.mark.parametrize("name", REFUSED_CONTAINERS)
@pytest.mark.parametrize("side", ["argument", "output"])
def test_containers_that_cannot_be_rebuilt_exactly_are_a_clear_error(name, side):
    value, message = REFUSED_CONTAINERS[name]
    with pytest.raises(TypeError, match=message):
        flatten((value,), {}, walk_dataclasses=side == "output")


@pytest.mark.parametrize(
    "value",
    [{_X: 1}, {(1, _X): 1}, collections.OrderedDict([(frozenset([_X]), 1)]), [{"a": {_X: 2}}]],
    ids=["a tensor", "in a tuple", "in a frozenset of an OrderedDict", "nested"],
)
def test_a_returned_dict_keyed_by_a_tensor_is_a_clear_error(value):
    """A replay returns an output dict's keys as recorded: a tensor key would be the recording's
    object at every replay, where eager returns the call's."""
    with pytest.raises(TypeError, match=r"args\[0\].* is a dict keyed by a tensor"):
        flatten((value,), {}, walk_dataclasses=True)
    assert flatten(({"a": _X, (1, "b"): 2},), {}, walk_dataclasses=True)[1] == [_X, 2]  # constants: as recorded


def test_frozen_dataclasses_holding_tensors_make_their_tensors_leaves():
    """A fresh Batch every step: one key per shape (its tensors rebound like any argument),
    not a key per object; its other fields are constants of the key."""
    x = torch.zeros(4)
    first, second = Batch(torch.ones(4), 1), Batch(torch.ones(4), 1)
    spec, leaves, paths = flatten((x, first), {})
    assert leaves[1] is first.ids and paths == ["args[0]", "args[1].ids", "args[1].n"]
    assert key_of(x, first) == key_of(x, second)
    assert key_of(x, first) != key_of(x, Batch(torch.ones(5), 1)) != key_of(x, Batch(torch.ones(4), 1.0))
    rebuilt = unflatten(spec, leaves)[0][1]
    assert type(rebuilt) is Batch and rebuilt.ids is first.ids and rebuilt.n == 1


def test_a_dataclass_that_is_not_frozen_is_not_walked():
    @dataclasses.dataclass(eq=False)
    class State:  # hashable by identity: the region may write it, a rebuilt copy would take the writes
        t: torch.Tensor

    with pytest.raises(RefusedKey, match=r"args\[1\] is a .*State, an object compared by identity"):
        key_of(_X, State(torch.ones(2)))


# --- through the session (the tests' double): arguments reach the region as given ------------
@pytest.fixture
def double():
    from jitcore.backends import use_backend
    from jitcore.backends.null import NullBackend
    from tests.replay import test_session as ts

    with use_backend(NullBackend()):
        session = ts.DoubleSession(record_after=1, record_budget=1)
        ts.DoubleSession.current = session
        yield session


def test_torch_size_defaultdict_and_batch_arguments_run_and_replay(double):
    def step(x, size, counts, batch):
        return x.new_zeros(size) + len(counts["missing"]) + batch.ids.sum() + batch.n

    region = double.region(step)
    for _ in range(4):
        batch = Batch(torch.ones(3), 2)  # fresh every call: one key, rebound
        got = region(torch.zeros(2), torch.Size([2, 3]), collections.defaultdict(list), batch)
        assert torch.equal(got, torch.full((2, 3), 5.0))
    assert double.stats().replays >= 2


class BakingGraph:
    """A graph double that bakes what a capture bakes: each leaf that is not a tensor or a
    dynamic scalar keeps (a deep copy of) its value at recording."""

    @staticmethod
    def make(base):
        class Baking(base):
            def __init__(self, region, key, capture, spec, leaves, paths, session, number):
                super().__init__(region, key, capture, spec, leaves, paths, session, number)
                self.baked = [
                    leaf if isinstance(leaf, (torch.Tensor, region_keys.Dynamic)) else copy.deepcopy(leaf)
                    for leaf in leaves
                ]

            def replay(self, *leaves):
                self.replays += 1
                self.session.counters.replays += 1
                live = (torch.Tensor, region_keys.Dynamic)  # (an object: the caller's, its values keyed)
                now = [n if isinstance(n, live) or b is objects.BAKED else b for n, b in zip(leaves, self.baked)]
                args, kwargs = region_keys.unflatten(self.key[1], region_keys.plain_leaves(now))
                return self.region.fn(*args, **kwargs)

        return Baking


def test_a_mutated_object_argument_is_never_served_by_a_stale_graph(double):
    """The finding's loop: the graph recorded at temperature 1.0 must not serve 0.5. The
    object is walked: its temperature is a plain value of the key, so 0.5 is another key."""
    double.build_graph = BakingGraph.make(type(double).build_graph)

    def step(logits, params):
        return logits / params.temperature

    region = double.region(step)
    params, logits = Sampling(1.0), torch.full((4,), 2.0)
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for temperature in (1.0, 1.0, 1.0, 0.5, 0.5):
            params.temperature = temperature
            results.append(region(logits, params).tolist())
    assert results == [[2.0] * 4] * 3 + [[4.0] * 4] * 2, "a stale graph served the call"
    assert double.stats().replays >= 1 and not [w for w in caught if issubclass(w.category, replay.ReplayWarning)]


class Computed:  # what it shows its class computes: no state of its own a key can see
    current = 1.0

    @property
    def temperature(self):
        return Computed.current


def test_a_refused_argument_runs_eagerly_with_one_warning(double):
    def step(logits, params):
        return logits / params.temperature

    region = double.region(step)
    params, logits = Computed(), torch.full((4,), 2.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for temperature in (1.0, 1.0, 1.0, 0.5, 0.25):
            Computed.current = temperature
            assert region(logits, params).tolist() == [2.0 / temperature] * 4
    refusals = [w for w in caught if issubclass(w.category, replay.ReplayWarning) and "args[1]" in str(w.message)]
    assert len(refusals) == 1 and double.stats().replays == 0


def test_a_requires_grad_key_is_its_own_and_its_exact_key_without_one():
    x, w = torch.ones(4), torch.ones(4, requires_grad=True)
    spec, leaves, paths = flatten((x, 3), {})
    assert region_keys.region_key(-1, spec, leaves, paths) == region_keys.exact_key(-1, spec, leaves, paths)
    spec, grad_leaves, paths = flatten((w, 3), {})
    key = region_keys.region_key(-1, spec, grad_leaves, paths)
    assert key != region_keys.region_key(-1, spec, leaves, paths)
    assert key[:-1] == region_keys.exact_key(-1, spec, grad_leaves, paths)
    assert region_keys.grad_leaves(key) == (0,) and region_keys.grad_leaves(key[:-1]) == ()
    assert "requiring grad" in describe_key(key)
