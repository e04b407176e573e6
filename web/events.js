// Server events from the data channel, each handed to the part of the page it concerns.

import { setYouSpeaking } from "./mic.js";
import { $, omni, replay, showError } from "./page.js";
import { reflectSession, settingsState } from "./settings.js";
import { botBubble, findBubble, linkItem, marker, userBubble, userItem } from "./transcript.js";
import {
  armBargeIn, awaitReply, botSpeaking, confirmBargeIn, dropBargeIn, responding, responseCreated,
  responseDone,
} from "./turns.js";

const LAST_EVENTS_KEEP = 100; // omni.lastEvents' length

export function onServerEvent(ev) {
  const type = ev.type || "?";
  omni.events[type] = (omni.events[type] || 0) + 1;
  omni.lastEvents.push({ type, t_ms: Math.round(performance.now()) });
  if (omni.lastEvents.length > LAST_EVENTS_KEEP) omni.lastEvents.shift();
  const item = ev.item || {};
  switch (type) {
    case "session.created":
    case "session.updated":
      reflectSession(ev.session || {});
      if (type === "session.updated") settingsState("applied", true);
      break;
    case "input_audio_buffer.speech_started":
      setYouSpeaking(true);
      userBubble(ev.item_id).startMs = ev.audio_start_ms ?? 0;
      if (responding() && $("interrupt").checked) armBargeIn();
      break;
    case "input_audio_buffer.speech_stopped": {
      setYouSpeaking(false);
      awaitReply(performance.now());
      const b = findBubble(ev.item_id);
      if (b && b.pending) b.spoken((ev.audio_end_ms ?? 0) - (b.startMs ?? 0));
      break;
    }
    case "conversation.item.added":
      if (item.role === "user") userItem(item);
      break;
    case "conversation.item.input_audio_transcription.delta":
      userBubble(ev.item_id).appendText(ev.delta || "");
      break;
    case "conversation.item.input_audio_transcription.completed":
      userBubble(ev.item_id).setText(ev.transcript || "");
      break;
    case "response.created":
      responseCreated(ev.response.id);
      botBubble(ev.response.id);
      $("bot-state").textContent = "thinking";
      break;
    case "response.output_item.added":
      if (item.id) linkItem(item.id, ev.response_id);
      break;
    case "response.output_audio_transcript.delta":
    case "response.audio_transcript.delta":
    case "response.output_text.delta":
    case "response.text.delta": {
      const b = findBubble(ev.item_id) || findBubble(ev.response_id);
      if (b) b.appendText(ev.delta || "");
      break;
    }
    case "response.done":
      onResponseDone(ev.response || {});
      break;
    case "error": {
      const e = ev.error || {};
      showError(`Server: ${e.message || "error"}${e.code ? ` (${e.code})` : ""}`);
      break;
    }
    default:
      break;
  }
}

function onResponseDone(resp) {
  const b = findBubble(resp.id);
  const status = resp.status;
  const details = resp.status_details || {};
  const out = (resp.output || [])[0];
  const heard = out && out.content && out.content[0] ? out.content[0].transcript : null;
  responseDone(resp.id);
  if (b) b.finish(status, heard, details);
  if (status === "cancelled") {
    const turn = details.reason === "turn_detected";
    const m = marker(turn ? "Barge-in: you spoke over the bot" : "You stopped the response", "",
      b ? b.li : null);
    replay($("tile-bot"), "flash");
    confirmBargeIn(m);
  } else {
    dropBargeIn();
  }
  if (!botSpeaking()) $("bot-state").textContent = "idle";
}
