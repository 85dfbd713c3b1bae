"""A padded argument: its marker (what ``replay.padded`` makes, :class:`Padded`) and its copy
in one kernel launch (bucketing pads every call that is not exactly a bucket's size).

``torch.constant_pad_nd`` allocates the padded tensor, fills it and copies the call's rows
through torch's dispatcher, a large part of a bucketed step's host time. Here a contiguous
tensor is padded by one jit launch that writes every element of the padded tensor once (the
call's rows copied, the others ``fill``) into a tensor from ``new_empty``, with a single
dispatch of the allocation on its path. Anything else goes through ``constant_pad_nd``: a
tensor that is not contiguous, not on a GPU, empty, of an element size other
than 1, 2, 4 or 8 bytes, or one that requires grad (the kernel records no autograd). Both
give the same tensor bit for bit (shape, contiguity, every byte), tested against each other
on the GPU.
"""

from __future__ import annotations

import math

import torch

import jitcore as jc
from jitcore.for_replay import CAPTURES
from replay.staging import ELEMENT_TYPES, INTEGER_VIEWS


class Padded:
    """A region argument to pad to the session's bucket sizes (see :func:`padded`). Only a
    top-level argument of a region call (positional or keyword) may be one; it is unhashable,
    so anywhere else keying the call refuses it."""

    __slots__ = ("tensor", "dim", "fill", "written", "bits")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, tensor: torch.Tensor, dim: int, fill: bool | int | float, written: bool, bits: int):
        self.tensor, self.dim, self.fill, self.written = tensor, dim, fill, written
        self.bits = bits  # the fill's bytes in the tensor's dtype (replay.padding.fill_bits)

    def __repr__(self) -> str:
        return f"padded(<{tuple(self.tensor.shape)} {self.tensor.dtype}>, dim={self.dim}, fill={self.fill!r})"


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
    jc.UnsupportedTensorError,
    jc.ArgumentError,
    jc.LayoutError,
    jc.DeviceError,
    jc.CompileError,
    jc.BackendUnavailableError,
)

#: (dtype, rank, dim, device) the jit refused once: not tried again (a failed compile costs much).
_REFUSED: set[tuple] = set()


def _refusal(tensor: torch.Tensor, dim: int) -> tuple:
    return (tensor.dtype, tensor.dim(), dim, tensor.get_device())


#: The pad's first launch compiles and loads its kernel: not while another thread captures.
_SHARED_CAPTURE_EXCLUSION = CAPTURES.shared()

#: ``fill_bits`` answers by (fill's type, fill, its sign, dtype): ``replay.padded()`` runs on
#: every call of a bucketed loop, where converting the fill through a tensor would be paid each time.
#: Emptied beyond ``_FILL_BITS_KEPT`` answers (fills a loop makes up as it goes).
_FILL_BITS: dict[tuple, int | None] = {}
_FILL_BITS_KEPT = 1024
_UNKNOWN = object()


def fill_bits(fill: bool | int | float, dtype: torch.dtype) -> int | None:
    """The bytes of ``fill`` in ``dtype`` as an unsigned integer (what the kernel writes), or
    None where the fill is not exact in it: a value the dtype cannot hold or rounds, a sign
    it loses (-0.0 in an integer dtype), any fill of a complex dtype. ``replay.padded()``
    refuses those; 1, 1.0 and True, and 0.0 and -0.0, are answered apart."""
    if isinstance(fill, float):
        # NaN equals nothing, not even itself as a dictionary key: every NaN shares one entry
        key: tuple = (float, "nan", dtype) if math.isnan(fill) else (float, fill, math.copysign(1, fill), dtype)
    else:
        key = (fill.__class__, fill, dtype)
    bits = _FILL_BITS.get(key, _UNKNOWN)
    if bits is _UNKNOWN:
        if len(_FILL_BITS) >= _FILL_BITS_KEPT:
            _FILL_BITS.clear()
        bits = _FILL_BITS[key] = _exact_bits(fill, dtype)
    return bits


#: ``fill_bits(0, dtype)`` by dtype alone: ``replay.padded()``'s default fill, answered without
#: building ``fill_bits``'s key on every call of a bucketed loop.
_ZERO_BITS: dict[torch.dtype, int | None] = {}


def zero_fill_bits(dtype: torch.dtype) -> int | None:
    """``fill_bits(0, dtype)`` (the default fill), from a cache keyed by the dtype alone."""
    bits = _ZERO_BITS.get(dtype, _UNKNOWN)
    if bits is _UNKNOWN:
        bits = _ZERO_BITS[dtype] = fill_bits(0, dtype)
    return bits


def _exact_bits(fill: bool | int | float, dtype: torch.dtype) -> int | None:
    if dtype.is_complex:
        return None
    if dtype == torch.bool:
        return int(fill) if fill in (0, 1) else None
    nan = isinstance(fill, float) and math.isnan(fill)
    if nan and not dtype.is_floating_point:
        return None
    try:
        converted = torch.tensor(fill, dtype=dtype)
        value = converted.item()
    except (RuntimeError, OverflowError, ValueError):  # torch says "Overflow when unpacking long long"
        return None
    if not nan and (value != fill or (isinstance(fill, float) and math.copysign(1, value) != math.copysign(1, fill))):
        return None
    size = dtype.itemsize
    return converted.view(INTEGER_VIEWS[size]).item() % (1 << (8 * size))


def pad(tensor: torch.Tensor, dim: int, size: int, fill: bool | int | float, bits: int | None) -> torch.Tensor:
    """``tensor`` grown along ``dim`` to ``size`` with ``fill``, whose bytes in the tensor's
    dtype are ``bits`` (:func:`fill_bits`, which ``replay.padded`` computed): a new
    contiguous tensor, as ``constant_pad_nd`` makes it."""
    if _jit_pads(tensor, dim, bits):
        shape = list(tensor.shape)
        shape[dim] = size
        grown = tensor.new_empty(shape)
        if _pad_with_jit(tensor, grown, dim, bits):
            return grown
    widths = [0, 0] * (tensor.dim() - 1 - dim) + [0, size - tensor.shape[dim]]  # last dimension first
    return torch.constant_pad_nd(tensor, widths, fill)


def pad_into(tensor: torch.Tensor, dim: int, bits: int | None, out: torch.Tensor) -> bool:
    """Write what :func:`pad` returns into ``out`` (contiguous, of its dtype, shape and
    device: a graph's staged buffer), by the jit pad alone: False, and ``out`` untouched,
    where the jit cannot pad ``tensor`` (the caller pads it the usual way)."""
    return _jit_pads(tensor, dim, bits) and _pad_with_jit(tensor, out, dim, bits)


def _jit_pads(tensor: torch.Tensor, dim: int, bits: int | None) -> bool:
    """Whether the jit pad may take ``tensor`` (see the module docstring)."""
    return (
        tensor.is_cuda
        and type(tensor) is torch.Tensor
        and not tensor.requires_grad
        and tensor.is_contiguous()
        and bits is not None
        and bool(tensor.numel())
        and tensor.element_size() in ELEMENT_TYPES
        and not tensor.is_conj()
        and not tensor.is_neg()  # a lazily negated view: its memory holds the other sign
        and not (_REFUSED and _refusal(tensor, dim) in _REFUSED)
    )


def _pad_with_jit(tensor: torch.Tensor, out: torch.Tensor, dim: int, bits: int) -> bool:
    """Pad ``tensor`` into ``out`` by one jit launch; False where the jit refused it before
    any GPU work (torch pads it, now and from now on) or met its first call inside someone's
    capture (torch pads it this once)."""
    try:
        with _SHARED_CAPTURE_EXCLUSION:
            pad_along(tensor, out, bits, ELEMENT_TYPES[tensor.element_size()], dim)
    except _REFUSALS:
        _REFUSED.add(_refusal(tensor, dim))
        return False
    except jc.CaptureMissError:
        return False
    return True
