"""ICE settings for the WebRTC peers: STUN/TURN servers and the host addresses offered.

    use_host_addresses(None)            # every interface's address, plus 127.0.0.1
    use_host_addresses(["127.0.0.1"])   # loopback only (tests, benchmarks)
    config = rtc_configuration(gateway_config.ice_servers)

aioice leaves 127.0.0.1 out of its host candidates, so on a machine whose only interface is the
loopback an answer carries no candidate and the call hangs; `use_host_addresses` wraps aioice's
address lookup (process-wide: aioice offers no per-connection hook) so that 127.0.0.1 is always
offered, or only the addresses given. aiortc's default STUN server is on the internet; with no
`ice_servers` the configuration lists none, so loopback and LAN calls gather at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import aioice.ice
from aiortc import RTCConfiguration, RTCIceServer

from realtime_omni.errors import ConfigError

LOOPBACK = "127.0.0.1"

_original: Callable[..., list[str]] | None = None
_addresses: list[str] | None = None


def _host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    if _addresses is not None:
        return [a for a in _addresses if (use_ipv6 if ":" in a else use_ipv4)]
    assert _original is not None
    found = list(_original(use_ipv4=use_ipv4, use_ipv6=use_ipv6))
    if use_ipv4 and LOOPBACK not in found:
        found.append(LOOPBACK)
    return found


def use_host_addresses(addresses: Sequence[str] | None) -> None:
    """Offer these addresses as ICE host candidates (None: every interface's and 127.0.0.1),
    for every peer connection of this process gathered from now on."""
    global _original, _addresses
    if _original is None:
        _original = aioice.ice.get_host_addresses
        aioice.ice.get_host_addresses = _host_addresses
    _addresses = list(addresses) if addresses is not None else None


def ice_server(spec: dict[str, Any], where: str = "ice_servers") -> RTCIceServer:
    """One STUN/TURN server in the browser's `RTCIceServer` shape:
    `{"urls": "turn:host:3478" | [...], "username": ..., "credential": ...}`."""
    if not isinstance(spec, dict):
        raise ConfigError(f"{where}: {spec!r} is not an object; use {{'urls': 'stun:host:port'}}")
    urls = spec.get("urls")
    if isinstance(urls, str):
        urls = [urls]
    if not urls or not all(
        isinstance(u, str) and u.split(":", 1)[0] in ("stun", "stuns", "turn", "turns")
        for u in urls
    ):
        raise ConfigError(
            f"{where}: urls = {spec.get('urls')!r}; give stun:, stuns:, turn: or turns: URLs"
        )
    unknown = set(spec) - {"urls", "username", "credential"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}: urls, username, credential")
    return RTCIceServer(urls=urls, username=spec.get("username"), credential=spec.get("credential"))


def rtc_configuration(servers: Sequence[dict[str, Any]]) -> RTCConfiguration:
    """The peer connection's configuration; an empty list means no STUN/TURN at all."""
    return RTCConfiguration(
        iceServers=[ice_server(s, f"ice_servers[{i}]") for i, s in enumerate(servers)]
    )
