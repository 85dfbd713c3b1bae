"""Regions of Triton kernels on a real GPU: pointers rebound, dynamic scalars and grids
recomputed, specialization changes declined, every call bit-exact against eager."""

from __future__ import annotations

import random

import pytest
import torch

import replay
from replay import dynamic

pytestmark = pytest.mark.gpu
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


@triton.jit
def scale_kernel(x_ptr, out_ptr, s, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * s, mask=mask)


@triton.jit(do_not_specialize=["m"])
def first_rows_kernel(x_ptr, out_ptr, m, cols, BLOCK: tl.constexpr):
    """Row r < m (one program per row, grid (m,)): out[r] = x[r] * 2 + m."""
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    mask = c < cols
    tl.store(out_ptr + r * cols + c, tl.load(x_ptr + r * cols + c, mask=mask) * 2.0 + m, mask=mask)


@triton.jit
def add_int_kernel(x_ptr, out_ptr, k, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + k, mask=mask)


def three_kernels(x, y, s, m):
    """Vector add, a scale by a dynamic float, and a kernel whose grid is a dynamic row count."""
    n = x.numel()
    h = torch.empty_like(x)
    add_kernel[(triton.cdiv(n, 256),)](x, y, h, n, BLOCK=256)
    out = torch.empty_like(x)
    scale_kernel[(triton.cdiv(n, 256),)](h, out, s, n, BLOCK=256)
    rows = torch.zeros_like(x)
    first_rows_kernel[(m,)](y, rows, m, x.shape[1], BLOCK=64)
    return out, rows


def poison(tensors):
    for t in tensors:
        t.fill_(float("nan"))


def test_a_region_of_triton_kernels_replays_exactly_with_its_inputs_rebound():
    rng = random.Random(15)
    generator = torch.Generator(device="cuda").manual_seed(15)
    shapes = [3, 16, 33]
    steps = 300
    with replay.capture(record_budget=1.0) as session:
        step = session.region(three_kernels)
        for number in range(steps):
            batch = rng.choice(shapes)
            x = torch.randn(batch, 64, device="cuda", generator=generator)
            y = torch.randn(batch, 64, device="cuda", generator=generator)
            # a grid of 0 (m == 0) is a no-op; kept out of the first steps, where keys record
            s, m = rng.uniform(-2, 2), rng.randrange(0 if number >= 40 else 1, batch + 1)
            expected = three_kernels(x.clone(), y.clone(), s, m)
            got = step(x, y, dynamic(s), dynamic(m))
            for a, b in zip(got, expected):
                assert torch.equal(a, b), f"step {number}, batch {batch}, s {s}, m {m}"
            poison(got)  # the next replay must write every output again
        stats = session.stats()
    assert stats.replays >= steps - 4 * len(shapes), stats
    assert stats.declined == 0 and stats.patches > 0
    choices = {(c.input, c.choice) for c in stats.inputs}
    assert choices == {("args[0]", "rebound"), ("args[1]", "rebound")}, choices


def test_with_the_hook_off_the_same_region_stages_its_inputs():
    replay.record_triton_launches(False)
    try:
        with replay.capture(record_budget=1.0) as session:
            step = session.region(three_kernels)
            for _ in range(4):
                x, y = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda")
                got = step(x, y, 0.5, 3)  # plain values: keyed, baked
                for a, b in zip(got, three_kernels(x, y, 0.5, 3)):
                    assert torch.equal(a, b)
            stats = session.stats()
    finally:
        replay.record_triton_launches(True)
    assert stats.replays >= 2
    assert {c.input for c in stats.inputs} == {"args[0]", "args[1]"}
    assert all(c.choice.startswith("staged") for c in stats.inputs), stats.inputs


def add_int(x, k):
    out = torch.empty_like(x)
    add_int_kernel[(triton.cdiv(x.numel(), 128),)](x, out, k, x.numel(), BLOCK=128)
    return out


def test_a_dynamic_int_recorded_as_one_declines_other_values_and_stays_exact():
    # recorded at k == 1, Triton compiles k in as a constant: patching 5 into that binary is
    # impossible (it has no k), keeping it would add 1; the replay must decline
    values = [1, 1, 1, 5, 1, 7, 1, 16, 32, 2, 1, 1]
    with replay.capture(record_budget=1.0) as session:
        step = session.region(add_int)
        for k in values:
            x = torch.randn(1000, device="cuda")
            got = step(x, dynamic(k))
            assert torch.equal(got, x + k), k
            poison([got])
        stats = session.stats()
    assert stats.replays >= 4
    assert stats.declined >= 5  # 5, 7, 16, 32, 2


def test_a_dynamic_int_whose_divisibility_changes_is_declined():
    values = [3, 3, 5, 16, 7, 1, 48, 9]
    declined = []
    with replay.capture(record_budget=1.0) as session:
        step = session.region(add_int)
        for k in values:
            before = session.stats().declined
            x = torch.randn(1000, device="cuda")
            got = step(x, dynamic(k))
            assert torch.equal(got, x + k), k
            declined.append(session.stats().declined - before)
    assert declined == [0, 0, 0, 1, 0, 1, 1, 0], declined


def test_a_pointer_that_loses_its_16_byte_alignment_is_declined_and_stays_exact():
    storage = torch.randn(4096 + 64, device="cuda")
    with replay.capture(record_budget=1.0) as session:
        step = session.region(add_int)
        for start in (0, 0, 16, 32):  # aligned: recorded, then replayed
            x = storage[start : start + 4096]
            assert torch.equal(step(x, 3), x + 3)
        assert session.stats().declined == 0
        for start in (1, 5, 3):  # 4 bytes off: the recorded binary assumed 16-byte alignment
            x = storage[start : start + 4096]
            assert torch.equal(step(x, 3), x + 3)
        stats = session.stats()
    assert stats.declined == 3 and stats.replays >= 2
    assert {c.choice for c in stats.inputs} == {"rebound"}
