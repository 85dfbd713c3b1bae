"""Triton kernels in a region: launches rebound against inputs staged and eager (GPU, Triton).

A region of 8 small Triton kernels (a chain of ``y = x * s + h`` over a [batch, 1024] float32
activation, ``s`` a ``dynamic(...)`` scalar, the first kernel reading a second input) called
with fresh input tensors every step (new addresses), one process, three ways:

- eager: the region called directly (8 Triton launches from Python);
- replay, rebound: under ``capture()``, with Triton launches recorded (pointers patched,
  the dynamic scalar recomputed, one graph launch);
- replay, staged: the same with ``replay.record_triton_launches(False)``, so Triton
  kernels are foreign to replay: both inputs are copied into the graph's buffers
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


def loop(step, inputs, scalar_of, steps: int) -> tuple[float, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for number in range(steps):
        x, h = inputs[number % len(inputs)]
        step(x, h, scalar_of(number))
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (issued - start) / steps * 1e6, (done - start) / steps * 1e6


#: (name, batch rows, the scalar of step k): small inputs with a fixed scalar (the host cost
#: of patching against staging's copies), large inputs (staging's copies cost GPU time), and a
#: scalar new every step (a decode position: staged, it is a plain argument and every value a
#: new key)
SCENARIOS = [
    ("small inputs, fixed scalar", BATCH, lambda k: 0.5),
    ("large inputs, fixed scalar", 4096, lambda k: 0.5),
    ("small inputs, scalar new every step", BATCH, lambda k: 0.5 + k / 1024),
]


def measure(batch: int, scalar_of, repeats: int, steps: int) -> dict:
    inputs = [(torch.randn(batch, WIDTH, device="cuda"), torch.randn(batch, WIDTH, device="cuda")) for _ in range(8)]
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
    probe = scalar_of(7)
    assert torch.equal(rebound(*inputs[1], replay.dynamic(probe)), region(*inputs[1], probe))

    paths = {
        "eager (8 Triton launches)": lambda x, h, s: region(x, h, s),
        "replay, Triton launches rebound": lambda x, h, s: rebound(x, h, replay.dynamic(s)),
        "replay, Triton inputs staged": lambda x, h, s: staged(x, h, s),
    }
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    for _ in range(repeats):  # round robin: a noisy machine's drift hits every path alike
        for name, step in paths.items():
            samples[name].append(loop(step, inputs, scalar_of, steps))
    results: dict = {}
    for name, runs in samples.items():
        results[name] = {
            "host_us": statistics.median(r[0] for r in runs),
            "end_to_end_us": statistics.median(r[1] for r in runs),
            "loops": len(runs),
            "steps": steps,
        }
    results["inputs rebound"] = [f"{c.input}: {c.choice}" for c in rebound_session.stats().inputs]
    results["inputs staged"] = [f"{c.input}: {c.choice}" for c in staged_session.stats().inputs]
    for label, session in (("rebound", rebound_session), ("staged", staged_session)):
        stats = session.stats()
        results[f"{label} session"] = {
            "replays": stats.replays,
            "eager_runs": stats.eager_runs,
            "records": stats.records,
            "declined": stats.declined,
            "patches_per_replay": stats.patches / max(stats.replays, 1),
        }
    rebound_session.close()
    staged_session.close()
    return results


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    if triton is None:
        print("Triton is not installed: skipped")
        return
    repeats, steps = (3, 200) if args.quick else (9, 600)
    torch.manual_seed(0)
    results, rows = {}, []
    for name, batch, scalar_of in SCENARIOS:
        measured = results[name] = measure(batch, scalar_of, repeats, steps)
        eager = measured["eager (8 Triton launches)"]["end_to_end_us"]
        for path, r in measured.items():
            if isinstance(r, dict) and "host_us" in r:
                rows.append((name, path, r["host_us"], r["end_to_end_us"], eager / r["end_to_end_us"]))
    body = common.markdown_table(
        ["scenario", "path", "host us/step", "end-to-end us/step", "speed-up vs eager (e2e)"], rows
    )
    body += (
        f"\n\n{KERNELS} Triton kernels over [batch, {WIDTH}] float32 (small: {BATCH} rows, large: 4096), "
        f"fresh inputs every step (8 sets cycled); medians of {repeats} loops of {steps} steps. Rebound: each "
        "replay patches every node that reads an input (here all 8: each kernel reads the second input). "
        "Staged: each replay's graph copies both inputs into its buffers and back (Triton pointers "
        "count as written), patching only the copy kernels; with a scalar new every step each value is a new "
        "key, so the staged session runs eagerly.\n\n"
        + "\n".join(
            f"- {name}: rebound session {results[name]['rebound session']}; staged session "
            f"{results[name]['staged session']}; inputs {', '.join(results[name]['inputs rebound'])} / "
            f"{', '.join(results[name]['inputs staged'])}."
            for name, _, _ in SCENARIOS
        )
    )
    common.write(args.out, "triton", "Triton kernels in a region: rebound vs staged vs eager", results, body)


if __name__ == "__main__":
    main()
