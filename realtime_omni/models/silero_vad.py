"""silero-vad, one model for every session: speech probabilities of 32 ms windows of 16 kHz
audio (`gateway/turns/vad.py` turns them into turns). Imports torch; the gateway constructs it
at start, in a thread, only when `vad` is on."""

from __future__ import annotations

import asyncio
import time

import numpy as np


class SileroVad:
    """One silero-vad model for every session's stream.

    `stream()` gives a session its own `SileroStream` (the model's recurrent state and the last
    64 samples of context). What all streams wait to have judged at one moment goes through the
    model together, one window of each stream per pass (a stream's next window needs the state
    its previous one left), in one worker thread off the event loop: a window costs a quarter of
    what it costs alone in a pass of 16, and a model per session cost half of two cores with 16
    calls. Construct it in a thread: it imports torch and loads the model (~0.1 s, holding the
    GIL). Only one pass runs at a time, so a stream is never judged twice at once.
    """

    CONTEXT_SAMPLES = 64  # what silero's 16 kHz model sees of the previous window
    # Passes start at least this far apart, so windows of many calls (each arrives every 32 ms,
    # at its own phase) meet in one pass: 0.2 ms a window in a pass of 16, 0.8 ms alone. The
    # price is at most this much more time to notice speech start or stop.
    MIN_PASS_INTERVAL_S = 0.016
    # A window whose loudest sample is under -60 dBFS is silence without asking the model (a
    # muted or noise-suppressed microphone sends long runs of them); the stream then starts
    # afresh, as the model does at the start of a stream.
    SILENT_PEAK = 1e-3

    def __init__(self) -> None:
        import torch
        from silero_vad import load_silero_vad

        torch.set_num_threads(1)  # the gateway's torch does only this; leave cores to stages
        self._torch = torch
        self._model = load_silero_vad()._model  # the stateless core: (x, state) -> (p, state)
        # Bounded by the sessions: a stream waits for its answer before it asks again.
        self._waiting: list[tuple[SileroStream, list[np.ndarray], asyncio.Future[list[float]]]] = []
        self._task: asyncio.Task[None] | None = None
        self._last_pass = 0.0  # time.monotonic() when the last pass started

    def stream(self) -> SileroStream:
        return SileroStream(self)

    async def probs(self, stream: SileroStream, windows: list[np.ndarray]) -> list[float]:
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((stream, windows, fut))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        return await fut

    async def _run(self) -> None:
        while self._waiting:
            await asyncio.sleep(self._last_pass + self.MIN_PASS_INTERVAL_S - time.monotonic())
            self._last_pass = time.monotonic()
            batch, self._waiting = self._waiting, []
            try:
                results = await asyncio.to_thread(self.judge, [(s, w) for s, w, _ in batch])
            except Exception as e:
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, _, fut), probs in zip(batch, results, strict=True):
                if not fut.done():  # its session may have closed meanwhile
                    fut.set_result(probs)

    def judge(self, batch: list[tuple[SileroStream, list[np.ndarray]]]) -> list[list[float]]:
        """Speech probabilities of each stream's windows (512 samples at 16 kHz each), in order;
        each stream's state moves on past its windows. Blocking: call it off the event loop."""
        torch = self._torch
        out: list[list[float]] = [[] for _ in batch]
        with torch.inference_mode():
            for r in range(max((len(w) for _, w in batch), default=0)):
                now = []
                for i, (st, w) in enumerate(batch):
                    if r >= len(w):
                        continue
                    silent = np.abs(w[r]).max() < self.SILENT_PEAK
                    if st.reset_pending or silent:
                        st.reset_pending = False
                        st.zero()
                    if silent:
                        out[i].append(0.0)
                    else:
                        now.append(i)
                if not now:
                    continue
                streams = [batch[i][0] for i in now]
                x = torch.from_numpy(np.stack([batch[i][1][r] for i in now]))
                x = torch.cat([torch.cat([st.context for st in streams]), x], dim=1)
                state = torch.cat([st.state for st in streams], dim=1)
                p, state = self._model(x, state)
                for j, (i, st) in enumerate(zip(now, streams, strict=True)):
                    st.state = state[:, j : j + 1]
                    st.context = x[j : j + 1, -self.CONTEXT_SAMPLES :]
                    out[i].append(float(p[j]))
        return out


class SileroStream:
    """One session's view of the shared `SileroVad`: `await probs(windows)`, `reset()`."""

    def __init__(self, vad: SileroVad) -> None:
        self._vad = vad
        self.reset_pending = False
        self.zero()

    def reset(self) -> None:
        """Forget the audio so far, from the next window judged on (a pass may be running)."""
        self.reset_pending = True

    def zero(self) -> None:
        torch = self._vad._torch
        self.state = torch.zeros(2, 1, 128)
        self.context = torch.zeros(1, SileroVad.CONTEXT_SAMPLES)

    async def probs(self, windows: list[np.ndarray]) -> list[float]:
        return await self._vad.probs(self, windows)
