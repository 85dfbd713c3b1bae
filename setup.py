"""The compiled parts, all optional, all in csrc/:

- csrc/jitcore_native.c builds jitcore.backends._native, the hot driver calls (and a
  recording's capture query and node reads);
- csrc/jitcore_exclusion.c builds jitcore._exclusion, the capture exclusion's shared side;
- csrc/replay_eager.c builds replay._eager, a region's call and its flat eager path;
- csrc/replay_checks.c builds replay._checks, two of a replay's exactness checks (torch's
  settings, the arguments' aliasing);
- csrc/replay_step.c builds replay._step, a recorded graph's replay in its steady state (with
  the torch-side helper built).

csrc/jitcore_torch_native.cpp is not built here: its C++ ABI belongs to one torch build, so
``python -m jitcore.torch_native`` compiles it on the machine that loads it. The wheel carries
it, with the headers it includes, under jitcore/_csrc/ (see ``BuildPy``).

Where no C compiler (or no Python headers) is present the build goes on without them: the
backends call the vendor bindings from Python (the same generated code; see docs/kernels.md,
"The native launch helper"), the capture exclusion, regions' eager path and those checks run
in Python (the same protocol, the same decisions and counts; docs/replay.md, "The eager path"
and "The life of a key").
Everything else is in pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

CSRC = Path("csrc")
#: Sources compiled at run time (jitcore.torch_native), shipped inside the jitcore package.
RUNTIME_SOURCES = ("jitcore_torch_native.cpp", *sorted(p.name for p in CSRC.glob("*.h")))


class BuildPy(build_py):
    """Copy the sources compiled at run time into the built jitcore package (jitcore/_csrc/),
    where jitcore.torch_native finds them after a non-editable install."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "jitcore" / "_csrc"
        target.mkdir(parents=True, exist_ok=True)
        for name in RUNTIME_SOURCES:
            shutil.copyfile(CSRC / name, target / name)


def extension(module: str, source: str) -> Extension:
    return Extension(
        module,
        [str(CSRC / source)],
        depends=[str(p) for p in CSRC.glob("*.h")],
        include_dirs=[str(CSRC)],
        optional=True,
        extra_compile_args=["-O2", "-Wall"],
    )


setup(
    cmdclass={"build_py": BuildPy},
    ext_modules=[
        extension("jitcore.backends._native", "jitcore_native.c"),
        extension("jitcore._exclusion", "jitcore_exclusion.c"),
        extension("replay._eager", "replay_eager.c"),
        extension("replay._checks", "replay_checks.c"),
        extension("replay._step", "replay_step.c"),
    ],
)
