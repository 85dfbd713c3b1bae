"""Shape-polymorphic replay: a bucket's graph serves every smaller size, exactly.

With ``capture(buckets=[...], polymorphic=True)``, a call whose ``replay.padded`` arguments
are smaller than their bucket does not have to be padded: the bucket's graph can run the
call's own launches, at the call's own size, once it is known that they are the same
launches. That is established by one observed eager run per size (:func:`observe`): the
region runs on the call's real arguments with jitcore's launch recorder installed and a
dispatch mode watching torch. The run is exact (it is eager) and it is the call's result.

Its launches are then matched against the graph's (:func:`match`), launch for launch:

- the same kernel (function handle), block and shared memory; the grid may differ;
- every parameter that is not a pointer takes the observed bytes (sizes, strides, scalars);
- a pointer into an argument is left to the variant's rebinding plan, as in any graph;
- a pointer into memory the observed run made (a tensor a factory op allocated, seen by the
  dispatch mode) is moved into the memory the graph's recording made at the same place:
  storage for storage, a one-to-one correspondence over the whole run, each observed
  storage no larger than its counterpart. Both runs keep every storage a launch saw alive
  until they end (the records hold the tensors), so distinct storages never overlap and the
  translated launches read and write exactly what the observed ones did, in graph memory;
- a pointer into memory neither made nor an argument (a global weight) must be the graph's.

Nothing else may run: the observed run may call torch only for views and allocations (any
other op on a device tensor may launch a kernel the graph does not hold), and the graph
must hold nothing but the matched jit launches and the copies of its outputs into the
region's output slots (a torch op node, a matmul, picks its kernels per size). What the
region returns is found in the same correspondence: an output in memory the run made must
lie in memory the graph copies into an output slot, and is handed out as the observed
view of that slot.

A size that matches gets a :class:`VariantGraph`: a replay function of its own (guards,
rebinding plan, outputs, generated like any graph's) over the bucket's exec. The graphs
sharing an exec form a :class:`Family`; the exec's kernel nodes hold one member's state at a
time, and a replay of another member first writes its nodes back (a node update per node
whose bytes or grid differ). A size that does not match is padded as any bucketed call is,
and the reason is kept (``Region.polymorphic_report``).

What stays assumed, as for every graph: the region's Python takes the same path on every
call of one key (one size); the observed run shows that path once. Kernels launched by
neither jitcore nor torch (CuPy, ctypes) are not seen by the observed run; a graph holding
one is refused, and a region that launches one only at some sizes is not caught (document:
do not; ``verify_every`` catches it).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence

import attrs
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from jitcore import for_replay
from jitcore.for_replay import get_backend
from replay import output_identity, rebinding, recording, region_keys, triton_launches
from replay.dynamic import DynamicScalar
from replay.graph import (
    NodeState,
    OwnedOutput,
    RecordedGraph,
    SlotOutput,
    TensorTemplate,
    ValueTemplate,
    compile_function,
)
from replay.observe import METADATA_QUERIES, run_as_parts, runs_as_its_parts
from replay.recording import CaptureFailed, StorageUse

log = logging.getLogger("replay")

_POINTER = struct.Struct("<Q")

#: The most (loaded, to load) pairs of family members whose node lists a family keeps.
MAX_CACHED_PUSHES = 4096


@attrs.frozen
class Launch:
    """One jit launch as :func:`match` needs it. ``pointers``: (parameter index, byte offset
    in ``param_bytes``, the storage it points into or None) for each pointer parameter."""

    function: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    param_bytes: bytes
    pointers: tuple[tuple[int, int, StorageUse | None], ...]
    fixed_grid: bool = True  # launched, and no grid computed from dynamic scalars


class Unmatched(Exception):
    """The observed launches cannot run on the graph; the message says where."""


@attrs.frozen
class Match:
    """The observed launches moved onto the graph: per launch its parameter bytes (pointers
    into memory the run made now point into the graph's) and grid, and the correspondence
    of storages (observed first byte -> the graph's)."""

    param_bytes: tuple[bytes, ...]
    grids: tuple[tuple[int, int, int], ...]
    translation: dict[int, int]


def _in_inputs(address: int, inputs: Sequence[tuple[int, int]]) -> bool:
    return any(lo <= address < hi or address == lo for lo, hi in inputs)


def match(graph: Sequence[Launch], observed: Sequence[Launch], inputs: Sequence[tuple[int, int]]) -> Match:
    """Move the ``observed`` launches onto the ``graph``'s (see the module docstring), or
    raise :class:`Unmatched`. ``inputs``: the observed call's argument byte ranges."""
    if len(observed) != len(graph):
        raise Unmatched(f"{len(observed)} launches at this size, {len(graph)} in the graph")
    forward: dict[int, int] = {}
    backward: dict[int, int] = {}
    moved, grids = [], []
    for number, (ours, theirs) in enumerate(zip(observed, graph)):
        where = f"launch {number}"
        if ours.function != theirs.function:
            raise Unmatched(f"{where} runs another kernel")
        if (ours.block, ours.shared) != (theirs.block, theirs.shared):
            raise Unmatched(f"{where} has another block or shared memory size")
        if len(ours.param_bytes) != len(theirs.param_bytes) or [p[:2] for p in ours.pointers] != [
            p[:2] for p in theirs.pointers
        ]:
            raise Unmatched(f"{where} has other parameters")
        if not (ours.fixed_grid and theirs.fixed_grid):
            raise Unmatched(f"{where} has an empty grid or one computed from a dynamic scalar")
        new = bytearray(ours.param_bytes)
        for (index, offset, use), (_, _, graph_use) in zip(ours.pointers, theirs.pointers):
            address = _POINTER.unpack_from(ours.param_bytes, offset)[0]
            if _in_inputs(address, inputs):
                continue  # an argument, or a view of one: the variant's plan rebinds it each call
            if use is not None and use.made:
                if graph_use is None or not graph_use.made:
                    raise Unmatched(
                        f"{where}, parameter {index}: memory the region made, where the graph's launch points "
                        "into memory it did not make"
                    )
                if (
                    forward.setdefault(use.base, graph_use.base) != graph_use.base
                    or backward.setdefault(graph_use.base, use.base) != use.base
                ):
                    raise Unmatched(
                        f"{where}, parameter {index}: the region's memory is shared otherwise than in the graph"
                    )
                if use.nbytes > graph_use.nbytes:
                    raise Unmatched(
                        f"{where}, parameter {index}: {use.nbytes} bytes, where the graph holds {graph_use.nbytes}"
                    )
                _POINTER.pack_into(new, offset, graph_use.base + address - use.base)
            elif address != _POINTER.unpack_from(theirs.param_bytes, offset)[0]:
                raise Unmatched(
                    f"{where}, parameter {index}: memory the region did not make (a global) other than the graph's"
                )
        moved.append(bytes(new))
        grids.append(ours.grid)
    return Match(tuple(moved), tuple(grids), forward)


def output_place(
    storage: int, address: int, extent: int, translation: dict[int, int], lanes: Sequence[tuple[int, int]]
) -> tuple[int, int] | None:
    """Where an observed output in memory the run made lies in the graph's output slots:
    (lane, byte offset in it), or None when the graph copies no such bytes out."""
    target = translation.get(storage)
    if target is None:
        return None
    moved = target + address - storage
    for lane, (lo, size) in enumerate(lanes):
        if lo <= moved and moved + extent <= lo + size:
            return lane, moved - lo
    return None


# --- the observed run ----------------------------------------------------------------------
_aten = torch.ops.aten
#: ops that allocate without writing (their tensors are memory the run made)
_FACTORIES = {
    getattr(_aten, name)
    for name in ("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided")
    if hasattr(_aten, name)
}
#: ops that launch nothing besides views (``is_view``) and allocations
_NO_LAUNCH = {
    getattr(_aten, name) for name in ("detach", "alias", "lift_fresh", *METADATA_QUERIES) if hasattr(_aten, name)
}


class LaunchFreeObserver(TorchDispatchMode):
    """Active over an observed run: notes the storages factory ops make (``made``) and the
    first op that may launch device work (``launching``: any op on a tensor of
    ``device_types`` besides views, allocations and metadata queries)."""

    def __init__(self, device_types: Sequence[str] = ("cuda",)):
        super().__init__()
        self.device_types = tuple(device_types)
        self.made: set[int] = set()
        self.launching: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if runs_as_its_parts(func):  # under inference mode: its parts are what may launch (observe.py)
            with self:
                return run_as_parts(func, args, kwargs)
        result = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in _FACTORIES:
            for tensor in tree_flatten(result)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.layout is torch.strided:
                    self.made.add(tensor.untyped_storage().data_ptr())
        elif self.launching is None and not getattr(func, "is_view", False) and packet not in _NO_LAUNCH:
            tensors = [t for t in tree_flatten((args, kwargs, result))[0] if isinstance(t, torch.Tensor)]
            if any(t.device.type in self.device_types for t in tensors):
                self.launching = str(func)
        return result


class _Launches:
    """jitcore's recorder protocol: keeps every launch (its record holds the tensors, so
    the run's storages stay apart until it ends); a jit miss compiles, as in any eager run."""

    def __init__(self) -> None:
        self.records: list = []

    def launch(self, record) -> None:
        self.records.append(record)

    def miss(self, description: str) -> None:
        return None


@attrs.define
class Observation:
    records: list
    made: set[int]
    launching: str | None
    outputs: object  # what the region returned (dynamic scalars as DynamicScalar)
    doubts: dict = attrs.Factory(dict)  # recording.input_doubts, taken before the run
    identity: output_identity.OutputIdentity = output_identity.UNKNOWN  # which outputs are the caller's objects


def observe(
    fn, spec: object, leaves: Sequence, paths: Sequence[str], held: recording.HeldTensors | None = None
) -> Observation:
    """Run the region eagerly on the call's arguments (dynamic scalars as
    :class:`~replay.dynamic.DynamicScalar`, as a capture passes them, so that launches
    report where their scalars came from), recording its launches and watching torch.
    ``held`` as for a capture (recording.input_doubts)."""
    doubts = recording.input_doubts({i: leaf for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}, held)
    args, kwargs = recording.region_arguments(spec, leaves, paths, {}, None)
    launches = _Launches()
    observer = LaunchFreeObserver()
    with for_replay.recording(launches), triton_launches.recording(launches), observer:
        outputs = fn(*args, **kwargs)
    identity = output_identity.identify(outputs, output_identity.given_objects(leaves, {}, None), held)
    return Observation(launches.records, observer.made, observer.launching, outputs, doubts, identity)


def plain_outputs(outputs: object) -> object:
    """The observed run's result as an eager call returns it (dynamic scalars as values)."""
    spec, leaves, _ = region_keys.flatten((outputs,), {}, walk_dataclasses=True)
    if not any(isinstance(leaf, DynamicScalar) for leaf in leaves):
        return outputs
    values = [leaf.value if isinstance(leaf, DynamicScalar) else leaf for leaf in leaves]
    return region_keys.unflatten(spec, values)[0][0]


# --- the family of graphs over one exec ----------------------------------------------------
class Family:
    """The graphs that share one exec: the bucket's own graph (``base``) and its variants.
    ``updaters`` (the base's, extended) covers every node any member binds or moves;
    ``loaded`` is the member whose state the nodes hold (None: unknown, after an
    interrupted update)."""

    def __init__(self, base: RecordedGraph, forget) -> None:
        self.base = base
        self.members: list[RecordedGraph] = [base]
        self.updaters = base.updaters
        self.loaded: RecordedGraph | None = base
        self.forget = forget  # called with each variant released with the base
        # (member loaded, member to load) -> the nodes to push: where their states differ, and
        # where the loaded one binds values (its replays may have patched them)
        self.pushes: dict[tuple, list[int]] = {}
        base.node_base = {
            node: (base.capture.records[launch].param_bytes, tuple(base.capture.records[launch].grid))
            for launch, node in base.plan.matches
        }
        base.bound_nodes = {b.node for b in (*base.plan.pointers, *base.plan.scalars)}

    def load(self, member: RecordedGraph) -> None:
        """Write ``member``'s state into the nodes where it differs from what they hold
        (every node any member binds or moves, when that is unknown), reset its remembered
        values, and leave the output copies for its replay to point at its slot."""
        previous = self.loaded
        self.loaded = None  # unknown until every push below went through
        if previous is None:
            nodes = list(self.updaters)
        else:
            nodes = self.pushes.get((previous, member))
            if nodes is None:
                nodes = [
                    node
                    for node in self.updaters
                    if node in previous.bound_nodes or previous.node_base[node] != member.node_base[node]
                ]
                if len(self.pushes) >= MAX_CACHED_PUSHES:
                    self.pushes.clear()
                self.pushes[(previous, member)] = nodes
        for node in nodes:
            updater = self.updaters[node]
            data, grid = member.node_base[node]
            updater.params.buffer[: len(data)] = data
            if previous is None or previous.node_base[node][1] != grid:
                for field, value in zip(("grid_x", "grid_y", "grid_z"), grid):
                    updater.set_dimension(field, value)
            updater.apply()
        last = member.namespace.get("_last")
        if last is not None:
            last[:] = member.initial_last
        for other in self.members:
            other.bound_slot = other.views = None
        member.session.counters.patches += len(nodes)
        self.loaded = member

    def added_updaters(self) -> None:
        """New nodes are bound or moved: the cached lists of pushes leave them out."""
        self.pushes.clear()

    def release(self, member: RecordedGraph) -> None:
        """``member`` is released; the base takes its variants with it."""
        self.pushes.clear()
        if member is self.base:
            for variant in self.members[1:]:
                variant.release()
                self.forget(variant)
            self.members = []
        elif member in self.members:
            self.members.remove(member)
        if self.loaded is member:
            self.loaded = None


# --- the variant -------------------------------------------------------------------------
def refusal(base: RecordedGraph) -> str | None:
    """Why ``base`` cannot serve other sizes (None: it may)."""
    capture = base.capture
    if getattr(capture, "pointer_storages", None) is None:
        return "recorded without the storages of its launches"
    if base.plan.configs:
        return "a grid is computed from a dynamic scalar"
    if base.uses_rng:
        return "it draws random numbers"
    matched = {node for _, node in base.plan.matches}
    copies = {source for source, _ in base.lane_sources}
    for node in capture.nodes:
        if node.kind == "kernel" and node.index in matched:
            continue
        if node.kind == "memcpy" and node.pointers and node.pointers[0] in copies:
            continue
        what = "kernel no jit launch made (a torch op such as a matmul)" if node.kind == "kernel" else node.kind
        return f"its graph holds a {what} node"
    if len(base.plan.matches) != len(capture.records):
        return "a launch of its recording has no node"
    if base.staged or base.copied_back or base.host is not None:
        return "it stages inputs (a torch op or foreign kernel reads or writes them)"
    return None


def _launches(records: Sequence, storages: Sequence[dict]) -> list[Launch]:
    launches = []
    for record, uses in zip(records, storages):
        pointers = []
        for param in record.params:
            if param.kind == "pointer":
                if param.size != 8:
                    raise Unmatched(f"kernel {record.kernel}: a {param.size}-byte pointer")
                pointers.append((param.index, param.offset, uses.get(param.index)))
        launches.append(
            Launch(
                record.function,
                tuple(record.grid),
                tuple(record.block),
                record.shared_bytes,
                record.param_bytes,
                tuple(pointers),
                fixed_grid=getattr(record, "launched", True) and not getattr(record, "dynamic_config", ()),
            )
        )
    return launches


@attrs.define
class _ObservedCall:
    """What :meth:`RecordedGraph._classify_outputs` and the pointer code read of a capture."""

    inputs: list
    input_dtypes: dict


class VariantGraph(RecordedGraph):
    """A size served by a bucket's graph: its own replay over the base's exec (see the
    module docstring). Built by :func:`make_variant`."""

    def __init__(
        self, base: RecordedGraph, key: tuple, entry, spec, leaves, paths, ranges, observation, moved: Match, plan
    ):
        backend = get_backend()
        self.base = base
        self.region = base.region
        self.region_name = base.region_name
        self.entry = entry
        self.key = key
        self.graph = base.graph
        self.device = base.device
        self.plan = plan
        self.staged, self.copied_back, self.host = {}, set(), None
        self.in_place = {}
        self._variant_inputs(spec, leaves, paths, ranges)
        self.session = base.session
        self.uses_rng = False
        self.generation = 0
        self.replays = 0
        self.memory = 0
        # one name for every variant, as for every graph: the variants of a bucket's graph
        # generate one text, compiled once (their filenames tell them apart)
        self.name = "replay_graph_variant"
        self._variant_nodes(backend, moved, plan)
        self.released = False
        self.initial_last = []
        self.checks = []
        for record in observation.records:
            if record.check_globals is not None and record.check_globals not in self.checks:
                self.checks.append(record.check_globals)
        self._variant_outputs(observation, moved)
        self.namespace = dict(backend.hot_namespace)
        self.source = self._generate(backend, leaves)
        self.replay = compile_function(
            self.source,
            self.name,
            f"size variant {len(self.family.members)} of a replay graph of region {base.region_name}",
            self.namespace,
        )
        self.step_refused = "a size variant (its exec shared with its family)"

    def _variant_inputs(self, spec, leaves: Sequence, paths: Sequence[str], ranges: list) -> None:
        """The call's arguments as this size's key holds them: paths, byte ranges, dtypes and
        templates."""
        self.paths = list(paths)
        self.spec = spec
        tensors = {i: leaf for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
        self.capture = _ObservedCall(ranges, {i: t.dtype for i, t in tensors.items()})
        self.template = [
            TensorTemplate(tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, False)
            if isinstance(leaf, torch.Tensor)
            else ValueTemplate(leaf)
            for leaf in leaves
        ]
        self.input_bytes = sum(region_keys.extent_bytes(t) for t in tensors.values())

    def _variant_nodes(self, backend, moved: Match, plan: rebinding.Plan) -> None:
        """Each matched node's state at this size (the moved parameter bytes and grid), and an
        updater in the family for every node this size binds or holds otherwise than the base."""
        base, family = self.base, self.base.family
        nodes = {n.index: n for n in base.capture.nodes}
        self.node_base = {node: (moved.param_bytes[launch], moved.grids[launch]) for launch, node in plan.matches}
        raw_exec = self.graph.raw_cuda_graph_exec()
        bound = {b.node for b in plan.pointers} | {b.node for b in plan.scalars}
        for node, state in self.node_base.items():
            if node in family.updaters or (node not in bound and state == base.node_base[node]):
                continue
            launch = next(launch for launch, n in base.plan.matches if n == node)
            record = base.capture.records[launch]
            family.updaters[node] = backend.node_updater(raw_exec, nodes[node], record.layout, record.param_bytes)
            family.added_updaters()
        self.updaters = family.updaters
        self.bound_nodes = bound
        self.node_states = {
            node: NodeState(
                self.updaters[node],
                self.node_base[node][0],
                self.node_base[node][1] + tuple(self.updaters[node].dimensions()[3:]),
            )
            for node in bound
        }
        self.family = family

    def _variant_outputs(self, observation: Observation, moved: Match) -> None:
        """What this size returns: the observed run's outputs, with those in memory the run
        made handed out from the base's output slots."""
        base = self.base
        self.output_spec, output_leaves, _ = region_keys.flatten((observation.outputs,), {}, walk_dataclasses=True)
        try:
            self.outputs = self._classify_outputs(output_leaves, observation.identity)
        except CaptureFailed as failure:
            raise Unmatched(failure.reason) from None
        self.output_memory = {}
        self.slot = self.bound_slot = self.views = None
        self.output_slots, self.slot_need, self.retargets = base.output_slots, base.slot_need, base.retargets
        self.lane_sources = base.lane_sources
        self.slot_outputs = []
        self._place_outputs(observation, moved)

    def _place_outputs(self, observation: Observation, moved: Match) -> None:
        """Outputs in memory the run made: the same views of the output slot its graph copies
        them into (anything else a graph cannot hand out at this size is refused)."""
        for number, item in enumerate(self.outputs):
            if not isinstance(item, OwnedOutput):
                continue
            tensor = item.tensor
            where = f"output {number}"
            if tensor.requires_grad:
                raise Unmatched(f"{where} requires grad")
            if not tensor.numel():
                self.outputs[number] = OwnedOutput(
                    torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)
                )
                continue
            storage = tensor.untyped_storage().data_ptr()
            if storage not in observation.made:
                if tensor.device.type != "cuda":
                    raise Unmatched(f"{where} is a tensor on {tensor.device}")
                continue  # a tensor the region did not make (a global): returned as it is, as eagerly
            if self.output_slots is None:
                raise Unmatched(f"{where}: the graph has no output slots")
            place = output_place(
                storage, tensor.data_ptr(), region_keys.extent_bytes(tensor), moved.translation, self.lane_sources
            )
            if place is None:
                raise Unmatched(f"{where} lies in memory the graph does not copy out")
            lane, offset = place
            elements, remainder = divmod(offset, tensor.element_size())
            if remainder:
                raise Unmatched(f"{where} is misaligned in its output slot")
            self.outputs[number] = SlotOutput(len(self.slot_outputs))
            self.slot_outputs.append((lane, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), elements))

    def release(self) -> None:
        """Forget this size; the exec, its nodes and their updaters are the base's."""
        self.leave_family_and_slots()
        self.node_states.clear()
        self.outputs = []
        self.namespace.clear()


def make_variant(
    base: RecordedGraph,
    key: tuple,
    entry,
    spec,
    leaves: Sequence,
    paths: Sequence[str],
    observation: Observation,
    forget,
) -> VariantGraph:
    """The observed size as a variant of ``base``, or :class:`Unmatched` saying why not.
    Nothing is changed on a refusal (no family, no updater)."""
    reason = refusal(base)
    if reason:
        raise Unmatched(f"the bucket's graph cannot serve other sizes: {reason}")
    if observation.launching:
        raise Unmatched(f"the region calls {observation.launching} at this size (an op that may launch a kernel)")
    moved = _moved_onto(base, observation, leaves)
    ranges, plan = _variant_plan(base, observation, moved, leaves, paths)
    new_family = base.family is None
    if new_family:
        base.family = Family(base, forget)
    try:
        variant = VariantGraph(base, key, entry, spec, leaves, paths, ranges, observation, moved, plan)
    except BaseException:
        if new_family:
            base.family = None
        raise
    base.family.members.append(variant)
    return variant


def _moved_onto(base: RecordedGraph, observation: Observation, leaves: Sequence) -> Match:
    """The observed launches moved onto the base's graph (:func:`match`)."""
    capture = base.capture
    graph_launches = _launches(capture.records, capture.pointer_storages)
    storages = recording.pointer_storages(observation.records, observation.made.__contains__)
    observed = _launches(observation.records, storages)
    inputs = [
        region_keys.byte_range(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda"
    ]
    if any(isinstance(leaf, torch.Tensor) and leaf.device.type != "cuda" for leaf in leaves):
        raise Unmatched("a host tensor argument")
    return match(graph_launches, observed, inputs)


def _variant_plan(
    base: RecordedGraph, observation: Observation, moved: Match, leaves: Sequence, paths: Sequence[str]
) -> tuple[list, rebinding.Plan]:
    """(the call's input ranges, the rebinding plan of the moved launches over the base's
    nodes); Unmatched where this size needs more than rebinding, or other nodes."""
    capture = base.capture
    records = [
        record.replace(param_bytes=data, args=tuple(recording.scalar_or_none(a) for a in record.args))
        for record, data in zip(observation.records, moved.param_bytes)
    ]
    launch_nodes = capture.launch_nodes or [None] * len(records)
    views = _node_views(capture.nodes, records, base.plan.matches)
    tensors = {i: leaf for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
    ranges = recording.input_ranges(tensors, paths)
    extents = recording.pointer_extents(observation.records, ranges, tensors.values(), observation.doubts)
    plan = rebinding.build_plan(
        ranges,
        recording.launch_views(records, launch_nodes, None, extents),
        views,
        staged=set(),
        copied_back=set(),
        torch_read=set(),
        torch_written=set(),
        scanned=True,
    )
    problem = plan.failure or plan.retry_later
    if not problem and (plan.needs_staging or plan.needs_copy_back or plan.configs):
        problem = "an input would have to be staged"
    if not problem and sorted(plan.matches) != sorted(base.plan.matches):
        problem = "its launches pair with other nodes"
    if problem:
        raise Unmatched(problem)
    return ranges, plan


def _node_views(nodes: Sequence, records: Sequence, matches: Sequence[tuple[int, int]]) -> list[rebinding.NodeView]:
    """The base's nodes as they hold this size: each kernel node with its launch's moved
    parameters."""
    by_node = {node: launch for launch, node in matches}
    views = []
    for node in nodes:
        if node.kind == "kernel":
            record = records[by_node[node.index]]
            layout = record.layout
            params = [
                record.param_bytes[offset : offset + kind.size] for offset, kind in zip(layout.offsets, layout.types)
            ]
            views.append(
                rebinding.NodeView(
                    node.index, "kernel", node.function, tuple(params), handle=recording.node_handle(node)
                )
            )
        else:  # an output copy (refusal() allows no other): it reads the graph's memory and writes
            # an output slot, never an argument (the replay's own checks keep arguments out of slots)
            views.append(rebinding.NodeView(node.index, "other", handle=recording.node_handle(node)))
    return views
