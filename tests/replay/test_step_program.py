"""The C step's program (replay.step_program), read by name by csrc/replay_step.c, and the
replay_support layout check shared with the torch-side helper (csrc/replay_support.h).

Graphs are made against the simulated exec of tests/replay/test_graph.py, with the torch-side
helper built for real (tests/conftest.py's session cache).
"""

from __future__ import annotations

import ctypes
import importlib.util
import types

import attrs
import pytest
import torch

from jitcore import torch_native
from jitcore.backends import use_backend
from replay import graph_step
from replay.dynamic import Dynamic
from replay.graph import MISMATCH
from replay.rebinding import PointerBinding
from replay.step_program import OutputKind, PointerWrite, StepOutput, StepProgram
from tests.replay.test_graph import SimBackend, build, node_pointer, node_scale, scalar_plan

pytestmark = pytest.mark.skipif(importlib.util.find_spec("replay._step") is None, reason="replay._step is not built")


def stepped_graph(helper):
    """A graph of a pointer and a scalar, replayed by its C step."""
    plan = scalar_plan()
    plan.pointers.append(PointerBinding(0, 0, 0, 0, 0, 16))
    with torch_native.using(helper):
        graph, sim = build([torch.randn(8), Dynamic(1.0)], plan)
    assert isinstance(graph.replay, graph_step.ReplayStep), graph.step_refused
    return graph, sim


def test_the_step_reads_the_objects_the_generated_function_holds(torch_native_helper):
    """One source for both: every program field that is a value of the generated function's
    namespace is that very object, the nodes write the buffers the function writes, the
    extents are the function's ``_e{i}``, and the fallback is the function itself."""
    graph, _ = stepped_graph(torch_native_helper)
    program, ns = graph.replay.program, graph.namespace
    assert isinstance(program, StepProgram) and program.namespace is ns
    for field, name in graph_step.NAMESPACE_FIELDS.items():
        assert getattr(program, field) is ns[name], field
    assert program.fallback is graph.replay.fallback and program.fallback.__globals__ is ns
    buffers = {id(value) for name, value in ns.items() if name.startswith("_buf")}
    assert program.nodes and all(id(node.buffer) in buffers for node in program.nodes)
    assert all(ns[f"_e{tensor.leaf}"] == tensor.extent for tensor in program.tensors)
    assert all(callable(ns[name]) for name in (*program.check_names, program.modes_check_name))


def test_the_program_is_read_once_when_the_step_is_built(torch_native_helper):
    """A program changed after its step was built (even its frozen fields) changes nothing."""
    graph, sim = stepped_graph(torch_native_helper)
    program = graph.replay.program
    object.__setattr__(program, "nodes", ())
    object.__setattr__(program, "last_stream", "not a list")
    object.__setattr__(program, "tensors", None)
    y = torch.randn(8)
    with use_backend(SimBackend(sim)):
        assert graph.replay(y, Dynamic(3.0)) is not MISMATCH
    assert node_pointer(sim) == y.data_ptr() + 16 and node_scale(sim) == 3.0


def _without(program: StepProgram, name: str) -> types.SimpleNamespace:
    fields = attrs.asdict(program, recurse=False)
    del fields[name]
    return types.SimpleNamespace(**fields)


def _node(program: StepProgram, **changes) -> StepProgram:
    """``program`` with its first node changed."""
    return attrs.evolve(program, nodes=(attrs.evolve(program.nodes[0], **changes),))


def _pointer(program: StepProgram, **changes) -> StepProgram:
    """``program`` with its first node's pointer value changed (and its scalar value gone)."""
    pointer = next(v for v in program.nodes[0].values if v.input is not None)
    return _node(program, values=(attrs.evolve(pointer, **changes),))


def _first(program: StepProgram, field: str, **changes) -> StepProgram:
    """``program`` with the first item of its tuple ``field`` changed."""
    return attrs.evolve(program, **{field: (attrs.evolve(getattr(program, field)[0], **changes),)})


#: Malformed programs: (what, how, the error raised, what its message names).
_DAMAGES = [
    ("a field missing", lambda p: _without(p, "tensors"), TypeError, "has no field 'tensors'"),
    ("a list for a tuple", lambda p: attrs.evolve(p, tensors=list(p.tensors)), TypeError, "'tensors' must be a tuple"),
    ("a tensor beyond the leaves", lambda p: _first(p, "tensors", leaf=5), ValueError, "'leaf'"),
    ("a negative extent", lambda p: _first(p, "tensors", extent=-1), ValueError, "'extent'"),
    ("a huge extent", lambda p: _first(p, "tensors", extent=2**70), ValueError, "'extent'"),
    ("a namespace that is no dict", lambda p: attrs.evolve(p, namespace=[]), TypeError, "'namespace'"),
    ("set_args not a tuple", lambda p: _node(p, set_args=[]), TypeError, "'set_args'"),
    ("a buffer that is not writable", lambda p: _node(p, buffer=b"\0" * 64), TypeError, "'buffer'"),
    ("a write outside the buffer", lambda p: _pointer(p, writes=(PointerWrite(10**6, 0),)), ValueError, "'offset'"),
    ("a pointer of a leaf that is no tensor", lambda p: _pointer(p, input=1), ValueError, "'input'"),
    ("both a pointer and a scalar", lambda p: _pointer(p, scalar=0), ValueError, "'input'"),
    ("a last index beyond the list", lambda p: _pointer(p, last=99), ValueError, "'last'"),
    ("a node value of another type", lambda p: _node(p, values=("not a value",)), TypeError, "has no field"),
    ("a scalar of no launch", lambda p: _first(p, "scalars", launch=5), ValueError, "'launch'"),
    (
        "an argument source that is not a dynamic leaf",
        lambda p: attrs.evolve(p, argument_sources=((None, 0),)),
        ValueError,
        "'argument_sources'",
    ),
    (
        "neither sources nor a maker",
        lambda p: attrs.evolve(p, argument_sources=None, argument_maker=None),
        ValueError,
        "'argument_maker'",
    ),
    (
        "a slot view of a graph without slots",
        lambda p: attrs.evolve(p, outputs=(StepOutput(OutputKind.SLOT_VIEW, 0),)),
        ValueError,
        "'kind'",
    ),
    ("an output of no kind", lambda p: attrs.evolve(p, outputs=(StepOutput(7, 0),)), ValueError, "'kind'"),
    (
        "an output leaf beyond the leaves",
        lambda p: attrs.evolve(p, outputs=(StepOutput(OutputKind.LEAF, 9),)),
        ValueError,
        "'number'",
    ),
    (
        "an output the same as a later one",
        lambda p: attrs.evolve(p, outputs=(StepOutput(OutputKind.SAME_AS, 0),)),
        ValueError,
        "'number'",
    ),
    (
        "an output made by what cannot be called",
        lambda p: attrs.evolve(p, outputs=(StepOutput(OutputKind.MADE, 0, 5),)),
        TypeError,
        "'value'",
    ),
    (
        "a view of a leaf beyond the leaves",
        lambda p: attrs.evolve(p, outputs=(StepOutput(OutputKind.MADE_FROM_LEAF, 9, len),)),
        ValueError,
        "'number'",
    ),
    ("own readers not a bool", lambda p: attrs.evolve(p, own_readers=None), TypeError, "'own_readers'"),
    ("too many lanes", lambda p: attrs.evolve(p, lane_count=65), ValueError, "'lane_count'"),
    (
        "a staged input that is no tensor",
        lambda p: attrs.evolve(p, staged_inputs=(1,), fixed_addresses=(16,)),
        ValueError,
        "'staged_inputs'",
    ),
    (
        "fixed addresses out of order",
        lambda p: attrs.evolve(p, staged_inputs=(0,), fixed_addresses=(32, 16)),
        ValueError,
        "sorted",
    ),
    ("a last that is no list", lambda p: attrs.evolve(p, last=tuple(p.last)), TypeError, "'last'"),
    ("an empty last stream", lambda p: attrs.evolve(p, last_stream=[]), TypeError, "'last_stream'"),
    ("a device that is no int", lambda p: attrs.evolve(p, device="0"), TypeError, "'device'"),
    ("a launch that cannot be called", lambda p: attrs.evolve(p, launch=5), TypeError, "'launch'"),
    (
        "arithmetic errors that are no exceptions",
        lambda p: attrs.evolve(p, arithmetic_errors=(ValueError, 5)),
        TypeError,
        "'arithmetic_errors'",
    ),
    ("slotted not a bool", lambda p: attrs.evolve(p, slotted=1), TypeError, "'slotted'"),
    ("a support that is no capsule", lambda p: attrs.evolve(p, support=object()), TypeError, "support"),
    ("no program at all", lambda p: None, TypeError, "has no field"),
]


@pytest.mark.parametrize(("what", "damage", "error", "named"), _DAMAGES, ids=[d[0] for d in _DAMAGES])
def test_a_malformed_program_is_refused_naming_the_field(torch_native_helper, what, damage, error, named):
    """replay.graph_step builds the program; a malformed one (a bug, never a user's doing)
    raises TypeError (a field missing or of another type) or ValueError (out of range)
    naming the field, when the step is made: no later call can meet it."""
    graph, _ = stepped_graph(torch_native_helper)
    program = graph.replay.program
    assert isinstance(graph_step.ReplayStep(program), graph_step.ReplayStep)  # the program itself is fine
    with pytest.raises(error, match=named):
        graph_step.ReplayStep(damage(program))


def test_a_step_exists_only_built():
    """No way to make a ReplayStep skips its program: without one, through object.__new__, by
    copying (no half-built step exists to be called)."""
    ReplayStep = graph_step.ReplayStep
    with pytest.raises(TypeError):
        ReplayStep.__new__(ReplayStep)
    with pytest.raises(TypeError):
        object.__new__(ReplayStep)
    with pytest.raises(TypeError):
        ReplayStep(program=None)
    with pytest.raises(TypeError):
        type("Sub", (ReplayStep,), {})


def test_a_copy_of_a_step_is_refused(torch_native_helper):
    import copy

    graph, _ = stepped_graph(torch_native_helper)
    with pytest.raises(TypeError):
        copy.copy(graph.replay)


# --- csrc/replay_support.h: the layout both sides are built from --------------------------------


class _Support(ctypes.Structure):
    """The struct's first two members, which every layout keeps, and room for the functions."""

    _fields_ = [("layout", ctypes.c_char_p), ("size", ctypes.c_size_t), ("functions", ctypes.c_void_p * 6)]


_CAPSULE = b"jitcore._torch_native.replay_support"
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)
_new_capsule = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi)
)


def _capsule_like(helper, layout: bytes | None = None, size: int | None = None, name: bytes = _CAPSULE):
    """A capsule holding a copy of the helper's replay_support, its layout text or size changed:
    what a helper built from another version of the header would lend. Returns it with what
    must outlive it (the struct, its name)."""
    real = _Support.from_address(_capsule_pointer(helper.replay_support, _CAPSULE))
    copy = _Support(real.layout if layout is None else layout, real.size if size is None else size, real.functions)
    return _new_capsule(ctypes.addressof(copy), name, None), (copy, name)


def test_the_helper_and_the_step_are_built_from_one_layout(torch_native_helper):
    """The helper built in a fresh cache lends the layout the step was built with, and a step
    accepts it; the layout text is the header's field list."""
    from replay import _step

    assert torch_native_helper.REPLAY_SUPPORT_LAYOUT == _step.SUPPORT_LAYOUT
    for function in ("read_data_pointer", "fresh_output", "storage_use_count", "read_storage_span"):
        assert f"(*{function})" in _step.SUPPORT_LAYOUT
    graph, _ = stepped_graph(torch_native_helper)
    assert graph.replay.program.support is torch_native_helper.replay_support


def test_a_helper_of_another_layout_is_refused_saying_what_to_rebuild(torch_native_helper):
    graph, _ = stepped_graph(torch_native_helper)
    program = graph.replay.program
    same, _kept = _capsule_like(torch_native_helper)
    assert isinstance(graph_step.ReplayStep(attrs.evolve(program, support=same)), graph_step.ReplayStep)
    edited = torch_native_helper.REPLAY_SUPPORT_LAYOUT.replace("int64_t", "int32_t").encode()
    assert edited != torch_native_helper.REPLAY_SUPPORT_LAYOUT.encode()
    for changes in ({"layout": edited}, {"layout": b""}, {"size": ctypes.sizeof(_Support) + 8}):
        other, _kept = _capsule_like(torch_native_helper, **changes)
        with pytest.raises(ValueError, match="another csrc/replay_support.h.*rebuild"):
            graph_step.ReplayStep(attrs.evolve(program, support=other))
    foreign, _kept = _capsule_like(torch_native_helper, name=b"another.capsule")
    with pytest.raises(TypeError, match="replay_support capsule"):
        graph_step.ReplayStep(attrs.evolve(program, support=foreign))
