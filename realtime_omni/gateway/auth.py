"""API keys and client secrets, checked on every route but `/healthz` and the demo page's files.

    auth = Auth(keys={"sk-..."}, ttl_s=600)       # no keys: nothing is checked
    secret = auth.mint({"instructions": "..."})   # {"value": "ek_...", "expires_at", ...}
    grant = auth.check("ek_...")                  # Grant(kind="secret", session={...}), or None
    app = AuthMiddleware(app, auth)               # ASGI: 401 / WebSocket close 1008 without one

A request carries its token as OpenAI's clients send it: `Authorization: Bearer <token>`, or,
on a WebSocket from a browser (which cannot set headers), the subprotocol
`openai-insecure-api-key.<token>` beside `realtime` (the endpoint echoes `realtime` back). The
phone routes also take `?token=`, since a provider's webhook is a URL; a media stream from
Twilio, whose stream URLs carry no query, is let through to show its token in `start`'s
parameters (`media_stream.py` checks it there).

An API key is long-lived and belongs on a server; a client secret (`ek_...`, minted by
`POST /v1/realtime/client_secrets` with a key) expires after `ttl_s` and carries the session
settings it was minted with, so an app's backend can hand a page a secret instead of its key.
Secrets live in memory, at most `MAX_SECRETS` (the oldest go first); a restart voids them.
"""

from __future__ import annotations

import hmac
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

MAX_SECRETS = 10000
OPEN_PATHS = ("/", "/healthz")  # and /static/...: the demo page
SUBPROTOCOL_KEY = "openai-insecure-api-key."


@dataclass(frozen=True)
class Grant:
    kind: str  # "key" | "secret" | "open" (no keys configured)
    session: dict[str, Any] | None = None  # a client secret's session settings


@dataclass
class _Secret:
    expires_at: float  # unix time
    session: dict[str, Any]


class Auth:
    def __init__(self, keys: Iterable[str] = (), ttl_s: int = 600) -> None:
        self.keys = frozenset(keys)
        self.ttl_s = ttl_s
        self._secrets: OrderedDict[str, _Secret] = OrderedDict()

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def mint(self, session: dict[str, Any], ttl_s: int | None = None) -> tuple[str, int]:
        """A new client secret bound to `session` settings, and when it expires (unix s)."""
        now = time.time()
        self._purge(now)
        value = f"ek_{secrets.token_urlsafe(24)}"
        expires_at = int(now + min(ttl_s or self.ttl_s, self.ttl_s))
        self._secrets[value] = _Secret(expires_at, session)
        while len(self._secrets) > MAX_SECRETS:
            self._secrets.popitem(last=False)
        return value, expires_at

    def check(self, token: str | None) -> Grant | None:
        """What `token` allows: None when keys are required and it is none of them."""
        if not self.required:
            return Grant("open")
        if not token:
            return None
        if any(hmac.compare_digest(token, k) for k in self.keys):
            return Grant("key")
        secret = self._secrets.get(token)
        if secret is None:
            return None
        if secret.expires_at <= time.time():
            del self._secrets[token]
            return None
        return Grant("secret", secret.session)

    def _purge(self, now: float) -> None:
        for value in [v for v, s in self._secrets.items() if s.expires_at <= now]:
            del self._secrets[value]


def _header(scope: dict[str, Any], name: bytes) -> str:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return str(v.decode("latin-1"))
    return ""


def offered_subprotocols(scope: dict[str, Any]) -> list[str]:
    return [p.strip() for p in _header(scope, b"sec-websocket-protocol").split(",") if p.strip()]


def token_of(scope: dict[str, Any]) -> str | None:
    """The token a request carries: the bearer, a browser WebSocket's subprotocol, or, on the
    phone routes only, `?token=`."""
    bearer = _header(scope, b"authorization")
    if bearer.lower().startswith("bearer "):
        return bearer[7:].strip()
    for p in offered_subprotocols(scope):
        if p.startswith(SUBPROTOCOL_KEY):
            return p[len(SUBPROTOCOL_KEY) :]
    if str(scope.get("path", "")).startswith("/v1/phone/"):
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if query.get("token"):
            return query["token"][0]
    return None


def _open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith("/static/")


class AuthMiddleware:
    """Refuses what carries no valid token (HTTP 401 with OpenAI's error shape; a WebSocket is
    closed before it is accepted, which a client sees as HTTP 403) and puts the `Grant` in the
    scope (`scope["auth"]`) for the routes that read it."""

    def __init__(self, app: Any, auth: Auth) -> None:
        self.app, self.auth = app, auth

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or _open(scope["path"]):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http" and scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)  # a CORS preflight carries no credentials
            return
        token = token_of(scope)
        grant = self.auth.check(token)
        if grant is None and token is None and _deferred(scope):
            grant = Grant("deferred")  # a Twilio stream: its token comes in `start`
        if grant is not None:
            scope["auth"] = grant
            await self.app(scope, receive, send)
            return
        why = "no API key given" if token is None else "the API key or client secret is not valid"
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008, "reason": why[:120]})
            return
        body = json.dumps(
            {
                "error": {
                    "type": "invalid_request_error",
                    "code": "invalid_api_key",
                    "message": f"{why}: send Authorization: Bearer <key>",
                    "param": None,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _deferred(scope: dict[str, Any]) -> bool:
    return scope["type"] == "websocket" and str(scope["path"]).startswith("/v1/phone/")


def grant_of(scope: dict[str, Any]) -> Grant:
    """The request's grant (`Grant("open")` when the app runs without the middleware)."""
    grant = scope.get("auth")
    return grant if isinstance(grant, Grant) else Grant("open")
