"""One session's conversation: its items, their OpenAI shapes, truncation, and the pipeline
payload a turn becomes. No I/O.

An assistant item's transcript is kept as (token_time, text) pieces and its audio as chunk marks
(audio_ms, token_time): cutting the audio at `audio_end_ms` keeps the text of every token whose
audio had begun by then, so the conversation remembers what the person heard, not what was made.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_ITEMS = 256  # older items are dropped from the context past this
# `previous_item_id` that puts an item first (OpenAI's word; LiveKit's plugin sends it for the
# first item of a chat context it mirrors).
ROOT = "root"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


@dataclass
class Part:
    kind: str  # "text" | "audio" | "image"
    text: str = ""  # a text part's; an audio part's transcript, once made
    audio: np.ndarray | None = None  # 16 kHz mono float32 (user audio)
    image: np.ndarray | None = None  # uint8 [H, W, 3]


@dataclass
class Item:
    id: str
    role: str  # "user" | "assistant" | "system"; a function call "assistant", its output "tool"
    parts: list[Part] = field(default_factory=list)
    status: str = "completed"
    type: str = "message"  # | "function_call" | "function_call_output"
    modality: str = "audio"  # an assistant message: "audio" (spoken) or "text" (text only)
    call_id: str = ""  # a function call and its output
    name: str = ""  # a function call's
    arguments: str = ""  # a function call's, JSON text
    output: str = ""  # a function call output's
    # assistant only
    pieces: list[tuple[float, str]] = field(default_factory=list)  # (token_time, text)
    marks: list[tuple[float, float]] = field(default_factory=list)  # (audio_ms, token_time)
    audio_ms: float = 0.0  # audio made (or kept, after a truncation)

    @property
    def transcript(self) -> str:
        return "".join(t for _, t in self.pieces)

    def add_text(self, token_time: float, text: str) -> None:
        self.pieces.append((token_time, text))

    def add_audio(self, ms: float, token_time: float | None) -> None:
        if token_time is not None:
            self.marks.append((self.audio_ms, token_time))
        self.audio_ms += ms

    def truncate(self, audio_end_ms: float) -> None:
        """Keep the first `audio_end_ms` of the audio and the text that was heard with it."""
        if audio_end_ms > self.audio_ms + 1e-6:
            raise ValueError(
                f"audio_end_ms {audio_end_ms:.0f} is past the item's audio ({self.audio_ms:.0f} ms)"
            )
        heard = [t for ms, t in self.marks if ms < audio_end_ms]
        cut = max(heard) if heard else float("-inf")
        if self.marks:  # without marks there is no timing to cut the text by
            self.pieces = [(t, s) for t, s in self.pieces if t <= cut]
        self.marks = [(ms, t) for ms, t in self.marks if ms < audio_end_ms]
        self.audio_ms = audio_end_ms

    def to_openai(self) -> dict[str, Any]:
        """GA's shape (`protocol.for_beta` makes beta's of it)."""
        base = {"id": self.id, "object": "realtime.item", "type": self.type, "status": self.status}
        if self.type == "function_call":
            return {**base, "call_id": self.call_id, "name": self.name, "arguments": self.arguments}
        if self.type == "function_call_output":
            return {**base, "call_id": self.call_id, "output": self.output}
        content: list[dict[str, Any]] = []
        if self.role == "assistant" and self.modality == "text":
            content.append({"type": "output_text", "text": self.transcript})
        elif self.role == "assistant":
            content.append({"type": "output_audio", "transcript": self.transcript})
        for p in self.parts:
            if p.kind == "text":
                content.append({"type": "input_text", "text": p.text})
            elif p.kind == "audio":
                content.append({"type": "input_audio", "transcript": p.text or None})
            elif p.kind == "image":
                content.append({"type": "input_image"})
        return {**base, "role": self.role, "content": content}


MAX_BYTES = 32 << 20  # a session's audio, images and text (8 min of 16 kHz float32 audio)


def _array_bytes(item: Item) -> int:
    return sum(
        (p.audio.nbytes if p.audio is not None else 0)
        + (p.image.nbytes if p.image is not None else 0)
        for p in item.parts
    )


def _held_bytes(item: Item) -> int:
    """What an item holds: its arrays and its text, a byte a character (what a client sent of
    it; 12 items of 7 MiB of text were all kept when only arrays counted)."""
    text = sum(len(p.text) for p in item.parts) + sum(len(t) for _, t in item.pieces)
    return _array_bytes(item) + text + len(item.arguments) + len(item.output)


class Conversation:
    """The items of one session, bounded: past `max_items` items or `max_bytes` of audio,
    images and text the oldest go; their ids wait in `dropped` for the session to announce."""

    def __init__(self, max_items: int = MAX_ITEMS, max_bytes: int = MAX_BYTES) -> None:
        self.items: list[Item] = []
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.dropped: list[str] = []

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Insert after `previous_item_id` (default: at the end; `"root"`: first, as OpenAI's);
        returns the id it follows, None when first."""
        at = len(self.items)
        if previous_item_id == ROOT:
            at = 0
        elif previous_item_id is not None:
            at = self.index(previous_item_id) + 1
        prev = self.items[at - 1].id if at > 0 else None
        self.items.insert(at, item)
        self._shed(self.max_items, self.max_bytes, keep=item, size=_held_bytes)
        return prev

    def _shed(
        self, max_items: int, max_bytes: float, keep: Item, size: Callable[[Item], int]
    ) -> None:
        """Drop whole items oldest first, never `keep`, while there are more than `max_items`
        or they take more than `max_bytes` by `size`; their ids go to `dropped`."""
        total = sum(size(it) for it in self.items)
        while len(self.items) > 1 and (len(self.items) > max_items or total > max_bytes):
            old = self.items.pop(0 if self.items[0] is not keep else 1)
            total -= size(old)
            self.dropped.append(old.id)

    def take_dropped(self) -> list[str]:
        gone, self.dropped = self.dropped, []
        return gone

    def index(self, item_id: str) -> int:
        for i, it in enumerate(self.items):
            if it.id == item_id:
                return i
        raise KeyError(item_id)

    def get(self, item_id: str) -> Item:
        return self.items[self.index(item_id)]

    def delete(self, item_id: str) -> None:
        del self.items[self.index(item_id)]

    @property
    def last_id(self) -> str | None:
        return self.items[-1].id if self.items else None

    def array_bytes(self) -> int:
        return sum(_array_bytes(it) for it in self.items)

    def fit(self, max_bytes: int, retention_ratio: float = 1.0) -> None:
        """The truncation rule: when the conversation's audio and images exceed `max_bytes`
        (what one turn's payload may carry), delete whole items oldest first until they take at
        most `retention_ratio` x `max_bytes`; their ids go to `dropped`. The newest item is
        never deleted (a turn of it alone that is too large fails its response). A ratio below 1
        drops more at once, so the kept history stays one prefix for several turns and the
        stages' kept caches keep serving it."""
        if self.items and self.array_bytes() > max_bytes:
            self._shed(
                self.max_items, retention_ratio * max_bytes, self.items[-1], size=_array_bytes
            )

    def payload(
        self,
        instructions: str = "",
        max_bytes: int | None = None,
        image: np.ndarray | None = None,
        extra: Item | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """The request payload of preprocessing.py's contract: `messages` and named arrays.

        `image` (the latest camera frame) joins the last user message. Arrays beyond
        `max_bytes` are left out oldest first (the entry edge's slot size bounds a payload).
        `extra`: an item after the conversation's, not in it (a turn still being spoken).
        """
        arrays: list[tuple[int, int, Part]] = []  # (message index, part index, part)
        messages: list[dict[str, Any]] = []
        if instructions:
            messages.append({"role": "system", "content": instructions})
        items = [*self.items, extra] if extra is not None else self.items
        last_user = max((i for i, it in enumerate(items) if it.role == "user"), default=-1)
        for i, it in enumerate(items):
            parts = list(it.parts)
            if i == last_user and image is not None:
                parts.append(Part("image", image=image))
            if it.type == "function_call":  # the checkpoint's chat template renders the call
                call = {"name": it.name, "arguments": _json_object(it.arguments)}
                prev = messages[-1] if messages else None
                if prev is not None and prev["role"] == "assistant" and "tool_calls" in prev:
                    prev["tool_calls"].append({"type": "function", "function": call})
                elif prev is not None and prev["role"] == "assistant":
                    prev["tool_calls"] = [{"type": "function", "function": call}]
                else:
                    messages.append(
                        {"role": "assistant", "content": "", "tool_calls": [
                            {"type": "function", "function": call}]}
                    )  # fmt: skip
                continue
            if it.type == "function_call_output":
                messages.append({"role": "tool", "content": it.output})
                continue
            if it.role == "assistant":
                if it.transcript:
                    messages.append({"role": "assistant", "content": it.transcript})
                continue
            content = []
            for p in parts:
                if p.kind == "text":
                    content.append({"type": "text", "text": p.text})
                else:
                    arrays.append((len(messages), len(content), p))
                    content.append({"type": p.kind})
            if content:
                messages.append({"role": it.role, "content": content})
        payload: dict[str, Any] = {}
        budget = max_bytes if max_bytes is not None else float("inf")
        keep: set[tuple[int, int]] = set()
        for mi, ci, p in reversed(arrays):  # newest first
            a = p.audio if p.kind == "audio" else p.image
            assert a is not None
            if a.nbytes <= budget:
                budget -= a.nbytes
                keep.add((mi, ci))
        counts = {"audio": 0, "image": 0}
        for mi, ci, p in arrays:
            part = messages[mi]["content"][ci]
            if (mi, ci) not in keep:
                part["drop"] = True
                continue
            name = f"{p.kind}_{counts[p.kind]}"
            counts[p.kind] += 1
            part[p.kind] = name
            payload[name] = p.audio if p.kind == "audio" else p.image
        for msg in messages:
            if isinstance(msg["content"], list):
                msg["content"] = [c for c in msg["content"] if not c.get("drop")]
        payload["messages"] = [m for m in messages if m["content"] or m.get("tool_calls")]
        payload.update({k: v for k, v in fields.items() if v is not None})
        return payload


def _json_object(text: str) -> Any:
    """A function call's arguments as the chat template wants them: the parsed object (its
    JSON text as it was, if it does not parse)."""
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        return text
