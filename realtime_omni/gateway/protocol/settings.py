"""A session's settings: the values of OpenAI's session object as this server holds them, and
how it shows them (`Settings.to_openai`). No I/O. `session_update.py` applies a client's
session object to them.

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

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from realtime_omni.gateway.protocol.events import PCM16, AudioFormat, ProtocolError
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
