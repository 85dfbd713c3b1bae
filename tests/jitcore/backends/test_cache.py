"""The disk cache: hits, misses, atomic writes under concurrent processes, corruption."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from jitcore.backends import cache
from jitcore.backends.base import CompiledBinary


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


def test_unwritable_cache_is_skipped(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("JITCORE_CACHE_DIR", str(blocker))
    key = cache.entry_key("cuda", "c", "sm_90", "x", ["k"], [])
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
