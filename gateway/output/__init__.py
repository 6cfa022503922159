"""Output: OpenAI-shaped frames, the SSE stream and the result poll."""
