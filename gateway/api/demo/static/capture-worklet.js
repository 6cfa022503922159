// The microphone's samples, off the audio thread: batches of ~20 ms (at the
// AudioContext's own rate) posted to the page, which resamples and sends them.
// Batching keeps the message rate near 50/s instead of one per 128-sample quantum.
class Capture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.batch = new Float32Array(Math.round(sampleRate * 0.02));
    this.filled = 0;
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (channel) {
      let offset = 0;
      while (offset < channel.length) {
        const take = Math.min(channel.length - offset, this.batch.length - this.filled);
        this.batch.set(channel.subarray(offset, offset + take), this.filled);
        this.filled += take;
        offset += take;
        if (this.filled === this.batch.length) {
          this.port.postMessage(this.batch.slice(0));
          this.filled = 0;
        }
      }
    }
    return true; // keep running while the page holds the node
  }
}

registerProcessor("capture", Capture);
