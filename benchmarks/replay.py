"""Replay against eager jit, the static-copy graph pattern and the raw graph launch (GPU).

A decode-like region of 32 small jit kernels (a chain of ``y = a*x + b`` over a [batch, 256]
activation) whose batch size cycles over 8 shapes, with a fresh input tensor (a new address)
every step. Per step, host time (issuing the step) and end-to-end time (until the GPU is done):

- eager jit: the region called directly, 32 ``@jit`` launches;
- replay: the region under ``capture()`` (guard, rebind the input pointer, one graph launch);
- static-copy graphs: the make_graphed_callables / vLLM pattern written by hand: a
  ``torch.cuda.CUDAGraph`` per shape over a static input buffer, and per step
  ``static.copy_(x)`` then ``graph.replay()``;
- raw graph launch: the driver's graph launch of an already recorded graph of the region
  (torch's, from the static-copy pattern), through the backend's graph-launch template as
  generated replays run it, nothing else (the floor for any graph-based path; it does not
  rebind, so it reads a stale input).

Also a host input: the same region taking an extra small host (CPU) tensor of token ids that it
copies to the GPU (``ids.to("cuda", non_blocking=True)``), staged through a pinned buffer the
graph owns: per step, replay with and without it in the loop, and the host cost of the staging
alone (wait for the previous launch, memmove, event record) measured with the GPU idle.

Also the first-recording cost, against a raw ``torch.cuda.graph`` capture plus instantiate of
the same region into one pool made beforehand: the recording call of a new shape in a running
session, and its second call (node analysis, code generation, a replay); and the recording
call of a fresh session (after one eager warm-up call), which also makes the session's pool,
with its capture + instantiate (the session's ``capture_seconds``) alone.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import statistics
import struct
import time
from collections.abc import Callable

import torch

import jitcore as jc
import replay
from benchmarks import common
from jitcore.backends import get_backend
from replay import instrumentation

SOURCE = r"""
__global__ void affine(const float* __restrict__ x, float* __restrict__ y, float a, float b, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}
"""
affine_kernel = jc.Kernel(SOURCE, "affine")
WIDTH, KERNELS = 256, 32
SHAPES = [1, 2, 4, 8, 12, 16, 24, 32]
#: The replay row timed with the per-call exactness checks beyond the key skipped (torch
#: settings, launchers' globals; instrumentation.measure_without_checks): the difference is their cost.
WITHOUT_CHECKS = "replay, exactness checks skipped (measurement only)"
#: The replay row timed with the torch-settings check made without the torch-side helper's
#: watch (csrc/replay_checks.c's, reading each setting through torch's Python getters), and in
#: generated Python, as it runs where no C helper was built (instrumentation.measure_with_settings_check).
C_SETTINGS = "replay, settings checked by csrc/replay_checks.c (without the torch-side helper)"
PYTHON_SETTINGS = "replay, settings checked in generated Python (without C helpers)"
#: The pointer + scalar row replayed by each graph's generated Python function alone, without
#: csrc/replay_step.c in front of it (instrumentation.measure_generated_python).
GENERATED = "replay, pointer + dynamic scalar, generated Python (without csrc/replay_step.c)"
#: What any replay that rebinds the input and the scalar must do, and nothing else: write both
#: into the node's parameters, push the node to the exec, launch (from Python, through the same
#: C driver calls as replay).
FLOOR = "floor: node update + graph launch (pointer + scalar, no checks, no outputs)"
#: The recording call's own steps (replay.recording.capture marks them on
#: replay.instrumentation.steps), in the order they run, none inside another; the capture's
#: begin, checks and end are one step, in two parts around the region.
RECORDING_CALL_STEPS = (
    "prepare",
    "region",
    "capture begin, checks, end",
    "pool snapshot",
    "own outputs",
    "extents and records",
    "instantiate",
)
#: The steps of the key's second call (replay.recording.analyse, then the session's build of
#: the replay code).
SECOND_CALL_STEPS = ("analyse", "build replay")
#: Steps a raw capture has a counterpart of: the region under capture, and the capture's
#: begin, end and instantiation. The others exist for exactness alone.
RAW_COUNTERPARTS = ("region", "capture begin, checks, end", "instantiate")


@jc.jit
def affine(x, y, a, b):
    n = x.numel()
    affine_kernel[jc.cdiv(n, 256), 256](x, y, a, b, n)


def _affine_kernels(h, first: int, length: int):
    """Kernels ``first`` .. ``length - 1`` of the chain, each reading the last one's output."""
    for k in range(first, length):
        y = torch.empty_like(h)
        affine(h, y, 1.0 + k * 1e-3, 1e-3)
        h = y
    return h


def chain(length: int):
    """A region of ``length`` affine kernels, each reading the last one's output."""

    def region(x):
        return _affine_kernels(x, 0, length)

    region.__qualname__ = f"chain{length}"
    return region


region = chain(KERNELS)


def scaled_chain(length: int):
    """The chain with the first kernel's slope a runtime scalar: a replay rebinds the input
    pointer and patches that scalar (``replay.dynamic``) in the same node."""

    def region(x, slope):
        h = torch.empty_like(x)
        affine(x, h, slope, 1e-3)
        return _affine_kernels(h, 1, length)

    region.__qualname__ = f"scaled_chain{length}"
    return region


scaled_region = scaled_chain(KERNELS)


def with_host_ids(x, ids):
    """The chain, plus a host tensor of ids the region copies to the GPU itself."""
    return region(x), ids.to("cuda", non_blocking=True)


def graph_launcher(graph: torch.cuda.CUDAGraph):
    """A function that launches ``graph`` on the current stream and does nothing else: the
    backend's graph-launch template (the vendor call and its status check, as generated
    replays run it) over the graph's executable."""
    backend = get_backend()
    namespace = dict(
        backend.hot_namespace,
        _exec=backend.graph_exec_object(graph.raw_cuda_graph_exec()),
        _stream=backend.hot_namespace["_stream_object"](torch.cuda.current_stream().cuda_stream),
    )
    body = backend.graph_launch_template.format(exec="_exec", stream="_stream")
    exec("def launch():\n" + "".join(f"    {line}\n" for line in body.splitlines()), namespace)
    return namespace["launch"]


def floor_steps(region_object, shapes) -> tuple[dict, Callable]:
    """Per batch size, ``step(x, slope)`` doing what any replay of the scaled region that
    rebinds ``x`` and ``slope`` must do, through its recorded graph's own node and exec:
    write the pointer and the scalar into the node's parameter buffer, push the node, launch.
    And ``restore()``, which puts the graphs back to a state their next replay repairs (their
    interrupted-patch rollback: recorded bytes, every value pushed again)."""
    backend = get_backend()
    launch, _failed = backend.graph_launch_parts()
    current_stream = backend.hot_namespace["_current_stream"]
    steps, graphs = {}, []
    for entry in region_object.entries.values():
        graph = entry.graph
        if graph is None or graph.template[0].shape[0] not in shapes:
            continue
        scalar = graph.plan.scalars[0]
        pointer = next(p for p in graph.plan.pointers if p.node == scalar.node)
        updater = graph.updaters[scalar.node]
        buffer, graph_exec = updater.params.buffer, graph.namespace["_EXEC"]
        pack_pointer = functools.partial(struct.Struct("<Q").pack_into, buffer, pointer.offset)
        pack_scalar = functools.partial(struct.Struct("<" + scalar.fmt).pack_into, buffer, scalar.offset)
        set_call, set_args, delta = updater.set_call, updater.set_args, pointer.delta

        def step(
            x,
            slope,
            pack_pointer=pack_pointer,
            pack_scalar=pack_scalar,
            set_call=set_call,
            set_args=set_args,
            delta=delta,
            graph_exec=graph_exec,
        ):
            pack_pointer(x.data_ptr() + delta)
            pack_scalar(slope)
            set_call(*set_args)
            launch(graph_exec, current_stream(0))

        steps[graph.template[0].shape[0]] = step
        graphs.append(graph)

    def restore():
        for graph in graphs:
            graph._interrupted()

    return steps, restore


class _NodeRecorder:
    """The least an exact recording hears of each launch: the graph node it became, asked of
    the capture right after the launch (records made in C beside the packed launch, as a
    recording's are: ``launch_sink``)."""

    def __init__(self, backend) -> None:
        self.records, self.nodes, self.backend = [], [], backend
        self.launch_sink = (self.records, self.nodes, backend.capture_tail_function())

    def launch(self, record) -> None:
        self.records.append(record)
        tail = self.backend.capture_tail(record.stream) if record.launched else None
        self.nodes.append(tail[0] if tail and len(tail) == 1 else None)

    def miss(self, description: str) -> None:
        raise RuntimeError(f"{description}: compile before measuring the floor")


def exact_floor(step, x, pool) -> tuple[float, float]:
    """The driver work an exact recording of ``step(x)`` cannot leave out, in microseconds:
    (the recording call's: a capture into ``pool`` that asks each launch's graph node, the
    outputs' own memory appended to the graph in a second capture, instantiate, the first
    launch and its wait; the key's second call's: the graph's nodes and each kernel node's
    parameters read, a launch and its wait)."""
    backend = get_backend()
    graph, stream = torch.cuda.CUDAGraph(keep_graph=True), torch.cuda.Stream()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        with jc.recorder.recording(_NodeRecorder(backend)):
            out = step(x)
        graph.capture_end()
        own = torch.empty_like(out)  # outside the pool: the output's own memory
        try:  # as a recording adds it: a copy node, or a capture into the graph
            backend.append_copies(
                graph.raw_cuda_graph(), [(own.data_ptr(), out.data_ptr(), own.nbytes)], own.device.index
            )
        except NotImplementedError:
            with backend.capture_into(graph.raw_cuda_graph(), stream.cuda_stream):
                own.copy_(out)
        graph.instantiate()
    graph.replay()
    torch.cuda.synchronize()
    recorded = time.perf_counter()
    for node in backend.graph_nodes(graph.raw_cuda_graph()):
        sizes = backend.kernel_param_sizes(node.function) if node.kind == "kernel" else None
        if sizes is not None:
            backend.read_kernel_params(node, sizes)
    graph.replay()
    torch.cuda.synchronize()
    return (recorded - start) * 1e6, (time.perf_counter() - recorded) * 1e6


def floor_report(raw_median: float, floor: dict, first: dict, second: dict) -> tuple[str, dict]:
    """The targets stated against the exact floor (markdown, JSON fields): how much of each
    target the floor leaves to the host steps of exactness, and what they spend now."""
    med = statistics.median
    call = med(f for f, _ in floor.values())
    two = med(f + s for f, s in floor.values())
    spent_first = med(first.values()) - call
    spent_two = med(first[b] + second[b] for b in first) - two
    text = (
        f"The driver work an exact recording cannot leave out (a capture that asks each launch's graph node, the "
        f"outputs' own memory appended in a second capture, instantiate, the first launch and its wait) costs "
        f"{call:.0f} us, **{call / raw_median:.2f}x** the raw capture: the 2x target leaves "
        f"{2 * raw_median - call:.0f} us above it for a recording's host steps (the inputs' checks, the torch-op "
        f"observer, the launch records, the pool's segments, the refusals, the extents), which spend "
        f"{spent_first:.0f} us now. With the key's second call (the graph's nodes read, a launch and its wait) the "
        f"floor is {two:.0f} us, **{two / raw_median:.2f}x**: the 3x target leaves {3 * raw_median - two:.0f} us "
        f"for the analysis and the replay code, which spend "
        f"{spent_two:.0f} us now."
    )
    fields = {
        "exact_floor_us": {b: f for b, (f, _) in floor.items()},
        "exact_floor_second_call_us": {b: s for b, (_, s) in floor.items()},
        "exact_floor_ratio": call / raw_median,
        "exact_floor_two_calls_ratio": two / raw_median,
        "first_target_left_above_floor_us": 2 * raw_median - call,
        "two_calls_target_left_above_floor_us": 3 * raw_median - two,
        "in_session_first_above_floor_us": spent_first,
        "in_session_two_calls_above_floor_us": spent_two,
        "targets_against_floor": text,
    }
    return text, fields


def loop(step, inputs, order, sync=torch.cuda.synchronize) -> tuple[float, float]:
    """(host us per step, end-to-end us per step) over one pass of ``order``."""
    sync()
    start = time.perf_counter()
    for number, batch in enumerate(order):
        step(batch, inputs[batch][number % len(inputs[batch])])
    issued = time.perf_counter()
    sync()
    done = time.perf_counter()
    return (issued - start) / len(order) * 1e6, (done - start) / len(order) * 1e6


def recording_parts(
    first: dict[int, float],
    steps: dict[str, list[float]],
    outside: list[float],
    raw_capture: dict[int, float],
    raw_region: dict[int, float],
    raw_first_launch: dict[int, float],
) -> str:
    """The in-session recording call of each shape in parts, beside the raw capture's (markdown):
    where the time above a raw capture goes, by what a raw capture has a counterpart of and what
    exists for exactness alone."""
    med = statistics.median
    raw = med(raw_capture.values())
    floor = med(raw_capture[b] + raw_first_launch[b] for b in raw_capture)  # of a call that records and answers
    raw_rest = [raw_capture[b] - raw_region[b] for b in raw_capture]
    count = len(outside)
    exactness = [sum(steps[n][i] for n in RECORDING_CALL_STEPS if n not in RAW_COUNTERPARTS) for i in range(count)]
    counterparts = [steps["capture begin, checks, end"][i] + steps["instantiate"][i] for i in range(count)]
    rows = [
        [
            "region under capture (the jit's launch reports and the torch-op observer inside)",
            med(steps["region"]),
            med(raw_region.values()),
        ],
        ["capture begin and end (ours: with the refusal checks), instantiate", med(counterparts), med(raw_rest)],
        *[
            [f"{name} (no raw counterpart)", med(steps[name]), 0.0]
            for name in RECORDING_CALL_STEPS
            if name not in RAW_COUNTERPARTS
        ],
        [
            "outside the capture (ours: the key, admission, first outputs), the first launch and its wait",
            med(outside),
            med(raw_first_launch.values()),
        ],
        ["the call", med(first.values()), floor],
    ]
    table = common.markdown_table(
        ["part (median us over the shapes)", "recording call", "raw capture + first launch"], rows
    )
    return (
        "The recording call of a new shape in a running session, in parts, beside the raw capture's and its "
        "first launch (medians per part, so the parts do not add up to the call exactly):\n\n"
        + table
        + f"\n\nThe steps a raw capture has no counterpart of (the inputs' doubts and observer, the pool "
        f"snapshot, the outputs' own memory, the pointer extents and records) cost {med(exactness):.0f} us, "
        f"{med(exactness) / raw:.2f}x the raw capture, and the region under capture "
        f"{med(steps['region']) - med(raw_region.values()):.0f} us more than raw's (its launch reports and "
        f"observer): with the raw capture itself, the first launch and its wait (which any call that "
        f"records and answers pays), these leave target 3 (at most 2x the raw capture, {2 * raw:.0f} us) "
        f"{2 * raw - floor:.0f} us for them all."
    )


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    repeats, steps = (3, 200) if args.quick else (15, 800)
    torch.manual_seed(0)
    order = [SHAPES[i % len(SHAPES)] for i in range(steps)]
    inputs = {b: [torch.randn(b, WIDTH, device="cuda") for _ in range(16)] for b in SHAPES}
    for b in SHAPES:  # warm the jit (compiles) for every shape
        region(inputs[b][0])
    torch.cuda.synchronize()

    # first capture: each shape recorded by a fresh session with the default policy (one
    # eager warm-up run, observed; then the recording call, timed; then the second call, which
    # analyses the capture and builds the replay code)
    first, phases, second, steps_of_recording = {}, {}, {}, {}
    for b in SHAPES:
        fresh = replay.capture()
        fresh_region = fresh.region(region)
        fresh_region(inputs[b][2])  # the warm-up run
        torch.cuda.synchronize()
        # the recording's own steps (the recording call's, then its second call's analyse
        # and build replay), where the first recording's time goes
        with instrumentation.timing() as recording_steps:
            start = time.perf_counter()
            fresh_region(inputs[b][0])
            torch.cuda.synchronize()
            first[b] = (time.perf_counter() - start) * 1e6
            captured = fresh.stats().capture_seconds * 1e6  # this one recording's capture + instantiate
            phases.setdefault("capture + instantiate", []).append(captured)
            phases.setdefault("rest of the recording call (prepare, first launch, wait)", []).append(
                first[b] - captured
            )
            analysed = time.perf_counter()
            fresh_region(inputs[b][1])
            torch.cuda.synchronize()
            second.setdefault("second call (analysis, replay code, replay)", []).append(
                (time.perf_counter() - analysed) * 1e6
            )
        seconds = recording_steps.seconds()
        for step_name in (*RECORDING_CALL_STEPS, *SECOND_CALL_STEPS):
            steps_of_recording.setdefault(step_name, []).append(seconds[step_name] * 1e6)
        fresh.close()
    capture_only = statistics.median(phases["capture + instantiate"])

    # the session under test records every shape as it first arrives (smallest first here,
    # the worst order for sharing memory: each new shape compacts the pool)
    # each shape's first call (the recording) and second call (analysis, replay code, a
    # replay) timed apart: a new shape arriving in a session that already runs (its memory
    # pool made), the case the raw capture below is measured in (one pool, made beforehand)
    session = replay.capture(record_after=0, record_budget=1.0)  # steady state: no key postponed
    step_region = session.region(region)
    in_session_first, in_session_second = {}, {}
    in_session_steps: dict[str, list[float]] = {}
    in_session_outside: list[float] = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for b in SHAPES:
        with instrumentation.timing() as recording_call:
            called = time.perf_counter()
            step_region(inputs[b][0])
            torch.cuda.synchronize()
            recorded = time.perf_counter()
        step_region(inputs[b][1])
        torch.cuda.synchronize()
        in_session_first[b] = (recorded - called) * 1e6
        in_session_second[b] = (time.perf_counter() - recorded) * 1e6
        # the recording call in parts: the recording's own steps (none inside another), and
        # what the call spends outside them (the key, admission, the first launch and the
        # wait for it, the first outputs)
        seconds = recording_call.seconds()
        recording_steps = {name: seconds[name] * 1e6 for name in RECORDING_CALL_STEPS}
        for name, us in recording_steps.items():
            in_session_steps.setdefault(name, []).append(us)
        in_session_outside.append(in_session_first[b] - sum(recording_steps.values()))
    record_all = (time.perf_counter() - start) * 1e6

    # raw: torch.cuda.graph capture + instantiate of the same region, and static-copy graphs
    # raw_first_launch: the new graph's first launch and the wait for it, which the recording
    # call (timed with its wait) must also pay to return its result: with the capture and the
    # instantiation, the floor of any first call that records and answers
    static_in, static_out, graphs, raw_capture, raw_first_launch, raw_region = {}, {}, {}, {}, {}, {}
    pool = torch.cuda.graph_pool_handle()
    for b in SHAPES:
        static_in[b] = torch.randn(b, WIDTH, device="cuda")
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.graph(graph, pool=pool):
            region_started = time.perf_counter()
            static_out[b] = region(static_in[b])
            raw_region[b] = (time.perf_counter() - region_started) * 1e6
        torch.cuda.synchronize()
        captured = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        raw_capture[b] = (captured - start) * 1e6
        raw_first_launch[b] = (time.perf_counter() - captured) * 1e6
        graphs[b] = graph

    launches = {b: graph_launcher(graphs[b]) for b in SHAPES}
    # the exact floor of each shape, into the same pool as the raw captures
    exact_floors = {b: exact_floor(region, static_in[b], pool) for b in SHAPES}

    # the same region with a runtime scalar: each step rebinds one pointer and one scalar
    slopes = [replay.dynamic(1.0 + i / 64) for i in range(16)]
    next_slope = itertools.cycle(slopes).__next__
    scaled_step = session.region(scaled_region)
    for b in SHAPES:
        for slope in slopes[:3]:
            scaled_step(inputs[b][0], slope)
    assert session.stats().graphs == 2 * len(SHAPES), session.stats()
    for b in SHAPES:
        x, slope = torch.randn(b, WIDTH, device="cuda"), slopes[5]
        assert torch.equal(scaled_step(x, slope), scaled_region(x, slope.value))

    def eager(b, x):
        return region(x)

    def replayed(b, x):
        return step_region(x)

    def static_copy(b, x):
        static_in[b].copy_(x)
        graphs[b].replay()
        return static_out[b]

    def raw(b, x):
        launches[b]()

    def torch_replay(b, x):
        # torch's own replay of the same graph, rebinding nothing: what issue "Hot paths at the
        # floor" holds replay's host time to
        graphs[b].replay()

    host_session = replay.capture(record_after=0, record_budget=1.0)
    host_region = host_session.region(with_host_ids)
    ids = {b: [torch.randint(0, 50_000, (b,)) for _ in range(16)] for b in SHAPES}
    pairs = {b: list(zip(inputs[b], ids[b])) for b in SHAPES}
    for b in SHAPES:
        for pair in pairs[b][:3]:
            host_region(*pair)

    def replayed_host(b, pair):
        return host_region(*pair)

    # correctness of the paths being compared, on fresh data
    for b in SHAPES:
        x = torch.randn(b, WIDTH, device="cuda")
        reference = region(x)
        assert torch.equal(replayed(b, x), reference)
        assert torch.equal(static_copy(b, x), reference)
        fresh_ids = torch.randint(0, 50_000, (b,))
        got, got_ids = replayed_host(b, (x, fresh_ids))
        assert torch.equal(got, reference) and torch.equal(got_ids.cpu(), fresh_ids)

    def replayed_with_scalar(b, x):
        return scaled_step(x, next_slope())

    floors, restore_floored = floor_steps(scaled_step, set(SHAPES))

    def floor(b, x):
        floors[b](x, next_slope().value)

    paths = {
        "eager jit": eager,
        "replay": replayed,
        WITHOUT_CHECKS: replayed,
        C_SETTINGS: replayed,
        PYTHON_SETTINGS: replayed,
        "replay, pointer + dynamic scalar": replayed_with_scalar,
        GENERATED: replayed_with_scalar,
        FLOOR: floor,
        "static-copy torch graphs": static_copy,
        "torch CUDAGraph.replay": torch_replay,
        "raw graph launch": raw,
    }
    samples = {name: ([], []) for name in paths}
    patches_before = session.stats().patches
    replays_before = session.stats().replays
    host_path = "replay + a host input (pinned buffer)"
    samples[host_path] = ([], [])
    for _ in range(repeats):
        for name, step in paths.items():
            measured = contextlib.nullcontext()
            if name == WITHOUT_CHECKS:
                measured = instrumentation.measure_without_checks(instrumentation.graphs_held(step_region))
            elif name == C_SETTINGS:
                measured = instrumentation.measure_with_settings_check(instrumentation.graphs_held(step_region), "c")
            elif name == PYTHON_SETTINGS:
                measured = instrumentation.measure_with_settings_check(
                    instrumentation.graphs_held(step_region), "python"
                )
            elif name == GENERATED:
                measured = instrumentation.measure_generated_python(scaled_step)
            with measured:
                host, total = loop(step, inputs, order)
            if name == FLOOR:
                restore_floored()
            samples[name][0].append(host)
            samples[name][1].append(total)
        host, total = loop(replayed_host, pairs, order)
        samples[host_path][0].append(host)
        samples[host_path][1].append(total)
    # the host cost of staging alone: each step issued with the GPU idle (the wait for the
    # previous launch returns at once), with and without the host input
    idle = {"replay": [], host_path: []}
    for number, batch in enumerate(order):
        pair = pairs[batch][number % len(pairs[batch])]
        for name, call, arguments in (("replay", step_region, pair[:1]), (host_path, host_region, pair)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            call(*arguments)
            idle[name].append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    idle_us = {name: statistics.median(values) for name, values in idle.items()}
    patched_per_step = (session.stats().patches - patches_before) / max(session.stats().replays - replays_before, 1)
    results = {
        name: {"host_us": statistics.median(h), "end_to_end_us": statistics.median(e), "host_min_us": min(h)}
        for name, (h, e) in samples.items()
    }
    raw_host = results["raw graph launch"]["host_us"]
    rows = [
        [name, r["host_us"], r["end_to_end_us"], results["eager jit"]["end_to_end_us"] / r["end_to_end_us"]]
        for name, r in results.items()
    ]
    body = common.markdown_table(["path", "host us/step", "end-to-end us/step", "speedup vs eager (e2e)"], rows)
    replay_e2e = results["replay"]["end_to_end_us"]
    torch_host = results["torch CUDAGraph.replay"]["host_us"]
    host_budget = 1.5 * raw_host + 1.0 * patched_per_step
    raw_median = statistics.median(raw_capture.values())
    record_floor = statistics.median(raw_capture[b] + raw_first_launch[b] for b in SHAPES)
    first_ratio = statistics.median(first.values()) / raw_median
    capture_ratio = capture_only / raw_median
    in_session_ratio = statistics.median(in_session_first.values()) / raw_median
    two_calls = [in_session_first[b] + in_session_second[b] for b in SHAPES]
    two_calls_ratio = statistics.median(two_calls) / raw_median
    floor_text, floor_fields = floor_report(raw_median, exact_floors, in_session_first, in_session_second)
    fresh_two_calls = statistics.median(first.values()) + statistics.median(next(iter(second.values())))
    body += (
        f"\n\nReplay end to end: **{results['eager jit']['end_to_end_us'] / replay_e2e:.2f}x** faster than eager jit "
        f"(target at least 5x), **{results['static-copy torch graphs']['end_to_end_us'] / replay_e2e:.2f}x** "
        f"the static-copy pattern (target above 1x).\n\n"
        f"Replay host time {results['replay']['host_us']:.2f} us against a budget of 1.5 x raw graph launch + "
        f"1 us x {patched_per_step:.2f} patched nodes per step = {host_budget:.2f} us; torch's own "
        f"CUDAGraph.replay() of the same graphs, rebinding nothing, {torch_host:.2f} us "
        f"(replay / torch: **{results['replay']['host_us'] / torch_host:.2f}x**, target at most 1x); "
        f"rebinding one pointer and one dynamic scalar per step "
        f"{results['replay, pointer + dynamic scalar']['host_us']:.2f} us "
        f"(**{results['replay, pointer + dynamic scalar']['host_us'] / torch_host:.2f}x** torch's; "
        f"{results[GENERATED]['host_us']:.2f} us through the generated Python alone, without csrc/replay_step.c). "
        f"The floor of any replay that rebinds them, the node update and the launch alone, costs "
        f"{results[FLOOR]['host_us']:.2f} us (**{results[FLOOR]['host_us'] / torch_host:.2f}x** torch's replay): "
        f"the pointer + scalar replay spends "
        f"{results['replay, pointer + dynamic scalar']['host_us'] - results[FLOOR]['host_us']:.2f} us above it. "
        f"The per-call exactness checks beyond the key (torch settings, launchers' globals) cost "
        f"{results['replay']['host_us'] - results[WITHOUT_CHECKS]['host_us']:.2f} us per step "
        f"(replay with them skipped: {results[WITHOUT_CHECKS]['host_us']:.2f} us); the settings checked by "
        f"csrc/replay_checks.c through torch's Python getters instead of the torch-side helper's watch (C++ getters), "
        f"a replay costs {results[C_SETTINGS]['host_us']:.2f} us "
        f"(the watch saves {results[C_SETTINGS]['host_us'] - results['replay']['host_us']:.2f} us), "
        f"in generated Python {results[PYTHON_SETTINGS]['host_us']:.2f} us.\n\n"
        f"A host input (int64 ids, 8 bytes a row, staged through a pinned buffer): issued with the GPU idle, "
        f"a replay costs {idle_us[host_path]:.2f} us against {idle_us['replay']:.2f} us without it: "
        f"**{idle_us[host_path] - idle_us['replay']:.2f} us** for the staged byte range (wait for the previous "
        f"launch, memmove, event record). In the loop above its host time includes waiting for the previous "
        f"launch of the same graph before the buffer is written again (one replay in flight per graph).\n\n"
        f"First recording of a shape (medians over the 8 shapes), against a raw torch.cuda.graph capture + "
        f"instantiate of the same region into one pool made beforehand ({raw_median:.0f} us):\n\n"
        f"- a new shape in a running session (its pool made; no eager call of the shape before it, so the "
        f"capture runs under the torch-op observer): the recording call "
        f"{statistics.median(in_session_first.values()):.0f} us, **{in_session_ratio:.2f}x** (target at most "
        f"2x); with the shape's second call (analysis, replay code, a replay: "
        f"{statistics.median(in_session_second.values()):.0f} us) **{two_calls_ratio:.2f}x** (target at most 3x);\n"
        f"- the floor of a first call that records and answers, a raw capture + instantiate followed by the "
        f"graph's first launch and the wait for it: {record_floor:.0f} us ({record_floor / raw_median:.2f}x the raw "
        f"capture); the recording call is **{statistics.median(in_session_first.values()) / record_floor:.2f}x** "
        f"that floor;\n"
        f"- the first call that records in a fresh session (one eager warm-up call before it): "
        f"{statistics.median(first.values()):.0f} us, **{first_ratio:.2f}x**, which includes making the "
        f"session's pool (capturing the empty graph that keeps it); capture + instantiate alone "
        f"{capture_only:.0f} us ({capture_ratio:.2f}x); with the second call "
        f"{fresh_two_calls / raw_median:.2f}x.\n\n"
        + recording_parts(
            in_session_first, in_session_steps, in_session_outside, raw_capture, raw_region, raw_first_launch
        )
        + "\n\n"
        + floor_text
        + "\n\nThe fresh session's recording call, in parts (median us): "
        + ", ".join(f"{name} {statistics.median(values):.0f}" for name, values in phases.items())
        + f"; the key's second call (analysis and replay code, then a replay) "
        f"{statistics.median(next(iter(second.values()))):.0f} us. The recording's own timings of its steps "
        "(median us): "
        + ", ".join(f"{name} {statistics.median(values):.0f}" for name, values in steps_of_recording.items())
        + f".\n\nRecording all 8 shapes smallest first in one session took {record_all / 1e3:.1f} ms, "
        f"{session.stats().compactions} pool compactions included; the pool then holds "
        f"{session.stats().graph_memory_bytes / 2**20:.1f} MiB."
    )
    common.plot(
        args.out,
        "replay",
        f"End-to-end time per step, {KERNELS}-kernel region over 8 shapes (us)",
        "us per step",
        "",
        {name: ([0], [r["end_to_end_us"]]) for name, r in results.items()},
        bars=True,
    )
    body += "\n\n![end-to-end time per step](replay.png)"
    results.update(
        patched_nodes_per_step=patched_per_step,
        checks_cost_us=results["replay"]["host_us"] - results[WITHOUT_CHECKS]["host_us"],
        settings_watch_saves_us=results[C_SETTINGS]["host_us"] - results["replay"]["host_us"],
        settings_check_in_c_saves_us=results[PYTHON_SETTINGS]["host_us"] - results["replay"]["host_us"],
        replay_over_torch_replay=results["replay"]["host_us"] / torch_host,
        rebinding_over_torch_replay=results["replay, pointer + dynamic scalar"]["host_us"] / torch_host,
        floor_over_torch_replay=results[FLOOR]["host_us"] / torch_host,
        step_in_c_saves_us=results[GENERATED]["host_us"] - results["replay, pointer + dynamic scalar"]["host_us"],
        host_budget_us=host_budget,
        first_record_us=first,
        raw_capture_us=raw_capture,
        raw_first_launch_us=raw_first_launch,
        record_floor_us=record_floor,
        capture_only_us=capture_only,
        first_capture_ratio=first_ratio,
        in_session_first_us=in_session_first,
        in_session_second_us=in_session_second,
        in_session_first_ratio=in_session_ratio,
        in_session_two_calls_ratio=two_calls_ratio,
        **floor_fields,
        first_record_phases_us=phases,
        in_session_steps_us=in_session_steps,
        in_session_outside_steps_us=in_session_outside,
        raw_region_under_capture_us=raw_region,
        first_record_steps_us=steps_of_recording,
        second_call_us=second,
        record_all_us=record_all,
        host_input_idle_us=idle_us,
        host_input_report=host_session.report(),
        report=session.report(),
    )
    common.write(
        args.out,
        "replay",
        f"Replay of a {KERNELS}-kernel region over 8 shapes, fresh input every step",
        results,
        body,
        notes="Steps cycle through batch sizes "
        + ", ".join(map(str, SHAPES))
        + f"; {steps} steps a loop, medians of {repeats} interleaved loops.",
    )


if __name__ == "__main__":
    main()
