"""vLLM's own KV-event publisher, ``vllm/distributed/kv_events.py`` of release 0.33.0,
loaded from the ``vllm`` package installed from PyPI: the file is read and run as it
ships, not copied into this repository.

Source: github.com/vllm-project/vllm, release v0.33.0 (the wheel's
``vllm/_version.py`` names commit ``4ba787ec9``), files ``vllm/distributed/kv_events.py``
and ``vllm/config/kv_events.py`` (its ``KVEventsConfig``). Copyright contributors to
the vLLM project, licensed under the Apache License, Version 2.0
(http://www.apache.org/licenses/LICENSE-2.0); the license text is in the installed
wheel's ``vllm-0.33.0.dist-info/licenses/LICENSE``.

Only the package's files are needed, not its dependencies (torch and the rest): install
it with ``pip install --no-deps vllm==0.33.0``. Both files are checked against the
sha256 the wheel's ``RECORD`` lists (and pinned here), so what runs is byte for byte
what vLLM published; their ``vllm.*`` imports are answered by :mod:`vendor.vllm_shims`.

:func:`load` returns the module (``ZmqEventPublisher``, ``KVEventBatch``,
``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``...), or ``None`` with
:data:`MISSING` saying why, so that tests can skip.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import types
from importlib import metadata
from pathlib import Path

from vendor import vllm_shims

VERSION = "0.33.0"
COMMIT = "4ba787ec9"
# sha256 of each file, as vllm-0.33.0.dist-info/RECORD lists it (urlsafe base64, no padding).
FILES = {
    "vllm/config/kv_events.py": "iw5tmyRzwYXmj7QqFoq0oJbwVsTNqealZT3PEauYmbg",
    "vllm/distributed/kv_events.py": "grNioKf4kxjZEnrd_OJU1Tf1B4oxqoe-sISTsJU4le4",
}
INSTALL = f"pip install --no-deps vllm=={VERSION}"
MISSING = ""
_cache: types.ModuleType | None = None


def _source(dist: metadata.Distribution, rel: str) -> Path:
    path = Path(str(dist.locate_file(rel)))
    digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()
    if digest != FILES[rel]:
        raise RuntimeError(f"{path}: sha256 {digest}, not vLLM {VERSION}'s {FILES[rel]}")
    return path


def _exec(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load() -> types.ModuleType | None:
    global _cache, MISSING
    if _cache is not None:
        return _cache
    try:
        dist = metadata.distribution("vllm")
    except metadata.PackageNotFoundError:
        MISSING = f"vLLM's own publisher needs the vllm {VERSION} package's files: {INSTALL}"
        return None
    if dist.version != VERSION:
        MISSING = f"vllm {dist.version} is installed, these tests pin {VERSION}: {INSTALL}"
        return None
    cfg_path = _source(dist, "vllm/config/kv_events.py")
    kv_path = _source(dist, "vllm/distributed/kv_events.py")
    with vllm_shims.installed():
        cfg = _exec("vllm_0_33_0_config_kv_events", cfg_path)
    with vllm_shims.installed({"vllm.config.kv_events": cfg}):
        _cache = _exec("vllm_0_33_0_distributed_kv_events", kv_path)
    return _cache
