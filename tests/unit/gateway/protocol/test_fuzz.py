"""Hostile input, generated: every HTTP route with bad bodies, headers and query strings, and
client events with wrong types and shapes. Each gets a 4xx or an `error` event naming the
problem: never a 500, never a traceback in the log, never Python's own exception text."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from realtime_omni.gateway.session.driver import Session
from tests.conftest import run
from tests.unit.gateway.app_harness import gateway_server, multipart, offer
from tests.unit.gateway.fakes import FakeCoord

KEY = "sk-fuzz-0123"
SEED = 31
# Python's words: a traceback, or an exception's repr (ValueError('...'), KeyError(...)).
PYTHON_TEXT = re.compile(rb"Traceback|\b[A-Z]\w*(Error|Exception)\(")

ROUTES = [
    ("POST", "/v1/realtime/client_secrets"),
    ("POST", "/v1/realtime/calls"),
    ("POST", "/v1/realtime/calls/sess_x/hangup"),
    ("POST", "/v1/webrtc/offer"),
    ("POST", "/v1/whip"),
    ("DELETE", "/v1/whip/sess_x"),
    ("GET", "/v1/stats"),
    ("GET", "/metrics"),
    ("GET", "/v1/metrics"),
    ("GET", "/readyz"),
    ("GET", "/healthz"),
    ("POST", "/v1/phone/twilio/voice"),
    ("GET", "/"),
]


def deep(n: int) -> Any:
    x: Any = 1
    for i in range(n):
        x = [x] if i % 2 else {"a": x}
    return x


def json_bodies(sdp: str) -> list[Any]:
    """Bodies a route parses as JSON: right shapes with wrong types, deep, odd numbers."""
    return [
        [],
        "x",
        None,
        {"session": "x"},
        {"session": []},
        {"session": {"audio": {"input": "x"}}},
        {"session": {"audio": {"input": "format, turn_detection"}, "output": "voice"}},
        {"session": {"audio": {"output": 5, "input": [1]}}},
        {"session": {"audio": "x"}},
        {"session": {"tools": [{"type": "function", "name": "f", "parameters": deep(60)}]}},
        {"session": deep(200)},
        {"session": {"tools": [{"type": "function", "name": "f", "parameters": deep(900)}]}},
        {"session": {"turn_detection": {"type": "server_vad", "threshold": "high"}}},
        {"session": {"instructions": "\ud800 lone surrogate"}},
        {"session": {"voice": {"name": "x"}}, "expires_after": {"seconds": "600"}},
        {"expires_after": 600},
        {"expires_after": {"seconds": True}},
        {"expires_after": {"seconds": 1e308}},
        {"sdp": sdp, "type": "offer", "session": "x"},
        {"sdp": ["x"], "type": "offer"},
        {
            "sdp": sdp.replace("m=audio", "m=audio 9 UDP/TLS/RTP/SAVPF 999999999999"),
            "type": "offer",
        },
        {"sdp": sdp[: len(sdp) // 2], "type": "offer"},
        {"type": "offer"},
    ]


def raw_bodies(rng: random.Random, sdp: str) -> list[bytes]:
    lines = sdp.split("\r\n")
    shuffled = lines[:]
    rng.shuffle(shuffled)
    return [
        b"",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"session": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"session": {"tracing": ' + b'{"a": ' * 980 + b"1" + b"}" * 980 + b"}}",
        b'{"expires_after": {"seconds": 1e999999}}',
        b'{"session": NaN}',
        b"\xff\xfe\x00garbage",
        bytes(rng.randrange(256) for _ in range(300)),
        "\r\n".join(shuffled).encode(),
        sdp.replace("a=ice-ufrag:", "a=ice-ufrag-").encode(),
        sdp.encode() + b"a=candidate:\xff\r\n",
        b"v=0\r\nm=" + b"audio 9 RTP/AVP 0\r\nm=" * 50 + b"x\r\n",
        b"CallSid=" + "é".encode() * 50 + b"&From=%ZZ&To",
    ]


HEADERS: list[dict[str, str | bytes]] = [
    {"Authorization": b"Bearer \xe9\xff"},
    {"Authorization": "Bearer"},
    {"Authorization": "Bearer  "},
    {"Authorization": f"bearer {KEY}"},
    {"Authorization": f"Bearer {KEY}", "Content-Type": "multipart/form-data"},
    {"Authorization": f"Bearer {KEY}", "Content-Type": "multipart/form-data; boundary="},
    {"Authorization": f"Bearer {KEY}", "Content-Type": "application/sdp; charset=\xff"},
    {"Authorization": f"Bearer {KEY}", "Content-Type": b"\xff/\xfe"},
    {"Authorization": f"Bearer {KEY}", "Origin": b"http://\xff"},
    {"Authorization": f"Bearer {KEY}", "Origin": "null"},
    {"Authorization": f"Bearer {KEY}", "X-Forwarded-Proto": "gopher", "X-Forwarded-Host": "a b"},
    {"Authorization": f"Bearer {KEY}", "Host": b"\xff\xfe"},
    {"Authorization": f"Bearer {KEY}", "Host": "[::1"},
    {"Authorization": f"Bearer {KEY}", "Sec-WebSocket-Protocol": "a,,b, openai-insecure-api-key."},
]

QUERIES = [
    "",
    "?since=nan",
    "?since=-inf",
    "?since=1e999999",
    "?since=%FF",
    f"?token=%FF%FE&token={KEY}",
    "?token=%E2%98%83",
    "?token=",
    "?call_id=%00",
    "?" + "a=1&" * 2000,
]


def test_the_http_routes_never_answer_500_nor_say_pythons_words(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rng = random.Random(SEED)
    sdp = offer()
    auth: dict[str, str | bytes] = {"Authorization": f"Bearer {KEY}"}
    cases: list[tuple[str, str, bytes | None, dict[str, str | bytes]]] = []
    for method, path in ROUTES:
        for data in json_bodies(sdp):
            body = json.dumps(data).encode()
            cases.append((method, path, body, {**auth, "Content-Type": "application/json"}))
        for body in raw_bodies(rng, sdp):
            kind = rng.choice(["application/json", "application/sdp", "text/plain", ""])
            cases.append((method, path, body, {**auth, "Content-Type": kind}))
        for session in (b"[" * 5000, b'{"audio": {"input": "x"}}', b'"x"', b"\xff"):
            for boundary in ("b0undary", rng.choice(["x" * 69, "é", "a b"])):
                body, kind = multipart(sdp, session, boundary)
                cases.append((method, path, body, {**auth, "Content-Type": kind}))
        for headers in HEADERS:
            cases.append((method, path, b"{}", headers))
        for query in QUERIES:
            cases.append((method, path + query, b"{}", auth))
    with gateway_server(keys=KEY, max_sessions=4) as srv:
        for method, path, body, headers in cases:
            status, _, answer = srv.request(method, path, body, headers)
            where = (method, path[:60], (body or b"")[:60], headers)
            assert status < 500, (status, answer[:300], where)
            assert not PYTHON_TEXT.search(answer), (answer[:300], where)
        assert srv.request("GET", "/healthz")[0] == 200  # and it serves on
    errors = [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert errors == [], [r.getMessage() for r in errors[:3]]
    assert len(cases) > 500


def mutations(rng: random.Random) -> list[Any]:
    """Client events of each type with a field replaced by a value of the wrong type."""
    valid: list[dict[str, Any]] = [
        {"type": "session.update", "session": {"instructions": "x", "audio": {"input": {}}}},
        {"type": "session.update", "session": {"tools": [{"type": "function", "name": "f"}]}},
        {"type": "input_audio_buffer.append", "audio": "AAAA"},
        {"type": "input_audio_buffer.commit"},
        {"type": "input_audio_buffer.clear"},
        {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                      "content": [{"type": "input_text",
                                                                   "text": "hi"}]}},
        {"type": "conversation.item.truncate", "item_id": "x", "content_index": 0,
         "audio_end_ms": 0},
        {"type": "conversation.item.delete", "item_id": "x"},
        {"type": "conversation.item.retrieve", "item_id": "x"},
        {"type": "response.create", "response": {"instructions": "x"}},
        {"type": "response.cancel"},
        {"type": "output_audio_buffer.clear"},
    ]  # fmt: skip
    wrong: list[Any] = [
        "x", 5, -1, 1e308, True, None, [], [1, "x"], {}, {"x": 1}, deep(40), "\ud800", "A" * 9,
    ]  # fmt: skip
    out: list[Any] = []
    for event in valid:
        for _ in range(20):
            ev = json.loads(json.dumps(event))
            node = ev
            while True:  # walk down a random path, replace what is there
                keys = (
                    [k for k in node if k != "type" or node is not ev]
                    if isinstance(node, dict)
                    else list(range(len(node)))
                )
                if not keys:
                    break
                k = rng.choice(keys)
                if isinstance(node[k], dict | list) and node[k] and rng.random() < 0.6:
                    node = node[k]
                    continue
                node[k] = rng.choice(wrong)
                break
            out.append(ev)
    return out


def test_client_events_of_the_wrong_shape_get_a_request_error_never_pythons_words() -> None:
    rng = random.Random(SEED)

    async def body() -> None:
        s = Session(FakeCoord(chunks=1))
        await s.start()
        for ev in mutations(rng):
            raw = json.dumps(ev)
            err = await s.handle_text(raw, 1 << 20)
            sent = ([err] if err else []) + [e for e in s.pending_events() if e["type"] == "error"]
            for e in sent:
                assert e["error"]["type"] == "invalid_request_error", (raw[:200], e)
                assert not PYTHON_TEXT.search(json.dumps(e).encode()), (raw[:200], e)
        await s.close()

    run(body(), 60)


def test_a_session_nested_past_pythons_stack_in_a_secret_and_its_call_is_refused() -> None:
    nested = b'{"tracing": ' + b'{"a": ' * 960 + b"1" + b"}" * 960 + b"}"
    sdp = offer()
    with gateway_server(keys=KEY) as srv:
        status, _, raw = srv.request(
            "POST", "/v1/realtime/client_secrets", b'{"session": ' + nested + b"}",
            {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        )  # fmt: skip
        assert status < 500, raw[:300]
        secret = json.loads(raw).get("value", KEY)
        body, kind = multipart(sdp, nested)
        status, _, raw = srv.request(
            "POST", "/v1/realtime/calls", body,
            {"Authorization": f"Bearer {secret}", "Content-Type": kind},
        )  # fmt: skip
        assert status < 500 and not PYTHON_TEXT.search(raw), raw[:300]
