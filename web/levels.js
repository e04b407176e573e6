// Audio levels: both tiles' meters, the bot's speaking tag, and the receive counters in
// `omni.rx`. Polled while the call is connected.

import { micLive } from "./mic.js";
import { $, omni } from "./page.js";
import { botAudio, botSpeaking, responding } from "./turns.js";

const SILENCE_PEAK = 0.004; // received audio under this peak is silence (the server sends zeros)
const POLL_MS = 10; // level polling; the analyser window (2048 samples, ~43 ms) overlaps it,
// so a late timer loses nothing, and sound is timed by its place in the window, not the poll
const STATS_MS = 500;

let audioCtx = null;
let micAnalyser = null;
let botAnalyser = null;
let pollTimer = null;
let statsTimer = null;
let lastPollAt = 0;
let jitterSeen = { count: 0, delayS: 0 }; // getStats() jitter buffer counters at the last read

// Call within the user's click: an AudioContext made outside a user gesture starts suspended.
export function openLevels() {
  audioCtx = new AudioContext();
}

export function listenToMic(stream) {
  micAnalyser = analyser(new MediaStream(stream.getAudioTracks()));
}

// `stream` must be playing in a media element: Chromium feeds a remote stream to WebAudio only
// then.
export function listenToBot(stream) {
  botAnalyser = analyser(stream);
}

// Starts polling the levels, and `pc`'s receive statistics; a second call does nothing.
export function startPolling(pc) {
  if (pollTimer) return;
  pollTimer = setInterval(poll, POLL_MS);
  statsTimer = setInterval(() => readStats(pc), STATS_MS);
}

// The call ended: stop polling, release the audio, zero the meters.
export function stopLevels() {
  clearInterval(pollTimer);
  clearInterval(statsTimer);
  pollTimer = statsTimer = null;
  if (audioCtx) audioCtx.close();
  audioCtx = micAnalyser = botAnalyser = null;
  jitterSeen = { count: 0, delayS: 0 };
  $("jitter").textContent = "";
  showLevel("you", 0);
  setBotLevel(0, false);
}

function analyser(stream) {
  const node = audioCtx.createAnalyser();
  node.fftSize = 2048;
  audioCtx.createMediaStreamSource(stream).connect(node);
  return { node, buf: new Float32Array(node.fftSize) };
}

// Peak and RMS of the analyser's window, and the first and last samples above the silence
// level (-1: none), counted back from the window's end in ms.
function measure(a) {
  a.node.getFloatTimeDomainData(a.buf);
  let peak = 0;
  let sum = 0;
  let first = -1;
  let last = -1;
  a.buf.forEach((x, i) => {
    const m = Math.abs(x);
    if (m > peak) peak = m;
    if (m > SILENCE_PEAK) {
      if (first < 0) first = i;
      last = i;
    }
    sum += x * x;
  });
  const msPerSample = 1000 / audioCtx.sampleRate;
  const n = a.buf.length;
  return {
    peak,
    rms: Math.sqrt(sum / n),
    firstAgoMs: first < 0 ? -1 : (n - first) * msPerSample,
    lastAgoMs: last < 0 ? -1 : (n - 1 - last) * msPerSample,
    windowMs: n * msPerSample,
  };
}

function poll() {
  const now = performance.now();
  if (micAnalyser) {
    const { rms } = measure(micAnalyser);
    showLevel("you", micLive() ? meterLevel(rms) : 0);
  }
  if (!botAnalyser) return;
  const m = measure(botAnalyser);
  omni.rx.level = m.rms;
  omni.rx.peak = m.peak;
  omni.rx.maxPeak = Math.max(omni.rx.maxPeak, m.peak);
  const sincePoll = Math.min(now - lastPollAt, m.windowMs);
  lastPollAt = now;
  if (m.lastAgoMs >= 0) omni.rx.audibleMs += Math.round(sincePoll);
  botAudio(now, m);
  setBotLevel(meterLevel(m.rms), botSpeaking(now));
}

function meterLevel(rms) {
  const db = 20 * Math.log10(rms + 1e-9);
  return Math.min(1, Math.max(0, (db + 60) / 50));
}

// `who`: "you" or "bot"; `level` from 0 to 1.
function showLevel(who, level) {
  $(`meter-${who}`).style.width = `${level * 100}%`;
  $(`avatar-${who}`).style.setProperty("--level", level.toFixed(3));
}

function setBotLevel(level, speaking) {
  const tile = $("tile-bot");
  const was = tile.dataset.speaking === "true";
  if (was !== speaking) {
    tile.dataset.speaking = String(speaking);
    $("bot-state").textContent = speaking ? "speaking" : responding() ? "thinking" : "idle";
  }
  showLevel("bot", level);
}

async function readStats(pc) {
  const stats = await pc.getStats();
  stats.forEach((s) => {
    if (s.type === "inbound-rtp" && s.kind === "audio") {
      omni.rx.bytes = s.bytesReceived || 0;
      omni.rx.packets = s.packetsReceived || 0;
      omni.rx.energy = s.totalAudioEnergy || 0;
      // The jitter buffer's mean delay over the last interval (the counters are cumulative).
      const emitted = (s.jitterBufferEmittedCount || 0) - jitterSeen.count;
      if (emitted > 0) {
        const delayS = s.jitterBufferDelay - jitterSeen.delayS;
        omni.rx.jitterBufferMs = Math.round((1000 * delayS) / emitted);
        $("jitter").textContent = `Receive jitter buffer now: ${omni.rx.jitterBufferMs} ms.`;
      }
      jitterSeen = { count: s.jitterBufferEmittedCount || 0, delayS: s.jitterBufferDelay || 0 };
    }
  });
}
