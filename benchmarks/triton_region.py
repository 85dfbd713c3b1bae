"""Triton kernels in a region: rebound (issue 15 item 2) against staged and eager (GPU, Triton).

A region of 8 small Triton kernels (a chain of ``y = x * s + h`` over a [batch, 1024] float32
activation, ``s`` a ``dynamic(...)`` scalar, the first kernel reading a second input) called
with fresh input tensors every step (new addresses), one process, three ways:

- eager: the region called directly (8 Triton launches from Python);
- replay, rebound: under ``capture()``, with Triton launches recorded (pointers patched,
  the dynamic scalar recomputed, one graph launch);
- replay, staged: the same with ``replay.record_triton_launches(False)``, so Triton
  kernels are foreign to replay, as before: both inputs are copied into the graph's buffers
  each step (and back), and the scalar is a plain argument (keyed: one value, one graph).

Host us per step (issuing the step) and end-to-end us per step (until the GPU is done).
"""

from __future__ import annotations

import statistics
import time

import torch

import replay
from benchmarks import common

try:
    import triton
    import triton.language as tl
except ImportError:  # an optional dependency: the benchmark says so and passes
    triton = None

KERNELS, WIDTH, BATCH = 8, 1024, 16

if triton is not None:

    @triton.jit
    def fma_kernel(x_ptr, h_ptr, out_ptr, s, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, x * s + tl.load(h_ptr + offs, mask=mask), mask=mask)


def region(x, h, s):
    n = x.numel()
    grid = (triton.cdiv(n, 1024),)
    for _ in range(KERNELS):
        out = torch.empty_like(x)
        fma_kernel[grid](x, h, out, s, n, BLOCK=1024)
        x = out
    return x


def loop(step, inputs, scalar, steps: int) -> tuple[float, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for number in range(steps):
        x, h = inputs[number % len(inputs)]
        step(x, h, scalar)
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (issued - start) / steps * 1e6, (done - start) / steps * 1e6


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    if triton is None:
        print("Triton is not installed: skipped")
        return
    repeats, steps = (3, 200) if args.quick else (11, 1000)
    torch.manual_seed(0)
    inputs = [(torch.randn(BATCH, WIDTH, device="cuda"), torch.randn(BATCH, WIDTH, device="cuda")) for _ in range(16)]
    expected = region(*inputs[0], 0.5)

    rebound_session = replay.capture(record_budget=1.0)
    rebound = rebound_session.region(region)
    replay.record_triton_launches(False)
    try:
        staged_session = replay.capture(record_budget=1.0)
        staged = staged_session.region(region)
        for _ in range(3):  # warm-up, recording (staged: a retry with the inputs staged), analysis
            staged(*inputs[0], 0.5)
    finally:
        replay.record_triton_launches(True)
    for _ in range(3):
        rebound(*inputs[0], replay.dynamic(0.5))
    assert torch.equal(rebound(*inputs[0], replay.dynamic(0.5)), expected)
    assert torch.equal(staged(*inputs[0], 0.5), expected)

    paths = {
        "eager (8 Triton launches)": lambda x, h, s: region(x, h, s),
        "replay, Triton launches rebound": lambda x, h, s: rebound(x, h, replay.dynamic(s)),
        "replay, Triton inputs staged": lambda x, h, s: staged(x, h, s),
    }
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    for _ in range(repeats):  # round robin: a noisy machine's drift hits every path alike
        for name, step in paths.items():
            samples[name].append(loop(step, inputs, 0.5, steps))
    results = {}
    for name, runs in samples.items():
        results[name] = {
            "host_us": statistics.median(r[0] for r in runs),
            "end_to_end_us": statistics.median(r[1] for r in runs),
            "loops": len(runs),
            "steps": steps,
        }
    results["inputs rebound"] = [f"{c.input}: {c.choice}" for c in rebound_session.stats().inputs]
    results["inputs staged"] = [f"{c.input}: {c.choice}" for c in staged_session.stats().inputs]
    results["declined"] = {"rebound": rebound_session.stats().declined, "staged": staged_session.stats().declined}
    rebound_session.close()
    staged_session.close()
    rows = [
        (name, r["host_us"], r["end_to_end_us"])
        for name, r in results.items()
        if isinstance(r, dict) and "host_us" in r
    ]
    body = common.markdown_table(["path", "host us/step", "end-to-end us/step"], rows)
    body += (
        f"\n\n{KERNELS} Triton kernels over [{BATCH}, {WIDTH}] float32, fresh inputs every step; medians of "
        f"{repeats} loops of {steps} steps.\n\nInputs, rebound session: {', '.join(results['inputs rebound'])}; "
        f"staged session: {', '.join(results['inputs staged'])}."
    )
    common.write(args.out, "triton", "Triton kernels in a region: rebound vs staged vs eager", results, body)


if __name__ == "__main__":
    main()
