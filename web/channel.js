// The "oai-events" data channel: OpenAI Realtime server events (GA names) come in, client events
// go out.

import { omni, showError } from "./page.js";

let dc = null;

// Opens the channel on `pc`; call before making the offer, so the offer negotiates it. `onOpen`
// runs once it opens, `onEvent` with each parsed server event, `onClose` when it closes, unless
// closeChannel closed it.
export function openChannel(pc, { onOpen, onEvent, onClose }) {
  dc = pc.createDataChannel("oai-events");
  dc.onopen = () => {
    omni.channelOpen = true;
    onOpen();
  };
  dc.onclose = () => {
    omni.channelOpen = false;
    onClose();
  };
  dc.onmessage = (e) => {
    try {
      onEvent(JSON.parse(e.data));
    } catch (err) {
      showError(`Could not read a server event: ${err.message}`);
    }
  };
}

export function closeChannel() {
  if (!dc) return;
  dc.onclose = null; // our own hang-up: nothing to report
  dc.close();
  dc = null;
}

// Sends a client event; false (and nothing sent) while the channel is not open.
export function send(event) {
  if (!dc || dc.readyState !== "open") return false;
  dc.send(JSON.stringify(event));
  return true;
}
