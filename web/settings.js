// The settings form and the session: changes go to the server as session.update; the server's
// session.created/updated are reflected back into the form.

import { send } from "./channel.js";
import { applyPttMode } from "./mic.js";
import { $, omni } from "./page.js";

const SETTINGS_DEBOUNCE_MS = 150; // a burst of changes goes out as one session.update

let applyingSession = false; // reflecting server settings into the form: do not send them back
let settingsTimer = null;

// Smart Turn on: OpenAI's semantic_vad, which the server decides with Smart Turn's model (or, on a
// server without it, a silence set by the eagerness); off: server_vad and the silence slider.
function turnDetection() {
  if (!$("vad").checked) return null;
  const semantic = $("semantic").checked;
  return {
    type: semantic ? "semantic_vad" : "server_vad",
    ...(semantic ? { eagerness: "auto" } : { silence_duration_ms: Number($("silence").value) }),
    threshold: Number($("threshold").value),
    prefix_padding_ms: Number($("prefix").value),
    create_response: true,
    interrupt_response: $("interrupt").checked,
  };
}

export function sendSettings() {
  const sent = send({
    type: "session.update",
    session: {
      type: "realtime",
      audio: {
        input: { turn_detection: turnDetection() },
        output: { voice: $("voice").value },
      },
    },
  });
  if (sent) settingsState("sending…", false);
}

export function settingsChanged() {
  showLabels();
  document.querySelector(".silence-row").classList.toggle("unused", $("semantic").checked);
  applyPttMode();
  if (applyingSession || !omni.channelOpen) return;
  clearTimeout(settingsTimer);
  settingsTimer = setTimeout(sendSettings, SETTINGS_DEBOUNCE_MS);
}

export function settingsState(text, ok) {
  const el = $("settings-state");
  el.textContent = text;
  el.classList.toggle("ok", ok);
}

// Shows the server's session `s` in the form (GA shape, or the older flat fields).
export function reflectSession(s) {
  const audio = s.audio || {};
  const input = audio.input || {};
  const output = audio.output || {};
  const td = "turn_detection" in input ? input.turn_detection : s.turn_detection;
  const voice = output.voice ?? s.voice;
  applyingSession = true;
  if (voice && [...$("voice").options].some((o) => o.value === voice)) $("voice").value = voice;
  if (td !== undefined) {
    $("vad").checked = td !== null;
    if (td) {
      $("semantic").checked = td.type === "semantic_vad";
      if (td.threshold != null) $("threshold").value = td.threshold;
      if (td.silence_duration_ms != null) $("silence").value = td.silence_duration_ms;
      if (td.prefix_padding_ms != null) $("prefix").value = td.prefix_padding_ms;
      if (td.interrupt_response != null) $("interrupt").checked = td.interrupt_response;
    }
  }
  settingsChanged();
  applyingSession = false;
}

// The sliders' values beside their labels.
export function showLabels() {
  $("threshold-out").textContent = Number($("threshold").value).toFixed(2);
  $("silence-out").textContent = `${$("silence").value} ms`;
  $("prefix-out").textContent = `${$("prefix").value} ms`;
}
