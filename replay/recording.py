"""Recording a region into a CUDA/HIP graph, and working out how to rebind it.

One recording: stream capture of the region on the session's capture stream and memory pool
(thread-local capture mode, ``keep_graph=True``) with the jitcore recorder installed (every jit
launch is logged with its parameter provenance, and a jit cache miss aborts the capture before
anything compiles) and the torch-op observer active. Then the graph is instantiated, its
nodes read, and :func:`replay.rebinding.build_plan` decides what to patch and what to stage.

Capture goes through ``CUDAGraph.capture_begin/capture_end`` rather than the
``torch.cuda.graph`` context manager: the latter synchronizes the device and empties the
allocator cache on entry, which a recording need not pay (the session's pool is private and
nothing captured runs until the graph is launched).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import enum
import itertools
import logging
import os
import struct
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Protocol

import attrs
import numpy as np
import torch

from jitcore import CaptureMissError, for_replay
from jitcore.for_replay import LaunchRecord, ParamRecord, get_backend
from replay import host as host_inputs
from replay import instrumentation, output_identity, rebinding, staging, triton_launches
from replay.dynamic import Dynamic, DynamicScalar
from replay.errors import DynamicScalarError
from replay.observe import TorchOpObserver, op_observer
from replay.region_keys import byte_range, extent_bytes, flatten, storage_range, unflatten

log = logging.getLogger("replay")

_NUMBERS = (int, float, bool)
_POINTER = struct.Struct("<Q")  # a pointer parameter's bytes


class OpObservation(Protocol):
    """What an op observer saw (replay.observe's observers, or none): indices into the
    watched ranges that torch ops read and wrote."""

    @property
    def read(self) -> Collection[int]: ...

    @property
    def written(self) -> Collection[int]: ...


class _NoObservation:
    read: frozenset = frozenset()
    written: frozenset = frozenset()
    reached_beyond: frozenset = frozenset()
    host_refusals: tuple = ()


class CaptureAborted(Exception):
    """The capture must be retried later (a jit miss: compile eagerly first)."""


class RecordLater(CaptureAborted):
    """The analysis found the capture unusable for now (a launch skipped because a dynamic
    grid size was 0 has no node to patch); a later recording may succeed."""


class CaptureFailed(Exception):
    """This key cannot be captured; ``reason`` says why (it will run eagerly)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class CaptureRetry(Exception):
    """The capture showed more inputs must be staged; record again with them."""


#: Held exclusively by every recording (capture begin to instantiate) and by whatever must
#: not run while another thread captures (a device-wide synchronize, emptying the
#: allocator's cache); held shared by eager runs of regions and jit compiles, which may load
#: modules (see jitcore.recorder.CaptureExclusion). Sessions in different threads take turns
#: recording and replay concurrently.
CAPTURES = for_replay.CAPTURES


class Recorder:
    """The jitcore recorder: keeps every launch (and the graph node it became, where the
    backend can say), refuses every miss. Packed launches append their records and nodes
    themselves (``launch_sink``), as :meth:`launch` does, without a Python call per launch."""

    def __init__(self, backend) -> None:
        self.records: list = []
        self.nodes: list[int | None] = []
        self.backend = backend
        self.launch_sink = (self.records, self.nodes, backend.capture_tail_function())

    def launch(self, record) -> None:
        self.records.append(record)
        tail = self.backend.capture_tail(record.stream) if getattr(record, "launched", True) else None
        self.nodes.append(tail[0] if tail and len(tail) == 1 else None)

    def miss(self, description: str) -> None:
        raise CaptureMissError(f"{description} (during replay recording: compile eagerly first)")


@attrs.define
class Capture:
    """Everything a successful capture produced. ``nodes`` and ``plan`` are filled in by
    :func:`analyse`, which the session defers to the key's second call: the first replay
    uses the very pointers the graph was recorded with, so it needs no rebinding."""

    graph: torch.cuda.CUDAGraph
    device: int
    outputs: object  # what the region returned (tensors in the pool, constants, dynamic scalars)
    records: list
    inputs: list[rebinding.InputRange]
    input_dtypes: dict[int, torch.dtype]
    dynamic_values: dict[int, object]  # leaf index -> the value recorded for a dynamic scalar
    staged: dict[int, torch.Tensor]  # leaf index -> the graph's own buffer
    copied_back: set[int]
    torch_read: set[int]
    torch_written: set[int]
    seconds: float  # capture + instantiate
    memory: int  # bytes the pool grew by
    output_bytes: int = 0  # memory of the outputs' own buffers (outside the pool)
    owned_outputs: set = attrs.Factory(set)  # data pointers of those buffers' storages
    staging_launches: dict = attrs.Factory(dict)  # record index -> input index (our staging copies)
    launch_nodes: list = attrs.Factory(list)  # per record: the graph node it became (raw handle) or None
    nodes: list = attrs.Factory(list)
    # rebinding.NodeView of each node, read by analyse (None: a kernel's parameters could not be read)
    node_views: list | None = attrs.Factory(list)
    plan: rebinding.Plan | None = None
    # host (CPU) tensor inputs: their pinned buffers and the event of the last launch
    # (replay.host); None without any. Not in ``inputs``: the graph never sees their memory.
    host: host_inputs.HostInputs | None = None
    # per launch record, {parameter index: replay.polymorphic.StorageUse}; None unless asked for
    pointer_storages: list | None = None
    # per launch record: {pointer parameter: rebinding.Extent of the jit argument it came from},
    # for pointers into an input whose provenance the plan must check (pointer_extents)
    pointer_extents: list = attrs.Factory(list)
    # (first byte, one past the last) of each segment of the session's pool after the capture:
    # memory only graphs use, which no caller's tensor can share
    pool_memory: list = attrs.Factory(list)
    # which outputs are the caller's own objects, and where the outputs it owns live
    # (replay.output_identity.OutputIdentity)
    identity: output_identity.OutputIdentity = output_identity.UNKNOWN


class KeptPool:
    """A graph memory pool that stays valid while this object lives.

    torch counts the users of a pool in two allocators (device and pinned host) and frees the
    pool, poisoning its id, when the count drops to zero, as it does when the last graph
    recorded into it is released. Capturing an empty graph into the pool first, and keeping
    that graph, holds one count in both for the life of this object."""

    def __init__(self, device: int, stream: torch.cuda.Stream):
        with torch.cuda.device(device):
            self.id = torch.cuda.graph_pool_handle()
        weakref.finalize(self, _forget_pool, device, tuple(self.id))
        self.device = device
        self.keeper = torch.cuda.CUDAGraph()
        # a capture like any other: thread-local mode, and never beside another thread's
        with warnings.catch_warnings(), CAPTURES.exclusive():
            warnings.simplefilter("ignore")  # "The CUDA Graph is empty": that is the point
            with torch.cuda.stream(stream):
                self.keeper.capture_begin(pool=self.id, capture_error_mode="thread_local")
                self.keeper.capture_end()


@attrs.frozen
class _KnownPool:
    """A private pool's segments as last measured, and the allocator's counts of device
    allocations and frees on its device read just before (None where torch does not say)."""

    counts: tuple[int, int] | None
    segments: list[tuple[int, int]]  # (address, bytes)


#: Each private pool as last measured, by (device, pool id): what the pool held before a
#: recording, for the recording's memory figure, and what stats and the compaction rule read,
#: without a snapshot of the allocator (whose cost grows with every block the process holds).
#: Only captures grow a pool, and a live pool keeps every segment it has: the segments known
#: are the pool's (it may have more). While the allocator's counts of device allocations and
#: frees on the device have not moved since, no segment of any pool came or went, and the
#: segments known are all the pool's (see current_pool_segments).
_KNOWN_POOLS: dict[tuple[int, tuple], _KnownPool] = {}


def _forget_pool(device: int, pool: tuple) -> None:
    _KNOWN_POOLS.pop((device, pool), None)


def _device_segment_counts(device: int) -> tuple[int, int] | None:
    """(device allocations, device frees) the caching allocator has made on ``device``: every
    segment it maps or unmaps moves one of them. None where torch does not say."""
    stats = getattr(torch._C, "_cuda_memoryStats", None)
    try:
        found = stats(device) if stats is not None else {}
    except Exception:
        return None
    counts = (found.get("num_device_alloc"), found.get("num_device_free"))
    return counts if all(isinstance(c, int) for c in counts) else None


def current_pool_segments(device: int, pool: tuple) -> tuple[list[tuple[int, int]], bool]:
    """(the pool's segments now, whether they were measured by a snapshot): the segments last
    measured while the allocator's counts of device allocations and frees on the device are
    those read before that measurement (no segment came or went since), else
    :func:`pool_segments`. The counts can only say "unchanged" wrongly where torch's
    accumulated statistics were reset in between and then reached the same numbers again:
    exactness never rests on them (a recording's own outputs check the segments they rely
    on, see _pool_memory_holding); a memory figure could miss a segment."""
    known = _KNOWN_POOLS.get((device, tuple(pool)))
    if known is not None and known.counts is not None and known.counts == _device_segment_counts(device):
        return known.segments, False
    return pool_segments(device, pool), True


def pool_segments(device: int, pool: tuple) -> list[tuple[int, int]]:
    """(address, bytes) of each segment of a private memory pool, from the allocator's
    snapshot (which also updates :func:`known_pool_bytes`). Asked of the pool alone: with the
    pool's own id where torch's one-pool snapshot takes nothing from it, else with numbers of
    our own equal to it, given back what torch took (:func:`_one_pool_segments_given_back`).
    Where neither can be done safely (an older torch; a Python whose small numbers are not
    immortal, asked of an id that holds one), taken from the whole allocator's snapshot, each
    segment's pool read from it: that lists every block of the process (a model's weights),
    where the pool's own snapshot lists the pool's alone (torch still walks every block to
    pick them: benchmarks/pool_snapshot.py)."""
    found = None
    counts = _device_segment_counts(device)  # before the snapshot: a segment in between moves them
    try:
        if not _one_pool_snapshot_takes_its_ids():
            found = _segments_of(torch.cuda.memory_snapshot(mempool_id=pool, include_traces=False), device)
        elif all(_can_give_back(n) for n in pool):
            found, _taken = _one_pool_segments_given_back(device, pool)
    except TypeError:  # older torch: no per-pool snapshot
        pass
    if found is None:
        found = [
            (s["address"], s["total_size"])
            for s in _whole_snapshot()
            if s.get("device") == device and tuple(s.get("segment_pool_id", ())) == tuple(pool)
        ]
    _KNOWN_POOLS[(device, tuple(pool))] = _KnownPool(counts, found)
    return found


def _segments_of(snapshot: list[dict], device: int) -> list[tuple[int, int]]:
    return [(s["address"], s["total_size"]) for s in snapshot if s.get("device", device) == device]


#: Small numbers are shared by the whole interpreter; from Python 3.12 on they are immortal
#: (taking a reference from one does nothing), before that they are not.
_SMALL_NUMBERS_IMMORTAL = sys.version_info >= (3, 12)


def _can_give_back(number: int) -> bool:
    """Whether what torch takes from a copy of ``number`` can be measured and given back: the
    copy is an object of our own, or an immortal one."""
    return _SMALL_NUMBERS_IMMORTAL or not -5 <= number <= 256


def _one_pool_segments_given_back(device: int, pool: tuple) -> tuple[list[tuple[int, int]], bool]:
    """torch's one-pool snapshot, asked with copies of the pool's numbers that nothing else
    holds (so that the session's own id is never handed to it). Two spare holders keep each
    copy alive through the call, whatever it takes; afterwards, with the snapshot dropped,
    each copy's reference count is compared with its count before, and what was taken is
    given back through the C API, as torch took it (immortal numbers: nothing to compare).
    Giving back too much could only keep a number alive; too little never happens, as the
    count is read when nothing but our holders remains. Returns (segments, whether anything
    was taken)."""
    own = tuple(int.from_bytes(n.to_bytes(16, "little", signed=True), "little", signed=True) for n in pool)
    spares = [*own, *own]
    before = [sys.getrefcount(n) for n in own]
    snapshot = None
    try:
        snapshot = torch.cuda.memory_snapshot(mempool_id=own, include_traces=False)
        found = _segments_of(snapshot, device)
    finally:
        snapshot = None  # its entries might hold the copies: let go before they are counted
        after = [sys.getrefcount(n) for n in own]  # (read as `before` was)
        taken = [held - now for held, now in zip(before, after)]
        for number, count in zip(own, taken):
            for _ in range(count):
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(number))
        del spares
    return found, any(count > 0 for count in taken)


def _whole_snapshot() -> list[dict]:
    try:
        return torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # older torch: traces always
        return torch.cuda.memory_snapshot()


#: Whether torch's snapshot of one pool takes a reference from each number of the pool's id
#: (empty: not asked yet). torch 2.11's ``_cuda_memorySnapshot`` does: each call frees a
#: reference it never held. Numbers up to 256 are shared forever and survive it; a process's
#: 257th pool has ids that do not, and a few recordings later the interpreter read freed
#: memory (crashes in unrelated code, found by the GPU suite). Where it does, pool_segments
#: never hands it the pool's own id (see :func:`_one_pool_segments_given_back`).
_SNAPSHOT_TAKES_POOL_IDS: list[bool] = []


def _one_pool_snapshot_takes_its_ids() -> bool:
    """Asked once per process, of numbers no pool has: whether a one-pool snapshot leaves
    them with fewer references than it found (what it took is given back)."""
    if not _SNAPSHOT_TAKES_POOL_IDS:
        try:
            _found, taken = _one_pool_segments_given_back(0, ((1 << 52) + os.getpid(), (1 << 53) + os.getpid()))
        except TypeError:  # older torch: no per-pool snapshot (pool_segments falls back)
            taken = False
        _SNAPSHOT_TAKES_POOL_IDS.append(taken)
        if taken:
            log.info("torch's one-pool memory snapshot takes references from the pool's id: asked with copies of it")
    return _SNAPSHOT_TAKES_POOL_IDS[0]


def pool_bytes(device: int, pool: tuple) -> int:
    """Bytes reserved by a private memory pool (its segments) now (:func:`current_pool_segments`)."""
    return sum(size for _, size in current_pool_segments(device, pool)[0])


def known_pool_bytes(device: int, pool: tuple) -> int | None:
    """:func:`pool_bytes` as last measured (None if never)."""
    known = _KNOWN_POOLS.get((device, tuple(pool)))
    return None if known is None else sum(size for _, size in known.segments)


def _end_capture_after_error(graph: torch.cuda.CUDAGraph, device: int, pool: tuple) -> bool:
    """Leave no capture running and the device allocator routing nothing to the pool.

    Returns True when the pool must not be captured into again: where torch's
    ``capture_end`` fails (the capture was invalidated), it skips ending the pool's routing,
    and while the device allocator's can be ended from Python, the pinned host allocator's
    cannot, so the next ``capture_begin`` on that pool would fail ("already recording to
    mempool_id"). The session then moves its recordings to a fresh pool."""
    spoiled = False
    try:
        graph.capture_end()
    except Exception:
        spoiled = True
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end is not None:
            try:
                end(device, pool)
            except Exception:
                pass  # already ended (a torch that ends routing before checking the capture)
    try:
        graph.reset()
    except Exception:
        pass
    if spoiled:  # a clean capture_end already took the generator out of capture mode
        _repair_generator(device)
    return spoiled


#: How many times a generator was given a fresh state (``_repair_generator``). A graph that
#: draws random numbers was registered with the state of its recording's epoch; once the
#: epoch moved on, its replay would advance a state nobody draws from, so it declines.
GENERATOR_EPOCH = [0]


def _repair_generator(device: int) -> None:
    """torch leaves the default CUDA generator in capture mode when a capture fails at its
    end (pytorch#171263), after which every random op raises "Offset increment outside graph
    capture". Give it a fresh state (not capturing) with the same seed and offset: the failed
    capture drew nothing that counts. Graphs recorded before hold the old state object and
    would advance it instead: the session records its random-drawing graphs again
    (:meth:`replay.session.Session.retire_pool`)."""
    try:
        generator = torch.cuda.default_generators[device]
        fresh = torch.Generator(device=f"cuda:{device}")
        fresh.manual_seed(generator.initial_seed())
        fresh.set_offset(generator.get_offset())
        generator.graphsafe_set_state(fresh.graphsafe_get_state())
        GENERATOR_EPOCH[0] += 1
    except Exception:
        try:
            generator.graphsafe_set_state(generator.clone_state())
        except Exception:
            pass


class SpoiledPool(CaptureFailed):
    """A capture failed in a way that leaves its memory pool unusable for further captures
    (see :func:`_end_capture_after_error`); the session moves to a fresh pool."""


_KEPT_ARGUMENTS = (DynamicScalar, *_NUMBERS)


def scalar_or_none(value: object) -> object:
    """What analysis needs of a jit argument: dynamic scalars and numbers; nothing else."""
    kind = value.__class__
    if kind is torch.Tensor:  # most arguments, then plain numbers: answered before the isinstance test
        return None
    if kind is float or kind is int or isinstance(value, _KEPT_ARGUMENTS) or hasattr(value, "__jit_scalar__"):
        return value
    return None


_literal_names = itertools.count()


#: ParamViews made from launch records' parameters, by the parameter record's id, the record
#: kept beside its view (so its id is not reused while cached). jit call states hand out the
#: same frozen records from recording to recording (jitcore.codegen.CallState._report), so a
#: view is mostly made once, not once per launch of every recording.
_PARAM_VIEWS: dict[int, tuple[object, rebinding.ParamView]] = {}
_PARAM_VIEWS_LIMIT = 4096


def _param_view(p) -> rebinding.ParamView:
    cached = _PARAM_VIEWS.get(id(p))
    if cached is not None and cached[0] is p:
        return cached[1]
    view = rebinding.ParamView(
        index=p.index,
        offset=p.offset,
        size=p.size,
        fmt=p.fmt,
        kind=p.kind,
        read_only=p.read_only,
        expression=p.expression,
        convert=p.convert,
        scalar_args=p.scalar_args,
        evaluate=p.evaluate,
        byte_offset=p.byte_offset,
        offset_scalar_args=getattr(p, "offset_scalar_args", ()),
        offset_evaluate=getattr(p, "offset_evaluate", None),
        aligned=getattr(p, "aligned", None),
    )
    if len(_PARAM_VIEWS) >= _PARAM_VIEWS_LIMIT:
        _PARAM_VIEWS.clear()
    _PARAM_VIEWS[id(p)] = (p, view)
    return view


#: The same for a launch record's whole ``params`` tuple, by its id (the tuple kept beside its
#: views): call states hand out one tuple for every launch whose pointers sit at the same
#: byte offsets (jitcore.codegen.CallState._report), so most launches' views are one lookup.
_PARAMS_VIEWS: dict[int, tuple[tuple, tuple[rebinding.ParamView, ...]]] = {}


def _param_views(params: Sequence) -> tuple[rebinding.ParamView, ...]:
    whole = _PARAMS_VIEWS.get(id(params))
    if whole is not None and whole[0] is params:
        return whole[1]
    views = []
    for p in params:
        cached = _PARAM_VIEWS.get(id(p))
        views.append(cached[1] if cached is not None and cached[0] is p else _param_view(p))
    views = tuple(views)
    if isinstance(params, tuple):  # immutable: its views hold as long as it lives
        if len(_PARAMS_VIEWS) >= _PARAM_VIEWS_LIMIT:
            _PARAMS_VIEWS.clear()
        _PARAMS_VIEWS[id(params)] = (params, views)
    return views


def _launch_view(
    record, node: int | None, staging_input: int | None = None, extents: dict | None = None
) -> rebinding.LaunchView:
    sources, dynamic, constants = _scalar_sources(record.args)
    # positional, in LaunchView's order (one is made per launch of every recording)
    return tuple.__new__(
        rebinding.LaunchView,
        (
            record.function,
            record.kernel,
            record.param_bytes,
            _param_views(record.params),
            sources,
            frozenset(dynamic),
            constants,
            _config_views(getattr(record, "dynamic_config", ())),
            getattr(record, "launched", True),
            node,
            _check_views(getattr(record, "checks", ())),
            staging_input,
            extents or {},
        ),
    )


def _scalar_sources(args: Sequence) -> tuple[dict[int, str], set[int], dict[str, object]]:
    """(jit argument index -> source, the dynamic ones, the constants the sources name) of a
    record's arguments (tensors dropped: None)."""
    sources, dynamic, constants = {}, set(), {}
    for k, arg in enumerate(args):
        if arg is None:
            continue  # a tensor, dropped from the record (scalar_or_none)
        kind = arg.__class__
        if kind is float or kind is int or kind is bool:
            value = arg  # (the common case, answered first: no such object has __jit_scalar__)
        elif isinstance(arg, DynamicScalar):
            sources[k] = arg.source
            constants.update(arg.constants)
            dynamic.add(k)
            continue
        elif isinstance(arg, _NUMBERS) or hasattr(arg, "__jit_scalar__"):
            value = arg.__jit_scalar__() if hasattr(arg, "__jit_scalar__") else arg
        else:
            continue
        # a plain number: bound by name, never pasted into generated code by its repr
        name = f"_lit{next(_literal_names)}"
        constants[name] = value
        sources[k] = name
    return sources, dynamic, constants


#: The views of a record's ``dynamic_config`` and ``checks`` tuples, by the tuple's id (kept
#: beside them): call states hand the same tuples to every launch of one key.
_CONFIG_VIEWS: dict[int, tuple[tuple, tuple]] = {}


def _config_views(dynamic_config: Sequence) -> tuple:
    if not dynamic_config:
        return ()
    cached = _CONFIG_VIEWS.get(id(dynamic_config))
    if cached is not None and cached[0] is dynamic_config:
        return cached[1]
    views = tuple(
        rebinding.ConfigView(c.field, tuple(c.scalar_args), c.evaluate, getattr(c, "expression", ""))
        for c in dynamic_config
    )
    _remember_views(dynamic_config, views)
    return views


def _check_views(checks: Sequence) -> tuple:
    if not checks:
        return ()
    cached = _CONFIG_VIEWS.get(id(checks))
    if cached is not None and cached[0] is checks:
        return cached[1]
    views = tuple(rebinding.CheckView(tuple(c.scalar_args), c.value, c.size) for c in checks)
    _remember_views(checks, views)
    return views


def _remember_views(records: Sequence, views: tuple) -> None:
    if isinstance(records, tuple):  # immutable: its views hold as long as it lives
        if len(_CONFIG_VIEWS) >= _PARAM_VIEWS_LIMIT:
            _CONFIG_VIEWS.clear()
        _CONFIG_VIEWS[id(records)] = (records, views)


def launch_views(
    records: Sequence,
    nodes: Sequence[int | None] | None = None,
    staging: dict[int, int] | None = None,
    extents: Sequence[dict] | None = None,
) -> list[rebinding.LaunchView]:
    """The plan's view of each launch record (``extents``: :func:`pointer_extents`, per record)."""
    nodes = nodes if nodes is not None else [None] * len(records)
    staging = staging or {}
    extents = extents or [None] * len(records)
    return [
        _launch_view(record, node, staging.get(n), extent)
        for n, (record, node, extent) in enumerate(zip(records, nodes, extents))
    ]


def node_handle(node) -> int:
    try:
        return int(node.handle or 0)
    except (TypeError, ValueError):
        return 0


def launch_param_sizes(records: Sequence) -> dict[int, tuple[int, ...]]:
    """{function: its parameters' sizes} of the jit launches among ``records`` (what a kernel
    node of that function holds)."""
    sizes_of: dict[int, tuple[int, ...]] = {}
    for record in records:
        if record.function not in sizes_of:
            sizes_of[record.function] = tuple(t.size for t in record.layout.types)
    return sizes_of


def node_views(
    backend, nodes: Sequence, records: Sequence, sizes_of: dict[int, tuple[int, ...]] | None = None
) -> tuple[list[rebinding.NodeView], bool]:
    """Read each kernel node's parameters (those read with the node: ``GraphNode.params``):
    with the sizes of the jit launch that may be in it (``sizes_of``: :func:`launch_param_sizes`
    of ``records``), or the driver's parameter info for foreign kernels (None where unknown)."""
    sizes_of = dict(launch_param_sizes(records) if sizes_of is None else sizes_of)
    scanned = True
    views = []
    new = tuple.__new__
    for node in nodes:
        kind, handle = node.kind, node_handle(node)
        if kind == "kernel":
            params = node.params
            if params is None:
                sizes = sizes_of.get(node.function)
                if sizes is None:
                    sizes = sizes_of[node.function] = backend.kernel_param_sizes(node.function)
                params = None if sizes is None else tuple(backend.read_kernel_params(node, sizes))
            scanned = scanned and params is not None
            views.append(new(rebinding.NodeView, (node.index, kind, node.function, params, (), handle)))
        elif kind in ("memcpy", "memset"):
            views.append(new(rebinding.NodeView, (node.index, kind, 0, None, tuple(node.pointers), handle)))
        else:
            views.append(new(rebinding.NodeView, (node.index, kind, 0, None, (), handle)))
    return views, scanned


@attrs.frozen
class _CaptureInputs:
    """The region's tensor inputs as one capture uses them, prepared before it starts."""

    tensors: dict[int, torch.Tensor]  # leaf index -> the caller's tensor (device ones)
    inputs: list[rebinding.InputRange]
    staged: dict[int, torch.Tensor]  # leaf index -> the graph's own buffer for that input
    # the byte ranges the torch-op observer watches (the inputs, then the staged buffers),
    # and the leaf index of each
    watched: list[tuple[int, int]]
    watched_index: list[int]
    host: host_inputs.HostInputs | None = None  # host tensor inputs, staged through pinned buffers
    # staged input -> the byte range of its caller's storage, where that holds more than the
    # input: memory a global or closure tensor may reach it through (watched too, after
    # ``watched``: see observed_ranges and _refuse_staged_inputs_reached_otherwise)
    staged_storages: dict[int, tuple[int, int]] = attrs.Factory(dict)
    # input -> why a pointer into it may not follow it (input_doubts, taken before the region ran)
    doubts: dict[int, InputDoubt] = attrs.Factory(dict)
    # the CPU tensors the region reaches by name: (their storage's byte range, pinned), which
    # the capture's observer refuses to see read on the CPU (host.named_host_ranges)
    named_host: list[tuple[tuple[int, int], bool]] = attrs.Factory(list)

    def observed_ranges(self) -> list[tuple[int, int]]:
        """What the torch-op observer watches: ``watched``, then ``staged_storages``."""
        return self.watched + list(self.staged_storages.values())

    def host_buffers(self) -> dict[int, torch.Tensor] | None:
        return self.host.buffers if self.host is not None else None

    def host_ranges(self) -> list[tuple[int, int]]:
        return [r for _, r in self.host.ranges()] if self.host is not None else []

    def leaves_seen(self, watched_numbers: Iterable[int]) -> set[int]:
        """The inputs behind the watched ranges the observer saw touched, staged ones left
        out (their staging copies, not the region, touch the caller's memory)."""
        inputs = [self.watched_index[w] for w in watched_numbers if w < len(self.watched)]
        return {i for i in inputs if i not in self.staged}


@attrs.define
class _Recorded:
    """What the capture itself produced besides the graph."""

    # what the region returned (tensors in the pool, constants, dynamic scalars), until its
    # tensors are given memory of their own (the pool's then return to the pool)
    outputs: object
    observation: OpObservation  # what torch ops read and wrote (indices into the watched ranges)
    staging_launches: dict[int, int]  # record index -> the input a staging copy reads or writes
    copied_back: set[int]
    output_bytes: int = 0  # memory of the outputs' own buffers (outside the pool)
    owned_outputs: set[int] = attrs.Factory(set)  # data pointers of those buffers' storages


def input_ranges(tensors: dict[int, torch.Tensor], paths: Sequence[str]) -> list[rebinding.InputRange]:
    """The byte range of each tensor argument (leaf index -> tensor), as the plan sees it."""
    return [rebinding.InputRange(i, paths[i], *byte_range(t)) for i, t in tensors.items()]


def _prepare_inputs(
    leaves: Sequence,
    paths: Sequence[str],
    *,
    device: int,
    stage: set[int],
    held: HeldTensors | None = None,
    shadows: frozenset[int] = frozenset(),
) -> _CaptureInputs:
    """Check the tensor inputs are on the capture's device, note which of them the region may
    reach by another route (:func:`input_doubts`), and make the staged inputs' buffers
    (refusing inputs that cannot be staged). Raises CaptureFailed.

    ``shadows``: the tensors of object arguments (replay.objects), which the region reads
    through the object: never staged, and refused on the host (no pinned buffer can stand in)."""
    tensors = {i: leaf for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
    on_host = {i: t for i, t in tensors.items() if t.device.type == "cpu"}
    on_host_inside_objects = sorted(shadows & on_host.keys())
    if on_host_inside_objects:
        path = paths[on_host_inside_objects[0]]
        raise CaptureFailed(f"{path} is a CPU tensor inside an object argument: a graph would bake its values")
    stage = set(stage) - shadows
    for i, tensor in on_host.items():
        reason = host_inputs.unsupported_reason(tensor)
        if reason:
            raise CaptureFailed(f"host input {paths[i]} cannot be staged: {reason}")
    tensors = {i: t for i, t in tensors.items() if i not in on_host}
    for i, tensor in tensors.items():
        if tensor.device.type != "cuda" or tensor.device.index != device:
            raise CaptureFailed(f"input {paths[i]} is on {tensor.device}, the current device is cuda:{device}")
    doubts = input_doubts(tensors, held)
    for i, doubt in doubts.items():
        if doubt.itself:  # every route to it, torch ops' included, is the global's as well
            raise CaptureFailed(f"input {paths[i]}: {doubt.reason}, so replay cannot tell which route reaches it")
    stage = set(stage) - set(on_host)  # a warm-up saw torch read them: they are staged apart
    host = host_inputs.HostInputs(on_host, {i: paths[i] for i in on_host}) if on_host else None
    inputs = input_ranges(tensors, paths)
    staged: dict[int, torch.Tensor] = {}
    for i in sorted(stage):
        reason = staging.unsupported_reason(tensors[i])
        if reason:
            raise CaptureFailed(f"input {paths[i]} must be staged but {reason}")
        staged[i] = staging.staged_buffer(tensors[i])
        staging.prepare(tensors[i], staged[i])
        staging.prepare(staged[i], tensors[i])
    watched = [(r.lo, r.hi) for r in inputs] + [byte_range(b) for b in staged.values()]
    watched_index = [r.index for r in inputs] + list(staged)
    return _CaptureInputs(
        tensors,
        inputs,
        staged,
        watched,
        watched_index,
        host,
        _storages_beyond(tensors, staged, doubts),
        doubts,
        host_inputs.named_host_ranges((*held.named, *held.attributes, *held.watched) if held is not None else ()),
    )


def _storages_beyond(tensors: dict[int, torch.Tensor], staged: dict, doubts: Mapping) -> dict[int, tuple[int, int]]:
    """The caller's storage of each staged input that holds more than the input itself, or
    that another tensor held when the call began (``doubts``: a global may reach it)."""
    spans = {}
    for i in staged:
        span = storage_range(tensors[i])
        if span != byte_range(tensors[i]) or i in doubts:
            spans[i] = span
    return spans


def region_arguments(
    spec: object, leaves: Sequence, paths: Sequence[str], staged: dict, host: dict | None = None
) -> tuple[tuple, dict]:
    """The arguments the region is called with while capturing: each staged input replaced
    by its buffer (a host input by its pinned buffer), each dynamic scalar by a
    :class:`DynamicScalar` that jit launches report."""
    capture_leaves = list(leaves)
    host = host or {}
    for i, leaf in enumerate(leaves):
        if i in staged:
            capture_leaves[i] = staged[i]
        elif i in host:
            capture_leaves[i] = host[i]
        elif isinstance(leaf, Dynamic):
            capture_leaves[i] = DynamicScalar(f"_d{i}", leaf.value, paths[i])
    return unflatten(spec, capture_leaves)


def _copy_staged_in(prepared: _CaptureInputs, recorder: Recorder, staging_launches: dict[int, int]) -> None:
    """Captured first: copy each staged input into its buffer (remembering which launch
    records are these copies, for the plan)."""
    for i, buffer in prepared.staged.items():
        staging_launches[len(recorder.records)] = i
        staging.copy(prepared.tensors[i], buffer)


def _pointer_addresses(records: Sequence, *, written_only: bool = False) -> Iterator[tuple[LaunchRecord, int]]:
    """(record, address) of every pointer parameter the records' jit launches pass (only
    those not read-only, with ``written_only``)."""
    for record in records:
        for param in record.params:
            if param.kind == "pointer" and not (written_only and param.read_only):
                yield record, _POINTER.unpack_from(record.param_bytes, param.offset)[0]


def _inputs_written(prepared: _CaptureInputs, observation: OpObservation, region_records: Sequence) -> set[int]:
    """The inputs the region wrote: those torch ops wrote, and the staged inputs whose buffer
    a jit launch of the region writes through a pointer."""
    watched = len(prepared.watched)
    written = {prepared.watched_index[w] for w in observation.written if w < watched}
    if not prepared.staged:
        return written
    for _record, address in _pointer_addresses(region_records, written_only=True):
        for i, buffer in prepared.staged.items():
            if buffer.data_ptr() <= address < buffer.data_ptr() + max(extent_bytes(buffer), 1):
                written.add(i)
    return written


def _refuse_reads_beyond_inputs(prepared: _CaptureInputs, observation: OpObservation) -> None:
    """A torch op read a tensor that holds an input and reaches beyond it (``cache`` while
    ``cache[0]`` is the argument): the op reads that memory at a fixed address, while replay
    would rebind or stage the input apart from it, so the key runs eagerly. So does a capture
    whose observer could not watch every op (observe.NativeOpObserver.failure)."""
    failure = getattr(observation, "failure", None)
    if failure is not None:
        raise CaptureFailed(f"the torch-op observer could not watch the capture: {failure}")
    beyond = sorted(w for w in getattr(observation, "reached_beyond", ()) if w < len(prepared.watched))
    if beyond:
        paths = {r.index: r.path for r in prepared.inputs}
        names = sorted({paths.get(prepared.watched_index[w], f"input {prepared.watched_index[w]}") for w in beyond})
        raise CaptureFailed(
            f"a torch op reads a tensor that holds {', '.join(names)} and reaches beyond it (a global or closure "
            "tensor holding the argument, or a view wider than it): replay cannot move the argument apart from it"
        )


def _refuse_staged_inputs_reached_otherwise(
    prepared: _CaptureInputs, observation: OpObservation, region_records
) -> None:
    """A staged input is a copy of the caller's tensor: exact only while the region reaches
    that memory through the input alone. A torch op or a jit launch that reaches the caller's
    storage of a staged input otherwise (a global or closure tensor holding it: ``cache``
    while ``cache[0]`` is the argument and a torch op writes it) would see it apart from its
    copy, so the key runs eagerly. Replays check the same for every call's staged inputs
    (replay.graph: the memory the graph reaches at fixed addresses)."""
    if not prepared.staged_storages:
        return
    spans = list(prepared.staged_storages.items())
    first = len(prepared.watched)
    seen = set(observation.read) | set(observation.written)
    reached = {spans[w - first][0] for w in seen if w >= first}
    for _record, address in _pointer_addresses(region_records):
        reached |= {i for i, (lo, hi) in spans if lo <= address < hi}
    if reached:
        paths = {r.index: r.path for r in prepared.inputs}
        names = ", ".join(paths.get(i, f"input {i}") for i in sorted(reached))
        raise CaptureFailed(
            f"{names} must be staged (a torch op reads or writes it, or a kernel reaches it through a tensor other "
            "than the argument), and the region also reaches its memory through another tensor (a global or closure "
            "tensor holding it): a staged copy would part them"
        )


def _refuse_host_misuse(prepared: _CaptureInputs, observation: OpObservation, region_records: Sequence) -> None:
    """Inside the capture, before the graph is ever launched: a torch op used a host input's
    values on the CPU (or wrote it), or a jit launch writes its pinned buffer."""
    refusals = list(getattr(observation, "host_refusals", ()))
    if refusals:
        raise CaptureFailed(refusals[0])
    if prepared.host is None:
        return
    for record, address in _pointer_addresses(region_records, written_only=True):
        owner = prepared.host.owner(address)
        if owner is not None:
            raise CaptureFailed(
                f"{record.kernel} writes host input {prepared.host.paths[owner]}: a graph cannot copy it back exactly"
            )


def _copy_staged_back(
    prepared: _CaptureInputs,
    recorder: Recorder,
    written: set[int],
    copy_back: set[int],
    staging_launches: dict[int, int],
    copied_back: set[int],
) -> None:
    """Captured last: copy each staged input the region wrote (or the caller asked for) from
    its buffer back into the input."""
    for i, buffer in prepared.staged.items():
        if i in written or i in copy_back:
            staging_launches[len(recorder.records)] = i
            staging.copy(buffer, prepared.tensors[i])
            copied_back.add(i)


def _run_under_capture(
    fn,
    args: tuple,
    kwargs: dict,
    prepared: _CaptureInputs,
    recorder: Recorder,
    observer,
    graph: torch.cuda.CUDAGraph,
    *,
    device: int,
    pool: tuple,
    copy_back: set[int],
) -> _Recorded:
    """The capture itself, on the current stream: the staging copies in, the region, the
    copies back, between ``capture_begin`` and ``capture_end``.

    On any error no capture is left running, and the exception says what the session does
    next: CaptureAborted (a jit miss: compile eagerly, record later), CaptureFailed (run this
    key eagerly), SpoiledPool (as CaptureFailed, and the pool cannot be captured into
    again)."""
    _begin_capture(graph, device, pool)
    try:
        recorded = _run_region(fn, args, kwargs, prepared, recorder, observer, copy_back)
    except CaptureMissError as exc:
        if _end_capture_after_error(graph, device, pool):
            raise SpoiledPool(str(exc)) from exc
        raise CaptureAborted(str(exc)) from exc
    except (DynamicScalarError, CaptureFailed, host_inputs.HostInputRefused) as exc:
        failed = SpoiledPool if _end_capture_after_error(graph, device, pool) else CaptureFailed
        raise failed(str(exc)) from exc
    except Exception as exc:
        failed = SpoiledPool if _end_capture_after_error(graph, device, pool) else CaptureFailed
        raise failed(f"{type(exc).__name__} while capturing: {_first_line(exc)}") from exc
    try:
        graph.capture_end()
    except Exception as exc:
        _end_capture_after_error(graph, device, pool)
        raise SpoiledPool(f"the capture was invalidated: {_first_line(exc)}") from exc
    return recorded


def _begin_capture(graph: torch.cuda.CUDAGraph, device: int, pool: tuple) -> None:
    """``capture_begin`` into the session's pool, in the capture mode of this thread alone."""
    try:
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    except Exception as exc:
        # capture_begin puts the generator in capture mode before it can fail: repaired
        # with a new state, as after a spoiled capture (and handled the same way)
        _repair_generator(device)
        raise SpoiledPool(f"the capture could not start: {_first_line(exc)}") from exc


def _run_region(
    fn, args: tuple, kwargs: dict, prepared: _CaptureInputs, recorder: Recorder, observer, copy_back: set[int]
) -> _Recorded:
    """Under capture, with the launch recorders and the torch-op observer on: the staging
    copies in, the region, the refusals of what a graph cannot reproduce, the copies back.
    The region's own call is a step apart: it holds the jit's launch reports and the
    observer, the recording's cost per launch and per op."""
    copied_back: set[int] = set()
    staging_launches: dict[int, int] = {}  # record index -> the input a staging copy reads or writes
    with for_replay.recording(recorder), triton_launches.recording(recorder), observer as observation:
        _copy_staged_in(prepared, recorder, staging_launches)
        first_region_launch = len(recorder.records)
        instrumentation.steps.mark("capture begin, checks, end")
        outputs = fn(*args, **kwargs)
        instrumentation.steps.mark("region")
        region_records = recorder.records[first_region_launch:]  # (the staging copies left out)
        _refuse_host_misuse(prepared, observation, region_records)
        _refuse_reads_beyond_inputs(prepared, observation)
        _refuse_staged_inputs_reached_otherwise(prepared, observation, region_records)
        written = _inputs_written(prepared, observation, region_records)
        _copy_staged_back(prepared, recorder, written, copy_back, staging_launches, copied_back)
        _refuse_written_overlaps(prepared.inputs, prepared.staged, written | copied_back)
    return _Recorded(outputs, observation, staging_launches, copied_back)


class _OnStream:
    """``torch.cuda.stream(stream)`` for a stream of the current device, without that context
    manager's device lookups (torch's ``_get_device_index`` and ``is_available``), which every
    recording would pay. A stream of another device takes torch's context manager, which
    switches the device as well."""

    __slots__ = ("stream", "previous", "other_device")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self.previous: torch.cuda.Stream | None = None
        self.other_device: torch.cuda.StreamContext | None = None

    def __enter__(self) -> None:
        stream = self.stream
        if stream.device_index != torch.cuda.current_device():
            self.other_device = torch.cuda.stream(stream)
            self.other_device.__enter__()
            return
        self.previous = torch.cuda.current_stream(stream.device_index)
        torch.cuda.set_stream(stream)

    def __exit__(self, *exc_info) -> None:
        if self.other_device is not None:
            self.other_device.__exit__(*exc_info)
        else:
            torch.cuda.set_stream(self.previous)


def _observer(prepared: _CaptureInputs, observe: bool) -> contextlib.AbstractContextManager:
    """The capture's torch-op observer: a context manager whose value is what it saw."""
    host = prepared.host
    if host is not None or prepared.named_host:  # always observed: a torch op reading host values would bake them in
        ranges, describe = (host.ranges(), host.paths.get) if host is not None else ((), str)
        return TorchOpObserver(
            prepared.observed_ranges(), ranges, describe, rewrite_blocking=True, named=prepared.named_host
        )
    if observe:
        return op_observer(prepared.observed_ranges())
    return contextlib.nullcontext(_NoObservation())


def _pool_bytes_before(device: int, pool: tuple) -> int:
    """The pool's size before the capture (for the recording's memory): as last measured,
    else measured now."""
    known = known_pool_bytes(device, pool)
    return known if known is not None else pool_bytes(device, pool)


def _pool_memory(device: int, pool: tuple) -> tuple[list[tuple[int, int]], bool]:
    """((first byte, one past the last) of each segment of the pool, whether a snapshot of the
    allocator measured them): see :func:`current_pool_segments`."""
    segments, measured = current_pool_segments(device, pool)
    return [(address, address + size) for address, size in segments], measured


def _pool_memory_after(recorded, prepared, device: int, pool: tuple) -> list[tuple[int, int]]:
    """The pool memory a capture's outputs are judged by (:func:`_pool_memory`, measured again
    where an output lies outside it: :func:`_pool_memory_holding`)."""
    pool_memory, measured = _pool_memory(device, pool)
    watched = prepared.watched + prepared.host_ranges()
    return _pool_memory_holding(recorded.outputs, watched, device, pool, pool_memory, measured)


def _pool_memory_holding(
    outputs: object, watched: Sequence[tuple[int, int]], device: int, pool: tuple, pool_memory: list, measured: bool
) -> list[tuple[int, int]]:
    """The pool memory own_outputs decides by: ``pool_memory``, unless it was not measured now
    and a device tensor the region returned lies outside it and outside the inputs; then
    measured now. Segments known are the pool's whatever the allocator's counts say, so an
    output inside them was made in the pool; one outside may lie in a segment the pool gained
    (or be a global's, returned as is): only a snapshot tells."""
    if measured:
        return pool_memory
    try:
        _spec, leaves, _paths = flatten((outputs,), {}, walk_dataclasses=True)
    except TypeError:  # a result no graph returns: own_outputs refuses it, naming why (CaptureFailed)
        return pool_memory
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda" and leaf.numel():
            lo, hi = byte_range(leaf)
            if not any(a <= lo and hi <= b for a, b in watched) and not any(a <= lo < b for a, b in pool_memory):
                return [(address, address + size) for address, size in pool_segments(device, pool)]
    return pool_memory


def _give_outputs_their_own_memory(
    recorded: _Recorded,
    prepared: _CaptureInputs,
    graph,
    pool_memory: Sequence[tuple[int, int]],
    backend,
    stream,
    device: int,
) -> None:
    """:func:`own_outputs` for a capture that just ended (filling in ``recorded``'s outputs,
    their bytes and their storages); on failure the graph is reset and the error is a
    CaptureFailed. ``pool_memory``: the pool's segments, checked to hold what own_outputs
    relies on (see _pool_memory_holding)."""
    watched = prepared.watched + prepared.host_ranges()
    try:
        owned = own_outputs(recorded.outputs, watched, device, backend, graph, stream, pool_memory)
    except Exception as exc:
        graph.reset()
        if isinstance(exc, CaptureFailed):
            raise
        raise CaptureFailed(
            f"{type(exc).__name__} while giving the outputs their own memory: {_first_line(exc)}"
        ) from exc
    recorded.outputs, recorded.output_bytes, recorded.owned_outputs = owned


@attrs.frozen
class _KeptRecords:
    """What a capture keeps of its launch records (see :func:`_keep_records`)."""

    records: list  # each launch record, its tensors dropped (scalar_or_none)
    extents: list  # pointer_extents, per record
    storages: list | None  # pointer_storages, per record, where asked for


def _keep_records(
    records: Sequence, prepared: _CaptureInputs, pool_memory: Sequence[tuple[int, int]], storages: bool
) -> _KeptRecords:
    """What analysis needs of the launch records, read while their ``args`` still hold the
    tensors; then the records without them. Records must not keep the capture's tensors
    alive: intermediates freed return to the pool, where the next graph recorded into it
    reuses them."""
    storage_uses = None
    if storages:  # replay.polymorphic matches later runs against these: where each pointer pointed
        storage_uses = pointer_storages(records, lambda base: any(lo <= base < hi for lo, hi in pool_memory))
    extents = pointer_extents(records, prepared.inputs, prepared.tensors.values(), prepared.doubts)
    return _KeptRecords(records_without_tensors(records), extents, storage_uses)


def records_without_tensors(records: Sequence) -> list:
    """Each launch record with its ``args`` as analysis needs them (:func:`scalar_or_none`):
    in one C call where the helper is built (csrc/jitcore_native.c, the same rule)."""
    native = _native_helper()
    if native is not None and isinstance(records, list):
        return native.without_tensors(records, _ARGS_FIELD, torch.Tensor, _KEPT_ARGUMENTS, "__jit_scalar__")
    return [r.with_args(tuple(map(scalar_or_none, r.args))) for r in records]


#: Where a launch record holds its jit call's arguments.
_ARGS_FIELD = for_replay.LaunchRecord._fields.index("args")


def _native_helper():
    """jitcore.backends._native where it was built and ``JITCORE_NATIVE`` allows it, else None."""
    return for_replay.native_helper()


def _instantiate(graph: torch.cuda.CUDAGraph) -> None:
    """Make the graph launchable; on failure it is reset and the error is a CaptureFailed."""
    try:
        graph.instantiate()
    except Exception as exc:
        graph.reset()
        raise CaptureFailed(f"the graph could not be instantiated: {_first_line(exc)}") from exc


def _make_capture(
    graph: torch.cuda.CUDAGraph,
    device: int,
    leaves: Sequence,
    prepared: _CaptureInputs,
    recorded: _Recorded,
    recorder: Recorder,
    kept: _KeptRecords,
    seconds: float,
    memory: int,
    pool_memory: list,
) -> Capture:
    """The Capture: the graph, with what analysis and replay need to know of its recording."""
    return Capture(
        graph=graph,
        device=device,
        outputs=recorded.outputs,
        records=kept.records,
        launch_nodes=list(recorder.nodes),
        staging_launches=recorded.staging_launches,
        output_bytes=recorded.output_bytes,
        owned_outputs=recorded.owned_outputs,
        inputs=prepared.inputs,
        input_dtypes={
            **{i: t.dtype for i, t in prepared.tensors.items()},
            **({i: b.dtype for i, b in prepared.host.buffers.items()} if prepared.host else {}),
        },
        dynamic_values={i: leaf.value for i, leaf in enumerate(leaves) if isinstance(leaf, Dynamic)},
        staged=prepared.staged,
        copied_back=recorded.copied_back,
        torch_read=prepared.leaves_seen(recorded.observation.read),
        torch_written=prepared.leaves_seen(recorded.observation.written),
        seconds=seconds,
        memory=memory,
        host=prepared.host,
        pointer_storages=kept.storages,
        pointer_extents=kept.extents,
        pool_memory=pool_memory,
    )


def capture(
    fn,
    spec: object,
    leaves: Sequence,
    paths: Sequence[str],
    *,
    device: int,
    pool: tuple,
    stream: torch.cuda.Stream,
    stage: set[int],
    copy_back: set[int],
    observe: bool = True,
    storages: bool = False,
    held: HeldTensors | None = None,
    shadows: frozenset[int] = frozenset(),
) -> Capture:
    """Record ``fn`` once. Raises CaptureAborted or CaptureFailed.

    ``observe=False`` skips the torch-op observer (a cost per torch op): the session passes it
    when this key's eager warm-up ran observed and saw no torch op touch an input (the node
    scan after capture still catches foreign kernels and copies that reach an input).
    ``storages=True`` keeps where each pointer parameter pointed (``Capture.pointer_storages``,
    for replay.polymorphic). ``held``: the tensors the region reaches by name (:func:`input_doubts`).
    ``shadows``: the tensors of object arguments (:func:`_prepare_inputs`).

    The steps, each marked on ``replay.instrumentation.steps``: prepare; then, holding
    :data:`CAPTURES` exclusively, run the region under capture with its checks, snapshot the
    pool, give the outputs memory of their own, keep the extents and the records, instantiate.
    ``Capture.seconds`` counts from capture begin to the graph instantiated."""
    instrumentation.steps.start()
    prepared = _prepare_inputs(leaves, paths, device=device, stage=stage, held=held, shadows=shadows)
    args, kwargs = region_arguments(spec, leaves, paths, prepared.staged, prepared.host_buffers())
    observer = _observer(prepared, observe)
    with CAPTURES.exclusive():  # no other thread's work may break this capture
        recorder = Recorder(get_backend())
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        pool_before = _pool_bytes_before(device, pool)
        instrumentation.steps.mark("prepare")
        started = time.perf_counter()
        with _OnStream(stream):
            recorded = _run_under_capture(
                fn, args, kwargs, prepared, recorder, observer, graph, device=device, pool=pool, copy_back=copy_back
            )
            instrumentation.steps.mark("capture begin, checks, end")
            given = output_identity.given_objects(leaves, prepared.staged, prepared.host_buffers())
            identity = output_identity.identify(recorded.outputs, given, held)
            pool_memory = _pool_memory_after(recorded, prepared, device, pool)
            instrumentation.steps.mark("pool snapshot")
            _give_outputs_their_own_memory(recorded, prepared, graph, pool_memory, recorder.backend, stream, device)
        instrumentation.steps.mark("own outputs")
        kept = _keep_records(recorder.records, prepared, pool_memory, storages)
        del args, kwargs
        instrumentation.steps.mark("extents and records")
        _instantiate(graph)
        seconds = time.perf_counter() - started
        instrumentation.steps.mark("instantiate")
        memory = max(sum(hi - lo for lo, hi in pool_memory) - pool_before, 0) + recorded.output_bytes
        made = _make_capture(graph, device, leaves, prepared, recorded, recorder, kept, seconds, memory, pool_memory)
        made.identity = output_identity.with_memory(identity, recorded.outputs, recorded.owned_outputs)
        return made


@attrs.frozen
class StorageUse:
    """The storage a pointer parameter points into: its first byte, its size, and whether
    the run that launched it made it (the capture's pool, a factory op an observed run
    called) rather than found it (an argument, a global). See replay.polymorphic."""

    base: int
    nbytes: int
    made: bool


def pointer_extents(
    records: Sequence,
    inputs: Sequence[rebinding.InputRange],
    tensors: Iterable[torch.Tensor],
    doubts: Mapping[int, InputDoubt] | None = None,
) -> list[dict[int, rebinding.Extent]]:
    """Per launch record (its ``args`` still the tensors), ``{parameter index: Extent}`` of the
    jit argument a pointer parameter came from, for each pointer into an input whose jit
    argument is not that input tensor itself (a view of it, or a global or closure tensor that
    happens to hold it), and for each pointer into an input ``doubts`` (:func:`input_doubts`)
    names. The plan binds a pointer to an input by its address; it must not where the tensor
    the pointer came from reaches beyond that input (``cache`` passed to a kernel while
    ``cache[0]`` is the argument: the global must stay where it is, the argument moves), nor
    where another holder of the input's memory may have given it (the extent's ``doubt``; see
    rebinding's bind_pointer)."""
    if not inputs:
        return [{} for _ in records]
    doubts = doubts or {}
    itself_doubted = any(d.itself for d in doubts.values())
    own = {id(t) for t in tensors}
    # every address inputs_at can place lies in [lowest, highest]: most pointers (the
    # region's intermediates) are answered by this one comparison
    lowest, highest = min(r.lo for r in inputs), max(r.hi for r in inputs)
    unpack, tensor_class = _POINTER.unpack_from, torch.Tensor
    result = []
    for record in records:
        found = {}
        args, param_bytes = record.args, record.param_bytes
        for index, arg_index, offset in _pointers_of(record.params):
            tensor = args[arg_index]
            if tensor.__class__ is not tensor_class and not isinstance(tensor, tensor_class):
                continue
            itself = id(tensor) in own
            if itself and not itself_doubted:
                continue  # the input itself (most pointers into inputs): its range is the input's
            (address,) = unpack(param_bytes, offset)
            if lowest <= address <= highest:
                extent = _extent_into_inputs(inputs, doubts, address, tensor, itself)
                if extent is not None:
                    found[index] = extent
        result.append(found)
    return result


def _extent_into_inputs(
    inputs: Sequence[rebinding.InputRange], doubts: Mapping[int, InputDoubt], address: int, tensor, itself: bool
) -> rebinding.Extent | None:
    """The extent pointer_extents records for a pointer at ``address`` that came from
    ``tensor`` (``itself``: the input tensor itself), or None where the plan needs none."""
    owners = rebinding.inputs_at(inputs, address)  # the plan's rule
    doubt = next(
        (doubts[o.index].reason for o in owners if o.index in doubts and (doubts[o.index].itself or not itself)),
        "",
    )
    if owners and (doubt or not itself):
        return rebinding.Extent(*byte_range(tensor), doubt)
    return None


#: (parameter index, jit argument index, byte offset) of each pointer parameter of a launch
#: record's ``params`` that came from a jit argument, by the tuple's id (kept beside it):
#: records share their params tuples (see _PARAMS_VIEWS), so this is mostly one lookup.
_POINTERS_OF: dict[int, tuple[tuple, tuple]] = {}


def _pointers_of(params: Sequence) -> tuple:
    cached = _POINTERS_OF.get(id(params))
    if cached is not None and cached[0] is params:
        return cached[1]
    pointers = tuple(
        (p.index, p.arg_index, p.offset) for p in params if p.kind == "pointer" and p.arg_index is not None
    )
    if isinstance(params, tuple):  # immutable: the answer holds as long as it lives
        if len(_POINTERS_OF) >= _PARAM_VIEWS_LIMIT:
            _POINTERS_OF.clear()
        _POINTERS_OF[id(params)] = (params, pointers)
    return pointers


@attrs.frozen
class InputDoubt:
    """Why a pointer into an input may not follow the input (see :func:`input_doubts`);
    ``itself``: even a pointer the input tensor itself gave."""

    reason: str
    itself: bool


#: A tensor alone holds its storage twice: its own reference and its Python storage object's.
_ALONE = 2


def _storage_holders(tensor: torch.Tensor) -> int:
    """torch's count of the references to the tensor's storage (with the Python storage
    object's); where it cannot be read (a tensor without a storage of its own), more than
    a tensor alone, so that the input is in doubt."""
    try:
        return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, AttributeError):
        return _ALONE + 1


@attrs.frozen
class HeldTensors:
    """The tensors a region reaches other than through its arguments. ``named``: those its
    globals, closures and module attributes hold, and the containers they hold (few, each
    compared with the arguments by identity and by the bytes it lies over); ``attributes``: a
    module region's parameters and buffers (often thousands, compared by identity alone, so
    that a recording pays a set of their ids rather than a read of each one's storage).
    ``complete`` False: the search for ``named`` stopped at its bound with values left unread
    (jitcore.drift.GlobalsSnapshot.tensors_by_name), so any argument may be one of them."""

    named: Sequence[torch.Tensor] = ()
    attributes: Sequence[torch.Tensor] = ()
    complete: bool = True
    # every tensor the region's watch holds (replay.watch: deeper than ``named``, through the
    # objects and modules it reaches): searched for CPU tensors only (host.named_host_ranges)
    watched: Sequence[torch.Tensor] = ()


def input_doubts(tensors: Mapping[int, torch.Tensor], held: HeldTensors | None = None) -> dict:
    """The inputs whose memory the region may reach by another route than the argument, as
    the call begins (before the region makes views of its own), by input index.

    A kernel's pointer into an input binds to the input by its address, so the plan must know
    the pointer came through the argument. When another tensor holds the input's storage too
    (the argument is ``cache[1]`` while ``cache`` lives on; a view the caller keeps; a global
    over the same memory), or a tensor the region reaches by name lies over the input's bytes
    through a storage of its own (a DLPack or ``from_blob`` alias, which torch's count of the
    storage's holders does not see), a tensor the region passes that is not the input itself
    may be the other holder's (``cache[1]`` made from the global), at an address that stays
    where it is while the argument moves. When the argument is the very tensor the region
    reaches by name, even the input itself may have come that way (the capture is refused).
    Either way the recording cannot tell from the address, and the plan never binds such a
    pointer to the input: it stages the input, or refuses the key (rebinding's
    stage_for_doubt). ``held``: what the region reaches by name
    (``Region._tensors_held_by_name``); where its search was cut short, every argument may be
    a tensor the region reaches by name, and is doubted so."""
    held = held or HeldTensors()
    by_name = {id(t) for t in (*held.named, *held.attributes)}
    overlaps_named = _ByteRanges([_storage_span(t) for t in held.named])
    doubts = {}
    for i, tensor in tensors.items():
        if not held.complete:
            doubts[i] = InputDoubt(
                "the region reads more values by name (globals, closure values and the items of the containers they "
                "hold) than replay looks through, so the argument may be a tensor among them",
                True,
            )
        elif id(tensor) in by_name:
            doubts[i] = InputDoubt(
                "the argument is a tensor the region also reads by name (a global, a closure "
                "value, a module's parameter or buffer)",
                True,
            )
        elif _storage_holders(tensor) > _ALONE or overlaps_named(*byte_range(tensor)):
            doubts[i] = InputDoubt(
                "it came from a tensor other than the argument, and when the call began another tensor held the "
                "argument's memory too (the argument is a view of a larger tensor, or a global or a view the caller "
                "keeps shares it), so the pointer may be that tensor's",
                False,
            )
    return doubts


def _storage_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The byte range of a tensor's storage; an empty one where it has none to read."""
    try:
        return storage_range(tensor)
    except (RuntimeError, NotImplementedError, AttributeError):
        return (0, 0)


class _ByteRanges:
    """``ranges(lo, hi)``: whether [lo, hi) overlaps any of the (nonempty) ranges, in a
    bisection over them, sorted once (the storages of the tensors a region reaches by name,
    against each argument of a recording)."""

    def __init__(self, ranges: Iterable[tuple[int, int]]) -> None:
        spans = sorted((lo, hi) for lo, hi in ranges if hi > lo)
        self.starts = [lo for lo, _ in spans]
        self.reach = list(itertools.accumulate((hi for _, hi in spans), max))  # furthest end so far

    def __call__(self, lo: int, hi: int) -> bool:
        if hi <= lo:
            return False
        before = bisect.bisect_left(self.starts, hi)  # the ranges starting before hi
        return before > 0 and self.reach[before - 1] > lo


def _pointer_tensors(record) -> Iterator[tuple[ParamRecord, torch.Tensor]]:
    """(parameter record, tensor) for each pointer parameter of a launch record whose jit
    argument is a tensor (``args`` still the tensors)."""
    for param in record.params:
        if param.kind == "pointer" and param.arg_index is not None:
            tensor = record.args[param.arg_index]
            if isinstance(tensor, torch.Tensor):
                yield param, tensor


def pointer_storages(records: Sequence, made: Callable[[int], bool]) -> list[dict]:
    """Per launch record (its ``args`` still the tensors), ``{parameter index: StorageUse}``
    for each pointer parameter whose tensor has memory; ``made(first byte)`` says whether the
    run made that storage."""
    result = []
    for record in records:
        uses = {}
        for param, tensor in _pointer_tensors(record):
            storage = tensor.untyped_storage()
            base, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes:
                uses[param.index] = StorageUse(base, nbytes, made(base))
        result.append(uses)
    return result


def analyse(capture: Capture) -> None:
    """Read the graph's nodes and plan the rebinding (fills ``capture.nodes/plan``). Raises
    CaptureFailed when the graph cannot be rebound, CaptureRetry when more inputs must be
    staged; the caller then releases ``capture.graph``."""
    instrumentation.steps.start()
    backend = get_backend()
    sizes_of = launch_param_sizes(capture.records)
    capture.nodes = backend.graph_nodes_with_params(capture.graph.raw_cuda_graph(), sizes_of)
    views, scanned = node_views(backend, capture.nodes, capture.records, sizes_of)
    capture.node_views = views if scanned else None
    plan = rebinding.build_plan(
        capture.inputs,
        launch_views(
            capture.records, capture.launch_nodes or None, capture.staging_launches, capture.pointer_extents or None
        ),
        views,
        staged=set(capture.staged),
        copied_back=capture.copied_back,
        torch_read=capture.torch_read,
        torch_written=capture.torch_written,
        scanned=scanned,
    )
    instrumentation.steps.mark("analyse")
    if plan.failure:
        raise CaptureFailed(plan.failure)
    if capture.host is not None:
        _refuse_host_nodes(capture.host, views, {node for _, node in plan.matches})
    if plan.retry_later:
        raise RecordLater(plan.retry_later)
    if plan.needs_staging or plan.needs_copy_back:
        raise CaptureRetry(plan)
    capture.plan = plan


def _refuse_host_nodes(host: host_inputs.HostInputs, nodes: Sequence[rebinding.NodeView], jit_nodes: set) -> None:
    """A host input's pinned buffer may only be the source of copies (the region's own
    host-to-device copies). A copy into it, a copy whose addresses cannot be read, or a
    kernel other than a jit launch reaching it is refused (jit launches that write it were
    refused while capturing)."""
    for node in nodes:
        if node.kind == "memcpy":
            if not node.pointers:
                raise CaptureFailed("a copy node whose addresses cannot be read may write a host input's buffer")
            destination = node.pointers[-1]
            owner = host.owner(destination)
            if owner is not None:
                raise CaptureFailed(
                    f"a copy writes host input {host.paths[owner]}: a graph cannot copy it back exactly"
                )
        elif node.kind == "memset" and node.pointers:
            owner = host.owner(node.pointers[0])
            if owner is not None:
                raise CaptureFailed(f"a memset writes host input {host.paths[owner]}")
        elif node.kind == "kernel" and node.index not in jit_nodes:
            words = rebinding.addresses_in(node)
            if words is None:
                raise CaptureFailed("a kernel whose parameters cannot be read may reach a host input's buffer")
            for word in words.tolist():
                owner = host.owner(word)
                if owner is not None:
                    raise CaptureFailed(
                        f"a kernel other than a jit launch reaches host input {host.paths[owner]}'s memory"
                    )


def _overlapping_staged(inputs: Sequence[rebinding.InputRange], staged: dict) -> set[int]:
    """Staged inputs that overlap another input. Their staged buffers are separate copies,
    exact only while nothing writes them."""
    return set(rebinding.overlapping_inputs(inputs)) & set(staged)


def _refuse_written_overlaps(inputs, staged: dict, written: set[int]) -> None:
    """Called inside the capture, before the graph is ever launched: the region writes an
    input that overlaps another one, so separate staged copies would not see each other."""
    bad = _overlapping_staged(inputs, staged) & written
    if bad:
        names = ", ".join(r.path for r in inputs if r.index in bad)
        raise CaptureFailed(f"input {names} overlaps another input and is written: a graph cannot reproduce that")


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


_CONSTANT_OUTPUTS = (
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.device,
    enum.Enum,
    np.generic,
)


def own_outputs(
    outputs: object,
    watched: Sequence[tuple[int, int]],
    device: int,
    backend,
    graph,
    stream,
    pool_memory: Sequence[tuple[int, int]] = (),
) -> tuple[object, int, set[int]]:
    """Give the graph's tensor outputs memory of their own, outside the session's pool.

    Inside the pool, an output can sit where an earlier graph keeps its scratch, and a replay
    of that graph would overwrite it while the caller still holds it (or passes it to another
    region). So once the region is captured, buffers are allocated outside the pool and copies
    of the outputs into them are appended to the graph (captured into it, after every node),
    and the caller gets views of those buffers with the outputs' exact layout. Outputs that
    share storage share a buffer, so their aliasing is kept. Outputs inside the inputs
    (``watched`` byte ranges) and tensors the region did not allocate (outside
    ``pool_memory``: globals, closure tensors) stay what they are, as eagerly. Raises
    CaptureFailed for outputs a graph cannot reproduce. Returns (outputs, bytes allocated,
    the data pointers of the new buffers' storages)."""
    spec, leaves, paths = flatten((outputs,), {}, walk_dataclasses=True)
    groups = _outputs_by_storage(leaves, paths, watched, pool_memory)
    if not groups:
        return unflatten(spec, leaves)[0][0], 0, set()
    new_leaves = list(leaves)
    total = 0
    copies = []
    owned: set[int] = set()
    for members in groups.values():
        buffer, lo, copy = _own_buffer([leaves[i] for i in members], device)
        total += buffer.numel()
        owned.add(buffer.untyped_storage().data_ptr())
        if copy is not None:
            copies.append(copy)
        for i in members:
            new_leaves[i] = _same_view_in(buffer, lo, leaves[i], paths[i])
    _append_copies(copies, backend, graph, stream)
    return unflatten(spec, new_leaves)[0][0], total, owned


def _outputs_by_storage(
    leaves: list, paths: Sequence[str], watched: Sequence[tuple[int, int]], pool_memory: Sequence[tuple[int, int]]
) -> dict[int, list[int]]:
    """The output leaves that get memory of their own, grouped by the storage they share (by
    its data pointer). An empty one is given a fresh empty tensor in ``leaves`` instead: it
    has no bytes to keep (and maybe no address)."""
    groups: dict[int, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if not _needs_own_memory(leaf, paths[i].replace("args[0]", "output", 1), watched, pool_memory):
            continue
        if leaf.numel() == 0:
            leaves[i] = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device=leaf.device)
            continue
        groups.setdefault(leaf.untyped_storage().data_ptr(), []).append(i)
    return groups


def _needs_own_memory(
    leaf: object, where: str, watched: Sequence[tuple[int, int]], pool_memory: Sequence[tuple[int, int]]
) -> bool:
    """Whether an output leaf is a tensor the capture made in the pool; raises CaptureFailed
    for a leaf a replay cannot return."""
    if isinstance(leaf, DynamicScalar) or isinstance(leaf, _CONSTANT_OUTPUTS):
        return False
    if not isinstance(leaf, torch.Tensor):
        raise CaptureFailed(
            f"the region returned a {type(leaf).__qualname__} ({where}); a replay can only return tensors, "
            "numbers, strings and tuples, lists, dicts, named tuples or dataclasses of those"
        )
    if leaf.requires_grad:
        raise CaptureFailed(
            f"{where} requires grad; replay does not record autograd (run the loop under torch.no_grad() "
            "or torch.inference_mode())"
        )
    lo, hi = byte_range(leaf)
    if any(a <= lo and hi <= b for a, b in watched):
        return False  # a view of an input: rebuilt on the caller's input at each replay
    if leaf.device.type == "cuda" and not any(a <= lo < b for a, b in pool_memory):
        return False  # not made by this capture (a global, a closure tensor): returned as is
    if leaf.device.type != "cuda":
        raise CaptureFailed(f"{where} is a tensor on {leaf.device} the region made; a graph cannot produce it")
    if type(leaf) is not torch.Tensor:
        raise CaptureFailed(f"{where} is a {type(leaf).__qualname__}; replay returns plain tensors only")
    return True


def _own_buffer(members: Sequence[torch.Tensor], device: int) -> tuple[torch.Tensor, int, tuple | None]:
    """A buffer outside the pool for outputs that share one storage: the bytes from the first
    one's start (rounded down to 16 bytes, within the storage) to the last one's end. Returns
    (buffer, the address its first byte stands for, the (destination, source) copy that fills
    it, None where there are no bytes)."""
    storage = members[0].untyped_storage()
    base = storage.data_ptr()
    lo = max(min(leaf.data_ptr() for leaf in members) & ~15, base)
    hi = max(leaf.data_ptr() + extent_bytes(leaf) for leaf in members)
    buffer = torch.empty(max(hi - lo, 1), dtype=torch.uint8, device=f"cuda:{device}")
    if hi <= lo:
        return buffer, lo, None
    source = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
    source.set_(storage, lo - base, (hi - lo,), (1,))
    return buffer, lo, (buffer[: hi - lo], source)


def _same_view_in(buffer: torch.Tensor, lo: int, leaf: torch.Tensor, path: str) -> torch.Tensor:
    """``leaf``'s view (dtype, shape, strides) of the bytes ``buffer`` holds from ``lo`` on."""
    offset, remainder = divmod(leaf.data_ptr() - lo, leaf.element_size())
    if remainder:
        raise CaptureFailed(f"an output ({path}) is misaligned within its storage")
    view = torch.empty(0, dtype=leaf.dtype, device=leaf.device)
    view.set_(buffer.untyped_storage(), offset, leaf.shape, leaf.stride())
    return view


def _append_copies(copies: Sequence[tuple[torch.Tensor, torch.Tensor]], backend, graph, stream) -> None:
    """Add the (destination, source) copies to the graph, after every node it holds: copy
    nodes added to it where the backend can (``append_copies``), else captured into it."""
    if not copies:
        return
    flat = [(destination.data_ptr(), source.data_ptr(), destination.nbytes) for destination, source in copies]
    try:
        backend.append_copies(graph.raw_cuda_graph(), flat, copies[0][0].device.index)
        return
    except NotImplementedError:
        pass
    try:
        appending = backend.capture_into(graph.raw_cuda_graph(), stream.cuda_stream)
    except NotImplementedError as exc:
        raise CaptureFailed(f"{exc}, so its outputs cannot get memory of their own") from None
    with appending:
        for destination, source in copies:
            destination.copy_(source)


def owned_output_memory(capture: Capture) -> dict[int, int]:
    """``{start: bytes}`` of the output buffers a capture owns (outside the pool: see
    :func:`own_outputs`), which its first launch and every replay write."""
    _spec, leaves, _ = flatten((capture.outputs,), {}, walk_dataclasses=True)
    owned = getattr(capture, "owned_outputs", set())
    memory = {}
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.numel():
            storage = leaf.untyped_storage()
            if storage.data_ptr() in owned:
                memory[storage.data_ptr()] = storage.nbytes()
    return memory


def first_outputs(capture: Capture, inputs: Sequence, hand_out=None) -> object:
    """What the first launch of a fresh capture returns, as every replay returns it, the
    capture's own objects never handed out (replay.output_identity.first_outputs)."""
    return output_identity.first_outputs(capture, inputs, hand_out)
