"""A session's responses: start one for a turn, stream its request's outputs into the playout
and the events, finish it, cancel it (a barge-in, `response.cancel`, a hang-up).

`Responses` owns the active response (at most one), the id of the last one to finish and which
item belongs to which active response; it plays into its session's playout and announces on its
session's event channel. A preemptive answer (`speculate`) is computed for a turn that has not
ended yet and `held`: nothing of it is sent or played until `release` makes it the active
response (the turn ended as it was when it started) or `abandon` aborts it unseen (the person
went on). Everything runs in the session's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from realtime_omni.aio import within
from realtime_omni.errors import OmniError
from realtime_omni.gateway.media.audio import MODEL_RATE_HZ, Resampler
from realtime_omni.gateway.media.playout import Playout, PlayoutFull
from realtime_omni.gateway.protocol.conversation import Item, new_id
from realtime_omni.gateway.protocol.events import ProtocolError, error_event
from realtime_omni.gateway.protocol.settings import Tool
from realtime_omni.gateway.protocol.tool_calls import Call
from realtime_omni.gateway.session.response import Response, Status
from realtime_omni.logs import REQUEST, SESSION

if TYPE_CHECKING:
    from realtime_omni.gateway.session.driver import Session

log = logging.getLogger(__name__)
HELD_MS = 480.0  # a held answer computes this much audio ahead, then waits to be released


class Responses:
    """One session's responses. `start` one (none may be active), `cancel` it, `barge_in`;
    `active` is the one running, from `response.created` until `response.done`."""

    def __init__(self, session: Session) -> None:
        self.s = session
        self.active: Response | None = None
        self.held: Response | None = None  # a preemptive answer, computed but not shown
        self._task: asyncio.Task[None] | None = None  # the active (or held) response's
        # Set once the active response's first audio was read out, or it ended without: what
        # waits to go after it (an input transcription) waits on it. A new one per response.
        self.audible = asyncio.Event()
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

    def start(self, overrides: dict[str, Any], turn_end: float) -> Response:
        if self.active is not None:
            raise ProtocolError(
                f"the conversation already has an active response ({self.active.id})",
                code="conversation_already_has_active_response",
            )
        self.abandon()  # a held answer to something else
        self._truncate(self.s.settings.truncation)
        resp = self._new(overrides, turn_end)
        self._open(resp)
        self._task = asyncio.create_task(self._run(resp))
        return resp

    def speculate(self, user: Item, now: float) -> bool:
        """Start the answer to `user` (the turn so far, not in the conversation) and hold it:
        nothing is sent or played. False when none can start now (an answer is active or held,
        or the conversation would have to be truncated to carry the turn)."""
        if self.active is not None or self.held is not None or not self._fits(user):
            return False
        resp = self._new({}, now, extra=user)
        resp.held, resp.user_item_id = True, user.id
        self.held = resp
        self._task = asyncio.create_task(self._run(resp))
        return True

    def prefill(self, user: Item) -> None:
        """Send the conversation and `user` (the turn so far, not in the conversation) to be
        prefilled and kept for the answer: no output, nothing sent to the client. Skipped when
        the conversation would have to be truncated to carry it."""
        if not self._fits(user):
            return
        resp = self._new({}, time.monotonic(), extra=user)
        resp.payload["prefill_only"] = True
        self.s._track(self._prefill(resp))  # a task of the session's: `close` aborts it

    async def _prefill(self, resp: Response) -> None:
        stream = resp.stream = await self.s.coord.submit(resp.payload, resp.id)
        resp.payload = {}
        try:
            async for _ in stream:
                pass
        except asyncio.CancelledError:
            await asyncio.shield(self.s.coord.abort(resp.id))
            raise
        finally:
            stream.close()
        await self._charge(resp, "prefill_compute_ms")

    def _fits(self, user: Item) -> bool:
        """The conversation and `user` go in one payload without truncating it."""
        room = self.s.max_payload_bytes
        if room is None:
            return True
        video = self.s._video.nbytes if self.s._video is not None else 0
        turn = sum(p.audio.nbytes for p in user.parts if p.audio is not None)
        return self.s.conversation.array_bytes() + turn + video <= room

    def release(self, user_item_id: str, turn_end: float) -> bool:
        """The turn `user_item_id` ended as the held answer heard it (its item is in the
        conversation now): that answer becomes the active response, and what it computed is
        sent and played at once. False: no answer to it is held (the caller starts one)."""
        resp = self.held
        if resp is None or resp.user_item_id != user_item_id or self.active is not None:
            return False
        self.held = None
        resp.turn_end = turn_end
        self._open(resp)
        resp.held = False
        for out, token_time in resp.held_out:
            if isinstance(out, np.ndarray):
                self._write_audio(resp, out, token_time)
            else:
                self._on_piece(resp, out, token_time)
        resp.held_out = []
        self.s.audio_read.set()  # its request may run on past the hold
        return True

    def abandon(self) -> asyncio.Task[None] | None:
        """The held answer is not wanted (the person went on talking): its request is aborted
        in every stage, in the background (the task given); nothing of it was or will be sent."""
        resp, self.held = self.held, None
        if resp is None:
            return None
        resp.muted = True
        task, self._task = self._task, None
        return self.s._track(self._discard(resp, task))

    async def _discard(self, resp: Response, task: asyncio.Task[None] | None) -> None:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.s.coord.abort(resp.id)
        await self._charge(resp, "discarded_compute_ms")

    async def _charge(self, resp: Response, metric: str) -> None:
        """Record what the response's request cost the stages, in all, once it is known."""
        stream = resp.stream
        if stream is None or not hasattr(stream, "settled"):
            return
        with contextlib.suppress(TimeoutError):
            await within(stream.settled.wait(), 10.0)
        self.s._metric(metric, 1e3 * sum(stream.compute_s.values()))

    def _new(
        self, overrides: dict[str, Any], turn_end: float, extra: Item | None = None
    ) -> Response:
        """A response to the conversation (and `extra`, a turn not in it yet), not started."""
        s = self.s.settings
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
            extra=extra,
            **_tools_payload(
                overrides.get("tools", s.tools), overrides.get("tool_choice", s.tool_choice)
            ),
        )
        item = Item(new_id("item"), "assistant", status="in_progress")
        item.modality = "text" if text_only else "audio"
        resp = Response(new_id("resp"), item, payload, turn_end, overrides=overrides)
        resp.max_tokens = payload.get("max_tokens")
        resp.text_only = text_only
        return resp

    def _open(self, resp: Response) -> None:
        """`resp` is the active response: announced, its item in the conversation."""
        self.active = resp
        self.audible = asyncio.Event()
        self.item_response[resp.item.id] = resp.id
        self.s._send(resp.opening())
        self.s._send(resp.item_added(self.s._add(resp.item)))
        self.s._disarm_idle()

    async def _run(self, resp: Response) -> None:
        SESSION.set(self.s.id)
        REQUEST.set(resp.id)  # the pipeline request id: log lines of the response carry it
        status: Status = "completed"
        details: Any = None
        try:
            stream = resp.stream = await self.s.coord.submit(resp.payload, resp.id)
            resp.payload = {}  # the arrays are in the pipeline now
            try:
                it = stream.__aiter__()
                while True:
                    await self._hold_lead(resp)
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
            while resp.held:  # all of it computed before its turn ended
                self.s.audio_read.clear()
                await self.s.audio_read.wait()
            while self.s.playout.queued_of(resp.item.id) > 0:  # done once it has been heard
                self.s.audio_read.clear()
                await self.s.audio_read.wait()
        except (PlayoutFull, ProtocolError):  # the gateway's own limits broken: a bug
            log.exception("response %s failed", resp.id)
            status, details = "failed", _failed("the server failed; it logged why")
        except OmniError as e:
            log.warning("response %s failed: %s", resp.id, e)
            # A stage's own words (a full KV cache, a dead stage): the client is told the cause.
            status, details = "failed", _failed(str(e))
        except Exception:  # a bug: the response fails, and the session takes the next one
            log.exception("response %s failed", resp.id)
            # Python's own words stay in the log, not with the client.
            status, details = "failed", _failed("the server failed; it logged why")
        else:
            if resp.max_tokens is not None and resp.text_tokens >= resp.max_tokens:
                status = "incomplete"
                details = {"type": "incomplete", "reason": "max_output_tokens"}
        if resp.ending:
            # Cut meanwhile (a barge-in's flush ends the wait above at once): `_stop` ends it,
            # truncated at what was heard, never as if all of it had been.
            return
        if status == "failed":
            self.s._flush(resp.item.id)
            if resp is self.active:  # an unseen held answer's failure tells nothing
                # The cause, as an `error` too: a client that waits on its events (not only on
                # `response.done`) hears why its call went silent.
                why = details["error"]["message"]
                self.s._send([error_event(why, "response_failed", kind="server_error")])
        self._finish(resp, status, details)

    async def _hold_lead(self, resp: Response) -> None:
        """Wait while the playout queue is `max_lead_ms` ahead of what has been played, or a
        held answer has `HELD_MS` of audio waiting."""
        while self.s.playout.queued_ms > self.s.max_lead_ms or (
            resp.held and resp.held_ms >= HELD_MS
        ):
            self.s.audio_read.clear()
            await self.s.audio_read.wait()

    def _on_output(self, resp: Response, data: dict[str, Any]) -> None:
        token_time = data.get("token_time")
        resp.count(data)
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

    def _on_piece(self, resp: Response, piece: str | Call, token_time: float | None) -> None:
        """Words of the answer, or a function call the model made."""
        if resp.held:
            resp.held_out.append((piece, token_time))
            return
        if isinstance(piece, Call):
            item, after = resp.call(piece)
            self.s._send(resp.call_made(item, piece, self.s._add(item, after)))
            return
        self.s._send([resp.text(piece, token_time if token_time is not None else time.monotonic())])

    def _write_audio(self, resp: Response, pcm: np.ndarray, token_time: float | None) -> None:
        if not len(pcm) or resp.muted:
            return
        if resp.held:
            resp.held_out.append((pcm, token_time))
            resp.held_ms += len(pcm) * 1000 / self.s.playout.rate_hz
            return
        self.s.playout.write(resp.item.id, pcm, token_time)
        self.s.audio_written.set()
        resp.item.add_audio(len(pcm) * 1000 / self.s.playout.rate_hz, token_time)

    def _finish(self, resp: Response, status: Status, details: Any) -> None:
        if resp is self.held:  # failed before its turn ended, unseen: the turn's end starts anew
            self.held = None
            return
        if self.active is not resp:
            return
        self.s._track(self._charge(resp, "answer_compute_ms"))
        self.active = None
        self.audible.set()
        # Speech that began over the answer is still judged when the answer ends: a blip (the
        # answer's own echo, a cough) is dropped, not taken for a turn; a paused tail stays
        # paused until then (the policy resumes or flushes it).
        self.item_response.pop(resp.item.id, None)
        for piece in resp.tool_text.flush():  # text held back for a tag, a call left open
            self._on_piece(resp, piece, None)
        self.s._send(resp.closing(status, details))
        self.last_id = resp.id
        self.s._arm_idle()

    def barge_in(self) -> None:
        """An interruption (the driver has unpaused and timed it): the playout is flushed, once,
        so the next read is silent, and the active response is stopped in the background:
        truncated at what was heard (`conversation.item.truncated`), `response.done` cancelled
        with `turn_detected`, whether its request still ran or only its audio was left."""
        resp = self.active
        halted = resp if resp is not None and self._halt(resp) else None
        self.s._flush()
        rid = resp.id if resp is not None else self.last_id
        if rid is not None:
            self.s._emit("output_audio_buffer.cleared", response_id=rid)
        if halted is not None:  # else a cancel already stops it
            self.s._track(self._stop(halted, "turn_detected", told=True))

    async def cancel(self, reason: str) -> bool:
        """Stop the active response: flush its audio, abort its request in every stage (awaited),
        keep what was played. False when there was none."""
        resp = self.active
        if resp is None or not self._halt(resp):
            return resp is not None
        self.s._flush(resp.item.id)
        await self._stop(resp, reason, told=False)
        return True

    def _halt(self, resp: Response) -> bool:
        """`resp` is ending early: nothing more of it is queued, what waits on its first audio
        goes on, and `_run` leaves its end to `_stop`. False when it was ending already."""
        if resp.ending:
            return False
        resp.ending = resp.muted = True
        self.audible.set()
        return True

    async def _stop(self, resp: Response, reason: str, *, told: bool) -> None:
        """End `resp`, halted and flushed: its task stopped, its request aborted in every stage
        (awaited; one that had ended has nothing left to stop), its item cut to what was heard
        (`told`: the client hears of it in `conversation.item.truncated`, as OpenAI's tells a
        WebRTC client of a barge-in), then `response.done` cancelled with `reason`."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        t0 = time.monotonic()
        try:
            await self.s.coord.abort(resp.id)
        finally:
            self.s._metric("abort_ms", (time.monotonic() - t0) * 1e3)
            heard_ms = self.s.playout.played_ms(resp.item.id)
            if self.s.heard_ms is not None:
                heard_ms = min(heard_ms, self.s.heard_ms(resp.item.id))
            heard_ms = min(heard_ms, int(resp.item.audio_ms))
            resp.item.truncate(heard_ms)
            if told and not resp.text_only:
                self.s._emit(
                    "conversation.item.truncated",
                    item_id=resp.item.id,
                    content_index=0,
                    audio_end_ms=heard_ms,
                )
            self.s.playout.forget(resp.item.id)
            self._finish(resp, "cancelled", {"type": "cancelled", "reason": reason})


def _failed(message: str) -> dict[str, Any]:
    """`response.done`'s `status_details` of a response that failed, in the client's words."""
    return {"type": "failed", "error": {"type": "server_error", "message": message}}


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
