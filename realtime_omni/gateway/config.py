"""The gateway's settings: what `realtime-omni serve` takes from its flags (`GatewayConfig`) and
the `phone:`, `sip:` and `realtime:` sections of the config file (`PhoneConfig`, `SipConfig`,
`RealtimeConfig`), which the pipeline's own parser leaves to this one.

    cfg = load_server_config("configs/tiny.yaml")    # .pipeline, .phone, .sip, .realtime

```yaml
phone:
  public_url: wss://voice.example.com     # the stream URL the Twilio webhook's TwiML names
  idle_timeout_s: 60                      # no speech and no answer this long: goodbye, hang up
  routes:
    default: {session: {instructions: "You are a helpful phone agent."}}
    twilio: {session: {audio: {output: {voice: Ethan}}}}
sip:
  bind: 0.0.0.0
  public_address: 203.0.113.7
  allowed_peers: [10.0.0.0/8, 203.0.113.20]
  registration: {registrar: "sip:trunk.example.com", user: "+15550100", password_env: TRUNK_PW}
realtime:
  voices: {alloy: chelsie, ash: ethan}    # OpenAI's voice names -> the checkpoint's speakers
  api_keys_env: REALTIME_OMNI_API_KEYS    # the keys themselves live in the environment
  admin_api_keys_env: REALTIME_OMNI_ADMIN_KEYS  # keys that may act on every call
  cors_origins: ["https://app.example.com"]
  allowed_hosts: [voice.example.com]      # Host names answered besides loopback's
  client_secret_max_sessions: 1           # live sessions one client secret may hold
  resume_window_s: 30                     # a dropped WebSocket's session waits this long
```

A route's `session` is what a client would put in `session.update` (GA or beta shape); a
provider's route is laid over `default`, and a call's own stream parameters over both.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from realtime_omni.errors import ConfigError
from realtime_omni.gateway.protocol.settings import DEFAULT_VOICES
from realtime_omni.pipeline.config import GATEWAY_SECTIONS, PipelineConfig, load_config

Route = Literal["default", "twilio", "telnyx", "plivo", "sip"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PhoneRoute(_Strict):
    session: dict[str, Any] = Field(
        default_factory=dict,
        description="session settings for calls on this route, as in session.update",
    )


SIP_CODECS: tuple[Literal["PCMU", "PCMA"], ...] = ("PCMU", "PCMA")  # in order of preference


class PhoneConfig(_Strict):
    """Calls from a phone: the media-stream bridges (`/v1/phone/<provider>`) and SIP."""

    enabled: bool = True  # the /v1/phone routes; false: they are not served
    public_url: str | None = Field(
        None,
        description="base URL providers reach this server at (wss://host[:port]); None: the "
        "request's Host (or, with trust_forwarded_headers, X-Forwarded-Host and -Proto), wss "
        "behind TLS, else ws. What the providers' signatures are checked against",
    )
    trust_forwarded_headers: bool = Field(
        False,
        description="with public_url unset, take the URL a provider requested from "
        "X-Forwarded-Proto and X-Forwarded-Host (set this only behind a proxy that sets them "
        "itself): otherwise anyone may name any host in them, and replay there a signature "
        "captured for another server's URL",
    )
    replay_window_s: float = Field(
        600.0,
        gt=0,
        description="a signed request (Twilio's voice webhook, Plivo's stream upgrade with its "
        "nonce) seen again within this many seconds is refused (403) as a replay",
    )
    lead_ms: float = Field(80.0, gt=0, le=1000, description="audio sent ahead of real time")
    start_timeout_s: float = Field(10.0, gt=0, description="a stream must send `start` by then")
    idle_timeout_s: float | None = Field(
        60.0, gt=0, description="no speech and no answer this long ends the call; None: never"
    )
    goodbye_instructions: str = Field(
        "The caller has said nothing for a while. Say a short, polite goodbye.",
        description="what the bot is asked to say before an idle hang-up; empty: hang up at once",
    )
    goodbye_max_s: float = Field(15.0, gt=0, description="the goodbye's limit before hang-up")
    max_message_bytes: int = Field(1 << 20, gt=0, description="larger messages are dropped")
    max_start_bytes: int = Field(
        64 << 10,
        gt=0,
        description="a message before `start` (when the stream is not yet authenticated) larger "
        "than this ends the stream",
    )
    max_pending_streams: int = Field(
        16,
        gt=0,
        description="media streams connected and waiting for their `start` at once, counted "
        "twice: those that showed a credential (a token, the provider's signature) and those "
        "that did not, each up to this; more are closed at once (1013, try again later)",
    )
    max_pending_streams_per_address: int = Field(
        8,
        gt=0,
        description="of the streams that showed no credential, how many one address may hold "
        "waiting for their `start` at once (behind a proxy every stream has the proxy's)",
    )
    twilio_auth_token_env: str = Field(
        "TWILIO_AUTH_TOKEN",
        description="environment variable holding the Twilio account's auth token; set, the "
        "voice webhook and the /v1/phone/twilio WebSocket upgrade are taken only with an "
        "X-Twilio-Signature that verifies (403 otherwise)",
    )
    plivo_auth_token_env: str = Field(
        "PLIVO_AUTH_TOKEN",
        description="environment variable holding the Plivo account's auth token; set, the "
        "/v1/phone/plivo WebSocket upgrade is taken only with an X-Plivo-Signature-V3 that "
        "verifies (403 otherwise). Telnyx signs no stream upgrade: nothing to set for it",
    )
    routes: dict[Route, PhoneRoute] = Field(default_factory=dict)

    def twilio_auth_token(self) -> str | None:
        return os.environ.get(self.twilio_auth_token_env) or None

    def plivo_auth_token(self) -> str | None:
        return os.environ.get(self.plivo_auth_token_env) or None

    def session_for(self, route: str) -> dict[str, Any]:
        """The route's session settings laid over the default route's."""
        base = self.routes.get("default", PhoneRoute()).session
        return merge(base, self.routes.get(route, PhoneRoute()).session)  # type: ignore[call-overload]


class SipRegistration(_Strict):
    """Register with a trunk or PBX, so calls to `user` reach this server."""

    registrar: str = Field(description="e.g. sip:trunk.example.com")
    user: str = Field(description="the account's user part, e.g. +15550100")
    realm: str = "*"
    username_env: str | None = Field(None, description="env var of the auth user (else `user`)")
    password_env: str = Field(
        "REALTIME_OMNI_SIP_PASSWORD", description="env var holding the password; never the file"
    )

    def credentials(self) -> tuple[str, str]:
        password = os.environ.get(self.password_env)
        if password is None:
            raise ConfigError(
                f"sip.registration: the environment variable {self.password_env} (the trunk's "
                "password) is not set. Fix: export it, or name another in password_env"
            )
        user = os.environ.get(self.username_env, "") if self.username_env else self.user
        return user or self.user, password


class SipConfig(_Strict):
    """The SIP user agent (`serve --sip-port`): UDP signalling, G.711 over RTP."""

    bind: str = Field("127.0.0.1", description="address SIP and RTP listen on")
    port: int = Field(5060, ge=0, le=65535, description="SIP's UDP port; --sip-port sets it")
    public_address: str | None = Field(
        None, description="address put in Contact and SDP (behind NAT); None: the bound one"
    )
    allowed_peers: list[str] = Field(
        default_factory=lambda: ["127.0.0.1/32"],
        description="addresses or networks whose INVITEs are answered; others get 403",
    )
    rtp_port: int = Field(40000, ge=1024, le=65535, description="first RTP port")
    rtp_port_range: int = Field(1000, ge=2, description="RTP ports from rtp_port on")
    codecs: list[Literal["PCMU", "PCMA"]] = Field(default_factory=lambda: list(SIP_CODECS))
    max_calls: int = Field(32, gt=0, description="more INVITEs get 486 Busy Here")
    registration: SipRegistration | None = None

    @field_validator("allowed_peers")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        for peer in v:
            try:
                ipaddress.ip_network(peer, strict=False)
            except ValueError:
                raise ValueError(f"{peer!r} is not an IP address or network") from None
        return v

    def allows(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in ipaddress.ip_network(p, strict=False) for p in self.allowed_peers)


class RealtimeConfig(_Strict):
    """The OpenAI Realtime API: its voices, API keys, client secrets and browsers."""

    voices: dict[str, str] = Field(
        default_factory=lambda: dict(DEFAULT_VOICES),
        description="voice names a session may ask for -> the checkpoint's speakers (the "
        "speakers' own names are taken too)",
    )
    api_keys_env: str = Field(
        "REALTIME_OMNI_API_KEYS",
        description="environment variable holding the API keys, comma-separated (never put "
        "them in this file); unset or empty: no authentication, loopback only",
    )
    admin_api_keys_env: str = Field(
        "REALTIME_OMNI_ADMIN_KEYS",
        description="environment variable holding admin API keys, comma-separated: keys that "
        "may act on every call (hang up, attach a sideband); any other key acts on its own calls "
        "and those of the client secrets it minted",
    )
    client_secret_ttl_s: int = Field(
        600, ge=10, le=7200, description="a client secret's life unless its request asks less"
    )
    client_secret_max_sessions: int = Field(
        1,
        ge=1,
        le=64,
        description="sessions one client secret may start in all, and hold at once (a page's "
        "own call): more at once are refused with client_secret_session_limit, more in all with "
        "client_secret_used (one that never connected, or that a new one replaced while it "
        "waited for a resume, gives its place back)",
    )
    live_max_session_s: float = Field(
        3600.0,
        gt=0,
        description="how long a Live API session (/v1/live/sessions) may last: its session "
        "resource's expires_at, after which it ends with session.closed reason expired",
    )
    resume_window_s: float = Field(
        30.0,
        ge=0,
        le=600,
        description="how long a /v1/realtime session whose connection dropped (no close frame) "
        "waits for its client to come back with the resume token session.created gave it "
        "(an extension: transports/resume.py); meanwhile it counts against the limits, but "
        "gives way to a new session they would refuse. 0: off, a drop ends the session",
    )
    cors_origins: list[str] = Field(
        default_factory=list,
        description="origins browsers may call from (CORS, and the Origin a WebSocket or a "
        "POST may come with besides the server's own); ['*']: any",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="names the server answers to in the Host header, besides loopback's "
        "(localhost, 127.0.0.1, ::1), the address `serve --host` names and phone.public_url's "
        "host; other Hosts get 400 (DNS rebinding). ['*']: any",
    )
    websocket_compression: bool = Field(
        False,
        description="accept permessage-deflate on the WebSockets (/v1/realtime, the phone "
        "bridges). Off by default: a message is inflated on the event loop in one piece, and an "
        "8 MB append held every call's audio for 60-380 ms; base64 audio shrinks little, and "
        "every outgoing audio delta would be deflated on the loop too",
    )
    smart_turn_dir: str | None = Field(
        None,
        description="directory holding Smart Turn v3's ONNX model (smart-turn-v3*.onnx): "
        "semantic_vad then ends a turn when it sounds complete (gateway/turns/end_of_turn.py). "
        "None: .cache/models/smart_turn/ beside the package, where `make install` puts v3.2 "
        "from the pinned pipecat-ai wheel (BSD 2-clause; models/smart_turn.py), and if it is "
        "not there, one log line says so and semantic_vad is a silence set by its eagerness; "
        "'': no model, that silence",
    )

    webrtc_reorder_packets: int | None = Field(
        2,
        ge=1,
        description="a WebRTC caller's audio reaches the VAD as each packet arrives; a packet "
        "after a gap waits until this many packets (20 ms each) came after the gap, for a "
        "packet the network reordered, before the gap counts as lost and becomes silence "
        "(gateway/transports/webrtc_input.py; 1: never wait). null: aiortc's own jitter buffer, "
        "which holds every frame 80 ms, and after a loss drops 4 more frames and 300 ms for "
        "the rest of the call",
    )

    def api_keys(self) -> frozenset[str]:
        raw = os.environ.get(self.api_keys_env, "")
        return frozenset(k.strip() for k in raw.split(",") if k.strip())

    def admin_api_keys(self) -> frozenset[str]:
        raw = os.environ.get(self.admin_api_keys_env, "")
        return frozenset(k.strip() for k in raw.split(",") if k.strip())


@dataclass
class GatewayConfig:
    max_sessions: int = 16  # more connections are refused with `too_many_sessions`
    max_message_bytes: int = 8 << 20  # larger WebSocket messages get `message_too_large`
    # What one WebSocket's client may send a second, beyond a burst of two largest messages:
    # past it the connection is not read until it is back under (`aio.ReadPace`). Audio at 4x
    # real time is under 0.3 MB/s.
    max_client_bytes_per_s: int = 2 << 20
    max_lead_ms: float = 2000.0  # audio made ahead of playout, per session
    send_ahead_ms: float = 100.0  # WebSocket audio sent ahead of real time (client jitter)
    entry_slot_bytes: int = 4 << 20  # a turn's payload limit (conversation audio and images),
    # used when the pipeline config sets no `client -> entry` edge of its own
    max_session_bytes: int = 32 << 20  # a session's audio and images; the oldest items go past
    # it (announced with conversation.item.deleted), so a client cannot grow a session for ever
    vad: bool = True  # load silero-vad; off only for tests without torch
    # WebRTC. STUN/TURN servers for the calls' ICE, in the browser's RTCIceServer shape:
    # [{"urls": "turn:turn.example.com:3478", "username": "u", "credential": "p"}]. Empty: host
    # candidates only, enough for loopback and LAN calls (aiortc's default public STUN is not used).
    ice_servers: list[dict[str, Any]] = field(default_factory=list)
    # Addresses offered as ICE host candidates. None: every interface's, plus 127.0.0.1 (which
    # aioice leaves out, so a loopback-only machine could not call). ["127.0.0.1"]: loopback only.
    ice_host_addresses: list[str] | None = None
    # ICE candidates an offer may not name (CIDR networks): the server would send STUN checks
    # there. Default: link-local (169.254.0.0/16, fe80::/10, which holds the clouds' metadata
    # service, 169.254.169.254), the AWS IPv6 metadata address, "this network" and multicast.
    # Such candidates are taken out of the offer before it is parsed (the log says so).
    ice_denied_networks: list[str] = field(
        default_factory=lambda: [
            "169.254.0.0/16",
            "fe80::/10",
            "fd00:ec2::254/128",
            "0.0.0.0/8",
            "224.0.0.0/4",
            "ff00::/8",
        ]
    )
    phone: PhoneConfig = field(default_factory=PhoneConfig)  # the config file's `phone:`
    sip: SipConfig | None = None  # the config file's `sip:` with --sip-port; None: no SIP
    realtime: RealtimeConfig = field(default_factory=RealtimeConfig)  # the file's `realtime:`
    # Serve another address than loopback with no API keys (something in front authenticates).
    allow_no_auth: bool = False
    # With no API keys set, make one for this run and print it (`serve --generate-api-key`:
    # the Docker image's default, so `docker run -p 8000:8000` never serves anyone).
    generate_api_key: bool = False
    # Keys besides realtime.api_keys_env's: the one `generate_api_key` made.
    api_keys: tuple[str, ...] = ()
    # The address `serve --host` listens on: its name is answered in Host besides loopback's.
    bind_host: str | None = None
    # SIGTERM: /readyz 503 and new sessions refused at once, live ones go on up to this many
    # seconds, then end and the process exits (`app.serve`); 0: end them at once.
    drain_s: float = 25.0
    # In a drain, a WebRTC call whose caller has sent no audio for this many seconds ends at
    # once instead of holding the drain: its peer vanished without hanging up, and ICE takes
    # ~30 s to say so. A caller sends a packet every 20 ms (every 400 ms in Opus DTX's
    # silence, and a muted browser track sends silence), so 3 s is no pause of a live call.
    # A call that sends no audio (events only) is not judged. 0: none is ended early.
    drain_media_timeout_s: float = 3.0
    # Every server event sent, one JSON line each, audio left out (`event_log.py`); None: off.
    event_log: str | None = None


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid over `base`, nested mappings merged key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@dataclass(frozen=True)
class ServerConfig:
    """A config file: the pipeline, and the gateway's sections."""

    pipeline: PipelineConfig
    phone: PhoneConfig
    sip: SipConfig
    realtime: RealtimeConfig


def load_server_config(path: str | Path) -> ServerConfig:
    """The pipeline config and the gateway's sections of the same file."""
    pipeline = load_config(path)
    data = yaml.safe_load(Path(path).read_text()) or {}
    return ServerConfig(
        pipeline,
        _section(PhoneConfig, data, "phone"),
        _section(SipConfig, data, "sip"),
        _section(RealtimeConfig, data, "realtime"),
    )


def _section(model: Any, data: dict[str, Any], name: str) -> Any:
    assert name in GATEWAY_SECTIONS
    try:
        return model.model_validate(data.get(name) or {})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join([name, *(str(p) for p in err["loc"])])
        top = model.model_fields.get(err["loc"][0]) if err["loc"] else None
        about = f" ({top.description})" if top is not None and top.description else ""
        raise ConfigError(
            f"config field {where!r} = {err.get('input')!r}: {err['msg']}{about}"
        ) from None
