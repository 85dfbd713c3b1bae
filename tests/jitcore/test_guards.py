"""The one guard generator (jitcore.guards.make_guard) behind @jit's and replay's fast paths."""

from __future__ import annotations

import linecache
import math
import struct

import numpy as np
import pytest
import torch

import jitcore as jc
from jitcore import guards
from jitcore.guards import ArgumentCheck, make_guard

GUARDS = jc.tensor_guard([torch.zeros(1)], [[1]], [[1]]) is not None
needs_guards = pytest.mark.skipif(not GUARDS, reason="torch has no C++ tensor guard evaluator")


class Device:
    """A current-device reader the test can switch."""

    def __init__(self, index: int = 0) -> None:
        self.index = index

    def __call__(self) -> int:
        return self.index


class Box:
    def __init__(self, value: object) -> None:
        self.value = value


def bits(value: float) -> bytes:
    return struct.pack("<d", value)


def test_class_and_value_checks_are_exact():
    guard = make_guard(
        [ArgumentCheck.of_class(float), ArgumentCheck.equal(3), ArgumentCheck.equal("s")],
        device=0,
        current_device=Device(),
        description="test guard",
    )
    assert guard(1.5, 3, "s") and guard(-2.0, 3, "s")
    assert not guard(1, 3, "s")  # an int is not a float
    assert not guard(np.float64(1.5), 3, "s")  # nor is a subclass
    assert not guard(1.5, 4, "s") and not guard(1.5, True, "s") and not guard(1.5, 3.0, "s")
    assert not guard(1.5, 3, "t")


def test_floats_through_their_bits():
    check = ArgumentCheck.equal_through
    guard = make_guard(
        [check(0.0, bits), check(math.nan, bits)], device=0, current_device=Device(), description="test guard"
    )
    assert guard(0.0, math.nan)
    assert not guard(-0.0, math.nan)  # == would say yes
    assert not guard(0.0, 0.0)


def test_an_attributes_class():
    guard = make_guard(
        [ArgumentCheck.wrapping(Box, "value", int)], device=0, current_device=Device(), description="test guard"
    )
    assert guard(Box(1)) and guard(Box(7))
    assert not guard(Box(1.0)) and not guard(Box(True)) and not guard(1)
    with pytest.raises(ValueError):
        ArgumentCheck.wrapping(Box, "value.x", int)


def test_the_device_is_checked_last():
    device = Device(1)
    guard = make_guard([ArgumentCheck.of_class(int)], device=1, current_device=device, description="test guard")
    assert guard(5)
    device.index = 0
    assert not guard(5)


def test_positional_and_packed_signatures():
    checks = [ArgumentCheck.of_class(int), ArgumentCheck.of_class(str)]
    positional = make_guard(checks, device=0, current_device=Device(), description="test guard")
    packed = make_guard(checks, device=0, current_device=Device(), description="test guard", packed=True)
    assert positional.source.startswith("def guard(_a0, _a1):")
    assert positional(1, "a") and packed(1, "a")
    assert not packed(1) and not packed(1, "a", 2)  # the arity check, not a TypeError
    with pytest.raises(TypeError):
        positional(1)
    one = make_guard(checks[:1], device=0, current_device=Device(), description="test guard", packed=True)
    assert one(1) and not one("a") and not one()
    none = make_guard([], device=0, current_device=Device(), description="test guard", packed=True)
    assert none() and not none(1)
    assert make_guard([], device=0, current_device=Device(), description="test guard")()


def test_source_goes_through_codegen():
    guard = make_guard([ArgumentCheck.equal(2)], device=0, current_device=Device(), description="test guard")
    filename = guard.__code__.co_filename
    assert filename.startswith("<jitcore test guard")
    assert "".join(linecache.getlines(filename)) == guard.source
    assert "_a0 == _v0" in guard.source  # values reach it by name, not by repr


def test_the_tests_run_in_the_generated_order_and_the_first_no_ends_it(monkeypatch):
    """Class, value and attribute tests in argument order, then the nested screen, then each
    evaluator, then the device; a test that says no ends the guard, one that raises raises."""
    log = []

    def evaluator(*tensors):
        log.append(("evaluator", len(tensors)))
        return evaluator.answer

    evaluator.answer = True
    monkeypatch.setattr(guards, "_raw_tensor_guard", lambda examples, sizes, strides: (evaluator, False))

    def through(value):
        log.append(("through", value))
        if value == "boom":
            raise KeyError("boom")
        return value

    def device():
        log.append(("device",))
        return device.index

    device.index = 0
    x = torch.zeros(2)
    guard = make_guard(
        [ArgumentCheck.tensor(x, [2], [1]), ArgumentCheck.equal_through("a", through), ArgumentCheck.of_class(int)],
        device=0,
        current_device=device,
        description="test guard",
    )
    log.clear()  # equal_through read the example
    assert guard(x, "a", 1) and log == [("through", "a"), ("evaluator", 1), ("device",)]
    log.clear()
    assert not guard(x, "a", 1.0) and log == [("through", "a")]  # the class test of the last argument
    log.clear()
    assert not guard(x, "b", 1) and log == [("through", "b")]
    log.clear()
    with pytest.raises(KeyError):
        guard(x, "boom", 1)
    log.clear()
    evaluator.answer = False
    assert not guard(x, "a", 1) and log == [("through", "a"), ("evaluator", 1)]
    log.clear()
    evaluator.answer = True
    device.index = 1
    assert not guard(x, "a", 1) and log[-1] == ("device",)
    log.clear()
    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    assert not guard(nested, "a", 1) and ("evaluator", 1) not in log  # screened before the evaluator


def test_the_nested_tensor_screen_goes_through_codegen():
    check = guards._screened(lambda *tensors: True, 2)
    filename = check.__code__.co_filename
    assert filename.startswith("<jitcore screen of a tensor guard of 2 tensors")
    assert "".join(linecache.getlines(filename)).startswith("def check(t0, t1, /):")
    assert check(torch.zeros(1), torch.zeros(2)) and not check(torch.zeros(1), 3)
    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    assert not check(torch.zeros(1), nested)


@needs_guards
def test_tensors_by_the_c_plus_plus_guard():
    x = torch.randn(4, 6)
    static = ArgumentCheck.tensor(x, [4, 6], [6, 1])
    dynamic = ArgumentCheck.tensor(x, [None, None], [None, 1])
    guard = make_guard([static, dynamic], device=0, current_device=Device(), description="test guard")
    assert guard(x, x)  # one tensor as two arguments: one C++ guard each
    assert guard(torch.randn(4, 6), torch.randn(9, 3))
    assert not guard(torch.randn(4, 7), x)  # a static size
    assert not guard(x, torch.randn(6, 4).t())  # the unit stride
    assert not guard(x, x.double()) and not guard(x, x.to(torch.float16))
    assert not guard(torch.nn.Parameter(x), x)  # class exactly torch.Tensor
    assert not guard(torch._neg_view(x), x)
    assert not guard(x, 1.0)
    assert "_tensor_guard0(_a0)" in guard.source and "_tensor_guard1(_a1)" in guard.source


@needs_guards
def test_distinct_tensors_share_one_c_plus_plus_call():
    x, y = torch.randn(4, 6), torch.randn(5)
    guard = make_guard(
        [ArgumentCheck.tensor(x, [None, 6], [6, 1]), ArgumentCheck.of_class(int), ArgumentCheck.tensor(y, [5], [1])],
        device=0,
        current_device=Device(),
        description="test guard",
    )
    assert "_tensor_guard0(_a0, _a2)" in guard.source and "_tensor_guard1" not in guard.source
    assert guard(x, 1, y) and guard(torch.randn(9, 6), 2, torch.randn(5))
    assert guard(x, 1, x[0, :5])  # a view of another argument is a distinct tensor
    assert not guard(x, 1, torch.randn(6)) and not guard(torch.randn(4, 7), 1, y)
    assert not guard(x, 1, y.double()) and not guard(x, 1.0, y)
    # one tensor as two arguments: the evaluator says no (the call takes the key path)
    z = torch.randn(5)
    same = make_guard(
        [ArgumentCheck.tensor(z, [5], [1]), ArgumentCheck.tensor(y, [5], [1])],
        device=0,
        current_device=Device(),
        description="test guard",
    )
    assert same(z, y) and not same(z, z)
    # nested tensors never reach the evaluator (it would abort the process)
    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    assert not guard(nested, 1, y) and not guard(x, 1, nested)


@needs_guards
def test_class_checks_come_before_the_tensor_guards():
    x = torch.randn(3)
    guard = make_guard(
        [ArgumentCheck.tensor(x, [3], [1]), ArgumentCheck.of_class(int)],
        device=0,
        current_device=Device(),
        description="test guard",
    )
    body = guard.source.split("return ", 1)[1]
    assert body.index("_a1.__class__") < body.index("_tensor_guard0(") < body.index("_device()")


def test_no_guard_where_torch_cannot_guard_a_tensor():
    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    check = ArgumentCheck.tensor(nested, [None, None], [None, None])
    assert make_guard([check], device=0, current_device=Device(), description="test guard") is None
