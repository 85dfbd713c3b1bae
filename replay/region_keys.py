"""Region keys: the structure of the arguments plus a shape-exact signature of every leaf.

A graph bakes in grids and sizes, so a replay key is shape-exact even where a jit key is
shape-dynamic: tensors contribute jitcore's lean static signature (dtype, shape, strides,
unit-stride axis, alignment, device, read straight from the tensor, no DLPack); dynamic
scalars their type; every other leaf its type and value. The key also carries the current
device, since graphs are recorded and replayed per device.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import itertools
import struct
from collections.abc import Callable, Iterable, Sequence

import attrs
import numpy as np
import torch

import jitcore
from jitcore import generated
from jitcore.backends import compiled_helpers_enabled
from replay.dynamic import Dynamic

try:  # the settings check in C (replay/_checks.c; optional, built by setup.py)
    from replay._checks import SettingsCheck as _SettingsCheck
except ImportError:
    _SettingsCheck = None

FLAT = "flat"  # spec of a call whose arguments are all positional leaves

_CONSTANT_TYPES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum, np.generic)


def _flatten_into(value: object, leaves: list, path: str, paths: list, walk_dataclasses: bool) -> object:
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Tensor):
        kind = "tuple" if isinstance(value, tuple) else "list"
        if isinstance(value, tuple) and type(value) is not tuple:  # a named tuple: keep its type
            kind = type(value)
        return (
            kind,
            tuple(_flatten_into(v, leaves, f"{path}[{i}]", paths, walk_dataclasses) for i, v in enumerate(value)),
        )
    if isinstance(value, dict):
        keys = tuple(value)
        try:
            hash(keys)
        except TypeError:
            raise TypeError(f"{path}: dict keys of region arguments must be hashable") from None
        return (
            "dict",
            keys,
            tuple(_flatten_into(value[k], leaves, f"{path}[{k!r}]", paths, walk_dataclasses) for k in keys),
        )
    if walk_dataclasses and dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = tuple(f.name for f in dataclasses.fields(value))
        extra = set(getattr(value, "__dict__", {})) - set(names)
        if extra:
            raise TypeError(
                f"{path}: a {type(value).__qualname__} with attributes that are not dataclass fields "
                f"({', '.join(sorted(extra))}) cannot be rebuilt for each replay"
            )
        return (
            "dataclass",
            type(value),
            names,
            tuple(_flatten_into(getattr(value, n), leaves, f"{path}.{n}", paths, walk_dataclasses) for n in names),
        )
    leaves.append(value)
    paths.append(path)
    return None


#: The paths of flat calls, by argument count (shared: callers never change ``paths``).
_FLAT_PATHS: dict[int, list[str]] = {}


def flatten(args: tuple, kwargs: dict, *, walk_dataclasses: bool = False) -> tuple[object, list, list[str]]:
    """(spec, leaves, paths): nested tuples, lists and dicts are walked (and dataclass
    instances, for outputs); everything else is a leaf. ``paths`` name each leaf for messages
    (``args[1]['kv']``); callers read them and never change them (flat calls share theirs)."""
    if not kwargs and not walk_dataclasses:
        for a in args:
            if isinstance(a, (tuple, list, dict)):
                break
        else:
            count = len(args)
            paths = _FLAT_PATHS.get(count)
            if paths is None:
                paths = _FLAT_PATHS[count] = [f"args[{i}]" for i in range(count)]
            return (FLAT, count), list(args), paths
    leaves: list = []
    paths: list[str] = []
    spec = (
        tuple(_flatten_into(a, leaves, f"args[{i}]", paths, walk_dataclasses) for i, a in enumerate(args)),
        tuple(kwargs),
        tuple(_flatten_into(v, leaves, k, paths, walk_dataclasses) for k, v in kwargs.items()),
    )
    return spec, leaves, paths


def make_dataclass_instance(cls: type, names: Sequence[str], values: Sequence) -> object:
    """A new instance of a dataclass with these field values (frozen ones too), without
    running ``__init__``/``__post_init__``: what a region returned, with new outputs."""
    instance = object.__new__(cls)
    for name, value in zip(names, values):
        object.__setattr__(instance, name, value)
    return instance


def _rebuild(spec: object, leaves: Sequence, position: list[int]) -> object:
    if spec is None:
        value = leaves[position[0]]
        position[0] += 1
        return value
    kind = spec[0]
    if kind == "dict":
        return {k: _rebuild(s, leaves, position) for k, s in zip(spec[1], spec[2])}
    if kind == "dataclass":
        return make_dataclass_instance(spec[1], spec[2], [_rebuild(s, leaves, position) for s in spec[3]])
    items = [_rebuild(s, leaves, position) for s in spec[1]]
    if kind == "tuple":
        return tuple(items)
    if kind == "list":
        return items
    return kind(*items)  # named tuple


def unflatten(spec: object, leaves: Sequence) -> tuple[tuple, dict]:
    """Rebuild (args, kwargs) from a spec and (possibly replaced) leaves."""
    if spec[0] == FLAT:
        return tuple(leaves), {}
    position = [0]
    args = tuple(_rebuild(s, leaves, position) for s in spec[0])
    kwargs = {k: _rebuild(s, leaves, position) for k, s in zip(spec[1], spec[2])}
    return args, kwargs


def leaf_key(leaf: object, path: str) -> object:
    """The key element of one leaf."""
    if isinstance(leaf, torch.Tensor):
        return jitcore.lean_static_signature(leaf)
    if isinstance(leaf, Dynamic):
        return ("dynamic", type(leaf.value).__qualname__)
    if isinstance(leaf, (float, np.floating, complex)):
        # by bit pattern: -0.0 == 0.0 and nan != nan, yet each is its own constant
        return (type(leaf).__qualname__, float_bits(leaf))
    if isinstance(leaf, _CONSTANT_TYPES):
        return (type(leaf).__qualname__, leaf)
    try:
        hash(leaf)
    except TypeError:
        raise TypeError(
            f"region argument {path} is an unhashable {type(leaf).__qualname__}; region arguments are "
            "tensors, scalars (wrap runtime ones in replay.dynamic), hashable constants, and tuples, "
            "lists and dicts of those"
        ) from None
    return (type(leaf).__qualname__, leaf)  # an opaque constant: keyed (and baked) by its value


_DOUBLE = struct.Struct("<d")


def float_bits(value: object) -> bytes:
    """The exact bits of a float (or complex) constant: what tells -0.0 from 0.0 and one NaN
    from another."""
    if isinstance(value, complex):
        return _DOUBLE.pack(value.real) + _DOUBLE.pack(value.imag)
    if isinstance(value, np.floating):
        return value.tobytes()
    return _DOUBLE.pack(value)


def region_key(device: int, spec: object, leaves: Sequence, paths: Sequence[str]) -> tuple:
    """The full key of one call: device, the torch modes in force, the argument structure,
    how the tensor arguments overlap each other, and each leaf's signature."""
    return (
        device,
        spec,
        torch_modes(),
        alias_pattern(leaves),
        *(leaf_key(leaf, path) for leaf, path in zip(leaves, paths)),
    )


#: Key elements before the leaves' (device, spec, modes, aliasing).
LEAVES_START = 4


def tensor_ranges(leaves: Sequence) -> list[tuple[int, int, int]]:
    """(leaf index, first byte, one past the last byte) of every tensor leaf."""
    ranges = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            lo = leaf.data_ptr()
            ranges.append((i, lo, lo + extent_bytes(leaf)))
    return ranges


def alias_pattern(leaves: Sequence) -> tuple[tuple[int, int], ...]:
    """The pairs of tensor leaves whose bytes overlap (the same tensor twice, overlapping
    views). A graph recorded for one pattern must never serve another: a region that writes
    one argument and reads the other gives different results when they share memory.

    Most calls pass tensors of distinct allocations: when the storages' byte spans are
    disjoint, no two tensors can overlap and the exact element ranges are not computed."""
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if len(tensors) < 2:
        return ()
    try:
        spans = sorted((s.data_ptr(), s.nbytes()) for s in (t.untyped_storage() for t in tensors))
    except (RuntimeError, NotImplementedError):  # a tensor without a plain storage
        spans = None
    if spans is not None and all(lo + size <= next_lo for (lo, size), (next_lo, _) in itertools.pairwise(spans)):
        return ()
    return pattern_of(tensor_ranges(leaves))


#: Argument types that hold no tensor and are keyed by value as they are.
PLAIN_CONSTANTS = frozenset({int, float, bool, type(None), str, torch.dtype, torch.device})


class MergedRanges:
    """Byte ranges merged into disjoint, sorted spans, for asking many times whether a range
    overlaps any of them (a binary search instead of a walk over every range)."""

    __slots__ = ("_starts", "_ends")

    def __init__(self, ranges: Iterable[tuple[int, int]]):
        starts: list[int] = []
        ends: list[int] = []
        for lo, hi in sorted(r for r in ranges if r[0] < r[1]):
            if ends and lo <= ends[-1]:
                ends[-1] = max(ends[-1], hi)
            else:
                starts.append(lo)
                ends.append(hi)
        self._starts, self._ends = starts, ends

    def overlaps(self, lo: int, hi: int) -> bool:
        """Whether ``[lo, hi)`` shares a byte with a span (an empty range shares none). Spans
        are disjoint and sorted, so the last one starting before ``hi`` reaches furthest."""
        if hi <= lo:
            return False
        last = bisect.bisect_left(self._starts, hi) - 1
        return last >= 0 and self._ends[last] > lo


def pattern_of(ranges: Sequence[tuple[int, int, int]]) -> tuple[tuple[int, int], ...]:
    """The overlapping pairs among (leaf index, first byte, one past the last byte) ranges."""
    ranges = sorted(ranges, key=lambda r: r[1])
    pairs = []
    for n, (i, lo, hi) in enumerate(ranges):
        for j, other_lo, other_hi in ranges[n + 1 :]:
            if other_lo >= hi:
                break
            if other_lo < other_hi and lo < hi:
                pairs.append((min(i, j), max(i, j)))
    return tuple(sorted(pairs))


@attrs.frozen
class _ModeReader:
    """One global torch setting: the function that reads it and its arguments. A reader
    returning a list is keyed as a tuple (keys hold hashable values)."""

    what: str
    function: Callable
    args: tuple
    returns_list: bool

    def read(self) -> object:
        value = self.function(*self.args)
        return tuple(value) if self.returns_list else value


def _mode_readers() -> list[_ModeReader]:
    """A reader for every global torch setting that changes what a region's torch ops
    compute. A graph bakes in the kernels chosen under the settings in force when it was
    recorded, so these are part of every region key. Readers missing from the installed
    torch are skipped."""
    C = torch._C
    wanted = [
        ("grad mode", "is_grad_enabled", ()),
        ("inference mode", "is_inference_mode_enabled", ()),
        ("autocast (cuda)", "is_autocast_enabled", ("cuda",)),
        ("autocast dtype (cuda)", "get_autocast_dtype", ("cuda",)),
        ("autocast (cpu)", "is_autocast_enabled", ("cpu",)),
        ("autocast dtype (cpu)", "get_autocast_dtype", ("cpu",)),
        ("autocast cache", "is_autocast_cache_enabled", ()),
        ("default dtype", "get_default_dtype", ()),
        ("deterministic algorithms", "_get_deterministic_algorithms", ()),
        ("deterministic algorithms (warn only)", "_get_deterministic_algorithms_warn_only", ()),
        ("float32 matmul precision", "_get_float32_matmul_precision", ()),
        ("cuBLAS TF32", "_get_cublas_allow_tf32", ()),
        ("cuBLAS fp16 reduced precision", "_get_cublas_allow_fp16_reduced_precision_reduction", ()),
        ("cuBLAS bf16 reduced precision", "_get_cublas_allow_bf16_reduced_precision_reduction", ()),
        ("cuBLAS fp16 accumulation", "_get_cublas_allow_fp16_accumulation", ()),
        ("cuDNN TF32", "_get_cudnn_allow_tf32", ()),
        ("cuDNN enabled", "_get_cudnn_enabled", ()),
        ("cuDNN benchmark", "_get_cudnn_benchmark", ()),
        ("cuDNN deterministic", "_get_cudnn_deterministic", ()),
        ("SDPA flash", "_get_flash_sdp_enabled", ()),
        ("SDPA memory-efficient", "_get_mem_efficient_sdp_enabled", ()),
        ("SDPA math", "_get_math_sdp_enabled", ()),
        ("SDPA cuDNN", "_get_cudnn_sdp_enabled", ()),
        ("SDPA math fp16/bf16 reduction", "_get_math_sdp_allow_fp16_bf16_reduction", ()),
        ("SDPA priority order", "_get_sdp_priority_order", ()),
        ("preferred BLAS library", "_get_blas_preferred_backend", ()),
        ("preferred linalg library", "_get_linalg_preferred_backend", ()),
    ]
    readers = []
    for what, name, args in wanted:
        function = getattr(C, name, None) or getattr(torch, name, None)
        if function is None:
            continue
        try:
            value = function(*args)
        except Exception:
            continue
        readers.append(_ModeReader(what, function, args, isinstance(value, list)))
    return readers


_MODE_READERS = _mode_readers()
MODE_NAMES = tuple(reader.what for reader in _MODE_READERS)


def _call_source(number: int, reader: _ModeReader, namespace: dict) -> str:
    """``_m3(_m3_arg0)``: the reader called with its arguments bound by name."""
    namespace[f"_m{number}"] = reader.function
    names = []
    for position, value in enumerate(reader.args):
        namespace[f"_m{number}_arg{position}"] = value
        names.append(f"_m{number}_arg{position}")
    return f"_m{number}({', '.join(names)})"


def _make_torch_modes() -> Callable[[], tuple]:
    """One generated function reading every mode into a tuple (a call per setting, no loop)."""
    namespace: dict[str, object] = {"_tuple": tuple}
    calls = []
    for number, reader in enumerate(_MODE_READERS):
        call = _call_source(number, reader, namespace)
        calls.append(f"_tuple({call}), " if reader.returns_list else f"{call}, ")
    source = f"def torch_modes():\n    return ({''.join(calls)})\n"
    return generated.define(source, "<replay torch modes>", namespace)["torch_modes"]


torch_modes: Callable[[], tuple] = _make_torch_modes()
torch_modes.__doc__ = "The global torch settings in force now, in MODE_NAMES order (see _mode_readers)."

#: Values a reader returns as the same object whenever the setting is the same (bools, None,
#: torch's dtype singletons): compared by identity, the cheapest check there is.
_SINGLETON_TYPES = (bool, type(None), torch.dtype)
#: The settings that change what an op computes only while autocast is on (for CUDA or the CPU).
_AUTOCAST_SETTINGS = frozenset(
    {"autocast (cuda)", "autocast dtype (cuda)", "autocast (cpu)", "autocast dtype (cpu)", "autocast cache"}
)
#: One call saying whether autocast is on for any device (None in a torch without it).
_any_autocast: Callable[[], bool] | None = getattr(torch._C, "_is_any_autocast_enabled", None)
_modes_changed_cache: dict[tuple, Callable[[], bool]] = {}  # (recorded, the C type or None) -> check


def _is_pybind_enum(value: object) -> bool:
    """A pybind11 enum member (torch's preferred-library settings): its ``.value`` is its int."""
    return hasattr(type(value), "__members__") and isinstance(getattr(value, "value", None), int)


def modes_changed(recorded: tuple, *, compiled: bool = True) -> Callable[[], bool]:
    """A function telling whether any torch setting differs from ``recorded`` (a
    ``torch_modes()`` tuple) in a way that can change what a region computes, for replay's
    per-call check. It reads the same settings as ``torch_modes`` but builds no tuple and
    compares each value the cheapest exact way: singletons by identity, lists as lists,
    pybind enums by their int ``.value`` (their ``!=`` costs about 0.4 us), others (strings)
    by equality; the first difference ends it.

    Where autocast was off for both CUDA and the CPU when recorded, one call checks that it
    is still off for every device (``torch._C._is_any_autocast_enabled``) instead of the five
    autocast settings: the autocast dtypes and cache change nothing while autocast is off, so
    a change of them then is no change of what the graph computes (the region's key, which
    holds every setting, still tells such calls apart on the eager path).

    The check is replay._checks.SettingsCheck where that C helper was built (the same calls
    and comparisons in the same order, without a bytecode step per setting: see
    replay/_checks.c), else a generated function (``JITCORE_NATIVE=0`` or ``compiled=False``
    picks it). Made once per distinct recorded tuple."""
    native = _settings_check_type() if compiled else None
    check = _modes_changed_cache.get((recorded, native))
    if check is not None:
        return check
    tests = _mode_tests(recorded)
    if native is not None:
        check = native(
            tuple(reader for reader, _, _, _ in tests),
            tuple(args for _, args, _, _ in tests),
            tuple(value for _, _, value, _ in tests),
            "".join(way for _, _, _, way in tests),
        )
    else:
        check = _generated_modes_check(tests)
    _modes_changed_cache[(recorded, native)] = check
    return check


def _settings_check_type() -> type | None:
    """replay._checks.SettingsCheck, or None where it was not built or ``JITCORE_NATIVE=0``."""
    if _SettingsCheck is None or not compiled_helpers_enabled():
        return None
    return _SettingsCheck


#: How a mode test compares a reader's value with the recorded one (replay/_checks.c's ways).
_IDENTITY, _EQUALITY, _ENUM_VALUE = "i", "e", "v"


def _mode_tests(recorded: tuple) -> list[tuple[Callable, tuple, object, str]]:
    """The per-replay tests of ``recorded``, in order: (reader, its arguments, the value to
    compare with, how), as :func:`modes_changed` describes."""
    tests: list[tuple[Callable, tuple, object, str]] = []
    values = dict(zip(MODE_NAMES, recorded, strict=True))
    autocast_off = (
        _any_autocast is not None
        and _AUTOCAST_SETTINGS <= values.keys()
        and values["autocast (cuda)"] is False
        and values["autocast (cpu)"] is False
    )
    if autocast_off:
        tests.append((_any_autocast, (), False, _IDENTITY))
    for reader, value in zip(_MODE_READERS, recorded, strict=True):
        if autocast_off and reader.what in _AUTOCAST_SETTINGS:
            continue
        if reader.returns_list:
            tests.append((reader.function, reader.args, list(value), _EQUALITY))
        elif isinstance(value, _SINGLETON_TYPES):
            tests.append((reader.function, reader.args, value, _IDENTITY))
        elif _is_pybind_enum(value):
            tests.append((reader.function, reader.args, value.value, _ENUM_VALUE))
        else:
            tests.append((reader.function, reader.args, value, _EQUALITY))
    return tests


def _generated_modes_check(tests: list[tuple[Callable, tuple, object, str]]) -> Callable[[], bool]:
    """The tests as one generated ``or`` chain (the check without the C helper)."""
    namespace: dict[str, object] = {}
    lines = []
    for number, (reader, args, value, way) in enumerate(tests):
        name = "_any_autocast" if reader is _any_autocast else f"_m{number}"  # named in dumps
        namespace[name] = reader
        names = []
        for position, argument in enumerate(args):
            namespace[f"_m{number}_arg{position}"] = argument
            names.append(f"_m{number}_arg{position}")
        call = f"{name}({', '.join(names)})"
        namespace[f"_v{number}"] = value
        if way == _IDENTITY:
            lines.append(f"{call} is not _v{number}")
        elif way == _ENUM_VALUE:
            lines.append(f"{call}.value != _v{number}")
        else:
            lines.append(f"{call} != _v{number}")
    body = "\n        or ".join(lines) or "False"
    source = f"def modes_changed():\n    return (\n        {body}\n    )\n"
    return generated.define(source, generated.source_filename("replay torch modes check"), namespace)["modes_changed"]


def describe_mode_change(recorded: tuple, now: tuple) -> str:
    changed = [f"{name} {a!r} -> {b!r}" for name, a, b in zip(MODE_NAMES, recorded, now) if a != b]
    return ", ".join(changed) or "none"


def plain_leaves(leaves: Sequence) -> list:
    """Leaves with dynamic markers replaced by their values: what an eager run receives."""
    return [leaf.value if isinstance(leaf, Dynamic) else leaf for leaf in leaves]


def byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """(first byte, one past the last byte) the tensor can reach."""
    start = tensor.data_ptr()
    return start, start + extent_bytes(tensor)


def extent_bytes(tensor: torch.Tensor) -> int:
    """Bytes from the data pointer to one past the last element the tensor can reach."""
    if tensor.is_contiguous():  # the usual tensor, without a walk of its sizes and strides
        return tensor.numel() * tensor.element_size()
    if tensor.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()) if size > 0)
    return (last + 1) * tensor.element_size()
