"""Staging copies: a jit kernel that copies one tensor's elements into another of any layout.

A staged input is replaced, inside the graph, by a buffer the graph owns; the graph starts with
a copy from the caller's tensor into that buffer (and, for inputs the region writes, ends
with a copy back). Both copies are ordinary jit launches, so their pointers into the caller's
tensor are rebound like any other: staging costs one copy kernel inside the graph launch, not
a separate copy launched from Python.
"""

from __future__ import annotations

import torch

import jitcore as jc

MAX_RANK = 6

_SOURCE = r"""
template <typename T, int RANK>
__global__ void copy_strided(const void* __restrict__ src_, void* __restrict__ dst_, long long numel,
                             long long n0, long long n1, long long n2, long long n3, long long n4, long long n5,
                             long long a0, long long a1, long long a2, long long a3, long long a4, long long a5,
                             long long b0, long long b1, long long b2, long long b3, long long b4, long long b5) {
    const T* src = static_cast<const T*>(src_);
    T* dst = static_cast<T*>(dst_);
    const long long sizes[6] = {n0, n1, n2, n3, n4, n5};
    const long long from[6] = {a0, a1, a2, a3, a4, a5};
    const long long to[6] = {b0, b1, b2, b3, b4, b5};
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < numel;
         i += (long long)gridDim.x * blockDim.x) {
        long long rest = i, s = 0, d = 0;
        #pragma unroll
        for (int k = RANK - 1; k >= 0; --k) {
            long long index = rest % sizes[k];
            rest /= sizes[k];
            s += index * from[k];
            d += index * to[k];
        }
        dst[d] = src[s];
    }
}
"""
#: The kernel element type and the integer view of each element size (shared with replay.padding).
ELEMENT_TYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
copy_kernel = jc.Kernel(_SOURCE, "copy_strided")


def padded(values: tuple, fill: int) -> list[int]:
    return list(values) + [fill] * (MAX_RANK - len(values))


@jc.jit
def copy_tensor(src, dst, element: jc.Constexpr[str], rank: jc.Constexpr[int]):
    numel = dst.numel()
    sizes = padded(dst.shape, 1)
    blocks = jc.min(jc.cdiv(numel, 256), 4096)
    copy_kernel.instantiate(element, rank)[blocks, 256](
        src, dst, numel, *sizes, *padded(src.stride(), 0), *padded(dst.stride(), 0)
    )


def unsupported_reason(tensor: torch.Tensor) -> str | None:
    if tensor.ndim > MAX_RANK:
        return f"staging handles up to {MAX_RANK} dimensions, this input has {tensor.ndim}"
    if tensor.element_size() not in ELEMENT_TYPES:
        return f"staging copies elements of 1, 2, 4 or 8 bytes, this input's are {tensor.element_size()}"
    return None


def staged_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """A buffer the graph owns, with the input's exact shape and strides."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)


INTEGER_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _argument(tensor: torch.Tensor) -> torch.Tensor | jc.TensorAdaptor:
    """How the copy is given ``tensor``, so that one call state serves every shape of a layout
    (a static description compiled one for each new shape recorded). Usually its bytes as
    integers of its element size: a plain torch tensor's key is layout-dynamic already, and
    the lean path is far cheaper than an adaptor's. A tensor without
    a unit-stride axis, or one that cannot be viewed so (a subclass, a conjugate or negative
    view, a 0-d tensor), goes through an adaptor with every size and stride dynamic."""
    if (
        type(tensor) is torch.Tensor
        and tensor.ndim
        and 1 in tensor.stride()
        and not tensor.is_conj()
        and not tensor.is_neg()
    ):
        return tensor.view(INTEGER_VIEWS[tensor.element_size()])
    dims = range(tensor.ndim)
    return jc.from_dlpack(tensor).mark_shape_dynamic(dims).mark_stride_dynamic(dims)


def _arguments(src: torch.Tensor, dst: torch.Tensor) -> tuple:
    element = ELEMENT_TYPES[src.element_size()]
    return (_argument(src), _argument(dst), element, max(dst.ndim, 1))


def prepare(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Compile the copy for this layout before capture (compiling inside one is refused)."""
    if src.numel():
        jc.compile(copy_tensor, *_arguments(src, dst))


def copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` (same shape and dtype) on the current stream."""
    if src.numel():
        copy_tensor(*_arguments(src, dst))
