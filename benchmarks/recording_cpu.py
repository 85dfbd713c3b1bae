"""A recording's host work besides the driver, on the CPU (null backend).

The replay benchmark's region (a chain of 32 ``y = a*x + b`` jit kernels, each output made by
``torch.empty_like``) on CPU tensors, with the null backend standing in for the driver (a
launch that runs nothing, behind the C helper's packed launch where it was built, as on the
CUDA backend). Each step of a recording's host work is timed on its own
(``replay.instrumentation.RecordingSteps``):

- the region called plainly, and with the recorder a capture installs: the difference is the
  jit's launch reports, per launch; and with a recorder whose capture tail is a Python function
  around the C query (how the CUDA backend answered it before the query's answer was made in
  C: ``_native.CaptureTail``), the difference the Python frame per launch;
- what the capture keeps of the records: the extents of pointers into inputs, and the
  records without their tensors;
- the launch views the analysis makes of them, and the rebinding plan over kernel nodes that
  hold those launches (each node known by its handle, as a capture reports it).

Nothing here captures or launches: the driver's own work (capture, instantiate, the node
reads) is the GPU benchmark's (``replay``).
"""

from __future__ import annotations

import torch

import jitcore.recorder
from benchmarks import common
from benchmarks.replay import KERNELS, WIDTH, chain
from jitcore.backends import use_backend
from jitcore.backends.null import NullBackend
from replay import instrumentation

BATCH = 8
region = chain(KERNELS)  # the replay benchmark's region, CPU tensors here


def null_backend() -> tuple[NullBackend, str]:
    """The null backend, packing in C where the helper was built (as the CUDA backend does)."""
    try:
        return NullBackend(packed=True), "packed launch (csrc/jitcore_native.c)"
    except ValueError:
        return NullBackend(), "struct packing (no C helper)"


def python_tail(backend: NullBackend):
    """A capture tail answered in Python around the C capture query (a query that answers "not
    capturing"), as a backend without ``_native.CaptureTail`` answers it; None without the helper."""
    native = getattr(backend, "_packed", None)
    if native is None:
        return None
    query = native.bind("capture_info", "cuStreamGetCaptureInfo", native.NULL_CAPTURE_INFO)

    def capture_tail(stream: int) -> tuple | None:
        status, capture_status, nodes = query(stream)
        return None if status or capture_status != 1 else nodes

    return capture_tail


def recorded_with_tail(fn, args: tuple, tail) -> list:
    """``fn(*args)`` under a recording's recorder whose sink asks ``tail`` for each launch's node."""
    from replay import recording

    recorder = recording._Recorder(jitcore.backends.get_backend())
    recorder.launch_sink = (recorder.records, recorder.nodes, tail)
    with jitcore.recorder.recording(recorder):
        fn(*args)
    return recorder.records


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    repeats, calls = (3, 30) if args.quick else (15, 300)
    backend, packing = null_backend()
    with use_backend(backend):
        x = torch.randn(BATCH, WIDTH)
        region(x)  # the jit's misses, before anything is timed
        steps = instrumentation.RecordingSteps(region, (x,))
        paths = {
            "region, no recorder": lambda: region(x),
            "region under the recorder": steps.region,
            **(
                {"region under the recorder, tail asked in Python": lambda: recorded_with_tail(region, (x,), tail)}
                if (tail := python_tail(backend)) is not None
                else {}
            ),
            "records kept (extents, tensors dropped)": steps.keep,
            "launch views": steps.views,
            "rebinding plan": steps.plan,
        }
        timed = common.compare(paths, calls=calls, repeats=repeats, warmup=20)
    us = {name: t["median_us"] for name, t in timed.items()}
    reports = us["region under the recorder"] - us["region, no recorder"]
    python_tails = us.get("region under the recorder, tail asked in Python", us["region under the recorder"])
    tail_saved = python_tails - us["region under the recorder"]
    after_region = us["records kept (extents, tensors dropped)"]
    analysis = us["launch views"] + us["rebinding plan"]
    rows = [[name, value, value / KERNELS] for name, value in us.items()]
    body = common.markdown_table(["step", "us", f"us per launch ({KERNELS} launches)"], rows)
    body += (
        f"\n\nThe jit's launch reports cost {reports:.1f} us over the region's {KERNELS} launches "
        f"({reports / KERNELS:.2f} us a launch), the capture tail asked from C rather than through Python saves "
        f"{tail_saved / KERNELS:.2f} us a launch; the records kept after the capture {after_region:.1f} us; "
        f"the analysis of the key's second call (launch views and plan) {analysis:.1f} us. Launches: {packing}."
    )
    results = {
        "steps_us": timed,
        "reports_us": reports,
        "reports_per_launch_us": reports / KERNELS,
        "tail_in_c_saves_per_launch_us": tail_saved / KERNELS,
        "records_kept_us": after_region,
        "analysis_us": analysis,
        "launches": KERNELS,
        "packing": packing,
    }
    common.write(
        args.out,
        "recording-cpu",
        "A recording's host work besides the driver (CPU, null backend)",
        results,
        body,
        notes=f"CPU tensors [{BATCH}, {WIDTH}]; medians of {repeats} loops of {calls} calls each.",
    )


if __name__ == "__main__":
    main()
