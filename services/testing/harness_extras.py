"""Whether a third-party harness can run here: its optional extra installs only where it can.

Tests of the harnesses skip with this reason, never silently: Harbor 0.25 (terminus2)
requires Python >= 3.12, and either extra may simply not be installed.
"""

from __future__ import annotations

import importlib.util
import sys

#: harness -> (the module its extra provides, the extra's name)
_EXTRAS = {"terminus2": ("harbor", "terminus2"), "mini_swe_agent": ("minisweagent",
                                                                     "mini-swe-agent")}


def missing_harness_extra(harness: str) -> str | None:
    """Why `harness` cannot run in this interpreter, or None when it can."""
    module, extra = _EXTRAS[harness]
    if harness == "terminus2" and sys.version_info < (3, 12):
        return (f"Harbor 0.25 (the {extra} extra) requires Python >= 3.12; this is "
                f"{sys.version_info.major}.{sys.version_info.minor}")
    if importlib.util.find_spec(module) is None:
        return f"the {extra} extra is not installed (pip install 'riptide[{extra}]')"
    return None
