"""Generated code on the CPU (null backend): any parameter name works, no user value is pasted
into source by its repr, generated source shows in tracebacks, empty grids launch nothing."""

from __future__ import annotations

import enum
import io
import linecache
import math
import re
import struct
import token
import tokenize
import traceback

import numpy as np
import pytest
import torch

import jitcore as jc
from jitcore import generated, symbolic
from jitcore.backends import use_backend
from jitcore.errors import ArgumentError, LaunchConfigError

from .fakes import PACKINGS, CountingBackend, track_layouts

SOURCE = "__global__ void k(const float* x, long long n, long long v, float f) {}"


@pytest.fixture
def backend():
    fake = CountingBackend()
    with use_backend(fake):
        yield fake


def new_kernel(backend, source: str = SOURCE, name: str = "k"):
    """A fresh kernel loaded on this backend (so recorded bytes are read with its layout)."""
    kernel = jc.Kernel(source, name)
    track_layouts(backend, kernel.instantiate())
    return kernel


def params(backend, fmts: str) -> list:
    return [struct.unpack("<" + f, raw)[0] for f, raw in zip(fmts, backend.calls[-1][7])]


# --- A: any parameter name ---------------------------------------------------------------------
GENERATED_NAMES = [
    "x_numel", "x_ptr", "x_size0", "x_stride0", "x_shape", "x_strides", "key", "min", "max", "int",
    "len", "_s", "_b", "_m", "_n", "_d", "_t", "_e", "_r", "_so", "_hook", "_original", "_state",
    "_MRU", "_STATES", "_miss", "_touch", "_promote", "_device", "_default0", "_default1", "_Tensor",
    "_NAMES", "_LEAN", "_SCALAR", "_k0", "_k1", "_a0", "_a1", "_a1_ptr", "_f0", "_grid0x", "_block0x", "_pack0_0",
    "_tls", "_ACTIVE", "_pack_failed", "_c0", "_v0", "_dg", "_dv", "_ds0", "guard", "lean_key", "k",
]  # fmt: skip


@pytest.mark.parametrize("name", GENERATED_NAMES)
def test_any_parameter_name_reaches_the_kernel_unchanged(backend, name):
    kernel = new_kernel(backend)
    namespace = {"jc": jc, "kernel": kernel}
    exec(
        f"def launch(x, {name}, alpha=1.5):\n    kernel[1, 32](x, x.numel(), {name}, alpha)\n",
        namespace,
    )
    launch = jc.jit(namespace["launch"])
    x = torch.randn(6, 5)
    for call in range(3):  # miss, lean hit, guarded hit
        launch(x, 11 + call)
        assert params(backend, "Qqqf") == [x.data_ptr(), 30, 11 + call, 1.5]
    launch(x=x, **{name: 42}, alpha=-2.0)  # by keyword, with the user's names
    assert params(backend, "Qqqf")[1:] == [30, 42, -2.0]
    assert launch.cache_info().compiles == 1
    with pytest.raises(TypeError, match=f"'{name}'"):
        launch(x)  # Python's own message names the missing parameter


def test_parameters_shadowing_every_generated_name_at_once(backend):
    kernel = new_kernel(backend, "__global__ void k(const float* x, long long a, long long b, long long c, float f) {}")

    @jc.jit
    def f(x, x_numel, x_ptr, x_size0, key, min, _s, _b, _m, _MRU, _a0):
        kernel[1, 32](x, x_numel, x_ptr, x_size0 + _a0, key * _m + _MRU + _s)

    x = torch.randn(5, 3)
    for _ in range(3):
        f(x, 11, 22, 33, 2.0, 0, 5.0, 0, 3.0, 4.0, 1)
        assert params(backend, "Qqqqf")[1:] == [11, 22, 34, 15.0]
    source = f.dump(file=io.StringIO())
    identifiers = {t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == token.NAME}
    assert not identifiers & {"x", "x_numel", "x_ptr", "x_size0", "key", "min"}  # in comments only
    assert "def f(_a0, _a1," in source and "_a0 = x, _a1 = x_numel" in source


def test_launchers_whose_name_is_no_identifier(backend):
    kernel = new_kernel(backend)
    launch = jc.jit(lambda x, n: kernel[1, 32](x, n, n, 0.5))
    launch(torch.randn(4), 3)
    assert params(backend, "Qqqf")[1:] == [3, 3, 0.5]


# --- B: values reach generated code through its namespace -----------------------------------
class Color(enum.IntEnum):
    RED = 3


EXECUTED = []


class Sneaky:
    """A Constexpr whose repr spans lines and holds code."""

    def __repr__(self) -> str:
        return "1)\nimport tests.jitcore.test_codegen as m; m.EXECUTED.append(1)\n(2"

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sneaky)


def test_constexpr_repr_never_reaches_the_source(backend):
    kernel = new_kernel(backend)

    @jc.jit
    def launch(x, n, tag: jc.Constexpr[object]):
        kernel[1, 32](x, n, n, 1.0)

    x = torch.randn(4)
    launch(x, 2, Sneaky())
    launch(x, 2, Sneaky())
    assert EXECUTED == [] and params(backend, "Qqqf")[1:] == [2, 2, 1.0]
    text = launch.dump(file=io.StringIO())
    assert "m.EXECUTED" not in text and "Sneaky" not in text


@pytest.mark.parametrize(
    "factor, expected",
    [
        (np.float64(2.5), 5.0),
        (math.inf, math.inf),
        (-math.inf, -math.inf),
        (-0.0, -0.0),
        (Color.RED, 6.0),
    ],
)
def test_float_and_enum_constants_in_symbolic_expressions(backend, factor, expected):
    kernel = new_kernel(backend)

    @jc.jit
    def launch(x, n, scale):
        kernel[1, 32](x, n * Color.RED, n + Color.RED, scale * factor)

    x = torch.randn(4)
    launch(x, 2, 2.0)
    launch(x, 2, 2.0)
    got = params(backend, "Qqqf")[1:]
    assert got[:2] == [6, 5]
    assert got[2] == expected and math.copysign(1, got[2]) == math.copysign(1, expected)


def test_numpy_float32_constants_are_refused_clearly(backend):
    kernel = new_kernel(backend)

    @jc.jit
    def launch(x, scale):
        kernel[1, 32](x, 1, 1, scale * np.float32(0.5))

    with pytest.raises(TypeError, match="unsupported operand for symbolic"):
        launch(torch.randn(4), 2.0)


def test_nan_constant_in_a_symbolic_expression(backend):
    kernel = new_kernel(backend)

    @jc.jit
    def launch(x, scale):
        kernel[1, 32](x, 1, 1, scale * math.nan)

    launch(torch.randn(4), 2.0)
    assert math.isnan(params(backend, "Qqqf")[3])


def test_enum_launch_dimensions(backend):
    kernel = new_kernel(backend)

    @jc.jit
    def launch(x, n):
        kernel[Color.RED, (Color.RED, 2), Color.RED * 4](x, n, n, 1.0)

    launch(torch.randn(4), 1)
    assert backend.calls[-1][1:4] == ((3, 1, 1), (3, 2, 1), 12)


def test_symbolic_source_refuses_unbound_constants():
    n = symbolic.Sym.leaf("_a0", "n", is_float=True)
    expr = n * np.float64(2.0) + 1
    with pytest.raises(ValueError, match="needs a namespace"):
        expr.source()
    namespace: dict = {}
    assert expr.source(symbolic.Binder(namespace).bind) == "((_a0 * _k0) + 1)"
    assert namespace == {"_k0": np.float64(2.0)}
    assert expr.evaluate({"_a0": 3.0}) == 7.0
    assert "2.0" in expr.describe()  # messages show the repr


def test_symbolic_evaluate_compiles_once_through_the_one_define(monkeypatch):
    defined = []
    define = generated.define
    monkeypatch.setattr(generated, "define", lambda *args: defined.append(args[1]) or define(*args))
    n, size = symbolic.Sym.leaf("_a1", "n"), symbolic.Sym.leaf("_a0_size0", "x.shape[0]")
    expr = symbolic.maximum(n * np.float64(2.5), size) // size
    assert [expr.evaluate({"_a1": v, "_a0_size0": 2, "other": None}) for v in (1, 4)] == [1.0, 5.0]
    assert len(defined) == 1 and defined[0].startswith("<jitcore evaluation of (max((n * np.float64(2.5)), x.shape[0])")
    source = "".join(linecache.getlines(defined[0]))
    assert source.startswith("def evaluate(_a0_size0, _a1):") and "2.5" not in source
    with pytest.raises(NameError, match="'_a0_size0'"):  # what eval said of a missing leaf
        expr.evaluate({"_a1": 1})
    assert len(defined) == 1
    with pytest.raises(ZeroDivisionError) as info:
        symbolic.cdiv(n, size).evaluate({"_a1": 1, "_a0_size0": 0})
    frame = traceback.extract_tb(info.tb)[-1]
    assert frame.filename == defined[1] and frame.line == "return (-(-_a1 // _a0_size0))"  # the generated line


def test_symbolic_evaluate_sees_min_and_max_only_and_no_constant_takes_a_leafs_name():
    leaf = symbolic.Sym.leaf("_k0", "k")  # the name a bound constant would get first
    expr = symbolic.minimum(leaf * np.float64(3.0), 10.5)
    assert expr.evaluate({"_k0": 2.0}) == 6.0 and expr.evaluate({"_k0": 5.0}) == 10.5
    namespace = expr._expression.function.__globals__
    assert namespace["__builtins__"] == {"min": min, "max": max}


def test_generated_source_shows_in_tracebacks(backend):
    kernel = new_kernel(backend)

    @jc.jit
    def launch(x, threads):
        kernel[1, threads](x, 1, 1, 1.0)

    x = torch.randn(4)
    launch(x, 32)
    with pytest.raises(LaunchConfigError) as info:
        launch(x, 0)
    frames = [f for f in traceback.extract_tb(info.value.__traceback__) if f.filename.startswith("<jitcore")]
    states = [f for f in frames if f.filename.startswith("<jitcore call state launch__state0")]
    assert states and "_bad_config" in states[-1].line
    assert any(f.filename.startswith("<jitcore dispatcher") and f.line for f in frames)
    state = next(iter(launch.jit.states.values())).call_state
    assert linecache.getline(state.filename, 1).startswith("def launch__state0(")
    assert "".join(linecache.getlines(state.filename)) == state.source


def test_every_generated_source_gets_its_own_filename(backend):
    kernel = new_kernel(backend)

    def make():
        @jc.jit
        def same_name(x, n):
            kernel[1, 32](x, n, n, 1.0)

        return same_name

    first, second = make(), make()
    first(torch.randn(4), 1)
    second(torch.randn(4, 2), 1)
    a = next(iter(first.jit.states.values())).call_state
    b = next(iter(second.jit.states.values())).call_state
    assert a.filename != b.filename and first.jit.filename != second.jit.filename
    assert "".join(linecache.getlines(a.filename)) == a.source


# --- E: zero-size launches ---------------------------------------------------------------------
def test_static_empty_grid_launches_nothing(backend):
    kernel = new_kernel(backend)

    @jc.jit
    def launch(x):
        kernel[(4, 0), 32](x, 1, 1, 1.0)
        kernel[0, 32](x, 2, 2, 2.0)

    launch(torch.randn(4))
    launch(torch.randn(4))
    assert backend.calls == []
    kernel.instantiate()[0, 32](torch.randn(4), 1, 1, 1.0)  # outside a launcher as well
    assert backend.calls == []


@pytest.mark.parametrize(
    "grid, block, match",
    [
        (-1, 32, "grid dimension x is -1"),
        (0, 0, "block dimension x is 0"),
        ((1, 70000), 32, "grid dimension y"),
    ],
)
def test_bad_configurations_stay_errors_even_with_an_empty_grid(backend, grid, block, match):
    kernel = new_kernel(backend)

    @jc.jit
    def launch(x):
        kernel[grid, block](x, 1, 1, 1.0)

    with pytest.raises(LaunchConfigError, match=match):
        launch(torch.randn(4))


def test_dynamic_empty_grid_is_skipped_and_bad_ones_raise(backend):
    kernel = new_kernel(backend)

    @jc.jit
    def launch(x, n, threads):
        kernel[(jc.cdiv(n, 64), n), threads](x, n, n, 1.0)

    x = torch.randn(4)
    launch(x, 100, 64)
    assert backend.calls[-1][1] == (2, 100, 1)
    backend.calls.clear()
    launch(x, 0, 64)
    assert backend.calls == []
    with pytest.raises(LaunchConfigError, match=r"grid \(0, -1, 1\)"):
        launch(x, -1, 64)
    with pytest.raises(LaunchConfigError, match=r"grid \(1094, 70000, 1\)"):
        launch(x, 70000, 64)
    with pytest.raises(LaunchConfigError, match="block"):
        launch(x, 0, 0)  # an empty grid does not excuse an empty block
    assert backend.calls == [] and launch.cache_info().compiles == 1


def test_empty_tensor_launch_through_axpy_style_launcher(backend):
    kernel = new_kernel(backend)

    @jc.jit
    def launch(x):
        n = x.numel()
        kernel[jc.cdiv(n, 256), 256](x, n, n, 1.0)

    launch(torch.randn(300))
    assert backend.calls[-1][1] == (2, 1, 1)
    backend.calls.clear()
    launch(torch.randn(0))
    assert backend.calls == []


def test_argument_errors_still_raise_for_an_empty_launch(backend):
    kernel = new_kernel(backend, "__global__ void k(const float* x, int n) {}")

    @jc.jit
    def launch(x, n):
        kernel[jc.cdiv(x.numel(), 32), 32](x, n)

    with pytest.raises(ArgumentError, match=r"argument 1 \(int n\) of k gets 8589934592"):
        launch(torch.randn(0), 2**33)


# --- several launches: everything checked and packed, then every launch (finding #2) ------------
def _launch_line_numbers(source: str, marker: str) -> list[int]:
    return [number for number, line in enumerate(source.splitlines()) if re.search(marker, line)]


@pytest.mark.parametrize("packing", PACKINGS)
def test_a_call_state_of_several_launches_checks_and_packs_all_before_any_launch(packing):
    """Both generated functions (``run`` and its recording variant ``__rec``): every grid check
    and every packing comes before the first launch, under one readable comment; a call state
    of one launch keeps the backend's packed launch where it has one."""
    fake = CountingBackend(packed=packing == "packed")
    with use_backend(fake):
        kernel = new_kernel(fake, "__global__ void k(const float* x, int n) {}")

        @jc.jit
        def several(x, n):
            kernel[jc.cdiv(x.numel(), 32), 32](x, n)
            kernel[n, 32, n](x[1:], n + 1)
            kernel[1, n](x, n * 2)

        @jc.jit
        def one(x, n):
            kernel[jc.cdiv(x.numel(), 32), 32](x, n)

        several(torch.randn(8), 3)
        one(torch.randn(8), 3)
        source = several.jit.states[next(iter(several.jit.states))].source
        for function in source.split("\ndef ")[1:]:
            launches = _launch_line_numbers(function, r"_null_launch\(")
            checks = [
                *_launch_line_numbers(function, r"_pack\d+_\d+\("),
                *_launch_line_numbers(function, r"_check_grid\(|_bad_config\(|_grow_shared\("),
            ]
            assert len(launches) == 3 and len(checks) >= 7, function
            assert max(checks) < min(launches), function
            assert "# every launch checked and packed: launch them" in function
            assert "_L0(" not in function  # several launches: packed with struct first
        one_source = one.jit.states[next(iter(one.jit.states))].source
        assert ("_L0(" in one_source) == (packing == "packed")
        assert "# every launch checked" not in one_source
