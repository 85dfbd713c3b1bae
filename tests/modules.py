"""Modules written and imported by tests that need real module globals (drift checks)."""

from __future__ import annotations

import importlib
import sys
import textwrap
import types


class ModuleLoader:
    """Writes modules (and packages) into a temporary directory and imports them; the test's
    teardown removes them from ``sys.modules`` and ``sys.path``."""

    def __init__(self, root):
        self.root = root
        self.names: list[str] = []
        root.mkdir(parents=True, exist_ok=True)
        sys.path.insert(0, str(root))

    def __call__(self, **files: str) -> list[types.ModuleType]:
        """``load(helpers="EPS = 1", **{"pkg/__init__": "...", "pkg/sub": "..."})``: write the
        files, import each, return the modules in order."""
        for relative, source in files.items():
            path = self.root / f"{relative}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        loaded = []
        for relative in files:
            name = relative.removesuffix("/__init__").replace("/", ".")
            sys.modules.pop(name, None)
            self.names.append(name)
            loaded.append(importlib.import_module(name))
        return loaded

    def close(self) -> None:
        sys.path.remove(str(self.root))
        for name in self.names:
            sys.modules.pop(name, None)
