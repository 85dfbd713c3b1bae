"""Output slots on the GPU (replay.output_slots): the graphs of a region share their output
memory, and an output anyone still holds is never overwritten by another graph's replay.
The bookkeeping alone is tested on the CPU in test_output_slots.py."""

from __future__ import annotations

import random

import pytest
import torch

import jitcore as jc
import replay
from replay import output_slots
from tests.replay.test_hazards_gpu import spin_kernel

pytestmark = pytest.mark.gpu

SOURCE = r"""
__global__ void scale_shift(const float* __restrict__ x, float* __restrict__ y, float s, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * s + 1.0f;
}
"""
scale_shift_kernel = jc.Kernel(SOURCE, "scale_shift")
DIM, WIDTH = 64, 4096


@jc.jit
def scale_shift(x, y, s):
    n = x.numel()
    scale_shift_kernel[jc.cdiv(n, 256), 256](x, y, s, n)


def make_region(width: int = WIDTH):
    generator = torch.Generator(device="cuda").manual_seed(1)
    weight = torch.randn(DIM, width, device="cuda", generator=generator) / DIM**0.5

    def logits(x):
        h = x @ weight  # a torch op: its output lies in the pool, then is copied to a slot
        out = torch.empty_like(h)
        scale_shift(h, out, 0.5)
        return out, h[:, :8]  # two outputs sharing one buffer (h's), one of them a view

    logits(torch.randn(2, DIM, device="cuda"))  # cuBLAS and the kernel loaded before any capture
    return logits


def fresh_cublas_workspaces() -> None:
    """Drop torch's cuBLAS workspaces (32 MiB on an H200), so the next session's first matmul
    capture makes its own in the session's pool. torch keeps one per (handle, stream) after the
    session that made it, and sessions take capture streams from torch's pool in turn, so
    without this a session's graph memory held a workspace or not depending on which tests ran
    before it (the whole GPU suite once measured 31.6 MiB alone and 77.0 MiB for 48 shapes)."""
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()


def reference(fn, x):
    out, head = fn(x)
    return out.clone(), head.clone()


def test_a_held_output_of_one_shape_survives_replays_of_other_shapes():
    fn = make_region()
    rng = random.Random(0)
    sizes = [1, 3, 8, 17, 32]
    with replay.capture(record_after=0, record_budget=1.0) as session:
        step = session.region(fn)
        held = []  # (batch, outputs, expected): the latest call of each shape
        for call in range(120):
            batch = rng.choice(sizes) if call >= 2 * len(sizes) else sizes[call // 2]
            x = torch.randn(batch, DIM, device="cuda")
            outputs = step(x)
            for tensor in outputs:  # nothing left over from an earlier replay can pass
                assert tensor.shape[0] == batch
            # the documented rule: a graph's next replay overwrites its own previous outputs
            held = [h for h in held if h[0] != batch]
            held.append((batch, outputs, reference(fn, x)))
            if len(held) > 4:  # the caller lets the oldest go: its slot may be reused
                held.pop(0)
            for _batch, (out, head), (want_out, want_head) in held:
                assert torch.equal(out, want_out) and torch.equal(head, want_head)
        stats = session.stats()
        assert stats.replays >= 100, session.report()
        assert stats.records - stats.record_retries == len(sizes)


def test_an_output_held_only_through_a_view_or_a_dlpack_capsule_is_not_overwritten():
    fn = make_region()
    with replay.capture(record_after=0, record_budget=1.0) as session:
        step = session.region(fn)
        for batch in (4, 8):
            for _ in range(2):  # recorded, then analysed
                step(torch.randn(batch, DIM, device="cuda"))
        x4, x8 = torch.randn(4, DIM, device="cuda"), torch.randn(8, DIM, device="cuda")
        rows = step(x4)[0][1:3]  # the outputs themselves are dropped at once, a view is kept
        capsule = torch.utils.dlpack.to_dlpack(step(x8)[1])  # only a capsule of the other shape's
        want_rows, want_head = reference(fn, x4)[0][1:3], reference(fn, x8)[1]
        for _ in range(5):  # the other shape replayed many times meanwhile, each
            step(torch.randn(8, DIM, device="cuda"))  # output dropped at once
            step(torch.randn(4, DIM, device="cuda"))
        # each shape's own later replays overwrite its outputs (the documented rule): only
        # the other shape's replays ran between each hold and the last call of the other
        del capsule, want_head
        assert session.stats().replays >= 12
        rows = step(x4)[0][1:3]
        capsule = torch.utils.dlpack.to_dlpack(step(x8)[1])
        for _ in range(5):
            step(torch.randn(16, DIM, device="cuda"))  # a third shape, recorded and replayed
        assert torch.equal(rows, want_rows)
        assert torch.equal(torch.utils.dlpack.from_dlpack(capsule), reference(fn, x8)[1])


def test_a_graphs_next_replay_overwrites_its_own_outputs_and_no_other_graphs():
    fn = make_region()
    with replay.capture(record_after=0, record_budget=1.0) as session:
        step = session.region(fn)
        for batch in (4, 8):
            for _ in range(2):
                step(torch.randn(batch, DIM, device="cuda"))
        first4, first8 = torch.randn(4, DIM, device="cuda"), torch.randn(8, DIM, device="cuda")
        a = step(first4)[0]
        b = step(first8)[0]
        second4 = torch.randn(4, DIM, device="cuda")
        c = step(second4)[0]
        assert torch.equal(b, reference(fn, first8)[0])  # another graph's output: intact
        assert torch.equal(c, reference(fn, second4)[0])
        assert torch.equal(a, c)  # its own previous output: overwritten, as documented


def test_outputs_of_many_shapes_take_about_two_output_sets_not_one_per_shape():
    # a region ending in a wide output (the logits of issue 12): recorded for 48 batch sizes,
    # growing and scattered, in the usual loop `out = step(x)` (the previous output is held
    # while the next call runs, as an eager loop would hold it too)
    width = 32000
    fn = make_region(width)
    largest = 48
    set_bytes = largest * width * 4 * 2  # `out` and `h` (a view of h is returned), float32
    fresh_cublas_workspaces()
    with replay.capture(record_budget=1.0) as alone:
        step = alone.region(fn)
        x = torch.randn(largest, DIM, device="cuda")
        for _ in range(4):  # observed, recorded, analysed and replayed
            out = step(x)
        assert alone.stats().replays >= 2, alone.report()
        alone_bytes = alone.stats().graph_memory_bytes
    del out
    for order in (list(range(1, largest + 1)), random.Random(2).sample(range(1, largest + 1), largest)):
        fresh_cublas_workspaces()
        with replay.capture(record_budget=1.0) as session:
            step = session.region(fn)
            out = None
            for batch in order + order + order:  # recorded, analysed and replayed
                x = torch.randn(batch, DIM, device="cuda")
                out = step(x)
                assert torch.equal(out[0], reference(fn, x)[0])
            stats = session.stats()
            slots = sum(s.nbytes() for s in session._output_slots.values())
        assert stats.replays >= 2 * largest, session.report()
        del out
        assert slots <= 2 * set_bytes + 2 * 4096, f"{slots / 2**20:.1f} MiB of output slots"
        # one output set each: 48 shapes held 48 sets before (25x the largest set here)
        assert stats.graph_memory_bytes <= alone_bytes + set_bytes + alone_bytes // 2, (
            f"{stats.graph_memory_bytes / 2**20:.1f} MiB for {largest} shapes, {alone_bytes / 2**20:.1f} MiB alone"
        )


# --- the raw streams replays launch on, as torch objects ---------------------------------------
STREAMS = ["the default stream", "a side stream"]


def stream_named(name: str) -> torch.cuda.Stream:
    return torch.cuda.default_stream() if name == "the default stream" else torch.cuda.Stream()


def spin(dummy: torch.Tensor) -> None:
    spin_kernel[1, 32](dummy, 20_000_000)  # about 10 ms (the hazard tests' kernel)


@pytest.mark.parametrize("current", STREAMS)
def test_a_raw_handle_becomes_its_own_stream_the_default_streams_0_included(current):
    stream = stream_named(current)
    with torch.cuda.stream(stream):
        raw = torch.cuda.current_stream().cuda_stream
        made = output_slots.torch_stream(raw, torch.cuda.current_device())
    assert made.cuda_stream == raw == stream.cuda_stream
    assert (raw == 0) == (current == "the default stream")  # (what makes ExternalStream alone wrong)


@pytest.mark.parametrize("current", STREAMS)
def test_a_write_after_wait_for_readers_comes_after_the_readers_reads(current):
    """The wait alone: a reader's slow read, enqueued before the wait, sees the memory as it
    was before a write enqueued after the wait on the current stream."""
    dummy = torch.zeros(32, device="cuda")
    with torch.cuda.stream(stream_named(current)):
        memory = torch.full((1 << 20,), 1.0, device="cuda")
        readers = [torch.cuda.Stream(), torch.cuda.Stream()]
        copies = []
        for reader in readers:
            reader.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(reader):
                spin(dummy)
                copies.append(memory.clone())
        waiting = list(readers)
        output_slots.wait_for_readers(waiting, torch.cuda.current_stream().cuda_stream, memory.device)
        memory.fill_(2.0)
        torch.cuda.synchronize()
    assert waiting == [] and all(bool((copy == 1.0).all()) for copy in copies)


@pytest.mark.parametrize("current", STREAMS)
def test_memory_recorded_on_a_raw_stream_is_reused_only_after_that_streams_work(current):
    """record_on(tensors, raw): freed, the memory goes to no new tensor of another stream while
    the work enqueued on ``raw`` may still use it (the default stream's handle 0 included)."""
    dummy = torch.zeros(32, device="cuda")
    user, allocating = stream_named(current), torch.cuda.Stream()
    with torch.cuda.stream(allocating):
        memory = torch.zeros(1 << 20, device="cuda")
        address = memory.data_ptr()
        del memory
        memory = torch.zeros(1 << 20, device="cuda")  # its stream's freed block, handed straight back
    if memory.data_ptr() != address:
        pytest.skip("the allocator did not hand the freed block back on its own stream")
    user.wait_stream(allocating)
    with torch.cuda.stream(user):
        spin(dummy)
        memory.add_(1.0)  # used on `user` about 10 ms from now
    output_slots.record_on([memory], user.cuda_stream)
    del memory
    with torch.cuda.stream(allocating):
        new = torch.full((1 << 20,), 7.0, device="cuda")
    torch.cuda.synchronize()
    assert new.data_ptr() != address and bool((new == 7.0).all())
