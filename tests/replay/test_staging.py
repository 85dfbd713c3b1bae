"""replay.staging: the copy kernel that moves a staged input into a graph's buffer and back.

On the CPU with the driver double (which shapes share a call state, what is packed); on the
GPU for real (every layout copied bit for bit)."""

from __future__ import annotations

import struct

import pytest
import torch

from jitcore.backends import use_backend
from replay import staging
from tests.jitcore.fakes import CountingBackend, track_layouts

LAYOUTS = [
    lambda: torch.randn(1, 512),
    lambda: torch.randn(7, 512),
    lambda: torch.randn(300, 64),
    lambda: torch.randn(64, 33).t(),  # no unit stride on the last axis
    lambda: torch.randn(9, 40)[:, ::3],  # no unit-stride axis at all
    lambda: torch.randn(5, 6, 7)[1:, :, 2:].transpose(0, 2)[:, :, :2],
]


@pytest.fixture
def backend():
    """The driver double, and the copy's call states made against it dropped before and after
    (they launch through the backend they were made with)."""
    fake = CountingBackend()
    staging.copy_tensor.cache_clear()
    try:
        with use_backend(fake):
            yield fake
    finally:
        staging.copy_tensor.cache_clear()


def test_one_call_state_serves_every_shape_of_a_layout(backend):
    """A static description of the tensors compiled a call state per new shape (about a
    millisecond of every recording that stages an input): states follow layouts only."""
    for make in LAYOUTS:
        src = make()
        dst = staging.staged_buffer(src)
        staging.prepare(src, dst)
        staging.prepare(dst, src)
    states = staging.copy_tensor.cache_info().states
    assert states <= 2 * len(LAYOUTS)
    for rows in (2, 3, 17, 250):  # more shapes of the same layouts: no new state
        for src in (torch.randn(rows, 512), torch.randn(64, rows).t(), torch.randn(rows, 40)[:, ::3]):
            staging.prepare(src, staging.staged_buffer(src))
            staging.copy(src, staging.staged_buffer(src))
    assert staging.copy_tensor.cache_info().states == states


def test_the_copy_is_given_every_size_and_stride(backend):
    src = torch.randn(9, 40)[:, ::3]
    dst = torch.empty(9, 14).t().contiguous().t()  # another layout of the same shape
    track_layouts(backend, staging.copy_kernel.instantiate("unsigned int", 2))
    staging.copy(src, dst)  # a first call compiles
    backend.calls.clear()
    staging.copy(src, dst)
    (call,) = backend.calls
    params = call[-1]  # each parameter's bytes: src, dst, numel, n0..n5, a0..a5, b0..b5
    assert struct.unpack("<Q", params[0])[0] == src.data_ptr() and struct.unpack("<Q", params[1])[0] == dst.data_ptr()
    numbers = [struct.unpack("<q", p)[0] for p in params[2:]]
    numel, sizes, source, target = numbers[0], tuple(numbers[1:7]), tuple(numbers[7:13]), tuple(numbers[13:19])
    assert numel == 9 * 14 and sizes == (9, 14, 1, 1, 1, 1)
    assert source == (*src.stride(), 0, 0, 0, 0) and target == (*dst.stride(), 0, 0, 0, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.uint8, torch.bool, torch.complex64])
def test_every_layout_is_copied_bit_for_bit(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for make in LAYOUTS:
        base = make()
        # the layout's own strides kept on the GPU (a plain .cuda() of a view makes it contiguous)
        src = torch.empty_strided(base.shape, base.stride(), dtype=dtype, device="cuda")
        src.copy_((base * 100).to(dtype) if dtype is not torch.bool else base > 0)
        dst = staging.staged_buffer(src)
        dst.fill_(7)  # poisoned
        staging.prepare(src, dst)
        staging.copy(src, dst)
        back = torch.full_like(src, 3)
        staging.copy(dst, back)
        torch.cuda.synchronize()
        assert torch.equal(dst, src) and torch.equal(back, src)
        assert dst.stride() == src.stride()
