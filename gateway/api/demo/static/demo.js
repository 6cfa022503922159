// The voice page: the microphone to the gateway's OpenAI Realtime API, the
// answer back as text and sound. Two connections, as OpenAI's guide has them:
// a WebRTC call (/v1/realtime/calls: the microphone as an Opus track, the
// answer as a track, the events on the "oai-events" data channel), opened with
// a short-lived client secret from the page's own endpoint, so no key reaches
// the browser; or, as the fallback, the WebSocket (/v1/realtime: pcm16 in
// base64 events, the key as a subprotocol). Push to talk: audio is sent while
// the button (or Space) is held and committed at release. Hands-free: audio is
// sent all the time and the server's turn detection (server_vad) decides when
// a turn ends.

import { RATE, Resampler, base64ToBytes, bytesToBase64, floatToPcm16, pcm16Bytes } from "./pcm.js";
import { Player } from "./player.js";

const CHUNK_MS = 100; // audio per input_audio_buffer.append: small enough that the server hears speech at once
const CHUNK_SAMPLES = (RATE * CHUNK_MS) / 1000;
const MIN_TURN_MS = 200; // a shorter press is a slip, not a question
// A call's last words are still on the wire at release (RTP, the server's jitter buffer): commit after them.
const CALL_TAIL_MS = 300;
// A replica that died answers nothing and closes nothing: ICE says "disconnected" within seconds
// and "failed" only after ~30 s. A call disconnected this long is taken as broken off.
const CALL_LOST_MS = 3000;

const $ = (id) => document.getElementById(id);
const ui = {
  status: $("status"), talk: $("talk"), latency: $("latency"), error: $("error"), turns: $("turns"),
  apiKey: $("api-key"), instructions: $("instructions"), maxTokens: $("max-tokens"), temperature: $("temperature"),
};

const state = {
  transport: "webrtc", // or "websocket"
  socket: null, ready: null, // the connection, and a promise of its session.updated
  call: null, // a WebRTC call: {pc, channel, track, speaking}
  pressedAt: 0, // when the current push-to-talk press began
  silenceMs: 0, // server_vad's silence_duration_ms, as the session has it
  conversation: null, lastEventId: null, // where a call that breaks off resumes
  outputModalities: ["audio"],
  audio: null, // {context, stream, source, node, resampler, player}, opened on the first gesture
  sending: false, held: false, handsFree: false,
  pending: [], pendingSamples: 0, // pcm16 not yet sent (less than a chunk)
  turnSentMs: 0, // audio sent in the current push-to-talk turn
  sentMs: 0, sentLog: [], // hands-free: audio sent since session.update, and when each chunk was captured
  turn: null, // the turn on screen: {li, you, assistant, meta, endOfSpeechAt, firstSoundAt}
  lastTurn: null, // the latest turn, still the one whose answer plays after it is done
  responding: false,
};

// --- what the user sees ------------------------------------------------------------

function setState(name, status) {
  document.body.dataset.state = name;
  if (status) ui.status.textContent = status;
}

// The state between turns: waiting for a press, or (hands-free) for speech.
function settle() {
  if (state.handsFree && state.sending) setState("ready", "Listening for speech… (press to pause)");
  else setState("ready", state.socket ? "Connected" : "Not connected");
}

function showError(message) {
  ui.error.textContent = message;
  ui.error.hidden = false;
  document.body.dataset.error = message;
}

function clearError() {
  ui.error.hidden = true;
  ui.error.textContent = "";
  delete document.body.dataset.error;
}

function newTurn() {
  const li = document.createElement("li");
  li.className = "turn";
  const you = document.createElement("p");
  you.className = "you";
  const assistant = document.createElement("p");
  assistant.className = "assistant";
  const meta = document.createElement("p");
  meta.className = "meta";
  li.append(you, assistant, meta);
  ui.turns.append(li);
  state.turn = state.lastTurn = { li, you, assistant, meta, endOfSpeechAt: null, firstSoundAt: null };
  return state.turn;
}

function currentTurn() {
  return state.turn || newTurn();
}

// End of speech to the first sound of the answer (or its first text, for a
// gateway that does not speak): the delay a person in the conversation feels.
function showLatency(turn, at, what) {
  if (turn.endOfSpeechAt === null || turn.firstSoundAt !== null) return;
  turn.firstSoundAt = at;
  const ms = Math.max(0, Math.round(at - turn.endOfSpeechAt));
  ui.latency.textContent = `${ms} ms`;
  ui.latency.dataset.ms = String(ms);
  turn.meta.textContent = `end of speech → first ${what}: ${ms} ms`;
}

// --- the connection ---------------------------------------------------------------------

function realtimeUrl() {
  const url = new URL("v1/realtime", location.href); // the page is at <base>/demo
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  return url.href;
}

function connect() {
  if (state.ready) return state.ready;
  return state.transport === "webrtc" ? connectCall() : connectSocket();
}

// A connection's first events: its session is configured, then it is ready.
function onMessage(event, opened, resolve, reject) {
  if (event.event_id) state.lastEventId = event.event_id;
  if (event.type === "session.created") {
    state.conversation = event.session.id;
    state.outputModalities = event.session.output_modalities;
    send(sessionUpdate());
  } else if (event.type === "session.updated") {
    const detection = event.session.audio && event.session.audio.input.turn_detection;
    state.silenceMs = (detection && detection.silence_duration_ms) || 0;
    setState("ready", "Connected");
    resolve();
  } else if (event.type === "error" && !opened) {
    reject(new Error(event.error.message));
  }
  onEvent(event);
}

function connectSocket() {
  const key = ui.apiKey.value.trim();
  // Browsers cannot set headers on a WebSocket: the key rides as a subprotocol (OpenAI's way).
  const protocols = key ? ["realtime", `openai-insecure-api-key.${key}`] : ["realtime"];
  setState("connecting", "Connecting…");
  state.ready = new Promise((resolve, reject) => {
    let opened = false;
    let socket;
    try {
      socket = new WebSocket(realtimeUrl(), protocols);
    } catch (error) {
      reject(new Error(`Cannot open the connection: ${error.message}`));
      return;
    }
    state.socket = socket;
    socket.onopen = () => { opened = true; };
    socket.onmessage = (message) => onMessage(JSON.parse(message.data), opened, resolve, reject);
    socket.onclose = async (close) => {
      const wasReady = state.socket === socket;
      state.socket = null;
      state.ready = null;
      stopSending();
      if (!opened) {
        reject(new Error(await whyRefused(key)));
        return;
      }
      if (wasReady) {
        setState("idle", "Disconnected");
        if (close.code !== 1000) showError(`The connection closed (${close.code}${close.reason ? `: ${close.reason}` : ""}).`);
      }
      reject(new Error(`The connection closed (${close.code}).`));
    };
  });
  state.ready.catch(() => { state.ready = null; });
  return state.ready;
}

// What an app's backend does for its signed-in user, the page does for its one demo identity.
async function clientSecret() {
  let response;
  try {
    response = await fetch(new URL("demo/client_secret", location.href), { method: "POST" });
  } catch {
    throw new Error(`Cannot reach the gateway at ${location.host}: is it running?`);
  }
  const body = await response.json().catch(() => null);
  if (!response.ok) {
    const message = body && body.error ? body.error.message : response.statusText;
    throw new Error(`The page could not get a client secret (${response.status}): ${message}`);
  }
  return body.value;
}

// OpenAI's WebRTC recipe: the microphone track and the oai-events channel, the offer posted with the secret.
// `resume`: a call that broke off (its replica stopped, the network changed) is offered again, to
// any replica, with its conversation and last event: the answer in flight goes on from there.
function connectCall(resume = null) {
  setState("connecting", resume ? "The call broke off: reconnecting…" : "Connecting…");
  state.ready = new Promise((resolve, reject) => {
    let call = null;
    let opened = false;
    const end = (why) => {
      if (!call || state.call !== call) return;
      const wasSending = state.sending && state.handsFree;
      state.call = null;
      state.ready = null;
      call.track.enabled = true; // the microphone is the WebSocket's again, should the user switch
      stopSending();
      call.pc.close();
      delete document.body.dataset.call;
      reject(new Error(why || "The call ended."));
      if (opened && !resume && state.conversation) {
        reconnect(wasSending);
        return;
      }
      setState("idle", "Disconnected");
      if (why) showError(why);
    };
    (async () => {
      const secret = await clientSecret();
      const pc = new RTCPeerConnection();
      const track = state.audio.stream.getAudioTracks()[0];
      track.enabled = false; // silent until a press, or hands-free sending
      pc.addTrack(track, state.audio.stream);
      const channel = pc.createDataChannel("oai-events");
      call = { pc, channel, track, speaking: false };
      state.call = call;
      channel.onopen = () => { opened = true; };
      channel.onmessage = (message) => onMessage(JSON.parse(message.data), opened, resolve, reject);
      channel.onclose = () => end(opened ? "The call ended." : null);
      pc.onconnectionstatechange = () => {
        clearTimeout(call.lost);
        if (pc.connectionState === "failed") end("The call's media could not connect (is UDP to the gateway open?).");
        if (pc.connectionState === "disconnected" && opened) call.lost = setTimeout(() => end(null), CALL_LOST_MS);
      };
      pc.ontrack = (e) => {
        const element = new Audio();
        element.srcObject = new MediaStream([e.track]);
        element.play().catch(() => {}); // after the press's gesture the browser lets it play
      };
      await pc.setLocalDescription(await pc.createOffer());
      const calls = new URL("v1/realtime/calls", location.href);
      if (resume) {
        calls.searchParams.set("session_id", resume.conversation);
        if (resume.lastEventId) calls.searchParams.set("last_event_id", resume.lastEventId);
      }
      const response = await fetch(calls, {
        method: "POST", body: pc.localDescription.sdp,
        headers: { Authorization: `Bearer ${secret}`, "Content-Type": "application/sdp" },
      });
      if (response.status !== 201) {
        const body = await response.json().catch(() => null);
        const message = body && body.error ? body.error.message : response.statusText;
        throw new Error(`The gateway refused the call (${response.status}): ${message}`);
      }
      await pc.setRemoteDescription({ type: "answer", sdp: await response.text() });
      document.body.dataset.call = response.headers.get("Location"); // which call: for a backend, and tests
    })().catch((error) => {
      if (call) {
        state.call = null;
        call.track.enabled = true;
        call.pc.close();
      }
      reject(error);
    });
  });
  state.ready.catch(() => { state.ready = null; });
  return state.ready;
}

// Once per break: a call that breaks off again right after is left ended, with its reason shown.
function reconnect(wasSending) {
  connectCall({ conversation: state.conversation, lastEventId: state.lastEventId }).then(() => {
    if (wasSending) { // hands-free goes on listening
      state.sending = true;
      state.call.track.enabled = true;
    }
    if (!state.responding) settle();
  }, (error) => {
    setState("idle", "Disconnected");
    showError(`The call broke off and could not resume: ${error.message}`);
  });
}

function disconnect() {
  const call = state.call;
  if (call) {
    state.call = null; // a call ended on purpose: no error shown
    state.ready = null;
    call.track.enabled = true;
    call.pc.close();
    setState("idle", "Not connected");
  }
  if (state.socket) state.socket.close(1000);
}

// A browser is not told why a WebSocket handshake failed; the same checks
// answer a plain request with the error envelope, so ask one.
async function whyRefused(key) {
  try {
    const response = await fetch(new URL("v1/models", location.href), {
      headers: key ? { Authorization: `Bearer ${key}` } : {},
    });
    if (!response.ok) {
      const body = await response.json().catch(() => null);
      const message = body && body.error ? body.error.message : response.statusText;
      return `The gateway refused the connection (${response.status}): ${message}`;
    }
    return "The gateway refused the WebSocket connection (is /v1/realtime served here?).";
  } catch {
    return `Cannot reach the gateway at ${location.host}: is it running?`;
  }
}

function sessionUpdate() {
  const session = { type: "realtime", instructions: ui.instructions.value };
  const tokens = parseInt(ui.maxTokens.value, 10);
  if (tokens > 0) session.max_output_tokens = tokens;
  const temperature = parseFloat(ui.temperature.value);
  if (!Number.isNaN(temperature)) session.temperature = temperature;
  session.audio = { input: {
    turn_detection: state.handsFree ? { type: "server_vad" } : null,
    // The page shows what was heard: transcription events come only when asked for, as on OpenAI.
    transcription: { model: "default" },
  } };
  // Turn detection counts audio from the first append after this update.
  state.sentMs = 0;
  state.sentLog = [];
  return { type: "session.update", session };
}

function send(event) {
  if (state.call) {
    if (state.call.channel.readyState === "open") state.call.channel.send(JSON.stringify(event));
    return;
  }
  if (state.socket && state.socket.readyState === WebSocket.OPEN) state.socket.send(JSON.stringify(event));
}

function onEvent(event) {
  switch (event.type) {
    case "input_audio_buffer.speech_started": // hands-free: a new turn (and a barge-in, if it answered)
      if (state.audio) state.audio.player.stop();
      if (!state.turn || state.turn.you.textContent || state.turn.assistant.textContent) newTurn();
      setState("listening", "Listening…");
      break;
    case "input_audio_buffer.speech_stopped":
      // A call's audio is not counted in the page: the server says "stopped" once it has
      // heard silence_duration_ms of silence, so the speech ended that long before.
      currentTurn().endOfSpeechAt = state.call ? performance.now() - state.silenceMs : captureTime(event.audio_end_ms);
      setState("thinking", "Thinking…");
      break;
    case "conversation.item.input_audio_transcription.delta":
      currentTurn().you.textContent += event.delta;
      break;
    case "conversation.item.input_audio_transcription.completed":
      if (event.transcript) currentTurn().you.textContent = event.transcript;
      break;
    case "response.created":
      state.responding = true;
      setState("thinking", "Thinking…");
      break;
    case "response.output_text.delta":
    case "response.output_audio_transcript.delta": {
      const turn = currentTurn();
      turn.assistant.textContent += event.delta;
      if (!state.outputModalities.includes("audio")) showLatency(turn, performance.now(), "text");
      break;
    }
    case "output_audio_buffer.started": { // a call: the answer's track starts to play
      // Its turn may be done already: a resumed call plays the rest of an answer whose text came.
      const turn = state.turn || state.lastTurn || newTurn();
      if (state.call) state.call.speaking = true;
      if (!turn.li.dataset.audioStarted) {
        turn.li.dataset.audioStarted = "true";
        showLatency(turn, performance.now(), "sound");
        setState("speaking", "Speaking…");
      }
      break;
    }
    case "output_audio_buffer.stopped":
    case "output_audio_buffer.cleared":
      if (state.call) state.call.speaking = false;
      if (!state.responding && !state.held) settle();
      break;
    case "response.output_audio.delta": {
      const turn = currentTurn();
      const startsAt = state.audio.player.play(base64ToBytes(event.delta));
      if (startsAt !== null && !turn.li.dataset.audioStarted) {
        turn.li.dataset.audioStarted = "true"; // the first buffer is scheduled on the AudioContext
        showLatency(turn, startsAt, "sound");
        setState("speaking", "Speaking…");
      }
      break;
    }
    case "response.done": {
      state.responding = false;
      const { status, status_details: details } = event.response;
      const turn = currentTurn();
      turn.li.dataset.status = status;
      if (status === "cancelled") turn.meta.textContent += " (interrupted)";
      if (status === "failed") showError(`The answer failed: ${details && details.error ? details.error.message : "unknown error"}`);
      if (!state.handsFree) state.turn = null; // the next press starts a new turn
      if (!(state.audio && state.audio.player.playing) && !(state.call && state.call.speaking)) settle();
      break;
    }
    case "error":
      showError(`${event.error.message}${event.error.code ? ` (${event.error.code})` : ""}`);
      break;
    default:
      break;
  }
}

// --- the microphone ------------------------------------------------------------------------

async function openAudio() {
  if (state.audio) return state.audio;
  if (!window.isSecureContext || !navigator.mediaDevices || !window.AudioWorkletNode) {
    throw new Error("The microphone needs a secure page: open it at http://localhost or over https.");
  }
  // Made inside the user's gesture, so the browser lets it play sound.
  const context = new AudioContext();
  await context.resume();
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
  } catch (error) {
    await context.close();
    if (error.name === "NotAllowedError" || error.name === "SecurityError") {
      throw new Error("Microphone access was denied: allow it for this site (the icon in the address bar) and try again.");
    }
    if (error.name === "NotFoundError") throw new Error("No microphone was found.");
    throw new Error(`The microphone could not be opened: ${error.message}`);
  }
  await context.audioWorklet.addModule(new URL("./capture-worklet.js", import.meta.url));
  const source = context.createMediaStreamSource(stream);
  const node = new AudioWorkletNode(context, "capture");
  const mute = context.createGain();
  mute.gain.value = 0; // pulled by the graph, heard by nobody
  source.connect(node).connect(mute).connect(context.destination);
  const resampler = new Resampler(context.sampleRate, RATE);
  const player = new Player(context);
  player.onidle = () => { if (!state.responding && !state.held) settle(); };
  node.port.onmessage = (message) => onSamples(resampler.push(message.data));
  state.audio = { context, stream, source, node, resampler, player };
  return state.audio;
}

function onSamples(samples) {
  if (!state.sending || state.call || samples.length === 0) return; // a call's audio goes on its track
  state.pending.push(floatToPcm16(samples));
  state.pendingSamples += samples.length;
  while (state.pendingSamples >= CHUNK_SAMPLES) sendChunk(CHUNK_SAMPLES);
}

function sendChunk(count) {
  const pcm = new Int16Array(count);
  let filled = 0;
  while (filled < count) {
    const head = state.pending[0];
    const take = Math.min(head.length, count - filled);
    pcm.set(head.subarray(0, take), filled);
    filled += take;
    if (take === head.length) state.pending.shift();
    else state.pending[0] = head.subarray(take);
  }
  state.pendingSamples -= count;
  send({ type: "input_audio_buffer.append", audio: bytesToBase64(pcm16Bytes(pcm)) });
  const ms = (count * 1000) / RATE;
  state.turnSentMs += ms;
  state.sentMs += ms;
  state.sentLog.push({ endMs: state.sentMs, at: performance.now() });
  if (state.sentLog.length > 3000) state.sentLog.splice(0, 1000); // ~5 minutes is plenty to look back
}

// When the sample at `ms` (server_vad's count since session.update) was captured.
function captureTime(ms) {
  const entry = state.sentLog.find((e) => e.endMs >= ms);
  return entry ? entry.at - (entry.endMs - ms) : performance.now();
}

function stopSending() {
  state.sending = false;
  state.pending = [];
  state.pendingSamples = 0;
}

// --- push to talk ----------------------------------------------------------------------------

async function press() {
  if (state.held) return;
  state.held = true;
  clearError();
  try {
    await openAudio();
    await connect();
  } catch (error) {
    state.held = false;
    setState("idle", "Not connected");
    showError(error.message);
    return;
  }
  if (state.responding) send({ type: "response.cancel" }); // barge-in
  if (state.call && state.call.speaking) send({ type: "output_audio_buffer.clear" });
  state.audio.player.stop();
  newTurn();
  state.turnSentMs = 0;
  state.pressedAt = performance.now();
  if (state.call) {
    send({ type: "input_audio_buffer.clear" }); // the track's silence since the last turn
    state.call.track.enabled = true;
  }
  state.sending = true;
  setState("listening", "Listening… release to send");
  if (!state.held) release(); // let go while it was connecting
}

function release() {
  state.held = false;
  if (!state.sending) return;
  if (state.pendingSamples > 0) sendChunk(state.pendingSamples);
  stopSending();
  const turn = currentTurn();
  const call = state.call;
  const spokenMs = call ? performance.now() - state.pressedAt : state.turnSentMs;
  if (spokenMs < MIN_TURN_MS) {
    if (call) call.track.enabled = false;
    send({ type: "input_audio_buffer.clear" });
    turn.li.remove();
    state.turn = null;
    setState("ready", "Connected");
    showError("Hold the button while you speak, and let go when you are done.");
    return;
  }
  turn.endOfSpeechAt = performance.now();
  setState("thinking", "Thinking…");
  const commit = () => {
    send({ type: "input_audio_buffer.commit" });
    send({ type: "response.create" });
  };
  if (!call) {
    commit();
    return;
  }
  setTimeout(() => {
    if (state.held || state.call !== call) return; // pressed again meanwhile: that turn goes on
    call.track.enabled = false;
    commit();
  }, CALL_TAIL_MS);
}

// --- hands-free --------------------------------------------------------------------------------

async function toggleHandsFree() {
  clearError();
  if (state.sending) {
    stopSending();
    if (state.call) state.call.track.enabled = false;
    setState("ready", "Connected (paused)");
    ui.talk.textContent = "Start talking";
    return;
  }
  try {
    await openAudio();
    await connect();
  } catch (error) {
    setState("idle", "Not connected");
    showError(error.message);
    return;
  }
  state.sending = true;
  if (state.call) state.call.track.enabled = true;
  settle();
  ui.talk.textContent = "Pause";
}

// --- wiring ------------------------------------------------------------------------------------

function setMode(handsFree) {
  if (handsFree === state.handsFree) return;
  stopSending();
  if (state.call) state.call.track.enabled = false;
  state.handsFree = handsFree;
  ui.talk.textContent = handsFree ? "Start talking" : "Hold to talk";
  if (state.socket || state.call) send(sessionUpdate()); // turn detection follows the mode
}

function setTransport(transport) {
  if (transport === state.transport) return;
  disconnect(); // the next press connects the other way
  state.transport = transport;
}

for (const radio of document.querySelectorAll('input[name="mode"]')) {
  radio.addEventListener("change", () => setMode(radio.value === "vad" && radio.checked));
}
for (const radio of document.querySelectorAll('input[name="transport"]')) {
  radio.addEventListener("change", () => { if (radio.checked) setTransport(radio.value); });
}
ui.talk.addEventListener("pointerdown", (e) => {
  e.preventDefault();
  if (state.handsFree) toggleHandsFree();
  else press();
});
for (const name of ["pointerup", "pointerleave", "pointercancel"]) {
  ui.talk.addEventListener(name, () => { if (!state.handsFree && state.held) release(); });
}
const typing = (e) => e.target instanceof HTMLInputElement || e.target instanceof HTMLTextAreaElement;
document.addEventListener("keydown", (e) => {
  if (e.code !== "Space" || e.repeat || typing(e) || state.handsFree) return;
  e.preventDefault();
  press();
});
document.addEventListener("keyup", (e) => {
  if (e.code !== "Space" || typing(e) || state.handsFree) return;
  e.preventDefault();
  if (state.held) release();
});
ui.apiKey.addEventListener("change", () => { if (state.socket) state.socket.close(1000); }); // reconnect with the new key
document.body.dataset.loaded = "true";
