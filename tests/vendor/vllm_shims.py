"""Stand-ins for the few ``vllm`` modules that vLLM's ``vllm/distributed/kv_events.py``
imports, so that file runs without vLLM's own dependencies (torch, CUDA...).

Each stand-in provides exactly the names the file imports, with vLLM's meaning:

* ``vllm.logger.init_logger``: a plain :func:`logging.getLogger`;
* ``vllm.config.utils.config``: a pydantic dataclass forbidding extra fields, as
  vLLM's decorator makes (``vllm/config/kv_events.py``, vLLM's own ``KVEventsConfig``,
  is loaded with it, not rewritten);
* ``vllm.utils.network_utils``: ``get_ip`` as with ``VLLM_HOST_IP`` set (that variable,
  else ``127.0.0.1``: a test never looks for a routable address), and
  ``get_tcp_uri``, ``is_valid_ipv6_address``, ``split_zmq_path`` as vLLM defines them;
* ``vllm.v1.core.kv_cache_utils.ExternalBlockHash``: ``bytes | int``, vLLM's alias.

:func:`installed` puts them in :data:`sys.modules` for the length of a ``with`` block
and takes them out again (the real ``vllm`` package is never imported).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse


def init_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def config(cls: Any = None, **kwargs: Any) -> Any:
    from pydantic import ConfigDict
    from pydantic.dataclasses import dataclass

    def wrap(c: Any) -> Any:
        return dataclass(config=ConfigDict(extra="forbid"), **kwargs)(c)

    return wrap if cls is None else wrap(cls)


def get_ip() -> str:
    return os.environ.get("VLLM_HOST_IP") or "127.0.0.1"


def is_valid_ipv6_address(address: str) -> bool:
    try:
        ipaddress.IPv6Address(address)
        return True
    except ValueError:
        return False


def get_tcp_uri(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if is_valid_ipv6_address(ip) else f"tcp://{ip}:{port}"


def split_zmq_path(path: str) -> tuple[str, str, str]:
    parsed = urlparse(path)
    if not parsed.scheme:
        raise ValueError(f"Invalid zmq path: {path}")
    host = parsed.hostname or ""
    port = "" if parsed.port is None else str(parsed.port)
    if parsed.scheme == "tcp" and not all((host, port)):
        raise ValueError(f"Invalid zmq path: {path}")
    if parsed.scheme != "tcp" and port:
        raise ValueError(f"Invalid zmq path: {path}")
    return parsed.scheme, host, port


def _module(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


SHIMS: dict[str, types.ModuleType] = {
    "vllm.logger": _module("vllm.logger", init_logger=init_logger),
    "vllm.config.utils": _module("vllm.config.utils", config=config),
    "vllm.utils.network_utils": _module(
        "vllm.utils.network_utils", get_ip=get_ip, get_tcp_uri=get_tcp_uri,
        is_valid_ipv6_address=is_valid_ipv6_address, split_zmq_path=split_zmq_path),
    "vllm.v1.core.kv_cache_utils": _module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int),
}


@contextmanager
def installed(extra: dict[str, types.ModuleType] | None = None) -> Iterator[None]:
    """The stand-ins (and ``extra``) in :data:`sys.modules` inside the block only."""
    mods = {**SHIMS, **(extra or {})}
    clash = [n for n in mods if n in sys.modules]
    if clash:
        raise RuntimeError(f"already imported, not shadowing: {clash}")
    sys.modules.update(mods)
    try:
        yield
    finally:
        for n in mods:
            sys.modules.pop(n, None)
