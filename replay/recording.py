"""Recording a region into a CUDA/HIP graph, and working out how to rebind it.

One recording: stream capture of the region on the session's capture stream and memory pool
(thread-local capture mode, ``keep_graph=True``) with the jitcore recorder installed (every jit
launch is logged with its parameter provenance, and a jit cache miss aborts the capture before
anything compiles) and the torch-op observer active. Then the graph is instantiated, its
nodes read, and :func:`replay.rebinding.build_plan` decides what to patch and what to stage.

Capture goes through ``CUDAGraph.capture_begin/capture_end`` rather than the
``torch.cuda.graph`` context manager: the latter synchronizes the device and empties the
allocator cache on entry, which costs milliseconds per recording and is not needed here (the
session's pool is private and nothing captured runs until the graph is launched).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Sequence

import attrs
import torch

import jitcore
from jitcore.backends import get_backend
from jitcore.errors import CaptureMissError
from replay import rebinding, staging
from replay.dynamic import Dynamic, DynamicScalar
from replay.errors import DynamicScalarError
from replay.keys import extent_bytes, flatten, unflatten
from replay.observe import TorchOpObserver

_NUMBERS = (int, float, bool)


class _NoObservation:
    read: frozenset = frozenset()
    written: frozenset = frozenset()


class CaptureAborted(Exception):
    """The capture must be retried later (a jit miss: compile eagerly first)."""


class CaptureFailed(Exception):
    """This key cannot be captured; ``reason`` says why (it will run eagerly)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class CaptureRetry(Exception):
    """The capture showed more inputs must be staged; record again with them."""


class _Recorder:
    """The jitcore recorder: keeps every launch, refuses every miss."""

    def __init__(self) -> None:
        self.records: list = []

    def launch(self, record) -> None:
        self.records.append(record)

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
    timings: dict = attrs.Factory(dict)  # seconds per phase, for benchmarks and reports
    nodes: list = attrs.Factory(list)
    plan: rebinding.Plan | None = None


class KeptPool:
    """A graph memory pool that stays valid while this object lives.

    torch counts the users of a pool in two allocators (device and pinned host) and frees the
    pool, poisoning its id, when the count drops to zero, as it does when the last graph
    recorded into it is released. Capturing an empty graph into the pool first, and keeping
    that graph, holds one count in both for the life of this object."""

    def __init__(self, device: int, stream: torch.cuda.Stream):
        with torch.cuda.device(device):
            self.id = torch.cuda.graph_pool_handle()
        self.device = device
        self.keeper = torch.cuda.CUDAGraph()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "The CUDA Graph is empty": that is the point
            with torch.cuda.stream(stream):
                self.keeper.capture_begin(pool=self.id)
                self.keeper.capture_end()


def pool_bytes(device: int, pool: tuple) -> int:
    """Bytes reserved by a private memory pool (its segments), from the allocator's snapshot."""
    try:
        segments = torch.cuda.memory_snapshot(mempool_id=pool, include_traces=False)
        return sum(s["total_size"] for s in segments if s.get("device", device) == device)
    except TypeError:  # older torch: no per-pool snapshot
        segments = torch.cuda.memory_snapshot()
        return sum(
            s["total_size"]
            for s in segments
            if s.get("device") == device and tuple(s.get("segment_pool_id", ())) == tuple(pool)
        )


def _end_capture_after_error(graph: torch.cuda.CUDAGraph, device: int, pool: tuple) -> None:
    """Leave no capture running and the allocator routing no allocation to the pool."""
    try:
        graph.capture_end()
    except Exception:
        # cudaStreamEndCapture failed (an invalidated capture ends anyway); torch skipped
        # ending its allocation to the pool, so do it here.
        for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):  # balance capture_begin
            call = getattr(torch._C, name, None)
            if call is not None:
                try:
                    call(device, pool)
                except Exception:
                    pass
    try:
        graph.reset()
    except Exception:
        pass
    _repair_generator(device)


def _repair_generator(device: int) -> None:
    """torch (before 2.12) leaves the default CUDA generator in capture mode when a capture
    fails at its end (pytorch#171263), after which every random op raises; hand it a fresh
    copy of its own state, which is not capturing."""
    try:
        generator = torch.cuda.default_generators[device]
        generator.graphsafe_set_state(generator.clone_state())
    except Exception:
        pass


def _scalar_or_none(value: object) -> object:
    """What analysis needs of a jit argument: dynamic scalars and numbers; nothing else."""
    if isinstance(value, (DynamicScalar, *_NUMBERS)) or hasattr(value, "__jit_scalar__"):
        return value
    return None


def _launch_view(record, dynamic_args: set[int], sources: dict[int, str]) -> rebinding.LaunchView:
    params = tuple(
        rebinding.ParamView(
            index=p.index,
            offset=p.offset,
            size=p.size,
            fmt=p.fmt,
            kind=p.kind,
            read_only=p.read_only,
            expression=p.expression,
            convert=p.convert,
            scalar_args=p.scalar_args,
        )
        for p in record.params
    )
    return rebinding.LaunchView(
        function=record.function,
        kernel=record.kernel,
        param_bytes=record.param_bytes,
        params=params,
        scalar_sources=sources,
        dynamic_args=frozenset(dynamic_args),
    )


def launch_views(records: Sequence) -> list[rebinding.LaunchView]:
    views = []
    for record in records:
        sources, dynamic = {}, set()
        for k, arg in enumerate(record.args):
            if isinstance(arg, DynamicScalar):
                sources[k], _ = arg.source, dynamic.add(k)
            elif isinstance(arg, _NUMBERS) or hasattr(arg, "__jit_scalar__"):
                value = arg.__jit_scalar__() if hasattr(arg, "__jit_scalar__") else arg
                sources[k] = repr(value)
        views.append(_launch_view(record, dynamic, sources))
    return views


def node_views(backend, nodes: Sequence, records: Sequence) -> tuple[list[rebinding.NodeView], bool]:
    """Read each kernel node's parameters: with the sizes of the jit launch that may be in it,
    or the driver's parameter info for foreign kernels (None where unknown)."""
    layouts = {r.function: r.layout for r in records}
    scanned = True
    views = []
    for node in nodes:
        if node.kind == "kernel":
            layout = layouts.get(node.function)
            sizes = [t.size for t in layout.types] if layout is not None else backend.kernel_param_sizes(node.function)
            if sizes is None:
                scanned = False
                params = None
            else:
                params = tuple(backend.read_kernel_params(node, sizes))
            views.append(rebinding.NodeView(node.index, "kernel", node.function, params))
        elif node.kind in ("memcpy", "memset"):
            views.append(rebinding.NodeView(node.index, node.kind, pointers=tuple(node.pointers)))
        else:
            views.append(rebinding.NodeView(node.index, node.kind))
    return views, scanned


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
) -> Capture:
    """Record ``fn`` once. Raises CaptureAborted or CaptureFailed.

    ``observe=False`` skips the torch-op observer during the capture (it costs tens of
    microseconds per torch op): the session passes it when the eager warm-up of this key ran
    under the observer and saw no torch op touch an input. The node scan after capture still
    catches foreign kernels and copies that reach an input."""
    clock = time.perf_counter
    timings = {"start": clock()}
    tensors = {i: leaf for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
    for i, tensor in tensors.items():
        if tensor.device.type != "cuda" or tensor.device.index != device:
            raise CaptureFailed(f"input {paths[i]} is on {tensor.device}, the current device is cuda:{device}")
    inputs = [
        rebinding.InputRange(i, paths[i], t.data_ptr(), t.data_ptr() + extent_bytes(t)) for i, t in tensors.items()
    ]
    staged: dict[int, torch.Tensor] = {}
    for i in sorted(stage):
        reason = staging.unsupported_reason(tensors[i])
        if reason:
            raise CaptureFailed(f"input {paths[i]} must be staged but {reason}")
        staged[i] = staging.staged_buffer(tensors[i])
        staging.prepare(tensors[i], staged[i])
        staging.prepare(staged[i], tensors[i])
    capture_leaves = list(leaves)
    for i, leaf in enumerate(leaves):
        if i in staged:
            capture_leaves[i] = staged[i]
        elif isinstance(leaf, Dynamic):
            capture_leaves[i] = DynamicScalar(f"_d{i}", leaf.value, paths[i])
    args, kwargs = unflatten(spec, capture_leaves)
    watched = [(r.lo, r.hi) for r in inputs] + [(b.data_ptr(), b.data_ptr() + extent_bytes(b)) for b in staged.values()]
    watched_index = [r.index for r in inputs] + list(staged)
    observer = TorchOpObserver(watched) if observe else contextlib.nullcontext(_NoObservation())
    recorder = _Recorder()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    pool_before = pool_bytes(device, pool)
    timings["prepare"] = clock() - timings.pop("start")
    started = clock()
    copied_back: set[int] = set()
    with torch.cuda.stream(stream):
        try:
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        except Exception as exc:
            _repair_generator(device)
            raise CaptureFailed(f"the capture could not start: {str(exc).strip().splitlines()[0]}") from exc
        try:
            with jitcore.recorder.recording(recorder), observer as observer:
                for i, buffer in staged.items():
                    staging.copy(tensors[i], buffer)
                first_region_launch = len(recorder.records)
                outputs = fn(*args, **kwargs)
                written = {watched_index[w] for w in observer.written}
                for record in recorder.records[first_region_launch:]:
                    for param in record.params:
                        if param.kind == "pointer" and not param.read_only:
                            address = int.from_bytes(record.param_bytes[param.offset : param.offset + 8], "little")
                            for i, buffer in staged.items():
                                if buffer.data_ptr() <= address < buffer.data_ptr() + max(extent_bytes(buffer), 1):
                                    written.add(i)
                for i, buffer in staged.items():
                    if i in written or i in copy_back:
                        staging.copy(buffer, tensors[i])
                        copied_back.add(i)
        except CaptureMissError as exc:
            _end_capture_after_error(graph, device, pool)
            raise CaptureAborted(str(exc)) from exc
        except DynamicScalarError as exc:
            _end_capture_after_error(graph, device, pool)
            raise CaptureFailed(str(exc)) from exc
        except Exception as exc:
            _end_capture_after_error(graph, device, pool)
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise CaptureFailed(f"{type(exc).__name__} while capturing: {first_line}") from exc
        try:
            graph.capture_end()
        except Exception as exc:
            _end_capture_after_error(graph, device, pool)
            raise CaptureFailed(f"the capture was invalidated: {str(exc).strip().splitlines()[0]}") from exc
    timings["capture"] = clock() - started
    # Records must not keep the capture's tensors alive: intermediates freed now return to
    # the pool, where the next graph recorded into it reuses them.
    records = [attrs.evolve(r, args=tuple(_scalar_or_none(a) for a in r.args)) for r in recorder.records]
    del args, kwargs, capture_leaves
    graph.instantiate()
    seconds = clock() - started
    timings["instantiate"] = seconds - timings["capture"]
    measured = clock()
    memory = max(pool_bytes(device, pool) - pool_before, 0)
    timings["pool size"] = clock() - measured
    return Capture(
        graph=graph,
        device=device,
        outputs=outputs,
        records=records,
        inputs=inputs,
        input_dtypes={i: t.dtype for i, t in tensors.items()},
        dynamic_values={i: leaf.value for i, leaf in enumerate(leaves) if isinstance(leaf, Dynamic)},
        staged=staged,
        copied_back=copied_back,
        torch_read={watched_index[w] for w in observer.read if watched_index[w] not in staged},
        torch_written={watched_index[w] for w in observer.written if watched_index[w] not in staged},
        seconds=seconds,
        memory=memory,
        timings=timings,
    )


def analyse(capture: Capture) -> None:
    """Read the graph's nodes and plan the rebinding (fills ``capture.nodes/plan``). Raises
    CaptureFailed when the graph cannot be rebound, CaptureRetry when more inputs must be
    staged; the caller then releases ``capture.graph``."""
    started = time.perf_counter()
    backend = get_backend()
    capture.nodes = backend.graph_nodes(capture.graph.raw_cuda_graph())
    views, scanned = node_views(backend, capture.nodes, capture.records)
    plan = rebinding.build_plan(
        capture.inputs,
        launch_views(capture.records),
        views,
        staged=set(capture.staged),
        copied_back=capture.copied_back,
        torch_read=capture.torch_read,
        torch_written=capture.torch_written,
        scanned=scanned,
    )
    capture.timings["analyse"] = time.perf_counter() - started
    if plan.failure:
        raise CaptureFailed(plan.failure)
    if plan.needs_staging or plan.needs_copy_back:
        raise CaptureRetry(plan)
    capture.plan = plan


def first_outputs(capture: Capture) -> object:
    """What the first launch of a fresh capture returns: the capture's own outputs, with
    dynamic scalars turned into their recorded values."""
    spec, leaves, _ = flatten((capture.outputs,), {})
    values = [leaf.value if isinstance(leaf, DynamicScalar) else leaf for leaf in leaves]
    return unflatten(spec, values)[0][0]
