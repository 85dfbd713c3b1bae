"""ReplayWarning, pointed at the user's line.

A region call reaches a warning through a varying depth of replay's own frames (the flat
dispatch in C has none, its Python fallback some, the full path more), so no fixed
``stacklevel`` is right on every path: the warning is given at the first frame outside the
replay and jitcore packages and outside generated code (whose namespace has no module name).
"""

from __future__ import annotations

import os
import sys
import warnings

import jitcore
from replay.errors import ReplayWarning

#: replay's directory (this file's) and jitcore's: frames in them are the library's.
_LIBRARY_DIRECTORIES = (os.path.dirname(__file__) + os.sep, os.path.dirname(jitcore.__file__) + os.sep)


def _is_library(frame) -> bool:
    return frame.f_code.co_filename.startswith(_LIBRARY_DIRECTORIES) or "__name__" not in frame.f_globals


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning given by this function's caller name the first
    frame outside replay, jitcore and generated code."""
    frame, level = sys._getframe(2), 2  # the caller's caller, as warnings.warn counts it
    while frame is not None and _is_library(frame):
        frame, level = frame.f_back, level + 1
    return level


def warn(message: str) -> None:
    """Give a ReplayWarning at the user's line."""
    warnings.warn(ReplayWarning(message), stacklevel=user_stacklevel())
