"""ReplayWarning at the user's line: each text once per line under the ``default`` filter, what
was shown remembered in a bounded record of replay's own."""

from __future__ import annotations

import importlib.machinery
import warnings

import replay
from replay import warn as warn_module


def _say(text: str) -> None:
    warn_module.warn(text)  # (this file is outside replay: the warning names this line)


def test_each_text_is_shown_once_per_line_and_the_record_of_them_stays_bounded():
    texts = [
        f"region step: runs eagerly: args[0]['request {n}'] is an object" for n in range(3 * warn_module.MAX_SHOWN)
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):
            _say("a repeated text")
        for text in texts:
            _say(text)
    shown = [str(w.message) for w in caught]
    assert shown == ["a repeated text", *texts] and all(w.category is replay.ReplayWarning for w in caught)
    assert {w.filename for w in caught} == {__file__} and len({w.lineno for w in caught}) == 1
    assert len(warn_module._SHOWN[__file__]) <= warn_module.MAX_SHOWN + 2  # (the filters' version too)
    assert not any(texts[0] in str(key) for key in globals().get("__warningregistry__", {}))


def test_files_beyond_the_bound_start_the_record_over():
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("default")
        for n in range(warn_module.MAX_FILES + 5):
            exec(compile("say('text')", f"<user file {n}>", "exec"), {"__name__": "user", "say": warn_module.warn})
    assert len(warn_module._SHOWN) <= warn_module.MAX_FILES


def test_a_warning_given_in_a_module_run_as_main_reads_no_source_through_its_loader():
    # ``python -m package.module``: its loader answers only for its own name, not "__main__"
    loader = importlib.machinery.SourceFileLoader("a.module", __file__)
    namespace = {"__name__": "__main__", "__loader__": loader, "say": warn_module.warn}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile("say('from main')", "<a module run as main>", "exec"), namespace)
    assert [str(w.message) for w in caught] == ["from main"]
