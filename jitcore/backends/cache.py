"""A disk cache of compiled kernel binaries, shared by every process of a user.

Entries are keyed by everything that changes the binary: backend, compiler version, target
architecture, source, name expressions, options and the contents of every user header the
source can include (see :func:`header_digest`; system and toolkit headers are covered by the
compiler version). An entry is one file:

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
import re
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
    headers: str = "",
) -> str:
    """``headers`` is :func:`header_digest`'s answer; empty (no user header) keeps the key
    of a header-free source what it always was."""
    digest = hashlib.sha256()
    parts = [backend, compiler, arch, source, "\0".join(name_expressions), "\0".join(options)]
    if headers:
        parts.append(headers)
    for part in parts:
        encoded = part.encode()
        digest.update(struct.pack("<Q", len(encoded)))
        digest.update(encoded)
    return digest.hexdigest()


# --- user headers ------------------------------------------------------------------------
# Directives that name a header: #include, #include_next, #import, and __has_include(...)
# (its answer changes the compile as much as an include does).
_DIRECTIVE = re.compile(r"^[ \t]*#[ \t]*(?:include_next|include|import)\b[ \t]*(.*)$", re.MULTILINE)
_HAS_INCLUDE = re.compile(r"__has_include(?:_next)?\s*\(\s*([^)]*)\)")
# Options that add a header search directory, or a header included before the source.
_DIR_OPTIONS = ("--include-path", "-I", "-isystem", "-iquote", "-idirafter")
_PRE_INCLUDE_OPTIONS = ("--pre-include", "-include")


class UnresolvableInclude(Exception):
    """An include whose file cannot be named without running the preprocessor."""


def _split_options(options: Sequence[str], cwd: str) -> tuple[list[str], list[str]]:
    """(search directories, pre-included headers) from compiler options, in any of the
    spellings NVRTC and hiprtc take: ``-Idir``, ``-I dir``, ``--include-path=dir``, ..."""
    dirs: list[str] = []
    pre: list[str] = []
    pending: list[str] | None = None
    for option in options:
        if pending is not None:
            pending.append(option)
            pending = None
            continue
        for names, target in ((_DIR_OPTIONS, dirs), (_PRE_INCLUDE_OPTIONS, pre)):
            matched = False
            for name in names:
                if option == name:
                    pending, matched = target, True
                elif name.startswith("--") and option.startswith(name + "="):
                    target.append(option[len(name) + 1 :])
                    matched = True
                elif not name.startswith("--") and option.startswith(name) and len(option) > len(name):
                    target.append(option[len(name) :])
                    matched = True
                if matched:
                    break
            if matched:
                break
    return [os.path.join(cwd, d) for d in dirs], pre


def _header_names(text: str) -> list[tuple[str, str]]:
    """Every (delimiter, name) the text may include; raises UnresolvableInclude for a computed
    include (``#include SOME_MACRO``), whose file only the preprocessor knows."""
    found = []
    operands = [m.group(1) for m in _DIRECTIVE.finditer(text)] + [m.group(1) for m in _HAS_INCLUDE.finditer(text)]
    for operand in operands:
        operand = operand.strip()
        if operand[:1] == '"' and '"' in operand[1:]:
            found.append(('"', operand[1 : operand.index('"', 1)]))
        elif operand[:1] == "<" and ">" in operand:
            found.append(("<", operand[1 : operand.index(">")]))
        else:
            raise UnresolvableInclude(operand)
    return found


def header_digest(source: str, options: Sequence[str], cwd: str | None = None) -> str | None:
    """A digest of every user header ``source`` can reach, or None if one cannot be named.

    The cache cannot run the compiler's preprocessor or mirror its search order exactly, so
    this errs towards more: for every ``#include`` (also in inactive ``#if`` branches and
    comments) it hashes *each* existing candidate file in every user directory that could
    supply it (for ``"..."``: the including file's directory, the working directory, which
    NVRTC and hiprtc use for the main source, and every ``-I``-like directory; for ``<...>``:
    the ``-I``-like directories), and follows their includes the same way. A header
    found nowhere there is a system or toolkit header (the compiler version keys those) or
    missing (the compile fails and nothing is stored). The digest covers paths and contents,
    so editing, adding or shadowing a header all change the key. Empty when no user header is
    reachable. None for a computed include (``#include MACRO``) or an unreadable header: the
    caller must then compile without the cache rather than risk a stale binary."""
    cwd = os.getcwd() if cwd is None else cwd
    dirs, pre_includes = _split_options(options, cwd)
    entries: dict[str, str] = {}  # resolved path -> sha256 of its bytes
    scanned: set[tuple[str, tuple[str, ...]]] = set()
    # (text, the directories of the file it came from, searched first by quoted includes)
    pending: list[tuple[str, tuple[str, ...]]] = [(source, (cwd,))]
    for name in pre_includes:
        pending.append((f'#include "{name}"\n', (cwd,)))
    try:
        while pending:
            text, own = pending.pop()
            for delimiter, name in _header_names(text):
                roots = (*own, cwd, *dirs) if delimiter == '"' else tuple(dirs)
                candidates = [name] if os.path.isabs(name) else [os.path.join(root, name) for root in roots]
                for candidate in candidates:
                    path = os.path.realpath(candidate)
                    if not os.path.isfile(path):
                        continue
                    # Both the path as found and the symlink's target can anchor quoted includes.
                    where = tuple(dict.fromkeys((os.path.dirname(os.path.abspath(candidate)), os.path.dirname(path))))
                    if (path, where) in scanned:
                        continue
                    scanned.add((path, where))
                    with open(path, "rb") as handle:
                        data = handle.read()
                    entries[path] = hashlib.sha256(data).hexdigest()
                    pending.append((data.decode("utf-8", errors="replace"), where))
    except (UnresolvableInclude, OSError):
        return None
    if not entries:
        return ""
    return "\n".join(f"{path}\0{digest}" for path, digest in sorted(entries.items()))


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
