"""Where a request may come from: the `Host` it names and the `Origin` a browser sends, checked
before anything else, with API keys or without.

    app = OriginMiddleware(app, hosts={"voice.example.com"}, origins=["https://app.example.com"])

Any web page the user visits may open a WebSocket to `ws://127.0.0.1:8000` (WebSockets are not
bound by CORS) or POST a form to it, and a page may rebind a name of its own to 127.0.0.1 (DNS
rebinding: the browser then treats the server as that page's own site). So:

- `Host` must name the server: a loopback name (`localhost`, 127.0.0.0/8, ::1) or one of
  `hosts`; else 400 `host_not_allowed`. A request without Host (HTTP/1.0) passes: a browser
  always sends one, and a rebinding attack needs the browser.
- `Origin`, on a WebSocket upgrade and on a request that may change state (any method but GET,
  HEAD and OPTIONS: a preflight is CORS's to answer), must be the server's own (its host and
  port are the request's Host) or one of `origins`; else 403 `origin_not_allowed`. A client
  that sends no Origin (every client but a browser) passes.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from realtime_omni.gateway.auth import header, refuse

SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


def host_name(value: str) -> str:
    """The name in a Host header or a URL's netloc, without its port: `[::1]:8000` -> `::1`."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1 : v.find("]")] if "]" in v else v
    if v.count(":") == 1:  # name:port; a bare IPv6 address has more colons
        v = v.split(":")[0]
    return v.rstrip(".")


def is_loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class OriginMiddleware:
    """Refuses a request whose Host is not the server's, or whose Origin is neither the
    server's own nor allowed (see the module's docstring)."""

    def __init__(self, app: ASGIApp, hosts: Iterable[str] = (), origins: Iterable[str] = ()):
        self.app = app
        self.hosts = {host_name(h) for h in hosts}
        self.origins = {o.rstrip("/").lower() for o in origins}

    def host_allowed(self, name: str) -> bool:
        return "*" in self.hosts or name in self.hosts or is_loopback(name)

    def origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.rstrip("/").lower()
        if "*" in self.origins or origin in self.origins:
            return True
        try:
            parts = urlsplit(origin)
        except ValueError:
            return False
        own = parts.scheme in ("http", "https") and parts.netloc == host.strip().lower()
        return own and bool(host)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = header(scope, b"host")
        if host and not self.host_allowed(host_name(host)):
            await refuse(
                scope, receive, send, 400, "host_not_allowed",
                f"this server does not answer to the host {host!r}; its operator lists the "
                "names it answers to in realtime.allowed_hosts",
            )  # fmt: skip
            return
        origin = header(scope, b"origin")
        checked = scope["type"] == "websocket" or scope.get("method") not in SAFE_METHODS
        if origin and checked and not self.origin_allowed(origin, host):
            await refuse(
                scope, receive, send, 403, "origin_not_allowed",
                f"requests from the origin {origin!r} are not allowed; its operator lists the "
                "origins browsers may call from in realtime.cors_origins",
            )  # fmt: skip
            return
        await self.app(scope, receive, send)
