"""The fuzzer's objects family on the CPU (tests/replay/fuzz_objects.py; its GPU run is in
test_fuzz_gpu.py): deterministic cases, a harness that finds nothing where nothing is wrong (an
eager stand-in, and the session's own logic with the recording double) and finds a replay that
reads a stale object."""

from __future__ import annotations

import copy

import pytest
import torch

from jitcore.backends import use_backend
from jitcore.backends.null import NullBackend

from . import fuzz_grammar as fz
from . import fuzz_objects as fo
from .test_session import DoubleSession


def test_object_cases_are_deterministic_per_seed_and_draw_every_block():
    cases = [fo.generate_objects_case(seed) for seed in range(200)]
    assert [c.source for c in cases[:20]] == [fo.generate_objects_case(seed).source for seed in range(20)]
    drawn = {name for case in cases for name in case.blocks}
    assert drawn == set(fo.BLOCKS) | set(fo.UNREPLAYABLE)
    calls = fo.plan_object_calls(cases[0], 200)
    assert calls == fo.plan_object_calls(cases[0], 200) and {c.mutation for c in calls} == set(fo.MUTATIONS)


def _eager_factory(**policy):
    return fz.EagerSession(**policy)


@pytest.mark.parametrize("seed", range(12))
def test_the_objects_harness_finds_nothing_when_replay_is_eager(seed):
    result = fo.run_objects_case(
        fo.generate_objects_case(seed), _eager_factory, calls=25, device="cpu", launchers=fz.REFERENCE_LAUNCHERS
    )
    assert result.mismatch is None and result.calls == 25


@pytest.mark.parametrize("seed", range(12))
def test_the_sessions_own_logic_with_the_recording_double_keeps_every_object_call_exact(seed):
    """Walks, keys, side-effect refusals, addresses and the watch of the real session, with
    captures and replays that run the region (so a run the session makes twice shows)."""
    with use_backend(NullBackend()):

        def factory(**policy):
            session = DoubleSession(record_after=1, **policy)
            DoubleSession.current = session
            return session

        result = fo.run_objects_case(
            fo.generate_objects_case(seed), factory, calls=40, device="cpu", launchers=fz.REFERENCE_LAUNCHERS
        )
    assert result.mismatch is None, result.mismatch.report()
    assert result.stats.replays > 0 or {"counter", "cpu draw"} & set(fo.generate_objects_case(seed).blocks)


class _StaleObjects(fz.EagerSession):
    """A broken replay: from its second call a region reads the object it was first called with
    (a copy), as a graph that baked the first call's object would."""

    def region(self, fn):
        held = []

        def call(h, state, pos):
            if not held:
                held.append(copy.deepcopy(state))
            return fn(h, held[0], pos.value)

        return call


def test_the_objects_harness_catches_a_replay_reading_a_stale_object():
    found = [
        fo.run_objects_case(
            fo.generate_objects_case(seed), _StaleObjects, calls=20, device="cpu", launchers=fz.REFERENCE_LAUNCHERS
        ).mismatch
        for seed in range(6)
    ]
    assert all(found), [m.report() if m else None for m in found]
    assert any("state." in m.what or "outputs" in m.what for m in found)


def test_a_mutation_changes_both_states_alike():
    case = fo.generate_objects_case(3)
    knobs = fo.make_knobs(case.cols, "cpu")
    first = fo.State(case.layers, case.rows, case.cols, 1, "cpu")
    states = (first, copy.deepcopy(first))
    for mutation in fo.MUTATIONS:
        states = fo.mutate(mutation, states, knobs, case, fo.ObjectCall(mutation, 0, 5))
        assert fo._difference((torch.ones(1), "decode"), (torch.ones(1), "decode"), states) == ""
