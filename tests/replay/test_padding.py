"""replay.padding: a padded argument's copy in one jit launch.

On the CPU with the driver double: what the launch is given (sizes, the fill's bytes), which
calls share a call state, and torch's way for every tensor the kernel does not take. On the
GPU for real: bit for bit what ``torch.constant_pad_nd`` makes, over dtypes, shapes, dims and
fills, into memory poisoned beforehand."""

from __future__ import annotations

import math
import struct
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jitcore.backends import use_backend
from replay import padding
from tests.jitcore.fakes import CountingBackend, track_layouts

_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]
_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fills(dtype: torch.dtype) -> st.SearchStrategy:
    if dtype == torch.bool:
        return st.sampled_from([False, True, 0, 1])
    if dtype.is_floating_point:
        return st.sampled_from([0, 0.0, -0.0, 1.5, -7, math.inf, -math.inf, math.nan])
    if dtype == torch.uint8:
        return st.sampled_from([0, 3, 255, 1.0, True])
    return st.sampled_from([0, 3, -1, 1.0, True])


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers: equal bits, NaN payloads and -0.0 included."""
    return tensor.contiguous().view(_INTEGERS[tensor.element_size()])


def _reference(tensor: torch.Tensor, dim: int, size: int, fill) -> torch.Tensor:
    widths = [0, 0] * (tensor.dim() - 1 - dim) + [0, size - tensor.shape[dim]]
    return torch.constant_pad_nd(tensor, widths, fill)


@pytest.fixture
def backend():
    fake = CountingBackend()
    padding.pad_along.cache_clear()
    try:
        with use_backend(fake):
            yield fake
    finally:
        padding.pad_along.cache_clear()


def test_the_fills_bytes_are_the_dtypes_own():
    for dtype in _DTYPES:
        for fill in [False, True] if dtype == torch.bool else [0, 1, 3, 1.0, True]:
            expected = torch.full((1,), fill, dtype=dtype).view(_INTEGERS[dtype.itemsize]).item()
            assert padding.fill_bits(fill, dtype) == expected % (1 << (8 * dtype.itemsize))
    assert padding.fill_bits(-0.0, torch.float32) == 0x80000000
    assert padding.fill_bits(0.0, torch.float32) == 0  # after -0.0: cached apart
    assert padding.fill_bits(-1, torch.int16) == 0xFFFF
    assert padding.fill_bits(math.nan, torch.float16) == padding.fill_bits(float("nan"), torch.float16)
    assert padding.fill_bits(1.5, torch.bfloat16) == 0x3FC0


def test_the_launch_is_given_the_padded_geometry_and_the_fill(backend):
    src, dst = torch.randn(3, 5, 7), torch.empty(3, 8, 7)
    track_layouts(backend, padding.pad_kernel.instantiate("unsigned int"))
    padding.pad_along(src, dst, 0xDEADBEEF, "unsigned int", 1)
    backend.calls.clear()
    padding.pad_along(src, dst, 0xDEADBEEF, "unsigned int", 1)
    (call,) = backend.calls
    params = call[-1]  # src, dst, total, inner, rows, bucket, fill bits
    assert struct.unpack("<Q", params[0])[0] == src.data_ptr() and struct.unpack("<Q", params[1])[0] == dst.data_ptr()
    total, inner, rows, bucket = (struct.unpack("<q", p)[0] for p in params[2:6])
    assert (total, inner, rows, bucket) == (3 * 8 * 7, 7, 5, 8)
    assert struct.unpack("<Q", params[6])[0] == 0xDEADBEEF
    assert call[1][0] == -(-total // 256) and call[2] == (256, 1, 1)


def test_one_call_state_serves_every_size_of_a_rank_and_dim(backend):
    for rows, bucket in ((1, 2), (3, 4), (100, 128), (0, 8)):
        padding.pad_along(torch.randn(rows, 64), torch.empty(bucket, 64), 0, "unsigned int", 0)
    assert padding.pad_along.cache_info().states == 1
    padding.pad_along(torch.randn(4, 3), torch.empty(4, 8), 0, "unsigned int", 1)  # another dim
    padding.pad_along(torch.randn(4, 3, 2), torch.empty(8, 3, 2), 0, "unsigned int", 0)  # another rank
    assert padding.pad_along.cache_info().states == 3


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_tensors_the_kernel_does_not_take_are_padded_by_torch(data):
    # on the CPU every tensor goes torch's way; the result is constant_pad_nd's exactly
    dtype = data.draw(st.sampled_from(_DTYPES), label="dtype")
    shape = data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=3), label="shape")
    dim = data.draw(st.integers(0, len(shape) - 1), label="dim")
    fill = data.draw(_fills(dtype), label="fill")
    tensor = (torch.randn(*shape) * 50).to(dtype)
    got = padding.pad(tensor, dim, shape[dim] + 3, fill, padding.fill_bits(fill, dtype))
    assert torch.equal(_bits(got), _bits(_reference(tensor, dim, shape[dim] + 3, fill)))


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _poison_the_allocator(nbytes: int) -> None:
    """Leave freed blocks full of 0xA5 bytes in torch's cache, which new_empty then reuses:
    a kernel that skipped an element would leave poison, not zeros."""
    for size in {nbytes, 2 * nbytes, 512, 2 << 20}:
        torch.full((size,), 0xA5, dtype=torch.uint8, device="cuda")


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_the_kernel_pads_bit_for_bit_as_torch(data):
    dtype = data.draw(st.sampled_from(_DTYPES), label="dtype")
    shape = data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=4), label="shape")
    dim = data.draw(st.integers(0, len(shape) - 1), label="dim")
    extra = data.draw(st.sampled_from([0, 1, 7, 300]), label="rows added")
    fill = data.draw(_fills(dtype), label="fill")
    tensor = (torch.randn(*shape, device="cuda") * 50).to(dtype)
    expected = _reference(tensor, dim, shape[dim] + extra, fill)
    _poison_the_allocator(expected.numel() * expected.element_size())
    with mock.patch.object(torch, "constant_pad_nd", None):  # a contiguous CUDA tensor never goes torch's way
        got = padding.pad(tensor, dim, shape[dim] + extra, fill, padding.fill_bits(fill, dtype))
    assert got.shape == expected.shape and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(_bits(got), _bits(expected))


@pytest.mark.gpu
@needs_gpu
def test_on_the_gpu_tensors_the_kernel_does_not_take_go_torchs_way():
    base = torch.randn(6, 10, device="cuda")
    cases = {
        "transposed": base.t(),
        "strided": base[:, ::2],
        "requires grad": base.clone().requires_grad_(True),
        "empty": base[:0],
        "complex": torch.randn(3, 4, dtype=torch.complex128, device="cuda"),
    }
    for name, tensor in cases.items():
        got = padding.pad(tensor, 0, tensor.shape[0] + 2, 0, padding.fill_bits(0, tensor.dtype))
        expected = _reference(tensor, 0, tensor.shape[0] + 2, 0)
        assert torch.equal(got, expected), name
        assert got.requires_grad == expected.requires_grad, name


@pytest.mark.gpu
@needs_gpu
def test_a_first_pad_inside_someone_elses_capture_goes_torchs_way():
    # the jit refuses to compile inside a capture (CaptureMissError, before any GPU work):
    # that call pads with constant_pad_nd, captured like any torch op, and nothing is remembered
    padding.pad_along.cache_clear()
    x = torch.randn(3, 5, dtype=torch.float64, device="cuda")
    expected = _reference(x, 1, 9, 1.5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = padding.pad(x, 1, 9, 1.5, padding.fill_bits(1.5, x.dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(_bits(got), _bits(expected))
    assert (x.dtype, 2, 1, x.get_device()) not in padding._REFUSED
    again = padding.pad(x, 1, 9, 1.5, padding.fill_bits(1.5, x.dtype))  # outside: the kernel, compiled now
    assert torch.equal(_bits(again), _bits(expected)) and padding.pad_along.cache_info().states == 1


def test_fills_a_loop_makes_up_keep_a_bounded_cache():
    for n in range(3 * padding._FILL_BITS_KEPT):
        assert padding.fill_bits(n + 0.5, torch.float32) == struct.unpack("<I", struct.pack("<f", n + 0.5))[0]
    assert len(padding._FILL_BITS) <= padding._FILL_BITS_KEPT
