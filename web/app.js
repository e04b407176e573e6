// The demo page's entry point: wires the controls to the modules that do the work.
//
//   call.js        the peer connection: connect, signalling, hang up, camera
//   channel.js     the "oai-events" data channel
//   events.js      server events, handed to the parts below
//   settings.js    the settings form <-> session.update
//   mic.js         microphone: mute, push-to-talk, the You tile's tag
//   levels.js      meters, the bot's speaking tag, receive counters
//   turns.js       turn state and the latency readouts
//   transcript.js  the transcript's bubbles and markers
//   page.js        the observable state, status line, error banner

import { connect, hangup, inCall, toggleCamera } from "./call.js";
import { send } from "./channel.js";
import { applyPttMode, pttDown, pttMode, pttUp, toggleMute } from "./mic.js";
import { $, clearError, omni } from "./page.js";
import { settingsChanged, showLabels } from "./settings.js";
import { clearTranscript } from "./transcript.js";
import { responding } from "./turns.js";

// The page's observable state, and a way in for client events (tests/e2e/test_browser.py).
window.omni = Object.assign(omni, { send });

function sendText(e) {
  e.preventDefault();
  const text = $("text").value.trim();
  if (!text || !omni.connected) return;
  if (responding()) send({ type: "response.cancel" });
  send({
    type: "conversation.item.create",
    item: { type: "message", role: "user", content: [{ type: "input_text", text }] },
  });
  send({ type: "response.create" });
  $("text").value = "";
}

$("connect").addEventListener("click", () => (inCall() ? hangup() : connect()));
$("mute").addEventListener("click", toggleMute);
$("camera").addEventListener("change", toggleCamera);
$("error-close").addEventListener("click", clearError);
$("clear").addEventListener("click", clearTranscript);
$("composer").addEventListener("submit", sendText);
$("settings").addEventListener("submit", (e) => e.preventDefault());
for (const id of ["voice", "vad", "semantic", "interrupt", "threshold", "silence", "prefix"]) {
  $(id).addEventListener("change", settingsChanged);
}
for (const id of ["threshold", "silence", "prefix"]) $(id).addEventListener("input", showLabels);
const ptt = $("ptt");
ptt.addEventListener("pointerdown", (e) => { ptt.setPointerCapture(e.pointerId); pttDown(); });
ptt.addEventListener("pointerup", pttUp);
ptt.addEventListener("pointercancel", pttUp);
const typing = () => document.activeElement && ["INPUT", "SELECT", "TEXTAREA"]
  .includes(document.activeElement.tagName) && document.activeElement.type !== "range";
window.addEventListener("keydown", (e) => {
  if (e.code === "Space" && !e.repeat && pttMode() && !typing()) { e.preventDefault(); pttDown(); }
});
window.addEventListener("keyup", (e) => {
  if (e.code === "Space" && pttMode()) pttUp();
});
window.addEventListener("pagehide", () => { if (inCall()) hangup(); });
showLabels();
applyPttMode();
