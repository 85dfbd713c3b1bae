"""The torch-side native helper (csrc/jitcore_torch_native.cpp): built against the installed torch
by ``python -m jitcore.torch_native``, cached, and loaded only where it was built for this torch.

Why: what is left of a ``@jit`` hit's cost above the driver call is mostly two torch reads
made from Python, measured on the CPU machine with the launch itself a no-op: torch's guard
evaluator (about 650 ns for three tensors with symbolic sizes) and ``data_ptr()`` (130 ns a
tensor). Read through torch's C++ API they cost about 60 and 20 ns. Only torch's own headers
give that API, and its C++ ABI belongs to one torch build, so the helper cannot be shipped
compiled nor built by ``pip install`` (its build runs isolated from the torch it must match):
it is compiled on the machine, against the torch that will load it, with the C++ compiler
there, in about 20 s. Replay's per-replay check of torch's global settings reads them through
it as well (``settings_watch``: about 0.1 to 0.2 us against 2 to 6 through the Python getters;
see replay.region_keys.modes_changed).

Where it is: jitcore's cache directory (``JITCORE_CACHE_DIR``, trusted as the kernel cache is:
see :mod:`jitcore.backends.cache`), under ``torch-native/`` and a name made from this torch's
version and git revision, Python's extension suffix and the source's digest, so a torch
upgrade or a changed source is a different file and never loads a stale one. :func:`module`
imports it where that file exists and reports the same torch it was built for; it never
compiles on its own (a first import should not spend 20 s in a compiler). Where it is absent,
fails to load or ``JITCORE_NATIVE=0``, the same checks and reads run through torch's Python API
(:mod:`jitcore.guards`, the C launch helper's ``data_ptr()`` call), answering the same.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import torch

from jitcore.backends import cache, compiled_helpers_enabled


def _source_dir() -> Path:
    """Where the sources compiled at run time lie: inside the installed package (a wheel
    carries them under jitcore/_csrc/, see setup.py), else the checkout's csrc/ (an editable
    install, or the source tree on ``PYTHONPATH``)."""
    packaged = Path(__file__).with_name("_csrc")
    return packaged if packaged.is_dir() else Path(__file__).resolve().parent.parent / "csrc"


SOURCE_DIR = _source_dir()
SOURCE = SOURCE_DIR / "jitcore_torch_native.cpp"
MODULE_NAME = "jitcore._torch_native"

_lock = threading.Lock()
_loaded: list[types.ModuleType | None] = []  # [module or None] once decided
_why_not: list[str] = []


def torch_identity() -> str:
    """What the helper must have been built against: torch's version and git revision."""
    return f"{torch.__version__} {getattr(torch.version, 'git_version', '')}".strip()


def artifact_name() -> str:
    digest = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h"))]
    for part in (SOURCE.read_bytes(), *headers, torch_identity().encode(), sys.version.encode()):
        digest.update(part)
        digest.update(b"\0")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return f"_torch_native-{digest.hexdigest()[:20]}{suffix}"


def artifact_path() -> Path | None:
    """Where this torch's build of the helper lives; None where the cache directory is not
    trusted (then it is neither built nor loaded: a library there could be anyone's)."""
    root = cache.cache_root()
    if root.refusal is not None:
        return None
    return root.path / "torch-native" / artifact_name()


def module() -> types.ModuleType | None:
    """The helper, loaded once per process; None where it is not built for this torch, cannot
    be loaded, or ``JITCORE_NATIVE=0`` (:func:`why_not` says which)."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:
            found, reason = load()
            if found is not None:
                use_data_pointer_reader(found)
            _loaded.append(found)
            if reason:
                _why_not.append(reason)
    return _loaded[0]


@contextlib.contextmanager
def using(helper: types.ModuleType | None) -> Iterator[None]:
    """Inside the block, :func:`module` answers ``helper`` (None: no helper) and its reader
    serves the C launch helper, so the guards and packed launches made inside are made with it
    or without it; both are put back after. For side-by-side measurements and tests in one
    process (``benchmarks/jit.py``): a guard keeps the evaluator it was made with, while the
    reader is process-wide (switch it with :func:`use_data_pointer_reader` between timings)."""
    with _lock:
        saved = list(_loaded)
        _loaded[:] = [helper]
    use_data_pointer_reader(helper)
    try:
        yield
    finally:
        with _lock:
            _loaded[:] = saved
        use_data_pointer_reader(saved[0] if saved else None)


def why_not() -> str | None:
    """Why :func:`module` is None (None when it is loaded or not yet asked for)."""
    return _why_not[0] if _why_not else None


def load() -> tuple[types.ModuleType | None, str | None]:
    """(the helper built for this torch, None) or (None, why not): an import of the cached
    file, with nothing installed anywhere (:func:`module` decides for the process)."""
    if not compiled_helpers_enabled():
        return None, "JITCORE_NATIVE=0"
    try:
        path = artifact_path()
    except OSError as error:
        return None, f"the source cannot be read: {error}"
    if path is None:
        return None, "jitcore's cache directory is not trusted (see its CacheWarning)"
    if not path.is_file():
        return None, f"not built for this torch ({torch_identity()}): run `python -m jitcore.torch_native`"
    try:
        loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
        spec = importlib.util.spec_from_file_location(MODULE_NAME, str(path), loader=loader)
        found = importlib.util.module_from_spec(spec)
        loader.exec_module(found)
    except Exception as error:  # ImportError, an undefined symbol: a build for another torch
        return None, f"{path} does not load: {error}"
    if getattr(found, "TORCH_VERSION", None) != torch_identity():
        return None, f"{path} was built for torch {getattr(found, 'TORCH_VERSION', '?')}, not {torch_identity()}"
    return found, None


def use_data_pointer_reader(helper: types.ModuleType | None) -> None:
    """Tell the C launch helper (csrc/jitcore_native.c, where it is built) to read tensors'
    data pointers through ``helper``'s reader (None: through ``data_ptr()``)."""
    try:
        from jitcore.backends import _native
    except ImportError:
        return
    _native.use_data_pointer_reader(None if helper is None else helper.data_pointer_reader)


def compile_command(output: Path) -> list[str]:
    """The compiler call that builds the helper against this torch (``CXX`` picks the compiler)."""
    torch_dir = Path(torch.__file__).resolve().parent
    compiler = shlex.split(os.environ.get("CXX", "c++"))
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    return [
        *compiler,
        "-O2",
        "-DNDEBUG",  # release asserts only, as torch's own build (the helper checks it)
        "-std=c++17",
        "-fPIC",
        "-shared",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f'-DTORCH_VERSION_FOR_CHECK="{torch_identity()}"',
        f"-I{SOURCE_DIR}",
        f"-I{torch_dir / 'include'}",
        f"-I{sysconfig.get_paths()['include']}",
        str(SOURCE),
        "-o",
        str(output),
        f"-L{torch_dir / 'lib'}",
        f"-Wl,-rpath,{torch_dir / 'lib'}",
        "-lc10",
        "-ltorch_cpu",
        "-ltorch_python",
    ]


def build(*, quiet: bool = False) -> Path:
    """Compile the helper for this torch into the cache (atomically: a concurrent build or
    load sees the old file or the whole new one) and return its path. Raises RuntimeError
    with the compiler's output where it fails."""
    path = artifact_path()
    if path is None:
        raise RuntimeError("jitcore's cache directory is not trusted (see its CacheWarning); nothing was built")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".building-", suffix=path.suffix)
    os.close(handle)
    try:
        command = compile_command(Path(temporary))
        if not quiet:
            print(" ".join(shlex.quote(part) for part in command), file=sys.stderr)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed ({done.returncode}):\n{done.stderr or done.stdout}")
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m jitcore.torch_native [--if-possible | --check]``: build the helper for this
    torch and load it. ``--if-possible``: a build that cannot be made (no C++ compiler, no
    trusted cache) is reported and exits 0, for install scripts (jitcore works without it);
    ``--check``: build nothing, say whether it is built and loads."""
    argv = sys.argv[1:] if argv is None else argv
    unknown = [a for a in argv if a not in ("--if-possible", "--check")]
    if unknown:
        print(
            f"usage: python -m jitcore.torch_native [--if-possible | --check] (not {' '.join(unknown)})",
            file=sys.stderr,
        )
        return 2
    if "--check" not in argv:
        try:
            print(f"jitcore: built {build()}")
        except (RuntimeError, OSError) as error:
            print(f"jitcore: the torch-side native helper was not built: {error}", file=sys.stderr)
            print("jitcore works without it: the same checks and reads go through torch's Python API", file=sys.stderr)
            return 0 if "--if-possible" in argv else 1
    found = module()
    print(f"jitcore: torch-side native helper {'loaded' if found else 'not loaded: ' + str(why_not())}")
    return 0 if found or "--if-possible" in argv else 1


if __name__ == "__main__":
    raise SystemExit(main())
