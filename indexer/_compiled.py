"""Which implementation runs: the compiled core (``indexer/_core.c``) unless it is
not built (an install without a C compiler) or ``KVI_PURE_PYTHON=1`` asks for the
pure-Python twins, the reference the tests hold the compiled core to.

``core`` is the ``indexer._core`` module or None; read once, at import.
"""

from __future__ import annotations

import os
from types import ModuleType

core: ModuleType | None = None
if os.environ.get("KVI_PURE_PYTHON", "") in ("", "0"):
    try:
        from . import _core as core
    except ImportError:  # pragma: no cover - an install without a C compiler
        core = None

COMPILED = core is not None
