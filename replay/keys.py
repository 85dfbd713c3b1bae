"""Region keys: the structure of the arguments plus a shape-exact signature of every leaf.

A graph bakes in grids and sizes, so a replay key is shape-exact even where a jit key is
shape-dynamic: tensors contribute jitcore's lean static signature (dtype, shape, strides,
unit-stride axis, alignment, device, read straight from the tensor, no DLPack); dynamic
scalars their type; every other leaf its type and value. The key also carries the current
device, since graphs are recorded and replayed per device.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np
import torch

import jitcore
from replay.dynamic import Dynamic

FLAT = "flat"  # spec of a call whose arguments are all positional leaves

_CONSTANT_TYPES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum, np.generic)


def _flatten_into(value: object, leaves: list, path: str, paths: list) -> object:
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Tensor):
        kind = "tuple" if isinstance(value, tuple) else "list"
        if isinstance(value, tuple) and type(value) is not tuple:  # a named tuple: keep its type
            kind = type(value)
        return (kind, tuple(_flatten_into(v, leaves, f"{path}[{i}]", paths) for i, v in enumerate(value)))
    if isinstance(value, dict):
        keys = tuple(value)
        try:
            hash(keys)
        except TypeError:
            raise TypeError(f"{path}: dict keys of region arguments must be hashable") from None
        return ("dict", keys, tuple(_flatten_into(value[k], leaves, f"{path}[{k!r}]", paths) for k in keys))
    leaves.append(value)
    paths.append(path)
    return None


def flatten(args: tuple, kwargs: dict) -> tuple[object, list, list[str]]:
    """(spec, leaves, paths): nested tuples, lists and dicts are walked; everything else is a
    leaf. ``paths`` name each leaf for messages (``args[1]['kv']``)."""
    if not kwargs and not any(isinstance(a, (tuple, list, dict)) for a in args):
        return (FLAT, len(args)), list(args), [f"args[{i}]" for i in range(len(args))]
    leaves: list = []
    paths: list[str] = []
    spec = (
        tuple(_flatten_into(a, leaves, f"args[{i}]", paths) for i, a in enumerate(args)),
        tuple(kwargs),
        tuple(_flatten_into(v, leaves, k, paths) for k, v in kwargs.items()),
    )
    return spec, leaves, paths


def _rebuild(spec: object, leaves: Sequence, position: list[int]) -> object:
    if spec is None:
        value = leaves[position[0]]
        position[0] += 1
        return value
    kind = spec[0]
    if kind == "dict":
        return {k: _rebuild(s, leaves, position) for k, s in zip(spec[1], spec[2])}
    items = [_rebuild(s, leaves, position) for s in spec[1]]
    if kind == "tuple":
        return tuple(items)
    if kind == "list":
        return items
    return kind(*items)  # named tuple


def unflatten(spec: object, leaves: Sequence) -> tuple[tuple, dict]:
    """Rebuild (args, kwargs) from a spec and (possibly replaced) leaves."""
    if spec[0] == FLAT:
        return tuple(leaves), {}
    position = [0]
    args = tuple(_rebuild(s, leaves, position) for s in spec[0])
    kwargs = {k: _rebuild(s, leaves, position) for k, s in zip(spec[1], spec[2])}
    return args, kwargs


def leaf_key(leaf: object, path: str) -> object:
    """The key element of one leaf."""
    if isinstance(leaf, torch.Tensor):
        return jitcore.lean_static_signature(leaf)
    if isinstance(leaf, Dynamic):
        return ("dynamic", type(leaf.value).__qualname__)
    if isinstance(leaf, _CONSTANT_TYPES):
        return (type(leaf).__qualname__, leaf)
    try:
        hash(leaf)
    except TypeError:
        raise TypeError(
            f"region argument {path} is an unhashable {type(leaf).__qualname__}; region arguments are "
            "tensors, scalars (wrap runtime ones in replay.dynamic), hashable constants, and tuples, "
            "lists and dicts of those"
        ) from None
    return (type(leaf).__qualname__, leaf)  # an opaque constant: keyed (and baked) by its value


def region_key(device: int, spec: object, leaves: Sequence, paths: Sequence[str]) -> tuple:
    return (device, spec, *(leaf_key(leaf, path) for leaf, path in zip(leaves, paths)))


def plain_leaves(leaves: Sequence) -> list:
    """Leaves with dynamic markers replaced by their values: what an eager run receives."""
    return [leaf.value if isinstance(leaf, Dynamic) else leaf for leaf in leaves]


def extent_bytes(tensor: torch.Tensor) -> int:
    """Bytes from the data pointer to one past the last element the tensor can reach."""
    if tensor.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()) if size > 0)
    return (last + 1) * tensor.element_size()
