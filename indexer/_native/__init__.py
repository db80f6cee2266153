"""Which implementation runs: the compiled core (``indexer/_native/*.c``) unless it is
not built (an install without a C compiler) or ``KVI_PURE_PYTHON=1`` asks for the
pure-Python twins, the reference the tests hold the compiled core to.

``core`` is the ``indexer._native._core`` module or None; read once, at import.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def compiled(name: str) -> ModuleType | None:
    """The compiled module ``name`` (``"indexer._native._core"``, ``"api._surface"``), or
    None when it is not built (an install without a C compiler) or ``KVI_PURE_PYTHON=1``
    asks for the pure-Python paths: one switch for every compiled module of the project."""
    if os.environ.get("KVI_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        return importlib.import_module(name)
    except ImportError:  # pragma: no cover - an install without a C compiler
        return None


core: ModuleType | None = compiled("indexer._native._core")
COMPILED = core is not None


def prefault_arenas(n: int) -> bool:
    """Have pymalloc take its arenas from a reserve of ``n`` (1..128) that a background
    thread keeps faulted in (``indexer/_native/_prefault.c``), process-wide: the page faults of
    a growing index leave the thread that applies events. For a long-lived process that
    grows an index (the service calls it at start). False when that module is not built
    or the platform lacks it (not Linux); nothing changes then."""
    try:
        from indexer._native import _prefault
    except ImportError:  # pragma: no cover - an install without a C compiler
        return False
    return bool(_prefault.install(n))
