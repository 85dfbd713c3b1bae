"""The C helper for the hot driver calls (csrc/jitcore_native.c), run on the CPU.

The driver is replaced by ctypes callbacks with the vendor prototypes (a test double for the
driver, as the guide allows in CPU tests of pure logic): each test checks what reaches the C
side and what comes back. The same calls run against the real driver in the GPU tests (the
CUDA backend uses the helper wherever it was built and libcuda loads).
"""

from __future__ import annotations

import ctypes
import shutil
import struct
import sysconfig
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jitcore.errors import DriverError

try:
    from jitcore.backends import _native
except ImportError:  # pragma: no cover - a build without a C compiler
    _native = None

needs_native = pytest.mark.skipif(_native is None, reason="the C helper was not built (no C compiler)")

UINT = ctypes.c_uint
VOIDP = ctypes.c_void_p
KERNEL_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, VOIDP, UINT, UINT, UINT, UINT, UINT, UINT, UINT, VOIDP, VOIDP, VOIDP)
GRAPH_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, VOIDP, VOIDP)
NODE_SET = ctypes.CFUNCTYPE(ctypes.c_int, VOIDP, VOIDP, VOIDP)
CAPTURE_INFO = ctypes.CFUNCTYPE(
    ctypes.c_int,
    VOIDP,
    ctypes.POINTER(ctypes.c_int),
    ctypes.POINTER(ctypes.c_ulonglong),
    ctypes.POINTER(VOIDP),
    ctypes.POINTER(ctypes.POINTER(VOIDP)),
    ctypes.POINTER(ctypes.c_size_t),
)


class FakeDriver:
    """One vendor function as a ctypes callback: records its arguments, returns ``status``."""

    def __init__(self, prototype, status: int = 0) -> None:
        self.calls: list[tuple] = []
        self.status = status

        def call(*args):
            self.calls.append(args)
            return self.status

        self.callback = prototype(call)  # kept alive as long as the fake
        self.address = ctypes.cast(self.callback, ctypes.c_void_p).value


class Handle:
    """A binding's handle object: int() gives the raw handle (as cuda-bindings' do)."""

    def __init__(self, raw: int) -> None:
        self.raw = raw

    def __int__(self) -> int:
        return self.raw


def test_the_helper_is_built_where_a_compiler_is():
    """``pip install -e .`` builds it wherever a C compiler and the Python headers are (CI
    included); elsewhere the backends use the bindings (tested by every other CPU test)."""
    include = sysconfig.get_paths()["include"]
    if shutil.which("cc") is None or not (include and __import__("os").path.exists(f"{include}/Python.h")):
        pytest.skip("no C compiler or no Python headers: the helper is optional")
    assert _native is not None, "a C compiler is present but jitcore.backends._native was not built"


@needs_native
def test_a_kernel_launch_passes_every_argument_through():
    fake = FakeDriver(KERNEL_LAUNCH)
    launch = _native.bind("kernel_launch", "cuLaunchKernel", fake.address)
    assert launch.__name__ == "cuLaunchKernel"
    result = launch(0x1234, 7, 2, 3, 256, 1, 4, 96, 0xBEEF, 0x5000, 0)
    assert result == (0,) and result is _native.SUCCESS  # success is one shared tuple
    assert fake.calls == [(0x1234, 7, 2, 3, 256, 1, 4, 96, 0xBEEF, 0x5000, None)]
    # handles as binding objects (int()), None as NULL, numpy ints as dimensions, the
    # largest handle and the largest dimension
    launch(Handle(2**64 - 1), np.int64(5), np.uint32(1), True, 1, 1, 1, 2**32 - 1, None, Handle(8), None)
    assert fake.calls[-1] == (2**64 - 1, 5, 1, 1, 1, 1, 1, 2**32 - 1, None, 8, None)


@needs_native
def test_a_failed_call_returns_its_status_like_the_binding():
    fake = FakeDriver(KERNEL_LAUNCH, status=700)
    launch = _native.bind("kernel_launch", "cuLaunchKernel", fake.address)
    result = launch(1, 1, 1, 1, 1, 1, 1, 0, 0, 8, 0)
    assert result == (700,) and result[0] == 700


@needs_native
@pytest.mark.parametrize(
    ("position", "value", "error", "words"),
    [
        (1, -1, OverflowError, "grid x"),
        (4, 2**32, OverflowError, "block x"),
        (7, 2**40, OverflowError, "shared bytes"),
        (2, 1.0, TypeError, "float"),
        (0, "f", TypeError, "function"),
        (8, object(), TypeError, "stream"),
        (9, -1, OverflowError, "kernel params"),
        (0, 2**64, OverflowError, "function"),
    ],
)
def test_bad_arguments_are_refused_before_the_driver_is_called(position, value, error, words):
    fake = FakeDriver(KERNEL_LAUNCH)
    launch = _native.bind("kernel_launch", "cuLaunchKernel", fake.address)
    args = [1, 1, 1, 1, 1, 1, 1, 0, 0, 8, 0]
    args[position] = value
    with pytest.raises(error, match=words):
        launch(*args)
    with pytest.raises(TypeError, match="expected 11 arguments, got 10"):
        launch(*args[:10])
    assert fake.calls == []


@needs_native
def test_graph_launch_and_node_update():
    graph = FakeDriver(GRAPH_LAUNCH)
    launch = _native.bind("graph_launch", "cuGraphLaunch", graph.address)
    assert launch(0xE0, 0) == (0,) and launch(Handle(0xE1), Handle(5)) == (0,)
    assert graph.calls == [(0xE0, None), (0xE1, 5)]
    with pytest.raises(TypeError, match="expected 2 arguments"):
        launch(0xE0)
    node = FakeDriver(NODE_SET, status=1)
    set_params = _native.bind("kernel_node_set", "cuGraphExecKernelNodeSetParams", node.address)
    assert set_params(0xE0, 0xA0, 0x7000) == (1,)
    assert node.calls == [(0xE0, 0xA0, 0x7000)]
    with pytest.raises(ValueError, match="node params"):
        set_params(0xE0, 0xA0, 0)  # a NULL struct would crash the driver
    assert len(node.calls) == 1


class FakeCaptureInfo:
    """cuStreamGetCaptureInfo_v2 as a ctypes callback: writes ``capture_status`` and a
    dependency array of ``nodes`` (a NULL array where ``nodes`` is None, with ``count``
    claimed anyway), returns ``status``."""

    def __init__(self, status: int = 0, capture_status: int = 1, nodes=(), count: int | None = None) -> None:
        self.streams: list = []
        self.status, self.capture_status = status, capture_status
        self.set_nodes(nodes, count)

        def call(stream, capture_status_out, id_out, graph_out, dependencies_out, count_out):
            self.streams.append(stream)
            capture_status_out[0] = self.capture_status
            id_out[0] = 77
            graph_out[0] = 0x6000
            dependencies_out[0] = self.array
            count_out[0] = self.count
            return self.status

        self.callback = CAPTURE_INFO(call)
        self.address = ctypes.cast(self.callback, ctypes.c_void_p).value

    def set_nodes(self, nodes, count: int | None = None) -> None:
        if nodes is None:
            self.array = ctypes.POINTER(VOIDP)()  # NULL
        else:
            self.array = ctypes.cast((VOIDP * max(len(nodes), 1))(*nodes), ctypes.POINTER(VOIDP))
        self.count = len(nodes or ()) if count is None else count


@needs_native
def test_a_capture_query_returns_the_status_the_capture_status_and_the_dependencies():
    fake = FakeCaptureInfo(nodes=(0xA0, 2**64 - 1))
    query = _native.bind("capture_info", "cuStreamGetCaptureInfo", fake.address)
    assert query.__name__ == "cuStreamGetCaptureInfo"
    assert query(0xBEEF) == (0, 1, (0xA0, 2**64 - 1))
    assert query(None) == (0, 1, (0xA0, 2**64 - 1)) and query(Handle(5))[2] == (0xA0, 2**64 - 1)
    assert fake.streams == [0xBEEF, None, 5]
    fake.set_nodes(())
    fake.capture_status = 0  # not capturing
    assert query(1) == (0, 0, ())
    fake.status, fake.capture_status = 900, 1  # a failed query: no dependencies, whatever it wrote
    fake.set_nodes((0xA0,))
    assert query(1) == (900, 1, ())
    fake.status = 0
    fake.set_nodes(None, count=3)  # a count without an array is read as none
    assert query(1) == (0, 1, ())
    with pytest.raises(TypeError, match="expected 1 arguments, got 2"):
        query(1, 2)
    with pytest.raises(TypeError, match="stream"):
        query("s")
    assert len(fake.streams) == 6


GRAPH_GET_NODES = ctypes.CFUNCTYPE(ctypes.c_int, VOIDP, ctypes.POINTER(VOIDP), ctypes.POINTER(ctypes.c_size_t))
NODE_GET_TYPE = ctypes.CFUNCTYPE(ctypes.c_int, VOIDP, ctypes.POINTER(ctypes.c_int))
KERNEL_NODE_GET_PARAMS = ctypes.CFUNCTYPE(ctypes.c_int, VOIDP, VOIDP)


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 as cuda.h declares it."""

    _fields_ = [
        ("func", VOIDP),
        *((name, UINT) for name in ("gx", "gy", "gz", "bx", "by", "bz", "shared")),
        ("kernelParams", VOIDP),
        ("extra", VOIDP),
        ("kern", VOIDP),
        ("ctx", VOIDP),
    ]


class FakeGraph:
    """cuGraphGetNodes, cuGraphNodeGetType and cuGraphKernelNodeGetParams_v2 as ctypes
    callbacks over a dict of nodes {handle: (type, params or None)}; ``grow`` nodes appear
    between the count and the fill (a graph another thread extends)."""

    def __init__(self, nodes: dict, status: int = 0) -> None:
        self.nodes, self.status, self.grow = nodes, status, 0

        def get_nodes(graph, out, count):
            handles = list(self.nodes)
            if not out:
                count[0] = len(handles)
            else:
                room = count[0]
                for i, handle in enumerate(handles[:room]):
                    out[i] = handle
                count[0] = len(handles) + self.grow
            return self.status

        def get_type(node, out):
            out[0] = self.nodes[node][0]
            return self.status

        def get_params(node, out):
            fields = self.nodes[node][1]
            struct = KernelNodeParams.from_address(out)
            for name, value in fields.items():
                setattr(struct, name, value)
            struct.ctx = 0xC7  # written by the driver past what the helper reads
            return self.status

        self.callbacks = (GRAPH_GET_NODES(get_nodes), NODE_GET_TYPE(get_type), KERNEL_NODE_GET_PARAMS(get_params))
        self.addresses = [ctypes.cast(c, ctypes.c_void_p).value for c in self.callbacks]


KERNEL_FIELDS = dict(func=0xF00, gx=4, gy=2, gz=1, bx=256, by=1, bz=1, shared=96, kernelParams=0x7000)


@needs_native
def test_the_node_reads_return_each_nodes_handle_type_and_kernel_parameters():
    graph = FakeGraph({0xA0: (0, KERNEL_FIELDS), 0xA1: (1, None), 2**64 - 8: (0, dict(KERNEL_FIELDS, gx=2**32 - 1))})
    get_nodes = _native.bind("graph_get_nodes", "cuGraphGetNodes", graph.addresses[0])
    get_type = _native.bind("node_get_type", "cuGraphNodeGetType", graph.addresses[1])
    get_params = _native.bind("kernel_node_get_params", "cuGraphKernelNodeGetParams", graph.addresses[2])
    assert get_nodes(0x6000) == (0, (0xA0, 0xA1, 2**64 - 8))
    assert get_type(0xA0) == (0, 0) and get_type(Handle(0xA1)) == (0, 1)
    assert get_params(0xA0) == (0, 0xF00, 4, 2, 1, 256, 1, 1, 96, 0x7000)
    assert get_params(2**64 - 8)[2] == 2**32 - 1
    graph.grow = 5  # more nodes at the fill than at the count: the handles there was room for
    assert get_nodes(0x6000) == (0, (0xA0, 0xA1, 2**64 - 8))
    graph.status = 900  # a failed read: nothing but the status
    assert get_nodes(0x6000) == (900, ())
    assert get_params(0xA0) == (900, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    assert get_type(0xA0)[0] == 900
    empty = FakeGraph({})  # an empty graph: no second call
    assert _native.bind("graph_get_nodes", "g", empty.addresses[0])(1) == (0, ())
    with pytest.raises(TypeError, match="expected 1 arguments"):
        get_params(1, 2)
    with pytest.raises(TypeError, match="node"):
        get_type("n")


@needs_native
def test_read_params_copies_what_each_parameter_pointer_points_to():
    values = [ctypes.create_string_buffer(bytes(range(1, 9))), ctypes.create_string_buffer(b"\xff\x00\x7f\x01")]
    array = (VOIDP * 3)(ctypes.addressof(values[0]), ctypes.addressof(values[1]), None)
    address = ctypes.addressof(array)
    assert _native.read_params(address, (8, 4)) == (bytes(range(1, 9)), b"\xff\x00\x7f\x01")
    assert _native.read_params(address, [2, 0]) == (b"\x01\x02", b"")
    assert _native.read_params(address, (8, 4, 0)) == (bytes(range(1, 9)), b"\xff\x00\x7f\x01", b"")
    assert _native.read_params(0, (8, 4)) == (b"", b"")  # a node without parameters
    with pytest.raises(ValueError, match="parameter 2 has no value"):
        _native.read_params(address, (8, 4, 4))
    with pytest.raises(ValueError, match="negative"):
        _native.read_params(address, (8, -1))
    with pytest.raises(TypeError, match="sequence"):
        _native.read_params(address, 8)


@needs_native
def test_binding_is_checked():
    fake = FakeDriver(GRAPH_LAUNCH)
    with pytest.raises(ValueError, match="kind must be"):
        _native.bind("memcpy", "x", fake.address)
    with pytest.raises(ValueError, match="must not be 0"):
        _native.bind("graph_launch", "x", 0)
    with pytest.raises(TypeError, match="address must be an int"):
        _native.bind("graph_launch", "x", Handle(fake.address))


@needs_native
def test_the_gil_is_released_during_the_driver_call():
    """A launch blocks while the launch queue is full; other threads must run meanwhile. The
    "driver" here is libc's nanosleep, which has graph_launch's shape (two pointers -> int)
    and holds no GIL of its own."""
    libc = ctypes.CDLL(None)
    sleep = _native.bind("graph_launch", "nanosleep", ctypes.cast(libc.nanosleep, ctypes.c_void_p).value)

    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    duration = Timespec(0, 300_000_000)
    ticks = []
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.005)

    counter = threading.Thread(target=count)
    counter.start()
    time.sleep(0.02)
    start = time.perf_counter()
    assert sleep(ctypes.addressof(duration), None) == (0,)
    end = time.perf_counter()
    stop.set()
    counter.join()
    assert end - start >= 0.29
    assert sum(start < t < end for t in ticks) >= 10  # the other thread ran all along


@needs_native
def test_a_capture_tail_answers_the_dependencies_while_the_stream_captures():
    """CaptureTail: the backend's capture_tail made in C, over cuStreamGetCaptureInfo_v2."""
    fake = FakeCaptureInfo(nodes=(0xA0,))
    tail = _native.CaptureTail(fake.address, 1)
    assert tail(0xBEEF) == (0xA0,) and tail(Handle(5)) == (0xA0,) and fake.streams == [0xBEEF, 5]
    fake.set_nodes((0xA0, 2**64 - 1))
    assert tail(None) == (0xA0, 2**64 - 1)
    fake.set_nodes(None, count=3)  # a count without an array is read as none
    assert tail(1) == ()
    fake.set_nodes((0xA0,))
    fake.capture_status = 2  # capturing no more (invalidated): not the "active" status told
    assert tail(1) is None
    fake.status, fake.capture_status = 900, 1  # a failed query
    assert tail(1) is None
    for misuse, error in (((), TypeError), ((1, 2), TypeError), (("s",), TypeError), ((-1,), OverflowError)):
        with pytest.raises(error):
            tail(*misuse)
    with pytest.raises(TypeError):
        tail(stream=1)
    with pytest.raises(ValueError, match="must not be 0"):
        _native.CaptureTail(0, 1)
    with pytest.raises(TypeError):
        _native.CaptureTail(fake.address)


@needs_native
def test_a_recording_asks_a_capture_tail_from_c_for_each_launchs_node():
    """A packed launch recorded into a sink whose tail is a CaptureTail: the node the query
    names (its only dependency, else None), asked on the launch's stream, with no Python call;
    an empty launch asks nothing."""
    from jitcore.codegen import _CALL_FIELDS
    from jitcore.recorder import LaunchRecord

    _native.use_launch_record(LaunchRecord, tuple(LaunchRecord._fields.index(f) for f in _CALL_FIELDS))
    template = tuple.__new__(LaunchRecord, (None,) * len(LaunchRecord._fields))
    launch = FakeDriver(KERNEL_LAUNCH)
    packed = _native.PackedLaunch(launch.address, 0xF00, bytes(4), (0,), ((0, "<i"),))
    fake = FakeCaptureInfo(nodes=(0xA7,))
    records, nodes = [], []
    sink = (records, nodes, _native.CaptureTail(fake.address, 1))
    packed.recorded(sink, template, (), 2, 1, 1, 64, 1, 1, 0, 0xBEEF, 5)
    fake.set_nodes((0xA7, 0xA8))  # two dependencies: not one launch's node
    packed.recorded(sink, template, (), 2, 1, 1, 64, 1, 1, 0, 0xBEEF, 6)
    fake.set_nodes((0xA9,))
    packed.recorded(sink, template, (), 0, 1, 1, 64, 1, 1, 0, 0xBEEF, 7)  # empty: nothing asked
    fake.capture_status = 0
    packed.recorded(sink, template, (), 2, 1, 1, 64, 1, 1, 0, 0xBEEF, 8)
    assert nodes == [0xA7, None, None, None] and fake.streams == [0xBEEF] * 3
    assert [r.param_bytes for r in records] == [struct.pack("<i", v) for v in (5, 6, 7, 8)]
    assert [r.launched for r in records] == [True, True, False, True] and len(launch.calls) == 3
    with pytest.raises(TypeError, match="stream"):
        packed.recorded(sink, template, (), 2, 1, 1, 64, 1, 1, 0, "s", 9)  # refused before the launch


def _param_array(values: list[bytes]) -> tuple[int, list]:
    """A kernel node's parameter array over ``values`` (its address, and what keeps it alive)."""
    buffers = [ctypes.create_string_buffer(v, len(v)) for v in values]
    array = (VOIDP * len(values))(*[ctypes.addressof(b) for b in buffers])
    return ctypes.addressof(array), [buffers, array]


@needs_native
def test_node_reads_give_every_nodes_fields_and_the_parameters_asked_for_in_one_call():
    first, kept = _param_array([struct.pack("<Q", 0x5000), struct.pack("<i", -3)])
    other, kept_too = _param_array([b"\1" * 16])
    nodes = {
        0xA0: (0, dict(KERNEL_FIELDS, kernelParams=first)),
        0xA1: (1, None),  # a copy: no fields
        2**64 - 8: (0, dict(KERNEL_FIELDS, func=0xF01, gx=2**32 - 1, kernelParams=other)),
    }
    graph = FakeGraph(nodes)
    reads = _native.NodeReads(*graph.addresses, 0)
    sizes = {0xF00: (8, 4)}
    status, which, rows = reads(0x6000, sizes)
    assert (status, which) == (0, 0)
    assert rows == (
        (0xA0, 0, 0xF00, 4, 2, 1, 256, 1, 1, 96, first, (struct.pack("<Q", 0x5000), struct.pack("<i", -3))),
        (0xA1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, None),
        (2**64 - 8, 0, 0xF01, 2**32 - 1, 2, 1, 256, 1, 1, 96, other, None),  # a function sizes does not name
    )
    assert reads(0x6000, None)[2][0][-1] is None  # no sizes: no parameters read
    assert reads(0x6000, {0xF01: (16,)})[2][2][-1] == (b"\1" * 16,)
    graph.grow = 5  # more nodes at the fill than at the count: the handles there was room for
    assert len(reads(0x6000, sizes)[2]) == 3
    graph.status = 900  # the first read fails: nothing but the status and which read
    assert reads(0x6000, sizes) == (900, 0, ())
    empty = FakeGraph({})
    assert _native.NodeReads(*empty.addresses, 0)(1, sizes) == (0, 0, ())
    fine, types_fail, params_fail = FakeGraph(nodes), FakeGraph(nodes, status=7), FakeGraph(nodes, status=8)
    reads = _native.NodeReads(fine.addresses[0], types_fail.addresses[1], fine.addresses[2], 0)
    assert reads(1, sizes) == (7, 1, ())
    reads = _native.NodeReads(fine.addresses[0], fine.addresses[1], params_fail.addresses[2], 0)
    assert reads(1, sizes) == (8, 2, ())
    graph.status = 0
    for misuse, error in (
        ((1, [sizes]), TypeError),  # sizes neither a dict nor None
        ((1, {0xF00: [8, 4]}), TypeError),  # sizes of a function not a tuple
        ((1, {0xF00: (8, -4)}), ValueError),
        (("g", sizes), TypeError),
        ((1,), TypeError),
    ):
        with pytest.raises(error):
            _native.NodeReads(*graph.addresses, 0)(*misuse)
    with pytest.raises(ValueError, match="must not be 0"):
        _native.NodeReads(graph.addresses[0], 0, graph.addresses[2], 0)
    assert kept and kept_too


GRAPH_ADD_MEMCPY = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(VOIDP), VOIDP, ctypes.POINTER(VOIDP), ctypes.c_size_t, VOIDP, VOIDP
)


class FakeAddMemcpy:
    """cuGraphAddMemcpyNode as a ctypes callback: records (graph, dependencies, params address,
    context) and what ``read(params address)`` says of the struct, answers node handles 0xC0, 0xC1..."""

    def __init__(self, read=lambda address: None, status: int = 0) -> None:
        self.calls: list[tuple] = []
        self.status = status

        def call(node_out, graph, dependencies, count, params, context):
            self.calls.append((graph, [dependencies[i] for i in range(count)], params, context, read(params)))
            node_out[0] = 0xC0 + len(self.calls) - 1
            return self.status

        self.callback = GRAPH_ADD_MEMCPY(call)
        self.address = ctypes.cast(self.callback, ctypes.c_void_p).value


@needs_native
def test_a_copy_node_is_added_after_the_dependencies_given():
    fake = FakeAddMemcpy()
    add = _native.bind("graph_add_memcpy", "cuGraphAddMemcpyNode", fake.address)
    assert add(0x6000, (0xA0, Handle(0xA1)), 0x7000, 0xC7) == (0, 0xC0)
    assert add(0x6000, [], 0x7000, None) == (0, 0xC1)
    assert fake.calls == [(0x6000, [0xA0, 0xA1], 0x7000, 0xC7, None), (0x6000, [], 0x7000, None, None)]
    fake.status = 1
    assert add(0x6000, (), 0x7000, 0) == (1, 0)  # no node unless the status is 0
    for misuse, error in (
        ((0x6000, (0xA0,), 0, 0xC7), ValueError),  # no copy parameters
        ((0x6000, {0xA0}, 0x7000, 0xC7), TypeError),
        ((0x6000, ("a",), 0x7000, 0xC7), TypeError),
        ((0x6000, (-1,), 0x7000, 0xC7), OverflowError),
        ((0x6000, (), 0x7000), TypeError),
    ):
        with pytest.raises(error):
            add(*misuse)
    assert len(fake.calls) == 3


@needs_native
def test_the_cuda_backend_launches_through_the_helper(monkeypatch):
    """The CUDA backend with a fake libcuda: a jit call state's launch and a node update go
    through the C helper with raw handles, the same arguments the binding would get."""
    pytest.importorskip("cuda.bindings")
    monkeypatch.delenv("JITCORE_NATIVE", raising=False)  # this test is of the helper itself
    from jitcore.backends import cuda as cuda_backend

    drivers = {
        "cuLaunchKernel": FakeDriver(KERNEL_LAUNCH),
        "cuGraphLaunch": FakeDriver(GRAPH_LAUNCH),
        "cuGraphExecKernelNodeSetParams_v2": FakeDriver(NODE_SET),
        "cuStreamGetCaptureInfo_v2": FakeCaptureInfo(nodes=(0xA7,)),
    }

    class FakeLibcuda:
        def __init__(self, name):
            assert name == "libcuda.so.1"

        def __getattr__(self, symbol):
            if symbol not in drivers:
                raise AttributeError(symbol)
            return drivers[symbol].callback

    monkeypatch.setattr(cuda_backend.ctypes, "CDLL", FakeLibcuda)
    calls = cuda_backend.native_calls()
    packed = calls.pop("packed_launch")
    assert calls.pop("read_params") is _native.read_params
    assert isinstance(calls.pop("capture_tail"), _native.CaptureTail)
    assert {role: f.__name__ for role, f in calls.items()} == {
        "launch": "cuLaunchKernel",
        "graph_launch": "cuGraphLaunch",
        "node_set": "cuGraphExecKernelNodeSetParams",
        "capture_info": "cuStreamGetCaptureInfo",
    }
    assert packed.func is _native.PackedLaunch and packed.args == (drivers["cuLaunchKernel"].address,)
    backend = cuda_backend.CudaBackend()
    assert backend.native and backend.raw_stream_handles
    assert backend.raw_launch is backend.hot_namespace["_cuLaunchKernel"]
    assert backend.binding_launch is cuda_backend.driver.cuLaunchKernel  # the benchmarks' floor
    assert backend.graph_exec_object(0xE0) == 0xE0

    # the capture query replay makes after each launch it records: the launch's node, or None
    # where the stream is not capturing or the query failed; a recording's sink takes the C
    # object that answers it (a packed launch's record asks it without Python)
    capture_info = drivers["cuStreamGetCaptureInfo_v2"]
    assert isinstance(backend.capture_tail_function(), _native.CaptureTail)
    assert backend.capture_tail(0xBEEF) == (0xA7,) and capture_info.streams == [0xBEEF]
    assert backend.capture_tail_function()(0xBEEF) == (0xA7,)
    capture_info.capture_status = 0
    assert backend.capture_tail(0xBEEF) is None
    capture_info.status, capture_info.capture_status = 1, 1
    assert backend.capture_tail(0xBEEF) is None
    # the node reads of an analysis: every node read in one C call (with the parameters of the
    # kernels whose sizes are given), handles raw ints; a node of another type (7: an empty
    # node) is "other"
    assert backend._native_node_reads is None  # the fake libcuda has none: the binding reads
    values = [struct.pack("<Q", 0x5000), struct.pack("<i", 9)]
    address, kept = _param_array(values)
    fake_graph = FakeGraph({0xB0: (0, dict(KERNEL_FIELDS, kernelParams=address)), 0xB1: (7, None)})
    node_reads = [cuda_backend._NATIVE_OPTIONAL[1][role][1] for role in cuda_backend._NATIVE_NODE_READS]
    for symbol, callback in zip(node_reads, fake_graph.callbacks):
        drivers[symbol] = SimpleNamespace(callback=callback)
    add_memcpy = FakeAddMemcpy(read=_copy_fields)
    drivers["cuGraphAddMemcpyNode"] = add_memcpy
    backend = cuda_backend.CudaBackend()
    assert isinstance(backend._native_node_reads, _native.NodeReads)
    kernel, other = backend.graph_nodes(0x6000)
    assert (kernel.index, kernel.handle, kernel.kind, kernel.function) == (0, 0xB0, "kernel", 0xF00)
    assert (kernel.grid, kernel.block, kernel.shared_bytes, kernel.params_address) == (
        (4, 2, 1),
        (256, 1, 1),
        96,
        address,
    )
    assert type(kernel.handle) is int and kernel.params is None
    assert (other.index, other.handle, other.kind) == (1, 0xB1, "other")
    kernel, _ = backend.graph_nodes_with_params(0x6000, {0xF00: (8, 4)})
    assert kernel.params == tuple(values) == tuple(backend.read_kernel_params(kernel, (8, 4)))
    # the outputs' copies: a memcpy node each, after every node the graph holds, in the
    # device's context, with the struct the binding makes
    monkeypatch.setattr(backend, "_context", lambda device: 0xC7)
    backend.append_copies(0x6000, [(0xD000, 0xE000, 48), (0xD100, 0xE100, 16)], 0)
    device = int(cuda_backend.driver.CUmemorytype.CU_MEMORYTYPE_DEVICE)
    assert [call[:2] + call[3:] for call in add_memcpy.calls] == [
        (0x6000, [0xB0, 0xB1], 0xC7, (device, 0xE000, device, 0xD000, 48, 1, 1)),
        (0x6000, [0xB0, 0xB1], 0xC7, (device, 0xE100, device, 0xD100, 16, 1, 1)),
    ]
    add_memcpy.status = 1
    monkeypatch.setattr(cuda_backend._check, "detail", lambda status: "")  # (the driver's sentence: none here)
    with pytest.raises(DriverError, match="cuGraphAddMemcpyNode"):
        backend.append_copies(0x6000, [(0xD000, 0xE000, 48)], 0)
    for symbol in node_reads:
        del drivers[symbol]
    del drivers["cuGraphAddMemcpyNode"]
    # a driver without the query: the other calls still go through the helper
    del drivers["cuStreamGetCaptureInfo_v2"]
    assert set(cuda_backend.native_calls()) == {"launch", "graph_launch", "node_set", "packed_launch", "read_params"}
    assert kept

    # the launch template, as a call state runs it
    namespace = dict(backend.hot_namespace, _f=0xF00, _addr=0x5000)
    source = "def launch(stream):\n" + "".join(
        f"    {line}\n"
        for line in backend.launch_template.format(
            function="_f", gx=3, gy=1, gz=1, bx=128, by=1, bz=1, shared=0, stream="stream", params="_addr", label="'k'"
        ).splitlines()
    )
    exec(source, namespace)
    namespace["launch"](0xBEEF)
    assert drivers["cuLaunchKernel"].calls == [(0xF00, 3, 1, 1, 128, 1, 1, 0, 0xBEEF, 0x5000, None)]
    drivers["cuLaunchKernel"].status = 1  # CUDA_ERROR_INVALID_VALUE: the backend's own error
    with pytest.raises(Exception, match="CUDA_ERROR_INVALID_VALUE"):
        namespace["launch"](0xBEEF)

    # a node updater sends raw handles and the node-params struct's address
    from jitcore.backends.abi import ParamLayout, parse_signature
    from jitcore.backends.base import GraphNode

    layout = ParamLayout.of(parse_signature("float* x, int n"))
    node = GraphNode(index=0, handle=Handle(0xA0), kind="kernel", function=0xF00, grid=(2, 1, 1), block=(64, 1, 1))
    updater = backend.node_updater(0xE0, node, layout, bytes(layout.size))
    assert updater.set_call(*updater.set_args) == (0,)
    (exec_handle, node_handle, struct_address), *_ = drivers["cuGraphExecKernelNodeSetParams_v2"].calls
    assert (exec_handle, node_handle, struct_address) == (0xE0, 0xA0, updater.node_params.getPtr())

    # a packed launch: the backend's PackedLaunch over the same cuLaunchKernel
    launcher = backend.packed_launcher(0xF00, bytes(12), (0, 8), ((0, "<Q"), (8, "<i")))
    drivers["cuLaunchKernel"].status = 0
    assert launcher(2, 1, 1, 64, 1, 1, 0, 0xBEEF, 0x1234, -7) == (0,)
    assert drivers["cuLaunchKernel"].calls[-1][:9] == (0xF00, 2, 1, 1, 64, 1, 1, 0, 0xBEEF)
    assert torch.zeros(1).sum() == 0  # torch still fine after the fakes (no stray frees)


def _copy_fields(address: int) -> tuple:
    """The fields of the CUDA_MEMCPY3D at ``address`` that a flat device copy sets."""
    from cuda.bindings import driver

    p = driver.CUDA_MEMCPY3D(_ptr=address)
    return (
        int(p.srcMemoryType),
        int(p.srcDevice),
        int(p.dstMemoryType),
        int(p.dstDevice),
        p.WidthInBytes,
        p.Height,
        p.Depth,
    )


# --- PackedLaunch: the launch that packs its own parameters -------------------------------------

_CODES = "bBhHiIlLqQ?efd"


class ParamReader:
    """A fake cuLaunchKernel that copies out the packed parameters while the call lasts (the
    buffer lives on the C stack for the call only)."""

    def __init__(self, layout_offsets: list[int], sizes: list[int]) -> None:
        self.seen: list[tuple] = []

        def call(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            pointers = (ctypes.c_void_p * len(layout_offsets)).from_address(params) if layout_offsets else []
            self.seen.append(
                (
                    (function, gx, gy, gz, bx, by, bz, shared, stream, extra),
                    [ctypes.string_at(p, n) for p, n in zip(pointers, sizes)],
                )
            )
            return 0

        self.callback = KERNEL_LAUNCH(call)
        self.address = ctypes.cast(self.callback, ctypes.c_void_p).value


def _values_for(code: str):
    ints = st.integers(-(2**70), 2**70) | st.sampled_from(
        [0, 1, -1, 127, 128, -129, 255, 256, 2**31, -(2**31) - 1, 2**32, 2**63, 2**64, -(2**63) - 1]
    )
    floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
        [3.5e38, 3.4e38, 65504.0, 65520.0, 1e308, -0.0]
    )
    others = st.sampled_from(
        [True, False, None, "1", np.int32(-5), np.uint8(7), np.float32(1.5), np.float64(2.25), np.bool_(True), 2**100]
    )
    return st.one_of(ints, floats, others)


@needs_native
@settings(max_examples=400, deadline=None)
@given(data=st.data(), codes=st.text(alphabet=_CODES, min_size=1, max_size=6))
def test_a_packed_launch_packs_exactly_what_struct_packs_and_refuses_what_it_refuses(data, codes):
    values = [data.draw(_values_for(code)) for code in codes]
    sizes = [struct.calcsize("<" + code) for code in codes]
    offsets = [sum(sizes[:i]) for i in range(len(codes))]
    reader = ParamReader([*offsets, sum(sizes)], [*sizes, 8])
    constant = b"\xab" * 8  # a constant parameter after the values, packed once in the template
    template = bytes(sum(sizes)) + constant
    launch = _native.PackedLaunch(reader.address, 0x77, template, (*offsets, sum(sizes)), ((0, "<" + codes),))
    try:
        expected = [struct.pack("<" + code, value) for code, value in zip(codes, values)]
    except (struct.error, OverflowError, TypeError) as refused:
        for call in (launch, launch.reporting):
            with pytest.raises((struct.error, OverflowError)) as caught:
                call(1, 1, 1, 32, 1, 1, 0, 0x5, *values)
            assert type(caught.value) is type(refused)  # struct.error or OverflowError, as struct says
        assert reader.seen == []  # nothing launched
        return
    assert launch(1, 1, 1, 32, 1, 1, 0, 0x5, *values) == (0,)
    # the recording path's launch: the same, returning the bytes it packed
    assert launch.reporting(1, 1, 1, 32, 1, 1, 0, 0x5, *values) == b"".join(expected) + constant
    (call, params), again = reader.seen
    assert call == (0x77, 1, 1, 1, 32, 1, 1, 0, 0x5, None)
    assert params == [*expected, constant] and again == (call, params)


@needs_native
def test_a_packed_launch_keeps_pads_and_constants_and_skips_empty_grids():
    reader = ParamReader([0, 8, 16], [8, 4, 8])
    template = b"\x00" * 8 + b"\x11\x22\x33\x44" + b"\xee" * 4 + b"\x00" * 8  # a constant int between two values
    launch = _native.PackedLaunch(reader.address, 1, template, (0, 8, 16), ((0, "<Q"), (16, "<d")))
    assert launch(2, 1, 1, 64, 1, 1, 128, None, 2**64 - 1, 0.5) == (0,)
    ((call, params),) = reader.seen
    assert params == [b"\xff" * 8, b"\x11\x22\x33\x44", struct.pack("<d", 0.5)]
    assert call[8] is None  # a NULL stream
    assert launch(0, 1, 1, 64, 1, 1, 0, 0, 1, 1.0) == (0,)  # an empty grid: packed, not launched
    assert len(reader.seen) == 1
    with pytest.raises(struct.error):
        launch(0, 1, 1, 64, 1, 1, 0, 0, -1, 1.0)  # packed (and refused) even when nothing would run
    with pytest.raises(TypeError, match="expected 10 arguments"):
        launch(1, 1, 1, 64, 1, 1, 0, 0, 1)
    with pytest.raises(OverflowError, match="grid x"):
        launch(2**32, 1, 1, 64, 1, 1, 0, 0, 1, 1.0)
    with pytest.raises(ValueError, match="struct code"):
        _native.PackedLaunch(reader.address, 1, template, (0,), ((0, "<2Q"),))
    with pytest.raises(ValueError, match="outside"):
        _native.PackedLaunch(reader.address, 1, template, (0,), ((20, "<Q"),))


@needs_native
def test_a_packed_launch_reads_tensors_pointers_and_raises_the_backends_error():
    reader = ParamReader([0, 8], [8, 8])
    seen = []

    def failed(status):
        seen.append(status)
        raise RuntimeError(f"the launch failed ({status})")

    launch = _native.PackedLaunch(reader.address, 1, bytes(16), (0, 8), ((0, "<PQ"),), failed)
    x = torch.arange(4.0)
    assert launch(1, 1, 1, 32, 1, 1, 0, 0, x, 7) == (0,)  # 'P': the tensor's data_ptr(), as 'Q'
    assert reader.seen[-1][1] == [struct.pack("<Q", x.data_ptr()), struct.pack("<Q", 7)]

    class NoPointer:
        def data_ptr(self):
            raise ValueError("no storage")

    with pytest.raises(ValueError, match="no storage"):  # what data_ptr() raises, as the Python path would
        launch(1, 1, 1, 32, 1, 1, 0, 0, NoPointer(), 7)
    with pytest.raises(AttributeError):
        launch(1, 1, 1, 32, 1, 1, 0, 0, 5, 7)
    assert len(reader.seen) == 1

    refusing = FakeDriver(KERNEL_LAUNCH, status=700)
    launch = _native.PackedLaunch(refusing.address, 1, bytes(16), (0, 8), ((0, "<PQ"),), failed)
    with pytest.raises(RuntimeError, match="700"):
        launch(1, 1, 1, 32, 1, 1, 0, 0, x, 7)
    assert seen == [700]
    plain = _native.PackedLaunch(refusing.address, 1, bytes(16), (0, 8), ((0, "<PQ"),))
    assert plain(1, 1, 1, 32, 1, 1, 0, 0, x, 7) == (700,)  # without failed: the status comes back
    with pytest.raises(RuntimeError, match="700"):  # the recording path's launch never passes one over
        launch.reporting(1, 1, 1, 32, 1, 1, 0, 0, x, 7)
    with pytest.raises(RuntimeError, match="status 700"):
        plain.reporting(1, 1, 1, 32, 1, 1, 0, 0, x, 7)
    assert seen == [700, 700]


@needs_native
def test_a_reporting_launch_of_an_empty_grid_returns_its_bytes_without_launching():
    reader = ParamReader([0, 8], [8, 4])
    template = bytes(8) + b"\x01\x02\x03\x04"
    launch = _native.PackedLaunch(reader.address, 1, template, (0, 8), ((0, "<q"),))
    assert launch.reporting(1, 0, 1, 64, 1, 1, 0, 0, -3) == struct.pack("<q", -3) + b"\x01\x02\x03\x04"
    assert reader.seen == []
    with pytest.raises(struct.error):
        launch.reporting(0, 1, 1, 64, 1, 1, 0, 0, 2**63)  # packed (and refused) all the same
    with pytest.raises(TypeError, match="expected 9 arguments"):
        launch.reporting(1, 1, 1, 64, 1, 1, 0, 0)
