"""Deploy artefacts, tested with what runs here (no Docker engine, no helm): the chart's YAML
parses and lints, every ``.Values`` path a template uses exists, the hand-rendered example in
docs/deploy.md has the templates' shape, and the Dockerfile's install step works in a fresh
virtual environment and its entry point starts."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from svc import ROOT, free_port

CHART = ROOT / "helm" / "kv-prefix-indexer"
TEMPLATES = sorted(p for p in (CHART / "templates").glob("*.yaml"))
ACTION = re.compile(r"{{.*?}}")


def values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def rendered_example() -> str:
    text = (ROOT / "docs" / "deploy.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    return next(b for b in blocks if "kind: Deployment" in b)


def key_paths(text: str) -> set[str]:
    """Key paths of a YAML-ish text by indentation (template action lines skipped), so a
    template and a rendered manifest can be compared shape for shape. Keys inside a
    ``with``/``if`` block are optional and left out, unless the block wraps the whole
    template (an ``enabled`` switch)."""
    out: set[str] = set()
    stack: list[tuple[int, str]] = []
    depth = 0
    for n, raw in enumerate(text.splitlines()):
        opens = re.match(r"\s*{{-?\s*(with|if|range)\b", raw)
        if opens:
            depth += n > 0
            continue
        if re.match(r"\s*{{-?\s*end\b", raw):
            depth = max(0, depth - 1)
            continue
        if depth:
            continue
        line = ACTION.sub("X", raw.rstrip())
        s = line.strip()
        if not s or s.startswith("#") or s == "X" or s == "---":
            continue
        indent = len(line) - len(line.lstrip(" "))
        item = s.startswith("- ")
        if item:
            s = s[2:]
            indent += 2
        m = re.match(r"([A-Za-z0-9_./-]+):(\s|$)", s)
        if not m:
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if item:
            # A list item's first key: a sibling of the item's other keys, one level down.
            while stack and stack[-1][0] >= indent - 2 and stack[-1][1] == "[]":
                stack.pop()
            stack.append((indent - 1, "[]"))
        key = m.group(1)
        path = "/".join(k for _, k in stack) + "/" + key if stack else key
        out.add(path)
        stack.append((indent, key))
    return out


def test_chart_and_values_parse_with_what_helm_needs():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "kv-prefix-indexer"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"]) and chart["appVersion"]
    v = values()
    assert v["service"]["port"] == 8080 and v["replicaCount"] >= 1
    # The settings block is valid service configuration as it stands.
    from api.settings import load_settings

    s = load_settings(None, v["config"], env={})
    assert s.ready_fraction == v["config"]["ready_fraction"]
    assert {p.name for p in TEMPLATES} == {"configmap.yaml", "deployment.yaml", "service.yaml",
                                          "servicemonitor.yaml", "pdb.yaml"}
    assert (CHART / "templates" / "NOTES.txt").exists() and (CHART / "templates" / "_helpers.tpl").exists()


def test_every_values_path_a_template_uses_exists():
    v = values()
    used = set()
    for p in list(TEMPLATES) + [CHART / "templates" / "NOTES.txt", CHART / "templates" / "_helpers.tpl"]:
        used |= set(re.findall(r"\.Values\.([A-Za-z0-9_.]+)", p.read_text()))
    assert used, "no .Values paths found"
    for path in sorted(used):
        node = v
        for part in path.split("."):
            assert isinstance(node, dict) and part in node, f".Values.{path} is not in values.yaml"
            node = node[part]


def test_the_hand_rendered_example_has_the_templates_shape():
    docs = [d for d in yaml.safe_load_all(rendered_example()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"ConfigMap", "Deployment", "Service", "ServiceMonitor", "PodDisruptionBudget"}
    example_paths = {}
    for d in docs:
        example_paths[d["kind"]] = key_paths(yaml.safe_dump(d, sort_keys=False, default_flow_style=False))
    for t in TEMPLATES:
        text = t.read_text()
        kind = re.search(r"^kind: (\w+)", text, re.M).group(1)
        missing = key_paths(text) - example_paths[kind]
        assert not missing, f"{t.name}: keys not in the example: {sorted(missing)}"
    # The example's settings are valid service settings, and the probes hit the real routes.
    from api.settings import load_settings

    load_settings(None, yaml.safe_load(kinds["ConfigMap"]["data"]["config.yaml"]), env={})
    c = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert kinds["ServiceMonitor"]["spec"]["endpoints"][0]["path"] == "/metrics"


def test_key_paths_sees_a_difference():
    a = key_paths("spec:\n  ports:\n    - name: http\n      port: 1\n")
    assert a == {"spec", "spec/ports", "spec/ports/[]/name", "spec/ports/[]/port"}
    assert key_paths("spec:\n  ports:\n    - name: http\n") != a


def test_yamllint_is_clean(tmp_path):
    example = tmp_path / "rendered.yaml"
    example.write_text(rendered_example())
    r = subprocess.run([sys.executable, "-m", "yamllint", "-c", str(ROOT / ".yamllint"), str(CHART / "Chart.yaml"),
                        str(CHART / "values.yaml"), str(example)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_dockerfile_is_conventional():
    d = dockerfile()
    froms = re.findall(r"^FROM (\S+)", d, re.M)
    assert len(froms) == 2 and all(f.startswith("python:") and f.split()[0].endswith("-slim") for f in froms)
    assert re.search(r"^USER 10001$", d, re.M)
    assert "HEALTHCHECK" in d and "/healthz" in d
    assert json.loads(re.search(r"^ENTRYPOINT (.+)$", d, re.M).group(1)) == ["kv-indexer", "serve"]
    ignore = [x for x in (ROOT / ".dockerignore").read_text().splitlines() if x and not x.startswith("#")]
    assert ignore[0] == "*" and {"!pyproject.toml", "!indexer/", "!api/"} <= set(ignore)


def test_the_image_install_step_works_in_a_fresh_venv_and_the_entry_point_starts(tmp_path):
    """The Dockerfile's two pip commands, run as written on a copy of the build context
    (.dockerignore applied), into fresh virtual environments; then its entry point."""
    d = dockerfile()
    runs = [shlex.split(r) for r in re.findall(r"^RUN (pip .+?)(?: && .*)?$", d, re.M)]
    wheel_cmd = next(r for r in runs if r[1] == "wheel")
    install_cmd = next(r for r in runs if r[1] == "install")
    ctx = tmp_path / "src"
    ctx.mkdir()
    for name in ("pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy(ROOT / name, ctx / name)
    for pkg in ("indexer", "api"):  # as .dockerignore leaves them: no bytecode, no built core
        shutil.copytree(ROOT / pkg, ctx / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    wheels = tmp_path / "wheels"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")

    def run(cmd: list[str]) -> None:
        cmd = [py, "-m"] + [c.replace("/wheels", str(wheels)) for c in cmd]
        r = subprocess.run(cmd, cwd=ctx, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{cmd}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"

    run(wheel_cmd)
    assert any(p.name.startswith("kv_prefix_indexer-") for p in wheels.iterdir())
    run(install_cmd)
    exe = venv / "bin" / "kv-indexer"
    assert exe.exists()
    # The wheel carries the compiled core (the image has no compiler to build it later).
    probe = subprocess.run([py, "-c", "import indexer.tree as t; print(t.COMPILED)"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "True", probe.stderr[-2000:]
    port = free_port()
    env = {**os.environ, "KVI_HOST": "127.0.0.1", "KVI_PORT": str(port), "KVI_LOG_JSON": "true"}
    proc = subprocess.Popen([str(exe), "serve"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                    assert r.status == 200 and json.load(r) == {"status": "ok"}
                    break
            except OSError:
                assert time.monotonic() < deadline, "the entry point did not answer /healthz"
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("doc", ["deploy.md"])
def test_deploy_doc_names_the_vllm_flags_and_alerts(doc):
    text = (ROOT / "docs" / doc).read_text()
    for needle in ("--kv-events-config", "enable_kv_cache_events", '"publisher"', '"endpoint"', "replay_endpoint",
                   "self_describing_kv_events", "kvi_stale_workers", "kvi_replays_total", "kvi_payloads_dropped_total",
                   "bytes per resident", "helm install"):
        assert needle in text, needle
    rules = next(b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "groups:" in b)
    assert yaml.safe_load(rules)["groups"][0]["rules"]
