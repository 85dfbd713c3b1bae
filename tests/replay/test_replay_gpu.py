"""Replay on a real GPU: differential runs against eager, staging, fallbacks, bounds, memory."""

from __future__ import annotations

import array
import collections
import random
import types
import warnings

import pytest
import torch

import jitcore as jc
import replay
from replay import dynamic

from . import fuzz_grammar as fz

# every test with the torch-side helper (its observer, guards, C step) and without it
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("with_and_without_helper")]

SOURCE = r"""
__global__ void gather_add(const long long* __restrict__ tokens, const float* __restrict__ table,
                           const float* __restrict__ extra, float* __restrict__ out, int rows, int cols) {
    int r = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < cols) out[r * cols + c] = table[tokens[r] * cols + c] + extra[r * cols + c];
}
__global__ void scale(const float* __restrict__ x, float* __restrict__ y, float s, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * s;
}
__global__ void write_row(const float* __restrict__ x, float* __restrict__ cache, long long row, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) cache[row * n + i] = x[i] + (float)row;
}
__global__ void relu(const float* __restrict__ x, float* __restrict__ y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
__global__ void spread(const float* __restrict__ x, float* __restrict__ h, long long cols) {
    long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (c < cols) h[blockIdx.y * cols + c] = x[blockIdx.y] * (float)(c % 7);
}
__global__ void row_sum(const float* __restrict__ x, float* __restrict__ out, int cols) {
    float acc = 0.f;
    for (int c = threadIdx.x; c < cols; c += 32) acc += x[blockIdx.x * (long long)cols + c];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffff, acc, o);
    if (threadIdx.x == 0) out[blockIdx.x] = acc;
}
"""
gather_kernel = jc.Kernel(SOURCE, "gather_add")
scale_kernel = jc.Kernel(SOURCE, "scale")
write_kernel = jc.Kernel(SOURCE, "write_row")
relu_kernel = jc.Kernel(SOURCE, "relu")
row_sum_kernel = jc.Kernel(SOURCE, "row_sum")
spread_kernel = jc.Kernel(SOURCE, "spread")

VOCAB, DIM, ROWS = 97, 64, 16
TABLE = torch.randn(VOCAB, DIM, device="cuda") if torch.cuda.is_available() else None


@jc.jit
def gather(tokens, table, extra, out):
    rows, cols = out.shape
    gather_kernel[(jc.cdiv(cols, 64), rows), 64](tokens, table, extra, out, rows, cols)


@jc.jit
def scaled(x, y, s):
    n = x.numel()
    scale_kernel[jc.cdiv(n, 256), 256](x, y, s, n)


@jc.jit
def write(x, cache, row):
    n = x.numel()
    write_kernel[jc.cdiv(n, 256), 256](x, cache, row, n)


@jc.jit
def relu(x, y):
    n = x.numel()
    relu_kernel[jc.cdiv(n, 256), 256](x, y, n)


@jc.jit
def spread(x, h):
    rows, cols = h.shape
    spread_kernel[(jc.cdiv(cols, 256), rows), 256](x, h, cols)


@jc.jit
def row_sums(x, out):
    row_sum_kernel[x.shape[0], 32](x, out, x.shape[1])


def decode_step(tokens, extra, cache, pos):
    batch = tokens.shape[0]
    h = torch.empty(batch, DIM, device="cuda")
    gather(tokens, TABLE, extra, h)
    y = torch.empty_like(h)
    scaled(h, y, pos * 0.5 + 1.0)
    write(y, cache, pos % ROWS)
    return y


def fresh_inputs(batch, generator):
    tokens = torch.randint(0, VOCAB, (batch,), device="cuda", generator=generator)
    extra = torch.randn(batch, DIM, device="cuda", generator=generator)
    cache = torch.randn(ROWS, batch * DIM, device="cuda", generator=generator)
    return tokens, extra, cache


def test_differential_2000_steps_over_8_shapes_fresh_inputs_and_a_changing_dynamic_scalar():
    generator = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    shapes = [1, 2, 3, 4, 5, 8, 13, 16]
    order = random.Random(1).choices(shapes, k=2000)
    with replay.capture(record_budget=1.0) as session:  # each shape records on its second call
        step = session.region(decode_step)
        for number, batch in enumerate(order):
            tokens, extra, cache = fresh_inputs(batch, generator)
            expected_cache = cache.clone()
            expected = decode_step(tokens.clone(), extra.clone(), expected_cache, number)
            got = step(tokens, extra, cache, dynamic(number))
            assert torch.equal(got, expected), f"step {number}, batch {batch}"
            assert torch.equal(cache, expected_cache), f"step {number}, batch {batch}: cache"
        stats = session.stats()
    assert stats.records == len(set(order))
    assert stats.replays + stats.eager_runs == 2000 and stats.eager_runs == len(set(order))
    assert stats.patches > 0
    choices = {c.input: c.choice for c in stats.inputs}
    assert choices == {"args[0]": "rebound", "args[1]": "rebound", "args[2]": "rebound"}


def host_ids_step(ids, extra, cache, pos):
    """A decode step that takes its token ids on the host: copied to the GPU by the region,
    an embedding lookup (torch), a gather (jit), then jit kernels with a dynamic position."""
    tokens = ids.to("cuda", non_blocking=True)
    embedded = torch.nn.functional.embedding(tokens, TABLE)
    h = torch.empty_like(embedded)
    gather(tokens, TABLE, extra, h)
    y = torch.empty_like(h)
    scaled(h + embedded, y, pos * 0.5 + 1.0)
    write(y, cache, pos % ROWS)
    return y, tokens


def test_a_decode_step_taking_host_token_ids_replays_600_steps_bit_for_bit():
    seed = random.randrange(1 << 30)
    host_generator = torch.Generator().manual_seed(seed)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    order = random.Random(seed).choices([1, 4, 16], k=600)
    with warnings.catch_warnings():
        warnings.simplefilter("error", replay.ReplayWarning)
        with replay.capture(record_budget=1.0) as session:
            step = session.region(host_ids_step)
            for number, batch in enumerate(order):
                ids = torch.randint(0, VOCAB, (batch,), generator=host_generator)
                if number % 3 == 0:
                    ids = ids.pin_memory()
                _, extra, cache = fresh_inputs(batch, generator)
                expected_cache = cache.clone()
                expected = host_ids_step(ids.clone(), extra.clone(), expected_cache, number)
                got = step(ids, extra, cache, dynamic(number))
                where = f"step {number}, batch {batch}, seed {seed}"
                assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), where
                assert torch.equal(cache, expected_cache), f"{where}: cache"
                got[0].fill_(float("nan"))  # poisoned: the next replay must write it again
                got[1].fill_(-1)
            stats = session.stats()
    assert stats.records == 3 and stats.eager_only_keys == 0
    assert stats.replays + stats.eager_runs == 600 and stats.eager_runs == 3
    assert {c.input: c.choice for c in stats.inputs}["args[0]"] == "staged"


def test_outputs_are_overwritten_clone_outputs_copies_and_stale_reads_are_caught():
    with replay.capture(record_after=0) as session:
        step = session.region(decode_step)
        step(*fresh_inputs(2, None), dynamic(1))  # recorded
        step(*fresh_inputs(2, None), dynamic(1))  # analysed, replayed
        first = step(*fresh_inputs(2, None), dynamic(1))
        kept = first.clone()
        second = step(*fresh_inputs(2, None), dynamic(2))
        # the same memory (the region's output slot the graph wrote last), overwritten
        assert second.data_ptr() == first.data_ptr() and not torch.equal(first, kept)
    with replay.capture(record_after=0, clone_outputs=True) as session:
        step = session.region(decode_step)
        a = step(*fresh_inputs(2, None), dynamic(1))
        b = step(*fresh_inputs(2, None), dynamic(2))
        assert a is not b and a.data_ptr() != b.data_ptr()
    with replay.capture(record_after=0, check_stale=True) as session:
        step = session.region(decode_step)
        a = step(*fresh_inputs(2, None), dynamic(1))
        a.sum()  # fresh: fine
        step(*fresh_inputs(2, None), dynamic(2))
        with pytest.raises(replay.StaleOutputError, match="overwritten by a later replay"):
            a.sum()


COUNTS: list = []  # a global tensor a region writes and returns (made where CUDA is)


def counts_and_doubles(x):
    counts = COUNTS[0]
    counts.add_(1)
    return x, counts, x * 2, counts[1:]


@pytest.mark.parametrize("policy", ["clone_outputs", "check_stale"])
def test_clone_outputs_and_check_stale_touch_only_what_the_graph_writes(policy):
    """The caller's argument and a global the region returns are what eager returns (the
    objects themselves, a view of the global over the global), on the recording call and on
    every replay; only the graph's own output is copied, or guarded."""
    COUNTS[:] = [torch.zeros(4, device="cuda")]
    with replay.capture(record_after=0, **{policy: True}) as session:
        step = session.region(counts_and_doubles)
        for calls in range(1, 6):
            x = torch.randn(4, device="cuda")
            arg, counts, doubled, tail = step(x)
            assert arg is x and counts is COUNTS[0] and type(counts) is torch.Tensor
            assert torch.equal(counts, torch.full((4,), float(calls), device="cuda")) and torch.equal(doubled, x * 2)
            assert tail.data_ptr() == counts.data_ptr() + 4 and type(tail) is torch.Tensor
            assert (type(doubled) is torch.Tensor) == (policy == "clone_outputs")
        assert session.stats().replays >= 4
    COUNTS.clear()


def turns_tf32_on(x, w):
    torch.backends.cuda.matmul.allow_tf32 = True  # and leaves it on: every eager call sets it
    return x @ w


def test_a_region_leaving_a_torch_setting_changed_runs_eagerly_where_the_caller_puts_it_back():
    x, w = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with replay.capture(record_after=0) as session:
                step = session.region(turns_tf32_on)
                for _ in range(5):
                    torch.backends.cuda.matmul.allow_tf32 = False
                    step(x, w)
                    assert torch.backends.cuda.matmul.allow_tf32  # as eagerly, at every call
                assert session.stats().replays <= 1  # the first launch of the refused capture at most
                for _ in range(5):  # left on: a key whose runs change nothing, replayed
                    assert torch.equal(step(x, w), turns_tf32_on(x, w))
                assert session.stats().replays >= 4
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert any("leaves it changed" in str(w.message) for w in caught)


class _ModelOutput(collections.OrderedDict):  # transformers' pattern: no graph returns it
    pass


def returns_a_model_output(x):
    return _ModelOutput(logits=x * 2)


def returns_a_dict_keyed_by_its_argument(x):
    return {x: x * 2}


@pytest.mark.parametrize("fn", [returns_a_model_output, returns_a_dict_keyed_by_its_argument])
def test_a_result_no_graph_returns_runs_eagerly_with_a_warning_never_an_error(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replay.capture(record_after=0) as session:
            step = session.region(fn)
            for _ in range(4):
                x = torch.randn(4, device="cuda")
                out = step(x)
                assert type(out) is type(fn(x)) and torch.equal(next(iter(out.values())), x * 2)
                assert fn is returns_a_model_output or next(iter(out)) is x
            stats = session.stats()
    assert stats.replays == 0 and stats.eager_only_keys == 1
    assert any(issubclass(w.category, replay.ReplayWarning) for w in caught)


def mixed(x, w):
    h = torch.empty_like(x)
    relu(x, h)
    return h @ w


def test_torch_ops_reading_inputs_are_staged_and_results_match_eager():
    with replay.capture() as session:
        step = session.region(mixed)
        for _ in range(20):
            x = torch.randn(32, 64, device="cuda")
            w = torch.randn(64, 48, device="cuda")
            expected = mixed(x.clone(), w.clone())
            assert torch.equal(step(x, w), expected)
        stats = session.stats()
    choices = {c.input: c.choice for c in stats.inputs}
    assert choices == {"args[0]": "rebound", "args[1]": "staged"}
    assert stats.staged_copies > 0


def inplace_torch(x, w):
    x.mul_(2)  # a torch op writing an input: staged and copied back
    out = torch.empty_like(w)
    relu(w, out)
    return out


def test_inputs_written_by_torch_ops_are_copied_back():
    with replay.capture() as session:
        step = session.region(inplace_torch)
        for _ in range(6):
            x, w = torch.randn(100, device="cuda"), torch.randn(7, device="cuda")
            x_expected = x.clone() * 2
            assert torch.equal(step(x, w), torch.relu(w))
            assert torch.equal(x, x_expected)
    assert {c.input: c.choice for c in session.stats().inputs}["args[0]"] == "staged+copied back"


def with_item(x):
    y = torch.empty_like(x)
    relu(x, y)
    if y.sum().item() > 1e9:
        y.zero_()
    return y


def test_a_host_sync_makes_the_key_eager_only_with_one_warning():
    with replay.capture() as session:
        step = session.region(with_item)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(5):
                x = torch.randn(50, device="cuda")
                assert torch.equal(step(x), torch.relu(x))
        relevant = [w for w in caught if issubclass(w.category, replay.ReplayWarning)]
        assert len(relevant) == 1 and "runs eagerly" in str(relevant[0].message)
        assert session.stats().eager_only_keys == 1 and session.stats().replays == 0
    # the process, the stream and the allocator are fine afterwards
    x = torch.randn(10, device="cuda")
    y = torch.empty_like(x)
    relu(x, y)
    torch.cuda.synchronize()
    assert torch.equal(y, torch.relu(x))


def test_a_jit_miss_during_recording_aborts_cleanly_and_records_later():
    @jc.jit
    def fresh_scale(x, y, s):
        n = x.numel()
        scale_kernel[jc.cdiv(n, 256), 256](x, y, s, n)

    # which path the region takes: switched by the caller after the eager warm-up, so the
    # recording run takes a path the warm-up did not (the watch snapshots it at the recording)
    path = types.SimpleNamespace(fresh=False)

    def region(x):
        y = torch.empty_like(x)
        if path.fresh:
            fresh_scale(x, y, 3.0)
        else:
            scaled(x, y, 3.0)
        return y

    with replay.capture(record_after=1) as session:
        step = session.region(region)
        for call in range(4):
            path.fresh = call >= 1
            x = torch.randn(64, device="cuda")
            assert torch.equal(step(x), x * 3.0)
        stats = session.stats()
    assert stats.record_retries == 1 and stats.records == 1 and stats.replays == 2


def test_eviction_on_the_gpu_keeps_hot_graphs_and_stays_exact():
    # two graphs held; a third key replaces the colder one only once called more than twice
    # as often recently (replay.admission); every call exact, replayed, refused or recorded
    with replay.capture(record_after=0, max_graphs=2) as session:
        step = session.region(decode_step)
        order = [1, 2, 1, 2, 1, 1] + [3] * 6 + [1, 2, 3, 1, 3]
        for number, batch in enumerate(order):
            tokens, extra, cache = fresh_inputs(batch, None)
            expected_cache = cache.clone()
            expected = decode_step(tokens, extra, expected_cache, number)
            assert torch.equal(step(tokens, extra, cache, dynamic(number)), expected)
            assert torch.equal(cache, expected_cache)
        stats = session.stats()
    assert stats.graphs == 2 and stats.evictions == 1 and stats.refused >= 1, session.report()


def forty_launches(x):
    h = x
    for _ in range(20):
        y = torch.empty_like(h)
        scaled(h, y, 0.5)
        h = torch.empty_like(y)
        relu(y, h)
    return h


def test_after_the_grace_rare_shapes_run_eagerly_and_a_frequent_one_is_recorded(monkeypatch):
    # the payback rule on the GPU, with the real costs: a recording of 40 launches costs
    # milliseconds, an eager call a few hundred microseconds; shapes seen once never repay a
    # recording, the one called 150 times does
    from replay import admission

    monkeypatch.setattr(admission, "GRACE_SECONDS", 0.5)  # the GPU tests' hour of grace, undone
    first = admission.FIRST_RECORDINGS  # the first recordings are at least these many captures
    with replay.capture(record_after=0, record_budget=0.5) as session:  # a budget that never postpones here
        step = session.region(forty_launches)
        for rows in range(1, first + 1):  # the first recordings: made at once, the recording costs measured
            x = torch.randn(rows, 256, device="cuda")
            assert torch.equal(step(x), forty_launches(x)) and torch.equal(step(x), forty_launches(x))
        assert session.stats().records == first
        budget = session.admission.budget
        budget.spent = admission.FIRST_RECORDINGS_SHARE * budget.grace  # the first recordings made, the budget not
        assert not budget.first_recordings()
        for rows in range(first + 1, first + 38):
            x = torch.randn(rows, 256, device="cuda")
            assert torch.equal(step(x), forty_launches(x))
        assert session.stats().records == first and session.stats().too_rare == 37, session.report()
        x = torch.randn(64, 256, device="cuda")
        for _ in range(150):
            x.normal_()
            expected = forty_launches(x)
            out = torch.full_like(expected, float("nan"))
            out.copy_(step(x))
            assert torch.equal(out, expected)
        stats = session.stats()
    assert stats.records == first + 1 and stats.replays >= 50, session.report()


WIDE = 1 << 20


def big_intermediates(x):
    h = torch.empty(x.shape[0], WIDE, device="cuda")  # 4 MiB a row, freed when the region returns
    spread(x, h)
    out = torch.empty(x.shape[0], device="cuda")
    row_sums(h, out)
    return out


def test_memory_of_eight_shapes_is_close_to_the_largest_alone():
    torch.cuda.synchronize()
    with replay.capture(record_after=0, record_budget=1.0) as alone:
        x = torch.randn(8, device="cuda")
        step = alone.region(big_intermediates)
        step(x)
        step(x)
        largest = alone.stats().graph_memory_bytes
    assert largest >= 8 * WIDE * 4
    # any order within 1.5x of the largest alone (replay.admission.COMPACTION_GROWTH); shapes
    # that keep growing fragment the pool and are compacted (recorded again, largest first)
    for order, compacted in (([3, 8, 1, 6, 2, 7, 4, 5], False), ([1, 2, 4, 8], True)):
        with replay.capture(record_after=0, record_budget=1.0) as session:
            step = session.region(big_intermediates)
            for batch in order:
                for _ in range(2):  # recorded, then analysed
                    x = torch.randn(batch, device="cuda")
                    expected = (x[:, None] * (torch.arange(WIDE, device="cuda") % 7).float()).sum(1)
                    torch.testing.assert_close(step(x), expected, rtol=2e-3, atol=1e-1)
            for batch in order[::-1]:  # still right after any compaction
                x = torch.randn(batch, device="cuda")
                expected = (x[:, None] * (torch.arange(WIDE, device="cuda") % 7).float()).sum(1)
                torch.testing.assert_close(step(x), expected, rtol=2e-3, atol=1e-1)
            stats = session.stats()
        total = stats.graph_memory_bytes
        assert total <= 1.5 * largest, f"{order}: {total / 2**20:.1f} MiB vs {largest / 2**20:.1f} MiB alone"
        assert stats.replays >= len(order) and (stats.compactions >= 1 or not compacted), session.report()


def test_verify_every_catches_a_stale_graph():
    # a Python float read from a C object's memory: baked into the graph, and out of the watch's
    # sight (it compares such objects by identity), so nothing but verification sees it change
    config = array.array("d", [1.0])

    def uses_config(x):
        y = torch.empty_like(x)
        scaled(x, y, config[0])
        return y

    with replay.capture(record_after=0, verify_every=2) as session:
        step = session.region(uses_config)
        x = torch.randn(16, device="cuda")
        step(x)  # records
        step(x)  # analysed, replayed (replay 1)
        step(x)  # replay 2: verified, still fresh
        config[0] = 2.0  # nothing a key, the drift check or the watch sees: the graph is stale
        step(x)  # replay 3
        with pytest.raises(replay.ReplayMismatchError, match="differs from an eager run"):
            step(x)  # replay 4: verified
        assert session.stats().verifications == 2
        session.invalidate()
        assert torch.equal(step(x), x * 2.0)


def aliasing_output(x):
    relu(x, x)
    return x[1:]


def test_outputs_that_alias_inputs_follow_the_new_input():
    with replay.capture(record_after=0) as session:
        step = session.region(aliasing_output)
        for _ in range(3):
            x = torch.randn(10, device="cuda")
            expected = torch.relu(x)[1:]
            out = step(x)
            assert out.data_ptr() == x.data_ptr() + 4 and torch.equal(out, expected)


def test_replays_follow_the_current_stream():
    with replay.capture(record_after=0) as session:
        step = session.region(decode_step)
        tokens, extra, cache = fresh_inputs(4, None)
        step(tokens, extra, cache, dynamic(0))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            tokens, extra, cache = fresh_inputs(4, None)
            expected_cache = cache.clone()
            expected = decode_step(tokens, extra, expected_cache, 5)
            got = step(tokens, extra, cache, dynamic(5))
        stream.synchronize()
        assert torch.equal(got, expected) and torch.equal(cache, expected_cache)


WEIGHT = torch.randn(DIM, DIM, device="cuda") if torch.cuda.is_available() else None


def rows_step(tokens, extra, pos):
    """Row-independent: jit kernels and a matmul against a weight, per row."""
    h = torch.empty(tokens.shape[0], DIM, device="cuda")
    gather(tokens, TABLE, extra, h)
    y = torch.empty_like(h)
    scaled(h @ WEIGHT, y, pos * 0.25 + 1.0)
    z = torch.empty_like(y)
    relu(y, z)
    return z


def test_bucketed_replay_equals_eager_on_the_padded_rows_bit_for_bit():
    generator = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    sizes = random.Random(2).choices(range(1, 41), k=400)
    with replay.capture(buckets=[1, 2, 4, 8, 16, 32, 64]) as session:
        step = session.region(rows_step)
        for number, batch in enumerate(sizes):
            bucket = 1 << (batch - 1).bit_length()
            tokens = torch.randint(0, VOCAB, (batch,), device="cuda", generator=generator)
            extra = torch.randn(batch, DIM, device="cuda", generator=generator)
            # the reference: eager on the same padded inputs (a matmul of another height may
            # round differently, so the bit-for-bit claim is against the padded computation)
            padded_tokens = torch.zeros(bucket, dtype=tokens.dtype, device="cuda")
            padded_tokens[:batch] = tokens
            padded_extra = torch.zeros(bucket, DIM, device="cuda")
            padded_extra[:batch] = extra
            expected = rows_step(padded_tokens, padded_extra, number)[:batch]
            got = step(replay.padded(tokens), replay.padded(extra), dynamic(number))
            assert got.shape == (batch, DIM) and torch.equal(got, expected), f"step {number}, batch {batch}"
            # and close to the unpadded run: cuBLAS may pick another algorithm for another height
            torch.testing.assert_close(got, rows_step(tokens, extra, number), rtol=1e-3, atol=1e-3)
        stats = session.stats()
    assert stats.records <= 7 and stats.replays >= 380, session.report()


def test_verify_every_catches_padding_of_a_region_that_mixes_rows():
    with replay.capture(buckets=[8], verify_every=1) as session:
        centred = session.region(lambda x: x - x.mean(0, keepdim=True), name="centred")
        with pytest.raises(replay.ReplayMismatchError, match="not independent"):
            centred(replay.padded(torch.randn(3, DIM, device="cuda") + 1))


def matmul_first(x):
    """Row-independent, and a torch op reads the argument: the graph stages it."""
    h = x @ WEIGHT
    y = torch.empty_like(h)
    relu(h, y)
    return y


def bumped_matmul(x):
    """Writes its argument (a torch op): staged, copied back; ``written=True`` when padded."""
    x.mul_(2)
    return x @ WEIGHT


def matmul_and_a_view(x):
    """An output is a view of the argument: as a bucketed call hands it out, a view of the
    call's own padded copy, which the next call must not overwrite."""
    return x[:, :4], x @ WEIGHT


def gather_after_matmul(tokens, extra):
    """``extra`` read by a matmul (staged), ``tokens`` by a jit kernel only (rebound)."""
    h = torch.empty(tokens.shape[0], DIM, device="cuda")
    gather(tokens, TABLE, extra @ WEIGHT, h)
    return h


def _steps_of(sizes, generator):
    for number, batch in enumerate(sizes):
        yield number, batch, torch.randn(batch, DIM, device="cuda", generator=generator)


def test_a_staged_padded_argument_is_padded_straight_into_the_graphs_buffer():
    # the graph stages x (a matmul reads it): a bucketed call pads it into the staged buffer
    # and the replay skips the copy in and back; every call equals eager on the padded rows
    generator = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    sizes = random.Random(3).choices(range(1, 41), k=300)
    buckets = [1, 2, 4, 8, 16, 32, 64]
    with replay.capture(buckets=buckets, record_after=1) as session:
        step = session.region(matmul_first)
        for number, batch, x in _steps_of(sizes, generator):
            kept = x.clone()
            expected = fz.padded_reference(matmul_first, (replay.padded(x),), {}, buckets)
            got = step(replay.padded(x))
            assert got.shape == (batch, DIM) and torch.equal(got, expected), f"step {number}, batch {batch}"
            assert torch.equal(x, kept)
        stats = session.stats()
    assert stats.records <= 7 and stats.replays >= 280, session.report()
    assert stats.padded_in_place >= stats.replays // 2, session.report()
    # a replay in place makes no staging copy, any other its copy in (and back, where the
    # graph copies back); a recording call's own launch counts as a replay without copies
    (choice,) = {c.choice for c in stats.inputs}
    copies = {"staged": 1, "staged+copied back": 2}[choice]
    assert stats.staged_copies == copies * (stats.replays - stats.records - stats.padded_in_place), session.report()


def test_in_place_padding_keeps_written_arguments_views_streams_and_declines_exact():
    generator = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    sizes = random.Random(4).choices(range(1, 17), k=120)
    buckets = [4, 8, 16]
    # a written argument: its rows copied back from the buffer after the replay
    with replay.capture(buckets=buckets, record_after=1) as session:
        step = session.region(bumped_matmul)
        for number, _batch, x in _steps_of(sizes, generator):
            expected_x = x.clone()  # the reference copies the rows back into it
            expected = fz.padded_reference(bumped_matmul, (replay.padded(expected_x, written=True),), {}, buckets)
            got = step(replay.padded(x, written=True))
            assert torch.equal(got, expected) and torch.equal(x, expected_x), f"step {number}"
        assert session.stats().padded_in_place >= 60, session.report()
    # an output viewing the argument: not padded in place, and a held output stays as it was
    with replay.capture(buckets=buckets, record_after=1) as session:
        step = session.region(matmul_and_a_view)
        held = []
        for number, _batch, x in _steps_of(sizes, generator):
            expected = fz.padded_reference(matmul_and_a_view, (replay.padded(x),), {}, buckets)
            got = step(replay.padded(x))
            assert all(torch.equal(g, e) for g, e in zip(got, expected)), f"step {number}"
            held.append((got, expected))
        for number, (got, expected) in enumerate(held[-20:]):  # later calls left them alone
            assert torch.equal(got[0], expected[0]), f"held view {number}"
        assert session.stats().padded_in_place == 0 and session.stats().replays >= 100, session.report()
    # calls alternating between two streams, and a torch setting changed under the graphs:
    # the replays decline it (the call goes the usual way, and computes as eager does)
    side = torch.cuda.Stream()
    with replay.capture(buckets=buckets, record_after=1) as session:
        step = session.region(matmul_first)
        for number, _batch, x in _steps_of(sizes, generator):
            tf32 = number % 10 == 9
            stream = side if number % 3 == 0 else torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.current_stream())
            previous = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = tf32
            try:
                with torch.cuda.stream(stream):
                    expected = fz.padded_reference(matmul_first, (replay.padded(x),), {}, buckets)
                    got = step(replay.padded(x))
                    torch.cuda.current_stream().synchronize()
            finally:
                torch.backends.cuda.matmul.allow_tf32 = previous
            assert torch.equal(got, expected), f"step {number}, stream {'side' if stream is side else 'main'}"
        stats = session.stats()
        assert stats.padded_in_place >= 20, session.report()
    # two padded arguments, one staged (a matmul reads it: padded in place), one a jit kernel
    # reads (rebound: padded into a temporary as before)
    with replay.capture(buckets=buckets, record_after=1) as session:
        step = session.region(gather_after_matmul)
        for number, batch, extra in _steps_of(sizes, generator):
            tokens = torch.randint(0, VOCAB, (batch,), device="cuda", generator=generator)
            expected = fz.padded_reference(
                gather_after_matmul, (replay.padded(tokens), replay.padded(extra)), {}, buckets
            )
            got = step(replay.padded(tokens), replay.padded(extra))
            assert torch.equal(got, expected), f"step {number}"
        stats = session.stats()
        assert 0 < stats.padded_in_place < stats.replays and stats.records <= 3, session.report()
    # verify_every: a verified or declined call runs the region on its arguments, so never
    # on a graph's buffer
    with replay.capture(buckets=buckets, record_after=1, verify_every=5) as session:
        step = session.region(matmul_first)
        for number, _batch, x in _steps_of(sizes[:40], generator):
            expected = fz.padded_reference(matmul_first, (replay.padded(x),), {}, buckets)
            assert torch.equal(step(replay.padded(x)), expected), f"step {number}"
        assert session.stats().padded_in_place == 0 and session.stats().replays >= 20, session.report()


def doubled_plus_one(x):
    return x * 2 + 1  # torch ops read x: its graphs stage it, and padded calls pad into the buffer


def test_in_place_padding_never_pads_into_a_buffer_of_another_dtype():
    """Calls of the same shapes in other dtypes (int32 has float32's element size, so the
    pad's bytes would fit) are served by graphs of their own dtype, or eagerly: each call
    compared with its padded eager reference, dtype and every element, over random dtypes
    and rows."""
    generator = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    draw = random.Random(random.randrange(1 << 30))
    dtypes = [torch.float32, torch.int32, torch.float16, torch.bfloat16, torch.int64]
    buckets = [4, 8]
    with replay.capture(buckets=buckets, record_after=1) as session:
        step = session.region(doubled_plus_one)
        for number in range(200):
            dtype = dtypes[0] if number < 8 else draw.choice(dtypes)  # float32 graphs first
            rows = draw.randint(1, 8)
            x = (torch.randn(rows, 33, device="cuda", generator=generator) * 1000).to(dtype)
            expected = fz.padded_reference(doubled_plus_one, (replay.padded(x),), {}, buckets)
            got = step(replay.padded(x))
            assert got.dtype == expected.dtype == dtype, f"call {number}: {got.dtype}, {dtype}"
            assert torch.equal(got, expected), f"call {number}, {dtype}, {rows} rows"
        stats = session.stats()
        assert stats.padded_in_place >= 60 and stats.records >= 6, session.report()


add_bias_kernel = jc.Kernel(
    r"""
__global__ void add_bias(const float* __restrict__ x, const float* __restrict__ bias, float* __restrict__ y,
                         int cols, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * 2.f + (bias ? bias[i % cols] : 0.f);
}
""",
    "add_bias",
)


@jc.jit
def add_bias(x, bias, y):
    n = x.numel()
    add_bias_kernel[jc.cdiv(n, 256), 256](x, bias, y, x.shape[1], n)


def optional_bias_step(x, bias):
    y = torch.empty_like(x)
    add_bias(x, bias, y)
    return y


def test_an_optional_tensor_left_out_is_its_own_key_and_replays_exactly():
    with replay.capture() as session:
        step = session.region(optional_bias_step)
        for number in range(12):
            x = torch.randn(4, 32, device="cuda")
            bias = torch.randn(32, device="cuda") if number % 3 else None
            expected = x * 2 + (bias if bias is not None else 0)
            got = step(x, bias)
            assert torch.equal(got, expected), f"call {number}, bias {'given' if bias is not None else 'None'}"
        stats = session.stats()
    assert stats.records == 2 and stats.replays >= 8, session.report()


def test_an_output_fed_back_padded_is_left_as_eager_leaves_it():
    # h = step(replay.padded(h)): the graph reads a padded copy of h, and h is its previous
    # output, which the replay would overwrite; the region runs such a call eagerly
    def scaled(h):
        return torch.tanh(h) * 2

    def bumped(h):
        h.add_(1)
        return h * 2

    for fn, written in ((scaled, False), (bumped, True)):
        with replay.capture(record_after=0, buckets=[4, 8]) as session:
            step = session.region(fn)
            h = torch.randn(3, 16, device="cuda")
            for number in range(8):
                before = h.clone()
                expected_h = before.clone()
                expected = fn(expected_h)
                out = step(replay.padded(h, written=written))
                assert torch.equal(out, expected), (fn.__name__, number)
                assert torch.equal(h, expected_h), (fn.__name__, number)  # as eager left it
                assert out.untyped_storage().data_ptr() != h.untyped_storage().data_ptr()
                h = out if number % 2 else torch.randn(3, 16, device="cuda")
            assert session.stats().replays >= 2 and session.stats().declined >= 1, session.report()


def _grad_step(x, w):
    """A jit kernel (no autograd, eagerly either) then torch ops that autograd records."""
    h = torch.empty_like(x)
    scaled(x, h, 2.0)
    return torch.relu(h @ w)


def _replay_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, replay.ReplayWarning)]


def _same_autograd(got: torch.Tensor, expected: torch.Tensor, wrt: list[torch.Tensor]) -> None:
    """``got`` is what eager gives: the same values, requires_grad and grad_fn, and the same
    gradients through it."""
    assert torch.equal(got, expected)
    assert got.requires_grad == expected.requires_grad
    assert type(got.grad_fn) is type(expected.grad_fn)
    if expected.requires_grad:
        for a, b in zip(torch.autograd.grad(got.sum(), wrt), torch.autograd.grad(expected.sum(), wrt)):
            assert torch.equal(a, b)


def test_an_argument_requiring_grad_under_grad_mode_runs_eagerly_with_its_grad_fn_and_one_warning():
    # A graph recorded for w serves no call whose w requires grad (a replay's outputs are
    # detached views of its memory: the gradients would be lost silently).
    torch.manual_seed(0)
    x = torch.randn(8, 16, device="cuda")
    w = torch.randn(16, 4, device="cuda")
    with replay.capture(record_budget=1.0) as session:
        step = session.region(_grad_step)
        for _ in range(4):  # nothing requires grad: recorded and replayed
            _same_autograd(step(x, w), _grad_step(x, w), [])
        replays = session.stats().replays
        assert replays >= 2, session.report()
        trained = w.clone().requires_grad_()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                _same_autograd(step(x, trained), _grad_step(x, trained), [trained])
        said = _replay_warnings(caught)
        assert len(said) == 1 and "requires grad" in said[0] and "torch.no_grad()" in said[0], said
        assert session.stats().replays == replays, session.report()
        _same_autograd(step(x, w), _grad_step(x, w), [])  # the key without grad still replays
        assert session.stats().replays == replays + 1
        with torch.no_grad():  # nothing needs autograd: the same tensors record and replay
            for _ in range(4):
                _same_autograd(step(x, trained), _grad_step(x, trained), [])
        assert session.stats().replays >= replays + 3, session.report()


@pytest.mark.parametrize("record_after", [1, 0], ids=["observed-warm-up", "refused-at-capture"])
def test_weights_requiring_grad_under_grad_mode_run_eagerly_with_their_grad_fn_and_one_warning(record_after):
    # No argument requires grad, the region's weights do (as a module's parameters do by
    # default). With a warm-up, its observed run shows it before any capture; without one,
    # the capture refuses outputs that require grad. Either way: eager, as eager computes.
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 4, device="cuda")

    def model_step(x):
        h = torch.empty_like(x)
        scaled(x, h, 2.0)
        return torch.relu(linear(h))

    x = torch.randn(8, 16, device="cuda")
    with replay.capture(record_after=record_after, record_budget=1.0) as session:
        step = session.region(model_step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(5):
                _same_autograd(step(x), model_step(x), list(linear.parameters()))
        said = _replay_warnings(caught)
        assert len(said) == 1 and "grad" in said[0] and "torch.inference_mode()" in said[0], said
        assert session.stats().replays == 0, session.report()
        with torch.inference_mode():  # the loop as it should run: recorded and replayed
            for _ in range(4):
                assert torch.equal(step(x), model_step(x))
        assert session.stats().replays >= 2, session.report()


def _double_then_relu(x):
    y = torch.empty_like(x)
    scaled(x, y, 2.0)
    z = torch.empty_like(x)
    relu(y, z)
    return z


def test_a_session_with_pool_ids_past_256_leaves_their_numbers_every_reference():
    """torch's pool ids count up from (0, 1), and numbers above 256 are objects of their own.
    torch 2.11's one-pool memory snapshot takes a reference from each number of the id it is
    given; every recording measures its pool, so after a few recordings into a session's
    257th pool the numbers were freed while the session held them (crashes elsewhere, later).
    Recordings into such a pool take no reference from the id's numbers, and replay exactly."""
    import sys

    handles = [torch.cuda.graph_pool_handle() for _ in range(300)]  # the next pool's id is past 256
    assert max(handles[-1]) > 256
    with replay.capture(record_after=0) as session:
        step = session.region(_double_then_relu)
        first = torch.randn(3, 64, device="cuda")
        assert torch.equal(step(first), _double_then_relu(first))
        pool = session.pool(torch.cuda.current_device())
        numbers = [n for n in pool if n > 256]
        assert numbers, pool
        before = [sys.getrefcount(n) for n in numbers]
        for rows in range(4, 16):  # a new key each: a capture and a measure of the pool each
            for _ in range(2):  # the recording call, then the analysis and a replay
                x = torch.randn(rows, 64, device="cuda")
                assert torch.equal(step(x), _double_then_relu(x))
        after = [sys.getrefcount(n) for n in numbers]  # (outside the assert: pytest's rewrite holds operands)
        assert all(now >= then for now, then in zip(after, before)), (before, after)  # holders may add, never take
        assert session.stats().records >= 12 and session.stats().replays >= 12
