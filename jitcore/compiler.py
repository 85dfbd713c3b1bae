"""Runtime compilation, vendor-neutral: prelude, disk cache and readable compile errors.

The backend compiles; this module decides what to compile (the user's source behind a
prelude, with ``#line`` so the compiler reports the user's own line numbers), consults the
disk cache first and turns compiler failures into a :class:`~jitcore.errors.CompileError`
that quotes the offending source lines.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence

from jitcore.backends import cache
from jitcore.backends.base import Backend, CompiledBinary
from jitcore.errors import CompileError

# "kernel.cu(12): error" (NVRTC) and "kernel.cu:12:5: error" (hiprtc / clang)
log = logging.getLogger("jitcore")

_LOCATION = re.compile(r"kernel\.cu(?:\((\d+)\)|:(\d+):\d+):\s*(?:catastrophic )?error")


def full_source(backend: Backend, source: str, type_names: Sequence[str]) -> str:
    return backend.prelude(source, type_names) + '#line 1 "kernel.cu"\n' + source


def source_excerpt(source: str, log: str, context: int = 2) -> str:
    """The user's source around every line the compiler log points at, numbered."""
    lines = source.splitlines()
    wanted: list[int] = []
    for match in _LOCATION.finditer(log):
        number = int(match.group(1) or match.group(2))
        if number not in wanted:
            wanted.append(number)
    if not wanted:
        return ""
    shown: set[int] = set()
    for number in wanted:
        shown.update(range(max(1, number - context), min(len(lines), number + context) + 1))
    width = len(str(max(shown))) if shown else 1
    out, previous = [], None
    for number in sorted(shown):
        if previous is not None and number != previous + 1:
            out.append(" " * width + " | ...")
        marker = ">" if number in wanted else " "
        out.append(f"{marker}{number:>{width}} | {lines[number - 1]}")
        previous = number
    return "\n".join(out)


def compile_cached(
    backend: Backend,
    source: str,
    name_expressions: Sequence[str],
    options: Sequence[str],
    arch: str,
    type_names: Sequence[str] = (),
) -> CompiledBinary:
    """Compile ``source`` (the user's text) for ``arch``, through the disk cache.

    The key covers every user header the source can include (:func:`cache.header_digest`),
    so editing a header found through ``-I`` (or next to the working directory) recompiles
    in the next process instead of serving the old binary. A source whose headers cannot be
    named (a computed ``#include MACRO``, an unreadable header) is compiled without the cache;
    a header that changes while compiling keeps the result out of the cache."""
    text = full_source(backend, source, type_names)
    compiler = backend.compiler_version()
    headers = cache.header_digest(text, options)
    key = cache.entry_key(backend.name, compiler, arch, text, name_expressions, options, headers or "")
    binary = cache.load(key) if headers is not None else None
    if binary is not None and all(e in binary.lowered_names for e in name_expressions):
        log.debug("%s for %s: from the disk cache", ", ".join(name_expressions), arch)
        return binary
    started = time.perf_counter()
    try:
        binary = backend.compile(text, name_expressions, options, arch)
    except CompileError as exc:
        log.info("%s for %s: compile failed", ", ".join(name_expressions), arch)
        excerpt = source_excerpt(source, exc.log)
        message = f"{exc}\n\n{exc.log.strip()}"
        if excerpt:
            message += f"\n\nsource:\n{excerpt}"
        raise CompileError(message, log=exc.log, source_excerpt=excerpt) from None
    cached = headers is not None and cache.header_digest(text, options) == headers
    if cached:
        cache.store(key, binary)
    log.info(
        "%s for %s: compiled in %.1f ms%s",
        ", ".join(name_expressions),
        arch,
        (time.perf_counter() - started) * 1e3,
        "" if cached else " (not cached: its headers could not be named, or changed while compiling)",
    )
    return binary
