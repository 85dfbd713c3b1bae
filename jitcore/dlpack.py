"""Reading a DLPack capsule without importing any framework.

The full (miss-path) tensor signature is built from what a producer exports through DLPack,
so that any producer (torch, numpy, cupy, ...) is described the same way. This module only
reads the exported ``DLTensor``; it never takes ownership, so the capsule's own destructor
frees the export when the capsule is dropped.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import attrs

# DLDeviceType values from dlpack.h.
DL_CPU = 1
DL_CUDA = 2
DL_CUDA_HOST = 3
DL_ROCM = 10
DL_ROCM_HOST = 11
DL_CUDA_MANAGED = 13

# DLDataTypeCode values from dlpack.h (v1.1).
DL_INT = 0
DL_UINT = 1
DL_FLOAT = 2
DL_BFLOAT = 4
DL_COMPLEX = 5
DL_BOOL = 6
DL_FLOAT8_E3M4 = 7
DL_FLOAT8_E4M3 = 8
DL_FLOAT8_E4M3B11FNUZ = 9
DL_FLOAT8_E4M3FN = 10
DL_FLOAT8_E4M3FNUZ = 11
DL_FLOAT8_E5M2 = 12
DL_FLOAT8_E5M2FNUZ = 13
DL_FLOAT8_E8M0FNU = 14
DL_FLOAT6_E2M3FN = 15
DL_FLOAT6_E3M2FN = 16
DL_FLOAT4_E2M1FN = 17


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


@attrs.frozen
class DLPackView:
    """What a DLPack export says about a tensor, in framework-neutral terms."""

    data: int  # data pointer plus byte_offset
    device_type: int
    device_id: int
    dtype_code: int
    dtype_bits: int
    dtype_lanes: int
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None  # in elements; None means compact row-major
    read_only: bool


def read_capsule(capsule: object) -> DLPackView:
    """Decode a legacy (``dltensor``) or versioned (``dltensor_versioned``) capsule."""
    read_only = False
    if _capsule_is_valid(capsule, b"dltensor"):
        address = _capsule_get_pointer(capsule, b"dltensor")
        tensor = _DLTensor.from_address(address)  # DLManagedTensor starts with its DLTensor
    elif _capsule_is_valid(capsule, b"dltensor_versioned"):
        address = _capsule_get_pointer(capsule, b"dltensor_versioned")
        managed = _DLManagedTensorVersioned.from_address(address)
        tensor = managed.dl_tensor
        read_only = bool(managed.flags & 1)
    else:
        raise TypeError("object is not an unconsumed DLPack capsule")
    ndim = tensor.ndim
    shape = tuple(tensor.shape[i] for i in range(ndim))
    strides = tuple(tensor.strides[i] for i in range(ndim)) if tensor.strides else None
    return DLPackView(
        data=(tensor.data or 0) + tensor.byte_offset,
        device_type=tensor.device.device_type,
        device_id=tensor.device.device_id,
        dtype_code=tensor.dtype.code,
        dtype_bits=tensor.dtype.bits,
        dtype_lanes=tensor.dtype.lanes,
        shape=shape,
        strides=strides,
        read_only=read_only,
    )


class SupportsDLPack(Protocol):
    """A DLPack producer: what :func:`export` reads."""

    def __dlpack__(self) -> object: ...


def export(obj: SupportsDLPack) -> DLPackView:
    """Export ``obj`` through its ``__dlpack__`` method and decode the result."""
    return read_capsule(obj.__dlpack__())
