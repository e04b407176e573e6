"""A session's settings and `session.update`: every field of OpenAI's session object (GA nested,
beta flat) is applied, or refused with an error that names it. No I/O.

    s, refused = apply_session_update(settings, session_object, voices)
    # `s` has every field that parsed; `refused` is one ProtocolError per field that did not,
    # its `param` naming the field. One bad field never drops the others.

What each field does here, where it differs from OpenAI:

- `turn_detection`: `server_vad` as OpenAI's (silero-vad), with `idle_timeout_ms`;
  `semantic_vad` maps onto it, its `eagerness` choosing how long a silence ends the turn
  (`EAGERNESS_SILENCE_MS`: low 1000 ms, medium and auto 600, high 300); the answer keeps its
  type and eagerness. Extension fields: `min_interruption_ms`, `resume_after_ms`, `echo_gate`,
  `echo_gate_aec`, `preemptive_ms` (null: off), `prefill_while_speaking`
  (`gateway/turns/policy.py`).
- `voice`: an OpenAI voice name (`alloy`, `ash`, ...) or one of the checkpoint's speakers,
  mapped through `Voices` (the config's `realtime.voices` table); another name is refused,
  naming the voices there are.
- `audio.input.transcription`: each user audio item is transcribed
  (`gateway/session/transcribe.py`); `model`, `language` and `prompt` are kept and shown, the
  server's own transcriber does the work.
- `audio.input.noise_reduction`: `near_field` and `far_field` both run WebRTC's noise
  suppressor (LiveKit's bindings, the `aec` extra) on the microphone; without them it is
  refused.
- `output_modalities`: `["audio"]` or `["text"]` (text only: the talker and code2wav do no
  work for the response).
- `tools` (type `function`), `tool_choice`: given to the thinker in Qwen3-Omni's own tool
  format; MCP tools are refused.
- `type`: `realtime` or `transcription`, fixed when the session is made (`new_settings`; an
  update naming the other type is refused whole, `invalid_parameter`, as OpenAI's). A
  transcription session takes only the input side (`audio.input`, `include`; the rest is
  refused by name, `unknown_parameter`) and never answers (`Settings.__post_init__`).
- `audio.output.speed`: 1.0 only (the talker speaks at one pace); `prompt` (stored prompts)
  and `include` are refused; `tracing` is kept and shown, nothing is traced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Literal

from realtime_omni.gateway.protocol.events import PCM16, AudioFormat, ProtocolError, parse_format
from realtime_omni.gateway.turns.policy import TurnParams
from realtime_omni.gateway.turns.vad import VadParams

# semantic_vad's eagerness -> the silence that ends a turn. OpenAI's low eagerness waits for the
# person to finish a thought; high answers at the first pause.
EAGERNESS_SILENCE_MS = {"low": 1000, "medium": 600, "auto": 600, "high": 300}

# OpenAI's voice names -> Qwen3-Omni's speakers (Chelsie, Ethan, Aiden), by how they sound.
DEFAULT_VOICES = {
    "alloy": "chelsie",
    "coral": "chelsie",
    "sage": "chelsie",
    "shimmer": "chelsie",
    "marin": "chelsie",
    "ash": "ethan",
    "echo": "ethan",
    "cedar": "ethan",
    "ballad": "aiden",
    "verse": "aiden",
}


@dataclass(frozen=True)
class Voices:
    """The voice names a session may ask for: `table` (a name -> a checkpoint speaker) and the
    speakers themselves."""

    table: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_VOICES))

    def speaker(self, voice: str) -> str:
        v = voice.lower()
        return self.table.get(v, v)

    def names(self) -> list[str]:
        return sorted({*self.table, *self.table.values()})

    def check(self, voice: Any, param: str) -> str:
        if not isinstance(voice, str) or voice.lower() not in self.names():
            raise ProtocolError(
                f"{param} = {voice!r} is not a voice of this server; use one of "
                f"{', '.join(self.names())}",
                code="invalid_value",
                param=param,
            )
        return voice


@dataclass(frozen=True)
class TurnDetection:
    """OpenAI's `server_vad` (or `semantic_vad`, mapped onto it), plus how speech over the bot
    is judged (`gateway/turns/policy.py`): `min_interruption_ms` of it is an interruption (0: any
    speech start is), and speech over the bot that falls silent for `resume_after_ms` first
    lets the answer resume."""

    vad: VadParams = field(default_factory=VadParams)
    create_response: bool = True
    interrupt_response: bool = True
    turns: TurnParams = field(default_factory=TurnParams)
    idle_timeout_ms: int | None = None  # no speech this long after an answer: answer anyway
    eagerness: str | None = None  # set: the client asked for semantic_vad

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "server_vad"}
        if self.eagerness is not None:
            out = {"type": "semantic_vad", "eagerness": self.eagerness}
        return {
            **out,
            "threshold": self.vad.threshold,
            "prefix_padding_ms": self.vad.prefix_padding_ms,
            "silence_duration_ms": self.vad.silence_duration_ms,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
            "idle_timeout_ms": self.idle_timeout_ms,
            "min_interruption_ms": self.turns.min_interruption_ms,
            "resume_after_ms": self.turns.resume_after_ms,
            "echo_gate": self.turns.echo_gate,
            "echo_gate_aec": self.turns.echo_gate_aec,
            "preemptive_ms": self.turns.preemptive_ms,
            "prefill_while_speaking": self.turns.prefill_while_speaking,
        }

    def without_answers(self) -> TurnDetection:
        """The same turn detection with nothing that answers or starts an answer: no response
        at a turn's end or after an idle silence, no preemptive answer, no prefill."""
        turns = replace(self.turns, preemptive_ms=None, prefill_while_speaking=False)
        return replace(
            self, create_response=False, interrupt_response=False, idle_timeout_ms=None, turns=turns
        )


@dataclass(frozen=True)
class Tool:
    """A function the model may call: OpenAI's `{type: function, name, description,
    parameters}`."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)

    def to_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": dict(self.parameters),
        }


@dataclass(frozen=True)
class Transcription:
    model: str | None = None
    language: str | None = None
    prompt: str | None = None

    def to_openai(self) -> dict[str, Any]:
        return {"model": self.model, "language": self.language, "prompt": self.prompt}


SessionType = Literal["realtime", "transcription"]
SESSION_TYPES: tuple[SessionType, ...] = ("realtime", "transcription")


@dataclass(frozen=True)
class Settings:
    """What `session.update` can change. `type` cannot change: it is chosen when the session
    is made (`new_settings`)."""

    model: str = "qwen3-omni"
    # "transcription": the caller's turns are transcribed and nothing ever answers (OpenAI's
    # transcription sessions, `/v1/realtime?intent=transcription`).
    type: SessionType = "realtime"
    instructions: str = ""
    voice: str | None = None  # as the client named it; `Voices.speaker` maps it
    temperature: float | None = None
    max_output_tokens: int | None = None
    output_modalities: tuple[str, ...] = ("audio",)
    input_format: AudioFormat = PCM16
    output_format: AudioFormat = PCM16
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    transcription: Transcription | None = None  # None: user audio is not transcribed
    noise_reduction: str | None = None  # "near_field" | "far_field" | None
    tools: tuple[Tool, ...] = ()
    tool_choice: str | Mapping[str, Any] = "auto"  # auto | none | required | {type, name}
    tracing: Any = None  # kept and shown; nothing is traced
    # WebRTC's echo canceller on the microphone's audio (gateway/media/echo_canceller.py; needs
    # `livekit`): an extension field, `audio.input.echo_cancellation` (beta:
    # `input_audio_echo_cancellation`).
    # Off by default: with no echo path (a phone, a headset, a browser cancelling echo itself)
    # it still damps the person talking over the bot by 5-18 dB for seconds, which turn-taking
    # cannot afford; the echo gate (turn_detection.echo_gate) keeps the bot's echo from
    # interrupting it without touching the audio.
    echo_cancellation: bool = False
    # "auto", "disabled", or a retention ratio in (0, 1]: what happens when the conversation's
    # audio and images outgrow one turn's payload (`Conversation.fit`).
    truncation: str | float = "auto"

    def __post_init__(self) -> None:
        # The one place a transcription session is kept from answering: whatever its turn
        # detection says, no turn's end, pause or silence starts an answer or a prefill.
        if self.type == "transcription" and self.turn_detection is not None:
            object.__setattr__(self, "turn_detection", self.turn_detection.without_answers())

    @property
    def text_only(self) -> bool:
        return self.output_modalities == ("text",)

    def truncation_openai(self) -> Any:
        if isinstance(self.truncation, str):
            return self.truncation
        return {"type": "retention_ratio", "retention_ratio": self.truncation}

    def to_openai(self, session_id: str, beta: bool = False) -> dict[str, Any]:
        td = self.turn_detection.to_openai() if self.turn_detection else None
        max_tokens: Any = self.max_output_tokens if self.max_output_tokens is not None else "inf"
        tools = [t.to_openai() for t in self.tools]
        tr = self.transcription.to_openai() if self.transcription else None
        nr = {"type": self.noise_reduction} if self.noise_reduction else None
        if self.type == "transcription":
            return self._transcription_openai(session_id, beta, td, tr, nr)
        if beta:
            return {  # no `model`: beta's type allows only OpenAI's names, or none
                "id": session_id,
                "object": "realtime.session",
                "modalities": ["text"] if self.text_only else ["audio", "text"],
                "instructions": self.instructions,
                "voice": self.voice,
                "input_audio_format": self.input_format.name,
                "input_audio_echo_cancellation": self.echo_cancellation,
                "input_audio_transcription": tr,
                "input_audio_noise_reduction": nr,
                "output_audio_format": self.output_format.name,
                "turn_detection": td,
                "tools": tools,
                "tool_choice": self.tool_choice,
                "temperature": self.temperature,
                "max_response_output_tokens": max_tokens,
            }
        return {
            "type": "realtime",
            "id": session_id,
            "object": "realtime.session",
            "model": self.model,
            "output_modalities": list(self.output_modalities),
            "instructions": self.instructions,
            "audio": {
                "input": {
                    "format": self.input_format.ga(),
                    "turn_detection": td,
                    "transcription": tr,
                    "noise_reduction": nr,
                    "echo_cancellation": self.echo_cancellation,
                },
                "output": {"format": self.output_format.ga(), "voice": self.voice, "speed": 1.0},
            },
            "tools": tools,
            "tool_choice": self.tool_choice,
            "max_output_tokens": max_tokens,
            "truncation": self.truncation_openai(),
            "tracing": self.tracing,
        }

    def _transcription_openai(
        self, session_id: str, beta: bool, td: Any, tr: Any, nr: Any
    ) -> dict[str, Any]:
        """OpenAI's transcription session object: the input side only; turn detection shows
        the VAD's fields and that it never answers."""
        if td is not None:
            td = {k: v for k, v in td.items() if k in _TRANSCRIPTION_VAD_FIELDS}
        head = {"id": session_id, "object": "realtime.transcription_session"}
        if beta:
            return {
                **head,
                "modalities": ["text"],
                "input_audio_format": self.input_format.name,
                "input_audio_transcription": tr,
                "input_audio_noise_reduction": nr,
                "turn_detection": td,
            }
        audio_in = {
            "format": self.input_format.ga(),
            "transcription": tr,
            "noise_reduction": nr,
            "turn_detection": td,
            "echo_cancellation": self.echo_cancellation,
        }
        return {"type": "transcription", **head, "audio": {"input": audio_in}, "include": None}


_TRANSCRIPTION_VAD_FIELDS = frozenset(
    {
        "type",
        "eagerness",
        "threshold",
        "prefix_padding_ms",
        "silence_duration_ms",
        "create_response",
        "interrupt_response",
    }
)
# What a transcription session's object may hold (GA's, and beta's flat input fields); any other
# field is a realtime session's and is refused by name, as OpenAI refuses it.
TRANSCRIPTION_FIELDS = frozenset(
    {
        "type",
        "audio",
        "include",
        "turn_detection",
        "input_audio_format",
        "input_audio_transcription",
        "input_audio_noise_reduction",
        "input_audio_echo_cancellation",
    }
)


def new_settings(kind: SessionType = "realtime", model: str = "qwen3-omni") -> Settings:
    """A new session's settings: a transcription session transcribes from the start."""
    if kind == "transcription":
        return Settings(model=model, type=kind, transcription=Transcription(model=model))
    return Settings(model=model)


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
    changes: dict[str, Any] = {}
    if "threshold" in v:
        x = f.take(lambda: _number(v["threshold"], f"{param}.threshold", 0, 1))
        if x is not _MISSING:
            vad = replace(vad, threshold=x)
    for key in ("prefix_padding_ms", "silence_duration_ms"):
        if key in v and (kind == "server_vad" or key == "prefix_padding_ms"):
            x = f.take(partial(_int_field, v, key, param))
            if x is not _MISSING:
                vad = replace(vad, **{key: x})
    for key in ("min_interruption_ms", "resume_after_ms"):
        if key in v:
            x = f.take(partial(_int_field, v, key, param))
            if x is not _MISSING:
                turns = replace(turns, **{key: x})
    if "preemptive_ms" in v:
        x = (
            None
            if v["preemptive_ms"] is None
            else f.take(partial(_int_field, v, "preemptive_ms", param))
        )
        if x is not _MISSING:
            turns = replace(turns, preemptive_ms=x)
    for key in ("echo_gate", "echo_gate_aec", "prefill_while_speaking"):
        if key in v:
            x = f.take(partial(_flag_field, v, key, param))
            if x is not _MISSING:
                turns = replace(turns, **{key: x})
    for key in ("create_response", "interrupt_response"):
        if key in v:
            x = f.take(partial(_flag_field, v, key, param))
            if x is not _MISSING:
                changes[key] = x
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
    null means off (`NULL_MEANS_OFF`)."""
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
    return replace(s, **changes), f.refused


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
