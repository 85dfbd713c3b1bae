"""Host (CPU) tensor inputs on the CPU: what the observer refuses, how the generated replay
fills the pinned buffers (against the simulated graph exec of test_graph.py), and the node
checks. The GPU tests (test_hazards_gpu.py, test_replay_gpu.py) capture for real."""

from __future__ import annotations

import re
import struct
import types

import attrs
import pytest
import torch

from jitcore.backends import use_backend
from jitcore.backends.base import GraphNode
from replay import host as host_inputs
from replay import output_identity, recording, region_keys
from replay.graph import MISMATCH, RecordedGraph
from replay.host import HostInputs, blocking_rewrite, host_use_refusal
from replay.observe import TorchOpObserver
from replay.rebinding import InputRange, NodeView, Plan, PointerBinding
from tests.replay.test_graph import LAYOUT, FakeRegion, FakeSession, FakeTorchGraph, Record, SimBackend, SimExec

aten = torch.ops.aten


# --- the observer: only plain copies to a device tensor may touch a host buffer ------------------
def observe(host: torch.Tensor, body, rewrite: bool = False) -> TorchOpObserver:
    """Run ``body(host)`` under an observer watching ``host`` as a staged host input. The
    "meta" device stands in for the GPU: a copy to it reads nothing on the CPU, as a copy to
    the GPU is a memcpy node."""
    observer = TorchOpObserver([], [(3, region_keys.byte_range(host))], {3: "args[3]"}.get, rewrite)
    with observer:
        body(host)
    return observer


ALLOWED = {
    "to the device": lambda h: h.to("meta"),
    "to the device, non_blocking": lambda h: h.to("meta", non_blocking=True),
    "a transposed dense host tensor": lambda h: h.t().to("meta"),
    "copy_ into a device tensor": lambda h: torch.empty(h.shape, dtype=h.dtype, device="meta").copy_(h),
    "a view of it copied": lambda h: h[1:].to("meta"),
    "metadata only": lambda h: (torch.empty_like(h), h.view(-1), h.shape, h.stride(), h.is_pinned()),
}


@pytest.mark.parametrize("name", ALLOWED)
def test_copies_to_the_device_and_metadata_are_not_refused(name):
    observer = observe(torch.arange(12, dtype=torch.int64).reshape(3, 4), ALLOWED[name])
    assert observer.host_refusals == []


REFUSED = {
    "int(host[0])": (lambda h: int(h[0, 0]), "reads host input args[3] on the CPU"),
    "host.item()": (lambda h: h[0, 0].item(), "reads host input args[3] on the CPU"),
    "host.sum()": (lambda h: h.sum(), "reads host input args[3] on the CPU"),
    "if host.any()": (lambda h: bool(h.any()), "reads host input args[3] on the CPU"),
    "a CPU op": (lambda h: h + 1, "reads host input args[3] on the CPU"),
    "a CPU dtype conversion": (lambda h: h.to(torch.float64), "reads host input args[3] on the CPU"),
    "a conversion on the way": (lambda h: h.to("meta", dtype=torch.float64), "converts its dtype or layout"),
    "a non-dense slice copied": (lambda h: h[:, ::2].to("meta"), "converts its dtype or layout"),
    "copy_ converting": (
        lambda h: torch.empty(h.shape, dtype=torch.float32, device="meta").copy_(h),
        "converts its dtype or layout",
    ),
    "written": (lambda h: h.copy_(torch.zeros_like(h)), "writes host input args[3]"),
    "written in place": (lambda h: h.add_(1), "reads host input args[3] on the CPU"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_reading_host_values_on_the_cpu_or_writing_them_is_refused(name):
    body, message = REFUSED[name]
    observer = observe(torch.arange(12, dtype=torch.int64).reshape(3, 4), body)
    assert observer.host_refusals and message in observer.host_refusals[0]


@pytest.mark.parametrize(
    "name", ["written in place", "a non-dense slice copied", "a conversion on the way", "int(host[0])"]
)
def test_inside_a_capture_a_refused_op_raises_before_it_runs(name):
    body, message = REFUSED[name]
    host = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    ran = []

    class Spy(TorchOpObserver):
        def _observed(self, func, arguments, args, kwargs):
            ran.append(func)
            return super()._observed(func, arguments, args, kwargs)

    with pytest.raises(host_inputs.HostInputRefused, match=re.escape(message)):
        with Spy([], [(3, region_keys.byte_range(host))], {3: "args[3]"}.get, True):
            body(host)
    assert not [f for f in ran if not f.is_view]  # nothing that reads or writes the host ran
    assert torch.equal(host, torch.arange(12).reshape(3, 4))


def test_ops_on_other_tensors_are_not_refused_and_device_inputs_are_still_watched():
    host = torch.arange(8)
    other = torch.randn(8)
    observer = TorchOpObserver([region_keys.byte_range(other)], [(1, region_keys.byte_range(host))], str)
    with observer:
        other.sum()
        torch.randn(3) * 2
    assert observer.host_refusals == [] and observer.read == {0}


def test_blocking_copies_are_made_non_blocking_only_when_asked():
    host = torch.arange(4)
    assert blocking_rewrite(aten._to_copy.default, (host,), {"non_blocking": False})[1]["non_blocking"] is True
    assert blocking_rewrite(aten.copy_.default, (host, host, False), {})[0][2] is True
    assert blocking_rewrite(aten.copy_.default, (host, host), {})[1]["non_blocking"] is True
    seen = []

    class Spy(TorchOpObserver):
        def _observed(self, func, arguments, args, kwargs):
            seen.append((func, args, kwargs))
            return super()._observed(func, arguments, args, kwargs)

    for rewrite, expected in ((True, True), (False, False)):
        seen.clear()
        with Spy([], [(0, region_keys.byte_range(host))], str, rewrite):
            host.to("meta", non_blocking=False)
        copies = [kwargs for func, _, kwargs in seen if func.overloadpacket is aten._to_copy]
        assert copies and copies[0].get("non_blocking", False) is expected


def test_host_use_refusal_names_the_op_and_the_input():
    host = torch.arange(4)
    message = host_use_refusal(aten.sum.default, {"self": host}, {"self": 2}, lambda i: f"leaf{i}", host.sum())
    assert "sum" in message and "leaf2" in message


def test_unsupported_host_tensors_are_named():
    assert host_inputs.unsupported_reason(torch.randn(3)) is None
    assert "conjugate" in host_inputs.unsupported_reason(torch.randn(3, dtype=torch.complex64).conj())
    assert "negative" in host_inputs.unsupported_reason(torch.randn(3, dtype=torch.complex64).conj().imag)


# --- CPU tensors the region reaches by name: their values would be baked into the graph --------
#: What a region may do with a CPU tensor it reaches by name (a global ``scale``) that a graph
#: would bake: the op reads its values on the CPU once, at the capture.
NAMED_READS = {
    "a 0-dim CPU tensor as a scalar": lambda s, x: x * s,
    "item()": lambda s, x: s.item(),
    "int()": lambda s, x: int(s),
    "a CPU op": lambda s, x: s + 1,
    "written in place": lambda s, x: s.add_(1),
    "a view of it read": lambda s, x: s.view(1).sum(),
    "a blocking copy to the device": lambda s, x: s.to("meta"),
}


@pytest.mark.parametrize("name", NAMED_READS)
def test_an_op_reading_a_cpu_tensor_the_region_reaches_by_name_refuses_the_capture_before_it_runs(name):
    scale, x = torch.tensor(2.0), torch.ones(3)
    named = host_inputs.named_host_ranges([torch.randn(2, device="meta"), torch.empty(0), scale, scale.view(1)])
    assert named == [(region_keys.byte_range(scale), False)]  # its storage, once; CPU tensors only
    with pytest.raises(host_inputs.HostInputRefused, match="a CPU tensor the region reaches by name"):
        with TorchOpObserver([], (), str, True, named=named):
            NAMED_READS[name](scale, x)
    assert scale.item() == 2.0  # refused before it ran
    observer = TorchOpObserver([], (), str, named=named)  # an observed eager run only notes it
    with observer:
        NAMED_READS[name](scale, x)
    assert len(observer.host_refusals) == 1


def test_metadata_of_a_cpu_tensor_reached_by_name_and_other_cpu_tensors_are_not_refused():
    scale = torch.arange(4.0)
    with TorchOpObserver([], (), str, True, named=host_inputs.named_host_ranges([scale])) as observer:
        torch.empty_like(scale), scale.shape, scale.view(2, 2), torch.ones(3) * 2.0, torch.randn(2).sum()
    assert observer.host_refusals == []


def test_only_a_non_blocking_copy_of_a_pinned_cpu_tensor_reached_by_name_is_replayed():
    """The graph's copy reads the memory when it runs, as the eager non-blocking copy of pinned
    memory does; a blocking copy (which a capture would rewrite) or pageable memory, read later
    by a replay than by eager, is refused."""
    t = torch.arange(4.0)
    copy = aten._to_copy.default
    for non_blocking, pinned, allowed in ((True, {-1}, True), (False, {-1}, False), (True, set(), False)):
        named = {"self": t, "device": torch.device("meta"), "non_blocking": non_blocking}
        refusal = host_inputs.named_use_refusal(copy, named, {"self": -1}, pinned)
        assert (refusal is None) is allowed
    converting = {"self": t, "dtype": torch.float64, "device": torch.device("meta"), "non_blocking": True}
    assert host_inputs.named_use_refusal(copy, converting, {"self": -1}, {-1}) is not None


def test_a_capture_observes_the_cpu_tensors_the_region_reaches_even_where_it_would_not_observe():
    scale, deep, weight = torch.tensor(2.0), torch.zeros(2), torch.randn(2, device="meta")
    held = recording.HeldTensors(named=(weight,), attributes=(scale,), watched=(deep, scale))
    prepared = recording._prepare_inputs([], [], device=0, stage=set(), held=held)
    assert prepared.named_host == host_inputs.named_host_ranges([scale, deep])
    observer = recording._observer(prepared, observe=False)
    assert isinstance(observer, TorchOpObserver) and observer.named and observer.rewrite_blocking
    nothing = recording._prepare_inputs([], [], device=0, stage=set(), held=recording.HeldTensors(named=(weight,)))
    assert not isinstance(recording._observer(nothing, observe=False), TorchOpObserver)


# --- the generated replay against a simulated exec -----------------------------------------------
class FakeEvent:
    def __init__(self, log: list, host) -> None:
        self.log, self.host = log, host

    def record(self) -> None:
        self.log.append("record")

    def synchronize(self) -> None:  # what the buffers hold when the host waits (before writing)
        self.log.append(("wait", [b.clone() for b in self.host.buffers.values()]))


class FakeHost(HostInputs):
    """HostInputs with plain (not pinned) buffers and an event that logs, for the CPU."""

    def __init__(self, tensors: dict, paths: dict, log: list) -> None:
        self.paths = paths
        self.buffers = {}
        for i, t in tensors.items():
            self.buffers[i] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
            self.fill(i, t)
        self.event = FakeEvent(log, self)
        self.launches = 0

    def _record_on(self, stream: int, device: int) -> None:
        self.event.record()

    def _wait_for_event(self) -> None:
        self.event.synchronize()


class LoggingExec(SimExec):
    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log
        self.host = None

    def launch(self) -> None:
        super().launch()
        self.log.append(("launch", [b.clone() for b in self.host.buffers.values()]))


def build_with_host(device_input: torch.Tensor, host_leaves: list, outputs=None):
    """A graph of region(x, *hosts): x rebound into node 0, the hosts staged through buffers."""
    log: list = []
    sim = LoggingExec(log)
    leaves = [device_input, *host_leaves]
    spec, flat, paths = region_keys.flatten(tuple(leaves), {})
    key = region_keys.region_key(-1, spec, flat, paths)
    host = FakeHost({i: flat[i] for i in range(1, len(flat))}, {i: paths[i] for i in range(1, len(flat))}, log)
    sim.host = host
    initial = struct.pack("<Qfxxxxq", device_input.data_ptr(), 1.0, 7)
    fields = "graph device plan staged copied_back memory nodes records outputs inputs input_dtypes dynamic_values host"
    capture = attrs.make_class("Capture", fields.split())(
        FakeTorchGraph(sim),
        -1,
        Plan(pointers=[PointerBinding(0, 0, 0, 0, 0, 0)]),
        {},
        set(),
        0,
        [GraphNode(0, None, "kernel", 0xF, (4, 1, 1), (64, 1, 1), 0)],
        [Record(LAYOUT, initial)],
        outputs,
        [InputRange(0, paths[0], *region_keys.byte_range(device_input))],
        {0: device_input.dtype, **{i: flat[i].dtype for i in host.buffers}},
        {},
        host,
    )
    with use_backend(SimBackend(sim)):
        graph = RecordedGraph(FakeRegion(key), key, capture, spec, flat, paths, FakeSession(), 0)
    return graph, log, host


def launches(log: list) -> list:
    return [entry[1] for entry in log if entry[0] == "launch"]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def fresh(dtype: torch.dtype, shape=(4, 6)) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-1000, 1000, shape).to(dtype)


LAYOUTS = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.t(),
    "sliced with gaps": lambda t: t[:, ::2],
    "a row of a larger tensor": lambda t: t[1:3],
    "very sparse (strided copy)": lambda t: torch.zeros(4, 6 * 4096, dtype=t.dtype)[:, ::4096].copy_(t),
    "expanded": lambda t: t[:1].expand(4, 6),
}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float16, torch.bool])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_replay_fills_the_buffer_with_the_callers_values_before_the_launch(dtype, layout):
    make = LAYOUTS[layout]
    x = torch.randn(8)
    graph, log, _ = build_with_host(x, [make(fresh(dtype))])
    for _ in range(5):
        ids = make(fresh(dtype))
        graph.replay(x, ids)
        at_launch = launches(log)[-1][0]
        assert same_bytes(at_launch.contiguous(), ids.contiguous())
    assert graph.source.count("_memmove(") + graph.source.count("_host_copy") == 1
    assert ("_host_copy" in graph.source) == (layout == "very sparse (strided copy)")


def test_the_host_waits_for_the_last_launch_before_writing_and_records_after_launching():
    x = torch.randn(8)
    first = torch.arange(6)
    graph, log, host = build_with_host(x, [first])
    host.launched()  # the recording call's first launch
    values = [torch.randint(0, 100, (6,)) for _ in range(4)]
    for v in values:
        graph.replay(x, v)
    events = [e if isinstance(e, str) else e[0] for e in log]
    assert events == ["record"] + ["wait", "launch", "record"] * 4
    waits = [e[1][0] for e in log if e[0] == "wait"]
    # at each wait the buffer still holds what the previous launch read
    for held, previous in zip(waits, [first, *values[:-1]]):
        assert same_bytes(held, previous)


def test_a_declined_call_leaves_the_buffer_alone():
    x = torch.randn(8)
    graph, log, host = build_with_host(x, [torch.arange(6), torch.arange(6)])
    a = torch.arange(6) * 3
    graph.replay(x, a, a + 1)
    before = [b.clone() for b in host.buffers.values()]
    shared = torch.arange(6) * 5
    assert graph.replay(x, shared, shared) is MISMATCH  # another aliasing pattern
    assert all(same_bytes(b, c) for b, c in zip(host.buffers.values(), before))
    assert len(launches(log)) == 1


def test_the_same_host_tensor_twice_fills_both_buffers():
    x = torch.randn(8)
    ids = torch.arange(6)
    graph, log, _ = build_with_host(x, [ids, ids])
    for _ in range(3):
        ids = torch.randint(0, 50, (6,))
        assert graph.replay(x, ids, ids) is not MISMATCH
        assert all(same_bytes(b, ids) for b in launches(log)[-1])


def test_views_of_a_host_buffer_are_returned_as_views_of_the_callers_tensor():
    x = torch.randn(8)
    graph, _, host = build_with_host(x, [torch.arange(6)])
    buffer = host.buffers[1]
    _, leaves, _ = region_keys.flatten(((buffer, buffer[2:]),), {}, walk_dataclasses=True)
    identity = output_identity.identify(leaves, output_identity.given_objects([x, buffer], {}, host.buffers))
    whole, view = graph._classify_outputs(leaves, identity)  # the buffer the region was given: the argument
    assert whole.input == 1 and whole.whole
    assert view.input == 1 and not view.whole and view.delta == 2
    assert "args[" not in graph.source  # no path or name reaches the generated source


# --- graph nodes that reach a host buffer ----------------------------------------------------------
def fake_host(size: int = 64) -> types.SimpleNamespace:
    buffer = torch.zeros(size, dtype=torch.uint8)
    lo = buffer.data_ptr()
    return types.SimpleNamespace(
        buffer=buffer,
        lo=lo,
        host=types.SimpleNamespace(owner=lambda a: 1 if lo <= a < lo + size else None, paths={1: "args[1]"}),
    )


def test_a_copy_from_the_host_buffer_is_fine_a_copy_into_it_is_refused():
    h = fake_host()
    device_address = 0x7000_0000_0000
    fine = [NodeView(0, "memcpy", pointers=(h.lo + 8, device_address)), NodeView(1, "kernel", 5, params=())]
    recording._refuse_host_nodes(h.host, fine, set())
    with pytest.raises(recording.CaptureFailed, match="writes host input args"):
        recording._refuse_host_nodes(h.host, [NodeView(0, "memcpy", pointers=(device_address, h.lo))], set())
    with pytest.raises(recording.CaptureFailed, match="cannot be read"):
        recording._refuse_host_nodes(h.host, [NodeView(0, "memcpy", pointers=())], set())


def test_a_foreign_kernel_reaching_the_host_buffer_is_refused_a_jit_one_is_left_to_the_capture():
    h = fake_host()
    params = (struct.pack("<Q", h.lo + 16),)
    with pytest.raises(recording.CaptureFailed, match="other than a jit launch"):
        recording._refuse_host_nodes(h.host, [NodeView(3, "kernel", 5, params=params)], set())
    with pytest.raises(recording.CaptureFailed, match="cannot be read"):
        recording._refuse_host_nodes(h.host, [NodeView(3, "kernel", 5, params=None)], set())
    recording._refuse_host_nodes(h.host, [NodeView(3, "kernel", 5, params=params)], {3})


def test_a_jit_launch_writing_the_host_buffer_is_refused():
    h = fake_host()
    param = types.SimpleNamespace(kind="pointer", read_only=False, offset=0)
    record = types.SimpleNamespace(kernel="k", params=[param], param_bytes=struct.pack("<Q", h.lo))
    prepared = types.SimpleNamespace(host=h.host)
    observation = types.SimpleNamespace(host_refusals=())
    with pytest.raises(recording.CaptureFailed, match="k writes host input args"):
        recording._refuse_host_misuse(prepared, observation, [record])
    param.read_only = True  # reading it through a pointer is reading it on the GPU: fine
    recording._refuse_host_misuse(prepared, observation, [record])
    with pytest.raises(recording.CaptureFailed, match="first"):
        recording._refuse_host_misuse(prepared, types.SimpleNamespace(host_refusals=["first", "second"]), [])
