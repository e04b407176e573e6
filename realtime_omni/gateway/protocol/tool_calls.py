"""The thinker's text split into what it says and the function calls it makes, as Qwen3-Omni's
chat template asks for them: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. No I/O.

    calls = ToolCallStream()
    for piece in calls.push(delta):        # each text delta as decode sends it
        if isinstance(piece, str): ...     # words of the answer
        else: ...                          # a Call(name, arguments as JSON text)
    calls.flush()                          # at the end: text held back for a tag that never came

A tag split across deltas is held back until it is whole, so no part of a call reaches the
answer's text. The thinker stops speaking at `<tool_call>` (thinker.py), so what follows it is
never heard either. A call whose JSON does not parse, or names no function, is dropped with a
warning (`malformed`): there is nothing a client could run.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)
OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI's events carry it


class ToolCallStream:
    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self.malformed: list[str] = []

    def push(self, text: str) -> list[str | Call]:
        self._buf += text
        out: list[str | Call] = []
        while True:
            tag = CLOSE if self._in_call else OPEN
            at = self._buf.find(tag)
            if at < 0:
                if not self._in_call:  # say all but a tail that may begin the tag
                    keep = _partial_tail(self._buf, OPEN)
                    if len(self._buf) > keep:
                        out.append(self._buf[: len(self._buf) - keep])
                        self._buf = self._buf[len(self._buf) - keep :]
                return out
            head, self._buf = self._buf[:at], self._buf[at + len(tag) :]
            if self._in_call:
                call = _parse(head)
                if call is None:
                    self.malformed.append(head)
                    log.warning("a tool call that does not parse was dropped: %r", head[:200])
                else:
                    out.append(call)
            elif head:
                out.append(head)
            self._in_call = not self._in_call

    def flush(self) -> list[str | Call]:
        """The end of the answer: held-back text that began no tag, or an unclosed call."""
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            call = _parse(rest)  # the model stopped before </tool_call>: take it if whole
            return [call] if call is not None else []
        return [rest] if rest else []


def _partial_tail(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _parse(body: str) -> Call | None:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    return Call(obj["name"], args if isinstance(args, str) else json.dumps(args))
