"""The disk cache: hits, misses, atomic writes under concurrent processes, corruption, and
trusting no other user (directories, entries) nor a dead writer's leftovers."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jitcore import compiler
from jitcore.backends import cache
from jitcore.backends.base import CompiledBinary
from jitcore.backends.null import NullBackend
from jitcore.errors import CacheWarning


def binary(payload: bytes) -> CompiledBinary:
    return CompiledBinary(payload, {"k<float>": "_Z1kIfEvv"}, "log", "sm_90", "nvrtc-test")


def test_round_trip_and_key_sensitivity():
    key = cache.entry_key("cuda", "nvrtc-1", "sm_90", "src", ["k<float>"], ["-DX=1"])
    assert cache.load(key) is None
    cache.store(key, binary(b"image"))
    assert cache.load(key) == binary(b"image")
    for changed in (
        ("hip", "nvrtc-1", "sm_90", "src", ["k<float>"], ["-DX=1"]),
        ("cuda", "nvrtc-2", "sm_90", "src", ["k<float>"], ["-DX=1"]),
        ("cuda", "nvrtc-1", "sm_80", "src", ["k<float>"], ["-DX=1"]),
        ("cuda", "nvrtc-1", "sm_90", "src ", ["k<float>"], ["-DX=1"]),
        ("cuda", "nvrtc-1", "sm_90", "src", ["k<double>"], ["-DX=1"]),
        ("cuda", "nvrtc-1", "sm_90", "src", ["k<float>"], ["-DX=2"]),
        ("cuda", "nvrtc-1", "sm_90", "src", ["k<float>", ""], ["-DX=1"]),
    ):
        assert cache.entry_key(*changed) != key


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage"])
def test_damaged_entries_are_never_loaded(damage):
    key = cache.entry_key("cuda", "c", "sm_90", "damaged", ["k"], [])
    cache.store(key, binary(b"x" * 1000))
    path = cache.entry_path(key)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-10] ^= 0xFF
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(b"JITCORE1\xff\xff\xff\xff{not json")
    path.write_bytes(bytes(data))
    assert cache.load(key) is None
    cache.store(key, binary(b"y" * 10))  # a recompile overwrites it
    assert cache.load(key) == binary(b"y" * 10)


def test_disable_and_relocate(monkeypatch, tmp_path):
    key = cache.entry_key("cuda", "c", "sm_90", "x", ["k"], [])
    monkeypatch.setenv("JITCORE_CACHE", "0")
    cache.store(key, binary(b"a"))
    assert cache.load(key) is None
    monkeypatch.delenv("JITCORE_CACHE")
    monkeypatch.setenv("JITCORE_CACHE_DIR", str(tmp_path / "elsewhere"))
    cache.store(key, binary(b"a"))
    assert cache.entry_path(key).is_relative_to(tmp_path / "elsewhere")


@pytest.mark.parametrize(("below", "problem"), [("", "is not a directory"), ("sub", "cannot be created")])
def test_unwritable_cache_is_skipped(monkeypatch, tmp_path, below, problem):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("JITCORE_CACHE_DIR", str(blocker / below))
    key = cache.entry_key("cuda", "c", "sm_90", "x", ["k"], [])
    with pytest.warns(CacheWarning, match=problem):
        cache.store(key, binary(b"a"))  # no exception
    assert cache.load(key) is None


def _writer(directory: str, key: str, fill: int, rounds: int, started) -> None:
    os.environ["JITCORE_CACHE_DIR"] = directory
    started.wait(60)
    for _ in range(rounds):
        cache.store(key, binary(bytes([fill]) * (2 << 20)))


def _reader(directory: str, key: str, started, writers_done, queue) -> None:
    os.environ["JITCORE_CACHE_DIR"] = directory
    seen = {"missing": 0, "whole": 0, "torn": 0}
    started.set()
    while True:
        finished = writers_done.is_set()
        try:
            data = cache.entry_path(key).read_bytes()
        except OSError:
            seen["missing"] += 1
        else:
            entry = cache.decode(data)
            if entry is None:
                seen["torn"] += 1
            else:
                assert len(set(entry.image)) == 1  # never a mix of two writers
                seen["whole"] += 1
        if finished:
            break
    queue.put(seen)


def test_concurrent_writers_in_two_processes_never_expose_a_torn_file(tmp_path):
    context = multiprocessing.get_context("spawn")
    key = cache.entry_key("cuda", "c", "sm_90", "concurrent", ["k"], [])
    queue, started, writers_done = context.Queue(), context.Event(), context.Event()
    writers = [context.Process(target=_writer, args=(str(tmp_path), key, fill, 20, started)) for fill in (1, 2)]
    reader = context.Process(target=_reader, args=(str(tmp_path), key, started, writers_done, queue))
    for process in (reader, *writers):
        process.start()
    for process in writers:
        process.join(120)
        assert process.exitcode == 0
    writers_done.set()
    seen = queue.get(timeout=60)
    reader.join(60)
    assert reader.exitcode == 0
    assert seen["torn"] == 0
    assert seen["whole"] > 0
    os.environ["JITCORE_CACHE_DIR"] = str(tmp_path)
    assert cache.load(key) is not None


# --- trust: another user's directory or entry, a killed writer's leftovers ------------------
# Tests that need another user's files chown them where they run as root and otherwise pretend
# to be someone else through cache.current_uid; modes are set for real everywhere.
posix = pytest.mark.skipif(not hasattr(os, "getuid"), reason="no uids or POSIX modes on this platform")
ROOT = hasattr(os, "getuid") and os.getuid() == 0
STRANGER = 4242  # neither the test's uid nor root's
KEY = cache.entry_key("cuda", "c", "sm_90", "trust", ["k"], [])


def attempt(monkeypatch, directory: Path | str) -> tuple[list[str], CompiledBinary | None]:
    """Store and load one entry with the cache in ``directory``: the CacheWarnings issued,
    and what the load found."""
    monkeypatch.setenv("JITCORE_CACHE_DIR", str(directory))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache.store(KEY, binary(b"a"))
        found = cache.load(KEY)
    return [str(w.message) for w in caught if issubclass(w.category, CacheWarning)], found


def stranger_owns(path: Path) -> None:
    """Make ``path`` another user's, for real: that needs root (the pretend variants cover the rest)."""
    if not ROOT:
        pytest.skip("chown to another user needs root; the pretend variant runs instead")
    os.chown(path, STRANGER, STRANGER)


@posix
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o707, 0o1777], ids=oct)
def test_a_cache_directory_others_can_write_is_refused_once(monkeypatch, tmp_path, mode):
    """Even with the sticky bit: another user could create a subdirectory there first."""
    directory = tmp_path / "cache"
    directory.mkdir()
    os.chmod(directory, mode)
    messages, found = attempt(monkeypatch, directory)
    assert found is None and len(messages) == 1
    assert f"kernel cache in {directory}: {directory} is writable by" in messages[0]
    assert f"chmod -R go-w {directory}" in messages[0]
    assert list(directory.iterdir()) == []
    assert attempt(monkeypatch, directory) == ([], None)  # warned once per directory and process


@posix
def test_a_subdirectory_others_can_write_is_refused(monkeypatch, tmp_path):
    directory = tmp_path / "cache"
    (directory / "ab").mkdir(parents=True)
    os.chmod(directory / "ab", 0o777)
    messages, found = attempt(monkeypatch, directory)
    assert found is None and f"{directory / 'ab'} is writable by its group and others (mode 0o777)" in messages[0]


@posix
def test_an_ancestor_others_can_write_is_refused_unless_sticky(monkeypatch, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    messages, found = attempt(monkeypatch, shared / "mine" / "cache")
    assert found is None and f"{shared} is writable by its group and others" in messages[0]
    os.chmod(shared, 0o1777)  # as /tmp: nobody can rename or replace what is not theirs
    assert attempt(monkeypatch, shared / "other" / "cache") == ([], binary(b"a"))
    for created in (shared / "other", shared / "other" / "cache", cache.entry_path(KEY).parent):
        assert os.stat(created).st_mode & 0o777 == 0o700


@posix
@pytest.mark.parametrize("variable", ["XDG_CACHE_HOME", "HOME"])
def test_the_default_location_is_checked_too(monkeypatch, tmp_path, variable):
    monkeypatch.delenv("JITCORE_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    below = "jitcore" if variable == "XDG_CACHE_HOME" else ".cache/jitcore"
    loose, private = tmp_path / "loose", tmp_path / "private"
    loose.mkdir(mode=0o700)
    os.chmod(loose, 0o775)
    monkeypatch.setenv(variable, str(loose))
    with pytest.warns(CacheWarning, match=f"{loose} is writable by its group"):
        assert cache.cache_dir() == loose / below
    assert cache.load(KEY) is None
    private.mkdir(mode=0o700)
    monkeypatch.setenv(variable, str(private))
    cache.store(KEY, binary(b"a"))
    assert cache.cache_dir() == private / below and cache.load(KEY) == binary(b"a")


@posix
@pytest.mark.parametrize("how", ["chown", "pretend"])
def test_a_directory_another_user_owns_is_refused(monkeypatch, tmp_path, how):
    directory = tmp_path / "theirs"
    directory.mkdir()
    if how == "chown":
        stranger_owns(directory)
        owner = STRANGER
    else:
        if ROOT:
            pytest.skip("root's directories are trusted whoever the test pretends to be; the chown variant runs")
        owner = os.getuid()
        monkeypatch.setattr(cache, "current_uid", lambda: owner + 1)
    messages, found = attempt(monkeypatch, directory)
    assert found is None and f"{directory} is owned by uid {owner}, neither you" in messages[0]


@posix
@pytest.mark.parametrize("how", ["chown", "pretend"])
def test_an_entry_another_user_wrote_is_never_loaded(monkeypatch, how):
    cache.store(KEY, binary(b"theirs"))
    if how == "chown":
        stranger_owns(cache.entry_path(KEY))
    else:  # the directory was judged at first use, ours; now read as someone else
        monkeypatch.setattr(cache, "current_uid", lambda: STRANGER)
    assert cache.load(KEY) is None
    if how == "chown":
        cache.store(KEY, binary(b"mine"))  # the recompile's store replaces it
        assert cache.load(KEY) == binary(b"mine")


def test_without_uids_the_checks_are_skipped(monkeypatch, tmp_path):
    """Windows has no os.getuid, and its mode bits do not say who may write."""
    monkeypatch.delattr(os, "getuid", raising=False)
    assert cache.current_uid() is None
    directory = tmp_path / "open"
    directory.mkdir()
    os.chmod(directory, 0o777)
    assert attempt(monkeypatch, directory) == ([], binary(b"a"))


@posix
def test_compiles_still_work_in_a_refused_directory(monkeypatch, tmp_path):
    directory = tmp_path / "cache"
    directory.mkdir()
    os.chmod(directory, 0o777)
    monkeypatch.setenv("JITCORE_CACHE_DIR", str(directory))
    backend, calls = NullBackend(), []
    original = backend.compile
    monkeypatch.setattr(backend, "compile", lambda *args: calls.append(args) or original(*args))
    with pytest.warns(CacheWarning):
        first = compiler.compile_cached(backend, "__global__ void k() {}", ["k"], [], "sm_90")
    assert compiler.compile_cached(backend, "__global__ void k() {}", ["k"], [], "sm_90") == first
    assert len(calls) == 2 and list(directory.iterdir()) == []


def test_a_relative_path_is_resolved_once_at_first_use(monkeypatch, tmp_path, caplog):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.chdir(first)
    monkeypatch.setenv("JITCORE_CACHE_DIR", "relative-cache")
    with caplog.at_level(logging.INFO, logger=cache.__name__):
        assert cache.cache_root() == cache.CacheRoot("relative-cache", first / "relative-cache", None)
    assert f"'relative-cache' is relative: resolved once, to {first / 'relative-cache'}" in caplog.text
    monkeypatch.chdir(second)
    cache.store(KEY, binary(b"a"))
    assert cache.entry_path(KEY).is_relative_to(first / "relative-cache") and cache.load(KEY) == binary(b"a")
    assert not (second / "relative-cache").exists()


@posix
def test_a_relative_path_in_a_deleted_working_directory_is_refused(monkeypatch, tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    monkeypatch.setenv("JITCORE_CACHE_DIR", "orphaned-cache")  # a setting this process has not resolved yet
    with pytest.warns(CacheWarning, match="cannot be resolved"):
        assert cache.load(KEY) is None


KILLED_WRITER = """
import os, signal, sys
from jitcore.backends import cache
from jitcore.backends.base import CompiledBinary
os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # dies after writing, before the rename
cache.store(sys.argv[1], CompiledBinary(b"x" * 4096, {}, "", "sm_90", "c"))
"""


@posix
def test_a_killed_writers_temporary_is_swept_by_the_next_write_once_stale():
    package_root = Path(cache.__file__).resolve().parents[2]  # the checkout under test, not an installed copy
    env = dict(os.environ, PYTHONPATH=str(package_root))
    result = subprocess.run([sys.executable, "-c", KILLED_WRITER, KEY], env=env, capture_output=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    shard = cache.entry_path(KEY).parent
    (left,) = shard.glob(".*.tmp")
    live = shard / f".{KEY[:16]}.live.tmp"  # another writer's, in progress
    live.write_bytes(b"partial")
    cache.store(KEY, binary(b"a"))
    assert left.exists() and live.exists()  # not stale yet: it could still be a live write
    stale = time.time() - cache.STALE_TEMPORARY_SECONDS - 60
    os.utime(left, (stale, stale))
    cache.store(KEY, binary(b"b"))
    assert not left.exists() and live.exists()
    assert cache.load(KEY) == binary(b"b")


# --- one rule for all the cache holds: symbolic links, files, damage of any shape ------------


@posix
def test_a_cache_directory_that_is_a_symbolic_link_is_refused_and_not_written_into(monkeypatch, tmp_path):
    """As a link to /etc would be: root-owned, not writable by others, and still not jitcore's."""
    system = tmp_path / "etc"
    system.mkdir(mode=0o755)
    link = tmp_path / "cache"
    link.symlink_to(system)
    messages, found = attempt(monkeypatch, link)
    assert found is None and len(messages) == 1
    assert f"{link} is a symbolic link (to {system})" in messages[0]
    assert list(system.iterdir()) == []


@posix
@pytest.mark.parametrize("how", ["chown", "open directory"])
def test_a_link_on_the_way_that_another_user_controls_is_refused(monkeypatch, tmp_path, how):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    holder = tmp_path / "holder"
    holder.mkdir(mode=0o700)
    link = holder / "link"
    link.symlink_to(private)
    if how == "chown":
        if not ROOT:
            pytest.skip("a link of another user's needs root to make")
        os.lchown(link, STRANGER, STRANGER)
        expected = f"{link} is a symbolic link owned by uid {STRANGER}"
    else:
        os.chmod(holder, 0o777)  # anyone may replace the link
        expected = f"{holder} is writable by its group and others"
    messages, found = attempt(monkeypatch, link / "cache")
    assert found is None and expected in messages[0]
    assert list(private.iterdir()) == []


@posix
def test_a_link_on_the_way_that_is_yours_is_followed(monkeypatch, tmp_path):
    """~/.cache on another disk, say: the cache lies where the link leads."""
    elsewhere = tmp_path / "disk"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "home").mkdir(mode=0o700)
    (tmp_path / "home" / ".cache").symlink_to(Path("..") / "disk")  # relative, resolved from the link's folder
    assert attempt(monkeypatch, tmp_path / "home" / ".cache" / "jitcore") == ([], binary(b"a"))
    assert cache.entry_path(KEY).is_relative_to(elsewhere / "jitcore")


@posix
@pytest.mark.parametrize("how", ["symlink", "group writable", "other writable"])
def test_an_entry_that_is_a_link_or_writable_by_others_is_never_loaded(monkeypatch, tmp_path, how):
    cache.store(KEY, binary(b"mine"))
    path = cache.entry_path(KEY)
    if how == "symlink":
        target = tmp_path / "elsewhere.bin"
        path.rename(target)
        path.symlink_to(target)
    else:
        os.chmod(path, 0o620 if how == "group writable" else 0o602)
    assert cache.load(KEY) is None
    cache.store(KEY, binary(b"again"))  # the recompile's store replaces it
    assert cache.load(KEY) == binary(b"again")


def _entry(header: object, image: bytes = b"image") -> bytes:
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    return cache.MAGIC + struct.pack("<I", len(encoded)) + encoded + image


GOOD_HEADER = json.loads(cache.encode(binary(b"image"))[12:-5])


DAMAGED = {
    "nested past the parser (RecursionError)": _entry(b"[" * 100_000 + b"]" * 100_000),
    "nested objects": _entry(b'{"a": ' * 50_000 + b"1" + b"}" * 50_000),
    "a list": _entry([1, 2, 3]),
    "a string": _entry("a string"),
    "null": _entry(None),
    "length a string": _entry({**GOOD_HEADER, "length": "5"}),
    "length a bool": _entry({**GOOD_HEADER, "length": True}),
    "length a float": _entry({**GOOD_HEADER, "length": 5.0}),
    "digest null": _entry({**GOOD_HEADER, "sha256": None}),
    "names a list of pairs": _entry({**GOOD_HEADER, "lowered_names": [["k", "v"]]}),
    "a name an int": _entry({**GOOD_HEADER, "lowered_names": {"k<float>": 1}}),
    "log a list": _entry({**GOOD_HEADER, "log": ["a"]}),
    "arch an int": _entry({**GOOD_HEADER, "arch": 90}),
    "no compiler": _entry({k: v for k, v in GOOD_HEADER.items() if k != "compiler"}),
    "not UTF-8": _entry(b"\xff\xfe not utf-8"),
    "image truncated": _entry(GOOD_HEADER)[:-1],
    "header length truncated": _entry(GOOD_HEADER)[:11],
    "header truncated": cache.MAGIC + b"\xff\xff\xff\x00{",
}


@pytest.mark.parametrize("data", DAMAGED.values(), ids=DAMAGED.keys())
def test_damaged_entries_of_any_shape_are_missing_and_recompiled(data):
    assert cache.decode(_entry(GOOD_HEADER)) == binary(b"image")  # the control: whole, it loads
    assert cache.decode(data) is None
    backend, calls = NullBackend(), []
    original = backend.compile
    backend.compile = lambda *args: calls.append(args) or original(*args)
    first = compiler.compile_cached(backend, "__global__ void k() {}", ["k"], [], "sm_90")
    (entry,) = cache.cache_dir().glob("*/*.bin")
    entry.write_bytes(data)
    assert compiler.compile_cached(backend, "__global__ void k() {}", ["k"], [], "sm_90") == first
    assert len(calls) == 2 and cache.decode(entry.read_bytes()) == first  # recompiled, and stored again


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(header=JSON)
def test_no_header_makes_decode_raise(header):
    """Any JSON in any field: None, or an entry of the types encode writes (never an exception)."""
    for fields in (header, {**GOOD_HEADER, "lowered_names": header}, {**GOOD_HEADER, "length": header}):
        found = cache.decode(_entry(fields))
        if found is not None:
            assert found.image == b"image" and isinstance(found.lowered_names, dict)
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in found.lowered_names.items())
