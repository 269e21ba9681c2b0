"""API keys: with ``SAKER_API_KEYS`` and/or ``SAKER_API_KEY_FILE`` set, ``Authorization: Bearer <key>`` is
required on ``/v1/*`` and the tokenizer routes (and on ``/metrics`` with ``SAKER_METRICS_REQUIRE_KEY``).
``/health`` (probes) and ``/openapi.json`` stay open.

Keys are compared in constant time (``hmac.compare_digest`` over SHA-256 digests, so neither the content nor
the length of a key leaks through timing), every key is checked on every request, and neither the keys nor
the presented token is ever logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac

from flask import Flask, request

from app.errors import AuthenticationError
from app.settings import Settings

PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="saker"'}


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class KeyChecker:
    def __init__(self, keys: list[str]):
        self._digests = [_digest(k) for k in keys]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def accepts(self, token: str) -> bool:
        presented = _digest(token)
        ok = False
        for digest in self._digests:  # no early exit: the time does not depend on which key matched
            ok |= hmac.compare_digest(presented, digest)
        return ok


def is_protected(path: str, metrics_too: bool) -> bool:
    return path.startswith("/v1/") or path == "/v1" or path in PROTECTED_PATHS or (metrics_too and path == "/metrics")


def install_auth(app: Flask, settings: Settings) -> None:
    checker = KeyChecker(settings.api_key_list)
    if not checker:
        return
    metrics_too = settings.metrics_require_key

    @app.before_request
    def _require_api_key():
        if not is_protected(request.path, metrics_too):
            return None
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return None  # a browser's CORS preflight never carries credentials (the request after it does)
        scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthenticationError(
                "Missing API key: send it as 'Authorization: Bearer <key>'", headers=dict(_CHALLENGE)
            )
        if not checker.accepts(token):
            raise AuthenticationError("Incorrect API key provided", headers=dict(_CHALLENGE))
        return None
