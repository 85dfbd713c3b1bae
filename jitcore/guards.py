"""Tensor guards: a check, in C++, that tensors still fit a compiled call state or graph.

Computing a key reads four or five attributes per tensor in Python (dtype, strides, device,
the negative bit), about 0.6 us per tensor. When the same call state serves call after call,
a guard can answer "do these tensors still satisfy everything the state assumed?" in one
C++ call: torch's own dynamo guard evaluator (``torch._C._dynamo.guards.TensorGuards``)
compares the dispatch key set (device type, conjugate/negative bits, sparse, subclasses),
dtype, device index, requires_grad, and every size and stride we mark static.

The guard is only an inline cache in front of the key path, never a replacement for it: a
guard that says no sends the call down the ordinary key path, and where torch lacks the
evaluator (or it changes shape between releases) :func:`tensor_guard` returns None and every
call takes the key path. It is stricter than a key (requires_grad and inference mode count),
never looser: each static size and stride it checks is one the state was compiled for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

try:  # torch's C++ guard evaluator (used by torch.compile on every call)
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except Exception:  # pragma: no cover - older or stripped torch builds
    _TensorGuards = None

DYNAMIC = None  # a size/stride entry the guard does not check


def available() -> bool:
    return _TensorGuards is not None


def tensor_guard(
    examples: Sequence[torch.Tensor],
    sizes: Sequence[Sequence[int | None]],
    strides: Sequence[Sequence[int | None]],
) -> Callable[..., bool] | None:
    """A ``check(*tensors) -> bool`` for tensors like ``examples``, checking each static size
    and stride (``None`` entries are left unchecked); None if guards are unavailable."""
    if _TensorGuards is None or not examples:
        return None
    try:
        guard = _TensorGuards(
            *examples,
            dynamic_dims_sizes=[list(s) for s in sizes],
            dynamic_dims_strides=[list(s) for s in strides],
        )
        check = guard.check
        if not check(*examples):  # self-test: it must accept what it was built from
            return None
    except Exception:
        return None
    return check
