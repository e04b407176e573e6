"""The control plane's ZMQ sockets, made one way by the coordinator and every stage process.

Each process binds one PULL inbox and connects a PUSH socket per peer. On one machine the
inboxes are `ipc://` sockets in a private directory (mode 0700: no other user reaches them).
Across hosts they are TCP, and then CurveZMQ authenticates and encrypts every connection: all
processes of a deployment share one Curve secret key, taken from the environment variable the
config names (`runtime.curve_secret_env`, default `REALTIME_OMNI_CURVE_SECRET`, 40 Z85
characters; `realtime-omni keygen` makes one), never from the config file. Each inbox is a Curve
server with that key and each peer socket a Curve client of it, so a connection that does not
hold the secret completes no handshake and delivers nothing: no stranger who reaches a port can
send `Shutdown`, `Abort` or forged payloads. A TCP config without the key does not start.
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq

from realtime_omni.errors import ConfigError
from realtime_omni.pipeline.config import PipelineConfig

# ZMQ send queues: what can be in flight is bounded by the edges' credits (one message per
# payload, one ack per payload) plus a few control messages per request, so this never binds.
SNDHWM = 100_000


def private_dir(path: Path) -> None:
    """Make `path` a folder only its owner may enter (0700): `runtime.ipc_dir` holds the stage
    processes' ipc:// sockets, and whoever can connect to those can talk to the stages. One
    that exists open to others is refused, not changed (it may be a shared folder)."""
    try:
        path.mkdir(mode=0o700, parents=True)
        path.chmod(0o700)  # mkdir's mode passes through the umask
    except FileExistsError:
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise ConfigError(
                f"runtime.ipc_dir = {str(path)!r} is open to other users (mode {mode:o}). Fix: "
                f"chmod 700 {path}, or name a folder that does not exist yet"
            ) from None


def curve_secret(cfg: PipelineConfig) -> bytes | None:
    """The deployment's Curve secret key when its processes talk over TCP (`hosts`), else None;
    ConfigError if TCP is used without a valid key in the environment."""
    if not cfg.hosts:
        return None
    var = cfg.runtime.curve_secret_env
    key = os.environ.get(var, "").strip().encode()
    fix = (
        f"Fix: set {var} to the same 40-character Z85 key on every host (make one with "
        "`realtime-omni keygen`)"
    )
    if not key:
        raise ConfigError(f"runtime: the stages talk over TCP (hosts) but {var} is not set. {fix}")
    try:
        zmq.curve_public(key)
    except (zmq.ZMQError, ValueError):
        raise ConfigError(f"runtime: {var} is not a Curve secret key. {fix}") from None
    return key


def keygen() -> str:
    """A new Curve secret key, Z85 text."""
    return zmq.curve_keypair()[1].decode()


def inbox(ctx: zmq.Context, endpoint: str, secret: bytes | None) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)  # bounded by credits, see SNDHWM
    if secret is not None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.bind(endpoint)
    return sock


def peer(ctx: zmq.Context, endpoint: str, secret: bytes | None) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, SNDHWM)
    sock.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        public = zmq.curve_public(secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.connect(endpoint)
    return sock


def drop(peers: dict[str, zmq.Socket], process: str) -> None:
    """Close the socket to `process` (it died, or moved): the next send connects anew."""
    sock = peers.pop(process, None)
    if sock is not None:
        sock.close(linger=0)
