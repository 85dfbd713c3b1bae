"""The element types jitcore knows, under one name each.

A signature names a dtype by a short string ("float32", "float8_e4m3fn"), never by a torch
object, so that signatures built from torch tensors and from any other DLPack producer are
byte-identical and readable in error messages. Vendor C type names live in the backends.
"""

from __future__ import annotations

import attrs
import torch

from jitcore import dlpack


@attrs.frozen
class DType:
    """One element type: its name, storage size and how DLPack spells it."""

    name: str
    torch_dtype: torch.dtype
    itemsize: int  # bytes per stored element (float4_e2m1fn_x2 packs two values in one byte)
    dlpack: tuple[int, int, int]  # (type code, bits, lanes)
    kind: str  # "float", "int", "uint", "bool", "complex", "fp8", "fp4"

    @property
    def is_complex(self) -> bool:
        return self.kind == "complex"


def _table() -> list[DType]:
    entries = [
        ("float32", "float32", 4, (dlpack.DL_FLOAT, 32, 1), "float"),
        ("float64", "float64", 8, (dlpack.DL_FLOAT, 64, 1), "float"),
        ("float16", "float16", 2, (dlpack.DL_FLOAT, 16, 1), "float"),
        ("bfloat16", "bfloat16", 2, (dlpack.DL_BFLOAT, 16, 1), "float"),
        ("int8", "int8", 1, (dlpack.DL_INT, 8, 1), "int"),
        ("int16", "int16", 2, (dlpack.DL_INT, 16, 1), "int"),
        ("int32", "int32", 4, (dlpack.DL_INT, 32, 1), "int"),
        ("int64", "int64", 8, (dlpack.DL_INT, 64, 1), "int"),
        ("uint8", "uint8", 1, (dlpack.DL_UINT, 8, 1), "uint"),
        ("uint16", "uint16", 2, (dlpack.DL_UINT, 16, 1), "uint"),
        ("uint32", "uint32", 4, (dlpack.DL_UINT, 32, 1), "uint"),
        ("uint64", "uint64", 8, (dlpack.DL_UINT, 64, 1), "uint"),
        ("bool", "bool", 1, (dlpack.DL_BOOL, 8, 1), "bool"),
        ("complex32", "complex32", 4, (dlpack.DL_COMPLEX, 32, 1), "complex"),
        ("complex64", "complex64", 8, (dlpack.DL_COMPLEX, 64, 1), "complex"),
        ("complex128", "complex128", 16, (dlpack.DL_COMPLEX, 128, 1), "complex"),
        ("float8_e4m3fn", "float8_e4m3fn", 1, (dlpack.DL_FLOAT8_E4M3FN, 8, 1), "fp8"),
        ("float8_e4m3fnuz", "float8_e4m3fnuz", 1, (dlpack.DL_FLOAT8_E4M3FNUZ, 8, 1), "fp8"),
        ("float8_e5m2", "float8_e5m2", 1, (dlpack.DL_FLOAT8_E5M2, 8, 1), "fp8"),
        ("float8_e5m2fnuz", "float8_e5m2fnuz", 1, (dlpack.DL_FLOAT8_E5M2FNUZ, 8, 1), "fp8"),
        ("float8_e8m0fnu", "float8_e8m0fnu", 1, (dlpack.DL_FLOAT8_E8M0FNU, 8, 1), "fp8"),
        ("float4_e2m1fn_x2", "float4_e2m1fn_x2", 1, (dlpack.DL_FLOAT4_E2M1FN, 4, 2), "fp4"),
    ]
    table = []
    for name, attr, itemsize, code, kind in entries:
        torch_dtype = getattr(torch, attr, None)
        if torch_dtype is not None:  # older torch builds lack some fp8/fp4 types
            table.append(DType(name, torch_dtype, itemsize, code, kind))
    return table


ALL: tuple[DType, ...] = tuple(_table())
BY_TORCH: dict[torch.dtype, DType] = {d.torch_dtype: d for d in ALL}
BY_NAME: dict[str, DType] = {d.name: d for d in ALL}
BY_DLPACK: dict[tuple[int, int, int], DType] = {d.dlpack: d for d in ALL}


def from_torch(dtype: torch.dtype) -> DType:
    try:
        return BY_TORCH[dtype]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} is not supported by jitcore (supported: {', '.join(d.name for d in ALL)})"
        ) from None
