// The transcript: a bubble per turn (yours and the bot's), markers between them.
//
// A bubble is found by the server's item id or response id; a push-to-talk turn is drawn before
// the server names its item (see pttTurn).

import { $, showError } from "./page.js";

const bubbles = new Map(); // item id or response id -> message element state
let pendingUser = null; // a push-to-talk bubble waiting for the server to name its item

function atBottom() {
  const t = $("transcript");
  return t.scrollHeight - t.scrollTop - t.clientHeight < 60;
}

function append(el) {
  const t = $("transcript");
  const stick = atBottom();
  $("empty").hidden = true;
  t.appendChild(el);
  if (stick) t.scrollTop = t.scrollHeight;
}

function keepScrolled(fn) {
  const stick = atBottom();
  fn();
  if (stick) $("transcript").scrollTop = $("transcript").scrollHeight;
}

function clock() {
  return new Date().toLocaleTimeString([], { hour: "2-digit", minute: "2-digit",
    second: "2-digit" });
}

function span(cls, text) {
  const s = document.createElement("span");
  s.className = cls;
  s.textContent = text;
  return s;
}

// A line between turns ("Call ended", a barge-in); placed after the element `after` if given.
export function marker(text, kind, after = null) {
  const li = document.createElement("li");
  li.className = `marker ${kind}`;
  li.textContent = text;
  if (after) keepScrolled(() => after.after(li));
  else append(li);
  return li;
}

// Appends a bubble for `side` ("you" or "bot"), typing dots until text comes; returns its state.
function message(side) {
  const li = document.createElement("li");
  li.className = `msg ${side}`;
  const meta = document.createElement("div");
  meta.className = "meta";
  const who = document.createElement("span");
  who.textContent = `${side === "you" ? "You" : "Qwen3-Omni"} · ${clock()}`;
  meta.appendChild(who);
  const bubble = document.createElement("div");
  bubble.className = "bubble";
  li.append(meta, bubble);
  append(li);
  const state = {
    li,
    side,
    pending: true,
    text: "",
    setPending() {
      bubble.innerHTML = '<span class="typing"><i></i><i></i><i></i></span>';
      state.pending = true;
    },
    appendText(delta) {
      state.setText(state.text + delta);
    },
    setText(text) {
      state.text = text;
      state.pending = false;
      keepScrolled(() => { bubble.textContent = text; });
    },
    note(text) {
      state.pending = false;
      keepScrolled(() => { bubble.innerHTML = ""; bubble.appendChild(span("note", text)); });
    },
    addBadge(text, kind) {
      meta.appendChild(span(`badge ${kind}`, text));
    },
    spoken(ms) {
      if (state.text) return;
      state.note(ms > 0 ? `spoke for ${(ms / 1000).toFixed(1)} s` : "spoke");
    },
    finish(status, heard, details) {
      const said = state.text;
      if (typeof heard === "string" && heard.length < said.length && said.startsWith(heard)) {
        keepScrolled(() => {
          bubble.textContent = heard;
          bubble.appendChild(span("unheard", said.slice(heard.length)));
        });
        bubble.title = "Struck out: generated but never played";
      } else if (!said) {
        state.note(status === "completed" ? "(audio only, no transcript)" :
          status === "cancelled" ? "(cut off before any text)" : "(no answer)");
      }
      if (status === "cancelled") {
        state.addBadge(details.reason === "turn_detected" ? "interrupted" : "stopped", "cut");
      } else if (status === "failed" || status === "incomplete") {
        li.classList.add("failed");
        const why = details.error && details.error.message ? `: ${details.error.message}` : "";
        state.addBadge(status, "bad");
        if (why) showError(`The response ${status}${why}`);
      }
    },
  };
  state.setPending();
  return state;
}

// The bubble for `id` (an item id or a response id), if there is one.
export function findBubble(id) {
  return bubbles.get(id);
}

// The user's bubble for item `id`, made if new.
export function userBubble(id) {
  let b = id && bubbles.get(id);
  if (!b) {
    b = message("you");
    if (id) bubbles.set(id, b);
  }
  return b;
}

export function botBubble(responseId) {
  const b = message("bot");
  bubbles.set(responseId, b);
  return b;
}

// The output item `itemId` of response `responseId` shares the response's bubble.
export function linkItem(itemId, responseId) {
  if (bubbles.has(responseId)) bubbles.set(itemId, bubbles.get(responseId));
}

// A push-to-talk turn, held `heldMs`: drawn now, named by the next user audio item (userItem).
export function pttTurn(heldMs) {
  const b = message("you");
  b.pttMs = heldMs;
  pendingUser = b;
}

// conversation.item.added for a user item: its text, or how long it was spoken.
export function userItem(item) {
  const content = item.content || [];
  if (pendingUser && !bubbles.has(item.id) && content.some((c) => c.type === "input_audio")) {
    bubbles.set(item.id, pendingUser);
    pendingUser = null;
  }
  const b = userBubble(item.id);
  const text = content.filter((c) => c.type === "input_text").map((c) => c.text).join(" ");
  const transcript = content.map((c) => c.transcript).filter(Boolean).join(" ");
  if (text || transcript) b.setText(text || transcript);
  else if (content.some((c) => c.type === "input_audio") && b.pending) {
    b.spoken(b.pttMs ?? null); // push-to-talk turns have no speech events
  }
  if (content.some((c) => c.type === "input_image")) b.addBadge("with camera frame", "");
}

// Speech that never became a turn once VAD is turned off; with `callEnded`, answers too, and a
// push-to-talk turn still waiting for its item.
export function dropUnfinishedTurns(callEnded = false) {
  const waiting = new Set(bubbles.values());
  if (callEnded && pendingUser) {
    waiting.add(pendingUser);
    pendingUser = null;
  }
  for (const b of waiting) {
    if (!b.pending || (b.side === "bot" && !callEnded)) continue;
    b.note(b.side === "you" ? "(not sent)" : "(call ended)");
  }
}

export function clearTranscript() {
  const t = $("transcript");
  for (const el of [...t.children]) if (el.id !== "empty") el.remove();
  $("empty").hidden = false;
  bubbles.clear();
}
