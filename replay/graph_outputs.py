"""What a recorded graph returns, and how each replay hands it out.

Each output leaf of a recording is classified once (what it is decides how a replay returns
it); a graph whose output copies the backend can retarget adopts its region's output slots
(replay.output_slots) instead of memory of its own; the generated replay function ends with
the statement building the outputs in the region's structure, a fresh container every call.

Every tensor a replay hands out is a fresh object, with the metadata eager gives, except where
eager itself returns an object the caller already has (replay.output_identity says which): an
argument returned as is (``return x``) is the caller's tensor, a tensor the region reaches by
name (``return self.cache``) that tensor, and one object returned twice is one object twice. A
caller changing an output's metadata (``unsqueeze_``, ``as_strided_``, ``t_``, ``set_``,
``.data =``) changes that object alone, as eagerly; the graph's own templates are never handed
out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from replay import output_identity, output_slots, region_keys
from replay.dynamic import DynamicScalar
from replay.errors import StaleOutputError
from replay.recording import Capture, CaptureFailed, RecordLater, owned_output_memory

if TYPE_CHECKING:
    from jitcore.for_replay import GraphNode
    from replay.lifecycle import Entry
    from replay.source_text import Source

# What each output leaf of a graph is; compared by identity (``eq=False``) where they hold
# tensors or arbitrary values.


@attrs.frozen(eq=False)
class OwnedOutput:
    """A tensor the region made or reached otherwise than by name: in memory the graph owns
    (every replay writes it again; handed out as a ``detach()`` of it), empty (a fresh empty
    tensor each call), or a view of a global (a fresh view each call). :func:`maker` tells."""

    tensor: torch.Tensor


@attrs.frozen(eq=False)
class HeldOutput:
    """A tensor the region reaches by name (a global, a closure tensor, a module's parameter or
    buffer), returned itself: the same object at every call, as eagerly."""

    tensor: torch.Tensor


@attrs.frozen
class SameOutput:
    """The very object of an earlier output (the region returned one object twice)."""

    first: int  # that output's leaf index


@attrs.frozen
class InputView:
    """A view of an input (or of its staged buffer, which has the input's layout): rebuilt
    on the caller's input at every replay, a fresh view each call."""

    input: int  # leaf index
    size: tuple[int, ...]
    stride: tuple[int, ...]
    delta: int  # in elements, from the input's first element
    whole: bool  # the input itself (the very object the region was given): returned as is

    def view(self, leaf: torch.Tensor) -> torch.Tensor:
        """This view of the call's ``leaf`` (what the generated function writes inline)."""
        return torch.as_strided(leaf, self.size, self.stride, leaf.storage_offset() + self.delta)


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


Output = OwnedOutput | HeldOutput | SameOutput | InputView | ConstantOutput | DynamicOutput | SlotOutput


def dynamic_sources(outputs: Sequence[Output]) -> list[str]:
    """The expressions of the outputs recomputed from dynamic scalars."""
    return [item.scalar.source for item in outputs if isinstance(item, DynamicOutput)]


# --- classification --------------------------------------------------------------------------
def classify(graph, output_leaves: list, identity: output_identity.OutputIdentity | None = None) -> list[Output]:
    """What each output leaf is, and so how a replay returns it (addresses are the
    capture's). ``graph``: a RecordedGraph or a variant (its capture, staged, host, template);
    ``identity``: which leaves are the caller's own objects (by default the capture's; where
    nothing is known every tensor is handed out as a fresh object)."""
    if identity is None:
        identity = getattr(graph.capture, "identity", None) or output_identity.UNKNOWN
    classified: list[Output] = []
    for n, value in enumerate(output_leaves):
        if n in identity.repeats:
            classified.append(SameOutput(identity.repeats[n]))
        elif isinstance(value, DynamicScalar):
            classified.append(DynamicOutput(value))
        elif not isinstance(value, torch.Tensor):
            classified.append(ConstantOutput(value))
        elif n in identity.inputs:
            i = identity.inputs[n]
            classified.append(InputView(i, tuple(value.shape), tuple(value.stride()), 0, True))
        elif n in identity.held:
            classified.append(HeldOutput(value))
        else:
            classified.append(_classify_tensor(graph, value, identity.addresses.get(n, value.data_ptr())))
    return classified


def _input_ranges(graph) -> list[tuple[int, int, int]]:
    """(leaf, first byte, bytes) of each recorded input and host input's pinned buffer."""
    host = getattr(graph, "host", None)
    host_ranges = [(i, *region_keys.byte_range(b)) for i, b in host.buffers.items()] if host else []
    return [(r.index, r.lo, r.hi - r.lo) for r in graph.capture.inputs] + [
        (i, lo, hi - lo) for i, lo, hi in host_ranges
    ]


def _classify_tensor(graph, value: torch.Tensor, address: int) -> Output:
    """A tensor output at ``address`` (where the region ran): a view of an input (rebuilt per
    call) or a tensor the graph owns."""
    owner, base = None, 0
    for i, lo, extent in _input_ranges(graph):
        # a staged input's buffer (a host input's pinned buffer) has the input's exact
        # layout: a view of it is the same view of the input
        lo = graph.staged[i].data_ptr() if i in graph.staged else lo
        inside = lo <= address and address + region_keys.extent_bytes(value) <= lo + extent
        if inside and (extent or value.numel() == 0):
            owner, base = i, lo
            break
    if owner is None:
        return OwnedOutput(value)
    if value.dtype != graph.capture.input_dtypes[owner]:
        raise CaptureFailed(f"an output is a view of input {graph.paths[owner]} with another dtype")
    delta, remainder = divmod(address - base, value.element_size())
    if remainder:
        raise CaptureFailed(f"an output is a misaligned view of input {graph.paths[owner]}")
    # a view, even one covering the whole input (``x[:]``): a fresh one each call, as eagerly
    return InputView(owner, tuple(value.shape), tuple(value.stride()), delta, False)


# --- the graph's own output memory -----------------------------------------------------------
def own_memory(capture: Capture) -> dict[int, int]:
    """``{first byte: bytes}`` of the output buffers the capture owns, where the capture put them
    (the identity's spans, read before any output was handed out; recording's reading of the
    outputs' storages where the capture has none)."""
    owned = getattr(capture, "identity", output_identity.UNKNOWN).owned
    if owned:
        return dict(owned.values())
    return owned_output_memory(capture)


def own_memory_lanes(graph, capture: Capture) -> list:
    """The graph's own output buffers as output_slots.Lane objects (where they are, their
    readers): for a graph that keeps its output memory (no slots). A buffer a caller already
    moved (``resize_`` on the recording call's output) cannot be written: the key records
    again later (RecordLater)."""
    owned = getattr(capture, "identity", output_identity.UNKNOWN).owned
    _spec, leaves, _ = region_keys.flatten((capture.outputs,), {}, walk_dataclasses=True)
    lanes = {}
    for n, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or not leaf.numel():
            continue
        storage = leaf.untyped_storage()
        address, size = owned.get(n, (storage.data_ptr(), storage.nbytes()))
        if address in graph.output_memory and address not in lanes:
            lanes[address] = lane = output_slots.Lane.over(leaf, address, size, graph)
            if lane.moved():
                raise RecordLater("an output of the recording call had its storage resized before the graph was built")
    return list(lanes.values())


# --- the region's output slots ---------------------------------------------------------------
def adopt_slots(graph, backend, capture: Capture) -> tuple[output_slots.OutputSlots | None, tuple[int, ...], list]:
    """Point ``graph``'s output copies at its region's shared output slots, where the
    backend can retarget them (the CUDA backend: each copy is a memcpy node appended by
    recording.own_outputs into a buffer of its own, one per group of outputs sharing
    memory). Returns (the region's OutputSlots, the bytes each lane of a slot must hold,
    largest first, [(set_destination, lane)]), or (None, (), []) when the graph keeps its
    own output memory (no slots in this session, no owned outputs, a copy the backend
    cannot retarget)."""
    slots_of = getattr(graph.session, "output_slots", None)
    if slots_of is None or not graph.output_memory:
        return None, (), []
    copies = _output_copies(graph, capture)
    if copies is None:
        return None, (), []
    raw_exec = graph.graph.raw_cuda_graph_exec()
    lanes, retargets, sources = {}, [], []  # buffer address -> lane; (set_destination, lane)
    by_size = sorted(graph.output_memory.items(), key=lambda item: (-item[1], item[0]))
    for lane, (start, size) in enumerate(by_size):  # the largest group in lane 0
        setter = backend.memcpy_retargeter(raw_exec, copies[start], graph.device)
        if setter is None:
            return None, (), []
        lanes[start] = lane
        retargets.append((setter, lane))
        sources.append((copies[start].pointers[0], size))
    graph.lane_sources = sources
    _slot_the_outputs(graph, lanes)
    # the graph's own output buffers go once the first call's outputs (if held) go
    capture.outputs = None
    capture.output_bytes = 0
    graph.output_memory = {}
    return slots_of(graph.region, graph.device), tuple(size for _start, size in by_size), retargets


def _output_copies(graph, capture: Capture) -> dict[int, GraphNode] | None:
    """Buffer address -> the memcpy node writing it, for every output buffer; None where
    that is not what recording.own_outputs makes (two copies into one buffer, one missing)."""
    copies: dict[int, GraphNode] = {}
    for node in getattr(capture, "nodes", None) or ():
        if node.kind == "memcpy" and len(node.pointers) == 2 and node.pointers[1] in graph.output_memory:
            if node.pointers[1] in copies:
                return None
            copies[node.pointers[1]] = node
    return copies if set(copies) == set(graph.output_memory) else None


def _slot_the_outputs(graph, lanes: dict[int, int]) -> None:
    """Each owned output in a lane becomes a SlotOutput (its layout in ``slot_outputs``)."""
    stream = graph.session.last_stream[0]
    owned = getattr(graph.capture, "identity", output_identity.UNKNOWN).owned
    for number, item in enumerate(graph.outputs):
        if not isinstance(item, OwnedOutput) or not item.tensor.numel():
            continue  # an empty output: a fresh empty tensor each call
        tensor = item.tensor
        storage = owned[number][0] if number in owned else tensor.untyped_storage().data_ptr()
        if storage not in lanes:
            continue  # a tensor the region did not make (a view of a global): a fresh view each call
        graph.outputs[number] = SlotOutput(len(graph.slot_outputs))
        graph.slot_outputs.append(
            (lanes[storage], tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        )
        output_slots.record_on([tensor], stream)  # the first launch may still write it: freed after


# --- handing them out ------------------------------------------------------------------------
def maker(graph, number: int) -> Callable[[], torch.Tensor] | None:
    """How output ``number`` (an OwnedOutput) is made afresh at every call: a ``detach()`` of
    it in memory the graph owns, a fresh empty tensor, or a fresh view of a global (of a
    template of the graph's own, so that nothing done to the object the recording handed out
    reaches it). None for the other kinds."""
    item = graph.outputs[number]
    if not isinstance(item, OwnedOutput):
        return None
    tensor = item.tensor
    size, stride = tuple(tensor.shape), tuple(tensor.stride())
    if not tensor.numel():
        return functools.partial(torch.empty_strided, size, stride, dtype=tensor.dtype, device=tensor.device)
    if writes(graph, number):
        return tensor.detach
    template = torch.as_strided(tensor, size, stride, tensor.storage_offset())
    return functools.partial(torch.as_strided, template, size, stride, tensor.storage_offset())


def writes(graph, number: int) -> bool:
    """Whether output ``number`` (an OwnedOutput) lies in memory the graph writes at every
    replay: the outputs ``clone_outputs`` copies and ``check_stale`` guards."""
    tensor = graph.outputs[number].tensor
    if not tensor.numel():
        return False
    owned = getattr(graph.capture, "identity", output_identity.UNKNOWN).owned
    return (owned[number][0] if number in owned else tensor.untyped_storage().data_ptr()) in graph.output_memory


def makers(graph) -> dict[int, Callable]:
    """Output number -> its :func:`maker`, for every output made afresh by one (the generated
    function and the C step call the same objects)."""
    made = {n: maker(graph, n) for n in range(len(graph.outputs))}
    return {n: m for n, m in made.items() if m is not None}


def return_outputs(code: Source, graph) -> None:
    """The generated function's last lines: the outputs in the region's structure, a fresh
    container every call (an output the region returned twice made once, into a temporary)."""
    policy = graph.session.policy
    if graph.output_slots is not None and graph.slot_outputs:
        code.line("_v = _me.views")  # the templates in the slot just written
    repeated = {item.first for item in graph.outputs if isinstance(item, SameOutput)}
    expressions = []
    for number, item in enumerate(graph.outputs):
        if isinstance(item, SameOutput):
            expressions.append(f"_t{int(item.first)}")
            continue
        expression = _expression(code, graph, number, policy.clone_outputs, policy.check_stale)
        if number in repeated:
            code.line(f"_t{number} = {expression}")
            expression = f"_t{number}"
        expressions.append(expression)
    code.line(f"return {_container(code, graph.output_spec[0][0], expressions)}")


def _handed_out(code: Source, tensor: str, clone: bool, guard: bool, fresh: str = "") -> str:
    """How a tensor the graph writes is handed out: a copy (``clone_outputs``), else the
    tensor made ``fresh`` (the suffix making a new tensor of it, if any), behind the stale
    guard in ``check_stale`` mode."""
    if clone:
        return f"{tensor}.clone()"
    if guard:
        code.namespace["_stale_guard"] = stale_guard
        return f"_stale_guard({tensor}{fresh}, _owner)"
    return tensor + fresh


def _expression(code: Source, graph, number: int, clone: bool, guard: bool) -> str:
    """The expression handing out output ``number``."""
    item = graph.outputs[number]
    if isinstance(item, SlotOutput):  # a fresh tensor on the slot's memory
        return _handed_out(code, f"_v[{int(item.number)}]", clone, guard, ".detach()")
    if isinstance(item, OwnedOutput):  # made afresh by the same object the C step calls
        made = f"{code.bind(graph.output_makers[number], '_make')}()"
        # copied or guarded only where the graph writes it (not an empty tensor or a view of
        # a global, which eager makes anew or reads where the global lies)
        return _handed_out(code, made, clone, guard) if writes(graph, number) else made
    if isinstance(item, HeldOutput):  # the global itself, as eagerly (no copy, no guard)
        return code.bind(item.tensor, "_out")
    if isinstance(item, InputView):
        owner = item.input
        if item.whole:
            return f"l{owner}"
        code.namespace["_as_strided"] = torch.as_strided
        size_name, stride_name = code.bind(item.size, "_size"), code.bind(item.stride, "_stride")
        return f"_as_strided(l{owner}, {size_name}, {stride_name}, l{owner}.storage_offset() + {int(item.delta)})"
    if isinstance(item, DynamicOutput):
        return code.with_constants(item.scalar.source, item.scalar.constants)
    return code.bind(item.value, "_const")


def _container(code: Source, spec: object, leaves: list[str]) -> str:
    """An expression building ``spec``'s structure anew from the leaf expressions."""
    if spec is None:
        return leaves.pop(0)
    kind = spec[0]
    if kind == "dict":
        items = ", ".join(f"{code.bind(k, '_key')}: {_container(code, s, leaves)}" for k, s in zip(spec[1], spec[2]))
        return "{" + items + "}"
    if kind == "dataclass":
        code.namespace["_make_dataclass"] = region_keys.make_dataclass_instance
        values = "".join(f"{_container(code, s, leaves)}, " for s in spec[3])
        return f"_make_dataclass({code.bind(spec[1], '_type')}, {code.bind(spec[2], '_fields')}, ({values}))"
    items = "".join(f"{_container(code, s, leaves)}, " for s in spec[1])
    if kind == "tuple":
        return f"({items})"
    if kind == "list":
        return f"[{items}]"
    return f"{code.bind(kind, '_type')}({items})"  # a named tuple


# --- check_stale mode ------------------------------------------------------------------------
def guard_outputs(value: object, owner) -> object:
    """Hand out tensors that raise once ``owner`` (an entry) has been replayed again."""
    spec, leaves, _ = region_keys.flatten((value,), {}, walk_dataclasses=True)
    return region_keys.unflatten(spec, [stale_guard(leaf, owner) for leaf in leaves])[0][0]


def stale_guard(leaf: object, owner) -> object:
    """``leaf`` as a StaleGuardTensor remembering ``owner``'s generation (others as they are)."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    leaf = leaf.as_subclass(StaleGuardTensor)
    leaf._replay_owner = owner
    leaf._replay_generation = owner.generation
    return leaf


class StaleGuardTensor(torch.Tensor):
    """An output handed out in ``check_stale`` mode: any use after the graph that produced it
    has been replayed again raises :class:`StaleOutputError` instead of reading new data."""

    _replay_owner: Entry  # the entry whose replay wrote it (set by stale_guard)
    _replay_generation: int  # that entry's replay count when it was handed out

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
