"""Kernel parameter ABI: C parameter types, their sizes and alignments, and packing.

Vendor-neutral: CUDA and HIP kernels take parameters the same way (an array of ``void*``, each
pointing at one parameter's bytes). A :class:`ParamLayout` places every parameter at its C
alignment inside one persistent buffer; :class:`PackedParams` owns that buffer and the ``void*``
array the driver reads; call states write only the slots whose value can change, with one
``struct.pack_into`` per run of such slots.
"""

from __future__ import annotations

import ctypes
import functools
import math
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs

from jitcore.errors import ArgumentError

# The C types the ABI knows, in one place: everything below is derived from these tables, so a
# spelling that parses as a scalar always has its pointee dtypes too (and is never an opaque
# pointee, which would take a tensor of any dtype).
#
# Canonical C scalar type -> (struct format, size, kind). kind: "int" (signed), "uint",
# "float", "bool", "half", "bfloat16". LP64 (long is 8 bytes) and a signed char, as on the
# Linux hosts and the GPUs jitcore targets.
_SCALAR_TYPES: dict[str, tuple[str, int, str]] = {
    "char": ("b", 1, "int"),
    "signed char": ("b", 1, "int"),
    "unsigned char": ("B", 1, "uint"),
    "short": ("h", 2, "int"),
    "unsigned short": ("H", 2, "uint"),
    "int": ("i", 4, "int"),
    "unsigned int": ("I", 4, "uint"),
    "long": ("q", 8, "int"),
    "unsigned long": ("Q", 8, "uint"),
    "long long": ("q", 8, "int"),
    "unsigned long long": ("Q", 8, "uint"),
    "bool": ("?", 1, "bool"),
    "float": ("f", 4, "float"),
    "double": ("d", 8, "float"),
    "__half": ("e", 2, "half"),
    "__nv_bfloat16": ("H", 2, "bfloat16"),
    "__hip_bfloat16": ("H", 2, "bfloat16"),
}
# Other names of those types: the fixed-width and size typedefs (also written ``std::name`` or
# ``::name``, see _STD_TYPEDEFS) and the vendors' aliases.
_ALIASES: dict[str, str] = {
    "int8_t": "signed char",
    "uint8_t": "unsigned char",
    "int16_t": "short",
    "uint16_t": "unsigned short",
    "int32_t": "int",
    "uint32_t": "unsigned int",
    "int64_t": "long long",
    "uint64_t": "unsigned long long",
    "ptrdiff_t": "long",
    "intptr_t": "long",
    "ssize_t": "long",
    "size_t": "unsigned long",
    "uintptr_t": "unsigned long",
    "half": "__half",
    "nv_bfloat16": "__nv_bfloat16",
    "hip_bfloat16": "__hip_bfloat16",
}
_STD_TYPEDEFS = frozenset(name for name in _ALIASES if name.endswith("_t") and name != "ssize_t")
# The torch dtype a scalar type's values are, by (kind, size): a pointer to the scalar takes it.
_SCALAR_DTYPES: dict[tuple[str, int], str] = {
    ("int", 1): "int8",
    ("uint", 1): "uint8",
    ("int", 2): "int16",
    ("uint", 2): "uint16",
    ("int", 4): "int32",
    ("uint", 4): "uint32",
    ("int", 8): "int64",
    ("uint", 8): "uint64",
    ("bool", 1): "bool",
    ("float", 4): "float32",
    ("float", 8): "float64",
    ("half", 2): "float16",
    ("bfloat16", 2): "bfloat16",
}
_BYTE_STORAGE = frozenset(
    [
        "uint8",
        "bool",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    ]
)
# Pointees whose dtypes are not just their scalar's: bytes (any byte-sized storage behind
# unsigned char, char as int8, uint8 or bool), vector types, fp8 types (no by-value form), and
# long double, which no torch dtype is (so it takes none).
_POINTEE_ONLY: dict[str, frozenset[str]] = {
    "char": frozenset(["int8", "uint8", "bool"]),
    "unsigned char": _BYTE_STORAGE,
    "float2": frozenset(["float32"]),
    "float4": frozenset(["float32"]),
    "double2": frozenset(["float64"]),
    "__half2": frozenset(["float16"]),
    "half2": frozenset(["float16"]),
    "__nv_bfloat162": frozenset(["bfloat16"]),
    "int2": frozenset(["int32"]),
    "int4": frozenset(["int32"]),
    "__nv_fp8_e4m3": frozenset(["float8_e4m3fn"]),
    "__hip_fp8_e4m3": frozenset(["float8_e4m3fn"]),
    "__nv_fp8_e5m2": frozenset(["float8_e5m2"]),
    "__hip_fp8_e5m2": frozenset(["float8_e5m2"]),
    "__hip_fp8_e4m3_fnuz": frozenset(["float8_e4m3fnuz"]),
    "__hip_fp8_e5m2_fnuz": frozenset(["float8_e5m2fnuz"]),
    "__nv_fp8_e8m0": frozenset(["float8_e8m0fnu"]),
    "long double": frozenset(),
}
# The words of C's integer types, which a declaration may write in any order.
_INTEGER_WORDS = frozenset(["signed", "unsigned", "char", "short", "int", "long"])


@functools.lru_cache(maxsize=4096)
def canonical_type(spelling: str) -> str:
    """The canonical spelling of a C type (no qualifiers, no ``*``), by which the tables are
    keyed: integer keywords in any order and with the redundant ``signed`` or ``int`` as
    C allows (``long unsigned int`` and ``unsigned long`` are one type, ``signed short int``
    is ``short``), typedefs with or without ``std::``, and vendor aliases, resolved to the
    type they name (``std::int64_t`` is ``long long``). Anything else is returned as it is
    (whitespace normalized): a type the ABI does not know."""
    text = re.sub(r"\s*::\s*", "::", " ".join(spelling.split()))
    for prefix in ("std::", "::"):
        if text.startswith(prefix) and text[len(prefix) :] in _STD_TYPEDEFS:
            text = text[len(prefix) :]
    words = text.split()
    if words and all(word in _INTEGER_WORDS for word in words):
        return _integer_type(words) or text
    return _ALIASES.get(text, text)


def _integer_type(words: list[str]) -> str | None:
    """The canonical integer type these keywords name, or None for no valid type."""
    count = {word: words.count(word) for word in _INTEGER_WORDS}
    signed, unsigned = count["signed"], count["unsigned"]
    if signed + unsigned > 1 or count["char"] > 1 or count["short"] > 1 or count["int"] > 1 or count["long"] > 2:
        return None
    if count["char"]:
        if count["short"] or count["int"] or count["long"]:
            return None
        return "unsigned char" if unsigned else "signed char" if signed else "char"
    if count["short"] and count["long"]:
        return None
    base = "short" if count["short"] else {0: "int", 1: "long", 2: "long long"}[count["long"]]
    return f"unsigned {base}" if unsigned else base


# Every spelling of each table, derived (word-order variants are found by canonical_type):
# spelling -> (struct format, size, kind), for parameters passed by value.
_SCALARS: dict[str, tuple[str, int, str]] = {
    **_SCALAR_TYPES,
    **{alias: _SCALAR_TYPES[canonical] for alias, canonical in _ALIASES.items()},
}
# Pointee spelling -> torch dtype names a tensor argument may have. Types not listed here are
# opaque (a user's struct or typedef): any dtype is accepted, as for void*.
_POINTEE_DTYPES: dict[str, frozenset[str]] = {
    **{name: frozenset([_SCALAR_DTYPES[kind, size]]) for name, (_fmt, size, kind) in _SCALARS.items()},
    **_POINTEE_ONLY,
    **{alias: _POINTEE_ONLY[canonical] for alias, canonical in _ALIASES.items() if canonical in _POINTEE_ONLY},
}
_KNOWN_TYPES = frozenset(_SCALARS) | frozenset(_POINTEE_DTYPES) | {"void"}
# Template-argument spellings of torch dtypes, per vendor (data, not bindings: the null test
# backend uses the CUDA names too).
CUDA_TYPE_NAMES = {
    "float32": "float",
    "float64": "double",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "int8": "signed char",
    "int16": "short",
    "int32": "int",
    "int64": "long long",
    "uint8": "unsigned char",
    "uint16": "unsigned short",
    "uint32": "unsigned int",
    "uint64": "unsigned long long",
    "bool": "bool",
    "float8_e4m3fn": "__nv_fp8_e4m3",
    "float8_e5m2": "__nv_fp8_e5m2",
    "float8_e8m0fnu": "__nv_fp8_e8m0",
    "float4_e2m1fn_x2": "__nv_fp4x2_e2m1",
}
HIP_TYPE_NAMES = {
    **{k: v for k, v in CUDA_TYPE_NAMES.items() if not v.startswith("__nv")},
    "bfloat16": "__hip_bfloat16",
    "float8_e4m3fn": "__hip_fp8_e4m3",
    "float8_e5m2": "__hip_fp8_e5m2",
    "float8_e4m3fnuz": "__hip_fp8_e4m3_fnuz",
    "float8_e5m2fnuz": "__hip_fp8_e5m2_fnuz",
}

# Fixed-width integer typedefs, the start of every vendor prelude (kernels compile without the
# C library's headers). hiprtc compiles with -nogpuinc and its builtin header
# (hiprtc_runtime.h, built from hip_runtime.h with __HIPCC_RTC__) already declares uint32_t,
# uint64_t, int32_t and int64_t as unsigned int, unsigned long long, signed int and signed long
# long: C++ accepts a typedef redeclared to the same type, so each line below must name exactly
# those types.
INTEGER_TYPEDEFS = """\
#ifndef JITCORE_STDINT
#define JITCORE_STDINT
typedef signed char int8_t; typedef unsigned char uint8_t;
typedef short int16_t; typedef unsigned short uint16_t;
typedef int int32_t; typedef unsigned int uint32_t;
typedef long long int64_t; typedef unsigned long long uint64_t;
#endif
"""


def prelude(source: str, type_names: Sequence[str], headers: Sequence[tuple[str, str]]) -> str:
    """The source prepended to a kernel: :data:`INTEGER_TYPEDEFS`, then each vendor header
    ``(marker, include)`` whose marker (a type name's fragment, e.g. ``"bfloat16"``) appears in
    the kernel's source or its template arguments, so a kernel pays only for the headers its
    types need."""
    text = source + " " + " ".join(type_names)
    return "\n".join([INTEGER_TYPEDEFS, *(include for marker, include in headers if marker in text)]) + "\n"


_QUALIFIERS = re.compile(r"\b(const|volatile|__restrict__|__restrict|restrict|struct|__grid_constant__)\b")


@attrs.frozen
class ParamType:
    """One kernel parameter's C type, as the ABI sees it."""

    spelling: str  # as written (after template substitution)
    fmt: str  # struct format character
    size: int
    align: int
    kind: str  # "pointer", "int", "uint", "float", "bool", "half", "bfloat16"
    pointee: str | None = None  # for pointers: the normalised pointee type ("void", "float", ...)
    const_pointee: bool = False
    name: str | None = None

    @property
    def is_pointer(self) -> bool:
        return self.kind == "pointer"

    def accepts_dtype(self, dtype_name: str) -> bool:
        """Whether a tensor of this dtype may be passed to this pointer parameter: the dtypes
        of its pointee however it is spelled (:func:`canonical_type`), any dtype for a pointee
        the ABI does not know (``void``, a user's struct or typedef)."""
        if self.pointee is None:
            return False
        allowed = _POINTEE_DTYPES.get(canonical_type(self.pointee))
        return allowed is None or dtype_name in allowed

    def describe(self) -> str:
        """The declaration as the kernel spells it (name included, when it has one)."""
        return self.spelling


def parse_param(declaration: str, index: int = 0) -> ParamType:
    """Parse one parameter declaration such as ``const float* __restrict__ x`` or ``int n``."""
    text = " ".join(declaration.replace("\n", " ").split())
    if not text:
        raise ArgumentError(f"kernel parameter {index} has an empty declaration")
    if "&" in text:
        raise ArgumentError(f"kernel parameter {index} ({text!r}): references are not supported")
    if "(" in text:
        raise ArgumentError(f"kernel parameter {index} ({text!r}): function pointers are not supported")
    if "=" in text:
        text = text.split("=", 1)[0].strip()
    array = text.endswith("]")
    if array:
        text = text[: text.index("[")].strip()
    stars = text.count("*") + (1 if array else 0)
    const_pointee = bool(re.search(r"\bconst\b", text.split("*", 1)[0])) if stars else False
    bare = _QUALIFIERS.sub(" ", text.replace("*", " * "))
    words = [t for t in bare.split() if t != "*"]
    # The last word is the parameter's name unless all the words spell a known type.
    name = None
    if (
        len(words) >= 2
        and canonical_type(" ".join(words)) not in _KNOWN_TYPES
        and re.match(r"^[A-Za-z_]\w*$", words[-1])
    ):
        name = words.pop()
    base_type = " ".join(words)
    if stars:
        if not base_type:
            raise ArgumentError(f"kernel parameter {index} ({declaration!r}): missing pointee type")
        return ParamType(
            spelling=declaration.strip(),
            fmt="Q",
            size=8,
            align=8,
            kind="pointer",
            pointee=base_type if stars == 1 else "void*",
            const_pointee=const_pointee,
            name=name,
        )
    scalar = _SCALARS.get(canonical_type(base_type))
    if scalar is None:
        raise ArgumentError(
            f"kernel parameter {index} ({declaration.strip()!r}): type {base_type!r} is not "
            "supported by value (structs and vector types are out of scope; pass a pointer)"
        )
    fmt, size, kind = scalar
    return ParamType(spelling=declaration.strip(), fmt=fmt, size=size, align=size, kind=kind, name=name)


def split_params(text: str) -> list[str]:
    """Split a parameter list on top-level commas (templates and parentheses nest)."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    tail = "".join(current)
    if tail.strip() or parts:
        parts.append(tail)
    parts = [p.strip() for p in parts]
    if parts == ["void"]:
        return []
    return parts


def parse_signature(signature: str) -> tuple[ParamType, ...]:
    """Parse an explicit signature string: ``"const float* x, float* y, int n"``."""
    return tuple(parse_param(part, i) for i, part in enumerate(split_params(signature)))


_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


@attrs.frozen
class KernelDeclaration:
    """A ``__global__`` function found in source: its template and parameter lists."""

    name: str
    template_params: tuple[tuple[str, str, str | None], ...]  # (kind, name, default)
    params_text: tuple[str, ...]


def find_kernel(source: str, name: str) -> KernelDeclaration:
    """Locate the ``__global__`` declaration of ``name`` and read its template and parameters."""
    clean = _COMMENTS.sub(" ", source)
    pattern = re.compile(r"__global__\b(?P<pre>[^;{}()]*?(?:\([^()]*\)[^;{}()]*?)*?)\b" + re.escape(name) + r"\s*\(")
    matches = list(pattern.finditer(clean))
    if not matches:
        raise ArgumentError(f"no __global__ function named {name!r} in the kernel source")
    if len(matches) > 1:
        raise ArgumentError(f"{len(matches)} __global__ functions named {name!r}; pass signature= to choose")
    match = matches[0]
    start = match.end()
    depth, end = 1, start
    while depth and end < len(clean):
        depth += {"(": 1, ")": -1}.get(clean[end], 0)
        end += 1
    params_text = tuple(split_params(clean[start : end - 1]))
    prefix = clean[: match.start()]
    template_params: tuple = ()
    head = prefix.rstrip()
    # A template clause ends right before __global__ (possibly with extern "C" or static).
    head = re.sub(r'(\bstatic\b|\binline\b|\bextern\s*"C"|__launch_bounds__\s*\([^)]*\))\s*$', "", head).rstrip()
    if head.endswith(">"):
        depth, i = 0, len(head) - 1
        while i >= 0:
            depth += {">": 1, "<": -1}.get(head[i], 0)
            if depth == 0:
                break
            i -= 1
        before = head[:i].rstrip()
        if before.endswith("template"):
            template_params = tuple(_parse_template_param(p) for p in split_params(head[i + 1 : -1]))
    return KernelDeclaration(name, template_params, params_text)


def _parse_template_param(text: str) -> tuple[str, str, str | None]:
    default = None
    if "=" in text:
        text, default = (part.strip() for part in text.split("=", 1))
    tokens = text.split()
    if not tokens:
        raise ArgumentError("empty template parameter")
    kind = "type" if tokens[0] in ("typename", "class") else "value"
    return (kind, tokens[-1], default)


def substitute(text: str, mapping: Mapping[str, str]) -> str:
    """Replace template parameter names by their arguments, token by token."""
    if not mapping:
        return text
    pattern = re.compile(r"\b(" + "|".join(re.escape(k) for k in mapping) + r")\b")
    return pattern.sub(lambda m: mapping[m.group(1)], text)


def _align_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


@attrs.frozen
class ParamLayout:
    """Where each parameter sits in the packed buffer (C alignment rules)."""

    types: tuple[ParamType, ...]
    offsets: tuple[int, ...]
    size: int

    @classmethod
    def of(cls, types: Sequence[ParamType]) -> ParamLayout:
        offsets, offset, max_align = [], 0, 1
        for param in types:
            offset = _align_up(offset, param.align)
            offsets.append(offset)
            offset += param.size
            max_align = max(max_align, param.align)
        return cls(tuple(types), tuple(offsets), _align_up(offset, max_align))

    def assemble(self, parts: Sequence[bytes]) -> bytes:
        """One packed buffer from each parameter's bytes (as a graph node reports them)."""
        buffer = bytearray(self.size)
        for offset, part, param in zip(self.offsets, parts, self.types):
            if len(part) != param.size:
                raise ValueError(f"parameter {param.describe()!r} needs {param.size} bytes, got {len(part)}")
            buffer[offset : offset + param.size] = part
        return bytes(buffer)

    def runs(self, indices: Iterable[int]) -> list[tuple[int, ...]]:
        """Group parameter indices into runs of consecutive parameters."""
        runs: list[list[int]] = []
        for index in sorted(set(indices)):
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        return [tuple(run) for run in runs]

    def struct_for(self, run: Sequence[int]) -> tuple[int, struct.Struct]:
        """A little-endian Struct writing the consecutive parameters ``run`` (padding between
        them is written as zero bytes) and the byte offset it starts at."""
        fmt, position = "<", self.offsets[run[0]]
        for index in run:
            gap = self.offsets[index] - position
            fmt += "x" * gap + self.types[index].fmt
            position = self.offsets[index] + self.types[index].size
        return self.offsets[run[0]], struct.Struct(fmt)


class PackedParams:
    """A persistent parameter buffer and the ``void*`` array pointing into it.

    The addresses never change for the life of the object, so a call state can hand
    ``self.address`` to the driver on every launch and only rewrite the changed values.
    """

    __slots__ = ("layout", "buffer", "pointers", "address", "buffer_address")

    def __init__(self, layout: ParamLayout, initial: bytes | None = None):
        self.layout = layout
        size = max(layout.size, 8)
        if initial is None:
            self.buffer = (ctypes.c_char * size)()
        else:  # the first ``layout.size`` bytes of ``initial``, zeros after (one copy, no memmove call)
            self.buffer = (ctypes.c_char * size).from_buffer_copy(bytes(initial[: layout.size]).ljust(size, b"\0"))
        self.buffer_address = ctypes.addressof(self.buffer)
        count = max(len(layout.offsets), 1)
        self.pointers = (ctypes.c_void_p * count)(*[self.buffer_address + offset for offset in layout.offsets])
        self.address = ctypes.addressof(self.pointers)

    def bytes(self) -> bytes:
        return bytes(self.buffer[: self.layout.size])

    def param_bytes(self, index: int) -> bytes:
        offset = self.layout.offsets[index]
        return bytes(self.buffer[offset : offset + self.layout.types[index].size])


def float_to_bfloat16_bits(value: float) -> int:
    """Round a Python float to bfloat16 (round to nearest even, from the double itself, not
    through float32) and return its bits. NaN keeps its sign; a finite value too large for
    bfloat16 raises OverflowError (as ``struct`` does for ``f`` and ``e``)."""
    value = float(value)
    if value != value:
        return 0xFFC0 if math.copysign(1.0, value) < 0 else 0x7FC0
    try:
        (bits,) = struct.unpack("<I", struct.pack("<f", value))
    except OverflowError:
        raise OverflowError("float too large to pack as bfloat16") from None
    (single,) = struct.unpack("<f", struct.pack("<I", bits))
    if single != value:
        # float32 rounded: redo it rounding to odd (truncate, set the last bit), so that the
        # second rounding, to bfloat16, cannot round a second time the wrong way.
        if abs(single) > abs(value):
            bits -= 1
        bits |= 1
    bits += 0x7FFF + ((bits >> 16) & 1)
    result = (bits >> 16) & 0xFFFF
    if result & 0x7FFF == 0x7F80 and not math.isinf(value):
        raise OverflowError("float too large to pack as bfloat16")
    return result


def pack_conversion(param: ParamType) -> Callable[[float], int] | None:
    """What a by-value parameter's number goes through before ``struct`` packs it with
    ``param.fmt``, or None where struct packs the number itself. bfloat16 has no struct format:
    it is packed as its bits (``H``), from :func:`float_to_bfloat16_bits`. Call states, the
    records replay patches graphs from and :func:`scalar_value` all convert through it."""
    return float_to_bfloat16_bits if param.kind == "bfloat16" else None


def bfloat16_bits_to_float(bits: int) -> float:
    """The value of bfloat16 ``bits`` as a Python float."""
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


class ScalarError(ValueError):
    """A scalar that a C parameter type cannot hold with its value unchanged."""


def c_type_name(param: ParamType) -> str:
    """The C type of a by-value parameter in words, for messages."""
    if param.kind == "float":
        return "double" if param.size == 8 else "float"
    if param.kind in ("int", "uint"):
        return f"{'' if param.kind == 'int' else 'u'}int{param.size * 8}"
    return param.kind


def _narrow(param: ParamType, value: float) -> tuple[float, object]:
    """(the value the parameter holds, what struct packs) for a float, or OverflowError."""
    convert = pack_conversion(param)
    if convert is not None:  # bfloat16: held as the float its bits encode
        bits = convert(value)
        return bfloat16_bits_to_float(bits), bits
    if param.size == 8:
        return value, value
    fmt = "<" + param.fmt
    return struct.unpack(fmt, struct.pack(fmt, value))[0], value


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:18]}...{text[-18:]}"


def scalar_value(param: ParamType, value: object) -> object:
    """What ``struct`` packs with ``param.fmt`` for the Python or numpy scalar ``value``.

    The kernel receives exactly ``value``, encoded in the parameter's C type, or this raises
    :class:`ScalarError` saying why not: a type the parameter does not take (a float for an
    integer, anything but a bool for ``bool``), an integer outside the C type's range, an
    integer that a floating type cannot hold exactly (above 2**24 for ``float``, 2**53 for
    ``double``, 2048 for ``half``, 256 for ``bfloat16``, unless it happens to be
    representable), or a finite float beyond the type's range. Floats are rounded to nearest
    (that is their encoding); NaN and infinities pass.
    """
    import numpy as np

    kind, ctype = param.kind, c_type_name(param)
    if kind == "pointer":
        raise ScalarError("a pointer parameter takes a tensor or None, not a scalar")
    if kind == "bool":
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        raise ScalarError(f"a bool parameter takes a bool, not a {type(value).__qualname__}")
    integral = isinstance(value, (int, np.integer, np.bool_))
    if kind in ("int", "uint"):
        if not integral:
            raise ScalarError(f"an {ctype} parameter takes an integer, not a {type(value).__qualname__}")
        number = int(value)
        bits = param.size * 8
        low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if kind == "int" else (0, 2**bits - 1)
        if not low <= number <= high:
            raise ScalarError(f"{_shown(number)} is outside the range of {ctype} ({low}..{high})")
        return number
    if integral:
        number = int(value)
        try:
            converted = float(number)
        except OverflowError:
            raise ScalarError(f"{_shown(number)} is too large for {ctype}") from None
        if converted != number:
            raise ScalarError(
                f"{_shown(number)} has no exact {ctype} representation (the nearest double is {converted!r})"
            )
    elif isinstance(value, (float, np.floating)):
        converted = float(value)
        if converted != value and converted == converted:
            raise ScalarError(f"{_shown(value)} has no exact double representation")
    else:
        raise ScalarError(f"a {ctype} parameter takes a number, not a {type(value).__qualname__}")
    try:
        held, packed = _narrow(param, converted)
    except OverflowError:
        raise ScalarError(f"{_shown(value)} is too large for {ctype}") from None
    if integral and held != converted:
        raise ScalarError(f"{_shown(int(value))} has no exact {ctype} representation (it would become {held!r})")
    return packed


def encode_scalar(param: ParamType, value: object) -> bytes:
    """The parameter's bytes for a scalar, checked as :func:`scalar_value` checks it."""
    return struct.pack("<" + param.fmt, scalar_value(param, value))


def accepts_scalar(param: ParamType, value: object) -> bool:
    """Whether a Python/numpy scalar may be passed by value to ``param`` unchanged (no lossy
    casts; :func:`scalar_value` says why not)."""
    if param.kind == "pointer":
        return value is None
    try:
        scalar_value(param, value)
    except ScalarError:
        return False
    return True
