"""The compiled parts, all optional: jitcore/backends/_native.c, a C helper for the hot driver
calls (and a recording's capture query and node reads); jitcore/_exclusion.c, the capture
exclusion's shared side; replay/_eager.c, a region's flat eager path; replay/_checks.c, two of
a replay's exactness checks (torch's settings, the arguments' aliasing); replay/_step.c, a
recorded graph's replay in its steady state (with the torch-side helper built).

Where no C compiler (or no Python headers) is present the build goes on without them: the
backends call the vendor bindings from Python (the same generated code; see docs/kernels.md,
"The native launch helper"), the capture exclusion, regions' eager path and those checks run
in Python (the same protocol, the same decisions and counts; docs/replay.md, "The eager path"
and "The life of a key").
Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "jitcore.backends._native",
            ["jitcore/backends/_native.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall"],
        ),
        Extension("jitcore._exclusion", ["jitcore/_exclusion.c"], optional=True, extra_compile_args=["-O2", "-Wall"]),
        Extension("replay._eager", ["replay/_eager.c"], optional=True, extra_compile_args=["-O2", "-Wall"]),
        Extension("replay._checks", ["replay/_checks.c"], optional=True, extra_compile_args=["-O2", "-Wall"]),
        Extension("replay._step", ["replay/_step.c"], optional=True, extra_compile_args=["-O2", "-Wall"]),
    ]
)
