"""The key of one value (replay.value_keys): what the key of a call and the walk of objects both
stand on. The keys of whole calls are tested in test_region_keys.py."""

from __future__ import annotations

import collections
import dataclasses
import enum
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from replay import dynamic, value_keys
from replay.errors import RefusedKey

Pair = collections.namedtuple("Pair", "a b")


class Colour(enum.Enum):
    RED = 1


@dataclasses.dataclass(frozen=True)
class Frozen:
    scale: float
    name: str


@given(st.floats(allow_nan=True), st.floats(allow_nan=True))
def test_two_floats_share_a_key_exactly_where_their_bits_agree(a, b):
    same_bits = value_keys.float_bits(a) == value_keys.float_bits(b)
    assert (value_keys.constant_key(a, "x") == value_keys.constant_key(b, "x")) == same_bits
    assert (value_keys.leaf_key(a, "x") == value_keys.leaf_key(b, "x")) == same_bits


def test_equal_values_of_other_classes_or_bits_get_keys_of_their_own():
    keys = [value_keys.constant_key(v, "x") for v in (1, 1.0, True, np.int64(1), 0.0, -0.0, math.nan)]
    assert len(set(keys)) == len(keys)
    assert value_keys.constant_key((1, 2.5), "x") == value_keys.constant_key((1, 2.5), "x")
    assert value_keys.constant_key(Colour.RED, "x") == (Colour, Colour.RED)
    assert value_keys.constant_key(Frozen(1.0, "a"), "x") != value_keys.constant_key(Frozen(-0.0, "a"), "x")


def test_a_dynamic_scalar_is_keyed_by_its_type_and_a_tensor_by_one_shared_signature():
    assert value_keys.leaf_key(dynamic(3), "x") == value_keys.leaf_key(dynamic(4), "x")
    assert value_keys.leaf_key(dynamic(3), "x") != value_keys.leaf_key(dynamic(3.0), "x")
    first, second = torch.zeros(2, 3), torch.ones(2, 3)
    assert value_keys.leaf_key(first, "x") is value_keys.leaf_key(second, "x")  # one object, shared by keys
    assert value_keys.leaf_key(first, "x") != value_keys.leaf_key(first.t(), "x")


def test_what_a_graph_would_bake_unseen_is_refused_naming_its_path():
    with pytest.raises(RefusedKey, match=r"args\[0\]\[1\] is a tensor inside a constant"):
        value_keys.constant_key((1, torch.zeros(1)), "args[0]")
    with pytest.raises(RefusedKey, match="an object compared by identity"):
        value_keys.constant_key(object(), "args[2]")
    with pytest.raises(TypeError, match="unhashable"):
        value_keys.constant_key([1], "args[1]")


def test_the_kinds_of_tuples_rebuild_what_they_were_given():
    for value in (Pair(1, 2), torch.Size([2, 3]), torch.tensor([3.0, 1.0]).topk(1)):
        kind = value_keys.tuple_kind(value, type(value), "x")
        rebuilt = kind(*value)
        assert type(rebuilt) is type(value) and tuple(rebuilt) == tuple(value)

    class Plain(tuple):
        pass

    with pytest.raises(TypeError, match="cannot be rebuilt"):
        value_keys.tuple_kind(Plain((1,)), Plain, "x")
    assert value_keys.field_names(Frozen) == ("scale", "name")
