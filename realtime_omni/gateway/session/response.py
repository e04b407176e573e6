"""One response's state and the OpenAI server events it makes, from `response.created` to
`response.done`. No I/O, no asyncio: `Responses` (responses.py) runs the response's request,
plays its audio, adds its items to the conversation and emits what these methods return, in
order.

    resp = Response(new_id("resp"), item, payload, turn_end)
    emit(resp.opening())                  # response.created, rate_limits.updated
    prev = conversation.add(resp.item)
    emit(resp.item_added(prev))           # the answer's item and its content part
    emit([resp.text(piece, now)])         # a delta of its words
    item, after = resp.call(call)         # a function call the model made: an item of its own
    emit(resp.call_made(item, call, conversation.add(item, after)))
    emit(resp.closing("completed", None)) # ... response.done
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from realtime_omni.gateway.media.audio import Resampler
from realtime_omni.gateway.protocol.conversation import Item, new_id
from realtime_omni.gateway.protocol.tool_calls import Call, ToolCallStream

Event = dict[str, Any]  # a server event: `type` and its fields, no `event_id` yet
# A response's `status`, as OpenAI's `response.done` says it.
Status = Literal["in_progress", "completed", "cancelled", "failed", "incomplete"]
CODEC_FRAME_MS = 80.0  # one talker codec frame of audio (12.5 Hz)


@dataclass
class Response:
    id: str
    item: Item  # the answer's message
    payload: dict[str, Any]  # the request's, until it is submitted
    turn_end: float  # monotonic time the turn ended (speech stop, commit or response.create)
    resampler: Resampler | None = None  # the model's audio to the playout's rate
    first_audio: float | None = None  # when its first audio was read out
    ending: bool = False  # finishing or cancelling: nothing may start either again
    muted: bool = False  # barged in or cancelled: audio still arriving is dropped, not queued
    overrides: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None  # the thinker's limit for this response
    text_only: bool = False  # output_modalities ["text"]: no talker, no audio
    calls: list[Item] = field(default_factory=list)  # function calls made, in order
    tool_text: ToolCallStream = field(default_factory=ToolCallStream)
    text_tokens: int = 0  # the thinker's tokens that came out (decode's outputs)
    input_tokens: int = 0  # the prompt's, all of it (its first token says)
    cached_tokens: int = 0  # of which the thinker's kept cache held (not prefilled again)
    # A preemptive answer (`turns/preempt.py`) computed before its turn ended: nothing of it
    # is sent or played while `held`; its outputs wait in `held_out` (audio at the playout's
    # rate with its token time, or the answer's text pieces and calls) until it is released.
    held: bool = False
    user_item_id: str | None = None  # the turn it answers
    held_out: list[tuple[Any, float | None]] = field(default_factory=list)
    held_ms: float = 0.0  # the audio in `held_out`
    stream: Any = None  # its request's stream, once submitted (what it cost: `compute_s`)

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

    def as_openai(self, status: Status, details: Any = None) -> dict[str, Any]:
        """OpenAI's `realtime.response` object."""
        calls = [c.to_openai() for c in self.calls]
        return {
            "id": self.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": [] if status == "in_progress" else [self.item.to_openai(), *calls],
            "output_modalities": ["text"] if self.text_only else ["audio"],
            "usage": None if status == "in_progress" else self.usage(),
            "metadata": self.overrides.get("metadata"),  # response.create's, echoed
        }

    def opening(self) -> list[Event]:
        """The response starts (before its item joins the conversation)."""
        return [
            {"type": "response.created", "response": self.as_openai("in_progress")},
            {"type": "rate_limits.updated", "rate_limits": []},  # as OpenAI's; none here
        ]

    def item_added(self, previous_item_id: str | None) -> list[Event]:
        """Its item joined the conversation after `previous_item_id`."""
        item = self.item
        empty = (
            {"type": "text", "text": ""} if self.text_only else {"type": "audio", "transcript": ""}
        )
        return [
            {
                "type": "response.output_item.added",
                "response_id": self.id,
                "output_index": 0,
                "item": item.to_openai(),
            },
            {
                "type": "conversation.item.added",
                "previous_item_id": previous_item_id,
                "item": item.to_openai(),
            },
            {
                "type": "response.content_part.added",
                "response_id": self.id,
                "item_id": item.id,
                "output_index": 0,
                "content_index": 0,
                "part": empty,
            },
        ]

    def count(self, data: dict[str, Any]) -> None:
        """Count the tokens an output of the pipeline carries."""
        if "token_id" in data:  # one of the thinker's tokens, through decode
            self.text_tokens += 1
            if "prefill_tokens" in data:  # the first token's: the prompt, as OpenAI counts it
                self.cached_tokens = int(data.get("cached_tokens", 0))
                self.input_tokens = int(data["prefill_tokens"]) + self.cached_tokens

    def text(self, piece: str, token_time: float) -> Event:
        """Words of the answer, made at `token_time`."""
        self.item.add_text(token_time, piece)
        kind = "output_text" if self.text_only else "output_audio_transcript"
        return {
            "type": f"response.{kind}.delta",
            "response_id": self.id,
            "item_id": self.item.id,
            "output_index": 0,
            "content_index": 0,
            "delta": piece,
        }

    def call(self, call: Call) -> tuple[Item, str]:
        """A function call the model made: its item (in progress), and the item it follows
        in the conversation (the answer's message, or the call before it)."""
        item = Item(new_id("item"), "assistant", type="function_call", status="in_progress")
        item.call_id, item.name = f"call_{new_id('c')[2:18]}", call.name
        self.calls.append(item)
        after = self.calls[-2].id if len(self.calls) > 1 else self.item.id
        return item, after

    def call_made(self, item: Item, call: Call, previous_item_id: str | None) -> list[Event]:
        """The call's item joined the conversation: its arguments in one delta (the model
        writes them whole), `completed` at once."""
        ids = {"response_id": self.id, "output_index": 1 + self.calls.index(item)}
        out: list[Event] = [
            {"type": "response.output_item.added", **ids, "item": item.to_openai()},
            {
                "type": "conversation.item.added",
                "previous_item_id": previous_item_id,
                "item": item.to_openai(),
            },
        ]
        item.arguments, item.status = call.arguments, "completed"
        args = {**ids, "item_id": item.id, "call_id": item.call_id}
        out += [
            {"type": "response.function_call_arguments.delta", **args, "delta": call.arguments},
            {
                "type": "response.function_call_arguments.done",
                **args,
                "name": item.name,
                "arguments": item.arguments,
            },
            {"type": "response.output_item.done", **ids, "item": item.to_openai()},
            {"type": "conversation.item.done", "item": item.to_openai()},
        ]
        return out

    def closing(self, status: Status, details: Any) -> list[Event]:
        """The response ended (its held-back text already flushed): its item is done, then
        `response.done`."""
        item = self.item
        item.status = "completed" if status == "completed" else "incomplete"
        ids = {"response_id": self.id, "item_id": item.id, "output_index": 0, "content_index": 0}
        out: list[Event]
        if self.text_only:
            out = [{"type": "response.output_text.done", **ids, "text": item.transcript}]
            part = {"type": "text", "text": item.transcript}
        else:
            out = [
                {"type": "response.output_audio.done", **ids},
                {
                    "type": "response.output_audio_transcript.done",
                    **ids,
                    "transcript": item.transcript,
                },
            ]
            part = {"type": "audio", "transcript": item.transcript}
        return [
            *out,
            {"type": "response.content_part.done", **ids, "part": part},
            {
                "type": "response.output_item.done",
                "response_id": self.id,
                "output_index": 0,
                "item": item.to_openai(),
            },
            {"type": "conversation.item.done", "item": item.to_openai()},
            {"type": "response.done", "response": self.as_openai(status, details)},
        ]
