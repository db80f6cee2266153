"""Deploy artefacts, tested with what runs here (no Docker engine, no cluster): the chart's
YAML parses and lints, every ``.Values`` path a template uses exists, the templates render
(by Helm's own engine, see ``render_files``) to the hand-rendered examples in
docs/deploy.md, the token, NetworkPolicy and durable-state switches (persistence, peer
bootstrap, relay and NATS) render what they promise or are refused by name, and the
Dockerfile's install step works in a fresh virtual environment and its entry point starts."""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

import helm_python as helm
import pytest
import yaml

from svc import ROOT, bound_port, wait_until

CHART = ROOT / "helm" / "kv-prefix-indexer"
TEMPLATES = sorted(p for p in (CHART / "templates").glob("*.yaml"))
ACTION = re.compile(r"{{.*?}}")


def values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def yaml_blocks() -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / "deploy.md").read_text(), re.S)


def rendered_example() -> str:
    """docs/deploy.md's hand render of the default values (+ serviceMonitor)."""
    return next(b for b in yaml_blocks() if "kind: Deployment" in b and "kind: ConfigMap" in b)


def secure_values() -> dict:
    """The values of docs/deploy.md's security example (token, authReads, NetworkPolicy)."""
    return yaml.safe_load(next(b for b in yaml_blocks() if b.startswith("auth:")))


def secure_example() -> str:
    """What the docs say those values render (the manifests that change or appear)."""
    return next(b for b in yaml_blocks() if "kind: NetworkPolicy" in b and "kind: Secret" in b)


def state_block(shape: int, what: str) -> str:
    """docs/deploy.md's durable-state examples, each block opened by a comment line:
    ``# Shape N values``, ``# Shape N renders`` (manifests that appear or change) and
    ``# Shape N: the Deployment's spec`` (what the replicas' Deployment spec gains)."""
    head = {"values": f"# Shape {shape} values\n", "renders": f"# Shape {shape} renders\n",
            "spec": f"# Shape {shape}: the Deployment's spec\n"}[what]
    (block,) = [b for b in yaml_blocks() if b.startswith(head)]
    return block


def state_examples() -> list[dict]:
    return [d for n in (1, 2, 3) for d in yaml.safe_load_all(state_block(n, "renders")) if d]


def monitoring_examples() -> list[dict]:
    """docs/deploy.md's monitoring example (section 6): what the dashboard and alert switches
    render (the dashboard's JSON abbreviated there)."""
    (block,) = [b for b in yaml_blocks() if b.startswith("# Monitoring renders\n")]
    return [d for d in yaml.safe_load_all(block) if d]


def secure_pod_fragment() -> str:
    """What the docs say the Deployment's pod template gains with a token."""
    return next(b for b in yaml_blocks() if "KVI_API_TOKEN_FILE" in b and "kind:" not in b)


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
        if "X" not in path.split("/"):  # a key named by the values (a template action) is not shape
            out.add(path)
        stack.append((indent, key))
    return out


# The chart is rendered by Helm itself: Helm v4's Go SDK (its template engine, Sprig
# functions, values coalescing, .Files), built into helm-python-sdk's libhelm_c and called
# through ctypes; no helm binary and no cluster. It renders what ``helm template`` renders,
# file by file (NOTES.txt included), before the CLI joins them into one stream.

class ChartFail(Exception):
    """The chart's own ``fail`` or ``required``: the values are refused, with this message."""


def render_files(overrides: dict | None = None, release: str = "kvi", namespace: str = "default",
                 chart=CHART) -> dict[str, str]:
    """Every template file's output for these values (over the chart's values.yaml, merged
    as Helm merges them: maps key by key, null removes a key), by file name."""
    with helm.Chart.load(str(chart)) as c:
        try:
            # As helm template: an install, revision 1.
            files = c.render(overrides or {}, name=release, namespace=namespace, revision=1, is_install=True)
        except helm.HelmRenderError as e:
            # Helm reports a template's fail/required as an execution error at its position;
            # any other error (a bad template, a nil pointer) stays a HelmRenderError.
            m = re.fullmatch(r"execution error at \(([^)]*)\): (.*)", str(e), re.S)
            if m:
                raise ChartFail(m.group(2)) from e
            raise
    return {name.rsplit("/", 1)[1]: text for name, text in files.items()}


def render(overrides: dict | None = None) -> tuple[dict[str, list[dict]], str]:
    """The manifests for these values (over values.yaml), by kind, and NOTES.txt."""
    files = render_files(overrides)
    notes = files.pop("NOTES.txt")
    kinds: dict[str, list[dict]] = {}
    for text in files.values():
        for d in yaml.safe_load_all(text):
            if d:
                kinds.setdefault(d["kind"], []).append(d)
    return kinds, notes


def one(kinds: dict[str, list[dict]], kind: str) -> dict:
    assert len(kinds.get(kind, [])) == 1, f"{kind}: {len(kinds.get(kind, []))} rendered"
    return kinds[kind][0]


def test_chart_and_values_parse_with_what_helm_needs():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "kv-prefix-indexer"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"]) and chart["appVersion"]
    v = values()
    assert v["service"]["port"] == 8080 and v["replicaCount"] >= 1
    # The settings block is valid service configuration as it stands.
    from api.settings import load_settings

    s = load_settings(None, v["config"], env={})
    assert s.ready_fraction == v["config"]["ready_fraction"] == 0  # ready once ingest runs (docs: Readiness)
    assert s.allowed_endpoints == () and v["config"]["allowed_endpoints"] == []
    # Security is opt-in: no token, no NetworkPolicy, unless the values say so.
    assert v["auth"] == {"token": "", "existingSecret": "", "secretKey": "token", "authReads": False}
    assert v["networkPolicy"] == {"enabled": False, "ingressFrom": [], "dnsTo": [], "engineEgress": [],
                                  "natsTo": [], "natsPort": 4222}
    # So is durable state: no volume, no bootstrap, no relay, no NATS (docs/state.md).
    assert not any(v[k]["enabled"] for k in ("persistence", "bootstrap", "relay", "nats"))
    assert v["nats"]["url"] == "" and v["relay"]["replicaCount"] == 2
    # The names the chart gives the relay and the replicas are the service's own defaults.
    d = load_settings(None, {}, env={})
    assert (v["nats"]["stream"], v["nats"]["subject"], v["nats"]["bucket"]) == (
        d.nats_stream, d.nats_subject, d.nats_bucket)
    assert v["persistence"]["snapshotIntervalS"] == v["nats"]["snapshotIntervalS"] == d.snapshot_interval_s
    assert {p.name for p in TEMPLATES} == {"configmap.yaml", "deployment.yaml", "service.yaml",
                                          "servicemonitor.yaml", "pdb.yaml", "secret.yaml", "networkpolicy.yaml",
                                          "pvc.yaml", "service-peers.yaml", "relay.yaml", "pdb-relay.yaml",
                                          "networkpolicy-relay.yaml", "grafana-dashboard.yaml",
                                          "prometheusrule.yaml"}
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
    secure = [d for d in yaml.safe_load_all(secure_example()) if d]
    assert {d["kind"] for d in secure} == {"Secret", "ConfigMap", "ServiceMonitor", "NetworkPolicy"}
    example_paths: dict[str, set[str]] = {}
    for d in docs + secure + state_examples() + monitoring_examples():
        example_paths.setdefault(d["kind"], set()).update(
            key_paths(yaml.safe_dump(d, sort_keys=False, default_flow_style=False)))
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
    examples = []
    for n, block in enumerate(yaml_blocks()):  # every YAML example of docs/deploy.md
        examples.append(tmp_path / f"example-{n}.yaml")
        examples[-1].write_text(block)
    assert len(examples) >= 7
    r = subprocess.run([sys.executable, "-m", "yamllint", "-c", str(ROOT / ".yamllint"), str(CHART / "Chart.yaml"),
                        str(CHART / "values.yaml"), *map(str, examples)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_renderer_is_helm_and_tells_a_refusal_from_a_broken_template(tmp_path):
    """The renderer is Helm v4's engine; the chart's fail/required is a ChartFail (the tests
    match its message), anything else Helm refuses is not."""
    assert helm.helm_sdk_version().startswith("v4.")
    (tmp_path / "templates").mkdir()
    (tmp_path / "Chart.yaml").write_text("apiVersion: v2\nname: t\nversion: 0.0.1\nappVersion: '1'\n")
    (tmp_path / "values.yaml").write_text("m:\n  k: 1\n")

    def out(src: str, v: dict | None = None) -> str:
        (tmp_path / "templates" / "t.yaml").write_text(src)
        return render_files(v, chart=tmp_path)["t.yaml"]

    # Sprig and Helm's own functions, and the values merged over values.yaml.
    assert out('{{ .Values.m.k }} {{ .Values.s | default "d" | quote }} {{ toYaml .Values.m | trim }}') == '1 "d" k: 1'
    assert out("{{ .Values.m | toYaml }}", {"m": {"k": None, "j": 2}}) == "j: 2"
    for src, message in (('{{ fail "refused" }}', "refused"), ('{{ required "needed" .Values.a }}', "needed")):
        with pytest.raises(ChartFail, match=f"^{message}$"):
            out(src)
    for src in ("{{ nosuch 1 }}", "{{ .Values.a.b }}", "{{ if 1 }}open"):
        with pytest.raises(helm.HelmRenderError) as e:
            out(src)
        assert not isinstance(e.value, ChartFail)


def comparable(doc: dict) -> dict:
    """A manifest as the docs can state it: the config parsed, the checksum left out."""
    d = copy.deepcopy(doc)
    if d["kind"] == "ConfigMap":
        d["data"]["config.yaml"] = yaml.safe_load(d["data"]["config.yaml"])
    if d["kind"] == "Deployment":
        checksum = d["spec"]["template"]["metadata"]["annotations"].pop("checksum/config")
        assert re.fullmatch(r"[0-9a-f]{64}", checksum)
    return d


def contains(big, small) -> bool:
    """``small`` is part of ``big``: mappings key by key, list items each in some item."""
    if isinstance(small, dict):
        return isinstance(big, dict) and all(k in big and contains(big[k], v) for k, v in small.items())
    if isinstance(small, list):
        return isinstance(big, list) and all(any(contains(b, s) for b in big) for s in small)
    return big == small


def pod_spec(kinds: dict[str, list[dict]]) -> dict:
    return one(kinds, "Deployment")["spec"]["template"]["spec"]


def config_of(kinds: dict[str, list[dict]]) -> dict:
    return yaml.safe_load(one(kinds, "ConfigMap")["data"]["config.yaml"])


def test_the_templates_render_the_documented_example():
    kinds, notes = render({"serviceMonitor": {"enabled": True}})
    example = [d for d in yaml.safe_load_all(rendered_example()) if d]
    assert sorted(kinds) == sorted(d["kind"] for d in example)
    for d in example:
        assert comparable(one(kinds, d["kind"])) == comparable(d), d["kind"]
    assert pod_spec(kinds)["automountServiceAccountToken"] is False
    assert "(scraped by the ServiceMonitor)" in notes


def test_the_templates_render_the_documented_security_example(tmp_path):
    v = secure_values()
    kinds, notes = render(v)
    for d in yaml.safe_load_all(secure_example()):
        assert comparable(one(kinds, d["kind"])) == comparable(d), d["kind"]
    assert contains(pod_spec(kinds), yaml.safe_load(secure_pod_fragment()))
    assert "WARNING" not in notes and "Authorization: Bearer $TOKEN" in notes
    # What the pods get is what the service accepts: the config, and the token from the
    # mounted file (the Secret's key, written where KVI_API_TOKEN_FILE points).
    from api.settings import load_settings

    env = {e["name"]: e["value"] for e in pod_spec(kinds)["containers"][0]["env"]}
    token_file = tmp_path / "token"
    token_file.write_text(base64.b64decode(one(kinds, "Secret")["data"]["token"]).decode() + "\n")
    assert env["KVI_API_TOKEN_FILE"] == "/var/run/secrets/kv-indexer/token"
    s = load_settings(None, config_of(kinds), env={"KVI_API_TOKEN_FILE": str(token_file)})
    assert s.api_token == v["auth"]["token"] and s.auth_reads is True
    assert s.allowed_endpoints == ("*.vllm.svc.cluster.local",)


TOKEN = "t0ken-for-the-chart-tests-0123456789"


@pytest.mark.parametrize("auth, created, mounted, key", [
    ({}, None, None, None),
    ({"token": TOKEN}, "kvi-kv-prefix-indexer-auth", "kvi-kv-prefix-indexer-auth", "token"),
    ({"existingSecret": "mine"}, None, "mine", "token"),
    ({"token": TOKEN, "existingSecret": "mine"}, None, "mine", "token"),  # the user's Secret wins
    ({"existingSecret": "mine", "secretKey": "api-token"}, None, "mine", "api-token"),
    ({"token": TOKEN, "secretKey": "k"}, "kvi-kv-prefix-indexer-auth", "kvi-kv-prefix-indexer-auth", "k"),
], ids=["none", "token", "existing", "both", "existing-key", "token-key"])
def test_the_token_secret_and_its_mount(auth, created, mounted, key):
    kinds, notes = render({"auth": auth})
    secrets = kinds.get("Secret", [])
    if created:
        (s,) = secrets
        assert s["metadata"]["name"] == created and s["type"] == "Opaque"
        assert {k: base64.b64decode(x).decode() for k, x in s["data"].items()} == {key: TOKEN}
    else:
        assert secrets == []
    pod = pod_spec(kinds)
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert not {"KVI_API_TOKEN", "KVI_AUTH_READS"} & set(env)
    if mounted:
        assert env["KVI_API_TOKEN_FILE"] == "/var/run/secrets/kv-indexer/token"
        assert mounts["api-token"] == {"name": "api-token", "mountPath": "/var/run/secrets/kv-indexer", "readOnly": True}
        assert volumes["api-token"]["secret"] == {"secretName": mounted, "defaultMode": 0o440,
                                                  "items": [{"key": key, "path": "token"}]}
        assert "WARNING: no API token" not in notes and f"Secret {mounted} (key {key})" in notes
    else:
        assert "KVI_API_TOKEN_FILE" not in env and "api-token" not in mounts and "api-token" not in volumes
        assert "WARNING: no API token" in notes and "can register and remove engines" in notes
    assert set(mounts) == set(volumes)


def test_the_token_never_reaches_the_configmap():
    v = {"auth": {"token": TOKEN, "authReads": True}, "serviceMonitor": {"enabled": True},
         "networkPolicy": {"enabled": True}}
    files = render_files(v)
    encoded = base64.b64encode(TOKEN.encode()).decode()
    assert encoded in files["secret.yaml"]
    for name, text in files.items():
        if name != "secret.yaml":
            assert TOKEN not in text and encoded not in text, name
    cm = one(render({"auth": v["auth"]})[0], "ConfigMap")
    assert not {"api_token", "api_token_file"} & set(yaml.safe_load(cm["data"]["config.yaml"]))
    # Values that would write it there are refused, not rendered.
    for bad in ({"api_token": TOKEN}, {"api_token_file": "/etc/token"}):
        with pytest.raises(ChartFail, match="not under config"):
            render({"config": bad})


def test_auth_reads_puts_metrics_behind_the_same_secret():
    off, notes = render({"serviceMonitor": {"enabled": True}, "auth": {"existingSecret": "mine"}})
    assert "authorization" not in one(off, "ServiceMonitor")["spec"]["endpoints"][0]
    assert config_of(off)["auth_reads"] is False and "Reads (/v1/match" in notes
    on, notes = render({"serviceMonitor": {"enabled": True},
                        "auth": {"existingSecret": "mine", "secretKey": "api", "authReads": True}})
    assert one(on, "ServiceMonitor")["spec"]["endpoints"][0]["authorization"] == {
        "type": "Bearer", "credentials": {"name": "mine", "key": "api"}}
    assert config_of(on)["auth_reads"] is True and "Reads (/v1/match" not in notes
    assert "-H \"Authorization: Bearer $TOKEN\"" in notes and "jsonpath='{.data.api}'" in notes
    # Refused: reads behind a token nobody has, auth_reads the ServiceMonitor would not see, a
    # token the service would refuse at start.
    with pytest.raises(ChartFail, match="needs a token"):
        render({"auth": {"authReads": True}})
    with pytest.raises(ChartFail, match="auth.authReads"):
        render({"config": {"auth_reads": True}, "auth": {"existingSecret": "mine"}})
    with pytest.raises(ChartFail, match="16"):
        render({"auth": {"token": "too-short"}})


def commented_example(key: str) -> list:
    """The commented-out example under ``key: []`` in values.yaml, uncommented and parsed."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    start = next(n for n, s in enumerate(lines) if s.strip() == f"{key}: []")
    indent = len(lines[start]) - len(lines[start].lstrip())
    body = []
    for s in lines[start + 1:]:
        if not s.startswith(" " * indent + "#  "):
            break
        body.append(s[indent + 3:])
    return yaml.safe_load("\n".join(body))


def test_the_network_policy_is_off_by_default_and_tight_when_on():
    kinds, notes = render()
    assert "NetworkPolicy" not in kinds and "networkPolicy.engineEgress" not in notes
    kinds, notes = render({"networkPolicy": {"enabled": True}})
    np = one(kinds, "NetworkPolicy")["spec"]
    assert np["podSelector"] == one(kinds, "Deployment")["spec"]["selector"]
    assert np["policyTypes"] == ["Ingress", "Egress"]
    # The HTTP port, from the release's namespace only; out, DNS only (no engine yet: NOTES says so).
    assert np["ingress"] == [{"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": 8080}]}]
    assert np["egress"] == [{"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}]
    assert "networkPolicy.engineEgress" in notes


def test_the_network_policy_renders_the_given_peers_and_ports():
    peers = commented_example("ingressFrom")
    dns = commented_example("dnsTo")
    engines = commented_example("engineEgress")
    assert peers and dns and {p["port"] for r in engines for p in r["ports"]} == {5557, 5600}
    kinds, notes = render({"service": {"port": 9000},
                           "networkPolicy": {"enabled": True, "ingressFrom": peers, "dnsTo": dns,
                                             "engineEgress": engines}})
    np = one(kinds, "NetworkPolicy")["spec"]
    assert np["ingress"] == [{"from": peers, "ports": [{"protocol": "TCP", "port": 9000}]}]
    assert np["egress"] == [{"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
                             "to": dns}] + engines
    assert "networkPolicy.engineEgress" not in notes


NATS = "nats://nats.nats.svc:4222"
FULL = "kvi-kv-prefix-indexer"


def named(kinds: dict[str, list[dict]], kind: str, name: str) -> dict:
    (d,) = [d for d in kinds.get(kind, []) if d["metadata"]["name"] == name]
    return d


def env_of(deployment: dict) -> dict[str, str]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels, matchExpressions In/NotIn) matches these labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        inside = labels.get(e["key"]) in e["values"]
        if (e["operator"] == "In") != inside:
            return False
    return True


@pytest.mark.parametrize("shape", [1, 2, 3])
def test_the_templates_render_the_documented_state_examples(shape):
    """docs/deploy.md, "Durable state in the chart": each shape's values render the manifests
    shown, the replicas' Deployment gains the fragment shown, and the settings the pods get
    (ConfigMap + environment) are settings the service accepts."""
    v = yaml.safe_load(state_block(shape, "values"))
    kinds, notes = render(v)
    for d in yaml.safe_load_all(state_block(shape, "renders")):
        got = named(kinds, d["kind"], d["metadata"]["name"])
        assert comparable(got) == comparable(d), (d["kind"], d["metadata"]["name"])
    indexer = named(kinds, "Deployment", FULL)
    assert contains(indexer["spec"], yaml.safe_load(state_block(shape, "spec")))
    from api.settings import load_settings

    s = load_settings(None, config_of(kinds), env=env_of(indexer))
    if shape == 1:
        assert s.state_dir == "/var/lib/kv-indexer" and s.bootstrap_from is None and s.nats_url is None
    elif shape == 2:
        assert s.bootstrap_from == f"http://{FULL}-peers.default.svc:8080" and s.state_dir
    else:
        assert s.nats_url == NATS and s.state_dir is None and s.bootstrap_from is None
        relay = named(kinds, "Deployment", f"{FULL}-relay")
        r = load_settings(None, config_of(kinds), env=env_of(relay))
        assert (r.nats_stream, r.nats_subject) == (s.nats_stream, s.nats_subject)
        assert "2 relays" in notes and "no engine connections" in notes and "WARNING: networkPolicy" not in notes
    assert s.snapshot_interval_s == 60


def test_persistence_pvc_is_one_replica_one_claim():
    kinds, notes = render({"replicaCount": 1, "persistence": {"enabled": True}})
    pvc = one(kinds, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"] and "storageClassName" not in pvc["spec"]
    dep = one(kinds, "Deployment")
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    # The root filesystem stays read-only: the state dir is the mounted volume.
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "state", "mountPath": "/var/lib/kv-indexer"} in c["volumeMounts"]
    assert env_of(dep)["KVI_STATE_DIR"] == "/var/lib/kv-indexer" and "State dir /var/lib/kv-indexer (pvc)" in notes
    # The user's claim: none created. A storage class, or "-" for none at all.
    kinds, _ = render({"replicaCount": 1, "persistence": {"enabled": True, "existingClaim": "mine"}})
    assert "PersistentVolumeClaim" not in kinds
    assert {"name": "state", "persistentVolumeClaim": {"claimName": "mine"}} in pod_spec(kinds)["volumes"]
    for cls, want in (("fast-ssd", "fast-ssd"), ("-", "")):
        kinds, _ = render({"replicaCount": 1, "persistence": {"enabled": True, "storageClass": cls,
                                                              "mountPath": "/state", "snapshotIntervalS": 0}})
        assert one(kinds, "PersistentVolumeClaim")["spec"]["storageClassName"] == want
        assert env_of(one(kinds, "Deployment"))["KVI_SNAPSHOT_INTERVAL_S"] == "0"
    # Off by default: no volume, no strategy change, no claim.
    kinds, _ = render()
    assert "PersistentVolumeClaim" not in kinds and "strategy" not in one(kinds, "Deployment")["spec"]
    assert not {"KVI_STATE_DIR", "KVI_BOOTSTRAP_FROM", "KVI_NATS_URL"} & set(env_of(one(kinds, "Deployment")))


def test_persistence_refuses_what_a_deployment_cannot_do():
    with pytest.raises(ChartFail, match="needs replicaCount 1.*emptyDir.*bootstrap"):
        render({"persistence": {"enabled": True}})  # replicaCount 2, kind pvc
    with pytest.raises(ChartFail, match="pvc or emptyDir"):
        render({"replicaCount": 1, "persistence": {"enabled": True, "kind": "hostPath"}})
    with pytest.raises(ChartFail, match="object store"):
        render({"persistence": {"enabled": True, "kind": "emptyDir"}, "nats": {"enabled": True, "url": NATS}})
    # emptyDir: any number of replicas, one dir per pod; the claim-only Recreate strategy is not used.
    kinds, _ = render({"replicaCount": 5, "persistence": {"enabled": True, "kind": "emptyDir", "sizeLimit": "2Gi"}})
    assert "PersistentVolumeClaim" not in kinds and "strategy" not in one(kinds, "Deployment")["spec"]
    assert {"name": "state", "emptyDir": {"sizeLimit": "2Gi"}} in pod_spec(kinds)["volumes"]


def test_bootstrap_asks_a_ready_peer_through_a_headless_service():
    kinds, notes = render({"bootstrap": {"enabled": True}, "serviceMonitor": {"enabled": True},
                           "auth": {"existingSecret": "mine"}, "networkPolicy": {"enabled": True}})
    dep = one(kinds, "Deployment")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    peers = named(kinds, "Service", f"{FULL}-peers")
    main = named(kinds, "Service", FULL)
    # Ready pods only: a starting replica (not ready) is never in the answer, so never itself.
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"] is False
    assert peers["spec"]["selector"] == main["spec"]["selector"] and selects({"matchLabels": peers["spec"]["selector"]},
                                                                             pod_labels)
    assert peers["spec"]["ports"] == main["spec"]["ports"]
    assert env_of(dep)["KVI_BOOTSTRAP_FROM"] == f"http://{FULL}-peers.default.svc:8080"
    # GET /v1/snapshot needs the token: the replicas mount it as always.
    assert env_of(dep)["KVI_API_TOKEN_FILE"] == "/var/run/secrets/kv-indexer/token"
    # The ServiceMonitor scrapes the main Service, not the peers' (the same pods twice).
    sel = one(kinds, "ServiceMonitor")["spec"]["selector"]
    assert selects(sel, main["metadata"]["labels"]) and not selects(sel, peers["metadata"]["labels"])
    # The NetworkPolicy lets the replicas reach each other's HTTP port, and nothing else more.
    np = one(kinds, "NetworkPolicy")["spec"]
    me = {"podSelector": {"matchLabels": dep["spec"]["selector"]["matchLabels"]}}
    port = [{"protocol": "TCP", "port": 8080}]
    assert {"from": [me], "ports": port} in np["ingress"] and {"to": [me], "ports": port} in np["egress"]
    assert f"from {FULL}-peers" in notes
    # Another namespace, another port: the URL follows.
    files = render_files({"bootstrap": {"enabled": True}, "service": {"port": 9000}}, release="r", namespace="prod")
    dep = yaml.safe_load(files["deployment.yaml"])
    assert env_of(dep)["KVI_BOOTSTRAP_FROM"] == "http://r-kv-prefix-indexer-peers.prod.svc:9000"
    # Off: no peers' Service, no selector change.
    kinds, _ = render({"serviceMonitor": {"enabled": True}})
    assert [s["metadata"]["name"] for s in kinds["Service"]] == [FULL]
    assert "matchExpressions" not in one(kinds, "ServiceMonitor")["spec"]["selector"]


def test_relay_and_nats_mode():
    engines = commented_example("engineEgress")
    kinds, notes = render({"relay": {"enabled": True, "replicaCount": 3}, "nats": {"enabled": True, "url": NATS},
                           "auth": {"token": TOKEN}, "networkPolicy": {"enabled": True, "engineEgress": engines}})
    indexer = named(kinds, "Deployment", FULL)
    relay = named(kinds, "Deployment", f"{FULL}-relay")
    assert relay["spec"]["replicas"] == 3
    (c,) = relay["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["kv-indexer", "relay"]
    assert c["args"] == ["--nats", NATS, "--config", "/etc/kv-indexer/config.yaml"]
    # The same engines: the relay mounts the replicas' ConfigMap (and rolls when it changes).
    assert {"name": "config", "configMap": {"name": FULL}} in relay["spec"]["template"]["spec"]["volumes"]
    assert "checksum/config" in relay["spec"]["template"]["metadata"]["annotations"]
    assert env_of(relay)["KVI_API_TOKEN_FILE"] == env_of(indexer)["KVI_API_TOKEN_FILE"]
    assert env_of(indexer)["KVI_NATS_URL"] == NATS
    # Relays are not replicas: no selector of the replicas matches them, and the reverse.
    relay_pods = relay["spec"]["template"]["metadata"]["labels"]
    indexer_pods = indexer["spec"]["template"]["metadata"]["labels"]
    for sel in (indexer["spec"]["selector"], {"matchLabels": one(kinds, "Service")["spec"]["selector"]},
                named(kinds, "PodDisruptionBudget", FULL)["spec"]["selector"],
                named(kinds, "NetworkPolicy", FULL)["spec"]["podSelector"]):
        assert selects(sel, indexer_pods) and not selects(sel, relay_pods)
    for sel in (relay["spec"]["selector"], named(kinds, "PodDisruptionBudget", f"{FULL}-relay")["spec"]["selector"],
                named(kinds, "NetworkPolicy", f"{FULL}-relay")["spec"]["podSelector"]):
        assert selects(sel, relay_pods) and not selects(sel, indexer_pods)
    # Egress: the relay to DNS, NATS and the engines, nothing in; the replicas to DNS and NATS.
    dns = {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    nats = {"ports": [{"protocol": "TCP", "port": 4222}]}
    rnp = named(kinds, "NetworkPolicy", f"{FULL}-relay")["spec"]
    assert rnp["ingress"] == [] and rnp["policyTypes"] == ["Ingress", "Egress"]
    assert rnp["egress"] == [dns, nats] + engines
    assert named(kinds, "NetworkPolicy", FULL)["spec"]["egress"] == [dns, nats]
    assert "WARNING: networkPolicy" not in notes and "3 relays" in notes
    # The relay alone (replicas still on ZMQ, e.g. while migrating): the replicas keep the engines.
    kinds, notes = render({"relay": {"enabled": True}, "nats": {"url": NATS},
                           "networkPolicy": {"enabled": True, "engineEgress": engines}})
    indexer = named(kinds, "Deployment", FULL)
    assert "KVI_NATS_URL" not in env_of(indexer)
    assert named(kinds, "NetworkPolicy", FULL)["spec"]["egress"] == [dns] + engines
    assert "Every replica subscribes to every engine" in notes
    # NATS mode with a relay elsewhere: said so; no engine egress needed here, so no warning.
    kinds, notes = render({"nats": {"enabled": True, "url": NATS}, "networkPolicy": {"enabled": True}})
    assert "Deployment" in kinds and len(kinds["Deployment"]) == 1
    assert "nats.enabled without relay.enabled" in notes and "WARNING: networkPolicy" not in notes


@pytest.mark.parametrize("over, message", [
    ({"relay": {"enabled": True}}, "nats.url is required with relay.enabled or nats.enabled"),
    ({"nats": {"enabled": True}}, "nats.url is required with relay.enabled or nats.enabled"),
    ({"nats": {"enabled": True, "url": "nats.nats.svc:4222"}}, "nats://, tls://, ws:// or wss://"),
    ({"config": {"nats_url": NATS}}, "set nats_url with the chart's"),
    ({"config": {"state_dir": "/data"}}, "set state_dir with the chart's"),
    ({"config": {"bootstrap_from": "http://x:8080"}}, "set bootstrap_from with the chart's"),
], ids=["relay-no-url", "nats-no-url", "url-scheme", "config-nats", "config-state", "config-bootstrap"])
def test_state_values_the_chart_refuses(over, message):
    with pytest.raises(ChartFail, match=re.escape(message)):
        render(over)


def test_state_doc_has_the_shapes_costs_and_the_measured_figures():
    text = (ROOT / "docs" / "state.md").read_text()
    for needle in ("state_dir", "bootstrap_from", "kv-indexer relay", "Nats-Msg-Id", "JetStream", "stale",
                   "replay", "snapshot.md", "nats/nats", "config.jetstream.enabled=true", "## Figures",
                   "persistence.kind", "bootstrap.enabled", "relay.enabled", "nats.url"):
        assert needle in text, needle
    # The measured figures, with the command that measures them; no placeholder left.
    assert "<!-- FIGURES -->" not in text
    figures = text.split("## Figures", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"\d+(\.\d+)?\s*(ms|s|MiB|GiB|MB|GB)\b", figures), figures
    assert "benchmarks/bench_snapshot.py" in figures and "bench_jetstream.py" in figures
    assert "state.md" in (ROOT / "docs" / "deploy.md").read_text()
    assert "docs/state.md" in (ROOT / "README.md").read_text()


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
    # The wheel carries the compiled core and the service's compiled formats (the image has
    # no compiler to build them later).
    probe = subprocess.run([py, "-c", "import indexer.store.tree as t, api.surface as s; print(t.COMPILED, s.COMPILED)"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "True True", probe.stderr[-2000:]
    # Port 0: the server binds a free port itself and logs it (uvicorn's start-up line).
    env = {**os.environ, "KVI_HOST": "127.0.0.1", "KVI_PORT": "0", "KVI_LOG_JSON": "true"}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(exe), "serve"], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        port = bound_port(log.read_text, proc, "the installed kv-indexer serve")

        def healthz():
            assert proc.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                    return (r.status, json.load(r))
            except urllib.error.HTTPError:
                raise  # it answered, and not 200
            except OSError:
                return None  # not listening yet

        assert wait_until(healthz, 30, 0.1, msg="the entry point to answer /healthz") == (200, {"status": "ok"})
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("doc", ["deploy.md"])
def test_deploy_doc_names_the_vllm_flags_and_alerts(doc):
    text = (ROOT / "docs" / doc).read_text()
    for needle in ("--kv-events-config", "enable_kv_cache_events", '"publisher"', '"endpoint"', "replay_endpoint",
                   "self_describing_kv_events", "kvi_stale_workers", "kvi_replays_total", "kvi_payloads_dropped_total",
                   "bytes per resident", "helm install",
                   # Security and readiness: what an operator greps for.
                   "## 7. Security", "### Readiness", "KVI_API_TOKEN_FILE", "KVI_API_TOKEN`", "auth.existingSecret",
                   "rollout restart", "WWW-Authenticate: Bearer", "401", "403", "auth_reads", "/metrics",
                   "allowed_endpoints", "*.vllm.svc.cluster.local", "10.0.0.0/8", "before any socket",
                   "networkPolicy.engineEgress", "networkPolicy.ingressFrom", "SECURITY:", "kv_indexer.audit",
                   "kvi_engine_changes_total", "kvi_auth_failures_total", "ready_fraction", "/v1/workers"):
        assert needle in text, needle
    (rule,) = [d for d in monitoring_examples() if d["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"][0]["rules"]
