"""`session.update` (and a client secret's, a call's session object): every field of OpenAI's
session object (GA nested, beta flat) is applied to a session's `settings.Settings`, or refused
with an error that names it. No I/O; what each field does is said in `settings.py`.

    s, refused = apply_session_update(settings, session_object, voices)
    # `s` has every field that parsed; `refused` is one ProtocolError per field that did not,
    # its `param` naming the field. One bad field never drops the others.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

from realtime_omni.gateway.protocol.events import ProtocolError, parse_format
from realtime_omni.gateway.protocol.settings import (
    EAGERNESS_SILENCE_MS,
    SESSION_TYPES,
    TRANSCRIPTION_FIELDS,
    Settings,
    Tool,
    Transcription,
    TurnDetection,
    Voices,
)
from realtime_omni.gateway.turns.vad import VadParams

# A session's settings as JSON (instructions, tools, tracing, ...) at most: every
# `session.updated` (a 40-byte `session.update` asks for one) and `session.created` of a resumed
# session echo all of them, so settings grown by several messages of up to 8 MiB each would
# have the server serialise tens of megabytes per tiny request.
MAX_SETTINGS_BYTES = 512 << 10

# ---- parsing ---------------------------------------------------------------------------


def _number(v: Any, param: str, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise ProtocolError(f"{param} = {v!r}: must be a number in [{lo}, {hi}]", param=param)
    return float(v)


def _flag(v: Any, param: str) -> bool:
    if not isinstance(v, bool):
        raise ProtocolError(f"{param} must be true or false", param=param)
    return v


def _string(v: Any, param: str) -> str:
    if not isinstance(v, str):
        raise ProtocolError(f"{param} must be a string", param=param)
    return v


def _unsupported(param: str, why: str) -> ProtocolError:
    return ProtocolError(f"{param}: {why}", code="unsupported_value", param=param)


def parse_truncation(v: Any, param: str) -> str | float:
    """GA `truncation`: "auto", "disabled" or `{type: retention_ratio, retention_ratio}`."""
    if v in ("auto", "disabled"):
        return str(v)
    if isinstance(v, dict) and v.get("type") == "retention_ratio":
        return _number(v.get("retention_ratio"), f"{param}.retention_ratio", 0.01, 1.0)
    raise ProtocolError(
        f"truncation = {v!r}: use 'auto', 'disabled' or "
        "{'type': 'retention_ratio', 'retention_ratio': 0.8}",
        param=param,
    )


class _Fields:
    """Parses fields one by one: each that fails is kept as an error, and the rest go on."""

    def __init__(self) -> None:
        self.refused: list[ProtocolError] = []

    def take(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except ProtocolError as e:
            self.refused.append(e)
            return _MISSING

    def each(
        self, v: dict[str, Any], keys: tuple[str, ...], parse: Callable[..., Any], param: str
    ) -> dict[str, Any]:
        """Those of `keys` that `v` has and `parse(v, key, param)` takes, by key."""
        out = {}
        for key in keys:
            if key in v and (x := self.take(partial(parse, v, key, param))) is not _MISSING:
                out[key] = x
        return out


_MISSING = object()
# The fields whose null is a setting (off); any other field's null leaves it as it is.
NULL_MEANS_OFF = frozenset(
    {
        "turn_detection",
        "transcription",
        "noise_reduction",
        "tracing",
        "input_audio_transcription",
        "input_audio_noise_reduction",
    }
)


def _int_field(v: dict[str, Any], key: str, param: str) -> int:
    return int(_number(v[key], f"{param}.{key}", 0, 10000))


def _optional_int_field(v: dict[str, Any], key: str, param: str) -> int | None:
    return None if v[key] is None else _int_field(v, key, param)


def _flag_field(v: dict[str, Any], key: str, param: str) -> bool:
    return _flag(v[key], f"{param}.{key}")


def parse_turn_detection(
    v: Any, current: TurnDetection | None, f: _Fields, param: str
) -> TurnDetection | object | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ProtocolError(f"{param} must be an object or null", param=param)
    kind = v.get("type", "server_vad")
    if kind not in ("server_vad", "semantic_vad"):
        raise ProtocolError(
            f"{param}.type = {kind!r}: use server_vad, semantic_vad or null",
            code="unsupported_value",
            param=f"{param}.type",
        )
    td = current or TurnDetection()
    vad, turns = td.vad, td.turns
    eagerness: str | None = None
    if kind == "semantic_vad":
        eagerness = v.get("eagerness", "auto")
        if eagerness not in EAGERNESS_SILENCE_MS:
            f.refused.append(
                ProtocolError(
                    f"{param}.eagerness = {eagerness!r}: use low, medium, high or auto",
                    param=f"{param}.eagerness",
                )
            )
            eagerness = td.eagerness or "auto"
        vad = replace(vad, silence_duration_ms=EAGERNESS_SILENCE_MS[eagerness])
    elif td.eagerness is not None:  # back from semantic_vad: its own default silence again
        vad = replace(vad, silence_duration_ms=VadParams().silence_duration_ms)
    if "threshold" in v:
        x = f.take(lambda: _number(v["threshold"], f"{param}.threshold", 0, 1))
        if x is not _MISSING:
            vad = replace(vad, threshold=x)
    # semantic_vad's silence is its eagerness'
    silences = ("silence_duration_ms",) if kind == "server_vad" else ()
    vad = replace(vad, **f.each(v, ("prefix_padding_ms", *silences), _int_field, param))
    turns = replace(
        turns,
        **f.each(v, ("min_interruption_ms", "resume_after_ms"), _int_field, param),
        **f.each(v, ("preemptive_ms",), _optional_int_field, param),
        **f.each(v, ("echo_gate", "echo_gate_aec", "prefill_while_speaking"), _flag_field, param),
    )
    changes = f.each(v, ("create_response", "interrupt_response"), _flag_field, param)
    if "idle_timeout_ms" in v:
        x = v["idle_timeout_ms"]
        if x is not None:
            where = f"{param}.idle_timeout_ms"
            x = f.take(lambda: int(_number(v["idle_timeout_ms"], where, 5000, 30000)))
        if x is not _MISSING:
            changes["idle_timeout_ms"] = x
    return replace(td, vad=vad, turns=turns, eagerness=eagerness, **changes)


def parse_tools(v: Any, param: str) -> tuple[Tool, ...]:
    if not isinstance(v, list):
        raise ProtocolError(f"{param} must be a list", param=param)
    tools = []
    for i, t in enumerate(v):
        where = f"{param}[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            kind = t.get("type") if isinstance(t, dict) else t
            raise _unsupported(where, f"type {kind!r}: only function tools are supported")
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise ProtocolError(f"{where}.name must be a non-empty string", param=f"{where}.name")
        params = t.get("parameters") or {}
        if not isinstance(params, dict):
            raise ProtocolError(f"{where}.parameters must be a JSON schema object", param=where)
        tools.append(Tool(name, str(t.get("description") or ""), params))
    return tuple(tools)


def parse_tool_choice(v: Any, param: str) -> str | Mapping[str, Any]:
    if v in ("auto", "none", "required"):
        return str(v)
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("name"), str):
        return {"type": "function", "name": v["name"]}
    raise ProtocolError(
        f"{param} = {v!r}: use auto, none, required or {{type: function, name}}", param=param
    )


def parse_transcription(v: Any, param: str) -> Transcription | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ProtocolError(f"{param} must be an object or null", param=param)
    out = {}
    for key in ("model", "language", "prompt"):
        if v.get(key) is not None:
            out[key] = _string(v[key], f"{param}.{key}")
    return Transcription(**out)


def parse_noise_reduction(v: Any, param: str, available: bool) -> str | None:
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in ("near_field", "far_field"):
        raise ProtocolError(f"{param}.type must be near_field or far_field", param=param)
    if not available:
        raise _unsupported(
            param, "this server has no noise suppressor (pip install 'realtime-omni[aec]')"
        )
    return str(kind)


def parse_modalities(v: Any, param: str) -> tuple[str, ...]:
    if not isinstance(v, list) or not v or not set(v) <= {"audio", "text"}:
        raise ProtocolError(f'{param} = {v!r}: use ["audio"] or ["text"]', param=param)
    return ("text",) if set(v) == {"text"} else ("audio",)


def apply_session_update(
    s: Settings,
    session: Any,
    voices: Voices | None = None,
    noise_suppressor: bool = False,
    where: str = "session",
) -> tuple[Settings, list[ProtocolError]]:
    """`session.update`'s `session` object (GA nested or beta flat) applied to `s`: the new
    settings, and one error per field refused (the others are applied). `where` names the
    object in errors (`response` for `response.create`'s). A field that is null is left as it
    is, as OpenAI does (its SDK's models send `instructions: null` for "not set"), except where
    null means off (`NULL_MEANS_OFF`). Settings past `MAX_SETTINGS_BYTES` as JSON refuse the
    whole update (ProtocolError `session_too_large`)."""
    if not isinstance(session, dict):
        raise ProtocolError(f"{where} must be an object", param=where)
    voices = voices or Voices()
    f = _Fields()
    changes: dict[str, Any] = {}
    Parse = Callable[[Any, str], Any]

    def take(obj: dict[str, Any], at: str, fields: list[tuple[str, str, Parse]]) -> None:
        for key, into, fn in fields:
            if key in obj and (obj[key] is not None or key in NULL_MEANS_OFF):
                x = f.take(partial(fn, obj[key], f"{at}.{key}"))
                if x is not _MISSING:
                    changes[into] = x

    def turn_detection(v: Any, param: str) -> Any:
        if s.type == "transcription" and isinstance(v, dict):
            f.refused += _answering_fields(v, param)
        return parse_turn_detection(v, s.turn_detection, f, param)

    def noise(v: Any, param: str) -> Any:
        return parse_noise_reduction(v, param, noise_suppressor)

    kind = session.get("type") or s.type
    if kind not in SESSION_TYPES:
        f.refused.append(_unsupported(f"{where}.type", f"{kind!r}: use realtime or transcription"))
    elif kind != s.type:  # its fields mean another session: none of them is applied
        raise ProtocolError(
            f"Passing a {kind} session update event to a {s.type} session is not allowed.",
            code="invalid_parameter",
            param=f"{where}.type",
        )
    if s.type == "transcription":
        session = _transcription_fields(session, where, f)
    take(
        session,
        where,
        [
            ("model", "model", _string),
            ("instructions", "instructions", _string),
            ("temperature", "temperature", lambda v, p: _number(v, p, 0, 2)),
            ("voice", "voice", voices.check),
            ("truncation", "truncation", parse_truncation),
            ("tools", "tools", parse_tools),
            ("tool_choice", "tool_choice", parse_tool_choice),
            ("output_modalities", "output_modalities", parse_modalities),
            ("modalities", "output_modalities", parse_modalities),  # beta
            ("tracing", "tracing", lambda v, p: v),
            ("max_output_tokens", "max_output_tokens", _max_tokens),
            ("max_response_output_tokens", "max_output_tokens", _max_tokens),  # beta
            ("turn_detection", "turn_detection", turn_detection),
            # beta's flat audio fields
            ("input_audio_format", "input_format", parse_format),
            ("output_audio_format", "output_format", parse_format),
            ("input_audio_echo_cancellation", "echo_cancellation", _flag),
            ("input_audio_transcription", "transcription", parse_transcription),
            ("input_audio_noise_reduction", "noise_reduction", noise),
        ],
    )
    for key, why in (
        ("prompt", "stored prompts are not supported; send instructions"),
        ("include", "no extra outputs can be included"),
    ):
        if session.get(key) is not None:
            f.refused.append(_unsupported(f"{where}.{key}", why))
    a = session.get("audio")
    if a is not None and not isinstance(a, dict):
        f.refused.append(ProtocolError(f"{where}.audio must be an object", param=f"{where}.audio"))
    elif a is not None:
        inp, out = a.get("input") or {}, a.get("output") or {}
        for obj, at in ((inp, f"{where}.audio.input"), (out, f"{where}.audio.output")):
            if not isinstance(obj, dict):
                f.refused.append(ProtocolError(f"{at} must be an object", param=at))
        take(
            inp if isinstance(inp, dict) else {},
            f"{where}.audio.input",
            [
                ("format", "input_format", parse_format),
                ("echo_cancellation", "echo_cancellation", _flag),
                ("transcription", "transcription", parse_transcription),
                ("noise_reduction", "noise_reduction", noise),
                ("turn_detection", "turn_detection", turn_detection),
            ],
        )
        take(
            out if isinstance(out, dict) else {},
            f"{where}.audio.output",
            [("format", "output_format", parse_format), ("voice", "voice", voices.check)],
        )
    for obj, at in (
        (session, where),
        ((a.get("output") if isinstance(a, dict) else None) or {}, f"{where}.audio.output"),
    ):
        if isinstance(obj, dict) and obj.get("speed") not in (None, 1, 1.0):
            f.refused.append(_unsupported(f"{at}.speed", "the talker speaks at one pace (1.0)"))
    new = replace(s, **changes)
    if (size := len(json.dumps(new.to_openai("")))) > MAX_SETTINGS_BYTES and changes:
        raise ProtocolError(
            f"{where}: the settings would take {size} bytes as JSON, at most "
            f"{MAX_SETTINGS_BYTES}: shorten the instructions or the tools (nothing was applied)",
            code="session_too_large",
            param=where,
        )
    return new, f.refused


def _transcription_fields(session: dict[str, Any], where: str, f: _Fields) -> dict[str, Any]:
    """A transcription session's object without the fields only a realtime session has (each
    refused by name: `unknown_parameter`, as OpenAI's)."""
    kept = {}
    for key, v in session.items():
        if key in TRANSCRIPTION_FIELDS:
            kept[key] = v
        else:
            f.refused.append(
                ProtocolError(
                    f"Unknown parameter: '{where}.{key}': a transcription session transcribes "
                    "the caller and never answers",
                    code="unknown_parameter",
                    param=f"{where}.{key}",
                )
            )
    a = kept.get("audio")
    if isinstance(a, dict) and "output" in a:
        f.refused.append(
            ProtocolError(
                f"Unknown parameter: '{where}.audio.output': a transcription session has no output",
                code="unknown_parameter",
                param=f"{where}.audio.output",
            )
        )
        kept["audio"] = {k: v for k, v in a.items() if k != "output"}
    return kept


def _answering_fields(v: dict[str, Any], param: str) -> list[ProtocolError]:
    """A transcription session's turn detection asking for an answer: refused by name (the
    session never answers, whatever it is sent: `Settings.__post_init__`)."""
    asks = {
        "create_response": v.get("create_response") is True,
        "interrupt_response": v.get("interrupt_response") is True,
        "idle_timeout_ms": v.get("idle_timeout_ms") is not None,
        "preemptive_ms": v.get("preemptive_ms") is not None,
        "prefill_while_speaking": v.get("prefill_while_speaking") is True,
    }
    return [
        _unsupported(f"{param}.{key}", "a transcription session never answers")
        for key, asked in asks.items()
        if asked
    ]


def _max_tokens(v: Any, param: str) -> int | None:
    return None if v == "inf" else int(_number(v, param, 1, 1 << 20))
