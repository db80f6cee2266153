"""What the consumer knows of a vLLM engine before any event: its configuration and
vLLM's addressing rules (contract §1 Engine, Worker).

* :class:`EngineConfig`: one engine (id, model, live and replay endpoints, topic, DP
  ranks), validated when built;
* :func:`offset_endpoint`: vLLM's DP rule, rank ``r`` publishes on the ports plus ``r``;
* ``END_SEQ``: the sequence frame that ends a replay (``-1`` as 8 signed big-endian bytes).

Both the consumer (transport) and the producer side (``indexer.producer``) import from
here; nothing here imports either.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

__all__ = ["EngineConfig", "END_SEQ", "check_endpoint", "offset_endpoint", "as_config"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)

_TCP = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


def offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's DP rule: tcp ports shift by the rank (port 0 stays 0); inproc gets ``_dp<rank>``."""
    if rank == 0 or not endpoint:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if port.isdigit() and int(port) != 0:
            return f"{host}:{int(port) + rank}"
    return endpoint


def check_endpoint(endpoint: str, what: str) -> None:
    """Raise ValueError unless ``endpoint`` is something a SUB/DEALER can connect to."""
    if endpoint.startswith("tcp://"):
        m = _TCP.match(endpoint)
        if m is None or not 0 < int(m.group(2)) < 65536:
            raise ValueError(f"{what}: expected tcp://HOST:PORT with a port 1-65535, got {endpoint!r}")
    elif endpoint.startswith(("ipc://", "inproc://")):
        if endpoint.endswith("//"):
            raise ValueError(f"{what}: empty address in {endpoint!r}")
    else:
        raise ValueError(f"{what}: endpoint must be tcp://, ipc:// or inproc://, got {endpoint!r}")


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One vLLM engine (contract §1): its DP rank ``r`` publishes on the ports plus ``r``.

    ``dp_rank_start`` lets one config cover ranks ``start .. start+dp_size-1`` only, the
    first of them on ``endpoint`` itself (Dynamo registers each DP rank with its own
    endpoint); configs of one id may then cover disjoint rank ranges.
    """

    id: str
    endpoint: str
    model: str = "default"
    replay_endpoint: str | None = None
    topic: str = ""
    dp_size: int = 1
    dp_rank_start: int = 0

    @property
    def ranks(self) -> range:
        return range(self.dp_rank_start, self.dp_rank_start + self.dp_size)

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("engine id must not be empty")
        if not 1 <= self.dp_size <= 1024:
            raise ValueError(f"engine {self.id}: dp_size must be 1..1024, got {self.dp_size}")
        if not 0 <= self.dp_rank_start <= 1023:
            raise ValueError(f"engine {self.id}: dp_rank_start must be 0..1023, got {self.dp_rank_start}")
        # Every DP rank's ports (base + rank) must be valid too.
        for r in (0, self.dp_size - 1):
            check_endpoint(offset_endpoint(self.endpoint, r), f"engine {self.id} endpoint")
            if self.replay_endpoint is not None:
                check_endpoint(offset_endpoint(self.replay_endpoint, r), f"engine {self.id} replay_endpoint")


def as_config(e: EngineConfig | dict[str, Any]) -> EngineConfig:
    """``e`` as an :class:`EngineConfig`; ValueError naming the bad field otherwise."""
    if isinstance(e, EngineConfig):
        return e
    try:
        return msgspec.convert(e, EngineConfig)
    except msgspec.ValidationError as err:
        raise ValueError(f"bad engine configuration: {err}") from None
