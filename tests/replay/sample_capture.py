"""A capture shaped like the decode sample's (samples/decode_loop.py), made on the CPU.

For the CPU benchmark of the key's second call (benchmarks/recording_cpu.py) and the tests of
the replay build (tests/replay/test_graph.py): a region of jit launches over ten tensor
arguments (a token batch and eight caches the launches read and write through views, as the
sample's attention does), four layers of torch matmuls between them, returning a matmul's
output. It runs for real under the recorder (the jit's launch records, the plan's launch views
and extents, as a capture keeps them); what only a driver makes is made up here: each launch's
kernel node (known by its handle, as a capture reports it), a cuBLAS-like kernel node per
matmul whose parameter bytes point at memory of no argument (the pool's), and the copy of the
output into memory of its own. Nothing here runs on a GPU; the graph's exec is the caller's
(a backend double: the benchmark's does nothing, the tests' simulates one).
"""

from __future__ import annotations

import struct

import attrs
import numpy as np
import torch

from benchmarks.replay import affine
from jitcore.backends.abi import PackedParams
from jitcore.backends.base import GraphNode, NodeUpdater
from jitcore.backends.null import NullBackend
from replay import output_identity, recording, recording_steps, region_keys
from replay.graph import RecordedGraph
from replay.output_slots import OutputSlots
from replay.policy import Policy
from replay.rebinding import NodeView
from replay.stats import Stats

LAYERS, WIDTH, CACHE_ROWS = 4, 64, 16
#: A made-up address no CPU tensor has (the graph's pool, where a matmul's operands live).
POOL = 0x5A5A_0000_0000
#: A cuBLAS-like kernel's parameters: six pointers, four int sizes, a float and a struct of 64 bytes.
_FOREIGN_PARAMS = struct.Struct("<6Q4if")


def decode_like(tokens, *caches):
    """Per layer: a norm, a projection (torch), the cache writes and reads through views of
    two caches, a residual, a projection back (torch), a norm, an MLP (torch, a fused
    activation, torch); then a last norm and the logits from a matmul."""
    batch = tokens.shape[0]
    h = _launch(tokens, 1.0)  # the embedding reads the token batch
    for layer in range(LAYERS):
        keys, values = caches[2 * layer], caches[2 * layer + 1]
        projected = _launch(h, 1.0 + layer) @ _WEIGHTS[4 * layer]
        affine(projected, keys[:batch], 0.5, 0.0)  # the cache writes
        affine(projected, values[:batch], 0.25, 0.0)
        attended = _launch(keys[:batch], 1.0)  # the attention reads them
        mixed = _launch(values[:batch], 0.5) @ _WEIGHTS[4 * layer + 1]
        residual = _launch(attended, 1.0)
        up = _launch(_launch(residual, 0.5) @ _WEIGHTS[4 * layer + 2], 2.0)
        h = _launch(up @ _WEIGHTS[4 * layer + 3] + mixed, 1.0)
    return _launch(h, 1.0) @ _WEIGHTS[-1]


def _launch(x: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty_like(x)
    affine(x, out, scale, 1e-3)
    return out


_WEIGHTS = [torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(n)) for n in range(4 * LAYERS + 1)]
MATMULS = 4 * LAYERS + 1


def arguments(batch: int) -> tuple[torch.Tensor, ...]:
    """The region's arguments at one batch size: the token batch and the eight caches."""
    return (torch.randn(batch, WIDTH), *(torch.zeros(CACHE_ROWS, WIDTH) for _ in range(2 * LAYERS)))


def foreign_nodes(first: int, count: int) -> list[NodeView]:
    """``count`` cuBLAS-like kernel nodes numbered from ``first``, each parameter pointing into
    the pool or holding a size."""
    rng = np.random.default_rng(first)
    nodes = []
    for n in range(count):
        pointers = [POOL + int(offset) * 256 for offset in rng.integers(0, 1 << 20, 6)]
        scalars = struct.pack("<64s", rng.bytes(32) + bytes(32))
        packed = _FOREIGN_PARAMS.pack(*pointers, WIDTH, WIDTH, WIDTH, 1, 1.0)
        params = tuple(packed[k : k + 8] for k in range(0, 48, 8)) + tuple(packed[k : k + 4] for k in range(48, 68, 4))
        nodes.append(NodeView(first + n, "kernel", 0xC0B1A5, (*params, scalars), handle=0x20000 + first + n))
    return nodes


@attrs.frozen
class SampleCapture:
    """What the tests and the benchmark take of the capture: the steps of its recording, its
    nodes as the plan sees them (jit launches, then the matmuls, then the output's copy) and
    as a backend reports them, the region's flattened arguments, its outputs in their own
    memory."""

    steps: recording_steps.RecordingSteps
    node_views: list
    nodes: list
    leaves: tuple
    spec: object
    paths: list
    key: tuple
    outputs: torch.Tensor


def sample_capture(batch: int) -> SampleCapture:
    """The sample-like capture at ``batch`` tokens (under the current backend: a null one)."""
    args = arguments(batch)
    own = decode_like(*args).clone()  # the jit's misses first; the output copied into memory of its own
    steps = recording_steps.RecordingSteps(decode_like, args)
    jit = steps.nodes
    foreign = foreign_nodes(len(jit), MATMULS)
    copy = NodeView(len(jit) + MATMULS, "memcpy", pointers=(POOL, own.data_ptr()), handle=0x30000)
    views = [*jit, *foreign, copy]
    nodes = [_graph_node(view) for view in views]
    spec, leaves, paths = region_keys.flatten(args, {})
    key = region_keys.region_key(-1, spec, leaves, paths)
    return SampleCapture(steps, views, nodes, tuple(leaves), spec, paths, key, own)


def _graph_node(view: NodeView) -> GraphNode:
    """The node as a backend reports it (its launch dimensions made up)."""
    pointers = view.pointers if view.kind == "memcpy" else ()
    return GraphNode(view.index, view.handle, view.kind, view.function, (4, 1, 1), (64, 1, 1), pointers=pointers)


def plan(sample: SampleCapture) -> recording.rebinding.Plan:
    """The rebinding planner's plan of the sample (every argument rebound)."""
    return sample.steps.plan(sample.node_views)


def capture_for_graph(sample: SampleCapture, graph: object, made: recording.rebinding.Plan) -> recording.Capture:
    """A recording.Capture of the sample whose graph is ``graph`` (a double with
    ``raw_cuda_graph_exec``, ``replay`` and ``reset``) and whose plan is ``made`` (:func:`plan`)."""
    steps = sample.steps
    if made.failure or made.needs_staging:
        raise AssertionError(f"the sample-like capture must rebind every argument: {made}")
    owned = {sample.outputs.untyped_storage().data_ptr()}
    given = output_identity.given_objects(sample.leaves, {}, None)
    identity = output_identity.identify(sample.outputs, given, None)
    return recording.Capture(
        graph=graph,
        device=-1,
        outputs=sample.outputs,
        records=steps.kept[0],
        inputs=steps.inputs,
        input_dtypes={i: leaf.dtype for i, leaf in enumerate(sample.leaves)},
        dynamic_values={},
        staged={},
        copied_back=set(),
        torch_read=set(),
        torch_written=set(),
        seconds=0.0,
        memory=0,
        output_bytes=sample.outputs.untyped_storage().nbytes(),
        owned_outputs=owned,
        nodes=list(sample.nodes),
        node_views=list(sample.node_views),
        plan=made,
        identity=output_identity.with_memory(identity, sample.outputs, owned),
    )


# --- a graph of the sample with an exec that does nothing (the CPU benchmark's) -------------
_DONE = (0,)


def _done(*_args: object) -> tuple:
    return _DONE


class _NodeParams:
    """A kernel node's parameter buffer and launch dimensions, pushed nowhere."""

    enable_call, enable_args = _done, ()
    DIMENSIONS = NodeUpdater.DIMENSIONS

    def __init__(self, node: GraphNode, layout: object, initial: bytes) -> None:
        self.params = PackedParams(layout, initial)
        self.set_call, self.set_args = _done, ()
        self._dimensions = [*node.grid, *node.block, node.shared_bytes]

    def set_dimension(self, field: str, value: int) -> None:
        self._dimensions[self.DIMENSIONS.index(field)] = value

    def dimensions(self) -> tuple:
        return tuple(self._dimensions)


class NothingGraphBackend(NullBackend):
    """The null backend with graphs whose node updates, copies' retargets and launches do
    nothing: a replay build's host work alone."""

    raw_stream_handles = True

    def node_updater(self, raw_exec, node, layout, initial):
        return _NodeParams(node, layout, initial)

    def graph_launch_parts(self):
        return _done, _done

    def graph_exec_object(self, raw_exec):
        return raw_exec

    def memcpy_retargeter(self, raw_exec, node, device):
        return _done


class NothingGraph:
    """torch's CUDAGraph as a replay build reads it."""

    def raw_cuda_graph_exec(self) -> int:
        return 1

    def replay(self) -> None:
        pass

    def reset(self) -> None:
        pass


class BuildSession:
    """What a graph reads of its session: the policy, counters, the last stream, the region's
    output slots (CPU memory)."""

    def __init__(self) -> None:
        self.policy, self.counters, self.last_stream = Policy(), Stats(), [0]
        self.slots = OutputSlots(lambda size: torch.empty(size, dtype=torch.uint8))

    def stream_switch(self, stream: int) -> None:
        self.last_stream[0] = stream

    def output_slots(self, region: object, device: int) -> OutputSlots:
        return self.slots


@attrs.define
class _Entry:
    generation: int = 0


class BuildRegion:
    """What a graph reads of its region: its name and the entry of its key."""

    name = "decode_like"

    def __init__(self) -> None:
        self.entries: dict = {}


def build_graph(sample: SampleCapture, made: object, session: BuildSession, region: BuildRegion) -> RecordedGraph:
    """A RecordedGraph of the sample (under a backend with graphs: NothingGraphBackend)."""
    region.entries.setdefault(sample.key, _Entry())
    capture = capture_for_graph(sample, NothingGraph(), made)
    return RecordedGraph(region, sample.key, capture, sample.spec, sample.leaves, sample.paths, session, 0)
