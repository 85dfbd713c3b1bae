"""A differential fuzzer for replay: random regions, every call compared with eager bit for bit.

A **case** is one replay session holding one to three **regions**. Every region is a real Python
function whose source is drawn at random from a grammar (:func:`generate_case`): jit kernels (an
elementwise ``a*x + b`` into an output, an in-place ``x += c``, a copy into ``cache[pos]`` with the
row offset computed from a scalar, a kernel whose grid is ``cdiv(n, 64)`` of a runtime ``n``
writing only the first ``n`` elements, a reduction writing one value per row, a kernel reading a
shifted view ``x[1:]`` of its input), torch ops (matmul, autocast on and off around a matmul,
elementwise ops, in-place ``add_``/``mul_``/``copy_``/``out=``, and, in the RNG families,
``rand_like``/``randn_like``/``bernoulli``/``multinomial``/``dropout``), ``replay.dynamic`` scalars
(kernel scalars, grid sizes, pointer offsets, arithmetic on them, returned values), inputs that
alias each other (the same tensor twice, rows or elements overlapping, disjoint views of one
buffer, a view at an offset), outputs that are inputs or views of inputs, nested argument and
result containers, and now and then a step replay must refuse (a host sync, a dynamic scalar
passed to torch, a differently typed view of an input returned).

The calls of a case (:func:`plan_calls`) pick a region, a shape from a small menu (so graphs are
reused), an aliasing pattern, a global torch mode (autocast, TF32, no_grad), fresh scalar values;
some calls keep their outputs, which later calls check again (an output of region A held while
region B replays) and feed into other calls as inputs (``mem = enc(x)`` then ``dec(y, mem)``; and
``h = step(h)`` with the same graph: "feedback").

:class:`Harness` runs a case. Each call draws fresh inputs (random data, never zeros; preallocated
output buffers poisoned with NaN or a sentinel), makes two storage-level copies built on one base
tensor per aliasing group (so the aliasing is the same in both), runs the region eagerly on one
(outside any session) and through the session on the other, and compares bit for bit every output
leaf (values, dtype, shape, strides, and whether it is a view of an input at the same offset),
every input buffer afterwards (inputs may be written in place) and every held output. Families:

- ``plain``: no random numbers; eager and replay alternate per call;
- ``rng-reseed``: random ops; ``torch.manual_seed(s)`` right before the eager call and again right
  before the replayed call (what torch's own ``CUDAGraph.replay`` guarantees: it reads the
  generator's seed and offset at launch);
- ``rng-sequence``: random ops; the whole sequence of calls runs eagerly first from one generator
  state (outputs saved), the state is reset with ``set_rng_state``, then the same sequence runs
  through the session and each call is compared with its eager twin: a sequence of replays must
  draw the numbers the eager sequence draws;
- ``padded`` (only when asked for: ``--family padded``, ``run(family=PADDED)``; never drawn or
  cycled, so the seeds of the three families above keep their cases): bucketing. The session gets
  ``buckets=[...]`` (a random small list), every row-shaped argument is passed as
  ``replay.padded(x, dim, fill, written)`` (fills other than 0 too, NaN and infinities among
  them; ``written=True`` for every argument the region writes, and now and then for one it only
  reads), and each call draws its own batch size (the rows), some equal to a bucket, some beyond
  the largest one (unpadded). The grammar keeps only row-wise building blocks there (see
  :class:`_PaddedRegionBuilder`), since padding is exact only for regions whose rows are
  independent. The bit-for-bit reference is the eager run of the *same padded* computation
  (:func:`padded_reference`: pad the same way, run the function, copy the written rows back,
  slice the same outputs), because a matmul of another height may round differently; every call
  is also compared with the unpadded eager run with ``torch.testing.assert_close`` (which
  catches the reference and replay agreeing on a wrong padding).
- ``polymorphic`` (only when asked for, as ``padded``): the padded family's cases with
  ``polymorphic=True``, most regions made of jit kernels only, so that a bucket's graph serves
  smaller sizes at their own size. A call is right when it equals, bit for bit, either the
  padded reference (a padded call) or the unpadded eager run (a size served at its own size).

A call that falls back to eager with a :class:`replay.ReplayWarning` is fine (refused loudly:
counted by reason); a silent difference is a :class:`Mismatch`, reported with the case seed, the
region, the call and the region's source, and reproducible with
``python -m tests.replay.fuzz_long --seed-start SEED --cases 1 --family FAMILY``.

The grammar and the planner are pure Python (no GPU); the harness runs on the GPU with the real
jit launchers and ``replay.capture``, or on the CPU with :data:`REFERENCE_LAUNCHERS` and
:class:`EagerSession` (to test the harness itself).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import linecache
import math
import random
import re
import struct
import time
import traceback
import warnings
from collections.abc import Callable

import torch

import jitcore as jc
import replay

# --------------------------------------------------------------------------------------------
# Kernels and launchers
# --------------------------------------------------------------------------------------------

KERNEL_SOURCE = r"""
__global__ void fz_axpb(const float* x, float* out, float a, float b, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = a * x[i] + b;
}
__global__ void fz_add_scalar(float* x, float c, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] + c;
}
__global__ void fz_copy(const float* src, float* dst, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}
__global__ void fz_prefix(const float* x, float* out, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] * 2.0f + 1.0f;
}
__global__ void fz_row_sum(const float* x, float* out, int cols) {
    float acc = 0.f;
    for (int c = threadIdx.x; c < cols; c += 32) acc += x[blockIdx.x * (long long)cols + c];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffff, acc, o);
    if (threadIdx.x == 0) out[blockIdx.x] = acc;
}
__global__ void fz_shift_add(const float* a, const float* b, float* out, long long m, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = i < m ? a[i] + b[i] : a[i];
}
"""

# the padded family's per-row write (its own source, so the kernels above keep their module)
PADDED_KERNEL_SOURCE = r"""
__global__ void fz_copy_rows(const float* src, float* dst, long long cols, long long dst_stride, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) {
        long long r = i / cols;
        dst[r * dst_stride + (i - r * cols)] = src[i];
    }
}
"""

_AXPB = jc.Kernel(KERNEL_SOURCE, "fz_axpb")
_ADD_SCALAR = jc.Kernel(KERNEL_SOURCE, "fz_add_scalar")
_COPY = jc.Kernel(KERNEL_SOURCE, "fz_copy")
_PREFIX = jc.Kernel(KERNEL_SOURCE, "fz_prefix")
_ROW_SUM = jc.Kernel(KERNEL_SOURCE, "fz_row_sum")
_SHIFT_ADD = jc.Kernel(KERNEL_SOURCE, "fz_shift_add")
_COPY_ROWS = jc.Kernel(PADDED_KERNEL_SOURCE, "fz_copy_rows")


@jc.jit
def axpb(x, out, a, b):
    """out = a*x + b (elementwise; out may be x itself)."""
    n = x.numel()
    _AXPB[jc.cdiv(n, 128), 128](x, out, a, b, n)


@jc.jit
def add_scalar_(x, c):
    """x += c in place."""
    n = x.numel()
    _ADD_SCALAR[jc.cdiv(n, 128), 128](x, c, n)


@jc.jit
def copy_row(src, cache, pos):
    """cache[pos] = src: the row's pointer is cache + pos * stride, pos a runtime scalar."""
    row = cache[pos]
    n = src.numel()
    _COPY[jc.cdiv(n, 128), 128](src, row, n)


@jc.jit
def prefix(x, out, n):
    """out[:n] = 2*x[:n] + 1, grid cdiv(n, 64) from the runtime scalar n; out[n:] untouched."""
    _PREFIX[jc.cdiv(n, 64), 64](x, out, n)


@jc.jit
def row_sum(x, out):
    """out[r] = sum(x[r, :]) (x contiguous [rows, cols], out [rows])."""
    _ROW_SUM[x.shape[0], 32](x, out, x.shape[1])


@jc.jit
def shift_add(x, out):
    """flat: out[i] = x[i] + x[i + cols] for the first (rows-1)*cols elements, x[i] after, through
    a view x[1:] whose pointer offset is one (dynamic) row stride."""
    below = x[1:]
    n = x.numel()
    _SHIFT_ADD[jc.cdiv(n, 128), 128](x, below, out, below.numel(), n)


@jc.jit
def copy_rows(src, cache, pos):
    """cache[:, pos] = src for a batch-major cache [R, P, C]: row r of src goes to slot pos of
    row r (a per-row write, as a decode step writes each sequence's new token into its own
    cache row; its rows stay independent, so it may be padded). The view's pointer is offset by
    pos (a runtime scalar) times the slot stride, its row stride is P * C."""
    slot = cache[:, pos]
    n = src.numel()
    _COPY_ROWS[jc.cdiv(n, 128), 128](src, slot, src.shape[1], slot.stride(0), n)


LAUNCHERS: dict[str, Callable] = {
    "axpb": axpb,
    "add_scalar_": add_scalar_,
    "copy_row": copy_row,
    "prefix": prefix,
    "row_sum": row_sum,
    "shift_add": shift_add,
    "copy_rows": copy_rows,
}


def _ref_axpb(x, out, a, b):
    out.copy_(x * a + b)


def _ref_add_scalar_(x, c):
    x.add_(c)


def _ref_copy_row(src, cache, pos):
    cache[pos].view(-1).copy_(src.reshape(-1))


def _ref_prefix(x, out, n):
    out.view(-1)[:n] = x.reshape(-1)[:n] * 2.0 + 1.0


def _ref_row_sum(x, out):
    out.copy_(x.sum(1))


def _ref_shift_add(x, out):
    flat = x.reshape(-1).clone()
    m = (x.shape[0] - 1) * x.shape[1]
    flat[:m] += x.reshape(-1)[x.shape[1] :]
    out.view(-1).copy_(flat)


def _ref_copy_rows(src, cache, pos):
    cache[:, pos].copy_(src)


#: torch stand-ins for the launchers (same semantics, any device): the harness's own CPU tests.
REFERENCE_LAUNCHERS: dict[str, Callable] = {
    "axpb": _ref_axpb,
    "add_scalar_": _ref_add_scalar_,
    "copy_row": _ref_copy_row,
    "prefix": _ref_prefix,
    "row_sum": _ref_row_sum,
    "shift_add": _ref_shift_add,
    "copy_rows": _ref_copy_rows,
}

# result containers regions may return (replay must rebuild them with the new outputs)
Out2 = collections.namedtuple("Out2", "a b")
Out3 = collections.namedtuple("Out3", "a b c")


@dataclasses.dataclass
class OutDC:
    a: object
    b: object


# --------------------------------------------------------------------------------------------
# The grammar
# --------------------------------------------------------------------------------------------

FAMILIES = ("plain", "rng-sequence", "rng-reseed")  # drawn per case, or cycled through
RNG_FAMILIES = ("rng-sequence", "rng-reseed")
PADDED = "padded"  # bucketing: only when asked for (see the module docstring)
POLYMORPHIC = "polymorphic"  # bucketing with polymorphic replay: only when asked for
BUCKETED_FAMILIES = (PADDED, POLYMORPHIC)
ALL_FAMILIES = (*FAMILIES, *BUCKETED_FAMILIES)
BUCKET_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16)  # what a padded case's buckets are drawn from
# fills of padded rows (each exact in float32); 0 is the common one, the others show whether
# anything of the added rows leaks into the call's rows (NaN and infinities loudest)
# (a tuple of pairs: 0, 0.0 and -0.0 are one key of a dict)
FILLS = (
    (0, 3),
    (0.0, 2),
    (-0.0, 1),
    (1.0, 1),
    (-7.5, 1),
    (3, 1),
    (1e4, 1),
    (math.inf, 1),
    (-math.inf, 1),
    (math.nan, 1),
)
ROWS = (1, 2, 3, 4, 5, 7, 8, 12, 16)
COLS = (16, 32, 48, 64, 96, 128)
MODES = ("plain", "autocast", "tf32", "no_grad")
SENTINEL = 4242.0  # poison of preallocated output buffers (the other poison is NaN)
MAX_HELD = 4

# how argument slots share memory in one aliasing group (see base_shape and group_views)
GROUP_KINDS = ("single", "offset", "same", "overlap_rows", "overlap_elem", "disjoint")
_GROUP_TEXT = {
    "single": "{0} alone",
    "offset": "{0} = buf[1:] (a view at an offset)",
    "same": "{0} is {1} (the same tensor twice)",
    "overlap_rows": "{0} = buf[1:], {1} = buf[:-1] (overlapping rows)",
    "overlap_elem": "{0} = flat[1:], {1} = flat[:-1] (overlapping by all but one element)",
    "disjoint": "{0} = buf[:R], {1} = buf[R:] (disjoint views of one buffer)",
}


@dataclasses.dataclass
class Slot:
    """One argument of a region."""

    name: str
    kind: str  # rc | w | cache | bcache | dyn_float | dyn_count | dyn_pos | static_float
    role: str = "in"  # rc: "in" (random data) or "out" (a poisoned preallocated buffer)
    written: bool = False  # the region writes it (in place)
    menu: tuple = ()  # static_float: the values calls pick from

    @property
    def is_tensor(self) -> bool:
        return self.kind in ("rc", "w", "cache", "bcache")

    @property
    def is_dynamic(self) -> bool:
        return self.kind.startswith("dyn_")


@dataclasses.dataclass
class Value:
    """A name bound in the region body: an argument tensor or an intermediate."""

    name: str
    kind: str  # rc ([R, C] float32, contiguous) | r ([R]) | cache ([P, R, C]) | bcache ([R, P, C]) | w ([C, C])
    slot: int | None = None  # the argument it is (None: an intermediate made inside the region)
    ready: bool = True  # holds defined data (a poisoned output slot is not ready until written)


@dataclasses.dataclass(frozen=True)
class Group:
    kind: str
    slots: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Pattern:
    """How a call's rc arguments share memory: one group per base buffer."""

    groups: tuple[Group, ...]

    def group_of(self, slot: int) -> Group:
        for group in self.groups:
            if slot in group.slots:
                return group
        raise KeyError(slot)

    def relation(self, a: int, b: int) -> str:
        """none | identical | partial, for two distinct rc slots."""
        group = self.group_of(a)
        if b not in group.slots:
            return "none"
        if group.kind == "same":
            return "identical"
        if group.kind in ("overlap_rows", "overlap_elem"):
            return "partial"
        return "none"

    def overlapping_pairs(self, rows: int | None = None) -> tuple[tuple[int, int], ...]:
        """The argument pairs that share memory; with ``rows`` (the call's shape), only those
        that really overlap: ``buf[1:]`` and ``buf[:-1]`` of a two-row buffer are disjoint."""
        return tuple(
            g.slots
            for g in self.groups
            if g.kind in ("same", "overlap_rows", "overlap_elem")
            and len(g.slots) == 2
            and not (g.kind == "overlap_rows" and rows == 1)
        )

    def describe(self, slots: list[Slot]) -> str:
        parts = [
            _GROUP_TEXT[g.kind].format(*(slots[s].name for s in g.slots)) for g in self.groups if g.kind != "single"
        ]
        return "; ".join(parts) or "all distinct"


@dataclasses.dataclass
class OutLeaf:
    expr: str
    kind: str  # tensor | scalar | const
    feedable: bool = False  # a fresh [R, C] float32 tensor another call may take as an input
    value: str | None = None  # the Value it is (feedable leaves), to never feed one tensor twice


@dataclasses.dataclass(frozen=True)
class PadSpec:
    """How the padded family passes one argument: ``replay.padded(x, dim, fill, written)`` with
    this dim (0 or its negative spelling: every padded argument pads its rows) and written flag;
    the fill is drawn per call."""

    dim: int
    written: bool


@dataclasses.dataclass
class Region:
    index: int
    name: str
    slots: list[Slot]
    params: list[tuple]  # ("slot", i) | ("list", [i, ...]) | ("dict", [i, ...])
    patterns: list[Pattern]
    modes: tuple[str, ...]
    body: list[str]
    steps: list[str]  # what each step exercises, for the description
    outputs: list[OutLeaf]
    ret: str
    cache_rows: int
    uses_rng: bool = False
    has_matmul: bool = False
    refusal: str | None = None
    # the padded family: slot -> how it is padded; the parameters from this index on are passed
    # by keyword; a matmul runs in bfloat16 whatever the mode (the unpadded check's tolerance)
    padded: dict[int, PadSpec] = dataclasses.field(default_factory=dict)
    keyword_from: int | None = None
    reduced_precision: bool = False

    def _signature(self) -> tuple[list[str], list[str]]:
        """The parameter names and the lines unpacking grouped parameters."""
        names = []
        unpack = []
        for entry in self.params:
            if entry[0] == "slot":
                names.append(self.slots[entry[1]].name)
            else:
                group = f"grp{len(unpack)}"
                names.append(group)
                members = [self.slots[i].name for i in entry[1]]
                if entry[0] == "list":
                    unpack.append(f"{', '.join(members)}{',' if len(members) == 1 else ''} = {group}")
                else:
                    unpack.extend(f"{m} = {group}[{m!r}]" for m in members)
        return names, unpack

    @property
    def source(self) -> str:
        names, unpack = self._signature()
        lines = [f"def {self.name}({', '.join(names)}):"]
        lines += [f"    {line}" for line in unpack + self.body]
        lines.append(f"    return {self.ret}")
        return "\n".join(lines) + "\n"

    def split_arguments(self, args: list) -> tuple[list, dict]:
        """Positional and keyword arguments of a call (``keyword_from``: replay.padded may be a
        keyword argument too)."""
        if self.keyword_from is None:
            return args, {}
        names = self._signature()[0]
        cut = self.keyword_from
        return args[:cut], dict(zip(names[cut:], args[cut:]))

    def feedable_slots(self, pattern: Pattern) -> list[int]:
        """rc input slots the region only reads and that share memory with no other argument:
        a held output of another call may be passed there."""
        return [
            i
            for i, s in enumerate(self.slots)
            if s.kind == "rc" and s.role == "in" and not s.written and pattern.group_of(i).kind == "single"
        ]

    def describe(self) -> str:
        slots = ", ".join(
            f"{s.name}:{s.kind}" + (f"({s.role})" if s.kind == "rc" else "") + ("[written]" if s.written else "")
            for s in self.slots
        )
        lines = [
            f"region {self.index} ({self.name}): {len(self.steps)} steps: {'; '.join(self.steps)}",
            f"  arguments: {slots}; cache rows {self.cache_rows}",
            "  aliasing patterns: " + " | ".join(p.describe(self.slots) for p in self.patterns),
            f"  modes: {', '.join(self.modes)}",
        ]
        if self.refusal:
            lines.append(f"  refusal step (replay must warn and run eagerly): {self.refusal}")
        if self.padded:
            padded = ", ".join(
                f"{self.slots[i].name} dim={p.dim}" + (" written" if p.written else "") for i, p in self.padded.items()
            )
            names = self._signature()[0]
            keywords = names[self.keyword_from :] if self.keyword_from is not None else []
            lines.append(
                f"  padded: {padded}; by keyword: {', '.join(keywords) or 'none'}"
                + ("; a matmul in bfloat16" if self.reduced_precision else "")
            )
        lines += ["  " + line for line in self.source.splitlines()]
        return "\n".join(lines)


@dataclasses.dataclass
class Case:
    seed: int
    family: str
    regions: list[Region]
    shapes: list[tuple[int, int]]
    policy: dict
    weights: list[float]
    steps: int
    # the padded family: the session's buckets (also in policy), and the most rows a call draws
    buckets: tuple[int, ...] = ()
    max_rows: int = 0

    def describe(self) -> str:
        if self.buckets:
            shapes = (
                f"rows 1..{self.max_rows} (unpadded beyond {self.buckets[-1]}) x cols {[c for _, c in self.shapes]}"
            )
        else:
            shapes = f"shapes {self.shapes}"
        lines = [
            f"case seed {self.seed}, family {self.family}, {self.steps} calls, {shapes}, "
            f"policy {self.policy}, region weights {self.weights}"
        ]
        lines += [r.describe() for r in self.regions]
        return "\n".join(lines)


class _RegionBuilder:
    #: how often a region holds a step replay must refuse
    refusal_chance = 0.07

    def __init__(self, rng: random.Random, index: int, name: str, family: str):
        self.rng = rng
        self.index = index
        self.name = name
        self.family = family
        self.slots: list[Slot] = []
        self.values: list[Value] = []
        self.body: list[str] = []
        self.steps: list[str] = []
        self.patterns: list[Pattern] = []
        self.cache_rows = rng.choice((3, 4, 6, 8))
        self.temps = 0
        self.uses_rng = False
        self.has_matmul = False
        self.reduced_precision = False  # a matmul in bfloat16 whatever the mode
        self.last: Value | None = None

    # --- slots and values ------------------------------------------------------------------
    def add_slot(self, slot: Slot, value_kind: str | None = None) -> int:
        self.slots.append(slot)
        index = len(self.slots) - 1
        if value_kind is not None:
            self.values.append(Value(slot.name, value_kind, index, ready=slot.role == "in"))
        return index

    def slot_value(self, kind: str) -> Value:
        """The tensor argument of this kind (w or cache), made on first use."""
        for value in self.values:
            if value.kind == kind and value.slot is not None:
                return value
        prefix = {"w": "w", "cache": "c"}[kind]
        self.add_slot(Slot(f"{prefix}0", kind), kind)
        return self.values[-1]

    def scalar_slot(self, kind: str) -> str:
        existing = [s for s in self.slots if s.kind == kind]
        limit = 2 if kind == "dyn_float" else 1
        if existing and (len(existing) >= limit or self.rng.random() < 0.6):
            return self.rng.choice(existing).name
        prefix = {"dyn_float": "f", "dyn_count": "n", "dyn_pos": "p", "static_float": "k"}[kind]
        menu = ()
        if kind == "static_float":
            menu = tuple(sorted({self.rng.choice((0.5, 1.25, -0.75, 2.0)) for _ in range(self.rng.choice((1, 2)))}))
        self.add_slot(Slot(f"{prefix}{len(existing)}", kind, menu=menu))
        return self.slots[-1].name

    def temp(self, kind: str) -> Value:
        value = Value(f"v{self.temps}", kind)
        self.temps += 1
        return value

    def produce(self, value: Value) -> None:
        self.values.append(value)
        self.last = value

    def pick(self, kind: str = "rc") -> Value | None:
        candidates = [v for v in self.values if v.kind == kind and v.ready]
        if not candidates:
            return None
        return self.rng.choices(candidates, weights=[1 + i for i in range(len(candidates))])[0]

    # --- aliasing rules --------------------------------------------------------------------
    def relation(self, a: Value, b: Value) -> str:
        if a is b:
            return "identical"
        if a.slot is None or b.slot is None or a.kind != "rc" or b.kind != "rc":
            return "none"
        if a.slot == b.slot:
            return "identical"
        worst = "none"
        for pattern in self.patterns:
            r = pattern.relation(a.slot, b.slot)
            if r == "partial":
                return "partial"
            if r == "identical":
                worst = "identical"
        return worst

    def can_write(self, target: Value, reads: list[Value], elementwise: bool) -> bool:
        """A kernel or torch op writing ``target`` while reading ``reads``: it must never see a
        partial overlap (a race in a kernel, an error in torch), and an identical operand only
        where each element is read and written by the same thread (elementwise)."""
        for read in reads:
            r = self.relation(target, read)
            if r == "partial" or (r == "identical" and not elementwise):
                return False
        return True

    def target(self, reads: list[Value], elementwise: bool) -> Value | None:
        """An rc argument to write into (a preallocated output, or an input updated in place)."""
        candidates, weights = [], []
        for value in self.values:
            if value.slot is None or value.kind != "rc" or not self.can_write(value, reads, elementwise):
                continue
            candidates.append(value)
            weights.append(4 if not value.ready else 1)
        if not candidates:
            return None
        return self.rng.choices(candidates, weights=weights)[0]

    def wrote(self, value: Value) -> None:
        value.ready = True
        if value.slot is not None:
            self.slots[value.slot].written = True
        self.last = value

    # --- scalar expressions ----------------------------------------------------------------
    def float_expr(self) -> str:
        choice = self.rng.random()
        if choice < 0.15:
            return repr(self.rng.choice((1.5, -0.5, 0.25, 2.0)))
        if choice < 0.25:
            return self.scalar_slot("static_float")
        f = self.scalar_slot("dyn_float")
        if choice < 0.6:
            return f
        form = self.rng.choice(("{f} * 0.5", "-{f}", "({f} + {k})", "({f} - 1.0)"))
        return form.format(f=f, k=self.scalar_slot("static_float") if "{k}" in form else "")

    def count_expr(self) -> str:
        n = self.scalar_slot("dyn_count")
        return self.rng.choice((n, n, f"({n} + 1) // 2", f"{n} // 2"))

    def pos_expr(self) -> str:
        p = self.scalar_slot("dyn_pos")
        rows = self.cache_rows
        return self.rng.choice((p, p, f"({p} + 1) % {rows}", f"{rows - 1} - {p}"))

    # --- steps -----------------------------------------------------------------------------
    def step_axpb(self) -> bool:
        a = self.pick()
        A, B = self.float_expr(), self.float_expr()
        t = self.target([a], elementwise=True) if self.rng.random() < 0.35 else None
        if t is not None:
            self.body.append(f"axpb({a.name}, {t.name}, {A}, {B})")
            self.wrote(t)
            self.steps.append(f"jit axpb into argument {t.name}")
        else:
            v = self.temp("rc")
            self.body += [f"{v.name} = torch.empty_like({a.name})", f"axpb({a.name}, {v.name}, {A}, {B})"]
            self.produce(v)
            self.steps.append("jit axpb")
        return True

    def step_add_scalar(self) -> bool:
        t = self.pick()
        self.body.append(f"add_scalar_({t.name}, {self.float_expr()})")
        self.wrote(t)
        self.steps.append("jit in-place add" + (f" on argument {t.name}" if t.slot is not None else ""))
        return True

    def step_copy_row(self) -> bool:
        src = self.pick()
        cache = self.slot_value("cache")
        self.body.append(f"copy_row({src.name}, {cache.name}, {self.pos_expr()})")
        self.wrote(cache)
        self.steps.append("jit copy into cache[pos] (offset from a dynamic scalar)")
        return True

    def step_prefix(self) -> bool:
        a = self.pick()
        n = self.count_expr()
        t = self.target([a], elementwise=True) if self.rng.random() < 0.35 else None
        if t is not None:
            self.body.append(f"prefix({a.name}, {t.name}, {n})")
            self.wrote(t)
            self.steps.append(f"jit grid cdiv(n, 64) writing the first n elements of argument {t.name}")
        else:
            v = self.temp("rc")
            self.body += [f"{v.name} = torch.full_like({a.name}, -7.5)", f"prefix({a.name}, {v.name}, {n})"]
            self.produce(v)
            self.steps.append("jit grid cdiv(n, 64) writing the first n elements")
        return True

    def step_row_sum(self) -> bool:
        a = self.pick()
        v = self.temp("r")
        self.body += [f"{v.name} = {a.name}.new_empty({a.name}.shape[0])", f"row_sum({a.name}, {v.name})"]
        self.produce(v)
        self.steps.append("jit row reduction")
        return True

    def step_shift_add(self) -> bool:
        a = self.pick()
        t = self.target([a], elementwise=False) if self.rng.random() < 0.3 else None
        if t is not None:
            self.body.append(f"shift_add({a.name}, {t.name})")
            self.wrote(t)
            self.steps.append(f"jit shifted view x[1:] into argument {t.name}")
        else:
            v = self.temp("rc")
            self.body += [f"{v.name} = torch.empty_like({a.name})", f"shift_add({a.name}, {v.name})"]
            self.produce(v)
            self.steps.append("jit shifted view x[1:]")
        return True

    def step_binary(self) -> bool:
        a, b = self.pick(), self.pick()
        v = self.temp("rc")
        self.body.append(f"{v.name} = {a.name} {self.rng.choice('+-*')} {b.name}")
        self.produce(v)
        self.steps.append("torch elementwise")
        return True

    def step_unary(self) -> bool:
        a = self.pick()
        v = self.temp("rc")
        form = self.rng.choice(("torch.tanh({a})", "torch.sigmoid({a})", "torch.softmax({a}, -1)", "{a}.relu()"))
        self.body.append(f"{v.name} = {form.format(a=a.name)}")
        self.produce(v)
        self.steps.append("torch unary")
        return True

    def step_inplace(self) -> bool:
        t, b = self.pick(), self.pick()
        if not self.can_write(t, [b], elementwise=True):
            return False
        self.body.append(f"{t.name}.{self.rng.choice(('add_', 'mul_'))}({b.name})")
        self.wrote(t)
        self.steps.append("torch in-place" + (f" on argument {t.name}" if t.slot is not None else ""))
        return True

    def step_out(self) -> bool:
        a, b = self.pick(), self.pick()
        t = self.target([a, b], elementwise=True)
        if t is None:
            return False
        if self.rng.random() < 0.5:
            self.body.append(f"torch.{self.rng.choice(('add', 'mul'))}({a.name}, {b.name}, out={t.name})")
            self.steps.append(f"torch out= argument {t.name}")
        else:
            self.body.append(f"{t.name}.copy_({a.name})")
            self.steps.append(f"torch copy_ into argument {t.name}")
        self.wrote(t)
        return True

    def step_matmul(self) -> bool:
        a = self.pick()
        w = self.slot_value("w")
        v = self.temp("rc")
        form = self.rng.choice(self.matmul_forms())
        if form == "plain":
            self.body.append(f"{v.name} = ({a.name} @ {w.name}).float()")
        elif form == "autocast":
            self.body += [
                'with torch.autocast("cuda", dtype=torch.bfloat16):',
                f"    {v.name} = {a.name} @ {w.name}",
                f"{v.name} = {v.name}.float()",
            ]
        elif form == "autocast_off":
            self.body += [
                'with torch.autocast("cuda", enabled=False):',
                f"    {v.name} = ({a.name} @ {w.name}).float()",
            ]
        else:
            self.body.append(f"{v.name} = (({a.name} @ {a.name}.t()) @ {a.name} * 0.125).float()")
        self.produce(v)
        self.has_matmul = True
        self.reduced_precision |= form == "autocast"
        self.steps.append(f"torch matmul ({form.replace('_', ' ')})")
        return True

    def matmul_forms(self) -> tuple[str, ...]:
        """The matmuls drawn from (one per entry; "gram" is x @ x.t() @ x)."""
        return ("plain", "plain", "autocast", "autocast_off", "gram")

    def step_row_scale(self) -> bool:
        r = self.pick("r")
        if r is None:
            return False
        a = self.pick()
        v = self.temp("rc")
        self.body.append(f"{v.name} = {a.name} * torch.tanh({r.name})[:, None]")
        self.produce(v)
        self.steps.append("torch broadcast of a row vector")
        return True

    def step_cache_read(self) -> bool:
        cache = self.slot_value("cache")
        v = self.temp("rc")
        if self.rng.random() < 0.5:
            self.body.append(f"{v.name} = {cache.name}.sum(0)")
        else:
            a = self.pick()
            self.body.append(f"{v.name} = {cache.name}[{self.rng.randrange(self.cache_rows)}] * {a.name}")
        self.produce(v)
        self.steps.append("torch reads the cache")
        return True

    def step_random(self) -> bool:
        a = self.pick()
        v = self.temp("rc")
        # NaN (a poisoned buffer read after a partial write) must never reach bernoulli or
        # multinomial: their device-side asserts would end the process's CUDA context
        forms = {
            "{a} + torch.rand_like({a})": 2,
            "torch.randn_like({a}) * {a}": 2,
            "torch.bernoulli(torch.sigmoid({a}).nan_to_num(0.5))": 2,
            "torch.multinomial(torch.softmax(torch.tanh({a}).nan_to_num(0.0), -1), {a}.shape[1], "
            "replacement=True).float()": 2,
            # without replacement torch checks the probabilities on the host: refused (a warning)
            "torch.multinomial(torch.softmax(torch.tanh({a}).nan_to_num(0.0), -1), {a}.shape[1]).float()": 1,
            "F.dropout({a}, p=0.25, training=True)": 2,
        }
        form = self.rng.choices(list(forms), weights=list(forms.values()))[0]
        self.body.append(f"{v.name} = {form.format(a=a.name)}")
        self.produce(v)
        self.uses_rng = True
        name = re.search(r"(rand_like|randn_like|bernoulli|multinomial|dropout)", form).group(1)
        if name == "multinomial":
            name += " with replacement" if "replacement=True" in form else " without replacement"
        self.steps.append(f"torch random {name}")
        return True

    def step_refusal(self, kind: str) -> bool:
        a = self.pick()
        v = self.temp("rc")
        if kind == "host sync":
            self.body.append(f"{v.name} = {a.name} * (2.0 if float({a.name}.abs().sum()) > 1e30 else 1.0)")
        else:  # a dynamic scalar passed to a torch op
            self.body.append(f"{v.name} = {a.name} * {self.scalar_slot('dyn_float')}")
        self.produce(v)
        self.steps.append(f"refused: {kind}")
        return True

    # --- outputs ---------------------------------------------------------------------------
    def tensor_leaf(self, value: Value) -> OutLeaf:
        fresh = value.slot is None and value.kind == "rc"
        return OutLeaf(value.name, "tensor", feedable=fresh, value=value.name if fresh else None)

    def view_leaf(self) -> OutLeaf | None:
        rc_args = [v for v in self.values if v.kind == "rc" and v.slot is not None]
        others = [v for v in self.values if v.kind in ("rc", "cache", "r") and v.ready]
        base = self.rng.choice(rc_args) if rc_args and self.rng.random() < 0.6 else self.rng.choice(others)
        if base.kind == "cache":
            form = self.rng.choice(("{x}[0]", "{x}[1:]", "{x}.view(-1)"))
        elif base.kind == "r":
            form = self.rng.choice(("{x}[1:]", "{x}[:1]"))
        else:
            form = self.rng.choice(("{x}[1:]", "{x}[:-1]", "{x}.view(-1)", "{x}.t()", "{x}[:, 1:]", "{x}[0]"))
        return OutLeaf(form.format(x=base.name), "tensor")

    def output_values(self) -> list[Value]:
        """The values a region may return as a whole."""
        return [v for v in self.values if v.ready]

    def scalar_leaf(self) -> OutLeaf:
        dynamic = [s.name for s in self.slots if s.is_dynamic]
        if dynamic and self.rng.random() < 0.7:
            name = self.rng.choice(dynamic)
            form = self.rng.choice(("{s}", "{s} + 1", "{s} * 2"))
            return OutLeaf(form.format(s=name), "scalar")
        return OutLeaf(repr(self.rng.choice(("tag", 3, None, 0.5))), "const")

    def outputs(self) -> tuple[list[OutLeaf], str]:
        rng = self.rng
        leaves = [self.tensor_leaf(self.last)]
        for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
            roll = rng.random()
            if roll < 0.4:
                leaves.append(self.tensor_leaf(rng.choice(self.output_values())))
            elif roll < 0.75:
                leaves.append(self.view_leaf())
            else:
                leaves.append(self.scalar_leaf())
        if self.refusal == "typed view output":
            arg = rng.choice([v for v in self.values if v.kind == "rc" and v.slot is not None])
            leaves.insert(rng.randrange(len(leaves) + 1), OutLeaf(f"{arg.name}.view(torch.int32)", "tensor"))
        rng.shuffle(leaves)
        exprs = [leaf.expr for leaf in leaves]
        n = len(leaves)
        if n == 1 and rng.random() < 0.6:
            return leaves, exprs[0]
        shapes = ["tuple", "list", "dict", "nested"]
        if n in (2, 3):
            shapes.append("namedtuple")
        if n == 2:
            shapes.append("dataclass")
        shape = rng.choice(shapes)
        if shape == "tuple":
            ret = f"({', '.join(exprs)}{',' if n == 1 else ''})"
        elif shape == "list":
            ret = f"[{', '.join(exprs)}]"
        elif shape == "dict":
            ret = "{" + ", ".join(f"'o{i}': {e}" for i, e in enumerate(exprs)) + "}"
        elif shape == "namedtuple":
            ret = f"Out{n}({', '.join(exprs)})"
        elif shape == "dataclass":
            ret = f"OutDC(a={exprs[0]}, b={exprs[1]})"
        else:
            cut = rng.randrange(n + 1)
            ret = (
                "{'first': (" + "".join(f"{e}, " for e in exprs[:cut]) + "), 'rest': [" + ", ".join(exprs[cut:]) + "]}"
            )
        return leaves, ret

    # --- the whole region ------------------------------------------------------------------
    def step_table(self) -> list[tuple[Callable[[], bool], int]]:
        """The building blocks and their weights."""
        return [
            (self.step_axpb, 5),
            (self.step_add_scalar, 3),
            (self.step_copy_row, 3),
            (self.step_prefix, 4),
            (self.step_row_sum, 2),
            (self.step_shift_add, 2),
            (self.step_binary, 4),
            (self.step_unary, 3),
            (self.step_inplace, 3),
            (self.step_out, 3),
            (self.step_matmul, 4),
            (self.step_row_scale, 2),
            (self.step_cache_read, 2),
        ]

    def parameters(self, order: list[int]) -> list[tuple]:
        """The region's parameters in this order, some of them grouped in a list or a dict."""
        rng = self.rng
        params: list[tuple] = [("slot", i) for i in order]
        if len(order) >= 3 and rng.random() < 0.25:
            start = rng.randrange(len(order) - 1)
            size = rng.randint(2, min(3, len(order) - start))
            members = order[start : start + size]
            params = (
                [("slot", i) for i in order[:start]]
                + [(rng.choice(("list", "dict")), members)]
                + [("slot", i) for i in order[start + size :]]
            )
        return params

    def build(self) -> Region:
        rng = self.rng
        count = rng.choice((1, 1, 2, 2, 3))
        for i in range(count):
            role = "in" if i == 0 or rng.random() < 0.65 else "out"
            self.add_slot(Slot(f"x{i}", "rc", role=role), "rc")
        self.patterns = [Pattern(tuple(Group("single", (i,)) for i in range(count)))]
        for _ in range(rng.choice((0, 1, 1, 2))):
            if count >= 2 and rng.random() < 0.8:
                i, j = sorted(rng.sample(range(count), 2))
                kind = rng.choice(("same", "same", "overlap_rows", "overlap_elem", "disjoint"))
                groups = [Group(kind, (i, j))] + [Group("single", (s,)) for s in range(count) if s not in (i, j)]
            else:
                i = rng.randrange(count)
                groups = [Group("offset", (i,))] + [Group("single", (s,)) for s in range(count) if s != i]
            pattern = Pattern(tuple(groups))
            if pattern not in self.patterns:
                self.patterns.append(pattern)

        functions, weights = zip(*self.step_table())
        n_steps = rng.randint(2, 7)
        random_at = rng.randrange(n_steps) if self.family in RNG_FAMILIES else -1
        self.refusal = None
        if rng.random() < self.refusal_chance:
            self.refusal = rng.choice(("host sync", "dynamic scalar passed to torch", "typed view output"))
        refusal_at = rng.randrange(n_steps) if self.refusal in ("host sync", "dynamic scalar passed to torch") else -1
        for number in range(n_steps):
            if number == random_at:
                self.step_random()
            if number == refusal_at:
                self.step_refusal(self.refusal)
            for _ in range(10):
                if rng.choices(functions, weights=weights)[0]():
                    break
        if self.last is None:
            self.step_binary()

        outputs, ret = self.outputs()
        modes = ["plain"]
        if self.has_matmul:
            modes += rng.sample(("autocast", "tf32"), rng.choice((0, 1, 1, 2)))
        elif rng.random() < 0.25:
            modes.append(rng.choice(("autocast", "no_grad")))

        order = list(range(len(self.slots)))
        rng.shuffle(order)
        params = self.parameters(order)
        return Region(
            index=self.index,
            name=self.name,
            slots=self.slots,
            params=params,
            patterns=self.patterns,
            modes=tuple(modes),
            body=self.body,
            steps=self.steps,
            outputs=outputs,
            ret=ret,
            cache_rows=self.cache_rows,
            uses_rng=self.uses_rng,
            has_matmul=self.has_matmul,
            refusal=self.refusal,
        )


class _PaddedRegionBuilder(_RegionBuilder):
    """The grammar of the padded family. Every row-shaped argument (the [R, C] ones and a
    batch-major cache [R, P, C]) is padded along its rows, so every building block must keep
    row i of each result a function of row i of those arguments (and of the weight and the
    scalars) alone: anything else differs padded by design, and the fuzzer would blame replay
    for what the region does.

    Kept: the elementwise jit kernels (axpb, the in-place add, the first-n prefix with n at
    most the call's own elements), the jit reduction over columns, torch elementwise ops and
    softmax over columns, in-place and ``out=`` writes (the written arguments are passed with
    ``written=True``), matmuls against the fixed weight, a row vector broadcast over columns,
    per-row writes into and reads of the batch-major cache (:func:`copy_rows` at a dynamic
    slot, torch at a constant one). Left out: the shifted view x[1:] (row i reads row i+1), the
    Gram matrix x @ x.t() (mixes rows), the [P, R, C] cache (its rows are dim 1: every padded
    argument here pads dim 0, so the dim outputs are sliced along is unambiguous), random
    numbers (what a row draws depends on its position in the whole padded tensor), a host sync
    over the padded rows (it reads row 0 only). Outputs are batch-shaped, their size along dim 0
    the call's rows, since replay slices exactly those back (a row x[0] or a transpose would be
    sliced by accident or not at all, as the docs warn)."""

    def slot_value(self, kind: str) -> Value:
        for value in self.values:
            if value.kind == kind and value.slot is not None:
                return value
        prefix = {"w": "w", "bcache": "c"}[kind]
        self.add_slot(Slot(f"{prefix}0", kind), kind)
        return self.values[-1]

    def matmul_forms(self) -> tuple[str, ...]:
        return ("plain", "plain", "autocast", "autocast_off")

    def step_bcache_write(self) -> bool:
        src = self.pick()
        cache = self.slot_value("bcache")
        if self.rng.random() < 0.6:
            self.body.append(f"copy_rows({src.name}, {cache.name}, {self.pos_expr()})")
            self.steps.append("jit per-row write into cache[:, pos] (offset from a dynamic scalar)")
        else:
            slot = self.rng.randrange(self.cache_rows)
            form = self.rng.choice(("{c}[:, {k}].copy_({x})", "{c}[:, {k}] += {x}"))
            self.body.append(form.format(c=cache.name, k=slot, x=src.name))
            self.steps.append("torch per-row write into cache[:, k]")
        self.wrote(cache)
        return True

    def step_bcache_read(self) -> bool:
        cache = self.slot_value("bcache")
        v = self.temp("rc")
        if self.rng.random() < 0.5:
            self.body.append(f"{v.name} = {cache.name}.sum(1)")  # over the slots, not the rows
        else:
            a = self.pick()
            self.body.append(f"{v.name} = {cache.name}[:, {self.rng.randrange(self.cache_rows)}] * {a.name}")
        self.produce(v)
        self.steps.append("torch reads the cache per row")
        return True

    def step_refusal(self, kind: str) -> bool:
        if kind != "host sync":
            return super().step_refusal(kind)
        a = self.pick()
        v = self.temp("rc")
        self.body.append(f"{v.name} = {a.name} * (2.0 if float({a.name}[0].abs().sum()) > 1e30 else 1.0)")
        self.produce(v)
        self.steps.append(f"refused: {kind}")
        return True

    def step_table(self) -> list[tuple[Callable[[], bool], int]]:
        return [
            (self.step_axpb, 5),
            (self.step_add_scalar, 3),
            (self.step_bcache_write, 3),
            (self.step_prefix, 4),
            (self.step_row_sum, 2),
            (self.step_binary, 4),
            (self.step_unary, 3),
            (self.step_inplace, 3),
            (self.step_out, 3),
            (self.step_matmul, 4),
            (self.step_row_scale, 2),
            (self.step_bcache_read, 2),
        ]

    def output_values(self) -> list[Value]:
        return [v for v in self.values if v.ready and v.kind in ("rc", "r", "bcache")]

    def view_leaf(self) -> OutLeaf:
        rng = self.rng
        rc_args = [v for v in self.values if v.kind == "rc" and v.slot is not None]
        base = rng.choice(rc_args) if rc_args and rng.random() < 0.6 else rng.choice(self.output_values())
        if base.kind == "bcache":
            form = rng.choice(("{x}[:, 0]", "{x}[:, 1:]", "{x}.view({x}.shape[0], -1)"))
        elif base.kind == "r":
            form = rng.choice(("{x}[:, None]", "{x}.unsqueeze(1)"))
        else:
            form = rng.choice(("{x}[:, 1:]", "{x}[:, :-1]", "{x}[:, ::2]", "{x}.view({x}.shape[0], -1, 16)"))
        return OutLeaf(form.format(x=base.name), "tensor")

    def parameters(self, order: list[int]) -> list[tuple]:
        """As the base's, but replay.padded may only be a top-level argument: only the other
        slots (scalars, the weight) are grouped; and from a random parameter on, the call passes
        them by keyword."""
        rng = self.rng
        params: list[tuple] = [("slot", i) for i in order]
        loose = [i for i in order if self.slots[i].kind not in ("rc", "bcache")]
        if len(loose) >= 2 and rng.random() < 0.25:
            members = sorted(rng.sample(loose, rng.randint(2, min(3, len(loose)))), key=order.index)
            params = [("slot", i) for i in order if i not in members]
            at = sum(1 for i in order[: order.index(members[0])] if i not in members)
            params.insert(at, (rng.choice(("list", "dict")), members))
        self.keyword_from = rng.randrange(len(params)) if rng.random() < 0.3 else None
        return params

    def build(self) -> Region:
        self.keyword_from = None
        region = super().build()
        rng = self.rng
        # arguments sharing memory stop sharing it once padded (each gets its own copy): that
        # changes nothing while the region only reads them, so patterns where it writes one of
        # them are dropped (the first pattern, all distinct, always stays)
        region.patterns = [
            p for p in region.patterns if not any(self.slots[s].written for pair in p.overlapping_pairs() for s in pair)
        ]
        region.padded = {
            i: PadSpec(
                dim=rng.choice((0, -2 if slot.kind == "rc" else -3)),
                written=slot.written or rng.random() < 0.15,  # copying back unchanged rows is harmless
            )
            for i, slot in enumerate(self.slots)
            if slot.kind in ("rc", "bcache")
        }
        region.keyword_from = self.keyword_from
        region.reduced_precision = self.reduced_precision
        return region


class _PolymorphicRegionBuilder(_PaddedRegionBuilder):
    """The grammar of the polymorphic family: the padded family's, but most regions launch jit
    kernels only (every launch one polymorphic replay can match at another size: the
    elementwise kernels, the first-n prefix, the reduction over columns, the per-row cache
    write at a dynamic slot); the others draw from the whole padded grammar, whose torch ops
    keep a graph from serving other sizes (those calls are padded, and say why)."""

    def __init__(self, rng: random.Random, index: int, name: str, family: str):
        super().__init__(rng, index, name, family)
        self.jit_only = rng.random() < 0.7
        if self.jit_only:
            self.refusal_chance = 0.0  # a refusal step is a torch op: the region would not be jit-only

    def step_jit_cache_write(self) -> bool:
        src = self.pick()
        cache = self.slot_value("bcache")
        self.body.append(f"copy_rows({src.name}, {cache.name}, {self.pos_expr()})")
        self.steps.append("jit per-row write into cache[:, pos] (offset from a dynamic scalar)")
        self.wrote(cache)
        return True

    def step_table(self) -> list[tuple[Callable[[], bool], int]]:
        if not self.jit_only:
            return super().step_table()
        return [
            (self.step_axpb, 6),
            (self.step_add_scalar, 3),
            (self.step_jit_cache_write, 2),
            (self.step_prefix, 4),
            (self.step_row_sum, 2),
        ]


def generate_region(rng: random.Random, index: int, name: str, family: str) -> Region:
    builder = {PADDED: _PaddedRegionBuilder, POLYMORPHIC: _PolymorphicRegionBuilder}.get(family, _RegionBuilder)
    return builder(rng, index, name, family).build()


def generate_case(seed: int, *, steps_per_region: int = 200, family: str | None = None) -> Case:
    """The case of this seed: its regions, shapes, session policy and number of calls (pure
    Python, deterministic per seed, family and steps_per_region)."""
    rng = random.Random(seed)
    drawn = rng.choices(FAMILIES, weights=(55, 25, 20))[0]
    family = family or drawn
    if family not in ALL_FAMILIES:
        raise ValueError(f"family must be one of {ALL_FAMILIES}, got {family!r}")
    if family in BUCKETED_FAMILIES:
        return _generate_padded_case(rng, seed, steps_per_region, family)
    n_regions = rng.choices((1, 2, 3), weights=(50, 35, 15))[0]
    shapes = sorted({(rng.choice(ROWS), rng.choice(COLS)) for _ in range(rng.choice((2, 3, 4)))})
    policy: dict = {
        "record_after": rng.choices((0, 1, 2), weights=(25, 60, 15))[0],
        "clone_outputs": False,
        "check_stale": False,
    }
    if rng.random() < 0.15:
        policy["max_graphs"] = rng.choice((2, 3, 4))
    if rng.random() < 0.15:
        policy["clone_outputs"] = True
    elif rng.random() < 0.12:
        policy["check_stale"] = True
    if family == "plain" and rng.random() < 0.15:
        policy["verify_every"] = rng.choice((2, 3, 5))
    regions = [generate_region(rng, i, f"fz{seed}_r{i}", family) for i in range(n_regions)]
    weights = [1.0] if n_regions == 1 else [1.0] + [3.0] * (n_regions - 1)
    return Case(seed, family, regions, shapes, policy, weights, steps_per_region * n_regions)


def _generate_padded_case(rng: random.Random, seed: int, steps_per_region: int, family: str = PADDED) -> Case:
    """A case of the padded family: a small random list of buckets, calls of 1 to a few rows
    beyond the largest bucket, one or two column counts; the policy as the other families draw
    it, but ``verify_every`` (which compares each padded call with an unpadded eager run within
    torch's default tolerance) only for regions without a matmul, whose other heights may round
    differently, and without a typed view output (an int32 view of floats that differ in the
    last bit differs by one, beyond any tolerance for ints). The polymorphic family adds
    ``polymorphic=True`` and, mostly, a recording budget that never runs out (short cases
    would otherwise observe few sizes)."""
    n_regions = rng.choices((1, 2, 3), weights=(50, 35, 15))[0]
    buckets = tuple(sorted(rng.sample(BUCKET_SIZES, rng.choice((1, 2, 3, 3, 4)))))
    max_rows = buckets[-1] + rng.choice((1, 2, 4))
    cols = sorted(rng.sample(COLS, rng.choice((1, 2))))
    policy: dict = {
        "record_after": rng.choices((0, 1, 2), weights=(25, 60, 15))[0],
        "clone_outputs": False,
        "check_stale": False,
        "buckets": list(buckets),
    }
    if rng.random() < 0.15:
        policy["max_graphs"] = rng.choice((2, 3, 4))
    if rng.random() < 0.15:
        policy["clone_outputs"] = True
    elif rng.random() < 0.12:
        policy["check_stale"] = True
    if family == POLYMORPHIC:
        policy["polymorphic"] = True
        if rng.random() < 0.8:
            policy["record_budget"] = 1.0
    regions = [generate_region(rng, i, f"fz{seed}_r{i}", family) for i in range(n_regions)]
    exact = not any(r.has_matmul or r.refusal == "typed view output" for r in regions)
    if exact and rng.random() < 0.25:
        policy["verify_every"] = rng.choice((2, 3, 5))
    weights = [1.0] if n_regions == 1 else [1.0] + [3.0] * (n_regions - 1)
    shapes = [(max_rows, c) for c in cols]
    return Case(seed, family, regions, shapes, policy, weights, steps_per_region * n_regions, buckets, max_rows)


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int:
    """The rows a call of ``rows`` runs with: the smallest bucket that holds them, or the rows
    themselves beyond the largest (replay does not pad those)."""
    return min((b for b in buckets if b >= rows), default=rows)


def _padded_shape(rng: random.Random, case: Case) -> tuple[int, int]:
    """A call's shape in the padded family: rows up to the largest bucket mostly, beyond it one
    call in five (those run unpadded, each on its own key)."""
    cols = rng.choice(case.shapes)[1]
    top = case.buckets[-1]
    if case.max_rows > top and rng.random() < 0.2:
        return rng.randint(top + 1, case.max_rows), cols
    return rng.randint(1, top), cols


# --------------------------------------------------------------------------------------------
# Planning the calls (pure Python)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Feed:
    held: int  # the held entry
    leaf: int  # which of its output leaves
    feedback: bool  # the output of the same region and key: the graph rewrites it while reading it
    compare_after: bool  # the fed tensor must be unchanged after the call


@dataclasses.dataclass
class Call:
    index: int
    region: int
    shape: tuple[int, int]
    pattern: int
    mode: str
    scalars: dict[int, object]  # slot -> value
    data_seed: int
    torch_seed: int
    poison: float
    feeds: dict[int, Feed]  # slot -> feed
    hold: int | None  # keep this call's outputs as held entry number ...
    checks: tuple[int, ...]  # held entries to compare after this call
    sig: tuple
    # the padded family: slot -> the fill of its added rows, the rows the call runs with, and
    # how: "padded", "exact bucket" (no copy) or "beyond the buckets" (unpadded, its own key)
    fills: dict[int, object] | None = None
    bucket: int | None = None
    padding: str | None = None

    def describe(self, case: Case) -> str:
        region = case.regions[self.region]
        scalars = ", ".join(
            f"{region.slots[i].name}={'dynamic(' + repr(v) + ')' if region.slots[i].is_dynamic else repr(v)}"
            for i, v in sorted(self.scalars.items())
        )
        feeds = ", ".join(
            f"{region.slots[i].name} <- held #{f.held} leaf {f.leaf}"
            + (" (feedback: the same region and key)" if f.feedback else "")
            for i, f in sorted(self.feeds.items())
        )
        padding = ""
        if self.fills is not None:
            fills = ", ".join(f"{region.slots[i].name}={v!r}" for i, v in sorted(self.fills.items()))
            padding = f"rows {self.shape[0]} -> {self.bucket} ({self.padding}; fills {fills}), "
        return (
            f"call {self.index}: region {self.region}, shape {self.shape}, {padding}"
            f"aliasing: {region.patterns[self.pattern].describe(region.slots)}, mode {self.mode}, "
            f"scalars: {scalars or 'none'}, poison {self.poison!r}, feeds: {feeds or 'none'}, "
            f"holds #{self.hold}, checks held {list(self.checks)}, data seed {self.data_seed}, "
            f"torch seed {self.torch_seed}"
        )


def _scalar_value(rng: random.Random, slot: Slot, shape: tuple[int, int], cache_rows: int) -> object:
    rows, cols = shape
    if slot.kind == "dyn_float":
        roll = rng.random()
        if roll < 0.05:
            return -0.0
        if roll < 0.1:
            return 1.0
        return round(rng.uniform(-2.0, 2.0), 3)
    if slot.kind == "dyn_count":
        roll = rng.random()
        if roll < 0.03:
            return 0  # a zero-size launch: a no-op
        if roll < 0.2:
            return rows * cols
        return rng.randint(1, rows * cols)
    if slot.kind == "dyn_pos":
        return rng.randrange(cache_rows)
    return rng.choice(slot.menu)


def plan_calls(case: Case, *, feedback: bool = True) -> list[Call]:
    """Every call of the case, drawn from its seed: which region, shape, aliasing pattern and
    mode, the scalar values, the data and torch seeds, which held outputs it takes as inputs,
    whether it holds its outputs, and which held outputs to check after it. Held outputs of a
    region are dropped when that region is called again with the same shape, mode, static
    scalars and overlap pattern (the same graph: it overwrites them, as documented), unless
    the session clones outputs. In the padded family the graph is the bucket's: a call of 3
    rows and one of 4 share the graph of bucket 4, so the bucket stands for the rows there (and
    the overlap pattern is left out, which only drops more held outputs than needed)."""
    rng = random.Random(case.seed * 7919 + 17)
    live: collections.OrderedDict[int, dict] = collections.OrderedDict()
    next_held = 0
    calls = []
    feeding = not case.policy.get("check_stale")
    for index in range(case.steps):
        r = rng.choices(range(len(case.regions)), weights=case.weights)[0]
        region = case.regions[r]
        shape = _padded_shape(rng, case) if case.buckets else rng.choice(case.shapes)
        p = rng.randrange(len(region.patterns))
        pattern = region.patterns[p]
        mode = region.modes[0] if rng.random() < 0.6 else rng.choice(region.modes)
        scalars = {
            i: _scalar_value(rng, s, shape, region.cache_rows) for i, s in enumerate(region.slots) if not s.is_tensor
        }
        statics = tuple(sorted((i, v) for i, v in scalars.items() if region.slots[i].kind == "static_float"))
        fills, bucket, padding = None, None, None
        if case.buckets:
            values, weights = zip(*FILLS)
            fills = {i: rng.choices(values, weights=weights)[0] for i in sorted(region.padded)}
            bucket = bucket_for(shape[0], case.buckets)
            if bucket > shape[0]:
                padding = "padded"
            else:
                padding = "exact bucket" if bucket in case.buckets else "beyond the buckets"
            sig = (r, (bucket, shape[1]), mode, statics, ())
        else:
            sig = (r, shape, mode, statics, pattern.overlapping_pairs(shape[0]))
        feeds: dict[int, Feed] = {}
        if feeding:
            used: set[tuple[int, str]] = set()
            for slot in region.feedable_slots(pattern):
                if rng.random() >= 0.45:
                    continue
                candidates = []
                for hid, held in live.items():
                    if held["shape"] != shape:
                        continue
                    same_graph = held["region"] == r and held["sig"] == sig
                    if same_graph and not feedback:
                        continue
                    for leaf, value in held["feedable"]:
                        if (hid, value) not in used:
                            candidates.append((hid, leaf, value, same_graph))
                if not candidates:
                    continue
                hid, leaf, value, same_graph = rng.choice(candidates)
                used.add((hid, value))
                clones = case.policy.get("clone_outputs", False)
                feeds[slot] = Feed(hid, leaf, feedback=same_graph, compare_after=clones or not same_graph)
        # a held output lives in the memory of the graph that made it, and of every graph whose
        # output was fed into the call that made it (a region may return its input as is)
        fed_deps = set().union(*(live[f.held]["deps"] for f in feeds.values() if f.held in live))
        if not case.policy.get("clone_outputs"):
            for hid in [h for h, held in live.items() if sig in held["deps"]]:
                del live[hid]
        checks = tuple(live)
        hold = None
        tensors = [i for i, leaf in enumerate(region.outputs) if leaf.kind == "tensor"]
        if tensors and rng.random() < 0.3:
            hold = next_held
            next_held += 1
            live[hold] = {
                "region": r,
                "sig": sig,
                "shape": shape,
                "feedable": [(i, leaf.value) for i, leaf in enumerate(region.outputs) if leaf.feedable],
                "deps": {sig} | fed_deps,
            }
            while len(live) > MAX_HELD:
                live.popitem(last=False)
        calls.append(
            Call(
                index=index,
                region=r,
                shape=shape,
                pattern=p,
                mode=mode,
                scalars=scalars,
                data_seed=rng.randrange(1 << 31),
                torch_seed=rng.randrange(1 << 31),
                poison=rng.choice((math.nan, SENTINEL)),
                feeds=feeds,
                hold=hold,
                checks=checks,
                sig=sig,
                fills=fills,
                bucket=bucket,
                padding=padding,
            )
        )
    return calls


# --------------------------------------------------------------------------------------------
# Running a case
# --------------------------------------------------------------------------------------------


def build_function(region: Region, launchers: dict[str, Callable] | None = None, device: str = "cuda") -> Callable:
    """The region as a Python function (its source registered with linecache, so tracebacks
    show its lines). Each region gets its own globals: torch, F, the launchers, Out2/Out3/OutDC."""
    source = region.source if device == "cuda" else region.source.replace('"cuda"', repr(device))
    filename = f"<fuzz region {region.name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {
        "__name__": "fuzz_regions",
        "torch": torch,
        "F": torch.nn.functional,
        "Out2": Out2,
        "Out3": Out3,
        "OutDC": OutDC,
        **(LAUNCHERS if launchers is None else launchers),
    }
    exec(compile(source, filename, "exec"), namespace)
    return namespace[region.name]


def _tensors_in(value: object) -> list[tuple[torch.Tensor, bool]]:
    """(tensor, padded) for every tensor in a call argument, containers walked."""
    if isinstance(value, replay.Padded):
        return [(value.tensor, True)]
    if isinstance(value, torch.Tensor):
        return [(value, False)]
    if isinstance(value, (list, tuple)):
        return [item for v in value for item in _tensors_in(v)]
    if isinstance(value, dict):
        return [item for v in value.values() for item in _tensors_in(v)]
    return []


def _refuse_padded_sharing(args: tuple | list, kwargs: dict) -> None:
    """The documented refusal: an argument that is copied to pad it may share no memory with
    another argument (that sharing would be lost). Raised as replay raises it: ValueError."""
    found = [item for a in (*args, *kwargs.values()) for item in _tensors_in(a)]
    spans = []
    for tensor, padded in found:
        start = tensor.data_ptr()
        reach = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) + 1 if tensor.numel() else 0
        spans.append((start, start + reach * tensor.element_size(), padded))
    for n, (lo, hi, padded) in enumerate(spans):
        for other_lo, other_hi, other_padded in spans[n + 1 :]:
            if (padded or other_padded) and lo < other_hi and other_lo < hi:
                raise ValueError("padded_reference: a padded argument shares memory with another argument")


def padded_reference(fn: Callable, args: tuple | list, kwargs: dict, buckets: list[int] | tuple[int, ...]) -> object:
    """The eager run of a padded call, the padded family's bit-for-bit reference: every
    ``replay.padded(x, dim, fill, written)`` argument is filled up along ``dim`` to the smallest
    bucket that holds its rows (a new tensor, the added rows ``fill``; beyond the largest bucket,
    or at a bucket's exact size, ``x`` itself), ``fn`` runs eagerly, the rows of every ``written``
    argument are copied back, and every tensor of the result whose size along ``dim`` is the
    bucket is narrowed to the call's rows (a view, as replay returns it).

    Why not compare with the unpadded run bit for bit: a matmul of another height may round
    differently (another kernel); the replay of a padded call must equal *this* exactly. Written
    here from the documented semantics rather than with replay.buckets, so that a mistake there
    is not mirrored in the reference. Every padded argument must pad the same dim (the fuzzer
    only pads rows): with several dims, which one outputs are sliced along is not specified."""
    marks = [a for a in (*args, *kwargs.values()) if isinstance(a, replay.Padded)]
    if not marks:
        return fn(*args, **kwargs)
    dims = {m.dim % m.tensor.dim() for m in marks}
    if len(dims) != 1:
        raise ValueError(f"padded_reference: every padded argument must pad one dim, got dims {sorted(dims)}")
    dim = dims.pop()
    sizes = {m.tensor.shape[dim] for m in marks}
    if len(sizes) != 1:
        raise ValueError(f"padded_reference: padded arguments of different sizes {sorted(sizes)}")
    rows = sizes.pop()
    bucket = min((b for b in buckets if b >= rows), default=rows)
    if bucket != rows:
        _refuse_padded_sharing(args, kwargs)
    grown: list[tuple[replay.Padded, torch.Tensor]] = []

    def pad(value: object) -> object:
        if not isinstance(value, replay.Padded):
            return value
        if bucket == rows:
            return value.tensor
        shape = list(value.tensor.shape)
        shape[dim] = bucket
        tensor = torch.full(shape, value.fill, dtype=value.tensor.dtype, device=value.tensor.device)
        tensor.narrow(dim, 0, rows).copy_(value.tensor)
        grown.append((value, tensor))
        return tensor

    result = fn(*[pad(a) for a in args], **{k: pad(v) for k, v in kwargs.items()})
    if bucket == rows:
        return result
    for mark, tensor in grown:
        if mark.written:
            mark.tensor.copy_(tensor.narrow(dim, 0, rows))
    return _slice_rows(result, dim, bucket, rows)


def _slice_rows(value: object, dim: int, bucket: int, rows: int) -> object:
    """``value`` with every tensor whose size along ``dim`` is ``bucket`` narrowed to ``rows``,
    through tuples, named tuples, lists, dicts and dataclasses (rebuilt, as replay rebuilds
    them)."""
    if isinstance(value, torch.Tensor):
        return value.narrow(dim, 0, rows) if value.dim() > dim and value.shape[dim] == bucket else value
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return type(value)(*(_slice_rows(v, dim, bucket, rows) for v in value))
    if isinstance(value, tuple):
        return tuple(_slice_rows(v, dim, bucket, rows) for v in value)
    if isinstance(value, list):
        return [_slice_rows(v, dim, bucket, rows) for v in value]
    if isinstance(value, dict):
        return {k: _slice_rows(v, dim, bucket, rows) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _slice_rows(getattr(value, f.name), dim, bucket, rows) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **fields)
    return value


def base_shapes(region: Region, pattern: Pattern, shape: tuple[int, int]) -> list[tuple[str, tuple, str]]:
    """(label, shape, fill) of every buffer a call allocates: one per aliasing group of rc
    arguments, then the w and cache arguments. fill: randn | poison | w."""
    rows, cols = shape
    sizes = {
        "single": (rows, cols),
        "offset": (rows + 1, cols),
        "same": (rows, cols),
        "overlap_rows": (rows + 1, cols),
        "overlap_elem": (rows * cols + 1,),
        "disjoint": (2 * rows, cols),
    }
    out = []
    for group in pattern.groups:
        names = "/".join(region.slots[s].name for s in group.slots)
        alone = group.kind in ("single", "offset")
        fill = "poison" if alone and region.slots[group.slots[0]].role == "out" else "randn"
        out.append((f"{names} buffer", sizes[group.kind], fill))
    for slot in region.slots:
        if slot.kind == "w":
            out.append((slot.name, (cols, cols), "w"))
        elif slot.kind == "cache":
            out.append((slot.name, (region.cache_rows, rows, cols), "randn"))
        elif slot.kind == "bcache":
            out.append((slot.name, (rows, region.cache_rows, cols), "randn"))
    return out


def group_views(group: Group, base: torch.Tensor, shape: tuple[int, int]) -> list[torch.Tensor]:
    rows, cols = shape
    kind = group.kind
    if kind == "single" or kind == "same":
        return [base] * len(group.slots)
    if kind == "offset":
        return [base[1:]]
    if kind == "overlap_rows":
        return [base[1:], base[:-1]]
    if kind == "overlap_elem":
        return [base[1:].view(rows, cols), base[:-1].view(rows, cols)]
    if kind == "disjoint":
        return [base[:rows], base[rows:]]
    raise ValueError(kind)


@dataclasses.dataclass
class Outcome:
    """One run of one call (eager or replayed)."""

    result: object = None
    error: BaseException | None = None
    buffers: list = dataclasses.field(default_factory=list)  # (label, tensor, compare) after the call
    structure: object = None
    leaves: list = dataclasses.field(default_factory=list)
    warnings: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Mismatch:
    seed: int
    family: str
    region: int
    call: int
    what: str
    call_text: str
    case_text: str
    steps_per_region: int = 200

    def report(self) -> str:
        return (
            f"replay fuzz mismatch: case seed {self.seed}, family {self.family}, region {self.region}, "
            f"call {self.call}\n{self.what}\n{self.call_text}\n{self.case_text}\n"
            f"reproduce: python -m tests.replay.fuzz_long --seed-start {self.seed} --cases 1 --family {self.family} "
            f"--steps-per-region {self.steps_per_region} --verbose"
        )

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class CaseResult:
    seed: int
    family: str
    regions: int
    planned: int
    calls: int = 0
    mismatch: Mismatch | None = None
    fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    other_warnings: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    loud: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # errors both raised, stale
    feeds: int = 0
    held_checks: int = 0
    stats: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    padding: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # padded family

    def line(self) -> str:
        s = self.stats
        fallbacks = sum(self.fallbacks.values())
        status = "MISMATCH" if self.mismatch else "ok"
        return (
            f"case seed={self.seed} family={self.family} regions={self.regions} calls={self.calls}/{self.planned} "
            f"replays={s.get('replays', '?')} eager={s.get('eager_runs', '?')} records={s.get('records', '?')} "
            f"declined={s.get('declined', '?')} eager_only_keys={s.get('eager_only_keys', '?')} "
            f"fallbacks={fallbacks} feeds={self.feeds} held_checks={self.held_checks} "
            f"{self.seconds:.1f}s {status}"
            + (f" padding={dict(self.padding)}" if self.padding else "")
            + (f" reasons={dict(self.fallbacks)}" if fallbacks else "")
        )


_STAT_NAMES = (
    "calls",
    "replays",
    "eager_runs",
    "records",
    "record_retries",
    "eager_only_keys",
    "patches",
    "staged_copies",
    "padded_in_place",
    "graphs",
    "evictions",
    "compactions",
    "invalidations",
    "verifications",
    "declined",
    "variants",
    "not_polymorphic",
)

_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    return t.view(_INT_VIEWS[t.element_size()])


def _flatten(value: object, leaves: list) -> object:
    """A structure descriptor (container types, dict keys, field names) and the leaves, in the
    order a region builds them."""
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return "tensor"
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return (type(value).__name__, tuple(_flatten(v, leaves) for v in value))
    if isinstance(value, tuple):
        return ("tuple", tuple(_flatten(v, leaves) for v in value))
    if isinstance(value, list):
        return ("list", tuple(_flatten(v, leaves) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(value), tuple(_flatten(v, leaves) for v in value.values()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = tuple(f.name for f in dataclasses.fields(value))
        return (type(value).__name__, names, tuple(_flatten(getattr(value, n), leaves) for n in names))
    leaves.append(value)
    return "scalar"


def _mutate_containers(value: object) -> None:
    """Edit a returned container the way a caller may (hazard: a replay returning the same
    container object every call would show the edit in the next call's result)."""
    if isinstance(value, list):
        for item in value:
            _mutate_containers(item)
        value.append("edited by the caller")
    elif isinstance(value, dict):
        for item in list(value.values()):
            _mutate_containers(item)
        value["edited"] = "by the caller"
    elif isinstance(value, tuple):
        for item in value:
            _mutate_containers(item)
    elif isinstance(value, OutDC):
        _mutate_containers(value.a)
        _mutate_containers(value.b)
        value.a = "edited by the caller"


def _same_scalar(a: object, b: object) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return a == b


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _describe_difference(label: str, expected: torch.Tensor, got: torch.Tensor) -> str:
    e, g = _bits(expected).reshape(-1), _bits(got).reshape(-1)
    diff = (e != g).nonzero().reshape(-1)
    first = int(diff[0]) if diff.numel() else -1
    ev = expected.reshape(-1)[first].item() if first >= 0 else None
    gv = got.reshape(-1)[first].item() if first >= 0 else None
    return (
        f"{label}: {diff.numel()} of {e.numel()} elements differ ({expected.dtype}, shape {tuple(expected.shape)}); "
        f"first at flat index {first}: eager {ev!r}, replay {gv!r}"
    )


def _reason(message: str) -> str:
    text = message.split("runs eagerly from now on: ", 1)[-1]
    text = re.sub(r"0x[0-9a-f]+", "#", text)
    text = re.sub(r"\d+", "#", text)
    return text[:120]


class EagerSession:
    """A stand-in for ``replay.capture()`` that runs every call eagerly (what a correct replay
    must be indistinguishable from): tests the harness itself, on any device."""

    def __init__(self, **policy: object):
        self.policy = policy

    def __enter__(self) -> EagerSession:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def region(self, fn: Callable) -> Callable:
        buckets = self.policy.get("buckets") or ()

        def call(*args, **kwargs):
            args = [_plain(a) for a in args]
            kwargs = {k: _plain(v) for k, v in kwargs.items()}
            return padded_reference(fn, args, kwargs, buckets)  # fn(*args, **kwargs) unless padded

        return call

    def stats(self) -> None:
        return None


def _plain(value: object) -> object:
    if isinstance(value, replay.Dynamic):
        return value.value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@contextlib.contextmanager
def torch_mode(mode: str, device: str):
    """A global torch mode around both runs of a call (replay keys on it)."""
    if mode == "autocast":
        with torch.autocast(device, dtype=torch.bfloat16):
            yield
    elif mode == "tf32":
        old = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(old)
    elif mode == "no_grad":
        with torch.no_grad():
            yield
    else:
        yield


class _Stop(Exception):
    pass


def _padded_call(fn: Callable, buckets: tuple[int, ...], *args, **kwargs) -> object:
    return padded_reference(fn, args, kwargs, buckets)


def unpadded_tolerance(region: Region, mode: str) -> dict:
    """assert_close's tolerance between a padded call and the unpadded eager run: torch's
    default for float32 where the region has no matmul (its row-wise ops give each row the same
    result whatever the height, up to a last bit where a reduction or a vectorized loop splits
    otherwise); 1e-4 with a float32 matmul (a kernel for another height may sum in another
    order); 0.1 with a matmul in bfloat16 or TF32 (summed in another order, a bfloat16 result
    may round to its neighbour, 0.4% off, which a softmax or a product downstream amplifies;
    TF32 is closer, but the mode is per call, not per matmul). A padding
    mistake (a fill leaking into a call's row, a row lost, a write not copied back) is off by
    far more; the bit-for-bit comparison with the padded reference stays exact in every case."""
    if not region.has_matmul:
        return {}
    if region.reduced_precision or mode in ("autocast", "tf32"):
        return {"rtol": 0.1, "atol": 0.1}
    return {"rtol": 1e-4, "atol": 1e-4}


def _comparable(t: torch.Tensor) -> torch.Tensor:
    """A plain float tensor for assert_close: an int32 view of floats (the typed view output)
    compared as the floats it holds (a last-bit difference of the float is no tolerance away
    as an int)."""
    t = t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t
    if not t.dtype.is_floating_point and not t.dtype.is_complex and t.element_size() == 4:
        t = t.view(torch.float32)
    return t


class Harness:
    """Runs cases eagerly and through a session and compares them (see the module docstring).

    ``session_factory`` (default ``replay.capture``) and ``launchers`` (default the jit
    launchers) can be replaced to test the harness on the CPU; ``feedback`` turns feeding a
    region's output back into the same region and key on or off."""

    def __init__(
        self,
        *,
        device: str = "cuda",
        session_factory: Callable | None = None,
        launchers: dict[str, Callable] | None = None,
        feedback: bool = True,
        log: Callable[[str], None] | None = None,
    ):
        self.device = device
        self.session_factory = session_factory or replay.capture
        self.launchers = launchers
        self.feedback = feedback
        self.log = log or (lambda line: None)

    # --- RNG -------------------------------------------------------------------------------
    def _get_rng(self):
        return torch.cuda.get_rng_state() if self.device == "cuda" else torch.get_rng_state()

    def _set_rng(self, state) -> None:
        if self.device == "cuda":
            torch.cuda.set_rng_state(state)
        else:
            torch.set_rng_state(state)

    # --- inputs ----------------------------------------------------------------------------
    def make_buffers(self, case: Case, call: Call) -> list[torch.Tensor]:
        """Fresh inputs of one call from its data seed (the same tensors every time)."""
        region = case.regions[call.region]
        generator = torch.Generator(device=self.device)
        generator.manual_seed(call.data_seed)
        buffers = []
        for _, size, fill in base_shapes(region, region.patterns[call.pattern], call.shape):
            if fill == "poison":
                buffers.append(torch.full(size, call.poison, device=self.device))
                continue
            t = torch.randn(size, device=self.device, generator=generator)
            if fill == "w":
                t = t * (size[0] ** -0.5)
            buffers.append(t)
        return buffers

    def build_args(self, case: Case, call: Call, buffers: list, fed: dict, dynamic: bool, padded: bool = False):
        """The call's arguments built on ``buffers`` (fed slots take the held tensors), and the
        (label, tensor, compare) list of everything the region may have written. ``padded``: the
        padded family's arguments wrapped in ``replay.padded`` (for the session and for
        :func:`padded_reference`; the unpadded run takes them plain)."""
        region = case.regions[call.region]
        pattern = region.patterns[call.pattern]
        values: dict[int, object] = {}
        after = []
        labels = [label for label, _, _ in base_shapes(region, pattern, call.shape)]
        position = 0
        for group in pattern.groups:
            base = buffers[position]
            label = labels[position]
            position += 1
            fed_slot = group.slots[0] if group.slots[0] in fed else None
            if fed_slot is not None:
                tensor = fed[fed_slot]
                values[fed_slot] = tensor
                feed = call.feeds[fed_slot]
                after.append(
                    (f"fed input {region.slots[fed_slot].name} (held #{feed.held})", tensor, feed.compare_after)
                )
                continue
            for slot, view in zip(group.slots, group_views(group, base, call.shape)):
                values[slot] = view
            after.append((label, base, True))
        for i, slot in enumerate(region.slots):
            if slot.kind in ("w", "cache", "bcache"):
                values[i] = buffers[position]
                after.append((slot.name, buffers[position], True))
                position += 1
            elif not slot.is_tensor:
                value = call.scalars[i]
                values[i] = replay.dynamic(value) if dynamic and slot.is_dynamic else value
        if padded and call.fills is not None:
            for i, spec in region.padded.items():
                values[i] = replay.padded(values[i], spec.dim, call.fills[i], written=spec.written)
        args = []
        for entry in region.params:
            if entry[0] == "slot":
                args.append(values[entry[1]])
            elif entry[0] == "list":
                args.append([values[i] for i in entry[1]])
            else:
                args.append({region.slots[i].name: values[i] for i in entry[1]})
        return args, after

    def _fed(self, case: Case, call: Call, held: dict) -> dict:
        """slot -> the held tensor to pass there (only what both runs can take)."""
        fed = {}
        rows, cols = call.shape
        for slot, feed in call.feeds.items():
            leaves = held.get(feed.held)
            if leaves is None or feed.leaf >= len(leaves):
                continue
            t = leaves[feed.leaf]
            if (
                isinstance(t, torch.Tensor)
                and t.dtype == torch.float32
                and tuple(t.shape) == (rows, cols)
                and t.is_contiguous()
            ):
                fed[slot] = t
        return fed

    # --- running ---------------------------------------------------------------------------
    def _run(self, fn: Callable, args: list, call: Call, reseed: bool, kwargs: dict | None = None) -> Outcome:
        outcome = Outcome()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch_mode(call.mode, self.device):
                if reseed:
                    torch.manual_seed(call.torch_seed)
                try:
                    outcome.result = fn(*args, **(kwargs or {}))
                except Exception as error:
                    outcome.error = error
        outcome.warnings = list(caught)
        if outcome.error is None:
            outcome.structure = _flatten(outcome.result, outcome.leaves)
        return outcome

    def _eager(self, case: Case, call: Call, fn: Callable, state: dict, buffers: list, reseed: bool) -> Outcome:
        fed = self._fed(case, call, state["eager_held"])
        state["fed"][call.index] = set(fed)
        args, after = self.build_args(case, call, buffers, fed, dynamic=False, padded=True)
        args, kwargs = case.regions[call.region].split_arguments(args)
        outcome = self._run(fn, args, call, reseed, kwargs)
        outcome.buffers = after
        if call.hold is not None and outcome.error is None:
            state["eager_held"][call.hold] = list(outcome.leaves)
        return outcome

    def _replay(self, case: Case, call: Call, region_fn: Callable, state: dict, buffers: list, reseed: bool):
        allowed = state["fed"][call.index]
        fed = {s: t for s, t in self._fed(case, call, state["replay_held"]).items() if s in allowed}
        if set(fed) != allowed:
            return None, "a held output the eager run took as an input is missing from the replay run"
        args, after = self.build_args(case, call, buffers, fed, dynamic=True, padded=True)
        args, kwargs = case.regions[call.region].split_arguments(args)
        outcome = self._run(region_fn, args, call, reseed, kwargs)
        outcome.buffers = after
        return outcome, None

    def _unpadded(self, case: Case, call: Call, fn: Callable, state: dict, buffers: list) -> Outcome:
        """The padded family's second reference: the same call eagerly without padding (the
        held outputs the padded reference took as inputs, the same buffers' values)."""
        allowed = state["fed"][call.index]
        fed = {s: t for s, t in self._fed(case, call, state["eager_held"]).items() if s in allowed}
        args, after = self.build_args(case, call, buffers, fed, dynamic=False)
        args, kwargs = case.regions[call.region].split_arguments(args)
        outcome = self._run(fn, args, call, True, kwargs)
        outcome.buffers = after
        return outcome

    def _compare_unpadded(self, case: Case, call: Call, plain: Outcome, got: Outcome) -> str | None:
        """None, or how the padded replay differs from the unpadded eager run beyond
        :func:`unpadded_tolerance` (structure, shapes, dtypes and scalars exactly). Errors are
        left to the bit-for-bit comparison, except the unpadded run raising alone."""
        if got.error is not None:
            return None
        if plain.error is not None:
            return (
                f"the unpadded eager run raised {type(plain.error).__name__}: {plain.error}; the padded ones returned"
            )
        if plain.structure != got.structure:
            return f"result structure differs: unpadded {plain.structure!r}, padded replay {got.structure!r}"
        region = case.regions[call.region]
        pending = []
        for number, (e, g) in enumerate(zip(plain.leaves, got.leaves)):
            label = f"output leaf {number}"
            if len(region.outputs) == len(plain.leaves):
                label += f" ({region.outputs[number].expr})"
            if isinstance(e, torch.Tensor) != isinstance(g, torch.Tensor):
                return f"{label}: unpadded {type(e).__name__}, padded replay {type(g).__name__}"
            if not isinstance(e, torch.Tensor):
                if not _same_scalar(e, g):
                    return f"{label}: unpadded {e!r}, padded replay {g!r}"
                continue
            if e.dtype != g.dtype or e.shape != g.shape:
                return f"{label}: unpadded {e.dtype} {tuple(e.shape)}, padded replay {g.dtype} {tuple(g.shape)}"
            pending.append((label, e, g))
        for (label, e, compare), (_, g, _) in zip(plain.buffers, got.buffers):
            if compare:
                pending.append((f"input {label} after the call", e, g))
        tolerance = unpadded_tolerance(region, call.mode)
        for label, e, g in pending:
            try:
                torch.testing.assert_close(
                    _comparable(g), _comparable(e), equal_nan=True, check_stride=False, **tolerance
                )
            except AssertionError as error:
                detail = " ".join(line.strip() for line in str(error).splitlines()[:4])
                return f"{label}: {detail} (tolerance {tolerance or 'torch default'})"
        return None

    def _compare(self, case: Case, call: Call, expected: Outcome, got: Outcome, state: dict, result: CaseResult):
        """None, or what differs."""
        if expected.error is not None or got.error is not None:
            if expected.error is None:
                trace = "".join(traceback.format_exception(got.error)[-6:])
                return f"replay raised {type(got.error).__name__}: {got.error}\n{trace}eager returned normally"
            if got.error is None:
                return f"eager raised {type(expected.error).__name__}: {expected.error}; replay returned normally"
            if type(expected.error) is not type(got.error):
                return (
                    f"eager raised {type(expected.error).__name__}: {expected.error}; replay raised "
                    f"{type(got.error).__name__}: {got.error}"
                )
            result.loud[f"both raised {type(got.error).__name__}"] += 1
            return None
        if expected.structure != got.structure:
            return f"result structure differs: eager {expected.structure!r}, replay {got.structure!r}"
        pending: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        eager_inputs = [(_storage_key(t), label) for label, t, _ in expected.buffers]
        replay_inputs = [(_storage_key(t), label) for label, t, _ in got.buffers]
        region = case.regions[call.region]
        for number, (e, g) in enumerate(zip(expected.leaves, got.leaves)):
            label = f"output leaf {number}"
            if isinstance(e, torch.Tensor) != isinstance(g, torch.Tensor):
                return f"{label}: eager {type(e).__name__}, replay {type(g).__name__}"
            if not isinstance(e, torch.Tensor):
                if not _same_scalar(e, g):
                    return f"{label}: eager {e!r} ({type(e).__name__}), replay {g!r} ({type(g).__name__})"
                continue
            if e.dtype != g.dtype or e.shape != g.shape or e.device != g.device:
                return (
                    f"{label}: eager {e.dtype} {tuple(e.shape)} {e.device}, "
                    f"replay {g.dtype} {tuple(g.shape)} {g.device}"
                )
            if e.numel() and not case.policy.get("clone_outputs"):  # clone_outputs: documented copies
                if e.stride() != g.stride():
                    return f"{label}: strides eager {e.stride()}, replay {g.stride()}"
                e_key, g_key = _storage_key(e), _storage_key(g)
                e_in = [i for i, (k, _) in enumerate(eager_inputs) if k == e_key]
                g_in = [i for i, (k, _) in enumerate(replay_inputs) if k == g_key]
                if e_in != g_in:
                    where = lambda found, inputs: (
                        f"a view of {inputs[found[0]][1]}" if found else "not an input's memory"
                    )
                    return (
                        f"{label}: eager output is {where(e_in, eager_inputs)}, "
                        f"replay output is {where(g_in, replay_inputs)}"
                    )
                if e_in and e.storage_offset() != g.storage_offset():
                    return (
                        f"{label}: a view of an input at storage offset {e.storage_offset()} eagerly, "
                        f"{g.storage_offset()} replayed"
                    )
            if len(region.outputs) == len(expected.leaves):
                label += f" ({region.outputs[number].expr})"
            pending.append((label, e, g))
        for (label, e, compare), (_, g, _) in zip(expected.buffers, got.buffers):
            if compare:
                pending.append((f"input {label} after the call", e, g))
        for hid in call.checks:
            e_leaves = state["eager_held"].get(hid)
            g_leaves = state["replay_held"].get(hid)
            if e_leaves is None or g_leaves is None:
                continue
            for number, (e, g) in enumerate(zip(e_leaves, g_leaves)):
                if isinstance(e, torch.Tensor) and e.numel():
                    try:
                        g_plain = _bits(g)  # reading a held output (check_stale may refuse: loud)
                    except replay.StaleOutputError:
                        result.loud["held output refused as stale"] += 1
                        state["replay_held"].pop(hid, None)
                        break
                    del g_plain
                    pending.append(
                        (f"held #{hid} output leaf {number} (kept since call {state['held_at'][hid]})", e, g)
                    )
                    result.held_checks += 1
        if pending:
            flags = torch.stack([torch.ne(_bits(e), _bits(g)).any() for _, e, g in pending]).tolist()
            for flag, (label, e, g) in zip(flags, pending):
                if flag:
                    return _describe_difference(label, e, g)
        return None

    def run_case(self, case: Case, *, calls: int | None = None) -> CaseResult:
        plan = plan_calls(case, feedback=self.feedback)
        if calls is not None:
            plan = plan[:calls]
        fns = [build_function(r, self.launchers, self.device) for r in case.regions]
        references = [functools.partial(_padded_call, fn, case.buckets) for fn in fns]
        result = CaseResult(case.seed, case.family, len(case.regions), len(plan))
        state = {"eager_held": {}, "replay_held": {}, "fed": {}, "held_at": {}}
        started = time.perf_counter()
        case_text = None
        per_region = case.steps // len(case.regions)

        def fail(call: Call, what: str) -> None:
            nonlocal case_text
            case_text = case_text or case.describe()
            result.mismatch = Mismatch(
                case.seed, case.family, call.region, call.index, what, call.describe(case), case_text, per_region
            )
            raise _Stop

        def count_padding(call: Call) -> None:
            result.padding[call.padding] += 1
            if call.padding == "padded":
                specs = case.regions[call.region].padded
                if any(spec.written for spec in specs.values()):
                    result.padding["written copied back"] += 1
                if any(not fill == 0 for fill in call.fills.values()):  # NaN too
                    result.padding["fill not 0"] += 1

        def account(call: Call, got: Outcome) -> None:
            result.calls += 1
            result.feeds += len(call.feeds)
            for w in got.warnings:
                if issubclass(w.category, replay.ReplayWarning):
                    result.fallbacks[_reason(str(w.message))] += 1
                else:
                    result.other_warnings[f"{w.category.__name__}: {str(w.message)[:80]}"] += 1

        def replay_and_check(call: Call, expected: Outcome, buffers: list, reseed: bool, plain=None) -> None:
            got, problem = self._replay(case, call, regions[call.region], state, buffers, reseed)
            if problem:
                fail(call, problem)
            account(call, got)
            what = self._compare(case, call, expected, got, state, result)
            if what and case.family == POLYMORPHIC and plain is not None:
                # a size its bucket's graph serves at its own size returns what the unpadded
                # run returns: bit for bit equal to that one is right too
                if self._compare(case, call, plain, got, state, result) is None:
                    what = None
                    result.padding["served at its own size"] += 1
                    if call.hold is not None and call.hold in state["eager_held"]:
                        state["eager_held"][call.hold] = list(plain.leaves)  # what later checks expect
            if what:
                fail(call, what)
            if plain is not None:
                what = self._compare_unpadded(case, call, plain, got)
                if what:
                    fail(
                        call,
                        f"the padded replay differs from the UNPADDED eager run (padding changed the result):\n{what}",
                    )
                count_padding(call)
            if call.hold is not None and got.error is None and call.hold in state["eager_held"]:
                state["replay_held"][call.hold] = list(got.leaves)
                state["held_at"][call.hold] = call.index
            if got.error is None:
                _mutate_containers(got.result)

        session = self.session_factory(**case.policy)
        try:
            with session:
                regions = [session.region(fn) for fn in fns]
                if case.family == "rng-sequence":
                    torch.manual_seed(case.seed)
                    start = self._get_rng()
                    expected = [
                        self._eager(case, c, fns[c.region], state, self.make_buffers(case, c), False) for c in plan
                    ]
                    self._set_rng(start)
                    for call, outcome in zip(plan, expected):
                        replay_and_check(call, outcome, self.make_buffers(case, call), False)
                elif case.buckets:
                    # the reference is the eager run of the same padded call (bit for bit), and
                    # the unpadded eager run too (within a tolerance); no random numbers here
                    for call in plan:
                        buffers = self.make_buffers(case, call)
                        padded_copies, plain_copies = [b.clone() for b in buffers], [b.clone() for b in buffers]
                        outcome = self._eager(case, call, references[call.region], state, padded_copies, True)
                        plain = self._unpadded(case, call, fns[call.region], state, plain_copies)
                        replay_and_check(call, outcome, buffers, True, plain)
                else:
                    reseed = True  # torch.manual_seed(s) right before each of the two runs
                    for call in plan:
                        buffers = self.make_buffers(case, call)
                        copies = [b.clone() for b in buffers]
                        outcome = self._eager(case, call, fns[call.region], state, copies, reseed)
                        replay_and_check(call, outcome, buffers, reseed)
                stats = session.stats()
                if stats is not None:
                    result.stats = {n: getattr(stats, n) for n in _STAT_NAMES if hasattr(stats, n)}
        except _Stop:
            stats = session.stats()
            if stats is not None:
                result.stats = {n: getattr(stats, n) for n in _STAT_NAMES if hasattr(stats, n)}
        except Exception as error:  # the session (or the device) failed outside a region call
            trace = "".join(traceback.format_exception(error)[-8:])
            result.mismatch = Mismatch(
                case.seed,
                case.family,
                -1,
                result.calls,
                f"crashed: {type(error).__name__}: {error}\n{trace}",
                "(outside a compared call)",
                case.describe(),
                per_region,
            )
        result.seconds = time.perf_counter() - started
        self.log(result.line())
        return result


@dataclasses.dataclass
class RunSummary:
    seed_start: int
    seed_end: int = -1
    cases: int = 0
    regions: int = 0
    steps: int = 0
    mismatches: list = dataclasses.field(default_factory=list)
    fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    other_warnings: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    loud: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    families: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    stats: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    feeds: int = 0
    held_checks: int = 0
    seconds: float = 0.0
    padding: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # padded family

    def add(self, case: Case, result: CaseResult) -> None:
        self.seed_end = case.seed
        self.cases += 1
        self.regions += len(case.regions)
        self.steps += result.calls
        self.families[case.family] += 1
        self.fallbacks.update(result.fallbacks)
        self.other_warnings.update(result.other_warnings)
        self.loud.update(result.loud)
        self.stats.update(result.stats)
        self.feeds += result.feeds
        self.held_checks += result.held_checks
        self.padding.update(result.padding)
        if result.mismatch is not None:
            self.mismatches.append(result.mismatch)

    def line(self) -> str:
        calls = self.stats.get("calls", 0)
        replays = self.stats.get("replays", 0)
        return (
            f"replay fuzz: {self.steps} steps, {self.cases} cases (seeds {self.seed_start}-{self.seed_end}), "
            f"{self.regions} regions, {len(self.mismatches)} mismatches, {sum(self.fallbacks.values())} fallbacks "
            f"({len(self.fallbacks)} reasons), replays {replays}/{calls} calls, {self.feeds} fed inputs, "
            f"{self.held_checks} held-output checks, {self.seconds:.1f} s"
            + (f", padding {dict(self.padding)}" if self.padding else "")
        )

    def as_dict(self) -> dict:
        return {
            "seed_start": self.seed_start,
            "seed_end": self.seed_end,
            "cases": self.cases,
            "regions": self.regions,
            "steps": self.steps,
            "mismatches": [m.as_dict() for m in self.mismatches],
            "fallbacks": dict(self.fallbacks.most_common()),
            "other_warnings": dict(self.other_warnings.most_common()),
            "refused_loudly": dict(self.loud.most_common()),
            "families": dict(self.families),
            "session_stats": dict(self.stats),
            "fed_inputs": self.feeds,
            "held_output_checks": self.held_checks,
            "seconds": round(self.seconds, 2),
            **({"padding": dict(self.padding)} if self.padding else {}),
        }


def run(
    harness: Harness,
    *,
    seed_start: int,
    steps: int | None = None,
    min_regions: int | None = None,
    cases: int | None = None,
    steps_per_region: int = 200,
    family: str | None = None,
    cycle_families: bool = False,
    stop_on_mismatch: bool = False,
    max_seconds: float | None = None,
    on_case: Callable[[RunSummary], None] | None = None,
) -> RunSummary:
    """Cases of seeds seed_start, seed_start+1, ... until ``steps`` calls, ``min_regions``
    regions or ``cases`` cases are done (whichever is given and reached first), or
    ``max_seconds`` passed. ``cycle_families`` gives case i the family FAMILIES[i % 3]; the
    padded family runs only when ``family=PADDED``."""
    summary = RunSummary(seed_start)
    started = time.perf_counter()
    seed = seed_start
    while True:
        if steps is not None and summary.steps >= steps:
            break
        if min_regions is not None and summary.regions >= min_regions:
            break
        if cases is not None and summary.cases >= cases:
            break
        if max_seconds is not None and time.perf_counter() - started > max_seconds:
            break
        chosen = family or (FAMILIES[summary.cases % len(FAMILIES)] if cycle_families else None)
        case = generate_case(seed, steps_per_region=steps_per_region, family=chosen)
        remaining = None if steps is None else steps - summary.steps
        result = harness.run_case(case, calls=remaining if remaining is not None and remaining < case.steps else None)
        summary.add(case, result)
        summary.seconds = time.perf_counter() - started
        if on_case is not None:
            on_case(summary)
        if result.mismatch is not None and stop_on_mismatch:
            break
        seed += 1
    summary.seconds = time.perf_counter() - started
    return summary
