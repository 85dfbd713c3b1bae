"""Replay under shape distributions: never slower than eager, faster where shapes repeat (GPU).

A 6-layer region of jit kernels and torch matmuls (per layer: ``h @ W``, a bias-and-scale jit
kernel, a ReLU jit kernel) whose batch size is drawn every step from:

- uniform: 1..256 at random;
- zipf: 1..256 with probability proportional to 1 / rank^1.1 (a few sizes dominate);
- fixed: a small set of sizes (1, 8, 32, 64, 128, 256);
- prefill: hundreds of lengths, each seen once (the bookkeeping and warm-up cost of keys that
  never repeat).

Per distribution, in one process and on the same draws, taking turns every 25 steps: eager,
replay with the default policy, and replay with bucketing (``capture(buckets=[1, 2, 4, ...,
256])`` and ``replay.padded``; the region's rows are independent), and with vLLM's capture
sizes as buckets (1, 2, 4, then every multiple of 8: less padding, more graphs). A bucketed
step is bound by the GPU time of its graph (each size padded to the next power of two runs
1.33x the rows on average), so its speed-up follows how fast eager's host runs that day.
Reported per step: the first and the second half of the run (end to end: the GPU synchronised
at each block's end), the
ratio to eager, records, evictions, keys not admitted, recordings postponed by the budget,
calls of keys too rare to pay for a recording, compactions and graph memory. One-time costs
are paid before timing on both sides: every jit call state is compiled, and a throwaway session
records two shapes (replay's own kernels, the first capture).
A second table times a short loop over three sizes, eager against a fresh session with the
default policy (see three_sizes): the policy should record each size on its first calls.
A third times the eager path of a session against the direct call (see eager_path).
A third measures graph memory over many shapes of a region ending in a 32,000-wide output
(see many_shapes_memory). The jit-only rows run the same layers with the matmul as a jit
kernel too, eager against bucketed and shape-polymorphic replay (one graph per bucket serving
every smaller size at its own size). A fourth puts the bucketed step beside its floors: the
GPU time of torch CUDA graphs of the same region at the bucket sizes (see bucketed_floor).
"""

from __future__ import annotations

import bisect
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import jitcore as jc
import replay
from benchmarks import common
from benchmarks.replay import loop

SOURCE = r"""
__global__ void bias_scale(const float* __restrict__ x, const float* __restrict__ bias, float* __restrict__ y,
                           float s, int cols, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = (x[i] + bias[i % cols]) * s;
}
__global__ void relu(const float* __restrict__ x, float* __restrict__ y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
__global__ void affine(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                       long long k, long long cols) {
    long long i = blockIdx.y, j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (j >= cols) return;
    float acc = 0.f;
    for (long long t = 0; t < k; ++t) acc += x[i * k + t] * w[t * cols + j];
    y[i * cols + j] = acc;
}
"""
affine_kernel = jc.Kernel(SOURCE, "affine")
bias_scale_kernel = jc.Kernel(SOURCE, "bias_scale")
relu_kernel = jc.Kernel(SOURCE, "relu")
DIM, LAYERS, LARGEST = 512, 6, 256
JIT_DIM = 128  # the jit-only region's width
BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
#: vLLM's default CUDA-graph capture sizes up to 256 (1, 2, 4, then every multiple of 8): a
#: uniform batch is padded by 3.5 rows on average, against 42 with powers of two.
VLLM_BUCKETS = [1, 2, 4, *range(8, LARGEST + 1, 8)]
VLLM_PATH = "bucketed, vLLM's sizes"
FIXED = [1, 8, 32, 64, 128, 256]


@jc.jit
def bias_scale(x, bias, y, s):
    n = x.numel()
    bias_scale_kernel[jc.cdiv(n, 256), 256](x, bias, y, s, x.shape[1], n)


@jc.jit
def relu(x, y):
    n = x.numel()
    relu_kernel[jc.cdiv(n, 256), 256](x, y, n)


def _stack(width: int, matmul) -> Callable:
    """Six layers of ``matmul(h, w)`` (weights ``width`` wide), then the bias-and-scale and
    the ReLU jit kernels, on fixed random weights."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(width, width, device="cuda", generator=generator) / width**0.5 for _ in range(LAYERS)]
    biases = [torch.randn(width, device="cuda", generator=generator) for _ in range(LAYERS)]

    def layers(x):
        h = x
        for w, b in zip(weights, biases):
            t = matmul(h, w)
            y = torch.empty_like(h)
            bias_scale(t, b, y, 0.5)
            h = torch.empty_like(y)
            relu(y, h)
        return h

    return layers


def make_region():
    return _stack(DIM, torch.matmul)


@jc.jit
def affine(x, w, y):
    rows, k = x.shape
    cols = w.shape[1]
    affine_kernel[(jc.cdiv(cols, 256), rows), 256](x, w, y, k, cols)


def _jit_matmul(h, w):
    t = torch.empty_like(h)
    affine(h, w, t)
    return t


def make_jit_region():
    """The same layers with the matmul as a jit kernel too: every launch is a jit launch, so
    one graph per bucket can serve every smaller size at its own size (polymorphic).
    Narrower than the other region: a naive matmul kernel 512 wide would be bound by the GPU."""
    return _stack(JIT_DIM, _jit_matmul)


def draws(distribution: str, steps: int, rng: random.Random) -> list[int]:
    if distribution == "uniform":
        return [rng.randint(1, LARGEST) for _ in range(steps)]
    if distribution == "zipf":
        weights = [1 / rank**1.1 for rank in range(1, LARGEST + 1)]
        sizes = list(range(1, LARGEST + 1))
        rng.shuffle(sizes)  # the popular sizes are not the small ones
        return rng.choices(sizes, weights=weights, k=steps)
    if distribution == "fixed":
        return [rng.choice(FIXED) for _ in range(steps)]
    lengths = list(range(1, steps + 1))  # prefill: each length once
    rng.shuffle(lengths)
    return lengths


def padding(region):
    return lambda x: region(replay.padded(x))


#: Steps per block: the three paths take turns, block by block, on the same draws (see measure).
#: 25: the machine's speed drifts by 10-30% within a run (eager's first and second halves
#: differed by up to 14% in one run of 2026-12-01 with blocks of 100, and the ratios of two
#: runs of the same code by 3% to 8%); shorter turns put the drift on every path alike. A
#: block's closing synchronisation (tens of microseconds) is under 1% of its 25 steps.
BLOCK = 25


def measure(distribution: str, steps: int, polymorphic: bool = False) -> dict[str, dict[str, float]]:
    """The paths take turns every ``BLOCK`` steps (each block's order rotated), so a drift of
    the machine's speed during the run (we saw eager alone vary by 30% between two halves of
    one run) falls on all of them alike; each session sees every step of the run in order.
    ``polymorphic``: the jit-only region, eager against bucketed and polymorphic replay."""
    region = make_jit_region() if polymorphic else make_region()
    sizes = draws(distribution, steps, random.Random(1))
    width = JIT_DIM if polymorphic else DIM
    inputs = {n: [torch.randn(n, width, device="cuda") for _ in range(2)] for n in set(sizes)}
    for n in set(sizes):  # compile every jit call state before any timing
        region(inputs[n][0])
    with replay.capture(record_after=0, record_budget=1.0) as warm:
        # replay's one-time costs (its own copy kernels compiled, the first capture) are paid
        # before timing too, as eager's compiles are: a throwaway session records two shapes
        warmed = warm.region(region)
        for n in sorted(set(sizes))[:2]:
            for _ in range(3):
                warmed(inputs[n][0])
    torch.cuda.synchronize()
    if polymorphic:
        sessions = {
            "bucketed": replay.capture(buckets=BUCKETS),
            "polymorphic": replay.capture(buckets=BUCKETS, polymorphic=True),
        }
    else:
        sessions = {
            "replay": replay.capture(),
            "bucketed": replay.capture(buckets=BUCKETS),
            VLLM_PATH: replay.capture(buckets=VLLM_BUCKETS),
        }
    paths = {
        "eager": region,
        **{
            name: padding(session.region(region)) if session.policy.buckets else session.region(region)
            for name, session in sessions.items()
        },
    }
    half = len(sizes) // 2
    spent = {path: [0.0, 0.0] for path in paths}  # microseconds in the first and second half
    for number, start in enumerate(range(0, len(sizes), BLOCK)):
        names = list(paths)
        names = names[number % len(names) :] + names[: number % len(names)]
        for name in names:
            # a block that straddles the middle is split at it
            for part, (begin, end) in enumerate(((start, min(start + BLOCK, half)), (max(start, half), start + BLOCK))):
                block = sizes[begin:end]
                if block:
                    step = paths[name]
                    spent[name][part] += loop(lambda _size, x, step=step: step(x), inputs, block)[1] * len(block)
    counts = (half, len(sizes) - half)
    results: dict[str, dict[str, float]] = {}
    for name in paths:
        results[name] = {"first_us": spent[name][0] / counts[0], "second_us": spent[name][1] / counts[1]}
    for name, session in sessions.items():
        stats = session.stats()
        results[name].update(
            records=stats.records,
            evictions=stats.evictions,
            not_admitted=stats.refused,
            postponed=stats.deferred,
            too_rare=stats.too_rare,
            compactions=stats.compactions,
            recaptures=stats.recaptures,
            graph_mib=stats.graph_memory_bytes / 2**20,
            variants=stats.variants,
            padded_in_place=stats.padded_in_place,
        )
        session.close()
    eager_total = spent["eager"][0] + spent["eager"][1]
    for row, name in zip(results.values(), paths):
        row["whole_run_vs_eager"] = (spent[name][0] + spent[name][1]) / eager_total
        row["second_half_speedup"] = results["eager"]["second_us"] / row["second_us"]
    return results


#: The loop over three sizes: batch sizes taken in turn, steps, and the passes of each path.
THREE_SIZES, THREE_SIZES_STEPS, THREE_SIZES_PASSES = (8, 16, 32), 300, 5


def three_sizes() -> dict[str, float]:
    """A loop of ``THREE_SIZES_STEPS`` steps going round three batch sizes of the 6-layer region,
    eager and in a fresh session with the default policy (its recordings in its time), taking
    turns pass by pass (medians over ``THREE_SIZES_PASSES``): each size is called a hundred
    times, and a recording is repaid after a few dozen calls, so the policy should record each
    size on its first calls. Replays are a session's calls served by a graph (its recording
    calls among them, as the session counts them)."""
    region = make_region()
    inputs = {n: [torch.randn(n, DIM, device="cuda")] for n in THREE_SIZES}
    order = [THREE_SIZES[step % len(THREE_SIZES)] for step in range(THREE_SIZES_STEPS)]
    for n in THREE_SIZES:
        region(inputs[n][0])
    with replay.capture(record_after=0, record_budget=1.0) as warm:  # replay's one-time costs, as in measure
        warmed = warm.region(region)
        for _ in range(3):
            warmed(inputs[THREE_SIZES[0]][0])
    eager, replayed, replays, records = [], [], [], []
    for _ in range(THREE_SIZES_PASSES):
        eager.append(loop(lambda _size, x: region(x), inputs, order)[1])
        with replay.capture() as session:
            step = session.region(region)
            replayed.append(loop(lambda _size, x, step=step: step(x), inputs, order)[1])
            stats = session.stats()
            replays.append(stats.replays)
            records.append(stats.records)
    median = statistics.median
    return {
        "eager_us": median(eager),
        "replay_us": median(replayed),
        "speedup": median(eager) / median(replayed),
        "replays_min": min(replays),
        "records_max": max(records),
    }


def trivial(x):
    return x


def eager_path(steps: int) -> dict[str, dict[str, float]]:
    """What a call that runs eagerly costs a session beyond the direct call, alone (a region
    that returns its argument) and inside this benchmark's loop (the 6-layer region, whose own
    Python crowds the CPU's caches): still warming (``record_after`` never reached), and too
    rare to pay back (the first recordings and the budget spent, a recording made to cost 2 s). Interleaved
    blocks of ``BLOCK`` calls over the uniform draws, microseconds per call over the direct call."""
    sizes = draws("uniform", steps, random.Random(1))
    inputs = {n: [torch.randn(n, DIM, device="cuda")] for n in set(sizes)}
    results = {}
    for label, fn in (("trivial region", trivial), ("6-layer region", make_region())):
        for n in set(sizes):
            fn(inputs[n][0])
        warming = replay.capture(record_after=10**9)
        rare = replay.capture(record_after=0)
        rare.admission.budget.spent = 1.0  # past the first recordings and the budget,
        rare.admission.budget.recent = [1.0] * 3  # and a recording costs 2 s: every key too rare
        paths = {"direct": fn, "warming": warming.region(fn), "too_rare": rare.region(fn)}
        spent = dict.fromkeys(paths, 0.0)
        for number, start in enumerate(range(0, len(sizes), BLOCK)):
            names = list(paths)
            names = names[number % len(names) :] + names[: number % len(names)]
            for name in names:
                block = sizes[start : start + BLOCK]
                spent[name] += loop(lambda _size, x, step=paths[name]: step(x), inputs, block)[1] * len(block)
        assert rare.stats().records == 0 and warming.stats().records == 0
        warming.close()
        rare.close()
        direct = spent["direct"] / len(sizes)
        results[label] = {"direct_us": direct}
        results[label].update(
            {f"{name}_over_direct_us": spent[name] / len(sizes) - direct for name in paths if name != "direct"}
        )
    return results


def _torch_bucket_graphs(region, inputs: dict[int, torch.Tensor]) -> tuple[dict, dict]:
    """torch CUDA graphs of ``region`` at each bucket size (one pool, largest first, as vLLM
    records them): (bucket -> graph, bucket -> its static input)."""
    static = {b: inputs[b].clone() for b in BUCKETS}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for b in BUCKETS:
            region(static[b])
    torch.cuda.current_stream().wait_stream(side)
    graphs, pool = {}, None
    for b in reversed(BUCKETS):
        graphs[b] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[b], pool=pool):
            region(static[b])
        pool = graphs[b].pool()
    torch.cuda.synchronize()
    return graphs, static


def bucketed_floor(steps: int) -> dict[str, dict[str, float]]:
    """Where the bucketed uniform run's second half stands against what the GPU needs: per
    path, the GPU time of a step (blocks of ``BLOCK`` calls issued behind a long GPU sleep, so
    the host is ahead and the events time the GPU alone), the host time of a call with the
    GPU ahead (median), and a block after a block of eager calls, as the distributions' runs
    take turns (the step's time, and the host time of the block's first call). Paths: the
    padded call; replay of a bucket's own size (no padding); torch CUDA graphs of the same
    region at each bucket (replay only, and with the call's rows copied into the static
    input: the least a padded step can do)."""
    region = make_region()
    sizes = [n for n in draws("uniform", steps, random.Random(2)) if n not in BUCKETS]
    inputs = {n: torch.randn(n, DIM, device="cuda") for n in {*sizes, *BUCKETS}}
    for n in inputs:
        region(inputs[n])
    bucket_of = {n: BUCKETS[bisect.bisect_left(BUCKETS, n)] for n in set(sizes)}
    padded_session = replay.capture(buckets=BUCKETS, record_after=0, record_budget=1.0)
    padded_step = padded_session.region(region)
    exact_session = replay.capture(record_after=0, record_budget=1.0)
    exact_step = exact_session.region(region)
    for n in set(sizes):
        for _ in range(2):
            padded_step(replay.padded(inputs[n]))
    for b in BUCKETS:
        for _ in range(3):
            exact_step(inputs[b])
    graphs, static = _torch_bucket_graphs(region, inputs)
    paths = {
        "bucketed (padded call)": lambda n: padded_step(replay.padded(inputs[n])),
        "replay at the bucket's size": lambda n: exact_step(inputs[bucket_of[n]]),
        "torch CUDA graph": lambda n: graphs[bucket_of[n]].replay(),
        "torch CUDA graph + rows copied in": lambda n: (
            static[bucket_of[n]][:n].copy_(inputs[n]),
            graphs[bucket_of[n]].replay(),
        ),
    }
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    blocks = [sizes[start : start + BLOCK] for start in range(0, len(sizes) - BLOCK + 1, BLOCK)][:60]
    results: dict[str, dict[str, float]] = {}
    for name, call in paths.items():
        gpu, host, after_eager, first = [], [], [], []
        for number, block in enumerate(blocks):
            torch.cuda._sleep(4_000_000)  # the GPU busy for milliseconds: the host runs ahead
            events[0].record()
            for n in block:
                started = time.perf_counter()
                call(n)
                host.append(time.perf_counter() - started)
            events[1].record()
            torch.cuda.synchronize()
            gpu.append(events[0].elapsed_time(events[1]) * 1e3 / len(block))
            for n in blocks[(number + 1) % len(blocks)]:  # a block of eager calls, then this path's
                region(inputs[n])
            torch.cuda.synchronize()
            started = time.perf_counter()
            for k, n in enumerate(block):
                call(n)
                if k == 0:
                    first.append(time.perf_counter() - started)
            torch.cuda.synchronize()
            after_eager.append((time.perf_counter() - started) / len(block))
        results[name] = {
            "gpu_us": statistics.median(gpu),
            "host_us": statistics.median(host) * 1e6,
            "after_eager_us": statistics.median(after_eager) * 1e6,
            "first_call_us": statistics.median(first) * 1e6,
        }
    padded_session.close()
    exact_session.close()
    return results


LOGITS, MEMORY_SHAPES = 32000, 64


def many_shapes_memory(shapes: int) -> dict[str, dict[str, float]]:
    """Graph memory of ``shapes`` batch sizes (1..shapes, growing and scattered, each called
    four times) of a region ending in a logits-like output (``x @ W`` to 32,000 columns, then
    a bias-and-scale jit kernel), against its largest shape recorded alone. Two loops: the
    caller keeps the last output while calling again (``out = step(x)``, as eager keeps it
    too), or drops each output at once. The last row gives each graph output memory of its
    own, as on a backend without output slots (HIP), by turning the session's slots off."""
    generator = torch.Generator(device="cuda").manual_seed(3)
    weight = torch.randn(DIM, LOGITS, device="cuda", generator=generator) / DIM**0.5
    bias = torch.randn(LOGITS, device="cuda", generator=generator)

    def logits(x):
        h = x @ weight
        y = torch.empty_like(h)
        bias_scale(h, bias, y, 0.5)
        return y

    logits(torch.randn(2, DIM, device="cuda"))  # cuBLAS and the kernels loaded before any capture

    def run(order: list[int], hold: bool, slots: bool = True) -> dict[str, float]:
        torch.cuda.synchronize()
        # cuBLAS's workspace (32 MiB on this GPU) is torch's per (handle, stream), made by the
        # first matmul on a stream, in the pool capturing it and kept after the session: a
        # session whose capture stream (torch's pool of streams, taken in turn) had one from an
        # earlier session records without it. Every row starts without any, so each session's
        # pool holds its own (the largest shape alone measured 27.8 or 59.8 MiB, 2026-12-01).
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        with replay.capture(record_budget=1.0) as session:
            if not slots:
                session.output_slots = None  # each graph keeps output memory of its own
            step = session.region(logits)
            out = None
            for batch in order * 4:  # observed, recorded, analysed, replayed
                x = torch.randn(batch, DIM, device="cuda")
                if hold:
                    out = step(x)
                else:
                    step(x)
            stats = session.stats()
            slot_bytes = sum(s.nbytes() for s in session._output_slots.values())
            outputs = slot_bytes or sum(
                getattr(e.graph.capture, "output_bytes", 0) for e in session.lru if e.graph is not None
            )
            row = {
                "graph_mib": stats.graph_memory_bytes / 2**20,
                "output_mib": outputs / 2**20,
                "replays": stats.replays,
                "records": stats.records,
            }
        del out
        return row

    results = {"largest alone": run([shapes], hold=True)}
    growing = list(range(1, shapes + 1))
    scattered = random.Random(4).sample(growing, shapes)
    for name, order in (("growing", growing), ("scattered", scattered)):
        results[f"{shapes} shapes {name}, out = step(x)"] = run(order, hold=True)
        results[f"{shapes} shapes {name}, outputs dropped"] = run(order, hold=False)
    results[f"{shapes} shapes scattered, out = step(x), per-graph outputs"] = run(scattered, hold=True, slots=False)
    alone = results["largest alone"]["graph_mib"]
    for row in results.values():
        row["vs_alone"] = row["graph_mib"] / alone
    return results


def main() -> None:
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument("--from-json", type=Path, help="make the markdown page again from a saved shapes.json")
    args = parser.parse_args()
    if args.from_json:
        record = json.loads(args.from_json.read_text())
        body, notes = report(record["results"], record["results"].get("steps", 6000))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "shapes.md").write_text(common.markdown(record, TITLE, body, notes))
        return
    steps = 600 if args.quick else 6000
    results = {d: measure(d, steps) for d in ("uniform", "zipf", "fixed")}
    results["prefill"] = measure("prefill", 100 if args.quick else 1000)
    for distribution in ("uniform", "zipf"):
        results[f"{distribution}, jit-only region"] = measure(distribution, steps, polymorphic=True)
    results["three_sizes"] = three_sizes()
    results["eager_path"] = eager_path(steps)
    results["many_shapes_memory"] = many_shapes_memory(16 if args.quick else MEMORY_SHAPES)
    results["bucketed_floor"] = bucketed_floor(steps)
    results["steps"] = steps
    body, notes = report(results, steps)
    common.write(args.out, "shapes", TITLE, results, body, notes)


TITLE = "Replay under shape distributions"


def _ordered(mapping: dict, first: tuple) -> dict:
    """``mapping`` with the keys of ``first`` first, in that order (a saved JSON's keys are
    sorted), the others after them as they come."""
    return {**{k: mapping[k] for k in first if k in mapping}, **{k: v for k, v in mapping.items() if k not in first}}


def _three_sizes_table(three: dict | None) -> str:
    """The loop over three sizes (three_sizes), as markdown ("" for older saved runs)."""
    if not three:
        return ""
    text = (
        f"\n\nA loop of {THREE_SIZES_STEPS} steps going round batch sizes {list(THREE_SIZES)}, eager "
        f"and in a fresh session with the default policy, its recordings included (us per step, medians "
        f"of {THREE_SIZES_PASSES} passes each; target: at least 250 of {THREE_SIZES_STEPS} calls "
        "replayed):\n\n"
    )
    return text + common.markdown_table(
        ("eager us/step", "replay us/step", "speed-up", "replays (fewest)", "records (most)"),
        [(three["eager_us"], three["replay_us"], three["speedup"], three["replays_min"], three["records_max"])],
    )


def report(results: dict, steps: int) -> tuple[str, str]:
    """(tables, notes) of a run's results, the distributions' and the two extra tables'
    (``eager_path``, ``many_shapes_memory``): also made again from a saved JSON with
    ``python -m benchmarks.shapes --from-json shapes.json``."""
    overhead = _ordered(results["eager_path"], ("trivial region", "6-layer region"))
    memory = _ordered(results["many_shapes_memory"], ("largest alone",))
    extra = ("eager_path", "many_shapes_memory", "bucketed_floor", "three_sizes", "steps")
    distributions = _ordered(
        {k: v for k, v in results.items() if k not in extra},
        ("uniform", "zipf", "fixed", "prefill", "uniform, jit-only region", "zipf, jit-only region"),
    )
    headers = (
        "distribution",
        "path",
        "first half us/step",
        "second half us/step",
        "whole run / eager",
        "second half speed-up",
        "records",
        "evictions",
        "not admitted",
        "postponed",
        "too rare",
        "compactions (graphs)",
        "graph MiB",
        "sizes at own size",
    )
    rows = []
    for distribution, paths in distributions.items():
        for path, r in _ordered(paths, ("eager", "replay", "bucketed", VLLM_PATH, "polymorphic")).items():
            rows.append(
                (
                    distribution,
                    path,
                    r["first_us"],
                    r["second_us"],
                    r["whole_run_vs_eager"],
                    r["second_half_speedup"],
                    r.get("records", "-"),
                    r.get("evictions", "-"),
                    r.get("not_admitted", "-"),
                    r.get("postponed", "-"),
                    r.get("too_rare", "-"),
                    f"{r['compactions']} ({r['recaptures']})" if "compactions" in r else "-",
                    r.get("graph_mib", "-"),
                    r.get("variants", "-") if path == "polymorphic" else "-",
                )
            )
    body = common.markdown_table(headers, rows)
    body += _three_sizes_table(results.get("three_sizes"))
    body += "\n\nThe eager path of a session (us per call, interleaved with the direct call):\n\n"
    body += common.markdown_table(
        ("region", "direct call us", "warming: over direct", "too rare: over direct"),
        [(k, v["direct_us"], v["warming_over_direct_us"], v["too_rare_over_direct_us"]) for k, v in overhead.items()],
    )
    body += (
        "\n\nGraph memory over many shapes of a region ending in a 32,000-wide output (MiB; "
        "target: at most 1.5x the largest shape alone):\n\n"
    )
    body += common.markdown_table(
        ("loop", "graph MiB", "of which outputs", "replays", "records", "x largest alone"),
        [(k, v["graph_mib"], v["output_mib"], v["replays"], v["records"], v["vs_alone"]) for k, v in memory.items()],
    )
    floor = results.get("bucketed_floor")
    if floor:  # (older saved runs have none)
        body += (
            "\n\nThe bucketed step against its floors: uniform sizes that need padding, blocks of "
            f"{BLOCK} calls (us; GPU: the GPU's time per step with the host ahead; host: one call "
            "with the GPU ahead, median; after eager: per step of a block after a block of eager "
            "calls, as the runs above take turns, and the host time of its first call):\n\n"
        )
        body += common.markdown_table(
            ("path", "GPU us/step", "host us/call", "after eager us/step", "first call after eager us"),
            [(k, v["gpu_us"], v["host_us"], v["after_eager_us"], v["first_call_us"]) for k, v in floor.items()],
        )
    notes = (
        f"{steps} steps per distribution (prefill: each length once), batch sizes 1..{LARGEST}, "
        f"{LAYERS} layers of a {DIM}x{DIM} matmul and two jit kernels. Targets: the "
        "default policy at most 1.05x eager's time over the whole run under every distribution; "
        "bucketed at least 2.5x faster than eager in the second half of the uniform run. Bucketed: "
        f"sizes {BUCKETS}; {VLLM_PATH}: 1, 2, 4 and every multiple of 8 up to {LARGEST} (vLLM's "
        "default capture sizes), the same code with less padding. The "
        f"jit-only rows run the same layers, {JIT_DIM} wide, with the matmul as a naive jit kernel (every "
        "launch a jit launch), eager against bucketed and polymorphic replay "
        "(capture(buckets=..., polymorphic=True))."
    )
    return body, notes


if __name__ == "__main__":
    main()
