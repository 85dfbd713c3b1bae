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

:func:`op_observer` picks how: where the torch-side helper is built (:mod:`jitcore.torch_native`),
:class:`NativeOpObserver`, the same answers from a C++ record-function callback, without the
dispatch mode's Python frames that an observed recording runs for every op of its region; else
:class:`TorchOpObserver`. Host inputs are always watched by :class:`TorchOpObserver`, which
must also rewrite their copies before they run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from jitcore.for_replay import torch_native_module
from replay import host as host_inputs
from replay.region_keys import byte_range

_aten = torch.ops.aten
#: Queries of a tensor's metadata: they read no data and launch nothing (replay.polymorphic
#: lets them pass an observed run too).
METADATA_QUERIES = (
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
#: Ops that take a tensor for its metadata (shape, dtype, device) and never read its data
#: (csrc/jitcore_torch_native.cpp's observer keeps the same list: tests/replay/test_observe.py).
METADATA_ONLY_NAMES = (
    *METADATA_QUERIES,
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
    "is_pinned",  # so ids.pin_memory() on a host input's (pinned) buffer is just the buffer
)
_METADATA_ONLY = {getattr(_aten, name) for name in METADATA_ONLY_NAMES if hasattr(_aten, name)}


class TorchOpObserver(TorchDispatchMode):
    """Records, per watched range, whether a torch op read it and whether one wrote it.

    ``host``: (leaf index, byte range) of the pinned buffers that stand in for host tensor
    arguments during a capture. An op touching one that is not a plain copy to a device
    tensor is noted in ``host_refusals`` (see :func:`replay.host.host_use_refusal`). With
    ``rewrite_blocking`` (a capture), such an op raises ``HostInputRefused`` before it runs,
    and the copies allowed run non-blocking (see :func:`replay.host.blocking_rewrite`).

    ``named``: the storages of the CPU tensors the region reaches by name (a global, a closure
    or module attribute: :func:`replay.host.named_host_ranges`), each with whether it is pinned.
    An op reading one on the CPU would bake its values into the graph, where a later in-place
    write would not reach them: noted (and raised in a capture) like a host input's misuse
    (:func:`replay.host.named_use_refusal`), never rewritten."""

    def __init__(
        self,
        ranges: Sequence[tuple[int, int]],
        host: Sequence[tuple[int, tuple[int, int]]] = (),
        describe=str,
        rewrite_blocking: bool = False,
        named: Sequence[tuple[tuple[int, int], bool]] = (),
    ):
        super().__init__()
        self.ranges = list(ranges)
        self.read: set[int] = set()
        self.written: set[int] = set()
        # watched ranges an op reached through a tensor that none of the ranges holds whole (a
        # global or closure tensor holding an argument, or a view wider than it): staging such
        # an input, or rebinding it, would part it from memory the op reads at a fixed address
        self.reached_beyond: set[int] = set()
        self.host = list(host)
        self.named = [(-1 - n, span) for n, (span, _pinned) in enumerate(named)]
        self.pinned = {-1 - n for n, (_span, pinned) in enumerate(named) if pinned}
        self.describe = describe
        self.rewrite_blocking = rewrite_blocking
        self.host_refusals: list[str] = []

    def _hits(self, tensor: torch.Tensor) -> list[int]:
        if tensor.device.type == "meta" or tensor.layout is not torch.strided:
            return []
        lo, hi = byte_range(tensor)
        if lo == hi:
            return []
        hits = [i for i, (a, b) in enumerate(self.ranges) if a < hi and lo < b]
        if hits and not any(a <= lo and hi <= b for a, b in self.ranges):
            self.reached_beyond.update(hits)
        return hits

    def _host_hits(self, arguments: tuple, args: tuple, kwargs: dict, host: Sequence = ()) -> tuple[dict, dict]:
        """The op's arguments by name, and which of them touch a host buffer (name -> input;
        ``host``: (index, byte range) of the buffers, the host inputs' by default)."""
        host = host or self.host
        named, hits = {}, {}
        for name, _written, value, tensors in _arguments_and_tensors(arguments, args, kwargs):
            named[name] = value
            for tensor in tensors:
                if tensor.device.type != "cpu" or tensor.layout is not torch.strided:
                    continue
                lo, hi = byte_range(tensor)
                for i, (a, b) in host:
                    if (a < hi and lo < b) or (lo == hi and a <= lo < max(b, a + 1)):
                        hits.setdefault(name, i)
        return named, hits

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if runs_as_its_parts(func):
            # only under inference mode (no autograd key) does a composite op reach a mode
            # whole; skipped as a view (``contiguous``, ``to``) it would hide the copy inside
            # it. Its own C++ kernel runs it as its parts, each seen here, as outside inference
            # mode (not ``decompose``, which prefers Python decompositions that may differ:
            # torch's ``dropout`` outside training returns its input, the Python one a clone)
            with self:
                return run_as_parts(func, args, kwargs)
        arguments = _schema_arguments(func)
        if arguments and self.named:
            named, hits = self._host_hits(arguments, args, kwargs, self.named)
            if hits:
                self._refuse(host_inputs.named_use_refusal(func, named, hits, self.pinned))
        if arguments and self.host:
            named, hits = self._host_hits(arguments, args, kwargs)
            if hits:
                self._refuse(host_inputs.host_use_refusal(func, named, hits, self.describe))
                if self.rewrite_blocking:
                    args, kwargs = host_inputs.blocking_rewrite(func, args, kwargs)
                result = self._observed(func, arguments, args, kwargs)
                self._refuse(host_inputs.host_use_refusal(func, named, hits, self.describe, result))
                return result
        return self._observed(func, arguments, args, kwargs)

    def _refuse(self, refusal: str | None) -> None:
        """Note a refusal; inside a capture (``rewrite_blocking``) also stop the region there,
        before the op runs on the CPU (a region that catches it is refused all the same)."""
        if refusal is not None:
            self.host_refusals.append(refusal)
            if self.rewrite_blocking:
                raise host_inputs.HostInputRefused(refusal)

    def _observed(self, func, arguments: tuple, args: tuple, kwargs: dict):
        if arguments and self.ranges:
            for _name, written, _value, tensors in _arguments_and_tensors(arguments, args, kwargs):
                for tensor in tensors:
                    for hit in self._hits(tensor):
                        self.read.add(hit)
                        if written:
                            self.written.add(hit)
        return func(*args, **kwargs)


def _arguments_and_tensors(arguments: tuple, args: tuple, kwargs: dict):
    """(name, written, value, the tensors in it) for each argument of an op's schema, as the
    call passed it (positionally or by keyword); no tensors for scalars and None."""
    for index, (name, written) in enumerate(arguments):
        value = args[index] if index < len(args) else kwargs.get(name)
        if value is None or isinstance(value, (int, float, bool, str)):
            tensors = []
        elif isinstance(value, torch.Tensor):
            tensors = [value]
        else:
            tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        yield name, written, value, tensors


#: Kernels that make an op more than its parts (csrc/jitcore_torch_native.cpp's runs_as_its_parts
#: checks the same keys: tests/replay/test_observe.py).
OWN_KERNEL_KEYS = (
    "CPU",
    "CUDA",
    "HIP",
    "Meta",
    "MPS",
    "XPU",
    "PrivateUse1",
    "QuantizedCPU",
    "QuantizedCUDA",
    "SparseCPU",
    "SparseCUDA",
    "NestedTensorCPU",
    "NestedTensorCUDA",
    "CompositeExplicitAutograd",
    "CompositeExplicitAutogradNonFunctional",
    "Autograd",
    "AutogradCPU",
    "AutogradCUDA",
    "Python",
    "FuncTorchBatched",
)
_PARTS: dict = {}
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd


def runs_as_its_parts(func) -> bool:
    """Whether an op only ever runs as the ops it is made of: a CompositeImplicitAutograd
    kernel and no kernel of its own. Cached per op."""
    found = _PARTS.get(func)
    if found is None:
        name = func.name()
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        found = has(name, "CompositeImplicitAutograd") and not any(has(name, key) for key in OWN_KERNEL_KEYS)
        _PARTS[func] = found
    return found


def run_as_parts(func, args: tuple, kwargs: dict):
    """Run a composite op (:func:`runs_as_its_parts`) through its own C++ kernel, so the ops it
    is made of are dispatched, and reach the active mode, one by one; call it with the mode
    active (``with mode:``)."""
    return func._op_dk(_COMPOSITE, *args, **kwargs)


_ARGUMENTS: dict = {}
_prepared = []


def prepare() -> None:
    """The first op dispatched through any Python dispatch mode makes torch import its
    compiler stack (hundreds of modules). Pay that once, when a session is created, not
    inside the first recording."""
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


class NativeOpObserver:
    """:class:`TorchOpObserver`'s answers (``read``, ``written``, ``reached_beyond``) for byte
    ranges, noted by the torch-side helper's record-function callback (op_observer_begin in
    csrc/jitcore_torch_native.cpp): every operator the dispatcher runs on this thread, with the
    dispatch mode's rules (views, metadata-only ops, and composite ops seen as their parts).
    Sets accumulate over several ``with`` blocks, as the mode's do. Where the helper says the
    observation cannot be trusted (record functions turned off on the thread, an op whose
    inputs could not be read), every range counts as read, written and reached beyond, and
    ``failure`` says why: the caller then stages or refuses what it must.

    The answers are live, as the mode's sets are: read inside the block, they ask the helper
    what the ops did so far. The capture's refusals are made there, before the block ends
    (replay.recording._run_region): answers kept until the end would let them pass unseen."""

    def __init__(self, ranges: Sequence[tuple[int, int]], helper) -> None:
        self.ranges = list(ranges)
        self.host_refusals: list[str] = []  # (host inputs are TorchOpObserver's alone)
        self._read: set[int] = set()
        self._written: set[int] = set()
        self._beyond: set[int] = set()
        self._failure: str | None = None
        self._helper = helper
        self._token = None

    def __enter__(self) -> NativeOpObserver:
        self._token = self._helper.op_observer_begin(self.ranges)
        return self

    def __exit__(self, *exc_info) -> None:
        token, self._token = self._token, None
        self._take(self._helper.op_observer_end(token))

    def _take(self, answers: tuple) -> None:
        read, written, beyond, failure = answers
        if failure is not None:
            self._failure = failure
            read = written = beyond = range(len(self.ranges))
        self._read.update(read)
        self._written.update(written)
        self._beyond.update(beyond)

    def _answers_so_far(self) -> NativeOpObserver:
        if self._token is not None:
            self._take(self._helper.op_observer_peek(self._token))
        return self

    @property
    def read(self) -> set[int]:
        return self._answers_so_far()._read

    @property
    def written(self) -> set[int]:
        return self._answers_so_far()._written

    @property
    def reached_beyond(self) -> set[int]:
        return self._answers_so_far()._beyond

    @property
    def failure(self) -> str | None:
        return self._answers_so_far()._failure


def op_observer(ranges: Sequence[tuple[int, int]]) -> TorchOpObserver | NativeOpObserver:
    """The observer of torch ops over these byte ranges: the helper's where it is built."""
    helper = torch_native_module()
    if helper is not None:
        return NativeOpObserver(ranges, helper)
    return TorchOpObserver(ranges)
