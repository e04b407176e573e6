"""Input transcription: each user audio item, with `audio.input.transcription` set, is
transcribed by the thinker itself, and the client gets
`conversation.item.input_audio_transcription.delta`s, then `.completed` (or `.failed`).

Why the thinker: Qwen3-Omni hears the audio it answers; asking it to write down what was said is
one more request through the stages already loaded (preprocessing, the audio encoder, the
thinker, decode; text only, so the talker and code2wav do nothing), with no second model to
load, place and keep in memory. It is low-priority work: a transcription waits until the
answer to its turn has sent its first audio (or ended), so it never delays the first audio it
would compete with in the thinker's prefill, and a session runs one transcription at a time.
A transcription lives only as long as its item: an item deleted or dropped by the session's
bounds cancels its transcription, queued or running (aborted in the stages), so the audio that
queued transcriptions hold is always audio `max_session_bytes` counts in the conversation.
The session's `transcription.language` and `prompt` are put to the thinker as hints; `model`
is kept and shown, not used. What each transcription cost each stage (its stream's `compute_s`)
is the session metric `transcription_compute_ms.<stage>`: a text-only request gives the talker
and code2wav no forward, and this is where that shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from realtime_omni.aio import within
from realtime_omni.errors import OmniError
from realtime_omni.gateway.protocol.conversation import Item, new_id

if TYPE_CHECKING:
    from realtime_omni.gateway.protocol.settings import Transcription
    from realtime_omni.gateway.session.driver import Session

log = logging.getLogger(__name__)
INSTRUCTION = (
    "Transcribe the user's audio exactly as spoken, in the language spoken. Write only the "
    "words, nothing else."
)
MAX_TOKENS = 256


def request(audio: np.ndarray, tr: Transcription | None = None) -> dict[str, Any]:
    """The pipeline request that transcribes `audio` (16 kHz float32): the thinker alone, text
    only (nothing for the talker and code2wav), greedy; the session's language and prompt as
    hints. `benchmarks/transcription_wer.py` sends the same."""
    hints = [INSTRUCTION]
    if tr is not None and tr.language:
        hints.append(f"The language is {tr.language}.")
    if tr is not None and tr.prompt:
        hints.append(f"Context: {tr.prompt}")
    return {
        "messages": [
            {"role": "system", "content": " ".join(hints)},
            {"role": "user", "content": [{"type": "audio", "audio": "audio_0"}]},
        ],
        "audio_0": audio,
        "text_only": True,
        "temperature": 0.0,
        "max_tokens": MAX_TOKENS,
    }


class Transcriptions:
    """One session's input transcriptions: `later(item)` when a user audio item is committed,
    `cancel(item_id)` when one leaves the conversation."""

    def __init__(self, session: Session) -> None:
        self.s = session
        self._lock = asyncio.Lock()  # one input transcription at a time
        # item_id -> its transcription, queued or running: one per user audio item still in
        # the conversation (deleting the item cancels it), so their audio is the items' own.
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def later(self, item: Item) -> None:
        """Transcribe a committed user audio item, in the background, if the session asks."""
        if (
            self.s.settings.transcription is not None
            and item.parts
            and item.parts[0].audio is not None
        ):
            item_id = item.id  # not the item: the callback outlives the task
            t = self._tasks[item_id] = self.s._track(self._transcribe(item))
            t.add_done_callback(lambda _: self._tasks.pop(item_id, None))

    def cancel(self, item_id: str) -> None:
        """The item left the conversation: its transcription, if any, stops (no event: the
        client is told the item was deleted) and lets go of its audio."""
        t = self._tasks.pop(item_id, None)
        if t is not None:
            t.cancel()

    async def _transcribe(self, item: Item) -> None:
        async with self._lock:  # one at a time per session, in turn order
            # The answer's first audio goes first.
            responses = self.s.responses
            while responses.active is not None and not responses.audible.is_set():
                await responses.audible.wait()
            await self._run(item)

    async def _run(self, item: Item) -> None:
        assert item.parts[0].audio is not None  # `later` takes audio items only
        payload = request(item.parts[0].audio, self.s.settings.transcription)
        rid, ids = new_id("tr"), {"item_id": item.id, "content_index": 0}
        text: list[str] = []
        usage = {"input_tokens": 0, "output_tokens": 0}
        done = False
        try:
            stream = await self.s.coord.submit(payload, rid)
            try:
                async for out in stream:
                    data: dict[str, Any] = out.data
                    if "token_id" in data:
                        usage["output_tokens"] += 1
                        usage["input_tokens"] = int(
                            data.get("prefill_tokens", usage["input_tokens"])
                        )
                    if data.get("text"):
                        text.append(data["text"])
                        self.s._emit(
                            "conversation.item.input_audio_transcription.delta",
                            **ids, delta=data["text"],
                        )  # fmt: skip
            finally:
                stream.close()
            done = True
            self.s._track(self._charge(stream))
        except OmniError as e:
            done = True  # failed in the stages: nothing is left there
            log.warning("transcription of %s failed: %s", item.id, e)
            error = {
                "type": "transcription_error",
                "code": "transcription_failed",
                "message": str(e),
            }
            self.s._emit("conversation.item.input_audio_transcription.failed", **ids, error=error)
            return
        finally:
            if not done:  # cancelled (the session closed): nothing may stay in the stages
                await asyncio.shield(self.s.coord.abort(rid))
        transcript = "".join(text).strip()
        item.parts[0].text = transcript
        total = usage["input_tokens"] + usage["output_tokens"]
        self.s._emit(
            "conversation.item.input_audio_transcription.completed",
            **ids,
            transcript=transcript,
            usage={"type": "tokens", **usage, "total_tokens": total},
        )

    async def _charge(self, stream: Any) -> None:
        """Record what the transcription cost each stage, once every stage has said."""
        if not hasattr(stream, "settled"):
            return
        with contextlib.suppress(TimeoutError):
            await within(stream.settled.wait(), 10.0)
        for stage, seconds in stream.compute_s.items():
            self.s._metric(f"transcription_compute_ms.{stage}", 1e3 * seconds)
