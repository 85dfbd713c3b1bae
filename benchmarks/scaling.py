"""Per-step time against region length, distinct shapes, tensor arguments and patched nodes (GPU).

Eager jit and replay side by side, with a fresh input tensor every step:

- region length: a chain of K small jit kernels (K = 1 ... 64), one shape;
- distinct shapes: a 16-kernel region whose batch size cycles over S shapes (S = 1 ... 16).

Then replay's host time per step against the number of tensor arguments A (1, 4, 16, 64) and
of kernel nodes patched per replay P (0, 1, 8, 32). Each cell is a region
of A arguments, all of shape [8, 256] float32, written out as straight-line code (see
``grid_cell``) that launches exactly 32 jit kernels, each ``y = a * (h + x_0 + ... + x_m-1)
+ b`` over a [8, 256] tensor (one ``mix`` kernel, generated per arity ``m``):

- kernel 0 starts the chain (no ``h``); kernels 1 to 31 each read the previous kernel's
  output ``h``, a tensor made inside the region (graph memory: never rebound);
- kernels 0 to P-1 also read region arguments, so their nodes must be patched on every
  replay; kernels P to 31 read no argument (``m = 0``) and are never patched;
- A >= P: patched kernel j reads the arguments i with i % P == j, so each argument feeds
  exactly one node and the A pointers are spread over the P nodes (A = 64, P = 1: one node
  of 64 input pointers; A = 64, P = 32: two arguments a node);
- A < P: patched kernel j reads the one argument j % A (A = 1, P = 32: all 32 kernels read
  the same argument, 32 nodes patched for one new pointer);
- P = 0: no kernel reads an argument (kernel 0 is the fill ``y = b``): the A arguments are
  keyed, guarded and checked for overlap, and nothing is rebound.

So a replay rebinds max(A, P) pointer parameters over P nodes (none for P = 0). Every step
passes a new tensor for every argument (A tensors from a pool of 8 sets, cycled), so every
pointer changes on every step. Per cell, in the same process and interleaved: replay (the
region under ``capture()``), torch's ``CUDAGraph.replay()`` of a ``torch.cuda.graph``
capture of the same region (rebinding nothing, so it reads its static inputs) and the raw
graph launch of that graph (``benchmarks.replay.graph_launcher``). Before timing, each cell
checks replay's output against the eager region's with ``torch.equal`` on fresh random
inputs (and torch's graph fed the same inputs by copy), that every replay patched exactly P
nodes and staged nothing; ``session.stats().patches`` over the timed replays is reported per
step. With P > 0 the output depends on every argument, so a pointer left stale changes it;
with P = 0 it depends on none (the comparison then checks only the kernels' own work, and the
patch count, 0, is the check that nothing was rebound).
"""

from __future__ import annotations

import functools
import statistics
from collections import Counter

import torch

import jitcore as jc
import replay
from benchmarks import common
from benchmarks.replay import WIDTH, chain, graph_launcher, loop

#: The argument and patched-node grid, the kernels of every cell, its tensors.
ARGUMENTS, PATCHED, KERNELS_PER_CELL, ROWS = [1, 4, 16, 64], [0, 1, 8, 32], 32, 8
#: Sets of fresh argument tensors cycled by the timed loops (a new pointer every step).
POOL = 8


def plan(arguments: int, patched: int) -> list[tuple[int, ...]]:
    """For each of the 32 kernels of a cell, the region arguments it reads (module docstring)."""
    if arguments < 1 or not 0 <= patched <= KERNELS_PER_CELL:
        raise ValueError(f"no cell for {arguments} arguments and {patched} patched nodes")
    reads: list[tuple[int, ...]] = [() for _ in range(KERNELS_PER_CELL)]
    for j in range(patched):
        if arguments >= patched:
            reads[j] = tuple(range(j, arguments, patched))
        else:
            reads[j] = (j % arguments,)
    return reads


@functools.cache
def mix(inputs: int, chained: bool):
    """A ``@jc.jit`` launcher of ``y = a * (h + x_0 + ... + x_inputs-1) + b`` (no ``h`` unless
    ``chained``), written out for this arity (a launcher takes a fixed parameter list)."""
    name = f"mix{inputs}{'c' if chained else ''}"
    tensors = (["h"] if chained else []) + [f"x{i}" for i in range(inputs)]
    terms = " + ".join(f"{t}[i]" for t in tensors) or "0.0f"
    declared = "".join(f"const float* __restrict__ {t}, " for t in tensors)
    source = (
        f"__global__ void {name}({declared}float* __restrict__ y, float a, float b, long long n) {{\n"
        "    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;\n"
        f"    if (i < n) y[i] = a * ({terms}) + b;\n"
        "}\n"
    )
    params = ", ".join([*tensors, "y", "a", "b"])
    namespace = {"__name__": __name__, "jc": jc, "kernel": jc.Kernel(source, name)}
    exec(  # a launcher per arity, from the fixed text above
        f"def {name}({params}):\n    n = y.numel()\n    kernel[jc.cdiv(n, 256), 256]({params}, n)\n",
        namespace,
    )
    return jc.jit(namespace[name])


class Cell:
    """One cell of the grid: its plan, the region's source and the region (a function of
    ``arguments`` tensors, straight-line code, so its globals are its few launchers and
    ``torch`` whatever the cell: the region's drift check costs about the same everywhere)."""

    def __init__(self, arguments: int, patched: int):
        self.arguments, self.patched = arguments, patched
        self.reads = plan(arguments, patched)
        self.name = f"args{arguments}_patched{patched}"
        names = [f"x{i}" for i in range(arguments)]
        namespace: dict[str, object] = {"__name__": __name__, "torch": torch}
        lines = [f"def {self.name}({', '.join(names)}):"]
        for k, read in enumerate(self.reads):
            launcher = mix(len(read), k > 0)
            namespace[launcher.__name__] = launcher
            inputs = (["h"] if k else []) + [names[i] for i in read]
            scale = 1.0 / len(inputs) if inputs else 1.0  # keeps every value near the inputs' range
            lines.append("    y = torch.empty_like(x0)")
            lines.append(f"    {launcher.__name__}({', '.join([*inputs, 'y'])}, {scale!r}, {1e-3 * (k + 1)!r})")
            lines.append("    h = y")
        lines.append("    return h")
        self.source = "\n".join(lines) + "\n"
        exec(self.source, namespace)  # generated from the plan above
        self.region = namespace[self.name]

    @property
    def rebound_pointers(self) -> int:
        return sum(len(read) for read in self.reads)

    def inputs(self, device: str = "cuda") -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(ROWS, WIDTH, device=device) for _ in range(self.arguments))


def measure_cell(arguments: int, patched: int, steps: int, repeats: int) -> dict[str, object]:
    """Host and end-to-end us/step of replay, torch's CUDAGraph.replay() and the raw graph
    launch for one cell, after checking replay against eager on fresh inputs."""
    cell = Cell(arguments, patched)
    region = cell.region
    inputs = {0: [cell.inputs() for _ in range(POOL)]}
    order = [0] * steps
    region(*inputs[0][0])  # compile every launcher eagerly
    session = replay.capture(record_after=0, record_budget=1.0)
    replayed = session.region(region)
    replayed(*inputs[0][0])  # recorded
    replayed(*inputs[0][1])  # analysed, replayed
    static = cell.inputs()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static_out = region(*static)
    torch.cuda.synchronize()
    launch = graph_launcher(graph)

    # correctness on fresh random data, every set kept alive so each has new pointers
    before = session.stats()
    fresh = [cell.inputs() for _ in range(3)]
    for xs in fresh:
        expected = region(*xs)
        if not torch.equal(replayed(*xs), expected):
            raise AssertionError(f"{cell.name}: replay differs from the eager region")
        for s, x in zip(static, xs):
            s.copy_(x)
        graph.replay()
        if not torch.equal(static_out, expected):
            raise AssertionError(f"{cell.name}: torch's graph differs from the eager region")
    after = session.stats()
    replays = after.replays - before.replays
    if replays != len(fresh) or after.patches - before.patches != patched * replays:
        raise AssertionError(
            f"{cell.name}: {after.patches - before.patches} node patches in {replays} replays, "
            f"expected {len(fresh)} replays patching {patched} nodes each"
        )
    if after.staged_copies != before.staged_copies:  # every argument is rebound or unused
        raise AssertionError(f"{cell.name}: replays staged inputs: {session.report()}")

    paths = {
        "replay": lambda b, xs: replayed(*xs),
        "torch CUDAGraph.replay": lambda b, xs: graph.replay(),
        "raw graph launch": lambda b, xs: launch(),
    }
    samples = {name: ([], []) for name in paths}
    before = session.stats()
    for _ in range(repeats):
        for name, step in paths.items():
            host, total = loop(step, inputs, order)
            samples[name][0].append(host)
            samples[name][1].append(total)
    after = session.stats()
    choices = Counter(c.choice for c in after.inputs if c.region == cell.name)
    session.close()
    result: dict[str, object] = {
        name: {"host_us": statistics.median(h), "end_to_end_us": statistics.median(e), "host_min_us": min(h)}
        for name, (h, e) in samples.items()
    }
    result.update(
        patches_per_step=(after.patches - before.patches) / max(after.replays - before.replays, 1),
        staged_copies_per_step=(after.staged_copies - before.staged_copies) / max(after.replays - before.replays, 1),
        rebound_pointers=cell.rebound_pointers,
        kernels=len(cell.reads),
        reads=[list(read) for read in cell.reads],
        input_choices=dict(choices),
    )
    return result


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def grid_report(grid: dict[int, dict[int, dict]]) -> tuple[str, dict[str, object]]:
    """The markdown for the argument x patched-node grid and the slopes it is read by."""
    host = {a: {p: grid[a][p]["replay"]["host_us"] for p in PATCHED} for a in ARGUMENTS}
    torch_host = {a: {p: grid[a][p]["torch CUDAGraph.replay"]["host_us"] for p in PATCHED} for a in ARGUMENTS}
    patches = {a: {p: grid[a][p]["patches_per_step"] for p in PATCHED} for a in ARGUMENTS}
    raw_host = {a: {p: grid[a][p]["raw graph launch"]["host_us"] for p in PATCHED} for a in ARGUMENTS}
    headers = ["arguments \\ patched nodes", *(f"P={p}" for p in PATCHED)]
    body = (
        "Replay host us/step against tensor arguments (rows, A) and kernel nodes patched per replay "
        f"(columns, P); {KERNELS_PER_CELL} jit kernels in every region, a fresh tensor for every argument "
        "every step (construction in the module docstring of benchmarks/scaling.py):\n\n"
    )
    body += common.markdown_table(headers, [[a, *(host[a][p] for p in PATCHED)] for a in ARGUMENTS])
    body += "\n\nThe same, as a ratio of torch's CUDAGraph.replay() of the same region (rebinding nothing):\n\n"
    body += common.markdown_table(headers, [[a, *(host[a][p] / torch_host[a][p] for p in PATCHED)] for a in ARGUMENTS])
    body += (
        "\n\nReference rows, host us/step: torch CUDAGraph.replay / raw graph launch, then node patches "
        "per replay (session.stats().patches over the timed replays):\n\n"
    )
    body += common.markdown_table(
        headers,
        [
            [a, *(f"{torch_host[a][p]:.2f} / {raw_host[a][p]:.2f}, {patches[a][p]:g}" for p in PATCHED)]
            for a in ARGUMENTS
        ],
    )
    per_argument = {p: slope(ARGUMENTS, [host[a][p] for a in ARGUMENTS]) for p in PATCHED}
    nodes = [p for p in PATCHED if p]
    per_node = {a: slope(nodes, [host[a][p] for p in nodes]) for a in ARGUMENTS}
    first_node = {a: host[a][nodes[0]] - host[a][0] for a in ARGUMENTS}
    lo, hi = ARGUMENTS[0], ARGUMENTS[-1]
    rebound = {a: "/".join(str(grid[a][p]["rebound_pointers"]) for p in nodes) for a in (lo, hi)}
    growth_args = {p: host[hi][p] - host[lo][p] for p in PATCHED}
    growth_nodes = {a: host[a][nodes[-1]] - host[a][nodes[0]] for a in ARGUMENTS}
    torch_all = [torch_host[a][p] for a in ARGUMENTS for p in PATCHED]
    ratios = [host[a][p] / torch_host[a][p] for a in ARGUMENTS for p in PATCHED]
    bigger = "arguments" if max(growth_args.values()) >= max(growth_nodes.values()) else "patched nodes"
    body += (
        "\n\nWhere it grows (least-squares slopes over the table, computed by the script):\n\n"
        "- per extra tensor argument at P fixed: "
        + ", ".join(f"P={p} {per_argument[p]:.3f} us" for p in PATCHED)
        + f". At P=0 no kernel reads an argument, so this is the per-argument cost of the region's "
        "guard (one tensor check each), the key's shape pre-key and the replay's overlap check and "
        "output-memory check (every argument's pointer read); with P>0 each argument is also a pointer "
        "parameter compared with what its node holds and packed into the node's parameters: at "
        f"P={nodes[0]} (one node holding all A pointers) that adds {per_argument[nodes[0]] - per_argument[0]:+.3f} "
        "us per argument over P=0.\n"
        f"- per extra patched node at A fixed (P from {nodes[0]} to {nodes[-1]}): "
        + ", ".join(f"A={a} {per_node[a]:.3f} us" for a in ARGUMENTS)
        + f"; the first patched node (P=0 to {nodes[0]}) adds "
        + ", ".join(f"A={a} {first_node[a]:+.2f} us" for a in ARGUMENTS)
        + f". Each patched node is one driver call updating the node in the graph exec; at A={hi} the "
        f"pointers rebound stay {rebound[hi]} over P={', '.join(map(str, nodes))} (that slope is the node "
        f"updates alone), at A={lo} they are {rebound[lo]} (each node adds one pointer too).\n"
        f"- from A={lo} to A={hi}: "
        + ", ".join(f"P={p} {growth_args[p]:+.2f} us" for p in PATCHED)
        + f"; from P={nodes[0]} to P={nodes[-1]}: "
        + ", ".join(f"A={a} {growth_nodes[a]:+.2f} us" for a in ARGUMENTS)
        + f". Over this grid host time grows most with {bigger}.\n"
        f"- torch's CUDAGraph.replay() stays at {min(torch_all):.2f} to {max(torch_all):.2f} us (it rebinds "
        f"nothing); replay is {min(ratios):.2f}x to {max(ratios):.2f}x of it."
    )
    summary = {
        "us_per_argument_at_patched": per_argument,
        "us_per_patched_node_at_arguments": per_node,
        "first_patched_node_us_at_arguments": first_node,
        "replay_over_torch_replay": {a: {p: host[a][p] / torch_host[a][p] for p in PATCHED} for a in ARGUMENTS},
    }
    return body, summary


def measure(region, shapes: list[int], steps: int, repeats: int) -> dict[str, dict[str, float]]:
    inputs = {b: [torch.randn(b, WIDTH, device="cuda") for _ in range(16)] for b in shapes}
    order = [shapes[i % len(shapes)] for i in range(steps)]
    # steady state: no recording postponed by the budget (with the default budget, the warm-up
    # below records a few shapes and the rest are recorded during the timed loops: their
    # eager steps were timed as replay's, 51.9 and 89.7 us at 8 and 16 shapes on 2026-12-01)
    session = replay.capture(record_after=0, record_budget=1.0)
    replayed = session.region(region)
    for b in shapes:  # record and analyse every shape before timing
        replayed(inputs[b][0])
        replayed(inputs[b][1])
        region(inputs[b][0])
    if session.stats().records != len(shapes):
        raise AssertionError(f"{len(shapes)} shapes, {session.stats().records} recorded before timing")
    paths = {"eager jit": lambda b, x: region(x), "replay": lambda b, x: replayed(x)}
    samples = {name: ([], []) for name in paths}
    before = session.stats()
    for _ in range(repeats):
        for name, step in paths.items():
            host, total = loop(step, inputs, order)
            samples[name][0].append(host)
            samples[name][1].append(total)
    after = session.stats()
    session.close()
    if after.eager_runs != before.eager_runs or after.records != before.records:
        raise AssertionError(f"timed replay steps ran eagerly or recorded: {before} -> {after}")
    return {
        name: {"host_us": statistics.median(h), "end_to_end_us": statistics.median(e)}
        for name, (h, e) in samples.items()
    }


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    repeats, steps = (3, 100) if args.quick else (9, 400)
    lengths = [1, 2, 4, 8, 16, 32, 64]
    by_length = {k: measure(chain(k), [8], steps, repeats) for k in lengths}
    shape_counts = [1, 2, 4, 8, 16]
    by_shapes = {s: measure(chain(16), [1 + 2 * i for i in range(s)], steps, repeats) for s in shape_counts}
    rows = [
        [
            k,
            r["eager jit"]["end_to_end_us"],
            r["replay"]["end_to_end_us"],
            r["replay"]["host_us"],
            r["eager jit"]["end_to_end_us"] / r["replay"]["end_to_end_us"],
        ]
        for k, r in by_length.items()
    ]
    body = "Region length (one shape, fresh input every step):\n\n"
    body += common.markdown_table(["kernels", "eager us/step", "replay us/step", "replay host us", "speedup"], rows)
    rows = [
        [
            s,
            r["eager jit"]["end_to_end_us"],
            r["replay"]["end_to_end_us"],
            r["replay"]["host_us"],
            r["eager jit"]["end_to_end_us"] / r["replay"]["end_to_end_us"],
        ]
        for s, r in by_shapes.items()
    ]
    body += "\n\nDistinct shapes cycled (16 kernels, fresh input every step):\n\n"
    body += common.markdown_table(["shapes", "eager us/step", "replay us/step", "replay host us", "speedup"], rows)
    body += (
        "\n\n![per-step time against region length](scaling-length.png)\n![against distinct shapes](scaling-shapes.png)"
    )
    grid = {a: {p: measure_cell(a, p, steps, repeats) for p in PATCHED} for a in ARGUMENTS}
    grid_body, grid_summary = grid_report(grid)
    body += "\n\n" + grid_body
    common.write(
        args.out,
        "scaling",
        "Per-step time against region length, distinct shapes, tensor arguments and patched nodes",
        {"by_length": by_length, "by_shapes": by_shapes, "by_arguments_and_patches": grid, "grid": grid_summary},
        body,
        notes=f"{steps} steps a loop, medians of {repeats} interleaved loops.",
    )
    for name, data, xlabel in (
        ("scaling-length", by_length, "kernels in the region"),
        ("scaling-shapes", by_shapes, "distinct shapes cycled"),
    ):
        xs = list(data)
        common.plot(
            args.out,
            name,
            f"Per-step time, eager jit vs replay ({xlabel})",
            xlabel,
            "us per step (end to end)",
            {path: (xs, [data[x][path]["end_to_end_us"] for x in xs]) for path in ("eager jit", "replay")},
            logx=True,
            logy=True,
        )


if __name__ == "__main__":
    main()
