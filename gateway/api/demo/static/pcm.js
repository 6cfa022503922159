// Audio formats between the browser and the Realtime API: float samples at the
// microphone's rate in, pcm16 mono at 24 kHz (base64 in the events) out, and back.

export const RATE = 24000; // OpenAI Realtime's pcm16 rate, the only one /v1/realtime takes

// Streaming resampler: call push() with each batch, in order. Going down it
// averages the input samples each output sample covers (a box filter, so
// 48 kHz speech does not alias into the band the recognizer hears); going up
// it interpolates linearly.
export class Resampler {
  constructor(fromRate, toRate = RATE) {
    this.step = fromRate / toRate; // input samples per output sample
    this.pending = new Float32Array(0);
    this.position = 0; // where the next output sample sits in `pending`
  }

  push(input) {
    const data = new Float32Array(this.pending.length + input.length);
    data.set(this.pending);
    data.set(input, this.pending.length);
    const out = [];
    let p = this.position;
    if (this.step >= 1) {
      while (Math.floor(p + this.step) <= data.length) {
        const from = Math.floor(p), to = Math.max(from + 1, Math.floor(p + this.step));
        let sum = 0;
        for (let i = from; i < to; i++) sum += data[i];
        out.push(sum / (to - from));
        p += this.step;
      }
    } else {
      while (Math.floor(p) + 1 < data.length) {
        const i = Math.floor(p), frac = p - i;
        out.push(data[i] * (1 - frac) + data[i + 1] * frac);
        p += this.step;
      }
    }
    const used = Math.min(Math.floor(p), data.length);
    this.pending = data.slice(used);
    this.position = p - used;
    return Float32Array.from(out);
  }
}

export function floatToPcm16(samples) {
  const pcm = new Int16Array(samples.length);
  for (let i = 0; i < samples.length; i++) {
    const s = Math.max(-1, Math.min(1, samples[i]));
    pcm[i] = s < 0 ? s * 0x8000 : s * 0x7fff;
  }
  return pcm;
}

export function pcm16ToFloat(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const samples = new Float32Array(Math.floor(bytes.byteLength / 2));
  for (let i = 0; i < samples.length; i++) samples[i] = view.getInt16(2 * i, true) / 0x8000;
  return samples;
}

export function bytesToBase64(bytes) {
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    text += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(text);
}

export function base64ToBytes(b64) {
  const text = atob(b64);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  return bytes;
}

// pcm16 little-endian bytes of the samples (the Int16Array's own byte order is the platform's).
export function pcm16Bytes(pcm) {
  const bytes = new Uint8Array(pcm.length * 2);
  const view = new DataView(bytes.buffer);
  for (let i = 0; i < pcm.length; i++) view.setInt16(2 * i, pcm[i], true);
  return bytes;
}
