"""The OpenAI Realtime protocol over a WebSocket, on streaming-input sessions."""
