"""ReplayWarning, pointed at the user's line.

A region call reaches a warning through a varying depth of replay's own frames (the flat
dispatch in C has none, its Python fallback some, the full path more), so no fixed
``stacklevel`` is right on every path: the warning is given at the first frame outside the
replay and jitcore packages and outside generated code (whose namespace has no module name).

What was shown where is remembered as the warnings filters' ``default`` action does (each text
once per line), in a record of replay's own rather than the user's module's
``__warningregistry__``: warnings whose text names an argument (a dict keyed by request id)
would otherwise grow that registry by one entry per call for the life of the process. The
record keeps ``MAX_SHOWN`` texts per file and ``MAX_FILES`` files, and starts over beyond: a
text may then be shown again.
"""

from __future__ import annotations

import os
import sys
import warnings

import jitcore
from replay.errors import ReplayWarning

#: replay's directory (this file's) and jitcore's: frames in them are the library's.
_LIBRARY_DIRECTORIES = (os.path.dirname(__file__) + os.sep, os.path.dirname(jitcore.__file__) + os.sep)

#: Texts remembered as shown, per file, and files remembered (see the module docstring).
MAX_SHOWN = 1024
MAX_FILES = 64
#: The user's file -> the registry ``warnings.warn_explicit`` keeps what it showed there in.
_SHOWN: dict[str, dict] = {}


def _is_library(frame) -> bool:
    return frame.f_code.co_filename.startswith(_LIBRARY_DIRECTORIES) or "__name__" not in frame.f_globals


def warn(message: str) -> None:
    """Give a ReplayWarning at the user's line."""
    frame = sys._getframe(1)
    while frame is not None and _is_library(frame):
        frame = frame.f_back
    if frame is None:  # (as warnings.warn does past the outermost frame)
        namespace, filename, line = sys.__dict__, "sys", 1
    else:
        namespace, filename, line = frame.f_globals, frame.f_code.co_filename, frame.f_lineno
    registry = _SHOWN.get(filename)
    if registry is None or len(registry) > MAX_SHOWN:
        if registry is None and len(_SHOWN) >= MAX_FILES:
            _SHOWN.clear()
        registry = _SHOWN[filename] = {}
    module = namespace.get("__name__", "<string>")
    # without the module's globals, as warnings.warn gives none: through them the source line
    # is read by the module's loader, which refuses a module run as __main__ (python -m)
    warnings.warn_explicit(ReplayWarning(message), ReplayWarning, filename, line, module, registry)
