// The call: one WebRTC peer connection to the gateway.
//
// Signalling: OpenAI's flow, POST /v1/realtime/calls with the offer as application/sdp -> 201,
// the answer, Location: /v1/realtime/calls/<session id>; sent once ICE gathering is complete
// (the answer carries the server's candidates inline; no trickle). A server with API keys wants
// a client secret, which the page never mints itself (that takes a key): it comes in the page's
// URL, `#client_secret=ek_...`, from whoever opened the page (an app's backend mints it). Media: the microphone (and the camera, when on at connect) go out; one audio track
// comes back (48 kHz speech, silence when the bot says nothing). Events: the "oai-events" data
// channel (channel.js).

import { closeChannel, openChannel } from "./channel.js";
import { onServerEvent } from "./events.js";
import { listenToBot, listenToMic, openLevels, startPolling, stopLevels } from "./levels.js";
import { closeMic, openMic, setYouSpeaking } from "./mic.js";
import { $, clearError, explainMediaError, omni, setState, showError } from "./page.js";
import { sendSettings } from "./settings.js";
import { dropUnfinishedTurns, marker } from "./transcript.js";
import { resetTurns } from "./turns.js";

const ICE_GATHER_LIMIT_MS = 5000;
const CONNECT_LIMIT_MS = 15000;

let pc = null;
let camStream = null;
let videoSender = null;

export function inCall() {
  return pc !== null;
}

export async function connect() {
  clearError();
  if (!window.isSecureContext || !navigator.mediaDevices) {
    showError("The microphone needs a secure page: open it over https or on localhost.");
    return;
  }
  setButtons("connecting");
  setState("connecting", "Opening the microphone…");
  openLevels(); // before the first await: still inside the click
  let mic;
  try {
    mic = await openMic();
  } catch (e) {
    fail(explainMediaError(e, "microphone"));
    return;
  }
  listenToMic(mic);
  try {
    await call(mic);
  } catch (e) {
    fail(e.message || String(e));
  }
}

async function call(mic) {
  pc = new RTCPeerConnection({ iceServers: [] });
  const thisPc = pc;
  openChannel(pc, {
    onOpen: sendSettings,
    onEvent: onServerEvent,
    onClose: () => {
      if (pc === thisPc && omni.connected) {
        showError("The event channel closed: the server ended the session.");
        hangup("closed");
      }
    },
  });
  for (const track of mic.getAudioTracks()) pc.addTrack(track, mic);
  $("camera-hint").hidden = true; // a camera switched on before now joins this call
  const cam = camStream && camStream.getVideoTracks()[0];
  if (cam) {
    videoSender = pc.addTransceiver(cam, { direction: "sendonly", streams: [camStream] }).sender;
  }
  pc.ontrack = (e) => {
    if (e.track.kind === "audio") onRemoteAudio(e.streams[0] || new MediaStream([e.track]));
  };
  pc.onconnectionstatechange = () => onConnectionState(thisPc);

  await pc.setLocalDescription(await pc.createOffer());
  setState("connecting", "Gathering network candidates…");
  await iceGatheringComplete(pc);
  if (pc !== thisPc) return; // hung up meanwhile

  setState("connecting", "Calling the server…");
  let response;
  try {
    const headers = { "Content-Type": "application/sdp" };
    const secret = clientSecret();
    if (secret) headers.Authorization = `Bearer ${secret}`;
    response = await fetch("/v1/realtime/calls", {
      method: "POST",
      headers,
      body: pc.localDescription.sdp,
    });
  } catch (e) {
    throw new Error(`The server cannot be reached: ${e.message}`);
  }
  if (!response.ok) {
    throw new Error(`The server refused the call (HTTP ${response.status}): ` +
      await reason(response));
  }
  const answer = await response.text();
  if (pc !== thisPc) return;
  omni.sessionId = (response.headers.get("Location") || "").split("/").pop() || null;
  await pc.setRemoteDescription({ type: "answer", sdp: answer });
  setState("connecting", "Connecting media…");
  setTimeout(() => {
    if (pc === thisPc && !omni.connected) {
      fail("The media connection did not come up in time (ICE or DTLS failed).");
    }
  }, CONNECT_LIMIT_MS);
}

// The client secret the page was opened with (#client_secret=...), if any.
function clientSecret() {
  const params = new URLSearchParams(location.hash.slice(1));
  return params.get("client_secret");
}

// The error a refusing server gave, from its JSON body or its text.
async function reason(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    const err = body.error ?? body.detail ?? body.message ?? body;
    return typeof err === "string" ? err : err.message || JSON.stringify(err);
  } catch {
    return text.trim() || response.statusText;
  }
}

function iceGatheringComplete(peer) {
  if (peer.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      if (peer.iceGatheringState !== "complete") return;
      peer.removeEventListener("icegatheringstatechange", done);
      resolve();
    };
    peer.addEventListener("icegatheringstatechange", done);
    setTimeout(resolve, ICE_GATHER_LIMIT_MS); // send what was gathered so far
  });
}

function onConnectionState(peer) {
  if (peer !== pc) return;
  const s = peer.connectionState;
  if (s === "connected") {
    omni.connected = true;
    setState("connected", "Connected", omni.sessionId || "");
    setButtons("connected");
    startPolling(peer);
  } else if (s === "disconnected") {
    setState("connecting", "Connection interrupted, trying to recover…");
  } else if (s === "failed") {
    fail("The connection to the server failed.");
  }
}

function onRemoteAudio(stream) {
  const el = $("remote");
  el.srcObject = stream;
  el.play().catch((e) => {
    if (e.name === "NotAllowedError") showError("The browser blocked playback: click the page.");
  });
  listenToBot(stream);
}

function fail(message) {
  showError(message);
  hangup("failed");
}

export function hangup(state = "closed") {
  const wasConnected = omni.connected;
  closeChannel();
  if (pc) pc.close();
  pc = videoSender = null;
  closeMic();
  $("remote").srcObject = null;
  omni.connected = omni.channelOpen = false;
  resetTurns();
  stopLevels(); // after resetTurns: the bot's tag falls back to "idle", not "thinking"
  setYouSpeaking(false);
  dropUnfinishedTurns(true);
  setButtons("idle");
  if (state === "failed") setState("failed", "Call failed");
  else setState("closed", wasConnected ? "Call ended" : "Not connected");
  if (wasConnected) marker("Call ended", "info");
}

function setButtons(phase) {
  const btn = $("connect");
  btn.disabled = phase === "connecting";
  btn.textContent = phase === "idle" ? "Connect" : phase === "connecting" ? "Connecting…" :
    "Hang up";
  btn.classList.toggle("hangup", phase === "connected");
  $("aec").disabled = phase !== "idle"; // getUserMedia's constraints hold for the call
  const live = phase === "connected";
  $("mute").disabled = !live;
  $("ptt").disabled = !live;
  $("text").disabled = !live;
  $("send").disabled = !live;
}

// Follows the Camera switch. A call sends video only if the camera was on when it connected
// (its offer then has a video sender, whose track follows the switch); switched on mid-call
// otherwise, the camera shows here and joins from the next call.
export async function toggleCamera() {
  const on = $("camera").checked;
  const hint = $("camera-hint");
  hint.hidden = true;
  if (!on) {
    if (camStream) camStream.getTracks().forEach((t) => t.stop());
    camStream = null;
    $("preview").hidden = true;
    if (videoSender) await videoSender.replaceTrack(null);
    return;
  }
  try {
    camStream = await navigator.mediaDevices.getUserMedia({
      video: { width: { ideal: 640 }, height: { ideal: 480 } },
    });
  } catch (e) {
    $("camera").checked = false;
    showError(explainMediaError(e, "camera"));
    return;
  }
  $("preview").srcObject = camStream;
  $("preview").hidden = false;
  if (videoSender) {
    await videoSender.replaceTrack(camStream.getVideoTracks()[0]);
  } else if (pc) {
    hint.textContent = "The camera joins the call from the next connect.";
    hint.hidden = false;
  }
}
