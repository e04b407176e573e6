"""Logging for the server and its stage processes: plain text, or one JSON object per line.

`setup()` configures the root logger from `REALTIME_OMNI_LOG_FORMAT` (`text`, the default, or
`json`) and `REALTIME_OMNI_LOG_LEVEL` (default INFO); `realtime-omni serve --log-format json`
sets the former, and the stage processes it starts inherit it. A JSON line carries `ts`,
`level`, `logger`, `message`, `process` (the stage process's name, or `gateway`), and
`session_id` / `request_id` when the record is made within a session or a request (the context
variables below, or `extra={"request_id": ...}`), so one turn can be followed through the
gateway, the coordinator and every stage: a response's id is its pipeline request id.
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextvars import ContextVar

SESSION: ContextVar[str | None] = ContextVar("session_id", default=None)
REQUEST: ContextVar[str | None] = ContextVar("request_id", default=None)
FORMAT_ENV, LEVEL_ENV = "REALTIME_OMNI_LOG_FORMAT", "REALTIME_OMNI_LOG_LEVEL"


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "process": self.process,
        }
        for key, var in (("session_id", SESSION), ("request_id", REQUEST)):
            value = getattr(record, key, None) or var.get()
            if value:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup(process: str = "gateway") -> None:
    fmt = os.environ.get(FORMAT_ENV, "text")
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(process))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {process} %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get(LEVEL_ENV, "INFO").upper())
