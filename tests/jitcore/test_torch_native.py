"""The torch-side native helper (csrc/jitcore_torch_native.cpp, built by jitcore/torch_native.py),
compiled for real against the installed torch into a temporary cache, on the CPU.

Its guard must answer exactly as torch's dynamo evaluator (``TensorGuards``), which it replaces
where it is built: both are asked about the same tensors, under the same thread-local dispatch
state, and must agree on every one (the one exception: tensors torch's evaluator cannot be
asked about without aborting the process, where this one says no). Its data-pointer reader
must read what ``data_ptr()`` returns, and leave to the method whatever the method would treat
differently (subclasses, torch function modes, tensors without storage). The process-wide
decision (:func:`jitcore.torch_native.module`) is left alone here: each test installs what it
uses and puts it back.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import jitcore as jc
from jitcore import guards, torch_native
from jitcore.backends import cache, use_backend
from jitcore.backends.null import NullBackend
from jitcore.errors import CacheWarning

from .backends.test_cache import STRANGER
from .backends.test_native import ParamReader, needs_native

try:
    from torch._C._dynamo.guards import TensorGuards
except Exception:  # pragma: no cover - a torch without the evaluator
    TensorGuards = None

ROOT = Path(__file__).resolve().parents[2]
COMPILER = shutil.which(os.environ.get("CXX", "c++").split()[0])
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler on this machine")


@pytest.fixture(scope="module")
def native_cache(torch_native_cache):
    """The cache directory holding the helper built for this torch (tests/conftest.py)."""
    return torch_native_cache


@pytest.fixture
def helper(native_cache, monkeypatch):
    monkeypatch.setenv("JITCORE_CACHE_DIR", str(native_cache))
    found, reason = torch_native.load()
    assert found is not None, reason
    return found


# --- building and loading ------------------------------------------------------------------------


@needs_compiler
def test_the_build_is_found_for_this_torch_only(helper, native_cache, monkeypatch):
    assert helper.TORCH_VERSION == torch_native.torch_identity()
    assert torch.__version__ in torch_native.torch_identity()
    # another torch (or another source) is another file: never the one built here
    monkeypatch.setattr(torch_native, "torch_identity", lambda: "0.0.0 another")
    found, reason = torch_native.load()
    assert found is None and "not built for this torch (0.0.0 another)" in reason
    assert "python -m jitcore.torch_native" in reason


@needs_compiler
def test_a_file_built_for_another_torch_is_refused_even_under_this_torchs_name(helper, native_cache, monkeypatch):
    path = torch_native.artifact_path()
    monkeypatch.setattr(torch_native, "torch_identity", lambda: "0.0.0 another")
    monkeypatch.setattr(torch_native, "artifact_path", lambda: path)  # the name collides, the build does not
    found, reason = torch_native.load()
    assert found is None and "was built for torch" in reason and "not 0.0.0 another" in reason


def test_nothing_loads_where_it_was_not_built_or_is_turned_off(tmp_path, monkeypatch):
    os.chmod(tmp_path, 0o700)
    monkeypatch.setenv("JITCORE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("JITCORE_NATIVE", "1")
    found, reason = torch_native.load()
    assert found is None and "not built for this torch" in reason
    monkeypatch.setenv("JITCORE_NATIVE", "0")
    assert torch_native.load() == (None, "JITCORE_NATIVE=0")


def test_a_failed_build_says_why_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    os.chmod(tmp_path, 0o700)
    monkeypatch.setenv("JITCORE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", sys.executable + " -c 'import sys; sys.stderr.write(\"no compiler here\"); sys.exit(3)'")
    with pytest.raises(RuntimeError, match="failed \\(3\\)"):
        torch_native.build()
    assert not any((tmp_path / "torch-native").iterdir())  # no partial file
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert torch_native.main(["--if-possible"]) == 0
    assert torch_native.main([]) == 1
    assert "jitcore works without it" in capsys.readouterr().err
    assert torch_native.main(["--bogus"]) == 2


# --- the command: one line, a cached build used as it is -------------------------------------------
FAKE_COMPILER = """
import pathlib, shutil, sys
prebuilt, arguments = sys.argv[1], sys.argv[2:]
with open(prebuilt + ".calls", "a") as log:
    log.write(" ".join(arguments) + "\\n")
shutil.copyfile(prebuilt, arguments[arguments.index("-o") + 1])
"""


@pytest.fixture
def fake_compiler(native_cache, tmp_path):
    """A ``CXX`` that "compiles" by copying the helper built for this torch (native_cache) to
    its output, and logs each call: the command's logic, without a compile's wait."""
    prebuilt = tmp_path / "prebuilt.so"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JITCORE_CACHE_DIR", str(native_cache))
        shutil.copyfile(torch_native.artifact_path(), prebuilt)
    script = tmp_path / "fake_compiler.py"
    script.write_text(FAKE_COMPILER)
    return f"{sys.executable} {script} {prebuilt}", Path(f"{prebuilt}.calls")


def run_command(cache_dir: Path, compiler: str, *options: str) -> subprocess.CompletedProcess:
    """``python -m jitcore.torch_native`` as the README runs it, warnings made errors."""
    env = dict(os.environ, JITCORE_CACHE_DIR=str(cache_dir), CXX=compiler, PYTHONPATH=str(ROOT))
    command = [sys.executable, "-W", "error", "-m", "jitcore.torch_native", *options]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@needs_compiler
def test_the_command_builds_once_then_uses_the_cached_build_in_one_line(fake_compiler, tmp_path):
    compiler, calls = fake_compiler
    cache_dir = tmp_path / "cache"
    first = run_command(cache_dir, compiler, "--if-possible")
    assert first.returncode == 0 and first.stderr == "", first.stderr  # no RuntimeWarning, no command line
    (line,) = first.stdout.splitlines()
    assert line.startswith(f"jitcore: torch-side native helper built for torch {torch_native.torch_identity()}")
    again = run_command(cache_dir, compiler, "--if-possible")
    assert again.returncode == 0 and again.stderr == ""
    (line,) = again.stdout.splitlines()
    assert "loaded from the cache" in line
    assert len(calls.read_text().splitlines()) == 1  # the second run compiled nothing
    verbose = run_command(tmp_path / "other-cache", compiler, "--verbose")
    assert verbose.returncode == 0 and "jitcore_torch_native.cpp -o" in verbose.stderr


@needs_compiler
@pytest.mark.parametrize("damage", ["truncated", "planted by another user"])
def test_the_command_builds_anew_over_a_damaged_or_refused_build(fake_compiler, tmp_path, damage):
    compiler, calls = fake_compiler
    cache_dir = tmp_path / "cache"
    assert run_command(cache_dir, compiler).returncode == 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JITCORE_CACHE_DIR", str(cache_dir))
        path = torch_native.artifact_path()
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:4096])
    else:
        stranger_owns(path)
    done = run_command(cache_dir, compiler)
    assert done.returncode == 0 and "built for torch" in done.stdout, done.stderr
    assert len(calls.read_text().splitlines()) == 2
    assert path.stat().st_uid == os.getuid() and path.stat().st_size > 4096


# --- trust: the helper is read from the cache as a kernel entry is -------------------------------
C_COMPILER = shutil.which("cc") or shutil.which("gcc")
PLANTED = r"""
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void) {
    const char *marker = getenv("PLANTED_MARKER");
    if (marker) close(open(marker, O_CREAT | O_WRONLY, 0600));
}
"""


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A library at the helper's place in a fresh cache, whose loading shows: its constructor
    creates the marker file. (path, marker)"""
    if C_COMPILER is None or not hasattr(os, "getuid"):
        pytest.skip("needs a C compiler and POSIX owners")
    source = tmp_path / "planted.c"
    source.write_text(PLANTED)
    library = tmp_path / "planted.so"
    subprocess.run([C_COMPILER, "-shared", "-fPIC", str(source), "-o", str(library)], check=True, timeout=120)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o700)
    monkeypatch.setenv("JITCORE_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("JITCORE_NATIVE", "1")  # loading is what is tested (the fallback's run sets 0)
    path = torch_native.artifact_path()
    path.parent.mkdir(mode=0o700)
    shutil.copyfile(library, path)
    os.chmod(path, 0o755)
    torch_native.digest_path(path).write_text(hashlib.sha256(path.read_bytes()).hexdigest())  # whole, as built
    marker = tmp_path / "marker"
    monkeypatch.setenv("PLANTED_MARKER", str(marker))
    return path, marker


def stranger_owns(path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("chown to another user needs root")
    os.chown(path, STRANGER, STRANGER)


def test_the_planted_library_runs_when_loaded_as_its_owner(planted):
    """The control for the tests below: the library is loaded, its code runs."""
    _path, marker = planted
    found, reason = torch_native.load()
    assert found is None and "does not load" in reason  # no module inside
    assert marker.exists()


@pytest.mark.parametrize("how", ["another user's", "group writable", "other writable", "a symbolic link"])
def test_a_planted_library_is_never_loaded(planted, tmp_path, how):
    path, marker = planted
    expected = {
        "another user's": f"is owned by uid {STRANGER}, not you (uid 0)",
        "group writable": "is writable by others than you (mode 0o775)",
        "other writable": "is writable by others than you (mode 0o757)",
        "a symbolic link": "is not a regular file (a symbolic link)",
    }[how]
    if how == "another user's":
        stranger_owns(path)
    elif how == "a symbolic link":
        path.rename(tmp_path / "elsewhere.so")
        path.symlink_to(tmp_path / "elsewhere.so")
    else:
        os.chmod(path, 0o775 if how == "group writable" else 0o757)
    found, reason = torch_native.load()
    assert found is None and f"{path} {expected}: not loaded" in reason
    assert not marker.exists()


@pytest.mark.parametrize("how", ["writable by others", "another user's"])
def test_a_helper_directory_others_control_refuses_the_cache(planted, monkeypatch, how):
    path, marker = planted
    monkeypatch.setattr(cache, "_roots", {})  # the directory judged anew, as by the next process
    if how == "writable by others":
        os.chmod(path.parent, 0o777)
        expected = "is writable by its group and others"
    else:
        stranger_owns(path.parent)
        expected = f"is owned by uid {STRANGER}"
    with pytest.warns(CacheWarning, match=f"{path.parent} {expected}"):
        found, reason = torch_native.load()
    assert found is None and "not trusted" in reason and not marker.exists()
    with pytest.raises(RuntimeError, match="not trusted"):
        torch_native.build()


def test_a_cache_that_is_a_symbolic_link_gets_no_build(tmp_path, monkeypatch):
    system = tmp_path / "etc"
    system.mkdir(mode=0o755)
    (tmp_path / "cache").symlink_to(system)
    monkeypatch.setenv("JITCORE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.warns(CacheWarning, match="is a symbolic link"):
        assert torch_native.artifact_path() is None
    with pytest.raises(RuntimeError, match="not trusted"):
        torch_native.build()
    assert list(system.iterdir()) == []


# --- the guard: torch's evaluator's answers --------------------------------------------------------


def _variants() -> dict[str, torch.Tensor]:
    """Tensors that differ from a plain float32 [4, 6] in one way each (and plain ones)."""
    base = torch.randn(4, 6)
    complex_base = torch.randn(4, 6, dtype=torch.complex64)
    with torch.inference_mode():
        inference = torch.randn(4, 6)
    return {
        "plain": base,
        "plain_again": torch.randn(4, 6),
        "float64": torch.randn(4, 6, dtype=torch.float64),
        "float16": torch.randn(4, 6).half(),
        "bfloat16": torch.randn(4, 6).bfloat16(),
        "int64": torch.arange(24).reshape(4, 6),
        "bool": torch.ones(4, 6, dtype=torch.bool),
        "taller": torch.randn(5, 6),
        "wider": torch.randn(4, 7),
        "flat": torch.randn(24),
        "three_dims": torch.randn(4, 6, 1),
        "transposed": torch.randn(6, 4).t(),
        "strided_rows": torch.randn(8, 6)[::2],
        "strided_columns": torch.randn(4, 12)[:, ::2],
        "offset_view": torch.randn(5, 6)[1:],
        "expanded": torch.randn(1, 6).expand(4, 6),
        "requires_grad": torch.randn(4, 6, requires_grad=True),
        "parameter": torch.nn.Parameter(torch.randn(4, 6)),
        "inference": inference,
        "meta": torch.empty(4, 6, device="meta"),
        "complex": complex_base,
        "complex_conj": complex_base.conj(),
        "neg_view": torch._neg_view(complex_base),
        "zero_rows": torch.randn(0, 6),
        "subclass": torch.randn(4, 6).as_subclass(_Plain),
    }


class _Plain(torch.Tensor):
    pass


@pytest.mark.skipif(TensorGuards is None, reason="torch has no C++ tensor guard evaluator")
@needs_compiler
def test_the_guard_answers_as_torchs_evaluator_for_every_tensor(helper):
    tensors = _variants()
    patterns = [
        ((None, None), (None, None)),  # every size and stride left unchecked
        ((4, None), (None, 1)),
        ((4, 6), (6, 1)),
        ((None, 6), (6, None)),
    ]
    disagreements, checked = [], 0
    for example_name, example in tensors.items():
        for sizes, strides in patterns:
            if example.dim() != 2:
                sizes, strides = tuple([None] * example.dim()), tuple([None] * example.dim())
            other = torch.randn(3)
            torchs = TensorGuards(
                example, other, dynamic_dims_sizes=[list(sizes), [None]], dynamic_dims_strides=[list(strides), [None]]
            )
            ours = helper.tensor_guard((example, other), (sizes, (None,)), (strides, (None,)))
            candidates = [*tensors.values(), 3, None, "x", other]
            for candidate in candidates:
                for pair in ((candidate, other), (example, candidate)):
                    expected, got = torchs.check(*pair), ours(*pair)
                    checked += 1
                    if expected != got:
                        disagreements.append((example_name, sizes, strides, repr(pair)[:80], expected, got))
    assert checked > 2000 and disagreements == []


@pytest.mark.skipif(TensorGuards is None, reason="torch has no C++ tensor guard evaluator")
@needs_compiler
def test_the_guard_answers_as_torchs_under_every_thread_local_dispatch_state(helper):
    """Both apply this thread's included and excluded dispatch keys, built in one state and
    asked in another (inference mode, no_grad, keys excluded by hand)."""
    plain, grad, fresh = torch.randn(4), torch.randn(4, requires_grad=True), torch.randn(4)
    with torch.inference_mode():
        inference = torch.randn(4)

    def states():
        yield "plain", torch.enable_grad
        yield "no_grad", torch.no_grad
        yield "inference_mode", torch.inference_mode
        excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)
        yield "exclude ADInplaceOrView", lambda: torch._C._ExcludeDispatchKeyGuard(excluded)
        yield "include Python", lambda: torch._C._IncludeDispatchKeyGuard(torch._C.DispatchKey.Python)

    disagreements = []
    for (built_in, build_state), (asked_in, ask_state) in itertools.product(list(states()), repeat=2):
        for example in (plain, grad, inference):
            with build_state():
                torchs = TensorGuards(example, dynamic_dims_sizes=[[None]], dynamic_dims_strides=[[None]])
                ours = helper.tensor_guard((example,), ((None,),), ((None,),))
            with ask_state():
                for candidate in (plain, grad, inference, fresh):
                    expected, got = torchs.check(candidate), ours(candidate)
                    if expected != got:
                        disagreements.append((built_in, asked_in, expected, got))
    # torch's masks the Python dispatch keys (torch 2.13: outside a mode that does not ignore
    # compile internals; 2.11 does not); this one never does, so with Python keys included in
    # one state and not the other it may say no where torch's says yes: stricter, never looser
    assert all((built_in, asked_in).count("include Python") == 1 for built_in, asked_in, _, _ in disagreements)
    assert all(expected and not got for _, _, expected, got in disagreements)


@needs_compiler
def test_the_guard_says_no_to_one_tensor_passed_twice_as_torchs_does(helper):
    a, b = torch.randn(4), torch.randn(4)
    check = helper.tensor_guard((a, b), ((None,), (None,)), ((None,), (None,)))
    assert check(a, b) and check(b, a) and not check(a, a)
    many = [torch.randn(2) for _ in range(20)]  # more than are compared pairwise
    check = helper.tensor_guard(tuple(many), ((None,),) * 20, ((None,),) * 20)
    assert check(*many) and not check(*many[:19], many[3])
    if TensorGuards is not None:
        torchs = TensorGuards(*many, dynamic_dims_sizes=[[None]] * 20, dynamic_dims_strides=[[None]] * 20)
        assert torchs.check(*many) and not torchs.check(*many[:19], many[3])


@needs_compiler
def test_the_guard_says_no_to_unusual_tensors_without_aborting(helper):
    """In process: what torch's evaluator aborts on (a strided nested tensor) this one refuses
    by its dispatch keys before any size is read."""
    check = helper.tensor_guard((torch.randn(4, 4),), ((None, None),), ((None, None),))
    unusual = [
        torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)]),
        torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=torch.jagged),
        torch.randn(4, 4).to_sparse(),
        torch.randn(4, 4).to_sparse_csr(),
        torch.empty(4, 4, device="meta"),
    ]
    assert [check(t) for t in unusual] == [False] * len(unusual)
    assert check(torch.randn(4, 4))
    with pytest.raises(TypeError, match="checks 1 tensors, got 2"):
        check(torch.randn(4, 4), torch.randn(4, 4))


@needs_compiler
def test_the_guard_refuses_examples_it_cannot_check(helper):
    with pytest.raises(TypeError, match="example 0 is not a tensor"):
        helper.tensor_guard((3,), ((),), ((),))
    with pytest.raises(ValueError, match="not a plain strided tensor"):
        helper.tensor_guard((torch.randn(4, 4).to_sparse(),), ((None, None),), ((None, None),))
    with pytest.raises(ValueError, match="one entry per dimension"):
        helper.tensor_guard((torch.randn(4, 4),), ((None,),), ((None, None),))
    with pytest.raises(ValueError, match="one sizes and one strides entry per example"):
        helper.tensor_guard((torch.randn(4),), (), ())


@needs_compiler
def test_make_guard_uses_the_helper_and_drops_the_nested_screen(helper, monkeypatch):
    monkeypatch.setattr(torch_native, "module", lambda: helper)
    x, y = torch.randn(8), torch.randn(8)
    checks = [guards.ArgumentCheck.tensor(t, [None], [1]) for t in (x, y)]
    guard = guards.make_guard(checks, device=-1, current_device=lambda: -1, description="test native guard")
    assert "is_nested" not in guard.source and "_tensor_guard0(_a0, _a1)" in guard.source
    assert guard(x, y) and guard(torch.randn(3), torch.randn(5)) and not guard(x, x)
    assert not guard(torch.randn(8, dtype=torch.float64), y) and not guard(torch.randn(16)[::2], y)
    assert not guard(torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), y)
    assert jc.tensor_guard([x], [[None]], [[None]]) is not None  # public, and unscreened: it is safe
    monkeypatch.setattr(torch_native, "module", lambda: None)
    screened = guards.make_guard(checks, device=-1, current_device=lambda: -1, description="test torch guard")
    if screened is not None:  # torch's evaluator: behind the nested screen
        assert "is_nested" in screened.source


# --- the data pointer reader ----------------------------------------------------------------------


@needs_compiler
def test_the_reader_reads_what_data_ptr_returns(helper):
    for name, tensor in _variants().items():
        if name == "subclass":
            assert helper.data_pointer(tensor) is None, name  # its data_ptr may be its own
        else:
            assert helper.data_pointer(tensor) == tensor.data_ptr(), name
    assert helper.data_pointer(torch.randn(4, 4).to_sparse()) is None  # data_ptr() raises: the method says why
    assert helper.data_pointer(3) is None and helper.data_pointer(None) is None


class _AnswersDataPtr(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.data_ptr:
            return 0x1234560
        return func(*args, **(kwargs or {}))


@needs_compiler
def test_the_reader_leaves_a_torch_function_mode_to_the_method(helper):
    x = torch.randn(4)
    with _AnswersDataPtr():
        assert x.data_ptr() == 0x1234560
        assert helper.data_pointer(x) is None


def _described(tensor: torch.Tensor) -> tuple:
    """What a caller can see of a handed-out output besides its values."""
    return (
        type(tensor),
        tensor.dtype,
        tensor.device,
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
        tensor.data_ptr(),
        tensor.requires_grad,
        tensor.grad_fn,
        tensor.is_inference(),
        tensor._is_view(),
        tensor._base is None,
        tensor._version,
    )


@needs_compiler
@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_a_fresh_output_is_what_detach_makes(helper, mode):
    """csrc/replay_step.c hands out fresh_output(view) where generated replays hand out
    view.detach(): the same tensor in every way a caller can see, under every grad mode."""
    lane = torch.empty(4096, dtype=torch.uint8)
    views = [
        torch.as_strided(lane[:4096].view(torch.float32), (8, 16), (16, 1), 4),
        torch.as_strided(lane[:4096].view(torch.float16), (3, 5), (1, 7), 9),
        lane[:100].view(torch.int32),
    ]
    context = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    for view in views:
        with context():
            made, reference = helper.fresh_output(view), view.detach()
        assert made is not view and made is not reference
        assert _described(made) == _described(reference)
        view.add_(0)  # an in-place write bumps the version the outputs share with the view, as detach()'s do
        assert made._version == reference._version


@needs_compiler
def test_a_storage_use_count_is_what_torch_answers(helper):
    x = torch.randn(16)
    storage = x.untyped_storage()
    views = [x[2:], x.view(4, 4)]
    assert helper.storage_use_count(storage) == torch._C._storage_Use_Count(storage._cdata)
    del views
    assert helper.storage_use_count(storage) == torch._C._storage_Use_Count(storage._cdata)
    assert helper.storage_use_count(x) is None and helper.storage_use_count(3) is None


@needs_compiler
def test_a_storage_span_is_what_torch_answers(helper):
    """csrc/replay_step.c's check of staged inputs reads each one's storage: its first byte and
    size as untyped_storage() says, for views at offsets too; nothing for what its reader
    would not read (a subclass, a non-tensor, under a torch function mode)."""
    base = torch.randn(4, 8)
    for tensor in (base, base[1], base[:, 2:], base.t(), torch.empty(0), torch.randn(3, dtype=torch.float64)):
        storage = tensor.untyped_storage()
        assert helper.storage_span(tensor) == (storage.data_ptr(), storage.nbytes())
    subclass = type("Sub", (torch.Tensor,), {})
    assert helper.storage_span(base.as_subclass(subclass)) is None and helper.storage_span(3) is None
    with _SeesDetach():
        assert helper.storage_span(base) is None


class _SeesDetach(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.detach:
            self.seen += 1
        return func(*args, **(kwargs or {}))


@needs_compiler
def test_a_fresh_output_under_a_torch_function_mode_is_made_by_the_method(helper):
    view = torch.randn(8)[2:]
    with _SeesDetach() as mode:
        made = helper.fresh_output(view)
    assert mode.seen == 1 and made.data_ptr() == view.data_ptr()
    assert _described(made)[:8] == _described(view.detach())[:8]
    with pytest.raises(AttributeError):  # not a tensor: the method's own error
        helper.fresh_output(3)


@needs_native
@needs_compiler
def test_a_packed_launch_packs_the_same_pointers_through_the_reader(helper):
    from jitcore.backends import _native

    reader = ParamReader([0, 8], [8, 8])
    launch = _native.PackedLaunch(reader.address, 1, bytes(16), (0, 8), ((0, "<PQ"),))
    tensors = [t for name, t in _variants().items() if name != "meta"] + [torch.randn(4, 4).to_sparse()]
    try:
        for use in (None, helper):
            torch_native.use_data_pointer_reader(use)
            for tensor in tensors:
                try:
                    launch(1, 1, 1, 32, 1, 1, 0, 0, tensor, 7)
                    reader.seen.append(("packed", use is not None))
                except RuntimeError as error:
                    reader.seen.append(("raised", use is not None, str(error)[:40]))
            with _AnswersDataPtr():
                launch(1, 1, 1, 32, 1, 1, 0, 0, tensors[0], 7)
        seen = [entry for entry in reader.seen if isinstance(entry[0], tuple)]
        plain, native = seen[: len(seen) // 2], seen[len(seen) // 2 :]
        assert [p for _, p in plain] == [p for _, p in native]  # the same bytes either way
        assert native[-1][1][0] == struct.pack("<Q", 0x1234560)  # the mode's answer, through the method
        raised = [entry for entry in reader.seen if entry[0] == "raised"]
        assert len(raised) == 2 and raised[0][2] == raised[1][2]  # sparse: the method's error both times
    finally:
        torch_native.use_data_pointer_reader(torch_native.module())


def _launcher(kernel: jc.Kernel):
    @jc.jit
    def launch(a, b, s):
        kernel[jc.cdiv(a.numel(), 128), 128](a, b, s, a.numel())

    return launch


@needs_compiler
def test_jit_calls_answer_the_same_with_the_helper(helper, monkeypatch):
    """A @jit function's guard and packed launches built with the helper serve and refuse the
    same calls as without it (the launch log is the null backend's)."""
    source = "__global__ void k(const float* a, float* b, float s, long long n) {}"
    logs = []
    for use in (None, helper):
        monkeypatch.setattr(torch_native, "module", lambda use=use: use)
        launch = _launcher(jc.Kernel(source, "k"))

        backend = NullBackend()
        with use_backend(backend):
            a, b = torch.randn(1000), torch.randn(1000)
            outcomes = []
            for args in [
                (a, b, 1.0),
                (a, b, 2.0),
                (torch.randn(10), torch.randn(10), 1.0),
                (a.double(), b.double(), 1.0),
                (a, a, 1.0),
                (torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), b, 1.0),
                (torch.randn(2000)[::2], b, 1.0),
            ]:
                try:
                    launch(*args)
                    outcomes.append("ok")
                except Exception as error:
                    outcomes.append(type(error).__name__)
            logs.append((outcomes, launch.cache_info()))
    assert logs[0] == logs[1]


@needs_compiler
def test_unusual_tensors_are_refused_on_every_call_in_a_fresh_process_with_the_helper(native_cache):
    """The adaptor tests' scripts (tests/jitcore/test_adaptors.py) again, in a process that
    loads the helper from the cache: nothing aborts, everything is refused as without it."""
    from . import test_adaptors

    env = dict(os.environ, JITCORE_CACHE_DIR=str(native_cache), PYTHONPATH=str(ROOT))
    check = "from jitcore import torch_native; assert torch_native.module() is not None, torch_native.why_not()\n"
    for script in (test_adaptors.JIT_SCRIPT, test_adaptors.GUARD_SCRIPT):
        done = subprocess.run(
            [sys.executable, "-c", check + script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-3000:]
        lines = done.stdout.splitlines()
        expected = test_adaptors.run_isolated(script)
        assert lines == expected


@needs_compiler
def test_using_switches_the_helper_for_what_is_made_inside_and_puts_it_back(helper):
    before = torch_native.module()
    x = torch.randn(8)
    checks = [guards.ArgumentCheck.tensor(x, [None], [1])]
    with torch_native.using(helper):
        assert torch_native.module() is helper
        inside = guards.make_guard(checks, device=-1, current_device=lambda: -1, description="made with the helper")
        with torch_native.using(None):
            assert torch_native.module() is None
        assert torch_native.module() is helper
    assert torch_native.module() is before
    assert "is_nested" not in inside.source and inside(x)
