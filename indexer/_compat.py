"""Old module paths of the flat layout, kept importable for one release with a
``DeprecationWarning`` that names the new path (see ``CHANGELOG.md``).

Two mechanisms, because two kinds of old name exist:

* a module that no longer exists (``indexer.keys``): a meta-path finder aliases the
  old name to the new module object, so ``import indexer.keys`` and
  ``from indexer.keys import block_keys`` still work;
* a module whose name is now a package (``indexer.wire``, ``indexer.query``,
  ``indexer.transport``): the package's ``__getattr__`` serves the old module's names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType

# Old module -> new module, for modules that no longer exist under their old name.
MOVED = {
    "indexer._compiled": "indexer._native",
    "indexer._core": "indexer._native._core",
    "indexer._prefault": "indexer._native._prefault",
    "indexer.vllm_events": "indexer.wire.events",
    "indexer.engines": "indexer.wire.engines",
    "indexer.keys": "indexer.wire.keys",
    "indexer.discovery": "indexer.transport.discovery",
    "indexer.engine_metrics": "indexer.transport.engine_metrics",
    "indexer.sequencer": "indexer.sequence.sequencer",
    "indexer.tree": "indexer.store.tree",
    "indexer.state": "indexer.store.state",
    "indexer.inflight": "indexer.store.inflight",
    "indexer.removal": "indexer.store.removal",
    "indexer.lifecycle": "indexer.store.lifecycle",
    "indexer.snapshot": "indexer.store.snapshot",
    "indexer.result": "indexer.query.answers",
    "indexer.route": "indexer.query.route",
    "indexer.explain": "indexer.query.explain",
    "indexer.index": "indexer.query.index",
    "indexer.background": "indexer.ingest.background",
    "indexer.jetstream": "indexer.ingest.jetstream",
    "indexer.relay": "indexer.ingest.relay",
    "indexer.eventlog": "indexer.ingest.eventlog",
    "indexer.chat": "indexer.text.chat",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old path goes in the next release", DeprecationWarning, stacklevel=3)


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module object is the new module's, already executed."""


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        _warn(fullname, new)
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Add the finder of old module paths to ``sys.meta_path`` (once per process)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


def package_getattr(package: str, old: str, new: str, names: tuple[str, ...]) -> Callable[[str], object]:
    """A package ``__getattr__`` that serves ``names`` (the public names of module ``old``,
    whose name the package now has) from module ``new``, with a DeprecationWarning.
    Any other name is an AttributeError, so a submodule import (``from pkg import sub``)
    never picks up a name of ``new`` by accident."""
    served = frozenset(names)

    def __getattr__(name: str) -> object:
        if name not in served:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(new), name)
        _warn(f"{old}.{name}", f"{new}.{name}")
        # Kept on the package: one warning per name, not one per attribute read.
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
