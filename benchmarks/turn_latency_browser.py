"""The browser's own figure for `turn_latency.py --browser`: the demo page (web/, served by the
server) in headless Chromium speaks complete questions through a fake microphone, and the time
from the end of each question's speech to the first audible sample of the answer is measured in
the page.

The page is unchanged: an init script (Playwright's `add_init_script`, run before the page's
modules) wraps `getUserMedia` and `RTCPeerConnection`, and taps the microphone track and the
remote audio track into one AudioContext of its own, each through an AudioWorklet that reports
where, in that context's sample clock, the sound starts and stops. Both taps share one clock, so
end of speech (the microphone's last loud sample, 400 ms of quiet confirming it) -> heard (the
remote track's first loud sample after it) is exact to a sample, with Chromium's own jitter
buffer and decoder included. It also records the session the server reports
(`session.created`/`session.updated` on the data channel) to check the policy in force.

The page's defaults give the policy: Smart Turn on (`semantic_vad`), with the server's default
`preemptive_ms` (160), i.e. `smart_turn+preemptive`. Its echo cancellation is switched off
before connecting (the browser's audio processing changes a fake microphone's sound a lot).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np

RATE_HZ = 48000
LEAD_S = 3.0  # silence before the first question: the page connects and sends its settings
GAP_S = 6.0  # silence after each question: the answer plays out
MIC_LOUD = 0.005  # a microphone sample above this is speech (voice() cuts its ends at 0.008)
MIC_HOLD_MS = 400  # speech ended once this long passed with no loud microphone sample
BOT_LOUD = 0.02  # as the aiortc caller: a received sample above this is audible
BOT_HOLD_MS = 1000

FLAGS = [
    "--no-sandbox",
    "--autoplay-policy=no-user-gesture-required",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    "--allow-loopback-in-peer-connection",
    "--disable-features=WebRtcHideLocalIpsWithMdns",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

# Runs in the page before its own scripts. window.__bench: {events: [{src, kind, ms}],
# sessions: [turn_detection], ready}: `ms` on the tap context's sample clock.
INIT_JS = r"""
((CFG) => {
  const bench = { events: [], sessions: [], errors: [], ctx: null };
  window.__bench = bench;
  const WORKLET = `
    class Edges extends AudioWorkletProcessor {
      constructor(o) {
        super();
        this.loud = o.processorOptions.loud;
        this.hold = Math.round(o.processorOptions.holdMs * sampleRate / 1000);
        this.active = false;
        this.last = -1;
      }
      process(inputs) {
        const ch = inputs[0] && inputs[0][0];
        if (ch) {
          for (let i = 0; i < ch.length; i++) {
            if (Math.abs(ch[i]) > this.loud) {
              const f = currentFrame + i;
              if (!this.active) {
                this.active = true;
                this.port.postMessage({ kind: "on", frame: f });
              }
              this.last = f;
            }
          }
        }
        if (this.active && currentFrame + 128 - this.last > this.hold) {
          this.active = false;
          this.port.postMessage({ kind: "off", frame: this.last });
        }
        return true;
      }
    }
    registerProcessor("edges", Edges);`;
  let ready = null;
  function context() {
    if (!ready) {
      const ctx = new AudioContext({ sampleRate: 48000 });
      bench.ctx = ctx;
      const url = URL.createObjectURL(new Blob([WORKLET], { type: "application/javascript" }));
      ready = ctx.audioWorklet.addModule(url).then(() => ctx);
    }
    return ready;
  }
  async function tap(src, stream, loud, holdMs) {
    try {
      const ctx = await context();
      const node = new AudioWorkletNode(ctx, "edges", { processorOptions: { loud, holdMs } });
      node.port.onmessage = (e) => bench.events.push(
        { src, kind: e.data.kind, ms: (1000 * e.data.frame) / ctx.sampleRate });
      ctx.createMediaStreamSource(stream).connect(node);
      const sink = ctx.createGain();  // keeps the worklet pulled without making a sound
      sink.gain.value = 0;
      node.connect(sink).connect(ctx.destination);
      if (ctx.state !== "running") await ctx.resume();
    } catch (e) {
      bench.errors.push(String(e));
    }
  }
  const gum = navigator.mediaDevices.getUserMedia.bind(navigator.mediaDevices);
  navigator.mediaDevices.getUserMedia = async (c) => {
    const s = await gum(c);
    if (c && c.audio) tap("mic", new MediaStream(s.getAudioTracks()), CFG.micLoud, CFG.micHoldMs);
    return s;
  };
  const PC = window.RTCPeerConnection;
  window.RTCPeerConnection = class extends PC {
    constructor(...a) {
      super(...a);
      this.addEventListener("track", (e) => {
        // The page plays e.streams[0] in its <audio>: Chromium feeds WebAudio only then.
        if (e.track.kind === "audio") {
          tap("bot", e.streams[0] || new MediaStream([e.track]), CFG.botLoud, CFG.botHoldMs);
        }
      });
    }
    createDataChannel(...a) {
      const dc = super.createDataChannel(...a);
      dc.addEventListener("message", (e) => {
        try {
          const ev = JSON.parse(e.data);
          if (ev.type === "session.created" || ev.type === "session.updated") {
            const input = ((ev.session || {}).audio || {}).input || {};
            bench.sessions.push(input.turn_detection ?? null);
          }
        } catch (_) {}
      });
      return dc;
    }
  };
})(%s);
""".replace(
    "%s",
    json.dumps(
        {
            "micLoud": MIC_LOUD,
            "micHoldMs": MIC_HOLD_MS,
            "botLoud": BOT_LOUD,
            "botHoldMs": BOT_HOLD_MS,
        }
    ),
)


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def write_mic(path: Path, speeches: list[np.ndarray]) -> list[float]:
    """A 48 kHz mono WAV: `LEAD_S` of silence, then each speech followed by `GAP_S` of silence;
    returns each speech's end in seconds from the file's start (the layout, for a check)."""
    parts = [np.zeros(int(LEAD_S * RATE_HZ), np.float32)]
    ends, at = [], LEAD_S * RATE_HZ
    for s in speeches:
        parts += [s, np.zeros(int(GAP_S * RATE_HZ), np.float32)]
        at += len(s)
        ends.append(at / RATE_HZ)
        at += int(GAP_S * RATE_HZ)
    pcm = np.clip(np.concatenate(parts), -1, 1)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE_HZ)
        w.writeframes((pcm * 32767).astype(np.int16).tobytes())
    return ends


def pair(events: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """Per question (the microphone's first `n` speech runs): its end -> the first bot sound
    after it (before the next question starts); premature: bot sound began during the speech."""
    mic = [e for e in events if e["src"] == "mic"]
    ons = [e["ms"] for e in mic if e["kind"] == "on"]
    offs = [e["ms"] for e in mic if e["kind"] == "off"]
    bot = sorted(e["ms"] for e in events if e["src"] == "bot" and e["kind"] == "on")
    out = []
    for i, (on, off) in enumerate(list(zip(ons, offs, strict=False))[:n]):
        nxt = ons[i + 1] if i + 1 < len(ons) else float("inf")
        heard = next((t for t in bot if off <= t < nxt), None)
        out.append(
            {
                "speech_ms": round(off - on, 1),
                "end_ms": round(off, 1),
                "end_to_heard_ms": None if heard is None else round(heard - off, 1),
                "premature": any(on + 200 <= t < off for t in bot),
            }
        )
    return out


def browser_call(
    url: str, speeches: list[tuple[str, np.ndarray]], max_output_tokens: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The demo page at `url` speaks `speeches` (text, 48 kHz pcm) once; per question the
    measured turn, and what the page reported (the policy in force, the layout check)."""
    from playwright.sync_api import sync_playwright

    exe = chromium()
    if exe is None:
        raise SystemExit("--browser needs chromium (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as d:
        wav = Path(d) / "mic.wav"
        layout = write_mic(wav, [pcm for _, pcm in speeches])
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=exe,
                headless=True,
                args=[*FLAGS, f"--use-file-for-fake-audio-capture={wav}"],
            )
            try:
                page = browser.new_page()
                page.add_init_script(INIT_JS)
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(url)
                page.evaluate("document.getElementById('aec').checked = false")
                # The page's settings go out when the channel opens; the answers kept short.
                page.click("#connect")
                page.wait_for_function("window.omni.connected && window.omni.channelOpen")
                page.evaluate(
                    "(n) => window.omni.send({type: 'session.update',"
                    " session: {type: 'realtime', max_output_tokens: n}})",
                    max_output_tokens,
                )
                n = len(speeches)
                deadline = time.monotonic() + LEAD_S + n * (GAP_S + 6.0) + 10.0
                while time.monotonic() < deadline:
                    offs = page.evaluate(
                        "window.__bench.events.filter(e => e.src === 'mic' && e.kind === 'off')"
                        ".length"
                    )
                    if offs >= n:
                        break
                    page.wait_for_timeout(250)
                page.wait_for_timeout(GAP_S * 1000 - 1000)  # the last answer is heard
                bench = page.evaluate(
                    "({events: window.__bench.events, sessions: window.__bench.sessions,"
                    " errors: window.__bench.errors})"
                )
                page_errors = [*errors, *page.evaluate("window.omni.errors")]
                jitter_ms = page.evaluate("window.omni.rx.jitterBufferMs")  # getStats()
                page.click("#connect")  # hang up
            finally:
                browser.close()
    turns = pair(bench["events"], len(speeches))
    for t, (text, _) in zip(turns, speeches, strict=False):
        t["text"] = text
    mic_ends = [t["end_ms"] for t in turns]
    report = {
        "turn_detection": bench["sessions"][-1] if bench["sessions"] else None,
        "errors": bench["errors"] + page_errors,
        # Chromium's receive jitter buffer, its mean delay over the page's last 500 ms of stats.
        "jitter_buffer_ms": jitter_ms,
        # The microphone's measured gaps between speech ends against the WAV's: how exactly the
        # page hears its own microphone (ms; ~0 when the taps see every sample in time).
        "mic_layout_error_ms": [
            round((b - a) - 1000 * (lb - la), 1)
            for a, b, la, lb in zip(mic_ends, mic_ends[1:], layout, layout[1:], strict=False)
        ],
    }
    return turns, report
