"""One routed request as the in-flight view holds it, and who is told of this replica's
own (:class:`FlightListener`; :class:`NoListener` when nobody is): shared by
:mod:`.inflight` and :mod:`.peerflight`."""

from __future__ import annotations

from array import array
from typing import Protocol

__all__ = ["NO_KEYS", "FlightListener", "FlightRequest", "NoListener", "WorkerKey"]

WorkerKey = tuple[str, int]  # (engine, dp_rank)
NO_KEYS: array[int] = array("Q")  # a request's keys once none is predicted any more

class FlightRequest:
    """A routed request: its prompt's keys, its load, its deadlines, who routed it."""

    __slots__ = ("id", "model", "worker", "keys", "prefill_tokens", "decode_blocks", "t", "expiry",
                 "prefill_open", "decode_open", "origin")

    def __init__(self, rid: str, model: str, worker: WorkerKey, keys: array[int], prefill_tokens: int,
                 decode_blocks: int, t: float, expiry: float, predict: bool) -> None:
        self.id = rid
        self.model = model
        self.worker = worker
        self.keys = keys
        self.prefill_tokens = prefill_tokens
        self.decode_blocks = decode_blocks
        self.t = t
        self.expiry = expiry  # of its prefill (and of its prediction marks)
        self.prefill_open = predict  # waiting for the worker to announce its blocks
        self.decode_open = decode_blocks > 0
        self.origin = ""  # the router replica that routed it ("": this one)


class FlightListener(Protocol):
    """Told of this replica's own bookkeeping as it happens, under the index's lock (so
    it must only queue what it is told): what route sync publishes to the other replicas.
    Nothing applied from a peer (:mod:`.peerflight`) is told back."""

    def recorded(self, rid: str, model: str, worker: WorkerKey, keys: array[int], prefill_tokens: int,
                 decode_blocks: int, prefill_open: bool) -> None: ...

    def ended(self, rid: str, origin: str, why: str, whole: bool) -> None: ...

    def forgot(self, worker: WorkerKey) -> None: ...


class NoListener:
    """The listener of a replica alone: tells nobody."""

    def recorded(self, rid: str, model: str, worker: WorkerKey, keys: array[int], prefill_tokens: int,
                 decode_blocks: int, prefill_open: bool) -> None:
        pass

    def ended(self, rid: str, origin: str, why: str, whole: bool) -> None:
        pass

    def forgot(self, worker: WorkerKey) -> None:
        pass
