"""Symbolic values compute exactly what Python computes on the call's values.

The simplifications of :func:`jitcore.symbolic._binary` (``x * 1 -> x``, ``x + 0 -> x``, ...)
keep generated code readable; each must give, for every value the leaf can hold, the value
*and type* that Python's own arithmetic gives. Checked here by evaluating the expression
jitcore built against evaluating the operator directly, over ints, numpy integers, floats
(signed zeros, NaNs of several payloads, infinities) and bools, and through the jit.
"""

from __future__ import annotations

import math
import operator
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jitcore as jc
from jitcore import symbolic
from jitcore.backends import use_backend
from jitcore.errors import ArgumentError
from jitcore.symbolic import Sym

from .fakes import PACKINGS, CountingBackend, track_layouts

OPERATORS = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "//": operator.floordiv,
    "%": operator.mod,
    "/": operator.truediv,
}
SIGNALLING_NAN = struct.unpack("<d", bytes.fromhex("010000000000f07f"))[0]
NEGATIVE_NAN = struct.unpack("<d", bytes.fromhex("000000000000f8ff"))[0]
FLOATS = st.one_of(
    st.sampled_from([0.0, -0.0, 2.5, -2.5, 7.5, math.inf, -math.inf, math.nan, SIGNALLING_NAN, NEGATIVE_NAN]),
    st.floats(allow_nan=True, allow_infinity=True),
)
INTS = st.one_of(st.integers(-5, 5), st.integers(-(2**70), 2**70))
# signed: an out-of-range constant (-1 for a uint8) makes numpy raise through __import__, which
# the restricted namespace of Sym.evaluate lacks (a KeyError; reported, not part of this test)
NUMPY_INTS = st.tuples(st.sampled_from([np.int8, np.int16, np.int32, np.int64]), st.integers(0, 9))
# (kind of leaf, value): the leaf is made as tracing makes it for such an argument
VALUES = st.one_of(
    INTS.map(lambda v: ("int", v)),
    NUMPY_INTS.map(lambda t: ("int", t[0](t[1]))),
    FLOATS.map(lambda v: ("float", v)),
    FLOATS.map(lambda v: ("float", np.float64(v))),
    st.booleans().map(lambda v: ("bool", v)),
    st.booleans().map(lambda v: ("bool", np.bool_(v))),
)
CONSTANTS = st.sampled_from([0, 1, 2, -1, 0.0, 1.0, -0.0])


def leaf(kind: str) -> Sym:
    return Sym.leaf("v", "v", is_float=kind == "float", is_int=kind == "int")


def same(got: object, want: object) -> bool:
    """The same type and the same value, floats by their bits."""
    if type(got) is not type(want):
        return False
    if isinstance(want, np.generic):
        return got.tobytes() == want.tobytes()
    if isinstance(want, float):
        return struct.pack("<d", got) == struct.pack("<d", want)
    return got == want


def python(op: str, left: object, right: object) -> tuple[str, object]:
    try:
        with np.errstate(all="ignore"):
            return "ok", OPERATORS[op](left, right)
    except (ZeroDivisionError, TypeError, OverflowError) as error:
        return "error", type(error)


def jitcore_value(expression: object, value: object) -> tuple[str, object]:
    try:
        with np.errstate(all="ignore"):
            return "ok", expression.evaluate({"v": value}) if isinstance(expression, Sym) else expression
    except (ZeroDivisionError, TypeError, OverflowError) as error:
        return "error", type(error)


@settings(max_examples=600, deadline=None)
@given(value=VALUES, constant=CONSTANTS, op=st.sampled_from(sorted(OPERATORS)), reflected=st.booleans())
def test_property_an_expression_evaluates_to_what_python_computes(value, constant, op, reflected):
    kind, number = value
    symbol = leaf(kind)
    expression = symbolic._binary(op, constant, symbol) if reflected else symbolic._binary(op, symbol, constant)
    want = python(op, constant, number) if reflected else python(op, number, constant)
    got = jitcore_value(expression, number)
    if want[0] == "ok" and got[0] == "ok":
        assert same(got[1], want[1]), f"{expression!r} with v = {number!r}: {got[1]!r}, Python gives {want[1]!r}"
    else:
        assert got == want, f"{expression!r} with v = {number!r}"


@settings(max_examples=300, deadline=None)
@given(
    value=st.one_of(INTS, st.tuples(st.sampled_from([np.uint8, np.uint64, np.int8]), st.integers(0, 9))),
    divisor=st.sampled_from([1, 2, 3, 256]),
)
def test_property_cdiv_of_integers_is_the_exact_ceiling(value, divisor):
    """In a numpy integer's own width ``-(-a // b)`` wraps (``-numpy.uint8(3)`` is 253): jc.cdiv
    computes on Python ints, statically and on every call alike."""
    value = value[0](value[1]) if isinstance(value, tuple) else value
    pyint = isinstance(value, int)
    n = Sym.leaf("v", "v", is_int=True, is_pyint=pyint)
    want = -(-int(value) // divisor)
    for got in (symbolic.cdiv(n, divisor).evaluate({"v": value}), symbolic.cdiv(value, divisor)):
        assert type(got) is int and got == want
    if value:
        got = symbolic.cdiv(divisor, n).evaluate({"v": value})
        assert type(got) is int and got == -(-divisor // int(value))


@pytest.mark.parametrize(
    "build, value, want",
    [
        (lambda v: v // 1, 2.5, 2.0),  # floors
        (lambda v: v // 1, -2.5, -3.0),
        (lambda v: v + 0, -0.0, 0.0),  # the sign of zero
        (lambda v: 0 + v, -0.0, 0.0),
        (lambda v: v * 1, SIGNALLING_NAN, SIGNALLING_NAN * 1),  # a signalling NaN is quieted
        (lambda v: v - 0, SIGNALLING_NAN, SIGNALLING_NAN - 0),
    ],
)
def test_float_operands_are_never_simplified(build, value, want):
    expression = build(leaf("float"))
    assert isinstance(expression, Sym) and expression.op != "leaf"
    assert struct.pack("<d", expression.evaluate({"v": value})) == struct.pack("<d", want)


@pytest.mark.parametrize("flag", [True, np.True_])
@pytest.mark.parametrize("build", [lambda v: v * 1, lambda v: 1 * v, lambda v: v + 0, lambda v: v // 1, lambda v: +v])
def test_a_bool_operand_becomes_an_int_as_in_python(flag, build):
    expression = build(leaf("bool"))
    assert isinstance(expression, Sym) and expression.op != "leaf"
    if isinstance(flag, np.bool_) and expression.op == "pos":
        with pytest.raises(TypeError):  # numpy refuses +np.True_, and so does the expression
            expression.evaluate({"v": flag})
        return
    assert same(expression.evaluate({"v": flag}), build(flag))


def test_integer_identities_still_keep_generated_code_short():
    n = leaf("int")
    assert n * 1 is n and 1 * n is n and n + 0 is n and 0 + n is n and n - 0 is n and n // 1 is n and +n is n
    assert (n * 2).is_int and (n // 2).is_int and not (n / 2).is_int and (n / 2).is_float
    assert not (n * 1.0).is_int and (n * 1.0).is_float  # a float constant: a float, not simplified
    assert symbolic.cdiv(leaf("float"), 2).is_float and symbolic.cdiv(n, 2).is_int
    assert symbolic.minimum(n, 3).is_int and not symbolic.minimum(n, leaf("bool")).is_int


def test_as_index_is_operator_index_on_every_call_and_invisible_in_messages():
    n = leaf("int")
    index = symbolic.as_index(n * 4)
    assert symbolic.as_index(index) is index and index.describe() == "(v * 4)"
    value = index.evaluate({"v": np.int32(3)})
    assert type(value) is int and value == 12


# --- through the jit: what the kernel receives ---------------------------------------------------
@pytest.fixture(params=PACKINGS)
def backend(request):
    fake = CountingBackend(packed=request.param == "packed")
    with use_backend(fake):
        yield fake


def scalar_kernel(backend, ctype: str) -> jc.Kernel:
    kernel = jc.Kernel(f"__global__ void s({ctype} v) {{}}", "s")
    track_layouts(backend, kernel.instantiate())
    return kernel


def test_a_float_floor_divided_by_a_constexpr_one_is_floored(backend):
    kernel = scalar_kernel(backend, "double")

    @jc.jit
    def bucket(alpha, width: jc.Constexpr[int]):
        kernel[1, 1](alpha // width)

    for width in (2, 1, 1):  # the second call of width 1 runs the call state its first built
        bucket(7.5, width)
        assert backend.calls[-1][7][0] == struct.pack("<d", 7.5 // width)


def test_negative_zero_plus_zero_is_positive_zero(backend):
    kernel = scalar_kernel(backend, "float")

    @jc.jit
    def shifted(alpha, offset: jc.Constexpr[int] = 0):
        kernel[1, 1](alpha + offset)

    for _ in range(2):
        shifted(-0.0)
        assert backend.calls[-1][7][0] == struct.pack("<f", 0.0)


def test_a_bool_times_one_is_not_a_bool_argument(backend):
    kernel = scalar_kernel(backend, "bool")

    @jc.jit
    def flagged(flag):
        kernel[1, 1](flag * 1)

    with pytest.raises(ArgumentError, match="a bool parameter takes a bool launcher argument"):
        flagged(True)
    assert flagged.cache_info().states == 0


def test_numpy_integer_arithmetic_stays_numpy_arithmetic(backend):
    kernel = scalar_kernel(backend, "long long")

    @jc.jit
    def scaled(n):
        kernel[1, 1](n * 1 + 0)

    for value in (np.int32(7), np.int32(-3)):
        scaled(value)
        assert backend.calls[-1][7][0] == struct.pack("<q", int(value))
