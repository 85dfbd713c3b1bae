"""Which region inputs torch ops touch, seen through torch's dispatcher.

A torch op inside a region is captured into the graph with its tensor addresses baked in; the
replay layer cannot patch it, so an input such an op reads must be staged (copied into the
recorded buffer) and one it writes copied back. :class:`TorchOpObserver` is a
``TorchDispatchMode`` active while a region runs eagerly (the warm-up before recording) and
while it is captured: every non-view op reports the tensors it reads and writes, and the
observer maps them to region inputs by address range (so views and slices count).

This is exact for torch ops, including indirect ones (pointer arrays built inside a library
kernel) because it looks at op arguments, not at kernel parameters. Kernels neither torch nor
jitcore launched (Triton, CuPy) are caught after capture by scanning graph nodes instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from replay.region_keys import byte_range

_aten = torch.ops.aten
# Ops that take a tensor for its metadata (shape, dtype, device) and never read its data.
_METADATA_ONLY = {
    getattr(_aten, name)
    for name in (
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
        "size",
        "stride",
        "numel",
        "dim",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_contiguous",
        "is_same_size",
    )
    if hasattr(_aten, name)
}


class TorchOpObserver(TorchDispatchMode):
    """Records, per watched range, whether a torch op read it and whether one wrote it."""

    def __init__(self, ranges: Sequence[tuple[int, int]]):
        super().__init__()
        self.ranges = list(ranges)
        self.read: set[int] = set()
        self.written: set[int] = set()

    def _hits(self, tensor: torch.Tensor) -> list[int]:
        if tensor.device.type == "meta" or tensor.layout is not torch.strided:
            return []
        lo, hi = byte_range(tensor)
        if lo == hi:
            return []
        return [i for i, (a, b) in enumerate(self.ranges) if a < hi and lo < b]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        arguments = _schema_arguments(func)
        if arguments and self.ranges:
            for index, (name, written) in enumerate(arguments):
                value = args[index] if index < len(args) else kwargs.get(name)
                if value is None or isinstance(value, (int, float, bool, str)):
                    continue
                tensors = (
                    [value]
                    if isinstance(value, torch.Tensor)
                    else [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
                )
                for tensor in tensors:
                    for hit in self._hits(tensor):
                        self.read.add(hit)
                        if written:
                            self.written.add(hit)
        return func(*args, **kwargs)


_ARGUMENTS: dict = {}
_prepared = []


def prepare() -> None:
    """The first op dispatched through any Python dispatch mode makes torch import its
    compiler stack (about 800 modules, 1 to 6 s). Pay that once, when a session is created,
    not inside the first recording."""
    if not _prepared:
        _prepared.append(True)
        with TorchOpObserver([]):
            torch.empty(1).add_(1)


def _schema_arguments(func) -> tuple:
    """(name, written) for each argument of an op that reads data; () for views and
    metadata-only ops. Cached per op."""
    arguments = _ARGUMENTS.get(func)
    if arguments is None:
        if getattr(func, "is_view", False) or func.overloadpacket in _METADATA_ONLY:
            arguments = ()
        else:
            arguments = tuple(
                (a.name, a.alias_info is not None and a.alias_info.is_write) for a in func._schema.arguments
            )
        _ARGUMENTS[func] = arguments
    return arguments
