"""The torch-side native helper (csrc/jitcore_torch_native.cpp): built against the installed torch
by ``python -m jitcore.torch_native``, cached, and loaded only where it was built for this torch.

Why: what is left of a ``@jit`` hit's cost above the driver call is mostly two torch reads
made from Python: torch's guard evaluator and ``data_ptr()``. Read through torch's C++ API they
cost a fraction of that. Only torch's own headers give that API, and its C++ ABI belongs to
one torch build, so the helper cannot be shipped compiled nor built by ``pip install`` (its
build runs isolated from the torch it must match): it is compiled on the machine, against the
torch that will load it, with the C++ compiler there. Replay's per-replay check of torch's
global settings reads them through it as well (``settings_watch``, several times cheaper than
the Python getters; see replay.region_keys.modes_changed).

Where it is: jitcore's cache directory (``JITCORE_CACHE_DIR``), under ``torch-native/`` and a
name made from this torch's version and git revision, Python's extension suffix and the
source's digest, so a torch upgrade or a changed source is a different file and never loads a
stale one. It is trusted as a kernel entry is (:mod:`jitcore.backends.cache`: the directories
on the way, the file's owner and mode), since loading it runs its code. :func:`module` imports
it where that file exists and reports the same torch it was built for; it never compiles on
its own (a first import should not wait for a compiler). Where it is absent, refused, fails to
load or ``JITCORE_NATIVE=0``, the same checks and reads run through torch's Python API
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
    return root.path / cache.HELPER_DIRECTORY / artifact_name()


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
    refusal = _refusal(path)
    if refusal is not None:
        return None, refusal
    try:
        loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
        spec = importlib.util.spec_from_file_location(MODULE_NAME, str(path), loader=loader)
        found = importlib.util.module_from_spec(spec)
        loader.exec_module(found)
    except Exception as error:  # ImportError, an undefined symbol: a build for another torch, a damaged file
        return None, f"{path} does not load: {error}"
    if getattr(found, "TORCH_VERSION", None) != torch_identity():
        return None, f"{path} was built for torch {getattr(found, 'TORCH_VERSION', '?')}, not {torch_identity()}"
    return found, None


def digest_path(path: Path) -> Path:
    """Where the digest of the build at ``path`` is recorded (written by :func:`build`)."""
    return path.with_name(path.name + ".sha256")


def _refusal(path: Path) -> str | None:
    """Why the build at ``path`` may not be loaded; None if it may. Loading runs its code, so
    it is read as a kernel entry is (cache.read_file: the file's owner and mode), and it must
    be whole: the digest its build recorded must match (a truncated library can crash the
    process that maps it, where a damaged kernel entry only fails to parse)."""
    anew = "not loaded (`python -m jitcore.torch_native` builds it anew)"
    try:
        image = cache.read_file(path)
    except FileNotFoundError:
        return f"not built for this torch ({torch_identity()}): run `python -m jitcore.torch_native`"
    except (OSError, cache.RefusedFile) as error:
        return f"{error}: {anew}"
    try:
        recorded = cache.read_file(digest_path(path))
    except (OSError, cache.RefusedFile) as error:
        return f"{path} has no digest to check it by ({error}): {anew}"
    if recorded.strip() != hashlib.sha256(image).hexdigest().encode():
        return f"{path} is damaged or incomplete (its digest differs from its build's): {anew}"
    return None


def use_data_pointer_reader(helper: types.ModuleType | None) -> None:
    """Tell the C launch helper (csrc/jitcore_native.c, where it is built) to read tensors'
    data pointers through ``helper``'s reader (None: through ``data_ptr()``)."""
    try:
        from jitcore.backends import _native  # type: ignore[attr-defined]  # a C extension, built by setup.py
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


def build(*, verbose: bool = False) -> Path:
    """Compile the helper for this torch into the cache (atomically: a concurrent build or
    load sees the old file or the whole new one, and a refused file there is replaced) and
    return its path. ``verbose``: print the compiler's command line first. Raises RuntimeError
    with the compiler's output where it fails."""
    path = artifact_path()
    if path is None:
        raise RuntimeError("jitcore's cache directory is not trusted (see its CacheWarning); nothing was built")
    # Not parents=True: a cache directory removed after its first use stays missing, as for
    # kernel entries (re-creating it unchecked could adopt one another user made in its place).
    path.parent.mkdir(mode=0o700, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".building-", suffix=path.suffix)
    os.close(handle)
    try:
        command = compile_command(Path(temporary))
        if verbose:
            print(" ".join(shlex.quote(part) for part in command), file=sys.stderr)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed ({done.returncode}):\n{done.stderr or done.stdout}")
        os.chmod(temporary, 0o755)  # the compiler's output follows the umask: the cache's rule does not
        _record_digest(path, Path(temporary).read_bytes())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return path


def _record_digest(path: Path, image: bytes) -> None:
    """Write the digest of ``image``, the build about to replace ``path``, atomically. Written
    before the build is moved in: a load between the two finds a mismatch and refuses."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".digest-")
    try:
        with os.fdopen(handle, "w") as digest:
            digest.write(hashlib.sha256(image).hexdigest() + "\n")
        os.replace(temporary, digest_path(path))
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


USAGE = "usage: python -m jitcore.torch_native [--if-possible | --check] [--verbose]"


def main(argv: list[str] | None = None) -> int:
    """``python -m jitcore.torch_native [--if-possible | --check] [--verbose]``: make sure the
    helper built for this torch is in the cache and loads, and say so in one line. A build of
    the same source for the same torch found there, whole and trusted, is used as it is; one
    that is missing, refused or damaged is compiled anew. ``--if-possible``: a build that
    cannot be made (no C++ compiler, no trusted cache) is reported and exits 0, for install
    scripts (jitcore works without it); ``--check``: build nothing, say whether it is built and
    loads; ``--verbose``: print the compiler's command line, and its whole output where it
    fails. Building does not depend on ``JITCORE_NATIVE``; loading does."""
    argv = sys.argv[1:] if argv is None else argv
    unknown = [a for a in argv if a not in ("--if-possible", "--check", "--verbose")]
    if unknown:
        print(f"{USAGE} (not {' '.join(unknown)})", file=sys.stderr)
        return 2
    built = False
    if "--check" not in argv and not _usable_build_present():
        try:
            build(verbose="--verbose" in argv)
        except (RuntimeError, OSError) as error:
            return _not_built(error, argv)
        built = True
    found, reason = load()
    if found is not None:
        how = "built for torch {} and loaded" if built else "for torch {} loaded from the cache"
        print(f"jitcore: torch-side native helper {how.format(torch_identity())} ({found.__file__})")
        return 0
    print(f"jitcore: torch-side native helper not loaded: {reason}", file=sys.stderr)
    return 0 if "--if-possible" in argv else 1


def _usable_build_present() -> bool:
    """Whether the cache holds this torch's build, whole and trusted (:func:`_refusal`)."""
    try:
        path = artifact_path()
    except OSError:
        return False  # the source cannot be read: the build says so
    return path is not None and _refusal(path) is None


def _not_built(error: Exception, argv: list[str]) -> int:
    """Say why the build failed (its first line; everything with --verbose) and what follows."""
    text = str(error) if "--verbose" in argv else str(error).splitlines()[0] + " (--verbose shows the output)"
    print(
        f"jitcore: the torch-side native helper was not built: {text}; jitcore works without it: "
        "the same checks and reads go through torch's Python API",
        file=sys.stderr,
    )
    return 0 if "--if-possible" in argv else 1


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy's: the helper's state (what
    # module() decided) then lives in the one module the rest of jitcore imports.
    from jitcore.torch_native import main as _main

    raise SystemExit(_main())
