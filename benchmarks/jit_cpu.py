"""The jit's Python-side cost with the driver call replaced by a no-op (CPU benchmark).

A launcher with 1, 4 and 16 tensor arguments (one kernel taking that many pointers plus the
element count), called through ``@jit`` and through a ``compile()`` handle, with the null
backend standing in for the driver: what remains is key, lookup, drift check and packing.
"""

from __future__ import annotations

import torch

import jitcore as jc
from benchmarks import common
from jitcore.backends import use_backend
from jitcore.backends.null import NullBackend


def launcher_for(count: int):
    params = ", ".join(f"const float* p{i}" for i in range(count))
    kernel = jc.Kernel(f"__global__ void touch({params}, long long n) {{}}", "touch")
    names = ", ".join(f"t{i}" for i in range(count))
    namespace = {"jc": jc, "kernel": kernel}
    exec(f"def launch({names}):\n    n = t0.numel()\n    kernel[jc.cdiv(n, 256), 256]({names}, n)\n", namespace)
    return jc.jit(namespace["launch"])


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    repeats, calls = (3, 2000) if args.quick else (15, 20000)
    results, rows = {}, []
    with use_backend(NullBackend()):
        for count in (1, 4, 16):
            launch = launcher_for(count)
            tensors = [torch.randn(1024) for _ in range(count)]
            launch(*tensors)
            handle = jc.compile(launch, *tensors)
            timed = common.compare(
                {
                    "@jit call": lambda launch=launch, tensors=tensors: launch(*tensors),
                    "compile() handle": lambda handle=handle, tensors=tensors: handle(*tensors),
                },
                calls=calls // count,
                repeats=repeats,
            )
            results[count] = timed
            rows.append(
                [
                    count,
                    timed["@jit call"]["median_us"],
                    timed["compile() handle"]["median_us"],
                    timed["@jit call"]["median_us"] / count,
                ]
            )
    body = common.markdown_table(["tensor args", "@jit call us", "compile() handle us", "@jit per tensor arg us"], rows)
    body += "\n\nThe launch is a no-op Python function with the vendor call's arity; CPU tensors."
    common.write(args.out, "jit-cpu", "jit Python-side cost, driver call replaced by a no-op", results, body)


if __name__ == "__main__":
    main()
