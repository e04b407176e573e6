"""Every server event as the client got it, one JSON line each: for debugging an integration
(`serve --event-log PATH`) and for the tests that check each event against the `openai` SDK's
types.

    log = EventLog.open("events.jsonl")   # None for no path
    log.write(session_id, "websocket", beta=False, event=event)

Each line is `{"session", "transport", "beta", "event"}`. Audio stays out of it: a delta's
base64 is replaced by its length (`"<n base64 chars>"`, still a string), so a long call writes
kilobytes, not its audio. Lines are flushed as written; the file is appended to, and only its
owner may read it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

_AUDIO_FIELDS = ("delta", "audio")


class EventLog:
    def __init__(self, f: IO[str]) -> None:
        self._f = f

    @classmethod
    def open(cls, path: str | Path | None) -> EventLog | None:
        """The log at `path`, for the owner alone to read (0600: it holds what callers said,
        as text, and the sessions' instructions), appended to; None for no path."""
        if not path:
            return None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)  # a file made before keeps its own mode otherwise
        return cls(os.fdopen(fd, "a", encoding="utf-8"))

    def write(self, session: str, transport: str, beta: bool, event: dict[str, Any]) -> None:
        kind = str(event.get("type", ""))
        if "audio" in kind and not kind.endswith("transcript.delta"):
            event = {
                k: f"<{len(v)} base64 chars>" if k in _AUDIO_FIELDS and isinstance(v, str) else v
                for k, v in event.items()
            }
        line = {"session": session, "transport": transport, "beta": beta, "event": event}
        self._f.write(json.dumps(line) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()
