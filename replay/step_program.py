"""The program csrc/replay_step.c runs: one recorded graph's replay as named fields.

replay.graph_step builds it from the graph's generated replay function (the objects that
function's namespace holds, the node values its generator planned); csrc/replay_step.c reads
every field by name once, when the step is built, into C fields its calls read. A missing field
or one of another type raises TypeError naming it; a value out of range, ValueError. Nothing
here is read again after that: changing a program once its step is built changes nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import attrs

from replay.source_text import SourcedFunction


@attrs.frozen
class TensorArgument:
    """A tensor argument whose data pointer the step reads (through the torch-side helper)."""

    leaf: int  # its place among the call's leaves
    extent: int  # its byte extent: the checks compare [pointer, pointer + extent)


@attrs.frozen(eq=False)
class MemoryRange:
    """Output memory a graph without output slots writes at every replay: an argument lying
    in it would be overwritten, where eagerly it is not, so the call is declined."""

    start: int
    size: int
    # a tensor over the buffer's storage: where that storage no longer spans the range (a caller
    # resized an output), the generated function decides (it spoils the graph). None: not checked
    holder: object = None


@attrs.frozen
class Alignment:
    """A rebound pointer whose 16-byte alignment a kernel was specialised on (Triton's
    ``tt.divisibility``): another alignment declines the call, eager picks the right binary."""

    leaf: int
    delta: int  # bytes from the argument's pointer to the kernel's
    aligned: bool  # what it was when recorded


@attrs.frozen
class ScalarComputation:
    """A scalar parameter computed from a launch's jit arguments and packed to its exact bytes
    (what the generated ``_v{n} = packer(convert(evaluate(_a{launch})))`` computes)."""

    launch: int  # its launch's place among the argument tuples
    evaluate: Callable
    convert: Callable | None
    packer: Callable  # struct.Struct(fmt).pack: a value that does not fit raises, and the call declines


# The node values and their writes are made per patched slot at every graph build: plain
# attrs classes, an init of a frozen one costing over twice as much. Nothing changes them.
@attrs.define
class PointerWrite:
    """Where a rebound pointer goes in its node's parameter buffer."""

    offset: int  # bytes into the buffer
    delta: int  # the recorded view's bytes from its input's pointer


@attrs.define
class ScalarWrite:
    """Where a scalar's packed bytes go in its node's parameter buffer."""

    offset: int  # bytes into the buffer
    size: int  # the packed value's bytes: another size is refused, never written


@attrs.define
class NodeValue:
    """One value a node may be given: the pointer of a tensor argument (plus each write's
    delta) or a computed scalar; written only where it differs from what the node holds."""

    last: int  # its index in ``StepProgram.last``, what the node holds now
    input: int | None  # a pointer: its argument's leaf (None for a scalar)
    scalar: int | None  # a scalar: its place in ``StepProgram.scalars`` (None for a pointer)
    writes: tuple[PointerWrite, ...] | tuple[ScalarWrite, ...]


@attrs.define(eq=False)
class NodePatch:
    """A kernel node whose parameters a replay may change, and the driver call pushing them."""

    node: int  # its index in the graph, for the error a failed update raises
    buffer: object  # its updater's parameter buffer (writable, fixed size): every write lands here
    set_call: Callable  # the updater's call pushing the buffer to the exec: ``set_call(*set_args)``
    set_args: tuple
    values: tuple[NodeValue, ...]


class OutputKind(enum.IntEnum):
    """How the step makes an output (the outputs it does not make refuse the step)."""

    SLOT_VIEW = 0  # a fresh ``detach()`` of its template view in the output slot written
    LEAF = 1  # an argument returned as it is (the output is that very argument)
    VALUE = 2  # the same object at every call (a tensor the region reaches by name, a constant)
    MADE = 3  # ``value()``: made afresh (a detach() of the graph's own memory, a view of a global, an empty tensor)
    MADE_FROM_LEAF = 4  # ``value(leaf)``: a fresh view of the argument ``number``
    SAME_AS = 5  # the very object of the earlier output ``number`` (one object returned twice)


@attrs.frozen(eq=False)
class StepOutput:
    """One output of the replay, in the order the region returns them."""

    kind: OutputKind
    number: int = 0  # SLOT_VIEW: its place in the graph's views; LEAF, MADE_FROM_LEAF: its leaf; SAME_AS: an output
    value: object = None  # VALUE: the object returned; MADE, MADE_FROM_LEAF: what makes it


@attrs.frozen(eq=False)
class StepProgram:
    """A graph's replay as csrc/replay_step.c runs it (see replay.graph_step, which says which
    graphs have one and which values of the generated function's namespace each field is)."""

    # --- the generated function, which the step runs for anything it does not decide
    fallback: Callable  # called with the call's arguments, before anything is done
    namespace: dict  # its namespace: the checks below are read from it at every call
    check_names: tuple[str, ...]  # the launchers' globals checks: called in order, results ignored
    modes_check_name: str  # the torch settings check: a true answer returns ``mismatch``
    mismatch: object  # what a call the graph cannot serve returns (replay.graph.MISMATCH)
    # --- the call's arguments and the checks on them
    leaf_count: int  # the arguments a call passes: another count is the fallback's TypeError
    tensors: tuple[TensorArgument, ...]  # recorded apart: any overlap declines the call
    owned_memory: tuple[MemoryRange, ...]
    alignments: tuple[Alignment, ...]
    staged_inputs: tuple[int, ...]  # leaves whose storage must hold none of ``fixed_addresses``
    fixed_addresses: tuple[int, ...]  # sorted: the addresses the graph's nodes hold fixed
    # --- the values computed from dynamic scalars
    dynamic_leaves: tuple[int, ...]  # the leaves whose ``.value`` is read, once a call
    launch_count: int  # the argument tuples computed: one per launch that has jit arguments
    argument_sources: tuple[tuple[int | None, ...], ...] | None  # per argument its dynamic leaf, or None
    argument_maker: SourcedFunction | None  # else: a function of the dynamic values making every tuple
    scalars: tuple[ScalarComputation, ...]
    arithmetic_errors: tuple[type[BaseException], ...]  # what a computation declines the call on
    # --- the nodes
    nodes: tuple[NodePatch, ...]
    last: list  # what each node value holds now (the generated ``_last``), shared with the function
    rollback: Callable  # after an interrupted patch: every buffer back to what its node holds
    set_failed: Callable  # raises for a failed node update: ``set_failed(status, node)``
    # --- the launch
    current_stream: Callable  # ``current_stream(device)``: the stream the call launches on
    device: int
    last_stream: list  # one item, the stream of the session's last launch
    stream_switch: Callable  # told the new stream when it is not ``last_stream[0]``
    launch: Callable  # ``launch(graph_exec, stream)`` -> a status tuple
    graph_exec: object
    launch_failed: Callable  # raises for a failed launch: ``launch_failed(status)``
    # before it: the streams callers read the output memory on (record_stream), which the slot
    # written notes, or the graph itself for its own output buffers (``own_readers``)
    own_readers: bool
    notes_stream: bool  # after it: the graph keeps its stream (``graph.stream``, for its release)
    # --- the output slots (replay.output_slots) and the outputs
    slotted: bool  # its outputs are copied into the region's output slots
    lane_count: int  # the lanes of a slot it writes: each where it was (else choose decides); no argument in them
    retarget: Callable | None  # points the output copies at another slot (slotted graphs)
    use_count_reader: Callable  # replay.output_slots' own reader: the slots whose held() C answers
    support: object  # the torch-side helper's replay_support capsule (csrc/replay_support.h)
    outputs: tuple[StepOutput, ...]
    in_tuple: bool  # the outputs in a fresh flat tuple; else the one output itself
    # --- the bookkeeping
    graph: object  # the RecordedGraph: its replays counted; its slot, bound_slot and views read
    counters: object  # the session's Stats: replays, patches, staged copies
    staged_copies: int  # the staging copies each replay makes
