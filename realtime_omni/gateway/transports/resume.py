"""A dropped `/v1/realtime` connection is not a lost conversation: resume, an extension of
OpenAI's Realtime protocol (which has none; vLLM-Omni's duplex API has resume and playback acks).

    resumes = Resumes(window_s=30)                 # the server's, one per gateway
    link = resumes.hold(session, owner)            # a new session: its token in session.created
    resumes.park(host, link)                       # its connection dropped: the window starts
    link = await resumes.take(token, owner)        # a reconnect: the session back, or ResumeRefused
    resumes.give_way(host, owner)                  # a limit is reached: a parked session ends now

The wire: `session.created` carries a top-level `resume` object, `{"token", "window_s",
"resumed"}` (the SDK's types keep unknown fields; a client that does not know it ignores it).
A client whose connection dropped (no close frame: TCP lost, a phone on a train) reconnects
within `window_s` to `/v1/realtime?resume=<token>` with the key or client secret that made the
session (the token may instead go in an `X-Resume-Token` header, or from a browser in the
subprotocol `realtime-omni-resume.<token>`, so that no proxy's access log keeps it), and may
add

- `last_event_id`: the last event it got; the events sent after it (audio deltas aside) are sent
  again, with their event ids (the last `REPLAY_EVENTS`, within the replay's byte budget: an
  eighth of the session's `max_session_bytes`, taken from what its conversation may hold);
- `item_id` and `audio_end_ms`: the playback ack, how much of that answer it played. The
  answer's audio sent past it (the last `TAIL_S` seconds of it) is put back in the playout, so
  the answer continues from there; with `answer=cut` the answer is cancelled and the item
  truncated there (`conversation.item.truncate`'s rule). An answer that had ended is truncated
  there either way. Without an ack, what was sent counts as heard, as on any WebSocket.

It gets `session.created` (the same session id, a new token: a token is good once), the replayed
events, then what the session made meanwhile. While nobody is attached the session pauses, it
does not buffer: nothing reads its playout, so its answer waits under its lead limit
(`max_lead_ms`) and its server events wait in its outbox, at most one lead-limited answer's
worth. A reconnect while the old connection still looks alive to the server (a half-open TCP
connection) takes the session over; the old one is closed with 4000.

A client that closes with a close frame (any code: `close()` in a browser, the SDKs') ends the
session at once, as before. A parked session counts against `max_sessions` and a client
secret's cap until its window ends, but gives way (ends now, oldest first) to a new session
those limits would refuse; a drain (SIGTERM) ends parked sessions at once. A token is bound to
the grant's owner (`auth.Grant.owner`): another key or secret is refused with
`resume_token_not_yours`; a client secret must still be valid when the client comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from realtime_omni.gateway.host import release

if TYPE_CHECKING:
    from realtime_omni.gateway.host import Host
    from realtime_omni.gateway.session.driver import Session

REPLAY_EVENTS = 512  # sent server events kept for `last_event_id` (audio deltas are not)
REPLAY_SHARE = 8  # the replay (events and audio tail) may hold 1/8 of `max_session_bytes`
TAIL_S = 10.0  # seconds of sent answer audio kept for the playback ack
TAKEN_OVER = 4000  # the close code of a connection whose session resumed on another


class ResumeRefused(Exception):
    """A resume the server refuses: `code` and a message for the client's `error` event."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Token:
    session_id: str
    owner: str
    dropped_at: float | None = None  # when its connection dropped; None: attached


class ResumeTokens:
    """The resume tokens' rules, no I/O, the clock passed in: one live token per session, bound
    to its owner, good once, and after a drop only for `window_s`."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._tokens: dict[str, _Token] = {}
        self._of: dict[str, str] = {}  # session id -> its live token

    def issue(self, session_id: str, owner: str) -> str:
        """A new token for the session (the last one is void), for its next `session.created`."""
        self.forget(session_id)
        token = f"rt_{secrets.token_urlsafe(24)}"
        self._tokens[token] = _Token(session_id, owner)
        self._of[session_id] = token
        return token

    def dropped(self, session_id: str, now: float) -> None:
        """The session's connection dropped at `now`: its token is good until the window ends."""
        token = self._of.get(session_id)
        if token is not None:
            self._tokens[token].dropped_at = now

    def take(self, token: str, owner: str, now: float) -> str:
        """The session `token` resumes, the token used up; `ResumeRefused` says why not (a
        refused token stays as it was)."""
        t = self._tokens.get(token)
        if t is None:
            raise ResumeRefused(
                "resume_token_invalid",
                "this resume token is unknown, was used already, or its session ended; start "
                "a new session",
            )
        if t.owner != owner:
            raise ResumeRefused(
                "resume_token_not_yours",
                "this resume token belongs to a session another API key or client secret "
                "started; resume with the credential that started it",
            )
        if t.dropped_at is not None and now > t.dropped_at + self.window_s:
            self.forget(t.session_id)
            raise ResumeRefused(
                "resume_token_expired",
                f"the session waited {self.window_s:g} s for its client to come back and has "
                "ended; start a new session",
            )
        self.forget(t.session_id)
        return t.session_id

    def forget(self, session_id: str) -> None:
        """The session ended or took a new token: its token is void."""
        token = self._of.pop(session_id, None)
        if token is not None:
            del self._tokens[token]

    def __len__(self) -> int:
        return len(self._tokens)


class Replay:
    """What one session's connections sent, kept for the next connection: the last server
    events (audio deltas aside) for `last_event_id`, as the JSON text that went on the wire
    (so a kept event pins no item the conversation dropped), and the tail of the answer audio
    for the playback ack. At most `max_events` events and `max_bytes` of their text, the oldest
    going first; an event larger than `max_bytes` is not kept and takes those before it with
    it (a replay after them would have a gap). No I/O."""

    def __init__(
        self,
        max_events: int = REPLAY_EVENTS,
        tail_samples: int = 240_000,
        max_bytes: int = 4 << 20,
    ) -> None:
        self.events: deque[tuple[str, str]] = deque()  # (event_id, wire text), oldest first
        self.max_events, self.max_bytes = max_events, max_bytes
        self.held_bytes = 0  # of the events' text, a byte a character
        self.tail_samples = tail_samples
        self._tail: deque[tuple[str, np.ndarray]] = deque()  # (item_id, pcm), oldest first
        self._held = 0  # samples in `_tail`
        # Events taken from the session but never sent: they go first on the next connection.
        self.unsent: list[dict[str, Any]] = []

    def sent(self, event_id: str, text: str) -> None:
        """An event as it went on the wire: its event_id and its JSON text."""
        if len(text) > self.max_bytes:
            self.events.clear()
            self.held_bytes = 0
            return
        self.events.append((event_id, text))
        self.held_bytes += len(text)
        while len(self.events) > self.max_events or self.held_bytes > self.max_bytes:
            self.held_bytes -= len(self.events.popleft()[1])

    def after(self, last_event_id: str) -> list[str] | None:
        """The wire texts of the events sent after `last_event_id`; None when it is not among
        those kept."""
        ids = [event_id for event_id, _ in self.events]
        if last_event_id not in ids:
            return None
        return [text for _, text in list(self.events)[ids.index(last_event_id) + 1 :]]

    def audio(self, item_id: str, pcm: np.ndarray) -> None:
        """Answer audio sent, at the output rate; the oldest goes past `tail_samples`."""
        self._tail.append((item_id, pcm))
        self._held += len(pcm)
        while self._held - len(self._tail[0][1]) >= self.tail_samples:
            self._held -= len(self._tail.popleft()[1])

    def unheard(self, item_id: str, samples: int) -> np.ndarray:
        """The last `samples` sent of `item_id` (fewer if fewer are kept), in order."""
        parts: list[np.ndarray] = []
        need = samples
        for kept_id, pcm in reversed(self._tail):
            if need <= 0 or kept_id != item_id:
                if parts:
                    break  # the item's audio is contiguous: what came before is another's
                continue
            parts.append(pcm[-need:])
            need -= len(parts[-1])
        return np.concatenate(parts[::-1]) if parts else np.zeros(0, np.float32)


@dataclass
class Link:
    """One resumable session across its connections."""

    session: Session
    owner: str
    replay: Replay
    token: str = ""  # the live one, for the next session.created
    attached: bool = True  # a connection serves it
    leave: asyncio.Event = field(default_factory=asyncio.Event)  # set: the connection must go
    free: asyncio.Event = field(default_factory=asyncio.Event)  # set: no connection serves it
    dropped_at: float | None = None
    timer: asyncio.TimerHandle | None = None  # the window's end


class Resumes:
    """The server's resumable sessions: their tokens, links and windows. `window_s` 0: off
    (`hold` returns None, no token is given)."""

    def __init__(self, window_s: float, clock: Any = time.monotonic) -> None:
        self.window_s = window_s
        self.tokens = ResumeTokens(window_s)
        self.clock = clock
        self.links: dict[str, Link] = {}  # by session id
        self._ending: set[asyncio.Task[None]] = set()

    @property
    def parked(self) -> list[Link]:
        return [link for link in self.links.values() if not link.attached]

    @property
    def ending(self) -> int:
        """Sessions `end` let go of whose release (the abort of what ran, then `forget`) has
        not finished: no longer counted against the limits, not yet gone."""
        return len(self._ending)

    def hold(self, session: Session, owner: str) -> Link | None:
        """Make a new session resumable, attached to the connection that made it."""
        if self.window_s <= 0:
            return None
        # Charged to the session's `max_session_bytes`: its conversation keeps the rest.
        budget = session.reserve_bytes(session.max_session_bytes // REPLAY_SHARE)
        tail_samples = min(int(TAIL_S * session.output_rate), budget // 2 // 4)  # float32
        replay = Replay(tail_samples=tail_samples, max_bytes=budget - tail_samples * 4)
        link = Link(session, owner, replay)
        link.token = self.tokens.issue(session.id, owner)
        self.links[session.id] = link
        return link

    def park(self, host: Host, link: Link) -> None:
        """Its connection dropped: the session waits `window_s` for its client, then ends."""
        link.attached = False
        link.dropped_at = self.clock()
        self.tokens.dropped(link.session.id, link.dropped_at)
        loop = asyncio.get_running_loop()
        link.timer = loop.call_later(self.window_s, self.end, host, link)
        link.free.set()

    async def take(self, token: str, owner: str) -> Link:
        """The session `token` resumes, detached from any connection (one that still holds it
        is told to leave, and awaited) and with a new token; `ResumeRefused` says why not."""
        link = self.links.get(self.tokens.take(token, owner, self.clock()))
        if link is None:  # ending: its token outlived it for a moment
            raise ResumeRefused("resume_token_invalid", "this resume token's session ended")
        if link.attached:
            link.leave.set()
            await link.free.wait()
            if self.links.get(link.session.id) is not link:  # its client closed it meanwhile
                raise ResumeRefused("resume_token_invalid", "this resume token's session ended")
        if link.timer is not None:
            link.timer.cancel()
            link.timer = None
        link.attached, link.dropped_at = True, None
        link.leave.clear()
        link.free.clear()
        link.token = self.tokens.issue(link.session.id, owner)
        return link

    def end(self, host: Host, link: Link) -> None:
        """Forget the session's link and token now, release it (close, forget) in the
        background; safe twice."""
        if self.links.get(link.session.id) is not link:
            return
        del self.links[link.session.id]
        self.tokens.forget(link.session.id)
        if link.timer is not None:
            link.timer.cancel()
        host.sessions.discard(link.session)  # no longer counted against the limits, from now
        task = asyncio.ensure_future(release(host, link.session))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    def forget(self, link: Link) -> None:
        """The session ended with its connection (a clean close): nothing to resume."""
        if self.links.get(link.session.id) is link:
            del self.links[link.session.id]
            self.tokens.forget(link.session.id)

    def give_way(self, host: Host, owner: str | None = None) -> bool:
        """End the parked session (of `owner`, or anyone's) that has waited longest, so a new
        session may take its place; False when there is none."""
        waiting = [k for k in self.parked if owner is None or k.owner == owner]
        if not waiting:
            return False
        self.end(host, min(waiting, key=lambda k: k.dropped_at or 0.0))
        return True

    def end_all(self, host: Host) -> None:
        """End every parked session now (a drain: nobody will come back to this server)."""
        for link in self.parked:
            self.end(host, link)

    async def close(self) -> None:
        """Cancel the windows and await the sessions ending (the server stops)."""
        for link in self.links.values():
            if link.timer is not None:
                link.timer.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._ending, return_exceptions=True)
