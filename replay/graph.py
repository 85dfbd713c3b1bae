"""A recorded graph and its generated replay function.

Replaying is straight-line Python generated per graph (print it with ``REPLAY_DUMP=1`` or
``Session.dump()``); where csrc/replay_step.c and the torch-side helper are built, most graphs run
the same steps from C in front of it (replay.graph_step). It runs in two phases:

1. Check and compute, changing nothing: the region's globals, the torch modes, how the tensor
   arguments overlap (it must be the pattern the graph was recorded for), the new pointers and
   the parameters and grid sizes computed from dynamic scalars (packed to their exact bytes).
   Anything this graph cannot serve exactly (another aliasing pattern, a value that does not
   fit its C type, a grid beyond the device, a pointer leaving its input) returns
   :data:`MISMATCH` and the caller runs the call eagerly, which gives the exact result or
   the exact error.
2. Patch and launch: write what changed into the kernel nodes' parameter buffers, push each
   dirty node to the graph exec (disabling a node whose grid became 0), remember what the
   nodes now hold, launch the graph once on the current stream, and build the outputs in the
   region's structure (a fresh container every call).

"What the nodes hold" changes only after the driver took the update, and an exception while
patching restores every buffer to what its node holds, so an interrupted replay never
leaves a half-patched graph behind. Graphs whose region draws random numbers are launched
through torch's own ``CUDAGraph.replay()``, which advances the generators' offsets first.

This module is the graph itself (what the session and the polymorphic variants call); the
function's text is replay.graph_source's (its checks replay.graph_checks', its outputs
replay.graph_outputs'), the C step's program replay.graph_step's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from jitcore.for_replay import generated, get_backend
from replay import graph_outputs, output_slots, rebinding, region_keys, value_keys
from replay.errors import ReplayMismatchError
from replay.graph_outputs import (  # noqa: F401 (the output kinds, where callers import them)
    ConstantOutput,
    DynamicOutput,
    HeldOutput,
    InputView,
    Output,
    OwnedOutput,
    SameOutput,
    SlotOutput,
    StaleGuardTensor,
    guard_outputs,
)
from replay.graph_source import MISMATCH, UNKNOWN, ReplaySource
from replay.graph_step import ReplayStep, make_step  # noqa: F401 (where tests read the C step type)
from replay.recording import Capture
from replay.source_text import compile_function

if TYPE_CHECKING:
    from jitcore.for_replay import NodeUpdater


def bitwise_equal(a: object, b: object) -> bool:
    """Equal bit for bit: tensors of one shape and dtype with the same bytes (NaNs and -0.0
    included), floats by their bits, anything else by type and ==."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    if isinstance(a, float) and isinstance(b, float):
        return value_keys.float_bits(a) == value_keys.float_bits(b)
    return type(a) is type(b) and a == b


def clone_preserving_sharing(leaves: Sequence) -> list:
    """Independent copies of the tensor leaves that share memory exactly as the originals do:
    one copy per storage, every leaf rebuilt on it with its own offset, shape and strides (so
    the same tensor passed twice, or overlapping views, stay aliased in the copy)."""
    copies: dict[int, torch.UntypedStorage] = {}
    result = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            result.append(leaf)
            continue
        storage = leaf.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else id(leaf)
        copy_storage = copies.get(key)
        if copy_storage is None:
            copy_storage = copies[key] = storage.clone()
        copy = torch.empty(0, dtype=leaf.dtype, device=leaf.device)
        copy.set_(copy_storage, leaf.storage_offset(), leaf.shape, leaf.stride())
        result.append(copy)
    return result


class NodeState:
    """A kernel node's parameter bytes and launch dimensions as recorded, put back into the
    updater's buffers when a replay is interrupted (see RecordedGraph._interrupted: after
    that every patchable value is written again, so what stays is exactly the recording's)."""

    __slots__ = ("updater", "held", "dimensions")

    def __init__(self, updater, held: bytes | None = None, dimensions: tuple | None = None) -> None:
        """``held``/``dimensions``: what the node holds in this graph's own state, where that is
        not what the updater's buffer holds now (a polymorphic variant: replay.polymorphic)."""
        self.updater = updater
        self.held = bytes(updater.params.buffer) if held is None else held
        if dimensions is None:
            dimensions = updater.dimensions() if hasattr(updater, "dimensions") else ()
        self.dimensions = dimensions

    def rollback(self) -> None:
        buffer = self.updater.params.buffer
        buffer[: len(self.held)] = self.held
        for field, value in zip(self.updater.DIMENSIONS, self.dimensions):
            self.updater.set_dimension(field, value)


@attrs.frozen
class TensorTemplate:
    """A recorded tensor argument's layout: a placeholder like it records the key again."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    host: bool = False  # a host (CPU) tensor input


@attrs.frozen(eq=False)
class ValueTemplate:
    """A recorded argument that is not a tensor, passed again as it was."""

    value: object


def templates(leaves: Sequence) -> list[TensorTemplate | ValueTemplate]:
    """What the leaves looked like, to record their key again without the caller's tensors."""
    return [
        TensorTemplate(tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.device.type == "cpu")
        if isinstance(leaf, torch.Tensor)
        else ValueTemplate(leaf)
        for leaf in leaves
    ]


def _fixed_addresses(capture) -> tuple[int, ...] | None:
    """replay.rebinding.fixed_addresses of a capture: the recorded inputs and the staging
    buffers are what each replay points elsewhere, and the session's pool is memory no
    caller's tensor shares (most of a graph's words point there: its intermediates)."""
    if capture.node_views is None:
        return None
    per_call = [(r.lo, r.hi) for r in capture.inputs] + list(getattr(capture, "pool_memory", ()))
    per_call += [region_keys.storage_range(buffer) for buffer in capture.staged.values()]
    return rebinding.fixed_addresses(capture.node_views, per_call)


def _globals_checks(records: Sequence) -> list:
    """The jit launchers' globals checks of a recording's launches, each once, in order."""
    checks = []
    for record in records:
        if record.check_globals is not None and record.check_globals not in checks:
            checks.append(record.check_globals)
    return checks


class RecordedGraph:
    """One key's graph: its exec, node updaters, outputs and the generated replay."""

    # set by replay.polymorphic when the graph becomes the base of a family of size variants:
    # node -> (its parameter bytes, its grid) as captured; the nodes the plan binds values in
    node_base: dict[int, tuple[bytes, tuple]]
    bound_nodes: set[int]

    def __init__(
        self,
        region,
        key: tuple,
        capture: Capture,
        spec: object,
        leaves: Sequence,
        paths: Sequence[str],
        session,
        number: int,
    ):
        backend = get_backend()
        self.region, self.region_name, self.key = region, region.name, key
        self.entry = region.entries[key]
        self.capture, self.graph, self.device, self.plan = capture, capture.graph, capture.device, capture.plan
        self.staged, self.copied_back = capture.staged, capture.copied_back
        self.fixed_addresses = _fixed_addresses(capture) if self.staged else ()
        self.host = getattr(capture, "host", None)  # host inputs' pinned buffers (replay.host)
        self.paths, self.spec = list(paths), spec
        self.template = templates(leaves)
        self.input_bytes = sum(region_keys.extent_bytes(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor))
        self.session = session
        self.uses_rng = bool(getattr(self.entry, "uses_rng", False))
        self.generation = self.replays = 0
        self.memory = capture.memory
        # one name for every graph: with the values it needs in its namespace (extents as
        # _e{i}), the replay of a region's next shape is, as text, the one compiled before
        # (generated.compile_source reuses its code; the filename still tells graphs apart)
        self.name = "replay_graph"
        self.family: Any | None = None  # the graphs sharing this exec (replay.polymorphic), once there are several
        self.released = False
        self.updaters = self._node_updaters(backend, capture)
        self.node_states = {node: NodeState(updater) for node, updater in self.updaters.items()}
        self.checks = _globals_checks(capture.records)
        self._outputs_of(backend, capture)
        self.in_place = self._inputs_taken_in_place(capture)
        self.namespace: dict[str, Any] = dict(backend.hot_namespace)  # what the generated replay reads
        self.source = self._generate(backend, leaves)
        self.replay = compile_function(
            self.source, self.name, f"replay graph {number} of region {region.name}", self.namespace
        )
        #: why this graph replays through its generated Python rather than csrc/replay_step.c
        #: (None: through the C step, which runs that function itself for what it does not decide)
        step, self.step_refused, self.step_arguments_source = make_step(self, backend, leaves, self.generated)
        if step is not None:
            self.replay = step
        if generated.dump_enabled("REPLAY_DUMP"):
            print(f"# replay graph, {self.how_it_replays()}\n{self.full_source()}")

    def _outputs_of(self, backend, capture: Capture) -> None:
        """What the graph returns (replay.graph_outputs) and the memory it writes them into: the
        region's output slots where its copies can be pointed at them, else its own buffers."""
        self.output_spec, output_leaves, _ = region_keys.flatten((capture.outputs,), {}, walk_dataclasses=True)
        self.outputs = self._classify_outputs(output_leaves)
        self.output_memory = graph_outputs.own_memory(capture)  # what each replay writes
        self.slot = None  # the slot its replay wrote last (replay.output_slots)
        self.bound_slot = None  # the slot its output copies write now
        self.views = None  # its outputs' template views in the bound slot
        self.slot_outputs: list[tuple] = []  # (lane, dtype, size, stride, storage offset) per slotted output
        self.lane_sources: list[tuple[int, int]] = []  # per lane: (first byte, bytes) its copy reads
        self.output_slots, self.slot_need, self.retargets = graph_outputs.adopt_slots(self, backend, capture)
        # without slots, its own output buffers: where they are (a caller's resize_ moves them),
        # and the streams callers read them on (record_stream), as a slot's
        self.readers: list = []
        self.own_lanes = graph_outputs.own_memory_lanes(self, capture) if self.output_memory else []
        #: why this graph can serve no call any more (None: it can): the session drops it
        self.spoiled: str | None = None
        #: the raw stream of its last replay, kept where it has staged buffers or output memory
        #: of its own (graph_source.notes_stream): what the allocator is told on release
        self.stream: int | None = None

    def _node_updaters(self, backend, capture: Capture) -> dict[int, NodeUpdater]:
        """An updater per kernel node a replay patches (a pointer, a scalar or a grid)."""
        raw_exec = self.graph.raw_cuda_graph_exec()
        nodes = {n.index: n for n in capture.nodes}
        updaters = {}
        for binding in (*self.plan.pointers, *self.plan.scalars, *self.plan.configs):
            if binding.node not in updaters:
                record = capture.records[binding.launch]
                updaters[binding.node] = backend.node_updater(
                    raw_exec, nodes[binding.node], record.layout, record.param_bytes
                )
        return updaters

    def full_source(self) -> str:
        """The replay function's source, and the C step's argument function where it has one."""
        maker = getattr(self, "step_arguments_source", "")
        return f"{self.source}\n# the C step's jit arguments\n{maker}" if maker else self.source

    def how_it_replays(self) -> str:
        """One line for dumps: through csrc/replay_step.c, or through the generated function alone
        and why."""
        if self.step_refused is None:
            return "replayed by csrc/replay_step.c, which runs this function for what it does not decide"
        return f"replayed by this function alone: {self.step_refused}"

    def _generate(self, backend, leaves: Sequence) -> str:
        """The replay function's source (replay.graph_source), keeping what the C step's
        program takes from its generation (``generated``) and what the nodes hold as recorded
        (``initial_last``: replay.polymorphic loads it back)."""
        self.output_makers = graph_outputs.makers(self)
        self.generated = ReplaySource(self, backend, leaves).generate()
        self.initial_last = list(self.generated.patches.last)
        return self.generated.source

    def _classify_outputs(self, output_leaves: list, identity=None) -> list[Output]:
        """What each output leaf is, and so how a replay returns it (replay.graph_outputs);
        ``identity``: which are the caller's own objects (replay.output_identity; by default
        what the capture found)."""
        if identity is None:
            identity = getattr(self.capture, "identity", None)
        #: argument leaves that must be one object for its outputs to be told right (OutputIdentity.same)
        self.same_arguments = identity.same if identity is not None else ()
        return graph_outputs.classify(self, output_leaves, identity)

    def wait_for_readers(self, stream: int) -> None:
        """Before a replay on raw ``stream`` writes the graph's own output buffers: the streams
        callers read them on first (replay.output_slots.wait_for_readers)."""
        output_slots.wait_for_readers(self.readers, stream, self.device)

    def spoil(self, reason: str) -> object:
        """This graph can serve no call any more (``spoiled``, for the session to drop it); the
        call runs eagerly (MISMATCH)."""
        self.spoiled = reason
        return MISMATCH

    def _inputs_taken_in_place(self, capture: Capture) -> dict[int, tuple[torch.Tensor, tuple[int, ...]]]:
        """Staged inputs whose replay skips its staging copies when the caller passes the
        staged buffer itself: input index -> (buffer, the nodes of its copy in and back).
        Bucketing pads an argument straight into it (the session pads in place), where it
        would pad into a temporary that the copy in reads and the copy back writes for
        nothing: two kernel nodes of every bucketed step. Only where the backend can disable
        nodes of an exec, and where no output is a view of the input (it would be a view of
        the graph's buffer, overwritten by the next replay, not of a temporary of the call)."""
        staging_launches = getattr(capture, "staging_launches", None)
        if not self.staged or not staging_launches:
            return {}
        viewed = {output.input for output in self.outputs if isinstance(output, InputView)}
        nodes: dict[int, set[int]] = {}
        for binding in self.plan.pointers:
            if staging_launches.get(binding.launch) == binding.input:
                nodes.setdefault(binding.input, set()).add(binding.node)
        return {
            i: (buffer, tuple(sorted(nodes[i])))
            for i, buffer in self.staged.items()
            if i in nodes and i not in viewed and all(self.updaters[node].enable_call is not None for node in nodes[i])
        }

    def in_place_buffer(self, index: int) -> torch.Tensor | None:
        """The staged buffer of input ``index`` when passing it as that input skips the
        staging copies (see :meth:`_inputs_taken_in_place`), else None."""
        taken = self.in_place.get(index)
        return taken[0] if taken is not None else None

    def _retarget(self, slot) -> None:
        """Point every output copy at ``slot`` (phase 2 of a replay whose slot changed). On
        failure the copies' destinations are unknown: the next replay sets them again."""
        self.bound_slot = self.views = None
        for set_destination, lane in self.retargets:
            set_destination(slot.lanes[lane].address)
        self.views = slot.views_for(self, self.slot_outputs)
        self.bound_slot = slot
        self.session.counters.patches += len(self.retargets)

    def _interrupted(self) -> None:
        """A patch was interrupted (a failed node update, an exception, KeyboardInterrupt).
        What each node holds is now unknown: put every buffer back to its recorded bytes and
        forget every remembered value, so the next replay writes every patchable value again
        and pushes every node (an update the driver took just before the interruption is
        then simply repeated). Nothing is copied on the way of a replay that succeeds."""
        for state in self.node_states.values():
            state.rollback()
        if self.family is not None:
            self.family.loaded = None  # every node is pushed again by the next replay of any of them
        last = self.namespace.get("_last")
        if last is not None:
            last[:] = [UNKNOWN] * len(last)
        disabled = self.namespace.get("_disabled")
        if disabled is not None:
            for node in disabled:
                disabled[node] = None  # neither enabled nor disabled: set again next time

    def _set_failed(self, status: object, node: int) -> None:
        from jitcore import DriverError

        raise DriverError(f"graph node update (node {node}) in {self.name}", int(status), str(status))

    # --- verification --------------------------------------------------------------------
    def verify(self, leaves: Sequence, eager) -> object:
        """Replay, then run the region eagerly on copies of the inputs taken before the
        replay (sharing memory as the inputs do), and compare outputs and every input
        afterwards bit for bit."""
        snapshots = clone_preserving_sharing(leaves)
        before = torch.cuda.get_rng_state(self.device) if self.uses_rng else None
        result = self.replay(*leaves)
        if result is MISMATCH:
            return result
        replayed = [
            t.clone() if isinstance(t, torch.Tensor) else t
            for t in region_keys.flatten((result,), {}, walk_dataclasses=True)[1]
        ]
        if before is not None:  # the reference draws the numbers the replay drew, and the
            after = torch.cuda.get_rng_state(self.device)  # sequence goes on from the replay's
            torch.cuda.set_rng_state(before, self.device)
            try:
                expected = eager(snapshots)
            finally:
                torch.cuda.set_rng_state(after, self.device)
        else:
            expected = eager(snapshots)
        expected_leaves = region_keys.flatten((expected,), {}, walk_dataclasses=True)[1]
        problems = []
        if len(replayed) != len(expected_leaves):
            problems.append("a different number of outputs")
        for number, (a, b) in enumerate(zip(replayed, expected_leaves)):
            if not bitwise_equal(a, b):
                problems.append(f"output {number}")
        for i, (leaf, snapshot) in enumerate(zip(leaves, snapshots)):
            if isinstance(leaf, torch.Tensor) and not bitwise_equal(leaf, snapshot):
                problems.append(f"input {self.paths[i]} after the call")
        if problems:
            raise ReplayMismatchError(
                f"replay of region {self.region_name} differs from an eager run in {', '.join(problems)}: the "
                "graph is stale (a tensor or value it baked in has changed) or the region is not deterministic; "
                "Session.invalidate() drops graphs"
            )
        return result

    def placeholder_leaves(self) -> list:
        """Leaves like the recorded ones (fresh tensors of the same layout, same constants)."""
        leaves = []
        for item in self.template:
            if isinstance(item, TensorTemplate):
                device = "cpu" if item.host else f"cuda:{self.device}"
                leaves.append(torch.empty_strided(item.shape, item.stride, dtype=item.dtype, device=device))
            else:
                leaves.append(item.value)
        return leaves

    def leave_family_and_slots(self) -> None:
        """What releasing any graph starts with (a polymorphic variant's release stops here):
        leave the family sharing its exec, and the region's output slots."""
        self.released = True
        if self.family is not None:
            self.family.release(self)
            self.family = None
        if self.output_slots is not None:
            self.slot = self.bound_slot = self.views = None
            self.output_slots.forget(self)

    def release(self) -> None:
        # its staged buffers and own output memory go with the graph, while its last replay may
        # still use them on the stream it ran on (which waited for every replay before it): the
        # allocator reuses them once that replay is done
        own = [lane.buffer for lane in self.own_lanes]
        output_slots.record_on([*self.staged.values(), *own], self.stream)
        for lane in self.own_lanes:
            lane.free()
        self.own_lanes = []
        self.leave_family_and_slots()
        self.retargets = []
        self.updaters.clear()
        self.node_states.clear()
        self.outputs = []
        self.output_memory = {}
        self.namespace.clear()
        self.staged = {}
        self.in_place = {}
        self.graph.reset()
