"""Every way a value can enter a graph, on a real GPU: exact, or refused loudly.

One test (or a few) per hazard of the "Hazards" table in docs/replay.md. Each compares the
replayed call with an eager run of the same region on copies of the same fresh random inputs
(copied so that arguments share memory exactly as the originals do), bit for bit, with
outputs poisoned before the call.
"""

from __future__ import annotations

import dataclasses
import threading
import traceback
import warnings

import pytest
import torch

import jitcore as jc
import replay
from jitcore import drift
from jitcore.errors import ArgumentError
from replay import dynamic, recording
from replay.graph import clone_preserving_sharing

# each hazard with the torch-side helper (its torch-op observer) and without it
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("with_and_without_helper")]

SOURCE = r"""
__global__ void add_one(const float* x, float* y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] + 1.f;
}
__global__ void fill_first(float* out, float base, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = base + (float)i;
}
__global__ void copy_into(const float* __restrict__ x, float* __restrict__ row, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) row[i] = x[i];
}
__global__ void scale(const float* __restrict__ x, float* __restrict__ y, float s, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * s;
}
__global__ void store_int(float* y, int v) { y[0] = (float)v; }
"""
add_one_kernel = jc.Kernel(SOURCE, "add_one")
fill_kernel = jc.Kernel(SOURCE, "fill_first")
copy_kernel = jc.Kernel(SOURCE, "copy_into")
scale_kernel = jc.Kernel(SOURCE, "scale")
store_int_kernel = jc.Kernel(SOURCE, "store_int")


@jc.jit
def add_one(x, y):
    n = x.numel()
    add_one_kernel[jc.cdiv(n, 256), 256](x, y, n)


@jc.jit
def fill_first(out, n):
    fill_kernel[jc.cdiv(n, 64), 64](out, 1.5, n)


@jc.jit
def write_row(x, cache, pos):
    row = cache[pos]  # a view whose offset is computed from a runtime scalar
    n = x.numel()
    copy_kernel[jc.cdiv(n, 256), 256](x, row, n)


@jc.jit
def scaled(x, y, s):
    n = x.numel()
    scale_kernel[jc.cdiv(n, 256), 256](x, y, s, n)


@jc.jit
def store_int(y, v):
    store_int_kernel[1, 1](y, v)


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def differential(step, fn, *args):
    """Call the region and, on copies that share memory like ``args``, the plain function;
    compare the outputs and every argument afterwards."""
    plain = [a.value if isinstance(a, replay.Dynamic) else a for a in args]
    copies = clone_preserving_sharing(plain)
    expected = fn(*copies)
    got = step(*args)
    assert same(got, expected), "outputs differ from eager"
    for number, (arg, copy) in enumerate(zip(plain, copies)):
        if isinstance(arg, torch.Tensor):
            assert same(arg, copy), f"argument {number} differs from eager after the call"
    return got


# --- 1. aliased inputs ------------------------------------------------------------------------
def write_then_read(x, y):
    add_one(x, y)  # y = x + 1 (jit)
    return x * 2  # a torch op reading x


def test_aliased_inputs_select_their_own_graph():
    with replay.capture() as session:
        step = session.region(write_then_read)
        for _ in range(3):
            differential(step, write_then_read, torch.randn(256, device="cuda"), torch.randn(256, device="cuda"))
        for _ in range(5):
            a = torch.randn(256, device="cuda")
            differential(step, write_then_read, a, a)  # eager: 2 * (a + 1)
        for _ in range(3):
            base = torch.randn(512, device="cuda")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", replay.ReplayWarning)
                differential(step, write_then_read, base[:256], base[128:384])
        for _ in range(3):
            differential(step, write_then_read, torch.randn(256, device="cuda"), torch.randn(256, device="cuda"))


def read_both(x, y):
    a = torch.empty_like(x)
    add_one(y, a)
    b = torch.empty_like(x)
    add_one(x, b)
    return a, b  # jit reads both: staged, each into its own buffer (read-only: exact)


def test_verify_every_keeps_the_aliasing_of_its_reference_run():
    with replay.capture(verify_every=1) as session:
        step = session.region(read_both)
        for _ in range(5):
            base = torch.randn(512, device="cuda")
            differential(step, read_both, base[:256], base[128:384])
        assert session.stats().verifications >= 1


def sync_inside(x):
    return x * (2.0 if float(x.abs().sum()) > 1e30 else 1.0)


def test_a_failed_capture_leaves_recording_and_random_numbers_working():
    with replay.capture() as session:
        bad = session.region(sync_inside)
        good = session.region(noisy)
        with pytest.warns(replay.ReplayWarning):
            for _ in range(3):
                differential(bad, sync_inside, torch.randn(64, device="cuda"))
        torch.rand(4, device="cuda")  # the generator is not left capturing
        inputs = [torch.randn(1024, device="cuda") for _ in range(6)]
        torch.manual_seed(7)
        expected = [[t.clone() for t in noisy(x)] for x in inputs]
        torch.manual_seed(7)
        got = [[t.clone() for t in good(x)] for x in inputs]
        assert all(same(a, b) for a, b in zip(got, expected))
        assert session.stats().replays >= 4


# --- 2. random numbers --------------------------------------------------------------------------
def noisy(x):
    y = torch.empty_like(x)
    scaled(x, y, 2.0)
    probabilities = torch.softmax(y[:16], dim=0)
    return (
        y + torch.rand_like(y),
        torch.bernoulli(torch.full_like(y, 0.3)),
        torch.multinomial(probabilities, 4, replacement=True),
        torch.nn.functional.dropout(y, 0.5),
    )


def test_random_numbers_are_fresh_on_every_replay_and_equal_the_eager_sequence():
    inputs = [torch.randn(1024, device="cuda") for _ in range(12)]
    torch.manual_seed(1234)
    expected = [[t.clone() for t in noisy(x)] for x in inputs]
    torch.manual_seed(1234)
    got = []
    with replay.capture() as session:
        step = session.region(noisy)
        for x in inputs:
            got.append([t.clone() for t in step(x)])
        assert session.stats().replays >= 10
    for number, (a, b) in enumerate(zip(got, expected)):
        assert same(a, b), f"call {number}"
    assert not torch.equal(got[5][0], got[6][0])


# --- 3 and 5. launch sizes from dynamic scalars, zero-size launches -----------------------------
def fill(out, n):
    fill_first(out, n)
    return out


def test_grid_sizes_from_dynamic_scalars_are_recomputed_and_zero_is_a_no_op():
    with replay.capture() as session:
        step = session.region(fill)
        for n in [100, 100, 4000, 7, 0, 0, 4096, 1, 0, 3333]:
            out = torch.full((4096,), float("nan"), device="cuda")
            differential(step, fill, out, dynamic(n))
        stats = session.stats()
    assert stats.replays >= 7 and stats.eager_only_keys == 0


def test_a_dynamic_grid_first_seen_at_zero_records_later():
    with replay.capture() as session:
        step = session.region(fill)
        for n in [0, 0, 0, 50, 60, 0, 70]:
            differential(step, fill, torch.full((128,), float("nan"), device="cuda"), dynamic(n))
        assert session.stats().eager_only_keys == 0 and session.stats().replays >= 2


def empty_batch(x):
    y = torch.empty_like(x)
    add_one(x, y)
    return y


def test_zero_size_launches_are_no_ops_eagerly_and_in_regions():
    x = torch.empty(0, device="cuda")
    add_one(x, torch.empty(0, device="cuda"))  # eager: no error
    with replay.capture() as session:
        step = session.region(empty_batch)
        for size in [0, 0, 0, 5, 0, 5]:
            differential(step, empty_batch, torch.randn(size, device="cuda"))


# --- 4. threads ----------------------------------------------------------------------------------
def threaded_step(x, n):
    y = torch.empty_like(x)
    scaled(x, y, 0.5)
    fill_first(y, n)
    return y.cumsum(0)


def test_sessions_in_threads_record_and_replay_concurrently():
    errors = []

    def work(seed):
        try:
            stream = torch.cuda.Stream()
            generator = torch.Generator(device="cuda").manual_seed(seed)
            with torch.cuda.stream(stream), replay.capture() as session:
                step = session.region(threaded_step)
                for i in range(60):
                    x = torch.randn(64 + 32 * (i % 4), device="cuda", generator=generator)
                    differential(step, threaded_step, x, dynamic(i % 50))
            stream.synchronize()
        except BaseException as exc:  # reported below
            errors.append(exc)

    # A kernel's first launch loads its module, which breaks a capture under way in another
    # thread (docs/replay.md, "Streams and threads"): load them once before the threads start.
    threaded_step(torch.randn(64, device="cuda"), 3)
    same(torch.zeros(2, device="cuda"), torch.zeros(2, device="cuda"))
    torch.cuda.synchronize()
    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, "".join("".join(traceback.format_exception(e)) for e in errors)


# --- 6. pointer offsets from dynamic scalars ----------------------------------------------------
def kv_write(x, cache, pos):
    write_row(x, cache, pos)
    return cache


def test_pointer_offsets_from_dynamic_scalars_follow_the_scalar():
    cache = torch.randn(16, 64, device="cuda")
    with replay.capture() as session:
        step = session.region(kv_write)
        for pos in [3, 3, 0, 15, 7, 7, 1]:
            differential(step, kv_write, torch.randn(64, device="cuda"), cache, dynamic(pos))
        with pytest.raises(IndexError):
            step(torch.randn(64, device="cuda"), cache, dynamic(16))
        differential(step, kv_write, torch.randn(64, device="cuda"), cache, dynamic(-1))
        assert session.stats().replays >= 5


# --- 7. outputs held across other graphs' replays -----------------------------------------------
def encoder(x):
    h = torch.empty_like(x)
    scaled(x, h, 3.0)
    return h * 2


def decoder(y, memory):
    scratch = torch.empty_like(y)
    scaled(y, scratch, 0.25)
    big = torch.empty(8 * y.numel(), device="cuda")
    big.fill_(7.0)
    return scratch + memory + big[: y.numel()]


def test_outputs_survive_any_other_graphs_replays():
    with replay.capture() as session:
        dec = session.region(decoder)
        enc = session.region(encoder)
        for _ in range(3):  # the decoder's graph is recorded first: its scratch is in the pool
            dec(torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda"))
        for _ in range(3):
            x = torch.randn(4096, device="cuda")
            memory = enc(x)
            kept = memory.clone()
            for _ in range(5):
                y = torch.randn(4096, device="cuda")
                assert same(dec(y, memory), decoder(y, kept))
                assert same(memory, kept), "another graph's replay overwrote a held output"


# --- 8. global torch modes ----------------------------------------------------------------------
def matmul_region(a, b):
    return a @ b


def test_torch_modes_select_their_own_graph():
    with replay.capture() as session:
        step = session.region(matmul_region)
        for _ in range(3):
            differential(step, matmul_region, torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda"))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(3):
                got = differential(
                    step, matmul_region, torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
                )
                assert got.dtype == torch.bfloat16
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = not previous
        try:
            for _ in range(3):
                differential(
                    step, matmul_region, torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
                )
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
        with torch.no_grad():
            for _ in range(3):
                differential(
                    step, matmul_region, torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
                )


# --- 9. returned containers ----------------------------------------------------------------------
def as_dict(x):
    y = torch.empty_like(x)
    scaled(x, y, 2.0)
    return {"y": y, "extra": [x.numel()]}


def test_returned_containers_are_fresh_each_call():
    with replay.capture() as session:
        step = session.region(as_dict)
        for _ in range(4):
            x = torch.randn(32, device="cuda")
            out = step(x)
            assert same(out["y"], x * 2)
            out["y"] = out["y"] * 0
            out["extra"].append("edited")
        x = torch.randn(32, device="cuda")
        again = step(x)
        assert same(again["y"], x * 2) and again["extra"] == [32]


# --- 10. an interrupted replay -------------------------------------------------------------------
def int_store(y, v):
    store_int(y, v)
    return y


def test_a_value_that_does_not_fit_is_refused_and_the_graph_stays_exact():
    y = torch.zeros(1, device="cuda")
    with replay.capture() as session:
        step = session.region(int_store)
        for v in [1, 2, 3]:
            step(y, dynamic(v))
            assert y.item() == v
        with pytest.raises(ArgumentError):
            step(y, dynamic(2**40))
        step(y, dynamic(3))  # the value the graph held before the refused call
        assert y.item() == 3
        step(y, dynamic(-7))
        assert y.item() == -7


# --- 11. kernels whose parameters cannot be read ------------------------------------------------
def torch_and_jit(x, w):
    h = torch.empty_like(x)
    scaled(x, h, 2.0)
    return h + w


def test_kernels_of_unknown_parameters_stage_every_input(monkeypatch):
    from jitcore.backends import get_backend

    backend = get_backend()
    monkeypatch.setattr(type(backend), "kernel_param_sizes", lambda self, function: None)
    with replay.capture() as session:
        step = session.region(torch_and_jit)
        for _ in range(6):
            differential(step, torch_and_jit, torch.randn(100, device="cuda"), torch.randn(100, device="cuda"))
        choices = {c.input: c.choice for c in session.stats().inputs}
    assert set(choices.values()) <= {"staged", "staged+copied back"}, choices


# --- 14. byte-identical launches -----------------------------------------------------------------
def twins(x, s):
    a = torch.empty_like(x)
    scaled(x, a, s)  # s is dynamic
    b = a * 1  # a torch op reads the first result
    scaled(x, a, 2.0)  # the very same parameter bytes while s == 2.0
    return b, a


def test_launches_with_equal_bytes_are_told_apart():
    with replay.capture() as session:
        step = session.region(twins)
        x = torch.randn(64, device="cuda")
        for s in [2.0, 2.0, 3.0, -1.0, 2.0, 0.5]:
            b, a = step(x, dynamic(s))
            assert same(b, x * s) and same(a, x * 2.0)
        assert session.stats().replays >= 4


# --- host tensors (staged through pinned buffers) and other outputs ------------------------------
def with_host_tensor(x, host):
    y = torch.empty_like(x)
    scaled(x, y, 2.0)
    return y + host.to("cuda", non_blocking=True)


def with_blocking_host_copy(x, host):
    y = torch.empty_like(x)
    scaled(x, y, 2.0)
    device = torch.empty(host.shape, dtype=host.dtype, device="cuda")
    device.copy_(host)  # non_blocking=False
    return y + host.to("cuda") * device  # .to() blocking too


def host_differential(step, fn, calls, make_host, *, poison=True, pinned=False):
    """``calls`` calls with fresh device and host inputs, each against eager; the returned
    output (the graph's own buffer once replayed) is poisoned after each comparison, so a
    replay that skipped writing it would be caught."""
    for _ in range(calls):
        host = make_host()
        if pinned:
            host = host.pin_memory()
        got = differential(step, fn, torch.randn(*host.shape, device="cuda"), host)
        if poison:
            got.fill_(float("nan"))


def test_host_tensor_arguments_are_staged_through_a_pinned_buffer_and_replayed():
    with warnings.catch_warnings():
        warnings.simplefilter("error", replay.ReplayWarning)
        with replay.capture() as session:
            step = session.region(with_host_tensor)
            host_differential(step, with_host_tensor, 12, lambda: torch.randn(16))
            stats = session.stats()
    assert stats.replays >= 10 and stats.eager_only_keys == 0
    assert {c.input: c.choice for c in stats.inputs}["args[1]"] == "staged"


def pins_then_copies(x, host):
    return x + host.pin_memory().to("cuda", non_blocking=True)  # pinning the pinned buffer: itself


def test_pinned_host_tensors_from_the_caller_are_replayed_too():
    with warnings.catch_warnings():
        warnings.simplefilter("error", replay.ReplayWarning)
        with replay.capture() as session:
            step = session.region(with_host_tensor)
            host_differential(step, with_host_tensor, 6, lambda: torch.randn(16), pinned=True)
            host_differential(step, with_host_tensor, 6, lambda: torch.randn(16))  # the same key, unpinned
            assert session.stats().replays >= 9
            pinning = session.region(pins_then_copies)
            host_differential(pinning, pins_then_copies, 6, lambda: torch.randn(16))
            assert session.stats().replays >= 13


def test_blocking_host_copies_inside_a_region_are_replayed_exactly():
    """torch's blocking copy synchronizes the stream, which a capture cannot; replay captures
    copies from a host buffer as non-blocking (exact: the host waits for the launch before
    writing the buffer again)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", replay.ReplayWarning)
        with replay.capture() as session:
            step = session.region(with_blocking_host_copy)
            host_differential(step, with_blocking_host_copy, 10, lambda: torch.randn(64))
            assert session.stats().replays >= 8


def test_torch_itself_cannot_capture_a_blocking_host_copy():
    """What the rewrite above is for: torch's blocking copy synchronizes the capturing stream
    (``memcpy_and_sync``), which fails the capture. If torch learns to capture it, this fails:
    then the rewrite can go."""
    host = torch.randn(64).pin_memory()
    device = torch.cuda.current_device()
    pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            with pytest.raises(RuntimeError):
                host.to("cuda", non_blocking=False)
        finally:
            recording._end_capture_after_error(graph, device, pool)  # no capture left running
    torch.cuda.synchronize()
    torch.rand(4, device="cuda")  # the generator is not left capturing


SCALE = torch.tensor(2.0)  # a CPU tensor a region reaches by name (as a module's plain tensor attribute)


class Temperature(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.temperature = torch.tensor(0.5)  # not a buffer: .cuda() leaves it on the CPU

    def forward(self, logits):
        return logits / self.temperature


def scaled_by_a_cpu_global(x):
    return x * SCALE, SCALE.item()


def test_a_cpu_tensor_the_region_reaches_by_name_is_never_baked_into_a_graph():
    """A torch op reading a CPU tensor on the CPU (a 0-dim one as a scalar, ``.item()``) reads
    it once, at the capture: the graph would keep the value, and the watch never sees an
    in-place write. Such a key runs eagerly, with one warning, and every call is exact."""
    module = Temperature().cuda()
    x = torch.randn(8, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replay.capture() as session:
            step, sampler = session.region(scaled_by_a_cpu_global), session.region(module)
            for value in (2.0, 2.0, 2.0, 3.0, 3.0, 5.0):
                SCALE.fill_(value)
                module.temperature.fill_(value / 4)
                out, item = step(x)
                assert torch.equal(out, x * value) and item == value
                assert torch.equal(sampler(x), x / (value / 4))
            stats = session.stats()
    SCALE.fill_(2.0)
    assert stats.replays == 0 and stats.eager_only_keys == 2
    assert any("reaches by name" in str(w.message) for w in caught)


PINNED: list = []  # a pinned CPU tensor a region reaches by name (made where CUDA is)


def adds_a_pinned_global(x):
    return x + PINNED[0].to("cuda", non_blocking=True)


def test_a_pinned_cpu_tensor_the_region_copies_non_blocking_is_read_live_by_every_replay():
    PINNED[:] = [torch.zeros(8).pin_memory()]
    x = torch.randn(8, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error", replay.ReplayWarning)
        with replay.capture() as session:
            step = session.region(adds_a_pinned_global)
            for value in range(6):
                torch.cuda.synchronize()  # as eagerly: the copy reads the memory when it runs
                PINNED[0].fill_(float(value))
                assert torch.equal(step(x), x + value)
            assert session.stats().replays >= 3
    PINNED.clear()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float16, torch.bool])
def test_host_tensors_of_every_dtype_are_replayed_bit_for_bit(dtype):
    def region(x, host):
        device = host.to("cuda", non_blocking=True)
        y = torch.empty_like(x)
        scaled(x, y, 3.0)
        return y, device, device.to(torch.float32) * y

    def make():
        if dtype is torch.bool:
            return torch.rand(8, 32) > 0.5
        if dtype.is_floating_point:
            return torch.randn(8, 32).to(dtype)
        return torch.randint(-(2**30), 2**30, (8, 32)).to(dtype)

    with warnings.catch_warnings():
        warnings.simplefilter("error", replay.ReplayWarning)
        with replay.capture() as session:
            step = session.region(region)
            for _ in range(8):
                host = make()
                got = differential(step, region, torch.randn(8, 32, device="cuda"), host)
                for tensor in got:
                    tensor.zero_()  # poisoned: the next replay must write them all again
            assert session.stats().replays >= 6


def test_a_transposed_host_tensor_is_replayed_one_with_gaps_runs_eagerly():
    def region(x, host):
        return x + host.to("cuda", non_blocking=True)

    with warnings.catch_warnings():
        warnings.simplefilter("error", replay.ReplayWarning)
        with replay.capture() as session:
            step = session.region(region)
            for _ in range(6):
                differential(step, region, torch.randn(32, 16, device="cuda"), torch.randn(16, 32).t())
            assert session.stats().replays >= 4
    with replay.capture() as session:
        step = session.region(region)
        with pytest.warns(replay.ReplayWarning, match="converts its dtype or layout"):
            for _ in range(6):
                differential(step, region, torch.randn(16, 16, device="cuda"), torch.randn(16, 32)[:, ::2])
        assert session.stats().replays == 0


def uses_first_id_as_a_scale(x, host):
    y = torch.empty_like(x)
    scaled(x, y, float(host[0]))  # read on the CPU: would be baked
    return y


def sums_on_the_cpu(x, host):
    return x * host.sum().to("cuda")


def branches_on_the_cpu(x, host):
    return x + 1 if host.any() else x - 1


def uses_item(x, host):
    y = torch.empty_like(x)
    store_int(y, int(host[1].item()))
    return y


def writes_its_host_argument(x, host):
    y = torch.empty_like(x)
    scaled(x, y, 2.0)
    host.copy_(y, non_blocking=True)  # a copy into the host tensor
    return y


@pytest.mark.parametrize(
    "fn, message",
    [
        (uses_first_id_as_a_scale, "reads host input args\\[1\\] on the CPU"),
        (sums_on_the_cpu, "reads host input"),
        (branches_on_the_cpu, "reads host input"),
        (uses_item, "reads host input"),
        (writes_its_host_argument, "writes host input"),
    ],
)
def test_host_values_read_or_written_on_the_cpu_make_the_key_eager_only(fn, message):
    with replay.capture() as session:
        step = session.region(fn)
        with pytest.warns(replay.ReplayWarning, match=message):
            for number in range(6):
                host = torch.randint(0, 5, (16,)).to(torch.float32)
                host[0] = number  # another scale, branch, sum, stored value each call
                if fn is writes_its_host_argument:
                    x = torch.randn(16, device="cuda")
                    expected = fn(x.clone(), host.clone())
                    got = step(x, host)
                    torch.cuda.synchronize()  # the eager run's non-blocking copy into the host
                    assert same(got, expected) and same(host, expected.cpu())
                else:
                    differential(step, fn, torch.randn(16, device="cuda"), host)
        stats = session.stats()
        assert stats.replays == 0 and stats.eager_only_keys == 1


def reads_host_through_numpy(x, host):
    y = torch.empty_like(x)
    scaled(x, y, float(host.numpy()[0]))  # .numpy() bypasses torch's dispatcher: not seen
    return y


def test_verify_every_catches_a_host_read_the_observer_cannot_see():
    with replay.capture(verify_every=1) as session:
        step = session.region(reads_host_through_numpy)
        with pytest.raises(replay.ReplayMismatchError):
            for number in range(8):
                step(torch.randn(16, device="cuda"), torch.full((4,), float(number + 1)))
        assert session.stats().verifications >= 1


def test_host_arguments_that_alias_each_other_are_replayed_exactly():
    def region(x, a, b):
        return x + a.to("cuda", non_blocking=True) * 2 - b.to("cuda", non_blocking=True)

    with warnings.catch_warnings():
        warnings.simplefilter("error", replay.ReplayWarning)
        with replay.capture() as session:
            step = session.region(region)
            for _ in range(5):  # the same tensor twice
                ids = torch.randn(16)
                differential(step, region, torch.randn(16, device="cuda"), ids, ids)
            for _ in range(5):  # overlapping views
                base = torch.randn(24)
                differential(step, region, torch.randn(16, device="cuda"), base[:16], base[8:])
            for _ in range(5):  # apart
                differential(step, region, torch.randn(16, device="cuda"), torch.randn(16), torch.randn(16))
            assert session.stats().replays >= 9


SPIN = r"""
__global__ void spin(float* y, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
    y[threadIdx.x] += 1.f;
}
"""
spin_kernel = jc.Kernel(SPIN, "spin")


@jc.jit
def spin(y, cycles):
    spin_kernel[1, 32](y, cycles)


def slow_then_host(x, host):
    y = x.clone()
    spin(y, 20_000_000)  # about 10 ms before the graph copies the host buffer
    return y + host.to("cuda", non_blocking=True)


def test_the_host_never_overwrites_a_buffer_a_launch_still_reads():
    """Replays enqueued back to back without a synchronize: each launch must copy its own
    call's host values, though the host is already filling the buffer for the next."""
    with replay.capture() as session:
        step = session.region(slow_then_host)
        x = torch.zeros(32, device="cuda")
        for _ in range(3):
            step(x, torch.randn(32))
        hosts = [torch.full((32,), float(n)) for n in range(8)]
        got = [step(x, h).clone() for h in hosts]  # no synchronize in between
        torch.cuda.synchronize()
        assert all(same(g, slow_then_host(x, h)) for g, h in zip(got, hosts))
        assert session.stats().replays >= 9


def test_a_nested_tensor_after_a_replayed_key_is_refused_cleanly():
    """A strided nested tensor's ``.shape`` raises torch's internal error; the replay fast
    path and the admission count must leave it to the key, which refuses it."""
    with replay.capture() as session:
        step = session.region(torch_and_jit)
        for _ in range(4):
            differential(step, torch_and_jit, torch.randn(100, device="cuda"), torch.randn(100, device="cuda"))
        assert session.stats().replays >= 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch: nested tensors are a prototype
            nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], device="cuda")
        with pytest.raises(jc.UnsupportedTensorError):
            step(nested, torch.randn(100, device="cuda"))
        differential(step, torch_and_jit, torch.randn(100, device="cuda"), torch.randn(100, device="cuda"))


@dataclasses.dataclass(frozen=True)
class Result:
    y: torch.Tensor
    n: int


def returns_dataclass(x):
    y = torch.empty_like(x)
    scaled(x, y, 3.0)
    return Result(y, 7)


def test_dataclass_outputs_carry_the_new_outputs():
    with replay.capture() as session:
        step = session.region(returns_dataclass)
        for _ in range(4):
            x = torch.randn(32, device="cuda")
            out = step(x)
            assert isinstance(out, Result) and same(out.y, x * 3.0) and out.n == 7
        assert session.stats().replays >= 2


def recurrent(h, x):
    y = torch.empty_like(h)
    scaled(h, y, 0.5)
    return y + x


def test_an_output_fed_back_into_its_own_graph_runs_eagerly():
    with replay.capture() as session:
        step = session.region(recurrent)
        h = torch.randn(128, device="cuda")
        for _ in range(8):
            x = torch.randn(128, device="cuda")
            h = differential(step, recurrent, h, x)
        assert session.stats().declined >= 1


# --- a global tensor that holds an argument -------------------------------------------------------
def _rows_then_global(cache):
    def step(row, x):
        add_one(x, row)  # writes the argument: a row of the global
        out = torch.empty(cache.numel(), device="cuda")
        scaled(cache.view(-1), out, 2.0)  # reads the whole global: its pointer is row 0's address
        return out

    return step


def _rows_then_torch_reads_global(cache):
    def step(row, x):
        add_one(x, row)  # writes the argument: a row of the global
        return cache.sum(0)  # a torch op reading the whole global, the argument's row included

    return step


@pytest.mark.parametrize("region", [_rows_then_global, _rows_then_torch_reads_global])
def test_a_global_that_holds_the_argument_stays_where_it_is(region):
    """Recorded with row = cache[0], the global's pointer equals the argument's; bound by address
    it would follow the argument to cache[i] on replay (reading past the end), and staged, the
    argument would be parted from the global a torch op reads. The tensor the kernel or op got
    reaches beyond the input, so the key is refused loudly and runs eagerly: exact."""
    initial = torch.randn(4, 256, device="cuda")
    eager_cache, replay_cache = initial.clone(), initial.clone()
    eager_step = region(eager_cache)
    with replay.capture() as session:
        step = session.region(region(replay_cache))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", replay.ReplayWarning)
            for i in [0, 0, 0, 2, 3, 0, 1]:
                x = torch.randn(256, device="cuda")
                expected = eager_step(eager_cache[i], x.clone())
                got = step(replay_cache[i], x)
                assert same(got, expected) and same(replay_cache, eager_cache), i
        # (staged, the argument is refused as one the region reaches through another tensor)
        # (or, before either, as an argument whose memory another tensor held when the call began)
        refusals = ("reaches beyond it", "through another tensor", "another tensor held the argument's memory")
        assert any(r in str(w.message) for w in caught for r in refusals), [str(w.message) for w in caught]


# --- torch ops touching the inputs, whichever call of the key records ---------------------------
def _torch_writes_then_kernel_reads(x, y):
    x.mul_(2)  # a torch op writes the input in place: replay must copy it back to the caller's x
    add_one(x, y)
    return y


def _kernel_writes_then_torch_reads(x, y):
    add_one(x, y)
    return y.sum() + x.amax()  # torch ops read both inputs after a kernel wrote one


def _torch_writes_a_view_of_the_input(x, y):
    x[1:].copy_(y[:-1])  # written through a view: the input's own range, written
    add_one(x, y)
    return x.clone()


def _torch_out_into_the_input(x, y):
    torch.add(x, y, out=y)  # an out= argument is written
    add_one(y, x)
    return x


@pytest.mark.parametrize("record_after", [0, 1, 2])
@pytest.mark.parametrize(
    "region",
    [
        _torch_writes_then_kernel_reads,
        _kernel_writes_then_torch_reads,
        _torch_writes_a_view_of_the_input,
        _torch_out_into_the_input,
    ],
)
def test_torch_ops_on_the_inputs_are_exact_whichever_call_records(region, record_after):
    """The recording call's torch ops decide what is staged and copied back: with no eager
    call before it (``record_after=0``) only the capture's own observation says which inputs
    torch ops read and write (asked before the capture ends), with one it is the warm-up's too.
    Every call, eager, recording or replayed, equals eager on fresh data."""
    with replay.capture(record_after=record_after) as session:
        step = session.region(region)
        for _ in range(record_after + 4):
            differential(step, region, torch.randn(256, device="cuda"), torch.randn(256, device="cuda"))
        assert session.stats().replays >= 1


# --- an argument that is a view of memory the graph reaches at a fixed address ------------------
def _called_alike(step, eager_step, arguments, label) -> None:
    """One call of the region and one of eager, on the same fresh ``x``: ``arguments`` is the
    pair (the region's, eager's) of a global's rows or the global itself, or None for a
    tensor of its own (fresh, and equal after the calls as before)."""
    x = torch.randn(256, device="cuda")
    if arguments is None:
        mine = torch.randn(256, device="cuda")
        arguments = (mine, mine.clone())
    expected, got = eager_step(arguments[1], x.clone()), step(arguments[0], x)
    assert same(arguments[0], arguments[1]), label
    assert same(got, expected), label


def _torch_writes_the_argument_torch_reads_the_global(cache):
    def step(row, x):
        row.add_(x)  # staged (a torch op writes it), copied back after the graph
        return cache.sum(0)  # reads the global at its address: row's new values, eagerly

    return step


def _torch_reads_the_argument_a_kernel_writes_it_torch_reads_the_global(cache):
    def step(row, x):
        doubled = row * 2  # staged: a torch op reads it
        add_one(x, row)  # writes the staged copy
        return doubled, cache.sum(0)

    return step


def _a_kernel_writes_the_global_torch_reads_the_argument(cache):
    def step(row, x):
        add_one(x, cache[0])  # the global's first row, at its address
        return row * 2  # staged: eagerly, row 0's new values when row is cache[0]

    return step


def _torch_writes_the_argument_torch_reads_a_row_of_the_global(cache):
    def step(row, x):
        row.add_(x)
        return cache[0] * 3  # exactly the argument's bytes when row is cache[0]

    return step


def _a_kernel_writes_the_argument_a_kernel_reads_the_global(cache):
    def step(row, x):  # nothing staged: the argument is rebound, the global read where it is
        add_one(x, row)
        out = torch.empty(cache.numel(), device="cuda")
        add_one(cache.view(-1), out)
        return out

    return step


def _kernels_write_rows_of_the_global(cache):
    def step(row, x):  # the argument is untouched; rows of the global, by name, at their address
        add_one(x, cache[1])
        add_one(x, cache[0])
        return x.clone()

    return step


def _a_kernel_reads_the_argument_and_writes_a_row_of_the_global(cache):
    def step(row, x):  # recorded with row = cache[0], both pointers are one address
        y = torch.empty(256, device="cuda")
        add_one(row, y)
        add_one(x, cache[0])
        return y

    return step


@pytest.mark.parametrize("record_after", [0, 1])
@pytest.mark.parametrize("rows_first", [False, True], ids=["tensors_first", "rows_first"])
@pytest.mark.parametrize(
    "region",
    [
        _torch_writes_the_argument_torch_reads_the_global,
        _torch_reads_the_argument_a_kernel_writes_it_torch_reads_the_global,
        _a_kernel_writes_the_global_torch_reads_the_argument,
        _torch_writes_the_argument_torch_reads_a_row_of_the_global,
        _a_kernel_writes_the_argument_a_kernel_reads_the_global,
        _kernels_write_rows_of_the_global,
        _a_kernel_reads_the_argument_and_writes_a_row_of_the_global,
    ],
)
def test_an_argument_inside_memory_the_graph_reaches_otherwise_is_exact(region, rows_first, record_after):
    """The same key (shapes alone) called with tensors of their own and with rows of a global
    the region also reaches (a torch op or a kernel reads or writes ``cache`` at its address),
    in either order, so the graph is recorded with one and replayed with the other. A staged
    argument copied apart from that memory would part what eagerly is one: the capture refuses
    it (recorded with a row) or the replay declines the call (recorded apart). Every call is
    exact, and so is the global after it."""
    initial = torch.randn(4, 256, device="cuda")
    eager_cache, replay_cache = initial.clone(), initial.clone()
    eager_step, replay_region = region(eager_cache), region(replay_cache)
    own = [("own", None)] * 4
    rows = [("row", i) for i in (0, 1, 0, 3, 2, 0)]
    with replay.capture(record_after=record_after) as session, warnings.catch_warnings():
        warnings.simplefilter("ignore", replay.ReplayWarning)
        step = session.region(replay_region)
        for number, (kind, i) in enumerate(rows + own if rows_first else own + rows):
            rows_of = None if kind == "own" else (replay_cache[i], eager_cache[i])
            _called_alike(step, eager_step, rows_of, (number, kind, i))
            assert same(replay_cache, eager_cache), (number, kind, i)


def _a_kernel_on_views_the_region_makes(x, y):
    add_one(x[1:], y[:-1])  # views of both arguments, made inside the region
    return y * 1


@pytest.mark.parametrize("record_after", [0, 1])
def test_an_argument_viewing_a_tensor_the_caller_keeps_replays_staged(record_after):
    """The argument is a row of a buffer the caller keeps (another holder of its memory), and
    the region hands a kernel a view it makes of the row: the view's pointer cannot be told
    from one another holder gave, so the row is staged (the region's views then point into
    the graph's buffer) and the key replays, exact for every row and every buffer after."""
    buffer = torch.randn(6, 256, device="cuda")
    reference = buffer.clone()
    with replay.capture(record_after=record_after) as session, warnings.catch_warnings():
        warnings.simplefilter("error", replay.ReplayWarning)  # nothing refused
        step = session.region(_a_kernel_on_views_the_region_makes)
        for number, row in enumerate([0, 3, 1, 5, 2, 4, 0, 3]):
            y = torch.randn(256, device="cuda")
            y_reference = y.clone()
            expected = _a_kernel_on_views_the_region_makes(reference[row], y_reference)
            got = step(buffer[row], y)
            assert same(got, expected) and same(y, y_reference), number
            assert same(buffer, reference), number
        stats = session.stats()
    assert stats.replays >= 4, session.report()
    assert {c.input: c.choice for c in stats.inputs}["args[0]"] == "staged", stats.inputs


# --- the global itself as the argument -------------------------------------------------------
def _writes_the_global_reads_the_argument(table):
    def step(t, x):
        add_one(x, table)  # the global, by name: it stays where it is
        y = torch.empty(256, device="cuda")
        add_one(t, y)  # the argument: it moves
        return y

    return step


def _reads_the_argument_writes_the_global(table):
    def step(t, x):
        y = torch.empty(256, device="cuda")
        add_one(t, y)
        add_one(x, table)
        add_one(table, x)  # reads the global after writing it: x is the global plus two
        return y, x.clone()

    return step


@pytest.mark.parametrize("record_after", [0, 1])
@pytest.mark.parametrize("region", [_writes_the_global_reads_the_argument, _reads_the_argument_writes_the_global])
def test_the_very_tensor_a_global_holds_as_the_argument_is_exact(region, record_after):
    """Called first with the global tensor itself, then with tensors of their own, then with
    the global again: recorded with the global, every pointer into it came from the argument
    and the global alike (one object), so the key is refused; recorded with a tensor of its
    own, the replay is exact for the global too (its addresses are the ones eager uses)."""
    initial = torch.randn(256, device="cuda")
    eager_table, replay_table = initial.clone(), initial.clone()
    eager_step, replay_region = region(eager_table), region(replay_table)
    with replay.capture(record_after=record_after) as session, warnings.catch_warnings():
        warnings.simplefilter("ignore", replay.ReplayWarning)
        step = session.region(replay_region)
        for number, kind in enumerate(["global"] * 3 + ["own"] * 3 + ["global", "own"]):
            _called_alike(step, eager_step, None if kind == "own" else (replay_table, eager_table), (number, kind))
            assert same(replay_table, eager_table), (number, kind)
    with replay.capture(record_after=record_after) as session, warnings.catch_warnings():
        warnings.simplefilter("ignore", replay.ReplayWarning)
        step = session.region(replay_region)  # tensors of their own first: replays
        for number, kind in enumerate(["own"] * 3 + ["global"] * 2 + ["own"]):
            _called_alike(step, eager_step, None if kind == "own" else (replay_table, eager_table), (number, kind))
            assert same(replay_table, eager_table), (number, kind)
        assert session.stats().replays >= 1


#: A global the next test's region reads: a table, then more values than replay looks through.
_WIDE_TABLES: list = []


def _writes_the_wide_tables_first(t, x):
    add_one(x, _WIDE_TABLES[0])
    y = torch.empty(256, device="cuda")
    add_one(t, y)
    return y


def test_a_region_reading_more_by_name_than_replay_looks_through_refuses_its_captures():
    """The table the region writes through a global list sits where the search of what the
    region reads by name, cut short by its bound, does not reach. Passed as the argument too,
    it would be recorded as the argument alone (the stop 38 hazard: later calls' writes moved
    into their arguments). Every argument is in doubt then, so every capture is refused with a
    warning, and every call, the table itself or a tensor of its own, is eager's."""
    table = torch.randn(256, device="cuda")
    _WIDE_TABLES[:] = [table, *range(drift._TENSOR_SEARCH_LIMIT)]
    try:
        with replay.capture(record_after=0) as session:
            step = session.region(_writes_the_wide_tables_first)
            with pytest.warns(replay.ReplayWarning, match="more values by name"):
                for number, kind in enumerate(["global", "own", "global", "own", "own"]):
                    t = table if kind == "global" else torch.randn(256, device="cuda")
                    x = torch.randn(256, device="cuda")
                    expected = (x + 1 if kind == "global" else t) + 1
                    out = step(t, x)
                    assert torch.equal(table, x + 1) and torch.equal(out, expected), (number, kind)
            assert session.stats().replays == 0
    finally:
        _WIDE_TABLES[:] = []


class _TableModule(torch.nn.Module):
    """A module whose forward writes its own buffer by attribute and reads its argument."""

    def __init__(self, initial: torch.Tensor):
        super().__init__()
        self.register_buffer("table", initial.clone())

    def forward(self, t, x):
        add_one(x, self.table)
        y = torch.empty(256, device="cuda")
        add_one(t, y)
        return y


@pytest.mark.parametrize("record_after", [0, 1])
def test_a_module_buffer_passed_as_the_argument_is_exact(record_after):
    """The buffer a module's forward writes by attribute, passed as the argument too (as a
    KV cache held by the model and handed to its step): recorded so, the key is refused (the
    buffer is among the module's tensors); tensors of their own replay, and the buffer stays
    equal to eager's throughout."""
    initial = torch.randn(256, device="cuda")
    eager, mine = _TableModule(initial), _TableModule(initial)
    for order in (["buffer"] * 3 + ["own"] * 3 + ["buffer", "own"], ["own"] * 3 + ["buffer"] * 2 + ["own"]):
        with replay.capture(record_after=record_after) as session, warnings.catch_warnings():
            warnings.simplefilter("ignore", replay.ReplayWarning)
            step = session.region(mine)
            for number, kind in enumerate(order):
                _called_alike(step, eager, None if kind == "own" else (mine.table, eager.table), (number, kind))
                assert same(mine.table, eager.table), (number, kind)
            if order[0] == "own":  # recorded with a tensor of its own: replays
                assert session.stats().replays >= 1


# --- random regions over an argument and a global that may hold it -----------------------------
def _random_region(rng, cache):
    """A region ``step(row, x)`` of 2 to 4 steps drawn from what a torch op or a kernel can do
    with the argument ``row`` and a global ``cache`` ([4, 256]) that a call may pass a row of:
    read or write the argument, read the whole global or one of its rows, write one of its
    rows. Returns (step, description)."""
    steps = []

    def torch_reads_argument(row, x, out):
        out.append(row * 2)

    def torch_writes_argument(row, x, out):
        row.add_(x)

    def kernel_reads_argument(row, x, out):
        y = torch.empty(256, device="cuda")
        add_one(row, y)
        out.append(y)

    def kernel_writes_argument(row, x, out):
        add_one(x, row)

    def torch_reads_global(row, x, out):
        out.append(cache.sum(0))

    def kernel_reads_global(row, x, out):
        y = torch.empty(cache.numel(), device="cuda")
        add_one(cache.view(-1), y)
        out.append(y)

    def torch_reads_a_row(k):
        def read(row, x, out):
            out.append(cache[k] * 3)

        return read

    def torch_writes_a_row(k):
        def write(row, x, out):
            cache[k].mul_(0.5)

        return write

    def kernel_writes_a_row(k):
        def write(row, x, out):
            add_one(x, cache[k])

        return write

    fixed = [
        torch_reads_argument,
        torch_writes_argument,
        kernel_reads_argument,
        kernel_writes_argument,
        torch_reads_global,
        kernel_reads_global,
    ]
    rowed = [torch_reads_a_row, torch_writes_a_row, kernel_writes_a_row]
    names = []
    for _ in range(rng.randint(2, 4)):
        if rng.random() < 0.6:
            chosen = rng.choice(fixed)
            steps.append(chosen)
            names.append(chosen.__name__)
        else:
            make, k = rng.choice(rowed), rng.randrange(4)
            steps.append(make(k))
            names.append(f"{make.__name__}({k})")

    def step(row, x):
        out = []
        for each in steps:
            each(row, x, out)
        return tuple(out)

    return step, " -> ".join(names)


@pytest.mark.parametrize("seed", range(12))
def test_random_regions_over_an_argument_and_a_global_that_may_hold_it(seed):
    """The class of the two tests above, drawn at random: each call passes a tensor of its
    own or a row of the global, in a random order, so graphs are recorded with either and
    replayed with the other. Every call is exact (replayed, declined or refused: eager), and
    so are the argument and the global after it."""
    import random

    rng = random.Random(seed)
    for number in range(4):
        initial = torch.randn(4, 256, device="cuda")
        eager_cache, replay_cache = initial.clone(), initial.clone()
        eager_step, shown = _random_region(random.Random(f"{seed}-{number}"), eager_cache)
        replay_region, _ = _random_region(random.Random(f"{seed}-{number}"), replay_cache)
        with replay.capture(record_after=rng.choice((0, 1))) as session, warnings.catch_warnings():
            warnings.simplefilter("ignore", replay.ReplayWarning)
            step = session.region(replay_region)
            for call in range(10):
                k = rng.randrange(5)  # 4: a tensor of its own
                _called_alike(step, eager_step, None if k == 4 else (replay_cache[k], eager_cache[k]), (shown, call, k))
                assert same(replay_cache, eager_cache), (shown, call, k)


# --- outputs after they are handed out: their objects, their metadata, their memory -------------
def alike(got, expected, arguments, copies) -> None:
    """``got`` (a replayed call's outputs) is what eager gave (``expected``, from the same
    region on ``copies`` of ``arguments``): the same values and layouts, the same objects where
    eager returned an argument itself or one object twice, views where eager's are views."""
    assert len(got) == len(expected)
    for i, (out, want) in enumerate(zip(got, expected)):
        assert same(out, want) and out.stride() == want.stride(), f"output {i}"
        assert out.storage_offset() == want.storage_offset() and (out._base is None) == (want._base is None), i
        for arg, copy in zip(arguments, copies):
            assert (out is arg) == (want is copy), f"output {i}: the argument itself, or not, as eagerly"
        for j in range(i):
            assert (out is got[j]) == (want is expected[j]), f"outputs {j} and {i}: one object, or not"


def poison(outputs, keep=()) -> None:
    """NaN into every float output that is not one of ``keep`` (the caller's own tensors)."""
    for out in outputs:
        if out.is_floating_point() and not any(out is k for k in keep) and out._base is None:
            out.fill_(float("nan"))


def whole_views(x, y):
    add_one(x, y)  # y = x + 1 (jit), in place into the argument
    return x.view(x.shape), x[:], x, y.view(y.shape), y, y


def test_a_view_covering_a_whole_input_is_a_new_view_and_the_input_itself_the_input():
    """``x.view(x.shape)`` and ``x[:]`` are new views at every eager call, ``x`` the caller's
    tensor: a caller changing a view's metadata (``unsqueeze_``, ``t_``) leaves ``x`` alone."""
    with replay.capture() as session:
        step = session.region(whole_views)
        for call in range(8):
            x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 32, device="cuda")
            copies = clone_preserving_sharing([x, y])
            expected = whole_views(*copies)
            got = step(x, y)
            alike(got, expected, [x, y], copies)
            got[0].unsqueeze_(0)
            got[1].t_()
            got[3].as_strided_((4,), (2,))
            assert x.shape == (16, 32) and y.shape == (16, 32) and x.stride() == (32, 1), call
        assert session.stats().replays >= 5, session.report()


_GLOBAL = torch.empty(0)


def views_of_a_global(x):
    y = torch.empty_like(x)
    scaled(x, y, 2.0)
    return y, _GLOBAL[1], _GLOBAL.view(-1), _GLOBAL, _GLOBAL.t()


def test_a_view_of_a_global_is_a_new_view_each_call_and_the_global_itself_the_global():
    """A view the region makes of a global is a new object at every eager call; the global
    itself is the global: what a caller does to one call's view (``unsqueeze_``,
    ``as_strided_``, ``set_``, ``.data =``) shows in no later result, nor in the global."""
    global _GLOBAL
    _GLOBAL = torch.randn(8, 32, device="cuda")
    with replay.capture() as session:
        step = session.region(views_of_a_global)
        changes = [
            lambda t: t.unsqueeze_(0),
            lambda t: t.as_strided_((4,), (2,)),
            lambda t: t.set_(torch.zeros(3, device="cuda")),
            lambda t: setattr(t, "data", torch.zeros(5, device="cuda")),
            lambda t: t.requires_grad_(),
        ]
        for call in range(10):
            x = torch.randn(256, device="cuda")
            copies = clone_preserving_sharing([x])
            expected = views_of_a_global(*copies)
            got = step(x)
            alike(got, expected, [x], copies)
            assert got[3] is _GLOBAL and _GLOBAL.shape == (8, 32) and not _GLOBAL.requires_grad, call
            for out in (got[1], got[2], got[4]):
                changes[call % len(changes)](out)
            poison([got[0]])
        assert session.stats().replays >= 6, session.report()


def scale_region(x):
    y = torch.empty_like(x)
    scaled(x, y, 3.0)
    return y * 2  # a torch op: its output is copied into the region's output slot


def test_outputs_under_no_grad_are_never_inference_tensors_of_an_inference_mode_graph():
    """One region called under inference mode and under no_grad: the graphs share the region's
    output memory, but an inference tensor cannot be saved for backward, where eager's output
    under no_grad can. Each mode's replays hand out tensors of their mode."""
    weight = torch.randn(4096, device="cuda", requires_grad=True)
    with replay.capture() as session:
        step = session.region(scale_region)
        for call in range(12):
            x = torch.randn(4096, device="cuda")
            inference = call % 3 == 0
            with torch.inference_mode() if inference else torch.no_grad():
                out = step(x)
            assert out.is_inference() == inference, call
            assert same(out, scale_region(x)), call
            if not inference:  # as eager's: saved for backward
                weight.grad = None
                (out * weight).sum().backward()
                assert same(weight.grad, out), call
            del out
        assert session.stats().replays >= 6, session.report()


SOURCE_LOGITS = r"""
__global__ void shift(const float* __restrict__ x, float* __restrict__ y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] + 0.5f;
}
"""
shift_kernel = jc.Kernel(SOURCE_LOGITS, "shift")


@jc.jit
def shifted(x, y):
    n = x.numel()
    shift_kernel[jc.cdiv(n, 256), 256](x, y, n)


def shapes_region(x):
    h = x * 2.0  # in the pool, then copied into an output slot
    out = torch.empty_like(h)
    shifted(h, out)
    return out


def _record_two_shapes(step):
    """Each shape recorded, analysed and replayed, every output dropped: they share one slot."""
    for _ in range(3):
        for rows in (64, 48):
            step(torch.randn(rows, 1024, device="cuda"))


@pytest.mark.parametrize("streams", [1, 2])
def test_an_output_read_on_other_streams_is_not_overwritten_before_they_are_done(streams):
    """``out.record_stream(s)``: eagerly the allocator keeps the memory until ``s`` is done with
    it. A slot nobody holds is written by the next replay of any shape, so the replay waits for
    the streams callers read it on: a slow read enqueued on another stream still sees its
    call's values, though the output was dropped and another shape replayed at once."""
    dummy = torch.zeros(32, device="cuda")
    with replay.capture() as session:
        step = session.region(shapes_region)
        _record_two_shapes(step)
        readers = [torch.cuda.Stream() for _ in range(streams)]
        for call in range(4):
            x = torch.randn(64, 1024, device="cuda")
            want = shapes_region(x.clone())
            out = step(x)
            copies = []
            for number, reader in enumerate(readers):
                reader.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(reader):
                    spin(dummy, 20_000_000 // (number + 1))  # about 10 ms before it reads
                    copies.append(out.clone())
                out.record_stream(reader)
            del out  # nobody holds it: the other shape's replay may take its slot
            other = torch.randn(48, 1024, device="cuda")
            again = step(other)
            torch.cuda.synchronize()
            for copy in copies:
                assert same(copy, want), f"call {call}: a stream's read saw another replay's values"
            assert same(again, shapes_region(other)), call
        assert session.stats().replays >= 10, session.report()


@pytest.mark.parametrize("launch_on", ["the default stream", "a side stream"])
def test_each_step_of_waiting_for_an_outputs_reader_holds(launch_on, monkeypatch):
    """The steps the test above rests on, each asserted apart so that a failure names its step:
    the wrapper is installed; the output's memory is a watched lane; record_stream notes the
    reader on that lane's slot; the other shape's replay writes that same slot; it waited once,
    for that reader, on the raw stream it launched on; that handle is the launch stream's own
    torch object (the default stream's handle is 0); the reader saw its call's values."""
    from replay import output_slots

    waits = []
    wait = output_slots.wait_for_readers

    def counted(readers, stream, device):
        waits.append((list(readers), stream))
        wait(readers, stream, device)

    monkeypatch.setattr(output_slots, "wait_for_readers", counted)
    dummy = torch.zeros(32, device="cuda")
    launch = torch.cuda.current_stream() if launch_on == "the default stream" else torch.cuda.Stream()
    reader = torch.cuda.Stream()

    def slot_of(tensor):
        storage = tensor.untyped_storage()
        lane = output_slots.watched_lane(storage.data_ptr(), storage.nbytes())
        return lane.owner() if lane is not None and lane.owner is not None else None

    with torch.cuda.stream(launch), replay.capture() as session:
        step = session.region(shapes_region)
        _record_two_shapes(step)
        for call in range(3):
            x = torch.randn(64, 1024, device="cuda")
            want = shapes_region(x.clone())
            replays = session.stats().replays
            out = step(x)
            assert session.stats().replays == replays + 1, f"call {call}: the 64-row call was not a replay"
            assert torch.Tensor.record_stream is output_slots._record_stream, "no record_stream wrapper"
            slot = slot_of(out)
            assert slot is not None, f"call {call}: the output's memory is no watched lane"
            reader.wait_stream(launch)
            with torch.cuda.stream(reader):
                spin(dummy, 20_000_000)  # about 10 ms before it reads
                copy = out.clone()
            out.record_stream(reader)
            assert slot.readers == [reader], f"call {call}: record_stream noted {slot.readers} on the output's slot"
            del out
            waits.clear()
            other = torch.randn(48, 1024, device="cuda")
            again = step(other)
            assert session.stats().replays == replays + 2, f"call {call}: the 48-row call was not a replay"
            assert slot_of(again) is slot, f"call {call}: the 48-row replay wrote another slot"
            raw = launch.cuda_stream
            assert waits == [([reader], raw)], f"call {call}: waits {waits}, want one for the reader on stream {raw}"
            assert slot.readers == [], f"call {call}: the readers were not forgotten after the wait"
            target = output_slots.torch_stream(raw, torch.cuda.current_device())
            assert target.cuda_stream == raw, f"call {call}: the wait went to stream {target.cuda_stream}, not {raw}"
            torch.cuda.synchronize()
            assert same(copy, want), f"call {call}: the reader saw another replay's values"
            assert same(again, shapes_region(other)), call
            del again


def reads_with_torch(x):
    y = torch.empty_like(x)
    scaled(x * 1.0, y, 2.0)  # a torch op reads x: x is staged into a buffer the graph owns
    return y


def test_a_staged_buffer_freed_by_invalidate_waits_for_the_replay_on_another_stream():
    """``invalidate()`` frees a graph's staged buffers while its last replay, on another stream,
    may not have run yet: the allocator must not hand that memory to a new tensor (whose
    writes the replay's copy into the buffer would then clobber, or read) before it has."""
    import gc

    dummy = torch.zeros(32, device="cuda")
    side = torch.cuda.Stream()
    with replay.capture() as session:
        step = session.region(reads_with_torch)
        for _ in range(5):
            step(torch.randn(1 << 20, device="cuda"))
        assert session.stats().staged_copies >= 1, session.report()
        for attempt in range(3):
            x = torch.randn(1 << 20, device="cuda")
            want = reads_with_torch(x.clone())
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                spin(dummy, 20_000_000)  # the replay waits about 10 ms behind it on the side stream
                out = step(x)
            session.invalidate()
            gc.collect()  # the graph and its staged buffer go now
            junk = [torch.full((1 << 20,), 123.0, device="cuda") for _ in range(8)]
            torch.cuda.synchronize()
            assert same(out, want), attempt
            assert all(bool((j == 123.0).all()) for j in junk), f"attempt {attempt}: a new tensor was written"
            for _ in range(5):  # recorded again for the next attempt
                step(torch.randn(1 << 20, device="cuda"))
        assert session.stats().invalidations == 3 and session.stats().replays >= 9, session.report()


_RESIZES = {
    "resize_ larger": lambda t: t.resize_(1 << 20),
    "resize_ smaller then larger": lambda t: (t.resize_(1), t.resize_(1 << 20)),
    "storage resized to 0": lambda t: t.untyped_storage().resize_(0),
    "storage resized to its size": lambda t: t.untyped_storage().resize_(t.untyped_storage().nbytes()),
}


@pytest.mark.parametrize("resize", list(_RESIZES), ids=list(_RESIZES))
def test_a_resized_output_never_has_its_old_memory_written(resize):
    """``out.resize_(n)`` moves the storage ``out`` shares with its output memory, and gives the
    old block back to the allocator: a tensor allocated after it may get that block, and the
    graph's copies must never write it again; the output itself keeps what the caller made of it."""
    with replay.capture() as session:
        step = session.region(shapes_region)
        _record_two_shapes(step)
        for call in range(6):
            rows = (64, 48)[call % 2]
            x = torch.randn(rows, 1024, device="cuda")
            out = step(x)
            assert same(out, shapes_region(x)), call
            _RESIZES[resize](out)
            usable = out.untyped_storage().nbytes() >= out.numel() * 4  # (a storage resized to 0 holds nothing)
            if usable:
                out.fill_(-3.0)
            bystanders = [torch.full((64, 1024), 9.0, device="cuda") for _ in range(4)]  # the old block, likely
            for _ in range(3):
                for rows_again in (64, 48):
                    other = torch.randn(rows_again, 1024, device="cuda")
                    assert same(step(other), shapes_region(other)), call
            torch.cuda.synchronize()
            assert all(bool((b == 9.0).all()) for b in bystanders), f"call {call}: a tensor allocated after was written"
            assert not usable or bool((out == -3.0).all()), f"call {call}: the resized output was written"
        assert session.stats().replays >= 30, session.report()


def test_what_a_caller_does_to_an_output_object_reaches_no_later_result():
    """Every replay hands out new tensor objects over its output memory: changing one's
    metadata (``t_``, ``unsqueeze_``, ``as_strided_``, ``set_``, ``.data =``,
    ``requires_grad_``) changes that object alone; passing one back in runs eagerly."""
    changes = [
        lambda t: t.t_(),
        lambda t: t.unsqueeze_(0),
        lambda t: t.as_strided_((8,), (3,)),
        lambda t: t.set_(torch.zeros(3, device="cuda")),
        lambda t: setattr(t, "data", torch.zeros(5, device="cuda")),
        lambda t: t.requires_grad_(),
    ]
    with replay.capture() as session:
        step = session.region(shapes_region)
        _record_two_shapes(step)
        for call in range(12):
            x = torch.randn((64, 48)[call % 2], 1024, device="cuda")
            out = step(x)
            want = shapes_region(x)
            assert same(out, want) and out.stride() == want.stride() and out._base is None, call
            assert not out.requires_grad and not out.is_inference() and out.grad_fn is None, call
            if call % 4 == 3:
                fed = step(out)  # its own output as its argument: eagerly, exact
                assert same(fed, shapes_region(want)), call
            changes[call % len(changes)](out)
        assert session.stats().replays >= 10 and session.stats().declined >= 1, session.report()


def test_the_recording_calls_output_resized_before_the_graph_is_built_is_never_written():
    """The first call records and returns the new graph's outputs; a caller who resizes one
    before the second call (which builds the replay) must not have the old memory written."""
    with replay.capture() as session:
        step = session.region(shapes_region)
        step(torch.randn(64, 1024, device="cuda"))  # observed
        x = torch.randn(64, 1024, device="cuda")
        out = step(x)  # recorded: the graph's first launch
        assert same(out, shapes_region(x)) and session.stats().records == 1, session.report()
        out.resize_(1 << 20).fill_(-3.0)
        bystanders = [torch.full((64, 1024), 9.0, device="cuda") for _ in range(4)]
        for _ in range(4):
            other = torch.randn(64, 1024, device="cuda")
            assert same(step(other), shapes_region(other))
        torch.cuda.synchronize()
        assert all(bool((b == 9.0).all()) for b in bystanders) and bool((out == -3.0).all())


def test_outputs_held_across_invalidate_and_close_keep_their_values():
    with replay.capture() as session:
        step = session.region(shapes_region)
        _record_two_shapes(step)
        x = torch.randn(64, 1024, device="cuda")
        held = step(x)
        session.invalidate()
        for _ in range(3):
            step(torch.randn(48, 1024, device="cuda"))  # recorded again, replayed
        x2 = torch.randn(48, 1024, device="cuda")
        last = step(x2)
    for _ in range(3):
        torch.randn(64, 1024, device="cuda").fill_(1.0)  # memory the session gave back, reused
    torch.cuda.synchronize()
    assert same(held, shapes_region(x)) and same(last, shapes_region(x2))
    held.add_(1.0)  # still the caller's to write
    assert same(held, shapes_region(x) + 1.0)
