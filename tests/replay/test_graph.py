"""The generated replay function against a simulated graph exec (the GPU tests run real ones).

The simulated exec keeps, per kernel node, the parameter bytes, launch dimensions and enabled
state the driver accepted, and every launch records what would have run: so these tests see
exactly what a real graph would compute with, including after failed updates.
"""

from __future__ import annotations

import contextlib
import struct
import time

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jitcore.backends import use_backend
from jitcore.backends.abi import ParamLayout, parse_param
from jitcore.backends.base import GraphNode, NodeUpdater
from jitcore.backends.null import NullBackend
from jitcore.errors import DriverError
from replay import graph as graph_module
from replay import graph_checks, output_identity, region_keys
from replay.dynamic import Dynamic, DynamicScalar
from replay.graph import MISMATCH, RecordedGraph, clone_preserving_sharing
from replay.instrumentation import measure_with_settings_check, measure_without_checks
from replay.policy import Policy
from replay.rebinding import (
    ConfigBinding,
    InputRange,
    Plan,
    PointerBinding,
    ScalarBinding,
)
from replay.stats import Stats


class SimExec:
    """What a graph exec holds: per node, parameter bytes, dimensions, enabled."""

    def __init__(self) -> None:
        self.params: dict[int, bytes] = {}
        self.dims: dict[int, tuple] = {}
        self.enabled: dict[int, bool] = {}
        self.launched: list[dict] = []
        self.fail_next_set = 0
        self.interrupt_after_next_set = False

    def launch(self) -> None:
        self.launched.append({n: (self.params[n], self.dims[n]) for n in self.params if self.enabled.get(n, True)})


class SimUpdater(NodeUpdater):
    def __init__(self, sim: SimExec, node: GraphNode, layout: ParamLayout, initial: bytes):
        from jitcore.backends.abi import PackedParams

        self.params = PackedParams(layout, initial)
        self.size = layout.size
        self.sim = sim
        self.node = node.index
        self._dims = list(node.grid) + list(node.block) + [node.shared_bytes]
        sim.params[self.node] = bytes(initial)
        sim.dims[self.node] = tuple(self._dims)
        self.set_call = self._set
        self.set_args = ()
        self.enable_call = self._enable
        self.enable_args = ()

    def _set(self):
        if self.sim.fail_next_set:
            self.sim.fail_next_set -= 1
            return (700,)
        if 0 in self._dims[:6]:
            return (1,)  # a real driver refuses a zero grid
        self.sim.params[self.node] = bytes(self.params.buffer)[: self.size]
        self.sim.dims[self.node] = tuple(self._dims)
        if self.sim.interrupt_after_next_set:  # the driver took it; then Ctrl-C
            self.sim.interrupt_after_next_set = False
            raise KeyboardInterrupt
        return (0,)

    def _enable(self, flag):
        self.sim.enabled[self.node] = bool(flag)
        return (0,)

    def set_dimension(self, field, value):
        self._dims[self.DIMENSIONS.index(field)] = value

    def dimensions(self):
        return tuple(self._dims)


def _launched(launch):
    """A graph launch as the backends make it for csrc/replay_step.c: (exec, stream) -> status."""

    def graph_launch(_exec, _stream):
        launch()
        return (0,)

    return graph_launch


def _launch_failed(status):
    raise DriverError("graph launch", int(status), str(status))


class SimBackend(NullBackend):
    raw_stream_handles = True

    def __init__(self, sim: SimExec) -> None:
        super().__init__()
        self.sim = sim
        self.hot_namespace = dict(self.hot_namespace, _SIM=sim)
        self.graph_launch_template = "_SIM.launch()"

    def graph_launch_parts(self):
        return _launched(self.sim.launch), _launch_failed

    def node_updater(self, raw_exec, node, layout, initial):
        return SimUpdater(self.sim, node, layout, initial)

    def graph_exec_object(self, raw_exec):
        return raw_exec


class FakeTorchGraph:
    def __init__(self, sim: SimExec) -> None:
        self.sim = sim

    def raw_cuda_graph_exec(self):
        return 1

    def replay(self):
        self.sim.launch()

    def reset(self):
        pass


@attrs.define
class Record:
    layout: ParamLayout
    param_bytes: bytes
    check_globals: object = None


class FakeSession:
    def __init__(self, **policy):
        self.policy = Policy(**policy)
        self.counters = Stats()
        self.last_stream = [0]

    def stream_switch(self, stream):
        self.last_stream[0] = stream


@attrs.frozen
class Held:
    """What a region reaches by name (recording.HeldTensors, as output_identity reads it)."""

    named: tuple = ()


class FakeRegion:
    name = "step"

    def __init__(self, key):
        self.entries = {key: attrs.make_class("E", {"generation": attrs.field(default=0)})()}


@pytest.fixture(autouse=True)
def _replayed_both_ways(replay_step):
    """Every test here runs against both ways a graph replays: csrc/replay_step.c ("c", with the
    torch-side helper built for real) and the generated Python alone ("python")."""
    return replay_step


LAYOUT = ParamLayout.of([parse_param("float* x"), parse_param("float s"), parse_param("long long n")])


def build(
    leaves,
    plan,
    *,
    outputs=None,
    sim=None,
    grid=(4, 1, 1),
    staged=None,
    node_views=(),
    held=(),
    owned=(),
    backend=None,
    **policy,
):
    """A graph recorded over ``leaves`` returning ``outputs`` (``held``: the tensors among them
    the region reaches by name, as replay.output_identity tells a capture's; ``owned``: buffers
    the capture gave outputs as memory of their own, which a session without slots keeps)."""
    sim = sim or SimExec()
    spec, flat, paths = region_keys.flatten(tuple(leaves), {})
    key = region_keys.region_key(-1, spec, flat, paths)
    tensors = [(i, leaf) for i, leaf in enumerate(flat) if isinstance(leaf, torch.Tensor)]
    initial = struct.pack("<Qfxxxxq", tensors[0][1].data_ptr() if tensors else 0, 1.0, 7)
    capture = attrs.make_class(
        "Capture",
        [
            "graph",
            "device",
            "plan",
            "staged",
            "copied_back",
            "memory",
            "nodes",
            "records",
            "outputs",
            "inputs",
            "input_dtypes",
            "dynamic_values",
            "node_views",
            "identity",
            "owned_outputs",
        ],
    )(
        FakeTorchGraph(sim),
        -1,
        plan,
        staged or {},
        set(),
        0,
        [GraphNode(0, None, "kernel", 0xF, grid, (64, 1, 1), 0)],
        [Record(LAYOUT, initial)],
        outputs,
        [InputRange(i, paths[i], t.data_ptr(), t.data_ptr() + region_keys.extent_bytes(t)) for i, t in tensors],
        {i: t.dtype for i, t in tensors},
        {},
        list(node_views) if node_views is not None else None,
        output_identity.identify(outputs, output_identity.given_objects(flat, staged or {}, None), Held(held)),
        {buffer.data_ptr() for buffer in owned},
    )
    capture.identity = output_identity.with_memory(capture.identity, outputs, capture.owned_outputs)
    region = FakeRegion(key)
    with use_backend(backend or SimBackend(sim)):
        graph = RecordedGraph(region, key, capture, spec, flat, paths, FakeSession(**policy), 0)
    return graph, sim


def node_pointer(sim, launch=-1):
    return struct.unpack_from("<Q", sim.launched[launch][0][0])[0]


def node_scale(sim, launch=-1):
    return struct.unpack_from("<f", sim.launched[launch][0][0], 8)[0]


def test_pointers_rebind_and_the_node_holds_the_new_address():
    x = torch.randn(64)
    graph, sim = build([x], Plan(pointers=[PointerBinding(0, 0, 0, 0, 0, 16)]))
    y = torch.randn(64)
    graph.replay(y)
    assert node_pointer(sim) == y.data_ptr() + 16
    graph.replay(x)
    assert node_pointer(sim) == x.data_ptr() + 16


def scalar_plan(fmt="f"):
    binding = ScalarBinding(0, 0, 1, 8, fmt, lambda s: s[1])
    return Plan(scalars=[binding], arguments={0: (None, "_d1")})


def test_scalars_compare_by_bits_so_negative_zero_and_nan_are_patched():
    x = torch.randn(8)
    graph, sim = build([x, Dynamic(0.0)], scalar_plan())
    graph.replay(x, Dynamic(0.0))
    graph.replay(x, Dynamic(-0.0))
    assert struct.pack("<f", node_scale(sim)) == struct.pack("<f", -0.0)
    graph.replay(x, Dynamic(float("nan")))
    assert node_scale(sim) != node_scale(sim)


def test_a_value_that_does_not_fit_declines_without_touching_the_graph():
    x = torch.randn(8)
    binding = ScalarBinding(0, 0, 2, 16, "q", lambda s: s[1])
    graph, sim = build([x, Dynamic(3)], Plan(scalars=[binding], arguments={0: (None, "_d1")}))
    graph.replay(x, Dynamic(3))
    held = dict(sim.params)
    assert graph.replay(x, Dynamic(2**70)) is MISMATCH
    assert sim.params == held and len(sim.launched) == 1
    graph.replay(x, Dynamic(5))
    assert struct.unpack_from("<q", sim.launched[-1][0][0], 16)[0] == 5


def test_an_interrupted_update_never_leaves_a_half_patched_graph():
    x, y = torch.randn(8), torch.randn(8)
    plan = Plan(
        pointers=[PointerBinding(0, 0, 0, 0, 0, 0)],
        scalars=[ScalarBinding(0, 0, 1, 8, "f", lambda s: s[1])],
        arguments={0: (None, "_d1")},
    )
    graph, sim = build([x, Dynamic(1.0)], plan)
    sim.fail_next_set = 1
    with pytest.raises(DriverError):
        graph.replay(y, Dynamic(2.0))
    # the same values again: the replay must push them (the node still holds the old ones)
    graph.replay(y, Dynamic(2.0))
    assert node_pointer(sim) == y.data_ptr() and node_scale(sim) == 2.0
    # and back to the very first values: patched back, not skipped
    graph.replay(x, Dynamic(1.0))
    assert node_pointer(sim) == x.data_ptr() and node_scale(sim) == 1.0


def test_a_graph_never_serves_another_aliasing_pattern():
    x, y = torch.randn(16), torch.randn(16)
    graph, sim = build([x, y], Plan(pointers=[PointerBinding(0, 0, 0, 0, 0, 0)]))
    assert graph.replay(x, x) is MISMATCH
    assert graph.replay(x, x[4:]) is MISMATCH
    base = torch.randn(32)
    assert graph.replay(base[:16], base[16:]) is not MISMATCH  # adjacent, not overlapping
    assert len(sim.launched) == 1
    shared, _ = build([x, x[4:]], Plan())
    assert shared.replay(y, y[4:]) is not MISMATCH
    assert shared.replay(x, y) is MISMATCH  # recorded overlapping, now disjoint


def test_many_tensor_arguments_check_aliasing_with_one_sort(c_or_python):
    tensors = [torch.randn(4) for _ in range(10)]
    graph, _ = build(tensors, Plan())
    assert ("_disjoint(" if c_or_python == "c" else "_overlap_groups") in graph.source
    assert graph.replay(*tensors) is not MISMATCH
    assert graph.replay(*tensors[:9], tensors[0]) is MISMATCH


def test_one_tensor_passed_many_times_is_checked_by_one_sort(c_or_python):
    """Recorded with one tensor 2000 times, the replay checks the pattern in about linear
    time (one group, not 2000 * 1999 / 2 pairs), and declines a call overlapping otherwise."""
    x, y = torch.randn(4), torch.randn(4)
    graph, _ = build([x] * 2000, Plan())
    assert graph.key[3] == (tuple(range(2000)),) and "_overlap_groups" in graph.source
    seconds = []
    for _ in range(5):
        started = time.perf_counter()
        assert graph.replay(*[y] * 2000) is not MISMATCH
        seconds.append(time.perf_counter() - started)
    assert sorted(seconds)[2] < 0.2, seconds  # (the median: a loaded machine's pauses are not the check's)
    assert graph.replay(*[y] * 1999, x) is MISMATCH


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())  # (the fixture sets the environment once for every example)
def test_many_arguments_recorded_apart_are_checked_apart_like_the_general_pattern(c_or_python, data):
    """Tensors recorded apart are checked by one sort in C (from replay.graph_checks.C_DISJOINT_FROM)
    or, without it, by numpy (above NUMPY_DISJOINT_FROM): either must decline exactly when the
    general pattern finds an overlap (views of one buffer at random offsets, touching ones too)."""
    least = graph_checks.C_DISJOINT_FROM if c_or_python == "c" else graph_checks.NUMPY_DISJOINT_FROM + 1
    count = data.draw(st.integers(least, 24))
    base = torch.zeros(4096)
    recorded = [base[64 * i : 64 * i + 16] for i in range(count)]
    graph, _ = build(recorded, Plan())
    if c_or_python == "c":
        assert "_disjoint(" in graph.source and "_np_array" not in graph.source
    else:
        assert "_np_array" in graph.source and "_overlap_groups" not in graph.source
    assert graph.replay(*recorded) is not MISMATCH
    views = []
    for _ in range(count):
        start = data.draw(st.integers(0, 4096 - 16))
        views.append(base[start : start + 16])
    apart = region_keys.pattern_of(region_keys.tensor_ranges(views)) == ()
    assert (graph.replay(*views) is not MISMATCH) == apart


@settings(max_examples=300, deadline=None)
@given(ranges=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 40)), max_size=70))
def test_the_c_disjoint_check_agrees_with_the_general_pattern(ranges):
    """replay._checks.disjoint on its own: equal starts, touching ends, nested ranges, more
    ranges than its stack array (64), none at all."""
    if graph_checks._disjoint is None:
        pytest.skip("replay._checks is not built here")
    pointers = tuple(start for start, _ in ranges)
    extents = tuple(extent for _, extent in ranges)
    general = region_keys.pattern_of([(i, lo, lo + e) for i, (lo, e) in enumerate(ranges)]) == ()
    assert graph_checks._disjoint(pointers, extents) is general


def test_the_c_disjoint_check_refuses_what_it_cannot_judge():
    if graph_checks._disjoint is None:
        pytest.skip("replay._checks is not built here")
    disjoint = graph_checks._disjoint
    with pytest.raises(ValueError, match="extents\\[0\\] is 0"):
        disjoint((1,), (0,))
    with pytest.raises(ValueError, match="one extent per pointer"):
        disjoint((1, 2), (1,))
    with pytest.raises(TypeError, match="pointers\\[1\\] must be an int"):
        disjoint((1, 2.0), (1, 1))
    with pytest.raises(OverflowError):
        disjoint((2**64 - 1,), (2,))
    with pytest.raises(TypeError):
        disjoint([1], (1,))


def test_a_graph_never_serves_other_torch_modes():
    x = torch.randn(8)
    graph, _ = build([x], Plan())
    with torch.no_grad():
        assert graph.replay(x) is MISMATCH
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert graph.replay(x) is MISMATCH
    finally:
        torch.set_default_dtype(previous)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert graph.replay(x) is MISMATCH
    assert graph.replay(x) is not MISMATCH


def test_checks_are_skipped_only_inside_the_measurement_hook_and_restored_after():
    x = torch.randn(8)
    graph, _ = build([x], Plan())
    with torch.no_grad():
        assert graph.replay(x) is MISMATCH
        with measure_without_checks([graph]):
            assert graph.replay(x) is not MISMATCH  # the benchmark's view: the check is gone
        assert graph.replay(x) is MISMATCH


@pytest.mark.parametrize(("way", "kind"), [("python", "function"), ("c", "SettingsCheck")])
def test_each_settings_check_runs_only_inside_its_measurement_hook_and_is_as_exact(way, kind):
    if way == "c" and region_keys._settings_check_type() is None:
        pytest.skip("replay._checks is not built here (or JITCORE_NATIVE=0)")
    x = torch.randn(8)
    graph, _ = build([x], Plan())
    fastest = graph.namespace["_modes_changed"]
    with measure_with_settings_check([graph], way):
        check = graph.namespace["_modes_changed"]
        assert type(check).__name__ == kind
        assert graph.replay(x) is not MISMATCH
        with torch.no_grad():
            assert graph.replay(x) is MISMATCH
    assert graph.namespace["_modes_changed"] is fastest


def test_pointer_offsets_from_dynamic_scalars_follow_the_scalar():
    cache = torch.randn(8, 16)
    row = 16 * 4
    binding = PointerBinding(
        0, 0, 0, 0, 0, 3 * row, dynamic=True, recorded_offset=3 * row, offset_evaluate=lambda s: s[1] * row
    )
    graph, sim = build([cache, Dynamic(3)], Plan(pointers=[binding], arguments={0: (None, "_d1")}))
    graph.replay(cache, Dynamic(5))
    assert node_pointer(sim) == cache.data_ptr() + 5 * row
    other = torch.randn(8, 16)
    graph.replay(other, Dynamic(0))
    assert node_pointer(sim) == other.data_ptr()
    assert graph.replay(other, Dynamic(9)) is MISMATCH  # past the input: eager decides
    graph.replay(other, Dynamic(3))
    assert node_pointer(sim) == other.data_ptr() + 3 * row


def test_grid_sizes_from_dynamic_scalars_are_patched_and_zero_disables_the_node():
    x = torch.randn(64)
    config = ConfigBinding(0, 0, "grid_x", lambda s: -(-s[1] // 16))
    graph, sim = build([x, Dynamic(64)], Plan(configs=[config], arguments={0: (None, "_d1")}))
    graph.replay(x, Dynamic(4000))
    assert sim.launched[-1][0][1][0] == 250
    graph.replay(x, Dynamic(0))
    assert 0 not in sim.launched[-1]  # disabled: nothing of it runs
    graph.replay(x, Dynamic(17))
    assert sim.launched[-1][0][1][0] == 2
    assert graph.replay(x, Dynamic(-20)) is MISMATCH  # a negative grid: the eager error
    assert graph.replay(x, Dynamic(16 * 2**40)) is MISMATCH  # beyond the device


def test_outputs_come_in_a_fresh_container_every_call():
    x = torch.randn(8)
    out = torch.randn(8)  # a tensor the region reaches by name, returned twice
    graph, _ = build([x], Plan(), outputs={"y": out, "n": [1, 2.5], "t": (out, x)}, held=[out])
    first = graph.replay(x)
    second = graph.replay(x)
    assert first is not second and first["n"] is not second["n"]
    first["y"] = None
    first["n"].append(3)
    third = graph.replay(x)
    assert third["y"] is out and third["n"] == [1, 2.5] and third["t"][1] is x and third["t"][0] is out


def test_dynamic_outputs_are_recomputed_from_the_new_value():
    x = torch.randn(8)
    expr = DynamicScalar("_d1", 3, "args[1]") * float("inf")
    graph, _ = build([x, Dynamic(3)], Plan(), outputs=(x, expr))
    assert graph.replay(x, Dynamic(-2))[1] == float("-inf")


# --- what a replay hands out: fresh objects, as eager makes them -----------------------------

#: What a caller may do to an output's own object (metadata, storage) that must reach no later one.
METADATA_CHANGES = {
    "unsqueeze_": lambda t: t.unsqueeze_(0),
    "as_strided_": lambda t: t.as_strided_((2,), (1,)),
    "t_": lambda t: t.t_() if t.dim() <= 2 else t.transpose_(0, 1),
    "transpose_": lambda t: t.unsqueeze_(0).transpose_(0, 1),
    "set_": lambda t: t.set_(torch.zeros(3)),
    ".data =": lambda t: setattr(t, "data", torch.zeros(5)),
    "requires_grad_": lambda t: t.requires_grad_(),
}


def test_a_view_covering_a_whole_input_is_a_fresh_view_and_the_input_itself_the_input(replay_step):
    """``return x[:]`` is a new view at every eager call (changing its metadata leaves ``x``
    alone), ``return x`` the caller's ``x`` itself: a replay tells them apart by what the capture
    saw, not by their layouts, which are the same."""
    x = torch.randn(8)
    graph, _ = build([x], Plan(), outputs=(x[:], x, x.view(2, 4), x.view(x.shape)))
    if replay_step == "c":
        assert graph.step_refused is None  # the C step makes the views too
    y = torch.randn(8)
    first, second = graph.replay(y), graph.replay(y)
    assert first[1] is y and second[1] is y
    for out in (first[0], first[3]):
        assert out is not y and out._base is y and out.shape == (8,) and out.data_ptr() == y.data_ptr()
    assert first[0] is not second[0] and first[2].shape == (2, 4) and first[2]._base is y
    for change in METADATA_CHANGES.values():
        change(graph.replay(y)[0])
        later = graph.replay(y)
        assert y.shape == (8,) and not y.requires_grad and later[0].shape == (8,) and later[3].shape == (8,)
        assert later[0].data_ptr() == y.data_ptr() and not later[0].requires_grad


def test_a_view_of_a_global_is_a_fresh_view_and_the_global_itself_the_global(replay_step):
    """A view the region makes of a tensor it reaches by name is new at every eager call; the
    tensor itself is that tensor: whatever a caller does to one call's view reaches no later one."""
    x, w = torch.randn(8), torch.randn(4, 4)
    graph, _ = build([x], Plan(), outputs=(w[1], w, w.t()), held=[w])
    if replay_step == "c":
        assert graph.step_refused is None
    for what, change in METADATA_CHANGES.items():
        first = graph.replay(x)
        assert first[1] is w and first[0] is not graph.replay(x)[0], what
        change(first[0])
        change(first[2]) if what != "requires_grad_" else None
        later = graph.replay(x)
        assert later[0].shape == (4,) and later[0].data_ptr() == w[1].data_ptr(), what
        assert later[2].shape == (4, 4) and later[2].stride() == (1, 4) and not later[0].requires_grad, what
        assert w.shape == (4, 4) and not w.requires_grad, what
    assert torch.equal(graph.replay(x)[0], w[1])


def test_one_object_returned_twice_is_one_object_each_call(replay_step):
    x, w = torch.randn(8), torch.randn(4)
    view = x[2:]
    graph, _ = build([x], Plan(), outputs=(view, w, view, x, x), held=[w])
    if replay_step == "c":
        assert graph.step_refused is None
    first, second = graph.replay(x), graph.replay(x)
    assert first[0] is first[2] and first[0] is not second[0] and first[3] is first[4] is x
    first[0].unsqueeze_(0)
    assert first[2].shape == (1, 6) and second[0].shape == (6,)


def test_an_empty_output_is_a_fresh_empty_tensor_each_call(replay_step):
    x = torch.randn(8)
    graph, _ = build([x], Plan(), outputs=(torch.empty(0, 3),))
    first = graph.replay(x)[0]
    first.resize_(5).fill_(1.0)  # the caller grows it: nothing of it reaches the next one
    second = graph.replay(x)[0]
    assert second.shape == (0, 3) and second.untyped_storage().nbytes() == 0
    assert second.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or not first.numel()


def _owning(sim=None):
    """A graph without output slots whose output lies in a buffer the capture gave it."""
    x = torch.randn(8)
    buffer = torch.empty(64, dtype=torch.uint8)
    out = torch.empty(0).set_(buffer.untyped_storage(), 2, (2, 3), (3, 1))
    graph, sim = build([x], Plan(pointers=[PointerBinding(0, 0, 0, 0, 0, 0)]), outputs=(out,), owned=[buffer], sim=sim)
    return graph, sim, out


@pytest.mark.parametrize("policy", ["clone_outputs", "check_stale"])
def test_only_outputs_in_the_graphs_memory_are_copied_or_guarded(policy):
    """``clone_outputs`` copies, and ``check_stale`` guards, what a later replay overwrites:
    the graph's own output memory. The caller's argument, a global the region returns and views
    of them are what eager returns (``out is w``; a write into ``out`` reaches ``w``), and one
    object returned twice is one object (copied once)."""
    x, w = torch.randn(8), torch.randn(4)
    buffer = torch.empty(64, dtype=torch.uint8)
    out = torch.empty(0).set_(buffer.untyped_storage(), 2, (2, 3), (3, 1))
    outputs = (out, x, x[1:], w, w[1:], out, torch.empty(0, 2))
    graph, _ = build([x], Plan(), outputs=outputs, held=[w], owned=[buffer], **{policy: True})
    y = torch.randn(8)
    mine, arg, view, held, held_view, again, empty = graph.replay(y)
    assert arg is y and held is w and again is mine and type(held) is torch.Tensor
    assert view._base is y and held_view.data_ptr() == w.data_ptr() + 4 and empty.shape == (0, 2)
    assert all(type(t) is torch.Tensor for t in (arg, view, held, held_view, empty))
    if policy == "clone_outputs":
        assert mine.data_ptr() != out.data_ptr() and type(mine) is torch.Tensor and torch.equal(mine, out)
    else:
        assert isinstance(mine, graph_module.StaleGuardTensor) and mine.data_ptr() == out.data_ptr()
    held_view.fill_(7.0)  # as eagerly: a write through a view of the global reaches it
    assert torch.equal(w[1:], torch.full((3,), 7.0))


@pytest.mark.parametrize(
    "resize",
    [
        lambda t: t.resize_(100),
        lambda t: t.untyped_storage().resize_(0),
        lambda t: (t.resize_(1), t.resize_(100)),  # smaller (stays), then larger (moves)
        lambda t: (t.untyped_storage().resize_(0), t.untyped_storage().resize_(64)),  # its size back, elsewhere
    ],
)
def test_a_resized_output_of_a_graph_keeping_its_memory_spoils_the_graph(replay_step, resize):
    """Without slots a graph's copies write its own buffer: a caller who resizes an output moves
    the storage and gives the old memory back to the allocator, which the graph must never write
    again. The replay declines every call from then on (before launching) and says so, for the
    session to drop the graph and record the key again."""
    graph, sim, recorded = _owning()
    if replay_step == "c":
        assert graph.step_refused is None
    out = graph.replay(torch.randn(8))[0]
    assert out is not recorded and out.data_ptr() == recorded.data_ptr()  # a fresh object, the same memory
    out.unsqueeze_(0)
    again = graph.replay(torch.randn(8))[0]
    assert again.shape == (2, 3) and again.stride() == (3, 1) and graph.spoiled is None
    launched = len(sim.launched)
    resize(again)
    if not graph.own_lanes[0].moved():
        pytest.skip("the allocator gave the storage its old memory back: it is the graph's again")
    assert graph.replay(torch.randn(8)) is MISMATCH and graph.replay(torch.randn(8)) is MISMATCH
    assert len(sim.launched) == launched and graph.spoiled


def test_a_graph_keeping_its_memory_waits_for_the_streams_callers_read_it_on(replay_step, monkeypatch):
    """Without slots the graph's own output buffer is what its next replay writes: a stream a
    caller named with record_stream is waited for first, as a slot's (once)."""
    from replay import output_slots

    waits = []

    def wait(readers, stream, device):
        waits.append((list(readers), len(sim.launched)))
        readers.clear()

    monkeypatch.setattr(output_slots, "wait_for_readers", wait)
    graph, sim, _recorded = _owning()
    output_slots._watch(graph.own_lanes[0])  # (the CPU's buffers are not watched of themselves)
    out = graph.replay(torch.randn(8))[0]
    reader = object()
    output_slots.note_reader(out.t(), reader)
    assert graph.readers == [reader]
    launched = len(sim.launched)
    graph.replay(torch.randn(8))
    graph.replay(torch.randn(8))
    assert waits == [([reader], launched)] and len(sim.launched) == launched + 2


def test_generated_source_holds_no_user_names_or_reprs():
    x = torch.randn(8)
    graph, _ = build([x, Dynamic(1.0)], scalar_plan(), outputs={"secret_name": x, "k": "literal text"})
    assert "secret_name" not in graph.source and "literal text" not in graph.source and "step" not in graph.source
    import linecache

    filename = graph.replay.__code__.co_filename
    assert linecache.getlines(filename) == graph.source.splitlines(True)


def test_verification_copies_keep_the_inputs_aliasing():
    base = torch.randn(16)
    a, b = base[:8], base[4:12]
    copies = clone_preserving_sharing([a, b, 3])
    copies[0].add_(1)
    assert torch.equal(copies[1][:4], b[:4] + 1)  # the overlap moved with the write
    assert torch.equal(base[:8], a) and copies[2] == 3


def test_an_interrupt_after_the_driver_took_an_update_is_repaired_by_the_next_replay():
    x, y = torch.randn(8), torch.randn(8)
    graph, sim = build([x], Plan(pointers=[PointerBinding(0, 0, 0, 0, 0, 0)]))
    graph.replay(x)
    sim.interrupt_after_next_set = True
    with pytest.raises(KeyboardInterrupt):
        graph.replay(y)
    assert struct.unpack_from("<Q", sim.params[0])[0] == y.data_ptr()  # the node holds y now
    graph.replay(x)  # x is what was last remembered before: it must be pushed again
    assert node_pointer(sim) == x.data_ptr()


# --- output slots (replay.output_slots): the generated code's side ----------------------------


class SlotSimBackend(SimBackend):
    """The simulated exec, with its output copies retargetable: a launch 'copies' its launch
    number into each copy's current destination (found among the slots' lanes)."""

    def __init__(self, sim: SimExec, lanes_by_address) -> None:
        super().__init__(sim)
        self.destinations: dict[int, int] = {}  # memcpy node -> its destination now
        self.retargeted = 0
        lanes = lanes_by_address
        destinations = self.destinations

        def launch():
            sim.launch()
            for address in destinations.values():
                lane = lanes(address)
                if lane is not None:
                    lane.buffer.view(torch.float32).fill_(float(len(sim.launched)))

        self.hot_namespace = dict(self.hot_namespace, _SIM_COPY=launch)
        self.graph_launch_template = "_SIM_COPY()"
        self._copying_launch = launch

    def graph_launch_parts(self):
        return _launched(self._copying_launch), _launch_failed

    def memcpy_retargeter(self, raw_exec, node, device):
        def set_destination(address):
            self.destinations[node.index] = address
            self.retargeted += 1

        return set_destination


class SlotSession(FakeSession):
    def __init__(self, slots, **policy):
        super().__init__(**policy)
        self.slots = slots

    def output_slots(self, region, device):
        return self.slots


def build_slotted(slots, sim, rows, *, region=None, **policy):
    """A graph of one input and two outputs in buffers of their own (as recording.own_outputs
    makes them), each written by a memcpy node: the graph adopts the region's slots."""
    from replay.output_slots import OutputSlots  # noqa: F401 (the type the session hands out)

    x = torch.randn(rows, 4)
    spec, flat, paths = region_keys.flatten((x,), {})
    key = region_keys.region_key(-1, spec, flat, paths)
    wide, narrow = torch.empty(rows * 8, dtype=torch.uint8), torch.empty(rows * 4 + 4, dtype=torch.uint8)
    out_wide = torch.empty(0).set_(wide.untyped_storage(), 0, (rows, 2), (2, 1))
    out_narrow = torch.empty(0).set_(narrow.untyped_storage(), 1, (rows,), (1,))  # at an offset
    nodes = [
        GraphNode(0, None, "kernel", 0xF, (4, 1, 1), (64, 1, 1), 0),
        GraphNode(1, None, "memcpy", pointers=(0x1000, wide.data_ptr())),
        GraphNode(2, None, "memcpy", pointers=(0x2000, narrow.data_ptr())),
    ]
    capture = attrs.make_class(
        "Capture",
        ["graph", "device", "plan", "staged", "copied_back", "memory", "nodes", "records", "outputs", "inputs"]
        + ["input_dtypes", "dynamic_values", "owned_outputs", "output_bytes"],
    )(
        FakeTorchGraph(sim),
        -1,
        Plan(),
        {},
        set(),
        0,
        nodes,
        [Record(LAYOUT, struct.pack("<Qfxxxxq", x.data_ptr(), 1.0, 7))],
        (out_wide, out_narrow),
        [InputRange(0, paths[0], x.data_ptr(), x.data_ptr() + region_keys.extent_bytes(x))],
        {0: x.dtype},
        {},
        {wide.data_ptr(), narrow.data_ptr()},
        wide.numel() + narrow.numel(),
    )
    region = region or FakeRegion(key)
    region.entries[key] = attrs.make_class("E", {"generation": attrs.field(default=0)})()
    graph = RecordedGraph(region, key, capture, spec, flat, paths, SlotSession(slots, **policy), 0)
    return graph, region


def slot_setup():
    from replay.output_slots import OutputSlots

    slots = OutputSlots(lambda size: torch.empty(size, dtype=torch.uint8))

    def lane_at(address):
        for slot in slots.slots:
            for lane in slot.lanes:
                if lane.address == address and not slot.freed:
                    return lane
        return None

    sim = SimExec()
    return slots, sim, SlotSimBackend(sim, lane_at)


def test_a_slotted_graph_hands_out_fresh_views_of_its_slot_with_the_recorded_layouts():
    slots, sim, backend = slot_setup()
    with use_backend(backend):
        graph, _ = build_slotted(slots, sim, 4)
        assert graph.output_slots is slots and graph.slot_need == (32, 20) and graph.output_memory == {}
        first = graph.replay(torch.randn(4, 4))
        second_x = torch.randn(4, 4)
    assert "_o = _choose(_me" in graph.source and "_retarget(_o)" in graph.source
    (slot,) = slots.slots
    assert [lane.size for lane in slot.lanes] == [512, 512]
    wide, narrow = first
    assert wide.shape == (4, 2) and wide.stride() == (2, 1) and wide.storage_offset() == 0
    assert narrow.shape == (4,) and narrow.storage_offset() == 1  # as in its own buffer
    assert wide.untyped_storage().data_ptr() == slot.lanes[0].address
    assert narrow.untyped_storage().data_ptr() == slot.lanes[1].address  # a storage each, as eagerly
    assert torch.equal(wide, torch.full((4, 2), 1.0)) and backend.retargeted == 2
    with use_backend(backend):
        again = graph.replay(second_x)
    assert again[0] is not wide and again[0].data_ptr() == wide.data_ptr()  # fresh views, same memory
    assert torch.equal(wide, torch.full((4, 2), 2.0))  # its own previous output: overwritten
    assert backend.retargeted == 2  # the same slot: no node update


def test_another_graphs_held_output_sends_a_replay_to_another_slot_and_back_when_dropped():
    slots, sim, backend = slot_setup()
    with use_backend(backend):
        g4, region = build_slotted(slots, sim, 4)
        g8, _ = build_slotted(slots, sim, 8, region=region)
        held = g4.replay(torch.randn(4, 4))[0]  # launch 1, slot A
        out8 = g8.replay(torch.randn(8, 4))  # slot A is held: a new slot B, lanes as large as both need
        assert len(slots.slots) == 2 and out8[0].data_ptr() != held.data_ptr()
        assert torch.equal(held, torch.full((4, 2), 1.0))  # untouched by the other graph
        del out8
        out4 = g4.replay(torch.randn(4, 4))  # its own slot A again
        assert out4[0].data_ptr() == held.data_ptr()
        del held, out4
        patches = backend.retargeted
        g8.replay(torch.randn(8, 4))  # B: still its own
        assert backend.retargeted == patches
        g4.replay(torch.randn(4, 4))  # A, free
        kept = g8.replay(torch.randn(8, 4))[1]  # B
        g4.replay(torch.randn(4, 4))  # A
        b = g8.replay(torch.randn(8, 4))[1]
        assert b.data_ptr() == kept.data_ptr()  # its own slot, overwriting its own output
    assert len(slots.slots) == 2


def test_graphs_taking_turns_in_one_slot_never_write_an_output_someone_holds():
    """Two graphs whose copies point at the same slot take it in turns while nobody holds
    their outputs (the replay's inline rule, no call of choose); once one graph's output is
    held, the other's replay goes to another slot, and the held output keeps its values."""
    slots, sim, backend = slot_setup()
    with use_backend(backend):
        g4, region = build_slotted(slots, sim, 4)
        g8, _ = build_slotted(slots, sim, 8, region=region)
        g4.replay(torch.randn(4, 4))  # slot A
        g8.replay(torch.randn(8, 4))  # A is free: g8's copies point there too
        (shared,) = slots.slots
        assert g4.bound_slot is shared and g8.bound_slot is shared
        for _ in range(3):  # turns in A, no new slot, no retarget
            patches = backend.retargeted
            g4.replay(torch.randn(4, 4))
            g8.replay(torch.randn(8, 4))
            assert backend.retargeted == patches and slots.slots == [shared]
        held = g4.replay(torch.randn(4, 4))[0]
        before = held.clone()
        out8 = g8.replay(torch.randn(8, 4))  # A holds g4's output: another slot
        assert len(slots.slots) == 2 and g8.bound_slot is not shared
        assert out8[0].untyped_storage().data_ptr() != held.untyped_storage().data_ptr()
        assert torch.equal(held, before)
        assert held.untyped_storage().data_ptr() == shared.lanes[0].address


def test_an_argument_in_the_slot_a_replay_would_write_declines_the_call():
    slots, sim, backend = slot_setup()
    with use_backend(backend):
        graph, _ = build_slotted(slots, sim, 4)
        wide, _narrow = graph.replay(torch.randn(4, 4))
        fed = torch.as_strided(wide, (4, 4), (0, 0))  # its own output passed back in
        assert graph.replay(fed) is MISMATCH
        launched = len(sim.launched)
        assert graph.replay(torch.randn(4, 4)) is not MISMATCH and len(sim.launched) == launched + 1


def test_a_failed_retarget_is_retried_on_the_next_replay():
    slots, sim, backend = slot_setup()
    with use_backend(backend):
        g4, region = build_slotted(slots, sim, 4)
        g8, _ = build_slotted(slots, sim, 8, region=region)
        held = g4.replay(torch.randn(4, 4))
        fail = [True]
        original = g8.retargets[0][0]

        def flaky(address):
            if fail[0]:
                fail[0] = False
                raise DriverError("cuGraphExecMemcpyNodeSetParams", 1, "refused")
            original(address)

        g8.retargets[0] = (flaky, 0)
        with pytest.raises(DriverError):
            g8.replay(torch.randn(8, 4))
        assert g8.bound_slot is None and g8.slot is None  # nothing launched, nothing marked written
        out = g8.replay(torch.randn(8, 4))
        assert g8.bound_slot is g8.slot and out[0].data_ptr() == g8.slot.lanes[0].address
        del held


def test_a_released_graph_writes_no_slot_and_its_held_outputs_stay():
    slots, sim, backend = slot_setup()
    with use_backend(backend):
        graph, _ = build_slotted(slots, sim, 4)
        wide, _ = graph.replay(torch.randn(4, 4))
        (slot,) = slots.slots
        graph.release()
    assert slot.writer is None and graph.slot is None and slot.held()
    assert torch.equal(wide, torch.full((4, 2), 1.0))


def test_a_replay_notes_the_stream_it_wrote_its_slot_from():
    slots, sim, backend = slot_setup()
    backend.hot_namespace = dict(backend.hot_namespace, _current_stream=lambda device: 77)
    with use_backend(backend):
        graph, _ = build_slotted(slots, sim, 4)
        graph.replay(torch.randn(4, 4))
    assert slots.slots[0].streams == {77}  # a slot freed later lets the allocator wait for it


@pytest.mark.parametrize(
    "resize",
    [
        lambda t: t.resize_(200),
        lambda t: (t.resize_(1), t.resize_(200)),  # smaller (the storage stays), then larger
        lambda t: t.untyped_storage().resize_(0),
        lambda t: (t.untyped_storage().resize_(0), t.untyped_storage().resize_(512)),
    ],
)
def test_a_slot_whose_storage_a_caller_resized_is_never_written_again(replay_step, resize):
    """``out.resize_(n)`` moves the storage ``out`` shares with its slot's lane, and gives the
    lane's memory back to the allocator: the graph's next replay (C step or generated function)
    writes another slot, and the moved memory, the caller's now, keeps what the caller put there."""
    slots, sim, backend = slot_setup()
    with use_backend(backend):
        graph, _ = build_slotted(slots, sim, 4)
        if replay_step == "c":
            assert isinstance(graph.replay, graph_module.ReplayStep)
        out = graph.replay(torch.randn(4, 4))[0]
        moved = graph.slot
        resize(out)
        if not moved.moved():
            pytest.skip("the allocator gave the storage its old memory back: it is the slot's again")
        storage = out.untyped_storage()  # the caller's memory now: filled with its own values
        if not storage.nbytes():
            storage.resize_(2048)
        mine = torch.empty(0).set_(storage, 0, (storage.nbytes() // 4,), (1,)).fill_(-7.0)
        for _ in range(3):
            again = graph.replay(torch.randn(4, 4))
            assert graph.slot is not moved and graph.bound_slot is graph.slot and again[0].shape == (4, 2)
            assert again[0].untyped_storage().data_ptr() != storage.data_ptr()
    assert moved.freed and moved not in slots.slots and moved.lanes[0].storage is None
    assert bool((mine == -7.0).all())  # never written by a replay


def test_slots_serve_only_the_mode_they_were_allocated_in(replay_step):
    """A region recorded under inference mode and under no_grad: their graphs share the region's
    slots, but an inference tensor handed to a no_grad call cannot be saved for backward, where
    eager's output can. So each mode's replays get slots of their own, even when the other's
    are free."""
    slots, sim, backend = slot_setup()
    weight = torch.randn(2, requires_grad=True)
    with use_backend(backend):
        with torch.inference_mode():
            inference, region = build_slotted(slots, sim, 4)
            out = inference.replay(torch.randn(4, 4))[0]
            assert out.is_inference()
            del out
        with torch.no_grad():
            plain, _ = build_slotted(slots, sim, 4, region=region)
            out = plain.replay(torch.randn(4, 4))[0]
        assert len(slots.slots) == 2 and plain.slot is not inference.slot  # the free inference slot is not taken
        assert not out.is_inference()
        (out * weight).sum().backward()  # saved for backward, as eager's output is
        assert weight.grad is not None
        with torch.inference_mode():
            assert inference.replay(torch.randn(4, 4))[0].is_inference()


def test_a_replay_waits_for_the_streams_callers_read_its_slot_on(replay_step, monkeypatch):
    """``out.record_stream(s)`` makes the allocator keep eager memory until ``s`` is done with it;
    a slot nobody holds is written by the next replay at once. So the wrapped record_stream notes
    ``s`` on the slot, and the replay that writes the slot next makes its stream wait for ``s``
    first (before its launch), once."""
    from replay import output_slots

    waits = []

    def wait(readers, stream, device):
        waits.append((list(readers), stream, len(sim.launched)))
        readers.clear()

    monkeypatch.setattr(output_slots, "wait_for_readers", wait)
    slots, sim, backend = slot_setup()
    backend.hot_namespace = dict(backend.hot_namespace, _current_stream=lambda device: 5)
    with use_backend(backend):
        g4, region = build_slotted(slots, sim, 4)
        g8, _ = build_slotted(slots, sim, 8, region=region)
        out = g4.replay(torch.randn(4, 4))
        for lane in g4.slot.lanes:
            output_slots._watch(lane)  # (the CPU's lanes are not watched of themselves)
        reader, other = object(), object()
        output_slots.note_reader(out[0][1:], reader)  # a view of it, read on another stream
        output_slots.note_reader(out[1], reader)  # twice: once
        output_slots.note_reader(torch.randn(3), other)  # not output memory: nothing
        assert g4.slot.readers == [reader]
        del out
        g8.replay(torch.randn(8, 4))  # the free slot: written after the reader is done
        assert waits == [([reader], 5, 1)] and g8.slot.readers == []
        g8.replay(torch.randn(8, 4))
        assert len(waits) == 1


def test_a_slot_is_told_each_stream_that_writes_it_once(replay_step, monkeypatch):
    from replay import output_slots

    told = []
    monkeypatch.setattr(
        output_slots.Slot, "written_from", lambda slot, stream: (told.append(stream), slot.streams.add(stream))
    )
    streams = iter([77, 77, 78, 77, 78])
    slots, sim, backend = slot_setup()
    backend.hot_namespace = dict(backend.hot_namespace, _current_stream=lambda device: next(streams))
    with use_backend(backend):
        graph, _ = build_slotted(slots, sim, 4)
        for _ in range(5):
            graph.replay(torch.randn(4, 4))
    assert told == [77, 78] and slots.slots[0].streams == {77, 78}


def test_a_released_graph_tells_the_allocator_the_stream_of_its_last_replay(replay_step, monkeypatch):
    """A graph's staged buffers (and own output memory) go with it while its last replay may
    still use them: its release tells the allocator that replay's stream, which waited for every
    one before it."""
    from replay import output_slots

    recorded = []
    monkeypatch.setattr(output_slots, "record_on", lambda tensors, stream: recorded.append((list(tensors), stream)))
    streams = iter([77, 78])
    buffer = torch.empty(8)
    sim = SimExec()
    backend = SimBackend(sim)
    backend.hot_namespace = dict(backend.hot_namespace, _current_stream=lambda device: next(streams))
    with use_backend(backend):
        graph, _ = build([torch.randn(8), Dynamic(1.0)], scalar_plan(), staged={0: buffer}, sim=sim, backend=backend)
        assert graph.stream is None
        graph.replay(torch.randn(8), Dynamic(2.0))
        graph.replay(torch.randn(8), Dynamic(2.0))
    assert graph.stream == 78
    graph.release()
    assert len(recorded) == 1 and recorded[0][1] == 78 and recorded[0][0][0] is buffer


def test_recordings_that_name_their_constants_apart_generate_one_text_and_compile_it_once(monkeypatch):
    # a recording names a dynamic scalar's constants by process-wide counters (_k7, _lit3);
    # renamed per function, two recordings of one region at two shapes generate one text
    # (compiled once), and each graph still evaluates its own constants
    from jitcore import generated

    compiled = []
    real_compile = generated.builtins.compile

    def counting(source, *rest, **options):
        compiled.append(source)
        return real_compile(source, *rest, **options)

    monkeypatch.setattr(generated.builtins, "compile", counting)
    graphs = []
    row = 16 * 4
    for rows, (name, value, literal) in ((64, ("_k41", 3, "_lit9")), (32, ("_k97", 5, "_lit12"))):
        cache = torch.randn(rows, 16)
        scalar = DynamicScalar(f"(_d1 + {name})", 3 + value, "args[1] + k", {name: value})
        binding = PointerBinding(
            0, 0, 0, 0, 0, 0, dynamic=True, recorded_offset=0, offset_evaluate=lambda s: s[1] * row
        )
        plan = Plan(
            pointers=[binding],
            arguments={0: (None, f"(_d1 + {name})", literal)},
            constants={name: value, literal: 7},
        )
        graphs.append(build([cache, Dynamic(3)], plan, outputs=(cache, scalar)))
    (first, first_sim), (second, second_sim) = graphs
    assert first.source == second.source
    assert "_k41" not in first.source and "_lit9" not in first.source
    assert sum("def replay_graph" in source for source in compiled) <= 1  # the second reused the first's code
    cache = torch.randn(64, 16)
    assert first.replay(cache, Dynamic(2))[1] == 2 + 3  # each its own constant
    assert node_pointer(first_sim) == cache.data_ptr() + (2 + 3) * 16 * 4
    small = torch.randn(32, 16)
    assert second.replay(small, Dynamic(1))[1] == 1 + 5
    assert node_pointer(second_sim) == small.data_ptr() + (1 + 5) * 16 * 4


# --- csrc/replay_step.c against the generated function ------------------------------------------


def test_the_c_step_serves_what_it_runs_and_says_why_it_leaves_the_rest_to_python(replay_step):
    x = torch.randn(8)
    plan = scalar_plan()
    plan.pointers.append(PointerBinding(0, 0, 0, 0, 0, 16))
    graph, _ = build([x, Dynamic(1.0)], plan)
    if replay_step == "c":
        assert isinstance(graph.replay, graph_module.ReplayStep) and graph.step_refused is None
        assert graph.replay.fallback.__code__.co_filename.startswith("<")  # the generated function
    else:
        assert not isinstance(graph.replay, graph_module.ReplayStep)
        assert "torch-side helper" in graph.step_refused or "JITCORE_NATIVE=0" in graph.step_refused
    offset = Plan(
        pointers=[PointerBinding(0, 0, 0, 0, 0, 0, True, 0, lambda s: 4 * s[1])], arguments={0: (None, "_d1")}
    )
    graph, _ = build([x, Dynamic(1)], offset)  # a pointer offset computed per call: Python's
    assert not isinstance(graph.replay, graph_module.ReplayStep)
    if replay_step == "c":
        assert graph.step_refused == "pointer offsets computed per call"


def _both_ways(leaves, plan, helper):
    """The same recording as a C step and as the generated function alone, each over its own
    simulated exec."""
    from jitcore import torch_native

    made = []
    for chosen in (helper, None):
        with torch_native.using(chosen):
            made.append(build(leaves, plan, sim=SimExec()))
    return made


_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e39, -1e39, float("nan"), 3.0]),
    st.integers(min_value=-(2**70), max_value=2**70),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    computed=st.booleans(),
    steps=st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 4), _VALUES, st.booleans()),
        min_size=1,
        max_size=12,
    ),
)
def test_the_c_step_does_what_the_generated_function_does_call_for_call(torch_native_helper, computed, steps):
    """Random calls (pointers rebound, aliasing arguments, scalars that differ only in bits or
    do not fit, failed node updates) to a C step and to the generated function alone: the same
    answers, the same exceptions, the same node parameters launched, the same remembered
    values and counts after every call. The scalar is the dynamic value itself, or computed
    from it by an expression with a named constant (which raises for 0: the call declines)."""
    base = torch.randn(64)
    pool = [base[:16], base[16:32], base[8:24], torch.randn(16), torch.randn(16)]
    plan = Plan(
        pointers=[PointerBinding(0, 0, 0, 0, 0, 16), PointerBinding(0, 0, 0, 0, 1, 0)],
        scalars=[ScalarBinding(0, 0, 1, 8, "f", lambda s: s[1])],
        arguments={0: (None, "(_k9 / _d2)" if computed else "_d2")},
        constants={"_k9": 3.0},
    )
    (c_graph, c_sim), (py_graph, py_sim) = _both_ways([pool[0], pool[1], Dynamic(1.0)], plan, torch_native_helper)
    assert isinstance(c_graph.replay, graph_module.ReplayStep), c_graph.step_refused
    assert not isinstance(py_graph.replay, graph_module.ReplayStep)
    for first, second, value, fail in steps:
        answers = []
        for graph, sim in ((c_graph, c_sim), (py_graph, py_sim)):
            sim.fail_next_set = int(fail)
            with use_backend(SimBackend(sim)):
                try:
                    result = graph.replay(pool[first], pool[second], Dynamic(value))
                    answers.append(("mismatch" if result is MISMATCH else "replayed", None))
                except Exception as error:  # compared below, not swallowed
                    answers.append(("raised", type(error)))
            sim.fail_next_set = 0
        assert answers[0] == answers[1]
        assert c_sim.params == py_sim.params and len(c_sim.launched) == len(py_sim.launched)
        assert c_sim.launched == py_sim.launched
        c_last, py_last = c_graph.namespace["_last"], py_graph.namespace["_last"]
        assert [v if isinstance(v, (int, bytes)) else "unknown" for v in c_last] == [
            v if isinstance(v, (int, bytes)) else "unknown" for v in py_last
        ]
        assert (c_graph.replays, c_graph.session.counters.patches) == (
            py_graph.replays,
            py_graph.session.counters.patches,
        )


def test_the_c_step_sees_a_slot_held_exactly_when_the_slot_says_so(replay_step):
    """The C step answers Slot.held() itself for the slot it is bound to (csrc/replay_step.c): the
    same answer as the method whatever still reaches an output (the tensor, a view, its
    storage object alone, a DLPack capsule), and nothing held once they are gone."""
    if replay_step != "c":
        pytest.skip("the C step's own answer")
    from replay import _step

    slots, sim, backend = slot_setup()
    with use_backend(backend):
        graph, _ = build_slotted(slots, sim, 4)
        step = graph.replay
        assert isinstance(step, graph_module.ReplayStep)
        keepers = {
            "nothing": lambda out: None,
            "the output": lambda out: out,
            "a view of it": lambda out: out[1:],
            "its storage object": lambda out: out.untyped_storage(),
            "a DLPack capsule": lambda out: torch.utils.dlpack.to_dlpack(out),
            "its storage's data pointer only": lambda out: out.untyped_storage().data_ptr(),
        }
        for what, keep in keepers.items():
            kept = keep(step(torch.randn(4, 4))[0])
            slot = graph.slot
            assert _step.held(step, slot) == slot.held(), what
            assert slot.held() == (what not in ("nothing", "its storage's data pointer only")), what
            del kept
            assert _step.held(step, slot) is False and slot.held() is False, what


def test_a_dump_says_how_each_graph_replays(replay_step):
    x = torch.randn(8)
    graph, _ = build([x, Dynamic(1.0)], scalar_plan())
    line = graph.how_it_replays()
    if replay_step == "c":
        assert line.startswith("replayed by csrc/replay_step.c")
    else:
        assert line.startswith("replayed by this function alone: ") and graph.step_refused in line
    assert graph.full_source() == graph.source  # its arguments are the dynamic value itself
    computed = Plan(
        scalars=[ScalarBinding(0, 0, 1, 8, "f", lambda s: s[1])],
        arguments={0: (None, "(_k9 / _d1)")},
        constants={"_k9": 3.0},
    )
    graph, _ = build([x, Dynamic(1.0)], computed)
    if replay_step == "c":  # the C step's generated argument function is shown with the replay's
        assert "def step_arguments(_d1):" in graph.full_source() and "_k9" not in graph.full_source()


def test_the_c_step_leaves_what_its_reader_does_not_read_to_the_generated_function(torch_native_helper):
    """A tensor subclass (a Parameter), a call under a torch function mode and keyword
    arguments are run by the generated function itself: the same node parameters and answers
    as the generated function alone."""
    from torch.overrides import TorchFunctionMode

    class Counting(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.randn(16)
    plan = scalar_plan()
    plan.pointers.append(PointerBinding(0, 0, 0, 0, 0, 16))
    (c_graph, c_sim), (py_graph, py_sim) = _both_ways([x, Dynamic(1.0)], plan, torch_native_helper)
    assert isinstance(c_graph.replay, graph_module.ReplayStep)
    for argument in (torch.nn.Parameter(torch.randn(16)), torch.randn(16)):
        for mode in (contextlib.nullcontext(), Counting()):
            answers = []
            for graph, sim in ((c_graph, c_sim), (py_graph, py_sim)):
                with use_backend(SimBackend(sim)), mode:
                    answers.append(graph.replay(argument, Dynamic(2.5)) is MISMATCH)
            assert answers[0] == answers[1]
            assert c_sim.params == py_sim.params and len(c_sim.launched) == len(py_sim.launched) > 0
    y = torch.randn(16)
    for graph, sim in ((c_graph, c_sim), (py_graph, py_sim)):  # keywords: the generated function's call
        with use_backend(SimBackend(sim)):
            assert graph.replay(l0=y, l1=Dynamic(4.0)) is not MISMATCH
    assert c_sim.params == py_sim.params and node_pointer(c_sim) == y.data_ptr() + 16


def test_a_staged_input_sharing_its_storage_with_a_fixed_address_is_declined(replay_step):
    """A staged input whose storage holds an address the graph's nodes keep fixed (a global
    that holds the argument, recorded while the argument was a tensor of its own) is
    declined, by the C step as by the generated function; other tensors, views of other
    storages among them, replay. Where a node's addresses could not be read, a staged input
    must be its storage's whole."""
    from replay.rebinding import NodeView

    x, cache, other = torch.randn(8), torch.randn(4, 8), torch.randn(4, 8)
    weight = torch.randn(16)
    global_node = NodeView(0, "kernel", 0xF, (struct.pack("<QQ", cache.data_ptr(), weight.data_ptr()),))
    graph, sim = build([x, Dynamic(1.0)], scalar_plan(), staged={0: torch.empty(8)}, node_views=[global_node])
    assert {cache.data_ptr(), weight.data_ptr()} <= set(graph.fixed_addresses)
    if replay_step == "c":
        assert isinstance(graph.replay, graph_module.ReplayStep)
    assert graph.replay(torch.randn(8), Dynamic(2.0)) is not MISMATCH
    assert graph.replay(other[2], Dynamic(2.0)) is not MISMATCH  # a view, of a storage the graph never reaches
    launched = len(sim.launched)
    for held in (cache[0], cache[3], weight[:8]):
        assert graph.replay(held, Dynamic(2.0)) is MISMATCH
    assert len(sim.launched) == launched  # declined before anything ran

    unread, _ = build([x, Dynamic(1.0)], scalar_plan(), staged={0: torch.empty(8)}, node_views=None)
    assert unread.fixed_addresses is None
    if replay_step == "c":
        assert unread.step_refused == "staged inputs of a graph whose addresses were not all read"
    assert unread.replay(torch.randn(8), Dynamic(2.0)) is not MISMATCH
    assert unread.replay(other[2], Dynamic(2.0)) is MISMATCH


def test_one_object_passed_twice_and_returned_is_served_only_passed_twice(replay_step):
    """``step(x, x)`` returning ``x``: which argument the region returns cannot be told, so the
    graph serves calls passing one object twice (returning it) and declines distinct objects
    over the same memory, which the aliasing check alone would take."""
    x = torch.randn(8)
    graph, sim = build([x, x], Plan(), outputs=(x,))
    y = torch.randn(8)
    assert graph.replay(y, y)[0] is y
    launched = len(sim.launched)
    assert graph.replay(y, y.view(y.shape)) is MISMATCH and graph.replay(y.view(8), y) is MISMATCH
    assert len(sim.launched) == launched


def test_a_view_of_an_argument_is_found_where_it_was_when_recorded(replay_step):
    """The recording call's argument may have its storage moved by the caller (``resize_``)
    before the graph is built: a view of it returned by the region is still classified by where
    it was when the region ran, a view of the argument, rebuilt on each call's argument."""
    x = torch.randn(8)
    graph, _ = build([x], Plan())
    outputs = (x[2:],)
    identity = output_identity.with_memory(output_identity.identify(outputs, {0: x}), outputs, set())
    x.untyped_storage().resize_(4096)  # the argument, and the view with it, moved
    (view,) = graph._classify_outputs(list(outputs), identity)
    assert isinstance(view, graph_module.InputView) and view.input == 0 and view.delta == 2 and not view.whole


# --- a capture shaped like the decode sample's (tests/replay/sample_capture.py) ------------------


def test_a_sample_shaped_graph_rebinds_every_argument_and_shares_its_code_across_batch_sizes():
    """Jit launches over ten arguments, a cuBLAS-like node per matmul, the logits copied into
    an output slot: each replay writes the new arguments' pointers into every node bound to
    them, and the graphs of two batch sizes are one text (one compiled code, their values in
    their namespaces)."""
    from tests.replay import sample_capture

    graphs = []
    for batch in (4, 6):
        slots, sim, backend = slot_setup()  # an exec each
        with use_backend(backend):
            sample = sample_capture.sample_capture(batch)
            plan = sample_capture.plan(sample)
            assert len(plan.pointers) >= 17 and not plan.needs_staging and plan.failure is None
            capture = sample_capture.capture_for_graph(sample, FakeTorchGraph(sim), plan)
            graph = RecordedGraph(
                FakeRegion(sample.key),
                sample.key,
                capture,
                sample.spec,
                sample.leaves,
                sample.paths,
                SlotSession(slots),
                0,
            )
            graphs.append((graph, batch))
            for _ in range(2):
                arguments = sample_capture.arguments(batch)
                out = graph.replay(*arguments)
                assert out.shape == (batch, sample_capture.WIDTH)
                launched = sim.launched[-1]
                for binding in graph.plan.pointers:
                    pointer = struct.unpack_from("<Q", launched[binding.node][0], binding.offset)[0]
                    assert pointer == arguments[binding.input].data_ptr() + binding.delta
    (first, _), (second, _) = graphs
    assert first.source == second.source
    assert first.namespace["_e0"] != second.namespace["_e0"]  # the token batch's extent, a value
