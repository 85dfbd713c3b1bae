"""A recorded graph and its generated replay function.

Replaying is straight-line Python generated per graph (print it with ``REPLAY_DUMP=1`` or
``Session.dump()``); where csrc/replay_step.c and the torch-side helper are built, most graphs run
the same steps from C in front of it (:meth:`RecordedGraph._step`). It runs in two phases:

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
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import re
import struct
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence

import attrs
import numpy as np
import torch

import jitcore.torch_native
from jitcore import generated
from jitcore.backends import compiled_helpers_enabled, get_backend
from replay import host as host_inputs
from replay import output_slots, rebinding, recording, region_keys
from replay.dynamic import DynamicScalar
from replay.errors import ReplayMismatchError, StaleOutputError
from replay.recording import Capture, CaptureFailed

try:  # the aliasing check in C (csrc/replay_checks.c; optional, built by setup.py)
    from replay._checks import disjoint as _disjoint
except ImportError:
    _disjoint = None

try:  # a replay's steady state in C (csrc/replay_step.c; optional, built by setup.py)
    from replay._step import ReplayStep
except ImportError:
    ReplayStep = None


class _Mismatch:
    """Returned by a replay function for a call its graph cannot serve exactly."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MISMATCH"


MISMATCH = _Mismatch()

_sources = itertools.count()

#: A named constant in a dynamic scalar's source (replay.dynamic ``_k``, replay.recording ``_lit``).
_CONSTANT_NAME = re.compile(r"\b(?:_k|_lit)\d+\b")


def compile_function(source: str, name: str, description: str, namespace: dict) -> Callable:
    """Compile generated source with ``namespace`` as its globals, through jitcore's one
    generated-source helper (registered with ``linecache``, so tracebacks and pdb show its lines)."""
    filename = f"<{generated.comment(description)} #{next(_sources)}>"
    function = generated.define(source, filename, namespace)[name]
    function.source = source
    weakref.finalize(function, generated.forget_source, filename)  # rebuilt often: linecache stays bounded
    return function


def guard_outputs(value: object, owner) -> object:
    """Hand out tensors that raise once ``owner`` (an entry) has been replayed again."""
    spec, leaves, _ = region_keys.flatten((value,), {}, walk_dataclasses=True)
    return region_keys.unflatten(spec, [_stale_guard(leaf, owner) for leaf in leaves])[0][0]


def _stale_guard(leaf: object, owner) -> object:
    if not isinstance(leaf, torch.Tensor):
        return leaf
    leaf = leaf.as_subclass(StaleGuardTensor)
    leaf._replay_owner = owner
    leaf._replay_generation = owner.generation
    return leaf


class StaleGuardTensor(torch.Tensor):
    """An output handed out in ``check_stale`` mode: any use after the graph that produced it
    has been replayed again raises :class:`StaleOutputError` instead of reading new data."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            if isinstance(value, StaleGuardTensor):
                owner = getattr(value, "_replay_owner", None)
                if owner is not None and owner.generation != value._replay_generation:
                    raise StaleOutputError(
                        f"this output of region {owner.region.name} was overwritten by a later replay "
                        f"(replay {owner.generation}, output of replay {value._replay_generation}); copy "
                        "outputs you keep (tensor.clone()) or use capture(clone_outputs=True)"
                    )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def bitwise_equal(a: object, b: object) -> bool:
    """Equal bit for bit: tensors of one shape and dtype with the same bytes (NaNs and -0.0
    included), floats by their bits, anything else by type and ==."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    if isinstance(a, float) and isinstance(b, float):
        return region_keys.float_bits(a) == region_keys.float_bits(b)
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


#: Above this many non-empty tensor arguments recorded apart, replay checks that they are still
#: apart with numpy (about 5 us for 16, 8 us for 64 on the CPU box, against 6 and 27 for the
#: general pattern).
_NUMPY_DISJOINT_FROM = 12
#: From this many, with csrc/replay_checks.c built, by its ``disjoint`` (one sort in C: 0.33 us for
#: 4 ranges, 1.1 us for 16, against 0.52 and 7.4 us compared pair by pair, on the CPU box).
_C_DISJOINT_FROM = 4
#: At most this many tensor arguments for csrc/replay_step.c (its fixed-size pointer array).
_STEP_MAX_TENSORS = 64


def _disjoint_check() -> Callable | None:
    """replay._checks.disjoint where it was built and ``JITCORE_NATIVE`` allows it, else None."""
    if _disjoint is None or not compiled_helpers_enabled():
        return None
    return _disjoint


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


#: What ``measure_without_checks`` swaps in: each check reports "nothing changed".
def _unchanged() -> bool:
    return False


def _no_check() -> None:
    return None


def generated_replay(run: Callable) -> Callable:
    """The generated Python function behind a replay (``run`` itself where it is one)."""
    return run.fallback if ReplayStep is not None and isinstance(run, ReplayStep) else run


def measure_without_checks(graphs: Sequence[RecordedGraph]) -> contextlib.AbstractContextManager:
    """Benchmarks only: while the context lasts, ``graphs`` skip the per-call checks that
    guard exactness beyond the key (the torch settings, the jit launchers' globals), so a
    benchmark can time their cost as a difference (docs/benchmarks/replay.md). Calls made
    inside it are not protected: never use it around calls whose results matter."""

    def skipped(graph: RecordedGraph) -> dict[str, object]:
        checks = (name for name in graph.namespace if re.fullmatch(r"_check\d+", name))
        return {"_modes_changed": _unchanged, **dict.fromkeys(checks, _no_check)}

    return _namespaces_swapped(graphs, skipped)


#: The ways :func:`measure_with_settings_check` can make the settings check: (compiled, watch).
_SETTINGS_CHECK_WAYS = {"python": (False, False), "c": (True, False)}


def measure_with_settings_check(graphs: Sequence[RecordedGraph], way: str) -> contextlib.AbstractContextManager:
    """Benchmarks only: while the context lasts, ``graphs`` check the torch settings another
    way than the fastest one built, so a benchmark can time what each step saves: ``"python"``
    the generated Python check (where no C helper was built), ``"c"`` csrc/replay_checks.c's
    without the torch-side helper's settings watch. Every way is exact."""
    compiled, watch = _SETTINGS_CHECK_WAYS[way]
    return _namespaces_swapped(
        graphs,
        lambda graph: {"_modes_changed": region_keys.modes_changed(graph.key[2], compiled=compiled, watch=watch)},
    )


@contextlib.contextmanager
def _namespaces_swapped(
    graphs: Sequence[RecordedGraph], replacements: Callable[[RecordedGraph], dict[str, object]]
) -> Iterator[None]:
    """Each graph's replay namespace with ``replacements(graph)`` in place while the context
    lasts, then its own values back (the measurement hooks above)."""
    saved = []
    for graph in graphs:
        values = replacements(graph)
        saved.append((graph, {name: graph.namespace[name] for name in values}))
        graph.namespace.update(values)
    try:
        yield
    finally:
        for graph, values in saved:
            graph.namespace.update(values)


class _Source:
    """Lines of generated Python with their indentation, and values bound by name."""

    def __init__(self, namespace: dict) -> None:
        self.lines: list[str] = []
        self.namespace = namespace
        self._names = itertools.count()
        self._bound: dict[int, str] = {}

    def line(self, text: str, depth: int = 1) -> None:
        self.lines.append("    " * depth + text)

    def bind(self, value: object, prefix: str = "_v") -> str:
        """A name for ``value`` in the generated function's namespace (one per object)."""
        name = self._bound.get(id(value))
        if name is None or self.namespace.get(name) is not value:
            name = self._bound[id(value)] = f"{prefix}{next(self._names)}"
            self.namespace[name] = value
        return name

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    def with_constants(self, source: str, constants: Mapping[str, object]) -> str:
        """``source`` (an expression over dynamic leaves and named constants, see
        replay.dynamic) with each constant renamed to this function's own name for its value.
        The names a recording gives constants (``_k7``, ``_lit3``) come from process-wide
        counters, so every recording of a region would generate a text of its own; renamed,
        the same region recorded at another shape generates the same text, and its compiled
        code is reused (jitcore.generated.compile_source: about 2 ms a recording saved)."""
        return _CONSTANT_NAME.sub(
            lambda found: self.bind(constants[found[0]], "_k") if found[0] in constants else found[0], source
        )


@attrs.frozen
class _Slot:
    """One value a replay may write into a kernel node; ``_last[index]`` in the generated
    code is what the node holds now."""

    index: int
    value: str  # the expression of what this call needs the node to hold
    writes: list[str]  # the statements writing it into the node's buffer or dimensions
    # the same for csrc/replay_step.c: ("pointer", input, ((address, delta, params), ...)) or
    # ("scalar", number, ((address, size, params), ...)); None for anything else
    program: tuple | None = None

    @property
    def changed(self) -> str:
        """The generated name of whether this call's value differs from the node's."""
        return f"_c{self.index}"


@attrs.define
class _Patches:
    """What phase 1 of a replay computed for the nodes, and phase 2 may write into them."""

    slots: dict[int, list[_Slot]] = attrs.Factory(dict)  # node index -> its slots
    last: list[object] = attrs.Factory(list)  # per slot, what its node holds now: ``_last``
    zero_grids: dict[int, list[str]] = attrs.Factory(dict)  # node -> conditions of a grid of 0
    # node -> when a staging copy has nothing to do: the caller passed the staged buffer itself
    in_place: dict[int, list[str]] = attrs.Factory(dict)

    def add(self, node: int, value: str, writes: list[str], *, held: object, program: tuple | None = None) -> None:
        """A slot of ``node`` whose node holds ``held`` now (the recorded value)."""
        self.slots.setdefault(node, []).append(_Slot(len(self.last), value, writes, program))
        self.last.append(held)


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


# What each output leaf of a graph is (:meth:`RecordedGraph._classify_outputs`); compared by
# identity (``eq=False``) where they hold tensors or arbitrary values.


@attrs.frozen(eq=False)
class OwnedOutput:
    """A tensor in memory the graph owns: every replay writes it again."""

    tensor: torch.Tensor


@attrs.frozen
class InputView:
    """A view of an input (or of its staged buffer, which has the input's layout): rebuilt
    on the caller's input at every replay."""

    input: int  # leaf index
    size: tuple[int, ...]
    stride: tuple[int, ...]
    delta: int  # in elements, from the input's first element
    whole: bool  # the input itself: returned as is


@attrs.frozen(eq=False)
class ConstantOutput:
    """Anything else the region returned (a number, a string, None): returned as it was."""

    value: object


@attrs.frozen(eq=False)
class DynamicOutput:
    """A value computed from dynamic scalars: recomputed from each call's values."""

    scalar: DynamicScalar


@attrs.frozen
class SlotOutput:
    """A tensor the graph's replay copies into the region's output slot it was given
    (replay.output_slots): handed out fresh at every replay, a ``detach()`` of its template
    view in that slot (``RecordedGraph.slot_outputs[number]`` describes it)."""

    number: int


Output = OwnedOutput | InputView | ConstantOutput | DynamicOutput | SlotOutput

_ARITHMETIC_ERRORS = (struct.error, OverflowError, TypeError, ValueError, ArithmeticError)


class _Unknown:
    """A remembered value after an interrupted patch: equal to nothing, so it is pushed again."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return False

    def __ne__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__


_UNKNOWN = _Unknown()


def _fixed_addresses(capture) -> tuple[int, ...] | None:
    """replay.rebinding.fixed_addresses of a capture: the recorded inputs and the staging
    buffers are what each replay points elsewhere, and the session's pool is memory no
    caller's tensor shares (most of a graph's words point there: its intermediates)."""
    if capture.node_views is None:
        return None
    per_call = [(r.lo, r.hi) for r in capture.inputs] + list(getattr(capture, "pool_memory", ()))
    per_call += [region_keys.storage_range(buffer) for buffer in capture.staged.values()]
    return rebinding.fixed_addresses(capture.node_views, per_call)


class RecordedGraph:
    """One key's graph: its exec, node updaters, outputs and the generated replay."""

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
        self.region = region
        self.region_name = region.name
        self.entry = region.entries[key]
        self.key = key
        self.capture = capture
        self.graph = capture.graph
        self.device = capture.device
        self.plan = capture.plan
        self.staged = capture.staged
        self.copied_back = capture.copied_back
        self.fixed_addresses = _fixed_addresses(capture) if self.staged else ()
        self.host = getattr(capture, "host", None)  # host inputs' pinned buffers (replay.host)
        self.paths = list(paths)
        self.spec = spec
        # what the leaves looked like, to record this key again without the caller's tensors
        self.template = [
            TensorTemplate(tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.device.type == "cpu")
            if isinstance(leaf, torch.Tensor)
            else ValueTemplate(leaf)
            for leaf in leaves
        ]
        self.input_bytes = sum(region_keys.extent_bytes(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor))
        self.session = session
        self.uses_rng = bool(getattr(self.entry, "uses_rng", False))
        self.generation = 0
        self.replays = 0
        self.memory = capture.memory
        # one name for every graph: with the values it needs in its namespace (extents as
        # _e{i}), the replay of a region's next shape is, as text, the one compiled before
        # (generated.compile_source reuses its code; the filename still tells graphs apart)
        self.name = "replay_graph"
        raw_exec = self.graph.raw_cuda_graph_exec()
        nodes = {n.index: n for n in capture.nodes}
        self.updaters = {}
        self.family = None  # the graphs sharing this exec (replay.polymorphic), once there are several
        self.released = False
        self.initial_last: list = []  # what its patchable values are in the nodes as recorded
        for binding in (*self.plan.pointers, *self.plan.scalars, *self.plan.configs):
            if binding.node not in self.updaters:
                record = capture.records[binding.launch]
                self.updaters[binding.node] = backend.node_updater(
                    raw_exec, nodes[binding.node], record.layout, record.param_bytes
                )
        self.node_states = {node: NodeState(updater) for node, updater in self.updaters.items()}
        self.checks = []
        for record in capture.records:
            if record.check_globals is not None and record.check_globals not in self.checks:
                self.checks.append(record.check_globals)
        self.output_spec, output_leaves, _ = region_keys.flatten((capture.outputs,), {}, walk_dataclasses=True)
        self.outputs = self._classify_outputs(output_leaves)
        self.output_memory = recording.owned_output_memory(capture)  # what each replay writes
        # the region's output slots, when this graph's output copies can be pointed at them
        self.slot = None  # the slot its replay wrote last (replay.output_slots)
        self.bound_slot = None  # the slot its output copies write now
        self.views = None  # its outputs' template views in the bound slot
        self.slot_outputs: list[tuple] = []  # (lane, dtype, size, stride, storage offset) per slotted output
        self.lane_sources: list[tuple[int, int]] = []  # per lane: (first byte, bytes) its copy reads
        self.output_slots, self.slot_need, self.retargets = self._adopt_output_slots(backend, capture)
        self.in_place = self._inputs_taken_in_place(capture)
        self.namespace: dict[str, object] = dict(backend.hot_namespace)
        self.source = self._generate(backend, leaves)
        self.replay = compile_function(
            self.source, self.name, f"replay graph {number} of region {region.name}", self.namespace
        )
        #: why this graph replays through its generated Python rather than csrc/replay_step.c
        #: (None: through the C step, which runs that function itself for what it does not decide)
        self.step_refused: str | None = None
        step = self._step(backend, leaves)
        if step is not None:
            self.replay = step
        if generated.dump_enabled("REPLAY_DUMP"):
            print(f"# replay graph, {self.how_it_replays()}\n{self.full_source()}")

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

    def _inputs_taken_in_place(self, capture: Capture) -> dict[int, tuple[torch.Tensor, tuple[int, ...]]]:
        """Staged inputs whose replay skips its staging copies when the caller passes the
        staged buffer itself: input index -> (buffer, the nodes of its copy in and back).
        Bucketing pads an argument straight into it (Region._pad_in_place), where it would
        pad into a temporary that the copy in reads and the copy back writes for nothing: two
        kernel nodes of every bucketed step (about 4 us of GPU time on the H200 machine).
        Only where the backend can disable nodes of an exec, and where no output is a view
        of the input (it would be a view of the graph's buffer, overwritten by the next
        replay, not of a temporary of the call)."""
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

    # --- outputs -------------------------------------------------------------------------
    def _classify_outputs(self, output_leaves: list) -> list[Output]:
        """What each output leaf is, and so how a replay returns it (addresses are the
        capture's)."""
        classified: list[Output] = []
        for value in output_leaves:
            if isinstance(value, DynamicScalar):
                classified.append(DynamicOutput(value))
                continue
            if not isinstance(value, torch.Tensor):
                classified.append(ConstantOutput(value))
                continue
            address, owner, base = value.data_ptr(), None, 0
            host_ranges = [(i, *region_keys.byte_range(b)) for i, b in self.host.buffers.items()] if self.host else []
            for i, lo, extent in [(r.index, r.lo, r.hi - r.lo) for r in self.capture.inputs] + [
                (i, lo, hi - lo) for i, lo, hi in host_ranges
            ]:
                # a staged input's buffer (a host input's pinned buffer) has the input's exact
                # layout: a view of it is the same view of the input
                lo = self.staged[i].data_ptr() if i in self.staged else lo
                if (
                    lo <= address
                    and address + region_keys.extent_bytes(value) <= lo + extent
                    and (extent or value.numel() == 0)
                ):
                    owner, base = i, lo
                    break
            if owner is None:
                classified.append(OwnedOutput(value))
                continue
            if value.dtype != self.capture.input_dtypes[owner]:
                raise CaptureFailed(f"an output is a view of input {self.paths[owner]} with another dtype")
            delta, remainder = divmod(address - base, value.element_size())
            if remainder:
                raise CaptureFailed(f"an output is a misaligned view of input {self.paths[owner]}")
            template = self.template[owner]
            whole = delta == 0 and tuple(value.shape) == template.shape and tuple(value.stride()) == template.stride
            classified.append(InputView(owner, tuple(value.shape), tuple(value.stride()), delta, whole))
        return classified

    def _adopt_output_slots(self, backend, capture: Capture) -> tuple[object, tuple[int, ...], list]:
        """Point this graph's output copies at its region's shared output slots, where the
        backend can retarget them (the CUDA backend: each copy is a memcpy node appended by
        recording.own_outputs into a buffer of its own, one per group of outputs sharing
        memory). Returns (the region's OutputSlots, the bytes each lane of a slot must hold,
        largest first, [(set_destination, lane)]), or (None, (), []) when the graph keeps its
        own output memory (no slots in this session, no owned outputs, a copy the backend
        cannot retarget)."""
        slots_of = getattr(self.session, "output_slots", None)
        if slots_of is None or not self.output_memory:
            return None, (), []
        copies: dict[int, object] = {}  # buffer address -> the memcpy node writing it
        for node in getattr(capture, "nodes", None) or ():
            if node.kind == "memcpy" and len(node.pointers) == 2 and node.pointers[1] in self.output_memory:
                if node.pointers[1] in copies:
                    return None, (), []  # two copies into one buffer: not what own_outputs makes
                copies[node.pointers[1]] = node
        if set(copies) != set(self.output_memory):
            return None, (), []
        raw_exec = self.graph.raw_cuda_graph_exec()
        lanes, retargets = {}, []  # buffer address -> lane; (set_destination, lane)
        by_size = sorted(self.output_memory.items(), key=lambda item: (-item[1], item[0]))
        sources = []
        for lane, (start, size) in enumerate(by_size):  # the largest group in lane 0
            setter = backend.memcpy_retargeter(raw_exec, copies[start], self.device)
            if setter is None:
                return None, (), []
            lanes[start] = lane
            retargets.append((setter, lane))
            sources.append((copies[start].pointers[0], size))
        self.lane_sources = sources
        need = tuple(size for _start, size in by_size)
        stream = self.session.last_stream[0]
        for number, item in enumerate(self.outputs):
            if not isinstance(item, OwnedOutput) or not item.tensor.numel():
                continue  # an empty output is a fresh tensor of its own: handed out as it is
            tensor = item.tensor
            storage = tensor.untyped_storage().data_ptr()
            if storage not in lanes:
                continue  # a tensor the region did not make (a global): returned as it is
            self.outputs[number] = SlotOutput(len(self.slot_outputs))
            self.slot_outputs.append(
                (lanes[storage], tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
            )
            if tensor.is_cuda and stream is not None:  # the first launch may still write it:
                tensor.record_stream(torch.cuda.ExternalStream(stream, device=tensor.device))  # freed after
        # the graph's own output buffers go once the first call's outputs (if held) go
        capture.outputs = None
        capture.output_bytes = 0
        self.output_memory = {}
        return slots_of(self.region, self.device), need, retargets

    def _retarget(self, slot) -> None:
        """Point every output copy at ``slot`` (phase 2 of a replay whose slot changed). On
        failure the copies' destinations are unknown: the next replay sets them again."""
        self.bound_slot = self.views = None
        for set_destination, lane in self.retargets:
            set_destination(slot.lanes[lane].address)
        self.views = slot.views_for(self, self.slot_outputs)
        self.bound_slot = slot
        self.session.counters.patches += len(self.retargets)

    @staticmethod
    def _handed_out(code: _Source, tensor: str, clone: bool, guard: bool, fresh: str = "") -> str:
        """How a tensor the graph writes is handed out: a copy (``clone_outputs``), else the
        tensor made ``fresh`` (the suffix making a new tensor of it, if any), behind the stale
        guard in ``check_stale`` mode."""
        if clone:
            return f"{tensor}.clone()"
        if guard:
            code.namespace["_stale_guard"] = _stale_guard
            return f"_stale_guard({tensor}{fresh}, _owner)"
        return tensor + fresh

    def _output_expressions(self, code: _Source, clone: bool, guard: bool) -> list[str]:
        expressions = []
        for item in self.outputs:
            if isinstance(item, SlotOutput):  # a fresh tensor on the slot's memory
                expressions.append(self._handed_out(code, f"_v[{int(item.number)}]", clone, guard, ".detach()"))
            elif isinstance(item, OwnedOutput):
                expressions.append(self._handed_out(code, code.bind(item.tensor, "_out"), clone, guard))
            elif isinstance(item, InputView):
                owner = item.input
                if item.whole:
                    expressions.append(f"l{owner}")
                else:
                    code.namespace["_as_strided"] = torch.as_strided
                    size_name, stride_name = code.bind(item.size, "_size"), code.bind(item.stride, "_stride")
                    expressions.append(
                        f"_as_strided(l{owner}, {size_name}, {stride_name}, "
                        f"l{owner}.storage_offset() + {int(item.delta)})"
                    )
            elif isinstance(item, DynamicOutput):
                expressions.append(code.with_constants(item.scalar.source, item.scalar.constants))
            else:
                expressions.append(code.bind(item.value, "_const"))
        return expressions

    def _container(self, code: _Source, spec: object, leaves: list[str]) -> str:
        """An expression building ``spec``'s structure anew from the leaf expressions."""
        if spec is None:
            return leaves.pop(0)
        kind = spec[0]
        if kind == "dict":
            items = ", ".join(
                f"{code.bind(k, '_key')}: {self._container(code, s, leaves)}" for k, s in zip(spec[1], spec[2])
            )
            return "{" + items + "}"
        if kind == "dataclass":
            code.namespace["_make_dataclass"] = region_keys.make_dataclass_instance
            values = "".join(f"{self._container(code, s, leaves)}, " for s in spec[3])
            return f"_make_dataclass({code.bind(spec[1], '_type')}, {code.bind(spec[2], '_fields')}, ({values}))"
        items = "".join(f"{self._container(code, s, leaves)}, " for s in spec[1])
        if kind == "tuple":
            return f"({items})"
        if kind == "list":
            return f"[{items}]"
        return f"{code.bind(kind, '_type')}({items})"  # a named tuple

    # --- generation ----------------------------------------------------------------------
    def _generate(self, backend, leaves: Sequence) -> str:
        """The replay function's source, step by step in the order its lines run."""
        code = _Source(self.namespace)
        for i, leaf in enumerate(leaves):  # each tensor's byte extent, _e{i} in every check
            if isinstance(leaf, torch.Tensor):
                self.namespace[f"_e{i}"] = region_keys.extent_bytes(leaf)
        self._emit_guards(code, len(leaves))
        self._alias_checks(code, leaves)
        self._own_output_checks(code, leaves)
        self._staged_storage_checks(code)
        self._alignment_checks(code)
        self._load_own_state(code)
        # --- phase 1: compute, change nothing ---
        self._read_dynamic_values(code)
        patches = self._compute_new_values(code, backend, leaves)
        disabled = self._decide_which_nodes_change(code, patches)
        # --- phase 2: patch, remembering only what the driver took ---
        self._patch_nodes(code, patches, disabled)
        self._point_outputs_at_the_slot(code)
        self._fill_host_buffers(code)
        # --- launch ---
        self._launch(code, backend)
        self._after_host_launch(code)
        if self.output_slots is not None:
            code.line("_o.writer = _me")  # this slot now holds this graph's outputs
            code.line("_me.slot = _o")
            code.line("_o.streams.add(_s)")  # freed later, it waits for this stream
        self._count_replay(code)
        self._return_outputs(code)
        self._patches = patches
        return code.text()

    # --- the C step ----------------------------------------------------------------------
    def _step(self, backend, leaves: Sequence) -> Callable | None:
        """The replay as csrc/replay_step.c runs it, where this graph's generated function has no
        step outside what that file runs (else None, and ``step_refused`` says why). The C
        step makes the generated function's calls in its order; for what it does not decide
        (a slot that OutputSlots.choose must pick, a tensor its reader does not read) it runs
        the generated function itself, so it can only ever do what that function does."""
        if ReplayStep is None or not compiled_helpers_enabled():
            self.step_refused = "csrc/replay_step.c is not built (or JITCORE_NATIVE=0)"
            return None
        helper = jitcore.torch_native.module()
        support = getattr(helper, "replay_support", None)
        if support is None:
            self.step_refused = "the torch-side helper is not built for this torch (python -m jitcore.torch_native)"
            return None
        program, refused = self._step_program(backend, leaves, support)
        if program is None:
            self.step_refused = refused
            self.step_arguments_source = ""  # an argument function made before the refusal serves nothing
            return None
        return ReplayStep(program)

    def _step_program(self, backend, leaves: Sequence, support: object) -> tuple[tuple | None, str]:
        """csrc/replay_step.c's program for this graph (its layout is that file's), or None and
        what the generated function does that the C step does not."""
        policy, plan = self.session.policy, self.plan
        parts = backend.graph_launch_parts()
        refusals = [
            (policy.polymorphic, "a polymorphic session (an exec shared by several graphs)"),
            (policy.clone_outputs or policy.check_stale, "outputs cloned or guarded against staleness"),
            (self.uses_rng, "random numbers (torch's replay advances the generators)"),
            (self.host is not None, "host inputs"),
            (bool(self.in_place), "staged inputs taken in place"),
            (
                bool(self.staged) and self.fixed_addresses is None,
                "staged inputs of a graph whose addresses were not all read",
            ),
            (bool(plan.configs or plan.checks), "grid sizes or index checks computed per call"),
            (any(b.dynamic for b in plan.pointers), "pointer offsets computed per call"),
            (bool(self.key[3]), "arguments recorded overlapping"),
            (parts is None or not backend.raw_stream_handles, "a backend launching from Python"),
            (len([leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]) > _STEP_MAX_TENSORS, "many tensors"),
        ]
        for refused, why in refusals:
            if refused:
                return None, why
        launches = sorted(plan.arguments)
        argument_of = {launch: n for n, launch in enumerate(launches)}
        texts = [text for launch in launches for text in plan.arguments[launch] if text is not None]
        dynamic = sorted({int(m) for text in texts for m in re.findall(r"\b_d(\d+)\b", text)})
        if all(re.fullmatch(r"_d\d+", text) for text in texts):  # each argument a dynamic value itself
            arguments = tuple(
                tuple(-1 if text is None else int(text[2:]) for text in plan.arguments[launch]) for launch in launches
            )
        else:  # expressions: one generated function of the values computes them all
            maker = self._argument_maker(launches, dynamic)
            arguments = (maker, len(launches))
            self.step_arguments_source = maker.source
        scalars = []
        for binding in plan.scalars:
            if binding.launch not in argument_of:
                return None, "a scalar computed without its launch's arguments"
            packer = struct.Struct("<" + binding.fmt).pack
            scalars.append((argument_of[binding.launch], binding.evaluate, binding.convert, packer))
        nodes = []
        for node, slots in self._patches.slots.items():
            values = []
            for slot in slots:
                if slot.program is None:
                    return None, "a node value csrc/replay_step.c does not write"
                kind, number, writes = slot.program
                values.append(
                    (slot.index, number if kind == "pointer" else -1, number if kind == "scalar" else -1, writes)
                )
            updater = self.updaters[node]
            nodes.append((updater.set_call, tuple(updater.set_args), node, tuple(values)))
        outputs = []
        for item in self.outputs:
            if isinstance(item, SlotOutput):
                outputs.append((0, int(item.number)))
            elif isinstance(item, InputView) and item.whole:
                outputs.append((1, int(item.input)))
            elif isinstance(item, OwnedOutput):
                outputs.append((2, item.tensor))
            elif isinstance(item, ConstantOutput):
                outputs.append((2, item.value))
            else:
                return None, "outputs rebuilt per call (views of inputs, dynamic values)"
        spec = self.output_spec[0][0]
        if spec is None:
            container = 0
        elif spec[0] == "tuple" and all(child is None for child in spec[1]):
            container = 1
        else:
            return None, "outputs in a structure other than one tensor or a flat tuple"
        aligned = {(b.input, b.delta, bool(b.aligned)): None for b in self.plan.pointers if b.aligned is not None}
        slotted = self.output_slots is not None
        ns = self.namespace
        check_names = tuple(
            next(name for name, value in ns.items() if value is check and name.startswith("_check"))
            for check in self.checks
        )
        tensors = [
            (i, region_keys.extent_bytes(leaf)) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)
        ]
        launch, launch_failed = parts
        program = (
            self.replay,
            ns,
            check_names,
            MISMATCH,
            self if slotted else None,
            len(leaves),
            tuple(tensors),
            len(self.slot_need) if slotted else 0,
            () if slotted else tuple((int(lo), int(size)) for lo, size in self.output_memory.items()),
            tuple((i, int(delta), int(want)) for i, delta, want in aligned),
            tuple(dynamic),
            arguments,
            tuple(scalars),
            _ARITHMETIC_ERRORS,
            tuple(nodes),
            ns["_last"],
            self._interrupted,
            self._set_failed,
            self._retarget,
            backend.hot_namespace["_current_stream"],
            int(self.device),
            self.session.last_stream,
            self.session.stream_switch,
            launch,
            ns["_EXEC"],
            launch_failed,
            self.session.counters,
            self,
            len(self.staged) + len(self.copied_back),
            tuple(outputs),
            container,
            support,
            "_modes_changed",
            output_slots._use_count,
            (tuple(sorted(self.staged)), self.fixed_addresses) if self.fixed_addresses else ((), ()),
        )
        return program, ""

    def _argument_maker(self, launches: list[int], dynamic: list[int]) -> Callable:
        """``arguments(*values)``: each launch's jit arguments (the generated replay's
        ``_a{launch}``), from the dynamic leaves' values in ``dynamic``'s order, for the C step.
        Its builtins are the replay function's own, so its expressions resolve as they do there."""
        code = _Source({"__builtins__": self.namespace["__builtins__"]} if "__builtins__" in self.namespace else {})
        tuples = []
        for launch in launches:
            values = "".join(
                f"{code.with_constants(text, self.plan.constants) if text is not None else 'None'}, "
                for text in self.plan.arguments[launch]
            )
            tuples.append(f"({values})")
        code.lines.append(f"def step_arguments({', '.join(f'_d{i}' for i in dynamic)}):")
        code.line(f"return ({''.join(t + ', ' for t in tuples)})")
        return compile_function(code.text(), "step_arguments", f"jit arguments of {self.name}", code.namespace)

    def _emit_guards(self, code: _Source, count: int) -> None:
        """The signature, then what must hold for any call: the region's globals unchanged,
        the torch modes of the recording, and (drawing random numbers) the generator state
        the graph was registered with."""
        ns = code.namespace
        params = ", ".join(f"l{i}" for i in range(count))
        code.lines.append(f"def {self.name}({params}):")
        code.line(f"# a recorded graph: {count} arguments, {len(self.updaters)} patchable kernel nodes")
        ns["_MISMATCH"] = MISMATCH
        for check in self.checks:
            code.line(f"{code.bind(check, '_check')}()")
        ns["_modes_changed"] = region_keys.modes_changed(self.key[2])
        code.line("if _modes_changed():")
        code.line("return _MISMATCH", 2)
        if self.uses_rng:  # registered with the generator state of its recording (see recording)
            ns["_GENERATOR_EPOCH"] = recording.GENERATOR_EPOCH
            code.line(f"if _GENERATOR_EPOCH[0] != {int(getattr(self.entry, 'rng_epoch', 0))}:")
            code.line("return _MISMATCH", 2)

    def _load_own_state(self, code: _Source) -> None:
        """In a polymorphic session the exec may be shared by several graphs (the graph of a
        bucket and its variants for smaller sizes, replay.polymorphic): when another one
        launched it last, its nodes are first put back to this graph's recorded state. A
        call declined after this only leaves the exec in a state of this graph."""
        if not self.session.policy.polymorphic:
            return
        code.namespace["_me"] = self
        code.line("_fam = _me.family")
        code.line("if _fam is not None and _fam.loaded is not _me:")
        code.line("_fam.load(_me)", 2)

    def _read_dynamic_values(self, code: _Source) -> None:
        """Read the value of each dynamic argument that a recomputed jit argument or a
        dynamic output uses (``_d{i}``), once per call."""
        sources = [s for text in self.plan.arguments.values() for s in text if s]
        sources += [item.scalar.source for item in self.outputs if isinstance(item, DynamicOutput)]
        for i in sorted({int(m) for source in sources for m in re.findall(r"\b_d(\d+)\b", source)}):
            code.line(f"_d{i} = l{i}.value")

    def _compute_new_values(self, code: _Source, backend, leaves: Sequence) -> _Patches:
        """Phase 1: the jit arguments, index checks and every value the nodes may need, inside
        one ``try`` where anything is computed (an arithmetic error declines the call: the
        eager run raises the exact error, or computes)."""
        plan = self.plan
        computes = bool(plan.arguments or plan.scalars or plan.configs)
        if computes:
            code.line("try:")
            self._recompute_arguments(code)
        patches = _Patches()
        code.namespace["_last"] = patches.last
        code.namespace["_pack_Q"] = struct.Struct("<Q").pack_into
        self._compute_pointers(code, leaves, patches)
        self._skip_copies_in_place(code, patches)
        self._compute_scalars(code, patches)
        self._compute_grids(code, backend, patches)
        self.initial_last = list(patches.last)
        if computes:
            code.namespace["_ARITHMETIC_ERRORS"] = _ARITHMETIC_ERRORS
            code.line("except _ARITHMETIC_ERRORS:")
            code.line("return _MISMATCH", 2)
        return patches

    def _recompute_arguments(self, code: _Source) -> None:
        """Each launch's jit arguments that replay follows (``_a{launch}``), then the
        launcher's index checks over them: where eager would raise IndexError, decline."""
        for launch, sources in sorted(self.plan.arguments.items()):
            values = "".join(
                f"{code.with_constants(s, self.plan.constants) if s is not None else 'None'}, " for s in sources
            )
            code.line(f"_a{launch} = ({values})", 2)
        for check in self.plan.checks:
            value, size = code.bind(check.value, "_index"), code.bind(check.size, "_extent")
            code.line(f"_i = {value}(_a{check.launch})", 2)
            code.line(f"_n = {size}(_a{check.launch})", 2)
            code.line("if not -_n <= _i < _n:", 2)
            code.line("return _MISMATCH", 3)

    def _compute_pointers(self, code: _Source, leaves: Sequence, patches: _Patches) -> None:
        """New pointers: an input's pointer plus the recorded delta. A view offset computed
        from a dynamic scalar is recomputed and must stay inside its input; the fixed pointers
        into one input in one node share one remembered value, the input's pointer."""
        recorded_pointer = {r.index: r.lo for r in self.capture.inputs}
        static: dict[tuple[int, int], list] = {}
        for number, binding in enumerate(self.plan.pointers):
            buffer = code.bind(self.updaters[binding.node].params.buffer, "_buf")
            if not binding.dynamic:
                static.setdefault((binding.input, binding.node), []).append((buffer, binding))
                continue
            evaluate = code.bind(binding.offset_evaluate, "_offset")
            value = f"_q{number}"
            code.line(
                f"{value} = _p{binding.input} + {int(binding.delta - binding.recorded_offset)} + "
                f"{evaluate}(_a{binding.launch})",
                2,
            )
            code.line(f"if not _p{binding.input} <= {value} <= _p{binding.input} + _e{binding.input}:", 2)
            code.line("return _MISMATCH", 3)
            patches.add(
                binding.node,
                value,
                [f"_pack_Q({buffer}, {binding.offset}, {value})"],
                held=recorded_pointer[binding.input] + binding.delta,
            )
        for (input_index, node), bound in sorted(static.items()):
            writes = [f"_pack_Q({buffer}, {b.offset}, _p{input_index} + {int(b.delta)})" for buffer, b in bound]
            params = self.updaters[node].params
            targets = tuple((params.buffer_address + b.offset, b.delta, params) for _, b in bound)
            program = ("pointer", input_index, targets)
            patches.add(node, f"_p{input_index}", writes, held=recorded_pointer[input_index], program=program)

    def _skip_copies_in_place(self, code: _Source, patches: _Patches) -> None:
        """A staged input passed as its staged buffer (``_S{i}``) needs no copy in or back:
        those nodes are disabled for the call (see :meth:`_inputs_taken_in_place`)."""
        for i, (buffer, nodes) in sorted(self.in_place.items()):
            code.namespace[f"_S{i}"] = buffer.data_ptr()
            for node in nodes:
                patches.in_place.setdefault(node, []).append(f"_p{i} == _S{i}")

    def _compute_scalars(self, code: _Source, patches: _Patches) -> None:
        """Scalar parameters computed from dynamic scalars, packed to their exact bytes (a
        value that does not fit its C type raises, and the call is declined)."""
        for number, binding in enumerate(self.plan.scalars):
            state = self.node_states[binding.node]
            size = struct.calcsize("<" + binding.fmt)
            packer = code.bind(struct.Struct("<" + binding.fmt).pack, "_packer")
            evaluate = code.bind(binding.evaluate, "_value")
            computed = f"{evaluate}(_a{binding.launch})"
            if binding.convert is not None:
                computed = f"{code.bind(binding.convert, '_convert')}({computed})"
            code.line(f"_v{number} = {packer}({computed})", 2)
            params = self.updaters[binding.node].params
            buffer = code.bind(params.buffer, "_buf")
            patches.add(
                binding.node,
                f"_v{number}",
                [f"{buffer}[{binding.offset}:{binding.offset + size}] = _v{number}"],
                held=state.held[binding.offset : binding.offset + size],
                program=("scalar", number, ((params.buffer_address + binding.offset, size, params),)),
            )

    def _compute_grids(self, code: _Source, backend, patches: _Patches) -> None:
        """Grid sizes computed from dynamic scalars: declined beyond the device's limits; a
        grid of 0 means the node must not run at all."""
        limits = backend.device_limits(self.device) if self.plan.configs else None
        for number, binding in enumerate(self.plan.configs):
            evaluate = code.bind(binding.evaluate, "_size")
            axis = "xyz".index(binding.field[-1])
            code.line(f"_g{number} = {evaluate}(_a{binding.launch})", 2)
            code.line(f"if not 0 <= _g{number} <= {int(limits.max_grid[axis])}:", 2)
            code.line("return _MISMATCH", 3)
            dimension = code.bind(self.updaters[binding.node].set_dimension, "_dimension")
            field = code.bind(binding.field, "_field")
            updater = self.updaters[binding.node]
            patches.add(
                binding.node,
                f"_g{number}",
                [f"{dimension}({field}, _g{number})"],
                held=updater.dimensions()[updater.DIMENSIONS.index(binding.field)],
            )
            patches.zero_grids.setdefault(binding.node, []).append(f"_g{number} == 0")

    def _decide_which_nodes_change(self, code: _Source, patches: _Patches) -> dict[int, bool | None]:
        """Still changing nothing: which nodes are disabled (a grid of 0; where the backend
        cannot disable a node, the call is declined), which values differ from what their
        node holds (``_c``), and which nodes must be updated (``_u``). Returns the nodes that
        can be disabled, with what each is now (the generated code's ``_disabled``)."""
        code.namespace["_disabled"] = disabled = {}
        for node in {**patches.zero_grids, **patches.in_place}:
            zero, in_place = patches.zero_grids.get(node, []), patches.in_place.get(node, [])
            if self.updaters[node].enable_call is None:  # (never for copies skipped in place)
                code.line(f"if {' or '.join(zero)}:")  # cannot disable the node: run eagerly
                code.line("return _MISMATCH", 2)
            else:
                # a grid of 0, or a staging copy with nothing to do: disable the node
                code.line(f"_z{node} = {' or '.join(zero + in_place)}")
                disabled[node] = False
        for node, slots in patches.slots.items():
            for slot in slots:
                code.line(f"{slot.changed} = {slot.value} != _last[{slot.index}]")
            dirty = " or ".join(slot.changed for slot in slots)
            code.line(f"_u{node} = {f'not _z{node} and ' if node in disabled else ''}({dirty})")
        return disabled

    def _patch_nodes(self, code: _Source, patches: _Patches, disabled: dict[int, bool | None]) -> None:
        """Phase 2: write each changed value and push each dirty node to the exec, then
        enable or disable the nodes whose grid became or stopped being 0. What a node holds
        is remembered only once the driver took it; any exception rolls every buffer back."""
        if not (patches.slots or disabled):
            return
        ns = code.namespace
        any_change = " or ".join([f"_u{n}" for n in patches.slots] + [f"_z{n} is not _disabled[{n}]" for n in disabled])
        ns["_rollback"] = self._interrupted
        ns["_set_failed"] = self._set_failed
        code.line(f"if {any_change}:")
        code.line("try:", 2)
        for node, slots in patches.slots.items():
            updater = self.updaters[node]
            set_call, set_args = code.bind(updater.set_call, "_set"), code.bind(updater.set_args, "_set_args")
            code.line(f"if _u{node}:", 3)
            for slot in slots:
                code.line(f"if {slot.changed}:", 4)
                for write in slot.writes:
                    code.line(write, 5)
            code.line(f"_r = {set_call}(*{set_args})", 4)
            code.line(f"if _r[0]: _set_failed(_r[0], {node})", 4)
            for slot in slots:
                code.line(f"if {slot.changed}: _last[{slot.index}] = {slot.value}", 4)
            code.line("_stats.patches += 1", 4)
        for node in disabled:
            updater = self.updaters[node]
            enable, args = code.bind(updater.enable_call, "_enable"), code.bind(updater.enable_args, "_enable_args")
            code.line(f"if _z{node} is not _disabled[{node}]:", 3)
            code.line(f"_r = {enable}(*{args}, 0 if _z{node} else 1)", 4)
            code.line(f"if _r[0]: _set_failed(_r[0], {node})", 4)
            code.line(f"_disabled[{node}] = _z{node}", 4)
        code.line("except BaseException:", 2)
        code.line("_rollback()", 3)
        code.line("raise", 3)

    def _launch(self, code: _Source, backend) -> None:
        """Launch the graph once on the current stream (telling the session when the stream
        changed)."""
        ns = code.namespace
        ns["_current_stream"] = backend.hot_namespace["_current_stream"]
        ns["_stream_switch"] = self.session.stream_switch
        ns["_LAST_STREAM"] = self.session.last_stream
        code.line(f"_s = _current_stream({int(self.device)})")
        code.line("if _s != _LAST_STREAM[0]:")
        code.line("_stream_switch(_s)", 2)
        if self.uses_rng:
            # torch's replay advances the captured generators' offsets before launching, so
            # each replay draws fresh numbers exactly as the eager sequence would
            ns["_torch_replay"] = self.graph.replay
            code.line("_torch_replay()")
        else:
            ns["_EXEC"] = backend.graph_exec_object(self.graph.raw_cuda_graph_exec())
            if not backend.raw_stream_handles:  # the launch takes a vendor stream object
                code.line("_so = _STREAMS.get(_s)")
                code.line("if _so is None:")
                code.line("_so = _stream_object(_s)", 2)
            stream = "_s" if backend.raw_stream_handles else "_so"
            for line in backend.graph_launch_template.format(exec="_EXEC", stream=stream).splitlines():
                code.line(line)

    def _fill_host_buffers(self, code: _Source) -> None:
        """Host inputs (replay.host): wait until the last launch of this graph is done with
        their pinned buffers, then copy each caller's tensor into its buffer (a memmove over
        the byte extent, the layouts being equal; torch's strided copy for sparse layouts).
        Last before the launch: nothing after it declines the call."""
        if self.host is None:
            return
        code.line(f"{code.bind(self.host.wait, '_host_wait')}()")
        for i in sorted(self.host.buffers):
            kind, target, extent = self.host.copier(i)
            if kind == "memmove":
                code.namespace["_memmove"] = host_inputs._memmove
                code.line(f"_memmove({int(target)}, _p{i}, {int(extent)})")
            elif kind == "copy":
                code.line(f"{code.bind(target, '_host_copy')}(l{i})")

    def _after_host_launch(self, code: _Source) -> None:
        """Host inputs: the launch just enqueued reads their buffers until it is done."""
        if self.host is not None:
            code.line(f"{code.bind(self.host.launched_on, '_host_launched')}(_s, {int(self.device)})")

    def _count_replay(self, code: _Source) -> None:
        """Count the replay: the entry's generation (which outputs handed out remember, in
        ``check_stale`` mode), its replays and the session's counters."""
        ns = code.namespace
        ns["_stats"] = self.session.counters
        ns["_entry"] = self
        if self.session.policy.check_stale:
            ns["_owner"] = self.entry
            code.line("_owner.generation += 1")
        code.line("_entry.replays += 1")
        code.line("_stats.replays += 1")
        staged_copies = len(self.staged) + len(self.copied_back) + (len(self.host.buffers) if self.host else 0)
        skipped = [f"_z{node}" for _buffer, nodes in self.in_place.values() for node in nodes]
        if skipped:  # copies skipped in place are not made
            code.line(f"_stats.staged_copies += {staged_copies} - ({' + '.join(skipped)})")
        elif staged_copies:
            code.line(f"_stats.staged_copies += {staged_copies}")

    def _return_outputs(self, code: _Source) -> None:
        """Return the outputs in the region's structure, a fresh container every call."""
        policy = self.session.policy
        if self.output_slots is not None and self.slot_outputs:
            code.line("_v = _me.views")  # the templates in the slot just written
        expressions = self._output_expressions(code, policy.clone_outputs, policy.check_stale)
        code.line(f"return {self._container(code, self.output_spec[0][0], expressions)}")

    def _alias_checks(self, code: _Source, leaves: Sequence) -> None:
        """Read every tensor argument's pointer and return MISMATCH unless the arguments
        overlap exactly as they did when the graph was recorded (the key's pattern)."""
        tensors = [
            (i, region_keys.extent_bytes(leaf)) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)
        ]
        for i, _ in tensors:
            code.line(f"_p{i} = l{i}.data_ptr()")
        pattern = set(self.key[3])
        ranges = [(i, extent) for i, extent in tensors if extent]  # an empty tensor overlaps nothing
        disjoint = _disjoint_check()
        if not pattern and disjoint is not None and len(ranges) >= _C_DISJOINT_FROM:
            # recorded all apart, and still so: one sort in C (csrc/replay_checks.c)
            code.namespace["_disjoint"] = disjoint
            code.namespace["_EXTENTS"] = tuple(int(extent) for _, extent in ranges)
            code.line(f"if not _disjoint(({''.join(f'_p{i}, ' for i, _ in ranges)}), _EXTENTS):")
            code.line("return _MISMATCH", 2)
            return
        if not pattern and len(ranges) > _NUMPY_DISJOINT_FROM:
            # recorded all apart, and still so: sorted by first byte, each range ends at or
            # before the next begins (numpy: a few calls for any count, where the general
            # pattern is a Python loop)
            ns = code.namespace
            ns["_np_array"], ns["_np_int64"] = np.array, np.int64
            ns["_EXTENTS"] = np.array([extent for _, extent in ranges], dtype=np.int64)
            code.line(f"_a = _np_array([{', '.join(f'_p{i}' for i, _ in ranges)}], _np_int64)")
            code.line("_o = _a.argsort()")
            code.line("if ((_a + _EXTENTS)[_o[:-1]] > _a[_o[1:]]).any():")
            code.line("return _MISMATCH", 2)
            return
        if len(tensors) > 8:  # one sort instead of n^2/2 comparisons
            code.namespace["_pattern_of"] = region_keys.pattern_of
            code.namespace["_PATTERN"] = self.key[3]
            ranges = "".join(f"({i}, _p{i}, _p{i} + _e{i}), " for i, _extent in tensors)
            code.line(f"if _pattern_of([{ranges}]) != _PATTERN:")
            code.line("return _MISMATCH", 2)
            return
        for n, (i, extent_i) in enumerate(tensors):
            for j, extent_j in tensors[n + 1 :]:
                overlap = f"_p{i} < _p{j} + _e{j} and _p{j} < _p{i} + _e{i}"
                if not extent_i or not extent_j:
                    continue  # an empty tensor overlaps nothing
                code.line(f"if {'not (' + overlap + ')' if (i, j) in pattern else overlap}:")
                code.line("return _MISMATCH", 2)

    def _staged_storage_checks(self, code: _Source) -> None:
        """Decline a call whose staged input shares its storage with memory the graph reaches
        at a fixed address (``step(cache[0])`` where a node reads ``cache`` itself, recorded
        while the argument was a tensor of its own): staged, the input is copied apart from
        that memory, so a write through one is not seen through the other, where eagerly it
        is. Storage by storage: the graph's fixed addresses (replay.rebinding.fixed_addresses)
        are sorted, so one bisection per staged input. Where a node's addresses could not be
        read, a staged input must be its storage's whole."""
        if not self.staged or self.fixed_addresses == ():
            return
        ns = code.namespace
        if self.fixed_addresses is None:
            for i in sorted(self.staged):
                code.line(f"_st = l{i}.untyped_storage()")
                code.line(f"if _st.data_ptr() != _p{i} or _st.nbytes() != _e{i}:")
                code.line("return _MISMATCH", 2)
            return
        ns["_bisect"], ns["_FIXED"] = bisect.bisect_left, self.fixed_addresses
        ns["_FIXED_COUNT"] = len(self.fixed_addresses)
        for i in sorted(self.staged):
            code.line(f"_st = l{i}.untyped_storage()")
            code.line("_sb = _st.data_ptr()")
            code.line("_sn = _bisect(_FIXED, _sb)")
            code.line("if _sn < _FIXED_COUNT and _FIXED[_sn] < _sb + _st.nbytes():")
            code.line("return _MISMATCH", 2)

    def _own_output_checks(self, code: _Source, leaves: Sequence) -> None:
        """Decline a call whose tensor argument lies in the output memory this replay writes
        (its previous output passed back in, ``h = step(h)``): the replay would overwrite that
        argument with the new output, where an eager call leaves it as it was. A graph using
        the region's output slots first chooses its slot (``_o``: the one it wrote last, while
        no other graph wrote it since, so usually a few attribute reads); an argument anyone
        still holds keeps every other slot from being chosen, so only that slot can hold it."""
        if self.output_slots is not None:
            ns = code.namespace
            ns["_me"] = self
            ns["_choose"] = self.output_slots.choose
            code.line("_o = _me.slot")
            code.line("if _o is None or _o.writer is not _me or _o.freed:")
            # OutputSlots.choose's second rule inline (graphs taking turns take it on every
            # replay): the slot its copies write, if nobody holds outputs in it (it fits: the
            # copies only ever point at a slot choose gave this graph, and slots never shrink)
            code.line("_o = _me.bound_slot", 2)
            code.line("if _o is None or _o.freed or _o.held():", 2)
            code.line(f"_o = _choose(_me, {code.bind(self.slot_need, '_need')})", 3)
            tensors = [
                (i, region_keys.extent_bytes(leaf)) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)
            ]
            tensors = [(i, extent) for i, extent in tensors if extent]
            if tensors:
                for lane in range(len(self.slot_need)):
                    code.line(f"_l = _o.lanes[{lane}]")
                    code.line("_la = _l.address")  # read once per lane, not once per argument
                    code.line("_lz = _la + _l.size")
                    for i, _extent in tensors:
                        code.line(f"if _p{i} < _lz and _la < _p{i} + _e{i}:")
                        code.line("return _MISMATCH", 2)
            return
        buffers = self.output_memory
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor) or not region_keys.extent_bytes(leaf):
                continue
            for lo, size in buffers.items():
                code.line(f"if _p{i} < {lo + size} and {lo} < _p{i} + {region_keys.extent_bytes(leaf)}:")
                code.line("return _MISMATCH", 2)

    def _point_outputs_at_the_slot(self, code: _Source) -> None:
        """Phase 2, last: when the chosen slot is not the one the output copies write, point
        them at it (a node update per copy; nothing declines the call after this)."""
        if self.output_slots is not None:
            code.namespace["_retarget"] = self._retarget
            code.line("if _o is not _me.bound_slot:")
            code.line("_retarget(_o)", 2)

    def _alignment_checks(self, code: _Source) -> None:
        """Decline a call whose rebound pointer would lose (or gain) the 16-byte alignment a
        kernel was specialized on when recorded (Triton's ``tt.divisibility``): the eager run
        picks the binary compiled for the new alignment."""
        seen = set()
        for binding in self.plan.pointers:
            if binding.aligned is None:
                continue
            key = (binding.input, binding.delta % 16, binding.aligned)
            if key in seen:
                continue
            seen.add(key)
            test = "==" if binding.aligned else "!="
            code.line(f"if not (((_p{binding.input} + {int(binding.delta)}) & 15) {test} 0):")
            code.line("return _MISMATCH", 2)

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
            last[:] = [_UNKNOWN] * len(last)
        disabled = self.namespace.get("_disabled")
        if disabled is not None:
            for node in disabled:
                disabled[node] = None  # neither enabled nor disabled: set again next time

    def _set_failed(self, status: object, node: int) -> None:
        from jitcore.errors import DriverError

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
