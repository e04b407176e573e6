// What every part of the page shares: the element lookup, the observable state, the status line
// and the error banner.

export const $ = (id) => document.getElementById(id);

// The page's observable state; app.js publishes it as `window.omni` (tests/e2e/test_browser.py
// reads it). Each part of the page fills in its own fields.
export const omni = {
  state: "idle", // idle | connecting | connected | closed | failed
  connected: false,
  channelOpen: false,
  sessionId: null,
  events: {}, // server event type -> count
  lastEvents: [], // the last 100 server events: {type, t_ms}
  rx: {
    level: 0, peak: 0, maxPeak: 0, audibleMs: 0, // from the analyser
    bytes: 0, packets: 0, energy: 0, jitterBufferMs: 0, // from getStats()
  },
  latency: { firstAudioMs: [], bargeInMs: [] },
  errors: [],
};

export function setState(state, text, detail = "") {
  omni.state = state;
  $("status").dataset.state = state;
  $("status-text").textContent = text;
  $("status-detail").textContent = detail;
}

export function showError(message) {
  omni.errors.push(message);
  $("error-text").textContent = message;
  $("error").hidden = false;
}

export function clearError() {
  $("error").hidden = true;
}

export function explainMediaError(e, what) {
  if (e.name === "NotAllowedError") return `Permission to use the ${what} was denied.`;
  if (e.name === "NotFoundError") return `No ${what} was found on this device.`;
  if (e.name === "NotReadableError") return `The ${what} is in use by another application.`;
  return `Could not open the ${what}: ${e.message || e.name}`;
}

// Plays the CSS animation that `cls` starts on `el` again, even if it is still running.
export function replay(el, cls) {
  el.classList.remove(cls);
  void el.offsetWidth; // a reflow in between, or the browser sees no change to animate
  el.classList.add(cls);
}
