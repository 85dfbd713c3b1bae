"""Lean vs full cache keys: host time per tensor argument (CPU benchmark).

Times, per tensor argument, the lean signature (dtype, stride() and the device read straight
from the tensor), the full signature (a TensorAdaptor built through DLPack) and a whole lean
key from a KeyPlan for launchers with 1, 4 and 16 tensor arguments. Runs on CUDA tensors when
a GPU is present (the case that matters), else on CPU tensors.
"""

from __future__ import annotations

import torch

import jitcore as jc
from benchmarks import common


def launcher_with(count: int):
    """A launcher signature with ``count`` tensor parameters (its body never runs)."""
    namespace: dict[str, object] = {}
    exec(f"def launch({', '.join(f't{i}' for i in range(count))}):\n    pass\n", namespace)
    return namespace["launch"]


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    repeats, calls = (3, 2000) if args.quick else (15, 20000)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tensor = torch.randn(64, 128, device=device)
    results: dict[str, dict] = {"device": device}
    single = common.compare(
        {
            "lean signature": lambda: jc.lean_cache_signature(tensor),
            "full signature (DLPack)": lambda: jc.TensorAdaptor(tensor).__cache_signature__(),
            # the floor: any lean key reads at least these four attributes of every tensor
            "bare read of (dtype, shape, stride(), device)": lambda: (
                tensor.dtype,
                tensor.shape,
                tensor.stride(),
                tensor.device,
            ),
        },
        calls=calls // 10,
        repeats=repeats,
    )
    results["per_signature"] = single
    rows = [[name, r["median_us"], r["min_us"]] for name, r in single.items()]
    speedups = []
    for count in (1, 4, 16):
        plan = jc.KeyPlan.of(launcher_with(count))
        tensors = [torch.randn(32, 32 + i, device=device) for i in range(count)]
        lean, full = plan.lean_key, plan.full_key
        timed = common.compare(
            {
                "lean key": lambda lean=lean, tensors=tensors: lean(*tensors),
                "full key": lambda full=full, tensors=tensors: full(*tensors),
            },
            calls=max(calls // (10 * count), 20),
            repeats=repeats,
        )
        results[f"key_{count}"] = timed
        lean_per = timed["lean key"]["median_us"] / count
        full_per = timed["full key"]["median_us"] / count
        speedups.append(full_per / lean_per)
        rows.append([f"whole lean key, {count} tensor args (per arg)", lean_per, timed["lean key"]["min_us"] / count])
        rows.append([f"whole full key, {count} tensor args (per arg)", full_per, timed["full key"]["min_us"] / count])
    results["full_over_lean"] = speedups
    body = common.markdown_table(["what", "median us", "min us"], rows)
    body += "\n\nFull key / lean key per argument (1, 4, 16 args): " + ", ".join(f"{s:.1f}x" for s in speedups)
    floor = single["bare read of (dtype, shape, stride(), device)"]["median_us"]
    results["floor_us"] = floor
    body += (
        f"\n\nThe bare attribute read every lean key needs costs {floor:.3f} us per tensor on this machine; "
        f"the whole lean key for 16 tensors is {rows[-2][1] / floor:.2f}x that per tensor."
    )
    body += (
        f"\n\nTensors on `{device}`. Targets: lean key at most 0.5 us per tensor argument, "
        "at least 5x faster than the full key."
    )
    name = "keys" if device == "cpu" else f"keys-{device}"  # keys.md is the CPU-machine table the target is set on
    common.write(args.out, name, f"Cache keys: lean vs full ({device} tensors)", results, body)


if __name__ == "__main__":
    main()
