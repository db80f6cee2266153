"""The suite's own rules (pyproject.toml, tests/conftest.py, tests/skipgate.py): a warning
fails its test, every test carries its tier's marker, and in CI (``CI`` true) a skip not on
the expected list fails the session. The CI switch is shown on pytester sessions."""

from __future__ import annotations

import warnings

import pytest

import skipgate


def test_a_warning_fails_the_test():
    with pytest.raises(UserWarning, match="any warning"):
        warnings.warn("any warning", UserWarning, stacklevel=1)


def test_a_test_carries_the_marker_of_its_tier(request):
    assert [m.name for m in request.node.iter_markers() if m.name in ("unit", "service", "e2e")] == ["unit"]


SKIPS = """
import pytest

def test_runs():
    pass

def test_skipped():
    pytest.skip("not on the list")
"""


def session(pytester: pytest.Pytester, monkeypatch, ci: str | None, source: str = SKIPS) -> pytest.RunResult:
    """A pytester session of ``source`` with the gate loaded, ``CI`` set to ``ci`` (unset: None)."""
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    pytester.makepyfile(test_x=source)
    return pytester.runpytest("-p", "skipgate")


def test_in_ci_an_unexpected_skip_fails_the_session_and_is_listed(pytester, monkeypatch):
    r = session(pytester, monkeypatch, "true")
    r.assert_outcomes(passed=1, skipped=1)
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    r.stdout.fnmatch_lines(["*skips not expected in CI (CI is true): the session fails*",
                            "SKIPPED test_x.py::test_skipped: not on the list"])


@pytest.mark.parametrize("ci", [None, "false", ""])
def test_outside_ci_a_skip_is_reported_as_usual(pytester, monkeypatch, ci):
    r = session(pytester, monkeypatch, ci)
    r.assert_outcomes(passed=1, skipped=1)
    assert r.ret == pytest.ExitCode.OK
    assert "skips not expected" not in r.stdout.str()


def test_in_ci_a_module_skipped_at_collection_fails_the_session(pytester, monkeypatch):
    r = session(pytester, monkeypatch, "true", 'import pytest\npytest.importorskip("no_such_module_here")\n')
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    r.stdout.fnmatch_lines(["SKIPPED test_x.py: could not import 'no_such_module_here'*"])


def test_in_ci_an_xfail_is_not_a_skip(pytester, monkeypatch):
    r = session(pytester, monkeypatch, "true", 'import pytest\n\n@pytest.mark.xfail\ndef test_x():\n    assert 0\n')
    r.assert_outcomes(xfailed=1)
    assert r.ret == pytest.ExitCode.OK


MOONCAKE = """
import pytest
from indexer.producer.sim import TRACE

def test_on_the_trace():
    pytest.skip(f"no Mooncake trace at {TRACE} (the team's shared data beside the repository)")
"""


@pytest.mark.parametrize("present, ret", [(False, pytest.ExitCode.OK), (True, pytest.ExitCode.TESTS_FAILED)],
                         ids=["absent-expected", "present-unexpected"])
def test_in_ci_the_trace_skip_is_expected_only_where_the_trace_is_absent(pytester, monkeypatch, tmp_path,
                                                                         present, ret):
    from indexer.producer import sim

    trace = tmp_path / "conversation_trace.jsonl"
    if present:
        trace.write_text("{}\n")
    monkeypatch.setattr(sim, "TRACE", trace)
    r = session(pytester, monkeypatch, "true", MOONCAKE)
    r.assert_outcomes(skipped=1)
    assert r.ret == ret


@pytest.mark.parametrize("pure, ret", [("1", pytest.ExitCode.OK), ("0", pytest.ExitCode.TESTS_FAILED)])
def test_in_ci_a_core_skip_is_expected_only_in_the_pure_python_build(pytester, monkeypatch, pure, ret):
    monkeypatch.setenv("KVI_PURE_PYTHON", pure)
    r = session(pytester, monkeypatch, "true",
                'import pytest\n\n@pytest.mark.skipif(True, reason="needs the compiled core")\ndef test_x():\n    pass\n')
    r.assert_outcomes(skipped=1)
    assert r.ret == ret


def test_the_expected_list_is_short_and_says_why():
    assert len(skipgate.EXPECTED) <= 6
    assert all(e.reason and e.why for e in skipgate.EXPECTED)
    assert not skipgate.expected("not on the list")
