"""API keys and client secrets, checked on every route but `/healthz` and the demo page's files.

    auth = Auth(keys={"sk-..."}, ttl_s=600)       # no keys: nothing is checked
    secret = auth.mint({"instructions": "..."})   # ("ek_...", expires_at)
    grant = auth.check("ek_...")                  # Grant(kind="secret", session={...}), or None
    app = AuthMiddleware(app, auth)               # ASGI: 401 / WebSocket close 1008 without one

A request carries its token as OpenAI's clients send it: `Authorization: Bearer <token>`, or,
on a WebSocket from a browser (which cannot set headers), the subprotocol
`openai-insecure-api-key.<token>` beside `realtime` (the endpoint echoes `realtime` back). The
phone routes also take `?token=`, since a provider's webhook is a URL; a media stream from
Twilio, whose stream URLs carry no query, is let through to show its token in `start`'s
parameters (`media_stream.py` checks it there).

What each grant may do:

- an API key (long-lived, for servers): every route; it acts (hangs up, attaches a sideband)
  on its own calls, those the secrets it minted started among them; an admin key
  (`realtime.admin_api_keys_env`) on every call;
- a client secret (`ek_...`, minted by `POST /v1/realtime/client_secrets` with a key, expiring
  after `ttl_s`): the routes that start or end a call (`CALL_ROUTES`) and nothing else: no
  stats, no metrics, no minting, no webhook. Every call it starts begins with the session
  settings it was minted with; it starts at most `max_sessions_per_secret` sessions in all, not
  one after another until it expires (a session that never connected, or that a new one of the
  same secret replaced while it waited for a resume, gives its place back), and holds at most
  that many at once (`Gateway.refusal`); it may hang up and attach a sideband to its own calls
  only. A secret the Twilio webhook mints for a stream (`purpose="phone"`) is good for a phone
  stream alone.

Secrets live in memory, at most `MAX_SECRETS` of them and `max_bytes` of their session settings
(the oldest go first); a restart voids them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Receive, Scope, Send

MAX_SECRETS = 10000
MAX_SECRET_BYTES = 64 << 20  # the secrets' session settings together, as JSON
OPEN_PATHS = ("/", "/healthz")  # and /static/...: the demo page
SUBPROTOCOL_KEY = "openai-insecure-api-key."
# (scope type, path) a browser's client secret may reach: starting a call and ending it.
CALL_ROUTES = re.compile(
    r"websocket:/v1/realtime|http:/v1/realtime/calls(/[^/]+/hangup)?|http:/v1/webrtc/offer"
    r"|http:/v1/whip(/[^/]+)?|websocket:/v1/live/sessions(/[^/]+/attach)?"
    r"|http:/v1/live/sessions(/[^/]+/hangup)?"
)
PHONE_ROUTES = re.compile(r"websocket:/v1/phone/[^/]+")  # a phone stream's secret

Kind = Literal["key", "secret", "open", "deferred"]
Purpose = Literal["call", "phone"]


@dataclass(frozen=True)
class Grant:
    kind: Kind  # "open": no keys configured; "deferred": a Twilio stream, token in `start`
    session: dict[str, Any] | None = None  # a client secret's session settings
    owner: str = "open"  # who: a key's or a secret's digest; the sessions it started carry it
    purpose: Purpose = "call"  # a secret's: a browser's call, or one phone stream
    admin: bool = False  # a key that may act on every call, not only its own

    @property
    def trusted(self) -> bool:
        """An API key's holder (or anyone, with no keys configured): every route and call."""
        return self.kind in ("key", "open")


@dataclass
class _Secret:
    expires_at: float  # unix time
    session: dict[str, Any]
    purpose: Purpose
    size: int  # bytes of `session` as JSON: what it counts against `max_bytes`


def _digest(kind: str, token: str) -> str:
    return f"{kind}:{hashlib.sha256(_bytes(token)).hexdigest()[:16]}"


def _bytes(token: str) -> bytes:
    # A header is decoded as latin-1 and `?token=` as UTF-8: any character may come.
    return token.encode("utf-8", "replace")


class Auth:
    def __init__(
        self,
        keys: Iterable[str] = (),
        ttl_s: int = 600,
        max_bytes: int = MAX_SECRET_BYTES,
        max_sessions_per_secret: int = 1,
        admin_keys: Iterable[str] = (),
    ) -> None:
        self.admins = {_digest("key", k) for k in admin_keys}
        self.keys = {_bytes(k): _digest("key", k) for k in [*keys, *admin_keys]}
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.max_sessions_per_secret = max_sessions_per_secret  # read by `Gateway.refusal`
        self._secrets: OrderedDict[str, _Secret] = OrderedDict()
        self._bytes = 0  # of the secrets' sessions
        self._started: dict[str, int] = {}  # a secret's digest -> sessions it started
        # a secret's digest -> the key that minted it (kept past the secret: its calls go on)
        self._minted_by: OrderedDict[str, str] = OrderedDict()

    @property
    def required(self) -> bool:
        return bool(self.keys)

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def mint(
        self,
        session: dict[str, Any],
        ttl_s: int | None = None,
        purpose: Purpose = "call",
        minted_by: str | None = None,
    ) -> tuple[str, int]:
        """A new client secret bound to `session` settings, and when it expires (unix s);
        `minted_by`: the key that asked for it, which owns its calls too. The oldest secrets go
        past `MAX_SECRETS` or `max_bytes`."""
        now = time.time()
        self._purge(now)
        value = f"ek_{secrets.token_urlsafe(24)}"
        expires_at = int(now + min(ttl_s or self.ttl_s, self.ttl_s))
        size = len(json.dumps(session)) + 256  # and the entry's own keep
        self._secrets[value] = _Secret(expires_at, session, purpose, size)
        if minted_by is not None:
            self._minted_by[_digest("secret", value)] = minted_by
            while len(self._minted_by) > 4 * MAX_SECRETS:
                self._minted_by.popitem(last=False)
        self._bytes += size
        while len(self._secrets) > MAX_SECRETS or self._bytes > self.max_bytes:
            self._bytes -= self._secrets.popitem(last=False)[1].size
        return value, expires_at

    def check(self, token: str | None) -> Grant | None:
        """What `token` allows: None when keys are required and it is none of them."""
        if not self.required:
            return Grant("open")
        if not token:
            return None
        given = _bytes(token)
        for key, owner in self.keys.items():
            if hmac.compare_digest(given, key):
                return Grant("key", owner=owner, admin=owner in self.admins)
        secret = self._secrets.get(token)
        if secret is None:
            return None
        if secret.expires_at <= time.time():
            self._drop(token)
            return None
        return Grant("secret", secret.session, _digest("secret", token), secret.purpose)

    def owns(self, grant: Grant, owner: str) -> bool:
        """Whether `grant` may act on a call whose session `owner` started: its own, a call of
        a secret its key minted, or any call for an admin key (or with no keys at all)."""
        if grant.kind == "open" or grant.admin or grant.owner == owner:
            return True
        return grant.kind == "key" and self._minted_by.get(owner) == grant.owner

    def started(self, owner: str) -> int:
        """Sessions the secret of digest `owner` started and still counts."""
        return self._started.get(owner, 0)

    def count_start(self, owner: str) -> None:
        """A session was admitted for `owner`: a secret's counts against its sessions."""
        if owner.startswith("secret:"):
            self._started[owner] = self.started(owner) + 1

    def uncount(self, owner: str) -> None:
        """A secret's session gave its place to a newer one of the same secret."""
        if self._started.get(owner):
            self._started[owner] -= 1

    def _drop(self, value: str) -> None:
        self._bytes -= self._secrets.pop(value).size
        self._started.pop(_digest("secret", value), None)

    def _purge(self, now: float) -> None:
        for value in [v for v, s in self._secrets.items() if s.expires_at <= now]:
            self._drop(value)


def header(scope: Scope, name: bytes) -> str:
    """A request header's value (latin-1, as HTTP has it), "" when absent."""
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return str(v.decode("latin-1"))
    return ""


def offered_subprotocols(scope: Scope) -> list[str]:
    return [p.strip() for p in header(scope, b"sec-websocket-protocol").split(",") if p.strip()]


def token_of(scope: Scope) -> str | None:
    """The token a request carries: the bearer, a browser WebSocket's subprotocol, or, on the
    phone routes only, `?token=`."""
    bearer = header(scope, b"authorization")
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


def may_reach(grant: Grant, scope: Scope) -> bool:
    """Whether `grant` may reach this route at all (what it may do there, the route decides)."""
    if grant.kind != "secret":
        return True
    routes = PHONE_ROUTES if grant.purpose == "phone" else CALL_ROUTES
    return routes.fullmatch(f"{scope['type']}:{scope['path']}") is not None


async def refuse(
    scope: Scope, receive: Receive, send: Send, status: int, code: str, message: str
) -> None:
    """Refuse a request before any route sees it: OpenAI's error shape over HTTP; a WebSocket is
    closed before it is accepted (the client sees HTTP 403)."""
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        reason = message.encode()[:120].decode("utf-8", "ignore")  # a close reason's limit
        await send({"type": "websocket.close", "code": 1008, "reason": reason})
        return
    body = json.dumps(
        {
            "error": {
                "type": "invalid_request_error",
                "code": code,
                "message": message,
                "param": None,
            }
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class AuthMiddleware:
    """Refuses what carries no valid token (401), and a client secret on a route that is not
    its own (403); puts the `Grant` in the scope (`scope["auth"]`) for the routes that read
    it."""

    def __init__(self, app: ASGIApp, auth: Auth) -> None:
        self.app, self.auth = app, auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or _open(scope["path"]):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http" and scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)  # a CORS preflight carries no credentials
            return
        token = token_of(scope)
        grant = self.auth.check(token)
        if grant is None and token is None and _deferred(scope):
            grant = Grant("deferred", owner="deferred")  # a Twilio stream: token in `start`
        if grant is not None and not may_reach(grant, scope):
            await refuse(
                scope, receive, send, 403, "forbidden",
                "a client secret is good for starting and ending its own calls only; this "
                "route takes an API key",
            )  # fmt: skip
            return
        if grant is not None:
            scope["auth"] = grant
            await self.app(scope, receive, send)
            return
        why = "no API key given" if token is None else "the API key or client secret is not valid"
        await refuse(
            scope, receive, send, 401, "invalid_api_key",
            f"{why}: send Authorization: Bearer <key>",
        )  # fmt: skip


def _deferred(scope: Scope) -> bool:
    # Only Twilio's stream URLs take no query (its error 31920); Telnyx's and Plivo's carry
    # `?token=`, so one of theirs without a token is refused here like any other request.
    return scope["type"] == "websocket" and scope["path"] == "/v1/phone/twilio"


def grant_of(scope: Scope) -> Grant:
    """The request's grant (`Grant("open")` when the app runs without the middleware)."""
    grant = scope.get("auth")
    return grant if isinstance(grant, Grant) else Grant("open")
