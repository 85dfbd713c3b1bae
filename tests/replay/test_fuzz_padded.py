"""The replay fuzzer's padded family (bucketing) on the CPU: the grammar, the planner, the
padded reference and the harness, without a GPU (the GPU runs are in test_fuzz_gpu.py).

What can go wrong in the fuzzer itself, and is checked here: a region whose rows are not
independent (the fuzzer would then blame replay for what padding does by design), a case that
never pads, never exceeds its buckets, never writes a padded argument or never fills with
anything but 0 (it would test less than it says), a reference that pads differently from what
the docs specify, and a harness that would miss a broken padding."""

from __future__ import annotations

import builtins
import collections
import dataclasses
import dis
import math
import re

import pytest
import torch

import replay

from . import fuzz_grammar as fz

SEEDS = range(60)


def _cases(steps_per_region: int = 30) -> list[fz.Case]:
    return [fz.generate_case(seed, steps_per_region=steps_per_region, family=fz.PADDED) for seed in SEEDS]


def _cpu_run(session_factory, cases: int = 12, seed_start: int = 0, family: str = fz.PADDED) -> fz.RunSummary:
    harness = fz.Harness(device="cpu", session_factory=session_factory, launchers=fz.REFERENCE_LAUNCHERS)
    return fz.run(harness, seed_start=seed_start, cases=cases, steps_per_region=30, family=family)


# --- the grammar and the planner ----------------------------------------------------------------


def test_padded_cases_are_deterministic_per_seed():
    for seed in range(20):
        a = fz.generate_case(seed, steps_per_region=30, family=fz.PADDED)
        b = fz.generate_case(seed, steps_per_region=30, family=fz.PADDED)
        assert a.describe() == b.describe() and "family padded" in a.describe()
        assert [c.describe(a) for c in fz.plan_calls(a)] == [c.describe(b) for c in fz.plan_calls(b)]
    assert fz.generate_case(1, family=fz.PADDED).describe() != fz.generate_case(2, family=fz.PADDED).describe()


def test_the_padded_family_is_only_run_when_asked_for():
    """Adding it changed nothing for the three other families' seeds: never drawn, never cycled."""
    assert fz.PADDED not in fz.FAMILIES and fz.PADDED in fz.ALL_FAMILIES
    assert {fz.generate_case(seed).family for seed in range(60)} == set(fz.FAMILIES)
    summary = fz.run(
        fz.Harness(device="cpu", session_factory=fz.EagerSession, launchers=fz.REFERENCE_LAUNCHERS),
        seed_start=0,
        cases=4,
        steps_per_region=2,
        cycle_families=True,
    )
    assert fz.PADDED not in summary.families and not summary.padding
    with pytest.raises(ValueError, match="family must be one of"):
        fz.generate_case(0, family="bucketed")


def test_padded_regions_are_row_independent_and_pass_padded_arguments_at_the_top_level():
    namespace = {"torch", "F", "Out2", "Out3", "OutDC", *fz.LAUNCHERS, *dir(builtins)}
    # building blocks that mix rows, draw random numbers or read the padded rows
    forbidden = ("shift_add(", ".t()", "rand", "bernoulli", "multinomial", "dropout", ".sum(0)", "copy_row(")
    for case in _cases():
        assert case.family == fz.PADDED and case.buckets == tuple(sorted(case.buckets))
        assert set(case.buckets) <= set(fz.BUCKET_SIZES) and case.policy["buckets"] == list(case.buckets)
        assert case.max_rows > case.buckets[-1]
        if "verify_every" in case.policy:  # compared within float32's default tolerance
            assert not any(r.has_matmul for r in case.regions)
        for region in case.regions:
            source = region.source
            assert not any(word in source for word in forbidden), source
            syncs = [line for line in source.splitlines() if re.search(r"(?<![.\w])float\(", line)]
            assert all("[0].abs().sum()" in line for line in syncs), source  # a host sync reads row 0 only
            code = compile(source, region.name, "exec")
            function = next(c for c in code.co_consts if hasattr(c, "co_names"))
            globals_read = {i.argval for i in dis.get_instructions(function) if i.opname == "LOAD_GLOBAL"}
            assert globals_read <= namespace, (globals_read - namespace, source)
            assert not region.uses_rng
            row_shaped = {i for i, s in enumerate(region.slots) if s.kind in ("rc", "bcache")}
            assert set(region.padded) == row_shaped
            for i, spec in region.padded.items():
                ndim = 3 if region.slots[i].kind == "bcache" else 2
                assert spec.dim % ndim == 0  # every padded argument pads its rows
                assert spec.written or not region.slots[i].written, (region.slots[i].name, source)
            grouped = {i for entry in region.params if entry[0] != "slot" for i in entry[1]}
            assert not grouped & row_shaped  # replay.padded is refused inside a container
            assert region.keyword_from is None or 0 <= region.keyword_from < len(region.params)
            for pattern in region.patterns:  # padded copies stop sharing memory: only read ones may
                for pair in pattern.overlapping_pairs():
                    assert not any(region.slots[s].written for s in pair), pattern


def test_padded_calls_vary_their_rows_fills_and_buckets():
    seen = collections.Counter()
    for case in _cases():
        top = case.buckets[-1]
        for call in fz.plan_calls(case):
            region = case.regions[call.region]
            rows, cols = call.shape
            assert 1 <= rows <= case.max_rows and (rows, cols) in {(rows, c) for _, c in case.shapes}
            assert call.bucket == fz.bucket_for(rows, case.buckets) >= rows
            assert call.padding == (
                "padded" if call.bucket > rows else "exact bucket" if rows in case.buckets else "beyond the buckets"
            )
            assert (call.padding == "beyond the buckets") == (rows > top)
            assert set(call.fills) == set(region.padded)
            for i, value in call.scalars.items():
                if region.slots[i].kind == "dyn_count":
                    assert 0 <= value <= rows * cols  # a prefix never reaches the added rows
            seen[call.padding] += 1
            for fill in call.fills.values():
                seen["fill NaN" if isinstance(fill, float) and math.isnan(fill) else f"fill {fill!r}"] += 1
            if call.feeds:
                seen["fed"] += 1
        for region in case.regions:
            seen["regions"] += 1
            seen["written"] += any(spec.written for spec in region.padded.values())
            seen["by keyword"] += region.keyword_from is not None
            seen["batch-major cache"] += any(s.kind == "bcache" for s in region.slots)
            seen["matmul"] += region.has_matmul
            seen["bfloat16 matmul"] += region.reduced_precision
            seen["dim spelled negative"] += any(spec.dim < 0 for spec in region.padded.values())
            seen["aliasing"] += len(region.patterns) > 1
    for what in ("padded", "exact bucket", "beyond the buckets", "fed", "written", "by keyword"):
        assert seen[what] > 0, (what, seen)
    for what in ("batch-major cache", "matmul", "bfloat16 matmul", "dim spelled negative", "aliasing"):
        assert seen[what] > 0, (what, seen)
    for fill in ("fill 0", "fill -7.5", "fill inf", "fill -inf", "fill NaN", "fill 3"):
        assert seen[fill] > 0, (fill, seen)
    # about one call in five beyond the largest bucket, most of the others padded
    calls = seen["padded"] + seen["exact bucket"] + seen["beyond the buckets"]
    assert 0.1 < seen["beyond the buckets"] / calls < 0.3 and seen["padded"] > calls / 3


# --- the padded reference ------------------------------------------------------------------------


def test_the_padded_reference_pads_copies_back_and_slices_as_documented():
    seen = []

    def fn(x, c, w, *, y, scratch):
        seen.append((x.clone(), c.clone(), y.clone()))
        c.add_(1.0)  # written: its rows come back
        scratch.mul_(0.0)  # read-only: the write lands in the padded copy
        return {"rows": (x * 2 + y, c[:, 0]), "other": [w.sum(), w, 7], "view": x}

    x = torch.arange(6.0).reshape(3, 2)
    c = torch.arange(12.0).reshape(3, 2, 2)
    y = torch.ones(3, 2)
    scratch = torch.full((3, 2), 5.0)
    w = torch.arange(5.0)  # not padded, and not the bucket's size: left alone
    c_before = c.clone()
    out = fz.padded_reference(
        fn,
        (replay.padded(x, fill=-7.5), replay.padded(c, dim=-3, written=True), w),
        {"y": replay.padded(y, fill=math.nan), "scratch": replay.padded(scratch)},
        [2, 4, 8],
    )
    (seen_x, seen_c, seen_y) = seen[0]
    assert seen_x.shape == (4, 2) and torch.equal(seen_x[:3], x) and torch.equal(seen_x[3], torch.full((2,), -7.5))
    assert seen_c.shape == (4, 2, 2) and torch.equal(seen_c[3], torch.zeros(2, 2))  # fill 0
    assert seen_y[3].isnan().all()
    rows, col0 = out["rows"]
    assert torch.equal(rows, torch.tensor([[1.0, 3.0], [5.0, 7.0], [9.0, 11.0]]))
    assert torch.equal(col0, c_before[:, 0] + 1)
    assert torch.equal(c, c_before + 1)  # copied back
    assert torch.equal(scratch, torch.full((3, 2), 5.0))  # not written: unchanged
    assert out["other"][1] is w and out["other"][2] == 7 and torch.equal(out["other"][0], torch.tensor(10.0))
    view = out["view"]  # an input returned: a view of the padded copy, not of the caller's x
    assert view.shape == (3, 2) and torch.equal(view, x)
    assert view.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_the_padded_reference_slices_every_tensor_of_the_bucket_size_through_containers():
    def fn(x):
        return fz.Out2(a=[x, {"k": x + 1}], b=fz.OutDC(a=torch.zeros(4), b=torch.zeros(5, 4)))

    out = fz.padded_reference(fn, (replay.padded(torch.ones(3, 4)),), {}, [4])
    assert type(out) is fz.Out2 and type(out.b) is fz.OutDC
    assert out.a[0].shape == (3, 4) and out.a[1]["k"].shape == (3, 4)
    assert out.b.a.shape == (3,)  # the bucket's size along dim 0: sliced, batch-shaped or not
    assert out.b.b.shape == (5, 4)


def test_at_a_bucket_and_beyond_the_last_the_reference_passes_the_tensors_themselves():
    calls = []

    def fn(x, y):
        calls.append((x, y))
        return x

    for rows in (4, 9):  # a bucket's exact size; beyond the largest bucket
        x, y = torch.randn(rows, 3), torch.randn(rows, 3)
        out = fz.padded_reference(fn, (replay.padded(x, fill=1.0), replay.padded(y, written=True)), {}, [2, 4, 8])
        assert calls[-1][0] is x and calls[-1][1] is y and out is x


def test_the_padded_reference_refuses_what_is_not_specified():
    x = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="one dim"):
        fz.padded_reference(lambda a, b: a, (replay.padded(x), replay.padded(x, dim=1)), {}, [4])
    with pytest.raises(ValueError, match="different sizes"):
        fz.padded_reference(lambda a, b: a, (replay.padded(x), replay.padded(torch.zeros(2, 2))), {}, [4])


def test_the_padded_reference_agrees_with_a_real_session_on_the_cpu(monkeypatch):
    """replay.capture() without a GPU runs every call eagerly through the same padding path as
    on the GPU (replay.buckets): the same results, bit for bit, as the fuzzer's reference."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # on a GPU machine too

    def fn(x, c):
        c[:, 1].copy_(torch.tanh(x))
        return x @ torch.ones(4, 4) * 0.5, c.sum(1), x[:, 1:]

    for rows, fill in ((3, -7.5), (4, 0), (5, math.inf), (11, math.nan)):
        x, c = torch.randn(rows, 4), torch.randn(rows, 3, 4)
        x2, c2 = x.clone(), c.clone()
        expected = fz.padded_reference(fn, (replay.padded(x, fill=fill), replay.padded(c, written=True)), {}, [4, 8])
        with pytest.warns(replay.ReplayWarning, match="no CUDA GPU"), replay.capture(buckets=[4, 8]) as session:
            got = session.region(fn)(replay.padded(x2, fill=fill), replay.padded(c2, written=True))
        assert torch.equal(c, c2)
        for e, g in zip(expected, got):
            assert e.shape == g.shape and e.stride() == g.stride() and torch.equal(e, g)


def test_the_unpadded_tolerance_is_exact_without_a_matmul():
    region = fz.generate_case(0, family=fz.PADDED).regions[0]
    plain = dataclasses.replace(region, has_matmul=False, reduced_precision=False)
    assert fz.unpadded_tolerance(plain, "autocast") == {}
    matmul = dataclasses.replace(region, has_matmul=True, reduced_precision=False)
    assert fz.unpadded_tolerance(matmul, "plain")["rtol"] < fz.unpadded_tolerance(matmul, "tf32")["rtol"]


# --- the harness ---------------------------------------------------------------------------------


def test_the_harness_finds_nothing_when_the_padded_replay_is_eager():
    """The eager stand-in pads like the reference, so this checks the harness and, through the
    comparison with the unpadded run, that every generated region is row-independent."""
    summary = _cpu_run(fz.EagerSession)
    assert not summary.mismatches, summary.mismatches[0].report()
    assert set(summary.families) == {fz.PADDED} and summary.held_checks > 0 and summary.feeds > 0
    for what in ("padded", "exact bucket", "beyond the buckets", "written copied back", "fill not 0"):
        assert summary.padding[what] > 0, (what, summary.padding)


def test_the_unpadded_comparison_catches_a_region_whose_rows_are_not_independent():
    """Padded reference and 'replay' agree bit for bit on a region that mixes rows (both pad
    it); only the comparison with the unpadded run sees that padding changed its result."""
    harness = fz.Harness(device="cpu", session_factory=fz.EagerSession, launchers=fz.REFERENCE_LAUNCHERS)
    caught = 0
    for seed in range(4):
        case = fz.generate_case(seed, steps_per_region=30, family=fz.PADDED)
        for region in case.regions:
            region.body.insert(0, "x0 = x0.roll(1, 0)")  # row 0 now reads the last row: a fill once padded
        result = harness.run_case(case)
        assert result.mismatch is not None, result.line()
        assert "UNPADDED" in result.mismatch.what and "padded" in result.mismatch.call_text
        caught += 1
    assert caught == 4


def test_a_real_session_pads_like_the_reference_on_the_cpu(monkeypatch):
    """The real session, eager for want of a GPU, but through replay.buckets' padding, copying
    back, slicing and verification: the fuzzer's CPU check of replay's own padding path."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # on a GPU machine too
    summary = _cpu_run(replay.capture, cases=16)
    assert not summary.mismatches, summary.mismatches[0].report()
    assert all(reason.startswith("no CUDA GPU") for reason in summary.fallbacks), summary.fallbacks
    assert summary.padding["padded"] > 0 and summary.padding["written copied back"] > 0


def test_a_real_session_verifies_padded_calls_with_dynamic_scalars():
    case = fz.generate_case(9, steps_per_region=30, family=fz.PADDED)
    assert case.policy.get("verify_every") and any(s.is_dynamic for r in case.regions for s in r.slots)
    harness = fz.Harness(device="cpu", session_factory=replay.capture, launchers=fz.REFERENCE_LAUNCHERS)
    result = harness.run_case(case)
    assert result.mismatch is None, result.mismatch.what


class _BrokenPadding(fz.EagerSession):
    """An eager 'replay' of padded calls with one deliberate fault."""

    fault = ""

    def region(self, fn):
        buckets, fault, kept = tuple(self.policy["buckets"]), self.fault, {}

        def call(*args, **kwargs):
            args, kwargs = [fz._plain(a) for a in args], {k: fz._plain(v) for k, v in kwargs.items()}
            marks = [a for a in (*args, *kwargs.values()) if isinstance(a, replay.Padded)]
            rows = marks[0].tensor.shape[marks[0].dim]
            bucket = fz.bucket_for(rows, buckets)
            if bucket != rows:
                fz._refuse_padded_sharing(args, kwargs)  # the documented refusal: no fault there
            grown = []

            def pad(position, value):
                if not isinstance(value, replay.Padded):
                    return value
                if bucket == rows:
                    return value.tensor
                shape = list(value.tensor.shape)
                shape[value.dim] = bucket
                fresh = (position, tuple(shape)) not in kept
                full = torch.full(shape, value.fill, dtype=value.tensor.dtype)
                tensor = kept.setdefault((position, tuple(shape)), full)
                if fresh or fault != "a stale padded copy":
                    tensor.narrow(value.dim, 0, rows).copy_(value.tensor)
                if fault == "a fill leaks into the last row":
                    tensor.narrow(value.dim, rows - 1, 1).fill_(value.fill)
                if fault != "a stale padded copy":
                    del kept[(position, tuple(shape))]
                grown.append((value, tensor))
                return tensor

            result = fn(*[pad(i, a) for i, a in enumerate(args)], **{k: pad(k, v) for k, v in kwargs.items()})
            if bucket == rows:
                return result
            for mark, tensor in grown:
                if mark.written and fault != "written rows not copied back":
                    mark.tensor.copy_(tensor.narrow(mark.dim, 0, rows))
            return result if fault == "outputs not sliced back" else fz._slice_rows(result, 0, bucket, rows)

        return call


@pytest.mark.parametrize(
    ("fault", "caught_by"),
    [
        ("", None),  # the double itself pads right: what the faults below are caught by is theirs
        ("written rows not copied back", "after the call"),
        ("outputs not sliced back", "cpu, replay torch.float32"),
        ("a fill leaks into the last row", "elements differ"),
        ("a stale padded copy", "elements differ"),
    ],
)
@pytest.mark.parametrize("family", fz.BUCKETED_FAMILIES)
def test_the_harness_catches_a_broken_padding(fault, caught_by, family):
    summary = _cpu_run(type("Broken", (_BrokenPadding,), {"fault": fault}), cases=8, family=family)
    if caught_by is None:
        assert not summary.mismatches, summary.mismatches[0].report()
        return
    assert summary.mismatches, summary.line()
    report = summary.mismatches[0].report()
    assert caught_by in report.splitlines()[1], report
    assert f"family {family}" in report and f"--family {family}" in report and " -> " in report


# --- the polymorphic family --------------------------------------------------------------------


def test_polymorphic_cases_are_padded_cases_with_polymorphic_replay_and_mostly_jit_only_regions():
    cases = [fz.generate_case(seed, steps_per_region=30, family=fz.POLYMORPHIC) for seed in SEEDS]
    regions = [region for case in cases for region in case.regions]
    jit_only = [r for r in regions if all(step.startswith("jit") for step in r.steps)]
    assert len(jit_only) >= 0.5 * len(regions) and len(jit_only) < len(regions)
    for case in cases:
        assert case.family == fz.POLYMORPHIC and case.policy["polymorphic"] is True
        assert case.policy["buckets"] == list(case.buckets) and case.max_rows > case.buckets[-1]
        again = fz.generate_case(case.seed, steps_per_region=30, family=fz.POLYMORPHIC)
        assert again.describe() == case.describe()
    assert sum(case.policy.get("record_budget") == 1.0 for case in cases) >= len(cases) // 2
    assert fz.POLYMORPHIC not in fz.FAMILIES and {fz.generate_case(seed).family for seed in SEEDS} == set(fz.FAMILIES)


class _OwnSize(fz.EagerSession):
    """A polymorphic 'replay' done right: every other call smaller than its bucket runs at its
    own size (what a variant returns), the others padded like the reference. ``corrupt``:
    one element of each such call's outputs is off (a variant gone wrong)."""

    corrupt = False

    def region(self, fn):
        padded = super().region(fn)
        calls = [0]

        def call(*args, **kwargs):
            calls[0] += 1
            if calls[0] % 2:
                return padded(*args, **kwargs)
            unwrap = lambda a: a.tensor if isinstance(a, replay.Padded) else fz._plain(a)
            result = fn(*map(unwrap, args), **{k: unwrap(v) for k, v in kwargs.items()})
            leaves: list = []
            fz._flatten(result, leaves)
            tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
            if self.corrupt and tensors:
                tensors[0].view(-1)[0] += 1.0
            return result

        return call


def test_the_harness_takes_a_call_served_at_its_own_size_as_right_and_catches_a_wrong_one():
    summary = _cpu_run(_OwnSize, cases=10, family=fz.POLYMORPHIC)
    assert not summary.mismatches, summary.mismatches[0].report()
    assert summary.padding["padded"] > 0 and summary.held_checks > 0
    wrong = _cpu_run(type("Wrong", (_OwnSize,), {"corrupt": True}), cases=10, family=fz.POLYMORPHIC)
    assert wrong.mismatches, wrong.line()
