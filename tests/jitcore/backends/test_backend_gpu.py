"""The selected backend on a real GPU: launches, shared memory, graphs and node updates."""

from __future__ import annotations

import struct

import pytest
import torch

import jitcore as jc
from jitcore.backends import get_backend

pytestmark = pytest.mark.gpu

ADD = r"""
template <typename T>
__global__ void add(const T* __restrict__ x, const T* __restrict__ y, T* __restrict__ out, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + y[i];
}
"""
GRID2D = r"""
__global__ void index2d(float* out, int rows, int cols) {
    int r = blockIdx.y * blockDim.y + threadIdx.y;
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows && c < cols) out[r * cols + c] = r * 1000.0f + c;
}
"""
BIG_SHARED = r"""
extern "C" __global__ void reverse_in_shared(const float* x, float* out, int n) {
    extern __shared__ float tile[];
    for (int i = threadIdx.x; i < n; i += blockDim.x) tile[i] = x[i];
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = tile[n - 1 - i] * 2.0f;
}
"""
add_kernel = jc.Kernel(ADD, "add")


def random_like(dtype, n, device="cuda"):
    if dtype.is_floating_point:
        return torch.randn(n, device=device).to(dtype)
    return torch.randint(-1000, 1000, (n,), device=device, dtype=dtype)


def poison(shape, dtype):
    shape = (shape,) if isinstance(shape, int) else shape
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), device="cuda", dtype=dtype)
    return torch.full(shape, -12345, device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64])
@pytest.mark.parametrize("n", [1, 1000, 1 << 20])
def test_vector_add_matches_torch(dtype, n):
    x, y = random_like(dtype, n), random_like(dtype, n)
    out = poison(n, dtype)
    add_kernel.instantiate(dtype)[jc.cdiv(n, 256), 256](x, y, out, n)
    torch.cuda.synchronize()
    assert torch.equal(out, x + y)  # every element, bitwise: one rounding in both


def test_two_dimensional_grid():
    rows, cols = 37, 300
    out = poison((rows, cols), torch.float32)
    jc.Kernel(GRID2D, "index2d")[(jc.cdiv(cols, 32), jc.cdiv(rows, 8)), (32, 8)](out, rows, cols)
    r = torch.arange(rows, device="cuda", dtype=torch.float32)[:, None]
    c = torch.arange(cols, device="cuda", dtype=torch.float32)[None, :]
    assert torch.equal(out, r * 1000 + c)


def test_more_than_48kb_of_dynamic_shared_memory():
    n = 20000  # 80 KB of floats
    x = torch.randn(n, device="cuda")
    out = poison(n, torch.float32)
    kernel = jc.Kernel(BIG_SHARED, "reverse_in_shared")
    kernel[1, 256, n * 4](x, out, n)
    torch.cuda.synchronize()
    assert torch.equal(out, x.flip(0) * 2)
    function = kernel.instantiate().function(torch.cuda.current_device())
    assert function.dynamic_shared_limit >= n * 4


def test_shared_memory_beyond_the_device_is_refused_before_launch():
    with pytest.raises(jc.LaunchConfigError, match="shared memory"):
        jc.Kernel(BIG_SHARED, "reverse_in_shared")[1, 256, 10**7](
            torch.randn(4, device="cuda"), torch.empty(4, device="cuda"), 4
        )


def capture_add(x, y, out, n):
    spec = add_kernel.instantiate(torch.float32)
    spec[jc.cdiv(n, 256), 256](x, y, out, n)  # compile and load before capture
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        spec[jc.cdiv(n, 256), 256](x, y, out, n)
    graph.instantiate()
    return spec, graph


def test_launch_inside_torch_graph_is_captured_and_replayed():
    n = 4096
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    out = poison(n, torch.float32)
    _, graph = capture_add(x, y, out, n)
    out.fill_(float("nan"))
    x.copy_(torch.randn(n, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x + y)


def test_graph_nodes_are_enumerated_with_their_parameters():
    n = 1000
    x, y, out = torch.randn(n, device="cuda"), torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    spec, graph = capture_add(x, y, out, n)
    backend = get_backend()
    nodes = [node for node in backend.graph_nodes(graph.raw_cuda_graph()) if node.kind == "kernel"]
    assert len(nodes) == 1
    node = nodes[0]
    assert node.function == spec.function(torch.cuda.current_device()).address
    assert node.grid == (4, 1, 1) and node.block == (256, 1, 1) and node.shared_bytes == 0
    raw = backend.read_kernel_params(node, [t.size for t in spec.layout.types])
    assert [struct.unpack("<Q", raw[i])[0] for i in range(3)] == [x.data_ptr(), y.data_ptr(), out.data_ptr()]
    assert struct.unpack("<q", raw[3])[0] == n


def test_updating_a_node_moves_the_output_to_a_new_buffer():
    n = 2048
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    old, new = poison(n, torch.float32), poison(n, torch.float32)
    spec, graph = capture_add(x, y, old, n)
    backend = get_backend()
    node = next(node for node in backend.graph_nodes(graph.raw_cuda_graph()) if node.kind == "kernel")
    raw = backend.read_kernel_params(node, [t.size for t in spec.layout.types])
    updater = backend.node_updater(graph.raw_cuda_graph_exec(), node, spec.layout, spec.layout.assemble(raw))
    struct.pack_into("<Q", updater.params.buffer, spec.layout.offsets[2], new.data_ptr())
    updater.apply()
    old.fill_(float("nan"))
    x.copy_(torch.randn(n, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(new, x + y)
    assert torch.isnan(old).all()  # nothing landed in the old buffer


def test_backend_launch_through_a_graph_exec_on_the_current_stream():
    n = 512
    x, y, out = torch.randn(n, device="cuda"), torch.randn(n, device="cuda"), poison(n, torch.float32)
    _, graph = capture_add(x, y, out, n)
    out.fill_(float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the poison is written before the graph runs
    with torch.cuda.stream(stream):
        get_backend().graph_launch(graph.raw_cuda_graph_exec(), stream.cuda_stream)
    stream.synchronize()
    assert torch.equal(out, x + y)


def test_the_capture_query_names_each_launchs_node(monkeypatch):
    """``capture_tail`` right after each launch of a capture names that launch's node (how
    replay maps launches to nodes), through the C helper where it was built and through
    cuda-bindings' own query alike; outside a capture it is None."""
    n = 3000
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    first, second = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    spec = add_kernel.instantiate(torch.float32)
    spec[jc.cdiv(n, 256), 256](x, y, first, n)  # compile and load before capture
    backend = get_backend()
    native = getattr(backend, "_native_capture_info", None)
    if getattr(backend, "native", False):
        assert native is not None  # the helper, where it is used, makes this query too

    def through_binding(stream: int):
        with monkeypatch.context() as patch:
            patch.setattr(backend, "_native_capture_info", None, raising=False)
            return backend.capture_tail(stream)

    idle = torch.cuda.current_stream().cuda_stream
    assert backend.capture_tail(idle) is None and through_binding(idle) is None
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    tails = []
    with torch.cuda.graph(graph):
        stream = torch.cuda.current_stream().cuda_stream
        for out in (first, second):
            spec[jc.cdiv(n, 256), 256](x, y, out, n)
            tails.append((backend.capture_tail(stream), through_binding(stream)))
    kernels = {(int(node.handle),) for node in backend.graph_nodes(graph.raw_cuda_graph()) if node.kind == "kernel"}
    assert len(kernels) == 2
    assert {tail for tail, _ in tails} == kernels
    assert all(tail == binding for tail, binding in tails)
    graph.reset()


def test_graph_nodes_read_from_c_are_the_bindings(monkeypatch):
    """The node reads of an analysis through the C helper (where it was built) give the
    same nodes as cuda-bindings' calls: kernels with their launch geometry and parameters,
    copies and memsets with their addresses, in the same order."""
    backend = get_backend()
    if not getattr(backend, "native", False):
        pytest.skip("the C helper is not used on this machine (JITCORE_NATIVE=0 or not built)")
    assert backend._native_node_reads is not None and backend._native_read_params is not None
    n = 5000
    x, y, out = torch.randn(n, device="cuda"), torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    spec = add_kernel.instantiate(torch.float32)
    spec[jc.cdiv(n, 256), 256](x, y, out, n)  # compile and load before capture
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        spec[jc.cdiv(n, 256), 256](x, y, out, n)
        y.copy_(out)  # a copy node
        x.zero_()  # a memset node (or a fill kernel)
        spec[jc.cdiv(n // 2, 128), 128](out, out, y, n // 2)
    sizes = [t.size for t in spec.layout.types]
    function = spec.function(torch.cuda.current_device()).address

    def ours(nodes):  # our kernel's nodes, whose parameter sizes are known
        return [node for node in nodes if node.kind == "kernel" and node.function == function]

    from_c = backend.graph_nodes(graph.raw_cuda_graph())
    read_from_c = [backend.read_kernel_params(node, sizes) for node in ours(from_c)]
    monkeypatch.setattr(backend, "_native_node_reads", None)
    monkeypatch.setattr(backend, "_native_read_params", None)
    from_binding = backend.graph_nodes(graph.raw_cuda_graph())
    read_from_binding = [backend.read_kernel_params(node, sizes) for node in ours(from_binding)]
    assert {node.kind for node in from_c} >= {"kernel", "memcpy"}
    assert len(from_c) == len(from_binding) >= 4
    for a, b in zip(from_c, from_binding):
        assert (a.index, int(a.handle), a.kind, a.function) == (b.index, int(b.handle), b.kind, b.function)
        assert (a.grid, a.block, a.shared_bytes, a.params_address, a.pointers) == (
            b.grid,
            b.block,
            b.shared_bytes,
            b.params_address,
            b.pointers,
        )
        assert type(a.handle) is type(b.handle)
    assert read_from_c == read_from_binding and len(read_from_c) == 2
    by_block = {node.block: raw for node, raw in zip(ours(from_c), read_from_c)}
    pointers = {block: [struct.unpack("<Q", raw[i])[0] for i in range(3)] for block, raw in by_block.items()}
    assert pointers == {
        (256, 1, 1): [x.data_ptr(), y.data_ptr(), out.data_ptr()],
        (128, 1, 1): [out.data_ptr(), out.data_ptr(), y.data_ptr()],
    }
    assert struct.unpack("<q", by_block[(128, 1, 1)][3])[0] == n // 2
    graph.reset()


@pytest.mark.parametrize("through", ["c", "binding"])
def test_copy_nodes_appended_to_a_graph_run_after_every_node_and_retarget(monkeypatch, through):
    """``append_copies``: each copy a memcpy node after every node the graph holds (the outputs'
    own memory of a recording), through the C helper and through cuda-bindings alike; the node
    reads see it as a copy between those addresses, and a retargeted copy writes elsewhere."""
    backend = get_backend()
    if not hasattr(backend, "_native_add_memcpy"):
        pytest.skip("a backend without copy nodes of its own (it captures the copies)")
    if through == "binding":
        monkeypatch.setattr(backend, "_native_add_memcpy", None)
    elif backend._native_add_memcpy is None:
        pytest.skip("the C helper is not used on this machine (JITCORE_NATIVE=0 or not built)")
    n, device = 5000, torch.cuda.current_device()
    x, y, out = torch.randn(n, device="cuda"), torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    spec = add_kernel.instantiate(torch.float32)
    spec[jc.cdiv(n, 256), 256](x, y, out, n)  # compile and load before capture
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        spec[jc.cdiv(n, 256), 256](x, y, out, n)
        spec[jc.cdiv(n, 256), 256](out, y, out, n)  # out = x + 2y: the copy must see both
    own, head = poison(n, torch.float32), poison(16, torch.float32)
    copies = [(own.data_ptr(), out.data_ptr(), 4 * n), (head.data_ptr(), out.data_ptr(), 64)]
    backend.append_copies(graph.raw_cuda_graph(), copies, device)
    nodes = backend.graph_nodes(graph.raw_cuda_graph())
    memcpy = [node for node in nodes if node.kind == "memcpy"]
    assert [node.pointers for node in memcpy] == [(out.data_ptr(), own.data_ptr()), (out.data_ptr(), head.data_ptr())]
    graph.instantiate()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(own, x + y + y) and torch.equal(head, own[:16])
    elsewhere = poison(n, torch.float32)
    setter = backend.memcpy_retargeter(graph.raw_cuda_graph_exec(), memcpy[0], device)
    setter(elsewhere.data_ptr())
    x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(elsewhere, x + y + y) and not torch.equal(own, elsewhere)
    graph.reset()
