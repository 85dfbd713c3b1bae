"""A padded argument's copy in one kernel launch (bucketing pads every call that is not
exactly a bucket's size).

``torch.constant_pad_nd`` allocates the padded tensor, fills it and copies the call's rows
through torch's dispatcher: about 20 us of host time a call on the H200 machine, a quarter of a
bucketed step of a six-layer region. Here a contiguous tensor is padded by one jit launch that
writes every element of the padded tensor once (the call's rows copied, the others ``fill``)
into a tensor from ``new_empty``: about 10 us. Anything else goes through ``constant_pad_nd``
as before: a tensor that is not contiguous, not on a GPU, empty, of an element size other
than 1, 2, 4 or 8 bytes, or one that requires grad (the kernel records no autograd). Both
give the same tensor bit for bit (shape, contiguity, every byte), tested against each other
on the GPU.
"""

from __future__ import annotations

import torch

import jitcore as jc
from jitcore import errors
from jitcore.recorder import CAPTURES

_SOURCE = r"""
template <typename T>
__global__ void pad_along(const void* __restrict__ src_, void* __restrict__ dst_, long long total,
                          long long inner, long long rows, long long bucket, unsigned long long fill_bits) {
    const T* src = static_cast<const T*>(src_);
    T* dst = static_cast<T*>(dst_);
    const T fill = *reinterpret_cast<const T*>(&fill_bits);  // the low bytes: little-endian
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long row = (i / inner) % bucket;
        dst[i] = row < rows ? src[(i / (inner * bucket) * rows + row) * inner + i % inner] : fill;
    }
}
"""
_ELEMENT_TYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
_INTEGER_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
pad_kernel = jc.Kernel(_SOURCE, "pad_along")


@jc.jit
def pad_along(src, dst, fill_bits, element: jc.Constexpr[str], dim: jc.Constexpr[int]):
    """Write ``dst`` (contiguous, ``src``'s shape but longer along ``dim``): ``src``'s
    elements where it has them, ``fill_bits`` (the fill's bytes) elsewhere."""
    inner = 1
    for size in dst.shape[dim + 1 :]:
        inner = inner * size
    total = dst.numel()
    blocks = jc.min(jc.cdiv(total, 256), 4096)
    pad_kernel.instantiate(element)[blocks, 256](src, dst, total, inner, src.shape[dim], dst.shape[dim], fill_bits)


#: What the jit refuses before any GPU work (a dtype or device it does not take, no compiler):
#: torch pads those calls instead.
_REFUSALS = (
    errors.UnsupportedTensorError,
    errors.ArgumentError,
    errors.LayoutError,
    errors.DeviceError,
    errors.CompileError,
    errors.BackendUnavailableError,
)

#: (dtype, rank, dim, device) the jit refused once: not tried again (a failed compile costs much).
_REFUSED: set[tuple] = set()

#: The pad's first launch compiles and loads its kernel: not while another thread captures.
_SHARED_CAPTURE_EXCLUSION = CAPTURES.shared()

#: The fill's bytes as an unsigned integer, by (fill's type, its repr, dtype): computing them
#: goes through a tensor (microseconds), and a bucketed loop pads on every call. The repr keeps
#: -0.0 and 0.0 apart and makes NaN a key like any other (NaN equals nothing).
_FILL_BITS: dict[tuple, int] = {}


def _fill_bits(fill: bool | int | float, dtype: torch.dtype) -> int:
    key = (fill.__class__, repr(fill), dtype)
    bits = _FILL_BITS.get(key)
    if bits is None:
        size = dtype.itemsize
        bits = torch.tensor([fill], dtype=dtype).view(_INTEGER_VIEWS[size]).item() % (1 << (8 * size))
        _FILL_BITS[key] = bits
    return bits


def pad(tensor: torch.Tensor, dim: int, size: int, fill: bool | int | float) -> torch.Tensor:
    """``tensor`` grown along ``dim`` to ``size`` with ``fill`` (exact in its dtype, which
    ``replay.padded`` checked): a new contiguous tensor, as ``constant_pad_nd`` makes it."""
    if tensor.is_cuda and type(tensor) is torch.Tensor and not tensor.requires_grad and tensor.is_contiguous():
        element = _ELEMENT_TYPES.get(tensor.element_size()) if tensor.numel() else None
        refusal = (tensor.dtype, tensor.dim(), dim, tensor.get_device())
        if element is not None and refusal not in _REFUSED and not tensor.is_conj() and not tensor.is_neg():
            shape = list(tensor.shape)
            shape[dim] = size
            grown = tensor.new_empty(shape)
            try:
                with _SHARED_CAPTURE_EXCLUSION:
                    pad_along(tensor, grown, _fill_bits(fill, tensor.dtype), element, dim)
            except _REFUSALS:  # raised before any GPU work: torch pads it, now and from now on
                _REFUSED.add(refusal)
            except errors.CaptureMissError:  # its first call inside someone's capture: torch, this once
                pass
            else:
                return grown
    widths = [0, 0] * (tensor.dim() - 1 - dim) + [0, size - tensor.shape[dim]]  # last dimension first
    return torch.constant_pad_nd(tensor, widths, fill)
