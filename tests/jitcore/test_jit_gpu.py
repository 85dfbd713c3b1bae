"""@jit launchers on a real GPU, against torch on fresh random data."""

from __future__ import annotations

import pytest
import torch

import jitcore as jc

pytestmark = pytest.mark.gpu

BROADCAST_ADD = r"""
template <typename T>
__global__ void bcast_mul_add(const T* a, const T* b, T* out, float alpha, int rows, int cols,
                              long long a_rs, long long a_cs, long long b_rs, long long b_cs, long long o_rs) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int r = blockIdx.y;
    if (c < cols) {
        float av = (float)a[r * a_rs + c * a_cs];
        float bv = (float)b[r * b_rs + c * b_cs];
        out[r * o_rs + c] = (T)(alpha * av + bv);
    }
}
"""
SOFTMAX = r"""
template <int BLOCK>
__global__ void row_softmax(const float* __restrict__ x, float* __restrict__ out, int cols,
                            long long x_rs, long long o_rs) {
    __shared__ float scratch[BLOCK];
    const float* row = x + blockIdx.x * x_rs;
    float* orow = out + blockIdx.x * o_rs;
    float m = -3.402823466e+38f;
    for (int c = threadIdx.x; c < cols; c += BLOCK) m = fmaxf(m, row[c]);
    scratch[threadIdx.x] = m;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) scratch[threadIdx.x] = fmaxf(scratch[threadIdx.x], scratch[threadIdx.x + s]);
        __syncthreads();
    }
    m = scratch[0];
    __syncthreads();
    float sum = 0.f;
    for (int c = threadIdx.x; c < cols; c += BLOCK) sum += __expf(row[c] - m);
    scratch[threadIdx.x] = sum;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) scratch[threadIdx.x] += scratch[threadIdx.x + s];
        __syncthreads();
    }
    float inv = 1.f / scratch[0];
    for (int c = threadIdx.x; c < cols; c += BLOCK) orow[c] = __expf(row[c] - m) * inv;
}
"""
RMSNORM = r"""
template <typename T, int BLOCK>
__global__ void rmsnorm(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out, int cols, float eps) {
    __shared__ float scratch[BLOCK];
    const T* row = x + (long long)blockIdx.x * cols;
    float acc = 0.f;
    for (int c = threadIdx.x; c < cols; c += BLOCK) { float v = (float)row[c]; acc += v * v; }
    scratch[threadIdx.x] = acc;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) scratch[threadIdx.x] += scratch[threadIdx.x + s];
        __syncthreads();
    }
    float scale = rsqrtf(scratch[0] / cols + eps);
    for (int c = threadIdx.x; c < cols; c += BLOCK)
        out[(long long)blockIdx.x * cols + c] = (T)((float)row[c] * scale * (float)w[c]);
}
"""
SCALE_SHIFT = r"""
__global__ void scale(const float* x, float* y, float s, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; if (i < n) y[i] = x[i] * s;
}
__global__ void shift(const float* y, float* z, float t, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; if (i < n) z[i] = y[i] + t;
}
"""
bcast = jc.Kernel(BROADCAST_ADD, "bcast_mul_add")
softmax_kernel = jc.Kernel(SOFTMAX, "row_softmax")
rmsnorm_kernel = jc.Kernel(RMSNORM, "rmsnorm")
scale_kernel = jc.Kernel(SCALE_SHIFT, "scale")
shift_kernel = jc.Kernel(SCALE_SHIFT, "shift")


@jc.jit
def mul_add(a, b, out, alpha):
    rows, cols = out.shape
    bcast.instantiate(out.dtype)[(jc.cdiv(cols, 128), rows), 128](
        a, b, out, alpha, rows, cols, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0)
    )


@jc.jit
def softmax(x, out):
    softmax_kernel.instantiate(128)[x.shape[0], 128](x, out, x.shape[1], x.stride(0), out.stride(0))


@jc.jit
def rmsnorm(x, w, out, eps):
    rmsnorm_kernel.instantiate(x.dtype, 256)[x.shape[0], 256](x, w, out, x.shape[1], eps)


@jc.jit
def scale_then_shift(x, tmp, out, s, t):
    n = x.numel()
    scale_kernel[jc.cdiv(n, 256), 256](x, tmp, s, n)
    shift_kernel[jc.cdiv(n, 256), 256](tmp, out, t, n)


def nan_like(t):
    return torch.full_like(t, float("nan"))


@pytest.mark.parametrize(
    "make_a, make_b",
    [
        (lambda r, c: torch.randn(r, c, device="cuda"), lambda r, c: torch.randn(r, c, device="cuda")),
        (lambda r, c: torch.randn(1, c, device="cuda").expand(r, c), lambda r, c: torch.randn(r, c, device="cuda")),
        (
            lambda r, c: torch.randn(r, 1, device="cuda").expand(r, c),
            lambda r, c: torch.randn(c, device="cuda").expand(r, c),
        ),
        (lambda r, c: torch.randn(c, r, device="cuda").t(), lambda r, c: torch.randn(r, 2 * c, device="cuda")[:, ::2]),
    ],
    ids=["dense", "broadcast-rows", "broadcast-both", "transposed-and-strided"],
)
@pytest.mark.parametrize("shape", [(1, 1), (7, 300), (64, 1024)])
def test_elementwise_with_broadcast_inputs(make_a, make_b, shape):
    a, b = make_a(*shape), make_b(*shape)
    if a.stride(-1) != 1 and a.stride(0) != 1:
        a = jc.from_dlpack(a)
    if b.stride(-1) != 1 and b.stride(0) != 1:
        b = jc.from_dlpack(b)
    out = torch.full(shape, float("nan"), device="cuda")
    alpha = float(torch.rand(()).item() * 4 - 2)
    mul_add(a, b, out, alpha)
    ta = a.source if isinstance(a, jc.TensorAdaptor) else a
    tb = b.source if isinstance(b, jc.TensorAdaptor) else b
    torch.testing.assert_close(out, alpha * ta + tb, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 5), (33, 128), (256, 1000), (8, 4096)])
def test_row_softmax_with_shared_memory(shape):
    x = torch.randn(*shape, device="cuda") * 3
    out = nan_like(x)
    softmax(x, out)
    torch.testing.assert_close(out, torch.softmax(x, dim=1), rtol=2e-5, atol=1e-6)
    wide = torch.randn(shape[0], shape[1] + 64, device="cuda")[:, 32 : 32 + shape[1]]  # strided rows
    out2 = nan_like(x)
    softmax(wide, out2)
    torch.testing.assert_close(out2, torch.softmax(wide, dim=1), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (17, 4096), (128, 768)])
def test_rmsnorm(dtype, shape):
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    w = torch.randn(shape[1], device="cuda", dtype=dtype)
    out = torch.full_like(x, float("nan"))
    rmsnorm(x, w, out, 1e-6)
    xf = x.float()
    reference = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(dtype)
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out, reference, rtol=tolerance, atol=tolerance)


def test_two_kernels_where_the_second_reads_the_first():
    for n in (10, 4097, 1 << 18):
        x = torch.randn(n, device="cuda")
        tmp, out = nan_like(x), nan_like(x)
        s, t = float(torch.randn(()).item()), float(torch.randn(()).item())
        scale_then_shift(x, tmp, out, s, t)
        torch.testing.assert_close(out, x * s + t, rtol=0, atol=1e-6)
        assert torch.equal(tmp, x * s)


def test_compile_counts_dynamic_once_static_per_shape():
    @jc.jit
    def scaled(x, out, s):
        n = x.numel()
        scale_kernel[jc.cdiv(n, 256), 256](x, out, s, n)

    for n in (100, 200, 300, 100):
        x = torch.randn(n, device="cuda")
        out = nan_like(x)
        scaled(x, out, 2.0)
        assert torch.equal(out, x * 2)
    assert scaled.cache_info().compiles == 1
    for n in (100, 200, 300, 100):
        x = torch.randn(n, device="cuda")
        out = nan_like(x)
        scaled(jc.from_dlpack(x), jc.from_dlpack(out), 3.0)
        assert torch.equal(out, x * 3)
    assert scaled.cache_info().compiles == 4


def test_pinned_handle_matches_the_jit_function():
    x = torch.randn(5000, device="cuda")
    tmp, out = nan_like(x), nan_like(x)
    handle = jc.compile(scale_then_shift, x, tmp, out, 1.0, 1.0)
    x2 = torch.randn(777, device="cuda")
    tmp2, out2 = nan_like(x2), nan_like(x2)
    handle(x2, tmp2, out2, 0.5, -3.0)
    torch.testing.assert_close(out2, x2 * 0.5 - 3.0, rtol=0, atol=1e-6)


def test_launches_follow_the_current_stream_and_graph_capture():
    x = torch.randn(4096, device="cuda")
    tmp, out = nan_like(x), nan_like(x)
    scale_then_shift(x, tmp, out, 2.0, 1.0)  # warm: the key exists before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.fill_(float("nan"))
        scale_then_shift(x, tmp, out, 3.0, 1.0)
    stream.synchronize()
    assert torch.equal(out, x * 3.0 + 1.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scale_then_shift(x, tmp, out, 4.0, 1.0)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 4.0 + 1.0)


def test_a_miss_during_capture_is_refused_cleanly():
    @jc.jit
    def fresh(x, out):
        n = x.numel()
        scale_kernel[jc.cdiv(n, 256), 256](x, out, 1.0, n)

    x = torch.randn(64, device="cuda")
    out = nan_like(x)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(jc.CaptureMissError, match="call it once"), torch.cuda.graph(graph):
        fresh(x, out)
    assert fresh.cache_info().states == 0
    fresh(x, out)  # the process and the allocator are still fine
    torch.cuda.synchronize()
    assert torch.equal(out, x)


def test_errors_on_the_gpu_are_raised_before_any_launch():
    x = torch.randn(64, device="cuda")
    out = nan_like(x)
    with pytest.raises(jc.DeviceError, match="CPU tensor"):
        scale_then_shift(x.cpu(), out, out, 1.0, 1.0)
    with pytest.raises(jc.ArgumentError, match="dtype float16"):
        scale_then_shift(x.half(), out, out, 1.0, 1.0)
    # an empty tensor is a no-op launch (grid 0), as in torch and Triton
    scale_then_shift(
        torch.empty(0, device="cuda"), torch.empty(0, device="cuda"), torch.empty(0, device="cuda"), 1.0, 1.0
    )
    torch.cuda.synchronize()
    assert torch.isnan(out).all()


@pytest.mark.multigpu
def test_a_tensor_on_another_device_is_refused():
    x = torch.randn(64, device="cuda:1")
    with torch.cuda.device(0), pytest.raises(jc.DeviceError, match="cuda:1"):
        scale_then_shift(x, x, x, 1.0, 1.0)
