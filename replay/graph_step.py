"""A recorded graph's C step (csrc/replay_step.c): which graphs have one, and its program.

The step runs the graph's generated replay function's steps from C, in its order and with its
results; for anything it does not decide it runs that function itself, before doing anything.
Its program (replay.step_program) is made from the generation: the node values the generator
planned, and every object the function uses taken from the function's own namespace by the
name it is bound under there (NAMESPACE_FIELDS), so the two cannot run different programs.
Graphs whose function has a step outside what the C file runs get no step, and the reason.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import torch

from jitcore.for_replay import compiled_helpers_enabled, torch_native_module
from replay import output_slots
from replay.graph_outputs import ConstantOutput, HeldOutput, InputView, OwnedOutput, SameOutput, SlotOutput
from replay.graph_source import (
    DYNAMIC_NAME,
    GeneratedReplay,
    notes_stream,
    readers_holder,
    staged_copies,
)
from replay.source_text import Source, SourcedFunction, compile_function
from replay.step_program import (
    Alignment,
    MemoryRange,
    NodePatch,
    OutputKind,
    ScalarComputation,
    StepOutput,
    StepProgram,
    TensorArgument,
)

try:  # a replay's steady state in C (csrc/replay_step.c; optional, built by setup.py)
    from replay._step import ReplayStep
except ImportError:
    ReplayStep = None

#: At most this many tensor arguments for csrc/replay_step.c (its fixed-size pointer array).
STEP_MAX_TENSORS = 64
#: At most this many lanes in a slot the step writes (its fixed-size arrays of where they are).
STEP_MAX_LANES = 64

#: The program's fields that are values of the generated function's namespace, by their names there.
NAMESPACE_FIELDS = {
    "mismatch": "_MISMATCH",
    "arithmetic_errors": "_ARITHMETIC_ERRORS",
    "last": "_last",
    "rollback": "_rollback",
    "set_failed": "_set_failed",
    "current_stream": "_current_stream",
    "last_stream": "_LAST_STREAM",
    "stream_switch": "_stream_switch",
    "graph_exec": "_EXEC",
    "counters": "_stats",
    "graph": "_me",
}

#: The torch settings check's name in the generated function's namespace.
MODES_CHECK_NAME = "_modes_changed"


class Refused(Exception):
    """The graph's generated function does something the C step does not (the reason)."""


def make_step(graph, backend, leaves: Sequence, generated: GeneratedReplay) -> tuple[Callable | None, str | None, str]:
    """(the C step, None, its argument function's source) for ``graph``, or (None, why not, "")."""
    if ReplayStep is None or not compiled_helpers_enabled():
        return None, "csrc/replay_step.c is not built (or JITCORE_NATIVE=0)", ""
    support = getattr(torch_native_module(), "replay_support", None)
    if support is None:
        return None, "the torch-side helper is not built for this torch (python -m jitcore.torch_native)", ""
    try:
        program = build_program(graph, backend, leaves, generated, support)
    except Refused as refused:
        return None, str(refused), ""
    maker = program.argument_maker
    return ReplayStep(program), None, maker.source if maker is not None else ""


def refusal(graph, backend, leaves: Sequence) -> str | None:
    """What ``graph``'s generated function does that the C step does not (None: nothing)."""
    policy, plan = graph.session.policy, graph.plan
    refusals = [
        (policy.polymorphic, "a polymorphic session (an exec shared by several graphs)"),
        (policy.clone_outputs or policy.check_stale, "outputs cloned or guarded against staleness"),
        (graph.uses_rng, "random numbers (torch's replay advances the generators)"),
        (graph.host is not None, "host inputs"),
        (bool(graph.in_place), "staged inputs taken in place"),
        (
            bool(graph.staged) and graph.fixed_addresses is None,
            "staged inputs of a graph whose addresses were not all read",
        ),
        (bool(plan.configs or plan.checks), "grid sizes or index checks computed per call"),
        (any(b.dynamic for b in plan.pointers), "pointer offsets computed per call"),
        (bool(graph.key[3]), "arguments recorded overlapping"),  # (one object as several among them)
        (backend.graph_launch_parts() is None or not backend.raw_stream_handles, "a backend launching from Python"),
        (sum(isinstance(leaf, torch.Tensor) for leaf in leaves) > STEP_MAX_TENSORS, "many tensors"),
        (len(graph.slot_need) > STEP_MAX_LANES, "many groups of outputs sharing memory"),
    ]
    return next((why for refused, why in refusals if refused), None)


def build_program(graph, backend, leaves: Sequence, generated: GeneratedReplay, support: object) -> StepProgram:
    """csrc/replay_step.c's program for ``graph``, or :class:`Refused` saying why it has none."""
    why = refusal(graph, backend, leaves)
    if why is not None:
        raise Refused(why)
    ns = graph.namespace
    launches = sorted(graph.plan.arguments)
    dynamic, sources, maker = _arguments(graph, launches)
    scalars = _scalars(graph, launches)
    nodes = _nodes(graph, generated)
    outputs, in_tuple = _outputs(graph)
    launch, launch_failed = backend.graph_launch_parts()
    slotted = graph.output_slots is not None
    fixed = ns.get("_FIXED", ())  # bound where staged inputs are checked against fixed addresses
    tensors = [TensorArgument(i, ns[f"_e{i}"]) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    holders = {lane.address: lane.buffer for lane in getattr(graph, "own_lanes", ())}
    owned = [MemoryRange(int(lo), int(size), holders.get(lo)) for lo, size in graph.output_memory.items()]
    pointers = graph.plan.pointers
    alignments = {Alignment(b.input, int(b.delta), bool(b.aligned)): None for b in pointers if b.aligned is not None}
    return StepProgram(
        fallback=graph.replay,
        namespace=ns,
        check_names=generated.check_names,
        modes_check_name=MODES_CHECK_NAME,
        leaf_count=len(leaves),
        tensors=tuple(tensors),
        owned_memory=() if slotted else tuple(owned),
        alignments=tuple(alignments),
        staged_inputs=tuple(sorted(graph.staged)) if fixed else (),
        fixed_addresses=tuple(fixed),
        dynamic_leaves=dynamic,
        launch_count=len(launches),
        argument_sources=sources,
        argument_maker=maker,
        scalars=scalars,
        nodes=nodes,
        device=int(graph.device),
        launch=launch,
        launch_failed=launch_failed,
        own_readers=readers_holder(graph) == "_me",
        notes_stream=notes_stream(graph),
        slotted=slotted,
        lane_count=len(graph.slot_need) if slotted else 0,
        retarget=ns.get("_retarget"),
        use_count_reader=output_slots._use_count,
        support=support,
        outputs=outputs,
        in_tuple=in_tuple,
        staged_copies=staged_copies(graph),
        **{field: ns[name] for field, name in NAMESPACE_FIELDS.items()},
    )


def _arguments(graph, launches: list[int]) -> tuple[tuple[int, ...], tuple | None, Callable | None]:
    """The dynamic leaves read, and each launch's jit arguments: per argument the dynamic leaf
    it is (None: not recomputed) where each is one, else a generated function computing them."""
    plan = graph.plan
    texts = [text for launch in launches for text in plan.arguments[launch] if text is not None]
    dynamic = tuple(sorted({int(m) for text in texts for m in DYNAMIC_NAME.findall(text)}))
    if all(DYNAMIC_NAME.fullmatch(text) for text in texts):
        sources = tuple(
            tuple(None if text is None else int(text[2:]) for text in plan.arguments[launch]) for launch in launches
        )
        return dynamic, sources, None
    return dynamic, None, _argument_maker(graph, launches, dynamic)


def _argument_maker(graph, launches: list[int], dynamic: tuple[int, ...]) -> SourcedFunction:
    """``step_arguments(*values)``: each launch's jit arguments (the generated replay's
    ``_a{launch}``), from the dynamic leaves' values in ``dynamic``'s order, for the C step.
    Its builtins are the replay function's own, so its expressions resolve as they do there."""
    builtins = graph.namespace.get("__builtins__")
    code = Source({"__builtins__": builtins} if builtins is not None else {})
    tuples = []
    for launch in launches:
        values = "".join(
            f"{code.with_constants(text, graph.plan.constants) if text is not None else 'None'}, "
            for text in graph.plan.arguments[launch]
        )
        tuples.append(f"({values})")
    code.lines.append(f"def step_arguments({', '.join(f'_d{i}' for i in dynamic)}):")
    code.line(f"return ({''.join(t + ', ' for t in tuples)})")
    return compile_function(code.text(), "step_arguments", f"jit arguments of {graph.name}", code.namespace)


def _scalars(graph, launches: list[int]) -> tuple[ScalarComputation, ...]:
    """Each scalar parameter's computation, from its launch's argument tuple."""
    argument_of = {launch: n for n, launch in enumerate(launches)}
    scalars = []
    for binding in graph.plan.scalars:
        if binding.launch not in argument_of:
            raise Refused("a scalar computed without its launch's arguments")
        packer = struct.Struct("<" + binding.fmt).pack
        scalars.append(ScalarComputation(argument_of[binding.launch], binding.evaluate, binding.convert, packer))
    return tuple(scalars)


def _nodes(graph, generated: GeneratedReplay) -> tuple[NodePatch, ...]:
    """Each patched node with the values the generator planned for it, as the C step writes them."""
    nodes = []
    updaters = graph.updaters
    for node, slots in generated.patches.slots.items():
        values = tuple([slot.step for slot in slots])
        if any(value is None for value in values):
            raise Refused("a node value csrc/replay_step.c does not write")
        updater = updaters[node]
        nodes.append(NodePatch(node, updater.params.buffer, updater.set_call, updater.set_args, values))
    return tuple(nodes)


def _outputs(graph) -> tuple[tuple[StepOutput, ...], bool]:
    """How the step makes each output (with the objects the generated function uses), and
    whether they go in a tuple."""
    outputs = []
    for number, item in enumerate(graph.outputs):
        if isinstance(item, SlotOutput):
            outputs.append(StepOutput(OutputKind.SLOT_VIEW, int(item.number)))
        elif isinstance(item, InputView):
            kind = OutputKind.LEAF if item.whole else OutputKind.MADE_FROM_LEAF
            outputs.append(StepOutput(kind, int(item.input), None if item.whole else item.view))
        elif isinstance(item, OwnedOutput):
            outputs.append(StepOutput(OutputKind.MADE, value=graph.output_makers[number]))
        elif isinstance(item, HeldOutput):
            outputs.append(StepOutput(OutputKind.VALUE, value=item.tensor))
        elif isinstance(item, ConstantOutput):
            outputs.append(StepOutput(OutputKind.VALUE, value=item.value))
        elif isinstance(item, SameOutput):
            outputs.append(StepOutput(OutputKind.SAME_AS, int(item.first)))
        else:
            raise Refused("outputs recomputed per call (dynamic values)")
    spec = graph.output_spec[0][0]
    if spec is not None and not (spec[0] == "tuple" and all(child is None for child in spec[1])):
        raise Refused("outputs in a structure other than one tensor or a flat tuple")
    return tuple(outputs), spec is not None
