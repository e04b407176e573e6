"""JSON log lines carry the process, and the session and request a record was made in."""

from __future__ import annotations

import asyncio
import io
import json
import logging

from realtime_omni.logs import REQUEST, SESSION, JsonFormatter


def test_json_lines_carry_the_session_and_request_of_their_context() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter("gateway"))
    log = logging.getLogger("rto-test-json")
    log.addHandler(handler)
    log.propagate = False

    async def response() -> None:
        SESSION.set("sess_1")
        REQUEST.set("resp_1")
        log.warning("the %s failed", "response")

    async def main() -> None:
        await asyncio.create_task(response())
        log.error("abort of x", extra={"request_id": "x"})  # outside any session

    asyncio.run(main())
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["message"] == "the response failed" and first["level"] == "warning"
    assert (first["session_id"], first["request_id"], first["process"]) == (
        "sess_1", "resp_1", "gateway",
    )  # fmt: skip
    assert second["request_id"] == "x" and "session_id" not in second
    assert first["ts"].endswith("Z")
