"""The replay differential fuzzer (see tests/replay/fuzz_grammar.py).

GPU (marked ``gpu``, skipped without one):

- ``test_fuzz_regions``: at least 24 random regions x 200 calls, every call compared with eager
  bit for bit; ``REPLAY_FUZZ_SEED`` picks the first case seed (printed on failure),
  ``REPLAY_FUZZ_REGIONS`` and ``REPLAY_FUZZ_STEPS`` (calls per region) the size,
  ``REPLAY_FUZZ_FEEDBACK=0`` stops passing an output back into its own graph (``h = step(h)``);
- ``test_fuzz_harness_finds_nothing_comparing_eager_with_eager``: the same harness with an eager
  stand-in for the session, on the GPU: the kernels and torch ops of the grammar are
  deterministic, so a failure of ``test_fuzz_regions`` is replay's;
- ``test_fuzz_padded_regions``: the padded family (bucketing: ``capture(buckets=...)``,
  ``replay.padded`` arguments, calls of varying rows, some beyond the largest bucket, written
  arguments, fills other than 0), at least ``REPLAY_FUZZ_PADDED_REGIONS`` (default 12) regions x
  ``REPLAY_FUZZ_STEPS`` calls, each compared bit for bit with the eager run of the same padded
  call and within a tolerance with the unpadded one;
- ``test_fuzz_padded_harness_finds_nothing_comparing_eager_with_eager``: the padded family's
  harness with the eager stand-in: on the GPU's kernels (cuBLAS picks another kernel for another
  height) the grammar's regions stay row-independent within the unpadded check's tolerance, so
  a failure of ``test_fuzz_padded_regions`` is replay's.
- ``test_fuzz_object_regions``: the objects family (tests/replay/fuzz_objects.py: an object
  argument holding tensors and plain values, a module read through the region's globals, both
  changed between calls), ``REPLAY_FUZZ_OBJECT_CASES`` (default 16) cases; its eager-with-eager
  twin ``test_fuzz_object_harness_finds_nothing_comparing_eager_with_eager``. Its CPU tests are
  in tests/replay/test_fuzz_objects.py.

CPU: the grammar is deterministic per seed and describes every region; the harness finds nothing
when "replay" is eager and catches deliberately broken replays (a baked dynamic scalar, repeated
random numbers, output buffers shared across calls, aliasing dropped).

The long run: ``python -m tests.replay.fuzz_long --steps 100000 --seed-start N --out FILE.json``
(add ``--family padded`` for bucketing). The padded family's CPU tests are in
tests/replay/test_fuzz_padded.py.
"""

from __future__ import annotations

import builtins
import collections
import dis
import os
import random

import pytest
import torch

import replay

from . import fuzz_grammar as fz
from . import fuzz_objects as fo

DEFAULT_SEED = 20250601


def _summary_text(summary: fz.RunSummary, seed: int) -> str:
    first = summary.mismatches[0].report() if summary.mismatches else ""
    return (
        f"{summary.line()}\nfirst case seed REPLAY_FUZZ_SEED={seed}\n{first}\n"
        f"fallbacks by reason: {dict(summary.fallbacks)}"
    )


def _run_from_environment(label: str, regions_variable: str, default_regions: int, **run_options):
    """The GPU fuzz run the environment sizes (seed, regions, calls per region, feedback), its
    summary printed with the fallbacks by reason; asserts no mismatch and the size reached.
    Returns (summary, seed)."""
    seed = int(os.environ.get("REPLAY_FUZZ_SEED", DEFAULT_SEED))
    regions = int(os.environ.get(regions_variable, default_regions))
    steps = int(os.environ.get("REPLAY_FUZZ_STEPS", 200))
    feedback = os.environ.get("REPLAY_FUZZ_FEEDBACK", "1").strip() not in ("", "0")
    print(f"{label}: REPLAY_FUZZ_SEED={seed}, {regions} regions x {steps} calls, feedback {feedback}")
    harness = fz.Harness(feedback=feedback, log=print)
    summary = fz.run(
        harness, seed_start=seed, min_regions=regions, steps_per_region=steps, stop_on_mismatch=True, **run_options
    )
    print(summary.line())
    if summary.fallbacks:
        print("fallbacks (ReplayWarning, eager) by reason:")
        for reason, count in summary.fallbacks.most_common():
            print(f"  {count:5d}  {reason}")
    assert not summary.mismatches, _summary_text(summary, seed)
    assert summary.regions >= regions and summary.steps >= regions * steps
    return summary, seed


def _assert_mostly_replayed(summary: fz.RunSummary, seed: int) -> None:
    """A fuzzer that silently ran everything eagerly would test nothing."""
    calls, replays = summary.stats.get("calls", 0), summary.stats.get("replays", 0)
    assert replays >= 0.2 * calls, f"only {replays} of {calls} calls were replayed\n{_summary_text(summary, seed)}"


@pytest.mark.gpu
def test_fuzz_regions():
    # cycle_families: every family, whatever the seed
    summary, seed = _run_from_environment("replay fuzz", "REPLAY_FUZZ_REGIONS", 24, cycle_families=True)
    _assert_mostly_replayed(summary, seed)


@pytest.mark.gpu
def test_fuzz_harness_finds_nothing_comparing_eager_with_eager():
    harness = fz.Harness(session_factory=fz.EagerSession)
    seed = int(os.environ.get("REPLAY_FUZZ_SEED", DEFAULT_SEED))
    summary = fz.run(harness, seed_start=seed, cases=6, steps_per_region=40, cycle_families=True)
    assert not summary.mismatches, _summary_text(summary, seed)


@pytest.mark.gpu
def test_fuzz_padded_regions():
    summary, seed = _run_from_environment("replay fuzz, padded", "REPLAY_FUZZ_PADDED_REGIONS", 12, family=fz.PADDED)
    # every way a padded call can go happened: padded, exactly a bucket, beyond the largest
    # bucket (unpadded), a written argument copied back, a fill other than 0
    for what in ("padded", "exact bucket", "beyond the buckets", "written copied back", "fill not 0"):
        assert summary.padding[what] > 0, (what, dict(summary.padding))
    # and arguments padded straight into a graph's staged buffer (a torch op reads them)
    assert summary.stats["padded_in_place"] > 0, _summary_text(summary, seed)
    _assert_mostly_replayed(summary, seed)


@pytest.mark.gpu
def test_fuzz_polymorphic_regions():
    summary, seed = _run_from_environment(
        "replay fuzz, polymorphic", "REPLAY_FUZZ_POLYMORPHIC_REGIONS", 12, family=fz.POLYMORPHIC
    )
    # sizes served at their own size by their bucket's graph, and graphs that could not serve
    # them (a torch op: padded, said why), both happened
    assert summary.stats["variants"] > 0 and summary.stats["not_polymorphic"] > 0, _summary_text(summary, seed)
    assert summary.padding["padded"] > 0, dict(summary.padding)
    _assert_mostly_replayed(summary, seed)


@pytest.mark.gpu
def test_fuzz_padded_harness_finds_nothing_comparing_eager_with_eager():
    harness = fz.Harness(session_factory=fz.EagerSession)
    seed = int(os.environ.get("REPLAY_FUZZ_SEED", DEFAULT_SEED))
    summary = fz.run(harness, seed_start=seed, cases=12, steps_per_region=40, family=fz.PADDED)
    assert not summary.mismatches, _summary_text(summary, seed)
    assert summary.padding["padded"] > 0


@pytest.mark.gpu
def test_fuzz_object_regions():
    """The objects family (tests/replay/fuzz_objects.py): ``REPLAY_FUZZ_OBJECT_CASES`` cases
    (default 16) x ``REPLAY_FUZZ_STEPS`` calls from ``REPLAY_FUZZ_SEED``, regions passed a
    cache-like object and reading a module, both changed between calls."""
    seed = int(os.environ.get("REPLAY_FUZZ_SEED", DEFAULT_SEED))
    cases = int(os.environ.get("REPLAY_FUZZ_OBJECT_CASES", 16))
    steps = int(os.environ.get("REPLAY_FUZZ_STEPS", 200))
    calls = replays = 0
    fallbacks = collections.Counter()
    for case_seed in range(seed, seed + cases):
        result = fo.run_objects_case(fo.generate_objects_case(case_seed), replay.capture, calls=steps)
        assert result.mismatch is None, f"REPLAY_FUZZ_SEED={case_seed}\n{result.mismatch.report()}"
        calls, replays = calls + result.calls, replays + result.stats.replays
        fallbacks.update(result.fallbacks)
    print(f"objects: {cases} cases, {calls} calls, {replays} replayed; fallbacks {dict(fallbacks)}")
    assert replays >= 0.2 * calls, f"only {replays} of {calls} calls were replayed"


@pytest.mark.gpu
def test_fuzz_object_harness_finds_nothing_comparing_eager_with_eager():
    seed = int(os.environ.get("REPLAY_FUZZ_SEED", DEFAULT_SEED))
    for case_seed in range(seed, seed + 6):
        result = fo.run_objects_case(fo.generate_objects_case(case_seed), fz.EagerSession, calls=40)
        assert result.mismatch is None, result.mismatch.report()


# --- CPU: the grammar and the harness itself ---------------------------------------------------


def _regions(seed: int, count: int = 100) -> list[fz.Region]:
    rng = random.Random(seed)
    families = fz.FAMILIES
    return [fz.generate_region(rng, i, f"r{i}", families[i % len(families)]) for i in range(count)]


def test_generating_100_regions_is_deterministic_per_seed_and_each_is_described():
    first, again, other = _regions(7), _regions(7), _regions(8)
    assert [r.describe() for r in first] == [r.describe() for r in again]
    assert [r.source for r in first] != [r.source for r in other]
    namespace = {"torch", "F", "Out2", "Out3", "OutDC", *fz.LAUNCHERS, *dir(builtins)}
    for region in first:
        text = region.describe()
        assert text.strip() and region.steps and region.name in text
        code = compile(region.source, region.name, "exec")
        function = next(c for c in code.co_consts if hasattr(c, "co_names"))
        globals_read = {i.argval for i in dis.get_instructions(function) if i.opname == "LOAD_GLOBAL"}
        assert globals_read <= namespace, (globals_read - namespace, region.source)
    kinds = {step.split(" ")[0] for region in first for step in region.steps}
    assert {"jit", "torch"} <= kinds
    everything = " ".join(step for region in first for step in region.steps)
    for hazard in ("cache[pos]", "cdiv(n, 64)", "matmul", "in-place", "random", "row reduction"):
        assert hazard in everything, hazard
    patterns = {g.kind for region in first for p in region.patterns for g in p.groups}
    assert patterns == set(fz.GROUP_KINDS)


def test_cases_and_their_calls_are_deterministic_per_seed():
    for seed in range(20):
        a = fz.generate_case(seed, steps_per_region=30)
        b = fz.generate_case(seed, steps_per_region=30)
        assert a.describe() == b.describe() and a.describe().strip()
        calls_a, calls_b = fz.plan_calls(a), fz.plan_calls(b)
        assert [c.describe(a) for c in calls_a] == [c.describe(b) for c in calls_b]
        assert len(calls_a) == 30 * len(a.regions)
    families = {fz.generate_case(seed).family for seed in range(40)}
    assert families == set(fz.FAMILIES)
    assert fz.generate_case(3, family="rng-sequence").family == "rng-sequence"


def _cpu_run(session_factory, **kwargs) -> fz.RunSummary:
    harness = fz.Harness(device="cpu", session_factory=session_factory, launchers=fz.REFERENCE_LAUNCHERS)
    return fz.run(harness, steps_per_region=30, **kwargs)


def test_the_harness_finds_nothing_when_replay_is_eager():
    summary = _cpu_run(fz.EagerSession, seed_start=0, cases=9, cycle_families=True)
    assert not summary.mismatches, summary.mismatches[0].report()
    assert summary.feeds > 0 and summary.held_checks > 0
    assert set(summary.families) == set(fz.FAMILIES)


class _Broken(fz.EagerSession):
    """An eager 'replay' with one deliberate fault."""

    fault = ""

    def region(self, fn):
        first_values: dict[int, object] = {}
        rng_state: list = []
        shared: dict = {}
        fault = self.fault

        def call(*args):
            args = list(args)
            if fault == "baked dynamic scalar":
                for i, a in enumerate(args):
                    if isinstance(a, replay.Dynamic):
                        args[i] = replay.dynamic(first_values.setdefault(i, a.value))
            if fault == "repeated random numbers":
                if rng_state:
                    torch.set_rng_state(rng_state[0])
                else:
                    rng_state.append(torch.get_rng_state())
            plain = [fz._plain(a) for a in args]
            if fault == "aliasing dropped":
                copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in plain]
                result = fn(*copies)
                for a, c in zip(plain, copies):
                    if isinstance(a, torch.Tensor):
                        a.copy_(c)
                return result
            result = fn(*plain)
            if fault == "outputs shared across calls":
                leaves: list = []
                fz._flatten(result, leaves)
                key = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else type(x) for x in leaves)
                if key in shared:
                    old, old_leaves = shared[key]
                    for o, n in zip(old_leaves, leaves):
                        if isinstance(o, torch.Tensor) and o.data_ptr() != n.data_ptr():
                            o.copy_(n)
                    return old
                shared[key] = (result, leaves)
            return result

        return call


@pytest.mark.parametrize(
    "fault",
    ["baked dynamic scalar", "repeated random numbers", "outputs shared across calls", "aliasing dropped"],
)
def test_the_harness_catches_a_broken_replay(fault):
    session = type("Broken", (_Broken,), {"fault": fault})
    family = "rng-sequence" if fault == "repeated random numbers" else None
    summary = _cpu_run(session, seed_start=100, cases=8, family=family)
    assert summary.mismatches, summary.line()
    report = summary.mismatches[0].report()
    assert "case seed" in report and "reproduce: python -m tests.replay.fuzz_long" in report
    assert "def fz" in report  # the region's source
