// The microphone: opening it, mute, push-to-talk, and the You tile's tag.
//
// The track is enabled only while it should reach the server: not muted, and with server VAD
// off (push-to-talk mode) only while the button or Space is held.

import { send } from "./channel.js";
import { $, omni } from "./page.js";
import { dropUnfinishedTurns, pttTurn } from "./transcript.js";
import { armBargeIn, awaitReply, responding } from "./turns.js";

const PTT_COMMIT_DELAY_MS = 200; // let the last spoken audio reach the server before commit

let stream = null; // the microphone while a call has it
let muted = false;
let heldSince = null; // performance.now() time push-to-talk was pressed; null: not held

// Opens the microphone for a call (rejects as getUserMedia does) and returns its stream.
export async function openMic() {
  // The browser's echo cancellation by default: with speakers it keeps the bot from hearing,
  // and interrupting, itself (the server's echo gate is the second line). With headphones it
  // can be turned off for raw audio, which is what the VAD and the model hear best.
  const aec = $("aec").checked;
  stream = await navigator.mediaDevices.getUserMedia({
    audio: {
      channelCount: 1,
      echoCancellation: aec,
      noiseSuppression: aec,
      autoGainControl: false,
    },
  });
  applyMicEnabled();
  return stream;
}

// The call ended: a held push-to-talk is let go, and a released one is not sent (pttUp).
export function closeMic() {
  if (stream) stream.getTracks().forEach((t) => t.stop());
  stream = null;
  heldSince = null;
  $("ptt").classList.remove("active");
}

// Whether the microphone is open and sending.
export function micLive() {
  return stream !== null && stream.getAudioTracks().some((t) => t.enabled);
}

export function pttMode() {
  return !$("vad").checked;
}

// Follows the VAD switch: push-to-talk shows its button and gates the microphone.
export function applyPttMode() {
  const ptt = pttMode();
  if (ptt) dropUnfinishedTurns();
  $("settings").classList.toggle("ptt-mode", ptt);
  $("ptt").hidden = !ptt;
  applyMicEnabled();
}

function applyMicEnabled() {
  if (!stream) return;
  const on = !muted && (!pttMode() || heldSince !== null);
  stream.getAudioTracks().forEach((t) => { t.enabled = on; });
}

export function toggleMute() {
  muted = !muted;
  $("mute").setAttribute("aria-pressed", String(muted));
  $("mute").textContent = muted ? "Unmute mic" : "Mute mic";
  setYouSpeaking(false);
  applyMicEnabled();
}

export function setYouSpeaking(speaking) {
  $("tile-you").dataset.speaking = String(speaking);
  $("you-state").textContent = speaking ? "speaking" : muted ? "muted" : "idle";
}

// Push-to-talk pressed: cut the bot off, drop audio sent before, open the microphone.
export function pttDown() {
  if (!pttMode() || !omni.connected || heldSince !== null) return;
  heldSince = performance.now();
  if (responding()) {
    armBargeIn();
    send({ type: "response.cancel" });
  }
  send({ type: "input_audio_buffer.clear" });
  $("ptt").classList.add("active");
  setYouSpeaking(true);
  applyMicEnabled();
}

// Push-to-talk released: a moment later, close the microphone, commit the turn and ask for the
// answer, unless the call has ended by then.
export function pttUp() {
  if (heldSince === null) return;
  const heldMs = performance.now() - heldSince;
  heldSince = null;
  $("ptt").classList.remove("active");
  setYouSpeaking(false);
  const releasedAt = performance.now();
  const mic = stream;
  setTimeout(() => {
    if (stream !== mic) return; // hung up meanwhile
    applyMicEnabled();
    pttTurn(heldMs);
    send({ type: "input_audio_buffer.commit" });
    send({ type: "response.create" });
    awaitReply(releasedAt);
  }, PTT_COMMIT_DELAY_MS);
}
