"""A pytest plugin: in CI (``CI`` true in the environment), a skipped test fails the
session unless its skip is on :data:`EXPECTED`.

CI runs the README's test command with every optional piece installed (the ``test``
extra, the compiled core, vLLM, the engine venv, the team's shared data), so a skip there
means a check silently did not run: a dependency that stopped installing, a core that no
longer compiles. Outside CI skips are reported as usual. The root ``conftest.py`` loads this
module; it is a module of its own so that a pytester session can load it too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest


def in_ci() -> bool:
    """``CI`` as CI services set it (the real-engine tier reads it the same way)."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _pure_python() -> bool:
    # As indexer._native decides: any value but "" and "0" asks for the pure-Python build.
    return os.environ.get("KVI_PURE_PYTHON", "") not in ("", "0")


def _no_trace() -> bool:
    from indexer.producer import sim

    return not sim.TRACE.exists()


@dataclass(frozen=True)
class Expected:
    """A skip reason (its start) and the condition under which that skip is expected."""

    reason: str
    when: Callable[[], bool]
    why: str


# Every pytest.skip / skipif / importorskip in tests/ is either here, with the condition
# that makes it expected, or unexpected in CI: the text extra's imports (tokenizers, jinja2,
# transformers), vLLM, the compiled core of a normal build and the kv-indexer script are
# all installed by the README's command. The real-engine tier fails in CI by itself.
EXPECTED = (
    Expected("no Mooncake trace at ", _no_trace,
             "the trace is the team's shared data, absent from a plain clone; the synthetic twin runs instead"),
    Expected("the pure-Python build: nothing compiled to compare", _pure_python, "KVI_PURE_PYTHON asks for no core"),
    Expected("the compiled core is not built (or KVI_PURE_PYTHON=1)", _pure_python,
             "KVI_PURE_PYTHON asks for no core"),
    Expected("needs the compiled core", _pure_python, "KVI_PURE_PYTHON asks for no core"),
    Expected("reads /proc", lambda: not sys.platform.startswith("linux"), "only Linux has /proc"),
)


def expected(reason: str) -> bool:
    return any(reason.startswith(e.reason) and e.when() for e in EXPECTED)


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


class SkipGate:
    """Collects the unexpected skips of a session; in CI, lists them and fails the session."""

    def __init__(self) -> None:
        self.skips: list[tuple[str, str]] = []  # (node id, reason)

    def _note(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        # An xfail is reported as skipped too, but it ran: not a skip.
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = _reason(report)
            if not expected(reason):
                self.skips.append((report.nodeid, reason))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._note(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        # A module-level skip (importorskip, allow_module_level) is reported at collection.
        self._note(report)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if in_ci() and self.skips:
            terminalreporter.section("skips not expected in CI (CI is true): the session fails", sep="=", red=True)
            for nodeid, reason in self.skips:
                terminalreporter.line(f"SKIPPED {nodeid}: {reason}", red=True)
            terminalreporter.line("The expected skips, and when they are expected: EXPECTED in tests/skipgate.py")

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        # A session that only skipped (exit 5, nothing collected) fails too.
        if in_ci() and self.skips and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SkipGate(), "skipgate-session")
