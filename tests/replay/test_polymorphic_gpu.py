"""Polymorphic replay on the GPU (replay.polymorphic): a bucket's graph serves smaller sizes at
their own size, bit for bit equal to eager, or says why it cannot and pads. The matching
itself is tested on the CPU in test_polymorphic.py."""

from __future__ import annotations

import random

import pytest
import torch

import jitcore as jc
import replay

pytestmark = pytest.mark.gpu

SOURCE = r"""
__global__ void affine(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                       float* __restrict__ y, long long rows, long long k, long long cols) {
    long long i = blockIdx.y, j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= rows || j >= cols) return;
    float acc = b[j];
    for (long long t = 0; t < k; ++t) acc += x[i * k + t] * w[t * cols + j];
    y[i * cols + j] = acc;
}
__global__ void act(const float* __restrict__ x, float* __restrict__ y, float slope, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) { float v = x[i]; y[i] = v > 0.0f ? v : v * slope; }
}
__global__ void center(const float* __restrict__ x, float* __restrict__ y, long long rows, long long cols) {
    long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (j >= cols) return;
    float s = 0.0f;
    for (long long i = 0; i < rows; ++i) s += x[i * cols + j];
    float mean = s / (float)rows;
    for (long long i = 0; i < rows; ++i) y[i * cols + j] = x[i * cols + j] - mean;
}
__global__ void transpose(const float* __restrict__ x, float* __restrict__ y, long long rows, long long cols) {
    long long i = blockIdx.y, j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < rows && j < cols) y[j * rows + i] = x[i * cols + j];
}
__global__ void shift(float* __restrict__ x, float by, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] += by;
}
"""
affine_kernel = jc.Kernel(SOURCE, "affine")
act_kernel = jc.Kernel(SOURCE, "act")
center_kernel = jc.Kernel(SOURCE, "center")
transpose_kernel = jc.Kernel(SOURCE, "transpose")
shift_kernel = jc.Kernel(SOURCE, "shift")
DIM, LAYERS = 32, 6
BUCKETS = [4, 8, 16, 32, 64]


@jc.jit
def affine(x, w, b, y):
    rows, k = x.shape
    cols = w.shape[1]
    affine_kernel[(jc.cdiv(cols, 32), rows), 32](x, w, b, y, rows, k, cols)


@jc.jit
def act(x, y, slope):
    n = x.numel()
    act_kernel[jc.cdiv(n, 128), 128](x, y, slope, n)


@jc.jit
def center(x, y):
    rows, cols = x.shape
    center_kernel[jc.cdiv(cols, 32), 32](x, y, rows, cols)


@jc.jit
def transpose(x, y):
    rows, cols = x.shape
    transpose_kernel[(jc.cdiv(cols, 32), rows), 32](x, y, rows, cols)


@jc.jit
def shift(x, by):
    n = x.numel()
    shift_kernel[jc.cdiv(n, 128), 128](x, by, n)


def make_weights(seed: int = 0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    weights = [torch.randn(DIM, DIM, device="cuda", generator=generator) / DIM**0.5 for _ in range(LAYERS)]
    biases = [torch.randn(DIM, device="cuda", generator=generator) for _ in range(LAYERS)]
    return weights, biases


def make_stack(mix_rows: bool = True, flip: bool = True):
    """Six layers of jit kernels only; the last one mixes rows (a mean over the batch), which
    padding would get wrong and polymorphic replay gets exact."""
    weights, biases = make_weights()

    def stack(x, slope):
        h = x
        for w, b in zip(weights, biases):
            t = torch.empty(h.shape[0], DIM, device="cuda")
            affine(h, w, b, t)
            u = torch.empty_like(t)
            act(t, u, slope)
            h = u
        out = torch.empty_like(h)
        if mix_rows:
            center(h, out)
        else:
            act(h, out, 1.0)
        if not flip:  # every output batch-first: padding slices them all right
            return out, h[:, :4]
        flipped = torch.empty(DIM, h.shape[0], device="cuda")  # batch along dim 1
        transpose(out, flipped)
        return out, flipped, h[:, :4]

    return stack


def eager_copy(result):
    """Copies of the eager outputs, each with the strides it had (a view's included)."""
    return tuple(torch.empty_strided(t.shape, t.stride(), device=t.device).copy_(t) for t in result)


def assert_same(got, want, context=""):
    assert len(got) == len(want)
    for number, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.stride() == b.stride(), (context, number, a.shape, b.shape)
        assert torch.equal(a, b), (context, number)


def warm(step, buckets, *, dynamic_slope=False):
    """Two padded calls per bucket, not compared: they record the bucket's graph (the first
    calls of a bucket are padded, which a region mixing rows gets wrong: documented)."""
    for bucket in buckets:
        for _ in range(2):
            x = torch.randn(max(bucket - 1, 1), DIM, device="cuda")
            step(replay.padded(x), replay.dynamic(0.1) if dynamic_slope else 0.1)


def drive(step, fn, sizes, steps, rng, *, dynamic_slope=False, held=4):
    """Call ``step`` on fresh random inputs of random sizes; compare each call with eager bit
    for bit, and keep the last few results held and compare them again later (a later
    replay of another size must not have overwritten them)."""
    warm(step, sorted({min(b for b in BUCKETS if b >= rows) for rows in sizes}), dynamic_slope=dynamic_slope)
    for rows in sizes:  # each size padded once, then observed: compared, not held (a padded
        for _ in range(2):  # call's outputs are the bucket graph's, which its next call overwrites)
            x = torch.randn(rows, DIM, device="cuda")
            want = eager_copy(fn(x, 0.1))
            assert_same(step(replay.padded(x), replay.dynamic(0.1) if dynamic_slope else 0.1), want, f"rows {rows}")
    kept = []
    for call in range(steps):
        rows = rng.choice(sizes)
        x = torch.randn(rows, DIM, device="cuda")
        slope = rng.choice([0.01, 0.1, 0.2]) if dynamic_slope else 0.1  # a plain float is a key of its own
        want = eager_copy(fn(x, slope))
        got = step(replay.padded(x), replay.dynamic(slope) if dynamic_slope else slope)
        assert_same(got, want, f"call {call}, rows {rows}")
        # the documented rule: the next call of the same size overwrites that size's outputs
        kept = [k for k in kept if k[2] != rows][-held:] + [(got, want, rows)]
        for old_got, old_want, _rows in kept:
            assert_same(old_got, old_want, f"held output at call {call}")


def test_one_graph_per_bucket_serves_every_size_bit_for_bit():
    fn = make_stack(mix_rows=False, flip=False)
    fn(torch.randn(3, DIM, device="cuda"), 0.1)  # compile before any capture
    rng = random.Random(1)
    sizes = list(range(1, 65))
    with replay.capture(buckets=BUCKETS, polymorphic=True, record_after=0, record_budget=1.0) as session:
        step = session.region(fn)
        drive(step, fn, sizes, 600, rng)
        stats = session.stats()
        report = session.report()
    assert stats.variants >= 40, report
    # one graph per bucket and per slope (a plain float is keyed by value): no size of its own
    assert stats.records - stats.record_retries <= 3 * len(BUCKETS), report
    assert stats.not_polymorphic == 0, report
    assert stats.replays >= 350, report
    assert "sizes served at their own size" in report


def test_a_size_served_at_its_own_size_is_exact_where_padding_is_not():
    """Rows mixed (a mean over the batch) and an output batched along dim 1: padding gets
    both wrong; a size's first call is padded (documented), its second observed (eager), and
    from then on its variant replays bit for bit."""
    fn = make_stack(mix_rows=True, flip=True)
    fn(torch.randn(3, DIM, device="cuda"), 0.1)
    sizes = [3, 5, 6, 7, 11, 13, 20, 30, 31, 45, 63]
    with replay.capture(buckets=BUCKETS, polymorphic=True, record_after=0, record_budget=1.0) as session:
        step = session.region(fn)
        warm(step, BUCKETS)
        for rows in sizes:  # padded once, then observed
            for _ in range(2):
                step(replay.padded(torch.randn(rows, DIM, device="cuda")), 0.1)
        assert session.stats().variants == len(sizes), session.report()
        rng = random.Random(8)
        kept = []
        for call in range(200):
            rows = rng.choice(sizes)
            x = torch.randn(rows, DIM, device="cuda")
            want = eager_copy(fn(x, 0.1))
            got = step(replay.padded(x), 0.1)
            assert_same(got, want, f"call {call}, rows {rows}")
            kept = [k for k in kept if k[2] != rows][-4:] + [(got, want, rows)]
            for old_got, old_want, _rows in kept:
                assert_same(old_got, old_want, f"held output at call {call}")
        stats = session.stats()
    assert stats.eager_runs <= len(sizes) + 2 * len(BUCKETS), session.report()


def test_dynamic_scalars_are_rebound_in_every_variant():
    fn = make_stack(mix_rows=False, flip=False)
    fn(torch.randn(3, DIM, device="cuda"), 0.1)
    rng = random.Random(2)
    with replay.capture(buckets=BUCKETS, polymorphic=True, record_after=0, record_budget=1.0) as session:
        step = session.region(fn)
        drive(step, fn, [3, 5, 6, 7, 8, 13, 30], 300, rng, dynamic_slope=True)
        stats = session.stats()
    assert stats.variants >= 5, session.report()
    assert stats.replays >= 200


def test_a_graph_holding_a_torch_matmul_pads_and_says_why():
    weights, _ = make_weights()

    def mixed(x, slope):
        h = x @ weights[0]  # cuBLAS picks its kernels per size: not polymorphic
        out = torch.empty_like(h)
        act(h, out, slope)
        return (out,)

    mixed(torch.randn(3, DIM, device="cuda"), 0.1)
    rng = random.Random(3)
    with replay.capture(buckets=BUCKETS, polymorphic=True, record_after=0, record_budget=1.0) as session:
        step = session.region(mixed)
        for _ in range(80):
            rows = rng.choice([3, 5, 6, 7])
            x = torch.randn(rows, DIM, device="cuda")
            want = mixed(x, 0.1)[0].clone()
            got = step(replay.padded(x), 0.1)[0]
            torch.testing.assert_close(got, want)  # padded: the matmul may round otherwise
        stats = session.stats()
        report = session.report()
    assert stats.variants == 0 and stats.not_polymorphic >= 3, report
    assert "kernel no jit launch made" in report


def test_a_region_that_branches_on_the_size_is_served_only_where_its_launches_match():
    weights, biases = make_weights()

    def branching(x, slope):
        h = torch.empty_like(x)
        if x.shape[0] > 5:
            affine(x, weights[0], biases[0], h)
        else:
            act(x, h, slope)  # another kernel below 6 rows
        out = torch.empty_like(h)
        act(h, out, slope)
        return (out,)

    branching(torch.randn(8, DIM, device="cuda"), 0.1)
    branching(torch.randn(3, DIM, device="cuda"), 0.1)
    with replay.capture(buckets=[8], polymorphic=True, record_after=0, record_budget=1.0) as session:
        step = session.region(branching)
        rng = random.Random(4)
        for _ in range(120):
            rows = rng.choice([3, 4, 6, 7, 8])
            x = torch.randn(rows, DIM, device="cuda")
            want = branching(x, 0.1)[0].clone()
            got = step(replay.padded(x), 0.1)[0]
            if rows > 5:
                assert torch.equal(got, want)
            else:  # observed once (eager, exact), then padded to 8 rows: the bucket's path runs
                want_padded = branching(torch.cat([x, torch.zeros(8 - rows, DIM, device="cuda")]), 0.1)[0][:rows]
                assert torch.equal(got, want) or torch.equal(got, want_padded)
        stats = session.stats()
        report = session.report()
    assert stats.variants == 2 and stats.not_polymorphic == 2, report
    assert "runs another kernel" in report


def test_a_region_writing_its_argument_writes_the_callers_tensor():
    def in_place(x, by):
        shift(x, by)
        out = torch.empty_like(x)
        act(x, out, 0.5)
        return (out,)

    in_place(torch.randn(3, DIM, device="cuda"), 1.0)
    with replay.capture(buckets=[16], polymorphic=True, record_after=0, record_budget=1.0) as session:
        step = session.region(in_place)
        rng = random.Random(5)
        for _ in range(60):
            rows = rng.choice([2, 9, 11, 16])
            x = torch.randn(rows, DIM, device="cuda")
            copy = x.clone()
            want = in_place(copy, 0.25)[0].clone()
            got = step(replay.padded(x, written=True), 0.25)[0]
            assert torch.equal(got, want) and torch.equal(x, copy)
        assert session.stats().variants == 3, session.report()


def test_an_output_fed_back_runs_eagerly_and_verify_every_checks_variants():
    fn = make_stack(mix_rows=False, flip=False)
    fn(torch.randn(3, DIM, device="cuda"), 0.1)
    with replay.capture(
        buckets=BUCKETS, polymorphic=True, record_after=0, record_budget=1.0, verify_every=3
    ) as session:
        step = session.region(fn)
        warm(step, [8])
        # the bucket's own graph fed its own output: declined, run eagerly (never overwritten while read)
        out = step(replay.padded(torch.randn(8, DIM, device="cuda")), 0.1)[0]
        want_again = eager_copy(fn(out.clone(), 0.1))
        assert_same(step(replay.padded(out), 0.1), want_again)
        assert session.stats().declined >= 1, session.report()
        rng = random.Random(6)
        for _ in range(60):
            rows = rng.choice([5, 6, 7])
            x = torch.randn(rows, DIM, device="cuda")
            out = step(replay.padded(x), 0.1)[0]
            want_again = eager_copy(fn(out.clone(), 0.2))
            again = step(replay.padded(out), 0.2)  # its own output back in: never overwritten while read
            assert_same(again, want_again)
        stats = session.stats()
    assert stats.variants == 6 and stats.verifications >= 10, session.report()  # 3 sizes, 2 slopes


def test_compaction_and_invalidation_drop_variants_and_sizes_are_served_again():
    fn = make_stack(mix_rows=False, flip=False)
    fn(torch.randn(3, DIM, device="cuda"), 0.1)
    with replay.capture(buckets=BUCKETS, polymorphic=True, record_after=0, record_budget=1.0) as session:
        step = session.region(fn)
        rng = random.Random(7)
        drive(step, fn, [3, 5, 6, 7, 12, 13], 100, rng)
        first = session.stats().variants
        session.invalidate()
        drive(step, fn, [3, 5, 6, 7, 12, 13], 100, rng)
        stats = session.stats()
    assert first >= 4 and stats.variants >= first + 4, session.report()


def test_sizes_are_observed_only_when_admitted_and_within_the_recording_budget():
    """An observation costs several eager calls: a size seen once is only padded (a replay),
    and a size that comes back waits while the recording budget is spent (item 5 of issue
    "Never slower than eager": new keys cost what eager costs)."""
    fn = make_stack(mix_rows=False, flip=False)
    fn(torch.randn(3, DIM, device="cuda"), 0.1)
    with replay.capture(buckets=[64], polymorphic=True) as session:  # record_after=1: a size's 2nd call
        step = session.region(fn)
        warm(step, [64])
        warm(step, [64])  # the bucket's key past its warm-up: recorded
        assert session.stats().records >= 1, session.report()
        eager_before, variants_before = session.stats().eager_runs, session.stats().variants
        sizes = list(range(1, 40))
        for rows in sizes:  # each size once: padded, never observed
            x = torch.randn(rows, DIM, device="cuda")
            assert_same(step(replay.padded(x), 0.1), eager_copy(fn(x, 0.1)), f"rows {rows}")
        stats = session.stats()
        assert stats.variants == variants_before and stats.eager_runs == eager_before, session.report()
        budget = session.admission.budget
        budget.spent = 1e9  # the budget spent: sizes that come back still wait, padded
        for rows in sizes[:10]:
            x = torch.randn(rows, DIM, device="cuda")
            assert_same(step(replay.padded(x), 0.1), eager_copy(fn(x, 0.1)), f"rows {rows}")
        assert session.stats().variants == variants_before and session.stats().eager_runs == eager_before
        budget.spent = 0.0  # room again: each size that comes back is observed once, charged
        for rows in sizes[:10]:
            x = torch.randn(rows, DIM, device="cuda")
            assert_same(step(replay.padded(x), 0.1), eager_copy(fn(x, 0.1)), f"rows {rows}")
        stats = session.stats()
    assert stats.variants == variants_before + 10 and stats.eager_runs == eager_before + 10, session.report()
    assert budget.spent > 0
