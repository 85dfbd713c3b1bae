"""The type checker as a guard against wiring bugs: a method called on the wrong object, a
misspelled name, a call with arguments its function does not take. CPU tests replace parts of
a session with test doubles, so such a bug can pass every CPU test and fail only on a GPU.

mypy runs over ``jitcore`` and ``replay`` with the settings of ``[tool.mypy]`` in
pyproject.toml: untyped functions checked too, and only the error codes that find such bugs
(attr-defined, name-defined, call-arg) enabled."""

import os
import re
from pathlib import Path

import pytest

api = pytest.importorskip("mypy.api", reason="mypy is not installed (the test extra brings it)")

ROOT = Path(__file__).resolve().parents[1]

#: The error codes the guard reports; pyproject.toml disables every other one.
WIRING_CODES = frozenset({"attr-defined", "name-defined", "call-arg"})


def test_no_wiring_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the config's paths are relative to the repository root
    # no cache: a cold run is what CI pays, and nothing is written into the repository
    stdout, stderr, status = api.run(["--config-file", "pyproject.toml", "--cache-dir", os.devnull])
    assert status in (0, 1), f"mypy could not run (exit status {status}):\n{stdout}{stderr}"
    # only the wiring codes count: a newer mypy's new default code reports outside the guard
    errors = [line for line in stdout.splitlines() if ": error: " in line and _code(line) in WIRING_CODES]
    assert not errors, f"mypy found {len(errors)} wiring error(s):\n" + "\n".join(errors)


def _code(line: str) -> str:
    match = re.search(r"\[([a-z-]+)\]$", line.strip())
    return match.group(1) if match else ""


def test_config_keeps_the_wiring_codes_enabled() -> None:
    """pyproject.toml disables the codes outside the guard, never one of the three."""
    config = (ROOT / "pyproject.toml").read_text()
    section = config[config.index("[tool.mypy]") :]
    listed = section[section.index("disable_error_code") : section.index("]", section.index("disable_error_code"))]
    disabled = set(re.findall(r'"([a-z-]+)"', listed))
    assert disabled and not disabled & WIRING_CODES
