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


def tensor_guard(
    examples: Sequence[torch.Tensor],
    sizes: Sequence[Sequence[int | None]],
    strides: Sequence[Sequence[int | None]],
) -> Callable[..., bool] | None:
    """A ``check(*tensors) -> bool`` for tensors like ``examples``, checking each static size
    and stride (``None`` entries are left unchecked); None if guards are unavailable."""
    if _TensorGuards is None or not examples:
        return None
    if not all(_plain_strided(t) for t in examples):
        return None  # the evaluator's self-test below would abort on a nested example
    try:
        guard = _TensorGuards(
            *examples,
            dynamic_dims_sizes=[list(s) for s in sizes],
            dynamic_dims_strides=[list(s) for s in strides],
        )
        check = _screened(guard.check, len(examples))
        if not check(*examples):  # self-test: it must accept what it was built from
            return None
    except Exception:
        return None
    return check


def _plain_strided(tensor: object) -> bool:
    return isinstance(tensor, torch.Tensor) and not tensor.is_nested


def _screened(raw: Callable[..., bool], count: int) -> Callable[..., bool]:
    """``raw`` behind a Python screen for tensors torch's evaluator cannot survive.

    The C++ evaluator reads every argument's strides before it compares dispatch keys, and a
    strided nested tensor (``torch.nested.nested_tensor([...])``: class ``torch.Tensor``,
    layout ``strided``) throws from ``strides()`` inside code that cannot propagate the
    exception, so the process aborts (SIGABRT) instead of the guard saying no. Every other
    unusual tensor (sparse, meta, mkldnn, quantized, jagged nested, subclasses) is refused by
    the evaluator itself; ``tests/jitcore/test_adaptors.py`` checks each in a subprocess. Any
    argument whose ``is_nested`` cannot be read (not a tensor) is refused here too.
    The screen costs one Python frame and one attribute read per tensor (about 50 ns)."""
    names = [f"t{i}" for i in range(count)]
    params = ", ".join(names)
    nested = " or ".join(f"{name}.is_nested" for name in names)
    source = (
        f"def check({params}, /):\n"
        "    try:\n"
        f"        if {nested}:\n"
        "            return False\n"
        "    except Exception:\n"
        "        return False\n"
        f"    return _raw({params})\n"
    )
    namespace: dict[str, object] = {"_raw": raw}
    exec(compile(source, "<jitcore tensor guard>", "exec"), namespace)
    check = namespace["check"]
    check.raw = raw
    return check
