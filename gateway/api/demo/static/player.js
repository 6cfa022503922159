// Gapless playback of the answer's pcm16 deltas on an AudioContext: each delta
// is scheduled to start exactly where the previous one ends, so network jitter
// shows up as a later start, never as clicks or gaps inside the answer.

import { RATE, pcm16ToFloat } from "./pcm.js";

// Margin before the first delta of an answer starts, so the next can arrive in time.
const LEAD_SEC = 0.05;

export class Player {
  constructor(context) {
    this.context = context;
    this.next = 0; // context time at which the next delta starts
    this.sources = new Set();
    this.onidle = null; // called when everything scheduled has played
  }

  // Schedules one delta; returns when it starts, in performance.now() milliseconds.
  play(bytes) {
    const samples = pcm16ToFloat(bytes);
    if (samples.length === 0) return null;
    const buffer = this.context.createBuffer(1, samples.length, RATE); // the context resamples to its rate
    buffer.copyToChannel(samples, 0);
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.context.destination);
    const now = this.context.currentTime;
    const start = Math.max(this.next, now + LEAD_SEC);
    source.start(start);
    this.next = start + buffer.duration;
    this.sources.add(source);
    source.onended = () => {
      this.sources.delete(source);
      if (this.sources.size === 0 && this.onidle) this.onidle();
    };
    return performance.now() + (start - now) * 1000;
  }

  get playing() {
    return this.sources.size > 0;
  }

  // Barge-in: silence now, forget what was scheduled.
  stop() {
    for (const source of this.sources) {
      source.onended = null;
      source.stop();
    }
    this.sources.clear();
    this.next = 0;
  }
}
