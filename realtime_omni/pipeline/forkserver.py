"""A fork server: stage processes forked from one that has imported their modules already.

A stage process started as a fresh interpreter spends seconds importing torch, transformers and
its executor's module before it loads a weight (3.6 s on a busy 2-core machine, most of a tiny
model's restart). The coordinator instead starts this server once, which imports the modules the
config's local executors name and then only forks: each stage process is a fork of it, running
`worker_main` as `python -m realtime_omni.pipeline.worker` would, and pays for its model load
alone. PyTorch's DataLoader forks from processes with torch imported the same way; nothing here
touches CUDA before a fork, so each stage process initialises its own.

Protocol, JSON lines over a socket pair (`ForkServer` in the coordinator, `serve` here):

    -> {"modules": [...]}          once; <- {"ready": true} when imported (a failed import is
                                   not fatal here: the stage that needs it fails as it would)
    -> {"spawn": {env}}            <- {"pid": n} once forked; the child runs with `env` as its
                                   whole environment (the worker's arguments in ARGS_ENV)
                                   <- {"exit": n, "code": c} when a child exits (reaped here)

The server is single-threaded (no thread may hold a lock across a fork). It exits when the
coordinator closes its end; its children watch the coordinator themselves (a pidfd of
`owner_pid`), not the server: should it die (the OOM killer), they go on serving and the
supervisor starts another server for the next starts.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from typing import Any

SPAWN_TIMEOUT_S = 10.0  # a fork takes milliseconds; the first waits for the imports below
READY_TIMEOUT_S = 300.0


class ForkServer:
    """The coordinator's side: start the server, fork stage processes from it."""

    def __init__(self, modules: list[str], env: dict[str, str] | None = None) -> None:
        """`env`: the server's environment (default this process's): its stages' start from it
        (the server's credentials left out: `environ.py`)."""
        mine, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "realtime_omni.pipeline.forkserver", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
        )
        theirs.close()
        self.sock = mine
        self.sock.settimeout(SPAWN_TIMEOUT_S)
        self._buf = b""
        self._exits: dict[int, int] = {}  # pid -> exit code, reported by the server
        self._lock = threading.Lock()  # spawns come from the loop, polls from any thread
        self._send({"modules": modules})
        self._ready = False

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Block until the server has imported its modules (off the event loop: seconds)."""
        with self._lock:
            self._read_until("ready", timeout)
            self._ready = True

    def spawn(self, env: dict[str, str]) -> Forked:
        with self._lock:
            if not self._ready:
                self._read_until("ready", READY_TIMEOUT_S)
                self._ready = True
            self._send({"spawn": env})
            pid = int(self._read_until("pid", SPAWN_TIMEOUT_S)["pid"])
        return Forked(pid, self)

    def exit_code(self, pid: int, timeout: float = 0.0) -> int | None:
        """`pid`'s exit code once the server has reported it (waiting up to `timeout`)."""
        with self._lock:
            if pid not in self._exits and timeout > 0:
                with contextlib.suppress(TimeoutError, OSError):
                    self._read_until("exit", timeout, pid)
            elif pid not in self._exits:
                self._drain()
            return self._exits.get(pid)

    def close(self) -> None:
        self.sock.close()  # the server sees EOF and exits
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    # ---- the socket ---------------------------------------------------------------------

    def _send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(msg).encode() + b"\n")

    def _read_until(self, key: str, timeout: float, pid: int | None = None) -> dict[str, Any]:
        """Messages until one with `key` (for "exit", about `pid`); exits are kept on the way."""
        self.sock.settimeout(timeout)
        while True:
            while (msg := self._next_message()) is not None:
                if key in msg and (pid is None or msg.get(key) == pid):
                    return msg
            chunk = self.sock.recv(65536)
            if not chunk:
                raise OSError(f"the fork server exited (code {self.proc.poll()})")
            self._buf += chunk

    def _drain(self) -> None:
        try:
            self.sock.setblocking(False)
            while chunk := self.sock.recv(65536):
                self._buf += chunk
        except (BlockingIOError, OSError):
            pass
        finally:
            self.sock.setblocking(True)
        while self._next_message() is not None:
            pass

    def _next_message(self) -> dict[str, Any] | None:
        """The next whole message read, an exit report kept on the way; None: none yet."""
        if b"\n" not in self._buf:
            return None
        line, self._buf = self._buf.split(b"\n", 1)
        msg = dict(json.loads(line))
        if "exit" in msg:
            self._exits[int(msg["exit"])] = int(msg["code"])
        return msg


class Forked:
    """A stage process forked by the server, with the part of `subprocess.Popen`'s interface the
    coordinator uses. It is the server's child, not ours: its end is seen through a pidfd, its
    exit code through the server's report, and signals go through the pidfd (never to a pid
    reused by someone else)."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._server = server
        self._fd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._fd], [], [], 0)[0]:
            self._ended(1.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._fd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"stage process {self.pid}", timeout or 0)
            self._ended(1.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._fd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _ended(self, timeout: float) -> None:
        code = self._server.exit_code(self.pid, timeout)
        self.returncode = -signal.SIGKILL if code is None else code  # the server died first
        os.close(self._fd)


# ---- the server process -------------------------------------------------------------------


def serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinator's to handle
    children: dict[int, int] = {}  # pidfd -> pid
    buf = b""

    def send(msg: dict[str, Any]) -> None:
        sock.sendall(json.dumps(msg).encode() + b"\n")

    while True:
        readable, _, _ = select.select([fd, *children], [], [])
        for pidfd in readable:
            if pidfd == fd:
                continue
            pid = children.pop(pidfd)
            os.close(pidfd)
            _, status = os.waitpid(pid, 0)
            send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if fd not in readable:
            continue
        chunk = sock.recv(65536)
        if not chunk:
            return  # the coordinator is gone or done
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            msg = json.loads(line)
            if "modules" in msg:
                for name in msg["modules"]:
                    with contextlib.suppress(Exception):  # its stage reports the same error
                        importlib.import_module(name)
                send({"ready": True})
            elif "spawn" in msg:
                pid = os.fork()
                if pid == 0:
                    _child(sock, list(children), msg["spawn"])
                children[os.pidfd_open(pid)] = pid
                send({"pid": pid})


def _child(sock: socket.socket, fds: list[int], env: dict[str, str]) -> None:
    """In the forked process: become a stage process; never returns."""
    code = 1
    try:
        sock.close()
        for fd in fds:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        import msgspec

        from realtime_omni.pipeline.worker import ARGS_ENV, WorkerArgs, worker_main

        args = msgspec.json.decode(os.environ.pop(ARGS_ENV), type=WorkerArgs)
        worker_main(msgspec.structs.replace(args, parent_is_fork_server=True))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":  # started by ForkServer
    serve(int(sys.argv[1]))
