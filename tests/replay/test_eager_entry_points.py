"""replay._eager's entry points (csrc/replay_eager.c) misused from Python raise, never crash:
each misuse runs in a subprocess, and a signal fails the test. Also: the gate reads its
program by field name, and a field renamed on one side fails loudly when the gate is made."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("replay._eager") is None, reason="replay._eager is not built")

#: Made in every subprocess: the extension loaded alone (no torch: each case starts in a moment),
#: a program of stand-ins with the fields DispatchProgram has, and ``raises``.
PRELUDE = """
import glob, importlib.util, attrs
path = glob.glob("replay/_eager*.so")[0]
spec = importlib.util.spec_from_file_location("replay._eager", path)
eager = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eager)
EagerGate, RegionCall = eager.EagerGate, eager.RegionCall
MISS, RUN_EAGERLY = object(), object()

class Drift(Exception):
    pass

class Tensor:  # stands for torch.Tensor: its shape
    def __init__(self, *shape):
        self.shape = shape

@attrs.define
class Sketch:
    counts: dict = attrs.Factory(dict)
    calls: int = 0
    window: int = 1024

    def halve(self):
        self.counts, self.calls = {}, 0

@attrs.define
class Counters:
    too_rare: int = 0
    eager_runs: int = 0

@attrs.define
class Forgotten:
    eager_runs: int = 0

@attrs.define
class Quiet:  # every count warms: the gate runs the call itself
    below: int = 10**6
    version: int = 0

@attrs.define
class ReplayTimes:
    runs: int = 0

@attrs.define
class Budget:
    version: int = 0

class Admission:
    record_after = 5

class Session:
    closed, _gpu = False, True

class Exclusion:
    def __enter__(self):
        return self

    def __exit__(self, *error):
        return False

FIELDS = dict(
    region=None, by_pre_key={}, entry_shapes={}, session=Session(), admission=Admission(), sketch=Sketch(),
    budget=Budget(), counters=Counters(), forgotten=Forgotten(), quiet=Quiet(), replay_times=ReplayTimes(),
    fn=lambda *a: "ran", exclusion=Exclusion(), touch=lambda entry: None, clock=lambda: 0.0, padded_type=None,
    buckets=frozenset(), largest=0, decide=lambda *a: RUN_EAGERLY, took=lambda seconds: None,
    replayed=lambda seconds: None, full_path=lambda args, kwargs: "full", region_drift=None, specs=((0, 0), (0, 1)),
    flat=0, tensor_type=Tensor, dynamic_type=Drift, dynamic_mark=("dynamic",), plain=frozenset({int}), miss=MISS,
    eagerly=RUN_EAGERLY, declined=object(), time_replays=True, mask=7, settled=256, settled_mask=63,
)
Program = attrs.make_class("Program", list(FIELDS), slots=True)

def program(**changes):
    return Program(**{**FIELDS, **changes})

def raises(kind, call, *args, **kwargs):
    try:
        call(*args, **kwargs)
    except kind as error:
        return str(error)
    raise AssertionError(f"{call} did not raise {kind.__name__}")

assert EagerGate(program())((Tensor(2),)) == "ran"  # the stand-ins make a working gate
"""

#: (name, code): each asserts what the misuse raises.
MISUSES = {
    "gate made with __new__ and called": """
        gate = EagerGate.__new__(EagerGate)
        assert "no program" in raises(RuntimeError, gate, (Tensor(1),))
        assert "no program" in raises(RuntimeError, lambda: gate.program)
        assert gate.direct_slots == []
    """,
    "gate called with wrong arguments": """
        gate = EagerGate(program())
        for args, kwargs in [((), {}), ((1,), {}), (([1],), {}), (((), ()), {}), (((),), {"x": 1})]:
            raises(TypeError, gate, *args, **kwargs)
    """,
    "gate made from something else than a program": """
        for other in (5, None, object(), "program"):
            raises(AttributeError, EagerGate, other)
        raises(TypeError, EagerGate)
        raises(TypeError, EagerGate, program(), program())
    """,
    "program fields of the wrong types": """
        for field, value in [("by_pre_key", []), ("entry_shapes", ()), ("specs", []), ("plain", set()),
                             ("buckets", [1]), ("tensor_type", 3), ("largest", "big"), ("mask", 1.5),
                             ("time_replays", 1)]:
            message = raises(TypeError, EagerGate, program(**{field: value}))
            assert field in message, message
        raises(OverflowError, EagerGate, program(largest=2**70))
    """,
    "a program that is no attrs class": """
        import types
        assert "plain slot" in raises(TypeError, EagerGate, types.SimpleNamespace(**FIELDS))
    """,
    "a second __init__ that fails leaves no half-made gate": """
        gate = EagerGate(program())
        raises(AttributeError, gate.__init__, 5)
        assert "no program" in raises(RuntimeError, gate, (Tensor(1),))
        gate.__init__(program())
        assert gate((Tensor(1),)) == "ran"
    """,
    "ints of the program's objects that are not ints": """
        made = program()
        gate = EagerGate(made)
        made.sketch.calls = "many"
        raises(TypeError, gate, (Tensor(1),))
        made.sketch.calls = 0
        made.sketch.counts = []
        raises(TypeError, gate, (Tensor(1),))
        made.sketch.counts = {}
        made.counters.eager_runs = 2**70
        raises(OverflowError, gate, (Tensor(1),))
        made.counters.eager_runs = 0
        del made.quiet.below
        raises(AttributeError, gate, (Tensor(1),))
    """,
    "a pre-key table of the wrong shape, or emptied while its candidates run": """
        table = {}
        gate = EagerGate(program(by_pre_key=table))
        x = Tensor(2)
        table[(x.shape,)] = "not a list"
        raises(TypeError, gate, (x,))
        table[(x.shape,)] = [("not", "a triple")]
        raises(TypeError, gate, (x,))
        candidates = table[(x.shape,)] = []
        def guard(*args):
            candidates.clear()  # an eviction while the candidates run
            return False
        candidates += [(guard, None, None), (guard, None, None)]
        assert gate((x,)) == "ran" and candidates == []  # none served: the eager path
    """,
    "region call made with __new__ and called": """
        call = RegionCall.__new__(RegionCall)
        assert "not initialised" in raises(RuntimeError, call, object(), 1)
        assert "not initialised" in raises(RuntimeError, call.__get__(object()), 1)
    """,
    "region call with wrong arguments": """
        raises(TypeError, RegionCall, miss=MISS, drift=5)
        raises(TypeError, RegionCall, miss=MISS)
        call = RegionCall(miss=MISS, drift=Drift)
        raises(TypeError, call)
        raises(AttributeError, call, object(), 1)
        class NoDispatch:
            dispatch = 5
        raises(TypeError, call, NoDispatch(), 1)
    """,
}


@pytest.mark.parametrize("name", list(MISUSES))
def test_a_misused_entry_point_raises_and_never_crashes(name):
    code = PRELUDE + textwrap.dedent(MISUSES[name]) + "\nprint('done')\n"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env()
    )
    assert done.returncode >= 0, f"killed by signal {-done.returncode}:\n{done.stderr[-3000:]}"
    assert done.returncode == 0 and done.stdout.strip().endswith("done"), done.stderr[-3000:]


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_a_renamed_field_fails_loudly_when_the_gate_is_made():
    """The gate reads the program by field name: a field renamed on the Python side (in the
    program, or in one of the objects whose ints it reads at their slots) is an error naming
    it, when the gate is made, never a wrong read later."""
    import attrs
    from replay._eager import EagerGate

    from replay.session import capture

    session = capture()
    program = session.region(lambda x: x).program
    Renamed = attrs.make_class("Renamed", {"too_rarely": attrs.field(default=0), "eager_runs": attrs.field(default=0)})
    with pytest.raises(AttributeError, match=r"program\.counters \(Renamed\) has no field 'too_rare'"):
        EagerGate(attrs.evolve(program, counters=Renamed()))
    fields = {f.name: getattr(program, f.name) for f in attrs.fields(type(program)) if f.name != "took"}
    Older = attrs.make_class("Older", {**{name: attrs.field() for name in fields}, "timed": attrs.field()}, slots=True)
    with pytest.raises(AttributeError, match="has no field 'took'"):
        EagerGate(Older(**fields, timed=None))
    gate = EagerGate(program)
    assert gate.program is program
    with pytest.raises(attrs.exceptions.FrozenAttributeError):
        program.by_pre_key = {}  # a fixed field: the gate read it once
