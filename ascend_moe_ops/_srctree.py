"""Names of the shipped sub-packages, also in a source checkout used without an install.

An install (``setup.py``) maps ``triton_ref/`` to ``ascend_moe_ops.triton_ref`` and ``bench/`` to
``ascend_moe_ops.benchmark.suite``; nothing named ``triton_ref`` lands at the top level of
site-packages. A checkout put on ``PYTHONPATH`` has those folders next to the package instead; this
finder (which answers only when the installed folder is absent) gives them the same names, so every
import in the project uses the namespaced name. It is consulted before the other finders: a package
imported from a checkout takes these sub-packages from the same checkout, not from another one
that an editable install of the project maps them to.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_PKG = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_PKG)
ALIASES = {
    "ascend_moe_ops.triton_ref": (os.path.join(_PKG, "triton_ref"), os.path.join(_ROOT, "triton_ref")),
    "ascend_moe_ops.benchmark.suite": (os.path.join(_PKG, "benchmark", "suite"), os.path.join(_ROOT, "bench")),
}


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in ALIASES:
            return None
        installed, src = ALIASES[name]
        init = os.path.join(src, "__init__.py")
        if os.path.isdir(installed) or not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[src])


def install() -> None:
    if not any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceTreeFinder())
