"""Dynamic scalars: arithmetic builds expressions; anything that would bake a value refuses."""

from __future__ import annotations

import enum
import linecache
import math
import traceback

import numpy as np
import pytest
import torch

from jitcore import generated
from replay import DynamicScalarError, dynamic
from replay.dynamic import DynamicScalar


def test_dynamic_takes_numbers_only():
    assert dynamic(3).value == 3 and dynamic(np.float32(2)).value == 2
    assert dynamic(dynamic(5)).value == 5
    with pytest.raises(TypeError, match="takes an int, float or bool"):
        dynamic("3")
    with pytest.raises(TypeError):
        dynamic(torch.tensor(3))


def test_arithmetic_builds_source_and_value():
    pos = DynamicScalar("_d2", 7, "args[2]")
    expr = (pos + 1) * 2 - pos // 3
    assert expr.value == (7 + 1) * 2 - 7 // 3
    assert expr.evaluate({"_d2": 10}) == (10 + 1) * 2 - 10 // 3
    assert (3 - pos).value == -4 and (-pos).value == -7 and (pos / 2).value == 3.5
    assert expr.__jit_scalar__() == expr.value


class Scale(enum.IntEnum):
    DOUBLE = 2


@pytest.mark.parametrize("constant", [math.inf, -math.inf, np.float64(1.5), np.int32(3), Scale.DOUBLE, -0.0, 1e300])
def test_constants_reach_the_source_by_name_never_by_repr(constant):
    pos = DynamicScalar("_d0", 2.0, "args[0]")
    expr = pos * constant + 1
    # by token, not by substring: a bound name (_k82) may hold the constant's digits ("2")
    tokens = set(expr.source.replace("(", " ").replace(")", " ").split())
    assert repr(constant) not in tokens and str(constant) not in tokens
    assert tokens <= {"_d0", "*", "+", *expr.constants}
    for value in (3.0, -0.0, 7.5):
        assert np.float64(expr.evaluate({"_d0": value})).tobytes() == np.float64(value * constant + 1).tobytes()


def test_nan_constant_evaluates_to_nan():
    expr = DynamicScalar("_d0", 1.0, "args[0]") + math.nan
    assert math.isnan(expr.evaluate({"_d0": 2.0}))


def test_evaluate_compiles_once_through_codegen_without_builtins(monkeypatch):
    defined = []
    define = generated.define
    monkeypatch.setattr(generated, "define", lambda *args: defined.append(args[1]) or define(*args))
    pos = DynamicScalar("_d2", 7, "args[2]")
    expr = pos * np.float64(0.5) + pos // 2
    assert [expr.evaluate({"_d2": v, "_d9": None}) for v in (4, 8)] == [4.0, 8.0]
    assert len(defined) == 1 and defined[0].startswith("<jitcore dynamic scalar (")
    assert "".join(linecache.getlines(defined[0])) == f"def evaluate(_d2):\n    return {expr.source}\n"
    with pytest.raises(NameError, match="'_d2'"):  # a missing leaf: what eval said
        expr.evaluate({})
    with pytest.raises(NameError, match="'abs'"):  # no builtins
        DynamicScalar("abs(_d0)", 1, "args[0]").evaluate({"_d0": -1})
    with pytest.raises(ZeroDivisionError) as info:
        (1 // pos).evaluate({"_d2": 0})
    frame = traceback.extract_tb(info.tb)[-1]
    assert frame.filename == defined[-1] and frame.line.endswith("// _d2)")  # the generated line shows


@pytest.mark.parametrize(
    "use",
    [
        bool,
        int,
        float,
        hash,
        lambda p: p == 3,
        lambda p: p < 3,
        lambda p: f"{p:d}",
        lambda p: f"{p}",
        str,
        lambda p: "%s" % p,  # noqa: UP031 (the %-format is what is tested)
        lambda p: list(range(10))[p],
        lambda p: torch.full((2,), p),
        lambda p: torch.arange(p),
    ],
    ids=[
        "bool",
        "int",
        "float",
        "hash",
        "eq",
        "lt",
        "format",
        "f-string",
        "str",
        "%s",
        "index",
        "torch.full",
        "torch.arange",
    ],
)
def test_uses_that_would_bake_the_value_are_refused(use):
    """A string made of the value (``str(pos)`` returned, or a dict key chosen by it) would be
    the recording's at every replay: refused like a number made of it; ``repr`` stays a
    debugging aid that names it as what it is."""
    assert repr(DynamicScalar("_d0", 3, "args[0]")) == "DynamicScalar(args[0] = 3)"
    pos = DynamicScalar("_d0", 3, "args[0]")
    with pytest.raises((DynamicScalarError, TypeError)) as info:
        use(pos)
    if isinstance(info.value, DynamicScalarError):
        assert "args[0]" in str(info.value)
