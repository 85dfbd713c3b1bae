"""Dynamic scalars: arithmetic builds expressions; anything that would bake a value refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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
    assert eval(expr.source, {}, {"_d2": 10}) == (10 + 1) * 2 - 10 // 3
    assert (3 - pos).value == -4 and (-pos).value == -7 and (pos / 2).value == 3.5
    assert expr.__jit_scalar__() == expr.value


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
        lambda p: list(range(10))[p],
        lambda p: torch.full((2,), p),
        lambda p: torch.arange(p),
    ],
    ids=["bool", "int", "float", "hash", "eq", "lt", "format", "index", "torch.full", "torch.arange"],
)
def test_uses_that_would_bake_the_value_are_refused(use):
    pos = DynamicScalar("_d0", 3, "args[0]")
    with pytest.raises((DynamicScalarError, TypeError)) as info:
        use(pos)
    if isinstance(info.value, DynamicScalarError):
        assert "args[0]" in str(info.value)
