"""Fixtures more than one test file uses.

* ``serve``: ``kv-indexer serve`` processes (:class:`svc.Server`), stopped after the test;
* ``pubs``: vLLM-compatible publishers, on an ephemeral 127.0.0.1 port unless told
  otherwise, closed after the test;
* ``mooncake_trace``: the Mooncake trace, or a skip where it is absent.

Every test is marked with its tier, the folder it is in (``unit``, ``service``, ``e2e``),
so ``pytest -m unit`` runs the in-process tier alone. The ``skipgate`` plugin fails a CI
session (``CI`` true) that skipped a test for a reason it does not expect; ``pytester``
is there for the tests of that gate.

Plain helpers stay importable modules: ``svc`` (the HTTP client, waits, free ports),
``evkit`` (vLLM-shaped events, engine hashes, index probes) and ``golden`` (the vendored
vLLM payloads in ``tests/data/vllm-golden``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester", "skipgate"]

EPHEMERAL = "tcp://127.0.0.1:*"
TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "service", "e2e")


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        try:
            tier = item.path.resolve().relative_to(TESTS).parts[0]
        except ValueError:  # a test outside tests/ (a pytester session's)
            continue
        if tier in TIERS:
            item.add_marker(tier)


@pytest.fixture(autouse=True)
def _close_clients():
    """Close the connection of every ``svc.Client`` the test made, rather than leave its
    socket to the garbage collector (a ResourceWarning, an error here, in a later test)."""
    yield
    import svc

    while svc.Client.opened:
        svc.Client.opened.pop().close()


@pytest.fixture
def serve():
    """``serve(*args, env=None)`` starts a ``kv-indexer serve`` (a :class:`svc.Server`,
    answering ``/healthz``); every one started is stopped after the test. A test may
    ``stop()`` one itself first (to read its whole log, say): stopping twice is harmless."""
    from svc import Server

    started: list[Server] = []

    def start(*args: str, env: dict | None = None) -> Server:
        s = Server(*args, env=env)
        started.append(s)
        return s

    yield start
    for s in reversed(started):
        s.stop()


@pytest.fixture
def pubs():
    """``pubs(endpoint=EPHEMERAL, **kw)`` makes a bound
    :class:`~indexer.producer.publisher.VllmPublisher` (an ephemeral port: no race for
    it); every one made is closed after the test."""
    from indexer.producer.publisher import VllmPublisher

    made: list[VllmPublisher] = []

    def make(endpoint: str = EPHEMERAL, **kw) -> VllmPublisher:
        kw.setdefault("bind", True)
        p = VllmPublisher(endpoint, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


@pytest.fixture
def mooncake_trace():
    """The Mooncake trace's path (``indexer.producer.sim.TRACE``: ``$KVI_TRACE``, else the
    team's shared data beside the repository). Absent, as in a plain clone, the test is
    skipped: only tests whose synthetic-workload twin runs everywhere may use this."""
    from indexer.producer.sim import TRACE

    if not TRACE.exists():
        pytest.skip(f"no Mooncake trace at {TRACE} (the team's shared data beside the repository; "
                    "KVI_TRACE names another copy): the same checks run on synthetic requests in this test's twin")
    return TRACE


@pytest.fixture
def natsd(tmp_path):
    """A real nats-server with JetStream on 127.0.0.1 (tests/natsd.py), stopped after the test."""
    from natsd import NatsServer

    s = NatsServer(tmp_path / "nats")
    yield s
    s.stop()
