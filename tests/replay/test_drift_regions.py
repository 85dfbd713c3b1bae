"""Regions whose helpers read module globals (or that read module attributes): a change re-keys
the region (its graphs are dropped and recorded again), never serving a graph that baked the old
value. CPU, with the session's recording double; the graph double replays what its capture
returned, as a real graph would."""

from __future__ import annotations

import textwrap
import types

import pytest
import torch

from jitcore.backends import use_backend
from jitcore.backends.null import NullBackend
from replay.lifecycle import REPLAYING
from replay.session import Session

from .test_session import DoubleSession, FakeGraph

HELPERS = textwrap.dedent(
    """
    SCALE = 2.0
    TABLE = {"shift": 0.0}
    _CACHE = {}

    def scale(x):
        return x * SCALE + TABLE["shift"]

    def outer(x):
        return scale(x) + 1

    def memo(k):
        if k not in _CACHE:
            _CACHE[k] = float(k)
        return _CACHE[k]
    """
)


class BakedGraph(FakeGraph):
    """Replays return the capture's outputs: what the function computed when it was recorded,
    as a CUDA graph would (a stale value stays stale)."""

    def replay(self, *leaves):
        assert not self.released
        self.replays += 1
        self.session.counters.replays += 1
        return self.capture.outputs


class BakingSession(DoubleSession):
    build_graph = BakedGraph


@pytest.fixture
def session_factory():
    with use_backend(NullBackend()):

        def make(**policy):
            session = BakingSession(**policy)
            DoubleSession.current = session
            return session

        yield make


def region_over(session, source: str, **names):
    namespace = {"__name__": "regions", **names}
    exec(textwrap.dedent(source), namespace)
    return session.region(namespace["step"])


def warm(step, x, call=None):
    """Record and replay the key (three calls: record, analyse + replay, fast replay)."""
    for _ in range(3):
        (call or step)(x)
    assert [entry.state for entry in step.entries.values()] == [REPLAYING]


def test_object_attributes_are_watched_and_rekey(session_factory):
    session = session_factory(record_after=0)
    holder = types.SimpleNamespace(scale=2.0)
    step = session.region(lambda x: x * holder.scale)  # an object's attribute: watched (replay.watch)
    x = torch.ones(3)
    warm(step, x)
    holder.scale = 3.0
    assert torch.equal(step(x), x * 3)  # re-keyed, never the graph that baked 2.0
    assert session.stats().invalidations == 1


@pytest.mark.parametrize("path", ["fast", "keyword"])
def test_helper_global_change_rekeys_instead_of_serving_stale(session_factory, load, path):
    (helpers,) = load(helpers=HELPERS)
    session = session_factory(record_after=0)
    if path == "fast":  # flat calls: the generated fast path runs the inlined drift lines
        step = region_over(session, "def step(x):\n    return helpers.outer(x)\n", helpers=helpers)
        call = step
    else:  # keyword calls: the full path runs snapshot.check()
        step = region_over(session, "def step(x, bias=0.0):\n    return helpers.outer(x) + bias\n", helpers=helpers)
        call = lambda x: step(x, bias=0.0)
    x = torch.ones(3)
    warm(step, x, call)
    assert torch.equal(call(x), x * 2 + 1)
    baked = next(iter(step.entries.values())).graph
    helpers.SCALE = 3.0
    assert torch.equal(call(x), x * 3 + 1)  # re-keyed and recorded again, not the old graph
    stats = session.stats()
    assert (stats.invalidations, stats.records) == (1, 2)
    assert baked.released  # the stale graph was dropped
    helpers.TABLE["shift"] = 1.0  # a container read by the helper, mutated in place
    assert torch.equal(call(x), x * 3 + 2)
    assert session.stats().invalidations == 2
    warm(step, x, call)
    assert session.stats().invalidations == 2  # no change, no re-key


def test_module_attribute_change_rekeys(session_factory, load):
    (cfg,) = load(cfg="FACTOR = 2.0\n")
    session = session_factory(record_after=0)
    step = region_over(session, "def step(x):\n    return x * cfg.FACTOR\n", cfg=cfg)
    x = torch.ones(2)
    warm(step, x)
    cfg.FACTOR = 5.0
    assert torch.equal(step(x), x * 5)
    assert session.stats().invalidations == 1


def test_a_helpers_cache_filled_while_recording_does_not_rekey(session_factory, load):
    (helpers,) = load(helpers=HELPERS)
    session = session_factory(record_after=0)
    step = region_over(session, "def step(x, k):\n    return x * helpers.memo(k)\n", helpers=helpers)
    x = torch.ones(2)
    for k in (1, 2, 3):  # each key fills the cache while recording
        warm_calls = [step(x, k) for _ in range(3)]
        assert torch.equal(warm_calls[-1], x * k)
    assert session.stats().invalidations == 0 and session.stats().records == 3


def test_torch_functions_add_no_checks(session_factory, load):
    session = session_factory(record_after=0)
    step = region_over(
        session,
        "def step(x):\n    return torch.nn.functional.gelu(torch.add(x, 1))\n",
        torch=torch,
    )
    warm(step, torch.ones(2))
    assert [e.path for e in step.snapshot.entries] == ["torch"]
    assert session.stats().invalidations == 0


def test_without_a_gpu_regions_run_eagerly_and_see_the_change(load):
    """A real session on the CPU records nothing: every call is eager, so a helper's new global
    is simply used (no snapshot, no re-key)."""
    (helpers,) = load(helpers=HELPERS)
    if torch.cuda.is_available():
        pytest.skip("on a GPU the session records")
    with use_backend(NullBackend()):
        session = Session(record_after=0)
        step = region_over(session, "def step(x):\n    return helpers.scale(x)\n", helpers=helpers)
        x = torch.ones(2)
        assert torch.equal(step(x), x * 2)
        helpers.SCALE = 4.0
        assert torch.equal(step(x), x * 4)
        stats = session.stats()
        assert (stats.records, stats.invalidations, stats.eager_runs) == (0, 0, 2)
        assert step.snapshot is None
