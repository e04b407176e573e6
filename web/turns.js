// Turn-taking as this page sees it (the response in flight, the answer awaited, a barge-in being
// timed, the bot's last sound) and the two latency readouts timed from it.

import { $, omni, replay } from "./page.js";

const BOT_HOLD_MS = 250; // the bot still "speaks" this long after its last sound
// Speech has pauses: after a barge-in the bot counts as silent once this long has passed
// without sound; the readout is timed at its last loud sample.
const SILENT_CONFIRM_MS = 200;
const LATENCY_KEEP = 50; // measurements kept per readout

let activeResponse = null; // id of the response between response.created and response.done
let pendingReply = null; // {t0, responseSeen}: waiting for the first audio of the answer
let bargeIn = null; // {t0, silentAt, confirmed, marker}
let lastBotSoundAt = -Infinity; // performance.now() time of the last loud received sample

export function responding() {
  return Boolean(activeResponse);
}

export function botSpeaking(now = performance.now()) {
  return now - lastBotSoundAt < BOT_HOLD_MS;
}

// The user's turn ended at `t0` (performance.now() time): time the answer's first audio.
export function awaitReply(t0) {
  pendingReply = { t0, responseSeen: false };
}

export function responseCreated(id) {
  activeResponse = id;
  if (pendingReply) pendingReply.responseSeen = true;
}

export function responseDone(id) {
  if (activeResponse === id) activeResponse = null;
  if (pendingReply && pendingReply.responseSeen) pendingReply = null; // no audio came
}

export function armBargeIn() {
  // Only speech over audible bot audio measures anything; the cancel confirms it.
  bargeIn = botSpeaking() ? { t0: performance.now(), silentAt: null, confirmed: false } : null;
}

// The response was cancelled: an armed barge-in counts, and its time goes on `markerEl`.
export function confirmBargeIn(markerEl) {
  if (!bargeIn) return;
  bargeIn.confirmed = true;
  bargeIn.marker = markerEl;
  settleBargeIn();
}

// The response ended on its own: the speech did not cut it off.
export function dropBargeIn() {
  bargeIn = null;
}

// One poll of the received audio, `m` as levels.js measures it, at `now`.
export function botAudio(now, m) {
  if (m.lastAgoMs >= 0) {
    lastBotSoundAt = Math.max(lastBotSoundAt, now - m.lastAgoMs);
    if (pendingReply && pendingReply.responseSeen) {
      record("firstAudioMs", Math.max(0, now - m.firstAgoMs - pendingReply.t0));
      pendingReply = null;
    }
  }
  if (bargeIn && bargeIn.silentAt === null && now - lastBotSoundAt >= SILENT_CONFIRM_MS) {
    bargeIn.silentAt = Math.max(bargeIn.t0, lastBotSoundAt);
    settleBargeIn();
  }
}

// The call ended: nothing is in flight any more.
export function resetTurns() {
  activeResponse = pendingReply = bargeIn = null;
}

// A barge-in is measured once the cancel confirmed it and the bot fell silent, in either order.
function settleBargeIn() {
  if (!bargeIn || !bargeIn.confirmed || bargeIn.silentAt === null) return;
  const ms = bargeIn.silentAt - bargeIn.t0;
  record("bargeInMs", ms);
  if (bargeIn.marker) bargeIn.marker.textContent += ` · silent after ${Math.round(ms)} ms`;
  bargeIn = null;
}

function record(key, ms) {
  const list = omni.latency[key];
  list.push(Math.round(ms));
  if (list.length > LATENCY_KEEP) list.shift();
  const [value, sub] = key === "firstAudioMs" ? ["lat-first", "lat-first-sub"] :
    ["lat-barge", "lat-barge-sub"];
  $(value).textContent = Math.round(ms);
  const sorted = [...list].sort((a, b) => a - b);
  const median = sorted[Math.floor(sorted.length / 2)];
  $(sub).textContent = `median ${median} · best ${sorted[0]} · n=${list.length}`;
  replay($(value).closest(".metric"), "updated");
}
