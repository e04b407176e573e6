"""A session's responses: start one for a turn, stream its request's outputs into the playout
and the events, finish it, cancel it (a barge-in, `response.cancel`, a hang-up).

`Responses` owns the active response (at most one), the id of the last one to finish and which
item belongs to which active response; it plays into its session's playout and announces on its
session's event channel. Everything runs in the session's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from realtime_omni.errors import OmniError
from realtime_omni.gateway.media.audio import MODEL_RATE_HZ, Resampler
from realtime_omni.gateway.media.playout import Playout, PlayoutFull
from realtime_omni.gateway.protocol.conversation import Item, new_id
from realtime_omni.gateway.protocol.events import ProtocolError
from realtime_omni.gateway.protocol.settings import Tool
from realtime_omni.gateway.protocol.tool_calls import Call, ToolCallStream
from realtime_omni.logs import REQUEST, SESSION

if TYPE_CHECKING:
    from realtime_omni.gateway.session.driver import Session

log = logging.getLogger(__name__)
# A response's `status`, as OpenAI's `response.done` says it.
Status = Literal["in_progress", "completed", "cancelled", "failed", "incomplete"]

CODEC_FRAME_MS = 80.0  # one talker codec frame of audio (12.5 Hz)


@dataclass
class _Response:
    id: str
    item: Item
    payload: dict[str, Any]
    turn_end: float  # monotonic time the turn ended (speech stop, commit or response.create)
    task: asyncio.Task[None] | None = None
    resampler: Resampler | None = None
    first_audio: float | None = None
    ending: bool = False  # finishing or cancelling: nothing may start either again
    muted: bool = False  # barged in or cancelled: audio still arriving is dropped, not queued
    # Set once its first audio was read out, or it ends without: what waits to go after it.
    audible: asyncio.Event = field(default_factory=asyncio.Event)
    overrides: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None  # the thinker's limit for this response
    text_only: bool = False  # output_modalities ["text"]: no talker, no audio
    calls: list[Item] = field(default_factory=list)  # function calls made, in order
    tool_text: ToolCallStream = field(default_factory=ToolCallStream)
    text_tokens: int = 0  # the thinker's tokens that came out (decode's outputs)
    input_tokens: int = 0  # the prompt's, all of it (its first token says)
    cached_tokens: int = 0  # of which the thinker's kept cache held (not prefilled again)

    def usage(self) -> dict[str, Any]:
        """OpenAI's `usage`: the thinker's tokens; the talker's audio tokens at Qwen3-Omni's
        12.5 codec frames a second."""
        audio = round(self.item.audio_ms / CODEC_FRAME_MS)
        out = self.text_tokens + audio
        return {
            "total_tokens": self.input_tokens + out,
            "input_tokens": self.input_tokens,
            "output_tokens": out,
            "input_token_details": {
                "text_tokens": self.input_tokens,
                "audio_tokens": 0,
                "image_tokens": 0,
                "cached_tokens": self.cached_tokens,
            },
            "output_token_details": {"text_tokens": self.text_tokens, "audio_tokens": audio},
        }


class Responses:
    """One session's responses. `start` one (none may be active), `cancel` it, `barge_in`;
    `active` is the one running, from `response.created` until `response.done`."""

    def __init__(self, session: Session) -> None:
        self.s = session
        self.active: _Response | None = None
        self.last_id: str | None = None  # the id of the last response to finish
        self.item_response: dict[str, str] = {}  # item_id -> response id, while active

    def _truncate(self, truncation: str | float) -> None:
        """Make the conversation fit one turn's payload by its stated rule, telling the client
        of every item it deletes; with truncation disabled, refuse the response instead."""
        if self.s.max_payload_bytes is None:
            return
        room = self.s.max_payload_bytes - (self.s._video.nbytes if self.s._video is not None else 0)
        if truncation == "disabled":
            if self.s.conversation.array_bytes() > room:
                raise ProtocolError(
                    f"the conversation's audio and images ({self.s.conversation.array_bytes()} "
                    f"bytes) exceed what one turn carries ({room} bytes) and truncation is "
                    "disabled. Fix: delete old items, or set truncation to 'auto'",
                    code="context_length_exceeded",
                    param="session.truncation",
                )
            return
        ratio = 1.0 if truncation == "auto" else float(truncation)
        self.s.conversation.fit(room, ratio)
        self.s._announce_dropped()

    def start(self, overrides: dict[str, Any], turn_end: float) -> _Response:
        if self.active is not None:
            raise ProtocolError(
                f"the conversation already has an active response ({self.active.id})",
                code="conversation_already_has_active_response",
            )
        s = self.s.settings
        self._truncate(s.truncation)
        want = self.s._fixed_rate or s.output_format.rate_hz
        if want != self.s.playout.rate_hz and self.s.playout.queued == 0:
            self.s.playout = Playout(want)
        text_only = overrides.get("output_modalities", s.output_modalities) == ("text",)
        payload = self.s.conversation.payload(
            overrides.get("instructions", s.instructions),
            self.s.max_payload_bytes,
            self.s._video,
            temperature=overrides.get("temperature", s.temperature),
            max_tokens=overrides.get("max_output_tokens", s.max_output_tokens),
            speaker=self.s.voices.speaker(voice)
            if (voice := overrides.get("voice", s.voice))
            else None,
            session_id=self.s.id,  # the stages may keep this conversation's state between turns
            text_only=True if text_only else None,
            **_tools_payload(
                overrides.get("tools", s.tools), overrides.get("tool_choice", s.tool_choice)
            ),
        )
        item = Item(new_id("item"), "assistant", status="in_progress")
        item.modality = "text" if text_only else "audio"
        resp = _Response(new_id("resp"), item, payload, turn_end, overrides=overrides)
        resp.max_tokens = payload.get("max_tokens")
        resp.text_only = text_only
        self.active = resp
        self.item_response[item.id] = resp.id
        self.s._emit("response.created", response=self._response_obj(resp, "in_progress"))
        self.s._emit("rate_limits.updated", rate_limits=[])  # as OpenAI at a response's start; none
        prev = self.s._add(item)
        self.s._emit(
            "response.output_item.added", response_id=resp.id, output_index=0, item=item.to_openai()
        )
        self.s._emit("conversation.item.added", previous_item_id=prev, item=item.to_openai())
        self.s._emit(
            "response.content_part.added",
            response_id=resp.id,
            item_id=item.id,
            output_index=0,
            content_index=0,
            part={"type": "text", "text": ""} if text_only else {"type": "audio", "transcript": ""},
        )
        resp.task = asyncio.create_task(self._run(resp))
        self.s._disarm_idle()
        return resp

    def _response_obj(self, resp: _Response, status: Status, details: Any = None) -> dict[str, Any]:
        calls = [c.to_openai() for c in resp.calls]
        return {
            "id": resp.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": [] if status == "in_progress" else [resp.item.to_openai(), *calls],
            "output_modalities": ["text"] if resp.text_only else ["audio"],
            "usage": None if status == "in_progress" else resp.usage(),
        }

    async def _run(self, resp: _Response) -> None:
        SESSION.set(self.s.id)
        REQUEST.set(resp.id)  # the pipeline request id: log lines of the response carry it
        try:
            stream = await self.s.coord.submit(resp.payload, resp.id)
            resp.payload = {}  # the arrays are in the pipeline now
            try:
                it = stream.__aiter__()
                while True:
                    await self._hold_lead()
                    try:
                        out = await it.__anext__()
                    except StopAsyncIteration:
                        break
                    self._on_output(resp, out.data)
            finally:
                # Cancelled (barge-in, cancel, hang-up) or failed: outputs the lead limit left
                # unread hold their credits, even once the request ended in every stage.
                stream.close()
            if resp.resampler is not None:
                self._write_audio(resp, resp.resampler.flush(), None)
            while self.s.playout.queued_of(resp.item.id) > 0:  # done once it has been heard
                self.s.audio_read.clear()
                await self.s.audio_read.wait()
        except (PlayoutFull, ProtocolError):  # the gateway's own limits broken: a bug
            log.exception("response %s failed", resp.id)
            self.s._flush(resp.item.id)
            error = {"type": "server_error", "message": "the server failed; it logged why"}
            self._finish(resp, "failed", {"type": "failed", "error": error})
            return
        except OmniError as e:
            log.warning("response %s failed: %s", resp.id, e)
            self.s._flush(resp.item.id)
            # A stage's own words (a full KV cache, a dead stage): the client is told the cause.
            error = {"type": "server_error", "message": str(e)}
            self._finish(resp, "failed", {"type": "failed", "error": error})
            return
        except Exception:  # a bug: the response fails, and the session takes the next one
            log.exception("response %s failed", resp.id)
            self.s._flush(resp.item.id)
            # Python's own words stay in the log, not with the client.
            error = {"type": "server_error", "message": "the server failed; it logged why"}
            self._finish(resp, "failed", {"type": "failed", "error": error})
            return
        if resp.max_tokens is not None and resp.text_tokens >= resp.max_tokens:
            self._finish(resp, "incomplete", {"type": "incomplete", "reason": "max_output_tokens"})
        else:
            self._finish(resp, "completed", None)

    async def _hold_lead(self) -> None:
        """Wait while the playout queue is `max_lead_ms` ahead of what has been played."""
        while self.s.playout.queued_ms > self.s.max_lead_ms:
            self.s.audio_read.clear()
            await self.s.audio_read.wait()

    def _on_output(self, resp: _Response, data: dict[str, Any]) -> None:
        token_time = data.get("token_time")
        if "token_id" in data:  # one of the thinker's tokens, through decode
            resp.text_tokens += 1
            if "prefill_tokens" in data:  # the first token's: the prompt, as OpenAI counts it
                resp.cached_tokens = int(data.get("cached_tokens", 0))
                resp.input_tokens = int(data["prefill_tokens"]) + resp.cached_tokens
        if "pcm" in data:
            if resp.resampler is None:
                src = int(data.get("sample_rate_hz", MODEL_RATE_HZ))
                resp.resampler = Resampler(src, self.s.playout.rate_hz)
            pcm = np.asarray(data["pcm"], np.float32).reshape(-1)
            self._write_audio(resp, resp.resampler.process(pcm), token_time)
        text = data.get("text") or ""
        if text:
            for piece in resp.tool_text.push(text):
                self._on_piece(resp, piece, token_time)

    def _on_piece(self, resp: _Response, piece: str | Call, token_time: float | None) -> None:
        """Words of the answer, or a function call the model made."""
        if isinstance(piece, Call):
            self._function_call(resp, piece)
            return
        resp.item.add_text(token_time if token_time is not None else time.monotonic(), piece)
        kind = "output_text" if resp.text_only else "output_audio_transcript"
        self.s._emit(
            f"response.{kind}.delta",
            response_id=resp.id,
            item_id=resp.item.id,
            output_index=0,
            content_index=0,
            delta=piece,
        )

    def _function_call(self, resp: _Response, call: Call) -> None:
        """A call the model made: an item of its own after the answer's message, its arguments
        in one delta (the model writes them whole), `completed` at once."""
        item = Item(new_id("item"), "assistant", type="function_call", status="in_progress")
        item.call_id, item.name = f"call_{new_id('c')[2:18]}", call.name
        index = 1 + len(resp.calls)
        resp.calls.append(item)
        ids = {"response_id": resp.id, "output_index": index}
        prev = self.s._add(item, resp.calls[-2].id if len(resp.calls) > 1 else resp.item.id)
        self.s._emit("response.output_item.added", **ids, item=item.to_openai())
        self.s._emit("conversation.item.added", previous_item_id=prev, item=item.to_openai())
        item.arguments, item.status = call.arguments, "completed"
        args = {**ids, "item_id": item.id, "call_id": item.call_id}
        self.s._emit("response.function_call_arguments.delta", **args, delta=call.arguments)
        self.s._emit(
            "response.function_call_arguments.done",
            **args,
            name=item.name,
            arguments=item.arguments,
        )
        self.s._emit("response.output_item.done", **ids, item=item.to_openai())
        self.s._emit("conversation.item.done", item=item.to_openai())

    def _write_audio(self, resp: _Response, pcm: np.ndarray, token_time: float | None) -> None:
        if not len(pcm) or resp.muted:
            return
        self.s.playout.write(resp.item.id, pcm, token_time)
        self.s.audio_written.set()
        resp.item.add_audio(len(pcm) * 1000 / self.s.playout.rate_hz, token_time)

    def _finish(self, resp: _Response, status: Status, details: Any) -> None:
        if self.active is not resp:
            return
        self.active = None
        resp.audible.set()
        # Speech that began over the answer is still judged when the answer ends: a blip (the
        # answer's own echo, a cough) is dropped, not taken for a turn; a paused tail stays
        # paused until then (the policy resumes or flushes it).
        item = resp.item
        self.item_response.pop(item.id, None)
        item.status = "completed" if status == "completed" else "incomplete"
        for piece in resp.tool_text.flush():  # text held back for a tag, a call left open
            self._on_piece(resp, piece, None)
        ids = {"response_id": resp.id, "item_id": item.id, "output_index": 0, "content_index": 0}
        if resp.text_only:
            self.s._emit("response.output_text.done", **ids, text=item.transcript)
            part = {"type": "text", "text": item.transcript}
        else:
            self.s._emit("response.output_audio.done", **ids)
            self.s._emit("response.output_audio_transcript.done", **ids, transcript=item.transcript)
            part = {"type": "audio", "transcript": item.transcript}
        self.s._emit("response.content_part.done", **ids, part=part)
        self.s._emit(
            "response.output_item.done", response_id=resp.id, output_index=0, item=item.to_openai()
        )
        self.s._emit("conversation.item.done", item=item.to_openai())
        self.s._emit("response.done", response=self._response_obj(resp, status, details))
        self.last_id = resp.id
        self.s._arm_idle()

    def barge_in(self) -> None:
        """An interruption: silence from the next read, then cancel in the background."""
        if self.active is not None:
            self.active.muted = True  # outputs arriving before the cancel runs stay unheard
        if not self.s.playout.paused:  # else the pause already silenced it, and was timed
            self.s._barge_at = time.monotonic()
        self.s.playout.paused = False
        self.s._flush()
        rid = self.active.id if self.active is not None else self.last_id
        if rid is not None:
            self.s._emit("output_audio_buffer.cleared", response_id=rid)
        self.s._track(self.cancel("turn_detected"))

    async def cancel(self, reason: str) -> bool:
        """Stop the active response: flush its audio, abort its request in every stage (awaited),
        keep what was played. False when there was none."""
        resp = self.active
        if resp is None or resp.ending:
            return resp is not None
        resp.ending = resp.muted = True
        resp.audible.set()
        self.s._flush(resp.item.id)
        if resp.task is not None:
            resp.task.cancel()
            await asyncio.gather(resp.task, return_exceptions=True)
        t0 = time.monotonic()
        try:
            await self.s.coord.abort(resp.id)
        finally:
            self.s._metric("abort_ms", (time.monotonic() - t0) * 1e3)
            played_ms = self.s.playout.played_ms(resp.item.id)
            if self.s.heard_ms is not None:
                played_ms = min(played_ms, self.s.heard_ms(resp.item.id))
            resp.item.truncate(min(played_ms, resp.item.audio_ms))
            self.s.playout.forget(resp.item.id)
            self._finish(resp, "cancelled", {"type": "cancelled", "reason": reason})
        return True


def _tools_payload(tools: tuple[Tool, ...], choice: Any) -> dict[str, Any]:
    """The request's `tools`, in the shape the checkpoint's chat template takes, and how the
    choice is put to the thinker (`none`: no tools shown; `required` or one function: said in
    `tool_instruction`, which preprocessing adds to the system turn)."""
    if not tools or choice == "none":
        return {}
    out: dict[str, Any] = {
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": dict(t.parameters) or {"type": "object", "properties": {}},
                },
            }
            for t in tools
        ]
    }
    if choice == "required":
        out["tool_instruction"] = "Answer by calling one of the functions."
    elif isinstance(choice, Mapping):
        out["tool_instruction"] = f"Answer by calling the function {choice['name']}."
    return out
