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

A loaded entry is machine code run in this process, so the cache trusts no other user, as ssh
does not for its keys. One rule covers everything jitcore reads from it, kernel entries and the
torch-side helper (``torch-native/``, :mod:`jitcore.torch_native`) alike: the directories by
:func:`cache_root`, the files by :func:`file_refusal`, the contents by :func:`decode` (anything
that does not parse as a whole is damaged: recompiled, never an error). A directory it refuses
costs speed (compiles run uncached), never correctness.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import stat
import struct
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from jitcore.backends.base import CompiledBinary
from jitcore.errors import CacheWarning

MAGIC = b"JITCORE1"
# A temporary file untouched for this long belongs to a writer that died before its rename:
# a live write takes well under a second, and an hour also absorbs a stopped writer and the
# clock skew between this host and a network file server (which stamps the mtime).
STALE_TEMPORARY_SECONDS = 3600.0
_SHARD = re.compile(r"[0-9a-f]{2}")
#: The subdirectory holding the torch-side helper's builds (jitcore.torch_native).
HELPER_DIRECTORY = "torch-native"
# Symbolic links followed while judging a setting, at most (as the kernel's own limit).
_MAX_SYMLINKS = 40

log = logging.getLogger(__name__)


def cache_enabled() -> bool:
    return os.environ.get("JITCORE_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def current_uid() -> int | None:
    """The user whose files the cache trusts; None where the platform has no uids (Windows),
    which skips every ownership and permission check (its mode bits do not describe who may
    write: the directory's ACLs decide, and jitcore does not read them). A function, so tests
    can pretend to be another user: making a file someone else's needs root."""
    getuid = getattr(os, "getuid", None)
    return None if getuid is None else getuid()


@dataclass(frozen=True)
class CacheRoot:
    """The cache directory of one setting, as decided at its first use in this process.

    ``setting`` is the directory as configured (``JITCORE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/jitcore`` or ``~/.cache/jitcore``); ``path`` is it made absolute against
    the working directory of that first use, symlinks on the way resolved, and never
    re-resolved (a later ``chdir`` does not move the cache, nor does a symlink retargeted
    afterwards); ``refusal`` says why the directory is not used (None: it is)."""

    setting: str
    path: Path
    refusal: str | None


_roots: dict[str, CacheRoot] = {}
_roots_lock = threading.Lock()


def _setting() -> str:
    override = os.environ.get("JITCORE_CACHE_DIR")
    if override:
        return override
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jitcore")


def cache_root() -> CacheRoot:
    """The cache directory for the current setting, resolved, created and checked at its
    first use in this process (one :class:`~jitcore.errors.CacheWarning` if refused).

    The cache directory itself may not be a symbolic link (whoever made the link chose where
    jitcore writes: ``/etc``, say), and a link on the way to it must be the current user's or
    root's. Missing directories are created with mode 0700. Then, as ssh checks the path to a
    key, every directory from ``/`` down to the cache directory must be owned by the current
    user or root and not writable by group or others; a writable ancestor is allowed with the
    sticky bit (``/tmp``), which keeps others from renaming or replacing what they do not
    own. The cache directory itself and its subdirectories (the two-character shards, and
    ``torch-native/``) get no such allowance: anyone who can create names there can plant a
    subdirectory of their own.
    Creating first and checking after closes the gap in which another user could create the
    directory in between (in ``/tmp``, say). Checked once per setting and process: below a
    trusted directory only its owner and root can change anything."""
    setting = _setting()
    with _roots_lock:
        root = _roots.get(setting)
        if root is not None:
            return root
        root = _roots[setting] = _first_use(setting)
    if root.refusal is not None:  # outside the lock, and once: a warnings filter may raise
        origin = "" if str(root.path) == setting else f" ({setting!r} resolved)"
        warnings.warn(
            f"jitcore does not use the kernel cache in {root.path}{origin}: {root.refusal}. Kernels compile, "
            "uncached. The cache needs every directory on its path, and its own subdirectories, owned by you "
            f"or root and not writable by group or others (`chmod -R go-w {root.path}` fixes the cache's own); "
            "or point JITCORE_CACHE_DIR elsewhere (docs/troubleshooting.md)",
            CacheWarning,
            stacklevel=3,
        )
    return root


def cache_dir() -> Path:
    return cache_root().path


def _first_use(setting: str) -> CacheRoot:
    try:
        path = Path(os.path.realpath(setting))
    except OSError as exc:  # a relative setting in a working directory that was deleted
        return CacheRoot(setting, Path(setting), f"it cannot be resolved ({exc.strerror})")
    if not os.path.isabs(setting):
        log.info("kernel cache directory %r is relative: resolved once, to %s", setting, path)
    uid = current_uid()
    return CacheRoot(setting, path, _link_refusal(setting, uid) or _refusal(path, uid))


def _link_refusal(setting: str, uid: int | None) -> str | None:
    """Why the symbolic links on the way to ``setting`` make it unfit for ``uid``'s cache:
    the setting itself is one, or one on the way is neither ``uid``'s nor root's, or lies in a
    directory others may write without the sticky bit (its owner, or whoever may replace it,
    could point it anywhere). Followed as the kernel resolves a path, component by component."""
    parts = list(Path(os.path.join(os.getcwd(), setting)).parts[:0:-1])  # components, last first
    current, links = Path("/"), 0
    while parts:
        name = parts.pop()
        if name == "..":
            current = current.parent
            continue
        candidate = current / name
        try:
            status = os.lstat(candidate)
        except OSError:
            return None  # missing, or not reachable: no link from here on, _refusal judges the rest
        if not stat.S_ISLNK(status.st_mode):
            current = candidate
            continue
        try:
            target, home = os.readlink(candidate), os.lstat(current)
        except OSError as exc:
            return f"{candidate} cannot be examined ({exc.strerror})"
        if not parts:
            return f"{candidate} is a symbolic link (to {target}); point JITCORE_CACHE_DIR at a directory itself"
        if uid is not None and status.st_uid not in (uid, 0):
            return f"{candidate} is a symbolic link owned by uid {status.st_uid}, neither you (uid {uid}) nor root"
        problem = None if uid is None else _untrusted(home, uid, sticky_allowed=True)
        if problem:  # whoever may replace the link chooses where it leads
            return f"{current} {problem}"
        links += 1
        if links > _MAX_SYMLINKS:
            return f"{candidate}: too many levels of symbolic links"
        parts.extend(Path(target).parts[::-1])
        if os.path.isabs(target):
            parts.pop()  # the root: resolution restarts there
            current = Path("/")
    return None


def _refusal(path: Path, uid: int | None) -> str | None:
    """Create ``path`` if missing, then say why it may not hold ``uid``'s cache, if it may not."""
    chain = (path, *path.parents)
    for directory in reversed(chain):
        if not os.path.lexists(directory):
            try:
                os.mkdir(directory, 0o700)
            except FileExistsError:
                pass  # created meanwhile: judged below like any other
            except OSError as exc:
                return f"{directory} cannot be created ({exc.strerror})"
    if uid is None:
        return None
    try:
        for directory in chain:
            problem = _untrusted(os.lstat(directory), uid, sticky_allowed=directory != path)
            if problem:
                return f"{directory} {problem}"
        with os.scandir(path) as entries:
            for entry in entries:
                if _SHARD.fullmatch(entry.name) or entry.name == HELPER_DIRECTORY:
                    problem = _untrusted(entry.stat(follow_symlinks=False), uid, sticky_allowed=False)
                    if problem:
                        return f"{entry.path} {problem}"
    except OSError as exc:
        return f"{exc.filename} cannot be examined ({exc.strerror})"
    return None


def _untrusted(status: os.stat_result, uid: int, sticky_allowed: bool) -> str | None:
    """What makes a directory unfit to lead to, or hold, ``uid``'s cache; None if nothing."""
    if not stat.S_ISDIR(status.st_mode):
        return "is not a directory"
    if status.st_uid not in (uid, 0):
        return f"is owned by uid {status.st_uid}, neither you (uid {uid}) nor root"
    writable = status.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and not (sticky_allowed and status.st_mode & stat.S_ISVTX):
        who = {stat.S_IWGRP: "its group", stat.S_IWOTH: "others"}.get(writable, "its group and others")
        return f"is writable by {who} (mode {stat.S_IMODE(status.st_mode):#o})"
    return None


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
    """Parse an entry; None for anything that is not one whole entry as :func:`encode` writes
    it: torn, truncated, corrupted, nested past the parser's depth, or a header of other types."""
    if data[:8] != MAGIC or len(data) < 12:
        return None
    (header_length,) = struct.unpack("<I", data[8:12])
    try:
        header = json.loads(data[12 : 12 + header_length])
    except (ValueError, RecursionError):
        return None
    image = data[12 + header_length :]
    if not _header_fits(header, image):
        return None
    return CompiledBinary(
        image=image,
        lowered_names=dict(header["lowered_names"]),
        log=header["log"],
        arch=header["arch"],
        compiler=header["compiler"],
    )


def _header_fits(header: object, image: bytes) -> bool:
    """Whether ``header`` is an entry header (each field of its type) describing ``image``."""
    if not isinstance(header, dict):
        return False
    length, digest, names = header.get("length"), header.get("sha256"), header.get("lowered_names")
    if type(length) is not int or length != len(image) or not isinstance(digest, str):
        return False
    if not all(isinstance(header.get(field), str) for field in ("log", "arch", "compiler")):
        return False
    if not isinstance(names, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in names.items()):
        return False
    return hashlib.sha256(image).hexdigest() == digest


def file_refusal(status: os.stat_result) -> str | None:
    """What makes a file unfit to be read from the cache (a kernel entry, a build of the
    torch-side helper), from its status read without following a symbolic link; None if
    nothing. It must be a regular file, the current user's (written by anyone else, root
    included, it is never read: the recompile replaces it), and not writable by group or
    others (who could rewrite it in place, whatever its directory)."""
    uid = current_uid()
    if not stat.S_ISREG(status.st_mode):
        return "is not a regular file"
    if uid is None:
        return None
    if status.st_uid != uid:
        return f"is owned by uid {status.st_uid}, not you (uid {uid})"
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by others than you (mode {stat.S_IMODE(status.st_mode):#o})"
    return None


class RefusedFile(Exception):
    """A file in the cache that :func:`file_refusal` refuses; the message says which and why."""


def read_file(path: Path) -> bytes:
    """The bytes of a file in the cache, read only where :func:`file_refusal` accepts the file
    opened: the status judged is the one of the file read, not of whatever the name holds
    later, and a symbolic link is refused, not followed. Raises RefusedFile where refused,
    OSError where it cannot be read (FileNotFoundError: missing)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)  # a FIFO must not block
    try:
        descriptor = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RefusedFile(f"{path} is not a regular file (a symbolic link)") from None
        raise
    with os.fdopen(descriptor, "rb") as handle:
        refusal = file_refusal(os.fstat(handle.fileno()))
        if refusal is not None:
            raise RefusedFile(f"{path} {refusal}")
        return handle.read()


def load(key: str) -> CompiledBinary | None:
    """The entry for ``key``, or None: missing, damaged (:func:`decode`), in a refused
    directory, or a file :func:`read_file` refuses (the caller's recompile replaces it)."""
    if not cache_enabled() or cache_root().refusal is not None:
        return None
    try:
        data = read_file(entry_path(key))
    except (OSError, RefusedFile):
        return None
    return decode(data)


def store(key: str, binary: CompiledBinary) -> None:
    """Write atomically; a cache that cannot be written is skipped, never fatal. Only the
    subdirectory is created here: a cache directory removed after its first use stays
    missing (uncached) for the rest of the process, since re-creating it unchecked could
    adopt one another user made in its place."""
    if not cache_enabled() or cache_root().refusal is not None:
        return
    path = entry_path(key)
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        _sweep(path.parent)
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


def _sweep(directory: Path) -> None:
    """Remove the temporary files of writers killed before their rename (a writer that fails
    otherwise removes its own). Only stale ones, untouched for STALE_TEMPORARY_SECONDS: a
    younger one may be another process's write in progress. Age, not a pid check, because
    pids mean nothing across the hosts that share a cache on a network file system."""
    cutoff = time.time() - STALE_TEMPORARY_SECONDS
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                try:
                    if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                        os.unlink(entry.path)
                except OSError:
                    pass  # another writer swept it first: the write goes on either way
