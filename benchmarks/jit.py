"""Cache-hit cost of a jit call, against every peer, in one process (GPU benchmark).

A launcher taking three tensors and one runtime scalar (``out = alpha * x + y``), called with
a cache hit through ``@jit`` and through a ``compile()`` handle; the same kernel launched by
the raw prepacked driver call, written in Triton, as a CuPy ``RawKernel``, and the torch op.
The ``@jit`` time is broken down into key, lookup, drift check, fill and launch.
"""

from __future__ import annotations

import functools

import torch

import jitcore as jc
from benchmarks import common
from benchmarks.launch import SOURCE, N, launch_axpy, raw_paths
from jitcore import torch_native
from jitcore.backends import compiled_helpers_enabled


def triton_path(x, y, out, alpha):
    import triton
    import triton.language as tl

    @triton.jit
    def axpy_triton(X, Y, Out, alpha, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(Out + offsets, alpha * tl.load(X + offsets, mask=mask) + tl.load(Y + offsets, mask=mask), mask=mask)

    grid = (triton.cdiv(N, 256),)
    return lambda: axpy_triton[grid](x, y, out, alpha, N, BLOCK=256)


WITH_HELPER_JIT = "jitcore @jit call, torch-side helper"
WITH_HELPER_HANDLE = "jitcore compile() handle, torch-side helper"


def torch_side_helper():
    """(the torch-side native helper for this torch, built here if it was not, or None; why not)."""
    found, reason = torch_native.load()
    if found is None and compiled_helpers_enabled():
        try:
            torch_native.build(quiet=True)
        except (RuntimeError, OSError) as error:
            return None, f"it could not be built ({str(error).splitlines()[0]})"
        found, reason = torch_native.load()
    return found, reason


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    repeats, calls = (3, 500) if args.quick else (25, 2000)
    x, y = torch.randn(N, device="cuda"), torch.randn(N, device="cuda")
    out = torch.full((N,), float("nan"), device="cuda")
    alpha = 1.5
    with torch_native.using(None):  # the paths without the torch-side helper
        launch_axpy(x, y, out, alpha)
        torch.cuda.synchronize()
        torch.testing.assert_close(out, alpha * x + y, rtol=1e-6, atol=1e-5)  # the kernel may fuse into an FMA
        launch_axpy(x, y, out, alpha)
        handle = jc.compile(launch_axpy, x, y, out, alpha)
    helper, helper_note = torch_side_helper()
    if helper is not None:  # the same launcher again, its guard and launch made with the helper
        with torch_native.using(helper):
            launch_with = jc.jit(launch_axpy.__wrapped__)  # the same function, a second launcher
            for _ in range(2):
                out.fill_(float("nan"))
                launch_with(x, y, out, alpha)
                torch.cuda.synchronize()
                torch.testing.assert_close(out, alpha * x + y, rtol=1e-6, atol=1e-5)
            handle_with = jc.compile(launch_with, x, y, out, alpha)
    prepacked, _tuple, _backend_launch, _keep, native = raw_paths(x, y, out, alpha)
    steps = jc.hit_path_parts(launch_axpy, x, y, out, alpha)  # each step of a hit, run alone
    paths = {
        "raw prepacked driver launch": prepacked,
        **({"native prepacked launch (C helper)": native} if native else {}),
        "jitcore compile() handle": lambda: handle(x, y, out, alpha),
        "jitcore @jit call": lambda: launch_axpy(x, y, out, alpha),
        "torch.add(out=)": lambda: torch.add(y, x, alpha=alpha, out=out),
    }
    without = functools.partial(torch_native.use_data_pointer_reader, None)
    setups = {name: without for name in paths}
    if helper is not None:
        paths[WITH_HELPER_JIT] = lambda: launch_with(x, y, out, alpha)
        paths[WITH_HELPER_HANDLE] = lambda: handle_with(x, y, out, alpha)
        setups[WITH_HELPER_JIT] = setups[WITH_HELPER_HANDLE] = functools.partial(
            torch_native.use_data_pointer_reader, helper
        )
    try:
        paths["Triton kernel[grid](...)"] = triton_path(x, y, out, alpha)
    except Exception as exc:
        print(f"Triton skipped: {exc}")
    try:
        import cupy
        import numpy as np

        raw = cupy.RawKernel(SOURCE, "axpy_f")
        cargs = (cupy.from_dlpack(x), cupy.from_dlpack(y), cupy.from_dlpack(out), np.float32(alpha), np.int64(N))
        paths["CuPy RawKernel"] = lambda: raw((N // 256,), (256,), cargs)
    except Exception as exc:
        print(f"CuPy skipped: {exc}")
    results = common.compare(paths, calls=calls, repeats=repeats, sync=torch.cuda.synchronize, setups=setups)
    torch_native.use_data_pointer_reader(torch_native.module())
    breakdown = common.compare(
        {
            "key (lean key + current device)": steps["key"],
            "lookup (LRU dict)": steps["lookup"],
            "drift check": steps["drift check"],
            "fill (call state, launch replaced by a no-op)": steps["fill"],
        },
        calls=calls * 5,
        repeats=repeats,
    )
    floor = results["raw prepacked driver launch"]["median_us"]
    rows = [[name, r["median_us"], r["min_us"], r["median_us"] / floor] for name, r in results.items()]
    body = common.markdown_table(["path", "median us/call", "min us", "x raw prepacked"], rows)
    jit_ratio = results["jitcore @jit call"]["median_us"] / floor
    pinned_ratio = results["jitcore compile() handle"]["median_us"] / floor
    body += (
        f"\n\n`@jit` / raw: **{jit_ratio:.3f}x** (target at most 1.25x); "
        f"`compile()` handle / raw: **{pinned_ratio:.3f}x** (target at most 1.05x).\n\n"
    )
    ratios = {}
    if helper is not None:
        helper_jit = results[WITH_HELPER_JIT]["median_us"] / floor
        helper_handle = results[WITH_HELPER_HANDLE]["median_us"] / floor
        ratios.update(helper_jit_over_raw=helper_jit, helper_pinned_over_raw=helper_handle)
        body += (
            f"With the torch-side native helper (`python -m jitcore.torch_native`; docs/kernels.md): "
            f"`@jit` / raw **{helper_jit:.3f}x**, `compile()` handle / raw **{helper_handle:.3f}x**.\n\n"
        )
    else:
        body += f"The torch-side native helper was not measured: {helper_note}.\n\n"
    body += "Breakdown of the `@jit` hit path (each part timed alone):\n\n"
    parts = [[name, r["median_us"]] for name, r in breakdown.items()]
    parts.append(["launch (raw prepacked driver call)", floor])
    parts.append(["sum of parts", sum(p[1] for p in parts)])
    body += common.markdown_table(["part", "median us"], parts)
    common.plot(
        args.out,
        "jit",
        "Host time per cache-hit call (us, median)",
        "us per call",
        "",
        {name: ([0], [r["median_us"]]) for name, r in results.items()},
        bars=True,
    )
    body += "\n\n![host time per call](jit.png)"
    results.update(breakdown=breakdown, jit_over_raw=jit_ratio, pinned_over_raw=pinned_ratio, **ratios)
    common.write(
        args.out,
        "jit",
        "Cache-hit cost of a jit call",
        results,
        body,
        notes="Host time per call; a loop timed with perf_counter, synchronized before and after; "
        "medians of interleaved loops.",
    )


if __name__ == "__main__":
    main()
