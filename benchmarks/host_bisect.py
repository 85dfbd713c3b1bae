"""Replay host time per step, comparable across commits (GPU).

The 32-kernel chain of benchmarks/replay.py over 8 shapes, written only with the API every
commit since 2026-11-29 has (``jc.Kernel``, ``@jc.jit``, ``replay.capture(record_after=0)``),
so the same file measures an old tree checked out beside the current one::

    git worktree add /tmp/old 3c298b5
    PYTHONPATH=/tmp/old:. python -P -m benchmarks.host_bisect   # -P: the old tree, not ./jitcore
    PYTHONPATH=. python -m benchmarks.host_bisect

Each run prints replay's host us/step and torch's ``CUDAGraph.replay()`` of the same region
(medians of 15 interleaved loops) and the tree it imported. docs/benchmarks/host_bisect.md
holds the runs that located the rise of 2026-11-30 (the exactness checks).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import time

import torch

import jitcore as jc
import replay

SOURCE = r"""
__global__ void affine(const float* __restrict__ x, float* __restrict__ y, float a, float b, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}
"""
kernel = jc.Kernel(SOURCE, "affine")
WIDTH, SHAPES = 256, [1, 2, 4, 8, 12, 16, 24, 32]


@jc.jit
def affine(x, y, a, b):
    n = x.numel()
    kernel[jc.cdiv(n, 256), 256](x, y, a, b, n)


def region(x):
    h = x
    for k in range(32):
        y = torch.empty_like(h)
        affine(h, y, 1.0 + k * 1e-3, 1e-3)
        h = y
    return h


def main() -> None:
    torch.manual_seed(0)
    inputs = {b: [torch.randn(b, WIDTH, device="cuda") for _ in range(16)] for b in SHAPES}
    for b in SHAPES:
        region(inputs[b][0])
    session = replay.capture(record_after=0)
    step = session.region(region)
    for b in SHAPES:
        for i in range(3):
            step(inputs[b][i])
    time.sleep(1.0)
    for b in SHAPES:
        for i in range(3):
            step(inputs[b][i])
    graphs = {}
    for b in SHAPES:
        g = torch.cuda.CUDAGraph()
        s = torch.randn(b, WIDTH, device="cuda")
        with torch.cuda.graph(g):
            region(s)
        graphs[b] = g
    order = [SHAPES[i % len(SHAPES)] for i in range(800)]

    def loop_host(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for number, b in enumerate(order):
            fn(b, inputs[b][number % 16])
        h = time.perf_counter()
        torch.cuda.synchronize()
        return (h - t) / len(order) * 1e6

    paths = {"replay": lambda b, x: step(x), "torch replay": lambda b, x: graphs[b].replay()}
    samples = {k: [] for k in paths}
    for rep in range(15):
        for name in list(paths) if rep % 2 else list(paths)[::-1]:
            samples[name].append(loop_host(paths[name]))
    res = {k: round(statistics.median(v), 3) for k, v in samples.items()}
    res["tree"] = os.path.dirname(importlib.util.find_spec("jitcore").origin)
    res["stats"] = {k: getattr(session.stats(), k) for k in ("replays", "eager_runs", "records", "patches")}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
