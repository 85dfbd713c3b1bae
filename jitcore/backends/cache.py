"""A disk cache of compiled kernel binaries, shared by every process of a user.

Entries are keyed by everything that changes the binary: backend, compiler version, target
architecture, source, name expressions and options. An entry is one file:

    magic (8 bytes) | header length (4) | header JSON | payload

The header carries the payload's length and SHA-256 and the lowered names. Writers write a
temporary file in the same directory and rename it over the entry, so a reader sees either the
old file, the new one or none, never a torn one; a reader that finds a bad length or hash treats
the entry as missing (the caller recompiles and overwrites it).

``JITCORE_CACHE_DIR`` moves the cache; ``JITCORE_CACHE=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path

from jitcore.backends.base import CompiledBinary

MAGIC = b"JITCORE1"


def cache_enabled() -> bool:
    return os.environ.get("JITCORE_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    override = os.environ.get("JITCORE_CACHE_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jitcore"


def entry_key(
    backend: str,
    compiler: str,
    arch: str,
    source: str,
    name_expressions: Sequence[str],
    options: Sequence[str],
) -> str:
    digest = hashlib.sha256()
    for part in (backend, compiler, arch, source, "\0".join(name_expressions), "\0".join(options)):
        encoded = part.encode()
        digest.update(struct.pack("<Q", len(encoded)))
        digest.update(encoded)
    return digest.hexdigest()


def entry_path(key: str) -> Path:
    return cache_dir() / key[:2] / f"{key}.bin"


def encode(binary: CompiledBinary) -> bytes:
    header = json.dumps(
        {
            "length": len(binary.image),
            "sha256": hashlib.sha256(binary.image).hexdigest(),
            "lowered_names": binary.lowered_names,
            "log": binary.log,
            "arch": binary.arch,
            "compiler": binary.compiler,
        },
        sort_keys=True,
    ).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + binary.image


def decode(data: bytes) -> CompiledBinary | None:
    """Parse an entry; None for anything torn, truncated or corrupted."""
    try:
        if data[:8] != MAGIC:
            return None
        (header_length,) = struct.unpack("<I", data[8:12])
        header = json.loads(data[12 : 12 + header_length])
        image = data[12 + header_length :]
        if len(image) != header["length"] or hashlib.sha256(image).hexdigest() != header["sha256"]:
            return None
        return CompiledBinary(
            image=image,
            lowered_names=dict(header["lowered_names"]),
            log=header["log"],
            arch=header["arch"],
            compiler=header["compiler"],
        )
    except (ValueError, KeyError, TypeError, struct.error):
        return None


def load(key: str) -> CompiledBinary | None:
    if not cache_enabled():
        return None
    try:
        data = entry_path(key).read_bytes()
    except OSError:
        return None
    return decode(data)


def store(key: str, binary: CompiledBinary) -> None:
    """Write atomically; a cache that cannot be written is skipped, never fatal."""
    if not cache_enabled():
        return
    path = entry_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(encode(binary))
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        except BaseException:
            try:
                os.unlink(temporary)
            except OSError:
                pass
            raise
    except OSError:
        return
