"""Per-step time against region length and against the number of distinct shapes (GPU).

Eager jit and replay side by side, with a fresh input tensor every step:

- region length: a chain of K small jit kernels (K = 1 ... 64), one shape;
- distinct shapes: a 16-kernel region whose batch size cycles over S shapes (S = 1 ... 16).
"""

from __future__ import annotations

import statistics

import torch

import replay
from benchmarks import common
from benchmarks.replay import WIDTH, chain, loop


def measure(region, shapes: list[int], steps: int, repeats: int) -> dict[str, dict[str, float]]:
    inputs = {b: [torch.randn(b, WIDTH, device="cuda") for _ in range(16)] for b in shapes}
    order = [shapes[i % len(shapes)] for i in range(steps)]
    session = replay.capture(record_after=0)
    replayed = session.region(region)
    for b in shapes:  # record and analyse every shape before timing
        replayed(inputs[b][0])
        replayed(inputs[b][1])
        region(inputs[b][0])
    paths = {"eager jit": lambda b, x: region(x), "replay": lambda b, x: replayed(x)}
    samples = {name: ([], []) for name in paths}
    for _ in range(repeats):
        for name, step in paths.items():
            host, total = loop(step, inputs, order)
            samples[name][0].append(host)
            samples[name][1].append(total)
    session.close()
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
    common.write(
        args.out,
        "scaling",
        "Per-step time against region length and distinct shapes",
        {"by_length": by_length, "by_shapes": by_shapes},
        body,
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
