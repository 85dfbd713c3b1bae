"""Scalar parameters on the CPU (byte-recording null backend): the kernel receives exactly
Python's value encoded in the parameter's C type, or the call raises a clear ArgumentError;
never a silently changed value. Also: Constexpr keys that never merge different values."""

from __future__ import annotations

import bisect
import enum
import math
import struct
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jitcore as jc
from jitcore.backends import abi, use_backend
from jitcore.errors import ArgumentError

from .fakes import PACKINGS, CountingBackend, track_layouts

# One spelling per distinct C scalar type the ABI knows (abi._SCALARS maps every spelling).
C_TYPES = [
    "signed char",
    "unsigned char",
    "short",
    "unsigned short",
    "int",
    "unsigned int",
    "long long",
    "unsigned long long",
    "bool",
    "float",
    "double",
    "__half",
    "__nv_bfloat16",
]


def test_the_list_covers_every_abi_scalar_type():
    known = {(fmt, size, kind) for fmt, size, kind in abi._SCALARS.values()}
    covered = {abi._SCALARS[name] for name in C_TYPES}
    assert covered == known


# --- an independent oracle -----------------------------------------------------------------------
def _bf16_table() -> list[float]:
    return [struct.unpack("<f", struct.pack("<I", bits << 16))[0] for bits in range(0x7F80)]


_BF16 = _bf16_table()  # every non-negative finite bfloat16, in bit (and value) order


def round_bf16(x: float) -> float | None:
    """Nearest bfloat16 (ties to even) by exhaustive search; None when it overflows."""
    if math.isnan(x) or math.isinf(x):
        return x
    magnitude = Fraction(abs(x))
    top = Fraction(_BF16[-1])
    if magnitude >= top + Fraction(2) ** 119:  # halfway to 2**128 or beyond: rounds to infinity
        return None
    i = bisect.bisect_right(_BF16, abs(x)) - 1
    if i == len(_BF16) - 1 or Fraction(_BF16[i]) == magnitude:
        result = _BF16[i]
    else:
        low, high = Fraction(_BF16[i]), Fraction(_BF16[i + 1])
        if magnitude - low < high - magnitude or (magnitude - low == high - magnitude and i % 2 == 0):
            result = _BF16[i]
        else:
            result = _BF16[i + 1]
    return math.copysign(result, x)


def round_to(ctype: str, x: float) -> float | None:
    """x (a double) rounded to the C floating type; None when a finite x overflows."""
    if ctype == "double":
        return x
    if ctype == "__nv_bfloat16":
        return round_bf16(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rounded = float(np.float32(x) if ctype == "float" else np.float16(x))
    return None if math.isinf(rounded) and not math.isinf(x) else rounded


INT_RANGES = {
    "signed char": (-(2**7), 2**7 - 1),
    "unsigned char": (0, 2**8 - 1),
    "short": (-(2**15), 2**15 - 1),
    "unsigned short": (0, 2**16 - 1),
    "int": (-(2**31), 2**31 - 1),
    "unsigned int": (0, 2**32 - 1),
    "long long": (-(2**63), 2**63 - 1),
    "unsigned long long": (0, 2**64 - 1),
}


def expected(ctype: str, value: object) -> tuple[bool, object]:
    """(accepted, the value the kernel must receive)."""
    is_bool = isinstance(value, (bool, np.bool_))
    integral = is_bool or isinstance(value, (int, np.integer))
    floating = isinstance(value, (float, np.floating))
    if ctype == "bool":
        return (True, bool(value)) if is_bool else (False, None)
    if ctype in INT_RANGES:
        low, high = INT_RANGES[ctype]
        return (True, int(value)) if integral and low <= int(value) <= high else (False, None)
    if integral:
        number = int(value)
        try:
            as_double = float(number)
        except OverflowError:
            return False, None
        if as_double != number:
            return False, None
        rounded = round_to(ctype, as_double)
        return (True, rounded) if rounded == as_double else (False, None)
    assert floating
    rounded = round_to(ctype, float(value))
    return (False, None) if rounded is None else (True, rounded)


def decode(ctype: str, raw: bytes) -> object:
    fmt = abi.parse_param(f"{ctype} v").fmt
    (value,) = struct.unpack("<" + fmt, raw)
    if ctype == "__nv_bfloat16":
        return struct.unpack("<f", struct.pack("<I", value << 16))[0]
    return value


def same(received: object, wanted: object) -> bool:
    if isinstance(wanted, float):
        if math.isnan(wanted):
            return isinstance(received, float) and math.isnan(received)
        return received == wanted and math.copysign(1, received) == math.copysign(1, wanted)
    return type(received) is type(wanted) and received == wanted


# --- the three ways a scalar reaches a kernel ------------------------------------------------------
class Setup:
    def __init__(self) -> None:
        self.backend = CountingBackend()
        self.kernels, self.runtime, self.constexpr = {}, {}, {}
        with use_backend(self.backend):
            for ctype in C_TYPES:
                kernel = jc.Kernel(f"__global__ void s({ctype} v) {{}}", "s")
                track_layouts(self.backend, kernel.instantiate())
                self.kernels[ctype] = kernel
                self.runtime[ctype] = self._runtime(kernel)
                self.constexpr[ctype] = self._constexpr(kernel)

    @staticmethod
    def _runtime(kernel):
        @jc.jit
        def runtime_scalar(v):
            kernel[1, 1](v)

        return runtime_scalar

    @staticmethod
    def _constexpr(kernel):
        @jc.jit
        def constexpr_scalar(v: jc.Constexpr[object]):
            kernel[1, 1](v)

        return constexpr_scalar

    def call(self, path: str, ctype: str, value: object) -> bytes:
        self.backend.calls.clear()
        with use_backend(self.backend):
            if path == "runtime":
                self.runtime[ctype](value)
            elif path == "constexpr":
                self.constexpr[ctype](value)
            else:
                self.kernels[ctype].instantiate()[1, 1](value)
        (call,) = self.backend.calls
        return call[7][0]


_setup: Setup | None = None


def setup() -> Setup:
    global _setup
    if _setup is None:
        _setup = Setup()
    return _setup


def check(path: str, ctype: str, value: object) -> None:
    accepted, wanted = expected(ctype, value)
    try:
        raw = setup().call(path, ctype, value)
    except ArgumentError as error:
        if path == "runtime" and isinstance(value, enum.Enum):
            assert "unsupported argument type" in str(error)  # not a runtime scalar type
            return
        assert not accepted, f"{path} {ctype} {value!r}: refused ({error}), expected {wanted!r}"
        text = str(error)
        assert text.startswith("argument 0" if path == "direct" else f"{path}_scalar: "), text  # the launcher
        assert "of s" in text, text  # the kernel ...
        assert f"{ctype} v" in text or "parameter 'v'" in text, text  # ... and the parameter
        return
    assert accepted, f"{path} {ctype} {value!r}: the kernel got {decode(ctype, raw)!r}, expected an ArgumentError"
    received = decode(ctype, raw)
    assert same(received, wanted), f"{path} {ctype} {value!r}: the kernel got {received!r}, expected {wanted!r}"


# --- boundary values ---------------------------------------------------------------------------
class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2**40


BOUNDARY_INTS = sorted(
    {
        v
        for base in (0, 2**7, 2**8, 2**11, 2**15, 2**16, 2**24, 2**31, 2**32, 2**53, 2**63, 2**64)
        for v in (base - 2, base - 1, base, base + 1, base + 2, -base - 1, -base, -base + 1)
    }
    | {10**400, -(10**400), 65504, 65519, 65520, 2**128, 2**127 + 2**119}
)
BOUNDARY_FLOATS = [
    0.0,
    -0.0,
    math.nan,
    -math.nan,
    math.inf,
    -math.inf,
    1.0,
    -2.5,
    0.1,
    1e300,
    -1e300,
    5e-324,
    1e-45,
    1.4e-45,
    3.4028234663852886e38,  # float32 max
    3.4028235677973366e38,  # halfway to 2**128: rounds to infinity
    3.4028235e38,
    3.3895313892515355e38,  # bfloat16 max
    3.3961775292304e38,  # just under bfloat16's halfway to infinity
    65504.0,
    65519.99,
    65520.0,
    6e-8,
    2.0**24 + 1,
    2.0**53,
    1.00390625,
    1 + 2**-8 + 2**-30,  # rounds up to bfloat16 directly; a float32 detour rounds it down
]
NUMPY_INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
NUMPY_FLOATS = [(np.float16, 16), (np.float32, 32), (np.float64, 64)]


def numpy_ints():
    return st.sampled_from(NUMPY_INTS).flatmap(lambda t: st.integers(int(np.iinfo(t).min), int(np.iinfo(t).max)).map(t))


def numpy_floats():
    return st.sampled_from(NUMPY_FLOATS).flatmap(lambda tw: st.floats(width=tw[1]).map(tw[0]))


def numpy_boundaries() -> list:
    values = [np.True_, np.False_, np.uint64(2**64 - 1), np.int64(-(2**63)), np.uint32(2**24 + 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for kind in (np.float16, np.float32, np.float64):
            values += [kind(v) for v in BOUNDARY_FLOATS]
        for kind in NUMPY_INTS:
            info = np.iinfo(kind)
            values += [kind(v) for v in BOUNDARY_INTS if info.min <= v <= info.max]
    return values


VALUES = st.one_of(
    st.sampled_from(BOUNDARY_INTS),
    st.integers(),
    st.sampled_from(BOUNDARY_FLOATS),
    st.floats(),
    st.booleans(),
    st.sampled_from([np.True_, np.False_]),
    numpy_ints(),
    numpy_floats(),
    st.sampled_from(BOUNDARY_INTS).filter(lambda v: -(2**63) <= v < 2**63).map(np.int64),
    st.sampled_from(numpy_boundaries()),
    st.sampled_from(list(Level)),
)


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["runtime", "constexpr", "direct"]), st.sampled_from(C_TYPES), VALUES)
def test_property_a_scalar_arrives_exactly_or_is_refused(path, ctype, value):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's cast warnings in the oracle
        check(path, ctype, value)


@pytest.mark.parametrize("path", ["runtime", "constexpr", "direct"])
@pytest.mark.parametrize("ctype", C_TYPES)
def test_every_boundary_value_on_every_type(path, ctype):
    values = [*BOUNDARY_INTS, *BOUNDARY_FLOATS, True, False, Level.LOW, Level.HIGH, *numpy_boundaries()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for value in values:
            check(path, ctype, value)


# --- the filed cases, by name -----------------------------------------------------------------------
@pytest.fixture(params=PACKINGS)
def backend(request):
    fake = CountingBackend(packed=request.param == "packed")
    with use_backend(fake):
        yield fake


def float_launcher(backend, ctype: str = "float"):
    kernel = jc.Kernel(f"__global__ void scale(const float* x, {ctype} alpha) {{}}", "scale")
    track_layouts(backend, kernel.instantiate())

    @jc.jit
    def launch_scale(x, alpha):
        kernel[1, 32](x, alpha)

    @jc.jit
    def launch_constant(x, alpha: jc.Constexpr[object]):
        kernel[1, 32](x, alpha)

    return launch_scale, launch_constant


@pytest.mark.parametrize(
    "ctype, value",
    [("float", 2**24 + 1), ("float", -(2**24 + 1)), ("double", 2**53 + 1), ("__half", 2049), ("__nv_bfloat16", 257)],
)
def test_an_int_a_floating_parameter_cannot_hold_exactly_is_refused(backend, ctype, value):
    runtime, constant = float_launcher(backend, ctype)
    x = torch.randn(4)
    runtime(x, 3)  # exact: fine, and the call state exists
    for launch in (runtime, constant):
        with pytest.raises(ArgumentError, match=rf"launch_\w+: argument 1 \({ctype} alpha\) of scale") as info:
            launch(x, value)
        assert str(value) in str(info.value) and "exact" in str(info.value)
    runtime(x, 2**24 if ctype != "__half" else 2048)  # exact: fine
    assert struct.unpack("<Q", backend.calls[-1][7][0])[0] == x.data_ptr()


def test_a_float_too_large_names_the_parameter_and_the_launcher(backend):
    runtime, constant = float_launcher(backend)
    x = torch.randn(4)
    runtime(x, 1.0)
    with pytest.raises(ArgumentError, match=r"launch_scale: argument 1 \(float alpha\) of scale gets 1e\+300"):
        runtime(x, 1e300)
    with pytest.raises(ArgumentError, match=r"launch_constant: argument 1 \(float alpha\) of scale.*too large"):
        constant(x, 1e300)
    runtime(x, math.inf)  # infinities are values, not overflows
    assert struct.unpack("<f", backend.calls[-1][7][1])[0] == math.inf


def test_negative_zero_reaches_the_kernel_as_a_runtime_scalar(backend):
    runtime, _ = float_launcher(backend)
    x = torch.randn(4)
    runtime(x, 0.0)
    for _ in range(2):  # the hit path too
        runtime(x, -0.0)
        assert struct.pack("<f", -0.0) == backend.calls[-1][7][1]
    assert runtime.cache_info().compiles == 1  # runtime scalars are keyed by type only


def test_negative_zero_and_zero_constexpr_get_their_own_call_states(backend):
    _, constant = float_launcher(backend)
    x = torch.randn(4)
    for value in (0.0, -0.0, 0.0, -0.0):
        constant(x, value)
        assert backend.calls[-1][7][1] == struct.pack("<f", value)
    assert constant.cache_info().compiles == 2


def test_a_nan_constexpr_compiles_once(backend):
    _, constant = float_launcher(backend)
    x = torch.randn(4)
    for _ in range(5):
        constant(x, float("nan"))
        assert math.isnan(struct.unpack("<f", backend.calls[-1][7][1])[0])
    constant(x, np.float64("nan"))
    assert constant.cache_info().compiles == 2  # a float and a numpy.float64 NaN


def test_constexpr_containers_keep_element_values_and_types():
    from jitcore.keys import KeyPlan, Parameter

    plan = KeyPlan([Parameter("c", constexpr=True)])
    keys = [plan.lean_key(v) for v in [(0.0, 1), (-0.0, 1), (0.0, 1.0), (1, 1), (True, 1), frozenset({0.0})]]
    keys.append(plan.lean_key(frozenset({-0.0})))
    assert len(set(keys)) == len(keys)
    assert plan.lean_key(float("nan")) == plan.lean_key(float("nan"))
    assert plan.lean_key(complex(0.0, -0.0)) != plan.lean_key(complex(0.0, 0.0))
    for value in (0.0, -0.0, float("nan"), (1.5, -0.0), np.float32(-0.0), 3, "s", None, torch.float16):
        assert repr(plan.lean_key(value)) == repr(plan.full_key(value))


def test_the_guard_never_confuses_the_two_zeros(backend):
    _, constant = float_launcher(backend)
    x = torch.randn(4)
    constant(x, 1.5)
    constant(x, 1.5)
    guard, _ = constant.jit.mru[0]
    assert guard(x, 1.5) and not guard(x, 2.5)
    constant(x, -0.0)
    constant(x, -0.0)
    constant(x, 0.0)
    assert backend.calls[-1][7][1] == struct.pack("<f", 0.0)


def test_bfloat16_rounds_from_the_double_and_refuses_overflow():
    assert abi.float_to_bfloat16_bits(1 + 2**-8 + 2**-30) == 0x3F81  # torch's float32 detour gives 0x3F80
    assert abi.float_to_bfloat16_bits(-0.0) == 0x8000
    with pytest.raises(OverflowError):
        abi.float_to_bfloat16_bits(3.3961775292304e38 * 1.001)
    assert abi.float_to_bfloat16_bits(math.inf) == 0x7F80


@settings(max_examples=2000, deadline=None)
@given(st.floats(allow_nan=False))
def test_property_bfloat16_rounding_is_the_nearest(value):
    wanted = round_bf16(value)
    try:
        bits = abi.float_to_bfloat16_bits(value)
    except OverflowError:
        assert wanted is None
        return
    got = struct.unpack("<f", struct.pack("<I", bits << 16))[0]
    assert got == wanted and math.copysign(1, got) == math.copysign(1, wanted)


@pytest.mark.parametrize("ctype, fmt", [("long long", "<q"), ("int", "<i"), ("double", "<d")])
def test_a_numpy_longlong_is_passed_like_an_int64(backend, ctype, fmt):
    """``np.array([3], dtype='q')[0]`` is a numpy.longlong, a type apart from numpy.int64 on
    Linux (printed as np.int64(3)): accepted as what it is, an 8-byte integer."""
    kernel = jc.Kernel(f"__global__ void k({ctype} n) {{}}", "k")
    track_layouts(backend, kernel.instantiate())

    @jc.jit
    def launch(n):
        kernel[1, 1](n)

    for value in (np.array([3], dtype="q")[0], np.longlong(-7), np.int64(5), np.array([9], dtype="Q")[0]):
        launch(value)
        assert backend.calls[-1][7][0] == struct.pack(fmt, int(value))
    assert launch.cache_info().states == 2  # the 8-byte signed ints share one; the unsigned has its own
