// The demo page: one WebRTC call to the gateway.
//
// Signalling: POST /v1/webrtc/offer {sdp, type: "offer"} -> {sdp, type: "answer", session_id},
// sent once ICE gathering is complete (the answer carries the server's candidates inline; no
// trickle). Media: the microphone (and the camera, when on at connect) go out; one audio track
// comes back (48 kHz speech, silence when the bot says nothing). Events: the "oai-events" data
// channel carries the OpenAI Realtime server events (GA names) and takes client events.
//
// `window.omni` is the page's observable state (tests/e2e/test_browser.py reads it).
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);

  const SILENCE_PEAK = 0.004; // received audio under this peak is silence (the server sends zeros)
  const BOT_HOLD_MS = 250; // the bot still "speaks" this long after its last sound
  const POLL_MS = 10; // level polling; the analyser window (2048 samples, ~43 ms) overlaps it,
  // so a late timer loses nothing, and sound is timed by its place in the window, not the poll
  // Speech has pauses: after a barge-in the bot counts as silent once this long has passed
  // without sound; the readout is timed at its last loud sample.
  const SILENT_CONFIRM_MS = 200;
  const STATS_MS = 500;
  const ICE_GATHER_LIMIT_MS = 5000;
  const CONNECT_LIMIT_MS = 15000;
  const PTT_COMMIT_DELAY_MS = 200; // let the last spoken audio reach the server before commit
  const LATENCY_KEEP = 50; // measurements kept per readout

  const omni = {
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
    send: (event) => send(event),
  };
  window.omni = omni;

  // ---- call state ----------------------------------------------------------------------

  let pc = null;
  let dc = null;
  let audioCtx = null;
  let micStream = null;
  let camStream = null;
  let videoSender = null;
  let micAnalyser = null;
  let botAnalyser = null;
  let pollTimer = null;
  let statsTimer = null;
  let lastBotSoundAt = -Infinity; // performance.now() time of the last loud received sample
  let lastPollAt = 0;
  let jitterSeen = { count: 0, delayS: 0 }; // getStats() jitter buffer counters at the last read
  let muted = false;
  let pttHeldSince = null;
  let activeResponse = null; // id of the response between response.created and response.done
  let pendingReply = null; // {t0, responseSeen}: waiting for the first audio of the answer
  let bargeIn = null; // {t0, silentAt, confirmed, marker}
  let applyingSession = false; // reflecting server settings into the form: do not send them back
  let settingsTimer = null;
  let pendingUser = null; // a push-to-talk bubble waiting for the server to name its item

  const bubbles = new Map(); // item id or response id -> message element state

  // ---- status and errors ---------------------------------------------------------------

  function setState(state, text, detail = "") {
    omni.state = state;
    $("status").dataset.state = state;
    $("status-text").textContent = text;
    $("status-detail").textContent = detail;
  }

  function showError(message) {
    omni.errors.push(message);
    $("error-text").textContent = message;
    $("error").hidden = false;
  }

  function clearError() {
    $("error").hidden = true;
  }

  function explainMediaError(e, what) {
    if (e.name === "NotAllowedError") return `Permission to use the ${what} was denied.`;
    if (e.name === "NotFoundError") return `No ${what} was found on this device.`;
    if (e.name === "NotReadableError") return `The ${what} is in use by another application.`;
    return `Could not open the ${what}: ${e.message || e.name}`;
  }

  // ---- connect and hang up -------------------------------------------------------------

  async function connect() {
    clearError();
    if (!window.isSecureContext || !navigator.mediaDevices) {
      showError("The microphone needs a secure page: open it over https or on localhost.");
      return;
    }
    setButtons("connecting");
    setState("connecting", "Opening the microphone…");
    audioCtx = new AudioContext(); // made inside the click, so the browser lets it play
    try {
      // Raw audio by default: the browser's processing changes what the VAD and the model hear
      // (and makes tests irreproducible); with speakers, echo cancellation keeps the bot from
      // hearing, and interrupting, itself.
      const aec = $("aec").checked;
      micStream = await navigator.mediaDevices.getUserMedia({
        audio: {
          channelCount: 1,
          echoCancellation: aec,
          noiseSuppression: aec,
          autoGainControl: false,
        },
      });
    } catch (e) {
      fail(explainMediaError(e, "microphone"));
      return;
    }
    micAnalyser = analyser(new MediaStream(micStream.getAudioTracks()));
    applyMicEnabled();
    try {
      await call();
    } catch (e) {
      fail(e.message || String(e));
    }
  }

  async function call() {
    pc = new RTCPeerConnection({ iceServers: [] });
    const thisPc = pc;
    dc = pc.createDataChannel("oai-events");
    dc.onopen = () => {
      omni.channelOpen = true;
      sendSettings();
    };
    dc.onclose = () => {
      omni.channelOpen = false;
      if (pc === thisPc && omni.connected) {
        showError("The event channel closed: the server ended the session.");
        hangup("closed");
      }
    };
    dc.onmessage = (e) => {
      try {
        onServerEvent(JSON.parse(e.data));
      } catch (err) {
        showError(`Could not read a server event: ${err.message}`);
      }
    };
    for (const track of micStream.getAudioTracks()) pc.addTrack(track, micStream);
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
      response = await fetch("/v1/webrtc/offer", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ sdp: pc.localDescription.sdp, type: "offer" }),
      });
    } catch (e) {
      throw new Error(`The server cannot be reached: ${e.message}`);
    }
    if (!response.ok) {
      throw new Error(`The server refused the call (HTTP ${response.status}): ` +
        await reason(response));
    }
    const answer = await response.json();
    if (pc !== thisPc) return;
    omni.sessionId = answer.session_id || null;
    await pc.setRemoteDescription({ type: "answer", sdp: answer.sdp });
    setState("connecting", "Connecting media…");
    setTimeout(() => {
      if (pc === thisPc && !omni.connected) {
        fail("The media connection did not come up in time (ICE or DTLS failed).");
      }
    }, CONNECT_LIMIT_MS);
  }

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
      startPolling();
    } else if (s === "disconnected") {
      setState("connecting", "Connection interrupted, trying to recover…");
    } else if (s === "failed") {
      fail("The connection to the server failed.");
    }
  }

  function fail(message) {
    showError(message);
    hangup("failed");
  }

  function hangup(state = "closed") {
    const wasConnected = omni.connected;
    if (dc) dc.onclose = null;
    if (dc) dc.close();
    if (pc) pc.close();
    pc = dc = videoSender = null;
    if (micStream) micStream.getTracks().forEach((t) => t.stop());
    micStream = null;
    clearInterval(pollTimer);
    clearInterval(statsTimer);
    pollTimer = statsTimer = null;
    if (audioCtx) audioCtx.close();
    audioCtx = micAnalyser = botAnalyser = null;
    jitterSeen = { count: 0, delayS: 0 };
    $("jitter").textContent = "";
    $("remote").srcObject = null;
    omni.connected = omni.channelOpen = false;
    activeResponse = pendingReply = bargeIn = pttHeldSince = pendingUser = null;
    setYouSpeaking(false);
    setBotLevel(0, false);
    dropUnfinishedTurns(true);
    $("meter-you").style.width = "0";
    $("avatar-you").style.setProperty("--level", 0);
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

  // ---- audio levels --------------------------------------------------------------------

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

  function onRemoteAudio(stream) {
    // Chromium feeds a remote stream to WebAudio only while a media element plays it.
    const el = $("remote");
    el.srcObject = stream;
    el.play().catch((e) => {
      if (e.name === "NotAllowedError") showError("The browser blocked playback: click the page.");
    });
    botAnalyser = analyser(stream);
  }

  function startPolling() {
    if (pollTimer) return;
    pollTimer = setInterval(poll, POLL_MS);
    statsTimer = setInterval(readStats, STATS_MS);
  }

  function poll() {
    const now = performance.now();
    if (micAnalyser) {
      const { rms } = measure(micAnalyser);
      const live = micStream && micStream.getAudioTracks().some((t) => t.enabled);
      const level = live ? meterLevel(rms) : 0;
      $("meter-you").style.width = `${level * 100}%`;
      $("avatar-you").style.setProperty("--level", level.toFixed(3));
    }
    if (!botAnalyser) return;
    const m = measure(botAnalyser);
    omni.rx.level = m.rms;
    omni.rx.peak = m.peak;
    omni.rx.maxPeak = Math.max(omni.rx.maxPeak, m.peak);
    const sincePoll = Math.min(now - lastPollAt, m.windowMs);
    lastPollAt = now;
    if (m.lastAgoMs >= 0) {
      omni.rx.audibleMs += Math.round(sincePoll);
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
    setBotLevel(meterLevel(m.rms), now - lastBotSoundAt < BOT_HOLD_MS);
  }

  function meterLevel(rms) {
    const db = 20 * Math.log10(rms + 1e-9);
    return Math.min(1, Math.max(0, (db + 60) / 50));
  }

  async function readStats() {
    if (!pc) return;
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

  function setBotLevel(level, speaking) {
    const tile = $("tile-bot");
    const was = tile.dataset.speaking === "true";
    if (was !== speaking) {
      tile.dataset.speaking = String(speaking);
      $("bot-state").textContent = speaking ? "speaking" : activeResponse ? "thinking" :
        "idle";
    }
    $("meter-bot").style.width = `${level * 100}%`;
    $("avatar-bot").style.setProperty("--level", level.toFixed(3));
  }

  function botSpeaking() {
    return performance.now() - lastBotSoundAt < BOT_HOLD_MS;
  }

  function setYouSpeaking(speaking) {
    $("tile-you").dataset.speaking = String(speaking);
    $("you-state").textContent = speaking ? "speaking" : muted ? "muted" : "idle";
  }

  // ---- latency readouts ----------------------------------------------------------------

  function record(key, ms) {
    const list = omni.latency[key];
    list.push(Math.round(ms));
    if (list.length > LATENCY_KEEP) list.shift();
    const [value, sub, card] = key === "firstAudioMs" ?
      ["lat-first", "lat-first-sub", "lat-first"] : ["lat-barge", "lat-barge-sub", "lat-barge"];
    $(value).textContent = Math.round(ms);
    const sorted = [...list].sort((a, b) => a - b);
    const median = sorted[Math.floor(sorted.length / 2)];
    $(sub).textContent = `median ${median} · best ${sorted[0]} · n=${list.length}`;
    const metric = $(card).closest(".metric");
    metric.classList.remove("updated");
    void metric.offsetWidth; // restart the animation
    metric.classList.add("updated");
  }

  function settleBargeIn() {
    if (!bargeIn || !bargeIn.confirmed || bargeIn.silentAt === null) return;
    const ms = bargeIn.silentAt - bargeIn.t0;
    record("bargeInMs", ms);
    if (bargeIn.marker) bargeIn.marker.textContent += ` · silent after ${Math.round(ms)} ms`;
    bargeIn = null;
  }

  function armBargeIn() {
    // Only speech over audible bot audio measures anything; the cancel confirms it.
    bargeIn = botSpeaking() ? { t0: performance.now(), silentAt: null, confirmed: false } : null;
  }

  // ---- server events -------------------------------------------------------------------

  function onServerEvent(ev) {
    const type = ev.type || "?";
    omni.events[type] = (omni.events[type] || 0) + 1;
    omni.lastEvents.push({ type, t_ms: Math.round(performance.now()) });
    if (omni.lastEvents.length > 100) omni.lastEvents.shift();
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
        if (activeResponse && $("interrupt").checked) armBargeIn();
        break;
      case "input_audio_buffer.speech_stopped": {
        setYouSpeaking(false);
        pendingReply = { t0: performance.now(), responseSeen: false };
        const b = bubbles.get(ev.item_id);
        if (b && b.pending) b.spoken((ev.audio_end_ms ?? 0) - (b.startMs ?? 0));
        break;
      }
      case "conversation.item.added":
        if (item.role === "user") onUserItem(item);
        break;
      case "conversation.item.input_audio_transcription.delta":
        userBubble(ev.item_id).appendText(ev.delta || "");
        break;
      case "conversation.item.input_audio_transcription.completed":
        userBubble(ev.item_id).setText(ev.transcript || "");
        break;
      case "response.created":
        activeResponse = ev.response.id;
        if (pendingReply) pendingReply.responseSeen = true;
        botBubble(ev.response.id);
        $("bot-state").textContent = "thinking";
        break;
      case "response.output_item.added":
        if (item.id && bubbles.has(ev.response_id)) {
          bubbles.set(item.id, bubbles.get(ev.response_id));
        }
        break;
      case "response.output_audio_transcript.delta":
      case "response.audio_transcript.delta":
      case "response.output_text.delta":
      case "response.text.delta": {
        const b = bubbles.get(ev.item_id) || bubbles.get(ev.response_id);
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

  function onUserItem(item) {
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

  function onResponseDone(resp) {
    const b = bubbles.get(resp.id);
    const status = resp.status;
    const details = resp.status_details || {};
    const out = (resp.output || [])[0];
    const heard = out && out.content && out.content[0] ? out.content[0].transcript : null;
    if (activeResponse === resp.id) activeResponse = null;
    if (pendingReply && pendingReply.responseSeen) pendingReply = null; // no audio came
    if (b) b.finish(status, heard, details);
    if (status === "cancelled") {
      const turn = details.reason === "turn_detected";
      const m = marker(turn ? "Barge-in: you spoke over the bot" : "You stopped the response", "",
        b ? b.li : null);
      flash($("tile-bot"));
      if (bargeIn) {
        bargeIn.confirmed = true;
        bargeIn.marker = m;
        settleBargeIn();
      }
    } else {
      bargeIn = null;
    }
    if (!botSpeaking()) $("bot-state").textContent = "idle";
  }

  function flash(el) {
    el.classList.remove("flash");
    void el.offsetWidth;
    el.classList.add("flash");
  }

  // ---- transcript ----------------------------------------------------------------------

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

  function marker(text, kind, after = null) {
    const li = document.createElement("li");
    li.className = `marker ${kind}`;
    li.textContent = text;
    if (after) keepScrolled(() => after.after(li));
    else append(li);
    return li;
  }

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

  function span(cls, text) {
    const s = document.createElement("span");
    s.className = cls;
    s.textContent = text;
    return s;
  }

  function userBubble(id) {
    let b = id && bubbles.get(id);
    if (!b) {
      b = message("you");
      if (id) bubbles.set(id, b);
    }
    return b;
  }

  // Speech that never became a turn once VAD is turned off; with `callEnded`, answers too.
  function dropUnfinishedTurns(callEnded = false) {
    for (const b of new Set(bubbles.values())) {
      if (!b.pending || b === pendingUser || (b.side === "bot" && !callEnded)) continue;
      b.note(b.side === "you" ? "(not sent)" : "(call ended)");
    }
  }

  function botBubble(responseId) {
    const b = message("bot");
    bubbles.set(responseId, b);
    return b;
  }

  // ---- client events and settings ------------------------------------------------------

  function send(event) {
    if (!dc || dc.readyState !== "open") return false;
    dc.send(JSON.stringify(event));
    return true;
  }

  function turnDetection() {
    if (!$("vad").checked) return null;
    return {
      type: "server_vad",
      threshold: Number($("threshold").value),
      silence_duration_ms: Number($("silence").value),
      prefix_padding_ms: Number($("prefix").value),
      create_response: true,
      interrupt_response: $("interrupt").checked,
    };
  }

  function sendSettings() {
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

  function settingsChanged() {
    showLabels();
    applyPttMode();
    if (applyingSession || !omni.channelOpen) return;
    clearTimeout(settingsTimer);
    settingsTimer = setTimeout(sendSettings, 150);
  }

  function settingsState(text, ok) {
    const el = $("settings-state");
    el.textContent = text;
    el.classList.toggle("ok", ok);
  }

  function reflectSession(s) {
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
        if (td.threshold != null) $("threshold").value = td.threshold;
        if (td.silence_duration_ms != null) $("silence").value = td.silence_duration_ms;
        if (td.prefix_padding_ms != null) $("prefix").value = td.prefix_padding_ms;
        if (td.interrupt_response != null) $("interrupt").checked = td.interrupt_response;
      }
    }
    settingsChanged();
    applyingSession = false;
  }

  function showLabels() {
    $("threshold-out").textContent = Number($("threshold").value).toFixed(2);
    $("silence-out").textContent = `${$("silence").value} ms`;
    $("prefix-out").textContent = `${$("prefix").value} ms`;
  }

  // ---- microphone, push-to-talk, camera ------------------------------------------------

  function pttMode() {
    return !$("vad").checked;
  }

  function applyPttMode() {
    const ptt = pttMode();
    if (ptt) dropUnfinishedTurns();
    $("settings").classList.toggle("ptt-mode", ptt);
    $("ptt").hidden = !ptt;
    applyMicEnabled();
  }

  function applyMicEnabled() {
    if (!micStream) return;
    const on = !muted && (!pttMode() || pttHeldSince !== null);
    micStream.getAudioTracks().forEach((t) => { t.enabled = on; });
  }

  function toggleMute() {
    muted = !muted;
    $("mute").setAttribute("aria-pressed", String(muted));
    $("mute").textContent = muted ? "Unmute mic" : "Mute mic";
    setYouSpeaking(false);
    applyMicEnabled();
  }

  function pttDown() {
    if (!pttMode() || !omni.connected || pttHeldSince !== null) return;
    pttHeldSince = performance.now();
    if (activeResponse) {
      armBargeIn();
      send({ type: "response.cancel" });
    }
    send({ type: "input_audio_buffer.clear" });
    $("ptt").classList.add("active");
    setYouSpeaking(true);
    applyMicEnabled();
  }

  function pttUp() {
    if (pttHeldSince === null) return;
    const heldMs = performance.now() - pttHeldSince;
    pttHeldSince = null;
    $("ptt").classList.remove("active");
    setYouSpeaking(false);
    const releasedAt = performance.now();
    setTimeout(() => {
      applyMicEnabled();
      const b = message("you");
      b.pttMs = heldMs;
      send({ type: "input_audio_buffer.commit" });
      send({ type: "response.create" });
      pendingReply = { t0: releasedAt, responseSeen: false };
      pendingUser = b;
    }, PTT_COMMIT_DELAY_MS);
  }

  async function toggleCamera() {
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

  function sendText(e) {
    e.preventDefault();
    const text = $("text").value.trim();
    if (!text || !omni.connected) return;
    if (activeResponse) send({ type: "response.cancel" });
    send({
      type: "conversation.item.create",
      item: { type: "message", role: "user", content: [{ type: "input_text", text }] },
    });
    send({ type: "response.create" });
    $("text").value = "";
  }

  function clearTranscript() {
    const t = $("transcript");
    for (const el of [...t.children]) if (el.id !== "empty") el.remove();
    $("empty").hidden = false;
    bubbles.clear();
  }

  // ---- wiring --------------------------------------------------------------------------

  $("connect").addEventListener("click", () => (pc ? hangup() : connect()));
  $("mute").addEventListener("click", toggleMute);
  $("camera").addEventListener("change", toggleCamera);
  $("error-close").addEventListener("click", clearError);
  $("clear").addEventListener("click", clearTranscript);
  $("composer").addEventListener("submit", sendText);
  $("settings").addEventListener("submit", (e) => e.preventDefault());
  for (const id of ["voice", "vad", "interrupt", "threshold", "silence", "prefix"]) {
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
  window.addEventListener("pagehide", () => { if (pc) hangup(); });
  showLabels();
  applyPttMode();
})();
