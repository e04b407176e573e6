"""Incremental detokenisation: token ids in, text deltas out, never half a character.

Byte-level BPE splits a multi-byte character across tokens; decoding such a prefix yields U+FFFD.
`IncrementalDetokenizer` decodes a short window (the tokens since the last emitted delta plus a
few before them, so merges at the window edge decode as in the full text) and holds the delta
back while it ends in U+FFFD. Pure Python over a `decode(ids) -> str` function: no torch.
"""

from __future__ import annotations

from collections.abc import Callable

_CONTEXT = 5  # tokens decoded before the new ones so the window edge decodes as in full text


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens already turned into emitted text

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it completes ("" while a character is unfinished)."""
        self.ids.append(token_id)
        before = self.decode(self.ids[self.prefix : self.read])
        now = self.decode(self.ids[self.prefix :])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self.prefix = max(self.read, len(self.ids) - _CONTEXT)
        self.read = len(self.ids)
        return now[len(before) :]

    def flush(self) -> str:
        """Whatever is held back at the end of the stream (an unfinished character as U+FFFD)."""
        before = self.decode(self.ids[self.prefix : self.read])
        now = self.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return now[len(before) :]
