"""The fuzzer's objects family: regions passed an object (a cache of layers holding tensors and
plain values, as a Hugging Face ``StaticCache`` holds them) and reading a module through their
globals, both changed between calls; every call compared with eager bit for bit.

A **case** (:func:`generate_objects_case`) draws a region from building blocks, each applied to
every layer of the state: jit kernels reading and writing a layer's tensors (rebound per call),
torch ops reading and writing them (the key then holds their addresses), plain values read into
kernel scalars and branches, a lazy first-call initialisation (attributes made on the first
call), the module's buffer and float read, and now and then what no graph replays: a Python
counter on the state, a draw from the CPU generator. Between calls (:func:`plan_object_calls`)
the state and the module change as users change them: a plain value set, a tensor attribute
given a new tensor, values written in place, a new state (a new cache per generation), the
module's float set, its buffer replaced or written in place.

Each call runs eagerly on a twin of the state (the same changes applied to both) and through the
session on the state, the previous replay's outputs poisoned with NaN first, after one
``torch.manual_seed`` each; the outputs, every tensor and plain value of both states afterwards,
and the calls' warnings are compared. A call that falls back to eager with a ReplayWarning is
fine; a silent difference is a :class:`ObjectsMismatch`.

The planner is pure Python; the harness runs on the GPU with the jit launchers and
``replay.capture``, or anywhere with fuzz_grammar.REFERENCE_LAUNCHERS and a stand-in session.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import linecache
import random
import warnings
from collections.abc import Callable

import torch

import replay

from . import fuzz_grammar as fz

OBJECTS = "objects"
ROWS, COLS = (4, 8, 16), (16, 32, 64)

#: Building blocks: each a few lines applied to every layer (``h`` the running vector, ``layer``
#: the layer, ``state`` the object, ``knobs`` the module the region reads as a global).
BLOCKS = {
    "jit scale": "out = torch.empty_like(h)\naxpb(h, out, layer.scale, knobs.bias)\nh = out",
    "torch weight": "h = torch.tanh(h @ layer.weight)",
    "jit write": "copy_row(h, layer.cache, pos)",
    "torch write": (
        "layer.cache.index_copy_(0, (layer.step % layer.cache.shape[0]).view(1), h.view(1, -1))\nlayer.step.add_(1)"
    ),
    "jit read": (
        "sums = torch.empty(layer.cache.shape[0], device=h.device)\nrow_sum(layer.cache, sums)\nh = h + sums[0]"
    ),
    "torch read": "h = h + layer.cache.mean(0)",
    "flag": "if layer.flag:\n    h = h * 2.0",
    "module": "h = h + knobs.table * knobs.bias",
    "lazy": (
        "if not layer.ready:\n    layer.total = torch.zeros((), device=h.device)\n    layer.ready = True\n"
        "layer.total.add_(h.sum())"
    ),
}
#: Blocks a graph cannot replay (their keys are refused, exactly as eager): drawn now and then.
UNREPLAYABLE = {
    "counter": "state.calls += 1",
    "cpu draw": "h = h * float(torch.rand(()))",
}
MUTATIONS = (
    "none", "none", "none", "none", "scale", "flag", "replace weight", "weight in place", "new state", "bias",
    "replace table", "table in place",
)  # fmt: skip


class Layer:
    """A cache layer: tensors, plain values, a step counter tensor (as HF's cumulative_length)."""

    def __init__(self, rows: int, cols: int, generator: torch.Generator, device: str):
        self.cache = torch.randn(rows, cols, generator=generator).to(device)
        self.weight = (torch.randn(cols, cols, generator=generator) / cols**0.5).to(device)
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        self.scale = 0.5
        self.flag = True
        self.ready = False


class State:
    """The object a region is passed: layers, a mode string, a Python counter."""

    def __init__(self, layers: int, rows: int, cols: int, seed: int, device: str):
        generator = torch.Generator().manual_seed(seed)
        self.layers = [Layer(rows, cols, generator, device) for _ in range(layers)]
        self.mode = "decode"
        self.calls = 0


@dataclasses.dataclass
class ObjectsCase:
    seed: int
    layers: int
    rows: int
    cols: int
    blocks: list[str]
    source: str

    def describe(self) -> str:
        return f"objects case {self.seed}: {self.layers} layers [{self.rows}, {self.cols}], blocks {self.blocks}"


def generate_objects_case(seed: int) -> ObjectsCase:
    """A random region over a state of layers (deterministic per seed)."""
    rng = random.Random(seed)
    names = rng.sample(sorted(BLOCKS), rng.randint(2, 5))
    if rng.random() < 0.15:
        names.append(rng.choice(sorted(UNREPLAYABLE)))
    rng.shuffle(names)
    body = "\n".join(_indented((BLOCKS | UNREPLAYABLE)[name], 8) for name in names)
    source = f"def region(h, state, pos):\n    for layer in state.layers:\n{body}\n    return h, state.mode\n"
    return ObjectsCase(seed, rng.randint(1, 3), rng.choice(ROWS), rng.choice(COLS), names, source)


def _indented(text: str, spaces: int) -> str:
    return "\n".join(" " * spaces + line for line in text.splitlines())


@dataclasses.dataclass
class ObjectCall:
    mutation: str
    pos: int
    seed: int  # of the call's random input and of torch.manual_seed before each run


def plan_object_calls(case: ObjectsCase, count: int) -> list[ObjectCall]:
    rng = random.Random(case.seed * 7919 + 1)
    return [ObjectCall(rng.choice(MUTATIONS), rng.randrange(case.rows), rng.randrange(1 << 30)) for _ in range(count)]


@dataclasses.dataclass
class ObjectsMismatch:
    seed: int
    call: int
    what: str
    case_text: str

    def report(self) -> str:
        return f"replay objects fuzz mismatch: case seed {self.seed}, call {self.call}\n{self.what}\n{self.case_text}"


@dataclasses.dataclass
class ObjectsResult:
    seed: int
    calls: int = 0
    mismatch: ObjectsMismatch | None = None
    fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    stats: object = None


def build_region(case: ObjectsCase, knobs: torch.nn.Module, launchers: dict[str, Callable]) -> Callable:
    """The region as a Python function (its source in linecache), reading ``knobs`` as a global."""
    filename = f"<fuzz objects region {case.seed}>"
    linecache.cache[filename] = (len(case.source), None, case.source.splitlines(True), filename)
    namespace = {"__name__": "fuzz_object_regions", "torch": torch, "knobs": knobs, **launchers}
    exec(compile(case.source, filename, "exec"), namespace)
    return namespace["region"]


def make_knobs(cols: int, device: str) -> torch.nn.Module:
    knobs = torch.nn.Module()
    knobs.register_buffer("table", torch.linspace(-1, 1, cols, device=device))
    knobs.bias = 0.25
    return knobs


def mutate(mutation: str, states: tuple[State, State], knobs: torch.nn.Module, case: ObjectsCase, call: ObjectCall):
    """The same change to the state and its twin (and to the module both runs read); returns
    the states (a new pair for ``new state``)."""
    rng = random.Random(call.seed)
    layer, scale, bias = rng.randrange(case.layers), rng.choice((0.5, -1.5, 2.0)), rng.choice((0.25, -0.75, 1.5))
    if mutation == "new state":
        fresh = State(case.layers, case.rows, case.cols, call.seed, knobs.table.device.type)
        return fresh, copy.deepcopy(fresh)
    for state in states:
        target = state.layers[layer]
        if mutation == "scale":
            target.scale = scale
        elif mutation == "flag":
            target.flag = not target.flag
        elif mutation == "replace weight":
            target.weight = target.weight.flip(0).contiguous()
        elif mutation == "weight in place":
            target.weight.mul_(-1.0)
    if mutation == "bias":
        knobs.bias = bias
    elif mutation == "replace table":
        knobs.table = knobs.table.flip(0).contiguous()
    elif mutation == "table in place":
        knobs.table.add_(0.5)
    return states


def state_values(state: State) -> list[tuple[str, object]]:
    """(path, value) of every value the state holds, for the comparison."""
    values = [("mode", state.mode), ("calls", state.calls)]
    for number, layer in enumerate(state.layers):
        values += [(f"layers[{number}].{name}", value) for name, value in sorted(vars(layer).items())]
    return values


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(fz._bits(a), fz._bits(b))
    return type(a) is type(b) and fz._same_scalar(a, b)


def run_objects_case(
    case: ObjectsCase,
    session_factory: Callable,
    *,
    calls: int = 60,
    device: str = "cuda",
    launchers: dict[str, Callable] | None = None,
) -> ObjectsResult:
    """Run ``case``'s calls through a session (``session_factory(**policy)``) and eagerly on a
    twin state; stop at the first difference."""
    result = ObjectsResult(case.seed)
    knobs = make_knobs(case.cols, device)
    fn = build_region(case, knobs, fz.LAUNCHERS if launchers is None else launchers)
    first = State(case.layers, case.rows, case.cols, case.seed, device)
    states = (first, copy.deepcopy(first))
    previous = None
    with torch.no_grad(), session_factory(record_budget=1.0) as session:
        region = session.region(fn)
        for number, call in enumerate(plan_object_calls(case, calls)):
            states = mutate(call.mutation, states, knobs, case, call)
            h = torch.randn(case.cols, generator=torch.Generator().manual_seed(call.seed)).to(device)
            torch.manual_seed(call.seed)
            expected = fn(h.clone(), states[1], call.pos)
            if previous is not None:
                previous.fill_(float("nan"))
            torch.manual_seed(call.seed)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = region(h, states[0], replay.dynamic(call.pos))
            for w in caught:
                if issubclass(w.category, replay.ReplayWarning):
                    result.fallbacks[fz._reason(str(w.message))] += 1
            what = _difference(got, expected, states)
            result.calls = number + 1
            if what:
                text = f"{case.describe()}\n{case.source}"
                result.mismatch = ObjectsMismatch(case.seed, number, f"{call}: {what}", text)
                break
            previous = got[0]
        stats = session.stats()
        result.stats = stats
    return result


def _difference(got: object, expected: object, states: tuple[State, State]) -> str:
    """What differs between the replayed and the eager call ("" where nothing does)."""
    if not isinstance(got, tuple) or len(got) != 2 or not _same(got[0], expected[0]) or got[1] != expected[1]:
        return "the outputs differ"
    mine_values, their_values = state_values(states[0]), state_values(states[1])
    if [path for path, _ in mine_values] != [path for path, _ in their_values]:
        return "the states hold other attributes after the call"
    for (path, mine), (_, theirs) in zip(mine_values, their_values):
        if not _same(mine, theirs):
            return f"state.{path} differs after the call"
    return ""
