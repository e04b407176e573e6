"""Whether a request came from the phone provider it names: each provider's signature over the
URL it requested, keyed by the account's auth token (`phone.twilio_auth_token_env`,
`phone.plivo_auth_token_env`). With a provider's token unset nothing is checked.

    provider  signs                                    header, and what is signed
    Twilio    the voice webhook (POST), and the        X-Twilio-Signature: HMAC-SHA1 of the URL,
              Media Streams WebSocket upgrade          then the form's fields sorted by name
              (GET, the wss:// URL, no fields)         (name + value), base64
    Plivo     the audio stream's WebSocket upgrade     X-Plivo-Signature-V3 (-Ma-V3: the main
              (GET)                                    account's), X-Plivo-Signature-V3-Nonce:
                                                       HMAC-SHA256 of the URL (its query sorted)
                                                       + "." + nonce, base64; a comma-separated
                                                       list while a token rotates
    Telnyx    its HTTP webhooks only (Ed25519 over     nothing on the media-stream WebSocket, and
              "timestamp|body", telnyx-signature-      this server serves no Telnyx webhook:
              ed25519, telnyx-timestamp)               nothing to check

Sources: Twilio asks Media Streams servers to validate X-Twilio-Signature
(twilio.com/docs/global-infrastructure/firewall-configurations/media-streams-configuration); the
upgrade is signed over its wss:// URL (Twilio's own validator for WebSocket upgrades,
github.com/twilio/twilio-agent-connect-python `src/tac/server/signature_validation.py`, and
twilio-labs/twilio-aspnet issue 162), and a <Stream> URL takes no query string (Twilio error
31920). Plivo: "Plivo signs WebSocket connection requests", validated as a GET with
`validateV3Signature` over the full URI (plivo.com/docs/voice-agents/audio-streaming/concepts/
audio-streaming-guide, "Signature Validation"; plivo.com/docs/voice/xml/request/validation); the
construction is that of Plivo's SDK (github.com/plivo/plivo-python `plivo/utils/signature_v3.py`).
Plivo's Node stream SDK (plivo-stream-sdk-node) rebuilds the URL with http(s):// rather than
ws(s)://, so both are taken. Telnyx:
developers.telnyx.com "Media Streaming over WebSockets" and the AsyncAPI "Stream call media over
WebSocket" name no signature on the connection; its webhooks' are documented per callback
(developers.telnyx.com/api-reference/callbacks). With API keys set a Telnyx stream shows one in
its `stream_url`'s `?token=`, as before.

Neither signature carries a time, so `Replays` remembers what was taken for
`phone.replay_window_s`: a Twilio webhook's signature (over its CallSid and fields: each call's
own) or a Plivo upgrade's nonce seen again is refused. Twilio's stream upgrade is signed over the
stream's URL alone, the same for every call: no replay of it can be told from a new call (its
session needs the secret the signed webhook minted, in the stream's `start`, where keys are
set). No I/O here but reading a connection's headers.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from urllib.parse import parse_qs, urlsplit, urlunsplit

from starlette.requests import HTTPConnection

from realtime_omni.gateway.config import PhoneConfig

DEFAULT_PORTS = {"https": 443, "wss": 443, "http": 80, "ws": 80}
AS_HTTP = {"wss": "https", "ws": "http"}


MAX_REPLAYS = 100_000  # signatures and nonces remembered at most (oldest forgotten first)


class Replays:
    """What signed requests were taken within the window: `fresh(key)` is True the first time
    a key is seen (and remembers it), False for a replay."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        self._seen: OrderedDict[str, float] = OrderedDict()

    def fresh(self, key: str) -> bool:
        now = self.clock()
        while self._seen and (
            next(iter(self._seen.values())) < now - self.window_s or len(self._seen) > MAX_REPLAYS
        ):
            self._seen.popitem(last=False)
        if key in self._seen:
            return False
        self._seen[key] = now
        return True


def public_base(conn: HTTPConnection, config: PhoneConfig) -> tuple[bool, str]:
    """(secure, host[/prefix]) of the URL a provider requested: `phone.public_url`'s, else this
    request's Host and scheme, or the proxy's `X-Forwarded-Proto`/`-Host` where the config
    trusts them (`phone.trust_forwarded_headers`)."""
    if config.public_url:
        parts = urlsplit(config.public_url.rstrip("/"))
        return parts.scheme in ("https", "wss"), parts.netloc + parts.path
    headers = conn.headers
    proto, host = conn.url.scheme, headers.get("host", "localhost")
    if config.trust_forwarded_headers:
        proto = headers.get("x-forwarded-proto", proto).split(",")[0].strip()
        host = headers.get("x-forwarded-host") or host
    return proto in ("https", "wss"), host


def public_url(conn: HTTPConnection, config: PhoneConfig) -> str:
    """The URL a provider requested, as it named it (what it signs): `public_base`, then the
    path and query. A WebSocket upgrade's scheme is ws(s)://, a request's http(s)://."""
    secure, host = public_base(conn, config)
    if conn.scope["type"] == "websocket":
        scheme = "wss" if secure else "ws"
    else:
        scheme = "https" if secure else "http"
    query = conn.url.query
    return f"{scheme}://{host}{conn.url.path}" + (f"?{query}" if query else "")


def for_log(url: str) -> str:
    """`url` fit for a log line: its `token` (an API key or a stream's secret) hidden, quoted
    (a Host header or a path is the client's: no raw control characters reach the log)."""
    query = re.sub(r"(^|&)token=[^&]*", r"\1token=<hidden>", urlsplit(url).query)
    return repr(urlunsplit(urlsplit(url)._replace(query=query)))


def _spellings(url: str) -> set[str]:
    """`url` as given, without its port and with its scheme's default port: which one a
    provider signs depends on how the URL was written where it was configured. Only as given
    when its host does not parse (`Host: localhost:99999`): no signature will match it."""
    parts = urlsplit(url)
    try:
        host = parts.hostname or ""
        port = parts.port or DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return {url}
    host = f"[{host}]" if ":" in host else host
    return {
        url,
        parts._replace(netloc=host).geturl(),
        parts._replace(netloc=f"{host}:{port}").geturl() if port else url,
    }


def _matches(expected: Iterable[str], given: Iterable[str]) -> bool:
    """Whether any `given` signature is one of `expected`, in constant time for each pair."""
    want = [e.encode() for e in expected]
    return any(
        hmac.compare_digest(w, g.strip().encode("utf-8", "replace")) for g in given for w in want
    )


def twilio_signature(token: str, url: str, form: dict[str, list[str]]) -> str:
    """Twilio's X-Twilio-Signature: HMAC-SHA1 of the URL and the form's fields sorted by name,
    each name followed by its value, keyed by the account's auth token, in base64. A WebSocket
    upgrade has no fields."""
    data = url + "".join(k + v for k in sorted(form) for v in sorted(form[k]))
    mac = hmac.new(token.encode(), data.encode(), hashlib.sha1).digest()
    return base64.b64encode(mac).decode()


def twilio_signature_ok(
    token: str, url: str, form: dict[str, list[str]], given: str | None
) -> bool:
    """Whether `given` signs this request: the URL with and without its scheme's default port,
    as Twilio's own validator tries."""
    if not given:
        return False
    return _matches((twilio_signature(token, u, form) for u in _spellings(url)), [given])


def plivo_signature(token: str, url: str, nonce: str) -> str:
    """Plivo's X-Plivo-Signature-V3 on a GET (a WebSocket upgrade): HMAC-SHA256 of the URL, its
    query's fields sorted by name as `name=value` joined by `&`, then "." and the nonce, keyed by
    the account's auth token, in base64."""
    parts = urlsplit(url)
    fields = parse_qs(parts.query, keep_blank_values=True)
    query = "&".join(f"{k}={v}" for k in sorted(fields) for v in sorted(fields[k]))
    signed = urlunsplit((parts.scheme, parts.netloc, parts.path, query, "")) + "." + nonce
    mac = hmac.new(token.encode(), signed.encode(), hashlib.sha256).digest()
    return base64.b64encode(mac).decode()


def plivo_signature_ok(token: str, url: str, nonce: str | None, given: Iterable[str]) -> bool:
    """Whether one of the `given` header values (each a comma-separated list) signs this
    upgrade: the URL with its ws(s):// scheme or as http(s)://, with and without the default
    port."""
    signatures = [s for value in given for s in value.split(",") if s.strip()]
    if not nonce or not signatures:
        return False
    parts = urlsplit(url)
    urls = {url, parts._replace(scheme=AS_HTTP.get(parts.scheme, parts.scheme)).geturl()}
    spelt = {s for u in urls for s in _spellings(u)}
    return _matches((plivo_signature(token, u, nonce) for u in spelt), signatures)


def signs_upgrades(provider: str, config: PhoneConfig) -> bool:
    """Whether `upgrade_refusal` checks this provider's stream upgrades (its token is set): a
    stream it let in then came from the account's provider."""
    if provider == "twilio":
        return config.twilio_auth_token() is not None
    return provider == "plivo" and config.plivo_auth_token() is not None


def upgrade_refusal(
    provider: str, conn: HTTPConnection, config: PhoneConfig, replays: Replays
) -> str | None:
    """Why a media stream's WebSocket upgrade is refused: the provider's auth token is set and
    the upgrade's signature is missing or not over the URL it was sent to, or (Plivo) its nonce
    was taken before. None: let it in (also every Telnyx stream: Telnyx signs no upgrade)."""
    headers = conn.headers
    if provider == "twilio" and (token := config.twilio_auth_token()) is not None:
        url = public_url(conn, config)
        if not twilio_signature_ok(token, url, {}, headers.get("x-twilio-signature")):
            return f"X-Twilio-Signature does not match {for_log(url)}"
    if provider == "plivo" and (token := config.plivo_auth_token()) is not None:
        url = public_url(conn, config)
        given = headers.getlist("x-plivo-signature-v3") + headers.getlist("x-plivo-signature-ma-v3")
        nonce = headers.get("x-plivo-signature-v3-nonce")
        if not plivo_signature_ok(token, url, nonce, given):
            return f"X-Plivo-Signature-V3 does not match {for_log(url)}"
        if not replays.fresh(f"plivo {nonce}"):
            return f"a replay: nonce {nonce!r} was taken before"
    return None
