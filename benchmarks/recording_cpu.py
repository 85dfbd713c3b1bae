"""A recording's host work besides the driver, on the CPU (null backend).

The replay benchmark's region (a chain of 32 ``y = a*x + b`` jit kernels, each output made by
``torch.empty_like``) on CPU tensors, with the null backend standing in for the driver (a
launch that runs nothing, behind the C helper's packed launch where it was built, as on the
CUDA backend). Each step of a recording's host work is timed on its own
(``replay.recording_steps.RecordingSteps``):

- the region called plainly, and with the recorder a capture installs: the difference is the
  jit's launch reports, per launch; and with a recorder whose capture tail is a Python function
  around the backend's C one (a Python frame per launch, as where the tail is not a
  ``_native.CaptureTail``);
- what the capture keeps of the records: the extents of pointers into inputs, and the
  records without their tensors;
- the launch views the analysis makes of them, and the rebinding plan over kernel nodes that
  hold those launches (each node known by its handle, as a capture reports it);
- the key's second call on a capture shaped like the decode sample's
  (tests/replay/sample_capture.py: jit launches over ten arguments, a cuBLAS-like kernel node per
  matmul, the output copied into memory of its own): its rebinding plan (the scan of the
  foreign nodes' parameters included) and the build of its replay (``RecordedGraph``: output
  slots, node updaters doing nothing, the generated function, the C step's program).

Nothing here captures or launches: the driver's own work (capture, instantiate, the node
reads) is the GPU benchmark's (``replay``).
"""

from __future__ import annotations

import torch

from benchmarks import common
from benchmarks.replay import KERNELS, WIDTH, chain
from jitcore.backends import use_backend
from jitcore.backends.null import NullBackend
from replay import recording_steps
from tests.replay import sample_capture

BATCH = 8
SAMPLE_BATCH = 4
SAMPLE_PLAN = "sample-like capture: rebinding plan"
SAMPLE_BUILD = "sample-like capture: replay build"
SAMPLE_STEPS = (SAMPLE_PLAN, SAMPLE_BUILD)
region = chain(KERNELS)  # the replay benchmark's region, CPU tensors here


def null_backend() -> tuple[NullBackend, str]:
    """The null backend, packing in C where the helper was built (as the CUDA backend does)."""
    try:
        return NullBackend(packed=True), "packed launch (csrc/jitcore_native.c)"
    except ValueError:
        return NullBackend(), "struct packing (no C helper)"


def python_tail(backend: NullBackend):
    """A capture tail answered through a Python function around the backend's C one (as a
    backend without ``_native.CaptureTail`` answers it: a Python frame per launch)."""
    tail = backend.capture_tail_function()

    def capture_tail(stream: int) -> tuple | None:
        return tail(stream)

    return capture_tail


class TailOf:
    """What a recording's recorder reads of a backend: its capture tail (``capture_tail_function``)."""

    def __init__(self, tail) -> None:
        self.tail = tail

    def capture_tail_function(self):
        return self.tail

    def capture_tail(self, stream: int) -> tuple | None:
        return self.tail(stream)


def _chain_steps(backend: NullBackend, calls: int, repeats: int) -> dict[str, dict]:
    """The chain's recording steps, each timed on its own."""
    with use_backend(backend):
        x = torch.randn(BATCH, WIDTH)
        region(x)  # the jit's misses, before anything is timed
        steps = recording_steps.RecordingSteps(region, (x,))
        python_steps = recording_steps.RecordingSteps(region, (x,))
        python_steps.backend = TailOf(python_tail(backend))  # its recorder's tail: through Python
        paths = {
            "region, no recorder": lambda: region(x),
            "region under the recorder": steps.region,
            "region under the recorder, tail asked in Python": python_steps.region,
            "records kept (extents, tensors dropped)": steps.keep,
            "launch views": steps.views,
            "rebinding plan": steps.plan,
        }
        timed = common.compare(paths, calls=calls, repeats=repeats, warmup=20)
    return timed


def _sample_steps(calls: int, repeats: int) -> dict[str, dict]:
    """The key's second call on the sample-like capture: its plan, and the build of its replay
    (each graph released once built, as a session drops graphs)."""
    with use_backend(sample_capture.NothingGraphBackend()):
        sample = sample_capture.sample_capture(SAMPLE_BATCH)
        made = sample_capture.plan(sample)
        session, owner = sample_capture.BuildSession(), sample_capture.BuildRegion()

        def build() -> None:
            sample_capture.build_graph(sample, made, session, owner).release()

        paths = {SAMPLE_PLAN: lambda: sample_capture.plan(sample), SAMPLE_BUILD: build}
        return common.compare(paths, calls=max(calls // 10, 3), repeats=repeats, warmup=5)


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    repeats, calls = (3, 30) if args.quick else (15, 300)
    backend, packing = null_backend()
    timed = _chain_steps(backend, calls, repeats)
    timed.update(_sample_steps(calls, repeats))
    us = {name: t["median_us"] for name, t in timed.items()}
    reports = us["region under the recorder"] - us["region, no recorder"]
    tail_saved = us["region under the recorder, tail asked in Python"] - us["region under the recorder"]
    after_region = us["records kept (extents, tensors dropped)"]
    analysis = us["launch views"] + us["rebinding plan"]
    rows = [[name, value, value / KERNELS if name not in SAMPLE_STEPS else ""] for name, value in us.items()]
    body = common.markdown_table(["step", "us", f"us per launch ({KERNELS} launches)"], rows)
    body += (
        f"\n\nThe jit's launch reports cost {reports:.1f} us over the region's {KERNELS} launches "
        f"({reports / KERNELS:.2f} us a launch), the capture tail asked from C rather than through Python saves "
        f"{tail_saved / KERNELS:.2f} us a launch; the records kept after the capture {after_region:.1f} us; "
        f"the analysis of the key's second call (launch views and plan) {analysis:.1f} us. Launches: {packing}. "
        f"On the sample-like capture (batch {SAMPLE_BATCH}), the plan {us[SAMPLE_PLAN]:.1f} us and the replay's "
        f"build {us[SAMPLE_BUILD]:.1f} us."
    )
    results = {
        "steps_us": timed,
        "reports_us": reports,
        "reports_per_launch_us": reports / KERNELS,
        "tail_in_c_saves_per_launch_us": tail_saved / KERNELS,
        "records_kept_us": after_region,
        "analysis_us": analysis,
        "sample_plan_us": us[SAMPLE_PLAN],
        "sample_build_us": us[SAMPLE_BUILD],
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
