"""The API token: which requests need it, and the check (constant time).

With ``api_token`` set, every mutating route needs ``Authorization: Bearer <token>``:
engine register, unregister and clear (ours and Dynamo's) and the state snapshot. With
``auth_reads`` every other route needs it too, but the probes (a kubelet sends no
token) and the live page's static files (``PAGE``: no data in them). A missing token
is 401 (with ``WWW-Authenticate``), a wrong one 403.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import MutableMapping
from contextvars import ContextVar
from typing import Any

log = logging.getLogger("kv_indexer.audit")

# Routes that change what the index subscribes to or hand out its whole state, by
# (method, path); and DELETE /v1/engines/{id} and POST /v1/engines/{id}/clear (is_mutating).
MUTATING = frozenset({("POST", "/v1/engines"), ("POST", "/register"), ("POST", "/unregister"),
                      ("GET", "/v1/snapshot")})
# Liveness and readiness probes: never behind the token.
PROBES = frozenset({"/healthz", "/readyz", "/health"})
# The live page's static files (api/ui.py): they hold no data, and a browser cannot send
# a bearer header on a navigation; the page then sends the token on its own requests
# (/ui/state, /v1/explain), which need it like every other read.
PAGE = frozenset({"/ui", "/ui/app.js", "/ui/app.css"})

# Who made the request being handled: "HOST:PORT (token|no token configured)", for the
# audit log of the handlers (set per request on the non-hot path only).
CLIENT: ContextVar[str] = ContextVar("kvi_client", default="in-process")


def is_mutating(method: str, path: str) -> bool:
    if (method, path) in MUTATING:
        return True
    if not path.startswith("/v1/engines/"):
        return False
    return method == "DELETE" or (method == "POST" and path.endswith("/clear"))


def client_of(scope: MutableMapping[str, Any]) -> str:
    c = scope.get("client")
    return f"{c[0]}:{c[1]}" if c else "unknown"


class Auth:
    """The check for one configured token; counts refusals in ``failures`` by reason."""

    # A token is configured: refusals are counted and exported (kvi_auth_failures), the
    # OpenAPI document declares the bearer scheme.
    enforced = True

    def __init__(self, token: str, auth_reads: bool = False) -> None:
        self._expected = f"Bearer {token}".encode()
        self.auth_reads = auth_reads
        self.failures: dict[str, int] = {"missing": 0, "wrong": 0}

    def needs_token(self, method: str, path: str) -> bool:
        if is_mutating(method, path):
            return True
        return self.auth_reads and path not in PROBES and not (method == "GET" and path in PAGE)

    def refuse(self, scope: MutableMapping[str, Any]) -> tuple[int, str, list[tuple[bytes, bytes]]] | None:
        """None when the request may go on; else ``(status, message, extra headers)``."""
        method, path = scope["method"], scope["path"]
        if not self.needs_token(method, path):
            return None
        got = None
        for k, v in scope["headers"]:
            if k == b"authorization":
                got = v
                break
        if got is None or not got.strip():
            self.failures["missing"] += 1
            log.warning("refused %s %s from %s: no bearer token", method, path, client_of(scope))
            return 401, "authentication required: send Authorization: Bearer <token>", [
                (b"www-authenticate", b'Bearer realm="kv-indexer"')]
        if not hmac.compare_digest(got, self._expected):
            self.failures["wrong"] += 1
            log.warning("refused %s %s from %s: wrong bearer token", method, path, client_of(scope))
            return 403, "the bearer token is not valid", [
                (b"www-authenticate", b'Bearer realm="kv-indexer", error="invalid_token"')]
        return None


class OpenAuth(Auth):
    """No token configured: every request may go on (the service calls it all the same)."""

    enforced = False

    def __init__(self) -> None:
        self.auth_reads = False
        self.failures = {"missing": 0, "wrong": 0}

    def needs_token(self, method: str, path: str) -> bool:
        return False

    def refuse(self, scope: MutableMapping[str, Any]) -> tuple[int, str, list[tuple[bytes, bytes]]] | None:
        return None
