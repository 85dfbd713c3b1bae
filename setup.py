"""The one compiled part: jitcore/backends/_native.c, a C helper for the hot driver calls.

It is optional: where no C compiler (or no Python headers) is present the build goes on
without it and the backends call the vendor bindings from Python (the same generated code;
see docs/kernels.md, "The native launch helper"). Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "jitcore.backends._native",
            ["jitcore/backends/_native.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall"],
        )
    ]
)
