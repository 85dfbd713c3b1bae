"""replay._step (csrc/replay_step.c) misused from Python raises, never crashes the process.

Each misuse runs in a subprocess of its own, with the torch-side helper built for real (the
session's cache, tests/conftest.py), and fails on a signal: a step made without its program,
the lists it shares with its graph emptied or changed after it was built, a list changed by
the very comparison that reads it, wrong arguments, values that do not fit, malformed programs.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("replay._step") is None, reason="replay._step is not built")

ROOT = Path(__file__).resolve().parents[2]

#: What every misuse starts from: a graph replayed by its C step over the simulated exec.
PRELUDE = """
import torch
from jitcore import torch_native
from jitcore.backends import use_backend
from replay import _step, output_slots
from replay.dynamic import Dynamic
from tests.replay.test_graph import SimBackend
from tests.replay.test_step_program import stepped_graph

helper, why = torch_native.load()
assert helper is not None, why
graph, sim = stepped_graph(helper)
step = graph.replay
x = torch.randn(8)


def outcome(call):
    try:
        with use_backend(SimBackend(sim)):
            result = call()
    except Exception as error:
        print("raised", type(error).__name__, error)
    else:
        print("returned", type(result).__name__)
"""


def misuse(cache: Path, body: str) -> str:
    """Run ``body`` after PRELUDE in a fresh interpreter: its output, failing on a signal."""
    environment = dict(os.environ, JITCORE_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    environment.pop("JITCORE_NATIVE", None)
    script = PRELUDE + textwrap.dedent(body)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300
    )
    assert done.returncode >= 0, f"killed by signal {-done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, done.stderr
    return done.stdout


MISUSES = {
    "made without its program": (
        """
        from replay._step import ReplayStep
        for make in (lambda: ReplayStep.__new__(ReplayStep), lambda: object.__new__(ReplayStep)):
            try:
                made = make()
            except TypeError as error:
                print("raised TypeError", error)
            else:
                outcome(lambda: made(x, Dynamic(1.0)))
        """,
        ["raised TypeError", "raised TypeError"],
    ),
    "the last stream emptied after the build": (
        """
        graph.session.last_stream.clear()
        outcome(lambda: step(x, Dynamic(2.0)))
        outcome(lambda: graph.replay.fallback(x, Dynamic(2.0)))
        """,
        ["raised IndexError list index out of range"] * 2,
    ),
    "the last stream replaced by a wrong type": (
        """
        graph.session.last_stream[0] = "not a stream"
        graph.namespace["_LAST_STREAM"] = 5
        object.__setattr__(step.program, "last_stream", None)
        outcome(lambda: step(x, Dynamic(2.0)))
        """,
        ["returned"],
    ),
    "the remembered values emptied after the build": (
        """
        graph.namespace["_last"].clear()
        outcome(lambda: step(x, Dynamic(2.0)))
        """,
        ["raised IndexError"],
    ),
    "the remembered values emptied by the comparison reading them": (
        """
        class Emptying:
            def __ne__(self, other):
                graph.namespace["_last"].clear()
                return True

        graph.namespace["_last"][0] = Emptying()
        outcome(lambda: step(x, Dynamic(2.0)))
        """,
        ["raised IndexError"],
    ),
    "the namespace cleared (a released graph)": (
        """
        graph.namespace.clear()
        outcome(lambda: step(x, Dynamic(2.0)))
        """,
        ["raised KeyError"],
    ),
    "wrong arguments": (
        """
        outcome(lambda: step("a", "b"))
        outcome(lambda: step(x))
        outcome(lambda: step(x, Dynamic(2.0), 3))
        outcome(lambda: step(x, l1=Dynamic(2.0), other=1))
        outcome(lambda: step(x, 2.0))
        """,
        ["raised AttributeError", "raised TypeError", "raised TypeError", "raised TypeError", "raised AttributeError"],
    ),
    "values that do not fit": (
        """
        outcome(lambda: step(x, Dynamic(2**200)))
        outcome(lambda: step(x, Dynamic(-(2**200))))
        outcome(lambda: step(x, Dynamic(float("nan"))))
        """,
        ["returned _Mismatch", "returned _Mismatch", "returned"],
    ),
    "a slot's lanes changed while the step reads them": (
        """
        class Lane:
            own = 1
            own_storage_refs_c = 1

            @property
            def storage(self):
                lanes.clear()  # drops this lane too: the step must hold its own reference
                return torch.empty(4).untyped_storage()

        class Slot:
            use_count = staticmethod(output_slots._use_count)

        lanes = [Lane(), Lane()]
        Slot.lanes = lanes
        print("held", _step.held(step, Slot()))
        outcome(lambda: _step.held(step, object()))
        outcome(lambda: _step.held(object(), object()))
        outcome(lambda: _step.storage_references(object()))
        """,
        ["held ", "raised AttributeError", "raised TypeError", "raised AttributeError"],
    ),
}


@pytest.mark.parametrize("what", list(MISUSES))
def test_a_misused_step_raises_and_never_crashes(torch_native_cache, what):
    body, expected = MISUSES[what]
    lines = misuse(torch_native_cache, body).splitlines()
    assert len(lines) == len(expected), lines
    for line, start in zip(lines, expected):
        assert line.startswith(start), (line, start)


def test_malformed_programs_raise_and_never_crash(torch_native_cache):
    """Every malformed program of tests/replay/test_step_program.py, in a fresh process."""
    output = misuse(
        torch_native_cache,
        """
        from replay._step import ReplayStep
        from tests.replay.test_step_program import _DAMAGES

        for what, damage, error, named in _DAMAGES:
            try:
                ReplayStep(damage(step.program))
            except (TypeError, ValueError) as raised:
                print(what, "->", type(raised).__name__)
        """,
    )
    from tests.replay.test_step_program import _DAMAGES

    assert output.splitlines() == [f"{what} -> {error.__name__}" for what, _, error, _ in _DAMAGES]
