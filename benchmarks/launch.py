"""Host cost of one kernel launch, path by path, in one process (GPU benchmark).

The same tiny kernel (``out = alpha * x + y`` over 1024 floats) launched through:

- the raw prepacked driver call: the binding's launch (cuda-bindings' ``cuLaunchKernel``)
  with a prepared function, stream object and ``void*`` array address (the floor);
- the same prepacked call through jitreplay's C helper (``jitcore.backends._native``), on raw
  handles, where the backend uses it;
- the vendor call's ``(values, types)`` tuple form;
- the backend's prepacked path: the launch code a call state runs (stream lookup, checked
  status), from the backend's own template;
- a jitcore ``compile()`` handle and the ``@jit`` function (for context; see jit.md);
- CuPy ``RawKernel`` and a torch op (``torch.add(..., out=)``).
"""

from __future__ import annotations

import ctypes

import torch

import jitcore as jc
from benchmarks import common
from jitcore.backends import get_backend
from jitcore.backends.abi import PackedParams

SOURCE = r"""
extern "C" __global__ void axpy_f(const float* __restrict__ x, const float* __restrict__ y, float* __restrict__ out,
                                  float alpha, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = alpha * x[i] + y[i];
}
"""
N = 1024
kernel = jc.Kernel(SOURCE, "axpy_f")


@jc.jit
def launch_axpy(x, y, out, alpha):
    n = x.numel()
    kernel[jc.cdiv(n, 256), 256](x, y, out, alpha, n)


def raw_paths(x, y, out, alpha):
    """The vendor launch itself, called the way a hand-written prepacked launcher would."""
    backend = get_backend()
    device = torch.cuda.current_device()
    function = kernel.instantiate().function(device)
    raw_stream = torch.cuda.current_stream().cuda_stream
    stream = backend.stream_object(raw_stream)
    launch = getattr(backend, "binding_launch", backend.raw_launch)  # the binding's call: the floor
    packed = PackedParams(kernel.instantiate().layout)
    offset, packer = kernel.instantiate().layout.struct_for(range(5))
    packer.pack_into(packed.buffer, offset, x.data_ptr(), y.data_ptr(), out.data_ptr(), alpha, N)
    address, handle, grid = packed.address, function.handle, N // 256
    values = (
        (x.data_ptr(), y.data_ptr(), out.data_ptr(), alpha, N),
        (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_longlong),
    )

    def prepacked():
        launch(handle, grid, 1, 1, 256, 1, 1, 0, stream, address, 0)

    def tuple_form():
        launch(handle, grid, 1, 1, 256, 1, 1, 0, stream, values, 0)

    native = None
    if getattr(backend, "native", False):
        native_launch, function_address = backend.raw_launch, function.address

        def native():
            native_launch(function_address, grid, 1, 1, 256, 1, 1, 0, raw_stream, address, 0)

    # what a call state runs per launch, from the backend's template
    hot_stream = backend.hot_namespace["_stream_object"](raw_stream)
    hot_function = backend.launch_function(function)
    namespace = dict(backend.hot_namespace, _f=hot_function, _addr=address, _stream=hot_stream)
    source = "def backend_launch():\n" + "\n".join(
        "    " + line
        for line in backend.launch_template.format(
            function="_f",
            gx=grid,
            gy=1,
            gz=1,
            bx=256,
            by=1,
            bz=1,
            shared=0,
            stream="_stream",
            params="_addr",
            label="'axpy_f'",
        ).splitlines()
    )
    exec(source, namespace)
    return prepacked, tuple_form, namespace["backend_launch"], packed, native


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    repeats, calls = (3, 500) if args.quick else (25, 2000)
    x, y, out = (torch.randn(N, device="cuda") for _ in range(3))
    alpha = 1.5
    launch_axpy(x, y, out, alpha)
    prepacked, tuple_form, backend_launch, _keep, native = raw_paths(x, y, out, alpha)
    handle = jc.compile(launch_axpy, x, y, out, alpha)
    paths = {
        "raw prepacked driver launch": prepacked,
        "raw (values, types) tuple form": tuple_form,
        **({"native prepacked launch (C helper)": native} if native else {}),
        "backend prepacked path": backend_launch,
        "jitcore compile() handle": lambda: handle(x, y, out, alpha),
        "jitcore @jit call": lambda: launch_axpy(x, y, out, alpha),
        "torch.add(out=)": lambda: torch.add(y, x, alpha=alpha, out=out),
    }
    try:
        import cupy
        import numpy as np

        raw = cupy.RawKernel(SOURCE, "axpy_f")
        cx, cy, co = (cupy.from_dlpack(t) for t in (x, y, out))
        cargs = (cx, cy, co, np.float32(alpha), np.int64(N))
        paths["CuPy RawKernel"] = lambda: raw((N // 256,), (256,), cargs)
    except Exception as exc:  # cupy missing: say so in the table
        print(f"CuPy skipped: {exc}")
    results = common.compare(paths, calls=calls, repeats=repeats, sync=torch.cuda.synchronize)
    floor = results["raw prepacked driver launch"]["median_us"]
    rows = [[name, r["median_us"], r["min_us"], r["median_us"] / floor] for name, r in results.items()]
    body = common.markdown_table(["path", "median us/launch", "min us", "x raw prepacked"], rows)
    ratio = results["backend prepacked path"]["median_us"] / floor
    body += f"\n\nBackend prepacked path / raw prepacked launch: **{ratio:.3f}x** (target at most 1.05x)."
    results["backend_over_raw"] = ratio
    common.plot(
        args.out,
        "launch",
        "Host time per launch (us, median)",
        "us per launch",
        "",
        {name: ([0], [r["median_us"]]) for name, r in results.items() if isinstance(r, dict)},
        bars=True,
    )
    body += "\n\n![host time per launch](launch.png)"
    common.write(
        args.out,
        "launch",
        "Host cost per kernel launch",
        results,
        body,
        notes="Host time: a loop of launches timed with perf_counter, synchronized before and after; "
        "medians of interleaved loops.",
    )


if __name__ == "__main__":
    main()
