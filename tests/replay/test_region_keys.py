"""Region keys: structure plus shape-exact leaf signatures; flatten and unflatten agree."""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay import dynamic, region_keys
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
    assert region_keys.alias_pattern(leaves) == region_keys.pattern_of(region_keys.tensor_ranges(leaves))
